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

import hashlib
import json
import math
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator

from fedskew.config import ConfigError, load_yaml, make_config
from fedskew.schema import StrictSettings, describe_errors
from fedskew.sweep import MethodEntry
from fedskew.tuning.space import RUN_LEVEL, Dist, as_dist, method_space, suggest, unknown_overrides
from fedskew.tuning.tuned import TunedEntry, canonical_method, setting_of, write_tuned

# keys a tune spec's base may not set: the search sets them per trial
_TUNE_OWNED = ("method", "seed", "out", "db", "validation", "evaluate_on")


class TuneSpec(StrictSettings):
    """A search: ``base`` settings, the ``methods`` to tune, the budget and the objective."""

    name: str | None = Field(None, description="the search's name (default: the spec file's name, or 'tune')")
    base: dict[str, Any] = Field(default_factory=dict, description="settings every trial shares (a config file)")
    methods: list[str | MethodEntry] = Field(min_length=1, description="methods to tune (args: fixed, not searched)")
    space: dict[str, Any] = Field(
        default_factory=dict, description="KEY: SPEC overrides of the declared ranges (lr=log:0.001..0.1, mu=none)"
    )
    trials: int = Field(20, ge=1, description="trials per method (a method with nothing to tune runs once)")
    seeds: list[int] | int = Field(default_factory=lambda: [0], description="seeds each trial runs (value: mean)")
    validation: float = Field(0.2, gt=0, lt=1, description="share of every client's training split held out")
    metric: str = Field("auto", description="the objective (auto: the protocol's headline; domain skew: AVG)")
    statistic: Literal["last_n_mean", "best", "final"] = Field("last_n_mean", description="of the metric's curve")
    prune: bool = Field(True, description="stop trials whose validation curve trails the median (after warm-up)")
    warmup_rounds: int | None = Field(None, ge=0, description="rounds before pruning may act (default: rounds/4)")
    storage: str | None = Field(None, description="Optuna storage URL (default sqlite:///OUT/optuna.db)")
    out: str | None = Field(None, description="output folder (default runs/tune-<name>)")
    db: str | None = Field(None, description="results database for the trials table (default OUT/fedskew.db)")
    tuned: str | None = Field(None, description="the tuned.yaml to write or update (default OUT/tuned.yaml)")
    jobs: int = Field(1, ge=1, description="trials at a time, each in its own process")
    timeout: float | None = Field(None, gt=0, description="stop starting trials of a method after this many seconds")

    @field_validator("seeds")
    @classmethod
    def _seeds(cls, v: list[int] | int) -> list[int] | int:
        if isinstance(v, int) and v < 1:
            raise ValueError(f"a seed count must be >= 1, got {v}")
        if isinstance(v, list) and (not v or any(s < 0 for s in v) or len(set(v)) != len(v)):
            raise ValueError(f"seeds must be distinct non-negative integers, got {v}")
        return v

    @field_validator("base")
    @classmethod
    def _base(cls, v: dict[str, Any]) -> dict[str, Any]:
        v = {str(k).replace("-", "_"): x for k, x in v.items()}
        owned = [k for k in _TUNE_OWNED if k in v]
        if owned:
            raise ValueError(f"{owned} are set by the search itself (methods:, seeds:, out:, db:, validation:)")
        return v

    def seed_list(self) -> list[int]:
        return list(range(self.seeds)) if isinstance(self.seeds, int) else list(self.seeds)

    def method_entries(self) -> list[MethodEntry]:
        return [MethodEntry(name=m) if isinstance(m, str) else m for m in self.methods]

    @property
    def root(self) -> Path:
        return Path(self.out or f"runs/tune-{self.name or 'tune'}")

    @property
    def storage_url(self) -> str:
        return self.storage or f"sqlite:///{(self.root / 'optuna.db').resolve()}"

    @property
    def db_path(self) -> str:
        return str(self.db or self.root / "fedskew.db")

    @property
    def tuned_path(self) -> Path:
        return Path(self.tuned) if self.tuned else self.root / "tuned.yaml"

    def overrides(self) -> dict[str, Dist | None]:
        return {str(k): as_dist(v) for k, v in self.space.items()}


