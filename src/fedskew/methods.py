"""The method registry: a method is a client-side local algorithm composed with server-side pieces.

Names compose with ``+``: ``<client>[+<server plug-in>...]``. The client part is one of :data:`CLIENTS`
(``fedavg`` is plain local SGD); each server plug-in fills one or more roles of the server step
(``weighting``, ``masking``, ``combine``; see :class:`fedskew.server.api.Aggregation`), and a role may be filled
only once. Examples: ``fedavg``, ``fedsa`` (= ``fedavg+fedsa``), ``fedavg+disco``.
Hyper-parameters come as one flat mapping (``method_args``); each key must belong to exactly one part.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fedskew.client.algorithms import FedProx, Moon, Scaffold
from fedskew.client.local import LocalAlgorithm
from fedskew.server.api import Aggregation, ServerStrategy
from fedskew.server.combine import WeightedMean
from fedskew.server.disco import DiscoWeights
from fedskew.server.fedsa import FedSACombine
from fedskew.server.heal import FaelWeights, HealMasks
from fedskew.server.weights import SampleWeights, UniformWeights


def _config_error(msg: str) -> Exception:
    from fedskew.config import ConfigError

    return ConfigError(msg)


class NoParams(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ServerBaseParams(BaseModel):
    """The default server step (FedAvg's): which client weights, when no plug-in sets its own."""

    model_config = ConfigDict(extra="forbid")
    weights: Literal["samples", "uniform"] = "samples"


class FedProxParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    mu: float = Field(0.01, ge=0)


class MoonParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    mu: float = Field(1.0, ge=0)
    tau: float = Field(0.5, gt=0)


@dataclass(frozen=True)
class ClientPart:
    name: str
    summary: str
    paper: str
    params: type[BaseModel]
    build: Callable[[Any], LocalAlgorithm]


@dataclass(frozen=True)
class ServerPlugin:
    name: str
    summary: str
    paper: str
    params: type[BaseModel]
    roles: tuple[str, ...]  # subset of ("weighting", "masking", "combine")
    build: Callable[[Any], dict[str, Any]]  # params -> {role: piece}; optional "local": state kept on clients


CLIENTS: dict[str, ClientPart] = {
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
    ),
    "moon": ClientPart(
        "moon",
        "local loss + mu * model-contrastive loss on features (mu=1, tau=0.5)",
        "Li, He, Song, Model-Contrastive Federated Learning, CVPR 2021",
        MoonParams,
        lambda p: Moon(mu=p.mu, tau=p.tau),
    ),
    "scaffold": ClientPart(
        "scaffold",
        "control variates correct local gradients (option II; server averages control deltas over all N)",
        "Karimireddy et al., SCAFFOLD: Stochastic Controlled Averaging for Federated Learning, ICML 2020",
        NoParams,
        lambda p: Scaffold(),
    ),
}


class DiscoParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    a: float = Field(0.5, ge=0)
    b: float = 0.1
    metric: Literal["kl", "l1", "l2", "cosine", "only_iid"] = "kl"
    target: tuple[float, ...] | None = None


class HealParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tau: float = 0.3
    beta: float = Field(0.4, ge=0, le=1)
    strict: bool = True
    distance: Literal["l2_per_tensor", "squared"] = "l2_per_tensor"
    fael_init: Literal["uniform", "datasize"] = "uniform"


class FedSAParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lam: float = Field(0.2, ge=0, le=1)
    delta: float = 0.2
    C: int = Field(4, ge=1)
    S: int = Field(4, ge=1)
    micro_norm: Literal["layer_minmax", "position_max", "raw"] = "layer_minmax"
    alpha_norm: Literal["per_position", "literal"] = "per_position"
    low_weighting: Literal["uniform", "samples"] = "uniform"
    buffers: Literal["mean", "local"] = "mean"
    cv_norm: Literal["minmax", "rank"] = "minmax"


def _fedsa(p: FedSAParams) -> dict[str, Any]:
    pieces: dict[str, Any] = {"combine": FedSACombine(**p.model_dump())}
    if p.buffers == "local":
        pieces["local"] = frozenset({"buffers"})
    return pieces


def _heal(p: HealParams) -> dict[str, Any]:
    return {
        "masking": HealMasks(tau=p.tau, strict=p.strict),
        "weighting": FaelWeights(beta=p.beta, distance=p.distance, fael_init=p.fael_init),
    }


ALIASES = {"fedpake": "fedsa"}

SERVER_PLUGINS: dict[str, ServerPlugin] = {
    "disco": ServerPlugin(
        "disco",
        "weights ReLU(n_k - a*d_k + b) from dataset size and label-distribution discrepancy (a=0.5, b=0.1, kl)",
        "Ye et al., FedDisco: Federated Learning with Discrepancy-Aware Collaboration, ICML 2023",
        DiscoParams,
        ("weighting",),
        lambda p: {"weighting": DiscoWeights(a=p.a, b=p.b, metric=p.metric, target=p.target)},
    ),
    "fedsa": ServerPlugin(
        "fedsa",
        "parameter-skew-aware aggregation: CV split, Micro/Macro-Class clustering (lam=delta=0.2, C=S=4)",
        "The Key of Parameter Skew in Federated Learning (FedSA, arXiv 2408.11278 v1; FedPake, v2)",
        FedSAParams,
        ("combine",),
        _fedsa,
    ),
    "heal": ServerPlugin(
        "heal",
        "FPHL update-consistency masks (tau=0.3) + FAEL momentum distance weights (beta=0.4)",
        "Chen et al., Fair Federated Learning under Domain Skew with Local Consistency and Domain Diversity, CVPR 2024",
        HealParams,
        ("masking", "weighting"),
        _heal,
    ),
}


