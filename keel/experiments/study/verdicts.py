"""The verdicts of a study's claims, computed from the finished runs' records with
paired per-seed differences (:func:`paired_verdict`), one function per kind of claim (the kinds,
with their keys and tables: :mod:`keel.experiments.study.claims`)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from keel.config import load_config, resolve_config_path
from keel.experiments.study.spec import Group, Study
from keel.model import count_parameters

REPRODUCED, NOT_REPRODUCED, INCONCLUSIVE = "reproduced", "not reproduced", "inconclusive"
MAX_LR_FLOOR = math.log10(1.05)  # noise floor of a max-LR pair (log10 of the ratio): a 5% difference
LEVEL = 0.95  # confidence of each one-sided bound of a paired interval (together: a two-sided 90% interval)


def t_bounds(xs: Sequence[float], level: float = LEVEL) -> tuple[float, float] | None:
    """One-sided Student-t bounds of the mean of ``xs``: ``(lo, hi)`` with
    ``lo = mean - t_{level, n-1} * sd / sqrt(n)`` and ``hi = mean + t_{level, n-1} * sd / sqrt(n)``
    (``sd`` with ddof 1; Student 1908, the paired t interval): each bound holds with probability
    ``level`` when the ``xs`` are independent draws of a normal difference. None for fewer than two."""
    n = len(xs)
    if n < 2:
        return None
    from scipy.stats import t  # the t quantile; imported here, where the study needs it
    half = float(t.ppf(level, n - 1)) * statistics.stdev(xs) / math.sqrt(n)
    mean = statistics.fmean(xs)
    return mean - half, mean + half


def paired_verdict(diffs: dict, min_effect: float, min_seeds: int = 3, level: float = LEVEL) -> dict:
    """The verdict of one paired comparison, oriented so that the claim predicts ``d > 0``.

    ``diffs``: ``{seed: d_seed}`` (nats/token, or any unit ``min_effect`` is in), one per seed
    that both sides finished (paired: same seed = same init draws and data order). With
    ``(lo, hi)`` the one-sided ``level`` t bounds of the mean difference (:func:`t_bounds`):

    * ``reproduced``: at least ``min_seeds`` seeds and ``lo >= min_effect`` (the effect clears
      the floor);
    * ``not reproduced``: at least ``min_seeds`` seeds and ``hi < min_effect`` (the interval
      excludes an effect as large as the floor: the opposite, or no effect);
    * ``inconclusive``: anything else (the interval straddles the floor, or too few seeds).

    Returns ``{verdict, n, mean, sd, lo, hi, level, diffs, min_effect}`` (``sd`` the sample
    standard deviation, ddof 1; 0 for one seed; ``mean``/``sd`` None without seeds; ``lo``/``hi``
    None below two seeds).
    """
    xs = [float(x) for x in diffs.values() if x is not None and math.isfinite(x)]
    n = len(xs)
    mean = statistics.fmean(xs) if xs else None
    sd = (statistics.stdev(xs) if n > 1 else 0.0) if xs else None
    lo, hi = t_bounds(xs, level) or (None, None)
    if n < max(2, min_seeds):
        verdict = INCONCLUSIVE
    elif lo >= min_effect:
        verdict = REPRODUCED
    elif hi < min_effect:
        verdict = NOT_REPRODUCED
    else:
        verdict = INCONCLUSIVE
    return {"verdict": verdict, "n": n, "mean": mean, "sd": sd, "lo": lo, "hi": hi, "level": level,
            "diffs": dict(diffs), "min_effect": min_effect}


def trend_verdict(margins: dict[int, dict], min_effect: float, min_seeds: int = 3) -> dict:
    """Whether a paired margin grows with depth, from every depth (not two endpoints).

    ``margins``: ``{sub-layers: {seed: margin}}``. Per seed that has a margin at every depth, the
    least-squares slope of its margin against ``log2(sub-layers)`` (nats per doubling of depth);
    the verdict is :func:`paired_verdict` of those slopes with the floor spread over the studied
    range, ``min_effect / log2(L_max / L_min)`` (the fitted growth from the shallowest to the
    deepest depth must clear ``min_effect``). Fewer than two depths: inconclusive, no seeds.
    Returns the :func:`paired_verdict` dict plus ``depths``.
    """
    depths = sorted(margins)
    seeds = sorted(set.intersection(*(set(m) for m in margins.values()))) if depths else []
    slopes = {}
    if len(depths) >= 2:
        xs = [math.log2(L) for L in depths]
        mx = statistics.fmean(xs)
        for sd in seeds:
            ys = [margins[L][sd] for L in depths]
            my = statistics.fmean(ys)
            slopes[sd] = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    floor = min_effect / math.log2(depths[-1] / depths[0]) if len(depths) >= 2 else min_effect
    return {**paired_verdict(slopes, floor, min_seeds), "depths": depths}


def loss_floor(runs: Sequence[dict], cells: Sequence[tuple[Sequence[str], str, int]], minimum: float) -> dict:
    """The noise floor of the loss claims, from the measured seed-to-seed spread.

    ``cells``: ``(groups, scheme, sub-layers)`` whose best loss a verdict reads. Per cell with at
    least two finished seeds, the sample sd of the best loss over seeds (:func:`best_losses`);
    the floor is their median, and at least ``minimum`` (nats/token): a difference smaller than
    the typical seed-to-seed spread of one configuration's best loss is not counted as an effect.
    Returns ``{floor, median_sd, cells, min_sd, max_sd, minimum}``.
    """
    sds = []
    for groups, scheme, L in cells:
        b = list(best_losses(runs, groups, scheme, L).values())
        if len(b) >= 2:
            sds.append(statistics.stdev(b))
    med = statistics.median(sds) if sds else None
    return {"floor": max(minimum, med or 0.0), "median_sd": med, "cells": len(sds),
            "min_sd": min(sds, default=None), "max_sd": max(sds, default=None), "minimum": minimum}


def combine(verdicts: Sequence[str]) -> str:
    """All parts reproduced -> reproduced; any part not reproduced -> not reproduced; else inconclusive."""
    if verdicts and all(v == REPRODUCED for v in verdicts):
        return REPRODUCED
    return NOT_REPRODUCED if NOT_REPRODUCED in verdicts else INCONCLUSIVE


def best_runs(runs: Sequence[dict], groups: Sequence[str], scheme: str, sublayers: int) -> dict:
    """``{seed: run record}`` of ``scheme`` at ``sublayers`` over the runs of ``groups``: per seed,
    the run with the lowest capped final validation loss (each seed's best LR; a run without a
    finite final loss counts as its step-0 loss: ``capped_loss`` of
    :func:`keel.experiments.study.records.run_record`). Seeds with an unfinished LR are left out."""
    out = {}
    for seed in sorted({r["seed"] for r in runs}):
        rs = [r for r in runs if r["group"] in groups and r["scheme"] == scheme and r["sublayers"] == sublayers
              and r["seed"] == seed]
        if rs and all(r["status"] == "done" for r in rs):
            out[seed] = min(rs, key=lambda r: r["capped_loss"])
    return out


def best_losses(runs: Sequence[dict], groups: Sequence[str], scheme: str, sublayers: int) -> dict:
    """``{seed: best capped final validation loss}`` (nats/token) of :func:`best_runs`."""
    return {seed: r["capped_loss"] for seed, r in best_runs(runs, groups, scheme, sublayers).items()}


def best_lrs(runs: Sequence[dict], groups: Sequence[str], scheme: str, sublayers: int) -> dict:
    """``{seed: peak LR}`` of :func:`best_runs`: where each seed's best loss came from."""
    return {seed: r["lr"] for seed, r in best_runs(runs, groups, scheme, sublayers).items()}


