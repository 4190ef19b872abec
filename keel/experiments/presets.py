"""``keel sweep``, ``keel stress`` and ``keel lr-sensitivity`` as study presets: each command's
flags become a study of one group (:class:`keel.experiments.study.spec.Study`), run by the one
engine (:func:`keel.experiments.study.run.execute`: the output folder's check and lock, the
dataset prepared once, the grid runner and executor, ``--resume``, ``--report-only``,
``--dry-run``, ``report.md`` / ``report.json`` and the group's PNG). The command's table is the
group kind's own table (:meth:`keel.experiments.study.kinds.TrainKind.table`), a section of the
engine's ``report.md`` and ``report.json``'s ``group_tables``; ``sweep.md``, ``stress.md``,
``sensitivity.md`` and their JSON are its deprecated aliases, written for one more release
(:func:`write_deprecated_tables`). Sweep presets are study files of one grid group
(:func:`load_sweep_preset`).

The group's runs sit directly in ``--out`` (``Group.folder = ""``), named as the command
always named them; the group's PNG is the command's (``stress.png``, ``sensitivity.png``,
``sweep.png``). The formulas and tables stay in :mod:`.sweep`, :mod:`.stress` and
:mod:`.sensitivity`, which the engine's group kinds use.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from pathlib import Path

from keel.config import Override, read_toml, resolve_config_path
from keel.errors import KeelError
from keel.experiments import sensitivity as LS
from keel.experiments import stress as ST
from keel.experiments.grid import cached_result, check_reportable
from keel.experiments.sweep import run_name
from keel.experiments.study.run import execute
from keel.experiments.study.spec import Group, Study, refuse_sets, study_from_dict
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


def _require_finished(out: Path, names: Sequence[str], what: str) -> list[str]:
    """For ``--report-only``: the names in ``names`` whose run in ``out`` has finished, checked
    before the engine writes anything.

    Raises:
        KeelError: ``out`` holds no finished run (:func:`keel.experiments.grid.check_reportable`),
            or none of ``names`` (a folder of another grid).
    """
    try:  # the command that started out: its grid flags are the ones to give
        started = json.loads((out / "study.json").read_text(encoding="utf-8"))["command"]
    except (OSError, ValueError, KeyError, TypeError):
        started = ""
    hint = f"its runs are of `{started}`: give those grid flags" if started else "check --out and the grid flags"
    try:
        check_reportable(out)
    except KeelError:
        if not started:
            raise
        # a folder of another command (a study: its runs are in its groups' folders)
        raise KeelError(f"{out} holds no finished run of this {what}: nothing to report; it is the folder of "
                        f"`{started}`") from None
    done = [n for n in names if cached_result(out / n) is not None]
    if names and not done:
        raise KeelError(f"{out} holds no finished run of this {what}: nothing to report; {hint}")
    return done


def _execute(what: str, config: str | None, sets: Sequence[Override], group: Group, out: Path, **engine) -> dict:
    """The engine's report (or, with ``dry_run``, its plan) of the preset study of command ``what``;
    after a run, one line on how many runs have finished (``report_only``) and a warning naming the
    run folders in ``out`` that are not runs of this grid (:func:`_log_unplanned`). ``report_only``
    with other flags than the runs were trained with is refused (KeelError naming the keys): the
    report would state the new flags beside the old runs' numbers."""
    study = preset_study(what, config, sets, group)
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


DEPRECATED = "*deprecated: see report.md (its section \"Group {group}: {title}\"); this file goes in the next release*\n\n"


