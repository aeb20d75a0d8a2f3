"""Upload stacks on disk: the ``[K, ...]`` buffers in unnamed files, mapped shared, their pages handed back as the
server goes (``aggregation: disk``).

A server whose pieces read every upload at once (FedSA's dispersion, FedHEAL's masks and distances, FedCAC's
overlaps) cannot sum the uploads as they arrive (:mod:`fedskew.server.streaming`); at full participation of many
clients its stack outgrows RAM (2,000 clients of PFLlib's CNN: 4.7 GB). :class:`DiskBuffers` is an allocator for
:class:`~fedskew.server.uploads.UploadStack` whose buffers are ordinary CPU tensors over shared mappings of files,
so every server piece reads them unchanged and the results are those of the in-memory stack, bit for bit.

**Pages.** Writing or reading a mapped page makes it resident in this process (it counts in its RSS) until it is
unmapped. :func:`release_pages` tells the kernel (``madvise(MADV_DONTNEED)``) that the process no longer needs the
live stacks' pages: the data stays in the files (a shared mapping's dirty pages go to the page cache, then to disk)
and a later read faults them back in. It runs after each upload is copied in
(:meth:`~fedskew.server.uploads.UploadStack.add`), after each column block a reduction has consumed
(:func:`fedskew.server.combine.column_blocks`) and after each client of a per-client loop over the stack, so the
resident part of the stack stays about one ``K × block`` slab or one row. The mappings are ``MADV_RANDOM``: with
read-ahead, a page cache of large folios (ext4 on Linux 6.x maps up to a 2 MiB folio per fault) would map every row
a column block touches in full, i.e. the whole stack (measured: 368 of 400 MiB for one block of 200 rows). The page
cache holding the files is the kernel's to write back and evict under memory pressure. With no disk stack alive,
:func:`release_pages` returns at once.

**Files.** Unnamed (``O_TMPFILE``; elsewhere created and unlinked at once) in a directory the host names (the run
directory), so a crash leaves nothing behind and nothing is ever deleted by name; they need the stack's size in
free disk space. A mapping, and its file, live as long as a tensor over it.
"""

from __future__ import annotations

import mmap
import os
import tempfile
import weakref
from pathlib import Path

import torch
from torch import Tensor

_LIVE: weakref.WeakSet[mmap.mmap] = weakref.WeakSet()  # the mappings of the disk stacks alive now


def release_pages() -> None:
    """Hand the live disk stacks' resident pages back to the kernel (their data stays in the files)."""
    if not _LIVE:
        return
    for mapping in list(_LIVE):
        try:
            mapping.madvise(mmap.MADV_DONTNEED)
        except (ValueError, OSError):  # closed meanwhile
            _LIVE.discard(mapping)


def is_on_disk(t: Tensor) -> bool:
    """Whether ``t`` (or the tensor it views) lives in one of :class:`DiskBuffers`' files."""
    return t.device.type == "cpu" and getattr(t.untyped_storage(), "_fedskew_disk", False)


class DiskBuffers:
    """``empty(key, shape, dtype, device)``: an uninitialized CPU tensor in a new unnamed file under ``directory``
    (the signature of :meth:`fedskew.engine.buffers.BufferPool.empty`, so either can allocate an upload stack).
    A tensor without elements is an ordinary empty one."""

    def __init__(self, directory: str | Path | None = None) -> None:
        self.directory = Path(directory) if directory is not None else Path(tempfile.gettempdir())

    def empty(self, key: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> Tensor:
        if torch.device(device).type != "cpu":
            raise ValueError(f"a disk-backed upload stack lives on the CPU, not on {device} (use aggregation stacked)")
        numel = 1
        for s in shape:
            numel *= int(s)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=self.directory, prefix=".upload-stack-") as f:
                os.ftruncate(f.fileno(), nbytes)  # sparse: blocks are taken as the rows are written
                mapping = mmap.mmap(f.fileno(), nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as e:
            raise OSError(
                f"cannot map a {nbytes / 2**20:.1f} MiB upload-stack file ({key}) in {self.directory}: {e}"
            ) from e
        # no read-ahead or fault-around: a page-cache folio can hold a whole row (ext4's large folios), and a column
        # block would then map every row it touches in full, i.e. the whole stack
        mapping.madvise(mmap.MADV_RANDOM)
        _LIVE.add(mapping)
        t = torch.frombuffer(mapping, dtype=dtype, count=numel)  # keeps the mapping (and the file) alive
        t.untyped_storage()._fedskew_disk = True  # type: ignore[attr-defined]
        return t.view(shape)
