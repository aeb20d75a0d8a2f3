"""User-level DP (issue 43): golden ε against dp-accounting's own numbers, the noise's moments and that it is added
once, the clip, the neighbour bound, the Poisson rate, which compositions may be private, and a run that reports ε
each round, stops at its budget and resumes to the same ε."""

import json
import math

import pytest
import torch

pytest.importorskip("dp_accounting", reason="the privacy extra (dp-accounting) is not installed")

from fedskew.config import make_config  # noqa: E402
from fedskew.engine.rounds import sample_clients  # noqa: E402
from fedskew.methods import resolve_method  # noqa: E402
from fedskew.privacy.accountant import Sampling, calibrate, epsilon  # noqa: E402
from fedskew.privacy.mechanism import capped_weights, clip_update, delta_norm  # noqa: E402
from fedskew.privacy.server import PrivacyPlan, PrivateMean, refusal  # noqa: E402
from fedskew.protocol import RoundInput  # noqa: E402
from fedskew.runner import run_experiment  # noqa: E402
from fedskew.schema import ConfigError  # noqa: E402


# ---- the accountant: the golden numbers ---------------------------------------------------------------------
def test_golden_epsilons():
    assert epsilon(1.2, Sampling("poisson", 10_000, q=0.01), 100, 1e-6) == pytest.approx(0.975892494240961, rel=1e-3)
    assert epsilon(1.2, Sampling("full", 10), 1, 1e-6) == pytest.approx(4.253499721177566, rel=1e-3)
    fixed = Sampling("fixed", 1000, m=100)
    assert epsilon(1.5, fixed, 10, 1e-6) == pytest.approx(2.7582097098379643, rel=1e-3)
    z = calibrate(8.0, 1e-3, Sampling("poisson", 1000, q=0.1), 200)
    assert z == pytest.approx(1.016, rel=1e-3)
    assert epsilon(z, Sampling("poisson", 1000, q=0.1), 200, 1e-3) <= 8.0
    # PLD is tighter than RDP; it has no fixed-size event
    poisson = Sampling("poisson", 10_000, q=0.01)
    assert epsilon(1.2, poisson, 100, 1e-6, "pld") < epsilon(1.2, poisson, 100, 1e-6)
    with pytest.raises(ValueError, match="PLD accountant has no event"):
        epsilon(1.5, fixed, 10, 1e-6, "pld")
    assert epsilon(1.2, poisson, 0, 1e-6) == 0.0


# ---- the mechanism ---------------------------------------------------------------------------------------------------
def test_clip_scales_the_update_keeps_its_direction_and_leaves_a_small_or_zero_one():
    g = torch.Generator().manual_seed(0)
    received = {"a": torch.randn(3, 4, generator=g), "b": torch.randn(5, generator=g), "n": torch.tensor(3)}
    trained = {k: v + (torch.randn(v.shape, generator=g) if v.is_floating_point() else 1) for k, v in received.items()}
    names = ("a", "b")
    norm = delta_norm(received, trained, names)
    out, before, _ = clip_update(received, trained, names, 0.5)
    assert before == pytest.approx(norm) and norm > 0.5
    assert delta_norm(received, out, names) == pytest.approx(0.5, rel=1e-6)
    for n in names:  # the same direction: a positive multiple of the update, applied to the delta, not the weights
        torch.testing.assert_close(out[n] - received[n], (trained[n] - received[n]) * (0.5 / norm))
    assert torch.equal(out["n"], trained["n"])  # an entry outside the clipped vector is left as it is
    same, _, _ = clip_update(received, trained, names, 10 * norm)
    assert same is trained
    zero, z, _ = clip_update(received, dict(received), names, 1.0)
    assert z == 0.0 and all(torch.equal(zero[n], received[n]) for n in names)
    # the extras a client uploads (SCAFFOLD's control delta) are part of the one clipped vector
    extras = {"dc": torch.randn(7, generator=g)}
    joint, full, clipped = clip_update(received, trained, names, 0.5, extras)
    assert full == pytest.approx(math.sqrt(norm**2 + float((extras["dc"] ** 2).sum())))
    moved = delta_norm(received, joint, names) ** 2 + float((clipped["dc"] ** 2).sum())
    assert math.sqrt(moved) == pytest.approx(0.5, rel=1e-6)
    torch.testing.assert_close(clipped["dc"], extras["dc"] * (0.5 / full))


