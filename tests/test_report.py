"""From one run to a paper's table (issue 16): `fedskew report` groups experiments and counts seeds, its formats and
metrics, a closed pipe, the run summary, run-folder names, and the domains a domain-skew run used."""

import csv
import dataclasses
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


def test_the_prose_around_a_table_fits_a_terminal(tmp_path, capsys):
    """The settings line and the notes are wrapped to 100 columns (they were one line of about 700 characters);
    a table row stays one line."""
    db = tmp_path / "r.db"
    for seed in range(2):
        _add(db, [0.7], seed=seed)
        _add(db, [0.8], seed=seed, method="fedprox")
    table = _report(capsys, db)
    prose = [ln for ln in table.splitlines() if not ln.startswith("|")]
    assert len(prose) > 4 and max(len(ln) for ln in prose) <= 100
    assert " ".join(" ".join(prose).split()).startswith("settings common to every row: dataset=digits;")
    assert len(_rows(table)) == 3  # fedavg, fedprox and the detectable-difference footer


def test_a_diverged_run_stays_visible(tmp_path, capsys):
    db = tmp_path / "r.db"
    _add(db, [0.8], seed=0)
    _add(db, [], seed=1, diverged_round=1, lr=1.5)  # diverged in round 1: no metric at all
    table = _report(capsys, db, "--metric", "global_acc")
    header = next(ln for ln in table.splitlines() if ln.startswith("| method"))
    assert "diverged" in header
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
    from fedskew.data.readers.domains import DOMAIN_SUITES

    fake = dataclasses.replace(fed.domain_suite("digits_domains"), load=lambda *a, **k: dict(doms))
    monkeypatch.setitem(DOMAIN_SUITES, "digits_domains", fake)
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


# ---- 7. paired comparisons against a reference row (issue 23) ----------------------------------------------------
_BASE = [0.60, 0.66, 0.55, 0.70]  # FedAvg per seed: the seeds themselves vary by up to 15 points


def _cells(table, label):
    (row,) = [r for r in _rows(table) if r.startswith(f"| {label} |")]
    return [c.strip() for c in row.strip().strip("|").split(" | ")]


def _paired_db(tmp_path):
    db = tmp_path / "r.db"
    for seed, b in enumerate(_BASE):
        _add(db, [b], seed=seed)
        _add(db, [b + (0.020, 0.021, 0.019, 0.020)[seed]], seed=seed, method="fedprox")  # +2 points on every seed
        _add(db, [b + (0.01, -0.01, 0.01, -0.01)[seed]], seed=seed, method="scaffold")  # noise around 0
    return db


def test_a_row_better_on_every_seed_is_marked_and_noise_is_not(tmp_path, capsys):
    db = _paired_db(tmp_path)
    table = _report(capsys, db)
    header = next(ln for ln in table.splitlines() if ln.startswith("| method"))
    assert header == (
        "| method | seeds | paired vs | global_acc best | global_acc best Δ | global_acc last-1 | global_acc last-1 Δ "
        "| diverged |"
    )
    ref = _cells(table, "fedavg")
    assert ref[2] == "(reference)" and ref[4] == "(reference)" and ref[6] == "(reference)"
    # fedprox - fedavg per seed: 2.0, 2.1, 1.9, 2.0 -> mean 2.0, sd 0.08165, t_{0.975,3} 3.1824: half-width 0.1299
    better = _cells(table, "fedprox")
    assert better[2] == "fedavg" and better[4] == "+2.00 [+1.87, +2.13]*" and better[6] == better[4]
    # scaffold - fedavg: +1, -1, +1, -1 -> mean 0, sd 1.1547, half-width 1.8374: not marked
    noise = _cells(table, "scaffold")
    assert noise[4] == "+0.00 [-1.84, +1.84]"
    # under each column: the detectable difference from the pooled paired std (sqrt((3 * 0.0067 + 3 * 1.3333) / 6))
    foot = next(ln for ln in table.splitlines() if ln.startswith("| detectable Δ"))
    sd = np.sqrt((0.08165**2 + 1.1547**2) / 2)
    from fedskew.results.stats import detectable_difference

    assert f"{detectable_difference(sd, 4):.2f} (n=4, sd {sd:.2f})" in foot
    prose = " ".join(table.split())  # the notes are wrapped to the width of a terminal
    assert "paired t (fewer than 10 common seeds)" in prose and "* marks an interval that excludes 0" in prose
    # the unpaired view could not tell fedprox from fedavg: the std over seeds (5.8) dwarfs the 2-point gain
    assert better[3] == "64.75 ± 5.77" and ref[3] == "62.75 ± 5.72"


