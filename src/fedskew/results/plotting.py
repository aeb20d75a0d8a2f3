"""What every fedskew figure shares: the page it must fit (:data:`PAGE_WIDTH` inches at :data:`DPI`, no text under
:data:`FONT` pt), markers on short series, text wrapping, grouping of rows by host, the metrics' axis labels, and
writing a PNG with a JSON of its numbers beside it."""

from __future__ import annotations

import json
import math
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PAGE_WIDTH = 7.5  # inches: a page's text width; no figure is wider
DPI = 150  # the resolution the figures are saved at (7.5 in -> 1125 px)
FONT = 8  # pt: the smallest text in any figure
TITLE_FONT = 9
FEW_POINTS = 20  # a series with fewer points than this has a marker at each of them
MANY_ROWS = 10  # more curves than this: small multiples, one panel per host and its plug-ins
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "h")
CHAR_WIDTH = 0.6 / 72  # inches per character per pt of font size (DejaVu Sans, a little generous)


def wrap(text: str, width_in: float, size: float = FONT) -> str:
    """``text`` broken into lines that fit ``width_in`` inches at ``size`` pt (its own line breaks kept)."""
    chars = max(10, int(width_in / (CHAR_WIDTH * size)))
    return "\n".join(
        textwrap.fill(line, chars, break_long_words=False, break_on_hyphens=False) or line for line in text.split("\n")
    )


def text_width(text: str, size: float = FONT) -> float:
    """Inches the widest line of ``text`` takes at ``size`` pt (an estimate)."""
    return max(len(line) for line in text.split("\n")) * CHAR_WIDTH * size


def line_count(text: str) -> int:
    return text.count("\n") + 1


def few_points_style(n_points: int, marker: str, size: float = 4.0) -> dict[str, Any]:
    """Marker keywords for a line of ``n_points`` points: a marker at each when there are few (always for one)."""
    if n_points >= FEW_POINTS:
        return {"marker": None}
    return {"marker": marker, "markersize": size + (1.0 if n_points == 1 else 0.0)}


def single_x(ax: Any, xs: list[float]) -> None:
    """An axis whose points all lie at one x: a window of ± 1 around it (with whole-number ticks) rather than the
    ± a few hundredths matplotlib chooses."""
    if xs and len(set(xs)) == 1:
        ax.set_xlim(xs[0] - 1, xs[0] + 1)


@dataclass
class FigureInfo:
    """A written figure: the PNG, the JSON of everything drawn in it (next to the PNG), and that data."""

    kind: str  # "curves" | "paired" | "domains"
    path: Path
    data_path: Path
    data: dict[str, Any] = field(default_factory=dict)


def write_figure(fig: Any, path: Path, data: dict[str, Any], kind: str, dpi: int = 110) -> FigureInfo:
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    data_path = path.with_suffix(".json")
    data_path.write_text(json.dumps(data, indent=1, sort_keys=True))
    return FigureInfo(kind, path, data_path, data)


def host_of(label: str) -> str:
    """The host of a row: its method as typed up to the first ``+`` (``fedprox+heal (mu=0.1)`` -> ``fedprox``)."""
    return label.split(" ", 1)[0].split("+", 1)[0]


def host_groups(labels: list[str], most: int | None = 8) -> list[tuple[str, list[int]]]:
    """Row indices grouped by host (a host and its ``+plugin`` rows), hosts in the order they first appear, a host's
    own rows first and then its plug-ins in their order; hosts with a single row are gathered at the end ("other
    rows", or "rows" when no host has several). A group longer than ``most`` is split evenly."""
    by: dict[str, list[int]] = {}
    for i, lab in enumerate(labels):
        by.setdefault(host_of(lab), []).append(i)
    plain = [(h, idx) for h, idx in by.items() if len(idx) > 1]
    single = [idx[0] for idx in by.values() if len(idx) == 1]
    groups: list[tuple[str, list[int]]] = []
    for host, idx in [*plain, ("other rows" if plain else "rows", single)]:
        if not idx:
            continue
        idx = sorted(idx, key=lambda i: "+" in labels[i].split(" ", 1)[0])  # stable: the host's own rows first
        parts = 1 if most is None else math.ceil(len(idx) / most)
        size = math.ceil(len(idx) / parts)
        for p in range(parts):
            name = host if parts == 1 else f"{host} ({p + 1}/{parts})"
            groups.append((name, idx[p * size : (p + 1) * size]))
    return groups


def axes_style(ax: Any, xs: list[float]) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.tick_params(labelsize=FONT)
    ax.grid(alpha=0.3)
    single_x(ax, xs)


METRIC_LABELS = {
    "global_acc": "global model, global test set",
    "global_local_acc": "global model, clients' test splits (sample-weighted)",
    "global_local_acc_mean": "global model, clients' test splits (mean over clients)",
    "personal_acc": "personalized models (sample-weighted)",
    "personal_acc_mean": "personalized models (mean over clients)",
    "trained_acc": "personal models after training (sample-weighted)",
    "domain_acc_avg": "global model, mean over domains (AVG)",
    "domain_acc_std": "std of accuracy across domains (STD)",
}


def metric_label(metric: str) -> str:
    if metric.startswith("domain_acc/"):
        return f"global model, domain {metric.split('/', 1)[1]}"
    return METRIC_LABELS.get(metric, metric)
