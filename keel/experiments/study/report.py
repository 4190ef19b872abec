"""A study's ``report.md`` and PNGs: the verdict table, one section per claim, the
groups no claim reads, best losses, plateau exits and every run."""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from keel.config import override_text
from keel.experiments import sensitivity as LS
from keel.experiments.analysis import LossFloor
from keel.experiments.record import RunRecord
from keel.experiments.study.kinds import GROUP_KINDS
from keel.experiments.study.spec import Group, Study
from keel.experiments.study.cells import CONDITION_WORDS, direction, lrs, pm, short
from keel.experiments.study.claims import Claim
from keel.experiments.table import markdown_table
from keel.experiments.study.verdicts import (LEVEL, MAX_LR_FLOOR, ClaimVerdict, baseline_margins, best_losses, best_lrs,
                                             best_runs, bracketed, paired_verdict, verdict_words)
from keel.train.plots import plt, save_figure


def claim_summary(claim: Claim, c: ClaimVerdict) -> str:
    """The claim's one-line summary, written from its verdict data: the verdict per condition
    (which init, which ramp; :meth:`Claim.phrase`) and the numbers of its deciding parts."""
    head = f"({claim.id}) {claim.title}: "
    conds = c.conditions
    if not conds:
        return head + f"{c.verdict} ({claim.numbers(c)})."
    nums = "; ".join(f"{CONDITION_WORDS.get(k, k)}: " + ("; ".join(f"{name} {short(p)}" for name, p in v.parts.items())
                                                        if v.parts and not (v.why and not any(p.n for p in v.parts.values()))
                                                        else v.why or "no finished runs")
                     for k, v in conds.items())
    return head + claim.phrase(conds) + (f" — {nums}" if nums else "") + "."


def claim_section(claim: Claim, c: ClaimVerdict) -> list[str]:
    """Markdown of one claim: its summary line, the rule, its kind's tables (:meth:`Claim.tables`)."""
    out = [f"## ({claim.id}) {claim.title}", "", f"**Verdict: {c.verdict}.** {c.summary or ''}", "",
           claim.rule(), ""] + ([claim.note.strip(), ""] if claim.note else [])
    return out + claim.tables(c) + [""]


def best_loss_table(study: Study, runs: list[RunRecord]) -> list[str]:
    """Markdown: per train group, scheme and depth, the best final validation loss over the
    LR grid per seed (:func:`best_losses`), mean ± sd: every scheme of the study side by side."""
    rows = []
    for g in study.groups:
        if not g.kind_class.lr_grid:
            continue
        for L in g.sublayers:
            for scheme in g.schemes:
                b = best_losses(runs, [g.name], scheme, L)
                if b:
                    rows.append([g.name, L, scheme, pm(paired_verdict(b, study.min_effect, 1), "{:.3f}"),
                                 lrs(best_lrs(runs, [g.name], scheme, L))])
    if not rows:  # no finished run of a train group (a ramp-only study): no table
        return []
    return ["## Best loss per scheme and depth", "",
            "Final validation loss (nats/token) at each seed's best LR; seeds with an unfinished LR are left out.",
            ""] + markdown_table(["group", "sub-layers", "scheme",
                                  f"best loss, seed mean [{2 * LEVEL - 1:.0%} CI] (per seed)", "best LR [per seed]"],
                                 rows) + [""]


def unclaimed_group_sections(study: Study, runs: list[RunRecord]) -> list[str]:
    """Markdown: one section per group that no claim reads (e.g. the 1024-sub-layer showcase, the
    residual bench): its ``note``, its settings beyond the scale's, and its finished runs (first
    and final validation loss, nats/token; plateau exit step; divergence verdict). No verdict."""
    read = {g for c in study.claims for g, _ in c.reads()}
    out = []
    for g in study.groups:
        if g.name in read:
            continue
        done = [r for r in runs if r.group == g.name and r.status == "done"]
        planned = sum(r.group == g.name for r in runs)
        out += [f"## Group {g.name} (no claim reads it)", ""] + ([g.note.strip(), ""] if g.note else [])
        if g.sets:
            out += [f"Settings beyond the scale's: {', '.join(override_text(x) for x in g.sets)}.", ""]
        out += [f"Runs finished: {len(done)} of {planned}.", ""] + baseline_table(study, g, runs)
        if done:
            out += markdown_table(
                ["scheme", "sub-layers", "LR", "seed", "tokens", "val loss: first → final", "plateau exit step", "verdict"],
                [[r.scheme, r.sublayers, f"{r.lr:g}", r.seed, f"{r.tokens or 0:,}",
                  f"{_loss(r.first_val_loss)} → {_loss(r.final_val_loss)}", _exit_words(r), verdict_words(r)]
                 for r in done])
            out.append("")
    return out


