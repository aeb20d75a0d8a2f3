"""Secure aggregation on fedskew's Flower apps: Flower's SecAgg+ protocol carries a round's uploads as one sum.

Under ``flower.secagg = true`` the server learns a round's uploads only as their sum (Bell et al., CCS'20, as Flower's
``SecAggPlusWorkflow`` and ``secaggplus_mod`` implement it: pairwise masks that cancel in the sum, self masks removed
with Shamir shares, a threshold of the round's clients needed to unmask; clients that drop out after sharing their
keys are recovered from their neighbours' shares). It applies to the compositions whose server reads a weighted sum
only, with weights the server knows before the clients train (:func:`~fedskew.server.streaming.secure_refusal`;
:attr:`~fedskew.server.api.Weighting.before_round`: sample counts, uniform, FedDisco's from the reported ``d_k``):
FedAvg, FedProx, SCAFFOLD, MOON, Ditto, FedAvgM, +Disco, ... Others are refused with the reason
(:func:`~fedskew.flower.settings.secagg_refusal`).

The round, in the simulator's terms:

1. the server fixes the cohort's weights ``w_k`` (normalized over the clients it sends to) and sends each client its
   own with its model (``secagg_weight``);
2. the client trains as always (:func:`fedskew.flower.client_app.train`), then :func:`secagg_mod` turns its upload
   into the vector SecAgg+ sums: ``w_k θ_k`` for every floating entry of the model, and its extras ``e_k``
   unweighted (SCAFFOLD's control delta: the server half reads their plain sum); every value must lie within
   ``±flower.secagg_clip`` (a client whose update does not fails the round with that reason, never clipped silently);
   Flower quantizes each value to 2**22 levels over that range with stochastic rounding, which fedskew seeds from
   (seed, client, round) so a secure run reproduces exactly;
3. the server receives ``Σ_k w_k θ_k`` and ``Σ_k e_k`` over the clients that completed the protocol, divides by their
   ``Σ w_k`` (a client that failed mid-round leaves the others' weights renormalized: for FedDisco not recomputed
   over the survivors, the one departure from the plain run beyond the quantization) and closes the round with the
   streaming path's code (:meth:`~fedskew.server.api.Aggregation.aggregate_sums`).

What still travels in the clear, per client: its sample count and training-loss scalars (the round's record), the
integer buffers' values (BatchNorm's step counters, which follow from the sample count) and the layout of its upload.
User-level DP together with SecAgg+ is not built (the DP server reads the stacked uploads): refused.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.app.message_type import MessageType
from flwr.client.mod import secaggplus_mod
from flwr.common import Code, FitIns, FitRes, Parameters, Status, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS
from flwr.compat.common import recorddict_compat as compat
from flwr.server.client_manager import SimpleClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.compat.legacy_context import LegacyContext
from flwr.server.strategy import Strategy
from flwr.server.workflow import SecAggPlusWorkflow
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD, Key
from flwr.serverapp import Grid

from fedskew.config import ConfigError
from fedskew.flower.codec import from_record
from fedskew.methods import Method
from fedskew.protocol import Params, RoundInput
from fedskew.seeding import Purpose, numpy_rng
from fedskew.server.streaming import RunningSum

PARAM, EXTRA = "p", "e"  # the kinds of an upload's entries in the secure vector's layout
LAYOUT = "secagg_layout"  # the clear metric holding an upload's layout (JSON)
LEVELS = 2**22  # Flower's quantization range (its default): values in ±clip on this many levels
MODULUS = 2**32  # Flower's modulus range: the sum of a round's quantized values must stay below it


def cohort_weights(
    method: Method,
    state: Any,
    rnd: int,
    cids: list[int],
    num_train: np.ndarray,
    reports: Mapping[str, np.ndarray],
    global_params: Params,
    trainable: frozenset[str],
) -> list[float]:
    """The weights the server fixes before the round for the clients it sends to (``cids``, normalized over them):
    the composition's own weighting on what the server knows (sample counts, client reports), no upload read."""
    rows = {k: np.asarray(v)[cids] for k, v in reports.items()}
    rin = RoundInput(
        round=rnd,
        cids=tuple(cids),
        params={},
        num_samples=torch.tensor([float(num_train[c]) for c in cids], dtype=torch.float64),
        extras={},
        global_params=global_params,
        trainable=trainable,
        label_hists=rows.get("label_hist"),
        reports=rows,
    )
    weights, _ = method.server.weighting(rin, None, state)  # type: ignore[attr-defined]
    return [float(w) for w in weights]


