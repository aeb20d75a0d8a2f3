"""A client method in one file: FedDecorr written as a client part of one's own, with its hyper-parameters, its
objective, its batched form and its registration, composed with FedDisco's server weighting and trained on the
batched path. (fedskew ships FedDecorr itself as the ``feddecorr`` plug-in, which adds the penalty to any client
part: ``fedprox+feddecorr``; this file shows how a user writes a method, and reuses the built-in penalty,
:func:`fedskew.catalog.feddecorr.decorrelation`.)

FedDecorr (Shi, Liang, Zhang, Tan, Bai, "Towards Understanding and Mitigating Dimensional Collapse in Heterogeneous
Federated Learning", ICLR 2023) adds to the cross-entropy ``beta`` times a decorrelation penalty on the body's
features of the batch: standardize each feature dimension over the batch (unbiased variance, eps 1e-8), take the
correlation matrix ``Z^T Z``, and penalize the mean square of its off-diagonal entries divided by the batch size (0
for a batch of one sample), as the official ``FedDecorrLoss``. Default ``beta = 0.1``; tune it on validation data
(``fedskew tune`` reads the range declared below).

Everything fedskew needs is here: the schema (``FedDecorrParams``), the client part (``FedDecorr``: its ``loss`` for
the sequential loop, its ``batched_step`` for the batched one, both from one function, ``decorrelation``, the
batched one a ``PaddedTerm`` over each client's real samples so that ``--capture-steps`` runs it too) and its
registration (``PART``). The engine is not touched: ``my_feddecorr``, ``my_feddecorr+disco`` and
``my_feddecorr+heal`` are method names as soon as this module is imported.

It prints, per method, the final accuracy on the sequential loop and how far the batched path's accuracy curve is
from it. For FedAvg that is 0; for FedDecorr at ``beta = 0.1`` it is not, and it is not the batched path's fault:
the penalty's ``1/sqrt(var + 1e-8)`` on nearly dead ReLU features amplifies float rounding, so the sequential loop
itself moves by 0.19 (max over the uploads' entries) when the model it receives moves by one ulp (measured on the
digits; 2.7e-6 at ``beta = 1e-3``). tests/test_one_file_method.py checks the two paths at ``beta = 1e-4``.

Run: python examples/one_file_method.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import functools
from dataclasses import dataclass

import torch.nn.functional as F
from pydantic import Field
from torch import Tensor

import fedskew
from fedskew.catalog.feddecorr import decorrelation
from fedskew.client.batched_form import BatchedStep, PaddedTerm
from fedskew.client.local import LocalAlgorithm, LocalContext
from fedskew.registry import CLIENTS
from fedskew.schema import StrictSettings
from fedskew.space import LogFloat


class FedDecorrParams(StrictSettings):
    beta: float = Field(0.1, ge=0)  # weight of the decorrelation penalty (0: plain local SGD)


@dataclass
class FedDecorr(LocalAlgorithm):
    """``CE + beta · decorrelation(body(x))`` on every local batch."""

    beta: float = 0.1

    def loss(self, ctx: LocalContext, logits: Tensor, features: Tensor, y: Tensor, x: Tensor) -> Tensor:
        ce = F.cross_entropy(logits, y)
        return ce if self.beta == 0 else ce + self.beta * decorrelation(features)

    def batched_step(self) -> BatchedStep:
        penalty = stacked_penalty(float(self.beta))
        # a PaddedTerm reads which samples of a padded batch are real, so --capture-steps runs it too
        return BatchedStep(term=lambda ctx: penalty, term_padded=True)


@functools.cache  # one function per beta: with --capture-steps every round replays the same CUDA graphs
def stacked_penalty(beta: float) -> PaddedTerm | None:
    """``beta · decorrelation`` of stacked clients' body features ``[K, B, D]`` -> ``[K]``, each client's over the
    real samples of its batch (``padding``: ``None``, all real, or the padded steps' weights and counts)."""
    if beta == 0:
        return None
    return PaddedTerm(lambda feats, logits, y, outs, padding: beta * decorrelation(feats, padding))


PART = fedskew.ClientPart(
    "my_feddecorr",
    "CE + beta * decorrelation of the batch's body features (beta=0.1)",
    "Shi et al., Towards Understanding and Mitigating Dimensional Collapse in Heterogeneous Federated Learning, "
    "ICLR 2023",
    FedDecorrParams,
    lambda p: FedDecorr(beta=p.beta),
    tunable={"beta": LogFloat(1e-3, 1.0)},
)
if PART.name not in CLIENTS:  # importing this module twice registers it once
    fedskew.register(PART)


def accuracies(result: fedskew.RunResult) -> list[float]:
    return [r["global_acc"] for r in result.records if "global_acc" in r]


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    settings = {"rounds": args.rounds, "clients": 6, "seed": 0, "threads": 1}
    for method in ("fedavg", "my_feddecorr", "my_feddecorr+disco"):
        seq = fedskew.run(method, **settings)
        bat = fedskew.run(method, **settings, batched_clients=True)
        gap = max(abs(a - b) for a, b in zip(accuracies(seq), accuracies(bat), strict=True))
        print(f"{method}: final global accuracy {accuracies(seq)[-1]:.4f}; batched path within {gap:.4f}")
