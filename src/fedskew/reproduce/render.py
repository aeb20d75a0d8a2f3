"""A reproduction's tables as written: the Markdown page (each paper table with its header lines: source, statistic,
evaluation protocol, the paired-difference and verdict rules; the orderings; the compute against the paper's) and
the same content as JSON. The tables themselves are built in :mod:`fedskew.reproduce.table`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from fedskew.reproduce.plan import Plan
from fedskew.reproduce.table import BuiltTable, Cell, delta_text, show, verdict
from fedskew.results import stats as st


def _here(plan: Plan) -> str:
    """The statistic's window at this scale, when it is a last-N mean (a scale may shorten the paper's window)."""
    n = plan.base.get("last_n")
    return f" over the last {n} evaluated rounds here" if plan.paper.metric.statistic == "last_n_mean" and n else ""


def evaluation_line(plan: Plan, statistic: str | None = None) -> str:
    """The table's evaluation protocol (:mod:`fedskew.results.evaluation`): the protocol preset the runs use and,
    for the metric the cells report, which round (``statistic``, else the paper metric's), clients, model, data and
    mean."""
    from fedskew.results.evaluation import of_run

    paper = plan.paper
    protocol = plan.base.get("protocol", "fedskew")
    statistic = statistic or paper.metric.statistic
    try:
        ev = of_run(paper.metric.keys[0], statistic, plan.base)
    except ValueError:
        return f"Evaluation protocol ({protocol}): {paper.metric.keys[0]}, {statistic}."
    return (
        f"Evaluation protocol ({protocol}): {ev.metric}, {ev.round}: {ev.model} on {ev.data}, {ev.mean}; "
        f"clients: {ev.clients}."
    )


def render_markdown(plan: Plan, tables: list[BuiltTable], compute: list[tuple[str, str, str]]) -> str:
    paper = plan.paper
    sc = paper.scales[plan.scale]  # type: ignore[index]
    lines = [
        f"# {paper.paper}: reproduction at scale `{plan.scale}`",
        "",
        f"{paper.title}. Paper numbers: {paper.source}.",
        f"Scale `{plan.scale}`: {sc.note.strip()}.",
        "Settings run here: "
        + "; ".join(
            s.setting.label + (f" (domains: {', '.join(s.domains)})" if s.domains else "") for s in plan.settings
        )
        + ".",
        f"Metric: {paper.metric.description.strip()} ({paper.metric.statistic}{_here(plan)}). Ours: mean ± std "
        f"(population, ddof=0) over seeds {', '.join(map(str, plan.seeds))}; a single seed shows its value alone. "
        "Paper: as published. A column marked (paper: X) runs the paper's protocol on an offline dataset and is set "
        "beside the paper's number for X, a different dataset: compare orderings, not values.",
        "",
        evaluation_line(plan),
        "",
        "Δ: our paired difference against the row's reference (column vs: "
        + (f"the row {plan.against!r}" if plan.against else "FedAvg; a host+plug-in row against its host")
        + "), in points: the mean over the seeds both ran (n, when fewer than the row's seeds; diverged runs left "
        f"out) with its {st.LEVEL:.0%} interval, paired t below {st.BOOTSTRAP_FROM} common seeds, percentile "
        f"bootstrap ({st.RESAMPLES} resamples, seed 0) from {st.BOOTSTRAP_FROM}; * marks an interval that excludes 0. "
        f"Last line, detectable Δ: the smallest true difference a two-sided paired t-test (α={st.ALPHA:g}) detects "
        f"with power {st.POWER:g} (exact, noncentral t) from the column's pooled paired std (sd) and its smallest "
        "number of common seeds (n).",
        "",
    ]
    if paper.verdicts:
        lines[-1:-1] = [
            f"Verdict: reproduces when the published mean lies inside our {st.LEVEL:.0%} t interval of the mean "
            "over seeds, or within the two spreads (|ours - published| <= our std + the published std, a missing "
            "std counting as the published number's rounding, half a unit of its last digit); not resolved (1 seed) "
            "for a single seed outside them; else does not reproduce. A "
            "reduced scale is not a verdict: only scale paper runs the benchmark's settings.",
        ]
    for bt in tables:
        src = bt.table.source
        lines += [
            f"## {bt.table.title}",
            "",
            f"Source: {src.paper}, {src.table}" + (f" ({src.setting})" if src.setting else ""),
            "",
        ]
        if bt.table.statistic and bt.table.statistic != paper.metric.statistic:
            note = f" ({bt.table.statistic_note.strip()})" if bt.table.statistic_note else ""
            lines += [
                f"Statistic of this table: {bt.table.statistic}{note}; ours likewise, from the same runs. "
                + evaluation_line(plan, bt.table.statistic),
                "",
            ]
        if bt.columns:
            by_id = {r.id: r for r in bt.rows}
            per = ("paper", "Δ", "verdict") if paper.verdicts else ("paper", "Δ")
            head = ["method", "vs"] + [x for c in bt.columns for x in (c.label, *per)]
            lines.append("| " + " | ".join(head) + " |")
            lines.append("|" + "---|" * len(head))
            for r in bt.rows:
                ref = bt.references.get(r.id)
                vs = "(reference)" if ref == r.id else by_id[ref].label if ref in by_id else "-"
                cells = []
                for j in range(len(bt.columns)):
                    c = bt.cells[(r.id, j)]
                    ours = (show(c.ours) + (f" ({c.note})" if c.note else "")) if c.ours else c.note
                    stand_in = paper.settings[bt.columns[j].setting].stands_for is not None
                    shown = ("stand-in: no verdict" if stand_in and c.paper else verdict(c)) or "-"
                    cells += [ours, show(c.paper), delta_text(c)] + ([shown] if paper.verdicts else [])
                lines.append("| " + " | ".join([r.label, vs, *cells]).replace("\n", " ") + " |")
            if any(d is not None for d in bt.detectable):
                foot = [f"detectable Δ (α={st.ALPHA:g}, power {st.POWER:g})", ""]
                for d in bt.detectable:
                    shown = "-" if d is None else f"{d['difference']:.2f} (n={d['n']}, sd {d['sd']:.2f})"
                    foot += ["", "", shown] + ([""] if paper.verdicts else [])
                lines.append("| " + " | ".join(foot) + " |")
            lines.append("")
        if bt.not_run:
            lines.append("Paper columns not run here:")
            lines += [f"- {label}: {why}" for label, why in bt.not_run]
            lines.append("")
        if bt.orderings:
            lines.append("Orderings (methods with both numbers):")
            lines += [f"- {o}" for o in bt.orderings]
            lines.append("")
    if plan.missing_rows:
        lines.append("Methods of the tables that did not run:")
        lines += [f"- {r.label} (`{r.method}`): {why}" for r, why in plan.missing_rows]
        lines.append("")
    lines += ["## Compute: ours against the paper's", "", "| | ours | paper |", "|---|---|---|"]
    lines += [f"| {q} | {a} | {b} |" for q, a, b in compute]
    lines.append("")
    if paper.notes:
        lines.append("Notes:")
        lines += [f"- {n}" for n in paper.notes]
    return "\n".join(lines).rstrip() + "\n"


def _train_samples(run_dir: str | None) -> int | None:
    try:
        known = json.loads((Path(str(run_dir)) / "clients.json").read_text())
        return int(np.asarray(known["train"] if "train" in known else known["num_train"]).sum())
    except (OSError, ValueError, KeyError, TypeError):
        return None


def compute_table(plan: Plan, finished: list[tuple[dict[str, Any], str]]) -> list[tuple[str, str, str]]:
    """(quantity, ours, paper) rows. ``finished``: (database row, run directory) of every finished run. A sample
    pass is one sample through one local training step's forward and backward (rounds x local epochs x training
    samples of the participating clients)."""
    paper = plan.paper
    setup = paper.paper_setup
    cfgs = [r["config"] for r, _ in finished]

    def distinct(key: str) -> str:
        vals = sorted({str(c.get(key)) for c in cfgs})
        return " / ".join(vals) if vals else "-"

    passes, unknown = 0.0, 0
    for r, run_dir in finished:
        n = _train_samples(run_dir)
        if n is None:
            unknown += 1
            continue
        c = r["config"]
        passes += r["summary"].get("rounds", 0) * c.get("local_epochs", 1) * n * c.get("join_ratio", 1.0)
    paper_passes, paper_runs, notes = 0.0, 0, []
    for t in paper.tables:
        cols = {c.setting for c in t.column_list()}
        for vals in t.values.values():
            for sid in cols:
                if not any(c.setting == sid and str(c.id) in vals for c in t.column_list()):
                    continue
                paper_runs += int(setup.get("seeds", 1))
                s = paper.settings[sid]
                if s.train_samples is None:
                    notes.append(sid)
                    continue
                paper_passes += (
                    setup["rounds"] * setup["local_epochs"] * s.train_samples * float(setup.get("join_ratio", 1.0))
                ) * int(setup.get("seeds", 1))
    wall = sum(float(r["summary"].get("wall_time") or 0.0) for r, _ in finished)
    planned_runs = len(plan.settings) * len(plan.rows) * len(plan.seeds)
    unknown_sets = sorted(set(notes))
    return [
        ("rounds", distinct("rounds"), str(setup.get("rounds"))),
        ("local epochs", distinct("local_epochs"), str(setup.get("local_epochs"))),
        ("clients", distinct("clients"), str(setup.get("clients"))),
        ("model", distinct("model"), str(setup.get("model"))),
        ("seeds per cell", str(len(plan.seeds)), str(setup.get("seeds"))),
        ("runs", f"{len(finished)} finished of {planned_runs} planned", f"{paper_runs} (every published cell)"),
        (
            "training sample passes",
            f"{passes:.3g}" + (f" ({unknown} run(s) without clients.json)" if unknown else ""),
            f"{paper_passes:.3g}"
            + (f" (without {', '.join(unknown_sets)}: sizes not known)" if unknown_sets else "")
            + (f"; ours = {100 * passes / paper_passes:.2g}%" if paper_passes else ""),
        ),
        ("wall time (sum over runs)", f"{wall:.0f} s on {distinct('device')}", "not reported"),
    ]


def tables_json(plan: Plan, tables: list[BuiltTable], compute: list[tuple[str, str, str]]) -> dict[str, Any]:
    return {
        "paper": plan.paper.paper,
        "scale": plan.scale,
        "seeds": plan.seeds,
        "metric": plan.paper.metric.model_dump(),
        "tables": [
            {
                "id": bt.table.id,
                "title": bt.table.title,
                "source": bt.table.source.model_dump(),
                "statistic": bt.table.statistic or plan.paper.metric.statistic,
                "columns": [c.__dict__ for c in bt.columns],
                "rows": [
                    {
                        "id": r.id,
                        "label": r.label,
                        "method": r.method,
                        "args": r.args,
                        "reference": bt.references.get(r.id),
                        "cells": [
                            _cell_json(bt.cells[(r.id, j)], plan.paper.settings[c.setting].stands_for is not None)
                            for j, c in enumerate(bt.columns)
                        ],
                    }
                    for r in bt.rows
                ],
                "detectable": bt.detectable,
                "not_run": bt.not_run,
                "orderings": bt.orderings,
            }
            for bt in tables
        ],
        "missing_rows": [{"id": r.id, "method": r.method, "why": why} for r, why in plan.missing_rows],
        "missing_settings": [{"id": s, "why": why} for s, why in plan.missing_settings],
        "compute": compute,
    }


def _cell_json(cell: Cell, stand_in: bool = False) -> dict[str, Any]:
    out = dict(cell.__dict__)
    out["verdict"] = "" if stand_in else verdict(cell)  # a stand-in ran another dataset than the published number
    out["values"] = {str(k): (None if v != v else v) for k, v in cell.values.items()}  # NaN (diverged) as null
    return out
