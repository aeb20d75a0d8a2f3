"""The server side of user-level DP: which compositions can be private, the noise multiplier a run uses (given, or
calibrated to a target ε), and :class:`PrivateMean`, the private replacement of a composition's weighted mean.

A composition can be private when its server combines the uploads as a weighted sum whose weights the server may
know without a further release, or from one that is itself private: FedAvg's client parts with uniform or (capped)
sample weights, FedDisco's weights from each client's ``d_k`` released once through a Gaussian mechanism
(``dp_report_noise``, composed in the accountant; :meth:`fedskew.server.api.Weighting.private`), a server step that
reads only the sum (FedAvgM, FedAdam: post-processing; not FedExP, which reads each update's norm), client-local
groups (FedPer's head never travels), client parts whose personalized models stay on the client (Ditto, APFL: the
guarantee covers the released global model). Refused, with the reason: a server piece that needs each client's
update on its own (masks, a combine other than the weighted mean, one model per client, a step reading the
uploads), weights or a calibration computed from the clients' statistics without a private form (CCVR's
calibration, FedDisco's ``only_iid``), and a client part whose server half reads the individual extras (a private one,
SCAFFOLD's, advances from their noised sum: the extras are clipped with the model and noised like it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch

from fedskew.privacy.accountant import AccountantKind, Sampling, calibrate, epsilon
from fedskew.privacy.mechanism import (
    DP_CLIP,
    DP_UNCLIPPED,
    capped_weights,
    model_noise_multiplier,
    next_clip,
    noise_std,
    noised_sum,
)
from fedskew.protocol import Params, RoundInput, ServerContext, State
from fedskew.schema import ConfigError
from fedskew.seeding import Purpose, torch_generator
from fedskew.server.api import ServerOutput, ServerStep
from fedskew.server.streaming import sum_refusal

if TYPE_CHECKING:
    from fedskew.methods import Method


@dataclass(frozen=True)
class AdaptiveClip:
    """Adaptive clipping (Andrew et al., NeurIPS 2021): the clip tracks ``quantile`` of the update norms at rate
    ``lr`` from the noised count of unclipped updates (noise std ``count_noise``); ``model_noise`` is the multiplier
    left for the model's sum, so that the pair spends what ``noise_multiplier`` does."""

    quantile: float
    lr: float
    count_noise: float
    model_noise: float


@dataclass(frozen=True)
class PrivacyPlan:
    """A run's DP settings as the server applies them: the clip ``C``, the noise multiplier ``z`` (given, or
    calibrated: ``calibrated``), the cohort's sampling, ``δ``, the accountant, the weights and their cap, the
    fixed denominator ``D`` and the ε budget (``None``: none); ``values``: every client's raw weight (the weights'
    private form, :class:`~fedskew.server.api.PrivateWeights`), ``report_noise`` the multiplier of the one-off
    release they read (0: none) and ``report`` what the record states of it."""

    clip: float
    noise_multiplier: float
    sampling: Sampling
    delta: float
    accountant: AccountantKind
    weights: str
    cap: float
    denominator: float
    budget: float | None
    calibrated: bool
    adaptive: AdaptiveClip | None = None  # adaptive clipping (None: the clip stays C)
    values: np.ndarray | None = None  # [N] raw weights (None: each upload's sample count, or 1)
    report_noise: float = 0.0
    report: tuple[tuple[str, Any], ...] = ()

    def epsilon(self, rounds: int) -> float:
        """The ε spent after ``rounds`` rounds (with the one-off release of the reports the weights read)."""
        once = (self.report_noise,) if self.report_noise > 0 else ()
        return epsilon(self.noise_multiplier, self.sampling, rounds, self.delta, self.accountant, once)

    def round_weights(self, cids: tuple[int, ...], num_samples: torch.Tensor) -> torch.Tensor:
        """The cohort's capped weights ``w_k ≤ 1`` (float64)."""
        raw = num_samples if self.values is None else torch.from_numpy(self.values[list(cids)])
        return capped_weights(raw, self.weights, self.cap)

    def summary(self, rounds: int, stopped_at_budget: bool) -> dict[str, Any]:
        """summary.json's ``privacy``: the settings, the ε spent in the ``rounds`` rounds run, whether the run stopped
        at its budget."""
        spent = self.epsilon(rounds)
        return {**self.record(), "epsilon": spent, "rounds": rounds, "stopped_at_budget": stopped_at_budget}

    def record(self) -> dict[str, Any]:
        """The run's privacy settings as applied."""
        return {
            "clip": self.clip,
            "noise_multiplier": self.noise_multiplier,
            "calibrated": self.calibrated,
            "sampling": self.sampling.kind,
            "q": self.sampling.expected_cohort / self.sampling.n,
            "delta": self.delta,
            "accountant": self.accountant,
            "weights": self.weights,
            "weight_cap": self.cap,
            "denominator": self.denominator,
            "budget": self.budget,
            **({} if self.report_noise <= 0 else {"report_noise_multiplier": self.report_noise, **dict(self.report)}),
            **(
                {}
                if self.adaptive is None
                else {
                    "clip_quantile": self.adaptive.quantile,
                    "clip_lr": self.adaptive.lr,
                    "count_noise": self.adaptive.count_noise,
                    "model_noise_multiplier": self.adaptive.model_noise,
                }
            ),
        }


