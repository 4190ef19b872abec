"""``metrics.jsonl``: one JSON object per line, one reader and one writer for the whole project.

Records (see :mod:`keel.train.trainer`): ``step`` (optimiser steps done; 0 = the freshly
initialised model), ``tokens``, ``loss``, ``lr``, ``grad_norm``, ``tokens_per_s``,
``elapsed_s``; ``skipped: true`` on a step whose update was skipped (not finite); with
``train.precision = "fp16-autocast"`` also ``loss_scale`` (the scale of the step's backward,
dimensionless) and ``skipped_steps`` (updates skipped since it trains in fp16, carried over a resume;
:mod:`keel.train.loss_scaling`); ``val_loss``/``val_ppl`` on evaluation steps; fields added by callbacks
(``divergence``, ``sublayer_grad_norm``, ``eval_tasks``). A resume that changed config
keys writes ``{"step": k, "config_change": {"section.key": {"old": a, "new": b}}}`` (no
``loss``) at the step it resumed from. Files are strict JSON: a non-finite number (NaN,
±inf: a blown-up loss) is written as ``null``. A kill during a write can leave a partial
last line: :func:`read_metrics` drops it with a warning, and a resumed run rewrites the
file up to its checkpoint's step (:func:`truncate_metrics`).
"""

from __future__ import annotations

import json
import logging
import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from keel.errors import KeelError
from keel.io import atomic_write_text, check_regular_file

log = logging.getLogger(__name__)

# Fields that hold a number; null in the file means "not finite" (read back as NaN).
NUMERIC_FIELDS = frozenset({"loss", "lr", "grad_norm", "tokens_per_s", "elapsed_s", "val_loss", "val_ppl",
                            "loss_scale"})


def _strict(value: Any) -> Any:
    """``value`` with every non-finite float replaced by None (JSON null), recursively."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(v) for v in value]
    return value


def read_metrics(path: str | Path) -> list[dict]:
    """The records of a ``metrics.jsonl`` file, in order ([] if the file does not exist).

    A last line that is not valid JSON (a write cut short by a kill) is dropped with a
    warning; an invalid line anywhere else is an error. A ``null`` in a numeric field
    (:data:`NUMERIC_FIELDS`: a non-finite value when it was written) is read back as
    ``float("nan")``, so every reader can do arithmetic on the records.

    Raises:
        KeelError: a corrupt line before the last one; a record of the wrong shape
            (:func:`_check_record`); ``path`` is not a regular file (a FIFO, a device).
    """
    path = Path(path)
    if not path.exists():
        return []
    check_regular_file(path, "metrics file")  # reading a FIFO would wait forever
    lines = [ln for ln in path.read_text(encoding="utf-8", errors="replace").splitlines() if ln.strip()]
    records = []
    for i, line in enumerate(lines):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                log.warning("%s: dropping a partial last line (a write was interrupted)", path)
                break
            raise KeelError(f"{path}: line {i + 1} is not valid JSON") from None
        _check_record(path, i + 1, record)
        records.append({k: (math.nan if v is None and k in NUMERIC_FIELDS else v) for k, v in record.items()})
    return records


def _check_record(path: Path, line: int, record) -> None:
    """Raise KeelError naming the line of a ``metrics.jsonl`` record of the wrong shape: not a
    JSON object (``5``), a ``step`` that is not a non-negative integer, a numeric field
    (:data:`NUMERIC_FIELDS`) that is not a number or null (these were ``AttributeError`` /
    ``TypeError`` tracebacks in ``keel train --resume``, ``keel runs`` and ``keel plot``)."""
    if not isinstance(record, dict):
        raise KeelError(f"{path}: line {line} is not a JSON object (one record per line), got {record!r}")
    step = record.get("step", 0)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise KeelError(f"{path}: line {line}: step must be a non-negative integer, got {step!r}")
    bad = [k for k in NUMERIC_FIELDS if k in record and record[k] is not None
           and (isinstance(record[k], bool) or not isinstance(record[k], (int, float)))]
    if bad:
        raise KeelError(f"{path}: line {line}: {bad[0]} must be a number or null, got {record[bad[0]]!r}")


def truncate_metrics(path: str | Path, keep_through_step: int) -> list[dict]:
    """Rewrite ``path`` (atomically) keeping only records with ``step <= keep_through_step``,
    dropping a torn last line and any ``config_change`` record at ``keep_through_step`` (an earlier
    resume's from that checkpoint: the resume that cuts the file compares and records its own);
    returns the records kept. A resumed run re-logs the rest."""
    records = [r for r in read_metrics(path) if r.get("step", 0) < keep_through_step
               or (r.get("step", 0) == keep_through_step and "config_change" not in r)]
    if Path(path).exists():
        atomic_write_text(path, "".join(json.dumps(_strict(r), allow_nan=False) + "\n" for r in records))
    return records


class JsonlSink:
    """Appends records to ``metrics.jsonl`` (strict JSON, non-finite numbers as null)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def write(self, record: dict) -> None:
        """Append one record as one line."""
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(_strict(record), allow_nan=False) + "\n")

    def close(self) -> None:
        """Nothing to release (each write opens and closes the file)."""


def untimed_tokens(records: Sequence[dict], tokens: int = 0, elapsed_s: float = 0.0) -> int:
    """Tokens a run had trained before keel timed its first step: 0 for a run trained from
    scratch; the count imported with ``keel import-hf`` (a checkpoint with tokens but no training
    time). Read from the first step record of ``records`` (only its own step was timed, so
    ``tokens - tokens_per_s * elapsed_s`` is what came before); without one, from the trainer
    state: ``tokens`` if nothing was timed yet (``elapsed_s == 0``), else 0."""
    first = next((r for r in records if r.get("elapsed_s") and r.get("tokens_per_s") and "tokens" in r), None)
    if first is None:
        return tokens if elapsed_s <= 0 else 0
    return max(0, round(first["tokens"] - first["tokens_per_s"] * first["elapsed_s"]))


def mean_tokens_per_s(tokens: int, elapsed_s: float, untimed: int = 0) -> float | None:
    """Mean training throughput: the tokens trained on keel's clock (``tokens - untimed``, see
    :func:`untimed_tokens`) per second of it (``elapsed_s``, training steps only); None before
    the first timed step."""
    return (tokens - untimed) / elapsed_s if elapsed_s and elapsed_s > 0 else None


def trailing_mean(values: Sequence[float], window: int) -> list[float]:
    """The mean of each value and the ``window - 1`` before it (fewer at the start), one per value;
    ``window <= 1``: the values unchanged. E.g. a smoothed training-loss curve (nats/token)."""
    if window <= 1:
        return list(values)
    return [statistics.fmean(values[max(0, i - window + 1):i + 1]) for i in range(len(values))]
