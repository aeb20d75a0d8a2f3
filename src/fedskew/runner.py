"""Run one configured experiment end to end: data -> simulation -> run directory + database.

Long runs never lose work: the run directory is written in place and locked (``results/rundir.py``), a checkpoint is
written every ``checkpoint_every`` rounds (``auto``: as often as keeps it under 2% of the run time) and on SIGINT or
SIGTERM, and ``resume=True`` (or the same ``--out`` with the same configuration) continues from the last checkpoint
with results identical to an uninterrupted run."""

from __future__ import annotations

import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedskew.config import NOT_IDENTITY, ConfigError, RunConfig, load_yaml, make_config
from fedskew.data.federated import build_federated
from fedskew.data.pools import FederatedData
from fedskew.data.readers.base import VOCAB_FILE, vocabulary_digest, vocabulary_text
from fedskew.engine.checkpoint import capture, restore
from fedskew.engine.kernels import device_kernels
from fedskew.engine.loop import Diverged, RoundResult, Simulation, UserModel, resolve_model_name, user_model_name
from fedskew.engine.numerics import continue_record, numerics
from fedskew.engine.state_store import STATE_DIR, StoreDirError, StoreFiles
from fedskew.methods import resolve_method
from fedskew.recorder import RunRecorder, domain_fields
from fedskew.results.loggers import LogContext, Loggers, check_installed
from fedskew.results.rundir import CHECKPOINT, UNFINISHED, RunDirectory, RunDirError, is_run_dir
from fedskew.results.store import (
    check_db_path,
    default_run_dir,
)

# checkpoint_every=auto: write when the rounds since the last checkpoint took this many times its writing time
AUTO_CHECKPOINT_RATIO = 49.0  # writing ≤ 1/(1 + 49) = 2% of the run time


@dataclass(frozen=True)
class RunOutcome:
    run_id: str
    run_dir: Path
    summary: dict[str, Any]
    records: list[dict[str, Any]]
    data: FederatedData


def label_table(data: FederatedData) -> dict[str, Any]:
    """Per-client label histograms (train and local test), saved with every run."""
    return {
        "num_classes": data.num_classes,
        "train": data.train_hists.tolist(),
        "test": data.test_hists.tolist(),
        "global_test": np.bincount(data.y_test.cpu().numpy(), minlength=data.num_classes).tolist(),
    }


def vocabulary_fields(data: FederatedData) -> dict[str, Any]:
    """Summary fields of a text run: its vocabulary's file in the run directory, size and SHA-1 (``{}`` without)."""
    if not data.vocabulary:
        return {}
    voc = data.vocabulary
    return {"vocabulary": {"file": VOCAB_FILE, "size": len(voc), "sha1": vocabulary_digest(voc)}}


class RunInterrupted(Exception):
    """SIGINT/SIGTERM stopped the run after a checkpoint; it can be resumed."""

    def __init__(self, signum: int, run_dir: Path, completed: int) -> None:
        super().__init__(f"interrupted by {signal.Signals(signum).name} after round {completed}")
        self.signum, self.run_dir, self.completed = signum, run_dir, completed

    def __reduce__(self) -> tuple[Any, ...]:  # crosses process boundaries (a worker's trial or run, to its parent)
        return (type(self), (self.signum, self.run_dir, self.completed))


class StopRun(Exception):
    """Raised by an ``on_round`` callback to end a run early on purpose (``fedskew tune`` pruning a hopeless trial):
    the finished rounds and the last checkpoint are kept, the run is marked ``stopped`` with the message, and the
    exception reaches the caller. Nothing is written to the database (the run did not finish)."""


class _Stop:
    """SIGINT/SIGTERM while rounds run: the first one lets the round finish and checkpoint; a second SIGINT
    abandons the round at once (the last checkpoint stands)."""

    def __init__(self) -> None:
        self.signum: int | None = None

    def __call__(self, signum: int, frame: object) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum
        print(
            f"\n{signal.Signals(signum).name}: finishing this round, then checkpointing "
            "(Ctrl-C again abandons the round; the last checkpoint stands)",
            flush=True,
        )


