"""The server-side seams of a federated round.

Everything a server method needs arrives as a :class:`RoundInput`: the K participants' uploads stacked along a
leading client axis (``params[name]`` has shape ``[K, *shape]``), their sample counts, any extra tensors they
uploaded, and the model that was broadcast. A client part may have a server side, a :class:`ServerHalf` (SCAFFOLD's
global control variate), which advances first. The server method is a :class:`ServerStrategy`; the common case is an
:class:`Aggregation`, the composition, in this order:

    masks   = masking(round_input, state)                  # optional: which client values enter each element (HEAL)
    weights = weighting(round_input, masks, state)          # one weight per client (size, uniform, Disco, FAEL)
    params  = combine(round_input, weights, masks, state)   # how stacked values become one (weighted mean, FedSA)
    params  = step(round_input, params, weights, state)     # optional: the server step (FedAvgM, FedDyn's cloud)

Vocabulary (one word per concept, in code, docs and tests): an **upload** (:class:`~fedskew.protocol.Upload`) is
what a client sends; a **delta** is ``w_k - w`` (:meth:`RoundInput.delta`); a **rejection** is an upload the server
refuses (:func:`~fedskew.server.uploads.check_upload`); the **server step** is what runs after the combine
(:class:`ServerStep`).

Each piece kind has one base class (:class:`Weighting`, :class:`Masking`, :class:`Combine`, :class:`ServerStep`),
and every piece derives from :class:`Piece`: its state is explicit, ``init(ctx) -> state`` and
``__call__(..., state) -> (..., new_state)``, a typed value (a NamedTuple or frozen dataclass; ``None`` for a
stateless piece, the default ``init``); its optional behaviour is declared there, not discovered:
``check_composition`` (refuse a composition: FedNova's combine takes no masks), ``reports`` (what it needs from every
client before round 1) and, on a combine, ``default_weights`` (its paper's average). Configuration lives in the
piece's fields, never in its state. :func:`stateless` makes a combine of a function. The server step may be a
chain of gradient transforms (:class:`Descent`: FedAvgM is ``ema`` or ``trace`` then ``scale``), their state keyed
by name. Personalized methods (FedCAC, FedAMP) implement :class:`ServerStrategy` directly and return one model per
client.

Uploads pass one validation and are stacked into a :class:`RoundInput` in :mod:`fedskew.server.uploads`
(:func:`~fedskew.server.uploads.check_upload`, the ``on_bad_update`` policy, the ``[K, ...]`` buffers).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple, Protocol

import numpy as np
import torch
from torch import Tensor

from fedskew.protocol import (
    ClientReport,
    Params,
    RoundInput,
    ServerContext,
    State,
)
from fedskew.schema import ConfigError

Diagnostics = dict[str, Any]  # JSON-serializable numbers a piece reports for the round's record


@dataclass(frozen=True)
class ServerOutput:
    global_params: Params
    # per-client models, for personalized methods (may be views of the round's [K, ...] tensors: copy what you keep)
    personal: Mapping[int, Params] | None = None
    diagnostics: Diagnostics = field(default_factory=dict)


class ServerStrategy(Protocol):
    """Anything that turns a round's uploads into the next model(s)."""

    def init(self, ctx: ServerContext) -> State: ...

    def aggregate(self, rin: RoundInput, state: State) -> tuple[ServerOutput, State]: ...


@dataclass(frozen=True)
class Composition:
    """What a piece sees of the method it is composed into, to refuse a composition it cannot serve."""

    method: str  # the composition's name, for the error message
    client: str  # the client part
    roles: frozenset[str]  # the server roles the plug-ins fill
    weights_given: bool = False  # the user set ``-m weights=...``


class Piece:
    """What every server piece shares. Override what applies; the defaults are a stateless piece that accepts
    every composition and needs nothing from the clients."""

    reports: tuple[ClientReport, ...] = ()  # statistics every client sends once, before round 1

    def init(self, ctx: ServerContext) -> State:
        """The piece's state before round 1 (``None``: stateless)."""
        return None

    def check_composition(self, comp: Composition) -> None:
        """Raise :class:`~fedskew.schema.ConfigError` when this piece cannot serve ``comp``."""
        return None


