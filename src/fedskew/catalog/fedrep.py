"""FedRep (Collins, Hassani, Mokhtari, Shakkottai, ICML 2021), whole: the local head trained first, then the shared
body; the head never leaves the client (``fedrep`` implies the ``fedper`` plug-in's local head).
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import Field

from fedskew.client.batched_form import BatchedStep
from fedskew.client.kernels import is_head
from fedskew.client.local import LocalAlgorithm, LocalContext, Phase
from fedskew.registry import ClientPart, ServerPlugin
from fedskew.schema import StrictSettings
from fedskew.space import Int


@dataclass
class FedRep(LocalAlgorithm):
    """FedRep (Collins et al., ICML 2021): ``head_epochs`` on the head with the body frozen, then ``local_epochs``
    on the body with the head frozen. Default ``head_epochs = 10`` (the FedRep paper's head epochs)."""

    head_epochs: int = 10

    def phases(self, ctx: LocalContext) -> list[Phase]:
        return [
            Phase(self.head_epochs, name="head", trains=is_head),
            Phase(ctx.settings.epochs, name="body", trains=lambda n: not is_head(n)),
        ]

    def batched_step(self) -> BatchedStep:
        return BatchedStep()  # phases only: the engine gives each its schedule, optimizer and trained parameters


# ---- registration ----------------------------------------------------------------------------------------------------
class FedRepParams(StrictSettings):
    head_epochs: int = Field(10, ge=1)


CLIENTS: dict[str, ClientPart] = {
    "fedrep": ClientPart(
        "fedrep",
        "local head trained first (head_epochs=10, body frozen), then the body; the head stays local (implies fedper)",
        "Collins et al., Exploiting Shared Representations for Personalized Federated Learning, ICML 2021",
        FedRepParams,
        lambda p: FedRep(head_epochs=p.head_epochs),
        implies=("fedper",),
        tunable={"head_epochs": Int(1, 10)},  # FedRep: 10 head epochs (its paper's default)
    ),
}
SERVER_PLUGINS: dict[str, ServerPlugin] = {}
