"""The resume policy: what a resumed run may change in its config, and how it says so.

A resume compares the config it is given with the one the checkpoint was trained with.
Each key declares what a resume does with a changed value (``on_resume`` in its
:func:`keel.keys.key`, :func:`keel.config.on_resume`): keys that would make the continuation
another run are refused in one line; every other change is applied from the resumed step,
logged as a warning and recorded (the trainer writes a ``config_change`` record into
metrics.jsonl); for the schedule's keys the next step's LR is reported too. ``train.steps``
may not go below the step the run reached. Which checkpoint a resume continues from:
:func:`checkpoint_to_resume`.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

from keel.config import Config, config_from_dict, load_config, on_resume
from keel.data import absolute_data_paths
from keel.errors import KeelError
from keel.keys import current_key
from keel.rundir import RunDir
from keel.train.checkpoint import CheckpointManager
from keel.train.metrics import read_metrics
from keel.train.optim import lr_at

log = logging.getLogger(__name__)


def has_history(checkpoints: CheckpointManager) -> bool:
    """Whether the run of ``checkpoints`` went past step 0: a checkpoint folder or a metrics record of step >= 1."""
    if checkpoints.has_folders():
        return True
    return any(r.get("step", 0) >= 1 for r in read_metrics(RunDir(checkpoints.run_dir).metrics))


def checkpoint_to_resume(checkpoints: CheckpointManager) -> str | None:
    """The newest intact checkpoint of a run (:meth:`keel.train.checkpoint.CheckpointManager.find_intact`),
    as a string, or None for a run that has none and no history; each newer damaged one is
    skipped with a warning saying why.

    Raises:
        KeelError: the run has history but no intact checkpoint.
    """
    run_dir = checkpoints.run_dir
    ckpt, reasons = checkpoints.find_intact()
    for reason in reasons:
        log.warning("skipping %s", reason)
    if ckpt is None and has_history(checkpoints):
        raise KeelError(f"cannot resume {run_dir}: it has history but no intact checkpoint"
                        f" ({'; '.join(reasons) or 'no checkpoint was saved'}); pass --restart to train it "
                        "again from step 0 (its metrics and checkpoints are deleted)")
    if ckpt is not None and reasons:
        log.warning("resuming from %s, the newest intact checkpoint", ckpt.name)
    return str(ckpt) if ckpt is not None else None


def _flat(d: dict) -> dict:
    """``{"section.key": value}`` of a nested config dict, renamed keys under their current names."""
    return {current_key(f"{s}.{k}"): v for s, keys in d.items() for k, v in keys.items()}


_WHERE = ("data.path", "data.cache_dir")  # where the dataset lies; the other data keys say how it is made


def config_changes(old: dict, new: Config) -> dict[str, dict]:
    """``{"section.key": {"old": a, "new": b}}`` for every key that differs between the saved
    config dict ``old`` (as :meth:`Config.to_dict` gives; missing keys take their defaults)
    and ``new``. Local data paths are compared absolute (:func:`keel.data.absolute_data_paths`, as
    the trainer stores them; a run from before that stored them as given, relative to the folder
    it was started from). With ``data.path`` on both sides the keys that say how a dataset is made
    (``data.source``, ``data.tokenizer``, ...) are not compared: neither side read them (the run
    stores the dataset's own, :func:`keel.data.prepared_from`; an older one stored the defaults),
    and the data loader's state checks that the tokens are the same."""
    before = _flat(_anchored(Config().to_dict()))
    before.update(_flat(_anchored(old)))
    after = _flat(_anchored(new.to_dict()))
    given = before.get("data.path") and after.get("data.path")  # how it was made: its meta's (older runs: defaults)
    return {k: {"old": before.get(k), "new": after.get(k)} for k in sorted(set(before) | set(after))
            if before.get(k) != after.get(k) and not (given and k.startswith("data.") and k not in _WHERE)}


def _anchored(config: dict) -> dict:
    """``config`` with its ``[data]`` section's local paths absolute."""
    return {**config, "data": absolute_data_paths(config["data"])} if isinstance(config.get("data"), dict) else config


def refused_changes(changes: dict[str, dict]) -> list[str]:
    """The keys of ``changes`` a resume refuses (declared ``on_resume="refuse"``)."""
    return [k for k in changes if on_resume(k) == "refuse"]


def saved_config(state: dict, run_dir: Path, cfg: Config) -> dict:
    """The config the checkpoint was trained with (saved in it; older checkpoints: the
    run's config.toml; else ``cfg``)."""
    if "config" in state:
        return state["config"]
    path = RunDir(run_dir).config
    return load_config(path, stored=True).to_dict() if path.is_file() else cfg.to_dict()


def check_refused_before_data(state: dict, cfg: Config, run_dir: Path) -> None:
    """:func:`check_config_changes`'s refusal, run before the dataset is prepared (a refused
    ``data.*`` change then costs no tokenizer training, and is named rather than the
    ``model.vocab_size`` it would upset). ``model.vocab_size = "auto"`` is left to the full check:
    it is resolved from the dataset. Raises KeelError: a refused key changed."""
    skip = ("model.vocab_size",) if cfg.model.vocab_size == "auto" else ()
    _refuse({k: c for k, c in config_changes(saved_config(state, run_dir, cfg), cfg).items() if k not in skip}, run_dir)


def _refuse(changes: dict[str, dict], run_dir: Path) -> None:
    """Raise KeelError (one line) naming the first key of ``changes`` a resume refuses, if any."""
    refused = refused_changes(changes)
    if refused:
        k = refused[0]
        path = changes.get("data.path", {})
        why = (f" (data.path {path['new']} was prepared otherwise than the data this run was made with; a run "
               "imported with keel import-hf takes its data.path there: --set data.path=...)"
               if not path.get("old") and path.get("new") and any(x.startswith("data.") for x in refused) else "")
        raise KeelError(f"cannot resume {run_dir} with {k} = {changes[k]['new']!r} (it was "
                        f"{changes[k]['old']!r}): changing {', '.join(refused)} would make it another run{why}; "
                        "start a new run instead")


def check_config_changes(state: dict, cfg: Config, run_dir: Path) -> dict[str, dict]:
    """Compare ``cfg`` with the config of the checkpoint state ``state``: refuse the keys
    declared ``on_resume="refuse"`` and a ``train.steps`` below the checkpoint's step (one-line
    KeelError), apply the others, logging each as a warning (and, for schedule keys, how the
    next step's LR changes). A resume with nothing left to train (the checkpoint is at
    ``train.steps``) logs nothing here: it applies nothing, and the trainer says so.

    Returns:
        The changes, as :func:`config_changes` gives them.
    Raises:
        KeelError: a refused key changed, or ``train.steps`` is below the step the run reached.
    """
    old = saved_config(state, run_dir, cfg)
    changes = config_changes(old, cfg)
    _refuse(changes, run_dir)
    if cfg.train.steps < state["step"]:  # "step 10/5": a run cannot be cut back to fewer steps than it trained
        raise KeelError(f"cannot resume {run_dir}: train.steps={cfg.train.steps} is below the step this run reached "
                        f"({state['step']}); give train.steps >= {state['step']}")
    if state["step"] >= cfg.train.steps:
        return changes
    for key, c in changes.items():
        log.warning("resume: %s changed from %r to %r (applied from step %d)", key, c["old"], c["new"], state["step"])
    if any(on_resume(k) == "schedule" for k in changes):
        try:
            was = lr_at(state["step"], config_from_dict(old, stored=True).train)
        except KeelError:  # the old config no longer validates: nothing to compare with
            return changes
        now = lr_at(state["step"], cfg.train)
        if not math.isclose(was, now, rel_tol=1e-9):
            log.warning("resume: the learning rate of step %d changes from %.4g to %.4g (train.schedule = %r; "
                        "see keel.train.optim)", state["step"] + 1, was, now, cfg.train.schedule)
    return changes