def refuse_masks(comp: Composition, why: str) -> None:
    """For a piece that takes whole client deltas: refuse a composition with a masking piece (HEAL's)."""
    if "masking" in comp.roles:
        raise ConfigError(f"method {comp.method!r}: {why}, not element masks")


@dataclass(frozen=True)
class PrivateWeights:
    """A weighting's form under user-level DP (:mod:`fedskew.privacy`): one raw weight per client of the federation,
    fixed before round 1, from what the server may know (sample counts) or from client reports released through a
    Gaussian mechanism of multiplier ``report_noise`` (0: no release), which the accountant composes once with the
    rounds. The private server caps them (``w ≤ 1``), sums the cohort's clipped updates with them and divides by the
    fixed denominator they give. ``record``: what the run's privacy record states of the release."""

    values: np.ndarray  # [N] float64, >= 0
    kind: str  # the record's name of the weights: uniform, samples, disco, ...
    report_noise: float = 0.0
    record: Mapping[str, Any] = field(default_factory=dict)


class Weighting(Piece):
    # whether the weights read only what the server knows before the round (sample counts, client reports), not the
    # uploads: secure aggregation (fedskew.flower.secagg) fixes them before the clients train
    before_round: ClassVar[bool] = False

    def __call__(self, rin: RoundInput, masks: Params | None, state: State) -> tuple[Tensor, State]:
        """Return ``[K]`` float64 non-negative weights summing to 1."""
        raise NotImplementedError

    def arrival_weight(self, num_samples: float) -> float | None:
        """An upload's raw weight from what arrives with it, the weights being these normalized over the round
        (sample counts: ``num_samples``; uniform: 1); ``None`` when it depends on the whole round (streaming
        aggregation, :mod:`fedskew.server.streaming`, needs it)."""
        return None

    def private_refusal(self) -> str | None:
        """Why these weights have no form under user-level DP (``None``: :meth:`private` gives it)."""
        return (
            f"its weights ({type(self).__name__}) come from the clients' statistics, a release of their own that is "
            "not privatized"
        )

    def private(self, ctx: ServerContext, report_noise: float | None) -> PrivateWeights:
        """The weights under user-level DP (see :class:`PrivateWeights`); ``report_noise``: the noise multiplier the
        run gives the release of the client reports they read (``None``: none given; a weighting that needs one
        raises :class:`~fedskew.schema.ConfigError` saying so)."""
        raise ConfigError(self.private_refusal() or f"{type(self).__name__} has no private form")


class Masking(Piece):
    def __call__(self, rin: RoundInput, state: State) -> tuple[Params, State]:
        """Return name -> ``[K, *shape]`` bool masks (True: the client's value enters that element)."""
        raise NotImplementedError


class Combine(Piece):
    default_weights: ClassVar[str | None] = None  # the average its paper uses unless a weighting or -m weights= says

    def __call__(
        self, rin: RoundInput, weights: Tensor, masks: Params | None, state: State
    ) -> tuple[Params, Diagnostics, State]:
        """Return the new global state dict, diagnostics and the new state."""
        raise NotImplementedError


class ServerStep(Piece):
    """The server's own step after the combine: ``params`` is the combined model, the result the next global model
    (FedAvgM's server momentum, FedDyn's correction by the mean of the clients' deltas). ``individual``: whether it
    reads the clients' uploads beyond the combined model (FedExP's norms of each update); a step that does not is
    post-processing of the combine, which is what lets it run after a private sum (docs/privacy.md)."""

    individual: ClassVar[bool] = True

    def __call__(
        self, rin: RoundInput, params: Params, weights: Tensor, state: State
    ) -> tuple[Params, Diagnostics, State]:
        raise NotImplementedError


ModelLookup = Callable[[int], "Params | None"]  # client id -> the model the server holds for it


