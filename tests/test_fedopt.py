"""FedOpt (Reddi et al., ICLR 2021): FedAdagrad, FedAdam, FedYogi as server steps (fedskew/catalog/fedopt.py).

Worked numbers from Algorithm 2, the recurrences written out over several rounds, Flower's own FedAdam / FedYogi /
FedAdagrad on the same uploads, and the compositions the issue names."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedskew.catalog.fedopt import Adaptive, fedopt
from fedskew.methods import resolve_method
from fedskew.protocol import ServerContext, Upload
from fedskew.schema import ConfigError
from fedskew.server.api import Aggregation
from fedskew.server.combine import WeightedMean
from fedskew.server.uploads import stack_uploads
from fedskew.server.weights import SampleWeights


def _ctx(template):
    return ServerContext(2, 3, template, frozenset(k for k in template if k != "bn.running_mean"), np.ones(2))


def _round(template, global_params, uploads, rnd=1):
    ups = [Upload(i, p, n) for i, (p, n) in enumerate(uploads)]
    return stack_uploads(ups, rnd=rnd, global_params=global_params, trainable=_ctx(template).trainable)


def test_one_fedadam_step_is_the_papers_algorithm_2_by_hand():
    """x = [1, 2]; two clients of equal size move it by [0.2, -0.4] and [0, 0]: Δ = [0.1, -0.2]. With β1 = 0.9,
    β2 = 0.99, τ = 1e-3, v_{-1} = τ², η = 0.1: m = [0.01, -0.02], v = 0.99e-6 + 0.01·Δ² = [1.0099e-4, 4.0099e-4],
    x' = x + η·m/(√v + τ) = [1 + 0.0905028, 2 - 0.0951261]."""
    x = {"w": torch.tensor([1.0, 2.0], dtype=torch.float64)}
    rin = _round(x, x, [({"w": torch.tensor([1.2, 1.6], dtype=torch.float64)}, 5), (x, 5)])
    agg = Aggregation(weighting=SampleWeights(), combine=WeightedMean(), step=fedopt("adam"))
    ctx = ServerContext(2, 3, x, frozenset({"w"}), np.ones(2))
    out, state = agg.aggregate(rin, agg.init(ctx))
    assert torch.allclose(out.global_params["w"], torch.tensor([1.0905028, 1.9048739], dtype=torch.float64), atol=1e-7)
    v = state.step.by_name["adaptive"].v["w"]  # the paper's v_t: even in Δ, so the pseudo-gradient's is the same
    assert torch.allclose(v, torch.tensor([1.0099e-4, 4.0099e-4], dtype=torch.float64), rtol=1e-12)
    assert out.diagnostics["fedadam_rate"] == 0.1


@pytest.mark.parametrize("kind", ["adagrad", "adam", "yogi"])
@pytest.mark.parametrize("v_init, bias", [("tau_squared", "none"), ("zero", "adam"), ("zero", "flower")])
def test_three_rounds_follow_the_written_out_recurrences(kind, v_init, bias):
    b1, b2, tau, lr = 0.8, 0.95, 1e-2, 0.3
    link = Adaptive(kind, lr, b1, b2, tau, v_init=v_init, bias_correction=bias, entries="all")
    ctx = ServerContext(1, 2, {"w": torch.zeros(3, dtype=torch.float64)}, frozenset({"w"}), np.ones(1))
    state = link.init(ctx)
    m, v = np.zeros(3), np.full(3, tau**2 if v_init == "tau_squared" else 0.0)
    rng = np.random.default_rng(0)
    for t in range(1, 4):
        delta = rng.normal(size=3) * 0.1  # the combined update; the pseudo-gradient is -delta
        out, _, state = link({"w": torch.tensor(-delta)}, state)
        m = b1 * m + (1 - b1) * delta
        if kind == "adagrad":
            v = v + delta**2
        elif kind == "adam":
            v = b2 * v + (1 - b2) * delta**2
        else:
            v = v - (1 - b2) * delta**2 * np.sign(v - delta**2)
        e = {"none": None, "adam": t, "flower": t + 1}[bias]
        eta = lr if e is None else lr * math.sqrt(1 - b2**e) / (1 - b1**e)
        # the descent link returns how far the model moves against the gradient: x_{t+1} = x_t + eta m/(sqrt v + tau)
        assert np.allclose(-out["w"].numpy(), eta * m / (np.sqrt(v) + tau), rtol=1e-12, atol=0)


