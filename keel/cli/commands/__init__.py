"""The ``keel`` commands' handlers, one module per group of commands (their flags are declared in
the modules of :mod:`keel.cli`). A handler module imports what its commands need (torch, the
library) at its top; :func:`keel.cli.main` imports only the module of the command that runs, so
that ``keel --help`` and every parser stay light. Shared here: the checks of flags several
commands take (:func:`check_counts`, :func:`check_seed`).
"""

from keel.config import check_value
from keel.errors import KeelError


def check_counts(args, *flags: str) -> None:
    """Each of ``flags`` (argparse dests, e.g. ``"batch_size"``) that was given is >= 1.

    Raises:
        KeelError: ``--flag must be >= 1, got N`` for the first that is not.
    """
    for flag in flags:
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise KeelError(f"--{flag.replace('_', '-')} must be >= 1, got {value}")


def check_seed(value: int, flag: str = "--seed") -> None:
    """``value`` is in ``train.seed``'s range (numpy's: 0 to 2**32 - 1): a seed outside it was an
    OverflowError traceback (above 2**64) or a seed keel train would refuse (below 0).

    Raises:
        KeelError: ``FLAG must be between 0 and 2**32 - 1 (numpy's seed range), got N``.
    """
    try:
        check_value("train.seed", value)
    except KeelError as e:
        raise KeelError(str(e).replace("train.seed", flag, 1)) from None


def check_loops(loops: int | None, model_cfg, source: str) -> None:
    """``--loops`` (None: not given) suits the model of ``source`` (a run or folder, as the user named it):
    an integer >= 1, for a looped model (``model_cfg.loop_core >= 1``, a :class:`keel.config.ModelConfig`).

    Raises:
        KeelError: one line naming the flag and the problem.
    """
    if loops is None:
        return
    if loops < 1:
        raise KeelError(f"--loops must be >= 1, got {loops}")
    if not model_cfg.loop_core:
        raise KeelError(f"--loops needs a looped model (model.loop_core >= 1); {source} does not loop")
