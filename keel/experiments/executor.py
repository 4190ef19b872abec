"""Where a grid's runs go: local worker processes (the default), submitit's ``LocalExecutor``, or
Slurm through submitit (https://github.com/facebookincubator/submitit).

:func:`keel.experiments.grid.run_grid` does the planning (finished runs are skipped, changed ones
refused) and hands the runs to start to one of:

- ``local``: a pool of ``--workers`` spawned processes (:mod:`keel.experiments.grid`). On a machine
  with GPUs each worker gets its own ``gpus_per_run`` devices (``CUDA_VISIBLE_DEVICES``,
  :func:`assign_devices`).
- ``submitit-local``: each run is a submitit job on this machine, at most ``--workers`` at a time:
  the code path of Slurm without Slurm (what CI and a laptop run).
- ``slurm``: each run is an ``sbatch`` job through submitit's ``AutoExecutor``; ``--slurm KEY=VALUE``
  sets its parameters (:func:`slurm_parameters`: partition, account, time in minutes, gpus per
  node, nodes, and any other ``sbatch`` option).

Ledger: a grid folder that submitit ran keeps ``jobs.json`` (run name → job id, state, attempts),
written after every submission and state change. ``--resume`` waits for the jobs it lists that
are still queued or running instead of submitting them twice, takes the finished ones, and submits
again (with a note) the ones that ended without a result. ``--report-only`` reads ``result.json``
files only, so it works while jobs are queued.

Preemption and time limits lose nothing (submitit's checkpointing protocol): submitit asks Slurm
for SIGUSR2 ``time`` minus 90 s before the end (``--signal=USR2@90``). In the job, keel's trainer
takes it as a stop signal (:data:`keel.io.STOP_SIGNALS`): it finishes its step and checkpoints.
Then :meth:`GridCall.checkpoint` gives submitit the same call with ``resume=True``, and submitit
requeues the job (``scontrol requeue``; the local executor restarts it), which continues from that
checkpoint. A run with no checkpoint yet starts again from step 0.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from keel.errors import Interrupted, KeelError
from keel.io import atomic_write_text, passing_on_stop_signals

_log = logging.getLogger(__name__)

EXECUTORS = ("local", "submitit-local", "slurm")
LEDGER_FILE = "jobs.json"
SUBMITIT_DIR = "submitit"  # under a grid folder: submitit's pickles and each job's stdout / stderr
PREEMPT_SIGNAL = signal.SIGUSR2  # what submitit asks Slurm for before a time limit (SUBMITIT_PREEMPT_SIGNAL)
DEFAULT_TIME_MIN = 24 * 60  # a job's time limit when --slurm time=... is not given (minutes)

# --slurm KEY=VALUE: the short names and the submitit parameter each sets; any other key is passed to
# sbatch as --KEY=VALUE (slurm_additional_parameters)
SLURM_KEYS = {"partition": "slurm_partition", "account": "slurm_account", "time": "timeout_min",
              "gpus": "gpus_per_node", "nodes": "nodes", "cpus": "cpus_per_task", "mem_gb": "mem_gb",
              "qos": "slurm_qos", "constraint": "slurm_constraint", "array_parallelism": "slurm_array_parallelism"}
_INT_KEYS = {"time", "gpus", "nodes", "cpus", "mem_gb", "array_parallelism"}
_ALIVE = {"PENDING", "RUNNING", "REQUEUED", "CONFIGURING", "COMPLETING", "SUSPENDED", "RESIZING", "UNKNOWN",
          "REQUEUE_HOLD", "REQUEUE_FED", "STAGE_OUT", "SIGNALING"}


@dataclass(frozen=True)
class Executor:
    """How a grid runs its jobs (the grid commands' ``--executor``, ``--slurm``, ``--gpus-per-run``,
    ``--share-gpus``).

    Attributes:
        kind: ``local``, ``submitit-local`` or ``slurm`` (:data:`EXECUTORS`).
        slurm: ``--slurm KEY=VALUE`` pairs (strings), read by :func:`slurm_parameters`.
        gpus_per_run: devices each run gets where there are GPUs; with a submitit executor also the
            processes of a run (tasks per node of its job, each one rank: :func:`_join_as_torchrun_would`),
            on the CPU too; a local worker runs each run in one process.
        share_gpus: let more local workers than GPUs share them (round robin) instead of refusing.
        poll_s: seconds between two looks at the submitted jobs' states.
    """

    kind: str = "local"
    slurm: Mapping[str, str] = field(default_factory=dict)
    gpus_per_run: int = 1
    share_gpus: bool = False
    poll_s: float = 5.0

    def __post_init__(self) -> None:
        if self.kind not in EXECUTORS:
            raise KeelError(f"--executor must be one of {', '.join(EXECUTORS)}, got {self.kind!r}")
        if self.gpus_per_run < 1:
            raise KeelError(f"--gpus-per-run must be >= 1, got {self.gpus_per_run}")
        if self.slurm and self.kind != "slurm":
            raise KeelError("--slurm sets Slurm's parameters; use it with --executor slurm")
        slurm_parameters(self)  # bad --slurm values fail here, before anything runs


def parse_slurm(items: Sequence[str]) -> dict[str, str]:
    """``["partition=gpu", "time=120"]`` → ``{"partition": "gpu", "time": "120"}``.

    Raises:
        KeelError: an item without ``=``, an empty key, or a key given twice.
    """
    out: dict[str, str] = {}
    for item in items:
        k, sep, v = item.partition("=")
        if not sep or not k.strip():
            raise KeelError(f"--slurm takes KEY=VALUE (e.g. partition=gpu, time=120), got {item!r}")
        if k.strip() in out:
            raise KeelError(f"--slurm {k.strip()} is given twice")
        out[k.strip()] = v.strip()
    return out


def slurm_parameters(ex: Executor) -> dict:
    """The submitit parameters of ``ex``: ``timeout_min`` (``time``, default :data:`DEFAULT_TIME_MIN`),
    ``gpus_per_node`` (``gpus``, default ``gpus_per_run`` on Slurm), ``tasks_per_node`` (``gpus_per_run``
    processes per run when it is above 1), the :data:`SLURM_KEYS`, and
    every other key in ``slurm_additional_parameters`` (sbatch ``--KEY=VALUE``).

    Raises:
        KeelError: a numeric key (time, gpus, nodes, cpus, mem_gb, array_parallelism) that is not a
            whole number >= 1 (gpus: >= 0).
    """
    params: dict = {"timeout_min": DEFAULT_TIME_MIN}
    if ex.gpus_per_run > 1:  # one process per GPU, each a task of the job (GridCall gives it its rank)
        params["tasks_per_node"] = ex.gpus_per_run
    if ex.kind == "slurm":
        params["gpus_per_node"] = ex.gpus_per_run
    extra = {}
    for k, v in ex.slurm.items():
        if k in _INT_KEYS:
            if not v.isdigit() or (int(v) < 1 and k != "gpus"):
                raise KeelError(f"--slurm {k}= must be a whole number{' >= 1' if k != 'gpus' else ''}, got {v!r}")
            params[SLURM_KEYS[k]] = int(v)
        elif k in SLURM_KEYS:
            params[SLURM_KEYS[k]] = v
        else:
            extra[k] = v
    if params.get("gpus_per_node") == 0:  # a CPU partition: no GPU request at all (sbatch has no gres there)
        del params["gpus_per_node"]
    if extra:
        params["slurm_additional_parameters"] = extra
    return params


def assign_devices(workers: int, per_run: int, count: int, share: bool = False) -> list[str | None]:
    """The ``CUDA_VISIBLE_DEVICES`` of each of ``workers`` local workers on a machine with ``count``
    GPUs, ``per_run`` each: worker i gets devices ``i*per_run .. i*per_run + per_run - 1``, or with
    ``share`` (more workers than devices) the same ones round robin. No GPU: ``None`` each (CPU).

    Raises:
        KeelError: ``workers * per_run > count`` without ``share``, or ``per_run > count``.
    """
    if count == 0:
        return [None] * workers
    if per_run > count:
        raise KeelError(f"each run needs {per_run} GPU(s) but this machine has {count}; lower --gpus-per-run")
    if workers * per_run > count and not share:
        raise KeelError(f"{workers} workers x {per_run} GPU(s) each need {workers * per_run} GPUs but this machine "
                        f"has {count}; lower --workers, or add --share-gpus to let workers share devices")
    slots = count // per_run
    return [",".join(str((i % slots) * per_run + d) for d in range(per_run)) for i in range(workers)]


class GridCall:
    """The function a submitit job runs: one grid job (``execute(task, job, run_dir, resume)``, i.e.
    :func:`keel.experiments.grid._execute`), with ``threads`` torch threads, under submitit's
    checkpointing protocol: stopped by :data:`PREEMPT_SIGNAL` (after the trainer checkpointed), it
    hands the signal to submitit's own handler, which calls :meth:`checkpoint` and requeues the job."""

    def __init__(self, execute: Callable) -> None:
        self.execute = execute

    def __call__(self, task: Callable, job, run_dir: str, resume: bool, threads: int | None) -> dict | None:
        import torch  # noqa: PLC0415 - in the job's own process

        if threads:
            torch.set_num_threads(threads)
        submitit_handler = signal.getsignal(PREEMPT_SIGNAL)
        rank = _join_as_torchrun_would()
        try:
            if rank:  # another process of a multi-process run: rank 0 writes the result and the log
                task(job, Path(run_dir), resume)
                return None
            return self.execute(task, job, run_dir, resume)
        except Interrupted as e:
            if e.signum == PREEMPT_SIGNAL and callable(submitit_handler):
                submitit_handler(e.signum, None)  # checkpoint() and requeue; it exits this process
            raise

    def checkpoint(self, task: Callable, job, run_dir: str, resume: bool, threads: int | None):
        """submitit's checkpointing protocol: the call to requeue, the same one resuming the run."""
        import submitit  # noqa: PLC0415

        return submitit.helpers.DelayedSubmission(self, task, job, run_dir, True, threads)


