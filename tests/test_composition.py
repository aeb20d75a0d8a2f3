"""A composed method equals the hand-composition of its parts."""

import numpy as np
import pytest
import torch
from conftest import digits_simulation

from fedskew.catalog.disco import DiscoWeights
from fedskew.methods import resolve_method
from fedskew.server.api import Aggregation
from fedskew.server.combine import WeightedMean


def _run(method, args=None, rounds=2, **kw):
    sim = digits_simulation(method, args, rounds, **kw)
    return sim.run(), sim


def _strip(recs):
    return [{k: v for k, v in r.items() if not k.startswith("time_")} for r in recs]


def test_fedprox_mu0_plus_disco_equals_fedavg_plus_disco():
    a, sa = _run("fedprox+disco", {"mu": 0.0})
    b, sb = _run("fedavg+disco")
    assert _strip(a) == _strip(b)
    assert all(torch.equal(sa.global_params[k], sb.global_params[k]) for k in sa.global_params)


def test_disco_weights_are_what_the_server_used():
    recs, sim = _run("disco", rounds=1)
    hists = sim.data.train_hists
    n = hists.sum(1) / hists.sum()
    p = hists / hists.sum(1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        kl = np.where(p > 0, p * np.log(p * 10), 0).sum(1)
    d = kl / kl.sum()
    raw = np.maximum(n - 0.5 * d + 0.1, 0)
    assert recs[0]["diagnostics"]["weights"] == pytest.approx(raw / raw.sum())


def test_hand_composed_server_equals_registry_composition():
    method = resolve_method("moon+disco", {"a": 0.3})
    assert method.server == Aggregation(DiscoWeights(a=0.3), WeightedMean())
    assert type(method.client).__name__ == "Moon"


def test_heal_with_beta0_and_no_masks_is_uniform_fedavg():
    a, _ = _run("heal", {"beta": 0.0, "tau": -1.0})
    b, _ = _run("fedavg", {"weights": "uniform"})
    for ra, rb in zip(a, b, strict=True):
        assert ra["global_acc"] == pytest.approx(rb["global_acc"], abs=1e-12)
        assert ra["diagnostics"]["weights"] == pytest.approx(rb["diagnostics"]["weights"])


@pytest.mark.parametrize("method", ["scaffold+heal", "moon+fedsa", "fedprox+heal", "scaffold+disco"])
def test_compositions_run_and_learn(method):
    recs, _ = _run(method, rounds=6, join_ratio=0.5)
    assert all(np.isfinite(r["train_loss"]) for r in recs)
    assert recs[-1]["global_acc"] > 0.2


def test_partial_participation_heal_runs():
    recs, sim = _run("heal", rounds=4, join_ratio=0.5)
    assert all(r["participants"] == 2 for r in recs)


@pytest.mark.parametrize(
    "name, args, msg",
    [
        ("fedsa+heal", {}, "masks"),
        ("disco+fedsa", {}, "low_weighting=samples"),
        ("fedsa", {"weights": "uniform"}, "low_weighting=samples"),
        ("disco+heal", {}, "weighting"),
        ("fedavg+nosuch", {}, "unknown part 'nosuch'"),
        ("fedprx", {}, "unknown part 'fedprx'; did you mean fedprox"),
        ("disco+fedprox", {}, r"'fedprox' is a client part.*did you mean 'fedprox\+disco'"),
        ("fedprox+moon", {}, r"'moon' is a client part, and a composition takes one client part, first \(CLIENT"),
        ("fedavg+disco+disco", {}, "repeated"),
    ],
)
def test_meaningless_compositions_are_refused(name, args, msg):
    from fedskew.config import ConfigError

    with pytest.raises(ConfigError, match=msg):
        resolve_method(name, args)


def test_disco_feeds_fedsa_low_region_when_asked():
    m = resolve_method("disco+fedsa", {"low_weighting": "samples"})
    assert isinstance(m.server.weighting, DiscoWeights)
