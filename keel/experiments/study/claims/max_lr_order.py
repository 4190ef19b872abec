"""Claim kind ``max_lr_order``: the max LR on the stress test's ramp increases along an order of
schemes (Keel paper Table 1)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import MISSING, dataclass
from typing import ClassVar

from keel.errors import KeelError
from keel.experiments.analysis import INCONCLUSIVE, PairedVerdict, Record, Runs, paired_verdict
from keel.experiments.study.cells import CONDITION_WORDS, lrs, parts, upper_first
from keel.experiments.study.claims.base import OneGroup
from keel.experiments.study.spec import Group, Study
from keel.experiments.study.verdicts import ClaimVerdict, Condition, MAX_LR_FLOOR, combine, unfinished, verdict_words
from keel.experiments.table import markdown_table
from keel.keys import key


@dataclass
class RampRow(Record):
    """One depth of a ramp group: ``group``, its ``peak_lr``, ``sublayers``; ``max_lr``, per scheme of
    the order ``{seed: the LR just before divergence, or None: no divergence up to the peak}``;
    ``verdicts``: each run's divergence verdict in words (``{"scheme sSEED": words}``)."""

    group: str
    peak_lr: float
    sublayers: int
    max_lr: dict[str, dict]
    verdicts: dict[str, str]


@dataclass
class RampCondition(Condition):
    """One ramp's condition of a ``max_lr_order`` verdict (``paper_ramp``, ``extended_ramp``):
    :class:`~keel.experiments.study.verdicts.Condition`'s ``verdict``, ``parts`` (per adjacent pair of the
    order and depth, log10 of the max-LR ratio per seed, Student-t one-sided bounds, floor log10 1.05) and
    ``why``, and ``peak_lr``: the ramp's peak LR (None before a run of it finished; written as null)."""

    peak_lr: float | None = None


@dataclass(kw_only=True)
class MaxLrOrder(OneGroup):
    """The keys of a ``max_lr_order`` claim (``group``: the ramp group on the paper's ramp, its verdict),
    its verdict and tables."""

    kind: ClassVar[str] = "max_lr_order"
    unit: ClassVar[str] = "log10 of the max-LR ratio"
    group_kind: ClassVar[str] = "ramp"

    order: list[str] = key(MISSING, "the schemes from the lowest max LR to the highest.", nonempty=True,
                           unique=True, note="two or more scheme names")
    extended_group: str = key("", "the same ramp continued at the same LR per step to a higher peak, reported "
                                  "beside it (optional per scale).")

    def verdict(self, study: Study, runs: Runs) -> ClaimVerdict:
        """Max LR (the stress ramp's LR just before divergence) increases along {order}, on the
        paper's ramp.

        For each adjacent pair (a, b) of the order, per seed ``d = log10(maxLR_b / maxLR_a)`` (a
        run that never diverged counts as the peak LR: censored, so ``d`` is a lower bound when
        ``b`` never diverged; a seed where neither diverged is left out); pair verdict
        :func:`paired_verdict` with ``min_effect = log10(1.05)`` (5%); a condition's verdict combines
        its pairs (:func:`combine`). Conditions: ``paper_ramp`` (the claim's ``group``: the paper's
        ramp), which gives the claim's verdict, and ``extended_ramp`` (``extended_group``: the same
        LR per step continued to a higher peak, reported beside it). Rows: one per ramp group and
        depth with each scheme's max LR per seed, the ramp's peak, and each run's verdict in words
        (:func:`verdict_words`).
        """
        order, sized = self.order, {g.name for g in study.groups}
        names = {"paper_ramp": self.group}
        if self.extended_group in sized:
            names["extended_ramp"] = self.extended_group
        rows = [row for name in names.values() for row in _ramp_rows(runs, name, order)]
        trained = {g.name: set(g.schemes) for g in study.groups}
        conds = {}
        for cond, name in names.items():
            mine = [r for r in rows if r.group == name]
            pairs = _order_pairs(study, mine, order, trained.get(name, set(order)))
            waiting = unfinished(runs, [name], order)  # a ramp run still training can move a max LR
            conds[cond] = RampCondition(verdict=combine([p.verdict for p in pairs.values()]) if pairs and not waiting
                                        else INCONCLUSIVE,
                                        parts=pairs, peak_lr=mine[0].peak_lr if mine else None,
                                        why=None if pairs else "no finished ramp runs",
                                        stored=("verdict", "parts", "peak_lr", *(() if pairs else ("why",))))
        return ClaimVerdict(verdict=conds["paper_ramp"].verdict, conditions=conds, rows=rows,
                            stored=("verdict", "conditions", "rows"))

    def groups_read(self) -> list[str]:
        return [self.group] + ([self.extended_group] if self.extended_group else [])

    def optional_groups(self) -> list[str]:
        return [self.extended_group]  # an extended ramp is optional per scale

    def schemes_read(self) -> list[str]:
        return list(self.order)

    def check(self, groups: dict[str, Group]) -> None:
        order = self.order
        if len(order) < 2:
            raise KeelError(f"study claim {self.id!r}: order must be a list of two or more scheme names, "
                            f"e.g. order = [\"post_ln\", \"keel\"], got {order!r}")
        if self.extended_group in groups:
            _check_extended_ramp(self, groups[self.group], groups[self.extended_group])

    @classmethod
    def phrase(cls, conds: dict[str, RampCondition]) -> str:
        """The summary's verdict words per ramp, each with its peak LR."""
        return "; ".join(f"{v.verdict} {CONDITION_WORDS.get(k, k)}" + (f" (to {v.peak_lr:g})" if v.peak_lr else "")
                         for k, v in conds.items())

    def tables(self, c: ClaimVerdict) -> list[str]:
        out = []
        for cond, cc in c.conditions.items():
            out += [f"**{upper_first(CONDITION_WORDS[cond])}" + (f" (to {cc.peak_lr:g})" if cc.peak_lr else "")
                    + f": {cc.verdict}.** {parts(cc)}", ""]
        out += markdown_table(["ramp to", "sub-layers", *self.order],
                              [[f"{r.peak_lr:g} ({r.group})", r.sublayers,
                                *(lrs(r.max_lr[s]) if r.max_lr[s] else "—" for s in self.order)]
                               for r in c.rows])
        out += ["", "Max LR per seed; none = no divergence up to the ramp's peak LR; — = not run on that ramp. "
                "A none counts as the peak LR (censored: the pair's difference is then a lower bound); a seed where "
                "both schemes of a pair are none is left out. The verdict is the paper's ramp's; the extended ramp "
                "(the same LR per step to a higher peak) is reported beside it. Pair verdicts use log10 ratios of "
                "max LR with a 5% floor (log10 1.05 = 0.021). A spike still open when the curve ended counts as a "
                "divergence. Each run's verdict:", ""]
        return out + [f"- ramp to {r.peak_lr:g}, {r.sublayers} sub-layers, {run}: {text}" for r in c.rows
                      for run, text in r.verdicts.items()]


