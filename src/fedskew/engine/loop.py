"""The one round loop. Methods plug into it; none copies it.

One round, as a reader should see it::

    sampled = sample(round) - dropped_out(round)       # both seeded by (seed, round), independent streams
    for cid in sampled:
        received = personal[cid] or global             # what this client gets (+ server broadcast extras)
        update   = local_train(method.client, ...)     # one reusable model, resident tensors, seeded order
        stack.add(update)                              # validated into preallocated [K, ...] buffers (or rejected)
    rin      = stack.round_input()                     # on_bad_update: fail raises, drop aggregates the rest
    server   = method.server.aggregate(rin, state)     # weights -> masks -> combine, or personalized
    evaluate(global / global_local / personal views)   # on the eval cadence
    record   -> metrics.jsonl, SQLite, progress bar
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from fedskew.client.local import LocalContext, TrainSettings, local_train, snapshot
from fedskew.config import ConfigError, RunConfig
from fedskew.data.federated import FederatedData
from fedskew.engine.evaluate import (
    ClientScores,
    accumulate,
    auto_eval_batch,
    batch_scores,
    client_part_views,
    domain_summary,
    pooled,
    summarize,
)
from fedskew.engine.probe import skew_probe
from fedskew.methods import Method, resolve_method
from fedskew.models import build_model, head_keys, norm_keys
from fedskew.protocol import ClientUpdate, NonFiniteUpdateError, Params, ServerContext
from fedskew.seeding import Purpose, numpy_rng, torch_generator, torch_seed
from fedskew.server.api import UploadStack, check_model

if TYPE_CHECKING:
    from fedskew.engine.workers import ClientWorkers

EvalSource = str | tuple[str, int]  # an evaluation pass's samples (Simulation.eval_tensors)


def payload_bytes(tensors: Params) -> int:
    """Bytes on the wire: boolean tensors (masks) count 1 bit per element, others their dtype size."""
    total = 0
    for t in tensors.values():
        total += math.ceil(t.numel() / 8) if t.dtype == torch.bool else t.numel() * t.element_size()
    return total


def sample_clients(seed: int, rnd: int, num_clients: int, join_ratio: float) -> list[int]:
    """``max(1, round(join_ratio * N))`` distinct clients, drawn from a stream keyed by (seed, round)."""
    m = max(1, int(round(join_ratio * num_clients)))
    if m >= num_clients:
        return list(range(num_clients))
    rng = numpy_rng(seed, Purpose.SAMPLING, rnd)
    return sorted(int(c) for c in rng.choice(num_clients, size=m, replace=False))


def dropped_out(seed: int, rnd: int, sampled: list[int], num_clients: int, p: float) -> list[int]:
    """The sampled clients that fail to report in round ``rnd``, each with probability ``p``.

    One uniform number per client of the federation is drawn from a stream keyed by (seed, round) of its own
    (:attr:`Purpose.DROPOUT`); client ``c`` drops out when ``u[c] < p``. So sampling is the same with or without
    dropout, whether a client drops out depends on nothing but (seed, round, client, p), and a larger ``p`` only
    removes more clients."""
    if p <= 0:
        return []
    u = numpy_rng(seed, Purpose.DROPOUT, rnd).random(num_clients)
    return [c for c in sampled if u[c] < p]


def _same_samples(data: FederatedData) -> bool:
    """Whether the global test set is exactly the clients' local test splits in client order (by source index)."""
    parts = [c.test_index for c in data.clients]
    if data.test_index is None or any(p is None for p in parts):
        return False
    return bool(np.array_equal(np.concatenate(parts), data.test_index))


class Diverged(RuntimeError):
    """Training diverged: a non-finite or exploding training loss, or a non-finite model. The run stops there."""

    def __init__(self, rnd: int, reason: str) -> None:
        super().__init__(f"training diverged in round {rnd}: {reason}")
        self.round = rnd
        self.reason = reason


