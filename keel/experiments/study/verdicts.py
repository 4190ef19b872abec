"""The verdicts of a study's claims, computed from the finished runs' records with
paired per-seed differences (:func:`paired_verdict`), one function per claim test
(:data:`CLAIM_TESTS`)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from keel.config import override_text
from keel.experiments.study.spec import Group, Study

REPRODUCED, NOT_REPRODUCED, INCONCLUSIVE = "reproduced", "not reproduced", "inconclusive"
MAX_LR_FLOOR = math.log10(1.05)  # noise floor of a max-LR pair (log10 of the ratio): a 5% difference


def paired_verdict(diffs: dict, min_effect: float, min_seeds: int = 2) -> dict:
    """The verdict of one paired comparison, oriented so that the claim predicts ``d > 0``.

    ``diffs``: ``{seed: d_seed}`` (nats/token, or any unit ``min_effect`` is in), one per seed
    that both sides finished (paired: same seed = same init draws and data order).

    * ``reproduced``: at least ``min_seeds`` seeds and every ``d >= min_effect``;
    * ``not reproduced``: at least ``min_seeds`` seeds and either every ``d <= -min_effect``
      (the opposite holds) or every ``|d| < min_effect`` (no effect);
    * ``inconclusive``: anything else (mixed signs, a seed inside the noise floor while
      another is outside it, fewer than ``min_seeds`` seeds).

    Returns ``{verdict, n, mean, sd, diffs, min_effect}`` (``sd`` the sample standard
    deviation, ddof 1; 0 for one seed; None without seeds).
    """
    xs = [float(x) for x in diffs.values() if x is not None and math.isfinite(x)]
    n = len(xs)
    mean = statistics.fmean(xs) if xs else None
    sd = (statistics.stdev(xs) if n > 1 else 0.0) if xs else None
    if n < max(1, min_seeds):
        verdict = INCONCLUSIVE
    elif all(x >= min_effect for x in xs):
        verdict = REPRODUCED
    elif all(x <= -min_effect for x in xs) or all(abs(x) < min_effect for x in xs):
        verdict = NOT_REPRODUCED
    else:
        verdict = INCONCLUSIVE
    return {"verdict": verdict, "n": n, "mean": mean, "sd": sd, "diffs": dict(diffs), "min_effect": min_effect}


def combine(verdicts: Sequence[str]) -> str:
    """All parts reproduced -> reproduced; any part not reproduced -> not reproduced; else inconclusive."""
    if verdicts and all(v == REPRODUCED for v in verdicts):
        return REPRODUCED
    return NOT_REPRODUCED if NOT_REPRODUCED in verdicts else INCONCLUSIVE


def best_runs(runs: Sequence[dict], groups: Sequence[str], scheme: str, sublayers: int) -> dict:
    """``{seed: run record}`` of ``scheme`` at ``sublayers`` over the runs of ``groups``: per seed,
    the run with the lowest capped final validation loss (each seed's best LR; a run without a
    finite final loss counts as its step-0 loss, as in
    :func:`keel.experiments.sensitivity.seed_curve`). Seeds with an unfinished LR are left out."""
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


def best_lr_at_edge(runs: Sequence[dict], groups: Sequence[str], scheme: str, sublayers: int) -> dict:
    """``{seed: bool}``: whether each seed's best LR (:func:`best_runs`) is the lowest or highest
    LR that ``scheme`` trained at ``sublayers`` in ``groups`` (then the optimum may lie outside
    them, e.g. at the deepest depth, trained at two LRs transferred from the depth before)."""
    out = {}
    for seed, r in best_runs(runs, groups, scheme, sublayers).items():
        lrs = [x["lr"] for x in runs if x["group"] in groups and x["scheme"] == scheme
               and x["sublayers"] == sublayers and x["seed"] == seed]
        out[seed] = len(lrs) > 1 and r["lr"] in (min(lrs), max(lrs))
    return out


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


def claim_margin_grows(study: Study, runs: list[dict], claim: dict) -> dict:
    """{scheme} beats {baseline} at the deepest depth and its margin grows with depth (both parts
    must hold).

    Margin per seed and depth: ``m_L = best(baseline) - best(scheme)`` (nats/token, best
    over the LR grid per seed). Two paired verdicts, combined by :func:`combine`:
    ``m_deepest > 0`` and ``m_deepest - m_shallowest > 0`` (depths where both schemes have
    a paired seed). Rows: the margin at every depth, each seed's best LR and the plateau exit
    step of that run (a margin is partly plateau-exit speed while the baseline leaves late), and
    the baseline's diverged runs.
    """
    groups, s, b = claim["groups"], claim["scheme"], claim["baseline"]
    depths = sorted({r["sublayers"] for r in runs if r["group"] in groups})
    rows = []
    for L in depths:
        m = _pair(best_losses(runs, groups, b, L), best_losses(runs, groups, s, L))
        if m:
            finished = [r for r in runs if r["group"] in groups and r["scheme"] == b and r["sublayers"] == L
                        and r["status"] == "done"]
            failed = [r for r in finished if r.get("diverged")]
            rows.append({"sublayers": L, "margin": paired_verdict(m, study.min_effect, study.min_seeds),
                         "best_lr": {b: best_lrs(runs, groups, b, L), s: best_lrs(runs, groups, s, L)},
                         "best_lr_at_edge": {x: best_lr_at_edge(runs, groups, x, L) for x in (b, s)},
                         "plateau_exit": {x: {seed: r.get("plateau_exit_step")
                                              for seed, r in best_runs(runs, groups, x, L).items()} for x in (b, s)},
                         "baseline_runs": len(finished), "baseline_diverged_runs": len(failed),
                         "baseline_recovered_runs": sum(left_plateau_later(r) for r in failed)})
    equal = equal_lr_margins(runs, groups, s, b, study.min_effect, study.min_seeds)
    if len(rows) < 2:
        return {"verdict": INCONCLUSIVE, "why": "needs paired results at two depths at least", "rows": rows,
                "equal_lr": equal}
    lo, hi = rows[0], rows[-1]
    growth = _pair(hi["margin"]["diffs"], lo["margin"]["diffs"])
    planned = max((L for g in study.groups if g.name in groups for L in g.sublayers), default=hi["sublayers"])
    where = f"margin at {hi['sublayers']} sub-layers" + (
        f" (the deepest finished; {planned} pending)" if planned > hi["sublayers"] else "")
    parts = {where: hi["margin"],
             f"growth {lo['sublayers']} -> {hi['sublayers']} sub-layers": paired_verdict(growth, study.min_effect,
                                                                                          study.min_seeds)}
    return {"verdict": combine([p["verdict"] for p in parts.values()]), "parts": parts, "rows": rows,
            "equal_lr": equal}


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


def claim_init_margin(study: Study, runs: list[dict], claim: dict) -> dict:
    """{scheme} still beats {baseline} when each uses the better of two embedding inits.

    Per seed, at the init group's depth: ``m = min(best(baseline) over inits) - min(best(scheme)
    over inits)``, the inits being the group's (e.g. ``model.embed_init_std = 1.0``) and the
    reference group's (the study's default init); verdict :func:`paired_verdict` of ``m``.
    Also reported: the margin at each init alone, and the baseline's gain from the init.
    """
    g, ref, s, b = claim["group"], claim["reference_group"], claim["scheme"], claim["baseline"]
    depths = sorted({r["sublayers"] for r in runs if r["group"] == g})
    if not depths:
        return {"verdict": INCONCLUSIVE, "why": "no finished runs in the init group", "rows": {}}
    L = depths[0]
    bl = {k: best_losses(runs, [k], b, L) for k in (g, ref)}
    sl = {k: best_losses(runs, [k], s, L) for k in (g, ref)}
    best_b = {x: min(bl[g][x], bl[ref][x]) for x in set(bl[g]) & set(bl[ref])}
    best_s = {x: min(sl[g][x], sl[ref][x]) for x in set(sl[g]) & set(sl[ref])}
    v = paired_verdict(_pair(best_b, best_s), study.min_effect, study.min_seeds)
    sets = next((grp.sets for grp in study.groups if grp.name == g), [])
    init = ", ".join(override_text(x) for x in sets) or "this group's init"  # e.g. model.embed_init_std=1.0
    rows = {"margin, default init": paired_verdict(_pair(bl[ref], sl[ref]), study.min_effect, study.min_seeds),
            f"margin, {init}": paired_verdict(_pair(bl[g], sl[g]), study.min_effect, study.min_seeds),
            f"{b} gain from {init}": paired_verdict(_pair(bl[ref], bl[g]), study.min_effect, study.min_seeds)}
    return {"verdict": v["verdict"], "sublayers": L, "margin_best_init": v, "rows": rows}


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
    """Max LR (the stress ramp's LR just before divergence) increases along {order}.

    For each adjacent pair (a, b) of the order, per seed ``d = log10(maxLR_b / maxLR_a)``
    (a run that never diverged counts as the peak LR; a seed where neither diverged is left
    out, so a ramp whose peak is too low ends inconclusive); pair verdict :func:`paired_verdict`
    with ``min_effect = log10(1.05)`` (5%); the claim's verdict combines the pairs
    (:func:`combine`). A pair is judged on the claim's ``extended_group`` (the same ramp
    continued to a higher peak, for the pairs the first peak censors) once every run of both
    schemes at that depth has finished there, else on ``group``. Rows: one per ramp group and
    depth with each scheme's max LR per seed, the ramp's peak, and each run's verdict in words
    (:func:`verdict_words`).
    """
    order, sized = claim["order"], {g.name for g in study.groups}
    names = [claim["group"]] + ([claim["extended_group"]] if claim.get("extended_group") in sized else [])
    rows = [row for name in names for row in _ramp_rows(runs, name, order)]
    peaks = {r["group"]: r["peak_lr"] for r in rows}  # a pair is judged only on a group with finished rows
    pairs = {}
    for L in sorted({r["sublayers"] for r in rows if r["group"] == names[0]}):
        for a, b in zip(order, order[1:]):
            name = next((x for x in names[1:] if _ramp_pair_done(runs, x, (a, b), L)), names[0])
            lr = next(r["max_lr"] for r in rows if r["group"] == name and r["sublayers"] == L)
            d = {x: _log_ratio(lr[b][x], lr[a][x], peaks[name]) for x in sorted(set(lr[a]) & set(lr[b]))}
            d = {x: v for x, v in d.items() if v is not None}  # both never diverged: censored, left out
            key = f"{a} < {b} at {L}" + (f" (ramp to {peaks[name]:g})" if name != names[0] else "")
            pairs[key] = paired_verdict(d, MAX_LR_FLOOR, study.min_seeds)
    if not pairs:
        return {"verdict": INCONCLUSIVE, "why": "no finished ramp runs", "rows": rows, "parts": {}}
    return {"verdict": combine([p["verdict"] for p in pairs.values()]), "parts": pairs, "rows": rows,
            "peak_lr": peaks[names[0]]}


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


def _ramp_pair_done(runs: list[dict], group: str, pair: tuple[str, str], sublayers: int) -> bool:
    """Whether ramp ``group`` planned runs of both schemes of ``pair`` at ``sublayers`` and all have finished."""
    mine = [r for r in runs if r["group"] == group and r["sublayers"] == sublayers and r["scheme"] in pair]
    return {r["scheme"] for r in mine} == set(pair) and all(r["status"] == "done" for r in mine)


CLAIM_TESTS = {"margin_grows": claim_margin_grows, "lr_transfer": claim_lr_transfer,
               "init_margin": claim_init_margin, "max_lr_order": claim_max_lr_order}
CLAIM_UNITS = {"max_lr_order": "log10 of the max-LR ratio", "margin_grows": "nats/token", "init_margin": "nats/token",
               "lr_transfer": "peak LR"}  # the unit of each claim test's numbers (the verdict table's column)



def claim_reads(claim: dict) -> set[tuple[str, str]]:
    """The ``(group, scheme)`` pairs whose runs a claim's verdict reads (an lr_transfer claim:
    its ``scheme`` only; the other schemes of its table are for comparison)."""
    groups = list(claim.get("groups", [])) + [claim[k] for k in ("group", "reference_group", "extended_group")
                                              if k in claim]
    schemes = [claim.get("scheme", "keel")] if claim["test"] == "lr_transfer" else \
        [claim[k] for k in ("scheme", "baseline") if k in claim] + list(claim.get("order", []))
    return {(g, s) for g in groups for s in schemes}


