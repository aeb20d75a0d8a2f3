"""Parameter-skew probes: what the clients uploaded at a few positions of every layer, next to the aggregates.

FedSA/FedPake's central observation is that client values of some parameters are dispersed and skewed, so the
plain mean lands where few clients are. On every evaluated round the engine records, per trainable tensor, the
fraction of high-dispersion positions under FedSA's rule (min-max normalized coefficient of variation > 0.2) and,
for the ``per_layer`` positions of largest cv plus ``per_layer`` fixed random positions, the K client values, their
uniform and sample-weighted means (FedAvg) and the value the method actually produced. ``fedskew skew RUN_DIR``
plots them (``skew.jsonl`` in the run directory). Method-agnostic: it works for FedAvg runs too.
"""

from __future__ import annotations

from typing import Any

import torch

from fedskew.protocol import Params, RoundInput
from fedskew.server.dispersion import column_stats, cv_of, high_dispersion

LAMBDA = 0.2


def skew_probe(rin: RoundInput, aggregate: Params, per_layer: int, seed: int) -> dict[str, Any]:
    """One round's probe record (JSON-serializable)."""
    k = rin.num_participants
    weights = (rin.num_samples / rin.num_samples.sum()).to(torch.float64)
    layers: dict[str, Any] = {}
    for li, name in enumerate(sorted(rin.trainable)):
        x = rin.params[name].reshape(k, -1)
        m = x.shape[1]
        stats = column_stats(x, weights=weights.to(x.device), want_skew=True)
        cv = cv_of(stats, 1e-12)
        high = high_dispersion(cv, LAMBDA)
        top = torch.topk(cv, min(per_layer, m)).indices.cpu()
        g = torch.Generator().manual_seed(seed * 1009 + li)
        rand = torch.randperm(m, generator=g)[:per_layer]
        pos = torch.unique(torch.cat([top, rand]))
        pos_dev = pos.to(x.device)
        layers[name] = {
            "M": m,
            "high_frac": float(high.double().mean()),
            "skew_mean_abs": float(stats.skew.abs().mean()),
            "positions": pos.tolist(),
            "high": high[pos_dev].tolist(),
            "cv": cv[pos_dev].tolist(),
            "clients": x[:, pos_dev].double().T.tolist(),  # [P][K]
            "mean": stats.mean[pos_dev].tolist(),
            "weighted_mean": stats.weighted_mean[pos_dev].tolist(),
            "aggregate": aggregate[name].reshape(-1)[pos_dev].double().tolist(),
        }
    return {"round": rin.round, "cids": list(rin.cids), "layers": layers}
