"""MOON as the paper and the official code (QinbinLi/MOON) define it.

* the contrasted representation is the output of a 2-layer MLP projection head (256-d) between the body and the
  classifier (``ModelFedCon``: base → l1 → ReLU → l2 → classifier l3), whose parameters are part of the model, so
  they are trained and aggregated; ``projection=0`` contrasts the body's features (FedDisco's code);
* on a client's first participation there is no previous model: the official code's pool is empty, so the logits
  hold the positive pair only and the term is ``−log(e^{pos}/e^{pos}) = 0``.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import digits_simulation

from fedskew.catalog.moon import Moon
from fedskew.client.local import LocalAlgorithm, LocalContext, TrainSettings, local_train, snapshot
from fedskew.methods import resolve_method
from fedskew.models import build_model, projection_width


def _model(projection=16, seed=0):
    torch.manual_seed(seed)
    return build_model("mlp", in_channels=1, image_size=8, num_classes=3, projection=projection)


def _data(n=23, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 3, (n,), generator=g)


def _train(algo, model, received, state, epochs=1):
    x, y = _data()
    ctx = LocalContext(0, 1, model, received, state, {}, TrainSettings(epochs, 5, 0.1))
    return local_train(algo, ctx, x, y, torch.Generator().manual_seed(7)), ctx


def _loss_parts(algo, model, received, state):
    x, y = _data()
    model.load_state_dict(received)
    ctx = LocalContext(0, 2, model, received, state, {}, TrainSettings(1, 5, 0.1))
    algo.begin(ctx)
    feats = model.body(x)
    logits = model.head(feats)
    return algo.loss(ctx, logits, feats, y, x), F.cross_entropy(logits, y), feats, x


def test_first_participation_has_no_negative_term():
    model = _model()
    g = snapshot(model)
    loss, ce, _, _ = _loss_parts(Moon(mu=5.0, tau=0.5, projection=16), model, g, {})
    assert loss.item() == ce.item()  # the one-logit contrastive term is exactly 0 (not log 2)
    sgd, _ = _train(LocalAlgorithm(), model, g, {})
    moon_state: dict = {}
    moon, _ = _train(Moon(mu=5.0, projection=16), model, g, moon_state)
    assert all(torch.equal(sgd.params[k], moon.params[k]) for k in g)
    assert moon.metrics["train_loss"] == pytest.approx(sgd.metrics["train_loss"], abs=1e-12)
    assert set(moon_state["moon_prev"]) == set(g)  # the next participation contrasts with this model


def test_later_participation_contrasts_projected_features_of_global_and_previous_models():
    model = _model()
    g = snapshot(model)
    algo = Moon(mu=2.0, tau=0.5, projection=16)
    state: dict = {}
    _train(algo, model, g, state)  # first participation: stores the previous model
    prev_params = state["moon_prev"]
    glob_params = {k: v + 0.01 * torch.randn_like(v) if v.is_floating_point() else v for k, v in g.items()}
    loss, ce, feats, x = _loss_parts(algo, model, glob_params, state)
    assert feats.shape[1] == 16  # the body ends in the projection head
    ref = _model()
    ref.load_state_dict(glob_params)
    z_glob = ref.body(x)
    ref.load_state_dict(prev_params)
    z_prev = ref.body(x)
    pos = F.cosine_similarity(feats, z_glob, dim=1) / 0.5
    neg = F.cosine_similarity(feats, z_prev, dim=1) / 0.5
    expected = ce + 2.0 * F.cross_entropy(torch.stack([pos, neg], 1), torch.zeros(len(x), dtype=torch.long))
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    assert (loss - ce).item() > 1e-3
    # the contrastive term trains the projection head
    model.zero_grad()
    (loss - ce).backward()
    assert model.body.proj[2].weight.grad.abs().sum() > 0


@pytest.mark.parametrize(
    "name, args, options",
    [
        ("moon", {}, {"projection": 256}),
        ("moon", {"projection": 64}, {"projection": 64}),
        ("moon", {"projection": 0}, {}),
        ("moon+heal", {"heal.tau": 0.3}, {"projection": 256}),
        ("moon+disco", {}, {"projection": 256}),
        ("moon+fedcac", {}, {"projection": 256}),
        ("fedavg", {}, {}),
        ("fedprox+disco", {}, {}),
    ],
)
def test_moon_asks_for_the_papers_projection_head(name, args, options):
    m = resolve_method(name, args)
    assert dict(m.model_options) == options
    if name.startswith("moon"):
        assert m.client.projection == options.get("projection", 0)
        assert m.args["projection"] == options.get("projection", 0)


def test_moon_refuses_a_model_without_the_head_it_expects():
    template = snapshot(build_model("mlp", in_channels=1, image_size=8, num_classes=3))
    with pytest.raises(ValueError, match="projection head of width 256"):
        Moon(projection=256).check_model(template, frozenset(template))
    Moon(projection=0).check_model(template, frozenset(template))
    with_head = snapshot(_model(projection=256))
    assert projection_width(with_head) == 256
    Moon(projection=256).check_model(with_head, frozenset())


_sim = digits_simulation


def test_projection_head_is_trained_and_aggregated(one_thread):
    sim = _sim("moon", rounds=3)
    start = {k: v.clone() for k, v in sim.global_params.items()}
    assert projection_width(start) == 256 and "body.proj.0.weight" in sim.trainable
    recs = sim.run()
    assert all(math.isfinite(r["train_loss"]) for r in recs)
    for k in ("body.proj.0.weight", "body.proj.2.weight", "head.weight"):
        assert not torch.equal(sim.global_params[k], start[k]), k  # trained by the clients, averaged by the server
    assert recs[-1]["global_acc"] > 0.25  # it learns (chance: 0.1; the deeper model starts slower than FedAvg's)
    plain = _sim("moon", {"projection": 0}, rounds=1)
    assert projection_width(plain.global_params) == 0


@pytest.mark.parametrize(
    "method, args, model",
    [
        ("moon+heal", {"heal.tau": 0.3}, "mlp"),
        ("moon+disco", {}, "lenet"),
        ("moon+fedcac", {"beta": 2.0}, "lenet_bn"),
        ("moon", {"projection": 32}, "resnet8"),
    ],
)
def test_moon_compositions_run_on_every_kind_of_model(one_thread, method, args, model):
    over = {"dataset": "digits", "model": model}
    if model == "resnet8":
        over["clients"] = 2
    sim = _sim(method, args, rounds=2, **over)
    recs = sim.run()
    assert all(math.isfinite(r["train_loss"]) for r in recs)
    assert projection_width(sim.global_params) == sim.method.model_options.get("projection", 0)