def equal_lr_margins(runs: Sequence[dict], groups: Sequence[str], scheme: str, baseline: str,
                     min_effect: float, min_seeds: int) -> list[dict]:
    """Per depth and peak LR that both schemes ran, the paired per-seed margin
    ``loss(baseline) - loss(scheme)`` (capped final validation loss, nats/token) at that same
    LR, as a :func:`paired_verdict` dict: how the margin depends on the LR, beside the
    best-LR margin of :func:`claim_margin_grows`. Rows ``{"sublayers", "lr", "margin"}``."""
    def losses(name: str, L: int, lr: float) -> dict:
        return {r["seed"]: r["capped_loss"] for r in runs if r["group"] in groups and r["scheme"] == name
                and r["sublayers"] == L and r["lr"] == lr and r["status"] == "done"}

    rows = []
    for L in sorted({r["sublayers"] for r in runs if r["group"] in groups}):
        for lr in sorted({r["lr"] for r in runs if r["group"] in groups and r["sublayers"] == L}):
            m = _pair(losses(baseline, L, lr), losses(scheme, L, lr))
            if m:
                rows.append({"sublayers": L, "lr": lr, "margin": paired_verdict(m, min_effect, min_seeds)})
    return rows


def baseline_margins(study: Study, g: Group, runs: Sequence[dict]) -> list[dict]:
    """Per depth of group ``g``, scheme of ``g`` and baseline scheme (``g.baselines``, trained by
    group ``g.baselines_from``), the paired per-seed margin ``loss(baseline) - loss(scheme)``
    (nats/token; > 0: ``g``'s scheme is better), each side at its seed's best LR over ``g``'s LR
    grid (:func:`best_losses`; both groups train the same tokens per run), as a
    :func:`paired_verdict` dict. Rows ``{"sublayers", "scheme", "baseline", "margin"}``; empty
    when ``g`` names no baselines."""
    if not g.baselines_from:
        return []
    on_grid = [r for r in runs if any(math.isclose(r["lr"], lr) for lr in g.lrs)]
    return [{"sublayers": L, "scheme": s, "baseline": b,
             "margin": paired_verdict(_pair(best_losses(on_grid, [g.baselines_from], b, L),
                                            best_losses(on_grid, [g.name], s, L)), study.min_effect, study.min_seeds)}
            for L in g.sublayers for s in g.schemes for b in g.baselines]


