"""Issue 32: one base class per server piece kind, typed state, the server step as a chain, the server half of a
client part, and the wrappers and caches that must not hide anything."""

import gc
import pickle

import numpy as np
import pytest
import torch
from conftest import digits_simulation

from fedskew.catalog.fedavgm import fedavgm
from fedskew.catalog.moon import Moon
from fedskew.catalog.scaffold import SCAFFOLD_C, ControlState, ScaffoldServer
from fedskew.client.local import LocalAlgorithm, Wrapper
from fedskew.client.loss_before import LossBefore
from fedskew.methods import resolve_method
from fedskew.models import build_model
from fedskew.protocol import LABEL_HIST, ServerContext, Upload
from fedskew.registry import NoParams, ServerPlugin, register, unregister
from fedskew.schema import ConfigError
from fedskew.server.api import (
    NO_SERVER_HALF,
    Aggregation,
    AggregationState,
    ChainState,
    Descent,
    GradientTransform,
    Weighting,
    stateless,
)
from fedskew.server.combine import WeightedMean
from fedskew.server.optimizers import Ema, Scale
from fedskew.server.uploads import stack_uploads
from fedskew.server.weights import UniformWeights

F64 = torch.float64


def _rin(models, glob, counts=None):
    counts = counts or [1] * len(models)
    ups = [
        Upload(i, {"w": torch.tensor(m, dtype=F64), "n": torch.tensor(i)}, c)
        for i, (m, c) in enumerate(zip(models, counts, strict=True))
    ]
    return stack_uploads(
        ups, rnd=1, global_params={"w": torch.tensor(glob, dtype=F64), "n": torch.tensor(0)}, trainable=frozenset({"w"})
    )


def _ctx(template, n=3):
    return ServerContext(n, 2, template, frozenset({"w"}), np.ones(n), np.ones((n, 2)))


def test_stateless_makes_a_combine_that_threads_its_state():
    calls = []

    def mean(rin, weights, masks):
        calls.append(masks)
        return {n: t.to(F64).mean(0).to(t.dtype) for n, t in rin.params.items()}, {"seen": rin.num_participants}

    combine = stateless(mean)
    rin = _rin([[1.0, 2.0], [3.0, 4.0]], [0.0, 0.0])
    assert combine.init(None) is None and combine.default_weights is None
    out, diag, state = combine(rin, torch.full((2,), 0.5, dtype=F64), None, "kept")
    assert out["w"].tolist() == [2.0, 3.0] and diag == {"seen": 2} and state == "kept" and calls == [None]


def test_an_aggregation_keeps_each_piece_state_in_its_field():
    agg = Aggregation(weighting=UniformWeights(), combine=WeightedMean(), step=fedavgm(0.5))
    template = {"w": torch.zeros(2, dtype=F64), "n": torch.tensor(0)}
    state = agg.init(_ctx(template))
    assert isinstance(state, AggregationState) and state.weighting is None and state.masking is None
    assert isinstance(state.step, ChainState) and set(state.step.by_name) == {"momentum", "scale"}
    out, state = agg.aggregate(_rin([[1.0, 1.0], [3.0, 3.0]], [0.0, 0.0]), state)
    # ema, m = 0.5: g = 0 - 2 = -2, v = 0.5 * -2 = -1, w = 0 - (-1) = 1; integer buffers take the combine's max
    assert out.global_params["w"].tolist() == [1.0, 1.0] and out.global_params["n"].item() == 1
    assert state.step.by_name["momentum"].v["w"].tolist() == [-1.0, -1.0]
    assert out.diagnostics["fedavgm_momentum_norm"] == pytest.approx(2**0.5)


def test_a_descent_without_transforms_is_the_combined_model_and_names_must_differ():
    rin = _rin([[1.0, 5.0], [3.0, 7.0]], [2.0, 2.0])
    combined = {"w": torch.tensor([2.0, 6.0], dtype=F64), "n": torch.tensor(1)}
    step = Descent(())
    out, diag, state = step(rin, combined, torch.full((2,), 0.5, dtype=F64), step.init(_ctx(rin.global_params)))
    assert torch.equal(out["w"], combined["w"]) and out["n"].item() == 1 and diag == {} and state.by_name == {}
    with pytest.raises(ValueError, match="distinct names"):
        Descent((("x", Scale(1.0)), ("x", Scale(2.0))))

    # a user transform composes: clip the pseudo-gradient, then step
    class Clip(GradientTransform):
        def __call__(self, grads, state):
            return {n: g.clamp(-0.5, 0.5) for n, g in grads.items()}, {}, state

    clipped = Descent((("clip", Clip()), ("scale", Scale(1.0))))
    out, _, _ = clipped(rin, combined, None, clipped.init(_ctx(rin.global_params)))
    assert out["w"].tolist() == [2.0, 2.5]  # g = [0, -4] clipped to [0, -0.5]


