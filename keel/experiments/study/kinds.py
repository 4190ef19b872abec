"""The kinds of group a study runs, one class per kind, registered once in :data:`GROUP_KINDS`
(``kind -> class``): what differs between a ``train`` group (an LR grid), a ``ramp`` group (the
stress test's LR ramp) and a ``grid`` group (``keel sweep``'s grid over any keys). A group's
keys stay one dataclass (:class:`keel.experiments.study.spec.Group`, its ``kind`` a name);
``group.kind_class`` is its class here, and the rest of the engine asks it, never ``kind``.
Ramp and grid override what differs from train. Their methods take the group (``g``, a ``Group``) and
the study (a ``spec.Study``), unannotated: spec imports this module.

Each kind also has its own table (:meth:`TrainKind.table`, :meth:`TrainKind.table_markdown`): the
sweep table of a grid group, the stress table of a ramp group, the LR-sensitivity table of a train
group; the engine's report writes it as a section of ``report.md`` and a key of ``report.json``
(``group_tables``) for a grid group always, for the others when the group asks (``table = true``,
as ``keel stress`` and ``keel lr-sensitivity`` do).

A new kind of group is one class here, decorated with :func:`group_kind` (which registers it in
:data:`GROUP_KINDS`: ``Group.kind`` takes the names registered there), with its ``name``, its one-line
``summary`` (``Group.kind``'s help) and the keys only it reads (``keys``); what it does differently
from a train group is what it overrides (``axes``, ``lr_grid``, ``ramps``, ``jobs``, ``task``,
``record``, ``table`` ...)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

from keel.config import ModelConfig, override_text, resolve_config_path
from keel.diagnostics.divergence import Thresholds
from keel.errors import KeelError
from keel.experiments import sensitivity as LS
from keel.experiments import stress as ST
from keel.experiments import sweep as S
from keel.experiments.grid import GridJob, cached_result
from keel.experiments.job_result import JobResult, failed_result
from keel.experiments.record import RunRecord
from keel.experiments.study.ablation import train_and_ablate, train_and_test_loops
from keel.experiments.sweep import build_jobs, train_task

Jobs = tuple[list[GridJob], list[GridJob]]  # (reference jobs, jobs) of a group


def done_results(recs: list[RunRecord]) -> list[dict]:
    """The grid results (``result.json``) of the finished runs among ``recs``, in their order (a
    restored run, which keeps no result file, is left out)."""
    return [r.result for r in recs if r.status == "done" and r.result is not None]


def error_results(recs: list[RunRecord]) -> list[dict]:
    """The failed runs among ``recs`` as grid results (:func:`keel.experiments.job_result.failed_result`)."""
    return [failed_result(r.name, r.message, r.wall_s or 0.0, r.values) for r in recs if r.status == "error"]


GROUP_KINDS: dict[str, type[TrainKind]] = {}  # the kinds of group, by name: filled by @group_kind


def group_kind(cls: type[TrainKind]) -> type[TrainKind]:
    """Class decorator: register the kind of group ``cls`` in :data:`GROUP_KINDS` under ``cls.name``.

    Raises:
        ValueError: another kind has that name (a programming error, at import).
    """
    if cls.name in GROUP_KINDS:
        raise ValueError(f"two kinds of group are named {cls.name!r}")
    GROUP_KINDS[cls.name] = cls
    return cls


@group_kind
class TrainKind:
    """A ``train`` group: schemes x sub-layers x LRs x seeds, each run trained at its peak LR. Its
    LRs form a grid per (scheme, depth) cell, planned, widened and transferred by
    :func:`keel.experiments.study.lrs.group_records` (``lr_grid``); the keys of ``keys`` are its own."""

    name: ClassVar[str] = "train"
    summary: ClassVar[str] = "an LR grid per scheme and depth"  # Group.kind's help
    keys: ClassVar[tuple[str, ...]] = ("lrs", "lr_from", "lr_from_sublayers", "lr_from_steps", "baselines_from",
                                       "baselines", "widen", "ablate", "test_loops")  # the group keys only it reads
    lr_grid: ClassVar[bool] = True  # an LR grid per cell: what lr_from and baselines_from read, the best-loss table
    ramps: ClassVar[bool] = False  # its runs ramp the LR until they diverge (and have reference runs)
    axes: ClassVar[bool] = True  # its runs are schemes x sub-layers x seeds (a grid group's grid names its own)
    table_title: ClassVar[str] = "LR sensitivity"  # the heading of its own table in report.md (table)

    @classmethod
    def check(cls, g, where: str) -> None:
        """Raise KeelError (one line) for what the group's keys cannot say alone."""
        if not (g.lrs or g.lr_from):
            raise KeelError(f"{where} has neither lrs nor lr_from")

    @classmethod
    def schemes_named(cls, g) -> list[str]:
        """Every scheme the group names (checked against keel.model.SCHEMES)."""
        return list(g.schemes)

    @classmethod
    def jobs(cls, study, g, data_dir: str, out: Path,
             lr_for: dict[tuple[str, int], list[float]] | None) -> Jobs:
        """One :func:`keel.experiments.sweep.build_jobs` grid per (scheme, depth) in the order depth,
        scheme (as the group lists them), LR, seed: the seeds of one cell run side by side, so a partial
        group already holds paired cells for its first schemes. ``lr_for``: ``{(scheme, sub-layers):
        [LR, ...]}``; None: the group's ``lrs`` everywhere. No reference jobs."""
        sets, jobs = study.all_sets(g), []
        for scheme in g.schemes:
            for L in g.sublayers:
                lrs = lr_for[(scheme, L)] if lr_for is not None else g.lrs
                blocks = sum(g.loop) if g.loop else L // 2  # a looped group's blocks of weights: P + C + Q
                grid = {"model.n_layers": [blocks], "train.seed": g.scheme_seeds(scheme),
                        "model.residual": [scheme], "train.lr": sorted(lrs)}
                jobs += build_jobs(study.base, grid, sets + g.loop_sets(L), data_path=data_dir)  # L<effective depth>_...
        order = {s: i for i, s in enumerate(g.schemes)}
        jobs.sort(key=lambda j: (ModelConfig(**j.config["model"]).n_sublayers, order[j.values["model.residual"]],
                                 j.values["train.lr"], j.values["train.seed"]))
        return [], jobs

    @classmethod
    def task(cls, g) -> Callable:
        """The grid task of each run: training, then its ablation (``ablate``) or its test loop counts
        (``test_loops``) when the group asks for one."""
        if g.ablate:
            return train_and_ablate
        return functools.partial(train_and_test_loops, factors=g.test_loops) if g.test_loops else train_task

    @classmethod
    def own_data(cls, g) -> bool:
        """Whether each run prepares its own dataset (else the study's one, prepared once)."""
        return False

    @classmethod
    def lr_words(cls, g) -> str:
        """Its LRs in the ``--dry-run`` plan: ``0.0003, 0.001``, or ``from lr-grid at 64, grid steps
        [0, -1]`` (an ``lr_from`` group: known once its source has finished); "" for none."""
        if g.lr_from:
            return f"from {g.lr_from} at {g.lr_from_sublayers}, grid steps {g.lr_from_steps}"
        return ", ".join(f"{x:g}" for x in g.lrs)

    @classmethod
    def record(cls, g) -> dict:
        """What a finished run's record holds from the group itself."""
        return {"peak_lr": None}

    @classmethod
    def curve_axis(cls, g) -> str | None:
        """The report's plot of the group: its runs' loss curves against ``"step"`` or ``"lr"``, or
        None for loss against LR per cell (a group with an LR grid)."""
        return "step" if len(g.lrs) <= 1 else None

    @classmethod
    def table(cls, study, g, recs: list[RunRecord], out: Path, h1: float | None) -> dict | None:
        """The data of the group's own table (``report.json``'s ``group_tables``; the deprecated
        ``sensitivity.json``), from its run records ``recs``; None when the group has none (a train group:
        unless ``table = true``). A train group's: the LR-sensitivity summary: ``config``, ``sets``,
        ``schemes``, ``sublayers``, ``lrs`` (sorted), ``seeds``, ``unigram_entropy`` and
        ``plateau_level`` (nats; ``h1``, the training tokens' unigram entropy), ``runs`` (grid results)
        and ``cells`` (:func:`keel.experiments.sensitivity.summarise`)."""
        if not g.table:
            return None
        lrs = sorted(g.lrs)
        summary = {"config": str(resolve_config_path(study.base)), "sets": [override_text(x) for x in study.all_sets(g)],
                   "schemes": list(g.schemes), "sublayers": list(g.sublayers), "lrs": lrs, "seeds": list(g.seeds),
                   "unigram_entropy": h1, "plateau_level": Thresholds().plateau_level(h1),
                   "runs": done_results(recs) + error_results(recs)}
        summary["cells"] = LS.summarise(recs, g.schemes, g.sublayers, lrs, g.seeds, summary["plateau_level"])
        return summary

    @classmethod
    def table_markdown(cls, data: dict) -> str:
        """The markdown of :meth:`table`'s ``data`` (a section of ``report.md``; the deprecated
        ``sensitivity.md``)."""
        return LS.markdown(data)