def _pair(a: dict, b: dict) -> dict:
    """``{seed: a - b}`` over the seeds both have."""
    return {s: a[s] - b[s] for s in sorted(set(a) & set(b))}


WINDOW = 0.1  # nats/token: an LR is in a scheme's healthy window when its seed-mean loss is this close to the best
CONDITIONS = {"paper_init": "at the paper's init", "embed_init": "at N(0, 1) embeddings"}


def best_over_inits(study: Study, runs: Sequence[dict], alts: Sequence[Sequence[str]], scheme: str,
                    sublayers: int) -> dict:
    """``{seed: run record}``: per seed, the best run (lowest capped loss) of ``scheme`` at
    ``sublayers`` over alternatives ``alts`` (each a list of groups: one embedding init). An
    alternative whose groups are sized at that depth is required: a seed counts only when every
    required alternative has all its LRs finished (:func:`best_runs`)."""
    need = [a for a in alts if any(g.name in a and sublayers in g.sublayers and scheme in g.schemes
                                   for g in study.groups)]
    per = [best_runs(runs, a, scheme, sublayers) for a in need]
    seeds = set.intersection(*(set(p) for p in per)) if per else set()
    return {sd: min((p[sd] for p in per), key=lambda r: r["capped_loss"]) for sd in sorted(seeds)}


def bracketed(runs: Sequence[dict], rec: dict) -> bool:
    """Whether run ``rec`` (a seed's best) lies strictly inside the LRs its scheme trained at its
    depth, seed and group: its optimum is bracketed (a lower and a higher LR were trained and
    ended worse, diverged or stagnated)."""
    lrs = [x["lr"] for x in runs if (x["group"], x["scheme"], x["sublayers"], x["seed"])
           == (rec["group"], rec["scheme"], rec["sublayers"], rec["seed"])]
    return min(lrs) < rec["lr"] < max(lrs)


def lr_window(runs: Sequence[dict], groups: Sequence[str], scheme: str, sublayers: int,
              margin: float = WINDOW) -> list[float]:
    """The healthy-LR window of ``scheme`` at ``sublayers`` in ``groups``: the peak LRs whose
    seed-mean capped loss (over the seeds that finished every LR) is within ``margin`` nats/token
    of the best seed-mean loss, ascending. Empty while no seed has every LR finished."""
    rs = [r for r in runs if r["group"] in groups and r["scheme"] == scheme and r["sublayers"] == sublayers]
    lrs = sorted({r["lr"] for r in rs})
    seeds = [sd for sd in sorted({r["seed"] for r in rs})
             if sorted(r["lr"] for r in rs if r["seed"] == sd and r["status"] == "done") == lrs]
    if not seeds:
        return []
    mean = {lr: statistics.fmean(r["capped_loss"] for r in rs if r["lr"] == lr and r["seed"] in seeds) for lr in lrs}
    best = min(mean.values())
    return [lr for lr in lrs if mean[lr] <= best + margin]


