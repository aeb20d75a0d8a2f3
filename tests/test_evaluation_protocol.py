"""Issue 44: which number a table reports is one named record (round, clients, model, data, mean), stored in
``summary.json`` and stated in the header of every table fedskew prints (run, report, sweep, reproduce)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fedskew.cli import main
from fedskew.results.evaluation import describe, of_run


def test_the_record_names_round_clients_model_data_and_mean() -> None:
    ev = describe("global_local_acc_mean", "best")
    assert ev.model == "global model" and ev.data == "each client's test split"
    assert ev.mean == "uniform over clients" and ev.clients == "all clients"
    assert "optimistic" in ev.round  # the best round selects on the data it reports
    ev = describe("personal_acc", "last_n_mean", last_n=5, eval_clients=20)
    assert ev.model.startswith("personalized models") and ev.round == "the mean of the last 5 evaluated rounds"
    assert ev.mean.startswith("pooled over the samples") and "sample of 20 clients" in ev.clients
    assert describe("global_acc", "final").data == "the global test set"
    assert "validation split" in describe("global_local_acc", "final", evaluate_on="validation").data
    assert describe("domain_acc_std", "best").mean == "std across domains (lower is better)"
    assert "held-out" in describe("heldout_acc", "final", heldout_clients=3).clients
    assert "validation split" in describe("global_acc", "validation_selected").round
    with pytest.raises(ValueError, match="no evaluation protocol known"):
        describe("train_loss", "best")
    with pytest.raises(ValueError, match="unknown statistic"):
        describe("global_acc", "median")
    # a run's settings: at most the evaluated rounds enter the last-N mean
    assert "last 2 evaluated" in of_run("global_acc", "last_n_mean", {"last_n": 10}, {"evaluated_rounds": 2}).round


def test_every_table_names_its_evaluation_protocol(tmp_path, capsys) -> None:
    db = str(tmp_path / "r.db")
    base = ["--rounds", "2", "--local-epochs", "1", "--clients", "4", "--db", db]
    assert main(["run", *base, "--out", str(tmp_path / "a")]) == 0
    out = capsys.readouterr().out
    assert "headline (fedskew protocol):" in " ".join(out.split())  # the run's own table
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    ev = summary["evaluation"]
    assert ev["protocol"] == "fedskew" and ev["metric"] == summary["headline"]["metric"] == "global_acc"
    assert set(ev) >= {"round", "clients", "model", "data", "mean", "statistic"}
    assert main(["run", *base, "--protocol", "pfllib", "--partition", "iid", "--out", str(tmp_path / "b")]) == 0
    capsys.readouterr()
    ev = json.loads((tmp_path / "b" / "summary.json").read_text())["evaluation"]
    assert ev["protocol"] == "pfllib" and ev["statistic"] == "best" and ev["metric"] == "global_local_acc"
    for fmt in ("markdown", "latex"):
        assert main(["report", "--db", db, "--format", fmt]) == 0
        text = capsys.readouterr().out
        assert "evaluation protocol: global_acc: global model on the global test set" in " ".join(text.split())
        assert "best = the best evaluated round" in text
    spec = tmp_path / "s.yaml"
    spec.write_text(
        "name: s\nbase: {rounds: 2, local_epochs: 1, clients: 4}\nmethods: [fedavg]\nseeds: [0]\n"
        f"out: {tmp_path / 'sw'}\ndb: {tmp_path / 'sw.db'}\n"
    )
    assert main(["sweep", str(spec)]) == 0
    assert "evaluation protocol: global_acc" in " ".join(capsys.readouterr().out.split())


def test_validation_selected_round_selects_on_validation_and_reports_test() -> None:
    from fedskew.results.store import summarize_run

    recs = [
        {"round": 1, "evaluated": True, "global_acc": 0.50, "val_global_acc": 0.40},
        {"round": 2, "evaluated": True, "global_acc": 0.70, "val_global_acc": 0.60},  # the best test round
        {"round": 3, "evaluated": True, "global_acc": 0.65, "val_global_acc": 0.62},  # the best validation round
        {"round": 4, "evaluated": True, "global_acc": 0.60, "val_global_acc": 0.62},  # a tie: the earlier wins
    ]
    timing = {k: 0.0 for k in ("time_train", "time_aggregate", "time_eval", "time_probe", "time_round")}
    recs = [{**r, **timing, "bytes_up": 0, "bytes_down": 0} for r in recs]
    s = summarize_run(recs, last_n=2)
    assert s["global_acc"]["best"] == 0.70 and s["global_acc"]["best_round"] == 2
    assert (s["global_acc"]["validation_selected"], s["global_acc"]["validation_round"]) == (0.65, 3)
    assert "validation_selected" not in s["val_global_acc"]  # a validation score selects nothing itself
    no_val = summarize_run([{k: v for k, v in r.items() if k != "val_global_acc"} for r in recs], last_n=2)
    assert "validation_selected" not in no_val["global_acc"]


def test_a_run_with_validation_splits_records_the_validation_selected_round(tmp_path, capsys) -> None:
    db = str(tmp_path / "v.db")
    argv = ["run", "--rounds", "3", "--local-epochs", "1", "--clients", "4", "--validation", "0.2", "--db", db]
    assert main([*argv, "--out", str(tmp_path / "plain")]) == 0  # without the switch: no validation views
    assert "val_global_acc" not in json.loads((tmp_path / "plain" / "summary.json").read_text())
    assert main(["run", "--validation-select", "--db", db, "--out", str(tmp_path / "x")]) == 2  # needs validation
    assert "validation_select chooses a round" in capsys.readouterr().err
    argv.append("--validation-select")
    assert main([*argv, "--out", str(tmp_path / "v")]) == 0
    assert "val-selected" in capsys.readouterr().out
    s = json.loads((tmp_path / "v" / "summary.json").read_text())
    rounds = [json.loads(line) for line in (tmp_path / "v" / "metrics.jsonl").read_text().splitlines()]
    best_val = max(rounds, key=lambda r: (r["val_global_acc"], -r["round"]))
    assert s["global_acc"]["validation_round"] == best_val["round"]
    assert s["global_acc"]["validation_selected"] == best_val["global_acc"]


def test_heldout_clients_never_train_and_are_scored(tmp_path) -> None:
    from fedskew.config import make_config
    from fedskew.data.federated import build_federated
    from fedskew.runner import run_experiment

    cfg = make_config({"clients": 6, "heldout_clients": 2, "rounds": 2, "local_epochs": 1, "db": None})
    data = build_federated(cfg)
    assert [c.cid for c in data.clients] == [0, 1, 2, 3] and [c.cid for c in data.heldout] == [4, 5]
    assert data.train_hists.shape[0] == 4 and int(data.local_owner.max()) == 3
    trained = set(np.concatenate([c.train_index for c in data.clients]).tolist())
    assert not trained & set(np.concatenate([c.train_index for c in data.heldout]).tolist())
    with pytest.raises(Exception, match="must leave clients that train"):
        make_config({"clients": 3, "heldout_clients": 3, "db": None})

    def run(out: str, eval_every: int) -> dict:
        c = make_config(
            {
                "method": "ditto",
                "clients": 6,
                "heldout_clients": 2,
                "rounds": 3,
                "local_epochs": 1,
                "eval_every": eval_every,
                "out": str(tmp_path / out),
                "db": None,
            }
        )
        return run_experiment(c).summary

    a, b = run("a", 1), run("b", 3)
    # scoring (and adapting) the held-out clients at every round leaves the federation's training untouched
    assert a["global_acc"]["final"] == b["global_acc"]["final"]
    assert a["personal_acc"]["final"] == b["personal_acc"]["final"]
    assert 0 <= a["heldout_acc"]["final"] <= 1
    assert a["heldout_adapted_acc_mean"]["final"] > a["heldout_acc_mean"]["final"]  # Ditto's local round helps
    assert "held-out" in a["evaluation"]["clients"]


def test_the_tuning_table_names_its_protocol(tmp_path, capsys) -> None:
    argv = ["tune", "--methods", "fedavg", "--trials", "1", "--rounds", "2", "--clients", "4", "--quiet"]
    assert main([*argv, "--out", str(tmp_path / "t")]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "evaluation protocol: global_acc, the mean of the last" in out and "validation splits" in out
    assert "the test data is never read" in out
