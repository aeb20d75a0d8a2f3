"""A federation's data, resident on the device: per-client train/test tensors and a global test set."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from fedskew.config import RunConfig
from fedskew.data.partition import (
    PartitionError,
    client_class_proportions,
    dirichlet_fixed,
    domain_skew,
    label_histograms,
    long_tail,
    make_partition,
    pfllib_least_samples,
    train_test_split_clients,
)
from fedskew.data.readers import ImageDataset, digits_domains, load_dataset
from fedskew.seeding import Purpose, numpy_rng


@dataclass(frozen=True)
class ClientData:
    cid: int
    x_train: Tensor
    y_train: Tensor
    x_test: Tensor
    y_test: Tensor


@dataclass(frozen=True)
class FederatedData:
    name: str
    num_classes: int
    in_channels: int
    image_size: int
    clients: list[ClientData]
    x_test: Tensor  # global test set
    y_test: Tensor
    train_hists: np.ndarray  # [N, C] per-client training label histogram
    test_hists: np.ndarray  # [N, C] per-client local-test label histogram
    # all clients' local test sets concatenated, with the owner of each sample (for one-pass evaluation)
    local_x: Tensor
    local_y: Tensor
    local_owner: Tensor
    # domain skew: the global test set is the union of the domains' test splits
    domains: tuple[str, ...] = ()
    client_domain: np.ndarray | None = None  # [N] domain index of each client
    test_domain: Tensor | None = None  # domain index of each global test sample

    @property
    def num_clients(self) -> int:
        return len(self.clients)

    @property
    def num_train(self) -> np.ndarray:
        return self.train_hists.sum(1)


def to_float(x: np.ndarray, device: torch.device | str) -> Tensor:
    """uint8 images -> float32 in [-1, 1] ((x/255 - 0.5) / 0.5, as PFLlib stores them)."""
    t = torch.from_numpy(np.ascontiguousarray(x)).to(device)
    return t.float().div_(127.5).sub_(1.0)


def split_holdout(labels: np.ndarray, share: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Stratified split of a pool into (rest, holdout) with ``share`` of each class held out."""
    rest, hold = [], []
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        k = int(round(share * len(idx)))
        hold.append(idx[:k])
        rest.append(idx[k:])
    return np.sort(np.concatenate(rest)), np.sort(np.concatenate(hold))


def partition_params(cfg: RunConfig) -> dict[str, object]:
    """The partition's own parameters from the run configuration."""
    return {
        "iid": {},
        "dir": {"alpha": cfg.alpha, "min_size": cfg.min_size},
        "pat": {"classes_per_client": cfg.classes_per_client, "scheme": cfg.pat_scheme},
        "dirfixed": {"alpha": cfg.alpha, "samples_per_client": cfg.samples_per_client},
        "niid2": {},
        "quantity": {"beta": cfg.alpha},
    }[cfg.partition]


def _assemble(
    name: str,
    num_classes: int,
    x_pool: np.ndarray,
    y_pool: np.ndarray,
    train_parts: list[np.ndarray],
    test_parts: list[np.ndarray],
    x_gtest: np.ndarray,
    y_gtest: np.ndarray,
    dev: torch.device,
    **domain_fields: object,
) -> FederatedData:
    x_all = to_float(x_pool, dev)
    y_all = torch.from_numpy(y_pool.astype(np.int64)).to(dev)
    clients = []
    for cid, (tr, te) in enumerate(zip(train_parts, test_parts, strict=True)):
        tr_t = torch.from_numpy(tr).to(dev)
        te_t = torch.from_numpy(te).to(dev)
        clients.append(ClientData(cid, x_all[tr_t], y_all[tr_t], x_all[te_t], y_all[te_t]))
    owner = torch.cat([torch.full((len(te),), cid, dtype=torch.long) for cid, te in enumerate(test_parts)]).to(dev)
    return FederatedData(
        name=name,
        num_classes=num_classes,
        in_channels=int(x_pool.shape[1]),
        image_size=int(x_pool.shape[2]),
        clients=clients,
        x_test=to_float(x_gtest, dev),
        y_test=torch.from_numpy(y_gtest.astype(np.int64)).to(dev),
        train_hists=label_histograms(y_pool, train_parts, num_classes),
        test_hists=label_histograms(y_pool, test_parts, num_classes),
        local_x=torch.cat([c.x_test for c in clients]),
        local_y=torch.cat([c.y_test for c in clients]),
        local_owner=owner,
        **domain_fields,  # type: ignore[arg-type]
    )


