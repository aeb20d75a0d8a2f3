"""fedskew's server steps as Flower-native strategies: FedDisco, FedHEAL, FedSA (FedPake) and any composition.

Each class here *is* a ``flwr.serverapp.strategy.FedAvg`` (Flower 1.42's Message-API strategies), so it speaks
Flower's conventions: the model travels as an ``ArrayRecord`` under ``arrayrecord_key`` (``"arrays"``), the train
config under ``configrecord_key`` (``"config"``), and every train reply carries one ``ArrayRecord`` and one
``MetricRecord`` holding the client's sample count under ``weighted_by_key`` (``"num-examples"``). Sampling,
evaluation, metric averaging and ``start`` are Flower's; only ``aggregate_train`` changes: the replies are checked
with fedskew's :func:`~fedskew.server.uploads.check_upload`, stacked into a :class:`~fedskew.protocol.RoundInput`
(``[K, ...]`` tensors, :func:`~fedskew.server.uploads.stack_uploads`) and aggregated by fedskew's own pieces
(:class:`~fedskew.catalog.disco.DiscoWeights` / :func:`~fedskew.catalog.disco.disco_weights`,
:func:`~fedskew.catalog.heal.heal_aggregation`, :class:`~fedskew.catalog.fedsa.FedSACombine`), their state kept in the
strategy across rounds. Nothing is re-implemented. A Flower quickstart ServerApp swaps ``FedAvg`` for one of them::

    from flwr.app import ArrayRecord, ConfigRecord, Context
    from flwr.serverapp import Grid, ServerApp
    from fedskew.flower.strategies import FedDisco

    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        strategy = FedDisco(a=0.5, b=0.1, fraction_train=1.0)      # was: FedAvg(fraction_train=1.0)
        result = strategy.start(grid=grid, initial_arrays=ArrayRecord(Net().state_dict()),
                                train_config=ConfigRecord({"lr": 0.01}), num_rounds=3)
        print(strategy.last_weights)                                # {node_id: weight} of the last round

What a client sends besides the quickstart's ``num-examples``: FedDisco needs, in the train reply's MetricRecord,
either ``label-counts`` (its training label counts, a list; the strategy computes d_k) or ``discrepancy`` (d_k as a
scalar, computed by the client). FedHEAL and FedSA need nothing more. :class:`FedskewStrategy` runs any non-personalized
fedskew server composition by name (``"fedavg+disco"``, ``"heal"``, ``"fedsa"``, ``"fedavg+fedavgm"`` ...); the
reply's scalar metrics reach the pieces as ``RoundInput.metrics`` and ``label-counts`` as ``label_hists``.

User-level DP: ``dp=FlowerDP(clip=..., rounds=..., noise_multiplier=... | target_epsilon=...)`` with the nodes clipping
through :func:`fedskew.flower.native_dp.dp_clip_mod` (docs/privacy.md).

Client ids: fedskew's pieces key their state on a client index in ``[0, N)``. Flower node ids are mapped to indices in
the order the nodes are first seen; ``N`` is ``num_clients`` or the number of nodes connected at the first round.
"""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from inspect import Parameter, Signature
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg
from pydantic import ValidationError
from torch import Tensor

from fedskew.catalog.disco import DISCREPANCY, DiscoParams, DiscoWeights
from fedskew.catalog.fedsa import FedSACombine, FedSAParams
from fedskew.catalog.heal import HealParams, heal_aggregation
from fedskew.flower.codec import from_record, to_record
from fedskew.flower.native_dp import FlowerDP
from fedskew.protocol import Params, RoundInput, ServerContext, State, Upload, UploadError
from fedskew.schema import StrictSettings, describe_errors
from fedskew.server.api import NO_SERVER_HALF, Aggregation, Masking, ServerStrategy, Weighting
from fedskew.server.combine import WeightedMean
from fedskew.server.uploads import ON_BAD_UPDATE, check_upload, stack_uploads
from fedskew.server.weights import SampleWeights, UniformWeights

log = logging.getLogger("flwr.fedskew")

__all__ = ["FedDisco", "FedHEAL", "FedPake", "FedSA", "FedskewStrategy", "ReportedDiscoWeights", "RoundRecord"]


