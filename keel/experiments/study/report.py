"""A study's ``report.md`` and PNGs: the verdict table, one section per claim, the
groups no claim reads, best losses, plateau exits and every run."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib.ticker

from keel.config import override_text
from keel.experiments import sensitivity as LS
from keel.experiments import stress as ST
from keel.experiments.plot import plot_loss_curves
from keel.experiments.study.spec import Group, Study
from keel.experiments.study.verdicts import (
    CLAIM_TESTS,
    CLAIM_UNITS,
    MAX_LR_FLOOR,
    NOT_REPRODUCED,
    REPRODUCED,
    baseline_margins,
    best_losses,
    best_lrs,
    claim_reads,
    paired_verdict,
    verdict_words,
)
from keel.train.plots import plt, save_figure


def _pm(v: dict | None, fmt: str = "{:+.3f}") -> str:
    """``mean ± sd [per seed]`` of a :func:`paired_verdict` dict."""
    if not v or v.get("mean") is None:
        return "–"
    per = ", ".join(f"s{seed} {fmt.format(x)}" for seed, x in v["diffs"].items())
    return f"{fmt.format(v['mean'])} ± {abs(v['sd']):.3f} [{per}]" if v["n"] > 1 else f"{fmt.format(v['mean'])} [{per}]"


def claim_numbers(c: dict) -> str:
    """One cell: the numbers behind a claim's verdict."""
    if "parts" in c and c["parts"]:
        return "; ".join(f"{k}: {_pm(v)} ({v['verdict']})" for k, v in c["parts"].items())
    if "margin_best_init" in c and not c["margin_best_init"]["n"]:
        return f"no seed has both schemes' LR grids finished at both inits ({c['sublayers']} sub-layers)"
    if "margin_best_init" in c:
        return f"margin at each scheme's better init ({c['sublayers']} sub-layers): {_pm(c['margin_best_init'])}"
    if "log10_shift" in c:
        row = next(r for r in c["rows"] if r["scheme"] == c["scheme"])
        lo, hi = c["depths"]
        return (f"{c['scheme']} optimal LR per seed: {lo} sub-layers {_lrs(row['opt_lr'][lo])}, "
                f"{hi} sub-layers {_lrs(row['opt_lr'][hi])}" + ("; at an edge of the LR grid" if row["at_edge"] else ""))
    return c.get("why", "–")


def _lrs(d: dict, edge: dict | None = None) -> str:
    """``[s0 X, s1 Y*]``: one LR per seed (``none`` for a missing one; ``*`` where ``edge`` marks
    that seed's LR as an edge of the LRs it trained, :func:`best_lr_at_edge`)."""
    return "[" + ", ".join(f"s{seed} " + ("none" if x is None else f"{x:g}") + ("*" if (edge or {}).get(seed) else "")
                           for seed, x in d.items()) + "]"


def _exits(d: dict) -> str:
    """``[s0 317, s1 never]``: one plateau exit step per seed."""
    return "[" + ", ".join(f"s{seed} " + ("never" if x is None else str(x)) for seed, x in d.items()) + "]"


def direction(v: dict, scheme: str, baseline: str) -> str:
    """What one depth's paired margin (:func:`paired_verdict` of ``baseline - scheme``) says, in
    words that do not read as a verdict on the whole claim: ``{scheme} better`` (every seed >=
    the noise floor), ``{baseline} better``, ``no difference``, ``mixed`` or ``too few seeds``."""
    if v["verdict"] == REPRODUCED:
        return f"{scheme} better"
    if v["verdict"] == NOT_REPRODUCED:  # the opposite holds, or no effect (every seed inside the floor)
        return f"{baseline} better" if all(x <= -v["min_effect"] for x in v["diffs"].values()) else "no difference"
    return "too few seeds" if v["n"] < 2 else "mixed"


def _flagged(row: dict) -> str:
    """``4 of 4 (4 left the plateau later)``: a margin row's flagged baseline runs."""
    n, k = row["baseline_diverged_runs"], row.get("baseline_recovered_runs", 0)
    return f"{n} of {row.get('baseline_runs', n)}" + (f" ({k} left the plateau later)" if k else "")


