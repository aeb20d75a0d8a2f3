"""The server halves of client parts (:class:`~fedskew.server.api.ServerHalf`): what the server keeps, broadcasts
and advances for SCAFFOLD, FedDyn, FedDC and the prototype hosts (FedGen's is in ``server/fedgen.py``).

Each client part's objective is in ``fedskew/client/``; the two halves share only the names of the tensors they
exchange (``fedskew/protocol.py``: :data:`~fedskew.protocol.SCAFFOLD_C`, ...). The registry pairs them
(``ClientPart.server_half``), and the engine advances a half with the round's uploads before the aggregation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple

import numpy as np
import torch
from torch import Tensor

from fedskew.protocol import (
    FEDDC_C,
    FEDDC_DELTA,
    FEDDC_MEAN_SAMPLES,
    FEDDYN_MEAN_SAMPLES,
    GLOBAL_PRESENT,
    GLOBAL_PROTOS,
    PROTO_COUNT,
    PROTO_MEAN,
    SCAFFOLD_C,
    SCAFFOLD_DELTA,
    Params,
    RoundInput,
    ServerContext,
)
from fedskew.server.api import ServerHalf


def mean_client_size(num_train: np.ndarray) -> float:
    """The mean training-set size over all clients (FedDyn's and FedDC's size weights ``ω_k = n_k / mean``)."""
    return float(num_train.sum()) / max(len(num_train), 1)


# ---- SCAFFOLD ---------------------------------------------------------------------------------------------------
class ControlState(NamedTuple):
    """A global control variate ``c`` (one tensor per trainable entry) over ``num_clients`` clients."""

    c: Params
    num_clients: int


@dataclass(frozen=True)
class ScaffoldServer(ServerHalf):
    """SCAFFOLD's server half (:class:`fedskew.client.algorithms.Scaffold`): broadcasts ``c``; after a round
    ``c ← c + (1/N) Σ_{participants} Δc_i`` (N = all clients, as in FedDisco's code)."""

    def init(self, ctx: ServerContext) -> ControlState:
        return ControlState({n: torch.zeros_like(ctx.template[n]) for n in ctx.trainable}, ctx.num_clients)

    def broadcast(self, state: ControlState) -> Params:
        return {f"{SCAFFOLD_C}{n}": t for n, t in state.c.items()}

    def advance(self, rin: RoundInput, state: ControlState) -> ControlState:
        n_all = state.num_clients
        c = {n: t + rin.extras[f"{SCAFFOLD_DELTA}{n}"].sum(0) / n_all for n, t in state.c.items()}
        return ControlState(c, n_all)


# ---- FedDyn / FedDC ---------------------------------------------------------------------------------------------
class MeanSize(NamedTuple):
    mean_samples: float


@dataclass(frozen=True)
class FedDynServer(ServerHalf):
    """FedDyn's server half (:class:`fedskew.client.drift.FedDyn`): broadcasts the mean client size its clients
    scale their ``α`` by. (Its server model is the ``cloud`` step, ``server/optimizers.py``.)"""

    def init(self, ctx: ServerContext) -> MeanSize:
        return MeanSize(mean_client_size(ctx.num_train))

    def broadcast(self, state: MeanSize) -> Params:
        return {FEDDYN_MEAN_SAMPLES: torch.tensor(state.mean_samples, dtype=torch.float64)}


class FedDCState(NamedTuple):
    c: Params  # the global control variate (empty without ``correction``)
    num_clients: int
    mean_samples: float


@dataclass(frozen=True)
class FedDCServer(ServerHalf):
    """FedDC's server half (:class:`fedskew.client.drift.FedDC`): broadcasts the mean client size and, with
    ``correction``, the global control variate, ``c ← c + (1/N) Σ_{i∈P_t} ω_i Δc_i`` (FedDC's code; N: all clients;
    ``ω_i = n_i / mean`` with ``size_scaling``, else 1)."""

    correction: bool = True
    size_scaling: bool = True

    def init(self, ctx: ServerContext) -> FedDCState:
        c = {n: torch.zeros_like(ctx.template[n]) for n in sorted(ctx.trainable)} if self.correction else {}
        return FedDCState(c, int(ctx.num_clients), mean_client_size(ctx.num_train))

    def broadcast(self, state: FedDCState) -> Params:
        out = {f"{FEDDC_C}{n}": t for n, t in state.c.items()}
        out[FEDDC_MEAN_SAMPLES] = torch.tensor(state.mean_samples, dtype=torch.float64)
        return out

    def advance(self, rin: RoundInput, state: FedDCState) -> FedDCState:
        if not self.correction:
            return state
        omega = rin.num_samples.to(torch.float64) / state.mean_samples if self.size_scaling else None
        c = {}
        for n, t in state.c.items():
            dc = rin.extras[f"{FEDDC_DELTA}{n}"]
            w = torch.ones(dc.shape[0], dtype=torch.float64) if omega is None else omega
            total = torch.tensordot(w.to(device=dc.device, dtype=dc.dtype), dc, dims=1)
            c[n] = t + total / state.num_clients
        return state._replace(c=c)


# ---- FedProto / FedProc -----------------------------------------------------------------------------------------
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
    """FedProto's and FedProc's server half (:mod:`fedskew.client.prototypes`): the per-class average of the
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
