"""``--dataset npz``: your arrays in NumPy ``.npz`` files, in one of two layouts (``DIR`` is ``--data-dir``).

**One pool** -- ``DIR/<any>.npz`` (the only .npz in ``DIR``) or ``--data-dir FILE.npz``: arrays ``x`` (images) and
``y`` (labels), optionally ``x_test`` and ``y_test`` (the test split; without them a seeded ``holdout`` is taken) and
a scalar ``num_classes`` (default: the largest label + 1). fedskew's partitions divide the pool among clients.

**Per-client files** -- ``DIR/train/0.npz, 1.npz, ...`` and ``DIR/test/0.npz, ...`` (client ``i``'s training and
test data), optionally ``DIR/config.json``: used as the federation as it is (``--partition given``). Each file holds
either plain arrays ``x``, ``y``, or -- **PFLlib's dataset folder format**, exactly as its generators write it
(``dataset/utils/dataset_utils.py``: ``np.savez_compressed(f, data={'x': X, 'y': y})``, read back by PFLlib with
``np.load(f, allow_pickle=True)['data'].tolist()``) -- one pickled dict under the key ``data``, with ``config.json``
holding ``num_clients``, ``num_classes`` and the per-client label counts ``Size of samples for labels in clients``
(checked against the files). Without ``test/`` each client's data is split with ``train_ratio``.

Pickles are read only for PFLlib's ``data`` entry, and never with ``allow_pickle=True``: the entry is unpickled by
:class:`~fedskew.data.readers.base.ArrayUnpickler`, which accepts numpy arrays, dtypes and plain containers and
refuses anything else, so a crafted file cannot run code. Every other array is loaded with ``allow_pickle=False``.

Samples are images ``[N, C, H, W]`` (``[N, H, W]``: one channel; square ones can feed the CNNs) or features of any
other shape (flattened: the MLP); uint8 (or integers in 0..255) are scaled to [-1, 1] as every fedskew dataset,
floating-point values are used as they are (PFLlib stores its images normalised to [-1, 1]). Labels are integers
``0 .. num_classes-1``. Every problem is a :class:`DataError` naming the file: missing files, x/y length mismatch,
non-integer or out-of-range labels, NaN/Inf values, wrong dimensions, clients whose sample shapes differ.
"""

from __future__ import annotations

import json
import re
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from fedskew.data.readers.base import PICKLE_ERRORS, ArrayUnpickler, ClientDatasets, DataError, ImageDataset
from fedskew.data.readers.images import fingerprint
from fedskew.data.readers.registry import DatasetSpec, register_reader

PFLLIB_STATS = "Size of samples for labels in clients"
_HINT = (
    "expected one .npz with arrays x, y (optionally x_test, y_test), or per-client files train/0.npz, train/1.npz, "
    "... and test/0.npz, ... (PFLlib's dataset folder: also config.json)"
)
_OPEN_ERRORS = (OSError, ValueError, EOFError, zipfile.BadZipFile, KeyError)


# ============================================================================================= array checks


def check_images(x: Any, where: str) -> np.ndarray:
    """``x`` as samples ``[N, ...]``: images ``[N, C, H, W]`` (``[N, H, W]`` gets a channel axis) or features of
    any other shape (flattened for the MLP, as :func:`fedskew.from_arrays` takes them); uint8 (integers in 0..255
    converted) or float32 (finite). ``where`` names the file and array in every error."""
    if not isinstance(x, np.ndarray) or x.dtype.kind not in "uif":
        kind = f"dtype {x.dtype}" if isinstance(x, np.ndarray) else type(x).__name__
        raise DataError(f"{where}: samples must be a numeric array, got {kind}")
    if x.ndim < 2:
        raise DataError(f"{where}: samples must be [N, C, H, W] images or [N, F] features, got shape {x.shape}")
    if x.ndim == 3:
        x = x[:, None]
    if len(x) == 0:
        raise DataError(f"{where}: no samples (shape {x.shape})")
    if x.ndim == 4 and x.shape[3] in (1, 3, 4) and x.shape[1] == x.shape[2] > 4:
        raise DataError(f"{where}: shape {x.shape} looks channels-last [N, H, W, C]; store [N, C, H, W]")
    if x.dtype.kind == "f":
        x = x.astype(np.float32, copy=False)
        bad = ~np.isfinite(x)
        if bad.any():
            raise DataError(f"{where}: {int(bad.sum())} NaN/Inf values (first in sample {np.argwhere(bad)[0][0]})")
        return x
    if x.dtype != np.uint8:
        if x.min() < 0 or x.max() > 255:
            raise DataError(
                f"{where}: integer images must lie in 0..255, found [{x.min()}, {x.max()}] (store floats to have "
                f"them used as they are)"
            )
        x = x.astype(np.uint8)
    return x