# the runs of this process that run in other threads than the main one (signals reach the main thread only): whoever
# runs them there (engine/stacked_runs.py, sweep/task.py: execute_stacked) passes a signal on with stop_thread_runs
_THREAD_STOPS: set[_Stop] = set()
_THREAD_STOPS_LOCK = threading.Lock()


def stop_thread_runs(signum: int) -> int:
    """Ask every run running in a thread of this process to finish its round and checkpoint, as a signal asks a run
    in the main thread; returns how many were asked."""
    with _THREAD_STOPS_LOCK:
        for stop in _THREAD_STOPS:
            stop.signum = stop.signum or signum
        return len(_THREAD_STOPS)


@contextmanager
def _signals() -> Iterator[_Stop]:
    stop = _Stop()
    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
        with _THREAD_STOPS_LOCK:
            _THREAD_STOPS.add(stop)
        try:
            yield stop
        finally:
            with _THREAD_STOPS_LOCK:
                _THREAD_STOPS.discard(stop)
        return
    old = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def resume_config(run_dir: str | Path, overrides: dict[str, Any] | None = None) -> RunConfig:
    """The configuration of the run in ``run_dir``; ``overrides`` may change only where and how it runs (device,
    threads, database, checkpointing), never what it computes."""
    path = Path(run_dir)
    if not is_run_dir(path):
        raise ConfigError(f"{path} is not a fedskew run directory, so there is nothing to resume")
    saved = load_yaml(path / "config.yaml")
    changed = {
        k: v for k, v in (overrides or {}).items() if v is not None and k not in NOT_IDENTITY and saved.get(k) != v
    }
    if changed:
        raise ConfigError(
            f"--resume continues the run exactly as configured in {path / 'config.yaml'}; it cannot change "
            + ", ".join(f"{k} ({saved.get(k)!r} -> {v!r})" for k, v in changed.items())
        )
    return make_config(saved, {**{k: v for k, v in (overrides or {}).items() if k in NOT_IDENTITY}, "out": str(path)})


def _same_experiment(run_dir: Path, cfg: RunConfig) -> bool:
    """Whether ``run_dir`` holds an unfinished run of exactly ``cfg`` (so running the same command resumes it)."""
    rd = RunDirectory(run_dir)
    if rd.status().get("status") not in UNFINISHED or not (run_dir / CHECKPOINT).is_file():
        return False
    try:
        saved = make_config(load_yaml(run_dir / "config.yaml"))
    except ConfigError:
        return False
    return saved.identity() == cfg.identity() and saved.seed == cfg.seed


def run_experiment(
    cfg: RunConfig,
    *,
    overwrite: bool = False,
    resume: bool = False,
    on_round: Callable[[RoundResult], None] | None = None,
    on_start: Callable[[Simulation, int], None] | None = None,
    on_note: Callable[[str], None] | None = None,
    data: FederatedData | None = None,
    model: UserModel | None = None,
) -> RunOutcome:
    """Build the federation, run every round, write the run directory and (if configured) the database rows.

    ``resume``: continue the unfinished run in ``cfg.out`` from its last checkpoint (also done when ``cfg.out`` holds
    an unfinished run of the same configuration and seed). ``on_start(sim, first_round)`` is called before the
    first round this call runs. ``data`` / ``model``: a federation and a model of the user's (:mod:`fedskew.api`)
    instead of ``cfg.dataset`` / ``cfg.model``. Raises :class:`RunInterrupted` after checkpointing on SIGINT/SIGTERM,
    and :class:`DatabaseWriteError` when only the database insert failed (the run directory is complete).

    The run holds the GPU kernel flags it asks for (``tf32``, ``cudnn_benchmark``: engine/kernels.py) while it runs."""
    with device_kernels(cfg.device, cfg.tf32, cfg.cudnn_benchmark) as ignored:
        if ignored and on_note is not None:
            on_note(ignored)
        return _run(cfg, overwrite, resume, on_round, on_start, on_note, data, model)


