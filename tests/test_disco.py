"""FedDisco weights reproduce the spec's worked examples (methods.md 2.7, section 6 items 6-11)."""

from dataclasses import replace

import numpy as np
import pytest
import torch

from fedskew.catalog.disco import DiscoWeights, disco_terms, disco_weights, discrepancy
from fedskew.protocol import ServerContext, Upload
from fedskew.server.api import Aggregation
from fedskew.server.combine import WeightedMean
from fedskew.server.uploads import stack_uploads

TOL = 1e-5
E1_HISTS = np.array([[10, 10, 10], [20, 0, 0], [30, 10, 10]], dtype=float)
E1_MODELS = [[1.0, 0.0, 2.0, -1.0], [3.0, 3.0, 3.0, 3.0], [0.0, 1.0, 1.0, 1.0]]


def _rin(models, hists, cids=None):
    hists = np.asarray(hists, dtype=float)
    cids = cids if cids is not None else list(range(len(models)))
    ups = [
        Upload(cid, {"w": torch.tensor(m, dtype=torch.float64)}, int(h.sum()))
        for cid, m, h in zip(cids, models, hists, strict=True)
    ]
    return stack_uploads(
        ups,
        rnd=1,
        global_params={"w": torch.zeros(len(models[0]), dtype=torch.float64)},
        trainable=frozenset({"w"}),
        label_hists=hists,
    )


def _weights(weighting, rin):
    w, state = weighting(rin, None, weighting.init(None))
    assert w.dtype == torch.float64 and state is None
    assert float(w.sum()) == pytest.approx(1.0, abs=1e-12)
    return w.numpy()


# ------------------------------------------------------------------------------------------ worked examples


def test_e1_kl_discrepancies_weights_and_aggregate():
    assert discrepancy(E1_HISTS, None, "kl") == pytest.approx([0.0, 1.098612, 0.148342], abs=TOL)
    terms = DiscoWeights().terms(_rin(E1_MODELS, E1_HISTS))
    assert terms.n == pytest.approx([0.3, 0.2, 0.5], abs=TOL)
    assert terms.d == pytest.approx([0.0, 0.881037, 0.118963], abs=TOL)
    assert terms.d.sum() == pytest.approx(1.0, abs=1e-12)  # kl is normalized over the participants
    assert terms.raw == pytest.approx([0.4, -0.140518, 0.540518], abs=TOL)
    assert not terms.fallback

    agg = Aggregation(DiscoWeights(), WeightedMean())
    out, _ = agg.aggregate(_rin(E1_MODELS, E1_HISTS), agg.init(None))
    assert out.diagnostics["weights"] == pytest.approx([0.425297, 0.0, 0.574703], abs=TOL)
    assert out.global_params["w"].tolist() == pytest.approx([0.425297, 0.574703, 1.425297, 0.149405], abs=TOL)


def test_e2_partial_participation_renormalizes_n_and_d():
    rin = _rin([E1_MODELS[0], E1_MODELS[2]], E1_HISTS[[0, 2]], cids=[0, 2])
    terms = DiscoWeights().terms(rin)
    assert terms.n == pytest.approx([0.375, 0.625], abs=TOL)
    assert terms.d == pytest.approx([0.0, 1.0], abs=TOL)
    assert terms.weights == pytest.approx([0.678571, 0.321429], abs=TOL)
    agg = Aggregation(DiscoWeights(), WeightedMean())
    out, _ = agg.aggregate(rin, agg.init(None))
    assert out.global_params["w"].tolist() == pytest.approx([0.678571, 0.321429, 1.678571, -0.357143], abs=TOL)


def test_e3_l2_is_not_normalized():
    assert discrepancy(E1_HISTS, None, "l2") == pytest.approx([0.0, 0.816497, 0.326599], abs=TOL)
    terms = DiscoWeights(metric="l2").terms(_rin(E1_MODELS, E1_HISTS))
    assert terms.d == pytest.approx([0.0, 0.816497, 0.326599], abs=TOL)
    assert terms.raw == pytest.approx([0.4, -0.108248, 0.436701], abs=TOL)
    assert terms.weights == pytest.approx([0.478068, 0.0, 0.521932], abs=TOL)


