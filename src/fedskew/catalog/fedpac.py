"""FedPAC (Xu, Tong, Huang, ICLR 2023), whole: feature alignment to global prototypes and classifier collaboration.

One round, client i (``z = body(x)``, ``c_y`` the global prototype of class ``y``)::

    statistics under the received model:  p_k = n_k / n,  μ_k = mean z of class k,
        h_i[k] = p_k μ_k,   V_i = (Σ_k p_k tr(Z_kᵀ Z_k / n_k) − Σ_k p_k² ‖μ_k‖²) / n       (uploaded)
    one epoch on the head (body frozen) on CE, then the local epochs on the body (head frozen) on
        CE + lam · MSE(z, c_y)                       (a class without a global prototype: no pull)
    local prototypes: the class means of z under the trained model, one pass            (uploaded)

Server: the body is averaged by sample count; the global prototypes are the unweighted mean over the participants
that hold each class (broadcast next round); each participant's head becomes ``Σ_j α_ij head_j`` with ``α_i`` the
solution of the quadratic program

    min_α αᵀ (diag(V) + D_i) α   s.t.  α ≥ 0, Σ α = 1,    D_i[j, l] = Σ_k ⟨h_i[k] − h_j[k], h_i[k] − h_l[k]⟩

(:func:`combination_weights`). The head travels to client i only (the global model's other entries are the averaged
body): its personalized model is the averaged body with its combined head.

Read against PFLlib's ``clientpac.py`` / ``serverpac.py`` (the official FedPAC code's port). As there: the statistics
use the received model in evaluation mode and ``V`` is divided by the sample count once more; a matrix that is not
positive semi-definite is rebuilt from its eigenpairs of eigenvalue ≥ 0.01; weights below 1e-3 are set to zero without
renormalizing; a client whose program still has no PSD matrix keeps its own head. Departure, named: the program is
solved by SciPy's SLSQP to 1e-12 rather than by cvxpy (the same problem; ``tests/test_pfl_fedpac.py`` checks it
against an exact active-set enumeration). ``lam = 1`` (PFLlib's default). ``head_lr``: the head epoch's own learning
rate (default: the run's, as PFLlib; the official code, JianXu95/FedPAC, trains the head at 0.1 and the body at the
run's lr 0.01 with momentum 0.5).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor

from fedskew.client.batched_form import BatchedStep, FrozenTermFn
from fedskew.client.kernels import is_head
from fedskew.client.local import LocalAlgorithm, LocalContext, Phase
from fedskew.client.prototypes import PROTO_COUNT, PROTO_MEAN, class_sums
from fedskew.protocol import Params, RoundInput, ServerContext
from fedskew.registry import ClientPart, NoParams, ServerPlugin
from fedskew.schema import StrictSettings
from fedskew.server.api import ServerHalf, ServerOutput, Weighting
from fedskew.server.combine import WeightedMean
from fedskew.server.personal import PersonalState
from fedskew.space import LogFloat

PAC_V = "fedpac/v"  # upload: [1] the client's feature variance term V_i
PAC_H = "fedpac/h"  # upload: [C, D] h_i[k] = p_k μ_k
PAC_PROTOS = "fedpac/protos"  # broadcast: [C, D] global prototypes
PAC_PRESENT = "fedpac/present"  # broadcast: [C] 1 where a class has a global prototype


# ---- client ----------------------------------------------------------------------------------------------------------
@torch.no_grad()
def eval_features(ctx: LocalContext) -> Tensor:
    """The body's features of the client's training samples, in evaluation mode, in batches of the run's size."""
    assert ctx.x is not None
    model, bs = ctx.model, ctx.settings.batch_size
    was_training = model.training
    model.eval()
    try:
        return torch.cat([model.body(ctx.x[i : i + bs]) for i in range(0, ctx.x.shape[0], bs)])
    finally:
        model.train(was_training)