def _trained_in(runs: Sequence[dict], groups: Sequence[str], scheme: str, sublayers: int) -> str:
    """The first of ``groups`` holding a run of ``scheme`` at ``sublayers`` (else the first group): the
    name a table gives that init's LR window at that depth (e.g. ``transfer`` at 256, not ``lr-grid``)."""
    return next((g for g in groups if any(r["group"] == g and r["scheme"] == scheme and r["sublayers"] == sublayers
                                          for r in runs)), groups[0])


def _margin_condition(study: Study, runs: list[dict], claim: dict, alts: list[list[str]]) -> dict:
    """One condition of a margin claim: the paired margin at every depth, each scheme at each
    seed's best run over ``alts`` (one group list per embedding init), the margin at the deepest
    depth and its trend with depth (:func:`trend_verdict`), combined by :func:`combine`;
    inconclusive while a depth the condition's groups plan has no paired result yet."""
    s, b = claim["scheme"], claim["baseline"]
    groups = [g for a in alts for g in a]
    depths = sorted({r["sublayers"] for r in runs if r["group"] in groups})
    rows = []
    for L in depths:
        best = {x: best_over_inits(study, runs, alts, x, L) for x in (b, s)}
        m = _pair({sd: r["capped_loss"] for sd, r in best[b].items()},
                  {sd: r["capped_loss"] for sd, r in best[s].items()})
        if not m:
            continue
        finished = [r for r in runs if r["group"] in groups and r["scheme"] == b and r["sublayers"] == L
                    and r["status"] == "done"]
        failed = [r for r in finished if r.get("diverged")]
        rows.append({"sublayers": L, "margin": paired_verdict(m, study.min_effect, study.min_seeds),
                     "best_lr": {x: {sd: r["lr"] for sd, r in best[x].items()} for x in (b, s)},
                     "best_group": {x: {sd: r["group"] for sd, r in best[x].items()} for x in (b, s)},
                     "bracketed": {x: {sd: bracketed(runs, r) for sd, r in best[x].items()} for x in (b, s)},
                     "plateau_exit": {x: {sd: r.get("plateau_exit_step") for sd, r in best[x].items()}
                                      for x in (b, s)},
                     "window": {x: {_trained_in(runs, a, x, L): lr_window(runs, a, x, L) for a in alts} for x in (b, s)},
                     "baseline_runs": len(finished), "baseline_diverged_runs": len(failed),
                     "baseline_recovered_runs": sum(left_plateau_later(r) for r in failed)})
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


def claim_margin_grows(study: Study, runs: list[dict], claim: dict) -> dict:
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


def _opt_lrs(runs: list[dict], group: str, scheme: str, L: int) -> dict:
    """``{seed: (optimal LR, at an edge of the LR grid)}`` of one scheme and depth of a train group."""
    out = {}
    rs = [r for r in runs if r["group"] == group and r["scheme"] == scheme and r["sublayers"] == L]
    lrs = sorted({r["lr"] for r in rs})
    for seed in sorted({r["seed"] for r in rs}):
        mine = [r for r in rs if r["seed"] == seed]
        if len(mine) == len(lrs) and all(r["status"] == "done" for r in mine):
            best = min(mine, key=lambda r: r["capped_loss"])
            out[seed] = (best["lr"], len(lrs) > 1 and best["lr"] in (lrs[0], lrs[-1]))
    return out


def claim_lr_transfer(study: Study, runs: list[dict], claim: dict) -> dict:
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
    depths = sorted({r["sublayers"] for r in runs if r["group"] == g})
    rows = []
    for scheme in dict.fromkeys(r["scheme"] for r in runs if r["group"] == g):
        per = {L: _opt_lrs(runs, g, scheme, L) for L in depths}
        rows.append({"scheme": scheme, "opt_lr": {L: {s: v[0] for s, v in p.items()} for L, p in per.items()},
                     "at_edge": any(e for p in per.values() for _, e in p.values())})
    subject = claim.get("scheme", "keel")
    row = next((r for r in rows if r["scheme"] == subject), None)
    if row is None or len(depths) < 2:
        return {"verdict": INCONCLUSIVE, "why": "needs the scheme's LR grid at two depths", "rows": rows}
    lo, hi = row["opt_lr"][depths[0]], row["opt_lr"][depths[-1]]
    shift = {s: abs(math.log10(hi[s] / lo[s])) for s in sorted(set(lo) & set(hi))}
    if not shift:
        return {"verdict": INCONCLUSIVE, "rows": rows, "why": f"no seed has {subject}'s LR grid finished at both "
                f"{depths[0]} and {depths[-1]} sub-layers"}
    n_ok = len(shift) >= study.min_seeds
    if not n_ok or row["at_edge"]:
        verdict = INCONCLUSIVE
    elif all(x < 1e-9 for x in shift.values()):
        verdict = REPRODUCED
    elif all(x > 1e-9 for x in shift.values()):
        verdict = NOT_REPRODUCED
    else:
        verdict = INCONCLUSIVE
    return {"verdict": verdict, "scheme": subject, "depths": [depths[0], depths[-1]], "log10_shift": shift,
            "rows": rows}


