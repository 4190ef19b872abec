"""The ``keel`` commands, one module per group of commands (the list: ``keel.cli.COMMAND_GROUPS``).
A command is one place: its parser's flags (``_register_NAME`` or ``register``, which names the
handler) beside its handler (``cmd_NAME``). Building the parser must stay light (``keel --help``
loads no torch), so a module imports at its top only what its flags need and light modules
(the standard library, :mod:`keel.config`, :mod:`keel.errors`, :mod:`keel.io`); the library its
handlers call (torch, :mod:`keel.train`, :mod:`keel.experiments` ...) it imports in its
``import_library()``, which :func:`keel.cli.run_handler` calls before the handler. Shared here:
the flags and checks several commands take (:func:`add_loops_flag`, :func:`check_counts`,
:func:`check_seed`, :func:`check_loops`, :func:`check_folder_loops`).
"""

from keel.config import MAX_LOOPS_FACTOR, MAX_LOOPS_MIN, check_value, max_loops, max_loops_words  # noqa: F401 (max_loops: here too)
from keel.errors import KeelError


def add_loops_flag(p, what: str = "run") -> None:
    """``--loops R'``: run a looped model's core R' times instead of its trained ``model.loop_repeats``
    (test-time depth; ``keel eval``, ``generate``, ``ablate``, ``gradflow``). Checked by
    :func:`check_loops`."""
    p.add_argument("--loops", type=int, default=None, metavar="R",
                   help=f"a looped {what} (model.loop_core >= 1): apply its core R times per token instead of "
                        "model.loop_repeats (test-time depth; the weights and depth constants stay the trained ones); "
                        f"at most max({MAX_LOOPS_MIN}, {MAX_LOOPS_FACTOR} x model.loop_repeats)")


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
    an integer >= 1, for a looped model (``model_cfg.loop_core >= 1``, a :class:`keel.config.ModelConfig`), at
    most :func:`max_loops` of its ``loop_repeats``.

    Raises:
        KeelError: one line naming the flag and the problem.
    """
    if loops is None:
        return
    if loops < 1:
        raise KeelError(f"--loops must be >= 1, got {loops}")
    if not model_cfg.loop_core:
        raise KeelError(f"--loops needs a looped model (model.loop_core >= 1); {source} does not loop")
    if loops > (cap := max_loops(model_cfg.loop_repeats)):
        raise KeelError(f"--loops must be at most {cap} ({max_loops_words(model_cfg.loop_repeats)} for {source}), "
                        f"got {loops}: each token would apply the core {loops} times")


def check_folder_loops(loops: int, model_cfg, folder: str) -> None:
    """The loop count a Hugging Face folder's model runs at without ``--loops`` (``keel eval --hf``, ``keel
    ablate --hf``: its ``config.json``'s ``loops``, which :class:`keel.hf.KeelConfig` has checked is an int
    >= 1; ``model_cfg.loop_repeats`` when null) is at most :func:`max_loops` of its ``loop_repeats``, the cap
    ``--loops`` has (:func:`check_loops`): ``loops: 1000`` ran for hours where ``--loops 1000`` is refused.

    Raises:
        KeelError: one line naming config.json's loops and the cap.
    """
    if loops > (cap := max_loops(model_cfg.loop_repeats)):
        raise KeelError(f"config.json's loops = {loops} in {folder} is above {cap}, the cap of --loops "
                        f"({max_loops_words(model_cfg.loop_repeats)}): each token would apply the core {loops} times; "
                        f"give --loops R (R <= {cap}) to run another count")