def check_labels(y: Any, n: int, where: str, num_classes: int | None = None) -> np.ndarray:
    """``y`` as int64 labels ``[n]``, integer-valued and non-negative (and below ``num_classes`` when given)."""
    if not isinstance(y, np.ndarray) or y.dtype.kind not in "uif":
        kind = f"dtype {y.dtype}" if isinstance(y, np.ndarray) else type(y).__name__
        raise DataError(f"{where}: labels must be a numeric array of integers, got {kind}")
    if y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]
    if y.ndim != 1:
        raise DataError(f"{where}: labels must be one per sample, shape [N], got {y.shape}")
    if len(y) != n:
        raise DataError(f"{where}: {n} images but {len(y)} labels")
    if y.dtype.kind == "f":
        frac = ~np.isfinite(y) | (y != np.round(y))
        if frac.any():
            i = int(np.argmax(frac))
            raise DataError(f"{where}: non-integer labels ({int(frac.sum())} of them, e.g. {float(y[i])} at index {i})")
    y = y.astype(np.int64)
    if y.size and y.min() < 0:
        raise DataError(f"{where}: labels out of range: {int(y.min())} (labels are 0 .. num_classes-1)")
    if num_classes is not None and y.size and y.max() >= num_classes:
        raise DataError(f"{where}: labels out of range: {int(y.max())} >= num_classes {num_classes}")
    return y


def _same_images(x: np.ndarray, ref: np.ndarray, where: str, ref_where: str) -> None:
    if x.shape[1:] != ref.shape[1:] or (x.dtype == np.uint8) != (ref.dtype == np.uint8):
        raise DataError(
            f"{where}: images are {x.dtype} {tuple(x.shape[1:])} but {ref_where} holds {ref.dtype} "
            f"{tuple(ref.shape[1:])}; every image of a dataset needs one shape and one kind (uint8 or float)"
        )


def _num_classes(value: Any, where: str) -> int:
    if isinstance(value, np.ndarray) and value.shape == () and value.dtype.kind in "iu":
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 2:
        raise DataError(f"{where}: num_classes must be an integer >= 2, got {value!r}")
    return value


# ============================================================================================= file reading


def _open(path: Path) -> Any:
    try:
        return np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise DataError(f"{path}: file not found") from None
    except _OPEN_ERRORS as exc:
        raise DataError(f"{path}: not a readable .npz file ({exc})") from exc


def read_pfllib_entry(path: Path) -> dict[str, Any]:
    """PFLlib's ``data`` entry of ``path``: a 0-d object array holding a dict, unpickled with the restricted
    :class:`ArrayUnpickler` (module docstring)."""
    try:
        with zipfile.ZipFile(path) as zf, zf.open("data.npy") as f:
            version = np.lib.format.read_magic(f)
            if version == (1, 0):
                shape, _, dtype = np.lib.format.read_array_header_1_0(f)
            elif version == (2, 0):
                shape, _, dtype = np.lib.format.read_array_header_2_0(f)
            else:
                raise DataError(f"{path}: entry 'data' has unsupported .npy format version {version}")
            if dtype != np.dtype(object) or shape != ():
                raise DataError(f"{path}: entry 'data' must be PFLlib's pickled dict, got {dtype} array {shape}")
            obj = ArrayUnpickler(f, encoding="latin1").load()
    except DataError:
        raise
    except PICKLE_ERRORS + (zipfile.BadZipFile, KeyError) as exc:
        raise DataError(f"{path}: cannot read PFLlib's pickled 'data' entry ({exc})") from exc
    if isinstance(obj, np.ndarray) and obj.shape == ():
        obj = obj.item()
    if not isinstance(obj, dict) or "x" not in obj or "y" not in obj:
        got = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
        raise DataError(f"{path}: PFLlib's 'data' entry must be a dict with 'x' and 'y', got {got}")
    return obj


