"""LEAF's JSON format (Caldas et al., "LEAF: A Benchmark for Federated Settings", 2018; TalwalkarLab/leaf): natural
clients, a writer or a speaker or a user each.

``--dataset femnist | shakespeare | sent140 --data-dir DIR`` reads what LEAF's preparation scripts write:

- ``DIR/train/*.json`` and ``DIR/test/*.json`` split by sample (``preprocess.sh -t sample``: every user in both; a
  user's training and test samples are that client's),
- the same folders split by user (``-t user``: the test users are other users, who never train): the training users
  are the clients and the test users come after them as **held-out clients** (``--heldout-clients K`` with K the
  test users, ``--partition given``; every user's samples are split with ``train_ratio``: a held-out user adapts on
  the first part and is scored on the rest), or
- ``DIR/all_data/*.json`` or ``DIR/*.json`` (unsplit: each client's samples are split with ``train_ratio``, seeded).

Each file holds ``{"users": [...], "num_samples": [...], "user_data": {user: {"x": [...], "y": [...]}}}`` (an
optional ``"hierarchies"`` is ignored); users are taken in file order, files in name order.

Tasks, told apart by the samples (or by the dataset name):

- **femnist**: ``x`` 784 pixel values in [0, 1] (a 28x28 character), ``y`` one of 62 classes (digits, upper- and
  lower-case letters): float images ``[n, 1, 28, 28]`` as LEAF stores them;
- **shakespeare**: ``x`` 80 characters of a speaking role's lines, ``y`` the next character: token ids over LEAF's
  80-letter alphabet (``utils/language_utils.py``), 80 classes; LEAF's model is ``--model charlstm``;
- **sent140**: ``x`` a tweet's ``[id, date, query, user, text]``, ``y`` 0/1 sentiment: the text's lower-cased words
  as ids of a vocabulary of the training split's words (seen at least twice), the first 25 (LEAF's length), 0 pads,
  1 unknown; ``--model textcnn`` (LEAF's LSTM reads GloVe vectors, which fedskew does not ship: a named departure).

Every problem is a :class:`DataError` naming the file and user: unreadable JSON, a missing key, ``num_samples`` that
disagree with the data, x/y lengths that differ, ragged or non-numeric pixels, unknown characters, labels out of
range.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from fedskew.data.readers.base import ClientDatasets, DataError
from fedskew.data.readers.images import fingerprint
from fedskew.data.readers.registry import DatasetSpec, register_reader

#: LEAF's Shakespeare alphabet (``utils/language_utils.py`` ALL_LETTERS): 80 characters, a character's id its index
LEAF_LETTERS = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"
FEMNIST_CLASSES = 62
SENT140_LEN = 25
SENT140_MIN_FREQ = 2
_WORD = re.compile(r"[^\W_]+")


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.glob("*.json") if p.is_file())


def layout(folder: Path) -> tuple[list[Path], list[Path]]:
    """(training files, test files) of a LEAF data folder; no test files for an unsplit folder."""
    train, test = _files(folder / "train"), _files(folder / "test")
    if train or test:
        if not train or not test:
            which = "train" if not train else "test"
            raise DataError(f"{folder}: LEAF split folders need both train/ and test/ JSON files; {which}/ has none")
        return train, test
    for sub in (folder / "all_data", folder):
        if _files(sub):
            return _files(sub), []
    raise DataError(f"{folder}: no LEAF JSON files (expected train/*.json and test/*.json, or all_data/*.json)")


def read_users(files: list[Path]) -> dict[str, tuple[list[Any], list[Any]]]:
    """Every user's ``(x, y)`` over ``files``, in file and user order; a user in two files is an error."""
    out: dict[str, tuple[list[Any], list[Any]]] = {}
    for path in files:
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise DataError(f"{path}: not a readable LEAF JSON file ({exc})") from None
        if not isinstance(doc, dict) or not all(k in doc for k in ("users", "user_data")):
            raise DataError(f"{path}: a LEAF file holds 'users', 'num_samples' and 'user_data'")
        users, data, counts = doc["users"], doc["user_data"], doc.get("num_samples")
        if counts is not None and len(counts) != len(users):
            raise DataError(f"{path}: {len(users)} users but {len(counts)} num_samples entries")
        for i, user in enumerate(users):
            entry = data.get(user) if isinstance(data, dict) else None
            if not isinstance(entry, dict) or "x" not in entry or "y" not in entry:
                raise DataError(f"{path}: user {user!r} is listed but has no x and y in user_data")
            x, y = entry["x"], entry["y"]
            if len(x) != len(y):
                raise DataError(f"{path}: user {user!r} has {len(x)} samples but {len(y)} labels")
            if counts is not None and counts[i] != len(y):
                raise DataError(f"{path}: user {user!r}: num_samples says {counts[i]}, user_data holds {len(y)}")
            if user in out:
                raise DataError(f"{path}: user {user!r} appears in two files of the same split")
            out[str(user)] = (list(x), list(y))
    if not out:
        raise DataError(f"{files[0].parent}: the LEAF files hold no users")
    return out


