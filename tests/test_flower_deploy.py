"""Issue 12: a real Flower deployment on loopback. A SuperLink and 3 SuperNodes run as separate processes on
127.0.0.1 (insecure HTTP, FLWR_HOME in the test's tmp dir, telemetry, update check and runtime dependency installation
off), and ``flwr run`` runs an app folder written by ``fedskew flower new``:

* the run directory and its accuracy equal ``fedskew run``'s for the same config and seed (1e-6), and no process is
  left behind;
* a SuperNode killed during round 2: the round ends with the two others after the bounded wait, the dead client is
  recorded, the run completes.

Every wait is bounded (SuperLink health, node connection, each phase's replies, ``flwr run`` itself). Both runs
evaluate on round 2 only (``eval_every: 2``): a deployment round costs seconds of framework latency per phase
(docs/flower.md), and round 1's evaluation proves nothing round 2's does not.
"""

from __future__ import annotations

import importlib.util
import json
import math
import threading
import time
from pathlib import Path

import pytest
import yaml

from fedskew.cli import main
from fedskew.protocol import TIMING_KEYS

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("flwr") is None, reason='flwr is not installed (pip install -e ".[flower]")'
    ),
    pytest.mark.skipif(not Path("/proc").is_dir(), reason="the left-behind process check reads /proc (Linux)"),
]

BASE = {"clients": 3, "rounds": 2, "eval_every": 2, "seed": 11, "threads": 1, "method": "fedavg+disco"}


def _app(tmp_path: Path, values: dict, *flags: str) -> Path:
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(values))
    assert main(["flower", "new", "--config", str(tmp_path / "job.yaml"), str(tmp_path / "app"), *flags]) == 0
    return tmp_path / "app"


def _records(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING_KEYS} for line in lines]


def _simulate(tmp_path: Path, values: dict) -> Path:
    out = tmp_path / "sim"
    args = ["run", "--config", str(tmp_path / "job.yaml"), "--out", str(out), "--no-db", "--quiet"]
    assert main(args) == 0
    return out


def test_loopback_deployment_writes_the_simulators_run(tmp_path):
    from fedskew.flower.loopback import Loopback

    app = _app(tmp_path, BASE, "--round-timeout", "300", "--node-wait", "120")
    run_dir = tmp_path / "flower"
    with Loopback(tmp_path / "home", 3) as fed:
        out = fed.run_app(app, {"out": str(run_dir), "db": str(tmp_path / "f.db")}, timeout=420)
        assert "round 2/2" in out
    assert fed.leftovers() == [] and all(p.poll() is not None for p in fed.procs.values())

    sim_dir = _simulate(tmp_path, BASE)
    flower, simulator = _records(run_dir), _records(sim_dir)
    assert len(flower) == 2 and flower[1]["evaluated"] and not flower[0]["evaluated"]
    for a, b in zip(flower, simulator, strict=True):
        assert set(a) == set(b)
        for k in a:
            if isinstance(a[k], float):
                assert a[k] == pytest.approx(b[k], abs=1e-6), k
            else:
                assert a[k] == b[k], k
    assert abs(flower[1]["global_acc"] - simulator[1]["global_acc"]) <= 1e-6 and flower[1]["global_acc"] > 0.3
    fl_cfg, sim_cfg = (yaml.safe_load((d / "config.yaml").read_text()) for d in (run_dir, sim_dir))
    for c in (fl_cfg, sim_cfg):
        c.pop("out"), c.pop("db")
    assert fl_cfg == sim_cfg
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["engine"] == "flower" and summary["flower"]["failures"] == []
    assert json.loads((run_dir / "status.json").read_text())["status"] == "finished"
    assert (tmp_path / "f.db").is_file()


def test_a_supernode_killed_in_round_2_fails_its_round_and_the_run_completes(tmp_path):
    from fedskew.flower.loopback import Loopback

    # the dead node costs the straggler wait (15 s after the first reply), not the 300 s bound of a phase
    app = _app(tmp_path, BASE, "--round-timeout", "300", "--straggler-timeout", "15", "--node-wait", "120")
    run_dir = tmp_path / "flower"
    outcome: dict[str, object] = {}
    with Loopback(tmp_path / "home", 3) as fed:

        def run() -> None:
            try:
                outcome["out"] = fed.run_app(app, {"out": str(run_dir), "db": ""}, timeout=420)
            except Exception as exc:  # reported by the main thread
                outcome["error"] = exc

        runner = threading.Thread(target=run, daemon=True)
        runner.start()
        deadline = time.monotonic() + 300
        metrics = run_dir / "metrics.jsonl"
        while not (metrics.is_file() and metrics.read_text().count("\n") >= 1):  # round 1 recorded: round 2 begins
            assert runner.is_alive() and time.monotonic() < deadline, outcome.get("error", "round 1 never finished")
            time.sleep(0.1)
        fed.kill_node(1)  # client 1's machine dies
        runner.join(timeout=420)
        assert not runner.is_alive() and "error" not in outcome, outcome.get("error")
    assert fed.leftovers() == []

    recs = _records(run_dir)
    assert [r["participants"] for r in recs] == [3, 2]
    # the server stops waiting for client 1 15 s after the first reply, or earlier if the SuperLink has already
    # declared the node gone (no heartbeat for 2 x 30 s, which a slow, loaded machine can reach first)
    [failure] = recs[1]["failed"]
    assert failure["client"] == 1 and recs[1]["sampled"] == 3
    assert failure["reason"] == "no reply within 15 s of the first one" or "Node Unavailable" in failure["reason"]
    assert [f["client"] for f in recs[1]["eval_failed"]] == [1]  # not asked again in the same round
    assert math.isfinite(recs[1]["global_acc"]) and recs[1]["global_local_acc"] > 0
    assert recs[0] == _records(_simulate(tmp_path, BASE))[0]  # round 1, all three alive, is the simulator's
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [(f["round"], f["phase"], f["client"]) for f in summary["flower"]["failures"]] == [
        (2, "train", 1),
        (2, "evaluate", 1),
    ]
    assert json.loads((run_dir / "status.json").read_text())["status"] == "finished"
