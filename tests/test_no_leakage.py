"""No sample a model is tested on may be trained on: for every valid partition × protocol, no client's local test
sample and no global test sample appears in any client's training split.

Samples are identified by their source index (``ClientData.train_index`` / ``test_index``,
``FederatedData.test_index``: the dataset's training split, then its test split; fedskew/data/federated.py). Every
check first verifies that the recorded indices are where the tensors came from (the images and labels at those
source indices are the tensors' rows), so the bookkeeping cannot hide a leak."""

import numpy as np
import pytest
import torch

import fedskew.data.federated as fed
import fedskew.data.pools as pools
from fedskew.config import ConfigError, make_config
from fedskew.data.niid_bench import unit_float
from fedskew.data.partition import PartitionError
from fedskew.data.protocols import PROTOCOLS as PROTOCOL_RECORDS
from fedskew.data.readers import ImageDataset, digits_domains, load_dataset

PARTITIONS = ["iid", "dir", "pat", "dirfixed", "niid2", "biased", "quantity"]  # on digits; domain needs digits_domains
PROTOCOLS = ["fedskew", "pfllib", "fedcac", "niid-bench"]
VALID = {
    "fedskew": PARTITIONS,
    **{p: PROTOCOL_RECORDS[p].partitions for p in ("pfllib", "fedcac", "niid-bench")},  # the others refused
}
COMBOS = [(p, proto) for proto in PROTOCOLS for p in VALID[proto]]


def _source(parts: list[ImageDataset]) -> tuple[np.ndarray, np.ndarray]:
    """The source index space of datasets ``parts`` (one, or the domains in order): every training split, then every
    test split."""
    xs = [d.x_train for d in parts] + [d.x_test for d in parts if d.x_test is not None]
    ys = [d.y_train for d in parts] + [d.y_test for d in parts if d.y_test is not None]
    return np.concatenate(xs), np.concatenate(ys)


def _check_indices(x: torch.Tensor, y: torch.Tensor, index: np.ndarray | None, source: tuple) -> None:
    assert index is not None and index.dtype == np.int64 and index.shape == (len(y),)
    sx, sy = source
    # pixels as fedskew stores them ([-1, 1]) or as NIID-Bench's protocol does (ToTensor's [0, 1])
    assert torch.equal(x.cpu(), pools.to_float(sx[index], "cpu")) or torch.equal(
        x.cpu(), unit_float(sx[index], torch.device("cpu"))
    )
    assert np.array_equal(y.cpu().numpy(), sy[index])


def leak_report(data: pools.FederatedData, source: tuple) -> dict[str, int]:
    """Checks the recorded source indices against the tensors, then counts local-test and global-test samples that
    sit in some client's training split."""
    for c in data.clients:
        _check_indices(c.x_train, c.y_train, c.train_index, source)
        _check_indices(c.x_test, c.y_test, c.test_index, source)
    _check_indices(data.x_test, data.y_test, data.test_index, source)
    train = np.unique(np.concatenate([c.train_index for c in data.clients]))
    local = np.concatenate([c.test_index for c in data.clients])
    return {
        "local_leaks": int(np.isin(local, train).sum()),
        "local_tests": len(local),
        "global_leaks": int(np.isin(data.test_index, train).sum()),
        "global_tests": len(data.test_index),
    }


def assert_no_leak(data: pools.FederatedData, source: tuple) -> dict[str, int]:
    r = leak_report(data, source)
    assert r["local_tests"] > 0 and r["global_tests"] > 0
    assert (r["local_leaks"], r["global_leaks"]) == (0, 0), (
        f"{r['local_leaks']}/{r['local_tests']} local-test and {r['global_leaks']}/{r['global_tests']} global-test "
        "samples are in some client's training split"
    )
    return r


def _values(partition: str, protocol: str, seed: int = 1) -> dict:
    values = {"dataset": "digits", "partition": partition, "protocol": protocol, "clients": 10, "seed": seed}
    values.update({"samples_per_client": 100, "test_samples_per_client": 30, "db": None})
    if partition == "niid2":
        values["clients"] = 6
    if partition == "biased":
        values["uniform_clients"] = 2
    if partition == "quantity":  # quantity skew Dir(alpha) over sizes: 0.1 leaves clients with one sample
        values["alpha"] = 1.0
    return values


