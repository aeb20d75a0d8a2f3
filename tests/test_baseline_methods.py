"""Issue 13: the FedSA/FedPake paper's baselines FedNTD, FedGen, FedBABU and FedALA, each checked against its
written-out definition on tiny hand cases, against FedAvg where it must reduce to it, and on short simulations
(learning, partial participation, exact resume)."""

import dataclasses
import io
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import Tiny, digits_simulation, same_params, without_timing

from fedskew.catalog.fedala import (
    ALA_INIT,
    ALA_LOCAL,
    ALA_WEIGHTS,
    ala_combine,
    ala_weight_step,
    learn_ala_weights,
    top_parameter_names,
)
from fedskew.catalog.fedbabu import FedBABU
from fedskew.catalog.fedgen import FEDGEN_GENERATOR as PREFIX
from fedskew.catalog.fedgen import FEDGEN_LABELS as LABELS
from fedskew.catalog.fedgen import FedGen, FedGenServer, ensemble_logits
from fedskew.catalog.fedntd import FedNTD, not_true_logits, ntd_loss
from fedskew.client.kernels import PERSONAL
from fedskew.client.local import LocalContext, TrainSettings, local_train, snapshot
from fedskew.engine.checkpoint import capture, restore
from fedskew.engine.loop import dropped_out, sample_clients
from fedskew.methods import describe_methods, resolve_method
from fedskew.models.generator import Generator, draw
from fedskew.protocol import ServerContext, Upload
from fedskew.schema import ConfigError
from fedskew.server.uploads import stack_uploads

pytestmark = pytest.mark.usefixtures("one_thread")
F64 = torch.float64


def _tiny(seed=0):
    torch.manual_seed(seed)
    model = Tiny().double()
    x = torch.randn(8, 4, dtype=F64)
    y = torch.tensor([0, 1, 2, 0, 1, 2, 2, 1])
    return model, x, y


def _ctx(model, received, broadcast=None, state=None, generator=None):
    return LocalContext(
        0,
        1,
        model,
        received,
        {} if state is None else state,
        broadcast or {},
        TrainSettings(epochs=1, batch_size=4, lr=0.1),
        generator=generator,
    )


# ---- FedNTD ---------------------------------------------------------------------------------------------------------
def test_not_true_logits_drop_each_rows_true_class():
    logits = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    assert torch.equal(not_true_logits(logits, torch.tensor([0, 2])), torch.tensor([[2.0, 3.0], [4.0, 5.0]]))


def test_ntd_loss_hand_case():
    # local [1,2,3], global [3,2,1], true class 0: p = softmax([2,3]/tau), q = softmax([2,1]/tau)
    local, glob, y = (
        torch.tensor([[1.0, 2.0, 3.0]], dtype=F64),
        torch.tensor([[3.0, 2.0, 1.0]], dtype=F64),
        torch.tensor([0]),
    )
    e = math.e
    assert float(ntd_loss(local, glob, y, 1.0)) == pytest.approx((e - 1) / (e + 1), abs=1e-12)  # KL(q||p)
    r = math.sqrt(e)  # tau = 2: tau² · KL = 4 · 0.5 (q1 − q2) = 2 (√e − 1)/(√e + 1)
    assert float(ntd_loss(local, glob, y, 2.0)) == pytest.approx(2 * (r - 1) / (r + 1), abs=1e-12)
    assert float(ntd_loss(local, local, y, 1.0)) == pytest.approx(0.0, abs=1e-12)


def test_fedntd_objective_gradient_matches_the_written_out_loss():
    model, x, y = _tiny()
    received = {k: v + 0.3 * torch.randn_like(v) for k, v in snapshot(model).items()}  # a different global model
    beta, tau = 0.7, 2.0
    algo = FedNTD(beta=beta, tau=tau)
    ctx = _ctx(model, received)
    algo.begin(ctx)
    feats = model.body(x)
    loss = algo.loss(ctx, model.head(feats), feats, y, x)
    grads = torch.autograd.grad(loss, list(model.parameters()))

    # written out: CE + beta · tau² · mean_i Σ_{c ≠ y_i} q_ic (log q_ic − log p_ic), softmax over the not-true classes
    glob = Tiny().double()
    glob.load_state_dict(received)
    with torch.no_grad():
        g_logits = glob(x)
    logits = model(x)
    total = F.cross_entropy(logits, y)
    kl = 0.0
    for i in range(len(y)):
        others = [c for c in range(3) if c != int(y[i])]
        lp = logits[i, others] / tau
        lg = g_logits[i, others] / tau
        log_p = lp - torch.logsumexp(lp, 0)
        q = torch.exp(lg - torch.logsumexp(lg, 0))
        kl = kl + (q * (torch.log(q) - log_p)).sum()
    expected = total + beta * tau**2 * kl / len(y)
    assert float(loss.detach()) == pytest.approx(float(expected.detach()), abs=1e-12)
    for got, want in zip(grads, torch.autograd.grad(expected, list(model.parameters())), strict=True):
        assert torch.allclose(got, want, atol=1e-10)


