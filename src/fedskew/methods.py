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

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError

from fedskew.client.algorithms import FedProx, Moon, Scaffold
from fedskew.client.local import LocalAlgorithm, UploadExtras
from fedskew.client.personal import AmpClient, CriticalMasks, Ditto, FedRep
from fedskew.protocol import ClientReport, unique_reports
from fedskew.registry import (
    ALIASES,
    CLIENTS,
    EXTRA_PIECES,
    SERVER_PLUGINS,
    ClientPart,
    NoParams,
    ServerPlugin,
    keep_local,
    load_entry_points,
    register_builtin,
)
from fedskew.schema import ConfigError, StrictSettings, describe_errors
from fedskew.server.api import (
    NO_SERVER_HALF,
    Aggregation,
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
from fedskew.server.disco import DiscoParams, DiscoWeights
from fedskew.server.fedsa import FedSACombine, FedSAParams
from fedskew.server.halves import ScaffoldServer
from fedskew.server.heal import FaelWeights, HealMasks, HealParams
from fedskew.server.personal import FedAMP, FedCAC
from fedskew.server.weights import SampleWeights, UniformWeights
from fedskew.tuning.space import Float, Int, LogFloat


class ServerBaseParams(StrictSettings):
    """The default server step (FedAvg's): which client weights, when no plug-in sets its own. The default is the
    client part's (:attr:`ClientPart.weights`: ``uniform`` for SCAFFOLD and Ditto, as their papers average)."""

    weights: Literal["samples", "uniform"] = "samples"


class FedProxParams(StrictSettings):
    mu: float = Field(0.01, ge=0)


class MoonParams(StrictSettings):
    mu: float = Field(1.0, ge=0)
    tau: float = Field(0.5, gt=0)
    # width of MOON's projection head (paper and official code: 256); 0 contrasts the body's features (FedDisco)
    projection: int = Field(256, ge=0)


class FedRepParams(StrictSettings):
    head_epochs: int = Field(10, ge=1)


class DittoParams(StrictSettings):
    lam: float = Field(0.1, ge=0)
    personal_epochs: int | None = Field(None, ge=1)


class AmpClientParams(StrictSettings):
    mu: float = Field(1e-4, ge=0)


_CORE_CLIENTS: dict[str, ClientPart] = {
    "fedavg": ClientPart(
        "fedavg",
        "plain local SGD on cross-entropy; server averages with sample-share weights (weights=uniform: 1/K)",
        "McMahan et al., Communication-Efficient Learning of Deep Networks from Decentralized Data, AISTATS 2017",
        NoParams,
        lambda p: LocalAlgorithm(),
    ),
    "fedprox": ClientPart(
        "fedprox",
        "local loss + (mu/2)||w - w_global||^2 (mu=0.01)",
        "Li et al., Federated Optimization in Heterogeneous Networks, MLSys 2020",
        FedProxParams,
        lambda p: FedProx(mu=p.mu),
        # MOON and FedDisco's code tune mu over {0.001, 0.01, 0.1, 1}
        tunable={"mu": LogFloat(1e-3, 1.0)},
    ),
    "moon": ClientPart(
        "moon",
        "local loss + mu * model-contrastive loss on a projection head's output (mu=1, tau=0.5, projection=256)",
        "Li, He, Song, Model-Contrastive Federated Learning, CVPR 2021",
        MoonParams,
        lambda p: Moon(mu=p.mu, tau=p.tau, projection=p.projection),
        model_options=lambda p: {"projection": p.projection} if p.projection else {},
        # official MOON README: mu in {0.001, 0.01, 0.1, 1, 5, 10}; tau in {0.1, 0.5, 1}; FedDisco: mu 0.01 / 0.1
        tunable={"mu": LogFloat(1e-3, 10.0), "tau": Float(0.1, 1.0)},
    ),
    "scaffold": ClientPart(
        "scaffold",
        "control variates correct local steps (option II; control deltas averaged over all N; weights=uniform)",
        "Karimireddy et al., SCAFFOLD: Stochastic Controlled Averaging for Federated Learning, ICML 2020",
        NoParams,
        lambda p: Scaffold(),
        server_half=lambda p: ScaffoldServer(),
        weights="uniform",
    ),
    "fedrep": ClientPart(
        "fedrep",
        "local head trained first (head_epochs=10, body frozen), then the body; the head stays local (implies fedper)",
        "Collins et al., Exploiting Shared Representations for Personalized Federated Learning, ICML 2021",
        FedRepParams,
        lambda p: FedRep(head_epochs=p.head_epochs),
        implies=("fedper",),
        tunable={"head_epochs": Int(1, 10)},  # FedRep: 10 head epochs (its paper's default)
    ),
    "ditto": ClientPart(
        "ditto",
        "personal model trained with (lam/2)||v - w||^2 to the global model (lam=0.1), then the global model "
        "(weights=uniform)",
        "Li, Hu, Beirami, Smith, Ditto: Fair and Robust Federated Learning Through Personalization, ICML 2021",
        DittoParams,
        lambda p: Ditto(lam=p.lam, personal_epochs=p.personal_epochs),
        personalized=True,
        weights="uniform",
        tunable={"lam": LogFloat(1e-3, 2.0)},  # Ditto paper: lambda in {0.01, 0.1, 1, 2}; FedSA/FedPake 0.001
    ),
    "fedamp": ClientPart(
        "fedamp",
        "own model kept and trained with (mu/2)||w - u_i||^2 to its cloud model (mu=1e-4; implies amp)",
        "Huang et al., Personalized Cross-Silo Federated Learning on Non-IID Data, AAAI 2021",
        AmpClientParams,
        lambda p: AmpClient(mu=p.mu),
        implies=("amp",),
        personalized=True,
        tunable={"mu": LogFloat(1e-5, 1e-2)},
    ),
}


def _fedsa(p: FedSAParams) -> dict[str, Any]:
    pieces: dict[str, Any] = {"combine": FedSACombine(**p.model_dump())}
    if p.buffers == "local":
        pieces["local"] = frozenset({"buffers"})
    return pieces


def _heal(p: HealParams) -> dict[str, Any]:
    return {
        "masking": HealMasks(tau=p.tau, strict=p.strict),
        "weighting": FaelWeights(beta=p.beta, distance=p.distance, fael_init=p.fael_init, uniform_over=p.uniform_over),
    }


class CacParams(StrictSettings):
    tau: float = Field(0.5, ge=0, le=1)
    beta: float = Field(100.0, gt=0)


class AmpParams(StrictSettings):
    alpha_k: float = Field(1e4, gt=0)
    sigma: float = Field(100.0, gt=0)
    decay_rate: float = Field(0.1, gt=0, le=1)
    decay_every: int = Field(30, ge=1)


_CORE_PLUGINS: dict[str, ServerPlugin] = {
    "disco": ServerPlugin(
        "disco",
        "weights ReLU(n_k - a*d_k + b) from dataset size and label-distribution discrepancy (a=0.5, b=0.1, kl)",
        "Ye et al., FedDisco: Federated Learning with Discrepancy-Aware Collaboration, ICML 2023",
        DiscoParams,
        ("weighting",),
        lambda p: {"weighting": DiscoWeights(a=p.a, b=p.b, metric=p.metric, target=p.target, report=p.report)},
        tunable={"a": Float(0.1, 1.0), "b": Float(0.0, 0.2)},  # FedDisco Fig. 4 tunes a and b around 0.5 / 0.1
    ),
    "fedsa": ServerPlugin(
        "fedsa",
        "parameter-skew-aware aggregation: CV split, Micro/Macro-Class clustering (lam=delta=0.2, C=S=4)",
        "The Key of Parameter Skew in Federated Learning (FedSA, arXiv 2408.11278 v1; FedPake, v2)",
        FedSAParams,
        ("combine",),
        _fedsa,
        tunable={"lam": Float(0.1, 0.5), "C": Int(2, 8), "S": Int(2, 8)},  # FedPake Fig. 4: lam, C, S
    ),
    "heal": ServerPlugin(
        "heal",
        "FPHL update-consistency masks (tau=0.3) + FAEL momentum distance weights (beta=0.4)",
        "Chen et al., Fair Federated Learning under Domain Skew with Local Consistency and Domain Diversity, CVPR 2024",
        HealParams,
        ("masking", "weighting"),
        _heal,
        tunable={"tau": Float(0.1, 0.6), "beta": Float(0.1, 0.9)},  # FedHEAL Table 4 / Fig. 6
    ),
    "local": ServerPlugin(
        "local",
        "no collaboration: every state-dict entry stays on its client (the FedCAC paper's 'Separate')",
        "local training only (baseline in FedCAC, Wu et al., NeurIPS 2023)",
        NoParams,
        (),
        keep_local("all"),
    ),
    "fedper": ServerPlugin(
        "fedper",
        "the classifier head stays on each client; the body is averaged",
        "Arivazhagan et al., Federated Learning with Personalization Layers, arXiv 1912.00818",
        NoParams,
        (),
        keep_local("head"),
    ),
    "fedbn": ServerPlugin(
        "fedbn",
        "BatchNorm layers (affine and running statistics) stay on each client; the rest is averaged",
        "Li et al., FedBN: Federated Learning on Non-IID Features via Local Batch Normalization, ICLR 2021",
        NoParams,
        (),
        keep_local("norm"),
    ),
    "fedcac": ServerPlugin(
        "fedcac",
        "critical-parameter masks (tau=0.5) + time-varying collaborators (beta=100): one model per client",
        "Wu et al., Bold but Cautious: Unlocking the Potential of Personalized Federated Learning through "
        "Cautiously Aggressive Collaboration, NeurIPS 2023",
        CacParams,
        ("personalize",),
        lambda p: {
            "personalize": lambda w: FedCAC(weighting=w, beta=p.beta),
            "upload_extras": CriticalMasks(tau=p.tau),
        },
        tunable={"tau": Float(0.1, 0.9), "beta": LogFloat(10.0, 300.0)},  # FedCAC Figs. 5 and 6
    ),
    "amp": ServerPlugin(
        "amp",
        "FedAMP's attentive message passing: cloud model per client (alpha_k=1e4, sigma=100, decay 0.1/30 rounds)",
        "Huang et al., Personalized Cross-Silo Federated Learning on Non-IID Data, AAAI 2021",
        AmpParams,
        ("personalize",),
        lambda p: {"personalize": lambda w: FedAMP(weighting=w, **p.model_dump())},
    ),
}


def _register_builtins() -> None:
    from fedskew.catalog import CATALOGS

    register_builtin(_CORE_CLIENTS, _CORE_PLUGINS, {"fedpake": "fedsa", "separate": "local"})
    for module in CATALOGS:
        register_builtin(module.CLIENTS, module.SERVER_PLUGINS, getattr(module, "ALIASES", None))


_register_builtins()

__all__ = ["ALIASES", "CLIENTS", "SERVER_PLUGINS", "ClientPart", "NoParams", "ServerPlugin", "resolve_method"]

PERSONAL_GROUPS = frozenset({"head", "norm", "all"})  # local groups that make a method personalized


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
            known = ", ".join(sorted(set(CLIENTS) | set(SERVER_PLUGINS)))
            where = "server plug-in" if t in plugin_names and t in CLIENTS else "part"
            raise ConfigError(f"method {name!r}: unknown {where} {t!r} (known: {known})")
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
    parts = [("server", ServerBaseParams), (client.name, client.params)] + [(p.name, p.params) for p in plugins]
    parsed = _split_args(parts, args, name)
    built = _build_plugins(name, plugins, parsed[2:])
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
    return Method(
        "+".join([client_name, *plugin_names]) if tokens[0] in CLIENTS else "+".join(tokens),
        algo,
        server,
        _resolved_args(parts, parsed),
        server_half=half,
        personalized=client.personalized or "personalize" in built.roles or bool(built.local & PERSONAL_GROUPS),
        local=built.local,
        upload_extras=tuple(built.upload_extras),
        model_options=client.model_options(client_params),
        reports=reports,
    )


def describe_methods() -> list[tuple[str, str, str]]:
    """(name, kind, one-line summary) for ``fedskew methods`` (plug-in packages' parts included)."""
    load_entry_points()
    rows = [(c.name, "client", c.summary) for c in CLIENTS.values()]
    rows += [
        (p.name, f"server: {'/'.join(p.roles) or 'client-local state'}", p.summary) for p in SERVER_PLUGINS.values()
    ]
    rows += [(alias, "alias", f"= {target}") for alias, target in ALIASES.items()]
    return rows
