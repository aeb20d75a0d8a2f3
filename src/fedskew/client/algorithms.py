"""Client-side algorithms that change the local objective or exchange extra state.

Each is a handful of hooks on :class:`fedskew.client.local.LocalAlgorithm`; the training loop is never copied, and
any of them composes with any server aggregation (``fedprox+disco``, ``scaffold+heal``, ``moon+fedsa``).
"""

from __future__ import annotations

import copy
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedskew.client.batched_form import BatchedStep, FrozenTermFn, Shift
from fedskew.client.local import LocalAlgorithm, LocalContext
from fedskew.models import projection_width
from fedskew.protocol import SCAFFOLD_C, SCAFFOLD_DELTA, Params


def _trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def proximal(ctx: LocalContext, anchor: Params, mu: float) -> Tensor:
    """``(mu/2)·Σ‖w − anchor‖²`` over the parameters ``ctx.model`` trains now (FedProx, Ditto, FedAMP)."""
    return 0.5 * mu * torch.stack([((p - anchor[n]) ** 2).sum() for n, p in _trainable(ctx.model)]).sum()


@dataclass
class FedProx(LocalAlgorithm):
    """FedProx (Li et al., MLSys 2020): cross-entropy + (mu/2)·||w − w_global||² over trainable parameters.

    Default mu = 0.01 (FedDisco's code default; FedSA/FedPake use 0.001, FedDisco's scripts 0.1).
    mu = 0 is exactly plain local SGD.
    """

    mu: float = 0.01

    def loss(self, ctx: LocalContext, logits: Tensor, features: Tensor, y: Tensor, x: Tensor) -> Tensor:
        ce = F.cross_entropy(logits, y)
        return ce if self.mu == 0 else ce + proximal(ctx, ctx.received, self.mu)

    def batched_step(self) -> BatchedStep:
        return BatchedStep(prox_mu=lambda phase: float(self.mu))


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
        previous = ctx.client_state.get("moon_prev")
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
        ctx.client_state["moon_prev"] = {k: v.detach().clone() for k, v in ctx.model.state_dict().items()}
        return {}

    def batched_step(self) -> BatchedStep:
        mu, tau = float(self.mu), float(self.tau)

        def term(ctx: LocalContext) -> FrozenTermFn | None:
            """``loss``'s model-contrastive term per client: ``mu · mean_b(−pos + logsumexp(pos, neg))``, cosine
            similarities over ``tau`` of the trained body's output with the received and the previous model's."""
            if mu == 0:
                return None

            def contrastive(feats: Tensor, logits: Tensor, y: Tensor, outs: dict[str, tuple[Tensor, Tensor]]) -> Tensor:
                pos = F.cosine_similarity(feats, outs["received"][0], dim=2) / tau
                neg = F.cosine_similarity(feats, outs["previous"][0], dim=2) / tau
                return mu * (-pos + torch.logsumexp(torch.stack([pos, neg], dim=2), dim=2)).mean(1)

            return contrastive

        def previous(ctx: LocalContext) -> Params | None:  # begin decided: the term only with a previous model
            return ctx.client_state.get("moon_prev") if ctx.prep(MoonRound).contrast else None

        return BatchedStep(term=term, frozen=("received", "previous"), previous=previous)

    def check_model(self, template: Params, trainable: frozenset[str]) -> None:
        width = projection_width(template)
        if width != self.projection:
            raise ValueError(
                f"MOON expects a projection head of width {self.projection} (0: none) but the model has "
                f"{width or 'none'}; build it with build_model(..., **method.model_options)"
            )


@dataclass
class MoonRound:
    """What :meth:`Moon.begin` decides: whether the contrastive term is on (``mu > 0`` and a previous model)."""

    contrast: bool


@dataclass
class Scaffold(LocalAlgorithm):
    """SCAFFOLD (Karimireddy et al., ICML 2020), option II control variates, global learning rate 1.

    Client: after each optimizer step the parameters are shifted by ``−lr·(c − c_i)`` (FedDisco's code); afterwards
    ``c_i⁺ = c_i − c + (w_global − w_local)/(steps · lr)``, upload ``Δc_i = c_i⁺ − c_i``. Server half
    (:class:`fedskew.server.halves.ScaffoldServer`): ``c ← c + (1/N) Σ_{participants} Δc_i`` (N = all clients, as in
    FedDisco's code); the model itself is combined by whatever server aggregation the method uses.

    Why a shift after the step and not a gradient term: with plain SGD the two are identical. With momentum β a
    gradient term goes through the momentum buffer and moves the model by about ``lr·(c − c_i)/(1 − β)`` per step,
    and the option-II estimate then returns that amplified correction into ``c_i⁺`` (a feedback of gain about
    ``β/(1 − β)``: 9 at β = 0.9, which diverges). With the shift, ``K`` steps move the model by
    ``lr·Σ_t d_t + K·lr·(c − c_i)``, where ``d_t`` is the optimizer's direction at step t (the momentum buffer of the
    raw gradients, weight decay included; ``d_t = g_t`` for plain SGD), so the estimate is
    ``c_i⁺ = (1/K) Σ_t d_t``: the client's mean update direction, which contains no correction (no feedback). With
    momentum it is about ``ḡ/(1 − β)``, the same units in which the optimizer moves the model by the gradient, so
    ``lr·(c − c_i)`` keeps replacing the client's mean drift by the federation's, as SCAFFOLD intends.
    """

    def begin(self, ctx: LocalContext) -> None:
        names = [n for n, _ in _trainable(ctx.model)]
        c_i = ctx.client_state.get("scaffold_ci") or {n: torch.zeros_like(ctx.received[n]) for n in names}
        ctx.client_state["scaffold_ci"] = c_i
        c = {n: ctx.broadcast.get(f"{SCAFFOLD_C}{n}", torch.zeros_like(ctx.received[n])) for n in names}
        params = [p for _, p in _trainable(ctx.model)]
        ctx.prepared = ScaffoldRound(params, [c[n] - c_i[n] for n in names], -ctx.settings.lr, c)

    def after_step(self, ctx: LocalContext) -> None:
        prep = ctx.prep(ScaffoldRound)
        torch._foreach_add_(prep.params, prep.correction, alpha=prep.scale)

    def end(self, ctx: LocalContext) -> Params:
        c, c_i = ctx.prep(ScaffoldRound).c, ctx.client_state["scaffold_ci"]
        scale = 1.0 / (max(ctx.steps, 1) * ctx.settings.lr)
        extras, new_ci = {}, {}
        for n, p in _trainable(ctx.model):
            new_ci[n] = c_i[n] - c[n] + (ctx.received[n] - p.detach()) * scale
            extras[f"{SCAFFOLD_DELTA}{n}"] = new_ci[n] - c_i[n]
        ctx.client_state["scaffold_ci"] = new_ci
        return extras

    def batched_step(self) -> BatchedStep:
        # the shift after every step, as begin prepared it: w += −lr·(c − c_i)
        return BatchedStep(shift=lambda ctx: Shift(ctx.prep(ScaffoldRound).correction, ctx.prep(ScaffoldRound).scale))


@dataclass
class ScaffoldRound:
    """What :meth:`Scaffold.begin` prepares: the trained parameters, ``c − c_i`` per parameter, the shift's scale
    (``−lr``) and the received ``c``."""

    params: list[Tensor]
    correction: list[Tensor]
    scale: float
    c: Params
