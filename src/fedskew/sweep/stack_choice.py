"""``--stack-seeds auto``: for each experiment's seeds, stacked or concurrent, by what measures faster here (issue 47).

Stacking one experiment's seeds (:mod:`fedskew.engine.stacked_runs`) trains their clients in one batched step; it pays
where the device has room to spare (a GPU running small models) and can cost where the arithmetic already fills it (a
CPU with a CNN: 0.84x measured, docs/design.md). Which one wins depends on the model, the method and the device, so
``auto`` measures it for each group before the group runs:

- **stacked**: the group's seeds as one stacked group, in this process, for :data:`PROBE_ROUNDS` rounds;
- **concurrent**: the seeds as separate runs as the sweep would run them, ``k = min(jobs, seeds)`` at a time (``k > 1``
  in the sweep's worker processes), for the same rounds.

Each probe runs the group's own configurations (but for the rounds, a temporary folder, no database and no live
logger) and the time kept is a *steady* round: from the end of round 1 (data loading, process start and warm-up done)
to the end of the last. The group advances one round of all its seeds in ``stacked`` seconds stacked, in
``ceil(seeds / k) x concurrent`` seconds as separate runs; :func:`prefer_stacked` picks the smaller. The probe's
folders are deleted (it made them); nothing of it reaches the results. The choice and both times are a note of the
sweep (and in every run's events), and each stacked run is recorded as a ``--batched-clients`` run, as with
``--stack-seeds``.

A group whose runs are too short to repay the probe (fewer than :data:`MIN_ROUNDS` rounds) runs concurrently, unmeasured
(the records of separate runs are exact; stacked ones equal them to float32 rounding).
"""

from __future__ import annotations

import math
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fedskew.sweep.task import Event, RunResult, Task, TaskGroup, execute_run, execute_stacked

PROBE_ROUNDS = 3  # round 1 warms up; rounds 2..3 are timed
MIN_ROUNDS = 4 * PROBE_ROUNDS  # below this the two probes cost more than a wrong choice could


@dataclass(frozen=True)
class StackChoice:
    """What ``auto`` chose for one group, and the steady round times it measured (seconds; ``None``: not measured)."""

    stacked: bool
    stacked_s: float | None
    concurrent_s: float | None
    at_once: int  # k: the separate runs the sweep runs at the same time
    reason: str

    def note(self, seeds: int) -> str:
        if self.stacked_s is None or self.concurrent_s is None:
            return f"--stack-seeds auto: {'stacked' if self.stacked else 'concurrent'} ({self.reason})"
        waves = math.ceil(seeds / self.at_once)
        apart = waves * self.concurrent_s
        return (
            f"--stack-seeds auto: a round of all {seeds} seeds takes {self.stacked_s:.3g} s stacked, "
            f"{apart:.3g} s as separate runs ({self.at_once} at a time, {self.concurrent_s:.3g} s a round): "
            f"{'stacked' if self.stacked else 'concurrent'} ({self.reason})"
        )


def prefer_stacked(stacked_s: float, concurrent_s: float, seeds: int, at_once: int) -> bool:
    """Whether the stacked group advances a round of all ``seeds`` faster than separate runs ``at_once`` at a time."""
    return stacked_s < math.ceil(seeds / max(1, at_once)) * concurrent_s


class _Clock:
    """The time each probe run ended each round (events arrive from threads and from the pool's listener)."""

    def __init__(self) -> None:
        self.ends: dict[str, dict[int, float]] = {}
        self.failures: list[str] = []
        self.interrupted = False
        self._lock = threading.Lock()

    def emit(self, ev: Event) -> None:
        if ev[0] == "round":
            with self._lock:
                self.ends.setdefault(ev[1], {})[int(ev[2])] = time.perf_counter()

    def result(self, res: RunResult) -> None:
        self.interrupted = self.interrupted or res.status in ("interrupted", "not started")
        if res.status != "finished":
            self.failures.append(f"{res.name}: {res.status}{': ' + res.error if res.error else ''}")

    def stop_if_interrupted(self) -> None:
        """Ctrl-C or SIGTERM during a probe: the sweep stops before it starts."""
        if self.interrupted:
            raise KeyboardInterrupt

    def steady(self, names: list[str]) -> float:
        """The median over ``names`` of one steady round (round 1's end to the last round's, per round)."""
        per_run = []
        for name in names:
            ends = self.ends.get(name, {})
            if 1 not in ends or PROBE_ROUNDS not in ends:
                raise RuntimeError(f"probe run {name} did not report rounds 1 and {PROBE_ROUNDS}")
            per_run.append((ends[PROBE_ROUNDS] - ends[1]) / (PROBE_ROUNDS - 1))
        return statistics.median(per_run)


