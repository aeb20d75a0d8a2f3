"""``tuned.yaml``: the best hyper-parameters per method and setting that ``fedskew tune`` found, and how a sweep or
a reproduction applies them (``--tuned FILE``).

The file is a list of entries::

    tuned:
    - method: fedprox                 # the canonical composition
      setting: {dataset: digits, partition: dir, alpha: 0.1, clients: 10, ...}   # where it was tuned
      args: {mu: 0.0123}              # method hyper-parameters (-m)
      run: {lr: 0.031}                # run-level settings that were searched too (only when asked)
      value: 0.9412                   # the objective on the validation splits
      metric: global_acc
      statistic: last_n_mean
      ...                             # the search: study, space, trials, budget (for the record)

A run takes an entry when its method is the entry's and every key of the entry's ``setting`` has the run's value
(:data:`TUNED_SETTING_KEYS`: the data, the federation and the local training, not the number of rounds: a search on
fewer rounds is the usual budget); the most specific match wins. Arguments the run gives explicitly (a sweep's
``methods: [{name: fedprox, args: {mu: 0.1}}]``, a paper's row) win over the tuned ones; the tuned run-level
settings replace the base's (the setting matched on everything else).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from fedskew.config import SETTING_KEYS, TRAINING_KEYS
from fedskew.schema import ConfigError, read_yaml
from fedskew.space import RUN_LEVEL

# what "the same setting" means for tuned arguments: the data, the federation, the local training and the model;
# rounds, seeds, evaluation cadence and where output goes do not
TUNED_SETTING_KEYS = (*SETTING_KEYS, *TRAINING_KEYS)


@dataclass(frozen=True)
class TunedEntry:
    method: str
    setting: dict[str, Any]
    args: dict[str, Any] = field(default_factory=dict)
    run: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)  # value, metric, study, space, trials, budget

    def to_yaml(self) -> dict[str, Any]:
        return {"method": self.method, "setting": self.setting, "args": self.args, "run": self.run, **self.extra}

    def matches(self, method: str, cfg: Mapping[str, Any]) -> bool:
        return method == self.method and all(_same(cfg.get(k), v) for k, v in self.setting.items())


def format_args(args: Mapping[str, Any]) -> str:
    """``mu=0.01234, lr=0.05`` (floats to 4 significant digits), for progress lines and notes."""
    return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in args.items())


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, int | float) and isinstance(b, int | float) and not isinstance(a, bool):
        return float(a) == float(b)
    return a == b


def canonical_method(name: str) -> str:
    """A composition's canonical name (aliases resolved, implied plug-ins left implicit), as ``resolve_method`` names
    it: ``fedpake`` -> ``fedavg+fedsa``."""
    from fedskew.methods import _parse_name
    from fedskew.registry import ALIASES, CLIENTS

    tokens, client, plugins = _parse_name(name)
    implied = set(CLIENTS[client].implies) - {ALIASES.get(t, t) for t in tokens}
    shown = [p for p in plugins if p not in implied]
    return "+".join([client, *shown])


def setting_of(cfg: Mapping[str, Any], exclude: tuple[str, ...] = ()) -> dict[str, Any]:
    """The setting a configuration (a validated ``RunConfig.model_dump()``) tunes or runs in."""
    return {k: cfg[k] for k in TUNED_SETTING_KEYS if k in cfg and k not in exclude}


def load_tuned(path: str | Path) -> list[TunedEntry]:
    """Read a ``tuned.yaml``; a problem is a :class:`ConfigError` naming the file and the entry."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"tuned file not found: {p}")
    data = read_yaml(p) or {}
    items = data.get("tuned") if isinstance(data, dict) else None
    if not isinstance(items, list):
        raise ConfigError(f"tuned file {p}: expected a mapping with a list 'tuned:' of entries")
    out = []
    for i, item in enumerate(items):
        if not isinstance(item, dict) or not isinstance(item.get("method"), str):
            raise ConfigError(f"tuned file {p}, entry {i}: needs 'method' (a composition name)")
        for key in ("setting", "args", "run"):
            if not isinstance(item.get(key, {}), dict):
                raise ConfigError(f"tuned file {p}, entry {i} ({item['method']}): '{key}' must be a mapping")
        bad = [k for k in item.get("run", {}) if k not in RUN_LEVEL]
        if bad:
            raise ConfigError(f"tuned file {p}, entry {i}: run-level keys {bad} are not among {', '.join(RUN_LEVEL)}")
        try:
            method = canonical_method(item["method"])
        except ConfigError as exc:
            raise ConfigError(f"tuned file {p}, entry {i}: {exc}") from None
        rest = {k: v for k, v in item.items() if k not in ("method", "setting", "args", "run")}
        setting, args, run = (dict(item.get(k, {})) for k in ("setting", "args", "run"))
        out.append(TunedEntry(method, setting, args, run, rest))
    return out


def merge_entries(old: list[TunedEntry], new: list[TunedEntry]) -> list[TunedEntry]:
    """``old`` with every entry of the same method and setting as one of ``new`` replaced by it."""
    fresh = {(e.method, yaml.safe_dump(e.setting, sort_keys=True)) for e in new}
    kept = [e for e in old if (e.method, yaml.safe_dump(e.setting, sort_keys=True)) not in fresh]
    return [*kept, *new]


def dump_tuned(entries: list[TunedEntry]) -> str:
    head = (
        "# fedskew tune: best hyper-parameters per method and setting, found on the clients' validation splits.\n"
        "# Apply with `fedskew sweep SPEC --tuned FILE` or `fedskew reproduce PAPER --tuned FILE`.\n"
    )
    return head + yaml.safe_dump({"tuned": [e.to_yaml() for e in entries]}, sort_keys=False)


def write_tuned(path: str | Path, entries: list[TunedEntry]) -> Path:
    """Write ``entries`` into ``path``, keeping the entries of other methods and settings already there; written to
    a temporary file and renamed, so the file is never half-written."""
    p = Path(path)
    old = load_tuned(p) if p.is_file() else []
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(dump_tuned(merge_entries(old, entries)))
    tmp.replace(p)
    return p


def find_entry(entries: list[TunedEntry], method: str, cfg: Mapping[str, Any]) -> TunedEntry | None:
    """The most specific entry for ``method`` (canonical) in the validated configuration ``cfg``; the last one of
    equal specificity."""
    best: TunedEntry | None = None
    for e in entries:
        if e.matches(method, cfg) and (best is None or len(e.setting) >= len(best.setting)):
            best = e
    return best


def apply_tuned(values: dict[str, Any], entries: list[TunedEntry]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Configuration ``values`` (as a sweep builds them, before validation) with the tuned arguments of the entry
    that matches it, and what it took (``{"args", "run", "study"}``; None: no entry matched, ``values`` unchanged).
    Method arguments ``values`` gives explicitly win over the tuned ones."""
    from fedskew.config import make_config

    cfg = make_config(values).model_dump()
    entry = find_entry(entries, canonical_method(cfg["method"]), cfg)
    if entry is None:
        return values, None
    given = dict(values.get("method_args", {}))
    args = {k: v for k, v in entry.args.items() if k not in given}
    out = {**values, **entry.run, "method_args": {**args, **given}}
    return out, {"args": args, "run": dict(entry.run), "study": entry.extra.get("study")}
