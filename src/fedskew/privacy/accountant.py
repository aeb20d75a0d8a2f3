"""The privacy loss of a run's rounds: one DP event per round, composed by Google's ``dp-accounting``.

Each round releases the noised sum of the sampled clients' clipped updates: a Gaussian mechanism of noise multiplier
``z`` (noise std / sensitivity). How the cohort is drawn decides the event and the neighbouring relation:

* ``poisson``: every client joins independently with probability ``q``; amplification by Poisson subsampling,
  add-or-remove-one neighbours (``PoissonSampledDpEvent``);
* ``fixed``: ``m`` of the ``N`` clients without replacement; replace-one neighbours
  (``SampledWithoutReplacementDpEvent``; the RDP accountant only: the PLD accountant has no such event);
* ``full``: every client every round; no amplification (a plain ``GaussianDpEvent``), add-or-remove-one.

``T`` rounds compose the round's event ``T`` times. RDP (Mironov 2017) is the default accountant, PLD (privacy loss
distributions, tighter) on request. :func:`calibrate` finds the smallest ``z`` whose ``T`` rounds stay within a target
``ε`` (bisection: ``ε`` falls as ``z`` grows).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

SamplingKind = Literal["poisson", "fixed", "full"]
AccountantKind = Literal["rdp", "pld"]


class AccountantUnavailable(ImportError):
    """``dp-accounting`` is not installed (the ``privacy`` extra)."""


def _dpa() -> Any:
    try:
        import dp_accounting
    except ImportError as exc:  # pragma: no cover - the extra is installed where DP runs
        raise AccountantUnavailable(
            "differential privacy needs Google's dp-accounting: pip install 'fedskew[privacy]'"
        ) from exc
    return dp_accounting


@contextmanager
def _quiet() -> Iterator[None]:
    """dp-accounting logs a warning through absl for every RDP order it drops; the result is unaffected."""
    log = logging.getLogger("absl")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


@dataclass(frozen=True)
class Sampling:
    """How each round's cohort is drawn: ``kind``, the rate ``q`` (poisson), ``m`` of ``n`` clients (fixed)."""

    kind: SamplingKind
    n: int
    q: float = 1.0
    m: int = 0

    def __post_init__(self) -> None:
        if self.kind == "poisson" and not 0 < self.q <= 1:
            raise ValueError(f"Poisson sampling needs a rate in (0, 1], got {self.q}")
        if self.kind == "fixed" and not 0 < self.m <= self.n:
            raise ValueError(f"fixed-size sampling needs 0 < m <= n, got m={self.m}, n={self.n}")

    @property
    def expected_cohort(self) -> float:
        """The expected number of sampled clients (the fixed denominator's cohort)."""
        return {"poisson": self.q * self.n, "fixed": float(self.m), "full": float(self.n)}[self.kind]


def round_event(z: float, sampling: Sampling) -> Any:
    """One round's DP event: the Gaussian mechanism of multiplier ``z`` under the cohort's sampling."""
    dpa = _dpa()
    gauss = dpa.GaussianDpEvent(z)
    if sampling.kind == "poisson":
        return dpa.PoissonSampledDpEvent(sampling.q, gauss)
    if sampling.kind == "fixed":
        return dpa.SampledWithoutReplacementDpEvent(sampling.n, sampling.m, gauss)
    return gauss


def _accountant(kind: AccountantKind, sampling: Sampling) -> Any:
    dpa = _dpa()
    if kind == "rdp":
        from dp_accounting.rdp import rdp_privacy_accountant as rdp

        relation = dpa.NeighboringRelation
        neighbours = relation.REPLACE_ONE if sampling.kind == "fixed" else relation.ADD_OR_REMOVE_ONE
        return rdp.RdpAccountant(neighboring_relation=neighbours)
    if kind == "pld":
        if sampling.kind == "fixed":
            raise ValueError(
                "the PLD accountant has no event for fixed-size sampling without replacement: use the RDP "
                "accountant, or Poisson sampling (client_sampling: poisson)"
            )
        from dp_accounting.pld import pld_privacy_accountant as pld

        return pld.PLDAccountant()
    raise ValueError(f"unknown accountant {kind!r}; use rdp or pld")


def epsilon(
    z: float,
    sampling: Sampling,
    rounds: int,
    delta: float,
    kind: AccountantKind = "rdp",
    once: tuple[float, ...] = (),
) -> float:
    """``ε`` after ``rounds`` rounds at noise multiplier ``z`` (``δ = delta``); ``0`` rounds: 0. ``once``: the noise
    multipliers of Gaussian releases every client makes once, before round 1, whose values the rounds read (FedDisco's
    privatized ``d_k``): composed with the rounds, without amplification (every client reports), from round 1 on
    (nothing that depends on them is released before)."""
    if z <= 0 or any(o <= 0 for o in once):
        raise ValueError(f"the noise multipliers must be positive, got {z} and {list(once)}")
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    if rounds <= 0:
        return 0.0
    dpa = _dpa()
    acc = _accountant(kind, sampling)
    with _quiet():
        for o in once:
            acc.compose(dpa.GaussianDpEvent(o))
        acc.compose(dpa.SelfComposedDpEvent(round_event(z, sampling), rounds))
        return float(acc.get_epsilon(delta))


def calibrate(
    target: float,
    delta: float,
    sampling: Sampling,
    rounds: int,
    kind: AccountantKind = "rdp",
    rtol: float = 1e-4,
    once: tuple[float, ...] = (),
) -> float:
    """The smallest noise multiplier ``z`` (to ``rtol``) whose ``rounds`` rounds, with the releases ``once``
    (:func:`epsilon`), spend at most ``ε = target``."""
    if target <= 0:
        raise ValueError(f"the target epsilon must be positive, got {target}")
    if once and epsilon(1e6, sampling, rounds, delta, kind, once) > target:
        alone = epsilon(1e6, sampling, 1, delta, kind, once)
        raise ValueError(
            f"the one-off releases of noise multipliers {list(once)} alone spend about epsilon {alone:.3g}, more than "
            f"the target {target}: raise their noise"
        )
    lo, hi = 1e-3, 1.0
    while epsilon(hi, sampling, rounds, delta, kind, once) > target:
        lo, hi = hi, hi * 2
        if hi > 1e6:
            raise ValueError(f"no noise multiplier up to 1e6 keeps {rounds} rounds within epsilon {target}")
    while hi - lo > rtol * hi:
        mid = (lo + hi) / 2
        if epsilon(mid, sampling, rounds, delta, kind, once) > target:
            lo = mid
        else:
            hi = mid
    return hi
