"""The FedHEAL paper's fairness comparisons, whole: AFL, q-FFL (q-FedAvg) and FedFV (server plug-ins).

All three read each participant's loss on its training data at the broadcast model, before local training
(``RoundInput.metrics['loss_before']``, reported by the client wrapper :mod:`fedskew.client.loss_before`, which their
plug-ins install), and work on the stacked uploads ``u_k = w_k − W``:

* :class:`AflWeights` (a weighting with state): agnostic FL's mixture weights ``λ`` on the simplex, moved by
  projected gradient ascent on the clients' losses;
* :class:`QfflCombine`: q-FedAvg's step ``W + Σ p_k F_k^q u_k / Σ p_k h_k`` with ``h_k = q F_k^{q−1} L_k ‖u_k‖² +
  F_k^q`` (the Lipschitz-based step size of the paper; ``L_k = (1 − β)²/(lr · τ_k²)`` for ``τ_k`` local steps at
  momentum ``β``, which is the reference's ``L = 1/lr`` for one plain SGD step);
* :class:`FedFVCombine` (a stateful combine): FedFV's projection of conflicting updates in order of increasing loss,
  then of the combined update against the recent history of client updates, rescaled to the plain mean's norm.

The model geometry (norms, cosines, projections) is over the trainable floating tensors; floating buffers (BatchNorm
statistics) take the same coefficients (q-FFL) or the weighted mean (FedFV); integer buffers take the max, as in
:class:`~fedskew.server.combine.WeightedMean`. Sums are float64, reduced block by block of columns.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar, Literal, NamedTuple

import torch
from pydantic import Field, field_validator
from torch import Tensor

from fedskew.client.loss_before import (
    LEARNING_RATE,
    LOSS_BEFORE,
    MOMENTUM,
    with_loss_after,
    with_loss_before,
)
from fedskew.protocol import STEPS, Params, RoundInput, ServerContext, State
from fedskew.registry import ClientPart, ServerPlugin
from fedskew.schema import ConfigError, StrictSettings
from fedskew.server.api import Combine, Composition, Diagnostics, Weighting, refuse_masks
from fedskew.server.combine import column_blocks, weighted_mean
from fedskew.server.weights import normalize
from fedskew.space import Float, Int, LogFloat


def reported(rin: RoundInput, metric: str, who: str) -> Tensor:
    """``[K]`` float64 values of a metric every participant reported, or a clear error naming the method."""
    if metric not in rin.metrics:
        raise ValueError(
            f"{who} needs each client's '{metric}' in RoundInput.metrics (reported: {sorted(rin.metrics)}); "
            f"compose it by name (e.g. fedavg+{who.lower()}), which makes the clients report it"
        )
    return rin.metrics[metric].to(torch.float64)


def _trainable_float(rin: RoundInput) -> list[str]:
    return [n for n, t in rin.params.items() if t.is_floating_point() and n in rin.trainable]


def gram(vectors: list[Params], names: list[str]) -> Tensor:
    """``G[i, j] = Σ_names <v_i[name], v_j[name]>`` in float64 (``[V, V]``), reduced block by block of columns."""
    v = len(vectors)
    g = torch.zeros((v, v), dtype=torch.float64)
    for name in names:
        first = vectors[0][name]
        m = first.numel()
        for cols in column_blocks(v, m, first.device):
            block = torch.stack([vec[name].reshape(-1)[cols].to(torch.float64) for vec in vectors])
            g += (block @ block.T).cpu()
    return g


def delta_sq_norms(rin: RoundInput, names: list[str]) -> Tensor:
    """``[K]`` float64 ``‖w_k − W‖²`` over ``names``."""
    k = rin.num_participants
    sq = torch.zeros(k, dtype=torch.float64)
    for name in names:
        x = rin.params[name].reshape(k, -1)
        start = rin.global_params[name].reshape(-1)
        for cols in column_blocks(k, x.shape[1], x.device):
            delta = x[:, cols].to(torch.float64) - start[cols].to(torch.float64)
            sq += delta.square().sum(1).cpu()
    return sq


def apply_coefficients(rin: RoundInput, coef: Tensor, names: list[str]) -> Params:
    """``W + Σ_k coef_k (w_k − W)`` for the tensors ``names`` (float64 sums, cast back)."""
    out: Params = {}
    k = rin.num_participants
    for name in names:
        stacked, start = rin.params[name], rin.global_params[name]
        x = stacked.reshape(k, -1)
        c = coef.to(device=x.device, dtype=torch.float64)
        flat = start.reshape(-1)
        total = torch.empty(flat.numel(), dtype=torch.float64, device=x.device)
        for cols in column_blocks(k, x.shape[1], x.device):
            s = flat[cols].to(torch.float64)
            total[cols] = s + c @ (x[:, cols].to(torch.float64) - s)
        out[name] = total.reshape(start.shape).to(stacked.dtype)
    return out


# ------------------------------------------------------------------------------------------------------------ AFL


def project_simplex(v: Tensor) -> Tensor:
    """Euclidean projection of ``v`` (1-D) onto the probability simplex (Wang & Carreira-Perpiñán, arXiv 1309.1541;
    the ``project`` of fair_flearn and flgo)."""
    v = v.to(torch.float64)
    u = torch.sort(v, descending=True).values
    css = torch.cumsum(u, 0)
    j = torch.arange(1, v.numel() + 1, dtype=torch.float64)
    rho = int((u + (1.0 - css) / j > 0).nonzero().max()) + 1
    theta = (1.0 - css[rho - 1]) / rho
    return (v + theta).clamp(min=0.0)


def floor_simplex(lam: Tensor, floor: float) -> Tensor:
    """MarsFL's guard: entries ``<= floor`` are raised to ``floor``, then renormalized (unchanged when none is)."""
    low = lam <= floor
    if floor <= 0 or not bool(low.any()):
        return lam
    return normalize(torch.where(low, torch.full_like(lam, floor), lam))