@group_kind
class RampKind(TrainKind):
    """A ``ramp`` group: the stress test (:mod:`keel.experiments.stress`): each run's LR ramps from 0
    to ``peak_lr`` over ``ramp_steps`` until it diverges, classified against a ``reference`` scheme's
    run (reference jobs) at each depth and seed."""

    name: ClassVar[str] = "ramp"
    summary: ClassVar[str] = "an LR ramp until divergence (keel stress's)"  # Group.kind's help
    keys: ClassVar[tuple[str, ...]] = ("peak_lr", "ramp_steps", "reference")
    lr_grid: ClassVar[bool] = False
    ramps: ClassVar[bool] = True
    table_title: ClassVar[str] = "stress test, max LR per scheme and depth"

    @classmethod
    def check(cls, g, where: str) -> None:
        pass

    @classmethod
    def schemes_named(cls, g) -> list[str]:
        return g.schemes + [g.reference]

    @classmethod
    def jobs(cls, study, g, data_dir, out, lr_for) -> Jobs:
        """The stress test's reference jobs and jobs (:func:`keel.experiments.stress.stress_jobs`)."""
        return ST.stress_jobs(resolve_config_path(study.base), study.all_sets(g), g.schemes, g.sublayers, g.seeds,
                              g.peak_lr, g.ramp_steps, Path(data_dir), out / g.dir_name, g.reference, g.loop_sets)

    @classmethod
    def task(cls, g) -> Callable:
        return ST.stress_task

    @classmethod
    def lr_words(cls, g) -> str:
        return f"ramp 0 -> {g.peak_lr:g} over {g.ramp_steps} steps"

    @classmethod
    def record(cls, g) -> dict:
        return {"peak_lr": g.peak_lr}

    @classmethod
    def curve_axis(cls, g) -> str | None:
        return "lr"

    @classmethod
    def table(cls, study, g, recs, out, h1):
        """A ramp group's (``table = true``): the stress test's max LR per scheme and depth
        (:func:`keel.experiments.stress.stress_table`) with ``peak_lr``, ``ramp_steps``, ``config``,
        ``overrides``, ``reference_scheme``, ``runs`` (finished grid results) and ``references`` (the
        finished reference runs in ``out``)."""
        if not g.table:
            return None
        results = done_results(recs)
        refs = [cached_result(out / g.dir_name / ST.REFERENCES / ST.run_name(g.reference, L, sd))
                for sd in g.seeds for L in g.sublayers]
        return {"peak_lr": g.peak_lr, "ramp_steps": g.ramp_steps, "config": str(resolve_config_path(study.base)),
                "overrides": [override_text(x) for x in study.all_sets(g)], "reference_scheme": g.reference,
                "runs": results, "references": [r for r in refs if r is not None],
                "table": ST.stress_table(results, g.schemes, g.sublayers)}

    @classmethod
    def table_markdown(cls, data: dict) -> str:
        return ST.table_markdown(data["table"], data["peak_lr"])