def write_deprecated_tables(report: dict, group: Group, out: Path, stem: str) -> dict:
    """Write ``STEM.json`` / ``STEM.md`` (``sweep``, ``stress``, ``sensitivity``) into ``out``: the
    deprecated aliases, kept for one release, of ``group``'s own table in the engine's ``report.json``
    (``group_tables``) and ``report.md`` (the same data and text, from the same function:
    :meth:`keel.experiments.study.kinds.TrainKind.table_markdown`; the markdown's first line says it
    is deprecated). Returns the data."""
    data = report["group_tables"][group.name]
    atomic_write_text(out / f"{stem}.json", json.dumps(data, indent=1, default=str))
    atomic_write_text(out / f"{stem}.md", DEPRECATED.format(group=group.name, title=group.kind_class.table_title)
                      + group.kind_class.table_markdown(data))
    return data


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
                  peak_lr=peak_lr, ramp_steps=ramp_steps, reference=reference_scheme, table=True)
    names = [ST.run_name(s, L, sd) for sd in seeds for L in sublayers for s in schemes]
    cached = _require_finished(out, names, "stress test") if report_only else \
        [n for n in names if cached_result(out / n) is not None]
    report = _execute("stress", config, overrides, group, out, report_only=report_only, **engine)
    if engine.get("dry_run"):
        return report
    summary = write_deprecated_tables(report, group, out, "stress")
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
                  lrs=lrs, widen=0, table=True)
    if report_only:  # the run names of TrainKind.jobs: L<sub-layers>_seed<s>_<scheme>_lr<lr>
        _require_finished(out, [run_name({"model.n_layers": L // 2, "train.seed": sd, "model.residual": s,
                                          "train.lr": lr}) for L in sublayers for s in schemes for lr in lrs
                                for sd in seeds], "LR grid")
    report = _execute("lr-sensitivity", config, sets, group, out, report_only=report_only, **engine)
    if engine.get("dry_run"):
        return report
    return write_deprecated_tables(report, group, out, Path(LS.OUT_JSON).stem)  # sensitivity.png: the engine's plot


# ----------------------------------------------------------------------------- keel sweep
OLD_SWEEP_KEYS = ("grid", "set", "best_over", "match_params")  # the top-level keys of the old sweep-preset format


def load_sweep_preset(name: str) -> dict:
    """A sweep preset (``keel sweep --preset``): the packaged ``keel/configs/sweeps/NAME.toml`` or a
    TOML file, a study file of one group of kind ``grid`` read by the study reader
    (:func:`keel.experiments.study.spec.study_from_dict`), as the flags it gives: ``{"base", "grid",
    "set" (typed (key, value) pairs: the study's, then the group's), "best_over", "match_params"}``.
    A file of the old format (``grid``, ``set``, ``best_over``, ``match_params`` at the top level) is
    converted on read, with one warning saying how to convert it; it loads for one more release.

    Raises:
        KeelError: unknown name, unparsable TOML, a malformed study or group (an unknown key, a grid
            key whose list is empty or repeats a value, ``best_over`` not a grid key), a file that is
            not a study of exactly one grid group.
    """
    path = resolve_config_path(name, kind="sweeps")
    d = read_toml(path, "sweep preset")
    old = [k for k in OLD_SWEEP_KEYS if k in d]
    if old:
        _log.warning(f"sweep preset {path} is in the old sweep-preset format (top-level {', '.join(old)}), read "
                     f"for one more release: move {', '.join(old)} under [groups.sweep] with kind = \"grid\" "
                     "(docs/usage.md, sweep presets)")
        d = {**{k: v for k, v in d.items() if k not in OLD_SWEEP_KEYS},
             "groups": {"sweep": {"kind": "grid", **{k: d[k] for k in old}}}}
    try:
        study = study_from_dict(path.stem, d, SCALE)
    except KeelError as e:  # the study reader names the group, not the file: a user's preset is a path
        raise KeelError(f"sweep preset {path}: {e}") from None
    if len(study.groups) != 1 or study.groups[0].kind != "grid" or study.claims:
        raise KeelError(f"sweep preset {path}: a sweep preset is a study of one group of kind \"grid\" and no "
                        f"claims ([groups.NAME] with kind = \"grid\" and its grid), got group(s) "
                        f"{', '.join(f'{g.name} ({g.kind})' for g in study.groups)}")
    g = study.groups[0]
    return {"base": d.get("base"), "grid": g.grid, "set": study.all_sets(g), "best_over": g.best_over,
            "match_params": g.match_params}


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
                  match_params=match_params, best_over=best)
    report = _execute("sweep", config, sets, group, Path(out), **engine)
    if engine.get("dry_run"):
        return report
    return write_deprecated_tables(report, group, Path(out), "sweep")
