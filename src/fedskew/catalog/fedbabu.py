"""FedBABU (Oh, Kim, Yun, ICLR 2022), a FedSA/FedPake baseline: the body is trained with the head frozen at its
random initial value (so the global head never changes); each round the client also fine-tunes its locally trained
model (PFLlib's ``clientbabu.py``/``serverbabu.py``; or the received model) and keeps that as its personalized model.

PFLlib (TsingZ0/PFLlib) is the reference for every default, because the FedSA/FedPake experiments ran there (spec
§1.1); the differences are listed in ``docs/methods.md``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal

from pydantic import Field

from fedskew.client.batched_form import BatchedStep
from fedskew.client.kernels import PERSONAL, is_head
from fedskew.client.local import LocalAlgorithm, LocalContext, Phase, StateKey
from fedskew.protocol import Params
from fedskew.registry import NO_GLOBAL_MODEL, ClientPart, ServerPlugin
from fedskew.schema import StrictSettings

# client state, within one round's training only: the body-trained model to upload
BABU_UPLOAD = StateKey[Params]("fedbabu_upload", "FedBABU: the body-trained model to upload (within a round)")


@dataclass
class FedBABU(LocalAlgorithm):
    """FedBABU (Oh, Kim, Yun, ICLR 2022): federated training updates the body only; the head keeps its random
    initial value (frozen in every client's training, so the aggregated head is the initial one). For evaluation
    a client's model is fine-tuned locally for ``fine_tuning_epochs`` (``fine_tune = "full"``: body and head, as
    PFLlib's default ``fine_tune(['base', 'head'])``; ``"head"``: the head only) and kept as the client's
    personalized model.

    Where the fine-tuning starts (``fine_tune_from``):

    * ``"local"`` (default, PFLlib's ``serverbabu.py``: after the last aggregation every client fine-tunes its own
      ``client.model``, the model right after its latest local training, nothing being sent after the last
      aggregation): phases ``body`` (from the received model, head frozen; kept aside as the upload), then
      ``fine_tune`` continuing from that locally trained model (kept as the personal model); :meth:`end` reloads
      the body-trained model, which is what is uploaded. The personal view after round t is the fine-tuned local
      model of round t (PFLlib's final models when t is the last round, under full participation).
    * ``"global"`` (fedskew's earlier form): phases ``fine_tune`` from the received model (kept as the personal
      model), then ``body`` from the received model again (uploaded); the personal view after round t is the
      fine-tuned global model of round t−1.

    PFLlib fine-tunes once, after the last round; here every participating client fine-tunes in each round (see
    docs/methods.md). ``fine_tune_every = k`` fine-tunes only in rounds divisible by k (the personal model is the
    latest one between): with ``--eval-every k`` the evaluated personal views are the same at a k-th of the cost."""

    state_keys = (PERSONAL, BABU_UPLOAD)
    fine_tuning_epochs: int = 10
    fine_tune: Literal["full", "head"] = "full"
    fine_tune_every: int = 1
    fine_tune_from: Literal["local", "global"] = "local"
    name: str = "fedbabu"

    def phases(self, ctx: LocalContext) -> list[Phase]:
        body = Phase(ctx.settings.epochs, name="body", start=ctx.received, trains=lambda n: not is_head(n))
        if ctx.round % self.fine_tune_every:
            return [body]
        trains = None if self.fine_tune == "full" else is_head
        if self.fine_tune_from == "global":
            return [Phase(self.fine_tuning_epochs, "fine_tune", start=ctx.received, trains=trains, keep=PERSONAL), body]
        tune = Phase(self.fine_tuning_epochs, "fine_tune", start=None, trains=trains, keep=PERSONAL)  # from the body
        return [replace(body, keep=BABU_UPLOAD), tune]

    def end(self, ctx: LocalContext) -> Params:
        upload = ctx.take(BABU_UPLOAD)
        if upload is not None:  # fine-tuned after the body phase: upload the body-trained model, not the personal one
            ctx.model.load_state_dict(upload)
        return {}

    def personal_model(self, client_state: dict[str, Any]) -> Params | None:
        return PERSONAL.get(client_state)

    def batched_step(self) -> BatchedStep:
        return BatchedStep()  # phases only (the body with the head frozen, then the fine-tuning)


# ---- registration ----------------------------------------------------------------------------------------------------
class FedBABUParams(StrictSettings):
    fine_tuning_epochs: int = Field(10, ge=1)  # PFLlib -fte (FedSA/FedPake: "fine-tuning epochs 10")
    fine_tune: Literal["full", "head"] = "full"  # PFLlib's fine_tune(['base', 'head']); the paper fine-tunes all
    fine_tune_every: int = Field(1, ge=1)  # fedskew: fine-tune in every k-th round only (PFLlib: once, at the end)
    # where fine-tuning starts: the client's model right after its local training (PFLlib serverbabu.py), or the
    # received global model (fedskew's earlier form)
    fine_tune_from: Literal["local", "global"] = "local"


CLIENTS: dict[str, ClientPart] = {
    "fedbabu": ClientPart(
        "fedbabu",
        "body trained federatedly with the random head frozen; the locally trained model fine-tuned "
        "(fine_tuning_epochs=10, fine_tune_from=local as PFLlib) is the personal model",
        "Oh, Kim, Yun, FedBABU: Toward Enhanced Representation for Federated Image Classification, ICLR 2022",
        FedBABUParams,
        lambda p: FedBABU(**p.model_dump()),
        excludes=(
            NO_GLOBAL_MODEL,
            (
                "fedper",
                "FedBABU never trains the head in the federated rounds, so keeping it local changes nothing; its "
                "personalization is the fine-tuning",
            ),
        ),
        personalized=True,
    ),
}
SERVER_PLUGINS: dict[str, ServerPlugin] = {}
