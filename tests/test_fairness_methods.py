"""Issue 14: the FedHEAL paper's comparisons: FedProto and FedProc hosts, the AFL, q-FFL and FedFV server plug-ins.

Hand-checkable server steps (q = 0 is FedAvg, a zero AFL step is uniform averaging, FedFV without conflicts is
FedAvg, FedFV's projections and q-FFL's step written out), the prototype aggregation and losses against written-out
formulas, and the loss before and after training. Whole runs: tests/test_fairness_runs.py."""

import math

import numpy as np
import pytest
import torch
from conftest import digits_simulation, same_params, without_timing

from fedskew.catalog.fairness import (
    AflWeights,
    FedFVCombine,
    FedFVState,
    QfflCombine,
    project_simplex,
    qffl_coefficients,
    qffl_lipschitz,
)
from fedskew.catalog.prototypes import (
    GLOBAL_PRESENT,
    GLOBAL_PROTOS,
    PROTO_COUNT,
    PROTO_MEAN,
    FedProc,
    FedProto,
    PrototypeServer,
    aggregate_prototypes,
    curriculum_weight,
)
from fedskew.client.local import LocalContext, TrainSettings, local_train, snapshot
from fedskew.client.loss_before import LOSS_AFTER, LOSS_BEFORE, MOMENTUM, LossAfter, LossBefore, mean_loss
from fedskew.config import ConfigError, make_config
from fedskew.methods import resolve_method
from fedskew.models import build_model
from fedskew.protocol import ServerContext, Upload
from fedskew.server.api import Aggregation
from fedskew.server.combine import WeightedMean
from fedskew.server.uploads import stack_uploads
from fedskew.server.weights import SampleWeights, UniformWeights

F64 = torch.float64


def _rin(glob, deltas, losses, cids=None, sizes=None, rnd=1, lr=0.1, buffers=None, steps=None, momentum=0.0):
    """Round input whose client k uploads ``glob + deltas[k]`` and reports ``losses[k]`` before training, after
    ``steps[k]`` local steps (1 each by default) at learning rate ``lr`` and momentum ``momentum``."""
    cids = list(range(len(deltas))) if cids is None else cids
    sizes = [10 * (i + 1) for i in range(len(deltas))] if sizes is None else sizes
    steps = [1] * len(deltas) if steps is None else steps
    ups = []
    for i, (cid, delta, n, loss) in enumerate(zip(cids, deltas, sizes, losses, strict=True)):
        params = {"w": glob["w"] + torch.tensor(delta, dtype=F64)}
        if buffers is not None:
            params["b"] = buffers[i]
        metrics = {LOSS_BEFORE: float(loss), "lr": lr, "steps": float(steps[i]), MOMENTUM: momentum}
        ups.append(Upload(cid, params, n, metrics=metrics))
    trainable = frozenset({"w"})
    return stack_uploads(ups, rnd=rnd, global_params=glob, trainable=trainable, label_hists=np.ones((len(ups), 2)))


def _ctx(n=3):
    return ServerContext(n, 2, {"w": torch.zeros(2, dtype=F64)}, frozenset({"w"}), np.full(n, 10), np.ones((n, 2)))


# ---- q-FFL ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("lipschitz", ["auto", "lr", 3.0])
@pytest.mark.parametrize("weighting", [SampleWeights(), UniformWeights()], ids=["samples", "uniform"])
def test_qffl_with_q_zero_is_fedavg(weighting, lipschitz):
    glob = {"w": torch.tensor([0.5, -1.0], dtype=F64)}
    rin = _rin(glob, [[1.0, 2.0], [-3.0, 0.5], [0.2, 0.2]], [0.3, 2.0, 1.1], steps=[5, 9, 2], momentum=0.9)
    w, _ = weighting(rin, None, None)
    out, _, _ = QfflCombine(q=0.0, lipschitz=lipschitz)(rin, w, None, None)
    ref, _, _ = WeightedMean()(rin, w, None, None)
    assert torch.allclose(out["w"], ref["w"], atol=1e-12, rtol=0)


