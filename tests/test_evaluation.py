"""Evaluation scores each distinct (model, sample) pair once, in right-sized batches, with unchanged numbers."""

import pytest
import torch

from fedskew.config import make_config
from fedskew.data.federated import build_federated
from fedskew.engine.evaluate import EVAL_ACTIVATION_BUDGET, auto_eval_batch, pooled, predict_scores
from fedskew.engine.loop import Simulation
from fedskew.models import build_model


def evaluate_global(model, x, y, batch_size):
    """The global test set scored directly, one pass: the reference for the engine's views."""
    return pooled("global", predict_scores(model, x, y, torch.zeros(x.shape[0], dtype=torch.long), 1, batch_size))


def _sim(**kw):
    cfg = make_config(None, {"clients": 5, "db": None, "skew_probes": 0, **kw})
    return Simulation(cfg, build_federated(cfg))


def _passes(sim, monkeypatch):
    """The sources of the evaluation passes ``sim`` makes from now on."""
    seen = []
    scores_of = sim.batch_scores_of

    def spy(passes):
        seen.extend(source for _, source in passes)
        return scores_of(passes)

    monkeypatch.setattr(sim, "batch_scores_of", spy)
    return seen


def test_pfllib_global_test_is_scored_once_as_the_clients_tests(monkeypatch):
    sim = _sim(protocol="pfllib")
    assert sim.global_is_local_union
    data = sim.data
    sim.model.load_state_dict(sim.global_params)
    direct = evaluate_global(sim.model, data.x_test, data.y_test, 64)
    passes = _passes(sim, monkeypatch)
    rec, _ = sim.evaluate()
    assert passes == ["local"]  # the global test set is not scored a second time
    assert rec["global_acc"] == direct["global_acc"] == rec["global_local_acc"]
    assert rec["global_loss"] == pytest.approx(direct["global_loss"], rel=1e-6)  # float32 logits


def test_default_protocol_keeps_a_separate_global_test_pass(monkeypatch):
    sim = _sim()
    assert not sim.global_is_local_union
    passes = _passes(sim, monkeypatch)
    rec, _ = sim.evaluate()
    assert passes == ["test", "local"]
    sim.model.load_state_dict(sim.global_params)
    assert rec["global_acc"] == evaluate_global(sim.model, sim.data.x_test, sim.data.y_test, 7)["global_acc"]


def test_domain_runs_pool_the_per_domain_pass(fake_domains, monkeypatch):
    cfg = make_config(
        None,
        {"dataset": "digits_domains", "partition": "domain", "clients": 6, "domain_fraction": 0.1, "db": None},
    )
    sim = Simulation(cfg, build_federated(cfg))
    sim.model.load_state_dict(sim.global_params)
    direct = evaluate_global(sim.model, sim.data.x_test, sim.data.y_test, 64)
    passes = _passes(sim, monkeypatch)
    rec, _ = sim.evaluate()
    assert passes == ["test", "local"]  # one pass over the domains' test sets, scored per domain
    assert rec["global_acc"] == direct["global_acc"]
    assert rec["global_loss"] == pytest.approx(direct["global_loss"], rel=1e-6)  # float32 logits


def test_auto_eval_batch_keeps_the_largest_activation_under_budget_and_changes_no_score():
    torch.manual_seed(0)
    model = build_model("cnn", in_channels=1, image_size=28, num_classes=10)
    x = torch.randn(600, 1, 28, 28)
    y = torch.randint(0, 10, (600,))
    bs = auto_eval_batch(model, x)
    assert model.training  # the probe restores the mode
    per_sample = 32 * 5 * 5 * 8 * 8 * 4  # the CNN's second conv unfolds 32·5·5 values for each of 8·8 outputs
    assert bs == EVAL_ACTIVATION_BUDGET // per_sample
    owner = torch.zeros(600, dtype=torch.long)
    a = predict_scores(model, x, y, owner, 1, bs)
    b = predict_scores(model, x, y, owner, 1, 600)
    assert a.correct[0] == b.correct[0]
    assert a.loss_sum[0] == pytest.approx(b.loss_sum[0], rel=1e-9)
    small = build_model("mlp", in_channels=1, image_size=8, num_classes=10)
    assert auto_eval_batch(small, torch.randn(4, 1, 8, 8)) == 2048  # capped


def test_eval_batch_size_setting():
    assert make_config(None, {}).eval_batch_size == "auto"
    assert _sim(eval_batch_size=32).eval_batch == 32
    with pytest.raises(Exception, match="eval_batch_size"):
        make_config(None, {"eval_batch_size": 0})
