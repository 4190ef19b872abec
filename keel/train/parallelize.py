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

:func:`init_distributed` joins the process group that ``torchrun`` describes in the
environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``):
NCCL on CUDA, gloo on CPU. Without those variables the run is a single process.

Helpers that must see the whole model whatever the sharding: :func:`clip_grad_norm_` (the
full L2 norm of all gradients, also when they are FSDP2 ``DTensor`` shards),
:func:`full_model_state_dict` / :func:`full_optimizer_state_dict` (gathered, on CPU, keyed
by parameter name: what a world-size-independent checkpoint stores) and
:func:`load_optimizer_state_dict`.

:func:`memory_estimate` gives the bytes a training step needs (parameters, gradients, AdamW
state, stored activations per block), with and without activation checkpointing.
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass

import torch
import torch.nn as nn

from keel.errors import KeelError

AC_MODES = ("none", "block", "every_k")
PARALLELISMS = ("ddp", "fsdp")


# --------------------------------------------------------------------------- processes


@dataclass
class DistInfo:
    """Where this process sits: ``rank`` of ``world_size`` processes, ``local_rank`` on its
    node, the ``device`` it computes on; ``initialized_here`` when :func:`init_distributed`
    created the process group (and :func:`destroy_distributed` should end it)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    initialized_here: bool = False

    @property
    def distributed(self) -> bool:
        """True when a process group is in use (launched by torchrun)."""
        return torch.distributed.is_available() and torch.distributed.is_initialized()

    @property
    def is_main(self) -> bool:
        """Rank 0: the one process that writes files and logs."""
        return self.rank == 0


def launched_by_torchrun() -> bool:
    """True when the torchrun environment variables ``RANK`` and ``WORLD_SIZE`` are set."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def init_distributed(device: torch.device) -> DistInfo:
    """Join the process group described by the torchrun environment, if there is one.

    Args:
        device: the device the config asks for (``cpu``, ``cuda`` or ``cuda:N``). Under
            torchrun a CUDA device without an index becomes ``cuda:LOCAL_RANK``.
    Returns:
        :class:`DistInfo`; single process (rank 0 of 1) when not launched by torchrun.
        The backend is NCCL on CUDA and gloo on CPU. A process group that already exists
        (e.g. created by a test) is used as it is.
    Raises:
        KeelError: torchrun variables that are not integers, or a rank without a GPU.
    """
    import torch.distributed as dist

    if not dist.is_available() or not (launched_by_torchrun() or dist.is_initialized()):
        return DistInfo(device=device)
    if dist.is_initialized():
        rank, world_size = dist.get_rank(), dist.get_world_size()
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        here = False
    else:
        try:
            rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        except ValueError:
            raise KeelError("RANK, WORLD_SIZE and LOCAL_RANK must be integers (set by torchrun)") from None
        here = True
    if device.type == "cuda":
        if device.index is None:
            if local_rank >= torch.cuda.device_count():
                raise KeelError(f"LOCAL_RANK {local_rank} has no GPU ({torch.cuda.device_count()} visible)")
            device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    if here:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                rank=rank, world_size=world_size)
    return DistInfo(rank, world_size, local_rank, device, here)


def destroy_distributed(info: DistInfo) -> None:
    """End the process group if :func:`init_distributed` created it."""
    if info.initialized_here and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def broadcast_object(obj, info: DistInfo):
    """Rank 0's ``obj`` (any picklable value) on every rank; ``obj`` itself when single-process."""
    if not info.distributed:
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def barrier(info: DistInfo) -> None:
    """Wait for all ranks (no-op in a single process)."""
    if info.distributed:
        torch.distributed.barrier()


def all_reduce_mean(value: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """The mean over ranks of a same-shaped tensor on every rank (SUM, then / world size;
    gloo has no AVG). Returns ``value`` itself in a single process."""
    if not info.distributed or info.world_size == 1:
        return value
    value = value.clone()
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.SUM)
    return value / info.world_size


