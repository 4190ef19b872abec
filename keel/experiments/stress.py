"""``keel stress``: the Keel paper's max-LR stress test (Chen & Wei 2026, arXiv 2601.19895,
Sec. 5.1, Table 1), over a grid of residual schemes x depths x seeds.

Each run trains with the usual recipe (:func:`keel.train.train`: AdamW (0.9, 0.95), weight
decay 0.01, clipping 1.0) but with ``train.warmup_steps = train.steps = ramp`` and
``train.lr = peak``, so the LR of optimiser step k (1-based, as logged in metrics.jsonl) is
``peak * k / ramp`` (:func:`keel.train.optim.lr_at` with step k - 1 < warmup): a linear
ramp from 0 to the peak (paper: 5e-2 over 5000 steps). ``train.stop_on_divergence`` is on, so
the online divergence classifier (:mod:`keel.diagnostics.divergence`) stops a diverged run.

"Max LR" is the LR at the last step before divergence: the ``lr`` logged at step
``verdict.step - 1`` (0.0 if the run failed at step 1). A run that never diverged has no
max LR ("no divergence up to peak LR X").

Layout of ``--out`` (default ``runs/stress``)::

    OUT/<scheme>-<L>sl-seed<S>/   one run directory per run (keel train's layout)
        stress_result.json        the run's result; its presence marks the run as done
    OUT/stress.json               all results + the table
    OUT/stress.md                 the table, laid out like the paper's Table 1
    OUT/stress.png                loss against LR (log x), one panel per depth

A finished run (with ``stress_result.json``) is skipped on a re-run; an unfinished one is
resumed from its latest checkpoint (or restarted if it has none).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from keel.errors import KeelError
from keel.io import atomic_write_text

RESULT_FILE = "stress_result.json"


def run_name(scheme: str, sublayers: int, seed: int) -> str:
    """Directory name of one run, e.g. ``keel-64sl-seed0`` (depth in sub-layers)."""
    return f"{scheme}-{sublayers}sl-seed{seed}"


def parse_list(text: str, kind, what: str) -> list:
    """``"a,b,c"`` -> [kind(a), ...]; raises KeelError naming ``what`` on a bad or empty item."""
    items = [s.strip() for s in str(text).split(",") if s.strip()]
    if not items:
        raise KeelError(f"{what} is empty")
    try:
        return [kind(s) for s in items]
    except ValueError:
        raise KeelError(f"{what} must be a comma-separated list of {kind.__name__}s, got {text!r}") from None


def run_overrides(scheme: str, sublayers: int, seed: int, peak_lr: float, ramp_steps: int,
                  user_sets: list[str]) -> list[str]:
    """The ``--set`` list of one run: quiet, cheap defaults, then the user's, then the forced ramp keys."""
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


def run_result(run_dir: Path, spec: dict) -> dict:
    """The result of a finished run, from its metrics.jsonl: the verdict of the classifier
    on the whole logged curve (:func:`keel.diagnostics.divergence.classify_metrics`; the same
    as the online verdict that stopped the run, which is kept as ``online_verdict``; it also
    catches non-finite steps, which the trainer does not feed to the online monitor), and
    the max LR."""
    from keel.diagnostics.divergence import classify_metrics
    from keel.train.metrics import read_metrics

    records = read_metrics(run_dir / "metrics.jsonl")
    logged = [r["divergence"] for r in records if "divergence" in r]
    verdict = classify_metrics(records)
    last = max((r["step"] for r in records if "loss" in r), default=0)
    out = dict(spec)
    out.update(name=run_dir.name, run_dir=str(run_dir), diverged=verdict.diverged, verdict=verdict.to_dict(),
               summary=verdict.summary(), last_step=last, online_verdict=logged[0] if logged else None,
               max_lr=max_lr(records, verdict.step) if verdict.diverged else None)
    return out


def _run_one(spec: dict) -> dict:
    """Worker: train (or resume) one run, write its ``stress_result.json``; returns the result."""
    import torch

    threads_before = torch.get_num_threads()
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    try:
        return _train_one(spec)
    finally:
        torch.set_num_threads(threads_before)  # the in-process (1 worker) case