def test_ema_and_scale_are_the_links_fedavgm_is_made_of():
    assert fedavgm(0.7, 0.3) == Descent((("momentum", Ema(0.7)), ("scale", Scale(0.3))), prefix="fedavgm")
    with pytest.raises(ValueError, match="server momentum"):
        fedavgm(1.0)
    with pytest.raises(ValueError, match="form"):
        fedavgm(0.5, form="nesterov")


def test_a_piece_that_does_not_derive_from_its_role_base_is_refused_by_name():
    class DuckWeights:  # the old duck-typed form: init and __call__, no base class
        def init(self, ctx):
            return None

        def __call__(self, rin, masks, state):
            return torch.full((rin.num_participants,), 1.0 / rin.num_participants, dtype=F64), state

    register(
        ServerPlugin("duck_w", "duck weights", "test", NoParams, ("weighting",), lambda p: {"weighting": DuckWeights()})
    )
    try:
        with pytest.raises(ConfigError, match=r"weighting is a DuckWeights, not a fedskew\.server\.api\.Weighting"):
            resolve_method("fedavg+duck_w", {})
    finally:
        unregister("duck_w")


def test_reports_are_declared_on_pieces_and_halves_and_wrappers_forward_them():
    class Histo(Weighting):
        reports = (LABEL_HIST,)

        def __call__(self, rin, masks, state):
            return torch.full((rin.num_participants,), 1.0 / rin.num_participants, dtype=F64), state

    register(ServerPlugin("histo_w", "h", "test", NoParams, ("weighting",), lambda p: {"weighting": Histo()}))
    try:
        assert resolve_method("fedavg+histo_w", {}).reports == (LABEL_HIST,)
    finally:
        unregister("histo_w")
    fedgen = resolve_method("fedgen", {})
    assert fedgen.server_half.reports == (LABEL_HIST,) and fedgen.reports == (LABEL_HIST,)

    class Reporting(LocalAlgorithm):
        reports = (LABEL_HIST,)

    wrapped = LossBefore(Reporting())  # what +afl, +qffl, +fedfv put around any client part
    assert isinstance(wrapped, Wrapper) and wrapped.reports == (LABEL_HIST,)


def test_a_client_part_without_a_server_side_has_the_empty_half():
    m = resolve_method("fedprox", {})
    assert m.server_half is NO_SERVER_HALF and m.server_half.broadcast(None) == {}
    assert m.server_half.advance(None, "same") == "same"
    sc = resolve_method("scaffold+disco", {})
    assert isinstance(sc.server_half, ScaffoldServer)


def test_scaffold_server_half_in_a_run_broadcasts_its_typed_state():
    sim = digits_simulation("scaffold", rounds=2)
    sim.run()
    state = sim.server_half_state
    assert isinstance(state, ControlState) and state.num_clients == sim.data.num_clients
    sent = sim.method.server_half.broadcast(state)
    assert set(sent) == {f"{SCAFFOLD_C}{n}" for n in sim.trainable}
    assert any(float(t.abs().sum()) > 0 for t in state.c.values())  # the control variate advanced


def test_moon_frozen_copies_are_a_weak_cache_never_pickled():
    moon = Moon(mu=1.0)
    model = build_model("mlp", in_channels=1, image_size=8, num_classes=3)
    glob, prev = moon._aux(model)
    assert moon._aux(model)[0] is glob and prev is not glob
    again = pickle.loads(pickle.dumps(moon))
    assert again == moon and len(again._frozen) == 0
    del model, glob, prev
    gc.collect()
    assert len(moon._frozen) == 0  # gone with the model: no copy outlives it, no id can be reused


def test_a_checkpoint_of_the_untyped_format_is_refused_with_what_to_do():
    from fedskew.engine.checkpoint import FORMAT, capture, restore

    sim = digits_simulation("scaffold+heal", rounds=2)
    sim.round(1)
    state = capture(sim)
    assert FORMAT == 2 and isinstance(state["server_state"], AggregationState)
    with pytest.raises(ValueError, match=r"format 1 \(another fedskew version\).*start it over"):
        restore(digits_simulation("scaffold+heal", rounds=2), {**state, "format": 1})