def test_e4_niid2_structure():
    hists = np.zeros((6, 10))
    for i in range(5):
        hists[i, [2 * i, 2 * i + 1]] = 50
    hists[5] = 10
    d = discrepancy(hists, None, "kl")
    assert d == pytest.approx([1.609438] * 5 + [0.0], abs=TOL)
    w = _weights(DiscoWeights(), _rin([[0.0]] * 6, hists))
    assert w == pytest.approx([0.151515] * 5 + [0.242424], abs=TOL)


def test_e5_all_iid_flattens_toward_uniform():
    hists = np.array([[15, 15], [10, 10], [25, 25]], dtype=float)
    terms = DiscoWeights().terms(_rin([[0.0]] * 3, hists))
    assert terms.d.tolist() == [0.0, 0.0, 0.0]  # KL sum 0 -> every d_k = 0
    assert terms.weights == pytest.approx([0.307692, 0.230769, 0.461538], abs=TOL)


def test_fallback_to_size_weights_when_every_raw_weight_is_non_positive():
    hists = np.zeros((3, 10))
    hists[0, 0], hists[1, 3], hists[2, 7] = 10, 30, 60  # one class each: l1 = 1.8
    terms = DiscoWeights(metric="l1").terms(_rin([[0.0]] * 3, hists))
    assert terms.d == pytest.approx([1.8] * 3, abs=TOL)
    assert np.all(terms.raw <= 0) and terms.fallback
    assert terms.weights == pytest.approx([0.1, 0.3, 0.6], abs=TOL)


# ------------------------------------------------------------------------------------ other metrics, target


def test_l1_and_cosine_on_e1_clients():
    assert _weights(DiscoWeights(metric="l1"), _rin(E1_MODELS, E1_HISTS)) == pytest.approx(
        [0.545455, 0.0, 0.454545], abs=TOL
    )
    assert discrepancy(E1_HISTS, None, "cosine") == pytest.approx([0.0, 0.422650, 0.129612], abs=TOL)
    assert _weights(DiscoWeights(metric="cosine"), _rin(E1_MODELS, E1_HISTS)) == pytest.approx(
        [0.390675, 0.086608, 0.522717], abs=TOL
    )


@pytest.mark.parametrize("num_classes", [6, 7, 13, 15, 21, 24, 26])
def test_cosine_of_a_histogram_proportional_to_the_target_is_exactly_zero(num_classes):
    # 1 - cos rounds to -2.2e-16 for these class counts; spec 2.3: d >= 0, so it is clipped at 0 (as kl is)
    balanced = np.full(num_classes, 7.0)
    skewed = np.zeros(num_classes)
    skewed[0] = 30.0
    hists = np.stack([balanced, skewed])
    w = _weights(DiscoWeights(metric="cosine"), _rin([[1.0], [2.0]], hists))  # used to raise ValueError
    d = discrepancy(hists, None, "cosine")
    assert d[0] == 0.0 and d[1] > 0
    n = np.array([7.0 * num_classes, 30.0]) / (7.0 * num_classes + 30.0)
    raw = n - 0.5 * d + 0.1
    assert w == pytest.approx(np.maximum(raw, 0) / np.maximum(raw, 0).sum(), abs=1e-12)


def test_cosine_with_a_proportional_non_uniform_target_is_not_negative():
    rng = np.random.default_rng(0)
    for _ in range(200):
        c = int(rng.integers(2, 40))
        t = rng.integers(1, 9, size=c).astype(float)
        hists = np.stack([t * int(rng.integers(1, 50)) for _ in range(3)])
        assert (discrepancy(hists, t, "cosine") >= 0).all()


def test_only_iid_drops_non_iid_clients_and_falls_back_when_all_dropped():
    # cos to uniform: 1, 0.577, 0.870 -> only client 0 counts as IID
    assert discrepancy(E1_HISTS, None, "only_iid").tolist() == [0.01, np.inf, np.inf]
    assert _weights(DiscoWeights(metric="only_iid"), _rin(E1_MODELS, E1_HISTS)) == pytest.approx([1.0, 0.0, 0.0])
    # a = 0 must not turn 0·inf into NaN
    assert _weights(DiscoWeights(a=0.0, metric="only_iid"), _rin(E1_MODELS, E1_HISTS)) == pytest.approx([1.0, 0.0, 0.0])
    terms = disco_terms(np.array([20.0, 50.0]), np.array([np.inf, np.inf]), metric="only_iid")
    assert terms.fallback and terms.weights == pytest.approx([20 / 70, 50 / 70])


