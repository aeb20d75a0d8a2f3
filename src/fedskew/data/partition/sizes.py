"""Partitions that skew sizes or sources rather than labels: the IID split, quantity skew (sizes ~ Dir(beta)),
the global long tail, and FedHEAL's domain skew."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np

from fedskew.data.partition.base import (
    PartitionError,
    _apportion,
    _as_labels,
    _check_clients,
    _check_int,
    _check_positive,
    _check_rng,
    _class_pools,
    _dirichlet,
    _fmt,
    _split_sizes,
)


def iid(
    labels: np.ndarray | Sequence[int],
    num_clients: int,
    rng: np.random.Generator,
    *,
    balanced: bool = True,
    sigma: float = 1.0,
) -> list[np.ndarray]:
    """IID split: a random permutation cut into ``num_clients`` disjoint pieces covering every sample.

    ``balanced=True``: sizes differ by at most one. ``balanced=False``: sizes proportional to LogNormal(0,
    sigma) draws (the "unbalanced IID" of FedLab / LEAF-style quantity variation), every client keeping >= 1
    sample.
    """
    y = _as_labels(labels)
    n = len(y)
    k = _check_clients(n, num_clients)
    _check_rng(rng)
    perm = rng.permutation(n)
    if balanced:
        sizes = np.full(k, n // k, dtype=np.int64)
        sizes[: n % k] += 1
    else:
        _check_positive("sigma", sigma)
        sizes = 1 + _apportion(rng.lognormal(0.0, sigma, size=k), n - k)
    return _split_sizes(perm, sizes)


def quantity_skew(
    labels: np.ndarray | Sequence[int],
    num_clients: int,
    rng: np.random.Generator,
    *,
    beta: float,
    min_size: int = 1,
    rule: Literal["shift", "niid-bench"] = "shift",
    max_retries: int = 1000,
) -> list[np.ndarray]:
    """Quantity skew (NIID-Bench): label-IID shards whose sizes follow Dir(beta); covers every sample.

    ``rule="shift"``: each client first gets ``min_size`` samples, the rest is apportioned by q ~ Dir(beta * 1_K)
    (it never retries and cannot fail). ``rule="niid-bench"``: NIID-Bench's ``iid-diff-quantity``: q ~ Dir(beta)
    is redrawn until every ``q_j * N >= min_size`` (NIID-Bench: 10), then a permutation of the samples is cut at
    ``int(cumsum(q) * N)``; at most ``max_retries`` draws (NIID-Bench loops forever), then :class:`PartitionError`.
    """
    y = _as_labels(labels)
    n = len(y)
    b = _check_positive("beta", beta)
    m = _check_int("min_size", min_size, 0)
    k = _check_clients(n, num_clients, max(m, 1))
    _check_rng(rng)
    perm = rng.permutation(n)
    if rule == "niid-bench":
        retries = _check_int("max_retries", max_retries, 1)
        for _ in range(retries):
            q = _dirichlet(rng, b, k)
            q = q / q.sum()
            if np.min(q * n) >= m:
                return _split_sizes(perm, np.diff((np.cumsum(q) * n).astype(np.int64)[:-1], prepend=0, append=n))
        raise PartitionError(
            f"quantity (niid-bench): no Dir(beta) draw gave every client >= min_size samples "
            f"{_fmt(n_samples=n, n_clients=k, beta=b, min_size=m, retries=retries)}; raise beta or lower min_size"
        )
    if rule != "shift":
        raise PartitionError(f"unknown quantity rule {rule!r}; use 'shift' or 'niid-bench'")
    sizes = m + _apportion(_dirichlet(rng, b, k), n - k * m)
    if m == 0:  # still never hand out an empty client: move one sample from the largest
        for i in np.flatnonzero(sizes == 0):
            sizes[np.argmax(sizes)] -= 1
            sizes[i] += 1
    return _split_sizes(perm, sizes)


def long_tail(
    labels: np.ndarray | Sequence[int],
    imbalance_ratio: float,
    rng: np.random.Generator,
    *,
    n_max: int | None = None,
) -> np.ndarray:
    """Long-tailed subset (CIFAR-10-LT style): sorted indices keeping n_max * ratio^(-r/(C-1)) of class c.

    r is the class's rank in sorted label order: the smallest label is the head (n_max samples), the largest
    the tail (n_max / ratio). ``n_max`` defaults to the largest value every class can supply. Samples within a
    class are chosen at random. Partition the result with any scheme (index it into the labels first).
    """
    y = _as_labels(labels)
    ratio = _check_positive("imbalance_ratio", imbalance_ratio)
    if ratio < 1:
        raise PartitionError(f"imbalance_ratio must be >= 1 (head/tail size ratio), got {imbalance_ratio}")
    _check_rng(rng)
    classes, pools = _class_pools(y)
    c = len(classes)
    factors = ratio ** (-np.arange(c) / (c - 1)) if c > 1 else np.ones(1)
    avail = np.array([len(p) for p in pools], dtype=np.float64)
    top = int(np.floor(np.min(avail / factors) + 1e-9)) if n_max is None else _check_int("n_max", n_max, 1)
    want = np.maximum(1, np.floor(top * factors + 1e-9).astype(np.int64))
    if (want > avail).any():
        r = int(np.argmax(want > avail))
        raise PartitionError(
            f"long_tail: class {int(classes[r])} needs {int(want[r])} samples but has {int(avail[r])} "
            f"{_fmt(n_max=top, imbalance_ratio=ratio)}"
        )
    chosen = [rng.choice(pool, size=int(w), replace=False) for pool, w in zip(pools, want, strict=True)]
    return np.sort(np.concatenate(chosen)).astype(np.int64)


def domain_skew(
    domain_sizes: Sequence[int],
    clients_per_domain: Sequence[int],
    fraction: float,
    rng: np.random.Generator,
    *,
    labels: Sequence[np.ndarray] | None = None,
) -> list[tuple[int, np.ndarray]]:
    """Domain skew (FedHEAL): each client of domain d gets a random ``fraction`` of d's training set.

    Client size is ``int(fraction * domain_size)`` (1% of MNIST = 600, of USPS = 72); clients of one domain
    are disjoint (requires ``clients_per_domain[d] * fraction <= 1``). Returns ``(domain, indices)`` pairs,
    domain by domain, indices into that domain's own training set. With ``labels`` (one label array per
    domain), each client is repaired so that it holds every class of its domain, by swapping in unused samples
    of the missing classes (FedHEAL does this for Office-Caltech); impossible repairs raise
    :class:`PartitionError`.
    """
    sizes = [_check_int("domain_sizes[]", s, 1) for s in domain_sizes]
    counts = [_check_int("clients_per_domain[]", c, 0) for c in clients_per_domain]
    if len(sizes) != len(counts):
        raise PartitionError(f"{len(sizes)} domain sizes but {len(counts)} clients_per_domain entries")
    f = _check_positive("fraction", fraction)
    if f > 1:
        raise PartitionError(f"fraction must be in (0, 1], got {fraction}")
    if labels is not None and len(labels) != len(sizes):
        raise PartitionError(f"labels must hold one array per domain ({len(sizes)}), got {len(labels)}")
    _check_rng(rng)
    out: list[tuple[int, np.ndarray]] = []
    for d, (size, count) in enumerate(zip(sizes, counts, strict=True)):
        params = _fmt(domain=d, domain_size=size, clients=count, fraction=f)
        if count * f > 1 + 1e-9:
            raise PartitionError(f"domain_skew: clients_per_domain * fraction > 1, clients cannot be disjoint {params}")
        m = int(f * size + 1e-9)
        if count and m < 1:
            raise PartitionError(f"domain_skew: fraction of the domain is below one sample {params}")
        perm = rng.permutation(size)
        chunks = [perm[j * m : (j + 1) * m].copy() for j in range(count)]
        if labels is not None and count:
            y = _as_labels(labels[d])
            if len(y) != size:
                raise PartitionError(f"domain_skew: labels[{d}] has {len(y)} entries, domain size is {size}")
            _repair_classes(chunks, list(perm[count * m :]), y, rng, params)
        out += [(d, np.sort(c).astype(np.int64)) for c in chunks]
    return out


def _repair_classes(
    chunks: list[np.ndarray], unused: list[int], y: np.ndarray, rng: np.random.Generator, params: str
) -> None:
    classes = np.unique(y)
    for j, chunk in enumerate(chunks):
        if len(chunk) < len(classes):
            raise PartitionError(
                f"domain_skew: a client of {len(chunk)} samples cannot hold {len(classes)} classes {params}"
            )
        for c in np.setdiff1d(classes, y[chunk]):
            spare = [i for i, s in enumerate(unused) if y[s] == c]
            if not spare:
                raise PartitionError(f"domain_skew: no unused sample of class {int(c)} left for client {j} {params}")
            pick = spare[int(rng.integers(len(spare)))]
            vals, cnt = np.unique(y[chunk], return_counts=True)
            big = vals[np.argmax(cnt)]  # most frequent class: it keeps >= 1 sample after the swap
            pos = np.flatnonzero(y[chunk] == big)
            out_pos = int(pos[int(rng.integers(len(pos)))])
            unused[pick], chunk[out_pos] = int(chunk[out_pos]), unused[pick]
