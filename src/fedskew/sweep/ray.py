"""``fedskew sweep --executor ray``: the runs of a sweep as Ray tasks, anywhere in a Ray cluster, with every result
landing in the driver's run directories and database (no shared file system needed).

Each run is one Ray task (one CPU, or ``threads``/``workers`` CPUs; with a ``cuda`` device also ``--gpus-per-run``
GPUs, one by default, a fraction to share a GPU). The task runs :func:`fedskew.sweep.task.execute_run` in a temporary
run directory on its node, without a database. What travels, through Ray's object store:

* driver -> task: the run's configuration (:class:`fedskew.sweep.task.Task`) and, for a run that continues (state
  ``resume`` or ``restart``), the files of its run directory, checkpoint included;
* task -> driver, through an inbox actor on the driver's node: the run's progress events, and the run directory's
  changed files each time a checkpoint is written and once more when the run ends (finished, diverged, failed after
  some rounds, interrupted). The driver writes them into the run directory (each file through a temporary name and a
  rename; the per-round files first, the checkpoint next, ``status.json`` last, so the directory is always one a
  local run could have left), and records an ended run in the database itself (:func:`fedskew.recorder.record_in_db`).

So the run directories and the database are those of a local sweep (``config.yaml`` names the driver's ``out`` and
``db``), and everything the local pool guarantees holds: a finished run is skipped, an interrupted one continues from
its checkpoint. A task whose worker or node dies (``WorkerCrashedError``, ``NodeDiedError``, ...) is submitted again,
from the last checkpoint that reached the driver, up to :data:`MAX_RETRIES` times; it waits in Ray's queue until a
node has room. Ctrl-C (or SIGTERM) asks every running task to finish its round and checkpoint, like the local pool.
"""

from __future__ import annotations

import collections
import contextlib
import importlib.util
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from fedskew.config import ConfigError
from fedskew.results.rundir import RunDirectory, RunDirError
from fedskew.sweep.core import PlannedRun, _finished_id, run_state
from fedskew.sweep.ray_task import Inbox, read_run_files, remote_run, write_run_files
from fedskew.sweep.task import Event, RunResult, Task

INSTALL_HINT = "--executor ray needs Ray: pip install 'fedskew[ray]' (on the driver and on every node)"
MAX_RETRIES = 3  # re-submissions of a run whose worker or node died
_POLL = 0.25  # seconds between looks at the tasks and the inbox


def check_ray() -> None:
    """Refuse, saying how to install it, when Ray is missing (without importing it: see :meth:`RayExecutor._local`)."""
    try:
        found = importlib.util.find_spec("ray") is not None
    except (ImportError, ValueError):  # ValueError: sys.modules["ray"] is None
        found = False
    if not found:
        raise ConfigError(INSTALL_HINT)


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ConfigError(INSTALL_HINT) from None
    return ray


# ---- the driver ------------------------------------------------------------------------------------------------
@dataclass
class _Flight:
    """One run on its way through the cluster."""

    task: Task
    attempt: int = 0
    started: bool = False
    deaths: int = 0
    known: set[str] = field(default_factory=set)  # files of the run directory the task has (or had)
    lock: RunDirectory | None = None

    @property
    def out(self) -> Path:
        return Path(str(self.task.values.get("out")))