def all_reduce_sum(value: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """The sum over ranks of a same-shaped tensor on every rank (a copy)."""
    if not info.distributed or info.world_size == 1:
        return value
    value = value.clone()
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.SUM)
    return value


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
    if mode not in AC_MODES:
        raise KeelError(f"train.activation_checkpointing must be one of {', '.join(AC_MODES)}, got {mode!r}")
    if mode == "every_k" and every_k < 1:
        raise KeelError(f"train.checkpoint_k must be >= 1, got {every_k}")
    if mode == "none":
        return []
    if mode == "block":
        return list(range(n_blocks))
    return list(range(0, n_blocks, every_k))


def apply_activation_checkpointing(model: nn.Module, mode: str, every_k: int = 2) -> list[int]:
    """Recompute the chosen blocks' activations in the backward pass (in place).

    Each chosen block's ``forward`` is replaced by one that runs the original under
    ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` whenever autograd is
    recording; with gradients off (evaluation, generation with a KV cache) it runs the
    plain forward. Only the block's input (x [B, T, d]) stays alive between forward and
    backward, so memory for stored activations drops from one block's worth per block to
    one input per block plus one block's worth during its recomputation (see
    :func:`memory_estimate`). Parameter names are unchanged (no wrapper module), so
    checkpoints and diagnostics see the same names. Gradients are bit-identical on CPU:
    the recomputation runs the same kernels on the same inputs.

    Args:
        model: a :class:`keel.model.Transformer` (not yet wrapped by DDP/FSDP).
        mode, every_k: see :func:`checkpointed_blocks`.
    Returns the indices of the checkpointed blocks.
    Raises:
        KeelError: unknown mode, ``every_k < 1``, or a model without ``blocks``.
    """
    from torch.utils.checkpoint import checkpoint

    blocks = _blocks(model)
    chosen = checkpointed_blocks(len(blocks), mode, every_k)
    for b in chosen:
        block = blocks[b]
        if getattr(block, "_keel_checkpointed", False):
            continue
        original = block.forward

        @functools.wraps(original)
        def forward(*args, _original=original, **kwargs):
            if torch.is_grad_enabled():
                return checkpoint(_original, *args, use_reentrant=False, **kwargs)
            return _original(*args, **kwargs)

        block.forward = forward
        block._keel_checkpointed = True
    return chosen


def apply_compile(model: nn.Module, **compile_kwargs) -> None:
    """``torch.compile`` every block's forward, torchtitan style (per block, not the model).

    Compiling per block keeps the graphs small (the blocks share code, so Dynamo reuses the
    compiled graph across blocks whose guards agree). The block's ``forward`` attribute is
    replaced (no wrapper module), so the parameter names stay those of the plain model: no
    ``_orig_mod.`` prefix in checkpoints. Calls with a KV cache (generation) take the eager
    forward: their ever-growing cache would only trigger recompilations. The embedding,
    final norm, LM head and loss stay eager. Apply after activation checkpointing (the
    checkpointed forward is what gets compiled) and before DDP/FSDP. ``compile_kwargs`` go to
    ``torch.compile`` (e.g. ``backend="aot_eager"``).
    """
    for block in _blocks(model):
        if getattr(block, "_keel_compiled", False):
            continue
        eager = block.forward
        compiled = torch.compile(eager, **compile_kwargs)

        @functools.wraps(eager)
        def forward(x, cos, sin, cache=None, _eager=eager, _compiled=compiled):
            if cache is None:
                return _compiled(x, cos, sin)
            return _eager(x, cos, sin, cache)

        block.forward = forward
        block._keel_compiled = True


