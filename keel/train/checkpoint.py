"""Atomic checkpoints: weights in safetensors, trainer state in a ``weights_only`` torch file.

Layout of a run directory::

    RUN/checkpoints/step_00000100/model.safetensors   # weights (tied tensors stored once)
    RUN/checkpoints/step_00000100/trainer.pt          # optimizer, data position, RNG (and an fp16 run's loss scaler)
    RUN/checkpoints/step_00000100/manifest.json       # size and sha256 of the two files above
    RUN/checkpoints/latest                            # name of the newest complete checkpoint

A checkpoint is written into a temporary folder ``.step_*.tmp``; ``manifest.json`` is
written last, then the folder is renamed into place and ``latest`` is replaced atomically.
A crash never leaves a half-written checkpoint under a ``step_*`` name, and a checkpoint
damaged later (a truncated or overwritten file, a deleted file) no longer matches its
manifest: :meth:`CheckpointManager.find_intact` skips it, saying why, and takes the newest
intact one. Temporaries left by a crash are removed by :meth:`CheckpointManager.clean_temporaries`
when a run starts or resumes. Weights that are not all finite are never written
(:class:`NonFiniteWeights`).

Checkpoints do not depend on how the model was run: the weights are the full, gathered
tensors under the plain model's parameter names (no DDP ``module.``, no compile
``_orig_mod.``, no FSDP shards), and the optimizer state in ``trainer.pt`` is keyed by
parameter name (see :func:`keel.train.parallelize.full_optimizer_state_dict`). A run saved
with N processes resumes with M, compiled or not. Weights and optimizer states stored under
parameter names renamed since (:data:`keel.keys.RENAMED_PARAMS`) load under the current ones,
in both formats.

Multi-process runs write a *sharded* checkpoint instead (:meth:`CheckpointManager.save` with a
process group)::

    RUN/checkpoints/step_00000100/dcp/__R_0.distcp    # the shards rank R holds: weights + AdamW state
    RUN/checkpoints/step_00000100/dcp/.metadata       # torch.distributed.checkpoint's index
    RUN/checkpoints/step_00000100/trainer.pt          # data position, RNG (no model tensors)
    RUN/checkpoints/step_00000100/manifest.json       # size and sha256 of every file, and its rank

Each rank writes and hashes its own shards (``torch.distributed.checkpoint.save``), so no
rank ever holds the full weights or optimizer state; the same folder loads at any world
size, also in one process (``torch.distributed.checkpoint.load`` reshards), and
:meth:`CheckpointManager.load_weights` reads both formats (``keel export-hf``, ``eval``, ``generate``).

:class:`CheckpointManager` is the one way in: it saves, finds, loads, prunes and removes a run's
checkpoints, in both formats. The free functions here read one checkpoint folder
(:func:`checkpoint_problem`, :func:`trainer_state_problem`, :func:`is_sharded`,
:func:`checkpoint_step`) or name one (:func:`step_name`, :data:`LATEST`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import warnings
from pathlib import Path
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from keel.errors import KeelError
from keel.io import KEEL_TEMPORARY, atomic_dir, atomic_write_text, chmod_default, make_temp_dir
from keel.keys import current_param_name
from keel.rundir import RunDir
from keel.train.dist import DistInfo, barrier, broadcast_object
from keel.train.loss_scaling import is_scaler_state
from keel.train.optim import without_scheduler_marks
from keel.train.parallelize import unwrap
from keel.train.state_dict import (full_model_state_dict, full_optimizer_state_dict, load_optimizer_state_dict,
                                   load_sharded_state_dict, renamed_optimizer_state, sharded_state_dict)

COMPILE_PREFIX = "_orig_mod."
MANIFEST = "manifest.json"
FILES = ("model.safetensors", "trainer.pt")
SHARDED_DIR = "dcp"  # torch.distributed.checkpoint files of a multi-process run
_STEP_DIR = re.compile(r"^step_(\d+)$")
# The names inside RUN/checkpoints/ (RunDir.checkpoints) are this module's: a checkpoint folder per
# step (step_name) and the pointer file that names the newest one (LATEST).
LATEST = "latest"
STEP_GLOB = "step_*"  # every checkpoint folder's name matches it (and the temporaries' .step_*.tmp do not)


def step_name(step: int) -> str:
    """The folder name of the checkpoint of optimiser step ``step`` in ``RUN/checkpoints/``: ``step_NNNNNNNN``."""
    return f"step_{step:08d}"

log = logging.getLogger(__name__)


class NonFiniteWeights(KeelError):
    """A checkpoint was refused because some weight is NaN or infinite."""


def tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """``{alias: kept_name}`` for parameters registered under several names (tied weights).

    The kept name is the alphabetically first of each group -- the one
    ``safetensors.torch.save_model`` keeps -- so files stay compatible with it (a tied
    embedding/LM head is stored once, as ``lm_head.weight``). Names are those of the plain
    model (DDP/compile wrappers are looked through).
    """
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


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def non_finite_weights(weights: dict[str, torch.Tensor]) -> list[str]:
    """Names of the floating-point tensors of ``weights`` holding a NaN or an infinity."""
    return [k for k, v in weights.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]


def _save_full(ckpt_root: Path, step: int, model: torch.nn.Module | dict[str, torch.Tensor],
               state: dict[str, Any], aliases: dict[str, str] | None = None) -> Path:
    """:meth:`CheckpointManager.save` of one process: ``step_NNNNNNNN`` in ``ckpt_root`` (the
    files in a temporary folder, ``manifest.json`` last, then the rename) and ``latest``.
    ``model``: a module (unwrapped; ``aliases`` computed from it) or a full state dict."""
    if isinstance(model, torch.nn.Module):
        aliases = tied_aliases(model)
        weights = unwrap(model).state_dict()
    else:
        weights = model
    weights = _strip_compile_prefix(weights)
    aliases = aliases or {}
    weights = {k: v.detach().to("cpu").contiguous() for k, v in weights.items() if k not in aliases}
    _refuse_non_finite(step, non_finite_weights(weights))
    ckpt_root.mkdir(parents=True, exist_ok=True)
    name = step_name(step)
    final = ckpt_root / name
    _check_replaceable(final)
    with atomic_dir(final, replace=_remove_checkpoint) as tmp:
        _write_files(tmp, weights, state, step)
    atomic_write_text(ckpt_root / LATEST, name + "\n")
    return final


def _write_files(folder: Path, weights: dict[str, torch.Tensor], state: dict[str, Any], step: int) -> None:
    """The checkpoint's files, the manifest last (each flushed to disk before the rename)."""
    save_file(weights, str(folder / FILES[0]), metadata={"format": "pt"})
    chmod_default(folder / FILES[0])  # safetensors creates it 0600
    with open(folder / FILES[1], "wb") as f:  # a file object: a full disk surfaces as OSError (keel.io.write_failure)
        torch.save(state, f)
    for fname in FILES:
        with open(folder / fname, "rb") as f:
            os.fsync(f.fileno())
    _write_manifest(folder, {"step": step, "files": _hash_files(folder, list(FILES))})


