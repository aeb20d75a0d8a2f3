"""The method registry: a method is a client-side local algorithm composed with server-side pieces.

Names compose with ``+``: ``<client>[+<server plug-in>...]``. The client part is one of :data:`CLIENTS`
(``fedavg`` is plain local SGD); each server plug-in fills one or more roles of the server side
(``weighting``, ``masking``, ``combine``, ``step``; see :class:`fedskew.server.api.Aggregation`; or
``personalize``: a server strategy that returns one model per client, FedCAC and FedAMP), and a role may be filled
only once. Plug-ins may also name state-dict groups the clients keep for themselves (``local``: FedPer's head,
FedBN's norm layers, Local's everything) and tensors the clients add to their uploads (FedCAC's masks). A client part
may imply plug-ins (``fedrep`` keeps the head local, ``fedamp`` needs the ``amp`` server). Examples: ``fedavg``,
``fedsa`` (= ``fedavg+fedsa``), ``fedavg+disco``, ``fedcac``, ``fedprox+fedbn``.
Hyper-parameters come as one flat mapping (``method_args``); each key must belong to exactly one part.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ValidationError

from fedskew.client.local import LocalAlgorithm, UploadExtras
from fedskew.protocol import ClientReport, unique_reports
from fedskew.registry import (
    ALIASES,
    CLIENTS,
    EXTRA_PIECES,
    SERVER_PLUGINS,
    ClientPart,
    NoParams,
    ServerPlugin,
    load_entry_points,
    register_builtin,
)
from fedskew.schema import ConfigError, StrictSettings, describe_errors
from fedskew.server.api import (
    NO_SERVER_HALF,
    Aggregation,
    Calibration,
    Combine,
    Composition,
    Masking,
    Piece,
    ServerHalf,
    ServerStep,
    ServerStrategy,
    Weighting,
)
from fedskew.server.combine import WeightedMean
from fedskew.server.weights import SampleWeights, UniformWeights


class ServerBaseParams(StrictSettings):
    """The default server step (FedAvg's): which client weights, when no plug-in sets its own. The default is the
    client part's (:attr:`ClientPart.weights`: ``uniform`` for SCAFFOLD and Ditto, as their papers average)."""

    weights: Literal["samples", "uniform"] = "samples"


def _register_builtins() -> None:
    """Register the built-in parts (one module each, :mod:`fedskew.catalog`): every module's client parts in the
    catalog's order, then every module's server plug-ins and aliases (so ``fedskew methods`` lists them so)."""
    from fedskew.catalog import CATALOGS

    for module in CATALOGS:
        register_builtin(module.CLIENTS)
    for module in CATALOGS:
        register_builtin(None, module.SERVER_PLUGINS, getattr(module, "ALIASES", None))


_register_builtins()

__all__ = ["ALIASES", "CLIENTS", "SERVER_PLUGINS", "ClientPart", "NoParams", "ServerPlugin", "resolve_method"]

PERSONAL_GROUPS = frozenset({"head", "norm", "all", "personal"})  # local groups that make a method personalized


@dataclass(frozen=True)
class Method:
    name: str
    client: LocalAlgorithm
    server: ServerStrategy
    args: dict[str, Any]  # the resolved hyper-parameters, defaults included
    # what the server keeps for the client part (SCAFFOLD's c); advanced with each round's uploads before ``server``
    server_half: ServerHalf = NO_SERVER_HALF
    personalized: bool = False
    local: frozenset[str] = frozenset()  # state-dict groups each client keeps for itself: "buffers", ...
    upload_extras: tuple[UploadExtras, ...] = ()  # extra tensors every client computes and uploads (FedCAC's masks)
    # the post-hoc model the global views score instead of the global one (CCVR's calibrated classifier)
    calibration: Calibration | None = None
    # keyword arguments the engine passes to models.build_model (MOON: {"projection": 256})
    model_options: Mapping[str, Any] = field(default_factory=dict)
    # what every client computes from its training labels and sends once, before round 1, because a part declared
    # it (protocol.ClientReport: FedDisco's discrepancy, FedGen's label histogram); nothing else about its data
    reports: tuple[ClientReport, ...] = ()


def _split_args(parts: list[tuple[str, type[BaseModel]]], args: Mapping[str, Any], method: str) -> list[BaseModel]:
    """Hand each hyper-parameter to the part that owns it. A key two parts both have (MOON's and HEAL's ``tau``) is
    qualified with the part's name (``heal.tau``); used bare it is refused as ambiguous."""
    owners: dict[str, list[str]] = {}
    for name, model in parts:
        for field_name in model.model_fields:
            owners.setdefault(field_name, []).append(name)
    mine: dict[str, dict[str, Any]] = {name: {} for name, _ in parts}
    for key, value in args.items():
        part, _, field_name = key.rpartition(".")
        if part:
            if part not in mine or part not in owners.get(field_name, []):
                raise ConfigError(f"method {method!r} has no hyper-parameter {key!r} (part {part!r})")
        elif key not in owners:
            valid = sorted(k if len(o) == 1 else f"{o[0]}.{k}" for k, o in owners.items())
            raise ConfigError(f"method {method!r} has no hyper-parameter {key!r}; valid: {', '.join(valid) or 'none'}")
        elif len(owners[key]) > 1:
            qualified = " or ".join(f"{o}.{key}" for o in owners[key])
            raise ConfigError(f"method {method!r}: hyper-parameter {key!r} is ambiguous here; use {qualified}")
        else:
            part, field_name = owners[key][0], key
        mine[part][field_name] = value
    out = []
    for name, model in parts:
        try:
            out.append(model(**mine[name]))
        except ValidationError as exc:
            detail = "; ".join(describe_errors(exc))
            raise ConfigError(f"method {method!r}, part {name!r}: {detail}") from None
    return out


def _given(args: Mapping[str, Any], field_name: str) -> bool:
    return any(k.rpartition(".")[2] == field_name for k in args)


def _parse_name(name: str) -> tuple[list[str], str, list[str]]:
    """``(tokens, client part, plug-ins)`` of a composition name (aliases resolved, implied plug-ins added)."""
    load_entry_points()
    tokens = [ALIASES.get(t.strip().lower(), t.strip().lower()) for t in name.split("+")]
    if not all(tokens):
        raise ConfigError(f"method {name!r}: empty part in composition")
    client_name = tokens[0] if tokens[0] in CLIENTS else "fedavg"
    plugin_names = tokens[1:] if tokens[0] in CLIENTS else tokens
    plugin_names += [t for t in CLIENTS[client_name].implies if t not in plugin_names]
    for t in plugin_names:
        if t not in SERVER_PLUGINS:
            plugins = ", ".join(sorted(SERVER_PLUGINS))
            if t in CLIENTS:
                reordered = "+".join([t, *(x for x in tokens if x != t)])
                hint = f" (did you mean {reordered!r}?)" if sum(x in CLIENTS for x in tokens) == 1 else ""
                raise ConfigError(
                    f"method {name!r}: {t!r} is a client part, and a composition takes one client part, first "
                    f"(CLIENT+PLUGIN+...){hint}; what may follow it are server plug-ins: {plugins}"
                )
            near = difflib.get_close_matches(t, [*CLIENTS, *SERVER_PLUGINS], n=3)
            hint = f"; did you mean {' or '.join(near)}?" if near else ""
            raise ConfigError(
                f"method {name!r}: unknown part {t!r}{hint} (client parts: {', '.join(sorted(CLIENTS))}; "
                f"server plug-ins: {plugins})"
            )
    if len(set(plugin_names)) != len(plugin_names):
        raise ConfigError(f"method {name!r}: a plug-in is repeated")
    return tokens, client_name, plugin_names


@dataclass(frozen=True)
class PartInfo:
    """A part of a composition as hyper-parameters see it: its name, its settings model, its tunable ranges."""

    name: str
    params: type[BaseModel]
    tunable: Mapping[str, Any]


def method_parts(name: str) -> list[PartInfo]:
    """The parts of a composition in the order ``-m`` keys are resolved: the server's base average, the client part,
    then the plug-ins (implied ones included)."""
    _, client_name, plugin_names = _parse_name(name)
    client = CLIENTS[client_name]
    plugins = [SERVER_PLUGINS[t] for t in plugin_names]
    return [
        PartInfo("server", ServerBaseParams, {}),
        *(PartInfo(p.name, p.params, p.tunable) for p in (client, *plugins)),
    ]


@dataclass
class _Built:
    """What a composition's server plug-ins built: the pieces by role, and their client-side additions."""

    roles: dict[str, Any] = field(default_factory=dict)
    local: frozenset[str] = frozenset()  # state-dict groups each client keeps
    upload_extras: list[UploadExtras] = field(default_factory=list)
    wrappers: list[Callable[[LocalAlgorithm], LocalAlgorithm]] = field(default_factory=list)
    calibration: Calibration | None = None


# the base class a piece of each role derives from (personalize: a factory weighting -> ServerStrategy)
ROLE_BASES: dict[str, type[Piece]] = {
    "weighting": Weighting,
    "masking": Masking,
    "combine": Combine,
    "step": ServerStep,
}


def _build_plugins(method: str, plugins: list[ServerPlugin], params: list[BaseModel]) -> _Built:
    """Each plug-in's pieces, checked against the roles it declares; a role filled twice is refused."""
    built = _Built()
    for plugin, p in zip(plugins, params, strict=True):
        pieces = dict(plugin.build(p))
        roles = set(pieces) - set(EXTRA_PIECES)
        if roles != set(plugin.roles):
            raise ConfigError(
                f"method {method!r}: plug-in {plugin.name!r} declares roles {sorted(plugin.roles)} but its build "
                f"returned {sorted(pieces)} (extras allowed: {', '.join(EXTRA_PIECES)})"
            )
        built.local |= pieces.pop("local", frozenset())
        if "upload_extras" in pieces:
            built.upload_extras.append(pieces.pop("upload_extras"))
        if "calibrate" in pieces:
            if built.calibration is not None:
                raise ConfigError(f"method {method!r}: two plug-ins both calibrate the evaluated model")
            built.calibration = pieces.pop("calibrate")
            if not isinstance(built.calibration, Calibration):
                raise ConfigError(f"method {method!r}: plug-in {plugin.name!r}'s calibrate is not a Calibration")
        if "wrap_client" in pieces:  # e.g. AFL/q-FFL/FedFV: every client reports its loss before training
            built.wrappers.append(pieces.pop("wrap_client"))
        for role, piece in pieces.items():
            base = ROLE_BASES.get(role)
            if base is not None and not isinstance(piece, base):
                raise ConfigError(
                    f"method {method!r}: plug-in {plugin.name!r}'s {role} is a {type(piece).__name__}, not a "
                    f"{base.__module__}.{base.__name__} (derive it from that class)"
                )
            if role in built.roles:
                raise ConfigError(f"method {method!r}: two plug-ins both set the server's {role}")
            built.roles[role] = piece
    return built


def _base_weights(client: ClientPart, roles: Mapping[str, Any]) -> str:
    """The server's average when ``-m weights=`` is not given: the combine's paper's (q-FFL, FedFV: uniform) when
    no plug-in weights the clients, else the client part's paper's (SCAFFOLD, Ditto: uniform; FedAvg: samples)."""
    combine = roles.get("combine")
    if "weighting" not in roles and combine is not None and combine.default_weights:
        return str(combine.default_weights)
    return client.weights


def _server(method: str, roles: Mapping[str, Any], weighting: Weighting) -> ServerStrategy:
    if "personalize" in roles:
        clash = [r for r in ("combine", "masking", "step") if r in roles]
        if clash:
            raise ConfigError(
                f"method {method!r}: a personalized server strategy (one model per client) takes no {clash[0]} piece"
            )
        return roles["personalize"](weighting)  # type: ignore[no-any-return]
    return Aggregation(
        weighting=weighting,
        combine=roles.get("combine", WeightedMean()),
        masking=roles.get("masking"),
        step=roles.get("step"),
    )


def _resolved_args(parts: list[tuple[str, type[BaseModel]]], parsed: list[BaseModel]) -> dict[str, Any]:
    """Every part's hyper-parameters, defaults included; a name two parts share is qualified (``heal.tau``)."""
    counts: dict[str, int] = {}
    for p in parsed:
        for k in type(p).model_fields:
            counts[k] = counts.get(k, 0) + 1
    return {
        (k if counts[k] == 1 else f"{part}.{k}"): v
        for (part, _), p in zip(parts, parsed, strict=True)
        for k, v in p.model_dump().items()
    }


def resolve_method(name: str, args: Mapping[str, Any]) -> Method:
    """Parse a method name (with ``+`` compositions) and its hyper-parameters into runnable parts: the client part
    (wrapped by what the plug-ins add on the client side) and the server strategy the plug-ins' pieces make."""
    tokens, client_name, plugin_names = _parse_name(name)
    client = CLIENTS[client_name]
    for plugin_name, reason in client.excludes:
        if plugin_name in plugin_names:
            raise ConfigError(f"method {name!r}: {client_name} does not compose with {plugin_name}: {reason}")
    plugins = [SERVER_PLUGINS[t] for t in plugin_names]
    for plugin in plugins:
        if plugin.clients and client_name not in plugin.clients:
            raise ConfigError(
                f"method {name!r}: {plugin.name} reads what the {' or '.join(plugin.clients)} client part uploads, "
                f"not {client_name}'s"
            )
    parts = [("server", ServerBaseParams), (client.name, client.params)] + [(p.name, p.params) for p in plugins]
    parsed = _split_args(parts, args, name)
    built = _build_plugins(name, plugins, parsed[2:])
    built.local |= client.local
    weights_given = _given(args, "weights")
    if "weighting" in built.roles and weights_given:
        raise ConfigError(f"method {name!r}: 'weights' has no effect because a plug-in sets the client weights")
    comp = Composition(name, client_name, frozenset(built.roles), weights_given)
    for role, piece in built.roles.items():  # a piece may refuse the composition it is in (FedNova: no masks)
        if role in ROLE_BASES:
            piece.check_composition(comp)
    if not weights_given:
        parsed[0] = ServerBaseParams(weights=_base_weights(client, built.roles))
    base_params, client_params = parsed[0], parsed[1]
    weighting = built.roles.get("weighting") or (
        UniformWeights() if base_params.weights == "uniform" else SampleWeights()  # type: ignore[attr-defined]
    )
    server = _server(name, built.roles, weighting)
    algo = client.build(client_params)
    half = client.server_half(client_params) if client.server_half is not None else NO_SERVER_HALF
    pieces = (algo, half, weighting, *(p for r, p in built.roles.items() if r in ROLE_BASES))
    reports = unique_reports(r for piece in pieces for r in piece.reports)
    for wrap in built.wrappers:
        algo = wrap(algo)
    personalized = client.personalized or "personalize" in built.roles or bool(built.local & PERSONAL_GROUPS)
    if built.calibration is not None and (personalized or built.local):
        raise ConfigError(
            f"method {name!r}: a calibration of the global model (ccvr) needs one global model that every client "
            "evaluates whole; this method keeps models or layers on the clients"
        )
    return Method(
        "+".join([client_name, *plugin_names]) if tokens[0] in CLIENTS else "+".join(tokens),
        algo,
        server,
        _resolved_args(parts, parsed),
        server_half=half,
        personalized=personalized,
        local=built.local,
        upload_extras=tuple(built.upload_extras),
        calibration=built.calibration,
        model_options=client.model_options(client_params),
        reports=reports,
    )


# what a plug-in without a server role adds, by the extra its build returns
EXTRA_KINDS = {
    "local": "client-local state",
    "upload_extras": "client uploads",
    "wrap_client": "client term",
    "calibrate": "post-hoc calibration",
}


def _plugin_kind(plugin: ServerPlugin) -> str:
    """``fedskew methods``' kind column: the server roles a plug-in fills, else what its build adds (a build that
    needs arguments its defaults lack is described by its roles alone)."""
    if plugin.roles:
        return f"server: {'/'.join(plugin.roles)}"
    try:
        extras = set(plugin.build(plugin.params()))
    except Exception:  # a plug-in package's part with required arguments: nothing to say beyond its summary
        return "plug-in"
    return "plug-in: " + ("/".join(EXTRA_KINDS[e] for e in EXTRA_PIECES if e in extras) or "nothing")


def describe_methods() -> list[tuple[str, str, str]]:
    """(name, kind, one-line summary) for ``fedskew methods`` (plug-in packages' parts included)."""
    load_entry_points()
    rows = [(c.name, "client", c.summary) for c in CLIENTS.values()]
    rows += [(p.name, _plugin_kind(p), p.summary) for p in SERVER_PLUGINS.values()]
    rows += [(alias, "alias", f"= {target}") for alias, target in ALIASES.items()]
    return rows