def group_tables(study: Study, runs: list[RunRecord], out: Path, h1: float | None) -> dict[str, dict]:
    """``{group: data}``: the own table of each group whose kind has one (a grid group's sweep table;
    a ramp or train group's with ``table = true``: :meth:`keel.experiments.study.kinds.TrainKind.table`),
    from its run records ``runs`` and ``out`` (a ramp group's reference runs); ``h1``: the training
    tokens' unigram entropy (nats). ``report.json``'s ``group_tables``; :func:`group_table_sections`
    writes them into ``report.md``."""
    tables = {}
    for g in study.groups:
        data = g.kind_class.table(study, g, [r for r in runs if r.group == g.name], out, h1)
        if data is not None:
            tables[g.name] = data
    return tables


def group_table_sections(study: Study, tables: dict[str, dict]) -> list[str]:
    """Markdown: one section per group of ``tables`` (:func:`group_tables`), its kind's own text
    (:meth:`~keel.experiments.study.kinds.TrainKind.table_markdown`, the text of the deprecated
    ``sweep.md`` / ``stress.md`` / ``sensitivity.md``) under ``## Group NAME: its TITLE``, its
    headings two levels down."""
    out = []
    for g in study.groups:
        if g.name in tables:
            text = g.kind_class.table_markdown(tables[g.name])
            out += [f"## Group {g.name}: {g.kind_class.table_title}", ""]
            out += ["##" + x if x.startswith("#") else x for x in text.rstrip("\n").split("\n")] + [""]
    return out


def baseline_table(study: Study, g: Group, runs: list[RunRecord]) -> list[str]:
    """Markdown: ``g``'s schemes against its baselines (:func:`baseline_margins`), one row per
    depth and scheme, one column per baseline; empty when ``g`` names none."""
    rows = baseline_margins(study, g, runs)
    if not rows:
        return []
    out = [f"Against group {g.baselines_from}'s {', '.join(g.baselines)} (the same seeds, data and tokens per run): "
           f"margin = loss(baseline) − loss(scheme), nats/token, each side at its seed's best LR over every LR its "
           f"group trained (this group's grid {', '.join(f'{x:g}' for x in sorted(g.lrs))}, widened where a best LR "
           f"fell on an edge; group {g.baselines_from}'s for the baseline); > 0: the scheme is better. In brackets, "
           f"as the claims' "
           f"rule reads a margin: X better when every seed (≥ {study.min_seeds}) favours X by ≥ {study.min_effect:g}, "
           f"no difference when every seed is within {study.min_effect:g}, else mixed. No claim of the paper.", ""]
    cells = {(L, s): [r.margin for r in rows if (r.sublayers, r.scheme) == (L, s)]
             for L in g.sublayers for s in g.schemes}
    out += markdown_table(["sub-layers", "scheme", *(f"vs {b}" for b in g.baselines)],
                          [[L, s, *(f"{pm(v)} ({direction(v, s, b)})" if v.n else "–"
                                    for v, b in zip(cells[(L, s)], g.baselines))] for (L, s) in cells])
    edges = [f"{x} s{sd} ({r.lr:g}, group {gr})" for gr, xs in ((g.name, g.schemes), (g.baselines_from, g.baselines))
             for L in g.sublayers for x in xs for sd, r in best_runs(runs, [gr], x, L).items()
             if not bracketed(runs, r)]
    if edges:
        out += ["", f"Best LR on an edge of the LRs trained (not bracketed): {', '.join(edges)}."]
    if any(not r.margin.n for r in rows):
        out += ["", f"–: no seed has both sides finished yet (all of this group's LRs for the scheme and all of group "
                f"{g.baselines_from}'s for the baseline, at that depth)."]
    return out + [""]


def _loss(x: float | None) -> str:
    return "–" if x is None else f"{x:.3f}"