class AflState(NamedTuple):
    """AFL's mixture ``λ`` over all N clients (``[N]`` float64 on the simplex)."""

    lam: Tensor


@dataclass(frozen=True)
class AflWeights(Weighting):
    """AFL (Mohri, Sivek, Suresh, ICML 2019): minimax over mixtures ``λ`` of the clients' losses.

    State ``λ`` ([N] float64 on the simplex, ``1/N`` at start, as fair_flearn and flgo). Each round the participants
    are weighted by their ``λ`` (renormalized over them; uniform if they are all 0), then ``λ`` takes one projected
    gradient ascent step on the clients' losses before training, ``λ_k ← λ_k + step · F_k`` for the participants,
    projected onto the simplex (fair_flearn: weights from ``λ^t``, then ``λ^{t+1}``). ``floor`` raises entries
    ``<= floor`` after the projection (MarsFL, 1e-3; 0 disables). ``restart=True`` is MarsFL's variant: ``λ``
    restarts from ``1/K`` over the round's participants every round and the stepped, projected ``λ`` weights the
    same round (no memory). With ``step = 0`` the weights are uniform either way. ``loss``: the metric the ascent
    reads, ``loss_before`` (the received model on the training data, fair_flearn) or ``loss_after`` (the trained model
    on the client's validation split, FedHEAL's framework with its test split replaced by a validation split).
    """

    step: float = 0.01
    floor: float = 1e-3
    restart: bool = False
    loss: str = LOSS_BEFORE

    def init(self, ctx: ServerContext) -> AflState:
        return AflState(torch.full((ctx.num_clients,), 1.0 / ctx.num_clients, dtype=torch.float64))

    def __call__(self, rin: RoundInput, masks: Params | None, state: AflState) -> tuple[Tensor, AflState]:
        losses = reported(rin, self.loss, "AFL")
        k = rin.num_participants
        if self.restart:
            lam = floor_simplex(
                project_simplex(torch.full((k,), 1.0 / k, dtype=torch.float64) + self.step * losses), self.floor
            )
            return normalize(lam), state
        lam = state.lam
        cids = torch.tensor(rin.cids, dtype=torch.long)
        mine = lam[cids]
        weights = normalize(mine) if bool(mine.sum() > 0) else torch.full((k,), 1.0 / k, dtype=torch.float64)
        stepped = lam.clone()
        stepped[cids] += self.step * losses
        return weights, AflState(floor_simplex(project_simplex(stepped), self.floor))