@pytest.mark.parametrize("lipschitz", ["auto", "lr"])
def test_qffl_step_written_out(lipschitz):
    # W = 0, u1 = [1, 0], u2 = [0, 2], F = [1, 4], q = 1, L = 1/lr = 10, uniform p:
    # h_k = q F^{q-1} L ||u_k||^2 + F^q = [10 + 1, 40 + 4] = [11, 44]; coef = F / sum(h) = [1, 4] / 55
    # (one plain SGD step each, tau = 1 and beta = 0: the auto estimate (1 - beta)^2/(lr tau^2) is fair_flearn's 1/lr)
    glob = {"w": torch.zeros(2, dtype=F64)}
    rin = _rin(glob, [[1.0, 0.0], [0.0, 2.0]], [1.0, 4.0], lr=0.1)
    out, diag, _ = QfflCombine(q=1.0, lipschitz=lipschitz)(rin, torch.tensor([0.5, 0.5], dtype=F64), None, None)
    assert diag["qffl_coef"] == pytest.approx([1 / 55, 4 / 55], abs=1e-9)
    assert out["w"].tolist() == pytest.approx([1 / 55, 8 / 55], abs=1e-9)
    # a given Lipschitz constant replaces 1/lr; q = 2: h = 2 F L ||u||^2 + F^2
    coef = qffl_coefficients(
        torch.tensor([1.0, 4.0]), torch.tensor([1.0, 4.0]), torch.tensor([0.5, 0.5]), 2.0, torch.tensor([3.0, 3.0])
    )
    h = [2 * 1 * 3 * 1 + 1, 2 * 4 * 3 * 4 + 16]
    assert coef.tolist() == pytest.approx([1 / sum(h), 16 / sum(h)], rel=1e-9)


def test_qffl_lipschitz_estimate_written_out():
    # L_k = (1 - beta)^2 / (lr tau_k^2): one plain step is 1/lr; 4 steps at beta 0.5 and lr 0.1: 0.25 / 1.6
    lr, steps, beta = (torch.tensor(v, dtype=F64) for v in ([0.1, 0.1, 0.2], [1.0, 4.0, 0.0], [0.0, 0.5, 0.9]))
    assert qffl_lipschitz(lr, steps, beta).tolist() == pytest.approx([10.0, 0.15625, 0.01 / 0.2], rel=1e-12)
    assert qffl_lipschitz(lr, steps, beta).dtype == F64  # no step counted (cannot happen) is read as one


def test_qffl_auto_lipschitz_takes_a_larger_step_after_several_momentum_steps():
    # W = 0, u1 = [1, 0], u2 = [0, 2], F = [1, 4], q = 1, lr 0.1, momentum 0.5, steps [4, 2], uniform p:
    # L = 0.25 / (0.1 * [16, 4]) = [0.15625, 0.625]; h = L ||u||^2 + F = [0.15625 + 1, 2.5 + 4]
    glob = {"w": torch.zeros(2, dtype=F64)}
    rin = _rin(glob, [[1.0, 0.0], [0.0, 2.0]], [1.0, 4.0], lr=0.1, steps=[4, 2], momentum=0.5)
    p = torch.tensor([0.5, 0.5], dtype=F64)
    out, diag, _ = QfflCombine(q=1.0)(rin, p, None, None)  # the default is "auto"
    total = 1.15625 + 6.5
    assert diag["qffl_coef"] == pytest.approx([1 / total, 4 / total], rel=1e-9)
    assert out["w"].tolist() == pytest.approx([1 / total, 8 / total], rel=1e-9)
    _, ref, _ = QfflCombine(q=1.0, lipschitz="lr")(rin, p, None, None)  # fair_flearn's 1/lr ignores steps and momentum
    assert ref["qffl_coef"] == pytest.approx([1 / 55, 4 / 55], abs=1e-9)
    assert diag["qffl_step"] > 5 * ref["qffl_step"]
    _, const, _ = QfflCombine(q=1.0, lipschitz=0.625)(rin, p, None, None)  # a given constant for every client
    assert const["qffl_coef"] == pytest.approx([1 / (0.625 + 1 + 6.5), 4 / (0.625 + 1 + 6.5)], rel=1e-9)


