"""What every reader shares: the error types, the two shapes a dataset comes in, and the low-level helpers.

A reader returns either an :class:`ImageDataset` (one pool of images with an optional official test split, which
fedskew's partitions divide among clients) or a :class:`ClientDatasets` (data already divided among clients, used
as the federation as it is: ``--partition given``).
"""

from __future__ import annotations

import bz2
import gzip
import hashlib
import os
import pickle
import tempfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

PathLike = str | os.PathLike[str]


class DataError(ValueError):
    """A dataset file is missing, corrupt or truncated; the message names the file and the problem."""


class DatasetNotFoundError(DataError):
    """None of the searched directories holds the dataset; the message lists them and the expected files."""


@dataclass(frozen=True, eq=False)
class ImageDataset:
    """A labelled image dataset: images ``[N, C, H, W]`` (user arrays may be features ``[N, ...]`` of another shape,
    which the engine flattens for the MLP) and int64 labels ``[N]``.

    Images are uint8 (scaled to [-1, 1] when the federation is built, as every built-in dataset) or floating point
    (used as they are: arrays a user gives already normalised, e.g. PFLlib's). ``x_test``/``y_test`` are None when
    the dataset has no official test split (``digits``, an image folder without ``test/``); a seeded ``holdout`` is
    then taken. ``classes`` names the labels where the format has names (image folders), else it is empty.

    Text (``ag_news``): samples are int64 token ids ``[N, L]`` (0 pads, 1 is an unknown word) and ``vocabulary``
    names every id (``vocabulary[i]`` is the word of id ``i``); the engine keeps the ids as integers and the model
    zoo's ``textcnn`` embeds them. Empty for every image dataset.
    """

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray | None
    y_test: np.ndarray | None
    num_classes: int
    classes: tuple[str, ...] = ()
    vocabulary: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.x_train.ndim < 2 or len(self.x_train) != len(self.y_train):
            raise DataError(
                f"{self.name}: x_train must be [N, C, H, W] (or [N, ...] features) with one label per image, "
                f"got {self.x_train.shape} and {self.y_train.shape}"
            )
        if (self.x_test is None) != (self.y_test is None):
            raise DataError(f"{self.name}: x_test and y_test must both be given or both be None")
        if 0 in self.x_train.shape[1:]:  # e.g. IDX files declaring 0x0 images: no pixel for any model to read
            raise DataError(f"{self.name}: its samples hold no values (each is {list(self.x_train.shape[1:])})")
        if (
            self.x_test is not None
            and self.y_test is not None
            and (self.x_test.ndim != self.x_train.ndim or len(self.x_test) != len(self.y_test))
        ):
            raise DataError(
                f"{self.name}: x_test must be shaped as x_train with one label per image, "
                f"got {self.x_test.shape} and {self.y_test.shape}"
            )
        if self.y_test is not None and len(self.y_test) == 0:  # the headline metric would vanish without a word
            raise DataError(
                f"{self.name}: its test split holds no samples; give test samples, or none at all (then a seeded "
                "holdout of the training pool is the test set)"
            )
        check_classes(self.name, self.num_classes, [self.y_train])
        if self.vocabulary:
            for x in (self.x_train, self.x_test):
                if x is None:
                    continue
                if x.ndim != 2 or x.dtype.kind not in "iu" or x.dtype == np.uint8:
                    raise DataError(f"{self.name}: token ids must be an integer array [N, L], got {x.dtype} {x.shape}")
                if x.size and (x.min() < 0 or x.max() >= len(self.vocabulary)):
                    raise DataError(
                        f"{self.name}: token ids must lie in 0..{len(self.vocabulary) - 1} (the vocabulary), "
                        f"found [{x.min()}, {x.max()}]"
                    )


MAX_SPARSE_CLASSES = 1000  # more classes than this and than training samples: the labels are ids, not classes


def check_classes(name: str, num_classes: int, train_labels: list[np.ndarray]) -> None:
    """Refuse labels that make no classifier: fewer than two classes, or more classes than both the training
    samples and :data:`MAX_SPARSE_CLASSES` (labels that are ids, not classes: ``{0, 1000000}`` would build a
    million-way classifier; a small official file of a 10-class dataset is fine). One node's or client's own data
    may hold one class; a whole dataset may not (:func:`check_task`)."""
    n = sum(int(np.asarray(y).size) for y in train_labels)
    if num_classes < 2:
        raise DataError(f"{name}: {num_classes} class(es); a classification task needs at least 2")
    if num_classes > max(n, MAX_SPARSE_CLASSES):
        top = max((int(np.asarray(y).max()) for y in train_labels if np.asarray(y).size), default=-1)
        raise DataError(
            f"{name}: {num_classes} classes for {n} training samples (labels up to {top}): labels must be the "
            "classes 0 .. C-1, not ids; map them to 0 .. C-1 first"
        )


def check_task(name: str, num_classes: int, train_labels: list[np.ndarray]) -> None:
    """:func:`check_classes`, and a whole dataset's training labels hold two classes or more (one-class data would
    train and report as if it were a classification task)."""
    check_classes(name, num_classes, train_labels)
    labels = [np.asarray(y) for y in train_labels if np.asarray(y).size]
    present = np.unique(np.concatenate(labels)) if labels else np.array([], dtype=np.int64)
    if present.size < 2:
        only = f"only label {int(present[0])}" if present.size else "no training sample"
        raise DataError(f"{name}: the training data holds {only}; a classification task needs two classes or more")