def test_paired_numbers_in_csv_and_latex(tmp_path, capsys):
    db = _paired_db(tmp_path)
    rows = {r["method"]: r for r in csv.DictReader(io.StringIO(_report(capsys, db, "--format", "csv")))}
    p, n, f = rows["fedprox"], rows["scaffold"], rows["fedavg"]
    assert float(p["global_acc best delta"]) == pytest.approx(2.0)
    assert float(p["global_acc best delta lo"]) == pytest.approx(2.0 - 0.1299, abs=1e-4)
    assert float(p["global_acc best delta hi"]) == pytest.approx(2.0 + 0.1299, abs=1e-4)
    assert (p["global_acc best delta method"], p["global_acc best delta n"]) == ("paired t", "4")
    assert p["global_acc best delta significant"] == "true" and n["global_acc best delta significant"] == "false"
    assert float(p["global_acc best delta sd"]) == pytest.approx(0.08165, abs=1e-4)
    assert p["reference"] == "fedavg" and f["reference"] == "(reference)"
    assert f["global_acc best delta method"] == "reference" and f["global_acc best delta"] == ""
    capsys.readouterr()
    assert main(["report", "--db", str(db), "--format", "csv"]) == 0
    assert "note: detectable Δ (paired t, α=0.05, power 0.8): global_acc best Δ: " in capsys.readouterr().err
    latex = _report(capsys, db, "--format", "latex")
    assert "\\textbf{+2.00 [+1.87, +2.13]}" in latex and "\\textbf{+0.00" not in latex
    assert "detectable $\\Delta$" in latex and "global\\_acc best $\\Delta$" in latex


def test_unpaired_runs_are_reported_as_unpaired(tmp_path, capsys):
    db = tmp_path / "r.db"
    _add(db, [0.6], seed=0)
    _add(db, [0.7], seed=1)
    _add(db, [0.9], seed=2, method="fedprox")  # other seeds: other partitions and initial models
    _add(db, [0.8], seed=3, method="fedprox")
    table = _report(capsys, db)
    cells = _cells(table, "fedprox")
    assert cells[4] == "unpaired (no common seed)" and cells[6] == cells[4]
    assert "unpaired, not compared (no seed in common with their reference): fedprox" in table
    assert "detectable Δ" not in table  # nothing was compared
    (row,) = [r for r in csv.DictReader(io.StringIO(_report(capsys, db, "--format", "csv"))) if r["method"] != "fedavg"]
    assert row["global_acc best delta method"] == "unpaired" and row["global_acc best delta"] == ""


def test_partly_shared_seeds_and_a_diverged_seed(tmp_path, capsys):
    db = tmp_path / "r.db"
    for seed, b in enumerate(_BASE):
        _add(db, [b], seed=seed)
    _add(db, [0.63], seed=0, method="fedprox")
    _add(db, [0.69], seed=1, method="fedprox")
    _add(db, [0.50], seed=2, method="fedprox", diverged_round=1)  # left out of the comparison, named
    _add(db, [0.99], seed=9, method="fedprox")  # no partner: not used
    _add(db, [0.58], seed=2, method="scaffold")  # one common seed: a difference without an interval
    table = _report(capsys, db)
    assert _cells(table, "fedprox")[4] == "+3.00 [+3.00, +3.00]* (n=2)"  # +3 on seeds 0 and 1
    assert _cells(table, "scaffold")[4] == "+3.00 (1 seed, no interval)"
    assert "left out of paired comparisons (a diverged run, theirs or their reference's): fedprox seed 2" in table


