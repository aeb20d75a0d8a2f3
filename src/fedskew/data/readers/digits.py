"""scikit-learn's bundled 8x8 digits (1797 images, no test split): offline, nothing to locate."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fedskew.data.readers.base import ImageDataset, to_uint8
from fedskew.data.readers.registry import DatasetSpec, register_reader


def load_digits(_: Path | None = None) -> ImageDataset:
    """The digits rescaled from 0..16 to 0..255, one channel; a stratified ``holdout`` serves as the test split."""
    from sklearn.datasets import load_digits as sk_digits

    bunch = sk_digits()
    x = to_uint8(np.asarray(bunch.images), 0.0, 16.0)[:, None]
    return ImageDataset("digits", x, np.asarray(bunch.target, dtype=np.int64), None, None, 10)


register_reader(
    DatasetSpec(
        "digits",
        load_digits,
        summary="scikit-learn's bundled 8x8 digits (embedded, offline)",
        expected="nothing (bundled with scikit-learn)",
        uses_files=False,
    ),
    origin="fedskew",
)
