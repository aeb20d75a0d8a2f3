"""Property tests of the client partitions in fedskew.data.partition."""

from __future__ import annotations

import time

import numpy as np
import pytest

from fedskew.data.partition import (
    PARTITIONS,
    PartitionError,
    client_class_proportions,
    dirichlet,
    dirichlet_fixed,
    domain_skew,
    iid,
    label_histograms,
    long_tail,
    make_partition,
    niid2,
    pathological,
    pfllib_least_samples,
    quantity_skew,
    train_test_split_clients,
)


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


@pytest.fixture(scope="module")
def labels() -> np.ndarray:
    """3,000 labels over 10 classes with unequal class sizes, in shuffled order."""
    counts = [400, 350, 330, 310, 300, 290, 280, 270, 250, 220]
    y = np.repeat(np.arange(10), counts)
    return np.random.default_rng(123).permutation(y)


def assert_valid(parts: list[np.ndarray], n: int, *, complete: bool, disjoint: bool = True) -> None:
    for p in parts:
        assert p.dtype == np.int64
        assert np.all(np.diff(p) > 0), "indices must be sorted and unique within a client"
        assert p.size == 0 or (p.min() >= 0 and p.max() < n)
    allidx = np.concatenate(parts)
    if disjoint:
        assert len(np.unique(allidx)) == len(allidx), "a sample was assigned twice"
    if complete:
        assert np.array_equal(np.sort(allidx), np.arange(n)), "not every sample was assigned"


def same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


# ----------------------------------------------------------------------------------------- iid / quantity


def test_iid_balanced(labels):
    parts = iid(labels, 7, rng())
    assert_valid(parts, len(labels), complete=True)
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1


def test_iid_unbalanced_lognormal_sizes(labels):
    parts = iid(labels, 20, rng(1), balanced=False)
    assert_valid(parts, len(labels), complete=True)
    sizes = np.array([len(p) for p in parts])
    assert sizes.min() >= 1 and sizes.max() > 2 * sizes.min()


def test_quantity_skew(labels):
    parts = quantity_skew(labels, 10, rng(2), beta=0.3, min_size=5)
    assert_valid(parts, len(labels), complete=True)
    sizes = np.array([len(p) for p in parts])
    assert sizes.min() >= 5 and sizes.max() > 3 * np.median(sizes) / 2
    with pytest.raises(PartitionError, match="beta"):
        quantity_skew(labels, 10, rng(), beta=0.0)


# ----------------------------------------------------------------------------------------- pathological


@pytest.mark.parametrize("balanced", [True, False])
def test_pathological_random(labels, balanced):
    k = 2
    parts = pathological(labels, 15, k, rng(3), balanced=balanced)
    assert_valid(parts, len(labels), complete=True)
    hist = label_histograms(labels, parts, 10)
    held = hist > 0
    assert np.all(held.sum(axis=1) == k), "every client holds exactly k classes"
    holders = held.sum(axis=0)
    assert holders.min() >= 1 and holders.max() - holders.min() <= 1
    if balanced:  # a class splits equally among its holders
        for c in range(10):
            h = hist[held[:, c], c]
            assert h.max() - h.min() <= 1


def test_pathological_random_needs_cover(labels):
    with pytest.raises(PartitionError, match="n_clients=4"):
        pathological(labels, 4, 2, rng())  # 4 * 2 < 10 classes
    with pytest.raises(PartitionError, match="classes_per_client"):
        pathological(labels, 10, 11, rng())


def test_pathological_pfllib_blocked_assignment():
    # PFLlib MNIST setting on a merged pool (20 clients, 10 classes, 2 per client), labels in arbitrary order
    y = np.random.default_rng(5).permutation(np.repeat(np.arange(10), 700))
    parts = pathological(y, 20, 2, rng(0), scheme="pfllib")
    assert_valid(parts, len(y), complete=True)
    for client, p in enumerate(parts):
        block = client // 4
        assert set(np.unique(y[p]).tolist()) == {2 * block, 2 * block + 1}
    # balanced: the first 3 holders get int(700/4) = 175 of each class, the last the remainder
    hist = label_histograms(y, parts, 10)
    assert hist[0, 0] == 175 and hist[3, 0] == 700 - 3 * 175
    # pool order is kept (PFLlib does not shuffle): client 0 takes the first 175 zeros of the pool
    assert np.array_equal(parts[0][y[parts[0]] == 0], np.flatnonzero(y == 0)[:175])
    # the balanced assignment does not depend on the seed
    assert same(parts, pathological(y, 20, 2, rng(99), scheme="pfllib"))


