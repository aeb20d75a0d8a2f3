"""Client-side algorithms are hooks on one loop: check each against its definition on a tiny model."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import Tiny

from fedskew.catalog.fedprox import FedProx
from fedskew.catalog.moon import Moon
from fedskew.catalog.scaffold import Scaffold, ScaffoldServer
from fedskew.client.local import LocalAlgorithm, LocalContext, TrainSettings, local_train, snapshot
from fedskew.protocol import ServerContext
from fedskew.server.uploads import stack_uploads


def _setup(seed=0):
    torch.manual_seed(seed)
    model = Tiny()
    x = torch.randn(23, 4)
    y = torch.randint(0, 3, (23,))
    return model, snapshot(model), x, y


def _train(algo, model, received, x, y, state=None, broadcast=None, epochs=2):
    ctx = LocalContext(
        0,
        1,
        model,
        received,
        {} if state is None else state,
        broadcast or {},
        TrainSettings(epochs=epochs, batch_size=5, lr=0.1),
    )
    upd = local_train(algo, ctx, x, y, torch.Generator().manual_seed(7))
    return upd, ctx


def _close(a, b):
    return all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


def test_local_train_is_deterministic_and_counts_steps():
    model, g, x, y = _setup()
    u1, c1 = _train(LocalAlgorithm(), model, g, x, y)
    u2, _ = _train(LocalAlgorithm(), model, g, x, y)
    assert _close(u1.params, u2.params)
    assert c1.steps == 2 * math.ceil(23 / 5) and u1.num_samples == 23
    assert not _close(u1.params, g)


def test_drop_last():
    model, g, x, y = _setup()
    ctx = LocalContext(0, 1, model, g, {}, {}, TrainSettings(epochs=1, batch_size=5, lr=0.1, drop_last=True))
    local_train(LocalAlgorithm(), ctx, x, y, torch.Generator().manual_seed(0))
    assert ctx.steps == 4


def test_the_batch_layout_is_one_rule_for_every_caller():
    keep = TrainSettings(epochs=1, batch_size=5, lr=0.1)
    drop = TrainSettings(epochs=1, batch_size=5, lr=0.1, drop_last=True)
    assert keep.batches(23) == (5, 5) and drop.batches(23) == (5, 4)
    assert keep.batches(20) == drop.batches(20) == (5, 4)
    assert keep.batches(3) == drop.batches(3) == (3, 1)  # a client smaller than one batch keeps its one batch


def test_fedprox_mu0_is_sgd_and_mu_pulls_toward_global():
    model, g, x, y = _setup()
    sgd, _ = _train(LocalAlgorithm(), model, g, x, y)
    prox0, _ = _train(FedProx(mu=0.0), model, g, x, y)
    assert _close(sgd.params, prox0.params)
    prox, _ = _train(FedProx(mu=5.0), model, g, x, y)
    dist = lambda p: sum(((p[k] - g[k]) ** 2).sum() for k in g)  # noqa: E731
    assert dist(prox.params) < dist(sgd.params)


def test_fedprox_loss_value():
    model, g, x, y = _setup()
    with torch.no_grad():
        model.head.bias.add_(1.0)  # move away from the anchor by exactly 1 in 3 coordinates
    ctx = LocalContext(0, 1, model, g, {}, {}, TrainSettings(1, 5, 0.1))
    algo = FedProx(mu=0.2)
    algo.begin(ctx)
    feats = model.body(x)
    logits = model.head(feats)
    expected = F.cross_entropy(logits, y) + 0.5 * 0.2 * 3.0
    assert algo.loss(ctx, logits, feats, y, x).item() == pytest.approx(expected.item(), rel=1e-6)


def test_moon_mu0_is_sgd_and_first_participation_has_no_contrastive_term():
    model, g, x, y = _setup()
    sgd, _ = _train(LocalAlgorithm(), model, g, x, y)
    m0, _ = _train(Moon(mu=0.0), model, g, x, y)
    assert _close(sgd.params, m0.params)
    algo = Moon(mu=1.0, tau=0.5)
    model.load_state_dict(g)
    ctx = LocalContext(0, 1, model, g, {}, {}, TrainSettings(1, 5, 0.1))
    algo.begin(ctx)
    feats = model.body(x)
    logits = model.head(feats)
    extra = algo.loss(ctx, logits, feats, y, x) - F.cross_entropy(logits, y)
    assert extra.item() == 0.0  # no previous model: only the positive logit, -log(1) = 0 (official code)
    state: dict = {}
    upd, _ = _train(algo, model, g, x, y, state=state)
    assert _close(state["moon_prev"], upd.params)  # the previous model is remembered per client
    # the next participation has the negative pair: the term is now positive
    ctx = LocalContext(0, 2, model, g, state, {}, TrainSettings(1, 5, 0.1))
    model.load_state_dict(g)
    algo.begin(ctx)
    feats = model.body(x)
    extra = algo.loss(ctx, model.head(feats), feats, y, x) - F.cross_entropy(model.head(feats), y)
    assert extra.item() > 0


def test_scaffold_first_round_is_sgd_and_control_update():
    model, g, x, y = _setup()
    sgd, c_sgd = _train(LocalAlgorithm(), model, g, x, y)
    algo = Scaffold()
    state: dict = {}
    upd, ctx = _train(algo, model, g, x, y, state=state)
    assert _close(sgd.params, upd.params)  # c = c_i = 0
    scale = 1.0 / (ctx.steps * 0.1)
    for n in ("head.bias", "body.0.weight"):
        expected = (g[n] - upd.params[n]) * scale
        assert torch.allclose(upd.extras[f"scaffold_dc/{n}"], expected, atol=1e-6)
        assert torch.allclose(state["scaffold_ci"][n], expected, atol=1e-6)
    # server: c <- c + sum(dc)/N over all N clients
    trainable = frozenset(n for n, _ in model.named_parameters())
    sctx = ServerContext(4, 3, g, trainable, np.ones(4), np.ones((4, 3)))
    half = ScaffoldServer()
    s0 = half.init(sctx)
    rin = stack_uploads([upd, upd], rnd=1, global_params=g, trainable=trainable, label_hists=np.ones((2, 3)))
    s1 = half.advance(rin, s0)
    assert torch.allclose(s1.c["head.bias"], 2 * upd.extras["scaffold_dc/head.bias"] / 4)
    # a non-zero correction changes the trajectory in its direction
    bc = half.broadcast(s1)
    upd2, _ = _train(Scaffold(), model, g, x, y, state={}, broadcast=bc)
    assert not _close(upd2.params, sgd.params)


def test_scaffold_control_weights_samples_is_flowers_niid_bench_average():
    """``control_weights=samples``: c ← c + (|S|/N) Σ_S (n_i / Σ_S n_j) Δc_i (Flower's baselines/niid_bench strategy
    and server); the default stays the paper's c ← c + (1/N) Σ_S Δc_i. Equal client sizes make the two the same."""
    from dataclasses import replace

    model, g, x, y = _setup()
    ups = [replace(_train(Scaffold(), model, g, x[i:], y[i:], state={})[0], cid=i) for i in range(3)]
    ups = [replace(u, num_samples=n) for u, n in zip(ups, (10, 30, 60), strict=True)]
    trainable = frozenset(n for n, _ in model.named_parameters())
    sctx = ServerContext(5, 3, g, trainable, np.ones(5), np.ones((5, 3)))
    rin = stack_uploads(ups, rnd=1, global_params=g, trainable=trainable, label_hists=np.ones((3, 3)))
    key = "scaffold_dc/head.weight"
    deltas = [u.extras[key].double() for u in ups]
    weighted, uniform = ScaffoldServer("samples"), ScaffoldServer()
    c_w = weighted.advance(rin, weighted.init(sctx)).c["head.weight"]
    c_u = uniform.advance(rin, uniform.init(sctx)).c["head.weight"]
    by_hand_w = (3 / 5) * (0.1 * deltas[0] + 0.3 * deltas[1] + 0.6 * deltas[2])
    by_hand_u = (deltas[0] + deltas[1] + deltas[2]) / 5
    assert torch.allclose(c_w.double(), by_hand_w, atol=1e-7) and torch.allclose(c_u.double(), by_hand_u, atol=1e-7)
    assert not torch.allclose(c_w, c_u, atol=1e-4)  # unequal sizes: the two averages differ
    equal = stack_uploads(
        [replace(u, num_samples=20) for u in ups], rnd=1, global_params=g, trainable=trainable, label_hists=None
    )
    assert torch.allclose(
        weighted.advance(equal, weighted.init(sctx)).c["head.weight"],
        uniform.advance(equal, uniform.init(sctx)).c["head.weight"],
        atol=1e-7,
    )


