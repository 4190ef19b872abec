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
after the first re-done step are purged (``purge_step``: the re-done steps replace them).
W&B cannot take steps back, and a step passed to ``run.log()`` is not on disk until W&B's
service has written it (a ``kill -9`` in between loses it), so a resumed W&B sink reads what
W&B actually holds -- its own transaction logs, ``RUN/wandb/*-ID/run-ID.wandb``
(:func:`wandb_history`) -- logs every record of ``metrics.jsonl`` it lacks, and skips the
steps it has. Either way every step of ``metrics.jsonl`` appears once (for a step re-done
after a crash, W&B keeps the first attempt's timings, ``tokens_per_s`` and ``elapsed_s``).
"""

from __future__ import annotations

import importlib
import json
import secrets
import struct
from pathlib import Path
from typing import Any

import tomli_w

from keel.config import TrainConfig, check_value
from keel.keys import choices
from keel.errors import KeelError
from keel.io import atomic_write_text
from keel.rundir import RunDir
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
        from torch.utils.tensorboard import SummaryWriter  # optional extra [tensorboard]; ~1 s to import
        from torch.utils.tensorboard.summary import hparams

        purge = resume_step + 1 if resume_step is not None else None
        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge)
        hp = {k: v for k, v in config_hparams(config).items() if isinstance(v, (bool, int, float, str))}
        for summary in hparams(hp, {}):  # in this run's folder, not a sub-run as add_hparams makes
            self.writer.file_writer.add_summary(summary)

        self.writer.add_text("config", "```toml\n" + tomli_w.dumps(config) + "```", global_step=resume_step or 0)

    def write(self, record: dict) -> None:
        """One scalar per number of ``record`` at ``global_step = record["step"]``."""
        step = int(record.get("step", 0))
        for name, value in flatten(record).items():
            if name != "step":
                self.writer.add_scalar(name, value, global_step=step)

    def close(self) -> None:
        self.writer.close()


# W&B's transaction log (the .wandb file `wandb sync` uploads): a 7-byte header (":W&B",
# 0xBEE1, version), then LevelDB-log records in 32 KiB blocks -- a 7-byte header (crc32,
# length, type: 1 full, 2 first, 3 middle, 4 last) and a piece of a serialized
# wandb_internal_pb2.Record (W&B's own protobuf schema, used to parse it).
_WANDB_BLOCK, _WANDB_MAGIC = 32768, (b":W&B", 0xBEE1)


def _wandb_records(path: Path):
    """The raw records of one ``.wandb`` file, in order; stops at a torn or unreadable tail."""
    data = path.read_bytes()
    if len(data) < 7 or struct.unpack("<4sHB", data[:7])[:2] != _WANDB_MAGIC:
        return
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        left = _WANDB_BLOCK - pos % _WANDB_BLOCK
        if left < 7:  # the rest of a block too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk = data[pos + 7:pos + 7 + length]
        if kind not in (1, 2, 3, 4) or len(chunk) < length:
            return
        pos += 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            yield pending


def wandb_history(wandb_dir: str | Path, run_id: str) -> list[dict[str, Any]]:
    """The history rows W&B holds for run ``run_id`` under ``wandb_dir`` (``RUN/wandb``):
    every ``*/run-{run_id}.wandb`` transaction log (one per session, offline or online),
    oldest first, read with W&B's protobuf schema. Each row is ``{name: value}``
    as logged (plus W&B's ``_step``, ``_runtime``, ``_timestamp``). Empty when wandb is not
    installed or nothing was written."""
    try:
        from wandb.proto import wandb_internal_pb2 as pb  # optional extra [wandb]
    except ImportError:
        return []
    from google.protobuf.message import DecodeError  # installed with wandb (optional extra [wandb])

    rows = []
    # one folder per session: [offline-]run-<time>-<id>, with "-1", "-2" ... added when two
    # sessions start within the same second; latest-run is a link to one of them
    logs = [p for p in Path(wandb_dir).glob(f"*/run-{run_id}.wandb") if not p.parent.is_symlink()]
    for path in sorted(logs, key=lambda p: p.parent.name.partition("run-")[2]):
        for raw in _wandb_records(path):
            record = pb.Record()
            try:
                record.ParseFromString(raw)
            except DecodeError:
                break
            if record.WhichOneof("record_type") == "history":
                rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in record.history.item})
    return rows


def _wandb_key(row: dict) -> tuple[int, bool]:
    """What makes a row unique: its ``step`` and whether it is a resume's config change."""
    return int(row.get("step", 0)), any(k.startswith("config_change/") for k in row)


class WandbSink:
    """Logs records to a Weights & Biases run in ``run_dir/wandb`` (see the module docstring).

    Args:
        run_dir: the keel run directory (holds ``wandb/`` and ``wandb_id``).
        config: the resolved config's ``to_dict()`` (the W&B run config).
        mode: "offline" | "online" | "disabled".
        project: W&B project name.
        history: the run's ``metrics.jsonl`` records so far (a resumed run's, up to its
            checkpoint): those W&B does not hold (:func:`wandb_history`) are logged at once.
    Raises:
        KeelError: wandb is not installed (names the extra), or an unknown mode.
    """

    def __init__(self, run_dir: str | Path, config: dict, mode: str = "offline", project: str = "keel",
                 history: list[dict] | None = None):
        check_value("train.wandb_mode", mode)
        wandb = _require("wandb", "wandb")
        run_dir = Path(run_dir)
        id_file = RunDir(run_dir).wandb_id
        run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(4)
        if not id_file.is_file():
            atomic_write_text(id_file, run_id + "\n")
        self.run = wandb.init(project=project, dir=str(run_dir), id=run_id, resume="allow", mode=mode,
                              name=run_dir.name, config=config, settings=wandb.Settings(silent=True))
        # read after init: an earlier session's service may still be closing its log (finish()
        # returns first); this session's own log holds no history row yet
        self.held = {_wandb_key(row) for row in wandb_history(RunDir(run_dir).wandb, run_id)}
        self.run.define_metric("*", step_metric="step")
        for record in history or []:
            self.write(record)

    def write(self, record: dict) -> bool:
        """Log the numbers of ``record`` unless W&B holds that step already (from before a
        resume; a resume's ``config_change`` record counts apart). Returns whether it was logged."""
        row = flatten(record)
        key = _wandb_key(row)
        if key in self.held or set(row) <= {"step"}:  # held already, or no number to log
            return False
        self.run.log(row)
        self.held.add(key)
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
        KeelError: a name outside train.loggers' declared values (keel.config.TrainConfig).
    """
    names = [n.strip() for n in (names.split(",") if isinstance(names, str) else names) if n.strip()]
    check_value("train.loggers", names)
    return ["jsonl"] + [n for n in dict.fromkeys(names) if n != "jsonl"]


def open_sinks(cfg, run_dir: str | Path, resume_step: int | None = None, history: list[dict] | None = None) -> Sinks:
    """The sinks ``cfg.train.loggers`` names, for run ``run_dir`` (call on rank 0 only).

    Args:
        cfg: the resolved :class:`keel.config.Config`.
        resume_step: the checkpoint step a resumed run restarts after (None for a new run).
        history: the records ``metrics.jsonl`` holds already (see :class:`WandbSink`).
    Raises:
        KeelError: unknown logger, or its optional package is not installed (names the extra).
    """
    run_dir = Path(run_dir)
    tc = cfg.train
    sinks: list = []
    for name in check_loggers(getattr(tc, "loggers", ["jsonl"])):
        if name == "jsonl":
            sinks.append(JsonlSink(RunDir(run_dir).metrics))
        elif name == "tensorboard":
            sinks.append(TensorBoardSink(RunDir(run_dir).tensorboard, cfg.to_dict(), resume_step))
        else:
            sinks.append(WandbSink(run_dir, cfg.to_dict(), getattr(tc, "wandb_mode", "offline"),
                                   getattr(tc, "wandb_project", "keel"), history=history))
    return Sinks(sinks)
