"""Evaluation protocols: how a dataset becomes a federation and what a run's headline is, one record each.

A protocol (``--protocol``) fixes the data split's semantics and its defaults, not the method: ``fedskew`` (the
dataset's own test split is the global test set; any partition), ``pfllib`` (PFLlib's generator scripts: the splits
merged, a per-client train/test split, no separate global test set; the FedSA/FedPake numbers) and ``fedcac``
(FedCAC's fixed-size client train and test draws with shared class proportions) and ``niid-bench`` (NIID-Bench's
partitions, settings and final-round test accuracy; :mod:`fedskew.data.niid_bench`). docs/protocols.md gives the
details. Each is one :class:`Protocol` in :data:`PROTOCOLS`; the configuration, the federation builder, the engine
(which entries each client keeps) and the run recorder (the headline) read the record, never the protocol's name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from fedskew.data.niid_bench import PARTITIONS as NIID_BENCH_PARTITIONS
from fedskew.data.niid_bench import build_niid_bench
from fedskew.data.partition import (
    PartitionError,
    client_class_proportions,
    dirichlet_fixed,
    long_tail,
    make_partition,
    pfllib_least_samples,
    train_test_split_clients,
)
from fedskew.data.partition.registry import BUILTIN
from fedskew.data.pools import FederatedData, Pool, assemble, split_holdout, train_and_test_pools
from fedskew.data.readers import ImageDataset
from fedskew.data.settings import DataSettings
from fedskew.seeding import Purpose, numpy_rng, partition_generator

Builder = Callable[[DataSettings, ImageDataset], FederatedData]


@dataclass(frozen=True)
class Protocol:
    """One evaluation protocol. ``partitions``: the label partitions it supports (``None``: all); ``given``: whether
    per-client data files (``partition: given``) run under it; ``long_tail``: whether a global long tail
    (``imbalance_ratio``) applies; ``defaults``: the settings it presets (a file or a flag still wins);
    ``local``: state-dict groups every client keeps for itself under it (PFLlib: BatchNorm buffers, as its clients
    never receive the server's); ``build``: the federation from one pool of samples; ``headline``: (personalized
    method?) -> the metric its papers report, and ``statistic``: which of its summary statistics (``best``,
    ``last_n_mean`` or ``final``)."""

    name: str
    summary: str
    build: Builder
    headline: Callable[[bool], str]
    statistic: str
    partitions: tuple[str, ...] | None = None
    given: bool = True
    long_tail: bool = True
    defaults: Mapping[str, Any] = field(default_factory=dict)
    local: frozenset[str] = frozenset()
    feature_noise: bool = False  # whether it builds NIID-Bench's noise-based feature skew (``feature_noise``)

    def refuse(self, partition: str, imbalance_ratio: float | None, feature_noise: float = 0.0) -> str | None:
        """Why a configuration with these settings cannot run under this protocol (``None``: it can)."""
        own = ("given", "natural")  # the data's own clients
        if self.partitions is not None and partition not in (*self.partitions, *(own if self.given else ())):
            extra = " (and given, for per-client files)" if self.given else ""
            return f"protocol {self.name!r} supports partitions {', '.join(self.partitions)}{extra}, not {partition!r}"
        if partition in own and not self.given:
            runs = " or ".join(p.name for p in PROTOCOLS.values() if p.given)
            return f"partition {partition!r} runs under protocol {runs}, not {self.name!r}"
        if feature_noise and not self.feature_noise:
            runs = " or ".join(p.name for p in PROTOCOLS.values() if p.feature_noise)
            return (
                f"feature_noise is NIID-Bench's noise-based feature skew: run it under protocol {runs}, "
                f"not {self.name!r}"
            )
        if not self.long_tail and imbalance_ratio is not None:
            return (
                f"protocol {self.name!r} draws fixed-size client samples and has no global long tail: "
                f"imbalance_ratio must be unset, got {imbalance_ratio!r}"
            )
        return None


def partition_params(cfg: DataSettings) -> dict[str, object]:
    """The partition's own parameters from the data settings: a built-in scheme's from its dedicated settings, a
    registered one's from ``partition_args``."""
    if cfg.partition not in BUILTIN:
        return dict(cfg.partition_args)
    return {
        "iid": {},
        "dir": {"alpha": cfg.alpha, "min_size": cfg.min_size},
        "pat": {"classes_per_client": cfg.classes_per_client, "scheme": cfg.pat_scheme},
        "dirfixed": {"alpha": cfg.alpha, "samples_per_client": cfg.samples_per_client},
        "niid2": {},
        "biased": {"classes_per_client": cfg.classes_per_client, "num_uniform": cfg.uniform_clients},
        "quantity": {"beta": cfg.alpha},
    }[cfg.partition]