def _join_as_torchrun_would() -> int:
    """In a job of several tasks (``gpus_per_run`` > 1, or several nodes): give this task the
    environment torchrun gives a worker (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` = the
    job's first host, ``MASTER_PORT`` from the job id), so that the trainer joins one process group
    (:func:`keel.train.dist.init_distributed`). Returns this task's rank (0 in a one-task job)."""
    import submitit  # noqa: PLC0415

    env = submitit.JobEnvironment()
    if env.num_tasks < 2:
        return 0
    digits = "".join(c for c in str(env.job_id) if c.isdigit()) or "0"
    os.environ.update(RANK=str(env.global_rank), LOCAL_RANK=str(env.local_rank), WORLD_SIZE=str(env.num_tasks),
                      MASTER_ADDR="127.0.0.1" if env.num_nodes == 1 else env.hostnames[0],
                      MASTER_PORT=str(20000 + int(digits) % 20000))
    return env.global_rank


def _make_executor(ex: Executor, folder: Path):
    """A submitit executor writing into ``folder``."""
    import submitit  # noqa: PLC0415 - only the submitit executors need it

    params = slurm_parameters(ex)
    if ex.kind == "submitit-local":
        params = {k: params[k] for k in ("timeout_min", "tasks_per_node") if k in params}
        out = submitit.LocalExecutor(folder=folder)
    else:
        out = submitit.AutoExecutor(folder=folder, cluster="slurm")
    out.update_parameters(**params)
    return out