# ---------------------------------------------------------------------------------------------------------- q-FFL


def qffl_coefficients(losses: Tensor, sq_norms: Tensor, weights: Tensor, q: float, lipschitz: Tensor) -> Tensor:
    """q-FedAvg's coefficients ``c_k = p_k F_k^q / Σ_j p_j h_j``, ``h_j = q F_j^{q−1} L_j ‖u_j‖² + F_j^q``, so that
    the new model is ``W + Σ_k c_k u_k`` (``F``: losses + 1e-10, as fair_flearn; ``p``: the server's weights,
    uniform in the reference). The reference's ``Δ_k = F^q L (W − w_k)`` and ``h_k = q F^{q−1} ‖Δw_k‖² + L F^q`` with
    ``Δw_k = L (W − w_k)`` give exactly this after dividing both by ``L``. With ``q = 0``: ``c = p`` (FedAvg)."""
    f = losses.to(torch.float64) + 1e-10
    fq = f.pow(q)
    h = (q * f.pow(q - 1) * lipschitz * sq_norms if q != 0 else torch.zeros_like(f)) + fq
    p = weights.to(torch.float64)
    return p * fq / (p * h).sum()


def qffl_lipschitz(lr: Tensor, steps: Tensor, momentum: Tensor) -> Tensor:
    """``[K]`` q-FFL's Lipschitz estimates ``L_k = (1 − β_k)² / (lr_k · τ_k²)`` for clients that ran ``τ_k`` local
    steps (at least 1 counted) of SGD at learning rate ``lr_k`` and momentum ``β_k``.

    fair_flearn (``qffedavg.py``) trains one epoch of plain SGD and takes ``L = 1/lr``, its penalty
    ``q F^{q−1} ‖Δw_k‖²`` reading ``Δw_k = L (W − w_k)``, which is the client's gradient for one step. After ``τ``
    steps at momentum ``β`` the update is about ``τ/(1 − β)`` steps' worth, ``u_k ≈ −lr τ g/(1 − β)``, and the same
    penalty grows by ``τ²/(1 − β)²``. This ``L_k`` computes the penalty from the per-step gradient estimate
    ``ĝ_k = (1 − β) u_k/(lr τ)`` instead: ``L_k ‖u_k‖² = lr ‖ĝ_k‖²``, i.e. the reference's
    ``h_k = q F^{q−1} ‖ĝ_k‖² + F^q/lr`` divided by ``1/lr``, while the numerator keeps the whole update ``u_k``.
    With ``τ = 1`` and ``β = 0`` it is exactly ``1/lr``."""
    tau = steps.to(torch.float64).clamp(min=1.0)
    beta = momentum.to(torch.float64)
    return (1.0 - beta).square() / (lr.to(torch.float64) * tau.square())