@pytest.fixture(scope="module")
def fedavg_run():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the compared runs (module scope: set up before the one_thread fixture)
    try:
        sim = digits_simulation("fedavg")
        return [r["global_local_acc"] for r in sim.run()], sim.global_params
    finally:
        torch.set_num_threads(threads)


DEGENERATE = [
    ("fedntd", {"beta": 0.0}),
    ("fedala", {"layer_idx": 0}),  # no ALA tensors
    ("fedala", {"rand_percent": 0.0}),  # s = 0: no weight learning, the weights stay 1
    ("fedgen", {"gen_weight": 0.0, "server_epochs": 2}),  # the generator trains but no client uses it
]


@pytest.mark.parametrize("method, args", DEGENERATE, ids=[f"{m}-{next(iter(a))}" for m, a in DEGENERATE])
def test_degenerate_settings_are_fedavg(method, args, fedavg_run):
    accs, params = fedavg_run
    sim = digits_simulation(method, args)
    assert [r["global_local_acc"] for r in sim.run()] == accs
    assert same_params(sim.global_params, params, tol=1e-6)  # in fact bitwise


# ---- FedGen ---------------------------------------------------------------------------------------------------------
def test_ensemble_logits_is_the_share_weighted_sum_of_the_heads():
    torch.manual_seed(1)
    z, w, b = torch.randn(5, 4, dtype=F64), torch.randn(3, 2, 4, dtype=F64), torch.randn(3, 2, dtype=F64)
    p = torch.tensor([0.2, 0.5, 0.3], dtype=F64)
    want = sum(p[k] * (z @ w[k].T + b[k]) for k in range(3))
    assert torch.allclose(ensemble_logits(z, w, b, p), want, atol=1e-12)


def _fedgen_setup(seed=3, **kw):
    algo = FedGen(noise_dim=5, hidden_dim=7, gen_batch_size=6, **kw)
    half = FedGenServer(noise_dim=5, hidden_dim=7, server_epochs=30, gen_batch_size=6)
    model, x, y = _tiny()
    model = model.float()
    template = snapshot(model)
    hists = np.array([[5, 0, 1], [0, 4, 2]])
    sctx = ServerContext(2, 3, template, frozenset(template), np.array([6, 6]), hists, seed=seed)
    return algo, half, model, x.float(), y, template, sctx


def test_fedgen_client_objective_gradient_matches_the_written_out_loss():
    algo, half, model, x, y, template, sctx = _fedgen_setup(gen_weight=0.5)
    state = half.init(sctx)
    bc = half.broadcast(state)
    assert torch.allclose(bc[LABELS].double(), torch.tensor([5 / 12, 4 / 12, 3 / 12], dtype=F64))
    ctx = _ctx(model, template, broadcast=bc, generator=torch.Generator().manual_seed(11))
    algo.begin(ctx)
    feats = model.body(x)
    loss = algo.loss(ctx, model.head(feats), feats, y, x)
    grads = torch.autograd.grad(loss, list(model.parameters()))

    gen = Generator(5, 3, 7, 6)
    gen.load_state_dict({k[len(PREFIX) :]: v for k, v in bc.items() if k.startswith(PREFIX)})
    labels, noise = draw(bc[LABELS], 6, 5, torch.Generator().manual_seed(11))  # the same draws
    z = gen.train()(labels, noise).detach()
    expected = F.cross_entropy(model(x), y) + 0.5 * F.cross_entropy(model.head(z), labels)
    assert float(loss.detach()) == pytest.approx(float(expected.detach()), abs=1e-6)
    for got, want in zip(grads, torch.autograd.grad(expected, list(model.parameters())), strict=True):
        assert torch.allclose(got, want, atol=1e-6)
    assert grads[0].abs().sum() > 0 and not torch.equal(
        grads[-1], torch.autograd.grad(F.cross_entropy(model(x), y), list(model.parameters()))[-1]
    )


