"""SVHN (cropped digits): the official MATLAB files ``train_32x32.mat`` and ``test_32x32.mat`` (scipy)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fedskew.data.readers.base import DataError, ImageDataset
from fedskew.data.readers.download import Remote
from fedskew.data.readers.registry import DatasetSpec, register_reader


def load_svhn(d: Path) -> ImageDataset:
    """SVHN's two .mat files; label 10 (the digit 0) becomes 0."""
    import scipy.io
    from scipy.io.matlab import MatReadError

    def split(p: Path) -> tuple[np.ndarray, np.ndarray]:
        if not p.is_file():
            raise DataError(f"{p}: file not found")
        try:
            m = scipy.io.loadmat(p)
        except (MatReadError, ValueError, OSError, TypeError, NotImplementedError) as exc:
            raise DataError(f"{p}: corrupt or unsupported .mat file ({exc})") from exc
        if "X" not in m or "y" not in m:
            raise DataError(f"{p}: missing variables 'X' and 'y'")
        x, y = np.asarray(m["X"]), np.asarray(m["y"]).astype(np.int64).ravel()
        if x.ndim != 4 or x.shape[2] != 3 or x.shape[3] != len(y):
            raise DataError(f"{p}: X must be H x W x 3 x N matching y, got {x.shape} and {y.shape}")
        if y.size and (y.min() < 0 or y.max() > 10):
            raise DataError(f"{p}: labels must be 1..10 (10 = digit 0)")
        y[y == 10] = 0
        return np.ascontiguousarray(x.transpose(3, 2, 0, 1)).astype(np.uint8), y

    xtr, ytr = split(d / "train_32x32.mat")
    xte, yte = split(d / "test_32x32.mat")
    return ImageDataset("svhn", xtr, ytr, xte, yte, 10)


register_reader(
    DatasetSpec(
        "svhn",
        load_svhn,
        summary="SVHN cropped digits, MATLAB .mat files",
        subdirs=("svhn", "SVHN"),
        probe=lambda d: (d / "train_32x32.mat").is_file() or (d / "test_32x32.mat").is_file(),
        expected="train_32x32.mat, test_32x32.mat",
        remote=(
            Remote(
                "train_32x32.mat",
                ("http://ufldl.stanford.edu/housenumbers/train_32x32.mat",),
                "e26dedcc434d2e4c54c9b2d4a06d8373",
            ),
            Remote(
                "test_32x32.mat",
                ("http://ufldl.stanford.edu/housenumbers/test_32x32.mat",),
                "eb5a983be6a315427106f1b164d9cef3",
            ),
        ),
        download_subdir="svhn",
    ),
    origin="fedskew",
)
