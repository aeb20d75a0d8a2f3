"""MNIST and Fashion-MNIST: the official IDX files (gzip or plain), validated header, type code and length."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from fedskew.data.readers.base import DataError, ImageDataset, PathLike, read_bytes
from fedskew.data.readers.download import Remote
from fedskew.data.readers.registry import DatasetSpec, register_reader

_IDX_TYPES: dict[int, np.dtype] = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


def read_idx_magic(path: Path) -> tuple[np.ndarray, int]:
    """The array of an IDX file and its magic number."""
    raw = read_bytes(path)
    if len(raw) < 4:
        raise DataError(f"{path}: truncated IDX file ({len(raw)} bytes, no complete header)")
    magic = int.from_bytes(raw[:4], "big")
    if raw[0] != 0 or raw[1] != 0:
        raise DataError(f"{path}: bad IDX magic number 0x{magic:08x} (the first two bytes must be zero)")
    code, ndim = raw[2], raw[3]
    if code not in _IDX_TYPES:
        raise DataError(f"{path}: bad IDX magic number 0x{magic:08x} (unknown data type code 0x{code:02x})")
    if ndim == 0:
        raise DataError(f"{path}: bad IDX magic number 0x{magic:08x} (zero dimensions)")
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DataError(f"{path}: truncated IDX header ({len(raw)} bytes, need {header} for {ndim} dimensions)")
    dims = struct.unpack(f">{ndim}I", raw[4:header])
    dtype = _IDX_TYPES[code]
    count = int(np.prod(dims, dtype=np.int64))
    want = count * dtype.itemsize
    have = len(raw) - header
    if have != want:
        problem = "truncated" if have < want else "trailing bytes after the data"
        raise DataError(f"{path}: IDX data {problem}: {have} bytes for dimensions {dims}, expected {want}")
    arr = np.frombuffer(raw, dtype=dtype, count=count, offset=header).reshape(dims)
    return arr.astype(dtype.newbyteorder("="), copy=True), magic


def read_idx(path: PathLike) -> np.ndarray:
    """Read an IDX file (gzip or plain), validating magic, data type code, dimensions and length."""
    return read_idx_magic(Path(path))[0]


def _first_file(d: Path, base: str) -> Path:
    for cand in (d / f"{base}.gz", d / base):
        if cand.is_file():
            return cand
    raise DataError(f"{d}: missing {base}.gz (or uncompressed {base})")


def load_mnist_like(name: str, d: Path) -> ImageDataset:
    """The four official IDX files of MNIST or Fashion-MNIST in folder ``d``."""

    def split(prefix: str) -> tuple[np.ndarray, np.ndarray]:
        ip, lp = _first_file(d, f"{prefix}-images-idx3-ubyte"), _first_file(d, f"{prefix}-labels-idx1-ubyte")
        x, mx = read_idx_magic(ip)
        y, my = read_idx_magic(lp)
        if mx != 2051:
            raise DataError(f"{ip}: expected IDX magic 2051 (uint8, 3-D images), got {mx}")
        if my != 2049:
            raise DataError(f"{lp}: expected IDX magic 2049 (uint8, 1-D labels), got {my}")
        if len(x) != len(y):
            raise DataError(f"{ip} has {len(x)} images but {lp} has {len(y)} labels")
        if y.size and y.max() > 9:
            raise DataError(f"{lp}: labels must be 0..9, found {int(y.max())}")
        return x[:, None], y.astype(np.int64)

    xtr, ytr = split("train")
    xte, yte = split("t10k")
    return ImageDataset(name, xtr, ytr, xte, yte, 10)


_IDX_NAMES = tuple(
    f"{s}-{k}-idx{i}-ubyte{z}"
    for s in ("train", "t10k")
    for k, i in (("images", 3), ("labels", 1))
    for z in (".gz", "")
)
_IDX_EXPECTED = (
    "train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz, t10k-images-idx3-ubyte.gz, t10k-labels-idx1-ubyte.gz"
)


def _has_idx(d: Path) -> bool:
    return any((d / n).is_file() for n in _IDX_NAMES)


def _idx_remote(base_urls: Sequence[str], md5s: dict[str, str]) -> tuple[Remote, ...]:
    return tuple(Remote(f, tuple(u + f for u in base_urls), m) for f, m in md5s.items())


_MNIST_MD5 = {
    "train-images-idx3-ubyte.gz": "f68b3c2dcbeaaa9fbdd348bbdeb94873",
    "train-labels-idx1-ubyte.gz": "d53e105ee54ea40749a09fcbcd1e9432",
    "t10k-images-idx3-ubyte.gz": "9fb629c4189551a2d022fa330f9573f3",
    "t10k-labels-idx1-ubyte.gz": "ec29112dd5afa0611ce80d1b7f02629c",
}
_FMNIST_MD5 = {
    "train-images-idx3-ubyte.gz": "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
    "train-labels-idx1-ubyte.gz": "25c81989df183df01b3e8a0aad5dffbe",
    "t10k-images-idx3-ubyte.gz": "bef4ecab320f06d8554ea6380940ec79",
    "t10k-labels-idx1-ubyte.gz": "bb300cfdad3c16e7a12a480ee83cd310",
}


def _load_mnist(d: Path) -> ImageDataset:
    return load_mnist_like("mnist", d)


def _load_fmnist(d: Path) -> ImageDataset:
    return load_mnist_like("fmnist", d)


register_reader(
    DatasetSpec(
        "mnist",
        _load_mnist,
        summary="MNIST, official IDX files",
        subdirs=("mnist", "MNIST", "mnist/raw", "MNIST/raw"),
        probe=_has_idx,
        expected=_IDX_EXPECTED,
        remote=_idx_remote(
            ("http://yann.lecun.com/exdb/mnist/", "https://ossci-datasets.s3.amazonaws.com/mnist/"), _MNIST_MD5
        ),
        download_subdir="mnist",
    ),
    origin="fedskew",
)
register_reader(
    DatasetSpec(
        "fmnist",
        _load_fmnist,
        summary="Fashion-MNIST, official IDX files",
        subdirs=("fashion-mnist", "fmnist", "fashion_mnist", "FashionMNIST", "FashionMNIST/raw"),
        probe=_has_idx,
        expected=_IDX_EXPECTED,
        remote=_idx_remote(("http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",), _FMNIST_MD5),
        download_subdir="fashion-mnist",
        aliases=("fashion-mnist", "fashion_mnist", "fashionmnist"),
    ),
    origin="fedskew",
)