def _fedgen_round(template, rnd=1, seed=0):
    torch.manual_seed(seed + 100)
    ups = []
    for cid in range(2):
        params = {k: v + 0.5 * torch.randn_like(v) for k, v in template.items()}
        ups.append(Upload(cid, params, 6 if cid == 0 else 2))
    return stack_uploads(
        ups, rnd=rnd, global_params=template, trainable=frozenset(template), label_hists=np.ones((2, 3))
    )


def test_generator_forward_rows_is_one_training_forward_per_row():
    """``forward_rows`` (the batched FedGen step): R batches at once, each row's BatchNorm statistics its own, equal to
    R training-mode forwards; running statistics untouched."""
    torch.manual_seed(0)
    gen = Generator(6, 4, 8, 5).train()
    with torch.no_grad():  # a trained-looking BatchNorm affine
        gen.fc1[1].weight.uniform_(0.5, 2.0)
        gen.fc1[1].bias.uniform_(-1.0, 1.0)
    labels, noise = torch.randint(0, 4, (3, 7)), torch.rand(3, 7, 6)
    before = gen.fc1[1].running_mean.clone()
    rows = gen.forward_rows(labels, noise)
    assert torch.equal(gen.fc1[1].running_mean, before)
    one_by_one = torch.stack([gen(labels[r], noise[r]) for r in range(3)])
    assert rows.shape == (3, 7, 5)
    assert torch.allclose(rows, one_by_one, atol=1e-6)
    # the statistics are per row: the rows together as one batch give other features
    assert not torch.allclose(gen(labels.reshape(-1), noise.reshape(21, 6)).view(3, 7, 5), rows, atol=1e-3)


def test_fedgen_generator_training_is_seeded_changes_the_generator_and_fits_the_heads():
    _, half, _, _, _, template, sctx = _fedgen_setup()
    s0 = half.init(sctx)
    assert all(torch.equal(v, half.init(sctx).generator[k]) for k, v in s0.generator.items())
    other = half.init(dataclasses.replace(sctx, seed=4))
    assert not torch.equal(other.generator["fc.weight"], s0.generator["fc.weight"])
    rin = _fedgen_round(template)
    s1 = half.advance(rin, s0)
    s1b = half.advance(rin, s0)  # same state, same round: same draws
    assert all(torch.equal(s1.generator[k], s1b.generator[k]) for k in s1.generator)
    assert not torch.equal(s1.generator["fc.weight"], s0.generator["fc.weight"])
    assert s1.optimizer["state"][0]["step"] == 30
    assert not torch.equal(
        half.advance(_fedgen_round(template, rnd=2), s0).generator["fc.weight"],
        s1.generator["fc.weight"],
    )

    def ensemble_loss(state):  # the objective the server minimizes, on fixed draws
        gen = Generator(5, 3, 7, 6)
        gen.load_state_dict(state.generator)
        labels, noise = draw(state.label_shares, 200, 5, torch.Generator().manual_seed(0))
        shares = rin.num_samples / rin.num_samples.sum()
        logits = ensemble_logits(gen.train()(labels, noise), rin.params["head.weight"], rin.params["head.bias"], shares)
        return float(F.cross_entropy(logits, labels).detach())

    longer = FedGenServer(noise_dim=5, hidden_dim=7, server_epochs=300, gen_batch_size=6)
    assert ensemble_loss(longer.advance(rin, s0)) < ensemble_loss(s0) - 0.1