def _log_ratio(hi: float | None, lo: float | None, peak: float) -> float | None:
    """log10(max LR of the scheme expected higher / of the lower one); a run that never diverged
    counts as the peak LR (censored). Two censored runs are no evidence either way: None."""
    if hi is None and lo is None:
        return None
    a, b = (hi if hi is not None else peak), (lo if lo is not None else peak)
    if a <= 0 or b <= 0:
        return math.inf if a > b else (-math.inf if a < b else 0.0)
    return math.log10(a / b)


def left_plateau_later(rec: dict) -> bool:
    """Whether the divergence classifier flagged ``rec`` as a stagnation and the run then left
    the unigram plateau (its :func:`plateau_exit_step` is after the flagged step): a first
    failure the run recovered from, e.g. Pre-LN at 256 sub-layers, flagged at step 221, below
    the plateau from step 617."""
    d = rec.get("divergence") or {}
    left = rec.get("plateau_exit_step")
    return d.get("mode") == "stagnation" and left is not None and left > d.get("step", math.inf)


def verdict_words(rec: dict) -> str:
    """A run's divergence verdict, e.g. "instability from step 875 (LR 0.0437)", "healthy",
    "instability from step 994 (LR 0.0497), a spike still open when the curve ended" (the
    classifier's end-of-curve rule: a weaker verdict than a spike that did not recover within its
    recovery window), or "stagnation from step 221 (LR 0.000905), left the plateau at step 617":
    the classifier reports a run's first failure (here 100 steps on the unigram plateau), and
    :func:`plateau_exit_step` says when the run got below it afterwards."""
    d = rec.get("divergence") or {}
    if not d or d.get("mode") == "healthy":
        return rec.get("verdict") or "no verdict"
    lr = d.get("evidence", {}).get("lr_at_step")
    words = f"{d['mode']} from step {d['step']}" + (f" (LR {lr:.3g})" if lr is not None else "")
    if left_plateau_later(rec):
        words += f", left the plateau at step {rec['plateau_exit_step']}"
    return words + (", a spike still open when the curve ended" if d.get("evidence", {}).get("open_at_end") else "")


def claim_max_lr_order(study: Study, runs: list[dict], claim: dict) -> dict:
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


def _ramp_rows(runs: list[dict], group: str, order: Sequence[str]) -> list[dict]:
    """One row per depth of ramp ``group``'s finished runs: its peak LR, each scheme's max LR per
    seed, each run's verdict in words."""
    rr = [r for r in runs if r["group"] == group and r["status"] == "done"]
    peak = max([r["peak_lr"] for r in rr] or [0.0])
    rows = []
    for L in sorted({r["sublayers"] for r in rr}):
        at = [r for r in rr if r["sublayers"] == L]
        lr = {s: {r["seed"]: r.get("max_lr") for r in at if r["scheme"] == s} for s in order}
        detail = {f"{r['scheme']} s{r['seed']}": verdict_words(r) for s in order for r in at if r["scheme"] == s}
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


def group_tokens(runs: Sequence[dict], group: str) -> int | None:
    """Tokens per run of ``group`` (its finished runs' ``tokens``), None before one finished."""
    return next((r["tokens"] for r in runs if r["group"] == group and r["status"] == "done" and r.get("tokens")), None)


