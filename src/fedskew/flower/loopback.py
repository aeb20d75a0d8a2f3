"""A real Flower deployment on this machine: a SuperLink and N SuperNodes as separate processes on 127.0.0.1.

What the deployment test and ``docs/flower.md``'s overhead numbers run, and what a user can run to try an app folder
before taking it to real machines::

    with Loopback(tmp_dir, num_nodes=3) as fed:       # insecure HTTP on loopback ports, FLWR_HOME in tmp_dir
        fed.run_app(app_dir, {"rounds": 2, "out": "/abs/run"}, timeout=300)   # `flwr run APP loopback --stream`
    # leaving the block stops every process it started (their whole process groups), waits, and checks

Offline by construction: telemetry, the update check and the SuperLink's runtime dependency installation are off
(``FLWR_TELEMETRY_ENABLED=0``, ``FLWR_DISABLE_UPDATE_CHECK=1``, ``FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1``);
nothing binds outside 127.0.0.1. Every wait is bounded; every process is started in a session of its own, so stopping
it stops the SuperExec and app processes it spawned, and :meth:`Loopback.leftovers` finds any process still carrying
this federation's ``FLWR_HOME`` (none, after the block).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

OFFLINE_ENV = {
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
}
TASK_POLL = "0.2"  # FLWR_SUPEREXEC_TASK_POLL_INTERVAL: how often a SuperExec looks for work (flwr's default: 1 s)


class LoopbackError(RuntimeError):
    """The loopback federation did not come up or a run failed; the message points at the logs."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _executable(name: str) -> str:
    """A flwr entry point of this Python environment (next to the interpreter), else from PATH."""
    here = Path(sys.executable).parent / name
    found = str(here) if here.exists() else shutil.which(name)
    if not found:
        raise LoopbackError(f'{name} not found; install the Flower extra: pip install -e ".[flower]"')
    return found


def _toml_string(value: str) -> str:
    return "'" + value.replace("'", "") + "'"


def override_string(values: dict[str, Any]) -> str:
    """``--run-config`` text for ``values`` (strings single-quoted, booleans lower-case)."""
    parts = []
    for k, v in values.items():
        if isinstance(v, bool):
            text = "true" if v else "false"
        elif isinstance(v, int | float):
            text = repr(v)
        else:
            text = _toml_string("" if v is None else str(v))
        parts.append(f"{k}={text}")
    return " ".join(parts)


