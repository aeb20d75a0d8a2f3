"""Prototype-based hosts: FedProto and FedProc (the prototype hosts of the FedHEAL paper's Table 2).

A *prototype* is the mean body feature (``model.body(x)``, the input of the classifier head) of one class. Both
methods work the same way around the one training loop:

* the client collects its local prototypes from the features of its **last local epoch**, as both reference codes do,
  and uploads them with the model (:mod:`fedskew.client.prototypes`, which FPL shares);
* the client part's server half (:class:`PrototypeServer`) averages them per class over the
  clients that hold the class and broadcasts the result (:data:`GLOBAL_PROTOS`, :data:`GLOBAL_PRESENT`); the model
  itself is aggregated by whatever server step the method
  has (FedAvg's mean, HEAL's masks and FAEL weights, AFL's weights, ...), so ``fedproto+heal`` is HEAL on the model
  and FedProto on the prototypes;
* the local objective uses the global prototypes: FedProto adds ``lam`` times the squared distance of each feature to
  its class's global prototype; FedProc mixes a prototypical contrastive loss with cross-entropy under a curriculum.

Evaluation (:meth:`PrototypeLearning.eval_views`, called by the engine through
:func:`fedskew.engine.evaluate.client_part_views`) adds the view ``proto``: the global model's features classified by
the nearest global prototype, as the FedProto paper evaluates (``proto_acc``, and per domain under domain skew).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor, nn

from fedskew.client.batched_form import BatchedStep, FrozenTermFn
from fedskew.client.local import LocalContext
from fedskew.client.prototypes import (
    PROTO_COUNT,
    PROTO_MEAN,
    PrototypeCollector,
    PrototypeRound,
    collected_sums,
)
from fedskew.protocol import Params, RoundInput, ServerContext
from fedskew.registry import ClientPart, ServerPlugin
from fedskew.schema import StrictSettings
from fedskew.server.api import ServerHalf
from fedskew.space import Float, LogFloat

# what the server half broadcasts (the uploads, PROTO_MEAN and PROTO_COUNT, are fedskew.client.prototypes')
GLOBAL_PROTOS = "proto/global"  # broadcast: [C, D] the global prototypes
GLOBAL_PRESENT = "proto/present"  # broadcast: [C] bool, which classes have a global prototype

EVAL_VIEW = "proto"  # the evaluation view's record prefix: proto_acc, proto_loss, proto_domain_acc_avg, ...


@dataclass
class PrototypeLearning(PrototypeCollector):
    """What FedProto and FedProc share: last-epoch prototype collection (:class:`PrototypeCollector`), the received
    global prototypes, and the nearest-prototype evaluation (the per-class average is the server half's).
    Subclasses define the local objective (:meth:`loss`) and :meth:`_eval_scores`."""

    def prepare(self, ctx: LocalContext, collect_from: int) -> PrototypeRound:
        prep = PrototypeRound(collect_from=collect_from)
        protos = ctx.broadcast.get(GLOBAL_PROTOS)
        present = ctx.broadcast.get(GLOBAL_PRESENT)
        assert ctx.x is not None
        if protos is not None and present is not None and bool(present.any()):
            prep.protos = (protos.to(ctx.x.device, torch.float32), present.to(ctx.x.device))
        return prep

    # ---- evaluation -------------------------------------------------------------------------------------------
    def _eval_scores(self, features: Tensor, y: Tensor, protos: Tensor, present: Tensor) -> tuple[Tensor, Tensor]:
        """Per sample: the prediction from the prototypes and the loss the view reports."""
        raise NotImplementedError

    @torch.inference_mode()
    def eval_views(
        self, model: nn.Module, broadcast: Params, x: Tensor, y: Tensor, owner: Tensor, num_owners: int, batch_size: int
    ) -> dict[str, tuple[Tensor, Tensor]]:
        """The ``proto`` view of the model in ``model``: per owner (domain, or one for the global test set), the
        number of samples whose nearest global prototype is their class, and the summed per-sample loss."""
        if GLOBAL_PROTOS not in broadcast:
            return {}
        protos, present = broadcast[GLOBAL_PROTOS].to(x.device), broadcast[GLOBAL_PRESENT].to(x.device)
        was_training = model.training
        model.eval()
        correct = torch.zeros(num_owners, dtype=torch.float64, device=x.device)
        loss_sum = torch.zeros(num_owners, dtype=torch.float64, device=x.device)
        try:
            for i in range(0, x.shape[0], batch_size):
                xb, yb, ob = x[i : i + batch_size], y[i : i + batch_size], owner[i : i + batch_size]
                pred, loss = self._eval_scores(model.body(xb), yb, protos, present)
                correct.index_add_(0, ob, (pred == yb).double())
                loss_sum.index_add_(0, ob, loss.double())
        finally:
            model.train(was_training)
        return {EVAL_VIEW: (correct, loss_sum)}


def squared_distances(features: Tensor, protos: Tensor) -> Tensor:
    """``[B, C]``: mean over the feature dimension of ``(f_b - c_j)²`` (the reference's ``nn.MSELoss`` per pair)."""
    return (features.unsqueeze(1) - protos.unsqueeze(0)).pow(2).mean(2)


@dataclass
class FedProto(PrototypeLearning):
    """FedProto (Tan et al., AAAI 2022): cross-entropy + ``lam`` · MSE between each feature and its class's global
    prototype.

    The regularizer is the reference's ``nn.MSELoss()(f_new, f)``, where row ``i`` of ``f_new`` is the global
    prototype of sample ``i``'s class, or the feature itself (a zero term) when that class has no global prototype:
    ``(1/(B·D)) Σ_{i: y_i present} ‖f_i − c_{y_i}‖²``. Without any global prototype (the first round) the loss is plain
    cross-entropy. Default ``lam = 1`` (official code's ``--ld``; MarsFL, the FedHEAL authors' framework, uses 2).
    Evaluation by the nearest prototype in that distance (the reference's ``test_inference_new_het_lt``).
    """

    lam: float = 1.0

    def loss(self, ctx: LocalContext, logits: Tensor, features: Tensor, y: Tensor, x: Tensor) -> Tensor:
        ce = F.cross_entropy(logits, y)
        self.collect(ctx, features, y, logits.shape[1])
        global_protos = ctx.prep(PrototypeRound).protos
        if global_protos is None or self.lam == 0:
            return ce
        protos, present = global_protos
        has = present[y].unsqueeze(1)
        target = torch.where(has, protos[y], features.detach())
        return ce + self.lam * F.mse_loss(features, target)

    def batched_step(self) -> BatchedStep:
        lam = float(self.lam)

        def term(ctx: LocalContext) -> FrozenTermFn | None:
            """``loss``'s term per sample (the engine takes each client's batch mean): ``lam ·`` the MSE between each
            feature and its class's global prototype (the feature itself where the class has none); none before the
            first global prototypes (broadcast: the same for every client of the round; a new function each round,
            so captured steps capture their graphs anew each round)."""
            global_protos = ctx.prep(PrototypeRound).protos
            if global_protos is None or lam == 0:
                return None
            protos, present = global_protos

            def distance(feats: Tensor, logits: Tensor, y: Tensor, outs: dict[str, tuple[Tensor, Tensor]]) -> Tensor:
                target = torch.where(present[y].unsqueeze(-1), protos[y], feats.detach())
                return lam * ((feats - target) ** 2).mean(dim=2)

            return distance

        return BatchedStep(term=term, collect=collected_sums, term_per_sample=True)

    def _eval_scores(self, features: Tensor, y: Tensor, protos: Tensor, present: Tensor) -> tuple[Tensor, Tensor]:
        dist = squared_distances(features.float(), protos.float())
        pred = dist.masked_fill(~present.unsqueeze(0), math.inf).argmin(1)
        own = dist.gather(1, y.unsqueeze(1)).squeeze(1)
        return pred, torch.where(present[y], own, torch.zeros_like(own))


def prototypical_contrastive(
    features: Tensor, y: Tensor, protos: Tensor, present: Tensor, temperature: float = 1.0
) -> Tensor:
    """FedProc's per-sample loss ``−log( e^{cos(z, c_y)/T} / Σ_{j present} e^{cos(z, c_j)/T} )`` (``[B]``): the
    positive is the sample's class prototype, the negatives every other class's; 0 for a sample whose class has no
    global prototype. The classes without one are masked out of the normalizer (``−inf``) rather than selected by
    index, so that no step waits on the host (a CUDA graph can capture it); ``present`` must hold one class at least."""
    sims = F.cosine_similarity(features.unsqueeze(1), protos.unsqueeze(0), dim=2) / temperature  # [B, C]
    normalizer = torch.logsumexp(sims.masked_fill(~present.unsqueeze(0), float("-inf")), dim=1)
    positive = sims.gather(1, y.unsqueeze(1)).squeeze(1)
    return torch.where(present[y], normalizer - positive, torch.zeros_like(positive))


def curriculum_weight(rnd: int, total: int) -> float:
    """FedProc's curriculum weight of the contrastive term in round ``rnd`` (1-based) of ``total``:
    ``α = 1 − (rnd − 1)/(total − 1)`` clipped to ``[0, 1]`` (MarsFL's ``1 − epoch_index/(communication_epoch − 1)``,
    ``epoch_index`` 0-based); 1 in the first round, 0 in the last and after it; 0 throughout when ``total <= 1``."""
    if total <= 1:
        return 0.0
    return min(1.0, max(0.0, 1.0 - (rnd - 1) / (total - 1)))


@dataclass
class FedProc(PrototypeLearning):
    """FedProc (Mu et al., FGCS 2023 / arXiv 2109.12273): ``α · L_pc + (1 − α) · CE`` with the curriculum
    ``α = 1 − (t − 1)/(T − 1)`` over rounds ``t = 1..T`` (from the contrastive loss to cross-entropy; MarsFL's
    ``1 − epoch_index/(communication_epoch − 1)``, :func:`curriculum_weight`), where ``L_pc`` is the batch mean of
    :func:`prototypical_contrastive` (samples whose class has no global prototype count 0, as MarsFL divides by the
    batch size). ``T``: ``curriculum_rounds`` if given, else (``None``, the default) the run's number of rounds
    (``ctx.settings.rounds``), as MarsFL's ``communication_epoch`` is the run's length; past T, α stays 0. Without
    any global prototype (the first round) the loss is plain cross-entropy (MarsFL's would be ``(1 − α)·CE = 0`` in
    round 1, a round without training). Default temperature 1 (MarsFL's plain cosine). Evaluation by the prototype
    of highest cosine similarity.
    """

    curriculum_rounds: int | None = None
    temperature: float = 1.0

    def alpha(self, rnd: int, run_rounds: int | None = None) -> float:
        """The curriculum weight of the contrastive term in round ``rnd`` (1-based) of a run of ``run_rounds``
        rounds (``curriculum_rounds`` overrides the run's length)."""
        total = self.curriculum_rounds if self.curriculum_rounds is not None else run_rounds
        if total is None:
            raise ValueError(
                "FedProc's curriculum needs T: the run's number of rounds (TrainSettings.rounds) or curriculum_rounds"
            )
        return curriculum_weight(rnd, total)

    def loss(self, ctx: LocalContext, logits: Tensor, features: Tensor, y: Tensor, x: Tensor) -> Tensor:
        ce = F.cross_entropy(logits, y)
        self.collect(ctx, features, y, logits.shape[1])
        global_protos = ctx.prep(PrototypeRound).protos
        if global_protos is None:
            return ce
        protos, present = global_protos
        a = self.alpha(ctx.round, ctx.settings.rounds)
        contrast = prototypical_contrastive(features, y, protos, present, self.temperature).mean()
        return a * contrast + (1.0 - a) * ce

    def batched_step(self) -> BatchedStep:
        temperature = float(self.temperature)

        def term(ctx: LocalContext) -> FrozenTermFn | None:
            """``loss`` = ``α·L_pc + (1 − α)·CE`` as the cross-entropy plus ``α·(L_pc − CE)`` per sample (α the
            round's curriculum weight; the engine takes each client's batch mean); none before the first global
            prototypes (a new function each round)."""
            global_protos = ctx.prep(PrototypeRound).protos
            if global_protos is None:
                return None
            protos, present = global_protos
            a = self.alpha(ctx.round, ctx.settings.rounds)

            def contrast(feats: Tensor, logits: Tensor, y: Tensor, outs: dict[str, tuple[Tensor, Tensor]]) -> Tensor:
                k, b, c = logits.shape
                flat_y = y.reshape(k * b)
                ce = F.cross_entropy(logits.reshape(k * b, c), flat_y, reduction="none")
                pc = prototypical_contrastive(feats.reshape(k * b, -1), flat_y, protos, present, temperature)
                return a * (pc - ce).view(k, b)

            return contrast

        return BatchedStep(term=term, collect=collected_sums, term_per_sample=True)

    def _eval_scores(self, features: Tensor, y: Tensor, protos: Tensor, present: Tensor) -> tuple[Tensor, Tensor]:
        sims = F.cosine_similarity(features.float().unsqueeze(1), protos.float().unsqueeze(0), dim=2)
        pred = sims.masked_fill(~present.unsqueeze(0), -math.inf).argmax(1)
        return pred, prototypical_contrastive(features.float(), y, protos.float(), present, self.temperature)


# ---- server half -----------------------------------------------------------------------------------------------------
Average = Literal["clients", "samples"]


def aggregate_prototypes(means: Tensor, counts: Tensor, average: Average = "clients") -> tuple[Tensor, Tensor]:
    """Global prototypes from the clients' per-class means (``[K, C, D]``) and counts (``[K, C]``).

    ``average='clients'`` (both reference codes): the plain mean, per class, over the clients that have the class;
    ``'samples'``: weighted by each client's count of the class. A client without a class (count 0) never enters
    that class's average. Returns ``(protos [C, D] float64, present [C] bool)``; a class no client has is 0 and
    not present."""
    counts = counts.to(torch.float64)
    w = (counts > 0).to(torch.float64) if average == "clients" else counts
    total = w.sum(0)
    present = total > 0
    sums = torch.einsum("kc,kcd->cd", w, means.to(torch.float64))
    protos = sums / torch.where(present, total, torch.ones_like(total)).unsqueeze(1)
    return protos, present


class PrototypeState(NamedTuple):
    protos: Tensor | None  # [C, D] float32 global prototypes (None until the first uploads give the width)
    present: Tensor  # [C] bool: classes that have a global prototype


@dataclass(frozen=True)
class PrototypeServer(ServerHalf):
    """FedProto's and FedProc's server half (:mod:`fedskew.catalog.prototypes`): the per-class average of the
    uploaded prototypes (:func:`aggregate_prototypes`), broadcast once there is one. A class none of this round's
    participants has keeps its previous prototype (under full participation no class is ever in that case)."""

    average: Average = "clients"

    def init(self, ctx: ServerContext) -> PrototypeState:
        # the feature width is learned from the first uploads; until then nothing is broadcast
        return PrototypeState(None, torch.zeros(ctx.num_classes, dtype=torch.bool))

    def broadcast(self, state: PrototypeState) -> Params:
        if state.protos is None:
            return {}
        return {GLOBAL_PROTOS: state.protos, GLOBAL_PRESENT: state.present}

    def advance(self, rin: RoundInput, state: PrototypeState) -> PrototypeState:
        protos, present = aggregate_prototypes(rin.extras[PROTO_MEAN], rin.extras[PROTO_COUNT], self.average)
        protos = protos.to(torch.float32).cpu()
        present = present.cpu()
        if state.protos is not None:
            protos = torch.where(present.unsqueeze(1), protos, state.protos)
        return PrototypeState(protos, present | state.present)


# ---- registration ----------------------------------------------------------------------------------------------------
class FedProtoParams(StrictSettings):
    lam: float = Field(1.0, ge=0)  # weight of the prototype distance (official code --ld; MarsFL uses 2)
    average: Literal["clients", "samples"] = "clients"  # per-class server average (reference: over clients)


class FedProcParams(StrictSettings):
    curriculum_rounds: int | None = Field(None, ge=1)  # T of alpha = 1 - (t-1)/(T-1); None: the run's rounds (MarsFL)
    temperature: float = Field(1.0, gt=0)  # of the cosine similarities (MarsFL: none, i.e. 1)
    average: Literal["clients", "samples"] = "clients"


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

SERVER_PLUGINS: dict[str, ServerPlugin] = {}