def resolve_model_name(cfg: RunConfig, data: FederatedData, method: Method | None = None) -> str:
    """The model ``auto`` stands for: ``cnn`` for images of at least 16 px, else ``mlp``; a method that keeps the
    normalization layers on the clients (FedBN) gets ``lenet_bn``, the smallest zoo model with BatchNorm."""
    if cfg.model != "auto":
        return cfg.model
    if method is not None and "norm" in method.local:
        return "lenet_bn"
    return "cnn" if data.image_size >= 16 else "mlp"


UserModel = nn.Module | Callable[[], nn.Module]


def user_model_name(model: UserModel) -> str:
    """How a user's model is recorded in config.yaml: ``custom:<class or function name>``."""
    name = type(model).__name__ if isinstance(model, nn.Module) else getattr(model, "__name__", type(model).__name__)
    return f"custom:{name}"


def init_model(
    cfg: RunConfig, data: FederatedData, method: Method | None = None, user_model: UserModel | None = None
) -> nn.Module:
    """Build the model with weights drawn from the run's init stream (global torch RNG left untouched).

    ``user_model``: a module of the user's (copied, its weights are the initial model) or a function returning one
    (called under the init stream, so the seed fixes its weights), split into body + head by
    :func:`fedskew.models.custom.split_model` (checked on a batch of client 0's data)."""
    if user_model is not None:
        from fedskew.models.custom import prepare_user_model

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(torch_seed(cfg.seed, Purpose.INIT))
            example = data.clients[0].x_train[:2].cpu()
            model = prepare_user_model(user_model, example, method.model_options if method is not None else {})
        return _placed(model, cfg)
    if cfg.model.startswith("custom:"):
        raise ConfigError(
            f"model {cfg.model!r} was a user's model; pass it again: fedskew.run(..., model=...) (docs/extending.md)"
        )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(torch_seed(cfg.seed, Purpose.INIT))
        model = build_model(
            resolve_model_name(cfg, data, method),
            in_channels=data.in_channels,
            image_size=data.image_size,
            num_classes=data.num_classes,
            norm=cfg.norm,
            **(method.model_options if method is not None else {}),
        )
    return _placed(model, cfg)


def _placed(model: nn.Module, cfg: RunConfig) -> nn.Module:
    """The model on the run's device, its 4-D (convolution) weights channels-last when ``cfg.channels_last``: the
    layout is kept through ``load_state_dict`` (a copy into the existing tensors), so every client trains in it."""
    model = model.to(torch.device(cfg.device))
    return model.to(memory_format=torch.channels_last) if cfg.channels_last else model


LOCAL_GROUPS = {
    "buffers": "non-trainable entries (BatchNorm running statistics)",
    "head": "the classifier head (FedPer, FedRep)",
    "norm": "normalization layers: affine parameters and running statistics (FedBN)",
    "all": "every entry: no collaboration (Local / Separate)",
}


def local_state_names(groups: frozenset[str], model: nn.Module, trainable: frozenset[str]) -> frozenset[str]:
    """State-dict names behind the groups (:data:`LOCAL_GROUPS`) a method keeps on the clients."""
    template = model.state_dict()
    names: set[str] = set()
    for group in groups:
        if group == "buffers":
            names |= {n for n in template if n not in trainable}
        elif group == "head":
            names |= head_keys(model)
        elif group == "norm":
            found = norm_keys(model)
            if not found:
                raise ConfigError(
                    f"the model has no normalization layers, so keeping them local (FedBN) would be plain FedAvg; "
                    f"use a model with BatchNorm (e.g. --model resnet8), got layers {sorted(template)[:4]}..."
                )
            names |= found
        elif group == "all":
            names |= set(template)
        else:
            raise ConfigError(f"unknown client-local group {group!r}; known: {', '.join(LOCAL_GROUPS)}")
    return frozenset(names)


@dataclass
class RoundResult:
    record: dict[str, Any]  # one line of metrics.jsonl
    client_scores: dict[str, ClientScores] = field(default_factory=dict)  # view -> per-client scores
    probe: dict[str, Any] | None = None  # parameter-skew probe (evaluated rounds), see engine/probe.py


