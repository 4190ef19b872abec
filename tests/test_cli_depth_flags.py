"""Names say what they count (issue 20, item 7): every command that takes depths in sub-layers
has ``--sublayers``; ``--layers`` (the old name, while ``model.n_layers`` counts blocks) is a
deprecated alias for one release: the same plan, and one deprecation warning."""

import logging

import pytest

from keel.cli import build_parser, main

# each command with a depth flag, and the other arguments it needs
COMMANDS = {
    "gradflow": [],
    "stress": [],
    "lr-sensitivity": ["--out", "somewhere"],
}
DEFAULTS = {"gradflow": None, "stress": "64", "lr-sensitivity": "16,64"}


def parse(command: str, *flags: str):
    return build_parser().parse_args([command, *COMMANDS[command], *flags])


@pytest.mark.parametrize("command", COMMANDS)
def test_sublayers_and_the_layers_alias_give_the_same_plan(command):
    new, old = parse(command, "--sublayers", "4,8"), parse(command, "--layers", "4,8")
    assert new.sublayers_flag == "--sublayers" and old.sublayers_flag == "--layers"  # named by errors
    del new.sublayers_flag, old.sublayers_flag
    assert vars(new) == vars(old) and new.sublayers == "4,8"
    assert "layers" not in vars(new)  # one name for the value
    assert parse(command).sublayers == DEFAULTS[command]  # the alias does not hide the default


@pytest.mark.parametrize("command", COMMANDS)
def test_the_layers_alias_warns_once(command, caplog):
    with caplog.at_level(logging.WARNING, logger="keel"):
        parse(command, "--sublayers", "4")
    assert not caplog.records
    with caplog.at_level(logging.WARNING, logger="keel"):
        parse(command, "--layers", "4")
    (rec,) = caplog.records
    assert rec.levelno == logging.WARNING and "--layers is deprecated" in rec.getMessage()
    assert "--sublayers" in rec.getMessage()


def test_the_warning_reaches_stderr_and_the_command_still_runs(capsys):
    assert main(["gradflow", "--layers", "3"]) == 2  # checked as --sublayers, after one warning
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and "--layers is deprecated" in err[0]
    assert err[1] == "keel: error: --layers: 3 is not an even number >= 2 of sub-layers " \
                     "(each block is an attention and an FFN sub-layer)"  # the flag typed (it said --sublayers)


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("flag", ["--sublayers", "--layers"])
def test_a_bad_depth_error_names_the_flag_typed(command, flag, capsys):
    assert main([command, *COMMANDS[command], flag, "4,x"]) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.startswith(f"keel: error: {flag}") and ("--sublayers" in err) == (flag == "--sublayers")


def test_help_names_sublayers_for_every_depth_flag():
    for command in COMMANDS:
        p = build_parser()._subparsers._group_actions[0].choices[command]
        text = p.format_help()
        assert "--sublayers" in text and "deprecated alias of --sublayers" in text


@pytest.mark.parametrize("command", COMMANDS)
def test_sublayers_and_layers_together_are_refused(command, capsys):
    """A fresh-user trial: `--sublayers 4 --layers 8` silently profiled 8 sub-layers."""
    for flags in (["--sublayers", "4", "--layers", "8"], ["--layers", "8", "--sublayers", "4"]):
        with pytest.raises(SystemExit) as e:
            parse(command, *flags)
        assert e.value.code == 2
        assert "not allowed with argument" in capsys.readouterr().err
