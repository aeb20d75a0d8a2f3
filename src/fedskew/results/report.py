"""Paper-style tables from the results database: one row per experiment, mean ± std over distinct seeds.

An *experiment* is the whole resolved configuration except the seed and where output goes
(:meth:`fedskew.config.RunConfig.identity`), method hyper-parameters included with their defaults filled in, so
that runs differing only in ``--lr`` or in a ``-m`` argument are separate rows, and ``fedavg`` equals
``fedavg -m weights=samples``. A configuration stored by an older fedskew (fewer keys) is re-validated through
:func:`fedskew.config.make_config`, so a missing key counts as its default. Each seed counts once: when a seed was run
more than once, its latest run is used (and a footnote says so). The settings that differ between the rows are
columns (method arguments inside the method's cell, ``fedavg (weights=uniform)``); those shared by every row are
listed once above the table.
"""

from __future__ import annotations

import csv
import io
import json
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

FORMATS = ("markdown", "csv", "latex")
DEFAULT_METRIC = "global_acc"
_MISSING = object()


# ---- what an experiment is -----------------------------------------------------------------------------------
def _field_defaults() -> dict[str, Any]:
    from fedskew.config import RunConfig

    return {name: f.get_default(call_default_factory=True) for name, f in RunConfig.model_fields.items()}


def run_identity(config: dict[str, Any]) -> dict[str, Any]:
    """The experiment a stored configuration ran: :meth:`RunConfig.identity` with the method's hyper-parameters
    resolved (defaults included). A configuration from an older version is re-validated (missing keys take their
    defaults); one that no longer validates is compared on its keys, missing ones taken as today's defaults."""
    from fedskew.config import NOT_IDENTITY, make_config
    from fedskew.methods import resolve_method

    where = {"device": "cpu", "out": None, "db": None, "data_dir": None, "download": False}
    try:  # where a run went or ran never decides what it was; a cuda run must validate on a CPU-only machine
        ident = make_config({**config, **where}).identity()
    except Exception:  # noqa: BLE001 - any stored config that cannot be re-validated is compared as stored
        ident = {k: v for k, v in {**_field_defaults(), **config}.items() if k not in NOT_IDENTITY}
    try:
        method = resolve_method(str(ident.get("method")), ident.get("method_args") or {})
        ident["method"], ident["method_args"] = method.name, dict(method.args)
    except Exception:  # noqa: BLE001 - a method this version no longer has: its arguments as given
        ident["method_args"] = dict(ident.get("method_args") or {})
    return ident


def _key(ident: dict[str, Any]) -> str:
    return json.dumps(ident, sort_keys=True, default=str)


def _show(v: Any) -> str:
    if v is None or v is _MISSING:
        return "-"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, dict | list):
        return json.dumps(v, sort_keys=True)
    return str(v)


def _args(args: dict[str, Any]) -> str:
    return ", ".join(f"{k}={_show(v)}" for k, v in sorted(args.items()))


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
        groups.setdefault(_key(ident), Experiment(ident)).runs.append(r)
    for g in groups.values():
        by_seed: dict[int, dict[str, Any]] = {}
        for r in g.runs:  # oldest first: the latest run of a seed wins
            by_seed[r["seed"]] = r
        g.latest = [by_seed[s] for s in sorted(by_seed)]
    return list(groups.values())


