"""FedExP (Jhunjhunwala, Wang, Joshi, "FedExP: Speeding up Federated Averaging via Extrapolation", ICLR 2023): an
adaptive server step size from the clients' update diversity, a server ``step`` plug-in.

With ``Δ_i = w_i − w_t`` the participants' updates (trainable parameters, flattened into one vector) and ``Δ̄`` the
combined update (the combine's weighted mean, so ``+disco`` weights carry over), the server moves
``w_{t+1} = w_t + η_g·Δ̄`` with ::

    η_g = max(1, Σ_i p_i‖Δ_i‖² / (2·(‖Δ̄‖² + ε')))

``p_i`` the combine's weights (the official code's data shares ``p_i``; the paper's ``1/M`` is ``-m weights=uniform``)
and ``ε' = M·ε`` (the official code's ``S·epsilon``; ``epsilon_scale=none`` is the paper's ``ε``). Default
``ε = 1e-3`` (the official code's CIFAR-10/100 and CINIC-10 value; 0.1 for EMNIST), tuned over ``log[1e-4, 1]``.
Buffers (BatchNorm statistics) take the combined value, as the official code steps ``parameters()`` only. The
extrapolated rate is the diagnostic ``fedexp_eta_g``.

Departures from the official code, named: it decays ``ε`` by ``0.998²`` per round together with its local learning
rate's decay of ``0.998`` (fedskew has no learning-rate schedule, so neither decays; ``epsilon_decay`` sets the
per-round factor), and it evaluates the mean of the last two global models (the extrapolation oscillates); fedskew
evaluates the global model itself, as for every other method. Composes with every client part
(``fedprox+fedexp``, ``scaffold+fedexp``: the paper's FedProx(ExP) and SCAFFOLD(ExP)) and with ``+disco``; not with
another server step (``fedavgm``, ``fedadam``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
from pydantic import Field
from torch import Tensor

from fedskew.protocol import Params, RoundInput, ServerContext
from fedskew.registry import ClientPart, ServerPlugin
from fedskew.schema import StrictSettings
from fedskew.server.api import Diagnostics, ServerStep
from fedskew.space import LogFloat


class FedExPParams(StrictSettings):
    epsilon: float = Field(1e-3, gt=0)  # keeps η_g bounded when the updates cancel (the code's epsilon_fedexp)
    epsilon_scale: Literal["participants", "none"] = "participants"  # the code's S·ε, or the paper's ε
    epsilon_decay: float = Field(1.0, gt=0, le=1)  # ε's factor per round (the official code: 0.998² with its lr decay)


FEDEXP = FedExPParams()  # the defaults


class FedExPState(NamedTuple):
    rounds: int = 0  # rounds stepped so far (for ε's decay)


@dataclass(frozen=True)
class FedExPStep(ServerStep):
    """``w_t + η_g·(w̄ − w_t)`` on the trainable parameters, ``η_g`` from the update diversity (module docstring)."""

    epsilon: float = FEDEXP.epsilon
    epsilon_scale: str = FEDEXP.epsilon_scale
    epsilon_decay: float = FEDEXP.epsilon_decay

    def init(self, ctx: ServerContext) -> FedExPState:
        return FedExPState()

    def eta(self, rin: RoundInput, params: Params, weights: Tensor, rounds: int) -> float:
        """The round's extrapolated step size ``η_g``."""
        # in the model's order, not the frozenset's (whose order changes with the process's hash seed): the float64
        # sums below must add in the same order in every run
        names = [n for n, t in params.items() if n in rin.trainable and t.is_floating_point()]
        k = rin.num_participants
        w = weights.to(torch.float64)
        w = w / w.sum()
        start = {n: rin.global_params[n].to(torch.float64) for n in names}
        norms = torch.zeros(k, dtype=torch.float64)
        mean_sq = 0.0
        for n in names:
            deltas = rin.params[n].to(torch.float64) - start[n]  # [K, ...]
            norms += deltas.reshape(k, -1).pow(2).sum(1).cpu()
            mean_sq += float((params[n].to(torch.float64) - start[n]).pow(2).sum())
        eps = self.epsilon * self.epsilon_decay ** (rounds + 1) * (k if self.epsilon_scale == "participants" else 1)
        return max(1.0, 0.5 * float((w.cpu() * norms).sum()) / (mean_sq + eps))

    def __call__(
        self, rin: RoundInput, params: Params, weights: Tensor, state: FedExPState
    ) -> tuple[Params, Diagnostics, FedExPState]:
        eta = self.eta(rin, params, weights, state.rounds)
        out = dict(params)
        for n in params:
            if n in rin.trainable and params[n].is_floating_point():
                w0 = rin.global_params[n].to(torch.float64)
                out[n] = (w0 + eta * (params[n].to(torch.float64) - w0)).to(params[n].dtype)
        return out, {"fedexp_eta_g": eta}, FedExPState(state.rounds + 1)


CLIENTS: dict[str, ClientPart] = {}
SERVER_PLUGINS: dict[str, ServerPlugin] = {
    "fedexp": ServerPlugin(
        "fedexp",
        "extrapolated server step: w + eta_g (w_avg - w), eta_g = max(1, mean|d_i|^2 / (2 (|d_avg|^2 + M eps))) "
        "(eps=1e-3)",
        "Jhunjhunwala, Wang, Joshi, FedExP: Speeding up Federated Averaging via Extrapolation, ICLR 2023",
        FedExPParams,
        ("step",),
        lambda p: {"step": FedExPStep(**p.model_dump())},
        tunable={"epsilon": LogFloat(1e-4, 1.0)},
    ),
}
