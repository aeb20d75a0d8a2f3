"""`fedskew reproduce PAPER` (issue 16): the papers' numbers as package data with their sources, the plan (methods
this version lacks listed, and run once registered; missing data listed), and `--scale smoke` for every paper."""

import dataclasses
import json

import pytest
from conftest import SHARED_DATA, _fake_domain

from fedskew.cli import main
from fedskew.data.readers.domains import DOMAIN_SUITES
from fedskew.registry import NoParams, ServerPlugin, register, unregister
from fedskew.reproduce import SCALES, load_paper, make_plan, paper_names
from fedskew.reproduce.papers import parse_value
from fedskew.reproduce.plan import method_status
from fedskew.reproduce.table import build_tables
from fedskew.sweep.core import expand, load_spec


def test_paper_numbers_are_data_with_their_sources():
    assert paper_names() == ["fedcac", "feddisco", "fedheal", "fedsa", "niid-bench"]
    assert load_paper("fedpake").paper == "fedsa"  # aliases
    cells = {}
    for name in paper_names()[:4]:
        paper = load_paper(name)
        for t in paper.tables:
            assert t.source.paper and t.source.table.startswith("Table")
            for rid, vals in t.values.items():
                for col, v in vals.items():
                    cells[(name, t.id, rid, col)] = parse_value(v)
    # spot checks against specs/methods.md §1.7, §2.6, §3.6, §4.6
    assert cells[("fedsa", "table1", "fedavg", "patho_c10")] == (90.79, 0.08)
    assert cells[("fedsa", "table1", "fedsa", "dir_c100_r34")] == (39.12, 0.04)
    assert cells[("fedsa", "table3", "fedbabu", "dir001_c100")] == (71.67, None)
    assert cells[("feddisco", "table1_2", "fedavg_disco", "fmnist_niid2")] == (87.56, None)
    assert cells[("feddisco", "table1_2", "feddc", "ham_niid1")] == (54.48, None)
    assert cells[("fedcac", "table2", "fedcac", "dir01_c10")] == (86.82, 1.18)
    assert cells[("fedcac", "table1", "separate", "patho_tiny")] == (86.43, None)
    assert cells[("fedheal", "table2", "fedavg_heal", "avg")] == (78.09, None)
    assert cells[("fedheal", "table2", "fedproto_qffl", "office_std")] == (11.99, None)
    assert cells[("feddisco", "table4", "fedprox_disco", "ag_partial")] == (62.86, None)
    assert len(cells) == 9 * 10 + 17 * 7 + 4 * 2 + 7 * 12 + (30 * 12 - 12 * 8 - 2 * 8)


@pytest.mark.parametrize("name", ["fedsa", "feddisco", "fedcac", "fedheal", "niid-bench"])
def test_every_row_runs_or_is_listed_as_not_available(name):
    paper = load_paper(name)
    for scale in SCALES:
        plan = make_plan(paper, scale)
        for row, why in plan.missing_rows:
            assert why.startswith("not available in this version"), (row.id, why)
        assert {r.id for r in plan.rows} | {r.id for r, _ in plan.missing_rows} == {r.id for r in paper.rows}


def test_an_unregistered_method_is_listed_and_runs_once_registered():
    paper = load_paper("feddisco")
    row = paper.rows[0].model_copy(update={"id": "mine", "label": "Mine", "method": "fedavg+mine_weights"})
    table = paper.tables[0].model_copy(update={"values": {**paper.tables[0].values, "mine": {"fmnist_niid1": 90.0}}})
    paper = paper.model_copy(update={"rows": [*paper.rows, row], "tables": [table]})
    assert method_status(row) == "not available in this version (mine_weights not registered)"
    plan = make_plan(paper, "smoke")
    assert [(r.id, why) for r, why in plan.missing_rows] == [("mine", method_status(row))]
    (built,) = build_tables(plan, {}, {})
    cell = built.cells[("mine", 0)]
    assert cell.ours is None and cell.note.startswith("not available in this version") and cell.paper == (90.0, None)
    register(ServerPlugin("mine_weights", "test", "test", NoParams, (), lambda p: {}))
    try:
        plan = make_plan(paper, "smoke")
        assert "mine" in [r.id for r in plan.rows] and not plan.missing_rows
    finally:
        unregister("mine_weights")


