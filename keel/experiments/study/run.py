"""Run a study (``keel study``): its groups' jobs on the grid runner, each run's record,
the dry-run estimate (tokens, GPU-hours), the report."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import signal
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

from keel.config import config_from_dict, load_config, override_text, resolve_config_path
from keel.data.stats import dataset_unigram_entropy
from keel.errors import Interrupted, KeelError, plural
from keel.experiments import sensitivity as LS
from keel.experiments import stress as ST
from keel.experiments.executor import Executor, check_slurm_here
from keel.experiments.grid import GridJob, cached_result, check_pool, check_started, run_grid
from keel.experiments.job_result import JobResult
from keel.experiments.record import RunRecord
from keel.experiments.study.report import (claim_summary, group_tables, report_markdown, superseded_words, waiting_words,
                                          write_plots)
from keel.experiments.study.claims import Claim, load_study
from keel.experiments.study.dataset import NO_DATA, check_study_data, shares_data, study_dataset
from keel.experiments.study.plan import cpu_hours, plan_markdown, plan_total
from keel.experiments.study.records import kept_restored, load_restored, restored_record, run_record
from keel.experiments.study.spec import Group, Study, lr_ladder
from keel.experiments.study.verdicts import LEVEL, baseline_margins, loss_floor
from keel.experiments.sweep import check_train_job, train_task
from keel.io import LOCK_NAME, RunLock, atomic_write_text, make_dirs, remove_empty_dirs
from keel.model import count_parameters, flops_per_token


_log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- jobs
def group_jobs(study: Study, g: Group, data_dir: str, out: Path,
               lr_for: dict[tuple[str, int], list[float]] | None = None) -> tuple[list[GridJob], list[GridJob]]:
    """(reference jobs, jobs) of one group, as its kind makes them (:mod:`keel.experiments.study.kinds`:
    a train group's ``lr_for``, ``{(scheme, sub-layers): [LR, ...]}`` of :func:`initial_lrs` widened by
    :func:`widened_lrs`, or None: its ``lrs`` everywhere). Raises KeelError on a bad config."""
    return g.kind_class.jobs(study, g, data_dir, out, lr_for)


def initial_lrs(study: Study, g: Group, runs: list[dict]) -> dict[tuple[str, int], list[float]] | None:
    """``{(scheme, sub-layers): [LR, ...]}`` planned for train group ``g``: its ``lrs``, or for an
    ``lr_from`` group the source's grid points around each scheme's transferred optimum
    (:func:`stepped_lrs`); None while that optimum is not known (the source has not finished)."""
    if not g.lr_from:
        return {(s, L): sorted(g.lrs) for s in g.schemes for L in g.sublayers}
    opt = transferred_lrs(runs, g)
    if opt is None:
        return None
    return {(s, L): lrs for s, lrs in stepped_lrs(study, g, opt).items() for L in g.sublayers}


def lr_beyond(lrs: Sequence[float], ladder: Sequence[float], up: bool) -> float:
    """The next LR past the highest (``up``) or lowest of ``lrs``: the next point of ``ladder``
    (the group's LR grid, or its source's) beyond it, else the last step mirrored
    (``edge^2 / neighbour``, e.g. 0.09 after 0.01, 0.03; 9e-5 below 3e-4, 1e-3), to 3 significant digits."""
    pts = sorted(set(lrs) | set(ladder))
    edge = max(lrs) if up else min(lrs)
    beyond = [x for x in pts if (x > edge if up else x < edge)]
    if beyond:
        return min(beyond) if up else max(beyond)
    inner = [x for x in pts if (x < edge if up else x > edge)]
    nb = (max(inner) if up else min(inner)) if inner else (edge / 3 if up else edge * 3)
    return float(f"{edge * edge / nb:.3g}")


def widened_lrs(study: Study, g: Group, recs: list[RunRecord], lr_for: dict[tuple[str, int], list[float]],
                planned: dict[tuple[str, int], list[float]]) -> dict[tuple[str, int], list[float]] | None:
    """``lr_for`` with one more LR for every (scheme, depth) cell of train group ``g`` whose runs
    have all finished and where some seed's best run (lowest capped loss) is at the lowest or
    highest LR the cell trained: the next LR beyond that edge (:func:`lr_beyond`), for every seed
    of the cell (the cells stay rectangular, as the paired equal-LR table needs). Every cell of
    every table is bracketed this way, whether a claim reads it or not. At most ``g.widen`` LRs per
    side beyond ``planned`` (:func:`initial_lrs`). None: nothing to widen."""
    ladder = lr_ladder(study.groups, g)
    out, changed = dict(lr_for), False
    for (s, L), lrs in lr_for.items():
        cell = [r for r in recs if r.scheme == s and r.sublayers == L]
        if len(lrs) < 2 or not cell or any(r.status != "done" for r in cell):
            continue
        best = {min((r for r in cell if r.seed == sd), key=lambda r: r.capped_loss).lr
                for sd in {r.seed for r in cell}}
        for up, edge in ((True, max(lrs)), (False, min(lrs))):
            past = [x for x in lrs if (x > max(planned[(s, L)]) if up else x < min(planned[(s, L)]))]
            if edge in best and len(past) < g.widen:
                out[(s, L)] = sorted(set(out[(s, L)]) | {lr_beyond(lrs, ladder, up)})
                changed = True
    return out if changed else None


def group_records(study: Study, g: Group, runs: list[RunRecord], data_dir: str, out: Path, read
                  ) -> tuple[list[GridJob], list[GridJob], list[RunRecord]] | None:
    """(reference jobs, jobs, run records) of group ``g``, its LRs widened until every optimum a
    claim reads is bracketed (:func:`widened_lrs`): ``read(refs, jobs, train)`` trains (``train``)
    or only reads the jobs and returns their records. The first passes only read, so that an LR
    widened from runs already finished (restored, say) trains in the same pass as the rest, in the
    group's order, not after it. None: an ``lr_from`` group whose source has not finished."""
    lr_for = initial_lrs(study, g, runs) if g.kind_class.lr_grid else None
    if g.kind_class.lr_grid and lr_for is None:
        return None
    planned, trained = dict(lr_for or {}), False
    while True:
        refs, jobs = group_jobs(study, g, data_dir, out, lr_for)
        recs = read(refs, jobs, trained)
        wider = widened_lrs(study, g, recs, lr_for, planned) if lr_for is not None else None
        if wider is None and trained:
            return refs, jobs, recs
        lr_for, trained = wider or lr_for, trained or wider is None


