"""Plots of a run's ``metrics.jsonl`` (PNG, matplotlib's Agg backend, written atomically)."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def read_metrics(path: str | Path) -> list[dict]:
    """The records of a ``metrics.jsonl`` file, in order."""
    return [json.loads(ln) for ln in Path(path).read_text().splitlines() if ln.strip()]


def save_figure(fig, out: str | Path) -> None:
    """Save ``fig`` as PNG to ``out`` via a temp file and rename; closes the figure."""
    from keel.io import atomic_path

    try:
        with atomic_path(out, suffix=".png") as tmp:
            fig.savefig(tmp, dpi=120, bbox_inches="tight")
    finally:
        plt.close(fig)


def plot_loss(metrics_path: str | Path, out: str | Path, title: str = "") -> None:
    """Train loss (per step) and validation loss (eval steps) against tokens seen."""
    records = read_metrics(metrics_path)
    train = [(r["tokens"], r["loss"]) for r in records if "loss" in r and not r.get("skipped")]
    val = [(r["tokens"], r["val_loss"]) for r in records if "val_loss" in r]
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
