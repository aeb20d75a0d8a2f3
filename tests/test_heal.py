"""FedHEAL (FPHL masks + FAEL weights) reproduces the spec example (methods.md 4.7, section 6 items 16-18)."""

import numpy as np
import pytest
import torch

from fedskew.catalog.heal import FaelWeights, HealMasks, SignHistory, fael_distances, heal_aggregation
from fedskew.protocol import ServerContext, Upload
from fedskew.server.api import Aggregation
from fedskew.server.combine import WeightedMean
from fedskew.server.uploads import stack_uploads
from fedskew.server.weights import SampleWeights, UniformWeights

TOL = 1e-5
F64 = torch.float64

# spec 4.7: N = 3 clients, one 4-element tensor, W^0 = 0
R0 = [[1.0, 1.0, -1.0, 0.5], [2.0, -1.0, -1.0, -0.5], [-1.0, 1.0, 1.0, 1.0]]
R1 = [[0.5, -0.2, -0.3, 0.4], [-0.4, -0.5, 0.2, -0.1], [-0.2, 0.3, 0.6, -0.2]]
W1 = [0.693908, 0.297152, -0.342484, 0.312955]
W2 = [0.839087, 0.193924, -0.186286, 0.457495]


def _ctx(n=3, sizes=None):
    sizes = np.full(n, 100) if sizes is None else np.asarray(sizes)
    return ServerContext(n, 2, {"w": torch.zeros(4, dtype=F64)}, frozenset({"w"}), sizes, np.ones((n, 2)))


def _rin(glob, deltas, cids=None, sizes=None, extra=None):
    """Round input whose client c uploads ``glob + delta`` (``extra(cid)``: further tensors)."""
    cids = list(range(len(deltas))) if cids is None else cids
    sizes = [100] * len(deltas) if sizes is None else sizes
    ups = []
    for cid, delta, n in zip(cids, deltas, sizes, strict=True):
        params = {"w": glob["w"] + torch.tensor(delta, dtype=F64), **(extra(cid) if extra else {})}
        ups.append(Upload(cid, params, n))
    return stack_uploads(ups, rnd=0, global_params=glob, trainable=frozenset({"w"}), label_hists=np.ones((len(ups), 2)))


def _zeros():
    return {"w": torch.zeros(4, dtype=F64)}


def _masks(out_masks):
    return out_masks["w"].to(torch.int64).tolist()


# ------------------------------------------------------------------------------------------- worked example