def _plan(z=1.0, clip=1.0, weights="uniform", cap=1.0, denominator=4.0):
    return PrivacyPlan(clip, z, Sampling("full", 4), 1e-5, "rdp", weights, cap, denominator, None, False)


def _rin(deltas, num_samples=None, rnd=1):
    k = deltas.shape[0]
    g = torch.zeros(deltas.shape[1:])
    return RoundInput(
        round=rnd,
        cids=tuple(range(k)),
        params={"w": g + deltas},
        num_samples=torch.tensor(num_samples or [10.0] * k, dtype=torch.float64),
        extras={},
        global_params={"w": g},
        trainable=frozenset({"w"}),
    )


def test_noise_has_the_declared_std_no_excess_kurtosis_and_is_added_once_per_round():
    d = 100_000
    server = PrivateMean(_plan(z=1.3, clip=0.7, denominator=2.0), ("w",), seed=3)
    sigma = 1.3 * 0.7 / 2.0  # z·C·max w / D
    for k in (1, 4):  # the same noise whatever the cohort: added once, to the sum
        out, _ = server.aggregate(_rin(torch.zeros(k, d)), server.init(None))
        x = out.global_params["w"].double()
        assert float(x.std()) == pytest.approx(sigma, rel=0.02)
        kurt = float(((x - x.mean()) ** 4).mean() / x.var() ** 2) - 3
        assert abs(kurt) < 0.05
    other, _ = server.aggregate(_rin(torch.zeros(1, d), rnd=2), server.init(None))
    assert not torch.equal(other.global_params["w"], out.global_params["w"])  # a fresh draw each round
    again, _ = server.aggregate(_rin(torch.zeros(4, d)), server.init(None))
    assert torch.equal(again.global_params["w"], out.global_params["w"])  # seeded by (seed, round)
    alone, _ = server.no_uploads(1, {"w": torch.zeros(d)}, server.init(None))  # an empty cohort: the noise alone
    assert float(alone["w"].double().std()) == pytest.approx(sigma, rel=0.02)


@pytest.mark.parametrize("weights", ["uniform", "samples"])
def test_replacing_one_client_moves_the_aggregate_by_at_most_the_sensitivity(weights):
    g = torch.Generator().manual_seed(1)
    clip, denom, cap = 1.0, 3.0, 20.0
    server = PrivateMean(_plan(z=1e-12, clip=clip, weights=weights, cap=cap, denominator=denom), ("w",), seed=0)
    sizes = [5.0, 40.0, 20.0]
    deltas = torch.randn(3, 50, generator=g)
    deltas = deltas / deltas.norm(dim=1, keepdim=True) * clip  # clipped uploads
    base, _ = server.aggregate(_rin(deltas, sizes), server.init(None))
    worst = deltas.clone()
    worst[1] = -deltas[1]  # the largest-weight client, replaced by its opposite (distance 2C)
    moved, _ = server.aggregate(_rin(worst, sizes), server.init(None))
    w = capped_weights(torch.tensor(sizes), weights, cap)
    assert float(w.max()) <= 1.0
    shift = float((moved.global_params["w"] - base.global_params["w"]).norm())
    # add/remove moves the sum by ≤ C·max w; a replacement by ≤ 2·C·max w
    assert shift <= 2 * clip * float(w.max()) / denom + 1e-9
    assert shift == pytest.approx(2 * clip * float(w[1]) / denom, rel=1e-6)