def test_qffl_lipschitz_parameter():
    assert resolve_method("fedavg+qffl", {}).server.combine.lipschitz == "auto"
    assert resolve_method("fedavg+qffl", {"lipschitz": "lr"}).server.combine.lipschitz == "lr"
    assert resolve_method("fedavg+qffl", {"lipschitz": 2}).server.combine.lipschitz == 2.0
    for bad in (0, -1.0, "steps", True):
        with pytest.raises(ConfigError, match="lipschitz"):
            resolve_method("fedavg+qffl", {"lipschitz": bad})


def test_qffl_refuses_masks_and_defaults_to_the_references_uniform_average():
    with pytest.raises(ConfigError, match="element masks"):
        resolve_method("fedavg+heal+qffl", {})
    assert isinstance(resolve_method("fedavg+qffl", {}).server.weighting, UniformWeights)
    assert isinstance(resolve_method("fedavg+qffl", {"weights": "samples"}).server.weighting, SampleWeights)
    assert isinstance(resolve_method("fedavg+fedfv", {}).server.weighting, UniformWeights)


# ---- AFL ------------------------------------------------------------------------------------------------------------
def test_project_simplex_cases():
    assert project_simplex(torch.tensor([2.0, 0.0, 0.0])).tolist() == pytest.approx([1.0, 0.0, 0.0])
    assert project_simplex(torch.tensor([0.5, 0.5, 0.5])).tolist() == pytest.approx([1 / 3] * 3)
    # [1/3 + 0.1, 1/3 + 0.2, 1/3 + 0.3] sums to 1.6: every entry moves down by 0.2
    v = torch.tensor([1 / 3 + 0.1, 1 / 3 + 0.2, 1 / 3 + 0.3], dtype=F64)
    assert project_simplex(v).tolist() == pytest.approx([1 / 3 - 0.1, 1 / 3, 1 / 3 + 0.1], abs=1e-12)
    # [0.9, 0.1, -0.5]: the last is cut at 0, the others share the excess 0: theta = 0 -> [0.9, 0.1, 0]
    assert project_simplex(torch.tensor([0.9, 0.1, -0.5])).tolist() == pytest.approx([0.9, 0.1, 0.0])


def test_afl_with_zero_step_is_uniform_averaging():
    glob = {"w": torch.zeros(2, dtype=F64)}
    for restart in (False, True):
        agg = Aggregation(weighting=AflWeights(step=0.0, restart=restart), combine=WeightedMean())
        state = agg.init(_ctx(4))
        for rnd, cids in enumerate([[0, 1, 2], [1, 3], [0, 2, 3]], start=1):  # partial participation
            deltas = [[float(c), -2.0 * c] for c in cids]
            rin = _rin(glob, deltas, [1.0 + c for c in cids], cids=cids, rnd=rnd)
            out, state = agg.aggregate(rin, state)
            ref, _, _ = WeightedMean()(rin, UniformWeights()(rin, None, None)[0], None, None)
            assert out.diagnostics["weights"] == pytest.approx([1 / len(cids)] * len(cids), abs=1e-15)
            assert torch.allclose(out.global_params["w"], ref["w"], atol=1e-15, rtol=0)


