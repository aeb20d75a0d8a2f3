"""Server optimizers of the FedDisco paper's hosts: FedAvgM's momentum, FedNova's normalized averaging, and the
"cloud model" correction of FedDyn and FedDC.

* :func:`fedavgm` (role ``step``): FedAvgM (Hsu et al., 2019) as a :class:`~fedskew.server.api.Descent` chain. The
  combined model ``w̄`` defines the pseudo-gradient ``g = w^t − w̄``; a momentum transform keeps a buffer ``v`` and
  :class:`Scale` the server learning rate η: ``w^{t+1} = w^t − η·v``. ``form="ema"`` is FedDisco's code,
  :class:`Ema` ``v ← m·v + (1 − m)·g``; ``form="hsu"`` is Hsu et al.'s heavy ball, :class:`Trace` ``v ← m·v + g``.
  The two are the same method in two parameterizations (``ema`` with η equals ``hsu`` with ``η·(1 − m)``); both are
  offered so that a value from either source can be used as written.
* :class:`NovaCombine` (role ``combine``): FedNova (Wang et al., NeurIPS 2020). Each client's update is divided by
  its normalizer ``a_k`` (its local step count ``τ_k``, from ``RoundInput.metrics["steps"]``), and the weighted mean
  of the normalized updates is scaled back by ``τ_eff = Σ_k p_k a_k``:
  ``w^{t+1} = w^t + Σ_k (p_k τ_eff / a_k)(w_k − w^t)``, with ``p_k`` the weighting's weights (sample shares, or
  Disco's: "Disco re-weighting before FedNova's normalization", spec §2.3).
* :class:`CloudCorrection` (role ``step``, implied by the ``feddyn`` and ``feddc`` client parts): the server model
  is the weighted average plus the mean over all N clients of their accumulated updates,
  ``s ← s + (1/N) Σ_{k∈P_t} (w_k − w^t)``, ``w^{t+1} = w̄ + s``. This is FedDyn's ``θ^t = mean − h^t/α`` (Acar et al.,
  Algorithm 1: ``h`` changes by ``−α/N·Σ(w_k − w^t)``, so ``−h/α = s``) and FedDC's ``w̄ + mean_i h_i`` (official
  code; ``h_i`` is client i's accumulated drift). Disco changes only ``w̄`` (spec §2.3); ``s`` keeps its ``1/N``.

Each piece is a small frozen dataclass with explicit, typed state (``init(ctx) -> state``); the arithmetic is in
float64 and the result is cast back to each tensor's dtype. FedNova's formulas are pure functions
(:func:`nova_normalizer`, :func:`nova_coefficients`) so tests check them against hand computations.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
from torch import Tensor

from fedskew.protocol import STEPS, Params, RoundInput, ServerContext, State
from fedskew.schema import ConfigError
from fedskew.server.api import (
    Combine,
    Composition,
    Descent,
    Diagnostics,
    GradientTransform,
    ServerStep,
    refuse_masks,
)
from fedskew.server.combine import weighted_sums


def _float_names(params: Params) -> list[str]:
    return [n for n, t in params.items() if t.is_floating_point()]


# ---- FedAvgM ----------------------------------------------------------------------------------------------------
class MomentumState(NamedTuple):
    """A momentum transform's buffer ``v``, one per floating state-dict entry, in the entry's dtype."""

    v: Params


def _check_momentum(momentum: float) -> None:
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"server momentum must be in [0, 1), got {momentum}")


@dataclass(frozen=True)
class _Momentum(GradientTransform):
    momentum: float = 0.9
    form: str = "ema"

    def __post_init__(self) -> None:
        _check_momentum(self.momentum)

    def init(self, ctx: ServerContext) -> MomentumState:
        return MomentumState({n: torch.zeros_like(ctx.template[n]) for n in _float_names(ctx.template)})

    def __call__(self, grads: Params, state: MomentumState) -> tuple[Params, Diagnostics, MomentumState]:
        m = self.momentum
        out: Params = {}
        v_new: Params = {}
        sq = 0.0
        for name, v in state.v.items():
            g = grads[name]
            out[name] = m * v.to(torch.float64) + ((1.0 - m) * g if self.form == "ema" else g)
            v_new[name] = out[name].to(v.dtype)
            sq += float((out[name] ** 2).sum())
        return out, {"momentum_norm": sq**0.5}, MomentumState(v_new)


@dataclass(frozen=True)
class Ema(_Momentum):
    """``v ← m·v + (1 − m)·g`` (FedDisco's FedAvgM; optax's ``ema`` without debiasing)."""

    form: str = "ema"


@dataclass(frozen=True)
class Trace(_Momentum):
    """``v ← m·v + g``, heavy-ball momentum (Hsu et al.'s FedAvgM; optax's ``trace``)."""

    form: str = "hsu"


@dataclass(frozen=True)
class Scale(GradientTransform):
    """``g ← lr·g``: the server learning rate."""

    lr: float = 1.0

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"server_lr must be positive, got {self.lr}")

    def __call__(self, grads: Params, state: State) -> tuple[Params, Diagnostics, State]:
        return {n: self.lr * g for n, g in grads.items()}, {}, state


def fedavgm(momentum: float = 0.9, server_lr: float = 1.0, form: Literal["ema", "hsu"] = "ema") -> Descent:
    """FedAvgM's server step: ``ema`` (or ``hsu``: ``trace``) momentum, then ``scale`` by the server learning rate,
    over every floating state-dict entry (FedDisco's code applies it to every key); integer buffers take the combined
    value. Diagnostic: ``fedavgm_momentum_norm``, the norm of the new buffer."""
    if form not in ("ema", "hsu"):
        raise ValueError(f"form must be 'ema' or 'hsu', got {form!r}")
    trace = Ema(momentum) if form == "ema" else Trace(momentum)
    return Descent((("momentum", trace), ("scale", Scale(server_lr))), prefix="fedavgm")


# ---- FedNova ----------------------------------------------------------------------------------------------------
def nova_normalizer(steps: Tensor, local_momentum: float = 0.0) -> Tensor:
    """FedNova's ``a_k = ‖a^{(k)}‖₁`` from the local step counts ``τ_k`` (``[K]`` float64).

    Plain local SGD: ``a_k = τ_k``. Local SGD with momentum ρ (FedNova paper, §5 / official code): the sum over the
    steps of the momentum buffer's accumulated weight ``(1 − ρ^t)/(1 − ρ)``, i.e.
    ``a_k = [τ_k − ρ(1 − ρ^{τ_k})/(1 − ρ)] / (1 − ρ)``."""
    tau = steps.to(torch.float64)
    if local_momentum == 0:
        return tau
    rho = local_momentum
    return (tau - rho * (1.0 - rho**tau) / (1.0 - rho)) / (1.0 - rho)


def nova_coefficients(weights: Tensor, normalizer: Tensor) -> tuple[Tensor, float]:
    """FedNova's per-client coefficients ``c_k = p_k·τ_eff / a_k`` and ``τ_eff = Σ_k p_k a_k``.

    ``w^{t+1} = (1 − Σ_k c_k)·w^t + Σ_k c_k·w_k``; with equal ``a_k`` the coefficients are the weights (FedAvg)."""
    p = weights.to(torch.float64)
    a = normalizer.to(device=p.device, dtype=torch.float64)
    if a.shape != p.shape:
        raise ValueError(f"FedNova needs one normalizer per client: weights {tuple(p.shape)}, a {tuple(a.shape)}")
    if not bool((a > 0).all()):
        raise ValueError(f"FedNova: every client must have taken at least one local step, got a = {a.tolist()}")
    tau_eff = float((p * a).sum())
    return p * tau_eff / a, tau_eff


@dataclass(frozen=True)
class NovaCombine(Combine):
    """FedNova's normalized averaging (a ``combine`` piece) over every floating state-dict entry, as FedDisco's
    code does for every key; integer buffers take the max (as :class:`~fedskew.server.combine.WeightedMean`).

    ``local_momentum`` is the clients' SGD momentum ρ that the normalizer assumes (0: ``a_k = τ_k``, FedDisco's
    code, which ignores its local momentum 0.9; set it to the run's ``--momentum`` for the FedNova paper's
    momentum normalizer)."""

    local_momentum: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.local_momentum < 1.0:
            raise ValueError(f"local_momentum must be in [0, 1), got {self.local_momentum}")

    def check_composition(self, comp: Composition) -> None:
        """FedNova rescales whole client deltas; element masks (HEAL's) have no place in its formula."""
        refuse_masks(comp, "FedNova's normalized averaging takes one weight per client")

    def __call__(
        self, rin: RoundInput, weights: Tensor, masks: Params | None, state: State
    ) -> tuple[Params, Diagnostics, State]:
        if masks is not None:
            raise ValueError("FedNova's combine does not take element masks")
        if STEPS not in rin.metrics:
            raise ValueError(
                "FedNova needs every client's local step count (RoundInput.metrics['steps']); "
                f"the uploads reported only {sorted(rin.metrics)}"
            )
        coef, tau_eff = nova_coefficients(weights, nova_normalizer(rin.metrics[STEPS], self.local_momentum))
        keep = 1.0 - float(coef.sum())
        out: Params = {}
        for name, stacked in rin.params.items():
            if not stacked.is_floating_point():
                out[name] = stacked.max(0).values
                continue
            k = stacked.shape[0]
            total, _ = weighted_sums(stacked.reshape(k, -1), coef)
            w = rin.global_params[name].to(device=total.device, dtype=torch.float64).reshape(-1)
            out[name] = (keep * w + total).reshape(stacked.shape[1:]).to(stacked.dtype)
        return out, {"fednova_tau_eff": tau_eff, "fednova_coefficients": coef.tolist()}, state


# ---- FedDyn / FedDC ---------------------------------------------------------------------------------------------
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
