"""Issue 10: silent wrong numbers and refusals of valid input found by independent checks (engine, config, CLI)."""

import json
import sqlite3

import pytest
import torch
import yaml

from fedskew.cli import main
from fedskew.config import ConfigError, make_config
from fedskew.data.federated import build_federated
from fedskew.engine.loop import Diverged, Simulation
from fedskew.protocol import NonFiniteUploadError, Upload, UploadError
from fedskew.server.uploads import check_model, stack_uploads


def _cfg(tmp_path, **kw):
    values = {"clients": 5, "rounds": 2, "out": str(tmp_path / "run"), "db": None, "skew_probes": 0}
    values.update(kw)
    return make_config(None, values)


# ---- item 3: divergence is flagged loudly, uploads of the wrong dtype are refused --------------------------------
def test_diverging_run_is_flagged_in_summary_database_report_and_exit_code(tmp_path, capsys):
    db = tmp_path / "r.db"
    out = tmp_path / "div"
    rc = main(["run", "--lr", "1.5", "--rounds", "4", "--out", str(out), "--db", str(db), "--quiet"])
    assert rc == 3
    err = capsys.readouterr().err
    assert "diverged in round 1" in err and "training loss" in err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["diverged"] is True and summary["diverged_round"] == 1
    assert "exceeds divergence_factor" in summary["diverged_reason"]
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT diverged_round FROM runs").fetchall() == [(1,)]
    assert main(["report", "--db", str(db)]) == 0
    assert "seed 0 (round 1)" in capsys.readouterr().out


def test_healthy_run_is_not_flagged(tmp_path):
    from fedskew.runner import run_experiment

    summary = run_experiment(_cfg(tmp_path)).summary
    assert summary["diverged"] is False and summary["diverged_round"] is None


def test_exploding_loss_below_nan_is_divergence(tmp_path):
    cfg = _cfg(tmp_path, lr=1.5)
    sim = Simulation(cfg, build_federated(cfg))
    with pytest.raises(Diverged, match="round 1: training loss"):
        sim.round(1)


def test_nonfinite_client_loss_is_divergence(tmp_path, monkeypatch):
    cfg = _cfg(tmp_path)
    sim = Simulation(cfg, build_federated(cfg))
    real = sim.method.client.loss

    def nan_loss(ctx, logits, feats, y, x):
        return real(ctx, logits, feats, y, x) * float("nan") if ctx.cid == 2 else real(ctx, logits, feats, y, x)

    monkeypatch.setattr(sim.method.client, "loss", nan_loss)
    with pytest.raises(Diverged, match="client 2's training loss is nan"):
        sim.round(1)


def test_huge_finite_upload_is_caught_as_divergence_next_round(tmp_path):
    """A client whose upload is finite but huge poisons the average; the next round's training loss explodes and
    the run stops there instead of ending at chance accuracy with exit 0."""
    cfg = _cfg(tmp_path, rounds=3)
    sim = Simulation(cfg, build_federated(cfg))
    sim.round(1)
    sim.global_params = {k: v * 1e6 if v.is_floating_point() else v for k, v in sim.global_params.items()}
    with pytest.raises(Diverged, match="round 2"):
        sim.round(2)


def test_nonfinite_aggregate_is_divergence(tmp_path):
    cfg = _cfg(tmp_path)
    sim = Simulation(cfg, build_federated(cfg))
    bad = {k: torch.full_like(v, float("inf")) for k, v in sim.global_params.items()}
    with pytest.raises(Diverged, match="aggregated global model holds NaN or Inf"):
        sim.server._check_models(1, bad, None)


def test_check_model_refuses_dtype_and_shape_changes():
    template = {"w": torch.zeros(2, 3), "n": torch.zeros((), dtype=torch.long)}
    assert check_model(template, template, "x") == []
    with pytest.raises(TypeError, match="tensor 'w' is torch.float64"):
        check_model({**template, "w": torch.zeros(2, 3, dtype=torch.float64)}, template, "x")
    with pytest.raises(TypeError, match="missing tensors"):
        check_model({"w": template["w"]}, template, "x")
    assert check_model({**template, "w": torch.full((2, 3), float("nan"))}, template, "x") == ["w"]


def _stack(params_list):
    glob = {"w": torch.zeros(3)}
    ups = [Upload(cid=i, params=p, num_samples=5) for i, p in enumerate(params_list)]
    return stack_uploads(ups, rnd=1, global_params=glob, trainable=frozenset({"w"}), label_hists=[[1], [1]])


def test_stack_updates_refuses_integer_upload_naming_the_client():
    with pytest.raises(UploadError, match="client 1: tensor 'w' has dtype torch.int64, expected torch.float32"):
        _stack([{"w": torch.ones(3)}, {"w": torch.ones(3, dtype=torch.long)}])


def test_stack_updates_nonfinite_is_its_own_error_type():
    with pytest.raises(NonFiniteUploadError, match="client 0"):
        _stack([{"w": torch.tensor([1.0, float("inf"), 0.0])}, {"w": torch.ones(3)}])


@pytest.mark.parametrize("key", ["lr", "alpha", "momentum", "join_ratio", "weight_decay"])
@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_non_finite_settings_are_refused(key, value):
    with pytest.raises(ConfigError, match=key):
        make_config(None, {key: value})


