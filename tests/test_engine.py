"""The round loop: determinism, sampling, evaluation views, the run directory and the database."""

import json
import sqlite3
from pathlib import Path

import numpy as np
import pytest
import torch

from fedskew.cli import main
from fedskew.config import make_config
from fedskew.data.federated import build_federated
from fedskew.engine.loop import Simulation, payload_bytes, sample_clients
from fedskew.protocol import TIMING_KEYS
from fedskew.results.rundir import RunDirectory, RunDirError
from fedskew.runner import run_experiment


def _strip_timing(line: str) -> dict:
    rec = json.loads(line)
    for k in TIMING_KEYS:
        rec.pop(k)
    return rec


def test_two_runs_same_config_are_identical_except_timing(tmp_path):
    lines = []
    for i in range(2):
        cfg = make_config(
            None, {"clients": 6, "rounds": 3, "join_ratio": 0.5, "seed": 11, "out": str(tmp_path / f"r{i}"), "db": None}
        )
        run_experiment(cfg)
        lines.append((tmp_path / f"r{i}" / "metrics.jsonl").read_text().splitlines())
    assert len(lines[0]) == 3
    a = [_strip_timing(x) for x in lines[0]]
    b = [_strip_timing(x) for x in lines[1]]
    assert a == b
    # and the stripped lines are byte-identical once re-serialized
    assert [json.dumps(x, sort_keys=True) for x in a] == [json.dumps(x, sort_keys=True) for x in b]


def test_different_seeds_differ(tmp_path):
    accs = []
    for s in (1, 2):
        cfg = make_config(None, {"clients": 5, "rounds": 2, "seed": s, "out": str(tmp_path / f"s{s}"), "db": None})
        accs.append([r["global_local_acc"] for r in run_experiment(cfg).records])
    assert accs[0] != accs[1]


def test_sampling_is_seeded_and_respects_join_ratio():
    a = [sample_clients(5, r, 20, 0.25) for r in range(1, 6)]
    b = [sample_clients(5, r, 20, 0.25) for r in range(1, 6)]
    assert a == b
    assert all(len(s) == 5 and len(set(s)) == 5 for s in a)
    assert len({tuple(s) for s in a}) > 1  # rounds differ
    assert sample_clients(5, 1, 20, 1.0) == list(range(20))


def test_payload_counts_masks_as_bits():
    assert payload_bytes({"w": torch.zeros(10), "m": torch.zeros(16, dtype=torch.bool)}) == 40 + 2


def test_learning_happens_and_views_are_consistent(tiny_digits_config):
    cfg = tiny_digits_config.model_copy(update={"rounds": 8})
    data = build_federated(cfg)
    sim = Simulation(cfg, data)
    recs = sim.run()
    assert recs[-1]["global_acc"] > 0.5  # 10 classes: chance is 0.1
    last = recs[-1]
    assert 0 <= last["global_local_acc_worst10"] <= last["global_local_acc_mean"] <= 1
    # sample-weighted view equals total correct over total test samples
    rec, scores = sim.evaluate()
    s = scores["global_local"]
    assert rec["global_local_acc"] == pytest.approx(s.correct.sum() / s.count.sum())
    assert s.count.sum() == sum(len(c.y_test) for c in data.clients)
    assert last["bytes_up"] == last["bytes_down"] == cfg.clients * payload_bytes(sim.global_params)


def test_eval_cadence(tiny_digits_config):
    cfg = tiny_digits_config.model_copy(update={"rounds": 5, "eval_every": 2})
    recs = Simulation(cfg, build_federated(cfg)).run()
    assert [r["evaluated"] for r in recs] == [False, True, False, True, True]
    assert "global_acc" not in recs[0]


def test_run_directory_and_database(tiny_digits_config):
    cfg = tiny_digits_config
    out = run_experiment(cfg)
    files = sorted(p.name for p in out.run_dir.iterdir())
    assert files == [
        "client_metrics.jsonl",
        "clients.json",
        "config.yaml",
        "metrics.jsonl",
        "skew.jsonl",
        "status.json",
        "summary.json",
    ]
    summary = json.loads((out.run_dir / "summary.json").read_text())
    assert summary["seed"] == 3 and summary["rounds"] == 3 and "fedskew_version" in summary
    assert summary["global_acc"]["best"] == max(r["global_acc"] for r in out.records)
    hist = json.loads((out.run_dir / "clients.json").read_text())
    assert np.array(hist["train"]).sum() + np.array(hist["test"]).sum() + sum(hist["global_test"]) == 1797

    con = sqlite3.connect(cfg.db)
    assert con.execute("SELECT count(*) FROM runs").fetchone()[0] == 1
    assert con.execute("SELECT count(*) FROM rounds").fetchone()[0] == 3
    n_rows = con.execute("SELECT count(*) FROM client_metrics WHERE view='global_local'").fetchone()[0]
    assert n_rows == 3 * cfg.clients
    acc = con.execute("SELECT global_acc FROM rounds WHERE round=3").fetchone()[0]
    assert acc == pytest.approx(out.records[-1]["global_acc"])


