"""The statistics every grid and study reads off its run records (:class:`keel.experiments.record.RunRecord`):
mean and sd over seeds, paired per-seed differences and their Student-t interval (the verdict of
one paired comparison, :func:`paired_verdict`), the least-squares trend of a margin, and per cell
(group(s), scheme, depth) the best run over the LR grid, whether it is bracketed, the seed-mean
optimum and the healthy-LR window. Used by the claims (:mod:`keel.experiments.study.claims`),
the report's tables and the presets (:mod:`keel.experiments.sensitivity`).

The verdict of a paired comparison is a typed record, :class:`PairedVerdict` (a trend's
:class:`TrendVerdict`); :class:`Record` is the one ``report.json`` path (:meth:`Record.to_dict`,
:func:`plain`) of it and of every typed record of verdict data above it (a claim's verdict per
condition, :class:`keel.experiments.study.verdicts.Condition`; the kinds' rows).

The interval and the slope are written out rather than taken from ``scipy.stats.t.interval`` and
``scipy.stats.linregress``: those give the same numbers to about 1e-15 but differ in the last
bits (26 of the 84 intervals and a third of the slopes of the committed CPU study), and
``report.json`` keeps every digit, so a report regenerated with them would not be the same bytes.
Only the t quantile comes from scipy (``t.ppf``).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from keel.experiments.record import RunRecord

REPRODUCED, NOT_REPRODUCED, INCONCLUSIVE = "reproduced", "not reproduced", "inconclusive"
LEVEL = 0.95  # confidence of each one-sided bound of a paired interval (together: a two-sided 90% interval)
Runs = Sequence[RunRecord]


# ----------------------------------------------------------------------------- typed verdict data
def optional(default: Any = None, **kw):
    """A :class:`Record` field left out of :meth:`Record.to_dict` while it is None (a key that
    ``report.json`` holds only when it has a value, e.g. a verdict's ``why``)."""
    return dataclasses.field(default=default, metadata={"optional": True}, **kw)


def stored_keys():
    """The ``stored`` field of a :class:`Record` whose keys' order (or presence of a null key)
    depends on where it was made: the keys of its ``report.json`` entry, in order; empty for the
    declared order (as :class:`keel.experiments.record.RunRecord`'s ``stored``)."""
    return dataclasses.field(default=(), repr=False, compare=False, kw_only=True)


class Record:
    """The ``report.json`` path shared by the typed records of verdict data (:class:`PairedVerdict`,
    :class:`keel.experiments.study.verdicts.Condition`, the claim kinds' rows): :meth:`to_dict`,
    one rule for every such dataclass. Its keys (:meth:`keys`): the record's ``stored`` keys, in
    order, when it has them (a record made where a key comes in another order, or where a null key is
    written), followed by any :func:`optional` field set since (a claim's ``summary``); else its
    fields in declared order, an :func:`optional` field left out while it is None. Values go through
    :func:`plain` (records nested in dicts and lists written as their dicts)."""

    def keys(self) -> tuple[str, ...]:
        """The keys of the record's ``report.json`` entry, in order."""
        fields = [f for f in dataclasses.fields(self) if f.name != "stored"]
        present = [f.name for f in fields if not (f.metadata.get("optional") and getattr(self, f.name) is None)]
        stored = getattr(self, "stored", ())
        if not stored:
            return tuple(present)
        later = [f.name for f in fields if f.metadata.get("optional") and f.name in present and f.name not in stored]
        return (*stored, *later)

    def to_dict(self) -> dict:
        """The record's ``report.json`` entry: :meth:`keys` in order, values through :func:`plain`."""
        return {k: plain(getattr(self, k)) for k in self.keys()}


def plain(x: Any) -> Any:
    """``x`` ready for ``json.dumps``: a :class:`Record` as its :meth:`~Record.to_dict`, the values of
    dicts, lists and tuples likewise (keys, order and tuples kept: JSON writes a tuple as a list),
    anything else as it is."""
    if isinstance(x, Record):
        return x.to_dict()
    if isinstance(x, dict):
        return {k: plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(plain(v) for v in x)
    return x


@dataclass(frozen=True)
class PairedVerdict(Record):
    """The verdict of one paired comparison (:func:`paired_verdict`), oriented so that the claim
    predicts ``d > 0``.

    ``verdict``: reproduced, not reproduced or inconclusive. ``n``: the seeds with a finite
    difference. ``mean``, ``sd``: the mean and sample standard deviation (ddof 1; 0 for one seed)
    of the per-seed differences, in the unit of ``min_effect`` (nats/token for a loss margin,
    log10 of a max-LR ratio, a share of sub-layers); None without seeds. ``lo``, ``hi``: the
    one-sided Student-t bounds of the mean at confidence ``level`` each (:func:`t_bounds`: together
    a two-sided ``2 level - 1`` interval); None below two seeds. ``diffs``: ``{seed: d}`` as given
    (a non-finite or None difference kept here, left out of the statistics). ``min_effect``: the
    floor the bounds are judged against. ``report.json`` keeps the keys in this order.
    """

    verdict: str
    n: int
    mean: float | None
    sd: float | None
    lo: float | None
    hi: float | None
    level: float
    diffs: dict
    min_effect: float

    @classmethod
    def from_dict(cls, d: dict) -> PairedVerdict:
        """The record of a ``report.json`` entry ``d`` (a trend's, with ``depths``, a :class:`TrendVerdict`).
        JSON object keys are text: ``diffs`` keeps the seeds as ``report.json`` holds them."""
        if "depths" in d and cls is PairedVerdict:
            return TrendVerdict.from_dict(d)
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls)})


