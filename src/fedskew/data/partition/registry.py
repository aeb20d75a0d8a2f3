"""The partitions by name (:data:`PARTITIONS`) and :func:`make_partition`, which checks their parameters."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Literal

import numpy as np

from fedskew.data.partition.base import PartitionError, _check_int
from fedskew.data.partition.label_skew import biased_uniform, dirichlet, dirichlet_fixed, niid2, pathological
from fedskew.data.partition.sizes import iid, quantity_skew

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
    return dirichlet(labels, num_clients, alpha, rng, min_size=min_size, balance=balance, max_retries=max_retries)


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


def _p_biased(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    *,
    classes_per_client: int = 2,
    num_uniform: int = 1,
) -> list[np.ndarray]:
    u = _check_int("num_uniform", num_uniform, 0)
    k = _check_int("num_clients", num_clients, 1)
    if u > k:
        raise PartitionError(f"biased: uniform_clients={u} exceeds num_clients={k}")
    return biased_uniform(labels, k - u, u, rng, classes_per_biased=classes_per_client)


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
    "biased": _p_biased,
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
    niid2(num_unbiased=1: the other num_clients - num_unbiased clients are biased); biased(classes_per_client=2,
    num_uniform=1: the other num_clients - num_uniform clients hold classes_per_client classes each);
    quantity(beta, min_size).
    """
    fn = PARTITIONS.get(name)
    if fn is None:
        raise PartitionError(f"unknown partition {name!r}; choose one of {sorted(PARTITIONS)}")
    sig = inspect.signature(fn)
    accepted = [p for p in sig.parameters if sig.parameters[p].kind is inspect.Parameter.KEYWORD_ONLY]
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        raise PartitionError(f"partition {name!r} does not take {unknown}; it accepts {accepted}")
    missing = [p for p in accepted if sig.parameters[p].default is inspect.Parameter.empty and p not in params]
    if missing:
        raise PartitionError(f"partition {name!r} needs parameter(s) {missing}")
    return fn(labels, num_clients, rng, **params)
