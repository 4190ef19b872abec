"""Claim kind ``lr_transfer``: the optimal peak LR of a scheme is the same grid point at the shallowest
and the deepest depth (beyond the paper: Depth-muP, arXiv 2310.02244); a rule of its own."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from keel.experiments.analysis import INCONCLUSIVE, NOT_REPRODUCED, REPRODUCED, Record, Runs, opt_lrs, optional
from keel.experiments.study.cells import lrs
from keel.experiments.study.claims.base import OneGroup
from keel.experiments.study.spec import Study
from keel.experiments.study.verdicts import ClaimVerdict
from keel.experiments.table import markdown_table
from keel.keys import key


@dataclass
class OptLrRow(Record):
    """One scheme of an ``lr_transfer`` group: ``scheme``; ``opt_lr``, ``{sub-layers: {seed: optimal
    peak LR}}`` (:func:`~keel.experiments.analysis.opt_lrs`: the grid point of the lowest final loss);
    ``at_edge``: whether any of those optima lies on an edge of the LR grid."""

    scheme: str
    opt_lr: dict[int, dict[int, float]]
    at_edge: bool


@dataclass
class TransferVerdict(ClaimVerdict):
    """An ``lr_transfer`` verdict (its own rule, no parts): :class:`~keel.experiments.study.verdicts.ClaimVerdict`'s
    ``verdict``, ``rows`` (one :class:`OptLrRow` per scheme of the group) and ``why``, and once a seed has
    the scheme's LR grid at both depths: ``scheme`` (the one judged), ``depths`` (the shallowest and
    deepest, sub-layers) and ``log10_shift`` (``{seed: |log10(eta*_deep / eta*_shallow)|}``, 0 = the
    same grid point)."""

    scheme: str | None = optional()
    depths: list[int] | None = optional()
    log10_shift: dict[int, float] | None = optional()


@dataclass(kw_only=True)
class LrTransfer(OneGroup):
    """The keys of an ``lr_transfer`` claim (``group``: a train group with its whole LR grid at two or
    more depths), its verdict (a rule of its own) and table."""

    kind: ClassVar[str] = "lr_transfer"
    unit: ClassVar[str] = "peak LR"
    own_rule: ClassVar[bool] = True

    scheme: str = key("keel", "the scheme whose optimal LR should transfer.", nonempty=True)

    def verdict(self, study: Study, runs: Runs) -> TransferVerdict:
        """The optimal peak LR of {scheme} (the grid point of its lowest final loss) is the same at
        the shallowest and the deepest depth of group {group}, which trains its whole LR grid at each
        depth (a group trained at transferred LRs has too few LRs to locate an optimum). This claim has its own rule, not the
        paired-difference one: reproduced when every seed (at least the study's minimum) has its
        optimum at the same grid point at both depths, inside the grid; not reproduced when the
        optimum moves by at least one grid step in every seed; inconclusive otherwise, or when any
        optimum lies on an edge of the LR grid. There is no noise floor: one run per LR decides
        each optimum.

        Reported per seed: ``|log10(eta*_deep / eta*_shallow)|`` (0 = the same grid point).
        Rows: every scheme's per-seed optima, for comparison.
        """
        g = self.group
        depths = sorted({r.sublayers for r in runs if r.group == g})
        rows = _opt_lr_rows(runs, g, depths)
        subject = self.scheme
        row = next((r for r in rows if r.scheme == subject), None)
        if row is None or len(depths) < 2:
            return TransferVerdict(verdict=INCONCLUSIVE, why="needs the scheme's LR grid at two depths", rows=rows,
                                   stored=("verdict", "why", "rows"))
        lo, hi = row.opt_lr[depths[0]], row.opt_lr[depths[-1]]
        shift = {s: abs(math.log10(hi[s] / lo[s])) for s in sorted(set(lo) & set(hi))}
        if not shift:
            return TransferVerdict(verdict=INCONCLUSIVE, rows=rows, why=f"no seed has {subject}'s LR grid finished at "
                                   f"both {depths[0]} and {depths[-1]} sub-layers")
        return TransferVerdict(verdict=_transfer_verdict(shift, row.at_edge, study.min_seeds), scheme=subject,
                               depths=[depths[0], depths[-1]], log10_shift=shift, rows=rows,
                               stored=("verdict", "scheme", "depths", "log10_shift", "rows"))

    def schemes_read(self) -> list[str]:
        return [self.scheme]  # the other schemes of its table are for comparison

    @classmethod
    def numbers(cls, c: TransferVerdict) -> str:
        if c.log10_shift is None:
            return super().numbers(c)
        row = next(r for r in c.rows if r.scheme == c.scheme)
        lo, hi = c.depths
        return (f"{c.scheme} optimal LR per seed: {lo} sub-layers {lrs(row.opt_lr[lo])}, "
                f"{hi} sub-layers {lrs(row.opt_lr[hi])}" + ("; at an edge of the LR grid" if row.at_edge else ""))

    def tables(self, c: TransferVerdict) -> list[str]:
        return markdown_table(["scheme", "optimal LR per seed, by depth", "optimum at a grid edge"],
                              [[r.scheme, "; ".join(f"{L}: {lrs(v)}" for L, v in r.opt_lr.items()),
                                "yes" if r.at_edge else "no"] for r in c.rows])


def _opt_lr_rows(runs: Runs, group: str, depths: Sequence[int]) -> list[OptLrRow]:
    """One row per scheme of ``group`` (in the order of its runs): its per-seed optimal LR at each of
    ``depths`` (:func:`opt_lrs`) and whether any optimum lies on an edge of the LR grid."""
    rows = []
    for scheme in dict.fromkeys(r.scheme for r in runs if r.group == group):
        per = {L: opt_lrs(runs, group, scheme, L) for L in depths}
        rows.append(OptLrRow(scheme=scheme, opt_lr={L: {s: v[0] for s, v in p.items()} for L, p in per.items()},
                             at_edge=any(e for p in per.values() for _, e in p.values())))
    return rows


def _transfer_verdict(shift: dict[int, float], at_edge: bool, min_seeds: int) -> str:
    """The rule of :meth:`LrTransfer.verdict` on the per-seed shifts ``|log10(eta*_deep / eta*_shallow)|``:
    inconclusive with fewer than ``min_seeds`` seeds or an optimum on an edge of the grid; reproduced when
    no seed's optimum moves, not reproduced when every seed's moves; inconclusive otherwise."""
    if len(shift) < min_seeds or at_edge:
        return INCONCLUSIVE
    if all(x < 1e-9 for x in shift.values()):
        return REPRODUCED
    if all(x > 1e-9 for x in shift.values()):
        return NOT_REPRODUCED
    return INCONCLUSIVE