# ---- the client's side -----------------------------------------------------------------------------------------
Layout = dict[str, Any]  # an upload's layout: its summed entries and their dtypes, its integer entries' values


def secure_vector(params: Params, extras: Params, weight: float, clip: float) -> tuple[list[np.ndarray], Layout]:
    """An upload as the vector SecAgg+ sums (``w θ`` per floating entry, extras as they are) and its layout (names,
    dtypes, the integer entries' values), which travels in the clear. Raises ``ValueError`` naming the entry whose
    value is not finite or lies outside ``±clip``."""
    arrays: list[np.ndarray] = []
    layout: list[str] = []
    dtypes: list[str] = []
    ints: dict[str, list[int]] = {}
    entries = [(PARAM, n, t) for n, t in params.items()] + [(EXTRA, n, t) for n, t in extras.items()]
    for kind, name, t in entries:
        if not t.is_floating_point():
            if kind == EXTRA:
                raise ValueError(f"extra {name!r} is not a floating tensor; SecAgg+ sums floating values only")
            ints[name] = [int(v) for v in t.reshape(-1).tolist()]
            continue
        v = t.detach().cpu().to(torch.float64).numpy() * (weight if kind == PARAM else 1.0)
        if not np.isfinite(v).all():
            raise ValueError(f"{name!r} is not finite; a secure sum would hide it from the server's checks")
        peak = float(np.abs(v).max()) if v.size else 0.0
        if peak > clip:
            what = f"{weight:.4g} x {name!r}" if kind == PARAM else f"extra {name!r}"
            raise ValueError(
                f"{what} reaches {peak:.4g}, outside SecAgg+'s range ±{clip:g}: raise flower.secagg_clip "
                "(values are quantized to 2**22 levels over the range) or lower the learning rate"
            )
        arrays.append(v)
        layout.append(f"{kind}:{name}")
        dtypes.append(str(t.dtype).removeprefix("torch."))
    return arrays, {"entries": layout, "dtypes": dtypes, "ints": ints}


def _as_fitres(call_next: Callable[[Message, Context], Message]) -> Callable[[Message, Context], Message]:
    """The ClientApp's ``train`` reply as the FitRes SecAgg+ masks: the secure vector with weight 1 (SecAgg+ then
    sums, the weights being inside the vector), the scalars and the layout in the clear."""

    def train(msg: Message, ctxt: Context) -> Message:
        conf = msg.content["config"]
        reply = call_next(msg, ctxt)
        if reply.has_error():
            raise RuntimeError(f"client {conf['cid']}: training failed: {reply.error.reason}")
        content = reply.content
        cid, rnd = int(conf["cid"]), int(conf["round"])  # type: ignore[arg-type]
        params, extras = from_record(content["params"], "cpu"), from_record(content["extras"], "cpu")  # type: ignore[arg-type]
        try:
            arrays, layout = secure_vector(params, extras, float(conf["secagg_weight"]), float(conf["secagg_clip"]))  # type: ignore[arg-type]
        except ValueError as exc:
            raise ValueError(f"client {cid}, round {rnd}: {exc}") from None
        metrics = {k: float(v) for k, v in content["metrics"].items()}  # type: ignore[union-attr]
        clear = {"cid": cid, LAYOUT: json.dumps(layout), **metrics}  # a FitRes carries scalars only: JSON
        fitres = FitRes(Status(Code.OK, ""), ndarrays_to_parameters(arrays), 1, clear)
        # Flower's stochastic rounding draws from NumPy's global generator: seeded here, a secure run reproduces
        np.random.seed(int(numpy_rng(int(conf["seed"]), Purpose.SECAGG, cid, rnd).integers(2**32)))  # type: ignore[arg-type]
        return Message(compat.fitres_to_recorddict(fitres, keep_input=False), reply_to=msg)

    return train


def secagg_mod(msg: Message, ctxt: Context, call_next: Callable[[Message, Context], Message]) -> Message:
    """fedskew's ClientApp mod: a ``train`` message of a SecAgg+ round goes through Flower's ``secaggplus_mod``
    (its key exchange, masking and unmasking stages; the training stage reaches the app through
    :func:`_as_fitres`); every other message passes straight through, so one ClientApp serves both kinds of run."""
    if msg.metadata.message_type == MessageType.TRAIN and RECORD_KEY_CONFIGS in msg.content.config_records:
        return secaggplus_mod(msg, ctxt, _as_fitres(call_next))
    return call_next(msg, ctxt)


