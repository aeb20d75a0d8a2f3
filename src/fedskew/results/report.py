"""Paper-style tables from the results database: runs grouped by configuration, mean ± std over seeds."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np

IDENTITY_COLUMNS = ("method", "dataset", "partition", "alpha", "clients", "join_ratio", "rounds", "local_epochs")


def _pm(values: list[float]) -> str:
    a = 100 * np.asarray(values)
    return f"{a.mean():.2f} ± {a.std():.2f}"


def _diverged(group: list[dict[str, Any]]) -> str:
    """Which runs of a group stopped because training diverged: ``seed 2 (round 4)``; ``-`` for none."""
    hits = [f"seed {r['seed']} (round {r['summary']['diverged_round']})" for r in group if r["summary"].get("diverged")]
    return ", ".join(hits) or "-"


def group_runs(runs: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in runs:
        groups[r["group_key"]].append(r)
    return groups


def markdown_report(runs: list[dict[str, Any]], metric: str = "global_acc") -> str:
    """One row per configuration: its identity, #seeds, best and last-N accuracy as mean ± std (%) over seeds."""
    header = [*IDENTITY_COLUMNS, "args", "seeds", f"{metric} best", f"{metric} last-N", "diverged"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for _, group in sorted(group_runs(runs).items(), key=lambda kv: kv[1][0]["created"]):
        have = [r for r in group if metric in r["summary"]]
        if not have and not any(r["summary"].get("diverged") for r in group):
            continue
        cfg = group[0]["config"]
        args = ", ".join(f"{k}={v}" for k, v in sorted(cfg.get("method_args", {}).items())) or "-"
        best = [r["summary"][metric]["best"] for r in have]
        last = [r["summary"][metric]["last_n_mean"] for r in have]
        seeds = sorted({r["seed"] for r in have})
        cells = [str(cfg[c]) for c in IDENTITY_COLUMNS] + [args, f"{len(have)} ({','.join(map(str, seeds))})"]
        cells += [_pm(best) if have else "-", _pm(last) if have else "-", _diverged(group)]
        lines.append("| " + " | ".join(cells) + " |")
    if len(lines) == 2:
        return f"no runs with metric {metric!r}"
    return "\n".join(lines)
