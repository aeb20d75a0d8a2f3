"""Readers of the official dataset distribution formats, returning uint8 image arrays ``[N, C, H, W]``.

No torchvision and no network are needed: every reader parses the files as the distributors publish them (IDX,
LIBSVM text, HDF5, python pickles, MATLAB .mat, image folders). Downloads happen only when asked for
(``download=True``), from the official URLs with MD5 verification, written atomically.

Where the files are looked for (:func:`load_dataset`): the ``data_dir`` argument, else the ``FEDSKEW_DATA``
environment variable (one or more directories separated by ``os.pathsep``), else ``~/.cache/fedskew/data``.
Each such directory may be the dataset's own folder (e.g. ``.../mnist`` holding the four IDX files) or a root
holding a subfolder named after the dataset (``mnist/``, ``fashion-mnist/`` or ``fmnist/``, ``usps/``,
``cifar-10-batches-py/``, ...). Decoded datasets are cached in-process by (name, resolved folder);
image-folder datasets (Tiny-ImageNet, CINIC-10, Office-Caltech) are also cached on disk as uint8 ``.npz``
under ``$FEDSKEW_CACHE`` (default ``~/.cache/fedskew``; set it to ``off`` to disable). Treat the returned
arrays as read-only: the same objects are handed to every caller.
"""

from __future__ import annotations

import bz2
import gzip
import hashlib
import os
import pickle
import shutil
import struct
import tarfile
import tempfile
import threading
import urllib.error
import urllib.request
import zipfile
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = [
    "DATASETS",
    "DataError",
    "DatasetNotFoundError",
    "ImageDataset",
    "clear_cache",
    "digits_domains",
    "load_dataset",
    "load_domain_folders",
    "read_idx",
    "read_libsvm",
    "synth_digits",
]

PathLike = str | os.PathLike[str]


class DataError(ValueError):
    """A dataset file is missing, corrupt or truncated; the message names the file and the problem."""


class DatasetNotFoundError(DataError):
    """None of the searched directories holds the dataset; the message lists them and the expected files."""


@dataclass(frozen=True, eq=False)
class ImageDataset:
    """A labelled image dataset: uint8 images ``[N, C, H, W]`` and int64 labels ``[N]``.

    ``x_test``/``y_test`` are None when the dataset has no official test split (``digits``).
    """

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray | None
    y_test: np.ndarray | None
    num_classes: int

    def __post_init__(self) -> None:
        if self.x_train.ndim != 4 or len(self.x_train) != len(self.y_train):
            raise DataError(
                f"{self.name}: x_train must be [N, C, H, W] with one label per image, "
                f"got {self.x_train.shape} and {self.y_train.shape}"
            )
        if (self.x_test is None) != (self.y_test is None):
            raise DataError(f"{self.name}: x_test and y_test must both be given or both be None")
        if (
            self.x_test is not None
            and self.y_test is not None
            and (self.x_test.ndim != 4 or len(self.x_test) != len(self.y_test))
        ):
            raise DataError(
                f"{self.name}: x_test must be [N, C, H, W] with one label per image, "
                f"got {self.x_test.shape} and {self.y_test.shape}"
            )


# =============================================================================================== file formats

_IDX_TYPES: dict[int, np.dtype] = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


