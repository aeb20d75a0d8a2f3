"""The Gaussian mechanism of user-level DP-FedAvg as small pure functions: the client's clip, the server's capped
weights, the noised weighted sum and its fixed denominator.

Order, written once (:class:`fedskew.privacy.server.PrivateMean` applies it)::

    client:  Δ_k = θ_k − θ  over the floating entries that travel, with any extras it uploads (SCAFFOLD's control
             delta), one flattened vector;  Δ_k ← Δ_k · min(1, C/‖Δ_k‖)
    server:  w_k = 1 (uniform) or min(v_k / cap, 1) (capped: w_k ≤ 1; v_k the sample count, or FedDisco's weight
             from its released d̃_k)
             S = Σ_k w_k Δ_k + N(0, (z·C·max w)²·I)                      (the noise added once, to the sum)
             θ ← θ + S / D,  D = E[Σ_{k in the cohort} w_k]             (fixed: never the realised cohort's weight)

Replacing one client moves ``S`` by at most ``max w · C`` (add or remove: the same), which is the sensitivity the
noise is scaled to; ``z`` is the noise multiplier the accountant counts.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from fedskew.protocol import Params

DP_CLIP = "dp_clip"  # broadcast under adaptive clipping: this round's clip norm C (float64 scalar)
DP_UNCLIPPED = "dp_unclipped"  # a client's metric under adaptive clipping: 1 when its update was within C, else 0


def delta_norm(received: Params, trained: Params, names: Iterable[str]) -> float:
    """``‖θ_k − θ‖`` over ``names`` as one flattened vector (float64)."""
    total = 0.0
    for n in names:
        total += float(((trained[n].double() - received[n].double()) ** 2).sum())
    return math.sqrt(total)


def clip_update(
    received: Params, trained: Params, names: Sequence[str], clip: float, extras: Params | None = None
) -> tuple[Params, float, Params]:
    """``trained`` with its update over ``names`` and the ``extras`` it uploads (SCAFFOLD's control delta), one
    flattened vector, scaled to norm at most ``clip`` (direction kept; a zero update stays zero), the other entries
    as they are; returns the clipped model, the vector's norm before clipping and the clipped extras."""
    if clip <= 0:
        raise ValueError(f"the clipping norm must be positive, got {clip}")
    extras = extras or {}
    norm = math.sqrt(
        delta_norm(received, trained, names) ** 2 + sum(float((e.double() ** 2).sum()) for e in extras.values())
    )
    scale = min(1.0, clip / norm) if norm > 0 else 1.0
    if scale == 1.0:
        return trained, norm, extras
    out = dict(trained)
    for n in names:
        out[n] = (received[n] + scale * (trained[n] - received[n])).to(trained[n].dtype)
    return out, norm, {k: (scale * e).to(e.dtype) for k, e in extras.items()}


def capped_weights(raw: Tensor, weights: str, cap: float) -> Tensor:
    """The DP weights ``w_k`` (float64): ``uniform`` → 1; any other kind (``samples``: ``raw`` = the sample counts
    ``n_k``; ``disco``: FedDisco's weights from the released ``d̃_k``) → ``min(raw_k / cap, 1)``."""
    if weights == "uniform":
        return torch.ones_like(raw, dtype=torch.float64)
    if cap <= 0:
        raise ValueError(f"the weight cap must be positive, got {cap}")
    return (raw.double() / cap).clamp(max=1.0)


def noise_std(noise_multiplier: float, clip: float, max_weight: float) -> float:
    """The std of the noise on the weighted sum: ``z · C · max w`` (the sum's sensitivity times ``z``)."""
    return noise_multiplier * clip * max_weight


def noised_sum(deltas: Params, weights: Tensor, std: float, generator: torch.Generator) -> Params:
    """``Σ_k w_k Δ_k + N(0, std²)`` per entry, the noise drawn once per coordinate from ``generator`` (CPU, float64
    sums, cast back to each entry's dtype). ``deltas``: ``[K, ...]`` per entry (``K`` may be 0: noise alone)."""
    out: Params = {}
    for n, d in deltas.items():
        shape = d.shape[1:]
        total = torch.tensordot(weights.to(d.device), d.double(), dims=1) if d.shape[0] else torch.zeros(shape)
        noise = torch.randn(shape, generator=generator, dtype=torch.float64) * std
        out[n] = (total.cpu().double() + noise).to(device=d.device, dtype=d.dtype)
    return out


def model_noise_multiplier(z: float, count_noise: float) -> float:
    """Adaptive clipping's split of the privacy (Andrew et al., NeurIPS 2021, Thm. 1): the count of unclipped
    updates (each ``b_k − ½``, sensitivity ½) is noised with std ``σ_b``, so the model's sum gets the multiplier
    ``z_Δ = (z⁻² − (2σ_b)⁻²)^(−½)`` and the pair is one Gaussian mechanism of multiplier ``z``."""
    rest = z**-2 - (2 * count_noise) ** -2
    if rest <= 0:
        raise ValueError(
            f"the clipped count's noise std ({count_noise:g}) must exceed half the noise multiplier ({z / 2:g}): "
            "raise dp_count_noise or the noise"
        )
    return rest**-0.5


def next_clip(
    clip: float,
    unclipped: float,
    count_noise: float,
    cohort: float,
    quantile: float,
    lr: float,
    generator: torch.Generator,
) -> tuple[float, float]:
    """The geometric clip update: ``b̄ = (Σ b_k + N(0, σ_b²)) / E[cohort]``, ``C ← C·exp(−lr·(b̄ − quantile))``;
    returns ``(C', b̄)``."""
    noisy = (unclipped + float(torch.randn((), generator=generator, dtype=torch.float64)) * count_noise) / cohort
    return clip * math.exp(-lr * (noisy - quantile)), noisy
