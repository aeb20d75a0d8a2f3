"""Issue 42's personalized baselines: worked numbers from each update rule, against closed-form gradients of a
softmax-regression head (written here, independent of autograd), and the engine's personalization hook."""

import json
import multiprocessing
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedskew.catalog.apfl import ALPHA, APFL, APFL_ALPHA, APFL_V
from fedskew.catalog.feddbe import BIAS, DBE_BIAS, GLOBAL_MEAN, RUNNING_MEAN, DbeServer, DbeState, FedDBE
from fedskew.catalog.fedrod import ROD_HEAD, FedRoD, balanced_softmax_loss
from fedskew.catalog.perfedavg import PerFedAvg, split_batch  # (re-exported from client.batched_form)
from fedskew.catalog.pfedme import PFedMe
from fedskew.client.kernels import PERSONAL
from fedskew.client.local import LocalContext, PersonalContext, TrainSettings, local_train, snapshot
from fedskew.config import make_config
from fedskew.data.federated import build_federated
from fedskew.engine.loop import Simulation
from fedskew.models import FedModel
from fedskew.protocol import RoundInput
from fedskew.runner import run_experiment

D, C, N = 4, 3, 6


def _data(n=N, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, D, generator=g), torch.tensor([0, 1, 2, 0, 2, 2, 1, 0, 0][:n])


def _model(body: nn.Module | None = None, seed=1) -> FedModel:
    torch.manual_seed(seed)
    return FedModel(body if body is not None else nn.Flatten(), nn.Linear(D, C))


def _ctx(model, lr=0.1, batch=N, state=None, broadcast=None, epochs=1):
    settings = TrainSettings(epochs=epochs, batch_size=batch, lr=lr)
    received = snapshot(model)
    return LocalContext(0, 1, model, received, state if state is not None else {}, broadcast or {}, settings)


def _ce_grad(w, b, z, y):
    """Closed-form gradients of the mean cross-entropy of ``z W^T + b`` (float64): (dW, db, dlogits)."""
    w, b, z = w.double(), b.double(), z.double()
    g = (torch.softmax(z @ w.T + b, 1) - F.one_hot(y, w.shape[0]).double()) / z.shape[0]
    return g.T @ z, g.sum(0), g


def _close(a, b, tol=1e-5):
    assert torch.allclose(a.double(), b.double(), atol=tol, rtol=0), (a, b)


def _train(algo, ctx, x, y, seed=3):
    return local_train(algo, ctx, x, y, torch.Generator().manual_seed(seed))


# ---- APFL ------------------------------------------------------------------------------------------------------------
def test_apfl_steps_w_v_and_alpha_by_its_gradient():
    x, y = _data()
    model = _model()
    w0, b0 = model.head.weight.detach().clone(), model.head.bias.detach().clone()
    g = torch.Generator().manual_seed(7)
    v0 = {"head.weight": w0 + torch.randn(C, D, generator=g), "head.bias": b0 + torch.randn(C, generator=g)}
    state = {APFL_V.name: v0, APFL_ALPHA.name: {ALPHA: torch.tensor(0.3, dtype=torch.float64)}}
    ctx = _ctx(model, state=state)
    up = _train(APFL(alpha=0.5), ctx, x, y)
    lr, a = 0.1, 0.3
    gw, gb, _ = _ce_grad(w0, b0, x, y)
    _close(up.params["head.weight"], w0 - lr * gw)
    _close(up.params["head.bias"], b0 - lr * gb)
    vw, vb = a * v0["head.weight"] + (1 - a) * w0, a * v0["head.bias"] + (1 - a) * b0
    mw, mb, _ = _ce_grad(vw, vb, x, y)
    _close(state[APFL_V.name]["head.weight"], v0["head.weight"] - lr * a * mw)
    _close(state[APFL_V.name]["head.bias"], v0["head.bias"] - lr * a * mb)
    grad_alpha = ((v0["head.weight"] - w0) * mw).sum() + ((v0["head.bias"] - b0) * mb).sum()
    expected = min(max(a - lr * (float(grad_alpha) + 0.02 * a), 0.0), 1.0)
    assert 0.0 < expected < 1.0 and expected != pytest.approx(a, abs=1e-3)  # a real move, inside the clip
    assert float(state[APFL_ALPHA.name][ALPHA]) == pytest.approx(expected, abs=1e-6)
    assert up.metrics["apfl_alpha"] == pytest.approx(expected, abs=1e-6)
    # the personalized model mixes the kept v with whatever model the client holds
    base = {"head.weight": torch.zeros(C, D), "head.bias": torch.ones(C)}
    pctx = PersonalContext(0, 1, model, base, state, ctx.settings, x, y, torch.Generator())
    out = APFL().personalize(pctx)
    al = float(state[APFL_ALPHA.name][ALPHA])
    _close(out["head.weight"], al * state[APFL_V.name]["head.weight"])
    _close(out["head.bias"], al * state[APFL_V.name]["head.bias"] + (1 - al))


