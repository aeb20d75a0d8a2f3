"""FedSA / FedPake: spec 1.8 worked examples, section 6 items 1-5, section 7 rules, and the combine seam."""

from __future__ import annotations

import json
from fractions import Fraction

import numpy as np
import pytest
import torch

from fedskew.catalog.fedsa import FedSACombine, cluster, fedsa_layer, micro_classes, modal_classes, similarity
from fedskew.protocol import RoundInput, Upload
from fedskew.server.api import Aggregation
from fedskew.server.dispersion import coefficient_of_variation, column_stats, high_dispersion
from fedskew.server.uploads import stack_uploads
from fedskew.server.weights import SampleWeights, UniformWeights

E1_X = [
    [2.0, 2, 3, 0, 1],
    [2.2, 1, -2, 4, 4],
    [1.8, 0, 2, 4, 3],
    [2.0, -2, 5, -4, 0],
]
E1_KW = {"lam": 0.2, "delta": 0.2, "C": 3, "S": 2}


def _t(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


def _approx(t: torch.Tensor, expected: list[float], tol: float = 1e-5) -> None:
    assert t.tolist() == pytest.approx(expected, abs=tol)


# --------------------------------------------------------------------------------------------- E1 (item 1)


def test_e1_intermediates():
    X = _t(E1_X)
    stats = column_stats(X)
    _approx(stats.mean, [2.0, 0.25, 2.0, 1.0, 2.0])
    _approx(stats.var.sqrt(), [0.141421, 1.479020, 2.549510, 3.316625, 1.581139])
    cv = coefficient_of_variation(X)
    _approx(cv, [0.070711, 5.916080, 1.274755, 3.316625, 0.790569])
    assert high_dispersion(cv, 0.2).tolist() == [False, True, True, True, False]
    B = (X[:, 1:4] - stats.mean[1:4]) ** 2
    E = micro_classes(B, 3)
    assert E.tolist() == [[1, 1, 1], [1, 2, 2], [1, 1, 2], [1, 2, 3]]
    sim = similarity(E, 3)
    third, two = 1 / 3, 2 / 3
    expected = [[1, third, two, third], [third, 1, two, two], [two, two, 1, third], [third, two, third, 1]]
    np.testing.assert_allclose(sim.numpy(), np.array(expected), atol=1e-12)
    assert cluster(sim, 2, 0.2) == ([[0, 2], [1, 3]], [])
    assert modal_classes(E[[0, 2]], 3).tolist() == [1, 1, 1]  # m3 tie 1 vs 2 -> 1
    assert modal_classes(E[[1, 3]], 3).tolist() == [1, 2, 2]  # m3 tie 2 vs 3 -> 2


def test_e1_full_pipeline_default():
    out, diag = fedsa_layer(_t(E1_X), **E1_KW)
    _approx(out, [2.0, 0.625, 2.1, 1.2, 2.0])
    assert (diag.M, diag.H, diag.macro, diag.unclustered) == (5, 3, 2, 0)
    assert diag.high_index.tolist() == [1, 2, 3]
    assert diag.classes.tolist() == [[1, 1, 1], [1, 2, 2], [1, 1, 2], [1, 2, 3]]
    assert diag.clusters == [[0, 2], [1, 3]]
    assert diag.unclustered_ids == []


def test_e1_literal_alpha():
    out, _ = fedsa_layer(_t(E1_X), alpha_norm="literal", **E1_KW)
    _approx(out, [2.0, 0.416667, 1.75, 1.0, 2.0])


def test_e1_float32_input_gives_same_answer():
    out, diag = fedsa_layer(torch.tensor(E1_X, dtype=torch.float32), **E1_KW)
    assert diag.H == 3
    _approx(out, [2.0, 0.625, 2.1, 1.2, 2.0])


def test_e1_samples_weighting_changes_only_low_region():
    w = torch.tensor([1.0, 1.0, 1.0, 5.0])
    out, diag = fedsa_layer(_t(E1_X), low_weights=w, **E1_KW)
    # col 0: (2 + 2.2 + 1.8 + 5*2)/8 = 2.0; col 4: (1 + 4 + 3 + 0)/8 = 1.0; high region as in E1
    _approx(out, [2.0, 0.625, 2.1, 1.2, 1.0])
    assert diag.clusters == [[0, 2], [1, 3]]


# --------------------------------------------------------------------------------------------- E2 (item 2)

E2_SIM = [
    [1.0, 0.9, 0.3, 0.2, 0.1],
    [0.9, 1.0, 0.4, 0.3, 0.2],
    [0.3, 0.4, 1.0, 0.8, 0.5],
    [0.2, 0.3, 0.8, 1.0, 0.3],
    [0.1, 0.2, 0.5, 0.3, 1.0],
]


def test_e2_delta_02_last_client_joins():
    assert cluster(E2_SIM, 2, 0.2) == ([[0, 1], [2, 3, 4]], [])


def test_e2_delta_04_is_not_exceeded():
    assert cluster(E2_SIM, 2, 0.4) == ([[0, 1], [2, 3]], [4])


def test_e2_pre_cap_lone_client_joins_whatever_its_similarity():
    sim = [
        [1.0, 0.9, 0.8, 0.2],
        [0.9, 1.0, 0.8, 0.1],
        [0.8, 0.8, 1.0, 0.1],
        [0.2, 0.1, 0.1, 1.0],
    ]
    assert cluster(sim, 3, 0.2) == ([[0, 1, 2, 3]], [])
    # a global floor would have refused k4 (0.133 < 0.2): the threshold really applies only after the cap
    assert cluster(sim, 1, 0.2) == ([[0, 1, 2]], [3])


def test_e2_all_ones_single_cluster():
    assert cluster(np.ones((5, 5)), 2, 0.2) == ([[0, 1, 2, 3, 4]], [])


def test_cluster_delta_minus_inf_clusters_everybody():
    groups, uncl = cluster(E2_SIM, 2, float("-inf"))
    assert uncl == [] and sorted(sum(groups, [])) == [0, 1, 2, 3, 4]


def test_cluster_single_client_is_unclustered():
    assert cluster([[1.0]], 4, 0.2) == ([], [0])


def test_cluster_tolerance_makes_rounded_averages_ties():
    # simc(G1 = {k1, k2}, k3) = (0.7 + 0.1) / 2 is 0.39999999999999997 in floats; pair (k3, k4) = 0.4.
    # They are equal, so JOIN (before PAIR) must win; exact float comparison would open a second cluster.
    sim = [
        [1.0, 0.9, 0.7, 0.0],
        [0.9, 1.0, 0.1, 0.0],
        [0.7, 0.1, 1.0, 0.4],
        [0.0, 0.0, 0.4, 1.0],
    ]
    assert (0.7 + 0.1) / 2 < 0.4
    assert cluster(sim, 2, -1.0) == ([[0, 1, 2, 3]], [])


def _reference_cluster(
    sim: list[list[Fraction]], S: int, delta: Fraction
) -> tuple[list[list[int]], list[int], Fraction]:
    """Exact-rational, candidate-list spec 1.3 CLUSTER; also returns the smallest decision margin."""
    free = list(range(len(sim)))
    groups: list[list[int]] = []
    uncl: list[int] = []
    margin = Fraction(10**9)
    while free:
        cand = []  # (value, kind 0=JOIN 1=PAIR, index tuple)
        for j, g in enumerate(groups):
            for k in free:
                cand.append((sum(sim[a][k] for a in g) / len(g), 0, (j, k)))
        if len(groups) < S:
            for i, a in enumerate(free):
                for b in free[i + 1 :]:
                    cand.append((sim[a][b], 1, (a, b)))
        if not cand:
            uncl.extend(free)
            break
        best = max(c[0] for c in cand)
        ranked = sorted(cand, key=lambda c: (-c[0], c[1], c[2]))
        if len(ranked) > 1:
            margin = min(margin, ranked[0][0] - ranked[1][0])
        value, kind, idx = ranked[0]
        assert value == best
        if kind == 1:
            groups.append(list(idx))
            free.remove(idx[0])
            free.remove(idx[1])
        elif len(groups) < S or value > delta:
            if len(groups) == S:
                margin = min(margin, value - delta)
            groups[idx[0]].append(idx[1])
            free.remove(idx[1])
        else:
            margin = min(margin, delta - value)
            uncl.extend(free)
            break
    return groups, sorted(uncl), margin


@pytest.mark.parametrize("seed", range(40))
def test_cluster_matches_exact_rational_reference_on_tie_heavy_input(seed):
    rng = np.random.default_rng(seed)
    k = int(rng.integers(2, 9))
    h = int(rng.integers(1, 7))  # few positions: many exact ties among count / H values
    counts = rng.integers(0, h + 1, size=(k, k))
    counts = np.triu(counts, 1)
    counts = counts + counts.T + h * np.eye(k, dtype=np.int64)
    S = int(rng.integers(1, 4))
    dnum = int(rng.integers(0, h + 1))
    exact = [[Fraction(int(c), h) for c in row] for row in counts]
    groups, uncl, _ = _reference_cluster(exact, S, Fraction(dnum, h))
    assert cluster(counts / h, S, dnum / h) == (groups, uncl)


# --------------------------------------------------------------------------------------------- E3 (item 3)


def test_guard_single_client_returns_its_tensor():
    x = _t([[0.5, -1.0, 3.0]])
    out, diag = fedsa_layer(x)
    assert out.tolist() == [0.5, -1.0, 3.0]
    assert diag.H == 0 and diag.skew == 0.0


def test_guard_identical_clients_give_the_common_value_exactly():
    row = [0.1, 0.2, 0.3, -0.7, 1e-9]
    x = torch.tensor([row] * 7, dtype=torch.float32)
    cv = coefficient_of_variation(x)
    assert cv.tolist() == [0.0] * 5  # exact zero, even though a float mean of 7 copies may be off by an ulp
    out, diag = fedsa_layer(x)
    assert diag.H == 0
    assert torch.equal(out.to(torch.float32), x[0])


def test_guard_identical_column_is_never_high():
    # column 0 is constant (0.1 repeated: its float mean is not exactly 0.1); the others vary a little
    x = _t([[0.1, 1.0, 2.0], [0.1, 1.1, 2.0], [0.1, 0.9, 2.2]])
    assert coefficient_of_variation(x)[0].item() == 0.0
    _, diag = fedsa_layer(x)
    assert 0 not in diag.high_index.tolist()


def test_guard_identical_column_in_the_high_region_has_zero_deviations():
    # spec 7 (sigma = 0 exactly on identical columns) and 1.3 step 6 (position_max: 0/0 -> 0, class 1). With rank
    # cv normalization the constant column 2 (rank 1 of 0..2, z = 0.5 > lam) enters r^h; its float mean of three
    # 0.1s is one ulp off, which used to give squared deviations ~1e-34 scaled to class C instead of 0 -> class 1.
    x = _t([[1.0, 0.1, 0.1], [2.0, 0.1, 0.1], [4.0, 0.1, 0.1]])
    stats = column_stats(x)
    assert stats.var[1:].tolist() == [0.0, 0.0] and stats.mean[1:].tolist() == [0.1, 0.1]
    kw = {"lam": 0.2, "delta": 0.0, "C": 4, "S": 2, "cv_norm": "rank", "micro_norm": "position_max"}
    out, diag = fedsa_layer(x, alpha_norm="literal", **kw)
    assert diag.high_index.tolist() == [0, 2]
    # column 0: deviations^2 [16, 1, 25] / 9 -> / max -> [0.64, 0.04, 1] -> classes [3, 1, 4]; column 2: class 1
    assert diag.classes.tolist() == [[3, 1], [1, 1], [4, 1]]
    assert diag.clusters == [[0, 1, 2]]
    # one cluster, modal classes [1, 1] -> f(1) = 1 -> literal alpha 1/S = 0.5 on both high positions
    _approx(out, [7 / 6, 0.1, 0.05], tol=1e-12)
    out, _ = fedsa_layer(x, **kw)  # per-position alpha: the plain mean, the constant column exactly
    assert out[1:].tolist() == [0.1, 0.1]
    _approx(out, [7 / 3, 0.1, 0.1], tol=1e-12)


def test_guard_single_position_layer_is_the_mean():
    out, diag = fedsa_layer(_t([[1.0], [5.0], [-3.0]]))
    assert diag.H == 0
    _approx(out, [1.0])


def test_guard_zero_mean_column_is_the_only_high_position():
    x = _t([[1.0, 2.0, 3.0, -1.0], [-1.0, 2.5, 3.3, -1.2], [0.0, 1.5, 2.7, -0.8]])
    cv = coefficient_of_variation(x)
    assert cv[0].item() == pytest.approx(np.sqrt(2 / 3) / 1e-12)
    out, diag = fedsa_layer(x)
    assert diag.high_index.tolist() == [0]
    # classes on column 0: squared deviations [1, 1, 0] -> [4, 4, 1]; pair (k1, k2), then k3 joins (pre-cap)
    assert diag.classes.tolist() == [[4], [4], [1]]
    assert diag.clusters == [[0, 1, 2]]
    _approx(out, x.mean(0).tolist(), tol=1e-12)


def _raw_degenerate_input() -> torch.Tensor:
    # squared deviations all in (0, 1/C]: every client is class 1 everywhere under micro_norm='raw'
    g = torch.Generator().manual_seed(5)
    base = torch.tensor([0.5, -0.4, 0.3, 0.01, 0.6, -0.02, 0.2, 0.8])
    return (base + 0.05 * torch.randn(6, 8, generator=g)).to(torch.float64)


def test_raw_binning_degenerates_to_uniform_mean():
    x = _raw_degenerate_input()
    out, diag = fedsa_layer(x, micro_norm="raw")
    assert diag.H > 0
    assert bool((diag.classes == 1).all())
    assert diag.macro == 1 and diag.clusters == [[0, 1, 2, 3, 4, 5]]
    torch.testing.assert_close(out, x.mean(0), atol=1e-12, rtol=0)


def test_raw_binning_literal_alpha_shrinks_high_region_by_S():
    x = _raw_degenerate_input()
    S = 4
    out, diag = fedsa_layer(x, micro_norm="raw", alpha_norm="literal", S=S)
    mu = x.mean(0)
    expected = mu.clone()
    expected[diag.high_index] = mu[diag.high_index] / S
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=0)
    assert not torch.allclose(out, mu)


