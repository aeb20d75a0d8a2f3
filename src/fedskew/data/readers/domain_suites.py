"""The feature-skew suites of FedHEAL's and FPL's line of work as domain suites: PACS, Office-Home and DomainNet, read
from their official folder layouts like Office-Caltech (:mod:`fedskew.data.readers.office`).

Each suite is a root folder holding one folder per domain with one sub-folder per class (``--partition domain`` puts
each client on one domain; the per-domain accuracies, their mean and std are recorded), or, pooled, a dataset for
the other partitions (``--dataset pacs --partition dir``, at 32x32):

- **PACS** (Li et al., ICCV 2017; "kfold" release): ``art_painting``, ``cartoon``, ``photo``, ``sketch``, 7 classes.
- **Office-Home** (Venkateswara et al., CVPR 2017; ``OfficeHomeDataset_10072016``): ``Art``, ``Clipart``,
  ``Product``, ``Real World`` (or ``Real_World``), 65 classes.
- **DomainNet** (Peng et al., ICCV 2019): ``clipart``, ``infograph``, ``painting``, ``quickdraw``, ``real``,
  ``sketch``, 345 classes; its official split lists ``<domain>_train.txt`` / ``<domain>_test.txt`` (``path label``
  per line) beside the domain folders are used when present.

Labels index the sorted union of the class folder names, so they agree between domains. Without an official split,
each domain holds out 20% of every class as its test split with a generator fixed by the domain (not by the run's
seed), as Office-Caltech. Domains whose folders are missing are skipped; fewer than 2 is an error naming the folders
searched. Clients are not repaired to hold every class (Office-Home's and DomainNet's 65 and 345 classes outnumber a
1% client's images), unlike Office-Caltech under FedHEAL.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedskew.data.readers.base import DataError, DatasetNotFoundError, ImageDataset, PathLike
from fedskew.data.readers.domains import DomainSuite, register_domain_suite
from fedskew.data.readers.images import class_dirs, disk_cached, read_images
from fedskew.data.readers.office import _split_test, load_domain_folders
from fedskew.data.readers.registry import DatasetSpec, data_roots, register_reader

POOLED_SIZE = 32


@dataclass(frozen=True)
class FolderSuite:
    """A suite of domain folders: ``domains`` maps each domain to the folder names it may have (case-insensitive),
    ``subdirs`` the suite's root folder names under a data root, ``split_lists``: official ``<domain>_train.txt``
    / ``_test.txt`` files beside the domain folders (DomainNet)."""

    name: str
    title: str
    domains: dict[str, tuple[str, ...]]
    subdirs: tuple[str, ...]
    aliases: tuple[str, ...] = ()
    split_lists: bool = False

    def folders_in(self, d: Path) -> dict[str, str]:
        """{domain: its folder} of the domains present in ``d``, in the suite's order."""
        if not d.is_dir():
            return {}
        present = {p.name.lower(): p.name for p in d.iterdir() if p.is_dir()}
        out = {}
        for dom, names in self.domains.items():
            hit = next((present[n.lower()] for n in names if n.lower() in present), None)
            if hit is not None:
                out[dom] = hit
        return out

    def locate(self, data_dir: PathLike | None) -> tuple[Path | None, dict[str, str], list[Path]]:
        searched: list[Path] = []
        for root in data_roots(data_dir):
            for cand in (root, *(root / s for s in self.subdirs)):
                searched.append(cand)
                found = self.folders_in(cand)
                if found:
                    return cand, found, searched
        return None, {}, searched


def _listed(root: Path, lst: Path, classes: list[str], size: int) -> tuple[np.ndarray, np.ndarray]:
    """Images named in an official split list (``domain/class/file.jpg label`` per line), labelled by class folder."""
    paths, labels = [], []
    index = {c: i for i, c in enumerate(classes)}
    for n, line in enumerate(lst.read_text().splitlines(), 1):
        if not line.strip():
            continue
        rel = line.split()[0]
        parts = Path(rel).parts
        if len(parts) < 3 or parts[-2] not in index:
            raise DataError(f"{lst}:{n}: expected 'domain/class/file label', got {line.strip()!r}")
        paths.append(root / rel)
        labels.append(index[parts[-2]])
    if not paths:
        raise DataError(f"{lst}: the split list names no image")
    missing = [p for p in paths if not p.is_file()]
    if missing:
        raise DataError(f"{lst}: {len(missing)} listed image(s) missing, e.g. {missing[0]}")
    return read_images(paths, size), np.asarray(labels, dtype=np.int64)


