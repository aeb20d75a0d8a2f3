"""The Ray side of ``fedskew sweep --executor ray`` that runs on a worker node, and the run-directory files that
travel between it and the driver (:mod:`fedskew.sweep.ray` is the driver): :func:`remote_run` is one run's task body,
:class:`Inbox` the actor the tasks send to, :func:`read_run_files` and :func:`write_run_files` a run directory as
bytes and back (written in an order that always leaves a directory a local run could have left)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import shutil
import socket
import tempfile
from dataclasses import replace
from pathlib import Path, PurePosixPath
from typing import Any

import yaml

from fedskew.results.rundir import CHECKPOINT, LOCK, ROUND_FILES, STATUS, RunDirectory, RunDirError, write_atomic
from fedskew.sweep.task import Event, RunResult, Task, execute_run

_TEMP = re.compile(r"^\..*\.tmp-\d+$")  # a file being written (write_atomic, save_checkpoint): never travels


# ---- run directory files ---------------------------------------------------------------------------------------
def read_run_files(run_dir: Path) -> dict[str, bytes]:
    """Every file of a run directory (relative POSIX path -> bytes), except its lock and half-written files."""
    files: dict[str, bytes] = {}
    if not run_dir.is_dir():
        return files
    for path in sorted(run_dir.rglob("*")):
        rel = path.relative_to(run_dir).as_posix()
        if path.is_file() and rel != LOCK and not _TEMP.match(path.name):
            files[rel] = path.read_bytes()
    return files


def _order(rel: str) -> int:
    """Write order: whatever else first, then the per-round files, the checkpoint, the summary, the status."""
    return {**dict.fromkeys(ROUND_FILES, 1), CHECKPOINT: 2, "summary.json": 3, STATUS: 4}.get(rel, 0)


def _inside(run_dir: Path, rel: str) -> Path:
    p = PurePosixPath(rel)
    if p.is_absolute() or ".." in p.parts or not p.parts:
        raise RunDirError(f"a Ray task sent a file outside its run directory ({rel!r}); refused")
    return run_dir.joinpath(*p.parts)


def config_text(data: bytes, values: dict[str, Any]) -> bytes:
    """A task's ``config.yaml`` with the driver's ``out`` and ``db`` (the task ran in a temporary directory)."""
    saved = yaml.safe_load(data)
    if not isinstance(saved, dict):
        return data
    saved.update(out=values.get("out"), db=values.get("db"))
    return yaml.safe_dump(saved, sort_keys=False).encode()


def write_run_files(run_dir: Path, files: dict[str, bytes], gone: set[str], values: dict[str, Any]) -> None:
    """Bring ``run_dir`` up to a task's copy: write ``files`` (each atomically, in :func:`_order`), then delete
    ``gone`` (files the task's run deleted: the checkpoint of an ended run, its client-state store) and the folders
    they leave empty."""
    run_dir.mkdir(parents=True, exist_ok=True)
    for rel in sorted(files, key=lambda r: (_order(r), r)):
        path = _inside(run_dir, rel)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, config_text(files[rel], values) if rel == "config.yaml" else files[rel])
    for rel in sorted(gone, key=lambda r: (-len(PurePosixPath(r).parts), r)):
        path = _inside(run_dir, rel)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        for parent in path.parents:
            if parent == run_dir or not parent.is_relative_to(run_dir):
                break
            with contextlib.suppress(OSError):
                parent.rmdir()  # only if empty


# ---- the task (runs on a worker node) -------------------------------------------------------------------------
class _Shipper:
    """Sends the task's events and, after every checkpoint, its run directory's changed files to the inbox."""

    def __init__(self, ray: Any, inbox: Any, name: str, attempt: int, run_dir: Path, real: str) -> None:
        self.ray, self.inbox, self.name, self.attempt = ray, inbox, name, attempt
        self.run_dir, self.real = run_dir, real
        self.sent: dict[str, bytes] = {}  # rel -> digest of what the driver has
        self.checkpoint_round: Any = None

    def put(self, kind: str, *payload: Any) -> None:
        self.ray.get(self.inbox.put.remote((kind, self.name, self.attempt, *payload)))

    def seed(self, files: dict[str, bytes]) -> None:
        """The files the driver sent (it has them already), and the checkpoint they hold."""
        self.sent = {rel: hashlib.blake2b(data).digest() for rel, data in files.items()}
        with contextlib.suppress(KeyError, ValueError):
            self.checkpoint_round = json.loads(files[STATUS]).get("checkpoint_round")

    def event(self, ev: Event) -> None:
        if ev[0] == "note":
            ev = ("note", ev[1], str(ev[2]).replace(str(self.run_dir), self.real))
        self.put("event", ev)
        if ev[0] == "round":  # on_round runs right after the round's checkpoint, if there was one
            with contextlib.suppress(OSError, ValueError):
                st = RunDirectory(self.run_dir).status()
                if st.get("checkpoint_round") not in (None, self.checkpoint_round):
                    self.checkpoint_round = st["checkpoint_round"]
                    self.ship()

    def ship(self, everything: bool = False) -> None:
        files = read_run_files(self.run_dir)
        digests = {rel: hashlib.blake2b(data).digest() for rel, data in files.items()}
        changed = {rel: data for rel, data in files.items() if everything or self.sent.get(rel) != digests[rel]}
        if changed or set(self.sent) - set(files):
            self.put("files", changed, sorted(files))
        self.sent = digests


def remote_run(payload: dict[str, Any], inbox: Any) -> RunResult:
    """The body of a run's Ray task: write the shipped files into a temporary run directory, run, ship back."""
    import ray

    from fedskew import __version__
    from fedskew.engine.numerics import differences, numerics

    task: Task = payload["task"]
    real = str(task.values.get("out"))
    if payload["version"] != __version__:
        return RunResult(
            task.name,
            "failed",
            real,
            error=f"fedskew {__version__} on Ray node {socket.gethostname()}, {payload['version']} on the driver: "
            "install the same fedskew on every node",
        )
    root = Path(tempfile.mkdtemp(prefix="fedskew-ray-"))
    run_dir = root / Path(real).name
    try:
        shipper = _Shipper(ray, inbox, task.name, payload["attempt"], run_dir, real)
        if payload["files"]:
            write_run_files(run_dir, payload["files"], set(), task.values)
            shipper.seed(payload["files"])
        values = {**task.values, "out": str(run_dir), "db": None}
        device = payload["device"] or str(values.get("device", "cpu"))
        values["device"] = "cuda" if device.startswith("cuda") else device  # Ray chose the GPU (CUDA_VISIBLE_DEVICES)
        changed = differences(payload["numerics"], numerics())
        if changed:  # torch's version or its CPU kernels (engine/numerics.py)
            why = f"this node's arithmetic differs from the driver's ({'; '.join(changed)})"
            shipper.event(("note", task.name, f"{why}: the numbers may differ from a local run"))
        res = execute_run(replace(task, values=values), shipper.event)
        if run_dir.is_dir() and any(run_dir.iterdir()):
            shipper.ship(everything=True)  # the ended (or interrupted) run's files, all of them
    finally:
        shutil.rmtree(root, ignore_errors=True)
    here = str(run_dir)
    return replace(
        res,
        run_dir=real,
        error=res.error and res.error.replace(here, real),
        detail=res.detail.replace(here, real),
        trace=res.trace.replace(here, real),
    )


class Inbox:
    """What the tasks send, kept until the driver takes it (a Ray actor on the driver's node)."""

    def __init__(self) -> None:
        self.items: list[Any] = []

    def put(self, item: Any) -> None:
        self.items.append(item)

    def take(self) -> list[Any]:
        items, self.items = self.items, []
        return items