class ServerHalf(Piece):
    """The server's side of a client part: what the server keeps for that client algorithm across rounds, what it
    broadcasts with the model, and how a round's uploads advance it (SCAFFOLD's and FedDC's global control variate,
    FedDyn's mean client size, FedGen's generator, FedProto's global prototypes; each in its method's module). It runs
    before the aggregation, on the same :class:`RoundInput`. This base keeps nothing and broadcasts nothing (the client
    parts without a server side)."""

    def broadcast(self, state: State) -> Params:
        """The tensors every sampled client receives with its model this round."""
        return {}

    def advance(self, rin: RoundInput, state: State) -> State:
        """The state after this round's uploads."""
        return state

    # under user-level DP (docs/privacy.md) a server half may see the round's extras only as their noised sum: one
    # that can advance from it says so here, names the extras it sums (zeros of their shapes) and advances from them
    private: ClassVar[bool] = False

    def summed_extras(self, ctx: ServerContext) -> Params:
        """The extras a private server half advances from (zeros of their shapes; DP noises their sum)."""
        raise NotImplementedError

    def advance_sums(self, sums: Params, state: State) -> State:
        """The state after a round whose uploads this server half sees only as ``sums``: ``Σ_k extras_k`` over the
        cohort, noised (DP)."""
        raise NotImplementedError

    def downloads(self, state: State, cid: int, rnd: int, models: ModelLookup) -> Params:
        """The tensors client ``cid`` alone receives in round ``rnd`` beside its model and the broadcast (FedFomo: the
        models of the peers it is sent), made from ``models``: the model the server holds for a client (``None``:
        none). Counted in the round's bytes down when sent."""
        return {}


NO_SERVER_HALF = ServerHalf()


class Calibration(Piece):
    """A post-hoc change of the global model that the global views score and the clients never receive (CCVR's
    classifier calibrated on virtual features): training is untouched. At each evaluation every client computes
    :meth:`statistics` of its training features under the global model; the server sums them over the clients
    (the statistics must be additive) and :meth:`calibrate` returns the model the global views score."""

    def statistics(self, features: Tensor, labels: Tensor, num_classes: int) -> Params:
        """One client's additive statistics of its training features ``[n, d]`` (the global model's body)."""
        raise NotImplementedError

    def calibrate(self, global_params: Params, head: torch.nn.Module, stats: Params, key: CalibrationKey) -> Params:
        """The model to score, from the global one, the model's head module (a copy to train), the summed
        statistics and ``key`` (the run's seed and round, learning rate and batch size)."""
        raise NotImplementedError


class CalibrationKey(NamedTuple):
    """What a calibration may read of the run: its seed and the round (its random draws are keyed by them), and the
    clients' learning rate and batch size (its defaults)."""

    seed: int
    round: int
    lr: float
    batch_size: int


CombineFn = Callable[[RoundInput, Tensor, "Params | None"], "tuple[Params, Diagnostics]"]


@dataclass(frozen=True)
class _Stateless(Combine):
    fn: CombineFn

    def __call__(
        self, rin: RoundInput, weights: Tensor, masks: Params | None, state: State
    ) -> tuple[Params, Diagnostics, State]:
        params, diagnostics = self.fn(rin, weights, masks)
        return params, diagnostics, state


def stateless(fn: CombineFn) -> Combine:
    """A :class:`Combine` from ``fn(rin, weights, masks) -> (params, diagnostics)``, which keeps no state."""
    return _Stateless(fn)


# ---- the server step as a chain of gradient transforms ------------------------------------------------------------
class GradientTransform(Piece):
    """One link of a :class:`Descent` chain: maps the float64 pseudo-gradients (name -> tensor) to new ones."""

    def __call__(self, grads: Params, state: State) -> tuple[Params, Diagnostics, State]:
        raise NotImplementedError


class ChainState(NamedTuple):
    """The state of a :class:`Descent`'s transforms, by name."""

    by_name: Mapping[str, State]


