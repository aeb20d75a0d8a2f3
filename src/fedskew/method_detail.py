"""``fedskew methods NAME``: one method, plug-in or composition in detail, from the registry (the parts' own
declarations): each part's paper, summary, hyper-parameters with their defaults, bounds and tunable ranges, the client
reports it needs, and whether the composition can run under user-level DP and with batched clients (with the reason
when not)."""

from __future__ import annotations

import textwrap
import typing
from typing import Any

from pydantic import BaseModel


def _choices(annotation: Any) -> str:
    """``kl|l1|...`` for a Literal (inside an Optional too); empty otherwise."""
    for arg in (annotation, *typing.get_args(annotation)):
        if typing.get_origin(arg) is typing.Literal:
            return "|".join(str(a) for a in typing.get_args(arg))
    return ""


def _bounds(metadata: list[Any]) -> str:
    signs = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
    return ", ".join(f"{signs[k]} {getattr(m, k)}" for m in metadata for k in signs if hasattr(m, k))


def _range(dist: Any) -> str:
    """A tunable range as the docs write it: ``[0.1, 1]``, ``log[0.001, 1]``, ``{a, b}``."""
    if hasattr(dist, "values"):
        return "{" + ", ".join(map(str, dist.values)) + "}"
    return f"{'log' if dist.log else ''}[{dist.low:g}, {dist.high:g}]"


def hyper_parameters(params: type[BaseModel], tunable: Any) -> list[str]:
    """One line per hyper-parameter: ``name = default`` with its choices, bounds and tunable range."""
    lines = []
    for name, f in params.model_fields.items():
        notes = [x for x in (_choices(f.annotation), _bounds(f.metadata)) if x]
        if name in tunable:
            notes.append(f"tuned over {_range(tunable[name])}")
        lines.append(f"{name} = {f.default!r}" + (f" ({'; '.join(notes)})" if notes else ""))
    return lines


def describe(name: str, cols: int = 100) -> str:
    """The detail of ``name`` (a part, an alias or a composition), wrapped to ``cols`` columns; ``ValueError`` naming
    the choices for an unknown or refused name."""
    from fedskew.client.local import batched_form
    from fedskew.engine.captured import form_capture_refusal
    from fedskew.methods import ALIASES, CLIENTS, SERVER_PLUGINS, describe_methods, resolve_method
    from fedskew.privacy.server import refusal
    from fedskew.server.streaming import secure_refusal

    kinds = {row[0]: row[1] for row in describe_methods()}
    method = resolve_method(name, {})  # a ValueError names the choices or why the composition is refused

    def fill(text: str, indent: str = "") -> str:
        return textwrap.fill(text, cols, initial_indent=indent, subsequent_indent=indent + "  ")

    shown = name if method.name == name else f"{name} (= {method.name})"
    lines = [fill(f"{shown}: " + ("a composition" if "+" in method.name else "one part"))]
    for part_name in method.name.split("+"):
        part_name = ALIASES.get(part_name, part_name)
        part = CLIENTS.get(part_name) or SERVER_PLUGINS[part_name]
        lines.append(fill(f"{part_name} [{kinds[part_name]}]: {part.summary}", "  "))
        lines.append(fill(f"paper: {part.paper}", "    "))
        params = hyper_parameters(part.params, part.tunable)
        lines.append(fill("hyper-parameters (-m KEY=VALUE): " + ("; ".join(params) or "none"), "    "))
    sent = "; ".join(["its sample count", *(f"{r.name} ({r.learns})" for r in method.reports)])
    why = refusal(method)
    # a weighting that reads the clients' reports releases them through their own Gaussian mechanism under DP
    dp_note = " (docs/privacy.md)"
    if method.reports:
        dp_note = ", its reports released with --dp-report-noise" + dp_note
    form = batched_form(method.client)
    captured = "batched clients first" if isinstance(form, str) else form_capture_refusal(form)
    secure = secure_refusal(method)
    lines += [
        fill(f"what each client sends beside its model: {sent}"),
        fill("user-level DP (--dp-clip): " + (f"no: {why}" if why is not None else "can run" + dp_note)),
        fill("secure aggregation on Flower (flower.secagg): " + ("yes" if secure is None else f"no: {secure}")),
        fill("--batched-clients: " + ("yes" if not isinstance(form, str) else f"no: {form}")),
        fill(
            "--capture-steps (with --batched-clients): "
            + ("yes, on models with a stacked form" if captured is None else f"no: {captured}")
        ),
        fill("personalized models: " + ("yes, evaluated in the personal views" if method.personalized else "no")),
    ]
    return "\n".join(lines)
