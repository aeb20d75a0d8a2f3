"""FedLC and FedRS: client objectives that calibrate the logits by the client's own label counts.

Both count the labels of the client's training split once per round (in ``begin``; nothing about them travels) and
change the cross-entropy's logits, so that classes the client lacks are not pushed down by its local training:

* **FedLC** (Zhang, Li, Li, Wang, Liu, Wu, Ji, Federated Learning with Label Distribution Skew via Logits
  Calibration, ICML 2022): the calibrated cross-entropy ``CE(f(x) − τ·n^{−1/4}, y)``, ``n_c`` the client's count of
  class ``c``, clamped below at ``min_count = 1e-8`` (FL-bench's ``fedlc``, the public implementation: a class the
  client lacks gets the largest shift, ``τ·100``). Default ``τ = 1`` (FL-bench's), tuned over ``log[0.01, 10]``.
* **FedRS** (Li, Zhan, FedRS: Federated Learning with Restricted Softmax for Label Distribution Non-IID Data, KDD
  2021): the restricted softmax, ``CE(f(x) ⊙ s, y)`` with ``s_c = 1`` for the classes the client holds and ``α`` for
  the others (the logits of missing classes scaled down, so their classifier rows get smaller updates). ``α = 1`` is
  FedAvg; default ``α = 0.5``, tuned over ``[0, 1]``.

Both are client parts: they compose with every server plug-in (``fedlc+disco``, ``fedrs+fedadam``), not with
another client part's objective. Batched: each client's map of its logits is a
:class:`~fedskew.client.batched_form.LogitMap` (FedLC a shift, FedRS a scale), applied to its rows of the stacked
logits, so ``--batched-clients`` trains them together (and ``--capture-steps`` at one shape).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor

from fedskew.client.batched_form import BatchedStep, LogitMap
from fedskew.client.local import LocalAlgorithm, LocalContext
from fedskew.registry import ClientPart, ServerPlugin
from fedskew.schema import StrictSettings
from fedskew.space import Float, LogFloat


@dataclass
class LabelCounts:
    """What ``begin`` prepares: the client's training label counts ``[C]`` (float), counted at the first batch, when
    the number of classes (the logits' width) is known."""

    counts: Tensor | None = None

    def of(self, ctx: LocalContext, logits: Tensor) -> Tensor:
        return self.count(ctx, logits.shape[-1], logits.dtype)

    def count(self, ctx: LocalContext, num_classes: int, dtype: torch.dtype = torch.float32) -> Tensor:
        if self.counts is None:
            assert ctx.y is not None
            self.counts = torch.bincount(ctx.y, minlength=num_classes).to(dtype)
        return self.counts


class _Calibrated(LocalAlgorithm):
    def begin(self, ctx: LocalContext) -> None:
        ctx.prepared = LabelCounts()


def calibrated_logits(logits: Tensor, counts: Tensor, tau: float, min_count: float = 1e-8) -> Tensor:
    """FedLC's ``logits − τ·max(n, min_count)^{−1/4}`` (``counts``: ``[C]``)."""
    return logits - tau * counts.clamp_min(min_count).pow(-0.25)


def restricted_logits(logits: Tensor, counts: Tensor, alpha: float) -> Tensor:
    """FedRS's ``logits ⊙ s``, ``s_c = 1`` where the client holds class ``c``, else ``α``."""
    scale = torch.where(counts > 0, torch.ones_like(counts), torch.full_like(counts, alpha))
    return logits * scale


@dataclass
class FedLC(_Calibrated):
    """``CE(f(x) − τ·n^{−1/4}, y)`` on every local batch (module docstring)."""

    tau: float = 1.0
    min_count: float = 1e-8

    def loss(self, ctx: LocalContext, logits: Tensor, features: Tensor, y: Tensor, x: Tensor) -> Tensor:
        counts = ctx.prep(LabelCounts).of(ctx, logits)
        return F.cross_entropy(calibrated_logits(logits, counts, self.tau, self.min_count), y)

    def batched_step(self) -> BatchedStep:
        def shift(ctx: LocalContext, num_classes: int) -> LogitMap:  # logits + (−τ·n^{−1/4}) = logits − τ·n^{−1/4}
            counts = ctx.prep(LabelCounts).count(ctx, num_classes)
            return LogitMap(None, -(self.tau * counts.clamp_min(self.min_count).pow(-0.25)))

        return BatchedStep(logits=shift)


@dataclass
class FedRS(_Calibrated):
    """``CE(f(x) ⊙ s, y)``, ``s`` = 1 on the client's classes and ``α`` elsewhere (module docstring)."""

    alpha: float = 0.5

    def loss(self, ctx: LocalContext, logits: Tensor, features: Tensor, y: Tensor, x: Tensor) -> Tensor:
        counts = ctx.prep(LabelCounts).of(ctx, logits)
        return F.cross_entropy(restricted_logits(logits, counts, self.alpha), y)

    def batched_step(self) -> BatchedStep:
        def scale(ctx: LocalContext, num_classes: int) -> LogitMap:
            counts = ctx.prep(LabelCounts).count(ctx, num_classes)
            return LogitMap(torch.where(counts > 0, torch.ones_like(counts), torch.full_like(counts, self.alpha)), None)

        return BatchedStep(logits=scale)


# ---- registration ----------------------------------------------------------------------------------------------------
class FedLCParams(StrictSettings):
    tau: float = Field(1.0, ge=0)  # the calibration strength (0: FedAvg's cross-entropy)
    min_count: float = Field(1e-8, gt=0)  # the count a missing class is taken to have (FL-bench's clamp)


class FedRSParams(StrictSettings):
    alpha: float = Field(0.5, ge=0, le=1)  # the scale of a missing class's logit (1: FedAvg)


CLIENTS: dict[str, ClientPart] = {
    "fedlc": ClientPart(
        "fedlc",
        "logit calibration: CE(logits - tau * n_c^(-1/4), y) by the client's label counts (tau=1)",
        "Zhang, Li, Li, Wang, Liu, Wu, Ji, Federated Learning with Label Distribution Skew via Logits Calibration, "
        "ICML 2022",
        FedLCParams,
        lambda p: FedLC(tau=p.tau, min_count=p.min_count),
        tunable={"tau": LogFloat(0.01, 10.0)},
    ),
    "fedrs": ClientPart(
        "fedrs",
        "restricted softmax: the logits of classes the client lacks scaled by alpha (alpha=0.5)",
        "Li, Zhan, FedRS: Federated Learning with Restricted Softmax for Label Distribution Non-IID Data, KDD 2021",
        FedRSParams,
        lambda p: FedRS(alpha=p.alpha),
        tunable={"alpha": Float(0.0, 1.0)},
    ),
}
SERVER_PLUGINS: dict[str, ServerPlugin] = {}
