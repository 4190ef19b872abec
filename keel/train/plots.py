"""Plots of a run's ``metrics.jsonl`` (PNG, matplotlib's Agg backend, written atomically)."""

from __future__ import annotations

import contextlib
import gzip
import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.backend_bases import FigureCanvasBase  # noqa: E402

from keel.errors import KeelError
from keel.io import atomic_path
from keel.rundir import RunDir
from keel.train.metrics import read_metrics  # noqa: E402


def image_format(out: str | Path, flag: str = "--out") -> str:
    """The image format the suffix of ``out`` names (``png`` without one), checked before any work.

    Raises:
        KeelError: a suffix matplotlib cannot write (naming ``flag``, the option that gave ``out``,
            and the suffixes it can).
    """
    fmt = Path(out).suffix.lower().lstrip(".") or "png"
    known = FigureCanvasBase.get_supported_filetypes()
    if fmt not in known:
        raise KeelError(f"cannot write {out}: matplotlib writes no .{fmt} files; give {flag} one of "
                        + ", ".join(f".{k}" for k in sorted(known)))
    return fmt


PLOT_MARK = "keel plot"  # the metadata value that marks an image file as keel's (check_plot_out)
# the formats whose metadata can carry the mark, and the field that does (matplotlib's savefig(metadata=))
_MARK_FIELD = {"png": "Software", "pdf": "Creator", "svg": "Creator", "svgz": "Creator", "eps": "Creator",
               "ps": "Creator"}
_MARK_READ_MAX = 64 << 20  # bytes: a bigger file is no plot of keel's


def written_by_keel(path: str | Path) -> bool:
    """Whether ``path`` is a regular file that :func:`save_figure` wrote: a ``.png``, ``.pdf``, ``.svg``,
    ``.svgz``, ``.eps`` or ``.ps`` file whose metadata holds :data:`PLOT_MARK` (other formats carry no
    metadata, so no file of theirs is known to be keel's). Unreadable: False."""
    fmt = Path(path).suffix.lower().lstrip(".") or "png"
    if fmt not in _MARK_FIELD:
        return False
    with contextlib.suppress(OSError, EOFError, gzip.BadGzipFile):
        if os.path.isfile(path) and os.path.getsize(path) <= _MARK_READ_MAX:
            data = Path(path).read_bytes()
            return PLOT_MARK.encode() in (gzip.decompress(data) if fmt == "svgz" else data)
    return False


def check_plot_out(out: str | Path, flag: str = "--out") -> None:
    """Refuse an image path the user named (``keel plot --out``, ``keel gradflow --plot``) that exists
    and is not a plot keel wrote (:func:`written_by_keel`): keel overwrites only its own plots.

    Raises:
        KeelError: one line naming ``flag`` and ``out``; also for a file of a keel run's own layout
            (``RUN/loss.png``, any name :class:`keel.rundir.RunDir` declares, in a folder that
            :meth:`RunDir.is_run`), which another plot would silently replace.
    """
    _check_not_run_file(out, flag)
    if os.path.lexists(out) and not written_by_keel(out):
        fmt = Path(out).suffix.lower().lstrip(".") or "png"
        why = "" if fmt in _MARK_FIELD else f" (a .{fmt} file carries no mark of keel's)"
        raise KeelError(f"{flag} {out} exists and is not a plot keel wrote{why}; keel overwrites only its own "
                        f"plots: remove it, or give another {flag}")


def _check_not_run_file(out: str | Path, flag: str) -> None:
    """Refuse ``out`` when it names a file of a keel run's own layout (:class:`RunDir`'s names) in a
    folder that is a keel run: ``RUN/loss.png`` is the run's own loss curve, not a place for another."""
    out = Path(out)
    names = {n.rstrip("/") for n in RunDir.TRAINING_FILES + RunDir.GRID_FILES}
    if out.name not in names or not RunDir(out.parent).is_run():
        return
    what = {RunDir.LOSS_PLOT: "loss plot", RunDir.CONFIG: "config", RunDir.METRICS: "metrics",
            RunDir.TOKENIZER: "tokenizer", RunDir.SAMPLE: "sample"}.get(out.name, out.name)
    raise KeelError(f"{out} is run {out.parent}'s own {what}; choose another {flag}")


def save_figure(fig, out: str | Path) -> None:
    """Save ``fig`` to ``out`` via a temp file and rename, in the format its suffix names (``.png``,
    ``.pdf``, ``.svg``, ``.jpg``, ...; PNG without one: :func:`image_format`); closes the figure. Where
    the format has metadata, :data:`PLOT_MARK` marks the file as keel's (:func:`check_plot_out`).

    Raises:
        KeelError: a suffix matplotlib cannot write (nothing is written).
    """
    try:
        fmt = image_format(out)
        mark = {"metadata": {_MARK_FIELD[fmt]: PLOT_MARK}} if fmt in _MARK_FIELD else {}
        with atomic_path(out, suffix=f".{fmt}") as tmp:
            fig.savefig(tmp, dpi=120, bbox_inches="tight", format=fmt, **mark)
    finally:
        plt.close(fig)


def plot_loss(metrics_path: str | Path, out: str | Path, title: str = "") -> None:
    """Train loss (per step) and validation loss (eval steps) against tokens seen."""
    records = read_metrics(metrics_path)
    train = [(r["tokens"], r["loss"]) for r in records if r.get("loss") is not None and not r.get("skipped")]
    val = [(r["tokens"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train), lw=0.8, alpha=0.8, label="train")
    if val:
        ax.plot(*zip(*val), "o-", ms=3, label="validation")
    ax.set_xlabel("tokens")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    save_figure(fig, out)
