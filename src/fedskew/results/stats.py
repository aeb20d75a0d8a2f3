"""Paired comparisons of two rows of a table over the seeds they share, and the power of such a comparison.

Runs of one experiment that differ only in the method share their seeds, and so their partitions, initial models and
client samples: the difference of two methods is measured seed by seed (*paired*), which removes the variance those
shared draws put into both. Everything here works on plain numbers (per-seed values of one metric, in any unit):

* :func:`paired_differences`: the per-seed differences ``row - reference`` over the seeds both have (none in common:
  :class:`UnpairedError`, never a silent unpaired comparison);
* :func:`paired_t_interval` (Student's t on the differences) and :func:`bootstrap_interval` (percentile bootstrap of
  their mean, fixed seed); :func:`compare` picks the t interval below :data:`BOOTSTRAP_FROM` common seeds, the
  bootstrap from there on, and says which;
* :func:`detectable_difference`: the smallest true mean difference a two-sided paired t-test at ``alpha`` detects with
  probability ``power`` given the paired std and the number of seeds, and :func:`seeds_needed`, its inverse. Both are
  exact: the power of the t-test under the alternative is computed from the noncentral t distribution
  (``P(|T| > t_{1-alpha/2, n-1})``, T noncentral t with n - 1 degrees of freedom and noncentrality
  ``d sqrt(n) / sd``), not the normal or iterated t-quantile approximation.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

# scipy is imported inside the functions that need it: building the CLI's parser reaches this module, and a
# command that never computes an interval must not pay scipy's import (tests/test_cli_startup.py)

LEVEL = 0.95
ALPHA = 0.05
POWER = 0.8
BOOTSTRAP_FROM = 10  # common seeds from which the interval is a bootstrap
RESAMPLES = 10_000
PAIRED_T = "paired t"
BOOTSTRAP = "bootstrap"
SINGLE = "single seed"  # one common seed: a difference, no interval
UNPAIRED = "unpaired"  # no common seed: no comparison


class UnpairedError(ValueError):
    """Two rows without a seed in common: a paired comparison is impossible."""


@dataclass(frozen=True)
class Comparison:
    """A row against its reference over their common seeds: the mean paired difference ``row - reference`` and its
    interval (``lo``, ``hi``; None without one), how it was computed (``method``: "paired t", "bootstrap",
    "single seed" or "unpaired"), the ``n`` common seeds used, the std of the differences (``sd``, ddof=1; None
    below two seeds) and whether the interval excludes 0. ``excluded``: common seeds left out because a value was
    not finite (a diverged run)."""

    mean: float | None
    lo: float | None
    hi: float | None
    method: str
    n: int
    sd: float | None
    significant: bool
    level: float = LEVEL
    seeds: tuple[int, ...] = ()
    excluded: tuple[int, ...] = field(default=())

    @property
    def paired(self) -> bool:
        return self.method != UNPAIRED

    def detectable(self, alpha: float = ALPHA, power: float = POWER) -> float | None:
        """The smallest difference this design detects (:func:`detectable_difference` from ``sd`` and ``n``)."""
        return detectable_difference(self.sd, self.n, alpha, power) if self.sd is not None else None

    def seeds_for(self, d: float, alpha: float = ALPHA, power: float = POWER, max_n: int = 1000) -> int | None:
        """Seeds that would resolve a difference ``d`` with this comparison's paired std (None: unknown sd or more
        than ``max_n``)."""
        return seeds_needed(self.sd, d, alpha, power, max_n) if self.sd is not None else None

    def as_dict(self) -> dict[str, object]:
        return {
            "mean": self.mean,
            "lo": self.lo,
            "hi": self.hi,
            "method": self.method,
            "n": self.n,
            "sd": self.sd,
            "significant": self.significant,
            "level": self.level,
            "seeds": list(self.seeds),
            "excluded": list(self.excluded),
            "detectable": self.detectable(),
        }


def paired_differences(ref: Mapping[int, float], row: Mapping[int, float]) -> tuple[list[int], np.ndarray]:
    """The seeds both ``ref`` and ``row`` (seed -> value) hold with finite values, sorted, and ``row - ref`` on each.
    Raises :class:`UnpairedError` when they have no seed in common (runs of different seeds are not comparable
    pairwise). Common seeds whose value is not finite in either (NaN: a diverged run) are left out here; see
    :func:`compare` for the note."""
    common = sorted(set(ref) & set(row))
    if not common:
        raise UnpairedError(
            f"no common seed: the reference has seeds {sorted(ref)}, the row {sorted(row)}; a paired comparison "
            "needs runs of the same seeds"
        )
    seeds = [s for s in common if math.isfinite(float(ref[s])) and math.isfinite(float(row[s]))]
    return seeds, np.array([float(row[s]) - float(ref[s]) for s in seeds], dtype=float)


def _mean_sd(diffs: Sequence[float] | np.ndarray) -> tuple[np.ndarray, float, float]:
    d = np.asarray(diffs, dtype=float)
    if d.ndim != 1 or len(d) < 2:
        raise ValueError(f"an interval needs at least two paired differences, got {d.size}")
    if not np.all(np.isfinite(d)):
        raise ValueError("paired differences must be finite")
    return d, float(d.mean()), float(d.std(ddof=1))


def paired_t_interval(diffs: Sequence[float] | np.ndarray, level: float = LEVEL) -> tuple[float, float]:
    """The ``level`` confidence interval of the mean paired difference: mean ± t_{(1+level)/2, n-1} sd / sqrt(n)
    (sd with ddof=1). At least two differences; an sd of 0 collapses the interval to the mean."""
    from scipy import stats

    d, mean, sd = _mean_sd(diffs)
    half = float(stats.t.ppf(0.5 + level / 2, len(d) - 1)) * sd / math.sqrt(len(d))
    return mean - half, mean + half


def bootstrap_interval(
    diffs: Sequence[float] | np.ndarray, level: float = LEVEL, resamples: int = RESAMPLES, seed: int = 0
) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean paired difference: ``resamples`` resamples of the differences with
    replacement (numpy ``default_rng(seed)``: the same differences give the same interval), the ((1-level)/2,
    (1+level)/2) quantiles of their means."""
    d, _, _ = _mean_sd(diffs)
    rng = np.random.default_rng(seed)
    means = d[rng.integers(0, len(d), size=(resamples, len(d)))].mean(axis=1)
    lo, hi = np.quantile(means, [0.5 - level / 2, 0.5 + level / 2])
    return float(lo), float(hi)


