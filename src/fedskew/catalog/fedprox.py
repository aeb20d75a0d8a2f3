"""FedProx (Li, Sahu, Zaheer, Sanjabi, Talwalkar, Smith, MLSys 2020), whole: the local loss plus a proximal term
``(mu/2)·||w − w_global||²`` over the trainable parameters; the server averages as FedAvg (any plug-in composes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn.functional as F
from pydantic import Field
from torch import Tensor

from fedskew.client.batched_form import BatchedStep
from fedskew.client.kernels import proximal
from fedskew.client.local import LocalAlgorithm, LocalContext
from fedskew.registry import ClientPart, ServerPlugin
from fedskew.schema import StrictSettings
from fedskew.space import LogFloat


@dataclass
class FedProx(LocalAlgorithm):
    """FedProx (Li et al., MLSys 2020): cross-entropy + (mu/2)·||w − w_global||² over trainable parameters.

    Default mu = 0.01 (FedDisco's code default; FedSA/FedPake use 0.001, FedDisco's scripts 0.1).
    mu = 0 is exactly plain local SGD.
    """

    mu: float = 0.01

    def loss(self, ctx: LocalContext, logits: Tensor, features: Tensor, y: Tensor, x: Tensor) -> Tensor:
        ce = F.cross_entropy(logits, y)
        return ce if self.mu == 0 else ce + proximal(ctx, ctx.received, self.mu)

    def batched_step(self) -> BatchedStep:
        return BatchedStep(prox_mu=lambda phase: float(self.mu))


# ---- registration ----------------------------------------------------------------------------------------------------
class FedProxParams(StrictSettings):
    mu: float = Field(0.01, ge=0)


CLIENTS: dict[str, ClientPart] = {
    "fedprox": ClientPart(
        "fedprox",
        "local loss + (mu/2)||w - w_global||^2 (mu=0.01)",
        "Li et al., Federated Optimization in Heterogeneous Networks, MLSys 2020",
        FedProxParams,
        lambda p: FedProx(mu=p.mu),
        # MOON and FedDisco's code tune mu over {0.001, 0.01, 0.1, 1}
        tunable={"mu": LogFloat(1e-3, 1.0)},
    ),
}
SERVER_PLUGINS: dict[str, ServerPlugin] = {}