def suite_domains(suite: FolderSuite, data_dir: PathLike | None, size: int) -> dict[str, ImageDataset]:
    """The suite's domains present under ``data_dir`` (module docstring), RGB uint8 ``[N, 3, size, size]``."""
    if size < 1:
        raise DataError(f"size must be >= 1, got {size}")
    root, folders, searched = suite.locate(data_dir)
    where = ", ".join(str(s) for s in searched[:3]) + (" ..." if len(searched) > 3 else "")
    if root is None:
        want = ", ".join(f"{d}/" for d in suite.domains)
        raise DatasetNotFoundError(f"dataset {suite.name!r} not found. Searched: {where}. Expected: {want}")
    if len(folders) < 2:
        raise DataError(
            f"the {suite.title} domain suite needs at least 2 of its domain folders in {root}; found "
            f"{', '.join(folders) or 'none'}"
        )
    lists = (
        {d: (root / f"{f}_train.txt", root / f"{f}_test.txt") for d, f in folders.items()} if suite.split_lists else {}
    )
    listed = {d: pair for d, pair in lists.items() if pair[0].is_file() and pair[1].is_file()}
    out: dict[str, ImageDataset] = {}
    if listed:
        classes = sorted({c for f in folders.values() for c in class_dirs(root / f)})
        for d, (tr, te) in listed.items():

            def build(tr: Path = tr, te: Path = te, d: str = d) -> ImageDataset:
                xtr, ytr = _listed(root, tr, classes, size)
                xte, yte = _listed(root, te, classes, size)
                return ImageDataset(d, xtr, ytr, xte, yte, len(classes), tuple(classes))

            out[d] = disk_cached(f"{suite.name}-{d}", root / folders[d], (size, tuple(classes), "lists"), build)
    rest = [d for d in folders if d not in listed]
    if rest:
        read = load_domain_folders(root, size, domains=[folders[d] for d in folders])
        order = list(suite.domains)
        for d in rest:
            out[d] = _split_test(read[folders[d]], d, order.index(d))
    return {d: out[d] for d in suite.domains if d in out}


def _pooled(suite: FolderSuite):  # noqa: ANN202 - the reader of the pooled dataset
    def load(d: Path) -> ImageDataset:
        doms = list(suite_domains(suite, d, POOLED_SIZE).values())
        return ImageDataset(
            suite.name,
            np.concatenate([v.x_train for v in doms]),
            np.concatenate([v.y_train for v in doms]),
            np.concatenate([v.x_test for v in doms if v.x_test is not None]),
            np.concatenate([v.y_test for v in doms if v.y_test is not None]),
            doms[0].num_classes,
            doms[0].classes,
        )

    return load


SUITES = (
    FolderSuite(
        "pacs",
        "PACS",
        {"art_painting": ("art_painting",), "cartoon": ("cartoon",), "photo": ("photo",), "sketch": ("sketch",)},
        ("PACS", "pacs", "PACS/kfold", "pacs/kfold", "kfold", "pacs_data"),
    ),
    FolderSuite(
        "office_home",
        "Office-Home",
        {"art": ("Art",), "clipart": ("Clipart",), "product": ("Product",), "real_world": ("Real World", "Real_World")},
        ("OfficeHomeDataset_10072016", "office_home", "OfficeHome", "office-home"),
        aliases=("office-home", "officehome"),
    ),
    FolderSuite(
        "domainnet",
        "DomainNet",
        {d: (d,) for d in ("clipart", "infograph", "painting", "quickdraw", "real", "sketch")},
        ("domainnet", "DomainNet", "domain_net"),
        split_lists=True,
    ),
)

for _s in SUITES:
    register_reader(
        DatasetSpec(
            _s.name,
            _pooled(_s),
            summary=f"{_s.title} domain image folders, pooled at {POOLED_SIZE}x{POOLED_SIZE} (--partition domain: its "
            "domains as clients' domains)",
            subdirs=_s.subdirs,
            probe=lambda d, _s=_s: len(_s.folders_in(d)) >= 2,
            expected=f"domain folders {', '.join(n[0] + '/' for n in _s.domains.values())} with class subfolders",
            aliases=_s.aliases,
        ),
        origin="fedskew",
    )
    register_domain_suite(
        DomainSuite(
            _s.name,
            tuple(_s.domains),
            lambda data_dir=None, size=POOLED_SIZE, *, seed=0, download=False, _s=_s: suite_domains(_s, data_dir, size),
        )
    )