def claim_rule(claim: dict) -> str:
    """The claim's rule in one line: the first paragraph of its test's docstring, with the
    claim's ``scheme`` (default keel), ``baseline`` and ``order`` filled in."""
    text = " ".join((CLAIM_TESTS[claim["test"]].__doc__ or "").strip().split("\n\n")[0].split())
    return text.format(scheme=claim.get("scheme", "keel"), baseline=claim.get("baseline", "the baseline"),
                       order=" < ".join(claim.get("order", [])), group=claim.get("group", "G"))


def claim_section(claim: dict, c: dict) -> list[str]:
    """Markdown of one claim: verdict, the rule, the table of its rows."""
    out = [f"## ({claim['id']}) {claim['title']}", "", f"**Verdict: {c['verdict']}.** {claim_numbers(c)}", "",
           claim_rule(claim), ""] + ([claim["note"].strip(), ""] if claim.get("note") else [])
    if claim["test"] == "margin_grows":
        s, b = claim["scheme"], claim["baseline"]
        out += [f"| sub-layers | margin ({b} − {s}, nats) mean ± sd [per seed] | at this depth | "
                f"best LR per seed: {b}; {s} | plateau exit step at that LR: {b}; {s} | "
                f"{b} runs the divergence classifier flagged, of those finished |", "|---|---|---|---|---|---|"]
        out += [f"| {r['sublayers']} | {_pm(r['margin'])} | {direction(r['margin'], s, b)} | "
                f"{_lrs(r['best_lr'][b], r.get('best_lr_at_edge', {}).get(b))}; "
                f"{_lrs(r['best_lr'][s], r.get('best_lr_at_edge', {}).get(s))} | "
                f"{_exits(r.get('plateau_exit', {}).get(b, {}))}; {_exits(r.get('plateau_exit', {}).get(s, {}))} | "
                f"{_flagged(r)} |" for r in c["rows"]]
        out += ["", "A best LR marked with an asterisk is the lowest or highest LR that scheme trained at that depth, "
                "so its optimum may lie beyond it (at the deepest depth each scheme trained only the LRs transferred "
                "from the depth before).", "",
                f"The classifier reports a run's first failure: a {b} run flagged as a stagnation (100 steps on "
                "the unigram plateau) may leave the plateau later and still be that seed's best run (each run's "
                "verdict and plateau exit step: the last table)."]
        if c.get("equal_lr"):
            out += ["", "The same margin at equal peak LR (both schemes at that LR; not part of the verdict):", "",
                    "| sub-layers | LR | margin (baseline − scheme, nats) mean ± sd [per seed] |", "|---|---|---|"]
            out += [f"| {r['sublayers']} | {r['lr']:g} | {_pm(r['margin'])} |" for r in c["equal_lr"]]
    elif claim["test"] == "lr_transfer":
        out += ["| scheme | optimal LR per seed, by depth | optimum at a grid edge |", "|---|---|---|"]
        out += [f"| {r['scheme']} | " + "; ".join(f"{L}: {_lrs(v)}" for L, v in r["opt_lr"].items())
                + f" | {'yes' if r['at_edge'] else 'no'} |" for r in c["rows"]]
    elif claim["test"] == "init_margin":
        out += ["| comparison | mean ± sd [per seed] (nats) | verdict |", "|---|---|---|"]
        out += [f"| {k} | {_pm(v)} | {v['verdict']} |" for k, v in c["rows"].items()]
    elif claim["test"] == "max_lr_order":
        out += ["| ramp to | sub-layers | " + " | ".join(claim["order"]) + " |",
                "|---" * (len(claim["order"]) + 2) + "|"]
        out += [f"| {r['peak_lr']:g} ({r['group']}) | {r['sublayers']} | "
                + " | ".join(_lrs(r["max_lr"][s]) if r["max_lr"][s] else "—" for s in claim["order"]) + " |"
                for r in c["rows"]]
        if "peak_lr" in c:
            out += ["", "Max LR per seed; none = no divergence up to the ramp's peak LR; — = not run on that ramp. "
                    "A none counts as the peak LR (censored); a seed where both schemes of a pair are none is left out. "
                    + (f"A pair run on the ramp continued to a higher peak ({claim['extended_group']}, the same LR "
                       "per step) is judged there once all its runs have finished. "
                       if claim.get("extended_group") else "")
                    + "Pair verdicts use log10 ratios of max LR with a 5% floor (log10 1.05 = 0.021). A spike still "
                    "open when the curve ended counts as a divergence. Each run's verdict:", ""]
            out += [f"- ramp to {r['peak_lr']:g}, {r['sublayers']} sub-layers, {run}: {text}" for r in c["rows"]
                    for run, text in r.get("verdicts", {}).items()]
    return out + [""]


