"""Uploads on the server: the one validation (:func:`check_upload`), the ``on_bad_update`` policy (:func:`enforce`)
and the stacked round input.

Uploads pass one validation, :func:`check_upload` (a :class:`~fedskew.protocol.Rejection` with the reason, or
``None``), which both ``on_bad_update`` policies use: ``fail`` raises it, ``drop`` leaves the upload out of the round
(:func:`enforce`, the one place of the policy). The engine copies each valid upload into preallocated ``[K, ...]``
buffers as soon as it is trained (:class:`UploadStack`), so a round never holds its uploads twice;
:func:`stack_uploads` does the same for a list.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

import numpy as np
import torch
from torch import Tensor

from fedskew.protocol import LABEL_HIST, Params, Rejection, RoundInput, Upload, UploadError
from fedskew.server.paging import release_pages


def check_upload(
    upload: Upload,
    global_params: Params,
    extras_template: Params | None = None,
    nonfinite_at: Sequence[int] | None = None,
) -> Rejection | None:
    """The one validation of an upload: ``None`` if the server can use it, else the first problem found.

    Checked against the broadcast model: the same tensor names (nothing missing, nothing unknown), shapes and
    dtypes; a positive sample count; the extra tensors against ``extras_template`` (an accepted upload's extras:
    same names, shapes and dtypes; ``None``: not compared); every floating tensor finite. Both policies use it:
    ``fail`` raises :meth:`Rejection.error`, ``drop`` leaves the upload out of the round. ``nonfinite_at``: the
    upload's finiteness already found by :func:`nonfinite_each` with its round's other uploads (one device sync for
    all of them), the positions in :func:`upload_tensors` of its tensors that hold NaN or Inf.
    """
    missing = [n for n in global_params if n not in upload.params]
    extra = [n for n in upload.params if n not in global_params]
    if missing or extra:
        return Rejection(upload.cid, f"upload has missing tensors {missing} / unknown tensors {extra}")
    for n, ref in global_params.items():
        t = upload.params[n]
        if t.shape != ref.shape:
            return Rejection(upload.cid, f"tensor '{n}' has shape {tuple(t.shape)}, expected {tuple(ref.shape)}")
        if t.dtype != ref.dtype:
            return Rejection(upload.cid, f"tensor '{n}' has dtype {t.dtype}, expected {ref.dtype}")
    if upload.num_samples <= 0:
        return Rejection(upload.cid, f"num_samples must be positive, got {upload.num_samples}")
    if extras_template is not None:
        if sorted(upload.extras) != sorted(extras_template):
            return Rejection(upload.cid, f"extras {sorted(upload.extras)} differ from {sorted(extras_template)}")
        for n, ref in extras_template.items():
            t = upload.extras[n]
            if t.shape != ref.shape or t.dtype != ref.dtype:
                return Rejection(
                    upload.cid, f"extra tensor '{n}' is {t.dtype}{list(t.shape)}, expected {ref.dtype}{list(ref.shape)}"
                )
    named = upload_tensors(upload)
    bad = nonfinite([t for _, _, t in named]) if nonfinite_at is None else list(nonfinite_at)
    if bad:
        kind, n, _ = named[bad[0]]
        return Rejection(upload.cid, f"{kind} '{n}' contains NaN or Inf", nonfinite=True)
    return None


def upload_tensors(upload: Upload) -> list[tuple[str, str, Tensor]]:
    """An upload's tensors as ``(kind, name, tensor)``, its parameters then its extras: the positions
    :func:`nonfinite_each` reports."""
    return [
        (kind, n, t) for kind, ts in (("tensor", upload.params), ("extra tensor", upload.extras)) for n, t in ts.items()
    ]


def nonfinite_each(uploads: Sequence[Upload]) -> list[list[int]]:
    """:func:`nonfinite` of every upload's tensors (:func:`upload_tensors`) at once: for a round's uploads that
    arrive together (batched clients), one multi-tensor norm and one device sync instead of one each. What is not a
    tensor is left to :func:`check_upload`'s checks of names, shapes and dtypes."""
    owner: list[tuple[int, int]] = []  # (upload, position in its tensors) of each tensor checked
    tensors: list[Tensor] = []
    for u, upload in enumerate(uploads):
        for i, (_, _, t) in enumerate(upload_tensors(upload)):
            if isinstance(t, Tensor):
                owner.append((u, i))
                tensors.append(t)
    found: list[list[int]] = [[] for _ in uploads]
    for j in nonfinite(tensors):
        u, i = owner[j]
        found[u].append(i)
    return found


