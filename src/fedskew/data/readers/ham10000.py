"""HAM10000 (Tschandl et al., 2018), the official release: ``HAM10000_metadata.csv`` (columns ``lesion_id``,
``image_id``, ``dx``, ...) and the JPEGs ``<image_id>.jpg`` in ``HAM10000_images_part_1/`` and
``HAM10000_images_part_2/``. Seven classes, the ``dx`` values in :data:`HAM_CLASSES` order (labels 0..6); the
dataset is globally imbalanced (``nv`` is about two thirds of it).

Images are decoded RGB and resized (bilinear, aspect ratio not kept) to ``resize`` x ``resize``, default
:data:`HAM_SIZE`; the decoded pool is cached on disk like the other image readers (an atomically written ``.npz``
under ``$FEDSKEW_CACHE``, keyed by the files' sizes and modification times and by the size).

The release has no test split. FedDisco holds out a *uniform* test set: the same number of images of every class
(the paper's count is stripped in our copy, and its code reads a pre-split folder). ``ham_test_per_class`` images of
each class (default :data:`HAM_TEST_PER_CLASS`, at most half of the smallest class so every class keeps training
images) are drawn with a generator fixed by ``ham_test_seed`` (default 0) and become the official test split; the
rest is the training pool. The split is disjoint and the same on every call.
"""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np

from fedskew.data.readers.base import DataError, ImageDataset, PathLike
from fedskew.data.readers.images import disk_cached, read_images
from fedskew.data.readers.registry import DatasetSpec, data_roots, get_spec, locate, register_reader

HAM_CLASSES = ("akiec", "bcc", "bkl", "df", "mel", "nv", "vasc")
HAM_METADATA = "HAM10000_metadata.csv"
HAM_PARTS = ("HAM10000_images_part_1", "HAM10000_images_part_2")
#: default image side (the release's images are 600x450); ``--resize N`` reads another
HAM_SIZE = 32
#: default test images per class of the uniform held-out test set (the smallest class, df, has 115 images)
HAM_TEST_PER_CLASS = 30


def _read_metadata(d: Path) -> tuple[list[str], np.ndarray]:
    path = d / HAM_METADATA
    try:
        with path.open(newline="", encoding="utf-8-sig") as f:
            reader = csv.DictReader(f)
            rows = list(reader)
            header = [h.strip() for h in reader.fieldnames or []]
    except FileNotFoundError:
        raise DataError(f"{path}: metadata file missing (the release's {HAM_METADATA})") from None
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise DataError(f"{path}: cannot read ({exc})") from exc
    if not rows:
        raise DataError(f"{path}: no rows")
    lacking = [c for c in ("image_id", "dx") if c not in header]
    if lacking:
        raise DataError(f"{path}: column(s) {', '.join(lacking)} missing; header is {', '.join(header)}")
    index = {c: i for i, c in enumerate(HAM_CLASSES)}
    ids, labels = [], []
    for n, row in enumerate(rows, 2):
        iid, dx = (row.get("image_id") or "").strip(), (row.get("dx") or "").strip().lower()
        if not iid:
            raise DataError(f"{path}, line {n}: empty image_id")
        if dx not in index:
            raise DataError(f"{path}, line {n}: unknown dx {dx!r}; expected one of {', '.join(HAM_CLASSES)}")
        ids.append(iid)
        labels.append(index[dx])
    return ids, np.asarray(labels, dtype=np.int64)


def _image_paths(d: Path, ids: list[str]) -> list[Path]:
    where: dict[str, Path] = {}
    for part in HAM_PARTS:
        if (d / part).is_dir():
            where.update({p.stem: p for p in (d / part).iterdir() if p.suffix.lower() == ".jpg"})
    missing = [i for i in ids if i not in where]
    if missing:
        raise DataError(
            f"{d}: image {missing[0]}.jpg listed in {HAM_METADATA} but missing from {' and '.join(HAM_PARTS)} "
            f"({len(missing)} missing)"
        )
    return [where[i] for i in ids]


def uniform_test_split(y: np.ndarray, per_class: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(train indices, test indices) of labels ``y``: ``per_class`` of every class present in the test indices
    (at most half of the smallest class), drawn with a generator fixed by ``seed``; both sorted and disjoint."""
    if isinstance(per_class, bool) or not isinstance(per_class, int) or per_class < 1:
        raise DataError(f"ham_test_per_class must be a positive number of images, got {per_class!r}")
    counts = np.bincount(y)
    k = min(per_class, int(counts[counts > 0].min()) // 2)
    if k < 1:
        raise DataError("the uniform test split needs at least 2 images of every class")
    rng = np.random.default_rng([0x4A4, int(seed)])
    test = np.sort(np.concatenate([rng.permutation(np.flatnonzero(y == c))[:k] for c in np.flatnonzero(counts)]))
    return np.setdiff1d(np.arange(len(y)), test), test.astype(np.int64)


def load_ham10000(
    d: Path, resize: int | None = None, ham_test_per_class: int = HAM_TEST_PER_CLASS, ham_test_seed: int = 0
) -> ImageDataset:
    """The HAM10000 release in ``d`` (module docstring): RGB uint8 ``[N, 3, S, S]``, 7 classes, the uniform
    held-out test split."""
    size = HAM_SIZE if resize is None else resize
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise DataError(f"resize must be a positive number of pixels, got {resize!r}")

    def build() -> ImageDataset:
        ids, y = _read_metadata(d)
        x = read_images(_image_paths(d, ids), size)
        return ImageDataset("ham10000", x, y, None, None, len(HAM_CLASSES), HAM_CLASSES)

    pool = disk_cached("ham10000", d, (size,), build)
    tr, te = uniform_test_split(pool.y_train, ham_test_per_class, ham_test_seed)
    x, y = pool.x_train, pool.y_train
    return ImageDataset("ham10000", x[tr], y[tr], x[te], y[te], len(HAM_CLASSES), HAM_CLASSES)


def ham_missing(data_dir: PathLike | None) -> tuple[list[str], str]:
    """(the release's files and folders not found, the paths searched), looking where ``load_dataset("ham10000")``
    looks, without decoding anything."""
    spec = get_spec("ham10000")
    found, searched = locate(spec, data_roots(data_dir))
    where = ", ".join(str(s) for s in searched[:3]) + (" ..." if len(searched) > 3 else "")
    if found is None:
        found = next((c for c in searched if c.is_dir() and any((c / p).is_dir() for p in HAM_PARTS)), None)
    names = [HAM_METADATA, *(f"{p}/" for p in HAM_PARTS)]
    if found is None:
        return names, where
    return [n for n in names if not (found / n.rstrip("/")).exists()], str(found)


register_reader(
    DatasetSpec(
        "ham10000",
        load_ham10000,
        summary="HAM10000 skin lesions (7 classes): metadata CSV and the two JPEG folders; uniform test split",
        subdirs=("ham10000", "HAM10000", "dataverse_files", "ham10000/dataverse_files", "HAM10000/dataverse_files"),
        probe=lambda d: (d / HAM_METADATA).is_file(),
        expected=f"{HAM_METADATA} and the folders {' and '.join(f'{p}/' for p in HAM_PARTS)} of <image_id>.jpg",
        aliases=("ham", "ham-10000"),
        options=("resize", "ham_test_per_class", "ham_test_seed"),
    ),
    origin="fedskew",
)