def test_poisson_sampling_rate_within_its_binomial_interval():
    n, q, rounds = 200, 0.1, 300
    counts = [len(sample_clients(7, r, n, q, "poisson")) for r in range(1, rounds + 1)]
    rate = sum(counts) / (n * rounds)
    half = 3 * math.sqrt(q * (1 - q) / (n * rounds))
    assert abs(rate - q) < half
    assert len(set(counts)) > 5  # the cohort size varies
    assert sample_clients(7, 1, n, q, "poisson") == sample_clients(7, 1, n, q, "poisson")


# ---- which compositions may be private -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "method", ["fedavg", "fedprox", "fedavg+fedavgm", "fedavg+fedadam", "fedper", "moon", "ditto", "fedcp", "scaffold"]
)
def test_weighted_sum_compositions_may_be_private(method):
    assert refusal(resolve_method(method, {})) is None


@pytest.mark.parametrize(
    ("method", "why"),
    [
        ("fedavg+afl", "(AflWeights) come from the clients' statistics"),
        ("fedsa", "combines the individual updates"),
        ("fedavg+heal", "masks"),
        ("fedcac", "one model per client"),
        ("feddbe", "server half (DbeServer) reads the individual uploads' extras"),
        ("fedfomo", "one model per client"),
        ("fedavg+fedexp", "server step (FedExPStep) reads the individual uploads"),
        ("fedavg+ccvr", "feature statistics"),
    ],
)
def test_compositions_that_need_individual_updates_are_refused_with_the_reason(method, why):
    assert why in refusal(resolve_method(method, {}))


def test_dp_settings_are_checked():
    with pytest.raises(ConfigError, match="need dp_clip"):
        make_config(None, {"dp_noise": 1.0})
    with pytest.raises(ConfigError, match="dp_noise .* or dp_epsilon"):
        make_config(None, {"dp_clip": 1.0})
    with pytest.raises(ConfigError, match="batched_clients"):
        make_config(None, {"dp_clip": 1.0, "dp_noise": 1.0, "batched_clients": True})


# ---- runs ------------------------------------------------------------------------------------------------------------
def _values(tmp_path, **over):
    base = {"clients": 8, "rounds": 4, "join_ratio": 0.5, "client_sampling": "poisson", "seed": 2, "db": None}
    return {**base, "skew_probes": 0, "dp_clip": 0.5, "out": str(tmp_path / "run"), **over}


def _lines(path):
    return [json.loads(s) for s in (path / "metrics.jsonl").read_text().splitlines()]


def test_a_private_run_reports_epsilon_each_round_equal_to_an_offline_recomputation(tmp_path):
    run_experiment(make_config(None, _values(tmp_path, dp_epsilon=6.0)))
    records = _lines(tmp_path / "run")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())["privacy"]
    assert summary["calibrated"] and summary["sampling"] == "poisson" and summary["q"] == 0.5
    sampling = Sampling("poisson", 8, q=0.5)
    for r in records:
        assert r["dp_epsilon"] == pytest.approx(epsilon(summary["noise_multiplier"], sampling, r["round"], 1e-5))
    assert records[-1]["dp_epsilon"] <= 6.0 and summary["epsilon"] == pytest.approx(records[-1]["dp_epsilon"])
    assert not summary["stopped_at_budget"] and len(records) == 4


def test_a_run_stops_cleanly_at_its_budget(tmp_path):
    z = 2.0
    sampling = Sampling("poisson", 8, q=0.5)
    budget = (epsilon(z, sampling, 2, 1e-5) + epsilon(z, sampling, 3, 1e-5)) / 2  # between rounds 2 and 3
    run_experiment(make_config(None, _values(tmp_path, dp_noise=z, dp_epsilon=budget, rounds=6)))
    records = _lines(tmp_path / "run")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert len(records) == 2 and summary["privacy"]["stopped_at_budget"]
    assert summary["privacy"]["epsilon"] <= budget < epsilon(z, sampling, 3, 1e-5)