def test_afl_ascent_written_out():
    glob = {"w": torch.zeros(2, dtype=F64)}
    afl = AflWeights(step=0.1, floor=0.0)
    state = afl.init(_ctx(3))
    rin = _rin(glob, [[1.0, 0.0]] * 3, [1.0, 2.0, 3.0])
    w, state = afl(rin, None, state)
    assert w.tolist() == pytest.approx([1 / 3] * 3)  # weights from lambda^t, then the step
    assert state.lam.tolist() == pytest.approx([1 / 3 - 0.1, 1 / 3, 1 / 3 + 0.1], abs=1e-12)
    # partial participation: clients 0 and 2 are weighted by their lambda, renormalized over them
    rin2 = _rin(glob, [[1.0, 0.0]] * 2, [10.0, 0.0], cids=[0, 2], rnd=2)
    w2, state2 = afl(rin2, None, state)
    assert w2.tolist() == pytest.approx([(1 / 3 - 0.1) / (2 / 3), (1 / 3 + 0.1) / (2 / 3)], abs=1e-12)
    # lambda + [1, 0, 0] = [1.2333, 0.3333, 0.4333] -> theta = -(2 - 1)/3 ... projection drops client 1 and 2's excess
    expected = project_simplex(torch.tensor([1 / 3 - 0.1 + 1.0, 1 / 3, 1 / 3 + 0.1], dtype=F64))
    assert torch.allclose(state2.lam, expected)
    assert float(state2.lam.sum()) == pytest.approx(1.0)
    # MarsFL's floor: entries <= 1e-3 are raised to it and renormalized; restart: from 1/K every round, no memory
    floored = AflWeights(step=10.0, floor=1e-3)
    _, s = floored(rin, None, floored.init(_ctx(3)))
    assert float(s.lam.min()) > 0 and float(s.lam.sum()) == pytest.approx(1.0)
    w_r, s_r = AflWeights(step=0.1, floor=0.0, restart=True)(rin, None, None)
    assert w_r.tolist() == pytest.approx([1 / 3 - 0.1, 1 / 3, 1 / 3 + 0.1], abs=1e-12) and s_r is None


def test_fairness_plugins_need_the_loss_before_training():
    glob = {"w": torch.zeros(2, dtype=F64)}
    ups = [Upload(c, {"w": torch.ones(2, dtype=F64)}, 5) for c in range(2)]
    rin = stack_uploads(ups, rnd=1, global_params=glob, trainable=frozenset({"w"}), label_hists=np.ones((2, 2)))
    with pytest.raises(ValueError, match="loss_before"):
        AflWeights()(rin, None, AflWeights().init(_ctx(2)))
    with pytest.raises(ValueError, match="loss_before"):
        QfflCombine()(rin, torch.tensor([0.5, 0.5], dtype=F64), None, None)


# ---- FedFV ----------------------------------------------------------------------------------------------------------
def test_fedfv_without_conflicts_is_fedavg():
    glob = {"w": torch.tensor([0.1, 0.2], dtype=F64)}
    buffers = [torch.tensor([float(k)]) for k in range(3)]  # a non-trainable float entry: weighted mean
    rin = _rin(glob | {"b": torch.zeros(1)}, [[1.0, 0.5], [0.2, 2.0], [3.0, 0.1]], [3.0, 1.0, 2.0], buffers=buffers)
    fv = FedFVCombine(alpha=0.1, tau=1)
    for w in (torch.tensor([0.2, 0.5, 0.3], dtype=F64), torch.full((3,), 1 / 3, dtype=F64)):
        out, diag, _ = fv(rin, w, None, fv.init(_ctx()))
        ref, _, _ = WeightedMean()(rin, w, None, None)
        assert same_params(out, ref, tol=1e-12)
        assert diag["fedfv_coef"] == pytest.approx(w.tolist(), abs=1e-12) and diag["fedfv_external"] == 0


