"""The partitions by name (:data:`PARTITIONS`), open to user schemes, and :func:`make_partition`, which checks their
parameters.

A scheme is a function ``fn(labels, num_clients, rng, **params) -> list of index arrays`` (one per client, disjoint,
every sample at most once), its parameters keyword-only. The built-in ones take theirs from dedicated run settings
(``alpha``, ``classes_per_client``, ...); a registered one takes its own from the run's ``partition_args``
(``-P KEY=VALUE`` on the command line, ``partition_args:`` in YAML). Register with the :func:`partition` decorator
(``fedskew.partition``) in your code, or from an installed package under the ``fedskew.partitions`` entry-point group,
which the command line loads (docs/extending.md).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Mapping, Sequence
from importlib import metadata
from typing import Literal

import numpy as np

from fedskew.data.partition.base import PartitionError, _check_int
from fedskew.data.partition.flwr import flwr_partition
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
    scheme: Literal["random", "pfllib", "niid-bench"] = "random",
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
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    *,
    beta: float,
    min_size: int = 1,
    rule: Literal["shift", "niid-bench"] = "shift",
    max_retries: int = 1000,
) -> list[np.ndarray]:
    return quantity_skew(labels, num_clients, rng, beta=beta, min_size=min_size, rule=rule, max_retries=max_retries)


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
BUILTIN = frozenset(PARTITIONS)  # their parameters are run settings of their own (alpha, classes_per_client, ...)
SUMMARIES: dict[str, str] = {
    "iid": "every client a uniform random share",
    "dir": "per-class Dirichlet(alpha) proportions over the clients",
    "pat": "pathological: classes_per_client classes per client",
    "dirfixed": "samples_per_client samples per client from a Dirichlet(alpha) class mix (FedCAC)",
    "niid2": "FedDisco's NIID-2: one class per biased client, the rest uniform",
    "biased": "classes_per_client classes per biased client, uniform_clients clients with every class",
    "quantity": "client sizes from Dirichlet(alpha), labels uniform",
}
ENTRY_POINT_GROUP = "fedskew.partitions"
_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
RESERVED = ("domain", "given", "natural")  # partitions the federation builder implements itself (not label schemes)


def register_partition(name: str, fn: Partitioner, summary: str = "") -> Partitioner:
    """Add a scheme under ``name`` (refused: a taken or reserved name, a name that is not lower-case letters, digits
    and ``_``, a function whose first three parameters are not positional or whose others are not keyword-only)."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise PartitionError(f"partition name {name!r} must be lower-case letters, digits and '_' (a letter first)")
    if name in PARTITIONS or name in RESERVED:
        raise PartitionError(f"partition {name!r} is taken; choose another name")
    if not callable(fn):
        raise PartitionError(f"partition {name!r}: expected a function, got {type(fn).__name__}")
    params = list(inspect.signature(fn).parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    others = [p for p in params[len(positional) :] if p.kind is not p.KEYWORD_ONLY]
    if len(positional) != 3 or others:
        raise PartitionError(
            f"partition {name!r}: the function must take (labels, num_clients, rng) and then keyword-only "
            f"parameters (after a bare *), got ({', '.join(p.name for p in params)})"
        )
    PARTITIONS[name] = fn
    SUMMARIES[name] = summary or (fn.__doc__ or "").strip().split("\n")[0]
    return fn


def partition(name: str, summary: str = "") -> Callable[[Partitioner], Partitioner]:
    """Decorator: register a partition scheme (:func:`register_partition`), usable as ``partition: name`` with its
    parameters in ``partition_args``::

        @fedskew.partition("shards")
        def shards(labels, num_clients, rng, *, per_client=2):
            ..."""

    def decorate(fn: Partitioner) -> Partitioner:
        return register_partition(name, fn, summary)

    return decorate


def unregister_partition(name: str) -> None:
    """Remove a registered scheme (the built-in ones stay)."""
    if name in BUILTIN or name in SHIPPED:
        raise PartitionError(f"{name!r} is a built-in partition and cannot be removed")
    PARTITIONS.pop(name, None)
    SUMMARIES.pop(name, None)


_loaded_entry_points = False


def load_entry_points() -> list[str]:
    """Import the schemes installed packages declare under ``fedskew.partitions`` (once). An entry point names a
    function, registered under the entry point's name unless its module's import registered it already."""
    global _loaded_entry_points
    if _loaded_entry_points:
        return []
    _loaded_entry_points = True
    added = []
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            fn = ep.load()
        except Exception as exc:  # a broken plug-in package must not break fedskew
            raise PartitionError(f"partition entry point {ep.name!r} ({ep.value}) failed to load: {exc}") from exc
        if fn not in PARTITIONS.values():
            register_partition(ep.name, fn)
        added.append(ep.name)
    return added


def partition_parameters(name: str) -> tuple[list[str], list[str]]:
    """``(accepted, required)``: the keyword-only parameters of scheme ``name`` and those without a default."""
    fn = PARTITIONS.get(name)
    if fn is None:
        raise PartitionError(f"unknown partition {name!r}; choose one of {sorted(PARTITIONS)}")
    sig = inspect.signature(fn)
    accepted = [p for p in sig.parameters if sig.parameters[p].kind is inspect.Parameter.KEYWORD_ONLY]
    required = [p for p in accepted if sig.parameters[p].default is inspect.Parameter.empty]
    return accepted, required


def check_partition_params(name: str, params: Mapping[str, object]) -> None:
    """Refuse parameters scheme ``name`` does not take, or lacks (a clear :class:`PartitionError`)."""
    accepted, required = partition_parameters(name)
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        raise PartitionError(f"partition {name!r} does not take {unknown}; it accepts {accepted}")
    missing = [p for p in required if p not in params]
    if missing:
        raise PartitionError(f"partition {name!r} needs parameter(s) {missing}")


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
    quantity(beta, min_size); a registered scheme, its own. A registered scheme's result is checked: one index array
    per client, integer indices into ``labels``, no sample twice.
    """
    check_partition_params(name, params)
    parts = PARTITIONS[name](labels, num_clients, rng, **params)
    if name not in BUILTIN:
        _check_parts(name, parts, len(labels), num_clients)
    return parts


def _check_parts(name: str, parts: object, n: int, num_clients: int) -> None:
    if not isinstance(parts, list | tuple) or len(parts) != num_clients:
        got = f"{len(parts)} arrays" if isinstance(parts, list | tuple) else type(parts).__name__
        raise PartitionError(f"partition {name!r} must return one index array per client ({num_clients}), got {got}")
    seen = np.zeros(n, dtype=bool)
    for cid, idx in enumerate(parts):
        a = np.asarray(idx)
        if a.ndim != 1 or (a.size and not np.issubdtype(a.dtype, np.integer)):
            raise PartitionError(f"partition {name!r}: client {cid}'s indices must be a 1-D integer array")
        if a.size and (a.min() < 0 or a.max() >= n):
            raise PartitionError(f"partition {name!r}: client {cid} has an index outside 0..{n - 1}")
        if seen[a].any() or len(np.unique(a)) != a.size:
            raise PartitionError(f"partition {name!r}: a sample is given to more than one client (client {cid})")
        seen[a] = True


# not a built-in (its parameters come from partition_args, -P partitioner=DirichletPartitioner -P alpha=0.5)
register_partition("flwr", flwr_partition, "a flwr-datasets partitioner by name (-P partitioner=..., extra [hf])")
SHIPPED = frozenset({"flwr"})  # the registered schemes fedskew ships (kept, like the built-in ones)

