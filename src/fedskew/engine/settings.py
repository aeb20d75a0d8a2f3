"""What the server side of a round reads of a run: :class:`RoundSettings`.

The round server (``engine/round_server.py``) never sees the run configuration: the configuration builds these
settings (:meth:`fedskew.config.RunConfig.round_settings`), as it builds the data settings for ``fedskew.data``, and
both hosts of a round (the simulator and the Flower ServerApp) hand them over. The values arrive validated by the
configuration; this module only names them (and imports nothing of fedskew, so the configuration may import it).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class RoundSettings:
    """Every field the server side of a round reads. Names, meanings and defaults are those of
    :class:`fedskew.config.RunConfig` (no defaults here, so that they cannot drift apart)."""

    seed: int  # sampling, drop-outs and the evaluation sample are keyed by (seed, round)
    rounds: int  # the last round evaluates every client
    join_ratio: float  # clients sampled per round
    client_dropout: float  # probability that a sampled client does not report
    client_sampling: str  # fixed | poisson: who is sampled each round
    dp_clip: float | None  # user-level DP on when set: the clip C (clients), the noise (server)
    dp_noise: float | None  # the noise multiplier z (None: calibrated to dp_epsilon)
    dp_epsilon: float | None  # the epsilon budget
    dp_delta: float
    dp_accountant: str  # rdp | pld
    dp_weight_cap: float | None  # non-uniform weights' cap (None: their mean over the clients)
    dp_clip_quantile: float | None  # adaptive clipping's target quantile (None: a fixed clip)
    dp_clip_lr: float  # adaptive clipping's rate
    dp_count_noise: float | None  # the std of the clipped count's noise (None: cohort / 20)
    dp_report_noise: float | None  # the noise multiplier of a client report's release (FedDisco's d_k)
    dp_extras_scale: float  # the extras' factor in the clipped vector (the server divides their sum by it)
    on_bad_update: str  # fail | drop: a non-finite or mis-shaped upload stops the run, or is left out
    divergence_factor: float  # a round's training loss above this × ln(classes) diverged (0: never)
    eval_every: int  # the evaluation cadence (the last round always evaluates)
    eval_clients: int | None  # per-client views score a seeded sample of this many clients (None: all)
    skew_probes: int  # parameter-skew probe positions on evaluated rounds (0: no probe)
    aggregation: str  # auto | stacked | streaming | disk: uploads stacked, summed as they arrive, or stacked on disk
    state_memory: int | str | None  # the RAM budget a stack may take under aggregation auto (None: a quarter of RAM)
