"""What ``fedskew methods`` prints, without importing the methods (issue 45: it answers at once).

Listing the registered parts needs their modules, which import torch (seconds on a small machine); counting the
valid compositions resolves every pair. Both are fixed for a given fedskew source, so they are computed once into
``catalog/index.json`` (:func:`compute_index`, written by ``python tools/method_index.py``) and read back by
:func:`method_index`. The file cannot drift from the code: ``tests/test_cli_startup.py`` recomputes it and fails,
naming the command to run, when a part's name, kind or summary changed. Parts that installed packages register
through the ``fedskew.methods`` entry points, or that this process registered (``fedskew.register``), are not in the
file, so when there are any the index is computed from the registry instead (slower, always complete).
"""

from __future__ import annotations

import json
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

INDEX = Path(__file__).resolve().parent / "catalog" / "index.json"
ENTRY_POINT_GROUP = "fedskew.methods"  # as fedskew.registry's (kept here so that reading the index imports nothing)


def compute_index() -> dict[str, Any]:
    """The rows (name, kind, summary) of every registered part and alias, the valid compositions of a client part
    and a plug-in (or two plug-ins) under their canonical names, the refused ones with their reasons, and the valid
    ones that can run under user-level differential privacy."""
    from fedskew.methods import CLIENTS, SERVER_PLUGINS, describe_methods, resolve_method
    from fedskew.privacy.server import refusal

    valid: list[str] = []
    refused: list[str] = []
    private: list[str] = []  # the valid compositions that can run under user-level DP (docs/privacy.md)
    candidates = [c for c in CLIENTS] + [f"{c}+{p}" for c in CLIENTS for p in SERVER_PLUGINS]
    candidates += [f"{a}+{b}" for a in SERVER_PLUGINS for b in SERVER_PLUGINS if a < b]
    for name in candidates:
        try:
            method = resolve_method(name, {})
        except ValueError as exc:
            refused.append(f"{name} ({str(exc).split(': ', 1)[-1]})")
            continue
        if method.name not in valid:
            valid.append(method.name)
            if refusal(method) is None:
                private.append(method.name)
    rows = [list(r) for r in describe_methods()]
    return {"rows": rows, "valid": valid, "refused": refused, "private": private}


def method_index() -> dict[str, Any]:
    """The index: read from ``catalog/index.json`` when no installed package adds parts and this process registered
    none beyond the built-in ones (``fedskew.register``), else computed from the registry."""
    if list(metadata.entry_points(group=ENTRY_POINT_GROUP)) or not INDEX.is_file():
        return compute_index()
    stored = json.loads(INDEX.read_text(encoding="utf-8"))
    registry = sys.modules.get("fedskew.registry")
    if registry is not None:  # the registry is loaded: parts registered in this process count too
        names = set(registry.CLIENTS) | set(registry.SERVER_PLUGINS) | set(registry.ALIASES)
        if names != {row[0] for row in stored["rows"]}:
            return compute_index()
    return stored


def write_index(path: Path = INDEX) -> None:
    path.write_text(json.dumps(compute_index(), indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
