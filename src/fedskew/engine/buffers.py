"""Round buffers that outlive their round: the ``[K, ...]`` upload stacks allocated once, not every round.

A round's uploads are copied into preallocated ``[K, ...]`` buffers (``server.api.UploadStack``). Allocated afresh
every round, a buffer larger than glibc's mmap threshold (32 MiB at most) is a new mapping each time, and every page
of it faults on its first write: for 50 clients of PFLlib's CNN that is about 1 ms per client, more than the
validation and the copies themselves. :class:`BufferPool` hands out the previous round's buffer instead, but only
when nothing holds a view of it any more (a server piece may keep views of the uploads, e.g. a client's upload as
its personalized model): it counts the references to the buffer's storage, so a buffer still referenced is never
overwritten; a new one is allocated instead.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _storage_uses(t: Tensor) -> int | None:
    """How many tensors share ``t``'s storage (``None`` where torch does not say: never reuse then)."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    if count is None:
        return None
    return int(count(t.untyped_storage()._cdata))


class BufferPool:
    """``empty(key, shape, dtype, device)``: an uninitialized tensor, the pooled one for ``key`` when its rows and
    row shape fit and no view of it is alive, else a new one (which the pool then keeps)."""

    def __init__(self) -> None:
        self._held: dict[tuple[str, tuple[int, ...], torch.dtype, str], tuple[Tensor, int | None]] = {}

    def empty(self, key: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> Tensor:
        rows, row_shape = int(shape[0]), tuple(int(s) for s in shape[1:])
        slot = (key, row_shape, dtype, str(device))
        held = self._held.get(slot)
        if held is not None:
            t, alone = held
            if alone is not None and t.shape[0] >= rows and _storage_uses(t) == alone:
                return t[:rows]
        t = torch.empty((rows, *row_shape), dtype=dtype, device=device)
        self._held[slot] = (t, _storage_uses(t))
        return t[:rows]

    def clear(self) -> None:
        self._held.clear()


class TrainInPlace:
    """A model whose state-dict tensors are, while a client trains, the next free row of the round's upload buffers:
    loading the received model writes that row, the training updates it, and the upload is already where the round
    server stacks it (:meth:`fedskew.server.uploads.UploadStack.add` then skips the copy; the checks are the same).
    That removes a copy of the model per client, the largest part of the sequential loop's cost per client beside
    the plain SGD steps (docs/design.md, "Cross-device scale").

    :meth:`bind` points the model at a row (``False``, and nothing changed, when the row does not match the model
    tensor for tensor, or two state-dict entries share storage: a tied model trains in its own tensors);
    :meth:`restore` gives the model back its own tensors (not copied into: what the model holds then is what was
    last loaded into them). Bind for the training only: whatever uses the model after it (a personalized method's
    adaptation of the trained model, evaluation) would otherwise write into the stacked upload."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._home: dict[str, Tensor] | None = None  # the model's own tensors while it is bound
        # the model's parameter and buffer objects, listed once (state_dict() walks the modules: ~0.2 ms a call); a
        # part that replaced one of them since trains in it, and UploadStack.add copies that upload as any other
        self._entries = dict(model.state_dict(keep_vars=True))
        # tied entries (one tensor under two names): binding them apart would untie them
        self._tied = len({t.data_ptr() for t in self._entries.values()}) != len(self._entries)

    def bind(self, row: dict[str, Tensor] | None) -> bool:
        tensors = self._entries
        if row is None or self._tied or set(tensors) != set(row):
            return False
        for n, t in tensors.items():
            r = row[n]
            if r.shape != t.shape or r.dtype != t.dtype or r.device != t.device or not r.is_contiguous():
                return False
        if self._home is None:  # (bound already: the model's own tensors are still the ones kept)
            self._home = {n: t.data for n, t in tensors.items()}
        with torch.no_grad():
            for n, t in tensors.items():
                t.data = row[n]
        return True

    def restore(self) -> None:
        if self._home is None:
            return
        with torch.no_grad():
            for n, t in self._entries.items():
                t.data = self._home[n]
        self._home = None
