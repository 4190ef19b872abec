"""User-facing errors.

Anything a user can cause (a bad path, a bad config value, an empty corpus) raises
:class:`KeelError`. The command line catches it, prints one line ``keel: error: ...``
and exits with status 2, without a traceback. Programming errors keep their tracebacks.
"""


class KeelError(Exception):
    """A problem with the user's input (config, paths, data), reported in one line."""
