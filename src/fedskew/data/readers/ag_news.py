"""AG News (Zhang, Zhao and LeCun, 2015), the official CSV release ``ag_news_csv/``: ``train.csv`` (120,000 rows)
and ``test.csv`` (7,600 rows), no header, three quoted columns: the class index 1..4 (World, Sports, Business,
Sci/Tech: labels 0..3), the title and the description. A first row whose class column reads ``Class Index`` (the
Kaggle copy's header) is skipped; ``classes.txt`` and ``readme.txt`` are not read.

Text becomes token ids with a simple, deterministic tokenizer and a vocabulary built from the **training split
only** (:func:`tokenize`, :func:`build_vocabulary`):

* a sample's text is its title, a space and its description, lower-cased; its tokens are the maximal runs of
  letters and digits (``[^\\W_]+``, Unicode-aware), so punctuation, the release's ``\\`` line breaks and HTML
  escapes only separate words;
* the vocabulary is id 0 ``<pad>``, id 1 ``<unk>``, then the training split's words seen at least ``min_freq``
  times (default :data:`AG_MIN_FREQ`), most frequent first (ties alphabetically), at most ``max_vocab`` ids in all
  (default :data:`AG_MAX_VOCAB`);
* every sample is the ids of its first ``seq_len`` tokens (default :data:`AG_SEQ_LEN`; a word outside the vocabulary
  is 1), padded with 0 to ``seq_len``: int64 ``[N, seq_len]``.

The vocabulary is thus a function of ``train.csv`` and the options alone: the test split is encoded with it, and it
is stored with the encoded arrays in the on-disk cache (an atomically written ``.npz`` under ``$FEDSKEW_CACHE``,
keyed by the two files' sizes and modification times and by the options) and written into every run directory as
``vocab.txt`` (one word per line, line ``i`` is id ``i``). ``vocab_file=PATH`` encodes with such a saved vocabulary
instead of building one (the same ids as the run that wrote it).
"""

from __future__ import annotations

import contextlib
import csv
import re
import zipfile
from collections import Counter
from pathlib import Path

import numpy as np

from fedskew.data.readers.base import (
    DataError,
    ImageDataset,
    PathLike,
    atomic_savez,
    cache_root,
    vocabulary_digest,
)
from fedskew.data.readers.images import fingerprint
from fedskew.data.readers.registry import DatasetSpec, data_roots, get_spec, locate, register_reader

AG_CLASSES = ("World", "Sports", "Business", "Sci/Tech")
AG_FILES = ("train.csv", "test.csv")
PAD, UNK = "<pad>", "<unk>"
#: tokens kept per sample (AG News averages about 40 words of title and description; longer samples are truncated)
AG_SEQ_LEN = 64
#: vocabulary ids at most, ``<pad>`` and ``<unk>`` included
AG_MAX_VOCAB = 20_000
#: a training word seen fewer times than this is ``<unk>``
AG_MIN_FREQ = 2

_TOKEN = re.compile(r"[^\W_]+")


def tokenize(text: str) -> list[str]:
    """The lower-cased runs of letters and digits of ``text``."""
    return _TOKEN.findall(text.lower())


def read_ag_csv(path: Path) -> tuple[list[str], np.ndarray]:
    """(texts, int64 labels 0..3) of an AG News CSV file; :class:`DataError` naming the file and line otherwise."""
    texts: list[str] = []
    labels: list[int] = []
    try:
        with path.open(newline="", encoding="utf-8") as f:
            reader = csv.reader(f)
            for row in reader:
                n = reader.line_num
                if not row:
                    continue  # a blank line
                if n == 1 and row[0].strip().lower() == "class index":
                    continue  # the Kaggle copy's header
                if len(row) != 3:
                    raise DataError(
                        f"{path}, line {n}: expected 3 columns (class index, title, description), got {len(row)}"
                    )
                try:
                    c = int(row[0])
                except ValueError:
                    c = 0
                if not 1 <= c <= len(AG_CLASSES):
                    raise DataError(f"{path}, line {n}: class index {row[0]!r} is not one of 1, 2, 3, 4")
                labels.append(c - 1)
                texts.append(f"{row[1]} {row[2]}")
    except FileNotFoundError:
        raise DataError(f"{path}: file not found (AG News needs {' and '.join(AG_FILES)})") from None
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise DataError(f"{path}: cannot read ({exc})") from exc
    if not labels:
        raise DataError(f"{path}: no rows (empty file)")
    return texts, np.asarray(labels, dtype=np.int64)


def build_vocabulary(texts: list[str], max_vocab: int = AG_MAX_VOCAB, min_freq: int = AG_MIN_FREQ) -> tuple[str, ...]:
    """``<pad>``, ``<unk>``, then the words of ``texts`` seen at least ``min_freq`` times, most frequent first (ties
    alphabetically), ``max_vocab`` entries at most."""
    counts = Counter(w for t in texts for w in tokenize(t))
    words = sorted((w for w, c in counts.items() if c >= min_freq), key=lambda w: (-counts[w], w))
    return (PAD, UNK, *words[: max_vocab - 2])