def apply_fsdp(model: nn.Module, mesh=None, reshard_after_forward: bool = True) -> nn.Module:
    """Shard ``model`` with FSDP2: ``fully_shard`` each block, then the root (in place).

    Parameters become ``DTensor`` shards (dim 0) over ``mesh`` (default: a 1-D mesh of all
    ranks on the model's device type); each block's parameters are all-gathered just before
    its forward/backward and freed after. The tied embedding/LM head, if any, belongs to the
    root group. Requires an initialised process group. Returns ``model`` (now also an
    ``FSDPModule``).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if mesh is None:
        device_type = next(model.parameters()).device.type
        mesh = init_device_mesh(device_type, (torch.distributed.get_world_size(),))
    for block in _blocks(model):
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    return model


def apply_ddp(model: nn.Module, device: torch.device) -> nn.Module:
    """Wrap ``model`` in ``torch.nn.parallel.DistributedDataParallel`` (gradients averaged
    over ranks in the backward pass). Requires an initialised process group; returns the
    wrapper, whose ``.module`` is ``model``."""
    from torch.nn.parallel import DistributedDataParallel

    ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ids)


def parallelize(model: nn.Module, tc, info: DistInfo) -> nn.Module:
    """Apply the transforms ``tc`` (a :class:`keel.config.TrainConfig`) asks for, in order:
    activation checkpointing, compile, then DDP or FSDP2 when ``info`` is distributed.

    Returns the module to call for training forwards (the DDP wrapper, or ``model`` itself,
    which FSDP2 shards in place). Raises KeelError on an unknown ``tc.parallelism`` or
    checkpointing mode.
    """
    if tc.parallelism not in PARALLELISMS:
        raise KeelError(f"train.parallelism must be one of {', '.join(PARALLELISMS)}, got {tc.parallelism!r}")
    apply_activation_checkpointing(model, tc.activation_checkpointing, tc.checkpoint_k)
    if tc.compile:
        apply_compile(model)
    if not info.distributed:
        return model
    if tc.parallelism == "fsdp":
        return apply_fsdp(model)
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
    from torch.distributed.fsdp import FSDPModule

    if isinstance(module, torch.nn.parallel.DistributedDataParallel) and not enabled:
        with module.no_sync():
            yield
    elif isinstance(module, FSDPModule):
        module.set_requires_gradient_sync(enabled)
        yield
    else:
        yield


# --------------------------------------------------------------------------- whole-model views


def clip_grad_norm_(parameters, max_norm: float) -> float:
    """Clip gradients in place to total L2 norm ``max_norm``; return the norm before clipping.

    The norm is ``sqrt(sum_p ||grad_p||_2^2)`` over all parameters of the model, computed
    by ``torch.nn.utils.get_total_norm``. Under FSDP2 the gradients are ``DTensor`` shards
    and that norm is a ``DTensor`` with a pending (partial) reduction; ``.full_tensor()``
    completes it across ranks, so the value equals the single-process/DDP norm (torchtitan,
    ``dist_utils.clip_grad_norm_``; a local-shard norm would be wrong by up to sqrt(world
    size) and worse). Scaling is ``torch.nn.utils.clip_grads_with_norm_``: every gradient is
    multiplied by ``min(1, max_norm / (norm + 1e-6))``. ``max_norm = inf`` only measures.

    Returns a Python float (``nan``/``inf`` when a gradient is not finite).
    """
    from torch.distributed.tensor import DTensor

    params = [p for p in parameters if p.grad is not None]
    if not params:
        return 0.0
    total = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return float(total.item())


def _full_options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True)


def full_model_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full (unsharded) weights on CPU, keyed by the plain model's parameter names.

    ``torch.distributed.checkpoint.state_dict.get_model_state_dict`` with
    ``full_state_dict=True, cpu_offload=True``: FSDP2 shards are all-gathered, DDP's
    ``module.`` and compile's ``_orig_mod.`` prefixes are dropped. Collective under FSDP
    (call it on every rank); in a process group only rank 0 receives the tensors, the other
    ranks get ``{}``. Tied weights appear under every name.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(unwrap(model), options=_full_options())


def full_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The full optimizer state on CPU, keyed by parameter name (not by index), so it loads
    at any world size and with or without FSDP. Collective under FSDP; only rank 0 receives
    it in a process group (``{}`` elsewhere). Format: ``{"state": {name: {"step", "exp_avg",
    "exp_avg_sq"}}, "param_groups": [{..., "params": [names]}]}`` for AdamW."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(unwrap(model), optimizer, options=_full_options())


def load_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Load a state from :func:`full_optimizer_state_dict` (every rank passes the full state;
    each keeps its own shard under FSDP2). A legacy index-keyed ``optimizer.state_dict()``
    is loaded directly when the model is not sharded.

    Raises:
        KeelError: an index-keyed state with a sharded (FSDP) model.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
    from torch.distributed.fsdp import FSDPModule

    keys = list(state.get("state", {}))
    if keys and isinstance(keys[0], int):
        if isinstance(unwrap(model), FSDPModule):
            raise KeelError("this checkpoint's optimizer state is index-keyed (old format); "
                            "resume it without FSDP first")
        optimizer.load_state_dict(state)
        return
    set_optimizer_state_dict(unwrap(model), optimizer, state, options=StateDictOptions(full_state_dict=True))


# --------------------------------------------------------------------------- memory model


def activation_bytes_per_block(batch: int, seq_len: int, d_model: int, d_ff: int, n_heads: int,
                               n_kv_heads: int, residual: str = "keel", bytes_per_el: int = 4) -> int:
    """Bytes autograd keeps alive for one block's backward (fp32, no checkpointing, CPU SDPA),
    not counting the block's input, which belongs to the previous block.

    With E = B·T tokens, hd = d/H, kv = K·hd (the width of k and v)::

        floats = E · (c_d·d + 4·f + 2·kv + H + c_1) + T·hd

    * ``4·f``: SwiGLU keeps w1·x, w3·x, silu(w1·x) and their product ([E, f] each);
    * ``2·kv``: the k and v of grouped-query attention before the GQA broadcast;
    * ``H``: SDPA's logsumexp, one float per head and token;
    * ``T·hd``: the RoPE cos/sin slices ([T, hd/2] each), shared by the batch;
    * ``c_d·d + c_1``: every other [E, d] tensor (normed inputs, q, q after RoPE, SDPA
      output and its reshaped copy, the normalised value each RMSNorm keeps for its
      hand-written backward, :func:`keel.model.residual.rms_norm_of_sum`) and every
      per-token 1/rms of an RMSNorm. Pre-LN and Mix-LN (its Pre-LN blocks; its Post-LN blocks
      need less): ``c_d = 7, c_1 = 2``; Post-LN and DeepNorm, whose norm output is the next
      sub-layer's matmul input (one tensor, saved once): ``c_d = 6, c_1 = 2``; Keel, whose
      sub-layers carry two RMSNorms each (Norm_in and Norm_out): ``c_d = 9, c_1 = 4``.

    The coefficients were read off ``torch.autograd.graph.saved_tensors_hooks`` (unique
    storages) by an exact least-squares fit over 72 shapes (residual 0); the test suite
    re-measures at other shapes (:func:`measure_activation_bytes_per_block`). Schemes without
    coefficients here (e.g. ``hybridnorm``) are measured directly on a 1-block model.
    Per-block accounting follows Korthikanti et al. 2022, "Reducing Activation Recomputation
    in Large Transformer Models", Sec. 4.1 (their 34·s·b·h counts bf16 bytes with dropout).

    Returns bytes (int).
    """
    if residual not in _ACT_CONSTANTS:
        from keel.config import ModelConfig

        cfg = ModelConfig(vocab_size=8, d_model=d_model, n_layers=3, n_heads=n_heads, n_kv_heads=n_kv_heads,
                          d_ff=d_ff, max_seq_len=seq_len, residual=residual)
        return measure_activation_bytes_per_block(cfg, batch, seq_len) * bytes_per_el // 4
    hd = d_model // n_heads
    kv = n_kv_heads * hd
    c_d, c_1 = _ACT_CONSTANTS[residual]
    floats = batch * seq_len * (c_d * d_model + 4 * d_ff + 2 * kv + n_heads + c_1) + seq_len * hd
    return floats * bytes_per_el


# (c_d, c_1) per residual scheme; see activation_bytes_per_block.
_ACT_CONSTANTS: dict[str, tuple[int, int]] = {
    "pre_ln": (7, 2), "post_ln": (6, 2), "deepnorm": (6, 2), "mix_ln": (7, 2), "keel": (9, 4),
}


def measure_activation_bytes_per_block(cfg, batch: int, seq_len: int, block_index: int = -1) -> int:
    """Measured bytes autograd saves for one block's backward: the sum of the unique
    storages packed by ``torch.autograd.graph.saved_tensors_hooks`` during the forward of
    block ``block_index`` of a fresh fp32 ``Transformer(cfg)`` on a random input
    x [batch, seq_len, d] (parameters and x itself are not counted). Needs
    ``cfg.n_layers >= 3`` for the default last block to be a generic (not first) one."""
    from keel.model import Transformer

    model = Transformer(cfg)
    block = model.blocks[block_index]
    x = torch.randn(batch, seq_len, cfg.d_model, requires_grad=True)
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()} | {x.untyped_storage().data_ptr()}
    sizes: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            sizes[st.data_ptr()] = max(sizes.get(st.data_ptr(), 0), st.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x, model.rope_cos[:seq_len], model.rope_sin[:seq_len])
    return sum(sizes.values())


def memory_estimate(n_params: int, n_blocks: int, batch: int, seq_len: int, d_model: int, d_ff: int,
                    n_heads: int, n_kv_heads: int, vocab_size: int, residual: str = "keel",
                    activation_checkpointing: str = "none", checkpoint_k: int = 2,
                    fused_adamw: bool = False) -> dict[str, int]:
    """Bytes of fp32 AdamW training steps on one process (no sharding).

    * parameters 4·P, gradients 4·P, AdamW state (exp_avg, exp_avg_sq) 8·P: 16·P bytes;
    * stored activations: for a checkpointed block only its input, 4·B·T·d bytes, kept from
      forward to backward; for any other block :func:`activation_bytes_per_block`; plus,
      while one checkpointed block is recomputed in the backward pass, one block's full
      activations (at most one at a time);
    * the head: logits and their softmax for cross-entropy, fp32 [B·T, V] twice (8·B·T·V),
      plus the final hidden state (4·B·T·d).

    Peak: the terms do not all coexist. Right after the forward pass of a step (after the
    first), parameters, AdamW state, activations and the head are live, gradients are not
    (``zero_grad(set_to_none=True)``): ``forward_peak = 12·P + activations + head``. In the
    backward pass gradients grow as activations are freed. In the optimizer step, the
    foreach AdamW (CPU) adds a temporary ``sqrt(exp_avg_sq)`` list of 4·P bytes
    (``torch/optim/adamw.py``, ``_multi_tensor_adamw``): ``optimizer_peak = 20·P`` (16·P with
    ``fused=True``, as on CUDA). ``peak = max(forward_peak, optimizer_peak)``; ``total`` is
    the plain sum of all terms, an upper bound.

    Sources: Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
    Transformer Models", Sec. 4) for the per-block accounting; Chen et al. 2016 ("Training
    Deep Nets with Sublinear Memory Cost") for checkpointing. Returns a dict of byte counts:
    ``params``, ``grads``, ``optimizer``, ``activations``, ``head``, ``total``,
    ``forward_peak``, ``optimizer_peak``, ``peak`` (``fused_adamw=True``: no 4·P temporary).
    """
    per_block = activation_bytes_per_block(batch, seq_len, d_model, d_ff, n_heads, n_kv_heads, residual)
    ckpt = set(checkpointed_blocks(n_blocks, activation_checkpointing, checkpoint_k))
    block_input = 4 * batch * seq_len * d_model
    acts = sum(block_input if b in ckpt else per_block for b in range(n_blocks))
    if ckpt:
        acts += per_block  # one block recomputed at a time
    head = 8 * batch * seq_len * vocab_size + 4 * batch * seq_len * d_model
    out = {"params": 4 * n_params, "grads": 4 * n_params, "optimizer": 8 * n_params,
           "activations": acts, "head": head}
    out["total"] = sum(out.values())
    out["forward_peak"] = out["params"] + out["optimizer"] + acts + head
    out["optimizer_peak"] = out["params"] + out["grads"] + out["optimizer"] + (0 if fused_adamw else 4 * n_params)
    out["peak"] = max(out["forward_peak"], out["optimizer_peak"])
    return out
