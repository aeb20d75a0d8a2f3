"""FedFomo (Zhang, Sapra, Fidler, Yeung, Alvarez, ICLR 2021), whole: each client downloads other clients' models
and combines them by first-order model optimization on its own validation split.

One round, client i, its own model ``θ_i`` (the one it trained last; the global model before its first round)::

    server   sends θ_n for the M peers n it ranks highest in P[i] (ε-greedy: with probability ε_t a random one)
    client   w_n = (L_i(θ_i) − L_i(θ_n)) / (‖θ_n − θ_i‖ + 1e-5)          (L_i: mean CE on i's validation split)
             θ_i ← Σ_n w̄_n θ_n,  w̄ = max(w, 0) / Σ max(w, 0)              (kept as it is when no w_n > 0)
             local training from θ_i; upload θ_i and the raw w_n
    server   stores θ_i (it is what i, and its peers, are sent next), P[i, n] += w_n

``P`` starts as the identity; ``ε_t = max(ε − (t−1)·ε_decay, 0)``. The client part (``fedfomo``) implies the server
plug-in (``fomo``: every participant's stored model is its upload; the global model, which only the ``global_`` views
and newcomers see, is the weighted mean of the uploads). The personalized model is the client's own (its upload).
FedFomo needs a validation split (``validation``, PFLlib's ``val_ratio``: 0.2).

Read against the paper (Algorithm 1, Eq. 6) and PFLlib's ``clientfomo.py``/``serverfomo.py`` (defaults M = 5, no
exploration: ``epsilon=0``; the official NVlabs scripts explore with ``ε = 0.3`` decaying by 0.05 a round).
Departures, named: peers are ranked among the clients whose models the server holds (PFLlib: among all, the
never-trained holding the initial model; the same once every client has trained), ties broken by a seeded draw;
``anchor="trained"`` compares the peers with the model the client trained last (the paper's ``θ_i^{t−1}``), and
``anchor="start"`` with the model it started its last training from (PFLlib's ``old_model``); the validation loss is
the mean over samples (PFLlib: over batches); a newcomer starts from the global model (PFLlib: the initial one).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor

from fedskew.client.batched_form import BatchedStep
from fedskew.client.kernels import forward_with
from fedskew.client.local import LocalAlgorithm, LocalContext, Phase, StateKey
from fedskew.protocol import Params, RoundInput, ServerContext
from fedskew.registry import ClientPart, NoParams, ServerPlugin
from fedskew.schema import StrictSettings
from fedskew.seeding import Purpose, numpy_rng
from fedskew.server.api import ModelLookup, ServerHalf, ServerOutput, Weighting
from fedskew.server.combine import WeightedMean
from fedskew.server.personal import PersonalState, personal_models
from fedskew.space import Float, Int

PEER_IDS = "fomo_peer_ids"  # [M] int64: the peers a client is sent (download), then weighs (upload)
PEER_PREFIX = "fomo_peer."  # + entry name: [M, ...] the peers' models, stacked (download)
PEER_WEIGHTS = "fomo_weights"  # [M] float64: the raw w_n, in the order of PEER_IDS (upload)
FOMO_START = StateKey[Params]("fedfomo_start", "FedFomo (anchor=start): the model the client last started from")


# ---- server half: the affinities and who is sent what ---------------------------------------------------------------
class FomoState(NamedTuple):
    """``P`` as rows of the clients that have weighed peers (the diagonal 1 is implicit), who has a model on the
    server, and what the downloads read: the run's seed (the ε-greedy draws) and the trainable entries."""

    affinity: dict[int, dict[int, float]]
    stored: frozenset[int]
    seed: int
    trainable: tuple[str, ...]


def ranked_peers(
    row: Mapping[int, float], cid: int, stored: frozenset[int], m: int, eps: float, rng: np.random.Generator
) -> list[int]:
    """The ``m`` peers client ``cid`` is sent: in order of ``P[cid]`` (its own entry 1 plus what it added), ties in a
    random order; each pick, with probability ``eps``, a random remaining client instead (ε-greedy)."""
    candidates = sorted(stored)
    if not candidates or m == 0:
        return []
    tie = rng.random(len(candidates))
    score = [row.get(j, 0.0) + (1.0 if j == cid else 0.0) for j in candidates]
    order = [candidates[k] for k in np.lexsort((tie, -np.asarray(score)))]
    k = min(m, len(candidates))
    if eps == 0:  # no exploration: the top k (no draw but the ties')
        return order[:k]
    chosen: list[int] = []
    for _ in range(k):
        taken = set(chosen)
        if rng.random() < eps:
            rest = [j for j in order if j not in taken]
            chosen.append(rest[int(rng.integers(len(rest)))])
        else:
            chosen.append(next(j for j in order if j not in taken))
    return chosen


