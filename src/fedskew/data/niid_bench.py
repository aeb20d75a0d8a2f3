"""NIID-Bench's protocol (Li, Diao, Chen and He, "Federated Learning on Non-IID Data Silos: An Experimental Study",
ICDE 2022; code: Xtra-Computing/NIID-Bench, ``utils.partition_data``, ``utils.get_dataloader``, ``experiments.py``).

What the benchmark does, and :func:`build_niid_bench` with it:

* the official training split is partitioned among the clients, who train on **all** of their part (no local test
  split); the official test split is the test set of the global model, scored after every round;
* images as ``ToTensor`` gives them: pixels in [0, 1], no normalization;
* partitions (``--partition``): ``iid`` (``homo``: a permutation cut into near-equal pieces), ``dir``
  (``noniid-labeldir``: per-class Dir(beta) with the self-balancing rule, redrawn until every client holds 10),
  ``pat`` (``noniid-#labelk``: :func:`fedskew.data.partition.label_skew._pat_niid_bench`) and ``quantity``
  (``iid-diff-quantity``: sizes ~ Dir(beta), redrawn until every client holds 10);
* noise-based feature skew (``--feature-noise sigma``, NIID-Bench ``--noise``): client i's images get Gaussian noise of
  std ``sigma * i / (N - 1)`` (client 0 none, the last client sigma), and the test set the global model is scored on
  is the N copies of the test split, copy i with client i's noise (NIID-Bench concatenates the clients' noisy test
  loaders).

NIID-Bench adds the noise in its data loader, a fresh draw at every access. fedskew does the same for training
(``--noise-draw access``, the default: the local loop adds the client's noise to every batch it draws, from the
client's seeded stream) or bakes one draw per sample into the client's data (``--noise-draw once``; then
``--batched-clients`` can batch the clients). The test copies are drawn once, seeded (a fresh draw per evaluation only
adds sampling noise to the score: the one departure, named). Each client also gets a disjoint share of the (noisy)
test split as its local test split, so that fedskew's per-client views exist; the benchmark reports none of them.

``--partition-rng raw`` draws the partition from ``numpy.random.default_rng(federation seed)`` as Flower's replication
(adap/flower ``baselines/niid_bench``) does, so ``--data-seed 42`` gives its partition client for client: ``dir`` and
``pat`` make the same draws in the same order; for ``iid`` Flower draws ``choice(n, n, replace=False)`` where the
permutation above is drawn, and under raw so does fedskew.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from fedskew.data.partition import PartitionError, label_histograms, make_partition
from fedskew.data.pools import ClientData, FederatedData, input_shape, is_tokens, train_and_test_pools
from fedskew.data.readers import ImageDataset
from fedskew.data.settings import DataSettings
from fedskew.seeding import Purpose, numpy_rng, partition_generator

PARTITIONS = ("iid", "dir", "pat", "quantity")  # homo, noniid-labeldir, noniid-#labelk, iid-diff-quantity


def noise_levels(sigma: float, num_clients: int) -> np.ndarray:
    """NIID-Bench's per-client noise std: ``sigma * i / (N - 1)`` for client i (one client: none)."""
    if num_clients < 2:
        return np.zeros(num_clients)
    return sigma * np.arange(num_clients) / (num_clients - 1)


def niid_bench_parts(cfg: DataSettings, y: np.ndarray) -> list[np.ndarray]:
    """The clients' training indices into ``y`` by NIID-Bench's rules (module docstring)."""
    rng = partition_generator(cfg.seed, cfg.partition_rng)
    if cfg.partition == "iid":
        if cfg.partition_rng == "raw":  # Flower's niid_bench partition_data: choice(n, n, replace=False), cut in order
            return [np.sort(p) for p in np.array_split(rng.choice(len(y), len(y), replace=False), cfg.clients)]
        return make_partition("iid", y, cfg.clients, rng)
    if cfg.partition == "dir":
        return make_partition("dir", y, cfg.clients, rng, alpha=cfg.alpha, min_size=cfg.min_size)
    if cfg.partition == "pat":
        return make_partition(
            "pat", y, cfg.clients, rng, classes_per_client=cfg.classes_per_client, scheme="niid-bench"
        )
    if cfg.partition == "quantity":
        return make_partition("quantity", y, cfg.clients, rng, beta=cfg.alpha, min_size=cfg.min_size, rule="niid-bench")
    raise PartitionError(f"protocol 'niid-bench' supports partitions {', '.join(PARTITIONS)}, not {cfg.partition!r}")