# ---- the server's side -----------------------------------------------------------------------------------------
class _Node(ClientProxy):
    """A node as the legacy workflow addresses it (its node id only; fedskew sends through the Grid)."""

    def __init__(self, node_id: int) -> None:
        super().__init__(str(node_id))
        self.node_id = node_id

    def _unused(self, *_: Any, **__: Any) -> Any:
        raise NotImplementedError("fedskew's secure rounds send through the Grid, not through client proxies")

    get_properties = get_parameters = fit = evaluate = reconnect = _unused  # type: ignore[assignment]


@dataclass
class _Cohort(Strategy):
    """The legacy strategy the workflow asks: which nodes train (the round's), and where the sum goes."""

    nodes: list[int]
    results: list[tuple[ClientProxy, FitRes]] | None = None
    failures: list[Any] = field(default_factory=list)

    def configure_fit(self, server_round: int, parameters: Parameters, client_manager: Any) -> list[tuple[Any, Any]]:
        return [(_Node(n), FitIns(Parameters([], ""), {})) for n in self.nodes]

    def aggregate_fit(self, server_round: int, results: list[Any], failures: list[Any]) -> tuple[Any, dict]:
        self.results, self.failures = results, failures
        return None, {}

    def initialize_parameters(self, client_manager: Any) -> None:
        return None

    def configure_evaluate(self, *_: Any) -> list:
        return []

    def aggregate_evaluate(self, *_: Any) -> tuple[None, dict]:
        return None, {}

    def evaluate(self, *_: Any) -> None:
        return None


