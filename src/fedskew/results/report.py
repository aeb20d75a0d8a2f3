"""Paper-style tables from the results database: one row per experiment, mean ± std over distinct seeds.

An *experiment* is the whole resolved configuration except the seed and where output goes
(:meth:`fedskew.config.RunConfig.identity`), method hyper-parameters included with their defaults filled in, so
that runs differing only in ``--lr`` or in a ``-m`` argument are separate rows, and ``fedavg`` equals
``fedavg -m weights=samples``. A configuration stored by an older fedskew (fewer keys) is re-validated through
:func:`fedskew.config.make_config`, so a missing key counts as its default. Each seed counts once: when a seed was run
more than once, its latest run is used (and a footnote says so). The settings that differ between the rows are
columns (method arguments inside the method's cell, ``fedavg (weights=uniform)``); those shared by every row are
listed once above the table.

Every row is also compared *paired* with a reference row (:mod:`fedskew.results.stats`): the rows of one setting
(:data:`fedskew.config.SETTING_KEYS`, the data and the federation) ran the same seeds, so the same partitions,
initial models and client samples, and their difference is measured seed by seed. The reference of a row is
``against`` when given (a row's label or a method), else FedAvg with its default arguments for a plain method and
the host for a ``+plug-in`` composition (``fedprox+heal`` against ``fedprox``); among several candidates of the
setting, the one that differs from the row in the fewest other settings. Rows without a seed in common with their
reference are shown as unpaired, never compared.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from fedskew.results import render as rendering
from fedskew.results import stats as st
from fedskew.results.experiments import (
    MISSING,
    Experiment,
    Stat,
    group_experiments,
    group_runs,
    identity_key,
    mean_std,
    round_records,
    run_identity,
    show_args,
    show_value,
    stat_from_records,
    stat_from_summary,
)
from fedskew.results.paired import (
    FOOTER_LABEL,
    Paired,
    ReportError,
    choose_references,
    paired_cells,
    paired_notes,
    pooled,
    seed_values,
    seeds_cell,
)

FORMATS = ("markdown", "csv", "latex")
DEFAULT_METRIC = "global_acc"

__all__ = [
    "DEFAULT_METRIC",
    "FORMATS",
    "Experiment",
    "Paired",
    "Report",
    "ReportError",
    "Stat",
    "build_report",
    "choose_references",
    "group_experiments",
    "group_runs",
    "markdown_report",
    "paired_cells",
    "report_from_db",
    "round_records",
    "run_identity",
    "seed_values",
    "stat_from_records",
    "stat_from_summary",
]


# ---- the table -----------------------------------------------------------------------------------------------
@dataclass
class Report:
    """A rendered-agnostic table: ``columns`` and ``rows`` of cells; numbers as ``(mean, std | None)`` in percent,
    paired differences as :class:`Paired`, ``common`` the settings every row shares, ``notes`` the footnotes.
    ``kinds`` says what each column holds ("text"; "stat": a number; "delta": a :class:`Paired`; "seeds": the seeds
    needed for ``--seeds-needed``), ``footer`` what is printed under each column (a "delta" column's detectable
    difference ``(difference, pooled sd, n)``, a "seeds" column's seeds needed at the pooled sd; None: no footer),
    ``seeds`` each row's number of distinct seeds."""

    metrics: list[str]
    columns: list[str]
    rows: list[list[Any]]
    common: list[str]
    notes: list[str]
    kinds: list[str] = field(default_factory=list)
    footer: list[Any] | None = None
    seeds: list[int] = field(default_factory=list)
    evaluation: list[str] = field(default_factory=list)  # the evaluation protocol of each metric and statistic

    def kind(self, j: int) -> str:
        return self.kinds[j] if j < len(self.kinds) else "text"

    def render(self, fmt: str = "markdown") -> str:
        if not self.rows:
            return f"no runs with metric {', '.join(map(repr, self.metrics))}"
        if fmt == "markdown":
            return rendering.markdown_text(self)
        if fmt == "csv":
            return rendering.csv_text(self)
        if fmt == "latex":
            return rendering.latex_text(self)
        raise ValueError(f"unknown report format {fmt!r}; choose one of {', '.join(FORMATS)}")


def build_report(
    runs: list[dict[str, Any]],
    metrics: Sequence[str] = (DEFAULT_METRIC,),
    *,
    last_n: int | None = None,
    records: dict[str, list[dict[str, Any]]] | None = None,
    against: str | None = None,
    seeds_needed: float | None = None,
) -> Report:
    """One row per experiment holding at least one metric (or a diverged run): the settings that differ between
    rows, the distinct seeds, and per metric the best round and the last-N mean as mean ± std over seeds (in %),
    each followed by the paired difference against the row's reference (:func:`choose_references`; ``against``:
    the reference row, a label or a method) with its 95% interval, and, with ``seeds_needed`` (D, in points), the
    seeds a paired t-test would need to resolve a difference D given the row's paired std.
    ``last_n``: recompute the last-N mean from ``records`` (run id -> its round records) instead of the summaries'."""
    metrics = list(dict.fromkeys(metrics)) or [DEFAULT_METRIC]
    if seeds_needed is not None and not seeds_needed > 0:
        raise ReportError(f"--seeds-needed must be a positive difference in points, got {seeds_needed}")
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
    varying = [k for k in keys if len({identity_key({"v": i.get(k)}) for i in idents}) > 1]
    common = [f"{k}={show_value(idents[0].get(k))}" for k in keys if k not in varying]
    # method arguments: those that differ between rows of the same method go into its cell, the others are said once
    by_method: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for ident in idents:
        by_method[str(ident.get("method"))].append(ident["method_args"])
    shown_args: dict[str, list[str]] = {}
    for method, arg_sets in by_method.items():
        names = list(dict.fromkeys(k for a in arg_sets for k in a))
        shown_args[method] = [k for k in names if len({show_value(a.get(k, MISSING)) for a in arg_sets}) > 1]
        fixed = {k: arg_sets[0][k] for k in names if k not in shown_args[method] and k in arg_sets[0]}
        if fixed:
            common.append(f"{method}: {show_args(fixed)}")

    labels = []
    for g, _ in table:
        args = {
            k: g.identity["method_args"][k]
            for k in shown_args[str(g.identity.get("method"))]
            if k in g.identity["method_args"]
        }
        labels.append(g.name + (f" ({show_args(args)})" if args else ""))
    exps = [g for g, _ in table]
    refs = choose_references(exps, labels, against)
    compared = any(j is not None and j != i for i, j in enumerate(refs))

    def ref_name(j: int) -> str:  # a label shared by rows that differ in a setting column: with those settings
        if labels.count(labels[j]) == 1 or not varying:
            return labels[j]
        return f"{labels[j]} [{', '.join(f'{k}={show_value(idents[j].get(k, MISSING))}' for k in varying)}]"

    ns = {m: sorted({s.n for _, st_ in table for s in st_[m]}) for m in metrics}
    columns = ["method", *varying, "seeds"] + (["paired vs"] if compared else [])
    kinds = ["text"] * len(columns)
    paired: dict[tuple[str, str], list[Paired]] = {}
    for m in metrics:
        n = ns[m]
        last = f"{m} last-{n[0]}" if len(n) == 1 else f"{m} last-{last_n or 'N'}" if not n else f"{m} last-N"
        for statistic, name in (("best", f"{m} best"), ("last", last)):
            columns.append(name)
            kinds.append("stat")
            if compared:
                paired[(m, statistic)] = paired_cells(exps, refs, m, statistic, stat)
                columns.append(f"{name} Δ")
                kinds.append("delta")
                if seeds_needed is not None:
                    columns.append(f"{name} seeds for Δ={seeds_needed:g}")
                    kinds.append("seeds")
    columns.append("diverged")
    kinds.append("text")

    rows, repeated, row_seeds = [], 0, []
    for i, (g, stats) in enumerate(table):
        seeds = [r["seed"] for r in g.latest]
        row_seeds.append(len(seeds))
        repeated += len(g.runs) - len(g.latest)
        row: list[Any] = [labels[i], *(show_value(g.identity.get(k, MISSING)) for k in varying)]
        row.append(f"{len(seeds)} ({','.join(map(str, seeds))})")
        if compared:
            j = refs[i]
            row.append("(reference)" if j == i else "-" if j is None else ref_name(j))
        for m in metrics:
            st_ = stats[m]
            cells: list[Any] = ["-", "-"]
            if st_:
                last = mean_std([s.last for s in st_])
                if len(ns[m]) > 1:
                    last = (*last, "/".join(str(n) for n in sorted({s.n for s in st_})))  # type: ignore[assignment]
                cells = [mean_std([s.best for s in st_]), last]
            for k, statistic in enumerate(("best", "last")):
                row.append(cells[k])
                if compared:
                    cell = paired[(m, statistic)][i]
                    row.append(cell)
                    if seeds_needed is not None:
                        row.append(seeds_cell(cell, seeds_needed))
        hits = [
            f"seed {r['seed']} (round {r['summary'].get('diverged_round')})"
            for r in g.latest
            if r["summary"].get("diverged")
        ]
        row.append(", ".join(hits) or "-")
        rows.append(row)

    footer = None
    if compared:
        foot: list[Any] = [FOOTER_LABEL] + [""] * (len(columns) - 1)
        cells_of = iter(paired.values())
        for j, kind in enumerate(kinds):
            if kind == "delta":
                pool = pooled(next(cells_of))
                foot[j] = None if pool is None else (st.detectable_difference(pool[0], pool[1]), *pool)
            elif kind == "seeds":
                pool = foot[j - 1]
                foot[j] = None if pool is None else st.seeds_needed(pool[1], seeds_needed or 1.0)
        if any(f is not None and f != "" for f in foot[1:]):
            footer = foot

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
    notes += paired_notes(labels, refs, paired, against, seeds_needed, footer is not None)
    evaluation = evaluation_lines(metrics, idents, ns)
    return Report(metrics, columns, rows, common, notes, kinds, footer, row_seeds, evaluation)


def evaluation_lines(metrics: list[str], idents: list[dict[str, Any]], ns: dict[str, list[int]]) -> list[str]:
    """The table's evaluation protocol (:mod:`fedskew.results.evaluation`): per metric which model, data, mean and
    clients, then what its two statistics (best round, last-N mean) are; settings that change a view
    (``evaluate_on``, ``eval_clients``, ``heldout_clients``) read from the rows when they all share them."""
    from fedskew.results.evaluation import describe, statistics_line

    def shared(key: str) -> Any:
        vals = {identity_key({"v": i.get(key)}) for i in idents}
        return idents[0].get(key) if len(vals) == 1 else None

    out = []
    for m in metrics:
        try:
            ev = describe(
                m,
                "best",
                eval_clients=shared("eval_clients") if isinstance(shared("eval_clients"), int) else None,
                evaluate_on=shared("evaluate_on") or "test",
                heldout_clients=int(shared("heldout_clients") or 0),
            )
        except ValueError:
            out.append(f"{m}: a metric without a known evaluation protocol")
            continue
        out.append(f"{m}: {ev.model} on {ev.data}, {ev.mean}; clients: {ev.clients}")
    n = {x for m in metrics for x in ns.get(m, [])}
    out.append(statistics_line(["best", "last_n_mean"], next(iter(n)) if len(n) == 1 else None))
    return out


def report_from_db(
    db: Any,
    metrics: Sequence[str] = (DEFAULT_METRIC,),
    *,
    last_n: int | None = None,
    against: str | None = None,
    seeds_needed: float | None = None,
) -> Report:
    """:func:`build_report` over every run of a :class:`fedskew.results.store.ResultsDB`."""
    runs = db.runs()
    records = round_records(db.conn, [r["run_id"] for r in runs]) if last_n else None
    return build_report(runs, metrics, last_n=last_n, records=records, against=against, seeds_needed=seeds_needed)


def markdown_report(runs: list[dict[str, Any]], metric: str = DEFAULT_METRIC) -> str:
    """The markdown table of one metric (kept for scripts such as ``benchmarks/compare.py``)."""
    return build_report(runs, [metric]).render("markdown")