def build_domain_federated(cfg: RunConfig) -> FederatedData:
    """FedHEAL-style domain skew: ``clients / D`` clients per domain, each holding a random ``domain_fraction`` of
    its domain's training set (disjoint within a domain); the global test set is every domain's test split."""
    domains = digits_domains(cfg.data_dir, size=cfg.image_size, seed=cfg.seed, download=cfg.download)
    names = tuple(domains)
    d = len(names)
    if cfg.clients % d:
        raise PartitionError(
            f"domain skew needs the clients to split evenly over the {d} available domains {list(names)}: "
            f"clients={cfg.clients} (try {d * max(1, round(cfg.clients / d))})"
        )
    per = cfg.clients // d
    sizes = [len(domains[n].y_train) for n in names]
    parts = domain_skew(sizes, [per] * d, cfg.domain_fraction, numpy_rng(cfg.seed, Purpose.PARTITION))
    offsets = np.cumsum([0, *sizes])
    pooled = [offsets[dom] + idx for dom, idx in parts]
    train_parts, test_parts = train_test_split_clients(pooled, cfg.train_ratio, numpy_rng(cfg.seed, Purpose.SPLIT, 1))
    x_pool = np.concatenate([domains[n].x_train for n in names])
    y_pool = np.concatenate([domains[n].y_train for n in names])
    x_test = np.concatenate([domains[n].x_test for n in names])
    y_test = np.concatenate([domains[n].y_test for n in names])
    dev = torch.device(cfg.device)
    test_domain = np.concatenate([np.full(len(domains[n].y_test), i) for i, n in enumerate(names)])
    return _assemble(
        cfg.dataset,
        domains[names[0]].num_classes,
        x_pool,
        y_pool,
        train_parts,
        test_parts,
        x_test,
        y_test,
        dev,
        domains=names,
        client_domain=np.array([dom for dom, _ in parts]),
        test_domain=torch.from_numpy(test_domain).long().to(dev),
    )


def build_pfllib(cfg: RunConfig, ds: ImageDataset) -> FederatedData:
    """PFLlib's split (protocols.md section 1): the official train and test sets merged into one pool;
    ``pat`` is the blocked assignment, ``iid`` is ``pat`` with every class, ``dir`` retries until every client holds
    ``least_samples = int(min(batch/(1-train_ratio), N/clients/2))``; a per-client ``train_ratio`` split. PFLlib has
    no separate global test set: the global test set here is the union of the clients' test splits."""
    if ds.x_test is not None and ds.y_test is not None:
        x_pool, y_pool = np.concatenate([ds.x_train, ds.x_test]), np.concatenate([ds.y_train, ds.y_test])
    else:
        x_pool, y_pool = ds.x_train, ds.y_train
    rng = numpy_rng(cfg.seed, Purpose.PARTITION)
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
    return _assemble(
        ds.name,
        ds.num_classes,
        x_pool,
        y_pool,
        train_parts,
        test_parts,
        x_pool[test_idx],
        y_pool[test_idx],
        torch.device(cfg.device),
    )


def fedcac_proportions(cfg: RunConfig, num_classes: int, rng: np.random.Generator) -> np.ndarray:
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


def train_and_test_pools(cfg: RunConfig, ds: ImageDataset) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The dataset's official train and test splits, or, without a test split, a stratified ``holdout`` of the
    training split as the test pool: ``(x_train, y_train, x_test, y_test)``."""
    if ds.x_test is None or ds.y_test is None:
        pool_idx, hold_idx = split_holdout(ds.y_train, cfg.holdout, numpy_rng(cfg.seed, Purpose.SPLIT, 0))
        return ds.x_train[pool_idx], ds.y_train[pool_idx], ds.x_train[hold_idx], ds.y_train[hold_idx]
    return ds.x_train, ds.y_train, ds.x_test, ds.y_test


def fixed_size_draws(
    cfg: RunConfig, y_tr: np.ndarray, y_te: np.ndarray, n_train: int, n_test: int
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Every client draws ``n_train`` samples from the train pool ``y_tr`` and ``n_test`` from the separate test pool
    ``y_te``, both with its class proportions q_i (:func:`fedcac_proportions`). Samples never repeat within a client
    but may be shared across clients (Fling); no test sample can be in any client's training split, since the pools
    are disjoint. q and the train draw share one partition stream; the test draw has its own."""
    classes = np.unique(y_tr)  # q's columns: the classes present in the training pool
    rng = numpy_rng(cfg.seed, Purpose.PARTITION)
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


