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
- :func:`biased_uniform` -- FedDisco's AG News split (``biased``): k-class biased clients plus uniform all-class
  clients, equal sizes (``niid2`` is k = 2).
- :func:`long_tail` -- exponentially imbalanced subset (CIFAR-LT style), to be partitioned afterwards.
- :func:`domain_skew` -- FedHEAL: each client a random disjoint fraction of one domain's training set.
- :func:`train_test_split_clients` -- per-client train/test split (PFLlib 75/25).

The schemes live in this package by responsibility -- :mod:`.label_skew` (``pat``, ``dir``, ``dirfixed``, ``niid2``,
``biased``), :mod:`.sizes` (IID, quantity skew, long tail, domain skew), :mod:`.split` (train/test splits and label
histograms), :mod:`.registry` (:func:`make_partition`), :mod:`.base` (:class:`PartitionError` and the shared checks)
-- and are all importable from here.
"""

from fedskew.data.partition.base import PartitionError
from fedskew.data.partition.label_skew import (
    biased_uniform,
    client_class_proportions,
    dirichlet,
    dirichlet_fixed,
    niid2,
    pathological,
    pfllib_least_samples,
)
from fedskew.data.partition.registry import (
    PARTITIONS,
    make_partition,
    partition,
    register_partition,
    unregister_partition,
)
from fedskew.data.partition.sizes import domain_skew, iid, long_tail, quantity_skew
from fedskew.data.partition.split import label_histograms, train_test_split_clients

__all__ = [
    "PARTITIONS",
    "PartitionError",
    "biased_uniform",
    "client_class_proportions",
    "dirichlet",
    "dirichlet_fixed",
    "domain_skew",
    "iid",
    "label_histograms",
    "long_tail",
    "make_partition",
    "niid2",
    "partition",
    "pathological",
    "pfllib_least_samples",
    "quantity_skew",
    "register_partition",
    "train_test_split_clients",
    "unregister_partition",
]
