"""Flower's Simulation Engine: an app folder run on a local-simulation federation, one simulated SuperNode per client.

``flwr run APP local-simulation`` starts a local SuperLink in simulation mode, which runs the ClientApps as Ray
actors; each simulated node's config carries ``partition-id`` (fedskew's client id, :func:`~fedskew.flower.settings.
node_overrides`) and ``num-partitions``. The connection lives in ``$FLWR_HOME/config.toml``::

    [superlink.local-simulation]
    address = ":local:"
    options.num-supernodes = 20                          # = clients
    options.backend.client-resources.num-cpus = 1        # Flower's default 2 runs one actor at a time on 2 cores
    options.backend.client-resources.num-gpus = 0.25     # four actors share a GPU

:func:`connection` writes that block (``fedskew flower new --simulation`` puts it in the app folder as
``simulation.toml``); :class:`LocalSimulation` runs an app in a throwaway ``FLWR_HOME`` with a bounded wait and
stops what ``flwr run`` leaves running (the auto-started SuperLink and its simulation process outlive it), so that
``fedskew flower simulate DIR`` leaves nothing behind. The ServerApp, the ClientApp and every number are the same as
in a deployment and as ``fedskew run`` (tests/test_flower_simulation.py compares them).

It needs Ray (the extra ``[flower-sim]``). Flower's own ``flwr[simulation]`` extra pins one Ray release (2.55.1 for
flwr 1.42), which would conflict with the Ray executor's; fedskew asks for flwr and Ray separately (verified with
Ray 2.60).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from fedskew.flower.loopback import OFFLINE_ENV, LoopbackError, _executable, override_string, processes_with_home

CONNECTION = "local-simulation"
RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def connection(clients: int, num_cpus: float = 1.0, num_gpus: float = 0.0, default: bool = False) -> str:
    """The ``[superlink.local-simulation]`` block of ``$FLWR_HOME/config.toml`` for ``clients`` simulated nodes."""
    if clients < 1:
        raise ValueError(f"a simulation needs at least one node, got {clients}")
    if num_cpus <= 0 or num_gpus < 0:
        raise ValueError(f"client resources must be num-cpus > 0 and num-gpus >= 0, got {num_cpus}, {num_gpus}")
    head = f'[superlink]\ndefault = "{CONNECTION}"\n\n' if default else ""
    return (
        f"{head}[superlink.{CONNECTION}]\n"
        'address = ":local:"\n'
        f"options.num-supernodes = {int(clients)}\n"
        f"options.backend.client-resources.num-cpus = {float(num_cpus):g}\n"
        f"options.backend.client-resources.num-gpus = {float(num_gpus):g}\n"
    )


class LocalSimulation:
    """A local-simulation federation of ``clients`` nodes in ``home`` (its ``FLWR_HOME``); a context manager whose
    exit stops every process that carries this ``FLWR_HOME``."""

    def __init__(self, home: Path, clients: int, *, num_cpus: float = 1.0, num_gpus: float = 0.0) -> None:
        self.home = Path(home).resolve()
        self.clients = clients
        self.text = connection(clients, num_cpus, num_gpus, default=True)
        self.env = {**os.environ, **OFFLINE_ENV, **RAY_ENV, "FLWR_HOME": str(self.home), "PYTHONUNBUFFERED": "1"}

    def __enter__(self) -> LocalSimulation:
        self.home.mkdir(parents=True, exist_ok=True)
        (self.home / "config.toml").write_text(self.text)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def run_app(
        self,
        app_dir: Path,
        overrides: dict[str, Any] | None = None,
        *,
        timeout: float = 1800.0,
        extra_args: list[str] | None = None,
    ) -> tuple[str, dict[str, Any]]:
        """``flwr run APP_DIR local-simulation --stream``; its output and the run's ``flwr list`` status. Raises
        :class:`~fedskew.flower.loopback.LoopbackError` past ``timeout`` or when the run did not complete."""
        argv = [_executable("flwr"), "run", str(Path(app_dir).resolve()), CONNECTION, "--stream"]
        if overrides:
            argv += ["--run-config", override_string(overrides)]
        argv += extra_args or []
        done = self._run(argv, timeout, "flwr run")
        out = done.stdout.decode(errors="replace") + done.stderr.decode(errors="replace")
        started = re.search(r"Successfully started run (\d+)", out)
        if done.returncode != 0 or started is None:
            raise LoopbackError(f"flwr run exited with {done.returncode} and started no run:\n{out[-3000:]}")
        status = self.run_status(started.group(1))
        if status.get("status") != "finished:completed":
            details = status.get("status-details", "")
            raise LoopbackError(f"run {started.group(1)} is {status.get('status')}: {details}\n{out[-3000:]}")
        return out, status

    def run_status(self, run_id: str, timeout: float = 60.0) -> dict[str, Any]:
        import json

        done = self._run([_executable("flwr"), "list", CONNECTION, "--run-id", run_id, "--format", "json"], timeout)
        try:
            return dict(json.loads(done.stdout)["runs"][0])
        except (ValueError, KeyError, IndexError) as exc:
            raise LoopbackError(f"flwr list gave no status for run {run_id}: {done.stdout[-1000:]!r}") from exc

    def _run(self, argv: list[str], timeout: float, what: str = "flwr") -> subprocess.CompletedProcess[bytes]:
        try:
            return subprocess.run(
                argv, env=self.env, cwd=self.home, capture_output=True, timeout=timeout, start_new_session=True
            )
        except subprocess.TimeoutExpired as exc:
            raise LoopbackError(f"{what} did not finish within {timeout:g} s") from exc

    def leftovers(self) -> list[int]:
        """Processes still running with this federation's ``FLWR_HOME`` in their environment."""
        return list(processes_with_home(self.home))

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM every process carrying this ``FLWR_HOME`` (the local SuperLink, its simulation, Ray's workers),
        SIGKILL what is left after ``grace`` seconds."""
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, grace)):
            for pid in self.leftovers():
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, sig)
            end = time.monotonic() + wait
            while self.leftovers() and time.monotonic() < end:
                time.sleep(0.2)
            if not self.leftovers():
                return