@dataclass
class RayExecutor:
    """``run_sweep(..., executor=RayExecutor(...))``: the runs as Ray tasks.

    ``address``: a running cluster (``HOST:PORT``, ``auto``) with this process on one of its nodes; default ``auto``
    when ``RAY_ADDRESS`` is set, else a Ray instance on this machine (``jobs`` CPUs, on 127.0.0.1) for the sweep.
    ``jobs``: the most runs at a time (default: as many as the cluster's CPUs/GPUs hold). ``device``: the runs'
    device on the nodes (``cuda``: the GPU Ray gives the task), overriding the runs' own. ``gpus_per_run``: GPUs a
    run reserves (default 1 with a ``cuda`` device, else 0)."""

    address: str | None = None
    jobs: int | None = None
    device: str | None = None
    gpus_per_run: float | None = None
    retries: int = MAX_RETRIES

    def where(self) -> str:
        address = self.address or ("auto" if os.environ.get("RAY_ADDRESS") else None)
        return f"the Ray cluster at {address}" if address else "a local Ray instance"

    def resources(self, values: dict[str, Any]) -> dict[str, float]:
        cuda = str(self.device or values.get("device") or "cpu").startswith("cuda")
        gpus = self.gpus_per_run if self.gpus_per_run is not None else (1.0 if cuda else 0.0)
        if cuda and gpus <= 0:
            raise ConfigError("a cuda device on Ray needs --gpus-per-run > 0 (a fraction shares a GPU)")
        cpus = max(1, int(values.get("threads") or 1), int(values.get("workers") or 1))
        return {"num_cpus": cpus, "num_gpus": gpus} if gpus else {"num_cpus": cpus}

    def __call__(
        self,
        todo: list[Task],
        emit: Callable[[Event], None],
        results: dict[str, RunResult],
        report: Callable[[RunResult], None],
    ) -> bool:
        for task in todo:
            self.resources(task.values)  # refuse a bad --gpus-per-run before connecting
        with self._session() as ray:
            return _Driver(ray, self, emit, results, report).run(todo)

    @contextlib.contextmanager
    def _session(self) -> Iterator[Any]:
        """Ray, connected to the cluster (or a local instance started for the block, shut down after it)."""
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        with self._local():
            ray = import_ray()
            owned = not ray.is_initialized()
            if owned:
                self._connect(ray)
        try:
            yield ray
        finally:
            if owned:
                ray.shutdown()

    def run_calls(self, fn: Callable[..., Any], calls: list[tuple[Any, ...]]) -> list[Any]:
        """``fn(*args)`` for each ``args`` as a Ray task of one CPU (``fedskew tune --executor ray``: the ``--jobs``
        workers of one study), on the cluster or a local instance as for a sweep; their results in order. A failed
        task raises :class:`~fedskew.config.ConfigError` naming it, after the others have ended."""
        with self._session() as ray:
            remote = ray.remote(num_cpus=1, max_retries=0)(fn)
            refs = [remote.remote(*args) for args in calls]
            out, errors = [], []
            for i, ref in enumerate(refs):
                try:
                    out.append(ray.get(ref))
                except Exception as exc:  # a task's error (RayTaskError wraps the remote exception)
                    out.append(None)
                    errors.append(f"task {i}: {str(exc).strip().splitlines()[-1]}")
            if errors:
                raise ConfigError("Ray tasks failed: " + "; ".join(errors))
            return out

    @contextlib.contextmanager
    def _local(self) -> Iterator[None]:
        """For a Ray instance of our own: Ray's single-machine mode, in which every Ray process listens on 127.0.0.1
        only (otherwise Ray rewrites 127.0.0.1 into the machine's outward address and listens on every interface).
        It is read when Ray is imported, so it holds when this process has not imported Ray yet (the CLI)."""
        key = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
        if self.address or os.environ.get("RAY_ADDRESS") or key in os.environ or "ray" in sys.modules:
            yield
            return
        os.environ[key] = "0"
        try:
            yield
        finally:
            del os.environ[key]  # the Ray processes started meanwhile keep it

    def _connect(self, ray: Any) -> None:
        address = self.address or ("auto" if os.environ.get("RAY_ADDRESS") else None)
        quiet = {"log_to_driver": False, "logging_level": logging.WARNING}
        try:
            if address:
                ray.init(address=address, **quiet)
            else:  # a private instance: this machine only (see _local), no dashboard
                ray.init(num_cpus=self.jobs or 1, include_dashboard=False, **quiet)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise ConfigError(f"cannot connect to {self.where()}: {exc}") from None


