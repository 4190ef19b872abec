"""The handler of ``keel runs``, an overview of run folders (its flags: :mod:`keel.cli.info`).

Usage::

    keel runs [DIR] [--json]       # one line per run folder under DIR (default: runs)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from keel.experiments.overview import format_table, runs_overview


def cmd_runs(args: argparse.Namespace) -> int:
    rows = runs_overview(args.dir)
    if args.json:
        print(json.dumps(rows, indent=1))
    elif not rows:
        print(f"no runs under {args.dir}")
    else:
        print(format_table(rows, Path(args.dir)))
    return 0