def _load_ledger(out_dir: Path) -> dict:
    path = out_dir / LEDGER_FILE
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    jobs = data.get("jobs") if isinstance(data, dict) else None
    if not isinstance(jobs, dict):
        return {}
    return {k: v for k, v in jobs.items() if isinstance(v, dict) and isinstance(v.get("job_id"), str)}


def _save_ledger(out_dir: Path, kind: str, ledger: dict) -> None:
    atomic_write_text(out_dir / LEDGER_FILE, json.dumps({"executor": kind, "jobs": ledger}, indent=1))


def _job_handle(kind: str, folder: Path, job_id: str):
    """A submitit job object for a job submitted earlier (by this process or another)."""
    import submitit  # noqa: PLC0415

    return (submitit.SlurmJob if kind == "slurm" else submitit.LocalJob)(folder=folder, job_id=job_id)


def _task0(handle):
    """The job's first task (rank 0: the one that writes the run's result), or the job itself."""
    subs = getattr(handle, "_sub_jobs", None)
    return subs[0] if subs else handle


def _live_state(kind: str, handle) -> str | None:
    """The state of a job still queued or running (``queued``, ``running``, ...; Slurm: from its
    state, local: its controller process runs), or None once it has ended. One look per call (Slurm:
    one ``squeue``)."""
    if _task0(handle).paths.result_pickle.exists():
        return None
    if kind == "slurm":
        state = _slurm_state(handle)
        if state not in _ALIVE:
            return None
        return {"PENDING": "queued", "REQUEUED": "queued", "CONFIGURING": "queued"}.get(state, state.lower())
    if getattr(handle, "_process", None) is not None:  # submitted by this process
        return "running" if handle._process.poll() is None else None
    # submitted by an earlier invocation: its controller's pid is the job id
    return "running" if _pid_runs(handle.job_id) else None