def task_of(name: str, x: Any) -> str:
    """femnist, shakespeare or sent140, from the dataset name or the first sample."""
    if name in ("femnist", "shakespeare", "sent140"):
        return name
    if isinstance(x, str):
        return "shakespeare"
    if isinstance(x, list) and len(x) == 5 and isinstance(x[4], str):
        return "sent140"
    return "femnist"


def _femnist(user: str, x: list[Any], y: list[Any], where: str) -> tuple[np.ndarray, np.ndarray]:
    try:
        arr = np.asarray(x, dtype=np.float32)
    except (TypeError, ValueError):
        raise DataError(f"{where}: user {user!r}: pixels must be lists of 784 numbers (ragged or not)") from None
    if arr.ndim != 2 or arr.shape[1] != 28 * 28:
        raise DataError(f"{where}: user {user!r}: each FEMNIST sample is 784 pixel values, got shape {arr.shape}")
    if not np.isfinite(arr).all():
        raise DataError(f"{where}: user {user!r}: NaN or Inf pixel values")
    return arr.reshape(-1, 1, 28, 28), _labels(user, y, FEMNIST_CLASSES, where)


def _labels(user: str, y: list[Any], classes: int, where: str) -> np.ndarray:
    try:
        lab = np.asarray(y, dtype=np.float64)
    except (TypeError, ValueError):
        raise DataError(f"{where}: user {user!r}: labels must be integers") from None
    if lab.size and (lab.min() < 0 or lab.max() >= classes or not np.all(lab == np.round(lab))):
        raise DataError(f"{where}: user {user!r}: labels must be integers in 0..{classes - 1}")
    return lab.astype(np.int64)


def _chars(user: str, text: str, where: str) -> list[int]:
    ids = [LEAF_LETTERS.find(c) for c in text]
    if -1 in ids:
        bad = text[ids.index(-1)]
        raise DataError(f"{where}: user {user!r}: character {bad!r} is not in LEAF's 80-letter alphabet")
    return ids


def _shakespeare(user: str, x: list[Any], y: list[Any], where: str) -> tuple[np.ndarray, np.ndarray]:
    if not all(isinstance(s, str) for s in x) or len({len(s) for s in x}) > 1:
        raise DataError(f"{where}: user {user!r}: Shakespeare samples are strings of one length (LEAF: 80)")
    if not all(isinstance(c, str) and len(c) == 1 for c in y):
        raise DataError(f"{where}: user {user!r}: a Shakespeare label is the next character (one character)")
    xs = np.asarray([_chars(user, s, where) for s in x], dtype=np.int64).reshape(len(x), -1)
    ys = np.asarray([_chars(user, c, where)[0] for c in y], dtype=np.int64)
    return xs, ys


def _words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def _sent140_text(user: str, x: list[Any], where: str) -> list[str]:
    if not all(isinstance(s, list) and len(s) == 5 and isinstance(s[4], str) for s in x):
        raise DataError(f"{where}: user {user!r}: a Sent140 sample is [id, date, query, user, text]")
    return [s[4] for s in x]


