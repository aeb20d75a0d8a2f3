"""FedLC (ICML 2022) and FedRS (KDD 2021): logits calibrated by the client's label counts
(catalog/label_calibration.py)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import digits_simulation

from fedskew.catalog.label_calibration import FedLC, FedRS, calibrated_logits, restricted_logits
from fedskew.client.local import LocalContext, TrainSettings, local_train, snapshot
from fedskew.engine.batched import batchable
from fedskew.methods import resolve_method
from fedskew.models import build_model


def test_fedlcs_calibrated_loss_by_hand():
    """logits [2, 1, 0], label 0, counts [16, 1, 0], τ = 1: shifts 16^(-1/4) = 0.5, 1, (1e-8)^(-1/4) = 100, so the
    calibrated logits are [1.5, 0, -100] and the loss is log(1 + e^-1.5 + e^-101.5) = 0.2014133."""
    logits, counts = torch.tensor([[2.0, 1.0, 0.0]], dtype=torch.float64), torch.tensor([16.0, 1.0, 0.0])
    cal = calibrated_logits(logits, counts.double(), tau=1.0)
    assert torch.allclose(cal, torch.tensor([[1.5, 0.0, -100.0]], dtype=torch.float64), atol=1e-12)
    loss = F.cross_entropy(cal, torch.tensor([0]))
    assert float(loss) == pytest.approx(math.log(1 + math.exp(-1.5) + math.exp(-101.5)), abs=1e-12)
    assert float(loss) == pytest.approx(0.2014133, abs=1e-7)
    # FL-bench's form: -log(exp(cal_y) / sum exp(cal)) on the same numbers
    e = torch.exp(cal)
    assert float(loss) == pytest.approx(float(-torch.log(e[0, 0] / e.sum())), abs=1e-12)


def test_fedrss_restricted_softmax_by_hand():
    """logits [2, 1, 3], label 0, the client holds classes 0 and 2, α = 0.5: [2, 0.5, 3]."""
    logits, counts = torch.tensor([[2.0, 1.0, 3.0]], dtype=torch.float64), torch.tensor([5.0, 0.0, 2.0]).double()
    assert torch.equal(restricted_logits(logits, counts, 0.5), torch.tensor([[2.0, 0.5, 3.0]], dtype=torch.float64))
    loss = F.cross_entropy(restricted_logits(logits, counts, 0.5), torch.tensor([0]))
    assert float(loss) == pytest.approx(-math.log(math.exp(2) / (math.exp(2) + math.exp(0.5) + math.exp(3))))
    assert torch.equal(restricted_logits(logits, counts, 1.0), logits)  # α = 1: FedAvg's logits


def _train(algo, seed=0):
    torch.manual_seed(seed)
    model = build_model("mlp", in_channels=1, image_size=8, num_classes=10)
    ctx = LocalContext(0, 1, model, snapshot(model), {}, {}, TrainSettings(epochs=2, batch_size=8, lr=0.1))
    x = torch.randn(40, 1, 8, 8, generator=torch.Generator().manual_seed(1))
    y = torch.tensor([0, 1, 2] * 13 + [0])  # three of ten classes
    return local_train(algo, ctx, x, y, torch.Generator().manual_seed(2))


def test_the_neutral_settings_are_fedavg_and_the_others_protect_the_missing_classes():
    base = _train(resolve_method("fedavg", {}).client)
    for neutral in (FedLC(tau=0.0), FedRS(alpha=1.0)):
        up = _train(neutral)
        assert all(torch.equal(up.params[k], base.params[k]) for k in base.params), type(neutral).__name__
    # the missing classes' classifier rows move less than under FedAvg
    torch.manual_seed(0)
    init = snapshot(build_model("mlp", in_channels=1, image_size=8, num_classes=10))
    head = [k for k in base.params if k.startswith("head") and k.endswith("weight")][-1]
    missing = list(range(3, 10))
    moved = lambda up: float((up.params[head][missing] - init[head][missing]).norm())  # noqa: E731
    for algo in (FedLC(tau=1.0), FedRS(alpha=0.3)):
        assert moved(_train(algo)) < moved(base), type(algo).__name__


def test_they_run_compose_with_server_plug_ins_and_train_batched():
    mlp = build_model("mlp", in_channels=1, image_size=8, num_classes=10)
    for name, args in (("fedlc", {"tau": 0.5}), ("fedrs+disco", {"alpha": 0.3}), ("fedlc+fedadam", {})):
        method = resolve_method(name, args)
        assert batchable(method, mlp) is None
        recs = digits_simulation(name, args).run()
        assert all(math.isfinite(r["train_loss"]) for r in recs) and recs[-1]["global_acc"] > 0.1
    with pytest.raises(Exception, match="alpha"):
        resolve_method("fedrs", {"alpha": 1.5})
    # batched: the same run as the sequential loop (tests/test_batched_clients.py compares the uploads step by step)
    seq = digits_simulation("fedrs", {"alpha": 0.3}).run()
    sim = digits_simulation("fedrs", {"alpha": 0.3}, batched_clients=True)
    assert sim.batched
    bat = sim.run()
    assert [r["global_acc"] for r in bat] == pytest.approx([r["global_acc"] for r in seq], abs=0.02)


def test_the_batched_logit_maps_are_the_sequential_losses_maps():
    """The map each part declares for the batched path (logits·scale + shift) gives the logits its sequential loss
    computes, bit for bit, from the client's label counts."""
    from fedskew.client.batched_form import map_logits

    model = build_model("mlp", in_channels=1, image_size=8, num_classes=10)
    ctx = LocalContext(0, 1, model, snapshot(model), {}, {}, TrainSettings(1, 8, 0.1), y=torch.tensor([0, 1, 2, 2, 9]))
    logits = torch.randn(4, 10, generator=torch.Generator().manual_seed(0))
    counts = torch.bincount(ctx.y, minlength=10).float()
    for algo, sequential in (
        (FedLC(tau=0.7), calibrated_logits(logits, counts, 0.7)),
        (FedRS(alpha=0.3), restricted_logits(logits, counts, 0.3)),
    ):
        algo.begin(ctx)
        mapped = map_logits(logits, *algo.batched_step().logits(ctx, 10))
        assert torch.equal(mapped, sequential), type(algo).__name__
        assert not torch.equal(mapped, logits)