def best_loss_table(study: Study, runs: list[dict]) -> list[str]:
    """Markdown: per train group, scheme and depth, the best final validation loss over the
    LR grid per seed (:func:`best_losses`), mean ± sd: every scheme of the study side by side."""
    out = ["## Best loss per scheme and depth", "",
           "Final validation loss (nats/token) at each seed's best LR; seeds with an unfinished LR are left out.", "",
           "| group | sub-layers | scheme | best loss mean ± sd [per seed] | best LR [per seed] |", "|---|---|---|---|---|"]
    for g in study.groups:
        if g.kind != "train":
            continue
        for L in g.sublayers:
            for scheme in g.schemes:
                b = best_losses(runs, [g.name], scheme, L)
                if b:
                    v = paired_verdict(b, study.min_effect, 1)
                    out.append(f"| {g.name} | {L} | {scheme} | {_pm(v, '{:.3f}')} | "
                               f"{_lrs(best_lrs(runs, [g.name], scheme, L))} |")
    return out + [""]


def unclaimed_group_sections(study: Study, runs: list[dict]) -> list[str]:
    """Markdown: one section per group that no claim reads (e.g. the 1024-sub-layer showcase, the
    residual bench): its ``note``, its settings beyond the scale's, and its finished runs (first
    and final validation loss, nats/token; plateau exit step; divergence verdict). No verdict."""
    read = {g for c in study.claims for g, _ in claim_reads(c)}
    out = []
    for g in study.groups:
        if g.name in read:
            continue
        done = [r for r in runs if r["group"] == g.name and r["status"] == "done"]
        planned = sum(r["group"] == g.name for r in runs)
        out += [f"## Group {g.name} (no claim reads it)", ""] + ([g.note.strip(), ""] if g.note else [])
        if g.sets:
            out += [f"Settings beyond the scale's: {', '.join(override_text(x) for x in g.sets)}.", ""]
        out += [f"Runs finished: {len(done)} of {planned}.", ""] + baseline_table(study, g, runs)
        if done:
            out += ["| scheme | sub-layers | LR | seed | tokens | val loss: first → final | plateau exit step | verdict |",
                    "|---|---|---|---|---|---|---|---|"]
            out += [f"| {r['scheme']} | {r['sublayers']} | {r['lr']:g} | {r['seed']} | {r.get('tokens') or 0:,} | "
                    f"{_loss(r.get('first_val_loss'))} → {_loss(r.get('final_val_loss'))} | "
                    f"{_exit_words(r)} | "
                    f"{verdict_words(r)} |" for r in done]
            out.append("")
    return out


