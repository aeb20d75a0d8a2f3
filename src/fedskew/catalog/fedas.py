"""FedAS (Yang, Huang, Ye, CVPR 2024), whole: parameter alignment and client synchronization.

Client i keeps its own model ``θ_i`` (body and head). When it is sampled::

    alignment      its class prototypes under its own body, p_c = mean body_i(x) over its samples of class c;
                   the received global body trained for ``align_epochs`` (SGD at ``align_lr``, batches of
                   ``align_batch``, a seeded order) on Σ_c MSE(body(x_c), p_c), the classes of each batch
    start          the aligned global body with the client's own head
    training       the local epochs on CE (uploaded; the result is the client's model, kept)
    Fisher trace   F_i = Σ_batches ‖∇ NLL(batch)‖² under the trained model (evaluation mode)    (sent, a scalar)

Server (``fisher``, implied): the global model is ``Σ_i F_i θ_i / Σ_i F_i`` over the participants (client
synchronization weighted by the trace of the empirical Fisher information). The personalized model is the
client's own model.

Read against PFLlib's ``clientas.py`` / ``serveras.py`` (the official FedAS code's port): the alignment's optimizer,
learning rate (0.01), batch (16) and single epoch as hard-coded there; the Fisher trace over the training batches of
the run's size (without the last partial batch under ``drop_last``, as PFLlib's loaders: a batch of a few samples
has an inflated squared gradient norm; docs/results.md measures the switch beside PFLlib). Departures, named:
clients that are not sampled do not compute a Fisher trace (PFLlib computes one for every client every round and
uses only the participants'); the alignment and the trace read the training tensors in a seeded order (PFLlib: its
shuffled loaders). A client that has never trained starts from the received model (``first_align=False``, the
default); PFLlib aligns it too, against the prototypes of its own model, which is then the initial model
(``first_align=True`` does so with the received model as its own: PFLlib's computation when the client's first
participation is the first round, as under full participation).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor, nn

from fedskew.client.batched_form import BatchedStep
from fedskew.client.kernels import PERSONAL, is_head
from fedskew.client.local import LocalAlgorithm, LocalContext, Phase, TrainSettings, snapshot
from fedskew.client.prototypes import class_sums
from fedskew.protocol import Params, RoundInput, State
from fedskew.registry import ClientPart, NoParams, ServerPlugin
from fedskew.schema import StrictSettings
from fedskew.server.api import Weighting
from fedskew.server.weights import normalize
from fedskew.space import LogFloat

FISHER_TRACE = "fedas_fisher_trace"  # the upload's metric: the trace of the client's empirical Fisher information


@torch.no_grad()
def body_prototypes(body: nn.Module, x: Tensor, y: Tensor, num_classes: int, batch: int) -> tuple[Tensor, Tensor]:
    """Per-class mean features of ``body`` over ``(x, y)`` (float64 ``[C, D]``) and the class counts ``[C]``."""
    feats = torch.cat([body(x[i : i + batch]) for i in range(0, x.shape[0], batch)])
    sums, counts = class_sums(feats, y, num_classes)
    return sums / counts.clamp_min(1).unsqueeze(1), counts


def align_body(
    model: nn.Module,
    protos: Tensor,
    counts: Tensor,
    x: Tensor,
    y: Tensor,
    lr: float,
    epochs: int,
    batch: int,
    generator: torch.Generator,
) -> None:
    """FedAS's parameter alignment, in place on ``model.body``: SGD on ``Σ_c MSE(body(x_c), p_c)`` over the classes of
    each batch that have a prototype."""
    params = [p for p in model.body.parameters() if p.requires_grad]
    if not params:
        return
    opt = torch.optim.SGD(params, lr=lr)
    n = x.shape[0]
    for _ in range(epochs):
        perm = torch.randperm(n, generator=generator).to(x.device)
        for b in range(math.ceil(n / batch)):
            idx = perm[b * batch : (b + 1) * batch]
            xb, yb = x[idx], y[idx]
            feats = model.body(xb)
            terms = [
                F.mse_loss(feats[yb == c], protos[c].to(feats.dtype).expand_as(feats[yb == c]))
                for c in yb.unique().tolist()
                if counts[c] > 0
            ]
            if not terms:
                continue
            opt.zero_grad()
            torch.stack(terms).sum().backward()
            opt.step()


def fisher_trace(model: nn.Module, x: Tensor, y: Tensor, batch: int, drop_last: bool = False) -> float:
    """``Σ_batches ‖∇ mean NLL(batch)‖²`` over every trainable parameter, in evaluation mode (PFLlib's estimate of
    the trace of the empirical Fisher information); ``drop_last``: without the last partial batch, as the run's
    training batches (PFLlib's loaders drop it)."""
    params = [p for p in model.parameters() if p.requires_grad]
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64)
    try:
        bs, nb = TrainSettings(epochs=1, batch_size=batch, lr=0.0, drop_last=drop_last).batches(x.shape[0])
        for b in range(nb):
            loss = F.cross_entropy(model(x[b * bs : (b + 1) * bs]), y[b * bs : (b + 1) * bs])
            for g in torch.autograd.grad(loss, params):
                total += (g.detach().to(torch.float64) ** 2).sum().cpu()
    finally:
        model.train(was_training)
    return float(total)


