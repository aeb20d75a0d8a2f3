"""FedDyn and FedDC, the drift-correcting hosts of the FedDisco paper, whole: client parts, server halves, cloud step.

Both keep per-client state across rounds (in ``ctx.client_state``, so it is checkpointed and survives rounds a
client misses), pull the local model towards a client-specific anchor, and clip the gradient norm (10, as both
official codes do). Their server model is the "cloud model" of :class:`CloudCorrection` (the ``cloud`` plug-in,
implied by both): the weighted average plus the mean over all N clients of their accumulated updates,
``s ← s + (1/N) Σ_{k∈P_t} (w_k − w^t)``, ``w^{t+1} = w̄ + s``. This is FedDyn's ``θ^t = mean − h^t/α`` (Acar et al.,
Algorithm 1: ``h`` changes by ``−α/N·Σ(w_k − w^t)``, so ``−h/α = s``) and FedDC's ``w̄ + mean_i h_i`` (official
code; ``h_i`` is client i's accumulated drift). Both average uniformly (as both official codes), and compose with
``+disco`` the way FedDisco's code does it (spec §2.3): Disco changes only ``w̄``; ``s`` keeps its ``1/N``.

Everything of the two methods lives here: the tensors they exchange, the client parts (with their batched forms),
their server halves (:class:`FedDynServer`, :class:`FedDCServer`), the cloud step and their registration.

* :class:`FedDyn` (Acar et al., ICLR 2021, Algorithm 1): client k minimizes
  ``L_k(θ) − ⟨g_k, θ⟩ + (α_k/2)‖θ − w^t‖²`` from the received ``w^t``; afterwards ``g_k ← g_k − α_k(θ_k − w^t)``
  (so ``g_k = ∇L_k(θ_k)`` at the local optimum: the dynamic regularizer's linear term).
* :class:`FedDC` (Gao et al., CVPR 2022): client i keeps a drift ``h_i`` and a local control variate ``c_i``;
  it minimizes ``L_i(θ) + (α_i/2)‖θ − (w^t − h_i)‖² + ⟨θ, c/ω_i − c_i⟩`` (the last term is the gradient correction
  of SCAFFOLD's form); afterwards ``h_i ← h_i + (θ_i − w^t)`` and ``c_i⁺ = c_i − c/ω_i + (w^t − θ_i)/(K·lr)``
  (K local steps), uploading ``Δc_i = c_i⁺ − c_i``; the server keeps ``c ← c + (1/N)Σ ω_i Δc_i``.

``α_k = α/ω_k`` with ``ω_k = n_k / mean_j n_j`` (``size_scaling``, both official codes; 1 for a client of average
size). The mean client size is broadcast by the client part's server half (:class:`FedDynServer`,
:class:`FedDCServer`, which also keeps FedDC's global ``c``).

How the hooks carry the objectives: the regularizers' gradients (``α_k(θ − anchor) − g_k``) are added in
``after_backward`` before clipping, and the returned loss stays the plain cross-entropy, so ``train_loss`` is
comparable across methods. FedDC's correction ``c/ω_i − c_i`` is applied as a shift of the parameters right after
each optimizer step (``θ ← θ − lr·(c/ω_i − c_i)``), as fedskew's SCAFFOLD does: identical to the gradient term for
plain SGD, and with local momentum it does not pass through the momentum buffer, whose amplification would
otherwise feed back through ``c_i⁺`` (see :mod:`fedskew.catalog.scaffold`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch
from pydantic import Field
from torch import Tensor, nn

from fedskew import registry
from fedskew.client.batched_form import BatchedStep, Pull, Shift
from fedskew.client.local import LocalAlgorithm, LocalContext, StateKey
from fedskew.protocol import Params, RoundInput, ServerContext
from fedskew.registry import ClientPart, NoParams, ServerPlugin
from fedskew.schema import ConfigError, StrictSettings
from fedskew.server.api import Composition, Diagnostics, ServerHalf, ServerStep
from fedskew.server.combine import weighted_sums
from fedskew.space import LogFloat

# the tensors the client parts and their server halves exchange (a trailing "/": one tensor per trainable entry)
FEDDYN_MEAN_SAMPLES = "feddyn/mean_samples"  # broadcast, FedDyn: the mean training-set size over all clients
FEDDC_MEAN_SAMPLES = "feddc/mean_samples"  # broadcast, FedDC: the same, for its size weights
FEDDC_C = "feddc_c/"  # broadcast, FedDC: the global control variate c
FEDDC_DELTA = "feddc_dc/"  # upload, FedDC: the client's control delta
# what the clients keep across rounds (client state)
FEDDYN_GRAD = StateKey[Params]("feddyn_grad", "FedDyn: the client's accumulated gradient g_k")
FEDDC_DRIFT = StateKey[Params]("feddc_drift", "FedDC: the client's local drift h_i")
FEDDC_CI = StateKey[Params]("feddc_ci", "FedDC: the client's control variate c_i")


# ---- client ----------------------------------------------------------------------------------------------------------
def _trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def size_weight(ctx: LocalContext, key: str) -> float:
    """``ω_k = n_k / mean_j n_j``: this client's training-set size over the federation's mean (broadcast)."""
    mean = ctx.broadcast.get(key)
    if mean is None or ctx.x is None:
        raise ValueError(f"the client needs the server's broadcast {key!r} (mean client size) and its data")
    return ctx.x.shape[0] / float(mean)


def add_pull(params: list[nn.Parameter], anchors: list[Tensor], alpha: float, linear: list[Tensor] | None) -> None:
    """``grad += α(θ − anchor) − linear`` for each parameter: the gradient of ``(α/2)‖θ − anchor‖² − ⟨linear, θ⟩``."""
    with torch.no_grad():
        grads = []
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        if alpha != 0:
            torch._foreach_add_(grads, torch._foreach_sub(params, anchors), alpha=alpha)
        if linear is not None:
            torch._foreach_sub_(grads, linear)


def _clip(params: list[nn.Parameter], clip: float) -> None:
    if clip > 0:
        torch.nn.utils.clip_grad_norm_(params, clip)


def _zeros(ctx: LocalContext) -> Params:
    return {n: torch.zeros_like(p, memory_format=torch.contiguous_format).detach() for n, p in _trainable(ctx.model)}


@dataclass
class DriftRound:
    """What FedDyn's and FedDC's ``begin`` prepare: the trained parameters, the anchors and weight ``α`` of the pull
    towards them, FedDyn's linear term ``g_k`` per parameter; FedDC's received ``c/ω_i`` and its shift
    ``c/ω_i − c_i`` (with ``correction``)."""

    params: list[nn.Parameter]
    anchors: list[Tensor]
    alpha: float
    linear: list[Tensor] | None = None
    c: Params = field(default_factory=dict)
    shift: list[Tensor] | None = None


@dataclass
class FedDyn(LocalAlgorithm):
    """FedDyn's client: the dynamic regularizer ``−⟨g_k, θ⟩ + (α_k/2)‖θ − w^t‖²`` with state ``g_k`` (starts at 0).

    Defaults: α = 0.01 (FedDisco's code, ``alpha_coef = 1e-2``; Acar et al. tune α ∈ {0.1, 0.01, 0.001}),
    ``size_scaling`` on and gradient-norm clip 10 (both official codes). α = 0 with clip = 0 is plain local SGD.
    """

    state_keys = (FEDDYN_GRAD,)
    alpha: float = 0.01
    size_scaling: bool = True
    clip: float = 10.0

    def alpha_for(self, ctx: LocalContext) -> float:
        return self.alpha / size_weight(ctx, FEDDYN_MEAN_SAMPLES) if self.size_scaling else self.alpha

    def begin(self, ctx: LocalContext) -> None:
        named = _trainable(ctx.model)
        g = ctx.kept(FEDDYN_GRAD) or _zeros(ctx)
        ctx.keep(FEDDYN_GRAD, g)
        alpha = self.alpha_for(ctx)
        params = [p for _, p in named]
        anchors = [ctx.received[n] for n, _ in named]
        ctx.prepared = DriftRound(params, anchors, alpha, [g[n] for n, _ in named])

    def after_backward(self, ctx: LocalContext) -> None:
        prep = ctx.prep(DriftRound)
        add_pull(prep.params, prep.anchors, prep.alpha, prep.linear)
        _clip(prep.params, self.clip)

    def batched_step(self) -> BatchedStep:
        def pull(ctx: LocalContext) -> Pull:  # what begin prepared for after_backward: received w^t, α_k, g_k
            prep = ctx.prep(DriftRound)
            return Pull(float(prep.alpha), list(prep.anchors), None if prep.linear is None else list(prep.linear))

        return BatchedStep(pull=pull, clip=float(self.clip))

    def end(self, ctx: LocalContext) -> Params:
        alpha = ctx.prep(DriftRound).alpha
        g = ctx.held(FEDDYN_GRAD)
        ctx.keep(FEDDYN_GRAD, {n: g[n] - alpha * (p.detach() - ctx.received[n]) for n, p in _trainable(ctx.model)})
        return {}


@dataclass
class FedDC(LocalAlgorithm):
    """FedDC's client: local drift ``h_i`` (penalty ``(α_i/2)‖θ − (w^t − h_i)‖²``) and, with ``correction``, the
    gradient correction ``c/ω_i − c_i`` with SCAFFOLD-style control variates; server half (``FedDCServer``): the
    global ``c``.

    Defaults: α = 0.01 (FedDisco's code; the FedDC code's CIFAR examples use 0.1 and 0.01), ``size_scaling`` on,
    clip 10 (both codes), ``correction`` on (paper and FedDC code; FedDisco's code computes the correction but never
    adds it to the loss: ``correction=False`` reproduces that, and then no control variate travels).
    """

    state_keys = (FEDDC_DRIFT, FEDDC_CI)
    alpha: float = 0.01
    size_scaling: bool = True
    clip: float = 10.0
    correction: bool = True

    def begin(self, ctx: LocalContext) -> None:
        named = _trainable(ctx.model)
        omega = size_weight(ctx, FEDDC_MEAN_SAMPLES) if self.size_scaling else 1.0
        h = ctx.kept(FEDDC_DRIFT) or _zeros(ctx)
        ctx.keep(FEDDC_DRIFT, h)
        params = [p for _, p in named]
        anchors = [ctx.received[n] - h[n] for n, _ in named]
        ctx.prepared = prep = DriftRound(params, anchors, self.alpha / omega)
        if self.correction:
            c_i = ctx.kept(FEDDC_CI) or _zeros(ctx)
            ctx.keep(FEDDC_CI, c_i)
            prep.c = {n: ctx.broadcast[f"{FEDDC_C}{n}"] / omega for n, _ in named}
            prep.shift = [prep.c[n] - c_i[n] for n, _ in named]

    def after_backward(self, ctx: LocalContext) -> None:
        prep = ctx.prep(DriftRound)
        add_pull(prep.params, prep.anchors, prep.alpha, None)
        _clip(prep.params, self.clip)

    def after_step(self, ctx: LocalContext) -> None:
        prep = ctx.prep(DriftRound)
        if self.correction and prep.shift is not None:
            torch._foreach_add_(prep.params, prep.shift, alpha=-ctx.settings.lr)

    def batched_step(self) -> BatchedStep:
        def pull(ctx: LocalContext) -> Pull:  # begin: w^t − h_i and α_i
            prep = ctx.prep(DriftRound)
            return Pull(float(prep.alpha), list(prep.anchors), None)

        def shift(ctx: LocalContext) -> Shift | None:  # after_step with correction: θ ← θ − lr·(c/ω_i − c_i)
            prep = ctx.prep(DriftRound)
            return None if prep.shift is None else Shift(list(prep.shift), -float(ctx.settings.lr))

        return BatchedStep(pull=pull, clip=float(self.clip), shift=shift)

    def end(self, ctx: LocalContext) -> Params:
        named = _trainable(ctx.model)
        delta = {n: p.detach() - ctx.received[n] for n, p in named}
        h = ctx.held(FEDDC_DRIFT)
        ctx.keep(FEDDC_DRIFT, {n: h[n] + delta[n] for n, _ in named})
        if not self.correction:
            return {}
        c, c_i = ctx.prep(DriftRound).c, ctx.held(FEDDC_CI)
        scale = 1.0 / (max(ctx.steps, 1) * ctx.settings.lr)
        new_ci = {n: c_i[n] - c[n] - delta[n] * scale for n, _ in named}
        ctx.keep(FEDDC_CI, new_ci)
        return {f"{FEDDC_DELTA}{n}": new_ci[n] - c_i[n] for n, _ in named}


# ---- server halves ---------------------------------------------------------------------------------------------------
def mean_client_size(num_train: np.ndarray) -> float:
    """The mean training-set size over all clients (FedDyn's and FedDC's size weights ``ω_k = n_k / mean``)."""
    return float(num_train.sum()) / max(len(num_train), 1)


class MeanSize(NamedTuple):
    mean_samples: float


@dataclass(frozen=True)
class FedDynServer(ServerHalf):
    """FedDyn's server half (:class:`FedDyn`): broadcasts the mean client size its clients scale their ``α`` by. (Its
    server model is the ``cloud`` step, :class:`CloudCorrection`.)"""

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
    """FedDC's server half (:class:`FedDC`): broadcasts the mean client size and, with
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


