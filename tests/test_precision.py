"""The ``precision`` setting (client/precision.py): bf16 runs local training's forward passes under bfloat16 autocast,
in the sequential loop and the batched and captured steps alike, while parameters, gradients, uploads and client state
stay float32; float32 is the default and changes nothing."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from conftest import digits_simulation
from test_batched_clients import _side_by_side
from torch import nn

from fedskew.client.local import TrainSettings
from fedskew.client.precision import autocast, check_precision
from fedskew.config import make_config
from fedskew.engine.batched_steps import batchable
from fedskew.engine.stacked_step import stacked_step_function
from fedskew.schema import ConfigError


def test_a_precision_it_does_not_know_is_refused_by_name():
    with pytest.raises(ValueError, match="precision must be one of float32, bf16, not 'fp16'"):
        check_precision("fp16")
    with pytest.raises(ValueError, match="precision must be one of"):
        TrainSettings(1, 10, 0.1, precision="half")
    with pytest.raises(ConfigError, match="precision"):
        make_config({"db": None}, {"precision": "fp16"})


def test_float32_is_no_autocast_and_bf16_is_bfloat16_autocast():
    lin = nn.Linear(4, 3)
    x = torch.randn(2, 4)
    with autocast("cpu", "float32"):
        assert lin(x).dtype == torch.float32
    with autocast("cpu", "bf16"):
        assert lin(x).dtype == torch.bfloat16
        assert F.cross_entropy(lin(x), torch.tensor([0, 1])).dtype == torch.float32  # losses stay float32
    with pytest.raises(ValueError, match="no autocast for device type 'meta'"):
        autocast("meta", "bf16")


def test_bf16_on_a_gpu_without_bfloat16_is_refused_by_name(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    with pytest.raises(ValueError, match="this GPU has no bfloat16 arithmetic"):
        autocast("cuda", "bf16")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # (a machine with such a GPU)
    with pytest.raises(ConfigError, match="this GPU has no bfloat16 arithmetic"):  # said before the run starts
        make_config({"db": None}, {"precision": "bf16", "device": "cuda"})


def _linear_dtypes(sim) -> list[torch.dtype]:
    """The output dtypes of the model's linear layers during the next training (forward hooks)."""
    seen: list[torch.dtype] = []
    for m in sim.model.modules():
        if isinstance(m, nn.Linear):
            m.register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
    return seen


@pytest.mark.parametrize("precision", ["float32", "bf16"])
def test_the_sequential_loop_trains_its_forward_in_the_precision_and_keeps_float32(precision):
    sim = digits_simulation("fedavg", rounds=1, precision=precision)
    seen = _linear_dtypes(sim)
    plan = sim.open_round(1)
    cid = plan.sampled[0]
    up = sim._train(cid, 1, sim.params_for(cid), sim.sent_to(plan, cid))
    want = torch.bfloat16 if precision == "bf16" else torch.float32
    assert seen and set(seen) == {want}
    assert all(t.dtype == torch.float32 for t in up.params.values())
    assert all(p.dtype == torch.float32 for p in sim.model.parameters())


def _moved(rounds) -> tuple[float, float]:
    """The largest difference between the two runs' uploads, and the largest move of an upload from what it received."""
    diff = moved = 0.0
    for received, _, ups_seq, ups_bat in rounds:
        for u, v in zip(ups_seq, ups_bat, strict=True):
            for k, t in u.params.items():
                assert t.dtype == v.params[k].dtype
                if t.is_floating_point():
                    diff = max(diff, (t.double() - v.params[k].double()).abs().max().item())
                    moved = max(moved, (t.double() - received[u.cid][k].double()).abs().max().item())
    return diff, moved


@pytest.mark.parametrize(
    ("method", "args", "over", "capture"),
    [
        ("fedavg", None, {"model": "cnn"}, False),
        ("fedavg", None, {"model": "cnn"}, True),  # captured steps (run eagerly on the CPU)
        ("fedprox", {"mu": 0.1}, {"momentum": 0.5}, False),
        ("moon", None, {}, False),  # the frozen models' passes inside the loss
        ("fedavg", None, {"model": "lenet_bn", "momentum": 0.9}, False),  # the stacked graph's own BatchNorm
        ("fedsam", None, {"model": "cnn"}, False),  # SAM's second pass in the first's arithmetic
        ("gpfl", None, {}, True),  # a composite head's own stacked form (its LayerNorms) and a client's own term
        ("fedcp", None, {}, False),
    ],
)
def test_batched_bf16_matches_the_sequential_bf16_loop_at_bfloat16_rounding(method, args, over, capture):
    """One round of bf16 training, sequential and batched, agree to bfloat16's rounding (a few 1e-3 of a move of
    about 1e-1), and both differ from float32 training by far more than float32's rounding: autocast is on in both."""
    _, _, bf16 = _side_by_side(method, args, rounds=1, capture=capture, precision="bf16", **over)
    diff, moved = _moved(bf16)
    assert moved > 1e-2 and diff < 0.1 * moved, (diff, moved)
    _, _, f32 = _side_by_side(method, args, rounds=1, capture=capture, **over)
    apart = max(
        (u.params[k].double() - w.params[k].double()).abs().max().item()
        for (_, _, ups16, _), (_, _, ups32, _) in zip(bf16, f32, strict=True)
        for u, w in zip(ups16, ups32, strict=True)
        for k in u.params
        if u.params[k].is_floating_point()
    )
    assert apart > 1e-4, apart  # float32's own batched-vs-sequential differences are below 1e-5


