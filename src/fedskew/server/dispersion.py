"""Dispersion statistics of stacked client uploads: per position, over the client axis, the mean, the population
variance, the skewness, the coefficient of variation and the high-dispersion region it marks.

These are the statistics of FedSA/FedPake's parameter division (:mod:`fedskew.catalog.fedsa`, steps 1 and 2 of its
box; spec 1.3 and 1.5 A1, A2, section 7), which the engine's parameter-skew probe (:mod:`fedskew.engine.probe`)
also records for every method: pure functions over a ``K x M`` matrix, in float64, block by block of columns.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from fedskew.server.combine import column_blocks

CV_NORMS = ("minmax", "rank")
EPS = 1e-12


@dataclass(frozen=True)
class ColumnStats:
    """Per-position statistics of a ``K x M`` client matrix over the client axis (float64, length M)."""

    mean: Tensor  # exactly the common value on constant columns
    var: Tensor  # population variance (divisor K); exactly 0 on constant columns
    constant: Tensor  # bool: all K values equal (exact test, spec 7)
    skew: Tensor  # Fisher-Pearson g1 = m3 / m2^1.5 across clients; 0 where constant
    weighted_mean: Tensor | None = None  # sum_k w_k X_k when weights were given


CHUNK_ELEMENTS = 1 << 22  # float64 elements per column block on CPU (32 MiB): no full K x M float64 copy


def column_stats(X: Tensor, *, weights: Tensor | None = None, want_skew: bool = True) -> ColumnStats:
    """Mean, population variance, constancy, skewness (and a weighted mean) of every column of ``X``.

    ``X`` is ``K x M`` in any float dtype; the statistics are computed in float64 over blocks of columns
    (:func:`fedskew.server.combine.column_blocks`, one reused ``K x block`` float64 buffer pair), so no
    ``K x M`` float64 copy of a large layer is ever materialized.
    ``weights`` (``[K]``, already normalized) adds ``weighted_mean``.

    On constant columns (min == max, exactly) the means are the common value and the variance is 0 exactly
    (spec 7): a float mean of identical values can be an ulp off, which would leave squared deviations of
    ~1e-34 that a per-column normalization (``micro_norm='position_max'``) scales up to the top class.
    """
    if X.ndim != 2 or X.shape[0] < 1:
        raise ValueError(f"expected a K x M matrix with K >= 1, got shape {tuple(X.shape)}")
    k, m = X.shape
    dev_kw = {"dtype": torch.float64, "device": X.device}
    mean, var = torch.empty(m, **dev_kw), torch.empty(m, **dev_kw)
    m3 = torch.empty(m, **dev_kw) if want_skew else None
    lo, hi = torch.empty(m, dtype=X.dtype, device=X.device), torch.empty(m, dtype=X.dtype, device=X.device)
    wmean = None
    if weights is not None:
        wmean = torch.empty(m, **dev_kw)
        weights = torch.as_tensor(weights).to(**dev_kw).reshape(-1)
    buf = scratch = torch.empty(0, **dev_kw)
    # few, large kernels per block (each one is a parallel region on CPU); lazily, so a disk stack's pages go back
    for cols in column_blocks(k, m, X.device, CHUNK_ELEMENTS if X.device.type == "cpu" else None):
        s, e = cols.start, cols.stop
        if not buf.numel():  # one reused buffer pair, the first block's width (the last one may be narrower)
            buf, scratch = torch.empty((k, e - s), **dev_kw), torch.empty((k, e - s), **dev_kw)
        xb = X[:, s:e]
        torch.amax(xb, 0, out=hi[s:e])
        torch.amin(xb, 0, out=lo[s:e])
        d = buf[:, : e - s]
        d.copy_(xb)
        if wmean is not None:
            torch.mv(d.T, weights, out=wmean[s:e])
        mu = torch.mean(d, 0, out=mean[s:e])
        d.sub_(mu)
        q = torch.mul(d, d, out=scratch[:, : e - s])
        torch.mean(q, 0, out=var[s:e])
        if m3 is not None:
            torch.mean(q.mul_(d), 0, out=m3[s:e])
    constant = lo == hi
    if bool(constant.any()):  # O(M) fix-up; the common value is exact in float64
        common = lo.to(torch.float64)
        mean = torch.where(constant, common, mean)
        var = var.masked_fill(constant, 0.0)
        if wmean is not None:
            wmean = torch.where(constant, common, wmean)
    if m3 is None:
        skew = torch.zeros(m, **dev_kw)
    else:
        denom = var.pow(1.5)
        ok = ~constant & (denom > 0)
        skew = torch.where(ok, m3 / torch.where(ok, denom, torch.ones_like(denom)), 0.0)
    return ColumnStats(mean, var, constant, skew, wmean)


def coefficient_of_variation(X: Tensor, eps: float = EPS) -> Tensor:
    """Per-column cv of ``X`` (``K x M``): ``sigma / max(|mu|, eps)``; exactly 0 on constant columns.

    Spec 1.5 A1 and section 7.
    """
    return cv_of(column_stats(torch.as_tensor(X), want_skew=False), eps)


def cv_of(stats: ColumnStats, eps: float = EPS) -> Tensor:
    """The cv of :func:`column_stats`' statistics (:func:`coefficient_of_variation`)."""
    cv = stats.var.sqrt() / stats.mean.abs().clamp_min(eps)
    return torch.where(stats.constant, torch.zeros_like(cv), cv)


def high_dispersion(cv: Tensor, lam: float, cv_norm: str = "minmax") -> Tensor:
    """Bool mask of the high-dispersion positions ``r^h`` (spec 1.3 step 2.4; ``rank``: spec 7 / A2).

    ``minmax``: ``z = (cv - min) / (max - min) > lam``. ``rank``: ``z = r / (M - 1) > lam`` with 0-based
    ranks of a stable ascending sort (ties by position). Empty when ``max cv == min cv`` (includes ``M = 1``).
    """
    if cv_norm not in CV_NORMS:
        raise ValueError(f"unknown cv_norm {cv_norm!r}; expected one of {CV_NORMS}")
    cv = torch.as_tensor(cv, dtype=torch.float64)
    m = cv.numel()
    empty = torch.zeros(m, dtype=torch.bool, device=cv.device)
    if m < 2:
        return empty
    cmin, cmax = torch.aminmax(cv)
    span = float(cmax - cmin)
    if not span > 0:
        return empty
    if cv_norm == "minmax":
        z = (cv - cmin) / span
    else:
        order = torch.sort(cv, stable=True).indices
        ranks = torch.empty(m, dtype=torch.float64, device=cv.device)
        ranks[order] = torch.arange(m, dtype=torch.float64, device=cv.device)
        z = ranks / (m - 1)
    return z > lam