def test_apfl_non_adaptive_keeps_alpha_and_clips():
    x, y = _data()
    ctx = _ctx(_model())
    _train(APFL(alpha=0.25, adaptive=False), ctx, x, y)
    assert float(ctx.client_state[APFL_ALPHA.name][ALPHA]) == 0.25
    # a huge alpha gradient is clipped into [0, 1]
    model = _model()
    g = torch.Generator().manual_seed(2)
    v = {n: t + 50.0 * torch.randn(t.shape, generator=g) for n, t in snapshot(model).items()}
    state = {APFL_V.name: v, APFL_ALPHA.name: {ALPHA: torch.tensor(0.5, dtype=torch.float64)}}
    _train(APFL(), _ctx(model, lr=5.0, state=state), x, y)
    assert float(state[APFL_ALPHA.name][ALPHA]) in (0.0, 1.0)


# ---- pFedMe ----------------------------------------------------------------------------------------------------------
def test_pfedme_solves_the_inner_problem_then_moves_w_towards_theta():
    x, y = _data()
    model = _model()
    w0, b0 = model.head.weight.detach().clone(), model.head.bias.detach().clone()
    lam, plr, k, lr = 2.0, 0.05, 3, 0.1
    ctx = _ctx(model, lr=lr)
    up = _train(PFedMe(lam=lam, inner_steps=k, personal_lr=plr), ctx, x, y)
    tw, tb = w0.double(), b0.double()
    for _ in range(k):
        gw, gb, _ = _ce_grad(tw, tb, x, y)
        tw, tb = tw - plr * (gw + lam * (tw - w0)), tb - plr * (gb + lam * (tb - b0))
    theta = ctx.client_state[PERSONAL.name]
    _close(theta["head.weight"], tw)
    _close(theta["head.bias"], tb)
    _close(up.params["head.weight"], w0 - lr * lam * (w0 - tw))
    _close(up.params["head.bias"], b0 - lr * lam * (b0 - tb))
    assert PFedMe().personal_model(ctx.client_state) is theta
    # enough inner steps solve min f(θ) + (λ/2)||θ − w||²: its gradient vanishes at θ
    ctx = _ctx(_model(), lr=0.0)
    _train(PFedMe(lam=lam, inner_steps=400, personal_lr=0.1), ctx, x, y)
    theta = ctx.client_state[PERSONAL.name]
    gw, gb, _ = _ce_grad(theta["head.weight"], theta["head.bias"], x, y)
    assert float((gw + lam * (theta["head.weight"].double() - w0)).abs().max()) < 1e-5
    assert float((gb + lam * (theta["head.bias"].double() - b0)).abs().max()) < 1e-5


# ---- Per-FedAvg ------------------------------------------------------------------------------------------------------
def test_split_batch_parts():
    assert split_batch(5, 2) == [slice(0, 3), slice(3, 5)]
    assert split_batch(7, 3) == [slice(0, 3), slice(3, 6), slice(6, 7)]
    assert split_batch(1, 2) == [slice(0, 1), slice(0, 1)]  # too small to split: the first part again
    assert split_batch(2, 3) == [slice(0, 1), slice(1, 2), slice(0, 1)]