def test_raw_binning_clamps_large_deviations_to_class_C():
    E = micro_classes(torch.tensor([[0.0, 0.1, 0.3, 2.5]]), 4, "raw")
    assert E.tolist() == [[1, 1, 2, 4]]


def test_bins_are_upper_inclusive_despite_rounding():
    # 3 * (1/3) is 1.0000000000000002 in floats for some inputs; b' = i/C must stay in class i
    b = torch.tensor([[0.0, 1 / 3, 2 / 3, 1.0, 0.34]], dtype=torch.float64)
    assert micro_classes(b, 3, "raw").tolist() == [[1, 1, 2, 3, 2]]


def test_position_max_normalizes_each_column():
    B = torch.tensor([[4.0, 0.0], [1.0, 0.0], [3.0, 0.0]])
    assert micro_classes(B, 4, "position_max").tolist() == [[4, 1], [1, 1], [3, 1]]


def test_rank_cv_norm():
    cv = torch.tensor([0.5, 0.1, 0.5, 0.3, 0.2])
    # stable ascending ranks: 0.1->0, 0.2->1, 0.3->2, 0.5 (pos 0)->3, 0.5 (pos 2)->4; z = r / 4 > 0.5
    assert high_dispersion(cv, 0.5, "rank").tolist() == [True, False, True, False, False]
    assert high_dispersion(torch.tensor([3.0]), 0.0, "rank").tolist() == [False]


