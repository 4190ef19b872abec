"""Claim kind ``margin_grows``: a scheme's margin over a baseline is positive at the deepest
depth and grows with depth (Keel paper Table 3, Figure 1c)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import matplotlib.ticker

from keel.errors import KeelError
from keel.experiments.analysis import (
    INCONCLUSIVE,
    PairedVerdict,
    Record,
    Runs,
    best_run,
    best_runs,
    bracketed,
    cell,
    lr_window,
    pair,
    paired_verdict,
    trend_verdict,
)
from keel.experiments.study.cells import direction, exits, flagged, lrs, pm, window
from keel.experiments.study.cells import CONDITION_WORDS
from keel.experiments.study.claims.base import Claim, InitGroups, Paired, cond_head, edge
from keel.experiments.study.spec import Group, Study
from keel.experiments.study.verdicts import ClaimVerdict, Condition, combine, left_plateau_later, settled, unfinished
from keel.experiments.table import markdown_table
from keel.train.plots import plt, save_figure

WINDOW = 0.1  # nats/token: an LR is in a scheme's healthy window when its seed-mean loss is this close to the best


@dataclass
class MarginRow(Record):
    """One depth of a ``margin_grows`` condition: ``sublayers``; ``margin``, the paired
    ``best(baseline) - best(scheme)`` per seed (nats/token; a
    :class:`~keel.experiments.analysis.PairedVerdict`, Student-t one-sided bounds); per scheme and seed
    of its best run: ``best_lr``, ``best_group`` (the init group it came from), ``bracketed`` (inside
    the LRs trained) and ``plateau_exit`` (the step it left the unigram plateau, None: never);
    ``window``: per scheme ``{group: healthy LRs}`` (:func:`lr_window`); ``baseline_runs``,
    ``baseline_diverged_runs``, ``baseline_recovered_runs``: the baseline's finished runs, those the
    divergence classifier flagged, and of these the ones that left the plateau later."""

    sublayers: int
    margin: PairedVerdict
    best_lr: dict[str, dict]
    best_group: dict[str, dict]
    bracketed: dict[str, dict]
    plateau_exit: dict[str, dict]
    window: dict[str, dict]
    baseline_runs: int
    baseline_diverged_runs: int
    baseline_recovered_runs: int


@dataclass
class EqualLrRow(Record):
    """One depth and peak LR of :func:`equal_lr_margins`: ``sublayers``, ``lr`` and ``margin``, the
    paired ``loss(baseline) - loss(scheme)`` per seed at that LR (nats/token; Student-t one-sided bounds)."""

    sublayers: int
    lr: float
    margin: PairedVerdict


@dataclass
class MarginVerdict(ClaimVerdict):
    """A ``margin_grows`` verdict: :class:`~keel.experiments.study.verdicts.ClaimVerdict`'s ``verdict``
    and ``conditions`` (each with its parts: the margin at the deepest depth, nats/token, and its trend,
    nats/token per doubling of sub-layers, Student-t one-sided bounds; its rows, one per depth), and,
    reported beside them: ``equal_lr`` (:func:`equal_lr_margins`: the margin at equal peak LR per depth
    and LR) and ``widen`` (``{group: widen}`` of the groups read: how far the study widens an edge optimum)."""

    equal_lr: list[EqualLrRow] = field(default_factory=list)
    widen: dict[str, int] = field(default_factory=dict)


@dataclass(kw_only=True)
class MarginGrows(Paired, InitGroups):
    """The keys of a ``margin_grows`` claim (``groups``: the depths of the margin at the paper's
    init), its verdict and tables."""

    kind: ClassVar[str] = "margin_grows"
    unit: ClassVar[str] = "nats/token"
    figure: ClassVar[str] = "margins.png"

    @classmethod
    def plot(cls, verdicts: list[tuple[Claim, MarginVerdict]], out: Path) -> bool:
        """Margin (baseline − scheme, nats) against depth (log x) for every margin claim and condition
        (solid: the paper's init; dashed: both schemes at N(0, 1) embeddings): the seed mean as a line, every
        seed as a dot; False (nothing written) when no condition has two depths."""
        series = [(cl, k, cc) for cl, c in verdicts
                  for k, cc in c.conditions.items() if len(cc.rows or []) >= 2]
        if not series:
            return False
        fig, ax = plt.subplots(figsize=(6.4, 4.4))
        colors = {}
        for cl, k, c in series:
            xs = [r.sublayers for r in c.rows]
            line = ax.plot(xs, [r.margin.mean for r in c.rows], marker="o", ls="-" if k == "paper_init" else "--",
                           color=colors.get(cl.id), label=f"({cl.id}) {cl.baseline} − {cl.scheme}, "
                           f"{CONDITION_WORDS[k]}")[0]
            colors[cl.id] = line.get_color()
            seeds = [(r.sublayers, d) for r in c.rows for d in r.margin.diffs.values()]
            ax.scatter([x for x, _ in seeds], [d for _, d in seeds], s=14, alpha=0.6, color=line.get_color(),
                       marker="o" if k == "paper_init" else "x")
        ax.axhline(0, color="gray", lw=1)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({r.sublayers for _, _, c in series for r in c.rows}))
        ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel("depth (sub-layers)")
        ax.set_ylabel("final validation loss margin (nats/token)")
        ax.set_title("line: seed mean; markers: seeds", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        save_figure(fig, out)
        return True

    def verdict(self, study: Study, runs: Runs) -> MarginVerdict:
        """{scheme} beats {baseline} at the deepest depth and its margin grows with depth (both parts
        must hold), at the paper's init and with both schemes at N(0, 1) embeddings.

        Margin per seed and depth: ``m_L = best(baseline) - best(scheme)`` (nats/token, best over
        the LR grid per seed). Each condition (:data:`CONDITIONS`) has two parts, combined by
        :func:`combine`: the margin at the deepest depth (:func:`paired_verdict`) and its slope
        against log2 depth over every depth (:func:`trend_verdict`). ``paper_init`` reads the claim's
        ``groups``; ``embed_init`` (with ``init_groups``: the same depths at the other embedding init)
        reads only ``init_groups``: both schemes under the same init, fixed before any run, so no
        condition picks between inits on the losses it judges. The claim's verdict combines the
        conditions: reproduced only where both are. Rows per depth: the margin, each seed's best
        LR and init, whether it is bracketed, the plateau exit step, each init's healthy-LR window
        (:func:`lr_window`), the baseline's flagged runs.
        """
        conds = {"paper_init": [list(self.groups)]}
        if self.init_groups:
            conds["embed_init"] = [list(self.init_groups)]
        out = {k: _margin_condition(study, runs, self, alts) for k, alts in conds.items()}
        equal = equal_lr_margins(runs, self.groups, self.scheme, self.baseline, study.min_effect, study.min_seeds)
        widen = {g.name: g.widen for g in study.groups if g.name in [*self.groups, *self.init_groups]}
        return MarginVerdict(verdict=combine([c.verdict for c in out.values()]), conditions=out, equal_lr=equal,
                             widen=widen, stored=("verdict", "conditions", "equal_lr", "widen"))

    def floor_cells(self, study: Study) -> list[tuple[tuple[str, ...], str, int]]:
        """Every (group, scheme, depth) cell the margin reads, the paper's init's groups first."""
        return [((g.name,), s, L) for groups in (self.groups, self.init_groups) for g in study.groups
                if g.name in groups for s in (self.scheme, self.baseline) for L in g.sublayers]

    def check(self, groups: dict[str, Group]) -> None:
        if self.scheme == self.baseline:
            raise KeelError(f"study claim {self.id!r}: scheme and baseline are both {self.scheme!r}; "
                            "the margin is between two different schemes")

    def tables(self, c: MarginVerdict) -> list[str]:
        out = [line for cond, cc in c.conditions.items() for line in _margin_table(self, cond, cc)]
        out += ["A best LR marked with an asterisk is not bracketed: it is the lowest or highest LR that seed trained "
                f"({widen_words(c.widen)}).", "",
                f"The classifier reports a run's first failure: a {self.baseline} run flagged as a stagnation (100 "
                "steps on the unigram plateau) may leave the plateau later and still be that seed's best run (each "
                "run's verdict and plateau exit step: the last table)."]
        if c.equal_lr:
            out += ["", "The same margin at equal peak LR at the paper's init (both schemes at that LR; not part of "
                    "the verdict):", ""] + markdown_table(
                ["sub-layers", "LR", "margin (baseline − scheme, nats) mean [CI] (per seed)"],
                [[r.sublayers, f"{r.lr:g}", pm(r.margin)] for r in c.equal_lr])
        return out


def _margin_table(claim: MarginGrows, cond: str, c: Condition) -> list[str]:
    """Markdown: one condition of a margin claim, a row per depth."""
    s, b = claim.scheme, claim.baseline
    head = ["sub-layers", f"margin ({b} − {s}, nats) mean [CI] (per seed)", "at this depth", f"best LR per seed: {b}; {s}",
            f"init of the best run: {b}; {s}", f"plateau exit step at that LR: {b}; {s}",
            f"healthy-LR window (within {WINDOW:g} nats of the best seed-mean loss): {b}; {s}",
            f"{b} runs flagged by the divergence classifier"]
    rows = []
    for r in c.rows:
        at_edge = {x: edge(r.bracketed[x]) for x in (b, s)}
        rows.append([r.sublayers, pm(r.margin), direction(r.margin, s, b),
                     f"{lrs(r.best_lr[b], at_edge[b])}; {lrs(r.best_lr[s], at_edge[s])}",
                     "; ".join("[" + ", ".join(f"s{sd} {g}" for sd, g in r.best_group[x].items()) + "]"
                               for x in (b, s)),
                     f"{exits(r.plateau_exit[b])}; {exits(r.plateau_exit[s])}",
                     f"{window(r.window[b])} / {window(r.window[s])}",
                     flagged(r.baseline_runs, r.baseline_diverged_runs, r.baseline_recovered_runs)])
    return cond_head(cond, c) + markdown_table(head, rows) + [""]


def widen_words(widen: dict[str, int]) -> str:
    """How far the study widens an edge optimum, from each read group's ``widen`` (spec.Group)."""
    per = sorted(set(widen.values()))
    if per == [0]:
        return "this scale does not widen LR grids: widen = 0"
    head = "the study widens such a cell by one LR beyond the edge"
    if len(per) != 1:
        return head + ("" if not per else " (at most widen times per side: "
                       + ", ".join(f"{g}: {n}" for g, n in widen.items()) + ")")
    return head + ", " + {1: "at most once", 2: "at most twice"}.get(per[0], f"at most {per[0]} times") + " per side"


def equal_lr_margins(runs: Runs, groups: Sequence[str], scheme: str, baseline: str,
                     min_effect: float, min_seeds: int) -> list[EqualLrRow]:
    """Per depth and peak LR that both schemes ran, the paired per-seed margin
    ``loss(baseline) - loss(scheme)`` (capped final validation loss, nats/token) at that same
    LR, as a :class:`PairedVerdict`: how the margin depends on the LR, beside the
    best-LR margin of :meth:`MarginGrows.verdict`: one :class:`EqualLrRow` each."""
    def losses(name: str, L: int, lr: float) -> dict:
        return {r.seed: r.capped_loss for r in cell(runs, groups, name, L) if r.lr == lr and r.status == "done"}

    rows = []
    for L in sorted({r.sublayers for r in runs if r.group in groups}):
        for lr in sorted({r.lr for r in runs if r.group in groups and r.sublayers == L}):
            m = pair(losses(baseline, L, lr), losses(scheme, L, lr))
            if m:
                rows.append(EqualLrRow(sublayers=L, lr=lr, margin=paired_verdict(m, min_effect, min_seeds)))
    return rows


def best_over_inits(study: Study, runs: Runs, alts: Sequence[Sequence[str]], scheme: str,
                    sublayers: int) -> dict:
    """``{seed: run record}``: per seed, the best run (lowest capped loss) of ``scheme`` at
    ``sublayers`` over alternatives ``alts`` (each a list of groups: one embedding init). An
    alternative whose groups are sized at that depth is required: a seed counts only when every
    required alternative has all its LRs finished (:func:`best_runs`)."""
    need = [a for a in alts if any(g.name in a and sublayers in g.sublayers and scheme in g.schemes
                                   for g in study.groups)]
    per = [best_runs(runs, a, scheme, sublayers) for a in need]
    seeds = set.intersection(*(set(p) for p in per)) if per else set()
    return {sd: best_run([p[sd] for p in per]) for sd in sorted(seeds)}


def _trained_in(runs: Runs, groups: Sequence[str], scheme: str, sublayers: int) -> str:
    """The first of ``groups`` holding a run of ``scheme`` at ``sublayers`` (else the first group): the
    name a table gives that init's LR window at that depth (e.g. ``transfer`` at 256, not ``lr-grid``)."""
    return next((g for g in groups if cell(runs, [g], scheme, sublayers)), groups[0])


def _margin_row(study: Study, runs: Runs, claim: MarginGrows, alts: list[list[str]], L: int) -> MarginRow | None:
    """The row of one depth ``L`` of :func:`_margin_condition` (None without a paired result): the
    paired margin of each seed's best runs over ``alts``, their LR, group, bracketing and plateau exit
    per scheme, each init's healthy-LR window per scheme (:func:`lr_window`), the baseline's flagged
    runs (:func:`_baseline_failures`)."""
    s, b = claim.scheme, claim.baseline
    best = {x: best_over_inits(study, runs, alts, x, L) for x in (b, s)}
    m = pair({sd: r.capped_loss for sd, r in best[b].items()}, {sd: r.capped_loss for sd, r in best[s].items()})
    if not m:
        return None
    return MarginRow(sublayers=L, margin=paired_verdict(m, study.min_effect, study.min_seeds),
                     best_lr={x: {sd: r.lr for sd, r in best[x].items()} for x in (b, s)},
                     best_group={x: {sd: r.group for sd, r in best[x].items()} for x in (b, s)},
                     bracketed={x: {sd: bracketed(runs, r) for sd, r in best[x].items()} for x in (b, s)},
                     plateau_exit={x: {sd: r.plateau_exit_step for sd, r in best[x].items()} for x in (b, s)},
                     window={x: {_trained_in(runs, a, x, L): lr_window(runs, a, x, L, WINDOW) for a in alts}
                             for x in (b, s)},
                     **_baseline_failures(runs, [g for a in alts for g in a], b, L))


def _baseline_failures(runs: Runs, groups: list[str], baseline: str, L: int) -> dict:
    """The baseline's finished runs of ``groups`` at ``L`` sub-layers, those the divergence classifier
    flagged, and of these the ones that left the plateau later (:func:`left_plateau_later`), counted:
    ``{"baseline_runs", "baseline_diverged_runs", "baseline_recovered_runs"}``."""
    finished = [r for r in cell(runs, groups, baseline, L) if r.status == "done"]
    failed = [r for r in finished if r.diverged]
    return {"baseline_runs": len(finished), "baseline_diverged_runs": len(failed),
            "baseline_recovered_runs": sum(left_plateau_later(r) for r in failed)}


def _margin_condition(study: Study, runs: Runs, claim: MarginGrows, alts: list[list[str]]) -> Condition:
    """One condition of a margin claim: the paired margin at every depth, each scheme at each
    seed's best run over ``alts`` (one group list per embedding init), the margin at the deepest
    depth and its trend with depth (:func:`trend_verdict`), combined by :func:`combine`;
    inconclusive while a depth the condition's groups plan has no paired result yet."""
    groups = [g for a in alts for g in a]
    depths = sorted({r.sublayers for r in runs if r.group in groups})
    rows = [row for row in (_margin_row(study, runs, claim, alts, L) for L in depths) if row is not None]
    if len(rows) < 2:
        return Condition(verdict=INCONCLUSIVE, why="needs paired results at two depths at least", rows=rows, parts={},
                         stored=("verdict", "why", "rows", "parts"))
    hi = rows[-1]
    planned = max((L for g in study.groups if g.name in groups for L in g.sublayers), default=hi.sublayers)
    where = f"margin at {hi.sublayers} sub-layers" + (
        f" (the deepest finished; {planned} pending)" if planned > hi.sublayers else "")
    trend = trend_verdict({r.sublayers: r.margin.diffs for r in rows}, study.min_effect, study.min_seeds)
    parts = {where: hi.margin, f"trend over {', '.join(str(r.sublayers) for r in rows)} sub-layers "
             "(slope per doubling)": trend}
    # a depth or a run still training can overturn either part: no verdict on part of the planned range
    waiting = unfinished(runs, groups, (claim.scheme, claim.baseline))
    verdict = settled(parts, waiting, study.min_seeds) if planned == hi.sublayers else INCONCLUSIVE
    return Condition(verdict=verdict, parts=parts, rows=rows)