def compare(
    ref: Mapping[int, float],
    row: Mapping[int, float],
    *,
    level: float = LEVEL,
    bootstrap_from: int = BOOTSTRAP_FROM,
    resamples: int = RESAMPLES,
    seed: int = 0,
) -> Comparison:
    """``row`` against ``ref`` (seed -> value) over their common seeds: a paired t interval below ``bootstrap_from``
    common seeds, a percentile bootstrap from there on; one common seed gives the difference without an interval;
    no common seed gives an "unpaired" result (no numbers). Significant: the interval excludes 0 (with sd 0, the
    interval is the mean itself: significant iff the mean is not 0)."""
    try:
        seeds, d = paired_differences(ref, row)
    except UnpairedError:
        return Comparison(None, None, None, UNPAIRED, 0, None, False, level)
    excluded = tuple(sorted(s for s in set(ref) & set(row) if s not in seeds))
    if len(d) == 0:
        return Comparison(None, None, None, SINGLE, 0, None, False, level, (), excluded)
    mean = float(d.mean())
    if len(d) == 1:
        return Comparison(mean, None, None, SINGLE, 1, None, False, level, tuple(seeds), excluded)
    sd = float(d.std(ddof=1))
    if len(d) >= bootstrap_from:
        lo, hi = bootstrap_interval(d, level, resamples, seed)
        method = BOOTSTRAP
    else:
        lo, hi = paired_t_interval(d, level)
        method = PAIRED_T
    if sd == 0.0:
        lo = hi = mean
    significant = (lo > 0 or hi < 0) if lo != hi else mean != 0.0
    return Comparison(mean, lo, hi, method, len(d), sd, significant, level, tuple(seeds), excluded)


# ---- power ---------------------------------------------------------------------------------------------------------
def t_test_power(effect: float, n: int, alpha: float = ALPHA) -> float:
    """Power of the two-sided paired t-test at ``alpha`` with ``n`` pairs when the true mean difference is ``effect``
    paired stds: P(|T| > t_{1-alpha/2, n-1}) for T noncentral t (n - 1 degrees of freedom, noncentrality
    effect sqrt(n))."""
    if n < 2:
        raise ValueError(f"a paired t-test needs at least 2 seeds, got {n}")
    from scipy import stats

    df, nc = n - 1, abs(effect) * math.sqrt(n)
    tc = float(stats.t.ppf(1 - alpha / 2, df))
    upper = float(stats.nct.sf(tc, df, nc))
    lower = float(stats.nct.sf(tc, df, -nc))  # P(T < -tc) by symmetry; vanishing (scipy may say NaN) for large nc
    return upper + (lower if math.isfinite(lower) else 0.0)


def detectable_difference(sd: float | None, n: int, alpha: float = ALPHA, power: float = POWER) -> float | None:
    """The minimum detectable difference of a two-sided paired t-test at ``alpha`` with ``power``: the true mean
    difference (in the unit of ``sd``) that ``n`` seeds with paired std ``sd`` detect with probability ``power``
    (exact, noncentral t). None below two seeds or without an sd; 0 when ``sd`` is 0."""
    if sd is None or n < 2 or not math.isfinite(sd):
        return None
    if sd == 0:
        return 0.0
    from scipy import optimize

    hi = 1.0
    while t_test_power(hi, n, alpha) < power:
        hi *= 2.0
    effect = optimize.brentq(lambda e: t_test_power(e, n, alpha) - power, 0.0, hi, xtol=1e-12)
    return float(effect) * float(sd)


def seeds_needed(
    sd: float | None, d: float, alpha: float = ALPHA, power: float = POWER, max_n: int = 1000
) -> int | None:
    """The smallest number of seeds ``n >= 2`` whose two-sided paired t-test at ``alpha`` detects a true difference
    ``d`` with probability at least ``power`` when the paired std is ``sd`` (exact, noncentral t): the inverse of
    :func:`detectable_difference`. None when more than ``max_n`` seeds would be needed or ``sd`` is unknown; 2 when
    ``sd`` is 0."""
    if not d > 0:
        raise ValueError(f"the difference to resolve must be positive, got {d}")
    if sd is None or not math.isfinite(sd):
        return None
    if sd == 0:
        return 2
    from scipy import stats

    effect = d / sd
    z = float(stats.norm.ppf(1 - alpha / 2) + stats.norm.ppf(power))
    n = max(2, math.floor((z / effect) ** 2))  # the normal approximation never asks for more seeds than the t-test
    while n > 2 and t_test_power(effect, n - 1, alpha) >= power:
        n -= 1
    while n <= max_n:
        if t_test_power(effect, n, alpha) >= power:
            return n
        n += 1
    return None
