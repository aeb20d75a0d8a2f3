"""A paper's table from the runs of a reproduction: our mean ± std over seeds beside the paper's number in every cell,
the paired difference of every row against its reference row (the same seeds, so the same partitions, initial models
and client samples: :mod:`fedskew.results.stats`) with its 95% interval and, under each column, the smallest
difference its seeds could detect; each cell's verdict and which orderings of methods agree. Written out (Markdown,
JSON, with the compute used against the paper's) by :mod:`fedskew.reproduce.render`."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedskew.reproduce.papers import Paper, Row, Table, parse_value
from fedskew.reproduce.plan import Plan
from fedskew.results import stats as st
from fedskew.schema import ConfigError


@dataclass
class ShownColumn:
    id: str  # the paper column (key of its values)
    label: str
    setting: str  # the planned setting whose runs fill it
    metric: str | None  # None: the row's or the paper's metric keys
    lower_is_better: bool = False


@dataclass
class Cell:
    ours: tuple[float, float | None] | None = None  # mean, std (None for one seed), in %
    seeds: int = 0
    paper: tuple[float, float | None] | None = None
    paper_rounding: float = 0.0  # half a unit of the published number's last digit (98.9: 0.05)
    note: str = ""  # why there is no number of ours
    role: str = ""  # "reference" (the row is the reference), "compared" (``delta`` holds it), "" (no comparison)
    delta: dict[str, Any] | None = None  # the paired difference against the reference row (Comparison.as_dict())
    values: dict[int, float] = field(default_factory=dict)  # seed -> ours in % (NaN: a diverged run)


@dataclass
class BuiltTable:
    table: Table
    columns: list[ShownColumn]
    rows: list[Row]
    cells: dict[tuple[str, int], Cell]
    not_run: list[tuple[str, str]] = field(default_factory=list)  # (paper column label, why)
    orderings: list[str] = field(default_factory=list)
    references: dict[str, str | None] = field(default_factory=dict)  # row id -> its reference row id
    detectable: list[dict[str, Any] | None] = field(default_factory=list)  # per column: difference, sd, n


def _matches(row: Row, name: str) -> bool:
    return name.strip().lower() in (row.id.lower(), row.label.lower(), row.method.lower())


def check_against(paper: Paper, against: str | None) -> None:
    """Raise :class:`ConfigError` unless ``against`` (a row id, label or method) names a row of ``paper``."""
    if against and not any(_matches(r, against) for r in paper.rows):
        raise ConfigError(
            f"--against {against!r} names no row of {paper.paper}; rows: {', '.join(r.id for r in paper.rows)}"
        )


def references(rows: list[Row], pairs: list[tuple[str, str]], against: str | None = None) -> dict[str, str | None]:
    """Row id -> the id of the row it is compared with (its own id for a reference row; None: no reference).
    ``against`` (a row id, label or method): that row for every row. Else a row of the table's ``pairs``
    (host, host+plug-in) against its host; another ``host+plugin`` row against the host's row (the one whose
    arguments the composition shares); any other row against FedAvg with its default arguments."""
    ids = {r.id for r in rows}
    if against:
        ref = next((r.id for r in rows if _matches(r, against)), None)
        return {r.id: ref for r in rows}
    fedavg = next((r.id for r in rows if r.method == "fedavg" and not r.args), None)
    host_of = {plus: base for base, plus in pairs if base in ids}
    out: dict[str, str | None] = {}
    for r in rows:
        ref = host_of.get(r.id)
        if ref is None and "+" in r.method:
            host = r.method.rsplit("+", 1)[0]
            cands = [x for x in rows if x.method == host]
            shared = [x for x in cands if all(r.args.get(k) == v for k, v in x.args.items())]
            ref = (shared or cands or [None])[0]  # type: ignore[assignment]
            ref = ref.id if isinstance(ref, Row) else None
        out[r.id] = ref or fedavg
    return out


def _pm(values: list[float]) -> tuple[float, float | None]:
    a = 100.0 * np.asarray(values, dtype=float)
    return float(a.mean()), (float(a.std()) if len(a) > 1 else None)


def show(v: tuple[float, float | None] | None) -> str:
    if v is None:
        return "-"
    return f"{v[0]:.2f}" + (f" ± {v[1]:.2f}" if v[1] is not None else "")


def _value(summary: dict[str, Any], keys: list[str], statistic: str) -> float | None:
    for key in keys:
        s = summary.get(key)
        if isinstance(s, dict) and isinstance(s.get(statistic), int | float):
            return float(s[statistic])
    return None


def build_tables(
    plan: Plan, runs: dict[tuple[str, str], list[dict[str, Any]]], failed: dict[tuple[str, str], str]
) -> list[BuiltTable]:
    """Every table of the paper. ``runs``: (row id, setting id) -> database rows of its finished runs (one per seed);
    ``failed``: (row id, setting id) -> the error of a run that failed."""
    paper = plan.paper
    planned = {s.id: s for s in plan.settings}
    missing_rows = {r.id: why for r, why in plan.missing_rows}
    out = []
    for t in paper.tables:
        stat = t.statistic or paper.metric.statistic
        columns, not_run = [], []
        for c in t.column_list():
            reps = [s for s in plan.settings if s.represents == c.setting]
            if not reps:
                label = c.label or paper.settings[c.setting].label
                if c.label:
                    label += f" [{paper.settings[c.setting].label}]"
                not_run.append((label, plan.setting_reason(c.setting) or "not planned"))
            for s in reps:
                stand_in = s.id != c.setting
                if c.label:
                    label = c.label + (f" [{s.setting.label}]" if stand_in else "")
                else:
                    label = s.setting.label + (f" (paper: {paper.settings[c.setting].label})" if stand_in else "")
                columns.append(ShownColumn(str(c.id), label, s.id, c.metric, c.lower_is_better))
        chosen = {r.id for r in plan.rows} | set(missing_rows)
        rows = [r for r in paper.table_rows(t) if r.id in chosen]
        cells: dict[tuple[str, int], Cell] = {}
        for r in rows:
            for j, col in enumerate(columns):
                raw = t.values.get(r.id, {}).get(col.id)
                cell = Cell(paper=parse_value(raw) if raw is not None else None, paper_rounding=rounding(raw))
                keys = [col.metric] if col.metric else (r.metric or paper.metric.keys)
                if r.id in missing_rows:
                    cell.note = missing_rows[r.id]
                elif (r.id, col.setting) in failed:
                    cell.note = f"failed: {failed[(r.id, col.setting)]}"
                else:
                    got = runs.get((r.id, col.setting), [])
                    vals = [v for v in (_value(x["summary"], keys, stat) for x in got) if v is not None]
                    for x in got:  # seed -> value, for the paired differences; a diverged run is left out of them
                        v = _value(x["summary"], keys, stat)
                        if x["summary"].get("diverged"):
                            cell.values[int(x["seed"])] = float("nan")
                        elif v is not None:
                            cell.values[int(x["seed"])] = 100.0 * v
                    if vals:
                        cell.ours, cell.seeds = _pm(vals), len(vals)
                        gone = [str(x["seed"]) for x in got if x["summary"].get("diverged")]
                        cell.note = f"diverged: seed {', '.join(gone)}" if gone else ""
                    elif got:
                        cell.note = "not measured (metric absent" + (
                            f": domain not present, domains {', '.join(planned[col.setting].domains)})"
                            if col.metric and col.metric.startswith("domain_acc/")
                            else ")"
                        )
                    else:
                        cell.note = "not run"
                cells[(r.id, j)] = cell
        built = BuiltTable(t, columns, rows, cells, not_run)
        built.references = references(rows, t.pairs, plan.against)
        _pair(built)
        built.orderings = orderings(built)
        out.append(built)
    return out


def _pair(bt: BuiltTable) -> None:
    """Every cell of ours against the same column's cell of its row's reference (paired by seed), and each
    column's detectable difference from the pooled paired std of its comparisons."""
    bt.detectable = []
    for j in range(len(bt.columns)):
        cmps = []
        for r in bt.rows:
            cell, ref = bt.cells[(r.id, j)], bt.references.get(r.id)
            if ref is None or not cell.values:
                continue
            if ref == r.id:
                cell.role = "reference"
                continue
            base = bt.cells.get((ref, j))
            if base is None or not base.values:
                continue
            c = st.compare(base.values, cell.values)
            cell.role, cell.delta = "compared", c.as_dict()
            cmps.append(c)
        with_sd = [c for c in cmps if c.sd is not None]
        if not with_sd:
            bt.detectable.append(None)
            continue
        dof = sum(c.n - 1 for c in with_sd)
        sd = float(np.sqrt(sum((c.n - 1) * c.sd**2 for c in with_sd) / dof))  # type: ignore[operator]
        n = min(c.n for c in with_sd)
        bt.detectable.append({"difference": st.detectable_difference(sd, n), "sd": sd, "n": n})


