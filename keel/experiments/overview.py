"""An overview of run folders (``keel runs [DIR]``): one row per run, from :class:`keel.run.Run`.

Columns: run, scheme, blocks / sub-layers, parameters, step (of train.steps), tokens, last
validation loss (nats/token), mean tokens/s, status, divergence mode. Status:

* ``diverged`` -- the divergence classifier gave a verdict other than healthy (a run "counts as
  diverged" in any of the Keel paper's three modes, Sec. 5.1; the row's ``mode`` names it:
  ``stagnation``, ``instability`` or ``degradation``, and the table shows ``diverged (MODE)``), the last
  loss / validation loss is not finite (null in metrics.jsonl), or the last ``train.max_bad_steps``
  steps were all skipped as non-finite (the trainer stopped the run there);
* ``finished`` -- the last logged step is ``train.steps`` and so is the newest checkpoint's
  (:meth:`keel.run.Run.saved_step`; a run whose final checkpoint is missing, e.g. its write failed, is
  ``stopped``: ``keel train --resume`` trains it from its newest checkpoint);
* ``running`` -- a process holds the run's lock (:func:`keel.io.lock_holder`: a ``keel train``
  of it is alive, however long its steps take);
* ``stopped`` -- none of these (interrupted or killed; ``keel train --resume`` continues it);
* ``new`` -- no metrics yet.

A run without metrics but with a checkpoint past step 0 (``keel import-hf`` writes one) shows the
step and tokens of its checkpoint, and its status as if that were its last record.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

from keel.errors import KeelError
from keel.io import lock_holder
from keel.model import count_parameters
from keel.run import Run
from keel.rundir import RunDir
from keel.train.metrics import mean_tokens_per_s, untimed_tokens

log = logging.getLogger(__name__)

COLUMNS = ("run", "scheme", "blocks", "sublayers", "params", "step", "steps", "tokens", "val_loss", "tokens_per_s",
           "status", "mode")


def _not_finite(value) -> bool:
    return value is None or (isinstance(value, float) and not math.isfinite(value))


def run_status(records: list[dict], steps: int, held: bool, saved: int | None = None,
               max_bad_steps: int | None = None) -> str:
    """``new`` / ``diverged`` / ``finished`` / ``running`` / ``stopped`` (see the module
    docstring) of a run with metrics ``records`` and ``train.steps = steps``; ``held``: a process
    holds the run's lock; ``saved``: the step of its newest checkpoint (None: not known, taken as the
    last logged step); ``max_bad_steps``: its ``train.max_bad_steps`` (None: not checked)."""
    if not records:
        return "running" if held else "new"
    last = records[-1]
    if divergence_mode(records) is not None:
        return "diverged"
    if ("loss" in last and _not_finite(last["loss"])) or ("val_loss" in last and _not_finite(last["val_loss"])):
        return "diverged"
    if max_bad_steps and not held and _skipped_in_a_row(records) >= max_bad_steps:  # the trainer's stop rule
        return "diverged"
    if last.get("step", 0) >= steps and (saved is None or saved >= steps):
        return "finished"
    return "running" if held else "stopped"


def divergence_mode(records: list[dict]) -> str | None:
    """The mode of the first divergence verdict other than healthy in ``records`` (metrics.jsonl's
    ``divergence`` objects: ``stagnation``, ``instability`` or ``degradation``), None without one."""
    modes = [r["divergence"].get("mode") for r in records if isinstance(r.get("divergence"), dict)]
    return next((m for m in modes if m not in (None, "healthy")), None)


def _skipped_in_a_row(records: list[dict]) -> int:
    """How many of the last training steps of ``records`` were skipped (``"skipped": true``) in a row."""
    n = 0
    for r in reversed(records):
        if "loss" not in r:  # an evaluation or config-change record
            continue
        if not r.get("skipped"):
            break
        n += 1
    return n


def run_row(run: Run) -> dict:
    """One overview row (keys :data:`COLUMNS`) for ``run``; numbers are None when not logged yet, and
    ``mode`` (:func:`divergence_mode`) None for a run the classifier has not flagged."""
    cfg, records = run.config, run.metrics()
    progress = None if records else run.checkpoint_progress()
    if progress is not None and progress[0] > 0:  # e.g. an imported run: its checkpoint's step
        records = [{"step": progress[0], "tokens": progress[1]}]
    last = records[-1] if records else {}
    vals = [r["val_loss"] for r in records if "val_loss" in r]
    elapsed, tokens = last.get("elapsed_s"), last.get("tokens")
    return {"run": str(run.path), "scheme": cfg.model.residual, "blocks": cfg.model.n_layers,
            "sublayers": cfg.model.n_sublayers, "params": count_parameters(cfg.model),
            "step": last.get("step"), "steps": cfg.train.steps, "tokens": tokens,
            "val_loss": vals[-1] if vals else None,
            "tokens_per_s": mean_tokens_per_s(tokens, elapsed, untimed_tokens(records)) if tokens else None,
            "status": run_status(records, cfg.train.steps, lock_holder(run.path) is not None, run.saved_step() or 0,
                                 cfg.train.max_bad_steps),
            "mode": divergence_mode(records)}


def find_runs(root: str | Path) -> list[Path]:
    """Run folders (holding a ``config.toml``; a run stopped before its first metrics, e.g. in
    its step-0 evaluation, is one: status ``new``) at or under ``root``, sorted by name. Raises
    KeelError if ``root`` is not a folder."""
    root = Path(root)
    if not root.is_dir():
        raise KeelError(f"not a folder: {root}")
    return sorted({p.parent for p in root.rglob(RunDir.CONFIG)})


def runs_overview(root: str | Path = "runs") -> list[dict]:
    """One :func:`run_row` per run folder under ``root``; folders that cannot be read are
    skipped with a warning."""
    rows = []
    for path in find_runs(root):
        try:
            rows.append(run_row(Run(path)))
        except KeelError as e:
            log.warning("skipping %s: %s", path, e)
    return rows


def format_table(rows: list[dict], root: str | Path | None = None) -> str:
    """The rows as an aligned text table (run names relative to ``root``)."""
    def fmt(row: dict) -> list[str]:
        name = str(Path(row["run"]).relative_to(root)) if root is not None else row["run"]
        step = "-" if row["step"] is None else f"{row['step']}/{row['steps']}"
        return [name if name != "." else str(root), row["scheme"], f"{row['blocks']}/{row['sublayers']}",
                f"{row['params'] / 1e6:.2f}M", step, "-" if row["tokens"] is None else f"{row['tokens']:,}",
                "-" if row["val_loss"] is None else f"{row['val_loss']:.4f}",
                "-" if row["tokens_per_s"] is None else f"{row['tokens_per_s']:,.0f}",
                row["status"] + (f" ({row['mode']})" if row.get("mode") else "")]

    header = ["run", "scheme", "blocks/sub-layers", "params", "step", "tokens", "val_loss", "tokens/s", "status"]
    table = [header] + [fmt(r) for r in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in table)
