"""Client sides of the personalized methods, as hooks and phases on the one loop, plus FedCAC's critical masks.

* :class:`FedRep`  the local head is trained first (``head_epochs``, body frozen), then the body (head frozen);
                   the head never leaves the client (the ``fedper`` plug-in's local head, which ``fedrep`` implies).
* :class:`Ditto`   a personal model ``v`` kept on the client, trained with ``(lam/2)||v - w_global||²``, then the
                   global model trained as in FedAvg and uploaded.
* :class:`AmpClient` FedAMP's client: its own model persists across rounds and is trained with a proximal term
                   towards the personalized cloud model ``u_i`` the server sent; the own model is uploaded.
* :class:`CriticalMasks` FedCAC's upload: per parameter tensor, the top-``tau`` elements of ``|Δθ ⊙ θ|``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from fedskew.client.algorithms import proximal
from fedskew.client.batched_form import BatchedStep
from fedskew.client.local import LocalAlgorithm, LocalContext, Phase
from fedskew.protocol import MASK_PREFIX, Params

PERSONAL = "personal_model"  # client_state key of a client's own model (Ditto, FedAMP)


def is_head(name: str) -> bool:
    return name.startswith("head.")


@dataclass
class FedRep(LocalAlgorithm):
    """FedRep (Collins et al., ICML 2021): ``head_epochs`` on the head with the body frozen, then ``local_epochs``
    on the body with the head frozen. Default ``head_epochs = 10`` (the FedRep paper's head epochs)."""

    head_epochs: int = 10

    def phases(self, ctx: LocalContext) -> list[Phase]:
        return [
            Phase(self.head_epochs, name="head", trains=is_head),
            Phase(ctx.settings.epochs, name="body", trains=lambda n: not is_head(n)),
        ]

    def batched_step(self) -> BatchedStep:
        return BatchedStep()  # phases only: the engine gives each its schedule, optimizer and trained parameters


@dataclass
class Ditto(LocalAlgorithm):
    """Ditto (Li et al., ICML 2021): personal model ``v_k`` trained for ``personal_epochs`` (default: the local
    epochs) on ``CE + (lam/2)||v_k − w||²`` with ``w`` the received global model, kept on the client; then the global
    model trained with plain SGD and uploaded. Default ``lam = 0.1`` (FedSA/FedPake used 0.001)."""

    lam: float = 0.1
    personal_epochs: int | None = None

    def phases(self, ctx: LocalContext) -> list[Phase]:
        own = ctx.client_state.get(PERSONAL, ctx.received)
        epochs = self.personal_epochs or ctx.settings.epochs
        return [
            Phase(epochs, name="personal", start=own, keep=PERSONAL),
            Phase(ctx.settings.epochs, name="global", start=ctx.received),
        ]

    def loss(self, ctx: LocalContext, logits: Tensor, features: Tensor, y: Tensor, x: Tensor) -> Tensor:
        ce = F.cross_entropy(logits, y)
        if ctx.phase != "personal" or self.lam == 0:
            return ce
        return ce + proximal(ctx, ctx.received, self.lam)

    def batched_step(self) -> BatchedStep:
        return BatchedStep(prox_mu=lambda phase: float(self.lam) if phase == "personal" else 0.0)

    def personal_model(self, client_state: dict[str, Any]) -> Params | None:
        return client_state.get(PERSONAL)


@dataclass
class AmpClient(LocalAlgorithm):
    """FedAMP's client (Huang et al., AAAI 2021; as run in Fling): the client's own model persists and is trained on
    ``CE + (mu/2)||w − u_i||²`` with ``u_i`` the received cloud model; ``mu = λ/α_K`` (Fling's FedCAC-protocol
    config: λ = 1, α_K = 1e4, so ``mu = 1e-4``). In its first round a client starts from the received model."""

    mu: float = 1e-4

    def phases(self, ctx: LocalContext) -> list[Phase]:
        return [Phase(ctx.settings.epochs, start=ctx.client_state.get(PERSONAL), keep=PERSONAL)]

    def loss(self, ctx: LocalContext, logits: Tensor, features: Tensor, y: Tensor, x: Tensor) -> Tensor:
        ce = F.cross_entropy(logits, y)
        return ce if self.mu == 0 else ce + proximal(ctx, ctx.received, self.mu)

    def batched_step(self) -> BatchedStep:
        return BatchedStep(prox_mu=lambda phase: float(self.mu))

    def personal_model(self, client_state: dict[str, Any]) -> Params | None:
        return client_state.get(PERSONAL)


# ---- FedCAC: critical-parameter masks (spec 3.3 steps 2-3) --------------------------------------------------------


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
