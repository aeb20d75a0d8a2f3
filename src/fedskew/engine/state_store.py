"""Where the per-client state of a simulation lives: in RAM (``memory``, plain dicts, the default for small
federations) or on disk (``disk``), behind one mapping interface per client id.

A simulation keeps three per-client maps (:data:`MAPS`): ``client_states`` (each client's persistent state: SCAFFOLD's
``c_i``, MOON's previous model, Ditto's and FedAMP's own model, local heads or BatchNorm entries), ``personal`` (the
model the server sent each client: FedCAC, FedAMP) and ``trained`` (each client's model after its latest training,
personalized methods). In RAM they grow with every client that ever trained; with ``state_store: disk`` they are
:class:`DiskMap` s over preallocated arrays on disk (``engine/state_files.py``), and RAM holds only the clients a round
is working on.

How a :class:`DiskMap` behaves, so that the engine and every client part work unchanged:

* ``states[cid]`` returns the client's state as the plain nested dict of tensors the client code expects (read from
  disk, tensors on their original device with their dtype, shape and strides, bit for bit). In ``client_states``
  the value is kept in a write-back cache until :meth:`DiskMap.release` (the loop calls it once the client's upload
  is taken) or :meth:`DiskMap.commit` (end of every round), so a client part may change it in place, as it does in
  RAM. ``states[cid] = value`` caches the value the same way. :meth:`DiskMap.peek` and ``get`` read without caching
  (evaluation reads every client once: nothing stays in RAM).
* A value is split into *entries* (``client_states``: its top-level keys; ``personal``/``trained``: the whole model);
  the tensors of an entry are packed into one row of the entry's array (one array per namespace, entry and
  signature, created when the first client writes that entry); everything else (numbers, strings, ``None``, empty
  dicts, tensors without elements) is kept in RAM per client and travels in the checkpoint.
* A trained model that *is* an entry of the client's state (Ditto's, FedAMP's, FedALA's own model: the same object)
  is stored once, as an alias of that entry; before the entry is overwritten without the trained model (a client
  whose malformed upload was dropped keeps its trained view), the alias is replaced by the value itself.

Checkpoints and crashes. Each client has two slots in every array. The store remembers for each client the slot
holding its latest value (``live``) and the slot the last checkpoint references (``pinned``). A write goes to the
live slot when that is not pinned, otherwise to the other slot, so a slot a checkpoint references is never
written until the next checkpoint replaces it. :meth:`DiskMap.reference` (what a checkpoint holds instead of the
tensors) first writes the cache back and fsyncs the arrays, then records the per-client layouts, slots and small
values, and pins the live slots. A run killed at any point (mid-round, mid-write, mid-checkpoint) therefore resumes
from its last checkpoint with exactly the state that checkpoint saw: the rows written after it sit in other slots,
and the checkpoint file itself is replaced by a rename. Only the latest checkpoint of a store is valid.
"""

from __future__ import annotations

import shutil
import tempfile
import weakref
from collections.abc import Callable, Mapping, MutableMapping
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from fedskew.client.local import LocalAlgorithm
from fedskew.engine.disk_map import DiskMap, StoreRef
from fedskew.engine.state_files import StoreDirError, StoreFiles
from fedskew.sizes import parse_size, physical_memory

__all__ = [
    "MAPS",
    "STATE_DIR",
    "ClientStateStore",
    "DiskMap",
    "StoreDirError",
    "StoreFiles",
    "StoreRef",
    "choose_store",
    "keep_model",
    "memory_budget",
    "open_state_store",
    "peek",
    "peek_entry",
    "state_copies",
]

STATE_DIR = "client_state"  # the store's directory inside a run directory
MAPS = ("client_states", "personal", "trained")  # the simulation's per-client maps, in checkpoint order
_DEPTH = {"client_states": 1, "personal": 0, "trained": 0}  # where a value splits into entries (one array each)
BUDGET_SHARE = 0.25  # state_memory's default: this share of the machine's RAM
FALLBACK_BUDGET = 4 * 10**9  # where the platform does not say how much RAM it has


# ---- the choice of backend ----------------------------------------------------------------------------------------
def memory_budget(setting: str | int | None) -> int:
    """Bytes of per-client state a run may keep in RAM: ``state_memory``, else a quarter of this machine's RAM."""
    if setting is not None:
        return parse_size(setting)
    ram = physical_memory()
    return int(ram * BUDGET_SHARE) if ram else FALLBACK_BUDGET


