"""What personalized server steps share (one model per participant: FedCAC, FedAMP, in ``fedskew/catalog/``).

Each is a :class:`fedskew.server.api.ServerStrategy` objects built from small pure functions over the participants'
uploads stacked as ``[K, ...]`` tensors. The global model (what a newcomer would get, and the ``global_`` views) is
the weighted mean of the uploads under the composition's weighting (``weights=samples`` by default, ``uniform`` for
the papers' plain mean). Buffers (BatchNorm running statistics) stay each client's own: the server copies every
participant's uploaded buffers into its personalized model. Absent clients keep the model they have.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import NamedTuple

import torch
from torch import Tensor

from fedskew.protocol import Params, RoundInput, State
from fedskew.server.combine import column_blocks


def mix(
    a: Tensor,
    stacked: Tensor,
    out: Tensor | None = None,
    keep: Tensor | None = None,
    otherwise: Tensor | None = None,
) -> Tensor:
    """Row-mixing of client values: ``out[i] = Σ_j a[i, j] · stacked[j]`` in float64, cast back, block by block of
    columns (no ``K × M`` float64 copy). When ``a`` is the identity (nobody mixes: FedCAC after round ``beta``) every
    client keeps its own value, copied without the ``O(K² M)`` product (the same numbers: ``1 · x_i + Σ 0 · x_j`` is
    exact). Otherwise the whole product (a product over a subset of the rows would round differently on some BLAS,
    and the records would no longer match earlier runs').

    ``out``: where to write (``[K, ...]`` like ``stacked``, e.g. :meth:`RoundInput.empty`'s buffer beside a disk
    stack; default a new tensor). ``keep`` (boolean, ``[K, ...]``) with ``otherwise`` (one client's shape): the mix
    only where ``keep`` is set, ``otherwise`` elsewhere (FedCAC's ``M_i ⊙ u_i + (1 − M_i) ⊙ w̄``)."""
    k = stacked.shape[0]
    flat = stacked.reshape(k, -1)
    dest = torch.empty_like(flat) if out is None else out.reshape(k, -1)
    a64 = a.to(device=flat.device, dtype=torch.float64)
    identity = bool(torch.equal(a64, torch.eye(k, dtype=torch.float64, device=flat.device)))
    kept = None if keep is None else keep.reshape(k, -1)
    fallback = None if otherwise is None else otherwise.reshape(1, -1)
    for cols in column_blocks(k, flat.shape[1], flat.device):
        block = dest[:, cols]
        if identity:
            block.copy_(flat[:, cols])
        else:
            block.copy_((a64 @ flat[:, cols].to(torch.float64)).to(flat.dtype))
        if kept is not None and fallback is not None:
            block.copy_(torch.where(kept[:, cols], block, fallback[:, cols]))
    return dest.reshape(stacked.shape)


class PersonalModels(Mapping[int, Params]):
    """Per participant of a round: the given ``[K, ...]`` values for trainable tensors, its own upload for the others
    (buffers), as *views* of those ``[K, ...]`` tensors (no ``K`` copies at once, wherever the round's tensors live).
    A consumer that keeps a model beyond the round copies it (the round server writes each to the client-state
    store as it goes: :func:`fedskew.engine.state_store.keep_model`)."""

    def __init__(self, rin: RoundInput, trainable_values: Params) -> None:
        self._rows = {cid: k for k, cid in enumerate(rin.cids)}
        self._values = {n: trainable_values.get(n, t) for n, t in rin.params.items()}

    def __getitem__(self, cid: int) -> Params:
        k = self._rows[cid]
        return {n: t[k] for n, t in self._values.items()}

    def __iter__(self) -> Iterator[int]:
        return iter(self._rows)

    def __len__(self) -> int:
        return len(self._rows)


def personal_models(rin: RoundInput, trainable_values: Params) -> PersonalModels:
    """Per participant: the given ``[K, ...]`` values for trainable tensors, its own upload for buffers (views; see
    :class:`PersonalModels`)."""
    return PersonalModels(rin, trainable_values)


class PersonalState(NamedTuple):
    """A personalized server's state: its weighting's (for the global model it also computes)."""

    weighting: State = None