def baseline_table(study: Study, g: Group, runs: list[dict]) -> list[str]:
    """Markdown: ``g``'s schemes against its baselines (:func:`baseline_margins`), one row per
    depth and scheme, one column per baseline; empty when ``g`` names none."""
    rows = baseline_margins(study, g, runs)
    if not rows:
        return []
    out = [f"Against group {g.baselines_from}'s {', '.join(g.baselines)} (the same seeds, data and tokens per run): "
           f"margin = loss(baseline) − loss(scheme), nats/token, each side at its seed's best LR of this group's grid "
           f"({', '.join(f'{x:g}' for x in sorted(g.lrs))}); > 0: the scheme is better. In brackets, as the claims' "
           f"rule reads a margin: X better when every seed (≥ {study.min_seeds}) favours X by ≥ {study.min_effect:g}, "
           f"no difference when every seed is within {study.min_effect:g}, else mixed. No claim of the paper.", "",
           "| sub-layers | scheme | " + " | ".join(f"vs {b}" for b in g.baselines) + " |",
           "|---|---|" + "---|" * len(g.baselines)]
    for L in g.sublayers:
        for s in g.schemes:
            cells = [r["margin"] for r in rows if (r["sublayers"], r["scheme"]) == (L, s)]
            out.append(f"| {L} | {s} | " + " | ".join(
                f"{_pm(v)} ({direction(v, s, b)})" if v["n"] else "–" for v, b in zip(cells, g.baselines)) + " |")
    if any(not r["margin"]["n"] for r in rows):
        out += ["", f"–: no seed has both sides finished yet (all of this group's LRs for the scheme and all of group "
                f"{g.baselines_from}'s for the baseline, at that depth)."]
    return out + [""]


def _loss(x: float | None) -> str:
    return "–" if x is None else f"{x:.3f}"


def plateau_table(runs: list[dict]) -> list[str]:
    """Markdown: per group, scheme and depth, the plateau exit step of each seed's best run
    (lowest capped loss over its LRs) and how many of the finished runs never left the plateau."""
    out = ["## When each scheme leaves the unigram plateau", "",
           "Plateau exit: the first step whose 10-step trailing mean training loss is below 95% of the unigram "
           "entropy. Per seed, the run at that seed's best LR (a ramp group: its one run per seed); pending: a run "
           "of that seed is unfinished, so its best LR is not known yet (the finished runs' exit steps are in the "
           "last table).", "",
           "| group | scheme | sub-layers | exit step at the best LR, per seed | finished runs that never left |",
           "|---|---|---|---|---|"]
    done = [r for r in runs if r["status"] == "done"]
    for key in dict.fromkeys((r["group"], r["scheme"], r["sublayers"]) for r in done):
        rs = [r for r in runs if (r["group"], r["scheme"], r["sublayers"]) == key]
        cells = []
        for sd in sorted({r["seed"] for r in rs}):
            mine = [r for r in rs if r["seed"] == sd]
            if any(r["status"] != "done" for r in mine):
                cells.append("pending")
                continue
            step = min(mine, key=lambda r: r["capped_loss"]).get("plateau_exit_step")
            cells.append("never" if step is None else str(step))
        fin = [r for r in rs if r["status"] == "done"]
        never = sum(r.get("plateau_exit_step") is None for r in fin)
        out.append(f"| {key[0]} | {key[1]} | {key[2]} | {', '.join(cells)} | {never} of {len(fin)} |")
    return out + [""]


def _exit_words(r: dict) -> str:
    """A run's plateau exit step for the tables: the step, ``never`` (finished on the plateau),
    ``–`` (not finished)."""
    if r["status"] != "done":
        return "–"
    return "never" if r.get("plateau_exit_step") is None else str(r["plateau_exit_step"])


