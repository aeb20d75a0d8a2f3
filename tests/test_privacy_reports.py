"""User-level DP for weights that read a client report (issue 43): FedDisco's d_k released once through a Gaussian
mechanism of its range, the weights as post-processing (Eq. 3 over the federation, capped), the release composed in
the accountant with the rounds, the neighbour bound with those weights, and runs that report the composed ε."""

import json
import math

import numpy as np
import pytest
import torch

pytest.importorskip("dp_accounting", reason="the privacy extra (dp-accounting) is not installed")

from fedskew.catalog.disco import (  # noqa: E402
    DISCREPANCY,
    DiscoWeights,
    discrepancy,
    discrepancy_bound,
    released_discrepancy,
)
from fedskew.config import make_config  # noqa: E402
from fedskew.methods import resolve_method  # noqa: E402
from fedskew.privacy.accountant import Sampling, calibrate, epsilon  # noqa: E402
from fedskew.privacy.server import PrivateMean, plan_privacy, refusal  # noqa: E402
from fedskew.protocol import RoundInput, ServerContext  # noqa: E402
from fedskew.runner import run_experiment  # noqa: E402
from fedskew.schema import ConfigError  # noqa: E402
from fedskew.seeding import Purpose, numpy_rng  # noqa: E402


# ---- the report's range ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("metric", ["kl", "l1", "l2", "cosine"])
@pytest.mark.parametrize("target", [None, (0.1, 0.2, 0.3, 0.4)])
def test_the_range_of_d_k_is_its_largest_value_over_every_label_distribution(metric, target):
    c = 4
    bound = discrepancy_bound(target, c, metric)
    t = np.full(c, 1 / c) if target is None else np.asarray(target)
    closed = {  # the one-class client's discrepancy, written out
        "kl": -math.log(t.min()),
        "l1": 2 * (1 - t.min()),
        "l2": max(math.sqrt((1 - t[j]) ** 2 + (t**2).sum() - t[j] ** 2) for j in range(c)),
        "cosine": 1 - t.min() / np.linalg.norm(t),
    }[metric]
    assert bound == pytest.approx(closed, rel=1e-12)
    rng = np.random.default_rng(0)
    hists = np.concatenate([rng.dirichlet(np.full(c, a), size=3000) for a in (0.05, 1.0, 20.0)])
    d = discrepancy(hists, target, metric)
    assert d.min() >= 0 and d.max() <= bound + 1e-12  # no label distribution exceeds it
    assert discrepancy(np.eye(c), target, metric).max() == pytest.approx(bound)  # and a one-class client attains it
    with pytest.raises(ValueError, match="unbounded"):
        discrepancy_bound(None, c, "only_iid")


# ---- the release -----------------------------------------------------------------------------------------------------
def test_the_released_d_k_is_clipped_gaussian_noise_of_std_z_times_the_range_from_each_clients_stream():
    n, bound, z = 20_000, 2.0, 0.05
    d = np.full(n, 1.0)  # mid-range: clipping at 10 std moves nothing
    out = released_discrepancy(d, bound, z, seed=4)
    noise = out - d
    assert noise.std() == pytest.approx(z * bound, rel=0.02) and abs(noise.mean()) < 4 * z * bound / math.sqrt(n)
    assert abs(float(((noise - noise.mean()) ** 4).mean() / noise.var() ** 2) - 3) < 0.15
    # client k's draw is its own stream's first normal: the same in a federation of 10 and of 20,000
    assert np.array_equal(released_discrepancy(d[:10], bound, z, seed=4), out[:10])
    g7 = numpy_rng(4, Purpose.DP_REPORT, 7).standard_normal()
    assert out[7] == pytest.approx(1.0 + z * bound * g7, abs=1e-15)
    wide = released_discrepancy(np.array([0.0, bound, 1.0]), bound, 50.0, seed=1)
    assert wide.min() >= 0 and wide.max() <= bound  # clipped to the range: post-processing


