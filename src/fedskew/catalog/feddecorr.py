"""FedDecorr (Shi, Liang, Zhang, Tan, Bai, "Towards Understanding and Mitigating Dimensional Collapse in
Heterogeneous Federated Learning", ICLR 2023): a decorrelation penalty added to any client's objective.

On every local batch the client adds ``β · L_decorr`` to its own loss, where ``L_decorr`` is computed on the body's
features ``z`` of the batch (``B`` samples, ``D`` dimensions), as the official ``FedDecorrLoss``: standardize each
dimension over the batch (mean 0, unbiased variance, ``z / √(var + 1e-8)``), take ``K = zᵀz``, and
``L_decorr = mean over the D(D − 1) off-diagonal entries of K², divided by B`` (0 for a batch of one sample). The
paper uses it on FedAvg, FedProx, MOON, FedAvgM, FedNova...: here it is the ``feddecorr`` plug-in
(:mod:`fedskew.client.terms`), so ``feddecorr`` is FedAvg + the penalty and ``fedprox+feddecorr``,
``scaffold+feddecorr``, ``feddecorr+disco`` are compositions. Default ``β = 0.1`` (the official code's CIFAR-10
value; the paper tunes ``β ∈ {0.01, 0.05, 0.1, ...}``), tuned over ``log[1e-3, 1]``.

Batched wherever the host is (the penalty reads the trained body's output only), except on a host whose own term is
masked per client (MOON: no contrastive term at a client's first participation). At ``β = 0.1`` the penalty's
``1/√(var + 1e-8)`` on nearly dead ReLU features amplifies float rounding: the batched path agrees with the sequential
one as closely as the sequential loop agrees with itself under a one-ulp change of its input (examples/
one_file_method.py measures it); tests compare the two at small β.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from pydantic import Field
from torch import Tensor

from fedskew.client.batched_form import FrozenTermFn
from fedskew.client.local import LocalContext
from fedskew.client.terms import LossTerm, with_term
from fedskew.registry import ClientPart, ServerPlugin
from fedskew.schema import StrictSettings
from fedskew.space import LogFloat

EPS = 1e-8  # the official FedDecorrLoss's


def decorrelation(features: Tensor) -> Tensor:
    """FedDecorr's penalty of features ``[..., B, D]`` (one batch per leading index) → ``[...]``."""
    b, d = features.shape[-2], features.shape[-1]
    if b == 1:
        return features.new_zeros(features.shape[:-2])
    z = features - features.mean(dim=-2, keepdim=True)
    z = z / torch.sqrt(EPS + z.var(dim=-2, keepdim=True))
    corr = z.transpose(-1, -2) @ z  # [..., D, D]
    off = ~torch.eye(d, dtype=torch.bool, device=features.device)
    return corr[..., off].pow(2).mean(-1) / b


@dataclass(frozen=True)
class Decorrelation(LossTerm):
    """``β · decorrelation(body(x))`` on the batch (flattened to ``[B, D]``)."""

    beta: float = 0.1

    @property
    def active(self) -> bool:  # type: ignore[override]
        return self.beta != 0

    def __call__(self, ctx: LocalContext, logits: Tensor, features: Tensor, y: Tensor, x: Tensor) -> Tensor:
        return self.beta * decorrelation(features.flatten(1))

    def batched(self) -> FrozenTermFn:
        beta = float(self.beta)
        return lambda feats, logits, y, outs: beta * decorrelation(feats.flatten(2))  # [K, B, D] -> [K]


# ---- registration ----------------------------------------------------------------------------------------------------
class FedDecorrParams(StrictSettings):
    beta: float = Field(0.1, ge=0)  # the penalty's weight (0: the host's objective, bit for bit)


CLIENTS: dict[str, ClientPart] = {}
SERVER_PLUGINS: dict[str, ServerPlugin] = {
    "feddecorr": ServerPlugin(
        "feddecorr",
        "client term: + beta * decorrelation of the batch's body features, on any client part (beta=0.1)",
        "Shi, Liang, Zhang, Tan, Bai, Towards Understanding and Mitigating Dimensional Collapse in Heterogeneous "
        "Federated Learning, ICLR 2023",
        FedDecorrParams,
        (),
        lambda p: {"wrap_client": with_term(Decorrelation(beta=p.beta))},
        tunable={"beta": LogFloat(1e-3, 1.0)},
    ),
}
