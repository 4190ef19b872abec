"""Help output of every ``keel`` command: defaults shown, no reST markup.

:class:`HelpFormatter` is argparse's formatter with two changes: an option's help ends with
``(default: X)`` when it has a default worth showing (not None, False or empty, and not
already mentioned in the help), as ``argparse.ArgumentDefaultsHelpFormatter`` does; and the
reST markup of docstrings used as descriptions (double backquotes, ``:func:`` roles) is
shown as plain single-quoted-in-backquotes text. :func:`apply_help_format` sets it on a
parser and all its sub-parsers.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import re
from pathlib import Path

_ROLE = re.compile(r":[a-z]+:`~?([^`]+)`")


def plain_text(text: str) -> str:
    """``text`` without reST markup: ``:func:`x``` and ````x```` become ```x```."""
    return _ROLE.sub(r"`\1`", text).replace("``", "`")


class HelpFormatter(argparse.HelpFormatter):
    """argparse's formatter, with defaults shown and reST markup removed (module docstring)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        shown = default not in (None, False, "", [], argparse.SUPPRESS)
        takes_value = action.option_strings or action.nargs in (argparse.OPTIONAL, argparse.ZERO_OR_MORE)
        if shown and takes_value and "default" not in text and "%(default)" not in text:
            text += " (default: %(default)s)"
        return text

    def _format_text(self, text: str) -> str:
        return super()._format_text(plain_text(text))

    def _expand_help(self, action: argparse.Action) -> str:
        return plain_text(super()._expand_help(action))


def apply_help_format(parser: argparse.ArgumentParser) -> None:
    """Use :class:`HelpFormatter` for ``parser`` and, recursively, its sub-commands."""
    parser.formatter_class = HelpFormatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                apply_help_format(sub)


def module_summary(name: str) -> str:
    """The first paragraph of the docstring of module ``name`` (e.g. ``"keel.experiments.sweep"``),
    read from its source without importing it: a command's ``--help`` shows its library module's
    summary while ``keel --help`` imports no torch."""
    source = Path(importlib.util.find_spec(name).origin).read_text(encoding="utf-8")
    return (ast.get_docstring(ast.parse(source)) or "").split("\n\n")[0]
