"""``keel stress``: the Keel paper's max-LR stress test (Chen & Wei 2026, arXiv 2601.19895,
Sec. 5.1, Table 1), over a grid of residual schemes x depths x seeds.

Each run trains with the usual recipe (:func:`keel.train.train`: AdamW (0.9, 0.95), weight
decay 0.01, clipping 1.0) but with ``train.warmup_steps = train.steps = ramp`` and
``train.lr = peak``, so the LR of optimiser step k (1-based, as logged in metrics.jsonl) is
``peak * k / ramp`` (:func:`keel.train.optim.lr_at` with step k - 1 < warmup): a linear
ramp from 0 to the peak (paper: 5e-2 over 5000 steps). ``train.stop_on_divergence`` is on, so
the online divergence classifier (:mod:`keel.diagnostics.divergence`) stops a diverged run.

**Reference runs.** "Optimisation degradation" is judged against a healthy baseline (the
paper's Figure 3). For every (depth, seed) the grid first trains one *reference run*: the
``--reference-scheme`` (default ``pre_ln``, the standard the paper compares against) on the
same ramp, data, shape and seed, with ``train.stop_on_divergence`` off so that its curve
covers the whole ramp. Every stress run of that depth and seed gets
``train.divergence_reference = <reference run>`` and its verdict is
:func:`keel.diagnostics.divergence.run_verdict` against that curve and the unigram entropy of
the training tokens. The same ramp (not a constant LR) keeps early progress comparable: with
a constant-LR reference, every ramp run would be "behind" while its LR is still tiny. A
reference that itself fails only weakens the test (degradation needs the reference to have
made progress); the reference scheme's own run is, by construction, never degraded, and no run
is called stagnant on the unigram plateau while the reference is still on it.

"Max LR" is the LR at the last step before divergence: the ``lr`` logged at step
``verdict.step - 1`` (0.0 if the run failed at step 1). A run that never diverged has no
max LR ("no divergence up to peak LR X").

The runs are jobs of :func:`keel.experiments.grid.run_grid` (as ``keel sweep``): worker
processes, finished runs cached, an interrupted grid continued with ``--resume``, a run
folder with another config refused. Each run's ``result.json`` is the ``keel sweep`` run
summary (:func:`keel.experiments.sweep.run_summary`: one vocabulary, ``healthy`` /
``stagnation`` / ``instability`` / ``degradation``, and a ``reference`` field naming the
reference run) plus ``scheme``, ``sublayers``, ``blocks``, ``seed``, ``peak_lr``,
``ramp_steps`` and ``max_lr``. Layout of ``--out`` (default ``runs/stress``)::

    OUT/references/<ref scheme>-<L>sl-seed<S>/   the reference runs (a grid of their own)
    OUT/<scheme>-<L>sl-seed<S>/                  one run directory per stress run
    OUT/stress.json                              all results + the table
    OUT/stress.md                                the table, laid out like the paper's Table 1
    OUT/stress.png                               loss against LR (log x), one panel per depth
"""

from __future__ import annotations

import functools
import json
import logging
import math
import statistics
from pathlib import Path
from typing import Sequence

from keel.config import Override, load_config, resolve_config_path
from keel.data import resolve_data
from keel.errors import KeelError
from keel.experiments.executor import Executor
from keel.experiments.grid import check_reportable, GridJob, cached_result, run_grid
from keel.experiments.sweep import check_train_job, train_task
from keel.io import atomic_write_text, make_dirs
from keel.model import SCHEMES
from keel.train.metrics import read_metrics
from keel.train.plots import plt, save_figure

_log = logging.getLogger(__name__)

REFERENCES = "references"


def run_name(scheme: str, sublayers: int, seed: int) -> str:
    """Directory name of one run, e.g. ``keel-64sl-seed0`` (depth in sub-layers)."""
    return f"{scheme}-{sublayers}sl-seed{seed}"