def client_arrays(path: Path) -> tuple[Any, Any, bool]:
    """``(x, y, is_pfllib)`` of one per-client file: plain arrays ``x``, ``y`` or PFLlib's pickled ``data`` dict."""
    with _open(path) as z:
        names = set(z.files)
        try:
            if {"x", "y"} <= names:
                return z["x"], z["y"], False
        except _OPEN_ERRORS as exc:
            raise DataError(f"{path}: cannot read arrays x, y ({exc})") from exc
    if "data" in names:
        d = read_pfllib_entry(path)
        return d["x"], d["y"], True
    raise DataError(f"{path}: holds {sorted(names)}; a client file needs arrays x and y, or PFLlib's dict 'data'")


def _read_config(path: Path) -> dict[str, Any]:
    try:
        cfg = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(f"{path}: not a readable JSON file ({exc})") from exc
    if not isinstance(cfg, dict):
        raise DataError(f"{path}: must hold a JSON object, got {type(cfg).__name__}")
    n = cfg.get("num_clients")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise DataError(f"{path}: num_clients must be a positive integer, got {n!r}")
    if cfg.get("num_classes") is not None:
        _num_classes(cfg["num_classes"], str(path))
    return cfg


def _client_files(split_dir: Path, count: int | None, why: str) -> list[Path]:
    """``split_dir/0.npz .. {K-1}.npz``: K from ``count`` or the files present; missing or stray files refused."""
    stray = sorted(p.name for p in split_dir.iterdir() if p.is_file() and not re.fullmatch(r"\d+\.npz", p.name))
    stray = [s for s in stray if not s.startswith(".")]
    if stray:
        raise DataError(f"{split_dir / stray[0]}: per-client files are named 0.npz, 1.npz, ... (one per client)")
    ids = sorted(int(p.stem) for p in split_dir.glob("*.npz"))
    k = count if count is not None else len(ids)
    if k == 0:
        raise DataError(f"{split_dir}: no client files; {_HINT}")
    missing = sorted(set(range(k)) - set(ids))
    if missing:
        raise DataError(f"{split_dir / f'{missing[0]}.npz'}: missing ({len(missing)} client files missing; {why})")
    beyond = [i for i in ids if i >= k]
    if beyond:
        raise DataError(f"{split_dir / f'{beyond[0]}.npz'}: beyond the {k} clients ({why})")
    return [split_dir / f"{i}.npz" for i in range(k)]


# ================================================================================================= layouts


def load_pool(path: Path) -> ImageDataset:
    """One .npz with ``x``, ``y`` (optionally ``x_test``, ``y_test``, ``num_classes``)."""
    with _open(path) as z:
        names = set(z.files)
        if not {"x", "y"} <= names:
            extra = (
                "; it looks like one of PFLlib's client files: point --data-dir at the dataset folder holding "
                "train/, test/ and config.json"
                if "data" in names
                else ""
            )
            raise DataError(f"{path}: needs arrays x and y, holds {sorted(names)}{extra}")
        if ("x_test" in names) != ("y_test" in names):
            raise DataError(
                f"{path}: x_test and y_test go together, found only {'x_test' if 'x_test' in names else 'y_test'}"
            )
        try:
            arrays = {k: z[k] for k in ("x", "y", "x_test", "y_test", "num_classes") if k in names}
        except _OPEN_ERRORS as exc:
            raise DataError(f"{path}: cannot read its arrays ({exc})") from exc
    k = _num_classes(arrays["num_classes"], f"{path}: num_classes") if "num_classes" in arrays else None
    x = check_images(arrays["x"], f"{path}: x")
    y = check_labels(arrays["y"], len(x), f"{path}: y", k)
    xt = yt = None
    if "x_test" in arrays:
        xt = check_images(arrays["x_test"], f"{path}: x_test")
        _same_images(xt, x, f"{path}: x_test", "x")
        yt = check_labels(arrays["y_test"], len(xt), f"{path}: y_test", k)
    if k is None:
        k = int(max(y.max(), yt.max() if yt is not None else 0)) + 1
        if k < 2:
            raise DataError(f"{path}: every label is 0; a classifier needs at least 2 classes")
    return ImageDataset("npz", x, y, xt, yt, k)


def _label_counts(*ys: np.ndarray) -> list[list[int]]:
    values, counts = np.unique(np.concatenate(ys), return_counts=True)
    return [[int(v), int(c)] for v, c in zip(values, counts, strict=True)]


