"""Per-FedAvg (Fallah, Mokhtari, Ozdaglar, NeurIPS 2020): MAML's objective federated, one adaptation step personal.

Each local step splits its batch into independent parts (``D``, ``D'``; Hessian-free: ``D''`` too) and moves the
model along the gradient of the loss after one inner step::

    w'  = w − α ∇f(w; D)                                         (inner step, α = ``alpha``, default the run's lr)
    fo: d = ∇f(w'; D')
    hf: d = ∇f(w'; D') − α [∇f(w + δu; D'') − ∇f(w − δu; D'')] / (2δ),  u = ∇f(w'; D')
    w  <- w − β d                                                (the run's optimizer: β is the run's lr)

Uploads are averaged by sample count. The personalized model is the model the client holds after one step
``w − α ∇f(w; B)`` on a batch ``B`` of its training data (``adapt_batch`` samples, default the size of an inner
part), drawn from the (seed, client, round) stream; with ``adapt_steps`` more steps for a longer adaptation.

Read against the paper's Algorithm 1 and PFLlib's ``clientperavg.py`` (first-order only; its ``PerAvgOptimizer`` with
``α = β =`` the learning rate; a loader of batches ``2B`` split in halves). Departures, named: a part of a batch of
``n`` is ``⌈n/parts⌉`` samples, and a last batch too small to split reuses its first part; PFLlib's ``train()`` is
called twice per round in its server loop (a doubling of local epochs that fedskew does not copy: set
``--local-epochs`` to match); the hf variant uses the paper's central difference with ``delta`` (default 1e-3)
rather than an exact Hessian-vector product.

Batched (``--batched-clients``): the meta-gradient is the batched form's
:class:`~fedskew.client.batched_form.InnerStep`, each pass on the stacked rows; models of standard layers only, not
at captured shapes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor

from fedskew.client.batched_form import BatchedStep, InnerStep, split_batch
from fedskew.client.kernels import forward_with, trainable
from fedskew.client.local import LocalAlgorithm, LocalContext, PersonalContext, snapshot
from fedskew.protocol import Params
from fedskew.registry import ClientPart, ServerPlugin
from fedskew.schema import StrictSettings
from fedskew.space import LogFloat


def grads(loss: Tensor, params: list[Tensor], create_graph: bool = False) -> list[Tensor]:
    return list(torch.autograd.grad(loss, params, create_graph=create_graph))


@dataclass
class PerFedAvg(LocalAlgorithm):
    """Per-FedAvg's client (module docstring)."""

    variant: Literal["fo", "hf"] = "fo"
    alpha: float | None = None
    delta: float = 1e-3
    adapt_batch: int | None = None
    adapt_steps: int = 1

    @property
    def parts(self) -> int:
        return 2 if self.variant == "fo" else 3

    def inner_lr(self, lr: float) -> float:
        return lr if self.alpha is None else self.alpha

    def direction(self, ctx: LocalContext, logits: Tensor, y: Tensor, x: Tensor) -> tuple[dict[str, Tensor], Tensor]:
        """The meta-gradient ``d`` per trainable tensor, and the loss after the inner step (reported)."""
        named = trainable(ctx.model)
        names, params = [n for n, _ in named], [p for _, p in named]
        a = self.inner_lr(ctx.settings.lr)
        cuts = split_batch(y.shape[0], self.parts)
        g1 = grads(F.cross_entropy(logits[cuts[0]], y[cuts[0]]), params)
        adapted = {n: p.detach() - a * g for n, p, g in zip(names, params, g1, strict=True)}
        leaves = {n: t.requires_grad_(True) for n, t in adapted.items()}
        outer = F.cross_entropy(forward_with(ctx.model, leaves, x[cuts[1]]), y[cuts[1]])
        u = grads(outer, list(leaves.values()))
        d = dict(zip(names, u, strict=True))
        if self.variant == "hf":
            x3, y3 = x[cuts[2]], y[cuts[2]]
            plus = {n: p.detach() + self.delta * d[n] for n, p in named}
            minus = {n: p.detach() - self.delta * d[n] for n, p in named}
            gp = self._grad_at(ctx, plus, x3, y3)
            gm = self._grad_at(ctx, minus, x3, y3)
            d = {n: d[n] - a * (gp[n] - gm[n]) / (2 * self.delta) for n in names}
        return d, outer.detach()

    @staticmethod
    def _grad_at(ctx: LocalContext, point: Params, x: Tensor, y: Tensor) -> dict[str, Tensor]:
        leaves = {n: t.requires_grad_(True) for n, t in point.items()}
        loss = F.cross_entropy(forward_with(ctx.model, leaves, x), y)
        return dict(zip(leaves, grads(loss, list(leaves.values())), strict=True))

    def loss(self, ctx: LocalContext, logits: Tensor, features: Tensor, y: Tensor, x: Tensor) -> Tensor:
        d, reported = self.direction(ctx, logits, y, x)
        # a surrogate whose gradient in w is d and whose value is the loss after the inner step
        surrogate = torch.stack([(p * d[n]).sum() for n, p in trainable(ctx.model)]).sum()
        return reported + surrogate - surrogate.detach()

    def personalize(self, ctx: PersonalContext) -> Params | None:
        model, s = ctx.model, ctx.settings
        model.load_state_dict(ctx.base)
        model.train()
        n = ctx.x.shape[0]
        size = min(self.adapt_batch or math.ceil(s.batch_size / self.parts), n)
        a = self.inner_lr(s.lr)
        for _ in range(self.adapt_steps):
            idx = torch.randperm(n, generator=ctx.generator)[:size].to(ctx.x.device)
            named = trainable(model)
            loss = F.cross_entropy(model(ctx.x[idx]), ctx.y[idx])
            with torch.no_grad():
                for (_, p), g in zip(named, grads(loss, [p for _, p in named]), strict=True):
                    p.sub_(g, alpha=a)
        return snapshot(model)

    def batched_step(self) -> BatchedStep:
        return BatchedStep(inner=InnerStep(self.parts, self.alpha, self.variant == "hf", float(self.delta)))


# ---- registration ----------------------------------------------------------------------------------------------------
class PerFedAvgParams(StrictSettings):
    variant: Literal["fo", "hf"] = "fo"  # fo: first-order (PFLlib's); hf: Hessian-free (central difference)
    alpha: float | None = Field(None, gt=0)  # inner step size (None: the run's lr, as PFLlib)
    delta: float = Field(1e-3, gt=0)  # hf: the central difference's step
    adapt_batch: int | None = Field(None, ge=1)  # samples of the adaptation step (None: one inner part)
    adapt_steps: int = Field(1, ge=1)  # adaptation steps of the personalized model (the paper: one)


CLIENTS: dict[str, ClientPart] = {
    "perfedavg": ClientPart(
        "perfedavg",
        "MAML objective: each step moves w along the gradient after one inner step (variant=fo; hf: Hessian-free); "
        "personal model = one step from the global model on a local batch",
        "Fallah, Mokhtari, Ozdaglar, Personalized Federated Learning with Theoretical Guarantees: A Model-Agnostic "
        "Meta-Learning Approach, NeurIPS 2020",
        PerFedAvgParams,
        lambda p: PerFedAvg(p.variant, p.alpha, p.delta, p.adapt_batch, p.adapt_steps),
        personalized=True,
        tunable={"alpha": LogFloat(1e-3, 0.1)},  # the paper: alpha in {0.001, 0.01}; PFLlib: the learning rate
    ),
}
SERVER_PLUGINS: dict[str, ServerPlugin] = {}