@dataclass(frozen=True)
class TrendVerdict(PairedVerdict):
    """The verdict of a margin's growth (:func:`trend_verdict`): a :class:`PairedVerdict` of the
    per-seed least-squares slopes of the margin against log2 of the depth (sub-layers) or of the
    tokens (``diffs``, ``mean``, ``lo``, ``hi``: nats/token per doubling; ``min_effect``: the floor
    spread over the range, nats/token per doubling), and ``depths``: the x values it was fitted
    over (sub-layers, or tokens), ascending."""

    depths: list


# ----------------------------------------------------------------------------- numbers over seeds
def mean_sd(xs: Sequence[float | None]) -> tuple[float | None, float | None]:
    """``(mean, sample sd)`` of the numbers in ``xs`` (None entries left out; sd with ddof 1, 0
    for one number); ``(None, None)`` when there is none."""
    xs = [x for x in xs if x is not None]
    if not xs:
        return None, None
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def t_bounds(xs: Sequence[float], level: float = LEVEL) -> tuple[float, float] | None:
    """One-sided Student-t bounds of the mean of ``xs``: ``(lo, hi)`` with
    ``lo = mean - t_{level, n-1} * sd / sqrt(n)`` and ``hi = mean + t_{level, n-1} * sd / sqrt(n)``
    (``sd`` with ddof 1; Student 1908, the paired t interval): each bound holds with probability
    ``level`` when the ``xs`` are independent draws of a normal difference. None for fewer than two."""
    n = len(xs)
    if n < 2:
        return None
    from scipy.stats import t  # the t quantile; imported here, where a verdict needs it
    half = float(t.ppf(level, n - 1)) * statistics.stdev(xs) / math.sqrt(n)
    mean = statistics.fmean(xs)
    return mean - half, mean + half


def pair(a: dict, b: dict) -> dict:
    """Paired differences ``{seed: a[seed] - b[seed]}`` over the seeds both have (same seed = same
    init draws and data order), in seed order."""
    return {s: a[s] - b[s] for s in sorted(set(a) & set(b))}


def paired_verdict(diffs: dict, min_effect: float, min_seeds: int = 3, level: float = LEVEL) -> PairedVerdict:
    """The verdict of one paired comparison, oriented so that the claim predicts ``d > 0``.

    ``diffs``: ``{seed: d_seed}`` (nats/token, or any unit ``min_effect`` is in), one per seed
    that both sides finished (paired: same seed = same init draws and data order). With
    ``(lo, hi)`` the one-sided ``level`` t bounds of the mean difference (:func:`t_bounds`):

    * ``reproduced``: at least ``min_seeds`` seeds and ``lo >= min_effect`` (the effect clears
      the floor);
    * ``not reproduced``: at least ``min_seeds`` seeds and ``hi < min_effect`` (the interval
      excludes an effect as large as the floor: the opposite, or no effect);
    * ``inconclusive``: anything else (the interval straddles the floor, or too few seeds).

    Returns a :class:`PairedVerdict` (``sd`` the sample standard deviation, ddof 1; 0 for one seed;
    ``mean``/``sd`` None without seeds; ``lo``/``hi`` None below two seeds).
    """
    xs = [float(x) for x in diffs.values() if x is not None and math.isfinite(x)]
    n = len(xs)
    mean, sd = mean_sd(xs)
    lo, hi = t_bounds(xs, level) or (None, None)
    if n < max(2, min_seeds):
        verdict = INCONCLUSIVE
    elif lo >= min_effect:
        verdict = REPRODUCED
    elif hi < min_effect:
        verdict = NOT_REPRODUCED
    else:
        verdict = INCONCLUSIVE
    return PairedVerdict(verdict=verdict, n=n, mean=mean, sd=sd, lo=lo, hi=hi, level=level, diffs=dict(diffs),
                         min_effect=min_effect)


def slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of ``ys`` against ``xs``: ``sum((x - mx)(y - my)) / sum((x - mx)^2)``."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def trend_verdict(margins: dict[int, dict], min_effect: float, min_seeds: int = 3) -> TrendVerdict:
    """Whether a paired margin grows with depth (or tokens), from every point (not two endpoints).

    ``margins``: ``{sub-layers: {seed: margin}}``. Per seed that has a margin at every depth, the
    least-squares slope (:func:`slope`) of its margin against ``log2(sub-layers)`` (nats per
    doubling); the verdict is :func:`paired_verdict` of those slopes with the floor spread over the
    studied range, ``min_effect / log2(L_max / L_min)`` (the fitted growth from the shallowest to
    the deepest depth must clear ``min_effect``). Fewer than two depths: inconclusive, no seeds.
    Returns a :class:`TrendVerdict`: the :func:`paired_verdict` of the slopes plus ``depths``.
    """
    depths = sorted(margins)
    seeds = sorted(set.intersection(*(set(m) for m in margins.values()))) if depths else []
    slopes = {}
    if len(depths) >= 2:
        xs = [math.log2(L) for L in depths]
        slopes = {sd: slope(xs, [margins[L][sd] for L in depths]) for sd in seeds}
    floor = min_effect / math.log2(depths[-1] / depths[0]) if len(depths) >= 2 else min_effect
    v = paired_verdict(slopes, floor, min_seeds)
    return TrendVerdict(**{f.name: getattr(v, f.name) for f in dataclasses.fields(v)}, depths=depths)


# ----------------------------------------------------------------------------- the best LR of a cell
def cell(runs: Runs, groups: Sequence[str], scheme: str, sublayers: int) -> list[RunRecord]:
    """The records of one cell: ``scheme`` at ``sublayers`` in any of ``groups``, in run order."""
    return [r for r in runs if r.group in groups and r.scheme == scheme and r.sublayers == sublayers]


def lowest(items: Sequence, loss: Callable) -> int:
    """The index of the item of lowest ``loss(item)`` (the first of equals): the argmin over an LR
    grid, whether of runs or of a curve's points."""
    return min(range(len(items)), key=lambda i: loss(items[i]))


def best_run(recs: Runs) -> RunRecord:
    """The record of lowest ``capped_loss`` (a run without a finite final loss counts as its step-0
    loss), the first of equals."""
    return recs[lowest(recs, lambda r: r.capped_loss)]


def best_runs(runs: Runs, groups: Sequence[str], scheme: str, sublayers: int) -> dict:
    """``{seed: run record}`` of ``scheme`` at ``sublayers`` over the runs of ``groups``: per seed,
    the run with the lowest capped final validation loss (:func:`best_run`: each seed's best LR).
    Seeds with an unfinished LR are left out."""
    rs = cell(runs, groups, scheme, sublayers)
    out = {}
    for seed in sorted({r.seed for r in runs}):
        mine = [r for r in rs if r.seed == seed]
        if mine and all(r.status == "done" for r in mine):
            out[seed] = best_run(mine)
    return out


def best_losses(runs: Runs, groups: Sequence[str], scheme: str, sublayers: int) -> dict:
    """``{seed: best capped final validation loss}`` (nats/token) of :func:`best_runs`."""
    return {seed: r.capped_loss for seed, r in best_runs(runs, groups, scheme, sublayers).items()}


def best_lrs(runs: Runs, groups: Sequence[str], scheme: str, sublayers: int) -> dict:
    """``{seed: peak LR}`` of :func:`best_runs`: where each seed's best loss came from."""
    return {seed: r.lr for seed, r in best_runs(runs, groups, scheme, sublayers).items()}


def bracketed(runs: Runs, rec: RunRecord) -> bool:
    """Whether run ``rec`` (a seed's best) lies strictly inside the LRs its scheme trained at its
    depth, seed and group: its optimum is bracketed (a lower and a higher LR were trained and
    ended worse, diverged or stagnated)."""
    lrs = [x.lr for x in cell(runs, [rec.group], rec.scheme, rec.sublayers) if x.seed == rec.seed]
    return min(lrs) < rec.lr < max(lrs)


