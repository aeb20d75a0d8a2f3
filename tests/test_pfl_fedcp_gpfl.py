"""FedCP and GPFL (issue 42): their composite heads, worked numbers of each local step (the losses written out here
from the papers' official code, differentiated by autograd on plain tensors), and the engine's personal group."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedskew.catalog.fedcp import CPHead, FedCP, mmd_rbf
from fedskew.catalog.gpfl import GPFL, GPFLHead, conditional_inputs, embedding_loss
from fedskew.client.local import LocalContext, TrainSettings, local_train, snapshot
from fedskew.config import make_config
from fedskew.data.federated import build_federated
from fedskew.engine.loop import Simulation
from fedskew.models import FedModel, build_model
from fedskew.schema import ConfigError

D, C, N = 4, 3, 6


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, D, generator=g), torch.tensor([0, 1, 2, 0, 2, 2])


def _model(head_module, seed=1) -> FedModel:
    torch.manual_seed(seed)
    model = FedModel(nn.Linear(D, D), nn.Linear(D, C))
    model.head = head_module(model.head)
    return model


def _ctx(model, lr=0.1, state=None):
    settings = TrainSettings(epochs=1, batch_size=N, lr=lr)
    return LocalContext(0, 1, model, snapshot(model), state if state is not None else {}, {}, settings)


def _close(a, b, tol=1e-5):
    assert torch.allclose(a.double(), b.double(), atol=tol, rtol=0), (a, b)


# ---- FedCP -----------------------------------------------------------------------------------------------------------
def _mmd_by_loops(x, y, widths=(10.0, 15.0, 20.0, 50.0)):
    def k(a, b):
        return sum(torch.exp(-((a - b) ** 2).sum() / (2 * w)) for w in widths)

    n = x.shape[0]
    total = sum(k(x[i], x[j]) + k(y[i], y[j]) - 2 * k(x[i], y[j]) for i in range(n) for j in range(n))
    return total / (n * n)


def test_mmd_is_the_rbf_kernel_sum_of_the_official_code():
    x, y = _data()[0], _data(1)[0]
    _close(mmd_rbf(x, y), _mmd_by_loops(x, y))
    assert float(mmd_rbf(x, x)) == pytest.approx(0.0, abs=1e-6)
    # one point each, at distance 1: 2·Σ(1 − e^{−1/(2σ)})
    one = mmd_rbf(torch.zeros(1, 2), torch.tensor([[1.0, 0.0]]))
    assert float(one) == pytest.approx(2 * sum(1 - torch.exp(torch.tensor(-0.5 / w)).item() for w in (10, 15, 20, 50)))
    z = x.clone().requires_grad_(True)  # equal points: a finite gradient (no square root at distance 0)
    mmd_rbf(z, x).backward()
    assert torch.isfinite(z.grad).all()


def _gate_by_hand(head, z, noise=None):
    c = head.personal.context / head.personal.context.norm()
    s = head.policy(z * c).view(z.shape[0], 2, D)
    if noise is not None:
        s = s - noise.log()
    r = torch.softmax(s, dim=1)
    return r[:, 0], r[:, 1]


def test_cp_head_starts_both_heads_from_the_classifier_and_gates_each_feature():
    torch.manual_seed(0)
    source = nn.Linear(D, C)
    head = CPHead(source)
    assert torch.equal(head.generic.weight, source.weight) and torch.equal(head.personal.weight, source.weight)
    assert head.personal.context.shape == (1, D) and ((head.personal.context >= 0) & (head.personal.context < 1)).all()
    z = _data()[0]
    head.eval()  # noise-free
    r, s = head.gate(z)
    er, es = _gate_by_hand(head, z)
    _close(r, er)
    _close(r + s, torch.ones_like(r))
    _close(head(z), head.personal(z * er) + head.generic(z * es))
    head.train()
    head.noise = torch.Generator().manual_seed(9)
    r, _ = head.gate(z)
    noise = torch.empty(N, 2, D).exponential_(generator=torch.Generator().manual_seed(9))
    _close(r, _gate_by_hand(head, z, noise)[0])


def test_fedcp_steps_freeze_the_global_head_pull_the_body_to_the_received_one_and_upload_half_the_head():
    """Two steps (batches of 3): the MMD term is zero with a zero gradient at the received body, so the second step
    is the one that shows it."""
    x, y = _data()
    model = _model(CPHead)
    received = snapshot(model)
    lam, lr, seed, bs = 20.0, 0.5, 3, 3
    ctx = _ctx(model, lr)
    ctx.settings = TrainSettings(epochs=1, batch_size=bs, lr=lr)
    up = local_train(FedCP(lam=lam), ctx, x, y, torch.Generator().manual_seed(seed))
    # the same draws: the noise generator's seed, then the epoch's permutation, from the client's stream
    g = torch.Generator().manual_seed(seed)
    noise_gen = torch.Generator().manual_seed(int(torch.randint(0, 2**62, (1,), generator=g)))
    perm = torch.randperm(N, generator=g)
    ref = _model(CPHead)  # the same initial weights, stepped here by autograd on the loss written out
    params = dict(ref.named_parameters())
    trained = [n for n in params if not n.startswith("head.generic.")]
    mmd_moved = []
    for b in range(N // bs):
        idx = perm[b * bs : (b + 1) * bs]
        xb, yb = x[idx], y[idx]
        z = ref.body(xb)
        r, s = _gate_by_hand(ref.head, z, torch.empty(bs, 2, D).exponential_(generator=noise_gen))
        logits = ref.head.personal(z * r) + ref.head.generic(z * s)
        z_received = xb @ received["body.weight"].T + received["body.bias"]
        mmd = lam * mmd_rbf(z, z_received)
        (mmd_grad,) = torch.autograd.grad(mmd, params["body.weight"], retain_graph=True)
        mmd_moved.append(float(mmd_grad.abs().max()))
        grads = torch.autograd.grad(F.cross_entropy(logits, yb) + mmd, [params[n] for n in trained])
        with torch.no_grad():
            for n, gr in zip(trained, grads, strict=True):
                params[n].sub_(lr * gr)
    assert mmd_moved[0] < 1e-7 < 1e-4 < mmd_moved[1]  # the term acts from the second step on
    for n in trained:
        _close(up.params[n], params[n])
    for name in ("weight", "bias"):  # the global head did not train; its upload is half of it, half the personal one
        half = 0.5 * (received[f"head.generic.{name}"] + up.params[f"head.personal.{name}"])
        _close(up.params[f"head.generic.{name}"], half)
    _close(up.params["head.personal.context"], up.params["head.personal.weight"].sum(0, keepdim=True))
    assert model.head.noise is None


# ---- GPFL ------------------------------------------------------------------------------------------------------------
def test_gpfl_conditional_inputs_and_embedding_loss_by_hand():
    e = torch.tensor([[1.0, 0.0], [0.0, 2.0], [3.0, 3.0]])
    p, g = conditional_inputs(e, torch.tensor([2, 0, 1]))
    _close(p, torch.tensor([5 / 3, 1.0]))
    _close(g, torch.tensor([4 / 3, 5 / 3]))
    f, y = torch.tensor([[1.0, 1.0], [0.0, -1.0]]), torch.tensor([2, 1])
    cos = torch.tensor([[2**-0.5, 2**-0.5, 1.0], [0.0, -1.0, -(2**-0.5)]])
    expected = -(torch.log_softmax(cos, 1)[0, 2] + torch.log_softmax(cos, 1)[1, 1]) / 2
    _close(embedding_loss(f, y, e), expected)


def test_gpfl_head_reads_the_personal_conditional_input():
    torch.manual_seed(0)
    head = GPFLHead(nn.Linear(D, C))
    assert torch.equal(head.personal.personal_input, torch.zeros(D))  # the official start: zero inputs
    head.personal.personal_input.copy_(torch.arange(D, dtype=torch.float32))
    z = _data()[0]
    c = head.personal.personal_input
    valve = F.relu(z * (head.valve.gamma(c) + 1) + head.valve.beta(c))
    _close(head(z), head.personal(valve))


def test_gpfl_one_step_aligns_the_global_features_and_keeps_the_inputs_of_its_trained_embeddings():
    x, y = _data()
    model = _model(GPFLHead)
    with torch.no_grad():  # nonzero conditional inputs, as after a first round
        model.head.personal.generic_input.copy_(torch.linspace(-1, 1, D))
        model.head.personal.personal_input.copy_(torch.linspace(1, -0.5, D))
    start = {n: t.detach().clone() for n, t in model.named_parameters()}
    lam, mu, lr, seed = 0.5, 0.1, 0.1, 3
    up = local_train(GPFL(lam=lam, mu=mu), _ctx(model, lr), x, y, torch.Generator().manual_seed(seed))
    perm = torch.randperm(N, generator=torch.Generator().manual_seed(seed))
    ref = _model(GPFLHead)
    with torch.no_grad():
        ref.head.personal.generic_input.copy_(torch.linspace(-1, 1, D))
        ref.head.personal.personal_input.copy_(torch.linspace(1, -0.5, D))
    params = dict(ref.named_parameters())
    xb, yb = x[perm], y[perm]
    z = ref.body(xb)
    cov = ref.head.valve
    pers = F.relu(z * (cov.gamma(ref.head.personal.personal_input) + 1) + cov.beta(ref.head.personal.personal_input))
    glob = F.relu(z * (cov.gamma(ref.head.personal.generic_input) + 1) + cov.beta(ref.head.personal.generic_input))
    e = params["head.embedding.weight"]
    cos = F.normalize(glob) @ F.normalize(e).T
    frozen = start["head.embedding.weight"][yb]
    loss = F.cross_entropy(ref.head.personal(pers), yb) + F.cross_entropy(cos, yb)
    loss = loss + lam * ((glob - frozen) ** 2).sum().sqrt()
    grads = dict(zip(params, torch.autograd.grad(loss, list(params.values())), strict=True))
    for n in params:
        decay = mu * start[n] if n.startswith(("head.valve.", "head.embedding.")) else 0
        _close(up.params[n], start[n] - lr * (grads[n] + decay))
    p, g = conditional_inputs(up.params["head.embedding.weight"], torch.bincount(y, minlength=C))
    _close(up.params["head.personal.personal_input"], p)
    _close(up.params["head.personal.generic_input"], g)


# ---- in the engine ---------------------------------------------------------------------------------------------------
def _sim(method, **over):
    values = {"clients": 4, "rounds": 2, "method": method, "db": None, "skew_probes": 0, "seed": 5, **over}
    cfg = make_config(None, values)
    return Simulation(cfg, build_federated(cfg))


@pytest.mark.parametrize("method", ["fedcp", "gpfl"])
def test_each_client_keeps_its_personal_entries_and_the_rest_is_averaged(method):
    sim = _sim(method, join_ratio=0.5)
    sim.round(1)
    personal = {n for n in sim.global_params if n.startswith("head.personal.")}
    assert sim.local_names == personal and sim.method.personalized
    trained = [c for c in range(4) if c in sim.trained]
    never = [c for c in range(4) if c not in sim.trained]
    assert len(trained) == 2 and never
    own = [sim.personal_params(c) for c in trained]
    for c, mine in zip(trained, own, strict=True):
        assert all(torch.equal(mine[n], sim.trained[c][n]) for n in personal)
        assert all(torch.equal(mine[n], sim.global_params[n]) for n in sim.global_params if n not in personal)
    assert not torch.equal(own[0]["head.personal.weight"], own[1]["head.personal.weight"])
    # the personal entries never travel
    full = sum(t.numel() * t.element_size() for t in sim.global_params.values())
    kept = sum(sim.global_params[n].numel() * sim.global_params[n].element_size() for n in personal)
    assert sim.server.wire_bytes(sim.global_params) == full - kept


def test_composite_head_methods_refuse_a_plain_head():
    plain = snapshot(build_model("mlp", in_channels=1, image_size=8, num_classes=3))
    for algo in (FedCP(), GPFL()):
        with pytest.raises(ValueError, match="composite head"):
            algo.check_model(plain, frozenset(plain))
    from fedskew.engine.model_init import local_state_names

    with pytest.raises(ConfigError, match="no personal entries"):
        mlp = build_model("mlp", in_channels=1, image_size=8, num_classes=3)
        local_state_names(frozenset({"personal"}), mlp, frozenset())


def test_build_model_makes_the_composite_head_from_the_linear_classifier():
    model = build_model("cnn", in_channels=1, image_size=28, num_classes=10, head_module=CPHead)
    assert isinstance(model.head, CPHead) and model.head.generic.in_features == 512
    assert model(torch.zeros(2, 1, 28, 28)).shape == (2, 10)
    torch.manual_seed(0)
    b = build_model("mlp", in_channels=1, image_size=8, num_classes=3)
    torch.manual_seed(0)
    c = build_model("mlp", in_channels=1, image_size=8, num_classes=3, head_module=GPFLHead)
    assert all(torch.equal(b.state_dict()[n], c.state_dict()[n]) for n in b.state_dict() if n.startswith("body."))
