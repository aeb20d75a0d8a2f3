"""The ``biased`` partition (issue 30, item 3): FedDisco's biased and uniform clients (its AG News split), of which
``niid2`` is the two-class case; seeded, disjoint, equal sizes, named errors; its configuration key."""

from __future__ import annotations

import numpy as np
import pytest

from fedskew.config import make_config
from fedskew.data.federated import build_federated
from fedskew.data.partition import PartitionError, biased_uniform, label_histograms, make_partition, niid2


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def ag_like(per_class: int = 300) -> np.ndarray:
    """4 balanced classes in shuffled order, as AG News's training split."""
    return rng(9).permutation(np.repeat(np.arange(4), per_class))


def test_biased_and_uniform_clients_of_four_classes():
    y = ag_like()
    parts = make_partition("biased", y, 10, rng(1), classes_per_client=2, num_uniform=2)
    hist = label_histograms(y, parts, 4)
    assert [len(p) for p in parts] == [120] * 10  # 8 biased x 2 + 2 uniform x 1 = 10 shards of 30 per class
    for i in range(8):  # biased client i: classes (2i, 2i+1) mod 4, equal halves
        assert set(np.flatnonzero(hist[i])) == {(2 * i) % 4, (2 * i + 1) % 4} and set(hist[i][hist[i] > 0]) == {60}
    assert np.all(hist[8:] == 30)  # uniform: every class, equal parts
    flat = np.concatenate(parts)
    assert len(np.unique(flat)) == len(flat) == len(y)  # disjoint, and here every sample is used
    again = make_partition("biased", y, 10, rng(1), classes_per_client=2, num_uniform=2)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))
    other = make_partition("biased", y, 10, rng(2), classes_per_client=2, num_uniform=2)
    assert not all(np.array_equal(a, b) for a, b in zip(parts, other, strict=True))
    assert label_histograms(y, other, 4).tolist() == hist.tolist()  # the seed draws the samples, not the classes


@pytest.mark.parametrize("k", [1, 3, 4])
def test_other_class_counts_keep_equal_sizes(k):
    y = ag_like()
    parts = biased_uniform(y, 5, 1, rng(3), classes_per_biased=k)
    hist = label_histograms(y, parts, 4)
    assert len({len(p) for p in parts}) == 1
    for i in range(5):
        held = np.flatnonzero(hist[i])
        assert sorted(held.tolist()) == sorted({(k * i + j) % 4 for j in range(k)})
        assert len(set(hist[i][held].tolist())) == 1
    assert np.all(hist[5] == hist[5, 0]) and hist[5, 0] > 0


def test_niid2_is_the_two_class_case():
    y = rng(4).integers(0, 10, 3000)
    a = niid2(y, 5, 1, rng(5))
    b = make_partition("biased", y, 6, rng(5))  # defaults: 2 classes per biased client, 1 uniform client
    assert all(np.array_equal(p, q) for p, q in zip(a, b, strict=True))


@pytest.mark.parametrize(
    ("clients", "params", "match"),
    [
        (4, {"num_uniform": 5}, "uniform_clients=5 exceeds num_clients=4"),
        (4, {"classes_per_client": 5}, r"classes_per_client=5 \(per biased client\) exceeds the number of classes"),
        (4, {"classes_per_client": 0}, "classes_per_client must be >= 1"),
        (4, {"num_uniform": -1}, "num_uniform must be >= 0"),
        (500, {}, "class 0 has 300 samples but the clients need"),
        (4, {"alpha": 0.5}, r"does not take \['alpha'\]"),
    ],
)
def test_impossible_requests_are_named(clients, params, match):
    with pytest.raises(PartitionError, match=match):
        make_partition("biased", ag_like(), clients, rng(), **params)
    with pytest.raises(PartitionError, match="at least 2 classes"):
        biased_uniform(np.zeros(10, dtype=int), 2, 1, rng())


def test_configuration_and_identity():
    cfg = make_config(None, {"partition": "biased", "clients": 6, "uniform_clients": 2, "db": None})
    data = build_federated(cfg)  # digits: 10 classes, 4 biased 2-class clients + 2 uniform clients
    hist = data.train_hists + data.test_hists
    assert [int((h > 0).sum()) for h in hist] == [2, 2, 2, 2, 10, 10]
    assert cfg.identity()["uniform_clients"] == 2
    # a key added after runs were recorded: left out of the identity at its default, so old experiments keep theirs
    assert "uniform_clients" not in make_config(None, {"db": None}).identity()
    with pytest.raises(Exception, match="uniform_clients"):
        make_config(None, {"uniform_clients": -1})
