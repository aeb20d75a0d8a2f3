"""One trial of a search: its runs (one per tuning seed) in run directories named by their configuration, read when
finished, resumed when cut off; the validation curve reported round by round to the pruner; the objective."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fedskew.config import ConfigError, make_config
from fedskew.space import Dist, suggest
from fedskew.sweep.core import MethodEntry
from fedskew.tuning.spec import TuneSpec, trial_values
from fedskew.tuning.tuned import canonical_method


class Pruned(Exception):
    """The trial's validation curve trails: stop its run (fedskew.runner.StopRun subclasses are raised from here)."""


def _run_dir(spec: TuneSpec, entry: MethodEntry, cfg: Any) -> Path:
    from fedskew.sweep.core import run_name

    slug = canonical_method(entry.name).replace("+", "_")
    if entry.args:
        slug += "-" + hashlib.sha1(json.dumps(entry.args, sort_keys=True).encode()).hexdigest()[:6]
    return spec.root / "trials" / slug / run_name(cfg, [])


def run_trial_run(
    cfg: Any, report: Callable[[int, float], None], metric: str, on_note: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """One run of a trial in its own run directory: skipped when it already finished (its summary is read), resumed
    from its checkpoint when it was cut off, else (re)started. ``report(round, value)`` gets the metric of every
    evaluated round and may raise :class:`Pruned`. Returns the run's summary."""
    from fedskew.runner import StopRun, run_experiment
    from fedskew.sweep.core import PlannedRun, run_state

    _wait_for_other_writer(Path(cfg.out))
    state, detail = run_state(PlannedRun(Path(cfg.out).name, cfg, ""))
    if state == "blocked":
        raise ConfigError(detail)
    if state in ("done", "resume"):  # the pruner sees the whole curve, whichever process ran its rounds
        _replay(Path(cfg.out), report, metric, every=state == "done")
    if state == "done":
        return json.loads((Path(cfg.out) / "summary.json").read_text())

    class _Stop(StopRun, Pruned):
        pass

    def on_round(result: Any) -> None:
        rec = result.record
        if metric in rec and rec.get("evaluated", True):
            try:
                report(int(rec["round"]), float(rec[metric]))
            except Pruned as exc:
                raise _Stop(f"pruned at round {rec['round']}") from exc

    outcome = run_experiment(cfg, overwrite=state == "restart", on_round=on_round, on_note=on_note)
    return outcome.summary


def _wait_for_other_writer(run_dir: Path, poll: float = 0.5) -> None:
    """Two processes of one search may draw the same arguments at once (TPE on a small space): the second waits
    for the first's run of them to end (its lock released, or its process gone), then reads or resumes it."""
    from fedskew.results.rundir import LOCK, pid_alive

    lock = run_dir / LOCK
    while lock.exists():
        try:
            holder = json.loads(lock.read_text())
        except (OSError, ValueError):
            holder = {}
        pid = holder.get("pid")
        if holder.get("host") == socket.gethostname() and (not isinstance(pid, int) or not pid_alive(pid)):
            return  # a dead writer's lock: the run directory takes it over
        if holder.get("host") not in (None, socket.gethostname()):
            return  # another machine's run: its lock is reported as it is
        time.sleep(poll)


def _replay(run_dir: Path, report: Callable[[int, float], None], metric: str, *, every: bool) -> None:
    """Report the rounds a run directory already holds (all of them, or those up to its checkpoint)."""
    from fedskew.results.rundir import RunDirectory

    rd = RunDirectory(run_dir)
    upto = None if every else rd.status().get("checkpoint_round")
    for rec in rd.read_lines("metrics.jsonl"):
        if (upto is None or rec["round"] <= upto) and metric in rec and rec.get("evaluated", True):
            report(int(rec["round"]), float(rec[metric]))


def make_objective(
    spec: TuneSpec, entry: MethodEntry, space: dict[str, Dist], metric: str, group: str | None = None
) -> Callable[[Any], float]:
    """The Optuna objective of ``entry``: the trial's runs, one per tuning seed, and the mean of their statistic.
    ``group``: the live loggers' group of the runs (the study's name)."""
    import optuna

    from fedskew.runner import RunInterrupted

    seeds = spec.seed_list()

    def objective(trial: Any) -> float:
        trial.set_user_attr("host", socket.gethostname())
        trial.set_user_attr("pid", os.getpid())
        params = {k: suggest(trial, k, d) for k, d in space.items()}
        values = trial_values(spec, entry, params)
        rounds = int(make_config(values).rounds)
        scores, dirs = [], []
        for i, seed in enumerate(seeds):
            cfg = make_config({**values, "seed": seed})
            cfg = cfg.model_copy(update={"out": str(_run_dir(spec, entry, cfg)), "log_group": group})
            dirs.append(str(cfg.out))
            trial.set_user_attr("run_dirs", dirs)

            def report(rnd: int, value: float, i: int = i) -> None:
                trial.report(value, i * rounds + rnd)
                if trial.should_prune():
                    raise Pruned

            try:
                summary = run_trial_run(cfg, report, metric)
            except Pruned:
                raise optuna.TrialPruned(f"validation {metric} trails the median") from None
            except (RunInterrupted, KeyboardInterrupt):
                trial.set_user_attr("interrupted", True)  # retried by the next run of the search (not counted)
                raise
            if summary.get("diverged"):
                trial.set_user_attr("diverged", f"seed {seed}, round {summary.get('diverged_round')}")
                return float("nan")  # a failed trial: TPE learns nothing from it, the budget counts it
            if metric not in summary:
                raise ConfigError(
                    f"metric {metric!r} is not in the summary of {cfg.out} (it has: "
                    f"{', '.join(k for k in summary if isinstance(summary[k], dict))}); choose --metric"
                )
            scores.append(float(summary[metric][spec.statistic]))
        trial.set_user_attr("scores", scores)
        return float(sum(scores) / len(scores))

    return objective