def opt_lrs(runs: Runs, group: str, scheme: str, sublayers: int) -> dict:
    """``{seed: (optimal LR, at an edge of the LR grid)}`` of one scheme and depth of a train group:
    per seed that finished every LR of the cell, its best run's LR (:func:`best_run`). A cell of one LR
    is at an edge (that LR is both ends of its grid: its optimum is not located)."""
    rs = cell(runs, [group], scheme, sublayers)
    lrs = sorted({r.lr for r in rs})
    out = {}
    for seed in sorted({r.seed for r in rs}):
        mine = [r for r in rs if r.seed == seed]
        if len(mine) == len(lrs) and all(r.status == "done" for r in mine):
            lr = best_run(mine).lr
            out[seed] = (lr, lr in (lrs[0], lrs[-1]))
    return out


def seed_mean_losses(runs: Runs, groups: Sequence[str], scheme: str, sublayers: int) -> dict[float, float]:
    """``{peak LR: seed-mean capped loss}`` of a cell, ascending LR, over the seeds that finished
    every LR of it; empty while no seed has."""
    rs = cell(runs, groups, scheme, sublayers)
    lrs = sorted({r.lr for r in rs})
    seeds = [sd for sd in sorted({r.seed for r in rs})
             if sorted(r.lr for r in rs if r.seed == sd and r.status == "done") == lrs]
    if not seeds:
        return {}
    return {lr: statistics.fmean(r.capped_loss for r in rs if r.lr == lr and r.seed in seeds) for lr in lrs}


def seed_mean_optimum(runs: Runs, groups: Sequence[str], scheme: str, sublayers: int) -> float | None:
    """The peak LR with the lowest seed-mean capped loss of ``scheme`` at ``sublayers`` over the
    runs of ``groups`` (:func:`seed_mean_losses`); None before one seed has every LR finished."""
    mean = seed_mean_losses(runs, groups, scheme, sublayers)
    lrs = list(mean)
    return lrs[lowest(lrs, mean.get)] if lrs else None


def lr_window(runs: Runs, groups: Sequence[str], scheme: str, sublayers: int, margin: float) -> list[float]:
    """The healthy-LR window of ``scheme`` at ``sublayers`` in ``groups``: the peak LRs whose
    seed-mean capped loss (:func:`seed_mean_losses`) is within ``margin`` nats/token of the best
    seed-mean loss, ascending. Empty while no seed has every LR finished."""
    mean = seed_mean_losses(runs, groups, scheme, sublayers)
    best = min(mean.values(), default=None)
    return [lr for lr, x in mean.items() if x <= best + margin]


@dataclass(frozen=True)
class LossFloor(Record):
    """The noise floor of the loss claims (:func:`loss_floor`; ``report.json``'s ``floor``), nats/token:
    ``floor`` = max(``minimum``, ``median_sd``), the ``min_effect`` every loss claim is judged against;
    ``median_sd``: the median over the ``cells`` (groups, scheme, sub-layers) with two or more finished
    seeds of the sample sd (ddof 1) of a cell's best loss over seeds, ``min_sd`` / ``max_sd`` their range
    (None without such a cell); ``minimum``: the study's ``min_effect``. A floor not taken from the
    spread (``floor_from_spread = false``: :func:`keel.experiments.study.judge.study_floor`) holds
    ``floor`` and ``minimum`` only (``stored``)."""

    floor: float
    median_sd: float | None = None
    cells: int = 0
    min_sd: float | None = None
    max_sd: float | None = None
    minimum: float = 0.0
    stored: tuple[str, ...] = stored_keys()


def loss_floor(runs: Runs, cells: Sequence[tuple[Sequence[str], str, int]], minimum: float) -> LossFloor:
    """The noise floor of the loss claims, from the measured seed-to-seed spread.

    ``cells``: ``(groups, scheme, sub-layers)`` whose best loss a verdict reads. Per cell with at
    least two finished seeds, the sample sd of the best loss over seeds (:func:`best_losses`);
    the floor is their median, and at least ``minimum`` (nats/token): a difference smaller than
    the typical seed-to-seed spread of one configuration's best loss is not counted as an effect.
    Returns a :class:`LossFloor`.
    """
    sds = []
    for groups, scheme, L in cells:
        b = list(best_losses(runs, groups, scheme, L).values())
        if len(b) >= 2:
            sds.append(statistics.stdev(b))
    med = statistics.median(sds) if sds else None
    return LossFloor(floor=max(minimum, med or 0.0), median_sd=med, cells=len(sds), min_sd=min(sds, default=None),
                     max_sd=max(sds, default=None), minimum=minimum)
