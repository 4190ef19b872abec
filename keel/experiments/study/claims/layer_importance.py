"""Claim kind ``layer_importance``: a scheme's shallow sub-layers are less redundant than a baseline's
and the first two sub-layers of both are critical (Keel paper Appendix A)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import MISSING, dataclass
from pathlib import Path
from typing import ClassVar

from keel.errors import KeelError
from keel.experiments.analysis import Record, Runs, optional, pair, paired_verdict, seed_mean_optimum
from keel.experiments.record import RunRecord
from keel.experiments.study.cells import CONDITION_WORDS
from keel.experiments.study.claims.base import Claim, InitGroups, Paired, condition_tables
from keel.experiments.study.spec import Group, Study
from keel.experiments.study.verdicts import (ClaimVerdict, Condition, MAX_LR_FLOOR, combine, judged, pending,
                                             unfinished, waits)
from keel.train.plots import plt, save_figure
from keel.keys import key

REDUNDANT_BELOW = 0.01  # a sub-layer is redundant when removing it raises the PPL by less than 1%
SHALLOW = 0.5  # the shallow sub-layers: the first half


@dataclass
class ImportanceRow(Record):
    """One depth of a ``layer_importance`` condition: ``sublayers``; per scheme ``lr`` (the seed-mean
    optimal peak LR its ablated runs were trained at, None before it is known), and per scheme and seed
    ``share`` (:func:`redundant_share`: the share of the shallow half whose removal raises the
    perplexity by less than 1%), ``critical`` (:func:`first_critical`: log10 of the first two
    sub-layers' removal cost over the median's), ``delta_ppl`` (ΔPPL per removed sub-layer) and
    ``ppl_full`` (the full model's perplexity); ``missing``: per scheme the planned seeds without an
    ablation at that LR and why (``pending``: its run has not finished; ``no ablation``: it finished
    without one, stopped early), left out when none is missing."""

    sublayers: int
    lr: dict[str, float | None]
    share: dict[str, dict[int, float]]
    critical: dict[str, dict[int, float]]
    delta_ppl: dict[str, dict[int, list[float]]]
    ppl_full: dict[str, dict[int, float]]
    missing: dict[str, dict[int, str]] = optional()


@dataclass(kw_only=True)
class LayerImportance(Paired, InitGroups):
    """The keys of a ``layer_importance`` claim (``groups``, ``init_groups``: train groups with ablate =
    true; ``optimum_groups``, ``init_optimum_groups``: where each scheme's LR comes from), its verdict
    and tables."""

    kind: ClassVar[str] = "layer_importance"
    unit: ClassVar[str] = "share of sub-layers; log10 PPL ratio"
    figure: ClassVar[str] = "importance.png"

    optimum_groups: list[str] = key(MISSING, "the train groups whose seed-mean optimal LR picks the ablated run.",
                                    nonempty=True, note="group names")
    init_optimum_groups: list[str] = key([], "their LR source at the other init.", note="group names")
    share_floor: float = key(0.05, "the floor of the redundant-share difference.", gt=0, le=1)

    @classmethod
    def plot(cls, verdicts: list[tuple[Claim, ClaimVerdict]], out: Path) -> bool:
        """ΔPPL / PPL_full of removing each sub-layer against its relative depth (i + 0.5) / L, one
        panel per condition and depth of every layer-importance claim, each scheme's seed mean as a
        line (log y, values below 1e-4 drawn at 1e-4); False (nothing written) before any ablation."""
        panels = [(cond, row) for cl, c in verdicts
                  for cond, cc in c.conditions.items() for row in cc.rows or []
                  if any(row.delta_ppl[x] for x in row.delta_ppl)]
        if not panels:
            return False
        fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 3.8), squeeze=False)
        for ax, (cond, row) in zip(axes[0], panels):
            for scheme, per_seed in row.delta_ppl.items():
                if not per_seed:
                    continue
                rel = [[d / row.ppl_full[scheme][sd] for d in v] for sd, v in per_seed.items()]
                L = len(rel[0])
                mean = [max(1e-4, sum(r[i] for r in rel) / len(rel)) for i in range(L)]
                ax.plot([(i + 0.5) / L for i in range(L)], mean, label=f"{scheme} ({len(rel)} seeds)")
            ax.set_yscale("log")
            ax.set_xlabel("relative depth of the removed sub-layer")
            ax.set_title(f"{row.sublayers} sub-layers, {CONDITION_WORDS[cond]}", fontsize=9)
            ax.legend(fontsize=8)
        axes[0][0].set_ylabel("ΔPPL / PPL of the full model")
        fig.tight_layout()
        save_figure(fig, out)
        return True

    def verdict(self, study: Study, runs: Runs) -> ClaimVerdict:
        """{scheme}'s shallow sub-layers are less redundant than {baseline}'s, and the first two
        sub-layers of both are critical (every part must hold), at every depth of the ablated groups,
        at the paper's init and with both schemes at N(0, 1) embeddings. Redundant: a sub-layer of
        the shallow half whose removal raises the perplexity by less than 1%; per seed
        d = share({baseline}) − share({scheme}) against a floor of {claim.share_floor:g}. Critical: per
        scheme and seed log10(mean PPL without sub-layer 1 or 2 / median PPL without one sub-layer)
        against a floor of log10 1.05.

        Each scheme's run per seed at its seed-mean optimal LR (:func:`seed_mean_optimum` over
        ``optimum_groups``, ``init_optimum_groups``), ablated (``groups``, ``init_groups``: groups
        with ``ablate = true``; ΔPPL_i per sub-layer, Keel paper Appendix A). Metrics fixed before
        any ablation was read: the redundant share of the shallow half (:func:`redundant_share`: ΔPPL
        below 1% of the full PPL), paired ``d = share(baseline) - share(scheme)`` with floor
        ``share_floor``; and per scheme the first-two-sub-layers ratio (:func:`first_critical`,
        log10), one-sample with floor log10 1.05 (5%)."""
        conds = {"paper_init": (self.groups, self.optimum_groups),
                 **({"embed_init": (self.init_groups, self.init_optimum_groups)} if self.init_groups else {})}
        return judged({k: _importance_condition(study, runs, self, abl, opt) for k, (abl, opt) in conds.items()})

    def groups_read(self) -> list[str]:
        return [*self.groups, *self.optimum_groups, *self.init_groups, *self.init_optimum_groups]

    def own_floors(self) -> str:
        return (f"the redundant share, a share of sub-layers, f = {self.share_floor:g}; the first-two ratio, "
                f"log10 of a PPL ratio, f = log10 1.05 = {MAX_LR_FLOOR:.3f}")

    def check(self, groups: dict[str, Group]) -> None:
        plain = [g for g in [*self.groups, *self.init_groups] if g in groups and not groups[g].ablate]
        if plain:
            raise KeelError(f"study claim {self.id!r}: group(s) {', '.join(plain)} need ablate = true")
        if bool(self.init_groups) != bool(self.init_optimum_groups):
            raise KeelError(f"study claim {self.id!r}: init_groups and init_optimum_groups come together")

    def tables(self, c: ClaimVerdict) -> list[str]:
        s, b = self.scheme, self.baseline

        def fmt(r: ImportanceRow, what: str, x: str) -> str:
            got, missing = getattr(r, what)[x], (r.missing or {}).get(x, {})
            return "[" + ", ".join(f"s{sd} " + (f"{got[sd]:.3f}" if sd in got else missing[sd])
                                   for sd in sorted({*got, *missing})) + "]"

        lr = lambda x: "optimum not known yet" if x is None else f"{x:g}"
        return condition_tables(
            c, ["sub-layers", f"LR: {b}; {s}", f"redundant share of the shallow half per seed: {b}; {s}",
                f"first two over the median (log10) per seed: {b}; {s}"],
            lambda cc: [[r.sublayers, f"{lr(r.lr[b])}; {lr(r.lr[s])}", f"{fmt(r, 'share', b)}; {fmt(r, 'share', s)}",
                         f"{fmt(r, 'critical', b)}; {fmt(r, 'critical', s)}"] for r in cc.rows or []]) + [
            f"Redundant: removing the sub-layer raises PPL by less than {REDUNDANT_BELOW:.0%}; the shallow "
            f"half: the first {SHALLOW:.0%} of sub-layers. ΔPPL per sub-layer of every ablated run: "
            "report.json (`ablation` of each run), drawn in importance.png."]


def redundant_share(ablation: dict, below: float, share: float) -> float:
    """The share of the first ``share`` fraction of sub-layers (the shallow ones) whose removal
    raises the perplexity by less than ``below`` of the full model's: ``#{i < n·share : ΔPPL_i <
    below · PPL_full} / ⌈n·share⌉`` (Keel paper Appendix A: shallow-layer redundancy)."""
    d = ablation["delta_ppl"]
    k = max(1, math.ceil(len(d) * share))
    return sum(x < below * ablation["ppl_full"] for x in d[:k]) / k


def first_critical(ablation: dict, first: int = 2) -> float:
    """``log10(mean_{i < first} PPL_{-i} / median_i PPL_{-i})`` with ``PPL_{-i} = PPL_full + ΔPPL_i``
    (perplexity without sub-layer i): how much more removing one of the first sub-layers costs
    than removing the median sub-layer (Keel paper Appendix A: the first layers are critical)."""
    ppl = [ablation["ppl_full"] + x for x in ablation["delta_ppl"]]
    return math.log10(statistics.fmean(ppl[:first]) / statistics.median(ppl))





def _importance_condition(study: Study, runs: Runs, claim: LayerImportance, abl: Sequence[str],
                          opt: Sequence[str]) -> Condition:
    """One condition of :meth:`LayerImportance.verdict`: the parts and row of every depth of the ablated
    groups ``abl`` (:func:`_importance_depth`), each scheme at its seed-mean optimum over ``opt``;
    inconclusive while a planned depth has no ablated run or a part has fewer seeds than the study's
    minimum."""
    depths = sorted({r.sublayers for r in runs if r.group in abl})
    parts, rows = {}, []
    for L in depths:
        lrs = {x: seed_mean_optimum(runs, opt, x, L) for x in (claim.scheme, claim.baseline)}
        per = {x: _ablated_at_optimum(runs, abl, opt, x, L) for x in (claim.scheme, claim.baseline)}
        depth_parts, row = _importance_depth(study, claim, per, L, lrs)
        row.missing = {x: m for x in (claim.scheme, claim.baseline)
                       if (m := _missing_seeds(runs, abl, x, L, lrs[x], per[x]))} or None
        parts.update(depth_parts)
        rows.append(row)
    planned = [L for g in study.groups if g.name in abl for L in g.sublayers]
    waiting = unfinished(runs, [*abl, *opt], (claim.scheme, claim.baseline))
    if not rows or sorted(set(planned)) != depths or waits(parts, waiting, study.min_seeds):
        return pending(_pending_why(runs, claim, rows, [*abl, *opt], waiting), parts=parts, rows=rows)
    return Condition(verdict=combine([p.verdict for p in parts.values()]), parts=parts, rows=rows)


def _pending_why(runs: Runs, claim: LayerImportance, rows: list[ImportanceRow], groups: Sequence[str],
                 waiting: int) -> str:
    """Why a condition of :meth:`LayerImportance.verdict` has no verdict yet, in words: no ablated run,
    ``waiting`` unfinished runs of ``groups`` (named), too few ablated seeds, and the seeds whose run at
    the optimum finished without an ablation (stopped early), which no wait will bring."""
    lost = [f"{x} s{sd} at {r.sublayers}" for r in rows for x, m in (r.missing or {}).items()
            for sd, why in m.items() if why == "no ablation"]
    why = ("ablations pending" if waiting else "too few ablated seeds") if rows else "no ablated runs yet"
    if lost:
        return why + f" ({', '.join(lost)}: finished without an ablation, stopped early)"
    if waiting:
        where = [g for g in dict.fromkeys(groups) if unfinished(runs, [g], (claim.scheme, claim.baseline))]
        return why + f" ({waiting} runs of {', '.join(where)} unfinished)"
    return why


def _missing_seeds(runs: Runs, abl: Sequence[str], scheme: str, L: int, lr: float | None,
                   have: dict[int, RunRecord]) -> dict[int, str]:
    """``{seed: why}`` of the seeds of ``scheme`` at ``L`` planned in groups ``abl`` without an
    ablation at the seed-mean optimum ``lr``: ``pending`` (its run at ``lr`` has not finished, or
    ``lr`` is not known yet) or ``no ablation`` (it finished without one: stopped early)."""
    out = {}
    for sd in sorted({r.seed for r in runs if r.group in abl and r.scheme == scheme and r.sublayers == L}):
        if sd in have:
            continue
        at = [r for r in runs if r.group in abl and r.scheme == scheme and r.sublayers == L and r.seed == sd
              and lr is not None and math.isclose(r.lr, lr)]
        out[sd] = "no ablation" if at and all(r.status == "done" for r in at) else "pending"
    return out


def _ablated_at_optimum(runs: Runs, abl: Sequence[str], opt: Sequence[str], scheme: str, L: int) -> dict[int, RunRecord]:
    """``{seed: run record}``: the finished, ablated runs of ``scheme`` at ``L`` sub-layers in groups
    ``abl`` at its seed-mean optimal LR over groups ``opt`` (:func:`seed_mean_optimum`); empty while
    that optimum is unknown."""
    lr = seed_mean_optimum(runs, opt, scheme, L)
    return {r.seed: r for r in runs if r.group in abl and r.scheme == scheme and r.sublayers == L
            and lr is not None and math.isclose(r.lr, lr) and r.status == "done" and r.ablation}


def _importance_depth(study: Study, claim: LayerImportance, per: dict[str, dict[int, RunRecord]],
                      L: int, lrs: dict[str, float | None]) -> tuple[dict, ImportanceRow]:
    """``(parts, row)`` of one depth ``L`` of :meth:`LayerImportance.verdict` from each scheme's ablated
    runs ``per`` (``{scheme: {seed: run record}}``): the paired redundant-share part
    (:func:`redundant_share`, floor ``share_floor``), each scheme's first-two-sub-layers part
    (:func:`first_critical`, floor log10 1.05), and the row of LRs (``lrs``: each scheme's seed-mean
    optimum, known before its runs are ablated), shares, ratios, ΔPPL and full PPL."""
    share = {x: {sd: redundant_share(r.ablation, REDUNDANT_BELOW, SHALLOW) for sd, r in v.items()}
             for x, v in per.items()}
    crit = {x: {sd: first_critical(r.ablation) for sd, r in v.items()} for x, v in per.items()}
    parts = {f"redundant share of the shallow half at {L}: {claim.baseline} − {claim.scheme}":
             paired_verdict(pair(share[claim.baseline], share[claim.scheme]), claim.share_floor,
                            study.min_seeds)}
    for x in (claim.scheme, claim.baseline):
        parts[f"first two sub-layers over the median, {x} at {L} (log10)"] = \
            paired_verdict(crit[x], MAX_LR_FLOOR, study.min_seeds)
    row = ImportanceRow(sublayers=L, lr=dict(lrs),
                        share=share, critical=crit,
                        delta_ppl={x: {sd: r.ablation["delta_ppl"] for sd, r in v.items()} for x, v in per.items()},
                        ppl_full={x: {sd: r.ablation["ppl_full"] for sd, r in v.items()} for x, v in per.items()})
    return parts, row


