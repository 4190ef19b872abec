"""Experiment tracking: where the trainer's records go (``train.loggers``).

Every record the trainer writes to ``metrics.jsonl`` goes to every logger named in
``train.loggers`` (default ``["jsonl"]``), under the same names:

* ``"jsonl"`` -- ``RUN/metrics.jsonl`` (:class:`keel.train.metrics.JsonlSink`), always on.
* ``"tensorboard"`` -- ``RUN/tensorboard/`` event files (``torch.utils.tensorboard``'s
  ``SummaryWriter``; ``pip install -e .[tensorboard]``): one scalar per number, tag = the
  metrics.jsonl name (``loss``, ``val_loss``, ``lr``, ``grad_norm``, ``tokens_per_s`` ...),
  nested values joined with ``/`` (``eval_tasks/TASK/acc``, ``sublayer_grad_norm/3``),
  x-axis = ``step``; the resolved config as hyper-parameters (HPARAMS tab) and as TOML text.
* ``"wandb"`` -- a Weights & Biases run in ``RUN/wandb/`` (``pip install -e .[wandb]``),
  ``train.wandb_mode`` ``"offline"`` by default (``wandb sync RUN/wandb/offline-run-*``
  uploads it later), ``"online"`` to stream; the resolved config as the run's config; the
  run id is kept in ``RUN/wandb_id`` so a resumed run continues the same W&B run.

Only rank 0 logs (the trainer makes sinks on rank 0 only). Resume: TensorBoard events at or
after the first re-done step are purged (``purge_step``: the re-done steps replace them);
W&B cannot take steps back, so the steps it already has (``RUN/wandb_last_step``) are not
logged again. Either way every step appears once.
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

from keel.config import TrainConfig, choices
from keel.errors import KeelError
from keel.train.metrics import JsonlSink

LOGGERS = choices(TrainConfig, "loggers")  # declared once, in keel.config.TrainConfig
WANDB_MODES = choices(TrainConfig, "wandb_mode")


def flatten(record: dict, prefix: str = "") -> dict[str, float]:
    """The numbers of a metrics record as ``{name: float}``: nested dicts and lists joined
    with ``/`` (``{"eval_tasks": {"t": {"acc": 0.5}}}`` -> ``{"eval_tasks/t/acc": 0.5}``);
    booleans as 0/1; strings and None left out. ``step`` is kept (it is also the x-axis)."""
    out: dict[str, float] = {}
    items = record.items() if isinstance(record, dict) else enumerate(record)
    for key, value in items:
        name = f"{prefix}{key}"
        if isinstance(value, (dict, list, tuple)):
            out.update(flatten(value, name + "/"))
        elif isinstance(value, (bool, int, float)):
            out[name] = float(value)
    return out


def config_hparams(config: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """``{"section.key": value}`` of a config's ``to_dict()``; lists become comma-joined strings."""
    return {f"{s}.{k}": (",".join(map(str, v)) if isinstance(v, list) else v)
            for s, values in config.items() for k, v in values.items()}