@dataclass(frozen=True, eq=False)
class ClientDatasets:
    """Data already divided among clients: client ``i`` trains on ``x_train[i]``/``y_train[i]`` and is tested on
    ``x_test[i]``/``y_test[i]`` (None for every client when the files hold no test split: each client's data is then
    split with ``train_ratio``). Images ``[n_i, C, H, W]`` (uint8 or float, as :class:`ImageDataset`), labels int64 in
    ``0 .. num_classes-1``. ``sources[i]`` names client ``i``'s file(s) for messages; ``meta`` holds what the format
    stores beside the arrays (PFLlib's ``config.json``)."""

    name: str
    num_classes: int
    x_train: list[np.ndarray]
    y_train: list[np.ndarray]
    x_test: list[np.ndarray] | None
    y_test: list[np.ndarray] | None
    sources: list[str]
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        k = len(self.x_train)
        if k == 0:
            raise DataError(f"{self.name}: no clients")
        if len(self.y_train) != k or len(self.sources) != k:
            raise DataError(f"{self.name}: {k} clients' images but {len(self.y_train)} label arrays")
        if (self.x_test is None) != (self.y_test is None):
            raise DataError(f"{self.name}: x_test and y_test must both be given or both be None")
        empty = [c for c, x in enumerate(self.x_train) if 0 in np.shape(x)[1:]]
        if empty:  # no pixel for any model to read
            shape = list(np.shape(self.x_train[empty[0]])[1:])
            raise DataError(f"{self.name}: client {empty[0]}'s samples hold no values (each is {shape})")
        if self.x_test is not None and self.y_test is not None and not len(self.x_test) == len(self.y_test) == k:
            raise DataError(f"{self.name}: {k} clients' training data but {len(self.x_test)} test splits")
        check_task(self.name, self.num_classes, self.y_train)

    @property
    def num_clients(self) -> int:
        return len(self.x_train)


# =============================================================================================== file helpers


def read_bytes(path: Path) -> bytes:
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


def to_uint8(x: np.ndarray, lo: float, hi: float) -> np.ndarray:
    """Linearly map [lo, hi] to 0..255 with rounding."""
    return np.clip(np.rint((x.astype(np.float64) - lo) * (255.0 / (hi - lo))), 0, 255).astype(np.uint8)


_PICKLE_ALLOWED = {
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "scalar"),
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"),
    ("_codecs", "encode"),  # how protocol-2 pickles written by Python 3 store bytes
}


class ArrayUnpickler(pickle.Unpickler):
    """Unpickler restricted to plain containers and numpy arrays (what CIFAR batches and PFLlib's client files hold):
    any other class or function named in the pickle is refused, so a crafted file cannot run code."""

    def find_class(self, module: str, name: str) -> object:
        if (module, name) not in _PICKLE_ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a dataset pickle")
        if module == "numpy.core.multiarray":  # numpy 1.x pickles; numpy 2 moved the module
            module = "numpy._core.multiarray" if hasattr(np, "_core") else module
        return super().find_class(module, name)


# what a corrupt pickle can raise while being read
PICKLE_ERRORS = (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError, OSError)


def unpickle_dict(path: Path) -> dict[str, object]:
    """A pickled dict (Python-2 style bytes keys allowed) read with :class:`ArrayUnpickler`."""
    try:
        with path.open("rb") as f:
            obj = ArrayUnpickler(f, encoding="bytes").load()
    except FileNotFoundError:
        raise DataError(f"{path}: file not found") from None
    except PICKLE_ERRORS as exc:
        raise DataError(f"{path}: corrupt or truncated pickle ({exc})") from exc
    if not isinstance(obj, dict):
        raise DataError(f"{path}: expected a pickled dict, got {type(obj).__name__}")
    return {k.decode("latin1") if isinstance(k, bytes) else str(k): v for k, v in obj.items()}


def cache_root() -> Path | None:
    """``$FEDSKEW_CACHE`` (default ``$XDG_CACHE_HOME/fedskew`` or ``~/.cache/fedskew``); None when set to off."""
    env = os.environ.get("FEDSKEW_CACHE")
    if env is not None and env.strip().lower() in {"", "0", "off", "none", "false"}:
        return None
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "fedskew"


def atomic_savez(path: Path, **arrays: np.ndarray) -> None:
    """Write an uncompressed .npz through a temporary sibling and a rename: a reader sees the whole file or none,
    and a crash mid-write leaves no half-written cache entry. Raises OSError when the folder is not writable."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)  # type: ignore[arg-type]
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


VOCAB_FILE = "vocab.txt"  # a text run's vocabulary in its run directory


def vocabulary_text(vocabulary: tuple[str, ...]) -> str:
    """A vocabulary as ``vocab.txt`` holds it: one word per line, line ``i`` the word of token id ``i``."""
    return "".join(f"{w}\n" for w in vocabulary)


def vocabulary_digest(vocabulary: tuple[str, ...]) -> str:
    """SHA-1 of :func:`vocabulary_text` (a run's summary records it, a cache key includes it)."""
    return hashlib.sha1(vocabulary_text(vocabulary).encode()).hexdigest()
