"""FedCAC (Wu, Sun, Chen, Gao, Zhou, NeurIPS 2023, "Bold but Cautious"), whole: critical-parameter masks and
time-varying collaborators, one model per client (spec 3.3).

One round::

    client i:  trains from its model; uploads it and, per trainable tensor, the mask M_i of its critical elements:
               the top tau of the sensitivity |(θ_E − θ_0) ⊙ θ_E| (Eqs. 5-6; ties at the threshold included)
    server:    overlap O_ij of the participants' masks; threshold Thr^t rising to O_max at round beta; i's
               collaborators: O_ij >= Thr^t (for t > beta nobody collaborates on critical parameters)
               u_i = uniform mean over i and its collaborators; w̄ = the weighted mean of all uploads
               i's next model: M_i ⊙ u_i + (1 − M_i) ⊙ w̄ per trainable tensor (buffers: its own)

The masks are an upload extra (:class:`CriticalMasks`), so any client part carries them: ``fedprox+fedcac`` is
FedProx's objective with FedCAC's masks and server. With partial participation, O, Thr, w̄ and u_i are computed over
the participants only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from pydantic import Field
from torch import Tensor

from fedskew.protocol import Params, RoundInput, ServerContext
from fedskew.registry import ClientPart, ServerPlugin
from fedskew.schema import StrictSettings
from fedskew.server.api import ServerOutput, Weighting
from fedskew.server.combine import WeightedMean, column_blocks
from fedskew.server.paging import release_pages
from fedskew.server.personal import PersonalState, mix, personal_models
from fedskew.space import Float, LogFloat

MASK_PREFIX = "cac_mask/"  # upload: the critical mask of trainable tensor n, named MASK_PREFIX + n
COLLAB_TOL = 1e-12  # spec 7: exact ties with the threshold collaborate
EXACT_FLOAT32 = 1 << 24  # integers up to this are exact in float32


# ---- client: critical-parameter masks (spec 3.3 steps 2-3) -----------------------------------------------------------
def sensitivity(start: Tensor, trained: Tensor) -> Tensor:
    """FedCAC Eq. 5: ``|(θ_E − θ_0) ⊙ θ_E|``, the first-order loss change of zeroing each parameter."""
    return ((trained - start) * trained).abs()


def critical_mask(s: Tensor, tau: float) -> Tensor:
    """FedCAC Eq. 6 with the official rules: ``k = floor(tau·n)`` (k = 0: nothing critical); the threshold is the
    k-th largest sensitivity (repeats counted); a threshold ≤ 1e-10 is replaced by the smallest entry > 1e-20 (if
    any); every element ``>= threshold`` is critical, so ties at the threshold are all included."""
    flat = s.flatten()
    k = int(math.floor(tau * flat.numel()))
    if k == 0:
        return torch.zeros_like(s, dtype=torch.bool)
    thr = torch.topk(flat, k).values[-1]
    if thr <= 1e-10:
        positive = flat[flat > 1e-20]
        if positive.numel():
            thr = positive.min()
    return s >= thr


@dataclass(frozen=True)
class CriticalMasks:
    """FedCAC's upload: one boolean mask per trainable tensor, sent as ``cac_mask/<name>`` (1 bit per element)."""

    tau: float = 0.5

    def __call__(self, received: Params, trained: Params, trainable: frozenset[str]) -> Params:
        return {
            f"{MASK_PREFIX}{n}": critical_mask(sensitivity(received[n].double(), trained[n].double()), self.tau)
            for n in trained
            if n in trainable
        }


# ---- server (spec 3.3 steps 4-9) -------------------------------------------------------------------------------------
def overlap_matrix(masks: list[Tensor]) -> Tensor:
    """``O_ij = 1 − ||m_i − m_j||_1 / (2||m_i||_1)`` over the concatenation of every tensor's ``[K, ...]`` mask (the
    official formula; the paper's prints a mismatch ratio). A client with an empty mask gets ``O_ij = 0``. The
    diagonal is 1 and is never used."""
    k = masks[0].shape[0]
    gram = torch.zeros(k, k, dtype=torch.float64)
    for m in masks:
        flat = m.reshape(k, -1)
        # no K × M copy of the masks; a block's counts are integers below 2^24, exact in float32 (half float64's cost)
        for cols in column_blocks(k, flat.shape[1], flat.device, max_columns=EXACT_FLOAT32):
            block = flat[:, cols].to(torch.float32)
            gram += (block @ block.T).to(device="cpu", dtype=torch.float64)
    count = gram.diagonal().clone()  # |m_i|
    mismatch = count[:, None] + count[None, :] - 2 * gram  # ||m_i - m_j||_1
    safe = torch.where(count > 0, count, torch.ones_like(count))
    o = 1 - mismatch / (2 * safe[:, None])
    return torch.where(count[:, None] > 0, o, torch.zeros_like(o))


def collaboration_threshold(o: Tensor, t: int, beta: float) -> float:
    """FedCAC Eq. 7: ``O_avg + (t/β)(O_max − O_avg)`` over the ordered pairs ``i ≠ j`` (t 1-based)."""
    k = o.shape[0]
    off = o[~torch.eye(k, dtype=torch.bool)]
    o_avg, o_max = float(off.mean()), float(off.max())
    return o_avg + (t / beta) * (o_max - o_avg)