def _slurm_state(handle) -> str:
    """A Slurm job's state: ``squeue``'s while the job is listed there (queued, running, requeued), else
    submitit's from ``sacct`` (COMPLETED, FAILED, ...), else ``GONE`` (no accounting database here)."""
    try:
        out = subprocess.run(["squeue", "-h", "-j", str(handle.job_id), "-o", "%T"], capture_output=True,
                             text=True, timeout=60)
        listed = out.stdout.split() if out.returncode == 0 else []
    except (OSError, subprocess.TimeoutExpired):
        listed = []
    if listed:
        return listed[0]
    state = str(handle.state).split()[0]
    return "GONE" if state == "UNKNOWN" else state


def _pid_runs(pid: str) -> bool:
    """Does process ``pid`` exist and run (a zombie, ended but not yet waited for, does not)?"""
    try:
        os.kill(int(pid), 0)
    except (OSError, ValueError):
        return False
    with contextlib.suppress(OSError):  # Linux: the state is the field after the command name
        return Path(f"/proc/{int(pid)}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    return True


def _signal_job(handle) -> None:
    """Pass a stop signal to a local job: its controller forwards SIGTERM to the job's process, which
    finishes its step and checkpoints (the controller dies of the others)."""
    with contextlib.suppress(OSError, ValueError):
        os.kill(int(handle.job_id), signal.SIGTERM)


def _outcome(run_dir: Path, handle, read_result: Callable[[Path], dict | None]) -> dict:
    """The result of a job that ended: its ``result.json``, the dict the job returned (a task error),
    or ``{"status": "error", ...}`` with what submitit says (an exception, a killed job)."""
    r = read_result(run_dir)
    if r is not None:
        return r
    first = _task0(handle)
    if not first.paths.result_pickle.exists():
        return {"name": run_dir.name, "status": "error", "wall_s": 0.0,
                "message": f"job {handle.job_id} ended without a result (killed, or out of time): see "
                           f"{first.paths.stderr}"}
    try:
        out = first.result()
        if isinstance(out, dict):
            return out
        message = f"the job returned {out!r}, not a result"
    except Exception as e:  # noqa: BLE001 - submitit's UncompletedJobError / FailedJobError: recorded
        lines = [s for s in str(e).strip().splitlines() if s.strip()]
        message = f"job {handle.job_id} ended without a result: {lines[-1] if lines else type(e).__name__}"
    return {"name": run_dir.name, "status": "error", "message": message, "wall_s": 0.0}


@dataclass
class _Submitted:
    """The driver's view of the grid's submitted jobs."""

    ex: Executor
    out_dir: Path
    ledger: dict
    handles: dict = field(default_factory=dict)  # run name -> submitit job, while it is queued or running
    shown: dict = field(default_factory=dict)  # run name -> the state last logged

    def record(self, name: str, state: str, job_id: str | None = None) -> None:
        """Note ``state`` of run ``name`` (a new submission when ``job_id`` is given) in the ledger
        and log it when it changed."""
        if job_id is not None:
            attempts = self.ledger.get(name, {}).get("attempts", 0)
            self.ledger[name] = {"job_id": job_id, "attempts": attempts + 1 if isinstance(attempts, int) else 1}
        entry = self.ledger[name]
        entry.update(state=state, updated=time.strftime("%Y-%m-%dT%H:%M:%S"))
        _save_ledger(self.out_dir, self.ex.kind, self.ledger)
        if self.shown.get(name) != state:
            self.shown[name] = state
            _log.info(f"  {name}: {state} (job {entry['job_id']})")


def run_submitit(execute: Callable, task: Callable, todo: list, out_dir: Path, ex: Executor, workers: int,
                 threads: int | None, report: Callable[[object, dict], None], resumed: Callable[[object], bool],
                 read_result: Callable[[Path], dict | None]) -> None:
    """Run the grid jobs ``todo`` as submitit jobs of ``ex`` (see the module docstring), calling
    ``report(job, result)`` as each ends; with ``submitit-local`` at most ``max(1, workers)`` at a time.

    Args:
        execute: :func:`keel.experiments.grid._execute` (taken as an argument: this module is below
            the grid).
        read_result: the ``result.json`` of a run folder, or None (:func:`keel.experiments.grid.cached_result`).
    Raises:
        Interrupted: SIGINT / SIGTERM to this process. Slurm jobs keep running (``--resume`` waits for
            them); local jobs get the signal, finish their step and checkpoint.
    """
    folder = out_dir / SUBMITIT_DIR
    executor = _make_executor(ex, folder)
    st = _Submitted(ex, out_dir, _load_ledger(out_dir))
    waiting = list(todo)
    for job in list(waiting):  # submitted by an earlier invocation and still queued or running: wait for it
        entry = st.ledger.get(job.name)
        if entry is not None:
            handle = _job_handle(ex.kind, folder, entry["job_id"])
            state = _live_state(ex.kind, handle)
            if state is not None:
                st.handles[job.name] = handle
                waiting.remove(job)
                st.record(job.name, state)
    limit = max(1, workers) if ex.kind == "submitit-local" else len(todo)
    by_name = {j.name: j for j in todo}

    def stop(signum: int) -> None:
        waiting.clear()  # nothing new starts
        if ex.kind != "slurm":  # local jobs stop cleanly (they checkpoint); Slurm ones keep running
            for h in st.handles.values():
                _signal_job(h)

    with passing_on_stop_signals(stop) as received:
        while waiting or st.handles:
            while waiting and len(st.handles) < limit:
                _submit(executor, execute, task, waiting.pop(0), st, resumed, threads)
            _collect(st, by_name, report, read_result, stop_only=bool(received))
            if waiting or st.handles:
                time.sleep(ex.poll_s)
    if received:
        left = ("the Slurm jobs keep running; the same command with --resume waits for them"
                if ex.kind == "slurm" else "each running job finished its step and checkpointed its run")
        raise Interrupted(f"stopped by {signal.Signals(received[0]).name} ({left}; jobs list: {out_dir / LEDGER_FILE}); "
                          f"continue: the same command with --resume (out {out_dir})", received[0])


def _submit(executor, execute: Callable, task: Callable, job, st: _Submitted, resumed: Callable, threads) -> None:
    """Submit one grid job, noting a resubmission of a job that ended without a result."""
    old = st.ledger.get(job.name)
    if old is not None:
        _log.info(f"  {job.name}: job {old['job_id']} ended ({old.get('state', '?')}) without a result: "
                  "submitting it again (it resumes from its last checkpoint)")
    run_dir = str(st.out_dir / job.name)
    handle = executor.submit(GridCall(execute), task, job, run_dir, resumed(job), threads)
    st.handles[job.name] = handle
    st.record(job.name, "queued", str(handle.job_id))


def _collect(st: _Submitted, by_name: dict, report: Callable, read_result: Callable, stop_only: bool) -> None:
    """Log state changes; report (and forget) the jobs that ended. ``stop_only`` (the driver got a
    stop signal and passed it on): a local job that ends without a result checkpointed its run and
    is ``stopped``, not ``failed``."""
    for name, handle in list(st.handles.items()):
        state = _live_state(st.ex.kind, handle)
        if state is not None and not (st.ex.kind == "slurm" and stop_only):
            st.record(name, state)
            continue
        if state is not None:  # stopped: Slurm jobs are left running, in the ledger
            del st.handles[name]
            continue
        r = _outcome(st.out_dir / name, handle, read_result)
        del st.handles[name]
        st.record(name, "done" if r.get("status") == "done" else "stopped" if stop_only else "failed")
        if not (stop_only and r.get("status") != "done"):
            report(by_name[name], r)
