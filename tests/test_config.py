"""Every value is validated with an error that names the key and the bad value; flags override the file."""

import pytest

from fedskew.cli import main
from fedskew.config import ConfigError, load_yaml, make_config


def test_defaults_are_the_digits_main_job():
    cfg = make_config()
    assert (cfg.dataset, cfg.partition, cfg.alpha, cfg.clients, cfg.method) == ("digits", "dir", 0.1, 10, "fedavg")


def test_flags_override_file(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("rounds: 7\nclients: 4\nlocal-epochs: 2\n")
    cfg = make_config(load_yaml(f), {"rounds": 3, "clients": None})
    assert (cfg.rounds, cfg.clients, cfg.local_epochs) == (3, 4, 2)


@pytest.mark.parametrize(
    "overrides, needle",
    [
        ({"alpha": -1.0}, "alpha"),
        ({"join_ratio": 1.5}, "join_ratio"),
        ({"rounds": 0}, "rounds"),
        ({"partition": "weird"}, "partition"),
        ({"method": "nosuch"}, "nosuch"),
        ({"method": "fedavg", "method_args": {"weights": "heavy"}}, "weights"),
        ({"method": "fedavg", "method_args": {"mu": 0.1}}, "mu"),
        ({"device": "quantum"}, "device"),
        ({"lr": 0}, "lr"),
        ({"not_a_key": 1}, "not_a_key"),
    ],
)
def test_bad_values_are_named(overrides, needle):
    with pytest.raises(ConfigError, match=needle):
        make_config(None, overrides)


def test_bad_yaml_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_yaml(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("rounds: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_yaml(bad)
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_yaml(listy)


def test_cli_reports_config_errors_without_writing(tmp_path, capsys):
    out = tmp_path / "run"
    code = main(["run", "--alpha", "-3", "--out", str(out), "--no-db", "--quiet"])
    assert code == 2
    assert "alpha" in capsys.readouterr().err
    assert not out.exists()


def test_group_key_ignores_seed_and_output():
    a = make_config(None, {"seed": 1, "out": "x"})
    b = make_config(None, {"seed": 2, "out": "y"})
    c = make_config(None, {"seed": 1, "alpha": 0.5})
    assert a.group_key() == b.group_key() != c.group_key()


# ---- issue 46: a YAML file is read strictly ---------------------------------------------------------------------
def test_a_key_given_twice_is_refused_with_both_lines(tmp_path):
    from fedskew.config import load_yaml

    (tmp_path / "run.yaml").write_text("rounds: 3\nlr: 0.1\nrounds: 5\n")
    with pytest.raises(ConfigError, match=r"line 3: key 'rounds' is given twice \(first at line 1\)"):
        load_yaml(tmp_path / "run.yaml")
    (tmp_path / "spec.yaml").write_text("methods:\n  - name: fedprox\n    args: {mu: 1, mu: 2}\n")
    with pytest.raises(ConfigError, match="key 'mu' is given twice"):
        load_yaml(tmp_path / "spec.yaml")  # nested mappings too (sweep specs, method arguments)
    (tmp_path / "ok.yaml").write_text("rounds: 3\nmethod_args: {rounds: 1}\n")  # the same key in two mappings is fine
    assert load_yaml(tmp_path / "ok.yaml") == {"rounds": 3, "method_args": {"rounds": 1}}


def test_a_config_that_is_not_utf8_is_refused_naming_the_byte(tmp_path):
    from fedskew.config import load_yaml

    (tmp_path / "latin1.yaml").write_bytes("rounds: 3\nout: runs/caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"is not UTF-8 text \(byte 23: b'\\xe9'\); save it as UTF-8"):
        load_yaml(tmp_path / "latin1.yaml")


def test_a_seed_beyond_two_to_the_53_is_refused_and_the_largest_one_runs(tmp_path):
    """A larger seed overflowed a derived torch seed (the skew probe's) after training had started; now the
    configuration refuses it, and the largest seed it admits runs with the probes on."""
    from fedskew.api import run

    with pytest.raises(ConfigError, match="seed: Input should be less than or equal to 9007199254740991"):
        make_config(None, {"seed": 2**53})
    result = run("fedavg", seed=2**53 - 1, rounds=1, clients=3, skew_probes=2, out=str(tmp_path / "r"), db=None)
    assert result.records[-1]["round"] == 1


# the experiment-identity keys of the schema before 2026-12-02; a key added since is left out of the identity at its
# default (ADDED_AT_DEFAULT), so that every recorded experiment keeps its group key and sweep folder name
IDENTITY_KEYS_2026_12_01 = {
    "alpha", "batch_size", "classes_per_client", "client_dropout", "client_sampling", "clients", "dataset",
    "domain_fraction", "dp_accountant", "dp_clip", "dp_clip_lr", "dp_clip_quantile", "dp_count_noise", "dp_delta",
    "dp_epsilon", "dp_extras_scale", "dp_noise", "dp_report_noise", "dp_weight_cap", "drop_last", "eval_clients",
    "eval_every", "evaluate_on", "holdout", "image_size", "imbalance_ratio", "join_ratio", "last_n", "local_epochs",
    "lr", "method", "method_args", "min_size", "model", "momentum", "norm", "on_bad_update", "partition",
    "partition_args", "pat_scheme", "protocol", "resize", "rounds", "samples_per_client", "skew_probes",
    "test_samples_per_client", "train_ratio", "uniform_clients", "validation", "weight_decay",
}  # fmt: skip


def test_a_new_setting_keeps_recorded_experiments_identity():
    """A setting added to the schema must not change the identity of experiments recorded before it existed: it is
    left out of the identity at its default (ADDED_AT_DEFAULT). Fails for a key added without that."""
    from fedskew.config import ADDED_AT_DEFAULT, NOT_IDENTITY, RunConfig

    new = {k for k in RunConfig.model_fields if k not in NOT_IDENTITY} - IDENTITY_KEYS_2026_12_01
    assert new <= set(ADDED_AT_DEFAULT), f"add {sorted(new - set(ADDED_AT_DEFAULT))} to ADDED_AT_DEFAULT"
    cfg = make_config(None, {"db": None})
    for key, default in ADDED_AT_DEFAULT.items():
        assert getattr(cfg, key) == default, key  # the entry is the setting's real default
    assert not set(cfg.identity()) - IDENTITY_KEYS_2026_12_01


def test_an_unknown_key_is_named_as_one_with_the_nearest_known_keys(tmp_path):
    with pytest.raises(ConfigError) as err:
        make_config({"local_epoch": 2, "batchsize": 3, "dirichlet": 0.1})
    lines = str(err.value).splitlines()[1:]
    assert "local_epoch: unknown key; did you mean local_epochs? (got 2)" in lines[0]
    assert "batchsize: unknown key; did you mean batch_size or eval_batch_size? (got 3)" in lines[1]
    assert lines[2].strip() == "dirichlet: unknown key (got 0.1)"  # nothing near: no guess


def test_an_unknown_key_inside_a_nested_model_is_matched_against_that_models_keys(tmp_path):
    from fedskew.sweep.core import load_spec

    spec = tmp_path / "s.yaml"
    spec.write_text("name: x\nmethods: [{name: fedavg, lable: A}]\nseedz: [0]\n")
    with pytest.raises(ConfigError) as err:
        load_spec(spec)
    assert "methods.0.MethodEntry.lable: unknown key; did you mean label?" in str(err.value)
    assert "seedz: unknown key; did you mean seeds?" in str(err.value)