def state_copies(method: Any) -> int:
    """Model copies a method's clients keep, an upper estimate: 2 for a personalized method (its own or the server's
    model, and the model its `trained` view evaluates) or a client part with state of its own (MOON, SCAFFOLD,
    FedDyn, FedDC, ...), 1 for client-kept groups only (FedPer's head, FedBN's norms), else 0."""
    if method.personalized or type(method.client) is not LocalAlgorithm:
        return 2
    return 1 if method.local else 0


def choose_store(
    setting: Literal["auto", "memory", "disk"], budget: int, per_client: int, num_clients: int
) -> Literal["memory", "disk"]:
    """``memory`` or ``disk``: as set, or for ``auto`` disk exactly when the estimated state of all clients
    (``per_client`` bytes each) exceeds ``budget`` bytes."""
    if setting != "auto":
        return setting
    return "disk" if per_client * num_clients > budget else "memory"


def peek(mapping: MutableMapping[int, Any], cid: int) -> Any:
    """``mapping[cid]`` for reading only: a :class:`DiskMap` then neither caches nor writes it back."""
    return mapping.peek(cid) if isinstance(mapping, DiskMap) else mapping[cid]


def peek_entry(mapping: MutableMapping[int, Any], cid: int, key: str) -> Any:
    """``mapping[cid].get(key)`` for reading only; a :class:`DiskMap` reads that entry alone."""
    return mapping.peek_entry(cid, key) if isinstance(mapping, DiskMap) else mapping[cid].get(key)


# ---- the three maps of a simulation ----------------------------------------------------------------------------------
def keep_model(mapping: MutableMapping[int, Any], cid: int, model: Mapping[str, torch.Tensor]) -> None:
    """Keep client ``cid``'s ``model`` in ``mapping`` beyond the round: a :class:`DiskMap` writes it to disk at once
    (nothing cached, so a round's ``K`` personalized models never sit in RAM together); in RAM a tensor that owns its
    storage is kept as it is and a view of a larger one is copied (a row of a round's ``[K, ...]`` tensor would keep
    the whole of it alive)."""
    if isinstance(mapping, DiskMap):
        mapping[cid] = dict(model)
        mapping.release(cid)
        return
    mapping[cid] = {n: t if _owns_storage(t) else t.clone() for n, t in model.items()}


def _owns_storage(t: torch.Tensor) -> bool:
    return t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()


