"""Flower's niid_bench partitions (adap/flower, baselines/niid_bench/niid_bench/dataset_preparation.py) against
short ports of its code: under ``--partition-rng raw`` at data seed 42, fedskew's NIID-Bench partitions are Flower's,
client for client (#C=k, Dir(α), IID), which is what lets tools/flower_niid_probe.py run Flower's own methods on the
partition fedskew trains."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedskew.config import make_config
from fedskew.data.federated import build_federated
from fedskew.data.partition import make_partition


def _labels(seed: int, n: int, k: int = 10) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, k, size=n)


def _cfg(**kw: object):
    return make_config({"protocol": "niid-bench", "dataset": "digits", "model": "mlp", "db": None, **kw})


def port_flower_label_quantity(y: np.ndarray, n_clients: int, k: int, seed: int) -> list[np.ndarray]:
    """Flower's niid_bench ``partition_data_label_quantity`` (baselines/niid_bench/niid_bench/dataset_preparation.py):
    NIID-Bench's #C=k drawn with ``prng = np.random.default_rng(seed)`` (42 in every one of Flower's runs), its extra
    classes by ``prng.choice(K, 1)[0]``, each class's indices shuffled in place by the same generator."""
    prng = np.random.default_rng(seed)
    K = len(set(y.tolist()))
    times, contains = [0] * K, []
    for i in range(n_clients):
        current = [i % K]
        times[i % K] += 1
        while len(current) < k:
            index = prng.choice(K, 1)[0]
            if index not in current:
                current.append(index)
                times[index] += 1
        contains.append(current)
    idx_clients: list[list[int]] = [[] for _ in range(n_clients)]
    for c in range(K):
        idx_k = np.where(y == c)[0]
        prng.shuffle(idx_k)
        pieces = np.array_split(idx_k, times[c])
        for ids, j in enumerate(j for j in range(n_clients) if c in contains[j]):
            idx_clients[j] += pieces[ids].tolist()
    return [np.sort(np.asarray(p, dtype=np.int64)) for p in idx_clients]


@pytest.mark.parametrize("k", [2, 3])
def test_raw_partition_rng_at_data_seed_42_is_flowers_partition(k: int) -> None:
    """--partition-rng raw: the partition's generator is default_rng(federation seed) itself, so NIID-Bench's #C=k at
    data seed 42 is Flower's niid_bench partition, client for client (all three of its runs train that one); the
    default (derived) stays the partition's own stream of the seed, and a run's identity names raw only."""
    from fedskew.config import ConfigError
    from fedskew.data.niid_bench import niid_bench_parts
    from fedskew.seeding import Purpose, numpy_rng, partition_generator

    y = _labels(seed=11, n=2000)
    raw = _cfg(partition="pat", classes_per_client=k, seed=3, data_seed=42, partition_rng="raw")
    ours = niid_bench_parts(raw.data_settings(), y)
    flower = port_flower_label_quantity(y, 10, k, 42)
    assert [len(p) for p in ours] == [len(p) for p in flower]
    for mine, theirs in zip(ours, flower, strict=True):
        np.testing.assert_array_equal(np.sort(mine), theirs)
    derived = _cfg(partition="pat", classes_per_client=k, data_seed=42)
    assert derived.partition_rng == "derived"
    again = make_partition("pat", y, 10, numpy_rng(42, Purpose.PARTITION), classes_per_client=k, scheme="niid-bench")
    assert all(np.array_equal(a, b) for a, b in zip(niid_bench_parts(derived.data_settings(), y), again, strict=True))
    assert any(not np.array_equal(np.sort(a), b) for a, b in zip(again, flower, strict=True))  # a different draw
    assert "partition_rng" not in derived.identity() and raw.identity()["partition_rng"] == "raw"
    assert partition_generator(42, "raw").integers(1 << 30) == np.random.default_rng(42).integers(1 << 30)
    with pytest.raises(ValueError, match="partition_rng must be 'derived' or 'raw', got 'flower'"):
        partition_generator(42, "flower")
    with pytest.raises(ConfigError, match="partition_rng"):
        _cfg(partition_rng="flower")


def test_flowers_fmnist_partition_from_the_official_files(shared_data) -> None:
    """Flower's FMNIST #C=2 clients (sizes 4,000 to 9,000, client 0 with classes 0 and 7) from the official files."""
    root = shared_data("fashion-mnist")
    cfg = make_config(
        {
            "protocol": "niid-bench",
            "dataset": "fmnist",
            "data_dir": str(root.parent),
            "partition": "pat",
            "classes_per_client": 2,
            "data_seed": 42,
            "partition_rng": "raw",
            "model": "lenet",
            "db": None,
        }
    )
    data = build_federated(cfg)
    sizes = [len(c.y_train) for c in data.clients]
    assert sizes == [4000, 9000, 5000, 8000, 5000, 5000, 6000, 4000, 6000, 8000]
    assert sorted(torch.unique(data.clients[0].y_train).tolist()) == [0, 7]


