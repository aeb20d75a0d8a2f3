"""``fedskew tune``: each method's hyper-parameters searched with Optuna on the clients' validation splits.

One Optuna study per method (its search space is its own), all in one storage (an SQLite file by default, any
SQLAlchemy URL otherwise), so that

* a search that is interrupted (Ctrl-C, a killed process, a machine that went away) continues when the same command
  runs again: finished trials are kept, a trial whose process died is retried with the same arguments, and its runs
  resume from their checkpoints (each trial's runs have run directories named by their configuration);
* several processes (``--jobs``) or machines given the same ``--storage`` URL tune one study together.

A trial is one fedskew run per tuning seed of the method with the trial's arguments, under ``validation`` (a share of
every client's training split held out) and ``evaluate_on: validation``: every evaluation view scores the
validation splits and no test sample is in the federation the trial runs on (tests/test_no_leakage.py). Its value is
the chosen metric's statistic (the protocol's headline by default) averaged over the seeds. Hopeless trials are pruned
on the per-round validation curve (Optuna's median rule, after a warm-up), TPE draws the arguments (seeded), and the
budget is a number of trials per method (pruned and failed ones count; a retried one does not).

Output, in ``OUT`` (default ``runs/tune-<name>``): ``tuned.yaml`` (the best arguments per method and setting, for
``--tuned``), ``optuna.db`` (the studies), the trials in the results database (table ``trials``), the trial runs under
``trials/``, and ``figures/search-<method>.png`` (with its numbers as JSON).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedskew.config import make_config
from fedskew.schema import ConfigError
from fedskew.space import RUN_LEVEL, Dist
from fedskew.sweep.core import MethodEntry
from fedskew.tuning.method_space import method_space
from fedskew.tuning.spec import TuneSpec, dump_tune_spec, load_tune_spec, objective_metric, trial_values
from fedskew.tuning.trials import Pruned, make_objective, run_trial_run
from fedskew.tuning.tuned import TunedEntry, canonical_method, setting_of, write_tuned

__all__ = ["MethodResult", "Pruned", "TuneSpec", "load_tune_spec", "run_trial_run", "summarize", "trial_row", "tune"]


# ---- a study per method ------------------------------------------------------------------------------------------
def _fingerprint(spec: TuneSpec, entry: MethodEntry, space: dict[str, Dist], metric: str) -> str:
    """What a study's trials depend on: a study that was run with another base, space or objective is refused."""
    blob = {
        "base": make_config(trial_values(spec, entry, {})).identity(),
        "space": {k: d.describe() for k, d in sorted(space.items())},
        "metric": metric,
        "statistic": spec.statistic,
        "seeds": spec.seed_list(),
    }
    return hashlib.sha1(json.dumps(blob, sort_keys=True, default=str).encode()).hexdigest()[:16]


def study_name(spec: TuneSpec, entry: MethodEntry) -> str:
    name = f"{spec.name}:{canonical_method(entry.name)}"
    if entry.args:
        name += ":" + ",".join(f"{k}={v}" for k, v in sorted(entry.args.items()))
    return name


