"""Imports the format modules of this package, so that each registers its datasets: the built-in ones in the order
they are listed, then any other module found here (a format added as one file registers itself)."""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

PACKAGE = __name__.rpartition(".")[0]
BUILTIN = (
    "digits",
    "idx",
    "usps",
    "cifar",
    "svhn",
    "tinyimagenet",
    "cinic",
    "office",
    "ham10000",
    "ag_news",
    "folder",
    "npz",
)
# modules that hold shared code, not formats
INFRASTRUCTURE = frozenset({"base", "registry", "download", "images", "domains"})

for _name in BUILTIN:
    importlib.import_module(f"{PACKAGE}.{_name}")
for _info in pkgutil.iter_modules([str(Path(__file__).parent)]):
    if _info.name not in INFRASTRUCTURE and not _info.name.startswith("_"):
        importlib.import_module(f"{PACKAGE}.{_info.name}")
