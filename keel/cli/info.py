"""``keel config`` (presets and every config key) and ``keel runs`` (an overview of run folders).

Usage::

    keel config                    # presets, sweep presets, every key: type, default, meaning
    keel config --show paper-64    # the resolved preset, as TOML
    keel runs [DIR] [--json]       # one line per run folder under DIR (default: runs)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def register(subparsers) -> None:
    """Add ``config`` and ``runs`` to the ``keel`` sub-parsers."""
    pc = subparsers.add_parser("config", help="list presets and every config key; show a resolved preset",
                               description="Without --show: the shipped presets (keel train --config NAME), the "
                                           "sweep presets (keel sweep --preset NAME) and every config key with its "
                                           "type, default, meaning and allowed values or range (set any with "
                                           "--set SECTION.KEY=VALUE). "
                                           "With --show: the resolved preset or config file, as TOML.")
    pc.add_argument("--show", default=None, metavar="PRESET", help="a preset name or TOML file to print resolved")
    pc.set_defaults(func=cmd_config)

    pr = subparsers.add_parser("runs", help="overview of run folders: scheme, depth, step, val loss, status",
                               description="One line per run folder at or under DIR: scheme, blocks/sub-layers, "
                                           "parameters, step, tokens, last validation loss (nats/token), mean "
                                           "tokens/s and status (finished, running, stopped, diverged, new).")
    pr.add_argument("dir", nargs="?", default="runs", help="folder holding runs (or one run)")
    pr.add_argument("--json", action="store_true", help="print a JSON list instead of the table")
    pr.set_defaults(func=cmd_runs)


def _value(v) -> str:
    return "unset" if v is None else json.dumps(v)


def cmd_config(args: argparse.Namespace) -> int:
    import tomli_w

    from keel.config import describe_config, load_config, preset_names, resolve_config_path

    if args.show:
        if args.show in preset_names("sweeps") and args.show not in preset_names():
            print(resolve_config_path(args.show, kind="sweeps").read_text(), end="")
            return 0
        print(tomli_w.dumps(load_config(resolve_config_path(args.show)).to_dict()), end="")
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


def cmd_runs(args: argparse.Namespace) -> int:
    from keel.experiments.overview import format_table, runs_overview

    rows = runs_overview(args.dir)
    if args.json:
        print(json.dumps(rows, indent=1))
    elif not rows:
        print(f"no runs under {args.dir}")
    else:
        print(format_table(rows, Path(args.dir)))
    return 0