@dataclass
class AsRound:
    """What :meth:`FedAS.begin` prepares: the start of training, the aligned global body with the client's own head
    (``None``: the received model)."""

    start: Params | None


@dataclass
class FedAS(LocalAlgorithm):
    """FedAS's client (module docstring)."""

    state_keys = (PERSONAL,)
    align_lr: float = 0.01
    align_epochs: int = 1
    align_batch: int = 16
    first_align: bool = False

    def begin(self, ctx: LocalContext) -> None:
        own = ctx.kept(PERSONAL)
        if own is None and self.first_align:  # PFLlib: aligned against its own (the initial, here received) model
            own = dict(ctx.received)
        if own is None:  # never trained: the received model as it is
            ctx.prepared = AsRound(None)
            return
        assert ctx.x is not None and ctx.y is not None and ctx.generator is not None
        model = ctx.model
        classes = ctx.received[[n for n in ctx.received if is_head(n)][-1]].shape[0]
        model.load_state_dict(own)
        model.eval()  # the client's model as its last Fisher pass left it (PFLlib)
        protos, counts = body_prototypes(model.body, ctx.x, ctx.y, classes, self.align_batch)
        model.train()
        model.load_state_dict(ctx.received)
        schedule = (self.align_lr, self.align_epochs, self.align_batch, ctx.generator)
        align_body(model, protos, counts, ctx.x, ctx.y, *schedule)
        aligned = snapshot(model)
        ctx.prepared = AsRound({n: own[n] if is_head(n) else aligned[n] for n in aligned})

    def phases(self, ctx: LocalContext) -> list[Phase]:
        return [Phase(ctx.settings.epochs, start=ctx.prep(AsRound).start, keep=PERSONAL)]

    def end(self, ctx: LocalContext) -> Params:
        assert ctx.x is not None and ctx.y is not None
        ctx.metrics[FISHER_TRACE] = fisher_trace(
            ctx.model, ctx.x, ctx.y, ctx.settings.batch_size, drop_last=ctx.settings.drop_last
        )
        return {}

    def batched_step(self) -> BatchedStep:
        return BatchedStep()  # plain steps: the alignment (begin) and the Fisher pass (end) run per client

    def personal_model(self, client_state: dict[str, Any]) -> Params | None:
        return PERSONAL.get(client_state)


@dataclass(frozen=True)
class FisherWeights(Weighting):
    """FedAS's client synchronization: each participant's share of the round's Fisher traces."""

    def __call__(self, rin: RoundInput, masks: Params | None, state: State) -> tuple[Tensor, State]:
        if FISHER_TRACE not in rin.metrics:
            raise ValueError("the fisher weighting needs each upload's Fisher trace (the fedas client part sends it)")
        return normalize(rin.metrics[FISHER_TRACE].to(torch.float64)), state


# ---- registration ----------------------------------------------------------------------------------------------------
class FedASParams(StrictSettings):
    align_lr: float = Field(0.01, gt=0)  # the alignment's SGD step (PFLlib: 0.01, hard-coded)
    align_epochs: int = Field(1, ge=0)  # passes of the alignment (PFLlib: 1; 0 turns it off)
    align_batch: int = Field(16, ge=1)  # the alignment's batch (PFLlib: 16)
    first_align: bool = False  # align at the first participation too, against the received model's prototypes


CLIENTS: dict[str, ClientPart] = {
    "fedas": ClientPart(
        "fedas",
        "own model kept; the received body aligned to its class prototypes before training (align_lr=0.01), the "
        "Fisher trace sent (implies fisher)",
        "Yang, Huang, Ye, FedAS: Bridging Inconsistency in Personalized Federated Learning, CVPR 2024",
        FedASParams,
        lambda p: FedAS(
            align_lr=p.align_lr, align_epochs=p.align_epochs, align_batch=p.align_batch, first_align=p.first_align
        ),
        implies=("fisher",),
        personalized=True,
        tunable={"align_lr": LogFloat(1e-3, 0.1)},
    ),
}
SERVER_PLUGINS: dict[str, ServerPlugin] = {
    "fisher": ServerPlugin(
        "fisher",
        "FedAS's client synchronization: weights proportional to the participants' Fisher-information traces",
        "Yang, Huang, Ye, FedAS: Bridging Inconsistency in Personalized Federated Learning, CVPR 2024",
        NoParams,
        ("weighting",),
        lambda p: {"weighting": FisherWeights()},
        clients=("fedas",),
    ),
}