def runs_table(runs: list[dict]) -> list[str]:
    """Markdown: every run with its tokens, losses, plateau exit step and divergence verdict."""
    out = ["## Every run", "", "| group | scheme | sub-layers | LR | seed | status | tokens | final val loss | "
           "plateau exit step | verdict |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        f = r.get("final_val_loss")
        status = r["status"] + (" (restored)" if r.get("restored") else "")
        out.append(f"| {r['group']} | {r['scheme']} | {r['sublayers']} | {r['lr']:g} | {r['seed']} | {status} | "
                   f"{r.get('tokens') or 0:,} | {'–' if f is None else f'{f:.4f}'} | "
                   f"{_exit_words(r)} | "
                   f"{verdict_words(r) if r['status'] == 'done' else '–'} |")
    return out


def verdict_rule(study: Study, claims: Sequence[dict]) -> str:
    """The report's statement of the verdict rule: :func:`paired_verdict` for every claim but
    those tested by :func:`claim_lr_transfer` (their rule is in their own section)."""
    def ids(cs: Sequence[dict]) -> str:
        return ", ".join(f"({c['id']})" for c in cs)

    paired = [c for c in claims if c["test"] != "lr_transfer"]
    ramp, own = [c for c in paired if c["test"] == "max_lr_order"], [c for c in claims if c["test"] == "lr_transfer"]
    return (f"Rule of {ids(paired)}: paired per-seed differences d, oriented so that the claim predicts d > 0, "
            f"against a noise floor f (nats/token, f = {study.min_effect:g}"
            + (f"; for {ids(ramp)} log10 ratios of max LR, f = log10 1.05 = {MAX_LR_FLOOR:.3f}, a 5% ratio"
               if ramp else "") + "). "
            f"Reproduced when every seed (≥ {study.min_seeds}) has d ≥ f; not reproduced when "
            "every seed has d ≤ −f, or every seed has |d| < f (no effect); "
            "inconclusive otherwise (mixed, too few seeds). A claim with several parts (e.g. the margin at the "
            "deepest depth and its growth with depth) is reproduced only when every part is, not reproduced when "
            "any part is not." + (f" {ids(own)} has its own rule, stated in its section." if own else ""))


def unfinished_words(study: Study, runs: list[dict]) -> str:
    """" Unfinished: transfer 4 (deepnorm; read by no claim); ..." for the report's count line:
    per group its planned runs not finished yet, their schemes, and the claims whose verdicts
    they can still change."""
    pending = [r for r in runs if r["status"] != "done"]
    parts = []
    for g in dict.fromkeys(r["group"] for r in pending):
        schemes = list(dict.fromkeys(r["scheme"] for r in pending if r["group"] == g))
        readers = [f"({c['id']})" for c in study.claims if any((g, x) in claim_reads(c) for x in schemes)]
        parts.append(f"{g} {sum(r['group'] == g for r in pending)} ({', '.join(schemes)}; read by "
                     f"{', '.join(readers) if readers else 'no claim'})")
    return f" Unfinished: {'; '.join(parts)}." if parts else ""


def tokens_words(study: Study, done: list[dict]) -> str:
    """" (tokens per finished run: ...)" for the report's count line: the distinct budgets of the
    training runs, and the range of the ramp runs, which stop at their divergence."""
    ramp = {g.name for g in study.groups if g.kind == "ramp"}
    train = sorted({r["tokens"] for r in done if r.get("tokens") and r["group"] not in ramp})
    stopped = sorted(r["tokens"] for r in done if r.get("tokens") and r["group"] in ramp)
    parts = ([f"training runs {', '.join(f'{t:,}' for t in train)}"] if train else []) + (
        [f"ramp runs {stopped[0]:,}" + (f"–{stopped[-1]:,}" if stopped[-1] != stopped[0] else "")
         + " (a ramp run stops at its divergence)"] if stopped else [])
    return f" (tokens per finished run: {'; '.join(parts)})" if parts else ""


def restored_words(runs: list[dict], restore: str | Path | None) -> str:
    """The report's line on runs restored from an earlier report (``keel study --restore``)."""
    n = sum(1 for r in runs if r.get("restored"))
    if not n:
        return ""
    return (f" {n} of the finished runs were restored from `{restore}` (an earlier report of this study: their "
            "numbers, not their run folders; their loss curves are not redrawn here).")


def report_markdown(study: Study, claims: list[tuple[dict, dict]], runs: list[dict], command: str,
                    waiting: Sequence[str] = (), restore: str | Path | None = None) -> str:
    """``report.md``: the verdict table, one section per claim, every run."""
    done = [r for r in runs if r["status"] == "done"]
    lines = [f"# Study `{study.name}`, scale `{study.scale}`", "", study.note, "",
             f"Runs finished: {len(done)} of {len(runs)} planned so far{tokens_words(study, done)}."
             + unfinished_words(study, runs)
             + (" The ramp groups' reference runs (the scale's `--dry-run` counts them) are not counted."
                if any(g.kind == "ramp" for g in study.groups) else "")
             + (f" Not planned yet: {'; '.join(waiting)}." if waiting else "") + restored_words(runs, restore),
             f"Command: `{command}`", ""]
    if claims:  # a study of groups only (e.g. a bench) has no verdicts
        lines += ["## Verdicts", "", verdict_rule(study, [cl for cl, _ in claims]), "",
                  "| claim | verdict | numbers: mean ± sd [per seed] | unit |", "|---|---|---|---|"]
        lines += [f"| ({cl['id']}) {cl['title']} | **{c['verdict']}** | {claim_numbers(c)} | "
                  f"{CLAIM_UNITS[cl['test']]} |" for cl, c in claims] + [""]
    for cl, c in claims:
        lines += claim_section(cl, c)
    return "\n".join(lines + unclaimed_group_sections(study, runs) + best_loss_table(study, runs)
                     + plateau_table(runs) + runs_table(runs)) + "\n"


def plot_margins(claims: list[tuple[dict, dict]], out: Path) -> bool:
    """Margin (baseline − scheme, nats) against depth (log x) for every margin claim: the seed
    mean as a line, every seed as a dot (two seeds: a mean ± sd bar would hide them);
    False (nothing written) when no claim has two depths."""
    series = [(cl, c) for cl, c in claims if cl["test"] == "margin_grows" and len(c.get("rows", [])) >= 2]
    if not series:
        return False
    fig, ax = plt.subplots(figsize=(6, 4.2))
    for cl, c in series:
        xs = [r["sublayers"] for r in c["rows"]]
        line = ax.plot(xs, [r["margin"]["mean"] for r in c["rows"]], marker="o",
                       label=f"({cl['id']}) {cl['baseline']} − {cl['scheme']} (line: seed mean; dots: seeds)")[0]
        seeds = [(r["sublayers"], d) for r in c["rows"] for d in r["margin"]["diffs"].values()]
        ax.scatter([x for x, _ in seeds], [d for _, d in seeds], s=14, alpha=0.6, color=line.get_color())
    ax.axhline(0, color="gray", lw=1)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({r["sublayers"] for _, c in series for r in c["rows"]}))
    ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("depth (sub-layers)")
    ax.set_ylabel("final validation loss margin (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(fig, out)
    return True


def write_plots(study: Study, runs: list[dict], claims: list[tuple[dict, dict]], out: Path, h1: float | None) -> list[str]:
    """The report's PNGs: loss against LR per train group with an LR grid, the ramp (loss
    against LR), margins against depth, loss curves of single-LR groups. Returns the file names."""
    files = []
    for g in study.groups:
        done = [r for r in runs if r["group"] == g.name and r["status"] == "done"]
        curves = g.kind == "ramp" or len(g.lrs) <= 1  # drawn from the run folders' metrics
        if curves:
            done = [r for r in done if not r.get("restored")]  # a restored run has no run folder
        if not done:
            continue
        name = f"{g.name}.png"
        if g.kind == "ramp":
            results = [{**r["result"], "run_dir": str(out / g.name / r["name"])} for r in done]
            ST.plot_stress(results, g.schemes, g.sublayers, out / name)
        elif len(g.lrs) > 1:  # with the baselines' runs of the group they are compared with, if any
            refs = [r for r in runs if r["group"] == g.baselines_from and r["scheme"] in g.baselines
                    and r["status"] == "done"]
            schemes = g.schemes + [b for b in g.baselines if b not in g.schemes]
            cells = LS.summarise([r["result"] for r in done + refs], schemes, g.sublayers, g.lrs, g.seeds)
            LS.plot({"sublayers": g.sublayers, "cells": cells, "lrs": sorted(g.lrs), "schemes": schemes,
                     "unigram_entropy": h1 or float("nan")}, out / name)
        else:
            plot_loss_curves([out / g.name / r["name"] for r in done], out / name, smooth=10,
                             labels=[f"{r['scheme']} L{r['sublayers']} LR {r['lr']:g} s{r['seed']}" for r in done],
                             title=f"group {g.name}")
        files.append(name)
    if plot_margins(claims, out / "margins.png"):
        files.append("margins.png")
    return files