@pytest.mark.parametrize("variant", ["fo", "hf"])
def test_perfedavg_step_is_the_gradient_after_one_inner_step(variant):
    x, y = _data()
    model = _model()
    w0, b0 = model.head.weight.detach().clone(), model.head.bias.detach().clone()
    alpha, lr, delta = 0.03, 0.1, 1e-2
    up = _train(PerFedAvg(variant=variant, alpha=alpha, delta=delta), _ctx(model, lr=lr), x, y, seed=5)
    perm = torch.randperm(N, generator=torch.Generator().manual_seed(5))
    xs, ys = x[perm], y[perm]
    cuts = split_batch(N, 2 if variant == "fo" else 3)
    g1w, g1b, _ = _ce_grad(w0, b0, xs[cuts[0]], ys[cuts[0]])
    aw, ab = w0 - alpha * g1w, b0 - alpha * g1b
    dw, db, _ = _ce_grad(aw, ab, xs[cuts[1]], ys[cuts[1]])
    if variant == "hf":
        pw, pb, _ = _ce_grad(w0 + delta * dw, b0 + delta * db, xs[cuts[2]], ys[cuts[2]])
        mw, mb, _ = _ce_grad(w0 - delta * dw, b0 - delta * db, xs[cuts[2]], ys[cuts[2]])
        dw, db = dw - alpha * (pw - mw) / (2 * delta), db - alpha * (pb - mb) / (2 * delta)
    _close(up.params["head.weight"], w0 - lr * dw, 1e-4 if variant == "hf" else 1e-5)
    _close(up.params["head.bias"], b0 - lr * db, 1e-4 if variant == "hf" else 1e-5)


def test_perfedavg_personal_model_is_one_step_on_a_drawn_batch():
    x, y = _data(9)
    model = _model()
    base = snapshot(model)
    settings = TrainSettings(epochs=1, batch_size=4, lr=0.5)
    pctx = PersonalContext(2, 3, model, base, {}, settings, x, y, torch.Generator().manual_seed(11))
    out = PerFedAvg(alpha=0.2).personalize(pctx)
    idx = torch.randperm(9, generator=torch.Generator().manual_seed(11))[:2]  # one inner part of the batch of 4
    gw, gb, _ = _ce_grad(base["head.weight"], base["head.bias"], x[idx], y[idx])
    _close(out["head.weight"], base["head.weight"] - 0.2 * gw)
    _close(out["head.bias"], base["head.bias"] - 0.2 * gb)


# ---- FedRoD ----------------------------------------------------------------------------------------------------------
def test_balanced_softmax_is_cross_entropy_under_the_client_prior():
    logits = torch.tensor([[1.0, 2.0, -1.0], [0.5, 0.0, 3.0]])
    y = torch.tensor([0, 2])
    counts = torch.tensor([2.0, 0.0, 3.0])
    expected = 0.0
    for i in range(2):
        num = counts[y[i]] * torch.exp(logits[i, y[i]])
        expected += -torch.log(num / (counts * torch.exp(logits[i])).sum()) / 2
    assert float(balanced_softmax_loss(logits, y, counts.log())) == pytest.approx(float(expected), abs=1e-6)