def load_clients(d: Path) -> ClientDatasets:
    """Per-client files under ``d/train`` (and ``d/test``), with PFLlib's ``config.json`` when present."""
    cfg = _read_config(d / "config.json") if (d / "config.json").is_file() else {}
    n = cfg.get("num_clients")
    why = f"config.json: num_clients {n}" if n is not None else "clients are numbered 0 .. K-1"
    train = _client_files(d / "train", n, why)
    has_test = (d / "test").is_dir()
    if not has_test and cfg:
        raise DataError(f"{d / 'test'}: missing (a PFLlib dataset folder has train/, test/ and config.json)")
    test = _client_files(d / "test", len(train), f"train/ has {len(train)} clients") if has_test else []
    k = _num_classes(cfg["num_classes"], f"{d / 'config.json'}") if cfg.get("num_classes") is not None else None
    xs, ys, xts, yts = [], [], [], []
    ref: tuple[np.ndarray, str] | None = None
    for i, p in enumerate(train):
        parts = [(p, xs, ys)] + ([(test[i], xts, yts)] if has_test else [])
        for path, xl, yl in parts:
            xr, yr, _ = client_arrays(path)
            x = check_images(xr, f"{path}: x")
            y = check_labels(yr, len(x), f"{path}: y", k)
            if ref is None:
                ref = (x, str(path))
            _same_images(x, ref[0], f"{path}: x", ref[1])
            xl.append(x)
            yl.append(y)
    if k is None:
        k = int(max(int(y.max()) for y in ys + yts)) + 1
        if k < 2:
            raise DataError(f"{d}: every label is 0; a classifier needs at least 2 classes")
    stats = cfg.get(PFLLIB_STATS)
    if isinstance(stats, list) and len(stats) == len(train):
        for i, want in enumerate(stats):
            have = _label_counts(ys[i], *(yts[i : i + 1] if has_test else []))
            if [list(map(int, pair)) for pair in want] != have:
                files = f"train/{i}.npz" + (f" + test/{i}.npz" if has_test else "")
                raise DataError(
                    f"{d / 'config.json'}: {PFLLIB_STATS!r} of client {i} is {want} but {files} hold {have}"
                )
    elif stats is not None:
        raise DataError(f"{d / 'config.json'}: {PFLLIB_STATS!r} must list one entry per client ({len(train)})")
    sources = [str(p) + (f" + {test[i]}" if has_test else "") for i, p in enumerate(train)]
    return ClientDatasets(
        "npz", k, xs, ys, xts if has_test else None, yts if has_test else None, sources, {"config": cfg}
    )


def load_npz(d: Path) -> ImageDataset | ClientDatasets:
    """The layout ``d`` holds (module docstring): a file or a folder with one .npz is a pool, ``train/`` is
    per-client."""
    if d.is_file():
        return load_pool(d)
    if (d / "train").is_dir():
        return load_clients(d)
    files = sorted(p for p in d.glob("*.npz") if p.is_file())
    if len(files) == 1:
        return load_pool(files[0])
    if (d / "config.json").is_file():
        raise DataError(f"{d / 'train'}: missing (a PFLlib dataset folder has train/, test/ and config.json)")
    if not files:
        raise DataError(f"{d}: no .npz file; {_HINT}")
    raise DataError(f"{d}: {len(files)} .npz files ({', '.join(p.name for p in files[:4])}, ...); {_HINT}")


def _npz_files(d: Path) -> list[Path]:
    if d.is_file():
        return [d]
    return sorted(
        p for p in (*d.glob("*.npz"), *d.glob("train/*.npz"), *d.glob("test/*.npz"), d / "config.json") if p.is_file()
    )


def npz_fingerprint(d: Path) -> str:
    """The in-process cache key of ``d``: its .npz files and config.json with sizes and mtimes."""
    return fingerprint(d, "npz-v1", files=_npz_files(d))


register_reader(
    DatasetSpec(
        "npz",
        load_npz,
        summary="your arrays: one .npz (x, y[, x_test, y_test]) or per-client files (PFLlib's dataset folder)",
        probe=lambda d: d.is_dir() or d.suffix == ".npz",
        expected=f"a .npz file or a folder ({_HINT})",
        needs_data_dir=True,
        per_client=True,
        fingerprint=npz_fingerprint,
    ),
    origin="fedskew",
)
