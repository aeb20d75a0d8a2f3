"""Personalized server steps: one model per participant (FedCAC, FedAMP).

Both are :class:`fedskew.server.api.ServerStrategy` objects built from small pure functions over the participants'
uploads stacked as ``[K, ...]`` tensors. The global model (what a newcomer would get, and the ``global_`` views) is
the weighted mean of the uploads under the composition's weighting (``weights=samples`` by default, ``uniform`` for
the papers' plain mean). Buffers (BatchNorm running statistics) stay each client's own: the server copies every
participant's uploaded buffers into its personalized model. Absent clients keep the model they have.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor

from fedskew.protocol import MASK_PREFIX, Params, RoundInput, ServerContext, State
from fedskew.server.api import ServerOutput, Weighting
from fedskew.server.combine import WeightedMean, column_blocks

COLLAB_TOL = 1e-12  # spec 7: exact ties with the threshold collaborate


def mix(a: Tensor, stacked: Tensor) -> Tensor:
    """Row-mixing of client values: ``out[i] = Σ_j a[i, j] · stacked[j]`` in float64 (block by block of columns,
    no ``K × M`` float64 copy), cast back."""
    k = stacked.shape[0]
    flat = stacked.reshape(k, -1)
    a64 = a.to(device=flat.device, dtype=torch.float64)
    out = torch.empty_like(flat)
    for cols in column_blocks(k, flat.shape[1], flat.device):
        out[:, cols] = a64 @ flat[:, cols].to(torch.float64)
    return out.reshape(stacked.shape)


def personal_models(rin: RoundInput, trainable_values: Params) -> dict[int, Params]:
    """Per participant: the given ``[K, ...]`` values for trainable tensors, its own upload for buffers. Each row is
    a copy, so a client's model does not keep the round's ``[K, ...]`` tensors (and uploads) alive."""
    out: dict[int, Params] = {}
    for k, cid in enumerate(rin.cids):
        out[cid] = {
            n: (trainable_values[n][k] if n in trainable_values else t[k]).clone() for n, t in rin.params.items()
        }
    return out


# ---- FedCAC (spec 3.3 steps 4-9) ---------------------------------------------------------------------------------


def overlap_matrix(masks: list[Tensor]) -> Tensor:
    """``O_ij = 1 − ||m_i − m_j||_1 / (2||m_i||_1)`` over the concatenation of every tensor's ``[K, ...]`` mask (the
    official formula; the paper's prints a mismatch ratio). A client with an empty mask gets ``O_ij = 0``. The
    diagonal is 1 and is never used."""
    k = masks[0].shape[0]
    gram = torch.zeros(k, k, dtype=torch.float64)
    for m in masks:
        flat = m.reshape(k, -1).to(torch.float64)
        gram += flat @ flat.T
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
        c[empty] = False
    return c


def customized_mixing(collab: Tensor) -> Tensor:
    """FedCAC Eq. 10 as a mixing matrix: row i is uniform over ``C_i ∪ {i}``."""
    a = collab.to(torch.float64) + torch.eye(collab.shape[0], dtype=torch.float64)
    return a / a.sum(1, keepdim=True)


class PersonalState(NamedTuple):
    """A personalized server's state: its weighting's (for the global model it also computes)."""

    weighting: State = None


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
        for n in names:
            u = mix(a, rin.params[n])
            m = masks[n]
            new[n] = torch.where(m, u, wbar[n].unsqueeze(0).expand_as(u))
        critical = sum(int(m.sum()) for m in masks.values()) / sum(m.numel() for m in masks.values())
        diagnostics.update(
            {
                "cac_threshold": thr,
                "cac_collaborators_mean": float(collab.sum(1).double().mean()),
                "cac_critical_frac": critical,
            }
        )
        return ServerOutput(wbar, personal_models(rin, new), diagnostics), PersonalState(wstate)


# ---- FedAMP ------------------------------------------------------------------------------------------------------


def squared_distances(rin: RoundInput) -> Tensor:
    """``D_ij = ||w_i − w_j||²`` over all trainable tensors, float64 ``[K, K]``."""
    k = rin.num_participants
    d = torch.zeros(k, k, dtype=torch.float64)
    for n, t in rin.params.items():
        if n in rin.trainable:
            flat = t.reshape(k, -1)
            for cols in column_blocks(k, flat.shape[1], flat.device):
                block = flat[:, cols].to(torch.float64)
                d += torch.cdist(block, block).pow(2).cpu()
    return d


def amp_mixing(d: Tensor, alpha_k: float, sigma: float) -> tuple[Tensor, int]:
    """FedAMP's message passing: ``ξ_ij = α_K · e^{−D_ij/σ}/σ`` for ``j ≠ i`` (α_K times the derivative of the
    attention-inducing function ``1 − e^{−x/σ}``), ``ξ_ii = 1 − Σ_{j≠i} ξ_ij``.

    The paper requires ``ξ_ii ≥ 0`` (``u_i`` a convex combination); the literal formula breaks it when models are
    closer than about ``σ·ln(α_K (K−1)/σ)``. Such rows are rescaled so that ``Σ_{j≠i} ξ_ij = 1`` and ``ξ_ii = 0``.
    Returns the matrix and the number of rescaled rows."""
    xi = alpha_k * torch.exp(-d / sigma) / sigma
    xi.fill_diagonal_(0.0)
    others = xi.sum(1, keepdim=True)
    over = others > 1
    xi = torch.where(over, xi / others, xi)
    xi += torch.diag(1 - xi.sum(1)).clamp_min(0.0)
    return xi, int(over.sum())


@dataclass(frozen=True)
class FedAMP:
    """FedAMP's server (Huang et al., AAAI 2021; Fling's implementation): cloud model ``u_i = Σ_j ξ_ij w_j`` for every
    participant. ``α_K`` decays by ``decay_rate`` every ``decay_every`` rounds: ``α_K^t = α_K · r^{⌊(t−1)/every⌋}``.
    Defaults: Fling's FedCAC-protocol config (α_K = 1e4, σ = 100, decay 0.1 every 30 rounds)."""

    weighting: Weighting
    alpha_k: float = 1e4
    sigma: float = 100.0
    decay_rate: float = 0.1
    decay_every: int = 30

    def init(self, ctx: ServerContext) -> PersonalState:
        return PersonalState(self.weighting.init(ctx))

    def aggregate(self, rin: RoundInput, state: PersonalState) -> tuple[ServerOutput, PersonalState]:
        weights, wstate = self.weighting(rin, None, state.weighting)
        wbar, _, _ = WeightedMean()(rin, weights, None, None)
        alpha = self.alpha_k * self.decay_rate ** ((rin.round - 1) // self.decay_every)
        xi, rescaled = amp_mixing(squared_distances(rin), alpha, self.sigma)
        new = {n: mix(xi, t) for n, t in rin.params.items() if n in rin.trainable}
        diagnostics = {
            "weights": weights.tolist(),
            "amp_alpha_k": alpha,
            "amp_self_weight_min": float(xi.diagonal().min()),
            "amp_self_weight_mean": float(xi.diagonal().mean()),
            "amp_rows_rescaled": rescaled,
        }
        return ServerOutput(wbar, personal_models(rin, new), diagnostics), PersonalState(wstate)
