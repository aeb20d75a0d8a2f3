"""Streaming aggregation: a weighted mean summed upload by upload, in memory O(model) instead of O(clients × model).

A composition whose server is ``weights → weighted mean → (a step that reads the combined model only)`` and whose
weight of an upload is known when it arrives (:meth:`~fedskew.server.api.Weighting.arrival_weight`: its sample count,
or 1) never needs two uploads at once: :class:`RunningSum` validates each upload as :class:`UploadStack` does, adds
``r_k θ_k`` to float64 sums (integer buffers: a running max, as :class:`~fedskew.server.combine.WeightedMean`
takes), sums the extras a private server half reads (SCAFFOLD's control deltas), and keeps the per-client scalars
(ids, sample counts, metrics). :meth:`fedskew.server.api.Aggregation.aggregate_sums` then divides by ``Σ r_k`` and
runs the server step. FedAvg, FedProx, MOON, SCAFFOLD, Ditto, FedDyn's client part with FedAvg's server, FedAvgM,
FedAdam, ... qualify; a server that reads the uploads one by one (FedSA's dispersion, FedHEAL's masks, FedCAC's
overlaps, FedDisco's weights renormalized over the round's participants) does not, and :func:`stream_refusal` says
why. The result equals the stacked path's up to float64 rounding (the sums are taken in another order).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from fedskew.protocol import Params, Rejection, Upload
from fedskew.server.api import NO_SERVER_HALF, Aggregation
from fedskew.server.combine import WeightedMean
from fedskew.server.uploads import check_upload

if TYPE_CHECKING:
    from fedskew.methods import Method


def sum_refusal(method: Method) -> str | None:
    """Why ``method``'s server is not a weighted sum of the uploads followed by a step that reads only that sum
    (``None``: it is): what streaming aggregation and user-level DP both need of a composition."""
    server = method.server
    if not isinstance(server, Aggregation):
        return "its server makes one model per client from the individual uploads"
    if server.masking is not None:
        return f"its server masks each client's update ({type(server.masking).__name__})"
    if type(server.combine) is not WeightedMean:
        return f"its server combines the individual updates ({type(server.combine).__name__}), not a weighted sum"
    if server.step is not None and server.step.individual:
        return f"its server step ({type(server.step).__name__}) reads the individual uploads, not only their sum"
    if method.calibration is not None:
        return "its evaluated model is calibrated on the clients' feature statistics"
    if method.server_half is not NO_SERVER_HALF and not method.server_half.private:
        return (
            f"its client part's server half ({type(method.server_half).__name__}) reads the individual uploads' "
            "extras, not only their sum"
        )
    return None


def stream_refusal(method: Method) -> str | None:
    """Why ``method``'s server cannot aggregate upload by upload (``None``: it can): a weighted sum
    (:func:`sum_refusal`) whose weight of an upload is known when it arrives."""
    why = sum_refusal(method)
    if why is None and method.server.weighting.arrival_weight(1.0) is None:  # type: ignore[attr-defined]
        weighting = type(method.server.weighting).__name__  # type: ignore[attr-defined]
        return f"its weights ({weighting}) depend on the whole round's uploads or reports, not on each upload alone"
    return why


def secure_refusal(method: Method) -> str | None:
    """Why ``method``'s server cannot take a round's uploads as one secure sum (``None``: it can): a weighted sum
    (:func:`sum_refusal`) whose weights the server knows before the clients train (:mod:`fedskew.flower.secagg`)."""
    why = sum_refusal(method)
    if why is None and not method.server.weighting.before_round:  # type: ignore[attr-defined]
        weighting = type(method.server.weighting).__name__  # type: ignore[attr-defined]
        return f"its weights ({weighting}) read the uploads, which the server would see only as their sum"
    return why


@dataclass
class RunningSum:
    """One round's uploads as running sums (see the module docstring). Same surface as
    :class:`~fedskew.server.uploads.UploadStack` for the round server: :meth:`add` returns the
    :class:`~fedskew.protocol.Rejection` of an invalid upload (not summed), ``count``, ``cids``, ``num_samples``,
    ``metrics``, ``rejected``."""

    global_params: Params
    weight_of: Callable[[float], float | None]  # the weighting's arrival_weight: sample count -> raw weight r_k
    cids: list[int] = field(default_factory=list)
    num_samples: list[float] = field(default_factory=list)
    metrics: list[dict[str, float]] = field(default_factory=list)
    rejected: list[Rejection] = field(default_factory=list)
    raw_weights: list[float] = field(default_factory=list)
    sums: Params = field(default_factory=dict)  # floating entries: Σ r_k θ_k (float64); integer ones: running max
    extra_sums: Params | None = None  # Σ_k extras_k (float64), from the first accepted upload's names
    extra_template: Params | None = None  # the first accepted upload's extras' shapes and dtypes (uninitialized)
    kind: str = "streaming"  # how the sums were taken, for the round's record (SecAgg+'s: "secagg+")

    @property
    def count(self) -> int:
        return len(self.cids)

    def add(self, upload: Upload, nonfinite_at: Sequence[int] | None = None) -> Rejection | None:
        """Validate ``upload`` and add it to the sums (``nonfinite_at``: :func:`check_upload`'s)."""
        bad = check_upload(upload, self.global_params, self.extra_template, nonfinite_at)
        if bad is not None:
            self.rejected.append(bad)
            return bad
        r = float(self.weight_of(float(upload.num_samples)))  # type: ignore[arg-type]
        first = not self.cids
        for n, g in self.global_params.items():
            t = upload.params[n]
            if not g.is_floating_point():
                self.sums[n] = t.clone() if first else torch.maximum(self.sums[n], t)
            elif first:
                self.sums[n] = t.to(torch.float64) * r
            else:  # float32 into the float64 sum in place: no float64 copy of the upload (the same bits)
                self.sums[n].add_(t, alpha=r)
        if self.extra_sums is None:
            self.extra_template = {n: torch.empty_like(t) for n, t in upload.extras.items()}
            self.extra_sums = {n: torch.zeros_like(t, dtype=torch.float64) for n, t in upload.extras.items()}
        for n, t in upload.extras.items():
            self.extra_sums[n].add_(t)
        self.cids.append(upload.cid)
        self.num_samples.append(float(upload.num_samples))
        self.raw_weights.append(r)
        self.metrics.append({k: float(v) for k, v in upload.metrics.items()})
        return None

    def weights(self) -> Tensor:
        """The uploads' normalized weights ``r_k / Σ r`` (``[K]`` float64), as the weighting gives them."""
        raw = torch.tensor(self.raw_weights, dtype=torch.float64)
        return raw / raw.sum()

    def mean(self) -> Params:
        """The weighted mean ``Σ r_k θ_k / Σ r_k`` of every floating entry, in each entry's dtype; integer entries
        the maximum over the uploads."""
        total = float(sum(self.raw_weights))
        if not total > 0:
            raise ValueError(f"the round's weights must have a positive sum, got {self.raw_weights}")
        return {
            n: (s / total).to(self.global_params[n].dtype) if self.global_params[n].is_floating_point() else s
            for n, s in self.sums.items()
        }

    def summed_extras(self) -> Params:
        """``Σ_k extras_k`` in each extra's dtype (what a private server half advances from)."""
        template = self.extra_template or {}
        return {n: s.to(template[n].dtype) for n, s in (self.extra_sums or {}).items()}
