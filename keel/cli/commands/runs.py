"""``keel runs``, an overview of run folders: its flags beside its handler (:mod:`keel.cli.commands`).

Usage::

    keel runs [DIR] [--json]       # one line per run folder under DIR (default: runs)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def import_library() -> None:
    """The library the handler below calls, imported into this module (:mod:`keel.cli.commands`)."""
    global format_table, runs_overview
    # torch and the library (seconds of import), imported when one of these commands runs, not when the
    # parser is built: `keel --help` loads no torch
    from keel.experiments.overview import format_table, runs_overview


def register(subparsers) -> None:
    """Add ``runs`` to the ``keel`` sub-parsers."""
    pr = subparsers.add_parser("runs", help="overview of run folders: scheme, depth, step, val loss, status",
                               description="One line per run folder at or under DIR: scheme, blocks/sub-layers, "
                                           "parameters, step, tokens, last validation loss (nats/token), mean "
                                           "tokens/s and status (finished, running, stopped, diverged with its mode, new).")
    pr.add_argument("dir", nargs="?", default="runs", help="folder holding runs (or one run)")
    pr.add_argument("--json", action="store_true", help="print a JSON list instead of the table")
    pr.set_defaults(handler=cmd_runs)


def cmd_runs(args: argparse.Namespace) -> int:
    rows = runs_overview(args.dir)
    if args.json:
        print(json.dumps(rows, indent=1))
    elif not rows:
        print(f"no runs under {args.dir}")
    else:
        print(format_table(rows, Path(args.dir)))
    return 0