def test_kl_with_non_uniform_target_is_rescaled_to_sum_one():
    assert discrepancy(E1_HISTS, np.array([0.5, 0.25, 0.25]), "kl") == pytest.approx(
        [0.056633, 0.693147, 0.020136], abs=TOL
    )
    expected = [0.382280, 0.0, 0.617720]
    for target in [(0.5, 0.25, 0.25), (2, 1, 1)]:
        assert _weights(DiscoWeights(target=target), _rin(E1_MODELS, E1_HISTS)) == pytest.approx(expected, abs=TOL)


def test_disco_weights_function_matches_the_weighting():
    d = discrepancy(E1_HISTS, None, "kl")
    w = disco_weights(np.array([30.0, 20.0, 50.0]), d, metric="kl")
    assert w == pytest.approx([0.425297, 0.0, 0.574703], abs=TOL)
    # other a, b: n - a d + b = [0.3, 0.2 - 0.881037 = -0.681037, 0.5 - 0.118963 = 0.381037]
    w = disco_weights(np.array([30.0, 20.0, 50.0]), d, metric="kl", a=1.0, b=0.0)
    assert w == pytest.approx([0.3 / 0.681037, 0.0, 0.381037 / 0.681037], abs=TOL)


def test_permuting_clients_permutes_weights():
    perm = [2, 0, 1]
    w = _weights(DiscoWeights(), _rin(E1_MODELS, E1_HISTS))
    wp = _weights(DiscoWeights(), _rin([E1_MODELS[i] for i in perm], E1_HISTS[perm]))
    assert wp == pytest.approx(w[perm], abs=1e-12)


# ----------------------------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "kwargs, msg",
    [
        ({"metric": "kld"}, "unknown FedDisco metric"),
        ({"a": -0.1}, "a must be"),
        ({"a": float("nan")}, "a must be"),
        ({"b": float("inf")}, "b must be"),
        ({"b": "0.1"}, "b must be"),
        ({"target": (0.5, 0.5, 0.0)}, "strictly positive"),
        ({"target": (0.5, -0.5, 1.0), "metric": "l2"}, "non-negative"),
        ({"target": (0.0, 0.0), "metric": "l1"}, "positive sum"),
    ],
)
def test_invalid_fields_are_refused(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        DiscoWeights(**kwargs)


def test_zero_target_entry_is_fine_for_non_kl_metrics():
    w = _weights(DiscoWeights(metric="l2", target=(1.0, 0.0, 0.0)), _rin(E1_MODELS, E1_HISTS))
    assert np.all(w >= 0) and w.sum() == pytest.approx(1.0)


def test_target_length_must_match_the_task():
    ctx = ServerContext(2, 4, {}, frozenset(), np.array([1, 1]), np.ones((2, 4)))
    with pytest.raises(ValueError, match="4 classes"):
        DiscoWeights(target=(1.0, 1.0, 1.0)).init(ctx)
    with pytest.raises(ValueError, match="expected \\(3,\\)"):
        discrepancy(E1_HISTS, np.ones(4), "kl")


def test_bad_histograms_are_refused():
    with pytest.raises(ValueError, match="empty label histogram"):
        discrepancy(np.array([[1.0, 1.0], [0.0, 0.0]]), None, "kl")
    with pytest.raises(ValueError, match="non-negative"):
        discrepancy(np.array([[1.0, -1.0]]), None, "kl")
    with pytest.raises(ValueError, match="one row per participant"):
        DiscoWeights().terms(replace(_rin(E1_MODELS[:2], E1_HISTS[:2]), label_hists=E1_HISTS))
    with pytest.raises(ValueError, match="num_samples"):
        disco_weights(np.array([1.0, 0.0]), np.array([0.1, 0.2]), metric="l2")
    with pytest.raises(ValueError, match="infinite discrepancy"):
        disco_weights(np.array([1.0, 1.0]), np.array([0.1, np.inf]), metric="l2")