# ---- FedBABU --------------------------------------------------------------------------------------------------------
def test_fedbabu_keeps_the_initial_head_and_personalizes_by_fine_tuning():
    sim = digits_simulation("fedbabu", {"fine_tuning_epochs": 2}, rounds=3)
    initial = {k: v.clone() for k, v in sim.global_params.items()}
    recs = sim.run()
    heads = [k for k in initial if k.startswith("head.")]
    assert heads and all(torch.equal(sim.global_params[k], initial[k]) for k in heads)  # exactly the initial head
    assert not torch.equal(sim.global_params["body.1.weight"], initial["body.1.weight"])
    own = sim.client_states[0][PERSONAL.name]
    assert not torch.equal(own["head.weight"], initial["head.weight"])  # the fine-tuned head
    assert recs[-1]["personal_acc"] > recs[-1]["global_local_acc"] + 0.1
    # fine-tuned from the local model, the personal view is good from round 1 on (0.89 there, 0.83 in round 3)
    assert recs[-1]["personal_acc"] > 0.75 and recs[-1]["global_local_acc"] > 0.3


def test_fedbabu_fine_tunes_its_locally_trained_model_by_default():
    # PFLlib's serverbabu.py: each client fine-tunes its own model right after its local training (the body phase),
    # not the received global model; the upload is the body-trained model, untouched by the fine-tuning
    model, x, y = _tiny()
    received = snapshot(model)
    algo = FedBABU(fine_tuning_epochs=2, fine_tune="head")
    assert algo.fine_tune_from == "local"
    ctx = _ctx(model, received)
    assert [p.name for p in algo.phases(ctx)] == ["body", "fine_tune"]
    upd = local_train(algo, ctx, x, y, torch.Generator().manual_seed(0))
    own = ctx.client_state[PERSONAL.name]
    assert set(ctx.client_state) == {PERSONAL.name}  # the upload kept aside during training is not client state
    assert torch.equal(own["body.0.weight"], upd.params["body.0.weight"])  # head-only fine-tuning of the local body
    assert not torch.equal(own["body.0.weight"], received["body.0.weight"])
    assert not torch.equal(own["head.weight"], received["head.weight"])
    assert torch.equal(upd.params["head.weight"], received["head.weight"])  # uploaded: head frozen, body trained
    assert ctx.steps == 2 + 2 * 2  # 1 body epoch + 2 fine-tuning epochs of 2 batches
    # the upload is exactly a body-only round's (same draws: the body phase comes first)
    model2, _, _ = _tiny()
    body_only = FedBABU(fine_tune="head", fine_tune_every=10**6)  # round 1 is not a fine-tuning round
    ref = local_train(body_only, _ctx(model2, received), x, y, torch.Generator().manual_seed(0))
    assert same_params(upd.params, ref.params, tol=0.0)
    # full fine-tuning starts from the local model too: its first step is taken from the uploaded weights
    model3, _, _ = _tiny()
    ctx3 = _ctx(model3, received)
    full = local_train(FedBABU(fine_tuning_epochs=1), ctx3, x, y, torch.Generator().manual_seed(0))
    assert same_params(full.params, ref.params, tol=0.0)
    assert not torch.equal(ctx3.client_state[PERSONAL.name]["body.0.weight"], full.params["body.0.weight"])


def test_fedbabu_fine_tune_from_global_fine_tunes_the_received_model_then_trains_the_body():
    model, x, y = _tiny()
    received = snapshot(model)
    algo = FedBABU(fine_tuning_epochs=2, fine_tune="head", fine_tune_from="global")
    ctx = _ctx(model, received, generator=torch.Generator().manual_seed(0))
    upd = local_train(algo, ctx, x, y, torch.Generator().manual_seed(0))
    own = ctx.client_state[PERSONAL.name]
    assert torch.equal(own["body.0.weight"], received["body.0.weight"])  # head-only fine-tuning of the received model
    assert not torch.equal(own["head.weight"], received["head.weight"])
    assert torch.equal(upd.params["head.weight"], received["head.weight"])  # uploaded: head frozen, body trained
    assert not torch.equal(upd.params["body.0.weight"], received["body.0.weight"])
    assert ctx.steps == 2 * 2 + 2  # 2 fine-tuning epochs + 1 body epoch of 2 batches


def test_fedbabu_fine_tunes_only_in_every_kth_round():
    model, x, y = _tiny()
    for start, order in (("local", ["body", "fine_tune"]), ("global", ["fine_tune", "body"])):
        algo = FedBABU(fine_tuning_epochs=2, fine_tune_every=2, fine_tune_from=start)
        ctx = _ctx(model, snapshot(model))
        assert [p.name for p in algo.phases(ctx)] == ["body"]  # round 1
        ctx.round = 2
        assert [p.name for p in algo.phases(ctx)] == order


