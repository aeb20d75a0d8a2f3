"""FPL (Huang, Ye, Du, "Rethinking Federated Learning with Domain Shift: A Prototype View", CVPR 2023): federated
prototype learning with cluster and unbiased prototypes, the natural comparison for FedHEAL under domain skew.

As the official code (github.com/WenkeHuang/RethinkFL, ``models/fpl.py``) runs it:

* **Client**: collects its last local epoch's prototypes (:mod:`fedskew.client.prototypes`, as FedProto) and trains
  on ``CE + (1/B) Σ_{i: y_i has prototypes} [L_CPCL(z_i) + L_UPCR(z_i)]``, where ``z_i`` is the body's feature,
  ``L_CPCL = −log(Σ_{p ∈ P_y} e^{cos(z, p)/τ} / Σ_{p ∈ P} e^{cos(z, p)/τ})`` over the cluster prototypes ``P``
  (``P_y`` those of the sample's class) and ``L_UPCR = mean_d (z − u_y)²``, ``u_y`` the class's unbiased prototype
  (the mean of its cluster prototypes). Before the first prototypes (round 1) it is plain cross-entropy.
* **Server half**: per class, the participants' prototypes of that round (the clients that hold the class) are
  clustered with FINCH (cosine distance, first-neighbour relations; the coarsest partition FINCH keeps, i.e. before
  one that would merge everything or merge nothing); the cluster prototypes are the clusters' means, the unbiased
  prototype their mean. A class held by one participant has that prototype alone. Nothing is kept from earlier
  rounds (the official code recomputes them from the round's clients). The model is aggregated by the method's
  server step (FedAvg's by default, the code's ``averaging='weight'``), so ``fpl+heal`` composes.

Default ``τ = 0.1`` (the code's ``--infoNCET``), tuned over ``log[0.02, 1]``. Departures: the code's local optimizer
(SGD, momentum 0.9, weight decay 1e-5) is the run's (``--momentum``, ``--weight-decay``); the code evaluates with
the global model, as fedskew does. Batched: yes (the term reads the broadcast cluster prototypes, the same for
every client of a round); standard-layer models only, as every loss term.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor

from fedskew.client.batched_form import BatchedStep, FrozenTermFn
from fedskew.client.local import LocalContext
from fedskew.client.prototypes import PROTO_COUNT, PROTO_MEAN, PrototypeCollector, PrototypeRound, collected_sums
from fedskew.protocol import Params, RoundInput, ServerContext
from fedskew.registry import ClientPart, ServerPlugin
from fedskew.schema import StrictSettings
from fedskew.server.api import ServerHalf
from fedskew.space import LogFloat

# what the server half broadcasts
FPL_CLUSTERS = "fpl/clusters"  # [C, M, D] each class's cluster prototypes (padded to the most clusters M)
FPL_VALID = "fpl/valid"  # [C, M] bool: which of those are cluster prototypes
FPL_UNBIASED = "fpl/unbiased"  # [C, D] each class's unbiased prototype (the mean of its cluster prototypes)
FPL_PRESENT = "fpl/present"  # [C] bool: classes with prototypes this round


# ---- FINCH (Sarfraz, Sharma, Stiefelhagen, CVPR 2019) ------------------------------------------------------------
def first_neighbours(x: np.ndarray) -> np.ndarray:
    """Each row's nearest other row in cosine distance (itself when alone)."""
    norm = np.linalg.norm(x, axis=1, keepdims=True)
    unit = x / np.where(norm > 0, norm, 1.0)
    dist = 1.0 - unit @ unit.T
    np.fill_diagonal(dist, 1e12)
    return np.argmin(dist, axis=1)


