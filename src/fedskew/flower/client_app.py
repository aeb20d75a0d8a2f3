"""fedskew's ClientApp: one federation client on a SuperNode, running the simulator's client code.

Handlers (message types):

* ``query.hello`` (once, before round 1): the client's id, its fedskew version and configuration hash (the server
  refuses a node that differs), the shape of its data, its training sample count and the client reports its method
  declares (:class:`~fedskew.protocol.ClientReport`: FedDisco's ``d_k``, FedGen's label histogram), computed on the
  client; nothing else about its data leaves it, and its test split never does;
* ``train``: one round of local training: :func:`fedskew.engine.rounds.train_client` (the method's
  :class:`~fedskew.client.local.LocalAlgorithm` on the one loop, batches from the (seed, client, round) stream) on the
  model it received with the entries it keeps for itself overlaid; replies with its upload (model, extra tensors,
  scalar metrics and ``num-examples``). Its persistent state (control variates, MOON's previous model, personal models,
  local heads) lives in ``context.state`` between rounds (:mod:`fedskew.flower.codec`);
* ``evaluate``: its correct predictions, loss and sample count on its local test split for each view the server asks
  for (``global_local``: the global model with its local entries; ``personal``; ``trained``), as the simulator scores
  each client.

The client is ``--node-config "cid=K"`` (stable across runs; Flower's node ids are not). It holds only its own data
(:mod:`fedskew.flower.node_data`): under ``flower.data = "partition"`` its part of the simulator's partition, built
once and cached on the node; under ``"node"`` the data in its own ``data-dir``. Every message builds the method's
objects and the model afresh, as a SuperNode's fresh ``flwr-clientapp`` process does (so a method that kept client
state anywhere but in ``client_state`` would show here, in process too).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from torch import nn

from fedskew import __version__
from fedskew.client.local import TrainSettings, snapshot
from fedskew.config import ConfigError, RunConfig
from fedskew.data.pools import ClientData
from fedskew.engine.evaluate import predict_scores
from fedskew.engine.kernels import set_kernels
from fedskew.engine.model_init import init_model
from fedskew.engine.rounds import (
    LOCAL_PARAMS,
    UpdateClip,
    keep_trained,
    personalized,
    train_client,
    train_settings,
    with_local,
)
from fedskew.flower.codec import from_record, load_state, metrics_record, save_state, to_record
from fedskew.flower.hello import NodeReport
from fedskew.flower.node_data import NodePart, cached_part, own_part
from fedskew.flower.secagg import secagg_mod
from fedskew.flower.settings import FlowerSettings, config_hash, node_overrides, parse_run_config
from fedskew.methods import Method, resolve_method
from fedskew.privacy.server import noised_entries
from fedskew.protocol import Params

app = ClientApp(mods=[secagg_mod])  # SecAgg+'s stages for a secure round's train messages; others pass


@dataclass
class _Shared:
    """What a client builds from the configuration for one message."""

    part: NodePart  # its own data only
    method: Method
    model: nn.Module
    initial: Params  # the initial model: what a client holds of its local entries before it first trains
    settings: TrainSettings


_PARTS: dict[str, NodePart] = {}  # this process's part per configuration (JSON); one entry per process


def _part(cfg: RunConfig, cid: int, settings: FlowerSettings, node_config: dict[str, Any]) -> NodePart:
    key = json.dumps([cfg.model_dump(exclude={"out", "db"}), cid, settings.data], sort_keys=True, default=str)
    if key not in _PARTS:
        _PARTS.clear()
        _PARTS[key] = own_part(cfg, cid) if settings.data == "node" else cached_part(cfg, cid, node_config)
    return _PARTS[key]


def _shared(cfg: RunConfig, cid: int, settings: FlowerSettings, node_config: dict[str, Any]) -> _Shared:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    set_kernels(cfg.device, cfg.tf32, cfg.cudnn_benchmark)  # the node's process runs this configuration alone
    part = _part(cfg, cid, settings, node_config)
    method = resolve_method(cfg.method, cfg.method_args)
    model = init_model(cfg, part.federation(), method)
    return _Shared(part, method, model, snapshot(model), train_settings(cfg))


@dataclass(frozen=True)
class _Client:
    cfg: RunConfig
    cid: int
    shared: _Shared

    @property
    def data(self) -> ClientData:
        return self.shared.part.client


def _client(context: Context) -> _Client:
    cid, overrides = node_overrides(context.node_config)
    cfg, settings = parse_run_config(context.run_config, overrides)
    if cid >= cfg.clients:
        raise ConfigError(f"this node is client {cid}, but the federation has clients 0..{cfg.clients - 1}")
    return _Client(cfg, cid, _shared(cfg, cid, settings, dict(context.node_config)))


def _checked(client: _Client, msg: Message) -> ConfigRecord:
    conf = msg.content["config"]
    if int(conf["cid"]) != client.cid:  # type: ignore[arg-type]
        raise ConfigError(f"a message for client {conf['cid']} reached client {client.cid}")
    return conf  # type: ignore[return-value]


def _local(client_state: dict[str, Any], initial: Params, names: list[str]) -> Params:
    """The entries the client keeps for itself: its own after it first trained, the initial model's before."""
    return client_state.get(LOCAL_PARAMS) or {k: initial[k] for k in names}


