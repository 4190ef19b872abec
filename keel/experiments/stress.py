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

The command is a study preset (:func:`keel.experiments.presets.run_stress`): its flags make a
study of one ramp group, run by the one engine (:func:`keel.experiments.study.run.execute`):
worker processes or a Slurm executor, finished runs cached, an interrupted grid continued with
``--resume``, a run folder with another config refused, ``--dry-run``. Each run's
``result.json`` is the ``keel sweep`` run summary (:func:`keel.experiments.sweep.run_summary`:
one vocabulary, ``healthy`` / ``stagnation`` / ``instability`` / ``degradation``, and a
``reference`` field naming the reference run) plus ``scheme``, ``sublayers``, ``blocks``,
``seed``, ``peak_lr``, ``ramp_steps`` and ``max_lr``. Layout of ``--out`` (default ``runs/stress``)::

    OUT/references/<ref scheme>-<L>sl-seed<S>/   the reference runs (a grid of their own)
    OUT/<scheme>-<L>sl-seed<S>/                  one run directory per stress run
    OUT/report.md, report.json                   the engine's one report: the table (laid out like the paper's
                                                 Table 1) is its section "Group stress: ...", its data (all
                                                 results + the table) report.json's group_tables["stress"]
    OUT/stress.png                               training loss against the ramp's LR (log x), one line per run
    OUT/study.json                               the engine's marker
    OUT/stress.json, stress.md                   deprecated (one release): the same data and table
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Callable, Sequence

from keel.config import Override, load_config
from keel.errors import KeelError, plural
from keel.experiments.grid import GridJob
from keel.experiments.job_result import JobResult
from keel.experiments.table import markdown_table
from keel.experiments.sweep import train_task
from keel.rundir import RunDir
from keel.train.metrics import read_metrics

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
    records = read_metrics(RunDir(run_dir).metrics)
    run = JobResult.from_dict(out)
    out["max_lr"] = max_lr(records, run.divergence["step"]) if run.diverged else None
    return out


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
            rs = [r for r in map(JobResult.from_dict, results) if r.scheme == s and r.sublayers == L]
            vals = [r.max_lr if r.diverged else math.inf for r in rs]
            n, nd = len(rs), sum(r.diverged for r in rs)
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
    lines = markdown_table(["depth: sub-layers (blocks)", *cols],
                           [[f"{row['sublayers']} ({plural(row['blocks'], 'block')})",
                             *(row["cells"][c]["text"] for c in cols)] for row in table["rows"]])
    note = "Cells: median max LR over seeds (min–max); \"no div.\": no divergence"
    note += f" up to the peak LR {peak_lr:g}." if peak_lr else "."
    return "\n".join(lines) + "\n\n" + note + "\n"


def stress_jobs(cfg_path, overrides: Sequence[Override], schemes: list[str], sublayers: list[int], seeds: list[int],
                peak_lr: float, ramp_steps: int, data_dir: Path, out: Path, reference_scheme: str = "pre_ln",
                depth_sets: Callable[[int], list[Override]] = lambda L: []) -> tuple[list[GridJob], list[GridJob]]:
    """(reference jobs, stress jobs), seed-major (a partial grid covers every scheme and depth
    first). Each stress job's config names its reference run (``train.divergence_reference``,
    an absolute path under ``out/references``). ``depth_sets(L)``: keys applied last at depth ``L``
    (a looped study group's :meth:`keel.experiments.study.spec.Group.loop_sets`: ``L`` is then the
    effective depth and names the run). Raises KeelError on a bad config."""
    refs, jobs = [], []
    for seed in seeds:
        for L in sublayers:
            vals = {"sublayers": L, "blocks": L // 2, "seed": seed, "peak_lr": peak_lr, "ramp_steps": ramp_steps}
            ref_name = run_name(reference_scheme, L, seed)  # under OUT/references
            ref_dir = (out / REFERENCES / ref_name).resolve()
            sets = run_overrides(reference_scheme, L, seed, peak_lr, ramp_steps, overrides) + depth_sets(L)
            cfg = load_config(cfg_path, sets + [("data.path", str(data_dir)), ("train.stop_on_divergence", False)])
            refs.append(GridJob(ref_name, cfg.to_dict(), {"scheme": reference_scheme, **vals}))
            for s in schemes:
                sets = run_overrides(s, L, seed, peak_lr, ramp_steps, overrides) + depth_sets(L)
                cfg = load_config(cfg_path, sets + [("data.path", str(data_dir)),
                                                    ("train.divergence_reference", str(ref_dir))])
                jobs.append(GridJob(run_name(s, L, seed), cfg.to_dict(), {"scheme": s, **vals}))
    return refs, jobs


def references_of(jobs: Sequence[GridJob]) -> set[str]:
    """Folder names (under ``OUT/references``) of the reference runs that stress ``jobs`` name."""
    return {Path(ref).name for j in jobs if (ref := j.config.get("train", {}).get("divergence_reference"))}