def _run(
    cfg: RunConfig,
    overwrite: bool,
    resume: bool,
    on_round: Callable[[RoundResult], None] | None,
    on_start: Callable[[Simulation, int], None] | None,
    on_note: Callable[[str], None] | None,
    data: FederatedData | None,
    model: UserModel | None,
) -> RunOutcome:
    note = on_note or (lambda msg: None)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if cfg.db:
        check_db_path(cfg.db)  # before any compute
    check_installed(cfg.log)
    started = time.perf_counter()
    now = datetime.now(UTC)
    run_id = f"{now:%Y%m%d-%H%M%S}-{uuid.uuid4().hex[:6]}"
    out_dir = Path(cfg.out) if cfg.out else default_run_dir(cfg, run_id)
    data = data if data is not None else build_federated(cfg)
    method = resolve_method(cfg.method, cfg.method_args)
    # record the model `auto` stood for, so that config.yaml re-runs the same experiment
    model_name = resolve_model_name(cfg, data, method) if model is None else user_model_name(model)
    cfg = cfg.model_copy(update={"model": model_name})
    resume = resume or (not overwrite and out_dir.is_dir() and _same_experiment(out_dir, cfg))
    # refuses what it cannot run before anything is written; a disk-backed client-state store writes nothing yet
    sim = Simulation(cfg, data, method, model, state_dir=out_dir / STATE_DIR, owner=run_id)
    if overwrite and not resume:  # everything that could refuse the replacement refuses before anything is deleted
        try:
            StoreFiles.check_replaceable(out_dir / STATE_DIR)
        except StoreDirError as exc:
            sim.close()
            raise ConfigError(f"cannot replace {out_dir}: {exc}") from None
    rd = RunDirectory.prepare(out_dir, overwrite=overwrite, resume=resume)
    for msg in rd.notes:
        note(msg)
    first, elapsed = 1, 0.0
    arithmetic: list[dict[str, Any]] = []  # which arithmetic ran which rounds (engine/numerics.py)
    created = now.isoformat(timespec="seconds")
    files = {VOCAB_FILE: vocabulary_text(data.vocabulary)} if data.vocabulary else {}  # text: the word of every id
    if resume:
        try:
            ckpt = rd.load_checkpoint(cfg.device)
            rd.check_rounds(ckpt["round"])  # a record that lacks rounds the checkpoint holds is refused
            restore(sim, ckpt["sim"])
        except RunDirError:
            rd.unlock()
            raise
        except ValueError as exc:
            rd.unlock()
            raise ConfigError(f"cannot resume {out_dir}: {exc}") from None
        first, run_id, created, elapsed = ckpt["round"] + 1, ckpt["run_id"], ckpt["created"], ckpt["elapsed"]
        rd.cut_rounds(ckpt["round"])
        note(f"resuming {out_dir} after round {ckpt['round']} (checkpoint)")
        arithmetic = ckpt.get("numerics") or []
    else:
        try:
            if overwrite:  # the replaced run's client state: its store's own files, nothing else
                StoreFiles.remove_dir(out_dir / STATE_DIR)
            sim.state_store.create()  # a disk store takes its directory now, refusing one that is not its own
        except StoreDirError as exc:
            rd.unlock()
            raise ConfigError(f"cannot run into {out_dir}: {exc}") from None
        RunRecorder(rd, cfg, run_id, created).start(label_table(data), files)
    arithmetic, changed = continue_record(arithmetic, first, numerics(cfg.device))
    if changed:
        note(changed)
    rd.set_status("running", run_id=run_id)
    # live trackers on the same record stream (started at the first finished round; never stop the run)
    hists = data.train_hists + data.test_hists if cfg.log else None
    loggers = Loggers(cfg.log, cfg, out_dir, cfg.log_group or "", LogContext(run_id, first), note, hists)
    recorder = RunRecorder(rd, cfg, run_id, created, rd.read_lines("metrics.jsonl"), loggers)
    diverged: Diverged | None = None
    budget_stop: int | None = None  # DP: the round that would have passed the epsilon budget
    ckpt_time, ckpt_count, since_ckpt = 0.0, 0, 0.0
    last_ckpt_cost: float | None = None

    def checkpoint(rnd: int) -> None:
        nonlocal ckpt_time, ckpt_count, since_ckpt, last_ckpt_cost
        t = time.perf_counter()
        rd.save_checkpoint(
            {
                "round": rnd,
                "run_id": run_id,
                "created": created,
                "elapsed": elapsed + time.perf_counter() - started,
                "numerics": arithmetic,
                "sim": capture(sim),
            }
        )
        last_ckpt_cost = time.perf_counter() - t
        ckpt_time += last_ckpt_cost
        ckpt_count += 1
        since_ckpt = 0.0
        rd.set_status("running", completed_rounds=rnd, checkpoint_round=rnd)

    def due(rnd: int) -> bool:
        every = cfg.checkpoint_every
        if every == "auto":
            return last_ckpt_cost is None or since_ckpt >= AUTO_CHECKPOINT_RATIO * last_ckpt_cost
        return bool(every) and rnd % every == 0

    try:
        with _signals() as stop:
            if on_start is not None:
                on_start(sim, first)
            for rnd in range(first, cfg.rounds + 1):
                t0 = time.perf_counter()
                if sim.server.budget_spent(rnd):  # DP: this round would spend more than the epsilon budget
                    budget_stop = rnd
                    break
                try:
                    result = sim.round(rnd)
                except Diverged as exc:  # keep the rounds before it, flagged; the caller reports it loudly
                    diverged = exc
                    break
                recorder.round(result)
                since_ckpt += time.perf_counter() - t0
                if stop.signum is not None:
                    checkpoint(rnd)
                    rd.set_status("interrupted", signal=signal.Signals(stop.signum).name)
                    rd.unlock()
                    raise RunInterrupted(stop.signum, out_dir, rnd)
                if rnd < cfg.rounds and due(rnd):
                    checkpoint(rnd)
                if on_round is not None:
                    on_round(result)
    except RunInterrupted:
        loggers.close()
        raise
    except BaseException as exc:
        done = rd.status().get("checkpoint_round") or 0
        status = "failed"
        if isinstance(exc, KeyboardInterrupt | StopRun):
            status = "interrupted" if isinstance(exc, KeyboardInterrupt) else "stopped"
        if not recorder.records:  # no round finished: no trace left, client state first
            sim.state_store.remove()
        if recorder.failed(exc, status):
            raise
        if isinstance(exc, KeyboardInterrupt):
            raise RunInterrupted(signal.SIGINT, out_dir, done) from None
        raise
    finally:
        sim.close()  # worker processes, if any

    wall_time = elapsed + time.perf_counter() - started
    summary = recorder.summary(
        model=sim.model_name, wall_time=wall_time, diverged=diverged, checkpoints=ckpt_count, checkpoint_time=ckpt_time
    )
    summary.update({**domain_fields(cfg, data.domains), **vocabulary_fields(data), "numerics": arithmetic})
    if sim.server.privacy is not None:
        summary["privacy"] = sim.server.privacy.summary(len(recorder.records), budget_stop is not None)
    recorder.finish(summary)
    sim.state_store.remove()  # like the checkpoint, the client state is kept only while the run can be resumed
    recorder.publish(summary)
    return RunOutcome(run_id, out_dir, summary, recorder.records, data)