# --------------------------------------------------------------------------------------------- items 4-5


def _tie_free_input(seed: int) -> torch.Tensor:
    """Three pairs of clients; each pair shares a large deviation on its own block of 20 positions."""
    g = torch.Generator().manual_seed(seed)
    k, m = 6, 60
    base = (torch.rand(m, generator=g) + 1.0) * torch.sign(torch.randn(m, generator=g))
    x = base + 0.05 * torch.randn(k, m, generator=g)
    for pair in range(3):
        cols = slice(20 * pair, 20 * pair + 20)
        shift = 0.3 + torch.rand(20, generator=g) * 0.7
        x[2 * pair, cols] += shift
        x[2 * pair + 1, cols] += shift * (0.7 + 0.6 * torch.rand(20, generator=g))
    return x.to(torch.float64)


def _decision_margin(E: torch.Tensor, C: int, S: int, delta: float) -> Fraction:
    h = E.shape[1]
    counts = [[int((E[a] == E[b]).sum()) for b in range(E.shape[0])] for a in range(E.shape[0])]
    exact = [[Fraction(c, h) for c in row] for row in counts]
    return _reference_cluster(exact, S, Fraction(delta).limit_denominator(10**6))[2]


@pytest.mark.parametrize("cv_norm", ["minmax", "rank"])
def test_permutation_invariance_on_tie_free_input(cv_norm):
    x = _tie_free_input(2)  # seed chosen so that both cv_norm modes are tie-free
    out, diag = fedsa_layer(x, cv_norm=cv_norm)
    assert diag.H > 0 and diag.macro == 3
    assert sorted(sorted(g) for g in diag.clusters) == [[0, 1], [2, 3], [4, 5]]
    assert _decision_margin(diag.classes, 4, 4, 0.2) > 0  # precondition: no tie in any clustering decision
    assert not torch.allclose(out, x.mean(0))  # the high region really differs from FedAvg
    for s in range(6):
        perm = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(s))
        out_p, diag_p = fedsa_layer(x[perm], cv_norm=cv_norm)
        torch.testing.assert_close(out_p, out, atol=1e-12, rtol=0)
        clusters_orig = sorted(sorted(int(perm[i]) for i in g) for g in diag_p.clusters)
        assert clusters_orig == sorted(sorted(g) for g in diag.clusters)


