"""`fedskew sweep --executor ray` (issue 26): a real two-node Ray cluster on the loopback interface, the sweep's run
directories and database equal to a local `--jobs 1` sweep's, a second invocation running nothing, and a worker node
killed mid-run: the sweep finishes after the node is back, the interrupted run resumed from the checkpoint that had
travelled to the driver. Plus the run-directory mirroring the executor does, without Ray.

The cluster: a head node with no CPU (it holds the driver and its inbox; no run can land there) and a worker node
with 2 CPUs, started with the `ray` CLI in their own sessions, with token authentication on, and killed by process id
(their whole process trees) when the tests end. Every wait is bounded. The nodes advertise 127.0.0.2: Ray rewrites
127.0.0.1 into the machine's outward address, and every 127.x address is the loopback interface."""

import contextlib
import importlib.util
import json
import os
import secrets
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
from conftest import run_records

from fedskew.cli import main
from fedskew.config import ConfigError, make_config
from fedskew.protocol import TIMING_KEYS
from fedskew.sweep.ray import INSTALL_HINT, check_ray, import_ray
from fedskew.sweep.ray_task import config_text, read_run_files, write_run_files

SRC = Path(__file__).resolve().parents[1] / "src"
IP = "127.0.0.2"
TINY = {"dataset": "digits", "clients": 4, "rounds": 3, "model": "mlp", "skew_probes": 0, "lr": 0.1, "batch_size": 64}
SUMMARY_TIMING = {"run_id", "created", "wall_time", "checkpoints", "checkpoint_time"}
# the `ray` command of this Python's environment (a virtual environment need not be on PATH)
RAY_CLI = str(Path(sys.executable).parent / "ray") if (Path(sys.executable).parent / "ray").exists() else "ray"
pytestmark = pytest.mark.xdist_group("ray")  # one local Ray cluster at a time (conftest, pyproject)

needs_ray = pytest.mark.skipif(
    importlib.util.find_spec("ray") is None or shutil.which(RAY_CLI) is None,
    reason="Ray is not installed (extra [ray]), or its `ray` command is missing",
)


# ---- the run directory mirroring, without Ray ----------------------------------------------------------------------
def test_run_files_travel_and_land_in_order(tmp_path):
    src = tmp_path / "task"
    (src / "client_state").mkdir(parents=True)
    for name, text in [("status.json", "{}"), ("metrics.jsonl", "1\n"), ("checkpoint.pt", "c"), ("config.yaml", "")]:
        (src / name).write_text(text)
    (src / "client_state" / "store.json").write_text("s")
    (src / ".lock").write_text("held")
    (src / ".status.json.tmp-12").write_text("half")
    files = read_run_files(src)
    assert sorted(files) == ["checkpoint.pt", "client_state/store.json", "config.yaml", "metrics.jsonl", "status.json"]

    dest = tmp_path / "driver" / "run"
    values = {"out": str(dest), "db": str(tmp_path / "x.db")}
    files["config.yaml"] = b"method: fedavg\nout: /tmp/elsewhere\ndb: null\nseed: 0\n"
    write_run_files(dest, files, set(), values)
    times = {p.name: p.stat().st_mtime_ns for p in dest.rglob("*") if p.is_file()}
    assert times["metrics.jsonl"] <= times["checkpoint.pt"] <= times["status.json"]  # the status last
    assert (dest / "config.yaml").read_text() == f"method: fedavg\nout: {dest}\ndb: {tmp_path / 'x.db'}\nseed: 0\n"
    # the run ended: its checkpoint and client-state store went away; so do they here, and the emptied folder
    write_run_files(dest, {"summary.json": b"{}"}, {"checkpoint.pt", "client_state/store.json"}, values)
    assert sorted(p.name for p in dest.iterdir()) == ["config.yaml", "metrics.jsonl", "status.json", "summary.json"]
    with pytest.raises(OSError, match="outside its run directory"):
        write_run_files(dest, {"../escape": b"x"}, set(), values)
    assert not (dest.parent / "escape").exists()
    assert config_text(b"- not a mapping\n", values) == b"- not a mapping\n"