def transferred_lrs(runs: list[RunRecord], g: Group) -> dict[str, float] | None:
    """``{scheme: optimal LR}`` of group ``g.lr_from`` at ``g.lr_from_sublayers``: the argmin of
    the seed-mean capped loss over its LR grid (:func:`keel.experiments.sensitivity.cell_summary`);
    None until every scheme has every seed finished there."""
    out = {}
    for scheme in g.schemes:
        rs = [r for r in runs if r.group == g.lr_from and r.scheme == scheme and r.sublayers == g.lr_from_sublayers]
        lrs = sorted({r.lr for r in rs})
        curves = [LS.seed_curve([r.result for r in rs if r.seed == s], lrs) for s in g.scheme_seeds(scheme)]
        if not rs or any(c is None for c in curves):
            return None
        out[scheme] = LS.cell_summary(curves, lrs)["opt_lr"]
    return out


def stepped_lrs(study: Study, g: Group, opt: dict[str, float]) -> dict[str, list[float]]:
    """``{scheme: [peak LR, ...]}`` of an ``lr_from`` group: the points of the source group's LR
    grid ``g.lr_from_steps`` grid steps from each scheme's transferred optimum ``opt[scheme]``
    (0 = the optimum, -1 = the next lower LR; a point off the grid is left out)."""
    grid = lr_ladder(study.groups, g)
    out = {}
    for scheme, lr in opt.items():
        i = min(range(len(grid)), key=lambda k: abs(math.log(grid[k] / lr)))
        out[scheme] = [grid[i + k] for k in sorted(g.lr_from_steps) if 0 <= i + k < len(grid)]
    return out