@pytest.mark.parametrize("alpha_norm", ["per_position", "literal"])
def test_sign_flip_flips_output(alpha_norm):
    x = _tie_free_input(1)
    out, diag = fedsa_layer(x, alpha_norm=alpha_norm)
    out_neg, diag_neg = fedsa_layer(-x, alpha_norm=alpha_norm)
    assert diag.H > 0
    assert diag_neg.high_index.tolist() == diag.high_index.tolist()
    assert diag_neg.clusters == diag.clusters
    torch.testing.assert_close(out_neg, -out, atol=1e-12, rtol=0)
    out_e1, _ = fedsa_layer(-_t(E1_X), **E1_KW)
    _approx(out_e1, [-2.0, -0.625, -2.1, -1.2, -2.0])


@pytest.mark.parametrize("seed", range(3))
def test_lam_one_is_the_uniform_mean(seed):
    x = _tie_free_input(seed)
    out, diag = fedsa_layer(x, lam=1.0)
    assert diag.H == 0
    torch.testing.assert_close(out, x.mean(0), atol=1e-12, rtol=0)
    out_e1, _ = fedsa_layer(_t(E1_X), lam=1.0, C=3, S=2)
    _approx(out_e1, [2.0, 0.25, 2.0, 1.0, 2.0])


def test_unclustered_clients_only_enter_the_low_region():
    # E2-like structure built from classes: delta high enough that the last client stays out
    E = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 2], [3, 3, 4, 4], [3, 3, 4, 3], [2, 4, 2, 1]])
    sim = similarity(E, 4)
    groups, uncl = cluster(sim, 2, 0.5)
    assert groups == [[0, 1], [2, 3]] and uncl == [4]