@dataclass(frozen=True)
class QfflCombine(Combine):
    """q-FFL's server step (Li, Sanjabi, Beirami, Smith, ICLR 2020; q-FedAvg, Algorithm 2), see
    :func:`qffl_coefficients`. ``lipschitz``: ``"auto"`` (default) each client's :func:`qffl_lipschitz` from its
    reported ``lr``, ``steps`` and ``momentum`` (sound for several local steps with momentum, issue 22); ``"lr"``
    each client's ``1/lr`` (fair_flearn's and MarsFL's value, sound for one plain SGD step); a number: that constant
    for every client. The same coefficients apply to every floating tensor, ``‖u_k‖²`` is over the trainable ones.
    Refuses element masks (``check_composition``); the reference averages the participants uniformly
    (``default_weights``)."""

    q: float = 1.0
    lipschitz: str | float = "auto"
    default_weights: ClassVar[str] = "uniform"  # the reference's average, unless -m weights=... says otherwise

    def check_composition(self, comp: Composition) -> None:
        """The step weighs whole client deltas; element masks (HEAL's) have no place in its formula."""
        refuse_masks(comp, f"{type(self).__name__} takes whole client deltas")

    def lipschitz_estimates(self, rin: RoundInput) -> Tensor:
        """``[K]`` float64: the ``L_k`` of this round's participants (class docstring)."""
        if self.lipschitz == "auto":
            return qffl_lipschitz(
                reported(rin, LEARNING_RATE, "qffl"), reported(rin, STEPS, "qffl"), reported(rin, MOMENTUM, "qffl")
            )
        if self.lipschitz == "lr":
            return 1.0 / reported(rin, LEARNING_RATE, "qffl")
        if isinstance(self.lipschitz, str):
            raise ConfigError(f"qffl: lipschitz must be 'auto', 'lr' or a positive number, not {self.lipschitz!r}")
        return torch.full((rin.num_participants,), float(self.lipschitz), dtype=torch.float64)

    def __call__(
        self, rin: RoundInput, weights: Tensor, masks: Params | None, state: State
    ) -> tuple[Params, Diagnostics, State]:
        if masks is not None:
            raise ValueError("q-FFL's step does not take element masks")
        losses = reported(rin, LOSS_BEFORE, "qffl")
        lipschitz = self.lipschitz_estimates(rin)
        sq = delta_sq_norms(rin, _trainable_float(rin))
        coef = qffl_coefficients(losses, sq, weights, self.q, lipschitz)
        floats = [n for n, t in rin.params.items() if t.is_floating_point()]
        out = apply_coefficients(rin, coef, floats)
        for name, stacked in rin.params.items():
            if name not in out:
                out[name] = stacked.max(0).values
        diagnostics = {"qffl_coef": coef.tolist(), "qffl_step": float(coef.sum())}
        return {n: out[n] for n in rin.params}, diagnostics, state


# ---------------------------------------------------------------------------------------------------------- FedFV


def fedfv_internal(g: Tensor, losses: list[float], weights: Tensor, alpha: float) -> Tensor:
    """FedFV's internal projections on the Gram matrix ``g`` of the K updates: returns ``[K]`` coefficients ``a``
    with ``Σ_k w_k g'_k = Σ_j a_j u_j``.

    As the official code: clients sorted by increasing loss (ties by position); the ``α·K`` with the largest losses
    (``order[ceil((K−1)(1−α)):]``) keep their update; every other client's ``g'_i`` is projected, for each ``j`` in
    that order, onto the normal plane of the original ``g_j`` when ``g'_i · g_j < 0``. Done on coefficients:
    ``g'_i = Σ_j C_ij u_j``, so ``g'_i · u_j = (C g)_ij``."""
    k = g.shape[0]
    order = [i for _, i in sorted(zip(losses, range(k), strict=True))]
    keep = set(order[math.ceil((k - 1) * (1 - alpha)) :]) if alpha > 0 else set()
    c = torch.eye(k, dtype=torch.float64)
    for i in range(k):
        if i in keep:
            continue
        for j in order:
            if j == i:
                continue
            dot = float(c[i] @ g[:, j])
            if dot < 0:  # implies g[j, j] > 0
                c[i, j] -= dot / float(g[j, j])
    return weights.to(torch.float64) @ c


class StoredDelta(NamedTuple):
    """A client's delta as FedFV keeps it for later rounds' external projections."""

    round: int  # the round it was trained in
    delta: Params  # name -> tensor, the trainable float tensors


class FedFVState(NamedTuple):
    """FedFV's history: the latest delta of every client seen in the window of its step 2."""

    history: Mapping[int, StoredDelta]


