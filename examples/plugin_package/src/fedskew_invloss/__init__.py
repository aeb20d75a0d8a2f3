"""Example fedskew plug-in package: a server weighting ∝ (local training loss)^(-power) and a partition scheme (label
shards), each installed through an entry point."""

import numpy as np
import torch
from pydantic import Field

from fedskew.registry import ServerPlugin
from fedskew.schema import StrictSettings
from fedskew.server.api import Weighting


class InvLossParams(StrictSettings):
    power: float = Field(1.0, ge=0)  # -m power=2: sharper preference for low-loss clients


class InverseLossWeights(Weighting):
    """weights_k ∝ loss_k^(-power), normalized; stateless (``Weighting``'s default ``init`` returns ``None``)."""

    def __init__(self, power: float) -> None:
        self.power = power

    def __call__(self, rin, masks, state):
        w = rin.metrics["train_loss"].clamp_min(1e-8).pow(-self.power)
        return (w / w.sum()).to(torch.float64), None


PLUGIN = ServerPlugin(
    name="invloss_pkg",
    summary="weights ∝ local training loss^(-power) (power=1)",
    paper="fedskew example plug-in (examples/plugin_package)",
    params=InvLossParams,
    roles=("weighting",),
    build=lambda p: {"weighting": InverseLossWeights(p.power)},
)


def shards(labels, num_clients, rng, *, per_client=2):
    """label shards: the samples sorted by label, cut into num_clients * per_client shards, per_client random shards
    per client (McMahan et al.'s pathological non-IID split)"""
    order = np.argsort(np.asarray(labels), kind="stable")
    pieces = np.array_split(order, num_clients * per_client)
    drawn = rng.permutation(len(pieces))
    return [
        np.concatenate([pieces[j] for j in drawn[c * per_client : (c + 1) * per_client]]) for c in range(num_clients)
    ]
