"""User-facing errors.

Anything a user can cause (a bad path, a bad config value, an empty corpus) raises
:class:`KeelError`. The command line catches it, prints one line ``keel: error: ...``
and exits with status 2, without a traceback. Programming errors keep their tracebacks.
"""


class KeelError(Exception):
    """A problem with the user's input (config, paths, data), reported in one line."""


class Interrupted(KeelError):
    """Work stopped on purpose by SIGINT (Ctrl-C) or SIGTERM, after saving what it could; the
    message says how to continue. ``exit_code`` is 128 + the signal number (130, 143), the
    shell's convention for a process ended by a signal; the command line exits with it."""

    def __init__(self, msg: str, signum: int):
        super().__init__(msg)
        self.exit_code = 128 + int(signum)
        self.signum = int(signum)

    def __reduce__(self):  # pickles with both arguments: a grid worker returns it to the grid process
        return type(self), (str(self), self.signum)


def plural(n: int, noun: str) -> str:
    """A count with its noun for messages and titles: ``plural(1, "block")`` is ``"1 block"``,
    ``plural(2, "block")`` is ``"2 blocks"`` (regular English plurals only)."""
    return f"{n} {noun}{'s' * (n != 1)}"
