"""Scale-out and speed, applied to a :class:`keel.model.Transformer` from the outside.

The model code (``keel/model``) knows nothing about processes, sharding, recomputation or
compilation; this module takes a built model and transforms it in place, in the order
torchtitan uses (``torchtitan/models/llama3/parallelize.py``):

1. :func:`apply_activation_checkpointing` -- recompute a block's activations in the
   backward pass instead of storing them (non-reentrant ``torch.utils.checkpoint``);
2. :func:`apply_compile` -- ``torch.compile`` each block in place (``nn.Module.compile``),
   so parameter names never gain an ``_orig_mod.`` prefix;
3. :func:`apply_fsdp` (FSDP2, ``torch.distributed.fsdp.fully_shard`` per block, then the
   root) or :func:`apply_ddp` (``torch.nn.parallel.DistributedDataParallel``).

Process groups live in :mod:`keel.train.dist`; whole-model views of a sharded model
(gradient norm, full state dicts) in :mod:`keel.train.state_dict`.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

from keel.config import TrainConfig, check_value
from keel.keys import choices
from keel.errors import KeelError
from keel.train.dist import DistInfo

PARALLELISMS = choices(TrainConfig, "parallelism")  # declared once, in keel.config.TrainConfig


# --------------------------------------------------------------------------- transforms


def _blocks(model: nn.Module) -> nn.ModuleList:
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleList):
        raise KeelError("expected a keel Transformer with a `blocks` ModuleList")
    return blocks


def checkpointed_blocks(n_blocks: int, mode: str, every_k: int = 2) -> list[int]:
    """Indices of the blocks whose activations are recomputed, for ``n_blocks`` blocks.

    ``none``: no block; ``block``: every block; ``every_k``: blocks 0, k, 2k, ...
    (torchtitan's layer-wise "selective" checkpointing, one block in every k).

    Raises:
        KeelError: unknown ``mode`` or ``every_k < 1``.
    """
    check_value("train.activation_checkpointing", mode)
    if mode == "every_k":
        check_value("train.activation_checkpoint_k", every_k)
    if mode == "none":
        return []
    if mode == "block":
        return list(range(n_blocks))
    return list(range(0, n_blocks, every_k))


def apply_activation_checkpointing(model: nn.Module, mode: str, every_k: int = 2,
                                   when: Callable[[], bool] | None = None) -> list[int]:
    """Recompute the chosen blocks' activations in the backward pass (in place).

    Each chosen block's ``forward`` is replaced by one that runs the original under
    ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` whenever autograd is
    recording and ``when()`` is true (None: always); otherwise (evaluation, generation with a KV
    cache, a step ``when`` leaves out) it runs the plain forward. The trainer's ``when`` is
    ``train.activation_checkpoint_min_loops``: a looped model's step checkpoints only if it draws
    at least that many core applications. Only the block's input (x [B, T, d]) stays alive between forward and
    backward, so memory for stored activations drops from one block's worth per block to
    one input per block plus one block's worth during its recomputation (see
    :func:`memory_estimate`). Parameter names are unchanged (no wrapper module), so
    checkpoints and diagnostics see the same names. Gradients are bit-identical on CPU:
    the recomputation runs the same kernels on the same inputs.

    Args:
        model: a :class:`keel.model.Transformer` (not yet wrapped by DDP/FSDP).
        mode, every_k: see :func:`checkpointed_blocks`.
        when: called at each chosen block's forward under autograd; False runs that call plain.
    Returns the indices of the checkpointed blocks.
    Raises:
        KeelError: unknown mode, ``every_k < 1``, or a model without ``blocks``.
    """
    blocks = _blocks(model)
    chosen = checkpointed_blocks(len(blocks), mode, every_k)
    for b in chosen:
        block = blocks[b]
        if getattr(block, "_keel_checkpointed", False):
            continue
        original = block.forward

        @functools.wraps(original)
        def forward(*args, _original=original, **kwargs):
            if torch.is_grad_enabled() and (when is None or when()):
                return checkpoint(_original, *args, use_reentrant=False, **kwargs)
            return _original(*args, **kwargs)

        block.forward = forward
        block._keel_checkpointed = True
    return chosen


GRAPHS_PER_BLOCK = 4  # compiled graphs allowed per block: training, no-grad, and their dynamic-shape variants


def apply_compile(model: nn.Module, **compile_kwargs) -> None:
    """``torch.compile`` every block's forward, torchtitan style (per block, not the model).

    Compiling per block keeps the graphs small (the blocks share code, so Dynamo reuses the
    compiled graph across blocks whose guards agree). The block's ``forward`` attribute is
    replaced (no wrapper module), so the parameter names stay those of the plain model: no
    ``_orig_mod.`` prefix in checkpoints. Calls with a KV cache or a padding mask (generation)
    take the eager forward: their ever-growing cache would only trigger recompilations. The embedding,
    final norm, LM head and loss stay eager. Apply after activation checkpointing (the
    checkpointed forward is what gets compiled, as a ``torch.utils.checkpoint`` region inside
    the block's graph) and before DDP/FSDP. ``compile_kwargs`` go to ``torch.compile`` (e.g.
    ``backend="aot_eager"``); ``fullgraph=True`` is the default, so a graph break is an error
    instead of a silently eager block (the norms take a traceable form under compile, see
    :func:`keel.model.norm.rms_norm_of_sum`).

    Dynamo's recompile limit (8 graphs per code object, shared by every block, since they share
    ``Block.forward``) is raised to :data:`GRAPHS_PER_BLOCK` per block: a scheme whose blocks differ
    (Attention Residuals reads the outputs of every earlier block: one graph per depth; Keel's first
    block, Mix-LN's Post-LN blocks, HC's stream index) needs a graph per distinct block and per
    input-shape class (training, no-grad evaluation, sampling), and hit the limit at step 1 from 5
    blocks on (``FailOnRecompileLimitHit``). Raising a limit never lowers it. A looped model's core
    blocks are the same modules at every application: their graphs serve every application and every
    loop count (no recompile as R changes, ``tests/test_compile.py``).
    """
    compile_kwargs.setdefault("fullgraph", True)
    blocks = _blocks(model)
    need = GRAPHS_PER_BLOCK * len(blocks)
    cfg = torch._dynamo.config
    cfg.recompile_limit = max(cfg.recompile_limit, need)
    cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, need + cfg.recompile_limit)
    for block in blocks:
        if getattr(block, "_keel_compiled", False):
            continue
        eager = block.forward
        compiled = torch.compile(eager, **compile_kwargs)

        @functools.wraps(eager)
        def forward(x, cos, sin, cache=None, mask=None, _eager=eager, _compiled=compiled):
            if cache is None and mask is None:
                return _compiled(x, cos, sin)
            return _eager(x, cos, sin, cache, mask)

        block.forward = forward
        block._keel_compiled = True


def apply_fsdp(model: nn.Module, mesh=None, reshard_after_forward: bool = True, bf16: bool = False) -> nn.Module:
    """Shard ``model`` with FSDP2: ``fully_shard`` each block, then the root (in place).

    Parameters become ``DTensor`` shards (dim 0) over ``mesh`` (default: a 1-D mesh of all
    ranks on the model's device type); each block's parameters are all-gathered just before
    its forward/backward and freed after. The tied embedding/LM head, if any, belongs to the
    root group. With ``bf16`` (``train.precision = "bf16"``), torchtitan's mixed precision:
    ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` -- the shards, gradients
    and optimizer state stay fp32, the all-gathered parameters (and so the compute) are bf16,
    gradients are reduced in fp32. Requires an initialised process group. Returns ``model``
    (now also an ``FSDPModule``).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # lazy: +1.3 s of import; only FSDP runs need it

    if mesh is None:
        device_type = next(model.parameters()).device.type
        mesh = init_device_mesh(device_type, (torch.distributed.get_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    for block in _blocks(model):
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)
    return model


def apply_ddp(model: nn.Module, device: torch.device) -> nn.Module:
    """Wrap ``model`` in ``torch.nn.parallel.DistributedDataParallel`` (gradients averaged
    over ranks in the backward pass). Requires an initialised process group; returns the
    wrapper, whose ``.module`` is ``model``."""
    ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ids)


def parallelize(model: nn.Module, tc, info: DistInfo, checkpoint_when: Callable[[], bool] | None = None
                ) -> nn.Module:
    """Apply the transforms ``tc`` (a :class:`keel.config.TrainConfig`) asks for, in order:
    activation checkpointing (on the calls where ``checkpoint_when()`` is true; None: every call,
    :func:`apply_activation_checkpointing`), compile, then DDP or FSDP2 when ``info`` is distributed
    (with bf16 mixed precision for ``train.precision = "bf16"``).

    Returns the module to call for training forwards (the DDP wrapper, or ``model`` itself,
    which FSDP2 shards in place). Raises KeelError on an unknown ``tc.parallelism`` or
    checkpointing mode.
    """
    check_value("train.parallelism", tc.parallelism)
    apply_activation_checkpointing(model, tc.activation_checkpointing, tc.activation_checkpoint_k, checkpoint_when)
    if tc.compile:
        apply_compile(model)
    if not info.distributed:
        return model
    if tc.parallelism == "fsdp":
        return apply_fsdp(model, bf16=tc.precision == "bf16")
    return apply_ddp(model, info.device)


def unwrap(module: nn.Module) -> nn.Module:
    """The plain model inside DDP (``.module``) and ``torch.compile`` (``._orig_mod``) wrappers."""
    while True:
        if isinstance(module, torch.nn.parallel.DistributedDataParallel):
            module = module.module
        elif hasattr(module, "_orig_mod") and isinstance(module._orig_mod, nn.Module):
            module = module._orig_mod
        else:
            return module


@contextlib.contextmanager
def gradient_sync(module: nn.Module, enabled: bool):
    """Context for one micro-batch's forward + backward: with ``enabled=False`` the
    gradients are only accumulated locally (DDP ``no_sync``; FSDP2
    ``set_requires_gradient_sync(False)``), with ``True`` they are reduced across ranks.
    Use ``enabled`` only on the last micro-batch of a gradient-accumulation step."""
    from torch.distributed.fsdp import FSDPModule  # lazy: +1.3 s of import; only FSDP runs need it

    if isinstance(module, torch.nn.parallel.DistributedDataParallel) and not enabled:
        with module.no_sync():
            yield
    elif isinstance(module, FSDPModule):
        module.set_requires_gradient_sync(enabled)
        yield
    else:
        yield
