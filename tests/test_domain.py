"""Domain-skew federations (FedHEAL's setting) and the per-domain fairness metrics."""

import numpy as np
import pytest
from conftest import fake_domains_config

import fedskew.data.federated as fed
from fedskew.config import ConfigError, make_config
from fedskew.data.partition import PartitionError
from fedskew.engine.evaluate import ClientScores, domain_summary
from fedskew.engine.loop import Simulation


def test_domain_federation_layout(tmp_path, fake_domains):
    data = fed.build_federated(fake_domains_config(tmp_path))
    assert data.domains == ("a", "b", "c")
    assert data.client_domain.tolist() == [0, 0, 1, 1, 2, 2]
    sizes = [len(c.y_train) + len(c.y_test) for c in data.clients]
    assert sizes == [100, 100, 20, 20, 50, 50]  # 10% of each domain's training set
    assert data.test_domain.tolist() == [0] * 50 + [1] * 30 + [2] * 40
    assert data.x_test.shape[0] == 120


def test_domain_metrics_recorded(tmp_path, fake_domains):
    cfg = fake_domains_config(tmp_path)
    recs = Simulation(cfg, fed.build_federated(cfg)).run()
    r = recs[-1]
    accs = [r[f"domain_acc/{d}"] for d in "abc"]
    assert r["domain_acc_avg"] == pytest.approx(np.mean(accs))
    assert r["domain_acc_std"] == pytest.approx(np.std(accs, ddof=1))
    # pooled accuracy weighs domains by their test sizes
    assert r["global_acc"] == pytest.approx(np.dot(accs, [50, 30, 40]) / 120)


def test_domain_summary_matches_paper_std():
    # FedHEAL Table 2, FedAvg on Digits: 89.84 / 93.25 / 79.54 / 41.35 -> AVG 76.00, STD 23.82 (sample std)
    acc = np.array([89.84, 93.25, 79.54, 41.35]) / 100
    s = domain_summary(("m", "u", "s", "y"), ClientScores(acc * 100, np.zeros(4), np.full(4, 100.0)))
    assert s["domain_acc_avg"] == pytest.approx(0.7600, abs=5e-5)
    assert s["domain_acc_std"] == pytest.approx(0.2382, abs=5e-5)


def test_uneven_clients_and_mismatched_settings(tmp_path, fake_domains):
    with pytest.raises(PartitionError, match="split evenly"):
        fed.build_federated(fake_domains_config(tmp_path, clients=7))
    with pytest.raises(ConfigError, match="domain"):
        make_config(None, {"dataset": "digits_domains", "partition": "dir"})
    with pytest.raises(ConfigError, match="domain"):
        make_config(None, {"dataset": "digits", "partition": "domain"})


def test_global_long_tail_combines_with_any_partition():
    from fedskew.config import make_config as mk

    for partition in ("dir", "iid"):
        data = fed.build_federated(
            mk(None, {"imbalance_ratio": 10.0, "partition": partition, "clients": 4, "db": None})
        )
        counts = (data.train_hists + data.test_hists).sum(0)
        assert counts[0] >= 9 * counts[-1]  # head class ~10x the tail class
        assert np.all(np.diff(counts) <= 1)  # non-increasing class sizes