@dataclass(frozen=True)
class Descent(ServerStep):
    """A server step that treats the combine as a gradient (optax's view of FedOpt): the pseudo-gradient
    ``g = w^t - w̄`` (broadcast model minus combined one) of every floating state-dict entry, in float64, goes
    through ``transforms`` in order, and the next model is ``w^t - g'``, cast back to each tensor's dtype (integer
    buffers take the combined value). FedAvgM is ``Descent((("ema", Ema(m)), ("scale", Scale(lr))))``; with no
    transform the result is the combined model up to float64 rounding. Diagnostics are prefixed with ``prefix_``."""

    individual: ClassVar[bool] = False  # the pseudo-gradient is the combined model's alone
    transforms: tuple[tuple[str, GradientTransform], ...]
    prefix: str = ""

    def __post_init__(self) -> None:
        names = [n for n, _ in self.transforms]
        if len(set(names)) != len(names):
            raise ValueError(f"a Descent's transforms need distinct names, got {names}")

    def init(self, ctx: ServerContext) -> ChainState:
        return ChainState({name: t.init(ctx) for name, t in self.transforms})

    def __call__(
        self, rin: RoundInput, params: Params, weights: Tensor, state: ChainState
    ) -> tuple[Params, Diagnostics, ChainState]:
        names = [n for n, t in params.items() if t.is_floating_point()]
        start = {n: rin.global_params[n].to(torch.float64) for n in names}
        grads = {n: start[n] - params[n].to(torch.float64) for n in names}
        new_state: dict[str, State] = {}
        diagnostics: Diagnostics = {}
        for name, transform in self.transforms:
            grads, more, new_state[name] = transform(grads, state.by_name[name])
            diagnostics.update(more)
        out = dict(params)
        for n in names:
            out[n] = (start[n] - grads[n]).to(params[n].dtype)
        if self.prefix:
            diagnostics = {f"{self.prefix}_{k}": v for k, v in diagnostics.items()}
        return out, diagnostics, ChainState(new_state)


class AggregationState(NamedTuple):
    """An :class:`Aggregation`'s state: each piece's own (``None`` for a stateless or absent piece)."""

    weighting: State = None
    masking: State = None
    combine: State = None
    step: State = None


@dataclass(frozen=True)
class Aggregation:
    """masks -> weights -> combine -> step: the server side of FedAvg, +Disco, +HEAL, FedSA, FedAvgM, ..."""

    weighting: Weighting
    combine: Combine
    masking: Masking | None = None
    step: ServerStep | None = None

    def pieces(self) -> tuple[Piece, ...]:
        return tuple(p for p in (self.masking, self.weighting, self.combine, self.step) if p is not None)

    def init(self, ctx: ServerContext) -> AggregationState:
        return AggregationState(
            weighting=self.weighting.init(ctx),
            masking=self.masking.init(ctx) if self.masking is not None else None,
            combine=self.combine.init(ctx),
            step=self.step.init(ctx) if self.step is not None else None,
        )

    def aggregate(self, rin: RoundInput, state: AggregationState) -> tuple[ServerOutput, AggregationState]:
        masks, mstate = (None, None)
        if self.masking is not None:
            masks, mstate = self.masking(rin, state.masking)
        weights, wstate = self.weighting(rin, masks, state.weighting)
        params, diagnostics, cstate = self.combine(rin, weights, masks, state.combine)
        sstate = None
        if self.step is not None:
            params, more, sstate = self.step(rin, params, weights, state.step)
            diagnostics = {**diagnostics, **more}
        diagnostics = {"weights": weights.tolist(), **diagnostics}
        return ServerOutput(params, None, diagnostics), AggregationState(wstate, mstate, cstate, sstate)

    def aggregate_sums(
        self, rin: RoundInput, params: Params, weights: Tensor, state: AggregationState
    ) -> tuple[ServerOutput, AggregationState]:
        """The same aggregation from a weighted mean summed upload by upload (:mod:`fedskew.server.streaming`, for
        the compositions it accepts): ``params`` the combined model, ``weights`` the uploads' normalized weights;
        ``rin`` carries the round's scalars (ids, sample counts, metrics) and no uploads (``params`` empty), which a
        step that is not ``individual`` does not read."""
        sstate = None
        diagnostics: Diagnostics = {}
        if self.step is not None:
            params, diagnostics, sstate = self.step(rin, params, weights, state.step)
        diagnostics = {"weights": weights.tolist(), **diagnostics}
        return ServerOutput(params, None, diagnostics), state._replace(step=sstate)