def collect(study: Study, data_dir: str, out: Path, *, train: bool | Sequence[str], grid: Callable = run_grid,
            restored: dict[tuple[str, str], dict] | None = None,
            superseded: list[RunRecord] | None = None) -> tuple[list[RunRecord], list[dict]]:
    """Run or only read every group in order; return the run records (:func:`run_record`) of
    every job, finished or not, and per group not planned yet (an ``lr_from`` group whose source has not
    finished: skipped, logged, run on a later invocation) a dict for :func:`.report.waiting_words`.
    ``train``: True trains every group, False none, a list of group names only those (the other
    groups are read, so the report still covers them). ``grid``: :func:`keel.experiments.grid.run_grid`
    with the workers, threads and executor bound. ``restored``: :func:`load_restored`; a
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
        grid(refs, gdir / ST.REFERENCES, train_task, resume=True, check=check_train_job)
    got = grid(todo, gdir, g.kind_class.task(g), resume=True, check=check_train_job)
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


def report_json(study: Study, runs: list[RunRecord], claims: list[tuple[Claim, dict]], floor: dict, h1: float | None,
                command: str, restore, plots: list[str]) -> dict:
    """The content of ``report.json`` (see :func:`run_study`'s Returns)."""
    return {"study": study.name, "scale": study.scale, "note": study.note, "command": command,
            "sets": [override_text(x) for x in study.all_sets()],
            "unigram_entropy": h1, "min_effect": study.min_effect, "min_seeds": study.min_seeds, "floor": floor,
            "level": LEVEL, "summary": [c["summary"] for _, c in claims],
            "claims": [{"id": cl.id, "title": cl.title, **c} for cl, c in claims],
            "baseline_margins": [{"group": g.name, **r} for g in study.groups for r in baseline_margins(study, g, runs)],
            "group_sets": {g.name: [override_text(x) for x in g.sets] for g in study.groups},
            "restored_from": str(restore) if any(r.restored for r in runs) else None,
            "runs": [r.to_dict() for r in runs], "plots": plots}


def judge(study: Study, runs: list[dict]) -> tuple[Study, dict, list[tuple[Claim, dict]]]:
    """``(study with its floor as min_effect, the floor (:func:`study_floor`), [(claim, its
    verdict dict with its summary line)])``: every claim judged on ``runs``."""
    floor = study_floor(study, runs)
    study = replace(study, min_effect=floor["floor"])
    claims = [(cl, cl.verdict(study, runs)) for cl in study.claims]
    for cl, c in claims:
        c["summary"] = claim_summary(cl, c)
    return study, floor, claims


def study_floor(study: Study, runs: list[dict]) -> dict:
    """The loss claims' noise floor (:func:`keel.experiments.study.verdicts.loss_floor`) over every
    (group, scheme, depth) cell a claim names (:meth:`Claim.floor_cells`: those a margin claim
    reads), each init's groups apart; with
    ``floor_from_spread`` false, ``study.min_effect`` as it is (``{"floor": min_effect}``)."""
    if not study.floor_from_spread:
        return {"floor": study.min_effect, "minimum": study.min_effect}
    cells = [cell for c in study.claims for cell in c.floor_cells(study)]
    return loss_floor(runs, list(dict.fromkeys(cells)), study.min_effect)


# ----------------------------------------------------------------------------- estimate (dry run)
def planned_jobs(study: Study, data_dir: str, out: Path, restored: dict[tuple[str, str], dict] | None = None
                 ) -> list[tuple[Group, list[GridJob], list[GridJob]]]:
    """(group, reference jobs, jobs) of every group as planned before anything trains: an
    ``lr_from`` group at the optimum of its source's runs in ``restored`` (:func:`load_restored`)
    when they give one, else as if the optimum were the middle of its source's LR grid; LRs
    widened where the restored runs put an optimum on an edge. Raises KeelError on a bad config."""
    restored = restored or {}
    planned, runs = [], []
    for g in study.groups:
        def read(refs, jobs, now, g=g):  # nothing trains: every pass only reads
            olds = [restored_record(g, j, restored[(g.name, j.name)]) if (g.name, j.name) in restored else None
                    for j in jobs]
            return [o if o is not None else run_record(g, j, Path(), None) for j, o in zip(jobs, olds)]

        got = group_records(study, g, runs, data_dir, out, read)
        if got is None:  # the source's optimum is unknown: plan at the middle of its grid
            grid = lr_ladder(study.groups, g)
            lr_for = {(s, L): lrs for s, lrs in stepped_lrs(study, g, {s: grid[len(grid) // 2] for s in g.schemes}
                                                             ).items() for L in g.sublayers}
            got = (*group_jobs(study, g, data_dir, out, lr_for), [])
        runs += [r for r in got[2] if r.status == "done"]
        planned.append((g, got[0], got[1]))
    return planned


def plan_rows(study: Study, data_dir: str, out: Path, mfu: float, peak_tflops: float,
              restored: dict[tuple[str, str], dict] | None = None) -> list[dict]:
    """One row per group: runs (+ references), optimizer steps and tokens per run (the planned
    budget; a ramp run stops earlier when it diverges), tokens per non-embedding parameter per
    depth (``tokens_per_param``: ``{sub-layers: ratio}``), total tokens and estimated GPU-hours at ``mfu`` of a
    ``peak_tflops`` (dense bf16 TFLOP/s) GPU, the runs that compile (``compiled``: ``train.compile``);
    ``restored`` (:func:`load_restored`) plans as
    :func:`planned_jobs` does and counts the runs it holds (``restored``) and the GPU-hours of the
    others (``gpu_hours_left``). An ``lr_from`` group is planned as if the optimum were the middle
    of its source's LR grid when ``restored`` does not give it."""
    rows, restored = [], restored or {}
    for g, refs, jobs in planned_jobs(study, data_dir, out, restored):
        cfgs = [config_from_dict(j.config) for j in refs + jobs]
        per_run = [c.train.steps * c.train.batch_size * c.train.seq_len * c.train.grad_accum for c in cfgs]
        flops = [t * flops_per_token(c.model, c.train.seq_len) for t, c in zip(per_run, cfgs)]
        held = _held_runs(g, refs, jobs, restored)
        hours = 1 / (mfu * peak_tflops * 1e12) / 3600
        rows.append({"group": g.name, "kind": g.kind, "runs": len(jobs), "references": len(refs),
                     "steps": sorted({c.train.steps for c in cfgs[len(refs):]}),
                     "tokens_per_param": _tokens_per_param(per_run[len(refs):], cfgs[len(refs):]),
                     **_plan_axes(g, cfgs[len(refs):]),
                     "tokens_per_run": sorted(set(per_run)), "tokens": sum(per_run), "flops": sum(flops),
                     "gpu_hours": sum(flops) * hours, "cpu_hours": cpu_hours(sum(per_run), sum(flops)),
                     "restored": sum(held[len(refs):]),
                     "gpu_hours_left": sum(f for f, h in zip(flops, held) if not h) * hours,
                     "compiled": sum(1 for c in cfgs if c.train.compile)})  # runs that torch.compile (plan.compile_words)
    return rows


def _held_runs(g: Group, refs: list[GridJob], jobs: list[GridJob], restored: dict[tuple[str, str], dict]
               ) -> list[bool]:
    """Per reference job and job of group ``g`` (in that order): whether it would not train, its record in
    ``restored`` (a reference: no job that trains needs it, as :func:`_train_and_read` trains them)."""
    held = [(g.name, j.name) in restored and restored_record(g, j, restored[(g.name, j.name)]) is not None
            for j in jobs]
    needed = ST.references_of([j for j, h in zip(jobs, held) if not h])  # as _train_and_read trains them
    return [r.name not in needed for r in refs] + held


def _tokens_per_param(per_run: list[int], cfgs: list) -> dict[int, float]:
    """``{sub-layers: tokens per non-embedding parameter}`` of a group's runs (``per_run``: their tokens,
    ``cfgs``: their configs), of the first scheme at each depth, by depth."""
    per_param = {}
    for t, c in zip(per_run, cfgs):
        m = replace(c.model, vocab_size=256) if c.model.vocab_size == "auto" else c.model  # as flops_per_token
        per_param.setdefault(c.model.n_sublayers, t / count_parameters(m, non_embedding=True))
    return dict(sorted(per_param.items()))


def _plan_axes(g: Group, cfgs: list) -> dict:
    """What a plan row says group ``g`` varies (``cfgs``: its runs' configs): ``schemes``, ``sublayers``,
    ``seeds``, ``lrs`` (an LR grid's) and ``lr_plan`` (words); a group that does not list them (a sweep's)
    gives its runs' values."""
    seen = {k: list(dict.fromkeys(get(c) for c in cfgs)) for k, get in (  # a sweep's: its runs' values
        ("residual", lambda c: c.model.residual), ("n_sublayers", lambda c: c.model.n_sublayers),
        ("seed", lambda c: c.train.seed), ("lr", lambda c: c.train.lr))}
    return {"schemes": g.schemes or seen["residual"], "sublayers": g.sublayers or seen["n_sublayers"],
            "seeds": g.seeds or seen["seed"], "lrs": list(g.lrs) if g.kind_class.lr_grid and not g.lr_from else [],
            "lr_plan": g.kind_class.lr_words(g) or ", ".join(f"{x:g}" for x in seen["lr"])}


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
    plan_rows(study, "<data>", out, mfu, peak_tflops)  # every group's configs: a bad set refused now
    check_pool(workers or 0, threads)
    restored = load_restored(restore, study) if restore is not None else {}  # after the --set keys are checked
    base = load_config(resolve_config_path(study.base), study.all_sets())  # a bad --set: refused before out is claimed
    if dry_run:  # what can be checked of the data without preparing it
        check_study_data(study, base, planned_jobs(study, NO_DATA, out, restored))
        return _dry_run(study, out, groups, restored, restore, mfu, peak_tflops)
    _check_no_restored_runs_lost(out, restore)
    from_report = report_only and restore is not None  # a report of restored runs needs no earlier folder
    fresh = not out.exists()
    first_command = _claim_out(out, study, _command_of(restore) or command if from_report else command,
                               resume=resume or from_report, report_only=report_only and not from_report)
    if resume:  # another --set than the runs started with: refused now, not after the dataset is prepared
        check_started_runs(study, out)
    superseded: list[RunRecord] = []
    with _stopped_hint(out), _unclaimed_if(fresh, out), contextlib.nullcontext() if report_only else study_lock(out):
        if not report_only:  # the folder's executor, or the one it is started with (recorded)
            executor, workers, threads = engine_executor(out, executor, workers, threads, study.name)
        data_dir = study_dataset(base, planned_jobs(study, NO_DATA, out, restored)) \
            if shares_data(study, report_only) else NO_DATA  # prepared once; every run's vocab_size checked on it
        grid = functools.partial(run_grid, workers=workers or 0, threads=threads or None, executor=executor)
        runs, waiting = collect(study, data_dir, out, train=False if report_only else (list(groups) or True),
                                grid=grid, restored=restored, superseded=superseded)
    report = write_report(study, runs, out, _unigram_entropy(data_dir, runs), first_command, restore, superseded,
                          waiting)
    _warn_failed(runs, out)
    return report


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


def engine_executor(out: Path, given: Executor | None, workers: int | None, threads: int | None,
                    label: str) -> tuple[Executor, int, int | None]:
    """The executor, workers and threads this training invocation of study folder ``out`` uses, recorded in
    its ``study.json`` (``executor``): what is given, else (a ``--resume`` without the flags) what the folder
    recorded, else the local executor with 1 worker; ``label`` (the study's name) names Slurm jobs.

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
        if given is not None and given.kind != was.kind:
            raise KeelError(f"{out} was started with --executor {was.kind}, not {given.kind}; continue it with "
                            f"--executor {was.kind} (or leave --executor out: {marker} holds its settings), or use "
                            "another --out")
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


def write_report(study: Study, runs: list[dict], out: Path, h1: float | None, command: str,
                 restore: str | Path | None, superseded: list[RunRecord], waiting: list[dict]) -> dict:
    """Judge the claims (:func:`judge`) and write ``report.json``, ``report.md`` and the PNGs into
    ``out`` (each atomically); returns the report (``report.json``'s content plus ``waiting`` and
    ``records``, every run record with its result).
    ``h1``: the training tokens' unigram entropy (nats), the plateau level of the tables."""
    study, floor, claims = judge(study, runs)
    make_dirs(out)
    plots = write_plots(study, runs, claims, out, h1)
    report = report_json(study, runs, claims, floor, h1, command, restore, plots)
    report["superseded_runs"] = list({(r.group, r.name): r.to_dict() for r in superseded}.values())
    tables = group_tables(study, runs, out, h1)
    if tables:  # a study without a grid group or a group asking for its table: report.json as it was
        report["group_tables"] = tables
    atomic_write_text(out / "report.json", json.dumps(report, indent=1, default=str))
    report["waiting"] = waiting
    report["records"] = runs  # with each run's result (report.json leaves those out)
    atomic_write_text(out / "report.md", report_markdown(study, claims, runs, command, waiting, restore, floor, tables)
                      + superseded_words(report["superseded_runs"]))
    return report


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
    ``out``, before the dataset is prepared (``--resume``; a preset's ``--report-only``). Raises KeelError naming keys."""
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
            empty); holds another study or scale; ``report_only`` on a folder that holds no study.
    """
    marker = out / "study.json"
    held = _held_study(out, study, report_only=report_only)
    fresh = held is not None and [p.name for p in out.iterdir() if p.name != LOCK_NAME] == [marker.name]  # no run began
    if not (resume or report_only or fresh) and out.is_dir() and any(out.iterdir()):
        raise KeelError(f"output folder {out} is not empty; use --resume to continue it, or another --out")
    if resume and held is None and out.is_dir() and any(out.iterdir()):
        raise KeelError(f"{out} holds no study (no study.json) but is not empty; check --out (a study's folder, "
                        "not one of its groups), or give an empty or new one")
    if held is None or fresh:
        make_dirs(out)
        held = {"study": study.name, "scale": study.scale, "command": command}
        atomic_write_text(marker, json.dumps(held, indent=1))
    return held.get("command", command)


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
