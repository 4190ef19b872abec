"""Wiring a training run: the trainer plus the callbacks its config asks for.

:func:`train_run` (also ``keel.train_run``) is THE public entry point for training from
Python: it honours the whole config, as ``keel train`` does. ``keel train``, ``keel sweep``
and ``keel stress`` all train through it, so a run behaves the same whichever command (or
script) started it. The trainer itself (:func:`keel.train.train`) knows nothing of the
diagnostics and evaluation layers (it refuses a config that needs them without their
callbacks); this is the one place that connects them.
"""

from __future__ import annotations

from pathlib import Path

from keel.config import Config, checked_copy
from keel.diagnostics.callbacks import DivergenceCallback, GradflowCallback
from keel.eval.tasks import TaskEvalCallback
from keel.train import Callback, TrainResult, train


def run_callbacks(cfg: Config) -> list[Callback]:
    """The callbacks ``cfg.train`` asks for: the divergence monitor
    (``divergence_warnings`` / ``stop_on_divergence``, against ``divergence_reference``), gradient-flow logging
    (``gradflow_every``) and lm-eval tasks (``eval_tasks``, ``eval_tasks_every``)."""
    tc = cfg.train
    out: list[Callback] = []
    if tc.stop_on_divergence or tc.divergence_warnings:
        out.append(DivergenceCallback(tc.divergence_reference, stop=tc.stop_on_divergence))
    if tc.gradflow_every:
        out.append(GradflowCallback(tc.gradflow_every))
    tasks = [t.strip() for t in tc.eval_tasks.split(",") if t.strip()]
    if tasks and tc.eval_tasks_every:
        out.append(TaskEvalCallback(tasks, tc.eval_tasks_every, tc.eval_tasks_limit))
    return out


def train_run(cfg: Config, run_dir: str | Path, resume: bool = False, restart: bool = False) -> TrainResult:
    """Train ``cfg`` into ``run_dir`` (or continue it) exactly as ``keel train`` does:
    :func:`keel.train.train` with :func:`run_callbacks` attached, so every key of ``cfg``
    (``train.stop_on_divergence``, ``gradflow_every``, ``eval_tasks``, ...) takes effect.

    Args:
        cfg: the run's config (not modified; the run's ``config.toml`` holds the resolved one).
        run_dir: the run directory; ``resume`` / ``restart`` as :func:`keel.train.train`. ``resume=True``
            continues the run in ``run_dir`` from its newest checkpoint, or starts it when the folder holds
            no run yet (what a grid's ``--resume`` needs for its runs not yet started; one INFO line says
            so). ``keel train --resume DIR`` is stricter: it refuses a DIR without a run's config.toml.
    Returns:
        :class:`keel.train.TrainResult` (losses in nats/token).
    Raises:
        KeelError: as :func:`keel.train.train` (``TrainingStopped`` on a divergence verdict
            with ``train.stop_on_divergence``).
    """
    cfg = checked_copy(cfg)  # before the callbacks read it
    return train(cfg, run_dir, resume=resume, callbacks=run_callbacks(cfg), restart=restart)