def load_tune_spec(path: str | Path | None, updates: dict[str, Any] | None = None) -> TuneSpec:
    """A tune spec from a YAML file (or none) with ``updates`` (the command line's flags) on top, validated; every
    method, the base configuration and the space overrides are checked before anything runs."""
    values = load_yaml(path) if path else {}
    for k, v in (updates or {}).items():
        if v is None:
            continue
        if k in ("base", "space"):
            values[k] = {**values.get(k, {}), **v}
        else:
            values[k] = v
    where = f"tune spec {path}" if path else "tune settings"
    try:
        spec = TuneSpec(**values)
    except ValidationError as exc:
        raise ConfigError(f"{where}:\n  " + "\n  ".join(describe_errors(exc))) from None
    if spec.name is None:
        spec = spec.model_copy(update={"name": Path(path).stem if path else "tune"})
    check_spec(spec)
    return spec


def check_spec(spec: TuneSpec) -> None:
    """Every method with its fixed arguments, under the base, is a valid run; the space overrides name keys of some
    method (or run-level settings); the metric is known to the objective."""
    overrides = spec.overrides()
    for entry in spec.method_entries():
        _trial_values(spec, entry, {})  # validates the base with this method
        method_space(entry.name, overrides)
    unknown = unknown_overrides([e.name for e in spec.method_entries()], overrides)
    if unknown:
        raise ConfigError(
            f"search space: {unknown} belong to none of the methods {[e.name for e in spec.method_entries()]} "
            f"and are not run-level settings ({', '.join(RUN_LEVEL)})"
        )


def _trial_values(spec: TuneSpec, entry: MethodEntry, params: dict[str, Any], seed: int | None = None) -> dict:
    """The configuration of one trial run (validated): base + the trial's arguments, on the validation splits."""
    run = {k: v for k, v in params.items() if k in RUN_LEVEL}
    margs = {**entry.args, **{k: v for k, v in params.items() if k not in RUN_LEVEL}}
    values = {
        **spec.base,
        **run,
        "method": entry.name,
        "method_args": {**spec.base.get("method_args", {}), **margs},
        "validation": spec.validation,
        "evaluate_on": "validation",
        "db": None,
        "seed": spec.seed_list()[0] if seed is None else seed,
    }
    try:
        make_config(values)
    except ConfigError as exc:
        raise ConfigError(f"method {entry.display()}: {exc}") from None
    return values


def objective_metric(spec: TuneSpec, cfg_values: dict[str, Any]) -> tuple[str, str]:
    """(metric, direction): ``auto`` is the protocol's headline metric (PFLlib: the clients' sample-weighted accuracy;
    FedCAC: the personalized models' mean accuracy; fedskew: the global model's accuracy) or, under domain skew, the
    AVG over domains; ``*_std`` and ``*_loss`` metrics are minimized."""
    metric = spec.metric
    if metric == "auto":
        cfg = make_config(cfg_values)
        if cfg.partition == "domain":
            metric = "domain_acc_avg"
        elif cfg.protocol == "pfllib":
            metric = "global_local_acc"
        elif cfg.protocol == "fedcac":
            from fedskew.methods import resolve_method

            metric = "personal_acc_mean" if resolve_method(cfg.method, cfg.method_args).personalized else (
                "global_local_acc_mean"
            )
        else:
            metric = "global_acc"
    direction = "minimize" if metric.endswith(("_std", "_loss")) else "maximize"
    return metric, direction


# ---- one trial ---------------------------------------------------------------------------------------------------
class Pruned(Exception):
    """The trial's validation curve trails: stop its run (fedskew.runner.StopRun subclasses are raised from here)."""


def _run_dir(spec: TuneSpec, entry: MethodEntry, cfg: Any) -> Path:
    from fedskew.sweep import run_name

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
    from fedskew.sweep import PlannedRun, run_state

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


def make_objective(spec: TuneSpec, entry: MethodEntry, space: dict[str, Dist], metric: str) -> Callable[[Any], float]:
    """The Optuna objective of ``entry``: the trial's runs, one per tuning seed, and the mean of their statistic."""
    import optuna

    from fedskew.runner import RunInterrupted

    seeds = spec.seed_list()

    def objective(trial: Any) -> float:
        trial.set_user_attr("host", socket.gethostname())
        trial.set_user_attr("pid", os.getpid())
        params = {k: suggest(trial, k, d) for k, d in space.items()}
        values = _trial_values(spec, entry, params)
        rounds = int(make_config(values).rounds)
        scores, dirs = [], []
        for i, seed in enumerate(seeds):
            cfg = make_config({**values, "seed": seed})
            cfg = cfg.model_copy(update={"out": str(_run_dir(spec, entry, cfg))})
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


