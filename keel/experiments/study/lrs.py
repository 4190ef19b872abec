"""The LR plan of a study group: its jobs (:func:`group_jobs`), the peak LRs planned for a train
group (:func:`initial_lrs`; an ``lr_from`` group's around its source's optimum,
:func:`transferred_lrs`, :func:`stepped_lrs`) and widened until every cell's optimum is bracketed
(:func:`widened_lrs`, :func:`lr_beyond`, :func:`group_records`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from keel.experiments import sensitivity as LS
from keel.experiments.grid import GridJob
from keel.experiments.record import RunRecord
from keel.experiments.study.spec import Group, Study, lr_ladder


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
        curves = [LS.seed_curve([r for r in rs if r.seed == s], lrs) for s in g.scheme_seeds(scheme)]
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
