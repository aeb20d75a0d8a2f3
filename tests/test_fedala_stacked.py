"""FedALA's weight learning batched over clients (issue 47): ``learn_ala_weights_stacked`` gives, client by client,
what ``learn_ala_weights`` gives (passes, weights, blended tensors), and the batched simulation uses it where it
applies and falls back to each client's ``begin`` where it does not."""

import pytest
import torch
from conftest import digits_simulation

import fedskew.catalog.fedala as fedala
from fedskew.catalog.fedala import (
    AlaJob,
    learn_ala_weights,
    learn_ala_weights_stacked,
    stacked_weight_learning_applies,
    top_parameter_names,
)
from fedskew.client.local import LocalContext, TrainSettings
from fedskew.engine.batched import train_batched
from fedskew.models import build_model


def _client(model, received, n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, 8, 8, generator=g)
    y = torch.randint(0, 10, (n,), generator=g)
    settings = TrainSettings(1, 10, 0.1)
    ctx = LocalContext(
        cid=seed, round=2, model=model, received=received, client_state={}, broadcast={}, settings=settings,
        x=x, y=y, generator=torch.Generator().manual_seed(100 + seed),
    )  # fmt: skip
    return ctx


@pytest.mark.parametrize("layer_idx", [1, 2])
def test_stacked_weight_learning_equals_each_clients_own(layer_idx):
    torch.manual_seed(0)
    model = build_model("mlp", in_channels=1, image_size=8, num_classes=10)
    names = top_parameter_names(model, layer_idx)
    assert stacked_weight_learning_applies(model, names)
    received = {k: v.detach().clone() for k, v in model.state_dict().items()}
    # clients of different sizes (ragged last batches, one with no sample drawn), some learning until the loss
    # settles (their first time, from weights 1), others one pass from learned weights
    specs = [(37, True), (64, False), (23, True), (1, True), (50, False)]
    jobs, expected = [], []
    for k, (n, first_time) in enumerate(specs):
        ctx = _client(model, received, n, k)
        local = {nm: received[nm] + 0.3 * torch.randn_like(received[nm]) for nm in names}
        weights = {nm: torch.ones_like(received[nm]) if first_time else torch.rand_like(received[nm]) for nm in names}
        m = int(0.8 * n)
        start = int(torch.randint(0, n - m + 1, (1,), generator=torch.Generator().manual_seed(k))) if m else 0
        jobs.append(AlaJob(ctx, local, weights, start, m, until_converged=first_time))
        # the sequential learning draws its slice start from its generator: give it one that draws the same start
        model.load_state_dict(received)
        blended, w, passes = learn_ala_weights(
            model, received, local, weights, ctx.x, ctx.y, torch.Generator().manual_seed(k),
            rand_percent=0.8, batch_size=10, eta=1.0, until_converged=first_time, threshold=1e-4, num_pre_loss=4,
            max_epochs=30,
        )  # fmt: skip
        expected.append((blended, w, passes))
    got = learn_ala_weights_stacked(
        model, names, jobs, batch_size=10, eta=1.0, threshold=1e-4, num_pre_loss=4, max_epochs=30
    )
    passes = [p for _, _, p in got]
    assert passes == [p for _, _, p in expected]
    assert passes[3] == 0 and passes[1] == passes[4] == 1  # no sample drawn; one pass from learned weights
    assert max(passes) > 5  # some clients learned for several passes before their loss settled
    for (b_got, w_got, _), (b_exp, w_exp, _) in zip(got, expected, strict=True):
        for nm in names:
            torch.testing.assert_close(w_got[nm], w_exp[nm], atol=1e-5, rtol=0)
            torch.testing.assert_close(b_got[nm], b_exp[nm], atol=1e-5, rtol=0)
    assert any((w_got[nm] != 1).any() for w_got in (g[1] for g in got) for nm in names)  # the weights moved


def test_it_does_not_apply_where_the_features_of_a_batch_are_not_fixed():
    bn = build_model("lenet_bn", in_channels=1, image_size=8, num_classes=10)
    assert not stacked_weight_learning_applies(bn, top_parameter_names(bn, 1))  # BatchNorm in training mode
    mlp = build_model("mlp", in_channels=1, image_size=8, num_classes=10)
    assert stacked_weight_learning_applies(mlp, top_parameter_names(mlp, 2))
    body_too = top_parameter_names(mlp, 4)  # reaches into the body: the features change with the weights
    assert not all(n.startswith("head.") for n in body_too)
    assert not stacked_weight_learning_applies(mlp, body_too)


@pytest.mark.parametrize(("model", "stacked"), [("mlp", True), ("lenet_bn", False)])
def test_the_batched_round_learns_stacked_where_it_applies(monkeypatch, model, stacked):
    calls = {"own": 0, "stacked": 0}
    own, together = fedala.learn_ala_weights, fedala.learn_ala_weights_stacked

    def count_own(*a, **k):
        calls["own"] += 1
        return own(*a, **k)

    def count_stacked(*a, **k):
        calls["stacked"] += 1
        return together(*a, **k)

    monkeypatch.setattr(fedala, "learn_ala_weights", count_own)
    monkeypatch.setattr(fedala, "learn_ala_weights_stacked", count_stacked)
    sim = digits_simulation("fedala", {"layer_idx": 2}, rounds=2, model=model)
    for rnd in (1, 2):
        plan = sim.open_round(rnd)
        cids = [c for c in plan.sampled if c not in plan.gone]
        for u in train_batched(sim, rnd, cids, {c: sim.params_for(c) for c in cids}, plan.broadcast):
            sim.take_upload(plan, u)
        sim.close_round(plan)
    # round 1: no client has a local model yet (nothing learned); round 2: every client learns
    assert (calls["stacked"], calls["own"]) == ((1, 0) if stacked else (0, 4))
    assert all(s["ala_weights"] for s in sim.client_states.values())
