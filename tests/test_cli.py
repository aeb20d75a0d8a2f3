"""What the command line prints."""

import pytest


def test_the_consoles_print_colon_words_as_written(capsys):
    """A tuning study of MOON is named `<search>:moon:<args>`; rich's emoji codes would print a moon instead."""
    from fedskew.commands import console

    console(soft_wrap=True).print("note: fedsa-cpu-pat:moon:tau=1.0: trial 7 was cut off")
    assert "fedsa-cpu-pat:moon:tau=1.0" in capsys.readouterr().out


# settings without a `fedskew run` flag of their own: set in a YAML file (or by -m / -P / --download / --no-db)
NOT_FLAGS = {
    "method_args",  # -m KEY=VALUE
    "partition_args",  # -P KEY=VALUE
    "dataset_args",  # -D KEY=VALUE
    "download",  # --download (a switch on every data command)
    "divergence_factor",
    "drop_last",
    "eval_batch_size",
    "holdout",
    "log_group",
    "norm",
}


def test_run_flags_come_from_the_configuration_schema():
    """Every `fedskew run` flag is a run setting named with dashes, its help the setting's own description, its parser
    its type's (issue 40); a setting is either a flag, a switch or listed here as YAML-only, so a new one is not
    silently missing from the command line."""
    from fedskew.commands.flags import FLAG_KEYS, RUN_FLAGS, RUN_SWITCHES, flag_help, flag_type
    from fedskew.config import RunConfig

    fields = RunConfig.model_fields
    assert set(fields) == set(FLAG_KEYS) | set(RUN_SWITCHES) | NOT_FLAGS
    for flag, (key, _, help_) in RUN_FLAGS.items():
        assert flag == "--" + key.replace("_", "-") and help_ == flag_help(fields[key]) and help_
    assert RUN_FLAGS["--rounds"][1] is int and RUN_FLAGS["--lr"][1] is float and RUN_FLAGS["--resize"][1] is int
    every = RUN_FLAGS["--checkpoint-every"][1]
    assert every("auto") == "auto" and every("5") == 5
    assert flag_type(fields["state_memory"].annotation) is str  # "2GB" or a number of bytes: the config parses it
    assert RUN_FLAGS["--pat-scheme"][2].startswith("random | pfllib | niid-bench: ")  # a fixed set of choices is listed
    assert "%%" in flag_help(fields["domain_fraction"])  # argparse's % escaped


@pytest.mark.parametrize("columns", [80, 100, 140])
def test_methods_fits_a_screen_and_lists_the_compositions_on_request(capsys, monkeypatch, columns):
    """Issue 45: ``fedskew methods`` printed 27 KB with 7,000- and 13,000-character lines; now one line per part,
    cut to the terminal's width (``fedskew methods NAME`` has the rest), every line within it."""
    from fedskew.cli import main
    from fedskew.method_index import method_index

    monkeypatch.setenv("COLUMNS", str(columns))
    assert main(["methods"]) == 0
    out = capsys.readouterr().out
    assert len(out) < 10_000 and max(len(line) for line in out.splitlines()) <= columns
    names = [row[0] for row in method_index()["rows"]]
    listed = [ln.split()[0] for ln in out.splitlines() if ln.startswith("  ")]
    assert sorted(listed) == sorted(names)  # one line each (grouped by kind)
    flat = " ".join(out.split())
    assert "valid compositions of a client part and a plug-in" in flat and "fedprox+disco" not in flat
    assert "fedskew methods NAME" in flat
    assert main(["methods", "--compositions"]) == 0
    full = capsys.readouterr().out
    assert "fedprox+disco" in full and "refused:" in full and max(len(line) for line in full.splitlines()) <= columns


def test_methods_name_gives_each_parts_paper_defaults_and_what_the_composition_can_do(capsys, monkeypatch):
    from fedskew.cli import main

    monkeypatch.setenv("COLUMNS", "100")
    assert main(["methods", "fedprox+disco", "fedsa"]) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 100
    flat = " ".join(out.split())
    assert "fedprox+disco: a composition" in flat and "Li et al., Federated Optimization" in flat
    assert "mu = 0.01 (>= 0; tuned over log[0.001, 1])" in flat and "metric = 'kl' (kl|l1|l2|cosine|only_iid)" in flat
    assert "disco_discrepancy" in flat  # what the server learns of each client
    assert "user-level DP (--dp-clip): can run" in flat
    assert "user-level DP (--dp-clip): no: its server combines the individual updates (FedSACombine)" in flat
    assert "--capture-steps (with --batched-clients): yes, on models with a stacked form personalized" in flat
    assert main(["methods", "perfedavg", "gpfl"]) == 0  # Per-FedAvg's inner steps as masks, GPFL's stacked term
    flat = " ".join(capsys.readouterr().out.split())
    assert flat.count("--capture-steps (with --batched-clients): yes, on models with a stacked form") == 2
    assert main(["methods", "fedpake"]) == 0 and "fedpake (= fedsa)" in capsys.readouterr().out
    assert main(["methods", "nope"]) == 2 and "unknown part 'nope'" in capsys.readouterr().err


def test_a_commands_warning_is_one_note_line_without_pythons_source_line(tmp_path, capsys):
    """Issue 45: a warning (here: a loss term without a batched form on this model under --batched-clients) printed
    Python's ``file:line: UserWarning`` header and the raw ``warnings.warn(`` line under it."""
    import warnings

    from fedskew.cli import main

    before = warnings.showwarning
    args = ["run", "--method", "moon", "--model", "resnet8", "--batched-clients", "--rounds", "1", "--clients", "4"]
    args += ["--no-db", "--quiet"]
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        assert main([*args, "--out", str(tmp_path / "run")]) == 0
    err = capsys.readouterr().err
    assert "note: batched_clients: Moon's loss term is batched for standard-layer models only" in err
    assert "UserWarning" not in err and "warnings.warn(" not in err
    assert warnings.showwarning is before  # left as it was for the process that called main()


@pytest.mark.parametrize("value", ["null", "none", "None"])
def test_db_null_on_the_command_line_disables_the_database(tmp_path, monkeypatch, value):
    """``--db null`` (the help's way to disable it) wrote a SQLite file named ``null`` in the working directory."""
    from fedskew.cli import main
    from fedskew.config import make_config

    monkeypatch.chdir(tmp_path)
    args = ["run", "--rounds", "1", "--clients", "3", "--out", str(tmp_path / "run"), "--db", value, "--quiet"]
    assert main(args) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    assert make_config(None, {"db": value}).db is None and make_config(None, {"db": "my.db"}).db == "my.db"