def refusal(method: Method) -> str | None:
    """Why ``method`` cannot run under user-level DP (module docstring); ``None`` when it can: a server that is a
    weighted sum of the uploads (:func:`~fedskew.server.streaming.sum_refusal`, which streaming aggregation shares)
    with weights that have a private form, and no extra upload that is not part of the clipped vector."""
    why = sum_refusal(method) or method.server.weighting.private_refusal()  # type: ignore[attr-defined]
    if why is not None:
        return why
    if method.upload_extras:
        return "its clients upload extra tensors beside the model"
    return None


def plan_privacy(
    method: Method,
    ctx: ServerContext,
    *,
    clip: float,
    noise_multiplier: float | None,
    target_epsilon: float | None,
    delta: float,
    accountant: AccountantKind,
    sampling: Sampling,
    rounds: int,
    weight_cap: float | None,
    clip_quantile: float | None = None,
    clip_lr: float = 0.2,
    count_noise: float | None = None,
    report_noise: float | None = None,
) -> PrivacyPlan:
    """The run's :class:`PrivacyPlan`; :class:`~fedskew.schema.ConfigError` naming why a composition is refused.
    ``report_noise``: the noise multiplier of the client reports' one-off release, for weights that read them."""
    why = refusal(method)
    if why is not None:
        raise ConfigError(f"method {method.name!r} cannot run under differential privacy: {why}")
    private = method.server.weighting.private(ctx, report_noise)  # type: ignore[attr-defined]
    if report_noise is not None and private.report_noise <= 0:
        raise ConfigError(
            f"dp_report_noise is for weights that read client reports (FedDisco's); the weights of {method.name!r} "
            f"({private.kind}) read none: leave it out"
        )
    values = np.asarray(private.values, dtype=np.float64)
    if values.shape != (ctx.num_clients,) or not np.all(np.isfinite(values)) or np.any(values < 0):
        raise ValueError(f"the private weights must be [{ctx.num_clients}] finite and non-negative, got {values}")
    cap = float(weight_cap) if weight_cap is not None else float(values.mean())
    all_w = capped_weights(torch.from_numpy(values), private.kind, cap).sum().item()
    denominator = all_w * sampling.expected_cohort / sampling.n  # E[Σ w over the cohort]: each client joins w.p. q
    once = (private.report_noise,) if private.report_noise > 0 else ()
    if noise_multiplier is None:
        if target_epsilon is None:
            raise ConfigError("differential privacy needs dp_noise (the noise multiplier) or dp_epsilon (a target)")
        try:
            z, calibrated = calibrate(target_epsilon, delta, sampling, rounds, accountant, once=once), True
        except ValueError as exc:
            raise ConfigError(f"dp_epsilon {target_epsilon}: {exc}") from None
    else:
        z, calibrated = float(noise_multiplier), False
    adaptive = None
    if clip_quantile is not None:
        sigma_b = count_noise if count_noise is not None else sampling.expected_cohort / 20  # Andrew et al.'s default
        try:
            adaptive = AdaptiveClip(clip_quantile, clip_lr, sigma_b, model_noise_multiplier(z, sigma_b))
        except ValueError as exc:
            raise ConfigError(f"adaptive clipping: {exc}") from None
    return PrivacyPlan(
        clip,
        z,
        sampling,
        delta,
        accountant,
        private.kind,
        cap,
        denominator,
        target_epsilon,
        calibrated,
        adaptive,
        values,
        private.report_noise,
        tuple(private.record.items()),
    )


class PrivateState(NamedTuple):
    """The server step's state, and the clip norm this round's clients use (adaptive clipping moves it)."""

    step: State = None
    clip: float = 0.0