def run_overrides(scheme: str, sublayers: int, seed: int, peak_lr: float, ramp_steps: int,
                  user_sets: Sequence[Override]) -> list[Override]:
    """The overrides of one run (:func:`keel.config.apply_overrides`): quiet, cheap defaults, then
    the user's (``--set`` strings or typed pairs), then the forced ramp keys."""
    soft = ["train.progress=false", "train.eval_tokens=4096", f"train.eval_every={ramp_steps}",
            "train.checkpoint_every=50", "train.keep_checkpoints=1", "train.sample_tokens=16"]
    forced = [f"model.residual={scheme}", f"model.n_layers={sublayers // 2}", f"train.steps={ramp_steps}",
              f"train.warmup_steps={ramp_steps}", f"train.lr={peak_lr!r}", f"train.seed={seed}",
              "train.stop_on_divergence=true"]
    return soft + list(user_sets) + forced


def max_lr(records: list[dict], verdict_step: int) -> float:
    """LR (absolute) logged at step ``verdict_step - 1``, the last step before divergence; 0.0 at step 1."""
    if verdict_step <= 1:
        return 0.0
    for r in records:
        if r.get("step") == verdict_step - 1 and "lr" in r:
            return float(r["lr"])
    raise KeelError(f"no LR logged at step {verdict_step - 1}")


def stress_task(job: GridJob, run_dir: Path, resume: bool) -> dict:
    """Grid task of one stress run: train it (:func:`keel.experiments.sweep.train_task`),
    then add its coordinates (``job.values``) and its max LR (:func:`max_lr`)."""
    out = train_task(job, run_dir, resume)
    out.update(job.values)
    out["name"] = job.name
    out["run_dir"] = str(run_dir)
    records = read_metrics(Path(run_dir) / "metrics.jsonl")
    out["max_lr"] = max_lr(records, out["divergence"]["step"]) if out["diverged"] else None
    return out


def reference_name(scheme: str, sublayers: int, seed: int) -> str:
    """Folder name of a reference run under ``OUT/references``."""
    return run_name(scheme, sublayers, seed)


