"""Real Flower deployments on loopback: a SuperLink and SuperNodes as separate processes on 127.0.0.1 (FLWR_HOME in the
test's tmp dir, telemetry, update check and runtime dependency installation off), ``flwr run`` of an app folder
written by ``fedskew flower new``:

* issue 24, a real federation, secure (``Loopback(..., secure=True)``: TLS with a throwaway CA, SuperNode
  authentication with registered EC keys, no ``--insecure`` in any process): 3 SuperNodes each given only its own
  folder with its own ``.npz`` (``flower.data = node``), a server holding only a test file: ``fedavg+disco`` equals
  ``fedskew run --dataset npz --partition given`` on the same files (1e-6), and no process is left behind;
* issue 12, a simulated deployment (``flower.data = partition``, insecure): a SuperNode killed during round 2: the
  round ends with the two others after the bounded wait, the dead client is recorded, the run completes; round 1
  equals the simulator's;
* a SuperNode whose key was never registered is refused (it exits, never listed by the SuperLink) while a registered
  one comes online; ``fedskew flower loopback --secure`` passes the mode on.

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
from conftest import run_records

from fedskew.cli import main

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("flwr") is None, reason='flwr is not installed (pip install -e ".[flower]")'
    ),
    pytest.mark.skipif(not Path("/proc").is_dir(), reason="the left-behind process check reads /proc (Linux)"),
    pytest.mark.xdist_group("loopback"),  # one deployment at a time (each starts a SuperLink and its SuperNodes)
]

BASE = {"clients": 3, "rounds": 2, "eval_every": 2, "seed": 11, "threads": 1, "method": "fedavg+disco"}


def _app(tmp_path: Path, values: dict, *flags: str) -> Path:
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(values))
    assert main(["flower", "new", "--config", str(tmp_path / "job.yaml"), str(tmp_path / "app"), *flags]) == 0
    return tmp_path / "app"


def _simulate(tmp_path: Path, values: dict) -> Path:
    out = tmp_path / "sim"
    args = ["run", "--config", str(tmp_path / "job.yaml"), "--out", str(out), "--no-db", "--quiet"]
    assert main(args) == 0
    return out


def test_secure_node_local_deployment_writes_the_simulators_run(tmp_path):
    """Issue 24: a real federation on loopback. 3 SuperNodes, each given only its own folder with its own .npz, a
    ServerApp whose configuration names no data directory and holds only a test file, TLS and SuperNode
    authentication on (no process runs --insecure): fedavg+disco for 2 rounds equals `fedskew run --dataset npz
    --partition given` on the same per-client files within 1e-6, and no process is left behind."""
    from conftest import digits_nodes, run_records

    from fedskew.flower.loopback import Loopback
    from fedskew.flower.settings import NODE_DATA

    given, nodes = digits_nodes(tmp_path)
    values = {**BASE, "dataset": "npz", "model": "mlp"}
    server_test = str(tmp_path / "server_test.npz")
    app = _app(
        tmp_path, values, "--node-data", "--test-data", server_test, "--round-timeout", "300", "--node-wait", "120"
    )
    run_dir = tmp_path / "flower"
    seen: dict[int, list[str]] = {}  # every process of the federation, sampled during the run
    node_configs = [{"cid": c, "data-dir": str(d)} for c, d in enumerate(nodes)]
    with Loopback(tmp_path / "home", 3, node_configs=node_configs, secure=True) as fed:
        assert "insecure" not in (fed.home / "config.toml").read_text()
        assert set(fed.node_ids) == {"node0", "node1", "node2"}  # every public key registered before the nodes start
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                seen.update(fed.processes())
                done.wait(0.2)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            out = fed.run_app(app, {"out": str(run_dir), "db": str(tmp_path / "f.db")}, timeout=420)
        finally:
            done.set()
            sampler.join(timeout=30)
        assert "round 2/2" in out
    assert fed.leftovers() == [] and all(p.poll() is not None for p in fed.procs.values())

    commands = [" ".join(argv) for argv in seen.values()]
    assert not [c for c in commands if "--insecure" in c]
    [link] = [c for c in commands if "flower-superlink" in c]
    assert "--enable-supernode-auth" in link and f"--ssl-certfile {fed.tls.cert}" in link
    supernodes = sorted({c for c in commands if "flower-supernode" in c.split(" --")[0]})
    assert len(supernodes) == 3, supernodes
    assert all("--auth-supernode-private-key" in c and "--root-certificates" in c for c in supernodes)
    for c, node in enumerate(nodes):  # each node is given its own folder, and no other
        [mine] = [cmd for cmd in supernodes if f"cid={c}" in cmd]
        assert str(node) in mine and not any(str(other) in mine for other in nodes if other != node)
    assert any("flwr-serverapp" in c for c in commands) and any("flwr-clientapp" in c for c in commands)

    sim_values = {**values, "data_dir": str(given), "partition": "given"}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(sim_values))
    flower, simulator = run_records(run_dir), run_records(_simulate(tmp_path, sim_values))
    assert len(flower) == 2 and flower[1]["evaluated"] and not flower[0]["evaluated"]
    for a, b in zip(flower, simulator, strict=True):
        assert set(a) == set(b)
        for k in a:
            if isinstance(a[k], float):
                assert a[k] == pytest.approx(b[k], abs=1e-6), k
            else:
                assert a[k] == b[k], k
    # well above chance (0.1) after 2 rounds on label-skewed nodes, and the simulator's
    assert abs(flower[1]["global_acc"] - simulator[1]["global_acc"]) <= 1e-6 and flower[1]["global_acc"] > 0.2
    server_cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert server_cfg["data_dir"] == NODE_DATA  # the server was never told where any client's data is
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["engine"] == "flower" and summary["flower"]["failures"] == []
    assert summary["flower"]["data"] == "node" and summary["flower"]["test_data"] == server_test
    known = json.loads((run_dir / "clients.json").read_text())
    assert set(known) == {"num_classes", "num_train", "reports", "global_test"} and len(known["reports"]) == 1
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

    recs = run_records(run_dir)
    assert [r["participants"] for r in recs] == [3, 2]
    # the server stops waiting for client 1 15 s after the first reply, or earlier if the SuperLink has already
    # declared the node gone (no heartbeat for 2 x 30 s, which a slow, loaded machine can reach first)
    [failure] = recs[1]["failed"]
    assert failure["client"] == 1 and recs[1]["sampled"] == 3
    assert failure["reason"] == "no reply within 15 s of the first one" or "Node Unavailable" in failure["reason"]
    assert [f["client"] for f in recs[1]["eval_failed"]] == [1]  # not asked again in the same round
    assert math.isfinite(recs[1]["global_acc"]) and recs[1]["global_local_acc"] > 0
    assert recs[0] == run_records(_simulate(tmp_path, BASE))[0]  # round 1, all three alive, is the simulator's
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [(f["round"], f["phase"], f["client"]) for f in summary["flower"]["failures"]] == [
        (2, "train", 1),
        (2, "evaluate", 1),
    ]
    assert json.loads((run_dir / "status.json").read_text())["status"] == "finished"


SECURE = {"clients": 2, "rounds": 1, "eval_every": 1, "seed": 11, "threads": 1, "method": "fedavg"}


def test_secure_loopback_refuses_an_unregistered_supernode(tmp_path):
    from fedskew.flower.loopback import Loopback
    from fedskew.flower.tls import write_node_key

    with Loopback(tmp_path / "home", 1, secure=True) as fed:
        rogue_key, _ = write_node_key(tmp_path / "rogue", "rogue")  # a valid key pair, never registered
        fed.start_node("rogue", {"cid": 1}, private_key=rogue_key)
        deadline = time.monotonic() + 60
        while True:  # the registered node comes online; the rogue one is refused and exits
            listed = fed.nodes()
            online = [n["node-id"] for n in listed if n["status"] == "online"]
            if online and fed.procs["rogue"].poll() is not None:
                break
            assert time.monotonic() < deadline, (listed, fed.log("rogue")[-2000:])
            time.sleep(0.5)
        assert [n["node-id"] for n in listed] == online == [str(fed.node_ids["node0"])]
        assert fed.procs["node0"].poll() is None
    assert fed.procs["rogue"].returncode != 0
    assert "Failed to activate SuperNode" in fed.log("rogue")
    assert fed.leftovers() == []


def _fake_loopback(made: list[dict], output: str) -> type:
    """A stand-in for ``Loopback`` that records how it was built and whose run prints ``output``."""

    class Fake:
        port = 1

        def __init__(self, home, clients, **kwargs) -> None:
            made.append({"clients": clients, **kwargs})

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            pass

        def run_app(self, *args, **kwargs) -> str:
            return output

        def leftovers(self) -> list[int]:
            return []

    return Fake


def test_loopback_command_passes_secure(tmp_path, monkeypatch, capsys):
    import fedskew.flower.loopback as loopback

    made: list[dict] = []
    monkeypatch.setattr(loopback, "Loopback", _fake_loopback(made, "ran"))
    app = _app(tmp_path, SECURE)
    assert main(["flower", "loopback", str(app), "--secure"]) == 0
    assert main(["flower", "loopback", str(app)]) == 0
    here = Path.cwd()
    assert made == [{"clients": 2, "secure": True, "workdir": here}, {"clients": 2, "secure": False, "workdir": here}]
    assert "SuperNode authentication" in capsys.readouterr().out


def test_a_loopback_run_keeps_its_run_directory_and_database_where_the_user_ran_it(tmp_path, monkeypatch):
    """Issue 45: the ServerApp of a loopback deployment runs in a temporary Flower home, so its default
    runs/... directory and database vanished with it. The loopback tells it where the user is."""
    from fedskew.flower.loopback import Loopback
    from fedskew.flower.server_app import RUNS_ROOT_ENV, rooted

    fed = Loopback(tmp_path / "home", 1, workdir=tmp_path / "work")
    assert fed.env[RUNS_ROOT_ENV] == str((tmp_path / "work").resolve())
    monkeypatch.setenv(RUNS_ROOT_ENV, str(tmp_path / "work"))
    assert rooted("runs/fedskew.db") == str(tmp_path / "work" / "runs" / "fedskew.db")
    assert rooted(str(tmp_path / "abs")) == str(tmp_path / "abs")  # an absolute path is the user's choice
    monkeypatch.delenv(RUNS_ROOT_ENV)
    assert rooted("runs/x") == "runs/x"


def test_loopback_output_through_a_pipe_has_no_colour_codes(tmp_path, monkeypatch, capsys):
    import fedskew.flower.loopback as loopback

    output = "\x1b[92mINFO \x1b[0m:      round 1/1 \x1b[1;31mdone\x1b[0m"
    monkeypatch.setattr(loopback, "Loopback", _fake_loopback([], output))
    assert main(["flower", "loopback", str(_app(tmp_path, SECURE))]) == 0
    out = capsys.readouterr().out
    assert "INFO :      round 1/1 done" in out and "\x1b" not in out


def test_secagg_on_a_secure_loopback_gives_the_plain_runs_aggregate(tmp_path):
    """Issue 43: SecAgg+ over a real deployment with TLS and SuperNode authentication: the ServerApp runs Flower's
    SecAgg+ stages with the nodes' ClientApp processes (keys, masks, shares through the SuperLink) and reads each
    round's uploads as one sum; its numbers are the plain run's within the quantization (2**22 levels over ±8)."""
    from fedskew.flower.loopback import Loopback

    # one round (every SecAgg+ stage is a message, and so a ClientApp process, per node); SCAFFOLD: a server half
    # whose control deltas are summed securely too
    values = {**BASE, "method": "scaffold", "rounds": 1, "eval_every": 1}
    app = _app(tmp_path, values, "--secagg", "--round-timeout", "300", "--node-wait", "120")
    assert "secagg = true" in (app / "pyproject.toml").read_text()
    run_dir = tmp_path / "flower"
    with Loopback(tmp_path / "home", 3, secure=True) as fed:
        out = fed.run_app(app, {"out": str(run_dir), "db": ""}, timeout=420)
        assert "round 1/1" in out
    assert fed.leftovers() == []
    [secure], plain = run_records(run_dir), run_records(_simulate(tmp_path, values))
    assert secure["aggregation"] == "secagg+" and secure["participants"] == 3 and "failed" not in secure
    assert secure["train_loss"] == pytest.approx(plain[0]["train_loss"], abs=1e-6)  # trained before any sum
    # the aggregate, read through the global model's test loss: the plain one's within the quantization
    assert secure["global_loss"] == pytest.approx(plain[0]["global_loss"], abs=1e-4)
    assert secure["global_acc"] == pytest.approx(plain[0]["global_acc"], abs=0.01)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["flower"]["secagg"] is True and summary["flower"]["failures"] == []


def test_a_failed_run_names_each_supernodes_state_and_log(tmp_path, monkeypatch):
    """A ServerApp that failed says only that a node did not connect or answer: the error adds each SuperNode's state
    (running, or exited with its code) and the end of its log, so a slow or crashed node is seen in the failure."""
    import subprocess
    import sys

    from fedskew.flower import loopback

    fed = loopback.Loopback(tmp_path / "home", 2)
    fed._spawn("node0", [sys.executable, "-c", "print('node0 could not reach the SuperLink'); raise SystemExit(3)"])
    fed._spawn("node1", [sys.executable, "-c", "import time; print('node1 waiting', flush=True); time.sleep(60)"])
    try:
        fed.procs["node0"].wait(timeout=30)
        deadline = time.monotonic() + 30
        while "waiting" not in fed.log("node1") and time.monotonic() < deadline:
            time.sleep(0.1)
        started = subprocess.CompletedProcess([], 0, b"Successfully started run 7\n", b"")
        monkeypatch.setattr(loopback.subprocess, "run", lambda *a, **k: started)
        monkeypatch.setattr(fed, "run_status", lambda run_id: {"status": "finished:failed", "status-details": "boom"})
        with pytest.raises(loopback.LoopbackError) as caught:
            fed.run_app(tmp_path)
        said = str(caught.value)
        assert "run 7 is finished:failed: boom" in said
        assert "node0 (exited with 3)" in said and "node0 could not reach the SuperLink" in said
        assert "node1 (running)" in said and "node1 waiting" in said
    finally:
        fed.stop(grace=1)
