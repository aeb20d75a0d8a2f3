"""A real Flower deployment on this machine: a SuperLink and N SuperNodes as separate processes on 127.0.0.1.

What the deployment test and ``docs/flower.md``'s overhead numbers run, and what a user can run to try an app folder
before taking it to real machines::

    with Loopback(tmp_dir, num_nodes=3) as fed:       # insecure HTTP on loopback ports, FLWR_HOME in tmp_dir
        fed.run_app(app_dir, {"rounds": 2, "out": "/abs/run"}, timeout=300)   # `flwr run APP loopback --stream`
    # leaving the block stops every process it started (their whole process groups), waits, and checks

    with Loopback(tmp_dir, num_nodes=3, secure=True) as fed:   # TLS + SuperNode authentication, as across machines
        ...

``secure=True`` (``fedskew flower loopback --secure``) sets up what docs/flower.md's "TLS and authentication" asks
of real machines, with throwaway material in the federation's own folder (:mod:`fedskew.flower.tls`): a CA and a
server certificate for 127.0.0.1/localhost (``tls/``; the CA's key is never written), the SuperLink started with
``--ssl-ca-certfile/--ssl-certfile/--ssl-keyfile --enable-supernode-auth``, one EC P-384 key pair per SuperNode
(``keys/``) registered with ``flwr supernode register KEY.pub loopback`` before the node starts with
``--root-certificates ca.crt --auth-supernode-private-key KEY`` (its own 127.0.0.1 Runtime API on TLS too), and
``flwr`` connecting with ``root-certificates``: no process of the federation runs with ``--insecure``, and the
SuperLink refuses any SuperNode whose key was not registered. Without it: ``--insecure`` everywhere, any node
accepted (this machine only).

Offline by construction: telemetry, the update check and the SuperLink's runtime dependency installation are off
(``FLWR_TELEMETRY_ENABLED=0``, ``FLWR_DISABLE_UPDATE_CHECK=1``, ``FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1``);
nothing binds outside 127.0.0.1. Every wait is bounded; every process is started in a session of its own, so stopping
it stops the SuperExec and app processes it spawned (a refused SuperNode's SuperExec included), and
:meth:`Loopback.leftovers` finds any process still carrying this federation's ``FLWR_HOME`` (none, after the block).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from fedskew.flower.tls import TlsFiles, write_node_key, write_tls

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


def processes_with_home(home: Path) -> dict[int, list[str]]:
    """pid -> command line of every live process (not a zombie, not this one) whose environment has
    ``FLWR_HOME=home`` (Linux ``/proc``): what a federation in that home started."""
    marker = f"FLWR_HOME={home}".encode()
    found: dict[int, list[str]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            env = (entry / "environ").read_bytes()
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if b"\0" + marker + b"\0" in b"\0" + env and stat.split(")")[-1].split()[0] != "Z":
            found[int(entry.name)] = [a.decode(errors="replace") for a in cmdline.split(b"\0") if a]
    return found


class Loopback:
    """SuperLink + ``num_nodes`` SuperNodes (``cid=0..num_nodes-1``) on 127.0.0.1; a context manager.

    ``secure=True``: TLS on every connection (a throwaway CA and a server certificate for 127.0.0.1/localhost in
    ``home/tls``) and SuperNode authentication (the SuperLink refuses any node whose public key was not registered
    with ``flwr supernode register``; one EC key pair per node in ``home/keys``); no ``--insecure`` anywhere."""

    def __init__(
        self,
        home: Path,
        num_nodes: int,
        *,
        node_configs: list[dict[str, Any]] | None = None,
        start_timeout: float = 90.0,
        secure: bool = False,
        workdir: Path | None = None,
    ) -> None:
        self.home = Path(home).resolve()
        self.num_nodes = num_nodes
        self.node_configs = node_configs or [{"cid": c} for c in range(num_nodes)]
        self.start_timeout = start_timeout
        self.secure = secure
        self.tls: TlsFiles | None = None  # secure mode: the CA and server certificate, written by start()
        self.node_ids: dict[str, int] = {}  # secure mode: SuperNode name -> the node id its registration returned
        self.port = free_port()
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.last_run: dict[str, Any] = {}  # `flwr list` of the last run_app's run
        self.logs = self.home / "logs"
        self.keys = self.home / "keys"
        self.env = {**os.environ, **OFFLINE_ENV, "FLWR_HOME": str(self.home), "PYTHONUNBUFFERED": "1"}
        self.env.setdefault("FLWR_SUPEREXEC_TASK_POLL_INTERVAL", TASK_POLL)
        if workdir is not None:  # the ServerApp's relative run directory and database go there, not in the home
            self.env["FEDSKEW_RUNS_ROOT"] = str(Path(workdir).resolve())

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

    def _flwr(self, args: list[str], timeout: float) -> subprocess.CompletedProcess[bytes]:
        """``flwr ARGS`` against this federation (FLWR_HOME's ``loopback`` connection), bounded by ``timeout``."""
        try:
            return subprocess.run(
                [_executable("flwr"), *args],
                env=self.env,
                cwd=self.home,
                capture_output=True,
                timeout=timeout,
                start_new_session=True,
            )
        except subprocess.TimeoutExpired as exc:
            raise LoopbackError(f"flwr {' '.join(args[:2])} did not finish within {timeout:g} s") from exc

    def start(self) -> Loopback:
        """Start the SuperLink and wait until it is healthy; in secure mode, register the SuperNodes' public keys;
        start the SuperNodes (the ServerApp waits for them to connect: ``flower.node_wait``)."""
        self.home.mkdir(parents=True, exist_ok=True)
        if self.secure:
            self.tls = write_tls(self.home / "tls")
            connection = f"root-certificates = {_toml_string(str(self.tls.ca))}\n"
            flags = ["--ssl-ca-certfile", str(self.tls.ca), "--ssl-certfile", str(self.tls.cert)]
            flags += ["--ssl-keyfile", str(self.tls.key), "--enable-supernode-auth"]
        else:
            connection, flags = "insecure = true\n", ["--insecure"]
        (self.home / "config.toml").write_text(
            f'[superlink]\ndefault = "loopback"\n\n[superlink.loopback]\naddress = "127.0.0.1:{self.port}"\n'
            + connection
        )
        self._spawn(
            "superlink",
            [
                _executable("flower-superlink"),
                *flags,
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
        names = [f"node{i}" for i in range(len(self.node_configs))]
        private_keys: dict[str, Path | None] = dict.fromkeys(names)
        if self.secure:
            pairs = {name: write_node_key(self.keys, name) for name in names}
            self.node_ids.update(self.register_nodes([public for _, public in pairs.values()], names))
            private_keys = {name: private for name, (private, _) in pairs.items()}
        for name, nc in zip(names, self.node_configs, strict=True):
            self.start_node(name, nc, private_key=private_keys[name])
        return self

    def register_nodes(self, public_keys: list[Path], names: list[str] | None = None) -> dict[str, int]:
        """``flwr supernode register PUBLIC_KEY loopback`` for each key (at once, each bounded by the start
        timeout); returns name (default: the key's file name) -> node id."""
        names = names or [Path(k).stem for k in public_keys]
        self.logs.mkdir(parents=True, exist_ok=True)
        running = {}
        for name, key in zip(names, public_keys, strict=True):
            argv = [_executable("flwr"), "supernode", "register", str(key), "loopback", "--format", "json"]
            running[name] = subprocess.Popen(
                argv,
                env=self.env,
                cwd=self.home,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + self.start_timeout
        ids: dict[str, int] = {}
        failed: list[str] = []
        for name, proc in running.items():
            try:
                out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                out, _ = proc.communicate(timeout=10)
            text = out.decode(errors="replace")
            found = re.search(r'"node-id":\s*"?(\d+)', text)
            if proc.returncode == 0 and found:
                ids[name] = int(found.group(1))
            else:
                failed.append(f"{name} (exit {proc.returncode}): {text[-1000:]}")
        if failed:
            raise LoopbackError("flwr supernode register failed for " + "\n".join(failed))
        return ids

    def start_node(self, name: str, node_config: dict[str, Any], *, private_key: Path | None = None) -> None:
        """Start a SuperNode ``name`` (log: ``logs/NAME.log``) with ``node_config``; in secure mode it verifies the
        SuperLink's certificate against the run's CA and authenticates with ``private_key`` (required)."""
        if self.secure:
            if self.tls is None or private_key is None:
                raise LoopbackError(f"{name}: a secure SuperNode needs the run's CA (start first) and a private key")
            flags = ["--root-certificates", str(self.tls.ca), "--auth-supernode-private-key", str(private_key)]
            # the node's own Runtime API (127.0.0.1, for its SuperExec and ClientApps) on TLS too
            flags += ["--ssl-certfile", str(self.tls.cert), "--ssl-keyfile", str(self.tls.key)]
            flags += ["--ssl-ca-certfile", str(self.tls.ca)]
        else:
            flags = ["--insecure"]
        config = " ".join(f"{k}={_toml_string(v) if isinstance(v, str) else v}" for k, v in node_config.items())
        self._spawn(
            name,
            [
                _executable("flower-supernode"),
                *flags,
                "--superlink",
                f"127.0.0.1:{self.port}",
                "--port",
                str(free_port()),
                "--node-config",
                config,
            ],
        )

    def nodes(self, timeout: float = 60.0) -> list[dict[str, Any]]:
        """``flwr supernode list loopback --format json``: the SuperLink's nodes (``node-id``, ``status``: registered,
        online, offline, ...)."""
        done = self._flwr(["supernode", "list", "loopback", "--format", "json"], timeout)
        try:
            return list(json.loads(done.stdout)["nodes"])
        except (ValueError, KeyError) as exc:
            raise LoopbackError(f"flwr supernode list gave no nodes: {done.stdout[-1000:]!r}") from exc

    def _healthy(self) -> bool:
        scheme, context = "http", None
        if self.tls is not None:  # verifies the SuperLink's certificate as the nodes do
            scheme, context = "https", ssl.create_default_context(cafile=str(self.tls.ca))
        try:
            with urllib.request.urlopen(f"{scheme}://127.0.0.1:{self.port}/health", timeout=2, context=context) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def process_report(self, tail: int = 400) -> str:
        """Each SuperNode's state (running, or exited with its code) and the end of its log: what a failed run's
        error carries, since the ServerApp sees only that a node did not connect or answer."""
        lines = []
        for name, proc in self.procs.items():
            if name == "superlink":
                continue
            code = proc.poll()
            state = "running" if code is None else f"exited with {code}"
            end = self.log(name)[-tail:].strip()
            lines.append(f"{name} ({state}); its log ends:\n  " + (end.replace("\n", "\n  ") if end else "(empty)"))
        return "\n".join(lines)

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
            raise LoopbackError(
                f"run {started.group(1)} is {self.last_run.get('status')}: {details}\n{out[-3000:]}\n"
                f"the SuperNodes:\n{self.process_report()}"
            )
        return out

    def run_status(self, run_id: str, timeout: float = 60.0) -> dict[str, Any]:
        """``flwr list --run-id RUN_ID --format json``: the run's status, timings and traffic."""
        done = self._flwr(["list", "loopback", "--run-id", run_id, "--format", "json"], timeout)
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
        return list(self.processes())

    def processes(self) -> dict[int, list[str]]:
        """pid -> command line of every live process carrying this federation's ``FLWR_HOME`` (Linux ``/proc``)."""
        return processes_with_home(self.home)

    def __enter__(self) -> Loopback:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()