@dataclass(frozen=True)
class FomoServer(ServerHalf):
    """FedFomo's server half (module docstring): ``P``, and each client's download of its peers' models."""

    peers: int = 5
    epsilon: float = 0.0
    epsilon_decay: float = 0.0

    def init(self, ctx: ServerContext) -> FomoState:
        return FomoState({}, frozenset(), ctx.seed, tuple(sorted(ctx.trainable)))

    def advance(self, rin: RoundInput, state: FomoState) -> FomoState:
        affinity = {i: dict(row) for i, row in state.affinity.items()}
        if PEER_IDS in rin.extras:
            for k, cid in enumerate(rin.cids):
                row = affinity.setdefault(cid, {})
                ids, w = rin.extras[PEER_IDS][k].tolist(), rin.extras[PEER_WEIGHTS][k].tolist()
                for j, wj in zip(ids, w, strict=True):
                    row[int(j)] = row.get(int(j), 0.0) + float(wj)
        return state._replace(affinity=affinity, stored=state.stored | frozenset(rin.cids))

    def downloads(self, state: FomoState, cid: int, rnd: int, models: ModelLookup) -> Params:
        eps = max(self.epsilon - (rnd - 1) * self.epsilon_decay, 0.0)
        rng = numpy_rng(state.seed, Purpose.DOWNLOADS, rnd, cid)
        ids = ranked_peers(state.affinity.get(cid, {}), cid, state.stored, self.peers, eps, rng)
        held: list[Params] = []
        for j in ids:
            model = models(j)
            if model is None:
                raise RuntimeError(f"FedFomo: client {j} has trained, but the server holds no model for it")
            held.append(model)
        if not held:
            return {}
        out = {PEER_PREFIX + n: torch.stack([h[n] for h in held]) for n in state.trainable}
        out[PEER_IDS] = torch.tensor(ids, dtype=torch.int64)
        return out


# ---- server: each participant's model is its upload ------------------------------------------------------------------
@dataclass(frozen=True)
class OwnModels:
    """The ``fomo`` server step: every participant's model on the server is its upload; the global model is their
    weighted mean (the ``global_`` views', and a newcomer's)."""

    weighting: Weighting

    def init(self, ctx: ServerContext) -> PersonalState:
        return PersonalState(self.weighting.init(ctx))

    def aggregate(self, rin: RoundInput, state: PersonalState) -> tuple[ServerOutput, PersonalState]:
        weights, wstate = self.weighting(rin, None, state.weighting)
        mean, _, _ = WeightedMean()(rin, weights, None, None)
        return ServerOutput(mean, personal_models(rin, {}), {"weights": weights.tolist()}), PersonalState(wstate)


# ---- client ----------------------------------------------------------------------------------------------------------
def fomo_weights(own_loss: float, peer_losses: Tensor, distances: Tensor) -> Tensor:
    """``w_n = (L(θ_i) − L(θ_n)) / (‖θ_n − θ_i‖ + 1e-5)`` (float64, on the distances' device: the losses are host
    numbers, the distances the models' own, a GPU run's too)."""
    return (own_loss - peer_losses.double().to(distances.device)) / (distances.double() + 1e-5)


def combination(weights: Tensor) -> Tensor | None:
    """``max(w, 0)`` normalized to sum 1; ``None`` when no weight is positive (the client keeps its model)."""
    pos = weights.clamp_min(0)
    total = float(pos.sum())
    return pos / total if total > 0 else None


@dataclass
class FomoRound:
    """What :meth:`FedFomo.begin` computed: the peers it weighed and their raw weights (uploaded)."""

    ids: Tensor
    weights: Tensor
    start: Params | None  # the combined model local training starts from (None: the one received)