# --------------------------------------------------------------------------------------------- skewness


def test_column_blocks_do_not_change_the_result(monkeypatch):
    import fedskew.server.dispersion as dispersion_mod

    x = _tie_free_input(2).to(torch.float32)
    w = torch.arange(1.0, 7.0)
    full_out, full_diag = fedsa_layer(x, low_weights=w)
    full_stats = column_stats(x, weights=w / w.sum())
    monkeypatch.setattr(dispersion_mod, "CHUNK_ELEMENTS", 6 * 7)  # blocks of 7 columns, the last one partial
    out, diag = fedsa_layer(x, low_weights=w)
    stats = column_stats(x, weights=w / w.sum())
    for a, b in [
        (stats.mean, full_stats.mean),
        (stats.var, full_stats.var),
        (stats.skew, full_stats.skew),
        (stats.weighted_mean, full_stats.weighted_mean),
    ]:
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)
    assert torch.equal(stats.constant, full_stats.constant)
    torch.testing.assert_close(out, full_out, atol=1e-12, rtol=0)
    assert diag.clusters == full_diag.clusters


def test_skewness_diagnostic():
    # one column, values [0, 0, 0, 1]: m2 = 3/16, m3 = 3/32 -> g1 = (3/32) / (3/16)^1.5 = 1.1547005
    x = _t([[0.0, 5.0], [0.0, 5.0], [0.0, 5.0], [1.0, 5.0]])
    _, diag = fedsa_layer(x)
    assert diag.skew == pytest.approx(2 / np.sqrt(3))  # constant column excluded from the average
    assert diag.skew_signed == pytest.approx(2 / np.sqrt(3))
    _, diag_neg = fedsa_layer(-x)
    assert diag_neg.skew == pytest.approx(2 / np.sqrt(3))
    assert diag_neg.skew_signed == pytest.approx(-2 / np.sqrt(3))