@dataclass(frozen=True)
class PrivateMean:
    """DP-FedAvg's server (:mod:`fedskew.privacy.mechanism`): ``θ ← θ + (Σ w_k Δ_k + N(0, (z C max w)²))/D`` over
    the entries the clients clip (``noised``), then the composition's server step; the other entries (integer
    buffers, the entries clients keep locally) stay the global model's. Noise keyed by (seed, round)."""

    plan: PrivacyPlan
    noised: tuple[str, ...]
    seed: int
    step: ServerStep | None = None
    extras: Params | None = None  # a private server half's summed extras (zeros of their shapes: SCAFFOLD's Δc)

    def init(self, ctx: ServerContext) -> PrivateState:
        return PrivateState(self.step.init(ctx) if self.step is not None else None, self.plan.clip)

    def broadcast(self, state: PrivateState) -> Params:
        """Under adaptive clipping, this round's clip norm (the clients clip with it)."""
        return {} if self.plan.adaptive is None else {DP_CLIP: torch.tensor(state.clip, dtype=torch.float64)}

    def _release(self, rnd: int, global_params: Params, deltas: Params, weights: torch.Tensor, clip: float) -> Params:
        z = self.plan.noise_multiplier if self.plan.adaptive is None else self.plan.adaptive.model_noise
        std = noise_std(z, clip, 1.0)  # capped weights: max w ≤ 1; this round's clip for this round's noise
        gen = torch_generator(self.seed, Purpose.DP_NOISE, rnd)
        total = noised_sum(deltas, weights, std, gen)
        return {**global_params, **{n: global_params[n] + total[n] / self.plan.denominator for n in self.noised}}

    def _next_clip(self, rnd: int, unclipped: float, clip: float, diagnostics: dict[str, Any]) -> float:
        a = self.plan.adaptive
        if a is None:
            return clip
        gen = torch_generator(self.seed, Purpose.DP_NOISE, rnd, 1)  # the count's own stream
        cohort = self.plan.sampling.expected_cohort
        new, share = next_clip(clip, unclipped, a.count_noise, cohort, a.quantile, a.lr, gen)
        diagnostics.update({"dp_clip": clip, "dp_unclipped_share": share})
        return new

    def extras_sums(self, rnd: int, stacked: Params | None, clip: float, scale: float = 1.0) -> Params:
        """The noised ``Σ_k extras_k`` a private server half advances from (unweighted, as the halves sum them; the
        clipped vector's sensitivity holds for the pair since every weight is at most 1), from their own stream;
        ``scale``: the factor the clients multiplied their extras by before the clip (``dp_extras_scale``), divided
        out of the noised sum (post-processing)."""
        if self.extras is None:
            return {}
        z = self.plan.noise_multiplier if self.plan.adaptive is None else self.plan.adaptive.model_noise
        rows = stacked if stacked is not None else {k: t[None][:0] for k, t in self.extras.items()}
        k = next(iter(rows.values())).shape[0] if rows else 0
        gen = torch_generator(self.seed, Purpose.DP_NOISE, rnd, 2)
        total = noised_sum(rows, torch.ones(k, dtype=torch.float64), noise_std(z, clip, 1.0), gen)
        return total if scale == 1.0 else {n: (t / scale).to(t.dtype) for n, t in total.items()}

    def aggregate(self, rin: RoundInput, state: PrivateState) -> tuple[ServerOutput, PrivateState]:
        weights = self.plan.round_weights(rin.cids, rin.num_samples)
        deltas = {n: rin.params[n] - rin.global_params[n] for n in self.noised}
        params = self._release(rin.round, rin.global_params, deltas, weights, state.clip)
        diagnostics: dict[str, Any] = {"weights": weights.tolist(), "dp_cohort_weight": float(weights.sum())}
        unclipped = float(rin.metrics[DP_UNCLIPPED].sum()) if self.plan.adaptive is not None else 0.0
        clip = self._next_clip(rin.round, unclipped, state.clip, diagnostics)
        sstate = None
        if self.step is not None:
            params, more, sstate = self.step(rin, params, weights / self.plan.denominator, state.step)
            diagnostics.update(more)
        return ServerOutput(params, None, diagnostics), PrivateState(sstate, clip)

    def no_uploads(self, rnd: int, global_params: Params, state: PrivateState) -> tuple[Params, PrivateState]:
        """An empty cohort's release: the noise alone (skipping the round would tell a neighbour apart)."""
        empty = {n: global_params[n][None][:0] for n in self.noised}
        params = self._release(rnd, global_params, empty, torch.zeros(0, dtype=torch.float64), state.clip)
        return params, state._replace(clip=self._next_clip(rnd, 0.0, state.clip, {}))


def noised_entries(template: Params, local_names: frozenset[str]) -> tuple[str, ...]:
    """The entries a client clips and the server noises: every floating entry that travels."""
    return tuple(n for n, t in template.items() if t.is_floating_point() and n not in local_names)


def private_server(method: Method, plan: PrivacyPlan, ctx: ServerContext, local_names: frozenset[str]) -> PrivateMean:
    half = method.server_half
    extras = half.summed_extras(ctx) if half.private else None
    step = method.server.step  # type: ignore[attr-defined]
    return PrivateMean(plan, noised_entries(ctx.template, local_names), ctx.seed, step, extras)