def plateau_table(runs: list[RunRecord]) -> list[str]:
    """Markdown: per group, scheme and depth, the plateau exit step of each seed's best run
    (lowest capped loss over its LRs) and how many of the finished runs never left the plateau."""
    out = ["## When each scheme leaves the unigram plateau", "",
           "Plateau exit: the first step whose 10-step trailing mean training loss is below 95% of the unigram "
           "entropy. Per seed, the run at that seed's best LR (a ramp group: its one run per seed); pending: a run "
           "of that seed is unfinished, so its best LR is not known yet (the finished runs' exit steps are in the "
           "last table).", ""]
    rows = []
    done = [r for r in runs if r.status == "done"]
    for key in dict.fromkeys((r.group, r.scheme, r.sublayers) for r in done):
        rs = [r for r in runs if (r.group, r.scheme, r.sublayers) == key]
        best = {sd: r.plateau_exit_step for sd, r in best_runs(rs, [key[0]], key[1], key[2]).items()}
        cells = ["pending" if sd not in best else "never" if best[sd] is None else str(best[sd])
                 for sd in sorted({r.seed for r in rs})]
        fin = [r for r in rs if r.status == "done"]
        never = sum(r.plateau_exit_step is None for r in fin)
        rows.append([*key, ", ".join(cells), f"{never} of {len(fin)}"])
    return out + markdown_table(["group", "scheme", "sub-layers", "exit step at the best LR, per seed",
                                 "finished runs that never left"], rows) + [""]


def _exit_words(r: RunRecord) -> str:
    """A run's plateau exit step for the tables: the step, ``never`` (finished on the plateau),
    ``–`` (not finished)."""
    if r.status != "done":
        return "–"
    return "never" if r.plateau_exit_step is None else str(r.plateau_exit_step)


def runs_table(runs: list[RunRecord]) -> list[str]:
    """Markdown: every run with its tokens, losses, plateau exit step and divergence verdict."""
    return ["## Every run", ""] + markdown_table(
        ["group", "scheme", "sub-layers", "LR", "seed", "status", "tokens", "final val loss", "plateau exit step",
         "verdict"],
        [[r.group, r.scheme, r.sublayers, f"{r.lr:g}", r.seed, r.status + (" (restored)" if r.restored else ""),
          f"{r.tokens or 0:,}", "–" if r.final_val_loss is None else f"{r.final_val_loss:.4f}", _exit_words(r),
          verdict_words(r) if r.status == "done" else "–"] for r in runs])


def verdict_rule(study: Study, claims: Sequence[Claim], floor: LossFloor | None = None) -> str:
    """The report's statement of the verdict rule (:func:`paired_verdict`, :func:`trend_verdict`)
    and of the loss floor and where it comes from (:func:`.judge.study_floor`); claims tested by
    a kind with ``own_rule`` (``lr_transfer``) have their own rule, in their section."""
    def ids(cs: Sequence[Claim]) -> str:
        return ", ".join(f"({c.id})" for c in cs)

    paired = [c for c in claims if not c.own_rule]
    ramp = [c for c in paired if GROUP_KINDS[c.group_kind].ramps]
    own = [c for c in claims if c.own_rule]
    own_words = f"{ids(own)} {'has its' if len(own) == 1 else 'have their'} own rule, stated in its section."
    if not paired:  # was "Rule of : per seed ..." over no claim
        return own_words if own else ""
    floor = floor or LossFloor(floor=study.min_effect, minimum=study.min_effect)
    why = (f" The floor is the median seed-to-seed sd of a scheme's best loss over the {floor.cells} cells "
           f"(scheme, depth, init) with two or more seeds that the margin claims read ({floor.median_sd:.3f}; "
           f"range {floor.min_sd:.3f}–{floor.max_sd:.3f}), and at least {floor.minimum:g}: a difference "
           "smaller than one configuration's typical seed noise does not count as an effect."
           if floor.median_sd is not None else "")
    return (f"Rule of {ids(paired)}: per seed the paired difference d, oriented so that the claim predicts d > 0, and "
            f"its mean's one-sided {LEVEL:.0%} Student-t bounds lo and hi (together a {2 * LEVEL - 1:.0%} interval, "
            f"written [CI lo, hi]), against a floor f (nats/token, f = {floor.floor:.3f}"
            + (f"; for {ids(ramp)} log10 ratios of max LR, f = log10 1.05 = {MAX_LR_FLOOR:.3f}, a 5% ratio"
               if ramp else "")
            + "".join(f"; for ({c.id}) {c.own_floors()}" for c in paired if c.own_floors())
            + f"). Reproduced when lo ≥ f with at least {study.min_seeds} paired seeds; not reproduced "
            "when hi < f (the interval excludes an effect as large as the floor: no effect, or the opposite); "
            "inconclusive otherwise. Growth with depth is the slope of each seed's margin against log2(sub-layers) "
            "over every depth, judged the same way with the floor spread over the studied range "
            "(f / log2(deepest / shallowest)). A claim with several parts is reproduced only when every part is; "
            f"a condition stays inconclusive while a run it reads has not finished or a part has fewer than "
            f"{study.min_seeds} paired seeds."
            + (" Margin claims are judged under two conditions fixed before any run: at the paper's init (N(0, 0.02²) "
               "everywhere) and with both schemes at the init groups' embedding init (N(0, 1)); no condition picks an "
               "init on the losses it judges, and the summary names the condition of every number."
               if any(getattr(c, "init_groups", None) for c in paired) else "")
            + why + (f" {own_words}" if own else ""))


