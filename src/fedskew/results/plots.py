"""Figures (matplotlib, Agg backend: works headless): parameter skew of a run (``fedskew skew``), and the accuracy
curves, paired differences against the reference row and per-domain table of ``fedskew report --plot`` (each PNG
with a JSON of the plotted numbers next to it).

Every figure fits a page: at most :data:`PAGE_WIDTH` inches wide (saved at :data:`DPI`), its height growing with the
rows it shows, and no text smaller than :data:`FONT` pt at that size. A series with fewer than :data:`FEW_POINTS`
points has a marker at each, so a run evaluated once still shows; a figure is written only when it has something
to draw."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedskew.config import SETTING_KEYS
from fedskew.results import plotting
from fedskew.results.difference_figure import difference_figure
from fedskew.results.domain_figure import domain_table_figure
from fedskew.results.experiments import show_value
from fedskew.results.plotting import (
    DPI,
    FONT,
    MANY_ROWS,
    MARKERS,
    PAGE_WIDTH,
    TITLE_FONT,
    FigureInfo,
    axes_style,
    few_points_style,
    host_groups,
    host_of,
    line_count,
    metric_label,
    text_width,
    wrap,
)
from fedskew.results.skew_plot import read_jsonl, skew_figure

__all__ = ["DPI", "PAGE_WIDTH", "FigureInfo", "accuracy_figures", "read_jsonl", "report_figures", "skew_figure"]


# ---- report figures: accuracy curves, paired differences, per-domain table ------------------------------------
# which setting keys a partition uses (the others are not shown in a figure's title)
_PARTITION_KEYS = {
    "dir": ("alpha", "min_size"),
    "pat": ("classes_per_client", "pat_scheme"),
    "biased": ("classes_per_client", "uniform_clients"),
    "dirfixed": ("alpha", "samples_per_client"),
    "quantity": ("alpha",),
    "domain": ("domain_fraction", "image_size"),
}
@dataclass
class Series:
    """One curve: an experiment's metric per round, mean and std (population, ddof=0) over its seeds, in %.
    ``std`` is None at a round only one seed reached; ``n`` is how many seeds each round has (a value that is not
    finite, as a diverged run's, is left out)."""

    label: str
    rounds: list[int]
    mean: list[float]
    std: list[float | None]
    n: list[int]
    seeds: list[int]


def _setting(ident: dict[str, Any]) -> dict[str, Any]:
    return {k: ident.get(k) for k in SETTING_KEYS}


def _setting_title(s: dict[str, Any]) -> str:
    part = s.get("partition")
    keys = [k for k in _PARTITION_KEYS.get(str(part), ()) if s.get(k) is not None]
    params = ", ".join(f"{k}={show_value(s.get(k))}" for k in keys)
    text = f"{s.get('dataset')}, {part}" + (f" ({params})" if params else "") + f", {s.get('clients')} clients"
    if s.get("join_ratio") not in (None, 1.0):
        text += f", join {s['join_ratio']:g}"
    if s.get("protocol") not in (None, "fedskew"):
        text += f", protocol {s['protocol']}"
    return text


def _slug(setting: dict[str, Any]) -> str:
    import hashlib
    import re

    digest = hashlib.sha1(json.dumps(setting, sort_keys=True, default=str).encode()).hexdigest()[:6]
    base = re.sub(r"[^A-Za-z0-9.]+", "-", f"{setting.get('dataset')}-{setting.get('partition')}").strip("-")
    return f"{base}-{digest}"


def experiment_labels(experiments: list[Any]) -> list[str]:
    """Legend labels for experiments of one setting: the method as typed, plus the arguments and settings that tell
    it apart from the others (``fedavg (weights=uniform)``, ``fedprox (mu=0.1) lr=0.01``)."""
    idents = [e.identity for e in experiments]
    keys = list(dict.fromkeys(k for i in idents for k in i if k not in ("method", "method_args", *SETTING_KEYS)))
    differ = [k for k in keys if len({json.dumps(i.get(k), sort_keys=True, default=str) for i in idents}) > 1]
    labels = []
    for e in experiments:
        same = [o for o in idents if o.get("method") == e.identity.get("method")]
        args = e.identity.get("method_args") or {}
        shown = [k for k in args if len({json.dumps(o.get("method_args", {}).get(k), default=str) for o in same}) > 1]
        text = e.name + (f" ({', '.join(f'{k}={show_value(args[k])}' for k in sorted(shown))})" if shown else "")
        text += "".join(f" {k}={show_value(e.identity.get(k))}" for k in differ)
        labels.append(text)
    return labels


def _series(label: str, runs: list[dict[str, Any]], records: dict[str, list[dict[str, Any]]], metric: str) -> Series:
    per_round: dict[int, list[float]] = {}
    for r in runs:
        for rec in records.get(r["run_id"], []):
            value = rec.get(metric)
            if rec.get("evaluated", True) and isinstance(value, int | float) and math.isfinite(value):
                per_round.setdefault(int(rec["round"]), []).append(100.0 * float(value))
    rounds = sorted(per_round)
    vals = [np.asarray(per_round[t]) for t in rounds]
    return Series(
        label,
        rounds,
        [float(v.mean()) for v in vals],
        [float(v.std()) if len(v) > 1 else None for v in vals],
        [len(v) for v in vals],
        [int(r["seed"]) for r in runs],
    )


def _draw_series(ax: Any, s: Series, label: str, color: Any, marker: str, linestyle: str = "-", dx: float = 0.0) -> Any:
    """One curve with its ± std band (an error bar where it has a single point), a marker at each point when it
    has few (:data:`FEW_POINTS`); ``dx`` shifts it along x (see :func:`_dodge`)."""
    xs = [r + dx for r in s.rounds]
    (line,) = ax.plot(
        xs,
        s.mean,
        color=color,
        linestyle=linestyle,
        lw=1.4,
        label=label,
        zorder=3,
        **few_points_style(len(s.rounds), marker),
    )
    if any(d is not None for d in s.std):
        if len(s.rounds) > 1:
            lo = [m - (d or 0.0) for m, d in zip(s.mean, s.std, strict=True)]
            hi = [m + (d or 0.0) for m, d in zip(s.mean, s.std, strict=True)]
            ax.fill_between(xs, lo, hi, color=color, alpha=0.15, lw=0, zorder=2)
        else:
            ax.errorbar(xs, s.mean, yerr=[s.std[0] or 0.0], fmt="none", ecolor=color, capsize=3, zorder=2)
    return line


def _dodge(series: list[Series], k: int, n: int) -> float:
    """How far the ``k``-th of ``n`` coloured series of a panel is shifted along x so that markers at the same
    round do not hide each other: only when every series there has at most 3 points (a run evaluated once or
    twice), by at most a quarter of the gap between evaluated rounds; the JSON keeps the true rounds."""
    if n < 2 or any(len(s.rounds) > 3 for s in series):
        return 0.0
    xs = sorted({r for s in series for r in s.rounds})
    gap = min((b - a for a, b in zip(xs, xs[1:], strict=False)), default=1)
    return (k - (n - 1) / 2) * min(0.5 / n, 0.1) * gap


def _curves(panels: list[tuple[str, list[Series]]], title: str) -> Any:
    """The figure of :func:`_curves_figure`."""
    return _curves_figure(panels, title)[0]


def _curves_figure(
    panels: list[tuple[str, list[Series]]],
    title: str,
    empty: list[str] | tuple[str, ...] = (),
    missing: dict[str, list[str]] | None = None,
) -> tuple[Any, dict[str, Any]]:
    """Accuracy vs round, one line per experiment with a ± std band. Up to :data:`MANY_ROWS` rows: one panel per
    metric, every row in it, one legend below. More: small multiples, one panel per host and its plug-ins (and per
    metric) with those rows in colour and every other row in grey behind them, a legend beside each group; the
    y axes of one metric are shared. ``empty``: metrics no row has a value of (named in the title); ``missing``:
    per metric, the rows without a value (counted in the panel's title). Returns the figure and what its JSON adds
    to the plotted series: the layout and the groups."""
    import matplotlib.pyplot as plt

    missing = missing or {}
    labels = list(dict.fromkeys(s.label for _, ss in panels for s in ss))
    seeds = sorted({len(s.seeds) for _, ss in panels for s in ss})
    nseeds = {s.label: len(s.seeds) for _, ss in panels for s in ss}

    def named(label: str) -> str:
        n = nseeds[label]
        return label if len(seeds) == 1 else f"{label} ({n} seed{'s' if n != 1 else ''})"

    over = f"mean ± std over {seeds[0]} seeds (band)" if len(seeds) == 1 else "mean ± std over its seeds (band)"
    if seeds == [1]:
        over = "one seed"
    head = f"{title}: accuracy (%) vs communication round, {over}"
    many = len(labels) > MANY_ROWS
    if many:
        head += "; per panel a host and its plug-ins in colour, every other row in grey"
    head += "\n" + "; ".join(f"{m}: {metric_label(m)}" for m, _ in panels)
    if empty:
        head += f"\nno evaluated value of {', '.join(empty)} in any run (not drawn)"
    head = wrap(head, PAGE_WIDTH - 0.2, TITLE_FONT)
    head_h = 0.17 * line_count(head) + 0.2

    def panel_title(metric: str, members: list[str] | None = None) -> str:
        gone = [lab for lab in missing.get(metric, []) if members is None or lab in members]
        return f"no value: {len(gone)} row{'s' if len(gone) != 1 else ''}" if gone else ""

    colors = plt.get_cmap("tab10").colors
    m = len(panels)
    if not many:
        names = [named(lab) for lab in labels]
        entry_w = max(text_width(n) for n in names) + 0.6
        if entry_w > PAGE_WIDTH - 0.2:
            names = [wrap(n, PAGE_WIDTH - 0.9) for n in names]
            entry_w = PAGE_WIDTH - 0.2
        leg_cols = max(1, min(len(names), int((PAGE_WIDTH - 0.2) // entry_w)))
        leg_rows = math.ceil(len(names) / leg_cols)
        ncols = 1 if m == 1 else 2
        nrows = math.ceil(m / ncols)
        leg_h = 0.17 * leg_rows * max(line_count(n) for n in names) + 0.2
        fig = plt.figure(figsize=(PAGE_WIDTH, head_h + 2.8 * nrows + leg_h), layout="constrained")
        axes = fig.subplots(nrows, ncols, squeeze=False)
        handles: dict[str, Any] = {}
        for ax, (metric, series) in zip(axes.flat, panels, strict=False):
            for k, s in enumerate(series):
                i = labels.index(s.label)
                dx = _dodge(series, k, len(series))
                line = _draw_series(ax, s, named(s.label), colors[i % 10], MARKERS[i % len(MARKERS)], dx=dx)
                handles.setdefault(s.label, line)
            note = panel_title(metric)
            ax.set_title(metric + (f" ({note})" if note else ""), fontsize=TITLE_FONT)
            ax.set_ylabel("accuracy (%)", fontsize=FONT)
            ax.set_xlabel("communication round", fontsize=FONT)
            axes_style(ax, [r for s in series for r in s.rounds])
        for ax in list(axes.flat)[m:]:
            ax.axis("off")
        fig.legend(
            [handles[lab] for lab in labels],
            names,
            loc="outside lower center",
            ncol=leg_cols,
            fontsize=FONT,
            frameon=False,
        )
        fig.suptitle(head, fontsize=TITLE_FONT)
        return fig, {"layout": "one panel per metric", "groups": [["rows", labels]]}

    groups = [(name, [labels[i] for i in idx]) for name, idx in host_groups(labels)]
    per_row = 2 if m == 1 else 1
    leg_w = 1.75 if m == 1 else 2.0
    ax_w = (PAGE_WIDTH - per_row * leg_w) / (per_row * m)
    palette = ("black", *colors[:9])

    def entry(label: str, host: str) -> str:
        text = label[len(host) :] if label.startswith(host + "+") else label
        return wrap(named(label) if text == label else named(label)[len(host) :], leg_w - 0.55)

    entries = [[entry(lab, host_of(lab)) for lab in members] for _, members in groups]
    nrows = math.ceil(len(groups) / per_row)
    row_h = [
        max(
            1.75, 0.16 * max(sum(line_count(t) for t in e) + 1 for e in entries[r * per_row : (r + 1) * per_row]) + 0.45
        )
        for r in range(nrows)
    ]
    fig = plt.figure(figsize=(PAGE_WIDTH, head_h + sum(row_h) + 0.3), layout="constrained")
    grid = fig.add_gridspec(
        nrows, per_row * (m + 1), width_ratios=([ax_w] * m + [leg_w]) * per_row, height_ratios=row_h
    )
    shared: list[Any] = [None] * m
    for g, ((name, members), texts) in enumerate(zip(groups, entries, strict=True)):
        r, slot = divmod(g, per_row)
        handles = {}
        for j, (metric, series) in enumerate(panels):
            ax = fig.add_subplot(grid[r, slot * (m + 1) + j], sharex=shared[0], sharey=shared[j])
            shared[j] = shared[j] or ax
            for s in series:
                if s.label not in members:
                    ax.plot(s.rounds, s.mean, color="0.78", lw=0.8, zorder=1, **few_points_style(len(s.rounds), "o", 2))
            for s in series:
                if s.label in members:
                    k = members.index(s.label)
                    dx = _dodge(series, k, len(members))
                    line = _draw_series(ax, s, s.label, palette[k % 10], MARKERS[k % len(MARKERS)], dx=dx)
                    handles.setdefault(s.label, line)
            note = panel_title(metric, members)
            text = name if m == 1 else f"{name}: {metric}"
            ax.set_title(text + (f" ({note})" if note else ""), fontsize=FONT, loc="left")
            if slot == 0 and j == 0:
                ax.set_ylabel("accuracy (%)", fontsize=FONT)
            if g + per_row >= len(groups):
                ax.set_xlabel("communication round", fontsize=FONT)
            axes_style(ax, [x for s in series for x in s.rounds])
        lax = fig.add_subplot(grid[r, slot * (m + 1) + m])
        lax.axis("off")
        shown = [lab for lab in members if lab in handles]
        lax.legend(
            [handles[lab] for lab in shown],
            [texts[members.index(lab)] for lab in shown],
            loc="center left",
            title=name,
            fontsize=FONT,
            title_fontsize=FONT,
            frameon=False,
            borderaxespad=0.0,
        )
    fig.suptitle(head, fontsize=TITLE_FONT)
    return fig, {"layout": "one panel per host and its plug-ins", "groups": [[n, ms] for n, ms in groups]}


def accuracy_figures(
    runs: list[dict[str, Any]],
    records: dict[str, list[dict[str, Any]]],
    out_dir: str | Path,
    metrics: list[str] | tuple[str, ...] = ("global_acc",),
    *,
    last_n: int | None = None,
    against: str | None = None,
) -> list[FigureInfo]:
    """The figures of ``fedskew report --plot``: per setting (:data:`SETTING_KEYS`) one PNG of accuracy vs round
    (one curve per experiment, the report's rows, with a band of ± one std over its seeds; a panel per metric, or
    small multiples per host and its plug-ins when there are many rows; not written when no row has a value of any
    metric); where some row has a paired interval against its reference (the report's, ``against`` as there), one
    PNG of those differences (last-N mean) with their 95% interval bars; and for domain-skew settings a table of
    per-domain accuracy (rows × domains, AVG and STD, mean of the last N evaluated rounds, mean ± std over seeds,
    shaded within each column). ``runs`` are database rows (:meth:`ResultsDB.runs`), ``records`` each run's round
    records. Every PNG fits a page (:data:`PAGE_WIDTH`) and has a JSON next to it holding the plotted numbers."""
    import matplotlib

    matplotlib.use("Agg")

    from fedskew.results.report import choose_references, group_experiments

    out = Path(out_dir)
    settings: dict[str, list[Any]] = {}
    for e in group_experiments(runs, ignore=("last_n",) if last_n else ()):
        settings.setdefault(json.dumps(_setting(e.identity), sort_keys=True, default=str), []).append(e)
    every = [e for exps in settings.values() for e in exps]
    every_labels = [lab for exps in settings.values() for lab in experiment_labels(exps)]
    refs = choose_references(every, every_labels, against) if every else []
    figures: list[FigureInfo] = []
    first = 0
    for key, exps in settings.items():
        setting = json.loads(key)
        labels = experiment_labels(exps)
        title = _setting_title(setting)
        mine = [None if j is None else j - first for j in refs[first : first + len(exps)]]  # one setting's block
        first += len(exps)
        diffs = difference_figure(exps, labels, mine, records, metrics, last_n, title)
        if diffs is not None:
            fig, data = diffs
            data.update(setting=setting, title=title)
            figures.append(plotting.write_figure(fig, out / f"paired-{_slug(setting)}.png", data, "paired", DPI))
        panels, empty, missing = [], [], {}
        for metric in metrics:
            series = [_series(lab, e.latest, records, metric) for lab, e in zip(labels, exps, strict=True)]
            if any(s.rounds for s in series):
                panels.append((metric, [s for s in series if s.rounds]))
                if not all(s.rounds for s in series):
                    missing[metric] = [s.label for s in series if not s.rounds]
            else:
                empty.append(metric)
        if panels:  # nothing to draw: no figure (the table shows the empty columns)
            fig, info = _curves_figure(panels, title, empty, missing)
            data = {
                "setting": setting,
                "title": title,
                "panels": [{"metric": m, "series": [s.__dict__ for s in ss]} for m, ss in panels],
                "empty_metrics": empty,
                "missing": missing,
                **info,
            }
            figures.append(plotting.write_figure(fig, out / f"curves-{_slug(setting)}.png", data, "curves", DPI))
        bars = domain_table_figure(exps, labels, records, last_n, title)
        if bars is not None:
            fig, data = bars
            data.update(setting=setting, title=title)
            figures.append(plotting.write_figure(fig, out / f"domains-{_slug(setting)}.png", data, "domains", DPI))
    return figures


def report_figures(
    db: Any, out_dir: str | Path, metrics: list[str], *, last_n: int | None = None, against: str | None = None
) -> list[FigureInfo]:
    """:func:`accuracy_figures` over every run of a :class:`fedskew.results.store.ResultsDB` (round records from its
    ``rounds`` table)."""
    from fedskew.results.report import round_records

    runs = db.runs()
    records = round_records(db.conn, [r["run_id"] for r in runs])
    return accuracy_figures(runs, records, out_dir, metrics, last_n=last_n, against=against)
