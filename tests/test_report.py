"""From one run to a paper's table (issue 16): `fedskew report` groups experiments and counts seeds, its formats and
metrics, a closed pipe, the run summary, run-folder names, and the domains a domain-skew run used."""

import csv
import io
import json
import os
import re
import sqlite3
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import _fake_domain

from fedskew.cli import main, print_summary
from fedskew.config import make_config
from fedskew.protocol import TIMING_KEYS
from fedskew.results.store import ResultsDB, default_run_dir, summarize_run

_N = [0]


def _records(accs, local=None):
    recs = []
    for i, a in enumerate(accs, 1):
        r = {"round": i, "evaluated": True, "global_acc": a, "bytes_up": 0, "bytes_down": 0}
        r.update({k: 0.0 for k in TIMING_KEYS})
        if local is not None:
            r["global_local_acc"] = local[i - 1]
        recs.append(r)
    return recs


def _add(db_path, accs, seed=0, *, local=None, diverged_round=None, **cfg_values):
    """Insert one synthetic run (round records ``accs``) into the database, as the runner would."""
    _N[0] += 1
    cfg = make_config(None, {"seed": seed, "db": str(db_path), **cfg_values})
    records = _records(accs, local)
    summary = summarize_run(records, cfg.last_n)
    run_id = f"run{_N[0]:03d}"
    created = f"2024-01-01T00:00:{_N[0]:02d}"
    summary.update(
        {
            "run_id": run_id,
            "seed": seed,
            "wall_time": 1.0,
            "created": created,
            "diverged": diverged_round is not None,
            "diverged_round": diverged_round,
        }
    )
    with ResultsDB(db_path) as db:
        db.add_run(run_id, cfg, created, summary, records, [], None)
    return run_id


def _report(capsys, db, *extra):
    capsys.readouterr()
    assert main(["report", "--db", str(db), *extra]) == 0
    return capsys.readouterr().out


def _rows(table):
    return [ln for ln in table.splitlines() if ln.startswith("| ") and not ln.startswith("| method")]


# ---- 1. experiments and distinct seeds -------------------------------------------------------------------------
def test_a_seed_run_twice_counts_once_with_its_latest_run_and_no_pm(tmp_path, capsys):
    db = tmp_path / "r.db"
    _add(db, [0.5, 0.6], seed=0)
    _add(db, [0.7, 0.8], seed=0)  # the same seed again: replaces the first, is not a second seed
    table = _report(capsys, db)
    (row,) = _rows(table)
    assert "| 1 (0) |" in row
    assert "±" not in row  # one seed: its value alone, not "± 0.00"
    assert "80.00" in row and "75.00" in row  # the latest run's best and last-N mean
    assert "repeated a seed" in table and "latest run" in table


def test_std_over_two_distinct_seeds(tmp_path, capsys):
    db = tmp_path / "r.db"
    _add(db, [0.6], seed=0)
    _add(db, [0.8], seed=1)
    (row,) = _rows(_report(capsys, db))
    assert "| 2 (0,1) |" in row and "70.00 ± 10.00" in row


def test_runs_differing_in_lr_or_method_args_are_separate_rows_that_show_the_difference(tmp_path, capsys):
    db = tmp_path / "r.db"
    _add(db, [0.9])
    _add(db, [0.8], lr=0.01)
    _add(db, [0.7], method_args={"weights": "uniform"})
    table = _report(capsys, db)
    header = next(ln for ln in table.splitlines() if ln.startswith("| method"))
    assert header.split(" | ")[1] == "lr"  # a varying setting is a column
    rows = _rows(table)
    assert len(rows) == 3
    cells = [[c.strip() for c in r.strip("|").split("|")] for r in rows]
    assert [c[:2] for c in cells] == [
        ["fedavg (weights=samples)", "0.05"],
        ["fedavg (weights=samples)", "0.01"],
        ["fedavg (weights=uniform)", "0.05"],
    ]
    common = table.splitlines()[0]
    assert "dataset=digits" in common and "partition=dir" in common and "lr=" not in common


def test_explicit_default_method_arg_is_the_same_experiment(tmp_path, capsys):
    db = tmp_path / "r.db"
    _add(db, [0.6], seed=0)
    _add(db, [0.8], seed=1, method_args={"weights": "samples"})  # fedavg's default, spelled out
    (row,) = _rows(_report(capsys, db))
    assert "2 (0,1)" in row