@dataclass(frozen=True)
class FedFVCombine(Combine):
    """FedFV (Wang et al., Federated Learning with Fair Averaging, IJCAI 2021; official code WwZzz/easyFL
    ``fedfv.py``), a combine with state.

    1. internal conflicts: :func:`fedfv_internal` (``alpha``, default 0.1: the share of highest-loss clients whose
       update is kept as is), then ``g_t = Σ_k p_k g'_k`` (``p``: the server's weights; uniform in the reference);
    2. external conflicts (from round ``tau`` on): for ``k = tau−1, …, 0``, the stored updates of the clients last
       seen in round ``t − k`` (this round's participants for ``k = 0``) that conflict with ``g_t`` are summed and
       ``g_t`` is projected onto their sum's normal plane when it conflicts with it (default ``tau = 1``);
    3. ``g_t`` is rescaled to the norm of ``Σ_k p_k u_k`` and added to the model.

    State: the latest update of every client seen in the last ``tau − 1`` rounds (the only ones step 2 can still
    use; with ``tau = 1`` nothing is kept). Floating buffers take the weighted mean, integer buffers the max.
    Everything is computed on coefficients over the Gram matrix of the updates and the stored ones, then applied
    tensor by tensor. No conflict at all gives exactly FedAvg with the same weights.
    """

    alpha: float = 0.1
    tau: int = 1
    default_weights: ClassVar[str] = "uniform"  # the reference's average, unless -m weights=... says otherwise

    def check_composition(self, comp: Composition) -> None:
        """The step weighs whole client deltas; element masks (HEAL's) have no place in its formula."""
        refuse_masks(comp, f"{type(self).__name__} takes whole client deltas")

    def init(self, ctx: ServerContext) -> FedFVState:
        return FedFVState({})

    def __call__(
        self, rin: RoundInput, weights: Tensor, masks: Params | None, state: FedFVState
    ) -> tuple[Params, Diagnostics, FedFVState]:
        if masks is not None:
            raise ValueError("FedFV's combine does not take element masks")
        losses = reported(rin, LOSS_BEFORE, "fedfv").tolist()
        names = _trainable_float(rin)
        t, k = rin.round, rin.num_participants
        updates = {n: rin.delta(n) for n in names}  # [K, ...] each, computed once
        current = [{n: updates[n][i] for n in names} for i in range(k)]
        # stored updates of clients not in this round, still inside the window of step 2
        old = {cid: h for cid, h in state.history.items() if cid not in rin.cids and t - self.tau < h.round < t}
        old_cids = sorted(old)
        vectors = current + [old[c].delta for c in old_cids]
        rounds = [t] * k + [old[c].round for c in old_cids]
        g = gram(vectors, names)
        w = weights.to(torch.float64)
        a = torch.zeros(len(vectors), dtype=torch.float64)
        a[:k] = fedfv_internal(g[:k, :k], losses, w, self.alpha)
        projected = 0
        if t >= self.tau:
            for back in range(self.tau - 1, -1, -1):
                ga = g @ a  # g_t · v for every vector v
                con = [v for v in range(len(vectors)) if rounds[v] == t - back and float(ga[v]) < 0]
                if con:
                    e = torch.zeros(len(vectors), dtype=torch.float64)
                    e[con] = 1.0
                    dot = float(a @ g @ e)
                    if dot < 0:
                        a = a - e * dot / float(e @ g @ e)
                        projected += 1
        base = torch.zeros(len(vectors), dtype=torch.float64)
        base[:k] = w
        target, norm = float(base @ g @ base), float(a @ g @ a)
        a = a * math.sqrt(target / norm) if norm > 0 else torch.zeros_like(a)
        out: Params = {}
        for name in names:
            total = rin.global_params[name].to(torch.float64).clone()
            for v, vec in enumerate(vectors):
                if float(a[v]) != 0.0:
                    total += float(a[v]) * vec[name].to(torch.float64)
            out[name] = total.to(rin.params[name].dtype)
        for name, stacked in rin.params.items():
            if name in out:
                continue
            if stacked.is_floating_point():
                out[name] = weighted_mean(stacked, weights)
            else:
                out[name] = stacked.max(0).values
        history = {cid: h for cid, h in state.history.items() if cid not in rin.cids and h.round > t + 1 - self.tau}
        if self.tau > 1:  # with tau = 1 no stored update is ever read again
            for i, cid in enumerate(rin.cids):
                history[cid] = StoredDelta(t, {n: current[i][n].clone() for n in names})
        diagnostics = {"fedfv_coef": a[:k].tolist(), "fedfv_external": projected}
        return {n: out[n] for n in rin.params}, diagnostics, FedFVState(history)


