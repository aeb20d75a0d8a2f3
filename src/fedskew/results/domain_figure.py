"""The per-domain figure of a domain-skew report: a table drawn as a heatmap, methods (grouped by host) × the domains,
AVG and STD, each cell its mean ± std over seeds, shaded within its column (darker is better)."""

from __future__ import annotations

from typing import Any

import numpy as np

from fedskew.results.plotting import FONT, PAGE_WIDTH, TITLE_FONT, host_groups, line_count, text_width, wrap


def domain_table_figure(
    exps: list[Any], labels: list[str], records: dict[str, list[dict[str, Any]]], last_n: int | None, title: str
) -> tuple[Any, dict[str, Any]] | None:
    """A table as a heatmap: a row per experiment (grouped by host: a host, then its plug-ins), a column per domain
    (mean ± std over seeds of the last-N mean accuracy on that domain's test split), then the experiment's AVG and
    STD across domains; the numbers printed in the cells, each cell shaded by where it lies between its column's
    worst and best (darker: better, i.e. higher accuracy, lower STD), the column's best in bold. Its JSON lists the
    rows top to bottom."""
    import matplotlib.pyplot as plt

    from fedskew.results.report import stat_from_records, stat_from_summary

    domains = list(
        dict.fromkeys(
            k.split("/", 1)[1] for e in exps for r in e.latest for k in r["summary"] if k.startswith("domain_acc/")
        )
    )
    if not domains:
        return None

    def pm(runs: list[dict[str, Any]], metric: str) -> tuple[float | None, float | None]:
        stats = [
            stat_from_records(records.get(r["run_id"], []), metric, last_n)
            if last_n
            else stat_from_summary(r["summary"], metric)
            for r in runs
        ]
        vals = np.array([100.0 * s.last for s in stats if s is not None])
        if not len(vals):
            return None, None
        return float(vals.mean()), (float(vals.std()) if len(vals) > 1 else None)

    groups = []
    for lab, e in zip(labels, exps, strict=True):
        per = {d: pm(e.latest, f"domain_acc/{d}") for d in domains}
        avg, std = pm(e.latest, "domain_acc_avg"), pm(e.latest, "domain_acc_std")
        groups.append({"label": lab, "seeds": [r["seed"] for r in e.latest], "domains": per, "AVG": avg, "STD": std})
    hosts = host_groups(labels, most=None)
    groups = [groups[i] for _, idx in hosts for i in idx]
    cols = [*domains, "AVG", "STD"]
    cells = [[*(g["domains"][d] for d in domains), g["AVG"], g["STD"]] for g in groups]

    rows = [wrap(g["label"], 3.0) for g in groups]
    lab_w = min(3.1, max(text_width(t) for t in rows) + 0.15)
    cell_w = min(1.0, (PAGE_WIDTH - lab_w - 0.3) / len(cols))
    one_line = cell_w >= 0.8  # "88.5±0.4" in bold at 8 pt, with some room
    heads = [wrap(c, cell_w - 0.05) for c in [*domains, "AVG ↑", "STD ↓"]]
    width = min(PAGE_WIDTH, max(5.0, lab_w + len(cols) * cell_w + 0.3))
    n = f"last {last_n}" if last_n else "last-N"
    head = wrap(
        f"{title}\nper-domain accuracy (%) of the global model, mean of the {n} rounds, mean ± std over seeds; "
        "AVG ↑ and STD ↓ across domains. Shade: within each column, darker is better; bold: the column's best",
        width - 0.2,
        TITLE_FONT,
    )
    row_h = 0.13 * max(max(line_count(t) for t in rows), 1 if one_line else 2) + 0.1
    height = 0.17 * line_count(head) + 0.2 + 0.17 * max(line_count(h) for h in heads) + 0.15 + len(groups) * row_h + 0.1
    fig = plt.figure(figsize=(width, height), layout="constrained")
    ax = fig.add_subplot()
    cmap = plt.get_cmap("Blues")
    rgba = np.ones((len(groups), len(cols), 4))
    best: list[float | None] = []
    for c, col in enumerate(cols):
        vals = [row[c][0] for row in cells if row[c][0] is not None]
        lo, hi = (min(vals), max(vals)) if vals else (0.0, 0.0)
        best.append(None if not vals else (lo if col == "STD" else hi))
        for r, row in enumerate(cells):
            v = row[c][0]
            if v is None:
                rgba[r, c] = (0.93, 0.93, 0.93, 1.0)
                continue
            t = 0.5 if hi == lo else (v - lo) / (hi - lo)
            rgba[r, c] = cmap(0.08 + 0.62 * (1.0 - t if col == "STD" else t))
    ax.imshow(rgba, aspect="auto", interpolation="nearest")
    for r, row in enumerate(cells):
        for c, (mean, sd) in enumerate(row):
            if mean is None:
                ax.text(c, r, "-", ha="center", va="center", fontsize=FONT, color="0.4")
                continue
            text = f"{mean:.1f}" + ("" if sd is None else ("±" if one_line else "\n±") + f"{sd:.1f}")
            lum = 0.299 * rgba[r, c, 0] + 0.587 * rgba[r, c, 1] + 0.114 * rgba[r, c, 2]
            bold = best[c] is not None and abs(mean - best[c]) < 1e-9
            ax.text(
                c,
                r,
                text,
                ha="center",
                va="center",
                fontsize=FONT,
                linespacing=1.0,
                color="white" if lum < 0.5 else "black",
                fontweight="bold" if bold else "normal",
            )
    ax.set_xticks(np.arange(len(cols) + 1) - 0.5, minor=True)
    ax.set_yticks(np.arange(len(groups) + 1) - 0.5, minor=True)
    ax.grid(which="minor", color="white", lw=1.0)
    ax.tick_params(which="both", length=0, labelsize=FONT)
    ax.xaxis.tick_top()
    ax.set_xticks(range(len(cols)), heads, fontsize=FONT)
    ax.set_yticks(range(len(groups)), rows, fontsize=FONT)
    ax.axvline(len(domains) - 0.5, color="0.2", lw=1.2)
    if len(hosts) > 1:
        for b in np.cumsum([len(idx) for _, idx in hosts])[:-1]:
            ax.axhline(b - 0.5, color="0.2", lw=1.0)
    for spine in ax.spines.values():
        spine.set_visible(False)
    fig.suptitle(head, fontsize=TITLE_FONT)
    return fig, {"domains": domains, "groups": groups, "last_n": last_n, "columns": cols}
