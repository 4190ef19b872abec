"""A run directory as an object: :class:`Run` (``keel.load_run(path)``).

Every command that takes ``--run`` reads the run through this one class: its resolved
config, its metrics (one reader), its checkpoints, its tokenizer, its dataset folder and
its trained model. The layout of a run directory is :class:`keel.rundir.RunDir`'s
(``Run(path).dir``).
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path

import torch
from tokenizers import Tokenizer

from keel.config import Config, load_config
from keel.data import check_tokenizer_matches, resolve_data
from keel.errors import KeelError
from keel.model import Transformer
from keel.rundir import RunDir
from keel.train.checkpoint import CheckpointManager
from keel.train.device import resolve_device
from keel.train.metrics import read_metrics


class Run:
    """A finished or running training run in ``path``.

    Args:
        path: the run directory (it must hold ``config.toml``).
    Raises:
        KeelError: ``path`` is not a run directory.

    >>> run = Run("runs/demo")                     # doctest: +SKIP
    >>> model = run.load_model(device="cpu")       # latest checkpoint, eval mode
    >>> run.metrics()[-1]["val_loss"]              # nats/token
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.dir = RunDir(self.path)  # the run folder's files
        self.checkpoint_manager = CheckpointManager(self.path)  # its checkpoints (reading; a run writes its own)
        if not self.dir.config.is_file():
            raise KeelError(f"not a run directory (no {RunDir.CONFIG}): {self.path}")

    def __repr__(self) -> str:
        return f"Run({str(self.path)!r})"

    @cached_property
    def config(self) -> Config:
        """The resolved config the run was trained with (``config.toml``)."""
        return load_config(self.dir.config, stored=True)

    @property
    def metrics_path(self) -> Path:
        """``RUN/metrics.jsonl`` (:attr:`RunDir.metrics`)."""
        return self.dir.metrics

    def metrics(self) -> list[dict]:
        """The records of ``metrics.jsonl`` ([] before the first one; see :mod:`keel.train.metrics`)."""
        return read_metrics(self.metrics_path)

    def checkpoints(self) -> list[Path]:
        """Complete checkpoint folders, oldest first."""
        return self.checkpoint_manager.complete()

    def saved_step(self) -> int | None:
        """The step of the newest checkpoint that has its files (:meth:`checkpoints`; not verified against
        its checksums, which reads every byte: :meth:`latest_checkpoint` does), or None without one: the
        step a resume continues from. A run whose metrics reached ``train.steps`` but whose final checkpoint
        is missing (its write failed) is not finished: ``keel train --resume`` trains from this step."""
        steps = self.checkpoint_manager.steps()
        return steps[-1] if steps else None

    def latest_checkpoint(self) -> Path | None:
        """The newest intact checkpoint folder, or None
        (:meth:`keel.train.checkpoint.CheckpointManager.latest`): normally the one
        ``checkpoints/latest`` names; when that one is missing or damaged, the newest older intact
        one, with a warning per checkpoint skipped."""
        return self.checkpoint_manager.latest()

    def checkpoint_progress(self, checkpoint: str | Path | None = None) -> tuple[int, int] | None:
        """``(step, tokens)`` of ``checkpoint``'s trainer state (default: the latest checkpoint's;
        tokens trained, as the metrics count them), or None without a checkpoint or with an
        unreadable trainer state."""
        ckpt = Path(checkpoint) if checkpoint else self.latest_checkpoint()
        try:
            state = self.checkpoint_manager.load_trainer_state(ckpt) if ckpt is not None else None
        except KeelError:
            return None
        return (int(state.get("step", 0)), int(state.get("tokens", 0))) if state is not None else None

    def tokenizer(self):
        """The run's ``tokenizers.Tokenizer`` (``tokenizer.json``). Raises KeelError if missing."""
        path = self.dir.tokenizer
        if not path.is_file():
            raise KeelError(f"run {self.path} has no {RunDir.TOKENIZER}")
        return Tokenizer.from_file(str(path))

    def data_dir(self) -> Path:
        """The prepared dataset the run was trained on (``data.path``, or the cached dataset
        of ``data.source`` + ``data.tokenizer``, prepared again if the cache was removed).
        Raises KeelError if it cannot be found or prepared, or if it was prepared with another
        tokenizer than the run's own ``tokenizer.json`` (:func:`keel.data.check_tokenizer_matches`: e.g.
        ``keel prepare --out`` over the folder since), whose ids would mean other text to the model."""
        data = resolve_data(self.config, progress=False)
        if self.dir.tokenizer.is_file():
            check_tokenizer_matches(self.tokenizer(), data, whose=f"run {self.path}'s",
                                    fix="prepare the run's dataset again")
        return data

    def no_checkpoint_error(self) -> KeelError:
        """The error of a run without a checkpoint to load: none yet, or none intact (what is wrong with each)."""
        _, damaged = self.checkpoint_manager.find_intact()
        return KeelError(f"run {self.path} has no intact checkpoint ({'; '.join(damaged)})" if damaged
                         else f"run {self.path} has no checkpoint yet")

    def load_model(self, device: str | torch.device = "cpu", checkpoint: str | Path | None = None):
        """The trained :class:`keel.model.Transformer`, in eval mode on ``device``.

        Args:
            device: "auto" | "cpu" | "cuda[:N]" or a torch.device.
            checkpoint: a checkpoint folder (default: the latest).
        Raises:
            KeelError: no checkpoint yet, none intact (the message says what is wrong with each), or
                weights that do not match the config.
        """
        ckpt = Path(checkpoint) if checkpoint else self.latest_checkpoint()
        if ckpt is None:
            raise self.no_checkpoint_error()
        dev = device if isinstance(device, torch.device) else resolve_device(device, key="--device")
        model = Transformer(self.config.model)
        self.checkpoint_manager.load_weights(model, ckpt)
        return model.to(dev).eval()


def load_run(path: str | Path) -> Run:
    """``Run(path)``: the public way to open a run from Python."""
    return Run(path)