def test_a_config_stored_by_an_older_version_takes_defaults_for_missing_keys(tmp_path, capsys):
    db = tmp_path / "r.db"
    old = _add(db, [0.6], seed=0)
    _add(db, [0.8], seed=1)
    with sqlite3.connect(db) as conn:  # as an older fedskew wrote it: fewer keys, another group key
        cfg = json.loads(conn.execute("SELECT config FROM runs WHERE run_id = ?", (old,)).fetchone()[0])
        for key in ("client_dropout", "on_bad_update", "image_size", "domain_fraction"):
            del cfg[key]
        conn.execute("UPDATE runs SET config = ?, group_key = 'old' WHERE run_id = ?", (json.dumps(cfg), old))
    (row,) = _rows(_report(capsys, db))
    assert "2 (0,1)" in row


def test_a_config_that_no_longer_validates_is_compared_on_its_keys(tmp_path):
    from fedskew.results.report import build_report

    runs = [
        {"run_id": "a", "created": "1", "seed": 0, "config": {"method": "gone", "lr": 0.1}, "summary": {}},
        {"run_id": "b", "created": "2", "seed": 1, "config": {"method": "gone", "lr": 0.1}, "summary": {}},
    ]
    for r, acc in zip(runs, (0.5, 0.7), strict=True):
        r["summary"] = {"global_acc": {"best": acc, "last_n_mean": acc}, "last_n": 10, "evaluated_rounds": 3}
    rep = build_report(runs)
    assert len(rep.rows) == 1 and rep.rows[0][0] == "gone" and "2 (0,1)" in rep.rows[0]


# ---- 2. formats, metrics, last-N, divergence -------------------------------------------------------------------
def test_csv_with_two_metrics(tmp_path, capsys):
    db = tmp_path / "r.db"
    _add(db, [0.6, 0.7], seed=0, local=[0.5, 0.55])
    _add(db, [0.8, 0.9], seed=1, local=[0.6, 0.65])
    out = _report(capsys, db, "--format", "csv", "--metric", "global_acc,global_local_acc")
    (row,) = list(csv.DictReader(io.StringIO(out)))
    assert row["method"] == "fedavg"  # one experiment: its arguments are in the common settings, not the cell
    assert float(row["global_acc best mean"]) == pytest.approx(80.0)
    assert float(row["global_acc best std"]) == pytest.approx(10.0)
    assert float(row["global_local_acc last-2 mean"]) == pytest.approx(np.mean([52.5, 62.5]))
    assert row["seeds"] == "2 (0,1)"


def test_repeated_metric_flag_and_latex(tmp_path, capsys):
    db = tmp_path / "r.db"
    _add(db, [0.6], seed=0, local=[0.5])
    _add(db, [0.8], seed=1, local=[0.7], lr=0.01)
    out = _report(capsys, db, "--format", "latex", "--metric", "global_acc", "--metric", "global_local_acc")
    assert "\\begin{tabular}" in out and "\\end{tabular}" in out
    head = next(ln for ln in out.splitlines() if ln.startswith("method"))
    assert "global\\_acc best" in head and "global\\_local\\_acc best" in head
    assert out.count("\\\\") == 3  # header and two rows


def test_last_n_is_recomputed_from_the_round_records_and_stated(tmp_path, capsys):
    db = tmp_path / "r.db"
    _add(db, [0.1] * 8 + [0.5, 0.7])  # summary: last 10 of 10 evaluated rounds
    default = _report(capsys, db)
    assert "global_acc last-10" in default and "20.00" in default
    out = _report(capsys, db, "--last-n", "2")
    assert "global_acc last-2" in out and "| 60.00 |" in out


def test_last_n_header_says_fewer_rounds(tmp_path, capsys):
    db = tmp_path / "r.db"
    _add(db, [0.5, 0.7, 0.9])  # last_n 10, 3 evaluated rounds
    assert "global_acc last-3" in _report(capsys, db)


def test_a_diverged_run_stays_visible(tmp_path, capsys):
    db = tmp_path / "r.db"
    _add(db, [0.8], seed=0)
    _add(db, [], seed=1, diverged_round=1, lr=1.5)  # diverged in round 1: no metric at all
    table = _report(capsys, db, "--metric", "global_acc")
    assert "diverged" in table.splitlines()[2]
    (bad,) = [r for r in _rows(table) if "seed 1 (round 1)" in r]
    assert "| 1.5 |" in bad
    out = _report(capsys, db, "--format", "csv")
    assert [r["diverged"] for r in csv.DictReader(io.StringIO(out))] == ["-", "seed 1 (round 1)"]


# ---- 3. a closed pipe ------------------------------------------------------------------------------------------
def test_report_into_a_closed_pipe_exits_quietly(tmp_path):
    db = tmp_path / "r.db"
    for seed in range(3):
        _add(db, [0.5 + 0.1 * seed], seed=seed, lr=0.01 * (seed + 1))
    r, w = os.pipe()
    os.close(r)  # the reader is gone before anything is written, as after `| head` has read its lines
    try:
        proc = subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys; from fedskew.cli import main; sys.exit(main())",
                "report",
                "--db",
                str(db),
            ],
            stdout=w,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    finally:
        os.close(w)
    assert proc.returncode == 141, proc.stderr
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr and "Exception ignored" not in proc.stderr