def build_fedskew(cfg: DataSettings, ds: ImageDataset) -> FederatedData:
    """fedskew's own protocol: the dataset's training split (less a ``holdout`` without a test split) partitioned
    among the clients, each client's part split into local train and test (``train_ratio``), and the dataset's test
    split as the global test set; a global long tail (``imbalance_ratio``) first, when set."""
    pool, gtest = train_and_test_pools(cfg, ds)
    if cfg.imbalance_ratio is not None:  # global long tail first, then any partition of what remains
        pool = pool.take(long_tail(pool.y, cfg.imbalance_ratio, numpy_rng(cfg.seed, Purpose.DATA, 1)))
    if cfg.partition == "dirfixed":
        train_parts, test_parts = dirfixed_local_split(cfg, pool.y)
    else:
        parts = make_partition(
            cfg.partition,
            pool.y,
            cfg.clients,
            partition_generator(cfg.seed, cfg.partition_rng),
            **partition_params(cfg),
        )
        split_rng = numpy_rng(cfg.seed, Purpose.SPLIT, 1)
        train_parts, test_parts = train_test_split_clients(parts, cfg.train_ratio, split_rng)
    dev = torch.device(cfg.device)
    return assemble(ds.name, ds.num_classes, pool, train_parts, test_parts, gtest, dev, ds.vocabulary)


def dirfixed_local_split(cfg: DataSettings, y_pool: np.ndarray) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """``dirfixed`` under the default protocol: clients draw overlapping fixed-size samples (Fling), so splitting each
    client's draw into train and test would put one client's test samples into other clients' training splits.
    Instead the pool is first split, stratified, into a local-train pool (``train_ratio`` of every class) and a
    local-test pool (the rest), and every client draws its training samples from the first and its local test samples
    from the second, both with its class proportions q_i (:func:`fixed_size_draws`, as the fedcac protocol does with
    the official splits). A client's ``samples_per_client`` are split as :func:`train_test_split_clients` splits any
    client (``floor(train_ratio * n)`` for training, at least 1 of each). Seeded by ``cfg.seed`` alone. Returns
    per-client indices into ``y_pool``; a pool too small for the draws raises :class:`PartitionError` naming both
    pools' sizes."""
    n = cfg.samples_per_client  # >= 2 (validated by RunConfig)
    n_train = min(max(int(np.floor(cfg.train_ratio * n + 1e-9)), 1), n - 1)
    tr_pool, te_pool = split_holdout(y_pool, 1.0 - cfg.train_ratio, numpy_rng(cfg.seed, Purpose.SPLIT, 2))
    try:
        train_parts, test_parts = fixed_size_draws(cfg, y_pool[tr_pool], y_pool[te_pool], n_train, n - n_train)
    except PartitionError as e:
        raise PartitionError(
            f"partition 'dirfixed' (protocol {cfg.protocol!r}): each of the {cfg.clients} clients draws "
            f"{n_train} training samples from a local-train pool of {len(tr_pool)} and {n - n_train} local test "
            f"samples from a disjoint local-test pool of {len(te_pool)} (samples_per_client={n}, "
            f"train_ratio={cfg.train_ratio}), which the pools cannot supply: {e}"
        ) from e
    return [tr_pool[p] for p in train_parts], [te_pool[p] for p in test_parts]


