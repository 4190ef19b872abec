"""``keel sweep``: grids of training runs, with equal-compute tables and best-LR selection.

A sweep is the cartesian product of ``--grid KEY=V1,V2,...`` options over any config keys
(``model.residual``, ``model.n_layers``, ``train.lr`` ...), applied on top of a base config
and ``--set`` overrides. Every point is an ordinary run directory (``keel.train.train``)
named after its coordinates, e.g. ``keel_L64_lr0.003`` (L = sub-layers). The command is a
study preset (:func:`keel.experiments.presets.run_sweep`): one grid group run by the one engine
(:func:`keel.experiments.study.run.execute`): worker processes or a Slurm executor, finished
runs cached, an interrupted sweep continued with ``--resume``, ``--dry-run`` plans it.

Outputs in ``--out``::

    report.md    the engine's one report; the sweep's tables (:func:`sweep_markdown`) are its
                 section "Group sweep: sweep"
    report.json  its data; group_tables["sweep"]: grid, base config, what was held fixed, one
                 record per run, the best-LR table
    sweep.png    the runs' training loss curves (the engine's plot of the group)
    study.json   the engine's marker
    NAME/        the run directories (config.toml, metrics.jsonl, checkpoints/, result.json ...)
    sweep.json, sweep.md   deprecated (one release): the same data and tables

A study's grid group (``kind = "grid"``) gets the same section in its report.

Per run: final validation loss (at the last step; nats/token), best validation loss over
the evaluations, tokens trained, optimiser steps, parameters (total and non-embedding),
wall time (seconds in the worker, evaluations included) and a divergence verdict,
``healthy`` or one of the Keel paper's failure modes (Sec. 5.1: ``stagnation``,
``instability``, ``degradation``), from :func:`keel.diagnostics.divergence.run_verdict` on
the training loss curve, against the run's ``train.divergence_reference`` run if set and
with its dataset's unigram entropy (a NaN/inf loss is ``instability``; a run the trainer
stopped is never ``healthy``, and its ``stopped`` field holds the message). ``keel stress``
and ``keel lr-sensitivity`` report the same summary (:func:`run_summary`).

``--best-over train.lr``: for every combination of the other grid keys, the value of
``train.lr`` with the lowest final validation loss among runs that did not diverge (the
paper tunes the peak LR per scheme and depth, Sec. 5).

``--match-params N`` (or ``auto`` = the base config's count) holds the non-embedding
parameter count fixed: every point gets the ``d_model`` (and ``d_ff`` in the base
ratio) that brings it closest to N (:func:`width_for_params`), for deeper-vs-wider
comparisons (paper Table 5).

Presets: ``--preset NAME`` reads the packaged ``keel/configs/sweeps/NAME.toml`` (or a file), a
study file of one group of kind ``grid``, read by the study reader
(:func:`keel.experiments.presets.load_sweep_preset`)::

    base = "demo"                       # config preset or file; --config overrides it
    [groups.sweep]
    kind = "grid"
    best_over = "train.lr"              # optional
    match_params = 0                    # optional; "auto" or a count
    [groups.sweep.grid]
    "model.residual" = ["keel", "pre_ln"]
    [groups.sweep.set]
    "train.steps" = 300

``--grid`` and ``--set`` on the command line add to (and override) the preset's. The old format
(``grid``, ``set``, ``best_over``, ``match_params`` at the top level) still loads for one
release, converted on read with a warning: move those keys under ``[groups.sweep]`` as above.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import math
import re
import time
from pathlib import Path
from typing import Any, Sequence

from keel.config import (Config, Override, coerce_key, config_from_dict, load_config, parse_value, resolve_config_path,
                         resolve_vocab_size)
from keel.keys import current_key
from keel.data import read_meta
from keel.data.stats import dataset_unigram_entropy
from keel.diagnostics.divergence import HEALTHY, Verdict, run_verdict
from keel.errors import KeelError, plural
from keel.experiments.grid import GridJob
from keel.experiments.job_result import JobResult
from keel.experiments.table import markdown_table
from keel.experiments.training import train_run
from keel.model import SCHEMES, check_model_config, count_parameters
from keel.rundir import RunDir
from keel.train import TrainingStopped
from keel.train.checkpoint import CheckpointManager
from keel.train.metrics import read_metrics
from keel.train.trainer import check_train_config, perplexity

_log = logging.getLogger(__name__)  # inside a grid task: the run's run.log

HELD_KEYS = ("tokens", "steps", "params")


# ----------------------------------------------------------------------------- grid
def parse_grid(specs: Sequence[str]) -> dict[str, list]:
    """``["model.residual=keel,pre_ln", "train.lr=1e-3,3e-3"]`` -> ordered ``{key: [values]}``.

    Values are read as ``--set`` values (:func:`keel.config.parse_value`: a text key keeps the
    text typed). Raises KeelError on a malformed spec, a key without a section, an empty or
    repeated value, a key given twice (its values belong in one list).
    """
    grid: dict[str, list] = {}
    for spec in specs:
        if "=" not in spec:
            raise KeelError(f"--grid expects section.key=v1,v2,..., got {spec!r}")
        key, raw = spec.split("=", 1)
        key = key.strip()
        if "." not in key:
            raise KeelError(f"--grid key must be section.key, got {key!r}")
        parts = raw.split(",")
        if not raw.strip() or any(not p.strip() for p in parts):
            raise KeelError(f"--grid {key} has an empty value in {raw!r}")
        if key in grid:
            raise KeelError(f"--grid {key} is given twice; give all its values in one: --grid {key}=v1,v2,...")
        values = [parse_value(p.strip(), key) for p in parts]
        if repeats_a_value(key, values):
            raise KeelError(f"--grid {key} repeats a value: {raw!r}")
        grid[key] = values
    return grid


def repeats_a_value(key: str, values: Sequence[Any]) -> bool:
    """Whether two of a grid key's ``values`` are one value of the key once read as its declared type
    (:func:`keel.config.coerce_key`: ``model.n_layers`` 2 and 2.0, ``train.lr`` 1e-3 and 0.001): the
    plan counted them as two runs of one config. A key or value keel would refuse is compared as given
    (its error comes where the config is built)."""
    typed = []
    for v in values:
        try:
            section, name = current_key(key).split(".", 1)
            v = coerce_key(section, name, v)
        except (KeelError, KeyError, ValueError, TypeError, AttributeError):
            pass
        typed.append(json.dumps(v, sort_keys=True, default=str))
    return len(set(typed)) != len(typed)


def expand_grid(grid: dict[str, list]) -> list[dict]:
    """The cartesian product of ``grid``, as a list of ``{key: value}`` dicts, first key slowest."""
    keys = list(grid)
    return [dict(zip(keys, combo)) for combo in itertools.product(*(grid[k] for k in keys))]


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:g}"
    return str(v).lower() if isinstance(v, bool) else str(v)


def run_name(values: dict, sublayers: int | None = None) -> str:
    """A readable, filesystem-safe run name from grid coordinates.

    ``model.residual`` contributes its value, ``model.n_layers`` ``L<sub-layers>``,
    ``train.lr`` ``lr<value>``, any other key ``<last part of key><value>``; joined by ``_``.
    E.g. ``{"model.residual": "keel", "model.n_layers": 32, "train.lr": 0.003}`` ->
    ``keel_L64_lr0.003``. ``sublayers``: the run's effective depth
    (:attr:`keel.config.ModelConfig.n_sublayers`, 2 (P + R C + Q) for a looped model); default
    2 x ``model.n_layers``, the depth of a model without a loop.
    """
    parts = []
    for key, v in values.items():
        short = key.split(".")[-1]
        if key == "model.residual":
            parts.append(_fmt(v))
        elif key == "model.n_layers":
            parts.append(f"L{sublayers if sublayers is not None else 2 * int(v)}")
        else:
            parts.append(f"{short}{_fmt(v)}")
    name = "_".join(parts) or "run"
    return re.sub(r"[^A-Za-z0-9._=+-]", "-", name)


# ----------------------------------------------------------------------------- params
def width_for_params(model_cfg, target: int, n_layers: int | None = None, *, multiple: int | None = None,
                     ffn_ratio: float | None = None, non_embedding: bool = True):
    """The width that brings a model of ``n_layers`` blocks closest to ``target`` parameters.

    Holds the number of heads (and KV heads) and the FFN ratio ``d_ff / d_model`` fixed and
    searches ``d_model`` over multiples of ``multiple`` (default ``2 * n_heads``, so that
    the head dimension is even for RoPE). The parameter count grows monotonically with
    ``d_model``, so a bisection finds the bracketing widths and the closer one is chosen.
    Used for deeper-vs-wider comparisons at equal parameters (Keel paper, Table 5).

    Args:
        model_cfg: a ``keel.config.ModelConfig`` (not modified).
        target: parameter count to match (non-embedding by default; :func:`keel.model.count_parameters`).
        n_layers: blocks of the new model (default: ``model_cfg.n_layers``).
        multiple: step of the width search.
        ffn_ratio: ``d_ff / d_model`` (default: ``model_cfg``'s own ratio); ``d_ff`` is rounded.
    Returns:
        A new ``ModelConfig`` with ``n_layers``, ``d_model`` and ``d_ff`` set.
    Raises:
        KeelError: ``target`` < 1, under half the narrowest width's count (the narrowest model would
            be taken for it), or not reachable below 64x the base width.
    """
    if target < 1:
        raise KeelError(f"parameter target must be >= 1, got {target}")
    n_layers = model_cfg.n_layers if n_layers is None else int(n_layers)
    multiple = multiple or 2 * model_cfg.n_heads
    ratio = ffn_ratio if ffn_ratio is not None else model_cfg.d_ff / model_cfg.d_model

    def shape(k: int):
        d = k * multiple
        return dataclasses.replace(model_cfg, n_layers=n_layers, d_model=d, d_ff=max(1, round(ratio * d)))

    def count(k: int) -> int:
        return count_parameters(shape(k), non_embedding=non_embedding)

    lo, hi = 1, max(2, 64 * model_cfg.d_model // multiple)
    if count(hi) < target:
        raise KeelError(f"{target:,} parameters need more than d_model {hi * multiple} at "
                        f"{plural(n_layers, 'block')}")
    if count(lo) >= target:  # the narrowest width is the closest, unless the target is nearer to no model at all
        if target < count(lo) / 2:
            raise KeelError(f"{target:,} parameters are under half the narrowest model's: d_model {multiple} at "
                            f"{plural(n_layers, 'block')} has {count(lo):,}")
        return shape(lo)
    while hi - lo > 1:  # invariant: count(lo) < target <= count(hi)
        mid = (lo + hi) // 2
        if count(mid) < target:
            lo = mid
        else:
            hi = mid
    best = lo if target - count(lo) <= count(hi) - target else hi
    return shape(best)


# ----------------------------------------------------------------------------- jobs
def build_jobs(config: str | None, grid: dict[str, list], sets: Sequence[Override] = (), *,
               match_params: int | str | None = None, data_path: str | None = None) -> list[GridJob]:
    """One :class:`GridJob` per grid point: base config + ``sets`` (``--set`` strings or typed
    ``(key, value)`` pairs, :func:`keel.config.apply_overrides`) + the point's values, applied
    as typed values (never turned into text and parsed back).

    A scheme whose implementation version (:attr:`keel.model.residual.base.Residual.version`) is
    above 1 adds ``_v<version>`` to the run name and ``scheme_version`` to the values, so runs
    of an earlier implementation are never taken for cached ones.
    Every job gets ``train.progress = false`` (workers log to their ``run.log``) and, if
    given, ``data.path = data_path`` (data prepared once, before the workers start).
    With ``match_params`` (a count, or ``"auto"`` = the base config's non-embedding count),
    ``model.d_model``/``model.d_ff`` of each point are set by :func:`width_for_params`
    and recorded in its values.

    Raises:
        KeelError: unknown config keys or values, ``match_params`` together with a grid over
            ``model.d_model``, a grid point that is not a valid model.
    """
    cfg_path = resolve_config_path(config)
    base_sets = list(sets) + [("train.progress", False)] + ([("data.path", str(data_path))] if data_path else [])
    points = expand_grid(grid) if grid else [{}]
    target = base = None
    if match_params not in (None, 0, "0", ""):
        if "model.d_model" in grid or "model.d_ff" in grid:
            raise KeelError("--match-params sets model.d_model and model.d_ff; do not also sweep them")
        base = _matching_reference(cfg_path, base_sets, points[0], match_params)
        base_sets.append(("model.vocab_size", _matched_vocab(base, data_path)))
        base = _matching_reference(cfg_path, base_sets, points[0], match_params)
        if match_params == "auto":
            target = count_parameters(base.model, non_embedding=True)
        else:
            try:
                target = int(float(match_params))
            except (ValueError, OverflowError):
                raise KeelError(f"--match-params must be a parameter count or 'auto', got {match_params!r}") from None
            if target < 1:
                raise KeelError(f"--match-params must be a parameter count >= 1, got {match_params!r}")
    jobs = []
    for values in points:  # each point's config is checked whole: the base alone may need the grid's values
        cfg = _point_config(cfg_path, base_sets, values)
        shown = dict(values)
        if target is not None:
            m = width_for_params(cfg.model, target, ffn_ratio=base.model.d_ff / base.model.d_model)
            if m.d_model % m.n_heads or m.n_heads % m.n_kv_heads:
                raise KeelError(f"width {m.d_model} does not fit {m.n_heads} heads")
            cfg = _point_config(cfg_path, base_sets, {**values, "model.d_model": m.d_model, "model.d_ff": m.d_ff})
            shown["model.d_model"] = m.d_model
        check_model_config(cfg.model)  # the trainer's check: an unknown scheme is one line, not a KeyError
        version = SCHEMES[cfg.model.residual].version
        if version > 1:  # a scheme changed since its first version: its runs are other runs, not cached ones
            shown["scheme_version"] = version
        name = run_name(values, cfg.model.n_sublayers) + (f"_v{version}" if version > 1 else "")
        jobs.append(GridJob(name, cfg.to_dict(), shown))
    return jobs


def _point_config(cfg_path: Path | None, sets: list, values: dict) -> Config:
    """The config of one grid point: ``sets`` then the point's ``values`` (typed), checked whole (the rules
    between keys included: the base alone may break one that the grid's values satisfy).

    Raises:
        KeelError: the config is not valid (the message of :func:`keel.config.load_config`).
    """
    return load_config(cfg_path, sets + list(values.items()))


def _matching_reference(cfg_path: Path | None, sets: list, first: dict, match_params: int | str) -> Config:
    """The config ``--match-params`` reads its vocabulary, FFN ratio and (``auto``) parameter target from:
    the base config; where the base alone is not valid (a key needs a grid value, e.g. ``model.loop_repeats``
    a ``model.loop_core`` from the grid), a count takes them from the ``first`` grid point (the width keys it
    may not sweep are the base's), while ``auto`` cannot (its target is the base's own count).

    Raises:
        KeelError: ``auto`` with a base config that is not valid alone (naming the count remedy); the first
            grid point not valid either.
    """
    try:
        return load_config(cfg_path, sets)
    except KeelError as e:
        if match_params == "auto" and first:
            raise KeelError(f"--match-params auto matches the base config's non-embedding parameter count, but the "
                            f"base config is not valid without the grid's values ({e}): give --match-params a "
                            "count, or --set the keys that make the base valid") from None
        if not first:
            raise
    return _point_config(cfg_path, sets, first)


def _matched_vocab(base: Config, data_path: str | None) -> int:
    """``model.vocab_size`` for ``--match-params`` (the LM head counts in the target and in each
    width): the config's number, or for ``"auto"`` the vocabulary known before any data is
    prepared, the dataset's (``data_path``, ``data.path``) or ``bpe:N``'s N, rounded up as
    :func:`keel.config.resolve_vocab_size` does. Raises KeelError when neither is known."""
    if base.model.vocab_size != "auto":
        return base.model.vocab_size
    folder = data_path or base.data.path
    if folder and (Path(folder) / "meta.json").is_file():
        n = read_meta(folder)["vocab_size"]
    elif re.fullmatch(r"bpe:\d+", base.data.tokenizer):
        n = int(base.data.tokenizer[4:])
    else:
        raise KeelError('--match-params needs the vocabulary size (the LM head counts): model.vocab_size is "auto" and '
                        f"data.tokenizer {base.data.tokenizer!r} is sized only once prepared; "
                        "set model.vocab_size or data.path")
    return resolve_vocab_size("auto", n, base.model.vocab_multiple)


# ----------------------------------------------------------------------------- one run
def _verdict(records: list[dict], stopped: str | None, reference_dir: str,
             data_dir: str) -> tuple[dict, str | None, float | None]:
    """(verdict dict, reference used, unigram entropy used) of one run:
    :func:`keel.diagnostics.divergence.run_verdict` against the run's
    ``train.divergence_reference`` (if set) and its dataset's unigram entropy (if known)."""
    ref = None
    if reference_dir:
        ref_metrics = RunDir(reference_dir).metrics
        if not ref_metrics.is_file():
            raise KeelError(f"divergence reference {reference_dir} has no {RunDir.METRICS} (not a finished run)")
        ref = read_metrics(ref_metrics)
    h1 = dataset_unigram_entropy(data_dir) if data_dir and (Path(data_dir) / "meta.json").is_file() else None
    v = run_verdict(records, ref, h1, stopped)
    return v.to_dict(), (str(reference_dir) if reference_dir else None), h1


def run_summary(run_dir: str | Path, stopped: str | None = None) -> dict:
    """The numbers ``keel sweep`` reports for one run directory (from its files).

    Returns a dict: ``blocks``, ``sublayers``, ``step`` (steps done), ``steps`` (planned),
    ``tokens`` (trained), ``planned_tokens``, ``final_val_loss`` (at the last planned
    step, None if the run did not get there), ``best_val_loss``, ``first_val_loss``,
    ``params``, ``non_embedding_params``, ``elapsed_s`` (training seconds, evaluations
    excluded), ``verdict`` (``healthy`` | ``stagnation`` | ``instability`` |
    ``degradation``: :func:`keel.diagnostics.divergence.run_verdict`), ``verdict_detail``
    (one line), ``divergence`` (the verdict with its step and evidence), ``diverged``
    (verdict != healthy), ``stopped`` (the trainer's stop message or None), ``reference``
    (the ``train.divergence_reference`` run the verdict was judged against, or None) and
    ``unigram_entropy`` (nats, of the run's dataset, or None). Losses are nats/token.
    """
    run_dir = Path(run_dir)
    cfg = load_config(RunDir(run_dir).config, stored=True)
    records = read_metrics(RunDir(run_dir).metrics)
    vals = [r for r in records if "val_loss" in r]
    last = records[-1] if records else {}
    tc = cfg.train
    div, reference, h1 = _verdict(records, stopped, tc.divergence_reference, cfg.data.path)
    final = vals[-1]["val_loss"] if vals and vals[-1]["step"] == tc.steps and not stopped else None
    finite_vals = [r["val_loss"] for r in vals if math.isfinite(r["val_loss"])]
    return {
        "blocks": cfg.model.n_layers, "sublayers": cfg.model.n_sublayers, "d_model": cfg.model.d_model,
        "step": last.get("step", 0), "steps": tc.steps, "tokens": last.get("tokens", 0),
        "planned_tokens": tc.steps * tc.batch_size * tc.seq_len * tc.grad_accum,
        "final_val_loss": final, "best_val_loss": min(finite_vals) if finite_vals else None,
        "first_val_loss": vals[0]["val_loss"] if vals else None,
        "params": count_parameters(cfg.model), "non_embedding_params": count_parameters(cfg.model, non_embedding=True),
        "elapsed_s": last.get("elapsed_s", 0.0),
        "verdict": div["mode"], "verdict_detail": Verdict.from_dict(div).summary() + (f"; {stopped}" if stopped else ""),
        "divergence": div, "diverged": div["mode"] != HEALTHY, "stopped": stopped, "reference": reference,
        "unigram_entropy": h1,
    }


def restored_summary(config: dict, tokens: int | None, curve: dict | None) -> dict:
    """The numbers of :func:`run_summary` that a run restored from an earlier report (which keeps its
    measures, not its folder) still has: from ``config`` (the run's config as the study plans it, nested
    dicts) ``blocks``, ``sublayers``, ``d_model``, ``steps`` and ``planned_tokens`` (planned), ``params`` and
    ``non_embedding_params`` (where the vocabulary is known: a number, or the prepared dataset at
    ``data.path``); ``step`` (steps done: ``tokens`` trained over the tokens of a step, else the last step of
    ``curve``); ``best_val_loss`` (nats/token: the lowest of ``curve``'s validation losses, which the report
    keeps to 5 decimals). A number that cannot be had is left out (the sweep table shows a dash)."""
    cfg = config_from_dict(config, stored=True)
    tc, m = cfg.train, cfg.model
    per_step = tc.batch_size * tc.seq_len * tc.grad_accum
    out = {"blocks": m.n_layers, "sublayers": m.n_sublayers, "d_model": m.d_model, "steps": tc.steps,
           "planned_tokens": tc.steps * per_step}
    if tokens is not None:
        out["step"] = tokens // per_step
    elif curve and (curve["step"] or curve["val_step"]):
        out["step"] = max(curve["step"] + curve["val_step"])
    if curve and curve["val_loss"]:
        out["best_val_loss"] = min(curve["val_loss"])
    vocab = m.vocab_size
    if vocab == "auto" and cfg.data.path and (Path(cfg.data.path) / "meta.json").is_file():
        vocab = resolve_vocab_size("auto", read_meta(cfg.data.path)["vocab_size"], m.vocab_multiple)
    if vocab != "auto":
        sized = dataclasses.replace(m, vocab_size=vocab)
        out.update(params=count_parameters(sized), non_embedding_params=count_parameters(sized, non_embedding=True))
    return out


def check_train_job(job: GridJob, here: bool = True, world_size: int = 1) -> None:
    """The grid check of training jobs (``run_grid(check=...)``): the trainer's own checks
    (:func:`keel.train.trainer.check_train_config`: shapes, ranges, a batch that must divide over the
    ``world_size`` ranks of each run, and with ``here`` a device or a model too large for this machine; a
    Slurm job runs on another) on ``job.config``, before any run of the grid starts (or is submitted).

    Raises:
        KeelError: the first problem of the config.
    """
    check_train_config(config_from_dict(job.config), here=here, world_size=world_size)


def train_task(job: GridJob, run_dir: Path, resume: bool) -> dict:
    """Grid task of ``keel sweep``: train (or resume) ``job.config`` in ``run_dir``; a run
    interrupted before its first intact checkpoint is trained again from step 0.

    A run stopped by the trainer (``keel.train.TrainingStopped``: non-finite steps,
    divergence) is a result (its verdict is a failure mode, ``stopped`` holds the
    message), not an error. Returns
    :func:`run_summary` plus ``wall_s`` (seconds in this call).
    """
    t0 = time.perf_counter()
    cfg = config_from_dict(job.config)
    stopped = None
    started = resume and RunDir(run_dir).metrics.is_file()  # a grid's --resume also reaches runs never started
    # interrupted before its first intact checkpoint: nothing to continue, train it again from step 0
    restart = started and CheckpointManager(run_dir).find_intact()[0] is None
    if restart:
        _log.info("no intact checkpoint to resume from: training this run again from step 0")
    try:
        train_run(cfg, run_dir, resume=started and not restart, restart=restart)
    except TrainingStopped as e:
        stopped = str(e)
        _log.info(f"stopped: {e}")
    out = run_summary(run_dir, stopped)
    out["wall_s"] = time.perf_counter() - t0
    if restart:  # shown on the grid's progress line, not only in run.log
        out["note"] = "trained again from step 0: it had no intact checkpoint"
    return out


# ----------------------------------------------------------------------------- tables
def held_fixed(runs: list[dict]) -> dict[str, Any]:
    """For tokens (planned), steps (planned) and parameters: the common value if every run
    has the same one, else ``"varies"``; left out where no run has one (none finished).
    Equal-compute comparisons hold tokens fixed."""
    key = {"tokens": "planned_tokens", "steps": "steps", "params": "params"}
    out = {}
    for name in HELD_KEYS:
        vals = {r[key[name]] for r in runs if key[name] in r}
        if vals:
            out[name] = vals.pop() if len(vals) == 1 else "varies"
    return out


def best_over(runs: list[dict], grid_keys: Sequence[str], key: str) -> list[dict]:
    """For every combination of the grid keys other than ``key``, the run (among those that
    did not diverge and have a final validation loss) with the lowest final validation loss.

    Returns one row per combination, in first-seen order: ``{"values": {...other keys},
    "best": value of key or None, "run": the chosen run or None, "n_ok": usable runs,
    "n": runs}``. Raises KeelError if ``key`` is not a grid key.
    """
    if key not in grid_keys:
        raise KeelError(f"--best-over {key} is not one of the grid keys ({', '.join(grid_keys) or 'none'})")
    others = [k for k in grid_keys if k != key]
    groups: dict[str, dict] = {}
    best: dict[str, JobResult] = {}
    for r in map(JobResult.from_dict, runs):
        vals = r.values
        gk = json.dumps([vals.get(k) for k in others])
        g = groups.setdefault(gk, {"values": {k: vals.get(k) for k in others}, "best": None, "run": None,
                                   "n_ok": 0, "n": 0})
        g["n"] += 1
        if not usable(r):
            continue
        g["n_ok"] += 1
        if gk not in best or r.final_val_loss < best[gk].final_val_loss:
            best[gk] = r
            g["run"], g["best"] = r.to_dict(), vals.get(key)
    return list(groups.values())


def usable(r: JobResult) -> bool:
    """Run ``r`` finished, did not diverge and has a final validation loss (a best-over run, a point of a
    plot against depth)."""
    return r.done and not r.diverged and r.final_val_loss is not None


def _col(key: str) -> str:
    return {"model.n_layers": "blocks (sub-layers)", "model.residual": "scheme"}.get(key, key)


def _cell(key: str, v: Any, sublayers: int | None = None) -> str:
    """A grid value as ``sweep.md`` shows it; ``model.n_layers`` as blocks (sub-layers), the sub-layers
    the run's effective depth (``sublayers``: a looped run's 2 (P + R C + Q)) or, not known, 2 x blocks."""
    if v is None:
        return "—"
    if key == "model.n_layers":
        return f"{v} ({sublayers if sublayers is not None else 2 * int(v)})"
    return _fmt(v)


def _num(v, fmt="{:.4f}") -> str:
    return "—" if v is None else fmt.format(v)


def sweep_markdown(summary: dict) -> str:
    """The ``sweep.md`` text: header (what was held fixed), all runs, and the best-over table."""
    keys = summary["grid_keys"] + [k for k in summary.get("derived_keys", [])]
    lines = _sweep_header(summary)
    head = [_col(k) for k in keys] + ["final val", "best val", "final ppl", "tokens", "steps", "params (M)",
                                       "non-emb (M)", "wall s", "verdict"]
    lines += markdown_table(head, [_run_cells(r, keys) for r in summary["runs"]])
    if summary.get("best"):
        lines += _best_over_table(summary)
    return "\n".join(lines) + "\n"


def _sweep_header(summary: dict) -> list[str]:
    """The lines of ``sweep.md`` above its table of runs: the sweep, its base config and overrides, what
    was held fixed and what varies, the units."""
    held = summary["held_fixed"]
    fixed = [f"{k} = {v:,}" for k, v in held.items() if v != "varies"]
    varies = [k for k, v in held.items() if v == "varies"]
    what = (f"**Held fixed:** {', '.join(fixed) or 'nothing'}. **Varies:** {', '.join(varies) or 'nothing'}"
            " (tokens and steps are the planned ones; params include the embedding)." if held else
            "**Held fixed:** not known: no finished run has its result file (a run restored from an earlier "
            "report keeps only its measures).")
    return [f"# Sweep {summary['out']}", "",
            f"Base config: `{summary['config']}`; overrides: `{' '.join(summary['sets']) or 'none'}`.", "",
            what, "",
            "Losses are validation cross-entropy in nats/token; wall s = seconds in the worker (evaluations "
            "included)" + ("; depth is blocks (sub-layers)." if "model.n_layers" in summary["grid_keys"] else "."), ""]


def _run_cells(run: dict, keys: list[str]) -> list[str]:
    """The row of ``run`` (a grid result's content: :class:`~keel.experiments.job_result.JobResult`) in
    ``sweep.md``'s table of runs: its values of ``keys``, then its losses, size and verdict (a run not done:
    dashes and its error; a number the result lacks, e.g. the parameters of a run restored from an earlier
    report whose vocabulary is not known (:func:`restored_summary`): a dash)."""
    r = JobResult.from_dict(run)
    vals = r.values
    cells = [_cell(k, vals.get(k), r.sublayers) for k in keys]
    if not r.done:
        return cells + ["—"] * 8 + [f"error: {r.message}"]
    fv = r.final_val_loss
    millions = lambda n: None if n is None else n / 1e6
    return cells + [
        _num(fv), _num(r.best_val_loss), _num(perplexity(fv) if fv is not None else None, "{:.2f}"),
        _num(r.tokens, "{:,}"), _num(r.step, "{}"), _num(millions(r.params), "{:.3f}"),
        _num(millions(r.non_embedding_params), "{:.3f}"), f"{0 if r.wall_s is None else r.wall_s:.0f}", r.verdict or "—"]


def _best_over_table(summary: dict) -> list[str]:
    """The lines of ``sweep.md``'s best-over section: the best value of the ``best_over`` key per value of
    the other grid keys, among the runs that did not diverge."""
    key = summary["best_over"]
    others = [k for k in summary["grid_keys"] if k != key]
    lines = ["", f"## Best {key} per {', '.join(_col(k) for k in others) or 'sweep'}", "",
             "Chosen among runs that did not diverge, by final validation loss.", ""]
    head = [_col(k) for k in others] + [f"best {key}", "final val", "final ppl", "usable runs"]
    return lines + markdown_table(head, [[_cell(k, g["values"].get(k), g.get("sublayers")) for k in others] + [
        _cell(key, g["best"], g.get("sublayers")) if g["best"] is not None else "all diverged", _num(g["final_val_loss"]),
        _num(perplexity(g["final_val_loss"]) if g["final_val_loss"] is not None else None, "{:.2f}"),
        f"{g['n_ok']}/{g['n']}"] for g in summary["best"]])


def load_group_table(folder: str | Path, group: str, alias: str) -> dict | None:
    """The own table of group ``group`` of a folder the study engine wrote (a sweep's, stress
    test's or LR-sensitivity grid's): ``report.json``'s ``group_tables[group]``. A folder written
    before the engine's report (no ``report.json``, or one without that group's table) is read from
    its file ``alias`` (``sweep.json``, ``stress.json``, ``sensitivity.json``: the same data, now a
    deprecated alias). None when the folder has neither. Raises KeelError if a file is not JSON."""
    folder = Path(folder)
    for name, pick in (("report.json", lambda d: (d.get("group_tables") or {}).get(group)), (alias, lambda d: d)):
        p = folder / name
        if p.is_file():
            try:
                data = pick(json.loads(p.read_text()))
            except (ValueError, AttributeError) as e:
                raise KeelError(f"{p}: not a keel report ({e.__class__.__name__})") from None
            if data is not None:
                return data
    return None


def load_sweep(sweep_dir: str | Path) -> dict:
    """The sweep table of a sweep folder (:func:`find_sweep`). Raises KeelError if the folder has none."""
    found = find_sweep(sweep_dir)
    if found is None:
        raise KeelError(f"not a sweep folder (no report.json with a sweep table, no sweep.json): {sweep_dir}")
    return found[0]


def find_sweep(folder: str | Path) -> tuple[dict, Path] | None:
    """The sweep table of ``folder`` and the folder its runs are in: a sweep folder's (:func:`load_group_table`
    of group ``sweep``: its ``report.json``, or the ``sweep.json`` of a folder written before it), else a study
    grid group's (``report.json``'s group table, the runs under ``folder/GROUP``): of the group folder
    ``folder``, or of a study folder ``folder`` with one grid group. None where there is none.

    Raises:
        KeelError: a ``report.json`` that is not JSON; a study folder with several grid groups (naming their folders).
    """
    folder = Path(folder)
    data = load_group_table(folder, "sweep", "sweep.json")
    if data is not None:
        return data, folder
    if (folder / "report.json").is_file():
        grids = _grid_tables(folder)
        if len(grids) > 1:
            raise KeelError(f"{folder} is a study with several grid groups: give one's folder "
                            f"({', '.join(str(folder / g) for g in grids)})")
        return next(((t, folder / g) for g, t in grids.items()), None)
    if (folder.parent / "report.json").is_file():
        table = _grid_tables(folder.parent).get(folder.name)
        return None if table is None else (table, folder)
    return None


def _grid_tables(study_dir: Path) -> dict[str, dict]:
    """The sweep tables (those with ``grid_keys``) of the groups of the study folder ``study_dir``'s report."""
    p = study_dir / "report.json"
    try:
        tables = json.loads(p.read_text()).get("group_tables") or {}
        return {g: t for g, t in tables.items() if isinstance(t, dict) and "grid_keys" in t}
    except (ValueError, AttributeError) as e:
        raise KeelError(f"{p}: not a keel report ({e.__class__.__name__})") from None
