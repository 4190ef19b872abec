"""A generic grid runner: run a list of named jobs in worker processes, cache finished
ones, resume interrupted ones.

It knows nothing about what a job does; a *task* does the work. ``keel sweep``
(:mod:`keel.experiments.sweep`) uses it with a task that trains one config; ``keel
stress`` and ``keel lr-sensitivity`` use it with the same task. Layout under ``out_dir``::

    out_dir/grid.json          the job list (name, values, config) of the latest invocation
    out_dir/NAME/job.json      the job as it was launched (its config is checked on resume)
    out_dir/NAME/result.json   the task's result; its presence means "finished" (cached)
    out_dir/NAME/run.log       everything the task logged
    out_dir/NAME/...           whatever the task writes (a training run directory)

A job is *finished* when ``result.json`` exists: it is never run again (a finished job
whose ``job.json`` holds another config is refused, not reused). A job whose
folder exists without ``result.json`` was interrupted: with ``resume=True`` it is run
again with ``resume=True`` passed to the task (a training task continues from its
latest checkpoint, or starts over if it has none). Without ``resume``, an ``out_dir``
that already holds anything is an error that names ``--resume``.

A task is a module-level function (so that the ``spawn`` start method can pickle it)::

    task(job: GridJob, run_dir: Path, resume: bool) -> dict

It reports progress through ``logging`` (while it runs, the ``keel`` loggers write to the
job's ``run.log``; a ``note`` in its result is shown on the grid's progress line). It
returns a JSON-serialisable dict, stored as ``result.json`` together with
``name``, ``values``, ``status = "done"`` and ``wall_s`` (seconds in the task). A task
that raises is recorded as ``status = "error"`` with the message, is *not* cached (it
runs again on ``--resume``), and does not stop the other jobs; so is a job whose worker process
died (killed by SIGKILL, e.g. by the out-of-memory killer: :mod:`keel.experiments.pool`). An error
that stops a run (a full disk, no memory) is such an error, never a result. A task that should
treat an expected failure (e.g. ``keel.train.TrainingStopped``) as a result catches it
itself and returns it.

Stopping: SIGINT or SIGTERM to the grid process (Ctrl-C reaches only it: workers run in
their own process group) is passed on to every worker; a running training job finishes its
step and checkpoints (a job still starting up stops at once), queued jobs do not start, and
the grid raises ``Interrupted`` (exit 130 / 143); ``--resume`` continues. A second signal
stops the running jobs at once. A ``kill -9`` of the grid kills its workers too.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from keel.config import config_from_dict
from keel.errors import Interrupted, KeelError, plural
from keel.experiments.executor import (Executor, assign_devices, check_ledger, pool_words, run_submitit,
                                       settle_ledger, visible_devices)
from keel.experiments.job_result import JobResult, check_result, failed_result
from keel.experiments.pool import LocalPool
from keel.io import STOP_SIGNALS, atomic_write_text, die_with_parent, make_dirs, remove_empty_dirs
from keel.rundir import RunDir

_log = logging.getLogger(__name__)  # progress lines ("[3/12] name: done in 41 s")

GRID_FILE = "grid.json"

Task = Callable[["GridJob", Path, bool], dict]  # task(job, run_dir, resume); it logs through `logging`


@dataclass
class GridJob:
    """One named job of a grid.

    Attributes:
        name: folder name under ``out_dir`` (letters, digits and ``._=-+`` only).
        config: the nested config dict of the run (``keel.config.Config.to_dict()``), or
            any JSON-serialisable dict the task understands.
        values: the job's coordinates in the grid, e.g. ``{"model.residual": "keel",
            "train.lr": 0.003}`` (JSON-serialisable; shown in tables).
    """

    name: str
    config: dict
    values: dict = field(default_factory=dict)


def _check_name(name: str) -> None:
    ok = name and name not in (".", "..") and all(c.isalnum() or c in "._=-+" for c in name)
    if not ok:
        raise KeelError(f"grid job name {name!r} is not a plain folder name (letters, digits, ._=-+)")


def check_reportable(out_dir: str | Path) -> None:
    """For ``--report-only``: ``out_dir`` must be a folder holding at least one finished job
    (checked before any data is prepared or model built).

    Raises:
        KeelError: ``out_dir`` is missing, a file, or holds no finished job.
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise KeelError(f"cannot write {out_dir}: a file is there, not a folder")  # as keel.io.make_dirs says
    if not out_dir.is_dir() or not any(RunDir(d).result.is_file() for d in out_dir.iterdir()):
        raise KeelError(f"{out_dir} holds no finished run: nothing to report; check --out")