@app.query("hello")
def hello(msg: Message, context: Context) -> Message:
    """Once, before round 1: the client's id, the fedskew version and configuration hash it runs (the server refuses
    a node that differs), the shape of its data (classes, input), its training sample count and the client reports
    the server asks for, which its method declares (protocol.ClientReport: e.g. FedDisco's d_k), computed here from
    its own labels. Nothing else about its data leaves it; its test split never does."""
    client = _client(context)
    conf = msg.content["config"]
    part, method = client.shared.part, client.shared.method
    declared = {r.name: r for r in method.reports}
    wanted = [str(n) for n in conf.get("reports", [])]  # type: ignore[union-attr]
    unknown = [n for n in wanted if n not in declared]
    if unknown:
        raise ConfigError(
            f"the server asks client {client.cid} for reports {unknown}, which its method {method.name!r} does not "
            f"declare ({sorted(declared) or 'none'}): the nodes run another configuration or fedskew version"
        )
    shape = (part.num_classes, part.in_channels, part.image_size)
    domain = str(context.node_config.get("domain", ""))
    tokens = not part.client.x_train.is_floating_point()
    report = NodeReport.measure(client.cid, part.train_hist, shape, declared, wanted, domain, tokens, part.vocabulary)
    content = report.content(__version__, config_hash(client.cfg))
    return Message(content, reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    """One round of local training on the received model; the upload goes back, the client's state stays."""
    client = _client(context)
    conf = _checked(client, msg)
    cfg, sh, dev = client.cfg, client.shared, client.cfg.device
    names = list(conf["local_names"])  # type: ignore[arg-type]
    state, trained = load_state(context.state, dev)
    if names:  # as in the simulator, the state holds the local entries from the start
        state[LOCAL_PARAMS] = _local(state, sh.initial, names)
    received = with_local(from_record(msg.content["model"], dev), state.get(LOCAL_PARAMS), sh.initial)  # type: ignore[arg-type]
    broadcast = from_record(msg.content["broadcast"], dev)  # type: ignore[arg-type]
    rnd = int(conf["round"])  # type: ignore[arg-type]
    args = (sh.method, sh.model, sh.settings, cfg.seed, client.cid, rnd, received, broadcast, state)
    data = client.data
    # user-level DP: the node clips its own update (the server adds the noise), as the simulator's clients do
    clip = (
        UpdateClip(cfg.dp_clip, noised_entries(sh.initial, frozenset(names)), cfg.dp_extras_scale)
        if cfg.dp_clip is not None
        else None
    )
    update = train_client(*args, data.x_train, data.y_train, data.x_val, data.y_val, clip)
    own_args = (sh.method, sh.model, sh.settings, cfg.seed, client.cid, rnd)
    tune = lambda p: personalized(*own_args, p, state, data.x_train, data.y_train)  # noqa: E731
    kept = keep_trained(sh.method, frozenset(names), state, update, tune)
    save_state(context.state, state, kept if kept is not None else trained)
    content = RecordDict(
        {
            "params": to_record(update.params),
            "extras": to_record(update.extras),
            "metrics": metrics_record({"num-examples": update.num_samples, **update.metrics}),
            "meta": ConfigRecord({"cid": client.cid}),
        }
    )
    return Message(content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Correct predictions, summed loss and sample count on the local test split, per view asked for."""
    client = _client(context)
    conf = _checked(client, msg)
    sh, dev = client.shared, client.cfg.device
    state, trained = load_state(context.state, dev)
    local = _local(state, sh.initial, list(conf["local_names"]))  # type: ignore[arg-type]
    glob = from_record(msg.content["global"], dev)  # type: ignore[arg-type]
    server_personal = from_record(msg.content["personal"], dev) if "personal" in msg.content else glob  # type: ignore[arg-type]
    own = sh.method.client.personal_model(state)
    if own is None:
        args = (sh.method, sh.model, sh.settings, client.cfg.seed, client.cid, int(conf["round"]))  # type: ignore[arg-type]
        data = client.data
        own = personalized(*args, with_local(server_personal, local, sh.initial), state, data.x_train, data.y_train)
    personal = own
    models = {"global_local": with_local(glob, local, sh.initial), "personal": personal, "trained": trained or personal}
    x, y = client.data.x_test, client.data.y_test
    owner = torch.zeros(x.shape[0], dtype=torch.long, device=x.device)
    scores: dict[str, float] = {}
    for view in conf["views"]:  # type: ignore[union-attr]
        sh.model.load_state_dict(models[str(view)])
        s = predict_scores(sh.model, x, y, owner, 1, int(conf["eval_batch"]))  # type: ignore[arg-type]
        scores.update({f"{view}/correct": s.correct[0], f"{view}/loss_sum": s.loss_sum[0], f"{view}/count": s.count[0]})
    record = MetricRecord({k: float(v) for k, v in scores.items()})
    content = RecordDict({"scores": record, "meta": ConfigRecord({"cid": client.cid})})
    return Message(content, reply_to=msg)
