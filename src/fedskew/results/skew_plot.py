"""``fedskew skew``: client values against the FedAvg mean and the method's aggregate at probed positions, and the
share of high-dispersion positions over rounds (the FedSA paper's Figure 2)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from fedskew.results.plotting import (
    DPI,
    FONT,
    MARKERS,
    PAGE_WIDTH,
    TITLE_FONT,
    few_points_style,
    single_x,
    text_width,
    wrap,
)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found (is this a fedskew run directory written with skew_probes > 0?)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def skew_figure(
    run_dir: Path, out: Path, layers: list[str] | None = None, rnd: int | None = None, per_layer: int = 2
) -> dict[str, Any]:
    """Client values vs FedAvg mean vs the method's aggregate at probed positions (the FedSA paper's Figure 2),
    and the share of high-dispersion positions over rounds per layer. Returns a small text summary."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    probes = read_jsonl(run_dir / "skew.jsonl")
    if not probes:
        raise ValueError(f"{run_dir / 'skew.jsonl'} holds no probe")
    by_round = {p["round"]: p for p in probes}
    if rnd is None:
        rnd = max(by_round)
    if rnd not in by_round:
        raise ValueError(f"round {rnd} was not probed; probed rounds: {sorted(by_round)}")
    probe = by_round[rnd]
    names = layers or list(probe["layers"])[:4]
    unknown = [n for n in names if n not in probe["layers"]]
    if unknown:
        raise ValueError(f"unknown layer(s) {unknown}; available: {list(probe['layers'])}")

    ncols = max(1, per_layer)
    all_layers = list(probes[-1]["layers"])
    layer_w = max(text_width(n) for n in all_layers) + 0.6
    legend_cols = max(1, min(len(all_layers), int((PAGE_WIDTH - 0.3) // layer_w)))
    legend_h = 0.2 * math.ceil(len(all_layers) / legend_cols) + 0.1
    height = 0.9 + 2.0 * len(names) + 2.4 + legend_h
    fig = plt.figure(figsize=(PAGE_WIDTH, height), layout="constrained")
    grid = fig.add_gridspec(len(names) + 1, 1, height_ratios=[2.0] * len(names) + [2.4])
    summary: dict[str, Any] = {"round": rnd, "layers": {}}
    handles = []
    for row, name in enumerate(names):
        layer = probe["layers"][name]
        order = np.argsort(layer["cv"])[::-1][:per_layer]  # the most dispersed probed positions
        summary["layers"][name] = {"high_frac": layer["high_frac"], "M": layer["M"]}
        axes = grid[row].subgridspec(1, ncols).subplots(squeeze=False)[0]
        for col, j in enumerate(order):
            ax = axes[col]
            vals = np.asarray(layer["clients"][j])
            ax.hist(vals, bins=min(20, max(5, len(vals))), color="0.75", edgecolor="0.4")
            h1 = ax.axvline(layer["mean"][j], color="tab:blue", ls="--", label="mean (uniform FedAvg)")
            h2 = ax.axvline(layer["weighted_mean"][j], color="tab:green", ls=":", label="sample-weighted mean")
            h3 = ax.axvline(layer["aggregate"][j], color="tab:red", lw=2, label="this method's aggregate")
            handles = handles or [h1, h2, h3]
            high = "high" if layer["high"][j] else "low"
            text = f"{name}[{layer['positions'][j]}] cv={layer['cv'][j]:.3g} ({high})"
            ax.set_title(wrap(text, PAGE_WIDTH / ncols - 0.3), fontsize=FONT)
            ax.xaxis.set_major_locator(MaxNLocator(4))
            ax.yaxis.set_major_locator(MaxNLocator(4, integer=True))
            ax.ticklabel_format(axis="x", style="sci", scilimits=(-2, 3))
            ax.tick_params(labelsize=FONT)
            ax.xaxis.get_offset_text().set_fontsize(FONT)
            if col == 0:
                ax.set_ylabel("clients", fontsize=FONT)
        for col in range(len(order), ncols):
            axes[col].axis("off")
    rounds = [p["round"] for p in probes]
    bottom = grid[-1].subgridspec(1, 2).subplots()
    lines = []
    for i, name in enumerate(all_layers):
        style = {
            "color": plt.get_cmap("tab10").colors[i % 10],
            "linestyle": ("-", "--", ":", "-.")[(i // 10) % 4],
            **few_points_style(len(rounds), MARKERS[(i // 10) % len(MARKERS)], 3.5),
        }
        (line,) = bottom[0].plot(rounds, [p["layers"][name]["high_frac"] for p in probes], label=name, **style)
        bottom[1].plot(rounds, [p["layers"][name]["skew_mean_abs"] for p in probes], label=name, **style)
        lines.append(line)
    bottom[0].set_yscale("symlog", linthresh=1e-5)
    bottom[0].set_ylabel("H/M (high-dispersion share)", fontsize=FONT)
    bottom[1].set_ylabel("mean |skewness| of client values", fontsize=FONT)
    for ax in bottom:
        ax.set_xlabel("round", fontsize=FONT)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.tick_params(labelsize=FONT)
        ax.grid(alpha=0.3)
        single_x(ax, rounds)
    fig.legend(  # the title above it: a suptitle and a legend both "outside upper" overlap
        handles,
        [h.get_label() for h in handles],
        loc="outside upper center",
        ncol=3,
        fontsize=FONT,
        title=wrap(f"parameter skew, {run_dir.name}, round {rnd}", PAGE_WIDTH - 0.2, TITLE_FONT),
        title_fontsize=TITLE_FONT,
        frameon=False,
    )
    fig.legend(lines, all_layers, loc="outside lower center", ncol=legend_cols, fontsize=FONT, frameon=False)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=DPI)
    plt.close(fig)
    summary["high_frac_by_round"] = {
        name: [p["layers"][name]["high_frac"] for p in probes] for name in probes[-1]["layers"]
    }
    summary["rounds"] = rounds
    return summary
