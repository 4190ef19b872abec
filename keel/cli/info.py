"""The flags of ``keel config`` (presets and every config key) and ``keel runs`` (an overview of run
folders); handlers: :mod:`keel.cli.handlers.config` and :mod:`keel.cli.handlers.runs`.

Usage::

    keel config                    # presets, sweep presets, every key: type, default, meaning
    keel config --show paper-64    # the resolved preset, as TOML
    keel config --schemes          # the residual schemes (values of model.residual)
    keel runs [DIR] [--json]       # one line per run folder under DIR (default: runs)
"""

from __future__ import annotations


def register(subparsers) -> None:
    """Add ``config`` and ``runs`` to the ``keel`` sub-parsers."""
    pc = subparsers.add_parser("config", help="list presets and every config key; show a resolved preset",
                               description="Without --show: the shipped presets (keel train --config NAME), the "
                                           "sweep presets (keel sweep --preset NAME) and every config key with its "
                                           "type, default, meaning and allowed values or range (set any with "
                                           "--set SECTION.KEY=VALUE). "
                                           "With --show: the resolved preset, config file or run folder's config, as TOML. "
                                           "With --schemes: every residual scheme and its paper.")
    what = pc.add_mutually_exclusive_group()
    what.add_argument("--show", default=None, metavar="PRESET",
                      help="a preset name, TOML file or run folder to print resolved")
    what.add_argument("--schemes", action="store_true",
                    help="list the residual schemes (the values of model.residual) with their papers")
    pc.set_defaults(handler="keel.cli.handlers.config.cmd_config")

    pr = subparsers.add_parser("runs", help="overview of run folders: scheme, depth, step, val loss, status",
                               description="One line per run folder at or under DIR: scheme, blocks/sub-layers, "
                                           "parameters, step, tokens, last validation loss (nats/token), mean "
                                           "tokens/s and status (finished, running, stopped, diverged, new).")
    pr.add_argument("dir", nargs="?", default="runs", help="folder holding runs (or one run)")
    pr.add_argument("--json", action="store_true", help="print a JSON list instead of the table")
    pr.set_defaults(handler="keel.cli.handlers.runs.cmd_runs")