def _ctx(hists, seed=0, report="discrepancy"):
    hists = np.asarray(hists, dtype=np.int64)
    weights = DiscoWeights(report=report)
    reports = {r.name: np.stack([r.compute(h) for h in hists]) for r in weights.reports}
    return weights, ServerContext(
        num_clients=len(hists),
        num_classes=hists.shape[1],
        template={"w": torch.zeros(3)},
        trainable=frozenset({"w"}),
        num_train=hists.sum(axis=1),
        label_hists=reports.get("label_hist"),
        seed=seed,
        reports=reports,
    )


@pytest.mark.parametrize("report", ["discrepancy", "histogram"])
def test_private_disco_weights_are_eq3_over_the_federation_worked_example(report):
    """Three clients of 10 samples over two classes: (5, 5), (9, 1), (10, 0); uniform target, kl, a = 0.5, b = 0.1,
    noise negligible. d = 0, 0.9 ln 1.8 + 0.1 ln 0.2, ln 2; normalized over the three; n = 1/3 each."""
    weights, ctx = _ctx([[5, 5], [9, 1], [10, 0]], report=report)
    d = np.array([0.0, 0.9 * math.log(1.8) + 0.1 * math.log(0.2), math.log(2)])
    d = d / d.sum()  # 0, 0.346834, 0.653166
    raw = 1 / 3 - 0.5 * d + 0.1  # 0.433333, 0.259916, 0.106750 (sum 0.8)
    expected = raw / raw.sum()  # 0.541667, 0.324895, 0.133438
    private = weights.private(ctx, 1e-12)
    assert private.kind == "disco" and private.report_noise == 1e-12
    np.testing.assert_allclose(private.values, expected, rtol=1e-9)
    np.testing.assert_allclose(expected, [0.5416667, 0.3248954, 0.1334380], atol=1e-6)
    assert private.record["report_range"] == pytest.approx(math.log(2))
    # the plan: the cap is the mean weight (1/3), w = min(p / cap, 1), D = Σ w over everyone (full participation)
    plan = _plan(weights, ctx, z=1e-12)
    w = np.minimum(expected * 3, 1.0)  # 1, 0.974686, 0.400314
    assert plan.cap == pytest.approx(1 / 3) and plan.denominator == pytest.approx(w.sum())
    torch.testing.assert_close(plan.round_weights((0, 1, 2), torch.ones(3)), torch.from_numpy(w))
    torch.testing.assert_close(plan.round_weights((2,), torch.ones(1)), torch.from_numpy(w[2:]))


def test_private_disco_weights_read_the_noised_d_k():
    weights, ctx = _ctx([[5, 5], [9, 1], [10, 0], [3, 7]], seed=3)
    z, bound = 0.3, math.log(2)
    d = np.ravel(ctx.reports[DISCREPANCY])
    g = np.array([numpy_rng(3, Purpose.DP_REPORT, k).standard_normal() for k in range(4)])
    released = np.clip(d + z * bound * g, 0, bound)
    n = ctx.num_train / ctx.num_train.sum()
    raw = np.maximum(n - 0.5 * released / released.sum() + 0.1, 0)
    np.testing.assert_allclose(weights.private(ctx, z).values, raw / raw.sum(), rtol=1e-12)
    assert not np.allclose(weights.private(ctx, z).values, weights.private(ctx, 1e-12).values)


def _plan(weights, ctx, z=1.0, report_noise=1e-12, **over):
    method = resolve_method("fedavg+disco", {"report": weights.report})
    assert method.server.weighting == weights
    args = dict(clip=1.0, noise_multiplier=z, target_epsilon=None, delta=1e-5, accountant="rdp")
    args |= dict(sampling=Sampling("full", ctx.num_clients), rounds=5, weight_cap=None, report_noise=report_noise)
    return plan_privacy(method, ctx, **(args | over))


