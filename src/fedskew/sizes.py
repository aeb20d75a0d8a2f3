"""Byte sizes as people write them (``2GB``, ``512MiB``, ``1.5g``, ``1000000``) and back."""

from __future__ import annotations

import os
import re

_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]?)(i?)(b?)\s*$", re.IGNORECASE)


def parse_size(value: str | int) -> int:
    """Bytes in ``value``: an integer count of bytes, or a number with a unit, ``K``/``M``/``G``/``T`` (powers of
    1000, optionally followed by ``B``) or ``KiB``/``MiB``/``GiB``/``TiB`` (powers of 1024); ``ValueError``
    otherwise."""
    if isinstance(value, bool):
        raise ValueError(f"not a size: {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"a size cannot be negative: {value}")
        return value
    m = _SIZE.match(str(value))
    if m is None or (m.group(3) and not m.group(2)):
        raise ValueError(f"not a size: {value!r} (e.g. 2GB, 512MiB, 1000000)")
    number, unit, binary = float(m.group(1)), m.group(2).lower(), bool(m.group(3))
    return int(number * (_BINARY[unit] if binary else _UNITS[unit]))


def format_size(n: float) -> str:
    """``n`` bytes for a message: ``1.5 GB``, ``640 kB``, ``12 B``."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{int(n)} B"


def physical_memory() -> int | None:
    """This machine's RAM in bytes, where the platform says (``None`` where it does not)."""
    try:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None
    return pages * size if pages > 0 and size > 0 else None
