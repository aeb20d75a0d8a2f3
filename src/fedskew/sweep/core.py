"""``fedskew sweep SPEC.yaml``: many runs from one spec, in a process pool, into one database, idempotently.

A spec (docs/sweeps.md) names a ``base`` configuration and the axes that vary it: ``cases`` (a list of partial
configurations), ``zip`` (keys that move together), ``grid`` (a cartesian product over any configuration key,
``method_args.KEY`` included), ``methods`` (method compositions with their ``-m`` arguments) and ``seeds``. Every
point of the product is one run of :func:`fedskew.runner.run_experiment`, in its own run directory under ``out``
whose name is derived from the run's configuration (so the same spec always maps to the same directories), and every
run is recorded in the one database ``db``.

Running a spec twice does no work twice: a finished run is skipped (and recorded in the database if it is not
there yet), an interrupted one continues from its checkpoint, one that died before its first checkpoint starts
over. A run that fails is listed at the end with its error; the others go on.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError, field_validator

from fedskew.config import ConfigError, RunConfig, load_yaml, make_config
from fedskew.schema import StrictSettings, describe_errors
from fedskew.sweep.task import (
    Event,
    RunResult,
    Task,
    TaskGroup,
    execute,
    finished_id,
    folder_state,
    group_seeds,
    members,
    settled,
)
from fedskew.tuning.tuned import apply_tuned

_finished_id = finished_id  # the Ray executor's name for it

# keys every run gets from the sweep itself, never from an axis
_SWEEP_OWNED = ("out", "db", "seed")
MAX_RUNS = 100_000  # the most runs one sweep expands to (a typo such as seeds: 100000000 is refused at once)
# identity keys already in the default run-folder name (store.default_run_dir), or shown elsewhere
_NAMED = ("method", "method_args", "dataset", "partition")


class MethodEntry(StrictSettings):
    """One method of a sweep: a composition (``fedprox+disco``) with its hyper-parameters (``-m`` arguments)."""

    name: str = Field(min_length=1, description="method or composition, as `fedskew run --method`")
    args: dict[str, Any] = Field(default_factory=dict, description="hyper-parameters, as `-m KEY=VALUE`")
    label: str | None = Field(None, description="how the progress display names it (default: the name and args)")
    config: dict[str, Any] = Field(
        default_factory=dict,
        description="run settings this method needs beyond the base and the case (FedFomo: validation: 0.2)",
    )

    def display(self) -> str:
        args = ", ".join(f"{k}={v}" for k, v in sorted(self.args.items()))
        return self.label or (f"{self.name} ({args})" if args else self.name)


class SweepSpec(StrictSettings):
    """A sweep: ``base`` varied by ``cases`` x ``zip`` groups x ``grid`` x ``methods`` x ``seeds``."""

    name: str | None = Field(None, description="the sweep's name (default: the spec file's name)")
    base: dict[str, Any] = Field(default_factory=dict, description="settings every run shares (a config file)")
    cases: list[dict[str, Any]] = Field(default_factory=list, description="alternative partial configurations")
    zip: dict[str, list[Any]] | list[dict[str, list[Any]]] = Field(
        default_factory=list, description="keys whose i-th values go together (one group, or a list of groups)"
    )
    grid: dict[str, list[Any]] = Field(default_factory=dict, description="cartesian product over these keys")
    methods: list[str | MethodEntry] = Field(default_factory=list, description="method compositions with args")
    seeds: list[int] | int | None = Field(None, description="seeds (a list), or a count n for seeds 0..n-1")
    out: str | None = Field(None, description="root folder of the run directories (default runs/sweep-<name>)")
    db: str | None = Field(None, description="the one results database (default <out>/fedskew.db)")
    jobs: int | None = Field(None, ge=1, description="runs at a time (default 1; --jobs wins)")
    metrics: list[str] = Field(default_factory=lambda: ["global_acc"], description="metrics of the final table")
    tuned: str | None = Field(
        None, description="a tuned.yaml of `fedskew tune`: each run takes the tuned arguments of its method and setting"
    )

    @field_validator("grid")
    @classmethod
    def _grid_lists(cls, v: dict[str, list[Any]]) -> dict[str, list[Any]]:
        empty = [k for k, vals in v.items() if not vals]
        if empty:
            raise ValueError(f"grid key(s) {empty} have no values; give each a non-empty list")
        return v

    @field_validator("zip")
    @classmethod
    def _zip_lengths(cls, v: Any) -> list[dict[str, list[Any]]]:
        groups = [v] if isinstance(v, dict) else list(v)
        for g in groups:
            lengths = {k: len(vals) for k, vals in g.items()}
            if not g or len(set(lengths.values())) != 1 or 0 in lengths.values():
                raise ValueError(f"a zip group needs non-empty lists of one common length, got lengths {lengths}")
        return groups

    @field_validator("seeds")
    @classmethod
    def _seeds(cls, v: list[int] | int | None) -> list[int] | int | None:
        if isinstance(v, int) and v < 1:
            raise ValueError(f"a seed count must be >= 1, got {v}")
        if isinstance(v, list) and (not v or any(s < 0 for s in v) or len(set(v)) != len(v)):
            raise ValueError(f"seeds must be distinct non-negative integers, got {v}")
        return v

    def seed_count(self) -> int:
        return 1 if self.seeds is None else self.seeds if isinstance(self.seeds, int) else len(self.seeds)

    def seed_list(self) -> list[int]:
        if self.seeds is None:
            return [int(self.base.get("seed", 0))]
        return list(range(self.seeds)) if isinstance(self.seeds, int) else list(self.seeds)

    def method_entries(self) -> list[MethodEntry | None]:
        return [MethodEntry(name=m) if isinstance(m, str) else m for m in self.methods] or [None]


def load_spec(path: str | Path) -> SweepSpec:
    """Read and validate a sweep spec; a problem is a :class:`ConfigError` naming the file and the key."""
    values = load_yaml(path)
    try:
        spec = SweepSpec(**values)
    except ValidationError as exc:
        raise ConfigError(f"sweep spec {path}:\n  " + "\n  ".join(describe_errors(exc, SweepSpec))) from None
    if spec.name is None:
        spec = spec.model_copy(update={"name": Path(path).stem})
    return spec


def dump_spec(spec: SweepSpec) -> str:
    """The spec as YAML (what ``fedskew reproduce`` writes next to its table, re-runnable with ``fedskew sweep``)."""
    data = spec.model_dump(exclude_defaults=True)
    if spec.methods:
        data["methods"] = [m if isinstance(m, str) else m.model_dump(exclude_defaults=True) for m in spec.methods]
    return yaml.safe_dump(data, sort_keys=False)


# ---- expansion -------------------------------------------------------------------------------------------------
@dataclass
class PlannedRun:
    """One run of a sweep: its folder name, its validated configuration, and where on each axis it sits."""

    name: str
    cfg: RunConfig
    label: str  # for the progress display
    point: dict[str, Any] = field(default_factory=dict)  # {"case": i, "method": j, "seed": s, ...}
    tuned: dict[str, Any] | None = None  # the tuned arguments it took ({"args": ..., "run": ..., "study": ...})


def _set(values: dict[str, Any], key: str, value: Any, where: str) -> None:
    key = str(key).replace("-", "_")
    if key in _SWEEP_OWNED:
        raise ConfigError(
            f"{where}: {key!r} is set by the sweep itself (top-level out/db, seeds:), not by a configuration key"
        )
    mapping = key.split(".", 1)[0]
    if key in ("method_args", "partition_args"):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: {key} must be a mapping, got {value!r}")
        values[key] = {**values.get(key, {}), **value}
    elif mapping in ("method_args", "partition_args") and "." in key:
        arg = key.split(".", 1)[1].replace("-", "_")
        values[mapping] = {**values.get(mapping, {}), arg: value}
    else:
        values[key] = value


def _axes(spec: SweepSpec) -> list[list[tuple[str, Any, dict[str, Any]]]]:
    """Each axis as its points: (axis name, position on it, partial configuration)."""
    axes: list[list[tuple[str, Any, dict[str, Any]]]] = []
    if spec.cases:
        axes.append([("case", i, dict(c)) for i, c in enumerate(spec.cases)])
    for g, group in enumerate(spec.zip):  # type: ignore[arg-type]  (normalized to a list by the validator)
        n = len(next(iter(group.values())))
        axes.append([(f"zip{g}", i, {k: vals[i] for k, vals in group.items()}) for i in range(n)])
    for key, vals in spec.grid.items():
        axes.append([(key, v, {key: v}) for v in vals])
    return axes


def _slug(v: Any) -> str:
    text = json.dumps(v, sort_keys=True) if isinstance(v, list | dict) else f"{v:g}" if isinstance(v, float) else v
    return re.sub(r"[^A-Za-z0-9.+]+", "-", str(text)).strip("-")


def run_name(cfg: RunConfig, varying: Iterable[str]) -> str:
    """The run's folder name: the default run name (method, non-default args, dataset, partition), the values of the
    keys that vary in the sweep, the seed, and a hash of the whole experiment and seed (so two runs never share a
    folder and a changed base setting never reuses an old one)."""
    from fedskew.results.store import default_run_dir

    stem = default_run_dir(cfg, "x").name[2:].rsplit("-s", 1)[0]  # "x-<method>-<dataset>-<partition>-s<seed>"
    ident = cfg.identity()
    extras = [f"{k}{_slug(ident.get(k))}" for k in varying if k not in _NAMED]
    name = "-".join([stem, *extras])[:96].rstrip("-_.")
    digest = hashlib.sha1(json.dumps({**ident, "seed": cfg.seed}, sort_keys=True, default=str).encode()).hexdigest()
    return f"{name}-s{cfg.seed}-{digest[:6]}"


def expand(spec: SweepSpec, *, out: str | Path | None = None, db: str | Path | None = None) -> list[PlannedRun]:
    """Every run of ``spec``, each validated (a bad point is a :class:`ConfigError` naming it), seeds outermost
    (all methods of seed 0 first, so a partial sweep already compares them). Points that expand to the same run are
    run once."""
    root = Path(out or spec.out or f"runs/sweep-{spec.name or 'sweep'}")
    db_path = str(db or spec.db or root / "fedskew.db")
    base = {str(k).replace("-", "_"): v for k, v in spec.base.items()}
    for key in _SWEEP_OWNED:
        if key in base and key != "seed":
            raise ConfigError(f"sweep base: {key!r} is set by the sweep (top-level {key}:), not in base")
    base.pop("seed", None)
    axes = _axes(spec)
    planned = math.prod([spec.seed_count(), len(spec.method_entries()), *(len(a) for a in axes)])
    if planned > MAX_RUNS:
        raise ConfigError(
            f"sweep {spec.name!r}: {planned:,} runs ({spec.seed_count():,} seeds × {len(spec.method_entries())} "
            f"methods × {' × '.join(str(len(a)) for a in axes) or '1'} points); at most {MAX_RUNS:,} in one sweep: "
            "split it into several specs"
        )
    tuned_entries = None
    if spec.tuned:
        from fedskew.tuning.tuned import load_tuned

        tuned_entries = load_tuned(spec.tuned)
    tuned_by_draft: list[dict[str, Any] | None] = []
    drafts: list[tuple[RunConfig, str, dict[str, Any]]] = []
    for seed in spec.seed_list():
        for combo in itertools.product(*axes):
            for j, method in enumerate(spec.method_entries()):
                values = copy.deepcopy(base)
                point: dict[str, Any] = {"seed": seed}
                where = f"sweep run (seed {seed}"
                for axis, pos, partial in combo:
                    point[axis] = pos
                    where += f", {axis}={pos}"
                    for k, v in partial.items():
                        _set(values, k, v, where + ")")
                if method is not None:
                    point["method"] = j
                    values["method"] = method.name
                    values["method_args"] = {**values.get("method_args", {}), **method.args}
                    where += f", method {method.display()}"
                    for k, v in method.config.items():
                        _set(values, k, v, where + ")")
                values.update(seed=seed, db=db_path, log_group=spec.name)
                took = None
                try:
                    if tuned_entries is not None:
                        values, took = apply_tuned(values, tuned_entries)
                    cfg = make_config(values)
                except ConfigError as exc:
                    raise ConfigError(f"{where}): {exc}") from None
                label = method.display() if method is not None else cfg.method
                drafts.append((cfg, label + (" [tuned]" if took else ""), point))
                tuned_by_draft.append(took)
    idents = [cfg.identity() for cfg, _, _ in drafts]
    keys = list(dict.fromkeys(k for ident in idents for k in ident))
    varying = [k for k in keys if len({json.dumps(i.get(k), sort_keys=True, default=str) for i in idents}) > 1]
    runs: dict[str, PlannedRun] = {}
    for (cfg, label, point), took in zip(drafts, tuned_by_draft, strict=True):
        name = run_name(cfg, varying)
        # the hash alone identifies the run: a folder from before the spec grew (another key varies now, so the
        # readable part of the name differs) is still this run's
        earlier = sorted(
            p.name for p in root.glob(f"*-{name.rsplit('-', 2)[1]}-{name.rsplit('-', 1)[1]}") if p.is_dir()
        )
        name = earlier[0] if earlier else name
        if name not in runs:
            cfg = cfg.model_copy(update={"out": str(root / name)})
            extra = ", ".join(f"{k}={_slug(cfg.identity().get(k))}" for k in varying if k not in _NAMED)
            runs[name] = PlannedRun(name, cfg, f"{label}{' ' + extra if extra else ''} s{cfg.seed}", point, took)
    return list(runs.values())


def with_log(runs: list[PlannedRun], log: str | list[str] | None) -> list[PlannedRun]:
    """The runs with the live loggers ``log`` (``--log``; not part of what a run computes, so the same folders)."""
    if not log:
        return runs
    return [
        PlannedRun(r.name, make_config({**r.cfg.model_dump(), "log": log}), r.label, r.point, r.tuned) for r in runs
    ]


# ---- what is already there (the folder's state: sweep/task.py, which every executor's run reads too) ---------------
def run_state(run: PlannedRun) -> tuple[str, str]:
    """(state, detail) of a run's folder (:func:`fedskew.sweep.task.folder_state`)."""
    return folder_state(run.cfg)


