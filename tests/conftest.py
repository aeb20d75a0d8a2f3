"""Shared fixtures: small configs, and the offline data directory when present."""

from pathlib import Path

import pytest

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


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
    (``runs/``, ``runs/fedskew.db``) can never land in the user's checkout."""
    monkeypatch.chdir(tmp_path)


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