def non_embedding_params(study: Study, group: str, scheme: str, sublayers: int) -> int:
    """Non-embedding parameters (:func:`keel.model.count_parameters`) of ``scheme`` at
    ``sublayers`` with group ``group``'s config (the scale's keys, its own ``set``)."""
    g = next(x for x in study.groups if x.name == group)
    cfg = load_config(resolve_config_path(study.base),
                      study.all_sets(g) + [("model.residual", scheme), ("model.n_layers", sublayers // 2)])
    return count_parameters(cfg.model, non_embedding=True)


def _budget_condition(study: Study, runs: list[dict], claim: dict, groups: list[str]) -> dict:
    """One condition of claim (e): per budget group the paired margin at ``claim['sublayers']``,
    the margin at the largest budget and its slope against log2(tokens)."""
    s, b = claim["scheme"], claim["baseline"]
    L = one_depth(study, groups[0])
    rows = []
    for g in groups:
        tokens = group_tokens(runs, g)
        best = {x: best_runs(runs, [g], x, L) for x in (b, s)}
        m = _pair({sd: r["capped_loss"] for sd, r in best[b].items()}, {sd: r["capped_loss"] for sd, r in best[s].items()})
        if tokens is None or not m:
            continue
        rows.append({"group": g, "tokens": tokens, "margin": paired_verdict(m, study.min_effect, study.min_seeds),
                     "tokens_per_param": {x: tokens / non_embedding_params(study, g, x, L) for x in (b, s)},
                     "best_lr": {x: {sd: r["lr"] for sd, r in best[x].items()} for x in (b, s)},
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


def claim_data_scaling(study: Study, runs: list[dict], claim: dict) -> dict:
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


def claim_deep_vs_wide(study: Study, runs: list[dict], claim: dict) -> dict:
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
        loss = {c: {sd: r["capped_loss"] for sd, r in v.items()} for c, v in cells.items()}
        parts = {f"{b} deep ({Ld}) − {s} deep": _pair(loss[(b, "deep")], loss[(s, "deep")]),
                 f"{b} wide ({Lw}) − {s} deep": _pair(loss[(b, "wide")], loss[(s, "deep")])}
        parts = {n: paired_verdict(m, study.min_effect, study.min_seeds) for n, m in parts.items()}
        done = all(p["n"] >= study.min_seeds for p in parts.values())
        conds[k] = {"verdict": combine([p["verdict"] for p in parts.values()]) if done else INCONCLUSIVE,
                    "parts": parts, "groups": [deep, wide],
                    "params": {f"{x} {shape}": non_embedding_params(study, g, x, L) for x in (s, b)
                               for shape, g, L in (("deep", deep, Ld), ("wide", wide, Lw))},
                    "cells": {f"{x} {shape}": {"loss": loss[(x, shape)],
                                               "lr": {sd: r["lr"] for sd, r in cells[(x, shape)].items()},
                                               "bracketed": {sd: bracketed(runs, r) for sd, r in cells[(x, shape)].items()}}
                              for x, shape in cells}}
    return _judged(conds)


def seed_mean_optimum(runs: Sequence[dict], groups: Sequence[str], scheme: str, sublayers: int) -> float | None:
    """The peak LR with the lowest seed-mean capped loss of ``scheme`` at ``sublayers`` over the
    runs of ``groups`` (the seeds that finished every LR); None before one has."""
    rs = [r for r in runs if r["group"] in groups and r["scheme"] == scheme and r["sublayers"] == sublayers]
    lrs = sorted({r["lr"] for r in rs})
    seeds = [sd for sd in sorted({r["seed"] for r in rs})
             if sorted(r["lr"] for r in rs if r["seed"] == sd and r["status"] == "done") == lrs]
    if not seeds:
        return None
    return min(lrs, key=lambda lr: statistics.fmean(r["capped_loss"] for r in rs if r["lr"] == lr and r["seed"] in seeds))


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


def claim_layer_importance(study: Study, runs: list[dict], claim: dict) -> dict:
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
    conds = {}
    for k, (abl, opt) in {"paper_init": (claim["groups"], claim["optimum_groups"]),
                          **({"embed_init": (claim["init_groups"], claim["init_optimum_groups"])}
                             if claim.get("init_groups") else {})}.items():
        depths = sorted({r["sublayers"] for r in runs if r["group"] in abl})
        parts, rows = {}, []
        for L in depths:
            per = {}
            for x in (claim["scheme"], claim["baseline"]):
                lr = seed_mean_optimum(runs, opt, x, L)
                per[x] = {r["seed"]: r for r in runs if r["group"] in abl and r["scheme"] == x and r["sublayers"] == L
                          and lr is not None and math.isclose(r["lr"], lr) and r["status"] == "done"
                          and r.get("ablation")}
            share = {x: {sd: redundant_share(r["ablation"], REDUNDANT_BELOW, SHALLOW) for sd, r in v.items()}
                     for x, v in per.items()}
            crit = {x: {sd: first_critical(r["ablation"]) for sd, r in v.items()} for x, v in per.items()}
            parts[f"redundant share of the shallow half at {L}: {claim['baseline']} − {claim['scheme']}"] = \
                paired_verdict(_pair(share[claim["baseline"]], share[claim["scheme"]]), claim.get("share_floor", 0.05),
                               study.min_seeds)
            for x in (claim["scheme"], claim["baseline"]):
                parts[f"first two sub-layers over the median, {x} at {L} (log10)"] = \
                    paired_verdict(crit[x], MAX_LR_FLOOR, study.min_seeds)
            rows.append({"sublayers": L, "lr": {x: next((r["lr"] for r in v.values()), None) for x, v in per.items()},
                         "share": share, "critical": crit,
                         "delta_ppl": {x: {sd: r["ablation"]["delta_ppl"] for sd, r in v.items()} for x, v in per.items()},
                         "ppl_full": {x: {sd: r["ablation"]["ppl_full"] for sd, r in v.items()} for x, v in per.items()}})
        planned = [L for g in study.groups if g.name in abl for L in g.sublayers]
        if not rows or sorted(set(planned)) != depths or any(p["n"] < study.min_seeds for p in parts.values()):
            conds[k] = {**_pending("ablations pending" if rows else "no ablated runs yet"), "parts": parts, "rows": rows}
        else:
            conds[k] = {"verdict": combine([p["verdict"] for p in parts.values()]), "parts": parts, "rows": rows}
    return _judged(conds)


REDUNDANT_BELOW = 0.01  # a sub-layer is redundant when removing it raises the PPL by less than 1%
SHALLOW = 0.5  # the shallow sub-layers: the first half


def claim_early_spike(study: Study, runs: list[dict], claim: dict) -> dict:
    """At the LRs where {scheme} trains healthily, {baseline} spikes early and {scheme} does not:
    {baseline}'s largest early spike exceeds {scheme}'s.

    Per run the largest rise of the 10-step trailing-mean training loss over its earlier minimum
    in the first 1,000 steps (:func:`keel.experiments.study.records.early_spike`, nats/token;
    the rule was fixed before any run was read). Per depth and seed ``d = mean over the LRs where
    {scheme}'s run is healthy (divergence classifier) of spike(baseline) - spike(scheme)``;
    :func:`paired_verdict` with the study's loss floor. Keel paper Figure 1a/4: Pre-LN spikes at
    4.5e-3 in the first 1,000 steps at 1024 sub-layers, Keel converges smoothly."""
    s, b, g = claim["scheme"], claim["baseline"], claim["group"]
    rs = [r for r in runs if r["group"] == g and r["status"] == "done" and r.get("early_spike") is not None]
    parts, rows = {}, []
    for L in sorted({r["sublayers"] for r in runs if r["group"] == g}):
        at = {(r["scheme"], r["seed"], r["lr"]): r for r in rs if r["sublayers"] == L}
        diffs = {}
        for sd in sorted({r["seed"] for r in runs if r["group"] == g}):
            ok = [lr for (x, seed, lr), r in at.items() if x == s and seed == sd and r.get("verdict") == "healthy"
                  and (b, sd, lr) in at]
            if ok:
                diffs[sd] = statistics.fmean(at[(b, sd, lr)]["early_spike"] - at[(s, sd, lr)]["early_spike"] for lr in ok)
        parts[f"spike({b}) − spike({s}) at {L}, {s}'s healthy LRs"] = paired_verdict(diffs, study.min_effect,
                                                                                     study.min_seeds)
        for lr in sorted({k[2] for k in at}):
            rows.append({"sublayers": L, "lr": lr, **{x: {k[1]: (r["early_spike"], r.get("verdict")) for k, r in at.items()
                                                          if k[0] == x and k[2] == lr} for x in (s, b)}})
    planned = sum(len(gr.scheme_seeds(x)) * len(gr.sublayers) * len(gr.lrs) for gr in study.groups if gr.name == g
                  for x in (s, b))
    if len([r for r in rs if r["scheme"] in (s, b)]) < planned:
        return {**_pending(f"{len(rs)} of {planned} runs with every step's loss finished"), "parts": parts, "rows": rows}
    return {"verdict": combine([p["verdict"] for p in parts.values()]), "parts": parts, "rows": rows}


def claim_bench(study: Study, runs: list[dict], claim: dict) -> dict:
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