# ---- the accountant --------------------------------------------------------------------------------------------------
def test_the_reports_release_composes_with_the_rounds_as_gaussians_do():
    """Gaussian mechanisms compose exactly: multipliers z_d once and z T times are one of (z_d⁻² + T z⁻²)^(−½), in
    RDP (the curves add) and in the exact privacy-loss distribution (µ-GDP, Dong, Roth, Su 2019; analytic ε)."""
    from scipy.optimize import brentq
    from scipy.stats import norm

    zd, z, t, delta = 1.5, 2.0, 12, 1e-5
    full = Sampling("full", 50)
    one = (zd**-2 + t * z**-2) ** -0.5
    assert epsilon(z, full, t, delta, once=(zd,)) == pytest.approx(epsilon(one, full, 1, delta), rel=1e-9)
    mu = 1 / one

    def gap(eps):  # δ(ε) of µ-GDP minus the target δ
        return norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * norm.cdf(-eps / mu - mu / 2) - delta

    analytic = brentq(gap, 1e-6, 50)
    assert epsilon(z, full, t, delta, "pld", once=(zd,)) == pytest.approx(analytic, rel=1e-2)
    # with sampling the release is not amplified: it costs what it costs alone, and more noise costs less
    poisson = Sampling("poisson", 1000, q=0.01)
    assert epsilon(z, poisson, t, delta, once=(zd,)) > epsilon(z, poisson, t, delta)
    assert epsilon(z, poisson, t, delta, once=(zd,)) > epsilon(z, poisson, t, delta, once=(2 * zd,))
    assert epsilon(z, poisson, 0, delta, once=(zd,)) == 0.0  # nothing read from the reports is released yet
    # calibration keeps the pair within the target; a release that alone exceeds it is refused with its cost
    z8 = calibrate(8.0, delta, poisson, 50, once=(zd,))
    assert epsilon(z8, poisson, 50, delta, once=(zd,)) <= 8.0 and z8 > calibrate(8.0, delta, poisson, 50)
    with pytest.raises(ValueError, match="alone spend about epsilon"):
        calibrate(0.5, delta, poisson, 50, once=(0.5,))


# ---- the neighbour bound with FedDisco's weights ---------------------------------------------------------------------
def test_replacing_one_client_moves_the_aggregate_by_at_most_the_sensitivity_with_disco_weights():
    weights, ctx = _ctx([[5, 5], [9, 1], [10, 0], [3, 7], [8, 2]], seed=1)
    plan = _plan(weights, ctx, z=1e-12, report_noise=0.2)
    server = PrivateMean(plan, ("w",), seed=0)
    g = torch.Generator().manual_seed(2)
    deltas = torch.randn(5, 3, generator=g, dtype=torch.float64)
    deltas = deltas / deltas.norm(dim=1, keepdim=True) * plan.clip  # clipped uploads

    def rin(d):
        zero = torch.zeros(3, dtype=torch.float64)
        ones = torch.ones(5, dtype=torch.float64)
        return RoundInput(1, tuple(range(5)), {"w": d}, ones, {}, {"w": zero}, ctx.trainable)

    base, _ = server.aggregate(rin(deltas), server.init(ctx))
    w = plan.round_weights(tuple(range(5)), torch.ones(5))
    assert float(w.max()) <= 1.0 and float(w.max()) == 1.0  # capped at the mean: the heaviest clients weigh 1
    for k in range(5):
        worst = deltas.clone()
        worst[k] = -deltas[k]  # client k replaced by its opposite (distance 2C)
        moved, _ = server.aggregate(rin(worst), server.init(ctx))
        shift = float((moved.global_params["w"] - base.global_params["w"]).norm())
        assert shift <= 2 * plan.clip * float(w.max()) / plan.denominator + 1e-9
        assert shift == pytest.approx(2 * plan.clip * float(w[k]) / plan.denominator, rel=1e-6)


