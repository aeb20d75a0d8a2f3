"""A composition's search space: the tunable ranges its parts declare (:attr:`fedskew.registry.ClientPart.tunable`),
under the keys ``-m`` takes, with a search's overrides (:mod:`fedskew.space` holds the range types)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fedskew.methods import method_parts
from fedskew.schema import ConfigError
from fedskew.space import RUN_LEVEL, Dist


def method_space(method: str, overrides: Mapping[str, Dist | None] | None = None) -> dict[str, Dist]:
    """The search space of ``method`` (a composition): every part's declared tunables under the keys ``-m`` takes
    (qualified ``part.key`` where two parts of the composition share the key), updated by ``overrides`` (a ``None``
    removes a key; a run-level key in :data:`RUN_LEVEL` adds it). An override naming neither is refused."""
    parts = method_parts(method)
    owners: dict[str, list[str]] = {}
    for part in parts:
        for key in part.params.model_fields:
            owners.setdefault(key, []).append(part.name)
    space: dict[str, Dist] = {}
    for part in parts:
        for key, dist in part.tunable.items():
            if key not in part.params.model_fields:
                raise ConfigError(f"part {part.name!r} declares tunable {key!r}, which is not one of its parameters")
            space[key if len(owners[key]) == 1 else f"{part.name}.{key}"] = dist
    for key, dist in (overrides or {}).items():
        bare = key.rpartition(".")[2]
        known = (
            key in RUN_LEVEL
            or (key in owners and len(owners[key]) == 1)
            or ("." in key and key.rpartition(".")[0] in owners.get(bare, []))
        )
        if not known:
            if bare in owners and len(owners[bare]) > 1:
                raise ConfigError(
                    f"search space: {key!r} is ambiguous in {method!r}; use "
                    + " or ".join(f"{o}.{bare}" for o in owners[bare])
                )
            continue  # a key of another method in the same search (e.g. mu while tuning fedavg): not this one's
        if dist is None:
            space.pop(key, None)
        else:
            space[key] = dist
    return space


def unknown_overrides(methods: list[str], overrides: Mapping[str, Any]) -> list[str]:
    """Override keys that belong to none of ``methods`` (a typo): refused by ``fedskew tune``."""
    keys: set[str] = set(RUN_LEVEL)
    for m in methods:
        for part in method_parts(m):
            for k in part.params.model_fields:
                keys |= {k, f"{part.name}.{k}"}
    return [k for k in overrides if k not in keys]