def unfinished_words(study: Study, runs: list[RunRecord]) -> str:
    """" Unfinished: transfer 4 (deepnorm; read by no claim); ..." for the report's count line:
    per group its planned runs not finished yet, their schemes, and the claims whose verdicts
    they can still change."""
    pending = [r for r in runs if r.status != "done"]
    parts = []
    for g in dict.fromkeys(r.group for r in pending):
        schemes = list(dict.fromkeys(r.scheme for r in pending if r.group == g))
        readers = [f"({c.id})" for c in study.claims if any((g, x) in c.reads() for x in schemes)]
        parts.append(f"{g} {sum(r.group == g for r in pending)} ({', '.join(schemes)}; read by "
                     f"{', '.join(readers) if readers else 'no claim'})")
    return f" Unfinished: {'; '.join(parts)}." if parts else ""


def tokens_words(study: Study, done: list[RunRecord]) -> str:
    """" (tokens per finished run: ...)" for the report's count line: the distinct budgets of the
    training runs, and the range of the ramp runs, which stop at their divergence."""
    ramp = {g.name for g in study.groups if g.kind_class.ramps}
    train = sorted({r.tokens for r in done if r.tokens and r.group not in ramp})
    stopped = sorted(r.tokens for r in done if r.tokens and r.group in ramp)
    parts = ([f"training runs {', '.join(f'{t:,}' for t in train)}"] if train else []) + (
        [f"ramp runs {stopped[0]:,}" + (f"–{stopped[-1]:,}" if stopped[-1] != stopped[0] else "")
         + " (a ramp run stops at its divergence)"] if stopped else [])
    return f" (tokens per finished run: {'; '.join(parts)})" if parts else ""


def waiting_words(w: dict) -> str:
    """A group not planned yet (a dict of :func:`keel.experiments.study.run.collect`) in words:
    ``group transfer (33 runs) waits for group lr-grid at 64 sub-layers``."""
    return f"group {w['group']} ({w['runs']} runs) waits for group {w['source']} at {w['source_sublayers']} sub-layers"


def run_time_words(study: Study, runs: Sequence[RunRecord], waiting: Sequence[dict] = ()) -> str:
    """" Run time: N worker-hours recorded ...; about M worker-hours left ..." for the report's
    count line. Recorded: the sum of the finished runs' wall times (``wall_s``, seconds, as
    trained: a machine's ``--workers`` share its cores). Left: each unfinished run, and each run
    of a group not planned yet, at the median wall time of the finished runs of its group kind
    (training or ramp) and depth; runs at a kind and depth with no finished run yet are counted
    apart. Worker-hours divided by the workers that run at once give wall time."""
    ramps = {g.name: g.kind_class.ramps for g in study.groups}  # the kinds told apart: ramp runs or not
    walls: dict[tuple, list[float]] = {}
    for r in runs:
        if r.status == "done" and r.wall_s:
            walls.setdefault((ramps.get(r.group, False), r.sublayers), []).append(r.wall_s)
    todo = Counter((ramps.get(r.group, False), r.sublayers) for r in runs if r.status != "done")
    for w in waiting:
        for L in w["sublayers"]:
            todo[(ramps.get(w["group"], False), L)] += w["runs"] // len(w["sublayers"])
    parts = []
    if walls:
        parts.append(f"{sum(map(sum, walls.values())) / 3600:.1f} worker-hours recorded over the "
                     f"{sum(map(len, walls.values()))} finished runs that record one (each run's wall time as "
                     "trained: a machine's `--workers` share its cores)")
    if sum(todo.values()):
        parts.append(_time_left_words(walls, todo))
    return f" Run time: {'; '.join(parts)}." if parts else ""


