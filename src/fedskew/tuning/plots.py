"""The figure of a search (``OUT/figures/search-<method>.png``, its numbers in a JSON beside it): each trial's
value in trial order with the best so far, pruned trials at their last reported value, and the value against each
searched hyper-parameter (log axes for log ranges)."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from fedskew.results.plotting import DPI, FONT, PAGE_WIDTH, TITLE_FONT, write_figure
from fedskew.space import Float, Int, parse_dist


def plot_search(result: Any, folder: Path) -> Path | None:
    """Write the figure of one method's search (a :class:`fedskew.tuning.study.MethodResult`); None without trials."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator, NullFormatter

    rows = [r for r in result.trials if r["state"] in ("complete", "pruned")]
    if not rows:
        return None
    params = list(result.space)
    panels = 1 + len(params)
    ncols = min(3, panels)  # a page's width: at most 3 panels a row
    nrows = math.ceil(panels / ncols)
    fig, grid = plt.subplots(nrows, ncols, figsize=(PAGE_WIDTH, 2.5 * nrows + 0.4), squeeze=False)
    axes = [[a for row in grid for a in row]]
    for extra in axes[0][panels:]:
        extra.set_visible(False)
    sign = 1.0 if result.direction == "maximize" else -1.0
    done = [r for r in rows if r["state"] == "complete" and r["value"] is not None]
    pruned = [r for r in rows if r["state"] == "pruned" and r["last_value"] is not None]
    ax = axes[0][0]
    ax.plot([r["number"] for r in done], [r["value"] for r in done], "o", color="tab:blue", label="complete")
    ax.plot([r["number"] for r in pruned], [r["last_value"] for r in pruned], "x", color="0.5", label="pruned (last)")
    best, line = None, []
    for r in sorted(done, key=lambda r: r["number"]):
        best = r["value"] if best is None or sign * r["value"] > sign * best else best
        line.append((r["number"], best))
    if line:
        ax.step([n for n, _ in line], [v for _, v in line], where="post", color="tab:red", label="best so far")
    ax.set_xlabel("trial")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(f"validation {result.metric}")
    ax.legend(fontsize=FONT)
    for i, name in enumerate(params, start=1):
        ax = axes[0][i]
        xs = [r["params"].get(name) for r in done]
        ax.plot(xs, [r["value"] for r in done], "o", color="tab:blue")
        xp = [r["params"].get(name) for r in pruned]
        ax.plot(xp, [r["last_value"] for r in pruned], "x", color="0.5")
        dist = parse_dist(result.space[name])
        if isinstance(dist, Float | Int):  # the whole searched range, so where the trials fell shows
            pad = 0.0 if dist.log else 0.03 * (dist.high - dist.low)
            if dist.log:
                ax.set_xscale("log")
                ax.xaxis.set_minor_formatter(NullFormatter())
            ax.set_xlim(dist.low - pad, dist.high + pad)
        ax.set_xlabel(f"{name} ({result.space[name]})")
        ax.tick_params(labelsize=FONT)
    title = f"{result.study}: {len(done)} complete, {len(pruned)} pruned"
    fig.suptitle(title, fontsize=TITLE_FONT)
    fig.tight_layout()
    slug = re.sub(r"[^A-Za-z0-9.+_-]+", "-", result.study.split(":", 1)[-1]).strip("-")
    data = {"study": result.study, "metric": result.metric, "space": result.space, "trials": rows}
    return write_figure(fig, folder / f"search-{slug}.png", data, "search", DPI).path