# ---- the server model: the cloud step --------------------------------------------------------------------------------
class CloudState(NamedTuple):
    """FedDyn's / FedDC's accumulated mean delta ``s`` (trainable float tensors) over ``num_clients`` clients."""

    s: Params
    num_clients: int


@dataclass(frozen=True)
class CloudCorrection(ServerStep):
    """FedDyn's and FedDC's server model (a ``step`` piece): ``w^{t+1} = w̄ + s`` over the trainable parameters,
    ``s ← s + (1/N) Σ_{k∈P_t} (w_k − w^t)`` (N: every client of the federation; absent clients add nothing).
    Buffers take the combined value. State: :class:`CloudState`.

    ``clients``: the client parts it belongs to (the registry passes those that imply it)."""

    clients: tuple[str, ...] = ("feddyn", "feddc")

    def check_composition(self, comp: Composition) -> None:
        """Without FedDyn's or FedDC's client regularizer the accumulated mean delta grows without bound."""
        if comp.client not in self.clients:
            raise ConfigError(
                f"method {comp.method!r}: 'cloud' is the server side of {' and '.join(self.clients)} (implied by "
                f"them); with the {comp.client!r} client nothing keeps its accumulated correction bounded"
            )

    def init(self, ctx: ServerContext) -> CloudState:
        names = sorted(n for n in ctx.trainable if ctx.template[n].is_floating_point())
        return CloudState({n: torch.zeros_like(ctx.template[n]) for n in names}, int(ctx.num_clients))

    def __call__(
        self, rin: RoundInput, params: Params, weights: Tensor, state: CloudState
    ) -> tuple[Params, Diagnostics, CloudState]:
        n_all = state.num_clients
        out = dict(params)
        s_new: Params = {}
        sq = 0.0
        for name, s in state.s.items():
            stacked = rin.params[name]
            k = stacked.shape[0]
            total, _ = weighted_sums(stacked.reshape(k, -1), torch.full((k,), 1.0 / n_all, dtype=torch.float64))
            w = rin.global_params[name].to(device=total.device, dtype=torch.float64).reshape(-1)
            s64 = s.to(torch.float64).reshape(-1) + total - (k / n_all) * w
            s_new[name] = s64.reshape(s.shape).to(s.dtype)
            out[name] = (params[name].to(torch.float64) + s_new[name].to(torch.float64)).to(params[name].dtype)
            sq += float((s64**2).sum())
        return out, {"cloud_correction_norm": sq**0.5}, CloudState(s_new, n_all)


