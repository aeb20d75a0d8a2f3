"""FedCAC: the worked examples of spec section 3.7, items 12-15 of section 6, and the clarifications of section 7."""

import math

import numpy as np
import pytest
import torch

from fedskew.catalog.fedcac import (
    MASK_PREFIX,
    CriticalMasks,
    FedCAC,
    collaboration_threshold,
    collaborators,
    critical_mask,
    customized_mixing,
    overlap_matrix,
    sensitivity,
)
from fedskew.protocol import Upload
from fedskew.server.uploads import stack_uploads
from fedskew.server.weights import SampleWeights, UniformWeights

W0 = torch.tensor([1.0, -1.0, 0.5, 2.0], dtype=torch.float64)
TRAINED = [
    torch.tensor([1.5, -1.0, 0.2, 2.0], dtype=torch.float64),
    torch.tensor([1.2, -2.0, 0.5, 1.0], dtype=torch.float64),
    torch.tensor([2.0, -1.1, 0.9, 2.0], dtype=torch.float64),
]
WBAR = [1.566667, -1.366667, 0.533333, 1.666667]


def e1_round(t: int, beta: float = 2.0, extra: dict | None = None):
    """Spec E1 through the real client upload and server step: 3 clients, 1 tensor, tau 0.5."""
    upload = CriticalMasks(tau=0.5)
    ups = []
    for i, w in enumerate(TRAINED):
        params = {"w": w, **(extra[i] if extra else {})}
        received = {"w": W0, **(extra[i] if extra else {})}
        ups.append(Upload(i, params, 500, extras=upload(received, params, frozenset({"w"}))))
    glob = {"w": W0, **({k: v for k, v in extra[0].items()} if extra else {})}
    rin = stack_uploads(ups, rnd=t, global_params=glob, trainable=frozenset({"w"}), label_hists=np.ones((3, 2)))
    strategy = FedCAC(UniformWeights(), beta=beta)
    out, _ = strategy.aggregate(rin, strategy.init(None))
    return rin, out


def test_e1_sensitivity_and_masks():
    s = [sensitivity(W0, w) for w in TRAINED]
    assert torch.allclose(s[0], torch.tensor([0.75, 0, 0.06, 0], dtype=torch.float64))
    assert torch.allclose(s[1], torch.tensor([0.24, 2.0, 0, 1.0], dtype=torch.float64))
    assert torch.allclose(s[2], torch.tensor([2.0, 0.11, 0.36, 0], dtype=torch.float64))
    masks = [critical_mask(x, 0.5).int().tolist() for x in s]
    assert masks == [[1, 0, 1, 0], [0, 1, 0, 1], [1, 0, 1, 0]]


def test_e1_overlaps_threshold_collaborators():
    rin, _ = e1_round(1)
    o = overlap_matrix([rin.extras[f"{MASK_PREFIX}w"]])
    off = o[~torch.eye(3, dtype=torch.bool)].tolist()
    assert off == pytest.approx([0, 1, 0, 0, 1, 0])  # O12 O13 O21 O23 O31 O32
    assert collaboration_threshold(o, 1, 2) == pytest.approx(2 / 3)
    assert collaboration_threshold(o, 2, 2) == pytest.approx(1.0)
    assert collaboration_threshold(o, 3, 2) == pytest.approx(4 / 3)
    c = collaborators(o, collaboration_threshold(o, 1, 2))
    assert c.tolist() == [[False, False, True], [False, False, False], [True, False, False]]
    assert collaborators(o, collaboration_threshold(o, 2, 2)).tolist() == c.tolist()  # t = beta: pairs at O_max
    assert not collaborators(o, collaboration_threshold(o, 3, 2)).any()


def test_e1_new_personalized_models():
    _, out = e1_round(1)
    assert out.global_params["w"].tolist() == pytest.approx(WBAR, abs=1e-6)
    got = {cid: p["w"].tolist() for cid, p in out.personal.items()}
    assert got[0] == pytest.approx([1.75, -1.366667, 0.55, 1.666667], abs=1e-6)
    assert got[1] == pytest.approx([1.566667, -2.0, 0.533333, 1.0], abs=1e-6)
    assert got[2] == pytest.approx([1.75, -1.366667, 0.55, 1.666667], abs=1e-6)
    assert out.diagnostics["cac_threshold"] == pytest.approx(2 / 3)


