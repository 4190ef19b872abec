"""A study's run records: one per planned run, read from its run folder (:func:`run_record`:
status, losses, the divergence verdict, the plateau exit step, a thinned loss curve) or
restored from an earlier ``report.json`` (``keel study --restore``: :func:`load_restored`,
every record checked by :meth:`keel.experiments.record.RunRecord.from_dict` before a verdict reads it)."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from pathlib import Path

from keel.config import ModelConfig, load_config, resolve_config_path
from keel.diagnostics.divergence import Thresholds
from keel.errors import KeelError
from keel.experiments.grid import GridJob
from keel.experiments.job_result import JobResult, is_number
from keel.experiments.record import MEASURE_KEYS, OPTIONAL_KEYS, PENDING_KEYS, RunRecord
from keel.experiments.study.spec import Group, Study, without_loop_keys
from keel.experiments.sweep import restored_summary
from keel.rundir import RunDir
from keel.train.metrics import read_metrics, trailing_mean


PLATEAU_WINDOW = 10  # steps of the trailing mean of the training loss that must fall below the plateau level


CURVE_POINTS = 100  # points of the thinned loss curve each run's record keeps in report.json
SPIKE_STEPS = 1000  # the early phase whose loss spikes a record measures (paper Figure 1a/4: the first 1,000 steps)


def spike_steps(train_steps: int | None, window: int = PLATEAU_WINDOW) -> int:
    """The early phase :func:`early_spike` reads of a run of ``train_steps`` steps: the first
    :data:`SPIKE_STEPS` (the paper's first 1,000 steps, of a 238k-step run) or the first half of
    the run, whichever is shorter (at least ``2 * window``, the measure's least). The paper's
    spike is early and at a high LR; in a 1,000-step run (the cpu scale) its 1,000 steps are the
    whole run, whose second half is at under half the peak LR (cosine), where a healthy run's
    largest rise is a swing of the data order (the same steps for every scheme and LR of a
    seed), not a spike. None (unknown length): :data:`SPIKE_STEPS`."""
    if not train_steps:
        return SPIKE_STEPS
    return max(2 * window, min(SPIKE_STEPS, train_steps // 2))


# ----------------------------------------------------------------------------- run records
def plateau_exit_step(records: Sequence[dict], level: float | None, window: int = PLATEAU_WINDOW) -> int | None:
    """First step whose trailing mean training loss over ``window`` steps is below ``level``
    (nats/token; the divergence classifier's stagnation level, 95% of the unigram entropy):
    the step the run leaves the unigram plateau. None if it never does (or no level)."""
    if level is None:
        return None
    losses = [(r["step"], r["loss"]) for r in records if "loss" in r and math.isfinite(r["loss"])]
    means = trailing_mean([x for _, x in losses], window)
    return next((losses[i][0] for i in range(window - 1, len(losses)) if means[i] < level), None)


def early_spike(records: Sequence[dict], steps: int = SPIKE_STEPS, window: int = PLATEAU_WINDOW,
                cap: float | None = None) -> float | None:
    """The largest loss spike of a run's first ``steps`` steps (nats/token), from every step's
    training loss (not the thinned curve): with ``m_i`` the ``window``-step trailing mean of the
    training loss at step i, ``max_i (m_i - min_{j <= i - window} m_j)``, the largest rise of the
    smoothed loss above its lowest value at least one window earlier (0 when it never rises; the
    window keeps one noisy step from reading as a spike). A non-finite loss in the span gives
    ``cap`` (e.g. the step-0 validation loss: the run lost everything it had learnt). None with
    fewer than ``2 * window`` steps. The rule of claim (h) (paper Figure 1a/4: Pre-LN spikes in
    the first 1,000 steps at an aggressive LR, Keel does not), fixed before any run was read."""
    xs = [r["loss"] for r in records if is_number(r.get("loss")) and is_number(r.get("step")) and r["step"] <= steps]
    if any(not math.isfinite(x) for x in xs):
        return cap
    if len(xs) < 2 * window:
        return None
    m = trailing_mean(xs, window)
    best, rise = math.inf, 0.0
    for i in range(2 * window - 1, len(xs)):
        best = min(best, m[i - window])
        rise = max(rise, m[i] - best)
    return rise


def thinned_curve(records: Sequence[dict], points: int = CURVE_POINTS, window: int = PLATEAU_WINDOW) -> dict:
    """A run's loss curve small enough to keep in ``report.json`` (so that a restored report can
    redraw it): at most ``points`` steps, evenly spaced, of the ``window``-step trailing mean
    training loss (nats/token) and the peak LR, and every validation loss. Keys ``step``,
    ``loss``, ``lr``, ``val_step``, ``val_loss``; non-finite values are left out."""
    train = [(r["step"], r["loss"], r.get("lr")) for r in records
             if is_number(r.get("loss")) and math.isfinite(r["loss"]) and is_number(r.get("step"))]
    means = trailing_mean([x for _, x, _ in train], window)
    keep = sorted({round(i * (len(train) - 1) / max(1, points - 1)) for i in range(points)}) if train else []
    val = [(r["step"], r["val_loss"]) for r in records
           if is_number(r.get("val_loss")) and math.isfinite(r["val_loss"]) and is_number(r.get("step"))]
    return {"step": [train[i][0] for i in keep], "loss": [round(means[i], 5) for i in keep],
            "lr": [train[i][2] for i in keep], "val_step": [s for s, _ in val], "val_loss": [round(x, 5) for _, x in val]}


def sublayers_of(model: dict) -> int:
    """The effective depth of a run's ``[model]`` keys (a dict; 0 without ``n_layers``): sub-layers a
    forward pass applies, :attr:`keel.config.ModelConfig.n_sublayers` (2 (P + R C + Q) when looped)."""
    if "n_layers" not in model:
        return 0
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    return ModelConfig(**{k: v for k, v in model.items() if k in names}).n_sublayers


def run_record(group: Group, job: GridJob, run_dir: Path, result: dict | None) -> RunRecord:
    """One run's record (:class:`keel.experiments.record.RunRecord`), the run's row of the
    report: coordinates from the job's config, ``status`` pending without a ``result``; with one
    (the run's ``result.json``, finished), ``tokens`` trained, final / step-0 validation loss,
    ``capped_loss`` (final, or the step-0 loss when the run has no finite final loss: a NaN would
    win or lose ``min`` by its position), divergence verdict, max LR (ramp), plateau exit step,
    thinned loss curve and early spike (from ``run_dir``'s ``metrics.jsonl``; over the first
    :func:`spike_steps` of the run's ``train.steps``)."""
    model, train = job.config.get("model", {}), job.config.get("train", {})  # the run's own keys: one vocabulary
    rec = RunRecord(group=group.name, name=job.name, scheme=model.get("residual"),
                    sublayers=sublayers_of(model), seed=train.get("seed"), lr=train.get("lr"),
                    scheme_version=job.values.get("scheme_version", 1), values=job.values, result=result or {},
                    stored=PENDING_KEYS)
    if result is None:
        return rec
    res = JobResult.from_dict(result)
    final, first = res.final_val_loss, res.first_val_loss
    records = read_metrics(RunDir(run_dir).metrics)
    rec.update(status="done" if res.status is None else res.status, tokens=res.tokens, final_val_loss=final,
               first_val_loss=first, capped_loss=final if is_number(final) and math.isfinite(final) else first,
               verdict=res.verdict, divergence=res.divergence, diverged=res.diverged, max_lr=res.max_lr,
               **group.kind_class.record(group), wall_s=res.wall_s,
               plateau_exit_step=plateau_exit_step(records, Thresholds().plateau_level(res.unigram_entropy or None)),
               curve=thinned_curve(records), ablation=res.ablation,
               early_spike=early_spike(records, steps=spike_steps(train.get("steps")), cap=first))
    if res.test_loops is not None:
        rec.update(test_loops=res.test_loops)
    return rec


def load_restored(path: str | Path, study: Study) -> dict[tuple[str, str], RunRecord]:
    """The finished runs of an earlier ``report.json`` of the same study, scale and settings,
    ``{(group, run name): record}``: what stands in for run folders that are gone (``runs/`` is
    not kept between machines; the committed report is). A record keeps the numbers the
    verdicts and tables read (:class:`keel.experiments.record.RunRecord`, checked by its
    :meth:`~keel.experiments.record.RunRecord.from_dict`), with their thinned loss curves.

    Settings are compared by value (:func:`_restore_settings_diff`): the config the scale's and
    the user's keys give, and each group's with its own ``set`` when the report records it
    (``group_sets``; reports written before it compare the former only).

    Raises:
        KeelError: the file is missing or not a study report; it is another study or scale; its
            runs were trained with other settings; a finished run's record is malformed
            (:meth:`RunRecord.from_dict`: a field of the wrong type, a scheme or LR its name
            contradicts, a negative wall time, curves of mismatched lengths) or repeated.
    """
    path = Path(path)
    try:
        rep = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise KeelError(f"--restore {path}: no such file (give a study's report.json)") from None
    except IsADirectoryError:
        raise KeelError(f"--restore {path} is a folder; give the report.json in it") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise KeelError(f"--restore {path}: cannot read it as JSON ({e})") from None
    if not isinstance(rep, dict) or not isinstance(rep.get("runs"), list):
        raise KeelError(f"--restore {path}: not a study report (no runs list); give a study's report.json")
    if rep.get("study") is None:  # e.g. the table of keel stress or sweep: a runs list, no study
        raise KeelError(f"--restore {path}: not a study report (it names no study); give a study's report.json")
    if (rep.get("study"), rep.get("scale")) != (study.name, study.scale):
        raise KeelError(f"--restore {path} holds study {rep.get('study')!r} at scale {rep.get('scale')!r}, "
                        f"not {study.name!r} at {study.scale!r}")
    if not isinstance(rep.get("sets"), list):
        raise KeelError(f"--restore {path}: the report records no settings (sets), so its runs cannot be matched")
    diff = _restore_settings_diff(study, rep["sets"], None)
    group_sets = rep.get("group_sets", {})  # reports before v3 have none
    if not isinstance(group_sets, dict) or not all(isinstance(v, list) for v in group_sets.values()):
        raise KeelError(f"--restore {path}: group_sets must map each group to a list of section.key=value texts, "
                        f"got {json.dumps(group_sets)[:80]}")
    for g in study.groups:
        if not diff and g.name in group_sets:
            diff = _restore_settings_diff(study, rep["sets"] + list(group_sets[g.name]), g)
    if diff:
        raise KeelError(f"--restore {path}: its runs were trained with other settings ({diff}); restore only "
                        "the same study, scale and --set values")
    return _restored_runs(path, rep)


def _restored_runs(path: Path, rep: dict) -> dict[tuple[str, str], RunRecord]:
    """:func:`load_restored`'s records: the finished runs (``done``, ``superseded``) of the report
    ``rep`` read from ``path``, each checked (:meth:`RunRecord.from_dict`), by (group, run name),
    marked ``done`` and carrying the report's ``unigram_entropy``.

    Raises:
        KeelError: a record that is not an object, has another status, is malformed, or is listed
            twice; the message names the record (``runs[i]``, and its run when it has a name) and the key.
    """
    h1 = rep.get("unigram_entropy")
    out: dict[tuple[str, str], RunRecord] = {}
    superseded = rep.get("superseded_runs") if isinstance(rep.get("superseded_runs"), list) else []
    for where, r in [*((f"runs[{i}]", r) for i, r in enumerate(rep["runs"])),
                     *((f"superseded_runs[{i}]", r) for i, r in enumerate(superseded))]:
        if RunRecord.trains_again(r):
            continue  # not restored: trained again
        rec = RunRecord.from_dict(r, f"--restore {path}: {where}")
        if (rec.group, rec.name) in out:
            raise KeelError(f"--restore {path}: run {rec.name} of group {rec.group} is listed twice")
        rec.update(status="done", unigram_entropy=h1 if is_number(h1) else None)
        out[(rec.group, rec.name)] = rec
    return out


def _restore_settings_diff(study: Study, theirs: list, group: Group | None) -> str:
    """The keys whose value differs between the config the report's ``theirs`` (``section.key=value``
    texts) give and the one this study gives (for ``group``, with its own ``set``), in words;
    empty when they agree. Both sides are read as a run reads them: a looped group's with its loop
    (:meth:`Group.loop_sets` at its first depth; its ``model.loop_*`` keys need it), the base without any
    ``model.loop_*`` key (:func:`without_loop_keys`, as the base run). Raises KeelError when
    ``theirs`` does not parse."""
    base = resolve_config_path(study.base)
    loop = group.loop_sets(group.sublayers[0]) if group is not None and group.loop else []

    def as_run(sets: list) -> list:
        return list(sets) + loop if group is not None else without_loop_keys(sets)
    try:
        old = load_config(base, as_run([str(x) for x in theirs])).to_dict()
    except KeelError as e:
        raise KeelError(f"--restore: the report's settings do not load ({e})") from None
    new = load_config(base, as_run(study.all_sets(group))).to_dict()
    keys = [(sec, k) for sec in sorted(set(old) | set(new)) for k in sorted(set(old.get(sec, {})) | set(new.get(sec, {})))
            if old.get(sec, {}).get(k) != new.get(sec, {}).get(k)]
    if not keys:
        return ""
    where = f"group {group.name}: " if group else ""
    return where + ", ".join(f"{sec}.{k} {old.get(sec, {}).get(k)!r} in the report, {new.get(sec, {}).get(k)!r} now"
                             for sec, k in keys)


def restored_record(group: Group, job: GridJob, old: RunRecord, planned: bool = True) -> RunRecord | None:
    """A run's record (:func:`run_record`) from its record in an earlier report (``old``, of
    :func:`load_restored`), marked ``restored``; ``result`` holds what the LR-grid summaries and a grid
    group's sweep table read: with ``planned`` (``job.config`` is the config the study plans for the run,
    not a sketch of its coordinates) also the steps, best validation loss and parameter counts that
    :func:`keel.experiments.sweep.restored_summary` derives. None when ``old`` is for other coordinates
    (scheme, depth, seed, LR) than ``job``: then the run is trained."""
    rec = run_record(group, job, Path(), None)
    if any(getattr(old, k) != getattr(rec, k) for k in ("scheme", "sublayers", "seed", "lr")):
        return None
    rec.update({k: getattr(old, k) for k in ("status", *MEASURE_KEYS, *(k for k in OPTIONAL_KEYS if k in old))},
               restored=True)
    derived = restored_summary(job.config, old.tokens, old.curve) if planned else {}
    rec.result = {"name": job.name, "values": job.values, "unigram_entropy": old.unigram_entropy, **derived,
                  **{k: getattr(rec, k) for k in ("status", *MEASURE_KEYS) if k != "capped_loss"}}
    return rec


def kept_restored(g: Group, restored: dict[tuple[str, str], RunRecord]) -> list[RunRecord]:
    """The restored records (:func:`load_restored`) of group ``g``, as run records marked
    ``restored``, for a group that is not planned yet (an ``lr_from`` group waiting for its
    source): a report written meanwhile keeps them, so that restoring from it loses nothing."""
    out = []
    for (name, run_name), old in restored.items():
        if name != g.name:
            continue
        config = {"model": {"residual": old.scheme, "n_layers": old.sublayers // 2},
                  "train": {"seed": old.seed, "lr": old.lr}}
        rec = restored_record(g, GridJob(run_name, config, old.values), old, planned=False)  # a sketch of a config
        if rec is not None:
            out.append(rec)
    return out