def test_worked_example_two_rounds():
    agg = heal_aggregation()
    state = agg.init(_ctx())
    masking, weighting = agg.masking, agg.weighting

    # round 0: everything kept, tables from the signs, FAEL from the unmasked distances
    rin0 = _rin(_zeros(), R0)
    m0, _ = masking(rin0, state.masking)
    assert _masks(m0) == [[1, 1, 1, 1]] * 3
    assert fael_distances(rin0, m0) == pytest.approx([1.802776, 2.5, 2.0], abs=TOL)
    out0, state = agg.aggregate(rin0, state)
    tables = state.masking
    assert [tables[c].proportion("w").tolist() for c in range(3)] == [
        [1, 1, 0, 1],
        [1, 0, 0, 0],
        [0, 1, 1, 1],
    ]
    assert all(tables[c].rounds == 1 for c in range(3))
    fael = state.weighting.clients
    assert [fael[c].dp for c in range(3)] == pytest.approx([0.114412, 0.158660, 0.126928], abs=TOL)
    assert [fael[c].p for c in range(3)] == pytest.approx([0.447745, 0.491994, 0.460262], abs=TOL)
    assert out0.diagnostics["weights"] == pytest.approx([0.319818, 0.351424, 0.328758], abs=TOL)
    assert out0.global_params["w"].tolist() == pytest.approx(W1, abs=TOL)

    # round 1: masks from the round-0 tables, then the tables advance
    glob1 = out0.global_params
    rin1 = _rin(glob1, R1)
    m1, _ = masking(rin1, state.masking)
    assert _masks(m1) == [[1, 0, 1, 1], [0, 1, 0, 1], [1, 1, 1, 0]]
    assert fael_distances(rin1, m1) == pytest.approx([0.707107, 0.509902, 0.7], abs=TOL)
    w1, _ = weighting(rin1, m1, state.weighting)
    q = (w1.unsqueeze(1) * m1["w"].to(F64)) / (w1.unsqueeze(1) * m1["w"].to(F64)).sum(0)
    assert q.T.tolist()[0] == pytest.approx([0.493114, 0, 0.506886], abs=TOL)
    assert q.T.tolist()[1] == pytest.approx([0, 0.504035, 0.495965], abs=TOL)
    assert q.T.tolist()[2] == pytest.approx([0.493114, 0, 0.506886], abs=TOL)
    assert q.T.tolist()[3] == pytest.approx([0.489080, 0.510920, 0], abs=TOL)

    out1, state = agg.aggregate(rin1, state)
    tables = state.masking
    assert [tables[c].proportion("w").tolist() for c in range(3)] == [
        [1, 0.5, 0, 1],
        [0.5, 0, 0.5, 0],
        [0, 1, 1, 0.5],
    ]
    fael = state.weighting.clients
    assert [fael[c].dp for c in range(3)] == pytest.approx([0.216191, 0.201591, 0.222218], abs=TOL)
    assert [fael[c].p for c in range(3)] == pytest.approx([0.663936, 0.693585, 0.682479], abs=TOL)
    assert out1.diagnostics["weights"] == pytest.approx([0.325459, 0.339993, 0.334549], abs=TOL)
    assert out1.global_params["w"].tolist() == pytest.approx(W2, abs=TOL)


def test_paper_distance_variant_round0():
    weighting = FaelWeights(distance="squared")
    rin0 = _rin(_zeros(), R0)
    assert fael_distances(rin0, None, "squared") == pytest.approx([3.25, 6.25, 4.0], abs=TOL)
    _, st = weighting(rin0, None, weighting.init(_ctx()))
    shares = [st.clients[c].dp / 0.4 for c in range(3)]
    assert shares == pytest.approx([0.240741, 0.462963, 0.296296], abs=TOL)


def test_paper_threshold_variant_keeps_ties():
    # client 1 after round 0: table [1,0,0,0] (n = 1); an update [-1, 1, ...] has consistency 0 at e0, 0 at e1
    masking = HealMasks(tau=0.0, strict=False)
    _, st = masking(_rin(_zeros(), R0), masking.init(None))
    m, _ = masking(_rin(_zeros(), R1), st)
    assert _masks(m) == [[1] * 4] * 3  # c >= 0 always
    strict = HealMasks(tau=0.0)
    _, st = strict(_rin(_zeros(), R0), strict.init(None))
    m, _ = strict(_rin(_zeros(), R1), st)
    assert _masks(m) == [[1, 0, 1, 1], [0, 1, 0, 1], [1, 1, 1, 0]]  # c > 0: the same masks as tau = 0.3 here


# -------------------------------------------------------------------------------------- masks: corner cases


def test_element_that_nobody_keeps_is_unchanged():
    glob = {"w": torch.tensor([0.5, -0.25, 2.0, 1.0], dtype=F64)}
    agg = heal_aggregation(tau=0.3)
    state = agg.init(_ctx())
    _, state = agg.aggregate(_rin(glob, [[1.0, 1.0, 1.0, 1.0]] * 3), state)
    # every client reverses element 0 and 1 (consistency 0 -> masked), keeps the direction of 2 and 3
    out, _ = agg.aggregate(_rin(glob, [[-1.0, -2.0, 3.0, 1.0], [-2.0, -1.0, 1.0, 2.0], [-3.0, -1.0, 2.0, 3.0]]), state)
    w = out.diagnostics["weights"]
    assert out.global_params["w"][:2].tolist() == [0.5, -0.25]
    assert out.global_params["w"][2].item() == pytest.approx(2.0 + w[0] * 3 + w[1] * 1 + w[2] * 2, abs=1e-12)


