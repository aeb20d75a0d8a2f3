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

from pydantic import Field, field_validator

from fedskew.client.loss_before import with_loss_after, with_loss_before
from fedskew.client.prototypes import FedProc, FedProto
from fedskew.registry import ClientPart, ServerPlugin
from fedskew.schema import StrictSettings
from fedskew.server.fairness import AflWeights, FedFVCombine, QfflCombine
from fedskew.server.halves import PrototypeServer
from fedskew.tuning.space import Float, Int, LogFloat


class FedProtoParams(StrictSettings):
    lam: float = Field(1.0, ge=0)  # weight of the prototype distance (official code --ld; MarsFL uses 2)
    average: Literal["clients", "samples"] = "clients"  # per-class server average (reference: over clients)


class FedProcParams(StrictSettings):
    curriculum_rounds: int | None = Field(None, ge=1)  # T of alpha = 1 - (t-1)/(T-1); None: the run's rounds (MarsFL)
    temperature: float = Field(1.0, gt=0)  # of the cosine similarities (MarsFL: none, i.e. 1)
    average: Literal["clients", "samples"] = "clients"


class AflParams(StrictSettings):
    step: float = Field(0.01, ge=0)  # ascent step on lambda (MarsFL drfa_gamma, flgo learning_rate_lambda: 0.01)
    floor: float = Field(1e-3, ge=0, lt=1)  # MarsFL's floor on lambda after projection (0: none, as fair_flearn)
    restart: bool = False  # True: MarsFL's memoryless variant (lambda restarts at 1/K every round)
    # the loss the ascent reads: before training on the training data (fair_flearn, flgo), or after training on the
    # client's validation split (MarsFL, FedHEAL's framework, reads the test split there; needs validation > 0)
    loss: Literal["before", "after"] = "before"


class QfflParams(StrictSettings):
    q: float = Field(1.0, ge=0)  # fairness exponent (MarsFL and flgo default 1.0)
    # L of the step: "auto" (1-beta)^2/(lr*steps^2) per client (sound for several momentum steps; = 1/lr for one plain
    # SGD step), "lr" 1/lr per client (fair_flearn's, MarsFL's), or a given positive constant
    lipschitz: Literal["auto", "lr"] | float = "auto"

    @field_validator("lipschitz")
    @classmethod
    def _positive(cls, v: str | float) -> str | float:
        if not isinstance(v, str) and not v > 0:
            raise ValueError("a given Lipschitz constant must be positive (or 'auto', 'lr')")
        return v


class FedFVParams(StrictSettings):
    alpha: float = Field(0.1, ge=0, le=1)  # share of highest-loss clients kept unprojected (official code: 0.1)
    tau: int = Field(1, ge=1)  # rounds of update history projected against (official code: 1)


CLIENTS: dict[str, ClientPart] = {
    "fedproto": ClientPart(
        "fedproto",
        "CE + lam * MSE(feature, global class prototype) (lam=1); prototypes averaged per class; proto_acc view",
        "Tan et al., FedProto: Federated Prototype Learning across Heterogeneous Clients, AAAI 2022",
        FedProtoParams,
        lambda p: FedProto(lam=p.lam),
        server_half=lambda p: PrototypeServer(average=p.average),
        tunable={"lam": LogFloat(0.1, 10.0)},  # official code --ld 1, MarsFL 2
    ),
    "fedproc": ClientPart(
        "fedproc",
        "alpha * prototypical contrastive loss + (1 - alpha) * CE, alpha = 1 - (t-1)/(T-1) (T = the run's rounds)",
        "Mu et al., FedProc: Prototypical Contrastive Federated Learning on Non-IID Data, FGCS 2023 (arXiv 2109.12273)",
        FedProcParams,
        lambda p: FedProc(curriculum_rounds=p.curriculum_rounds, temperature=p.temperature),
        server_half=lambda p: PrototypeServer(average=p.average),
        tunable={"temperature": Float(0.1, 1.0)},
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
            "weighting": AflWeights(step=p.step, floor=p.floor, restart=p.restart, loss=f"loss_{p.loss}"),
            "wrap_client": with_loss_before if p.loss == "before" else with_loss_after,
        },
        tunable={"step": LogFloat(1e-3, 0.5)},  # fair_flearn / flgo: 0.01 (learning_rate_lambda)
    ),
    "qffl": ServerPlugin(
        "qffl",
        "q-FedAvg: updates weighted by loss^q, Lipschitz-based step (q=1, L=(1-momentum)^2/(lr*steps^2)); uniform "
        "over participants",
        "Li, Sanjabi, Beirami, Smith, Fair Resource Allocation in Federated Learning, ICLR 2020",
        QfflParams,
        ("combine",),
        lambda p: {"combine": QfflCombine(q=p.q, lipschitz=p.lipschitz), "wrap_client": with_loss_before},
        tunable={"q": LogFloat(1e-3, 15.0)},  # q-FFL paper's grid {0.001, 0.01, 0.1, 1, 2, 5, 10, 15}
    ),
    "fedfv": ServerPlugin(
        "fedfv",
        "conflicting updates projected away by increasing loss, then against recent history (alpha=0.1, tau=1)",
        "Wang et al., Federated Learning with Fair Averaging, IJCAI 2021",
        FedFVParams,
        ("combine",),
        lambda p: {"combine": FedFVCombine(alpha=p.alpha, tau=p.tau), "wrap_client": with_loss_before},
        tunable={"alpha": Float(0.0, 0.5), "tau": Int(1, 5)},  # FedFV paper: alpha and tau studied over these
    ),
}
