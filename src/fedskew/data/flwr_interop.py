"""fedskew's partitions and flwr-datasets' partitioners, each usable in the other (the ``[hf]`` extra).

- :class:`FedskewPartitioner`: a ``flwr_datasets.partitioner.Partitioner`` that cuts the dataset it is given with a
  fedskew scheme (``dir``, ``pat``, ``niid2``, ``quantity``, a registered one, ...), drawing from the same seeded
  stream as ``fedskew run`` (``--seed``, partition stream), so a Flower user's ``FederatedDataset(...,
  partitioners={"train": FedskewPartitioner("dir", 10, alpha=0.1)})`` holds exactly the clients fedskew's runs hold
  (before each client's own train/test split, which fedskew draws from another stream).
- ``--partition flwr -P partitioner=DirichletPartitioner -P alpha=0.5``: a flwr-datasets partitioner as a fedskew
  partition (:func:`fedskew.data.partition.flwr.flwr_partition`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fedskew.data.partition.flwr import _flwr_partitioners
from fedskew.seeding import Purpose, numpy_rng

try:  # the base class when flwr-datasets is installed; without it FedskewPartitioner refuses to be made
    from flwr_datasets.partitioner import Partitioner as _Base
except ImportError:  # pragma: no cover - the [hf] extra is missing
    _Base = object  # type: ignore[assignment,misc]


class FedskewPartitioner(_Base):  # type: ignore[misc,valid-type]
    """A fedskew partition scheme as a flwr-datasets partitioner: ``scheme`` (a name of
    :data:`fedskew.data.partition.PARTITIONS`) over ``num_partitions`` clients, reading the labels of column
    ``partition_by``, seeded like a fedskew run with ``seed``; ``params``: the scheme's own (``alpha=0.1``,
    ``classes_per_client=2``, ...)."""

    def __init__(self, scheme: str, num_partitions: int, *, partition_by: str = "label", seed: int = 0, **params: Any):
        if _Base is object:
            _flwr_partitioners()
        super().__init__()
        from fedskew.data.partition.registry import check_partition_params

        check_partition_params(scheme, params)
        self.scheme, self._n, self.partition_by, self.seed, self.params = (
            scheme,
            num_partitions,
            partition_by,
            seed,
            params,
        )
        self._parts: list[np.ndarray] | None = None

    @property
    def num_partitions(self) -> int:
        return self._n

    def partition_indices(self) -> list[np.ndarray]:
        """Every client's row indices into the assigned dataset (sorted), as fedskew's partition gives them."""
        if self._parts is None:
            from fedskew.data.partition.registry import make_partition

            labels = np.asarray(self.dataset[self.partition_by])
            rng = numpy_rng(self.seed, Purpose.PARTITION)
            self._parts = make_partition(self.scheme, labels, self._n, rng, **self.params)
        return self._parts

    def load_partition(self, partition_id: int) -> Any:
        parts = self.partition_indices()
        if not 0 <= partition_id < len(parts):
            raise ValueError(f"partition_id {partition_id} out of range: {len(parts)} partitions")
        return self.dataset.select(parts[partition_id].tolist())
