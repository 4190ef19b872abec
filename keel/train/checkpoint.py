"""Atomic checkpoints: weights in safetensors, trainer state in a ``weights_only`` torch file.

Layout of a run directory::

    RUN/checkpoints/step_00000100/model.safetensors   # weights (tied tensors stored once)
    RUN/checkpoints/step_00000100/trainer.pt          # optimizer, scheduler, data position, RNG
    RUN/checkpoints/latest                            # name of the newest complete checkpoint

A checkpoint is written into a temporary folder and renamed into place, then ``latest``
is replaced atomically, so a crash never leaves a half-written checkpoint that
``latest`` points to.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_model, save_model

from keel.errors import KeelError


def _write_text_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def save_checkpoint(run_dir: str | Path, step: int, model: torch.nn.Module, state: dict[str, Any],
                    keep: int = 2) -> Path:
    """Write checkpoint ``step`` and point ``latest`` to it; keep the newest ``keep``.

    Args:
        model: the plain (unwrapped) model; its weights go to ``model.safetensors``.
        state: plain Python values and tensors only (it is loaded with weights_only=True).
    Returns the checkpoint folder.
    """
    ckpt_root = Path(run_dir) / "checkpoints"
    ckpt_root.mkdir(parents=True, exist_ok=True)
    name = f"step_{step:08d}"
    final = ckpt_root / name
    tmp = Path(tempfile.mkdtemp(dir=ckpt_root, prefix=f".{name}."))
    try:
        save_model(model, str(tmp / "model.safetensors"))
        torch.save(state, tmp / "trainer.pt")
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _write_text_atomic(ckpt_root / "latest", name + "\n")
    old = sorted(p for p in ckpt_root.glob("step_*") if p.is_dir())
    for p in old[:-keep] if keep > 0 else []:
        shutil.rmtree(p, ignore_errors=True)
    return final


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The folder named by ``RUN/checkpoints/latest``, or None when the run has none."""
    ckpt_root = Path(run_dir) / "checkpoints"
    pointer = ckpt_root / "latest"
    if not pointer.is_file():
        return None
    path = ckpt_root / pointer.read_text().strip()
    return path if (path / "model.safetensors").is_file() else None


def load_weights(model: torch.nn.Module, ckpt: str | Path) -> None:
    """Load ``ckpt/model.safetensors`` into ``model`` (strict). Raises KeelError if missing."""
    path = Path(ckpt) / "model.safetensors"
    if not path.is_file():
        raise KeelError(f"no model weights at {path}")
    load_model(model, str(path), strict=True)


def load_trainer_state(ckpt: str | Path) -> dict[str, Any]:
    """Load ``ckpt/trainer.pt`` with ``torch.load(weights_only=True)``."""
    path = Path(ckpt) / "trainer.pt"
    if not path.is_file():
        raise KeelError(f"no trainer state at {path}")
    return torch.load(path, map_location="cpu", weights_only=True)


def load_run(run_dir: str | Path, device: str = "auto", checkpoint: str | Path | None = None):
    """Load a trained run for inference: ``(model, tokenizer, device)``.

    Reads ``RUN/config.toml``, the weights of the latest checkpoint (or ``checkpoint``)
    and ``RUN/tokenizer.json``. The model is in eval mode on ``device``.

    Raises:
        KeelError: not a run directory, or no checkpoint yet.
    """
    from tokenizers import Tokenizer

    from keel.config import load_config
    from keel.model import Transformer
    from keel.train.trainer import resolve_device

    run_dir = Path(run_dir)
    if not (run_dir / "config.toml").is_file():
        raise KeelError(f"not a run directory (no config.toml): {run_dir}")
    ckpt = Path(checkpoint) if checkpoint else latest_checkpoint(run_dir)
    if ckpt is None:
        raise KeelError(f"run {run_dir} has no checkpoint yet")
    if not (run_dir / "tokenizer.json").is_file():
        raise KeelError(f"run {run_dir} has no tokenizer.json")
    cfg = load_config(run_dir / "config.toml")
    dev = resolve_device(device)
    model = Transformer(cfg.model)
    load_weights(model, ckpt)
    model.to(dev).eval()
    return model, Tokenizer.from_file(str(run_dir / "tokenizer.json")), dev