# ---- a study per method ------------------------------------------------------------------------------------------
def _fingerprint(spec: TuneSpec, entry: MethodEntry, space: dict[str, Dist], metric: str) -> str:
    """What a study's trials depend on: a study that was run with another base, space or objective is refused."""
    blob = {
        "base": make_config(_trial_values(spec, entry, {})).identity(),
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


def storage(spec: TuneSpec) -> Any:
    """The RDB storage, with heartbeats (a trial whose process stopped beating for 3 minutes is failed and retried
    by the next process that tunes the study, on any machine)."""
    import warnings

    import optuna

    url = spec.storage_url
    if url.startswith("sqlite:///"):
        Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    kwargs = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else None
    with warnings.catch_warnings():  # heartbeats are marked experimental in Optuna; they are what resumption needs
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.storages.RDBStorage(
            url,
            engine_kwargs=kwargs,
            heartbeat_interval=60,
            grace_period=180,
            heartbeat_stale_trial_callback=_retry(),
        )


def _retry() -> Any:
    """Optuna's callback that queues a failed trial again with the same arguments (at most 3 times)."""
    import warnings

    import optuna

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=3)


def open_study(spec: TuneSpec, entry: MethodEntry, *, worker: int = 0) -> tuple[Any, dict[str, Dist], str]:
    """(study, space, metric) of ``entry``; the study is created in the storage or loaded (refused when it was run
    with other settings). ``worker``: which of the ``--jobs`` processes asks (each samples from its own seed, so
    that processes starting together do not draw the same arguments)."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    space = method_space(entry.name, spec.overrides())
    for k in entry.args:  # fixed by the spec: not searched
        space.pop(k, None)
    metric, direction = objective_metric(spec, _trial_values(spec, entry, {}))
    fp = _fingerprint(spec, entry, space, metric)
    seed = int(hashlib.sha1(f"{study_name(spec, entry)}:{spec.seed_list()[0]}".encode()).hexdigest()[:8], 16) + worker
    warmup = spec.warmup_rounds
    if warmup is None:
        warmup = max(1, int(make_config(_trial_values(spec, entry, {})).rounds) // 4)
    pruner: Any = optuna.pruners.NopPruner()
    if spec.prune:
        pruner = optuna.pruners.MedianPruner(n_startup_trials=3, n_warmup_steps=warmup)
    study = optuna.create_study(
        study_name=study_name(spec, entry),
        storage=storage(spec),
        sampler=optuna.samplers.TPESampler(seed=seed, n_startup_trials=min(5, max(spec.trials // 2, 1))),
        pruner=pruner,
        direction=direction,
        load_if_exists=True,
    )
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
        _retry()(study, study._storage.get_trial(t._trial_id))
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

    study.optimize(
        make_objective(spec, entry, space, metric),
        n_trials=left,
        timeout=spec.timeout,
        callbacks=[callback],
        catch=(),
        gc_after_trial=False,
    )


def _worker(spec_json: str, index: int, worker: int) -> None:
    """A ``--jobs`` process: tunes one method's study beside the others."""
    import signal

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
) -> list[MethodResult]:
    """Tune every method of ``spec`` (one after the other; ``spec.jobs`` trials of a method at a time), then write
    ``tuned.yaml`` and the figures. Re-running continues an interrupted search."""
    note = on_note or (lambda msg: None)
    spec.root.mkdir(parents=True, exist_ok=True)
    (spec.root / "tune.yaml").write_text(dump_tune_spec(spec))
    results = []
    for index, entry in enumerate(spec.method_entries()):
        study, space, metric = open_study(spec, entry)
        for n in recover_dead_trials(study):
            note(f"{study.study_name}: trial {n} was cut off (its process is gone); it runs again, from its checkpoint")
        if spec.jobs > 1 and _budget(spec, space) - counted(study) > 1:
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
    from concurrent.futures import ProcessPoolExecutor

    from fedskew.sweep import _mp_context

    with ProcessPoolExecutor(max_workers=spec.jobs, mp_context=_mp_context()) as pool:
        futures = [pool.submit(_worker, spec.model_dump_json(), index, w + 1) for w in range(spec.jobs)]
        for f in futures:
            f.result()


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
        cfg = make_config(_trial_values(spec, entry, dict(top.params))).model_dump()
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


def dump_tune_spec(spec: TuneSpec) -> str:
    import yaml

    data = spec.model_dump(exclude_defaults=True)
    data["methods"] = [m if isinstance(m, str) else m.model_dump(exclude_defaults=True) for m in spec.methods]
    return yaml.safe_dump(data, sort_keys=False)
