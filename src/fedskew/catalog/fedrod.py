"""FedRoD (Chen & Chao, ICLR 2022), whole: one body, a generic head for the federation, a personal head per client.

Each step on a batch ``(x, y)`` of client k, with ``z = body(x)``::

    generic   = BSM(head_g(z), y; n_k)            # balanced softmax: logits + log n_k[c] (the client's class counts)
    personal  = CE(head_g(z).detach() + head_p(z.detach()), y)
    body, head_g  <- the run's optimizer on ∇ generic     (uploaded and averaged by sample count)
    head_p        <- plain SGD at the run's lr on ∇ personal (kept on the client)

The client's personalized model predicts ``head_g(z) + head_p(z)``; with a linear head that is one linear layer of
weights ``W_g + W_p`` and bias ``b_g + b_p``, so fedskew evaluates it as a plain state dict (the generic model the
client holds, its personal head added: :meth:`FedRoD.personalize`). ``generic_loss="ce"`` trains the generic head
with plain cross-entropy (the paper's ablation, FedRoD without BSM).

Read against PFLlib's ``clientrod.py`` (the paper's linear-head variant): the same two losses, the same detachments,
the personal head stepped by its own plain SGD. Departures, named: the personal head starts from the generic head
the client receives at its first participation (PFLlib: a copy of the initial head, which is that head under full
participation); a client that has never trained is evaluated with the generic model (PFLlib adds its untrained
initial head, which leaves its predictions but not its loss unchanged). The run's momentum and weight decay apply to
the body and generic head only, as PFLlib's personal-head optimizer has neither.

Batched (``--batched-clients``): the personal head is each client's :class:`~fedskew.client.batched_form.SideHead`
(trained on its stacked rows beside the model), BSM the shift ``log n_k[c]`` of its logits
(:class:`~fedskew.client.batched_form.LogitMap`); models of standard layers only, not at captured shapes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from fedskew.client.batched_form import BatchedStep, LogitMap, SideHead
from fedskew.client.kernels import HEAD_BIAS, HEAD_WEIGHT, check_linear_head, leaf_copy, sgd_leaves
from fedskew.client.local import LocalAlgorithm, LocalContext, PersonalContext, StateKey
from fedskew.protocol import Params
from fedskew.registry import ClientPart, ServerPlugin
from fedskew.schema import StrictSettings

ROD_HEAD = StateKey[Params]("fedrod_head", "FedRoD: the client's personal head (head.weight, head.bias)")


def balanced_softmax_loss(logits: Tensor, y: Tensor, log_counts: Tensor) -> Tensor:
    """Balanced softmax (Ren et al., NeurIPS 2020): cross-entropy of ``logits + log n[c]``; a class the client never
    saw (``n[c] = 0``) gets ``−inf``, i.e. no probability and no gradient."""
    return F.cross_entropy(logits + log_counts.to(logits.dtype), y)


@dataclass
class RodRound:
    """What :meth:`FedRoD.begin` prepares: the personal head being trained (leaves) and ``log n_k[c]``."""

    head: Params
    log_counts: Tensor


@dataclass
class FedRoD(LocalAlgorithm):
    """FedRoD's client (module docstring): BSM on the generic head, CE of the summed logits on the personal head."""

    state_keys = (ROD_HEAD,)
    generic_loss: Literal["bsm", "ce"] = "bsm"

    def begin(self, ctx: LocalContext) -> None:
        head = ctx.kept(ROD_HEAD) or {n: ctx.received[n] for n in (HEAD_WEIGHT, HEAD_BIAS)}
        assert ctx.y is not None
        classes = ctx.received[HEAD_BIAS].shape[0]
        counts = torch.bincount(ctx.y, minlength=classes).to(torch.float64)
        ctx.prepared = RodRound(leaf_copy(head), counts.log())

    def loss(self, ctx: LocalContext, logits: Tensor, features: Tensor, y: Tensor, x: Tensor) -> Tensor:
        r = ctx.prep(RodRound)
        generic = (
            balanced_softmax_loss(logits, y, r.log_counts) if self.generic_loss == "bsm" else F.cross_entropy(logits, y)
        )
        summed = logits.detach() + F.linear(features.detach(), r.head[HEAD_WEIGHT], r.head[HEAD_BIAS])
        return generic + F.cross_entropy(summed, y)

    def after_step(self, ctx: LocalContext) -> None:
        sgd_leaves(ctx.prep(RodRound).head, ctx.settings.lr)

    def end(self, ctx: LocalContext) -> Params:
        ctx.keep(ROD_HEAD, {n: t.detach().clone() for n, t in ctx.prep(RodRound).head.items()})
        return {}

    def personalize(self, ctx: PersonalContext) -> Params | None:
        head = ctx.kept(ROD_HEAD)
        if head is None:  # never trained: the generic model (module docstring)
            return None
        return {**ctx.base, **{n: ctx.base[n] + head[n] for n in (HEAD_WEIGHT, HEAD_BIAS)}}

    def check_model(self, template: Params, trainable: frozenset[str]) -> None:
        check_linear_head(template, "FedRoD")

    def batched_step(self) -> BatchedStep:
        """The personal head as each client's side head; BSM as the shift ``log n_k[c]`` of its logits."""

        def personal(ctx: LocalContext) -> SideHead:
            head = ctx.prep(RodRound).head
            return SideHead(head[HEAD_WEIGHT], head[HEAD_BIAS])

        def balanced(ctx: LocalContext, num_classes: int) -> LogitMap:
            return LogitMap(None, ctx.prep(RodRound).log_counts)

        return BatchedStep(side_head=personal, logits=balanced if self.generic_loss == "bsm" else None)


# ---- registration ----------------------------------------------------------------------------------------------------
class FedRoDParams(StrictSettings):
    generic_loss: Literal["bsm", "ce"] = "bsm"  # bsm: the paper's; ce: its ablation without balanced softmax


CLIENTS: dict[str, ClientPart] = {
    "fedrod": ClientPart(
        "fedrod",
        "generic head trained with balanced softmax (averaged), personal head on the summed logits (kept); "
        "personal model = generic + personal head",
        "Chen, Chao, On Bridging Generic and Personalized Federated Learning for Image Classification, ICLR 2022",
        FedRoDParams,
        lambda p: FedRoD(generic_loss=p.generic_loss),
        personalized=True,
    ),
}
SERVER_PLUGINS: dict[str, ServerPlugin] = {}
