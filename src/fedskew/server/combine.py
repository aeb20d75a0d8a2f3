"""Combine rules: stacked client values -> one global state dict (see :class:`fedskew.server.api.Combine`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from fedskew.server.api import Params, RoundInput


def _expand(weights: Tensor, ndim: int) -> Tensor:
    return weights.reshape(-1, *([1] * (ndim - 1)))


def weighted_mean(
    stacked: Tensor, weights: Tensor, mask: Tensor | None = None, fallback: Tensor | None = None
) -> Tensor:
    """Weighted mean over the client axis of ``stacked`` ([K, ...]), computed in float64.

    With a boolean ``mask`` ([K, ...]) the weights are renormalized per element over the clients whose mask is True;
    elements that no client keeps take ``fallback`` (the broadcast value).
    """
    x = stacked.to(torch.float64)
    w = _expand(weights.to(device=x.device, dtype=torch.float64), x.ndim)
    if mask is None:
        out = (w * x).sum(0)
    else:
        wm = w * mask.to(device=x.device, dtype=torch.float64)
        denom = wm.sum(0)
        kept = denom > 0
        out = (wm * x).sum(0) / torch.where(kept, denom, torch.ones_like(denom))
        if fallback is None:
            raise ValueError("a masked mean needs the broadcast value for elements no client keeps")
        out = torch.where(kept, out, fallback.to(device=x.device, dtype=torch.float64))
    return out.to(stacked.dtype)


@dataclass(frozen=True)
class WeightedMean:
    """FedAvg's combine: a per-element weighted mean of every state-dict entry (integer buffers: max)."""

    def __call__(self, rin: RoundInput, weights: Tensor, masks: Params | None) -> tuple[Params, dict[str, Any]]:
        out: Params = {}
        for name, stacked in rin.params.items():
            if not stacked.is_floating_point():
                out[name] = stacked.max(0).values
            else:
                mask = None if masks is None else masks.get(name)
                out[name] = weighted_mean(stacked, weights, mask, rin.global_params[name])
        return out, {}