def test_fedrod_trains_the_generic_head_by_bsm_and_the_personal_head_on_the_summed_logits():
    x, y = _data()
    model = _model()
    w0, b0 = model.head.weight.detach().clone(), model.head.bias.detach().clone()
    g = torch.Generator().manual_seed(9)
    p0 = {"head.weight": torch.randn(C, D, generator=g), "head.bias": torch.randn(C, generator=g)}
    ctx = _ctx(model, state={ROD_HEAD.name: p0})
    up = _train(FedRoD(), ctx, x, y)
    lr = 0.1
    log_n = torch.bincount(y, minlength=C).double().log()
    gen = (torch.softmax(x.double() @ w0.double().T + b0.double() + log_n, 1) - F.one_hot(y, C).double()) / N
    _close(up.params["head.weight"], w0 - lr * gen.T @ x.double())
    _close(up.params["head.bias"], b0 - lr * gen.sum(0))
    summed = x @ w0.T + b0 + x @ p0["head.weight"].T + p0["head.bias"]
    gp = (torch.softmax(summed.double(), 1) - F.one_hot(y, C).double()) / N
    head = ctx.client_state[ROD_HEAD.name]
    _close(head["head.weight"], p0["head.weight"] - lr * gp.T @ x.double())
    _close(head["head.bias"], p0["head.bias"] - lr * gp.sum(0))
    # the personalized model is one linear layer giving generic + personal logits
    pctx = PersonalContext(0, 1, model, up.params, ctx.client_state, ctx.settings, x, y, torch.Generator())
    model.load_state_dict(FedRoD().personalize(pctx))
    with torch.no_grad():
        summed = F.linear(x, up.params["head.weight"], up.params["head.bias"]) + F.linear(
            x, head["head.weight"], head["head.bias"]
        )
        _close(model(x), summed)
    # ce: the ablation trains the generic head with plain cross-entropy
    model = _model()
    up = _train(FedRoD(generic_loss="ce"), _ctx(model), x, y)
    gw, gb, _ = _ce_grad(w0, b0, x, y)
    _close(up.params["head.weight"], w0 - lr * gw)


def test_fedrod_and_feddbe_refuse_a_head_that_is_not_one_linear_layer():
    model = FedModel(nn.Flatten(), nn.Sequential(nn.Linear(D, 5), nn.ReLU(), nn.Linear(5, C)))
    for algo in (FedRoD(), FedDBE()):
        with pytest.raises(ValueError, match="one Linear layer with a bias"):
            algo.check_model(snapshot(model), frozenset(n for n, _ in model.named_parameters()))


# ---- FedDBE ----------------------------------------------------------------------------------------------------------
def test_feddbe_first_round_is_plain_and_uploads_the_running_mean():
    x, y = _data()
    model = _model(nn.Linear(D, D))
    a0, c0 = model.body.weight.detach().clone(), model.body.bias.detach().clone()
    w0, b0 = model.head.weight.detach().clone(), model.head.bias.detach().clone()
    ctx = _ctx(model, batch=3)
    up = _train(FedDBE(mean_momentum=0.5), ctx, x, y)
    # momentum 0.5 over two batches of the seeded order: r = 0.5 (0.5 m1) + 0.5 m2, m_i the batch means under the
    # model of that step; the second step's body is the first step's result
    perm = torch.randperm(N, generator=torch.Generator().manual_seed(3))
    m1 = (x[perm[:3]] @ a0.T + c0).mean(0)
    z1 = x[perm[:3]] @ a0.T + c0
    gw, gb, g = _ce_grad(w0, b0, z1, y[perm[:3]])
    dz = g @ w0.double()
    a1, c1 = a0 - 0.1 * dz.T @ x[perm[:3]].double(), c0 - 0.1 * dz.sum(0)
    m2 = (x[perm[3:]].double() @ a1.T + c1).mean(0)
    _close(up.extras[RUNNING_MEAN], 0.25 * m1 + 0.5 * m2)
    assert torch.equal(ctx.client_state[DBE_BIAS.name][BIAS], torch.zeros(D))  # PRBM untouched without ḡ


