"""The kinds of group a study runs, one class per kind, registered once in :data:`GROUP_KINDS`
(``kind -> class``): what differs between a ``train`` group (an LR grid), a ``ramp`` group (the
stress test's LR ramp) and a ``grid`` group (``keel sweep``'s grid over any keys). A group's
keys stay one dataclass (:class:`keel.experiments.study.spec.Group`, its ``kind`` a name);
``group.kind_class`` is its class here, and the rest of the engine asks it, never ``kind``.
Ramp and grid override what differs from train. Their methods take the group (``g``, a ``Group``) and
the study (a ``spec.Study``), unannotated: spec imports this module.

A new kind of group is one class here, its line in :data:`GROUP_KINDS`, the name in
``Group.kind``'s type (when a study file may give it) and the keys only it reads."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import ClassVar

from keel.config import ModelConfig, resolve_config_path
from keel.errors import KeelError
from keel.experiments import stress as ST
from keel.experiments.grid import GridJob
from keel.experiments.study.ablation import train_and_ablate, train_and_test_loops
from keel.experiments.sweep import build_jobs, train_task

Jobs = tuple[list[GridJob], list[GridJob]]  # (reference jobs, jobs) of a group


class TrainKind:
    """A ``train`` group: schemes x sub-layers x LRs x seeds, each run trained at its peak LR. Its
    LRs form a grid per (scheme, depth) cell, planned, widened and transferred by
    :func:`keel.experiments.study.run.group_records` (``lr_grid``); the keys of ``keys`` are its own."""

    name: ClassVar[str] = "train"
    keys: ClassVar[tuple[str, ...]] = ("lrs", "lr_from", "lr_from_sublayers", "lr_from_steps", "baselines_from",
                                       "baselines", "widen", "ablate", "test_loops")  # the group keys only it reads
    lr_grid: ClassVar[bool] = True  # an LR grid per cell: what lr_from and baselines_from read, the best-loss table
    ramps: ClassVar[bool] = False  # its runs ramp the LR until they diverge (and have reference runs)

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
                # a looped run keeps the name of its effective depth (L68_...), as run_name spells n_layers first
                jobs += [replace(j, name=f"L{L}" + j.name[len(f"L{2 * blocks}"):])
                         for j in build_jobs(study.base, grid, sets + g.loop_sets(L), data_path=data_dir)]
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


class RampKind(TrainKind):
    """A ``ramp`` group: the stress test (:mod:`keel.experiments.stress`): each run's LR ramps from 0
    to ``peak_lr`` over ``ramp_steps`` until it diverges, classified against a ``reference`` scheme's
    run (reference jobs) at each depth and seed."""

    name: ClassVar[str] = "ramp"
    keys: ClassVar[tuple[str, ...]] = ("peak_lr", "ramp_steps", "reference")
    lr_grid: ClassVar[bool] = False
    ramps: ClassVar[bool] = True

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


class GridKind(TrainKind):
    """A ``grid`` group, made in Python by ``keel sweep`` (never in a study file): the product of
    ``grid``'s values over any config keys (:func:`keel.experiments.sweep.build_jobs`), with
    ``match_params``; a grid over ``data.*`` keys prepares each run's data in its worker."""

    name: ClassVar[str] = "grid"
    keys: ClassVar[tuple[str, ...]] = ()
    lr_grid: ClassVar[bool] = False

    @classmethod
    def check(cls, g, where: str) -> None:
        pass

    @classmethod
    def jobs(cls, study, g, data_dir, out, lr_for) -> Jobs:
        return [], build_jobs(study.base, g.grid, study.all_sets(g), match_params=g.match_params,
                              data_path=None if cls.own_data(g) else data_dir)

    @classmethod
    def task(cls, g) -> Callable:
        return train_task

    @classmethod
    def own_data(cls, g) -> bool:
        return any(k.startswith("data.") for k in g.grid)


GROUP_KINDS: dict[str, type[TrainKind]] = {k.name: k for k in (TrainKind, RampKind, GridKind)}
