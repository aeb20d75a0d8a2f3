"""No sample a model is tested on may be trained on: for every partition × protocol, no client's local test sample
and no global test sample appears in any client's training split.

Samples are identified by content (image bytes and label), restricted to images that occur once in the dataset
(digits has a few exact duplicates; a duplicate pair could sit in train and test legitimately)."""

import hashlib
from collections import Counter

import numpy as np
import pytest
import torch

from fedskew.config import FEDCAC_PARTITIONS, PFLLIB_PARTITIONS, ConfigError, make_config
from fedskew.data.federated import build_federated
from fedskew.data.readers import load_dataset

PARTITIONS = ["iid", "dir", "pat", "dirfixed", "niid2", "quantity"]
PROTOCOLS = ["fedskew", "pfllib", "fedcac"]
VALID = {"fedskew": PARTITIONS, "pfllib": PFLLIB_PARTITIONS, "fedcac": FEDCAC_PARTITIONS}  # others are refused
COMBOS = [(p, proto) for proto in PROTOCOLS for p in VALID[proto]]


def _keys(x: torch.Tensor, y: torch.Tensor) -> list[bytes]:
    xb = ((x.cpu().float() + 1.0) * 127.5).round().to(torch.uint8).reshape(len(x), -1).numpy()
    yb = y.cpu().numpy()
    return [
        hashlib.blake2b(row.tobytes() + int(lab).to_bytes(2, "little"), digest_size=12).digest()
        for row, lab in zip(xb, yb, strict=True)
    ]


def _unique_keys() -> set[bytes]:
    ds = load_dataset("digits")
    x = torch.from_numpy(ds.x_train).float().div(127.5).sub(1.0)
    counts = Counter(_keys(x, torch.from_numpy(ds.y_train)))
    return {k for k, n in counts.items() if n == 1}


UNIQUE = _unique_keys()


def _leaks(data) -> tuple[int, int, int]:
    """(local-test samples found in some train split, global-test samples found in some train split, local tests)"""
    train = set()
    for c in data.clients:
        train.update(k for k in _keys(c.x_train, c.y_train) if k in UNIQUE)
    local = [k for c in data.clients for k in _keys(c.x_test, c.y_test) if k in UNIQUE]
    glob = [k for k in _keys(data.x_test, data.y_test) if k in UNIQUE]
    return sum(k in train for k in local), sum(k in train for k in glob), len(local)


def _values(partition: str, protocol: str) -> dict:
    values = {"dataset": "digits", "partition": partition, "protocol": protocol, "clients": 10, "seed": 1}
    values.update({"samples_per_client": 100, "test_samples_per_client": 30, "db": None})
    if partition == "niid2":
        values["clients"] = 6
    if partition == "quantity":  # quantity skew Dir(alpha) over sizes: 0.1 leaves clients with one sample
        values["alpha"] = 1.0
    return values


@pytest.mark.parametrize("protocol", ["pfllib", "fedcac"])
def test_the_combinations_left_out_are_refused(protocol):
    for partition in sorted(set(PARTITIONS) - set(VALID[protocol])):
        with pytest.raises(ConfigError, match=f"protocol '{protocol}' supports"):
            make_config(None, _values(partition, protocol))


@pytest.mark.parametrize("partition, protocol", COMBOS)
def test_no_test_sample_is_in_any_training_split(partition, protocol):
    data = build_federated(make_config(None, _values(partition, protocol)))
    local_leaks, global_leaks, n_local = _leaks(data)
    assert n_local > 0
    assert (local_leaks, global_leaks) == (0, 0), f"{local_leaks}/{n_local} local-test samples leak"


def test_dirfixed_default_protocol_keeps_fixed_sizes_and_proportions():
    cfg = make_config(None, {"partition": "dirfixed", "clients": 10, "samples_per_client": 100, "db": None})
    data = build_federated(cfg)
    assert all(len(c.y_train) == 75 and len(c.y_test) == 25 for c in data.clients)
    # train and test follow the same class proportions (the same q), up to rounding
    tr = data.train_hists / data.train_hists.sum(1, keepdims=True)
    te = data.test_hists / data.test_hists.sum(1, keepdims=True)
    assert np.abs(tr - te).max() < 0.1


def test_domain_partition_has_no_leak(shared_data):
    root = shared_data("mnist").parent
    shared_data("usps")
    cfg = make_config(
        None,
        {"dataset": "digits_domains", "partition": "domain", "data_dir": str(root), "clients": 9, "db": None},
    )
    data = build_federated(cfg)
    train = set()
    for c in data.clients:
        train.update(_keys(c.x_train, c.y_train))
    local = [k for c in data.clients for k in _keys(c.x_test, c.y_test)]
    # domain clients hold disjoint random pieces of their domain's training split; the global test is the test split
    assert not any(k in train for k in local)