def test_feddbe_regularizes_the_mean_and_trains_the_representation_bias():
    x, y = _data()
    model = _model(nn.Linear(D, D))
    a0, c0 = model.body.weight.detach().clone().double(), model.body.bias.detach().clone().double()
    w0, b0 = model.head.weight.detach().clone().double(), model.head.bias.detach().clone().double()
    gmean, bias0, kappa, lr = torch.tensor([0.5, -1.0, 0.0, 2.0]), torch.tensor([0.1, 0.2, -0.3, 0.4]), 3.0, 0.1
    ctx = _ctx(model, lr=lr, state={DBE_BIAS.name: {BIAS: bias0}}, broadcast={GLOBAL_MEAN: gmean})
    up = _train(FedDBE(kappa=kappa), ctx, x, y)
    assert RUNNING_MEAN not in up.extras  # ḡ is known: nothing more to send
    xd = x.double()
    z = xd @ a0.T + c0
    gw, gb, g = _ce_grad(w0, b0, z + bias0.double(), y)
    dz = g @ w0  # dCE/dz, per sample
    r = z.mean(0)
    dr = kappa * (r - gmean.double()) / D  # d/dr of kappa·mean(½(r − ḡ)²)
    _close(up.params["head.weight"], w0 - lr * gw)
    _close(up.params["head.bias"], b0 - lr * gb)
    _close(up.params["body.weight"], a0 - lr * (dz.T @ xd + torch.outer(dr, xd.mean(0))))
    _close(up.params["body.bias"], c0 - lr * (dz.sum(0) + dr))
    bias = ctx.client_state[DBE_BIAS.name][BIAS]
    _close(bias, bias0.double() - lr * dz.sum(0))
    # the personalized model folds the bias into the head: head(body(x) + bias)
    pctx = PersonalContext(0, 1, model, up.params, ctx.client_state, ctx.settings, x, y, torch.Generator())
    personal = FedDBE().personalize(pctx)
    model.load_state_dict(up.params)
    with torch.no_grad():
        expected = model.head(model.body(x) + bias)
        model.load_state_dict(personal)
        _close(model(x), expected)


def test_feddbe_state_is_made_on_the_models_device():
    # a run on a GPU crashed here (the bias and running mean were made on the CPU beside CUDA features): the meta
    # device stands in for a second device on a CPU-only machine
    model = _model(nn.Linear(D, D)).to("meta")
    ctx = LocalContext(0, 1, model, snapshot(model), {}, {}, TrainSettings(epochs=1, batch_size=N, lr=0.1))
    FedDBE().begin(ctx)
    r = ctx.prepared
    assert r.bias[BIAS].device.type == "meta" and r.running.device.type == "meta"
    assert r.bias[BIAS].shape == (D,) and r.running.dtype == model.head.weight.dtype


def test_dbe_server_keeps_the_sample_weighted_mean_of_the_first_round():
    half = DbeServer()
    state = DbeState(None)
    assert half.broadcast(state) == {}
    means = torch.tensor([[1.0, 0.0], [3.0, 4.0]])
    counts = torch.tensor([1.0, 3.0], dtype=torch.float64)
    rin = RoundInput(1, (0, 1), {}, counts, {RUNNING_MEAN: means}, {}, frozenset())
    state = half.advance(rin, state)
    _close(state.global_mean, torch.tensor([2.5, 3.0]))
    later = RoundInput(2, (0,), {}, torch.tensor([1.0], dtype=torch.float64), {}, {}, frozenset())
    assert half.advance(later, state) is state
    assert torch.equal(half.broadcast(state)[GLOBAL_MEAN], state.global_mean)


# ---- on the engine ---------------------------------------------------------------------------------------------------
def _sim(method, **over):
    values = {"clients": 4, "rounds": 2, "method": method, "db": None, "skew_probes": 0, "seed": 5, **over}
    cfg = make_config(None, values)
    return Simulation(cfg, build_federated(cfg))


def test_lgfedavg_keeps_each_clients_body_and_shares_the_head():
    sim = _sim("lgfedavg")
    for rnd in (1, 2):
        sim.round(rnd)
    heads = [n for n in sim.global_params if n.startswith("head.")]
    bodies = [n for n in sim.global_params if not n.startswith("head.")]
    assert sorted(sim.local_names) == sorted(bodies)
    own = [sim.params_for(c) for c in range(4)]
    for c in range(4):
        assert all(torch.equal(own[c][n], sim.global_params[n]) for n in heads)
    assert not torch.equal(own[0][bodies[0]], own[1][bodies[0]])  # each client its own representation


