"""FedNTD (Lee, Jeong, Shin, Bae, Yun, NeurIPS 2022), a FedSA/FedPake baseline: cross-entropy + ``beta`` ·
not-true-class distillation from the received global model (PFLlib's ``clientntd.py``).

PFLlib (TsingZ0/PFLlib) is the reference for every default, because the FedSA/FedPake experiments ran there (spec
§1.1); the differences are listed in ``docs/methods.md``.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor, nn

from fedskew.client.batched_form import BatchedStep, FrozenTermFn
from fedskew.client.local import LocalAlgorithm, LocalContext
from fedskew.registry import NO_GLOBAL_MODEL, ClientPart, ServerPlugin
from fedskew.schema import StrictSettings


def not_true_logits(logits: Tensor, y: Tensor) -> Tensor:
    """``[B, C]`` logits without each row's true-class column (``[B, C-1]``, the other classes in their order)."""
    keep = torch.ones_like(logits, dtype=torch.bool).scatter_(1, y.view(-1, 1), False)
    return logits[keep].view(logits.shape[0], logits.shape[1] - 1)


def ntd_loss(logits: Tensor, global_logits: Tensor, y: Tensor, tau: float) -> Tensor:
    """FedNTD's not-true distillation (Lee et al. 2022, Eq. 5, with the ``tau²`` scale of the official criterion,
    Lee-Gihun/FedNTD ``algorithms/fedntd/criterion.py``, and of PFLlib's ``clientntd.py``):

    ``tau² · (1/B) Σ_i KL(q_i ‖ p_i)``, ``p_i = softmax(l̃_i/tau)``, ``q_i = softmax(g̃_i/tau)``, where ``l̃_i`` and
    ``g̃_i`` are the local and global model's logits with the true class ``y_i`` removed; ``q`` carries no gradient.
    """
    log_p = F.log_softmax(not_true_logits(logits, y) / tau, dim=1)
    with torch.no_grad():
        q = F.softmax(not_true_logits(global_logits, y) / tau, dim=1)
    return tau**2 * F.kl_div(log_p, q, reduction="batchmean")


def _frozen_copy(cache: dict[int, nn.Module], model: nn.Module) -> nn.Module:
    """A frozen copy of ``model``'s architecture in eval mode, made once per training model (a cache, not state)."""
    if id(model) not in cache:
        teacher = copy.deepcopy(model)
        teacher.eval()
        for q in teacher.parameters():
            q.requires_grad_(False)
        cache[id(model)] = teacher
    return cache[id(model)]


@dataclass
class FedNTD(LocalAlgorithm):
    """FedNTD (Lee et al., NeurIPS 2022): ``CE(l, y) + beta · ntd_loss(l, g, y, tau)`` with ``g`` the logits of the
    received global model (frozen, eval mode) on the same batch. Defaults ``tau = 1``, ``beta = 1`` (the official
    FedNTD config; PFLlib's ``-tau`` default is 1 too, its shared ``-bt`` default 0 would switch the term off).
    ``beta = 0`` is exactly plain local SGD (the global model is not even evaluated)."""

    beta: float = 1.0
    tau: float = 1.0
    name: str = "fedntd"
    _teachers: dict[int, nn.Module] = field(default_factory=dict, repr=False)

    def begin(self, ctx: LocalContext) -> None:
        if self.beta != 0:
            _frozen_copy(self._teachers, ctx.model).load_state_dict(ctx.received)

    def loss(self, ctx: LocalContext, logits: Tensor, features: Tensor, y: Tensor, x: Tensor) -> Tensor:
        ce = F.cross_entropy(logits, y)
        if self.beta == 0:
            return ce
        teacher = _frozen_copy(self._teachers, ctx.model)
        with torch.no_grad():
            global_logits = teacher.head(teacher.body(x))
        return ce + self.beta * ntd_loss(logits, global_logits, y, self.tau)

    def batched_step(self) -> BatchedStep:
        beta, tau = float(self.beta), float(self.tau)

        def term(ctx: LocalContext) -> FrozenTermFn | None:
            return None if beta == 0 else distillation_term(beta, tau)

        return BatchedStep(term=term, frozen=("received",), term_per_sample=True)


@functools.cache  # one function per (beta, tau): captured steps replay the same graphs every round
def distillation_term(beta: float, tau: float) -> FrozenTermFn:
    """``loss``'s not-true distillation per sample, ``beta · ntd_loss``'s summand with the received model's logits
    (the engine takes each client's batch mean, ``batchmean``'s)."""

    def distill(feats: Tensor, logits: Tensor, y: Tensor, outs: dict[str, tuple[Tensor, Tensor]]) -> Tensor:
        k, b, c = logits.shape
        flat_y = y.reshape(k * b)
        log_p = F.log_softmax(not_true_logits(logits.reshape(k * b, c), flat_y) / tau, dim=1)
        q = F.softmax(not_true_logits(outs["received"][1].reshape(k * b, c), flat_y) / tau, dim=1)
        return beta * tau**2 * F.kl_div(log_p, q, reduction="none").view(k, b, -1).sum(2)

    return distill


# ---- registration ----------------------------------------------------------------------------------------------------
class FedNTDParams(StrictSettings):
    beta: float = Field(1.0, ge=0)  # official FedNTD config (PFLlib's shared -bt default 0 disables the term)
    tau: float = Field(1.0, gt=0)  # official FedNTD config and PFLlib's -tau


CLIENTS: dict[str, ClientPart] = {
    "fedntd": ClientPart(
        "fedntd",
        "CE + beta * not-true-class distillation from the received global model (beta=1, tau=1)",
        "Lee, Jeong, Shin, Bae, Yun, Preservation of the Global Knowledge by Not-True Distillation in Federated "
        "Learning, NeurIPS 2022",
        FedNTDParams,
        lambda p: FedNTD(beta=p.beta, tau=p.tau),
        excludes=(NO_GLOBAL_MODEL,),
    ),
}
SERVER_PLUGINS: dict[str, ServerPlugin] = {}