@dataclass(frozen=True)
class RoundRecord:
    """What the strategy did in one round: the nodes aggregated (rows of the RoundInput, in order), the weight each
    got, the replies left out under ``on_bad_update='drop'`` (node, reason) and the pieces' diagnostics."""

    round: int
    nodes: tuple[int, ...]
    weights: tuple[float, ...]
    dropped: tuple[tuple[int, str], ...] = ()
    diagnostics: dict[str, Any] = field(default_factory=dict, repr=False)


@dataclass(frozen=True)
class _Recorded(Masking):
    """A masking piece whose last masks are kept in ``sink`` (the strategy exposes them as ``last_masks``)."""

    piece: Masking
    sink: dict[str, Any]

    def init(self, ctx: ServerContext) -> State:
        return self.piece.init(ctx)

    def __call__(self, rin: RoundInput, state: State) -> tuple[Params, State]:
        masks, state = self.piece(rin, state)
        self.sink["masks"] = masks
        return masks, state


class FedskewStrategy(FedAvg):
    """Any fedskew server step as a Flower ``FedAvg`` subclass (one model for everyone; see the module docstring).

    ``server``: a composition name resolved with :func:`fedskew.methods.resolve_method` (``method_args`` its
    hyper-parameters; the client part only matters to your ClientApp) or a :class:`ServerStrategy` object such as an
    :class:`Aggregation`. ``num_clients``: the federation's size N (default: nodes connected at the first round).
    ``trainable``: names of the trainable arrays (default: every floating-point array). ``on_bad_update``: ``'fail'``
    raises naming the node; ``'drop'`` leaves the reply out (``history[-1].dropped``). ``label_counts_key``: the list
    metric read as the client's label histogram (``None``: never). ``seed``: the ServerContext's seed. The other
    keyword arguments are ``FedAvg``'s. After each round: ``history`` (:class:`RoundRecord` per round),
    ``last_weights`` ({node: weight}) and, for a composition with masking, ``last_masks`` (name -> ``[K, ...]``).
    """

    def __init__(
        self,
        server: str | ServerStrategy,
        *,
        method_args: Mapping[str, Any] | None = None,
        num_clients: int | None = None,
        trainable: Iterable[str] | None = None,
        on_bad_update: str = "fail",
        label_counts_key: str | None = "label-counts",
        seed: int = 0,
        dp: FlowerDP | None = None,
        **fedavg_kwargs: Any,
    ) -> None:
        super().__init__(**fedavg_kwargs)
        if on_bad_update not in ON_BAD_UPDATE:
            raise ValueError(f"on_bad_update must be one of {ON_BAD_UPDATE}, got {on_bad_update!r}")
        if num_clients is not None and (not isinstance(num_clients, int) or num_clients < 1):
            raise ValueError(f"num_clients must be a positive integer or None, got {num_clients!r}")
        if label_counts_key is not None and (not isinstance(label_counts_key, str) or not label_counts_key):
            raise ValueError(f"label_counts_key must be a non-empty string or None, got {label_counts_key!r}")
        self.name = server if isinstance(server, str) else type(server).__name__
        self.dp, self.privacy, self._method = dp, None, None
        if dp is not None:  # user-level DP (fedskew.flower.native_dp): the composition by name, private by its rules
            from fedskew.flower.native_dp import check_private
            from fedskew.methods import resolve_method

            if not isinstance(server, str):
                raise ValueError("dp needs the composition by name (its private form is the method's)")
            self._method = resolve_method(server, method_args or {})
            check_private(self._method)
        if isinstance(server, str):
            server = _resolve(server, method_args or {})
        elif method_args:
            raise ValueError("method_args only apply to a composition given by name")
        if not callable(getattr(server, "aggregate", None)) or not callable(getattr(server, "init", None)):
            raise TypeError(f"server must be a composition name or a ServerStrategy, got {server!r}")
        self._sink: dict[str, Any] = {}
        if isinstance(server, Aggregation) and server.masking is not None:
            server = replace(server, masking=_Recorded(server.masking, self._sink))
        self.server: ServerStrategy = server
        self.num_clients = num_clients
        self.trainable = None if trainable is None else frozenset(trainable)
        self.on_bad_update = on_bad_update
        self.label_counts_key = label_counts_key
        self.seed = int(seed)
        self.history: list[RoundRecord] = []
        self._nodes: dict[int, int] = {}  # Flower node id -> fedskew client index
        self._global: Params | None = None
        self._state: State = None
        self._ready = False

    @property
    def last_weights(self) -> dict[int, float]:
        """{node id: weight} of the last aggregated round (empty before)."""
        return dict(zip(self.history[-1].nodes, self.history[-1].weights, strict=True)) if self.history else {}

    @property
    def last_masks(self) -> Params | None:
        """The last round's element masks (rows in ``history[-1].nodes`` order), for compositions with masking."""
        return self._sink.get("masks")

    def summary(self) -> None:
        log.info("\t├──> fedskew server step: %s (on_bad_update=%s)", self.name, self.on_bad_update)
        super().summary()

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        self._global = from_record(arrays)  # the model this round broadcasts: the pieces' ``global_params``
        for node in sorted(grid.get_node_ids()):
            self._nodes.setdefault(node, len(self._nodes))
        return super().configure_train(server_round, arrays, config, grid)

    def check_reply(self, node: int, metrics: MetricRecord) -> None:
        """Hook: refuse a train reply's MetricRecord (raise ``ValueError`` naming ``node``). Default: accept."""

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        valid, _ = self._check_and_log_replies(replies, is_train=True)
        if not valid:
            return None, None
        if self._global is None:
            raise RuntimeError(f"{type(self).__name__}: configure_train must run before aggregate_train")
        where = f"{type(self).__name__}, round {server_round}"
        kept: list[tuple[Message, Upload, np.ndarray | None]] = []
        dropped: list[tuple[int, str]] = []
        for msg in valid:
            node = msg.metadata.src_node_id
            metrics = next(iter(msg.content.metric_records.values()))
            self.check_reply(node, metrics)
            update, hist = self._update(node, msg, metrics, where)
            bad = check_upload(update, self._global)
            if bad is None:
                kept.append((msg, update, hist))
            elif self.on_bad_update == "fail":
                raise type(bad.error())(f"{where}: the train reply of Flower node {node} is refused: {bad.reason}")
            else:
                log.warning("%s: left out the reply of node %s: %s", where, node, bad.reason)
                dropped.append((node, bad.reason))
        if not kept:
            raise UploadError(f"{where}: no valid reply ({'; '.join(f'node {n}: {r}' for n, r in dropped)})")
        hists = [h for _, _, h in kept]
        if all(h is not None for h in hists):
            if len({len(h) for h in hists}) != 1:  # type: ignore[arg-type]
                sizes = {n.metadata.src_node_id: len(h) for (n, _, h) in kept}  # type: ignore[arg-type]
                raise ValueError(f"{where}: '{self.label_counts_key}' lists differ in length across nodes: {sizes}")
            label_hists = np.stack(hists)  # type: ignore[arg-type]
        else:
            label_hists = np.zeros((len(kept), 0))
        nodes = tuple(m.metadata.src_node_id for m, _, _ in kept)
        self._init_state(label_hists.shape[1], where)
        rin = stack_uploads(
            [u for _, u, _ in kept],
            rnd=server_round,
            global_params=self._global,
            trainable=self._trainable(),
            label_hists=label_hists,
        )
        try:
            out, self._state = self.server.aggregate(rin, self._state)
        except ValueError as exc:
            sent = "" if label_hists.shape[1] else f"; no reply carried '{self.label_counts_key}'"
            raise ValueError(f"{where} (rows are nodes {list(nodes)}{sent}): {exc}") from exc
        if out.personal is not None:
            raise TypeError(f"{where}: {self.name} returns one model per client; a Flower strategy needs one model")
        weights = tuple(float(w) for w in out.diagnostics.get("weights", [math.nan] * len(nodes)))
        diagnostics = dict(out.diagnostics)
        if self.privacy is not None:  # the ε spent after this round (the accountant, docs/privacy.md)
            diagnostics["epsilon"] = self.privacy.epsilon(server_round)
        self.history.append(RoundRecord(server_round, nodes, weights, tuple(dropped), diagnostics))
        arrays = to_record({n: out.global_params[n] for n in self._global})
        contents = [self._without_reports(m.content) for m, _, _ in kept]
        return arrays, self.train_metrics_aggr_fn(contents, self.weighted_by_key)

    def reported_keys(self) -> frozenset[str]:
        """The MetricRecord keys that carry what this strategy reads of a client (``label-counts``; FedDisco's
        ``discrepancy``): kept out of Flower's training-metric aggregation, where their mean means nothing."""
        return frozenset(k for k in (self.label_counts_key,) if k)

    def _without_reports(self, content: RecordDict) -> RecordDict:
        keys = self.reported_keys()
        if not keys:
            return content
        out = RecordDict()
        for name, record in content.items():
            if isinstance(record, MetricRecord):
                record = MetricRecord({k: v for k, v in record.items() if k not in keys})
            out[name] = record
        return out

    # ---- internals -----------------------------------------------------------------------------------------------
    def _update(self, node: int, msg: Message, metrics: MetricRecord, where: str) -> tuple[Upload, np.ndarray | None]:
        content = msg.content
        record = content[self.arrayrecord_key] if self.arrayrecord_key in content.array_records else None
        record = record if record is not None else next(iter(content.array_records.values()))
        n = metrics[self.weighted_by_key]
        if isinstance(n, bool) or not isinstance(n, numbers.Real) or not math.isfinite(n) or n <= 0:
            raise UploadError(
                f"{where}: node {node} sent '{self.weighted_by_key}' = {n!r}; expected a positive finite number "
                "(its sample count, or any positive weight, as Flower's FedAvg takes it)"
            )
        n = int(n) if float(n).is_integer() else float(n)  # a count, or a non-integer weight as Flower allows
        hist = None
        if self.label_counts_key is not None and self.label_counts_key in metrics:
            hist = np.asarray(metrics[self.label_counts_key], dtype=np.float64).reshape(-1)
            if hist.size == 0 or not np.all(np.isfinite(hist)) or np.any(hist < 0):
                raise ValueError(
                    f"{where}: node {node} sent '{self.label_counts_key}' = {hist.tolist()}; "
                    "expected a non-empty list of non-negative label counts"
                )
        if node not in self._nodes:
            self._nodes[node] = len(self._nodes)
        scalars = {k: float(v) for k, v in metrics.items() if isinstance(v, int | float) and not isinstance(v, bool)}
        return Upload(self._nodes[node], from_record(record), n, {}, scalars), hist  # type: ignore[arg-type]

    def _trainable(self) -> frozenset[str]:
        assert self._global is not None
        if self.trainable is None:
            return frozenset(n for n, t in self._global.items() if t.is_floating_point())
        return self.trainable

    def _init_state(self, num_classes: int, where: str) -> None:
        if self._ready:
            return
        assert self._global is not None
        unknown = sorted(self._trainable() - set(self._global))
        if unknown:
            raise ValueError(f"{where}: trainable names {unknown} are not arrays of the model")
        n = self.num_clients or len(self._nodes)
        # the clients' sizes and histograms are unknown before they train: pieces that need them say so
        hists = np.zeros((n, num_classes))
        ctx = ServerContext(n, num_classes, self._global, self._trainable(), np.zeros(n), hists, seed=self.seed)
        if self.dp is not None:  # the weighted mean becomes DP-FedAvg's noised one (fedskew.privacy.server)
            from fedskew.flower.native_dp import flower_sampling, private_mean

            sampling = flower_sampling(n, self.fraction_train, self.min_train_nodes)
            self.server, self.privacy = private_mean(self._method, self.dp, ctx, sampling)  # type: ignore[arg-type]
        self._state = self.server.init(ctx)
        self._ready = True