def test_every_valid_combination_is_covered():
    covered = set(COMBOS) | {("domain", "fedskew")}  # domain: the tests below
    for proto in PROTOCOLS:
        for partition in [*PARTITIONS, "domain"]:
            dataset = "digits_domains" if partition == "domain" else "digits"
            try:
                make_config(None, {**_values(partition, proto), "dataset": dataset})
            except ConfigError:
                assert (partition, proto) not in covered
            else:
                assert (partition, proto) in covered, f"{partition} × {proto} is valid but not checked"


@pytest.mark.parametrize("protocol", ["pfllib", "fedcac", "niid-bench"])
def test_the_combinations_left_out_are_refused(protocol):
    for partition in sorted(set(PARTITIONS) - set(VALID[protocol])):
        with pytest.raises(ConfigError, match=f"protocol '{protocol}' supports"):
            make_config(None, _values(partition, protocol))


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("partition, protocol", COMBOS)
def test_no_test_sample_is_in_any_training_split(partition, protocol, seed):
    data = fed.build_federated(make_config(None, _values(partition, protocol, seed)))
    assert_no_leak(data, _source([load_dataset("digits")]))
    if protocol == "pfllib":  # PFLlib has no global test set of its own: it is the union of the clients' tests
        local = np.concatenate([c.test_index for c in data.clients])
        assert np.array_equal(np.sort(data.test_index), np.sort(local))


@pytest.mark.parametrize("partition", ["iid", "dir", "pat"])
def test_no_leak_under_a_global_long_tail(partition):
    data = fed.build_federated(make_config(None, {**_values(partition, "fedskew"), "imbalance_ratio": 10}))
    assert_no_leak(data, _source([load_dataset("digits")]))


def test_dirfixed_default_protocol_keeps_fixed_sizes_and_proportions():
    cfg = make_config(None, {"partition": "dirfixed", "clients": 10, "samples_per_client": 100, "db": None})
    data = fed.build_federated(cfg)
    assert all(len(c.y_train) == 75 and len(c.y_test) == 25 for c in data.clients)
    # train and test follow the same class proportions (the same q), up to rounding
    tr = data.train_hists / data.train_hists.sum(1, keepdims=True)
    te = data.test_hists / data.test_hists.sum(1, keepdims=True)
    assert np.abs(tr - te).max() < 0.1
    # a client's samples split as every other partition's are: floor(train_ratio * n) for training
    cfg = make_config(None, {"partition": "dirfixed", "clients": 10, "samples_per_client": 50, "db": None})
    assert all((len(c.y_train), len(c.y_test)) == (37, 13) for c in fed.build_federated(cfg).clients)


def test_dirfixed_default_protocol_is_seeded():
    def indices(seed):
        values = {"partition": "dirfixed", "clients": 10, "samples_per_client": 100, "seed": seed, "db": None}
        cfg = make_config(None, values)
        return [(c.train_index, c.test_index) for c in fed.build_federated(cfg).clients]

    a, b, other = indices(3), indices(3), indices(4)
    assert all(np.array_equal(x, y) for pa, pb in zip(a, b, strict=True) for x, y in zip(pa, pb, strict=True))
    assert not all(np.array_equal(pa[0], po[0]) for pa, po in zip(a, other, strict=True))


def test_dirfixed_default_protocol_refuses_what_the_pools_cannot_supply():
    cfg = make_config(None, {"partition": "dirfixed", "clients": 10, "samples_per_client": 600, "db": None})
    with pytest.raises(PartitionError, match=r"local-train pool of \d+ .* local-test pool of \d+") as err:
        fed.build_federated(cfg)
    assert "samples_per_client=600" in str(err.value) and "train_ratio=0.75" in str(err.value)


def test_domain_partition_has_no_leak_on_small_fake_domains(fake_domains):
    doms = fake_domains
    values = {"dataset": "digits_domains", "partition": "domain", "clients": 6, "domain_fraction": 0.1, "db": None}
    data = fed.build_federated(make_config(None, values))
    r = assert_no_leak(data, _source(list(doms.values())))
    assert r["global_tests"] == 120  # the global test set is every domain's test split


def test_domain_partition_has_no_leak(shared_data):
    root = shared_data("mnist").parent
    shared_data("usps")
    values = {"dataset": "digits_domains", "partition": "domain", "data_dir": str(root), "clients": 9, "db": None}
    cfg = make_config(None, values)
    data = fed.build_federated(cfg)
    domains = digits_domains(root, size=cfg.image_size, seed=cfg.seed)  # cached: the same arrays
    assert_no_leak(data, _source([domains[n] for n in data.domains]))