# ---- registration ----------------------------------------------------------------------------------------------------
class FedDynParams(StrictSettings):
    alpha: float = Field(0.01, ge=0)  # FedDisco's code (alpha_coef = 1e-2); Acar et al. tune {0.1, 0.01, 0.001}
    size_scaling: bool = True  # alpha_k = alpha / (n_k / mean n): both official codes
    clip: float = Field(10.0, ge=0)  # gradient-norm clip of both official codes; 0: none


class FedDCParams(StrictSettings):
    alpha: float = Field(0.01, ge=0)  # FedDisco's code (alpha_coef = 1e-2); FedDC's code 0.1 / 0.01
    size_scaling: bool = True
    clip: float = Field(10.0, ge=0)
    correction: bool = True  # paper and FedDC's code; False: FedDisco's code (correction computed, never applied)


def _cloud_clients() -> tuple[str, ...]:
    """The registered client parts whose server model is the cloud model (those that imply it)."""
    return tuple(name for name, part in registry.CLIENTS.items() if "cloud" in part.implies)


def _excludes(host: str) -> tuple[tuple[str, str], ...]:
    return (
        ("local", "every entry stays on the clients, so there is no global model to regularize towards"),
        (
            "fedavgm",
            f"{host}'s server step is its cloud model (average + correction); momentum on top of it is "
            "defined by neither paper",
        ),
    )


