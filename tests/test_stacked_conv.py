"""The stacked convolution's two forms (engine/stacked.py, ``stacked_conv``): the engine's grouped convolution and
im2col with one batched matmul compute each client's own convolution, and a batched round with either matches the
sequential loop at the batched path's tolerance, plain and at captured shapes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import digits_simulation
from test_batched_clients import _side_by_side, _trained_alike
from torch import nn

from fedskew.engine.backends import batched_trainer
from fedskew.engine.stacked import CONV_FORMS
from fedskew.engine.stacked_step import stacked_step_function


@pytest.mark.parametrize(
    ("c", "o", "kernel", "stride", "padding", "dilation", "groups", "size"),
    [
        (1, 4, 5, 1, 0, 1, 1, (12, 12)),  # PFLlib's CNN's first convolution, smaller
        (4, 6, 3, 2, 1, 1, 2, (9, 7)),  # strided, padded, two groups of channels per client
        (6, 6, (3, 2), (1, 2), (1, 0), (2, 1), 3, (10, 11)),  # rectangular everything, dilated
        (3, 5, 1, 1, 0, 1, 1, (4, 4)),  # a 1×1 convolution
    ],
)
@pytest.mark.parametrize("bias", [True, False])
def test_every_form_is_each_clients_own_convolution(c, o, kernel, stride, padding, dilation, groups, size, bias):
    m = nn.Conv2d(c, o, kernel, stride, padding, dilation, groups, bias=bias)
    g = torch.Generator().manual_seed(c * 10 + o)
    k, b = 3, 2
    x = torch.randn(k, b, c, *size, generator=g, dtype=torch.float64)
    w = torch.randn(k, *m.weight.shape, generator=g, dtype=torch.float64)
    bs = torch.randn(k, o, generator=g, dtype=torch.float64) if bias else None
    own = torch.stack(
        [F.conv2d(x[i], w[i], None if bs is None else bs[i], m.stride, m.padding, m.dilation, groups) for i in range(k)]
    )
    for name, form in CONV_FORMS.items():
        got = form(m, x, w, bs)
        assert got.shape == own.shape, name
        torch.testing.assert_close(got, own, rtol=0, atol=1e-12, msg=name)


def test_an_unknown_form_is_refused_by_name():
    model = digits_simulation("fedavg", model="cnn").model
    with pytest.raises(ValueError, match="stacked convolution 'im2col': expected one of"):
        stacked_step_function(model, [n for n, _ in model.named_parameters()], 0.0, conv="im2col")


@pytest.mark.parametrize(
    ("form", "method", "args", "over", "capture"),
    [
        ("unfold", "fedavg", None, {}, False),
        ("unfold", "fedavg", None, {}, True),
        ("unfold", "fedprox", {"mu": 0.1}, {"momentum": 0.5}, False),
        ("unfold", "fedprox", {"mu": 0.1}, {"momentum": 0.5}, True),
        ("unfold", "moon", None, {}, False),  # round 2: the frozen models' forward passes through the same form
        ("per_client", "fedprox", {"mu": 0.1}, {}, False),
        ("per_client", "fedprox", {"mu": 0.1}, {}, True),
    ],
)
def test_other_forms_match_the_sequential_loop(one_thread, monkeypatch, form, method, args, over, capture):
    calls = []
    run = CONV_FORMS[form]
    monkeypatch.setitem(CONV_FORMS, form, lambda *a: calls.append(1) or run(*a))  # the form that ran
    seq, bat, rounds = _side_by_side(method, args, capture=capture, conv=form, model="cnn", **over)
    assert calls  # the batched steps convolved through this form
    _trained_alike(seq, bat, rounds, moved_at_least=1e-4)


def test_a_form_without_batched_steps_is_said_to_have_no_effect():
    with pytest.warns(UserWarning, match="stacked_conv unfold shapes the convolutions of batched steps.*no effect"):
        digits_simulation("fedavg", model="cnn", stacked_conv="unfold")


def test_the_run_setting_reaches_the_batched_trainer():
    for form in ("grouped", "unfold", "per_client"):
        sim = digits_simulation("fedavg", model="cnn", batched_clients=True, capture_steps=True, stacked_conv=form)
        trainer = batched_trainer(sim)
        assert trainer.conv == form
    # channels_last, which a model's convolutions keep, reaches the stacked grouped ones (unfold has its own layout)
    for form, expected in (("grouped", "grouped_channels_last"), ("unfold", "unfold")):
        sim = digits_simulation("fedavg", model="cnn", batched_clients=True, stacked_conv=form, channels_last=True)
        assert batched_trainer(sim).conv == expected


@pytest.mark.parametrize("capture", [False, True], ids=["bucketed", "captured"])
def test_channels_last_stacked_convolutions_match_the_sequential_loop(one_thread, monkeypatch, capture):
    """A channels-last run's batched steps convolve channels-last (the layout the sequential loop's model keeps) and
    train as that loop does."""
    layouts = []
    form = CONV_FORMS["grouped_channels_last"]

    def spy(m, x, w, b):
        out = form(m, x, w, b)
        if x.shape[0] * x.shape[2] > 1:  # (one input channel is both layouts at once: torch keeps the default)
            layouts.append(out.stride(2) == 1)  # [K, B, O, H, W] viewing [B, K·O, H, W]: channels innermost
        return out

    monkeypatch.setitem(CONV_FORMS, "grouped_channels_last", spy)
    seq, bat, rounds = _side_by_side(
        "fedavg", capture=capture, conv="grouped_channels_last", model="cnn", channels_last=True
    )
    assert layouts and all(layouts)  # the grouped convolutions ran on (and gave) channels-last tensors
    convs = [p for p in seq.model.parameters() if p.dim() == 4]
    assert convs and all(p.is_contiguous(memory_format=torch.channels_last) for p in convs)  # the loop's, as asked
    _trained_alike(seq, bat, rounds, moved_at_least=1e-4)


@pytest.mark.parametrize("capture", [False, True], ids=["bucketed", "captured"])
def test_stacked_seeds_convolve_in_their_runs_form(tmp_path, monkeypatch, capture):
    from fedskew.config import make_config
    from fedskew.engine.stacked_runs import run_stacked

    calls = []
    unfold = CONV_FORMS["unfold"]
    monkeypatch.setitem(CONV_FORMS, "unfold", lambda *a: calls.append(1) or unfold(*a))
    values = {"clients": 4, "rounds": 2, "model": "cnn", "skew_probes": 0, "db": None, "stacked_conv": "unfold"}
    values.update(capture_steps=capture, batched_clients=capture)  # (stacked seeds train batched either way)
    cfgs = [make_config(None, {**values, "seed": s, "out": str(tmp_path / f"s{s}")}) for s in (0, 1)]
    outcomes = run_stacked(cfgs)
    assert all(not isinstance(o, BaseException) for o in outcomes), outcomes
    assert calls  # the two runs' clients convolved through the unfolded form
    assert [o.summary["rounds"] for o in outcomes] == [2, 2]


@pytest.mark.parametrize("capture", [False, True], ids=["bucketed", "captured"])
def test_one_form_per_layer_convolves_each_layer_in_its_own_and_matches_the_sequential_loop(
    one_thread, monkeypatch, capture
):
    """``stacked_conv: per_client,grouped``: the CNN's first convolution (1 input channel) one client at a time, its
    second grouped (on this CPU the fastest form of each layer, benchmarks/conv_forms.py), and the training is the
    sequential loop's."""
    seen: dict[str, set[int]] = {"per_client": set(), "grouped": set()}
    for name in seen:
        form = CONV_FORMS[name]
        monkeypatch.setitem(
            CONV_FORMS, name, lambda m, *a, name=name, form=form: seen[name].add(m.in_channels) or form(m, *a)
        )
    seq, bat, rounds = _side_by_side("fedavg", capture=capture, conv="per_client,grouped", model="cnn")
    assert seen == {"per_client": {1}, "grouped": {32}}
    _trained_alike(seq, bat, rounds, moved_at_least=1e-4)


def test_a_list_of_forms_must_name_one_per_layer_before_training_starts():
    from fedskew.config import make_config
    from fedskew.schema import ConfigError

    sim = digits_simulation("fedavg", model="cnn", batched_clients=True, stacked_conv="per_client, grouped")
    assert batched_trainer(sim).conv == "per_client,grouped"
    with pytest.raises(ConfigError, match="names 3 forms, one per layer, but the model has 2 Conv2d layers"):
        digits_simulation("fedavg", model="cnn", batched_clients=True, stacked_conv="per_client,grouped,unfold")
    with pytest.raises(ConfigError, match="'im2col' is not a form"):
        make_config({"db": None}, {"stacked_conv": "per_client,im2col"})
    cl = digits_simulation("fedavg", model="cnn", batched_clients=True, stacked_conv="per_client,grouped")
    cl.cfg = cl.cfg.model_copy(update={"channels_last": True})
    assert batched_trainer(cl).conv == "per_client,grouped_channels_last"  # the grouped layer keeps the run's layout
