"""Shared fixtures: small configs, and the offline data directory when present."""

import os
from pathlib import Path

import pytest
from torch import nn

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def pytest_xdist_auto_num_workers(config):
    """``-n auto`` (pyproject's addopts): one worker per CPU this process may use, at most 4 (the subprocess-heavy
    tests start several processes each; the suite's 2-core CI machine runs 2)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(4, cpus))


def load_script(path: Path, name: str):
    """A script under ``benchmarks/`` (or ``tools/``) imported as module ``name``, registered in ``sys.modules`` while
    it runs (its dataclasses look their module up there)."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def shared_dataset_dir(name: str) -> Path:
    d = SHARED_DATA / name
    if not d.is_dir():
        pytest.skip(f"offline dataset {name!r} not present at {d} (only in the developers' checkout)")
    return d


@pytest.fixture
def shared_data():
    """``shared_data("mnist")`` -> the offline dataset folder, or skip with the reason."""
    return shared_dataset_dir


@pytest.fixture
def tiny_digits_config(tmp_path):
    """A fast digits federation: 5 clients, 3 rounds, MLP."""
    from fedskew.config import make_config

    return make_config(
        None,
        {"clients": 5, "rounds": 3, "out": str(tmp_path / "run"), "db": str(tmp_path / "fedskew.db"), "seed": 3},
    )


@pytest.fixture(autouse=True)
def _run_in_tmp_dir(tmp_path, monkeypatch):
    """Every test runs with its temporary directory as the working directory, so that a default output path
    (``runs/``, ``runs/fedskew.db``) can never land in the user's checkout, and fedskew's cache (decoded image
    folders, a Flower node's part) is inside it too, never in the user's ``~/.cache``."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FEDSKEW_CACHE", str(tmp_path / ".fedskew-cache"))
    # output wrapped to the terminal's width is the same in a terminal, a pipe and a parallel worker (tests that
    # check other widths set COLUMNS themselves)
    monkeypatch.setenv("COLUMNS", "100")


@pytest.fixture
def one_thread():
    """One torch thread, as the runner sets by default (``threads: 1``): much faster on a busy machine."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def digits_simulation(method: str, args: dict | None = None, rounds: int = 2, **over):
    """A small simulation on the embedded digits (4 clients, seed 5, no database, no probes)."""
    from fedskew.config import make_config
    from fedskew.data.federated import build_federated
    from fedskew.engine.loop import Simulation

    values = {"clients": 4, "rounds": rounds, "method": method, "method_args": args or {}, "db": None}
    cfg = make_config(None, {**values, "skew_probes": 0, "seed": 5, **over})
    return Simulation(cfg, build_federated(cfg))


def without_timing(records: list[dict]) -> list[dict]:
    """Round records without their wall-clock entries: what two runs of the same config must agree on exactly."""
    from fedskew.protocol import TIMING_KEYS

    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in records]


def run_records(run_dir) -> list[dict]:
    """A run directory's ``metrics.jsonl``, one record per round, without the wall-clock entries."""
    import json

    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return without_timing([json.loads(line) for line in lines])


def same_params(a: dict, b: dict, tol: float = 0.0) -> bool:
    """The same parameter names, each tensor within ``tol`` of the other's (``tol`` 0: equal values)."""
    return set(a) == set(b) and all(float((a[k].double() - b[k].double()).abs().max()) <= tol for k in a)


def _fake_domain(name, n_train, n_test, seed):
    import numpy as np

    from fedskew.data.readers import ImageDataset

    rng = np.random.default_rng(seed)
    return ImageDataset(
        name,
        rng.integers(0, 255, (n_train, 3, 8, 8), dtype=np.uint8),
        rng.integers(0, 10, n_train).astype(np.int64),
        rng.integers(0, 255, (n_test, 3, 8, 8), dtype=np.uint8),
        rng.integers(0, 10, n_test).astype(np.int64),
        10,
    )


@pytest.fixture
def fake_domains(monkeypatch):
    """Three small random RGB domains (1000/200/500 training samples) in place of the Digits suite's files."""
    import dataclasses

    import fedskew.data.federated as fed
    from fedskew.data.readers.domains import DOMAIN_SUITES

    doms = {
        "a": _fake_domain("a", 1000, 50, 0),
        "b": _fake_domain("b", 200, 30, 1),
        "c": _fake_domain("c", 500, 40, 2),
    }
    suite = fed.domain_suite("digits_domains")
    fake = dataclasses.replace(suite, load=lambda data_dir, size, seed, download=False: dict(doms))
    monkeypatch.setitem(DOMAIN_SUITES, "digits_domains", fake)
    return doms


def fake_domains_config(tmp_path, **over):
    """A 6-client domain-skew run on :func:`fake_domains` (two clients per domain, 10% of each), 2 rounds, MLP."""
    from fedskew.config import make_config

    base = {
        "dataset": "digits_domains",
        "partition": "domain",
        "clients": 6,
        "domain_fraction": 0.1,
        "rounds": 2,
        "model": "mlp",
        "db": None,
        "out": str(tmp_path / "r"),
    }
    return make_config(None, {**base, **over})


class Tiny(nn.Module):
    """A 4 → 6 → 3 body/head model for hand-checkable client tests."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 6), nn.ReLU())
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        return self.head(self.body(x))


def digits_nodes(tmp_path, k=3):
    """Label-skewed per-client data (issue 24): each node's own .npz (x, y, x_test, y_test, num_classes) in its own
    folder ``node0``, ``node1``, ..., the same clients as per-client files for the simulator (``given/train/K.npz``,
    ``given/test/K.npz``), and ``server_test.npz``: the clients' test splits in client order (so a server scoring the
    global model on it scores what the simulator pools over the clients). Returns (given, node folders)."""
    import numpy as np
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = np.clip(x * 16, 0, 255).astype(np.uint8).reshape(-1, 1, 8, 8)
    order = np.argsort(y, kind="stable")  # sorted by label: each node holds a few of the 10 classes
    given = tmp_path / "given"
    (given / "train").mkdir(parents=True)
    (given / "test").mkdir()
    nodes = []
    for c, idx in enumerate(np.array_split(order, k)):
        idx = np.random.default_rng(c).permutation(idx)
        cut = int(0.75 * len(idx))
        tr, te = idx[:cut], idx[cut:]
        node = tmp_path / f"node{c}"
        node.mkdir()
        np.savez(node / "data.npz", x=x[tr], y=y[tr], x_test=x[te], y_test=y[te], num_classes=10)
        np.savez(given / "train" / f"{c}.npz", x=x[tr], y=y[tr])
        np.savez(given / "test" / f"{c}.npz", x=x[te], y=y[te])
        nodes.append(node)
    tests = [np.load(n / "data.npz") for n in nodes]
    np.savez(
        tmp_path / "server_test.npz",
        x_test=np.concatenate([t["x_test"] for t in tests]),
        y_test=np.concatenate([t["y_test"] for t in tests]),
    )
    return given, nodes
