"""The verdicts of a study's claims, computed from the finished runs' records
(:class:`keel.experiments.record.RunRecord`) with paired per-seed differences
(:func:`keel.experiments.analysis.paired_verdict`, where the statistics live), one function per
kind of claim (the kinds, with their keys and tables: :mod:`keel.experiments.study.claims`)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from keel.config import load_config, resolve_config_path
from keel.diagnostics.divergence import Thresholds
from keel.experiments.analysis import (INCONCLUSIVE, LEVEL, NOT_REPRODUCED, REPRODUCED, Runs, best_losses,  # noqa: F401
                                       best_lrs, best_run, best_runs, bracketed, cell, loss_floor, lr_window, opt_lrs,
                                       pair, paired_verdict, seed_mean_optimum, t_bounds, trend_verdict)
from keel.experiments.record import RunRecord
from keel.experiments.study.spec import Group, Study
from keel.model import count_parameters

MAX_LR_FLOOR = math.log10(1.05)  # noise floor of a max-LR pair (log10 of the ratio): a 5% difference


def combine(verdicts: Sequence[str]) -> str:
    """All parts reproduced -> reproduced; any part not reproduced -> not reproduced; else inconclusive."""
    if verdicts and all(v == REPRODUCED for v in verdicts):
        return REPRODUCED
    return NOT_REPRODUCED if NOT_REPRODUCED in verdicts else INCONCLUSIVE


def equal_lr_margins(runs: Runs, groups: Sequence[str], scheme: str, baseline: str,
                     min_effect: float, min_seeds: int) -> list[dict]:
    """Per depth and peak LR that both schemes ran, the paired per-seed margin
    ``loss(baseline) - loss(scheme)`` (capped final validation loss, nats/token) at that same
    LR, as a :func:`paired_verdict` dict: how the margin depends on the LR, beside the
    best-LR margin of :func:`claim_margin_grows`. Rows ``{"sublayers", "lr", "margin"}``."""
    def losses(name: str, L: int, lr: float) -> dict:
        return {r.seed: r.capped_loss for r in cell(runs, groups, name, L) if r.lr == lr and r.status == "done"}

    rows = []
    for L in sorted({r.sublayers for r in runs if r.group in groups}):
        for lr in sorted({r.lr for r in runs if r.group in groups and r.sublayers == L}):
            m = pair(losses(baseline, L, lr), losses(scheme, L, lr))
            if m:
                rows.append({"sublayers": L, "lr": lr, "margin": paired_verdict(m, min_effect, min_seeds)})
    return rows


def baseline_margins(study: Study, g: Group, runs: Runs) -> list[dict]:
    """Per depth of group ``g``, scheme of ``g`` and baseline scheme (``g.baselines``, trained by
    group ``g.baselines_from``), the paired per-seed margin ``loss(baseline) - loss(scheme)``
    (nats/token; > 0: ``g``'s scheme is better), each side at its seed's best LR over ``g``'s LR
    grid (:func:`best_losses`; both groups train the same tokens per run), as a
    :func:`paired_verdict` dict. Rows ``{"sublayers", "scheme", "baseline", "margin"}``; empty
    when ``g`` names no baselines."""
    if not g.baselines_from:
        return []
    on_grid = [r for r in runs if any(math.isclose(r.lr, lr) for lr in g.lrs)]
    return [{"sublayers": L, "scheme": s, "baseline": b,
             "margin": paired_verdict(pair(best_losses(on_grid, [g.baselines_from], b, L),
                                            best_losses(on_grid, [g.name], s, L)), study.min_effect, study.min_seeds)}
            for L in g.sublayers for s in g.schemes for b in g.baselines]


WINDOW = 0.1  # nats/token: an LR is in a scheme's healthy window when its seed-mean loss is this close to the best
CONDITIONS = {"paper_init": "at the paper's init", "embed_init": "at N(0, 1) embeddings"}


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


def _margin_row(study: Study, runs: Runs, claim: dict, alts: list[list[str]], L: int) -> dict | None:
    """The row of one depth ``L`` of :func:`_margin_condition` (None without a paired result): the
    paired margin of each seed's best runs over ``alts``, their LR, group, bracketing and plateau exit
    per scheme, each init's healthy-LR window per scheme (:func:`lr_window`), the baseline's flagged
    runs (:func:`_baseline_failures`)."""
    s, b = claim["scheme"], claim["baseline"]
    best = {x: best_over_inits(study, runs, alts, x, L) for x in (b, s)}
    m = pair({sd: r.capped_loss for sd, r in best[b].items()}, {sd: r.capped_loss for sd, r in best[s].items()})
    if not m:
        return None
    return {"sublayers": L, "margin": paired_verdict(m, study.min_effect, study.min_seeds),
            "best_lr": {x: {sd: r.lr for sd, r in best[x].items()} for x in (b, s)},
            "best_group": {x: {sd: r.group for sd, r in best[x].items()} for x in (b, s)},
            "bracketed": {x: {sd: bracketed(runs, r) for sd, r in best[x].items()} for x in (b, s)},
            "plateau_exit": {x: {sd: r.plateau_exit_step for sd, r in best[x].items()} for x in (b, s)},
            "window": {x: {_trained_in(runs, a, x, L): lr_window(runs, a, x, L, WINDOW) for a in alts}
                       for x in (b, s)},
            **_baseline_failures(runs, [g for a in alts for g in a], b, L)}


def _baseline_failures(runs: Runs, groups: list[str], baseline: str, L: int) -> dict:
    """The baseline's finished runs of ``groups`` at ``L`` sub-layers, those the divergence classifier
    flagged, and of these the ones that left the plateau later (:func:`left_plateau_later`), counted:
    ``{"baseline_runs", "baseline_diverged_runs", "baseline_recovered_runs"}``."""
    finished = [r for r in cell(runs, groups, baseline, L) if r.status == "done"]
    failed = [r for r in finished if r.diverged]
    return {"baseline_runs": len(finished), "baseline_diverged_runs": len(failed),
            "baseline_recovered_runs": sum(left_plateau_later(r) for r in failed)}


def _margin_condition(study: Study, runs: Runs, claim: dict, alts: list[list[str]]) -> dict:
    """One condition of a margin claim: the paired margin at every depth, each scheme at each
    seed's best run over ``alts`` (one group list per embedding init), the margin at the deepest
    depth and its trend with depth (:func:`trend_verdict`), combined by :func:`combine`;
    inconclusive while a depth the condition's groups plan has no paired result yet."""
    groups = [g for a in alts for g in a]
    depths = sorted({r.sublayers for r in runs if r.group in groups})
    rows = [row for row in (_margin_row(study, runs, claim, alts, L) for L in depths) if row is not None]
    if len(rows) < 2:
        return {"verdict": INCONCLUSIVE, "why": "needs paired results at two depths at least", "rows": rows,
                "parts": {}}
    hi = rows[-1]
    planned = max((L for g in study.groups if g.name in groups for L in g.sublayers), default=hi["sublayers"])
    where = f"margin at {hi['sublayers']} sub-layers" + (
        f" (the deepest finished; {planned} pending)" if planned > hi["sublayers"] else "")
    trend = trend_verdict({r["sublayers"]: r["margin"]["diffs"] for r in rows}, study.min_effect, study.min_seeds)
    parts = {where: hi["margin"], f"trend over {', '.join(str(r['sublayers']) for r in rows)} sub-layers "
             "(slope per doubling)": trend}
    # a depth still training can overturn either part: no verdict on part of the planned range
    verdict = combine([p["verdict"] for p in parts.values()]) if planned == hi["sublayers"] else INCONCLUSIVE
    return {"verdict": verdict, "parts": parts, "rows": rows}


def claim_margin_grows(study: Study, runs: Runs, claim: dict) -> dict:
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
    conds = {"paper_init": [list(claim["groups"])]}
    if claim.get("init_groups"):
        conds["embed_init"] = [list(claim["init_groups"])]
    out = {k: _margin_condition(study, runs, claim, alts) for k, alts in conds.items()}
    equal = equal_lr_margins(runs, claim["groups"], claim["scheme"], claim["baseline"], study.min_effect,
                             study.min_seeds)
    widen = {g.name: g.widen for g in study.groups if g.name in [*claim["groups"], *claim.get("init_groups", [])]}
    return {"verdict": combine([c["verdict"] for c in out.values()]), "conditions": out, "equal_lr": equal,
            "widen": widen}


def claim_lr_transfer(study: Study, runs: Runs, claim: dict) -> dict:
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
    g = claim["group"]
    depths = sorted({r.sublayers for r in runs if r.group == g})
    rows = _opt_lr_rows(runs, g, depths)
    subject = claim.get("scheme", "keel")
    row = next((r for r in rows if r["scheme"] == subject), None)
    if row is None or len(depths) < 2:
        return {"verdict": INCONCLUSIVE, "why": "needs the scheme's LR grid at two depths", "rows": rows}
    lo, hi = row["opt_lr"][depths[0]], row["opt_lr"][depths[-1]]
    shift = {s: abs(math.log10(hi[s] / lo[s])) for s in sorted(set(lo) & set(hi))}
    if not shift:
        return {"verdict": INCONCLUSIVE, "rows": rows, "why": f"no seed has {subject}'s LR grid finished at both "
                f"{depths[0]} and {depths[-1]} sub-layers"}
    return {"verdict": _transfer_verdict(shift, row["at_edge"], study.min_seeds), "scheme": subject,
            "depths": [depths[0], depths[-1]], "log10_shift": shift, "rows": rows}


def _opt_lr_rows(runs: Runs, group: str, depths: Sequence[int]) -> list[dict]:
    """One row per scheme of ``group`` (in the order of its runs): its per-seed optimal LR at each of
    ``depths`` (:func:`opt_lrs`) and whether any optimum lies on an edge of the LR grid. Rows
    ``{"scheme", "opt_lr": {L: {seed: lr}}, "at_edge"}``."""
    rows = []
    for scheme in dict.fromkeys(r.scheme for r in runs if r.group == group):
        per = {L: opt_lrs(runs, group, scheme, L) for L in depths}
        rows.append({"scheme": scheme, "opt_lr": {L: {s: v[0] for s, v in p.items()} for L, p in per.items()},
                     "at_edge": any(e for p in per.values() for _, e in p.values())})
    return rows


def _transfer_verdict(shift: dict[int, float], at_edge: bool, min_seeds: int) -> str:
    """The rule of :func:`claim_lr_transfer` on the per-seed shifts ``|log10(eta*_deep / eta*_shallow)|``:
    inconclusive with fewer than ``min_seeds`` seeds or an optimum on an edge of the grid; reproduced when
    no seed's optimum moves, not reproduced when every seed's moves; inconclusive otherwise."""
    if len(shift) < min_seeds or at_edge:
        return INCONCLUSIVE
    if all(x < 1e-9 for x in shift.values()):
        return REPRODUCED
    if all(x > 1e-9 for x in shift.values()):
        return NOT_REPRODUCED
    return INCONCLUSIVE


def _log_ratio(hi: float | None, lo: float | None, peak: float) -> float | None:
    """log10(max LR of the scheme expected higher / of the lower one); a run that never diverged
    counts as the peak LR (censored). Two censored runs are no evidence either way: None."""
    if hi is None and lo is None:
        return None
    a, b = (hi if hi is not None else peak), (lo if lo is not None else peak)
    if a <= 0 or b <= 0:
        return math.inf if a > b else (-math.inf if a < b else 0.0)
    return math.log10(a / b)


def left_plateau_later(rec: RunRecord) -> bool:
    """Whether the divergence classifier flagged ``rec`` as a stagnation and the run then left
    the unigram plateau (its :func:`plateau_exit_step` is after the flagged step): a first
    failure the run recovered from, e.g. Pre-LN at 256 sub-layers, flagged at step 221, below
    the plateau from step 617."""
    d = rec.divergence or {}
    left = rec.plateau_exit_step
    return d.get("mode") == "stagnation" and left is not None and left > d.get("step", math.inf)


def verdict_words(rec: RunRecord) -> str:
    """A run's divergence verdict, e.g. "instability from step 875 (LR 0.0437)", "healthy",
    "instability from step 994 (LR 0.0497), a spike still open when the curve ended" (the
    classifier's end-of-curve rule: a weaker verdict than a spike that did not recover within its
    recovery window), or "stagnation from step 221 (LR 0.000905), left the plateau at step 617":
    the classifier reports a run's first failure (here 100 steps on the unigram plateau), and
    :func:`plateau_exit_step` says when the run got below it afterwards."""
    d = rec.divergence or {}
    if not d or d.get("mode") == "healthy":
        return rec.verdict or "no verdict"
    lr = d.get("evidence", {}).get("lr_at_step")
    words = f"{d['mode']} from step {d['step']}" + (f" (LR {lr:.3g})" if lr is not None else "")
    if left_plateau_later(rec):
        words += f", left the plateau at step {rec.plateau_exit_step}"
    return words + (", a spike still open when the curve ended" if d.get("evidence", {}).get("open_at_end") else "")


def claim_max_lr_order(study: Study, runs: Runs, claim: dict) -> dict:
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
    order, sized = claim["order"], {g.name for g in study.groups}
    names = {"paper_ramp": claim["group"]}
    if claim.get("extended_group") in sized:
        names["extended_ramp"] = claim["extended_group"]
    rows = [row for name in names.values() for row in _ramp_rows(runs, name, order)]
    trained = {g.name: set(g.schemes) for g in study.groups}
    conds = {}
    for cond, name in names.items():
        mine = [r for r in rows if r["group"] == name]
        pairs = {}
        for row in mine:
            lr, L = row["max_lr"], row["sublayers"]
            for a, b in zip(order, order[1:]):
                d = {x: _log_ratio(lr[b][x], lr[a][x], row["peak_lr"]) for x in sorted(set(lr[a]) & set(lr[b]))}
                d = {x: v for x, v in d.items() if v is not None}  # both never diverged: censored, left out
                if {a, b} <= trained.get(name, set(order)):
                    pairs[f"{a} < {b} at {L}"] = paired_verdict(d, MAX_LR_FLOOR, study.min_seeds)
        conds[cond] = {"verdict": combine([p["verdict"] for p in pairs.values()]) if pairs else INCONCLUSIVE,
                       "parts": pairs, "peak_lr": mine[0]["peak_lr"] if mine else None,
                       **({} if pairs else {"why": "no finished ramp runs"})}
    return {"verdict": conds["paper_ramp"]["verdict"], "conditions": conds, "rows": rows}


def _ramp_rows(runs: Runs, group: str, order: Sequence[str]) -> list[dict]:
    """One row per depth of ramp ``group``'s finished runs: its peak LR, each scheme's max LR per
    seed, each run's verdict in words."""
    rr = [r for r in runs if r.group == group and r.status == "done"]
    peak = max([r.peak_lr for r in rr] or [0.0])
    rows = []
    for L in sorted({r.sublayers for r in rr}):
        at = [r for r in rr if r.sublayers == L]
        lr = {s: {r.seed: r.max_lr for r in at if r.scheme == s} for s in order}
        detail = {f"{r.scheme} s{r.seed}": verdict_words(r) for s in order for r in at if r.scheme == s}
        rows.append({"group": group, "peak_lr": peak, "sublayers": L, "max_lr": lr, "verdicts": detail})
    return rows





# ----------------------------------------------------------------------------- claims (e)-(i) of study v5
def _conditions(claim: dict, paper: str, init: str) -> dict[str, list[str]]:
    """``{condition: groups}``: the claim's ``paper`` groups at the paper's init and, when it names
    them, its ``init`` groups (both schemes at the other embedding init: :data:`CONDITIONS`)."""
    conds = {"paper_init": list(claim[paper])}
    if claim.get(init):
        conds["embed_init"] = list(claim[init])
    return conds


def _judged(conds: dict[str, dict]) -> dict:
    """A claim's verdict dict over its conditions: reproduced only where every condition is."""
    return {"verdict": combine([c["verdict"] for c in conds.values()]), "conditions": conds}


def _pending(why: str, **rest) -> dict:
    return {"verdict": INCONCLUSIVE, "why": why, "parts": {}, **rest}


def group_tokens(runs: Runs, group: str) -> int | None:
    """Tokens per run of ``group`` (its finished runs' ``tokens``), None before one finished."""
    return next((r.tokens for r in runs if r.group == group and r.status == "done" and r.tokens), None)


def non_embedding_params(study: Study, group: str, scheme: str, sublayers: int) -> int:
    """Non-embedding parameters (:func:`keel.model.count_parameters`) of ``scheme`` at
    ``sublayers`` with group ``group``'s config (the scale's keys, its own ``set``)."""
    g = next(x for x in study.groups if x.name == group)
    cfg = load_config(resolve_config_path(study.base),
                      study.all_sets(g) + [("model.residual", scheme), ("model.n_layers", sublayers // 2)])
    return count_parameters(cfg.model, non_embedding=True)


def _budget_condition(study: Study, runs: Runs, claim: dict, groups: list[str]) -> dict:
    """One condition of claim (e): per budget group the paired margin at ``claim['sublayers']``,
    the margin at the largest budget and its slope against log2(tokens)."""
    s, b = claim["scheme"], claim["baseline"]
    L = one_depth(study, groups[0])
    rows = []
    for g in groups:
        tokens = group_tokens(runs, g)
        best = {x: best_runs(runs, [g], x, L) for x in (b, s)}
        m = pair({sd: r.capped_loss for sd, r in best[b].items()}, {sd: r.capped_loss for sd, r in best[s].items()})
        if tokens is None or not m:
            continue
        rows.append({"group": g, "tokens": tokens, "margin": paired_verdict(m, study.min_effect, study.min_seeds),
                     "tokens_per_param": {x: tokens / non_embedding_params(study, g, x, L) for x in (b, s)},
                     "best_lr": {x: {sd: r.lr for sd, r in best[x].items()} for x in (b, s)},
                     "bracketed": {x: {sd: bracketed(runs, r) for sd, r in best[x].items()} for x in (b, s)}})
    rows.sort(key=lambda r: r["tokens"])
    if len(rows) < len(groups):
        return _pending(f"{len(rows)} of {len(groups)} token budgets finished", rows=rows)
    trend = trend_verdict({r["tokens"]: r["margin"]["diffs"] for r in rows}, study.min_effect, study.min_seeds)
    parts = {f"margin at {rows[-1]['tokens']:,} tokens": rows[-1]["margin"],
             "trend over " + ", ".join(f"{r['tokens']:,}" for r in rows) + " tokens (slope per doubling)": trend}
    return {"verdict": combine([p["verdict"] for p in parts.values()]), "parts": parts, "rows": rows}


def one_depth(study: Study, group: str) -> int:
    """The one depth (sub-layers) group ``group`` trains (claims (e) and (f) read one per group)."""
    return next(g.sublayers[0] for g in study.groups if g.name == group)


def claim_data_scaling(study: Study, runs: Runs, claim: dict) -> dict:
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
    return _judged({k: _budget_condition(study, runs, claim, gs)
                    for k, gs in _conditions(claim, "budgets", "init_budgets").items()})


def claim_deep_vs_wide(study: Study, runs: Runs, claim: dict) -> dict:
    """{scheme} at the deep shape beats {baseline} at the deep shape and {baseline} at the wide
    shape of equal parameters (both parts must hold), at the paper's init and with both schemes
    at N(0, 1) embeddings.

    Per seed ``m = best(baseline, shape) - best(scheme, deep)`` (nats/token, each at its seed's
    best LR over its group's LRs), :func:`paired_verdict` per part; groups ``deep``/``wide`` (and
    ``init_deep``/``init_wide``), each at the one depth it trains. Keel paper Table 5:
    at ~3B parameters Keel deep 55.5, Pre-LN deep 52.3, Pre-LN wide 52.2 (benchmark average)."""
    s, b = claim["scheme"], claim["baseline"]
    conds = {}
    for k, (deep, wide) in {"paper_init": (claim["deep"], claim["wide"]),
                            **({"embed_init": (claim["init_deep"], claim["init_wide"])}
                               if claim.get("init_deep") else {})}.items():
        Ld, Lw = one_depth(study, deep), one_depth(study, wide)
        cells = {(x, shape): best_runs(runs, [g], x, L) for x in (s, b)
                 for shape, g, L in (("deep", deep, Ld), ("wide", wide, Lw))}
        loss = {c: {sd: r.capped_loss for sd, r in v.items()} for c, v in cells.items()}
        parts = {f"{b} deep ({Ld}) − {s} deep": pair(loss[(b, "deep")], loss[(s, "deep")]),
                 f"{b} wide ({Lw}) − {s} deep": pair(loss[(b, "wide")], loss[(s, "deep")])}
        parts = {n: paired_verdict(m, study.min_effect, study.min_seeds) for n, m in parts.items()}
        done = all(p["n"] >= study.min_seeds for p in parts.values())
        conds[k] = {"verdict": combine([p["verdict"] for p in parts.values()]) if done else INCONCLUSIVE,
                    "parts": parts, "groups": [deep, wide],
                    "params": {f"{x} {shape}": non_embedding_params(study, g, x, L) for x in (s, b)
                               for shape, g, L in (("deep", deep, Ld), ("wide", wide, Lw))},
                    "cells": {f"{x} {shape}": {"loss": loss[(x, shape)],
                                               "lr": {sd: r.lr for sd, r in cells[(x, shape)].items()},
                                               "bracketed": {sd: bracketed(runs, r) for sd, r in cells[(x, shape)].items()}}
                              for x, shape in cells}}
    return _judged(conds)


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


def claim_layer_importance(study: Study, runs: Runs, claim: dict) -> dict:
    """{scheme}'s shallow sub-layers are less redundant than {baseline}'s, and the first two
    sub-layers of both are critical (every part must hold), at every depth of the ablated groups,
    at the paper's init and with both schemes at N(0, 1) embeddings.

    Each scheme's run per seed at its seed-mean optimal LR (:func:`seed_mean_optimum` over
    ``optimum_groups``, ``init_optimum_groups``), ablated (``groups``, ``init_groups``: groups
    with ``ablate = true``; ΔPPL_i per sub-layer, Keel paper Appendix A). Metrics fixed before
    any ablation was read: the redundant share of the shallow half (:func:`redundant_share`: ΔPPL
    below 1% of the full PPL), paired ``d = share(baseline) - share(scheme)`` with floor
    ``share_floor``; and per scheme the first-two-sub-layers ratio (:func:`first_critical`,
    log10), one-sample with floor log10 1.05 (5%)."""
    conds = {"paper_init": (claim["groups"], claim["optimum_groups"]),
             **({"embed_init": (claim["init_groups"], claim["init_optimum_groups"])} if claim.get("init_groups") else {})}
    return _judged({k: _importance_condition(study, runs, claim, abl, opt) for k, (abl, opt) in conds.items()})


def _importance_condition(study: Study, runs: Runs, claim: dict, abl: Sequence[str], opt: Sequence[str]) -> dict:
    """One condition of :func:`claim_layer_importance`: the parts and row of every depth of the ablated
    groups ``abl`` (:func:`_importance_depth`), each scheme at its seed-mean optimum over ``opt``;
    inconclusive while a planned depth has no ablated run or a part has fewer seeds than the study's
    minimum."""
    depths = sorted({r.sublayers for r in runs if r.group in abl})
    parts, rows = {}, []
    for L in depths:
        per = {x: _ablated_at_optimum(runs, abl, opt, x, L) for x in (claim["scheme"], claim["baseline"])}
        depth_parts, row = _importance_depth(study, claim, per, L)
        parts.update(depth_parts)
        rows.append(row)
    planned = [L for g in study.groups if g.name in abl for L in g.sublayers]
    if not rows or sorted(set(planned)) != depths or any(p["n"] < study.min_seeds for p in parts.values()):
        return {**_pending("ablations pending" if rows else "no ablated runs yet"), "parts": parts, "rows": rows}
    return {"verdict": combine([p["verdict"] for p in parts.values()]), "parts": parts, "rows": rows}


def _ablated_at_optimum(runs: Runs, abl: Sequence[str], opt: Sequence[str], scheme: str, L: int) -> dict[int, RunRecord]:
    """``{seed: run record}``: the finished, ablated runs of ``scheme`` at ``L`` sub-layers in groups
    ``abl`` at its seed-mean optimal LR over groups ``opt`` (:func:`seed_mean_optimum`); empty while
    that optimum is unknown."""
    lr = seed_mean_optimum(runs, opt, scheme, L)
    return {r.seed: r for r in runs if r.group in abl and r.scheme == scheme and r.sublayers == L
            and lr is not None and math.isclose(r.lr, lr) and r.status == "done" and r.ablation}


def _importance_depth(study: Study, claim: dict, per: dict[str, dict[int, RunRecord]], L: int) -> tuple[dict, dict]:
    """``(parts, row)`` of one depth ``L`` of :func:`claim_layer_importance` from each scheme's ablated
    runs ``per`` (``{scheme: {seed: run record}}``): the paired redundant-share part
    (:func:`redundant_share`, floor ``share_floor``), each scheme's first-two-sub-layers part
    (:func:`first_critical`, floor log10 1.05), and the row of LRs, shares, ratios, ΔPPL and full PPL."""
    share = {x: {sd: redundant_share(r.ablation, REDUNDANT_BELOW, SHALLOW) for sd, r in v.items()}
             for x, v in per.items()}
    crit = {x: {sd: first_critical(r.ablation) for sd, r in v.items()} for x, v in per.items()}
    parts = {f"redundant share of the shallow half at {L}: {claim['baseline']} − {claim['scheme']}":
             paired_verdict(pair(share[claim["baseline"]], share[claim["scheme"]]), claim.get("share_floor", 0.05),
                            study.min_seeds)}
    for x in (claim["scheme"], claim["baseline"]):
        parts[f"first two sub-layers over the median, {x} at {L} (log10)"] = \
            paired_verdict(crit[x], MAX_LR_FLOOR, study.min_seeds)
    row = {"sublayers": L, "lr": {x: next((r.lr for r in v.values()), None) for x, v in per.items()},
           "share": share, "critical": crit,
           "delta_ppl": {x: {sd: r.ablation["delta_ppl"] for sd, r in v.items()} for x, v in per.items()},
           "ppl_full": {x: {sd: r.ablation["ppl_full"] for sd, r in v.items()} for x, v in per.items()}}
    return parts, row


REDUNDANT_BELOW = 0.01  # a sub-layer is redundant when removing it raises the PPL by less than 1%
SHALLOW = 0.5  # the shallow sub-layers: the first half


def claim_early_spike(study: Study, runs: Runs, claim: dict) -> dict:
    """At the LRs where {scheme} trains healthily, {baseline} spikes early and {scheme} does not:
    {baseline}'s largest early spike exceeds {scheme}'s.

    Per run the largest rise of the 10-step trailing-mean training loss over its earlier minimum
    in the first 1,000 steps (:func:`keel.experiments.study.records.early_spike`, nats/token;
    the rule was fixed before any run was read). Per depth and seed ``d = mean over the LRs where
    {scheme}'s run is healthy (divergence classifier) of spike(baseline) - spike(scheme)``;
    :func:`paired_verdict` with the study's loss floor. Keel paper Figure 1a/4: Pre-LN spikes at
    4.5e-3 in the first 1,000 steps at 1024 sub-layers, Keel converges smoothly."""
    s, b, g = claim["scheme"], claim["baseline"], claim["group"]
    rs = [r for r in runs if r.group == g and r.status == "done" and r.early_spike is not None]
    seeds = sorted({r.seed for r in runs if r.group == g})
    parts, rows = {}, []
    for L in sorted({r.sublayers for r in runs if r.group == g}):
        at = {(r.scheme, r.seed, r.lr): r for r in rs if r.sublayers == L}
        parts[f"spike({b}) − spike({s}) at {L}, {s}'s healthy LRs"] = paired_verdict(
            _spike_diffs(at, seeds, s, b), study.min_effect, study.min_seeds)
        rows += _spike_rows(at, L, s, b)
    planned = sum(len(gr.scheme_seeds(x)) * len(gr.sublayers) * len(gr.lrs) for gr in study.groups if gr.name == g
                  for x in (s, b))
    if len([r for r in rs if r.scheme in (s, b)]) < planned:
        return {**_pending(f"{len(rs)} of {planned} runs with every step's loss finished"), "parts": parts, "rows": rows}
    return {"verdict": combine([p["verdict"] for p in parts.values()]), "parts": parts, "rows": rows}


def _spike_diffs(at: dict[tuple, RunRecord], seeds: Sequence[int], scheme: str, baseline: str) -> dict[int, float]:
    """``{seed: d}`` of one depth of :func:`claim_early_spike` from its runs ``at`` (keyed ``(scheme, seed,
    lr)``): ``d`` the mean over the LRs where ``scheme``'s run is healthy and ``baseline`` ran too of
    spike(baseline) - spike(scheme); a seed with no such LR is left out."""
    diffs = {}
    for sd in seeds:
        ok = [lr for (x, seed, lr), r in at.items() if x == scheme and seed == sd and r.verdict == "healthy"
              and (baseline, sd, lr) in at]
        if ok:
            diffs[sd] = statistics.fmean(at[(baseline, sd, lr)].early_spike - at[(scheme, sd, lr)].early_spike
                                         for lr in ok)
    return diffs


def _spike_rows(at: dict[tuple, RunRecord], L: int, scheme: str, baseline: str) -> list[dict]:
    """The rows of one depth ``L`` of :func:`claim_early_spike`, one per LR of its runs ``at`` (keyed
    ``(scheme, seed, lr)``): per scheme ``{seed: (early spike, divergence verdict)}``."""
    return [{"sublayers": L, "lr": lr, **{x: {k[1]: (r.early_spike, r.verdict) for k, r in at.items()
                                              if k[0] == x and k[2] == lr} for x in (scheme, baseline)}}
            for lr in sorted({k[2] for k in at})]


def claim_bench(study: Study, runs: Runs, claim: dict) -> dict:
    """Each residual design of the bench beats {baseline} at the bench's depth (every part must
    hold), at the paper's init and with every scheme at N(0, 1) embeddings; each is also
    compared with Keel (reported, not part of the verdict).

    Per design X and seed ``m = best(baseline) - best(X)`` (nats/token, each at its seed's best
    LR over the bench group's LRs; the baseline trained by its ``baselines_from`` group at the
    same LRs, seeds and tokens: :func:`baseline_margins`), :func:`paired_verdict` with the study's
    loss floor. The claim of each design's own paper (Peri-LN, Hyper-Connections, mHC, AttnRes:
    better than Pre-LN), not of the Keel paper."""
    conds = {}
    for k, gname in {"paper_init": claim["group"], **({"embed_init": claim["init_group"]}
                                                       if claim.get("init_group") else {})}.items():
        g = next(x for x in study.groups if x.name == gname)
        rows = baseline_margins(study, g, runs)
        rows = [r for r in rows if r["scheme"] in claim["designs"]]
        parts = {f"{r['baseline']} − {r['scheme']} at {r['sublayers']}": r["margin"] for r in rows
                 if r["baseline"] == claim["baseline"]}
        done = parts and all(p["n"] >= study.min_seeds for p in parts.values())
        conds[k] = {"verdict": combine([p["verdict"] for p in parts.values()]) if done else INCONCLUSIVE,
                    "parts": parts, "rows": rows, **({} if done else {"why": "bench runs pending"})}
    return _judged(conds)


# ----------------------------------------------------------------------------- the looped family (study looped)
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


def _max_lr_row(study: Study, runs: Runs, groups: list[str], scheme: str, baseline: str, L: int) -> dict:
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
    return {"sublayers": L, "max_lr": per, "neither": neither, "seeds": len(seeds),
            "d": paired_verdict(d, MAX_LR_FLOOR, study.min_seeds)}


def _max_lr_condition(study: Study, runs: Runs, claim: dict, groups: list[str]) -> dict:
    """One condition of :func:`claim_loop_max_lr`: a part per judged depth, a row per depth."""
    s, b = claim["scheme"], claim["baseline"]
    parts, rows = {}, []
    for L in sorted({r.sublayers for r in runs if r.group in groups}):
        rows.append(_max_lr_row(study, runs, groups, s, b, L))
        if not rows[-1]["neither"]:
            parts[f"log10 max LR, {s} over {b} at {L}"] = rows[-1]["d"]
    gs = [g for g in study.groups if g.name in groups]
    planned = sorted({L for g in gs for L in g.sublayers})
    both = set.intersection(*({sd for g in gs for sd in g.scheme_seeds(x)} for x in (s, b))) if gs else set()
    finished = [r["sublayers"] for r in rows if r["seeds"] >= len(both)]  # every seed of both schemes
    if finished != planned or not parts:
        return _pending("neither scheme trains at any depth" if finished == planned
                        else "a depth of the LR grid is not finished", parts=parts, rows=rows)
    return {"verdict": combine([p["verdict"] for p in parts.values()]), "parts": parts, "rows": rows}


def claim_loop_max_lr(study: Study, runs: Runs, claim: dict) -> dict:
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
    return _judged({k: _max_lr_condition(study, runs, claim, gs)
                    for k, gs in _conditions(claim, "groups", "init_groups").items()})


def loop_losses(rec: RunRecord, repeats: int) -> dict[int, float]:
    """``{R': validation loss}`` of a looped run (nats/token): its ``test_loops`` and, at its trained
    ``repeats`` R, its capped final loss; a non-finite loss counts as the step-0 loss (as ``capped_loss``)."""
    out = {int(n): x if x is not None else rec.first_val_loss for n, x in (rec.test_loops or {}).items()}
    return {**out, repeats: rec.capped_loss}


NON_INFERIOR = {REPRODUCED: NOT_REPRODUCED, NOT_REPRODUCED: REPRODUCED}  # a paired verdict read the other way


def _test_depth_condition(study: Study, runs: Runs, claim: dict, groups: list[str]) -> dict:
    """One condition of :func:`claim_test_depth`: per depth, d per R' of both schemes at each seed's best LR."""
    s, b, f = claim["scheme"], claim["baseline"], claim.get("factor", 2.0)
    gs = [g for g in study.groups if g.name in groups]
    parts, rows = {}, []
    for L in sorted({L for g in gs for L in g.sublayers}):
        R, counts = gs[0].loop_repeats(L), gs[0].test_counts(L)
        loss = {x: {sd: loop_losses(r, R) for sd, r in best_runs(runs, groups, x, L).items()} for x in (s, b)}
        d = {x: {n: {sd: v[n] - v[R] for sd, v in loss[x].items() if n in v} for n in counts} for x in (s, b)}
        rows.append({"sublayers": L, "loops": R,
                     "d": {x: {n: paired_verdict(v, study.min_effect, study.min_seeds) for n, v in d[x].items()}
                           for x in (s, b)},
                     "vs": {n: paired_verdict(pair(d[s][n], d[b][n]), study.min_effect, study.min_seeds)
                            for n in counts}})
        v = rows[-1]["d"][s].get(round(f * R))
        if v is not None:
            parts[f"loss({round(f * R)}) − loss({R}), {s} at {L}"] = {**v, "verdict": NON_INFERIOR.get(
                v["verdict"], INCONCLUSIVE)}
    if not parts or any(p["n"] < study.min_seeds for p in parts.values()):
        return _pending("runs with test loops pending", parts=parts, rows=rows)
    return {"verdict": combine([p["verdict"] for p in parts.values()]), "parts": parts, "rows": rows}


def claim_test_depth(study: Study, runs: Runs, claim: dict) -> dict:
    """More loops at test time do not hurt {scheme} (reported beside {baseline}): at every effective depth,
    its validation loss with the core applied 2R times is not worse than at the trained R by the floor or
    more (every depth must hold), at the paper's init and with both schemes at N(0, 1) embeddings.

    Per depth and seed, the run at that seed's best LR (:func:`best_runs`; groups with ``test_loops``) and
    ``d = loss(R') − loss(R)`` (nats/token; R' = round(f R) on the windows of its final validation loss, a
    non-finite loss counted as the step-0 loss). Per depth the part is :func:`paired_verdict` of d at
    R' = 2R (the claim's ``factor``) with the study's floor f, read as non-inferiority: reproduced when its
    upper bound hi < f, not reproduced when its lower bound lo >= f (more loops cost at least f),
    inconclusive otherwise. Reported, not judged: d at every R' the groups test (R/2 too) for {scheme}
    and {baseline}, and d({scheme}) − d({baseline}) paired per seed."""
    return _judged({k: _test_depth_condition(study, runs, claim, gs)
                    for k, gs in _conditions(claim, "groups", "init_groups").items()})