def rounding(raw: str | float | None) -> float:
    """Half a unit of the last digit a published number is printed with (``98.9``: 0.05, ``90.79±0.08``: 0.005): the
    least spread a number printed that way has."""
    if raw is None:
        return 0.0
    head = re.split(r"±|\+-|\+/-", str(raw))[0].strip()
    decimals = len(head.split(".", 1)[1]) if "." in head else 0
    return 0.5 * 10.0**-decimals


def verdict(cell: Cell) -> str:
    """Whether our cell reproduces the published number: ``reproduces`` when the published mean lies inside our
    95% t interval of the mean over seeds, or within the two spreads (|ours - theirs| <= our std + their std, a
    missing std counting as the published number's rounding, half a unit of its last digit); ``does not reproduce``
    otherwise; ``not resolved (1 seed)`` for one seed outside the spreads; ``""`` without both numbers."""
    if cell.ours is None or cell.paper is None:
        return ""
    vals = np.array([v for v in cell.values.values() if v == v], dtype=float)
    gap = abs(cell.ours[0] - cell.paper[0])
    if gap <= (cell.ours[1] or 0.0) + max(cell.paper[1] or 0.0, cell.paper_rounding) + 1e-9:
        return "reproduces"
    if len(vals) < 2:
        return "not resolved (1 seed)"
    from scipy import stats as sps

    half = float(sps.t.ppf(0.5 + st.LEVEL / 2, len(vals) - 1) * vals.std(ddof=1) / np.sqrt(len(vals)))
    return "reproduces" if gap <= half else "does not reproduce"