def test_tau_at_least_one_freezes_the_model_and_shares_fall_back_to_uniform():
    agg = heal_aggregation(tau=1.0)
    state = agg.init(_ctx())
    out0, state = agg.aggregate(_rin(_zeros(), R0), state)
    dp0 = [state.weighting.clients[c].dp for c in range(3)]
    out1, state = agg.aggregate(_rin(out0.global_params, R1), state)
    assert torch.equal(out1.global_params["w"], out0.global_params["w"])
    # all masked -> every distance 0 -> share 1/K, the momentum update still runs
    dp1 = [state.weighting.clients[c].dp for c in range(3)]
    assert dp1 == pytest.approx([0.6 * d + 0.4 / 3 for d in dp0], abs=1e-12)


def test_consistency_tie_after_ten_rounds_is_decided_exactly():
    # per element, number of non-negative updates in 10 rounds: 7, 3, 4, 8
    nonneg = [7, 3, 4, 8]
    strict, loose = HealMasks(tau=0.3), HealMasks(tau=0.3, strict=False)
    st_s, st_l = strict.init(None), loose.init(None)
    for r in range(10):
        delta = [[1.0 if r < k else -1.0 for k in nonneg]]
        _, st_s = strict(_rin(_zeros(), delta), st_s)
        _, st_l = loose(_rin(_zeros(), delta), st_l)
    assert st_s[0].rounds == 10 and st_s[0].nonneg["w"].tolist() == nonneg
    assert (1 - 0.7) > 0.3  # why floats would get this wrong
    # round 11 update signs: -, +, +, -  -> consistency 3/10, 3/10, 4/10, 2/10
    last = [[-1.0, 1.0, 1.0, -1.0]]
    m_s, _ = strict(_rin(_zeros(), last), st_s)
    m_l, _ = loose(_rin(_zeros(), last), st_l)
    assert _masks(m_s) == [[0, 0, 1, 0]]
    assert _masks(m_l) == [[1, 1, 1, 0]]


def test_zero_update_counts_as_non_negative():
    masking = HealMasks()
    _, st = masking(_rin(_zeros(), [[0.0, -1.0, 1.0, 0.0]]), masking.init(None))
    assert st[0].nonneg["w"].tolist() == [1, 0, 1, 1]


def test_buffers_float_masked_integer_untouched_distance_excludes_buffers():
    def extra(cid):
        return {"bn.mean": torch.tensor([1.0, -1.0]) * (cid + 1), "bn.n": torch.tensor(5 + cid)}

    glob = {**_zeros(), "bn.mean": torch.zeros(2), "bn.n": torch.tensor(3)}
    masking = HealMasks()
    rin = _rin(glob, R0, extra=extra)
    masks, st = masking(rin, masking.init(None))
    assert set(masks) == {"w", "bn.mean", "bn.n"}
    assert masks["bn.n"].dtype == torch.bool and masks["bn.n"].all()
    assert set(st[0].nonneg) == {"w", "bn.mean"}  # float buffers are tracked, integer ones are not
    assert st[2].nonneg["bn.mean"].tolist() == [1, 0]
    assert fael_distances(rin, masks) == pytest.approx([1.802776, 2.5, 2.0], abs=TOL)
    # second round: bn.mean flips sign for everyone -> masked, keeps the broadcast value; bn.n takes the max
    agg = heal_aggregation()
    state = agg.init(_ctx())
    out, state = agg.aggregate(rin, state)
    glob2 = out.global_params
    out2, _ = agg.aggregate(
        _rin(
            glob2,
            R1,
            extra=lambda c: {
                "bn.mean": glob2["bn.mean"] - torch.tensor([1.0, -1.0]),
                "bn.n": glob2["bn.n"] + 1,
            },
        ),
        state,
    )
    assert torch.equal(out2.global_params["bn.mean"], glob2["bn.mean"])
    assert out2.global_params["bn.n"].item() == 8


