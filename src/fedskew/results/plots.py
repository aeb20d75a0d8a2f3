"""Figures (matplotlib, Agg backend: works headless): parameter skew of a run (``fedskew skew``), and the accuracy
curves, paired differences against the reference row and per-domain bars of ``fedskew report --plot`` (each PNG
with a JSON of the plotted numbers next to it)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fedskew.config import SETTING_KEYS


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


# ---- report figures: accuracy curves per setting, per-domain bars ------------------------------------------------
# which setting keys a partition uses (the others are not shown in a figure's title)
_PARTITION_KEYS = {
    "dir": ("alpha", "min_size"),
    "pat": ("classes_per_client", "pat_scheme"),
    "dirfixed": ("alpha", "samples_per_client"),
    "quantity": ("alpha",),
    "domain": ("domain_fraction", "image_size"),
}
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


@dataclass
class Series:
    """One curve: an experiment's metric per round, mean and std (population, ddof=0) over its seeds, in %.
    ``std`` is None at a round only one seed reached; ``n`` is how many seeds each round has."""

    label: str
    rounds: list[int]
    mean: list[float]
    std: list[float | None]
    n: list[int]
    seeds: list[int]


@dataclass
class FigureInfo:
    """A written figure: the PNG, the JSON of everything drawn in it (next to the PNG), and that data."""

    kind: str  # "curves" | "paired" | "domains"
    path: Path
    data_path: Path
    data: dict[str, Any] = field(default_factory=dict)


def _setting(ident: dict[str, Any]) -> dict[str, Any]:
    return {k: ident.get(k) for k in SETTING_KEYS}


def _setting_title(s: dict[str, Any]) -> str:
    part = s.get("partition")
    params = ", ".join(f"{k}={_fmt(s.get(k))}" for k in _PARTITION_KEYS.get(str(part), ()) if s.get(k) is not None)
    text = f"{s.get('dataset')}, {part}" + (f" ({params})" if params else "") + f", {s.get('clients')} clients"
    if s.get("join_ratio") not in (None, 1.0):
        text += f", join {s['join_ratio']:g}"
    if s.get("protocol") not in (None, "fedskew"):
        text += f", protocol {s['protocol']}"
    return text


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, dict | list):
        return json.dumps(v, sort_keys=True)
    return str(v)


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
        text = e.name + (f" ({', '.join(f'{k}={_fmt(args[k])}' for k in sorted(shown))})" if shown else "")
        text += "".join(f" {k}={_fmt(e.identity.get(k))}" for k in differ)
        labels.append(text)
    return labels


def _series(label: str, runs: list[dict[str, Any]], records: dict[str, list[dict[str, Any]]], metric: str) -> Series:
    per_round: dict[int, list[float]] = {}
    for r in runs:
        for rec in records.get(r["run_id"], []):
            if rec.get("evaluated", True) and isinstance(rec.get(metric), int | float):
                per_round.setdefault(int(rec["round"]), []).append(100.0 * float(rec[metric]))
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


def _write(fig: Any, path: Path, data: dict[str, Any], kind: str) -> FigureInfo:
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    data_path = path.with_suffix(".json")
    data_path.write_text(json.dumps(data, indent=1, sort_keys=True))
    return FigureInfo(kind, path, data_path, data)


def _style(i: int, n: int) -> dict[str, Any]:
    """Colour and line style of series ``i`` of ``n``: 10 colours, then the same colours dashed, dotted, ..."""
    import matplotlib.pyplot as plt

    colors = plt.get_cmap("tab10").colors
    return {"color": colors[i % 10], "linestyle": ("-", "--", ":", "-.")[(i // 10) % 4]}


def _legend_columns(n: int) -> int:
    return 1 if n <= 16 else 2 if n <= 40 else 3


def _curves(panels: list[tuple[str, list[Series]]], title: str) -> Any:
    """One panel per metric, one line per experiment with a ± std band, one legend beside the panels."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    labels = list(dict.fromkeys(s.label for _, ss in panels for s in ss))
    ncol = _legend_columns(len(labels))
    width = 5.6 * len(panels) + 2.8 * ncol
    fig, axes = plt.subplots(1, len(panels), figsize=(width, max(4.2, 0.2 * len(labels) / ncol + 1.5)), squeeze=False)
    handles: dict[str, Any] = {}
    for ax, (metric, series) in zip(axes[0], panels, strict=True):
        for s in series:
            style = _style(labels.index(s.label), len(labels))
            seeds = f"{len(s.seeds)} seed{'s' if len(s.seeds) != 1 else ''}"
            (line,) = ax.plot(s.rounds, s.mean, lw=1.5, label=f"{s.label} ({seeds})", **style)
            handles.setdefault(s.label, line)
            if any(d is not None for d in s.std):
                lo = [m - (d or 0.0) for m, d in zip(s.mean, s.std, strict=True)]
                hi = [m + (d or 0.0) for m, d in zip(s.mean, s.std, strict=True)]
                ax.fill_between(s.rounds, lo, hi, color=style["color"], alpha=0.15, lw=0)
        ax.set_xlabel("communication round")
        ax.set_ylabel(f"accuracy (%)\n{metric_label(metric)}", fontsize=8)
        ax.set_title(metric, fontsize=9)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    fig.suptitle(f"{title}: mean ± std over seeds (band)", fontsize=10)
    fig.legend(
        list(handles.values()),
        [h.get_label() for h in handles.values()],
        loc="center left",
        bbox_to_anchor=(1.0 - 2.8 * ncol / width, 0.5),
        fontsize=7,
        ncol=ncol,
        frameon=False,
    )
    fig.tight_layout(rect=(0, 0, 1.0 - 2.8 * ncol / width, 1))
    return fig