# ---- validation splits: carved from training, and under evaluate_on=validation no test sample is left -------------
def _all_test_indices(data: pools.FederatedData) -> np.ndarray:
    return np.concatenate([data.test_index, *(c.test_index for c in data.clients)])


def assert_validation_federation(values: dict, source: tuple) -> None:
    """The plain federation's test samples (local and global) appear nowhere in the validation-evaluated one; its
    validation splits came from the clients' own training splits and left them."""
    plain = fed.build_federated(make_config(None, values))
    carved = fed.build_federated(make_config(None, {**values, "validation": 0.2}))
    tuned = fed.build_federated(make_config(None, {**values, "validation": 0.2, "evaluate_on": "validation"}))
    tests = _all_test_indices(plain)
    for c_plain, c_carved, c_tuned in zip(plain.clients, carved.clients, tuned.clients, strict=True):
        _check_indices(c_carved.x_val, c_carved.y_val, c_carved.val_index, source)
        # train + validation is exactly the former training split, disjoint
        both = np.concatenate([c_carved.train_index, c_carved.val_index])
        assert np.array_equal(np.sort(both), np.sort(c_plain.train_index))
        assert len(np.intersect1d(c_carved.train_index, c_carved.val_index)) == 0
        assert len(c_carved.val_index) >= 1 and len(c_carved.train_index) >= 1
        # the test splits are untouched when evaluating on test; replaced by the validation splits otherwise
        assert np.array_equal(c_carved.test_index, c_plain.test_index)
        assert np.array_equal(c_tuned.test_index, c_carved.val_index)
        assert np.array_equal(c_tuned.train_index, c_carved.train_index)
    leak_report(tuned, source)  # checks every recorded index against the tensors
    used = np.concatenate(
        [tuned.test_index, *(c.train_index for c in tuned.clients), *(c.test_index for c in tuned.clients)]
    )
    assert not np.isin(used, tests).any(), "a test sample is in the federation evaluated on validation"
    assert np.array_equal(tuned.train_hists, carved.train_hists)
    assert tuned.train_hists.sum() == plain.train_hists.sum() - sum(len(c.val_index) for c in carved.clients)


@pytest.mark.parametrize("partition, protocol", COMBOS)
def test_evaluating_on_validation_reads_no_test_sample(partition, protocol):
    assert_validation_federation(_values(partition, protocol), _source([load_dataset("digits")]))


def test_evaluating_on_validation_under_domain_skew(fake_domains):
    values = {"dataset": "digits_domains", "partition": "domain", "clients": 6, "domain_fraction": 0.1, "db": None}
    assert_validation_federation(values, _source(list(fake_domains.values())))
    data = fed.build_federated(make_config(None, {**values, "validation": 0.2, "evaluate_on": "validation"}))
    owner_domain = np.repeat(data.client_domain, [len(c.y_test) for c in data.clients])
    assert np.array_equal(data.test_domain.cpu().numpy(), owner_domain)  # each sample keeps its client's domain


def test_evaluate_on_validation_needs_a_validation_share():
    with pytest.raises(ConfigError, match="evaluate_on 'validation'.*set validation"):
        make_config(None, {"evaluate_on": "validation", "db": None})
    with pytest.raises(ConfigError, match="validation"):
        make_config(None, {"validation": 1.0, "db": None})


def test_natural_clients_have_no_leak(tmp_path):
    """--partition natural on per-client files (LEAF's users): a sampled user's samples stay on its client, and no
    test sample is in any training split."""
    from fedskew.data.federated import natural_clients
    from fedskew.data.readers import load_source

    rng = np.random.default_rng(0)
    for split in ("train", "test"):
        (tmp_path / split).mkdir()
        for k in range(6):
            n = 8 if split == "train" else 3
            np.savez(
                tmp_path / split / f"{k}.npz",
                x=rng.integers(0, 256, (n, 1, 8, 8), dtype=np.uint8),
                y=rng.integers(0, 10, n),
            )
    cfg = make_config(
        None, {"dataset": "npz", "data_dir": str(tmp_path), "partition": "natural", "clients": 4, "seed": 3, "db": None}
    )
    data = fed.build_federated(cfg)
    src = natural_clients(load_source("npz", str(tmp_path)), 4, 3)
    source = (
        np.concatenate(list(src.x_train) + list(src.x_test)),
        np.concatenate(list(src.y_train) + list(src.y_test)),
    )
    assert_no_leak(data, source)