def test_scaffold_control_weights_is_a_checked_method_setting():
    from fedskew.methods import resolve_method
    from fedskew.privacy.server import refusal
    from fedskew.schema import ConfigError
    from fedskew.server.streaming import stream_refusal

    assert resolve_method("scaffold", {}).server_half.control_weights == "uniform"
    samples = resolve_method("scaffold", {"control_weights": "samples"})
    assert samples.server_half.control_weights == "samples"
    # the sample-weighted average reads each delta beside its client's size: not a plain sum, so DP and streaming
    # refuse it by name, while the uniform default stays private
    assert "reads the individual uploads' extras" in refusal(samples)
    assert "reads the individual uploads' extras" in stream_refusal(samples)
    assert refusal(resolve_method("scaffold", {})) is None
    with pytest.raises(ConfigError, match="control_weights"):
        resolve_method("scaffold", {"control_weights": "size"})


@pytest.mark.parametrize(
    "name, args, expected",
    [
        ("scaffold", {}, "uniform"),  # SCAFFOLD paper (and PFLlib): plain mean of the participants
        ("scaffold", {"weights": "samples"}, "samples"),
        ("scaffold", {"server.weights": "samples"}, "samples"),
        ("fedavg", {}, "samples"),
        ("fedavg", {"weights": "uniform"}, "uniform"),
        ("fedprox", {}, "samples"),
        ("moon", {}, "samples"),
    ],
)
def test_default_server_weighting_follows_the_client_parts_paper(name, args, expected):
    from fedskew.methods import resolve_method
    from fedskew.server.weights import SampleWeights, UniformWeights

    m = resolve_method(name, args)
    kind = {SampleWeights: "samples", UniformWeights: "uniform"}[type(m.server.weighting)]
    assert kind == expected and m.args["weights"] == expected