def test_missing_data_is_listed_and_nothing_runs(tmp_path, capsys):
    empty = tmp_path / "data"
    empty.mkdir()
    assert main(["reproduce", "fedsa", "--scale", "small", "--data-dir", str(empty), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "dataset mnist not found" in err and "dataset cifar10 not found" in err
    assert "error: nothing to run here" in err


def _smoke(tmp_path, capsys, name, rows):
    out = tmp_path / name
    code = main(["reproduce", name, "--scale", "smoke", "--rows", rows, "--out", str(out), "--quiet"])
    stdout = capsys.readouterr().out
    assert code == 0, stdout
    return out, stdout, json.loads((out / "table.json").read_text())


def _ours(data, table=0):
    return {r["id"]: [c["ours"] for c in r["cells"]] for r in data["tables"][table]["rows"]}


def test_smoke_fedsa_and_its_rerun_is_idempotent(tmp_path, capsys):
    out, text, data = _smoke(tmp_path, capsys, "fedsa", "fedavg,fedsa")  # both FedAvg rows, both FedSA rows (method)
    assert "| FedAvg |" in text and "90.79 ± 0.08" in text and "91.36 ± 0.23" in text  # the paper beside ours
    assert "Patho digits (8x8) (paper: Patho CIFAR-10)" in text
    ours = _ours(data)
    assert set(ours) == {"fedavg", "fedavg_uniform", "fedsa", "fedsa_rank"}
    assert all(len(v) == 2 and all(v) for v in ours.values())
    assert "| FedAvg, equal weights |" in text  # the weighting control, no paper number
    assert "| FedSA/FedPake, rank cv (ours) |" in text  # the ablation row, no paper number
    assert "Kendall tau" in text and "training sample passes" in text
    assert len(list((out / "figures").glob("curves-*.png"))) == 2  # one per setting
    # the sweep it wrote re-expands to the very same runs, and running again does nothing twice
    runs = expand(load_spec(out / "sweep.yaml"))
    assert sorted(r.name for r in runs) == sorted(p.name for p in (out / "runs").iterdir())
    _, again, data2 = _smoke(tmp_path, capsys, "fedsa", "fedavg,fedsa")
    assert "8 runs: 8 skipped" in again and _ours(data2) == ours


def test_table_only_tabulates_what_is_finished_and_runs_nothing(tmp_path, capsys):
    out = tmp_path / "fedsa"
    args = ["reproduce", "fedsa", "--scale", "smoke", "--rows", "fedavg", "--out", str(out), "--quiet"]
    assert main(args) == 0  # seed 0, both settings
    capsys.readouterr()
    before = sorted(p.name for p in (out / "runs").iterdir())
    assert main([*args, "--seeds", "0,1", "--table-only"]) == 0
    captured = capsys.readouterr()
    assert "4 of 8 runs finished" in captured.err  # both FedAvg rows, both settings, seed 0 of 0 and 1
    assert sorted(p.name for p in (out / "runs").iterdir()) == before  # seed 1 was not run
    data = json.loads((out / "table.json").read_text())
    assert all(len(v) == 2 and all(v) for v in _ours(data).values())  # seed 0's cells
    assert "over the last 10 evaluated rounds here" in captured.out  # the statistic's window at this scale


def test_smoke_feddisco_compares_the_plug_in_gain(tmp_path, capsys):
    _, text, data = _smoke(tmp_path, capsys, "feddisco", "fedavg,fedavg+disco")
    assert "| FedAvg+Disco |" in text and "89.56" in text
    assert "change over the host: FedAvg+Disco" in text and "(paper +0.30)" in text
    assert all(all(v) for v in _ours(data).values())


def test_smoke_fedcac_uses_personalized_accuracy(tmp_path, capsys):
    _, text, data = _smoke(tmp_path, capsys, "fedcac", "fedavg,fedcac")
    assert "| FedCAC |" in text and "89.77 ± 1.14" in text
    assert "| FedCAC, beta = 20% of the rounds (ours) |" in text  # our ablation: no paper number
    assert all(all(v) for t in range(2) for v in _ours(data, t).values())


def test_smoke_fedheal_per_domain_columns(tmp_path, capsys, monkeypatch):
    import fedskew.data.federated as fed
    import fedskew.reproduce.plan as plan_mod

    # three random domains big enough for the smoke's 0.2% per client, in place of the Digits suite's files
    doms = {n: _fake_domain(n, 3000, 60, i) for i, n in enumerate("abc")}
    fake = dataclasses.replace(fed.domain_suite("digits_domains"), load=lambda *a, **k: dict(doms))
    monkeypatch.setitem(DOMAIN_SUITES, "digits_domains", fake)
    real = plan_mod.dataset_status
    monkeypatch.setattr(
        plan_mod,
        "dataset_status",
        lambda d, data_dir: (None, list(doms)) if d == "digits_domains" else real(d, data_dir),
    )
    out, text, data = _smoke(tmp_path, capsys, "fedheal", "fedavg,fedavg+heal")
    table = data["tables"][0]
    labels = [c["label"] for c in table["columns"]]
    assert labels[:6] == [f"{x} [Digits, smoke subset]" for x in ("MNIST", "USPS", "SVHN")] + [
        "SYN (ours: synthetic digits from MNIST) [Digits, smoke subset]",
        "Digits AVG [Digits, smoke subset]",
        "Digits STD [Digits, smoke subset]",
    ]
    for row in table["rows"]:
        cells = row["cells"]
        assert cells[0]["ours"] is None and "domain not present" in cells[0]["note"]  # the fake domains are a, b, c
        assert cells[4]["ours"] and cells[5]["ours"]  # AVG and STD over the domains present
    assert "Office-Caltech" in text and "(paper +2.09)" in text  # HEAL's AVG gain over FedAvg in the paper
    assert len(list((out / "figures").glob("domains-*.png"))) == 1


@pytest.mark.parametrize("name", ["fedsa", "feddisco", "fedcac"])
def test_laptop_scale_runs_on_the_embedded_digits_with_three_seeds(name, monkeypatch):
    """`--scale laptop` needs no data directory for the label-skew papers: its settings are the embedded 8x8 digits."""
    monkeypatch.delenv("FEDSKEW_DATA", raising=False)
    plan = make_plan(load_paper(name), "laptop")
    assert plan.settings and {s.case["dataset"] for s in plan.settings} == {"digits"}
    assert plan.seeds == [0, 1, 2] and plan.base["rounds"] == 50


@pytest.mark.parametrize("name", ["fedsa", "feddisco", "fedcac", "fedheal"])
def test_cpu_scale_uses_the_official_test_sets_with_five_seeds(name, monkeypatch, tmp_path):
    """Issue 23: `--scale cpu` runs the paper's protocol on Fashion-MNIST / MNIST (official test sets), never on the
    8x8 digits, with at least 5 seeds; without the files every column is listed as missing, naming the dataset."""
    monkeypatch.delenv("FEDSKEW_DATA", raising=False)
    paper = load_paper(name)
    plan = make_plan(paper, "cpu", data_dir=str(tmp_path))
    assert not plan.settings and len(plan.seeds) >= 5
    datasets = {paper.settings[sid].dataset for sid, _ in plan.missing_settings if "cpu" in paper.settings[sid].scales}
    assert datasets and datasets <= {"fmnist", "mnist", "digits_domains", "office_caltech"}
    assert all(
        "not found" in why or "needs" in why
        for sid, why in plan.missing_settings
        if sid in paper.settings and "cpu" in paper.settings[sid].scales
    )
    if (SHARED_DATA / "fashion-mnist").is_dir() and (SHARED_DATA / "mnist").is_dir():
        plan = make_plan(paper, "cpu", data_dir=str(SHARED_DATA))
        assert plan.settings and all(s.setting.dataset != "digits" for s in plan.settings)


def test_references_follow_the_pairs_the_hosts_and_against():
    from fedskew.reproduce.table import references

    heal = load_paper("fedheal")
    (t,) = [t for t in heal.tables if t.id == "table2"]
    refs = references(heal.table_rows(t), t.pairs)
    assert refs["fedavg"] == "fedavg"  # the reference itself
    assert refs["fedprox_heal"] == "fedprox" and refs["fedprox_afl"] == "fedprox" and refs["moon_qffl"] == "moon"
    assert refs["fedprox"] == "fedavg" and refs["ditto"] == "fedavg"
    disco = load_paper("feddisco")
    t = disco.tables[0]
    refs = references(disco.table_rows(t), t.pairs)
    assert refs["fedavg_uniform"] == "fedavg" and refs["moon_disco"] == "moon" and refs["fedavg_disco"] == "fedavg"
    assert set(references(disco.table_rows(t), t.pairs, "FedProx").values()) == {"fedprox"}


def test_smoke_table_carries_paired_intervals(tmp_path, capsys):
    """Issue 23: with two seeds every cell of ours has its paired difference against the row's reference, with a
    95% paired t interval, in table.md and table.json, and each column its detectable difference."""
    import re

    import numpy as np
    from scipy import stats as sps

    from fedskew.results.stats import detectable_difference

    out = tmp_path / "feddisco"
    argv = ["reproduce", "feddisco", "--scale", "smoke", "--rows", "fedavg,fedavg+disco", "--seeds", "0,1"]
    assert main([*argv, "--out", str(out), "--quiet", "--against", "nope"]) == 2  # names no row
    assert "--against 'nope' names no row" in capsys.readouterr().err
    assert main([*argv, "--out", str(out), "--quiet"]) == 0
    text = capsys.readouterr().out
    data = json.loads((out / "table.json").read_text())
    table = data["tables"][0]
    rows = {r["id"]: r for r in table["rows"]}
    assert rows["fedavg"]["reference"] == "fedavg" and rows["fedavg_disco"]["reference"] == "fedavg"
    assert set(rows) == {"fedavg", "fedavg_disco", "fedavg_uniform"}  # --rows fedavg: every row of method fedavg
    assert rows["fedavg_uniform"]["reference"] == "fedavg"
    detectable = table["detectable"]
    for j in range(len(table["columns"])):
        ref, plus = rows["fedavg"]["cells"][j], rows["fedavg_disco"]["cells"][j]
        assert ref["role"] == "reference" and ref["delta"] is None
        d = plus["delta"]
        assert plus["role"] == "compared" and d["method"] == "paired t" and d["n"] == 2 and d["seeds"] == [0, 1]
        diffs = np.array([plus["values"][s] - ref["values"][s] for s in ("0", "1")])  # by hand, seed by seed
        half = sps.t.ppf(0.975, 1) * diffs.std(ddof=1) / np.sqrt(2)
        assert d["mean"] == pytest.approx(diffs.mean()) and d["sd"] == pytest.approx(diffs.std(ddof=1))
        assert d["lo"] == pytest.approx(diffs.mean() - half) and d["hi"] == pytest.approx(diffs.mean() + half)
        assert d["significant"] == (d["lo"] > 0 or d["hi"] < 0)
        assert f"{d['mean']:+.2f} [{d['lo']:+.2f}, {d['hi']:+.2f}]" in text
        # the column's detectable difference: from the pooled paired std of its two comparisons, at 2 seeds
        sd = np.sqrt((d["sd"] ** 2 + rows["fedavg_uniform"]["cells"][j]["delta"]["sd"] ** 2) / 2)
        assert detectable[j]["n"] == 2 and detectable[j]["sd"] == pytest.approx(sd)
        assert detectable[j]["difference"] == pytest.approx(detectable_difference(sd, 2))
        assert f"{detectable[j]['difference']:.2f} (n=2, sd {sd:.2f})" in text
    md = (out / "table.md").read_text()
    assert md.strip() in text  # what was printed is what was written
    assert "| method | vs | digits (8x8) NIID-1 (paper: FMNIST NIID-1) | paper | Δ |" in md
    assert "| FedAvg | (reference) |" in md and "| FedAvg+Disco | FedAvg |" in md
    assert "| detectable Δ (α=0.05, power 0.8) |" in md and "paired t below 10 common seeds" in md
    assert re.search(r"change over the host: FedAvg\+Disco [+-]\d+\.\d\d \[[+-]\d+\.\d\d, [+-]\d+\.\d\d\]\*? ", md)
    assert len(list((out / "figures").glob("paired-*.png"))) == 2  # one per setting, with the interval bars
    # one row of a method alone (--rows fedavg names every row of the method): =fedavg plans that row only, exactly
    # the runs the table counted for it, every one already finished (run ids do not depend on the selection)
    argv_one = ["reproduce", "feddisco", "--scale", "smoke", "--rows", "=fedavg", "--seeds", "0,1", "--out", str(out)]
    assert main([*argv_one, "--dry-run"]) == 0
    captured = capsys.readouterr()
    assert "methods: FedAvg\n" in captured.err
    planned = [line.split() for line in captured.out.splitlines() if line.startswith("  ")]
    assert len(planned) == 2 * len(table["columns"]) and all(p[0] == "skip" and p[-1] == "(finished)" for p in planned)
    names = {p[1] for p in planned}
    assert main([*argv_one[:5], "fedavg", *argv_one[6:], "--dry-run"]) == 0  # the method: its control's runs too
    every = {line.split()[1] for line in capsys.readouterr().out.splitlines() if line.startswith("  ")}
    assert names < every and len(every) == 2 * len(names)