def test_private_runs_are_reproducible_and_refused_compositions_say_why(tmp_path):
    a, b = (run_experiment(make_config(None, _values(tmp_path / s, dp_noise=1.0))) for s in "ab")
    strip = lambda rs: [{k: v for k, v in r.items() if not k.startswith("time")} for r in rs]  # noqa: E731
    assert strip(_lines(tmp_path / "a" / "run")) == strip(_lines(tmp_path / "b" / "run"))
    assert a is not None and b is not None
    with pytest.raises(ConfigError, match="cannot run under differential privacy: .*statistics"):
        run_experiment(make_config(None, _values(tmp_path / "c", dp_noise=1.0, method="fedavg+afl")))


def test_without_noise_or_clipping_a_private_run_is_uniform_fedavg(tmp_path):
    """Full participation, z → 0, a clip no update reaches and a cap below every client size (so w_k = 1): the
    release is Σ Δ_k / N, FedAvg's uniform mean, whose run it reproduces."""
    base = {**_values(tmp_path), "client_sampling": "fixed", "join_ratio": 1.0, "rounds": 3}
    private = {**base, "dp_noise": 1e-12, "dp_clip": 1e6, "dp_weight_cap": 1e-9}
    run_experiment(make_config(None, private))
    dp = _lines(tmp_path / "run")
    plain = {k: v for k, v in base.items() if not k.startswith("dp_")}
    plain |= {"out": str(tmp_path / "plain"), "method_args": {"weights": "uniform"}}
    run_experiment(make_config(None, plain))
    ref = _lines(tmp_path / "plain")
    for a, b in zip(dp, ref, strict=True):
        assert a["global_acc"] == pytest.approx(b["global_acc"], abs=2e-3)
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-4)


# ---- adaptive clipping -----------------------------------------------------------------------------------------------
def test_adaptive_clipping_splits_the_noise_multiplier_between_the_sum_and_the_count():
    from fedskew.privacy.mechanism import model_noise_multiplier, next_clip

    assert model_noise_multiplier(1.0, 5.0) == pytest.approx((1 - 1 / 100) ** -0.5)
    with pytest.raises(ValueError, match="must exceed half the noise multiplier"):
        model_noise_multiplier(2.0, 1.0)
    gen = torch.Generator().manual_seed(0)
    # all 10 of an expected 10 unclipped, no noise to speak of: C shrinks by exp(-lr (1 - q))
    new, share = next_clip(2.0, 10.0, 1e-12, 10.0, 0.5, 0.2, gen)
    assert share == pytest.approx(1.0) and new == pytest.approx(2.0 * math.exp(-0.2 * 0.5))


def test_adaptive_clip_tracks_the_quantile_over_rounds_and_reports_it(tmp_path):
    values = _values(tmp_path, dp_noise=1e-7, dp_count_noise=1e-6, dp_clip=1e3, dp_clip_quantile=0.5, rounds=4)
    values |= {"client_sampling": "fixed", "join_ratio": 1.0}
    run_experiment(make_config(None, values))
    records = _lines(tmp_path / "run")
    clips = [r["diagnostics"]["dp_clip"] for r in records]
    assert clips[0] == 1e3
    for a, b in zip(clips, clips[1:], strict=False):  # every update within the clip: b̄ = 1, a geometric decrease
        assert b == pytest.approx(a * math.exp(-0.2 * 0.5), rel=1e-6)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())["privacy"]
    assert summary["clip_quantile"] == 0.5 and summary["model_noise_multiplier"] > 1e-7
    with pytest.raises(ConfigError, match="must exceed half"):
        bad = {**values, "dp_noise": 1.0, "dp_count_noise": 0.1, "out": str(tmp_path / "x")}
        run_experiment(make_config(None, bad))