def accuracy_figures(
    runs: list[dict[str, Any]],
    records: dict[str, list[dict[str, Any]]],
    out_dir: str | Path,
    metrics: list[str] | tuple[str, ...] = ("global_acc",),
    *,
    last_n: int | None = None,
    against: str | None = None,
) -> list[FigureInfo]:
    """The figures of ``fedskew report --plot``: per setting (:data:`SETTING_KEYS`) one PNG of accuracy vs round,
    one panel per metric, one curve per experiment (the report's rows) with a band of ± one std over its seeds;
    where some row has a paired interval against its reference (the report's, ``against`` as there), one PNG of
    those differences (last-N mean) with their 95% interval bars; and for domain-skew settings one bar chart of
    per-domain accuracy (mean of the last N evaluated rounds, mean ± std over seeds) with every experiment's AVG
    and STD in its legend entry. ``runs`` are database rows (:meth:`ResultsDB.runs`), ``records`` each run's round
    records. Every PNG has a JSON next to it holding the plotted numbers."""
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
        diffs = _difference_figure(exps, labels, mine, records, metrics, last_n, title)
        if diffs is not None:
            fig, data = diffs
            data.update(setting=setting, title=title)
            figures.append(_write(fig, out / f"paired-{_slug(setting)}.png", data, "paired"))
        panels = []
        for metric in metrics:
            series = [_series(lab, e.latest, records, metric) for lab, e in zip(labels, exps, strict=True)]
            if any(s.rounds for s in series):
                panels.append((metric, [s for s in series if s.rounds]))
        if panels:
            fig = _curves(panels, title)
            data = {
                "setting": setting,
                "title": title,
                "panels": [{"metric": m, "series": [s.__dict__ for s in ss]} for m, ss in panels],
            }
            figures.append(_write(fig, out / f"curves-{_slug(setting)}.png", data, "curves"))
        bars = _domain_bars(exps, labels, records, last_n, title)
        if bars is not None:
            fig, data = bars
            data.update(setting=setting, title=title)
            figures.append(_write(fig, out / f"domains-{_slug(setting)}.png", data, "domains"))
    return figures