def stress_table(results: list[dict], schemes: list[str], depths: list[int]) -> dict:
    """Table 1 layout: one row per depth (sub-layers), one cell per scheme.

    A cell has ``n`` (runs), ``n_diverged``, and over all its runs, a run that did not
    diverge counting as +inf: ``median``, ``min``, ``max`` max-LR (absolute; None when
    infinite), and ``text``: ``"7.6e-03 (5.1e-03–8.0e-03)"``, ``"no div."`` when none
    diverged, with ``", k/n no div."`` appended when only some did; ``"–"`` for no runs.
    """
    rows = []
    for L in depths:
        cells = {}
        for s in schemes:
            rs = [r for r in results if r["scheme"] == s and r["sublayers"] == L]
            vals = [r["max_lr"] if r["diverged"] else math.inf for r in rs]
            n, nd = len(rs), sum(r["diverged"] for r in rs)
            cell = {"n": n, "n_diverged": nd, "median": None, "min": None, "max": None}
            if n == 0:
                cell["text"] = "–"
            elif nd == 0:
                cell["text"] = "no div."
            else:
                med, lo, hi = statistics.median(vals), min(vals), max(vals)
                cell.update({k: (x if math.isfinite(x) else None) for k, x in (("median", med), ("min", lo), ("max", hi))})
                fmt = (lambda x: f"{x:.2e}" if math.isfinite(x) else "no div.")
                cell["text"] = fmt(med) if n == 1 else f"{fmt(med)} ({fmt(lo)}–{fmt(hi)})"
                if nd < n:
                    cell["text"] += f", {n - nd}/{n} no div."
            cells[s] = cell
        rows.append({"sublayers": L, "blocks": L // 2, "cells": cells})
    return {"columns": list(schemes), "rows": rows}


def table_markdown(table: dict, peak_lr: float | None = None) -> str:
    """The table as markdown: rows = depths ("64 (32 blocks)"), columns = schemes."""
    cols = table["columns"]
    lines = ["| depth: sub-layers (blocks) | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for row in table["rows"]:
        lines.append(f"| {row['sublayers']} ({row['blocks']} blocks) | "
                     + " | ".join(row["cells"][c]["text"] for c in cols) + " |")
    note = "Cells: median max LR over seeds (min–max); \"no div.\": no divergence"
    note += f" up to the peak LR {peak_lr:g}." if peak_lr else "."
    return "\n".join(lines) + "\n\n" + note + "\n"


def plot_stress(results: list[dict], schemes: list[str], depths: list[int], out: Path) -> None:
    """Training loss against LR (log x), one panel per depth, one colour per scheme, one line
    per seed; a cross marks each run's divergence step. Written atomically as PNG."""
    fig, axes = plt.subplots(1, len(depths), figsize=(6 * len(depths), 4.2), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, L in zip(axes[0], depths):
        for i, s in enumerate(schemes):
            c = colors[i % len(colors)]
            for j, r in enumerate(x for x in results if x["scheme"] == s and x["sublayers"] == L):
                recs = [q for q in read_metrics(Path(r["run_dir"]) / "metrics.jsonl")
                        if "loss" in q and q.get("lr", 0) > 0 and math.isfinite(q["loss"])]
                if not recs:
                    continue
                ax.plot([q["lr"] for q in recs], [q["loss"] for q in recs], color=c, lw=0.8, alpha=0.75,
                        label=s if j == 0 else None)
                if r["diverged"]:
                    at = [q for q in recs if q["step"] == r["divergence"]["step"]]
                    if at:
                        ax.plot([at[0]["lr"]], [at[0]["loss"]], "x", color=c, ms=8, mew=2)
        ax.set_xscale("log")
        ax.set_xlabel("learning rate")
        ax.set_ylabel("training loss (nats/token)")
        ax.set_title(f"{L} sub-layers ({L // 2} blocks); x = divergence onset")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    save_figure(fig, out)


def stress_jobs(cfg_path, overrides: Sequence[Override], schemes: list[str], sublayers: list[int], seeds: list[int],
                peak_lr: float, ramp_steps: int, data_dir: Path, out: Path,
                reference_scheme: str = "pre_ln") -> tuple[list[GridJob], list[GridJob]]:
    """(reference jobs, stress jobs), seed-major (a partial grid covers every scheme and depth
    first). Each stress job's config names its reference run (``train.divergence_reference``,
    an absolute path under ``out/references``). Raises KeelError on a bad config."""
    refs, jobs = [], []
    for seed in seeds:
        for L in sublayers:
            vals = {"sublayers": L, "blocks": L // 2, "seed": seed, "peak_lr": peak_lr, "ramp_steps": ramp_steps}
            ref_name = reference_name(reference_scheme, L, seed)
            ref_dir = (out / REFERENCES / ref_name).resolve()
            sets = run_overrides(reference_scheme, L, seed, peak_lr, ramp_steps, overrides)
            cfg = load_config(cfg_path, sets + [("data.path", str(data_dir)), ("train.stop_on_divergence", False)])
            refs.append(GridJob(ref_name, cfg.to_dict(), {"scheme": reference_scheme, **vals}))
            for s in schemes:
                sets = run_overrides(s, L, seed, peak_lr, ramp_steps, overrides)
                cfg = load_config(cfg_path, sets + [("data.path", str(data_dir)),
                                                    ("train.divergence_reference", str(ref_dir))])
                jobs.append(GridJob(run_name(s, L, seed), cfg.to_dict(), {"scheme": s, **vals}))
    return refs, jobs


def _check_args(schemes, sublayers, seeds, peak_lr, ramp_steps, workers, reference_scheme) -> None:
    for s in list(schemes) + [reference_scheme]:
        if s not in SCHEMES:
            raise KeelError(f"unknown scheme {s!r} (available: {', '.join(SCHEMES)})")
    for L in sublayers:
        if L < 2 or L % 2:
            raise KeelError(f"--sublayers counts sub-layers (2 per block) and must be even and >= 2, got {L}")
    if not (math.isfinite(peak_lr) and peak_lr > 0):
        raise KeelError(f"--peak-lr must be > 0, got {peak_lr}")
    if ramp_steps < 2:
        raise KeelError(f"--ramp-steps must be >= 2, got {ramp_steps}")
    if workers < 0:
        raise KeelError(f"--workers must be >= 0, got {workers}")
    if len(set(schemes)) != len(schemes) or len(set(sublayers)) != len(sublayers) or len(set(seeds)) != len(seeds):
        raise KeelError("--residual, --sublayers and --seeds must not repeat a value")


def _finished(out: Path, jobs: list, refs: list) -> tuple[list[dict], list[dict]]:
    """The finished runs' and references' results in ``out`` (``--report-only``).

    Raises:
        KeelError: no run of the grid has finished."""
    results = [r for r in (cached_result(out / j.name) for j in jobs) if r is not None]
    ref_results = [r for r in (cached_result(out / REFERENCES / j.name) for j in refs) if r is not None]
    _log.info(f"  report only: {len(results)}/{len(jobs)} runs finished")
    if not results:
        raise KeelError(f"{out} holds no finished run of this stress test: nothing to report; "
                        "check --out and the grid flags")
    return results, ref_results


def run_stress(config: str | None = None, overrides: list[str] | None = None, schemes: list[str] = ("pre_ln", "keel"),
               sublayers: list[int] = (64,), seeds: list[int] = (0,), peak_lr: float = 5e-2, ramp_steps: int = 1000,
               out: str | Path = "runs/stress", workers: int = 1, threads: int = 0, resume: bool = False,
               report_only: bool = False, reference_scheme: str = "pre_ln", executor: Executor | None = None) -> dict:
    """Run (or complete) the stress grid and write stress.json / stress.md / stress.png.

    Args:
        config: base config file or preset name (default ``demo``).
        overrides: ``section.key=value`` strings applied to every run (e.g. ``model.d_model=64``).
        schemes: residual schemes, each in ``keel.model.SCHEMES``.
        sublayers: depths L in sub-layers (each even; n_layers = L / 2 blocks).
        seeds: ``train.seed`` values.
        peak_lr: LR at the end of the linear ramp (absolute).
        ramp_steps: optimiser steps of the ramp (0 -> peak).
        out: output folder.
        workers: worker processes (0 = in this process); threads: torch threads per worker
            (0 = cores / workers).
        resume: continue a non-empty ``out`` (finished runs cached, interrupted ones resumed).
        report_only: train nothing; tabulate the finished runs of the grid only.
        reference_scheme: the scheme of the reference runs (see the module docstring).
        executor: where the runs go (:func:`keel.experiments.grid.run_grid`).
    Returns:
        ``{"runs": [results], "references": [results], "table": table, "trained": [names],
        "cached": [names]}``.
    Raises:
        KeelError: odd or non-positive depth, unknown scheme, bad peak/ramp/workers, bad
            config, a non-empty ``out`` without ``resume``, a run folder with another config,
            ``report_only`` where no run of the grid has finished.
    """
    schemes, sublayers, seeds = list(schemes), list(sublayers), list(seeds)
    _check_args(schemes, sublayers, seeds, peak_lr, ramp_steps, workers, reference_scheme)
    out = Path(out)
    if not (resume or report_only) and out.is_dir() and any(out.iterdir()):
        raise KeelError(f"output folder {out} is not empty; use --resume to continue it, or another --out")
    if report_only:
        check_reportable(out)
    cfg_path = resolve_config_path(config)
    overrides = list(overrides or [])
    data_dir = resolve_data(load_config(cfg_path, overrides), progress=False)  # prepared once, here
    refs, jobs = stress_jobs(cfg_path, overrides, schemes, sublayers, seeds, peak_lr, ramp_steps, data_dir, out,
                             reference_scheme)
    cached = [j.name for j in jobs if cached_result(out / j.name) is not None]
    _log.info(f"stress: {len(jobs)} run(s) + {len(refs)} reference run(s) ({reference_scheme}), "
              f"ramp 0 -> {peak_lr:g} over {ramp_steps} steps, out {out}")
    if report_only:
        results, ref_results = _finished(out, jobs, refs)
    else:
        grid = functools.partial(run_grid, workers=workers, resume=True, threads=threads or None,
                                 check=check_train_job, executor=executor)
        ref_results = grid(refs, out / REFERENCES, train_task)
        results = [r for r in grid(jobs, out, stress_task) if r.get("status") == "done"]
    table = stress_table(results, schemes, sublayers)
    summary = {"peak_lr": peak_lr, "ramp_steps": ramp_steps, "config": str(cfg_path), "overrides": overrides,
               "reference_scheme": reference_scheme, "runs": results, "references": ref_results, "table": table}
    make_dirs(out)
    atomic_write_text(out / "stress.json", json.dumps(summary, indent=1, default=str))
    atomic_write_text(out / "stress.md", table_markdown(table, peak_lr))
    plot_stress(results, schemes, sublayers, out / "stress.png")
    summary.update(trained=[] if report_only else [j.name for j in jobs if j.name not in cached], cached=cached)
    return summary
