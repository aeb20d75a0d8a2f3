"""Search spaces: what a hyper-parameter may take while tuning.

A method part declares its tunable hyper-parameters next to their defaults (``ClientPart(..., tunable={"mu":
LogFloat(1e-3, 1.0)})``), with the ranges its paper or official code tunes over;
:func:`fedskew.tuning.method_space.method_space` gathers a composition's space under the keys ``-m`` uses (``heal.tau``
where two parts share ``tau``). This module knows no method and sits below the registry and the method modules, which
import it (it lived in tuning/ before, and made them import upwards). Run-level settings (``lr``, ``momentum``,
``local_epochs``) are tuned only when asked for (``--space lr=log:0.001..0.1``): the papers share one learning rate
across methods and tune each method's own hyper-parameters.

Override strings (``--space KEY=SPEC``, a tune spec's ``space:``):

* ``0.1..0.9`` a float, uniform; ``log:1e-4..1`` a float, log-uniform;
* ``int:1..10`` an integer; ``intlog:1..256`` an integer, log-uniform;
* ``[0.01, 0.1, 1]`` one of these values (YAML list);
* ``none`` (or ``fixed``): not tuned, held at its default or its given value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import yaml

from fedskew.schema import ConfigError


@dataclass(frozen=True)
class Float:
    """A float in ``[low, high]``, uniform or (``log``) log-uniform."""

    low: float
    high: float
    log: bool = False

    def __post_init__(self) -> None:
        _check_bounds(self.low, self.high, self.log)

    def describe(self) -> str:
        return f"{'log:' if self.log else ''}{self.low:g}..{self.high:g}"


@dataclass(frozen=True)
class Int:
    """An integer in ``[low, high]``, uniform or (``log``) log-uniform."""

    low: int
    high: int
    log: bool = False

    def __post_init__(self) -> None:
        if not (isinstance(self.low, int) and isinstance(self.high, int)):
            raise ConfigError(f"an integer range needs integer bounds, got {self.low!r}..{self.high!r}")
        _check_bounds(self.low, self.high, self.log)

    def describe(self) -> str:
        return f"{'intlog' if self.log else 'int'}:{self.low}..{self.high}"


@dataclass(frozen=True)
class Choice:
    """One of ``values`` (numbers, strings or booleans)."""

    values: tuple[Any, ...]

    def __post_init__(self) -> None:
        if not self.values or len(set(map(repr, self.values))) != len(self.values):
            raise ConfigError(f"a choice needs distinct values, got {list(self.values)!r}")
        if not all(v is None or isinstance(v, bool | int | float | str) for v in self.values):
            raise ConfigError(f"choice values must be numbers, strings or booleans, got {list(self.values)!r}")

    def describe(self) -> str:
        return "[" + ", ".join(str(v) for v in self.values) + "]"


Dist = Float | Int | Choice


def LogFloat(low: float, high: float) -> Float:  # noqa: N802 - reads as a type in the parts' declarations
    return Float(low, high, log=True)


def _check_bounds(low: float, high: float, log: bool) -> None:
    if not (math.isfinite(low) and math.isfinite(high)) or low >= high:
        raise ConfigError(f"a range needs finite bounds low < high, got {low!r}..{high!r}")
    if log and low <= 0:
        raise ConfigError(f"a log range needs low > 0, got {low!r}..{high!r}")


def parse_dist(text: str) -> Dist | None:
    """An override string (module docstring) -> a distribution, or ``None`` for ``none``/``fixed``."""
    s = str(text).strip()
    if s.lower() in ("none", "fixed"):
        return None
    if s.startswith("["):
        try:
            values = yaml.safe_load(s)
        except yaml.YAMLError as exc:
            raise ConfigError(f"search space {text!r}: not a YAML list ({exc})") from None
        if not isinstance(values, list):
            raise ConfigError(f"search space {text!r}: expected a list of values")
        return Choice(tuple(values))
    kind, _, rng = s.rpartition(":")
    lo, sep, hi = rng.partition("..")
    if not sep:
        raise ConfigError(
            f"search space {text!r}: expected LOW..HIGH, log:LOW..HIGH, int:LOW..HIGH, intlog:LOW..HIGH, a list "
            "[a, b, ...] or none"
        )
    if kind not in ("", "log", "int", "intlog"):
        raise ConfigError(f"search space {text!r}: unknown kind {kind!r} (use log, int or intlog)")
    number = int if kind.startswith("int") else float
    try:
        low, high = number(lo), number(hi)
    except ValueError:
        raise ConfigError(f"search space {text!r}: bounds must be numbers") from None
    if kind.startswith("int"):
        return Int(int(low), int(high), log=kind == "intlog")
    return Float(low, high, log=kind == "log")


def as_dist(value: Any) -> Dist | None:
    """A space entry from a spec (a string as :func:`parse_dist`, a list of choices, or ``None``)."""
    if value is None or isinstance(value, Float | Int | Choice):
        return value
    if isinstance(value, list):
        return Choice(tuple(value))
    return parse_dist(str(value))


def suggest(trial: Any, name: str, dist: Dist) -> Any:
    """Draw ``name`` from ``dist`` with an Optuna trial."""
    if isinstance(dist, Float):
        return trial.suggest_float(name, dist.low, dist.high, log=dist.log)
    if isinstance(dist, Int):
        return trial.suggest_int(name, dist.low, dist.high, log=dist.log)
    return trial.suggest_categorical(name, list(dist.values))


# run-level settings a search may cover when asked (``--space lr=...``); everything else is the method's
RUN_LEVEL = ("lr", "momentum", "weight_decay", "local_epochs", "batch_size")
