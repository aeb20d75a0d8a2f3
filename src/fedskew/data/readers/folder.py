"""``--dataset folder``: your own images in an ImageFolder-style tree, one sub-folder per class.

Layouts (``DIR`` is ``--data-dir``)::

    DIR/<class>/**/*.png|jpg|...          one pool: fedskew takes a seeded, stratified ``holdout`` as the test split
    DIR/train/<class>/...  DIR/test/<class>/...   (or val/, valid/ instead of test/): the given split

Labels are the class folders' positions in sorted order (as torchvision's ImageFolder). Images are decoded with
Pillow: all grayscale (modes 1, L, LA, 16-bit I;16 scaled to 8 bits) stay one channel, otherwise every image becomes
RGB (alpha dropped). All images must share one square size unless ``resize=N`` (``--resize N``) is given, which
resizes every image to N x N (bilinear, antialiased when shrinking; the aspect ratio is not kept).

The decoded arrays are cached as an uncompressed ``.npz`` in ``DIR/.fedskew-cache/`` (or under ``$FEDSKEW_CACHE``
when ``DIR`` is read-only; ``FEDSKEW_CACHE=off`` disables caching), keyed by the list of image files with their sizes
and modification times and by ``resize``: adding, removing or touching an image makes a new entry. Entries are
written to a temporary file and renamed, so an interrupted run never leaves a half-written cache.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from fedskew.data.readers.base import DataError, ImageDataset, cache_root
from fedskew.data.readers.images import IMG_EXT, class_dirs, fingerprint, images_in, pil, read_cached, write_cached
from fedskew.data.readers.registry import DatasetSpec, register_reader

CACHE_DIR = ".fedskew-cache"
TEST_SPLITS = ("test", "val", "valid")
_GRAY = {"1", "L", "LA"}
_LAYOUT_HINT = "expected DIR/<class>/*.png|jpg (at least 2 class folders), optionally under DIR/train/ and DIR/test/"


def _splits(d: Path) -> list[tuple[str, Path]]:
    """``[("train", dir), ("test", dir)]`` for a split layout, ``[("all", d)]`` for one pool."""
    if (d / "train").is_dir():
        test = next((d / s for s in TEST_SPLITS if (d / s).is_dir()), None)
        return [("train", d / "train")] + ([("test", test)] if test is not None else [])
    return [("all", d)]


def _listing(d: Path) -> tuple[list[str], list[tuple[str, list[Path], np.ndarray]]]:
    """The classes and, per split, its image files and their labels; :class:`DataError` for an empty folder, fewer
    than 2 classes, a class folder without images, or test classes the training split lacks."""
    if not d.is_dir():
        raise DataError(f"{d}: not a folder; {_LAYOUT_HINT}")
    splits = _splits(d)
    first = splits[0][1]
    classes = class_dirs(first)
    if not classes:
        loose = [p.name for p in first.iterdir() if p.is_file() and p.suffix.lower() in IMG_EXT]
        if loose:
            raise DataError(
                f"{first}: images ({loose[0]}, ...) lie directly in the folder; put them in one sub-folder per "
                f"class ({first}/<class>/{loose[0]})"
            )
        raise DataError(f"{first}: empty folder (no class sub-folders); {_LAYOUT_HINT}")
    if len(classes) < 2:
        raise DataError(f"{first}: found 1 class folder ({classes[0]!r}); a classifier needs at least 2 classes")
    out = []
    for split, sd in splits:
        names = class_dirs(sd)
        extra = sorted(set(names) - set(classes))
        if extra:
            raise DataError(f"{sd}: class folders {extra} are not among the training classes {classes}")
        files: list[Path] = []
        labels: list[int] = []
        for i, c in enumerate(classes):
            found = images_in(sd / c) if (sd / c).is_dir() else []
            if not found and split != "test":
                raise DataError(f"{sd / c}: class folder {c!r} holds no images ({', '.join(sorted(IMG_EXT))})")
            files += found
            labels += [i] * len(found)
        if not files:
            raise DataError(f"{sd}: no images in the class folders")
        out.append((split, files, np.asarray(labels, dtype=np.int64)))
    return classes, out


def _decode(path: Path, resize: int | None) -> np.ndarray:
    """One image as uint8 ``[H, W]`` (grayscale) or ``[H, W, 3]``, resized to ``resize`` x ``resize`` if given."""
    image, unidentified = pil()
    try:
        with image.open(path) as im:
            mode = im.mode
            wide = np.asarray(im, dtype=np.float64) if mode.startswith("I") else None
            if wide is not None and wide.min() >= 0 and wide.max() <= 65535:
                # 16-bit grayscale (mode I;16, or I as older Pillow opens 16-bit PNGs): 0..65535 to 0..255
                im2 = image.fromarray(np.rint(wide * (255.0 / 65535.0)).astype(np.uint8), "L")
            elif mode.startswith("I") or mode == "F":
                raise DataError(
                    f"{path}: {'32-bit integer' if mode == 'I' else 'floating-point'} image (mode {mode}) has no "
                    f"fixed range; save it as 8- or 16-bit"
                )
            else:
                im2 = im.convert("L" if mode in _GRAY else "RGB")
            if resize is not None and im2.size != (resize, resize):
                im2 = im2.resize((resize, resize), image.Resampling.BILINEAR)
            return np.asarray(im2, dtype=np.uint8)
    except DataError:
        raise
    except (unidentified, OSError, ValueError, SyntaxError) as exc:
        raise DataError(f"{path}: cannot decode image ({exc})") from exc


def _read(files: list[Path], resize: int | None, first: list[tuple[Path, tuple[int, ...]]]) -> list[np.ndarray]:
    """Decode ``files``; ``first`` carries the first image seen (across splits) to report a size mismatch."""
    out = []
    for p in files:
        a = _decode(p, resize)
        if not first:
            first.append((p, a.shape[:2]))
            h, w = a.shape[:2]
            if h != w:
                raise DataError(
                    f"{p}: images are {w}x{h} (width x height), not square; fedskew's models take square images: "
                    f"pass --resize N (YAML resize: N) to resize every image to N x N"
                )
        elif a.shape[:2] != first[0][1]:
            q, (h, w) = first[0]
            raise DataError(
                f"{p}: image is {a.shape[1]}x{a.shape[0]} but {q} is {w}x{h} (width x height); images of different "
                f"sizes need --resize N (YAML resize: N) to resize every image to N x N"
            )
        out.append(a)
    return out


def _stack(arrs: list[np.ndarray], rgb: bool) -> np.ndarray:
    """``[N, C, H, W]``: grayscale images replicated to 3 channels when some image is colour."""
    if rgb:
        arrs = [np.repeat(a[..., None], 3, axis=2) if a.ndim == 2 else a for a in arrs]
        return np.ascontiguousarray(np.stack(arrs).transpose(0, 3, 1, 2))
    return np.stack(arrs)[:, None]


def folder_fingerprint(d: Path, resize: int | None = None) -> str:
    """The cache key of folder ``d``: its image files (relative paths, sizes, mtimes) and ``resize``."""
    _, splits = _listing(d)
    files = [p for _, fs, _ in splits for p in fs]
    return fingerprint(d, "folder-v1", resize, files=files)


def _cache_paths(d: Path, key: str) -> list[Path]:
    root = cache_root()
    if root is None:
        return []
    return [d / CACHE_DIR / f"folder-{key}.npz", root / "folder" / f"folder-{key}.npz"]


def load_folder(d: Path, resize: int | None = None) -> ImageDataset:
    """The image folder ``d`` as an :class:`ImageDataset` (module docstring), from the cache when it is current."""
    if resize is not None and (isinstance(resize, bool) or not isinstance(resize, int) or resize < 1):
        raise DataError(f"resize must be a positive number of pixels, got {resize!r}")
    classes, splits = _listing(d)
    files = [p for _, fs, _ in splits for p in fs]
    paths = _cache_paths(d, fingerprint(d, "folder-v1", resize, files=files))
    for p in paths:
        cached = read_cached(p)
        if cached is not None and cached.classes == tuple(classes):
            return cached
    first: list[tuple[Path, tuple[int, ...]]] = []
    decoded = [(split, _read(fs, resize, first), y) for split, fs, y in splits]
    rgb = any(a.ndim == 3 for _, arrs, _ in decoded for a in arrs)
    arrays: dict[str, Any] = {split: (_stack(arrs, rgb), y) for split, arrs, y in decoded}
    xtr, ytr = arrays["train"] if "train" in arrays else arrays["all"]
    xte, yte = arrays.get("test", (None, None))
    ds = ImageDataset("folder", xtr, ytr, xte, yte, len(classes), tuple(classes))
    for p in paths:
        try:
            write_cached(p, ds)
            break
        except OSError:
            continue  # read-only data folder: the next place; none writable only costs speed
    return ds


register_reader(
    DatasetSpec(
        "folder",
        load_folder,
        summary="your images: DIR/<class>/*.png|jpg (optionally train/ and test/), cached as .npz",
        probe=lambda d: d.is_dir(),
        expected=f"a folder of class sub-folders of images ({_LAYOUT_HINT})",
        options=("resize",),
        needs_data_dir=True,
        fingerprint=folder_fingerprint,
    ),
    origin="fedskew",
)
