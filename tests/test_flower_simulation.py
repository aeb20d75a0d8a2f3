"""Issue 26: Flower's Simulation Engine. ``fedskew flower new --simulation`` writes a local-simulation federation
(one simulated SuperNode per client, its client resources); ``flwr run`` on it, through :class:`LocalSimulation`
(throwaway FLWR_HOME, telemetry and update checks off, bounded wait), gives ``fedskew run``'s metrics within 1e-6 for
``fedavg+disco`` on digits with 5 nodes (``partition-id`` as the client id), and stops every process flwr and Ray
leave behind."""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
from pathlib import Path

import pytest
import yaml
from conftest import run_records

from fedskew.cli import main

pytestmark = pytest.mark.xdist_group("ray")  # one local Ray cluster at a time (conftest, pyproject)

needs_flwr = pytest.mark.skipif(
    importlib.util.find_spec("flwr") is None, reason='flwr is not installed (pip install -e ".[flower]")'
)

BASE = {"clients": 5, "rounds": 2, "seed": 3, "threads": 1, "method": "fedavg+disco", "skew_probes": 0}


def _app(tmp_path: Path, *flags: str) -> Path:
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(BASE))
    assert main(["flower", "new", "--config", str(tmp_path / "job.yaml"), str(tmp_path / "app"), *flags]) == 0
    return tmp_path / "app"


def test_connection_block_and_its_checks():
    from fedskew.flower.simulation import connection

    text = connection(7, num_cpus=2, num_gpus=0.5, default=True)
    assert text.startswith('[superlink]\ndefault = "local-simulation"')
    assert 'address = ":local:"' in text and "options.num-supernodes = 7" in text
    assert "client-resources.num-cpus = 2\n" in text and "client-resources.num-gpus = 0.5\n" in text
    for bad in ({"clients": 0}, {"clients": 2, "num_cpus": 0}, {"clients": 2, "num_gpus": -1}):
        with pytest.raises(ValueError):
            connection(**bad)


def test_new_simulation_writes_the_federation(tmp_path, capsys):
    app = _app(tmp_path, "--simulation", "--num-cpus", "1", "--num-gpus", "0.25")
    import tomllib

    options = tomllib.loads((app / "simulation.toml").read_text())["superlink"]["local-simulation"]["options"]
    assert options["num-supernodes"] == 5
    assert options["backend"]["client-resources"] == {"num-cpus": 1, "num-gpus": 0.25}
    assert main(["flower", "new", str(tmp_path / "other"), "--num-cpus", "2"]) == 2
    assert "need --simulation" in capsys.readouterr().err and not (tmp_path / "other").exists()


@needs_flwr
@pytest.mark.skipif(
    importlib.util.find_spec("ray") is None, reason='Ray is not installed (pip install -e ".[flower-sim]")'
)
@pytest.mark.skipif(shutil.which("flwr") is None, reason="the flwr command is not on PATH")
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="the left-behind process check reads /proc (Linux)")
def test_simulation_engine_run_equals_fedskew_run(tmp_path):
    from fedskew.flower.simulation import LocalSimulation

    app = _app(tmp_path, "--simulation")
    flower_dir, sim_dir = tmp_path / "flower", tmp_path / "sim"
    with LocalSimulation(tmp_path / "home", 5) as fed:
        out, status = fed.run_app(app, {"out": str(flower_dir), "db": ""}, timeout=420)
        assert status["status"] == "finished:completed", out[-2000:]
    assert fed.leftovers() == []  # the local SuperLink, its simulation process and Ray's workers are stopped
    args = ["run", "--config", str(tmp_path / "job.yaml"), "--out", str(sim_dir), "--no-db", "--quiet"]
    assert main(args) == 0
    got, want = run_records(flower_dir), run_records(sim_dir)
    assert len(got) == len(want) == 2
    for g, w in zip(got, want, strict=True):
        assert set(g) == set(w)
        for k, v in w.items():
            if isinstance(v, float):
                assert math.isclose(g[k], v, rel_tol=0, abs_tol=1e-6), (k, g[k], v)
            else:
                assert g[k] == v, k
    clients = json.loads((flower_dir / "clients.json").read_text())
    assert len(clients["num_train"]) == 5  # every simulated node (partition-id 0..4) reported as its client