def cached_result(run_dir: str | Path) -> dict | None:
    """The stored ``result.json`` of a finished job, or None if it has not finished (none, or
    not JSON: a write cut short before results were atomic).

    Raises:
        KeelError: the file is JSON of the wrong shape (:func:`check_result`).
    """
    p = RunDir(run_dir).result
    if not p.is_file():
        return None
    try:
        result = json.loads(p.read_text())
    except ValueError:
        return None
    return check_result(p, result)


_STOP_SIGNALS = set(STOP_SIGNALS)
_STOP: list[int] = []  # in a worker: the signal that stopped the grid (see _init_worker); no job starts after it
_WORKER: list[int] = []  # set by _init_worker: this process is a grid worker
_RUNNING: list[str] = []  # in a worker: the job it is running, if any


def _worker_signal(signum, frame) -> None:
    """A grid worker's SIGINT/SIGTERM handler outside the trainer's own (see _init_worker)."""
    _STOP.append(signum)
    if _RUNNING:  # a job is starting up (or finishing) outside the training loop: stop it now
        raise KeyboardInterrupt


def _init_worker(threads: int, device: str | None = None) -> None:
    """A grid worker's initializer (:class:`keel.experiments.pool.LocalPool`): limit intra-op threads
    so workers x threads ~ cores; the worker dies with the grid process. It runs in its own process group, so a terminal's
    Ctrl-C reaches only the grid process, which passes the signal on to each worker
    (:func:`_run_in_workers`). In the training loop the trainer's handler takes it (the run
    finishes its step and is checkpointed); outside it (a job starting up: data, model) the
    job stops at once, as there is nothing to checkpoint yet; between jobs it is recorded and
    no further job starts. ``device``: this worker's ``CUDA_VISIBLE_DEVICES``
    (:func:`keel.experiments.executor.assign_devices`; None on a machine without GPUs)."""
    if device is not None:  # before anything touches CUDA in this process
        os.environ["CUDA_VISIBLE_DEVICES"] = device
    die_with_parent(signal.SIGKILL)  # a kill -9 of the grid: no worker left behind (it would hang)
    os.setpgrp()
    for s in STOP_SIGNALS:
        signal.signal(s, _worker_signal)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)  # blocked since spawn (keel.experiments.pool)
    _WORKER.append(os.getpid())
    os.environ["OMP_NUM_THREADS"] = str(threads)
    os.environ["MKL_NUM_THREADS"] = str(threads)

    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set in this process
        pass


@contextlib.contextmanager
def _logging_to(stream):
    """Send the ``keel`` logger's records to ``stream`` (a run's log file) instead of its
    usual handlers while a grid task runs."""
    logger = logging.getLogger("keel")
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(message)s"))
    saved, level, propagate = logger.handlers[:], logger.level, logger.propagate
    logger.handlers, logger.propagate = [handler], False
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.handlers, logger.propagate = saved, propagate
        logger.setLevel(level)


