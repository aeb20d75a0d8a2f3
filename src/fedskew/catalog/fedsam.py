"""FedSAM and MoFedSAM (Qu, Li, Duan, Liu, Tang, Lu, "Generalized Federated Learning via Sharpness Aware
Minimization", ICML 2022; FedSAM also Caldarola, Caputo, Ciccone, ECCV 2022): sharpness-aware local steps.

**FedSAM**: every local step is a SAM step (Foret et al.). The gradient ``g`` at ``w`` gives the ascent
``ε = ρ·g/(‖g‖ + 1e-12)`` (one norm over every trained parameter, as the SAM implementation both papers' code
uses); the gradient at ``w + ε`` is the one the optimizer steps with, from ``w``. The step's reported loss is the
loss at ``w``. Default ``ρ = 0.05`` (SAM's and FedSAM's CIFAR value), tuned over ``log[0.005, 0.5]``.

**MoFedSAM** (Qu et al.'s Algorithm 2, FedSAM with FedCM's client momentum): the client steps with
``v = α·g_SAM + (1 − α)·Δ``, where ``Δ`` is the server's last global update direction, broadcast by the server
half: the uniform mean over the last round's participants of ``(w_t − w_i)/(K_i·η_l)`` (the client delta per local
step and unit learning rate; the client divides the broadcast mean delta by the mean step count and its own learning
rate). ``Δ = 0`` before the first aggregation. The server step itself is FedAvg's (the paper's global learning rate
``η_g = K·η_l``, under which its update is the mean of the client models). Default ``α = 0.1`` (FedCM's and the
paper's), tuned over ``[0.05, 1]``.

Both are client parts (they compose with every server plug-in: ``fedsam+disco``, ``fedsam+fedadam``). Batched:
``BatchedStep.sam_rho`` makes every stacked step a SAM step (each client's own ascent from its rows' gradient norm,
the second pass on the same batch) and MoFedSAM's mix is a :class:`~fedskew.client.batched_form.Blend` of each
client's ``Δ``, so ``--batched-clients`` (and ``--capture-steps``) train the round's clients together.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor

from fedskew.client.batched_form import BatchedStep, Blend
from fedskew.client.local import LocalAlgorithm, LocalContext
from fedskew.protocol import STEPS, Params, RoundInput, ServerContext
from fedskew.registry import ClientPart, ServerPlugin
from fedskew.schema import StrictSettings
from fedskew.server.api import ServerHalf
from fedskew.space import Float, LogFloat

# what MoFedSAM's server half broadcasts: the mean client delta (one tensor per trainable entry n, named PREFIX + n)
# and the participants' mean number of local steps
MOFEDSAM_DELTA = "mofedsam_delta/"
MOFEDSAM_STEPS = "mofedsam/steps"


def _trained(ctx: LocalContext) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in ctx.model.named_parameters() if p.requires_grad]


@dataclass
class SamBatch:
    """What the SAM step needs of the batch its loss saw: the inputs and labels (set by ``loss``)."""

    x: Tensor | None = None
    y: Tensor | None = None
    # what every step of the round reads, listed once in ``begin``: the trained parameters and the BatchNorm layers
    params: list[torch.nn.Parameter] = field(default_factory=list)
    norms: list[torch.nn.modules.batchnorm._BatchNorm] = field(default_factory=list)


def _round_of(kind: type[SamBatch], ctx: LocalContext, **more: object) -> SamBatch:
    norms = [m for m in ctx.model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    return kind(params=[p for _, p in _trained(ctx)], norms=norms, **more)  # type: ignore[arg-type]


@dataclass
class MoSamRound(SamBatch):
    """MoFedSAM's: the batch, and the server's direction ``Δ`` per trained parameter, in ``params``' order (empty
    before the first round)."""

    direction: list[Tensor] = field(default_factory=list)


@dataclass
class FedSAM(LocalAlgorithm):
    """Local SAM steps on the cross-entropy (module docstring)."""

    rho: float = 0.05

    def begin(self, ctx: LocalContext) -> None:
        ctx.prepared = _round_of(SamBatch, ctx)

    def loss(self, ctx: LocalContext, logits: Tensor, features: Tensor, y: Tensor, x: Tensor) -> Tensor:
        batch = ctx.prep(SamBatch)
        batch.x, batch.y = x, y
        return F.cross_entropy(logits, y)

    def after_backward(self, ctx: LocalContext) -> None:
        """Replace the gradient at ``w`` by the gradient at ``w + ε`` (the parameters end where they were)."""
        sam_gradient(ctx, self.rho)

    def batched_step(self) -> BatchedStep:
        return BatchedStep(sam_rho=float(self.rho))


def sam_gradient(ctx: LocalContext, rho: float) -> None:
    """SAM's second pass on the batch ``loss`` saw: ``ε = ρ·g/(‖g‖ + 1e-12)``, the gradient at ``w + ε`` of the
    client's whole objective (``ctx.objective``: the cross-entropy, plus any term a plug-in added) into ``.grad``,
    ``w`` restored."""
    if rho == 0:
        return
    batch = ctx.prep(SamBatch)
    assert batch.x is not None and batch.y is not None
    params = [p for p in batch.params if p.grad is not None]
    grads = [p.grad for p in params]
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))  # type: ignore[arg-type]
    scale = rho / (norm + 1e-12)
    with torch.no_grad():
        eps = [g * scale for g in grads]  # type: ignore[operator]
        torch._foreach_add_(params, eps)
    for p in params:
        p.grad = None
    model = ctx.model
    with _frozen_statistics(batch.norms):  # the second pass must not move BatchNorm's running statistics again
        with ctx.settings.autocast(batch.x.device):  # in the first pass's arithmetic (precision)
            feats = model.body(batch.x)
            logits = model.head(feats)
            # the whole objective at w + ε, a term a plug-in added included (fedsam+feddecorr), as the batched step
            if ctx.objective is not None:
                loss = ctx.objective(ctx, logits, feats, batch.y, batch.x)
            else:
                loss = F.cross_entropy(logits, batch.y)
        loss.backward()
    with torch.no_grad():
        torch._foreach_sub_(params, eps)


@contextmanager
def _frozen_statistics(norms: list[torch.nn.modules.batchnorm._BatchNorm]) -> Iterator[None]:
    """The BatchNorm layers ``norms`` normalize by the batch as usual but leave their running statistics (and
    counters) as they were (SAM's reference implementation's ``disable_running_stats``)."""
    saved = [(m.momentum, None if m.num_batches_tracked is None else m.num_batches_tracked.clone()) for m in norms]
    for m in norms:
        m.momentum = 0.0
    try:
        yield
    finally:
        for m, (momentum, tracked) in zip(norms, saved, strict=True):
            m.momentum = momentum
            if tracked is not None:
                m.num_batches_tracked.copy_(tracked)


@dataclass
class MoFedSAM(FedSAM):
    """SAM steps moved by ``α·g_SAM + (1 − α)·Δ`` (module docstring)."""

    alpha: float = 0.1

    def begin(self, ctx: LocalContext) -> None:
        steps = float(ctx.broadcast[MOFEDSAM_STEPS]) if MOFEDSAM_STEPS in ctx.broadcast else 0.0
        scale = 1.0 / (steps * ctx.settings.lr) if steps > 0 else 0.0
        direction = [ctx.broadcast[f"{MOFEDSAM_DELTA}{n}"] * scale for n, _ in _trained(ctx)] if scale else []
        ctx.prepared = _round_of(MoSamRound, ctx, direction=direction)

    def after_backward(self, ctx: LocalContext) -> None:
        sam_gradient(ctx, self.rho)
        prep = ctx.prep(MoSamRound)
        with torch.no_grad():
            for k, p in enumerate(prep.params):
                if p.grad is None:
                    continue
                p.grad.mul_(self.alpha)
                if prep.direction:
                    p.grad.add_(prep.direction[k], alpha=1.0 - self.alpha)

    def batched_step(self) -> BatchedStep:
        def blend(ctx: LocalContext) -> Blend:
            direction = ctx.prep(MoSamRound).direction
            return Blend(float(self.alpha), direction or None)

        return BatchedStep(sam_rho=float(self.rho), blend=blend)


class MomentumDirection(NamedTuple):
    """MoFedSAM's server half state: the last round's mean client delta per trainable entry, and its mean steps."""

    delta: Params
    steps: float


@dataclass(frozen=True)
class MoFedSAMServer(ServerHalf):
    """Broadcasts the last round's uniform mean client delta ``mean_i(w_t − w_i)`` and mean local steps; zeros (and
    0 steps: no direction) before the first round."""

    def init(self, ctx: ServerContext) -> MomentumDirection:
        trained = [n for n in ctx.template if n in ctx.trainable]  # the model's order, whatever the hash seed
        return MomentumDirection({n: torch.zeros_like(ctx.template[n]) for n in trained}, 0.0)

    def broadcast(self, state: MomentumDirection) -> Params:
        out = {f"{MOFEDSAM_DELTA}{n}": t for n, t in state.delta.items()}
        out[MOFEDSAM_STEPS] = torch.tensor(state.steps, dtype=torch.float64)
        return out

    def advance(self, rin: RoundInput, state: MomentumDirection) -> MomentumDirection:
        delta = {n: (rin.global_params[n] - rin.params[n].to(rin.global_params[n].dtype)).mean(0) for n in state.delta}
        return MomentumDirection(delta, float(rin.metrics[STEPS].mean()))


# ---- registration ----------------------------------------------------------------------------------------------------
class FedSAMParams(StrictSettings):
    rho: float = Field(0.05, ge=0)  # the SAM neighbourhood's radius (0: plain local SGD)


class MoFedSAMParams(FedSAMParams):
    alpha: float = Field(0.1, gt=0, le=1)  # the SAM gradient's share of the step (1: FedSAM)


PAPER = (
    "Qu, Li, Duan, Liu, Tang, Lu, Generalized Federated Learning via Sharpness Aware Minimization, ICML 2022; "
    "Caldarola, Caputo, Ciccone, Improving Generalization in Federated Learning by Seeking Flat Minima, ECCV 2022"
)
CLIENTS: dict[str, ClientPart] = {
    "fedsam": ClientPart(
        "fedsam",
        "sharpness-aware local steps: the gradient at w + rho g/|g| (rho=0.05)",
        PAPER,
        FedSAMParams,
        lambda p: FedSAM(rho=p.rho),
        tunable={"rho": LogFloat(0.005, 0.5)},
    ),
    "mofedsam": ClientPart(
        "mofedsam",
        "SAM local steps moved by alpha g_SAM + (1-alpha) D, D the server's last mean update per step (alpha=0.1)",
        PAPER,
        MoFedSAMParams,
        lambda p: MoFedSAM(rho=p.rho, alpha=p.alpha),
        server_half=lambda p: MoFedSAMServer(),
        tunable={"rho": LogFloat(0.005, 0.5), "alpha": Float(0.05, 1.0)},
    ),
}
SERVER_PLUGINS: dict[str, ServerPlugin] = {}