def port_flower_dirichlet(y: np.ndarray, n_clients: int, alpha: float, seed: int) -> list[np.ndarray]:
    """Flower's niid_bench ``partition_data_dirichlet`` (baselines/niid_bench/niid_bench/dataset_preparation.py), the
    oracle: one ``default_rng(seed)`` for every draw; per class, its indices shuffled in place, then Dir(α) shares with
    the clients already at N/n or above zeroed, cut at ``int(cumsum · n_c)``; the whole draw again until every client
    holds at least 10."""
    prng = np.random.default_rng(seed)
    smallest = 0
    while smallest < 10:
        held: list[list[int]] = [[] for _ in range(n_clients)]
        for c in range(len(set(y.tolist()))):
            idx_c = np.where(y == c)[0]
            prng.shuffle(idx_c)
            share = prng.dirichlet(np.repeat(alpha, n_clients))
            share = np.array([p * (len(h) < len(y) / n_clients) for p, h in zip(share, held, strict=True)])
            cuts = (np.cumsum(share / share.sum()) * len(idx_c)).astype(int)[:-1]
            held = [h + part.tolist() for h, part in zip(held, np.split(idx_c, cuts), strict=True)]
            smallest = min(len(h) for h in held)
    return [np.sort(np.asarray(h, dtype=np.int64)) for h in held]


@pytest.mark.parametrize("alpha", [0.5, 0.1])
def test_raw_partition_rng_at_data_seed_42_is_flowers_dirichlet_partition(alpha: float) -> None:
    """NIID-Bench's Dir(α) under --partition-rng raw at data seed 42 is Flower's niid_bench partition, client for
    client (tools/flower_niid_probe.py runs Flower's own code on it); α 0.1 redraws (a client under 10 samples)."""
    from fedskew.data.niid_bench import niid_bench_parts

    y = _labels(seed=4, n=600)
    raw = _cfg(partition="dir", alpha=alpha, data_seed=42, partition_rng="raw")
    ours = niid_bench_parts(raw.data_settings(), y)
    flower = port_flower_dirichlet(y, 10, alpha, 42)
    for mine, theirs in zip(ours, flower, strict=True):
        np.testing.assert_array_equal(np.sort(mine), theirs)
    derived = niid_bench_parts(_cfg(partition="dir", alpha=alpha, data_seed=42).data_settings(), y)
    assert any(not np.array_equal(np.sort(a), b) for a, b in zip(derived, flower, strict=True))


def test_flowers_mnist_dirichlet_partition_from_the_official_files(shared_data) -> None:
    """Flower's MNIST Dir(0.5) clients from the official files: the oracle's partition, client for client."""
    import gzip

    root = shared_data("mnist")
    with gzip.open(root / "train-labels-idx1-ubyte.gz") as f:
        y = np.frombuffer(f.read()[8:], dtype=np.uint8).astype(np.int64)
    flower = port_flower_dirichlet(y, 10, 0.5, 42)
    cfg = {"protocol": "niid-bench", "dataset": "mnist", "data_dir": str(root.parent), "partition": "dir"}
    cfg |= {"alpha": 0.5, "data_seed": 42, "partition_rng": "raw", "model": "lenet", "db": None}
    data = build_federated(make_config(cfg))
    assert [len(c.y_train) for c in data.clients] == [6631, 9475, 6099, 6004, 5074, 5106, 7397, 3742, 6052, 4420]
    for client, theirs in zip(data.clients, flower, strict=True):
        assert torch.equal(torch.sort(client.y_train).values, torch.sort(torch.from_numpy(y[theirs])).values)


def test_raw_partition_rng_at_data_seed_42_is_flowers_iid_partition() -> None:
    """Flower's niid_bench ``partition_data`` (similarity 1): ``default_rng(42).choice(n, n, replace=False)`` cut by
    ``array_split``; under --partition-rng raw the NIID-Bench IID partition is that draw, and derived stays its own."""
    from fedskew.data.niid_bench import niid_bench_parts

    y = _labels(seed=4, n=605)
    ours = niid_bench_parts(_cfg(partition="iid", data_seed=42, partition_rng="raw").data_settings(), y)
    draw = np.random.default_rng(42).choice(len(y), len(y), replace=False)
    flower = [np.sort(p) for p in np.array_split(draw, 10)]
    assert [len(p) for p in ours] == [61] * 5 + [60] * 5
    for mine, theirs in zip(ours, flower, strict=True):
        np.testing.assert_array_equal(mine, theirs)
    derived = niid_bench_parts(_cfg(partition="iid", data_seed=42).data_settings(), y)
    assert any(not np.array_equal(a, b) for a, b in zip(derived, flower, strict=True))
