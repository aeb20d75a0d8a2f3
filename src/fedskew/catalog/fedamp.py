"""FedAMP (Huang, Chu, Zhou, Wang, Liu, Pei, Zhang, AAAI 2021), whole: attentive message passing, as Fling runs it
under the FedCAC protocol.

One round::

    client i:  its own model persists; it trains on CE + (mu/2)·||w − u_i||² towards the cloud model u_i it was sent
               (in its first round it starts from u_i), and uploads its own model
    server:    D_ij = ||w_i − w_j||²; ξ_ij = α_K·e^{−D_ij/σ}/σ (j ≠ i), ξ_ii = 1 − Σ_{j≠i} ξ_ij;
               u_i = Σ_j ξ_ij w_j, sent to client i; α_K decays by decay_rate every decay_every rounds

The client part (``fedamp``) implies the server plug-in (``amp``). ``mu = λ/α_K`` (Fling's config: λ = 1,
α_K = 1e4, so ``mu = 1e-4``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor

from fedskew.client.batched_form import BatchedStep
from fedskew.client.kernels import PERSONAL, proximal
from fedskew.client.local import LocalAlgorithm, LocalContext, Phase
from fedskew.protocol import Params, RoundInput, ServerContext
from fedskew.registry import ClientPart, ServerPlugin
from fedskew.schema import StrictSettings
from fedskew.server.api import ServerOutput, Weighting
from fedskew.server.combine import WeightedMean, column_blocks
from fedskew.server.personal import PersonalState, mix, personal_models
from fedskew.space import LogFloat


# ---- client ----------------------------------------------------------------------------------------------------------
@dataclass
class AmpClient(LocalAlgorithm):
    """FedAMP's client (Huang et al., AAAI 2021; as run in Fling): the client's own model persists and is trained on
    ``CE + (mu/2)||w − u_i||²`` with ``u_i`` the received cloud model; ``mu = λ/α_K`` (Fling's FedCAC-protocol
    config: λ = 1, α_K = 1e4, so ``mu = 1e-4``). In its first round a client starts from the received model."""

    state_keys = (PERSONAL,)
    mu: float = 1e-4

    def phases(self, ctx: LocalContext) -> list[Phase]:
        return [Phase(ctx.settings.epochs, start=ctx.kept(PERSONAL), keep=PERSONAL)]

    def loss(self, ctx: LocalContext, logits: Tensor, features: Tensor, y: Tensor, x: Tensor) -> Tensor:
        ce = F.cross_entropy(logits, y)
        return ce if self.mu == 0 else ce + proximal(ctx, ctx.received, self.mu)

    def batched_step(self) -> BatchedStep:
        return BatchedStep(prox_mu=lambda phase: float(self.mu))

    def personal_model(self, client_state: dict[str, Any]) -> Params | None:
        return PERSONAL.get(client_state)


# ---- server ----------------------------------------------------------------------------------------------------------
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
        new = {  # written where the round's uploads are (RAM or disk)
            n: mix(xi, t, out=rin.empty(f"amp:{n}", tuple(t.shape), t.dtype, t.device))
            for n, t in rin.params.items()
            if n in rin.trainable
        }
        diagnostics = {
            "weights": weights.tolist(),
            "amp_alpha_k": alpha,
            "amp_self_weight_min": float(xi.diagonal().min()),
            "amp_self_weight_mean": float(xi.diagonal().mean()),
            "amp_rows_rescaled": rescaled,
        }
        return ServerOutput(wbar, personal_models(rin, new), diagnostics), PersonalState(wstate)


# ---- registration ----------------------------------------------------------------------------------------------------
class AmpClientParams(StrictSettings):
    mu: float = Field(1e-4, ge=0)


class AmpParams(StrictSettings):
    alpha_k: float = Field(1e4, gt=0)
    sigma: float = Field(100.0, gt=0)
    decay_rate: float = Field(0.1, gt=0, le=1)
    decay_every: int = Field(30, ge=1)


CLIENTS: dict[str, ClientPart] = {
    "fedamp": ClientPart(
        "fedamp",
        "own model kept and trained with (mu/2)||w - u_i||^2 to its cloud model (mu=1e-4; implies amp)",
        "Huang et al., Personalized Cross-Silo Federated Learning on Non-IID Data, AAAI 2021",
        AmpClientParams,
        lambda p: AmpClient(mu=p.mu),
        implies=("amp",),
        personalized=True,
        tunable={"mu": LogFloat(1e-5, 1e-2)},
    ),
}
SERVER_PLUGINS: dict[str, ServerPlugin] = {
    "amp": ServerPlugin(
        "amp",
        "FedAMP's attentive message passing: cloud model per client (alpha_k=1e4, sigma=100, decay 0.1/30 rounds)",
        "Huang et al., Personalized Cross-Silo Federated Learning on Non-IID Data, AAAI 2021",
        AmpParams,
        ("personalize",),
        lambda p: {"personalize": lambda w: FedAMP(weighting=w, **p.model_dump())},
    ),
}
