"""Hooks into the training loop, so that the loop never imports the layers built on it.

The trainer (:mod:`keel.train.trainer`) calls every :class:`Callback` it was given at four
points; a callback returns the fields it wants added to the step's ``metrics.jsonl`` record
(or None). The divergence monitor (``keel.diagnostics.divergence``), gradient-flow logging
(``keel.diagnostics.gradflow``) and lm-eval tasks (``keel.eval.tasks``) are callbacks; the
layer that wires a run (``keel.experiments.training``) passes them in.

Some ``train`` keys are implemented only by such callbacks (:data:`CALLBACK_KEYS`); a
callback names the keys it implements in :attr:`Callback.config_keys`, and
:func:`keel.train.train` refuses a config asking for one that no given callback implements
(:func:`unhonoured_keys`), rather than ignoring it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from keel.config import Config, TrainConfig
from keel.keys import callback_test
from keel.train.dist import DistInfo


@dataclass
class StepState:
    """What a callback sees at one optimiser step (read it; set only ``stop``).

    ``step`` counts optimiser steps done (1-based once the step is applied), ``tokens`` the
    tokens seen over all ranks, ``loss`` the mean training loss of the step (nats/token),
    ``lr`` the learning rate it used, ``grad_norm`` the L2 norm before clipping (None in
    :meth:`Callback.on_gradients`, which runs before clipping). ``finite`` is False for a
    step whose update was skipped (non-finite loss or gradient). ``model`` is the model
    being trained (the plain module; FSDP-sharded in place under FSDP); ``plain_model()``
    returns an unsharded copy on rank 0 and None on other ranks (collective under FSDP:
    call it on every rank). Setting ``stop`` to a reason ends the run after this step's
    record is written (:class:`keel.train.trainer.TrainingStopped` carries the reason).
    ``data_dir`` is the run's prepared dataset.
    """

    cfg: Config
    run_dir: Path
    dist: DistInfo
    model: torch.nn.Module
    tokenizer: Any
    plain_model: Callable[[], torch.nn.Module | None]
    step: int = 0
    tokens: int = 0
    loss: float = float("nan")
    lr: float = 0.0
    grad_norm: float | None = None
    finite: bool = True
    history: list[dict] = field(default_factory=list)
    data_dir: Path | None = None
    stop: str | None = None


class Callback:
    """Base class: every hook does nothing. Override the ones you need.

    Every rank calls every hook with the same inputs (so collective operations inside a
    hook are allowed, and verdicts agree across ranks); only rank 0's returned fields are
    written. ``config_keys`` names the keys of :data:`CALLBACK_KEYS` the callback implements.
    """

    config_keys: tuple[str, ...] = ()

    def on_train_start(self, state: StepState) -> None:
        """Before the first step of this process; ``state.history`` holds the records
        already in ``metrics.jsonl`` up to ``state.step`` (a resumed run's past)."""

    def on_gradients(self, state: StepState) -> dict | None:
        """After the backward pass of a step, before clipping and the optimiser update
        (gradients are in ``p.grad``); ``state.step`` is the step about to be applied."""
        return None

    def on_step_end(self, state: StepState) -> dict | None:
        """After the update (or the skipped update) of step ``state.step``."""
        return None

    def on_train_end(self, state: StepState) -> dict | None:
        """After the last step of the run (``state.step == train.steps``), before the final
        sample; the fields returned are written as one more ``metrics.jsonl`` record of step
        ``state.step``. Not called when the run stops early or is interrupted (it resumes)."""
        return None


# The train keys only a callback implements, each with the test of whether the config asks
# for it, as their declarations give them (``key(..., callback=...)`` in keel.config); the wiring
# layer (keel.experiments.training.run_callbacks) attaches the callbacks.
CALLBACK_KEYS: dict[str, Callable[[TrainConfig], bool]] = {
    f"train.{f.name}": callback_test(TrainConfig, f.name)
    for f in dataclasses.fields(TrainConfig) if callback_test(TrainConfig, f.name)}


def unhonoured_keys(cfg: Config, callbacks: Sequence[Callback]) -> list[str]:
    """The keys of :data:`CALLBACK_KEYS` that ``cfg`` asks for but no callback of ``callbacks``
    implements (names its ``config_keys``); [] when the run can honour its whole config."""
    honoured = {key for cb in callbacks for key in cb.config_keys}
    return [key for key, asks in CALLBACK_KEYS.items() if asks(cfg.train) and key not in honoured]