class Loopback:
    """SuperLink + ``num_nodes`` SuperNodes (``cid=0..num_nodes-1``) on 127.0.0.1; a context manager."""

    def __init__(
        self,
        home: Path,
        num_nodes: int,
        *,
        node_configs: list[dict[str, Any]] | None = None,
        start_timeout: float = 90.0,
    ) -> None:
        self.home = Path(home).resolve()
        self.num_nodes = num_nodes
        self.node_configs = node_configs or [{"cid": c} for c in range(num_nodes)]
        self.start_timeout = start_timeout
        self.port = free_port()
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.last_run: dict[str, Any] = {}  # `flwr list` of the last run_app's run
        self.logs = self.home / "logs"
        self.env = {**os.environ, **OFFLINE_ENV, "FLWR_HOME": str(self.home), "PYTHONUNBUFFERED": "1"}
        self.env.setdefault("FLWR_SUPEREXEC_TASK_POLL_INTERVAL", TASK_POLL)

    # ---- processes -----------------------------------------------------------------------------------------------
    def _spawn(self, name: str, argv: list[str]) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)
        with open(self.logs / f"{name}.log", "wb") as out:
            self.procs[name] = subprocess.Popen(
                argv,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                cwd=self.home,
            )

    def log(self, name: str) -> str:
        path = self.logs / f"{name}.log"
        return path.read_text(errors="replace") if path.is_file() else ""

    def start(self) -> Loopback:
        """Start the SuperLink, wait until it is healthy, start the SuperNodes, wait until all are connected."""
        self.home.mkdir(parents=True, exist_ok=True)
        (self.home / "config.toml").write_text(
            f'[superlink]\ndefault = "loopback"\n\n[superlink.loopback]\naddress = "127.0.0.1:{self.port}"\n'
            "insecure = true\n"
        )
        self._spawn(
            "superlink",
            [
                _executable("flower-superlink"),
                "--insecure",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--disable-runtime-dependency-installation",
            ],
        )
        deadline = time.monotonic() + self.start_timeout
        while not self._healthy():
            self._check_alive("superlink")
            if time.monotonic() > deadline:
                tail = self.log("superlink")[-2000:]
                raise LoopbackError(f"the SuperLink was not healthy within {self.start_timeout:g} s:\n{tail}")
            time.sleep(0.3)
        for i, nc in enumerate(self.node_configs):
            config = " ".join(f"{k}={_toml_string(v) if isinstance(v, str) else v}" for k, v in nc.items())
            self._spawn(
                f"node{i}",
                [
                    _executable("flower-supernode"),
                    "--insecure",
                    "--superlink",
                    f"127.0.0.1:{self.port}",
                    "--port",
                    str(free_port()),
                    "--node-config",
                    config,
                ],
            )
        return self

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def _check_alive(self, name: str) -> None:
        proc = self.procs[name]
        if proc.poll() is not None:
            raise LoopbackError(f"{name} exited with {proc.returncode}:\n{self.log(name)[-2000:]}")

    def run_app(
        self,
        app_dir: Path,
        overrides: dict[str, Any] | None = None,
        *,
        timeout: float = 600.0,
        extra_args: list[str] | None = None,
    ) -> str:
        """``flwr run APP_DIR loopback --stream [--run-config ...]``; returns its output. Raises
        :class:`LoopbackError` when it runs past ``timeout`` or the run did not complete (``flwr run`` exits 0 even when
        the ServerApp raised: the run's status, from ``flwr list --run-id``, decides; :attr:`last_run` holds it,
        traffic and compute time included)."""
        argv = [_executable("flwr"), "run", str(Path(app_dir).resolve()), "loopback", "--stream"]
        if overrides:
            argv += ["--run-config", override_string(overrides)]
        argv += extra_args or []
        try:
            done = subprocess.run(
                argv, env=self.env, cwd=self.home, capture_output=True, timeout=timeout, start_new_session=True
            )
        except subprocess.TimeoutExpired as exc:
            raise LoopbackError(f"flwr run did not finish within {timeout:g} s") from exc
        out = done.stdout.decode(errors="replace") + done.stderr.decode(errors="replace")
        if done.returncode != 0:
            raise LoopbackError(f"flwr run exited with {done.returncode}:\n{out[-3000:]}")
        started = re.search(r"Successfully started run (\d+)", out)
        if started is None:
            raise LoopbackError(f"flwr run started no run:\n{out[-3000:]}")
        self.last_run = self.run_status(started.group(1))
        if self.last_run.get("status") != "finished:completed":
            details = self.last_run.get("status-details", "")
            raise LoopbackError(f"run {started.group(1)} is {self.last_run.get('status')}: {details}\n{out[-3000:]}")
        return out

    def run_status(self, run_id: str, timeout: float = 60.0) -> dict[str, Any]:
        """``flwr list --run-id RUN_ID --format json``: the run's status, timings and traffic."""
        argv = [_executable("flwr"), "list", "loopback", "--run-id", run_id, "--format", "json"]
        done = subprocess.run(argv, env=self.env, cwd=self.home, capture_output=True, timeout=timeout)
        try:
            return dict(json.loads(done.stdout)["runs"][0])
        except (ValueError, KeyError, IndexError) as exc:
            raise LoopbackError(f"flwr list gave no status for run {run_id}: {done.stdout[-1000:]!r}") from exc

    def kill_node(self, index: int) -> None:
        """Kill SuperNode ``index`` and everything it spawned at once (SIGKILL: a machine that died)."""
        proc = self.procs[f"node{index}"]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM every process group (nodes first), SIGKILL what is left after ``grace`` seconds; reap."""
        names = [n for n in self.procs if n != "superlink"] + (["superlink"] if "superlink" in self.procs else [])
        for name in names:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.procs[name].pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for name in names:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.procs[name].wait(timeout=max(0.1, deadline - time.monotonic()))
        for name in names:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.procs[name].pid, signal.SIGKILL)  # the group: spawned SuperExecs and apps too
            self.procs[name].wait(timeout=10)
        end = time.monotonic() + grace  # children of a group leader may need a moment to be reaped by init
        while self.leftovers() and time.monotonic() < end:
            time.sleep(0.2)

    def leftovers(self) -> list[int]:
        """Processes still running with this federation's ``FLWR_HOME`` in their environment."""
        marker = f"FLWR_HOME={self.home}".encode()
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                env = (entry / "environ").read_bytes()
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if b"\0" + marker + b"\0" in b"\0" + env and stat.split(")")[-1].split()[0] != "Z":
                found.append(int(entry.name))
        return found

    def __enter__(self) -> Loopback:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()
