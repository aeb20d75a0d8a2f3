"""Shared by the image-folder formats: finding and decoding image files (Pillow), and the on-disk ``.npz`` cache
of decoded folders under ``$FEDSKEW_CACHE`` (default ``~/.cache/fedskew``; ``off`` disables it)."""

from __future__ import annotations

import contextlib
import hashlib
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fedskew.data.readers.base import DataError, ImageDataset, atomic_savez, cache_root

IMG_EXT = {".jpg", ".jpeg", ".png", ".bmp", ".gif", ".ppm", ".pgm", ".tif", ".tiff", ".webp"}


def images_in(d: Path) -> list[Path]:
    """Image files below ``d`` (recursively, by extension, case-insensitive), sorted; hidden paths skipped."""
    return sorted(
        p
        for p in d.rglob("*")
        if p.suffix.lower() in IMG_EXT and p.is_file() and not any(s.startswith(".") for s in p.relative_to(d).parts)
    )


def pil() -> tuple[Any, type[Exception]]:
    """Pillow's ``Image`` module and ``UnidentifiedImageError``, or a :class:`DataError` saying how to get it."""
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError:
        raise DataError("reading image folders needs Pillow (pip install pillow; it comes with matplotlib)") from None
    return Image, UnidentifiedImageError


def read_images(paths: Sequence[Path], size: int | None) -> np.ndarray:
    """Decode images with PIL as RGB uint8 ``[N, 3, H, W]``, bilinear-resized to ``size`` x ``size``."""
    Image, UnidentifiedImageError = pil()
    arrs = []
    shape = None
    for p in paths:
        try:
            with Image.open(p) as im:
                im = im.convert("RGB")
                if size is not None and im.size != (size, size):
                    im = im.resize((size, size), Image.Resampling.BILINEAR)
                a = np.asarray(im, dtype=np.uint8)
        except (UnidentifiedImageError, OSError, ValueError) as exc:
            raise DataError(f"{p}: cannot decode image ({exc})") from exc
        if shape is None:
            shape = a.shape
        elif a.shape != shape:
            raise DataError(f"{p}: image size {a.shape[:2]} differs from {shape[:2]}; pass a common size to resize to")
        arrs.append(a)
    if not arrs:
        return np.zeros((0, 3, size or 1, size or 1), dtype=np.uint8)
    return np.ascontiguousarray(np.stack(arrs).transpose(0, 3, 1, 2))


def class_dirs(d: Path) -> list[str]:
    """Sub-folder names of ``d`` that can be classes (hidden and ``_``-prefixed ones skipped), sorted."""
    return sorted(p.name for p in d.iterdir() if p.is_dir() and not p.name.startswith((".", "_")))


def read_class_folders(d: Path, classes: Sequence[str], size: int | None) -> tuple[np.ndarray, np.ndarray]:
    """The images of ``d/<class>/`` for the given classes (label = position in ``classes``), RGB."""
    if not d.is_dir():
        raise DataError(f"{d}: missing folder")
    unknown = sorted(set(class_dirs(d)) - set(classes))
    if unknown:
        raise DataError(f"{d}: class folders {unknown} are not among the dataset's classes")
    paths, labels = [], []
    for i, c in enumerate(classes):
        if (d / c).is_dir():
            files = images_in(d / c)
            paths += files
            labels += [i] * len(files)
    if not paths:
        raise DataError(f"{d}: no images found in class subfolders")
    return read_images(paths, size), np.asarray(labels, dtype=np.int64)


def fingerprint(d: Path, *extra: object, files: Sequence[Path] | None = None) -> str:
    """A key of a folder's content: ``files`` (default every file below ``d``) with their sizes and mtimes, plus
    ``extra`` (the decoding options)."""
    h = hashlib.sha1(repr(("fedskew-npz-v1", str(d.resolve()), *extra)).encode())
    for p in sorted(files) if files is not None else sorted(q for q in d.rglob("*") if q.is_file()):
        st = p.stat()
        h.update(f"{p.relative_to(d)}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:20]


def read_cached(path: Path) -> ImageDataset | None:
    """A dataset from a cache entry written by :func:`write_cached`, or None when it is missing or unreadable."""
    if not path.is_file():
        return None
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
                tuple(str(c) for c in z["classes"]) if "classes" in z.files else (),
            )
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile, DataError):
        return None  # unreadable cache entry: rebuilt and overwritten


def write_cached(path: Path, ds: ImageDataset) -> None:
    """Store ``ds`` at ``path`` atomically (never half-written); OSError when the folder is not writable."""
    empty = np.zeros((0,), np.uint8)
    atomic_savez(
        path,
        name=np.asarray(ds.name),
        x_train=ds.x_train,
        y_train=ds.y_train,
        x_test=ds.x_test if ds.x_test is not None else empty,
        y_test=ds.y_test if ds.y_test is not None else empty,
        has_test=np.asarray(ds.x_test is not None),
        num_classes=np.asarray(ds.num_classes),
        classes=np.asarray(ds.classes, dtype=str),
    )


def disk_cached(tag: str, d: Path, extra: tuple[object, ...], build: Callable[[], ImageDataset]) -> ImageDataset:
    """``build()`` once per content fingerprint of folder ``d``, memoised as an atomically written .npz."""
    root = cache_root()
    if root is None:
        return build()
    path = root / f"{tag}-{fingerprint(d, *extra)}.npz"
    cached = read_cached(path)
    if cached is not None:
        return cached
    ds = build()
    with contextlib.suppress(OSError):  # an unwritable cache only costs speed
        write_cached(path, ds)
    return ds