def _write_manifest(folder: Path, manifest: dict) -> None:
    """``folder/manifest.json``, flushed to disk (written last: before the folder's rename)."""
    with open(folder / MANIFEST, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _refuse_non_finite(step: int, bad: list[str]) -> None:
    """Raise NonFiniteWeights naming (the first three of) ``bad``, the non-finite weights, if any."""
    if bad:
        raise NonFiniteWeights(f"refusing to checkpoint step {step}: non-finite values in {', '.join(bad[:3])}"
                               + (f" and {len(bad) - 3} more" if len(bad) > 3 else ""))


def is_sharded(ckpt: str | Path) -> bool:
    """Whether checkpoint folder ``ckpt`` is a sharded (``torch.distributed.checkpoint``) one."""
    return (Path(ckpt) / SHARDED_DIR / ".metadata").is_file()


def _local_tensors(weights: dict) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor  # lazy: +2-3 s of import; only sharded (FSDP) checkpoints need it

    return {k: v.to_local() if isinstance(v, DTensor) else v for k, v in weights.items()
            if isinstance(v, torch.Tensor)}


def _hash_files(folder: Path, names: list[str]) -> dict[str, dict]:
    return {n: {"bytes": (folder / n).stat().st_size, "sha256": _sha256(folder / n)} for n in names}


def _save_sharded(ckpt_root: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                  state: dict[str, Any], info) -> Path:
    """:meth:`CheckpointManager.save` of a multi-process run (collective): every rank checks its shards
    for non-finite values (any rank's finding stops all) and writes them (``dcp.save``) into ``dcp/``
    of a temporary folder, then hashes the files it wrote; rank 0 writes ``trainer.pt`` (no optimizer),
    the manifest (every file, with its rank) and renames the folder. The run folder must be on a file
    system every rank sees. Returns the checkpoint folder (on every rank; no barrier)."""
    import torch.distributed.checkpoint as dcp  # lazy: +2-3 s of import; only sharded (FSDP) checkpoints need it

    sd = sharded_state_dict(model, optimizer)
    bad: list[list[str]] = [[] for _ in range(info.world_size)]
    dist.all_gather_object(bad, non_finite_weights(_local_tensors(sd["model"])))
    _refuse_non_finite(step, sorted({n for names in bad for n in names}))
    name = step_name(step)
    tmp = None
    if info.is_main:
        ckpt_root.mkdir(parents=True, exist_ok=True)
        _check_replaceable(ckpt_root / name)
        tmp = str(make_temp_dir(ckpt_root, name))
    tmp = Path(broadcast_object(tmp, info))
    dcp.save(sd, checkpoint_id=tmp / SHARDED_DIR)
    mine = sorted(p.name for p in (tmp / SHARDED_DIR).glob(f"__{info.rank}_*"))
    if info.is_main:
        mine.append(".metadata")
    files: list[dict] = [{} for _ in range(info.world_size)]
    dist.all_gather_object(files, _hash_files(tmp / SHARDED_DIR, mine))
    if info.is_main:
        _finish_sharded(tmp, ckpt_root / name, files, state, step)
    return ckpt_root / name


def _finish_sharded(tmp: Path, final: Path, per_rank: list[dict], state: dict, step: int) -> None:
    """Rank 0's part: trainer.pt, the manifest, the rename and ``latest``."""
    torch.save(state, tmp / FILES[1])
    with open(tmp / FILES[1], "rb") as f:
        os.fsync(f.fileno())
    files = _hash_files(tmp, [FILES[1]])
    for rank, hashed in enumerate(per_rank):
        files.update({f"{SHARDED_DIR}/{n}": {**v, "rank": rank} for n, v in hashed.items()})
    _write_manifest(tmp, {"step": step, "files": files, "world_size": len(per_rank)})
    if final.exists():
        _remove_checkpoint(final)
    os.replace(tmp, final)
    atomic_write_text(final.parent / LATEST, final.name + "\n")


def _own_files(ckpt: Path) -> list[Path]:
    """The files keel wrote into checkpoint folder ``ckpt`` (those present): ``model.safetensors``,
    ``trainer.pt``, ``manifest.json``, every file the manifest lists, and a sharded checkpoint's
    ``dcp/__R_I.distcp`` shards and ``dcp/.metadata``."""
    names = {*FILES, MANIFEST, f"{SHARDED_DIR}/.metadata"}
    try:
        listed = json.loads((ckpt / MANIFEST).read_text(encoding="utf-8")).get("files")
        if isinstance(listed, dict):
            names |= {n for n in listed if isinstance(n, str) and ".." not in Path(n).parts}
    except (OSError, ValueError, AttributeError):
        pass
    names |= {f"{SHARDED_DIR}/{p.name}" for p in (ckpt / SHARDED_DIR).glob("__*_*.distcp")}
    return [ckpt / n for n in sorted(names) if (ckpt / n).is_file() and not (ckpt / n).is_symlink()]


def _foreign_files(ckpt: Path) -> list[str]:
    """The entries of checkpoint folder ``ckpt`` keel did not write (relative names, sorted)."""
    own = set(_own_files(ckpt)) | {ckpt / SHARDED_DIR}
    others = [p for p in ckpt.rglob("*") if p not in own]
    # files, and folders with nothing below them (a folder's files already name it)
    return sorted(str(p.relative_to(ckpt)) for p in others if p.is_symlink() or not p.is_dir() or not any(p.iterdir()))


def _check_replaceable(ckpt: Path) -> None:
    """Raise KeelError when checkpoint folder ``ckpt`` exists and holds files keel did not write:
    writing the checkpoint of its step again would have to delete them."""
    foreign = _foreign_files(ckpt) if ckpt.is_dir() else []
    if foreign:
        raise KeelError(f"cannot write the checkpoint {ckpt}: it holds files keel did not write "
                        f"({', '.join(foreign[:3])}); move them out of the run's checkpoints folder")


def _remove_checkpoint(ckpt: str | Path) -> bool:
    """Delete the files keel wrote into checkpoint folder ``ckpt`` (:func:`_own_files`), then the
    folder if that left it empty: never a folder wholesale. Files keel did not write (something
    saved into the run's checkpoints by hand) stay, and a warning names them. Returns whether the
    folder is gone."""
    ckpt = Path(ckpt)
    for p in _own_files(ckpt):
        p.unlink(missing_ok=True)
    for folder in (ckpt / SHARDED_DIR, ckpt):
        try:
            folder.rmdir()
        except FileNotFoundError:
            pass
        except OSError:  # not empty: files keel did not write
            if folder == ckpt:
                left = _foreign_files(ckpt)
                log.warning("%s: kept %s as it holds files keel did not write (%s); only the checkpoint's own "
                            "files were deleted", ckpt.parent.parent, ckpt.name, ", ".join(left[:3]) or "?")
                return False
    return True


def _load_sharded(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, ckpt: str | Path) -> None:
    """Load a sharded checkpoint into ``model`` (and ``optimizer``) at this run's world size:
    collective in a process group (every rank reads its part, resharded to the current
    layout), or in one process without one (full tensors). ``model`` is the plain, compiled
    or FSDP-sharded model.

    Raises:
        KeelError: an unreadable checkpoint, or one that does not match the model.
    """
    import torch.distributed.checkpoint as dcp  # lazy: +2-3 s of import; only sharded (FSDP) checkpoints need it

    sd = sharded_state_dict(model, optimizer)
    path = Path(ckpt) / SHARDED_DIR
    try:
        # dcp.load reads the names it is given: a checkpoint saved before a parameter rename
        # (keel.keys.RENAMED_PARAMS) is read under its old names, then renamed back
        stored = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
        old = any(current_param_name(k) != k for k in stored)
        load = _renamed_sharded(sd, old=True) if old else sd
        with warnings.catch_warnings():  # "... assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(load, checkpoint_id=path)
        load_sharded_state_dict(model, optimizer, _renamed_sharded(load) if old else sd)
    except Exception as e:  # noqa: BLE001 -- CheckpointException, RuntimeError (shapes), OSError ...
        raise KeelError(f"cannot load the sharded checkpoint {ckpt}: {_first_line(e)}") from None


def _renamed_sharded(sd: dict, old: bool = False) -> dict:
    """A :func:`keel.train.state_dict.sharded_state_dict` under the current parameter names, or with
    ``old`` under those from before a rename (:func:`keel.keys.current_param_name`); tensors shared."""
    out = {"model": {current_param_name(k, old): v for k, v in sd["model"].items()}}
    if "optim" in sd:
        out["optim"] = renamed_optimizer_state(sd["optim"], old)
    return out


def checkpoint_problem(ckpt: str | Path) -> str | None:
    """Why the checkpoint folder ``ckpt`` cannot be used, or None when it is intact.

    Intact means: ``manifest.json`` is readable and every file it lists has the recorded
    size and sha256. A checkpoint written before manifests existed is accepted when both
    files are present and non-empty and the weights' safetensors header reads.
    """
    ckpt = Path(ckpt)
    if not ckpt.is_dir():
        return "the folder does not exist"
    manifest = ckpt / MANIFEST
    if not manifest.is_file():
        return _unlisted_problem(ckpt)
    try:
        declared = json.loads(manifest.read_text(encoding="utf-8"))
        files = declared["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return "manifest.json is unreadable"
    if declared.get("step", checkpoint_step(ckpt)) != checkpoint_step(ckpt):  # manifests before v2 name no step
        return f"manifest.json says step {declared['step']!r}, the folder step {checkpoint_step(ckpt)}"
    if not (isinstance(files, dict) and all(isinstance(w, dict) and isinstance(w.get("bytes"), int)
                                            and isinstance(w.get("sha256"), str) for w in files.values())):
        return "manifest.json lists no files with their bytes and sha256"
    for fname, want in files.items():
        path = ckpt / fname
        if not path.is_file():
            return f"{fname} is missing"
        size = path.stat().st_size
        if size != want["bytes"]:
            return f"{fname} has {size} bytes, the manifest says {want['bytes']}"
        if _sha256(path) != want["sha256"]:
            return f"{fname} does not match its sha256 in the manifest"
    return None


def _unlisted_problem(ckpt: Path) -> str | None:
    """:func:`checkpoint_problem` of a checkpoint without a manifest (written before manifests
    existed): both files present and non-empty and the safetensors header readable (whether
    ``trainer.pt`` loads is :func:`_state_step_problem`'s check)."""
    missing = [f for f in FILES if not (ckpt / f).is_file() or (ckpt / f).stat().st_size == 0]
    if missing:
        return f"{missing[0]} is missing or empty (and there is no manifest)"
    try:
        with safe_open(str(ckpt / FILES[0]), "pt"):
            pass
    except Exception:  # noqa: BLE001 -- safetensors raises its own SafetensorError on a damaged file
        return f"{FILES[0]} is damaged: its header does not read (and there is no manifest)"
    return None


def _is_count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _is_loader_state(x: Any) -> bool:
    """A :meth:`keel.data.TokenLoader.state_dict`: integer epoch and position (and, when present,
    integer seed, sizes and world size, a text split)."""
    return (isinstance(x, dict) and all(_is_count(x.get(k)) for k in ("epoch", "position"))
            and all(_is_count(v) for k, v in x.items() if k not in ("split", "epoch", "position"))
            and isinstance(x.get("split", ""), str))


# trainer.pt, declared: key -> (check, what is expected). Every key a resume reads is checked
# before the checkpoint is chosen, so a state of the wrong shape is skipped for the previous
# intact checkpoint, as a damaged file is (it used to be a TypeError deep in the resume).
# ``optimizer``, ``config`` and ``grad_scaler`` are optional (a multi-process checkpoint keeps the
# optimiser with its shards; the checkpoint of an import has no config; only an fp16-autocast run
# has a loss scaler, keel.train.loss_scaling).
TRAINER_STATE: dict[str, tuple[Callable[[Any], bool], str]] = {
    "step": (_is_count, "its folder's step"),
    "tokens": (_is_count, "a token count >= 0"),
    "elapsed_s": (lambda x: isinstance(x, (int, float)) and not isinstance(x, bool) and x >= 0, "seconds >= 0"),
    "loader": (_is_loader_state, "a data loader position (integer epoch and position)"),
    "rng": (lambda x: isinstance(x, torch.Tensor) and x.dtype == torch.uint8 and x.dim() == 1,
            "a CPU RNG state (a uint8 tensor)"),
    "optimizer": (lambda x: isinstance(x, dict) and isinstance(x.get("state"), dict)
                  and isinstance(x.get("param_groups"), list), "an optimizer state (state and param_groups)"),
    "config": (lambda x: isinstance(x, dict) and all(isinstance(v, dict) for v in x.values()),
               "a config (a table per section)"),
    "grad_scaler": (is_scaler_state, "a loss-scaler state (scale, growth tracker, skipped_steps)"),
}
_OPTIONAL_STATE = ("optimizer", "config", "grad_scaler")


def trainer_state_problem(state: Any, step: int) -> str | None:
    """Why ``state`` (a loaded ``trainer.pt``) is not the trainer state of checkpoint step
    ``step`` (:data:`TRAINER_STATE`), or None: e.g. ``"its trainer state says step 999, the
    folder step 6"`` (a resume reported "applied from step 999" and trained nothing) or
    ``"its trainer state's tokens must be a token count >= 0, got 'x'"``."""
    if not isinstance(state, dict):
        return f"its trainer state must be a table of {', '.join(TRAINER_STATE)}, got {type(state).__name__}"
    if state.get("step") != step:
        return f"its trainer state says step {state.get('step')!r}, the folder step {step}"
    for key, (ok, expected) in TRAINER_STATE.items():
        if key in _OPTIONAL_STATE and key not in state:
            continue
        if not ok(state.get(key)):
            got = "nothing" if key not in state else repr(state[key])[:60]
            return f"its trainer state's {key} must be {expected}, got {got}"
    return None


def _state_step_problem(ckpt: Path) -> str | None:
    """Why ``ckpt``'s trainer state does not belong to its folder or has the wrong shape
    (:func:`trainer_state_problem`), or None. Reads ``trainer.pt`` memory-mapped."""
    path = ckpt / "trainer.pt"
    if not path.is_file():
        return None  # a checkpoint before manifests lacking it: checkpoint_problem says so
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # noqa: BLE001 -- a damaged pickle: the same words as CheckpointManager.load_trainer_state
        return f"trainer.pt cannot be read ({_first_line(e)})"
    return trainer_state_problem(state, checkpoint_step(ckpt))


def checkpoint_step(ckpt: str | Path) -> int:
    """The optimiser step of checkpoint folder ``RUN/checkpoints/step_NNNNNNNN``."""
    return int(Path(ckpt).name[5:])


def _step_dirs(root: Path) -> list[Path]:
    """The ``step_*`` folders of a run's ``checkpoints/`` folder ``root``, newest (highest step) first."""
    dirs = [p for p in root.glob(STEP_GLOB) if p.is_dir() and _STEP_DIR.match(p.name)]
    return sorted(dirs, key=checkpoint_step, reverse=True)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:200] if text else type(e).__name__



class CheckpointManager:
    """The checkpoints of one run: the one path that writes, finds, loads and removes them.

    It owns ``RUN/checkpoints/`` (:attr:`keel.rundir.RunDir.checkpoints`): the ``step_NNNNNNNN``
    folders (:func:`step_name`), the ``latest`` pointer, both formats (one process: full tensors,
    ``model.safetensors`` + ``trainer.pt``; several: ``torch.distributed.checkpoint`` shards in
    ``dcp/`` + ``trainer.pt``), the atomic writes and manifests, listing and pruning. What it saves
    exposes ``state_dict()`` (a :class:`keel.train.state_dict.TrainState`, the model and optimiser
    through :mod:`keel.train.state_dict`), as torchtitan's checkpointer; a resume puts it back with
    :meth:`restore`. Steps are optimiser steps (0 = nothing trained).

    Args:
        run_dir: the run folder (``RUN``; ``RUN/checkpoints`` need not exist yet). Log lines name it
            as given.
        info: this process's :class:`keel.train.dist.DistInfo` (default: a single process); with
            ``info.distributed`` :meth:`save` writes the sharded format, collectively.
        keep: how many of the newest checkpoints :meth:`save` keeps (0: all).
    """

    def __init__(self, run_dir: str | Path, info: DistInfo | None = None, keep: int = 2):
        self.run_dir = run_dir  # as given: the log lines name it so
        self.root = RunDir(run_dir).checkpoints
        self.info = info if info is not None else DistInfo()
        self.keep = keep

    def __repr__(self) -> str:
        return f"CheckpointManager({str(self.run_dir)!r}, keep={self.keep})"

    # ------------------------------------------------------------------ writing
    def save(self, step: int, model: torch.nn.Module | dict[str, torch.Tensor], state: Any,
             optimizer: torch.optim.Optimizer | None = None, aliases: dict[str, str] | None = None) -> Path:
        """Write checkpoint ``step`` (``RUN/checkpoints/step_NNNNNNNN``), point ``latest`` to it, remove
        the checkpoints past ``step`` (:meth:`remove_after`) and all but the newest ``keep`` (:meth:`prune`).

        The files go to a temporary folder ``.step_*.tmp``; ``manifest.json`` (size and sha256 of each
        file, and the step) is written last, then the folder is renamed into place. In a process group
        (``info.distributed``) it is collective and writes the sharded format (every rank its own shards
        of the weights and AdamW state, rank 0 ``trainer.pt``, the manifest, the rename, ``latest``);
        otherwise the full format.

        Args:
            model: the model (a compiled ``OptimizedModule``, DDP or FSDP wrapper is looked through: the
                plain module's names are saved), or a full state dict {name: tensor} (one process only).
            state: the trainer state, a ``Stateful`` (its ``state_dict()`` is saved) or a dict of plain
                Python values and tensors (it is loaded with ``weights_only=True``).
            optimizer: the optimiser, saved with it (one process: its full state, keyed by parameter
                name, under ``"optimizer"`` in ``trainer.pt``; several: with the shards). Without it
                (``keel import-hf``), the weights and ``state`` only.
            aliases: names to leave out because they alias another (tied weights), as
                :func:`tied_aliases` gives; computed from ``model`` when it is a module.
        Returns the checkpoint folder (on every rank).
        Raises:
            NonFiniteWeights: a weight holds NaN or inf (on any rank): nothing is written, ``latest``
                is unchanged.
            KeelError: the folder of ``step`` holds files keel did not write.
            OSError: the checkpoint cannot be written (a full disk, a read-only folder).
        """
        state = state.state_dict() if hasattr(state, "state_dict") else state
        if self.info.distributed:
            final = _save_sharded(self.root, step, model, optimizer, state, self.info)
            if self.info.is_main:
                self._after_save(step)
            barrier(self.info)
            return final
        if optimizer is not None:  # the trainer's: gathered weights, name-keyed optimiser state
            weights = full_model_state_dict(model)
            state = {**state, "optimizer": full_optimizer_state_dict(model, optimizer)}
            model, aliases = weights, aliases if aliases is not None else tied_aliases(model)
        final = _save_full(self.root, step, model, state, aliases)
        self._after_save(step)
        return final

    def _after_save(self, step: int) -> None:
        self.remove_after(step)
        self.prune()

    def check_writable(self, after: int, upto: int) -> None:
        """Refuse a run from step ``after`` to ``upto`` whose checkpoint folder of a step in between (one it
        may write: on its schedule, at the end, on a stop) holds files keel did not write: :meth:`save`
        would refuse that folder when its step comes, after the training since the previous checkpoint
        (``--restart`` used to train to the end, then lose its final checkpoint). Checked before training.

        Raises:
            KeelError: one line naming the folder and its first foreign files.
        """
        for p in reversed(_step_dirs(self.root)):  # oldest first
            foreign = _foreign_files(p) if after < checkpoint_step(p) <= upto else []
            if foreign:
                raise KeelError(f"cannot train {self.run_dir} to step {upto}: its checkpoint folder {p} holds files "
                                f"keel did not write ({', '.join(foreign[:3])}) where the checkpoint of step "
                                f"{checkpoint_step(p)} goes; move them out of the run's checkpoints folder")

    def prune(self, keep: int | None = None) -> list[Path]:
        """Remove all but the newest ``keep`` checkpoints (default: this manager's ``keep``; 0 keeps
        all). A ``step_*`` folder with no file keel wrote is no checkpoint: neither counted nor
        touched. Returns the folders removed (a folder holding others' files keeps them)."""
        keep = self.keep if keep is None else keep
        kept = [p for p in _step_dirs(self.root) if _own_files(p)]  # newest first
        gone = kept[keep:] if keep > 0 else []
        for p in gone:
            _remove_checkpoint(p)
        return gone

    def remove_after(self, step: int) -> list[Path]:
        """Remove (logged as a warning) the checkpoints past ``step``: an abandoned history, when a run
        resumes from an older checkpoint (e.g. past a damaged newer one) and its metrics are cut back
        to that step. A resume calls it once it has accepted its checkpoint, so such a checkpoint
        never counts towards ``keep``. Returns the folders removed."""
        stale = [p for p in _step_dirs(self.root) if checkpoint_step(p) > step and _own_files(p)]
        for p in stale:
            log.warning("%s: removing %s, a checkpoint past step %d of the history this run resumed before it",
                        self.run_dir, p.name, step)
            _remove_checkpoint(p)
        return stale

    def remove_all(self) -> None:
        """Delete every checkpoint (keel's files only: a file keel did not write stays, with a warning),
        ``latest`` and keel's temporaries in ``RUN/checkpoints``, then that folder if that left it empty
        (what ``keel train --restart`` does)."""
        if not self.root.is_dir():
            return
        for p in _step_dirs(self.root):
            _remove_checkpoint(p)
        (self.root / LATEST).unlink(missing_ok=True)
        self.clean_temporaries()
        try:
            self.root.rmdir()
        except OSError:  # files keel did not write: kept (_remove_checkpoint named those in its folders)
            left = sorted(p.name for p in self.root.iterdir() if not _STEP_DIR.match(p.name))
            if left:
                log.warning("%s: kept %s in its checkpoints folder (files keel did not write)",
                            self.run_dir, ", ".join(left[:3]))

    def clean_temporaries(self) -> list[Path]:
        """Delete what an interrupted writer left: ``RUN/checkpoints/.step_*.tmp`` folders and
        ``.NAME.*.tmp`` files (:mod:`keel.io`'s names only) in ``RUN`` and ``RUN/checkpoints``. Call
        it only while no other process writes to the run. Returns what was removed."""
        removed = []
        for folder in (Path(self.run_dir), self.root):
            for p in folder.glob(".*.tmp") if folder.is_dir() else []:
                if not KEEL_TEMPORARY.match(p.name):  # keel's own names only (keel.io): never another tool's file
                    continue
                if p.is_dir():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    p.unlink(missing_ok=True)
                removed.append(p)
        return removed

    # ------------------------------------------------------------------ finding
    def has_folders(self) -> bool:
        """Whether ``RUN/checkpoints`` holds any ``step_*`` folder (intact or not)."""
        return any(p.is_dir() for p in self.root.glob(STEP_GLOB))

    def complete(self) -> list[Path]:
        """The checkpoint folders that have their files (``step_*`` with weights and a manifest, or with
        both files for older checkpoints, or a sharded one with its manifest), oldest first. Not
        verified against the checksums: :meth:`find_intact` does that."""
        def has_files(p: Path) -> bool:
            single = (p / FILES[0]).is_file() and ((p / MANIFEST).is_file() or (p / FILES[1]).is_file())
            return single or (is_sharded(p) and (p / MANIFEST).is_file())

        return [p for p in reversed(_step_dirs(self.root)) if has_files(p)]

    def steps(self) -> list[int]:
        """The steps of :meth:`complete`'s checkpoints, ascending."""
        return [checkpoint_step(p) for p in self.complete()]

    def find_intact(self) -> tuple[Path | None, list[str]]:
        """The newest intact checkpoint, and a reason for each newer one it passed over.

        Candidates are the folder ``latest`` names and every ``step_*`` folder; the one with the
        highest step that passes :func:`checkpoint_problem` (and whose ``trainer.pt`` belongs to it,
        :func:`trainer_state_problem`) wins. The reasons (one line each, e.g. ``"step_00000012:
        model.safetensors is missing"`` or ``"checkpoints/latest (the file is missing)"``) are empty
        when ``latest`` names the winner. Nothing is logged.

        Returns:
            ``(folder or None, reasons)``.
        """
        root = self.root
        reasons: list[str] = []
        pointer = root / LATEST
        named = pointer.read_text(encoding="utf-8", errors="replace").strip() if pointer.is_file() else None
        chosen = None
        for folder in _step_dirs(root):
            problem = checkpoint_problem(folder) or _state_step_problem(folder)
            if problem is None:
                chosen = folder
                break
            reasons.append(f"{folder.name}: {problem}")
        if named is None and root.is_dir() and (chosen is not None or reasons):
            reasons.insert(0, f"{RunDir.CHECKPOINTS}/{LATEST} (the file is missing)")
        elif named is not None and (chosen is None or named != chosen.name) and not (root / named).is_dir():
            reasons.insert(0, f"{RunDir.CHECKPOINTS}/{LATEST} (it names {named}, which does not exist)")
        return chosen, reasons

    def latest(self) -> Path | None:
        """The newest intact checkpoint (:meth:`find_intact`), or None: normally the one ``latest``
        names; when that one is missing or damaged, the newest older intact one, with a warning per
        checkpoint skipped that says why."""
        chosen, reasons = self.find_intact()
        for reason in reasons:
            log.warning("%s: skipping %s", self.run_dir, reason)
        return chosen

    # ------------------------------------------------------------------ loading
    @staticmethod
    def load_weights(model: torch.nn.Module, ckpt: str | Path) -> None:
        """Load the weights of checkpoint folder ``ckpt`` (either format) into ``model``, strictly (same
        names and shapes): ``model.safetensors``, or the shards of ``dcp/`` (resharded, model only).

        ``model`` may be plain, compiled (``torch.compile``'s ``OptimizedModule``, or blocks compiled
        in place) or DDP-wrapped: the plain module is loaded. Names saved with an ``_orig_mod.``
        prefix are accepted, a tied weight stored once fills every name it has, and names renamed
        since (:data:`keel.keys.RENAMED_PARAMS`) load under the current ones. Load a full checkpoint
        before FSDP sharding.

        Raises:
            KeelError: no weights file, an unreadable one, or names/shapes that do not match the model.
        """
        if is_sharded(ckpt):
            _load_sharded(model, None, ckpt)
            return
        path = Path(ckpt) / FILES[0]
        if not path.is_file():
            raise KeelError(f"no model weights at {path}")
        try:
            sd = _strip_compile_prefix(load_file(str(path)))
        except Exception as e:  # noqa: BLE001 -- SafetensorError, OSError ...: a truncated or overwritten file
            raise KeelError(f"cannot read {path} (damaged?): {_first_line(e)}") from None
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

    @staticmethod
    def load_trainer_state(ckpt: str | Path) -> dict[str, Any]:
        """The trainer state of checkpoint folder ``ckpt``: ``trainer.pt`` read with
        ``torch.load(weights_only=True)`` onto the CPU (its keys: :data:`TRAINER_STATE`).

        Raises:
            KeelError: the file is missing or cannot be read (truncated, overwritten).
        """
        path = Path(ckpt) / FILES[1]
        if not path.is_file():
            raise KeelError(f"no trainer state at {path}")
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 -- PytorchStreamReader failed, UnicodeDecodeError, UnpicklingError ...
            raise KeelError(f"cannot read {path} (damaged?): {_first_line(e)}") from None

    @staticmethod
    def restore(ckpt: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                train_state: Any = None, state: dict[str, Any] | None = None) -> None:
        """Put the training state of checkpoint folder ``ckpt`` back (collective in a process group):
        the optimiser (a full checkpoint's name-keyed or old index-keyed ``"optimizer"`` entry; a
        sharded one's weights and AdamW state, resharded to this world size) and, given a
        ``train_state`` (a ``Stateful`` such as :class:`keel.train.state_dict.TrainState`), its
        ``load_state_dict(state)``. ``state``: :meth:`load_trainer_state`'s dict (read from ``ckpt``
        when not given). A full checkpoint's weights are loaded before sharding, with :meth:`load_weights`.

        Raises:
            KeelError: an unreadable ``trainer.pt``, a sharded checkpoint that does not match the
                model, or an index-keyed optimiser state with an FSDP model.
        """
        sharded = is_sharded(ckpt)
        if state is None and (train_state is not None or not sharded):
            state = CheckpointManager.load_trainer_state(ckpt)
        if sharded:
            _load_sharded(model, optimizer, ckpt)
        else:
            load_optimizer_state_dict(model, optimizer, without_scheduler_marks(state["optimizer"]))
        if train_state is not None:
            train_state.load_state_dict(state)
