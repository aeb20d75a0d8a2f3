"""tools/flower_niid_probe.py: runs Flower's own NIID-Bench code (a checkout of adap/flower needed). Here it runs a
stand-in checkout written by the test, whose clients, strategies and test function expose what the tool does with
them: the server step of each method (the model replaced by the aggregate, FedNova's step from the server's
parameters, SCAFFOLD's ``x ← x + Δx`` and ``c ← c + (|S|/N)·Δc`` from ``c = x0``) and a failed round-1 client."""

import json
import sys
from pathlib import Path

import pytest
from conftest import load_script

TOOL = Path(__file__).resolve().parents[1] / "tools" / "flower_niid_probe.py"

MODELS = """
import torch
from torch import nn

class CNNMnist(nn.Sequential):  # a stand-in: the digits are 8x8
    def __init__(self, input_dim, hidden_dims, num_classes):
        super().__init__(nn.Flatten(), nn.Linear(64, num_classes))
        with torch.no_grad():
            self[1].weight.add_(1.0)  # the weights sum to about 640, far from 0

def test(net, loader, device):  # "loss": the sum of the model's weights, so the test sees each round's model
    return float(sum(p.detach().sum() for p in net.parameters())), 0.5
"""
CLIENT = """
import numpy as np
import torch

class {name}:
    def __init__(self, *args):
        self.args = args

    def fit(self, parameters, config):
        n = 64 + len(self.args)
        arrays = [np.asarray(p) for p in parameters]
        return {update}
"""
UPDATES = {  # each stand-in client's upload
    "FlowerClientFedAvg": "[a + 1.0 for a in arrays], n, {}",  # the model moved by +1 everywhere
    "FlowerClientFedProx": "[a + 1.0 for a in arrays], n, {}",
    "FlowerClientFedNova": "[np.zeros_like(a) for a in arrays], n, {'a_i': 2.0}",
    # x and c sent together; uploads Δx = 0 and Δc = 100
    "FlowerClientScaffold": "[np.zeros_like(a) for a in arrays[: len(arrays) // 2]]"
    " + [np.full_like(a, 100.0) for a in arrays[len(arrays) // 2 :]], n, {}",
}
STRATEGY = """
from flwr.common import ndarrays_to_parameters, parameters_to_ndarrays
from flwr.server.strategy import FedAvg

SEEN = []

class FedNovaStrategy(FedAvg):
    def aggregate_fit_custom(self, server_round, server_params, results, failures):
        SEEN.append(len(results))
        return ndarrays_to_parameters([p - 1.0 for p in server_params]), {}  # the model moved by -1 everywhere

class ScaffoldStrategy(FedAvg):
    def aggregate_fit(self, server_round, results, failures):
        SEEN.append(len(results))
        uploads = [parameters_to_ndarrays(r.parameters) for _, r in results]
        return ndarrays_to_parameters([sum(u[i] for u in uploads) / len(uploads) for i in range(len(uploads[0]))]), {}
"""


@pytest.fixture
def standin(tmp_path, monkeypatch):
    """A stand-in adap/flower checkout, and the tool loaded with the digits federation in place of (F)MNIST's."""
    pytest.importorskip("flwr")
    pkg = tmp_path / "flower" / "baselines" / "niid_bench" / "niid_bench"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "models.py").write_text(MODELS)
    (pkg / "strategy.py").write_text(STRATEGY)
    for module, name in [("client_fedavg", "FlowerClientFedAvg"), ("client_fedprox", "FlowerClientFedProx")]:
        (pkg / f"{module}.py").write_text(CLIENT.format(name=name, update=UPDATES[name]))
    for module, name in [("client_fednova", "FlowerClientFedNova"), ("client_scaffold", "FlowerClientScaffold")]:
        (pkg / f"{module}.py").write_text(CLIENT.format(name=name, update=UPDATES[name]))
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = set(sys.modules)
    tool = load_script(TOOL, "flower_niid_probe")

    def digits(args):
        from fedskew.config import make_config
        from fedskew.data.federated import build_federated

        values = {"protocol": "niid-bench", "dataset": "digits", "partition": args.partition, "alpha": args.alpha}
        return build_federated(make_config(None, values | {"data_seed": 42, "partition_rng": "raw", "db": None}))

    monkeypatch.setattr(tool, "load_federation", digits)
    yield tool, tmp_path
    for name in set(sys.modules) - before:  # the stand-in package and any stubs the tool registered
        if name.startswith(("niid_bench", "hydra", "omegaconf", "flower_niid_probe")):
            del sys.modules[name]


def _run(tool, tmp_path, *args: str) -> list[dict]:
    out = tmp_path / "probe.jsonl"
    rc = tool.main(["--flower", str(tmp_path / "flower"), "--partition", "dir", "--out", str(out), *args])
    assert rc == 0
    return [json.loads(line) for line in out.read_text().splitlines()]


WEIGHTS = 64 * 10 + 10  # the stand-in model's entries


@pytest.mark.parametrize("method", ["fedavg", "fedprox"])
def test_fedavg_and_fedprox_take_flowers_weighted_average_as_the_model(standin, method):
    tool, tmp = standin
    rounds = _run(tool, tmp, "--method", method, "--rounds", "3")
    steps = [b["loss"] - a["loss"] for a, b in zip(rounds, rounds[1:], strict=False)]
    assert steps == pytest.approx([WEIGHTS, WEIGHTS], rel=1e-5)  # every client +1, so the average +1


def test_fednova_steps_from_the_servers_parameters(standin):
    tool, tmp = standin
    rounds = _run(tool, tmp, "--method", "fednova", "--rounds", "3", "--fail-client", "4")
    steps = [b["loss"] - a["loss"] for a, b in zip(rounds, rounds[1:], strict=False)]
    assert steps == pytest.approx([-WEIGHTS, -WEIGHTS], rel=1e-5)
    assert sys.modules["niid_bench.strategy"].SEEN == [9, 10, 10]  # client 4's round-1 fit dropped


def test_scaffold_control_starts_at_the_weights_and_moves_by_the_participants_share(standin):
    tool, tmp = standin
    r1, r2 = _run(tool, tmp, "--method", "scaffold", "--rounds", "2", "--fail-client", "7")
    assert r1["loss"] == pytest.approx(r2["loss"])  # Δx = 0: the model stays
    # c = x0 + (9/10)·100 after round 1 (client 7 failed), + (10/10)·100 after round 2; every entry positive
    assert r1["c_l1"] == pytest.approx(r1["loss"] + 90.0 * WEIGHTS, rel=1e-5)
    assert r2["c_l1"] == pytest.approx(r1["loss"] + 190.0 * WEIGHTS, rel=1e-5)


def test_a_folder_without_the_methods_client_is_named(standin):
    tool, tmp = standin
    (tmp / "flower" / "baselines" / "niid_bench" / "niid_bench" / "client_fednova.py").unlink()
    with pytest.raises(SystemExit, match=r"--flower .*: no baselines/niid_bench/niid_bench/client_fednova.py"):
        tool.main(["--flower", str(tmp / "flower"), "--method", "fednova", "--rounds", "1"])
    with pytest.raises(SystemExit, match=r"--fail-client 10: the clients are 0 to 9"):
        tool.main(["--flower", str(tmp / "flower"), "--method", "fedavg", "--fail-client", "10"])