def build_pfllib(cfg: DataSettings, ds: ImageDataset) -> FederatedData:
    """PFLlib's split (protocols.md section 1): the official train and test sets merged into one pool;
    ``pat`` is the blocked assignment, ``iid`` is ``pat`` with every class, ``dir`` retries until every client holds
    ``least_samples = int(min(batch/(1-train_ratio), N/clients/2))``; a per-client ``train_ratio`` split. PFLlib has
    no separate global test set: the global test set here is the union of the clients' test splits."""
    if ds.x_test is not None and ds.y_test is not None:
        x_pool, y_pool = np.concatenate([ds.x_train, ds.x_test]), np.concatenate([ds.y_train, ds.y_test])
    else:
        x_pool, y_pool = ds.x_train, ds.y_train
    pool = Pool(x_pool, y_pool, np.arange(len(y_pool), dtype=np.int64))  # the merged pool is the source order
    rng = partition_generator(cfg.seed, cfg.partition_rng)
    least = pfllib_least_samples(len(y_pool), cfg.clients, cfg.batch_size, cfg.train_ratio)
    if cfg.partition in ("pat", "iid"):
        k = cfg.classes_per_client if cfg.partition == "pat" else ds.num_classes
        parts = make_partition(
            "pat", y_pool, cfg.clients, rng, classes_per_client=k, scheme="pfllib", least_samples=least
        )
    elif cfg.partition == "dir":
        parts = make_partition("dir", y_pool, cfg.clients, rng, alpha=cfg.alpha, min_size=least)
    else:
        raise PartitionError(f"protocol 'pfllib' supports partitions iid, pat and dir, not {cfg.partition!r}")
    train_parts, test_parts = train_test_split_clients(parts, cfg.train_ratio, numpy_rng(cfg.seed, Purpose.SPLIT, 1))
    test_idx = np.concatenate(test_parts)
    return assemble(
        ds.name,
        ds.num_classes,
        pool,
        train_parts,
        test_parts,
        pool.take(test_idx),
        torch.device(cfg.device),
        ds.vocabulary,
    )


def fedcac_proportions(cfg: DataSettings, num_classes: int, rng: np.random.Generator) -> np.ndarray:
    """FedCAC's client-wise class proportions, shape ``[clients, num_classes]``: ``dirfixed`` draws
    q_i ~ Dir(alpha * 1_C); ``pat`` gives each client ``classes_per_client`` distinct classes chosen uniformly at
    random (independently across clients), each with share 1/k."""
    if cfg.partition == "dirfixed":
        return client_class_proportions(cfg.clients, num_classes, cfg.alpha, rng)
    if cfg.partition == "pat":
        k = cfg.classes_per_client
        if k > num_classes:
            raise PartitionError(
                f"protocol 'fedcac', partition 'pat': classes_per_client={k} exceeds the number of classes "
                f"present in the training pool ({num_classes})"
            )
        q = np.zeros((cfg.clients, num_classes))
        for row in q:
            row[rng.choice(num_classes, size=k, replace=False)] = 1.0 / k
        return q
    raise PartitionError(f"protocol 'fedcac' supports partitions dirfixed and pat, not {cfg.partition!r}")


