"""``keel config`` (presets and every config key): its flags beside its handler
(:mod:`keel.cli.commands`). It imports no torch (``keel config`` stays as fast as ``keel --help``),
except for ``--schemes``, whose list lives in the model layer.

Usage::

    keel config                    # presets, sweep presets, every key: type, default, meaning
    keel config --show paper-64    # the resolved preset, as TOML
    keel config --schemes          # the residual schemes (values of model.residual) and their papers
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import re
import textwrap
from pathlib import Path

import tomli_w

from keel.errors import KeelError
from keel.config import describe_config, load_config, preset_names, resolve_config_path
from keel.rundir import RunDir


def _value(v) -> str:
    return "unset" if v is None else json.dumps(v)


def scheme_summary(doc: str) -> list[str]:
    """The lines ``keel config --schemes`` shows for one scheme: its docstring's first prose
    paragraph(s), up to and including the first formula block (a paragraph after one ending in
    ``::``; at most 3 paragraphs), reST roles and ``cfg.`` names written as config keys."""
    paras = [p.rstrip() for p in inspect.cleandoc(doc or "").split("\n\n")]
    ends = [p.endswith("::") for p in paras]
    n = 2 if ends[0] else (3 if len(paras) > 2 and ends[1] else 1)  # prose, up to its formula block
    out: list[str] = []
    for i, para in enumerate(paras[:n]):
        if i and ends[i - 1]:  # a literal block: keep its lines
            out += para.splitlines()
            continue
        text = " ".join(para.split()).replace("``", "").removesuffix("::").removesuffix(":")
        out += textwrap.wrap(re.sub(r":(?:class|func|data|meth):`([^`]+)`", r"\1", text) + (":" * ends[i]), 96)
    return [re.sub(r"\bcfg\.(\w+)", r"model.\1", x) for x in out]


def print_schemes() -> None:
    """Print every name of :data:`keel.model.residual.SCHEMES` with :func:`scheme_summary` of
    its class docstring (the scheme's paper, equation and config keys)."""
    # the one list of schemes lives in the torch-importing model layer; only this flag pays for it
    schemes = importlib.import_module("keel.model.residual").SCHEMES
    for name, cls in schemes.items():
        print(f"  {name}")
        for line in scheme_summary(cls.__doc__):
            print(f"      {line}")


def _print_study_keys() -> None:
    """Print every key of a study file's tables (:func:`keel.experiments.study.claims.load.describe_study_keys`):
    a group's, every claim's, then each claim kind's own."""
    # the study engine lives above the config layer; only this flag pays for importing it
    keys = importlib.import_module("keel.experiments.study.claims.load").describe_study_keys()
    heads = {"group": "study group keys ([groups.NAME]; sized per scale in [scales.S.groups.NAME]):",
             "claim": "claim keys, every kind ([[claims]]):"}
    width = max(len(k["key"]) for rows in keys.values() for k in rows)
    print("a study file: description, base (a config preset or file), [verdict] (min_effect, min_seeds, "
          "floor_from_spread), [groups.NAME], [[claims]], [scales.S] (note, set: config keys of every run, groups); "
          "each group also takes set (config keys of its runs), a grid group grid = { KEY = [values] }, best_over "
          "and match_params (as keel sweep's flags). Shipped examples: keel/configs/studies/.")
    for name, rows in keys.items():
        print(heads.get(name, f"claim keys of test = \"{name}\":"))
        for k in rows:
            rule = f"  (must be {k['rule']})" if k["rule"] else ""
            default = "required" if k["default"] is None else _value(k["default"])
            print(f"  {k['key'].ljust(width)}  {k['type']} = {default}  {k['help']}{rule}")


def _not_a_run_folder(folder: Path) -> str:
    """Why ``keel config --show FOLDER`` cannot show a folder without a ``config.toml``."""
    held = next((f"a {kind} folder: each of its runs is a run folder inside it (`keel runs {folder}` lists them)"
                 for marker, kind in (("sweep.json", "sweep"), ("study.json", "study"), ("grid.json", "grid"))
                 if (folder / marker).is_file()), "not a run folder (no config.toml)")
    return f"--show {folder}: {held}; --show takes a preset, a TOML file or a run folder"


def register(subparsers) -> None:
    """Add ``config`` to the ``keel`` sub-parsers."""
    pc = subparsers.add_parser("config", help="list presets and every config key; show a resolved preset",
                               description="Without --show: the shipped presets (keel train --config NAME), the "
                                           "sweep presets (keel sweep --preset NAME) and every config key with its "
                                           "type, default, meaning and allowed values or range (set any with "
                                           "--set SECTION.KEY=VALUE). "
                                           "With --show: the resolved preset, config file or run folder's config, as TOML. "
                                           "With --schemes: every residual scheme and its paper. "
                                           "With --study-keys: every key of a study file's groups and claims.")
    what = pc.add_mutually_exclusive_group()
    what.add_argument("--show", default=None, metavar="PRESET",
                      help="a preset name, TOML file or run folder to print resolved")
    what.add_argument("--schemes", action="store_true",
                    help="list the residual schemes (the values of model.residual) with their papers")
    what.add_argument("--study-keys", action="store_true",
                      help="list the keys of a study file (keel study FILE): a group's and each kind of claim's")
    pc.set_defaults(handler=cmd_config)


def cmd_config(args: argparse.Namespace) -> int:
    if args.study_keys:
        _print_study_keys()
        return 0
    if args.schemes:
        print("residual schemes (keel train --set model.residual=NAME):")
        print_schemes()
        return 0
    if args.show:
        if args.show in preset_names("sweeps") and args.show not in preset_names():
            print(resolve_config_path(args.show, kind="sweeps").read_text(), end="")
            return 0
        run_config = RunDir(args.show).config  # a run folder: the config it was trained with
        if Path(args.show).is_dir() and not run_config.is_file():
            raise KeelError(_not_a_run_folder(Path(args.show)))
        cfg = load_config(run_config, stored=True) if run_config.is_file() else load_config(resolve_config_path(args.show))
        print(tomli_w.dumps(cfg.to_dict()), end="")
        return 0
    print(f"presets (keel train --config NAME): {', '.join(preset_names())}")
    print(f"sweep presets (keel sweep --preset NAME): {', '.join(preset_names('sweeps'))}")
    print("keys (keel train --set SECTION.KEY=VALUE):")
    keys = describe_config()
    width = max(len(k["key"]) for k in keys)
    for k in keys:
        rule = f"  (must be {k['rule']})" if k["rule"] else ""
        print(f"  {k['key'].ljust(width)}  {k['type']} = {_value(k['default'])}  {k['help']}{rule}")
    return 0
