"""`fedskew report --plot DIR` (issue 16): one accuracy-vs-round figure per setting with a mean ± std band per report
row, and a per-domain table with AVG/STD for domain skew; every PNG exists and the numbers drawn in it (its JSON) are
checked by hand. Issue 31: no figure is blank while it has data (a marker at each point of a short series), and
every figure fits a page with text of 8 pt or more, from 2 to 40 rows (checked on the figure and the saved PNG)."""

import json

import matplotlib
import matplotlib.colors
import matplotlib.image
import matplotlib.text
import numpy as np
import pytest

from fedskew.cli import main
from fedskew.config import make_config
from fedskew.protocol import TIMING_KEYS
from fedskew.results import plots, plotting
from fedskew.results.store import ResultsDB, summarize_run

PNG = b"\x89PNG\r\n\x1a\n"
_N = [0]


def _add(db_path, accs, seed=0, extra=None, evaluated=None, **cfg_values):
    """One synthetic run with round records ``accs`` (global_acc per round; ``extra``: more keys per round;
    ``evaluated``: per round whether it was evaluated, a round that was not has no accuracy)."""
    _N[0] += 1
    cfg = make_config(None, {"seed": seed, "db": str(db_path), **cfg_values})
    records = []
    for i, a in enumerate(accs, 1):
        rec = {"round": i, "evaluated": True, "bytes_up": 0, "bytes_down": 0}
        rec.update({k: 0.0 for k in TIMING_KEYS})
        if evaluated is None or evaluated[i - 1]:
            rec.update({"global_acc": a, **{k: v[i - 1] for k, v in (extra or {}).items()}})
        else:
            rec["evaluated"] = False
        records.append(rec)
    summary = summarize_run(records, cfg.last_n)
    run_id = f"p{_N[0]:03d}"
    created = f"2024-01-01T00:00:{_N[0]:02d}"
    summary.update({"run_id": run_id, "seed": seed, "wall_time": 1.0, "created": created, "diverged": False})
    with ResultsDB(db_path) as db:
        db.add_run(run_id, cfg, created, summary, records, [], None)


def _figures(tmp_path, capsys, db, *extra):
    out = tmp_path / "fig"
    assert main(["report", "--db", str(db), "--plot", str(out), *extra]) == 0
    err = capsys.readouterr().err
    pngs = sorted(out.glob("*.png"))
    for p in pngs:
        assert p.read_bytes()[:8] == PNG and p.stat().st_size > 5000
        assert str(p) in err
    return {p.name.split("-")[0] + ":" + p.stem: json.loads(p.with_suffix(".json").read_text()) for p in pngs}


def test_curves_have_one_band_per_row_with_mean_and_std_over_seeds(tmp_path, capsys):
    db = tmp_path / "r.db"
    _add(db, [0.5, 0.6, 0.7], seed=0)
    _add(db, [0.3, 0.6, 0.9], seed=1)
    _add(db, [0.4, 0.5, 0.6], seed=0, method_args={"weights": "uniform"})
    figs = _figures(tmp_path, capsys, db)
    assert len(figs) == 1  # one setting
    (data,) = figs.values()
    assert data["title"].startswith("digits, dir (alpha=0.1, min_size=10), 10 clients")
    (panel,) = data["panels"]
    assert panel["metric"] == "global_acc"
    by_label = {s["label"]: s for s in panel["series"]}
    assert set(by_label) == {"fedavg (weights=samples)", "fedavg (weights=uniform)"}  # the rows, by their args
    two = by_label["fedavg (weights=samples)"]
    assert two["rounds"] == [1, 2, 3] and two["seeds"] == [0, 1] and two["n"] == [2, 2, 2]
    assert two["mean"] == pytest.approx([40.0, 60.0, 80.0])
    assert two["std"] == pytest.approx([10.0, 0.0, 10.0])  # population std over the two seeds
    one = by_label["fedavg (weights=uniform)"]
    assert one["mean"] == pytest.approx([40.0, 50.0, 60.0]) and one["std"] == [None, None, None]


