"""``fedskew report --plot``'s paired-difference figure: per row, its mean paired difference against its reference
row with the 95% interval, one panel per metric (:func:`difference_figure`; the report's other figures are in
:mod:`fedskew.results.plots`)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from fedskew.results.plotting import FONT, PAGE_WIDTH, TITLE_FONT, host_groups, line_count, metric_label, wrap


def difference_figure(
    exps: list[Any],
    labels: list[str],
    refs: list[int | None],
    records: dict[str, list[dict[str, Any]]],
    metrics: list[str] | tuple[str, ...],
    last_n: int | None,
    title: str,
) -> tuple[Any, dict[str, Any]] | None:
    """One panel per metric (up to three side by side, sharing the rows): per row compared with its reference, the
    mean paired difference of the last-N mean accuracy (points) with its 95% interval as a bar (filled marker: the
    interval excludes 0), and a line at 0. Rows are grouped by host (a host, then its plug-ins), top to bottom as
    in the JSON. None when no row has an interval (fewer than two common seeds everywhere)."""
    import matplotlib.pyplot as plt

    from fedskew.results.report import paired_cells, stat_from_records, stat_from_summary

    def stat(r: dict[str, Any], metric: str) -> Any:
        if last_n:
            return stat_from_records(records.get(r["run_id"], []), metric, last_n)
        return stat_from_summary(r["summary"], metric)

    panels = []
    for metric in metrics:
        cells = paired_cells(exps, refs, metric, "last", stat)
        rows = [
            {"label": labels[i], "reference": labels[refs[i]], **c.cmp.as_dict()}  # type: ignore[index]
            for i, c in enumerate(cells)
            if c.cmp is not None and c.cmp.lo is not None
        ]
        if rows:
            panels.append({"metric": metric, "rows": rows})
    if not panels:
        return None
    shown = list(dict.fromkeys(r["label"] for p in panels for r in p["rows"]))
    groups = host_groups(shown, most=None)
    order = [shown[i] for _, idx in groups for i in idx]
    for p in panels:
        p["rows"].sort(key=lambda r: order.index(r["label"]))
    first = {}
    for p in panels:
        for r in p["rows"]:
            first.setdefault(r["label"], r)
    kinds = {(r["n"], r["method"]) for p in panels for r in p["rows"]}
    common = next(iter(kinds)) if len(kinds) == 1 else None
    texts = [
        wrap(f"{lab} vs {first[lab]['reference']}" + ("" if common else f" (n={first[lab]['n']})"), 3.2)
        for lab in order
    ]
    row_h = max(0.22, 0.15 * max(line_count(t) for t in texts) + 0.08)
    m = len(panels)
    ncols = min(m, 3)
    nrows = math.ceil(m / ncols)
    n = f"last {last_n}" if last_n else "last-N"
    head = f"{title}\npaired difference vs reference (points), {n} mean, 95% interval; filled: excludes 0"
    if common:
        head += f"; n={common[0]} seeds, {common[1]}, every row"
    head = wrap(head, PAGE_WIDTH - 0.2, TITLE_FONT)
    label_h = 0.17 * max(line_count(wrap(metric_label(p["metric"]), PAGE_WIDTH / ncols - 0.4)) for p in panels) + 0.5
    height = 0.17 * line_count(head) + 0.2 + nrows * (len(order) * row_h + 0.3 + label_h)
    fig = plt.figure(figsize=(PAGE_WIDTH, height), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False, sharey=True)
    ys = {lab: len(order) - 1 - k for k, lab in enumerate(order)}
    bounds = np.cumsum([len(idx) for _, idx in groups])[:-1]
    for ax, panel in zip(axes.flat, panels, strict=False):
        have = {r["label"] for r in panel["rows"]}
        for r in panel["rows"]:
            color = "tab:red" if r["significant"] else "0.35"
            ax.errorbar(
                r["mean"],
                ys[r["label"]],
                xerr=[[r["mean"] - r["lo"]], [r["hi"] - r["mean"]]],
                fmt="o",
                color=color,
                mfc=color if r["significant"] else "white",
                ms=5,
                capsize=3,
            )
        for lab in order:
            if lab not in have:
                ax.text(
                    0.5,
                    ys[lab],
                    "no interval",
                    transform=ax.get_yaxis_transform(),
                    ha="center",
                    va="center",
                    fontsize=FONT,
                    color="0.45",
                )
        for b in bounds:
            ax.axhline(len(order) - 0.5 - b, color="0.6", lw=0.6)
        ax.axvline(0.0, color="0.2", lw=0.8, ls="--")
        ax.set_yticks(list(ys.values()), texts, fontsize=FONT)
        ax.set_ylim(-0.6, len(order) - 0.4)
        ax.set_xlabel(
            wrap(f"paired difference (points)\n{metric_label(panel['metric'])}", PAGE_WIDTH / ncols - 0.4),
            fontsize=FONT,
        )
        ax.set_title(panel["metric"], fontsize=TITLE_FONT)
        ax.tick_params(labelsize=FONT)
        ax.grid(axis="x", alpha=0.3)
    for ax in list(axes.flat)[m:]:
        ax.axis("off")
    fig.suptitle(head, fontsize=TITLE_FONT)
    return fig, {"panels": panels, "statistic": "last_n_mean", "last_n": last_n}
