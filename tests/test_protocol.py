"""The PFLlib protocol preset: merged pool, blocked classes, least_samples, client-local BN buffers, headline."""

import numpy as np
import pytest

from fedskew.config import ConfigError, make_config
from fedskew.data.federated import build_federated
from fedskew.engine.loop import Simulation
from fedskew.runner import run_experiment


def test_preset_defaults_and_overrides():
    cfg = make_config(None, {"protocol": "pfllib"})
    assert (cfg.batch_size, cfg.lr, cfg.train_ratio, cfg.clients) == (10, 0.005, 0.75, 20)
    cfg = make_config({"protocol": "pfllib", "lr": 0.1}, {"batch_size": 32})
    assert (cfg.batch_size, cfg.lr) == (32, 0.1)
    with pytest.raises(ConfigError, match="protocol"):
        make_config(None, {"protocol": "flwr"})


def test_pfllib_blocked_pathological_on_merged_pool(shared_data):
    d = shared_data("mnist")
    cfg = make_config(
        None,
        {
            "protocol": "pfllib",
            "dataset": "mnist",
            "data_dir": str(d),
            "partition": "pat",
            "classes_per_client": 2,
            "db": None,
        },
    )
    data = build_federated(cfg)
    hist = data.train_hists + data.test_hists
    assert hist.sum() == 70_000  # official train + test merged
    for cid in range(20):
        assert set(np.flatnonzero(hist[cid])) == {2 * (cid // 4), 2 * (cid // 4) + 1}
    assert len(data.y_test) == data.test_hists.sum()  # the global test set is the clients' test splits


def test_pfllib_dir_uses_least_samples_and_iid_is_all_classes():
    cfg = make_config(None, {"protocol": "pfllib", "partition": "dir", "alpha": 0.5, "db": None, "clients": 10})
    data = build_federated(cfg)
    least = int(min(10 / 0.25, 1797 / 10 / 2))
    assert (data.train_hists + data.test_hists).sum(1).min() >= least
    cfg = make_config(None, {"protocol": "pfllib", "partition": "iid", "db": None, "clients": 10})
    assert (build_federated(cfg).train_hists > 0).sum(1).min() >= 9
    with pytest.raises(ConfigError, match="protocol 'pfllib' supports"):  # refused before any data is read
        make_config(None, {"protocol": "pfllib", "partition": "niid2", "db": None})


def test_pfllib_keeps_buffers_on_clients_and_reports_best_round(tmp_path):
    cfg = make_config(
        None,
        {
            "protocol": "pfllib",
            "clients": 4,
            "rounds": 2,
            "model": "resnet8",
            "db": None,
            "skew_probes": 0,
            "out": str(tmp_path / "r"),
        },
    )
    sim = Simulation(cfg, build_federated(cfg))
    assert sim.local_names and all("running" in k or "num_batches" in k for k in sim.local_names)
    out = run_experiment(cfg.model_copy(update={"model": "mlp"}))
    h = out.summary["headline"]
    assert h["metric"] == "global_local_acc" and h["statistic"] == "best"
    assert h["value"] == max(r["global_local_acc"] for r in out.records)
