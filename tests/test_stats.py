"""Paired comparisons (issue 23): the paired t interval, the fixed-seed bootstrap, the detectable difference and the
seeds needed (exact noncentral-t power), checked against hand-computed and published values; unpaired rows refused."""

import math

import numpy as np
import pytest
from scipy import stats as sps

from fedskew.results import stats as st


# ---- pairing -------------------------------------------------------------------------------------------------------
def test_differences_are_paired_by_seed_over_the_common_seeds():
    ref = {0: 50.0, 1: 60.0, 2: 70.0}
    row = {2: 71.0, 1: 63.0, 5: 99.0}  # seed 5 has no partner, seed 0 neither
    seeds, diffs = st.paired_differences(ref, row)
    assert seeds == [1, 2] and diffs.tolist() == [3.0, 1.0]


def test_rows_without_a_common_seed_are_refused_not_compared():
    with pytest.raises(st.UnpairedError, match="no common seed") as err:
        st.paired_differences({0: 1.0, 1: 2.0}, {2: 1.0, 3: 2.0})
    assert isinstance(err.value, ValueError)
    c = st.compare({0: 1.0, 1: 2.0}, {2: 1.0, 3: 2.0})
    assert c.method == st.UNPAIRED and c.mean is None and c.lo is None and not c.significant and not c.paired


def test_non_finite_values_are_left_out_with_the_seed_named():
    ref = {0: 50.0, 1: 60.0, 2: 70.0, 3: 80.0}
    row = {0: 51.0, 1: float("nan"), 2: 72.0, 3: 83.0}  # seed 1 diverged
    c = st.compare(ref, row)
    assert c.excluded == (1,) and c.seeds == (0, 2, 3) and c.n == 3
    assert c.mean == pytest.approx(2.0)


# ---- intervals -----------------------------------------------------------------------------------------------------
def test_paired_t_interval_by_hand():
    # diffs 1, 2, 3, 4: mean 2.5, sd 1.2910 (ddof 1), t_{0.975,3} = 3.1824, half-width 3.1824 * 1.2910 / 2 = 2.0543
    lo, hi = st.paired_t_interval([1, 2, 3, 4])
    assert lo == pytest.approx(2.5 - 2.0543, abs=1e-4) and hi == pytest.approx(2.5 + 2.0543, abs=1e-4)
    c = st.compare({s: 0.0 for s in range(4)}, {s: float(s + 1) for s in range(4)})
    assert (c.method, c.n) == (st.PAIRED_T, 4)
    assert c.sd == pytest.approx(1.2910, abs=1e-4) and c.significant  # [0.45, 4.55] excludes 0
    # a 90% interval is narrower: t_{0.95,3} = 2.3534
    lo90, hi90 = st.paired_t_interval([1, 2, 3, 4], level=0.90)
    assert hi90 - 2.5 == pytest.approx(2.3534 * 1.2910 / 2, abs=1e-3)


def test_an_interval_needs_two_differences():
    with pytest.raises(ValueError, match="at least two"):
        st.paired_t_interval([1.0])
    c = st.compare({0: 10.0, 1: 5.0}, {0: 12.5})  # one common seed: the difference, no interval, never significant
    assert c.method == st.SINGLE and c.n == 1 and c.mean == 2.5 and c.lo is None and c.sd is None
    assert not c.significant and c.detectable() is None


def test_zero_sd_collapses_the_interval_to_the_mean():
    c = st.compare({0: 1.0, 1: 2.0, 2: 3.0}, {0: 2.0, 1: 3.0, 2: 4.0})  # +1 on every seed
    assert (c.mean, c.lo, c.hi, c.sd) == (1.0, 1.0, 1.0, 0.0) and c.significant
    assert c.detectable() == 0.0
    same = st.compare({0: 1.0, 1: 2.0}, {0: 1.0, 1: 2.0})  # identical rows: 0, not significant
    assert (same.mean, same.lo, same.hi) == (0.0, 0.0, 0.0) and not same.significant


def test_noise_is_not_significant():
    c = st.compare({s: 50.0 for s in range(4)}, {0: 51.0, 1: 49.0, 2: 51.0, 3: 49.0})
    # mean 0, sd 1.1547, half-width 3.1824 * 1.1547 / 2 = 1.8374
    assert c.mean == 0.0 and c.hi == pytest.approx(1.8374, abs=1e-4) and not c.significant


