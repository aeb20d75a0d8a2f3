"""Client partitions of a labelled pool: which sample indices each client holds.

Every function takes an explicit, seeded :class:`numpy.random.Generator` and never touches global RNG state.
Partitions are returned as ``list[np.ndarray]`` of int64 indices into the pool, sorted within each client.
No function can loop forever: retry loops are bounded and end in :class:`PartitionError`, whose message names
the parameters (n_samples, n_clients, alpha, min_size, retries ...) so the caller can see what to change.

Schemes and where they come from:

- :func:`iid` -- uniform random split (every FL paper's IID baseline).
- :func:`quantity_skew` -- label-IID, sizes ~ Dir(beta) (NIID-Bench "quantity-based label imbalance" sizes).
- :func:`pathological` -- k classes per client (McMahan et al.; PFLlib ``pat``; FedCAC pathological).
- :func:`dirichlet` -- per-class Dir(alpha) over clients with self-balancing (PFLlib ``dir``, NIID-Bench,
  FedDisco NIID-1).
- :func:`dirichlet_fixed` -- per-client Dir(alpha) over classes, fixed samples per client (FedCAC / Fling).
- :func:`niid2` -- FedDisco NIID-2: biased 2-class clients plus unbiased all-class clients, equal sizes.
- :func:`long_tail` -- exponentially imbalanced subset (CIFAR-LT style), to be partitioned afterwards.
- :func:`domain_skew` -- FedHEAL: each client a random disjoint fraction of one domain's training set.
- :func:`train_test_split_clients` -- per-client train/test split (PFLlib 75/25).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from typing import Literal

import numpy as np

__all__ = [
    "PARTITIONS",
    "PartitionError",
    "client_class_proportions",
    "dirichlet",
    "dirichlet_fixed",
    "domain_skew",
    "iid",
    "label_histograms",
    "long_tail",
    "make_partition",
    "niid2",
    "pathological",
    "pfllib_least_samples",
    "quantity_skew",
    "train_test_split_clients",
]


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
        raise TypeError(
            f"rng must be a numpy.random.Generator (e.g. np.random.default_rng(seed)), got {type(rng)}"
        )
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


# ----------------------------------------------------------------------------------------------- schemes


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
) -> list[np.ndarray]:
    """Quantity skew (NIID-Bench): label-IID shards whose sizes follow Dir(beta); covers every sample.

    Each client first gets ``min_size`` samples, the rest is apportioned by q ~ Dir(beta * 1_K) (so it never
    retries, unlike NIID-Bench's redraw-until-min-size loop, and cannot hang).
    """
    y = _as_labels(labels)
    n = len(y)
    b = _check_positive("beta", beta)
    m = _check_int("min_size", min_size, 0)
    k = _check_clients(n, num_clients, max(m, 1))
    _check_rng(rng)
    perm = rng.permutation(n)
    sizes = m + _apportion(_dirichlet(rng, b, k), n - k * m)
    if m == 0:  # still never hand out an empty client: move one sample from the largest
        for i in np.flatnonzero(sizes == 0):
            sizes[np.argmax(sizes)] -= 1
            sizes[i] += 1
    return _split_sizes(perm, sizes)


def pfllib_least_samples(
    n_samples: int, num_clients: int, batch_size: int = 10, train_ratio: float = 0.75
) -> int:
    """PFLlib's ``least_samples = int(min(batch_size / (1 - train_ratio), N / num_clients / 2))``."""
    return int(min(batch_size / (1 - train_ratio), n_samples / num_clients / 2))


def pathological(
    labels: np.ndarray | Sequence[int],
    num_clients: int,
    classes_per_client: int,
    rng: np.random.Generator,
    *,
    scheme: Literal["random", "pfllib"] = "random",
    balanced: bool = True,
    least_samples: int | None = None,
) -> list[np.ndarray]:
    """Pathological non-IID: each client holds <= ``classes_per_client`` classes; disjoint and complete.

    ``scheme="pfllib"`` reproduces PFLlib's ``pat`` (FedSA/FedPake experiments): classes are visited in order
    and each goes to the first ``ceil(K / C * k)`` clients that still have a free class slot, so the
    assignment is blocked and deterministic (20 clients, 10 classes, k=2: clients 0-3 {0,1}, 4-7 {2,3}, ...,
    16-19 {8,9}). A class's samples are taken in pool order (PFLlib does not shuffle them); ``balanced=True``
    gives the first m-1 holders ``int(n_c/m)`` each and the last holder the remainder; ``balanced=False``
    draws those sizes uniformly from ``[max(n_c/m/10, least_samples/C), n_c/m)`` (``least_samples`` defaults
    to :func:`pfllib_least_samples`).

    ``scheme="random"`` (FedCAC: "each client gets k random classes"): clients, in random order, pick the k
    distinct classes held by the fewest clients so far (random tie-breaks), so every class gets a holder and
    holder counts differ by at most one. Each class's shuffled samples are split among its holders, equally
    (``balanced=True``) or with Dir(1) proportions (``balanced=False``); every holder gets >= 1 sample.
    """
    y = _as_labels(labels)
    n = len(y)
    k_clients = _check_clients(n, num_clients)
    _check_rng(rng)
    classes, pools = _class_pools(y)
    n_cls = len(classes)
    k = _check_int("classes_per_client", classes_per_client, 1)
    if k > n_cls:
        raise PartitionError(
            f"classes_per_client={k} exceeds the number of classes present in the labels ({n_cls})"
        )
    if scheme == "pfllib":
        return _pat_pfllib(pools, n, k_clients, k, rng, balanced, least_samples)
    if scheme != "random":
        raise PartitionError(f"unknown pathological scheme {scheme!r}; use 'random' or 'pfllib'")
    if k_clients * k < n_cls:
        raise PartitionError(
            "pathological (random): not every class can get a holder "
            f"{_fmt(n_clients=k_clients, classes_per_client=k, num_classes=n_cls)}; "
            "need n_clients*k >= classes"
        )
    holders: list[list[int]] = [[] for _ in range(n_cls)]
    held = np.zeros(n_cls, dtype=np.int64)
    for client in rng.permutation(k_clients):
        chosen = np.argsort(held + rng.random(n_cls), kind="stable")[:k]
        held[chosen] += 1
        for c in chosen:
            holders[c].append(int(client))
    parts: list[list[np.ndarray]] = [[] for _ in range(k_clients)]
    for c, pool in enumerate(pools):
        h = holders[c]
        if len(pool) < len(h):
            raise PartitionError(
                f"pathological (random): class {int(classes[c])} has {len(pool)} samples "
                f"but {len(h)} holders "
                f"{_fmt(n_samples=n, n_clients=k_clients, classes_per_client=k)}"
            )
        if balanced:
            sizes = np.full(len(h), len(pool) // len(h), dtype=np.int64)
            sizes[: len(pool) % len(h)] += 1
        else:
            sizes = 1 + _apportion(_dirichlet(rng, 1.0, len(h)), len(pool) - len(h))
        for client, piece in zip(h, np.split(rng.permutation(pool), np.cumsum(sizes)[:-1]), strict=True):
            parts[client].append(piece)
    return _finish([np.concatenate(p) for p in parts])


def _pat_pfllib(
    pools: list[np.ndarray],
    n: int,
    num_clients: int,
    k: int,
    rng: np.random.Generator,
    balanced: bool,
    least_samples: int | None,
) -> list[np.ndarray]:
    n_cls = len(pools)
    least = pfllib_least_samples(n, num_clients) if least_samples is None else int(least_samples)
    slots = [k] * num_clients
    # PFLlib's float expression, kept verbatim so that rounding matches it exactly.
    block = int(np.ceil((num_clients / n_cls) * k))
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for c, pool in enumerate(pools):
        chosen = [i for i in range(num_clients) if slots[i] > 0][:block]
        if not chosen:
            raise PartitionError(
                f"pfllib pat: class index {c} has no client with a free class slot "
                f"{_fmt(n_clients=num_clients, classes_per_client=k, num_classes=n_cls)}; "
                "need n_clients*k >= classes"
            )
        m = len(chosen)
        per = len(pool) / m
        if balanced:
            sizes = [int(per)] * (m - 1)
        else:
            low, high = int(max(per / 10, least / n_cls)), int(per)
            if m > 1 and low >= high:
                raise PartitionError(
                    f"pfllib pat (unbalanced): empty size range [{low}, {high}) for class index {c} "
                    f"{_fmt(n_samples=n, n_clients=num_clients, least_samples=least)}"
                )
            sizes = [int(v) for v in rng.integers(low, high, size=m - 1)] if m > 1 else []
        sizes.append(len(pool) - sum(sizes))
        start = 0
        for client, size in zip(chosen, sizes, strict=True):
            parts[client].append(pool[start : start + size])
            start += size
            slots[client] -= 1
    out = _finish([np.concatenate(p) if p else np.empty(0, np.int64) for p in parts])
    empty = [i for i, p in enumerate(out) if len(p) == 0]
    if empty:
        raise PartitionError(
            f"pfllib pat left clients {empty} without samples "
            f"{_fmt(n_samples=n, n_clients=num_clients, classes_per_client=k, num_classes=n_cls)}"
        )
    return out


def dirichlet(
    labels: np.ndarray | Sequence[int],
    num_clients: int,
    alpha: float,
    rng: np.random.Generator,
    *,
    min_size: int = 10,
    balance: bool = True,
    max_retries: int = 100,
) -> list[np.ndarray]:
    """Dirichlet label skew ("practical non-IID": PFLlib ``dir``, NIID-Bench, FedDisco NIID-1).

    For each class: shuffle its samples, draw p ~ Dir(alpha * 1_K); with ``balance`` zero p_j for clients
    already holding >= N/K samples (the self-balancing trick) and renormalise; cut at ``int(cumsum(p) *
    n_c)``. The whole draw is repeated until every client has >= ``min_size`` samples (PFLlib uses its
    ``least_samples`` here, NIID-Bench/FedDisco 10), at most ``max_retries`` times, then
    :class:`PartitionError`.
    """
    y = _as_labels(labels)
    n = len(y)
    a = _check_positive("alpha", alpha)
    m = _check_int("min_size", min_size, 0)
    retries = _check_int("max_retries", max_retries, 1)
    k = _check_int("num_clients", num_clients, 1)
    _check_rng(rng)
    params = _fmt(n_samples=n, n_clients=k, alpha=a, min_size=m, retries=retries)
    if k > n:
        raise PartitionError(f"more clients than samples {params}")
    if k * m > n:
        raise PartitionError(f"dirichlet partition impossible: n_clients*min_size > n_samples {params}")
    _, pools = _class_pools(y)
    cap = n / k
    best = -1
    for _ in range(retries):
        sizes = np.zeros(k, dtype=np.int64)
        pieces: list[tuple[np.ndarray, np.ndarray]] = []
        for pool in pools:
            idx = rng.permutation(pool)
            p = _dirichlet(rng, a, k)
            if balance:
                open_ = sizes < cap
                p = p * open_
                if (
                    p.sum() <= 0
                ):  # all mass on full clients (degenerate tiny-alpha draw): spread over open ones
                    p = open_.astype(np.float64) if open_.any() else np.ones(k)
                p = p / p.sum()
            cuts = (np.cumsum(p) * len(idx)).astype(np.int64)[:-1]
            cuts = np.clip(cuts, 0, len(idx))
            sizes += np.diff(np.concatenate(([0], cuts, [len(idx)])))
            pieces.append((idx, cuts))
        best = max(best, int(sizes.min()))
        if sizes.min() >= m:
            parts: list[list[np.ndarray]] = [[] for _ in range(k)]
            for idx, cuts in pieces:
                for j, piece in enumerate(np.split(idx, cuts)):
                    parts[j].append(piece)
            return _finish([np.concatenate(p) for p in parts])
    raise PartitionError(
        f"dirichlet partition failed: no draw gave every client >= min_size samples {params}; "
        f"best smallest client had {best}. Raise alpha, lower min_size, use fewer clients or more retries."
    )


def client_class_proportions(
    num_clients: int, num_classes: int, alpha: float, rng: np.random.Generator
) -> np.ndarray:
    """Per-client class proportions q_i ~ Dir(alpha * 1_C), shape [num_clients, num_classes] (FedCAC)."""
    k = _check_int("num_clients", num_clients, 1)
    c = _check_int("num_classes", num_classes, 1)
    return _dirichlet(_check_rng(rng), _check_positive("alpha", alpha), c, size=k)


def dirichlet_fixed(
    labels: np.ndarray | Sequence[int],
    num_clients: int,
    alpha: float,
    rng: np.random.Generator,
    *,
    samples_per_client: int,
    disjoint: bool = False,
    proportions: np.ndarray | None = None,
) -> list[np.ndarray]:
    """Client-wise Dirichlet with a fixed size (FedCAC, Fling ``dirichlet_sampling``).

    Each client draws q_i ~ Dir(alpha * 1_C) over the classes present (or uses row i of ``proportions``, e.g.
    the same q for a train and a test pool, see :func:`client_class_proportions`); its per-class counts are
    ``samples_per_client * q_i`` rounded by largest remainder, so every client has exactly
    ``samples_per_client``.

    ``disjoint=False`` (Fling/FedCAC): each client samples its count of class c *without replacement* from the
    whole class pool, independently of the other clients, so samples may be shared across clients but never
    repeat within one. ``disjoint=True``: samples are dealt without replacement across clients (each used at
    most once). If a class pool is too small for the demand, :class:`PartitionError` (Fling would silently
    switch to sampling with replacement; we refuse instead).
    """
    y = _as_labels(labels)
    n = len(y)
    k = _check_clients(n, num_clients)
    s = _check_int("samples_per_client", samples_per_client, 1)
    _check_rng(rng)
    classes, pools = _class_pools(y)
    if proportions is None:
        q = _dirichlet(rng, _check_positive("alpha", alpha), len(classes), size=k)
    else:
        q = np.asarray(proportions, dtype=np.float64)
        if q.shape != (k, len(classes)) or not np.isfinite(q).all() or (q < 0).any():
            raise PartitionError(
                f"proportions must be a finite non-negative array of shape {(k, len(classes))}, got {q.shape}"
            )
    counts = np.stack([_apportion(row, s) for row in q])  # [K, C]
    params = _fmt(n_samples=n, n_clients=k, alpha=alpha, samples_per_client=s, disjoint=disjoint)
    if disjoint:
        demand = counts.sum(axis=0)
        short = np.flatnonzero(demand > np.array([len(p) for p in pools]))
        if short.size:
            c = short[0]
            raise PartitionError(
                f"dirichlet_fixed: class {int(classes[c])} needs {int(demand[c])} samples "
                f"but has {len(pools[c])} "
                f"{params}; use disjoint=False, fewer clients or fewer samples_per_client"
            )
        parts: list[list[np.ndarray]] = [[] for _ in range(k)]
        for c, pool in enumerate(pools):
            idx = rng.permutation(pool)
            for j, piece in enumerate(np.split(idx, np.cumsum(counts[:, c])[:-1])):
                parts[j].append(piece[: counts[j, c]])
        return _finish([np.concatenate(p) for p in parts])
    out = []
    for j in range(k):
        chunks = []
        for c in np.flatnonzero(counts[j]):
            if counts[j, c] > len(pools[c]):
                raise PartitionError(
                    f"dirichlet_fixed: client {j} needs {int(counts[j, c])} samples "
                    f"of class {int(classes[c])} "
                    f"but the class has {len(pools[c])} {params}"
                )
            chunks.append(rng.choice(pools[c], size=int(counts[j, c]), replace=False))
        out.append(np.concatenate(chunks))
    return _finish(out)


def niid2(
    labels: np.ndarray | Sequence[int],
    num_biased: int,
    num_unbiased: int,
    rng: np.random.Generator,
) -> list[np.ndarray]:
    """FedDisco NIID-2: ``num_biased`` 2-class clients, then ``num_unbiased`` all-class clients; equal sizes.

    Classes sorted; biased client i gets classes (2i, 2i+1) mod C. Samples are dealt in shards of s samples: a
    biased client takes C/2 shards of each of its 2 classes, an unbiased client 1 shard of every class, so all
    clients hold C*s samples (for odd C: C and 2 shards, 2*C*s samples). The shard size is the largest s every
    class can supply, ``min_c floor(n_c / demand_c)``; for FedDisco's setting (5 biased + 1 unbiased, 10
    balanced classes) that is their ``n / (10 * 6)``, e.g. 833 on CIFAR-10 (8,330 per client). Unused samples
    are dropped.
    """
    y = _as_labels(labels)
    n = len(y)
    b = _check_int("num_biased", num_biased, 0)
    u = _check_int("num_unbiased", num_unbiased, 0)
    if b + u < 1:
        raise PartitionError("niid2 needs at least one client (num_biased + num_unbiased >= 1)")
    _check_rng(rng)
    classes, pools = _class_pools(y)
    n_cls = len(classes)
    if n_cls < 2:
        raise PartitionError(f"niid2 needs at least 2 classes, the labels have {n_cls}")
    per_biased, per_unbiased = (n_cls // 2, 1) if n_cls % 2 == 0 else (n_cls, 2)
    biased_classes = [((2 * i) % n_cls, (2 * i + 1) % n_cls) for i in range(b)]
    demand = np.full(n_cls, per_unbiased * u, dtype=np.int64)
    for pair in biased_classes:
        demand[list(pair)] += per_biased
    sizes = np.array([len(p) for p in pools])
    used = demand > 0
    shard = int(np.min(sizes[used] // demand[used]))
    if shard < 1:
        raise PartitionError(
            f"niid2: some class cannot supply one shard per demand "
            f"{_fmt(n_samples=n, num_biased=b, num_unbiased=u, num_classes=n_cls)}"
        )
    shuffled = [rng.permutation(p) for p in pools]
    taken = np.zeros(n_cls, dtype=np.int64)

    def take(c: int, count: int) -> np.ndarray:
        out = shuffled[c][taken[c] : taken[c] + count]
        taken[c] += count
        return out

    parts = [np.concatenate([take(c, per_biased * shard) for c in pair]) for pair in biased_classes]
    parts += [np.concatenate([take(c, per_unbiased * shard) for c in range(n_cls)]) for _ in range(u)]
    return _finish(parts)


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
            raise PartitionError(
                f"domain_skew: clients_per_domain * fraction > 1, clients cannot be disjoint {params}"
            )
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
                raise PartitionError(
                    f"domain_skew: no unused sample of class {int(c)} left for client {j} {params}"
                )
            pick = spare[int(rng.integers(len(spare)))]
            vals, cnt = np.unique(y[chunk], return_counts=True)
            big = vals[np.argmax(cnt)]  # most frequent class: it keeps >= 1 sample after the swap
            pos = np.flatnonzero(y[chunk] == big)
            out_pos = int(pos[int(rng.integers(len(pos)))])
            unused[pick], chunk[out_pos] = int(chunk[out_pos]), unused[pick]


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


def label_histograms(
    labels: np.ndarray | Sequence[int], parts: Sequence[np.ndarray], num_classes: int
) -> np.ndarray:
    """Per-client label counts, int64 array [num_clients, num_classes]."""
    y = np.asarray(labels).astype(np.int64, copy=False)
    c = _check_int("num_classes", num_classes, 1)
    if y.size and (y.min() < 0 or y.max() >= c):
        raise PartitionError(f"labels must lie in [0, {c}), got range [{int(y.min())}, {int(y.max())}]")
    out = np.zeros((len(parts), c), dtype=np.int64)
    for i, p in enumerate(parts):
        out[i] = np.bincount(y[np.asarray(p, dtype=np.int64)], minlength=c)
    return out


# ----------------------------------------------------------------------------------------------- registry

Partitioner = Callable[..., list[np.ndarray]]


def _p_iid(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    *,
    balanced: bool = True,
    sigma: float = 1.0,
) -> list[np.ndarray]:
    return iid(labels, num_clients, rng, balanced=balanced, sigma=sigma)


def _p_dir(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    *,
    alpha: float,
    min_size: int = 10,
    balance: bool = True,
    max_retries: int = 100,
) -> list[np.ndarray]:
    return dirichlet(
        labels, num_clients, alpha, rng, min_size=min_size, balance=balance, max_retries=max_retries
    )


def _p_pat(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    *,
    classes_per_client: int = 2,
    scheme: Literal["random", "pfllib"] = "random",
    balanced: bool = True,
    least_samples: int | None = None,
) -> list[np.ndarray]:
    return pathological(
        labels,
        num_clients,
        classes_per_client,
        rng,
        scheme=scheme,
        balanced=balanced,
        least_samples=least_samples,
    )


def _p_dirfixed(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    *,
    alpha: float,
    samples_per_client: int,
    disjoint: bool = False,
    proportions: np.ndarray | None = None,
) -> list[np.ndarray]:
    return dirichlet_fixed(
        labels,
        num_clients,
        alpha,
        rng,
        samples_per_client=samples_per_client,
        disjoint=disjoint,
        proportions=proportions,
    )


def _p_niid2(
    labels: np.ndarray, num_clients: int, rng: np.random.Generator, *, num_unbiased: int = 1
) -> list[np.ndarray]:
    u = _check_int("num_unbiased", num_unbiased, 0)
    k = _check_int("num_clients", num_clients, 1)
    if u > k:
        raise PartitionError(f"niid2: num_unbiased={u} exceeds num_clients={k}")
    return niid2(labels, k - u, u, rng)


def _p_quantity(
    labels: np.ndarray, num_clients: int, rng: np.random.Generator, *, beta: float, min_size: int = 1
) -> list[np.ndarray]:
    return quantity_skew(labels, num_clients, rng, beta=beta, min_size=min_size)


#: name -> partitioner(labels, num_clients, rng, **params); see :func:`make_partition`.
PARTITIONS: dict[str, Partitioner] = {
    "iid": _p_iid,
    "dir": _p_dir,
    "pat": _p_pat,
    "dirfixed": _p_dirfixed,
    "niid2": _p_niid2,
    "quantity": _p_quantity,
}


def make_partition(
    name: str,
    labels: np.ndarray | Sequence[int],
    num_clients: int,
    rng: np.random.Generator,
    **params: object,
) -> list[np.ndarray]:
    """Partition ``labels`` among ``num_clients`` with the scheme ``name`` (a key of :data:`PARTITIONS`).

    Parameters: iid(balanced, sigma); dir(alpha, min_size, balance, max_retries); pat(classes_per_client,
    scheme, balanced, least_samples); dirfixed(alpha, samples_per_client, disjoint, proportions);
    niid2(num_unbiased=1: the other num_clients - num_unbiased clients are biased); quantity(beta, min_size).
    """
    fn = PARTITIONS.get(name)
    if fn is None:
        raise PartitionError(f"unknown partition {name!r}; choose one of {sorted(PARTITIONS)}")
    sig = inspect.signature(fn)
    accepted = [p for p in sig.parameters if sig.parameters[p].kind is inspect.Parameter.KEYWORD_ONLY]
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        raise PartitionError(f"partition {name!r} does not take {unknown}; it accepts {accepted}")
    missing = [
        p for p in accepted if sig.parameters[p].default is inspect.Parameter.empty and p not in params
    ]
    if missing:
        raise PartitionError(f"partition {name!r} needs parameter(s) {missing}")
    return fn(labels, num_clients, rng, **params)
