"""One run of a sweep, as any executor runs it: :class:`Task` (plain data that crosses a process or machine
boundary), :func:`execute_run` (never raises: a failure comes back as a :class:`RunResult` with its error) and the
progress :data:`Event` it emits. The local pool (``sweep/pool.py``) and the Ray executor (``sweep/ray.py``) both
call it; ``sweep/core.py`` decides which runs to give them."""

from __future__ import annotations

import json
import os
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedskew.config import ConfigError, RunConfig, load_yaml, make_config

Event = tuple[Any, ...]  # ("start", name, first_round, rounds, pid) | ("round", name, rnd, info) | ("note", name, msg)


@dataclass(frozen=True)
class Task:
    """What a worker process needs for one run (plain data: it crosses a process boundary)."""

    name: str
    values: dict[str, Any]
    state: str


@dataclass
class RunResult:
    name: str
    status: str  # finished | diverged | skipped | failed | interrupted | not started
    run_dir: str
    run_id: str | None = None
    error: str | None = None
    detail: str = ""
    trace: str = ""
    wall_time: float = 0.0


def _info(record: dict[str, Any]) -> str:
    for key in ("global_acc", "domain_acc_avg", "personal_acc_mean", "global_local_acc"):
        if key in record:
            return f"{key} {100 * record[key]:.2f}%"
    return ""


@dataclass(frozen=True)
class TaskGroup:
    """One experiment's seeds run together, their rounds' clients trained as rows of one stacked computation
    (``fedskew sweep --stack-seeds``; :mod:`fedskew.engine.stacked_runs`). Plain data, as a :class:`Task`."""

    tasks: tuple[Task, ...]

    @property
    def name(self) -> str:
        return self.tasks[0].name

    @property
    def values(self) -> dict[str, Any]:
        return self.tasks[0].values


def group_seeds(todo: list[Task]) -> list[Task | TaskGroup]:
    """The runs that differ only in their seed (and where they go) as one :class:`TaskGroup` each, at the place of
    the first; the others as they are."""
    from fedskew.engine.stacked_runs import experiment_key

    groups: dict[str, list[Task]] = {}
    for task in todo:
        key = json.dumps(experiment_key(make_config(task.values)), sort_keys=True, default=str)
        groups.setdefault(key, []).append(task)
    return [g[0] if len(g) == 1 else TaskGroup(tuple(g)) for g in groups.values()]


def members(unit: Task | TaskGroup) -> tuple[Task, ...]:
    return unit.tasks if isinstance(unit, TaskGroup) else (unit,)


def execute(unit: Task | TaskGroup, emit: Callable[[Event], None]) -> list[RunResult]:
    """Run one task, or one group of stacked seeds; every member's result (never raises)."""
    return execute_stacked(unit, emit) if isinstance(unit, TaskGroup) else [execute_run(unit, emit)]


def execute_stacked(group: TaskGroup, emit: Callable[[Event], None]) -> list[RunResult]:
    """Run a group's seeds each in its own thread, their clients trained together at one rendezvous (each run
    recorded as a ``batched_clients`` run); every member's result, in order (never raises)."""
    from fedskew.engine.stacked_runs import Rendezvous, run_in_threads

    meeting = Rendezvous(len(group.tasks))
    results: list[RunResult | None] = [None] * len(group.tasks)
    said = threading.Lock()

    def tell(ev: Event) -> None:  # the runs' threads report one at a time (a display need not be thread-safe)
        with said:
            emit(ev)

    def one(r: int) -> None:
        task = group.tasks[r]
        task = Task(task.name, {**task.values, "batched_clients": True}, task.state)

        def seat_in(sim: Any) -> None:
            if not sim.use_trainer(meeting.seat(r)):  # no batched form: it trains its clients itself
                meeting.leave(r)

        try:
            results[r] = _execute_run(task, tell, seat_in)
        finally:
            meeting.leave(r)

    with warnings.catch_warnings(record=True) as caught:  # one capture for the threads (the filters are global)
        warnings.simplefilter("always")
        run_in_threads([lambda r=r: one(r) for r in range(len(group.tasks))])
    for w in caught:
        emit(("note", group.name, str(w.message)))
    return [res or RunResult(t.name, "failed", str(t.values.get("out")), error="its thread ended without a result")
            for res, t in zip(results, group.tasks, strict=True)]  # fmt: skip