# --------------------------------------------------------------------------------------------- combine


def _model_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.BatchNorm1d(5))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


TRAINABLE = frozenset({"0.weight", "0.bias", "1.weight", "1.bias"})


def _round(num_samples: list[int] | None = None) -> tuple[RoundInput, dict[str, torch.Tensor]]:
    glob = _model_state()
    g = torch.Generator().manual_seed(1)
    ups = []
    for k, row in enumerate(E1_X):
        p = {}
        for name, t in glob.items():
            if t.is_floating_point():
                p[name] = t + 0.05 * torch.randn(t.shape, generator=g)
            else:
                p[name] = t + 3 * k + 1
        p["0.bias"] = torch.tensor(row, dtype=torch.float32)  # E1 as a real layer
        p["1.running_var"] = p["1.running_var"].abs() + 0.5
        ups.append(Upload(10 + k, p, (num_samples or [10] * 4)[k]))
    rin = stack_uploads(ups, rnd=1, global_params=glob, trainable=TRAINABLE, label_hists=np.zeros((4, 2)))
    return rin, glob


def test_combine_end_to_end_default_buffers_mean():
    rin, _ = _round()
    comb = FedSACombine(C=3, S=2)
    agg = Aggregation(UniformWeights(), comb)
    out, _ = agg.aggregate(rin, agg.init(None))
    params = out.global_params
    assert set(params) == set(rin.params)
    _approx(params["0.bias"], [2.0, 0.625, 2.1, 1.2, 2.0])
    for name in TRAINABLE:
        vec, _ = fedsa_layer(rin.params[name].reshape(4, -1), C=3, S=2)
        assert params[name].dtype == torch.float32 and params[name].shape == rin.params[name].shape[1:]
        torch.testing.assert_close(params[name], vec.reshape(params[name].shape).float())
    torch.testing.assert_close(params["1.running_mean"], rin.params["1.running_mean"].mean(0))
    torch.testing.assert_close(params["1.running_var"], rin.params["1.running_var"].mean(0))
    assert params["1.num_batches_tracked"].dtype == torch.int64
    assert params["1.num_batches_tracked"].item() == 10  # max over clients of 0 + 3k + 1
    diag = out.diagnostics
    json.dumps(diag)
    assert set(diag["fedsa"]) == TRAINABLE
    assert diag["fedsa"]["0.bias"] == {
        "M": 5,
        "H": 3,
        "macro": 2,
        "unclustered": 0,
        "skew": pytest.approx(diag["fedsa"]["0.bias"]["skew"]),
        "skew_signed": pytest.approx(diag["fedsa"]["0.bias"]["skew_signed"]),
    }
    total_m = sum(v["M"] for v in diag["fedsa"].values())
    total_h = sum(v["H"] for v in diag["fedsa"].values())
    assert total_m == 15 + 5 + 5 + 5
    assert diag["fedsa_high_frac"] == pytest.approx(total_h / total_m)


