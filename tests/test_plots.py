"""`fedskew report --plot DIR` (issue 16): one accuracy-vs-round figure per setting with a mean ± std band per report
row, and per-domain bars with AVG/STD for domain skew; every PNG exists and the numbers drawn in it (its JSON) are
checked by hand."""

import json

import pytest

from fedskew.cli import main
from fedskew.config import make_config
from fedskew.protocol import TIMING_KEYS
from fedskew.results.store import ResultsDB, summarize_run

PNG = b"\x89PNG\r\n\x1a\n"
_N = [0]


def _add(db_path, accs, seed=0, extra=None, **cfg_values):
    """One synthetic run with round records ``accs`` (global_acc per round; ``extra``: more keys per round)."""
    _N[0] += 1
    cfg = make_config(None, {"seed": seed, "db": str(db_path), **cfg_values})
    records = []
    for i, a in enumerate(accs, 1):
        rec = {"round": i, "evaluated": True, "global_acc": a, "bytes_up": 0, "bytes_down": 0}
        rec.update({k: 0.0 for k in TIMING_KEYS})
        rec.update({k: v[i - 1] for k, v in (extra or {}).items()})
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