def feature_statistics(z: Tensor, y: Tensor, num_classes: int) -> tuple[Tensor, Tensor]:
    """FedPAC's ``(V, h)`` from features ``z`` ``[n, D]`` and labels: ``h[k] = p_k μ_k``, ``V = (Σ_k p_k tr(Z_kᵀZ_k /
    n_k) − Σ_k p_k² ‖μ_k‖²) / n`` (float64)."""
    z = z.to(torch.float64)
    n = z.shape[0]
    sums, counts = class_sums(z, y, num_classes)
    p = counts / n
    mu = sums / counts.clamp_min(1).unsqueeze(1)
    sq = torch.zeros(num_classes, dtype=torch.float64, device=z.device).index_add_(0, y, (z * z).sum(1))
    present = counts > 0
    v = (p[present] * sq[present] / counts[present]).sum() - (p[present] ** 2 * (mu[present] ** 2).sum(1)).sum()
    return (v / n).reshape(1), p.unsqueeze(1) * mu


@dataclass
class PacRound:
    """What :meth:`FedPAC.begin` prepares: the statistics to upload and the global prototypes (``None``: none yet)."""

    v: Tensor
    h: Tensor
    protos: Tensor | None
    present: Tensor | None


@dataclass
class FedPAC(LocalAlgorithm):
    """FedPAC's client (module docstring)."""

    lam: float = 1.0
    head_epochs: int = 1
    head_lr: float | None = None

    def begin(self, ctx: LocalContext) -> None:
        assert ctx.y is not None
        z = eval_features(ctx)
        with torch.no_grad():
            classes = ctx.model.head(z[:1]).shape[1]
        v, h = feature_statistics(z, ctx.y, classes)
        protos, present = ctx.broadcast.get(PAC_PROTOS), ctx.broadcast.get(PAC_PRESENT)
        ctx.prepared = PacRound(v, h, protos, present)

    def phases(self, ctx: LocalContext) -> list[Phase]:
        return [
            Phase(self.head_epochs, name="head", trains=is_head, lr=self.head_lr),
            Phase(ctx.settings.epochs, name="body", trains=lambda n: not is_head(n)),
        ]

    def loss(self, ctx: LocalContext, logits: Tensor, features: Tensor, y: Tensor, x: Tensor) -> Tensor:
        ce = F.cross_entropy(logits, y)
        r = ctx.prep(PacRound)
        if ctx.phase != "body" or r.protos is None or r.present is None or self.lam == 0:
            return ce
        has = r.present[y].bool().unsqueeze(1)
        target = torch.where(has, r.protos[y].to(features.dtype), features.detach())
        return ce + self.lam * F.mse_loss(features, target)

    def end(self, ctx: LocalContext) -> Params:
        assert ctx.y is not None
        r = ctx.prep(PacRound)
        sums, counts = class_sums(eval_features(ctx), ctx.y, r.h.shape[0])
        means = sums / counts.clamp_min(1).unsqueeze(1)
        return {
            PAC_V: r.v.to(torch.float32),
            PAC_H: r.h.to(torch.float32),
            PROTO_MEAN: means.to(torch.float32),
            PROTO_COUNT: counts.to(torch.float32),
        }

    def batched_step(self) -> BatchedStep:
        lam = float(self.lam)

        def term(ctx: LocalContext) -> FrozenTermFn | None:
            """``loss``'s term per sample in the body phase (the engine takes each client's batch mean): ``lam ·``
            the MSE between each feature and its class's global prototype (the feature itself where the class has
            none); none in the head phase and before the first global prototypes (broadcast: the same for every
            client of the round; a new function each round). The statistics (begin) and the prototypes (end) run per
            client."""
            r = ctx.prep(PacRound)
            if ctx.phase != "body" or r.protos is None or r.present is None or lam == 0:
                return None
            protos, present = r.protos, r.present.bool()

            def alignment(feats: Tensor, logits: Tensor, y: Tensor, outs: dict[str, tuple[Tensor, Tensor]]) -> Tensor:
                target = torch.where(present[y].unsqueeze(-1), protos[y].to(feats.dtype), feats.detach())
                return lam * ((feats - target) ** 2).mean(dim=2)

            return alignment

        return BatchedStep(term=term, term_per_sample=True)