def open_study(spec: TuneSpec, entry: MethodEntry, *, worker: int = 0) -> tuple[Any, dict[str, Dist], str]:
    """(study, space, metric) of ``entry``; the study is created in the storage or loaded (refused when it was run
    with other settings). ``worker``: which of the ``--jobs`` processes asks (each samples from its own seed, so
    that processes starting together do not draw the same arguments)."""
    import optuna

    from fedskew.tuning.storage import open_storage

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    space = dict(searched_spaces(spec)[spec.method_entries().index(entry)][1])
    metric, direction = objective_metric(spec, trial_values(spec, entry, {}))
    fp = _fingerprint(spec, entry, space, metric)
    seed = int(hashlib.sha1(f"{study_name(spec, entry)}:{spec.seed_list()[0]}".encode()).hexdigest()[:8], 16) + worker
    warmup = spec.warmup_rounds
    if warmup is None:
        warmup = max(1, int(make_config(trial_values(spec, entry, {})).rounds) // 4)
    pruner: Any = optuna.pruners.NopPruner()
    if spec.prune:
        pruner = optuna.pruners.MedianPruner(n_startup_trials=3, n_warmup_steps=warmup)

    def sampler(seed: int) -> Any:
        return optuna.samplers.TPESampler(seed=seed, n_startup_trials=min(5, max(spec.trials // 2, 1)))

    study = optuna.create_study(
        study_name=study_name(spec, entry),
        storage=open_storage(spec.storage_url),
        sampler=sampler(seed),
        pruner=pruner,
        direction=direction,
        load_if_exists=True,
    )
    if earlier := len(study.get_trials(deepcopy=False)):
        # a resumed search: a stream of its own (a function of the trials so far, so still reproducible), not the
        # first search's again, whose first draws repeat the first trials' arguments while TPE is in its random start
        study.sampler = sampler(seed + 100_003 * earlier)
    saved = study.user_attrs.get("fingerprint")
    if saved is None:
        study.set_user_attr("fingerprint", fp)
        study.set_user_attr("space", {k: d.describe() for k, d in space.items()})
        study.set_user_attr("metric", metric)
    elif saved != fp:
        raise ConfigError(
            f"study {study.study_name!r} in {spec.storage_url} was run with another base, search space or objective; "
            "choose another --name or --out (or the storage of that search)"
        )
    return study, space, metric


def searched_spaces(spec: TuneSpec) -> list[tuple[MethodEntry, dict[str, Dist]]]:
    """Each method of ``spec`` with the space its search covers (declared ranges, overrides, minus fixed arguments)."""
    out = []
    for entry in spec.method_entries():
        space = method_space(entry.name, spec.overrides())
        out.append((entry, {k: d for k, d in space.items() if k not in entry.args}))
    return out


def counted(study: Any) -> int:
    """Trials that use the budget: complete, pruned, and failed ones that were not retried."""
    from optuna.trial import TrialState

    trials = study.get_trials(deepcopy=False)
    retried = {n for t in trials for n in t.system_attrs.get("retry_history", [])}
    done = (TrialState.COMPLETE, TrialState.PRUNED)
    return sum(
        1
        for t in trials
        if t.state in done
        or (t.state == TrialState.FAIL and t.number not in retried and not t.user_attrs.get("interrupted"))
    )


def recover_dead_trials(study: Any) -> list[int]:
    """Trials left RUNNING by a process of this machine that no longer exists (killed, crashed), and trials stopped
    by Ctrl-C or SIGTERM: failed and queued again with the same arguments (their runs then resume from their
    checkpoints). Other machines' running trials are left to the heartbeat. Returns the recovered trial numbers."""
    from optuna.trial import TrialState

    from fedskew.results.rundir import pid_alive
    from fedskew.tuning.storage import retry_callback

    host, recovered = socket.gethostname(), []
    trials = study.get_trials(deepcopy=False)
    retried = {n for t in trials for n in t.system_attrs.get("retry_history", [])}
    for t in trials:
        pid = t.user_attrs.get("pid")
        if t.state == TrialState.RUNNING:
            if t.user_attrs.get("host") != host or not isinstance(pid, int) or pid_alive(pid):
                continue
            study._storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
        elif not (t.state == TrialState.FAIL and t.user_attrs.get("interrupted") and t.number not in retried):
            continue
        retry_callback()(study, study._storage.get_trial(t._trial_id))
        recovered.append(t.number)
    return recovered


def _budget(spec: TuneSpec, space: dict[str, Dist]) -> int:
    return spec.trials if space else 1  # nothing to search: one run of the defaults, the reference


def optimize(
    spec: TuneSpec, entry: MethodEntry, on_trial: Callable[[Any, Any], None] | None = None, worker: int = 0
) -> None:
    """Run this process's share of ``entry``'s trials until the study has its budget (or the timeout passes)."""
    study, space, metric = open_study(spec, entry, worker=worker)
    budget = _budget(spec, space)
    left = budget - counted(study)
    if left <= 0:
        return

    def callback(study: Any, trial: Any) -> None:
        record_trial(spec, entry, study, trial)
        if on_trial is not None:
            on_trial(study, trial)
        if counted(study) >= budget:
            study.stop()

    with quiet_interruptions():
        study.optimize(
            make_objective(spec, entry, space, metric, group=study.study_name),
            n_trials=left,
            timeout=spec.timeout,
            callbacks=[callback],
            catch=(),
            gc_after_trial=False,
        )


class _InterruptedTrials(logging.Filter):
    """Drops Optuna's report of a trial stopped by Ctrl-C or a signal (its traceback, then "failed with value
    None"): the interrupted trial is retried by the next run of the search, and fedskew says so in one line."""

    def __init__(self) -> None:
        super().__init__()
        self.interrupted = False

    def filter(self, record: logging.LogRecord) -> bool:
        from fedskew.runner import RunInterrupted

        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, (RunInterrupted, KeyboardInterrupt)):
            self.interrupted = True
            return False
        return not (self.interrupted and "failed with value None" in record.getMessage())


@contextlib.contextmanager
def quiet_interruptions() -> Iterator[None]:
    """While searching, Optuna's handlers leave out an interrupted trial's traceback (:class:`_InterruptedTrials`)."""
    handlers = logging.getLogger("optuna").handlers
    quiet = _InterruptedTrials()
    for h in handlers:
        h.addFilter(quiet)
    try:
        yield
    finally:
        for h in handlers:
            h.removeFilter(quiet)


def _worker(spec_json: str, index: int, worker: int) -> None:
    """A ``--jobs`` process: tunes one method's study beside the others."""
    import signal

    from fedskew.lifecycle import die_with_parent

    die_with_parent()  # its parent is the pool's fork server, which ends with the search: a kill -9 leaves no trial
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides; a killed trial is retried on the next run
    spec = TuneSpec.model_validate_json(spec_json)
    optimize(spec, spec.method_entries()[index], worker=worker)


# ---- recording ---------------------------------------------------------------------------------------------------
def trial_row(spec: TuneSpec, entry: MethodEntry, study: Any, trial: Any) -> dict[str, Any]:
    """One trial as the ``trials`` table and the search figure record it: its objective value when it completed
    (``None`` otherwise), and the last reported round of its validation curve (where a pruned trial stopped)."""
    from optuna.trial import TrialState

    complete = trial.state == TrialState.COMPLETE and trial.value is not None and math.isfinite(trial.value)
    inter = trial.intermediate_values
    last = max(inter) if inter else None
    return {
        "study": study.study_name,
        "number": trial.number,
        "method": canonical_method(entry.name),
        "state": trial.state.name.lower(),
        "value": float(trial.value) if complete else None,
        "params": dict(trial.params),
        "last_step": last,
        "last_value": None if last is None else float(inter[last]),
        "run_dirs": trial.user_attrs.get("run_dirs", []),
        "note": trial.user_attrs.get("diverged", ""),
        "started": trial.datetime_start.isoformat(timespec="seconds") if trial.datetime_start else None,
        "finished": trial.datetime_complete.isoformat(timespec="seconds") if trial.datetime_complete else None,
    }


def record_trial(spec: TuneSpec, entry: MethodEntry, study: Any, trial: Any) -> None:
    """The trial into the results database's ``trials`` table (a row per study and trial number, replaced)."""
    from fedskew.results.store import ResultsDB

    with ResultsDB(spec.db_path) as db:
        db.add_trial(trial_row(spec, entry, study, trial))


# ---- the whole search --------------------------------------------------------------------------------------------
@dataclass
class MethodResult:
    entry: MethodEntry
    study: str
    metric: str
    direction: str
    space: dict[str, str]
    counts: dict[str, int]
    best: TunedEntry | None
    trials: list[dict[str, Any]]
    figure: Path | None = None


def tune(
    spec: TuneSpec,
    *,
    on_trial: Callable[[MethodEntry, Any, Any], None] | None = None,
    on_note: Callable[[str], None] | None = None,
    executor: Any = None,
) -> list[MethodResult]:
    """Tune every method of ``spec`` (one after the other; ``spec.jobs`` trials of a method at a time), then write
    ``tuned.yaml`` and the figures. Re-running continues an interrupted search. ``executor``: a
    :class:`fedskew.sweep.ray.RayExecutor` whose tasks are the ``spec.jobs`` workers (each sampling from its own
    seed, all on the one study storage); default local processes."""
    note = on_note or (lambda msg: None)
    spec.root.mkdir(parents=True, exist_ok=True)
    (spec.root / "tune.yaml").write_text(dump_tune_spec(spec))
    results = []
    for index, entry in enumerate(spec.method_entries()):
        study, space, metric = open_study(spec, entry)
        for n in recover_dead_trials(study):
            note(f"{study.study_name}: trial {n} was cut off (its process is gone); it runs again, from its checkpoint")
        if executor is not None and _budget(spec, space) - counted(study) > 0:
            calls = [(spec.model_dump_json(), index, w + 1) for w in range(max(spec.jobs, 1))]
            executor.run_calls(_worker, calls)
        elif spec.jobs > 1 and _budget(spec, space) - counted(study) > 1:
            _parallel(spec, index)
        else:
            optimize(spec, entry, None if on_trial is None else lambda s, t, e=entry: on_trial(e, s, t))
        results.append(summarize(spec, entry))
    entries = [r.best for r in results if r.best is not None]
    if entries:
        write_tuned(spec.tuned_path, entries)
    from fedskew.tuning.plots import plot_search

    for r in results:
        r.figure = plot_search(r, spec.root / "figures")
    return results


def _parallel(spec: TuneSpec, index: int) -> None:
    """``spec.jobs`` worker processes on one study. SIGTERM or Ctrl-C to this process reaches the workers as SIGTERM:
    their running trials checkpoint after the round and are retried by the next run of the search (the workers ignore
    SIGINT themselves, and are not this process's children in the OS sense, so nothing else would stop them)."""
    import multiprocessing
    import signal
    import threading
    from concurrent.futures import ProcessPoolExecutor

    from fedskew.sweep.pool import mp_context, terminate

    def stop_workers(*_: Any) -> None:
        terminate([proc.pid for proc in multiprocessing.active_children() if proc.pid is not None])

    on_main = threading.current_thread() is threading.main_thread()
    old_term = signal.signal(signal.SIGTERM, stop_workers) if on_main else None
    try:
        with ProcessPoolExecutor(max_workers=spec.jobs, mp_context=mp_context()) as pool:
            futures = [pool.submit(_worker, spec.model_dump_json(), index, w + 1) for w in range(spec.jobs)]
            try:
                for f in futures:
                    f.result()
            except KeyboardInterrupt:
                stop_workers()
                raise
    finally:
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)


def summarize(spec: TuneSpec, entry: MethodEntry) -> MethodResult:
    """The study of ``entry`` as it stands: counts, every trial, and the best trial as a ``tuned.yaml`` entry."""
    from optuna.trial import TrialState

    study, space, metric = open_study(spec, entry)
    trials = study.get_trials(deepcopy=False)
    counts = {s: sum(1 for t in trials if t.state.name.lower() == s) for s in ("complete", "pruned", "fail", "running")}
    complete = [t for t in trials if t.state == TrialState.COMPLETE and t.value is not None and math.isfinite(t.value)]
    best = None
    if complete:
        sign = 1.0 if study.direction.name == "MAXIMIZE" else -1.0
        top = max(complete, key=lambda t: (sign * t.value, -t.number))
        cfg = make_config(trial_values(spec, entry, dict(top.params))).model_dump()
        tuned_run = {k: v for k, v in top.params.items() if k in RUN_LEVEL}
        best = TunedEntry(
            canonical_method(entry.name),
            setting_of(cfg, exclude=tuple(tuned_run)),
            {**entry.args, **{k: v for k, v in top.params.items() if k not in RUN_LEVEL}},
            tuned_run,
            {
                "value": round(float(top.value), 6),
                "metric": metric,
                "statistic": spec.statistic,
                "evaluated_on": f"validation ({spec.validation:g} of each client's training split)",
                "study": study.study_name,
                "best_trial": top.number,
                "space": {k: d.describe() for k, d in space.items()},
                "trials": {"budget": _budget(spec, space), **counts},
                "seeds": spec.seed_list(),
                "rounds": cfg["rounds"],
                "tuned_at": time.strftime("%Y-%m-%d %H:%M:%S"),
            },
        )
    rows = [trial_row(spec, entry, study, t) for t in trials]
    return MethodResult(
        entry,
        study.study_name,
        metric,
        study.direction.name.lower(),
        {k: d.describe() for k, d in space.items()},
        counts,
        best,
        rows,
    )
