"""``--dataset hf``: a Hugging Face dataset on disk (the ``[hf]`` extra: ``datasets``), offline.

Where it is read from (nothing needs the network):

- ``--data-dir DIR`` holding what ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk`` wrote, or parquet files
  (one ``.parquet`` file, or a folder of them per split: ``DIR/train*.parquet``, ``DIR/test*.parquet``), or
- ``-D hub=NAME`` (e.g. ``flwrlabs/femnist``): the copy in the local Hugging Face cache (``HF_HOME``), read with
  ``HF_DATASETS_OFFLINE=1`` (fetch it once yourself with ``datasets.load_dataset(NAME)`` where a network exists, or
  set ``HF_DATASETS_OFFLINE=0`` to let fedskew's read fetch it).

Options (``-D KEY=VALUE``): ``train_split`` (default ``train``), ``test_split`` (default ``test``; without it, a seeded
``holdout`` is the test set), ``label`` (default ``label``), and the input: ``image`` (an image column: PIL images or
arrays -> uint8 ``[N, C, H, W]``), ``text`` (a text column -> token ids of the training split's words seen at least
twice, the first ``seq_len``, default 64, for ``textcnn``) or ``features`` (comma-separated numeric columns -> float
features for the MLP); without one, the first image column, else the first string column, else every numeric column
but the label. ``partition_by`` (e.g. ``writer_id``): the samples of each value form one client, for
``--partition natural`` / ``given`` (the natural clients of FEMNIST-style data); the test split's rows go to the
client of their value. String labels become ids in sorted order (their names kept as the classes).

Errors name the column and what was found: a missing split or column, a column of the wrong kind, ragged images, a
label column with gaps.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from fedskew.data.readers.base import ClientDatasets, DataError, ImageDataset
from fedskew.data.readers.registry import DatasetSpec, register_reader

OPTIONS = ("hub", "train_split", "test_split", "label", "image", "text", "features", "partition_by", "seq_len")


def _datasets() -> Any:
    try:
        import datasets
    except ImportError:
        raise DataError("--dataset hf needs the Hugging Face datasets library: pip install 'fedskew[hf]'") from None
    return datasets


def open_splits(folder: Path | None, hub: str | None) -> dict[str, Any]:
    """Split name -> ``datasets.Dataset`` from a save_to_disk folder, parquet files or the local hub cache (read
    offline: ``HF_DATASETS_OFFLINE=1`` unless the environment says otherwise)."""
    ds = _datasets()
    if hub:
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
        try:
            loaded = ds.load_dataset(hub)
        except Exception as exc:  # noqa: BLE001 - the library's errors vary by version and cause
            raise DataError(
                f"hf: {hub!r} is not in the local Hugging Face cache ({type(exc).__name__}: {exc})"
            ) from None
        return dict(loaded)
    if folder is None:
        raise DataError("--dataset hf reads --data-dir (a save_to_disk folder or parquet files) or -D hub=NAME")
    folder = Path(folder)
    parquet = [folder] if folder.suffix == ".parquet" else sorted(folder.glob("*.parquet")) if folder.is_dir() else []
    if parquet:
        by_split: dict[str, list[str]] = {}
        for p in parquet:
            split = "test" if p.stem.startswith("test") else "train" if folder.is_dir() else "train"
            by_split.setdefault(split, []).append(str(p))
        try:
            return {k: ds.Dataset.from_parquet(v) for k, v in by_split.items()}
        except Exception as exc:  # noqa: BLE001
            raise DataError(f"{folder}: unreadable parquet ({type(exc).__name__}: {exc})") from None
    try:
        loaded = ds.load_from_disk(str(folder))
    except FileNotFoundError as exc:
        raise DataError(f"{folder}: not a save_to_disk folder or parquet files ({exc})") from None
    except Exception as exc:  # noqa: BLE001
        raise DataError(f"{folder}: unreadable Hugging Face dataset ({type(exc).__name__}: {exc})") from None
    return dict(loaded) if isinstance(loaded, ds.DatasetDict) else {"train": loaded}


def _kind(feature: Any) -> str:
    name = type(feature).__name__
    if name == "Image":
        return "image"
    if name == "ClassLabel":
        return "label"
    if name == "Value":
        return "string" if feature.dtype in ("string", "large_string") else "number"
    return name.lower()


def _choose_input(columns: dict[str, str], opts: dict[str, Any], skip: set[str]) -> tuple[str, list[str]]:
    for kind in ("image", "text"):
        if opts.get(kind):
            col = str(opts[kind])
            if col not in columns:
                raise DataError(f"hf: no column {col!r} for -D {kind}=; columns: {sorted(columns)}")
            return kind, [col]
    if opts.get("features"):
        cols = [c.strip() for c in str(opts["features"]).split(",") if c.strip()]
        missing = [c for c in cols if c not in columns]
        if missing:
            raise DataError(f"hf: no column(s) {missing} for -D features=; columns: {sorted(columns)}")
        return "features", cols
    free = {c: k for c, k in columns.items() if c not in skip}
    for kind, want in (("image", "image"), ("text", "string")):
        found = [c for c, k in free.items() if k == want]
        if found:
            return kind, found[:1]
    numeric = [c for c, k in free.items() if k in ("number", "label")]
    if not numeric:
        raise DataError(f"hf: no image, text or numeric input column among {sorted(columns)}")
    return "features", numeric


def _images(split: Any, col: str) -> np.ndarray:
    out = []
    for i, img in enumerate(split[col]):
        a = np.asarray(img)
        if a.ndim == 2:
            a = a[:, :, None]
        if a.ndim != 3:
            raise DataError(f"hf: column {col!r} row {i}: an image must be HxW or HxWxC, got shape {a.shape}")
        out.append(a)
    shapes = {a.shape for a in out}
    if len(shapes) > 1:
        raise DataError(f"hf: column {col!r} holds images of several sizes {sorted(shapes)[:3]}; resize them first")
    x = np.stack(out).transpose(0, 3, 1, 2)
    if x.dtype != np.uint8:
        x = x.astype(np.float32)
    return x


def _features(split: Any, cols: list[str]) -> np.ndarray:
    try:
        return np.stack([np.asarray(split[c], dtype=np.float32) for c in cols], axis=1)
    except (TypeError, ValueError):
        raise DataError(f"hf: feature columns {cols} must hold numbers") from None


def load_hf(folder: Path | None = None, **opts: Any) -> ImageDataset | ClientDatasets:
    """The dataset as one pool (:class:`ImageDataset`) or, with ``partition_by``, its natural clients."""
    from fedskew.data.readers.ag_news import build_vocabulary, encode

    unknown = sorted(set(opts) - set(OPTIONS))
    if unknown:
        raise DataError(f"hf: unknown option(s) {unknown}; options: {', '.join(OPTIONS)}")
    splits = open_splits(folder, opts.get("hub"))
    tr_name, te_name = str(opts.get("train_split", "train")), str(opts.get("test_split", "test"))
    if tr_name not in splits:
        raise DataError(f"hf: no split {tr_name!r} (-D train_split=); splits: {sorted(splits)}")
    train, test = splits[tr_name], splits.get(te_name)
    columns = {c: _kind(f) for c, f in train.features.items()}
    label = str(opts.get("label", "label"))
    if label not in columns:
        raise DataError(f"hf: no label column {label!r} (-D label=); columns: {sorted(columns)}")
    by = opts.get("partition_by")
    if by is not None and by not in columns:
        raise DataError(f"hf: no column {by!r} for -D partition_by=; columns: {sorted(columns)}")
    kind, cols = _choose_input(columns, opts, {label, *([by] if by else [])})
    # labels: ClassLabel ids as they are, numbers checked, strings mapped to ids in sorted order
    feat = train.features[label]
    raw = [np.asarray(train[label])] + ([np.asarray(test[label])] if test is not None else [])
    if _kind(feat) == "label":
        classes, num_classes = tuple(feat.names), int(feat.num_classes)
        ys = [r.astype(np.int64) for r in raw]
    elif raw[0].dtype.kind in "iu":
        ys = [r.astype(np.int64) for r in raw]
        classes, num_classes = (), int(max(int(r.max()) for r in ys if r.size) + 1)
    else:
        names = sorted({str(v) for r in raw for v in r})
        ids = {n: i for i, n in enumerate(names)}
        ys = [np.asarray([ids[str(v)] for v in r], dtype=np.int64) for r in raw]
        classes, num_classes = tuple(names), len(names)
    vocabulary: tuple[str, ...] = ()
    if kind == "image":
        xs = [_images(s, cols[0]) for s in (train, test) if s is not None]
    elif kind == "text":
        seq_len = int(opts.get("seq_len", 64))
        texts = [[str(t) for t in s[cols[0]]] for s in (train, test) if s is not None]
        vocabulary = build_vocabulary(texts[0])
        xs = [encode(t, vocabulary, seq_len) for t in texts]
    else:
        xs = [_features(s, cols) for s in (train, test) if s is not None]
    name = str(opts.get("hub") or (Path(folder).name if folder else "hf"))
    if by is None:
        return ImageDataset(
            name,
            xs[0],
            ys[0],
            xs[1] if test is not None else None,
            ys[1] if test is not None else None,
            num_classes,
            classes,
            vocabulary,
        )
    keys_tr = [str(v) for v in train[by]]
    owners = list(dict.fromkeys(keys_tr))
    pos = {k: i for i, k in enumerate(owners)}
    group_tr = np.asarray([pos[k] for k in keys_tr])
    x_tr = [xs[0][group_tr == i] for i in range(len(owners))]
    y_tr = [ys[0][group_tr == i] for i in range(len(owners))]
    x_te = y_te = None
    if test is not None:
        if by not in test.features:
            raise DataError(f"hf: the {te_name!r} split has no column {by!r} to give its rows to clients")
        keys_te = [str(v) for v in test[by]]
        strays = sorted(set(keys_te) - set(pos))
        if strays:
            raise DataError(f"hf: test rows of {by}={strays[:3]} have no training rows (a split by {by})")
        group_te = np.asarray([pos[k] for k in keys_te])
        x_te = [xs[1][group_te == i] for i in range(len(owners))]
        y_te = [ys[1][group_te == i] for i in range(len(owners))]
    meta: dict[str, Any] = {"partition_by": by, "classes": list(classes)}
    if vocabulary:
        meta["vocabulary"] = list(vocabulary)
    return ClientDatasets(name, num_classes, x_tr, y_tr, x_te, y_te, owners, meta)


register_reader(
    DatasetSpec(
        "hf",
        lambda folder, **opts: load_hf(folder, **opts),
        summary="a Hugging Face dataset on disk (save_to_disk folder, parquet, or the local hub cache; extra [hf])",
        probe=lambda d: True,
        expected="a save_to_disk folder or parquet files (or -D hub=NAME for the local Hugging Face cache)",
        needs_data_dir=False,
        uses_files=False,
        per_client=True,
        options=OPTIONS,
    ),
    origin="fedskew",
)
