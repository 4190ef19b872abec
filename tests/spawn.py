"""Run several training jobs in N local processes without torchrun (tests, notebooks).

``spawn_training(jobs, world_size)`` starts ``world_size`` processes with
``torch.multiprocessing`` (spawn), gives each the environment torchrun would
(``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) and runs the
jobs one after another in every process through :func:`keel.train.train`, which joins the
process group from that environment (gloo on CPU) and leaves it at the end of each job.
The command-line way is ``keel train --nproc N`` (torchrun underneath).
"""

from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for ``MASTER_PORT``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, ports: list[int], jobs, threads: int) -> None:
    import faulthandler

    import torch

    faulthandler.enable()  # a rank that aborts (SIGABRT from C++) prints its Python stack in the test's output

    torch.set_num_threads(threads)
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                       "MASTER_ADDR": "127.0.0.1"})
    from keel.train import train

    for port, (cfg, run_dir, resume) in zip(ports, jobs):
        # a fresh rendezvous port per job: a rank that finishes a job early must not reach the
        # previous job's store while rank 0 is still tearing it down
        os.environ["MASTER_PORT"] = str(port)
        train(cfg, run_dir, resume=resume)


def spawn_training(jobs: list[tuple], world_size: int, threads_per_process: int = 1) -> None:
    """Run ``jobs`` -- ``(Config, run_dir, resume)`` tuples, in order -- with ``world_size``
    processes each, like ``torchrun --nproc_per_node world_size -m keel train`` would. Each
job gets its own rendezvous port (``MASTER_PORT``).

    Raises ``torch.multiprocessing.ProcessRaisedException`` carrying a worker's exception
    (e.g. a KeelError) if one fails.
    """
    import torch.multiprocessing as mp

    jobs = [(cfg, str(Path(run_dir)), bool(resume)) for cfg, run_dir, resume in jobs]
    ports: list[int] = []
    while len(ports) < len(jobs):
        port = free_port()
        if port not in ports:
            ports.append(port)
    mp.start_processes(_worker, args=(world_size, ports, jobs, threads_per_process), nprocs=world_size,
                       join=True, start_method="spawn")


def truncate_to(src: Path, dst: Path, step: int) -> Path:
    """A copy of run ``src`` as if it had been interrupted right after checkpoint ``step``."""
    shutil.copytree(src, dst)
    name = f"step_{step:08d}"
    for p in (dst / "checkpoints").glob("step_*"):
        if p.name > name:
            shutil.rmtree(p)
    (dst / "checkpoints" / "latest").write_text(name + "\n")
    return dst