# ---- the client state: typed entries, each declared by the part that keeps it ---------------------------------------
def test_a_client_part_keeps_only_the_state_it_declares():
    from dataclasses import dataclass

    from fedskew.client.local import StateKey, Wrapper, declared_state

    COUNT = StateKey[int]("count", "rounds this client trained")

    class Counting(LocalAlgorithm):
        state_keys = (COUNT,)

        def begin(self, ctx):
            ctx.keep(COUNT, (ctx.kept(COUNT) or 0) + 1)

    class Sloppy(LocalAlgorithm):
        def begin(self, ctx):
            ctx.client_state["scratch"] = 1  # an entry no part declared

    model, received, x, y = _setup()
    state: dict = {}
    for _ in range(2):
        _train(Counting(), model, received, x, y, state=state, epochs=1)
    assert state == {"count": 2}
    with pytest.raises(TypeError, match=r"Sloppy keeps \['scratch'\] in the client state without declaring"):
        _train(Sloppy(), model, received, x, y, epochs=1)

    TAG = StateKey[str]("tag")

    @dataclass
    class Tagging(Wrapper):
        inner: LocalAlgorithm
        state_keys = (TAG,)

        def begin(self, ctx):
            ctx.keep(TAG, "seen")
            self.inner.begin(ctx)

    wrapped = Tagging(Counting())
    assert declared_state(wrapped) == {"count", "tag"}
    state = {}
    _train(wrapped, model, received, x, y, state=state, epochs=1)
    assert state == {"count": 1, "tag": "seen"}
    ctx = LocalContext(0, 1, model, received, {}, {}, TrainSettings(epochs=1, batch_size=5, lr=0.1))
    with pytest.raises(KeyError, match="client 0 holds no 'count' in its state"):
        ctx.held(COUNT)


def test_every_registered_client_part_declares_its_state():
    """Each built-in part's state entries are typed keys of its own module, and no two parts share a name unless it
    is the same entry (PERSONAL: the model a client keeps for itself)."""
    from fedskew.client.local import StateKey, declared_state, unwrapped
    from fedskew.methods import resolve_method
    from fedskew.registry import CLIENTS

    resolve_method("fedavg", {})  # the built-in parts are registered
    owners: dict[str, set[str]] = {}
    for name in CLIENTS:
        algo = resolve_method(name, {}).client
        for c in type(unwrapped(algo)).__mro__:
            for key in vars(c).get("state_keys", ()):
                assert isinstance(key, StateKey), (name, key)
        for key in declared_state(algo):
            owners.setdefault(key, set()).add(name)
    assert {"scaffold_ci", "moon_prev", "feddyn_grad", "feddc_ci", "personal_model", "ala_weights"} <= set(owners)
    assert owners["personal_model"] >= {"ditto", "fedamp", "fedbabu"}