def _execute(task: Task, job: GridJob, run_dir: str, resume: bool) -> dict:
    """Run one job (in a worker or in-process); never raises for a task error.

    In a worker, a stop signal (:func:`_worker_signal`) from the first line to the trainer's own
    handler stops the job at once (``KeyboardInterrupt``), and one received before it (between
    jobs) keeps it from starting (``Interrupted``): the job is marked running (``_RUNNING``) before
    ``_STOP`` is read, so no signal falls between the two. (It was marked after its run.log was
    open: a SIGINT in between was recorded and the job trained on to its last step.)"""
    try:
        _RUNNING.append(job.name)
        if _STOP:  # the grid was stopped while this job waited in the queue: do not start it
            raise Interrupted("not started: the grid was stopped", _STOP[0])
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(RunDir(run_dir).job, json.dumps(asdict(job), indent=1))
        t0 = time.perf_counter()
        with open(RunDir(run_dir).log, "a") as logf, _logging_to(logf):
            _log.info(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} {'resume' if resume else 'start'} {job.name}")
            try:
                out = dict(task(job, run_dir, resume))
            except SystemExit:  # a submitit job requeued (keel.experiments.executor): not a result
                raise
            except (KeyboardInterrupt, Interrupted) as e:  # Ctrl-C stops the grid, not just this run
                if _WORKER:  # the jobs queued to this worker must not start
                    _STOP.append(getattr(e, "signum", signal.SIGINT))
                raise
            except BaseException as e:  # noqa: BLE001 - recorded, the grid goes on
                _log.info(traceback.format_exc().rstrip("\n"))
                kind = "" if isinstance(e, KeelError) else f"{type(e).__name__}: "
                return failed_result(job.name, f"{kind}{e}", time.perf_counter() - t0, job.values)
    finally:
        _RUNNING.clear()
    own = JobResult.from_dict(out).wall_s  # a task may time itself (the training task does)
    result = {"name": job.name, "values": job.values, "status": "done", **out,
              "wall_s": own if own is not None else time.perf_counter() - t0}
    atomic_write_text(RunDir(run_dir).result, json.dumps(result, indent=1, default=str))
    return result


def plan_grid(jobs: Sequence[GridJob], out_dir: str | Path, resume: bool = False,
              check: Callable[[GridJob], None] | None = None) -> tuple[list[GridJob], list[GridJob]]:
    """Split ``jobs`` into (finished, to run); check names and the resume rules.

    Raises:
        KeelError: duplicate or unsafe names; a job to run that ``check(job)`` refuses (the
            message names the job); ``out_dir`` not empty without ``resume``; a
            finished or interrupted job whose stored ``job.json`` has a different config (the
            grid changed: its cached result would not belong to this grid).
    """
    out_dir = Path(out_dir)
    names = [j.name for j in jobs]
    for n in names:
        _check_name(n)
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise KeelError(f"grid has repeated run names: {', '.join(dup)}")
    if out_dir.exists() and not out_dir.is_dir():
        raise KeelError(f"output {out_dir} exists and is not a folder")
    if not resume and out_dir.is_dir() and any(out_dir.iterdir()):
        raise KeelError(f"output folder {out_dir} is not empty; use --resume to continue it, or another --out")
    done, todo = [], []
    for job in jobs:
        run_dir = out_dir / job.name
        if cached_result(run_dir) is not None:
            done.append(job)
            continue
        _check_same_config(run_dir, job)
        if check is not None:  # every run is checked before the first one starts
            try:
                check(job)
            except KeelError as e:
                raise KeelError(f"run {job.name}: {e}") from None
        todo.append(job)
    for job in done:
        _check_same_config(out_dir / job.name, job)
    return done, todo


def _with_defaults(config: dict) -> dict:
    """A training config dict with every key a later keel added filled in with its default
    (:func:`keel.config.config_from_dict`), so that a run started before a new config key
    existed still matches its job; any other dict is returned as it is."""
    try:
        return json.loads(json.dumps(config_from_dict(config, stored=True).to_dict()))
    except (KeelError, TypeError, ValueError, AttributeError):
        return config


