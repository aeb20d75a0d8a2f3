"""Fetching official dataset files: first working URL, MD5-checked, written atomically, archives unpacked safely."""

from __future__ import annotations

import hashlib
import os
import shutil
import tarfile
import tempfile
import urllib.error
import urllib.request
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from fedskew.data.readers.base import DataError


@dataclass(frozen=True)
class Remote:
    """One official file of a dataset: its name, the URLs that serve it (tried in order) and its MD5."""

    filename: str
    urls: tuple[str, ...]
    md5: str
    archive: bool = False  # unpack into the download folder after verification


def md5sum(path: Path) -> str:
    h = hashlib.md5()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def download(urls: Sequence[str], dest: Path, md5: str, timeout: float = 60.0) -> None:
    """Fetch the first URL that works into ``dest`` (temp file + MD5 check + atomic rename)."""
    errors = []
    for url in urls:
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=dest.name + ".", suffix=".part")
        except OSError as exc:
            raise DataError(f"cannot write {dest} ({exc})") from exc
        try:
            h = hashlib.md5()
            with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=timeout) as resp:
                for block in iter(lambda resp=resp: resp.read(1 << 20), b""):
                    h.update(block)
                    out.write(block)
            if h.hexdigest() != md5:
                errors.append(f"{url}: MD5 {h.hexdigest()} != expected {md5}")
                continue
            os.replace(tmp, dest)
            return
        except (urllib.error.URLError, OSError, ValueError) as exc:
            errors.append(f"{url}: {exc}")
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    raise DataError(f"could not download {dest.name}: " + "; ".join(errors))


def extract(archive: Path, into: Path) -> None:
    """Unpack a .tar.gz / .zip next to itself: into a temp folder first, then rename each top-level entry."""
    try:
        tmp = Path(tempfile.mkdtemp(dir=into, prefix=".extract-"))
    except OSError as exc:
        raise DataError(f"cannot unpack {archive} into {into} ({exc})") from exc
    try:
        if archive.name.endswith(".zip"):
            with zipfile.ZipFile(archive) as zf:
                zf.extractall(tmp)
        else:
            with tarfile.open(archive) as tf:
                if hasattr(tarfile, "data_filter"):
                    tf.extractall(tmp, filter="data")
                else:  # Python < 3.11.4: refuse links and paths escaping the target by hand
                    for m in tf.getmembers():
                        target = (tmp / m.name).resolve()
                        if not (m.isfile() or m.isdir()) or tmp.resolve() not in (target, *target.parents):
                            raise DataError(f"{archive}: unsafe archive member {m.name!r}")
                    tf.extractall(tmp)
        for entry in tmp.iterdir():
            if not (into / entry.name).exists():
                os.replace(entry, into / entry.name)
    except (tarfile.TarError, zipfile.BadZipFile, OSError) as exc:
        raise DataError(f"{archive}: cannot unpack ({exc})") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def fetch(remote: Sequence[Remote], target: Path, present: Callable[[Path], bool]) -> None:
    """Download the missing files of ``remote`` into ``target``; an archive is skipped when ``present(target)``
    already finds the unpacked dataset there."""
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DataError(f"cannot create download folder {target} ({exc})") from exc
    for r in remote:
        dest = target / r.filename
        if r.archive:
            if present(target):
                continue
            if not (dest.is_file() and md5sum(dest) == r.md5):
                download(r.urls, dest, r.md5)
            extract(dest, target)
        elif not dest.is_file() and not (target / r.filename.removesuffix(".gz")).is_file():
            download(r.urls, dest, r.md5)
