"""The ``keel`` commands' handlers, one module per group of commands (their flags are declared in
the modules of :mod:`keel.cli`). A handler module imports what its commands need (torch, the
library) at its top; :func:`keel.cli.main` imports only the module of the command that runs, so
that ``keel --help`` and every parser stay light.
"""
