"""fedskew's ServerApp: the simulator's round, its clients Flower nodes; the run directory ``fedskew run`` writes.

The ServerApp runs its own loop over the Grid (not ``Strategy.start``), so a round means exactly what it means in the
simulator: :class:`FlowerServer` holds the simulator's round server (:class:`~fedskew.engine.round_server.RoundServer`),
whose round opens (``open_round``: seeded sampling and drop-outs, the method's broadcast), takes each reply as an
upload (``take_upload``, validated into the ``[K, ...]`` buffers in client order) and closes (``close_round``: the
method's :class:`~fedskew.server.api.ServerStrategy` aggregates, the strategy state stays in this process) with the
same code. What differs is where the clients are:

1. ``query.hello`` to every node once: each reports its stable ``cid`` (node config) and its label histograms, from
   which the server builds what it knows before round 1 (:class:`~fedskew.protocol.ServerContext`). The server holds
   the dataset's global test split only (the held-out set ``fedskew run`` scores the global model on); it never sees a
   client's data.
2. per round, ``train`` to the sampled clients, each with its own payload (its personalized model or the global one,
   without the entries it keeps locally, plus the method's broadcast: SCAFFOLD's control variate); replies are
   awaited for at most ``flower.round_timeout`` seconds; a client that does not reply (or replies with an error) is
   recorded in the round's ``failed`` list and the round goes on with the others.
3. on the evaluation cadence, ``evaluate`` to every reachable client: each scores the views on its test split; the
   server scores the global model on the global test set and summarizes the views as the simulator does.

The run directory (``config.yaml``, ``clients.json``, ``metrics.jsonl``, ``client_metrics.jsonl``, ``skew.jsonl``,
``summary.json``, ``status.json``) and the database rows are the simulator's, with ``engine: flower`` in
``summary.json`` (and so in the database's summary). A Flower run is not resumable (the clients' state lives on the
nodes, for one run), so no checkpoint is written.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MessageType, RecordDict
from flwr.serverapp import Grid, ServerApp

from fedskew import __version__
from fedskew.client.local import snapshot
from fedskew.config import ConfigError, RunConfig
from fedskew.data.federated import build_federated
from fedskew.data.pools import FederatedData
from fedskew.engine.evaluate import (
    ClientScores,
    eval_batch_of,
    global_views,
    pooled,
    same_samples,
    summarize,
)
from fedskew.engine.kernels import set_kernels
from fedskew.engine.loop import Diverged, RoundResult
from fedskew.engine.model_init import init_model, kept_local, resolve_model_name
from fedskew.engine.round_server import Known, RoundServer, server_context
from fedskew.engine.state_store import open_state_store
from fedskew.flower.codec import from_record, to_record
from fedskew.flower.grid_link import GridLink
from fedskew.flower.hello import FederationError, Hello, known_of, server_knows
from fedskew.flower.secagg import cohort_weights, secure_round
from fedskew.flower.server_data import domain_scores, load_test_data, server_view
from fedskew.flower.settings import FlowerSettings, check_secagg, config_hash, parse_run_config
from fedskew.methods import Method, resolve_method
from fedskew.protocol import Params, Upload
from fedskew.recorder import RunRecorder, domain_fields
from fedskew.results.rundir import RunDirectory
from fedskew.results.store import check_db_path, default_run_dir
from fedskew.runner import RunOutcome

log = logging.getLogger("flwr.fedskew")
ENGINE = "flower"


def _failures(failed: dict[int, str]) -> list[dict[str, Any]]:
    return [{"client": cid, "reason": reason} for cid, reason in sorted(failed.items())]


def decode_update(cid: int, content: RecordDict, device: str) -> Upload:
    """A ``train`` reply as the simulator's :class:`~fedskew.protocol.Upload`."""
    if int(content["meta"]["cid"]) != cid:  # type: ignore[arg-type]
        raise FederationError(f"the reply for client {cid} came from client {content['meta']['cid']}")
    metrics = {k: float(v) for k, v in content["metrics"].items() if k != "num-examples"}  # type: ignore[arg-type]
    return Upload(
        cid=cid,
        params=from_record(content["params"], device),  # type: ignore[arg-type]
        num_samples=int(content["metrics"]["num-examples"]),  # type: ignore[arg-type]
        extras=from_record(content["extras"], device),  # type: ignore[arg-type]
        metrics=metrics,
    )


