"""Client parts of FedDyn and FedDC, the drift-correcting hosts of the FedDisco paper.

Both keep per-client state across rounds (in ``ctx.client_state``, so it is checkpointed and survives rounds a
client misses), pull the local model towards a client-specific anchor, and clip the gradient norm (10, as both
official codes do). Their server model is the "cloud model" of :class:`fedskew.server.optimizers.CloudCorrection`
(implied by both): the weighted average plus the mean over all N clients of their accumulated updates.

* :class:`FedDyn` (Acar et al., ICLR 2021, Algorithm 1): client k minimizes
  ``L_k(θ) − ⟨g_k, θ⟩ + (α_k/2)‖θ − w^t‖²`` from the received ``w^t``; afterwards ``g_k ← g_k − α_k(θ_k − w^t)``
  (so ``g_k = ∇L_k(θ_k)`` at the local optimum: the dynamic regularizer's linear term).
* :class:`FedDC` (Gao et al., CVPR 2022): client i keeps a drift ``h_i`` and a local control variate ``c_i``;
  it minimizes ``L_i(θ) + (α_i/2)‖θ − (w^t − h_i)‖² + ⟨θ, c/ω_i − c_i⟩`` (the last term is the gradient correction
  of SCAFFOLD's form); afterwards ``h_i ← h_i + (θ_i − w^t)`` and ``c_i⁺ = c_i − c/ω_i + (w^t − θ_i)/(K·lr)``
  (K local steps), uploading ``Δc_i = c_i⁺ − c_i``; the server keeps ``c ← c + (1/N)Σ ω_i Δc_i``.

``α_k = α/ω_k`` with ``ω_k = n_k / mean_j n_j`` (``size_scaling``, both official codes; 1 for a client of average
size). The mean client size is broadcast by the client part's server half (``server/halves.py``: FedDynServer,
FedDCServer, which also keeps FedDC's global ``c``).

How the hooks carry the objectives: the regularizers' gradients (``α_k(θ − anchor) − g_k``) are added in
``after_backward`` before clipping, and the returned loss stays the plain cross-entropy, so ``train_loss`` is
comparable across methods. FedDC's correction ``c/ω_i − c_i`` is applied as a shift of the parameters right after
each optimizer step (``θ ← θ − lr·(c/ω_i − c_i)``), as fedskew's SCAFFOLD does: identical to the gradient term for
plain SGD, and with local momentum it does not pass through the momentum buffer, whose amplification would
otherwise feed back through ``c_i⁺`` (see :class:`fedskew.client.algorithms.Scaffold`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from fedskew.client.batched_form import BatchedStep, Pull, Shift
from fedskew.client.local import LocalAlgorithm, LocalContext
from fedskew.protocol import FEDDC_C, FEDDC_DELTA, FEDDC_MEAN_SAMPLES, FEDDYN_MEAN_SAMPLES, Params


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

    alpha: float = 0.01
    size_scaling: bool = True
    clip: float = 10.0

    def alpha_for(self, ctx: LocalContext) -> float:
        return self.alpha / size_weight(ctx, FEDDYN_MEAN_SAMPLES) if self.size_scaling else self.alpha

    def begin(self, ctx: LocalContext) -> None:
        named = _trainable(ctx.model)
        g = ctx.client_state.get("feddyn_grad") or _zeros(ctx)
        ctx.client_state["feddyn_grad"] = g
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
        g = ctx.client_state["feddyn_grad"]
        ctx.client_state["feddyn_grad"] = {
            n: g[n] - alpha * (p.detach() - ctx.received[n]) for n, p in _trainable(ctx.model)
        }
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

    alpha: float = 0.01
    size_scaling: bool = True
    clip: float = 10.0
    correction: bool = True

    def begin(self, ctx: LocalContext) -> None:
        named = _trainable(ctx.model)
        omega = size_weight(ctx, FEDDC_MEAN_SAMPLES) if self.size_scaling else 1.0
        h = ctx.client_state.get("feddc_drift") or _zeros(ctx)
        ctx.client_state["feddc_drift"] = h
        params = [p for _, p in named]
        anchors = [ctx.received[n] - h[n] for n, _ in named]
        ctx.prepared = prep = DriftRound(params, anchors, self.alpha / omega)
        if self.correction:
            c_i = ctx.client_state.get("feddc_ci") or _zeros(ctx)
            ctx.client_state["feddc_ci"] = c_i
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
        h = ctx.client_state["feddc_drift"]
        ctx.client_state["feddc_drift"] = {n: h[n] + delta[n] for n, _ in named}
        if not self.correction:
            return {}
        c, c_i = ctx.prep(DriftRound).c, ctx.client_state["feddc_ci"]
        scale = 1.0 / (max(ctx.steps, 1) * ctx.settings.lr)
        new_ci = {n: c_i[n] - c[n] - delta[n] * scale for n, _ in named}
        ctx.client_state["feddc_ci"] = new_ci
        return {f"{FEDDC_DELTA}{n}": new_ci[n] - c_i[n] for n, _ in named}
