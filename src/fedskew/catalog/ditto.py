"""Ditto (Li, Hu, Beirami, Smith, ICML 2021), whole: a personal model trained towards the global one.

Each round client k first trains its personal model ``v_k`` (kept on the client) for ``personal_epochs`` on
``CE + (lam/2)||v_k − w||²`` with ``w`` the received global model, then trains the global model with plain SGD and
uploads it; the server averages uniformly (the paper's). Default ``lam = 0.1`` (FedSA/FedPake used 0.001).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.nn.functional as F
from pydantic import Field
from torch import Tensor

from fedskew.client.batched_form import BatchedStep
from fedskew.client.kernels import PERSONAL, proximal
from fedskew.client.local import LocalAlgorithm, LocalContext, Phase
from fedskew.protocol import Params
from fedskew.registry import ClientPart, ServerPlugin
from fedskew.schema import StrictSettings
from fedskew.space import LogFloat


@dataclass
class Ditto(LocalAlgorithm):
    """Ditto (Li et al., ICML 2021): personal model ``v_k`` trained for ``personal_epochs`` (default: the local
    epochs) on ``CE + (lam/2)||v_k − w||²`` with ``w`` the received global model, kept on the client; then the global
    model trained with plain SGD and uploaded. Default ``lam = 0.1`` (FedSA/FedPake used 0.001)."""

    state_keys = (PERSONAL,)
    lam: float = 0.1
    personal_epochs: int | None = None

    def phases(self, ctx: LocalContext) -> list[Phase]:
        kept = ctx.kept(PERSONAL)
        own = ctx.received if kept is None else kept
        epochs = self.personal_epochs or ctx.settings.epochs
        return [
            Phase(epochs, name="personal", start=own, keep=PERSONAL),
            Phase(ctx.settings.epochs, name="global", start=ctx.received),
        ]

    def loss(self, ctx: LocalContext, logits: Tensor, features: Tensor, y: Tensor, x: Tensor) -> Tensor:
        ce = F.cross_entropy(logits, y)
        if ctx.phase != "personal" or self.lam == 0:
            return ce
        return ce + proximal(ctx, ctx.received, self.lam)

    def batched_step(self) -> BatchedStep:
        return BatchedStep(prox_mu=lambda phase: float(self.lam) if phase == "personal" else 0.0)

    def personal_model(self, client_state: dict[str, Any]) -> Params | None:
        return PERSONAL.get(client_state)


# ---- registration ----------------------------------------------------------------------------------------------------
class DittoParams(StrictSettings):
    lam: float = Field(0.1, ge=0)
    personal_epochs: int | None = Field(None, ge=1)


CLIENTS: dict[str, ClientPart] = {
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
}
SERVER_PLUGINS: dict[str, ServerPlugin] = {}