# ---- server ----------------------------------------------------------------------------------------------------------
def global_prototypes(means: Tensor, counts: Tensor) -> tuple[Tensor, Tensor]:
    """Per class, the unweighted mean of the participants' local prototypes over those holding the class (PFLlib's
    ``proto_aggregation``), and its presence ``[C]``."""
    holds = (counts > 0).to(torch.float64)  # [K, C]
    n = holds.sum(0)
    protos = (holds.unsqueeze(2) * means.to(torch.float64)).sum(0) / n.clamp_min(1).unsqueeze(1)
    return protos.to(means.dtype), (n > 0).to(means.dtype)


class PacState(NamedTuple):
    """The global prototypes and their presence (``None`` before the first round)."""

    protos: Tensor | None
    present: Tensor | None


@dataclass(frozen=True)
class PacServer(ServerHalf):
    """FedPAC's server half: the global prototypes of the round's uploads, broadcast the next round."""

    def init(self, ctx: ServerContext) -> PacState:
        return PacState(None, None)

    def broadcast(self, state: PacState) -> Params:
        if state.protos is None or state.present is None:
            return {}
        return {PAC_PROTOS: state.protos, PAC_PRESENT: state.present}

    def advance(self, rin: RoundInput, state: PacState) -> PacState:
        if rin.num_participants == 0:
            return state
        return PacState(*global_prototypes(rin.extras[PROTO_MEAN], rin.extras[PROTO_COUNT]))


def program_matrix(v: Tensor, h: Tensor, i: int) -> np.ndarray:
    """``diag(V) + D_i`` with ``D_i[j, l] = Σ_k ⟨h_i[k] − h_j[k], h_i[k] − h_l[k]⟩`` (float64), ``h`` ``[K, C, D]``."""
    diff = (h[i].unsqueeze(0) - h).reshape(h.shape[0], -1).to(torch.float64)  # [K, C·D]
    return (torch.diag(v.reshape(-1).to(torch.float64)) + diff @ diff.T).cpu().numpy()


def psd_or_repaired(p: np.ndarray) -> np.ndarray | None:
    """``p`` if positive semi-definite, else rebuilt from its eigenpairs of eigenvalue ≥ 0.01 (PFLlib's repair);
    ``None`` if that is not PSD either."""
    if np.all(np.linalg.eigvalsh(p) >= 0):
        return p
    evals, evecs = np.linalg.eigh(p)
    keep = evals >= 0.01
    repaired = (evecs[:, keep] * evals[keep]) @ evecs[:, keep].T
    return repaired if np.all(np.linalg.eigvalsh(repaired) >= -1e-12) else None


def simplex_qp(p: np.ndarray) -> np.ndarray:
    """``argmin_α αᵀ p α`` over the probability simplex (``p`` PSD), by SLSQP from the uniform point."""
    from scipy.optimize import minimize

    k = p.shape[0]
    if k == 1:
        return np.ones(1)
    res = minimize(
        lambda a: float(a @ p @ a),
        np.full(k, 1.0 / k),
        jac=lambda a: 2 * p @ a,
        bounds=[(0.0, 1.0)] * k,
        constraints=[{"type": "eq", "fun": lambda a: a.sum() - 1.0, "jac": lambda a: np.ones_like(a)}],
        method="SLSQP",
        options={"ftol": 1e-12, "maxiter": 1000},
    )
    return np.clip(res.x, 0.0, None)


def simplex_qp_exact(p: np.ndarray) -> np.ndarray:
    """The same program solved exactly by enumerating active sets (small ``K`` only: the check of
    :func:`simplex_qp`): on each support, the equality-constrained optimum from its KKT system."""
    k = p.shape[0]
    best, best_val = None, np.inf
    for size in range(1, k + 1):
        for support in itertools.combinations(range(k), size):
            s = list(support)
            kkt = np.zeros((size + 1, size + 1))
            kkt[:size, :size] = 2 * p[np.ix_(s, s)]
            kkt[:size, size] = kkt[size, :size] = 1.0
            rhs = np.zeros(size + 1)
            rhs[size] = 1.0
            sol = np.linalg.lstsq(kkt, rhs, rcond=None)[0]
            if np.any(sol[:size] < -1e-12):
                continue
            a = np.zeros(k)
            a[s] = sol[:size]
            val = a @ p @ a
            if val < best_val - 1e-15:
                best, best_val = a, val
    assert best is not None
    return best