def test_one_figure_per_setting_and_one_panel_per_metric(tmp_path, capsys):
    db = tmp_path / "r.db"
    local = {"global_local_acc": [0.2, 0.4]}
    _add(db, [0.5, 0.6], alpha=0.1, extra=local)
    _add(db, [0.7, 0.8], alpha=0.5, extra=local)
    _add(db, [0.1, 0.2], alpha=0.5, lr=0.01, extra=local)
    figs = _figures(tmp_path, capsys, db, "--metric", "global_acc,global_local_acc")
    assert len(figs) == 2
    datas = sorted(figs.values(), key=lambda d: d["setting"]["alpha"])
    assert [d["setting"]["alpha"] for d in datas] == [0.1, 0.5]
    assert [p["metric"] for p in datas[1]["panels"]] == ["global_acc", "global_local_acc"]
    labels = [s["label"] for s in datas[1]["panels"][0]["series"]]
    assert labels == ["fedavg lr=0.05", "fedavg lr=0.01"]  # lr tells the two rows of that setting apart
    assert datas[1]["panels"][1]["series"][0]["mean"] == pytest.approx([20.0, 40.0])


def test_domain_skew_gets_per_domain_bars_with_avg_and_std(tmp_path, capsys):
    db = tmp_path / "r.db"
    dom = {"dataset": "digits_domains", "partition": "domain", "clients": 6, "last_n": 2}

    def extra(a, b):  # per-domain accuracies per round; AVG and sample STD as the engine records them
        avg = [(x + y) / 2 for x, y in zip(a, b, strict=True)]
        std = [abs(x - y) / 2**0.5 for x, y in zip(a, b, strict=True)]
        return {"domain_acc/a": a, "domain_acc/b": b, "domain_acc_avg": avg, "domain_acc_std": std}

    _add(db, [0.5, 0.5, 0.5], seed=0, extra=extra([0.9, 0.8, 0.6], [0.1, 0.2, 0.4]), **dom)
    _add(db, [0.5, 0.5, 0.5], seed=1, extra=extra([0.7, 0.8, 0.8], [0.3, 0.4, 0.4]), **dom)
    figs = _figures(tmp_path, capsys, db, "--metric", "domain_acc_avg")
    kinds = sorted(k.split(":")[0] for k in figs)
    assert kinds == ["curves", "domains"]
    bars = next(v for k, v in figs.items() if k.startswith("domains"))
    assert bars["domains"] == ["a", "b"]
    (g,) = bars["groups"]
    # last 2 rounds: seed 0 a = 0.7, b = 0.3; seed 1 a = 0.8, b = 0.4 -> mean 75 ± 5 and 35 ± 5
    assert g["domains"]["a"] == pytest.approx([75.0, 5.0]) and g["domains"]["b"] == pytest.approx([35.0, 5.0])
    assert g["AVG"] == pytest.approx([55.0, 5.0])  # per seed 50 and 60
    # STD per seed: mean over the last 2 rounds of |a - b| / sqrt(2)
    s0, s1 = (0.6 / 2**0.5 + 0.2 / 2**0.5) / 2, (0.4 / 2**0.5 + 0.4 / 2**0.5) / 2
    assert g["STD"] == pytest.approx([100 * (s0 + s1) / 2, 100 * abs(s0 - s1) / 2])


def test_recomputed_last_n_is_used_for_the_bars(tmp_path, capsys):
    db = tmp_path / "r.db"
    dom = {"dataset": "digits_domains", "partition": "domain", "clients": 6}
    ex = {"domain_acc/a": [0.2, 0.4, 0.6], "domain_acc/b": [0.2, 0.2, 0.2]}
    ex.update(domain_acc_avg=[0.2, 0.3, 0.4], domain_acc_std=[0.0, 0.1, 0.2])
    _add(db, [0.5, 0.5, 0.5], extra=ex, **dom)
    figs = _figures(tmp_path, capsys, db, "--last-n", "1")
    bars = next(v for k, v in figs.items() if k.startswith("domains"))
    assert bars["last_n"] == 1 and bars["groups"][0]["domains"]["a"] == pytest.approx([60.0, None])


