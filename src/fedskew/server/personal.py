"""What personalized server steps share (one model per participant: FedCAC, FedAMP, in ``fedskew/catalog/``).

Each is a :class:`fedskew.server.api.ServerStrategy` objects built from small pure functions over the participants'
uploads stacked as ``[K, ...]`` tensors. The global model (what a newcomer would get, and the ``global_`` views) is
the weighted mean of the uploads under the composition's weighting (``weights=samples`` by default, ``uniform`` for
the papers' plain mean). Buffers (BatchNorm running statistics) stay each client's own: the server copies every
participant's uploaded buffers into its personalized model. Absent clients keep the model they have.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from fedskew.protocol import Params, RoundInput, State
from fedskew.server.combine import column_blocks


def mix(a: Tensor, stacked: Tensor) -> Tensor:
    """Row-mixing of client values: ``out[i] = Σ_j a[i, j] · stacked[j]`` in float64 (block by block of columns,
    no ``K × M`` float64 copy), cast back."""
    k = stacked.shape[0]
    flat = stacked.reshape(k, -1)
    a64 = a.to(device=flat.device, dtype=torch.float64)
    out = torch.empty_like(flat)
    for cols in column_blocks(k, flat.shape[1], flat.device):
        out[:, cols] = a64 @ flat[:, cols].to(torch.float64)
    return out.reshape(stacked.shape)


def personal_models(rin: RoundInput, trainable_values: Params) -> dict[int, Params]:
    """Per participant: the given ``[K, ...]`` values for trainable tensors, its own upload for buffers. Each row is
    a copy, so a client's model does not keep the round's ``[K, ...]`` tensors (and uploads) alive."""
    out: dict[int, Params] = {}
    for k, cid in enumerate(rin.cids):
        out[cid] = {
            n: (trainable_values[n][k] if n in trainable_values else t[k]).clone() for n, t in rin.params.items()
        }
    return out


class PersonalState(NamedTuple):
    """A personalized server's state: its weighting's (for the global model it also computes)."""

    weighting: State = None