# ---- item 9: a client that never trained keeps the initial model's local entries -----------------------------------
@pytest.mark.parametrize("method", ["local", "fedper", "fedrep", "fedbn"])
def test_never_sampled_client_holds_initial_local_entries(tmp_path, method):
    cfg = _cfg(tmp_path, method=method, clients=6, join_ratio=0.5, rounds=1, model="lenet_bn")
    sim = Simulation(cfg, build_federated(cfg))
    initial = {k: v.clone() for k, v in sim.global_params.items()}
    sim.round(1)
    trained = {c for c in range(6) if "local_params" in sim.client_states[c] and c in sim.trained}
    absent = sorted(set(range(6)) - trained)
    assert absent, "the round must leave some client out"
    for cid in absent:
        personal = sim.personal_params(cid)
        for name in sim.local_names:
            assert torch.equal(personal[name], initial[name]), (method, cid, name)
        shared = [n for n in sim.global_params if n not in sim.local_names and n in sim.trainable]
        for name in shared:  # what is shared is the current global model
            assert torch.equal(personal[name], sim.global_params[name])
    if method == "local":  # Local never collaborates: an absent client is exactly the initial model
        assert all(torch.equal(sim.personal_params(absent[0])[k], v) for k, v in initial.items())


# ---- item 11: fedsa+disco with the argument the refusal asks for ---------------------------------------------------
def test_fedsa_disco_accepted_with_low_weighting_samples(tmp_path):
    with pytest.raises(ConfigError, match="low_weighting=samples"):
        make_config(None, {"method": "fedsa+disco"})
    cfg = make_config(None, {"method": "fedsa+disco", "method_args": {"low_weighting": "samples"}})
    assert cfg.method == "fedsa+disco"
    rc = main(
        ["run", "--method", "fedsa+disco", "-m", "low_weighting=samples", "--rounds", "1", "--clients", "4"]
        + ["--no-db", "--out", str(tmp_path / "r"), "--quiet"]
    )
    assert rc == 0


# ---- item 12: refusals are one-line errors; auto picks a normalization model for FedBN ----------------------------
def test_fedbn_with_auto_model_picks_lenet_bn_and_records_it(tmp_path):
    rc = main(["run", "--method", "fedbn", "--rounds", "1", "--no-db", "--out", str(tmp_path / "r"), "--quiet"])
    assert rc == 0
    assert yaml.safe_load((tmp_path / "r" / "config.yaml").read_text())["model"] == "lenet_bn"


def test_fedbn_on_a_model_without_norm_layers_is_a_one_line_refusal(tmp_path, capsys):
    rc = main(["run", "--method", "fedbn", "--model", "mlp", "--no-db", "--out", str(tmp_path / "r"), "--quiet"])
    assert rc == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "normalization layers" in err and "Traceback" not in err
    assert not (tmp_path / "r").exists()


def test_unknown_model_is_refused_at_validation():
    with pytest.raises(ConfigError, match="unknown model 'foo'"):
        make_config(None, {"model": "foo"})


# ---- item 13: the missing-data advice works ------------------------------------------------------------------------
def test_missing_data_advice_names_a_flag_that_exists(tmp_path, capsys):
    rc = main(["run", "--dataset", "mnist", "--data-dir", str(tmp_path), "--no-db", "--quiet"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "--download" in err
    from fedskew.cli import build_parser

    args = build_parser().parse_args(["run", "--download", "--dataset", "mnist"])
    assert args.download is True
    assert make_config(None, {"download": True}).download is True


# ---- item 14: config.yaml re-runs the same experiment; strict types; -m without '=' --------------------------------
def test_config_yaml_records_the_model_auto_stood_for(tmp_path):
    from fedskew.runner import run_experiment

    run_experiment(_cfg(tmp_path, rounds=1))
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved["model"] == "mlp"  # digits are 8x8


def test_method_arg_without_equals_exits_2(capsys):
    assert main(["run", "-m", "mu", "--quiet"]) == 2
    assert "KEY=VALUE" in capsys.readouterr().err


@pytest.mark.parametrize("key", ["rounds", "clients", "lr", "alpha", "seed", "batch_size"])
def test_yaml_boolean_is_not_read_as_a_number(tmp_path, key):
    f = tmp_path / "c.yaml"
    f.write_text(f"{key}: true\n")
    from fedskew.config import load_yaml

    with pytest.raises(ConfigError, match=f"{key}: expected"):
        make_config(load_yaml(f))


def test_yaml_numbers_still_parse(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("rounds: 3\nlr: 1e-3\nalpha: 0.5\ndrop_last: true\n")  # PyYAML reads 1e-3 as a string
    from fedskew.config import load_yaml

    cfg = make_config(load_yaml(f))
    assert (cfg.rounds, cfg.lr, cfg.alpha, cfg.drop_last) == (3, 1e-3, 0.5, True)


@pytest.mark.parametrize(
    "method, args, msg",
    [
        ("fedprox", {"mu": float("inf")}, "finite"),
        ("fedprox", {"mu": True}, "boolean"),
        ("fedsa", {"C": True}, "boolean"),
        ("disco", {"a": float("nan")}, "finite"),
    ],
)
def test_method_hyper_parameters_are_strict_too(method, args, msg):
    with pytest.raises(ConfigError, match=msg):
        make_config(None, {"method": method, "method_args": args})
