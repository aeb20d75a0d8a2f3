"""The FedHEAL paper's comparisons (Chen et al., CVPR 2024, Tables 2-3): prototype hosts and fairness plug-ins.

* client parts ``fedproto`` and ``fedproc`` (:mod:`fedskew.client.prototypes`): local objectives with global class
  prototypes, whose per-class server average is the client part's own server side, so they compose with any model
  aggregation (``fedproto+heal``, ``fedproc+afl``);
* server plug-ins ``afl`` (weighting), ``qffl`` and ``fedfv`` (combines) (:mod:`fedskew.server.fairness`): they read
  each client's loss before training, which their build makes every client report (``wrap_client``:
  :func:`fedskew.client.loss_before.with_loss_before`), so they work on any client part (``fedprox+qffl``,
  ``moon+afl``, ``scaffold+afl``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fedskew.client.loss_before import with_loss_before
from fedskew.client.prototypes import FedProc, FedProto
from fedskew.registry import ClientPart, ServerPlugin
from fedskew.schema import StrictSettings
from fedskew.server.fairness import AflWeights, FedFVCombine, QfflCombine


class FedProtoParams(StrictSettings):
    lam: float = Field(1.0, ge=0)  # weight of the prototype distance (official code --ld; MarsFL uses 2)
    average: Literal["clients", "samples"] = "clients"  # per-class server average (reference: over clients)


class FedProcParams(StrictSettings):
    curriculum_rounds: int = Field(200, ge=1)  # T of alpha = 1 - (t-1)/(T-1): set it to --rounds (FedHEAL: 200)
    temperature: float = Field(1.0, gt=0)  # of the cosine similarities (MarsFL: none, i.e. 1)
    average: Literal["clients", "samples"] = "clients"


class AflParams(StrictSettings):
    step: float = Field(0.01, ge=0)  # ascent step on lambda (MarsFL drfa_gamma, flgo learning_rate_lambda: 0.01)
    floor: float = Field(1e-3, ge=0, lt=1)  # MarsFL's floor on lambda after projection (0: none, as fair_flearn)
    restart: bool = False  # True: MarsFL's memoryless variant (lambda restarts at 1/K every round)


class QfflParams(StrictSettings):
    q: float = Field(1.0, ge=0)  # fairness exponent (MarsFL and flgo default 1.0)
    lipschitz: float | None = Field(None, gt=0)  # L of the step; None: 1/lr of each client (reference)


class FedFVParams(StrictSettings):
    alpha: float = Field(0.1, ge=0, le=1)  # share of highest-loss clients kept unprojected (official code: 0.1)
    tau: int = Field(1, ge=1)  # rounds of update history projected against (official code: 1)


CLIENTS: dict[str, ClientPart] = {
    "fedproto": ClientPart(
        "fedproto",
        "CE + lam * MSE(feature, global class prototype) (lam=1); prototypes averaged per class; proto_acc view",
        "Tan et al., FedProto: Federated Prototype Learning across Heterogeneous Clients, AAAI 2022",
        FedProtoParams,
        lambda p: FedProto(lam=p.lam, average=p.average),
    ),
    "fedproc": ClientPart(
        "fedproc",
        "alpha * prototypical contrastive loss + (1 - alpha) * CE, alpha = 1 - (t-1)/(T-1) (T=curriculum_rounds=200)",
        "Mu et al., FedProc: Prototypical Contrastive Federated Learning on Non-IID Data, FGCS 2023 (arXiv 2109.12273)",
        FedProcParams,
        lambda p: FedProc(curriculum_rounds=p.curriculum_rounds, temperature=p.temperature, average=p.average),
    ),
}

SERVER_PLUGINS: dict[str, ServerPlugin] = {
    "afl": ServerPlugin(
        "afl",
        "agnostic FL: mixture weights lambda on the simplex, projected ascent on the losses before training "
        "(step=0.01)",
        "Mohri, Sivek, Suresh, Agnostic Federated Learning, ICML 2019",
        AflParams,
        ("weighting",),
        lambda p: {
            "weighting": AflWeights(step=p.step, floor=p.floor, restart=p.restart),
            "wrap_client": with_loss_before,
        },
    ),
    "qffl": ServerPlugin(
        "qffl",
        "q-FedAvg: updates weighted by loss^q, Lipschitz-based step (q=1, L=1/lr); uniform over participants",
        "Li, Sanjabi, Beirami, Smith, Fair Resource Allocation in Federated Learning, ICLR 2020",
        QfflParams,
        ("combine",),
        lambda p: {"combine": QfflCombine(q=p.q, lipschitz=p.lipschitz), "wrap_client": with_loss_before},
    ),
    "fedfv": ServerPlugin(
        "fedfv",
        "conflicting updates projected away by increasing loss, then against recent history (alpha=0.1, tau=1)",
        "Wang et al., Federated Learning with Fair Averaging, IJCAI 2021",
        FedFVParams,
        ("combine",),
        lambda p: {"combine": FedFVCombine(alpha=p.alpha, tau=p.tau), "wrap_client": with_loss_before},
    ),
}