def combination_weights(v: Tensor, h: Tensor, eps: float = 1e-3) -> list[np.ndarray | None]:
    """Per participant i, FedPAC's head weights ``α_i`` over the participants (weights below ``eps`` zeroed, as PFLlib;
    ``None``: no PSD program, the client keeps its own head)."""
    out: list[np.ndarray | None] = []
    for i in range(h.shape[0]):
        p = psd_or_repaired(program_matrix(v, h, i))
        if p is None:
            out.append(None)
            continue
        a = simplex_qp(p)
        out.append(np.where(a > eps, a, 0.0))
    return out


@dataclass(frozen=True)
class PacHeads:
    """FedPAC's server step: the sample-weighted mean for the global model (the averaged body), and each
    participant's head combined by :func:`combination_weights`, sent to it in place of the global head."""

    weighting: Weighting

    def init(self, ctx: ServerContext) -> PersonalState:
        return PersonalState(self.weighting.init(ctx))

    def aggregate(self, rin: RoundInput, state: PersonalState) -> tuple[ServerOutput, PersonalState]:
        weights, wstate = self.weighting(rin, None, state.weighting)
        wbar, _, _ = WeightedMean()(rin, weights, None, None)
        alphas = combination_weights(rin.extras[PAC_V], rin.extras[PAC_H])
        heads = [n for n in rin.params if is_head(n)]
        personal: dict[int, Params] = {}
        for k, cid in enumerate(rin.cids):
            a = alphas[k]
            if a is None:
                personal[cid] = {n: rin.params[n][k].clone() for n in heads}
                continue
            coef = torch.as_tensor(a, dtype=torch.float64)
            personal[cid] = {
                n: torch.tensordot(coef.to(rin.params[n].device), rin.params[n].to(torch.float64), dims=1).to(
                    rin.params[n].dtype
                )
                for n in heads
            }
        kept = [a for a in alphas if a is not None]
        diagnostics = {
            "weights": weights.tolist(),
            "pac_own_head_weight_mean": float(np.mean([a[k] for k, a in enumerate(alphas) if a is not None]))
            if kept
            else 0.0,
            "pac_programs_without_psd": len(alphas) - len(kept),
        }
        return ServerOutput(wbar, personal, diagnostics), PersonalState(wstate)


# ---- registration ----------------------------------------------------------------------------------------------------
class FedPACParams(StrictSettings):
    lam: float = Field(1.0, ge=0)  # the feature alignment's weight (PFLlib: -lam 1)
    head_epochs: int = Field(1, ge=1)  # epochs on the head before the body (PFLlib: one pass)
    head_lr: float | None = Field(None, gt=0)  # the head epoch's lr (None: the run's, as PFLlib; official code: 0.1)


CLIENTS: dict[str, ClientPart] = {
    "fedpac": ClientPart(
        "fedpac",
        "head epoch then body epochs with lam*MSE to the global prototypes (lam=1); each head combined by a QP over "
        "the participants' feature statistics (implies pac)",
        "Xu, Tong, Huang, Personalized Federated Learning with Feature Alignment and Classifier Collaboration, "
        "ICLR 2023",
        FedPACParams,
        lambda p: FedPAC(lam=p.lam, head_epochs=p.head_epochs, head_lr=p.head_lr),
        server_half=lambda p: PacServer(),
        implies=("pac",),
        personalized=True,
        tunable={"lam": LogFloat(0.01, 10.0)},
    ),
}
SERVER_PLUGINS: dict[str, ServerPlugin] = {
    "pac": ServerPlugin(
        "pac",
        "FedPAC's classifier collaboration: the body averaged, each participant's head the QP-weighted combination",
        "Xu, Tong, Huang, Personalized Federated Learning with Feature Alignment and Classifier Collaboration, "
        "ICLR 2023",
        NoParams,
        ("personalize",),
        lambda p: {"personalize": lambda w: PacHeads(weighting=w)},
        clients=("fedpac",),
    ),
}