def _check_same_config(run_dir: Path, job: GridJob, ignore: Sequence[str] = ()) -> None:
    """Raise KeelError if ``run_dir/job.json`` holds another config than ``job`` (naming the keys),
    leaving out the ``section.key`` names in ``ignore``."""
    stored = RunDir(run_dir).job
    if not stored.is_file():
        return
    old, new = json.loads(stored.read_text()).get("config") or {}, json.loads(json.dumps(job.config))
    old, new = _with_defaults(old), _with_defaults(new)
    for key in ignore:
        sec, name = key.split(".", 1)
        for config in (old, new):
            if isinstance(config.get(sec), dict):
                config[sec].pop(name, None)
    if old == new:
        return
    keys = []
    for sec in sorted(set(old) | set(new)):
        a, b = old.get(sec), new.get(sec)
        if isinstance(a, dict) and isinstance(b, dict):
            keys += [f"{sec}.{k}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
        elif a != b:
            keys.append(sec)
    raise KeelError(f"run {run_dir} was started with other settings ({', '.join(keys)}); continue it with the "
                    f"settings in its {RunDir.JOB} (e.g. the same --set flags), or use another --out")


def check_started(jobs: Sequence[GridJob], out_dir: str | Path, ignore: Sequence[str] = ("data.path",)) -> None:
    """Refuse to continue ``out_dir`` with other settings before anything slow runs: raise
    KeelError (naming the keys) if the folder of one of ``jobs`` there was started with another
    config, leaving out the ``section.key`` names in ``ignore`` (e.g. ``data.path``, known only once
    the dataset is prepared, which for a download takes long). Folders not started pass."""
    for job in jobs:
        _check_same_config(Path(out_dir) / job.name, job, ignore)


def check_pool(workers: int, threads: int | None) -> None:
    """Raise KeelError for ``workers < 0`` or ``threads < 0`` (the grid's ``--workers`` / ``--threads``)."""
    if workers < 0:
        raise KeelError(f"--workers must be >= 0, got {workers}")
    if threads is not None and threads < 0:
        raise KeelError(f"--threads must be >= 0 (0 = cores / workers), got {threads}")


def gpu_count() -> int:
    """CUDA devices on this machine (0 without CUDA); read without initialising CUDA here."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def worker_devices(workers: int, executor: Executor) -> list[str | None]:
    """``CUDA_VISIBLE_DEVICES`` of each local worker (None each without GPUs): see
    :func:`keel.experiments.executor.assign_devices`.

    Raises:
        KeelError: more workers x GPUs per run than GPUs, without ``share_gpus``.
    """
    return assign_devices(max(1, workers), executor.gpus_per_run, gpu_count(), executor.share_gpus, visible_devices())


def run_grid(jobs: Sequence[GridJob], out_dir: str | Path, task: Task, *, workers: int = 1,
             resume: bool = False, threads: int | None = None,
             check: Callable[[GridJob], None] | None = None, executor: Executor | None = None) -> list[dict]:
    """Run every job of the grid that has not finished; return all results in job order.

    Args:
        jobs: the grid (names unique).
        out_dir: parent folder of the job folders.
        task: ``task(job, run_dir, resume) -> dict``, a module-level function; it reports
            progress through ``logging`` (the ``keel`` loggers go to the job's ``run.log`` meanwhile).
        workers: worker processes (:class:`keel.experiments.pool.LocalPool`, ``spawn`` start method);
            0 runs the jobs one after another in this process (debugging, tests). With a submitit
            executor: runs at once (:func:`keel.experiments.executor.array_cap`; Slurm: the job array's cap).
        resume: continue a non-empty ``out_dir`` (finished jobs are skipped, interrupted
            ones are resumed); without it a non-empty ``out_dir`` is an error.
        threads: torch intra-op threads per worker; default ``max(1, cores // workers)``, on Slurm the CPUs
            of each job's allocation (and given, the CPUs each job asks for).
        check: ``check(job)`` raises KeelError for a job that must not start (e.g.
            :func:`keel.experiments.sweep.check_train_job`); every job to run is checked before
            the first starts, so one bad job stops the grid before anything is written.
        executor: where the runs go (:class:`keel.experiments.executor.Executor`; default local
            workers, each with its own GPUs where there are any).
    Returns:
        One dict per job: the cached or new ``result.json`` content (``status = "done"``),
        or ``{"status": "error", "message": ...}`` for a job whose task raised.
    Raises:
        KeelError: see :func:`plan_grid`; ``workers < 0``; more local workers than GPUs (:func:`worker_devices`).
    """
    check_pool(workers, threads)
    executor = executor or Executor()
    devices = worker_devices(workers, executor) if executor.kind != "slurm" else []
    out_dir = Path(out_dir)
    done, todo = plan_grid(jobs, out_dir, resume, check)
    if todo:  # a ledger's job ids are another executor's: refused before anything is written
        check_ledger(out_dir, executor.kind)
    make_dirs(out_dir)
    atomic_write_text(out_dir / GRID_FILE, json.dumps([asdict(j) for j in jobs], indent=1))
    results: dict[str, dict] = {j.name: cached_result(out_dir / j.name) for j in done}
    settle_ledger(out_dir, executor.kind, done)  # runs whose jobs ended while the driver was stopped
    n_workers = max(1, workers)
    if executor.kind != "slurm":  # a Slurm job takes its own allocation's CPUs (executor.job_cpus)
        threads = threads or max(1, (os.cpu_count() or 1) // n_workers)
    _log.info(f"grid: {plural(len(jobs), 'run')}, {len(done)} finished already, {len(todo)} to run "
              f"({pool_words(executor, workers, threads)}), out {out_dir}")
    count = [len(done)]

    def report(job: GridJob, r: dict) -> None:
        results[job.name] = r
        count[0] += 1
        res = JobResult.from_dict(r)
        what = "done" if res.done else f"error: {res.message}"
        what += f"; {res.note}" if res.note else ""
        _log.info(f"[{count[0]}/{len(jobs)}] {job.name}: {what} ({res.wall_s:.0f} s)")

    def resumed(job: GridJob) -> bool:
        return (out_dir / job.name).exists()

    if todo and executor.kind != "local":
        run_submitit(_execute, task, todo, out_dir, executor, workers, threads, report, resumed, cached_result,
                     devices)
    elif todo and workers == 0:
        for job in todo:
            report(job, _execute(task, job, str(out_dir / job.name), resumed(job)))
    elif todo:
        _run_in_workers(task, todo, out_dir, workers, threads, report, resumed, devices)
    return [results[j.name] for j in jobs]


def _run_in_workers(task: Task, todo: list[GridJob], out_dir: Path, workers: int, threads: int,
                    report: Callable[[GridJob, dict], None], resumed: Callable[[GridJob], bool],
                    devices: Sequence[str | None] = ()) -> None:
    """Run ``todo`` in ``workers`` spawned processes (:class:`keel.experiments.pool.LocalPool`),
    calling ``report(job, result)`` as each ends; worker i sees the GPUs ``devices[i]``
    (``CUDA_VISIBLE_DEVICES``) where that is not None.

    A worker that dies (killed by SIGKILL, as the out-of-memory killer does) fails its job only:
    it is reported as an error naming the signal (not cached: ``--resume`` runs it again), a
    new worker takes its place and the other jobs go on (it was a ``BrokenProcessPool``
    traceback that abandoned the rest of the grid).

    The first SIGINT or SIGTERM to the grid process stops the grid cleanly: jobs not started
    are cancelled, and each worker gets the same signal, so a running job finishes its step
    and checkpoints its run (:mod:`keel.train.interrupt`); then :class:`Interrupted`. Every
    later signal is passed on too: a second Ctrl-C stops the running jobs at once.

    Raises:
        Interrupted: stopped by SIGINT / SIGTERM (``--resume`` continues every run).
        KeelError: no worker process can be started (e.g. ``ulimit -n``), in one line.
    """
    devices = list(devices) or [None]
    pool = LocalPool(workers, _init_worker, [(threads, devices[i % len(devices)]) for i in range(workers)])

    def died(job: GridJob, why: str, wall_s: float) -> None:
        message = f"{why}; --resume runs it again"
        with contextlib.suppress(OSError), open(RunDir(out_dir / job.name).log, "a") as logf:
            logf.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} {job.name} failed: {message}\n")
        report(job, failed_result(job.name, message, wall_s, job.values))

    try:
        received = pool.run([(job, _execute, (task, job, str(out_dir / job.name), resumed(job))) for job in todo],
                            report, died)
    except KeelError:  # no worker could start: where no run of the grid exists, its grid.json is all it wrote
        if not any(p.is_dir() for p in out_dir.iterdir()):
            (out_dir / GRID_FILE).unlink(missing_ok=True)
            remove_empty_dirs([out_dir])
        raise
    if received:
        name = signal.Signals(received[0]).name
        how = ("each running job finished its step and checkpointed its run" if len(received) == 1 else
               f"a second {signal.Signals(received[-1]).name} stopped the running jobs at once: each resumes "
               "from its last checkpoint")
        raise Interrupted(f"stopped by {name} ({how}; jobs not started were cancelled); continue: the same "
                          f"command with --resume (out {out_dir})", received[0])
