"""FedNova (Wang, Liu, Liang, Joshi, Poor, NeurIPS 2020): normalized averaging, a server ``combine`` plug-in.

Each client's update is divided by its normalizer ``a_k`` (its local step count ``τ_k``, from
``RoundInput.metrics["steps"]``), and the weighted mean of the normalized updates is scaled back by
``τ_eff = Σ_k p_k a_k``: ``w^{t+1} = w^t + Σ_k (p_k τ_eff / a_k)(w_k − w^t)``, with ``p_k`` the weighting's weights
(sample shares, or Disco's: "Disco re-weighting before FedNova's normalization", spec §2.3). The formulas are pure
functions (:func:`nova_normalizer`, :func:`nova_coefficients`) so tests check them against hand computations; the
arithmetic is in float64 and cast back to each tensor's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from pydantic import Field
from torch import Tensor

from fedskew.protocol import STEPS, Params, RoundInput, State
from fedskew.registry import ClientPart, ServerPlugin
from fedskew.schema import StrictSettings
from fedskew.server.api import Combine, Composition, Diagnostics, refuse_masks
from fedskew.server.combine import weighted_sums


def nova_normalizer(steps: Tensor, local_momentum: float = 0.0) -> Tensor:
    """FedNova's ``a_k = ‖a^{(k)}‖₁`` from the local step counts ``τ_k`` (``[K]`` float64).

    Plain local SGD: ``a_k = τ_k``. Local SGD with momentum ρ (FedNova paper, §5 / official code): the sum over the
    steps of the momentum buffer's accumulated weight ``(1 − ρ^t)/(1 − ρ)``, i.e.
    ``a_k = [τ_k − ρ(1 − ρ^{τ_k})/(1 − ρ)] / (1 − ρ)``."""
    tau = steps.to(torch.float64)
    if local_momentum == 0:
        return tau
    rho = local_momentum
    return (tau - rho * (1.0 - rho**tau) / (1.0 - rho)) / (1.0 - rho)


def nova_coefficients(weights: Tensor, normalizer: Tensor) -> tuple[Tensor, float]:
    """FedNova's per-client coefficients ``c_k = p_k·τ_eff / a_k`` and ``τ_eff = Σ_k p_k a_k``.

    ``w^{t+1} = (1 − Σ_k c_k)·w^t + Σ_k c_k·w_k``; with equal ``a_k`` the coefficients are the weights (FedAvg)."""
    p = weights.to(torch.float64)
    a = normalizer.to(device=p.device, dtype=torch.float64)
    if a.shape != p.shape:
        raise ValueError(f"FedNova needs one normalizer per client: weights {tuple(p.shape)}, a {tuple(a.shape)}")
    if not bool((a > 0).all()):
        raise ValueError(f"FedNova: every client must have taken at least one local step, got a = {a.tolist()}")
    tau_eff = float((p * a).sum())
    return p * tau_eff / a, tau_eff


@dataclass(frozen=True)
class NovaCombine(Combine):
    """FedNova's normalized averaging (a ``combine`` piece) over every floating state-dict entry, as FedDisco's
    code does for every key; integer buffers take the max (as :class:`~fedskew.server.combine.WeightedMean`).

    ``local_momentum`` is the clients' SGD momentum ρ that the normalizer assumes (0: ``a_k = τ_k``, FedDisco's
    code, which ignores its local momentum 0.9; set it to the run's ``--momentum`` for the FedNova paper's
    momentum normalizer)."""

    local_momentum: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.local_momentum < 1.0:
            raise ValueError(f"local_momentum must be in [0, 1), got {self.local_momentum}")

    def check_composition(self, comp: Composition) -> None:
        """FedNova rescales whole client deltas; element masks (HEAL's) have no place in its formula."""
        refuse_masks(comp, "FedNova's normalized averaging takes one weight per client")

    def __call__(
        self, rin: RoundInput, weights: Tensor, masks: Params | None, state: State
    ) -> tuple[Params, Diagnostics, State]:
        if masks is not None:
            raise ValueError("FedNova's combine does not take element masks")
        if STEPS not in rin.metrics:
            raise ValueError(
                "FedNova needs every client's local step count (RoundInput.metrics['steps']); "
                f"the uploads reported only {sorted(rin.metrics)}"
            )
        coef, tau_eff = nova_coefficients(weights, nova_normalizer(rin.metrics[STEPS], self.local_momentum))
        keep = 1.0 - float(coef.sum())
        out: Params = {}
        for name, stacked in rin.params.items():
            if not stacked.is_floating_point():
                out[name] = stacked.max(0).values
                continue
            k = stacked.shape[0]
            total, _ = weighted_sums(stacked.reshape(k, -1), coef)
            w = rin.global_params[name].to(device=total.device, dtype=torch.float64).reshape(-1)
            out[name] = (keep * w + total).reshape(stacked.shape[1:]).to(stacked.dtype)
        return out, {"fednova_tau_eff": tau_eff, "fednova_coefficients": coef.tolist()}, state


# ---- registration ----------------------------------------------------------------------------------------------------
class FedNovaParams(StrictSettings):
    # the clients' SGD momentum the normalizer assumes (0: a_k = tau_k, FedDisco's code and FedNova for plain SGD)
    local_momentum: float = Field(0.0, ge=0, lt=1)


CLIENTS: dict[str, ClientPart] = {}
SERVER_PLUGINS: dict[str, ServerPlugin] = {
    "fednova": ServerPlugin(
        "fednova",
        "normalized averaging: w + sum_k (p_k tau_eff / tau_k)(w_k - w), tau_k = local steps, tau_eff = sum p_k tau_k",
        "Wang et al., Tackling the Objective Inconsistency Problem in Heterogeneous Federated Optimization, "
        "NeurIPS 2020",
        FedNovaParams,
        ("combine",),
        lambda p: {"combine": NovaCombine(local_momentum=p.local_momentum)},
    ),
}
