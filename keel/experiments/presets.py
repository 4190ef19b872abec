"""``keel sweep``, ``keel stress`` and ``keel lr-sensitivity`` as study presets: each command's
flags become a study of one group (:class:`keel.experiments.study.spec.Study`), run by the one
engine (:func:`keel.experiments.study.run.execute`: the output folder's check and lock, the
dataset prepared once, the grid runner and executor, ``--resume``, ``--report-only``,
``--dry-run``, ``report.md`` / ``report.json`` and the group's PNG), then written up as the
command's own table (``sweep.md``, ``stress.md``, ``sensitivity.md`` and their JSON).

The group's runs sit directly in ``--out`` (``Group.folder = ""``), named as the command
always named them; the group's PNG is the command's (``stress.png``, ``sensitivity.png``,
``sweep.png``). The formulas and tables stay in :mod:`.sweep`, :mod:`.stress` and
:mod:`.sensitivity`, which the engine itself uses for a study's groups.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from keel.config import Override, override_text, resolve_config_path
from keel.diagnostics.divergence import Thresholds
from keel.errors import KeelError
from keel.experiments import sensitivity as LS
from keel.experiments import stress as ST
from keel.experiments import sweep as S
from keel.experiments.grid import cached_result, check_reportable
from keel.experiments.job_result import JobResult
from keel.experiments.study.run import check_started_runs, execute
from keel.experiments.study.spec import Group, Study, refuse_sets
from keel.io import atomic_write_text
from keel.model import SCHEMES
from keel.rundir import RunDir

_log = logging.getLogger(__name__)

SCALE = "cli"  # a preset's study.json scale: the command line sized it


def _owned(command: str, flags: dict[str, str]) -> dict[str, str]:
    """The keys ``command`` sets per run, for :func:`refuse_sets`: ``{key: ": keel COMMAND sets
    WHAT; use FLAG"}`` from ``flags`` = ``{key: "WHAT; use FLAG"}``."""
    return {k: f": keel {command} sets {why}" for k, why in flags.items()}


_RUN_KEYS = {"model.residual": "the scheme of each run; use --residual", "train.seed": "each run's seed; use --seeds",
             "model.n_layers": "each run's depth; use --sublayers"}
STRESS_OWNED = _owned("stress", {**_RUN_KEYS, "train.lr": "the LR (its ramp); use --peak-lr",
                                 "train.steps": "the steps (its ramp); use --ramp-steps",
                                 "train.warmup_steps": "the warmup (its ramp); use --ramp-steps",
                                 "train.stop_on_divergence": "it to true (the ramp ends at divergence)"})
SENSITIVITY_OWNED = _owned("lr-sensitivity", {**_RUN_KEYS, "train.lr": "each run's LR; use --lrs"})


def check_flags(schemes: Sequence[str], sublayers: Sequence[int], seeds: Sequence[int], lrs: Sequence[float] = (),
                reference: str | None = None) -> None:
    """Raise KeelError naming the first bad grid flag of ``keel stress`` / ``keel lr-sensitivity``: an
    unknown scheme (``--residual``, ``--reference-scheme``), a depth that is odd or under 2 sub-layers, a
    non-positive LR, a repeated value (``--workers``: the engine's :func:`keel.experiments.grid.check_pool`)."""
    for flag, s in [("--residual", s) for s in schemes] + ([("--reference-scheme", reference)] if reference else []):
        if s not in SCHEMES:
            raise KeelError(f"{flag}: unknown scheme {s!r} (available: {', '.join(SCHEMES)})")
    for L in sublayers:
        if L < 2 or L % 2:
            raise KeelError(f"--sublayers counts sub-layers (2 per block) and must be even and >= 2, got {L}")
    for lr in lrs:
        if not (math.isfinite(lr) and lr > 0):
            raise KeelError(f"--lrs must be positive numbers, got {lr}")
    for what, xs in (("--residual", schemes), ("--sublayers", sublayers), ("--lrs", lrs), ("--seeds", seeds)):
        if len(set(xs)) != len(xs):
            raise KeelError(f"{what} must not repeat a value")


def preset_study(name: str, config: str | None, sets: Sequence[Override], group: Group) -> Study:
    """The study of a grid command: one ``group`` (runs in ``--out`` itself), the base config
    ``config`` (a preset name or file; default ``demo``) and ``sets`` (``--set`` strings or typed
    pairs) applied to every run. Raises KeelError for an unknown config preset."""
    return Study(name=name, scale=SCALE, description="", note="", base=str(resolve_config_path(config)),
                 sets=list(sets), groups=[group], claims=[])


def _done(report: dict) -> list[dict]:
    """The finished runs' grid results (``result.json``) of an engine report, in run order."""
    return [r.result for r in report["records"] if r.status == "done"]


def _errors(report: dict) -> list[dict]:
    """The failed runs of an engine report, as grid results (``status``, ``message``)."""
    return [{"name": r.name, "values": r.values, "status": "error", "message": r.message}
            for r in report["records"] if r.status == "error"]


def _require_finished(out: Path, names: Sequence[str], what: str) -> list[str]:
    """For ``--report-only``: the names in ``names`` whose run in ``out`` has finished, checked
    before the engine writes anything.

    Raises:
        KeelError: ``out`` holds no finished run (:func:`keel.experiments.grid.check_reportable`),
            or none of ``names`` (a folder of another grid).
    """
    check_reportable(out)
    done = [n for n in names if cached_result(out / n) is not None]
    if names and not done:
        try:  # the command that started out: its grid flags are the ones to give
            started = json.loads((out / "study.json").read_text(encoding="utf-8"))["command"]
        except (OSError, ValueError, KeyError, TypeError):
            started = ""
        hint = f"its runs are of `{started}`: give those grid flags" if started else "check --out and the grid flags"
        raise KeelError(f"{out} holds no finished run of this {what}: nothing to report; {hint}")
    return done


def _execute(what: str, config: str | None, sets: Sequence[Override], group: Group, out: Path, **engine) -> dict:
    """The engine's report (or, with ``dry_run``, its plan) of the preset study of command ``what``;
    after a run, one line on how many runs have finished (``report_only``) and a warning naming the
    run folders in ``out`` that are not runs of this grid (:func:`_log_unplanned`). ``report_only``
    with other flags than the runs were trained with is refused (KeelError naming the keys): the
    report would state the new flags beside the old runs' numbers."""
    study = preset_study(what, config, sets, group)
    if engine.get("report_only"):
        check_started_runs(study, out)
    report = execute(study, out, **engine)
    if not engine.get("dry_run"):
        if engine.get("report_only"):
            done = sum(r.status == "done" for r in report["records"])
            _log.info(f"{what}: report only, {done}/{len(report['runs'])} runs finished")
        _log_unplanned(out, report, what)
    return report


def _log_unplanned(out: Path, report: dict, what: str) -> None:
    """One warning line naming the run folders in ``out`` (a ``job.json`` in them) that are not
    runs of this grid, e.g. left by an earlier ``--lrs`` before a ``--resume`` with another: they
    are in no table, which the user should hear rather than find out."""
    planned = {r.name for r in report["records"]}
    stray = sorted(p.name for p in out.iterdir() if RunDir(p).job.is_file() and p.name not in planned)
    if stray:
        more = f", ... ({len(stray)} in all)" if len(stray) > 3 else ""
        _log.warning(f"{what}: {out} holds run folders that are not runs of this grid, left out of its tables: "
                     f"{', '.join(stray[:3])}{more} (the grid flags changed? keep one grid per --out)")


# ----------------------------------------------------------------------------- keel stress
def run_stress(config: str | None = None, overrides: Sequence[Override] = (), schemes: Sequence[str] = ("pre_ln", "keel"),
               sublayers: Sequence[int] = (64,), seeds: Sequence[int] = (0,), peak_lr: float = 5e-2,
               ramp_steps: int = 1000, out: str | Path = "runs/stress", *, reference_scheme: str = "pre_ln",
               report_only: bool = False, **engine) -> dict:
    """Run (or complete, or only tabulate, or plan) the max-LR stress test (:mod:`keel.experiments.stress`)
    and write ``stress.json`` / ``stress.md`` (``stress.png``: the engine's plot of the group).

    Args:
        config, overrides: base config and ``--set`` overrides of every run.
        schemes, sublayers (even), seeds, peak_lr (absolute), ramp_steps: the grid and the ramp.
        out: output folder; reference_scheme: the reference runs' scheme.
        report_only, engine: :func:`keel.experiments.study.run.execute`'s options (``workers``,
            ``threads``, ``resume``, ``dry_run``, ``command``, ``executor``).
    Returns:
        ``{"runs": [results], "references": [results], "table": ..., "trained": [names],
        "cached": [names], ...}``; with ``dry_run`` the engine's plan.
    Raises:
        KeelError: odd or non-positive depth, unknown scheme, bad peak / ramp / workers, bad
            config, ``out`` not usable, ``report_only`` where no run of the grid has finished.
    """
    schemes, sublayers, seeds, out = list(schemes), list(sublayers), list(seeds), Path(out)
    check_flags(schemes, sublayers, seeds, reference=reference_scheme)
    if not (math.isfinite(peak_lr) and peak_lr > 0):
        raise KeelError(f"--peak-lr must be > 0, got {peak_lr}")
    if ramp_steps < 2:
        raise KeelError(f"--ramp-steps must be >= 2, got {ramp_steps}")
    refuse_sets(overrides, STRESS_OWNED)
    group = Group(name="stress", folder="", kind="ramp", schemes=schemes, sublayers=sublayers, seeds=seeds,
                  peak_lr=peak_lr, ramp_steps=ramp_steps, reference=reference_scheme)
    names = [ST.run_name(s, L, sd) for sd in seeds for L in sublayers for s in schemes]
    cached = _require_finished(out, names, "stress test") if report_only else \
        [n for n in names if cached_result(out / n) is not None]
    report = _execute("stress", config, overrides, group, out, report_only=report_only, **engine)
    if engine.get("dry_run"):
        return report
    results = _done(report)
    refs = [cached_result(out / ST.REFERENCES / ST.run_name(reference_scheme, L, sd)) for sd in seeds
            for L in sublayers]
    table = ST.stress_table(results, schemes, sublayers)
    summary = {"peak_lr": peak_lr, "ramp_steps": ramp_steps, "config": str(resolve_config_path(config)),
               "overrides": [override_text(x) for x in overrides], "reference_scheme": reference_scheme, "runs": results,
               "references": [r for r in refs if r is not None], "table": table}
    atomic_write_text(out / "stress.json", json.dumps(summary, indent=1, default=str))
    atomic_write_text(out / "stress.md", ST.table_markdown(table, peak_lr))
    summary.update(trained=[] if report_only else [n for n in names if n not in cached], cached=cached)
    return summary


# ----------------------------------------------------------------------------- keel lr-sensitivity
def run_lr_sensitivity(config: str | None, schemes: Sequence[str], sublayers: Sequence[int], lrs: Sequence[float],
                       seeds: Sequence[int], sets: Sequence[str] = (), *, out: str | Path, report_only: bool = False,
                       **engine) -> dict:
    """Run (or complete, or only tabulate, or plan) the LR-sensitivity grid
    (:mod:`keel.experiments.sensitivity`); write ``sensitivity.json`` / ``sensitivity.md``
    (``sensitivity.png``: the engine's loss-against-LR plot of the group).

    Args:
        config, sets: base config and ``--set`` overrides of every run.
        schemes, sublayers (even), lrs, seeds: the grid.
        out: output folder; report_only, engine: as :func:`run_stress`.
    Returns:
        The ``sensitivity.json`` content: ``config``, ``sets``, ``schemes``, ``sublayers``, ``lrs``
        (sorted), ``seeds``, ``unigram_entropy``, ``plateau_level``, ``runs`` (grid results) and
        ``cells`` (:func:`keel.experiments.sensitivity.summarise`); with ``dry_run`` the engine's plan.
    Raises:
        KeelError: bad grid or config; ``out`` not usable; ``report_only`` where no run has finished.
    """
    check_flags(schemes, sublayers, seeds, lrs)
    lrs = sorted(lrs)
    refuse_sets(sets, SENSITIVITY_OWNED)
    out = Path(out)
    group = Group(name="sensitivity", folder="", schemes=list(schemes), sublayers=list(sublayers), seeds=list(seeds),
                  lrs=lrs, widen=0)
    if report_only:
        _require_finished(out, (), "LR grid")
    report = _execute("lr-sensitivity", config, sets, group, out, report_only=report_only, **engine)
    if engine.get("dry_run"):
        return report
    results, h1 = _done(report) + _errors(report), report["unigram_entropy"]
    summary = {"config": str(resolve_config_path(config)), "sets": list(sets), "schemes": list(schemes),
               "sublayers": list(sublayers), "lrs": lrs, "seeds": list(seeds), "unigram_entropy": h1,
               "plateau_level": Thresholds().plateau_level(h1), "runs": results}
    summary["cells"] = LS.summarise(report["records"], schemes, sublayers, lrs, seeds, summary["plateau_level"])
    atomic_write_text(out / LS.OUT_JSON, json.dumps(summary, indent=1, default=str))
    atomic_write_text(out / LS.OUT_MD, LS.markdown(summary))  # sensitivity.png: the engine's plot (LS.plot)
    return summary


# ----------------------------------------------------------------------------- keel sweep
def run_sweep(config: str | None, grid: dict[str, list], sets: Sequence[Override] = (), *, out: str | Path,
              best: str | None = None, match_params: int | str | None = None, **engine) -> dict:
    """Run (or complete, or plan) a sweep (:mod:`keel.experiments.sweep`) and write ``sweep.json``
    and ``sweep.md`` in ``out`` (``sweep.png``: the engine's loss curves of the runs).

    Args: as the ``keel sweep`` options; ``best`` = ``--best-over``; ``sets``: ``--set`` strings
        and typed ``(key, value)`` pairs (a preset's ``[set]`` table); ``engine``: as :func:`run_stress`.
    Returns:
        The ``sweep.json`` content: ``config``, ``sets``, ``grid``, ``grid_keys``, ``held_fixed``,
        ``runs`` (one :func:`keel.experiments.sweep.run_summary` record per run, plus ``name``,
        ``values``, ``status``, ``wall_s``), ``best_over``, ``best``; with ``dry_run`` the plan.
    Raises:
        KeelError: bad grid / config, non-empty ``out`` without ``resume``, ``best`` not a grid
            key; data preparation errors.
    """
    if best is not None and best not in grid:
        raise KeelError(f"--best-over {best} is not one of the grid keys ({', '.join(grid) or 'none'})")
    # with --match-params auto the base config's model keys set the parameter target: a --set of one counts
    refuse_sets(sets, _owned("sweep", {k: "it per run; it is a --grid key" for k in grid
                                       if not (match_params == "auto" and k.startswith("model."))}))
    group = Group(name="sweep", folder="", kind="grid", schemes=[], sublayers=[], seeds=[], grid=grid,
                  match_params=match_params)
    report = _execute("sweep", config, sets, group, Path(out), **engine)
    if engine.get("dry_run"):
        return report
    order = {r.name: i for i, r in enumerate(report["records"])}
    results = sorted(_done(report) + _errors(report), key=lambda r: order[JobResult.from_dict(r).name])
    summary: dict[str, Any] = {
        "out": str(out), "config": str(resolve_config_path(config)), "sets": [override_text(x) for x in sets],
        "grid": grid, "grid_keys": list(grid), "derived_keys": ["model.d_model"] if match_params not in (None, 0, "0", "")
        else [], "match_params": match_params, "runs": results,
        "held_fixed": S.held_fixed([r for r in results if JobResult.from_dict(r).done]), "best_over": best, "best": None}
    if best:
        summary["best"] = [{"values": g["values"], "best": g["best"], "name": g["run"]["name"] if g["run"] else None,
                            "final_val_loss": g["run"]["final_val_loss"] if g["run"] else None,
                            "n_ok": g["n_ok"], "n": g["n"]} for g in S.best_over(results, list(grid), best)]
    atomic_write_text(Path(out) / "sweep.json", json.dumps(summary, indent=1, default=str))
    atomic_write_text(Path(out) / "sweep.md", S.sweep_markdown(summary))
    return summary