def test_bootstrap_is_deterministic_for_a_seed_and_close_to_t_on_a_normal_sample():
    diffs = np.random.default_rng(7).normal(1.0, 2.0, size=400)
    a = st.bootstrap_interval(diffs, seed=0)
    assert a == st.bootstrap_interval(diffs, seed=0)  # fixed seed: the same interval, every time
    assert a != st.bootstrap_interval(diffs, seed=1)
    t = st.paired_t_interval(diffs)
    width = t[1] - t[0]
    assert abs(a[0] - t[0]) < 0.05 * width and abs(a[1] - t[1]) < 0.05 * width
    # by hand, the same percentile bootstrap: quantiles of resampled means drawn with default_rng(0)
    small = np.array([0.5, 1.5, -0.2, 2.0, 0.9, 1.1, 0.3, 1.7, 0.8, 1.2])
    idx = np.random.default_rng(0).integers(0, 10, size=(st.RESAMPLES, 10))
    want = np.quantile(small[idx].mean(axis=1), [0.025, 0.975])
    assert st.bootstrap_interval(small) == pytest.approx(tuple(want))


def test_compare_uses_the_bootstrap_from_ten_common_seeds_and_says_so():
    ref = {s: 50.0 for s in range(10)}
    row = {s: 50.0 + 1.0 + 0.1 * (s % 3) for s in range(10)}
    c = st.compare(ref, row)
    assert c.method == st.BOOTSTRAP and c.n == 10 and c.significant
    assert (c.lo, c.hi) == st.bootstrap_interval([row[s] - ref[s] for s in range(10)], seed=0)
    nine = st.compare({s: ref[s] for s in range(9)}, {s: row[s] for s in range(9)})
    assert nine.method == st.PAIRED_T
    assert c.as_dict()["method"] == "bootstrap" and c.as_dict()["detectable"] == pytest.approx(c.detectable())


# ---- power ---------------------------------------------------------------------------------------------------------
def test_power_is_alpha_at_no_difference_and_grows():
    assert st.t_test_power(0.0, 5) == pytest.approx(0.05)
    assert st.t_test_power(0.5, 10) < st.t_test_power(1.0, 10) < st.t_test_power(1.0, 20)


def test_detectable_difference_exact_noncentral_t():
    # sd 1, n 10: the effect at which P(|T'| > t_{0.975,9}) = 0.8 for T' noncentral t(9, effect * sqrt(10));
    # solved with scipy: 0.99600. The iterated t-quantile formula (t_{0.975,9} + t_{0.8,9}) / sqrt(10) = 0.99471 is
    # the approximation it replaces (slightly optimistic at small n).
    d = st.detectable_difference(1.0, 10)
    assert d == pytest.approx(0.99600, abs=5e-5)
    approx = (sps.t.ppf(0.975, 9) + sps.t.ppf(0.8, 9)) / math.sqrt(10)
    assert approx == pytest.approx(0.99471, abs=5e-5) and approx < d < approx + 0.005
    assert st.t_test_power(d, 10) == pytest.approx(0.8, abs=1e-9)
    assert st.detectable_difference(2.5, 10) == pytest.approx(2.5 * d)  # in the unit of the sd
    assert st.detectable_difference(1.0, 3) == pytest.approx(3.26404, abs=5e-5)  # few seeds: much larger
    assert st.detectable_difference(1.0, 1) is None and st.detectable_difference(None, 5) is None
    assert st.detectable_difference(0.0, 4) == 0.0


def test_seeds_needed_matches_published_values_and_inverts_the_detectable_difference():
    # G*Power's classic paired-t examples (two-sided, alpha 0.05, power 0.8): effect 0.5 sd -> 34 pairs
    # (power 0.8078), effect 1 sd -> 10 pairs (power 0.8031)
    assert st.seeds_needed(1.0, 0.5) == 34 and st.t_test_power(0.5, 34) == pytest.approx(0.8078, abs=1e-4)
    assert st.seeds_needed(2.0, 2.0) == 10 and st.t_test_power(1.0, 10) == pytest.approx(0.8031, abs=1e-4)
    sd = 0.7
    needs = [st.seeds_needed(sd, d) for d in (0.2, 0.3, 0.5, 1.0, 2.0)]
    assert needs == sorted(needs, reverse=True) and needs[-1] >= 2  # monotone: a smaller difference needs more
    for d in (0.2, 0.5, 1.0):
        n = st.seeds_needed(sd, d)
        assert st.detectable_difference(sd, n) <= d < st.detectable_difference(sd, n - 1)
    assert st.seeds_needed(1.0, 0.01) is None  # beyond max_n
    assert st.seeds_needed(1.0, 0.01, max_n=100_000) == pytest.approx(78_500, rel=0.01)
    assert st.seeds_needed(0.0, 0.1) == 2 and st.seeds_needed(None, 0.1) is None
    with pytest.raises(ValueError, match="positive"):
        st.seeds_needed(1.0, 0.0)