class FlowerServer:
    """The round server (:class:`~fedskew.engine.round_server.RoundServer`, the simulator's) whose clients train and
    evaluate on Flower nodes (see the module docstring)."""

    def __init__(
        self,
        cfg: RunConfig,
        view: FederatedData,
        method: Method,
        link: GridLink,
        global_is_local_union: bool,
        *,
        known: Known,
    ) -> None:
        """``view``: the server's view of the federation (no client data; at most a held-out test set); ``known``:
        what the clients reported of themselves (sample counts, declared reports)."""
        if method.calibration is not None:
            raise ConfigError(
                f"method {method.name!r} calibrates the evaluated model from every client's feature statistics, which "
                "fedskew's Flower apps do not exchange yet; run it in the simulator (fedskew run)"
            )
        self.cfg, self.data, self.method = cfg, view, method
        self.model = init_model(cfg, view, method)  # scores the global model on the server's test set
        template = snapshot(self.model)
        trainable = frozenset(n for n, p in self.model.named_parameters() if p.requires_grad)
        self.local_names = kept_local(cfg, method, self.model, trainable)
        # the models the server sends individual clients (personalized strategies) live in a client-state store, so
        # that a disk store keeps them out of RAM; the clients keep their own state on their nodes
        self.state_store = open_state_store(cfg, method, template, view.num_clients)
        self.eval_batch = eval_batch_of(cfg.eval_batch_size, self.model, view.x_test)
        self.global_is_local_union = global_is_local_union  # the global test set is the clients' test splits
        self.server = RoundServer(
            cfg.round_settings(),
            method,
            server_context(view, method, template, trainable, cfg.seed, known),
            local_names=self.local_names,
            personal=self.state_store.maps["personal"],
        )
        self.link = link
        self.secagg = link.settings.secagg  # SecAgg+: the round's uploads reach the server as one sum
        if self.secagg:
            check_secagg(cfg, method)
            self.server.streaming = True  # the round opens running sums, which the secure sum fills
        self.unreachable: dict[int, str] = {}  # clients that failed this round: not asked again until the next
        self.failures: list[dict[str, Any]] = []  # every failure of the run, with round and phase
        self.rejoined: list[dict[str, Any]] = []  # clients whose node re-registered during the run
        self._round = 0

    @property
    def model_name(self) -> str:
        return resolve_model_name(self.cfg, self.data, self.method)

    @property
    def global_params(self) -> Params:
        return self.server.global_params

    def close(self) -> None:
        self.state_store.close()

    def _wire(self, params: Params) -> Params:
        """What travels to a client: the model without the entries the clients keep for themselves."""
        return {k: v for k, v in params.items() if k not in self.local_names}

    def _config(self, cid: int, **extra: Any) -> ConfigRecord:
        return ConfigRecord({"round": self._round, "cid": cid, "local_names": sorted(self.local_names), **extra})

    def round(self, rnd: int) -> RoundResult:
        self._round, self.unreachable = rnd, {}
        for cid, nid in self.link.rejoin().items():
            log.warning("round %d: client %d is back on a new node (%d), with a fresh state", rnd, cid, nid)
            self.rejoined.append({"round": rnd, "client": cid})
        plan = self.server.open_round(rnd)
        targets = [cid for cid in plan.sampled if cid not in plan.gone]
        broadcast = to_record(plan.broadcast)

        def sent_to(cid: int) -> ArrayRecord:  # the broadcast, with what the client alone is sent (its downloads)
            own = self.server.sent_to(plan, cid)
            return broadcast if own is plan.broadcast else to_record(own)

        # SecAgg+: each client is told its weight, fixed before it trains, the range of summed values and the seed
        weights = self._cohort_weights(rnd, targets) if self.secagg else {}
        secure = {"secagg_clip": self.link.settings.secagg_clip, "seed": self.cfg.seed} if self.secagg else {}
        contents = {
            cid: RecordDict(
                {
                    "model": to_record(self._wire(self.server.received(cid))),
                    "broadcast": sent_to(cid),
                    "config": self._config(cid, **secure, **({"secagg_weight": weights[cid]} if weights else {})),
                }
            )
            for cid in targets
        }
        if self.secagg:
            failed = self._secure_train(plan, contents, weights)
        else:
            replies, failed = self.link.exchange(MessageType.TRAIN, contents, rnd)
            for cid in targets:  # in client order, as the simulator stacks them
                if cid in replies:
                    try:
                        update = decode_update(cid, replies.pop(cid), self.cfg.device)
                    except (KeyError, TypeError, ValueError, FederationError) as exc:
                        failed[cid] = f"malformed reply: {exc}"
                        continue
                    # the client keeps its local entries and the model it trained in its own context.state
                    self.server.take_upload(plan, update)
        plan.failed = _failures(failed)
        self.unreachable = dict(failed)
        self.failures += [{"round": rnd, "phase": "train", **f} for f in plan.failed]
        for f in plan.failed:
            log.warning("round %d: client %d failed: %s", rnd, f["client"], f["reason"])
        return self.server.close_round(plan, self.evaluate, commit=self.state_store.commit)

    def _cohort_weights(self, rnd: int, targets: list[int]) -> dict[int, float]:
        """SecAgg+: the weights the server fixes for the clients it sends to, before they train."""
        srv = self.server
        args = (srv.ctx.num_train, srv.reports, srv.global_params, srv.trainable)
        weights = cohort_weights(self.method, srv.server_state.weighting, rnd, targets, *args)
        return dict(zip(targets, weights, strict=True))

    def _secure_train(self, plan: Any, contents: dict[int, RecordDict], weights: dict[int, float]) -> dict[int, str]:
        """SecAgg+: the round's training through the protocol; its sum becomes the round's running sums."""
        s = self.link.settings
        nodes = self.link.nodes
        out = secure_round(
            self.link.grid,
            nodes,
            contents,
            weights,
            self.global_params,
            shares=s.secagg_shares,
            threshold=s.secagg_threshold,
            clip=s.secagg_clip,
            timeout=s.round_timeout,
            poll=s.poll_interval,
            rnd=self._round,
        )
        plan.stack.kind = "secagg+"
        if out.sum is not None:
            plan.stack = out.sum
            plan.bytes_up += out.sum.count * (self.server.wire_bytes(self.global_params))
            for cid, n, m in zip(out.sum.cids, out.sum.num_samples, out.sum.metrics, strict=True):
                plan.losses.append((cid, int(n), m.get("train_loss", float("nan"))))
        return out.failed

    def evaluate(self, rnd: int | None = None) -> tuple[dict[str, Any], dict[str, ClientScores]]:
        """The simulator's views: the global model on the global test set here, every client's views on its test
        split there (its replies are the per-client scores the simulator computes). With ``eval_clients`` only the
        round's seeded sample of clients is asked (every view the clients compute is then over the sample)."""
        data, bs, n = self.data, self.eval_batch, self.data.num_clients
        sample = None if rnd is None else self.server.eval_sample(rnd)
        rec: dict[str, Any] = global_views(self, self.global_params)
        if sample is not None:
            rec["eval_clients"] = len(sample)
        views = ["global_local"] + (["personal", "trained"] if self.method.personalized else [])
        glob = to_record(self._wire(self.global_params))
        contents = {}
        asked = range(n) if sample is None else sample
        for cid in (c for c in asked if c not in self.unreachable):
            content = RecordDict({"global": glob, "config": self._config(cid, views=views, eval_batch=bs)})
            if cid in self.server.personal:
                content["personal"] = to_record(self._wire(self.server.received(cid)))
            contents[cid] = content
        replies, failed = self.link.exchange(MessageType.EVALUATE, contents, self._round)
        failed.update(self.unreachable)
        scores = {v: ClientScores(np.zeros(n), np.zeros(n), np.zeros(n)) for v in views}
        for cid, content in replies.items():
            got = content["scores"]
            for v in views:
                s = scores[v]
                s.correct[cid], s.loss_sum[cid], s.count[cid] = (
                    float(got[f"{v}/{k}"])  # type: ignore[arg-type]
                    for k in ("correct", "loss_sum", "count")
                )
        if failed:
            rec["eval_failed"] = _failures(failed)
            self.failures += [{"round": self._round, "phase": "evaluate", **f} for f in _failures(failed)]
        if not replies:  # no client scored anything: only the server's own view
            return rec, {}
        if self.global_is_local_union and not data.domains and not self.local_names:
            rec.update(pooled("global", scores["global_local"]))
        if data.domains and data.test_domain is None:  # federated evaluation of a real federation's domains
            rec.update(domain_scores(data.domains, np.asarray(data.client_domain), scores["global_local"]))
        for v in views:
            rec.update(summarize(v, scores[v]))
        return rec, scores