def test_fedfv_projections_written_out():
    # u0 = [1, 0] (loss 1), u1 = [-1, 1] (loss 2), uniform weights, W = 0
    glob = {"w": torch.zeros(2, dtype=F64)}
    rin = _rin(glob, [[1.0, 0.0], [-1.0, 1.0]], [1.0, 2.0])
    w = torch.tensor([0.5, 0.5], dtype=F64)
    # alpha = 0.1 keeps the highest-loss client (u1); u0 · u1 = -1 < 0: g0' = u0 - u1 (-1)/2 = [0.5, 0.5];
    # g_t = ([0.5, 0.5] + [-1, 1]) / 2 = [-0.25, 0.75] conflicts with u0 (dot -0.25): g_t - u0 (-0.25)/1 = [0, 0.75];
    # rescaled to |mean(u)| = |[0, 0.5]| = 0.5: [0, 0.5]
    fv = FedFVCombine(alpha=0.1, tau=1)
    out, diag, state = fv(rin, w, None, fv.init(_ctx(2)))
    assert out["w"].tolist() == pytest.approx([0.0, 0.5], abs=1e-12)
    assert diag["fedfv_external"] == 1 and state == FedFVState({})
    # alpha = 0: both projected; g0' = [0.5, 0.5], g1' = u1 - u0 (-1)/1 = [0, 1]; g_t = [0.25, 0.75], no external
    # conflict; rescaled to 0.5: [0.25, 0.75] * 0.5 / sqrt(0.625)
    out0, diag0, _ = FedFVCombine(alpha=0.0)(rin, w, None, FedFVState({}))
    s = 0.5 / math.sqrt(0.625)
    assert out0["w"].tolist() == pytest.approx([0.25 * s, 0.75 * s], abs=1e-12) and diag0["fedfv_external"] == 0


def test_fedfv_history_of_earlier_rounds():
    # tau = 2: client 0's round-1 update [1, 0] is kept; in round 2 client 1 alone uploads [-1, 1], which conflicts
    # with it: g_t = [-1, 1] - [1, 0] (-1)/1 = [0, 1], rescaled to |[-1, 1]| = sqrt(2)
    glob = {"w": torch.zeros(2, dtype=F64)}
    fv = FedFVCombine(alpha=0.1, tau=2)
    state = fv.init(_ctx(2))
    _, _, state = fv(_rin(glob, [[1.0, 0.0]], [1.0], cids=[0], rnd=1), torch.ones(1, dtype=F64), None, state)
    assert set(state.history) == {0} and state.history[0].round == 1
    out, diag, state = fv(_rin(glob, [[-1.0, 1.0]], [1.0], cids=[1], rnd=2), torch.ones(1, dtype=F64), None, state)
    assert out["w"].tolist() == pytest.approx([0.0, math.sqrt(2)], abs=1e-12) and diag["fedfv_external"] == 1
    assert set(state.history) == {1}  # client 0's round-1 update is out of the window for round 3
    # tau = 1 keeps nothing: the same round 2 is plain client 1
    fv1 = FedFVCombine(alpha=0.1, tau=1)
    _, _, s1 = fv1(_rin(glob, [[1.0, 0.0]], [1.0], cids=[0], rnd=1), torch.ones(1, dtype=F64), None, FedFVState({}))
    out1, _, _ = fv1(_rin(glob, [[-1.0, 1.0]], [1.0], cids=[1], rnd=2), torch.ones(1, dtype=F64), None, s1)
    assert out1["w"].tolist() == pytest.approx([-1.0, 1.0], abs=1e-12)