def load_leaf(folder: Path, name: str = "leaf") -> ClientDatasets:
    """The LEAF folder as per-client data (module docstring)."""
    folder = Path(folder)
    train_files, test_files = layout(folder)
    train = read_users(train_files)
    test = read_users(test_files) if test_files else None
    heldout: list[str] = []
    if test is not None and set(test) != set(train):
        if set(test) & set(train):
            both = sorted(set(test) & set(train))[:3]
            raise DataError(
                f"{folder}: train/ and test/ share some users (e.g. {both}) but not all: neither LEAF's split by "
                "sample (every user in both) nor by user (no user in both)"
            )
        heldout = list(test)  # split by user: the test users are held-out clients after the training users
        train = {**train, **test}
        test = None
    users = list(train)
    first_x = next(iter(train.values()))[0]
    task = task_of(name, first_x[0] if first_x else None)
    where_tr, where_te = str(train_files[0].parent), str(test_files[0].parent) if test_files else ""
    if task == "sent140":
        out = _load_sent140(folder, users, train, test, where_tr, where_te)
        out.meta["heldout_users"] = len(heldout)
        return out
    decode = _femnist if task == "femnist" else _shakespeare
    xs, ys = zip(*(decode(u, *train[u], where_tr) for u in users), strict=True)
    x_test = y_test = None
    if test is not None:
        xt, yt = zip(*(decode(u, *test[u], where_te) for u in users), strict=True)
        x_test, y_test = list(xt), list(yt)
    classes = FEMNIST_CLASSES if task == "femnist" else len(LEAF_LETTERS)
    meta: dict[str, Any] = {"users": users, "task": task, "heldout_users": len(heldout)}
    if task == "shakespeare":
        meta["vocabulary"] = list(LEAF_LETTERS)
    return ClientDatasets(task, classes, list(xs), list(ys), x_test, y_test, users, meta)


def _load_sent140(
    folder: Path,
    users: list[str],
    train: dict[str, tuple[list[Any], list[Any]]],
    test: dict[str, tuple[list[Any], list[Any]]] | None,
    where_tr: str,
    where_te: str,
) -> ClientDatasets:
    texts = {u: _sent140_text(u, train[u][0], where_tr) for u in users}
    counts = Counter(w for u in users for t in texts[u] for w in _words(t))
    vocab = ["<pad>", "<unk>", *sorted(w for w, c in counts.items() if c >= SENT140_MIN_FREQ)]
    ids = {w: i for i, w in enumerate(vocab)}

    def encode(text_list: list[str]) -> np.ndarray:
        out = np.zeros((len(text_list), SENT140_LEN), dtype=np.int64)
        for r, t in enumerate(text_list):
            toks = [ids.get(w, 1) for w in _words(t)][:SENT140_LEN]
            out[r, : len(toks)] = toks
        return out

    xs = [encode(texts[u]) for u in users]
    ys = [_labels(u, train[u][1], 2, where_tr) for u in users]
    x_test = y_test = None
    if test is not None:
        x_test = [encode(_sent140_text(u, test[u][0], where_te)) for u in users]
        y_test = [_labels(u, test[u][1], 2, where_te) for u in users]
    meta = {"users": users, "task": "sent140", "vocabulary": vocab}
    return ClientDatasets("sent140", 2, xs, ys, x_test, y_test, users, meta)


def _probe(folder: Path) -> bool:
    return any(_files(d) for d in (folder / "train", folder / "all_data", folder))


for _name, _summary in (
    ("femnist", "LEAF's FEMNIST: 62 classes of handwritten characters, a writer per client (LEAF JSON files)"),
    ("shakespeare", "LEAF's Shakespeare: next character of a speaking role's lines, a role per client (LEAF JSON)"),
    ("sent140", "LEAF's Sent140: tweet sentiment, a Twitter user per client (LEAF JSON files)"),
):
    register_reader(
        DatasetSpec(
            _name,
            lambda folder, _n=_name: load_leaf(folder, _n),
            summary=_summary,
            probe=_probe,
            expected="LEAF's JSON files: train/*.json and test/*.json (split by sample), or all_data/*.json",
            needs_data_dir=True,
            per_client=True,
            fingerprint=fingerprint,
        ),
        origin="fedskew",
    )