CLIENTS: dict[str, ClientPart] = {
    "feddyn": ClientPart(
        "feddyn",
        "dynamic regularizer -<g_k, w> + (alpha_k/2)||w - w_global||^2 with per-client g_k (alpha=0.01, clip=10); "
        "server: uniform mean + mean accumulated update (implies cloud)",
        "Acar et al., Federated Learning Based on Dynamic Regularization, ICLR 2021",
        FedDynParams,
        lambda p: FedDyn(alpha=p.alpha, size_scaling=p.size_scaling, clip=p.clip),
        server_half=lambda p: FedDynServer(),
        implies=("cloud",),
        excludes=_excludes("FedDyn"),
        tunable={"alpha": LogFloat(1e-3, 0.1)},  # Acar et al. tune {0.1, 0.01, 0.001}
        weights="uniform",
    ),
    "feddc": ClientPart(
        "feddc",
        "local drift h_i: (alpha_i/2)||w - (w_global - h_i)||^2 + gradient correction c - c_i (alpha=0.01, clip=10); "
        "server: uniform mean + mean drift (implies cloud)",
        "Gao et al., FedDC: Federated Learning with Non-IID Data via Local Drift Decoupling and Correction, CVPR 2022",
        FedDCParams,
        lambda p: FedDC(alpha=p.alpha, size_scaling=p.size_scaling, clip=p.clip, correction=p.correction),
        server_half=lambda p: FedDCServer(correction=p.correction, size_scaling=p.size_scaling),
        implies=("cloud",),
        excludes=_excludes("FedDC"),
        tunable={"alpha": LogFloat(1e-3, 0.1)},  # FedDC's code 0.1 / 0.01, FedDisco's 0.01
        weights="uniform",
    ),
}

SERVER_PLUGINS: dict[str, ServerPlugin] = {
    "cloud": ServerPlugin(
        "cloud",
        "FedDyn's/FedDC's server model: average + (1/N) sum of all clients' accumulated updates (implied by them)",
        "Acar et al., ICLR 2021 (Algorithm 1); Gao et al., CVPR 2022 (official code)",
        NoParams,
        ("step",),
        lambda p: {"step": CloudCorrection(clients=_cloud_clients())},
    ),
}