@dataclass
class RoundPlan:
    """One round in progress on the server: who was sampled and who dropped out (both seeded), what the server
    broadcasts, and what the uploads taken so far came to. :meth:`Simulation.open_round` makes it,
    :meth:`Simulation.take_upload` fills it (one upload at a time, in client order), :meth:`Simulation.close_round`
    aggregates, evaluates and records it. The simulator trains the clients in between; a deployment (Flower) sends
    them messages, and fills ``failed`` with the sampled clients that never replied."""

    rnd: int
    sampled: list[int]
    gone: set[int]  # sampled, but drop out before reporting (client_dropout, seeded)
    broadcast: Params
    stack: UploadStack
    t0: float
    losses: list[tuple[int, int, float]] = field(default_factory=list)  # (cid, samples, loss) of counted uploads
    bytes_up: int = 0
    bytes_down: int = 0
    failed: list[dict[str, Any]] = field(default_factory=list)  # [{"client": cid, "reason": ...}] (deployments)


def train_settings(cfg: RunConfig) -> TrainSettings:
    """The local optimizer's settings of a run and its number of rounds (every client's, wherever it trains)."""
    return TrainSettings(
        epochs=cfg.local_epochs,
        batch_size=cfg.batch_size,
        lr=cfg.lr,
        momentum=cfg.momentum,
        weight_decay=cfg.weight_decay,
        drop_last=cfg.drop_last,
        rounds=cfg.rounds,
    )


def train_client(
    method: Method,
    model: nn.Module,
    settings: TrainSettings,
    seed: int,
    cid: int,
    rnd: int,
    received: Params,
    broadcast: Params,
    client_state: dict[str, Any],
    x: torch.Tensor,
    y: torch.Tensor,
    x_val: torch.Tensor | None = None,
    y_val: torch.Tensor | None = None,
) -> ClientUpdate:
    """Client ``cid``'s local training in round ``rnd``, wherever the client runs (the simulator, a Flower
    ClientApp): the method's local algorithm on the one loop, batches drawn from the (seed, client, round) stream.
    ``client_state`` is the client's persistent state and advances in place. ``x_val``/``y_val``: its validation
    split, if the run has one (hooks may score it; it is never trained on)."""
    ctx = LocalContext(
        cid=cid,
        round=rnd,
        model=model,
        received=received,
        client_state=client_state,
        broadcast=broadcast,
        settings=settings,
        x_val=x_val,
        y_val=y_val,
    )
    gen = torch_generator(seed, Purpose.SHUFFLE, cid, rnd)
    return local_train(method.client, ctx, x, y, gen, method.uploads)


def keep_trained(
    method: Method, local_names: frozenset[str], client_state: dict[str, Any], update: ClientUpdate
) -> Params | None:
    """What a client keeps of the model it trained: its local entries (``method.local``) go into
    ``client_state["local_params"]``; for a personalized method the model the ``trained`` view evaluates is returned
    (the model it keeps for itself, else the one it trained), otherwise ``None``."""
    if local_names:
        client_state["local_params"] = {k: update.params[k] for k in local_names}
    if method.personalized:
        own = method.client.personal_model(client_state)
        return own if own is not None else update.params
    return None


def with_local(received: Params, local: Params | None, order: Params) -> Params:
    """The model a client holds after receiving ``received``: the entries it keeps for itself (``local``)
    overlaid, keys in the order of ``order`` (the model's state dict)."""
    if not local:
        return received
    return {k: local[k] if k in local else received[k] for k in order}


def global_views(server: Any, global_params: Params) -> dict[str, float]:
    """The server-side views of the global model (loaded into ``server.model``): on the global test set (per domain
    under domain skew, skipped when it is exactly the clients' test splits, scored there), plus the views the client
    part adds (FedProto's nearest-prototype accuracy). ``server``: a :class:`Simulation` or a deployment's server
    (Flower's), with ``model``, ``data``, ``eval_batch``, ``method``, ``client_server_state``,
    ``global_is_local_union`` and ``local_names``."""
    data, bs, model = server.data, server.eval_batch, server.model
    model.load_state_dict(global_params)
    rec: dict[str, float] = {}
    # views the client part adds (FedProto's nearest-prototype accuracy); {} for every other method
    rec.update(client_part_views(server.method.client, server.client_server_state, model, data, bs))
    if data.domains:  # one pass, per domain; the global numbers pool the domains
        assert data.test_domain is not None
        ds = accumulate(_test_pass(server, global_params), data.test_domain, len(data.domains))
        rec.update(pooled("global", ds))
        rec.update(domain_summary(data.domains, ds))
    elif not (server.global_is_local_union and not server.local_names):
        owner = torch.zeros(data.x_test.shape[0], dtype=torch.long, device=data.x_test.device)
        rec.update(pooled("global", accumulate(_test_pass(server, global_params), owner, 1)))
    return rec