def test_combine_buffers_local_returns_broadcast_value():
    rin, glob = _round()
    uniform = torch.full((4,), 0.25, dtype=torch.float64)
    params, _, _ = FedSACombine(C=3, S=2, buffers="local")(rin, uniform, None, None)
    for name in ("1.running_mean", "1.running_var", "1.num_batches_tracked"):
        assert torch.equal(params[name], glob[name])
        assert params[name].data_ptr() != glob[name].data_ptr()  # a copy, not an alias
    _approx(params["0.bias"], [2.0, 0.625, 2.1, 1.2, 2.0])


def test_combine_samples_weighting_changes_only_low_region():
    rin, _ = _round(num_samples=[10, 10, 10, 50])
    uni = Aggregation(SampleWeights(), FedSACombine(C=3, S=2))
    smp = Aggregation(SampleWeights(), FedSACombine(C=3, S=2, low_weighting="samples"))
    out_u, _ = uni.aggregate(rin, uni.init(None))
    out_s, _ = smp.aggregate(rin, smp.init(None))
    _approx(out_u.global_params["0.bias"], [2.0, 0.625, 2.1, 1.2, 2.0])
    _approx(out_s.global_params["0.bias"], [2.0, 0.625, 2.1, 1.2, 1.0])  # only position 4 (low, mean 2 -> 1)
    # buffers stay a plain mean in both
    torch.testing.assert_close(out_s.global_params["1.running_mean"], out_u.global_params["1.running_mean"])


def test_combine_refuses_masks():
    rin, _ = _round()
    masks = {n: torch.ones_like(t, dtype=torch.bool) for n, t in rin.params.items()}
    with pytest.raises(ValueError, match="masks"):
        FedSACombine()(rin, torch.full((4,), 0.25, dtype=torch.float64), masks, None)


@pytest.mark.parametrize(
    "kwargs, msg",
    [
        ({"lam": 1.5}, "lam"),
        ({"lam": -0.1}, "lam"),
        ({"delta": float("nan")}, "delta"),
        ({"C": 0}, "C"),
        ({"C": 2.5}, "C"),
        ({"S": 0}, "S"),
        ({"S": True}, "S"),
        ({"micro_norm": "minmax"}, "micro_norm"),
        ({"alpha_norm": "sum"}, "alpha_norm"),
        ({"low_weighting": "size"}, "low_weighting"),
        ({"buffers": "max"}, "buffers"),
        ({"cv_norm": "zscore"}, "cv_norm"),
    ],
)
def test_combine_validates_hyperparameters(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        FedSACombine(**kwargs)


def test_combine_defaults_are_the_paper_cifar10_values():
    c = FedSACombine()
    assert (c.lam, c.delta, c.C, c.S) == (0.2, 0.2, 4, 4)
    assert (c.micro_norm, c.alpha_norm, c.low_weighting, c.buffers, c.cv_norm) == (
        "layer_minmax",
        "per_position",
        "uniform",
        "mean",
        "minmax",
    )
