"""What an experiment is (the whole resolved configuration except the seed and where output goes), the runs grouped
into experiments (each seed once: its latest run), and a run's number for a metric (:class:`Stat`)."""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

MISSING = object()  # a setting an experiment's identity lacks (shown as "-")


# ---- what an experiment is -----------------------------------------------------------------------------------
def _field_defaults() -> dict[str, Any]:
    from fedskew.config import RunConfig

    return {name: f.get_default(call_default_factory=True) for name, f in RunConfig.model_fields.items()}


def run_identity(config: dict[str, Any]) -> dict[str, Any]:
    """The experiment a stored configuration ran: :meth:`RunConfig.identity` with the method's hyper-parameters
    resolved (defaults included). A configuration from an older version is re-validated (missing keys take their
    defaults); one that no longer validates is compared on its keys, missing ones taken as today's defaults."""
    from fedskew.config import ADDED_AT_DEFAULT, NOT_IDENTITY, make_config
    from fedskew.methods import resolve_method

    where = {"device": "cpu", "out": None, "db": None, "data_dir": None, "download": False}
    try:  # where a run went or ran never decides what it was; a cuda run must validate on a CPU-only machine
        ident = make_config({**config, **where}).identity()
    except Exception:  # noqa: BLE001 - any stored config that cannot be re-validated is compared as stored
        ident = {k: v for k, v in {**_field_defaults(), **config}.items() if k not in NOT_IDENTITY}
        ident = {k: v for k, v in ident.items() if not (k in ADDED_AT_DEFAULT and v == ADDED_AT_DEFAULT[k])}
    try:
        method = resolve_method(str(ident.get("method")), ident.get("method_args") or {})
        ident["method"], ident["method_args"] = method.name, dict(method.args)
    except Exception:  # noqa: BLE001 - a method this version no longer has: its arguments as given
        ident["method_args"] = dict(ident.get("method_args") or {})
    return ident


def identity_key(ident: dict[str, Any]) -> str:
    return json.dumps(ident, sort_keys=True, default=str)


def show_value(v: Any) -> str:
    if v is None or v is MISSING:
        return "-"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, dict | list):
        return json.dumps(v, sort_keys=True)
    return str(v)


def show_args(args: dict[str, Any]) -> str:
    return ", ".join(f"{k}={show_value(v)}" for k, v in sorted(args.items()))


@dataclass
class Experiment:
    identity: dict[str, Any]
    runs: list[dict[str, Any]] = field(default_factory=list)  # every run, oldest first
    latest: list[dict[str, Any]] = field(default_factory=list)  # the latest run of each seed, by seed

    @property
    def name(self) -> str:  # the method as it was typed (the identity holds the canonical composition)
        return str(self.runs[-1]["config"].get("method", self.identity.get("method")))


def group_experiments(runs: Iterable[dict[str, Any]], ignore: Iterable[str] = ()) -> list[Experiment]:
    """Runs grouped by experiment (``ignore``: identity keys left out, e.g. ``last_n`` when it is recomputed),
    in the order of their first run; within a group, the latest run of each seed."""
    skip = set(ignore)
    groups: dict[str, Experiment] = {}
    for r in sorted(runs, key=lambda r: (r["created"], r["run_id"])):
        ident = {k: v for k, v in run_identity(r["config"]).items() if k not in skip}
        groups.setdefault(identity_key(ident), Experiment(ident)).runs.append(r)
    for g in groups.values():
        by_seed: dict[int, dict[str, Any]] = {}
        for r in g.runs:  # oldest first: the latest run of a seed wins
            by_seed[r["seed"]] = r
        g.latest = [by_seed[s] for s in sorted(by_seed)]
    return list(groups.values())


def group_runs(runs: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Runs by experiment (all of them, repeated seeds included), keyed by the experiment's identity."""
    return {identity_key(g.identity): g.runs for g in group_experiments(runs)}


# ---- statistics ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Stat:
    """One metric of one run: best and last-N mean (fractions), with the N actually averaged."""

    best: float
    last: float
    n: int


def stat_from_summary(summary: dict[str, Any], metric: str) -> Stat | None:
    s = summary.get(metric)
    if not isinstance(s, dict):
        return None
    configured = int(summary.get("last_n") or 0)
    n = min(configured, int(summary.get("evaluated_rounds", configured)))
    return Stat(float(s["best"]), float(s["last_n_mean"]), n)


def stat_from_records(records: list[dict[str, Any]], metric: str, last_n: int) -> Stat | None:
    from fedskew.results.store import summarize_run

    s = summarize_run(records, last_n).get(metric)
    if s is None:
        return None
    n = sum(1 for r in records if r.get("evaluated") and metric in r)
    return Stat(float(s["best"]), float(s["last_n_mean"]), min(last_n, n))


def round_records(conn: Any, run_ids: Iterable[str]) -> dict[str, list[dict[str, Any]]]:
    """Every round record of the given runs from the database's ``rounds`` table, in round order."""
    out: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for rid in run_ids:
        rows = conn.execute("SELECT metrics FROM rounds WHERE run_id = ? ORDER BY round", (rid,)).fetchall()
        out[rid] = [json.loads(m) for (m,) in rows]
    return out


def mean_std(values: Sequence[float]) -> tuple[float, float | None]:
    a = 100 * np.asarray(values, dtype=float)
    return float(a.mean()), (float(a.std()) if len(a) > 1 else None)


def mean_std_text(mean: float, std: float | None, latex: bool = False) -> str:
    if std is None:
        return f"{mean:.2f}"
    return f"{mean:.2f} $\\pm$ {std:.2f}" if latex else f"{mean:.2f} ± {std:.2f}"