def _resolve(name: str, args: Mapping[str, Any]) -> ServerStrategy:
    from fedskew.methods import resolve_method

    method = resolve_method(name, args)
    if method.personalized or not isinstance(method.server, Aggregation):
        raise ValueError(f"{name!r} is personalized (one model per client); a Flower strategy sends one model")
    if method.upload_extras:
        raise ValueError(f"{name!r} needs extra tensors from the clients, which a Flower strategy does not collect")
    if method.server_half is not NO_SERVER_HALF:
        raise ValueError(
            f"{name!r}: its client part has a server half ({type(method.server_half).__name__}: state the server keeps "
            "and broadcasts), which a Flower strategy does not run; use fedskew's own Flower app (fedskew flower new)"
        )
    if method.local - {"buffers"}:
        raise ValueError(f"{name!r} keeps {sorted(method.local)} on the clients; not a one-model server step")
    if method.calibration is not None:
        raise ValueError(
            f"{name!r} calibrates the evaluated model from the clients' feature statistics, which a Flower strategy "
            "does not collect; it would run as its host without the calibration"
        )
    return method.server


@dataclass(frozen=True)
class ReportedDiscoWeights(Weighting):
    """FedDisco's weighting fed by what the clients report: their label counts (``RoundInput.label_hists``) or,
    without them, their own discrepancy ``d_k`` (``RoundInput.metrics[key]``, handed to :class:`DiscoWeights` as the
    client report it reads, ``disco_discrepancy``): either way :class:`DiscoWeights` computes the weights."""

    disco: DiscoWeights
    discrepancy_key: str = "discrepancy"

    def init(self, ctx: ServerContext) -> State:
        return self.disco.init(ctx if ctx is not None and ctx.num_classes > 0 else None)

    def __call__(self, rin: RoundInput, masks: Params | None, state: State) -> tuple[Tensor, State]:
        hists = rin.label_hists
        if hists is not None and np.ndim(hists) == 2 and np.shape(hists)[1] > 0:
            return self.disco(rin, masks, state)
        if self.discrepancy_key not in rin.metrics:
            raise ValueError(f"FedDisco needs every client's label counts or its '{self.discrepancy_key}'")
        d = rin.metrics[self.discrepancy_key].to(torch.float64).numpy().reshape(-1, 1)
        return self.disco(replace(rin, reports={**rin.reports, DISCREPANCY: d}), masks, state)