# ---- registration ----------------------------------------------------------------------------------------------------
class AflParams(StrictSettings):
    step: float = Field(0.01, ge=0)  # ascent step on lambda (MarsFL drfa_gamma, flgo learning_rate_lambda: 0.01)
    floor: float = Field(1e-3, ge=0, lt=1)  # MarsFL's floor on lambda after projection (0: none, as fair_flearn)
    restart: bool = False  # True: MarsFL's memoryless variant (lambda restarts at 1/K every round)
    # the loss the ascent reads: before training on the training data (fair_flearn, flgo), or after training on the
    # client's validation split (MarsFL, FedHEAL's framework, reads the test split there; needs validation > 0)
    loss: Literal["before", "after"] = "before"


class QfflParams(StrictSettings):
    q: float = Field(1.0, ge=0)  # fairness exponent (MarsFL and flgo default 1.0)
    # L of the step: "auto" (1-beta)^2/(lr*steps^2) per client (sound for several momentum steps; = 1/lr for one plain
    # SGD step), "lr" 1/lr per client (fair_flearn's, MarsFL's), or a given positive constant
    lipschitz: Literal["auto", "lr"] | float = "auto"

    @field_validator("lipschitz")
    @classmethod
    def _positive(cls, v: str | float) -> str | float:
        if not isinstance(v, str) and not v > 0:
            raise ValueError("a given Lipschitz constant must be positive (or 'auto', 'lr')")
        return v


class FedFVParams(StrictSettings):
    alpha: float = Field(0.1, ge=0, le=1)  # share of highest-loss clients kept unprojected (official code: 0.1)
    tau: int = Field(1, ge=1)  # rounds of update history projected against (official code: 1)


CLIENTS: dict[str, ClientPart] = {}
SERVER_PLUGINS: dict[str, ServerPlugin] = {
    "afl": ServerPlugin(
        "afl",
        "agnostic FL: mixture weights lambda on the simplex, projected ascent on the losses before training "
        "(step=0.01)",
        "Mohri, Sivek, Suresh, Agnostic Federated Learning, ICML 2019",
        AflParams,
        ("weighting",),
        lambda p: {
            "weighting": AflWeights(step=p.step, floor=p.floor, restart=p.restart, loss=f"loss_{p.loss}"),
            "wrap_client": with_loss_before if p.loss == "before" else with_loss_after,
        },
        tunable={"step": LogFloat(1e-3, 0.5)},  # fair_flearn / flgo: 0.01 (learning_rate_lambda)
    ),
    "qffl": ServerPlugin(
        "qffl",
        "q-FedAvg: updates weighted by loss^q, Lipschitz-based step (q=1, L=(1-momentum)^2/(lr*steps^2)); uniform "
        "over participants",
        "Li, Sanjabi, Beirami, Smith, Fair Resource Allocation in Federated Learning, ICLR 2020",
        QfflParams,
        ("combine",),
        lambda p: {"combine": QfflCombine(q=p.q, lipschitz=p.lipschitz), "wrap_client": with_loss_before},
        tunable={"q": LogFloat(1e-3, 15.0)},  # q-FFL paper's grid {0.001, 0.01, 0.1, 1, 2, 5, 10, 15}
    ),
    "fedfv": ServerPlugin(
        "fedfv",
        "conflicting updates projected away by increasing loss, then against recent history (alpha=0.1, tau=1)",
        "Wang et al., Federated Learning with Fair Averaging, IJCAI 2021",
        FedFVParams,
        ("combine",),
        lambda p: {"combine": FedFVCombine(alpha=p.alpha, tau=p.tau), "wrap_client": with_loss_before},
        tunable={"alpha": Float(0.0, 0.5), "tau": Int(1, 5)},  # FedFV paper: alpha and tau studied over these
    ),
}
