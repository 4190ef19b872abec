"""Discoverability: keel --version, keel config (presets, every key with type/default/meaning from
the dataclasses), keel config --show, keel runs (overview and statuses), help output with
defaults and without reST markup."""

import argparse
import dataclasses
import json
import os
import sys
import shutil

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from conftest import REPO, tiny_overrides
from keel import __version__
from keel.cli import build_parser, main
from keel.config import DataConfig, ModelConfig, TrainConfig, describe_config, load_config, resolve_config_path


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"keel {__version__}"


def test_describe_config_covers_every_field_from_the_dataclasses():
    rows = {r["key"]: r for r in describe_config()}
    for section, cls in (("model", ModelConfig), ("data", DataConfig), ("train", TrainConfig)):
        obj = cls()
        for f in dataclasses.fields(cls):
            row = rows.pop(f"{section}.{f.name}")
            assert row["default"] == getattr(obj, f.name)
            assert row["type"] == str(f.type) or row["choices"]  # Literal fields show their choices
            assert row["help"], f"{section}.{f.name} has no help"
    assert rows == {}
    d = {r["key"]: r for r in describe_config()}
    assert d["train.batch_size"]["help"].startswith("sequences per micro-batch")
    assert d["model.alpha"]["type"] == "float | None" and d["model.alpha"]["default"] is None


def test_keel_config_lists_presets_and_keys(capsys):
    assert main(["config"]) == 0
    out = capsys.readouterr().out
    assert "presets (keel train --config NAME): demo, paper-1024, paper-128, paper-512, paper-64" in out
    assert "sweep presets (keel sweep --preset NAME): " in out and "paper-depth" in out
    assert "  model.d_model " in out and "int = 128  width of the residual stream." in out
    assert sum(1 for ln in out.splitlines() if ln.startswith("  ")) == len(describe_config())


def test_keel_config_show_prints_the_resolved_preset(capsys):
    assert main(["config", "--show", "paper-64"]) == 0
    shown = tomllib.loads(capsys.readouterr().out)
    assert shown == load_config(resolve_config_path("paper-64")).to_dict()
    assert shown["model"]["d_model"] == 1024 and 2 * shown["model"]["n_layers"] == 64
    assert main(["config", "--show", "paper-depth"]) == 0  # a sweep preset: its file
    assert capsys.readouterr().out == resolve_config_path("paper-depth", kind="sweeps").read_text()
    assert main(["config", "--show", "nope"]) == 2
    assert "unknown config 'nope'" in capsys.readouterr().err


def test_keel_config_show_takes_a_run_folder(tiny_reference_run, capsys):
    """`keel config --show RUN_DIR` said "config file not found"; it shows the config the run trained with."""
    assert main(["config", "--show", str(tiny_reference_run)]) == 0
    shown = tomllib.loads(capsys.readouterr().out)
    assert shown == tomllib.loads((tiny_reference_run / "config.toml").read_text())
    assert shown["model"]["vocab_size"] == 512 and shown["train"]["steps"] == 12


@pytest.mark.parametrize("marker, words", [("sweep.json", "a sweep folder: each of its runs is a run folder inside it"),
                                           ("study.json", "a study folder: each of its runs is a run folder inside it"),
                                           (None, "not a run folder (no config.toml)")])
def test_keel_config_show_of_a_folder_that_is_not_a_run_says_what_it_is(tmp_path, capsys, marker, words):
    """`keel config --show SWEEP_DIR` said "config file not found: SWEEP_DIR"."""
    folder = tmp_path / "sw"
    folder.mkdir()
    if marker:
        (folder / marker).write_text("{}")
    assert main(["config", "--show", str(folder)]) == 2
    assert capsys.readouterr().err == (f"keel: error: --show {folder}: {words}"
                                       + (f" (`keel runs {folder}` lists them)" if marker else "")
                                       + "; --show takes a preset, a TOML file or a run folder\n")