def _schema_args(schema: type[StrictSettings], kwargs: dict[str, Any], who: str, *, leave: tuple[str, ...] = ()) -> Any:
    """The method's hyper-parameters among a strategy's keyword arguments (popped from ``kwargs``; the rest are
    :class:`FedskewStrategy`'s and ``FedAvg``'s), validated by the method's own schema (its defaults and bounds);
    ``leave``: schema fields that do not apply to the strategy (refused when given)."""
    given = [k for k in leave if k in kwargs]
    if given:
        raise ValueError(f"{who} on Flower: {', '.join(given)} does not apply to the strategy")
    mine = {k: kwargs.pop(k) for k in list(kwargs) if k in schema.model_fields}
    try:
        return schema(**mine)
    except ValidationError as exc:
        raise ValueError(f"{who}: " + "; ".join(describe_errors(exc))) from None


def _signed(schema: type[StrictSettings], *, leave: tuple[str, ...] = (), extra: tuple[Parameter, ...] = ()) -> Any:
    """A class decorator: the strategy's ``__init__`` signature (what ``help()`` and an editor show) is its method's
    schema fields with their defaults, ``extra``, then ``**kwargs``: declared once, in the method's module."""

    def decorate(cls: type) -> type:
        fields = [
            Parameter(name, Parameter.KEYWORD_ONLY, default=f.default, annotation=f.annotation)
            for name, f in schema.model_fields.items()
            if name not in leave
        ]
        kwargs = Parameter("kwargs", Parameter.VAR_KEYWORD, annotation=Any)
        self_ = Parameter("self", Parameter.POSITIONAL_OR_KEYWORD)
        cls.__init__.__signature__ = Signature([self_, *fields, *extra, kwargs])  # type: ignore[misc]
        return cls

    return decorate