@group_kind
class GridKind(TrainKind):
    """A ``grid`` group (``keel sweep``, a sweep preset): the product of ``grid``'s values over any
    config keys (:func:`keel.experiments.sweep.build_jobs`), with ``match_params`` and ``best_over``;
    a grid over ``data.*`` keys (or a ``set`` of them) prepares each run's data in its worker. Its
    keys are its own: a study file's grid group gives ``grid``, ``set``, ``best_over``,
    ``match_params``, ``note`` (no schemes, sub-layers, LRs or seeds: the grid names them)."""

    name: ClassVar[str] = "grid"
    summary: ClassVar[str] = "a grid over any config keys (keel sweep's: grid, best_over, match_params)"  # Group.kind's help
    keys: ClassVar[tuple[str, ...]] = ("grid", "best_over", "match_params")
    lr_grid: ClassVar[bool] = False
    axes: ClassVar[bool] = False
    table_title: ClassVar[str] = "sweep"

    @classmethod
    def check(cls, g, where: str) -> None:
        """Raise KeelError (one line): an empty ``grid``, a grid key whose values are not a non-empty list
        or repeat a value, a ``best_over`` that is not a grid key, a ``match_params`` that is neither
        ``"auto"`` nor a whole number >= 0."""
        if not isinstance(g.grid, dict) or not g.grid:
            raise KeelError(f"{where}: grid must be a table of config keys and their values, e.g. "
                            'grid = { "train.lr" = [1e-3, 3e-3] }')
        for k, v in g.grid.items():
            if not isinstance(v, list) or not v:
                raise KeelError(f"{where}: grid {k!r} must be a non-empty list")
            if S.repeats_a_value(k, v):
                raise KeelError(f"{where}: grid {k!r} repeats a value: {v}")
        if g.best_over is not None and g.best_over not in g.grid:
            raise KeelError(f"{where}: best_over {g.best_over!r} is not one of the grid keys ({', '.join(g.grid)})")
        m = g.match_params
        if not (m is None or m == "auto" or (isinstance(m, int) and not isinstance(m, bool) and m >= 0)):
            raise KeelError(f'{where}: match_params must be "auto" or a parameter count >= 0, got {m!r}')

    @classmethod
    def jobs(cls, study, g, data_dir, out, lr_for) -> Jobs:
        return [], build_jobs(study.base, g.grid, study.all_sets(g), match_params=g.match_params,
                              data_path=None if cls.own_data(g) else data_dir)

    @classmethod
    def task(cls, g) -> Callable:
        return train_task

    @classmethod
    def own_data(cls, g) -> bool:
        """A grid over ``data.*`` keys, or a group whose own ``set`` changes them (a sweep preset run by
        ``keel study``): the study's one dataset is not its runs'."""
        return any(k.startswith("data.") for k in [*g.grid, *(k for k, _ in g.sets)])

    @classmethod
    def table(cls, study, g, recs, out, h1):
        """A grid group's (always): the sweep summary (:func:`keel.experiments.sweep.sweep_markdown`'s
        input): ``out``, ``config``, ``sets``, ``grid``, ``grid_keys``, ``derived_keys``, ``match_params``,
        ``runs`` (finished and failed grid results, in run order), ``held_fixed``, ``best_over`` and
        ``best`` (the best value of ``best_over`` per combination of the other keys, with its run's name, final
        validation loss and effective depth ``sublayers``; or None)."""
        results = done_results(recs) + error_results(recs)
        order = {r.name: i for i, r in enumerate(recs)}
        results.sort(key=lambda r: order[JobResult.from_dict(r).name])
        summary = {"out": str(out), "config": str(resolve_config_path(study.base)),
                   "sets": [override_text(x) for x in study.all_sets(g)], "grid": g.grid, "grid_keys": list(g.grid),
                   "derived_keys": ["model.d_model"] if g.match_params not in (None, 0, "0", "") else [],
                   "match_params": g.match_params, "runs": results,
                   "held_fixed": S.held_fixed([r for r in results if JobResult.from_dict(r).done]),
                   "best_over": g.best_over, "best": None}
        if g.best_over:
            summary["best"] = [{"values": b["values"], "best": b["best"], "name": b["run"]["name"] if b["run"] else None,
                                "final_val_loss": b["run"]["final_val_loss"] if b["run"] else None,
                                "sublayers": JobResult.from_dict(b["run"]).sublayers if b["run"] else None,
                                "n_ok": b["n_ok"], "n": b["n"]} for b in S.best_over(results, list(g.grid), g.best_over)]
        return summary

    @classmethod
    def table_markdown(cls, data: dict) -> str:
        return S.sweep_markdown(data)

