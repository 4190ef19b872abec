"""Run a study (``keel study``): collect its groups' runs on the grid runner (each run's record,
:func:`collect`) and drive it (:func:`run_study`, :func:`execute`: the folder, the dataset, the
executor, ``--restore``, ``--dry-run``, the report)."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import signal
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

from keel.config import load_config, resolve_config_path
from keel.data.stats import dataset_unigram_entropy
from keel.errors import Interrupted, KeelError, plural
from keel.experiments import stress as ST
from keel.experiments.executor import Executor, check_slurm_here
from keel.experiments.grid import GridJob, cached_result, check_pool, check_started, run_grid
from keel.experiments.job_result import JobResult
from keel.experiments.record import RunRecord
from keel.experiments.study.claims import load_study
from keel.experiments.study.dataset import NO_DATA, check_study_data, shares_data, study_dataset
from keel.experiments.study.judge import write_report
from keel.experiments.study.lrs import group_records
from keel.experiments.study.plan import plan_markdown, plan_rows, plan_total, planned_jobs
from keel.experiments.study.records import kept_restored, load_restored, restored_record, run_record
from keel.experiments.study.report import waiting_words
from keel.experiments.study.spec import Group, Study
from keel.experiments.sweep import check_train_job, train_task
from keel.io import LOCK_NAME, RunLock, atomic_write_text, make_dirs, remove_empty_dirs


_log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- collecting runs
def collect(study: Study, data_dir: str, out: Path, *, train: bool | Sequence[str],
            grid: Callable = functools.partial(run_grid, check=check_train_job),
            restored: dict[tuple[str, str], dict] | None = None,
            superseded: list[RunRecord] | None = None) -> tuple[list[RunRecord], list[dict]]:
    """Run or only read every group in order; return the run records (:func:`run_record`) of
    every job, finished or not, and per group not planned yet (an ``lr_from`` group whose source has not
    finished: skipped, logged, run on a later invocation) a dict for :func:`.report.waiting_words`.
    ``train``: True trains every group, False none, a list of group names only those (the other
    groups are read, so the report still covers them). ``grid``: :func:`keel.experiments.grid.run_grid`
    with the workers, threads, executor and each run's check (:func:`keel.experiments.sweep.check_train_job`)
    bound. ``restored``: :func:`load_restored`; a
    run there is not trained, and its record stands in unless its own folder holds a result."""
    restored = restored or {}
    runs: list[dict] = []
    waiting = []
    for g in study.groups:
        trains = train is True or (bool(train) and g.name in train)

        def read(refs, jobs, now, g=g, trains=trains):
            recs = _train_and_read(g, refs, jobs, out, restored, trains and now, grid)
            if superseded is not None and now:  # kept in the report (out of every verdict): nothing measured is lost
                stale = superseded_runs(g, jobs, restored, out / g.dir_name)
                superseded.extend(replace(restored[(g.name, old)], status="superseded") for old in stale
                                  if (g.name, old) in restored)
            return recs

        got = group_records(study, g, runs, data_dir, out, read)
        if got is None:
            n = sum(len(g.scheme_seeds(s)) for s in g.schemes) * len(g.sublayers) * len(g.lr_from_steps)
            waiting.append({"group": g.name, "runs": n, "sublayers": list(g.sublayers), "source": g.lr_from,
                            "source_sublayers": g.lr_from_sublayers})
            if trains:
                _log.info(f"study: {waiting_words(waiting[-1])}")
            runs += kept_restored(g, restored)  # measured runs stay in the report while their group waits
            continue
        runs += got[2]
    return runs, waiting


def superseded_runs(g: Group, jobs: list[GridJob], restored: dict, gdir: Path) -> dict[str, str]:
    """``{old run name: scheme}`` of the runs of ``g`` that a scheme's newer implementation
    replaces (:func:`keel.experiments.sweep.build_jobs` names them ``<name>_v<version>``): a
    restored record or a run folder under the old name, for a job of the new one."""
    out = {}
    for j in jobs:
        v = j.values.get("scheme_version")
        if v is None:
            continue
        old = j.name[: -len(f"_v{v}")]
        if (g.name, old) in restored or (gdir / old).is_dir():
            out[old] = j.config["model"]["residual"]
    return out


def _train_and_read(g: Group, refs: list[GridJob], jobs: list[GridJob], out: Path, restored: dict, trains: bool,
                    grid: Callable) -> list[dict]:
    """:func:`collect`'s work for one group's jobs: train those not finished and not restored
    (when ``trains``), then return every job's record (its folder's result, else its restored
    record, else pending; ``error`` with the message for a run that failed now)."""
    gdir = out / g.dir_name
    olds = {j.name: restored_record(g, j, restored[(g.name, j.name)]) for j in jobs if (g.name, j.name) in restored}
    todo = [j for j in jobs if olds.get(j.name) is None]
    refs, errors = [r for r in refs if r.name in ST.references_of(todo)], {}  # only the references of runs to train
    fresh = [j for j in todo if (cached_result(gdir / j.name) or {}).get("status") != "done"]
    stale = superseded_runs(g, fresh, restored, gdir)  # announced while their replacements are still to train
    if trains and stale:
        _announce_superseded(g, stale)
    if trains and todo:
        errors = _train_jobs(g, refs, todo, len(jobs), gdir, grid)
    return [_job_record(g, j, gdir, olds.get(j.name), errors.get(j.name)) for j in jobs]


def _announce_superseded(g: Group, stale: dict[str, str]) -> None:
    """Log that the runs ``stale`` of group ``g`` (:func:`superseded_runs`) train again: an older implementation
    of their scheme trained them."""
    were, they = ("was", "it trains") if len(stale) == 1 else ("were", "they train")
    _log.info(f"study: group {g.name}: {plural(len(stale), 'earlier run')} of "
              f"{', '.join(sorted(set(stale.values())))} {were} trained by an older implementation of the scheme; "
              f"{they} again")


def _train_jobs(g: Group, refs: list[GridJob], todo: list[GridJob], n_jobs: int, gdir: Path,
                grid: Callable) -> dict[str, JobResult]:
    """Train the runs ``todo`` of group ``g`` (of its ``n_jobs``; the others restored) in ``gdir``, after the
    reference runs ``refs`` they need; returns ``{name: grid result}`` of the runs that failed."""
    _log.info(f"study: group {g.name}: {plural(len(todo), 'run')}"
              + (f" ({n_jobs - len(todo)} more restored)" if len(todo) < n_jobs else "")
              + (f" + {plural(len(refs), 'reference run')}" if refs else ""))
    if refs:
        grid(refs, gdir / ST.REFERENCES, train_task, resume=True)
    got = grid(todo, gdir, g.kind_class.task(g), resume=True)
    return {j.name: r for j, r in zip(todo, map(JobResult.from_dict, got)) if r.status == "error"}


def _job_record(g: Group, j: GridJob, gdir: Path, old: RunRecord | None, error: JobResult | None) -> RunRecord:
    """The record of job ``j`` of group ``g``: its folder's result (:func:`run_record`), else its restored
    record ``old``, else pending; ``error`` (a grid result): the run failed now, with its message."""
    res = cached_result(gdir / j.name)
    rec = run_record(g, j, gdir / j.name, res if res and JobResult.from_dict(res).done else None)
    if rec.status == "pending" and old is not None:
        rec = old
    if error is not None:
        rec.update(status="error", message=error.message)
    return rec


# ----------------------------------------------------------------------------- driver
def run_study(name: str, scale: str, out: str | Path, sets: Sequence[str] = (), **options) -> dict:
    """Run (or continue, or only report, or only plan) study ``name`` (a packaged study,
    ``keel/configs/studies/NAME.toml``, or a TOML path) at ``scale``, ``sets`` (``section.key=value``)
    applied to every run after the scale's keys: :func:`load_study`, then :func:`execute` with ``options``.

    Raises:
        KeelError: a bad study or scale (:func:`load_study`), and as :func:`execute`.
    """
    return execute(load_study(name, scale, sets), out, **options)


def execute(study: Study, out: str | Path, *, workers: int | None = None, threads: int | None = None, resume: bool = False,
            report_only: bool = False, dry_run: bool = False, mfu: float = 0.35, peak_tflops: float = 989.0,
            command: str = "", groups: Sequence[str] = (), restore: str | Path | None = None,
            executor: Executor | None = None) -> dict:
    """The one experiment engine: run (or continue, or only report, or only plan) a loaded study,
    from a study file (``keel study``) or built by a preset's front-end (``keel sweep``, ``keel
    stress``, ``keel lr-sensitivity``): the folder check and lock, the dataset prepared once,
    every group's runs on the grid runner, ``--restore``, the ``--dry-run`` plan, the report.

    Args:
        study: the study (:func:`load_study`, or built in code).
        out: output folder (run folders, ``report.md``, ``report.json``, PNGs).
        workers, threads, executor: as :func:`keel.experiments.grid.run_grid`; None (not given): what ``out``
            recorded when it started (``study.json``: a bare ``--resume`` continues as it began), else 1
            worker, cores / workers threads, the local executor (:func:`engine_executor`).
        resume: continue a non-empty ``out``; report_only: train nothing, report the finished runs.
        dry_run: prepare nothing and train nothing; return the plan (runs, tokens, estimated
            GPU-hours at ``mfu`` of ``peak_tflops`` dense bf16 TFLOP/s) as ``{"plan": rows per group,
            "total": the sums of runs, references, tokens, FLOPs and GPU-hours, "markdown": ...}``, and
            with ``restore`` ``restored`` (planned runs it holds; see :func:`_dry_run`) and ``restored_from``.
        command: the command line; the report shows the one that started ``out`` (``study.json``).
        groups: train only these groups (still in the study's order; empty: all). The report
            covers every group's finished runs. An ``lr_from`` group still waits for its source.
        restore: an earlier ``report.json`` of this study (:func:`load_restored`, e.g. the
            committed one when ``out`` was lost): its finished runs are not trained again and
            count in the verdicts and tables; their plots are redrawn from the thinned curves they keep.
    Returns:
        The ``report.json`` content: ``study``, ``scale``, ``claims`` (per claim its verdict and
        numbers), ``baseline_margins`` (:func:`baseline_margins` of each group, with ``group``),
        ``runs`` (every planned run's record, :func:`run_record`), ``plots``, and where a group has
        its own table (a grid group's sweep table; a ramp or train group's with ``table``)
        ``group_tables`` (``{group: data}``, :func:`keel.experiments.study.report.group_tables`, also
        sections of ``report.md``).
    Raises:
        KeelError: bad study or scale (:func:`load_study`), bad config, ``out`` not usable
            (:func:`_claim_out`: a file, another study's folder, non-empty without ``resume``);
            ``groups`` names a group the scale does not have; a bad ``restore``; the dataset cannot be
            prepared, or a run's ``model.vocab_size`` is below its vocabulary (:func:`study_dataset`); another
            executor than ``out`` was started with (:func:`engine_executor`).
    """
    _check_groups(study, study.scale, groups)
    out = Path(out)
    base = load_config(resolve_config_path(study.base), study.base_sets())  # a bad --set: refused before out is claimed
    plan_rows(study, "<data>", out, mfu, peak_tflops)  # every group's configs: a bad group set refused now, naming it
    check_pool(workers or 0, threads)
    restored = load_restored(restore, study) if restore is not None else {}  # after the --set keys are checked
    if dry_run:  # what can be checked of the data without preparing it
        check_study_data(study, base, planned_jobs(study, NO_DATA, out, restored))
        return _dry_run(study, out, groups, restored, restore, mfu, peak_tflops)
    _check_no_restored_runs_lost(out, restore)
    from_report = report_only and restore is not None  # a report of restored runs needs no earlier folder
    fresh = not out.exists()
    first_command = _claim_out(out, study, _command_of(restore) or command if from_report else command,
                               resume=resume or from_report, report_only=report_only and not from_report)
    if resume or report_only:  # runs started with other settings: refused now, not after the dataset is
        check_started_runs(study, out)  # prepared (--resume), nor reported under settings they never had
    superseded: list[RunRecord] = []
    with _stopped_hint(out), _unclaimed_if(fresh, out), contextlib.nullcontext() if report_only else study_lock(out):
        if not report_only:  # the folder's executor, or the one it is started with (recorded)
            executor, workers, threads = engine_executor(out, executor, workers, threads, study.name)
        data_dir = study_dataset(base, planned_jobs(study, NO_DATA, out, restored)) \
            if shares_data(study, report_only) else NO_DATA  # prepared once; every run's vocab_size checked on it
        grid = functools.partial(run_grid, workers=workers or 0, threads=threads or None, executor=executor,
                                 check=_run_check(executor))
        runs, waiting = collect(study, data_dir, out, train=False if report_only else (list(groups) or True),
                                grid=grid, restored=restored, superseded=superseded)
    report = write_report(study, runs, out, _unigram_entropy(data_dir, runs), first_command, restore, superseded,
                          waiting)
    _warn_restored_left_out(restored, runs, superseded, restore)
    _warn_failed(runs, out)
    return report


def _warn_restored_left_out(restored: dict[tuple[str, str], RunRecord], runs: list[RunRecord],
                            superseded: list[RunRecord], restore: str | Path | None) -> None:
    """Log a warning naming the finished runs of the ``--restore`` report (``restored``, :func:`load_restored`)
    that the new report (``runs``, ``superseded``) leaves out: runs of a group this study does not have, or at
    coordinates none of its planned runs has (a study file edited since). A later ``--restore`` of the new
    report would not have them. A run the report has from its folder (trained, not restored) is not left out."""
    kept = {(r.group, r.name) for r in runs} | {(r.group, r.name) for r in superseded}
    left = Counter(g for g, name in restored if (g, name) not in kept)
    if left:
        n = sum(left.values())
        where = "; ".join(f"group {g}: {k}" + ("" if g in {r.group for r in runs} else " (not a group of this study)")
                          for g, k in left.items())
        _log.warning(f"study: {plural(n, 'finished run')} of --restore {restore} {'is' if n == 1 else 'are'} not "
                     f"planned by this study and left out of its report ({where})")


def _unigram_entropy(data_dir: str, runs: list[RunRecord]) -> float | None:
    """The training tokens' unigram entropy (nats) for the report: of the prepared dataset ``data_dir``, else
    (no dataset: a report of restored runs) as the first run that records it; None where none does."""
    if data_dir != NO_DATA:
        return dataset_unigram_entropy(data_dir)
    return next((h1 for h1 in (JobResult.from_dict(r.result).unigram_entropy for r in runs) if h1), None)


def _warn_failed(runs: list[RunRecord], out: Path) -> None:
    """Log which ``runs`` failed with no result (each has its line above; the CLI then exits 1), and how to
    train them again."""
    failed = [r.name for r in runs if r.status == "error"]
    if failed:
        names = ", ".join(failed[:10]) + (f" and {len(failed) - 10} more" if len(failed) > 10 else "")
        _log.warning(f"study: {plural(len(failed), 'run')} failed, with no result: {names} (the reasons: the lines "
                     f"above, each run's run.log); the same command with --resume trains them again (out {out})")


def _run_check(executor: Executor | None) -> Callable:
    """The check of each run before the first starts (:func:`keel.experiments.sweep.check_train_job`): on
    Slurm not against this (login) node's device and memory; its batch over the ranks the executor gives a run."""
    ex = executor or Executor()
    return functools.partial(check_train_job, here=ex.kind != "slurm", world_size=ex.world_size())


def engine_executor(out: Path, given: Executor | None, workers: int | None, threads: int | None,
                    label: str) -> tuple[Executor, int, int | None]:
    """The executor, workers and threads this training invocation of study folder ``out`` uses, recorded in
    its ``study.json`` (``executor``): what is given, else (a ``--resume`` without the flags) what the folder
    recorded, else the local executor with 1 worker; ``label`` (the study's name) names Slurm jobs. A
    ``--slurm KEY=VALUE`` given on resume replaces that key of the recorded ones and keeps the others; a
    ``--gpus-per-run`` or ``--share-gpus`` not given keeps the recorded value (:attr:`Executor.unset`).

    Raises:
        KeelError: ``given`` is another executor than the one ``out`` was started with (its Slurm job ids
            would be waited on here as process ids, or its runs trained a second time beside the jobs).
    """
    marker = out / "study.json"
    held = json.loads(marker.read_text(encoding="utf-8"))  # _claim_out wrote or checked it
    rec = held.get("executor")
    if isinstance(rec, dict):
        try:
            was = Executor.from_record(rec)
        except KeelError as e:
            raise KeelError(f"{marker}: {e}") from None
        if given is not None and given.kind != was.kind and given.slurm and was.kind != "slurm":
            raise KeelError(f"{out} was started with --executor {was.kind}: --slurm sets the Slurm parameters of a "
                            f"folder started with --executor slurm; drop it ({marker} holds its settings), or use "
                            "another --out")
        if given is not None and given.kind != was.kind:
            raise KeelError(f"{out} was started with --executor {was.kind}, not {given.kind}; continue it with "
                            f"--executor {was.kind} (or leave --executor out: {marker} holds its settings), or use "
                            "another --out")
        if given is not None:  # --slurm KEY=V on resume replaces KEY, keeps the rest; a flag not given: the folder's
            given = replace(given, slurm={**was.slurm, **given.slurm}, **{k: getattr(was, k) for k in given.unset})
        given = given or was
        workers = rec.get("workers") if workers is None else workers
        threads = rec.get("threads") if threads is None else threads
    ex = replace(given or Executor(), label=label)
    workers = workers if isinstance(workers, int) else 1
    threads = threads if isinstance(threads, int) else None
    check_slurm_here(ex)
    atomic_write_text(marker, json.dumps({**held, "executor": {**ex.record(), "workers": workers, "threads": threads}},
                                         indent=1))
    return ex, workers, threads


@contextlib.contextmanager
def _stopped_hint(out: Path):
    """Re-raise the grid's :class:`Interrupted` with the study's folder in its hint (the grid's
    names a group's folder): what stopped and how, then ``continue: the same command with --resume``."""
    try:
        yield
    except Interrupted as e:
        msg = str(e)  # the grid's says how its jobs stopped; a run's own (workers=0) names its checkpoint: left out
        what = msg.split("; continue:")[0] if "; continue:" in msg else f"stopped by {signal.Signals(e.signum).name}"
        raise Interrupted(f"{what}; continue: the same command with --resume (out {out})", e.signum) from None


@contextlib.contextmanager
def _unclaimed_if(fresh: bool, out: Path):
    """On a KeelError before any run began (the data, :func:`study_dataset`; the grid's check of every run), take
    back the marker :func:`_claim_out` wrote in a folder this invocation created, and the folder:
    nothing half-written is left behind."""
    try:
        yield
    except KeelError:
        left = {p.name for p in out.iterdir()} if fresh and out.is_dir() else None
        if left is not None and left <= {"study.json", LOCK_NAME}:
            for name in left:
                (out / name).unlink(missing_ok=True)
            remove_empty_dirs([out])
        raise


def _check_groups(study: Study, scale: str, groups: Sequence[str]) -> None:
    """Raise KeelError naming the ``--groups`` entries the study's scale does not have."""
    unknown = [g for g in groups if g not in {x.name for x in study.groups}]
    if unknown:
        raise KeelError(f"study {study.name!r} at scale {scale!r} has no group(s) {', '.join(unknown)} "
                        f"(groups: {', '.join(x.name for x in study.groups)})")


def _command_of(report: str | Path) -> str | None:
    """The command a ``--restore`` report records (the study's first), or None if it records none:
    a report made only of restored runs names the command that trained them, not its own."""
    try:
        command = json.loads(Path(report).read_text(encoding="utf-8")).get("command")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):  # load_restored has read it already
        return None
    return command if isinstance(command, str) else None


def study_lock(out: Path) -> RunLock:
    """The OS lock (:class:`keel.io.RunLock`) a training study holds on its folder ``out``.

    Raises (on entry):
        KeelError: another ``keel study`` trains in ``out`` (the message names its pid).
    """
    lock = RunLock(out)
    lock.busy = f"study folder {out} is in use by another keel study (pid {{pid}}); wait for it or stop it first"
    return lock


def _dry_run(study: Study, out: Path, groups: Sequence[str], restored: dict, restore,
             mfu: float, peak_tflops: float) -> dict:
    """:func:`run_study`'s ``dry_run`` answer: the plan of ``groups`` (all when empty); with
    ``restore``, planned as its runs give it (:func:`plan_rows`: LRs widened, an ``lr_from`` group
    at its source's restored optimum), with the runs it holds (they would not train) and the
    GPU-hours left."""
    rows = [r for r in plan_rows(study, "<data>", out, mfu, peak_tflops, restored) if not groups or r["group"] in groups]
    answer = {"plan": rows, "total": plan_total(rows)}
    if restore is not None:
        answer.update(restored=answer["total"]["restored"], restored_from=str(restore))
    return {**answer, "markdown": plan_markdown(study, rows, mfu, peak_tflops, None if restore is None else str(restore))}


def check_started_runs(study: Study, out: Path) -> None:
    """:func:`keel.experiments.grid.check_started` for every group's planned runs (and ramp references) in
    ``out``, before the dataset is prepared (``--resume``, ``--report-only``). Raises KeelError naming keys."""
    for g, refs, jobs in planned_jobs(study, "<data>", out):
        check_started(refs, out / g.dir_name / ST.REFERENCES)
        check_started(jobs, out / g.dir_name)


def _check_no_restored_runs_lost(out: Path, restore: str | Path | None) -> None:
    """Raise KeelError if ``out``'s report holds restored runs and ``restore`` is not given: the
    report would lose them (``--report-only``) or the study would train them again (``--resume``)."""
    prior = out / "report.json"
    if restore is not None or not prior.is_file():
        return
    try:
        rep = json.loads(prior.read_text(encoding="utf-8"))
        n = sum(1 for r in rep.get("runs", []) if RunRecord.was_restored(r))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError, TypeError):
        return
    if n:
        src = rep.get("restored_from") or "the report it was restored from"
        raise KeelError(f"{prior} holds {n} runs restored from {src}; give --restore {src} again "
                        "(without it they would be left out of the report, or trained again)")


def _claim_out(out: Path, study: Study, command: str, *, resume: bool, report_only: bool) -> str:
    """Check ``out`` for this invocation and mark it as this study's (``study.json``: study,
    scale, the command that started it); return that first command.

    Raises:
        KeelError: ``out`` is a file; not empty without ``resume`` / ``report_only`` (a folder
            holding only this study's ``study.json``, stopped before its first run, counts as
            empty; the message advises ``--resume`` only where ``out`` holds a study); holds another
            study or scale; ``resume`` or ``report_only`` on a non-empty folder that holds no study.
    """
    marker = out / "study.json"
    held = _held_study(out, study, report_only=report_only)
    fresh = held is not None and [p.name for p in out.iterdir() if p.name != LOCK_NAME] == [marker.name]  # no run began
    if not (resume or report_only or fresh) and out.is_dir() and any(out.iterdir()):
        if held is None:  # --resume would be refused too: it continues studies only
            raise KeelError(f"output folder {out} is not empty and holds no study (no study.json); give an empty "
                            "or new --out")
        raise KeelError(f"output folder {out} is not empty; use --resume to continue it, or another --out")
    if resume and held is None and out.is_dir() and any(out.iterdir()):
        raise KeelError(f"{out} holds no study (no study.json) but is not empty; check --out (a study's folder, "
                        "not one of its groups), or give an empty or new one")
    if held is None or fresh:
        make_dirs(out)
        held = {"study": study.name, "scale": study.scale, "command": command}
        atomic_write_text(marker, json.dumps(held, indent=1))
    return held.get("command", command)


def started_scale(out: str | Path) -> str | None:
    """The scale the study in ``out`` was started at (its marker ``study.json``, :func:`_claim_out`), so that
    ``--resume`` and ``--report-only`` need no ``--scale``; None without a readable marker naming one (the
    checks of :func:`_held_study` then speak)."""
    try:
        held = json.loads((Path(out) / "study.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    scale = held.get("scale") if isinstance(held, dict) else None
    return scale if isinstance(scale, str) else None


def _held_study(out: Path, study: Study, *, report_only: bool) -> dict | None:
    """The marker ``study.json`` in ``out`` (:func:`_claim_out`), None where there is none.

    Raises:
        KeelError: ``out`` is a file; the marker is not a JSON object; ``report_only`` and no marker; the
            marker names another study or scale.
    """
    marker = out / "study.json"
    if out.exists() and not out.is_dir():
        raise KeelError(f"--out {out} exists and is not a folder")
    held = None
    if marker.is_file():
        try:
            held = json.loads(marker.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            held = "unreadable"
        if not isinstance(held, dict):
            raise KeelError(f"{marker} is not a study's marker (a JSON object with study, scale, command); "
                            "check --out, or remove the file")
    if report_only and held is None:
        raise KeelError(f"{out} holds no study (no study.json): nothing to report; check --out")
    if held is not None and (held.get("study"), held.get("scale")) != (study.name, study.scale):
        raise KeelError(f"{out} holds study {held.get('study')!r} at scale {held.get('scale')!r}, "
                        f"not {study.name!r} at {study.scale!r}; use another --out")
    return held
