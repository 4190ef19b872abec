"""Wiring a training run: the trainer plus the callbacks its config asks for.

``keel train``, ``keel sweep`` and ``keel stress`` all train through :func:`train_run`, so a
run behaves the same whichever command started it. The trainer itself
(:func:`keel.train.train`) knows nothing of the diagnostics and evaluation layers; this is
the one place that connects them.
"""

from __future__ import annotations

from pathlib import Path

from keel.config import Config
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
    """:func:`keel.train.train` with :func:`run_callbacks` attached. Raises what it raises."""
    return train(cfg, run_dir, resume=resume, callbacks=run_callbacks(cfg), restart=restart)
