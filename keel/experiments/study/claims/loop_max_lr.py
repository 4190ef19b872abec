"""Claim kind ``loop_max_lr``: in a looped family, a scheme trains at every effective depth where a
baseline does, at a higher max LR."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from keel.diagnostics.divergence import Thresholds
from keel.errors import KeelError
from keel.experiments.analysis import PairedVerdict, Record, Runs, cell, paired_verdict
from keel.experiments.record import RunRecord
from keel.experiments.study.cells import max_lr_cell, pm
from keel.experiments.study.claims.base import InitGroups, Paired, condition_tables
from keel.experiments.study.spec import Group, Study
from keel.experiments.study.verdicts import (MAX_LR_FLOOR, ClaimVerdict, Condition, combine, condition_groups, judged,
                                             pending)


@dataclass
class MaxLrRow(Record):
    """One depth of a ``loop_max_lr`` condition: ``sublayers`` (effective depth, sub-layers); ``max_lr``,
    per scheme ``{seed: (max trained LR, how)}`` (:func:`max_trained_lr`: how "exact", "top" a lower
    bound, "none" an upper bound); ``neither``: no scheme trains in any seed; ``seeds``: the seeds both
    schemes finished; ``d``: ``log10(maxLR(scheme) / maxLR(baseline))`` per seed not censored alike, a
    :class:`~keel.experiments.analysis.PairedVerdict` (Student-t one-sided bounds, floor log10 1.05)."""

    sublayers: int
    max_lr: dict[str, dict]
    neither: bool
    seeds: int
    d: PairedVerdict


@dataclass(kw_only=True)
class LoopMaxLr(Paired, InitGroups):
    """The keys of a ``loop_max_lr`` claim (``groups``, ``init_groups``: looped train groups, the
    effective depths), its verdict and tables."""

    kind: ClassVar[str] = "loop_max_lr"
    unit: ClassVar[str] = "log10 of the max-LR ratio"
    needs_test_loops: ClassVar[bool] = False  # its groups must also test loop counts (Group.test_loops)

    def verdict(self, study: Study, runs: Runs) -> ClaimVerdict:
        """{scheme} trains at every effective depth where {baseline} does, at a higher max LR (every depth
        must hold), at the paper's init and with both schemes at N(0, 1) embeddings.

        Max LR of a scheme at a depth and seed: the largest LR of its grid (the group's LRs, widened) whose
        run trains (:func:`trains`: it left the unigram plateau and ended finite, below it). Per depth and seed
        ``d = log10(maxLR({scheme}) / maxLR({baseline}))``: a scheme that trains at none of its LRs counts as
        one grid step below its lowest (an upper bound), one that trains at its highest LR as that LR (a lower
        bound: censored, as on the ramp); a seed where both are censored alike (both train at their highest
        LR, or neither trains) is left out. :func:`paired_verdict` with floor log10 1.05 per depth (the grid
        resolves max LR to its step, x3); a depth where neither scheme trains in any seed is reported, not
        judged."""
        return judged({k: _max_lr_condition(study, runs, self, gs)
                        for k, gs in condition_groups(self.groups, self.init_groups).items()})

    def check(self, groups: dict[str, Group]) -> None:
        """Every group read is looped, all with one loop geometry; with ``needs_test_loops``, all also test
        loop counts, the same ones (``test_loops``).

        Raises:
            KeelError: one line naming the groups that do not loop, or the key (``loop``, ``test_loops``) whose
                values differ and each group's value."""
        gs, tests = [groups[g] for g in self.groups_read() if g in groups], self.needs_test_loops
        bad = [g.name for g in gs if not g.loop or (tests and not g.test_loops)]
        if bad:
            raise KeelError(f"study claim {self.id!r}: its groups must be looped, with one loop = [P, C, Q]"
                            + (" and test_loops" if tests else "") + f" (check {', '.join(bad)})")
        for name in ("loop", "test_loops") if tests else ("loop",):
            if len({tuple(getattr(g, name)) for g in gs}) > 1:
                values = ", ".join(f"{g.name} [{', '.join(f'{v:g}' for v in getattr(g, name))}]" for g in gs)
                raise KeelError(f"study claim {self.id!r}: its groups' {name} differ: {values}; the claim pairs "
                                f"their runs depth by depth, so give them one {name}")

    def tables(self, c: ClaimVerdict) -> list[str]:
        s, b = self.scheme, self.baseline
        return condition_tables(
            c, ["sub-layers", f"max LR per seed: {b}", s, f"log10 ratio ({s} / {b}) mean [CI] (per seed)"],
            lambda cc: [[r.sublayers, max_lr_cell(r.max_lr[b]), max_lr_cell(r.max_lr[s]),
                         "neither trains" if r.neither else pm(r.d)] for r in cc.rows or []]) + [
            "Max LR: the largest grid LR whose run left the unigram plateau and ended finite below it (+: "
            "at the highest LR run; <: at none). A seed bounded alike on both sides is left out."]


def trains(rec: RunRecord) -> bool:
    """Whether run ``rec`` trained: finished, left the unigram plateau (``plateau_exit_step``) and ended at
    a finite validation loss below the plateau level (:meth:`Thresholds.plateau_level` of its unigram
    entropy, when the record knows it)."""
    level = Thresholds().plateau_level(rec.unigram_entropy or rec.result.get("unigram_entropy"))
    final = rec.final_val_loss
    return rec.status == "done" and rec.plateau_exit_step is not None and final is not None \
        and math.isfinite(final) and (level is None or final < level)


def max_trained_lr(recs: Runs) -> tuple[float, str]:
    """``(max LR, how)`` of one seed's runs of a cell (its LR grid): the largest LR whose run
    :func:`trains`, ``how`` "exact" (a higher LR was run and did not train) or "top" (the highest LR run:
    a lower bound); when none trains, one grid step below the lowest LR (``lowest^2 / next``, or
    ``lowest / 3`` for a one-LR grid) with ``how`` "none" (an upper bound)."""
    lrs = sorted(r.lr for r in recs)
    ok = [r.lr for r in recs if trains(r)]
    if not ok:
        return (lrs[0] ** 2 / lrs[1] if len(lrs) > 1 else lrs[0] / 3), "none"
    return max(ok), "top" if max(ok) == lrs[-1] else "exact"


def _max_lrs(runs: Runs, groups: list[str], scheme: str, sublayers: int) -> dict[int, tuple[float, str]]:
    """``{seed: max_trained_lr}`` of a cell, over the seeds whose every LR has finished."""
    rs = cell(runs, groups, scheme, sublayers)
    out = {}
    for sd in sorted({r.seed for r in rs}):
        mine = [r for r in rs if r.seed == sd]
        if all(r.status == "done" for r in mine):
            out[sd] = max_trained_lr(mine)
    return out


def _max_lr_row(study: Study, runs: Runs, groups: list[str], scheme: str, baseline: str, L: int) -> MaxLrRow:
    """The row of one depth ``L`` of :func:`_max_lr_condition`: each scheme's max LR per seed
    (:func:`_max_lrs`), the seeds both finished, whether neither scheme trains in any of them, and
    ``d = log10(maxLR(scheme) / maxLR(baseline))`` as a :func:`paired_verdict` over the seeds not
    censored alike."""
    s, b = scheme, baseline
    per = {x: _max_lrs(runs, groups, x, L) for x in (s, b)}
    seeds = sorted(set(per[s]) & set(per[b]))
    kept = [sd for sd in seeds if per[s][sd][1] == "exact" or per[s][sd][1] != per[b][sd][1]]  # alike: out
    d = {sd: math.log10(per[s][sd][0] / per[b][sd][0]) for sd in kept}
    neither = bool(seeds) and all(per[s][sd][1] == per[b][sd][1] == "none" for sd in seeds)
    return MaxLrRow(sublayers=L, max_lr=per, neither=neither, seeds=len(seeds),
                    d=paired_verdict(d, MAX_LR_FLOOR, study.min_seeds))


def _max_lr_condition(study: Study, runs: Runs, claim: LoopMaxLr, groups: list[str]) -> Condition:
    """One condition of :meth:`LoopMaxLr.verdict`: a part per judged depth, a row per depth."""
    s, b = claim.scheme, claim.baseline
    parts, rows = {}, []
    for L in sorted({r.sublayers for r in runs if r.group in groups}):
        rows.append(_max_lr_row(study, runs, groups, s, b, L))
        if not rows[-1].neither:
            parts[f"log10 max LR, {s} over {b} at {L}"] = rows[-1].d
    gs = [g for g in study.groups if g.name in groups]
    planned = sorted({L for g in gs for L in g.sublayers})
    both = set.intersection(*({sd for g in gs for sd in g.scheme_seeds(x)} for x in (s, b))) if gs else set()
    finished = [r.sublayers for r in rows if r.seeds >= len(both)]  # every seed of both schemes
    if finished != planned or not parts:
        return pending("neither scheme trains at any depth" if finished == planned
                        else "a depth of the LR grid is not finished", parts=parts, rows=rows)
    return Condition(verdict=combine([p.verdict for p in parts.values()]), parts=parts, rows=rows)