def _read_bytes(path: Path) -> bytes:
    """File content, transparently gunzipped / bunzipped (detected by magic bytes, not by name)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise DataError(f"{path}: file not found") from None
    except OSError as exc:
        raise DataError(f"{path}: cannot read ({exc})") from exc
    try:
        if raw[:2] == b"\x1f\x8b":
            return gzip.decompress(raw)
        if raw[:3] == b"BZh":
            return bz2.decompress(raw)
    except (OSError, EOFError, ValueError, zlib.error) as exc:
        raise DataError(f"{path}: corrupt or truncated compressed file ({exc})") from exc
    return raw


def _read_idx_magic(path: Path) -> tuple[np.ndarray, int]:
    raw = _read_bytes(path)
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
        raise DataError(
            f"{path}: truncated IDX header ({len(raw)} bytes, need {header} for {ndim} dimensions)"
        )
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
    return _read_idx_magic(Path(path))[0]


def read_libsvm(path: PathLike, n_features: int = 256) -> tuple[np.ndarray, np.ndarray]:
    """Read a LIBSVM sparse text file (bzip2, gzip or plain): float32 ``[N, n_features]``, int64 labels.

    Feature indices are 1-based; absent features are 0 (LIBSVM semantics).
    """
    p = Path(path)
    try:
        text = _read_bytes(p).decode("ascii")
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
            raise DataError(
                f"{p}, line {lineno}: label must be an integer and feature indices in [1, {n_features}]"
            )
        row = np.zeros(n_features, dtype=np.float32)
        row[idx - 1] = pairs[:, 1]
        rows.append(row)
        labels.append(int(label))
    if not rows:
        raise DataError(f"{p}: no samples (empty or truncated LIBSVM file)")
    return np.stack(rows), np.asarray(labels, dtype=np.int64)


_PICKLE_ALLOWED = {
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "scalar"),
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"),
    ("_codecs", "encode"),  # how protocol-2 pickles written by Python 3 store bytes
}


class _ArrayUnpickler(pickle.Unpickler):
    """Unpickler restricted to plain containers and numpy arrays (what the CIFAR batches contain)."""

    def find_class(self, module: str, name: str) -> object:
        if (module, name) not in _PICKLE_ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a dataset pickle")
        if module == "numpy.core.multiarray":  # numpy 1.x pickles; numpy 2 moved the module
            module = "numpy._core.multiarray" if hasattr(np, "_core") else module
        return super().find_class(module, name)


def _unpickle(path: Path) -> dict[str, object]:
    try:
        with path.open("rb") as f:
            obj = _ArrayUnpickler(f, encoding="bytes").load()
    except FileNotFoundError:
        raise DataError(f"{path}: file not found") from None
    except (
        pickle.UnpicklingError,
        EOFError,
        ValueError,
        TypeError,
        AttributeError,
        IndexError,
        OSError,
    ) as exc:
        raise DataError(f"{path}: corrupt or truncated pickle ({exc})") from exc
    if not isinstance(obj, dict):
        raise DataError(f"{path}: expected a pickled dict, got {type(obj).__name__}")
    return {k.decode("latin1") if isinstance(k, bytes) else str(k): v for k, v in obj.items()}


def _to_uint8(x: np.ndarray, lo: float, hi: float) -> np.ndarray:
    """Linearly map [lo, hi] to 0..255 with rounding."""
    return np.clip(np.rint((x.astype(np.float64) - lo) * (255.0 / (hi - lo))), 0, 255).astype(np.uint8)


# ======================================================================================== dataset readers


def _first_file(d: Path, base: str) -> Path:
    for cand in (d / f"{base}.gz", d / base):
        if cand.is_file():
            return cand
    raise DataError(f"{d}: missing {base}.gz (or uncompressed {base})")


def _load_mnist_like(name: str, d: Path) -> ImageDataset:
    def split(prefix: str) -> tuple[np.ndarray, np.ndarray]:
        ip, lp = _first_file(d, f"{prefix}-images-idx3-ubyte"), _first_file(d, f"{prefix}-labels-idx1-ubyte")
        x, mx = _read_idx_magic(ip)
        y, my = _read_idx_magic(lp)
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


def _load_digits(_: Path | None = None) -> ImageDataset:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = _to_uint8(np.asarray(bunch.images), 0.0, 16.0)[:, None]
    return ImageDataset("digits", x, np.asarray(bunch.target, dtype=np.int64), None, None, 10)


def _load_usps(d: Path) -> ImageDataset:
    """USPS 16x16: the LIBSVM pair (usps.bz2 + usps.t.bz2) if both exist, else usps.h5 (needs h5py)."""
    train_bz, test_bz, h5 = d / "usps.bz2", d / "usps.t.bz2", d / "usps.h5"

    def libsvm(p: Path) -> tuple[np.ndarray, np.ndarray]:
        x, y = read_libsvm(p, 256)
        if y.min() < 1 or y.max() > 10:
            raise DataError(f"{p}: USPS labels must be 1..10, found range [{y.min()}, {y.max()}]")
        return _to_uint8(x, -1.0, 1.0).reshape(-1, 1, 16, 16), y - 1

    if train_bz.is_file() and test_bz.is_file():
        (xtr, ytr), (xte, yte) = libsvm(train_bz), libsvm(test_bz)
        return ImageDataset("usps", xtr, ytr, xte, yte, 10)
    if h5.is_file():
        try:
            import h5py
        except ImportError:
            raise DataError(
                f"{h5}: reading it needs h5py (pip install h5py, or fedskew[usps]); "
                f"alternatively provide both usps.bz2 and usps.t.bz2 in {d}"
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
                        raise DataError(
                            f"{h5}: {split}/data must be N x 256 with N targets, got {x.shape}, {y.shape}"
                        )
                    if y.size and (y.min() < 0 or y.max() > 9):
                        raise DataError(f"{h5}: {split}/target must be 0..9")
                    out.append((_to_uint8(x, 0.0, 1.0).reshape(-1, 1, 16, 16), y))
        except OSError as exc:
            raise DataError(f"{h5}: corrupt or truncated HDF5 file ({exc})") from exc
        (xtr, ytr), (xte, yte) = out
        return ImageDataset("usps", xtr, ytr, xte, yte, 10)
    have = [p.name for p in (train_bz, test_bz) if p.is_file()]
    raise DataError(
        f"{d}: USPS needs both splits: usps.h5, or the LIBSVM pair usps.bz2 + usps.t.bz2 (found only {have})"
    )


def _load_cifar(d: Path, fine: bool) -> ImageDataset:
    def batch(p: Path) -> tuple[np.ndarray, np.ndarray]:
        obj = _unpickle(p)
        key = "fine_labels" if fine else "labels"
        if "data" not in obj or key not in obj:
            raise DataError(f"{p}: missing 'data' or {key!r} entry")
        data = np.asarray(obj["data"])
        y = np.asarray(obj[key], dtype=np.int64)
        if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072 or len(data) != len(y):
            raise DataError(
                f"{p}: 'data' must be uint8 N x 3072 with N labels, got {data.dtype} {data.shape}"
            )
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


def _load_svhn(d: Path) -> ImageDataset:
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


# ---------------------------------------------------------------------------------------------- image folders

_IMG_EXT = {".jpg", ".jpeg", ".png", ".bmp", ".gif", ".ppm", ".tif", ".tiff", ".webp"}


def _images_in(d: Path) -> list[Path]:
    return sorted(p for p in d.rglob("*") if p.suffix.lower() in _IMG_EXT and p.is_file())


def _read_images(paths: Sequence[Path], size: int | None) -> np.ndarray:
    """Decode images with PIL as RGB uint8 ``[N, 3, H, W]``, bilinear-resized to ``size`` x ``size``."""
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError:
        raise DataError(
            "reading image folders needs Pillow (pip install pillow; it comes with matplotlib)"
        ) from None
    arrs = []
    shape = None
    for p in paths:
        try:
            with Image.open(p) as im:
                im = im.convert("RGB")
                if size is not None and im.size != (size, size):
                    im = im.resize((size, size), Image.BILINEAR)
                a = np.asarray(im, dtype=np.uint8)
        except (UnidentifiedImageError, OSError, ValueError) as exc:
            raise DataError(f"{p}: cannot decode image ({exc})") from exc
        if shape is None:
            shape = a.shape
        elif a.shape != shape:
            raise DataError(
                f"{p}: image size {a.shape[:2]} differs from {shape[:2]}; pass a common size to resize to"
            )
        arrs.append(a)
    if not arrs:
        return np.zeros((0, 3, size or 1, size or 1), dtype=np.uint8)
    return np.ascontiguousarray(np.stack(arrs).transpose(0, 3, 1, 2))


def _class_dirs(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.is_dir() and not p.name.startswith((".", "_")))


def _read_class_folders(d: Path, classes: Sequence[str], size: int | None) -> tuple[np.ndarray, np.ndarray]:
    if not d.is_dir():
        raise DataError(f"{d}: missing folder")
    unknown = sorted(set(_class_dirs(d)) - set(classes))
    if unknown:
        raise DataError(f"{d}: class folders {unknown} are not among the dataset's classes")
    paths, labels = [], []
    for i, c in enumerate(classes):
        if (d / c).is_dir():
            files = _images_in(d / c)
            paths += files
            labels += [i] * len(files)
    if not paths:
        raise DataError(f"{d}: no images found in class subfolders")
    return _read_images(paths, size), np.asarray(labels, dtype=np.int64)


def _cache_root() -> Path | None:
    env = os.environ.get("FEDSKEW_CACHE")
    if env is not None and env.strip().lower() in {"", "0", "off", "none", "false"}:
        return None
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "fedskew"


def _fingerprint(d: Path, *extra: object) -> str:
    h = hashlib.sha1(repr(("fedskew-npz-v1", str(d.resolve()), *extra)).encode())
    for p in sorted(d.rglob("*")):
        if p.is_file():
            st = p.stat()
            h.update(f"{p.relative_to(d)}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:20]


def _disk_cached(
    tag: str, d: Path, extra: tuple[object, ...], build: Callable[[], ImageDataset]
) -> ImageDataset:
    """``build()`` once per content fingerprint of folder ``d``, memoised as an atomically written .npz."""
    root = _cache_root()
    if root is None:
        return build()
    path = root / f"{tag}-{_fingerprint(d, *extra)}.npz"
    if path.is_file():
        try:
            with np.load(path, allow_pickle=False) as z:
                has_test = bool(z["has_test"])
                return ImageDataset(
                    str(z["name"]),
                    z["x_train"],
                    z["y_train"],
                    z["x_test"] if has_test else None,
                    z["y_test"] if has_test else None,
                    int(z["num_classes"]),
                )
        except (OSError, ValueError, KeyError, zipfile.BadZipFile):
            pass  # unreadable cache entry: rebuild and overwrite
    ds = build()
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=root, prefix=path.name + ".", suffix=".tmp")
        try:
            empty = np.zeros((0,), np.uint8)
            with os.fdopen(fd, "wb") as f:
                np.savez(
                    f,
                    name=np.asarray(ds.name),
                    x_train=ds.x_train,
                    y_train=ds.y_train,
                    x_test=ds.x_test if ds.x_test is not None else empty,
                    y_test=ds.y_test if ds.y_test is not None else empty,
                    has_test=np.asarray(ds.x_test is not None),
                    num_classes=np.asarray(ds.num_classes),
                )
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except OSError:
        pass  # an unwritable cache only costs speed
    return ds


def _load_tinyimagenet(d: Path) -> ImageDataset:
    """Tiny-ImageNet-200: 100k train / 10k val (used as the test split) 64x64 RGB; classes = sorted wnids."""

    def build() -> ImageDataset:
        wn = d / "wnids.txt"
        try:
            wnids = sorted({w.strip() for w in wn.read_text().splitlines() if w.strip()})
        except OSError as exc:
            raise DataError(f"{wn}: cannot read ({exc})") from exc
        if not wnids:
            raise DataError(f"{wn}: no class ids")
        paths, labels = [], []
        for i, w in enumerate(wnids):
            files = _images_in(d / "train" / w)
            if not files:
                raise DataError(f"{d / 'train' / w}: no training images for class {w}")
            paths += files
            labels += [i] * len(files)
        xtr, ytr = _read_images(paths, None), np.asarray(labels, dtype=np.int64)
        ann = d / "val" / "val_annotations.txt"
        index = {w: i for i, w in enumerate(wnids)}
        try:
            lines = [ln.split("\t") for ln in ann.read_text().splitlines() if ln.strip()]
        except OSError as exc:
            raise DataError(f"{ann}: cannot read ({exc})") from exc
        vpaths, vlabels = [], []
        for n, parts in enumerate(lines, 1):
            if len(parts) < 2 or parts[1] not in index:
                raise DataError(f"{ann}, line {n}: expected '<file>\\t<wnid>...' with a known wnid")
            vpaths.append(d / "val" / "images" / parts[0])
            vlabels.append(index[parts[1]])
        missing = [p for p in vpaths if not p.is_file()]
        if missing:
            raise DataError(f"{missing[0]}: listed in {ann} but missing ({len(missing)} missing)")
        xte = _read_images(vpaths, None)
        return ImageDataset("tinyimagenet", xtr, ytr, xte, np.asarray(vlabels, dtype=np.int64), len(wnids))

    return _disk_cached("tinyimagenet", d, (), build)


def _load_cinic10(d: Path) -> ImageDataset:
    """CINIC-10: ``train/`` (90k) as the training split and ``test/`` (90k); ``valid/`` is not used."""

    def build() -> ImageDataset:
        classes = _class_dirs(d / "train")
        if len(classes) != 10:
            raise DataError(f"{d / 'train'}: expected 10 class folders, found {len(classes)}")
        xtr, ytr = _read_class_folders(d / "train", classes, None)
        xte, yte = _read_class_folders(d / "test", classes, None)
        return ImageDataset("cinic10", xtr, ytr, xte, yte, 10)

    return _disk_cached("cinic10", d, (), build)


OFFICE_DOMAINS = ("amazon", "caltech", "dslr", "webcam")
#: image size of the pooled ``load_dataset("office_caltech")``; use :func:`load_domain_folders` for others.
OFFICE_POOLED_SIZE = 32


def _domain_split_dirs(dom: Path) -> tuple[Path, Path | None]:
    if (dom / "train").is_dir():
        for name in ("val", "test"):
            if (dom / name).is_dir():
                return dom / "train", dom / name
        return dom / "train", None
    return dom, None


def load_domain_folders(
    root: PathLike, size: int, *, domains: Sequence[str] | None = None
) -> dict[str, ImageDataset]:
    """Per-domain image-folder datasets (Office-Caltech-10: amazon, caltech, dslr, webcam), RGB size x size.

    ``root`` holds one folder per domain; a domain folder holds class folders directly (no test split) or
    ``train/`` plus ``val/`` (or ``test/``) with class folders. Labels index the sorted union of class folder
    names across all domains, so they agree between domains. ``domains`` defaults to every subfolder of
    ``root``.
    """
    r = Path(root)
    if not r.is_dir():
        raise DatasetNotFoundError(f"{r}: domain root folder not found")
    names = list(domains) if domains is not None else _class_dirs(r)
    if not names:
        raise DataError(f"{r}: no domain folders")
    layout = {}
    for n in names:
        if not (r / n).is_dir():
            raise DataError(f"{r / n}: domain folder not found")
        layout[n] = _domain_split_dirs(r / n)
    classes = sorted(
        {c for tr, te in layout.values() for d in (tr, te) if d is not None for c in _class_dirs(d)}
    )
    if not classes:
        raise DataError(f"{r}: no class folders inside the domain folders")

    out = {}
    for n, (tr, te) in layout.items():

        def build(n: str = n, tr: Path = tr, te: Path | None = te) -> ImageDataset:
            xtr, ytr = _read_class_folders(tr, classes, size)
            xte, yte = _read_class_folders(te, classes, size) if te is not None else (None, None)
            return ImageDataset(n, xtr, ytr, xte, yte, len(classes))

        out[n] = _disk_cached(f"domain-{n}", r / n, (size, tuple(classes)), build)
    return out


def _office_root_ok(d: Path) -> bool:
    return d.is_dir() and sum(1 for p in d.iterdir() if p.is_dir() and _office_name(p.name)) >= 2


def _office_name(folder: str) -> str | None:
    low = folder.lower()
    return next((dom for dom in OFFICE_DOMAINS if low.startswith(dom)), None)


def _load_office_pooled(d: Path) -> ImageDataset:
    folders = sorted(p.name for p in d.iterdir() if p.is_dir() and _office_name(p.name))
    doms = load_domain_folders(d, OFFICE_POOLED_SIZE, domains=folders)
    vals = list(doms.values())
    has_test = all(v.x_test is not None for v in vals)
    return ImageDataset(
        "office_caltech",
        np.concatenate([v.x_train for v in vals]),
        np.concatenate([v.y_train for v in vals]),
        np.concatenate([v.x_test for v in vals if v.x_test is not None]) if has_test else None,
        np.concatenate([v.y_test for v in vals if v.y_test is not None]) if has_test else None,
        vals[0].num_classes,
    )


# =============================================================================================== registry


@dataclass(frozen=True)
class _Remote:
    filename: str
    urls: tuple[str, ...]
    md5: str
    archive: bool = False  # unpack into the download folder after verification


@dataclass(frozen=True)
class _Spec:
    name: str
    subdirs: tuple[str, ...]
    probe: Callable[[Path], bool]
    expected: str
    loader: Callable[[Path], ImageDataset]
    remote: tuple[_Remote, ...] = ()
    download_subdir: str = ""


def _any_file(*names: str) -> Callable[[Path], bool]:
    return lambda d: any((d / n).is_file() for n in names)


_IDX_NAMES = tuple(
    f"{s}-{k}-idx{i}-ubyte{z}"
    for s in ("train", "t10k")
    for k, i in (("images", 3), ("labels", 1))
    for z in (".gz", "")
)
_IDX_EXPECTED = (
    "train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz, "
    "t10k-images-idx3-ubyte.gz, t10k-labels-idx1-ubyte.gz"
)


def _idx_remote(base_urls: Sequence[str], md5s: dict[str, str]) -> tuple[_Remote, ...]:
    return tuple(_Remote(f, tuple(u + f for u in base_urls), m) for f, m in md5s.items())


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
_LIBSVM = "https://www.csie.ntu.edu.tw/~cjlin/libsvmtools/datasets/multiclass/"

_SPECS: dict[str, _Spec] = {
    "digits": _Spec("digits", (), lambda d: True, "nothing (bundled with scikit-learn)", _load_digits),
    "mnist": _Spec(
        "mnist",
        ("mnist", "MNIST", "mnist/raw", "MNIST/raw"),
        _any_file(*_IDX_NAMES),
        _IDX_EXPECTED,
        lambda d: _load_mnist_like("mnist", d),
        _idx_remote(
            ("http://yann.lecun.com/exdb/mnist/", "https://ossci-datasets.s3.amazonaws.com/mnist/"),
            _MNIST_MD5,
        ),
        "mnist",
    ),
    "fmnist": _Spec(
        "fmnist",
        ("fashion-mnist", "fmnist", "fashion_mnist", "FashionMNIST", "FashionMNIST/raw"),
        _any_file(*_IDX_NAMES),
        _IDX_EXPECTED,
        lambda d: _load_mnist_like("fmnist", d),
        _idx_remote(("http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",), _FMNIST_MD5),
        "fashion-mnist",
    ),
    "usps": _Spec(
        "usps",
        ("usps", "USPS"),
        _any_file("usps.h5", "usps.bz2", "usps.t.bz2"),
        "usps.h5 (train+test), or usps.bz2 + usps.t.bz2 (LIBSVM)",
        _load_usps,
        (
            _Remote("usps.bz2", (_LIBSVM + "usps.bz2",), "ec16c51db3855ca6c91edd34d0e9b197"),
            _Remote("usps.t.bz2", (_LIBSVM + "usps.t.bz2",), "8ea070ee2aca1ac39742fdd1ef5ed118"),
        ),
        "usps",
    ),
    "cifar10": _Spec(
        "cifar10",
        (
            "cifar-10-batches-py",
            "cifar10",
            "cifar10/cifar-10-batches-py",
            "CIFAR10/cifar-10-batches-py",
            "cifar-10",
        ),
        _any_file("data_batch_1", "test_batch"),
        "cifar-10-batches-py/ with data_batch_1..5 and test_batch",
        lambda d: _load_cifar(d, fine=False),
        (
            _Remote(
                "cifar-10-python.tar.gz",
                ("https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",),
                "c58f30108f718f92721af3b95e74349a",
                archive=True,
            ),
        ),
    ),
    "cifar100": _Spec(
        "cifar100",
        (
            "cifar-100-python",
            "cifar100",
            "cifar100/cifar-100-python",
            "CIFAR100/cifar-100-python",
            "cifar-100",
        ),
        lambda d: (d / "train").is_file() or (d / "test").is_file(),
        "cifar-100-python/ with train and test",
        lambda d: _load_cifar(d, fine=True),
        (
            _Remote(
                "cifar-100-python.tar.gz",
                ("https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz",),
                "eb9058c3a382ffc7106e4002c42a8d85",
                archive=True,
            ),
        ),
    ),
    "svhn": _Spec(
        "svhn",
        ("svhn", "SVHN"),
        _any_file("train_32x32.mat", "test_32x32.mat"),
        "train_32x32.mat, test_32x32.mat",
        _load_svhn,
        (
            _Remote(
                "train_32x32.mat",
                ("http://ufldl.stanford.edu/housenumbers/train_32x32.mat",),
                "e26dedcc434d2e4c54c9b2d4a06d8373",
            ),
            _Remote(
                "test_32x32.mat",
                ("http://ufldl.stanford.edu/housenumbers/test_32x32.mat",),
                "eb5a983be6a315427106f1b164d9cef3",
            ),
        ),
        "svhn",
    ),
    "tinyimagenet": _Spec(
        "tinyimagenet",
        (
            "tiny-imagenet-200",
            "tinyimagenet",
            "tinyimagenet/tiny-imagenet-200",
            "tiny_imagenet",
            "tiny-imagenet",
        ),
        _any_file("wnids.txt"),
        "tiny-imagenet-200/ with wnids.txt, train/<wnid>/images/, val/val_annotations.txt",
        _load_tinyimagenet,
        (
            _Remote(
                "tiny-imagenet-200.zip",
                ("http://cs231n.stanford.edu/tiny-imagenet-200.zip",),
                "90528d7ca1a48142e341f4ef8d21d0de",
                archive=True,
            ),
        ),
    ),
    "cinic10": _Spec(
        "cinic10",
        ("cinic10", "cinic-10", "CINIC-10", "CINIC10"),
        lambda d: (d / "train").is_dir() and (d / "test").is_dir() and not (d / "wnids.txt").is_file(),
        "train/ and test/ folders with one subfolder per class",
        _load_cinic10,
    ),
    "office_caltech": _Spec(
        "office_caltech",
        (
            "office_caltech",
            "office_caltech_10",
            "office-caltech",
            "office_caltech10",
            "OfficeCaltech10",
            "office-caltech-10",
        ),
        _office_root_ok,
        "domain folders amazon/, caltech/, dslr/, webcam/ with class subfolders",
        _load_office_pooled,
    ),
}

_ALIASES = {
    "fashion-mnist": "fmnist",
    "fashion_mnist": "fmnist",
    "fashionmnist": "fmnist",
    "cifar-10": "cifar10",
    "cifar-100": "cifar100",
    "tiny-imagenet": "tinyimagenet",
    "tiny_imagenet": "tinyimagenet",
    "cinic-10": "cinic10",
    "office-caltech": "office_caltech",
    "office": "office_caltech",
}

#: Names accepted by :func:`load_dataset`.
DATASETS: tuple[str, ...] = tuple(_SPECS)

_CACHE: dict[tuple[str, str], ImageDataset] = {}
_LOCK = threading.RLock()


def clear_cache() -> None:
    """Forget every in-process decoded dataset (the on-disk .npz cache is kept)."""
    with _LOCK:
        _CACHE.clear()
        _DOMAIN_CACHE.clear()


def _roots(data_dir: PathLike | None) -> list[Path]:
    if data_dir is not None:
        return [Path(data_dir).expanduser()]
    env = os.environ.get("FEDSKEW_DATA")
    if env and env.strip():
        return [Path(p).expanduser() for p in env.split(os.pathsep) if p.strip()]
    return [Path.home() / ".cache" / "fedskew" / "data"]


def _direct_ok(name: str, d: Path) -> bool:
    """Refuse to read a folder named for the *other* IDX dataset (they share file names)."""
    low = d.name.lower()
    if name == "fmnist":
        return low not in {"mnist"}
    if name == "mnist":
        return "fashion" not in low and low != "fmnist"
    return True


def _locate(spec: _Spec, roots: Sequence[Path]) -> tuple[Path | None, list[Path]]:
    searched: list[Path] = []
    for root in roots:
        for cand in (root, *(root / s for s in spec.subdirs)):
            searched.append(cand)
            if cand.is_dir() and (cand != root or _direct_ok(spec.name, cand)) and spec.probe(cand):
                return cand, searched
    return None, searched


def _canonical(name: str) -> str:
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    if key not in _SPECS:
        raise DataError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}")
    return key


def load_dataset(name: str, data_dir: PathLike | None = None, *, download: bool = False) -> ImageDataset:
    """Load dataset ``name`` (one of :data:`DATASETS`) from the official files, decoding once per process.

    Raises :class:`DatasetNotFoundError` naming the directories searched and the expected files when nothing
    is found (unless ``download=True`` and the dataset has an official download), :class:`DataError` for
    corrupt or incomplete files.
    """
    key = _canonical(name)
    spec = _SPECS[key]
    if key == "digits":
        with _LOCK:
            if ("digits", "") not in _CACHE:
                _CACHE[("digits", "")] = _load_digits()
            return _CACHE[("digits", "")]
    roots = _roots(data_dir)
    found, searched = _locate(spec, roots)
    if found is None and download and spec.remote:
        _fetch(spec, roots[0] / spec.download_subdir)
        found, searched = _locate(spec, roots)
    if found is None:
        hint = (
            " or add --download (YAML: download: true; Python: download=True) to fetch the official files, "
            "MD5-checked"
            if spec.remote
            else ""
        )
        raise DatasetNotFoundError(
            f"dataset {key!r} not found. Searched: {', '.join(str(s) for s in searched)}. "
            f"Expected: {spec.expected}. "
            f"Point data_dir (or FEDSKEW_DATA) at the folder holding these files or at a root with a "
            f"{spec.subdirs[0]!r} subfolder{hint}."
        )
    cache_key = (key, str(found.resolve()))
    with _LOCK:
        if cache_key not in _CACHE:
            try:
                _CACHE[cache_key] = spec.loader(found)
            except DataError:
                # incomplete folder: with download=True fetch the missing official files once, then retry
                if not (download and spec.remote and not spec.remote[0].archive):
                    raise
                _fetch(spec, found)
                _CACHE[cache_key] = spec.loader(found)
        return _CACHE[cache_key]


# =============================================================================================== download


def _md5(path: Path) -> str:
    h = hashlib.md5()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _download(urls: Sequence[str], dest: Path, md5: str, timeout: float = 60.0) -> None:
    """Fetch the first URL that works into ``dest`` (temp file + MD5 check + atomic rename)."""
    errors = []
    for url in urls:
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=dest.name + ".", suffix=".part")
        except OSError as exc:
            raise DataError(f"cannot write {dest} ({exc})") from exc
        try:
            h = hashlib.md5()
            with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=timeout) as resp:
                for block in iter(lambda resp=resp: resp.read(1 << 20), b""):
                    h.update(block)
                    out.write(block)
            if h.hexdigest() != md5:
                errors.append(f"{url}: MD5 {h.hexdigest()} != expected {md5}")
                continue
            os.replace(tmp, dest)
            return
        except (urllib.error.URLError, OSError, ValueError) as exc:
            errors.append(f"{url}: {exc}")
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    raise DataError(f"could not download {dest.name}: " + "; ".join(errors))


def _extract(archive: Path, into: Path) -> None:
    """Unpack a .tar.gz / .zip next to itself: into a temp folder first, then rename each top-level entry."""
    try:
        tmp = Path(tempfile.mkdtemp(dir=into, prefix=".extract-"))
    except OSError as exc:
        raise DataError(f"cannot unpack {archive} into {into} ({exc})") from exc
    try:
        if archive.name.endswith(".zip"):
            with zipfile.ZipFile(archive) as zf:
                zf.extractall(tmp)
        else:
            with tarfile.open(archive) as tf:
                if hasattr(tarfile, "data_filter"):
                    tf.extractall(tmp, filter="data")
                else:  # Python < 3.11.4: refuse links and paths escaping the target by hand
                    for m in tf.getmembers():
                        target = (tmp / m.name).resolve()
                        if not (m.isfile() or m.isdir()) or tmp.resolve() not in (target, *target.parents):
                            raise DataError(f"{archive}: unsafe archive member {m.name!r}")
                    tf.extractall(tmp)
        for entry in tmp.iterdir():
            if not (into / entry.name).exists():
                os.replace(entry, into / entry.name)
    except (tarfile.TarError, zipfile.BadZipFile, OSError) as exc:
        raise DataError(f"{archive}: cannot unpack ({exc})") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _fetch(spec: _Spec, target: Path) -> None:
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DataError(f"cannot create download folder {target} ({exc})") from exc
    for r in spec.remote:
        dest = target / r.filename
        if r.archive:
            if _locate(spec, [target])[0] is not None:
                continue
            if not (dest.is_file() and _md5(dest) == r.md5):
                _download(r.urls, dest, r.md5)
            _extract(dest, target)
        elif not dest.is_file() and not (target / r.filename.removesuffix(".gz")).is_file():
            _download(r.urls, dest, r.md5)


# =============================================================================================== digits suite


def _interp_matrix(n_in: int, n_out: int) -> np.ndarray:
    """[n_out, n_in] bilinear weights, pixel-centre aligned; a widened triangle filter when shrinking
    (antialiased bilinear, as PIL and ``torch.nn.functional.interpolate(antialias=True)`` do)."""
    scale = n_in / n_out
    support = max(scale, 1.0)
    centres = (np.arange(n_out) + 0.5) * scale - 0.5
    w = np.maximum(0.0, 1.0 - np.abs(np.arange(n_in)[None, :] - centres[:, None]) / support)
    return (w / w.sum(axis=1, keepdims=True)).astype(np.float32)


def _resize(x: np.ndarray, size: int, chunk: int = 8192) -> np.ndarray:
    """Bilinear resize of uint8 ``[N, C, H, W]`` to ``size`` x ``size`` (antialiased when shrinking)."""
    if x.shape[2:] == (size, size):
        return x
    ah, aw = _interp_matrix(x.shape[2], size), _interp_matrix(x.shape[3], size).T
    out = np.empty((len(x), x.shape[1], size, size), dtype=np.uint8)
    for s in range(0, len(x), chunk):
        r = ah @ x[s : s + chunk].astype(np.float32) @ aw
        out[s : s + chunk] = np.clip(np.rint(r), 0, 255).astype(np.uint8)
    return out


def _rgb(x: np.ndarray) -> np.ndarray:
    return np.repeat(x, 3, axis=1) if x.shape[1] == 1 else x


def synth_digits(x: np.ndarray, rng: np.random.Generator, size: int = 28, chunk: int = 8192) -> np.ndarray:
    """Synthetic colour-digit domain from grayscale digits ``x`` ``[N, 1, H, W]`` -> ``[N, 3, size, size]``.

    Per image, all randomness from ``rng`` (deterministic for a seeded generator):
    1. geometry: random affine warp of the digit stroke -- rotation U(-20, 20) degrees, scale U(0.8, 1.1),
       shift U(-0.1, 0.1) of the half-width per axis (bilinear, zero fill), output at ``size`` x ``size``;
    2. colours: background luminance L_b ~ U(0, 255); stroke luminance L_f = L_b +/- U(96, 160) (towards the
       side with room, clipped), each turned into an RGB colour by adding U(-64, 64) per channel;
    3. texture: background + a smooth colour noise field (4x4 Gaussian noise, std 40, bilinearly upsampled);
    4. composite: bg * (1 - m) + fg * m with m the warped stroke in [0, 1], plus pixel noise N(0, 6^2) taken
       from a bank of 64 noise images drawn once per call.
    The result stands in for SYN digits (rendered-font digits on textured backgrounds) when no copy is around.
    """
    import torch
    import torch.nn.functional as F

    n = len(x)
    out = np.empty((n, 3, size, size), dtype=np.uint8)
    # every per-image draw is made up front, so the result does not depend on ``chunk``
    ang = np.deg2rad(rng.uniform(-20.0, 20.0, n))
    scale = rng.uniform(0.8, 1.1, n)
    shift = rng.uniform(-0.1, 0.1, (n, 2))
    lb = rng.uniform(0.0, 255.0, n)
    gap = rng.uniform(96.0, 160.0, n)
    lf = np.where(lb < 128, np.minimum(lb + gap, 255.0), np.maximum(lb - gap, 0.0))
    cb = np.clip(lb[:, None] + rng.uniform(-64, 64, (n, 3)), 0, 255).astype(np.float32)
    cf = np.clip(lf[:, None] + rng.uniform(-64, 64, (n, 3)), 0, 255).astype(np.float32)
    low = rng.standard_normal((n, 3, 4, 4), dtype=np.float32) * 40.0
    pick = rng.integers(64, size=n)
    bank = rng.standard_normal((64, 3, size, size), dtype=np.float32) * 6.0
    up = _interp_matrix(4, size)
    kron = np.kron(up, up)  # [size*size, 16]: separable bilinear upsampling of the 4x4 noise
    # output pixel centres in [-1, 1] (align_corners=False convention of grid_sample)
    c = ((np.arange(size, dtype=np.float32) + 0.5) / size * 2.0 - 1.0).astype(np.float32)
    gx, gy = c[None, None, :], c[None, :, None]
    cos = (np.cos(ang) / scale).astype(np.float32)[:, None, None]
    sin = (np.sin(ang) / scale).astype(np.float32)[:, None, None]
    sh = shift.astype(np.float32)[:, :, None, None]
    for s in range(0, n, chunk):
        e = min(s + chunk, n)
        xb = np.ascontiguousarray(x[s:e], dtype=np.float32) / 255.0
        if xb.shape[1] != 1:
            xb = xb.mean(axis=1, keepdims=True)
        grid = np.stack(
            [cos[s:e] * gx - sin[s:e] * gy + sh[s:e, 0], sin[s:e] * gx + cos[s:e] * gy + sh[s:e, 1]], axis=-1
        )
        m = F.grid_sample(
            torch.from_numpy(xb),
            torch.from_numpy(grid),
            mode="bilinear",
            padding_mode="zeros",
            align_corners=False,
        ).numpy()
        img = (low[s:e].reshape(-1, 16) @ kron.T).reshape(e - s, 3, size, size)  # smooth background texture
        img += cb[s:e, :, None, None]
        img += (cf[s:e, :, None, None] - img) * m
        img += bank[pick[s:e]]
        np.rint(img, out=img)
        out[s:e] = np.clip(img, 0, 255).astype(np.uint8)
    return out


_DOMAIN_CACHE: dict[tuple[object, ...], dict[str, ImageDataset]] = {}


def _as_domain(ds: ImageDataset, name: str, size: int) -> ImageDataset:
    assert ds.x_test is not None and ds.y_test is not None
    return ImageDataset(
        name, _rgb(_resize(ds.x_train, size)), ds.y_train, _rgb(_resize(ds.x_test, size)), ds.y_test, 10
    )


def digits_domains(
    data_dir: PathLike | None = None, size: int = 28, *, seed: int = 0, download: bool = False
) -> dict[str, ImageDataset]:
    """The Digits domain-skew suite (FedHEAL): domains ``mnist``, ``usps``, ``svhn``, ``synth`` in that order.

    Every domain is RGB uint8 ``[N, 3, size, size]`` (grayscale MNIST/USPS replicated to 3 channels, as
    FedHEAL does; SVHN keeps its colour; bilinear resizing) with its own official train/test split. ``synth``
    is :func:`synth_digits` applied to MNIST train and test, with generators seeded ``[seed, 0x5EED, 0]`` and
    ``[seed, 0x5EED, 1]``. Domains whose files are missing are skipped (``synth`` needs MNIST); fewer than 2
    domains is a :class:`DataError`.
    """
    if size < 1:
        raise DataError(f"size must be >= 1, got {size}")
    key = (tuple(str(r.resolve()) for r in _roots(data_dir)), int(size), int(seed))
    with _LOCK:
        if key in _DOMAIN_CACHE:
            return dict(_DOMAIN_CACHE[key])
    out: dict[str, ImageDataset] = {}
    missing: dict[str, str] = {}
    base: dict[str, ImageDataset] = {}
    for name in ("mnist", "usps", "svhn"):
        try:
            base[name] = load_dataset(name, data_dir, download=download)
        except DatasetNotFoundError as exc:
            missing[name] = str(exc)
    for name, ds in base.items():
        out[name] = _as_domain(ds, name, size)
    if "mnist" in base:
        mn = base["mnist"]
        assert mn.x_test is not None and mn.y_test is not None
        r_train, r_test = (np.random.default_rng([int(seed), 0x5EED, split]) for split in (0, 1))
        out["synth"] = ImageDataset(
            "synth",
            synth_digits(mn.x_train, r_train, size),
            mn.y_train.copy(),
            synth_digits(mn.x_test, r_test, size),
            mn.y_test.copy(),
            10,
        )
    if len(out) < 2:
        raise DataError(
            f"the Digits domain suite needs at least 2 domains, found {sorted(out)}; missing: "
            + " | ".join(f"{k}: {v}" for k, v in missing.items())
        )
    with _LOCK:
        _DOMAIN_CACHE[key] = dict(out)
    return out
