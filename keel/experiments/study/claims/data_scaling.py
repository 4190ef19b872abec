"""Claim kind ``data_scaling``: a scheme's margin over a baseline is positive at the largest token
budget and grows with training tokens (Keel paper Table 4, Figure 5)."""

from __future__ import annotations

from dataclasses import MISSING, dataclass
from typing import ClassVar

from keel.errors import KeelError
from keel.experiments.analysis import PairedVerdict, Record, Runs, best_runs, bracketed, pair, paired_verdict, trend_verdict
from keel.experiments.study.cells import lrs, pm
from keel.experiments.study.claims.base import Paired, condition_tables, edge
from keel.experiments.study.spec import Group, Study
from keel.experiments.study.verdicts import (ClaimVerdict, Condition, condition_groups, judged,
                                             non_embedding_params, one_depth, pending, settled, unfinished)
from keel.keys import key


@dataclass
class BudgetRow(Record):
    """One token budget of a ``data_scaling`` condition: ``group`` and its ``tokens`` per run; ``margin``,
    the paired ``best(baseline) - best(scheme)`` per seed (nats/token; Student-t one-sided bounds:
    :class:`~keel.experiments.analysis.PairedVerdict`); ``tokens_per_param`` per scheme (tokens per
    non-embedding parameter); ``best_lr`` (``{scheme: {seed: LR}}``) and ``bracketed``
    (``{scheme: {seed: inside the LRs trained}}``) of each seed's best run."""

    group: str
    tokens: int
    margin: PairedVerdict
    tokens_per_param: dict[str, float]
    best_lr: dict[str, dict]
    bracketed: dict[str, dict]


@dataclass(kw_only=True)
class DataScaling(Paired):
    """The keys of a ``data_scaling`` claim (a train group per token budget and init, all of one
    depth), its verdict and tables."""

    kind: ClassVar[str] = "data_scaling"
    unit: ClassVar[str] = "nats/token"

    budgets: list[str] = key(MISSING, "train groups of one depth at growing token budgets, paper's init.",
                             nonempty=True, unique=True, note="group names")
    init_budgets: list[str] = key([], "the same budgets with both schemes at the other embedding init.",
                                  unique=True, note="group names")

    def verdict(self, study: Study, runs: Runs) -> ClaimVerdict:
        """{scheme} beats {baseline} at the largest token budget and its margin grows with training
        tokens (both parts must hold), at one depth, at the paper's init and with both schemes at
        N(0, 1) embeddings.

        Each budget is a group of the same model, depth and data trained for fewer or more steps at a
        fixed batch (``budgets``, ``init_budgets``: groups of one depth each, the same for all); per
        budget and seed ``m = best(baseline) - best(scheme)``
        (nats/token, best over the group's LRs, each bracketed by the study). Parts: the margin at the
        largest budget (:func:`paired_verdict`) and the slope of each seed's margin against
        log2(tokens) over every budget (:func:`trend_verdict`: nats per doubling of tokens, floor
        spread over the range). Keel paper Table 4 / Figure 5: Keel's training-loss gain over Pre-LN
        grows from 10B to 40B tokens at 512 sub-layers."""
        return judged({k: _budget_condition(study, runs, self, gs)
                        for k, gs in condition_groups(self.budgets, self.init_budgets).items()})

    def groups_read(self) -> list[str]:
        return list(self.budgets) + list(self.init_budgets)

    def check(self, groups: dict[str, Group]) -> None:
        depths = {g: groups[g].sublayers for g in self.groups_read() if g in groups}
        if any(len(v) != 1 for v in depths.values()) or len({v[0] for v in depths.values()}) > 1:
            raise KeelError(f"study claim {self.id!r}: every budget group trains the same one depth, got "
                            + ", ".join(f"{g} {v}" for g, v in depths.items()))

    def tables(self, c: ClaimVerdict) -> list[str]:
        s, b = self.scheme, self.baseline
        return condition_tables(
            c, ["group", "tokens", f"tokens per non-embedding parameter ({b}; {s})",
                f"margin ({b} − {s}, nats) mean [CI] (per seed)", f"best LR per seed: {b}; {s}"],
            lambda cc: [[r.group, f"{r.tokens:,}", f"{r.tokens_per_param[b]:.3f}; {r.tokens_per_param[s]:.3f}",
                         pm(r.margin), f"{lrs(r.best_lr[b], edge(r.bracketed[b]))}; "
                         f"{lrs(r.best_lr[s], edge(r.bracketed[s]))}"] for r in cc.rows or []]) + [
            "A best LR marked with an asterisk is not bracketed (the study widens such a cell)."]


def group_tokens(runs: Runs, group: str) -> int | None:
    """Tokens per run of ``group`` (its finished runs' ``tokens``), None before one finished."""
    return next((r.tokens for r in runs if r.group == group and r.status == "done" and r.tokens), None)


def _budget_condition(study: Study, runs: Runs, claim: DataScaling, groups: list[str]) -> Condition:
    """One condition of claim (e): per budget group the paired margin at the groups' one depth,
    the margin at the largest budget and its slope against log2(tokens)."""
    s, b = claim.scheme, claim.baseline
    L = one_depth(study, groups[0])
    rows = []
    for g in groups:
        tokens = group_tokens(runs, g)
        best = {x: best_runs(runs, [g], x, L) for x in (b, s)}
        m = pair({sd: r.capped_loss for sd, r in best[b].items()}, {sd: r.capped_loss for sd, r in best[s].items()})
        if tokens is None or not m:
            continue
        rows.append(BudgetRow(group=g, tokens=tokens, margin=paired_verdict(m, study.min_effect, study.min_seeds),
                              tokens_per_param={x: tokens / non_embedding_params(study, g, x, L) for x in (b, s)},
                              best_lr={x: {sd: r.lr for sd, r in best[x].items()} for x in (b, s)},
                              bracketed={x: {sd: bracketed(runs, r) for sd, r in best[x].items()} for x in (b, s)}))
    rows.sort(key=lambda r: r.tokens)
    if len(rows) < len(groups):
        return pending(f"{len(rows)} of {len(groups)} token budgets finished", rows=rows)
    trend = trend_verdict({r.tokens: r.margin.diffs for r in rows}, study.min_effect, study.min_seeds)
    parts = {f"margin at {rows[-1].tokens:,} tokens": rows[-1].margin,
             "trend over " + ", ".join(f"{r.tokens:,}" for r in rows) + " tokens (slope per doubling)": trend}
    return Condition(verdict=settled(parts, unfinished(runs, groups, (s, b)), study.min_seeds), parts=parts, rows=rows)