def execute_run(task: Task, emit: Callable[[Event], None]) -> RunResult:
    """Run (or resume) one planned run; never raises: a failure comes back as a result with its error."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = _execute_run(task, emit)
    for w in caught:
        emit(("note", task.name, str(w.message)))
    return result


def _execute_run(task: Task, emit: Callable[[Event], None], on_sim: Callable[[Any], None] | None = None) -> RunResult:
    from fedskew.runner import RunInterrupted, run_experiment

    t0 = time.perf_counter()
    out = str(task.values.get("out"))
    try:
        cfg = make_config(task.values)
        outcome, state = _run_when_free(task, cfg, emit, run_experiment, on_sim)
        if outcome is None:  # another process ran it meanwhile (the same sweep twice at once)
            result = state
        else:
            status = "diverged" if outcome.summary.get("diverged") else "finished"
            detail = {"resume": "resumed", "restart": "started over"}.get(state, "")
            result = RunResult(task.name, status, out, outcome.summary["run_id"], detail=detail)
    except RunInterrupted as exc:
        result = RunResult(task.name, "interrupted", out, detail=f"checkpoint after round {exc.completed}")
    except KeyboardInterrupt:
        result = RunResult(task.name, "interrupted", out, detail="before its first round ended (nothing kept)")
    except Exception as exc:  # noqa: BLE001 - any error of one run is reported, never stops the sweep
        result = RunResult(task.name, "failed", out, error=f"{type(exc).__name__}: {exc}", trace=traceback.format_exc())
    result.wall_time = time.perf_counter() - t0
    return result


LOCK_POLL_S = 1.0  # how often a run waits for another process of this machine to release its folder


def _run_when_free(
    task: Task,
    cfg: Any,
    emit: Callable[[Event], None],
    run_experiment: Callable[..., Any],
    on_sim: Callable[[Any], None] | None = None,
) -> Any:
    """Run ``task`` from its folder's state *now* (another process may have started or finished it since the sweep
    was planned: the same spec swept twice at once); while a live process of this machine holds the folder, wait for
    it. Returns ``(outcome, state)``, or ``(None, result)`` when the run needs no running any more (finished
    elsewhere: skipped)."""
    from fedskew.results.rundir import RunDirError, RunLocked

    said, races = False, 0

    def _started(sim: Any, first: int) -> None:
        emit(("start", task.name, first, cfg.rounds, os.getpid()))
        if on_sim is not None:
            on_sim(sim)

    while True:
        state, detail = folder_state(cfg)
        done = settled(task.name, cfg, state, detail)
        if done is not None:
            return None, done
        try:
            outcome = run_experiment(
                cfg,
                overwrite=state == "restart",
                on_start=lambda sim, first: _started(sim, first),
                on_round=lambda r: emit(("round", task.name, r.record["round"], _info(r.record))),
                on_note=lambda msg: emit(("note", task.name, msg)),
            )
            return outcome, state
        except RunLocked as exc:
            if not exc.holder_alive_here():
                raise
            if not said:
                emit(("note", task.name, f"another process (pid {exc.pid}) is running it; waiting for it to end"))
                said = True
            time.sleep(LOCK_POLL_S)
        except RunDirError:
            # the folder changed between the look and the start (another process finished or started it there):
            # look again, a few times, before reporting the error
            races += 1
            if races > 3 or folder_state(cfg)[0] == state:
                raise


# ---- the state of a run's folder (read when a sweep is planned, and again when each run starts) ------------------
def _same_experiment(saved: RunConfig, cfg: RunConfig) -> bool:
    a, b = saved.identity(), cfg.identity()
    if cfg.model == "auto":  # the run directory records the model `auto` stood for
        a.pop("model"), b.pop("model")
    return a == b and saved.seed == cfg.seed


def folder_state(cfg: RunConfig) -> tuple[str, str]:
    """(state, detail) of the folder of the run ``cfg``: ``new``, ``done`` (finished or diverged: skipped),
    ``resume`` (unfinished with a checkpoint), ``restart`` (unfinished, no checkpoint: started over), ``blocked``
    (the folder holds something else; the run fails with the reason)."""
    from fedskew.results.rundir import CHECKPOINT, LOCK, RunDirectory, is_run_dir

    d = Path(str(cfg.out))
    if not d.exists() or (d.is_dir() and not any(d.iterdir())):
        return "new", ""
    if d.is_dir() and (d / LOCK).is_file() and not is_run_dir(d):
        # a run has just locked the folder and not yet written its status (the same sweep started twice at once):
        # not a foreign folder. Starting it meets the lock and waits for its holder (or takes over a dead one's).
        return "new", "another run is starting it"
    if not d.is_dir() or not is_run_dir(d):
        return "blocked", f"{d} exists and is not a fedskew run directory; move it away"
    status = RunDirectory(d).status()
    try:
        saved = make_config(load_yaml(d / "config.yaml"))
    except ConfigError:
        saved = None
    if saved is not None and not _same_experiment(saved, cfg):
        return "blocked", f"{d} holds a different experiment; move it away"
    if status.get("status") in ("finished", "diverged") and (d / "summary.json").is_file():
        return "done", str(status["status"])
    if (d / CHECKPOINT).is_file() and saved is not None:
        return "resume", f"after round {status.get('checkpoint_round')}"
    return "restart", f"status {status.get('status', 'unknown')}, no checkpoint"


def settled(name: str, cfg: RunConfig, state: str, detail: str) -> RunResult | None:
    """The result of a run that needs no running (``done``: skipped, or failed when its folder cannot be read;
    ``blocked``: failed), else ``None``."""
    out = str(cfg.out)
    if state == "done":
        run_id, error = finished_id(out, cfg.db)
        return RunResult(name, "failed" if error else "skipped", out, run_id, error, detail=detail)
    if state == "blocked":
        return RunResult(name, "failed", out, error=detail)
    return None


def finished_id(run_dir: str, db: str | None) -> tuple[str | None, str | None]:
    """(run id, error) of a finished run directory, recording it in the database when it is not there yet."""
    from fedskew.recorder import record_in_db

    try:
        run_id = json.loads((Path(run_dir) / "summary.json").read_text())["run_id"]
        if db:
            record_in_db(db, run_dir)
        return run_id, None
    except Exception as exc:  # noqa: BLE001 - reported as this run's failure
        return None, f"{type(exc).__name__}: {exc}"
