"""USPS 16x16 digits: the LIBSVM text pair (``usps.bz2`` + ``usps.t.bz2``) or ``usps.h5`` (needs h5py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fedskew.data.readers.base import DataError, ImageDataset, PathLike, read_bytes, to_uint8
from fedskew.data.readers.download import Remote
from fedskew.data.readers.registry import DatasetSpec, register_reader


def read_libsvm(path: PathLike, n_features: int = 256) -> tuple[np.ndarray, np.ndarray]:
    """Read a LIBSVM sparse text file (bzip2, gzip or plain): float32 ``[N, n_features]``, int64 labels.

    Feature indices are 1-based; absent features are 0 (LIBSVM semantics).
    """
    p = Path(path)
    try:
        text = read_bytes(p).decode("ascii")
    except UnicodeDecodeError as exc:
        raise DataError(f"{p}: not a LIBSVM text file ({exc})") from exc
    rows: list[np.ndarray] = []
    labels: list[int] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        toks = line.replace(":", " ").split()
        if not toks:
            continue
        try:
            label = float(toks[0])
            pairs = np.array(toks[1:], dtype=np.float64).reshape(-1, 2)
        except ValueError as exc:
            raise DataError(f"{p}, line {lineno}: malformed LIBSVM line ({exc})") from exc
        idx = pairs[:, 0].astype(np.int64)
        if label != int(label) or (idx.size and (idx.min() < 1 or idx.max() > n_features)):
            raise DataError(f"{p}, line {lineno}: label must be an integer and feature indices in [1, {n_features}]")
        row = np.zeros(n_features, dtype=np.float32)
        row[idx - 1] = pairs[:, 1]
        rows.append(row)
        labels.append(int(label))
    if not rows:
        raise DataError(f"{p}: no samples (empty or truncated LIBSVM file)")
    return np.stack(rows), np.asarray(labels, dtype=np.int64)


def _read_h5(h5: Path) -> ImageDataset:
    try:
        import h5py
    except ImportError:
        raise DataError(
            f"{h5}: reading it needs h5py (pip install h5py, or fedskew[usps]); "
            f"alternatively provide both usps.bz2 and usps.t.bz2 in {h5.parent}"
        ) from None
    out = []
    try:
        with h5py.File(h5, "r") as f:
            for split in ("train", "test"):
                if split not in f or "data" not in f[split] or "target" not in f[split]:
                    raise DataError(f"{h5}: missing group {split!r} with datasets 'data' and 'target'")
                x = np.asarray(f[split]["data"][()], dtype=np.float64)
                y = np.asarray(f[split]["target"][()]).astype(np.int64).ravel()
                if x.ndim != 2 or x.shape[1] != 256 or len(x) != len(y):
                    raise DataError(f"{h5}: {split}/data must be N x 256 with N targets, got {x.shape}, {y.shape}")
                if y.size and (y.min() < 0 or y.max() > 9):
                    raise DataError(f"{h5}: {split}/target must be 0..9")
                out.append((to_uint8(x, 0.0, 1.0).reshape(-1, 1, 16, 16), y))
    except OSError as exc:
        raise DataError(f"{h5}: corrupt or truncated HDF5 file ({exc})") from exc
    (xtr, ytr), (xte, yte) = out
    return ImageDataset("usps", xtr, ytr, xte, yte, 10)


def load_usps(d: Path) -> ImageDataset:
    """USPS 16x16: the LIBSVM pair (usps.bz2 + usps.t.bz2) if both exist, else usps.h5 (needs h5py)."""
    train_bz, test_bz, h5 = d / "usps.bz2", d / "usps.t.bz2", d / "usps.h5"

    def libsvm(p: Path) -> tuple[np.ndarray, np.ndarray]:
        x, y = read_libsvm(p, 256)
        if y.min() < 1 or y.max() > 10:
            raise DataError(f"{p}: USPS labels must be 1..10, found range [{y.min()}, {y.max()}]")
        return to_uint8(x, -1.0, 1.0).reshape(-1, 1, 16, 16), y - 1

    if train_bz.is_file() and test_bz.is_file():
        (xtr, ytr), (xte, yte) = libsvm(train_bz), libsvm(test_bz)
        return ImageDataset("usps", xtr, ytr, xte, yte, 10)
    if h5.is_file():
        return _read_h5(h5)
    have = [p.name for p in (train_bz, test_bz) if p.is_file()]
    raise DataError(
        f"{d}: USPS needs both splits: usps.h5, or the LIBSVM pair usps.bz2 + usps.t.bz2 (found only {have})"
    )


_LIBSVM = "https://www.csie.ntu.edu.tw/~cjlin/libsvmtools/datasets/multiclass/"

register_reader(
    DatasetSpec(
        "usps",
        load_usps,
        summary="USPS 16x16, LIBSVM text pair or HDF5",
        subdirs=("usps", "USPS"),
        probe=lambda d: any((d / n).is_file() for n in ("usps.h5", "usps.bz2", "usps.t.bz2")),
        expected="usps.h5 (train+test), or usps.bz2 + usps.t.bz2 (LIBSVM)",
        remote=(
            Remote("usps.bz2", (_LIBSVM + "usps.bz2",), "ec16c51db3855ca6c91edd34d0e9b197"),
            Remote("usps.t.bz2", (_LIBSVM + "usps.t.bz2",), "8ea070ee2aca1ac39742fdd1ef5ed118"),
        ),
        download_subdir="usps",
    ),
    origin="fedskew",
)