def _require(module: str, extra: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise KeelError(f"train.loggers has {extra!r} but {module} is not installed: "
                        f"pip install -e .[{extra}]") from None


class TensorBoardSink:
    """Writes records as TensorBoard scalars into ``log_dir`` (see the module docstring).

    Args:
        log_dir: the event-file folder (``RUN/tensorboard``).
        config: the resolved config's ``to_dict()``, logged as hyper-parameters and text.
        resume_step: the checkpoint step a resumed run restarts after; events of later steps
            (from before an interruption) are purged. None for a new run.
    Raises:
        KeelError: tensorboard is not installed (names the extra).
    """

    def __init__(self, log_dir: str | Path, config: dict, resume_step: int | None = None):
        _require("tensorboard", "tensorboard")
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        purge = resume_step + 1 if resume_step is not None else None
        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge)
        hp = {k: v for k, v in config_hparams(config).items() if isinstance(v, (bool, int, float, str))}
        for summary in hparams(hp, {}):  # in this run's folder, not a sub-run as add_hparams makes
            self.writer.file_writer.add_summary(summary)
        import tomli_w

        self.writer.add_text("config", "```toml\n" + tomli_w.dumps(config) + "```", global_step=resume_step or 0)

    def write(self, record: dict) -> None:
        """One scalar per number of ``record`` at ``global_step = record["step"]``."""
        step = int(record.get("step", 0))
        for name, value in flatten(record).items():
            if name != "step":
                self.writer.add_scalar(name, value, global_step=step)

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """Logs records to a Weights & Biases run in ``run_dir/wandb`` (see the module docstring).

    Args:
        run_dir: the keel run directory (holds ``wandb/`` and ``wandb_id``).
        config: the resolved config's ``to_dict()`` (the W&B run config).
        mode: "offline" | "online" | "disabled".
        project: W&B project name.
    Raises:
        KeelError: wandb is not installed (names the extra), or an unknown mode.
    """

    def __init__(self, run_dir: str | Path, config: dict, mode: str = "offline", project: str = "keel"):
        if mode not in WANDB_MODES:
            raise KeelError(f"train.wandb_mode must be one of {', '.join(WANDB_MODES)}, got {mode!r}")
        wandb = _require("wandb", "wandb")
        run_dir = Path(run_dir)
        id_file = run_dir / "wandb_id"
        run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(4)
        if not id_file.is_file():
            from keel.io import atomic_write_text

            atomic_write_text(id_file, run_id + "\n")
        self.step_file = run_dir / "wandb_last_step"
        self.last_step = int(self.step_file.read_text()) if self.step_file.is_file() else -1
        self.run = wandb.init(project=project, dir=str(run_dir), id=run_id, resume="allow", mode=mode,
                              name=run_dir.name, config=config, settings=wandb.Settings(silent=True))
        self.run.define_metric("*", step_metric="step")

    def write(self, record: dict) -> bool:
        """Log the numbers of ``record``; a step not after the last one this W&B run has
        (``RUN/wandb_last_step``, kept across resumes) is skipped, except a resume's
        ``config_change`` record. Returns whether it was logged."""
        from keel.io import atomic_write_text

        step = int(record.get("step", 0))
        if step <= self.last_step and "config_change" not in record:  # a resume's config change is new
            return False
        self.run.log(flatten(record))
        self.last_step = max(step, self.last_step)
        atomic_write_text(self.step_file, f"{self.last_step}\n")
        return True

    def close(self) -> None:
        self.run.finish()


class Sinks:
    """Several sinks behind the one ``write(record)`` / ``close()`` interface."""

    def __init__(self, sinks: list):
        self.sinks = sinks

    def write(self, record: dict) -> None:
        for sink in self.sinks:
            sink.write(record)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def check_loggers(names) -> list[str]:
    """``train.loggers`` as a list of known names ("jsonl" first, added if missing).

    Raises:
        KeelError: an unknown name.
    """
    names = [n.strip() for n in (names.split(",") if isinstance(names, str) else names) if n.strip()]
    for n in names:
        if n not in LOGGERS:
            raise KeelError(f"unknown logger {n!r} in train.loggers (choose from {', '.join(LOGGERS)})")
    return ["jsonl"] + [n for n in dict.fromkeys(names) if n != "jsonl"]


def open_sinks(cfg, run_dir: str | Path, resume_step: int | None = None, history: list[dict] | None = None) -> Sinks:
    """The sinks ``cfg.train.loggers`` names, for run ``run_dir`` (call on rank 0 only).

    Args:
        cfg: the resolved :class:`keel.config.Config`.
        resume_step: the checkpoint step a resumed run restarts after (None for a new run).
    Raises:
        KeelError: unknown logger, or its optional package is not installed (names the extra).
    """
    run_dir = Path(run_dir)
    tc = cfg.train
    sinks: list = []
    for name in check_loggers(getattr(tc, "loggers", ["jsonl"])):
        if name == "jsonl":
            sinks.append(JsonlSink(run_dir / "metrics.jsonl"))
        elif name == "tensorboard":
            sinks.append(TensorBoardSink(run_dir / "tensorboard", cfg.to_dict(), resume_step))
        else:
            sinks.append(WandbSink(run_dir, cfg.to_dict(), getattr(tc, "wandb_mode", "offline"),
                                   getattr(tc, "wandb_project", "keel")))
    return Sinks(sinks)
