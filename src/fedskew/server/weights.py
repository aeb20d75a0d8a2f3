"""Client weightings: ``[K]`` float64 weights summing to 1 (see :class:`fedskew.server.api.Weighting`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from fedskew.protocol import Params, RoundInput, ServerContext, State
from fedskew.server.api import PrivateWeights, Weighting


def normalize(raw: Tensor) -> Tensor:
    """Scale non-negative weights to sum to 1."""
    total = raw.sum()
    if not bool(total > 0):
        raise ValueError(f"weights must have a positive sum, got {raw.tolist()}")
    return raw / total


@dataclass(frozen=True)
class SampleWeights(Weighting):
    """FedAvg's weights: each participant's share of the round's training samples."""

    before_round = True

    def __call__(self, rin: RoundInput, masks: Params | None, state: State) -> tuple[Tensor, State]:
        return normalize(rin.num_samples.to(torch.float64)), state

    def arrival_weight(self, num_samples: float) -> float | None:
        return num_samples

    def private_refusal(self) -> str | None:
        return None

    def private(self, ctx: ServerContext, report_noise: float | None) -> PrivateWeights:
        """Each client's training sample count (what the server knows of every client)."""
        return PrivateWeights(np.asarray(ctx.num_train, dtype=np.float64), "samples")


@dataclass(frozen=True)
class UniformWeights(Weighting):
    """Unweighted averaging: 1/K each (the control for every re-weighting method)."""

    before_round = True

    def __call__(self, rin: RoundInput, masks: Params | None, state: State) -> tuple[Tensor, State]:
        k = rin.num_participants
        return torch.full((k,), 1.0 / k, dtype=torch.float64), state

    def arrival_weight(self, num_samples: float) -> float | None:
        return 1.0

    def private_refusal(self) -> str | None:
        return None

    def private(self, ctx: ServerContext, report_noise: float | None) -> PrivateWeights:
        return PrivateWeights(np.ones(ctx.num_clients), "uniform")