def nonfinite(tensors: Sequence[Tensor]) -> list[int]:
    """The positions of the floating tensors holding NaN or Inf, exactly, in one device sync. Each tensor's sum is
    finite when all its elements are (NaN and Inf propagate through a sum); only a tensor whose sum is not finite
    (a bad element, or finite elements that overflow the sum) is checked element by element. A sum reads the tensor
    once without allocating: ``isfinite(t).all()`` costs about 15 times as much on a CPU. The sums are of absolute
    values, all tensors' in one multi-tensor operation (``torch._foreach_norm``, as ``clip_grad_norm_`` uses it)."""
    floats = [i for i, t in enumerate(tensors) if t.is_floating_point()]
    if not floats:
        return []
    # the sums of |x| (L1 norms: NaN and Inf propagate through them as through a sum) of all the tensors in one
    # multi-tensor operation, stacked in the widest of their dtypes: a few dispatches whatever the count of tensors
    norms = torch.stack(torch._foreach_norm([tensors[i] for i in floats], 1))
    suspect = [i for i, ok in zip(floats, torch.isfinite(norms).tolist(), strict=True) if not ok]
    return [i for i in suspect if not bool(torch.isfinite(tensors[i]).all())]


def validate_uploads(updates: Sequence[Upload], global_params: Params) -> tuple[list[Upload], list[Rejection]]:
    """Split uploads into the valid ones and the rejected ones with reasons (:func:`check_upload`); the first valid
    upload's extra tensors are the reference for the others'."""
    valid: list[Upload] = []
    rejected: list[Rejection] = []
    for u in updates:
        bad = check_upload(u, global_params, valid[0].extras if valid else None)
        if bad is None:
            valid.append(u)
        else:
            rejected.append(bad)
    return valid, rejected


# (key, shape, dtype, device) -> an uninitialized tensor: where an upload stack gets its buffers (the engine's
# engine/buffers.py pool reuses the last round's; default a new one each time)
Allocator = Callable[[str, tuple[int, ...], torch.dtype, torch.device], Tensor]