class _Driver:
    def __init__(
        self,
        ray: Any,
        ex: RayExecutor,
        emit: Callable[[Event], None],
        results: dict[str, RunResult],
        report: Callable[[RunResult], None],
    ) -> None:
        from fedskew import __version__

        self.ray, self.ex, self.emit, self.results, self.report = ray, ex, emit, results, report
        self.version = __version__
        self.flights: dict[Any, _Flight] = {}  # object ref -> run
        self.by_name: dict[str, _Flight] = {}
        self.waiting: collections.deque[_Flight] = collections.deque()
        self.interrupted = False
        self.remote = ray.remote(max_retries=0)(remote_run)
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        self.inbox = ray.remote(Inbox).options(num_cpus=0, scheduling_strategy=here).remote()

    def run(self, todo: list[Task]) -> bool:
        self._check_room(todo)
        self.waiting.extend(_Flight(t) for t in todo)
        self.by_name = {f.task.name: f for f in self.waiting}
        on_main = threading.current_thread() is threading.main_thread()

        def term(signum: int, frame: object) -> None:
            raise KeyboardInterrupt

        old_term = signal.signal(signal.SIGTERM, term) if on_main else None
        try:
            while self.waiting or self.flights:
                try:
                    self._step()
                except KeyboardInterrupt:
                    if self.interrupted:  # a second one: abandon the rounds in progress (their checkpoints stand)
                        self._abandon()
                        break
                    self._interrupt()
        finally:
            if old_term is not None:
                signal.signal(signal.SIGTERM, old_term)
            for f in self.by_name.values():
                if f.lock is not None:
                    f.lock.unlock()
            with contextlib.suppress(Exception):
                self.ray.kill(self.inbox)
        return self.interrupted

    def _check_room(self, todo: list[Task]) -> None:
        """Say so when no node of the cluster could hold a run now (Ray keeps such a task waiting for one)."""
        total = self.ray.cluster_resources()
        names = {"num_cpus": "CPU", "num_gpus": "GPU"}
        for shape in {tuple(sorted(self.ex.resources(t.values).items())) for t in todo}:
            have = {names[k]: total.get(names[k], 0) for k, _ in shape}
            if any(have[names[k]] < v for k, v in shape):
                need = ", ".join(f"{v:g} {names[k]}" for k, v in shape)
                owned = ", ".join(f"{v:g} {k}" for k, v in have.items())
                msg = f"note: a run needs {need}; {self.ex.where()} has {owned} now: runs wait for a node with room"
                print(msg, file=sys.stderr)

    # ---- one look at the cluster -----------------------------------------------------------------------------
    def _capacity(self) -> int:
        if self.ex.jobs:
            return self.ex.jobs
        total = self.ray.cluster_resources()
        shape = self.ex.resources(self.waiting[0].task.values)
        n = int(total.get("CPU", 0) // shape["num_cpus"])
        if shape.get("num_gpus"):
            n = min(n, int(total.get("GPU", 0) // shape["num_gpus"]))
        return max(n, 1)  # at least one waits in Ray's queue for a node to join

    def _step(self) -> None:
        while self.waiting and not self.interrupted and len(self.flights) < self._capacity():
            self._submit(self.waiting.popleft())
        if not self.flights:
            return
        ready, _ = self.ray.wait(list(self.flights), num_returns=len(self.flights), timeout=_POLL)
        self._drain()  # a task puts everything before it returns: its last files are in by now
        for ref in ready:
            self._end(ref)

    def _submit(self, f: _Flight) -> None:
        name, out = f.task.name, f.out
        if f.attempt:  # again after its worker died: from what reached this side
            from fedskew.config import make_config

            state, detail = run_state(PlannedRun(name, make_config(f.task.values), name))
            if state in ("done", "blocked"):  # it ended just before its worker died, or the folder was replaced
                run_id, error = _finished_id(str(out), f.task.values.get("db")) if state == "done" else (None, detail)
                return self._finish(f, RunResult(name, "failed" if error else detail, str(out), run_id, error))
            f.task = replace(f.task, state=state)
        files: dict[str, bytes] = {}
        if f.task.state in ("resume", "restart"):
            if f.lock is None:
                try:
                    self._lock(f)
                except RunDirError as exc:
                    return self._finish(f, RunResult(name, "failed", str(out), error=str(exc)))
            files = read_run_files(out)
        f.known = set(files)
        payload = {
            "task": f.task,
            "files": files,
            "version": self.version,
            "numerics": _numerics(),
            "device": self.ex.device,
            "attempt": f.attempt,
        }
        self.flights[self.remote.options(**self.ex.resources(f.task.values)).remote(payload, self.inbox)] = f

    def _lock(self, f: _Flight) -> None:
        rd = RunDirectory(f.out)
        rd._lock()  # like a local run: a second sweep on the same directory is refused, a dead holder taken over
        f.lock = rd
        for msg in rd.notes:
            self.emit(("note", f.task.name, msg))

    def _drain(self) -> None:
        for item in self.ray.get(self.inbox.take.remote()):
            kind, name, attempt = item[:3]
            f = self.by_name.get(name)
            if f is None or f.attempt != attempt or name in self.results:
                continue  # from a task that died and was submitted again
            if kind == "event":
                f.started = f.started or item[3][0] == "start"
                self.emit(item[3])
            elif kind == "files":
                changed, present = item[3], set(item[4])
                try:
                    write_run_files(f.out, changed, f.known - present, f.task.values)
                except OSError as exc:  # the run goes on; if its last files cannot be written either, it fails
                    self.emit(("note", name, f"could not write its files into {f.out}: {exc}"))
                    continue
                f.known = present
                if f.lock is None:
                    with contextlib.suppress(RunDirError):
                        self._lock(f)

    def _end(self, ref: Any) -> None:
        exc_mod = self.ray.exceptions
        f = self.flights.pop(ref)
        name, out = f.task.name, str(f.out)
        try:
            res: RunResult = self.ray.get(ref)
        except exc_mod.TaskCancelledError:
            status = "interrupted" if f.started else "not started"
            res = RunResult(name, status, out, detail="cancelled; its last checkpoint stands" if f.started else "")
        except exc_mod.RayTaskError as exc:  # an error outside the run itself (execute_run never raises)
            res = RunResult(name, "failed", out, error=str(exc).strip().splitlines()[-1], trace=str(exc))
        except exc_mod.RayError as exc:  # its worker process or its node died
            first = (str(exc).strip().splitlines() or [""])[0].split(". ")[0]
            why = f"{type(exc).__name__}: {first[:160]}"
            if not self.interrupted and f.deaths < self.ex.retries:
                f.deaths += 1
                f.attempt += 1
                f.started = False
                again = f"its Ray worker died ({why}); submitted again ({f.deaths}/{self.ex.retries})"
                self.emit(("note", name, again))
                self.waiting.appendleft(f)
                return
            error = f"its Ray worker died {f.deaths + 1} times (last: {why}); run the sweep again to resume it"
            res = RunResult(name, "failed", out, error=error)
            if self.interrupted:
                res = RunResult(name, "interrupted", out)
        if res.status in ("finished", "diverged"):
            run_id, error = _finished_id(out, f.task.values.get("db"))
            res = replace(res, run_id=run_id, error=error, status="failed" if error else res.status)
        if f.deaths and res.status != "failed" and not res.detail:
            res = replace(res, detail=f"after {f.deaths} worker death(s)")
        self._finish(f, res)

    def _finish(self, f: _Flight, res: RunResult) -> None:
        if f.lock is not None:
            f.lock.unlock()
            f.lock = None
        self.results[f.task.name] = res
        self.report(res)

    # ---- Ctrl-C ------------------------------------------------------------------------------------------------
    def _interrupt(self) -> None:
        """The running tasks finish their round and checkpoint (a SIGINT in their worker); none starts anew."""
        self.interrupted = True
        for f in self.waiting:
            self._finish(f, RunResult(f.task.name, "not started", str(f.out)))
        self.waiting.clear()
        for ref in self.flights:
            with contextlib.suppress(Exception):
                self.ray.cancel(ref, force=False)

    def _abandon(self) -> None:
        for ref, f in list(self.flights.items()):
            with contextlib.suppress(Exception):
                self.ray.cancel(ref, force=True)
            with contextlib.suppress(Exception):
                self._drain()
            detail = "abandoned; its last checkpoint stands"
            self._finish(f, RunResult(f.task.name, "interrupted", str(f.out), detail=detail))
        self.flights.clear()


def _numerics() -> dict[str, str]:
    from fedskew.engine.numerics import numerics

    return numerics()


__all__ = ["INSTALL_HINT", "MAX_RETRIES", "RayExecutor", "check_ray", "import_ray", "read_run_files", "write_run_files"]