RUNS_ROOT_ENV = "FEDSKEW_RUNS_ROOT"  # set by `fedskew flower loopback`: where relative out / db paths live


def rooted(path: str) -> str:
    """``path``, made absolute against ``$FEDSKEW_RUNS_ROOT`` when it is relative and that is set: a loopback
    deployment runs the ServerApp in a temporary Flower home, so its run directory and database go where the user
    ran ``fedskew flower loopback``."""
    root = os.environ.get(RUNS_ROOT_ENV)
    return str(Path(root) / path) if root and not Path(path).is_absolute() else path


def run_on_grid(
    grid: Grid,
    cfg: RunConfig,
    settings: FlowerSettings | None = None,
    *,
    overwrite: bool = False,
    on_round: Callable[[RoundResult], None] | None = None,
) -> RunOutcome:
    """Run ``cfg`` on the clients behind ``grid``; write the run directory and database rows ``fedskew run`` writes.

    Nothing is written until the federation is complete (every client id connected and reported)."""
    settings = settings or FlowerSettings()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    set_kernels(cfg.device, cfg.tf32, cfg.cudnn_benchmark)  # the server's evaluation, if it has a GPU
    cfg = cfg.model_copy(update={k: rooted(v) for k, v in (("out", cfg.out), ("db", cfg.db)) if v})
    if cfg.db:
        check_db_path(cfg.db)
    started = time.perf_counter()
    now = datetime.now(UTC)
    run_id = f"{now:%Y%m%d-%H%M%S}-{uuid.uuid4().hex[:6]}"
    method = resolve_method(cfg.method, cfg.method_args)
    request = Hello(tuple(r.name for r in method.reports), __version__, config_hash(cfg))
    link = GridLink(grid, settings)
    reports = link.connect(cfg.clients, request)
    if settings.data == "partition":  # a simulated deployment: the server holds the dataset's global test split
        full = build_federated(cfg)
        view, union = server_view(full, reports, cfg, None), same_samples(full)
        evaluation = "the global model on the dataset's test set here, every view on the clients' test splits there"
        del full
    else:  # a real federation: no client data here; at most a held-out test set
        test = load_test_data(settings.test_data, reports[0].num_classes) if settings.test_data else None
        view, union = server_view(None, reports, cfg, test), test is None
        evaluation = (
            "federated: every view, the global model's included, scored by the clients on their test splits (no "
            "test set on the server)"
            if test is None
            else "the global model on the server's test_data here, every view on the clients' test splits there"
        )
    cfg = cfg.model_copy(update={"model": resolve_model_name(cfg, view, method)})
    out_dir = Path(cfg.out) if cfg.out else Path(rooted(str(default_run_dir(cfg, run_id))))
    server = FlowerServer(cfg, view, method, link, union, known=known_of(reports, request))
    rd = RunDirectory.prepare(out_dir, overwrite=overwrite)
    recorder = RunRecorder(rd, cfg, run_id, now.isoformat(timespec="seconds"))
    recorder.start(server_knows(view, reports, request), engine=ENGINE)
    log.info("fedskew %s on %s: %d clients connected, run directory %s", cfg.method, cfg.dataset, cfg.clients, out_dir)
    diverged: Diverged | None = None
    budget_stop = False
    try:
        for rnd in range(1, cfg.rounds + 1):
            if server.server.budget_spent(rnd):  # DP: this round would spend more than the epsilon budget
                budget_stop = True
                break
            try:
                result = server.round(rnd)
            except Diverged as exc:  # keep the rounds before it, flagged
                diverged = exc
                break
            recorder.round(result)
            rd.set_status("running", completed_rounds=rnd)
            acc = result.record.get("global_acc")
            log.info("round %d/%d: global_acc %s", rnd, cfg.rounds, "-" if acc is None else f"{acc:.4f}")
            if on_round is not None:
                on_round(result)
    except BaseException as exc:
        recorder.failed(exc)
        raise
    finally:
        server.close()
    summary = recorder.summary(model=server.model_name, wall_time=time.perf_counter() - started, diverged=diverged)
    summary.update(
        {
            **domain_fields(cfg, view.domains),
            "engine": ENGINE,
            "evaluation": evaluation,
            "flower": {**settings.model_dump(), "failures": server.failures, "rejoined": server.rejoined},
        }
    )
    if server.server.privacy is not None:
        summary["privacy"] = server.server.privacy.summary(len(recorder.records), budget_stop)
    recorder.finish(summary)
    recorder.publish(summary)
    return RunOutcome(run_id, out_dir, summary, recorder.records, view)


app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """``flwr run``'s entry: the run config is fedskew's (``[tool.flwr.app.config]`` + ``--run-config``)."""
    try:
        cfg, settings = parse_run_config(context.run_config)
    except ConfigError as exc:
        log.error("fedskew: %s", exc)
        raise
    outcome = run_on_grid(grid, cfg, settings)
    log.info("fedskew: run %s finished; results in %s", outcome.run_id, outcome.run_dir)