class UploadStack:
    """Uploads validated into preallocated ``[capacity, ...]`` buffers one at a time, as they arrive.

    The engine adds each client's upload right after its training and drops the per-client copy, so a round never
    holds the K uploads twice. :meth:`add` returns the :class:`Rejection` of an invalid upload (which is not
    stored) and ``None`` otherwise; the caller applies its policy. Accepted uploads fill the rows in order; the
    first one fixes the extra tensors every later one must match.
    """

    def __init__(self, capacity: int, global_params: Params, alloc: Allocator | None = None) -> None:
        self.global_params = global_params
        self.capacity = capacity
        self._alloc: Allocator = alloc or (
            lambda key, shape, dtype, device: torch.empty(shape, dtype=dtype, device=device)
        )
        self.params: Params = {
            n: self._alloc(n, (capacity, *t.shape), t.dtype, t.device) for n, t in global_params.items()
        }
        self.extras: Params | None = None  # allocated from the first accepted upload
        # the buffers' rows as views made a chunk of rows at a time: an upload is checked against and copied into
        # its row without indexing every buffer for it (a dispatch each, per tensor and upload)
        self._rows = {n: RowViews(buf) for n, buf in self.params.items()}
        self._extra_rows: dict[str, RowViews] = {}
        self._template: Params | None = None  # the first accepted upload's extras (its rows): what later ones match
        self.cids: list[int] = []
        self.num_samples: list[float] = []
        self.metrics: list[dict[str, float]] = []
        self.rejected: list[Rejection] = []

    @property
    def count(self) -> int:
        return len(self.cids)

    def add(self, upload: Upload, nonfinite_at: Sequence[int] | None = None) -> Rejection | None:
        """Validate ``upload`` into the next row (``nonfinite_at``: :func:`check_upload`'s)."""
        bad = check_upload(upload, self.global_params, self._template, nonfinite_at)
        if bad is not None:
            self.rejected.append(bad)
            return bad
        if self.count >= self.capacity:
            raise ValueError(f"UploadStack holds {self.capacity} uploads; client {upload.cid} is one too many")
        if self.extras is None:
            self.extras = {
                n: self._alloc(f"extra:{n}", (self.capacity, *t.shape), t.dtype, t.device)
                for n, t in sorted(upload.extras.items())
            }
            self._extra_rows = {n: RowViews(buf) for n, buf in self.extras.items()}
            self._template = {n: buf[0] for n, buf in self.extras.items()}
        row = self.count
        into, given = [], []
        for n, rows in self._rows.items():
            if not _is_view_of(upload.params[n], rows[row]):  # trained in place (next_row): already there
                into.append(rows[row])
                given.append(upload.params[n])
        for n, rows in self._extra_rows.items():
            into.append(rows[row])
            given.append(upload.extras[n])
        copy_all(into, given)
        release_pages()  # a disk-backed stack (server.paging): the row's pages go back to the kernel
        self.cids.append(upload.cid)
        self.num_samples.append(float(upload.num_samples))
        self.metrics.append({k: float(v) for k, v in upload.metrics.items()})
        return None

    def next_row(self) -> Params | None:
        """Views of the row the next accepted upload fills (``None``: the stack is full), for a client to train in
        place (:class:`fedskew.engine.buffers.TrainInPlace`): an upload whose tensors are these views is not copied.
        A rejected upload leaves the row free for the next."""
        if self.count >= self.capacity:
            return None
        return {n: rows[self.count] for n, rows in self._rows.items()}

    def round_input(
        self,
        *,
        rnd: int,
        trainable: frozenset[str],
        reports: Mapping[str, np.ndarray] | None = None,
        label_hists: np.ndarray | None = None,
    ) -> RoundInput:
        """The accepted uploads as a :class:`RoundInput` (views of the buffers' filled rows, no copy); ``reports``:
        the accepted clients' declared client reports (name -> ``[K, d]``, rows in the order of :attr:`cids`), of
        which ``label_hist`` is also ``RoundInput.label_hists``; ``label_hists`` given alone stands for it."""
        reports = dict(reports or {})
        if label_hists is not None:
            reports.setdefault(LABEL_HIST.name, np.asarray(label_hists))
        if not self.cids:
            raise UploadError("no valid upload in this round")
        k = self.count
        return RoundInput(
            round=rnd,
            cids=tuple(self.cids),
            params={n: buf[:k] for n, buf in self.params.items()},
            num_samples=torch.tensor([float(n) for n in self.num_samples], dtype=torch.float64),
            extras={n: buf[:k] for n, buf in (self.extras or {}).items()},
            global_params=self.global_params,
            trainable=trainable,
            label_hists=reports.get(LABEL_HIST.name),
            metrics=stack_metrics(self.metrics),
            reports=reports,
            alloc=self._alloc,
        )


class RowViews:
    """``rows[i]``: the view ``buf[i]`` of a ``[capacity, ...]`` buffer, the views made :data:`ROW_CHUNK` rows at a
    time (one ``unbind`` of the chunk holding the row asked for, kept until a row of another chunk is asked for): a
    stack filled row after row indexes each buffer once a chunk, and a stack of 100,000 rows holds one chunk's views,
    not 100,000."""

    def __init__(self, buf: Tensor) -> None:
        self.buf = buf
        self.start = -1
        self.views: tuple[Tensor, ...] = ()

    def __getitem__(self, row: int) -> Tensor:
        start = row - row % ROW_CHUNK
        if start != self.start:
            self.views = self.buf[start : start + ROW_CHUNK].unbind(0)
            self.start = start
        return self.views[row - start]


ROW_CHUNK = 256


def copy_all(into: Sequence[Tensor], given: Sequence[Tensor]) -> None:
    """``into[i].copy_(given[i])`` for every ``i``: one multi-tensor copy when every tensor has one device and dtype
    (``torch._foreach_copy_``: one dispatch, and on a GPU a few kernel launches, for all of them), else one by one."""
    if not into:
        return
    kinds = {(t.device, t.dtype) for t in (*into, *given)}
    if len(kinds) == 1:
        torch._foreach_copy_(list(into), list(given))
        return
    for dst, src in zip(into, given, strict=True):
        dst.copy_(src)


