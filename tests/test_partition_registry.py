"""User partition schemes (issue 40): ``@fedskew.partition`` registers one, usable from the library, YAML configs,
sweeps and the command line with its own parameters (``partition_args``, ``-P``), checked like the built-ins."""

from __future__ import annotations

import numpy as np
import pytest

import fedskew
from fedskew.cli import main
from fedskew.config import ConfigError, load_yaml, make_config
from fedskew.data.federated import build_federated
from fedskew.data.partition import PartitionError, make_partition, register_partition, unregister_partition
from fedskew.data.partition.registry import BUILTIN, PARTITIONS, SHIPPED
from fedskew.sweep.core import SweepSpec, expand

TINY = {"rounds": 1, "clients": 4, "db": None}


def _shards(labels, num_clients, rng, *, per_client=2):
    """label shards (McMahan et al.)"""
    order = np.argsort(np.asarray(labels), kind="stable")
    pieces = np.array_split(order, num_clients * per_client)
    drawn = rng.permutation(len(pieces))
    return [
        np.concatenate([pieces[j] for j in drawn[c * per_client : (c + 1) * per_client]]) for c in range(num_clients)
    ]


@pytest.fixture
def shards():
    fedskew.partition("shards_t")(_shards)
    yield "shards_t"
    unregister_partition("shards_t")


@pytest.fixture
def scheme():
    """Register a scheme under a test name; unregistered afterwards."""
    names = []

    def add(name, fn):
        register_partition(name, fn)
        names.append(name)

    yield add
    for name in names:
        unregister_partition(name)


def test_a_registered_scheme_builds_the_federation_with_its_parameters(shards):
    values = {**TINY, "clients": 10, "partition": shards, "partition_args": {"per_client": 1}}
    data = build_federated(make_config(values))
    classes = [int((h > 0).sum()) for h in data.train_hists]
    assert max(classes) <= 2  # one tenth of the label-sorted digits each: one or two classes per client
    again = build_federated(make_config(values))
    assert np.array_equal(data.train_hists, again.train_hists)  # drawn from the run seed's partition stream
    other = build_federated(make_config({**values, "seed": 1}))
    assert not np.array_equal(data.train_hists, other.train_hists)


def test_the_library_api_and_a_yaml_config_take_it(shards, tmp_path):
    result = fedskew.run("fedavg", partition=shards, partition_args={"per_client": 3}, rounds=1, clients=4)
    assert result.config["partition"] == shards and result.config["partition_args"] == {"per_client": 3}
    path = tmp_path / "c.yaml"
    path.write_text(f"partition: {shards}\npartition_args:\n  per_client: 3\nclients: 4\n")
    assert make_config(load_yaml(path)).partition_args == {"per_client": 3}


def test_the_command_line_takes_it_with_dash_p(shards, tmp_path, capsys):
    out = tmp_path / "r"
    argv = ["run", "--partition", shards, "-P", "per_client=3", "--rounds", "1", "--clients", "4", "--out", str(out)]
    assert main([*argv, "--no-db", "--quiet"]) == 0
    assert "per_client: 3" in (out / "config.yaml").read_text()
    assert main(["partition", "--list"]) == 0
    listing = capsys.readouterr().out
    assert shards in listing and "registered" in listing and "label shards" in listing
    assert main(["partition", "--partition", shards, "-P", "per_clent=3", "--clients", "4"]) == 2
    assert "does not take ['per_clent']" in capsys.readouterr().err


def test_its_parameters_are_checked_when_the_configuration_is(shards):
    with pytest.raises(
        ConfigError, match=r"partition 'shards_t' does not take \['size'\]; it accepts \['per_client'\]"
    ):
        make_config({**TINY, "partition": shards, "partition_args": {"size": 3}})
    with pytest.raises(ConfigError, match="partition_args is for a registered scheme"):
        make_config({**TINY, "partition": "dir", "partition_args": {"alpha": 0.5}})
    with pytest.raises(ConfigError, match="unknown partition 'shard'.*shards_t"):
        make_config({**TINY, "partition": "shard"})


def test_a_required_parameter_must_be_given(scheme):
    def needs(labels, num_clients, rng, *, size):
        return [np.arange(c * size, (c + 1) * size) for c in range(num_clients)]

    scheme("needs_t", needs)
    with pytest.raises(ConfigError, match=r"partition 'needs_t' needs parameter\(s\) \['size'\]"):
        make_config({**TINY, "partition": "needs_t"})
    assert make_config({**TINY, "partition": "needs_t", "partition_args": {"size": 5}}).partition_args == {"size": 5}


def test_registration_refuses_bad_names_and_signatures():
    with pytest.raises(PartitionError, match="'dir' is taken"):
        register_partition("dir", _shards)
    with pytest.raises(PartitionError, match="'domain' is taken"):
        register_partition("domain", _shards)
    with pytest.raises(PartitionError, match="lower-case"):
        register_partition("My-Split", _shards)
    with pytest.raises(PartitionError, match=r"keyword-only parameters \(after a bare \*\)"):
        register_partition("loose_t", lambda labels, num_clients, rng, per_client=2: [])
    with pytest.raises(PartitionError, match="built-in partition"):
        unregister_partition("dir")
    assert set(PARTITIONS) == set(BUILTIN) | SHIPPED  # nothing half-registered


@pytest.mark.parametrize(
    ("result", "error"),
    [
        (lambda n: [np.arange(n)], "one index array per client"),
        (lambda n: [np.array([0, 1]), np.array([1, 2]), np.array([3]), np.array([4])], "more than one client"),
        (lambda n: [np.array([0]), np.array([n]), np.array([1]), np.array([2])], "outside 0.."),
        (lambda n: [np.array([0.0]), np.array([1]), np.array([2]), np.array([3])], "1-D integer array"),
    ],
)
def test_a_scheme_that_returns_a_bad_split_is_named(scheme, result, error):
    scheme("bad_t", lambda labels, num_clients, rng: result(len(labels)))
    with pytest.raises(PartitionError, match=f"partition 'bad_t'.*{error}"):
        make_partition("bad_t", np.arange(20) % 4, 4, np.random.default_rng(0))


def test_a_sweep_puts_its_parameters_on_an_axis(shards, tmp_path):
    spec = SweepSpec(
        base={"rounds": 1, "clients": 4, "partition": shards}, grid={"partition_args.per_client": [1, 3]}, seeds=[0]
    )
    runs = expand(spec, out=tmp_path)
    assert [r.cfg.partition_args for r in runs] == [{"per_client": 1}, {"per_client": 3}]
    assert runs[0].name != runs[1].name


def test_a_built_in_partition_keeps_its_experiment_identity():
    """partition_args at its default is left out of the identity, so experiments recorded before it keep their
    group keys and sweep folder names."""
    cfg = make_config(TINY)
    assert "partition_args" not in cfg.identity()
    assert cfg.group_key() == make_config({**TINY, "partition_args": {}}).group_key()
