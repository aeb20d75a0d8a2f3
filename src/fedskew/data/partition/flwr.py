"""``--partition flwr``: a flwr-datasets partitioner as a fedskew partition (the ``[hf]`` extra).

``--partition flwr -P partitioner=DirichletPartitioner -P alpha=0.5`` cuts the run's training pool with the named
partitioner (its labels as a ``datasets.Dataset`` column ``label``), seeded from the run's partition stream; what it
returns goes through fedskew's checks like any scheme (disjoint, every client non-empty). The other direction,
fedskew's partitions inside ``FederatedDataset``, is :class:`fedskew.data.flwr_interop.FedskewPartitioner`.
"""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np

from fedskew.data.partition.base import PartitionError


def _flwr_partitioners() -> Any:
    try:
        import flwr_datasets.partitioner as partitioners
    except ImportError:
        raise PartitionError("flwr-datasets is not installed: pip install 'fedskew[hf]'") from None
    return partitioners


def flwr_partition(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    *,
    partitioner: str,
    alpha: float | None = None,
    num_classes_per_partition: int | None = None,
    min_partition_size: int | None = None,
    self_balancing: bool | None = None,
    class_assignment_mode: str | None = None,
) -> list[np.ndarray]:
    """A flwr-datasets partitioner (by class name, e.g. ``DirichletPartitioner``) over the labels, as a fedskew scheme;
    the keyword arguments it takes are passed on (``partition_by`` is the label column, ``seed`` drawn from ``rng``)."""
    import datasets

    cls = getattr(_flwr_partitioners(), partitioner, None)
    if not isinstance(cls, type):
        raise PartitionError(f"flwr-datasets has no partitioner {partitioner!r} (e.g. DirichletPartitioner)")
    given = {
        "alpha": alpha,
        "num_classes_per_partition": num_classes_per_partition,
        "min_partition_size": min_partition_size,
        "self_balancing": self_balancing,
        "class_assignment_mode": class_assignment_mode,
    }
    sig = inspect.signature(cls.__init__).parameters
    refused = sorted(k for k, v in given.items() if v is not None and k not in sig)
    if refused:
        raise PartitionError(f"flwr partitioner {partitioner} does not take {refused}")
    kwargs = {k: v for k, v in given.items() if v is not None}
    if "partition_by" in sig:
        kwargs["partition_by"] = "label"
    if "seed" in sig:
        kwargs["seed"] = int(rng.integers(2**31 - 1))
    try:
        part = cls(num_partitions=num_clients, **kwargs)
        part.dataset = datasets.Dataset.from_dict(
            {"label": np.asarray(labels).tolist(), "_row": list(range(len(labels)))}
        )
        return [np.asarray(part.load_partition(i)["_row"], dtype=np.int64) for i in range(num_clients)]
    except (TypeError, ValueError) as exc:
        raise PartitionError(f"flwr partitioner {partitioner}: {exc}") from None