def test_private_scaffold_advances_its_control_variate_from_the_noised_sum(tmp_path):
    """SCAFFOLD's control deltas are clipped with the model and its server half sees their noised sum only: with no
    noise to speak of and a clip no upload reaches, the private run is SCAFFOLD's own (uniform weights)."""
    base = {**_values(tmp_path), "method": "scaffold", "client_sampling": "fixed", "join_ratio": 1.0, "rounds": 3}
    run_experiment(make_config(None, {**base, "dp_noise": 1e-12, "dp_clip": 1e6, "dp_weight_cap": 1e-9}))
    plain = {k: v for k, v in base.items() if not k.startswith("dp_")} | {"out": str(tmp_path / "plain")}
    run_experiment(make_config(None, plain))
    for a, b in zip(_lines(tmp_path / "run"), _lines(tmp_path / "plain"), strict=True):
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-4)
        assert a["global_acc"] == pytest.approx(b["global_acc"], abs=2e-3)


def test_fedskew_methods_lists_the_compositions_that_can_be_private(capsys):
    from fedskew.cli import main
    from fedskew.method_index import compute_index

    private = compute_index()["private"]
    assert {"fedavg", "fedprox", "scaffold", "fedavg+fedadam"} <= set(private)
    assert not {"fedsa", "fedavg+afl", "fedcac", "fedavg+fedexp"} & set(private)
    assert "fedavg+disco" in private  # with its d_k released through the Gaussian mechanism (dp_report_noise)
    assert main(["methods", "--compositions"]) == 0
    out = capsys.readouterr().out
    assert f"can run under user-level differential privacy (--dp-clip; docs/privacy.md), {len(private)}:" in out


def test_scaled_extras_enter_the_clip_scaled_and_the_server_divides_their_noised_sum(tmp_path):
    """dp_extras_scale s: the client clips [Δθ, s·Δc] jointly (SCAFFOLD's Δc is about Δθ/(lr·steps), so without it
    the control delta takes most of the clip) and the server divides the extras' noised sum by s; with no noise and
    a clip no upload reaches, the run is SCAFFOLD's own for any s."""
    from fedskew.engine.rounds import UpdateClip

    base = {**_values(tmp_path), "method": "scaffold", "client_sampling": "fixed", "join_ratio": 1.0, "rounds": 3}
    private = {**base, "dp_noise": 1e-12, "dp_clip": 1e6, "dp_weight_cap": 1e-9, "dp_extras_scale": 0.25}
    run_experiment(make_config(None, private))
    plain = {k: v for k, v in base.items() if not k.startswith("dp_")} | {"out": str(tmp_path / "plain")}
    run_experiment(make_config(None, plain))
    for a, b in zip(_lines(tmp_path / "run"), _lines(tmp_path / "plain"), strict=True):
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-4)
        assert a["global_acc"] == pytest.approx(b["global_acc"], abs=2e-3)
    # the clipped vector: the extras scaled by s before the joint clip
    received, trained = {"w": torch.zeros(3)}, {"w": torch.tensor([3.0, 0.0, 0.0])}
    extras = {"dc": torch.tensor([0.0, 40.0])}
    _, norm, clipped = clip_update(received, trained, ("w",), 1.0, {k: v * 0.1 for k, v in extras.items()})
    assert norm == pytest.approx(5.0) and float(clipped["dc"][1]) == pytest.approx(4.0 / 5.0)
    assert UpdateClip(1.0, ("w",)).extras_scale == 1.0
    server = PrivateMean(_plan(z=1e-12), ("w",), seed=0, extras={"dc": torch.zeros(2)})
    sums = server.extras_sums(1, {"dc": torch.tensor([[0.0, 0.8], [0.0, 0.4]])}, 1.0, scale=0.1)
    torch.testing.assert_close(sums["dc"], torch.tensor([0.0, 12.0]), rtol=1e-6, atol=1e-6)
    with pytest.raises(ConfigError, match="dp_extras_scale needs dp_clip"):
        make_config(None, {"dp_extras_scale": 0.5})