def test_existing_run_dir_is_not_overwritten(tiny_digits_config):
    run_experiment(tiny_digits_config.model_copy(update={"db": None}))
    rounds = tiny_digits_config.rounds
    with pytest.raises(RunDirError, match=rf"holds a finished run \({rounds} round\(s\)\): .*--overwrite"):
        run_experiment(tiny_digits_config.model_copy(update={"db": None}))
    # resuming a finished run says why nothing resumes and how to get more rounds
    with pytest.raises(RunDirError, match=rf"\({rounds} round\(s\)\): there is nothing to resume.*--rounds"):
        RunDirectory.prepare(Path(tiny_digits_config.out), resume=True)


def test_failed_run_leaves_nothing(tiny_digits_config, monkeypatch):
    def boom(self, rnd):
        raise RuntimeError("boom")

    monkeypatch.setattr(Simulation, "round", boom)
    with pytest.raises(RuntimeError):
        run_experiment(tiny_digits_config)
    parent = Path(tiny_digits_config.out).parent
    assert [p.name for p in parent.iterdir() if p.name.startswith(".run") or p.name == "run"] == []
    assert not Path(tiny_digits_config.db).exists()


def test_cli_run_methods_and_report(tmp_path, capsys):
    db = str(tmp_path / "r.db")
    for seed in (0, 1):
        code = main(
            [
                "run",
                "--clients",
                "4",
                "--rounds",
                "2",
                "--seed",
                str(seed),
                "--quiet",
                "--out",
                str(tmp_path / f"s{seed}"),
                "--db",
                db,
            ]
        )
        assert code == 0
    code = main(
        [
            "run",
            "--clients",
            "4",
            "--rounds",
            "2",
            "-m",
            "weights=uniform",
            "--quiet",
            "--out",
            str(tmp_path / "u"),
            "--db",
            db,
        ]
    )
    assert code == 0
    capsys.readouterr()
    assert main(["report", "--db", db]) == 0
    table = capsys.readouterr().out
    rows = [ln for ln in table.splitlines() if ln.startswith("| fedavg")]
    assert len(rows) == 2  # two configs: sample-weighted (2 seeds) and uniform (1 seed)
    assert "2 (0,1)" in table and "weights=uniform" in table
    assert main(["methods"]) == 0
    assert "fedavg" in capsys.readouterr().out


def test_mnist_dirichlet_run(tmp_path, shared_data):
    d = shared_data("mnist")
    out = tmp_path / "mnist"
    code = main(
        [
            "run",
            "--dataset",
            "mnist",
            "--data-dir",
            str(d),
            "--partition",
            "dir",
            "--alpha",
            "0.1",
            "--clients",
            "20",
            "--rounds",
            "1",
            "--model",
            "mlp",
            "--out",
            str(out),
            "--no-db",
            "--quiet",
        ]
    )
    assert code == 0
    assert {"config.yaml", "metrics.jsonl", "summary.json"} <= {p.name for p in out.iterdir()}
    rec = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert rec["global_acc"] > 0.3


def test_client_local_buffers(tmp_path):
    """FedSA with buffers=local: the server leaves BN buffers alone, each client keeps and evaluates with its own."""
    cfg = make_config(
        None,
        {
            "clients": 3,
            "rounds": 2,
            "model": "resnet8",
            "method": "fedsa",
            "method_args": {"buffers": "local"},
            "db": None,
            "skew_probes": 0,
        },
    )
    sim = Simulation(cfg, build_federated(cfg))
    init = {k: v.clone() for k, v in sim.global_params.items()}
    recs = sim.run()
    shared = {k: v for k, v in init.items() if k not in sim.local_names}
    assert recs[-1]["bytes_up"] == recs[-1]["bytes_down"] == 3 * payload_bytes(shared)  # local buffers never travel
    assert sim.local_names and all("running" in k or "num_batches" in k for k in sim.local_names)
    for k in sim.local_names:
        assert torch.equal(sim.global_params[k], init[k])  # the server never touched them
    own = sim.client_states[0]["local_params"]
    key = next(k for k in own if k.endswith("running_mean"))
    assert not torch.equal(own[key], init[key])
    assert torch.equal(sim.params_for(0)[key], own[key])  # what client 0 receives and evaluates with
    assert not torch.equal(sim.client_states[1]["local_params"][key], own[key])
