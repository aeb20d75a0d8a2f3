"""FedDBE (Zhang et al., NeurIPS 2023), whole: the domain bias eliminator on FedAvg.

Two pieces act on the representation ``z = body(x)`` of client k:

* **PRBM**, a personalized representation bias ``z̄_k`` (a vector of the feature width, kept on the client, trained
  with plain SGD at the run's lr): the head reads ``z + z̄_k``;
* **MR**, mean regularization: a running mean of the batch means of ``z``, ``r ← (1 − m)·r + m·mean(z)`` (``m`` =
  ``mean_momentum``; reset every round; gradient through the current batch only), pulled to the global mean ``ḡ``::

      loss = CE(head(z + z̄_k), y) + kappa · mean(½ (r − ḡ)²)

``ḡ`` is computed once: in the first round every client trains plainly (``CE(head(z), y)``, no PRBM, no MR) and
uploads its running mean, and the server keeps the sample-weighted mean of those (:class:`DbeServer`); from the second
round on it is broadcast. The body and head are averaged by sample count as in FedAvg. The personalized model is the
client's model with ``z̄_k`` folded into the head's bias (``b + W z̄_k``, exact for a linear head).

Read against the official code (TsingZ0/DBE ``clientDBE.py`` / ``serverDBE.py``, identical in PFLlib). Defaults
are the official script's (``run_me.sh``: ``-mo 1 -klw 50``, i.e. ``mean_momentum = 1``, ``kappa = 50``; PFLlib's
``main.py`` defaults are 0.1 and 0). Departure, named: the official server computes ``ḡ`` in an initialization
period before round 1, from every client's running mean after one discarded local training; fedskew's first round is
that training, kept as a round, and ``ḡ`` averages the first round's participants (all of them under full
participation, the official setting).

Batched (``--batched-clients``): PRBM and MR are each client's :class:`~fedskew.client.batched_form.Representation`
on its stacked rows (the bias trained beside the model, the running mean carried across steps); models of standard
layers only, not at captured shapes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor

from fedskew.client.batched_form import BatchedStep, Representation
from fedskew.client.kernels import HEAD_BIAS, HEAD_WEIGHT, check_linear_head, leaf_copy, sgd_leaves
from fedskew.client.local import LocalAlgorithm, LocalContext, PersonalContext, StateKey
from fedskew.protocol import Params, RoundInput, ServerContext
from fedskew.registry import ClientPart, ServerPlugin
from fedskew.schema import StrictSettings
from fedskew.server.api import ServerHalf
from fedskew.space import Float, LogFloat

DBE_BIAS = StateKey[Params]("feddbe_bias", "FedDBE: the client's personalized representation bias (PRBM)")
RUNNING_MEAN = "feddbe_running_mean"  # upload extra (first round): the client's running mean of representations
GLOBAL_MEAN = "feddbe_global_mean"  # broadcast from the second round: the global mean ḡ
BIAS = "bias"


@dataclass
class DbeRound:
    """What :meth:`FedDBE.begin` prepares: the PRBM being trained, the running mean, ``ḡ`` (``None``: first round)."""

    bias: Params
    running: Tensor
    global_mean: Tensor | None


@dataclass
class FedDBE(LocalAlgorithm):
    """FedDBE's client (module docstring): PRBM added to the representation, MR towards the global mean."""

    state_keys = (DBE_BIAS,)
    kappa: float = 50.0
    mean_momentum: float = 1.0

    def begin(self, ctx: LocalContext) -> None:
        w = ctx.received[HEAD_WEIGHT]
        bias = ctx.kept(DBE_BIAS) or {BIAS: w.new_zeros(w.shape[1])}  # on the model's device (a GPU run's too)
        running = torch.zeros_like(bias[BIAS])
        ctx.prepared = DbeRound(leaf_copy(bias), running, ctx.broadcast.get(GLOBAL_MEAN))

    def loss(self, ctx: LocalContext, logits: Tensor, features: Tensor, y: Tensor, x: Tensor) -> Tensor:
        r = ctx.prep(DbeRound)
        r.running = (1 - self.mean_momentum) * r.running.detach() + self.mean_momentum * features.mean(0)
        if r.global_mean is None:  # the first round: plain training, the running mean for ḡ
            return F.cross_entropy(logits, y)
        out = ctx.model.head(features + r.bias[BIAS])
        regularizer = (0.5 * (r.running - r.global_mean) ** 2).mean()
        return F.cross_entropy(out, y) + self.kappa * regularizer

    def after_step(self, ctx: LocalContext) -> None:
        sgd_leaves(ctx.prep(DbeRound).bias, ctx.settings.lr)

    def end(self, ctx: LocalContext) -> Params:
        r = ctx.prep(DbeRound)
        ctx.keep(DBE_BIAS, {BIAS: r.bias[BIAS].detach().clone()})
        return {RUNNING_MEAN: r.running.detach().clone()} if r.global_mean is None else {}

    def personalize(self, ctx: PersonalContext) -> Params | None:
        kept = ctx.kept(DBE_BIAS)
        if kept is None:
            return None
        w, b = ctx.base[HEAD_WEIGHT], ctx.base[HEAD_BIAS]
        return {**ctx.base, HEAD_BIAS: b + w @ kept[BIAS].to(w.dtype)}

    def check_model(self, template: Params, trainable: frozenset[str]) -> None:
        check_linear_head(template, "FedDBE")

    def batched_step(self) -> BatchedStep:
        """PRBM and MR as each client's :class:`~fedskew.client.batched_form.Representation` (the first round: the
        running mean only, for ḡ)."""

        def pieces(ctx: LocalContext) -> Representation:
            r = ctx.prep(DbeRound)
            first = r.global_mean is None
            bias = None if first else r.bias[BIAS]
            return Representation(bias, r.running, float(self.mean_momentum), r.global_mean, float(self.kappa))

        return BatchedStep(representation=pieces)


