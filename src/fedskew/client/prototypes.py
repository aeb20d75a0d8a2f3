"""Client-side prototype collection, shared by the prototype methods (FedProto, FedProc, FPL).

A *prototype* is the mean body feature (``model.body(x)``, the input of the classifier head) of one class. A
:class:`PrototypeCollector` collects the client's local prototypes from the features of its **last local epoch**,
as the reference codes do (no extra pass: the ``loss`` hook sees the features anyway), and uploads them with the
model as extras: :data:`PROTO_MEAN` (``[C, D]``, zeros for a class it has no sample of) and :data:`PROTO_COUNT`
(``[C]``, samples behind each mean, so that a server can tell a missing class from a zero feature). What a method's
server half makes of them (a per-class average, FPL's clusters) and what it broadcasts back is the method's own; its
client reads the broadcast in :meth:`PrototypeCollector.prepare`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from fedskew.client.batched_form import ClassSums
from fedskew.client.local import LocalAlgorithm, LocalContext
from fedskew.protocol import Params

# the tensors a prototype client uploads
PROTO_MEAN = "proto/mean"  # upload: [C, D] the client's mean feature per class (0 where none)
PROTO_COUNT = "proto/count"  # upload: [C] the number of features behind each mean


def class_sums(features: Tensor, labels: Tensor, num_classes: int) -> tuple[Tensor, Tensor]:
    """Per-class sums of ``features`` (``[B, D]``) in float64 and the per-class counts (``[C]`` float64)."""
    sums = torch.zeros((num_classes, features.shape[1]), dtype=torch.float64, device=features.device)
    sums.index_add_(0, labels, features.detach().to(torch.float64))
    counts = torch.bincount(labels, minlength=num_classes).to(torch.float64)
    return sums, counts


@dataclass
class PrototypeRound:
    """What :meth:`PrototypeCollector.begin` prepares: the first local step of the last epoch, from which the class
    sums of the features are collected into ``sums`` ``[C, D]`` and ``counts`` ``[C]`` (float64; a
    :class:`~fedskew.client.batched_form.ClassSums`), and the received global prototypes with their presence
    (``None`` before the first)."""

    collect_from: int
    sums: Tensor | None = None
    counts: Tensor | None = None
    protos: tuple[Tensor, Tensor] | None = None


class PrototypeCollector(LocalAlgorithm):
    """Last-epoch prototype collection and its upload; a subclass defines the local objective (its ``loss`` calls
    :meth:`collect`) and reads what its server broadcasts in :meth:`prepare`."""

    def prepare(self, ctx: LocalContext, collect_from: int) -> PrototypeRound:
        """This round's prepared value (a :class:`PrototypeRound` or a subclass), with what the server broadcast."""
        return PrototypeRound(collect_from=collect_from)

    def begin(self, ctx: LocalContext) -> None:
        assert ctx.x is not None
        s = ctx.settings
        n = ctx.x.shape[0]
        _, per_epoch = s.batches(n)
        epochs = sum(p.epochs for p in self.phases(ctx))
        ctx.prepared = self.prepare(ctx, (epochs - 1) * per_epoch)  # the first step of the last epoch

    def collect(self, ctx: LocalContext, features: Tensor, y: Tensor, num_classes: int) -> None:
        """Add this batch's features to the local prototypes when it belongs to the last local epoch."""
        prep = ctx.prep(PrototypeRound)
        if ctx.steps < prep.collect_from:
            return
        sums, counts = class_sums(features, y, num_classes)
        if prep.sums is None or prep.counts is None:
            prep.sums, prep.counts = sums, counts
        else:
            prep.sums += sums
            prep.counts += counts

    def end(self, ctx: LocalContext) -> Params:
        prep = ctx.prep(PrototypeRound)
        sums, counts = prep.sums, prep.counts
        if sums is None or counts is None:  # no step in the last epoch (not with epochs >= 1; keeps the upload's shape)
            assert ctx.x is not None
            with torch.no_grad():
                out = ctx.model(ctx.x[:1])
                dim = ctx.model.body(ctx.x[:1]).shape[1]
            sums = torch.zeros((out.shape[1], dim), dtype=torch.float64, device=ctx.x.device)
            counts = torch.zeros(out.shape[1], dtype=torch.float64, device=ctx.x.device)
        means = sums / torch.where(counts > 0, counts, torch.ones_like(counts)).unsqueeze(1)
        return {PROTO_MEAN: means.to(torch.float32), PROTO_COUNT: counts.to(torch.float32)}


def collected_sums(ctx: LocalContext) -> ClassSums:
    """Where the batched path leaves a client's last-epoch class sums (``BatchedStep.collect``)."""
    return ctx.prep(PrototypeRound)
