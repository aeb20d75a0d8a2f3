"""Per-client train/test splitting, and the label histograms that check a partition."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from fedskew.data.partition.base import PartitionError, _check_int, _check_positive, _check_rng


def train_test_split_clients(
    parts: Sequence[np.ndarray],
    ratio: float = 0.75,
    rng: np.random.Generator | None = None,
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per-client random train/test split (PFLlib: 75/25 of each client's samples, not stratified).

    A client of n samples gets ``floor(ratio * n)`` train samples (sklearn's rounding), clipped so that it
    keeps >= 1 train and >= 1 test sample; a client with fewer than 2 samples is an error naming it. ``rng``
    is required.
    """
    if rng is None:
        raise TypeError("train_test_split_clients needs rng (a seeded numpy.random.Generator)")
    _check_rng(rng)
    r = _check_positive("ratio", ratio)
    if r >= 1:
        raise PartitionError(f"ratio (train share) must be in (0, 1), got {ratio}")
    train, test = [], []
    for cid, part in enumerate(parts):
        idx = np.asarray(part, dtype=np.int64)
        n = len(idx)
        if n < 2:
            raise PartitionError(f"client {cid} has {n} sample(s); a train/test split needs at least 2")
        n_train = min(max(int(math.floor(r * n + 1e-9)), 1), n - 1)
        perm = rng.permutation(idx)
        train.append(np.sort(perm[:n_train]))
        test.append(np.sort(perm[n_train:]))
    return train, test


def label_histograms(labels: np.ndarray | Sequence[int], parts: Sequence[np.ndarray], num_classes: int) -> np.ndarray:
    """Per-client label counts, int64 array [num_clients, num_classes]."""
    y = np.asarray(labels).astype(np.int64, copy=False)
    c = _check_int("num_classes", num_classes, 1)
    if y.size and (y.min() < 0 or y.max() >= c):
        raise PartitionError(f"labels must lie in [0, {c}), got range [{int(y.min())}, {int(y.max())}]")
    out = np.zeros((len(parts), c), dtype=np.int64)
    for i, p in enumerate(parts):
        out[i] = np.bincount(y[np.asarray(p, dtype=np.int64)], minlength=c)
    return out
