"""The FedDisco paper's hosts beyond the core set: FedDyn and FedDC (client parts, with the implied ``cloud`` server
model), FedNova and FedAvgM (server plug-ins). Each composes with ``+disco`` the way FedDisco's code does it (spec
§2.3): Disco's weights replace the weights of the server average, and the host's own state is untouched.

* ``feddyn``, ``feddc``: client parts; both imply ``cloud`` and average uniformly (as both official codes), so
  ``feddyn+disco`` = FedDyn with ``w̄ = Σ p_k w_k`` in the cloud model;
* ``fedavgm``: the server momentum after the combine (``fedavgm`` alone = ``fedavg+fedavgm``; ``fedprox+fedavgm``);
* ``fednova``: the normalized combine (``fednova+disco``, ``scaffold+fednova``).

See :mod:`fedskew.client.drift` and :mod:`fedskew.server.optimizers` for the formulas.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fedskew import registry
from fedskew.client.drift import FedDC, FedDyn
from fedskew.registry import ClientPart, NoParams, ServerPlugin
from fedskew.schema import StrictSettings
from fedskew.server.halves import FedDCServer, FedDynServer
from fedskew.server.optimizers import CloudCorrection, NovaCombine, fedavgm
from fedskew.tuning.space import Float, LogFloat


class FedDynParams(StrictSettings):
    alpha: float = Field(0.01, ge=0)  # FedDisco's code (alpha_coef = 1e-2); Acar et al. tune {0.1, 0.01, 0.001}
    size_scaling: bool = True  # alpha_k = alpha / (n_k / mean n): both official codes
    clip: float = Field(10.0, ge=0)  # gradient-norm clip of both official codes; 0: none


class FedDCParams(StrictSettings):
    alpha: float = Field(0.01, ge=0)  # FedDisco's code (alpha_coef = 1e-2); FedDC's code 0.1 / 0.01
    size_scaling: bool = True
    clip: float = Field(10.0, ge=0)
    correction: bool = True  # paper and FedDC's code; False: FedDisco's code (correction computed, never applied)


class FedAvgMParams(StrictSettings):
    # Hsu et al.'s server momentum (FedDisco tunes it, values stripped; its code's default 0 turns it off)
    server_momentum: float = Field(0.9, ge=0, lt=1)
    server_lr: float = Field(1.0, gt=0)
    form: Literal["ema", "hsu"] = "ema"  # ema: FedDisco's code; hsu: v <- m v + delta (Hsu et al.)


class FedNovaParams(StrictSettings):
    # the clients' SGD momentum the normalizer assumes (0: a_k = tau_k, FedDisco's code and FedNova for plain SGD)
    local_momentum: float = Field(0.0, ge=0, lt=1)


def _cloud_clients() -> tuple[str, ...]:
    """The registered client parts whose server model is the cloud model (those that imply it)."""
    return tuple(name for name, part in registry.CLIENTS.items() if "cloud" in part.implies)


def _excludes(host: str) -> tuple[tuple[str, str], ...]:
    return (
        ("local", "every entry stays on the clients, so there is no global model to regularize towards"),
        (
            "fedavgm",
            f"{host}'s server step is its cloud model (average + correction); momentum on top of it is "
            "defined by neither paper",
        ),
    )


CLIENTS: dict[str, ClientPart] = {
    "feddyn": ClientPart(
        "feddyn",
        "dynamic regularizer -<g_k, w> + (alpha_k/2)||w - w_global||^2 with per-client g_k (alpha=0.01, clip=10); "
        "server: uniform mean + mean accumulated update (implies cloud)",
        "Acar et al., Federated Learning Based on Dynamic Regularization, ICLR 2021",
        FedDynParams,
        lambda p: FedDyn(alpha=p.alpha, size_scaling=p.size_scaling, clip=p.clip),
        server_half=lambda p: FedDynServer(),
        implies=("cloud",),
        excludes=_excludes("FedDyn"),
        tunable={"alpha": LogFloat(1e-3, 0.1)},  # Acar et al. tune {0.1, 0.01, 0.001}
        weights="uniform",
    ),
    "feddc": ClientPart(
        "feddc",
        "local drift h_i: (alpha_i/2)||w - (w_global - h_i)||^2 + gradient correction c - c_i (alpha=0.01, clip=10); "
        "server: uniform mean + mean drift (implies cloud)",
        "Gao et al., FedDC: Federated Learning with Non-IID Data via Local Drift Decoupling and Correction, CVPR 2022",
        FedDCParams,
        lambda p: FedDC(alpha=p.alpha, size_scaling=p.size_scaling, clip=p.clip, correction=p.correction),
        server_half=lambda p: FedDCServer(correction=p.correction, size_scaling=p.size_scaling),
        implies=("cloud",),
        excludes=_excludes("FedDC"),
        tunable={"alpha": LogFloat(1e-3, 0.1)},  # FedDC's code 0.1 / 0.01, FedDisco's 0.01
        weights="uniform",
    ),
}

SERVER_PLUGINS: dict[str, ServerPlugin] = {
    "fedavgm": ServerPlugin(
        "fedavgm",
        "server momentum on the averaged update: v <- m v + (1-m)(w - w_avg), w <- w - lr v (m=0.9, ema form; "
        "form=hsu: v <- m v + (w - w_avg))",
        "Hsu, Qi, Brown, Measuring the Effects of Non-Identical Data Distribution for Federated Visual "
        "Classification, arXiv 1909.06335, 2019",
        FedAvgMParams,
        ("step",),
        lambda p: {"step": fedavgm(momentum=p.server_momentum, server_lr=p.server_lr, form=p.form)},
        tunable={"server_momentum": Float(0.0, 0.97)},  # Hsu et al. sweep beta up to 0.97; FedDisco tunes m
    ),
    "fednova": ServerPlugin(
        "fednova",
        "normalized averaging: w + sum_k (p_k tau_eff / tau_k)(w_k - w), tau_k = local steps, tau_eff = sum p_k tau_k",
        "Wang et al., Tackling the Objective Inconsistency Problem in Heterogeneous Federated Optimization, "
        "NeurIPS 2020",
        FedNovaParams,
        ("combine",),
        lambda p: {"combine": NovaCombine(local_momentum=p.local_momentum)},
    ),
    "cloud": ServerPlugin(
        "cloud",
        "FedDyn's/FedDC's server model: average + (1/N) sum of all clients' accumulated updates (implied by them)",
        "Acar et al., ICLR 2021 (Algorithm 1); Gao et al., CVPR 2022 (official code)",
        NoParams,
        ("step",),
        lambda p: {"step": CloudCorrection(clients=_cloud_clients())},
    ),
}
