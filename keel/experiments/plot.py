"""``keel plot``: PNG figures from run and sweep folders.

* ``keel plot loss RUN_OR_SWEEP... --out FILE [--val] [--x tokens|steps] [--smooth K]``:
  loss curves of several runs on one axis (Keel paper, Figures 4 and 5). Training loss by
  default (a trailing mean over ``K`` steps with ``--smooth``); ``--val`` plots the
  validation loss of the evaluation steps instead. A sweep folder stands for all its runs.
* ``keel plot depth SWEEP --out FILE``: final validation loss against depth in sub-layers
  (log2 x axis), one line per scheme (paper Figure 1c). Where the sweep has a
  ``--best-over`` key (or ``train.lr`` varies), each point is the best value of it; any
  other varying grid key gets its own line.
* ``keel plot lr SWEEP --out FILE``: final validation loss against peak LR (log x axis),
  one line per scheme and depth; runs that diverged are drawn as crosses at their last
  validation loss.

Figures are written atomically (:func:`keel.train.plots.save_figure`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

from keel.errors import KeelError, plural
from keel.experiments import sensitivity
from keel.experiments.job_result import JobResult
from keel.experiments.sweep import find_sweep, load_group_table, load_sweep, usable
from keel.rundir import RunDir
from keel.train.metrics import read_metrics, trailing_mean
from keel.train.plots import plt, save_figure


def _run_dirs(paths: Sequence[str | Path]) -> list[tuple[str, Path]]:
    """(label, run dir) for every run folder or every run of a sweep folder."""
    out = []
    for p in map(Path, paths):
        found = find_sweep(p)
        if found is not None:  # a sweep's runs, or a study grid group's (in its own folder)
            names, runs_dir = [JobResult.from_dict(r).name for r in found[0]["runs"]], found[1]
            out += [(name, runs_dir / name) for name in names if RunDir(runs_dir / name).metrics.is_file()]
        elif RunDir(p).metrics.is_file():
            if not RunDir(p).is_run():  # before reading a metrics.jsonl keel may never have written
                why = f"no {RunDir.CONFIG}" if not RunDir(p).config.exists() else f"its {RunDir.CONFIG} is not keel's"
                raise KeelError(f"{p} is not a keel run ({why})")
            out.append((p.name, p))
        else:
            raise KeelError(f"not a run folder (no {RunDir.METRICS}) or sweep folder (no report.json with a sweep table): "
                           f"{p}")
    if not out:
        raise KeelError("no runs to plot")
    return out


def plot_loss_curves(paths: Sequence[str | Path], out: str | Path, *, val: bool = False, x: str = "tokens",
                     smooth: int = 0, title: str = "", labels: Sequence[str] | None = None) -> int:
    """Loss curves (nats/token) of runs on one axis; returns the number of curves drawn.

    Args:
        paths: run folders and/or sweep folders.
        out: PNG path.
        val: validation loss at the evaluation steps instead of the training loss.
        x: ``tokens`` or ``steps`` on the x axis.
        smooth: trailing-mean window (steps) for the training loss.
        labels: one legend label per curve (default: run folder names).
    Raises:
        KeelError: a path that is neither a run nor a sweep; bad ``x``; a negative ``smooth``, or one with
            ``val``; wrong number of labels; no loss
            values at all in the runs (nothing is written).
    """
    _check_loss_args(x, smooth, val)
    runs = _run_dirs(paths)
    if labels is not None and len(labels) != len(runs):
        raise KeelError(f"{len(labels)} labels for {len(runs)} runs")
    xkey = "tokens" if x == "tokens" else "step"
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    n = 0
    for i, (name, run) in enumerate(runs):
        pts = _loss_points(run, xkey, val)
        if not pts:
            continue
        xs, ys = zip(*pts)
        ys = list(ys) if val else trailing_mean(list(ys), smooth)
        ax.plot(xs, ys, "o-" if val else "-", ms=3, lw=1.0 if val else 0.9, label=labels[i] if labels else name)
        n += 1
    if n == 0:
        plt.close(fig)
        what = "validation" if val else "training"
        raise KeelError(f"nothing to plot: no {what} loss in the metrics.jsonl of {', '.join(str(r) for _, r in runs)}")
    _label_loss_axes(ax, x, val, smooth, title, n)
    save_figure(fig, out)
    return n


def _check_loss_args(x: str, smooth: int, val: bool = False) -> None:
    """Raise KeelError for :func:`plot_loss_curves`' ``x`` other than tokens or steps, a negative ``smooth``, or a
    ``smooth`` with ``val`` (it averages the training loss only: the validation plot would silently ignore it)."""
    if x not in ("tokens", "steps"):
        raise KeelError(f"--x must be tokens or steps, got {x!r}")
    if smooth < 0:
        raise KeelError(f"--smooth must be >= 0 steps (0: no smoothing), got {smooth}")
    if smooth and val:
        raise KeelError("--smooth averages the training loss; --val plots the validation loss unsmoothed: drop one")


def _loss_points(run: Path, xkey: str, val: bool) -> list[tuple]:
    """``(x, loss)`` of one run's ``metrics.jsonl`` (x: the record's ``xkey``): its finite validation losses
    (``val``), else its finite training losses of the steps not skipped."""
    recs = read_metrics(RunDir(run).metrics)
    if val:
        return [(r[xkey], r["val_loss"]) for r in recs if "val_loss" in r and math.isfinite(r["val_loss"])]
    return [(r[xkey], r["loss"]) for r in recs if "loss" in r and not r.get("skipped")
            and math.isfinite(r["loss"])]


def _label_loss_axes(ax, x: str, val: bool, smooth: int, title: str, n: int) -> None:
    """The axis labels, title, grid and legend (``n`` curves) of :func:`plot_loss_curves`' figure."""
    ax.set_xlabel("tokens" if x == "tokens" else "optimiser steps")
    what = "validation" if val else "training" + (f" (mean of {smooth} steps)" if smooth > 1 else "")
    ax.set_ylabel(f"{what} loss (nats/token)")
    ax.set_title(title or f"{what} loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2 if n > 8 else 1)


def _series_key(values: dict, skip: Sequence[str]) -> str:
    """A line's legend label from its grid values; a depth (``model.n_layers``, blocks) is
    shown in sub-layers, as on the depth axis: ``residual=keel, 8 sub-layers``."""
    return ", ".join(f"{2 * int(v)} sub-layers" if k == "model.n_layers" else f"{k.split('.')[-1]}={v}"
                     for k, v in values.items() if k not in skip)


def depth_points(sweep: dict) -> dict[str, list[tuple[int, float, dict]]]:
    """Per line label: ``(sub-layers, final val loss, run)`` for the plot of loss against depth.

    The line label is the scheme plus any grid key other than depth and the best-over key
    (``train.lr`` by default if it varies). Each point is the lowest final validation loss
    among that line's runs at that depth that did not diverge. Raises KeelError if the sweep
    does not vary ``model.n_layers``.
    """
    keys = sweep["grid_keys"]
    if "model.n_layers" not in keys:
        raise KeelError("this sweep does not vary model.n_layers: no depth axis")
    best = sweep.get("best_over") or ("train.lr" if "train.lr" in keys else None)
    skip = ["model.n_layers"] + ([best] if best else [])
    lines: dict[str, dict[int, tuple[float, dict]]] = {}
    for r in map(JobResult.from_dict, sweep["runs"]):
        if not usable(r):
            continue
        label = _series_key(r.values, skip) or "runs"
        L = r.sublayers if r.sublayers is not None else 2 * int(r.values["model.n_layers"])  # a looped run's effective depth
        cur = lines.setdefault(label, {}).get(L)
        if cur is None or r.final_val_loss < cur[0]:
            lines[label][L] = (r.final_val_loss, r.to_dict())
    return {k: sorted((L, v, run) for L, (v, run) in d.items()) for k, d in lines.items()}


def plot_depth(sweep_dir: str | Path, out: str | Path, title: str = "") -> dict:
    """Final validation loss against depth (sub-layers, log2 axis), one line per scheme.

    Returns :func:`depth_points`. Raises KeelError (not a sweep, no depth axis, no usable run).
    """
    sweep = load_sweep(sweep_dir)
    pts = depth_points(sweep)
    if not pts:
        raise KeelError(f"no finished, non-diverged runs in {sweep_dir}")
    best = sweep.get("best_over") or ("train.lr" if "train.lr" in sweep["grid_keys"] else None)
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for label, ps in pts.items():
        xs, ys = [p[0] for p in ps], [p[1] for p in ps]
        ax.plot(xs, ys, "o-", label=label)
        if best:
            for L, v, run in ps:
                ax.annotate(f"{run['values'][best]:g}", (L, v), textcoords="offset points", xytext=(4, 4), fontsize=6)
    ax.set_xscale("log", base=2)
    allx = sorted({p[0] for ps in pts.values() for p in ps})
    ax.set_xticks(allx)
    ax.set_xticklabels([f"{L}\n({plural(L // 2, 'block')})" for L in allx], fontsize=8)
    ax.set_xlabel("depth (sub-layers)")
    ax.set_ylabel("final validation loss (nats/token)")
    ax.set_title(title or ("final validation loss vs depth" + (f" (best {best} per point, labelled)" if best else "")))
    ax.grid(alpha=0.3)
    ax.legend()
    save_figure(fig, out)
    return pts


def plot_lr(sweep_dir: str | Path, out: str | Path, title: str = "") -> int:
    """Final validation loss against peak LR (log x), one line per scheme/depth (other keys).

    Diverged or stopped runs are drawn as crosses at their last validation loss. Returns
    the number of lines. A ``keel lr-sensitivity`` folder (its ``report.json``'s sensitivity table) is drawn as
    that command draws it (:func:`keel.experiments.sensitivity.plot`: one panel per depth,
    one line per scheme). Raises KeelError if the sweep does not vary ``train.lr``, or has no finished
    run (no cell with a finished seed) to draw.
    """
    summary = load_group_table(sweep_dir, "sensitivity", sensitivity.OUT_JSON)
    if summary is not None:
        n = sum(1 for cell in summary["cells"] if cell["n_seeds"])
        if not n:
            raise KeelError(f"no finished runs in {sweep_dir}: no cell has a finished seed to plot")
        sensitivity.plot(summary, out)
        return n
    found = find_sweep(sweep_dir)  # its table and its runs' folder, read once
    sweep, runs_dir = found if found is not None else (load_sweep(sweep_dir), None)  # load_sweep: the one-line error
    if "train.lr" not in sweep["grid_keys"]:
        raise KeelError("this sweep does not vary train.lr: no LR axis")
    lines = _lr_lines(sweep, runs_dir)
    if not lines:
        raise KeelError(f"no finished runs in {sweep_dir}: nothing to plot")
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for label, ps in lines.items():
        ps.sort()
        good = [(x, y) for x, y, ok in ps if ok]
        line = ax.plot(*zip(*good), "o-", label=label)[0] if good else ax.plot([], [], "o-", label=label)[0]
        bad = [(x, y) for x, y, ok in ps if not ok and y is not None and math.isfinite(y)]
        if bad:
            ax.plot(*zip(*bad), "x", color=line.get_color(), ms=8)
    ax.set_xscale("log")
    ax.set_xlabel("peak learning rate")
    ax.set_ylabel("final validation loss (nats/token)")
    ax.set_title(title or "LR sweep (x = diverged/stopped, last validation loss)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2 if len(lines) > 8 else 1)
    save_figure(fig, out)
    return len(lines)


def _lr_lines(sweep: dict, sweep_dir: Path) -> dict[str, list[tuple[float, float | None, bool]]]:
    """Per line label of :func:`plot_lr` (the grid values but the LR): ``(LR, loss, ok)`` of each finished run;
    ``ok``: it did not diverge and has a final validation loss (its loss), else the loss is its last
    validation loss (None: none)."""
    lines: dict[str, list] = {}
    for r in map(JobResult.from_dict, sweep["runs"]):
        if not r.done:
            continue
        label = _series_key(r.values, ["train.lr"]) or "runs"
        ok = usable(r)
        y = r.final_val_loss if ok else _last_val(sweep_dir / r.name)
        lines.setdefault(label, []).append((r.values["train.lr"], y, ok))
    return lines


def _last_val(run_dir: Path) -> float | None:
    metrics = RunDir(run_dir).metrics
    if not metrics.is_file():
        return None
    vals = [r["val_loss"] for r in read_metrics(metrics) if "val_loss" in r]
    return vals[-1] if vals else None