class _Workflow(SecAggPlusWorkflow):
    """Flower's SecAgg+ workflow whose training stage sends each node fedskew's own ``train`` content."""

    def __init__(self, contents: dict[int, RecordDict], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.contents = contents

    def setup_stage(self, grid: Grid, context: LegacyContext, state: Any) -> bool:
        ok = super().setup_stage(grid, context, state)
        state.nid_to_fitins = {nid: self.contents[nid] for nid in state.nid_to_fitins}
        return ok


class _Watched:
    """The Grid as the workflow uses it (``send_and_receive``), polled every ``poll`` seconds as fedskew's own
    exchanges are (Flower's polls every 3 s, per SecAgg+ stage), keeping each node's error reply: a failed client is
    recorded with its own reason (the workflow keeps the errors without their nodes)."""

    def __init__(self, grid: Grid, poll: float) -> None:
        self.grid = grid
        self.poll = poll
        self.errors: dict[int, str] = {}

    def send_and_receive(self, messages: Any, *, timeout: float | None = None) -> list[Message]:
        pending = {mid for mid in self.grid.push_messages(list(messages)) if mid}
        deadline = time.monotonic() + (timeout if timeout is not None else math.inf)
        replies: list[Message] = []
        while pending:
            for reply in self.grid.pull_messages(list(pending)):
                pending.discard(reply.metadata.reply_to_message_id)
                replies.append(reply)
            if not pending or time.monotonic() > deadline:
                break
            time.sleep(self.poll)
        for m in replies:
            if m.has_error():
                self.errors.setdefault(m.metadata.src_node_id, str(m.error.reason).strip().splitlines()[0][:400])
        return replies


@dataclass
class SecureRound:
    """What one SecAgg+ round gives the server: the survivors' sum and scalars, and who failed with why."""

    sum: RunningSum | None  # None: the protocol halted (fewer clients than its threshold remained)
    failed: dict[int, str]


def secure_round(
    grid: Grid,
    nodes: dict[int, int],
    contents: dict[int, RecordDict],
    weights: dict[int, float],
    global_params: Params,
    *,
    shares: float,
    threshold: float,
    clip: float,
    timeout: float,
    poll: float = 0.5,
    rnd: int,
) -> SecureRound:
    """Run one round's training through SecAgg+ (``contents``: each client's ``train`` content; ``nodes``: client id
    -> node id; ``weights``: each client's ``w_k``, which its content carries) and read the sum back as the
    streaming path's :class:`~fedskew.server.streaming.RunningSum`."""
    cid_of = {nodes[c]: c for c in contents}
    if len(contents) < 2:
        why = f"SecAgg+ needs at least 2 clients in a round, {len(contents)} were sent the model: not aggregated"
        return SecureRound(None, dict.fromkeys(contents, why))
    if len(contents) * LEVELS >= MODULUS:
        why = f"{len(contents)} clients' quantized values would overflow SecAgg+'s modulus 2**32: not aggregated"
        return SecureRound(None, dict.fromkeys(contents, why))
    strategy = _Cohort(sorted(cid_of))
    manager = SimpleClientManager()
    context = LegacyContext(Context(0, 0, {}, RecordDict(), {}), strategy=strategy, client_manager=manager)
    context.state.config_records[MAIN_CONFIGS_RECORD] = ConfigRecord({Key.CURRENT_ROUND: rnd})
    context.state.array_records[MAIN_PARAMS_RECORD] = ArrayRecord()
    workflow = _Workflow(
        {nodes[c]: content for c, content in contents.items()},
        num_shares=float(shares),
        reconstruction_threshold=float(threshold),
        max_weight=1.0,
        clipping_range=float(clip),
        quantization_range=LEVELS,
        modulus_range=MODULUS,
        timeout=timeout,
    )
    watched = _Watched(grid, poll)
    workflow(watched, context)  # type: ignore[arg-type]

    def why(c: int) -> str:
        own = watched.errors.get(nodes[c])
        return f"error: {own}" if own else f"no reply within {timeout:g} s during secure aggregation"

    if strategy.results is None:
        halted = "secure aggregation halted (fewer clients than its reconstruction threshold completed it)"
        return SecureRound(None, {c: f"{halted}; {why(c)}" if nodes[c] in watched.errors else halted for c in contents})
    got = {cid_of[p.node_id]: res for p, res in strategy.results}
    failed = {c: why(c) for c in contents if c not in got}
    if not got:
        return SecureRound(None, failed)
    total = parameters_to_ndarrays(strategy.results[0][1].parameters)  # the mean over the survivors; x n: the sum
    return SecureRound(_as_sums(got, total, weights, global_params), failed)


def _as_sums(
    got: dict[int, FitRes], mean: list[np.ndarray], weights: dict[int, float], global_params: Params
) -> RunningSum:
    """The survivors' secure mean (``mean``, over ``n`` of them) as running sums: ``n ×`` it is ``Σ w_k θ_k`` and
    ``Σ e_k``; the scalars from each client's clear metrics."""
    cids = sorted(got)
    layouts = {c: json.loads(str(got[c].metrics[LAYOUT])) for c in cids}
    entries, dtypes = layouts[cids[0]]["entries"], layouts[cids[0]]["dtypes"]
    for c in cids:
        if layouts[c]["entries"] != entries:
            raise ConfigError(f"client {c}'s upload has another layout than client {cids[0]}'s: the nodes differ")
    n = len(cids)
    sums: Params = {}
    extra_sums: Params = {}
    template: Params = {}
    device = next(iter(global_params.values())).device  # where the server aggregates (the model's: a GPU's too)
    for entry, dtype, arr in zip(entries, dtypes, mean, strict=True):
        kind, name = entry.split(":", 1)
        total = torch.from_numpy(np.asarray(arr, dtype=np.float64) * n).to(device)
        if kind == PARAM:
            sums[name] = total.reshape(global_params[name].shape)
        else:
            extra_sums[name] = total
            template[name] = torch.empty(total.shape, dtype=getattr(torch, dtype), device=device)
    for name, g in global_params.items():
        if not g.is_floating_point():  # integer buffers (in the clear): the maximum, as the weighted mean takes them
            values = [
                torch.tensor(layouts[c]["ints"][name], dtype=g.dtype, device=g.device).reshape(g.shape) for c in cids
            ]
            sums[name] = torch.stack(values).amax(0)
    missing = sorted(set(global_params) - set(sums))
    if missing:
        raise ConfigError(f"the secure sum lacks the model's entries {missing}: the nodes run another model")
    meta = {"cid", LAYOUT, "num-examples"}
    return RunningSum(
        global_params,
        lambda _n: None,
        cids=cids,
        num_samples=[float(got[c].metrics["num-examples"]) for c in cids],  # type: ignore[arg-type]
        metrics=[
            {k: float(v) for k, v in got[c].metrics.items() if k not in meta}  # type: ignore[arg-type]
            for c in cids
        ],
        raw_weights=[weights[c] for c in cids],
        sums=sums,
        extra_sums=extra_sums,
        extra_template=template,
        kind="secagg+",
    )