def _time_left_words(walls: dict[tuple, list[float]], todo: Counter) -> str:
    """The part of :func:`run_time_words` on the runs to go (``todo``: their count per ``(ramp, depth)``,
    at least one): about how many worker-hours they take at the median wall time of the finished runs
    ``walls`` (seconds per ``(ramp, depth)``) of their kind and depth, or that none can be estimated."""
    n = sum(todo.values())
    med = {k: statistics.median(walls[k]) for k in sorted(todo, key=lambda k: (k[1], k[0])) if k in walls}
    known = sum(todo[k] for k in med)
    if not med:
        return f"the {n} runs to go are not estimated (no finished run yet of their kind and depth)"
    each = ", ".join(f"{L} sub-layers{' (ramp)' if ramp else ''} {m / 60:.1f} min" for (ramp, L), m in med.items())
    return (f"about {sum(todo[k] * m for k, m in med.items()) / 3600:.1f} worker-hours left for "
            + (f"the {n} runs to go" if known == n else f"{known} of the {n} runs to go (the other "
               f"{n - known} at a depth with no finished run yet)")
            + f", each at the median wall time of this study's finished runs of its kind and depth ({each})")


def restored_words(runs: list[RunRecord], restore: str | Path | None) -> str:
    """The report's line on runs restored from an earlier report (``keel study --restore``)."""
    n = sum(1 for r in runs if r.restored)
    if not n:
        return ""
    return (f" {n} of the finished runs were restored from `{restore}` (an earlier report of this study: their "
            "numbers and thinned loss curves, not their run folders; a record without a curve is not redrawn).")


def report_markdown(study: Study, claims: list[tuple[Claim, ClaimVerdict]], runs: list[RunRecord], command: str,
                    waiting: Sequence[dict] = (), restore: str | Path | None = None, floor: LossFloor | None = None,
                    tables: dict[str, dict] | None = None) -> str:
    """``report.md``: the verdict table, one section per claim, the groups no claim reads, the groups'
    own tables (``tables``: :func:`group_tables`), every run."""
    done = [r for r in runs if r.status == "done"]
    lines = [f"# Study `{study.name}`, scale `{study.scale}`", "", study.note, "",
             f"Runs finished: {len(done)} of {len(runs)} planned so far{tokens_words(study, done)}."
             + unfinished_words(study, runs)
             + (" The ramp groups' reference runs (the scale's `--dry-run` counts them) are not counted."
                if any(g.kind_class.ramps for g in study.groups) else "")
             + (f" Not planned yet: {'; '.join(map(waiting_words, waiting))}." if waiting else "")
             + run_time_words(study, runs, waiting) + restored_words(runs, restore),
             f"Command (it trains every run of the study; flags that pick what one call trains, "
             f"such as `--groups` and `--resume`, are left out): `{command}`", ""]
    if study.unjudged:
        lines += ["Not judged at this scale (it does not size the groups they read): " + "; ".join(
            f"({u['id']}): {', '.join(u['groups'])}" for u in study.unjudged) + ".", ""]
    if claims:  # a study of groups only (e.g. a bench) has no verdicts
        lines += ["## Summary", ""] + [f"- {c.summary}" for _, c in claims] + [""]
        lines += ["## Verdicts", "", verdict_rule(study, [cl for cl, _ in claims], floor), ""] + markdown_table(
            ["claim", "at the paper's init", "at N(0, 1) embeddings", "unit"],
            [[f"({cl.id}) {cl.title}", _verdict_cell(c, first=True), _verdict_cell(c, first=False),
              cl.unit] for cl, c in claims]) + [""]
    for cl, c in claims:
        lines += claim_section(cl, c)
    return "\n".join(lines + unclaimed_group_sections(study, runs) + group_table_sections(study, tables or {})
                     + best_loss_table(study, runs)
                     + plateau_table(runs) + runs_table(runs)) + "\n"


def superseded_words(recs: Sequence[RunRecord | dict]) -> str:
    """Markdown: the runs of a scheme's older implementation that a newer one replaced (kept in
    ``report.json``'s ``superseded_runs``, read by no verdict or table above); empty if none."""
    if not recs:
        return ""
    recs = [r if isinstance(r, RunRecord) else RunRecord.from_dict(r, "superseded run") for r in recs]
    out = ["", "## Superseded runs", "",
           f"{len(recs)} runs of an older implementation of their scheme (its `version` has since risen; "
           "the study trains them again under the new one). Their numbers, for the record only:", ""]
    out += markdown_table(["group", "scheme", "sub-layers", "LR", "seed", "final val loss"],
                          [[r.group, r.scheme, r.sublayers, f"{r.lr:g}", r.seed, _loss(r.final_val_loss)] for r in recs])
    return "\n".join(out) + "\n"


