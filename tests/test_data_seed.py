"""``data_seed``: the federation's own seed. Fixed while ``seed`` varies, runs share the clients' data and differ in
training; unset, it is the seed (the federation of ``seed=N`` is that of ``data_seed=N``), and an experiment's
identity is what it was before the key existed."""

import pytest
import torch

from fedskew.commands.flags import RUN_FLAGS
from fedskew.config import ConfigError, make_config
from fedskew.data.federated import build_federated
from fedskew.engine.loop import Simulation

BASE = {"clients": 5, "rounds": 1, "db": None, "skew_probes": 0, "partition": "dir", "alpha": 0.3}


def _data(**over):
    cfg = make_config(None, {**BASE, **over})
    return cfg, build_federated(cfg)


def _same(a, b) -> bool:
    return all(
        torch.equal(x.x_train, y.x_train) and torch.equal(x.y_train, y.y_train) and torch.equal(x.y_test, y.y_test)
        for x, y in zip(a.clients, b.clients, strict=True)
    )


def test_a_data_seed_holds_the_federation_while_the_seed_varies_training():
    (c1, d1), (c2, d2) = _data(seed=1, data_seed=9), _data(seed=2, data_seed=9)
    assert _same(d1, d2)
    assert _same(d1, _data(seed=9)[1])  # the federation of data_seed 9 is that of seed 9
    assert not _same(_data(seed=1)[1], _data(seed=2)[1])  # unset: each seed its own partition
    s1, s2 = Simulation(c1, d1), Simulation(c2, d2)  # the training side still follows the seed
    assert any(not torch.equal(s1.global_params[k], s2.global_params[k]) for k in s1.global_params)
    r1, r2 = s1.round(1).record, s2.round(1).record
    assert r1["train_loss"] != r2["train_loss"]


def test_data_seed_is_part_of_the_experiment_only_when_set():
    unset, fixed = make_config(None, {**BASE, "seed": 3}), make_config(None, {**BASE, "seed": 3, "data_seed": 4})
    assert "data_seed" not in unset.identity()  # earlier runs keep their group keys
    assert fixed.identity()["data_seed"] == 4 and fixed.group_key() != unset.group_key()
    other_seed = make_config(None, {**BASE, "seed": 5, "data_seed": 4})
    assert other_seed.group_key() == fixed.group_key()  # seeds of one experiment


def test_the_flag_and_a_bad_value():
    key, parse, text = RUN_FLAGS["--data-seed"]
    assert key == "data_seed" and parse("7") == 7 and "federation" in text
    with pytest.raises(ConfigError, match="data_seed"):
        make_config(None, {**BASE, "data_seed": -1})


def test_fedskew_partition_shows_the_federation_of_the_data_seed(capsys):
    from fedskew.cli import main

    assert main(["partition", "--clients", "5", "--seed", "1", "--data-seed", "9"]) == 0
    fixed = capsys.readouterr().out
    assert main(["partition", "--clients", "5", "--seed", "9"]) == 0
    plain = capsys.readouterr().out
    assert "data seed 9" in fixed.splitlines()[0]
    assert fixed.splitlines()[1:] == plain.splitlines()[1:]  # the same clients' label table
