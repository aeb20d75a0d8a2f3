"""What a partition looks like: a per-client label table and a bubble plot (clients × classes, area = samples)."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def label_table(train_hists: np.ndarray, test_hists: np.ndarray | None = None) -> str:
    """Markdown table, one row per client: train/test sizes and the per-class training counts, then totals."""
    train = np.asarray(train_hists, dtype=np.int64)
    test = np.zeros_like(train) if test_hists is None else np.asarray(test_hists, dtype=np.int64)
    n, c = train.shape
    sizes = train.sum(1) + test.sum(1)
    present = (train > 0).sum(1)  # the partition's label skew: a client's test share may hold every class
    head = (
        f"{n} clients, {c} classes; client size min {sizes.min()}, median {int(np.median(sizes))}, "
        f"max {sizes.max()} (train + test); training classes per client mean {present.mean():.2f}\n"
        f"c0..c{c - 1}: training samples per class\n\n"
    )
    cols = ["client", "n_train", "n_test", *[f"c{j}" for j in range(c)]]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for i in range(n):
        cells = [str(i), str(train[i].sum()), str(test[i].sum()), *map(str, train[i])]
        lines.append("| " + " | ".join(cells) + " |")
    total = ["total", str(train.sum()), str(test.sum()), *map(str, train.sum(0))]
    lines.append("| " + " | ".join(total) + " |")
    return head + "\n".join(lines)


def bubble_plot(hists: np.ndarray, out_path: str | Path, title: str) -> Path:
    """Clients on x, classes on y, bubble area proportional to the number of samples (the papers' figures)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    h = np.asarray(hists, dtype=np.float64)
    n, c = h.shape
    xs, ys = np.nonzero(h)
    scale = 600.0 / max(h.max(), 1.0)
    fig, ax = plt.subplots(figsize=(max(4.0, 0.35 * n + 1.5), max(3.0, 0.35 * c + 1.2)))
    ax.scatter(xs, ys, s=h[xs, ys] * scale, color="tab:blue", alpha=0.6, edgecolors="k", linewidths=0.3)
    for v in sorted({int(h.max()), int(max(1, h.max() // 4))}):
        ax.scatter([], [], s=v * scale, color="tab:blue", alpha=0.6, edgecolors="k", label=f"{v} samples")
    ax.set_xticks(range(n))
    ax.set_yticks(range(c))
    ax.tick_params(labelsize=7)
    ax.set_xlabel("client")
    ax.set_ylabel("class")
    ax.set_xlim(-0.8, n - 0.2)
    ax.set_ylim(-0.8, c - 0.2)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7, labelspacing=1.5, frameon=False)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
