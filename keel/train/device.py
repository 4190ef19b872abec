"""Devices and precision: which device a run computes on, and in which precision (``train.precision``)."""

from __future__ import annotations

import contextlib
import logging
import os
import re

import torch

from keel.config import ModelConfig, TrainConfig, check_value
from keel.keys import choices
from keel.errors import KeelError
from keel.model import count_parameters, get_scheme, largest_loop_count

PRECISIONS = choices(TrainConfig, "precision")  # declared once, in keel.config.TrainConfig
log = logging.getLogger(__name__)


# Dense bf16 tensor-core peaks from the vendors' datasheets, TFLOP/s (no sparsity): MFU's
# denominator for a CUDA device of that name (peak_flops; benchmarks/mfu.py).
GPU_PEAK_TFLOPS: dict[str, float] = {
    "H200": 989.0,   # H200 SXM; same compute as H100 SXM
    "H100 PCIe": 756.0,
    "H100": 989.0,   # H100 SXM
    "GH200": 989.0,
    "A100": 312.0,
    "L40S": 362.0,
    "A10G": 70.0,
    "RTX 4090": 165.0,
}


def gpu_peak_flops(name: str) -> float | None:
    """Datasheet dense bf16 peak (FLOP/s) for a CUDA device name, first matching key of
    :data:`GPU_PEAK_TFLOPS` (longer keys first, so "H100 PCIe" wins over "H100"); None if unknown."""
    for k in sorted(GPU_PEAK_TFLOPS, key=len, reverse=True):
        if k.lower() in name.lower():
            return GPU_PEAK_TFLOPS[k] * 1e12
    return None


def peak_flops(device: torch.device, peak_tflops: float = 0.0) -> float | None:
    """One process's peak FLOP/s for MFU: ``peak_tflops`` (``train.peak_tflops``) when > 0, else
    the datasheet peak of a known CUDA device (:func:`gpu_peak_flops`); None on a CPU or an
    unknown GPU (no MFU is logged)."""
    if peak_tflops > 0:
        return peak_tflops * 1e12
    if device.type == "cuda":
        return gpu_peak_flops(torch.cuda.get_device_name(device))
    return None