def test_state_is_not_mutated():
    masking, weighting = HealMasks(), FaelWeights()
    ms, ws = masking.init(None), weighting.init(_ctx())
    rin0 = _rin(_zeros(), R0)
    m0, ms1 = masking(rin0, ms)
    _, ws1 = weighting(rin0, m0, ws)
    assert ms == {} and ws.clients == {}
    snapshot = {c: ms1[c].nonneg["w"].clone() for c in ms1}
    fael_snapshot = dict(ws1.clients)
    rin1 = _rin(_zeros(), R1)
    m1a, ms2 = masking(rin1, ms1)
    w1a, _ = weighting(rin1, m1a, ws1)
    assert all(torch.equal(ms1[c].nonneg["w"], snapshot[c]) and ms1[c].rounds == 1 for c in ms1)
    assert ws1.clients == fael_snapshot
    m1b, _ = masking(rin1, ms1)  # replaying a round from the same state gives the same answer
    w1b, _ = weighting(rin1, m1b, ws1)
    assert torch.equal(m1a["w"], m1b["w"]) and torch.equal(w1a, w1b)
    assert ms2[0] is not ms1[0]


# ------------------------------------------------------------------------------------ partial participation


def test_absent_client_keeps_its_table_and_momentum():
    agg = heal_aggregation()
    state = agg.init(_ctx())
    out0, state = agg.aggregate(_rin(_zeros(), R0), state)
    table1, fael1 = state.masking[1], state.weighting.clients[1]

    # round 1: clients 0 and 2 only
    glob1 = out0.global_params
    rin1 = _rin(glob1, [R1[0], R1[2]], cids=[0, 2])
    masks, _ = agg.masking(rin1, state.masking)
    assert _masks(masks) == [[1, 0, 1, 1], [1, 1, 1, 0]]
    out1, state = agg.aggregate(rin1, state)
    assert state.masking[1] is table1 and state.weighting.clients[1] is fael1
    fael = state.weighting.clients
    assert [fael[0].p, fael[2].p] == pytest.approx([0.717402, 0.735408], abs=TOL)
    assert [fael[0].dp, fael[2].dp] == pytest.approx([0.269657, 0.275147], abs=TOL)
    assert out1.diagnostics["weights"] == pytest.approx([0.493803, 0.506197], abs=TOL)
    assert out1.global_params["w"].tolist() == pytest.approx([0.839570, 0.597152, -0.186906, 0.712955], abs=TOL)

    # round 2: client 1 returns alone; its mask uses its own one-round table [1,0,0,0], not the round index
    glob2 = out1.global_params
    rin2 = _rin(glob2, [R1[1]], cids=[1])
    masks, _ = agg.masking(rin2, state.masking)
    assert _masks(masks) == [[0, 1, 0, 1]]
    out2, state = agg.aggregate(rin2, state)
    assert state.masking[1].rounds == 2
    assert state.masking[1].proportion("w").tolist() == [0.5, 0, 0.5, 0]
    assert state.weighting.clients[1].dp == pytest.approx(0.495196, abs=TOL)
    assert state.weighting.clients[1].p == pytest.approx(0.987190, abs=TOL)
    assert out2.global_params["w"].tolist() == pytest.approx([0.839570, 0.097152, -0.186906, 0.612955], abs=TOL)


@pytest.mark.parametrize("uniform_over, p0", [("participants", 0.5), ("clients", 0.25)])
def test_client_first_seen_later_is_unmasked_and_starts_from_p0(uniform_over, p0):
    # p0 = 1/|K^t| = 1/2 (spec 4.2, N8) or, with uniform_over='clients', 1/N = 1/4
    agg = heal_aggregation(uniform_over=uniform_over)
    state = agg.init(_ctx(n=4))
    _, state = agg.aggregate(_rin(_zeros(), R0), state)
    masks, _ = agg.masking(_rin(_zeros(), [R1[0], [-1.0, -1.0, -1.0, -1.0]], cids=[0, 3]), state.masking)
    assert _masks(masks) == [[1, 0, 1, 1], [1, 1, 1, 1]]
    _, state = agg.aggregate(_rin(_zeros(), [R1[0], [-1.0, -1.0, -1.0, -1.0]], cids=[0, 3]), state)
    d3 = 2.0  # ||[-1,-1,-1,-1]||
    d0 = float(np.linalg.norm([0.5, -0.3, 0.4]))
    assert state.weighting.clients[3].dp == pytest.approx(0.4 * d3 / (d0 + d3), abs=1e-12)
    assert state.weighting.clients[3].p == pytest.approx(p0 + 0.4 * d3 / (d0 + d3), abs=1e-12)