def _is_view_of(t: Tensor, row: Tensor) -> bool:
    """Whether ``t`` is exactly the tensor ``row`` (same memory, shape, strides and dtype)."""
    return (
        t.data_ptr() == row.data_ptr() and t.shape == row.shape and t.stride() == row.stride() and t.dtype == row.dtype
    )


def stack_metrics(metrics: Sequence[Mapping[str, float]]) -> dict[str, Tensor]:
    """The scalar metrics every upload reported, as ``[K]`` float64 tensors (a metric some client lacks is left out:
    a server piece that needs it names it in its error)."""
    if not metrics:
        return {}
    common = set(metrics[0]).intersection(*metrics[1:])
    return {k: torch.tensor([m[k] for m in metrics], dtype=torch.float64) for k in sorted(common)}


ON_BAD_UPDATE = ("fail", "drop")


def enforce(rejected: Sequence[Rejection], on_bad_update: str) -> None:
    """The one fail/drop policy over a round's rejected uploads (the engine's and :func:`stack_uploads`'): under
    ``'fail'`` the error of the round's first malformed upload, else of its first non-finite one
    (:class:`NonFiniteUploadError`, which the engine reports as divergence); under ``'drop'`` nothing (the uploads
    stay out, each with its :class:`Rejection`)."""
    if on_bad_update not in ON_BAD_UPDATE:
        raise ValueError(f"on_bad_update must be one of {ON_BAD_UPDATE}, got {on_bad_update!r}")
    if on_bad_update == "fail" and rejected:
        raise min(rejected, key=lambda r: r.nonfinite).error()


def stack_uploads(
    updates: Sequence[Upload],
    *,
    rnd: int,
    global_params: Params,
    trainable: frozenset[str],
    label_hists: np.ndarray | None = None,
    on_bad_update: str = "fail",
    reports: Mapping[str, np.ndarray] | None = None,
) -> RoundInput:
    """Validate the uploads against the broadcast model (:func:`check_upload`) and stack them along a client axis.

    ``on_bad_update='fail'`` raises :class:`UploadError` naming the client and tensor for a missing, extra,
    mis-shaped or wrong-dtype upload (:class:`NonFiniteUploadError` for NaN/Inf); ``'drop'`` leaves such uploads
    out (``RoundInput.rejected`` says which and why; the rows of ``label_hists`` and of every ``reports`` entry
    follow ``updates``) and raises only when none is left.
    """
    if on_bad_update not in ON_BAD_UPDATE:
        raise ValueError(f"on_bad_update must be one of {ON_BAD_UPDATE}, got {on_bad_update!r}")
    if not updates:
        raise UploadError("no client uploaded in this round")
    stack = UploadStack(len(updates), global_params)
    kept = [i for i, u in enumerate(updates) if stack.add(u) is None]
    enforce(stack.rejected, on_bad_update)
    if not kept:
        reasons = "; ".join(f"client {r.cid}: {r.reason}" for r in stack.rejected)
        raise UploadError(f"no valid upload in this round ({reasons})")
    rows = dict(reports or {})
    if label_hists is not None:
        rows.setdefault(LABEL_HIST.name, np.asarray(label_hists))
    if len(kept) < len(updates):
        rows = {k: np.asarray(v)[kept] for k, v in rows.items()}
    rin = stack.round_input(rnd=rnd, trainable=trainable, reports=rows)
    return replace(rin, rejected=tuple(stack.rejected)) if stack.rejected else rin


def check_model(params: Params, template: Params, what: str, partial: bool = False) -> list[str]:
    """Check a model the server produced against the template: same names (``partial``: some of them, a personalized
    step that sends a client part of a model), shapes and dtypes, else ``TypeError`` naming the tensor (a server-side
    bug, never to be run with). Returns the names of tensors holding NaN or Inf, which the engine reports as
    divergence."""
    missing, extra = sorted(set(template) - set(params)), sorted(set(params) - set(template))
    if extra or (missing and not partial) or not params:
        raise TypeError(f"{what}: missing tensors {missing} / unknown tensors {extra}")
    names = [n for n in template if n in params]
    for n in names:
        t, ref = params[n], template[n]
        if t.shape != ref.shape or t.dtype != ref.dtype:
            raise TypeError(f"{what}: tensor '{n}' is {t.dtype}{list(t.shape)}, expected {ref.dtype}{list(ref.shape)}")
    return [names[i] for i in nonfinite([params[n] for n in names])]
