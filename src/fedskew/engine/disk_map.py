"""One per-client map on disk (:class:`DiskMap`): each client's value split into entries, one array file per entry
shape, a slot per client; the store (:mod:`fedskew.engine.state_store`) holds three of them (see its docstring for
the layout, the slots and how a checkpoint pins them)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from fedskew.engine.state_files import ArraySpec, Signature, StoreDirError, StoreFiles

# ---- one map on disk -----------------------------------------------------------------------------------------------
_EMPTY = object()  # an empty dict in a value (kept as such)
# a layout's leaf: ("t", path, array, index, stride, requires_grad, device, parameter) | ("s", path, i) | ("d", path)
Leaf = tuple[Any, ...]


def _flatten(value: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """``(path, leaf)`` of a nested dict, depth first in insertion order. Dicts with str/int keys are descended (a
    dict subclass comes back as a plain dict); a dict with other keys is one leaf, kept whole in RAM."""
    if isinstance(value, dict):
        if not value:
            yield path, _EMPTY
            return
        if all(isinstance(k, str | int) and not isinstance(k, bool) for k in value):
            for k, v in value.items():
                yield from _flatten(v, (*path, k))
            return
    yield path, value


def _storable(t: Any) -> bool:
    return type(t) in (torch.Tensor, nn.Parameter) and t.layout == torch.strided and t.numel() > 0


def _kept_stride(t: torch.Tensor) -> tuple[int, ...] | None:
    """The strides to restore: ``None`` for a contiguous tensor (or one whose elements overlap or leave gaps, which
    comes back contiguous), else its own (a permuted dense layout, e.g. channels-last)."""
    if t.is_contiguous():
        return None
    expected = 1
    for i in sorted(range(t.dim()), key=lambda i: t.stride(i)):
        if t.shape[i] != 1 and t.stride(i) != expected:
            return None
        expected *= t.shape[i]
    return tuple(t.stride())


@dataclass(frozen=True)
class StoreRef:
    """What a checkpoint holds of a :class:`DiskMap` instead of its tensors: the store and the map it belongs to, each
    client's layout (the tensors' arrays and the small values) and the slot holding its value."""

    store_id: str
    directory: str
    namespace: str
    num_clients: int
    layouts: tuple[tuple[Leaf, ...], ...]
    layout_of: np.ndarray  # int32 [N]: index into layouts, -1: no value stored
    slot: np.ndarray  # int8 [N]
    small: dict[int, tuple[Any, ...]]


class DiskMap(MutableMapping[int, Any]):
    """One per-client map on disk (see the module docstring). ``default``: the value of a client never written
    (``client_states``: a fresh state; the map then holds every client); ``mutable``: values fetched with ``[cid]``
    are cached and written back (``client_states``), else only assigned values are."""

    def __init__(
        self,
        files: StoreFiles,
        namespace: str,
        *,
        depth: int,
        default: Callable[[], Any] | None = None,
        mutable: bool = False,
    ) -> None:
        n = files.num_clients
        self.files, self.namespace, self.depth, self.default, self.mutable = files, namespace, depth, default, mutable
        self._layouts: list[tuple[Leaf, ...]] = []
        self._layout_ids: dict[tuple[Leaf, ...], int] = {}
        self._layout_of = np.full(n, -1, dtype=np.int32)
        self._live = np.full(n, -1, dtype=np.int8)
        self._pinned = np.full(n, -1, dtype=np.int8)
        self._small: dict[int, tuple[Any, ...]] = {}
        self._cache: dict[int, Any] = {}
        self.source: DiskMap | None = None  # the map an alias points into (trained -> client_states)
        self.dependents: list[DiskMap] = []  # maps that may hold aliases into this one

    # ---- mapping -------------------------------------------------------------------------------------------------
    def _check(self, cid: Any) -> int:
        if isinstance(cid, bool) or not isinstance(cid, int | np.integer) or not 0 <= cid < len(self._layout_of):
            raise KeyError(cid)
        return int(cid)

    def __getitem__(self, cid: int) -> Any:
        cid = self._check(cid)
        if cid in self._cache:
            return self._cache[cid]
        if self._layout_of[cid] >= 0:
            value = self._load(cid)
        elif self.default is not None:
            value = self.default()
        else:
            raise KeyError(cid)
        if self.mutable:
            self._cache[cid] = value
        return value

    def peek(self, cid: int, default: Any = None) -> Any:
        """The client's value without caching it (``default`` when it has none)."""
        try:
            cid = self._check(cid)
        except KeyError:
            return default
        if cid in self._cache:
            return self._cache[cid]
        if self._layout_of[cid] >= 0:
            return self._load(cid)
        return self.default() if self.default is not None else default

    def peek_entry(self, cid: int, key: Any) -> Any:
        """``self.peek(cid).get(key)``, reading only the leaves under ``key``."""
        cid = self._check(cid)
        if cid in self._cache or self._layout_of[cid] < 0:
            value = self.peek(cid)
            return value.get(key) if isinstance(value, dict) else None
        return self._load(cid, key).get(key)

    def get(self, cid: int, default: Any = None) -> Any:  # type: ignore[override]
        return self.peek(cid, default)

    def __setitem__(self, cid: int, value: Any) -> None:
        self._cache[self._check(cid)] = value

    def __delitem__(self, cid: int) -> None:
        cid = self._check(cid)
        had = self._cache.pop(cid, _EMPTY) is not _EMPTY or self._layout_of[cid] >= 0
        self._layout_of[cid], self._live[cid] = -1, -1
        self._small.pop(cid, None)
        if not had:
            raise KeyError(cid)

    def __contains__(self, cid: object) -> bool:
        try:
            c = self._check(cid)
        except KeyError:
            return False
        return self.default is not None or c in self._cache or bool(self._layout_of[c] >= 0)

    def _ids(self) -> list[int]:
        if self.default is not None:
            return list(range(len(self._layout_of)))
        return sorted(set(self._cache) | {int(c) for c in np.nonzero(self._layout_of >= 0)[0]})

    def __iter__(self) -> Iterator[int]:
        return iter(self._ids())

    def __len__(self) -> int:
        return len(self._ids())

    # ---- write-back ----------------------------------------------------------------------------------------------
    def release(self, cid: int) -> None:
        """Write the client's cached value to disk and drop it from RAM (nothing cached: nothing to do)."""
        value = self._cache.pop(cid, _EMPTY)
        if value is not _EMPTY:
            self._write(cid, value)

    def commit(self) -> None:
        """Write every cached value to disk and empty the cache."""
        for cid in sorted(self._cache):
            self.release(cid)

    def write_alias(self, cid: int, key: Any) -> None:
        """Store client ``cid``'s value as "the entry ``key`` of its value in :attr:`source`", which holds that very
        object and has just been written (Ditto's trained model *is* its own model: written once, not twice)."""
        assert self.source is not None
        self._cache.pop(cid, None)
        layout = (("a", (), key),)
        lid = self._layout_ids.get(layout)
        if lid is None:
            lid = self._layout_ids[layout] = len(self._layouts)
            self._layouts.append(layout)
        self._layout_of[cid], self._live[cid] = lid, -1  # no row: a later real write avoids the pinned slot
        self._small.pop(cid, None)

    def _is_alias(self, cid: int) -> bool:
        lid = int(self._layout_of[cid])
        return lid >= 0 and self._layouts[lid][:1] != () and self._layouts[lid][0][0] == "a"

    def _unalias(self, cid: int) -> None:
        """Before :attr:`source` overwrites the entry an alias of ``cid`` points to, store the value itself."""
        if cid not in self._cache and self._is_alias(cid):
            self._write(cid, self._load(cid))

    def cached(self) -> int:
        return len(self._cache)

    def reference(self) -> StoreRef:
        """Write everything back, make it durable, and pin it: the returned reference stays valid (its slots are
        never written) until the next call."""
        self.commit()
        self.files.sync()
        ref = StoreRef(
            store_id=self.files.store_id,
            directory=str(self.files.directory),
            namespace=self.namespace,
            num_clients=len(self._layout_of),
            layouts=tuple(self._layouts),
            layout_of=self._layout_of.copy(),
            slot=self._live.copy(),
            small=dict(self._small),
        )
        self._pinned = self._live.copy()
        return ref

    def restore(self, ref: StoreRef) -> None:
        """Take the state a reference recorded (the store's files already opened)."""
        if ref.store_id != self.files.store_id or ref.namespace != self.namespace:
            raise StoreDirError(f"checkpoint references store {ref.store_id}/{ref.namespace}, not this one")
        if ref.num_clients != len(self._layout_of):
            n = len(self._layout_of)
            raise StoreDirError(f"checkpoint's store holds {ref.num_clients} clients, this run has {n}")
        arrays = len(self.files.arrays)
        if any(leaf[0] == "t" and leaf[2] >= arrays for layout in ref.layouts for leaf in layout):
            raise StoreDirError(f"{self.files.directory}: the checkpoint references arrays its marker does not list")
        self._layouts = list(ref.layouts)
        self._layout_ids = {layout: i for i, layout in enumerate(self._layouts)}
        self._layout_of = ref.layout_of.astype(np.int32).copy()
        self._live = ref.slot.astype(np.int8).copy()
        self._pinned = self._live.copy()
        self._small = dict(ref.small)
        self._cache.clear()

    # ---- encoding ------------------------------------------------------------------------------------------------
    def _write(self, cid: int, value: Any) -> None:
        for dependent in self.dependents:
            dependent._unalias(cid)
        leaves = list(_flatten(value))
        groups: dict[tuple[Any, ...], list[tuple[tuple[Any, ...], torch.Tensor]]] = {}
        small: list[Any] = []
        for path, leaf in leaves:
            if _storable(leaf) and len(path) >= self.depth:
                groups.setdefault(path[: self.depth], []).append((path[self.depth :], leaf))
        specs: dict[tuple[Any, ...], ArraySpec] = {}
        for group, items in groups.items():
            sig: Signature = tuple((sub, t.dtype, tuple(t.shape)) for sub, t in items)
            specs[group] = self.files.array(self.namespace, group, sig)
        index: dict[tuple[Any, ...], int] = {}
        layout: list[Leaf] = []
        for path, leaf in leaves:
            if _storable(leaf) and len(path) >= self.depth:
                group = path[: self.depth]
                k = index[group] = index.get(group, -1) + 1
                stride = _kept_stride(leaf)
                kind = (specs[group].id, k, stride, leaf.requires_grad, str(leaf.device), type(leaf) is nn.Parameter)
                layout.append(("t", path, *kind))
            elif leaf is _EMPTY:
                layout.append(("d", path))
            else:
                layout.append(("s", path, len(small)))
                small.append(leaf)
        key = tuple(layout)
        lid = self._layout_ids.get(key)
        if lid is None:
            lid = self._layout_ids[key] = len(self._layouts)
            self._layouts.append(key)
        live, pinned = int(self._live[cid]), int(self._pinned[cid])
        slot = live if live >= 0 and live != pinned else (1 - pinned if pinned >= 0 else 0)
        for group, items in groups.items():
            tensors = [t.detach().to("cpu").contiguous() for _, t in items]
            self.files.write(specs[group], cid, slot, tensors)
        self._layout_of[cid], self._live[cid] = lid, slot
        if small:
            self._small[cid] = tuple(small)
        else:
            self._small.pop(cid, None)

    def _load(self, cid: int, only: Any = _EMPTY) -> Any:
        """The client's value (``only``: just the leaves under that top-level key)."""
        layout = self._layouts[int(self._layout_of[cid])]
        if layout[:1] and layout[0][0] == "a":  # an alias: the source's stored entry (not its cache)
            assert self.source is not None
            return self.source._load(cid, layout[0][2]).get(layout[0][2])
        if only is not _EMPTY:
            layout = tuple(leaf for leaf in layout if leaf[1][:1] == (only,))
        slot, small = int(self._live[cid]), self._small.get(cid, ())
        rows: dict[int, torch.Tensor] = {}
        out: dict[Any, Any] = {}
        for leaf in layout:
            if leaf[0] == "t":
                _, path, aid, k, stride, grad, device, param = leaf
                spec = self.files.arrays[aid]
                if aid not in rows:
                    rows[aid] = self.files.read(spec, cid, slot)
                _, dtype, shape = spec.signature[k]
                n = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
                t = rows[aid][spec.offsets[k] : spec.offsets[k] + n].view(dtype).reshape(shape)
                if stride is not None:
                    t = torch.empty_strided(shape, stride, dtype=dtype).copy_(t)
                if device != "cpu":
                    t = t.to(device)
                if param:
                    t = nn.Parameter(t, requires_grad=grad)
                elif grad:
                    t.requires_grad_(True)
                value: Any = t
            elif leaf[0] == "d":
                path, value = leaf[1], {}
            else:
                path, value = leaf[1], small[leaf[2]]
            if not path:
                return value
            node = out
            for key in path[:-1]:
                node = node.setdefault(key, {})
            node[path[-1]] = value
        return out
