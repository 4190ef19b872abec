"""The ``keel`` command line. Every command's argparse code and handler lives in this package;
handlers are thin: they check flags, call library functions with plain arguments and print.

A command is one place: its flags and its handler side by side in one module of
:mod:`keel.cli.commands` (one per group of commands, each with ``register(subparsers)``; the
handler is ``cmd_NAME``), and :data:`COMMAND_GROUPS` lists the modules, in the order of
``keel --help``:

* :mod:`keel.cli.commands.train` -- ``prepare``, ``train``, ``generate``;
* :mod:`keel.cli.commands.scoring` -- ``eval``;
* :mod:`keel.cli.commands.hf` -- ``export-hf``, ``import-hf``;
* :mod:`keel.cli.commands.science` -- ``gradflow``, ``stress``, ``lr-sensitivity``, ``sweep``, ``plot``,
  ``ablate``, ``study``;
* :mod:`keel.cli.commands.config` -- ``config``;
* :mod:`keel.cli.commands.runs` -- ``runs``.

Every ``--help`` shows the defaults and no reST markup (:mod:`keel.cli.formatting`).

A user mistake (bad flag, bad path, bad config value, too little data) prints one line
``keel: error: ...`` on stderr and exits with status 2; no traceback (a bad flag: :class:`Parser`).
An argument that is not UTF-8 text (a path named with byte 0xff; ``--prompt`` aside) is such a
mistake: keel records paths and values in UTF-8 files. A training run stopped
by SIGINT / SIGTERM / SIGHUP (after writing its checkpoint) prints one line ``keel: stopped by ...``
saying how to resume and exits with 130 / 143 / 129; outside a training loop each signal unwinds (temporary files and
a new, still empty run folder are removed) and prints ``keel: stopped by SIGNAL``; once the command has
finished, a Ctrl-C during the interpreter's exit ends the process at once (no traceback), and SIGUSR1 / SIGUSR2
(Slurm's time-limit warnings) are ignored: they no longer turn a finished command's status into 138 / 140.
Library code reports progress through the standard ``logging`` module (loggers under ``keel``); :func:`main`
sends those records to stderr as plain lines. A command module imports at its top only what
its flags need; the library its handlers call (torch ...) it imports in its ``import_library()``,
which :func:`run_handler` calls for the chosen command only, so that ``keel --help`` stays fast
and loads no torch.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import signal
import sys
import threading

from keel import __version__
from keel.cli.commands import config, hf, runs, science, scoring, train
from keel.cli.formatting import apply_help_format
from keel.errors import Interrupted, KeelError

COMMAND_GROUPS = (train, scoring, hf, science, config, runs)  # the modules of every command, in `keel --help`'s order


class Parser(argparse.ArgumentParser):
    """argparse's parser with the one-line user error of every other keel mistake: a bad flag prints
    ``keel: error: MESSAGE (keel COMMAND --help)`` on stderr and exits with status 2 (argparse printed its
    usage lines first). An unknown ``--NAME`` that is a config key adds how to set it (``--set SECTION.NAME=``).
    Sub-command parsers are of this class too (``add_subparsers`` makes its parsers as its parent's class)."""

    def error(self, message: str):
        self.exit(2, f"keel: error: {message}{_config_key_hint(message)} (see {self.prog} --help)\n")


def _config_key_hint(message: str) -> str:
    """``; a config key is set with --set train.steps=VALUE`` for each ``--steps`` in an argparse
    ``message`` (unrecognized arguments) that names a config key; else ''."""
    if not message.startswith("unrecognized arguments:"):
        return ""
    import dataclasses  # lazily, with keel.config: only a bad flag needs them

    from keel.config import _SECTIONS  # lazily: `keel --help` stays light

    names = {f.name: sec for sec, cls in _SECTIONS.items() for f in dataclasses.fields(cls)}
    keys = [f"{names[n]}.{n}" for a in message.split(":", 1)[1].split() if a.startswith("--")
            and (n := a[2:].split("=", 1)[0].replace("-", "_")) in names]
    return f"; a config key is set with {', '.join(f'--set {k}=VALUE' for k in keys)}" if keys else ""


def build_parser() -> argparse.ArgumentParser:
    """The ``keel`` parser with every sub-command."""
    p = Parser(prog="keel", description="Keel and its baselines: prepare data, train, sample, diagnose, compare.")
    p.add_argument("--version", action="version", version=f"keel {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    for group in COMMAND_GROUPS:
        group.register(sub)
    apply_help_format(p)
    return p


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``parser.parse_args(argv)``, but arguments no parser knows are the chosen command's error (``keel train
    --steps 3``: ``(see keel train --help)``, where argparse's top-level parser named ``keel --help``)."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        sub.choices[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    return args


class _StderrHandler(logging.StreamHandler):
    """A StreamHandler that writes to whatever ``sys.stderr`` is when a record is emitted (as
    :data:`logging.lastResort` does), so a redirected or captured stderr gets the lines too."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def setup_logging(level: int = logging.INFO) -> None:
    """Send the ``keel`` loggers' records to stderr as plain lines (once per process)."""
    logger = logging.getLogger("keel")
    logger.setLevel(level)
    if not any(getattr(h, "_keel_cli", False) for h in logger.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        handler._keel_cli = True
        logger.addHandler(handler)


def run_handler(args: argparse.Namespace) -> int:
    """Call the handler that the command's parser set as ``args.handler`` and return its exit status;
    first its module's ``import_library()``, where it has one: a command module imports torch and
    the library there (~5 s on a busy 2-core machine), not at its top, which keeps building the
    parser (`keel --help`) at ~0.2 s without torch (tests/test_cli_info.py)."""
    import_library = getattr(sys.modules[args.handler.__module__], "import_library", None)
    if import_library is not None:
        import_library()
    return args.handler(args)


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP outside a training loop (which checkpoints on its own): unwinds like
    Ctrl-C, so ``finally`` blocks and context managers clean up (temporary files, a new run's
    folder). ``signum``: the signal."""

    signum = signal.SIGTERM


def _terminated(signum, frame) -> None:
    from keel.io import silence_hung_up_terminal  # lazily, as in main: `keel --help` imports no keel.io

    silence_hung_up_terminal(signum)  # SIGHUP: a closed terminal, whose writes would fail
    _received.append(signum)  # kept: a library's bare `except:` may swallow the exception raised here
    err = Terminated()
    err.signum = signum
    raise err


# Stopped outside a training loop, these unwind (Terminated) instead of killing the process at once:
# SIGTERM (kill) and SIGHUP (a closed terminal or SSH session). SIGINT raises KeyboardInterrupt itself.
_UNWINDING_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
_received: list[int] = []  # the unwinding signals this process got while a command ran (:func:`_terminated`)


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()  # signal handlers: main thread only


_TEXT_FLAGS = ("--prompt",)  # text keel reads as text (invalid UTF-8 -> U+FFFD) and records nowhere


def _not_utf8(argv: list[str]) -> str | None:
    """The first argument of ``argv`` that is not UTF-8 text (bytes the OS passed that Python kept as
    surrogates, e.g. a path named with byte 0xff), as its bytes' repr; None when all are (the values of
    :data:`_TEXT_FLAGS` aside). A run folder or value of that kind could not be recorded in config.toml
    / JSON (UTF-8): refused before any work, rather than trained and then not resumable."""
    text_value = False
    for a in argv:
        skip, text_value = text_value, a in _TEXT_FLAGS
        if skip or a.startswith(tuple(f + "=" for f in _TEXT_FLAGS)):
            continue
        try:
            a.encode("utf-8")
        except UnicodeEncodeError:
            return repr(os.fsencode(a))
    return None


def _os_error_status(e: OSError) -> int:
    """The exit status of a command that an OSError ended, its one line printed: a limit (``ulimit -n``),
    a file name too long, or the standard output on a full or read-only disk (2; the output is then
    closed). Raises ``e`` again for any other OSError (a bug, with its traceback)."""
    from keel.io import limit_failure, write_failure  # lazily: keel.io at the top would be imported by `keel --help`

    if (limit := limit_failure(e)) is not None:  # `ulimit -n 5`: the dataset's memmap, a checkpoint, ...
        where = f" ({e.filename})" if e.filename else ""
        raise_it = "; raise it (e.g. ulimit -n 4096) and run it again" if e.errno == errno.EMFILE else ""
        print(f"keel: error: {limit}{where}{raise_it}", file=sys.stderr)
        return 2
    if e.errno == errno.ENAMETOOLONG:  # a path no command checked first (keel.io.check_path_names)
        print(f"keel: error: a file name is too long for the file system: {str(e.filename)[:120]}...",
              file=sys.stderr)
        return 2
    if write_failure(e) is None:
        raise e
    print(f"keel: error: cannot write {e.filename or 'the standard output'}: {e.strerror}", file=sys.stderr)
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing more to flush at exit
    return 2


def main(argv: list[str] | None = None) -> int:
    """Run ``keel ARGS``; returns the exit status (2 for a user error, 130 / 143 / 129 when stopped
    by SIGINT / SIGTERM / SIGHUP). ``argv`` None (the process's command line, ``sys.argv``): the
    command is all the process does, so once it has finished SIGINT takes its default action (the
    process ends at once, status 128 + 2, no traceback from an exit handler it interrupted), and SIGUSR1 / SIGUSR2
    are ignored (the command's status stands)."""
    setup_logging()  # first: parsing may log (a deprecated flag)
    args = parse_args(build_parser(), argv)
    args.cli_argv = [str(a) for a in (sys.argv[1:] if argv is None else argv)]  # the command line reports record
    if (bad := _not_utf8(args.cli_argv)) is not None:
        print(f"keel: error: the argument {bad} is not UTF-8 text; keel records its paths and values in UTF-8 "
              "files (config.toml, JSON): rename the path, or give the value in UTF-8", file=sys.stderr)
        return 2
    saved = {s: signal.signal(s, _terminated) for s in _UNWINDING_SIGNALS} if _main_thread() else {}
    _received.clear()
    try:
        status = run_handler(args)
        sys.stdout.flush()  # `keel ... > FILE` on a full disk fails here, if not before
        if _received:  # the Terminated it raised was caught and dropped by a library (lm_eval's imports): the
            # command went on to its end, but a script that sent SIGTERM must not read success
            signum = _received[0]
            print(f"keel: stopped by {signal.Signals(signum).name} (a library caught the signal and went on: "
                  "the output above is complete)", file=sys.stderr)
            return 128 + signum
        return status
    except Interrupted as e:  # stopped on purpose (Ctrl-C, kill): not an error; 130 / 143
        print(f"keel: {e}", file=sys.stderr)
        return e.exit_code
    except KeelError as e:
        print(f"keel: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM before a training loop took over the signals
        signum = getattr(e, "signum", signal.SIGINT)
        print(f"keel: stopped by {signal.Signals(signum).name}", file=sys.stderr)
        return 128 + signum
    except BrokenPipeError:  # `keel ... | head`: the reader left; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except OSError as e:  # the standard output on a full or read-only disk (files are written by disk_errors)
        return _os_error_status(e)
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)
        if argv is None and _main_thread():  # the process's own command line: only the interpreter's exit is left
            # (atexit callbacks: torch's, transformers', seconds of them): a Ctrl-C now ends the process at once,
            # as SIGTERM does, not with a KeyboardInterrupt traceback from whichever callback it interrupted
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            for s in (signal.SIGUSR1, signal.SIGUSR2):  # Slurm's time-limit warnings: nothing is left to save, and
                signal.signal(s, signal.SIG_IGN)        # their default action (exit 138 / 140) would fail a finished job


if __name__ == "__main__":
    sys.exit(main())