def test_paired_differences_are_drawn_with_their_interval_bars(tmp_path, capsys):
    """Issue 23: a figure of each row's paired difference against its reference, with its 95% interval."""
    db = tmp_path / "r.db"
    for seed, b in enumerate((0.60, 0.66, 0.55, 0.70)):
        _add(db, [b], seed=seed)
        _add(db, [b + (0.020, 0.021, 0.019, 0.020)[seed]], seed=seed, method="fedprox")
        _add(db, [b + (0.01, -0.01, 0.01, -0.01)[seed]], seed=seed, method="scaffold")
    figs = _figures(tmp_path, capsys, db)
    assert sorted(k.split(":")[0] for k in figs) == ["curves", "paired"]
    data = next(v for k, v in figs.items() if k.startswith("paired"))
    (panel,) = data["panels"]
    rows = {r["label"]: r for r in panel["rows"]}
    assert set(rows) == {"fedprox", "scaffold"} and {r["reference"] for r in rows.values()} == {"fedavg"}
    p, s = rows["fedprox"], rows["scaffold"]
    assert p["mean"] == pytest.approx(2.0) and p["hi"] - p["mean"] == pytest.approx(0.1299, abs=1e-4)
    assert p["significant"] and p["method"] == "paired t" and p["n"] == 4 and p["seeds"] == [0, 1, 2, 3]
    assert s["mean"] == pytest.approx(0.0, abs=1e-9) and s["hi"] == pytest.approx(1.8374, abs=1e-4)
    assert not s["significant"]
    # --against moves the reference
    out = tmp_path / "fig2"
    assert main(["report", "--db", str(db), "--plot", str(out), "--against", "scaffold"]) == 0
    (paired,) = out.glob("paired-*.json")
    assert {r["reference"] for r in json.loads(paired.read_text())["panels"][0]["rows"]} == {"scaffold"}


# ---- issue 31: readable figures ------------------------------------------------------------------------------------
MAX_PX = plots.PAGE_WIDTH * plots.DPI  # 1125 px: 7.5 in at 150 dpi


def _capture(monkeypatch):
    """Every figure written by the report figures: (kind, the matplotlib figure, its PNG path)."""
    seen = []
    write = plotting.write_figure

    def spy(fig, path, data, kind, dpi=110):
        info = write(fig, path, data, kind, dpi)  # draws and saves it: tick labels and the layout exist after
        seen.append((kind, fig, path))
        return info

    monkeypatch.setattr(plotting, "write_figure", spy)
    return seen


def _texts(fig):
    return [t for t in fig.findobj(matplotlib.text.Text) if t.get_visible() and t.get_text().strip()]


def _assert_readable(fig, png):
    """The figure fits a page (its saved width too), and no text in it is under 8 pt."""
    from PIL import Image

    width, height = Image.open(png).size
    assert fig.get_size_inches()[0] <= plots.PAGE_WIDTH + 1e-9 and width <= MAX_PX
    small = [(t.get_text()[:30], t.get_fontsize()) for t in _texts(fig) if t.get_fontsize() < 8]
    assert not small
    return width, height


def _axes_pixels(fig, png, ax):
    """The saved pixels (RGB, 0..1) inside ``ax``, a two-pixel margin off its frame."""
    img = matplotlib.image.imread(png)[..., :3]
    scale = img.shape[1] / (fig.get_size_inches()[0] * fig.dpi)
    bb = ax.get_window_extent()
    y0, y1 = img.shape[0] - int(bb.y1 * scale) + 2, img.shape[0] - int(bb.y0 * scale) - 2
    return img[y0:y1, int(bb.x0 * scale) + 2 : int(bb.x1 * scale) - 2]


def _assert_drawn(fig, png):
    """Every axes with a frame has something in it: more than one colour, and colour beyond the grey of a grid."""
    for ax in fig.axes:
        if not ax.axison:
            continue
        px = _axes_pixels(fig, png, ax)
        assert px.size and px.reshape(-1, 3).std(0).max() > 0.02
        coloured = (px.max(-1) - px.min(-1) > 0.15) | (px.max(-1) < 0.5)  # a hue, or dark: marks, not a light grid
        assert coloured.sum() >= 10