def test_fedbabu_local_fine_tuning_leaves_the_federated_training_unchanged():
    # the body phase comes first and is what is uploaded: the global models are those of a run that never
    # fine-tunes, bit for bit; the personal models are fine-tuned from each client's latest local model
    tuned = digits_simulation("fedbabu", {"fine_tuning_epochs": 1}, rounds=2)
    never = digits_simulation("fedbabu", {"fine_tune_every": 1000}, rounds=2)
    tuned.run(), never.run()
    assert same_params(tuned.global_params, never.global_params, tol=0.0)
    assert all(set(st) == {PERSONAL.name} for st in tuned.client_states.values())
    glob = digits_simulation("fedbabu", {"fine_tuning_epochs": 1, "fine_tune_from": "global"}, rounds=2)
    glob.run()
    own, old = tuned.client_states[0][PERSONAL.name], glob.client_states[0][PERSONAL.name]
    assert not torch.equal(own["body.1.weight"], old["body.1.weight"])


# ---- FedALA ---------------------------------------------------------------------------------------------------------
def test_ala_combination_and_weight_step_hand_cases():
    local, received = torch.tensor([0.0, 1.0, 2.0]), torch.tensor([2.0, 3.0, 4.0])
    assert torch.equal(ala_combine(local, received, torch.tensor([0.0, 0.5, 1.0])), torch.tensor([0.0, 2.0, 4.0]))
    w = ala_weight_step(
        torch.tensor([0.5, 0.5, 1.0]),
        torch.tensor([1.0, -1.0, 2.0]),
        torch.zeros(3),
        torch.tensor([0.2, 0.3, 1.0]),
        1.0,
    )
    assert torch.allclose(w, torch.tensor([0.3, 0.8, 0.0]))  # 0.5 − 0.2, 0.5 + 0.3, clip(1 − 2) = 0
    assert torch.equal(ala_combine(torch.tensor([0.1]), torch.tensor([0.3]), torch.ones(1)), torch.tensor([0.3]))


def test_top_parameter_names_count_tensors_from_the_end_like_pfllib():
    model = Tiny()
    assert top_parameter_names(model, 1) == ["head.bias"]
    assert top_parameter_names(model, 2) == ["head.weight", "head.bias"]
    assert top_parameter_names(model, 0) == []


def test_ala_weight_learning_follows_its_gradient_and_stays_in_the_unit_interval():
    model, x, y = _tiny()
    received = snapshot(model)
    local = {n: received[n] + torch.randn_like(received[n]) for n in ("head.weight", "head.bias")}
    ones = {n: torch.ones_like(local[n]) for n in local}
    kw = dict(rand_percent=0.5, batch_size=4, eta=0.5, threshold=1e-9, num_pre_loss=3, max_epochs=7)
    blended, w, passes = learn_ala_weights(
        model, received, local, ones, x, y, torch.Generator().manual_seed(2), until_converged=False, **kw
    )
    assert passes == 1
    # one batch of 4 from a contiguous slice: one step from W = 1 by hand
    start = int(torch.randint(0, 8 - 4 + 1, (1,), generator=torch.Generator().manual_seed(2)))
    ref = Tiny().double()
    ref.load_state_dict(received)
    loss = F.cross_entropy(ref(x[start : start + 4]), y[start : start + 4])
    g_w, g_b = torch.autograd.grad(loss, [ref.head.weight, ref.head.bias])
    want_w = torch.clamp(1 - 0.5 * g_w * (received["head.weight"] - local["head.weight"]), 0, 1)
    assert torch.allclose(w["head.weight"], want_w, atol=1e-12)
    lw, rw, lb, rb = local["head.weight"], received["head.weight"], local["head.bias"], received["head.bias"]
    assert torch.allclose(blended["head.weight"], lw + (rw - lw) * want_w)
    assert torch.allclose(w["head.bias"], torch.clamp(1 - 0.5 * g_b * (rb - lb), 0, 1))
    _, w2, passes2 = learn_ala_weights(
        model, received, local, ones, x, y, torch.Generator().manual_seed(2), until_converged=True, **kw
    )
    assert passes2 == 7  # threshold never met: the cap stops it
    assert all(float(t.min()) >= 0 and float(t.max()) <= 1 for t in w2.values())


