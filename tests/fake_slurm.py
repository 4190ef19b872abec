"""A stand-in for Slurm's commands where no Slurm runs (tests): ``sbatch``, ``squeue``, ``sacct``,
``scancel``, ``scontrol`` and ``srun``, each a link to this file (:func:`install`), keeping their
state in the folder ``FAKE_SLURM`` names.

``sbatch SCRIPT`` keeps a copy of the script (``submissions/<id>.sh``), prints ``Submitted batch job
<id>`` and starts a detached runner that runs the script once per array task (``#SBATCH --array=0-N%CAP``:
at most CAP at a time; no array: once) with the environment Slurm gives a job (``SLURM_JOB_ID``,
``SLURM_ARRAY_JOB_ID``/``SLURM_ARRAY_TASK_ID``, ``SLURM_CPUS_PER_TASK``, ``SLURM_JOB_NAME``, ...).
``srun --output O --error E CMD`` runs CMD with its output there (``%A %a %j %t`` filled in).
``squeue -h -r -j IDS -o %i|%T`` lists the tasks queued or running; ``sacct`` knows nothing (no
accounting database), as on a cluster without one. The runner notes the most tasks it ran at once
(``max_running``). Also the grid task the tests submit: :func:`job_env`.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

COMMANDS = ("sbatch", "squeue", "sacct", "scancel", "scontrol", "srun")


def install(bin_dir: Path, state: Path) -> dict[str, str]:
    """Links of the commands in ``bin_dir``; returns the environment that puts them first on PATH."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    state.mkdir(parents=True, exist_ok=True)
    for c in COMMANDS:
        (bin_dir / c).write_text(f"#!/bin/sh\nexec {sys.executable} {Path(__file__).resolve()} {c} \"$@\"\n")
        (bin_dir / c).chmod(0o755)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "FAKE_SLURM": str(state)}


def job_env(job, run_dir: Path, resume: bool) -> dict:
    """Grid task: what the job's process sees (its torch threads, Slurm's variables, a setup line's)."""
    import torch

    return {"threads": torch.get_num_threads(), "job_name": os.environ.get("SLURM_JOB_NAME"),
            "array_task": os.environ.get("SLURM_ARRAY_TASK_ID"), "setup": os.environ.get("FAKE_SETUP"),
            "devices": os.environ.get("CUDA_VISIBLE_DEVICES")}


def slow_job_env(job, run_dir: Path, resume: bool) -> dict:
    """:func:`job_env` after two seconds (a job still running across several polls)."""
    time.sleep(2)
    return job_env(job, run_dir, resume)


def _state_dir() -> Path:
    return Path(os.environ["FAKE_SLURM"])


def _states() -> dict:
    try:
        return json.loads((_state_dir() / "state.json").read_text())
    except (OSError, ValueError):
        return {}


def _set_state(job_id: str, state: str) -> None:
    states = _states()
    states[job_id] = state
    tmp = _state_dir() / f"state.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(states))
    os.replace(tmp, _state_dir() / "state.json")


def _options(script: str) -> dict[str, str]:
    return dict(m.groups() for m in re.finditer(r"^#SBATCH --([\w-]+)=?(.*)$", script, re.M))


def sbatch(args: list[str]) -> int:
    script = Path(args[-1]).read_text()
    counter = _state_dir() / "next_id"
    job_id = int(counter.read_text()) if counter.is_file() else 1000
    counter.write_text(str(job_id + 1))
    (_state_dir() / "submissions").mkdir(exist_ok=True)
    (_state_dir() / "submissions" / f"{job_id}.sh").write_text(script)
    opts = _options(script)
    tasks = [f"{job_id}_{i}" for i in range(*_array_range(opts["array"]))] if "array" in opts else [str(job_id)]
    for t in tasks:
        _set_state(t, "PENDING")
    subprocess.Popen([sys.executable, __file__, "run", str(job_id), args[-1]], start_new_session=True,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    print(f"Submitted batch job {job_id}")
    return 0


def _array_range(spec: str) -> tuple[int, int]:
    first, last = spec.split("%")[0].split("-")
    return int(first), int(last) + 1


def run(job_id: str, script_path: str) -> int:
    """The runner: every task of the job, at most the array's cap at a time."""
    script = (_state_dir() / "submissions" / f"{job_id}.sh").read_text()
    opts = _options(script)
    cap = int(opts["array"].split("%")[1]) if "%" in opts.get("array", "") else 1 << 30
    tasks = list(range(*_array_range(opts["array"]))) if "array" in opts else [None]
    running: dict[str, subprocess.Popen] = {}
    most = 0
    while tasks or running:
        while tasks and len(running) < cap:
            i = tasks.pop(0)
            tid = job_id if i is None else f"{job_id}_{i}"
            env = {**os.environ, "SLURM_JOB_ID": tid, "SLURM_NTASKS": "1", "SLURM_JOB_NUM_NODES": "1",
                   "SLURM_NODEID": "0", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_JOB_NODELIST": "localhost",
                   "SLURM_JOB_NAME": opts.get("job-name", "")}
            if "cpus-per-task" in opts:
                env["SLURM_CPUS_PER_TASK"] = opts["cpus-per-task"]
            if i is not None:
                env.update(SLURM_ARRAY_JOB_ID=job_id, SLURM_ARRAY_TASK_ID=str(i))
            _set_state(tid, "RUNNING")
            running[tid] = subprocess.Popen(["bash", script_path], env=env)
        most = max(most, len(running))
        tmp = _state_dir() / "max_running.tmp"  # whole or not at all: a reader never sees a truncated file
        tmp.write_text(str(most))
        os.replace(tmp, _state_dir() / "max_running")
        for tid, p in list(running.items()):
            if p.poll() is not None:
                _set_state(tid, "COMPLETED" if p.returncode == 0 else "FAILED")
                del running[tid]
        time.sleep(0.05)
    return 0


def srun(args: list[str]) -> int:
    out = err = None
    while args and args[0].startswith("--"):
        flag = args.pop(0)
        if flag in ("--output", "--error"):
            path = args.pop(0)
            for k, v in (("%A", os.environ.get("SLURM_ARRAY_JOB_ID", "")), ("%a", os.environ.get("SLURM_ARRAY_TASK_ID", "")),
                         ("%j", os.environ["SLURM_JOB_ID"]), ("%t", "0")):
                path = path.replace(k, v)
            out, err = (path, err) if flag == "--output" else (out, path)
    with open(out or os.devnull, "a") as o, open(err or os.devnull, "a") as e:
        return subprocess.call(args, stdout=o, stderr=e)


def squeue(args: list[str]) -> int:
    fails = _state_dir() / "squeue_fails"  # a controller that does not answer: this many calls fail
    if fails.exists() and int(fails.read_text() or 0) > 0:
        fails.write_text(str(int(fails.read_text()) - 1))
        print("slurm_load_jobs error: Socket timed out on send/recv operation", file=sys.stderr)
        return 1
    ids = args[args.index("-j") + 1].split(",") if "-j" in args else None
    for tid, state in _states().items():
        if state in ("PENDING", "RUNNING") and (ids is None or tid.split("_")[0] in ids):
            print(f"{tid}|{state}")
    return 0


if __name__ == "__main__":
    cmd, rest = sys.argv[1], sys.argv[2:]
    if cmd == "run":
        sys.exit(run(*rest))
    sys.exit({"sbatch": sbatch, "squeue": squeue, "srun": srun}.get(cmd, lambda a: 0)(rest))