# ------------------------------------------------------------------------------------ beta = 0 equivalences


def _random_rounds(seed=0, rounds=4, n=5, full=False):
    gen = torch.Generator().manual_seed(seed)
    plan = []
    for r in range(rounds):
        cids = list(range(n)) if full else sorted(torch.randperm(n, generator=gen)[: 3 + r % 2].tolist())
        deltas = [torch.randn(4, generator=gen, dtype=F64).tolist() for _ in cids]
        plan.append((cids, deltas))
    return plan


SIZES = [50, 120, 300, 75, 900]


@pytest.mark.parametrize(
    "fael_init, uniform_over, full, reference",
    [
        ("datasize", "participants", False, SampleWeights()),
        ("uniform", "clients", False, UniformWeights()),
        # 1/|K^t| is uniform whenever every client first joins in rounds of equal size (full participation)
        ("uniform", "participants", True, UniformWeights()),
    ],
)
def test_beta_zero_without_fphl_equals_fedavg(fael_init, uniform_over, full, reference):
    heal = heal_aggregation(tau=-1.0, beta=0.0, fael_init=fael_init, uniform_over=uniform_over)
    ref = Aggregation(reference, WeightedMean())
    ctx = _ctx(n=5, sizes=SIZES)
    hs, rs = heal.init(ctx), ref.init(ctx)
    glob_h = glob_r = _zeros()
    for cids, deltas in _random_rounds(full=full):
        sizes = [SIZES[c] for c in cids]
        out_h, hs = heal.aggregate(_rin(glob_h, deltas, cids, sizes), hs)
        out_r, rs = ref.aggregate(_rin(glob_r, deltas, cids, sizes), rs)
        assert out_h.diagnostics["weights"] == pytest.approx(out_r.diagnostics["weights"], abs=1e-12)
        assert torch.allclose(out_h.global_params["w"], out_r.global_params["w"], atol=1e-12)
        glob_h, glob_r = out_h.global_params, out_r.global_params
    assert hs.masking == {}  # FPHL disabled keeps no tables


def test_beta_zero_with_fphl_gives_masked_fedavg():
    sizes = [100, 300, 600]
    heal = heal_aggregation(tau=0.3, beta=0.0, fael_init="datasize")
    ref = Aggregation(SampleWeights(), WeightedMean(), masking=HealMasks(tau=0.3))
    ctx = _ctx(sizes=sizes)
    hs, rs = heal.init(ctx), ref.init(ctx)
    out_h, hs = heal.aggregate(_rin(_zeros(), R0, sizes=sizes), hs)
    out_r, rs = ref.aggregate(_rin(_zeros(), R0, sizes=sizes), rs)
    assert out_h.global_params["w"].tolist() == pytest.approx([0.1, 0.4, 0.2, 0.5], abs=1e-12)
    glob = out_h.global_params
    out_h, _ = heal.aggregate(_rin(glob, R1, sizes=sizes), hs)
    out_r, _ = ref.aggregate(_rin(glob, R1, sizes=sizes), rs)
    # masks [1,0,1,1], [0,1,0,1], [1,1,1,0]; sizes renormalized per element over the clients that keep it
    assert out_h.global_params["w"].tolist() == pytest.approx([0.0, 0.433333, 0.671429, 0.525], abs=TOL)
    assert torch.allclose(out_h.global_params["w"], out_r.global_params["w"], atol=1e-12)