def delta_text(cell: Cell) -> str:
    """The paired-difference cell: ``+0.52 [+0.10, +0.94]*`` (``*``: the interval excludes 0), ``(reference)``,
    ``unpaired``, ``+0.52 (1 seed, no interval)``, or ``-``."""
    if cell.role == "reference":
        return "(reference)"
    d = cell.delta
    if d is None:
        return "-"
    if d["method"] == st.UNPAIRED:
        return "unpaired (no common seed)"
    if d["mean"] is None:
        return "no finite pair"
    if d["lo"] is None:
        return f"{d['mean']:+.2f} (1 seed, no interval)"
    text = f"{d['mean']:+.2f} [{d['lo']:+.2f}, {d['hi']:+.2f}]" + ("*" if d["significant"] else "")
    return text + (f" (n={d['n']})" if d["n"] < cell.seeds else "")


def orderings(bt: BuiltTable) -> list[str]:
    """Per column: the methods ranked by us and by the paper (those with both numbers), Kendall's tau between the
    two rankings, and where the paper's best method lands in ours."""
    from scipy.stats import kendalltau

    lines = []
    for j, col in enumerate(bt.columns):
        both = [(r, bt.cells[(r.id, j)]) for r in bt.rows if bt.cells[(r.id, j)].ours and bt.cells[(r.id, j)].paper]
        if len(both) < 2:
            continue
        sign = 1.0 if col.lower_is_better else -1.0
        ours = sorted(both, key=lambda rc: sign * rc[1].ours[0])  # type: ignore[index]
        theirs = sorted(both, key=lambda rc: sign * rc[1].paper[0])  # type: ignore[index]
        tau = kendalltau([c.ours[0] for _, c in both], [c.paper[0] for _, c in both]).statistic  # type: ignore[index]
        best = theirs[0][0]
        rank = [r.id for r, _ in ours].index(best.id) + 1
        tau_text = "undefined (ties)" if tau is None or np.isnan(tau) else f"{tau:+.2f}"
        lines.append(
            f"{col.label}: ours {' > '.join(r.label for r, _ in ours)}; paper {' > '.join(r.label for r, _ in theirs)}"
            f"; Kendall tau {tau_text} over {len(both)} methods; the paper's best ({best.label}) is ours #{rank}"
        )
    by_id = {r.id: r for r in bt.rows}
    for j, col in enumerate(bt.columns):
        gains = []
        for base, plus in bt.table.pairs:
            if base not in by_id or plus not in by_id:
                continue
            a, b = bt.cells[(base, j)], bt.cells[(plus, j)]
            if a.ours and b.ours and a.paper and b.paper:
                d = b.delta if bt.references.get(plus) == base else None
                ci = (
                    f" [{d['lo']:+.2f}, {d['hi']:+.2f}]" + ("*" if d["significant"] else "")
                    if d and d["lo"] is not None
                    else ""
                )
                gains.append((by_id[plus].label, b.ours[0] - a.ours[0], ci, b.paper[0] - a.paper[0]))
        if gains:
            same = sum(1 for _, o, _, p in gains if (o > 0) == (p > 0) and o != 0)
            shown = "; ".join(f"{lab} {o:+.2f}{ci} (paper {p:+.2f})" for lab, o, ci, p in gains)
            lines.append(f"{col.label}: change over the host: {shown}; same direction in {same} of {len(gains)}")
    return lines