def test_buffers_take_the_combined_value_unless_every_entry_is_stepped():
    x = {"w": torch.tensor([1.0, 2.0]), "bn.running_mean": torch.tensor([0.5, 0.5])}
    up = {"w": torch.tensor([1.2, 1.6]), "bn.running_mean": torch.tensor([0.7, 0.1])}
    rin = _round(x, x, [(up, 1), (x, 1)])
    combined = {k: (up[k] + x[k]) / 2 for k in x}
    for entries, stepped in (("trainable", {"w"}), ("all", {"w", "bn.running_mean"})):
        agg = Aggregation(weighting=SampleWeights(), combine=WeightedMean(), step=fedopt("yogi", entries=entries))
        out, _ = agg.aggregate(rin, agg.init(_ctx(x)))
        for k in x:
            assert torch.equal(out.global_params[k], combined[k]) != (k in stepped), (entries, k)


def test_refusals_name_the_problem():
    with pytest.raises(ValueError, match="beta1"):
        fedopt("adam", beta1=1.0)
    with pytest.raises(ValueError, match="kind"):
        Adaptive("sgd")
    with pytest.raises(ConfigError, match="two plug-ins both set the server's step"):
        resolve_method("fedadam+fedavgm", {})
    with pytest.raises(ConfigError, match="tau"):
        resolve_method("fedyogi", {"tau": 0.0})


def test_compositions_run_and_a_server_lr_of_one_without_adaptivity_is_fedavg():
    """``fedprox+fedadam`` and ``fedavg+disco+fedyogi`` train; and FedAdagrad with β1 = 0, η = 1 and a huge τ moves
    the model by Δ·η/τ: scaled by τ it is FedAvg's step (a control that the step reads the right combined model)."""
    from conftest import digits_simulation

    for name in ("fedprox+fedadam", "fedavg+disco+fedyogi"):
        sim = digits_simulation(name, {"server_lr": 0.03})
        recs = sim.run()
        assert all(math.isfinite(r["train_loss"]) for r in recs)
        assert f"fed{name.rsplit('fed', 1)[1]}_step_norm" in recs[-1]["diagnostics"]
    base = digits_simulation("fedavg", rounds=1)
    tau = 1e6
    opt = digits_simulation("fedadagrad", {"beta1": 0.0, "server_lr": tau, "tau": tau}, rounds=1)
    base.run(), opt.run()
    for k, w0 in digits_simulation("fedavg", rounds=1).global_params.items():
        if w0.is_floating_point():
            # |Δ|² ≪ τ: η·Δ/(√(τ² + Δ²) + τ) = Δ/2 up to O(Δ²/τ²)
            want = w0.double() + (base.global_params[k].double() - w0.double()) / 2
            assert torch.allclose(opt.global_params[k].double(), want, atol=1e-6), k


def _same_values(a, b, atol=1e-6):
    assert list(a) == list(b)
    for k in a:
        assert torch.allclose(a[k].double(), b[k].double(), atol=atol, rtol=0), k


# ---- Flower's own FedAdam / FedYogi / FedAdagrad: the same numbers on the same uploads -------------------------------
@pytest.mark.parametrize(
    "kind, flower_name, extra",
    [
        ("adam", "FedAdam", {"bias_correction": "flower"}),
        ("yogi", "FedYogi", {}),
        ("adagrad", "FedAdagrad", {"beta1": 0.0}),  # Flower's FedAdagrad has no first moment
    ],
)
def test_flowers_fedopt_strategies_give_the_same_models(one_thread, kind, flower_name, extra):
    pytest.importorskip("flwr")
    import flwr.serverapp.strategy as flower
    from test_flower_strategies import ROUNDS, make_client_app, run_flower

    from fedskew.flower.strategies import FedskewStrategy

    eta, tau = 0.05, 1e-2
    args = {"server_lr": eta, "tau": tau, "beta2": 0.99, "v_init": "zero", "entries": "all", **extra}
    theirs_kwargs = {"eta": eta, "tau": tau}
    if kind != "adagrad":
        theirs_kwargs |= {"beta_1": 0.9, "beta_2": 0.99}
    results = []
    for strategy in (FedskewStrategy(f"fed{kind}", method_args=args), getattr(flower, flower_name)(**theirs_kwargs)):
        log: list[dict] = []
        result, _ = run_flower(strategy, make_client_app("none", log))
        results.append((result.arrays.to_torch_state_dict(), log))
    (ours, log_ours), (theirs, log_theirs) = results
    # the second round's clients received the same model from both, and the final models agree
    for r_ours, r_theirs in zip(
        sorted((r for r in log_ours if r["round"] == ROUNDS), key=lambda r: r["node"]),
        sorted((r for r in log_theirs if r["round"] == ROUNDS), key=lambda r: r["node"]),
        strict=True,
    ):
        _same_values(r_ours["received"], r_theirs["received"])
    _same_values(ours, theirs)
    assert all(t.dtype == torch.float32 for t in ours.values())  # Flower's numpy step returns float64 arrays
    start = next(r["received"] for r in log_ours if r["round"] == 1)
    assert any(not torch.allclose(ours[k], start[k]) for k in ours)  # it did move
