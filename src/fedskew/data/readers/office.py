"""Office-Caltech-10: four domain image folders (amazon, caltech, dslr, webcam) with class sub-folders."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from fedskew.data.readers.base import DataError, DatasetNotFoundError, ImageDataset, PathLike
from fedskew.data.readers.images import class_dirs, disk_cached, read_class_folders
from fedskew.data.readers.registry import DatasetSpec, register_reader

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


def load_domain_folders(root: PathLike, size: int, *, domains: Sequence[str] | None = None) -> dict[str, ImageDataset]:
    """Per-domain image-folder datasets (Office-Caltech-10: amazon, caltech, dslr, webcam), RGB size x size.

    ``root`` holds one folder per domain; a domain folder holds class folders directly (no test split) or
    ``train/`` plus ``val/`` (or ``test/``) with class folders. Labels index the sorted union of class folder
    names across all domains, so they agree between domains. ``domains`` defaults to every subfolder of
    ``root``.
    """
    r = Path(root)
    if not r.is_dir():
        raise DatasetNotFoundError(f"{r}: domain root folder not found")
    names = list(domains) if domains is not None else class_dirs(r)
    if not names:
        raise DataError(f"{r}: no domain folders")
    layout = {}
    for n in names:
        if not (r / n).is_dir():
            raise DataError(f"{r / n}: domain folder not found")
        layout[n] = _domain_split_dirs(r / n)
    classes = sorted({c for tr, te in layout.values() for d in (tr, te) if d is not None for c in class_dirs(d)})
    if not classes:
        raise DataError(f"{r}: no class folders inside the domain folders")

    out = {}
    for n, (tr, te) in layout.items():

        def build(n: str = n, tr: Path = tr, te: Path | None = te) -> ImageDataset:
            xtr, ytr = read_class_folders(tr, classes, size)
            xte, yte = read_class_folders(te, classes, size) if te is not None else (None, None)
            return ImageDataset(n, xtr, ytr, xte, yte, len(classes), tuple(classes))

        out[n] = disk_cached(f"domain-{n}", r / n, (size, tuple(classes)), build)
    return out


def _office_name(folder: str) -> str | None:
    low = folder.lower()
    return next((dom for dom in OFFICE_DOMAINS if low.startswith(dom)), None)


def _office_root_ok(d: Path) -> bool:
    return d.is_dir() and sum(1 for p in d.iterdir() if p.is_dir() and _office_name(p.name)) >= 2


def load_office_pooled(d: Path) -> ImageDataset:
    """Every Office-Caltech domain found in ``d``, pooled at :data:`OFFICE_POOLED_SIZE`."""
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
        vals[0].classes,
    )


register_reader(
    DatasetSpec(
        "office_caltech",
        load_office_pooled,
        summary="Office-Caltech-10 domain image folders, pooled at 32x32",
        subdirs=(
            "office_caltech",
            "office_caltech_10",
            "office-caltech",
            "office_caltech10",
            "OfficeCaltech10",
            "office-caltech-10",
        ),
        probe=_office_root_ok,
        expected="domain folders amazon/, caltech/, dslr/, webcam/ with class subfolders",
        aliases=("office-caltech", "office"),
    ),
    origin="fedskew",
)