@dataclass
class FedFomo(LocalAlgorithm):
    """FedFomo's client (module docstring)."""

    state_keys = (FOMO_START,)
    needs_validation = True
    anchor: Literal["trained", "start"] = "trained"

    def _val_loss(self, ctx: LocalContext, params: Params) -> float:
        assert ctx.x_val is not None and ctx.y_val is not None
        was = ctx.model.training
        ctx.model.eval()
        with torch.no_grad():
            loss = F.cross_entropy(forward_with(ctx.model, params, ctx.x_val), ctx.y_val)
        ctx.model.train(was)
        return float(loss)

    def begin(self, ctx: LocalContext) -> None:
        ids = ctx.broadcast.get(PEER_IDS)
        if ids is None or ids.numel() == 0:
            ctx.prepared = FomoRound(torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.float64), None)
            return
        names = [n for n, p in ctx.model.named_parameters()]
        own = ctx.received if self.anchor == "trained" else (ctx.kept(FOMO_START) or ctx.received)
        own = {n: own[n] for n in names}
        peers = [{n: ctx.broadcast[PEER_PREFIX + n][m] for n in names} for m in range(ids.numel())]
        own_loss = self._val_loss(ctx, own)
        losses = torch.tensor([self._val_loss(ctx, p) for p in peers], dtype=torch.float64)
        dist = torch.stack(
            [torch.sqrt(sum(((p[n] - own[n]).double() ** 2).sum() for n in names)) for p in peers]  # type: ignore[misc]
        )
        w = fomo_weights(own_loss, losses, dist)
        mix = combination(w)
        start = None
        if mix is not None:
            start = dict(ctx.received)
            for n in names:
                stacked = ctx.broadcast[PEER_PREFIX + n]
                start[n] = torch.tensordot(mix.to(stacked.dtype), stacked, dims=1)
        ctx.prepared = FomoRound(ids, w, start)

    def phases(self, ctx: LocalContext) -> list[Phase]:
        start = ctx.prep(FomoRound).start
        if self.anchor == "start":
            ctx.keep(FOMO_START, {n: t.detach().clone() for n, t in (start or ctx.received).items()})
        return [Phase(ctx.settings.epochs, start=start)]

    def end(self, ctx: LocalContext) -> Params:
        r = ctx.prep(FomoRound)
        return {PEER_IDS: r.ids, PEER_WEIGHTS: r.weights} if r.ids.numel() else {}

    def batched_step(self) -> BatchedStep:
        return BatchedStep()  # plain steps from the combined start: the peers' passes (begin) run per client


# ---- registration ----------------------------------------------------------------------------------------------------
class FedFomoParams(StrictSettings):
    anchor: Literal["trained", "start"] = "trained"  # trained: the paper's θ_i^{t-1}; start: PFLlib's old_model
    peers: int = Field(5, ge=1)  # M, the models each client downloads (PFLlib: 5)
    epsilon: float = Field(0.0, ge=0, le=1)  # ε-greedy exploration (PFLlib: 0; official NVlabs script: 0.3)
    epsilon_decay: float = Field(0.0, ge=0)  # ε's decrease per round (official NVlabs script: 0.05)


CLIENTS: dict[str, ClientPart] = {
    "fedfomo": ClientPart(
        "fedfomo",
        "downloads M peer models, combines them by their validation-loss gain per distance, trains from the "
        "combination (peers=5; needs --validation; implies fomo)",
        "Zhang et al., Personalized Federated Learning with First Order Model Optimization, ICLR 2021",
        FedFomoParams,
        lambda p: FedFomo(anchor=p.anchor),
        server_half=lambda p: FomoServer(peers=p.peers, epsilon=p.epsilon, epsilon_decay=p.epsilon_decay),
        implies=("fomo",),
        personalized=True,
        tunable={"peers": Int(1, 10), "epsilon": Float(0.0, 0.5)},
    ),
}
SERVER_PLUGINS: dict[str, ServerPlugin] = {
    "fomo": ServerPlugin(
        "fomo",
        "FedFomo's server: every participant's model is its upload (sent to it and to the peers that download it)",
        "Zhang et al., Personalized Federated Learning with First Order Model Optimization, ICLR 2021",
        NoParams,
        ("personalize",),
        lambda p: {"personalize": lambda w: OwnModels(weighting=w)},
        clients=("fedfomo",),
    ),
}
