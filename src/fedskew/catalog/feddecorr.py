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
masked per client (MOON: no contrastive term at a client's first participation) and a host whose step is a direction
through inner steps (Per-FedAvg, pFedMe: the sequential loop adds the penalty's gradient at ``w`` to it). Its batched
form is a :class:`~fedskew.client.batched_form.PaddedTerm`: over a padded batch each client's penalty covers its real
samples only, so it runs at captured shapes (``--capture-steps``) too, alone or beside a per-sample host term (FedNTD,
FedProto), with which it is summed into one such term (:func:`fedskew.client.terms.summed_term`). At ``β = 0.1`` the
penalty's ``1/√(var + 1e-8)`` on nearly dead ReLU features amplifies float rounding: the batched path agrees with the
sequential one as closely as the sequential loop agrees with itself under a one-ulp change of its input (examples/
one_file_method.py measures it); tests compare the two at small β.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from pydantic import Field
from torch import Tensor

from fedskew.client.batched_form import PaddedTerm, Padding
from fedskew.client.local import LocalContext
from fedskew.client.terms import LossTerm, with_term
from fedskew.registry import ClientPart, ServerPlugin
from fedskew.schema import StrictSettings
from fedskew.space import LogFloat

EPS = 1e-8  # the official FedDecorrLoss's


def decorrelation(features: Tensor, padding: Padding = None) -> Tensor:
    """FedDecorr's penalty of features ``[..., B, D]`` (one batch per leading index) → ``[...]``. ``padding``: for
    features ``[K, B, D]`` of padded batches, ``(weights [K, B], counts [K])``: each client's penalty over its real
    samples only, as the sequential loop computes it on the unpadded batch (0 for a client with one sample or none)."""
    b, d = features.shape[-2], features.shape[-1]
    off = ~torch.eye(d, dtype=torch.bool, device=features.device)
    if padding is None:
        if b == 1:
            return features.new_zeros(features.shape[:-2])
        z = features - features.mean(dim=-2, keepdim=True)
        z = z / torch.sqrt(EPS + z.var(dim=-2, keepdim=True))
        corr = z.transpose(-1, -2) @ z  # [..., D, D]
        return corr[..., off].pow(2).mean(-1) / b
    weights, counts = padding
    n = counts.to(features.dtype).view(-1, 1, 1)  # [K, 1, 1]
    real = (weights > 0).unsqueeze(-1)  # [K, B, 1]: a padding slot is selected out (its features are any sample's)
    zero = torch.zeros((), dtype=features.dtype, device=features.device)
    mean = torch.where(real, features, zero).sum(-2, keepdim=True) / n.clamp(min=1)
    z = torch.where(real, features - mean, zero)
    z = z / torch.sqrt(EPS + z.pow(2).sum(-2, keepdim=True) / (n - 1).clamp(min=1))  # the unbiased variance
    corr = z.transpose(-1, -2) @ z
    value = corr[..., off].pow(2).mean(-1) / n.view(-1).clamp(min=1)
    return torch.where(counts > 1, value, zero)


@functools.cache
def padded_decorrelation(beta: float) -> PaddedTerm:
    """``β · decorrelation`` of the stacked clients' body features over their real samples, one function per ``β``
    (every round replays the same captured graphs)."""
    return PaddedTerm(lambda feats, logits, y, outs, padding: beta * decorrelation(feats.flatten(2), padding))


@dataclass(frozen=True)
class Decorrelation(LossTerm):
    """``β · decorrelation(body(x))`` on the batch (flattened to ``[B, D]``)."""

    beta: float = 0.1

    @property
    def active(self) -> bool:  # type: ignore[override]
        return self.beta != 0

    def __call__(self, ctx: LocalContext, logits: Tensor, features: Tensor, y: Tensor, x: Tensor) -> Tensor:
        return self.beta * decorrelation(features.flatten(1))

    def batched(self) -> PaddedTerm:
        return padded_decorrelation(float(self.beta))  # [K, B, D] -> [K], over each batch's real samples


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