def test_keel_config_schemes_lists_every_scheme_with_its_paper(capsys):
    from keel.model import SCHEMES

    assert main(["config", "--schemes"]) == 0
    lines = capsys.readouterr().out.splitlines()
    named = [ln.split()[0] for ln in lines[1:] if not ln.startswith("   ")]
    assert named == list(SCHEMES)  # every scheme, in the one list's order
    text = " ".join(lines)
    assert "arXiv 2601.19895" in text and "Peri-LN (Kim et al. 2025" in text
    assert "::" not in text and ":class:" not in text and "``" not in text and "cfg." not in text
    assert "alpha = model.alpha" in text and "rho = model.mix_ln_ratio" in text  # config keys, not attributes
    assert "X_next  = Norm(Y) + FFN(Norm(Y))" in text  # the formula block after a "::" paragraph
    assert "H_i <- H'_i + B_i * F(Norm(h_0))" in text  # Hyper-Connections: its update, not just the citation
    with pytest.raises(SystemExit):  # one thing at a time (was: --show silently dropped)
        main(["config", "--schemes", "--show", "demo"])
    assert "not allowed with argument" in capsys.readouterr().err
    main(["config"])
    assert "keel config --schemes" in next(ln for ln in capsys.readouterr().out.splitlines() if "model.residual " in ln)


def _parsers(parser, prefix=("keel",)):
    yield prefix, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, prefix + (name,))


def test_every_help_shows_defaults_and_no_rest_markup():
    seen = 0
    for name, parser in _parsers(build_parser()):
        text = parser.format_help()
        assert "``" not in text and ":func:`" not in text and ":mod:`" not in text, " ".join(name)
        for action in parser._actions:
            if action.option_strings and action.default not in (None, False, "", [], argparse.SUPPRESS) \
                    and action.help and "default" not in action.help:
                assert f"(default: {action.default})" in " ".join(text.split()), (name, action.dest)
        seen += 1
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert seen == 1 + len(commands) and len(commands) >= 15  # keel and each command (15 when this was written)
    eval_help = " ".join(dict(_parsers(build_parser()))[("keel", "eval")].format_help().split())
    assert "--batch-size BATCH_SIZE windows (perplexity) or requests (tasks) per forward pass (default: 8)" \
        in eval_help


def test_every_command_help_has_a_description():
    """A fresh-user trial: `keel stress --help` had no description line under its usage."""
    missing = [" ".join(name) for name, parser in _parsers(build_parser()) if not (parser.description or "").strip()]
    assert not missing, missing


