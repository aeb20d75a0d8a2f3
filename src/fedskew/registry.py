"""The parts a method is composed of, and the one registry that holds them.

A method name is ``<client part>[+<server plug-in>...]`` (see :mod:`fedskew.methods`). Both kinds of part are plain
records: a :class:`ClientPart` builds a :class:`~fedskew.client.local.LocalAlgorithm` from its hyper-parameters, a
:class:`ServerPlugin` builds the pieces of the server step it fills (its *roles*). The built-in parts live in
:mod:`fedskew.methods` and the ``fedskew.catalog`` modules; user code adds its own with :func:`register` (or an
installed package through the ``fedskew.methods`` entry-point group), and they compose with the built-ins by name.

Every part is checked the same way when it is registered: a lower-case name not taken by another part, roles from
:data:`ROLES`, hyper-parameters declared as a :class:`~fedskew.schema.StrictSettings` model (unknown keys refused).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, Literal

from pydantic import BaseModel

from fedskew.client.local import LocalAlgorithm
from fedskew.schema import ConfigError, StrictSettings
from fedskew.server.api import ServerHalf
from fedskew.space import RUN_LEVEL, Dist

# the roles a server plug-in may fill (each at most once per method), see fedskew.server.api.Aggregation:
#   weighting  [K] client weights                      (Disco, FAEL, AFL, ...)
#   masking    per-element masks of who enters          (HEAL's FPHL)
#   combine    stacked uploads -> one model             (weighted mean, FedSA, FedNova, q-FFL, FedFV)
#   step       the server step after the combine       (server momentum, FedDyn's correction)
#   personalize one model per client                   (FedCAC, FedAMP)
ROLES = ("weighting", "masking", "combine", "step", "personalize")
# what else a plug-in's build may return: "local" (state-dict groups the clients keep), "upload_extras" (a client
# UploadExtras: tensors every client adds to its upload),
# "wrap_client" (LocalAlgorithm -> LocalAlgorithm: e.g. the loss before training AFL, q-FFL and FedFV read),
# "calibrate" (a server.api.Calibration: the post-hoc model the global views score, CCVR's)
EXTRA_PIECES = ("local", "upload_extras", "wrap_client", "calibrate")
ENTRY_POINT_GROUP = "fedskew.methods"

_NAME = re.compile(r"^[a-z][a-z0-9_]*$")

# the ClientPart.excludes entry of a client part that needs a global model: ``local`` keeps every entry on the clients
NO_GLOBAL_MODEL = (
    "local",
    "'local' keeps every entry on the clients (no collaboration), so there is no global model for this method to use",
)


class NoParams(StrictSettings):
    """A part without hyper-parameters."""


@dataclass(frozen=True)
class ClientPart:
    name: str
    summary: str
    paper: str
    params: type[BaseModel]
    build: Callable[[Any], LocalAlgorithm]
    # params -> what the server keeps, broadcasts and advances for this client part (SCAFFOLD's global control
    # variate: fedskew.server.api.ServerHalf); None: it has no server side
    server_half: Callable[[Any], ServerHalf] | None = None
    implies: tuple[str, ...] = ()  # server plug-ins this client part needs (added when not named)
    # (plug-in, reason) pairs this client part does not compose with: resolve_method refuses them with the reason
    excludes: tuple[tuple[str, str], ...] = ()
    personalized: bool = False  # keeps a personal model of its own (evaluated in the personal views)
    # the default of the server's ``weights`` for this client part (its paper's server average); -m weights=... wins
    weights: Literal["samples", "uniform"] = "samples"
    # params -> keyword arguments for models.build_model (MOON's projection head, FedCP's composite head)
    model_options: Callable[[Any], dict[str, Any]] = lambda p: {}
    # state-dict groups this client part keeps on the clients (engine.model_init.LOCAL_GROUPS; FedCP: "personal")
    local: frozenset[str] = frozenset()
    # hyper-parameter -> the range `fedskew tune` searches (fedskew.space; the paper's or official code's)
    tunable: Mapping[str, Dist] = field(default_factory=dict)


@dataclass(frozen=True)
class ServerPlugin:
    name: str
    summary: str
    paper: str
    params: type[BaseModel]
    roles: tuple[str, ...]  # subset of ROLES
    # params -> {role: piece}; "personalize" is a factory weighting -> strategy; optional "local" (groups kept on the
    # clients, see engine.model_init.LOCAL_GROUPS) and "upload_extras" (a client-side UploadExtras)
    build: Callable[[Any], dict[str, Any]]
    # hyper-parameter -> the range `fedskew tune` searches (fedskew.space; the paper's or official code's)
    tunable: Mapping[str, Dist] = field(default_factory=dict)
    # the client parts whose uploads this plug-in reads (FedPAC's statistics); empty: any client part
    clients: tuple[str, ...] = ()


def keep_local(*groups: str) -> Callable[[Any], dict[str, Any]]:
    """A plug-in build that keeps state-dict groups on the clients (FedPer's head, FedBN's norm layers)."""
    return lambda p: {"local": frozenset(groups)}


CLIENTS: dict[str, ClientPart] = {}
SERVER_PLUGINS: dict[str, ServerPlugin] = {}
ALIASES: dict[str, str] = {}
ORIGIN: dict[str, str] = {}  # part name -> where it was registered from ("fedskew", a module, an entry point)


def _check(part: ClientPart | ServerPlugin) -> None:
    kind = "client part" if isinstance(part, ClientPart) else "server plug-in"
    if not isinstance(part.name, str) or not _NAME.match(part.name):
        raise ConfigError(f"{kind} name {part.name!r} must be lower-case letters, digits and '_' (a letter first)")
    if part.name in CLIENTS or part.name in SERVER_PLUGINS or part.name in ALIASES:
        raise ConfigError(f"{kind} {part.name!r} clashes with a registered part ({ORIGIN.get(part.name, 'alias')})")
    if not (isinstance(part.params, type) and issubclass(part.params, StrictSettings)):
        raise ConfigError(
            f"{kind} {part.name!r}: params must be a fedskew.schema.StrictSettings subclass (unknown keys refused), "
            f"got {part.params!r}"
        )
    if not callable(part.build):
        raise ConfigError(f"{kind} {part.name!r}: build must be callable")
    clash = [k for k in part.params.model_fields if k in RUN_LEVEL]
    if clash:
        raise ConfigError(
            f"{kind} {part.name!r}: hyper-parameter(s) {clash} are named as the run's own settings "
            f"({', '.join(RUN_LEVEL)}), which the tuner and the sweep read as the run's; give them the part's name "
            "(e.g. head_lr)"
        )
    stray = [k for k in part.tunable if k not in part.params.model_fields]
    if stray:
        raise ConfigError(f"{kind} {part.name!r}: tunable {stray} are not among its hyper-parameters")
    if isinstance(part, ServerPlugin):
        bad = [r for r in part.roles if r not in ROLES]
        if bad or len(set(part.roles)) != len(part.roles):
            raise ConfigError(f"server plug-in {part.name!r}: roles {list(part.roles)} must be distinct, from {ROLES}")
        if "personalize" in part.roles and set(part.roles) & {"combine", "masking", "step"}:
            raise ConfigError(f"server plug-in {part.name!r}: 'personalize' replaces combine/masking/step")


def register(part: ClientPart | ServerPlugin, *, origin: str | None = None) -> ClientPart | ServerPlugin:
    """Add a part to the registry, so that method names can use it (``fedprox+myweights``). Returns the part.

    Refused with :class:`~fedskew.schema.ConfigError`: a name already taken, roles outside :data:`ROLES`, params that
    are not a :class:`~fedskew.schema.StrictSettings` model."""
    if not isinstance(part, ClientPart | ServerPlugin):
        raise ConfigError(f"register() takes a ClientPart or a ServerPlugin, got {type(part).__name__}")
    _check(part)
    (CLIENTS if isinstance(part, ClientPart) else SERVER_PLUGINS)[part.name] = part  # type: ignore[index]
    ORIGIN[part.name] = origin or "user code"
    return part


def unregister(name: str) -> None:
    """Remove a part registered from user code (built-in parts stay)."""
    if ORIGIN.get(name) == "fedskew":
        raise ConfigError(f"{name!r} is a built-in part and cannot be removed")
    CLIENTS.pop(name, None)
    SERVER_PLUGINS.pop(name, None)
    ORIGIN.pop(name, None)


def register_builtin(
    clients: dict[str, ClientPart] | None = None,
    plugins: dict[str, ServerPlugin] | None = None,
    aliases: dict[str, str] | None = None,
) -> None:
    for part in [*(clients or {}).values(), *(plugins or {}).values()]:
        register(part, origin="fedskew")
    for alias, target in (aliases or {}).items():
        ALIASES[alias] = target


_loaded_entry_points = False


def load_entry_points() -> list[str]:
    """Register the parts installed packages declare under the ``fedskew.methods`` entry-point group (once).

    An entry point names a :class:`ClientPart`, a :class:`ServerPlugin`, a list of them, or a callable returning
    either; each is checked like a built-in. Returns the names registered."""
    global _loaded_entry_points
    if _loaded_entry_points:
        return []
    _loaded_entry_points = True
    added: list[str] = []
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            obj = ep.load()
        except Exception as exc:  # a broken plug-in package must not break fedskew
            raise ConfigError(f"plug-in entry point {ep.name!r} ({ep.value}) failed to load: {exc}") from exc
        if callable(obj) and not isinstance(obj, ClientPart | ServerPlugin):
            obj = obj()
        parts = obj if isinstance(obj, list | tuple) else [obj]
        for part in parts:
            register(part, origin=f"entry point {ep.value}")
            added.append(part.name)
    return added