def test_the_personal_views_personalize_the_model_each_client_holds():
    """FedRoD: the personal view is the global model with the client's personal head added; the trained view its
    trained model with it; a client that never trained is the global model."""
    sim = _sim("fedrod", join_ratio=0.5)
    sim.round(1)
    trained = [c for c in range(4) if ROD_HEAD.name in sim.client_states[c]]
    never = [c for c in range(4) if c not in trained]
    assert trained and never
    c = trained[0]
    head = sim.client_states[c][ROD_HEAD.name]
    personal = sim.personal_params(c)
    assert torch.equal(personal["head.weight"], sim.global_params["head.weight"] + head["head.weight"])
    assert torch.equal(sim.trained_params(c)["head.bias"], sim.trained[c]["head.bias"])
    assert not torch.equal(sim.trained[c]["head.bias"], sim.global_params["head.bias"] + head["head.bias"])
    assert all(torch.equal(sim.personal_params(never[0])[k], v) for k, v in sim.global_params.items())


def test_perfedavg_personal_views_are_reproducible_draws():
    a, b = _sim("perfedavg"), _sim("perfedavg")
    for sim in (a, b):
        sim.round(1)
    for c in range(4):
        pa, pb = a.personal_params(c, 1), b.personal_params(c, 1)
        assert all(torch.equal(pa[k], pb[k]) for k in pa)
        assert not torch.equal(pa["head.bias"], a.global_params["head.bias"])  # one step moved it
    # another round's draw is another batch
    other = a.personal_params(0, 2)
    assert not torch.equal(other["head.weight"], a.personal_params(0, 1)["head.weight"])


STATEFUL = ["fedrod", "feddbe", "apfl", "pfedme", "perfedavg", "lgfedavg", "fedpac", "fedas", "fedcp", "gpfl"]
STATEFUL += ["fedfomo"]
NEEDS = {"fedfomo": {"validation": 0.2}}  # what a method needs beyond the defaults


def _metrics(out):
    return [
        {k: v for k, v in json.loads(line).items() if not k.startswith("time")}
        for line in (out / "metrics.jsonl").read_text().splitlines()
    ]


def _killed_child(values: dict, kill_after: int) -> None:
    def die(result):
        if result.record["round"] == kill_after:
            os._exit(137)

    run_experiment(make_config(None, values), on_round=die)
    os._exit(0)


@pytest.mark.parametrize("method", STATEFUL)
def test_killed_and_resumed_runs_equal_uninterrupted_ones(tmp_path, method, one_thread):
    values = {
        "method": method,
        "clients": 6,
        "join_ratio": 0.5,
        "rounds": 4,
        "checkpoint_every": 2,
        "skew_probes": 0,
        "db": None,
        "seed": 4,
        "state_store": "disk",
        **NEEDS.get(method, {}),
    }
    run_experiment(make_config(None, {**values, "out": str(tmp_path / "whole"), "state_store": "memory"}))
    killed = {**values, "out": str(tmp_path / "killed")}
    child = multiprocessing.get_context("fork").Process(target=_killed_child, args=(killed, 3))
    child.start()
    child.join(120)
    assert child.exitcode == 137
    run_experiment(make_config(None, killed))
    whole, resumed = _metrics(tmp_path / "whole"), _metrics(tmp_path / "killed")
    assert len(resumed) == 4 and resumed == whole
    assert any("personal_acc_mean" in r for r in whole) or method == "lgfedavg"


@pytest.mark.parametrize("method", ["fedcp", "gpfl", "fedas", "fedpac", "fedfomo"])
def test_batched_clients_take_every_personalized_part_and_name_why_a_part_declares_none(method):
    """Every built-in part has a batched form (tests/test_batched_clients.py checks each against the sequential
    loop); a part that declares none is named with its own reason."""
    import dataclasses

    from fedskew.client.local import LocalAlgorithm
    from fedskew.engine.batched_steps import batchable
    from fedskew.methods import resolve_method
    from fedskew.models import build_model

    resolved = resolve_method(method, {})
    model = build_model("mlp", in_channels=1, image_size=8, num_classes=3)
    assert not resolved.client.unbatched and batchable(resolved, model) is None

    class Mine(LocalAlgorithm):
        unbatched = "a draw of its own inside every step"

    why = batchable(dataclasses.replace(resolved, client=Mine()), model)
    assert why == "its client part Mine declares no batched form (a draw of its own inside every step)"
