"""Atomic checkpoints: weights in safetensors, trainer state in a ``weights_only`` torch file.

Layout of a run directory::

    RUN/checkpoints/step_00000100/model.safetensors   # weights (tied tensors stored once)
    RUN/checkpoints/step_00000100/trainer.pt          # optimizer, scheduler, data position, RNG
    RUN/checkpoints/latest                            # name of the newest complete checkpoint

A checkpoint is written into a temporary folder and renamed into place, then ``latest``
is replaced atomically, so a crash never leaves a half-written checkpoint that
``latest`` points to.

Checkpoints do not depend on how the model was run: the weights are the full, gathered
tensors under the plain model's parameter names (no DDP ``module.``, no compile
``_orig_mod.``, no FSDP shards), and the optimizer state in ``trainer.pt`` is keyed by
parameter name (see :func:`keel.train.parallelize.full_optimizer_state_dict`). A run saved
with N processes resumes with M, compiled or not.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from keel.errors import KeelError
from keel.io import atomic_write_text, make_temp_dir


COMPILE_PREFIX = "_orig_mod."


def tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """``{alias: kept_name}`` for parameters registered under several names (tied weights).

    The kept name is the alphabetically first of each group -- the one
    ``safetensors.torch.save_model`` keeps -- so files stay compatible with it (a tied
    embedding/LM head is stored once, as ``lm_head.weight``). Names are those of the plain
    model (DDP/compile wrappers are looked through).
    """
    from keel.train.parallelize import unwrap

    groups: dict[int, list[str]] = {}
    for name, p in unwrap(model).named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    out = {}
    for names in groups.values():
        keep = sorted(names)[0]
        out.update({n: keep for n in names if n != keep})
    return out


def _strip_compile_prefix(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k.replace(COMPILE_PREFIX, ""): v for k, v in sd.items()}


def save_checkpoint(run_dir: str | Path, step: int, model: torch.nn.Module | dict[str, torch.Tensor],
                    state: dict[str, Any], keep: int = 2, aliases: dict[str, str] | None = None) -> Path:
    """Write checkpoint ``step`` and point ``latest`` to it; keep the newest ``keep``.

    Args:
        model: the model (a compiled ``OptimizedModule`` or a DDP wrapper is unwrapped: the
            plain module's names are saved), or a full state dict {name: tensor} such as
            :func:`keel.train.parallelize.full_model_state_dict` returns under FSDP.
        state: plain Python values and tensors only (it is loaded with weights_only=True).
        aliases: names to leave out because they alias another (tied weights), as
            :func:`tied_aliases` gives; computed from ``model`` when it is a module.
    Returns the checkpoint folder.
    """
    from keel.train.parallelize import unwrap

    if isinstance(model, torch.nn.Module):
        aliases = tied_aliases(model)
        weights = unwrap(model).state_dict()
    else:
        weights = model
    weights = _strip_compile_prefix(weights)
    aliases = aliases or {}
    weights = {k: v.detach().to("cpu").contiguous() for k, v in weights.items() if k not in aliases}
    ckpt_root = Path(run_dir) / "checkpoints"
    ckpt_root.mkdir(parents=True, exist_ok=True)
    name = f"step_{step:08d}"
    final = ckpt_root / name
    tmp = make_temp_dir(ckpt_root, name)
    try:
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        torch.save(state, tmp / "trainer.pt")
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    atomic_write_text(ckpt_root / "latest", name + "\n")
    old = sorted(p for p in ckpt_root.glob("step_*") if p.is_dir())
    for p in old[:-keep] if keep > 0 else []:
        shutil.rmtree(p, ignore_errors=True)
    return final


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """The complete checkpoint folders of a run (``step_*`` with weights), oldest first."""
    root = Path(run_dir) / "checkpoints"
    return sorted(p for p in root.glob("step_*") if p.is_dir() and (p / "model.safetensors").is_file())


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The folder named by ``RUN/checkpoints/latest``, or None when the run has none."""
    ckpt_root = Path(run_dir) / "checkpoints"
    pointer = ckpt_root / "latest"
    if not pointer.is_file():
        return None
    path = ckpt_root / pointer.read_text().strip()
    return path if (path / "model.safetensors").is_file() else None


def load_weights(model: torch.nn.Module, ckpt: str | Path) -> None:
    """Load ``ckpt/model.safetensors`` into ``model`` (strict: same names and shapes).

    ``model`` may be plain, compiled (``torch.compile``'s ``OptimizedModule``, or blocks
    compiled in place) or DDP-wrapped: the plain module is loaded. Names saved with an
    ``_orig_mod.`` prefix (a compiled module's own ``state_dict()``) are accepted too, and a
    tied weight stored once fills every name it has. Load before FSDP sharding.

    Raises:
        KeelError: no weights file, or names/shapes that do not match the model.
    """
    from keel.train.parallelize import unwrap

    path = Path(ckpt) / "model.safetensors"
    if not path.is_file():
        raise KeelError(f"no model weights at {path}")
    sd = _strip_compile_prefix(load_file(str(path)))
    plain = unwrap(model)
    for alias, kept in tied_aliases(plain).items():
        if kept in sd and alias not in sd:
            sd[alias] = sd[kept]
    try:
        missing, unexpected = plain.load_state_dict(sd, strict=False)
    except RuntimeError as e:  # shape mismatch
        raise KeelError(f"checkpoint {path} does not match the model: {str(e).splitlines()[-1].strip()}") from None
    if missing or unexpected:
        raise KeelError(f"checkpoint {path} does not match the model: missing {sorted(missing)[:3]}, "
                        f"unexpected {sorted(unexpected)[:3]}")


def load_trainer_state(ckpt: str | Path) -> dict[str, Any]:
    """Load ``ckpt/trainer.pt`` with ``torch.load(weights_only=True)``."""
    path = Path(ckpt) / "trainer.pt"
    if not path.is_file():
        raise KeelError(f"no trainer state at {path}")
    return torch.load(path, map_location="cpu", weights_only=True)