# ----------------------------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "make, msg",
    [
        (lambda: HealMasks(tau=float("nan")), "tau must be"),
        (lambda: HealMasks(tau="0.3"), "tau must be"),
        (lambda: HealMasks(strict=1), "strict must be"),
        (lambda: FaelWeights(beta=1.5), "beta must be"),
        (lambda: FaelWeights(beta=-0.1), "beta must be"),
        (lambda: FaelWeights(distance="l1"), "unknown FAEL distance"),
        (lambda: FaelWeights(fael_init="zeros"), "unknown FAEL init"),
        (lambda: FaelWeights(uniform_over="all"), "unknown FAEL uniform_over"),
        (lambda: heal_aggregation(beta=2.0), "FedHEAL: beta: Input should be less than or equal to 1"),
        (lambda: FaelWeights().init(None), "needs a ServerContext"),
        (lambda: FaelWeights(fael_init="datasize").init(_ctx(sizes=[1, 0, 2])), "positive sizes"),
        (lambda: fael_distances(_rin(_zeros(), R0), None, "l3"), "unknown FAEL distance"),
    ],
)
def test_invalid_settings_are_refused(make, msg):
    with pytest.raises(ValueError, match=msg):
        make()


def test_unknown_client_id_and_changed_shapes_are_refused():
    weighting = FaelWeights()
    with pytest.raises(ValueError, match="client id 5"):
        weighting(_rin(_zeros(), [R0[0]], cids=[5]), None, weighting.init(_ctx()))
    masking = HealMasks()
    bad = {0: SignHistory({"w": torch.zeros(3, dtype=torch.int32)}, 1)}
    with pytest.raises(ValueError, match="changed shape"):
        masking(_rin(_zeros(), [R0[0]]), bad)
    bad = {0: SignHistory({"v": torch.zeros(4, dtype=torch.int32)}, 1)}
    with pytest.raises(ValueError, match="history covers"):
        masking(_rin(_zeros(), [R0[0]]), bad)


# ------------------------------------------------------------------- first FAEL weight under partial participation


def test_first_fael_weight_is_one_over_the_round_participants():
    # spec 4.2, N4, N8: a missing p_m starts at 1/|K^t|. N = 4, clients 0 and 1 only, W^0 = 0, norms 1 and 3, beta 0.4:
    # shares [0.25, 0.75] -> dp [0.1, 0.3] -> p = 1/2 + dp = [0.6, 0.8] -> weights [3/7, 4/7] -> W = 15/7
    agg = heal_aggregation(beta=0.4)
    state = agg.init(_ctx(n=4))
    rin = _rin(_zeros(), [[1.0, 0, 0, 0], [3.0, 0, 0, 0]], cids=[0, 1])
    out, state = agg.aggregate(rin, state)
    fael = state.weighting.clients
    assert [fael[0].p, fael[1].p] == pytest.approx([0.6, 0.8], abs=1e-12)
    assert out.diagnostics["weights"] == pytest.approx([3 / 7, 4 / 7], abs=1e-12)
    assert out.global_params["w"][0].item() == pytest.approx(15 / 7, abs=1e-12)  # 2.142857


def test_first_fael_weight_one_over_n_is_an_option():
    # the former fedskew rule (uniform_over='clients'): p = 1/4 + dp = [0.35, 0.55] -> W = 0.35/0.9 + 3·0.55/0.9
    agg = heal_aggregation(beta=0.4, uniform_over="clients")
    state = agg.init(_ctx(n=4))
    rin = _rin(_zeros(), [[1.0, 0, 0, 0], [3.0, 0, 0, 0]], cids=[0, 1])
    out, state = agg.aggregate(rin, state)
    fael = state.weighting.clients
    assert [fael[0].p, fael[1].p] == pytest.approx([0.35, 0.55], abs=1e-12)
    assert out.global_params["w"][0].item() == pytest.approx(2.0 / 0.9, abs=1e-12)  # 2.222222


def test_heal_plugin_passes_uniform_over():
    from fedskew.catalog.heal import HealParams
    from fedskew.methods import SERVER_PLUGINS

    pieces = SERVER_PLUGINS["heal"].build(HealParams())
    assert pieces["weighting"].uniform_over == "participants"
    pieces = SERVER_PLUGINS["heal"].build(HealParams(uniform_over="clients"))
    assert pieces["weighting"].uniform_over == "clients"
