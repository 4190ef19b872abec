"""Process groups: join the one torchrun describes, and the few collectives the trainer uses.

:func:`init_distributed` joins the process group that ``torchrun`` describes in the
environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``):
NCCL on CUDA, gloo on CPU. Without those variables the run is a single process and every
helper here is a no-op (or returns its input).
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from typing import Callable, TypeVar

import torch
import torch.distributed as dist

from keel.errors import KeelError

T = TypeVar("T")


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


def rank_device(device: torch.device, local_rank: int, n_gpus: int) -> torch.device:
    """The device of the process with ``local_rank`` on its node when the config asks for
    ``device``: a CUDA device -- ``cuda`` or ``cuda:N``, any index -- becomes
    ``cuda:LOCAL_RANK`` (torchtitan's rule: one GPU per process; choose the GPUs with
    ``CUDA_VISIBLE_DEVICES``), so ``train.device = "cuda:0"`` never puts every rank on GPU 0.
    Other devices are returned as they are.

    Raises:
        KeelError: ``local_rank`` has no GPU (``n_gpus`` visible).
    """
    if device.type != "cuda":
        return device
    if local_rank >= n_gpus:
        raise KeelError(f"LOCAL_RANK {local_rank} has no GPU ({n_gpus} visible)")
    return torch.device("cuda", local_rank)


def init_distributed(device: torch.device) -> DistInfo:
    """Join the process group described by the torchrun environment, if there is one.

    Args:
        device: the device the config asks for (``cpu``, ``cuda`` or ``cuda:N``). Under
            torchrun a CUDA device, with or without an index, becomes ``cuda:LOCAL_RANK``
            (:func:`rank_device`).
    Returns:
        :class:`DistInfo`; single process (rank 0 of 1) when not launched by torchrun.
        The backend is NCCL on CUDA and gloo on CPU. A process group that already exists
        (e.g. created by a test) is used as it is.
    Raises:
        KeelError: torchrun variables that are not integers, or a rank without a GPU.
    """
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
        device = rank_device(device, local_rank, torch.cuda.device_count())
        torch.cuda.set_device(device)
    if here:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                rank=rank, world_size=world_size)
    return DistInfo(rank, world_size, local_rank, device, here)


def destroy_distributed(info: DistInfo, finished: bool = False) -> None:
    """End the process group if :func:`init_distributed` created it.

    ``finished``: every rank got here after the same last collective (the run ended without an
    error), so all ranks first meet at a barrier: no rank tears its gloo pairs down while another
    still has a collective in flight, which aborted a rank at exit ("terminate called without an
    active exception", SIGABRT) in about one two-node run in five on a loaded CPU machine. On an
    error path (``finished`` false) there is no barrier: a rank that failed alone would wait there
    for ranks that never come. First a garbage collection: the run's objects that hold the group
    (DDP's reducer, FSDP's state, kept alive by reference cycles) are freed now, not at interpreter
    exit, where gloo work they hold was reported to abort the process (pytorch/pytorch PR 179291).
    """
    if info.initialized_here and torch.distributed.is_initialized():
        gc.collect()  # free the run's model, DDP reducer and FSDP state (reference cycles) while the group is alive
        if finished:
            barrier(info)
        torch.distributed.destroy_process_group()


def broadcast_object(obj, info: DistInfo):
    """Rank 0's ``obj`` (any picklable value) on every rank; ``obj`` itself when single-process."""
    if not info.distributed:
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def check_same_config(config: dict[str, dict], info: DistInfo) -> None:
    """Refuse, on every rank, a run whose ranks were started with different configs (``config``: this
    rank's :meth:`keel.config.Config.to_dict`), before any collective that depends on them: ranks started by
    hand (torchrun on each node) with another ``--set`` crashed in gloo or NCCL ("collective mismatch",
    a traceback per rank). Collective: every rank calls it; no-op in a single process.

    Raises:
        KeelError: one line naming the first key (``section.key``) where a rank differs from rank 0, both
            values, and that rank.
    """
    if not info.distributed:
        return
    every: list = [None] * info.world_size
    dist.all_gather_object(every, config)
    first = every[0]
    for rank, other in enumerate(every[1:], start=1):
        for section in sorted(set(first) | set(other)):
            a, b = first.get(section) or {}, other.get(section) or {}
            for key in sorted(set(a) | set(b)):
                if a.get(key) != b.get(key):
                    raise KeelError(f"rank {rank} was started with {section}.{key} = {b.get(key)!r}, rank 0 with "
                                    f"{a.get(key)!r}: start every rank of a run with the same config and --set keys")


def decide_on_rank0(decide: Callable[[], T], info: DistInfo) -> T:
    """Run ``decide()`` on rank 0 only and return its result (any picklable value) on every
    rank. Collective: every rank calls it.

    Raises:
        KeelError: on every rank, with rank 0's one-line message, when ``decide()`` raised
            a KeelError there (the other ranks never run ``decide``).
    """
    value, error = None, None
    if info.is_main:
        try:
            value = decide()
        except KeelError as e:
            error = str(e)
    value, error = broadcast_object((value, error), info)
    if error is not None:
        raise KeelError(error)
    return value


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