def _test_pass(server: Any, global_params: Params) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The global model's batch scores on the global test set: through the server's ``batch_scores_of`` (the
    simulator's worker processes) where it has one, else with ``server.model``, which holds ``global_params``."""
    passes = getattr(server, "batch_scores_of", None)
    if passes is not None:
        return passes([(global_params, "test")])[0]
    return batch_scores(server.model, server.data.x_test, server.data.y_test, server.eval_batch)


class Simulation:
    """A seeded, single-process simulation of one federation."""

    def __init__(
        self, cfg: RunConfig, data: FederatedData, method: Method | None = None, model: UserModel | None = None
    ) -> None:
        self.cfg = cfg
        self.data = data
        self.method = method or resolve_method(cfg.method, cfg.method_args)
        self.model = init_model(cfg, data, self.method, model)
        self.global_params: Params = snapshot(self.model)
        self.trainable = frozenset(n for n, p in self.model.named_parameters() if p.requires_grad)
        self.personal: dict[int, Params] = {}  # per-client models the server sent (personalized strategies)
        self.trained: dict[int, Params] = {}  # personalized methods: each client's model after its latest training
        self.client_states: dict[int, dict[str, Any]] = {c: {} for c in range(data.num_clients)}
        self.settings = train_settings(cfg)
        self.ctx = ServerContext(
            num_clients=data.num_clients,
            num_classes=data.num_classes,
            template=self.global_params,
            trainable=self.trainable,
            num_train=data.num_train,
            label_hists=data.train_hists,
            seed=cfg.seed,
        )
        local_groups = self.method.local | ({"buffers"} if cfg.protocol == "pfllib" else set())
        self.local_names = local_state_names(frozenset(local_groups), self.model, self.trainable)
        if self.local_names:  # a client that has not trained yet holds the initial model's entries, not the average
            initial = {k: self.global_params[k] for k in self.local_names}
            for state in self.client_states.values():
                state["local_params"] = initial
        self.eval_batch = (
            auto_eval_batch(self.model, data.x_test) if cfg.eval_batch_size == "auto" else cfg.eval_batch_size
        )
        # the global test set is the clients' test splits together (protocol pfllib): score it once, as theirs
        self.global_is_local_union = _same_samples(data)
        # the training loss of a uniform prediction is ln(classes); a round above divergence_factor times that diverged
        self.loss_limit = cfg.divergence_factor * math.log(data.num_classes) if cfg.divergence_factor else math.inf
        self.server_state = self.method.server.init(self.ctx)
        self.client_server_state = self.method.client.server_init(self.ctx)
        self._workers: ClientWorkers | None = None  # forked at the first round that uses them (cfg.workers > 1)
        self.batched = cfg.batched_clients and self._batch_fallback() is None

    def _batch_fallback(self) -> str | None:
        """Why ``batched_clients`` cannot be used for this method and model (warned once), else ``None``."""
        from fedskew.engine.batched import batchable

        why = batchable(self.method, self.model)
        if why is not None:
            warnings.warn(f"batched_clients: {why}; training the clients one after the other", stacklevel=3)
        return why

    @property
    def model_name(self) -> str:
        return resolve_model_name(self.cfg, self.data, self.method)

    # ---- one round ---------------------------------------------------------------------------------------
    def round(self, rnd: int) -> RoundResult:
        plan = self.open_round(rnd)
        reporting = [cid for cid in plan.sampled if cid not in plan.gone]  # drop-outs: no training, no state change
        # each upload is validated into preallocated [K, ...] buffers as soon as it is trained, then dropped
        for update in self._train_clients(rnd, reporting, plan.broadcast):
            self.take_upload(plan, update)
        return self.close_round(plan)

    def _train_clients(self, rnd: int, cids: list[int], broadcast: Params) -> Iterator[ClientUpdate]:
        """The uploads of ``cids``, in that order: trained one after the other, in ``workers`` forked processes
        (``engine/workers.py``: identical results), or together, vmapped (``batched_clients``, ``engine/batched.py``:
        equal up to float32 rounding)."""
        if self.batched:
            from fedskew.engine.batched import train_batched

            received = {cid: self.params_for(cid) for cid in cids}
            yield from train_batched(self, rnd, cids, received, broadcast)
        elif self.cfg.workers > 1 and len(cids) > 1:
            if self._workers is None:
                from fedskew.engine.workers import ClientWorkers

                self._workers = ClientWorkers(self, min(self.cfg.workers, self.data.num_clients))
            yield from self._workers.train(self, rnd, [(cid, self.params_for(cid), broadcast) for cid in cids])
        else:
            for cid in cids:
                yield self._train(cid, rnd, self.params_for(cid), broadcast)

    def close(self) -> None:
        """Stop the worker processes, if any (the runner calls it when the run ends, however it ends)."""
        if self._workers is not None:
            self._workers.close()
            self._workers = None

    def open_round(self, rnd: int) -> RoundPlan:
        """Start round ``rnd``: sample (seeded by (seed, round)), draw the drop-outs, prepare the upload buffers;
        every sampled client is sent its model and the broadcast, whether or not it reports."""
        cfg, data, method = self.cfg, self.data, self.method
        t0 = time.perf_counter()
        sampled = sample_clients(cfg.seed, rnd, data.num_clients, cfg.join_ratio)
        gone = set(dropped_out(cfg.seed, rnd, sampled, data.num_clients, cfg.client_dropout))
        broadcast = method.client.broadcast(self.client_server_state)
        plan = RoundPlan(rnd, sampled, gone, broadcast, UploadStack(len(sampled) - len(gone), self.global_params), t0)
        plan.bytes_down = sum(self.wire_bytes(self.params_for(cid)) + payload_bytes(broadcast) for cid in sampled)
        return plan

    def take_upload(self, plan: RoundPlan, update: ClientUpdate) -> None:
        """Validate one client's upload into the round's buffers (or reject it under ``on_bad_update``)."""
        cid = update.cid
        plan.bytes_up += self.wire_bytes(update.params) + payload_bytes(update.extras)
        rejected = plan.stack.add(update)
        if rejected is None or rejected.nonfinite:  # the client holds the model it trained (see README)
            self._keep_trained(cid, update)
        if rejected is None or self.cfg.on_bad_update == "fail":
            plan.losses.append((cid, update.num_samples, update.metrics.get("train_loss", math.nan)))

    def close_round(self, plan: RoundPlan) -> RoundResult:
        """Aggregate the round's uploads with the method's server strategy, evaluate on the cadence, record."""
        cfg, data, method = self.cfg, self.data, self.method
        rnd, sampled, gone, stack = plan.rnd, plan.sampled, plan.gone, plan.stack
        t0, t1 = plan.t0, time.perf_counter()
        train_loss = self._check_training(rnd, plan.losses)
        if stack.rejected and cfg.on_bad_update == "fail":  # a malformed upload before a non-finite one
            error = min(stack.rejected, key=lambda r: r.nonfinite).error()
            if isinstance(error, NonFiniteUpdateError):  # fedskew trained these clients itself: that is divergence
                raise Diverged(rnd, str(error))
            raise error

        record: dict[str, Any] = {"round": rnd, "participants": stack.count, "train_loss": train_loss}
        if cfg.client_dropout > 0 or cfg.on_bad_update == "drop" or plan.failed:
            record["sampled"] = len(sampled)
        if cfg.client_dropout > 0:
            record["dropped_out"] = sorted(gone)
        if cfg.on_bad_update == "drop":
            record["dropped"] = [r.as_record() for r in stack.rejected]
        if plan.failed:
            record["failed"] = plan.failed
        rin, out = None, None
        if stack.count:
            rin = stack.round_input(rnd=rnd, trainable=self.trainable, label_hists=data.train_hists[stack.cids])
            self.client_server_state = method.client.server_update(rin, self.client_server_state)
            out, self.server_state = method.server.aggregate(rin, self.server_state)
            self._check_models(rnd, out.global_params, out.personal)
            self.global_params = out.global_params
            if out.personal:
                self.personal.update(out.personal)
        elif len(gone) == len(sampled):  # nobody to aggregate: every model and all server state stay as they are
            record["skipped_aggregation"] = "every sampled client dropped out"
        else:
            record["skipped_aggregation"] = "no sampled client replied" if plan.failed else "no valid upload"
        t2 = time.perf_counter()

        scores: dict[str, ClientScores] = {}
        evaluated = rnd % cfg.eval_every == 0 or rnd == cfg.rounds
        probe = None
        if evaluated:
            record_eval, scores = self.evaluate()
            record.update(record_eval)
        t3 = time.perf_counter()
        if evaluated and cfg.skew_probes and rin is not None:
            probe = skew_probe(rin, self.global_params, cfg.skew_probes, cfg.seed)
        t4 = time.perf_counter()
        record.update(
            {
                "bytes_up": plan.bytes_up,
                "bytes_down": plan.bytes_down,
                "time_train": t1 - t0,
                "time_aggregate": t2 - t1,
                "time_eval": t3 - t2,
                "time_probe": t4 - t3,
                "time_round": t4 - t0,
                "evaluated": evaluated,
            }
        )
        if out is not None and out.diagnostics:
            record["diagnostics"] = out.diagnostics
        return RoundResult(record, scores, probe)

    def _train(self, cid: int, rnd: int, received: Params, broadcast: Params) -> ClientUpdate:
        """Client ``cid``'s local training in round ``rnd`` (its persistent state advances in ``client_states``)."""
        client = self.data.clients[cid]
        state = self.client_states[cid]
        args = (self.method, self.model, self.settings, self.cfg.seed, cid, rnd, received, broadcast, state)
        return train_client(*args, client.x_train, client.y_train, client.x_val, client.y_val)

    def _keep_trained(self, cid: int, update: ClientUpdate) -> None:
        """What the client keeps of the model it trained: its local entries and, for personalized methods, the
        model the ``trained`` view evaluates (:func:`keep_trained`)."""
        trained = keep_trained(self.method, self.local_names, self.client_states[cid], update)
        if trained is not None:
            self.trained[cid] = trained

    def _check_training(self, rnd: int, losses: list[tuple[int, int, float]]) -> float | None:
        """The round's sample-weighted training loss over ``(cid, samples, loss)`` (``None`` when empty);
        :class:`Diverged` when a client's loss is not finite or the round's exceeds ``divergence_factor ×
        ln(classes)``."""
        if not losses:
            return None
        for cid, _, loss in losses:
            if not math.isfinite(loss):
                raise Diverged(rnd, f"client {cid}'s training loss is {loss}")
        n = np.array([s for _, s, _ in losses], dtype=np.float64)
        mean = float((n * np.array([loss for _, _, loss in losses])).sum() / n.sum())
        if mean > self.loss_limit:
            raise Diverged(
                rnd,
                f"training loss {mean:.3g} exceeds divergence_factor × ln({self.data.num_classes}) = "
                f"{self.loss_limit:.3g}",
            )
        return mean

    def _check_models(self, rnd: int, global_params: Params, personal: dict[int, Params] | None) -> None:
        """The server's models must match the template (names, shapes, dtypes) and be finite."""
        models = {"the aggregated global model": global_params}
        models.update({f"client {cid}'s personalized model": p for cid, p in (personal or {}).items()})
        for what, params in models.items():
            bad = check_model(params, self.ctx.template, f"round {rnd}, {what}")
            if bad:
                raise Diverged(rnd, f"{what} holds NaN or Inf in {', '.join(bad[:3])}")

    def wire_bytes(self, params: Params) -> int:
        """Bytes of a model exchange; entries the clients keep locally (``method.local``) never travel."""
        return payload_bytes({k: v for k, v in params.items() if k not in self.local_names})

    def params_for(self, cid: int, base: Params | None = None) -> Params:
        """The model client ``cid`` holds after receiving ``base`` (default: its personal or the global model),
        with the state-dict entries it keeps for itself (``method.local``) overlaid."""
        params = base if base is not None else self.personal.get(cid, self.global_params)
        own = self.client_states[cid].get("local_params")
        return {**params, **own} if own else params

    def personal_params(self, cid: int) -> Params:
        """Client ``cid``'s personalized model now, i.e. after aggregation: the model it keeps for itself (Ditto,
        FedAMP) or else what it would start its next round from (FedCAC's customized model, or the global model
        with its local entries for FedPer/FedRep/FedBN/Local)."""
        own = self.method.client.personal_model(self.client_states[cid])
        return own if own is not None else self.params_for(cid)

    def trained_params(self, cid: int) -> Params:
        """Client ``cid``'s model right after its latest local training (before aggregation); a client that has not
        trained yet holds its personalized model."""
        return self.trained.get(cid) or self.personal_params(cid)

    # ---- evaluation views --------------------------------------------------------------------------------
    def eval_tensors(self, source: EvalSource) -> tuple[torch.Tensor, torch.Tensor]:
        """The test samples of an evaluation pass: ``"local"`` (every client's test split, in client order),
        ``"test"`` (the global test set) or ``("client", cid)``."""
        if source == "local":
            return self.data.local_x, self.data.local_y
        if source == "test":
            return self.data.x_test, self.data.y_test
        c = self.data.clients[source[1]]
        return c.x_test, c.y_test

    def batch_scores_of(self, passes: list[tuple[Params, EvalSource]]) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
        """Per ``(params, source)`` pass, its :func:`~fedskew.engine.evaluate.batch_scores`: in the worker processes
        when there are any (split into ranges of whole batches: the same numbers), else here."""
        if self._workers is not None:
            return self._workers.score(self, passes, self.eval_batch)
        out = []
        for params, source in passes:
            self.model.load_state_dict(params)
            out.append(batch_scores(self.model, *self.eval_tensors(source), self.eval_batch))
        return out

    def _per_client_scores(self, params_of: Callable[[int], Params]) -> ClientScores:
        data = self.data
        correct, loss, count = (np.zeros(data.num_clients) for _ in range(3))
        passes: list[tuple[Params, EvalSource]] = [(params_of(c.cid), ("client", c.cid)) for c in data.clients]
        for c, batches in zip(data.clients, self.batch_scores_of(passes), strict=True):
            owner = torch.zeros(c.x_test.shape[0], dtype=torch.long, device=c.x_test.device)
            s = accumulate(batches, owner, 1)
            correct[c.cid], loss[c.cid], count[c.cid] = s.correct[0], s.loss_sum[0], s.count[0]
        return ClientScores(correct, loss, count)

    def evaluate(self) -> tuple[dict[str, float], dict[str, ClientScores]]:
        """Every view once: each distinct (model, sample) pair is scored at most once."""
        data = self.data
        rec: dict[str, float] = global_views(self, self.global_params)
        if self.local_names:  # each client evaluates the global model with the entries it keeps locally
            scores = {"global_local": self._per_client_scores(lambda cid: self.params_for(cid, self.global_params))}
        else:  # one pass over all clients' test sets
            (batches,) = self.batch_scores_of([(self.global_params, "local")])
            scores = {"global_local": accumulate(batches, data.local_owner, data.num_clients)}
            if self.global_is_local_union and not data.domains:
                rec.update(pooled("global", scores["global_local"]))
        rec.update(summarize("global_local", scores["global_local"]))
        if self.method.personalized:
            scores["personal"] = self._per_client_scores(self.personal_params)
            scores["trained"] = self._per_client_scores(self.trained_params)
            rec.update(summarize("personal", scores["personal"]))
            rec.update(summarize("trained", scores["trained"]))
        return rec, scores

    def run(self, on_round: Callable[[RoundResult], None] | None = None) -> list[dict[str, Any]]:
        records = []
        for rnd in range(1, self.cfg.rounds + 1):
            result = self.round(rnd)
            records.append(result.record)
            if on_round is not None:
                on_round(result)
        return records