def _probe_tasks(group: TaskGroup, root: Path, mode: str, count: int) -> list[Task]:
    tasks = []
    for i, task in enumerate(group.tasks[:count]):
        values = {**task.values, "rounds": PROBE_ROUNDS, "out": str(root / mode / str(i)), "db": None, "log": []}
        tasks.append(Task(f"probe-{mode}-{i}", values, "new"))
    return tasks


def probe_group(group: TaskGroup, jobs: int, emit: Callable[[Event], None] = lambda ev: None) -> StackChoice:
    """Measure ``group`` stacked and as separate runs (module docstring) and choose; ``emit`` hears when it starts."""
    seeds = len(group.tasks)
    at_once = max(1, min(jobs, seeds))
    rounds = int(group.values.get("rounds") or 0)
    if rounds < MIN_ROUNDS:
        return StackChoice(False, None, None, at_once, f"{rounds} rounds: too few to repay a probe of {PROBE_ROUNDS}")
    emit(("note", group.name, f"--stack-seeds auto: timing {PROBE_ROUNDS} rounds stacked and as separate runs"))
    root = Path(tempfile.mkdtemp(prefix="fedskew-stack-probe-"))
    try:
        clock = _Clock()
        stacked = _probe_tasks(group, root, "stacked", seeds)
        for res in execute_stacked(TaskGroup(tuple(stacked)), clock.emit):
            clock.result(res)
        clock.stop_if_interrupted()
        apart = _probe_tasks(group, root, "apart", at_once)
        if at_once == 1:
            clock.result(execute_run(apart[0], clock.emit))
        else:
            from fedskew.sweep.pool import run_pool

            got: dict[str, RunResult] = {}
            clock.interrupted = run_pool(list(apart), at_once, clock.emit, got, clock.result) or clock.interrupted
        clock.stop_if_interrupted()
        if clock.failures:
            return StackChoice(False, None, None, at_once, "the probe did not finish: " + "; ".join(clock.failures))
        stacked_s = clock.steady([t.name for t in stacked])
        concurrent_s = clock.steady([t.name for t in apart])
    finally:
        shutil.rmtree(root, ignore_errors=True)  # the probe's own temporary folder
    chosen = prefer_stacked(stacked_s, concurrent_s, seeds, at_once)
    return StackChoice(chosen, stacked_s, concurrent_s, at_once, "measured here, the faster")


def choose_stacking(
    units: list[Task | TaskGroup],
    jobs: int,
    emit: Callable[[Event], None],
    probe: Callable[[TaskGroup, int, Callable[[Event], None]], StackChoice] = probe_group,
) -> list[Task | TaskGroup]:
    """``units`` with each group of seeds kept as a group where ``probe`` finds stacking faster, else split back
    into its runs (in their places); each choice is a note of the group's first run."""
    out: list[Task | TaskGroup] = []
    for unit in units:
        if not isinstance(unit, TaskGroup):
            out.append(unit)
            continue
        choice = probe(unit, jobs, emit)
        emit(("note", unit.name, choice.note(len(unit.tasks))))
        out.extend([unit] if choice.stacked else unit.tasks)
    return out


__all__ = ["MIN_ROUNDS", "PROBE_ROUNDS", "StackChoice", "choose_stacking", "prefer_stacked", "probe_group"]
