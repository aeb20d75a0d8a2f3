"""Label-skew partitions: which classes a client holds and how many of each (``pat``, ``dir``, ``dirfixed``,
``niid2``, ``biased``), and PFLlib's least-samples rule."""

from __future__ import annotations

import math
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
    _finish,
    _fmt,
)


def pfllib_least_samples(n_samples: int, num_clients: int, batch_size: int = 10, train_ratio: float = 0.75) -> int:
    """PFLlib's ``least_samples = int(min(batch_size / (1 - train_ratio), N / num_clients / 2))``."""
    return int(min(batch_size / (1 - train_ratio), n_samples / num_clients / 2))


def pathological(
    labels: np.ndarray | Sequence[int],
    num_clients: int,
    classes_per_client: int,
    rng: np.random.Generator,
    *,
    scheme: Literal["random", "pfllib", "niid-bench"] = "random",
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

    ``scheme="niid-bench"`` is NIID-Bench's quantity-based label imbalance ``#C=k`` (``noniid-#labelk``, its
    ``utils.partition_data``): see :func:`_pat_niid_bench`.
    """
    y = _as_labels(labels)
    n = len(y)
    k_clients = _check_clients(n, num_clients)
    _check_rng(rng)
    classes, pools = _class_pools(y)
    n_cls = len(classes)
    k = _check_int("classes_per_client", classes_per_client, 1)
    if k > n_cls:
        raise PartitionError(f"classes_per_client={k} exceeds the number of classes present in the labels ({n_cls})")
    if scheme == "pfllib":
        return _pat_pfllib(pools, n, k_clients, k, rng, balanced, least_samples)
    if scheme == "niid-bench":
        return _pat_niid_bench(pools, classes, k_clients, k, rng)
    if scheme != "random":
        raise PartitionError(f"unknown pathological scheme {scheme!r}; use 'random', 'pfllib' or 'niid-bench'")
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


def _pat_niid_bench(
    pools: list[np.ndarray], classes: np.ndarray, num_clients: int, k: int, rng: np.random.Generator
) -> list[np.ndarray]:
    """NIID-Bench's ``#C=k``: client i holds class index ``i mod C`` and k - 1 more distinct classes, each drawn
    uniformly at random (redrawn while already held); then every class's samples, shuffled, are cut into as many
    near-equal pieces as it has holders (``np.array_split``: the first ``n_c mod h`` pieces one larger), the pieces
    going to the holders in client order. A class no client drew has no holder: NIID-Bench fails on it
    (``array_split`` into 0 pieces), here it is a :class:`PartitionError` naming the classes (fewer clients than
    classes; another seed may cover them)."""
    n_cls = len(pools)
    held: list[list[int]] = []
    for i in range(num_clients):
        current = [i % n_cls]
        while len(current) < k:
            c = int(rng.integers(n_cls))
            if c not in current:
                current.append(c)
        held.append(current)
    counts = np.bincount([c for h in held for c in h], minlength=n_cls)
    if (counts == 0).any():
        lost = [int(classes[c]) for c in np.flatnonzero(counts == 0)]
        raise PartitionError(
            f"niid-bench pat: no client drew classes {lost}, so their samples would be lost "
            f"{_fmt(n_clients=num_clients, classes_per_client=k, num_classes=n_cls)}; NIID-Bench fails here too: "
            "use more clients, more classes per client or another seed"
        )
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for c, pool in enumerate(pools):
        holders = [i for i in range(num_clients) if c in held[i]]
        if len(pool) < len(holders):
            raise PartitionError(
                f"niid-bench pat: class {int(classes[c])} has {len(pool)} samples but {len(holders)} holders"
            )
        for i, piece in zip(holders, np.array_split(rng.permutation(pool), len(holders)), strict=True):
            parts[i].append(piece)
    return _finish([np.concatenate(p) for p in parts])


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
                if p.sum() <= 0:  # all mass on full clients (degenerate tiny-alpha draw): spread over open ones
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


def client_class_proportions(num_clients: int, num_classes: int, alpha: float, rng: np.random.Generator) -> np.ndarray:
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
    are dropped. This is :func:`biased_uniform` with 2 classes per biased client.
    """
    return biased_uniform(labels, num_biased, num_unbiased, rng, classes_per_biased=2, name="niid2")


def biased_uniform(
    labels: np.ndarray | Sequence[int],
    num_biased: int,
    num_uniform: int,
    rng: np.random.Generator,
    *,
    classes_per_biased: int = 2,
    name: str = "biased",
) -> list[np.ndarray]:
    """FedDisco's biased and uniform clients (its AG News split; :func:`niid2` is the case of 2 classes):
    ``num_biased`` clients holding ``classes_per_biased`` = k classes each, then ``num_uniform`` clients holding every
    class; every client the same number of samples.

    Classes sorted; biased client i gets classes (k*i + j) mod C, j = 0..k-1. Samples are dealt in shards of s
    samples: with m = lcm(C, k), a biased client takes m/k shards of each of its classes and a uniform client m/C
    shards of every class, so every client holds m*s samples, its classes in equal parts. The shard size is the
    largest s every class can supply, ``min_c floor(n_c / demand_c)``; each class's samples are shuffled once and
    dealt in client order, so clients are disjoint. Unused samples are dropped.
    """
    y = _as_labels(labels)
    n = len(y)
    b = _check_int("num_biased", num_biased, 0)
    u = _check_int("num_uniform", num_uniform, 0)
    if b + u < 1:
        raise PartitionError(f"{name} needs at least one client (biased + uniform clients >= 1)")
    _check_rng(rng)
    classes, pools = _class_pools(y)
    n_cls = len(classes)
    if n_cls < 2:
        raise PartitionError(f"{name} needs at least 2 classes, the labels have {n_cls}")
    k = _check_int("classes_per_client", classes_per_biased, 1)
    if k > n_cls:
        raise PartitionError(
            f"{name}: classes_per_client={k} (per biased client) exceeds the number of classes present in the labels "
            f"({n_cls})"
        )
    m = math.lcm(n_cls, k)
    per_biased, per_uniform = m // k, m // n_cls
    biased_classes = [tuple((k * i + j) % n_cls for j in range(k)) for i in range(b)]
    demand = np.full(n_cls, per_uniform * u, dtype=np.int64)
    for held in biased_classes:
        demand[list(held)] += per_biased
    sizes = np.array([len(p) for p in pools])
    used = demand > 0
    shard = int(np.min(sizes[used] // demand[used]))
    if shard < 1:
        c = int(np.flatnonzero(used & (sizes < demand))[0])
        raise PartitionError(
            f"{name}: class {int(classes[c])} has {int(sizes[c])} samples but the clients need {int(demand[c])} "
            f"shards of it (of at least one sample) "
            f"{_fmt(n_samples=n, num_biased=b, num_uniform=u, classes_per_client=k, num_classes=n_cls)}; "
            "use fewer clients"
        )
    shuffled = [rng.permutation(p) for p in pools]
    taken = np.zeros(n_cls, dtype=np.int64)

    def take(c: int, count: int) -> np.ndarray:
        out = shuffled[c][taken[c] : taken[c] + count]
        taken[c] += count
        return out

    parts = [np.concatenate([take(c, per_biased * shard) for c in held]) for held in biased_classes]
    parts += [np.concatenate([take(c, per_uniform * shard) for c in range(n_cls)]) for _ in range(u)]
    return _finish(parts)
