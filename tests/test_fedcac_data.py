"""The FedCAC data protocol: fixed-size client train/test draws sharing one class mix, preset, headline."""

import numpy as np
import pytest
import torch

from fedskew.config import ConfigError, make_config
from fedskew.data.federated import build_federated
from fedskew.data.partition import PartitionError, client_class_proportions
from fedskew.data.pools import to_float
from fedskew.data.readers import ImageDataset
from fedskew.recorder import headline
from fedskew.runner import run_experiment
from fedskew.seeding import Purpose, numpy_rng

NUM_CLASSES = 6


def _encoded(n: int, split: int, labels: np.ndarray) -> np.ndarray:
    """Images whose pixels carry (split, index // 256, index % 256, label) so a client's samples can be traced."""
    x = np.zeros((n, 1, 4, 4), np.uint8)
    idx = np.arange(n)
    x[:, 0, 0, 0] = split
    x[:, 0, 0, 1] = idx // 256
    x[:, 0, 0, 2] = idx % 256
    x[:, 0, 0, 3] = labels
    return x


def _decode(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """(split marker, index) of float images made by :func:`_encoded` (to_float maps v to v/127.5 - 1)."""
    px = np.rint((x[:, 0, 0, :3].cpu().numpy() + 1.0) * 127.5).astype(np.int64)
    return px[:, 0], px[:, 1] * 256 + px[:, 2]


def _dataset(n_train_per_class: int = 120, n_test_per_class: int = 40, with_test: bool = True) -> ImageDataset:
    y_tr = np.repeat(np.arange(NUM_CLASSES), n_train_per_class)
    y_te = np.repeat(np.arange(NUM_CLASSES), n_test_per_class)
    return ImageDataset(
        "synthetic",
        _encoded(len(y_tr), 0, y_tr),
        y_tr,
        _encoded(len(y_te), 255, y_te) if with_test else None,
        y_te if with_test else None,
        NUM_CLASSES,
    )


def _cfg(**kw):
    base = {"protocol": "fedcac", "clients": 8, "samples_per_client": 60, "test_samples_per_client": 20, "db": None}
    return make_config(None, {**base, **kw})


def _largest_remainder(q: np.ndarray, total: int) -> np.ndarray:
    raw = q / q.sum() * total
    base = np.floor(raw).astype(np.int64)
    rest = total - int(base.sum())
    frac = raw - base
    order = sorted(range(len(q)), key=lambda c: (-frac[c], c))  # largest remainder first, ties to the lower class
    base[order[:rest]] += 1
    return base


def test_preset_defaults_and_overrides(tmp_path):
    cfg = make_config(None, {"protocol": "fedcac"})
    assert (cfg.clients, cfg.samples_per_client, cfg.test_samples_per_client) == (40, 500, 100)
    assert (cfg.local_epochs, cfg.batch_size, cfg.lr, cfg.momentum) == (5, 100, 0.1, 0.9)
    assert (cfg.partition, cfg.alpha) == ("dirfixed", 0.1)
    cfg = make_config({"protocol": "fedcac", "lr": 0.05, "partition": "pat"}, {"clients": 20, "batch_size": None})
    assert (cfg.lr, cfg.partition, cfg.clients, cfg.batch_size) == (0.05, "pat", 20, 100)
    assert make_config().test_samples_per_client == 100  # the key exists (unused) under the other protocols
    with pytest.raises(ConfigError, match="test_samples_per_client"):
        make_config(None, {"protocol": "fedcac", "test_samples_per_client": 0})


@pytest.mark.parametrize("partition", ["dir", "iid", "niid2", "quantity"])
def test_other_partitions_refused(partition):
    with pytest.raises(ConfigError, match=f"fedcac.*'{partition}'"):
        make_config(None, {"protocol": "fedcac", "partition": partition})


def test_imbalance_ratio_refused():
    with pytest.raises(ConfigError, match="imbalance_ratio"):
        make_config(None, {"protocol": "fedcac", "imbalance_ratio": 10.0})


def test_dirfixed_fixed_sizes_and_shared_proportions():
    ds = _dataset()
    cfg = _cfg(alpha=0.5, seed=3)
    data = build_federated(cfg, dataset=ds)
    assert data.num_clients == 8
    q = client_class_proportions(8, NUM_CLASSES, 0.5, numpy_rng(3, Purpose.PARTITION))
    for cid, client in enumerate(data.clients):
        assert len(client.y_train) == 60 and len(client.y_test) == 20
        train_split, train_idx = _decode(client.x_train)
        test_split, test_idx = _decode(client.x_test)
        assert (train_split == 0).all() and (test_split == 255).all()  # train from train, test from test split
        assert len(set(train_idx)) == 60 and len(set(test_idx)) == 20  # no repeats within a client
        assert np.array_equal(ds.y_train[train_idx], client.y_train.numpy())
        assert np.array_equal(ds.y_test[test_idx], client.y_test.numpy())
        np.testing.assert_array_equal(data.train_hists[cid], _largest_remainder(q[cid], 60))
        np.testing.assert_array_equal(data.test_hists[cid], _largest_remainder(q[cid], 20))
        assert set(np.flatnonzero(data.test_hists[cid])) <= set(np.flatnonzero(q[cid] > 0))
    # alpha 0.5 over 6 classes: the clients' mixes differ
    assert len({tuple(h) for h in data.train_hists}) > 1


def test_pathological_exactly_k_classes_in_train_and_test():
    data = build_federated(_cfg(partition="pat", classes_per_client=3, samples_per_client=50), dataset=_dataset())
    for cid in range(data.num_clients):
        support = np.flatnonzero(data.train_hists[cid])
        assert len(support) == 3
        assert np.array_equal(np.flatnonzero(data.test_hists[cid]), support)
        q = np.zeros(NUM_CLASSES)
        q[support] = 1 / 3
        np.testing.assert_array_equal(data.train_hists[cid], _largest_remainder(q, 50))  # 17, 17, 16
        np.testing.assert_array_equal(data.test_hists[cid], _largest_remainder(q, 20))  # 7, 7, 6
    assert len({tuple(np.flatnonzero(h)) for h in data.train_hists}) > 1  # random classes, not blocks


def test_pathological_more_classes_than_present_refused():
    with pytest.raises(PartitionError, match="classes_per_client=7"):
        build_federated(_cfg(partition="pat", classes_per_client=7), dataset=_dataset())


def test_deterministic_per_seed_and_different_across_seeds():
    ds = _dataset()
    a = build_federated(_cfg(seed=1), dataset=ds)
    b = build_federated(_cfg(seed=1), dataset=ds)
    c = build_federated(_cfg(seed=2), dataset=ds)
    for ca, cb in zip(a.clients, b.clients, strict=True):
        assert torch.equal(ca.x_train, cb.x_train) and torch.equal(ca.x_test, cb.x_test)
    assert np.array_equal(a.train_hists, b.train_hists) and np.array_equal(a.test_hists, b.test_hists)
    assert not np.array_equal(a.train_hists, c.train_hists)


def test_global_test_set_is_the_official_test_split():
    ds = _dataset()
    data = build_federated(_cfg(), dataset=ds)
    assert torch.equal(data.x_test, to_float(ds.x_test, "cpu"))
    assert torch.equal(data.y_test, torch.from_numpy(ds.y_test))
    assert torch.equal(data.local_y, torch.cat([c.y_test for c in data.clients]))
    assert data.local_owner.tolist() == [cid for cid in range(8) for _ in range(20)]


def test_without_official_test_split_draws_tests_from_the_holdout():
    ds = _dataset(with_test=False)
    data = build_federated(_cfg(holdout=0.25), dataset=ds)
    assert len(data.y_test) == NUM_CLASSES * 30  # stratified 25% of 120 per class
    _, hold = _decode(data.x_test)
    for client in data.clients:
        _, tr = _decode(client.x_train)
        _, te = _decode(client.x_test)
        assert len(client.y_train) == 60 and len(client.y_test) == 20
        assert set(te) <= set(hold) and not set(tr) & set(hold)


def test_test_pool_missing_a_class_is_refused():
    ds = _dataset()
    keep = ds.y_test != 2
    ds = ImageDataset(ds.name, ds.x_train, ds.y_train, ds.x_test[keep], ds.y_test[keep], NUM_CLASSES)
    with pytest.raises(PartitionError, match="class 2"):
        build_federated(_cfg(alpha=1.0), dataset=ds)
    # a class only the test pool has gets no client samples (q is over the training pool's classes)
    ds = _dataset()
    keep = ds.y_train != 5
    ds = ImageDataset(ds.name, ds.x_train[keep], ds.y_train[keep], ds.x_test, ds.y_test, NUM_CLASSES)
    data = build_federated(_cfg(alpha=1.0), dataset=ds)
    assert data.train_hists[:, 5].sum() == data.test_hists[:, 5].sum() == 0
    assert data.test_hists.sum(1).tolist() == [20] * 8
    assert len(data.y_test) == NUM_CLASSES * 40


def test_class_pool_too_small_is_refused():
    with pytest.raises(PartitionError, match="needs"):
        build_federated(_cfg(partition="pat", classes_per_client=1, test_samples_per_client=41), dataset=_dataset())


def test_headline_best_personal_mean_else_global_local_mean(tmp_path):
    cfg = make_config(None, {"protocol": "fedcac"})
    stats = {"best": 0.9, "best_round": 3, "last_n_mean": 0.8, "last_n_std": 0.01, "final": 0.8}
    summary = {"personal_acc_mean": stats, "global_local_acc_mean": {**stats, "best": 0.5}, "global_acc": stats}
    head = {"metric": "personal_acc_mean", "statistic": "best", "value": 0.9, "protocol": "fedcac"}
    assert headline(cfg, summary) == head
    del summary["personal_acc_mean"]
    head = {"metric": "global_local_acc_mean", "statistic": "best", "value": 0.5, "protocol": "fedcac"}
    assert headline(cfg, summary) == head
    # end to end with FedAvg on the embedded digits (no official test split: the holdout is the test pool)
    cfg = make_config(
        None,
        {
            "protocol": "fedcac",
            "clients": 4,
            "samples_per_client": 40,
            "test_samples_per_client": 10,
            "local_epochs": 1,
            "batch_size": 20,
            "rounds": 2,
            "model": "mlp",
            "skew_probes": 0,
            "db": None,
            "out": str(tmp_path / "r"),
        },
    )
    out = run_experiment(cfg)
    h = out.summary["headline"]
    assert h["metric"] == "global_local_acc_mean" and h["statistic"] == "best"
    assert h["value"] == max(r["global_local_acc_mean"] for r in out.records)
    assert out.data.num_train.tolist() == [40] * 4


def test_mnist_fedcac_20_clients(shared_data):
    d = shared_data("mnist")
    cfg = make_config(None, {"protocol": "fedcac", "dataset": "mnist", "data_dir": str(d), "clients": 20, "db": None})
    data = build_federated(cfg)
    assert data.train_hists.sum(1).tolist() == [500] * 20
    assert data.test_hists.sum(1).tolist() == [100] * 20
    assert len(data.y_test) == 10_000  # the official test split
    q = client_class_proportions(20, 10, 0.1, numpy_rng(cfg.seed, Purpose.PARTITION))
    for cid in range(20):
        np.testing.assert_array_equal(data.train_hists[cid], _largest_remainder(q[cid], 500))
        np.testing.assert_array_equal(data.test_hists[cid], _largest_remainder(q[cid], 100))
