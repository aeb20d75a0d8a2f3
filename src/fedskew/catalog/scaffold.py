"""SCAFFOLD (Karimireddy, Kale, Mohri, Reddi, Stich, Suresh, ICML 2020): control variates correct the local steps.

Option II control variates, global learning rate 1, as FedDisco's code runs it. One round::

    server:    broadcast c                                                   (SCAFFOLD_C, one tensor per parameter)
    client i:  every local step:  SGD step, then w ← w − lr·(c − c_i)        (the shift, outside the momentum)
               after K steps:     c_i⁺ = c_i − c + (w_received − w)/(K·lr);  upload Δc_i = c_i⁺ − c_i  (SCAFFOLD_DELTA)
    server:    c ← c + (1/N) Σ_{participants} Δc_i                           (N: all clients, FedDisco's code)
               control_weights=samples: c ← c + (|S|/N) Σ_{i∈S} (n_i / Σ_{j∈S} n_j) Δc_i  (Flower's niid_bench)
               the model: whatever server aggregation the method has (uniform mean by default, the paper's)

Everything SCAFFOLD is lives here: the tensors it exchanges, its client part (:class:`Scaffold`, with its batched
form), its server half (:class:`ScaffoldServer`) and its registration (``CLIENTS``).

Why a shift after the step and not a gradient term: with plain SGD the two are identical. With momentum β a
gradient term goes through the momentum buffer and moves the model by about ``lr·(c − c_i)/(1 − β)`` per step,
and the option-II estimate then returns that amplified correction into ``c_i⁺`` (a feedback of gain about
``β/(1 − β)``: 9 at β = 0.9, which diverges). With the shift, ``K`` steps move the model by
``lr·Σ_t d_t + K·lr·(c − c_i)``, where ``d_t`` is the optimizer's direction at step t (the momentum buffer of the
raw gradients, weight decay included; ``d_t = g_t`` for plain SGD), so the estimate is
``c_i⁺ = (1/K) Σ_t d_t``: the client's mean update direction, which contains no correction (no feedback). With
momentum it is about ``ḡ/(1 − β)``, the same units in which the optimizer moves the model by the gradient, so
``lr·(c − c_i)`` keeps replacing the client's mean drift by the federation's, as SCAFFOLD intends.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
from torch import Tensor, nn

from fedskew.client.batched_form import BatchedStep, Shift
from fedskew.client.local import LocalAlgorithm, LocalContext, StateKey
from fedskew.protocol import Params, RoundInput, ServerContext
from fedskew.registry import ClientPart, ServerPlugin
from fedskew.schema import StrictSettings
from fedskew.server.api import ServerHalf

# the tensors the two halves exchange (a trailing "/": one tensor per trainable entry n, named PREFIX + n)
SCAFFOLD_C = "scaffold_c/"  # broadcast: the global control variate c
SCAFFOLD_DELTA = "scaffold_dc/"  # upload: the client's control delta c_i⁺ − c_i
CLIENT_CI = StateKey[Params]("scaffold_ci", "the client's control variate c_i")  # client state


def _trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


# ---- client ----------------------------------------------------------------------------------------------------------
@dataclass
class ScaffoldRound:
    """What :meth:`Scaffold.begin` prepares: the trained parameters, ``c − c_i`` per parameter, the shift's scale
    (``−lr``) and the received ``c``."""

    params: list[Tensor]
    correction: list[Tensor]
    scale: float
    c: Params


@dataclass
class Scaffold(LocalAlgorithm):
    """SCAFFOLD's client: the shift ``−lr·(c − c_i)`` after each optimizer step, then ``c_i⁺`` and the uploaded
    ``Δc_i`` (module docstring)."""

    state_keys = (CLIENT_CI,)

    def begin(self, ctx: LocalContext) -> None:
        names = [n for n, _ in _trainable(ctx.model)]
        c_i = ctx.kept(CLIENT_CI) or {n: torch.zeros_like(ctx.received[n]) for n in names}
        ctx.keep(CLIENT_CI, c_i)
        c = {n: ctx.broadcast.get(f"{SCAFFOLD_C}{n}", torch.zeros_like(ctx.received[n])) for n in names}
        params = [p for _, p in _trainable(ctx.model)]
        ctx.prepared = ScaffoldRound(params, [c[n] - c_i[n] for n in names], -ctx.settings.lr, c)

    def after_step(self, ctx: LocalContext) -> None:
        prep = ctx.prep(ScaffoldRound)
        torch._foreach_add_(prep.params, prep.correction, alpha=prep.scale)

    def end(self, ctx: LocalContext) -> Params:
        c, c_i = ctx.prep(ScaffoldRound).c, ctx.held(CLIENT_CI)
        scale = 1.0 / (max(ctx.steps, 1) * ctx.settings.lr)
        extras, new_ci = {}, {}
        for n, p in _trainable(ctx.model):
            new_ci[n] = c_i[n] - c[n] + (ctx.received[n] - p.detach()) * scale
            extras[f"{SCAFFOLD_DELTA}{n}"] = new_ci[n] - c_i[n]
        ctx.keep(CLIENT_CI, new_ci)
        return extras

    def batched_step(self) -> BatchedStep:
        def shift(ctx: LocalContext) -> Shift:  # what begin prepared for after_step: w += −lr·(c − c_i)
            prep = ctx.prep(ScaffoldRound)
            return Shift(prep.correction, prep.scale)

        return BatchedStep(shift=shift)


# ---- server half -----------------------------------------------------------------------------------------------------
# how the server averages the control deltas: "uniform" (1/N each: the paper, NIID-Bench, FedDisco's code) or
# "samples" (by sample share, times |S|/N: Flower's baselines/niid_bench)
ControlWeights = Literal["uniform", "samples"]


class ControlState(NamedTuple):
    """A global control variate ``c`` (one tensor per trainable entry) over ``num_clients`` clients."""

    c: Params
    num_clients: int


@dataclass(frozen=True)
class ScaffoldServer(ServerHalf):
    """SCAFFOLD's server half: broadcasts ``c``; after a round ``c ← c + (1/N) Σ_{participants} Δc_i`` (N = all
    clients, as in the paper, NIID-Bench's and FedDisco's code), or with ``control_weights="samples"``
    ``c ← c + (|S|/N) Σ_{i∈S} (n_i / Σ_{j∈S} n_j) Δc_i`` (Flower's ``baselines/niid_bench``: its strategy averages the
    deltas by sample count, its server scales that by |S|/N). The two agree when the participants hold equal data."""

    control_weights: ControlWeights = "uniform"

    def init(self, ctx: ServerContext) -> ControlState:
        return ControlState({n: torch.zeros_like(ctx.template[n]) for n in ctx.trainable}, ctx.num_clients)

    def broadcast(self, state: ControlState) -> Params:
        return {f"{SCAFFOLD_C}{n}": t for n, t in state.c.items()}

    def advance(self, rin: RoundInput, state: ControlState) -> ControlState:
        if self.control_weights == "uniform":
            return self.advance_sums({k: t.sum(0) for k, t in rin.extras.items()}, state)
        share = rin.num_samples / rin.num_samples.sum()  # [K] float64, the participants' sample shares
        k = rin.num_participants
        sums = {
            key: k * torch.tensordot(share.to(device=t.device, dtype=t.dtype), t, dims=1)
            for key, t in rin.extras.items()
            if key.startswith(SCAFFOLD_DELTA)
        }
        return self.advance_sums(sums, state)

    # under DP the server sees only the noised sum of the control deltas, which is all the uniform ``advance`` reads
    # (the sample-weighted one reads each client's delta beside its size, so streaming and DP refuse it by name)
    @property
    def private(self) -> bool:  # type: ignore[override]
        return self.control_weights == "uniform"

    def summed_extras(self, ctx: ServerContext) -> Params:
        return {f"{SCAFFOLD_DELTA}{n}": torch.zeros_like(ctx.template[n]) for n in sorted(ctx.trainable)}

    def advance_sums(self, sums: Params, state: ControlState) -> ControlState:
        n_all = state.num_clients
        c = {n: t + sums[f"{SCAFFOLD_DELTA}{n}"] / n_all for n, t in state.c.items()}
        return ControlState(c, n_all)


# ---- registration ----------------------------------------------------------------------------------------------------
class ScaffoldParams(StrictSettings):
    control_weights: ControlWeights = "uniform"  # see ControlWeights


CLIENTS: dict[str, ClientPart] = {
    "scaffold": ClientPart(
        "scaffold",
        "control variates correct local steps (option II; control deltas averaged over all N; weights=uniform)",
        "Karimireddy et al., SCAFFOLD: Stochastic Controlled Averaging for Federated Learning, ICML 2020",
        ScaffoldParams,
        lambda p: Scaffold(),
        server_half=lambda p: ScaffoldServer(p.control_weights),
        weights="uniform",
    ),
}
SERVER_PLUGINS: dict[str, ServerPlugin] = {}