@_signed(
    DiscoParams,
    leave=("report",),
    extra=(
        Parameter("discrepancy_key", Parameter.KEYWORD_ONLY, default="discrepancy", annotation=str),
        Parameter("label_counts_key", Parameter.KEYWORD_ONLY, default="label-counts", annotation=str),
    ),
)
class FedDisco(FedskewStrategy):
    """FedDisco (Ye et al., ICML 2023): weights ``ReLU(n_k - a·d_k + b)`` normalized, then the weighted mean.

    ``a``, ``b``, ``metric`` (``kl``, ``l1``, ``l2``, ``cosine``, ``only_iid``), ``target`` (``None``: uniform):
    :class:`~fedskew.catalog.disco.DiscoParams`, its defaults and bounds (``report`` does not apply: a Flower client
    sends its label information with every reply). Each train reply's MetricRecord must carry ``label_counts_key``
    (list of training label counts; used when present) or ``discrepancy_key`` (scalar d_k computed on the client with
    the same metric and target). Other keyword arguments: :class:`FedskewStrategy`'s.
    """

    def __init__(
        self, *, discrepancy_key: str = "discrepancy", label_counts_key: str = "label-counts", **kwargs: Any
    ) -> None:
        params = _schema_args(DiscoParams, kwargs, "FedDisco", leave=("report",))
        for what, key in (("discrepancy_key", discrepancy_key), ("label_counts_key", label_counts_key)):
            if not isinstance(key, str) or not key:
                raise ValueError(f"FedDisco {what} must be a non-empty string, got {key!r}")
        if discrepancy_key == label_counts_key:
            raise ValueError(f"FedDisco discrepancy_key and label_counts_key must differ, both are {discrepancy_key!r}")
        disco = DiscoWeights(a=params.a, b=params.b, metric=params.metric, target=params.target)
        self.a, self.b, self.metric, self.target = disco.a, disco.b, disco.metric, disco.target
        self.discrepancy_key = discrepancy_key
        server = Aggregation(weighting=ReportedDiscoWeights(disco, discrepancy_key), combine=WeightedMean())
        super().__init__(server, label_counts_key=label_counts_key, **kwargs)
        self.name = f"disco(a={disco.a}, b={disco.b}, metric={disco.metric})"

    def reported_keys(self) -> frozenset[str]:
        return super().reported_keys() | {self.discrepancy_key}

    def check_reply(self, node: int, metrics: MetricRecord) -> None:
        if self.label_counts_key in metrics:
            if not isinstance(metrics[self.label_counts_key], list):
                raise ValueError(f"FedDisco: node {node} sent '{self.label_counts_key}' that is not a list")
            return
        if self.discrepancy_key not in metrics:
            raise ValueError(
                f"FedDisco: the train reply of node {node} carries neither '{self.label_counts_key}' (the client's "
                f"training label counts, a list) nor '{self.discrepancy_key}' (its discrepancy d_k, a number) in "
                f"its MetricRecord (keys: {sorted(metrics)})"
            )
        d = metrics[self.discrepancy_key]
        if not isinstance(d, int | float) or math.isnan(d) or d < 0:
            raise ValueError(f"FedDisco: node {node} sent '{self.discrepancy_key}' = {d!r}; expected a number >= 0")