def test_plug_in_rows_against_their_host_and_against(tmp_path, capsys):
    db = tmp_path / "r.db"
    for seed, b in enumerate(_BASE[:3]):
        _add(db, [b], seed=seed)
        _add(db, [b + 0.05], seed=seed, method="fedprox")
        _add(db, [b + 0.05 + 0.01 * (seed + 1)], seed=seed, method="fedprox+heal")
        _add(db, [b + 0.01], seed=seed, alpha=0.5)  # another setting: its own reference, never compared across
    table = _report(capsys, db)
    assert _cells(table, "fedprox+heal")[3] == "fedprox"  # the host (column 2 is alpha)
    assert _cells(table, "fedprox+heal")[5].startswith("+2.00 [")  # 1, 2, 3 points over fedprox
    # two fedavg rows (alpha 0.1 and 0.5): the reference is named with the setting that tells them apart
    prox = _cells(table, "fedprox")
    assert prox[3] == "fedavg [alpha=0.1]" and prox[5] == "+5.00 [+5.00, +5.00]*"
    fedavg_rows = [r for r in _rows(table) if r.startswith("| fedavg |")]
    assert len(fedavg_rows) == 2 and all("(reference)" in r for r in fedavg_rows)
    out = _report(capsys, db, "--against", "fedprox")
    assert _cells(out, "fedprox")[3] == "(reference)"
    assert _cells(out, "fedprox+heal")[5].startswith("+2.00 [")
    assert "-5.00 [-5.00, -5.00]*" in next(r for r in _rows(out) if r.startswith("| fedavg | 0.1"))
    assert "no reference row in their setting" in out  # alpha 0.5 has no fedprox row
    capsys.readouterr()
    assert main(["report", "--db", str(db), "--against", "fedyogi"]) == 2
    assert "--against 'fedyogi' names no row" in capsys.readouterr().err


def test_seeds_needed_per_row(tmp_path, capsys):
    from fedskew.results.stats import seeds_needed

    db = _paired_db(tmp_path)
    table = _report(capsys, db, "--seeds-needed", "0.5")
    header = next(ln for ln in table.splitlines() if ln.startswith("| method"))
    assert "| global_acc best seeds for Δ=0.5 |" in header
    assert _cells(table, "fedprox")[5] == str(seeds_needed(0.08165, 0.5)) == "3"  # tiny paired std
    assert _cells(table, "scaffold")[5] == str(seeds_needed(1.1547, 0.5)) == "44"
    assert _cells(table, "fedavg")[5] == "(reference)"
    assert "seeds for Δ=0.5: the smallest number of seeds" in table
    capsys.readouterr()
    assert main(["report", "--db", str(db), "--seeds-needed", "0"]) == 2
    assert "--seeds-needed must be a positive" in capsys.readouterr().err


# ---- issue 46: another application's database is never altered; a report only reads --------------------------------
def test_a_foreign_database_is_refused_before_any_work_and_left_unchanged(tmp_path):
    import hashlib
    import sqlite3

    from fedskew.results.store import DatabaseError, ResultsDB, check_db_path

    other = tmp_path / "app.db"
    conn = sqlite3.connect(other)
    conn.execute("CREATE TABLE runs (id INTEGER PRIMARY KEY, name TEXT)")  # another application's runs table
    conn.execute("INSERT INTO runs (name) VALUES ('theirs')")
    conn.commit()
    conn.close()
    before = hashlib.sha256(other.read_bytes()).hexdigest()
    with pytest.raises(DatabaseError, match=r"not a fedskew results database: its runs table lacks fedskew's columns"):
        check_db_path(other)
    with pytest.raises(DatabaseError, match="not a fedskew results database"):
        ResultsDB(other)
    with pytest.raises(DatabaseError, match="not a fedskew results database"):
        ResultsDB(other, read_only=True)
    assert hashlib.sha256(other.read_bytes()).hexdigest() == before and not (tmp_path / "app.db-wal").exists()
    conn = sqlite3.connect(tmp_path / "mixed.db")
    conn.execute("CREATE TABLE accounts (id INTEGER)")
    conn.close()
    with pytest.raises(DatabaseError, match=r"holds tables fedskew does not write \(accounts\)"):
        check_db_path(tmp_path / "mixed.db")


def test_a_report_opens_the_database_read_only(tmp_path):
    import os
    import sqlite3

    from fedskew.api import run
    from fedskew.results.store import ResultsDB

    db = tmp_path / "r.db"
    run("fedavg", rounds=1, clients=3, out=str(tmp_path / "run"), db=str(db))
    with ResultsDB(db) as store:  # a writer left WAL mode on; checkpoint so the file alone holds everything
        store.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        store.conn.execute("PRAGMA journal_mode = DELETE")
    mtime = os.stat(db).st_mtime_ns
    with ResultsDB(db, read_only=True) as store:
        assert len(store.runs()) == 1
        with pytest.raises(sqlite3.OperationalError, match="readonly"):
            store.conn.execute("DELETE FROM runs")
    assert os.stat(db).st_mtime_ns == mtime