def collaborators(o: Tensor, thr: float, masks: list[Tensor] | None = None) -> Tensor:
    """FedCAC Eq. 8: ``C_i = {j ≠ i : O_ij >= thr}`` as a ``[K, K]`` boolean matrix (tolerance 1e-12, spec 7).

    Given the ``[K, ...]`` masks the overlaps came from, a client whose mask is empty has ``C_i = ∅`` (spec 3.5: its
    ``O_ij`` is undefined, set to 0, which would otherwise pass a threshold of 0 when every mask is empty); it can
    still be another client's collaborator."""
    c = o >= thr - COLLAB_TOL
    c.fill_diagonal_(False)
    if masks is not None:
        k = o.shape[0]
        empty = torch.ones(k, dtype=torch.bool, device=c.device)
        for m in masks:
            empty &= ~m.reshape(k, -1).any(dim=1).to(c.device)
            release_pages()  # masks beside a disk stack: their pages back to the kernel
        c[empty] = False
    return c


def customized_mixing(collab: Tensor) -> Tensor:
    """FedCAC Eq. 10 as a mixing matrix: row i is uniform over ``C_i ∪ {i}``."""
    a = collab.to(torch.float64) + torch.eye(collab.shape[0], dtype=torch.float64)
    return a / a.sum(1, keepdim=True)


@dataclass(frozen=True)
class FedCAC:
    """FedCAC (Wu et al., NeurIPS 2023): each participant's next model is ``M_i ⊙ u_i + (1 − M_i) ⊙ w̄`` per trainable
    tensor, with ``M_i`` its uploaded critical mask, ``u_i`` the uniform mean over itself and its collaborators
    (critical-location overlap ``O_ij >= Thr^t``), and ``w̄`` the global model. ``t`` is the round (1-based); for
    ``t > beta`` nobody collaborates on critical parameters. With partial participation, O, Thr, w̄ and u_i are
    computed over the participants only."""

    weighting: Weighting
    beta: float = 100.0

    def init(self, ctx: ServerContext) -> PersonalState:
        return PersonalState(self.weighting.init(ctx))

    def aggregate(self, rin: RoundInput, state: PersonalState) -> tuple[ServerOutput, PersonalState]:
        names = [n for n in rin.params if n in rin.trainable]
        missing = [n for n in names if f"{MASK_PREFIX}{n}" not in rin.extras]
        if missing:
            raise ValueError(f"FedCAC needs every client's critical masks; missing for {missing[:3]}")
        masks = {n: rin.extras[f"{MASK_PREFIX}{n}"] for n in names}
        weights, wstate = self.weighting(rin, None, state.weighting)
        wbar, _, _ = WeightedMean()(rin, weights, None, None)
        diagnostics: dict[str, Any] = {"weights": weights.tolist()}
        if rin.num_participants == 1:
            collab = torch.zeros(1, 1, dtype=torch.bool)
            thr = float("nan")
        else:
            o = overlap_matrix(list(masks.values()))
            thr = collaboration_threshold(o, rin.round, self.beta)
            collab = collaborators(o, thr, list(masks.values()))
            off = o[~torch.eye(o.shape[0], dtype=torch.bool)]
            diagnostics.update({"cac_overlap_avg": float(off.mean()), "cac_overlap_max": float(off.max())})
        a = customized_mixing(collab)
        new: Params = {}
        for n in names:  # M_i ⊙ u_i + (1 − M_i) ⊙ w̄, written where the round's uploads are (RAM or disk)
            t = rin.params[n]
            out = rin.empty(f"cac:{n}", tuple(t.shape), t.dtype, t.device)
            new[n] = mix(a, t, out=out, keep=masks[n], otherwise=wbar[n])
        # count_nonzero: a bool tensor's sum() would first convert the K × M masks to int64
        critical = sum(int(torch.count_nonzero(m)) for m in masks.values()) / sum(m.numel() for m in masks.values())
        release_pages()
        diagnostics.update(
            {
                "cac_threshold": thr,
                "cac_collaborators_mean": float(collab.sum(1).double().mean()),
                "cac_critical_frac": critical,
            }
        )
        return ServerOutput(wbar, personal_models(rin, new), diagnostics), PersonalState(wstate)


# ---- registration ----------------------------------------------------------------------------------------------------
class CacParams(StrictSettings):
    tau: float = Field(0.5, ge=0, le=1)
    beta: float = Field(100.0, gt=0)


CLIENTS: dict[str, ClientPart] = {}
SERVER_PLUGINS: dict[str, ServerPlugin] = {
    "fedcac": ServerPlugin(
        "fedcac",
        "critical-parameter masks (tau=0.5) + time-varying collaborators (beta=100): one model per client",
        "Wu et al., Bold but Cautious: Unlocking the Potential of Personalized Federated Learning through "
        "Cautiously Aggressive Collaboration, NeurIPS 2023",
        CacParams,
        ("personalize",),
        lambda p: {
            "personalize": lambda w: FedCAC(weighting=w, beta=p.beta),
            "upload_extras": CriticalMasks(tau=p.tau),
        },
        tunable={"tau": Float(0.1, 0.9), "beta": LogFloat(10.0, 300.0)},  # FedCAC Figs. 5 and 6
    ),
}