def _settled(run: PlannedRun, state: str, detail: str) -> RunResult | None:
    return settled(run.name, run.cfg, state, detail)


@dataclass
class SweepOutcome:
    results: list[RunResult]
    interrupted: bool = False

    def by_status(self, *statuses: str) -> list[RunResult]:
        return [r for r in self.results if r.status in statuses]

    @property
    def failed(self) -> list[RunResult]:
        return self.by_status("failed")

    def run_ids(self) -> list[str]:
        return [r.run_id for r in self.results if r.run_id]


def sweep_state(runs: list[PlannedRun]) -> SweepOutcome:
    """What a sweep's folders hold now, running nothing: each finished run as ``skipped`` (with its run id, recorded in
    the database when it is not there yet), a folder holding something else as ``failed``, every other run (new,
    unfinished, running in another process) as ``not started``."""
    results = []
    for run in runs:
        state, detail = run_state(run)
        settled = _settled(run, state, detail)
        results.append(settled or RunResult(run.name, "not started", str(run.cfg.out), detail=detail))
    return SweepOutcome(results)


def run_sweep(
    runs: list[PlannedRun],
    *,
    jobs: int = 1,
    on_event: Callable[[Event], None] | None = None,
    on_result: Callable[[RunResult], None] | None = None,
    executor: Callable[..., bool] | None = None,
    stack_seeds: bool | str = False,
) -> SweepOutcome:
    """Run every planned run that is not done: ``jobs`` at a time in worker processes (``jobs=1``: one after the
    other in this process; with ``cuda`` and several GPUs, one GPU per worker), or by ``executor`` (called as
    ``executor(todo, on_event, results, on_result)``, returning whether it was interrupted: the Ray executor,
    :mod:`fedskew.sweep.ray`). ``on_event`` gets the runs' progress events, ``on_result`` each run's result
    (skipped runs first). Ctrl-C (or SIGTERM) lets the running runs finish their round and checkpoint, starts no new
    one, and returns with ``interrupted``; running the sweep again continues where it stopped. ``stack_seeds``: the
    runs that differ only in their seed run together, their clients trained as rows of one batched step
    (:mod:`fedskew.engine.stacked_runs`; a group takes one of the ``jobs``); ``"auto"``: each group stacked or run
    as separate runs by what a short probe measures faster (:mod:`fedskew.sweep.stack_choice`)."""
    emit = on_event or (lambda ev: None)
    report = on_result or (lambda r: None)
    results: dict[str, RunResult] = {}
    todo: list[Task] = []
    for run in runs:
        state, detail = run_state(run)
        res = _settled(run, state, detail)
        if res is None:
            todo.append(Task(run.name, run.cfg.model_dump(), state))
            continue
        results[run.name] = res
        report(res)
    from fedskew.results.loggers import check_installed

    check_installed(dict.fromkeys(n for t in todo for n in t.values.get("log") or []))  # before any run starts
    interrupted = False
    if executor is not None and stack_seeds:
        raise ValueError("stacked seeds run on the local executor (one process per group), not on Ray")
    units: list[Task | TaskGroup] = group_seeds(todo) if stack_seeds else list(todo)
    if stack_seeds == "auto":
        from fedskew.sweep.stack_choice import choose_stacking

        try:
            units = choose_stacking(units, jobs, emit)
        except KeyboardInterrupt:  # during a probe: nothing of the sweep has started
            for t in todo:
                results[t.name] = RunResult(t.name, "not started", str(t.values.get("out")))
            return SweepOutcome([results[r.name] for r in runs if r.name in results], True)
    if executor is not None:
        interrupted = bool(todo) and executor(todo, emit, results, report)
    elif jobs <= 1 or len(units) <= 1:
        for i, unit in enumerate(units):
            try:
                for res in execute(unit, emit):
                    results[res.name] = res
                    report(res)
            except KeyboardInterrupt:  # between two runs
                for t in members(unit):
                    results.setdefault(t.name, RunResult(t.name, "interrupted", str(t.values.get("out"))))
            if any(results[t.name].status == "interrupted" for t in members(unit)):
                interrupted = True
                for rest in (t for u in units[i + 1 :] for t in members(u)):
                    results[rest.name] = RunResult(rest.name, "not started", str(rest.values.get("out")))
                break
    else:
        from fedskew.sweep.pool import run_pool  # the local process pool (its own module: sweep/pool.py)

        interrupted = run_pool(units, jobs, emit, results, report)
    return SweepOutcome([results[r.name] for r in runs if r.name in results], interrupted)
