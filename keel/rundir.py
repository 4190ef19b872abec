"""The layout of a run folder: :class:`RunDir`, the one place that names its files.

A run folder (``keel train --run-dir RUN``, or one job's folder in a grid) holds::

    RUN/config.toml     the resolved config (every key, after --set): keel writes it first
    RUN/metrics.jsonl   one JSON object per optimiser step (keel.train.metrics)
    RUN/checkpoints/    atomic checkpoints (keel.train.checkpoint)
    RUN/tokenizer.json  the dataset's tokenizer
    RUN/loss.png        train and validation loss against tokens
    RUN/sample.txt      a sample from the final model (train.sample_tokens > 0)
    RUN/.keel.lock      the lock of the process writing the run (keel.io.RunLock)
    RUN/tensorboard/    TensorBoard event files (train.loggers with "tensorboard")
    RUN/wandb/          W&B's own folder (train.loggers with "wandb"; W&B names it)
    RUN/wandb_id        the W&B run id, kept across resumes
    RUN/job.json        a grid job: the job as launched (keel.experiments.grid)
    RUN/run.log         a grid job: everything the task logged
    RUN/result.json     a grid job: its result; its presence means "finished"

Every other module takes these names from here (``RunDir(path).metrics``, ``RunDir.CONFIG``);
``tests/test_rundir.py`` fails on a run-folder file name spelled anywhere else in ``keel/``.
Names *inside* ``checkpoints/`` (``step_NNNNNNNN``, ``latest``, a checkpoint's files) have one
owner of their own, :mod:`keel.train.checkpoint` (``step_name``, ``LATEST``).

This module sits in layer 0 (beside :mod:`keel.io`, which reads the layout to refuse foreign
folders): it imports nothing of keel's, so every layer may use it. Reading a run's config,
metrics and model is :class:`keel.run.Run`'s (layer 2), over a :class:`RunDir`.
"""

from __future__ import annotations

import os
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib


class RunDir:
    """The files of the run folder ``path`` (which need not exist yet): one path property each.

    Args:
        path: the run folder.

    Nothing is read or checked at construction; :meth:`is_run` says whether keel wrote a run
    there. The class attributes are the bare names (for messages and listings).

    >>> RunDir("runs/demo").metrics
    PosixPath('runs/demo/metrics.jsonl')
    """

    CONFIG = "config.toml"
    METRICS = "metrics.jsonl"
    CHECKPOINTS = "checkpoints"
    TOKENIZER = "tokenizer.json"
    LOSS_PLOT = "loss.png"
    SAMPLE = "sample.txt"
    LOCK = ".keel.lock"
    TENSORBOARD = "tensorboard"
    WANDB = "wandb"
    WANDB_ID = "wandb_id"
    JOB = "job.json"
    LOG = "run.log"
    RESULT = "result.json"

    #: what a training run writes (folders end in "/"), in the order of the layout above
    TRAINING_FILES = (CONFIG, METRICS, CHECKPOINTS + "/", TOKENIZER, LOSS_PLOT, SAMPLE, LOCK,
                      TENSORBOARD + "/", WANDB + "/", WANDB_ID)
    #: what a grid writes into a job's run folder around the training run
    GRID_FILES = (JOB, LOG, RESULT)
    #: what keel itself may find in a run folder it did not yet write a run into: its lock file and
    #: a grid job's job.json / run.log (the grid writes them before the run starts)
    SETUP_FILES = frozenset({LOCK, JOB, LOG})

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    @property
    def config(self) -> Path:
        """``RUN/config.toml``: the resolved config (:func:`keel.config.load_config` with ``stored=True``)."""
        return self.path / self.CONFIG

    @property
    def metrics(self) -> Path:
        """``RUN/metrics.jsonl`` (:func:`keel.train.metrics.read_metrics`)."""
        return self.path / self.METRICS

    @property
    def checkpoints(self) -> Path:
        """``RUN/checkpoints/`` (its contents: :mod:`keel.train.checkpoint`)."""
        return self.path / self.CHECKPOINTS

    @property
    def tokenizer(self) -> Path:
        """``RUN/tokenizer.json``: the dataset's tokenizer, copied at the start."""
        return self.path / self.TOKENIZER

    @property
    def loss_plot(self) -> Path:
        """``RUN/loss.png``: train and validation loss against tokens."""
        return self.path / self.LOSS_PLOT

    @property
    def sample(self) -> Path:
        """``RUN/sample.txt``: a sample from the final model."""
        return self.path / self.SAMPLE

    @property
    def lock(self) -> Path:
        """``RUN/.keel.lock``: :class:`keel.io.RunLock`'s file (its pid)."""
        return self.path / self.LOCK

    @property
    def tensorboard(self) -> Path:
        """``RUN/tensorboard/``: TensorBoard's event files."""
        return self.path / self.TENSORBOARD

    @property
    def wandb(self) -> Path:
        """``RUN/wandb/``: the folder W&B writes under ``dir=RUN``."""
        return self.path / self.WANDB

    @property
    def wandb_id(self) -> Path:
        """``RUN/wandb_id``: the W&B run id (one line), kept across resumes."""
        return self.path / self.WANDB_ID

    @property
    def job(self) -> Path:
        """``RUN/job.json``: a grid job as launched."""
        return self.path / self.JOB

    @property
    def log(self) -> Path:
        """``RUN/run.log``: what a grid job logged."""
        return self.path / self.LOG

    @property
    def result(self) -> Path:
        """``RUN/result.json``: a grid job's result (its presence: finished)."""
        return self.path / self.RESULT

    def is_run(self) -> bool:
        """Whether ``RUN/config.toml`` is a config keel wrote (a TOML file with a ``[model]`` table);
        False when it is missing, unreadable or not such a file (never raises)."""
        try:
            with open(self.config, "rb") as f:
                return isinstance(tomllib.load(f).get("model"), dict)
        except (OSError, ValueError):  # missing, unreadable, not TOML (tomllib.TOMLDecodeError is a ValueError)
            return False