def test_e1_after_beta_critical_parameters_are_purely_local():
    _, out = e1_round(3)  # Thr^3 = 4/3 > O_max: no collaborators, so u_i = w_i
    for i, w in enumerate(TRAINED):
        m = critical_mask(sensitivity(W0, w), 0.5)
        want = torch.where(m, w, torch.tensor(WBAR, dtype=torch.float64))
        assert out.personal[i]["w"].tolist() == pytest.approx(want.tolist(), abs=1e-6)


@pytest.mark.parametrize(
    "s, tau, want",
    [
        ([0.5, 0.5, 0.5, 0.1], 0.5, [1, 1, 1, 0]),  # ties at the threshold are all critical
        ([0, 0, 0, 0.3], 0.5, [0, 0, 0, 1]),  # 2nd largest 0 -> smallest positive entry
        ([0.2, 0.1, 0.4], 0.3, [0, 0, 0]),  # k = floor(0.9) = 0
        ([0.0, 0.0, 0.0, 0.0], 0.5, [1, 1, 1, 1]),  # no positive entry: thr stays 0, everything >= 0
    ],
)
def test_e2_mask_corner_cases(s, tau, want):
    assert critical_mask(torch.tensor(s, dtype=torch.float64), tau).int().tolist() == want


def test_k_is_floor_of_float_product_as_the_official_code():
    s = torch.arange(100, 0, -1, dtype=torch.float64)  # distinct values 100..1
    assert math.floor(0.29 * 100) == 28
    assert int(critical_mask(s, 0.29).sum()) == 28


def test_e3_asymmetric_overlap():
    m = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
    o = overlap_matrix([m])
    assert float(o[0, 1]) == pytest.approx(0.833333, abs=1e-6)
    assert float(o[1, 0]) == pytest.approx(0.75)


def test_overlap_over_the_concatenation_of_tensors():
    a = torch.tensor([[1, 0], [1, 1]], dtype=torch.bool)
    b = torch.tensor([[0, 0, 1], [1, 0, 0]], dtype=torch.bool)
    cat = torch.cat([a, b], dim=1)
    assert torch.equal(overlap_matrix([a, b]), overlap_matrix([cat]))


def test_empty_mask_row_is_zero_and_still_counts_in_the_statistics():
    m = torch.tensor([[0, 0, 0], [1, 1, 0], [1, 1, 0]], dtype=torch.bool)
    o = overlap_matrix([m])
    assert o[0, 1] == 0 and o[0, 2] == 0
    assert float(o[1, 2]) == 1.0 and float(o[1, 0]) == 0.5  # ||m_1 - m_0||_1 = 2 -> 1 - 2/(2*2)
    off = o[~torch.eye(3, dtype=torch.bool)]
    assert collaboration_threshold(o, 1, 1e9) == pytest.approx(float(off.mean()), abs=1e-6)


def test_all_equal_overlaps_collaborate_despite_float_rounding():
    o = torch.full((4, 4), 1 / 3, dtype=torch.float64)
    for t in (1, 7, 50):
        assert collaborators(o, collaboration_threshold(o, t, 3.0)).sum() == 12


def test_customized_mixing_is_uniform_over_self_and_collaborators():
    c = torch.tensor([[False, True, True], [False, False, False], [True, False, False]])
    a = customized_mixing(c)
    want = torch.tensor([[1 / 3, 1 / 3, 1 / 3], [0, 1, 0], [0.5, 0, 0.5]], dtype=torch.float64)
    assert torch.allclose(a, want)


def test_bn_buffers_are_untouched_by_the_server_step():
    """Spec item 15: running statistics stay each client's own (FedBN-like), integer counters too."""
    extra = [
        {"bn.running_mean": torch.tensor([float(i), 2.0 * i]), "bn.num_batches_tracked": torch.tensor(10 + i)}
        for i in range(3)
    ]
    _, out = e1_round(1, extra=extra)
    for i in range(3):
        assert torch.equal(out.personal[i]["bn.running_mean"], extra[i]["bn.running_mean"])
        assert torch.equal(out.personal[i]["bn.num_batches_tracked"], extra[i]["bn.num_batches_tracked"])


