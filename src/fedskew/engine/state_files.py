"""The files of a disk-backed client-state store (``engine/state_store.py``): one directory the store owns, holding a
marker and one preallocated array file per kind of state entry.

Layout of the directory::

    store.json                  the marker: kind, store id, the run that made it, and every array file it created
    <namespace>-<id>.bin        one array: ``[clients, 2, row_bytes]`` bytes; row = one client's entry in one slot

An array holds one *state entry* of every client that has one (SCAFFOLD's ``c_i``, Ditto's own model, a
personalized model the server sent): all its tensors packed in one row, each at an offset aligned to 64 bytes, so
a client's entry is one positional read or write (``os.preadv``/``os.pwritev``) straight into or out of the tensors'
memory. The files are created at their full size as sparse files, so only rows written take disk space. Each client
has two slots per array; which slot holds which version is the store's business (the checkpoint scheme, see
``state_store.py``). Data go through the kernel's page cache, not through memory maps: a map's touched pages would
count in the process's resident size and fault on every first touch, whereas the page cache is the kernel's to drop.

Ownership. A directory is this store's when its marker carries this store's id. A new store takes only a directory
that does not exist (it creates it) or is empty; it refuses any other, and opening an existing store refuses a
directory whose marker is missing, foreign or of another store, or which holds files the marker does not list.
Removing a store deletes exactly the files its marker lists, then the marker, then the directory if the store made
it and it is empty; nothing else is ever deleted.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import struct
import uuid
import zlib
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

MARKER = "store.json"
KIND = "fedskew client-state store"
VERSION = 1
ALIGN = 64  # every tensor of a row starts at a multiple of this (as a fresh allocation does)
SLOTS = 2
# a row's trailer (arrays with checksums): the CRC-32 of the row's data, then a mark telling a written row from the
# zeros of one never written (a sparse file's hole)
TRAILER = struct.Struct("<II")
ROW_MARK = 0x46534B31  # "FSK1"
_TMP = re.compile(r"^\.store\.json\.tmp-\d+$")


class StoreDirError(ValueError):
    """A directory the client-state store refuses (not its own), or a store it cannot open."""


Signature = tuple[tuple[tuple[Any, ...], torch.dtype, tuple[int, ...]], ...]  # ((subpath, dtype, shape), ...)


def dtype_of(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise StoreDirError(f"unknown dtype {name!r} in a client-state store marker")
    return dtype


@dataclass(frozen=True)
class ArraySpec:
    """One array file: which entry it holds (namespace, group key, the tensors' sub-paths, dtypes and shapes), where
    each tensor starts in a row, and the row's size."""

    id: int
    file: str
    namespace: str
    group: tuple[Any, ...]
    signature: Signature
    offsets: tuple[int, ...]
    row_bytes: int
    data_bytes: int = 0  # where the last tensor of a row ends (its checksum covers the row up to there)
    checksum: bool = False  # each row ends with its CRC-32 (rows of a store written before checksums have none)

    @classmethod
    def build(
        cls, id: int, namespace: str, group: tuple[Any, ...], signature: Signature, checksum: bool = True
    ) -> ArraySpec:
        offsets, pos, end = [], 0, 0
        for _, dtype, shape in signature:
            offsets.append(pos)
            n = _numel(shape) * _itemsize(dtype)
            end = pos + n
            pos += -(-n // ALIGN) * ALIGN
        if checksum:  # the trailer: CRC-32 and a mark, in the row's last bytes
            pos = -(-(end + TRAILER.size) // ALIGN) * ALIGN
        file = f"{namespace}-{id:04d}.bin"
        return cls(id, file, namespace, group, signature, tuple(offsets), max(pos, ALIGN), end, checksum)

    def as_json(self) -> dict[str, Any]:
        return {
            "file": self.file,
            "namespace": self.namespace,
            "group": list(self.group),
            "tensors": [[list(p), str(d), list(s)] for p, d, s in self.signature],
            "checksum": self.checksum,
        }

    @classmethod
    def from_json(cls, id: int, d: dict[str, Any]) -> ArraySpec:
        sig = tuple((tuple(p), dtype_of(t), tuple(int(x) for x in s)) for p, t, s in d["tensors"])
        spec = cls.build(id, d["namespace"], tuple(d["group"]), sig, checksum=bool(d.get("checksum", False)))
        if spec.file != d["file"]:
            raise StoreDirError(f"client-state store marker: array {id} is file {d['file']!r}, expected {spec.file!r}")
        return spec


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _read_marker(directory: Path) -> dict[str, Any] | None:
    try:
        marker = json.loads((directory / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) and marker.get("kind") == KIND else None


class StoreFiles:
    """The directory of one store and its array files (see the module docstring). Nothing is written until the
    first array is needed (or :meth:`create` is called), so a store can be set up before its run directory is."""

    def __init__(self, directory: Path, num_clients: int, owner: str = "") -> None:
        self.directory = Path(directory)
        self.num_clients = num_clients
        self.owner = owner
        self.store_id = uuid.uuid4().hex
        self.arrays: list[ArraySpec] = []
        self._by_key: dict[tuple[Any, ...], int] = {}
        self._fds: dict[int, int] = {}
        self._dirty: set[int] = set()
        self._trusted: dict[int, bytearray] = {}  # per array, a byte per (client, slot): written or checked here
        self.exists = False  # the directory holds this store's marker
        self.made_dir = False

    # ---- ownership --------------------------------------------------------------------------------------------
    def create(self) -> None:
        """Take the directory for a new store: create it, or adopt it when empty; refuse anything else."""
        if self.exists:
            return
        d = self.directory
        if d.exists():
            if not d.is_dir():
                raise StoreDirError(f"{d} is a file; the client-state store needs a directory of its own there")
            names = sorted(p.name for p in d.iterdir())
            if names:
                marker = _read_marker(d)
                listed = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
                whose = (
                    f"the client state of another run ({marker.get('owner') or marker.get('store_id')})"
                    if marker
                    else f"files that are not a client-state store's ({listed})"
                )
                raise StoreDirError(f"{d} holds {whose}; the client-state store only takes an empty or new directory")
        else:
            try:
                d.mkdir(parents=True)
            except OSError as exc:
                raise StoreDirError(f"cannot create the client-state directory {d}: {exc.strerror or exc}") from None
            self.made_dir = True
        self.exists = True
        self._write_marker()

    @classmethod
    def open(cls, directory: Path, store_id: str, num_clients: int) -> StoreFiles:
        """Reopen store ``store_id`` in ``directory`` (a resume): the marker must be that store's, and every file in
        the directory must be one the marker lists (or a temporary marker of its own)."""
        d = Path(directory)
        marker = _read_marker(d) if d.is_dir() else None
        if marker is None:
            what = "does not exist" if not d.exists() else "holds no client-state store marker"
            raise StoreDirError(f"the client-state store of this checkpoint is gone: {d} {what}")
        if marker.get("store_id") != store_id:
            raise StoreDirError(
                f"{d} holds another client-state store ({marker.get('store_id')}, run {marker.get('owner')!r}), not "
                f"the one this checkpoint references ({store_id})"
            )
        if marker.get("version") != VERSION or marker.get("num_clients") != num_clients:
            raise StoreDirError(
                f"{d}: client-state store version {marker.get('version')} for {marker.get('num_clients')} clients, "
                f"expected version {VERSION} for {num_clients}"
            )
        files = cls(d, num_clients, marker.get("owner", ""))
        files.store_id, files.exists, files.made_dir = store_id, True, bool(marker.get("made_dir"))
        for i, spec in enumerate(marker.get("arrays", [])):
            files._add(ArraySpec.from_json(i, spec))
        listed = {MARKER, *(a.file for a in files.arrays)}
        foreign = sorted(p.name for p in d.iterdir() if p.name not in listed and not _TMP.match(p.name))
        if foreign:
            raise StoreDirError(f"{d} holds files that are not its client-state store's: {', '.join(foreign[:5])}")
        for spec in files.arrays:
            path = d / spec.file
            want = num_clients * SLOTS * spec.row_bytes
            if not path.exists():  # listed in the marker just before a crash could create it: no row was written
                files._make_file(spec)
            elif path.stat().st_size != want:
                raise StoreDirError(f"{path} has {path.stat().st_size} bytes, expected {want}: the store is damaged")
        return files

    @staticmethod
    def check_replaceable(directory: Path) -> None:
        """Refuse, before anything of the run being replaced is deleted, a client-state directory that
        :meth:`remove_dir` would refuse or leave holding files fedskew did not write (which a new store refuses)."""
        d = Path(directory)
        if not d.exists():
            return
        marker = _store_marker(d)
        listed = {MARKER, *(a.get("file") for a in marker.get("arrays", []) if isinstance(a, dict))}
        foreign = sorted(p.name for p in d.iterdir() if p.name not in listed and not _TMP.match(p.name))
        if foreign:
            raise StoreDirError(
                f"{d} holds files fedskew did not write ({', '.join(foreign[:5])}); nothing was deleted: move them "
                "away and run again"
            )

    @staticmethod
    def remove_dir(directory: Path) -> None:
        """Delete the store in ``directory`` (a run being replaced): the files its marker lists, the marker, and the
        directory if the store made it and nothing else is left. Refuses a directory without a store marker."""
        d = Path(directory)
        if d.exists():
            _remove_listed(d, _store_marker(d))

    def remove(self) -> None:
        """Delete this store's files (see :meth:`remove_dir`); a store that wrote nothing leaves nothing to do."""
        self.close()
        if self.exists:
            marker = _read_marker(self.directory)
            if marker is not None and marker.get("store_id") == self.store_id:
                _remove_listed(self.directory, marker)
            self.exists = False

    def _write_marker(self) -> None:
        marker = {
            "kind": KIND,
            "version": VERSION,
            "store_id": self.store_id,
            "owner": self.owner,
            "num_clients": self.num_clients,
            "made_dir": self.made_dir,
            "created": datetime.now(UTC).isoformat(timespec="seconds"),
            "arrays": [a.as_json() for a in self.arrays],
        }
        tmp = self.directory / f".{MARKER}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(marker, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.directory / MARKER)
        self._sync_dir()

    def _sync_dir(self) -> None:
        with contextlib.suppress(OSError):  # not every platform can fsync a directory
            fd = os.open(self.directory, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    # ---- arrays ---------------------------------------------------------------------------------------------
    def _add(self, spec: ArraySpec) -> None:
        self.arrays.append(spec)
        self._by_key[(spec.namespace, spec.group, spec.signature)] = spec.id

    def array(self, namespace: str, group: tuple[Any, ...], signature: Signature) -> ArraySpec:
        """The array of this entry kind, created on first use (the marker lists it before the file exists)."""
        key = (namespace, group, signature)
        if key in self._by_key:
            return self.arrays[self._by_key[key]]
        self.create()
        spec = ArraySpec.build(len(self.arrays), namespace, group, signature)
        self._add(spec)
        self._write_marker()
        self._make_file(spec)
        return spec

    def _make_file(self, spec: ArraySpec) -> None:
        fd = os.open(self.directory / spec.file, os.O_RDWR | os.O_CREAT, 0o644)
        os.ftruncate(fd, self.num_clients * SLOTS * spec.row_bytes)  # sparse: rows take space once written
        self._fds[spec.id] = fd
        self._sync_dir()

    def _fd(self, spec: ArraySpec) -> int:
        fd = self._fds.get(spec.id)
        if fd is None:
            fd = self._fds[spec.id] = os.open(self.directory / spec.file, os.O_RDWR)
        return fd

    def _offset(self, spec: ArraySpec, cid: int, slot: int) -> int:
        return (cid * SLOTS + slot) * spec.row_bytes

    def write(self, spec: ArraySpec, cid: int, slot: int, tensors: list[torch.Tensor]) -> None:
        """Write one client's entry (its tensors in signature order, on the CPU, contiguous) into ``slot``."""
        chunks: list[Any] = []
        pos = 0
        for t, off in zip(tensors, spec.offsets, strict=True):
            if off > pos:
                chunks.append(bytes(off - pos))
            raw = t.reshape(-1).view(torch.uint8).numpy()
            chunks.append(raw)
            pos = off + raw.nbytes
        if spec.checksum:
            crc = 0
            for c in chunks:
                crc = zlib.crc32(c, crc)
            trailer_at = spec.row_bytes - TRAILER.size
            chunks += [bytes(trailer_at - pos), TRAILER.pack(crc, ROW_MARK)]
            pos = spec.row_bytes
        fd, at, total = self._fd(spec), self._offset(spec, cid, slot), pos
        done = 0
        while done < total:  # a positional write may be short; go on where it stopped
            n = os.pwritev(fd, _skip(chunks, done), at + done)
            if n <= 0:
                raise OSError(f"could not write client {cid}'s state into {self.directory / spec.file}")
            done += n
        self._dirty.add(spec.id)
        self._trust(spec, cid, slot)

    def read(self, spec: ArraySpec, cid: int, slot: int) -> torch.Tensor:
        """One client's row of ``slot`` as a ``uint8`` tensor (64-byte aligned, as every fresh allocation)."""
        buf = torch.empty(spec.row_bytes, dtype=torch.uint8)
        view = memoryview(buf.numpy())
        fd, at, done = self._fd(spec), self._offset(spec, cid, slot), 0
        while done < spec.row_bytes:
            n = os.preadv(fd, [view[done:]], at + done)
            if n <= 0:
                raise StoreDirError(f"{self.directory / spec.file} is shorter than its rows: the store is damaged")
            done += n
        if spec.checksum and not self._trusted_row(spec, cid, slot):  # a row of an earlier process (a resume)
            self._verify(spec, cid, slot, buf)
        return buf

    def _trust(self, spec: ArraySpec, cid: int, slot: int) -> None:
        marks = self._trusted.get(spec.id)
        if marks is None:
            marks = self._trusted[spec.id] = bytearray(self.num_clients * SLOTS)
        marks[cid * SLOTS + slot] = 1

    def _trusted_row(self, spec: ArraySpec, cid: int, slot: int) -> bool:
        marks = self._trusted.get(spec.id)
        return marks is not None and bool(marks[cid * SLOTS + slot])

    def _verify(self, spec: ArraySpec, cid: int, slot: int, buf: torch.Tensor) -> None:
        """Refuse a row whose data do not match the CRC-32 written with them (the file changed since)."""
        raw = memoryview(buf.numpy())
        crc, mark = TRAILER.unpack_from(raw, spec.row_bytes - TRAILER.size)
        if mark != ROW_MARK or zlib.crc32(raw[: spec.data_bytes]) != crc:
            what = "is all zeros (zeroed since it was written)" if not any(raw) else "fails its checksum"
            raise StoreDirError(
                f"{self.directory / spec.file}: client {cid}'s saved state {what}: the file was changed or damaged "
                "after the run wrote it, so the run cannot continue from it; start it over (fedskew run --overwrite)"
            )
        self._trust(spec, cid, slot)  # verified once

    def disk_usage(self) -> int:
        """Bytes the array files take on disk (they are sparse: the rows written)."""
        total = 0
        for spec in self.arrays if self.exists else []:
            with contextlib.suppress(OSError):
                total += os.stat(self.directory / spec.file).st_blocks * 512
        return total

    def sync(self) -> None:
        """Make every row written so far durable (before a checkpoint references it)."""
        for i in sorted(self._dirty):
            os.fsync(self._fds[i])
        self._dirty.clear()

    def close(self) -> None:
        for fd in self._fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds.clear()
        self._dirty.clear()


def _skip(chunks: list[Any], n: int) -> list[Any]:
    """``chunks`` without their first ``n`` bytes (to resume a short write)."""
    out, skipped = [], 0
    for c in chunks:
        view = memoryview(c).cast("B")
        if skipped + len(view) <= n:
            skipped += len(view)
            continue
        out.append(view[max(n - skipped, 0) :])
        skipped = n
    return out


def _store_marker(d: Path) -> dict[str, Any]:
    """The marker of the store in ``d``, which must have one (fedskew deletes nothing in a directory without)."""
    marker = _read_marker(d) if d.is_dir() else None
    if marker is None:
        raise StoreDirError(f"{d} is not a client-state store; fedskew does not delete it (move it away)")
    return marker


def _remove_listed(directory: Path, marker: dict[str, Any]) -> None:
    for a in marker.get("arrays", []):
        name = a.get("file") if isinstance(a, dict) else None
        if isinstance(name, str) and "/" not in name and name not in ("", ".", ".."):
            with contextlib.suppress(FileNotFoundError):
                (directory / name).unlink()
    for p in directory.iterdir():
        if _TMP.match(p.name):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
    with contextlib.suppress(FileNotFoundError):
        (directory / MARKER).unlink()
    if marker.get("made_dir"):
        with contextlib.suppress(OSError):
            directory.rmdir()  # only if empty