# ---- prototypes -----------------------------------------------------------------------------------------------------
def test_prototype_aggregation_hand_case():
    # client A: class 0 mean [1, 0] (2 samples), class 1 mean [0, 2] (1); client B: class 0 [3, 0] (1), class 2
    # [4, 4] (5). Class 3: nobody. Over clients: c0 = [2, 0]; over samples: c0 = (2·[1,0] + 1·[3,0]) / 3 = [5/3, 0]
    means = torch.tensor(
        [[[1.0, 0.0], [0.0, 2.0], [0.0, 0.0], [0.0, 0.0]], [[3.0, 0.0], [0.0, 0.0], [4.0, 4.0], [0.0, 0.0]]]
    )
    counts = torch.tensor([[2.0, 1.0, 0.0, 0.0], [1.0, 0.0, 5.0, 0.0]])
    protos, present = aggregate_prototypes(means, counts, "clients")
    assert present.tolist() == [True, True, True, False]
    assert protos.tolist() == [[2.0, 0.0], [0.0, 2.0], [4.0, 4.0], [0.0, 0.0]]
    protos_s, _ = aggregate_prototypes(means, counts, "samples")
    assert protos_s[0].tolist() == pytest.approx([5 / 3, 0.0])
    assert protos_s[1:3].tolist() == [[0.0, 2.0], [4.0, 4.0]]
    # the server half: a class no participant of a later round has keeps its prototype
    half = PrototypeServer()
    state = half.init(ServerContext(2, 4, {}, frozenset(), np.ones(2), np.ones((2, 4))))
    assert half.broadcast(state) == {}

    def rin(m, c):
        ups = [Upload(i, {"w": torch.zeros(1)}, 5, extras={PROTO_MEAN: m[i], PROTO_COUNT: c[i]}) for i in range(len(m))]
        return stack_uploads(
            ups, rnd=1, global_params={"w": torch.zeros(1)}, trainable=frozenset(), label_hists=np.ones((len(m), 4))
        )

    state = half.advance(rin(means, counts), state)
    later = torch.tensor([[[7.0, 7.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]]])
    state = half.advance(rin(later, torch.tensor([[1.0, 0.0, 0.0, 0.0]])), state)
    sent = half.broadcast(state)
    assert sent[GLOBAL_PROTOS].tolist() == [[7.0, 7.0], [0.0, 2.0], [4.0, 4.0], [0.0, 0.0]]
    assert sent[GLOBAL_PRESENT].tolist() == [True, True, True, False]


def _tiny(n=12, classes=3, seed=0):
    torch.manual_seed(seed)
    model = build_model("mlp", in_channels=1, image_size=4, num_classes=classes)
    x = torch.randn(n, 1, 4, 4)
    y = torch.arange(n) % classes
    y[-1] = 0  # class counts 5, 4, 3
    return model, x, y


def _local_ctx(model, broadcast=None, lr=0.0, epochs=2, rnd=1, batch=5):
    return LocalContext(0, rnd, model, snapshot(model), {}, broadcast or {}, TrainSettings(epochs, batch, lr))


def test_local_prototypes_are_class_means_of_the_last_epoch_features():
    model, x, y = _tiny()
    ctx = _local_ctx(model, lr=0.0)  # lr 0: every epoch sees the same features
    up = local_train(FedProto(), ctx, x, y, torch.Generator().manual_seed(0))
    with torch.no_grad():
        feats = model.body(x)
    for c in range(3):
        assert torch.allclose(up.extras[PROTO_MEAN][c], feats[y == c].mean(0), atol=1e-6)
    assert up.extras[PROTO_COUNT].tolist() == [5.0, 4.0, 3.0]  # the last epoch only (2 epochs ran)


def test_fedproto_loss_written_out():
    model, x, y = _tiny()
    with torch.no_grad():
        feats = model.body(x)
    d = feats.shape[1]
    protos = torch.randn(3, d)
    present = torch.tensor([True, False, True])  # class 1 has no global prototype
    ctx = _local_ctx(model, {GLOBAL_PROTOS: protos, GLOBAL_PRESENT: present})
    ctx.x, ctx.y = x, y
    algo = FedProto(lam=0.7)
    algo.begin(ctx)
    with torch.no_grad():
        logits = model.head(feats)
        loss = algo.loss(ctx, logits, feats, y, x)
        ce = torch.nn.functional.cross_entropy(logits, y)
    dist = sum(float(((feats[i] - protos[y[i]]) ** 2).sum()) for i in range(len(y)) if bool(present[y[i]]))
    assert float(loss) == pytest.approx(float(ce) + 0.7 * dist / (len(y) * d), rel=1e-5)