@_signed(HealParams)
class FedHEAL(FedskewStrategy):
    """FedHEAL (Chen et al., CVPR 2024): FPHL consistency masks + FAEL momentum weights, masked weighted mean.

    ``tau``, ``beta``, ``strict``, ``distance``, ``fael_init``, ``uniform_over``:
    :class:`~fedskew.catalog.heal.HealParams`, built by :func:`~fedskew.catalog.heal.heal_aggregation`; the per-client
    sign tables and FAEL momenta are kept in the strategy across rounds. ``fael_init='datasize'`` is refused: it needs
    every client's training-set size before the first round. The clients send what the quickstart sends. Other
    keyword arguments: :class:`FedskewStrategy`'s.
    """

    def __init__(self, **kwargs: Any) -> None:
        params = _schema_args(HealParams, kwargs, "FedHEAL")
        if params.fael_init == "datasize":
            raise ValueError(
                "FedHEAL on Flower: fael_init='datasize' needs every client's training-set size before round 1, "
                "which the strategy does not have; use fael_init='uniform'"
            )
        self.params = params
        self.tau, self.beta = params.tau, params.beta
        super().__init__(heal_aggregation(**params.model_dump()), **kwargs)
        self.name = f"heal(tau={params.tau}, beta={params.beta})"


@_signed(FedSAParams)
class FedSA(FedskewStrategy):
    """FedSA / FedPake (arXiv 2408.11278): parameter-skew-aware aggregation of every trainable array.

    ``lam``, ``delta``, ``C``, ``S``, ``micro_norm``, ``alpha_norm``, ``low_weighting``, ``buffers``, ``cv_norm``:
    :class:`~fedskew.catalog.fedsa.FedSAParams`, for :class:`~fedskew.catalog.fedsa.FedSACombine`; client weights are
    sample shares with ``low_weighting='samples'``, else uniform (the combine's, which ``history`` records).
    ``buffers='local'`` returns the broadcast buffers: your ClientApp must then keep its own. The clients send what
    the quickstart sends. Other keyword arguments: :class:`FedskewStrategy`'s.
    """

    def __init__(self, **kwargs: Any) -> None:
        params = _schema_args(FedSAParams, kwargs, "FedSA")
        self.params = params
        self.combine = FedSACombine(**params.model_dump())
        # the weights the combine uses, and so the ones history records: sample shares only with
        # low_weighting='samples' (with 'uniform' the low-dispersion mean is the plain one, as fedskew's `fedsa`)
        weighting = SampleWeights() if params.low_weighting == "samples" else UniformWeights()
        super().__init__(Aggregation(weighting=weighting, combine=self.combine), **kwargs)
        self.name = f"fedsa(lam={params.lam}, delta={params.delta}, C={params.C}, S={params.S})"


FedPake = FedSA
