"""The one base of every validated settings schema (run configuration, method hyper-parameters).

Settings come from YAML files and ``-m KEY=VALUE`` flags, where a typo is easy and a silent coercion is costly:
unknown keys are refused, infinities and NaNs are refused for every float, and a boolean is never read as a number
(pydantic alone would turn ``rounds: true`` into 1 and ``lr: .inf`` into a run that diverges).
"""

from __future__ import annotations

import difflib
import types
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator


def _admits_bool(annotation: Any) -> bool:
    """Whether a field's type accepts a bool as itself (``bool``, ``Any``, or a union/Literal holding one)."""
    if annotation is bool or annotation is Any:
        return True
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return any(isinstance(a, bool) for a in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return any(_admits_bool(a) for a in typing.get_args(annotation))
    return origin is not None and origin not in (tuple, list, dict, set, frozenset)


class ConfigError(ValueError):
    """A configuration value fedskew cannot run with; the message names the key and the value."""


class StrictSettings(BaseModel):
    """Unknown keys refused, floats finite, booleans only where a field is boolean."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _no_bool_as_number(cls, values: Any) -> Any:
        if isinstance(values, dict):
            for name, value in values.items():
                field = cls.model_fields.get(name)
                if isinstance(value, bool) and field is not None and not _admits_bool(field.annotation):
                    raise ValueError(f"{name}: expected a {_type_name(field.annotation)}, got the boolean {value!r}")
        return values


def _type_name(annotation: Any) -> str:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(annotation))
    if typing.get_origin(annotation) is typing.Literal:
        return " or ".join(repr(a) for a in typing.get_args(annotation))
    return getattr(annotation, "__name__", None) or str(annotation).replace("typing.", "")


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models a field's type holds (itself, or inside a list, dict, union or Optional)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def known_keys(model: type[BaseModel], path: tuple[int | str, ...]) -> list[str]:
    """The keys the model reached by ``path`` (an error's ``loc`` less its last part) takes: fields are followed
    into nested models, list indices are skipped, and a union arm's tag (a model's class name) keeps that model."""
    current = [model]
    for part in path:
        if isinstance(part, int):
            continue
        nxt: list[type[BaseModel]] = []
        for m in current:
            if part in m.model_fields:
                nxt += _models_in(m.model_fields[part].annotation)
            elif part == m.__name__:
                nxt.append(m)
        current = nxt
    return sorted({name for m in current for name in m.model_fields})


def describe_errors(exc: ValidationError, model: type[BaseModel] | None = None) -> list[str]:
    """One line per validation error: ``key: message (got value)``; errors of the whole model carry their own key.
    Given the ``model`` validated, an unknown key is named as one, with the nearest known keys as a suggestion."""
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden" and model is not None and err["loc"]:
            keys = known_keys(model, tuple(err["loc"][:-1]))
            near = difflib.get_close_matches(str(err["loc"][-1]), keys, n=3, cutoff=0.6)
            msg = "unknown key" + (f"; did you mean {' or '.join(near)}?" if near else "")
        value = err.get("input")
        shown = "" if isinstance(value, dict) or not loc else f" (got {value!r})"
        lines.append(f"{loc + ': ' if loc else ''}{msg}{shown}")
    return lines


class _StrictLoader(yaml.SafeLoader):
    """YAML's safe loader that refuses a key given twice in one mapping (YAML itself keeps the last silently)."""


def _no_duplicates(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)  # type: ignore[no-untyped-call]
        line = key_node.start_mark.line + 1
        if key in seen:
            raise ConfigError(f"line {line}: key {key!r} is given twice (first at line {seen[key]}); keep one")
        seen[key] = line
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _no_duplicates)


def read_yaml(path: Path) -> Any:
    """The YAML document in ``path``, read as UTF-8, with every mapping's keys distinct; a
    :class:`ConfigError` naming the file (and the line or byte) for anything else."""
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        bad = exc.object[exc.start : exc.start + 1]
        raise ConfigError(f"{path} is not UTF-8 text (byte {exc.start}: {bad!r}); save it as UTF-8") from None
    try:
        return yaml.load(text, Loader=_StrictLoader)  # a SafeLoader: plain data only
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {exc}") from None