def _train_one(spec: dict) -> dict:
    from keel.config import config_from_dict
    from keel.experiments.training import train_run
    from keel.train import TrainingStopped

    run_dir = Path(spec["run_dir"])
    cfg = config_from_dict(spec["config"])
    t0 = time.perf_counter()
    resume = (run_dir / "metrics.jsonl").exists()
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "stress.log", "a") as logf:
        def log(msg):
            logf.write(str(msg) + "\n")
            logf.flush()
        try:
            train_run(cfg, run_dir, resume=resume)
        except TrainingStopped as e:
            log(f"stopped: {e}")
    keys = ("scheme", "sublayers", "blocks", "seed", "peak_lr", "ramp_steps")
    result = run_result(run_dir, {k: spec[k] for k in keys})
    result["wall_s"] = time.perf_counter() - t0
    atomic_write_text(run_dir / RESULT_FILE, json.dumps(result, indent=1))
    return result


def _check_same_settings(run_dir: Path, cfg) -> None:
    """A run directory from an earlier grid must have the same resolved config (the vocab
    size aside, which the trainer raises to the tokenizer's); else raise KeelError."""
    from keel.config import load_config

    if not (run_dir / "config.toml").is_file():
        return
    old, new = load_config(run_dir / "config.toml").to_dict(), cfg.to_dict()
    for d in (old, new):
        d["model"].pop("vocab_size", None)
    if old != new:
        diff = sorted(f"{s}.{k}" for s in new for k in set(new[s]) | set(old[s]) if new[s].get(k) != old[s].get(k))
        raise KeelError(f"{run_dir} was run with other settings ({', '.join(diff)}); use another --out")