def test_fedproc_loss_written_out():
    model, x, y = _tiny()
    with torch.no_grad():
        feats = model.body(x)
    protos = torch.randn(3, feats.shape[1])
    present = torch.tensor([True, True, False])  # class 2: no prototype (its samples count 0, and no negative)
    algo = FedProc(curriculum_rounds=5, temperature=0.5)
    rnd = 3  # alpha = 1 - (3 - 1)/(5 - 1) = 0.5
    ctx = _local_ctx(model, {GLOBAL_PROTOS: protos, GLOBAL_PRESENT: present}, rnd=rnd)
    ctx.x, ctx.y = x, y
    algo.begin(ctx)
    with torch.no_grad():
        logits = model.head(feats)
        loss = float(algo.loss(ctx, logits, feats, y, x))

    def cos(a, b):
        return float(a @ b) / (float(a.norm()) * float(b.norm()))

    terms = []
    for i in range(len(y)):
        c = int(y[i])
        if not present[c]:
            terms.append(0.0)
            continue
        num = math.exp(cos(feats[i], protos[c]) / 0.5)
        den = sum(math.exp(cos(feats[i], protos[j]) / 0.5) for j in (0, 1))
        terms.append(-math.log(num / den))
    ce = float(torch.nn.functional.cross_entropy(logits, y))
    assert algo.alpha(rnd) == 0.5 and algo.alpha(1) == 1.0 and algo.alpha(5) == 0.0 and algo.alpha(9) == 0.0
    assert loss == pytest.approx(0.5 * sum(terms) / len(y) + 0.5 * ce, rel=1e-5)
    # without any global prototype (the first round) it is cross-entropy
    ctx0 = _local_ctx(model, rnd=1)
    ctx0.x, ctx0.y = x, y
    algo.begin(ctx0)
    assert float(algo.loss(ctx0, logits, feats, y, x)) == pytest.approx(ce, rel=1e-6)


def test_fedproc_curriculum_runs_over_the_runs_rounds_by_default():
    assert [curriculum_weight(t, 5) for t in (1, 2, 3, 5, 9)] == [1.0, 0.75, 0.5, 0.0, 0.0]
    assert curriculum_weight(1, 1) == 0.0
    assert FedProc().alpha(3, 5) == 0.5  # T = the run's rounds (MarsFL's communication_epoch)
    assert FedProc(curriculum_rounds=200).alpha(3, 5) == pytest.approx(1 - 2 / 199)  # an explicit T overrides
    with pytest.raises(ValueError, match="rounds"):
        FedProc().alpha(3)  # neither the run's rounds nor curriculum_rounds
    model, x, y = _tiny()
    with torch.no_grad():
        feats = model.body(x)
        logits = model.head(feats)
    bc = {GLOBAL_PROTOS: torch.randn(3, feats.shape[1]), GLOBAL_PRESENT: torch.ones(3, dtype=torch.bool)}
    losses = []
    for algo, rounds in ((FedProc(), 5), (FedProc(curriculum_rounds=5), None), (FedProc(curriculum_rounds=5), 50)):
        ctx = LocalContext(0, 3, model, snapshot(model), {}, bc, TrainSettings(2, 5, 0.0, rounds=rounds))
        ctx.x, ctx.y = x, y
        algo.begin(ctx)
        with torch.no_grad():
            losses.append(float(algo.loss(ctx, logits, feats, y, x)))
    assert losses[0] == losses[1] == losses[2]


def test_fedproc_run_reads_its_rounds():
    default = digits_simulation("fedproc", rounds=2)
    assert default.settings.rounds == 2
    same = digits_simulation("fedproc", {"curriculum_rounds": 2}, rounds=2)
    longer = digits_simulation("fedproc", {"curriculum_rounds": 200}, rounds=2)  # the old default
    r_default, r_same = without_timing(default.run()), without_timing(same.run())
    longer.run()
    assert r_default == r_same
    assert same_params(default.global_params, same.global_params)
    assert not same_params(default.global_params, longer.global_params, tol=1e-6)  # round 2: alpha 0 vs 0.995