def _check_extended_ramp(c: MaxLrOrder, ramp: Group, ext: Group) -> None:
    """Raise KeelError unless ``ext`` continues ``ramp``: the same LR per step (``peak_lr /
    ramp_steps``, so both ramps give step k the same LR and the extended runs repeat the first
    ramp up to its end) to a higher peak."""
    same_slope = math.isclose(ext.peak_lr / ext.ramp_steps, ramp.peak_lr / ramp.ramp_steps, rel_tol=1e-9)
    if ext is ramp or not same_slope or ext.peak_lr <= ramp.peak_lr:
        raise KeelError(f"study claim {c.id!r}: extended_group {ext.name!r} must continue group {ramp.name!r}'s "
                        f"ramp: the same LR per step ({ramp.peak_lr:g} / {ramp.ramp_steps} steps) to a higher peak, "
                        f"got {ext.peak_lr:g} / {ext.ramp_steps} steps")


def _log_ratio(hi: float | None, lo: float | None, peak: float) -> float | None:
    """log10(max LR of the scheme expected higher / of the lower one); a run that never diverged
    counts as the peak LR (censored). Two censored runs are no evidence either way: None."""
    if hi is None and lo is None:
        return None
    a, b = (hi if hi is not None else peak), (lo if lo is not None else peak)
    if a <= 0 or b <= 0:
        return math.inf if a > b else (-math.inf if a < b else 0.0)
    return math.log10(a / b)


def _order_pairs(study: Study, rows: list[RampRow], order: list[str], trained: set[str]) -> dict[str, PairedVerdict]:
    """``{"a < b at L": verdict}``: per ramp row (one depth) and neighbours ``a < b`` of ``order``
    that the group trains, the paired verdict of ``d = log10(maxLR(b) / maxLR(a))`` per seed
    (:func:`_log_ratio`; a seed where both never diverged is censored alike and left out)."""
    pairs = {}
    for row in rows:
        lr, L = row.max_lr, row.sublayers
        for a, b in zip(order, order[1:]):
            d = {x: _log_ratio(lr[b][x], lr[a][x], row.peak_lr) for x in sorted(set(lr[a]) & set(lr[b]))}
            d = {x: v for x, v in d.items() if v is not None}  # both never diverged: censored, left out
            if {a, b} <= trained:
                pairs[f"{a} < {b} at {L}"] = paired_verdict(d, MAX_LR_FLOOR, study.min_seeds)
    return pairs


def _ramp_rows(runs: Runs, group: str, order: Sequence[str]) -> list[RampRow]:
    """One row per depth of ramp ``group``'s finished runs: its peak LR, each scheme's max LR per
    seed, each run's verdict in words."""
    rr = [r for r in runs if r.group == group and r.status == "done"]
    peak = max([r.peak_lr for r in rr] or [0.0])
    rows = []
    for L in sorted({r.sublayers for r in rr}):
        at = [r for r in rr if r.sublayers == L]
        lr = {s: {r.seed: r.max_lr for r in at if r.scheme == s} for s in order}
        detail = {f"{r.scheme} s{r.seed}": verdict_words(r) for s in order for r in at if r.scheme == s}
        rows.append(RampRow(group=group, peak_lr=peak, sublayers=L, max_lr=lr, verdicts=detail))
    return rows
