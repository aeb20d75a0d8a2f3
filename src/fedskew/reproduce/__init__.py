"""``fedskew reproduce PAPER``: a paper's main tables as one sweep, and the table with the paper's numbers beside ours.

A reproduction is a :class:`~fedskew.sweep.core.SweepSpec` built from the paper's data (:mod:`.papers`) for one scale
(:mod:`.plan`), run by the sweep machinery (idempotent: run it again to resume or extend it), then assembled from the
database into the paper's tables (:mod:`.table`). Everything goes to one folder::

    OUT/sweep.yaml     the sweep it ran (``fedskew sweep OUT/sweep.yaml`` re-runs it)
    OUT/runs/...       one run directory per (method, setting, seed)
    OUT/fedskew.db     the results database (``fedskew report --db OUT/fedskew.db``)
    OUT/table.md       the tables (with each row's paired difference against its reference row, its 95% interval
                       and each column's detectable difference), the orderings, the compute against the paper's,
                       the notes
    OUT/table.json     the same numbers, machine-readable (per cell the per-seed values and the paired comparison)
    OUT/figures/       accuracy curves per setting (mean ± std over seeds), paired differences with their interval
                       bars, a per-domain table (methods x domains, AVG, STD) for domain skew
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedskew.reproduce.papers import SCALES, Paper, load_paper, paper_names
from fedskew.reproduce.plan import Plan, make_plan
from fedskew.reproduce.render import compute_table, render_markdown, tables_json
from fedskew.reproduce.table import BuiltTable, build_tables
from fedskew.sweep.core import (
    Event,
    PlannedRun,
    RunResult,
    SweepOutcome,
    dump_spec,
    expand,
    run_sweep,
    sweep_state,
    with_log,
)

__all__ = [
    "SCALES",
    "Paper",
    "Plan",
    "Reproduction",
    "load_paper",
    "make_plan",
    "paper_names",
    "run_reproduction",
    "tabulate",
]


@dataclass
class Reproduction:
    plan: Plan
    runs: list[PlannedRun]
    outcome: SweepOutcome
    tables: list[BuiltTable]
    markdown: str
    files: list[Path] = field(default_factory=list)


def planned_runs(plan: Plan) -> list[PlannedRun]:
    """The plan's runs (seeds x settings x methods), each with its folder under ``OUT/runs`` (and the plan's live
    loggers, which change nothing the runs compute)."""
    return with_log(expand(plan.spec()), plan.log)


def run_reproduction(
    plan: Plan,
    *,
    jobs: int = 1,
    on_event: Callable[[Event], None] | None = None,
    on_result: Callable[[RunResult], None] | None = None,
    executor: Callable[..., bool] | None = None,
    stack_seeds: bool | str = False,
) -> Reproduction:
    """Run the plan (skipping what is done) and write the tables and figures into ``plan.out``; ``executor`` and
    ``stack_seeds``: see :func:`fedskew.sweep.core.run_sweep` (the Ray executor; a cell's seeds as rows of one
    stacked computation)."""
    plan.out.mkdir(parents=True, exist_ok=True)
    (plan.out / "sweep.yaml").write_text(dump_spec(plan.spec()))
    runs = planned_runs(plan)
    outcome = run_sweep(
        runs, jobs=jobs, on_event=on_event, on_result=on_result, executor=executor, stack_seeds=stack_seeds
    )
    return assemble(plan, runs, outcome)


def tabulate(plan: Plan) -> Reproduction:
    """The tables, compute and figures of the runs the plan's folder holds now, running nothing (``reproduce
    --table-only``: a sweep that was stopped, or one still running in another process); unfinished runs count as
    not run."""
    plan.out.mkdir(parents=True, exist_ok=True)
    runs = planned_runs(plan)
    return assemble(plan, runs, sweep_state(runs))


def _curve_metrics(paper: Paper) -> list[str]:
    keys = [*paper.metric.keys]
    keys += [c.metric for t in paper.tables for c in t.column_list() if c.metric]
    keys += [k for r in paper.rows for k in (r.metric or [])]
    return [k for k in dict.fromkeys(keys) if not k.startswith("domain_acc/")]


def assemble(plan: Plan, runs: list[PlannedRun], outcome: SweepOutcome) -> Reproduction:
    """The tables, compute and figures from the database rows of the plan's runs."""
    from fedskew.results.plots import accuracy_figures
    from fedskew.results.report import round_records
    from fedskew.results.store import ResultsDB

    results = {r.name: r for r in outcome.results}
    ids = {r.run_id for r in outcome.results if r.run_id}
    db_runs: dict[str, dict[str, Any]] = {}
    records: dict[str, list[dict[str, Any]]] = {}
    if ids and plan.db.is_file():
        with ResultsDB(plan.db) as db:
            db_runs = {r["run_id"]: r for r in db.runs() if r["run_id"] in ids}
            records = round_records(db.conn, list(db_runs))
    grouped: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    failed: dict[tuple[str, str], str] = {}
    finished: list[tuple[dict[str, Any], str]] = []
    for run in runs:
        key = (plan.rows[run.point["method"]].id, plan.settings[run.point["case"]].id)
        res = results.get(run.name)
        if res is not None and res.run_id in db_runs:
            grouped[key].append(db_runs[res.run_id])
            finished.append((db_runs[res.run_id], str(run.cfg.out)))
        elif res is not None and res.status == "failed":
            failed[key] = res.error or "failed"
    tables = build_tables(plan, grouped, failed)
    compute = compute_table(plan, finished)
    markdown = render_markdown(plan, tables, compute)
    files = [plan.out / "table.md", plan.out / "table.json", plan.out / "sweep.yaml"]
    files[0].write_text(markdown)
    files[1].write_text(json.dumps(tables_json(plan, tables, compute), indent=1, default=str))
    if db_runs:
        figures = accuracy_figures(list(db_runs.values()), records, plan.out / "figures", _curve_metrics(plan.paper))
        files += [f.path for f in figures]
    return Reproduction(plan, runs, outcome, tables, markdown, files)