def test_sample_weighted_global_model_mirrors_fling():
    upload = CriticalMasks(tau=0.5)
    ups = [
        Upload(i, {"w": w}, n, extras=upload({"w": W0}, {"w": w}, frozenset({"w"})))
        for i, (w, n) in enumerate(zip(TRAINED, (100, 100, 200), strict=True))
    ]
    rin = stack_uploads(ups, rnd=1, global_params={"w": W0}, trainable=frozenset({"w"}), label_hists=np.ones((3, 2)))
    strategy = FedCAC(SampleWeights(), beta=2)
    out, _ = strategy.aggregate(rin, strategy.init(None))
    want = 0.25 * TRAINED[0] + 0.25 * TRAINED[1] + 0.5 * TRAINED[2]
    assert torch.allclose(out.global_params["w"], want)


def test_missing_masks_are_refused():
    ups = [Upload(i, {"w": w}, 10) for i, w in enumerate(TRAINED)]
    rin = stack_uploads(ups, rnd=1, global_params={"w": W0}, trainable=frozenset({"w"}), label_hists=np.ones((3, 2)))
    with pytest.raises(ValueError, match="critical masks"):
        FedCAC(UniformWeights()).aggregate(rin, FedCAC(UniformWeights()).init(None))


def test_single_participant_keeps_its_model():
    upload = CriticalMasks(tau=0.5)
    up = Upload(4, {"w": TRAINED[0]}, 10, extras=upload({"w": W0}, {"w": TRAINED[0]}, frozenset({"w"})))
    rin = stack_uploads([up], rnd=1, global_params={"w": W0}, trainable=frozenset({"w"}), label_hists=np.ones((1, 2)))
    out, _ = FedCAC(UniformWeights()).aggregate(rin, FedCAC(UniformWeights()).init(None))
    assert torch.equal(out.personal[4]["w"], TRAINED[0])


def test_all_empty_masks_mean_nobody_collaborates():
    """Spec 3.5: ||m_i||_1 = 0 -> O_ij = 0 and C_i = ∅. K = 2, one 1-element tensor, tau = 0.5 (k = 0): every mask
    is empty, every overlap 0, Thr = 0; the collaborator sets must still be empty."""
    upload = CriticalMasks(tau=0.5)
    w0 = torch.tensor([1.0], dtype=torch.float64)
    trained = [torch.tensor([2.0], dtype=torch.float64), torch.tensor([3.0], dtype=torch.float64)]
    ups = [Upload(i, {"w": w}, 10, extras=upload({"w": w0}, {"w": w}, frozenset({"w"}))) for i, w in enumerate(trained)]
    rin = stack_uploads(ups, rnd=1, global_params={"w": w0}, trainable=frozenset({"w"}), label_hists=np.ones((2, 2)))
    masks = rin.extras[f"{MASK_PREFIX}w"]
    assert not masks.any()
    strategy = FedCAC(UniformWeights(), beta=100.0)
    out, _ = strategy.aggregate(rin, strategy.init(None))
    assert out.diagnostics["cac_threshold"] == 0.0
    assert out.diagnostics["cac_collaborators_mean"] == 0.0
    o = overlap_matrix([masks])
    assert collaboration_threshold(o, 1, 100.0) == 0.0
    assert not collaborators(o, 0.0, masks=[masks]).any()
    for i in range(2):  # no critical parameter: every client takes the global model
        assert out.personal[i]["w"].tolist() == pytest.approx([2.5])


def test_client_with_empty_mask_has_no_collaborators_but_can_be_one():
    m = torch.tensor([[0, 0, 0], [1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    o = overlap_matrix([m])
    # threshold 0: every defined overlap passes; row 0 (empty mask) stays empty, O_10 = 0.5 and O_20 = 0.5 pass
    c = collaborators(o, 0.0, masks=[m])
    assert c.tolist() == [[False, False, False], [True, False, True], [True, True, False]]