def _components(neighbour: np.ndarray) -> np.ndarray:
    """Labels ``0..k-1`` of the connected components of the graph ``i ~ neighbour[i]`` (FINCH's clustering
    equation: ``i`` and ``j`` are linked when one is the other's first neighbour or they share it), numbered in the
    order of their smallest member."""
    parent = list(range(len(neighbour)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i, j in enumerate(neighbour):
        a, b = root(i), root(int(j))
        if a != b:
            parent[max(a, b)] = min(a, b)
    roots = [root(i) for i in range(len(neighbour))]
    order = {r: k for k, r in enumerate(dict.fromkeys(roots))}
    return np.array([order[r] for r in roots], dtype=np.int64)


def _means(x: np.ndarray, labels: np.ndarray) -> np.ndarray:
    k = int(labels.max()) + 1
    sums = np.zeros((k, x.shape[1]), dtype=x.dtype)
    np.add.at(sums, labels, x)
    return sums / np.bincount(labels, minlength=k)[:, None]


def finch(x: np.ndarray) -> np.ndarray:
    """The coarsest partition FINCH keeps (the official implementation's last column with ``ensure_early_exit``
    off): partition 0 from the rows' first neighbours, then each next one from the first neighbours of the current
    clusters' means, stopping before a partition of one cluster or one that merges nothing, and after one that
    merges a single pair."""
    x = x.astype(np.float32)
    labels = _components(first_neighbours(x))
    count = int(labels.max()) + 1
    while True:
        merged = _components(first_neighbours(_means(x, labels)))[labels]
        new = int(merged.max()) + 1
        if new == 1 or count - new < 1:  # everything in one cluster, or nothing merged: not kept
            return labels
        labels, merged_away, count = merged, count - new, new
        if merged_away == 1:  # the official loop stops after a partition that merged one pair (and keeps it)
            return labels


def cluster_prototypes(protos: np.ndarray) -> np.ndarray:
    """One class's cluster prototypes ``[m, D]`` from its clients' prototypes ``[k, D]`` (the prototype itself when
    ``k == 1``)."""
    if protos.shape[0] == 1:
        return protos.astype(np.float32)
    return _means(protos.astype(np.float32), finch(protos))


# ---- client ----------------------------------------------------------------------------------------------------------
class FPLPrototypes(NamedTuple):
    clusters: Tensor  # [C, M, D]
    valid: Tensor  # [C, M] bool
    unbiased: Tensor  # [C, D]
    present: Tensor  # [C] bool


@dataclass
class FPLRound(PrototypeRound):
    """FPL's prepared value: the collection, and the round's cluster prototypes (``None`` before the first)."""

    fpl: FPLPrototypes | None = None


def fpl_terms(features: Tensor, y: Tensor, p: FPLPrototypes, tau: float) -> Tensor:
    """Per sample ``[B]``: ``L_CPCL + L_UPCR`` (module docstring); 0 for a sample whose class has no prototypes."""
    c, m, d = p.clusters.shape
    flat, valid = p.clusters.reshape(c * m, d), p.valid.reshape(c * m)
    owner = torch.arange(c, device=features.device).repeat_interleave(m)
    sims = F.cosine_similarity(features.unsqueeze(1), flat.unsqueeze(0), dim=2) / tau  # [B, C·M]
    sims = sims.masked_fill(~valid.unsqueeze(0), float("-inf"))
    positive = sims.masked_fill(owner.unsqueeze(0) != y.unsqueeze(1), float("-inf"))
    has = p.present[y]
    info = torch.logsumexp(sims, dim=1) - torch.logsumexp(positive, dim=1)
    mse = (features - p.unbiased[y]).pow(2).mean(1)
    return torch.where(has, info + mse, torch.zeros_like(mse))


@dataclass
class FPL(PrototypeCollector):
    """``CE + (1/B) Σ (L_CPCL + L_UPCR)`` against the broadcast cluster and unbiased prototypes (module docstring)."""

    tau: float = 0.1

    def prepare(self, ctx: LocalContext, collect_from: int) -> FPLRound:
        prep = FPLRound(collect_from=collect_from)
        if FPL_CLUSTERS in ctx.broadcast and bool(ctx.broadcast[FPL_PRESENT].any()):
            assert ctx.x is not None
            b, dev = ctx.broadcast, ctx.x.device
            prep.fpl = FPLPrototypes(
                b[FPL_CLUSTERS].to(dev, torch.float32),
                b[FPL_VALID].to(dev),
                b[FPL_UNBIASED].to(dev, torch.float32),
                b[FPL_PRESENT].to(dev),
            )
        return prep

    def loss(self, ctx: LocalContext, logits: Tensor, features: Tensor, y: Tensor, x: Tensor) -> Tensor:
        ce = F.cross_entropy(logits, y)
        self.collect(ctx, features, y, logits.shape[1])
        protos = ctx.prep(FPLRound).fpl
        if protos is None:
            return ce
        return ce + fpl_terms(features, y, protos, self.tau).sum() / y.shape[0]

    def batched_step(self) -> BatchedStep:
        tau = float(self.tau)

        def term(ctx: LocalContext) -> FrozenTermFn | None:
            """``loss``'s term per sample, the engine taking each client's batch mean (the broadcast prototypes are
            the same for every client of the round; a new function each round)."""
            protos = ctx.prep(FPLRound).fpl
            if protos is None:
                return None

            def terms(feats: Tensor, logits: Tensor, y: Tensor, outs: dict[str, tuple[Tensor, Tensor]]) -> Tensor:
                k, b = y.shape
                return fpl_terms(feats.reshape(k * b, -1), y.reshape(k * b), protos, tau).view(k, b)

            return terms

        return BatchedStep(term=term, collect=collected_sums, term_per_sample=True)


# ---- server half -----------------------------------------------------------------------------------------------------
class FPLState(NamedTuple):
    broadcast: Params  # what the next round's clients receive ({} before the first uploads)


@dataclass(frozen=True)
class FPLServer(ServerHalf):
    """Per class, FINCH over the round's participants' prototypes: the cluster prototypes and their mean."""

    def init(self, ctx: ServerContext) -> FPLState:
        return FPLState({})

    def broadcast(self, state: FPLState) -> Params:
        return state.broadcast

    def advance(self, rin: RoundInput, state: FPLState) -> FPLState:
        means = rin.extras[PROTO_MEAN].to(torch.float32).cpu().numpy()  # [K, C, D]
        counts = rin.extras[PROTO_COUNT].cpu().numpy()  # [K, C]
        num_classes, dim = means.shape[1], means.shape[2]
        per_class = [
            cluster_prototypes(means[counts[:, c] > 0, c]) if (counts[:, c] > 0).any() else None
            for c in range(num_classes)
        ]
        m = max((p.shape[0] for p in per_class if p is not None), default=1)
        clusters = torch.zeros((num_classes, m, dim), dtype=torch.float32)
        valid = torch.zeros((num_classes, m), dtype=torch.bool)
        unbiased = torch.zeros((num_classes, dim), dtype=torch.float32)
        for c, p in enumerate(per_class):
            if p is not None:
                clusters[c, : p.shape[0]] = torch.from_numpy(p)
                valid[c, : p.shape[0]] = True
                unbiased[c] = torch.from_numpy(p.mean(0))
        present = valid.any(1)
        return FPLState({FPL_CLUSTERS: clusters, FPL_VALID: valid, FPL_UNBIASED: unbiased, FPL_PRESENT: present})


# ---- registration ----------------------------------------------------------------------------------------------------
class FPLParams(StrictSettings):
    tau: float = Field(0.1, gt=0)  # the contrastive temperature (the official code's --infoNCET)


CLIENTS: dict[str, ClientPart] = {
    "fpl": ClientPart(
        "fpl",
        "CE + cluster-prototype contrastive + unbiased-prototype MSE; prototypes clustered per class with FINCH "
        "(tau=0.1)",
        "Huang, Ye, Du, Rethinking Federated Learning with Domain Shift: A Prototype View, CVPR 2023",
        FPLParams,
        lambda p: FPL(tau=p.tau),
        server_half=lambda p: FPLServer(),
        tunable={"tau": LogFloat(0.02, 1.0)},
    ),
}
SERVER_PLUGINS: dict[str, ServerPlugin] = {}