# ---- the loss before training ---------------------------------------------------------------------------------------
def test_loss_before_is_reported_and_changes_nothing_else():
    model, x, y = _tiny()
    expected = mean_loss(model, x, y)
    with torch.no_grad():
        direct = float(torch.nn.functional.cross_entropy(model(x), y))
    assert expected == pytest.approx(direct, rel=1e-6)
    plain = local_train(FedProto(), _local_ctx(model, lr=0.1), x, y, torch.Generator().manual_seed(1))
    model2, _, _ = _tiny()
    wrapped = LossBefore(FedProto())
    up = local_train(wrapped, _local_ctx(model2, lr=0.1), x, y, torch.Generator().manual_seed(1))
    assert up.metrics[LOSS_BEFORE] == pytest.approx(expected, rel=1e-6) and up.metrics["lr"] == 0.1
    assert up.metrics[MOMENTUM] == 0.0 and up.metrics["steps"] == 2 * 3  # q-FFL's auto Lipschitz estimate reads both
    assert same_params(up.params, plain.params) and same_params(up.extras, plain.extras)
    assert type(wrapped.inner).__name__ == "FedProto" and wrapped.lam == 1.0  # the host's attributes show through
    assert isinstance(resolve_method("fedproto+afl+fedfv", {}).client, LossBefore)  # wrapped once for both


def test_loss_after_scores_the_trained_model_on_the_validation_split_and_changes_nothing_else():
    model, x, y = _tiny()
    _, x_val, y_val = _tiny(n=6, seed=3)
    plain = local_train(FedProto(), _local_ctx(model, lr=0.1), x, y, torch.Generator().manual_seed(1))
    model2, _, _ = _tiny()
    ctx = _local_ctx(model2, lr=0.1)
    ctx.x_val, ctx.y_val = x_val, y_val
    up = local_train(LossAfter(FedProto()), ctx, x, y, torch.Generator().manual_seed(1))
    assert same_params(up.params, plain.params) and same_params(up.extras, plain.extras)
    model2.load_state_dict(up.params)  # the uploaded (trained) model on the validation split
    assert up.metrics[LOSS_AFTER] == pytest.approx(mean_loss(model2, x_val, y_val), rel=1e-6)
    assert LOSS_BEFORE not in up.metrics
    with pytest.raises(ValueError, match="validation split"):
        local_train(LossAfter(FedProto()), _local_ctx(model2, lr=0.1), x, y, torch.Generator().manual_seed(1))


def test_afl_after_training_reads_the_loss_after_and_needs_validation_splits():
    glob = {"w": torch.zeros(2, dtype=F64)}
    rin = _rin(glob, [[1.0, 0.0]] * 3, [1.0, 2.0, 3.0])
    rin.metrics[LOSS_AFTER] = rin.metrics.pop(LOSS_BEFORE).flip(0)  # 3, 2, 1 after training
    w, _ = AflWeights(step=0.1, floor=0.0, restart=True, loss=LOSS_AFTER)(rin, None, None)
    assert w.tolist() == pytest.approx([1 / 3 + 0.1, 1 / 3, 1 / 3 - 0.1], abs=1e-12)
    method = resolve_method("fedprox+afl", {"loss": "after", "restart": True})
    assert isinstance(method.client, LossAfter) and type(method.client.inner).__name__ == "FedProx"
    with pytest.raises(ConfigError, match="set validation"):
        make_config(None, {"method": "fedavg+afl", "method_args": {"loss": "after"}, "db": None})
    sim = digits_simulation("fedavg+afl", {"loss": "after", "restart": True}, rounds=2, validation=0.2)
    records = sim.run()
    weights = records[-1]["diagnostics"]["weights"]
    assert len(weights) == 4 and sum(weights) == pytest.approx(1.0) and len(set(weights)) > 1
