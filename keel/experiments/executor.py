"""Where a grid's runs go: local worker processes (the default), submitit's ``LocalExecutor``, or
Slurm through submitit (https://github.com/facebookincubator/submitit). The user's guide: docs/cluster.md.

:func:`keel.experiments.grid.run_grid` does the planning (finished runs are skipped, changed ones
refused) and hands the runs to start to one of:

- ``local``: a pool of ``--workers`` spawned processes (:mod:`keel.experiments.grid`). On a machine
  with GPUs each worker gets its own ``gpus_per_run`` devices (``CUDA_VISIBLE_DEVICES``, within the one
  this process inherited: :func:`assign_devices`, :func:`visible_devices`).
- ``submitit-local``: each run is a submitit job on this machine, at most ``--workers`` at a time, job
  slot i with the devices worker i would have: the code path of Slurm without Slurm (what CI and a
  laptop run). Each job's controller runs in a session of its own (:func:`_own_sessions`): a
  terminal's Ctrl-C reaches the driver only, which passes one SIGTERM to each job.
- ``slurm``: the runs to start are one ``sbatch`` job array through submitit's ``AutoExecutor``
  (``batch()``), at most :func:`array_cap` running at once, named by :func:`job_name`; ``--slurm
  KEY=VALUE`` sets its parameters (:func:`slurm_parameters`: partition, account, time in minutes, gpus
  per node, nodes, setup lines, the signal delay, the requeue limit, and any other ``sbatch`` option).
  A job's torch threads come from its own allocation (:func:`job_cpus`), not the login node's cores.

Ledger: a grid folder that submitit ran keeps ``jobs.json`` (run name → job id, state, attempts:
every start, requeues included; for submitit-local the controller's process identity and devices),
written after every submission and state change. ``--resume`` waits for the jobs it lists that
are still queued or running instead of submitting them twice (a submitit-local job id is a PID: only
while that process is still this grid's controller, :func:`_our_controller`), takes the finished ones,
and submits again (with a note) the ones that ended without a result. A folder's ledger is run by the
executor that wrote it only (:func:`check_ledger`). ``--report-only`` reads ``result.json``
files only, so it works while jobs are queued.

Preemption and time limits lose nothing (submitit's checkpointing protocol): submitit asks Slurm
for SIGUSR2 ``time`` minus ``signal_delay_s`` (90 s) before the end. In the job, keel's trainer
takes it as a stop signal (:data:`keel.io.STOP_SIGNALS`): it finishes its step and checkpoints.
Then :meth:`GridCall.checkpoint` gives submitit the same call with ``resume=True``, and submitit
requeues the job (``scontrol requeue``; the local executor restarts it; at most ``max_num_timeout``
times), which continues from that checkpoint. A run with no checkpoint yet starts again from step 0.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import time
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from keel.errors import Interrupted, KeelError, plural
from keel.experiments.job_result import JobResult, failed_result
from keel.io import atomic_write_text, passing_on_stop_signals, pid_runs

_log = logging.getLogger(__name__)

EXECUTORS = ("local", "submitit-local", "slurm")
LEDGER_FILE = "jobs.json"
SUBMITIT_DIR = "submitit"  # under a grid folder: submitit's pickles and each job's stdout / stderr
PREEMPT_SIGNAL = signal.SIGUSR2  # what submitit asks Slurm for before a time limit (SUBMITIT_PREEMPT_SIGNAL)
DEFAULT_TIME_MIN = 24 * 60  # a job's time limit when --slurm time=... is not given (minutes)
DEFAULT_SIGNAL_DELAY_S = 90  # submitit's: SIGUSR2 this many seconds before the time limit

# --slurm KEY=VALUE: the short names and the submitit parameter each sets; any other key is passed to
# sbatch as --KEY=VALUE (slurm_additional_parameters)
SLURM_KEYS = {"partition": "slurm_partition", "account": "slurm_account", "time": "timeout_min",
              "gpus": "gpus_per_node", "nodes": "nodes", "cpus": "cpus_per_task", "mem_gb": "mem_gb",
              "qos": "slurm_qos", "constraint": "slurm_constraint", "array_parallelism": "slurm_array_parallelism",
              "name": "name", "setup": "slurm_setup", "signal_delay_s": "slurm_signal_delay_s",
              "max_num_timeout": "slurm_max_num_timeout"}
_SLURM_ALIASES = {"job-name": "name", "job_name": "name", "cpus-per-task": "cpus", "cpus_per_task": "cpus"}
# sbatch options that a key of SLURM_KEYS also writes: given both ways, submitit would drop one silently
# (mem=4G overrides mem_gb=8) or write both (--gpus-per-node twice, the last one winning)
_SBATCH_TWINS = {"mem": "mem_gb", "gpus-per-node": "gpus"}
_INT_KEYS = {"time", "gpus", "nodes", "cpus", "mem_gb", "array_parallelism", "signal_delay_s", "max_num_timeout"}
_ZERO_OK = {"gpus", "max_num_timeout"}  # the numeric keys that may be 0 (a CPU partition; no requeue after a timeout)
MAX_TIME_MIN = 366 * 24 * 60  # the longest --slurm time= keel passes on (minutes: a year; more is a typo)
_KEEL_OWNS = {"array": "a grid is one job array; its cap is --workers N or --slurm array_parallelism=N",
              "output": "each job's log is GRID/submitit/<job>_<task>_log.out (and .err)",
              "error": "each job's log is GRID/submitit/<job>_<task>_log.out (and .err)",
              "signal": "set the warning before the time limit with --slurm signal_delay_s=SECONDS",
              **dict.fromkeys(("ntasks-per-node", "ntasks_per_node"),
                              "a run's processes per node are --gpus-per-run K (one task each, joined as "
                              "torchrun's workers)")}
_ALIVE = {"PENDING", "RUNNING", "REQUEUED", "CONFIGURING", "COMPLETING", "SUSPENDED", "RESIZING", "UNKNOWN",
          "REQUEUE_HOLD", "REQUEUE_FED", "STAGE_OUT", "SIGNALING"}
_CONTROLLER = "submitit.local._local"  # the module a submitit-local job's controller runs (its command line)


@dataclass(frozen=True)
class Executor:
    """How a grid runs its jobs (the grid commands' ``--executor``, ``--slurm``, ``--gpus-per-run``,
    ``--share-gpus``).

    Attributes:
        kind: ``local``, ``submitit-local`` or ``slurm`` (:data:`EXECUTORS`).
        slurm: ``--slurm KEY=VALUE`` pairs (strings; ``setup`` lines joined by newlines), read by
            :func:`slurm_parameters`.
        gpus_per_run: devices each run gets where there are GPUs; with a submitit executor also the
            processes of a run (tasks per node of its job, each one rank: :func:`_join_as_torchrun_would`),
            on the CPU too; a local worker runs each run in one process.
        share_gpus: let more local workers than GPUs share them (round robin) instead of refusing (not
            with ``slurm``: a KeelError).
        poll_s: seconds between two looks at the submitted jobs' states.
        label: what Slurm jobs are named after (the engine sets the study's name): ``keel-LABEL-GROUP``
            for a grid's job array, ``keel-LABEL-GROUP-RUN`` for a job of one run; ``--slurm name=X``
            names them ``X``.
        unset: the fields of ``gpus_per_run`` and ``share_gpus`` the command line left at their defaults: a
            ``--resume`` takes them from the folder's record (not written in it).
    """

    kind: str = "local"
    slurm: Mapping[str, str] = field(default_factory=dict)
    gpus_per_run: int = 1
    share_gpus: bool = False
    poll_s: float = 5.0
    label: str = ""
    unset: frozenset[str] = field(default=frozenset(), compare=False)

    def __post_init__(self) -> None:
        if self.kind not in EXECUTORS:
            raise KeelError(f"--executor must be one of {', '.join(EXECUTORS)}, got {self.kind!r}")
        if self.gpus_per_run < 1:
            raise KeelError(f"--gpus-per-run must be >= 1, got {self.gpus_per_run}")
        if self.slurm and self.kind != "slurm":
            raise KeelError("--slurm sets Slurm's parameters; use it with --executor slurm")
        if self.share_gpus and self.kind == "slurm":  # it was accepted and did nothing
            raise KeelError("--share-gpus lets local workers share this machine's GPUs; a Slurm job gets its own "
                            "(--gpus-per-run), so leave it out with --executor slurm")
        slurm_parameters(self)  # bad --slurm values fail here, before anything runs

    def world_size(self) -> int:
        """The processes (ranks) of each run: ``gpus_per_run`` tasks per node times ``--slurm nodes=``
        with a submitit executor; 1 for a local worker, which runs each run in one process."""
        if self.kind == "local":
            return 1
        return self.gpus_per_run * int(self.slurm.get("nodes", "1"))

    def record(self) -> dict:
        """The settings a grid folder keeps (``study.json``), read back by :meth:`from_record`."""
        return {"kind": self.kind, "slurm": dict(self.slurm), "gpus_per_run": self.gpus_per_run,
                "share_gpus": self.share_gpus}

    @classmethod
    def from_record(cls, rec: Mapping, label: str = "") -> "Executor":
        """The executor of a :meth:`record` (a grid folder's; one of an older keel: ``local``).

        Raises:
            KeelError: a record that is not one (edited by hand): naming the file is the caller's.
        """
        try:
            return cls(str(rec.get("kind", "local")), {str(k): str(v) for k, v in dict(rec.get("slurm") or {}).items()},
                       int(rec.get("gpus_per_run", 1)), bool(rec.get("share_gpus", False)), label=label)
        except (TypeError, ValueError, AttributeError):
            raise KeelError(f"an executor record must be a table of kind, slurm, gpus_per_run, share_gpus; "
                            f"got {json.dumps(rec, default=str)[:80]}") from None


def check_slurm_here(ex: Executor | None) -> None:
    """Raise KeelError where ``ex`` is Slurm's and ``sbatch`` or ``srun`` (submitit's job scripts start the job
    with it) is not on PATH (submitit's traceback said ``Could not detect "srun"``, after the output folder was
    written)."""
    missing = next((c for c in ("sbatch", "srun") if shutil.which(c) is None), None)
    if ex is not None and ex.kind == "slurm" and missing:
        raise KeelError(f"--executor slurm needs Slurm ({missing} is not on PATH here); run on a Slurm login node, "
                        "or use --executor local or submitit-local")


def parse_slurm(items: Sequence[str]) -> dict[str, str]:
    """``["partition=gpu", "time=120"]`` → ``{"partition": "gpu", "time": "120"}``; ``job-name`` and
    ``job_name`` are ``name``, ``cpus-per-task`` is ``cpus``; ``setup`` may repeat (one shell line each, run
    in the job before keel starts: ``module load ...``, ``source .venv/bin/activate``), kept joined by newlines.

    Raises:
        KeelError: an item without ``=``, an empty key, a key not in lower case (sbatch's are), an empty ``setup=``, a
            key given twice, or a key keel sets itself
            (``array``, ``output``, ``error``, ``signal``: the message names the keel setting instead).
    """
    out: dict[str, str] = {}
    for item in items:
        k, sep, v = item.partition("=")
        k = _SLURM_ALIASES.get(k.strip(), k.strip())
        if not sep or not k:
            raise KeelError(f"--slurm takes KEY=VALUE (e.g. partition=gpu, time=120), got {item!r}")
        if k != k.lower():  # sbatch's options are lower case: --Partition=gpu would fail in sbatch, after planning
            raise KeelError(f"--slurm {k}=: Slurm's option names are lower case; did you mean "
                            f"{_SLURM_ALIASES.get(k.lower(), k.lower())}=?")
        if k in _KEEL_OWNS:
            raise KeelError(f"--slurm {k}= is keel's to set: {_KEEL_OWNS[k]}")
        if k == "setup" and not v.strip():
            raise KeelError("--slurm setup= is empty; give a shell line to run in the job, or leave it out")
        if k == "setup":
            out[k] = "\n".join(filter(None, [out.get(k, ""), v.strip()]))
            continue
        if k in out:
            raise KeelError(f"--slurm {k} is given twice")
        out[k] = v.strip()
    return out


def slurm_parameters(ex: Executor) -> dict:
    """The submitit parameters of ``ex``: ``timeout_min`` (``time``, default :data:`DEFAULT_TIME_MIN`),
    ``gpus_per_node`` (``gpus``, default ``gpus_per_run`` on Slurm), ``tasks_per_node`` (``gpus_per_run``
    processes per run when it is above 1), the :data:`SLURM_KEYS` (``slurm_setup``: a list of lines;
    ``slurm_max_num_timeout``: an argument of the executor, not a parameter: :func:`_make_executor`), and
    every other key in ``slurm_additional_parameters`` (sbatch ``--KEY=VALUE``; an empty value: ``--KEY``).

    Raises:
        KeelError: a bad numeric key (:func:`_slurm_number`); a ``signal_delay_s`` not below ``time``; an
            empty value of a :data:`SLURM_KEYS` key (``partition=``, ``setup=``, ``name=``: sbatch would get
            ``--partition=`` or a job without its setup; ``exclusive=`` is a flag); sbatch's ``mem`` with
            ``mem_gb``, or its ``gpus-per-node`` with ``gpus`` (one would be lost).
    """
    params: dict = {"timeout_min": DEFAULT_TIME_MIN}
    if ex.gpus_per_run > 1:  # one process per GPU, each a task of the job (GridCall gives it its rank)
        params["tasks_per_node"] = ex.gpus_per_run
    if ex.kind == "slurm":
        params["gpus_per_node"] = ex.gpus_per_run
    extra = {}
    for k, v in ex.slurm.items():
        if not v.strip() and k in SLURM_KEYS:  # another key passes a flag of sbatch's (exclusive=: --exclusive)
            raise KeelError(f"--slurm {k}= is empty; give its value, or leave it out"
                            + (" (keel-STUDY-GROUP)" if k == "name" else ""))
        if k in _INT_KEYS:
            params[SLURM_KEYS[k]] = _slurm_number(k, v)
        elif k == "setup":
            params[SLURM_KEYS[k]] = [line for line in v.split("\n") if line.strip()]
        elif k in SLURM_KEYS:
            params[SLURM_KEYS[k]] = v
        else:
            twin = _SBATCH_TWINS.get(k.replace("_", "-"))
            if twin in ex.slurm:
                raise KeelError(f"--slurm {k}= and {twin}= both set sbatch's --{k.replace('_', '-')}; give one of them")
            if twin == "gpus":  # sbatch's own spelling of the GPUs per node replaces the default one
                params.pop("gpus_per_node", None)
            extra[k] = v or True  # an empty value is a flag: submitit writes True as a bare --KEY, "" as --KEY=''
    _check_signal_delay(params, given="signal_delay_s" in ex.slurm)
    if params.get("gpus_per_node") == 0:  # a CPU partition: no GPU request at all (sbatch has no gres there)
        del params["gpus_per_node"]
    if extra:
        params["slurm_additional_parameters"] = extra
    return params


def _slurm_number(k: str, v: str) -> int:
    """The value of ``--slurm k=v`` for a numeric key (:data:`_INT_KEYS`).

    Raises:
        KeelError: not a whole number >= 1 (``gpus``, ``max_num_timeout``: >= 0); a ``time`` above
            :data:`MAX_TIME_MIN`.
    """
    if not v.isdigit() or (int(v) < 1 and k not in _ZERO_OK):
        raise KeelError(f"--slurm {k}= must be a whole number{'' if k in _ZERO_OK else ' >= 1'}, got {v!r}")
    if k == "time" and int(v) > MAX_TIME_MIN:
        raise KeelError(f"--slurm time= is in minutes and at most {MAX_TIME_MIN} (a year), got {v}")
    return int(v)


def _check_signal_delay(params: Mapping, given: bool) -> None:
    """Refuse a pre-timeout warning (``signal_delay_s``, ``given`` or submitit's default) that is not below
    the time limit: Slurm would send it as each job starts, and every attempt would stop after one step."""
    delay, minutes = params.get("slurm_signal_delay_s", DEFAULT_SIGNAL_DELAY_S), params["timeout_min"]
    if delay >= minutes * 60:
        raise KeelError(f"--slurm signal_delay_s={delay}{'' if given else ' (the default)'} is not below "
                        f"time={minutes} ({minutes * 60} s): each job would be told to stop as it starts; give a "
                        "longer time= or a smaller signal_delay_s=")


def array_cap(ex: Executor, workers: int) -> int:
    """How many runs of a grid run at once through submitit: ``--slurm array_parallelism=N`` where given,
    else ``--workers`` (at least 1). On Slurm it is the job array's ``%N`` (Slurm holds the others queued)."""
    given = ex.slurm.get("array_parallelism")
    return int(given) if given else max(1, workers)


def pool_words(ex: Executor, workers: int, threads: int | None) -> str:
    """How a grid's runs go, for its first line: local worker processes, or submitit jobs at most
    :func:`array_cap` at a time (Slurm: a job array), with their torch threads (None: each Slurm job's CPUs)."""
    each = f"{threads} thread(s) each" if threads else "threads: each job's CPUs"
    if ex.kind == "slurm":
        return f"Slurm job array, at most {array_cap(ex, workers)} run(s) at a time, {each}"
    if ex.kind == "submitit-local":
        return f"submitit jobs on this machine, at most {array_cap(ex, workers)} at a time, {each}"
    return f"{workers or 'no'} worker process(es), {each}"


def job_cpus() -> int:
    """CPUs this process may use: its affinity mask (``os.sched_getaffinity``; inside a Slurm job the
    allocation's CPUs), at most ``SLURM_CPUS_PER_TASK`` where Slurm set it (a job's own request, read from
    the allocation, not a keel setting), else ``os.cpu_count()``."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity call (macOS)
        n = os.cpu_count() or 1
    per_task = os.environ.get("SLURM_CPUS_PER_TASK", "")
    return max(1, min(n, int(per_task)) if per_task.isdigit() and int(per_task) > 0 else n)


def assign_devices(workers: int, per_run: int, count: int, share: bool = False,
                   names: Sequence[str] | None = None) -> list[str | None]:
    """The ``CUDA_VISIBLE_DEVICES`` of each of ``workers`` local workers (or submitit-local job slots) on a
    machine where this process sees ``count`` GPUs, ``per_run`` each: worker i gets devices
    ``i*per_run .. i*per_run + per_run - 1``, or with ``share`` (more workers than devices) the same ones
    round robin. The devices are named as this process sees them, ``names`` (:func:`visible_devices`: an
    inherited ``CUDA_VISIBLE_DEVICES=8,9,...`` gives the workers 8, 9, ..., never a GPU outside it); None:
    ``0 .. count-1``. No GPU: ``None`` each (CPU).

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
    names = list(names)[:count] if names and len(names) >= count else [str(i) for i in range(count)]
    slots = count // per_run
    return [",".join(names[(i % slots) * per_run + d] for d in range(per_run)) for i in range(workers)]


def visible_devices() -> list[str] | None:
    """The GPUs this process may use as a child's ``CUDA_VISIBLE_DEVICES`` names them: the entries of the
    one it inherited (indices, or ``GPU-<uuid>`` / ``MIG-...`` names), in order; None where it inherited none
    (every device, ``0 .. count-1``). The variable is CUDA's own selection, which keel keeps to."""
    given = os.environ.get("CUDA_VISIBLE_DEVICES")
    return None if given is None else [d.strip() for d in given.split(",") if d.strip()]


class GridCall:
    """The function a submitit job runs: one grid job (``execute(task, job, run_dir, resume)``, i.e.
    :func:`keel.experiments.grid._execute`), with ``threads`` torch threads (None: the CPUs of the job's
    own allocation, :func:`job_cpus`, not the login node's), under submitit's
    checkpointing protocol: stopped by :data:`PREEMPT_SIGNAL` (after the trainer checkpointed), it
    hands the signal to submitit's own handler, which calls :meth:`checkpoint` and requeues the job."""

    def __init__(self, execute: Callable) -> None:
        self.execute = execute

    def __call__(self, task: Callable, job, run_dir: str, resume: bool, threads: int | None) -> dict | None:
        import torch  # noqa: PLC0415 - in the job's own process

        torch.set_num_threads(threads or job_cpus())
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


def _make_executor(ex: Executor, folder: Path, threads: int | None, cap: int):
    """A submitit executor writing into ``folder``: submitit-local's controllers each in a session of their
    own (:func:`_own_sessions`); on Slurm a grid's runs go as one job array of at most ``cap`` at a time
    (``slurm_array_parallelism``), each run asking for ``threads`` CPUs where ``--threads`` was given and
    ``--slurm cpus=`` was not, and starting this Python (``sys.executable``) unless a setup line activates an
    environment, whose ``python`` it then starts."""
    import submitit  # noqa: PLC0415 - only the submitit executors need it

    params = slurm_parameters(ex)
    requeues = params.pop("slurm_max_num_timeout", 3)  # submitit's limit on requeues after a time limit
    if ex.kind == "submitit-local":
        params = {k: params[k] for k in ("timeout_min", "tasks_per_node") if k in params}
        out = submitit.LocalExecutor(folder=folder, max_num_timeout=requeues)
    else:
        if threads and "cpus_per_task" not in params:
            params["cpus_per_task"] = threads
        params.setdefault("slurm_array_parallelism", cap)
        # a setup line that activates an environment (source .venv/bin/activate, conda activate) picks the Python
        activates = any(re.search(r"\bactivate\b", line) for line in params.get("slurm_setup", ()))
        out = submitit.AutoExecutor(folder=folder, cluster="slurm", slurm_max_num_timeout=requeues,
                                    slurm_python="python" if activates else None)
    out.update_parameters(**params)
    return out


@contextlib.contextmanager
def _own_sessions():
    """While submitit-local starts a job's controller, start it in a session of its own
    (``start_new_session``): the terminal's Ctrl-C reaches the driver only, which passes one SIGTERM to
    each job (the controller forwards it), instead of the job getting the terminal's SIGINT and then the
    driver's SIGTERM (its second signal: stop at once, steps lost) and each controller printing a
    ``KeyboardInterrupt`` traceback. Only the name ``subprocess`` in submitit's module is rebound."""
    from submitit.local import local  # noqa: PLC0415

    real = local.subprocess
    local.subprocess = types.SimpleNamespace(Popen=functools.partial(subprocess.Popen, start_new_session=True))
    try:
        yield
    finally:
        local.subprocess = real


def _read_ledger(out_dir: Path) -> tuple[str | None, dict]:
    """``out_dir``'s ledger: the executor it names (None: no readable ledger, or none named) and its well-formed
    job entries (``{run: {"job_id": ..., ...}}``)."""
    try:
        data = json.loads((out_dir / LEDGER_FILE).read_text())
    except (OSError, ValueError):
        return None, {}
    if not isinstance(data, dict):
        return None, {}
    was, jobs = data.get("executor"), data.get("jobs")
    jobs = {k: v for k, v in jobs.items() if isinstance(v, dict) and isinstance(v.get("job_id"), str)} \
        if isinstance(jobs, dict) else {}
    return (was if isinstance(was, str) else None), jobs


def _load_ledger(out_dir: Path) -> dict:
    return _read_ledger(out_dir)[1]


def _save_ledger(out_dir: Path, kind: str, ledger: dict) -> None:
    atomic_write_text(out_dir / LEDGER_FILE, json.dumps({"executor": kind, "jobs": ledger}, indent=1))


def check_ledger(out_dir: str | Path, kind: str) -> None:
    """Refuse to run a grid folder's jobs with another executor than the one its job ledger names: a
    ledger's job ids are Slurm's or (submitit-local) process ids, and a Slurm job still running would be
    trained a second time here.

    Raises:
        KeelError: ``out_dir/jobs.json`` names another executor than ``kind``.
    """
    was = _read_ledger(Path(out_dir))[0]
    if was is not None and was != kind:
        raise KeelError(f"{out_dir} was run with --executor {was} (its {LEDGER_FILE}), not {kind}; continue it "
                        f"with --executor {was} (or leave --executor out), or use another --out")


def settle_ledger(out_dir: str | Path, kind: str, finished: Sequence) -> None:
    """Mark the ledger entries of the grid jobs ``finished`` (their ``result.json`` is there) ``done``: their jobs
    ended while no driver watched them (it was stopped), and a ``--resume`` does not look at them again, so
    ``jobs.json`` would say ``running`` or ``queued`` for good. A ledger of another executor is left alone."""
    was, ledger = _read_ledger(Path(out_dir))
    stale = [j.name for j in finished if j.name in ledger and ledger[j.name].get("state") != "done"]
    if was != kind or not stale:
        return
    for n in stale:
        ledger[n].update(state="done", updated=time.strftime("%Y-%m-%dT%H:%M:%S"))
    _save_ledger(Path(out_dir), kind, ledger)


def _job_handle(kind: str, folder: Path, job_id: str):
    """A submitit job object for a job submitted earlier (by this process or another)."""
    import submitit  # noqa: PLC0415

    return (submitit.SlurmJob if kind == "slurm" else submitit.LocalJob)(folder=folder, job_id=job_id)


def _task0(handle):
    """The job's first task (rank 0: the one that writes the run's result), or the job itself."""
    subs = getattr(handle, "_sub_jobs", None)
    return subs[0] if subs else handle


def _live_state(kind: str, handle, entry: Mapping | None = None, listed: Mapping[str, str] | None = None) -> str | None:
    """The state of a job still queued or running (``queued``, ``running``, ...; Slurm: from ``listed``, one
    ``squeue`` for every job, :func:`_squeue`; local: its controller process runs and is still the one this
    grid started, :func:`_our_controller`), or None once it has ended."""
    if _task0(handle).paths.result_pickle.exists():
        return None
    if kind == "slurm":
        state = _slurm_state(handle, listed)
        if state not in _ALIVE:
            return None
        return {"PENDING": "queued", "REQUEUED": "queued", "CONFIGURING": "queued"}.get(state, state.lower())
    if getattr(handle, "_process", None) is not None:  # submitted by this process
        return "running" if handle._process.poll() is None else None
    # submitted by an earlier invocation: its controller's pid is the job id
    return "running" if _our_controller(handle.job_id, handle.paths.folder, (entry or {}).get("process")) else None


def _squeue(job_ids: Sequence[str]) -> dict[str, str] | None:
    """``{job id: state}`` of the jobs of ``job_ids`` that ``squeue`` lists (queued, running, requeued), in
    one call for every array (``-r``: an array's tasks one a line, ``A_i``); a job it does not list has left
    the queue, as has one it no longer knows (``Invalid job id``). Where one call for several arrays fails,
    each is asked on its own. None where squeue did not answer (a busy controller's time-out): the jobs'
    states are not known, and not one of them has ended for it."""
    mains = sorted({str(j).split("_")[0] for j in job_ids})
    out: dict[str, str] = {}
    answered = False
    for group in [mains] if len(mains) < 2 else [mains, *([m] for m in mains)]:
        try:
            r = subprocess.run(["squeue", "-h", "-r", "-j", ",".join(group), "-o", "%i|%T"], capture_output=True,
                               text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if r.returncode == 0:
            answered = True
            out.update(line.split("|", 1) for line in r.stdout.splitlines() if line.count("|") == 1)
            if group is mains:
                break
        elif "invalid job id" in r.stderr.lower():
            answered = True
    return out if answered or not mains else None


def _slurm_state(handle, listed: Mapping[str, str] | None) -> str:
    """A Slurm job's state: ``squeue``'s while the job is listed there (queued, running, requeued), else
    submitit's from ``sacct`` (COMPLETED, FAILED, ...), else ``GONE`` (no accounting database here);
    ``UNKNOWN`` (alive) where squeue did not answer (``listed`` None)."""
    if listed is None:  # squeue did not answer (:func:`_squeue`): still there, as far as is known
        return "UNKNOWN"
    if str(handle.job_id) in listed:
        return listed[str(handle.job_id)]
    state = str(handle.state).split()[0]
    return "GONE" if state == "UNKNOWN" else state


def _process_identity(pid: int | str) -> str | None:
    """``BOOT_ID:START`` of process ``pid``: this boot's id and the process's start time (clock ticks
    after boot, field 22 of ``/proc/PID/stat``), which a reused PID or a reboot changes; None where
    ``/proc`` cannot tell (the process is gone; not Linux)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot}:{Path(f'/proc/{int(pid)}/stat').read_text().rsplit(')', 1)[1].split()[19]}"
    except (OSError, ValueError, IndexError):
        return None


def _our_controller(job_id: str, folder: str | Path, identity: str | None) -> bool:
    """Is process ``job_id`` (a submitit-local job's id is its controller's PID) still the controller this
    grid started: running, its command line submitit's controller on ``folder`` (this grid's
    ``submitit/``), and the process ``identity`` the ledger recorded (:func:`_process_identity`; an older
    ledger has none)? A PID another program took since (the driver was killed, the machine rebooted;
    a hand-edited ``1``) is not, and keel neither waits on it nor signals it."""
    if not str(job_id).isdigit() or int(job_id) < 2 or not pid_runs(job_id):
        return False
    try:
        argv = Path(f"/proc/{int(job_id)}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return not Path("/proc/self").exists()  # no /proc (not Linux): the PID is all there is to go on
    folders = {str(Path(folder).absolute()), str(Path(folder).resolve())}
    if _CONTROLLER not in argv or not folders & set(argv):
        return False
    return identity is None or _process_identity(job_id) == identity


def _signal_job(handle, entry: Mapping | None = None) -> None:
    """Pass a stop request to a local job: SIGTERM to its controller, which forwards it to the job's
    process (it finishes its step and checkpoints) -- only while the controller is still this grid's
    (:func:`_our_controller`), never to a process that took its PID since."""
    proc = getattr(handle, "_process", None)
    if proc is not None:  # started by this process: Popen knows whether it has ended
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    elif _our_controller(handle.job_id, handle.paths.folder, (entry or {}).get("process")):
        with contextlib.suppress(OSError):
            os.kill(int(handle.job_id), signal.SIGTERM)


def failure_words(text: str) -> str:
    """What a job's failure says, from submitit's error text (the job's traceback between two lines of
    dashes, then the paths of its logs): the exception's line, keel's own without the exception's class
    and without a single run's resume hint (e.g. ``stopped by SIGTERM after step 186: checkpoint …
    written``), another exception's as ``Class: message``."""
    parts = text.split("-" * 22)
    trace = parts[1] if len(parts) >= 3 else text
    lines = [s for s in trace.strip().splitlines() if s.strip() and not s[0].isspace()]
    if not lines:
        return "no error message"
    cls, sep, words = lines[-1].partition(": ")
    if not sep or " " in cls:
        return lines[-1]
    if cls.startswith("keel."):
        return words.split("; resume with:")[0]
    return f"{cls.rsplit('.', 1)[-1]}: {words}"


def _outcome(run_dir: Path, handle, read_result: Callable[[Path], dict | None]) -> dict:
    """The result of a job that ended: its ``result.json``, the dict the job returned (a task error),
    or ``{"status": "error", ...}`` with what the job said (:func:`failure_words`; an exception, a stop
    signal) and where its error log is, or that it left nothing (killed)."""
    r = read_result(run_dir)
    if r is not None:
        return r
    first = _task0(handle)
    if not first.paths.result_pickle.exists():
        return failed_result(run_dir.name, f"job {handle.job_id} ended without a result (killed, or out of time): "
                                           f"see {first.paths.stderr}")
    try:
        out = first.result()
        if isinstance(out, dict):
            return out
        message = f"the job returned {out!r}, not a result"
    except Exception as e:  # noqa: BLE001 - submitit's UncompletedJobError / FailedJobError: recorded
        message = f"job {handle.job_id} ended without a result: {failure_words(str(e))} (log: {first.paths.stderr})"
    return failed_result(run_dir.name, message)


def _starts(handle) -> int:
    """How many times a job started: submitit's ``Starting with JobEnvironment`` lines in its first task's
    log (the log is appended to across a requeue, on Slurm and on this machine alike)."""
    try:
        with open(_task0(handle).paths.stdout, errors="replace") as f:
            return sum("Starting with JobEnvironment" in line for line in f)
    except OSError:
        return 0


@dataclass
class _Submitted:
    """The driver's view of the grid's submitted jobs."""

    ex: Executor
    out_dir: Path
    ledger: dict
    handles: dict = field(default_factory=dict)  # run name -> submitit job, while it is queued or running
    shown: dict = field(default_factory=dict)  # run name -> the state last logged
    stopped: list = field(default_factory=list)  # after a stop request: what each running job said as it ended
    cap: int = 1  # runs at once (array_cap)

    def record(self, name: str, state: str, job_id: str | None = None, detail: str = "", **fields) -> None:
        """Note ``state`` of run ``name`` (a new submission when ``job_id`` is given; ``fields``: more of its
        ledger entry) in the ledger and log it (with ``detail``) when it changed."""
        if job_id is not None:
            attempts = self.ledger.get(name, {}).get("attempts", 0)
            self.ledger[name] = {"job_id": job_id, "attempts": attempts + 1 if isinstance(attempts, int) else 1}
        entry = self.ledger[name]
        entry.update(state=state, updated=time.strftime("%Y-%m-%dT%H:%M:%S"), **fields)
        _save_ledger(self.out_dir, self.ex.kind, self.ledger)
        if self.shown.get(name) != state or detail:
            self.shown[name] = state
            _log.info(f"  {name}: {state} (job {entry['job_id']})" + (f": {detail}" if detail else ""))

    def note_requeues(self, name: str, handle) -> None:
        """Count a requeue of a running job (submitit requeued it: a time limit, a preemption) in its ledger
        entry's ``attempts`` (and ``requeued``), with a line."""
        entry = self.ledger[name]
        requeued = max(0, _starts(handle) - 1)
        if requeued > entry.get("requeued", 0) and isinstance(entry.get("attempts"), int):
            entry["attempts"] += requeued - entry.get("requeued", 0)
            self.record(name, entry.get("state", "running"), detail=f"requeued (attempt {entry['attempts']})",
                        requeued=requeued)


def run_submitit(execute: Callable, task: Callable, todo: list, out_dir: Path, ex: Executor, workers: int,
                 threads: int | None, report: Callable[[object, dict], None], resumed: Callable[[object], bool],
                 read_result: Callable[[Path], dict | None], devices: Sequence[str | None] = ()) -> None:
    """Run the grid jobs ``todo`` as submitit jobs of ``ex`` (see the module docstring), calling
    ``report(job, result)`` as each ends, at most :func:`array_cap` at a time: on Slurm one job array
    (``%cap``) per submission, with ``submitit-local`` that many jobs, job slot i seeing the GPUs
    ``devices[i]`` (:func:`assign_devices`; None: the CPU).

    Args:
        execute: :func:`keel.experiments.grid._execute` (taken as an argument: this module is below
            the grid).
        threads: torch threads of each run; None (Slurm only): each job's allocation (:func:`job_cpus`).
        read_result: the ``result.json`` of a run folder, or None (:func:`keel.experiments.grid.cached_result`).
    Raises:
        KeelError: the folder's ledger names another executor (:func:`check_ledger`).
        Interrupted: SIGINT / SIGTERM to this process. Slurm jobs keep running (``--resume`` waits for
            them); each local job gets one SIGTERM and says how it stopped (its checkpoint), one line each.
    """
    check_ledger(out_dir, ex.kind)
    cap = array_cap(ex, workers)
    executor = _make_executor(ex, out_dir / SUBMITIT_DIR, threads, cap)
    st = _Submitted(ex, out_dir, _load_ledger(out_dir), cap=cap)
    waiting = _reattach(st, todo)
    slots = _Slots(list(devices) or [None] * cap, {n: st.ledger[n].get("devices") for n in st.handles})
    by_name = {j.name: j for j in todo}

    def stop(signum: int) -> None:
        waiting.clear()  # nothing new starts
        if ex.kind != "slurm":  # local jobs stop cleanly (they checkpoint); Slurm ones keep running
            for name, h in list(st.handles.items()):
                _signal_job(h, st.ledger.get(name))

    with passing_on_stop_signals(stop) as received:
        while waiting or st.handles:
            if waiting and ex.kind == "slurm":
                _submit_array(executor, execute, task, waiting, st, resumed, threads)
                waiting.clear()
            while waiting and len(st.handles) < cap:
                _submit(executor, execute, task, waiting.pop(0), st, resumed, threads, slots)
            _collect(st, by_name, report, read_result, stop_only=bool(received), slots=slots)
            if waiting or st.handles:
                time.sleep(ex.poll_s)
    if received:
        raise Interrupted(f"stopped by {signal.Signals(received[0]).name} ({_stop_words(ex, st, received)}; jobs "
                          f"list: {out_dir / LEDGER_FILE}); continue: the same command with --resume (out {out_dir})",
                          received[0])


def _reattach(st: _Submitted, todo: list) -> list:
    """Wait for the jobs of ``todo`` that an earlier invocation submitted and that are still queued or
    running (into ``st.handles``, one status line each); return the rest, to submit. A ledger's
    submitit-local job id whose process is not this grid's controller any more is not waited for (a
    line says so): the run is submitted again."""
    folder = st.out_dir / SUBMITIT_DIR
    known = [j for j in todo if j.name in st.ledger]
    listed = _squeue([st.ledger[j.name]["job_id"] for j in known]) if st.ex.kind == "slurm" and known else {}
    waiting = list(todo)
    for job in known:
        entry = st.ledger[job.name]
        handle = _job_handle(st.ex.kind, folder, entry["job_id"])
        state = _live_state(st.ex.kind, handle, entry, listed)
        if state is not None:
            st.handles[job.name] = handle
            waiting.remove(job)
            st.record(job.name, state)
        elif st.ex.kind != "slurm" and pid_runs(entry["job_id"]) and not _task0(handle).paths.result_pickle.exists():
            entry["state"] = "gone"
            _log.info(f"  {job.name}: job {entry['job_id']}'s process id belongs to another program now (the job "
                      "ended with its driver, or the machine restarted): not waiting on it, nor signalling it")
    return waiting


@dataclass
class _Slots:
    """The devices of submitit-local's job slots (``devices[i]``, or None: the CPU) and which run holds each."""

    devices: list
    held: dict  # run name -> the devices the ledger recorded for it (a job an earlier invocation started)
    taken: dict = field(default_factory=dict)  # run name -> slot index

    def __post_init__(self) -> None:
        for name, dev in self.held.items():
            self.take(name, dev)

    def take(self, name: str, prefer: str | None = None) -> str | None:
        """A free slot for run ``name`` (the one with devices ``prefer`` where free); its devices."""
        free = [i for i in range(len(self.devices)) if i not in self.taken.values()] or [0]
        i = next((i for i in free if self.devices[i] == prefer), free[0])
        self.taken[name] = i
        return self.devices[i]

    def free(self, name: str) -> None:
        self.taken.pop(name, None)


def job_name(ex: Executor, out_dir: Path, run: str | None = None) -> str:
    """The Slurm job name of a grid's submission: ``--slurm name=`` where given, else ``keel-LABEL-GROUP``
    (the study and the grid folder) for a job array, ``keel-LABEL-GROUP-RUN`` for a job of one run."""
    given = ex.slurm.get("name")
    if given:
        return given
    return "-".join(filter(None, ["keel", ex.label, out_dir.absolute().name, run]))


def _note_resubmission(st: _Submitted, job) -> None:
    old = st.ledger.get(job.name)
    if old is not None:
        _log.info(f"  {job.name}: job {old['job_id']} ended ({old.get('state', '?')}) without a result: "
                  "submitting it again (it resumes from its last checkpoint)")


def _submit(executor, execute: Callable, task: Callable, job, st: _Submitted, resumed: Callable, threads,
            slots: _Slots) -> None:
    """Submit one grid job to submitit-local in a free job slot (its GPUs: ``visible_gpus``), noting a
    resubmission of a job that ended without a result; the ledger keeps the controller's process identity."""
    _note_resubmission(st, job)
    devices = slots.take(job.name)
    if devices is not None:
        executor.update_parameters(gpus_per_node=len(devices.split(",")), visible_gpus=_indices(devices))
    with _own_sessions():
        handle = executor.submit(GridCall(execute), task, job, str(st.out_dir / job.name), resumed(job), threads)
    st.handles[job.name] = handle
    st.record(job.name, "queued", str(handle.job_id), process=_process_identity(handle.job_id), devices=devices)


def _indices(devices: str) -> list[int]:
    """``"8,9"`` → ``[8, 9]``: submitit-local sets its jobs' ``CUDA_VISIBLE_DEVICES`` from indices.

    Raises:
        KeelError: devices named otherwise (an inherited ``CUDA_VISIBLE_DEVICES`` of ``GPU-<uuid>`` names).
    """
    try:
        return [int(d) for d in devices.split(",")]
    except ValueError:
        raise KeelError(f"submitit-local gives its jobs GPUs by index, but CUDA_VISIBLE_DEVICES names them "
                        f"({devices}); set it to indices, or use --executor local") from None


def _submit_array(executor, execute: Callable, task: Callable, jobs: list, st: _Submitted, resumed: Callable,
                  threads) -> None:
    """Submit grid jobs to Slurm as one job array (Slurm runs at most the executor's
    ``slurm_array_parallelism`` of its tasks at once), named by :func:`job_name`; one ledger line per run
    (job id ``ARRAY_TASK``)."""
    for job in jobs:
        _note_resubmission(st, job)
    executor.update_parameters(name=job_name(st.ex, st.out_dir, jobs[0].name if len(jobs) == 1 else None))
    with executor.batch():
        handles = [executor.submit(GridCall(execute), task, job, str(st.out_dir / job.name), resumed(job), threads)
                   for job in jobs]
    if len(jobs) > 1:
        _log.info(f"  submitted job array {str(handles[0].job_id).split('_')[0]} ({len(jobs)} runs, at most "
                  f"{min(st.cap, len(jobs))} at a time, job name {job_name(st.ex, st.out_dir)})")
    for job, handle in zip(jobs, handles):
        st.handles[job.name] = handle
        st.record(job.name, "queued", str(handle.job_id))


def _collect(st: _Submitted, by_name: dict, report: Callable, read_result: Callable, stop_only: bool,
             slots: _Slots | None = None) -> None:
    """Log state changes and requeues; report (and forget) the jobs that ended. ``stop_only`` (the driver
    got a stop signal and passed it on): a local job that ends without a result is ``stopped``, not
    ``failed``, with its own words (its checkpoint, or that it had none)."""
    listed = _squeue([h.job_id for h in st.handles.values()]) if st.ex.kind == "slurm" and st.handles else {}
    if listed is None:  # squeue did not answer: no job has ended for it; the next poll asks again
        return
    for name, handle in list(st.handles.items()):
        state = _live_state(st.ex.kind, handle, st.ledger.get(name), listed)
        if state is not None and not (st.ex.kind == "slurm" and stop_only):
            st.record(name, state)
            st.note_requeues(name, handle)
            continue
        st.note_requeues(name, handle)  # also a job requeued and finished between two polls (a short run)
        del st.handles[name]
        if slots is not None:
            slots.free(name)
        if state is not None:  # stopped: Slurm jobs are left running, in the ledger
            continue
        r = _outcome(st.out_dir / name, handle, read_result)
        res = JobResult.from_dict(r)
        if stop_only and not res.done:
            words = res.message.split(" ended without a result: ", 1)[-1].split(" (log: ")[0]
            st.stopped.append(words)
            st.record(name, "stopped", detail=words)
            continue
        st.record(name, "done" if res.done else "failed")
        report(by_name[name], r)


def _stop_words(ex: Executor, st: _Submitted, received: list[int]) -> str:
    """What a stop request did to the grid's jobs, as it happened: Slurm's keep running; local ones,
    how many checkpointed after their step (each said how it stopped, one line each above)."""
    if ex.kind == "slurm":
        return "the Slurm jobs keep running; the same command with --resume waits for them"
    n = len(st.stopped)
    saved = sum("checkpoint" in w and "written" in w for w in st.stopped)
    if n == 0:
        return "no job was running"
    if saved == n:
        return f"{'the running job' if n == 1 else f'each of the {n} running jobs'} finished its step and checkpointed"
    more = f"; a second {signal.Signals(received[-1]).name} stops jobs at once" if len(received) > 1 else ""
    return (f"{saved} of {plural(n, 'running job')} checkpointed after its step, the others stopped without a new "
            f"checkpoint (see above; each resumes from its last one){more}")
