"""CIFAR-10 and CIFAR-100: the official python pickle batches, read with a restricted unpickler."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fedskew.data.readers.base import DataError, ImageDataset, unpickle_dict
from fedskew.data.readers.download import Remote
from fedskew.data.readers.registry import DatasetSpec, register_reader


def load_cifar(d: Path, fine: bool) -> ImageDataset:
    """CIFAR-10 (``fine=False``: data_batch_1..5 + test_batch) or CIFAR-100 (fine labels: train + test)."""

    def batch(p: Path) -> tuple[np.ndarray, np.ndarray]:
        obj = unpickle_dict(p)
        key = "fine_labels" if fine else "labels"
        if "data" not in obj or key not in obj:
            raise DataError(f"{p}: missing 'data' or {key!r} entry")
        data = np.asarray(obj["data"])
        y = np.asarray(obj[key], dtype=np.int64)
        if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072 or len(data) != len(y):
            raise DataError(f"{p}: 'data' must be uint8 N x 3072 with N labels, got {data.dtype} {data.shape}")
        return data.reshape(-1, 3, 32, 32), y

    names = ["train"] if fine else [f"data_batch_{i}" for i in range(1, 6)]
    parts = [batch(d / n) for n in names]
    xte, yte = batch(d / ("test" if fine else "test_batch"))
    xtr = np.concatenate([p[0] for p in parts])
    ytr = np.concatenate([p[1] for p in parts])
    k = 100 if fine else 10
    if ytr.max() >= k or yte.max() >= k or min(ytr.min(), yte.min()) < 0:
        raise DataError(f"{d}: labels outside 0..{k - 1}")
    return ImageDataset("cifar100" if fine else "cifar10", xtr, ytr, xte, yte, k)


def _load_cifar10(d: Path) -> ImageDataset:
    return load_cifar(d, fine=False)


def _load_cifar100(d: Path) -> ImageDataset:
    return load_cifar(d, fine=True)


register_reader(
    DatasetSpec(
        "cifar10",
        _load_cifar10,
        summary="CIFAR-10, python pickle batches",
        subdirs=(
            "cifar-10-batches-py",
            "cifar10",
            "cifar10/cifar-10-batches-py",
            "CIFAR10/cifar-10-batches-py",
            "cifar-10",
        ),
        probe=lambda d: (d / "data_batch_1").is_file() or (d / "test_batch").is_file(),
        expected="cifar-10-batches-py/ with data_batch_1..5 and test_batch",
        remote=(
            Remote(
                "cifar-10-python.tar.gz",
                ("https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",),
                "c58f30108f718f92721af3b95e74349a",
                archive=True,
            ),
        ),
        aliases=("cifar-10",),
    ),
    origin="fedskew",
)
register_reader(
    DatasetSpec(
        "cifar100",
        _load_cifar100,
        summary="CIFAR-100 (fine labels), python pickle batches",
        subdirs=(
            "cifar-100-python",
            "cifar100",
            "cifar100/cifar-100-python",
            "CIFAR100/cifar-100-python",
            "cifar-100",
        ),
        probe=lambda d: (d / "train").is_file() or (d / "test").is_file(),
        expected="cifar-100-python/ with train and test",
        remote=(
            Remote(
                "cifar-100-python.tar.gz",
                ("https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz",),
                "eb9058c3a382ffc7106e4002c42a8d85",
                archive=True,
            ),
        ),
        aliases=("cifar-100",),
    ),
    origin="fedskew",
)
