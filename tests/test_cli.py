"""What the command line prints."""


def test_the_consoles_print_colon_words_as_written(capsys):
    """A tuning study of MOON is named `<search>:moon:<args>`; rich's emoji codes would print a moon instead."""
    from fedskew.commands import console

    console(soft_wrap=True).print("note: fedsa-cpu-pat:moon:tau=1.0: trial 7 was cut off")
    assert "fedsa-cpu-pat:moon:tau=1.0" in capsys.readouterr().out


# settings without a `fedskew run` flag of their own: set in a YAML file (or by -m / -P / --download / --no-db)
NOT_FLAGS = {
    "method_args",  # -m KEY=VALUE
    "partition_args",  # -P KEY=VALUE
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
    assert RUN_FLAGS["--pat-scheme"][2].startswith("random | pfllib: ")  # a fixed set of choices is listed
    assert "%%" in flag_help(fields["domain_fraction"])  # argparse's % escaped


def test_methods_fits_a_screen_and_lists_the_compositions_on_request(capsys):
    """Issue 45: ``fedskew methods`` printed 27 KB with 7,000- and 13,000-character lines."""
    from fedskew.cli import main

    assert main(["methods"]) == 0
    out = capsys.readouterr().out
    assert len(out) < 10_000 and max(len(line) for line in out.splitlines()) < 250
    assert "valid compositions of a client part and a plug-in" in out and "fedprox+disco" not in out
    assert main(["methods", "--compositions"]) == 0
    full = capsys.readouterr().out
    assert "fedprox+disco" in full and "refused:" in full and max(len(line) for line in full.splitlines()) < 200