def test_pathological_pfllib_unbalanced():
    y = np.repeat(np.arange(10), 700)
    parts = pathological(y, 20, 2, rng(1), scheme="pfllib", balanced=False)
    assert_valid(parts, len(y), complete=True)
    hist = label_histograms(y, parts, 10)
    least = pfllib_least_samples(len(y), 20)
    assert least == 40
    for c in range(10):
        holders = np.flatnonzero(hist[:, c])
        assert list(holders) == list(range(4 * (c // 2), 4 * (c // 2) + 4))
        # first m-1 sizes are drawn from [max(per/10, least/C), per)
        assert np.all(hist[holders[:-1], c] >= 17) and np.all(hist[holders[:-1], c] < 175)
    assert not same(parts, pathological(y, 20, 2, rng(2), scheme="pfllib", balanced=False))


def test_pathological_pfllib_runs_out_of_slots():
    y = np.repeat(np.arange(10), 50)
    with pytest.raises(PartitionError, match="free class slot"):
        pathological(y, 3, 2, rng(), scheme="pfllib")
    with pytest.raises(PartitionError, match="unknown pathological scheme"):
        pathological(y, 10, 2, rng(), scheme="blocked")  # type: ignore[arg-type]


# ----------------------------------------------------------------------------------------- dirichlet


@pytest.mark.parametrize("alpha", [0.1, 0.5, 100.0])
def test_dirichlet_complete_and_min_size(labels, alpha):
    parts = dirichlet(labels, 12, alpha, rng(4), min_size=20)
    assert_valid(parts, len(labels), complete=True)
    assert min(len(p) for p in parts) >= 20
    hist = label_histograms(labels, parts, 10)
    assert np.array_equal(hist.sum(axis=0), np.bincount(labels, minlength=10))
    if alpha == 0.1:  # strong label skew: most clients dominated by few classes
        assert np.median(hist.max(axis=1) / hist.sum(axis=1)) > 0.4
    if alpha == 100.0:
        assert np.all(hist.max(axis=1) / hist.sum(axis=1) < 0.3)


def test_dirichlet_without_balance(labels):
    parts = dirichlet(labels, 5, 0.5, rng(5), min_size=1, balance=False)
    assert_valid(parts, len(labels), complete=True)


def test_dirichlet_bounded_failure_is_quick(labels):
    t0 = time.perf_counter()
    with pytest.raises(PartitionError) as err:
        dirichlet(labels, 100, 0.01, rng(6), min_size=25, max_retries=50)
    assert time.perf_counter() - t0 < 5.0
    msg = str(err.value)
    for part in ("n_samples=3000", "n_clients=100", "alpha=0.01", "min_size=25", "retries=50"):
        assert part in msg
    with pytest.raises(PartitionError, match="n_clients\\*min_size > n_samples"):
        dirichlet(labels, 200, 0.5, rng(), min_size=50)


# ----------------------------------------------------------------------------------------- dirichlet_fixed


def test_dirichlet_fixed_overlapping(labels):
    parts = dirichlet_fixed(labels, 40, 0.1, rng(7), samples_per_client=120)
    assert_valid(parts, len(labels), complete=False, disjoint=False)
    assert all(len(p) == 120 for p in parts)
    hist = label_histograms(labels, parts, 10)
    top2 = np.sort(hist, axis=1)[:, -2:].sum(axis=1) / 120
    assert np.median(top2) > 0.7  # alpha=0.1 concentrates each client on few classes
    allidx = np.concatenate(parts)
    assert len(np.unique(allidx)) < len(allidx)  # 40 * 120 > 3000: clients must share samples


def test_dirichlet_fixed_disjoint_and_shared_proportions(labels):
    q = client_class_proportions(10, 10, 0.5, rng(8))
    train = dirichlet_fixed(labels, 10, 0.5, rng(9), samples_per_client=100, disjoint=True, proportions=q)
    assert_valid(train, len(labels), complete=False, disjoint=True)
    assert all(len(p) == 100 for p in train)
    test_pool = np.tile(np.arange(10), 300)
    test = dirichlet_fixed(test_pool, 10, 0.5, rng(10), samples_per_client=20, proportions=q)
    h_tr, h_te = label_histograms(labels, train, 10), label_histograms(test_pool, test, 10)
    assert np.abs(h_tr / 100 - h_te / 20).max() <= 0.1  # same per-client proportions up to rounding


def test_dirichlet_fixed_impossible(labels):
    with pytest.raises(PartitionError, match="disjoint=True"):
        dirichlet_fixed(labels, 40, 1.0, rng(), samples_per_client=100, disjoint=True)
    y = np.repeat(np.arange(2), [5, 500])
    with pytest.raises(PartitionError, match="class 0"):
        dirichlet_fixed(y, 1, 1.0, rng(), samples_per_client=200, proportions=np.array([[0.5, 0.5]]))


# ----------------------------------------------------------------------------------------- niid2


def test_niid2_feddisco_cifar10_shape():
    y = np.random.default_rng(1).permutation(np.repeat(np.arange(10), 5000))
    parts = niid2(y, 5, 1, rng(11))
    assert_valid(parts, len(y), complete=False)
    assert [len(p) for p in parts] == [8330] * 6
    hist = label_histograms(y, parts, 10)
    for i in range(5):
        assert set(np.flatnonzero(hist[i])) == {2 * i, 2 * i + 1}
        assert hist[i, 2 * i] == hist[i, 2 * i + 1] == 5 * 833
    assert np.all(hist[5] == 833)


def test_niid2_general_and_odd_classes(labels):
    parts = niid2(labels, 7, 2, rng(12))
    assert_valid(parts, len(labels), complete=False)
    assert len({len(p) for p in parts}) == 1
    y3 = np.repeat(np.arange(3), 100)
    parts3 = niid2(y3, 2, 1, rng(13))
    assert len({len(p) for p in parts3}) == 1
    with pytest.raises(PartitionError, match="2 classes"):
        niid2(np.zeros(10, dtype=int), 2, 1, rng())


# ----------------------------------------------------------------------------------------- long tail


def test_long_tail_profile():
    y = np.repeat(np.arange(10), 500)
    sub = long_tail(y, 100.0, rng(14))
    assert np.all(np.diff(sub) > 0)
    counts = np.bincount(y[sub], minlength=10)
    expected = np.floor(500 * 100.0 ** (-np.arange(10) / 9) + 1e-9).astype(int)
    assert np.array_equal(counts, expected) and counts[0] == 500 and counts[-1] == 5
    parts = dirichlet(y[sub], 3, 1.0, rng(15), min_size=1)  # combinable with any scheme
    assert_valid(parts, len(sub), complete=True)
    with pytest.raises(PartitionError, match="imbalance_ratio"):
        long_tail(y, 0.5, rng())


# ----------------------------------------------------------------------------------------- domain skew


def test_domain_skew_fedheal_sizes():
    sizes = [60000, 7291, 73257]
    parts = domain_skew(sizes, [5, 5, 5], 0.01, rng(16))
    assert [d for d, _ in parts] == [0] * 5 + [1] * 5 + [2] * 5
    assert [len(p) for _, p in parts] == [600] * 5 + [72] * 5 + [732] * 5
    for d, n in enumerate(sizes):
        assert_valid([p for dd, p in parts if dd == d], n, complete=False)
    with pytest.raises(PartitionError, match="clients_per_domain \\* fraction > 1"):
        domain_skew([100], [3], 0.4, rng())


def test_domain_skew_class_repair():
    y = np.repeat(np.arange(10), [80, 10, 10, 10, 10, 10, 10, 10, 10, 10])
    y = np.random.default_rng(3).permutation(y)
    parts = domain_skew([len(y)], [3], 0.1, rng(17), labels=[y])
    assert_valid([p for _, p in parts], len(y), complete=False)
    for _, p in parts:
        assert len(p) == 17 and set(y[p].tolist()) == set(range(10))


# ----------------------------------------------------------------------------------------- train/test split


def test_train_test_split_clients(labels):
    parts = dirichlet(labels, 8, 0.5, rng(18), min_size=2)
    parts.append(np.array([3, 5], dtype=np.int64))
    train, test = train_test_split_clients(parts, 0.75, rng(19))
    for p, tr, te in zip(parts, train, test, strict=True):
        assert len(tr) >= 1 and len(te) >= 1
        assert np.array_equal(np.sort(np.concatenate([tr, te])), p)
        assert len(np.intersect1d(tr, te)) == 0
        assert len(tr) == min(max(int(np.floor(0.75 * len(p))), 1), len(p) - 1)
    tr2, te2 = train_test_split_clients(parts, 0.75, rng(19))
    assert same(train, tr2) and same(test, te2)
    with pytest.raises(PartitionError, match="client 1 has 1 sample"):
        train_test_split_clients([np.arange(5), np.array([7])], 0.75, rng())
    with pytest.raises(TypeError, match="rng"):
        train_test_split_clients(parts, 0.75)


def test_label_histograms(labels):
    parts = iid(labels, 4, rng(20))
    hist = label_histograms(labels, parts, 12)
    assert hist.shape == (4, 12) and hist.dtype == np.int64
    for i, p in enumerate(parts):
        assert np.array_equal(hist[i], np.bincount(labels[p], minlength=12))
    with pytest.raises(PartitionError, match="labels must lie"):
        label_histograms(labels, parts, 5)


# ----------------------------------------------------------------------------------------- registry


SCHEMES: dict[str, dict[str, object]] = {
    "iid": {},
    "dir": {"alpha": 0.3, "min_size": 10},
    "pat": {"classes_per_client": 2},
    "dirfixed": {"alpha": 0.3, "samples_per_client": 50},
    "niid2": {},
    "biased": {"num_uniform": 2},
    "quantity": {"beta": 0.5},
}


def test_registry_names():
    from fedskew.data.partition.registry import SHIPPED

    assert set(PARTITIONS) == set(SCHEMES) | SHIPPED  # SHIPPED: flwr, tested in tests/test_hf.py


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_make_partition_seeded(labels, name):
    params = SCHEMES[name]
    a = make_partition(name, labels, 10, rng(21), **params)
    b = make_partition(name, labels, 10, rng(21), **params)
    c = make_partition(name, labels, 10, rng(22), **params)
    assert len(a) == 10
    assert same(a, b), "same seed must give the identical partition"
    assert not same(a, c), "different seeds must give different partitions"
    complete = name in {"iid", "dir", "pat", "quantity"}
    assert_valid(a, len(labels), complete=complete, disjoint=name != "dirfixed")
    assert all(len(p) > 0 for p in a)


@pytest.mark.parametrize(
    ("name", "num_clients", "params", "match"),
    [
        ("nope", 5, {}, "unknown partition 'nope'"),
        ("dir", 5, {"alpha": 0.5, "beta": 1}, "does not take \\['beta'\\]"),
        ("dir", 5, {}, "needs parameter\\(s\\) \\['alpha'\\]"),
        ("dir", 5, {"alpha": 0.0}, "alpha must be a finite number > 0"),
        ("dir", 5, {"alpha": -1.0}, "alpha"),
        ("dirfixed", 5, {"alpha": float("nan"), "samples_per_client": 5}, "alpha"),
        ("pat", 5, {"classes_per_client": 11}, "classes_per_client=11 exceeds"),
        ("pat", 5, {"classes_per_client": 0}, "classes_per_client must be >= 1"),
        ("iid", 0, {}, "num_clients must be >= 1"),
        ("iid", 3001, {}, "more clients than samples"),
        ("dir", 3001, {"alpha": 0.5}, "more clients than samples"),
        ("quantity", 2.5, {"beta": 1.0}, "num_clients must be an integer"),
        ("niid2", 3, {"num_unbiased": 4}, "num_unbiased=4 exceeds"),
    ],
)
def test_make_partition_bad_params(labels, name, num_clients, params, match):
    with pytest.raises(PartitionError, match=match):
        make_partition(name, labels, num_clients, rng(), **params)


def test_bad_inputs(labels):
    with pytest.raises(TypeError, match="numpy.random.Generator"):
        iid(labels, 3, 0)  # type: ignore[arg-type]
    with pytest.raises(PartitionError, match="1-D"):
        iid(labels.reshape(2, -1), 3, rng())
    with pytest.raises(PartitionError, match="non-negative"):
        iid(np.array([0, -1, 2]), 2, rng())
    with pytest.raises(PartitionError, match="empty"):
        iid(np.array([], dtype=int), 1, rng())
