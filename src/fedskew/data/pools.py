"""A federation's data, resident on the device (per-client train/test tensors and a global test set), and the pieces
every protocol assembles one from: pools of samples with their source indices, and :func:`assemble`.

Every sample also carries its **source index**, the position of the sample in the dataset as read: the dataset's
training split first, then its test split (index ``len(y_train) + j`` is ``x_test[j]``); for a domain suite
(``digits_domains``, ``office_caltech``) the domains' training splits concatenated in domain order, then their test
splits in the same order. A holdout taken from a dataset without a test split (digits) keeps its training-split indices.
``ClientData.train_index`` / ``test_index`` and ``FederatedData.test_index`` hold these indices (int64 numpy arrays, row
``i`` of a tensor came from source index ``index[i]``), so that where every sample came from can be checked, e.g. that
no test sample sits in a training split (tests/test_no_leakage.py). For per-client data (``--partition given``) the
source order is every client's training file in client order, then every client's test file in client order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from fedskew.data.partition import label_histograms
from fedskew.data.readers import ImageDataset
from fedskew.data.settings import DataSettings
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
    # NIID-Bench's feature noise drawn at every access: the std of the Gaussian noise the local loop adds to every
    # training batch of this client (0: none; ``noise_draw: once`` bakes it into x_train instead)
    input_noise: float = 0.0


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
    # clients that never train (``heldout_clients``): evaluated only; ``clients`` are the ones that train
    heldout: tuple[ClientData, ...] = ()

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


def assemble(
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