# ---- what is refused -------------------------------------------------------------------------------------------------
def test_disco_under_dp_needs_its_report_noise_and_only_iid_is_refused():
    weights, ctx = _ctx([[5, 5], [9, 1]])
    assert refusal(resolve_method("fedavg+disco", {})) is None
    assert "only_iid d_k is unbounded" in refusal(resolve_method("fedavg+disco", {"metric": "only_iid"}))
    with pytest.raises(ConfigError, match="dp_report_noise"):
        _plan(weights, ctx, report_noise=None)
    plain = resolve_method("fedavg", {})
    args = dict(clip=1.0, noise_multiplier=1.0, target_epsilon=None, delta=1e-5, accountant="rdp")
    args |= dict(sampling=Sampling("full", 2), rounds=5, weight_cap=None, report_noise=0.5)
    with pytest.raises(ConfigError, match="read none: leave it out"):
        plan_privacy(plain, ctx, **args)
    with pytest.raises(ConfigError, match="need dp_clip"):
        make_config(None, {"method": "fedavg+disco", "dp_report_noise": 1.0})


# ---- runs ------------------------------------------------------------------------------------------------------------
def _values(tmp_path, **over):
    base = {"clients": 8, "rounds": 3, "seed": 2, "db": None, "skew_probes": 0, "method": "fedavg+disco"}
    return {**base, "dp_clip": 0.5, "out": str(tmp_path / "run"), **over}


def _lines(path):
    return [json.loads(s) for s in (path / "metrics.jsonl").read_text().splitlines()]


def test_a_private_disco_run_reports_the_epsilon_of_its_release_and_its_rounds(tmp_path):
    values = _values(tmp_path, dp_noise=1.5, dp_report_noise=2.0, client_sampling="poisson", join_ratio=0.5)
    run_experiment(make_config(None, values))
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())["privacy"]
    assert summary["weights"] == "disco" and summary["report_noise_multiplier"] == 2.0
    assert summary["report_range"] == pytest.approx(math.log(10))  # the digits' ten classes, uniform target
    assert summary["report_noise_std"] == pytest.approx(2.0 * math.log(10))
    sampling = Sampling("poisson", 8, q=0.5)
    for r in _lines(tmp_path / "run"):
        assert r["dp_epsilon"] == pytest.approx(epsilon(1.5, sampling, r["round"], 1e-5, once=(2.0,)))
        assert r["dp_epsilon"] > epsilon(1.5, sampling, r["round"], 1e-5)
    # a target ε calibrates the rounds' multiplier with the release counted in
    run_experiment(make_config(None, {**values, "dp_noise": None, "dp_epsilon": 9.0, "out": str(tmp_path / "cal")}))
    cal = json.loads((tmp_path / "cal" / "summary.json").read_text())["privacy"]
    assert cal["calibrated"] and cal["epsilon"] <= 9.0
    assert cal["epsilon"] == pytest.approx(epsilon(cal["noise_multiplier"], sampling, 3, 1e-5, once=(2.0,)))


def test_without_noise_or_clipping_private_disco_is_feddisco(tmp_path):
    """Full participation, z and z_d → 0, a clip no update reaches and a cap of 1 (w_k = p_k, D = Σ p_k = 1): the
    release is Σ p_k Δ_k with Eq. 3's weights over the federation, FedDisco's own run (the official code's per-round
    renormalization equals the paper's once-computed weights when everyone takes part)."""
    base = {k: v for k, v in _values(tmp_path).items() if not k.startswith("dp_")}
    private = {**base, "dp_clip": 1e6, "dp_noise": 1e-12, "dp_report_noise": 1e-12, "dp_weight_cap": 1.0}
    run_experiment(make_config(None, private))
    run_experiment(make_config(None, {**base, "out": str(tmp_path / "plain")}))
    dp, plain = _lines(tmp_path / "run"), _lines(tmp_path / "plain")
    for a, b in zip(dp, plain, strict=True):
        np.testing.assert_allclose(a["diagnostics"]["weights"], b["diagnostics"]["weights"], rtol=1e-9)
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-4)
        assert a["global_acc"] == pytest.approx(b["global_acc"], abs=2e-3)