def _verdict_cell(c: ClaimVerdict, first: bool) -> str:
    """A verdict-table cell: the paper's-init column holds every condition run at the paper's init
    (both ramps of a max-LR claim), the other the N(0, 1)-embedding condition; ``—`` where none."""
    conds = c.conditions
    if conds is None:
        return f"**{c.verdict}**" if first else "—"
    keys = [k for k in conds if (k == "embed_init") != first]
    if not keys:
        return "—"
    return "; ".join((f"{CONDITION_WORDS[k]}: " if len(keys) > 1 or k.endswith("ramp") else "")
                     + f"**{conds[k].verdict}**" for k in keys)


def plot_record_curves(recs: Sequence[RunRecord], out: Path, *, x: str, title: str) -> bool:
    """Loss curves (the thinned 10-step trailing mean kept in each run's record, nats/token) of
    runs ``recs`` against ``x`` (``step``, or ``lr`` on a log axis for a ramp), one line each,
    from their records alone (restored runs included); False (nothing written) when no record
    has a curve."""
    recs = [r for r in recs if (r.curve or {}).get("step")]
    if not recs:
        return False
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for r in recs:
        c = r.curve
        pts = [(a, y) for a, y in zip(c[x], c["loss"]) if a is not None and y is not None and (x != "lr" or a > 0)]
        ax.plot([a for a, _ in pts], [y for _, y in pts], lw=1,
                label=f"{r.scheme} L{r.sublayers}" + (f" LR {r.lr:g}" if x != "lr" else "") + f" s{r.seed}")
    if x == "lr":
        ax.set_xscale("log")
    ax.set_xlabel("LR at that step (on the ramp)" if x == "lr" else "step")
    ax.set_ylabel("training loss, 10-step trailing mean (nats/token)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6, ncol=2)
    save_figure(fig, out)
    return True


def write_plots(study: Study, runs: list[RunRecord], claims: list[tuple[Claim, ClaimVerdict]], out: Path,
                h1: float | None) -> list[str]:
    """The report's PNGs: loss against LR per train group with an LR grid (each cell over every LR
    its runs trained, widened ones included), loss curves of the ramp
    groups (against the ramp's LR) and of single-LR groups (drawn from the runs' records, so a
    restored report redraws them), margins against depth. Returns the file names."""
    files = []
    for g in study.groups:
        done = [r for r in runs if r.group == g.name and r.status == "done"]
        if not done:
            continue
        name = f"{g.name}.png"
        x = g.kind_class.curve_axis(g)
        if x is not None:
            if not plot_record_curves(done, out / name, x=x, title=f"group {g.name}"):
                continue
        else:  # with the baselines' runs of the group they are compared with, if any
            refs = [r for r in runs if r.group == g.baselines_from and r.scheme in g.baselines
                    and r.status == "done"]
            schemes = g.schemes + [b for b in g.baselines if b not in g.schemes]
            recs = done + refs  # each cell over the LRs its runs trained: the group's, and those widened
            cells = [row for L in g.sublayers for s in schemes for row in LS.summarise(
                recs, [s], [L], sorted(set(g.lrs) | {r.lr for r in recs if (r.scheme, r.sublayers) == (s, L)}),
                g.seeds)]
            LS.plot({"sublayers": g.sublayers, "cells": cells, "lrs": sorted(g.lrs), "schemes": schemes,
                     "unigram_entropy": h1 or float("nan")}, out / name)
        files.append(name)
    return files + claim_figures(claims, out)


def claim_figures(claims: list[tuple[Claim, ClaimVerdict]], out: Path) -> list[str]:
    """The PNGs the claims' kinds draw (:attr:`Claim.figure`, :meth:`Claim.plot`), each over all
    the claims of its kind, in the order of the kinds' first claims; the names of those written."""
    files = []
    for figure, kind in {type(cl).figure: type(cl) for cl, _ in claims if type(cl).figure}.items():
        if kind.plot([(cl, c) for cl, c in claims if type(cl).figure == figure], out / figure):
            files.append(figure)
    return files
