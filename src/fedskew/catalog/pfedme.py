"""pFedMe (T. Dinh, Tran, Nguyen, NeurIPS 2020): personalized models as Moreau envelopes of the local losses.

Client k keeps a personalized model ``θ_k`` beside the local copy ``w`` of the global model. For each batch ``D``,
``θ`` approximately solves ``min_θ f(θ; D) + (λ/2)‖θ − w‖²`` by ``K`` gradient steps at ``personal_lr``, then ``w``
moves towards it::

    repeat K:  θ <- θ − personal_lr (∇f(θ; D) + λ (θ − w) + mu θ)
    w <- w − η λ (w − θ)                                   (the run's optimizer at lr η; uploaded)

and the server takes ``w_{t+1} = (1 − β) w_t + β · mean(uploads)``: β is the server learning rate of ``+fedavgm``
with ``server_momentum=0`` (``pfedme+fedavgm -m server_momentum=0 -m server_lr=2``; ``pfedme`` alone is β = 1). The
personalized model is ``θ`` after the client's latest training (kept on the client), with ``w``'s buffers.
Defaults are the paper's (MNIST): ``lam = 15``, ``K = 5``, ``personal_lr = 0.01``, ``mu = 0``.

Read against the paper's Algorithm 1 and PFLlib's ``clientpFedMe.py`` / ``pFedMeOptimizer``: the same inner rule, the
same ``w`` step, ``θ`` continuing from batch to batch within a round and starting from the received model each round,
uploads averaged by sample count. PFLlib's personalized evaluation reads ``θ`` through the model's own parameter
objects, which its next ``set_parameters`` has overwritten with the global model; fedskew evaluates ``θ`` (the paper's
personalized model). The run's momentum and weight decay apply to ``w``'s step; ``θ``'s steps are plain.

Batched (``--batched-clients``): ``θ`` and its inner steps are each client's
:class:`~fedskew.client.batched_form.Envelope`, every inner step a pass on the stacked rows; models of standard
layers only, not at captured shapes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor

from fedskew.client.batched_form import BatchedStep, Envelope
from fedskew.client.kernels import PERSONAL, forward_with, trainable
from fedskew.client.local import LocalAlgorithm, LocalContext, snapshot
from fedskew.protocol import Params
from fedskew.registry import ClientPart, ServerPlugin
from fedskew.schema import StrictSettings
from fedskew.space import Int, LogFloat


@dataclass
class MeRound:
    """What :meth:`PFedMe.begin` prepares: ``θ`` (trainable tensors), continued from batch to batch."""

    theta: Params


@dataclass
class PFedMe(LocalAlgorithm):
    """pFedMe's client (module docstring)."""

    state_keys = (PERSONAL,)
    lam: float = 15.0
    inner_steps: int = 5
    personal_lr: float = 0.01
    mu: float = 0.0

    def begin(self, ctx: LocalContext) -> None:
        ctx.prepared = MeRound({n: p.detach().clone() for n, p in trainable(ctx.model)})

    def solve(self, theta: Params, w: Params, ctx: LocalContext, x: Tensor, y: Tensor) -> tuple[Params, Tensor]:
        """``K`` steps on ``f(θ; D) + (λ/2)‖θ − w‖² + (mu/2)‖θ‖²`` from ``theta``; the new ``θ`` and its last loss."""
        loss = torch.zeros(())
        for _ in range(self.inner_steps):
            leaves = {n: t.detach().requires_grad_(True) for n, t in theta.items()}
            loss = F.cross_entropy(forward_with(ctx.model, leaves, x), y)
            g = torch.autograd.grad(loss, list(leaves.values()))
            with torch.no_grad():
                theta = {
                    n: t - self.personal_lr * (gi + self.lam * (t - w[n]) + self.mu * t)
                    for (n, t), gi in zip(leaves.items(), g, strict=True)
                }
        return theta, loss.detach()

    def loss(self, ctx: LocalContext, logits: Tensor, features: Tensor, y: Tensor, x: Tensor) -> Tensor:
        r = ctx.prep(MeRound)
        named = trainable(ctx.model)
        w = {n: p.detach() for n, p in named}
        r.theta, personal_loss = self.solve(r.theta, w, ctx, x, y)
        # gradient in w: λ (w − θ); value: θ's loss on the batch (reported)
        pull = 0.5 * self.lam * torch.stack([((p - r.theta[n]) ** 2).sum() for n, p in named]).sum()
        return personal_loss + pull - pull.detach()

    def end(self, ctx: LocalContext) -> Params:
        theta = ctx.prep(MeRound).theta
        model = snapshot(ctx.model)
        ctx.keep(PERSONAL, {n: theta[n].clone() if n in theta else t for n, t in model.items()})
        return {}

    def personal_model(self, client_state: dict[str, Any]) -> Params | None:
        return PERSONAL.get(client_state)

    def batched_step(self) -> BatchedStep:
        """``θ`` and its inner steps as each client's :class:`~fedskew.client.batched_form.Envelope`."""

        def envelope(ctx: LocalContext) -> Envelope:
            return Envelope(ctx.prep(MeRound).theta, self.lam, self.inner_steps, self.personal_lr, self.mu)

        return BatchedStep(envelope=envelope)


# ---- registration ----------------------------------------------------------------------------------------------------
class PFedMeParams(StrictSettings):
    lam: float = Field(15.0, gt=0)  # the Moreau envelope's lambda (the paper, MNIST: 15)
    inner_steps: int = Field(5, ge=1)  # K (the paper: 5)
    personal_lr: float = Field(0.01, gt=0)  # the inner solver's step (the paper, MNIST: 0.01)
    mu: float = Field(0.0, ge=0)  # L2 on theta in the inner problem (PFLlib's mu; the paper: none)


CLIENTS: dict[str, ClientPart] = {
    "pfedme": ClientPart(
        "pfedme",
        "personal theta solves f(theta) + (lam/2)||theta - w||^2 by K steps per batch (lam=15, K=5), w moves to "
        "theta; beta via +fedavgm server_lr with server_momentum=0",
        "T. Dinh, Tran, Nguyen, Personalized Federated Learning with Moreau Envelopes, NeurIPS 2020",
        PFedMeParams,
        lambda p: PFedMe(lam=p.lam, inner_steps=p.inner_steps, personal_lr=p.personal_lr, mu=p.mu),
        personalized=True,
        tunable={"lam": LogFloat(0.1, 30.0), "personal_lr": LogFloat(1e-3, 0.1), "inner_steps": Int(1, 10)},
    ),
}
SERVER_PLUGINS: dict[str, ServerPlugin] = {}
