"""APFL (Deng, Kamani, Mahdavi, 2020): adaptive personalized FL, a per-client mixture of a local and the global model.

Client k keeps a personal model ``v_k`` and a mixing weight ``α_k``; the model it trains and uploads is the global
model ``w``. On each batch ``ξ``, with ``v̄ = α v + (1 − α) w``::

    w <- w − η ∇f(w; ξ)                                    (the run's optimizer; uploaded, averaged)
    v <- v − η ∇_v f(v̄; ξ) = v − η α ∇f(v̄; ξ)              (plain SGD; kept)
    α <- clip(α − η (⟨v − w, ∇f(v̄; ξ)⟩ + 0.02 α), 0, 1)     (adaptive=True; kept)

The personalized model is ``v̄ = α v + (1 − α) w`` with ``w`` the model the client holds: the global model after
aggregation (the ``personal`` view, the paper's output) or the one it has just trained (the ``trained`` view, what
PFLlib evaluates). Defaults: ``alpha = 0.5`` (initial α), ``adaptive = True``, ``alpha_l2 = 0.02``.

Read against the paper's Algorithm 1 and the official code (MLOPTPSU/FedTorch, ``alpha_update``), which PFLlib's
``clientapfl.py`` follows. Departures, named: fedskew steps ``v`` on the loss of the mixed model ``v̄`` and takes
``∇_α`` from the same backward pass (the paper's rule); the official code steps ``v`` on its own loss and estimates
``∇f(v̄)`` as ``α ∇f(v) + (1 − α) ∇f(w)``, and PFLlib then overwrites ``v`` with ``v̄`` after every round. The
``0.02 α`` term is the official code's (not in the paper): ``alpha_l2 = 0`` drops it. The mixed model uses ``w``'s
buffers (BatchNorm statistics); ``v`` holds trainable tensors only. ``v`` starts from the model the client receives at
its first participation (the paper: ``w⁰``, the same under full participation).

Batched (``--batched-clients``): ``v`` and ``α`` are each client's :class:`~fedskew.client.batched_form.Mixture`, the
mixed model's cross-entropy computed on the stacked rows beside the model's; models of standard layers only, not at
captured shapes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor

from fedskew.client.batched_form import BatchedStep, Mixture
from fedskew.client.kernels import forward_with, leaf_copy, sgd_leaves, trainable
from fedskew.client.local import LocalAlgorithm, LocalContext, PersonalContext, StateKey
from fedskew.protocol import Params
from fedskew.registry import ClientPart, ServerPlugin
from fedskew.schema import StrictSettings
from fedskew.space import Float

APFL_V = StateKey[Params]("apfl_v", "APFL: the client's personal model v (trainable tensors)")
APFL_ALPHA = StateKey[Params]("apfl_alpha", "APFL: the client's mixing weight alpha ({'alpha': 0-d float64})")
ALPHA = "alpha"


def mixed(v: Params, w: Params, alpha: Tensor) -> Params:
    """``α v + (1 − α) w`` over the entries of ``v``."""
    return {n: alpha * v[n] + (1 - alpha) * w[n] for n in v}


@dataclass
class ApflRound:
    """What :meth:`APFL.begin` prepares: ``v`` and ``α`` as leaves (their gradients come from each step's backward)."""

    v: Params
    alpha: Tensor


@dataclass
class APFL(LocalAlgorithm):
    """APFL's client (module docstring)."""

    state_keys = (APFL_V, APFL_ALPHA)
    alpha: float = 0.5
    adaptive: bool = True
    alpha_l2: float = 0.02

    def begin(self, ctx: LocalContext) -> None:
        names = [n for n, _ in trainable(ctx.model)]
        v = ctx.kept(APFL_V) or {n: ctx.received[n] for n in names}
        kept = ctx.kept(APFL_ALPHA)
        alpha = kept[ALPHA] if kept is not None else torch.tensor(self.alpha, dtype=torch.float64)
        dtype = ctx.received[names[0]].dtype
        ctx.prepared = ApflRound(leaf_copy(v), alpha.to(dtype).clone().requires_grad_(self.adaptive))

    def loss(self, ctx: LocalContext, logits: Tensor, features: Tensor, y: Tensor, x: Tensor) -> Tensor:
        r = ctx.prep(ApflRound)
        w = {n: p.detach() for n, p in trainable(ctx.model)}
        personal = forward_with(ctx.model, mixed(r.v, w, r.alpha), x)
        return F.cross_entropy(logits, y) + F.cross_entropy(personal, y)

    def after_step(self, ctx: LocalContext) -> None:
        r = ctx.prep(ApflRound)
        sgd_leaves(r.v, ctx.settings.lr)
        if self.adaptive and r.alpha.grad is not None:
            grad = r.alpha.grad + self.alpha_l2 * r.alpha
            r.alpha.sub_(grad, alpha=ctx.settings.lr).clamp_(0.0, 1.0)
            r.alpha.grad = None

    def end(self, ctx: LocalContext) -> Params:
        r = ctx.prep(ApflRound)
        ctx.keep(APFL_V, {n: t.detach().clone() for n, t in r.v.items()})
        ctx.keep(APFL_ALPHA, {ALPHA: r.alpha.detach().to(torch.float64).clone()})
        ctx.metrics["apfl_alpha"] = float(r.alpha.detach())
        return {}

    def personalize(self, ctx: PersonalContext) -> Params | None:
        v, kept = ctx.kept(APFL_V), ctx.kept(APFL_ALPHA)
        if v is None or kept is None:  # never trained: the model it holds
            return None
        alpha = kept[ALPHA]
        return {**ctx.base, **{n: t.to(ctx.base[n].dtype) for n, t in mixed(v, ctx.base, alpha).items()}}

    def batched_step(self) -> BatchedStep:
        """``v`` and ``α`` as each client's :class:`~fedskew.client.batched_form.Mixture`."""

        def mixture(ctx: LocalContext) -> Mixture:
            r = ctx.prep(ApflRound)
            return Mixture(r.v, r.alpha, self.adaptive, float(self.alpha_l2))

        return BatchedStep(mixture=mixture)


# ---- registration ----------------------------------------------------------------------------------------------------
class APFLParams(StrictSettings):
    alpha: float = Field(0.5, ge=0, le=1)  # the initial mixing weight (halfway; PFLlib's -al default is 1.0)
    adaptive: bool = True  # learn alpha by its gradient (the paper's adaptive APFL)
    alpha_l2: float = Field(0.02, ge=0)  # the official code's 0.02·alpha added to alpha's gradient (not in the paper)


CLIENTS: dict[str, ClientPart] = {
    "apfl": ClientPart(
        "apfl",
        "personal model v trained on the mixture alpha v + (1-alpha) w, alpha learned by its gradient (alpha=0.5); "
        "the global w trained and averaged",
        "Deng, Kamani, Mahdavi, Adaptive Personalized Federated Learning, arXiv 2003.13461, 2020",
        APFLParams,
        lambda p: APFL(alpha=p.alpha, adaptive=p.adaptive, alpha_l2=p.alpha_l2),
        personalized=True,
        tunable={"alpha": Float(0.0, 1.0)},  # the paper sweeps alpha in {0.25, 0.5, 0.75} (non-adaptive)
    ),
}
SERVER_PLUGINS: dict[str, ServerPlugin] = {}