def test_one_point_series_are_drawn_with_a_marker(tmp_path, capsys, monkeypatch):
    """A run evaluated once (`--eval-every` >= rounds, a smoke reproduction) draws a marker, not an empty axes."""
    db = tmp_path / "r.db"
    for seed in (0, 1):
        _add(db, [0.1, 0.5 + 0.1 * seed], seed=seed, evaluated=[False, True])
        _add(db, [0.1, 0.6 + 0.1 * seed], seed=seed, evaluated=[False, True], method="fedprox")
    seen = _capture(monkeypatch)
    figs = _figures(tmp_path, capsys, db)
    data = next(v for k, v in figs.items() if k.startswith("curves"))
    series = data["panels"][0]["series"]
    assert [s["rounds"] for s in series] == [[2], [2]] and series[0]["mean"] == pytest.approx([55.0])
    (fig, png) = next((f, p) for k, f, p in seen if k == "curves")
    (ax,) = [a for a in fig.axes if a.axison]
    lines = [ln for ln in ax.get_lines() if not ln.get_label().startswith("_")]
    assert len(lines) == 2
    for ln in lines:
        assert ln.get_marker() not in (None, "None", "", " ") and ln.get_markersize() >= 4
        (x,) = ln.get_xdata()
        assert x == pytest.approx(2, abs=0.25)  # dodged a little: the two markers do not hide each other
    assert ax.get_xlim() == pytest.approx((1.0, 3.0))  # not 1.9..2.1
    _assert_readable(fig, png)
    px = _axes_pixels(fig, png, ax)
    for ln in lines:  # the marker's colour is in the PNG, inside the axes
        rgb = np.array(matplotlib.colors.to_rgb(ln.get_color()))
        assert (np.abs(px - rgb).max(-1) < 0.08).sum() >= 10


def test_long_series_have_no_markers_and_a_metric_without_values_is_named(tmp_path, capsys, monkeypatch):
    db = tmp_path / "r.db"
    _add(db, [0.5 + 0.01 * i for i in range(25)])
    _add(db, [0.4, 0.5, 0.6], method="fedprox")
    seen = _capture(monkeypatch)
    figs = _figures(tmp_path, capsys, db, "--metric", "global_acc,personal_acc")
    (data,) = figs.values()
    assert data["empty_metrics"] == ["personal_acc"] and [p["metric"] for p in data["panels"]] == ["global_acc"]
    ((_, fig, png),) = seen
    assert "no evaluated value of personal_acc" in fig.get_suptitle()
    (ax,) = [a for a in fig.axes if a.axison]
    markers = {ln.get_label(): ln.get_marker() for ln in ax.get_lines() if not ln.get_label().startswith("_")}
    assert markers["fedavg"] in (None, "None", "") and markers["fedprox"] not in (None, "None", "")
    _assert_readable(fig, png)
    _assert_drawn(fig, png)


def test_a_setting_without_any_value_writes_no_curves(tmp_path, capsys):
    """All series empty: nothing to draw, so no PNG (documented in docs/sweeps.md); the table shows the columns."""
    db = tmp_path / "r.db"
    _add(db, [0.5, 0.6])
    assert _figures(tmp_path, capsys, db, "--metric", "personal_acc") == {}


def _domain_runs(db, hosts, plugins, seeds=(0, 1)):
    """Rows ``host`` and ``host+plugin`` (``plugins``: (suffix, method_args)) with 3 domains and 3 rounds, over
    ``seeds``; their accuracies differ per row."""
    k = 0
    for host in hosts:
        for plugin, args in (("", None), *plugins):
            k += 1
            for seed in seeds:
                a = [0.5 + 0.004 * k + 0.01 * seed + 0.05 * t for t in range(3)]
                ex = {"domain_acc/mnist": a, "domain_acc/svhn": [x - 0.3 for x in a], "domain_acc/usps": a}
                ex["domain_acc_avg"] = [x - 0.1 for x in a]
                ex["domain_acc_std"] = [0.14] * 3
                cfg = {"dataset": "digits_domains", "partition": "domain", "clients": 6, "method_args": args}
                _add(db, a, seed=seed, extra=ex, method=host + plugin, **cfg)
    return k


