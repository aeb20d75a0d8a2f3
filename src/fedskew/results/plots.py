"""Figures from a run directory (matplotlib, Agg backend: works headless)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np


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

    ncols = per_layer
    fig, axes = plt.subplots(len(names) + 1, ncols, figsize=(4.2 * ncols, 2.6 * (len(names) + 1)), squeeze=False)
    summary: dict[str, Any] = {"round": rnd, "layers": {}}
    for row, name in enumerate(names):
        layer = probe["layers"][name]
        order = np.argsort(layer["cv"])[::-1][:per_layer]  # the most dispersed probed positions
        summary["layers"][name] = {"high_frac": layer["high_frac"], "M": layer["M"]}
        for col, j in enumerate(order):
            ax = axes[row][col]
            vals = np.asarray(layer["clients"][j])
            ax.hist(vals, bins=min(20, max(5, len(vals))), color="0.75", edgecolor="0.4")
            ax.axvline(layer["mean"][j], color="tab:blue", ls="--", label="mean (uniform FedAvg)")
            ax.axvline(layer["weighted_mean"][j], color="tab:green", ls=":", label="sample-weighted mean")
            ax.axvline(layer["aggregate"][j], color="tab:red", lw=2, label="this method's aggregate")
            high = "high" if layer["high"][j] else "low"
            ax.set_title(f"{name}[{layer['positions'][j]}] cv={layer['cv'][j]:.3g} ({high})", fontsize=8)
            ax.tick_params(labelsize=7)
        for col in range(len(order), ncols):
            axes[row][col].axis("off")
    axes[0][0].legend(fontsize=6)
    rounds = [p["round"] for p in probes]
    ax = axes[-1][0]
    for name in probes[-1]["layers"]:
        ax.plot(rounds, [p["layers"][name]["high_frac"] for p in probes], label=name)
    ax.set_yscale("symlog", linthresh=1e-5)
    ax.set_xlabel("round")
    ax.set_ylabel("H/M (high-dispersion share)")
    ax.legend(fontsize=5)
    ax = axes[-1][1] if ncols > 1 else None
    if ax is not None:
        for name in probes[-1]["layers"]:
            ax.plot(rounds, [p["layers"][name]["skew_mean_abs"] for p in probes], label=name)
        ax.set_xlabel("round")
        ax.set_ylabel("mean |skewness| of client values")
        for col in range(2, ncols):
            axes[-1][col].axis("off")
    fig.suptitle(f"parameter skew, {run_dir.name}, round {rnd}", fontsize=9)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    summary["high_frac_by_round"] = {
        name: [p["layers"][name]["high_frac"] for p in probes] for name in probes[-1]["layers"]
    }
    summary["rounds"] = rounds
    return summary