def fixed_size_draws(
    cfg: DataSettings, y_tr: np.ndarray, y_te: np.ndarray, n_train: int, n_test: int
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Every client draws ``n_train`` samples from the train pool ``y_tr`` and ``n_test`` from the separate test pool
    ``y_te``, both with its class proportions q_i (:func:`fedcac_proportions`). Samples never repeat within a client
    but may be shared across clients (Fling); no test sample can be in any client's training split, since the pools
    are disjoint. q and the train draw share one partition stream; the test draw has its own."""
    classes = np.unique(y_tr)  # q's columns: the classes present in the training pool
    rng = partition_generator(cfg.seed, cfg.partition_rng)
    q = fedcac_proportions(cfg, len(classes), rng)
    train_parts = dirichlet_fixed(y_tr, cfg.clients, cfg.alpha, rng, samples_per_client=n_train, proportions=q)
    # the test draw uses the same q restricted to the test pool's classes; a class a client's q gives mass to
    # must have test samples, else the client's test split could not follow its train proportions
    test_classes = np.unique(y_te)
    missing = np.flatnonzero(~np.isin(classes, test_classes) & (q > 0).any(axis=0))
    if missing.size:
        c = int(classes[missing[0]])
        owners = np.flatnonzero(q[:, missing[0]] > 0).tolist()
        raise PartitionError(
            f"partition {cfg.partition!r} (protocol {cfg.protocol!r}): class {c} has training samples but none in "
            f"the test pool, so clients {owners} cannot draw test samples with their training proportions"
        )
    q_test = np.zeros((cfg.clients, len(test_classes)))
    in_train = np.isin(test_classes, classes)
    q_test[:, in_train] = q[:, np.searchsorted(classes, test_classes[in_train])]
    test_parts = dirichlet_fixed(
        y_te,
        cfg.clients,
        cfg.alpha,
        numpy_rng(cfg.seed, Purpose.PARTITION, 1),
        samples_per_client=n_test,
        proportions=q_test,
    )
    return train_parts, test_parts


def build_fedcac(cfg: DataSettings, ds: ImageDataset) -> FederatedData:
    """FedCAC's protocol (docs/protocols.md): every client draws exactly ``samples_per_client`` training samples
    from the official training split and ``test_samples_per_client`` local test samples from the official test
    split (a stratified ``holdout`` when the dataset has none), both with the same class proportions q_i
    (:func:`fixed_size_draws`). The global test set is the whole test split."""
    tr, te = train_and_test_pools(cfg, ds)
    train_parts, test_parts = fixed_size_draws(cfg, tr.y, te.y, cfg.samples_per_client, cfg.test_samples_per_client)
    # one pool of the train pool then the test pool, compacted to the samples drawn (the whole pool would only be
    # converted to float and indexed)
    used_tr = np.unique(np.concatenate(train_parts))
    used_te = np.unique(np.concatenate(test_parts))
    a, b = tr.take(used_tr), te.take(used_te)
    pool = Pool(np.concatenate([a.x, b.x]), np.concatenate([a.y, b.y]), np.concatenate([a.index, b.index]))
    train_parts = [np.searchsorted(used_tr, p) for p in train_parts]
    test_parts = [len(used_tr) + np.searchsorted(used_te, p) for p in test_parts]
    return assemble(ds.name, ds.num_classes, pool, train_parts, test_parts, te, torch.device(cfg.device), ds.vocabulary)


def _fedcac_headline(personalized: bool) -> str:
    return "personal_acc_mean" if personalized else "global_local_acc_mean"


PROTOCOLS: dict[str, Protocol] = {
    "fedskew": Protocol(
        "fedskew",
        "the dataset's test split is the global test set; any partition, per-client train/test splits",
        build_fedskew,
        headline=lambda personalized: "global_acc",
        statistic="last_n_mean",
    ),
    # the PFLlib generator scripts' constants and its run-time defaults
    "pfllib": Protocol(
        "pfllib",
        "PFLlib's split: train and test merged, per-client train/test, no separate global test set",
        build_pfllib,
        headline=lambda personalized: "global_local_acc",
        statistic="best",
        partitions=("iid", "pat", "dir"),  # the partitions PFLlib's generator scripts have
        defaults={"batch_size": 10, "lr": 0.005, "train_ratio": 0.75, "clients": 20},
        local=frozenset({"buffers"}),
    ),
    # the FedCAC paper's settings (N 40, 500 train / 100 test samples per client, Dir(0.1)) with Fling's local-training
    # configs (5 epochs, batch 100, SGD lr 0.1, momentum 0.9)
    "fedcac": Protocol(
        "fedcac",
        "FedCAC's fixed-size client train and test draws with shared class proportions",
        build_fedcac,
        headline=_fedcac_headline,
        statistic="best",
        partitions=("dirfixed", "pat"),  # FedCAC's Dirichlet and pathological class proportions
        given=False,
        long_tail=False,
        defaults={
            "clients": 40,
            "samples_per_client": 500,
            "test_samples_per_client": 100,
            "local_epochs": 5,
            "batch_size": 100,
            "lr": 0.1,
            "momentum": 0.9,
            "partition": "dirfixed",
            "alpha": 0.1,
        },
    ),
    # NIID-Bench's experiments (its scripts and README): 10 parties all sampled, 50 rounds of 10 local epochs,
    # batch 64, SGD lr 0.01, momentum 0.9 (rho), weight decay 1e-5 (--reg), the simple CNN, Dir(0.5) with 10 per client
    "niid-bench": Protocol(
        "niid-bench",
        "NIID-Bench's partitions on the official training split, pixels in [0, 1], the global model's final-round "
        "accuracy on the official test split",
        build_niid_bench,
        headline=lambda personalized: "global_acc",
        statistic="final",
        partitions=NIID_BENCH_PARTITIONS,
        given=False,
        long_tail=False,
        feature_noise=True,
        defaults={
            "clients": 10,
            "join_ratio": 1.0,
            "rounds": 50,
            "local_epochs": 10,
            "batch_size": 64,
            "lr": 0.01,
            "momentum": 0.9,
            "weight_decay": 1e-5,
            "model": "lenet",
            "partition": "dir",
            "alpha": 0.5,
            "min_size": 10,
            "pat_scheme": "niid-bench",
        },
    ),
}