def group_runs(runs: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Runs by experiment (all of them, repeated seeds included), keyed by the experiment's identity."""
    return {_key(g.identity): g.runs for g in group_experiments(runs)}


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


def _pm(values: Sequence[float]) -> tuple[float, float | None]:
    a = 100 * np.asarray(values, dtype=float)
    return float(a.mean()), (float(a.std()) if len(a) > 1 else None)


def _cell(mean: float, std: float | None, latex: bool = False) -> str:
    if std is None:
        return f"{mean:.2f}"
    return f"{mean:.2f} $\\pm$ {std:.2f}" if latex else f"{mean:.2f} ± {std:.2f}"


# ---- the table -----------------------------------------------------------------------------------------------
@dataclass
class Report:
    """A rendered-agnostic table: ``columns`` and ``rows`` of cells; numbers as ``(mean, std | None)`` in percent,
    ``common`` the settings every row shares, ``notes`` the footnotes."""

    metrics: list[str]
    columns: list[str]
    rows: list[list[Any]]
    common: list[str]
    notes: list[str]

    def render(self, fmt: str = "markdown") -> str:
        if not self.rows:
            return f"no runs with metric {', '.join(map(repr, self.metrics))}"
        if fmt == "markdown":
            return _markdown(self)
        if fmt == "csv":
            return _csv(self)
        if fmt == "latex":
            return _latex(self)
        raise ValueError(f"unknown report format {fmt!r}; choose one of {', '.join(FORMATS)}")


def build_report(
    runs: list[dict[str, Any]],
    metrics: Sequence[str] = (DEFAULT_METRIC,),
    *,
    last_n: int | None = None,
    records: dict[str, list[dict[str, Any]]] | None = None,
) -> Report:
    """One row per experiment holding at least one metric (or a diverged run): the settings that differ between
    rows, the distinct seeds, and per metric the best round and the last-N mean as mean ± std over seeds (in %).
    ``last_n``: recompute the last-N mean from ``records`` (run id -> its round records) instead of the summaries'."""
    metrics = list(dict.fromkeys(metrics)) or [DEFAULT_METRIC]
    groups = group_experiments(runs, ignore=("last_n",) if last_n else ())

    def stat(r: dict[str, Any], metric: str) -> Stat | None:
        if last_n:
            return stat_from_records((records or {}).get(r["run_id"], []), metric, last_n)
        return stat_from_summary(r["summary"], metric)

    table = []  # (experiment, {metric: [Stat per seed]})
    for g in groups:
        stats = {m: [s for s in (stat(r, m) for r in g.latest) if s is not None] for m in metrics}
        if any(stats.values()) or any(r["summary"].get("diverged") for r in g.latest):
            table.append((g, stats))
    if not table:
        return Report(metrics, [], [], [], [])

    # settings that differ between the rows are columns; the others are said once
    idents = [g.identity for g, _ in table]
    keys = list(dict.fromkeys(k for ident in idents for k in ident if k not in ("method", "method_args")))
    varying = [k for k in keys if len({_key({"v": i.get(k)}) for i in idents}) > 1]
    common = [f"{k}={_show(idents[0].get(k))}" for k in keys if k not in varying]
    # method arguments: those that differ between rows of the same method go into its cell, the others are said once
    by_method: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for ident in idents:
        by_method[str(ident.get("method"))].append(ident["method_args"])
    shown_args: dict[str, list[str]] = {}
    for method, arg_sets in by_method.items():
        names = list(dict.fromkeys(k for a in arg_sets for k in a))
        shown_args[method] = [k for k in names if len({_show(a.get(k, _MISSING)) for a in arg_sets}) > 1]
        fixed = {k: arg_sets[0][k] for k in names if k not in shown_args[method] and k in arg_sets[0]}
        if fixed:
            common.append(f"{method}: {_args(fixed)}")

    ns = {m: sorted({s.n for _, st in table for s in st[m]}) for m in metrics}
    columns = ["method", *varying, "seeds"]
    for m in metrics:
        n = ns[m]
        columns += [
            f"{m} best",
            f"{m} last-{n[0]}" if len(n) == 1 else f"{m} last-{last_n or 'N'}" if not n else f"{m} last-N",
        ]
    columns.append("diverged")

    rows, repeated = [], 0
    for g, stats in table:
        args = {
            k: g.identity["method_args"][k]
            for k in shown_args[str(g.identity.get("method"))]
            if k in g.identity["method_args"]
        }
        label = g.name + (f" ({_args(args)})" if args else "")
        seeds = [r["seed"] for r in g.latest]
        repeated += len(g.runs) - len(g.latest)
        row: list[Any] = [label, *(_show(g.identity.get(k, _MISSING)) for k in varying)]
        row.append(f"{len(seeds)} ({','.join(map(str, seeds))})")
        for m in metrics:
            st = stats[m]
            if not st:
                row += ["-", "-"]
                continue
            last = _pm([s.last for s in st])
            if len(ns[m]) > 1:
                last = (*last, "/".join(str(n) for n in sorted({s.n for s in st})))  # type: ignore[assignment]
            row += [_pm([s.best for s in st]), last]
        hits = [
            f"seed {r['seed']} (round {r['summary'].get('diverged_round')})"
            for r in g.latest
            if r["summary"].get("diverged")
        ]
        row.append(", ".join(hits) or "-")
        rows.append(row)

    source = f"recomputed from the rounds table with N={last_n}" if last_n else "from each run's summary"
    notes = [
        "accuracy in %: mean ± std (population std, ddof=0) over distinct seeds; one seed shows its value alone",
        f"best: best evaluated round; last-N: mean of the last N evaluated rounds ({source}; N is at most the "
        "evaluated rounds)",
    ]
    if repeated:
        notes.append(
            f"{repeated} run(s) repeated a seed of their experiment: each seed counts once, with its latest run"
        )
    return Report(metrics, columns, rows, common, notes)


def _text(cell: Any, latex: bool = False) -> str:
    if isinstance(cell, tuple):
        s = _cell(cell[0], cell[1], latex)
        return s + (f" (N={cell[2]})" if len(cell) > 2 else "")
    return str(cell)


def _markdown(rep: Report) -> str:
    lines = [f"settings common to every row: {'; '.join(rep.common) or '-'}", ""]
    lines.append("| " + " | ".join(rep.columns) + " |")
    lines.append("|" + "---|" * len(rep.columns))
    lines += ["| " + " | ".join(_text(c).replace("|", "\\|") for c in row) + " |" for row in rep.rows]
    lines += [""] + [f"{i}. {n}" for i, n in enumerate(rep.notes, 1)]
    return "\n".join(lines)


def csv_columns(rep: Report) -> list[str]:
    out = []
    for c in rep.columns:
        if any(c == f"{m} best" or c.startswith(f"{m} last-") for m in rep.metrics):
            out += [f"{c} mean", f"{c} std"] + ([f"{c} n"] if c.endswith("last-N") else [])
        else:
            out.append(c)
    return out


def _csv(rep: Report) -> str:
    """Plain CSV, one value per cell (std empty for a single seed); the common settings and notes are not in it."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(csv_columns(rep))
    for row in rep.rows:
        cells: list[Any] = []
        for col, c in zip(rep.columns, row, strict=True):
            if isinstance(c, tuple):
                cells += [f"{c[0]:.4f}", "" if c[1] is None else f"{c[1]:.4f}", *c[2:]]
            elif col.endswith((" best",)) or " last-" in col:
                cells += ["", ""] + ([""] if col.endswith("last-N") else [])
            else:
                cells.append(c)
        w.writerow(cells)
    return buf.getvalue().rstrip("\n")


_LATEX_ESCAPES = {
    "\\": r"\textbackslash{}",
    "&": r"\&",
    "%": r"\%",
    "$": r"\$",
    "#": r"\#",
    "_": r"\_",
    "{": r"\{",
    "}": r"\}",
    "~": r"\textasciitilde{}",
    "^": r"\textasciicircum{}",
}


def _tex(s: str) -> str:
    return "".join(_LATEX_ESCAPES.get(ch, ch) for ch in s).replace("±", "$\\pm$")


def _latex(rep: Report) -> str:
    """A booktabs tabular; the common settings and the notes as LaTeX comments above it."""
    lines = [f"% settings common to every row: {'; '.join(rep.common) or '-'}"]
    lines += [f"% {n}" for n in rep.notes]
    lines.append(
        "\\begin{tabular}{" + "l" * (len(rep.columns) - 2 * len(rep.metrics) - 1) + "r" * (2 * len(rep.metrics)) + "l}"
    )
    lines.append("\\toprule")
    lines.append(" & ".join(_tex(c) for c in rep.columns) + " \\\\")
    lines.append("\\midrule")
    for row in rep.rows:
        lines.append(" & ".join(_text(c, latex=True) if isinstance(c, tuple) else _tex(str(c)) for c in row) + " \\\\")
    lines += ["\\bottomrule", "\\end{tabular}"]
    return "\n".join(lines)


def report_from_db(db: Any, metrics: Sequence[str] = (DEFAULT_METRIC,), *, last_n: int | None = None) -> Report:
    """:func:`build_report` over every run of a :class:`fedskew.results.store.ResultsDB`."""
    runs = db.runs()
    records = round_records(db.conn, [r["run_id"] for r in runs]) if last_n else None
    return build_report(runs, metrics, last_n=last_n, records=records)


def markdown_report(runs: list[dict[str, Any]], metric: str = DEFAULT_METRIC) -> str:
    """The markdown table of one metric (kept for scripts such as ``benchmarks/compare.py``)."""
    return build_report(runs, [metric]).render("markdown")