def test_ala_weight_learning_reuses_the_body_features_bit_for_bit():
    """With every ALA tensor in the head the body holds the received model throughout, so each batch's features are
    computed once for all passes; the result equals recomputing them every pass (a BatchNorm body in train mode, whose
    features depend on the batch; 5 passes)."""
    from fedskew.models import build_model

    torch.manual_seed(0)
    model = build_model("lenet_bn", in_channels=1, image_size=8, num_classes=3)
    model.train()
    received = snapshot(model)
    names = top_parameter_names(model, 2)
    local = {n: received[n] + 0.3 * torch.randn_like(received[n]) for n in names}
    ones = {n: torch.ones_like(received[n]) for n in names}
    x, y = torch.randn(40, 1, 8, 8), torch.randint(0, 3, (40,))
    kw = dict(rand_percent=0.8, batch_size=6, eta=1.0, threshold=0.0, num_pre_loss=2, max_epochs=5)
    blended, w, passes = learn_ala_weights(
        model, received, local, ones, x, y, torch.Generator().manual_seed(3), until_converged=True, **kw
    )
    assert passes == 5
    # the loop recomputing the features every pass
    model.load_state_dict(received)
    params = dict(model.named_parameters())
    want = {n: ones[n].clone() for n in names}
    with torch.no_grad():
        for n in names:
            params[n].copy_(ala_combine(local[n], received[n], want[n]))
    m = int(0.8 * 40)
    start = int(torch.randint(0, 40 - m + 1, (1,), generator=torch.Generator().manual_seed(3)))
    for _ in range(5):
        for b in range(start, start + m, 6):
            end = min(b + 6, start + m)
            loss = F.cross_entropy(model.head(model.body(x[b:end])), y[b:end])
            grads = torch.autograd.grad(loss, [params[n] for n in names])
            with torch.no_grad():
                for n, g in zip(names, grads, strict=True):
                    want[n] = ala_weight_step(want[n], g, local[n], received[n], 1.0)
                    params[n].copy_(ala_combine(local[n], received[n], want[n]))
    assert all(torch.equal(w[n], want[n]) for n in names)
    assert all(torch.equal(blended[n], params[n].detach()) for n in names)


def test_fedala_learns_weights_in_the_unit_interval_and_keeps_lower_layers_global():
    sim = digits_simulation("fedala", {"layer_idx": 2}, rounds=3)
    recs = sim.run()
    state = sim.client_states[1]
    w = state[ALA_WEIGHTS.name]
    assert set(w) == {"head.weight", "head.bias"} == set(state[ALA_LOCAL.name])
    assert all(float(t.min()) >= 0 and float(t.max()) <= 1 for t in w.values())
    assert any(float(t.min()) < 1 for t in w.values())  # learning moved some weight off its initial 1
    init = state[ALA_INIT.name]
    assert not torch.equal(init["head.weight"], sim.global_params["head.weight"])
    assert recs[-1]["personal_acc"] > 0.3 and recs[-1]["global_local_acc"] > recs[0]["global_local_acc"]


def test_fedala_refuses_more_ala_layers_than_the_model_has():
    with pytest.raises(ConfigError, match="layer_idx=99"):
        digits_simulation("fedala", {"layer_idx": 99})


# ---- composition, parameters, runs ----------------------------------------------------------------------------------
def test_parts_are_listed_and_compose_with_server_plugins():
    names = {n for n, _, _ in describe_methods()}
    assert {"fedntd", "fedgen", "fedbabu", "fedala"} <= names
    for name in ("fedntd+disco", "fedgen+heal", "fedala+fedsa", "fedbabu+disco"):
        assert resolve_method(name, {}).name == name
    assert resolve_method("fedbabu", {}).personalized and resolve_method("fedala", {}).personalized
    assert not resolve_method("fedntd", {}).personalized
    m = resolve_method("fedntd+heal", {"fedntd.beta": 0.5, "heal.tau": 0.2})  # beta and tau exist in both parts
    assert m.args["fedntd.beta"] == 0.5 and m.args["heal.tau"] == 0.2
    with pytest.raises(ConfigError, match="ambiguous"):
        resolve_method("fedntd+heal", {"beta": 0.5})


@pytest.mark.parametrize("name", ["fedntd+local", "fedgen+local", "fedbabu+local", "fedala+local", "fedbabu+fedper"])
def test_nonsensical_compositions_are_refused(name):
    with pytest.raises(ConfigError, match="does not compose with"):
        resolve_method(name, {})


