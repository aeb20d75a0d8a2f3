"""A run directory: what fedskew writes for one run, and the only things it ever deletes.

Layout (every name in :data:`OWN_FILES` is fedskew's; nothing else in the directory is ever touched)::

    status.json            the marker of a fedskew run directory: run id, status, completed rounds, checkpoint round
    config.yaml            the resolved configuration (re-runnable with --config)
    clients.json           per-client label histograms
    metrics.jsonl          one line per finished round
    client_metrics.jsonl   one line per evaluated round: every client's accuracy and loss per view
    skew.jsonl             parameter-skew probes
    checkpoint.pt          everything the next round needs (while the run is unfinished)
    client_state/          per-client state on disk (--state-store disk), which checkpoint.pt references; the
                           engine's store creates, reopens and removes it (its own files only), not this module
    summary.json           written when the run ends (finished or diverged)
    .lock                  held by the one process writing the directory

Status: ``running`` (a process holds the lock; if that process is gone, it was killed), ``interrupted`` (SIGINT or
SIGTERM: resumable), ``failed`` (an error after some rounds: resumable once the cause is fixed), ``diverged``,
``finished``. Every whole-file write goes to a temporary name in the same directory and is renamed into place, so
a reader never sees half a file; per-round lines are appended and flushed, and a resume first cuts every per-round
file back to the checkpoint's round.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

STATUS = "status.json"
LOCK = ".lock"
CHECKPOINT = "checkpoint.pt"
CHECKPOINT_CRC = "checkpoint_crc32"  # status.json: the CRC-32 of the latest checkpoint written, and of the one before
ROUND_FILES = ("metrics.jsonl", "client_metrics.jsonl", "skew.jsonl")  # one JSON line per round, with "round"
VOCAB = "vocab.txt"  # a text run's vocabulary (fedskew.data.readers.base.VOCAB_FILE; a test keeps the two equal)
OWN_FILES = (STATUS, "config.yaml", "clients.json", *ROUND_FILES, CHECKPOINT, "summary.json", "skew.png", VOCAB, LOCK)
UNFINISHED = ("running", "interrupted", "failed", "stopped")


class RunDirError(OSError):
    """A run directory fedskew cannot use as asked; the message says why and what to do instead."""


class RunLocked(RunDirError):
    """The run directory is locked by another fedskew process (``pid`` on ``host``)."""

    def __init__(self, message: str, pid: int, host: str) -> None:
        super().__init__(message)
        self.pid, self.host = pid, host

    def holder_alive_here(self) -> bool:
        """Whether the holder is a live process on this machine (a lock of another machine cannot be checked)."""
        return self.host == socket.gethostname() and pid_alive(self.pid)


def is_run_dir(path: Path) -> bool:
    """A directory fedskew wrote: it has ``status.json`` with a run id (or, from before status files, the three
    files every finished run had). A damaged ``status.json`` beside fedskew's configuration and a checkpoint or a
    round record still marks one (it blocked both resume and --overwrite of a run with a valid checkpoint)."""
    status = path / STATUS
    if status.is_file():
        with contextlib.suppress(OSError, ValueError):
            data = json.loads(status.read_text())
            if isinstance(data, dict) and "run_id" in data:
                return True
        has_config = (path / "config.yaml").is_file()
        return has_config and ((path / CHECKPOINT).is_file() or (path / "metrics.jsonl").is_file())
    return all((path / n).is_file() for n in ("config.yaml", "metrics.jsonl", "summary.json"))


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs on this machine. A zombie (ended, not yet reaped by its parent: a killed sweep
    worker, say) is not running: its lock is stale, and waiting for it would wait forever."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        pass
    try:  # Linux: the state letter follows the parenthesised command name in /proc/<pid>/stat
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return not Path("/proc/self").exists()  # no /proc (macOS): os.kill's word; else it ended meanwhile
    return stat.rsplit(")", 1)[-1].split()[:1] != ["Z"]


def write_atomic(path: Path, data: str | bytes) -> None:
    """Write ``path`` through a temporary sibling and a rename: readers see the old or the new file, never half."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class RunDirectory:
    """One run's directory, locked by this process while it writes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.created = False  # whether this process created the directory itself
        self.notes: list[str] = []  # things the user should hear about (a stale lock taken over, ...)
        self._locked = False

    # ---- status --------------------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        """The run's status record; ``{}`` when it is missing or damaged (the next write replaces it whole)."""
        try:
            data = json.loads((self.path / STATUS).read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def set_status(self, status: str, **fields: Any) -> None:
        data = {**self.status(), **fields, "status": status, "updated": time.strftime("%Y-%m-%dT%H:%M:%S")}
        write_atomic(self.path / STATUS, json.dumps(data, indent=2, sort_keys=True))

    # ---- opening ---------------------------------------------------------------------------------------------
    @classmethod
    def prepare(cls, path: Path, *, overwrite: bool = False, resume: bool = False) -> RunDirectory:
        """Lock ``path`` for a new run (``resume=False``) or for continuing the unfinished run in it.

        A new run takes a directory that does not exist or is empty. ``overwrite`` replaces a fedskew run directory
        by deleting fedskew's own files in it (:data:`OWN_FILES`), nothing else, and never a directory that is not
        a run directory. Raises :class:`RunDirError` naming the problem and the way out."""
        rd = cls(path)
        if path.exists() and not path.is_dir():
            raise RunDirError(f"--out {path} is a file, not a directory; choose another --out")
        if resume:
            if not (path.is_dir() and is_run_dir(path)):
                raise RunDirError(f"{path} is not a fedskew run directory, so there is nothing to resume")
            rd._lock()
            if not (path / CHECKPOINT).is_file():
                st = rd.status()
                rd.unlock()
                if st.get("status") == "finished":
                    raise RunDirError(
                        f"{path} holds a finished run ({st.get('completed_rounds', '?')} round(s)): there is nothing "
                        "to resume, and a finished run keeps no checkpoint to extend; for more rounds start a run "
                        "with a larger --rounds into another --out"
                    )
                what = f"status {st.get('status', 'unknown')}"
                raise RunDirError(f"{path} has no checkpoint to resume from ({what})")
            return rd
        occupied = path.is_dir() and any(path.iterdir())
        if occupied and (path / LOCK).exists():  # another run may be writing it: say so first
            rd._lock()
            rd.unlock()
            # the lock was a dead run's, taken over; if that run wrote nothing else, the folder is a new run's
            occupied = any(path.iterdir())
        if occupied:
            if not is_run_dir(path):
                raise RunDirError(
                    f"{path} exists, is not empty and is not a fedskew run directory; fedskew never replaces it "
                    "(choose another --out)"
                )
            if not overwrite:
                st = rd.status()
                if st.get("status") in UNFINISHED and (path / CHECKPOINT).is_file():
                    raise RunDirError(
                        f"{path} holds an unfinished run (status {st['status']}, {st.get('completed_rounds', 0)} "
                        f"round(s) done); resume it with `fedskew run --resume {path}`, or replace it with --overwrite"
                    )
                held = (
                    f"holds a finished run ({st.get('completed_rounds', '?')} round(s))"
                    if st.get("status") == "finished"
                    else "exists and is not empty"
                )
                raise RunDirError(f"run directory {path} {held}: choose another --out, or replace it with --overwrite")
            rd._lock()
            for name in OWN_FILES:
                if name != LOCK:
                    with contextlib.suppress(FileNotFoundError):
                        (path / name).unlink()
            return rd
        try:
            rd.created = not path.exists()
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise RunDirError(f"cannot create run directory {path}: {exc.strerror or exc}") from None
        rd._lock()
        return rd

    def _lock(self) -> None:
        lock = self.path / LOCK
        me = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%dT%H:%M:%S")}
        for _ in range(2):
            try:
                fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                try:
                    holder = json.loads(lock.read_text())
                except (OSError, ValueError):
                    holder = {}
                pid, host = holder.get("pid"), holder.get("host")
                if host == me["host"] and isinstance(pid, int) and not pid_alive(pid):
                    self.notes.append(
                        f"{self.path}: the run that held it (pid {pid}) is gone (killed?); taking over its lock"
                    )
                    with contextlib.suppress(FileNotFoundError):
                        lock.unlink()
                    continue
                if not (isinstance(pid, int) and isinstance(host, str)):
                    raise RunDirError(
                        f"{self.path} is locked, but its lock file {lock} is damaged (it names no run holding it); "
                        f"if no fedskew run is writing {self.path}, delete {lock}"
                    ) from None
                raise RunLocked(
                    f"{self.path} is being written by another fedskew run (pid {pid} on {host}, since "
                    f"{holder.get('since', '?')}); concurrent runs need different --out directories. If that "
                    f"process is gone, delete {lock}",
                    pid,
                    host,
                ) from None
            except OSError as exc:
                raise RunDirError(f"cannot write in run directory {self.path}: {exc.strerror or exc}") from None
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
            self._locked = True
            return
        raise RunDirError(f"could not lock {self.path}")

    def unlock(self) -> None:
        if self._locked:
            with contextlib.suppress(FileNotFoundError):
                (self.path / LOCK).unlink()
            self._locked = False

    # ---- files -----------------------------------------------------------------------------------------------
    def write_file(self, name: str, text: str) -> None:
        write_atomic(self.path / name, text)

    def append_line(self, name: str, line: str) -> None:
        with (self.path / name).open("a") as f:
            f.write(line + "\n")
            f.flush()

    def read_lines(self, name: str) -> list[dict[str, Any]]:
        p = self.path / name
        if not p.is_file():
            return []
        out = []
        for line in p.read_text().splitlines():
            with contextlib.suppress(ValueError):  # a line cut by a kill is not a round
                out.append(json.loads(line))
        return out

    def check_rounds(self, last_round: int) -> None:
        """Before a resume: the run's record must hold every round up to the checkpoint's (a resume from a damaged
        record would finish with a summary of part of the run), else :class:`RunDirError` naming what is missing."""
        metrics = self.path / "metrics.jsonl"
        if last_round > 0:
            if not metrics.is_file():
                raise RunDirError(
                    f"cannot resume {self.path}: metrics.jsonl is gone but the checkpoint is after round {last_round}; "
                    "start the run over (fedskew run --overwrite)"
                )
            have = {r.get("round") for r in self.read_lines("metrics.jsonl")}
            missing = sorted(set(range(1, last_round + 1)) - have)
            if missing:
                shown = ", ".join(map(str, missing[:5])) + (", ..." if len(missing) > 5 else "")
                raise RunDirError(
                    f"cannot resume {self.path}: metrics.jsonl lacks round(s) {shown} of the {last_round} the "
                    "checkpoint holds; start the run over (fedskew run --overwrite)"
                )

    def cut_rounds(self, last_round: int) -> None:
        """Keep only the per-round lines of rounds ``<= last_round`` (a resume redoes the rest)."""
        for name in ROUND_FILES:
            if (self.path / name).is_file():
                kept = [r for r in self.read_lines(name) if r.get("round", 0) <= last_round]
                self.write_file(name, "".join(json.dumps(r, sort_keys=True) + "\n" for r in kept))

    # ---- checkpoints -----------------------------------------------------------------------------------------
    def save_checkpoint(self, state: dict[str, Any]) -> None:
        """Write ``state`` to a temporary file (its CRC-32 taken as it is written), record the CRC in status.json,
        then rename the file into place: status.json keeps this checkpoint's CRC and the previous one's, so a kill
        between the two steps leaves a checkpoint whose CRC is recorded."""
        tmp = self.path / f".{CHECKPOINT}.tmp-{os.getpid()}"
        with open(tmp, "wb") as f:
            writer = _CrcWriter(f)
            torch.save(state, writer)  # type: ignore[arg-type]
        known = self.status().get(CHECKPOINT_CRC) or []
        self.set_status(self.status().get("status", "running"), **{CHECKPOINT_CRC: [writer.crc, *known[:1]]})
        os.replace(tmp, self.path / CHECKPOINT)

    def load_checkpoint(self, device: str = "cpu") -> dict[str, Any]:
        path = self.path / CHECKPOINT
        known = self.status().get(CHECKPOINT_CRC)
        if isinstance(known, list) and known:  # checkpoints written before CRCs were recorded are read as they are
            crc = 0
            with open(path, "rb") as f:
                while chunk := f.read(1 << 24):
                    crc = zlib.crc32(chunk, crc)
            if crc not in known:
                raise RunDirError(
                    f"the checkpoint of {self.path} is damaged: its CRC-32 ({crc:08x}) is not the one recorded when it "
                    "was written; start the run over (fedskew run --overwrite)"
                )
        try:
            return torch.load(path, map_location=device, weights_only=False)
        except Exception as exc:  # a checkpoint is only ever replaced by a rename, so this is outside damage
            raise RunDirError(
                f"the checkpoint of {self.path} is damaged and cannot be read ({type(exc).__name__}: {exc}); start "
                "the run over (fedskew run --overwrite)"
            ) from None

    # ---- ending ----------------------------------------------------------------------------------------------
    def finish(self, status: str, summary: dict[str, Any]) -> None:
        """Write the summary, mark the run ended, drop the checkpoint, release the lock."""
        self.write_file("summary.json", json.dumps(summary, indent=2, sort_keys=True))
        self.set_status(status, completed_rounds=summary["rounds"])
        with contextlib.suppress(FileNotFoundError):
            (self.path / CHECKPOINT).unlink()
        self.unlock()

    def discard(self) -> None:
        """Undo a run that finished no round: remove fedskew's own files, and the directory if this run created it
        and nothing else is in it."""
        for name in OWN_FILES:
            with contextlib.suppress(FileNotFoundError):
                (self.path / name).unlink()
        self._locked = False
        if self.created:
            with contextlib.suppress(OSError):
                self.path.rmdir()  # only if empty


class _CrcWriter:
    """A binary file that keeps the CRC-32 of what is written through it (no second read of the file)."""

    def __init__(self, f: Any) -> None:
        self.f, self.crc = f, 0

    def write(self, data: bytes) -> int:
        self.crc = zlib.crc32(data, self.crc)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def stale_runs(root: Path) -> Iterator[Path]:
    """Run directories under ``root`` whose status says ``running`` but whose writer is gone (killed)."""
    if not root.is_dir():
        return
    for status in root.glob(f"*/{STATUS}"):
        rd = RunDirectory(status.parent)
        if rd.status().get("status") != "running":
            continue
        try:
            holder = json.loads((rd.path / LOCK).read_text())
        except (OSError, ValueError):
            holder = {}
        pid = holder.get("pid")
        if not holder or (holder.get("host") == socket.gethostname() and isinstance(pid, int) and not pid_alive(pid)):
            yield rd.path
