"""A federation's data, resident on the device: per-client train/test tensors and a global test set.

Every sample also carries its **source index**, the position of the sample in the dataset as read: the dataset's
training split first, then its test split (index ``len(y_train) + j`` is ``x_test[j]``); for a domain suite
(``digits_domains``, ``office_caltech``) the domains' training splits concatenated in domain order, then their test
splits in the same order. A holdout taken from
a dataset without a test split (digits) keeps its training-split indices. ``ClientData.train_index`` /
``test_index`` and ``FederatedData.test_index`` hold these indices (int64 numpy arrays, row ``i`` of a tensor came
from source index ``index[i]``), so that where every sample came from can be checked, e.g. that no test sample sits
in a training split (tests/test_no_leakage.py). For per-client data (``--partition given``) the source order is every
client's training file in client order, then every client's test file in client order.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

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
from fedskew.data.partition.registry import BUILTIN
from fedskew.data.readers import ClientDatasets, ImageDataset, load_source
from fedskew.data.readers.domains import domain_suite
from fedskew.data.settings import DataSettings, HasDataSettings, data_settings
from fedskew.schema import ConfigError
from fedskew.seeding import Purpose, numpy_rng


@dataclass(frozen=True)
class ClientData:
    cid: int
    x_train: Tensor
    y_train: Tensor
    x_test: Tensor
    y_test: Tensor
    # source index of every row of x_train / x_test (module docstring); None only for hand-built data
    train_index: np.ndarray | None = None
    test_index: np.ndarray | None = None
    # the client's validation split, carved from its training data (``validation`` > 0; see :func:`carve_validation`)
    x_val: Tensor | None = None
    y_val: Tensor | None = None
    val_index: np.ndarray | None = None


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
    test_index: np.ndarray | None = None  # source index of every global test sample (module docstring)
    # text: the word of every token id (the reader's, built from the training split); written to RUN_DIR/vocab.txt
    vocabulary: tuple[str, ...] = ()

    @property
    def num_clients(self) -> int:
        return len(self.clients)

    @property
    def holds_tokens(self) -> bool:
        """Whether the samples are token ids (integer tensors, text) rather than float images or features."""
        x = self.clients[0].x_train if self.clients else self.x_test
        return not x.is_floating_point()

    @property
    def num_train(self) -> np.ndarray:
        return self.train_hists.sum(1)


class Pool(NamedTuple):
    """Samples as uint8 images ``x``, labels ``y`` and the source index of each (module docstring)."""

    x: np.ndarray
    y: np.ndarray
    index: np.ndarray

    def take(self, idx: np.ndarray) -> Pool:
        return Pool(self.x[idx], self.y[idx], self.index[idx])


def is_tokens(x: np.ndarray) -> bool:
    """Whether ``x`` holds token ids (an integer array other than uint8: a text reader's ``[N, L]``)."""
    return x.dtype.kind in "iu" and x.dtype != np.uint8


def to_float(x: np.ndarray, device: torch.device | str) -> Tensor:
    """uint8 images -> float32 in [-1, 1] ((x/255 - 0.5) / 0.5, as PFLlib stores them); floating-point features
    (user data through :mod:`fedskew.api`) are taken as they are, as float32; token ids (:func:`is_tokens`) stay
    integers, as int64, for the model's embedding."""
    t = torch.from_numpy(np.ascontiguousarray(x)).to(device)
    if is_tokens(x):
        return t.long()
    if t.is_floating_point():
        return t.float()
    return t.float().div_(127.5).sub_(1.0)


def input_shape(x: np.ndarray, vocab_size: int = 0) -> tuple[int, int]:
    """``(in_channels, image_size)`` the model zoo builds for: square images ``[N, C, S, S]`` are (C, S); token ids
    ``[N, L]`` are (vocabulary size, L), the vocabulary size ``vocab_size`` (else the largest id + 1), which
    ``textcnn`` embeds; any other sample shape is a flat feature vector of (product of the sample's dimensions, 1),
    which ``auto`` gives an MLP."""
    if x.ndim == 2 and is_tokens(x):
        return vocab_size or (int(x.max()) + 1 if x.size else 2), int(x.shape[1])
    if x.ndim == 4 and x.shape[2] == x.shape[3]:
        return int(x.shape[1]), int(x.shape[2])
    return int(np.prod(x.shape[1:])), 1


def split_holdout(labels: np.ndarray, share: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Stratified split of a pool into (rest, holdout) with ``share`` of each class held out."""
    rest, hold = [], []
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        k = int(round(share * len(idx)))
        hold.append(idx[:k])
        rest.append(idx[k:])
    return np.sort(np.concatenate(rest)), np.sort(np.concatenate(hold))


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



def _assemble(
    name: str,
    num_classes: int,
    pool: Pool,
    train_parts: list[np.ndarray],
    test_parts: list[np.ndarray],
    gtest: Pool,
    dev: torch.device,
    vocabulary: tuple[str, ...] = (),
    **domain_fields: object,
) -> FederatedData:
    """The federation from per-client train/test indices into ``pool``; ``gtest`` is the global test set;
    ``vocabulary``: the words of the token ids (text)."""
    x_all = to_float(pool.x, dev)
    y_all = torch.from_numpy(pool.y.astype(np.int64)).to(dev)
    clients = []
    for cid, (tr, te) in enumerate(zip(train_parts, test_parts, strict=True)):
        tr_t = torch.from_numpy(tr).to(dev)
        te_t = torch.from_numpy(te).to(dev)
        tr_i, te_i = pool.index[tr], pool.index[te]
        clients.append(ClientData(cid, x_all[tr_t], y_all[tr_t], x_all[te_t], y_all[te_t], tr_i, te_i))
    owner = torch.cat([torch.full((len(te),), cid, dtype=torch.long) for cid, te in enumerate(test_parts)]).to(dev)
    in_channels, image_size = input_shape(pool.x, len(vocabulary))
    return FederatedData(
        name=name,
        num_classes=num_classes,
        in_channels=in_channels,
        image_size=image_size,
        clients=clients,
        x_test=to_float(gtest.x, dev),
        y_test=torch.from_numpy(gtest.y.astype(np.int64)).to(dev),
        train_hists=label_histograms(pool.y, train_parts, num_classes),
        test_hists=label_histograms(pool.y, test_parts, num_classes),
        local_x=torch.cat([c.x_test for c in clients]),
        local_y=torch.cat([c.y_test for c in clients]),
        local_owner=owner,
        test_index=gtest.index,
        vocabulary=vocabulary,
        **domain_fields,  # type: ignore[arg-type]
    )


def build_domain_federated(cfg: DataSettings) -> FederatedData:
    """FedHEAL-style domain skew: ``clients / D`` clients per domain, each holding a random ``domain_fraction`` of
    its domain's training set (disjoint within a domain); the global test set is every domain's test split."""
    suite = domain_suite(cfg.dataset)  # e.g. FedHEAL's Digits or Office-Caltech; a domain without files is skipped
    domains = suite.load(cfg.data_dir, size=cfg.image_size, seed=cfg.seed, download=cfg.download)
    names = tuple(domains)
    missing = [n for n in suite.domains if n not in names] if set(suite.domains) & set(names) else []
    if missing:
        import warnings

        warnings.warn(
            f"{cfg.dataset}: no files for {', '.join(missing)} (searched {cfg.data_dir or '$FEDSKEW_DATA'}); "
            f"running on {len(names)} domains ({', '.join(names)}) instead of FedHEAL's {len(suite.domains)}",
            UserWarning,
            stacklevel=2,
        )
    d = len(names)
    if cfg.clients % d:
        raise PartitionError(
            f"domain skew needs the clients to split evenly over the {d} available domains {list(names)}: "
            f"clients={cfg.clients} (try {d * max(1, round(cfg.clients / d))})"
        )
    per = cfg.clients // d
    sizes = [len(domains[n].y_train) for n in names]
    labels = [domains[n].y_train for n in names] if suite.every_class else None
    parts = domain_skew(sizes, [per] * d, cfg.domain_fraction, numpy_rng(cfg.seed, Purpose.PARTITION), labels=labels)
    offsets = np.cumsum([0, *sizes])
    pooled = [offsets[dom] + idx for dom, idx in parts]
    train_parts, test_parts = train_test_split_clients(pooled, cfg.train_ratio, numpy_rng(cfg.seed, Purpose.SPLIT, 1))
    n_train = int(offsets[-1])
    pool = Pool(
        np.concatenate([domains[n].x_train for n in names]),
        np.concatenate([domains[n].y_train for n in names]),
        np.arange(n_train, dtype=np.int64),
    )
    y_test = np.concatenate([domains[n].y_test for n in names])
    gtest = Pool(
        np.concatenate([domains[n].x_test for n in names]), y_test, n_train + np.arange(len(y_test), dtype=np.int64)
    )
    dev = torch.device(cfg.device)
    test_domain = np.concatenate([np.full(len(domains[n].y_test), i) for i, n in enumerate(names)])
    return _assemble(
        cfg.dataset,
        domains[names[0]].num_classes,
        pool,
        train_parts,
        test_parts,
        gtest,
        dev,
        domains=names,
        client_domain=np.array([dom for dom, _ in parts]),
        test_domain=torch.from_numpy(test_domain).long().to(dev),
    )


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


def train_and_test_pools(cfg: DataSettings, ds: ImageDataset) -> tuple[Pool, Pool]:
    """The dataset's official train and test splits, or, without a test split, a stratified ``holdout`` of the
    training split as the test pool: ``(train pool, test pool)``, with source indices."""
    n = len(ds.y_train)
    if ds.x_test is None or ds.y_test is None:
        pool_idx, hold_idx = split_holdout(ds.y_train, cfg.holdout, numpy_rng(cfg.seed, Purpose.SPLIT, 0))
        train = Pool(ds.x_train, ds.y_train, np.arange(n, dtype=np.int64))
        return train.take(pool_idx), train.take(hold_idx)
    test_index = n + np.arange(len(ds.y_test), dtype=np.int64)
    return Pool(ds.x_train, ds.y_train, np.arange(n, dtype=np.int64)), Pool(ds.x_test, ds.y_test, test_index)


def fixed_size_draws(
    cfg: DataSettings, y_tr: np.ndarray, y_te: np.ndarray, n_train: int, n_test: int
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
    return _assemble(
        ds.name, ds.num_classes, pool, train_parts, test_parts, te, torch.device(cfg.device), ds.vocabulary
    )


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


def build_given_federated(cfg: DataSettings, src: ClientDatasets) -> FederatedData:
    """The clients of per-client data files as they are (``--partition given``): client ``i`` trains on its training
    file and is tested on its test file (without test files, its data is split with ``train_ratio``, seeded as every
    partition). There is no separate global test set (as in PFLlib): the global test set is the union of the clients'
    test splits. The number of clients is the data's: ``cfg.clients`` must match it."""
    if cfg.partition != "given":
        raise ConfigError(
            f"{cfg.data_dir}: holds per-client files ({src.num_clients} clients), whose partition is given: set "
            f"partition: given (--partition given) instead of {cfg.partition!r}"
        )
    if cfg.protocol not in ("fedskew", "pfllib"):
        raise ConfigError(f"partition 'given' runs under protocol fedskew or pfllib, not {cfg.protocol!r}")
    if cfg.clients != src.num_clients:
        raise ConfigError(
            f"{cfg.data_dir}: holds {src.num_clients} clients but clients={cfg.clients}: set clients: "
            f"{src.num_clients} (--clients {src.num_clients})"
        )
    xs = list(src.x_train) + list(src.x_test or [])
    ys = list(src.y_train) + list(src.y_test or [])
    offsets = np.cumsum([0, *(len(y) for y in ys)])
    ranges = [np.arange(offsets[i], offsets[i + 1], dtype=np.int64) for i in range(len(ys))]
    k = src.num_clients
    if src.x_test is not None:
        train_parts, test_parts = ranges[:k], ranges[k:]
    else:
        split_rng = numpy_rng(cfg.seed, Purpose.SPLIT, 1)
        train_parts, test_parts = train_test_split_clients(ranges, cfg.train_ratio, split_rng)
    pool = Pool(np.concatenate(xs), np.concatenate(ys), np.arange(int(offsets[-1]), dtype=np.int64))
    gtest = pool.take(np.concatenate(test_parts))
    return _assemble(src.name, src.num_classes, pool, train_parts, test_parts, gtest, torch.device(cfg.device))


def carve_validation(data: FederatedData, share: float, seed: int) -> FederatedData:
    """Every client's training split split again into training and a **validation split** of ``share`` of its
    samples (as :func:`train_test_split_clients` splits a client: random, not stratified, at least one sample on each
    side; seeded by ``seed`` alone, stream ``SPLIT/3``). The validation samples leave the training split, so
    ``train_hists`` (and with them every sample-share weight and label histogram the server sees) count only what the
    clients train on. The clients' test splits and the global test set are untouched: see :func:`validation_as_test`
    for a federation evaluated on the validation splits instead."""
    if not 0 < share < 1:
        raise ConfigError(f"validation must be a share in (0, 1), got {share!r}")
    positions = [np.arange(len(c.y_train), dtype=np.int64) for c in data.clients]
    try:
        keep, val = train_test_split_clients(positions, 1.0 - share, numpy_rng(seed, Purpose.SPLIT, 3))
    except PartitionError as exc:
        raise PartitionError(f"validation={share}: a client's training split is too small to carve: {exc}") from None
    clients = []
    for c, tr, va in zip(data.clients, keep, val, strict=True):
        tr_t, va_t = torch.from_numpy(tr).to(c.y_train.device), torch.from_numpy(va).to(c.y_train.device)
        index = c.train_index
        clients.append(
            replace(
                c,
                x_train=c.x_train[tr_t],
                y_train=c.y_train[tr_t],
                train_index=None if index is None else index[tr],
                x_val=c.x_train[va_t],
                y_val=c.y_train[va_t],
                val_index=None if index is None else index[va],
            )
        )
    hists = np.stack([np.bincount(c.y_train.cpu().numpy(), minlength=data.num_classes) for c in clients])
    return replace(data, clients=clients, train_hists=hists.astype(data.train_hists.dtype))


def validation_as_test(data: FederatedData) -> FederatedData:
    """The federation evaluated on its validation splits (``evaluate_on: validation``, what ``fedskew tune`` runs):
    every client's test split is its validation split and the global test set is the union of the validation splits
    in client order (under domain skew each sample keeps its client's domain). No test sample is left in the
    returned federation (tests/test_no_leakage.py checks it by source index), so a search that reads only this
    federation cannot select on test data."""
    if any(c.x_val is None or c.y_val is None for c in data.clients):
        raise ConfigError("evaluate_on 'validation' needs validation splits: set validation to a share in (0, 1)")
    clients = [
        replace(c, x_test=c.x_val, y_test=c.y_val, test_index=c.val_index)  # type: ignore[arg-type]
        for c in data.clients
    ]
    dev = data.local_owner.device
    owner = torch.cat([torch.full((len(c.y_test),), c.cid, dtype=torch.long) for c in clients]).to(dev)
    x, y = torch.cat([c.x_test for c in clients]), torch.cat([c.y_test for c in clients])
    indices = [c.test_index for c in clients]
    test_domain = None
    if data.client_domain is not None and data.test_domain is not None:
        test_domain = torch.from_numpy(np.asarray(data.client_domain)).long().to(owner.device)[owner]
    hists = np.stack([np.bincount(c.y_test.cpu().numpy(), minlength=data.num_classes) for c in clients])
    return replace(
        data,
        clients=clients,
        x_test=x,
        y_test=y,
        test_hists=hists.astype(data.test_hists.dtype),
        local_x=x,
        local_y=y,
        local_owner=owner,
        test_domain=test_domain,
        test_index=None if any(i is None for i in indices) else np.concatenate(indices),  # type: ignore[arg-type]
    )


def with_validation(data: FederatedData, cfg: DataSettings) -> FederatedData:
    """The run's federation with its validation splits (``cfg.validation``) and evaluation set (``cfg.evaluate_on``)."""
    if cfg.validation:
        data = carve_validation(data, cfg.validation, cfg.seed)
    return validation_as_test(data) if cfg.evaluate_on == "validation" else data


def reader_options(cfg: DataSettings) -> dict[str, object]:
    """The options of the dataset's reader set in the configuration (``resize`` for image folders)."""
    return {"resize": cfg.resize} if cfg.resize is not None else {}


def build_federated(
    cfg: DataSettings | HasDataSettings, dataset: ImageDataset | ClientDatasets | None = None
) -> FederatedData:
    """Load, partition and split ``cfg.dataset`` with the run seed; place every tensor on ``cfg.device``. Per-client
    data (``ClientDatasets``, e.g. PFLlib's dataset folder) is used as given (:func:`build_given_federated`). Then the
    clients' validation splits are carved and, under ``evaluate_on: validation``, put in place of every test set
    (:func:`with_validation`).

    ``cfg``: the :class:`~fedskew.data.settings.DataSettings`, or a run configuration, which makes them
    (:meth:`fedskew.config.RunConfig.data_settings`); every other function here takes the settings."""
    settings = data_settings(cfg)
    return with_validation(_build_split(settings, dataset), settings)


def _build_split(cfg: DataSettings, dataset: ImageDataset | ClientDatasets | None) -> FederatedData:
    """The federation with every client's train and test split and the global test set (no validation yet)."""
    if cfg.partition == "domain":
        return build_domain_federated(cfg)
    ds = dataset
    if ds is None:
        ds = load_source(cfg.dataset, cfg.data_dir, download=cfg.download, **reader_options(cfg))
    if isinstance(ds, ClientDatasets):
        return build_given_federated(cfg, ds)
    if cfg.partition == "given":
        raise ConfigError(
            f"dataset {ds.name!r} is one pool of samples without a client assignment, so partition 'given' has no "
            f"clients to use: choose a partition such as dir or iid, or give per-client files (train/0.npz, ...)"
        )
    if cfg.protocol == "pfllib":
        return build_pfllib(cfg, ds)
    if cfg.protocol == "fedcac":
        return build_fedcac(cfg, ds)
    pool, gtest = train_and_test_pools(cfg, ds)
    if cfg.imbalance_ratio is not None:  # global long tail first, then any partition of what remains
        pool = pool.take(long_tail(pool.y, cfg.imbalance_ratio, numpy_rng(cfg.seed, Purpose.DATA, 1)))
    if cfg.partition == "dirfixed":
        train_parts, test_parts = dirfixed_local_split(cfg, pool.y)
    else:
        parts = make_partition(
            cfg.partition, pool.y, cfg.clients, numpy_rng(cfg.seed, Purpose.PARTITION), **partition_params(cfg)
        )
        split_rng = numpy_rng(cfg.seed, Purpose.SPLIT, 1)
        train_parts, test_parts = train_test_split_clients(parts, cfg.train_ratio, split_rng)
    dev = torch.device(cfg.device)
    return _assemble(ds.name, ds.num_classes, pool, train_parts, test_parts, gtest, dev, ds.vocabulary)