def _difference_figure(
    exps: list[Any],
    labels: list[str],
    refs: list[int | None],
    records: dict[str, list[dict[str, Any]]],
    metrics: list[str] | tuple[str, ...],
    last_n: int | None,
    title: str,
) -> tuple[Any, dict[str, Any]] | None:
    """One panel per metric: per row compared with its reference, the mean paired difference of the last-N mean
    accuracy (points) with its 95% interval as a bar (filled marker: the interval excludes 0), and a line at 0.
    None when no row has an interval (fewer than two common seeds everywhere)."""
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
    height = max(2.8, 0.45 * max(len(p["rows"]) for p in panels) + 1.8)
    fig, axes = plt.subplots(1, len(panels), figsize=(7.2 * len(panels), height), squeeze=False)
    for ax, panel in zip(axes[0], panels, strict=True):
        rows = panel["rows"]
        y = np.arange(len(rows))[::-1]
        for yi, r in zip(y, rows, strict=True):
            color = "tab:red" if r["significant"] else "0.35"
            ax.errorbar(
                r["mean"],
                yi,
                xerr=[[r["mean"] - r["lo"]], [r["hi"] - r["mean"]]],
                fmt="o",
                color=color,
                mfc=color if r["significant"] else "white",
                capsize=3,
            )
        ax.axvline(0.0, color="0.2", lw=0.8, ls="--")
        ax.set_yticks(y, [f"{r['label']}\nvs {r['reference']} (n={r['n']}, {r['method']})" for r in rows], fontsize=7)
        n = f"last {last_n}" if last_n else "last-N"
        ax.set_xlabel(f"paired difference (points), {n} mean\n{metric_label(panel['metric'])}", fontsize=8)
        ax.set_title(panel["metric"], fontsize=9)
        ax.grid(axis="x", alpha=0.3)
    fig.suptitle(f"{title}\npaired difference vs reference, 95% interval (filled: excludes 0)", fontsize=9)
    fig.tight_layout()
    return fig, {"panels": panels, "statistic": "last_n_mean", "last_n": last_n}


def _domain_bars(
    exps: list[Any], labels: list[str], records: dict[str, list[dict[str, Any]]], last_n: int | None, title: str
) -> tuple[Any, dict[str, Any]] | None:
    """Per experiment (x axis) one bar per domain, mean ± std over seeds of the last-N mean accuracy, with the
    experiment's AVG and STD across domains written above its bars."""
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

    def show(p: tuple[float | None, float | None]) -> str:
        return "-" if p[0] is None else f"{p[0]:.1f}" + (f"±{p[1]:.1f}" if p[1] is not None else "")

    groups = []
    for lab, e in zip(labels, exps, strict=True):
        per = {d: pm(e.latest, f"domain_acc/{d}") for d in domains}
        avg, std = pm(e.latest, "domain_acc_avg"), pm(e.latest, "domain_acc_std")
        groups.append({"label": lab, "seeds": [r["seed"] for r in e.latest], "domains": per, "AVG": avg, "STD": std})
    width = min(30.0, max(6.4, 1.5 + 0.28 * len(groups) * (len(domains) + 1)))
    fig, ax = plt.subplots(figsize=(width, 5.2))
    bar = 0.8 / len(domains)
    x = np.arange(len(groups))
    colors = plt.get_cmap("tab10").colors
    for k, d in enumerate(domains):
        means = [g["domains"][d][0] if g["domains"][d][0] is not None else np.nan for g in groups]
        errs = [g["domains"][d][1] or 0.0 for g in groups]
        ax.bar(x + (k - (len(domains) - 1) / 2) * bar, means, bar, yerr=errs, capsize=2, color=colors[k % 10], label=d)
    for i, g in enumerate(groups):
        ax.text(i, 101, f"AVG {show(g['AVG'])}\nSTD {show(g['STD'])}", ha="center", va="bottom", fontsize=6)
    ax.set_xticks(x, [g["label"] for g in groups], rotation=35 if len(groups) > 3 else 0, ha="right", fontsize=7)
    n = f"last {last_n}" if last_n else "last-N"
    ax.set_ylabel(f"accuracy (%), mean of the {n} rounds")
    ax.set_ylim(0, 112)
    ax.set_yticks(range(0, 101, 20))
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7, title="domain (its test split)", title_fontsize=7, loc="upper left", bbox_to_anchor=(1, 1))
    ax.set_title(f"{title}: per-domain accuracy (bars: mean ± std over seeds; AVG ↑, STD ↓ across domains)", fontsize=9)
    fig.tight_layout()
    return fig, {"domains": domains, "groups": groups, "last_n": last_n}


def report_figures(
    db: Any, out_dir: str | Path, metrics: list[str], *, last_n: int | None = None, against: str | None = None
) -> list[FigureInfo]:
    """:func:`accuracy_figures` over every run of a :class:`fedskew.results.store.ResultsDB` (round records from its
    ``rounds`` table)."""
    from fedskew.results.report import round_records

    runs = db.runs()
    records = round_records(db.conn, [r["run_id"] for r in runs])
    return accuracy_figures(runs, records, out_dir, metrics, last_n=last_n, against=against)