@dataclass(frozen=True)
class Method:
    name: str
    client: LocalAlgorithm
    server: ServerStrategy
    args: dict[str, Any]  # the resolved hyper-parameters, defaults included
    personalized: bool = False
    local: frozenset[str] = frozenset()  # state-dict groups each client keeps for itself: "buffers", ...


def _split_args(parts: list[tuple[str, type[BaseModel]]], args: Mapping[str, Any], method: str) -> list[BaseModel]:
    owners: dict[str, str] = {}
    for name, model in parts:
        for field_name in model.model_fields:
            if field_name in owners:
                raise _config_error(
                    f"method {method!r}: hyper-parameter {field_name!r} is claimed by both "
                    f"{owners[field_name]!r} and {name!r}"
                )
            owners[field_name] = name
    unknown = sorted(set(args) - set(owners))
    if unknown:
        raise _config_error(
            f"method {method!r} has no hyper-parameter {', '.join(map(repr, unknown))}; "
            f"valid: {', '.join(sorted(owners)) or 'none'}"
        )
    out = []
    for name, model in parts:
        mine = {k: v for k, v in args.items() if owners.get(k) == name}
        try:
            out.append(model(**mine))
        except ValidationError as exc:
            detail = "; ".join(
                f"{'.'.join(map(str, e['loc']))}: {e['msg']} (got {e.get('input')!r})" for e in exc.errors()
            )
            raise _config_error(f"method {method!r}, part {name!r}: {detail}") from None
    return out


def resolve_method(name: str, args: Mapping[str, Any]) -> Method:
    """Parse a method name (with ``+`` compositions) and its hyper-parameters into runnable parts."""
    tokens = [ALIASES.get(t.strip().lower(), t.strip().lower()) for t in name.split("+")]
    if not all(tokens):
        raise _config_error(f"method {name!r}: empty part in composition")
    client_name = tokens[0] if tokens[0] in CLIENTS else "fedavg"
    plugin_names = tokens[1:] if tokens[0] in CLIENTS else tokens
    for t in plugin_names:
        if t not in SERVER_PLUGINS:
            known = ", ".join(sorted(set(CLIENTS) | set(SERVER_PLUGINS)))
            where = "server plug-in" if t in plugin_names and t in CLIENTS else "part"
            raise _config_error(f"method {name!r}: unknown {where} {t!r} (known: {known})")
    if len(set(plugin_names)) != len(plugin_names):
        raise _config_error(f"method {name!r}: a plug-in is repeated")
    client = CLIENTS[client_name]
    plugins = [SERVER_PLUGINS[t] for t in plugin_names]
    parts = [("server", ServerBaseParams), (client.name, client.params)] + [(p.name, p.params) for p in plugins]
    parsed = _split_args(parts, args, name)
    base_params, client_params, plugin_params = parsed[0], parsed[1], parsed[2:]

    roles: dict[str, Any] = {}
    local: frozenset[str] = frozenset()
    for plugin, params in zip(plugins, plugin_params, strict=True):
        pieces = plugin.build(params)
        local |= pieces.pop("local", frozenset())
        for role, piece in pieces.items():
            if role in roles:
                raise _config_error(f"method {name!r}: two plug-ins both set the server's {role}")
            roles[role] = piece
    combine = roles.get("combine")
    if isinstance(combine, FedSACombine):
        if "masking" in roles:
            raise _config_error(f"method {name!r}: FedSA's combine does not take element masks")
        if combine.low_weighting == "uniform" and ("weighting" in roles or "weights" in args):
            raise _config_error(
                f"method {name!r}: FedSA with low_weighting=uniform ignores client weights; "
                "add -m low_weighting=samples to use them in the low-dispersion mean"
            )
    if "weighting" in roles and "weights" in args:
        raise _config_error(f"method {name!r}: 'weights' has no effect because a plug-in sets the client weights")
    weighting = roles.get("weighting") or (UniformWeights() if base_params.weights == "uniform" else SampleWeights())
    server = Aggregation(
        weighting=weighting, combine=roles.get("combine", WeightedMean()), masking=roles.get("masking")
    )
    resolved = {k: v for p in parsed for k, v in p.model_dump().items()}
    return Method("+".join(tokens), client.build(client_params), server, resolved, local=local)


def describe_methods() -> list[tuple[str, str, str]]:
    """(name, kind, one-line summary) for ``fedskew methods``."""
    rows = [(c.name, "client", c.summary) for c in CLIENTS.values()]
    rows += [(p.name, f"server: {'/'.join(p.roles)}", p.summary) for p in SERVER_PLUGINS.values()]
    rows += [(alias, "alias", f"= {target}") for alias, target in ALIASES.items()]
    return rows
