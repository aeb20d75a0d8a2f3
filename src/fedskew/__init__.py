"""fedskew: federated learning under data heterogeneity.

The library API (:mod:`fedskew.api`) is importable from here: ``fedskew.run``, ``fedskew.from_arrays``,
``fedskew.from_clients``, ``fedskew.split_model``, ``fedskew.weighting``, ``fedskew.combine``, ``fedskew.register``,
``fedskew.ClientPart``, ``fedskew.ServerPlugin``, ``fedskew.partition``, ``fedskew.LocalAlgorithm``,
``fedskew.RunResult``. They load on first use, so ``import fedskew`` (and the CLI's start-up) stays light.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_API = (
    "ClientPart",
    "LocalAlgorithm",
    "RunResult",
    "ServerPlugin",
    "combine",
    "from_arrays",
    "from_clients",
    "partition",
    "register",
    "run",
    "split_model",
    "unregister",
    "weighting",
)
__all__ = ["__version__", *_API]


def __getattr__(name: str) -> Any:
    if name in _API:
        from fedskew import api

        return getattr(api, name)
    raise AttributeError(f"module 'fedskew' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