def _median(values: list[float]) -> float:
    v = sorted(values)
    n = len(v)
    return v[n // 2] if n % 2 else 0.5 * (v[n // 2 - 1] + v[n // 2])


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
                med, lo, hi = _median(vals), min(vals), max(vals)
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
    from keel.train.metrics import read_metrics
    from keel.train.plots import plt, save_figure

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
                    at = [q for q in recs if q["step"] == r["verdict"]["step"]]
                    if at:
                        ax.plot([at[0]["lr"]], [at[0]["loss"]], "x", color=c, ms=8, mew=2)
        ax.set_xscale("log")
        ax.set_xlabel("learning rate")
        ax.set_ylabel("training loss (nats/token)")
        ax.set_title(f"{L} sub-layers ({L // 2} blocks); x = divergence onset")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    save_figure(fig, out)


def run_stress(config: str | None = None, overrides: list[str] | None = None, schemes: list[str] = ("pre_ln", "keel"),
               sublayers: list[int] = (64,), seeds: list[int] = (0,), peak_lr: float = 5e-2, ramp_steps: int = 1000,
               out: str | Path = "runs/stress", workers: int = 1, threads: int = 0, report_only: bool = False,
               log=print) -> dict:
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
        workers: worker processes (spawn context).
        threads: torch threads per worker (0 = leave torch's default).
        report_only: train nothing; tabulate the finished runs of the grid only.
    Returns:
        ``{"runs": [results], "table": table, "trained": [names], "cached": [names]}``.
    Raises:
        KeelError: odd or non-positive depth, unknown scheme, bad peak/ramp/workers, bad config.
    """
    from keel.config import resolve_config_path
    from keel.config import load_config
    from keel.model import SCHEMES
    from keel.data import resolve_data

    schemes, sublayers, seeds = list(schemes), list(sublayers), list(seeds)
    for s in schemes:
        if s not in SCHEMES:
            raise KeelError(f"unknown scheme {s!r} in --residual (available: {', '.join(SCHEMES)})")
    for L in sublayers:
        if L < 2 or L % 2:
            raise KeelError(f"--layers counts sub-layers (2 per block) and must be even and >= 2, got {L}")
    if not (math.isfinite(peak_lr) and peak_lr > 0):
        raise KeelError(f"--peak-lr must be > 0, got {peak_lr}")
    if ramp_steps < 2:
        raise KeelError(f"--ramp-steps must be >= 2, got {ramp_steps}")
    if workers < 1:
        raise KeelError(f"--workers must be >= 1, got {workers}")
    if len(set(schemes)) != len(schemes) or len(set(sublayers)) != len(sublayers) or len(set(seeds)) != len(seeds):
        raise KeelError("--residual, --layers and --seeds must not repeat a value")
    out = Path(out)
    cfg_path = resolve_config_path(config)
    base = load_config(cfg_path, list(overrides or []))
    data_dir = resolve_data(base, progress=False)  # prepare once, here, not in every worker
    out.mkdir(parents=True, exist_ok=True)

    specs, cached, todo = [], [], []
    for seed in seeds:  # seed-major: a partial grid covers every scheme and depth first
        for L in sublayers:
            for s in schemes:
                sets = run_overrides(s, L, seed, peak_lr, ramp_steps, list(overrides or []))
                cfg = load_config(cfg_path, sets + [f"data.path={data_dir}"])
                run_dir = out / run_name(s, L, seed)
                spec = {"scheme": s, "sublayers": L, "blocks": L // 2, "seed": seed, "peak_lr": peak_lr,
                        "ramp_steps": ramp_steps, "run_dir": str(run_dir), "config": cfg.to_dict(), "threads": threads}
                specs.append(spec)
                _check_same_settings(run_dir, cfg)
                (cached if (run_dir / RESULT_FILE).is_file() else todo).append(spec)
    results: dict[str, dict] = {}
    for spec in cached:
        results[spec["run_dir"]] = json.loads((Path(spec["run_dir"]) / RESULT_FILE).read_text())
    log(f"stress: {len(specs)} runs ({len(cached)} done already), ramp 0 -> {peak_lr:g} over {ramp_steps} steps, "
        f"{workers} worker(s), out {out}")

    def report(r: dict) -> None:
        results[r["run_dir"]] = r
        what = f"max LR {r['max_lr']:.3e} ({r['summary']})" if r["diverged"] else f"no divergence up to peak LR {peak_lr:g}"
        log(f"  {r['name']} ({r['blocks']} blocks = {r['sublayers']} sub-layers): {what} [{r['wall_s']:.0f} s]")

    if report_only:
        log(f"  report only: leaving {len(todo)} unfinished run(s) out")
        specs, todo = cached, []
    if todo:
        if workers == 1:
            for spec in todo:
                report(_run_one(spec))
        else:
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor, as_completed

            with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn")) as ex:
                futures = [ex.submit(_run_one, spec) for spec in todo]
                for f in as_completed(futures):
                    report(f.result())
    ordered = [results[s["run_dir"]] for s in specs]
    table = stress_table(ordered, schemes, sublayers)
    summary = {"peak_lr": peak_lr, "ramp_steps": ramp_steps, "config": str(cfg_path), "overrides": list(overrides or []),
               "runs": ordered, "table": table}
    atomic_write_text(out / "stress.json", json.dumps(summary, indent=1))
    atomic_write_text(out / "stress.md", table_markdown(table, peak_lr))
    plot_stress(ordered, schemes, sublayers, out / "stress.png")
    summary["trained"] = [Path(s["run_dir"]).name for s in todo]
    summary["cached"] = [Path(s["run_dir"]).name for s in cached]
    return summary


def cmd_stress(args) -> int:
    """``keel stress``: see the module docstring."""
    import sys

    from keel.model import SCHEMES

    schemes = parse_list(args.residual, str, "--residual") if args.residual is not None else list(SCHEMES)
    layers = parse_list(args.layers, int, "--layers")
    seeds = parse_list(args.seeds, int, "--seeds")
    log = (lambda m: print(m, file=sys.stderr)) if args.json else print
    res = run_stress(args.config, args.set, schemes, layers, seeds, args.peak_lr, args.ramp_steps, args.out,
                     args.workers, args.threads, report_only=args.report_only, log=log)
    if args.json:
        print(json.dumps(res["table"], indent=1))
    else:
        print(table_markdown(res["table"], args.peak_lr))
        print(f"wrote {Path(args.out) / 'stress.json'}, stress.md, stress.png")
    return 0


def register(subparsers) -> None:
    """Add the ``stress`` sub-command (the CLI's plug-in hook)."""
    p = subparsers.add_parser("stress", help="max-LR stress test: linear LR ramp until divergence (paper Table 1)")
    p.add_argument("--residual", default=None, help="comma-separated schemes (default: every scheme in keel.model.SCHEMES)")
    p.add_argument("--layers", default="64", help="comma-separated depths in SUB-LAYERS (even; 2 per block)")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated train.seed values")
    p.add_argument("--peak-lr", type=float, default=5e-2, help="LR at the end of the ramp (paper: 5e-2)")
    p.add_argument("--ramp-steps", type=int, default=1000, help="steps of the linear ramp 0 -> peak (paper: 5000)")
    p.add_argument("--config", default=None, help="base TOML file or preset name (default: demo)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config key for every run (repeatable)")
    p.add_argument("--out", default="runs/stress", help="output folder (default: runs/stress)")
    p.add_argument("--workers", type=int, default=1, help="parallel worker processes")
    p.add_argument("--threads", type=int, default=0, help="torch threads per worker (0 = torch default)")
    p.add_argument("--json", action="store_true", help="print the table as JSON on stdout")
    p.add_argument("--report-only", action="store_true", help="train nothing: tabulate the grid's finished runs")
    p.set_defaults(func=cmd_stress)
