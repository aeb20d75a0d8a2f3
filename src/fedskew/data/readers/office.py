"""Office-Caltech-10: four domain image folders (amazon, caltech, dslr, webcam) with class sub-folders."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from fedskew.data.readers.base import DataError, DatasetNotFoundError, ImageDataset, PathLike
from fedskew.data.readers.domains import DomainSuite, register_domain_suite
from fedskew.data.readers.images import class_dirs, disk_cached, read_class_folders
from fedskew.data.readers.registry import DatasetSpec, data_roots, get_spec, locate, register_reader

OFFICE_DOMAINS = ("amazon", "caltech", "dslr", "webcam")
#: image size of the pooled ``load_dataset("office_caltech")``; use :func:`load_domain_folders` for others.
OFFICE_POOLED_SIZE = 32
#: share of each class of a domain held out as its test split when the domain folder has none (the usual release)
OFFICE_TEST_SHARE = 0.2


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


def office_present(data_dir: PathLike | None) -> tuple[dict[str, str], str]:
    """({domain: its folder name} of the Office-Caltech domains found, in :data:`OFFICE_DOMAINS` order; the paths
    searched), looking where ``load_dataset("office_caltech")`` looks, without decoding anything."""
    found, searched = locate(get_spec("office_caltech"), data_roots(data_dir))
    where = ", ".join(str(s) for s in searched[:3]) + (" ..." if len(searched) > 3 else "")
    if found is None:  # the probe wants 2 domain folders: a folder holding just one is still reported as found
        found = next((c for c in searched if c.is_dir() and any(_office_name(p.name) for p in c.iterdir())), None)
    if found is None:
        return {}, where
    names = sorted(p.name for p in found.iterdir() if p.is_dir() and _office_name(p.name))
    folders: dict[str, str] = {}
    for n in names:
        folders.setdefault(_office_name(n), n)  # type: ignore[arg-type]
    return {d: folders[d] for d in OFFICE_DOMAINS if d in folders}, str(found)


def _split_test(ds: ImageDataset, dom: str, index: int) -> ImageDataset:
    """``ds`` with a stratified :data:`OFFICE_TEST_SHARE` of each class held out as its test split (at least one
    image of every class with 2 or more stays on each side); fixed by the domain, not by the run's seed."""
    if ds.x_test is not None:
        return ImageDataset(dom, ds.x_train, ds.y_train, ds.x_test, ds.y_test, ds.num_classes, ds.classes)
    rng = np.random.default_rng([0x0FF1CE, index])
    test = []
    for c in np.unique(ds.y_train):
        idx = rng.permutation(np.flatnonzero(ds.y_train == c))
        k = min(max(int(round(len(idx) * OFFICE_TEST_SHARE)), 1 if len(idx) > 1 else 0), len(idx) - 1)
        test.append(idx[:k])
    te = np.sort(np.concatenate(test)).astype(np.int64)
    tr = np.setdiff1d(np.arange(len(ds.y_train)), te)
    return ImageDataset(dom, ds.x_train[tr], ds.y_train[tr], ds.x_train[te], ds.y_train[te], ds.num_classes, ds.classes)


def office_domains(
    data_dir: PathLike | None = None, size: int = 32, *, seed: int = 0, download: bool = False
) -> dict[str, ImageDataset]:
    """Office-Caltech-10 as a domain suite (FedHEAL): domains ``amazon``, ``caltech``, ``dslr``, ``webcam`` in that
    order, RGB uint8 ``[N, 3, size, size]``, labels over the 10 shared classes. A domain folder with ``train/`` and
    ``val/`` (or ``test/``) keeps that split; one with class folders only (the usual release) holds out
    :data:`OFFICE_TEST_SHARE` of each class, with a fixed generator. Domains whose folders are missing are skipped;
    fewer than 2 is a :class:`DataError`. ``seed`` and ``download`` are accepted for the suite interface (no
    download exists)."""
    del seed, download
    if size < 1:
        raise DataError(f"size must be >= 1, got {size}")
    folders, where = office_present(data_dir)
    if not folders:
        raise DatasetNotFoundError(
            f"dataset 'office_caltech' not found. Searched: {where}. Expected: {get_spec('office_caltech').expected}"
        )
    if len(folders) < 2:
        raise DataError(
            f"the Office-Caltech domain suite needs at least 2 of the domain folders {', '.join(OFFICE_DOMAINS)} "
            f"in {where}; found {', '.join(folders)}"
        )
    read = load_domain_folders(Path(where), size, domains=list(folders.values()))
    return {d: _split_test(read[f], d, OFFICE_DOMAINS.index(d)) for d, f in folders.items()}


register_domain_suite(DomainSuite("office_caltech", OFFICE_DOMAINS, office_domains, every_class=True))
