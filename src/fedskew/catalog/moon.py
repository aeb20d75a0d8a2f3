"""MOON (Li, He, Song, CVPR 2021), whole: model-contrastive federated learning.

Client k's loss is the cross-entropy plus ``mu`` times a contrastive term on the body's output ``z``: the positive pair
is (z, the received global model's ``z``), the negative (z, this client's previous local model's ``z``), cosine
similarities over ``tau``. The server averages as FedAvg (any plug-in composes: ``moon+fedsa``, ``moon+heal``).
"""

from __future__ import annotations

import copy
import functools
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor, nn

from fedskew.client.batched_form import BatchedStep, FrozenTermFn
from fedskew.client.local import LocalAlgorithm, LocalContext, StateKey
from fedskew.models import projection_width
from fedskew.protocol import Params
from fedskew.registry import ClientPart, ServerPlugin
from fedskew.schema import StrictSettings
from fedskew.space import Float, LogFloat

MOON_PREV = StateKey[Params]("moon_prev", "the model the client trained at its previous participation")


@dataclass
class Moon(LocalAlgorithm):
    """MOON (Li, He, Song, CVPR 2021): cross-entropy + mu · model-contrastive loss on the body's output.

    With ``projection = D > 0`` the model carries MOON's projection head (``build_model(..., projection=D)``: the
    body ends in a 2-layer MLP to D dimensions and the classifier reads that), so the contrasted representation is the
    projection's output, as in the paper and the official code; ``projection = 0`` contrasts the plain body features
    (FedDisco's code, ``ModelFedCon_noheader``). The positive pair is (local, global), the negative (local, this
    client's previous local model, buffer of 1), cosine similarity over temperature ``tau``:
    ``−log(e^{pos/τ} / (e^{pos/τ} + e^{neg/τ}))``. On a client's first participation there is no previous model and,
    as in the official code (empty model pool), the term has only the positive logit: ``−log(e^{pos/τ}/e^{pos/τ}) =
    0``, i.e. plain cross-entropy. Defaults mu = 1 (official code's default; the paper's value for CIFAR-100 and
    Tiny-ImageNet, 5 for CIFAR-10), tau = 0.5 (paper and code), projection 256 (paper and code; set by the registry).
    """

    state_keys = (MOON_PREV,)
    mu: float = 1.0
    tau: float = 0.5
    projection: int = 0  # width of the projection head the model must carry (0: none expected)
    # two frozen copies of each training model's architecture (the global and the previous model), made once per
    # model: a cache, not state (held weakly, never pickled or compared)
    _frozen: weakref.WeakKeyDictionary[nn.Module, tuple[nn.Module, nn.Module]] = field(
        default_factory=weakref.WeakKeyDictionary, repr=False, compare=False
    )

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_frozen"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _frozen=weakref.WeakKeyDictionary())

    def _aux(self, model: nn.Module) -> tuple[nn.Module, nn.Module]:
        if model not in self._frozen:
            g, p = copy.deepcopy(model), copy.deepcopy(model)
            for m in (g, p):
                m.eval()
                for q in m.parameters():
                    q.requires_grad_(False)
            self._frozen[model] = (g, p)
        return self._frozen[model]

    def begin(self, ctx: LocalContext) -> None:
        previous = ctx.kept(MOON_PREV)
        ctx.prepared = MoonRound(contrast=self.mu != 0 and previous is not None)
        if ctx.prepared.contrast:
            glob, prev = self._aux(ctx.model)
            glob.load_state_dict(ctx.received)
            prev.load_state_dict(previous)

    def loss(self, ctx: LocalContext, logits: Tensor, features: Tensor, y: Tensor, x: Tensor) -> Tensor:
        ce = F.cross_entropy(logits, y)
        if not ctx.prep(MoonRound).contrast:  # mu = 0, or first participation: the one-logit term is exactly 0
            return ce
        glob, prev = self._aux(ctx.model)
        with torch.no_grad():
            z_glob = glob.body(x)
            z_prev = prev.body(x)
        pos = F.cosine_similarity(features, z_glob, dim=1) / self.tau
        neg = F.cosine_similarity(features, z_prev, dim=1) / self.tau
        contrastive = -pos + torch.logsumexp(torch.stack([pos, neg], dim=1), dim=1)
        return ce + self.mu * contrastive.mean()

    def end(self, ctx: LocalContext) -> Params:
        ctx.keep(MOON_PREV, {k: v.detach().clone() for k, v in ctx.model.state_dict().items()})
        return {}

    def batched_step(self) -> BatchedStep:
        mu, tau = float(self.mu), float(self.tau)

        def term(ctx: LocalContext) -> FrozenTermFn | None:
            return None if mu == 0 else contrastive_term(mu, tau)

        def previous(ctx: LocalContext) -> Params | None:  # begin decided: the term only with a previous model
            return ctx.kept(MOON_PREV) if ctx.prep(MoonRound).contrast else None

        return BatchedStep(term=term, frozen=("received", "previous"), previous=previous, term_per_sample=True)

    def check_model(self, template: Params, trainable: frozenset[str]) -> None:
        width = projection_width(template)
        if width != self.projection:
            raise ValueError(
                f"MOON expects a projection head of width {self.projection} (0: none) but the model has "
                f"{width or 'none'}; build it with build_model(..., **method.model_options)"
            )


@functools.cache  # one function per (mu, tau): captured steps replay the same graphs every round
def contrastive_term(mu: float, tau: float) -> FrozenTermFn:
    """``loss``'s model-contrastive term per sample, ``mu · (−pos + logsumexp(pos, neg))`` (the engine takes each
    client's batch mean): cosine similarities over ``tau`` of the trained body's output with the received and the
    previous model's."""

    def contrastive(feats: Tensor, logits: Tensor, y: Tensor, outs: dict[str, tuple[Tensor, Tensor]]) -> Tensor:
        pos = F.cosine_similarity(feats, outs["received"][0], dim=2) / tau
        neg = F.cosine_similarity(feats, outs["previous"][0], dim=2) / tau
        return mu * (-pos + torch.logsumexp(torch.stack([pos, neg], dim=2), dim=2))

    return contrastive


@dataclass
class MoonRound:
    """What :meth:`Moon.begin` decides: whether the contrastive term is on (``mu > 0`` and a previous model)."""

    contrast: bool


# ---- registration ----------------------------------------------------------------------------------------------------
class MoonParams(StrictSettings):
    mu: float = Field(1.0, ge=0)
    tau: float = Field(0.5, gt=0)
    # width of MOON's projection head (paper and official code: 256); 0 contrasts the body's features (FedDisco)
    projection: int = Field(256, ge=0)


CLIENTS: dict[str, ClientPart] = {
    "moon": ClientPart(
        "moon",
        "local loss + mu * model-contrastive loss on a projection head's output (mu=1, tau=0.5, projection=256)",
        "Li, He, Song, Model-Contrastive Federated Learning, CVPR 2021",
        MoonParams,
        lambda p: Moon(mu=p.mu, tau=p.tau, projection=p.projection),
        model_options=lambda p: {"projection": p.projection} if p.projection else {},
        # official MOON README: mu in {0.001, 0.01, 0.1, 1, 5, 10}; tau in {0.1, 0.5, 1}; FedDisco: mu 0.01 / 0.1
        tunable={"mu": LogFloat(1e-3, 10.0), "tau": Float(0.1, 1.0)},
    ),
}
SERVER_PLUGINS: dict[str, ServerPlugin] = {}
