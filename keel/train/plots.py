"""Plots of a run's ``metrics.jsonl`` (PNG, matplotlib's Agg backend, written atomically)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.backend_bases import FigureCanvasBase  # noqa: E402

from keel.errors import KeelError
from keel.io import atomic_path
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


def save_figure(fig, out: str | Path) -> None:
    """Save ``fig`` to ``out`` via a temp file and rename, in the format its suffix names (``.png``,
    ``.pdf``, ``.svg``, ``.jpg``, ...; PNG without one: :func:`image_format`); closes the figure.

    Raises:
        KeelError: a suffix matplotlib cannot write (nothing is written).
    """
    try:
        fmt = image_format(out)
        with atomic_path(out, suffix=f".{fmt}") as tmp:
            fig.savefig(tmp, dpi=120, bbox_inches="tight", format=fmt)
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