def test_ray_flags_need_the_ray_executor_and_ray_itself(tmp_path, monkeypatch, capsys):
    spec = tmp_path / "s.yaml"
    spec.write_text(f"base: {json.dumps(TINY)}\n")
    assert main(["sweep", str(spec), "--address", "auto", "--dry-run"]) == 2
    assert "go with --executor ray" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray were not installed
    for check in (check_ray, import_ray):
        with pytest.raises(ConfigError, match=r"pip install 'fedskew\[ray\]'"):
            check()
    assert main(["sweep", str(spec), "--executor", "ray", "--dry-run"]) == 2
    assert INSTALL_HINT in capsys.readouterr().err


# ---- a real two-node cluster ------------------------------------------------------------------------------------
def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


class Cluster:
    """A head (no CPU) and a worker node (2 CPUs) on the loopback interface, each a `ray start --block` process
    in its own session; only the processes these started are ever stopped, by id."""

    def __init__(self, root: Path, env: dict[str, str]) -> None:
        self.root, self.env = root, env
        with socket.socket() as s:
            s.bind((IP, 0))
            self.port = s.getsockname()[1]
        self.address = f"{IP}:{self.port}"
        self.procs: list[subprocess.Popen] = []
        common = ["--disable-usage-stats", "--object-store-memory", str(100 * 2**20), "--node-ip-address", IP]
        self.head = self._start(
            "head",
            ["--head", "--port", str(self.port), "--num-cpus", "0", "--include-dashboard", "false"]
            + ["--temp-dir", str(root / "ray"), *common],
        )
        self.worker_args = ["--address", self.address, "--num-cpus", "2", *common]
        self.worker = self._start("worker", self.worker_args)

    def _start(self, name: str, args: list[str], timeout: float = 90) -> subprocess.Popen:
        log = self.root / f"{name}.log"
        seen = log.read_text().count("Ray runtime started") if log.exists() else 0
        with log.open("a") as f:
            proc = subprocess.Popen(
                [RAY_CLI, "start", "--block", *args], stdout=f, stderr=subprocess.STDOUT, env=self.env,
                start_new_session=True,
            )  # fmt: skip
        self.procs.append(proc)
        start = time.monotonic()
        while log.read_text().count("Ray runtime started") <= seen:
            if proc.poll() is not None or time.monotonic() - start > timeout:
                raise RuntimeError(f"ray start ({name}) did not come up:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)
        return proc

    def kill(self, proc: subprocess.Popen) -> None:
        """SIGKILL a node's whole process tree (raylet, agents, its Ray workers): the machine is gone."""
        for _ in range(2):  # again for anything it started meanwhile
            for pid in _descendants(proc.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)

    def restart_worker(self) -> None:
        self.worker = self._start("worker", self.worker_args)

    def stop(self) -> None:
        for proc in reversed(self.procs):
            self.kill(proc)


@pytest.fixture(scope="module")
def cluster():
    try:
        with socket.socket() as s:
            s.bind((IP, 0))
    except OSError:
        pytest.skip(f"{IP} is not a loopback address here")
    root = Path(tempfile.mkdtemp(prefix="fsr", dir="/tmp"))  # short: Ray's socket paths must fit 107 bytes
    token = secrets.token_hex(32)
    env = {
        **os.environ,
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_AUTH_MODE": "token",  # only holders of the token can join or submit
        "RAY_AUTH_TOKEN": token,
        "TMPDIR": str(root),  # the tasks' temporary run directories
        "PYTHONPATH": os.pathsep.join([str(SRC), *filter(None, [os.environ.get("PYTHONPATH")])]),
    }
    (root / "ray").mkdir()
    c = None
    try:
        c = Cluster(root, env)
        yield c
    finally:
        if c is not None:
            c.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def ray_env(cluster, monkeypatch):
    for key in ("RAY_USAGE_STATS_ENABLED", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN"):
        monkeypatch.setenv(key, cluster.env[key])
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    return cluster


def _db(path: Path, root: Path) -> dict[str, dict]:
    """The database rows of each run (by folder name) without the run id, its timing and the root folder."""
    conn = sqlite3.connect(path)
    conn.row_factory = sqlite3.Row
    out = {}
    for run in conn.execute("SELECT * FROM runs"):
        row = dict(run)
        rid = row.pop("run_id")
        for key in ("created", "wall_time"):
            row.pop(key)
        cfg, summary = json.loads(row.pop("config")), json.loads(row.pop("summary"))
        cfg.pop("out"), cfg.pop("db")
        rounds = [
            {**dict(r), "metrics": {k: v for k, v in json.loads(r["metrics"]).items() if k not in TIMING_KEYS}}
            for r in conn.execute("SELECT * FROM rounds WHERE run_id = ? ORDER BY round", (rid,))
        ]
        clients = [
            dict(r) for r in conn.execute("SELECT * FROM client_metrics WHERE run_id = ? ORDER BY 2,3,4", (rid,))
        ]
        for r in rounds + clients:
            r.pop("run_id")
        name = Path(row.pop("run_dir")).relative_to(root).as_posix()
        summary = {k: v for k, v in summary.items() if k not in SUMMARY_TIMING and not k.startswith("mean_time")}
        out[name] = {**row, "config": cfg, "summary": summary, "rounds": rounds, "clients": clients}
    conn.close()
    return out


@needs_ray
@pytest.mark.timeout(240)
def test_a_sweep_on_a_two_node_cluster_equals_a_local_one(ray_env, tmp_path, capsys):
    spec = tmp_path / "spec.yaml"
    spec.write_text(f"base: {json.dumps(TINY)}\nmethods: [fedavg, fedprox]\nseeds: 2\n")
    on_ray, local = tmp_path / "ray", tmp_path / "local"
    assert main(["sweep", str(spec), "--executor", "ray", "--address", ray_env.address, "--out", str(on_ray)]) == 0
    out, err = capsys.readouterr()
    assert "4 runs: 4 finished" in out and f"on the Ray cluster at {ray_env.address}" in err
    assert "wait for a node" not in err  # the worker node's CPUs hold a run
    assert main(["sweep", str(spec), "--jobs", "1", "--out", str(local), "--quiet"]) == 0
    capsys.readouterr()

    names = sorted(p.name for p in on_ray.iterdir() if p.is_dir())
    assert len(names) == 4 and names == sorted(p.name for p in local.iterdir() if p.is_dir())
    for name in names:
        a, b = on_ray / name, local / name
        assert sorted(p.name for p in a.iterdir()) == sorted(p.name for p in b.iterdir())  # no checkpoint, no lock
        assert run_records(a) == run_records(b)
        for same in ("clients.json", "client_metrics.jsonl"):
            assert (a / same).read_bytes() == (b / same).read_bytes()
        assert (a / "config.yaml").read_text().replace(str(on_ray), str(local)) == (b / "config.yaml").read_text()
    assert _db(on_ray / "fedskew.db", on_ray) == _db(local / "fedskew.db", local)

    # the same command again: everything is done, nothing is submitted (Ray is not even contacted)
    before = {p: p.stat().st_mtime_ns for p in on_ray.rglob("*")}
    assert main(["sweep", str(spec), "--executor", "ray", "--address", "127.0.0.2:1", "--out", str(on_ray)]) == 0
    assert "4 runs: 4 skipped" in capsys.readouterr().out
    assert {p: p.stat().st_mtime_ns for p in on_ray.rglob("*")} == before


def _wait(what: str, check, timeout: float, proc: subprocess.Popen | None = None, log: Path | None = None):
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout or (proc is not None and proc.poll() is not None):
            raise AssertionError(f"timed out waiting for {what}" + (f":\n{log.read_text()[-3000:]}" if log else ""))
        time.sleep(0.05)


@needs_ray
@pytest.mark.timeout(300)
def test_a_killed_worker_node_resumes_its_run_from_the_travelled_checkpoint(ray_env, tmp_path):
    long_rounds = 120
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        textwrap.dedent(f"""
        base: {json.dumps({**TINY, "checkpoint_every": 1})}
        cases: [{{rounds: 3}}, {{rounds: {long_rounds}}}]
        out: {tmp_path / "sw"}
        """)
    )
    err, task_root = tmp_path / "driver.err", Path(ray_env.env["TMPDIR"])  # task_root: where the tasks' folders go
    cmd = [sys.executable, "-c", "import sys; from fedskew.cli import main; sys.exit(main(sys.argv[1:]))", "sweep"]
    cmd += [str(spec), "--executor", "ray", "--address", ray_env.address, "--quiet"]
    with err.open("w") as f_err:
        driver = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=f_err, text=True, env=ray_env.env)
    try:
        long_dir: Path = tmp_path
        status: dict = {}

        def checkpointed() -> bool:
            nonlocal long_dir, status
            dirs = list((tmp_path / "sw").glob(f"*rounds{long_rounds}*"))
            if not dirs or not (dirs[0] / "status.json").is_file():
                return False
            long_dir = dirs[0]
            with contextlib.suppress(OSError, ValueError):
                status = json.loads((long_dir / "status.json").read_text())
            return (status.get("checkpoint_round") or 0) >= 4

        def short_run_ended() -> bool:  # its task cleaned up, so killing the node cannot catch it half-way out
            dirs = list((tmp_path / "sw").glob("*rounds3-*"))
            with contextlib.suppress(OSError, ValueError):
                ended = bool(dirs) and json.loads((dirs[0] / "status.json").read_text())["status"] == "finished"
                return ended and not list(task_root.glob("fedskew-ray-*/*rounds3-*"))
            return False

        _wait("the long run's 4th checkpoint on the driver's side", checkpointed, 120, driver, err)
        _wait("the short run to end and its task to clean up", short_run_ended, 60, driver, err)
        assert json.loads((long_dir / "status.json").read_text())["status"] == "running"  # when its node dies
        assert (long_dir / "checkpoint.pt").is_file() and (long_dir / ".lock").is_file()  # the driver holds it
        ray_env.kill(ray_env.worker)  # the worker node dies mid-run
        _wait("the driver to submit the run again", lambda: "submitted again" in err.read_text(), 60, driver, err)
        assert json.loads((long_dir / "status.json").read_text())["status"] == "running"  # waiting for a node
        ray_env.restart_worker()
        stdout, _ = driver.communicate(timeout=180)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait(timeout=10)
    log = err.read_text()
    assert driver.returncode == 0, stdout + log
    assert "2 runs: 2 finished" in stdout and "resumed from a checkpoint" in stdout
    assert "NodeDiedError" in log or "WorkerCrashedError" in log
    assert f"resuming {long_dir} after round" in log  # the note names the driver's folder, not the task's
    assert sorted(p.name for p in long_dir.iterdir()) == [
        "client_metrics.jsonl", "clients.json", "config.yaml", "metrics.jsonl", "status.json", "summary.json",
    ]  # fmt: skip
    assert json.loads((long_dir / "status.json").read_text())["status"] == "finished"
    # the resumed run equals an uninterrupted one, round for round
    from fedskew.runner import run_experiment

    cfg = make_config({**TINY, "checkpoint_every": 1, "rounds": long_rounds, "out": str(tmp_path / "ref"), "db": None})
    run_experiment(cfg)
    assert run_records(long_dir) == run_records(tmp_path / "ref")
    with sqlite3.connect(tmp_path / "sw" / "fedskew.db") as conn:
        assert conn.execute("SELECT COUNT(*) FROM runs").fetchone() == (2,)
    assert not list(task_root.glob("fedskew-ray-*/*/summary.json"))  # the tasks cleaned up
