"""``keel lr-sensitivity``: final loss against a grid of constant peak learning rates, per
residual scheme and depth (Wortsman et al. 2023, "Small-scale proxies for large-scale
Transformer training instabilities", arXiv 2309.14322, Sec. 3.2).

Every point (scheme x depth x peak LR x seed) is an ordinary training run with the usual
schedule (linear warm-up, then cosine to ``train.min_lr``). The command is a study preset
(:func:`keel.experiments.presets.run_lr_sensitivity`): one train group run by the one engine
(:func:`keel.experiments.study.run.execute`): finished runs are cached, an interrupted grid
continues with ``--resume``, ``--dry-run`` plans it. Runs are named
``L<sub-layers>_seed<S>_<scheme>_lr<LR>`` and run in the order depths x schemes x LRs x seeds
as given on the command line (put the most informative depth first; the seeds of one point
run side by side).

Per (scheme, depth, seed), with ``l(eta)`` the final validation loss at peak LR ``eta``
(nats/token) and ``l0`` the validation loss at initialisation (step 0):

* optimal LR ``eta* = argmin_eta l(eta)``; best loss ``min_eta l(eta)``;
* max LR past the plateau: the largest LR whose final loss is below the divergence
  classifier's stagnation level ``0.95 * H1`` (``H1`` = unigram entropy of the training
  tokens): the run learnt more than token frequencies;
* LR sensitivity (Wortsman et al. 2023, Sec. 3.2)::

      S = mean over the LR grid of [ min(l(eta), l0) - min_eta l(eta) ]

  A run without a finite final loss (non-finite, stopped) counts as ``l0``. Caveat: a
  scheme that stays on the unigram plateau at every LR has a *low* sensitivity (its
  curve is flat); read it together with the best loss.

Seeds are then summarised by mean and sample standard deviation (``sd``, ddof = 1; 0 for
one seed); the optimal LR of a cell is also read off the seed-mean curve (``opt_lr``),
with a flag when it sits at either end of the LR grid (the grid is then too narrow).

Outputs in ``--out``: the run folders, the engine's one report (``report.md``: the table
(:func:`markdown`) is its section "Group sensitivity: LR sensitivity"; ``report.json``:
``group_tables["sensitivity"]``, the settings, every run's summary, the per-seed and per-cell
numbers) and ``sensitivity.png`` (loss against LR, log x, one panel per depth, one line per
scheme, with the init loss and the unigram entropy of the training tokens as horizontal lines).
``sensitivity.json`` / ``sensitivity.md`` are deprecated aliases (one release) of the same data
and table. A study's train group with ``table = true`` gets the same section.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from pathlib import Path

from keel.errors import KeelError, plural
from keel.experiments.analysis import lowest, mean_sd, pair
from keel.experiments.record import RunRecord
from keel.experiments.table import markdown_table
from keel.train.plots import plt, save_figure

OUT_JSON, OUT_MD, OUT_PNG = "sensitivity.json", "sensitivity.md", "sensitivity.png"


# ----------------------------------------------------------------------------- formulas
def lr_sensitivity(losses: Sequence[float | None], init_loss: float) -> float:
    """Wortsman et al. 2023 (arXiv 2309.14322, Sec. 3.2) LR sensitivity of one curve.

    ``S = mean_i [min(l_i, l0) - min_j l_j]`` over the LR grid, where a missing or
    non-finite ``l_i`` (a diverged run) counts as ``l0`` and the minimum is taken over the
    capped losses. Units: nats/token.

    Args:
        losses: final loss at each LR of the grid (None / NaN / inf = diverged).
        init_loss: ``l0``, the loss at initialisation (finite).
    Raises:
        KeelError: empty grid or non-finite ``init_loss``.
    """
    if not losses:
        raise KeelError("LR sensitivity of an empty LR grid")
    if init_loss is None or not math.isfinite(init_loss):
        raise KeelError(f"LR sensitivity needs a finite initial loss, got {init_loss}")
    capped = [min(x, init_loss) if x is not None and math.isfinite(x) else init_loss for x in losses]
    best = min(capped)
    return sum(c - best for c in capped) / len(capped)


def _final_loss(run: RunRecord) -> float | None:
    v = run.final_val_loss if run.status == "done" else None
    return v if v is not None and math.isfinite(v) else None


def seed_curve(runs: Sequence[RunRecord], lrs: Sequence[float]) -> dict | None:
    """Numbers of one (scheme, depth, seed) over the LR grid, or None until every LR finished.

    ``runs`` are the run records of that curve. Returns
    ``losses`` (per LR; None = no finite final loss), ``capped`` (``min(l, l0)``, diverged =
    ``l0``), ``init_loss`` (mean step-0 validation loss of the runs), ``opt_lr``, ``best_loss``,
    ``sensitivity`` (:func:`lr_sensitivity`).
    """
    by_lr = {r.lr: r for r in runs if r.status == "done"}
    lrs = sorted(lrs)
    if any(lr not in by_lr for lr in lrs):
        return None
    inits = [by_lr[lr].first_val_loss for lr in lrs]
    inits = [x for x in inits if x is not None and math.isfinite(x)]
    if not inits:
        return None
    l0 = statistics.fmean(inits)
    losses = [_final_loss(by_lr[lr]) for lr in lrs]
    capped = [min(x, l0) if x is not None else l0 for x in losses]
    i = lowest(capped, float)
    return {"losses": losses, "capped": capped, "init_loss": l0, "opt_lr": lrs[i], "best_loss": capped[i],
            "sensitivity": lr_sensitivity(losses, l0)}


def max_lr_below(losses: Sequence[float | None], lrs: Sequence[float], level: float) -> float | None:
    """The largest LR of the grid whose final loss is below ``level`` (nats), e.g. the unigram
    entropy (the run learnt more than token frequencies); None if there is none."""
    ok = [lr for lr, x in zip(lrs, losses) if x is not None and x < level]
    return max(ok) if ok else None


def cell_summary(curves: Sequence[dict], lrs: Sequence[float]) -> dict:
    """Seeds of one (scheme, depth) cell: mean / sd of best loss, sensitivity and log10 of
    the optimal LR; the seed-mean curve and its argmin ``opt_lr`` (``at_edge`` if that is
    the first or last LR of the grid); ``n_seeds``."""
    out: dict = {"n_seeds": len(curves)}
    if not curves:
        return out
    for key in ("best_loss", "sensitivity", "init_loss"):
        out[key], out[f"{key}_sd"] = mean_sd([c[key] for c in curves])
    log_opt = [math.log10(c["opt_lr"]) for c in curves]
    out["log10_opt_lr"], out["log10_opt_lr_sd"] = mean_sd(log_opt)
    out["seed_opt_lrs"] = [c["opt_lr"] for c in curves]
    out["seed_max_lr_past_plateau"] = [c.get("max_lr_past_plateau") for c in curves]
    mean_curve = [statistics.fmean(c["capped"][i] for c in curves) for i in range(len(lrs))]
    i = lowest(mean_curve, float)
    out.update(mean_curve=mean_curve, opt_lr=lrs[i], at_edge=i in (0, len(lrs) - 1) and len(lrs) > 1)
    return out


# ----------------------------------------------------------------------------- grid
def summarise(runs: Sequence[RunRecord], schemes: Sequence[str], sublayers: Sequence[int],
              lrs: Sequence[float], seeds: Sequence[int], plateau_level: float | None = None) -> list[dict]:
    """One row per (depth, scheme) of the run records ``runs``, in the given order: ``sublayers``, ``scheme``,
    ``lrs`` (the sorted LR grid the row is over), ``seeds`` (``{seed: seed_curve}`` for the seeds whose
    curve is complete, each with ``max_lr_past_plateau`` = :func:`max_lr_below` ``plateau_level`` when that is given) and
    the :func:`cell_summary` fields."""
    lrs = sorted(lrs)
    rows = []
    for L in sublayers:
        for s in schemes:
            per_seed = {}
            for seed in seeds:
                c = seed_curve([r for r in runs if (r.scheme, r.sublayers, r.seed) == (s, L, seed)], lrs)
                if c is not None:
                    if plateau_level is not None:
                        c["max_lr_past_plateau"] = max_lr_below(c["losses"], lrs, plateau_level)
                    per_seed[seed] = c
            rows.append({"sublayers": L, "scheme": s, "lrs": lrs, "seeds": per_seed,
                         **cell_summary(list(per_seed.values()), lrs)})
    return rows


# ----------------------------------------------------------------------------- outputs
def _pm(mean, sd, fmt="{:.3f}") -> str:
    if mean is None:
        return "–"
    return fmt.format(mean) if not sd else f"{fmt.format(mean)} ± {fmt.format(sd)}"


def markdown(summary: dict) -> str:
    """The ``sensitivity.md`` table: one row per depth and scheme with at least one complete seed."""
    lrs = summary["lrs"]
    lines = [(f"LR grid: {', '.join(f'{x:g}' for x in lrs)}; unigram entropy of the training tokens "
              f"{summary['unigram_entropy']:.3f} nats (plateau level 95% of it: "
              f"{(summary.get('plateau_level') or 0):.3f})."), ""]
    lines += markdown_table(  # a cell not run (or not finished) at its depth has no row
        ["sub-layers", "scheme", "seeds", "optimal LR (seed mean curve)", "optimal LR per seed", "best loss",
         "LR sensitivity", "init loss"],
        [[r["sublayers"], r["scheme"], r["n_seeds"], f"{r['opt_lr']:g}" + (" (edge)" if r["at_edge"] else ""),
          ", ".join(f"{x:g}" for x in r["seed_opt_lrs"]), _pm(r["best_loss"], r["best_loss_sd"]),
          _pm(r["sensitivity"], r["sensitivity_sd"]), _pm(r["init_loss"], r["init_loss_sd"])]
         for r in summary["cells"] if r["n_seeds"]])
    lines += ["", ("Losses: final validation loss, nats/token, mean ± sd over seeds. LR sensitivity: Wortsman et al. "
                   "2023 (arXiv 2309.14322), mean over the LR grid of min(loss, init loss) − best loss. "
                   "(edge): the optimum is at an end of the LR grid.")]
    return "\n".join(lines + transfer_lines(summary) + paired_lines(summary, "pre_ln")
                     + paired_lines(summary, "keel")) + "\n"


def _fmt_lrs(xs) -> str:
    return ", ".join("none" if x is None else f"{x:g}" for x in xs)


def transfer_lines(summary: dict) -> list[str]:
    """Markdown: optimal LR (seed-mean curve; per seed in brackets) and the largest LR whose
    final loss is below the plateau level (per seed), per scheme (rows) and depth (columns)."""
    depths = [L for L in summary["sublayers"] if any(r["sublayers"] == L and r["n_seeds"] for r in summary["cells"])]
    if not depths:
        return []
    out = ["", "## Optimal LR against depth (LR transfer)", "",
           ("Cell: optimal LR of the seed-mean curve [per seed]; the largest LR whose final loss is below "
            f"the unigram plateau ({summary.get('plateau_level') or 0:.3f} nats = 95% of the unigram entropy), "
            "per seed."), ""]
    rows = []
    for s in summary["schemes"]:
        cells = []
        for L in depths:
            r = next((r for r in summary["cells"] if r["sublayers"] == L and r["scheme"] == s), None)
            cells.append("–" if not r or not r["n_seeds"] else
                         f"{r['opt_lr']:g} [{_fmt_lrs(r['seed_opt_lrs'])}]; {_fmt_lrs(r['seed_max_lr_past_plateau'])}")
        if any(c != "–" for c in cells):
            rows.append([s, *cells])
    return out + markdown_table(["scheme", *(f"{L} sub-layers" for L in depths)], rows)


def paired_differences(summary: dict, scheme: str, baseline: str, key: str) -> list[dict]:
    """Per depth: ``{sublayers, diffs: {seed: x_scheme - x_baseline}, mean, sd}`` of the per-seed
    ``key`` (``best_loss`` or ``sensitivity``) over the seeds both have (paired: same seed =
    same data order and init draws). Depths where they share no seed are left out."""
    rows = []
    for L in summary["sublayers"]:
        a = next((r for r in summary["cells"] if r["sublayers"] == L and r["scheme"] == scheme), None)
        b = next((r for r in summary["cells"] if r["sublayers"] == L and r["scheme"] == baseline), None)
        if not a or not b:
            continue
        diffs = pair({sd: c[key] for sd, c in a["seeds"].items()}, {sd: c[key] for sd, c in b["seeds"].items()})
        if not diffs:
            continue
        m, sdv = mean_sd(list(diffs.values()))
        rows.append({"sublayers": L, "diffs": diffs, "mean": m, "sd": sdv})
    return rows


def paired_lines(summary: dict, baseline: str = "pre_ln") -> list[str]:
    """Markdown: paired (per-seed) differences of best loss and LR sensitivity, scheme − baseline."""
    if baseline not in summary["schemes"]:
        return []
    out = []
    for s in summary["schemes"]:
        if s == baseline:
            continue
        best = {r["sublayers"]: r for r in paired_differences(summary, s, baseline, "best_loss")}
        sens = {r["sublayers"]: r for r in paired_differences(summary, s, baseline, "sensitivity")}
        for L, r in best.items():
            out.append([L, s, ", ".join(f"{d:+.3f}" for d in r["diffs"].values()), f"{r['mean']:+.3f}",
                        ", ".join(f"{d:+.3f}" for d in sens[L]["diffs"].values()), f"{sens[L]['mean']:+.3f}"])
    if not out:
        return []
    return ["", f"## Paired differences against {baseline} (same seed)", ""] + markdown_table(
        ["sub-layers", "scheme", "Δ best loss per seed", "mean Δ best loss", "Δ sensitivity per seed",
         "mean Δ sensitivity"], out)


def plot(summary: dict, out: str | Path) -> None:
    """Loss against LR (log x), one panel per depth that has results, one line per scheme
    (seed mean over the row's own ``lrs``, e.g. a study cell's widened grid, else ``summary["lrs"]``;
    the error bars span the seeds' capped losses; one colour per scheme in every panel); dashed: init
    loss, dotted: unigram entropy."""
    depths = [L for L in summary["sublayers"] if any(r["sublayers"] == L and r["n_seeds"] for r in summary["cells"])]
    depths = depths or summary["sublayers"][:1]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    fig, axes = plt.subplots(1, len(depths), figsize=(5.5 * len(depths), 4.2), squeeze=False)
    for ax, L in zip(axes[0], depths):
        rows = [r for r in summary["cells"] if r["sublayers"] == L and r["n_seeds"]]
        for r in rows:
            curves, lrs = list(r["seeds"].values()), r.get("lrs", summary["lrs"])
            lo = [min(c["capped"][i] for c in curves) for i in range(len(lrs))]
            hi = [max(c["capped"][i] for c in curves) for i in range(len(lrs))]
            m = r["mean_curve"]
            c = colors[summary["schemes"].index(r["scheme"]) % len(colors)]
            ax.errorbar(lrs, m, yerr=[[a - b for a, b in zip(m, lo)], [b - a for a, b in zip(m, hi)]],
                        marker="o", ms=3, lw=1.2, capsize=2, color=c, label=f"{r['scheme']} (n={r['n_seeds']})")
        if rows:
            ax.axhline(statistics.fmean(r["init_loss"] for r in rows), color="gray", ls="--", lw=1, label="init loss")
        ax.axhline(summary["unigram_entropy"], color="black", ls=":", lw=1, label="unigram entropy")
        ax.set_xscale("log")
        ax.set_xlabel("peak learning rate")
        ax.set_ylabel("final validation loss (nats/token)")
        ax.set_title(f"{L} sub-layers ({plural(L // 2, 'block')})")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    save_figure(fig, out)