def test_forty_and_two_rows_fit_a_page_and_are_readable(tmp_path, capsys, monkeypatch):
    """The per-domain table (a heatmap), the paired differences and the curves (small multiples by host) of a
    40-row FedHEAL-like table fit 7.5 in, have no text under 8 pt, grow in height with the rows, and are not blank;
    the same for two rows."""
    sizes = {}
    for n, hosts, plugins in (
        (
            40,
            ["fedavg", "fedprox", "scaffold", "moon", "feddyn", "fedproc", "fedproto", "ditto"],
            [("+heal", None), ("+afl", None), ("+qffl", None), ("+afl", {"step": 0.05})],
        ),
        (2, ["fedavg", "fedprox"], []),
    ):
        db = tmp_path / f"d{n}.db"
        assert _domain_runs(db, hosts, plugins) == n
        seen = _capture(monkeypatch)
        out = tmp_path / f"fig{n}"
        assert main(["report", "--db", str(db), "--plot", str(out), "--metric", "domain_acc_avg"]) == 0
        capsys.readouterr()
        kinds = sorted(k for k, _, _ in seen)
        assert kinds == ["curves", "domains", "paired"]
        for kind, fig, png in seen:
            sizes[n, kind] = _assert_readable(fig, png)
            _assert_drawn(fig, png)
        bars = json.loads(next(out.glob("domains-*.json")).read_text())
        assert len(bars["groups"]) == n and bars["columns"] == ["mnist", "svhn", "usps", "AVG", "STD"]
        curves = json.loads(next(out.glob("curves-*.json")).read_text())
        if n == 40:
            labels = [g["label"] for g in bars["groups"]]
            blocks = [labels[i : i + 5] for i in range(0, 40, 5)]
            for block in blocks:  # each host's 5 rows together, the host's own row first, then its plug-ins
                host = block[0]
                assert "+" not in host and all(lab.startswith(host + "+") for lab in block[1:])
            assert len({b[0] for b in blocks}) == 8
            assert curves["layout"] == "one panel per host and its plug-ins" and len(curves["groups"]) == 8
            (fig,) = [f for k, f, _ in seen if k == "domains"]
            cells = [t for t in fig.axes[0].texts if "±" in t.get_text()]
            assert len(cells) == 40 * 5  # every number printed in its cell
        else:
            assert curves["layout"] == "one panel per metric"
    for kind in ("domains", "paired"):
        assert sizes[40, kind][1] > 3 * sizes[2, kind][1]  # the height grows with the rows
        assert sizes[40, kind][1] < 40 * 0.5 * plots.DPI  # ... by less than half an inch a row


def test_skew_figure_fits_a_page_and_shows_a_single_probe(tmp_path, monkeypatch):
    """`fedskew skew` of a run probed once: the rounds panels show markers, the figure fits a page."""
    import matplotlib.pyplot as plt

    rng = np.random.default_rng(0)
    layers = {}
    for k, name in enumerate(("body.0.weight", "body.0.bias", "head.weight")):
        clients = rng.normal(size=(3, 8)).tolist()
        layers[name] = {
            "positions": [4, 9, 17],
            "cv": [2.0, 0.5, 1.0],
            "high": [True, False, True],
            "M": 100,
            "high_frac": 0.02 * 10**-k,
            "skew_mean_abs": 0.3 + 0.2 * k,
            "clients": clients,
            "mean": [float(np.mean(c)) for c in clients],
            "weighted_mean": [float(np.mean(c)) for c in clients],
            "aggregate": [float(np.median(c)) for c in clients],
        }
    run = tmp_path / "run"
    run.mkdir()
    (run / "skew.jsonl").write_text(json.dumps({"round": 3, "layers": layers}) + "\n")
    closed = []
    monkeypatch.setattr(plt, "close", closed.append)
    summary = plots.skew_figure(run, run / "skew.png")
    assert summary["rounds"] == [3]
    (fig,) = closed
    _assert_readable(fig, run / "skew.png")
    rounds_axes = [a for a in fig.axes if a.get_xlabel() == "round"]
    assert len(rounds_axes) == 2
    for ax in rounds_axes:
        lines = ax.get_lines()
        assert len(lines) == 3 and all(ln.get_marker() not in (None, "None", "") for ln in lines)
    _assert_drawn(fig, run / "skew.png")
    plt.close(fig)