def build_fedcac(cfg: RunConfig, ds: ImageDataset) -> FederatedData:
    """FedCAC's protocol (docs/protocols.md): every client draws exactly ``samples_per_client`` training samples
    from the official training split and ``test_samples_per_client`` local test samples from the official test
    split (a stratified ``holdout`` when the dataset has none), both with the same class proportions q_i
    (:func:`fixed_size_draws`). The global test set is the whole test split."""
    x_tr, y_tr, x_te, y_te = train_and_test_pools(cfg, ds)
    train_parts, test_parts = fixed_size_draws(cfg, y_tr, y_te, cfg.samples_per_client, cfg.test_samples_per_client)
    # one pool of the train pool then the test pool, compacted to the samples drawn (the whole pool would only be
    # converted to float and indexed)
    used_tr = np.unique(np.concatenate(train_parts))
    used_te = np.unique(np.concatenate(test_parts))
    x_pool = np.concatenate([x_tr[used_tr], x_te[used_te]])
    y_pool = np.concatenate([y_tr[used_tr], y_te[used_te]])
    train_parts = [np.searchsorted(used_tr, p) for p in train_parts]
    test_parts = [len(used_tr) + np.searchsorted(used_te, p) for p in test_parts]
    return _assemble(
        ds.name,
        ds.num_classes,
        x_pool,
        y_pool,
        train_parts,
        test_parts,
        x_te,
        y_te,
        torch.device(cfg.device),
    )


def dirfixed_local_split(cfg: RunConfig, y_pool: np.ndarray) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """``dirfixed`` under the default protocol: clients draw overlapping fixed-size samples (Fling), so splitting each
    client's draw into train and test would put one client's test samples into other clients' training splits.
    Instead the pool is first split, stratified, into a local-train pool (``train_ratio``) and a local-test pool, and
    every client draws ``round(samples_per_client * train_ratio)`` training samples from the first and the rest from
    the second with the same class proportions (:func:`fixed_size_draws`, as the fedcac protocol does with the
    official splits). Returns per-client indices into ``y_pool``."""
    tr_pool, te_pool = split_holdout(y_pool, 1.0 - cfg.train_ratio, numpy_rng(cfg.seed, Purpose.SPLIT, 2))
    n_train = int(round(cfg.samples_per_client * cfg.train_ratio))
    n_test = cfg.samples_per_client - n_train
    if n_train < 1 or n_test < 1:
        raise PartitionError(
            f"partition 'dirfixed': samples_per_client={cfg.samples_per_client} with train_ratio={cfg.train_ratio} "
            f"leaves {n_train} training and {n_test} local test samples per client; both must be at least 1"
        )
    train_parts, test_parts = fixed_size_draws(cfg, y_pool[tr_pool], y_pool[te_pool], n_train, n_test)
    return [tr_pool[p] for p in train_parts], [te_pool[p] for p in test_parts]


def build_federated(cfg: RunConfig, dataset: ImageDataset | None = None) -> FederatedData:
    """Load, partition and split ``cfg.dataset`` with the run seed; place every tensor on ``cfg.device``."""
    if cfg.partition == "domain":
        return build_domain_federated(cfg)
    ds = dataset if dataset is not None else load_dataset(cfg.dataset, cfg.data_dir, download=cfg.download)
    if cfg.protocol == "pfllib":
        return build_pfllib(cfg, ds)
    if cfg.protocol == "fedcac":
        return build_fedcac(cfg, ds)
    x_pool, y_pool, x_gtest, y_gtest = train_and_test_pools(cfg, ds)
    if cfg.imbalance_ratio is not None:  # global long tail first, then any partition of what remains
        keep = long_tail(y_pool, cfg.imbalance_ratio, numpy_rng(cfg.seed, Purpose.DATA, 1))
        x_pool, y_pool = x_pool[keep], y_pool[keep]
    if cfg.partition == "dirfixed":
        train_parts, test_parts = dirfixed_local_split(cfg, y_pool)
    else:
        parts = make_partition(
            cfg.partition, y_pool, cfg.clients, numpy_rng(cfg.seed, Purpose.PARTITION), **partition_params(cfg)
        )
        split_rng = numpy_rng(cfg.seed, Purpose.SPLIT, 1)
        train_parts, test_parts = train_test_split_clients(parts, cfg.train_ratio, split_rng)
    return _assemble(
        ds.name, ds.num_classes, x_pool, y_pool, train_parts, test_parts, x_gtest, y_gtest, torch.device(cfg.device)
    )
