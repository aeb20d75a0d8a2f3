"""What the command line prints."""


def test_the_consoles_print_colon_words_as_written(capsys):
    """A tuning study of MOON is named `<search>:moon:<args>`; rich's emoji codes would print a moon instead."""
    from fedskew.commands import console

    console(soft_wrap=True).print("note: fedsa-cpu-pat:moon:tau=1.0: trial 7 was cut off")
    assert "fedsa-cpu-pat:moon:tau=1.0" in capsys.readouterr().out
