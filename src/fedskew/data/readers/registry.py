"""The dataset registry: a format registers a reader function under a dataset name, with its metadata.

A new format is one module: it defines ``load(folder, **options)`` returning an :class:`ImageDataset` (one pool
fedskew partitions) or a :class:`ClientDatasets` (data already divided among clients) and calls
:func:`register_reader` with a :class:`DatasetSpec`. Built-in format modules in this package are found and imported
automatically; an installed package declares its specs under the ``fedskew.datasets`` entry-point group (a spec, a
list of specs, or a callable returning either), loaded the first time a name is not found among the registered ones.

Where the files are looked for (:func:`load_source`): the ``data_dir`` argument, else the ``FEDSKEW_DATA``
environment variable (one or more directories separated by ``os.pathsep``), else ``~/.cache/fedskew/data``. Each
such directory may be the dataset's own folder or a root holding one of the spec's ``subdirs``. A spec with
``needs_data_dir`` (image folders, npz files: the data directory *is* the dataset) is read from ``data_dir`` only.
Decoded datasets are cached in-process by (name, resolved folder, options); treat the returned arrays as
read-only, the same objects are handed to every caller.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from fedskew.data.readers.base import ClientDatasets, DataError, DatasetNotFoundError, ImageDataset, PathLike
from fedskew.data.readers.download import Remote, fetch

ENTRY_POINT_GROUP = "fedskew.datasets"
_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
_ALIAS = re.compile(r"^[a-z][a-z0-9_-]*$")

Loader = Callable[..., ImageDataset | ClientDatasets]


def _always(_: Path) -> bool:
    return True


@dataclass(frozen=True)
class DatasetSpec:
    """A dataset name and how to read it.

    ``loader(folder, **options)`` reads the folder :func:`load_source` located (``probe(folder)`` is true; for a
    ``needs_data_dir`` spec the folder is ``data_dir`` itself, which may also be a file). ``options`` names the
    keyword options the loader accepts (e.g. ``resize``); ``per_client`` says the loader may return a
    :class:`ClientDatasets` (needed for ``--partition given``); ``fingerprint(folder, **options)``, when given, is
    part of the in-process cache key, so a folder whose files change is read again. ``remote`` lists the official
    files ``download=True`` fetches (into ``download_subdir`` of the first root)."""

    name: str
    loader: Loader
    summary: str = ""
    subdirs: tuple[str, ...] = ()
    probe: Callable[[Path], bool] = _always
    expected: str = ""
    remote: tuple[Remote, ...] = ()
    download_subdir: str = ""
    aliases: tuple[str, ...] = ()
    options: tuple[str, ...] = ()
    needs_data_dir: bool = False
    uses_files: bool = True  # False: nothing to locate (scikit-learn's bundled digits)
    per_client: bool = False
    fingerprint: Callable[..., str] | None = None


_SPECS: dict[str, DatasetSpec] = {}
_ALIASES: dict[str, str] = {}
ORIGIN: dict[str, str] = {}
_CACHE: dict[tuple[object, ...], ImageDataset | ClientDatasets] = {}
_CLEARERS: list[Callable[[], None]] = [_CACHE.clear]
_LOCK = threading.RLock()


def register_reader(spec: DatasetSpec, *, origin: str | None = None) -> DatasetSpec:
    """Make ``spec.name`` (and its aliases) loadable. Refused with :class:`DataError`: a name that is not lower-case
    letters, digits and ``_``, a name or alias already taken, a loader that is not callable, an option that is not
    an identifier. Returns the spec."""
    if not isinstance(spec, DatasetSpec):
        raise DataError(f"register_reader() takes a DatasetSpec, got {type(spec).__name__}")
    for n in (spec.name, *spec.aliases):
        pattern = _NAME if n == spec.name else _ALIAS  # aliases may also hold '-' (fashion-mnist)
        if not isinstance(n, str) or not pattern.match(n):
            raise DataError(f"dataset name {n!r} must be lower-case letters, digits and '_' (a letter first)")
        if n in _SPECS or n in _ALIASES:
            owner = _ALIASES.get(n, n)
            raise DataError(f"dataset name {n!r} is taken by {owner!r} ({ORIGIN.get(owner, 'fedskew')})")
    if not callable(spec.loader):
        raise DataError(f"dataset {spec.name!r}: loader must be callable")
    bad = [o for o in spec.options if not (isinstance(o, str) and o.isidentifier())]
    if bad:
        raise DataError(f"dataset {spec.name!r}: options {bad} must be Python identifiers")
    with _LOCK:
        _SPECS[spec.name] = spec
        _ALIASES.update({a: spec.name for a in spec.aliases})
        ORIGIN[spec.name] = origin or "user code"
    return spec


def unregister_reader(name: str) -> None:
    """Remove a dataset registered from user code or a plug-in (built-in readers stay)."""
    if ORIGIN.get(name) == "fedskew":
        raise DataError(f"{name!r} is a built-in dataset and cannot be removed")
    with _LOCK:
        spec = _SPECS.pop(name, None)
        for a in spec.aliases if spec else ():
            _ALIASES.pop(a, None)
        ORIGIN.pop(name, None)
        for key in [k for k in _CACHE if k[0] == name]:
            del _CACHE[key]


def on_clear(fn: Callable[[], None]) -> None:
    """Have :func:`clear_cache` also call ``fn`` (a format module's own in-process cache)."""
    _CLEARERS.append(fn)


def clear_cache() -> None:
    """Forget every in-process decoded dataset (on-disk caches are kept)."""
    with _LOCK:
        for fn in _CLEARERS:
            fn()


_entry_points_loaded = False


def load_entry_points() -> list[str]:
    """Register the specs installed packages declare under ``fedskew.datasets`` (once); returns their names."""
    global _entry_points_loaded
    with _LOCK:
        if _entry_points_loaded:
            return []
        _entry_points_loaded = True
    added: list[str] = []
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            obj: Any = ep.load()
            if callable(obj) and not isinstance(obj, DatasetSpec):
                obj = obj()
        except Exception as exc:  # a broken plug-in package must say so, not fail somewhere later
            raise DataError(f"dataset plug-in entry point {ep.name!r} ({ep.value}) failed to load: {exc}") from exc
        for spec in obj if isinstance(obj, list | tuple) else [obj]:
            register_reader(spec, origin=f"entry point {ep.value}")
            added.append(spec.name)
    return added


def dataset_names() -> tuple[str, ...]:
    """Every registered dataset name (built-in and plug-in), in registration order."""
    load_entry_points()
    return tuple(_SPECS)


def get_spec(name: str) -> DatasetSpec:
    """The spec of ``name`` (case-insensitive, aliases accepted); :class:`DataError` naming the choices if unknown."""
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    if key not in _SPECS and load_entry_points():
        key = _ALIASES.get(name.strip().lower(), key)
    if key not in _SPECS:
        raise DataError(f"unknown dataset {name!r}; choose one of {', '.join(_SPECS)}")
    return _SPECS[key]


def find_spec(name: str) -> DatasetSpec | None:
    """The spec of ``name``, or None when no reader is registered under it."""
    try:
        return get_spec(name)
    except DataError:
        return None


def data_roots(data_dir: PathLike | None) -> list[Path]:
    """The directories searched: ``data_dir``, else ``$FEDSKEW_DATA`` (``os.pathsep``-separated), else the default."""
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


def locate(spec: DatasetSpec, roots: Sequence[Path]) -> tuple[Path | None, list[Path]]:
    """The first of ``roots`` (or a ``subdirs`` entry below one) the spec's probe accepts, and every path tried."""
    searched: list[Path] = []
    for root in roots:
        for cand in (root, *(root / s for s in spec.subdirs)):
            searched.append(cand)
            ok = cand.exists() if spec.needs_data_dir else cand.is_dir()
            if ok and (cand != root or _direct_ok(spec.name, cand)) and spec.probe(cand):
                return cand, searched
    return None, searched


def load_source(
    name: str, data_dir: PathLike | None = None, *, download: bool = False, **options: Any
) -> ImageDataset | ClientDatasets:
    """Load dataset ``name`` with the registered reader, decoding once per process (per folder and options).

    Returns an :class:`ImageDataset`, or a :class:`ClientDatasets` for a format holding per-client files.
    Raises :class:`DatasetNotFoundError` naming the directories searched and the expected files when nothing is
    found (unless ``download=True`` and the dataset has an official download), :class:`DataError` for corrupt or
    incomplete files and for options the dataset does not take."""
    spec = get_spec(name)
    key = spec.name
    unknown = sorted(set(options) - set(spec.options))
    if unknown:
        takes = f"takes only {', '.join(spec.options)}" if spec.options else "takes no options"
        raise DataError(f"dataset {key!r} {takes}; got {', '.join(unknown)}")
    if not spec.uses_files:  # nothing to locate: the loader gets data_dir as it is (None without one)
        found: Path | None = Path(data_dir) if data_dir is not None else None
        cache_key: tuple[object, ...] = (key, str(found or ""), tuple(sorted(options.items())))
    else:
        if spec.needs_data_dir and data_dir is None:
            raise DataError(f"dataset {key!r} reads the folder given as data_dir (--data-dir DIR): {spec.expected}")
        roots = data_roots(data_dir)
        found, searched = locate(spec, roots)
        if found is None and download and spec.remote:
            fetch(spec.remote, roots[0] / spec.download_subdir, lambda d: locate(spec, [d])[0] is not None)
            found, searched = locate(spec, roots)
        if found is None:
            hint = (
                " or add --download (YAML: download: true; Python: download=True) to fetch the official files, "
                "MD5-checked"
                if spec.remote
                else ""
            )
            where = (
                f"Point data_dir (or FEDSKEW_DATA) at the folder holding these files or at a root with a "
                f"{spec.subdirs[0]!r} subfolder{hint}."
                if spec.subdirs
                else f"Point data_dir at it{hint}."
            )
            raise DatasetNotFoundError(
                f"dataset {key!r} not found. Searched: {', '.join(str(s) for s in searched)}. "
                f"Expected: {spec.expected}. {where}"
            )
        stamp = spec.fingerprint(found, **options) if spec.fingerprint is not None else ""
        cache_key = (key, str(found.resolve()), tuple(sorted(options.items())), stamp)
    with _LOCK:
        if cache_key not in _CACHE:
            try:
                _CACHE[cache_key] = spec.loader(found, **options)
            except DataError:
                # incomplete folder: with download=True fetch the missing official files once, then retry
                if found is None or not (download and spec.remote and not spec.remote[0].archive):
                    raise
                fetch(spec.remote, found, lambda d: locate(spec, [d])[0] is not None)
                _CACHE[cache_key] = spec.loader(found, **options)
        return _CACHE[cache_key]


def load_dataset(
    name: str, data_dir: PathLike | None = None, *, download: bool = False, **options: Any
) -> ImageDataset:
    """Load dataset ``name`` as one pool of images (:func:`load_source`); a folder holding per-client files is a
    :class:`DataError` here (use :func:`load_source`, or ``--partition given`` in a run)."""
    ds = load_source(name, data_dir, download=download, **options)
    if isinstance(ds, ClientDatasets):
        raise DataError(
            f"{data_dir}: holds per-client files ({ds.num_clients} clients), not one pool of images; read it with "
            f"load_source(), or run it with partition 'given'"
        )
    return ds
