"""Building a federation from the run's data settings (:func:`build_federated`): the protocol's split of one pool of
samples (:mod:`fedskew.data.protocols`), a domain suite's clients (``partition: domain``), per-client data files as
they are (``partition: given``), and every client's validation split carved from its training data.

The result is a :class:`~fedskew.data.pools.FederatedData`, every sample with its source index
(:mod:`fedskew.data.pools` says how indices run), so that where every sample came from can be checked.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from fedskew.data.partition import (
    PartitionError,
    domain_skew,
    train_test_split_clients,
)
from fedskew.data.pools import (
    FederatedData,
    Pool,
    assemble,
)
from fedskew.data.protocols import PROTOCOLS
from fedskew.data.readers import ClientDatasets, ImageDataset, load_source
from fedskew.data.readers.base import check_task
from fedskew.data.readers.domains import domain_suite
from fedskew.data.settings import DataSettings, HasDataSettings, data_settings
from fedskew.schema import ConfigError
from fedskew.seeding import Purpose, numpy_rng, partition_generator


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
            f"running on {len(names)} domains ({', '.join(names)}) instead of the suite's {len(suite.domains)}",
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
    parts = domain_skew(
        sizes, [per] * d, cfg.domain_fraction, partition_generator(cfg.seed, cfg.partition_rng), labels=labels
    )
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
    return assemble(
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


def natural_clients(src: ClientDatasets, n: int, seed: int) -> ClientDatasets:
    """``n`` of the data's own clients, drawn without replacement from the seed's partition stream, in the data's
    order (every one when ``n`` is their number)."""
    if n >= src.num_clients:
        return src
    keep = np.sort(numpy_rng(seed, Purpose.PARTITION).choice(src.num_clients, size=n, replace=False))

    def pick(arrays: list[np.ndarray] | None) -> list[np.ndarray] | None:
        return None if arrays is None else [arrays[i] for i in keep]

    return ClientDatasets(
        src.name,
        src.num_classes,
        pick(src.x_train) or [],
        pick(src.y_train) or [],
        pick(src.x_test),
        pick(src.y_test),
        [src.sources[i] for i in keep],
        {**src.meta, "natural_clients": [src.sources[i] for i in keep]},
    )


def build_given_federated(cfg: DataSettings, src: ClientDatasets) -> FederatedData:
    """The clients of per-client data files as they are (``--partition given``): client ``i`` trains on its training
    file and is tested on its test file (without test files, its data is split with ``train_ratio``, seeded as every
    partition). There is no separate global test set (as in PFLlib): the global test set is the union of the clients'
    test splits. The number of clients is the data's: ``cfg.clients`` must match it. ``--partition natural`` (a
    writer, speaker or user is a client, as the data defines them): ``cfg.clients`` of them, drawn without replacement
    from the partition stream of the seed (all of them when it equals their number), in the data's order."""
    if cfg.partition not in ("given", "natural"):
        raise ConfigError(
            f"{cfg.data_dir}: holds per-client data ({src.num_clients} clients), whose partition is given: set "
            f"partition: given (--partition given), or natural to sample some of them, instead of {cfg.partition!r}"
        )
    refused = PROTOCOLS[cfg.protocol].refuse(cfg.partition, None)
    if refused is not None:
        raise ConfigError(refused)
    held = int(src.meta.get("heldout_users", 0) or 0)  # LEAF split by user: its test users, last, never train
    if held and (cfg.heldout_clients != held or cfg.partition != "given"):
        raise ConfigError(
            f"{cfg.data_dir}: split by user, its last {held} of {src.num_clients} users are test users who never "
            f"train: run them as held-out clients with --partition given --clients {src.num_clients} "
            f"--heldout-clients {held}"
        )
    if cfg.partition == "natural" and cfg.clients <= src.num_clients:
        src = natural_clients(src, cfg.clients, cfg.seed)
    if cfg.clients != src.num_clients:
        hint = "" if cfg.partition == "natural" else ", or --partition natural to sample fewer"
        raise ConfigError(
            f"{cfg.data_dir}: holds {src.num_clients} clients but clients={cfg.clients}: set clients: "
            f"{src.num_clients} (--clients {src.num_clients}){hint}"
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
    vocabulary = tuple(str(w) for w in src.meta.get("vocabulary", ()))  # token data: the word or letter of each id
    dev = torch.device(cfg.device)
    return assemble(src.name, src.num_classes, pool, train_parts, test_parts, gtest, dev, vocabulary)


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
    """The run's federation with its validation splits (``cfg.validation``) and evaluation set (``cfg.evaluate_on``),
    then its held-out clients set apart (``cfg.heldout_clients``, :func:`hold_out`)."""
    if cfg.validation:
        data = carve_validation(data, cfg.validation, cfg.seed)
    data = validation_as_test(data) if cfg.evaluate_on == "validation" else data
    return hold_out(data, cfg.heldout_clients) if cfg.heldout_clients else data


def hold_out(data: FederatedData, k: int) -> FederatedData:
    """The federation whose last ``k`` clients never train (PFLlib's ``num_new_clients``): they move to
    ``heldout`` (evaluated only), the others keep their ids 0..N-k-1 and are the federation's clients; the per-client
    tables (histograms, the clients' test samples in one tensor, domains) cover the training clients only, the global
    test set is unchanged."""
    n = data.num_clients - k
    if k < 0 or n < 1:
        raise ConfigError(f"heldout_clients={k} must leave clients that train ({data.num_clients} clients)")
    clients, heldout = data.clients[:n], tuple(data.clients[n:])
    keep = data.local_owner < n
    return replace(
        data,
        clients=clients,
        heldout=heldout,
        train_hists=data.train_hists[:n],
        test_hists=data.test_hists[:n],
        local_x=data.local_x[keep],
        local_y=data.local_y[keep],
        local_owner=data.local_owner[keep],
        client_domain=None if data.client_domain is None else data.client_domain[:n],
    )


def reader_options(cfg: DataSettings) -> dict[str, object]:
    """The options of the dataset's reader set in the configuration (``resize`` for image folders, and the reader's
    own ``dataset_args``, ``-D KEY=VALUE``)."""
    return {**({"resize": cfg.resize} if cfg.resize is not None else {}), **cfg.dataset_args}


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
    check_task(ds.name, ds.num_classes, [ds.y_train])  # the whole dataset: one node's own data may hold one class
    if cfg.partition in ("given", "natural"):
        raise ConfigError(
            f"dataset {ds.name!r} is one pool of samples without a client assignment, so partition {cfg.partition!r} "
            "has no "
            f"clients to use: choose a partition such as dir or iid, or give per-client files (train/0.npz, ...)"
        )
    return PROTOCOLS[cfg.protocol].build(cfg, ds)
