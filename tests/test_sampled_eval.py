"""eval_clients: per-client views scored on a seeded sample of clients per evaluated round, every client at the
last round; training never sees it, and a sampled view is exactly the full view restricted to the sample."""

import json

import numpy as np
import pytest
from conftest import digits_simulation

from fedskew.config import ConfigError, make_config
from fedskew.runner import run_experiment


def _run(tmp_path, name: str, **over) -> tuple[list[dict], list[dict], dict]:
    values = {"method": "ditto", "clients": 12, "rounds": 3, "skew_probes": 0, "db": None, "out": str(tmp_path / name)}
    run_experiment(make_config(None, {**values, **over}))
    out = tmp_path / name
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    clients = [json.loads(line) for line in (out / "client_metrics.jsonl").read_text().splitlines()]
    return metrics, clients, json.loads((out / "summary.json").read_text())


def test_eval_sample_is_seeded_sized_and_full_at_the_last_round():
    sim = digits_simulation("ditto", rounds=5, clients=10, eval_clients=4)
    first = [sim.server.eval_sample(r) for r in range(1, 5)]
    again = digits_simulation("ditto", rounds=5, clients=10, eval_clients=4)
    assert first == [again.server.eval_sample(r) for r in range(1, 5)]
    for s in first:
        assert len(s) == 4 and s == sorted(set(s)) and all(0 <= c < 10 for c in s)
    assert len({tuple(s) for s in first}) > 1  # a new sample every round
    assert sim.server.eval_sample(5) is None  # the last round scores everyone
    assert digits_simulation("ditto", rounds=5, clients=10, eval_clients=10).server.eval_sample(1) is None
    assert digits_simulation("ditto", rounds=5, clients=10).server.eval_sample(1) is None


def test_sampled_views_are_the_full_views_on_the_sample(tmp_path):
    full_m, full_c, full_s = _run(tmp_path, "full")
    samp_m, samp_c, samp_s = _run(tmp_path, "sampled", eval_clients=4)
    assert "sampled_evaluation" not in full_s
    assert samp_s["sampled_evaluation"]["clients"] == 4 and samp_s["sampled_evaluation"]["rounds"] == 2
    for f, s, fc, sc in zip(full_m, samp_m, full_c, samp_c, strict=True):
        # training and the global model's views do not depend on what is evaluated
        for key in ("train_loss", "global_acc", "global_local_acc", "global_local_acc_mean"):
            assert f[key] == s[key], key
        rows = {(cid, view): acc for cid, view, acc, *_ in fc["rows"]}
        if s["round"] == 3:  # the last round: everyone, the same numbers
            assert "eval_clients" not in s and fc == sc
            continue
        assert s["eval_clients"] == 4
        scored = sorted({cid for cid, view, *_ in sc["rows"] if view == "personal"})
        assert len(scored) == 4
        assert {cid for cid, view, *_ in sc["rows"] if view == "global_local"} == set(range(12))
        for view in ("personal", "trained"):
            expected = np.mean([rows[(cid, view)] for cid in scored])
            assert s[f"{view}_acc_mean"] == pytest.approx(expected, abs=1e-12)
            assert {cid for cid, v, *_ in sc["rows"] if v == view} == set(scored)


def test_eval_clients_must_be_positive():
    with pytest.raises(ConfigError, match="eval_clients"):
        make_config(None, {"eval_clients": 0})