def test_plot_loss_help_shows_the_loss_options(capsys):
    with pytest.raises(SystemExit) as e:
        main(["plot", "loss", "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "--smooth" in out and "--val" in out


def test_run_status_rules():
    from keel.experiments.overview import run_status

    ok = [{"step": 0, "val_loss": 6.0}, {"step": 1, "loss": 5.0}, {"step": 2, "loss": 4.0, "val_loss": 4.5}]
    assert run_status([], 2, False) == "new" and run_status([], 2, True) == "running"
    assert run_status(ok, 2, False) == "finished" and run_status(ok, 2, True) == "finished"
    assert run_status(ok[:2], 2, True) == "running"
    assert run_status(ok[:2], 2, False) == "stopped"
    assert run_status(ok[:2] + [{"step": 2, "loss": None}], 2, False) == "diverged"
    verdict = {"mode": "instability", "step": 1, "evidence": {}}
    assert run_status([ok[0], {"step": 1, "loss": 5.0, "divergence": verdict}] + ok[2:], 2, True) == "diverged"
    healthy = dict(verdict, mode="healthy")
    assert run_status(ok[:2] + [dict(ok[2], divergence=healthy)], 2, False) == "finished"


@pytest.mark.parametrize("skipped,status", [(1, "stopped"), (2, "diverged"), (3, "diverged")])
def test_a_run_the_trainer_stopped_for_non_finite_steps_is_diverged(skipped, status):
    """A run stopped by train.max_bad_steps (its last steps skipped: grad norm NaN, loss finite) was
    listed as "stopped", whose meaning is "interrupted; keel train --resume continues it"."""
    from keel.experiments.overview import run_status

    bad = [{"step": 2 + i, "loss": 6.2, "grad_norm": None, "skipped": True} for i in range(skipped)]
    records = [{"step": 0, "val_loss": 6.0}, {"step": 1, "loss": 5.0}] + bad
    assert run_status(records, 20, False, 0, max_bad_steps=2) == status
    assert run_status(records, 20, True, 0, max_bad_steps=2) == "running"  # a live run may still recover
    assert run_status(records, 20, False, 0) == "stopped"  # max_bad_steps not known: not judged


def test_a_run_is_running_while_a_process_holds_its_lock(tmp_path):
    """`keel runs` called a run "running" for 5 minutes after its process was killed (metrics.jsonl
    had changed within 300 s), and "stopped" while a step took longer than that: the lock tells."""
    from keel.io import RunLock, lock_holder

    assert lock_holder(tmp_path / "nothing") is None
    with RunLock(tmp_path / "r"):
        assert lock_holder(tmp_path / "r") == str(os.getpid())
    assert lock_holder(tmp_path / "r") is None and (tmp_path / "r" / ".keel.lock").exists() is False
    (tmp_path / "r").mkdir()
    lock = RunLock(tmp_path / "r").acquire()
    (tmp_path / "r" / "x").write_text("")
    lock.release()
    assert (tmp_path / "r" / ".keel.lock").exists() and lock_holder(tmp_path / "r") is None  # the file stays, unheld


def test_keel_runs_table_and_json(tiny_data, tmp_path, capsys):
    from keel.experiments.overview import count_parameters
    from keel.model import Transformer
    from keel.train import train
    from keel.train.metrics import read_metrics

    root = tmp_path / "runs"
    cfg = load_config(REPO / "keel" / "configs" / "demo.toml",
                      tiny_overrides(tiny_data, steps=2, eval_every=2, checkpoint_every=2))
    train(cfg, root / "a")
    assert count_parameters(cfg.model) == Transformer(cfg.model).num_params()
    assert main(["runs", str(root), "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    last = read_metrics(root / "a" / "metrics.jsonl")[-1]
    assert row == {"run": str(root / "a"), "scheme": "keel", "blocks": 2, "sublayers": 4,
                   "params": count_parameters(cfg.model), "step": 2, "steps": 2, "tokens": last["tokens"],
                   "val_loss": last["val_loss"], "tokens_per_s": last["tokens"] / last["elapsed_s"],
                   "status": "finished", "mode": None}
    assert main(["runs", str(root)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["run", "scheme", "blocks/sub-layers", "params", "step", "tokens", "val_loss", "tokens/s",
                                "status"]
    assert table[1].split()[:5] == ["a", "keel", "2/4", f"{row['params'] / 1e6:.2f}M", "2/2"]
    assert table[1].split()[-1] == "finished" and f"{last['val_loss']:.4f}" in table[1]
    assert main(["runs", str(tmp_path / "none")]) == 2
    # a run folder whose config is not TOML, or not UTF-8 (that aborted the whole table), is skipped
    for name, text in (("b", b"[model\nd_model = 3"), ("c", b"\xff\xfe[train]\n")):
        (root / name / "checkpoints").mkdir(parents=True)
        (root / name / "config.toml").write_bytes(text)
    assert main(["runs", str(root), "--json"]) == 0
    assert [r["run"] for r in json.loads(capsys.readouterr().out)] == [str(root / "a")]
    # a run stopped before its first metrics (config.toml only) is listed as new (it was left out)
    (root / "d").mkdir()
    (root / "d" / "config.toml").write_text((root / "a" / "config.toml").read_text())
    assert main(["runs", str(root), "--json"]) == 0
    rows = {r["run"]: r for r in json.loads(capsys.readouterr().out)}
    assert list(rows) == [str(root / "a"), str(root / "d")]
    assert (rows[str(root / "d")]["status"], rows[str(root / "d")]["step"]) == ("new", None)
    # a run the classifier flagged says which of the paper's three modes (the table said "diverged" for a
    # stagnation on the unigram plateau, whose run finished every step without a spike)
    shutil.copytree(root / "a", root / "e")
    metrics = (root / "e" / "metrics.jsonl").read_text().splitlines()
    flagged = dict(json.loads(metrics[-1]), divergence={"mode": "stagnation", "step": 1, "evidence": {}})
    (root / "e" / "metrics.jsonl").write_text("\n".join(metrics[:-1] + [json.dumps(flagged)]) + "\n")
    assert main(["runs", str(root), "--json"]) == 0
    rows = {r["run"]: r for r in json.loads(capsys.readouterr().out)}
    assert (rows[str(root / "e")]["status"], rows[str(root / "e")]["mode"]) == ("diverged", "stagnation")
    assert rows[str(root / "a")]["mode"] is None
    assert main(["runs", str(root)]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("e "))
    assert line.endswith("diverged (stagnation)")


@pytest.mark.spawns
def test_help_loads_no_torch():
    """`keel --help` (building every command's parser) must not import torch: it stays fast."""
    import subprocess
    import sys

    from conftest import HANG_S

    code = "import sys; from keel.cli import build_parser; build_parser(); print('torch' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_S)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"


@pytest.mark.spawns
def test_help_of_keel_and_of_every_command_loads_no_torch():
    """`python -m keel --help` and `python -m keel CMD --help` for every command (each command's
    flags and handler in one module of keel.cli.commands, its library imported only when it runs)
    import neither torch nor the library above keel.config."""
    import subprocess

    from conftest import HANG_S

    code = ("import contextlib, io, runpy, sys\n"
            "from keel.cli import COMMAND_GROUPS, build_parser\n"
            "sub = next(a for a in build_parser()._actions if a.__class__.__name__ == '_SubParsersAction')\n"
            "for argv in [['--help']] + [[name, '--help'] for name in sub.choices]:\n"
            "    sys.argv = ['keel', *argv]\n"
            "    with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
            "        runpy.run_module('keel', run_name='__main__', alter_sys=True)\n"
            "print(len(sub.choices), 'torch' in sys.modules, sorted(m for m in sys.modules"
            " if m.split('.')[:2] in (['keel', 'train'], ['keel', 'model'], ['keel', 'data'], ['keel', 'run'],"
            " ['keel', 'hf'])))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_S)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == f"{len(_commands())} False []"


def _commands() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices


def test_every_command_has_its_handler_beside_its_flags():
    """Each command's parser sets ``handler`` to a function ``cmd_NAME`` of the module of
    ``keel.cli.COMMAND_GROUPS`` that declares its flags (no handler named by a string), and that
    module's ``import_library()`` (where it has one) binds every name its handlers use."""
    import sys as _sys

    from keel.cli import COMMAND_GROUPS

    groups = {g.__name__ for g in COMMAND_GROUPS}
    assert all(name.startswith("keel.cli.commands.") for name in groups)
    for name, parser in _commands().items():
        handler = parser.get_default("handler")
        assert callable(handler) and handler.__name__ == "cmd_" + name.replace("-", "_"), name
        assert handler.__module__ in groups, name
        library = getattr(_sys.modules[handler.__module__], "import_library", None)
        if library is not None:
            library()


def test_the_cli_docstring_names_every_command_and_its_module():
    """The package docstring of keel.cli lists every registered command (``NAME``), on the line
    of the module that registers it."""
    import keel.cli

    doc = keel.cli.__doc__
    for name, parser in _commands().items():
        module = parser.get_default("handler").__module__
        entry = doc[doc.index(f":mod:`{module}` --"):]
        entry = entry[:entry.index("\n* ") if "\n* " in entry else entry.index("\n\n")]
        assert f"``{name}``" in entry, f"{name} is not listed under {module} in keel.cli's docstring"


@pytest.mark.spawns
def test_keel_config_loads_no_torch():
    """`keel config` (its handler module included) stays as light as `keel --help`."""
    import subprocess
    import sys

    from conftest import HANG_S

    code = "import sys; from keel.cli import main; main(['config']); print('torch' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_S)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "False" and "model.residual" in r.stdout


def _documented_commands() -> list[tuple[str, str]]:
    """``(file, command line)`` of every ``keel ...`` (or ``... -m keel ...``) line in a code block of
    README.md and the guides in docs/ (continuation lines joined; the results pages left out)."""
    import re

    from conftest import REPO

    found = []
    for f in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for block in re.findall(r"```[a-z]*\n(.*?)```", f.read_text(encoding="utf-8"), flags=re.S):
            for line in block.replace("\\\n", " ").splitlines():
                s = line.strip().removeprefix("$ ")
                if s.startswith("keel ") or re.match(r"^\S*(python|torchrun)\S* .*-m keel ", s):
                    found.append((f.name, s))
    return found


def test_every_command_in_the_readme_and_the_guides_parses():
    """Issue 49: each command the README and docs/ guides show still parses (its command and flags exist,
    its values fit their types), so a renamed flag cannot leave a guide behind."""
    import shlex

    from keel.cli import build_parser

    commands = _documented_commands()
    assert len(commands) >= 30 and {f for f, _ in commands} >= {"README.md", "usage.md", "cluster.md"}
    for where, line in commands:
        argv = shlex.split(line.split("-m keel ", 1)[-1] if "-m keel " in line else line[len("keel "):],
                           comments=True)
        argv = argv[:next((i for i, a in enumerate(argv) if a in ("&&", "||", "|", ";", ">", "2>", "&")), len(argv))]
        try:
            build_parser().parse_args(argv)
        except SystemExit as e:
            pytest.fail(f"{where}: `{line}` does not parse (exit {e.code})")


def test_the_guide_command_check_catches_a_renamed_flag():
    """The check above fails on a flag that does not exist (argparse exits 2)."""
    from keel.cli import build_parser

    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["train", "--run-folder", "runs/x"])
    assert e.value.code == 2


def test_config_study_keys_lists_every_declared_key_of_a_study_file(capsys):
    """The study file format was documented only by the shipped files (a new user read claims.toml
    to learn widen, peak_lr, kind ...): `keel config --study-keys` prints every group key and every
    claim kind's keys from their declarations, with type, default and rule."""
    import dataclasses

    from keel.cli import main
    from keel.experiments.study.claims import CLAIMS
    from keel.experiments.study.spec import Group
    from keel.keys import key_names

    assert main(["config", "--study-keys"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith("a study file: description, base") and "best_over" in lines[0]
    group = lines[lines.index("study group keys ([groups.NAME]; sized per scale in [scales.S.groups.NAME]):") + 1:]
    assert [ln.split()[0] for ln in group[:len(key_names(Group))]] == key_names(Group)
    assert "  widen " in out and "(must be >= 0 (LRs added per side))" in out
    for kind, cls in CLAIMS.items():
        assert f'claim keys of test = "{kind}":' in out
        own = [f.name for f in dataclasses.fields(cls) if f.name in key_names(cls) and f.name not in ("id", "title",
                                                                                                      "test", "note")]
        block = out.split(f'claim keys of test = "{kind}":\n')[1].split("\nclaim keys of")[0]
        assert [ln.split()[0] for ln in block.splitlines() if ln.startswith("  ")] == own
    assert "  id " in out and "str = required" in out


@pytest.mark.parametrize("argv, command, words", [
    (["train", "--steps", "3"], "keel train",
     "unrecognized arguments: --steps 3; a config key is set with --set train.steps=VALUE"),
    (["train", "--d-model=64", "--lr", "1"], "keel train",
     "unrecognized arguments: --d-model=64 --lr 1; a config key is set with --set model.d_model=VALUE, "
     "--set train.lr=VALUE"),
    (["config", "--bogus"], "keel config", "unrecognized arguments: --bogus"),
    ([], "keel", "the following arguments are required: command"),
    (["bogus"], "keel", "argument command: invalid choice: 'bogus'"),
    (["gradflow", "--loop"], "keel gradflow", "argument --loop: expected one argument"),
    (["eval", "--run", "x", "--hf", "y"], "keel eval", "argument --hf: not allowed with argument --run"),
    (["study", "claims", "--workers", "abc"], "keel study", "argument --workers: invalid int value: 'abc'"),
])
def test_a_bad_flag_is_a_one_line_error(keel_main, argv, command, words):
    """A fresh-user trial: argparse printed its usage lines (the top-level ones for `keel train --steps 3`)
    before `keel: error:`; a bad flag is now one line like every other mistake, naming the command's --help,
    and an unknown flag that is a config key says how to set it."""
    r = keel_main(*argv)
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"keel: error: {words}") and lines[0].endswith(
        f"(see {command} --help)"), lines