@pytest.mark.parametrize(
    "name, args, match",
    [
        ("fedala", {"rand_percent": 1.5}, "rand_percent"),
        ("fedgen", {"gen_batch_size": 1}, "gen_batch_size"),
        ("fedbabu", {"fine_tune": "body"}, "fine_tune"),
        ("fedntd", {"tau": 0}, "tau"),
        ("fedntd", {"temperature": 1}, "temperature"),
    ],
)
def test_bad_hyper_parameters_are_config_errors(name, args, match):
    with pytest.raises(ConfigError, match=match):
        resolve_method(name, args)


RUNS = [
    ("fedntd+disco", {}, "global_local_acc"),
    ("fedgen", {"server_epochs": 20}, "global_local_acc"),
    ("fedbabu", {"fine_tuning_epochs": 2}, "global_local_acc"),  # the body learns under the frozen head
    ("fedala", {}, "global_local_acc"),
]


@pytest.mark.parametrize("method, args, key", RUNS, ids=[r[0] for r in RUNS])
def test_short_digits_run_learns(method, args, key):
    recs = digits_simulation(method, args, rounds=4).run()
    assert recs[-1][key] > max(0.5, recs[0][key] + 0.05)
    assert all(math.isfinite(r["train_loss"]) for r in recs)


STATEFUL = [
    ("fedgen", {"server_epochs": 10}),
    ("fedbabu", {"fine_tuning_epochs": 1}),
    ("fedala", {"layer_idx": 2}),
    ("fedntd", {}),
]


@pytest.mark.parametrize("method, args", STATEFUL, ids=[m for m, _ in STATEFUL])
def test_partial_participation_and_missed_rounds(method, args):
    sim = digits_simulation(method, args, rounds=4, clients=6, join_ratio=0.5, client_dropout=0.3)
    recs = sim.run()
    assert any(r["participants"] < 3 for r in recs)  # some sampled clients dropped out
    assert all(math.isfinite(r["global_local_acc"]) for r in recs)
    trained = set()
    for r in range(1, 5):
        s = sample_clients(5, r, 6, 0.5)
        trained |= set(s) - set(dropped_out(5, r, s, 6, 0.3))
    if method == "fedala":  # only clients that trained hold a local model; ALA starts at their second participation
        assert {c for c, st in sim.client_states.items() if ALA_LOCAL.name in st} == trained
    if method == "fedbabu":
        assert {c for c, st in sim.client_states.items() if PERSONAL.name in st} == trained


@pytest.mark.parametrize("method, args", STATEFUL[:3], ids=[m for m, _ in STATEFUL[:3]])
def test_checkpoint_resume_is_exact(method, args):
    over = {"clients": 5, "join_ratio": 0.6}
    whole = digits_simulation(method, args, rounds=4, **over)
    rec_whole = without_timing(whole.run())
    first = digits_simulation(method, args, rounds=4, **over)
    rec_first = [without_timing([first.round(r).record])[0] for r in (1, 2)]
    buf = io.BytesIO()
    torch.save(capture(first), buf)  # through bytes, as a checkpoint file
    del first
    resumed = digits_simulation(method, args, rounds=4, **over)
    buf.seek(0)
    restore(resumed, torch.load(buf, weights_only=False))
    rec_rest = [without_timing([resumed.round(r).record])[0] for r in (3, 4)]
    assert rec_first + rec_rest == rec_whole
    assert all(torch.equal(resumed.global_params[k], whole.global_params[k]) for k in whole.global_params)
    if method == "fedgen":
        g1, g2 = resumed.server_half_state.generator, whole.server_half_state.generator
        assert all(torch.equal(g1[k], g2[k]) for k in g2)


def test_fedgen_runs_are_reproducible_and_broadcast_the_generator():
    a, b = digits_simulation("fedgen", {"server_epochs": 10}), digits_simulation("fedgen", {"server_epochs": 10})
    assert without_timing(a.run()) == without_timing(b.run())
    assert all(torch.equal(a.global_params[k], b.global_params[k]) for k in a.global_params)
    bc = a.method.server_half.broadcast(a.server_half_state)
    assert LABELS in bc and f"{PREFIX}fc.weight" in bc