def encode(texts: list[str], vocabulary: tuple[str, ...], seq_len: int) -> np.ndarray:
    """int64 ``[len(texts), seq_len]``: each text's first ``seq_len`` token ids (1 for a word outside the
    vocabulary), padded with 0."""
    index = {w: i for i, w in enumerate(vocabulary)}
    out = np.zeros((len(texts), seq_len), dtype=np.int64)
    for row, t in enumerate(texts):
        ids = [index.get(w, 1) for w in tokenize(t)[:seq_len]]
        out[row, : len(ids)] = ids
    return out


def read_vocabulary(path: PathLike) -> tuple[str, ...]:
    """A vocabulary saved as ``vocab.txt`` (one word per line; ``<pad>`` and ``<unk>`` first)."""
    p = Path(path)
    try:
        words = tuple(p.read_text(encoding="utf-8").splitlines())
    except FileNotFoundError:
        raise DataError(f"{p}: vocabulary file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"{p}: cannot read ({exc})") from exc
    if words[:2] != (PAD, UNK) or len(set(words)) != len(words) or not all(words):
        raise DataError(f"{p}: not a vocabulary: '{PAD}' and '{UNK}' first, then distinct words, one per line")
    return words


def _check_options(seq_len: int, max_vocab: int, min_freq: int) -> None:
    for name, value, least in (("seq_len", seq_len, 1), ("max_vocab", max_vocab, 3), ("min_freq", min_freq, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise DataError(f"ag_news: {name} must be an integer >= {least}, got {value!r}")


def _read_cache(path: Path) -> ImageDataset | None:
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as z:
            vocab = tuple(str(w) for w in z["vocabulary"])
            return ImageDataset(
                "ag_news", z["x_train"], z["y_train"], z["x_test"], z["y_test"], len(AG_CLASSES), AG_CLASSES, vocab
            )
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile, DataError):
        return None  # unreadable cache entry: rebuilt and overwritten


def load_ag_news(
    d: Path,
    seq_len: int = AG_SEQ_LEN,
    max_vocab: int = AG_MAX_VOCAB,
    min_freq: int = AG_MIN_FREQ,
    vocab_file: PathLike | None = None,
) -> ImageDataset:
    """The AG News release in ``d`` (module docstring): token ids int64 ``[N, seq_len]``, 4 classes, the official
    test split, and the vocabulary (built from ``train.csv``, or read from ``vocab_file``)."""
    _check_options(seq_len, max_vocab, min_freq)
    given = read_vocabulary(vocab_file) if vocab_file is not None else None
    files = [d / f for f in AG_FILES]
    for f in files:
        if not f.is_file():
            raise DataError(f"{f}: file not found (AG News needs {' and '.join(AG_FILES)} in {d})")
    root = cache_root()
    key = ("ag_news-v1", seq_len, max_vocab, min_freq, vocabulary_digest(given) if given else "")
    path = root / f"ag_news-{fingerprint(d, *key, files=files)}.npz" if root is not None else None
    cached = _read_cache(path) if path is not None else None
    if cached is not None:
        return cached
    texts, y_train = read_ag_csv(files[0])
    test_texts, y_test = read_ag_csv(files[1])
    vocab = given if given is not None else build_vocabulary(texts, max_vocab, min_freq)
    ds = ImageDataset(
        "ag_news",
        encode(texts, vocab, seq_len),
        y_train,
        encode(test_texts, vocab, seq_len),
        y_test,
        len(AG_CLASSES),
        AG_CLASSES,
        vocab,
    )
    if path is not None:
        with contextlib.suppress(OSError):  # an unwritable cache only costs speed
            atomic_savez(
                path,
                x_train=ds.x_train,
                y_train=ds.y_train,
                x_test=ds.x_test,  # type: ignore[arg-type]
                y_test=ds.y_test,  # type: ignore[arg-type]
                vocabulary=np.asarray(vocab, dtype=str),
            )
    return ds


def ag_news_missing(data_dir: PathLike | None) -> tuple[list[str], str]:
    """(the release's files not found, the paths searched), looking where ``load_dataset("ag_news")`` looks,
    without reading anything."""
    found, searched = locate(get_spec("ag_news"), data_roots(data_dir))
    if found is None:
        return list(AG_FILES), ", ".join(str(s) for s in searched[:3]) + (" ..." if len(searched) > 3 else "")
    return [f for f in AG_FILES if not (found / f).is_file()], str(found)


def _stamp(d: Path, **options: object) -> str:
    return fingerprint(d, files=[f for f in (d / n for n in AG_FILES) if f.is_file()])


register_reader(
    DatasetSpec(
        "ag_news",
        load_ag_news,
        summary="AG News (4 classes of news text): the official train.csv and test.csv; token ids, TextCNN",
        subdirs=("ag_news_csv", "ag_news", "AG_NEWS", "ag-news", "agnews", "ag_news/ag_news_csv"),
        probe=lambda d: any((d / f).is_file() for f in AG_FILES),
        expected="train.csv and test.csv of the official ag_news_csv release (class index 1-4, title, description)",
        aliases=("ag-news", "agnews"),
        options=("seq_len", "max_vocab", "min_freq", "vocab_file"),
        fingerprint=_stamp,
    ),
    origin="fedskew",
)