# ---- 4. the run summary ----------------------------------------------------------------------------------------
def _tiny(tmp_path, **kw):
    base = {"clients": 4, "rounds": 3, "skew_probes": 0, "db": str(tmp_path / "r.db"), "out": str(tmp_path / "x")}
    return make_config(None, {**base, **kw})


def test_run_summary_shows_method_args_and_the_rounds_averaged(tmp_path, capsys):
    from fedskew.runner import run_experiment

    cfg = _tiny(tmp_path, method_args={"weights": "uniform"})
    outcome = run_experiment(cfg)
    capsys.readouterr()
    print_summary(outcome.summary, outcome.run_dir, cfg)
    out = " ".join(capsys.readouterr().out.split())
    assert "fedavg (weights=uniform) on digits" in out
    assert "last 3 mean" in out and "last 10" not in out


def _domain_cfg(tmp_path, **kw):
    return _tiny(
        tmp_path, dataset="digits_domains", partition="domain", clients=3, domain_fraction=0.1, model="mlp", **kw
    )


def test_domain_run_summary_has_one_row_per_domain(tmp_path, capsys, fake_domains):
    from fedskew.runner import run_experiment

    cfg = _domain_cfg(tmp_path)
    outcome = run_experiment(cfg)
    summary = json.loads((outcome.run_dir / "summary.json").read_text())
    assert summary["domains"] == ["a", "b", "c"] and summary["domains_missing"] == []
    for d in "abc":
        assert 0 <= summary[f"domain_acc/{d}"]["last_n_mean"] <= 1
    capsys.readouterr()
    print_summary(outcome.summary, outcome.run_dir, cfg)
    out = capsys.readouterr().out
    for d in "abc":
        assert f"global model, domain {d}" in out
    assert "(AVG)" in out and "(STD" in out


# ---- 6. a Digits suite without SVHN ----------------------------------------------------------------------------
def test_digits_domains_without_svhn_says_so_and_records_the_domains(tmp_path, capsys, monkeypatch):
    import fedskew.data.federated as fed
    from fedskew.runner import run_experiment

    doms = {n: _fake_domain(n, 300, 30, i) for i, n in enumerate(("mnist", "usps", "synth"))}
    monkeypatch.setattr(fed, "digits_domains", lambda data_dir, size, seed, download=False: dict(doms))
    cfg = _domain_cfg(tmp_path)
    with pytest.warns(UserWarning, match="svhn"):
        outcome = run_experiment(cfg)
    summary = json.loads((outcome.run_dir / "summary.json").read_text())
    assert summary["domains"] == ["mnist", "usps", "synth"]
    assert summary["domains_missing"] == ["svhn"]
    capsys.readouterr()
    print_summary(outcome.summary, outcome.run_dir, cfg)
    out = " ".join(capsys.readouterr().out.split())
    assert "domains: mnist, usps, synth" in out and "svhn" in out


# ---- 5. run-folder names ---------------------------------------------------------------------------------------
def test_run_folder_names_hold_non_default_method_args(tmp_path):
    plain = default_run_dir(make_config(None, {}), "T")
    assert plain == Path("runs/T-fedavg-digits-dir-s0")
    uniform = default_run_dir(make_config(None, {"method_args": {"weights": "uniform"}}), "T")
    assert uniform == Path("runs/T-fedavg_weights-uniform-digits-dir-s0")
    # the default spelled out adds nothing; SCAFFOLD's default average is uniform
    assert default_run_dir(make_config(None, {"method_args": {"weights": "samples"}}), "T") == plain
    assert (
        "weights"
        not in default_run_dir(
            make_config(None, {"method": "scaffold", "method_args": {"weights": "uniform"}}), "T"
        ).name
    )
    many = make_config(
        None, {"method": "moon", "method_args": {"mu": 0.123456789, "tau": 0.987654321, "projection": 64}}
    )
    a = default_run_dir(many, "T").name
    b = default_run_dir(
        many.model_copy(update={"method_args": {"mu": 0.123456789, "tau": 0.987654322, "projection": 64}}), "T"
    ).name
    tag = a.removeprefix("T-moon_").removesuffix("-digits-dir-s0")
    assert len(tag) <= 40 and a != b  # bounded, and a hash keeps cut names apart
    assert re.fullmatch(r"[A-Za-z0-9._-]+", a)