def test_the_stacked_step_returns_float32_under_bf16():
    model = digits_simulation("fedavg", model="cnn").model
    names = [n for n, _ in model.named_parameters()]
    k, b = 3, 4
    params = {n: t.detach().unsqueeze(0).repeat(k, *[1] * t.dim()) for n, t in model.state_dict().items()}
    g = torch.Generator().manual_seed(0)
    x = torch.rand(k, b, 1, 8, 8, generator=g)  # pixels in [0, 1], as the digits'
    y = torch.randint(0, 10, (k, b), generator=g)
    grads, (loss, _, feats) = stacked_step_function(model, names, 0.0, precision="bf16")(params, {}, {}, x, y)
    grads32, (loss32, _, _) = stacked_step_function(model, names, 0.0)(params, {}, {}, x, y)
    assert loss.dtype == feats.dtype == torch.float32 and all(g.dtype == torch.float32 for g in grads.values())
    g16, g32 = (torch.cat([g[n].flatten() for n in names]) for g in (grads, grads32))
    rel = ((g16 - g32).norm() / g32.norm()).item()
    assert 1e-5 < rel < 0.1, rel  # bfloat16's rounding (measured 0.03 to 0.045 over 8 draws), not another gradient
    assert torch.allclose(loss, loss32, rtol=2e-2)


def test_a_vmap_step_through_a_layernorm_falls_back_under_bf16_by_name():
    """torch's backward of LayerNorm or BatchNorm under vmap fails on autocast's mixed dtypes: a step under vmap (a
    client term without a stacked form, a model without one) through FedCP's policy network (a LayerNorm) is refused
    with the reason, and the run then trains its clients one after the other; FedCP's own step runs on the stacked
    graph, whose norms are its own, and trains batched under bf16; under float32 nothing is refused."""
    from dataclasses import replace

    from fedskew.client.local import batched_form
    from fedskew.engine.batched_steps import _vmap_precision_refusal

    sim = digits_simulation("fedcp")
    assert batchable(sim.method, sim.model) is None
    assert batchable(sim.method, sim.model, "bf16") is None  # the stacked graph: its LayerNorm, its draws
    form = batched_form(sim.method.client)
    assert not isinstance(form, str)
    why = _vmap_precision_refusal(replace(form, client_term_stacked=False), sim.model, "bf16")
    assert why is not None and "vmap(grad(loss))" in why and "LayerNorm" in why
    bn = digits_simulation("fedavg", model="lenet_bn")
    assert batchable(bn.method, bn.model, "bf16") is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback
        run = digits_simulation("fedcp", rounds=1, precision="bf16", batched_clients=True)
        run.run()
    with pytest.warns(UserWarning, match="precision bf16: its step runs as vmap"):
        run = digits_simulation("fedavg", model="resnet8", rounds=1, precision="bf16", batched_clients=True)
        run.run()


def test_precision_is_part_of_a_runs_identity_only_when_set():
    """bf16 computes other numbers, so it is another experiment; float32, the default, leaves the identity of runs
    recorded before the setting existed as it was."""
    base = make_config({"db": None}, {})
    assert "precision" not in base.identity()
    assert make_config({"db": None}, {"precision": "float32"}).group_key() == base.group_key()
    assert make_config({"db": None}, {"precision": "bf16"}).group_key() != base.group_key()


def test_a_bf16_runs_summary_says_so(tmp_path, capsys):
    from fedskew.cli import main

    args = ["run", "--rounds", "1", "--clients", "4", "--no-db", "--precision", "bf16", "--out", str(tmp_path / "r")]
    assert main(args) == 0
    printed = " ".join(capsys.readouterr().out.split())
    assert "seed 0, bf16 training passes)" in printed
    assert main(["run", "--precision", "fp16", "--out", str(tmp_path / "s")]) == 2
    assert "precision" in capsys.readouterr().err


def test_a_killed_bf16_run_resumes_to_the_uninterrupted_runs_metrics_and_keeps_its_precision(tmp_path, capsys):
    """bf16's autocast is as deterministic as float32: a run killed after round 3 (checkpoint of round 2) and resumed
    writes the uninterrupted run's metrics; a resume asking for float32 is refused, since it computes other numbers."""
    import json

    from test_long_runs import _metrics, kill_after_round_3

    from fedskew.cli import main
    from fedskew.runner import run_experiment

    values = {"method": "fedprox", "clients": 6, "join_ratio": 0.5, "rounds": 5, "checkpoint_every": 2, "db": None}
    values.update(model="cnn", precision="bf16", seed=3, skew_probes=0)
    killed = kill_after_round_3(tmp_path, values)
    assert main(["run", "--resume", str(tmp_path / "killed"), "--precision", "float32", "--quiet"]) == 2
    assert "cannot change precision" in capsys.readouterr().err
    run_experiment(make_config(None, killed))
    assert _metrics(tmp_path / "killed") == _metrics(tmp_path / "whole")
    assert json.loads((tmp_path / "killed" / "status.json").read_text())["status"] == "finished"