def unit_float(x: np.ndarray, device: torch.device) -> Tensor:
    """Images as ``ToTensor`` gives them: uint8 -> float32 in [0, 1]; float features as they are; token ids int64."""
    t = torch.from_numpy(np.ascontiguousarray(x))
    if is_tokens(x):
        return t.long().to(device)
    return (t.float() if t.is_floating_point() else t.float().div_(255.0)).to(device)


def _noisy(x: Tensor, std: float, rng: np.random.Generator) -> Tensor:
    if std <= 0:
        return x
    noise = torch.from_numpy(rng.standard_normal(tuple(x.shape), dtype=np.float32)).to(x.device)
    return x + noise * float(std)


def build_niid_bench(cfg: DataSettings, ds: ImageDataset) -> FederatedData:
    """The federation as NIID-Bench builds it (module docstring)."""
    tr, te = train_and_test_pools(cfg, ds)
    if cfg.feature_noise and is_tokens(tr.x):
        raise PartitionError("feature_noise adds Gaussian noise to images or features, not to token ids (text)")
    parts = niid_bench_parts(cfg, tr.y)
    dev = torch.device(cfg.device)
    levels = noise_levels(cfg.feature_noise, cfg.clients)
    noise_rng = numpy_rng(cfg.seed, Purpose.DATA, 2)
    x_pool = unit_float(tr.x, dev)
    y_pool = torch.from_numpy(tr.y.astype(np.int64)).to(dev)
    x_test = unit_float(te.x, dev)
    y_test = torch.from_numpy(te.y.astype(np.int64)).to(dev)
    # the test split the global model is scored on: one copy per noise level (one copy without noise)
    copies = [_noisy(x_test, s, noise_rng) for s in levels] if cfg.feature_noise else [x_test]
    shares = np.array_split(numpy_rng(cfg.seed, Purpose.SPLIT, 1).permutation(len(te.y)), cfg.clients)
    clients = []
    for cid, (part, share) in enumerate(zip(parts, shares, strict=True)):
        idx = torch.from_numpy(part).to(dev)
        sh = torch.from_numpy(np.sort(share)).to(dev)
        copy = copies[cid] if cfg.feature_noise else x_test
        once = cfg.noise_draw == "once"
        clients.append(
            ClientData(
                cid,
                _noisy(x_pool[idx], levels[cid], noise_rng) if once else x_pool[idx],
                y_pool[idx],
                copy[sh],
                y_test[sh],
                tr.index[part],
                te.index[np.sort(share)],
                input_noise=0.0 if once else float(levels[cid]),
            )
        )
    owner = torch.cat([torch.full((len(s),), cid, dtype=torch.long) for cid, s in enumerate(shares)]).to(dev)
    in_channels, image_size = input_shape(tr.x, len(ds.vocabulary))
    return FederatedData(
        name=ds.name,
        num_classes=ds.num_classes,
        in_channels=in_channels,
        image_size=image_size,
        clients=clients,
        x_test=torch.cat(copies),
        y_test=y_test.repeat(len(copies)),
        train_hists=label_histograms(tr.y, parts, ds.num_classes),
        test_hists=label_histograms(te.y, [np.sort(s) for s in shares], ds.num_classes),
        local_x=torch.cat([c.x_test for c in clients]),
        local_y=torch.cat([c.y_test for c in clients]),
        local_owner=owner,
        test_index=np.tile(te.index, len(copies)),
        vocabulary=ds.vocabulary,
    )