# ---- server half -----------------------------------------------------------------------------------------------------
class DbeState(NamedTuple):
    """The global mean of representations ``ḡ`` (``None`` until the first round's uploads)."""

    global_mean: Tensor | None


@dataclass(frozen=True)
class DbeServer(ServerHalf):
    """FedDBE's server half: ``ḡ = Σ_k n_k r_k / Σ_k n_k`` over the first round's uploads, then broadcast unchanged."""

    def init(self, ctx: ServerContext) -> DbeState:
        return DbeState(None)

    def broadcast(self, state: DbeState) -> Params:
        return {} if state.global_mean is None else {GLOBAL_MEAN: state.global_mean}

    def advance(self, rin: RoundInput, state: DbeState) -> DbeState:
        if state.global_mean is not None or RUNNING_MEAN not in rin.extras:
            return state
        means = rin.extras[RUNNING_MEAN].to(torch.float64)
        w = rin.num_samples.to(device=means.device, dtype=torch.float64)
        mean = (w[:, None] * means).sum(0) / w.sum()
        return DbeState(mean.to(rin.extras[RUNNING_MEAN].dtype))


# ---- registration ----------------------------------------------------------------------------------------------------
class FedDBEParams(StrictSettings):
    kappa: float = Field(50.0, ge=0)  # MR weight (official run_me.sh: -klw 50)
    mean_momentum: float = Field(1.0, gt=0, le=1)  # the running mean's momentum (official run_me.sh: -mo 1)


CLIENTS: dict[str, ClientPart] = {
    "feddbe": ClientPart(
        "feddbe",
        "personalized representation bias added to the features (kept) and mean regularization of the running "
        "feature mean to the first round's global mean (kappa=50, mean_momentum=1)",
        "Zhang et al., Eliminating Domain Bias for Federated Learning in Representation Space, NeurIPS 2023",
        FedDBEParams,
        lambda p: FedDBE(kappa=p.kappa, mean_momentum=p.mean_momentum),
        server_half=lambda p: DbeServer(),
        personalized=True,
        tunable={"kappa": LogFloat(0.1, 100.0), "mean_momentum": Float(0.1, 1.0)},  # official: kappa 50, momentum 1
    ),
}
SERVER_PLUGINS: dict[str, ServerPlugin] = {}