def resolve_device(spec: str, key: str = "train.device") -> torch.device:
    """``auto`` -> cuda if available else cpu; otherwise ``torch.device(spec)``.

    Args:
        spec: "auto" | "cpu" | "cuda" | "cuda:N".
        key: how the user gave ``spec`` (a config key or a CLI flag), for the error message.
    Raises:
        KeelError: an unknown device string, or cuda without a CUDA device.
    """
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise KeelError(f"unknown {key} {spec!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise KeelError(f"{key} is cuda but no CUDA device is available")
    return device


def host_memory_bytes() -> int:
    """The memory this process may use (bytes): the machine's physical memory (``sysconf``, POSIX),
    or the address-space limit (``ulimit -v``, RLIMIT_AS) when that is lower."""
    have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    with contextlib.suppress(ImportError, ValueError, OSError):
        import resource  # noqa: PLC0415 - POSIX only

        soft = resource.getrlimit(resource.RLIMIT_AS)[0]
        if soft != resource.RLIM_INFINITY:
            have = min(have, soft)
    return have


def rope_table_bytes(model_cfg: ModelConfig) -> int:
    """Bytes of RoPE's fp32 cos and sin tables: ``2 x max_seq_len x head_dim x 4``."""
    return 2 * model_cfg.max_seq_len * model_cfg.head_dim * 4


def activation_floor_bytes(model_cfg: ModelConfig, train_cfg: TrainConfig, world_size: int = 1,
                           loops: int | None = None) -> int:
    """A floor on the bytes one training micro-batch needs beside the weights (fp32, one process of
    ``world_size``): RoPE's cos and sin tables (``max_seq_len x head_dim`` each), and the activations
    autograd keeps for the backward, per token and applied block at least the inputs of the attention's four
    projections and of the FFN's (``4 d_model + 2 d_ff`` values) and, for a multi-stream scheme of m
    stream copies (:meth:`keel.model.Residual.stream_copies`: HC/mHC's n streams, AttnRes's sources),
    each sub-layer's stream input (``2 m d_model``); or the block's stream input (``m d_model``) under
    activation checkpointing (the recomputed block's own on top). Real use is higher (attention scores,
    logits, optimizer temporaries): this only catches what cannot fit at all. A looped core keeps its
    inputs per application, ``loops`` times (None: the most a step of the run applies,
    :func:`keel.model.largest_loop_count`, not the mean R: with ``model.loop_sampling`` uniform or
    poisson_lognormal some steps run 2R - 1 or about 5R). With ``train.activation_checkpoint_min_loops`` = n
    > 0 a step that draws fewer than n applications keeps every activation: the floor is the larger of
    the plain floor at min(loops, n - 1) applications and the checkpointed one at ``loops``."""
    rope = rope_table_bytes(model_cfg)
    tokens = -(-train_cfg.batch_size // max(1, world_size)) * train_cfg.seq_len
    m = get_scheme(model_cfg.residual).stream_copies(model_cfg)
    plain = 4 * model_cfg.d_model + 2 * model_cfg.d_ff + (2 * m * model_cfg.d_model if m > 1 else 0)
    if loops is None:
        loops = largest_loop_count(model_cfg, train_cfg.seed, train_cfg.steps)

    def saved(per_block: int, r: int) -> int:  # the values a step keeps with the core applied r times
        return tokens * (model_cfg.n_layers + (r - 1) * model_cfg.loop_core) * per_block * 4  # P + r C + Q blocks

    if train_cfg.activation_checkpointing == "none":
        return rope + saved(plain, loops)
    below = min(loops, train_cfg.activation_checkpoint_min_loops - 1) if model_cfg.loop_core else 0
    return rope + max(saved(m * model_cfg.d_model, loops), saved(plain, below) if below >= 1 else 0)


def check_activations_fit(model_cfg: ModelConfig, train_cfg: TrainConfig, world_size: int = 1) -> None:
    """Refuse a CPU training run whose weights and :func:`activation_floor_bytes` exceed this
    process's memory (:func:`host_memory_bytes`): e.g. ``train.batch_size=40000`` or
    ``model.max_seq_len=200000000`` used to end in the allocator's 80-line traceback. A looped model
    is sized at the most core applications a step of the run draws (:func:`keel.model.largest_loop_count`:
    2R - 1 with ``model.loop_sampling`` uniform; with poisson_lognormal, which has no largest, the largest
    the run's own steps draw), not at the mean R: a run that fits only at R ran out of memory at the first
    step that drew more.

    Raises:
        KeelError: one line naming the keys and the numbers.
    """
    weights = count_parameters(model_cfg) * 16 if model_cfg.vocab_size != "auto" else 0
    loops = largest_loop_count(model_cfg, train_cfg.seed, train_cfg.steps)
    need, have = weights + activation_floor_bytes(model_cfg, train_cfg, world_size, loops), host_memory_bytes()
    rope = rope_table_bytes(model_cfg)
    if rope > have:
        raise KeelError(f"model.max_seq_len {model_cfg.max_seq_len:,}: RoPE's cos and sin tables alone need "
                        f"{rope / 2**30:,.1f} GiB, more than the {have / 2**30:,.1f} GiB this process may use")
    if need > have:
        drawn = "" if loops == model_cfg.loop_repeats else \
            f" (the core applied {loops} times, the most a step draws with model.loop_sampling {model_cfg.loop_sampling})"
        raise KeelError(f"train.batch_size {train_cfg.batch_size} x train.seq_len {train_cfg.seq_len} on "
                        f"{2 * (model_cfg.n_layers + (loops - 1) * model_cfg.loop_core):,} sub-layers{drawn} "
                        f"at width {model_cfg.d_model} needs at least "
                        f"{need / 2**30:,.1f} GiB with its activations, more than the {have / 2**30:,.1f} GiB this "
                        "process may use; lower the batch or sequence length, or "
                        + ("set train.activation_checkpointing" if train_cfg.activation_checkpointing == "none" else
                           "lower train.activation_checkpoint_min_loops"
                           if train_cfg.activation_checkpoint_min_loops and model_cfg.loop_core else
                           "train a smaller model"))


def check_model_fits(model_cfg: ModelConfig, bytes_per_param: int, what: str) -> None:
    """Refuse a model whose ``bytes_per_param`` bytes per parameter (e.g. 4 for fp32 weights,
    16 for fp32 weights, gradients and AdamW's two moments) exceed this machine's memory.
    Every model is built on the CPU before it moves to its device, so the host's memory is
    the bound; the count is :func:`keel.model.count_parameters` (no allocation). A floor, not
    an estimate: activations come on top.

    Raises:
        KeelError: the model cannot fit, e.g. a mistyped depth (one line, with the numbers).
    """
    n = count_parameters(model_cfg)
    need, have = n * bytes_per_param, host_memory_bytes()
    if need > have:
        raise KeelError(f"{model_cfg.n_sublayers:,} sub-layers at width {model_cfg.d_model}: {n:,} parameters need "
                        f"{need / 2**30:,.1f} GiB for {what} alone, more than this machine's "
                        f"{have / 2**30:,.1f} GiB of memory")


_ALLOCATION = re.compile(r"(?:can't allocate memory|out of memory)", re.IGNORECASE)
_ASKED = re.compile(r"(?:tried to allocate|Tried to allocate) ([0-9.]+) ?(bytes|[KMG]iB)")


def is_out_of_memory(e: BaseException) -> bool:
    """Whether ``e`` is an allocation failure: ``MemoryError``, ``torch.OutOfMemoryError`` (CUDA)
    or the CPU allocator's ``RuntimeError`` ("DefaultCPUAllocator: can't allocate memory")."""
    return isinstance(e, (MemoryError, torch.OutOfMemoryError)) or (
        isinstance(e, RuntimeError) and bool(_ALLOCATION.search(str(e))))


@contextlib.contextmanager
def memory_errors(train_cfg: TrainConfig):
    """Turn an allocation failure inside the block (:func:`is_out_of_memory`; one the estimate of
    :func:`check_activations_fit` did not foresee, e.g. attention scores or a scheme's extra
    streams) into one line saying what it asked for and which settings to lower (it was the
    allocator's 80-line traceback).

    Raises:
        KeelError: as above; any other error passes through.
    """
    try:
        yield
    except Exception as e:  # noqa: BLE001 -- RuntimeError / OutOfMemoryError / MemoryError: see is_out_of_memory
        if not is_out_of_memory(e):
            raise
        asked = _ASKED.search(str(e))
        size = ""
        if asked:
            n, unit = float(asked.group(1)), asked.group(2)
            n *= {"bytes": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]
            size = f" (it asked for {n / 2**20:,.0f} MiB more)"
        raise KeelError(f"out of memory while training{size}: lower train.batch_size ({train_cfg.batch_size}) or "
                        f"train.seq_len ({train_cfg.seq_len}) (raise train.grad_accum, now {train_cfg.grad_accum}, "
                        "to keep the batch), set train.activation_checkpointing, or train a smaller model") from None


def resolve_precision(device: torch.device, precision: str) -> str:
    """The precision a run uses on ``device``: ``fp32``, ``bf16-autocast``, ``bf16`` or ``fp16-autocast``.

    ``auto`` is ``bf16-autocast`` on a CUDA device with native bf16 (compute capability >= 8.0,
    Ampere or newer), ``fp32`` on an older GPU (logged, with the hint that ``fp16-autocast``
    trains in half precision there: emulated bf16 would be slower) and on the CPU; ``auto``
    never picks fp16 (it needs loss scaling and can overflow). An explicit bf16 precision on a
    GPU without native bf16 is refused; ``fp16-autocast`` runs on every CUDA GPU and on the CPU
    (CPU autocast supports float16; slow, for tests).

    Raises:
        KeelError: ``precision`` not one of ``train.precision``'s declared values (:data:`PRECISIONS`),
            or a bf16 precision on a CUDA device without native bf16.
    """
    check_value("train.precision", precision)
    native = device.type != "cuda" or torch.cuda.is_bf16_supported(including_emulation=False)
    if precision == "auto":
        if device.type == "cuda" and not native:
            log.warning("train.precision = auto: %s has no native bf16 (compute capability < 8.0): training in fp32 "
                        "(train.precision = \"fp16-autocast\" trains in half precision with loss scaling)", device)
        return "bf16-autocast" if device.type == "cuda" and native else "fp32"
    if precision.startswith("bf16") and not native:
        raise KeelError(f"train.precision = {precision!r} needs a GPU with native bf16 (compute capability >= 8.0, "
                        f"Ampere or newer); {device} has none: use train.precision = \"fp16-autocast\" or \"fp32\"")
    return precision


@contextlib.contextmanager
def flushing_denormals(enabled: bool):
    """Flush subnormal (denormal) float32/float64 values to zero on the CPU inside the block
    (``torch.set_flush_denormal``, the x86 FTZ/DAZ flags) when ``enabled``; do nothing otherwise.

    Why: arithmetic on subnormal numbers (|x| < 1.18e-38 in float32) takes a slow microcode
    path on x86. A deep Post-LN that stagnates has thousands of subnormal gradient entries
    (~17,000 at step 750 of the 64-sub-layer, LR 3e-2 study run), and its backward then runs
    ~8x slower (3.45 s vs 0.42 s per step, 1 thread); flushing them changes no other value.
    torch has no getter for the flag, so it is turned off (torch's default) on exit; a CPU
    without FTZ/DAZ support runs the block unchanged. CUDA kernels are not affected.
    """
    if not enabled:
        yield
        return
    torch.set_flush_denormal(True)
    try:
        yield
    finally:
        torch.set_flush_denormal(False)


def autocast_context(device: torch.device, precision: str, sharded: bool = False):
    """The context a training forward runs in: bf16 autocast for ``bf16-autocast``, and for
    ``bf16`` unless the model is ``sharded`` by FSDP2 (whose MixedPrecisionPolicy then casts
    the parameters, :func:`keel.train.parallelize.apply_fsdp`); fp16 autocast for
    ``fp16-autocast`` (the weights stay fp32; the backward needs a loss scaler,
    :class:`keel.train.loss_scaling.LossScaling`); none for ``fp32``. ``precision`` is resolved
    first (:func:`resolve_precision`).

    Raises:
        KeelError: as :func:`resolve_precision`.
    """
    precision = resolve_precision(device, precision)
    if precision == "fp32" or (precision == "bf16" and sharded):
        return contextlib.nullcontext()
    dtype = torch.float16 if precision == "fp16-autocast" else torch.bfloat16
    return torch.autocast(device_type=device.type, dtype=dtype)
