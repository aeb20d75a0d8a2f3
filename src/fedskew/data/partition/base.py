"""What every partition shares: :class:`PartitionError` and the argument checks and sampling helpers."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


class PartitionError(ValueError):
    """The partition is impossible or its bounded retries ran out; the message names the parameters."""


# ----------------------------------------------------------------------------------------------- helpers


def _fmt(**params: object) -> str:
    return "(" + ", ".join(f"{k}={v}" for k, v in params.items()) + ")"


def _as_labels(labels: np.ndarray | Sequence[int]) -> np.ndarray:
    y = np.asarray(labels)
    if y.ndim != 1:
        raise PartitionError(f"labels must be a 1-D array, got shape {y.shape}")
    if y.size == 0:
        raise PartitionError("labels is empty: nothing to partition")
    if not np.issubdtype(y.dtype, np.integer):
        if np.issubdtype(y.dtype, np.floating) and np.all(np.isfinite(y)) and np.all(y == np.round(y)):
            y = y.astype(np.int64)
        else:
            raise PartitionError(f"labels must be integers, got dtype {y.dtype}")
    if y.min() < 0:
        raise PartitionError(f"labels must be non-negative, got minimum {int(y.min())}")
    return y.astype(np.int64, copy=False)


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise PartitionError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise PartitionError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _check_positive(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        raise PartitionError(f"{name} must be a number, got {value!r}")
    v = float(value)
    if not math.isfinite(v) or v <= 0:
        raise PartitionError(f"{name} must be a finite number > 0, got {value!r}")
    return v


def _check_rng(rng: object) -> np.random.Generator:
    if not isinstance(rng, np.random.Generator):
        raise TypeError(f"rng must be a numpy.random.Generator (e.g. np.random.default_rng(seed)), got {type(rng)}")
    return rng


def _check_clients(n_samples: int, num_clients: object, per_client: int = 1) -> int:
    k = _check_int("num_clients", num_clients, 1)
    if k * per_client > n_samples:
        what = "more clients than samples" if per_client == 1 else "too few samples for the clients"
        raise PartitionError(f"{what}: {_fmt(n_samples=n_samples, n_clients=k, min_per_client=per_client)}")
    return k


def _dirichlet(rng: np.random.Generator, alpha: float, k: int, size: int | None = None) -> np.ndarray:
    """Dir(alpha * 1_k) draws; a degenerate draw (all-zero or NaN at tiny alpha) becomes a random one-hot."""
    p = rng.dirichlet(np.full(k, alpha), size)
    flat = p.reshape(-1, k)
    bad = ~np.isfinite(flat).all(axis=1) | (flat.sum(axis=1) <= 0)
    if bad.any():
        rows = np.flatnonzero(bad)
        flat[rows] = 0.0
        flat[rows, rng.integers(k, size=len(rows))] = 1.0
    return flat.reshape(p.shape)


def _apportion(weights: np.ndarray, total: int) -> np.ndarray:
    """Integer counts summing to ``total``, proportional to ``weights`` (largest-remainder rounding)."""
    w = np.asarray(weights, dtype=np.float64)
    s = w.sum()
    w = np.full(len(w), 1.0 / len(w)) if not np.isfinite(s) or s <= 0 else w / s
    raw = w * total
    base = np.floor(raw).astype(np.int64)
    rest = int(total - base.sum())
    if rest > 0:
        order = np.argsort(-(raw - base), kind="stable")
        base[order[:rest]] += 1
    return base


def _split_sizes(perm: np.ndarray, sizes: np.ndarray) -> list[np.ndarray]:
    cuts = np.cumsum(sizes)[:-1]
    return [np.sort(p).astype(np.int64) for p in np.split(perm, cuts)]


def _class_pools(y: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    """Sorted distinct classes, and each class's indices in pool order."""
    order = np.argsort(y, kind="stable")
    classes, starts = np.unique(y[order], return_index=True)
    return classes, np.split(order, starts[1:])


def _finish(parts: Sequence[Sequence[int] | np.ndarray]) -> list[np.ndarray]:
    return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]
