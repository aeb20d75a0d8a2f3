"""Combine rules: stacked client values -> one global state dict (see :class:`fedskew.server.api.Combine`).

Statistics are exact float64 sums, but the ``[K, ...]`` uploads are never cast to float64 as a whole: the client
axis is reduced block by block of columns (:func:`column_blocks`), so the working memory is a few ``K × block``
float64 buffers (32 MiB on CPU) whatever K and the model size.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from fedskew.protocol import Params, RoundInput, State
from fedskew.server.api import Combine, Diagnostics
from fedskew.server.paging import release_pages

BLOCK_ELEMENTS = {"cpu": 1 << 22}  # float64 elements of one K × block working buffer (32 MiB); per device type
BLOCK_ELEMENTS_DEFAULT = 1 << 26  # accelerators: fewer, larger kernels (512 MiB)
# on a CPU also at most 1/16 of the columns (a float64 block <= 1/8 of a float32 [K, M] stack in RAM) ...
BLOCK_FRACTION = {"cpu": 16}  # (accelerators: the budget alone; a block is a few kernels launched from the host)
MIN_BLOCK_COLUMNS = 4096  # ... unless that is fewer columns than this


def column_blocks(
    k: int, m: int, device: torch.device, budget: int | None = None, max_columns: int | None = None
) -> Iterator[slice]:
    """Slices of ``range(m)`` such that a ``k × block`` float64 buffer stays within ``budget`` elements (default:
    the device's, :data:`BLOCK_ELEMENTS`) and, on a CPU, for large tensors, small next to the ``[k, m]`` stack
    itself (:data:`BLOCK_FRACTION`; on a GPU each block costs launches, and the pfl-research-shaped round aggregated
    its CNN in 30 blocks of a few operations each); at most ``max_columns`` columns each when given. After
    each block is consumed, a disk-backed stack's pages go back to the kernel
    (:func:`fedskew.server.paging.release_pages`): iterate lazily (not ``list(...)``) for that to bound them."""
    if budget is None:
        budget = BLOCK_ELEMENTS.get(device.type, BLOCK_ELEMENTS_DEFAULT)
    budget //= max(k, 1)
    fraction = BLOCK_FRACTION.get(device.type)
    share = m if fraction is None else max(MIN_BLOCK_COLUMNS, -(-m // fraction))
    block = max(1, min(m, budget, share))
    if max_columns is not None:
        block = min(block, max_columns)
    for s in range(0, m, block):
        yield slice(s, min(s + block, m))
        release_pages()


def weighted_sums(x: Tensor, weights: Tensor, mask: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """``Σ_k w_k x_k`` over the rows of ``x`` (``[K, M]``, any float dtype) in float64, and with a boolean ``mask``
    (``[K, M]``) only over the kept entries, together with the kept weight ``Σ_k w_k m_k`` per column."""
    k, m = x.shape
    w = weights.to(device=x.device, dtype=torch.float64).reshape(-1)
    total = torch.empty(m, dtype=torch.float64, device=x.device)
    kept = None if mask is None else torch.empty(m, dtype=torch.float64, device=x.device)
    buf = None
    for cols in column_blocks(k, m, x.device):
        if buf is None:  # one reusable float64 block (the last one may be narrower)
            buf = torch.empty((k, cols.stop - cols.start), dtype=torch.float64, device=x.device)
        xb = buf[:, : cols.stop - cols.start]
        if mask is not None and kept is not None:
            mb = mask[:, cols]
            torch.mv(xb.copy_(mb).T, w, out=kept[cols])
            xb.copy_(x[:, cols]).masked_fill_(~mb, 0.0)  # (a multiply by the bool mask would convert it first)
        else:
            xb.copy_(x[:, cols])
        torch.mv(xb.T, w, out=total[cols])
    return total, kept


def weighted_mean(
    stacked: Tensor, weights: Tensor, mask: Tensor | None = None, fallback: Tensor | None = None
) -> Tensor:
    """Weighted mean over the client axis of ``stacked`` ([K, ...]), computed in float64 and cast back.

    With a boolean ``mask`` ([K, ...]) the weights are renormalized per element over the clients whose mask is True;
    elements that no client keeps take ``fallback`` (the broadcast value).
    """
    if mask is not None and fallback is None:
        raise ValueError("a masked mean needs the broadcast value for elements no client keeps")
    k, shape = stacked.shape[0], stacked.shape[1:]
    flat_mask = None if mask is None else mask.to(stacked.device).reshape(k, -1)
    total, kept = weighted_sums(stacked.reshape(k, -1), weights, flat_mask)
    if kept is not None and fallback is not None:
        some = kept > 0
        total = total.div_(torch.where(some, kept, torch.ones_like(kept)))
        total = torch.where(some, total, fallback.to(device=total.device, dtype=torch.float64).reshape(-1))
    return total.reshape(shape).to(stacked.dtype)


@dataclass(frozen=True)
class WeightedMean(Combine):
    """FedAvg's combine: a per-element weighted mean of every state-dict entry (integer buffers: max)."""

    def __call__(
        self, rin: RoundInput, weights: Tensor, masks: Params | None, state: State
    ) -> tuple[Params, Diagnostics, State]:
        out: Params = {}
        for name, stacked in rin.params.items():
            if not stacked.is_floating_point():
                out[name] = stacked.max(0).values
            else:
                mask = None if masks is None else masks.get(name)
                out[name] = weighted_mean(stacked, weights, mask, rin.global_params[name])
        return out, {}, state