class ClientStateStore:
    """The per-client maps of one simulation (:data:`MAPS`) in RAM or on disk. ``directory``: where a disk store
    lives (a run's ``client_state/``; ``None``: a temporary directory, removed when the store is closed or
    collected); ``owner``: the run it belongs to (written in the marker); ``default_state``: a fresh client state."""

    def __init__(
        self,
        backend: Literal["memory", "disk"],
        num_clients: int,
        directory: Path | None = None,
        *,
        default_state: Callable[[], dict[str, Any]] = dict,
        owner: str = "",
    ) -> None:
        self.backend, self.num_clients, self.owner = backend, num_clients, owner
        self.default_state = default_state
        self.given_dir = directory is not None
        self.files: StoreFiles | None = None
        self._finalizer: weakref.finalize[Any, Any] | None = None
        self.maps: dict[str, MutableMapping[int, Any]] = {}
        if backend == "memory":
            states = {c: default_state() for c in range(num_clients)}
            self.maps = {"client_states": states, "personal": {}, "trained": {}}
        else:
            self._open_files(StoreFiles(directory or self._temp_dir(), num_clients, owner))
            self.maps = self._disk_maps()

    def _temp_dir(self) -> Path:
        path = Path(tempfile.mkdtemp(prefix="fedskew-state-"))
        self._finalizer = weakref.finalize(self, shutil.rmtree, path, True)
        return path

    def _open_files(self, files: StoreFiles) -> None:
        if self.files is not None and self.files is not files:
            self.files.close()
        self.files = files

    def _disk_maps(self) -> dict[str, MutableMapping[int, Any]]:
        assert self.files is not None
        maps = {
            name: DiskMap(
                self.files,
                name,
                depth=_DEPTH[name],
                default=self.default_state if name == "client_states" else None,
                mutable=name == "client_states",
            )
            for name in MAPS
        }
        maps["trained"].source = maps["client_states"]
        maps["client_states"].dependents.append(maps["trained"])
        return dict(maps)

    def create(self) -> None:
        """Take the store's directory now (disk; refusing one that is not empty), instead of at the first write."""
        if self.files is not None and self.backend == "disk":
            self.files.create()

    def release(self, cid: int) -> None:
        """Write client ``cid``'s values back to disk and out of RAM (its round's work on it is done). A trained
        model that is an entry of the client's state (Ditto's and FedAMP's own model) is written once, as an alias."""
        if self.backend != "disk":
            return
        states, trained = self.maps["client_states"], self.maps["trained"]
        assert isinstance(states, DiskMap) and isinstance(trained, DiskMap)
        state, model = states._cache.get(cid), trained._cache.get(cid)
        key = None
        if isinstance(state, dict) and model is not None:
            key = next((k for k, v in state.items() if v is model), None)
        states.release(cid)
        if key is not None and trained.source is states:
            trained.write_alias(cid, key)
        for m in self.maps.values():
            m.release(cid)  # type: ignore[attr-defined]

    def commit(self) -> None:
        """Write every cached value back (end of a round)."""
        if self.backend == "disk":
            cached = set().union(*(m._cache for m in self.maps.values()))  # type: ignore[attr-defined]
            for cid in sorted(cached):
                self.release(cid)

    def capture(self, maps: dict[str, MutableMapping[int, Any]] | None = None) -> dict[str, Any]:
        """What a checkpoint holds of ``maps`` (default: the store's): a dict as it is (shared: save it before the
        next round), a :class:`DiskMap` as its :class:`StoreRef` (which pins its slots)."""
        maps = self.maps if maps is None else maps
        if any(isinstance(m, DiskMap) for m in maps.values()):
            self.commit()
        return {name: m.reference() if isinstance(m, DiskMap) else m for name, m in maps.items()}

    def restore(self, saved: dict[str, Any]) -> dict[str, MutableMapping[int, Any]]:
        """Take a captured state (dicts, or references to a store on disk, reopened in this store's directory or,
        without one, where the reference says); returns the maps, in this store's backend."""
        refs = {name: v for name, v in saved.items() if isinstance(v, StoreRef)}
        disk: dict[str, MutableMapping[int, Any]] = {}
        if refs:
            first = next(iter(refs.values()))
            if self.files is not None and self.files.exists and self.files.store_id != first.store_id:
                raise StoreDirError("this simulation's store already holds state; restore into a fresh simulation")
            directory = self.files.directory if self.files is not None and self.given_dir else Path(first.directory)
            self._open_files(StoreFiles.open(directory, first.store_id, self.num_clients))
            disk = self._disk_maps()
            for name, ref in refs.items():
                disk[name].restore(ref)  # type: ignore[attr-defined]
        if self.backend == "memory":  # read everything back into RAM; the files stay until the run ends (remove)
            maps = {n: {c: disk[n].peek(c) for c in disk[n]} if n in refs else saved[n] for n in MAPS}  # type: ignore[attr-defined]
            if self.files is not None:
                self.files.close()
        else:
            maps = disk or self._disk_maps()
            self.maps = maps
            for name in MAPS:
                if name not in refs:  # a checkpoint from RAM continued on disk: write it there
                    for cid, value in saved[name].items():
                        maps[name][cid] = value
            self.commit()
        self.maps = maps
        return maps

    def disk_usage(self) -> int:
        """Bytes the store's files take on disk (both slots of the rows written; 0 in RAM)."""
        return self.files.disk_usage() if self.files is not None else 0

    def state_bytes(self) -> int:
        """Bytes of the clients' latest state on disk (one slot per row written; 0 in RAM)."""
        if self.files is None or not self.files.exists:
            return 0
        total = 0
        for m in self.maps.values():
            if isinstance(m, DiskMap):
                for lid in np.unique(m._layout_of[m._layout_of >= 0]):
                    aids = {leaf[2] for leaf in m._layouts[lid] if leaf[0] == "t"}
                    rows = int((m._layout_of == lid).sum())
                    total += rows * sum(self.files.arrays[a].row_bytes for a in aids)
        return total

    def close(self) -> None:
        """Close the files (a temporary directory is removed; a run's stays for a resume until :meth:`remove`)."""
        if self.files is not None:
            self.files.close()
        if self._finalizer is not None:
            self._finalizer()

    def remove(self) -> None:
        """Delete the store's files (the run ended, or is being replaced or discarded)."""
        if self.files is not None:
            self.files.remove()
        if self._finalizer is not None:
            self._finalizer()


def open_state_store(
    cfg: Any,
    method: Any,
    template: dict[str, torch.Tensor],
    num_clients: int,
    *,
    default_state: Callable[[], dict[str, Any]] = dict,
    directory: Path | None = None,
    owner: str = "",
) -> ClientStateStore:
    """The store of a run: ``cfg.state_store`` (``auto``: disk when the model's bytes × :func:`state_copies` × clients
    exceed :func:`memory_budget` of ``cfg.state_memory``)."""
    per_client = sum(t.numel() * t.element_size() for t in template.values()) * state_copies(method)
    backend = choose_store(cfg.state_store, memory_budget(cfg.state_memory), per_client, num_clients)
    return ClientStateStore(backend, num_clients, directory, default_state=default_state, owner=owner)
