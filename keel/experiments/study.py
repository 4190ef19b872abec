"""``keel study NAME --scale SCALE``: a study of the paper's claims, declared as data, run on
the grid runner, reported with verdicts computed from paired seeds.

A study is a TOML file (packaged in ``keel/configs/studies/``, e.g. ``claims.toml``) with

* ``[groups.G]``: a set of training runs, schemes x sub-layers x peak LRs x seeds, with extra
  config keys (``set``). ``kind = "ramp"`` makes it the paper's max-LR stress test
  (:mod:`keel.experiments.stress`: LR 0 -> ``peak_lr`` over ``ramp_steps``, a ``pre_ln``
  reference run per depth and seed); ``lr_from = "G2"`` trains every scheme at the optimal LR
  of group G2 at ``lr_from_sublayers`` sub-layers (the seed-mean curve's argmin), once
  those runs have finished (LR transfer across depth), and at the points of G2's LR grid
  ``lr_from_steps`` away from it (e.g. ``[0, -1]``: the optimum and the next lower LR).
  ``note``: text for the report's section of a group that no claim reads (e.g. the showcase).
  ``baselines_from = "G2"`` with ``baselines = ["keel", ...]``: that section pairs each scheme
  with those schemes of G2 at the same depths, seeds and LRs (e.g. the residual bench against
  the lr-grid's Keel and Pre-LN; :func:`baseline_margins`).
  Config keys apply in the order scale ``set``, group ``set``, the user's ``--set`` (later wins).
* ``[[claims]]``: per claim of the paper, the verdict function (``test``, a key of
  :data:`CLAIM_TESTS`) and the groups and schemes it reads. A ``max_lr_order`` claim may name an
  ``extended_group``: its ramp continued at the same LR per step to a higher peak, where the
  pairs that the first peak censors are judged (optional per scale).
* ``[scales.S]``: for each scale (``tiny`` for the test suite, ``cpu``, ``gpu-1``, ``paper``)
  the config keys of every run (``set``) and each group's sizes (``[scales.S.groups.G]``).
* ``[verdict]``: ``min_effect`` (nats/token) and ``min_seeds`` of :func:`paired_verdict`.

Every run is an ordinary ``keel train`` run (:func:`keel.experiments.sweep.train_task`):
finished runs are cached, interrupted ones resume (``--resume``), groups run in file order
(``--groups ramp,init`` trains only those, e.g. the cheap groups first).
Layout of ``--out``::

    OUT/<group>/<run>/          one training run (grid job: job.json, result.json, run.log, ...)
    OUT/<ramp group>/references/<run>/   the stress test's reference runs
    OUT/report.md, report.json  the verdicts, the per-claim tables, every run's numbers
    OUT/*.png                   loss against LR per group, the ramp, margins against depth, showcase

The verdict vocabulary is ``reproduced`` / ``not reproduced`` / ``inconclusive``, computed, never
written by hand: by :func:`paired_verdict` on paired per-seed differences for every claim test
but :func:`claim_lr_transfer`, whose rule (same optimal grid point in every seed) is its own.
"""

from __future__ import annotations

import json
import logging
import math
import signal
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import matplotlib.ticker

from keel.config import Override, config_from_dict, load_config, override_text, resolve_config_path, tomllib
from keel.data import resolve_data
from keel.data.stats import dataset_unigram_entropy
from keel.errors import Interrupted, KeelError
from keel.experiments import sensitivity as LS
from keel.experiments import stress as ST
from keel.experiments.grid import GridJob, cached_result, check_pool, run_grid
from keel.experiments.plot import plot_loss_curves
from keel.experiments.sweep import build_jobs, check_train_job, param_count, train_task
from keel.io import atomic_write_text, make_dirs
from keel.model import SCHEMES
from keel.train.metrics import read_metrics
from keel.train.plots import plt, save_figure

_log = logging.getLogger(__name__)

REPRODUCED, NOT_REPRODUCED, INCONCLUSIVE = "reproduced", "not reproduced", "inconclusive"
GROUP_KEYS = {"kind", "schemes", "sublayers", "lrs", "seeds", "set", "peak_lr", "ramp_steps", "lr_from",
              "lr_from_sublayers", "lr_from_steps", "note", "baselines_from", "baselines"}
PLATEAU_WINDOW = 10  # steps of the trailing mean of the training loss that must fall below the plateau level
MAX_LR_FLOOR = math.log10(1.05)  # noise floor of a max-LR pair (log10 of the ratio): a 5% difference


# ----------------------------------------------------------------------------- the study as data
@dataclass
class Group:
    """One group of runs of a study at one scale (see the module docstring). Depths are in
    sub-layers (even); ``lrs`` are peak LRs (absolute); ``sets`` are its ``[set]`` table as typed
    ``(section.key, value)`` pairs (:func:`keel.config.apply_overrides`)."""

    name: str
    schemes: list[str]
    sublayers: list[int]
    seeds: list[int]
    lrs: list[float] = field(default_factory=list)
    kind: str = "train"
    sets: list[Override] = field(default_factory=list)
    peak_lr: float = 5e-2
    ramp_steps: int = 1000
    lr_from: str = ""
    lr_from_sublayers: int = 0
    lr_from_steps: list[int] = field(default_factory=lambda: [0])
    note: str = ""
    baselines_from: str = ""
    baselines: list[str] = field(default_factory=list)


@dataclass
class Study:
    """A loaded study at one scale: ``groups`` in run order, ``claims`` (dicts from the TOML),
    ``sets`` (the scale's config keys as typed pairs), ``user_sets`` (the user's ``--set``
    strings: applied last, after a group's own ``set``), ``min_effect`` (nats/token) and
    ``min_seeds`` of the verdict rule."""

    name: str
    scale: str
    description: str
    note: str
    base: str
    sets: list[Override]
    groups: list[Group]
    claims: list[dict]
    min_effect: float = 0.02
    min_seeds: int = 2
    user_sets: list[str] = field(default_factory=list)

    def all_sets(self, group: Group | None = None) -> list[Override]:
        """The config keys of a run of ``group`` (or of the study's base run): the scale's, the
        group's own ``set``, then the user's ``--set``, later ones winning."""
        return self.sets + (group.sets if group else []) + list(self.user_sets)


# group keys' TOML types: key -> (element types, words, example); lists first, then scalars
_LIST_TYPES = {"schemes": ((str,), "a list of strings", '["keel"]'), "sublayers": ((int,), "a list of integers", "[64]"),
               "seeds": ((int,), "a list of integers", "[0, 1]"), "lrs": ((int, float), "a list of numbers", "[0.001]"),
               "baselines": ((str,), "a list of strings", '["keel", "pre_ln"]')}
_SCALAR_TYPES = {"peak_lr": (int, float), "ramp_steps": (int,), "lr_from_sublayers": (int,), "lr_from": (str,),
                 "kind": (str,), "note": (str,), "baselines_from": (str,)}


_RAMP_ONLY = {"peak_lr", "ramp_steps"}  # keys that only a kind = "ramp" group reads
_TRAIN_ONLY = {"lrs", "lr_from", "lr_from_sublayers", "lr_from_steps", "baselines_from", "baselines"}  # train only


def _check_group_types(name: str, d: dict) -> None:
    """Raise KeelError naming a group key of the wrong TOML type (e.g. ``lrs = 1e-3`` for
    ``lrs = [1e-3]``, ``lrs = ["1e-3"]``, ``schemes = "keel"``)."""
    def ok(x, types):
        return isinstance(x, types) and not isinstance(x, bool)
    for key, (types, words, example) in _LIST_TYPES.items():
        v = d.get(key, [])
        if not isinstance(v, list) or not all(ok(x, types) for x in v):
            raise KeelError(f"study group {name!r}: {key} must be {words}, e.g. {key} = {example}, got {v!r}")
    for key, types in _SCALAR_TYPES.items():
        if key in d and not ok(d[key], types):
            raise KeelError(f"study group {name!r}: {key} must be {'text' if types == (str,) else 'a number'}, "
                            f"got {d[key]!r}")
    if "set" in d and not isinstance(d["set"], dict):
        raise KeelError(f"study group {name!r}: set must be a table of config keys, e.g. set = "
                        "{ \"model.embed_init_std\" = 1.0 }")
    if any(not x > 0 for x in d.get("lrs", [])) or ("peak_lr" in d and not d["peak_lr"] > 0):
        raise KeelError(f"study group {name!r}: learning rates must be > 0")


def _group(name: str, spec: dict, sized: dict) -> Group:
    unknown = (set(spec) | set(sized)) - GROUP_KEYS
    if unknown:
        raise KeelError(f"study group {name!r}: unknown key(s) {', '.join(sorted(unknown))}")
    d = {**spec, **sized}
    _check_group_types(name, d)
    sets = list(d.pop("set", {}).items())
    g = Group(name=name, sets=sets, **{k: v for k, v in d.items()})
    for L in g.sublayers:
        if not isinstance(L, int) or L < 2 or L % 2:
            raise KeelError(f"study group {name!r}: sub-layers must be even integers >= 2, got {L}")
    if g.kind not in ("train", "ramp"):
        raise KeelError(f"study group {name!r}: kind must be train or ramp, got {g.kind!r}")
    other = sorted(set(d) & (_TRAIN_ONLY if g.kind == "ramp" else _RAMP_ONLY))
    if other:
        raise KeelError(f"study group {name!r}: {', '.join(other)} belong(s) to a "
                        f"{'train' if g.kind == 'ramp' else 'ramp'} group, not to this {g.kind} group")
    if g.kind == "ramp" and g.ramp_steps < 1:
        raise KeelError(f"study group {name!r}: ramp_steps must be >= 1, got {g.ramp_steps}")
    if g.kind == "train" and not (g.lrs or g.lr_from):
        raise KeelError(f"study group {name!r} has neither lrs nor lr_from")
    steps = g.lr_from_steps
    if not (isinstance(steps, list) and steps and all(isinstance(k, int) and not isinstance(k, bool) for k in steps)
            and len(set(steps)) == len(steps)):
        raise KeelError(f"study group {name!r}: lr_from_steps must be a list of distinct integers (grid steps from "
                        f"the transferred optimum, e.g. [0, -1]), got {steps!r}")
    if not (g.schemes and g.sublayers and g.seeds):
        raise KeelError(f"study group {name!r} needs schemes, sublayers and seeds")
    return g


def load_study(name: str, scale: str, user_sets: Sequence[str] = ()) -> Study:
    """Read study ``name`` (a packaged preset or a TOML path) at ``scale``.

    Raises:
        KeelError: unknown study or scale, unparsable or non-UTF-8 TOML, a malformed group,
            claim or ``[verdict]``, an unknown scheme, a claim naming a group that the scale
            does not size, a ``--set`` of a key the groups set per run.
    """
    path = resolve_config_path(name, kind="studies")
    try:
        d = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise KeelError(f"cannot parse study {path}: {e}") from None
    except UnicodeDecodeError:
        raise KeelError(f"cannot read study {path}: not UTF-8 text (a TOML file is)") from None
    unknown = set(d) - {"description", "base", "verdict", "groups", "claims", "scales"}
    if unknown:
        raise KeelError(f"study {path.stem!r}: unknown top-level key(s) {', '.join(sorted(unknown))}")
    scales = d.get("scales", {})
    if scale not in scales:
        raise KeelError(f"study {path.stem!r} has no scale {scale!r} (scales: {', '.join(scales)})")
    sc = scales[scale]
    sized = sc.get("groups", {})
    extra = set(sized) - set(d.get("groups", {}))
    if extra:
        raise KeelError(f"study scale {scale!r} sizes undeclared group(s) {', '.join(sorted(extra))}")
    groups = [_group(g, spec, sized[g]) for g, spec in d.get("groups", {}).items() if g in sized]
    for g in groups:
        _check_group_in_study(g, groups)
    claims = d.get("claims", [])
    if not isinstance(claims, list) or not claims:
        raise KeelError("a study needs [[claims]] entries (an array of tables)")
    for c in claims:
        _check_claim(c, {g.name: g for g in groups})
    ids = [c["id"] for c in claims]
    if len(set(ids)) != len(ids):
        raise KeelError(f"study claims repeat an id: {', '.join(ids)}")
    min_effect, min_seeds = _verdict_settings(d.get("verdict", {}))
    controlled = [x.split("=", 1)[0].strip() for x in user_sets if x.split("=", 1)[0].strip() in GRID_KEYS]
    if controlled:
        raise KeelError(f"--set {controlled[0]} is set by the study's groups; change the study file instead")
    return Study(name=path.stem, scale=scale, description=d.get("description", "").strip(), note=sc.get("note", ""),
                 base=d.get("base", "demo"), sets=list(sc.get("set", {}).items()), groups=groups, claims=claims,
                 min_effect=min_effect, min_seeds=min_seeds, user_sets=list(user_sets))


def _check_group_in_study(g: Group, groups: list[Group]) -> None:
    """Raise KeelError for a group's unknown or repeated scheme, repeated depth / seed / LR, or an
    ``lr_from`` that names no fitting train group or steps past its LR grid."""
    bad = [s for s in g.schemes if s not in SCHEMES]
    if bad:
        raise KeelError(f"study group {g.name!r}: unknown scheme(s) {', '.join(bad)} (available: {', '.join(SCHEMES)})")
    if len(set(g.schemes)) != len(g.schemes) or len(set(g.sublayers)) != len(g.sublayers) \
            or len(set(g.seeds)) != len(g.seeds) or len(set(g.lrs)) != len(g.lrs):
        raise KeelError(f"study group {g.name!r} repeats a scheme, depth, seed or LR")
    _check_baselines(g, groups)
    if not g.lr_from:
        return
    src = next((x for x in groups if x.name == g.lr_from and x is not g and x.kind == "train"), None)
    if src is None or g.lr_from_sublayers not in src.sublayers or set(g.schemes) - set(src.schemes):
        raise KeelError(f"study group {g.name!r}: lr_from must name another train group of this scale that "
                        f"has lr_from_sublayers ({g.lr_from_sublayers}) and every scheme of this group")
    far = [k for k in g.lr_from_steps if abs(k) >= len(src.lrs)]
    if far:
        raise KeelError(f"study group {g.name!r}: lr_from_steps {far} reach past group {src.name!r}'s "
                        f"{len(src.lrs)}-point LR grid (at most {len(src.lrs) - 1} steps from its optimum)")


def _check_baselines(g: Group, groups: list[Group]) -> None:
    """Raise KeelError unless ``baselines_from`` and ``baselines`` come together and name another
    train group of this scale that trains every baseline scheme at every depth and LR of ``g``
    (:func:`baseline_margins` pairs each of ``g``'s schemes with them over ``g``'s LRs)."""
    if not (g.baselines_from or g.baselines):
        return
    src = next((x for x in groups if x.name == g.baselines_from and x is not g and x.kind == "train"), None)
    missing_lrs = [lr for lr in g.lrs if src and not any(math.isclose(lr, x) for x in src.lrs)]
    if not g.baselines or src is None or set(g.baselines) - set(src.schemes) \
            or set(g.sublayers) - set(src.sublayers) or missing_lrs or g.lr_from:
        raise KeelError(f"study group {g.name!r}: baselines_from must name another train group of this scale that "
                        f"trains every scheme of baselines ({', '.join(g.baselines) or 'none given'}) at this "
                        f"group's depths and LRs (a group with lrs, not lr_from)")


def _verdict_settings(v) -> tuple[float, int]:
    """``(min_effect, min_seeds)`` of a study's ``[verdict]`` table (defaults 0.02 nats, 2 seeds).

    Raises:
        KeelError: not a table, an unknown key, ``min_effect`` not a finite number > 0,
            ``min_seeds`` not an integer >= 1 (1.7 used to become 1, "two" a traceback).
    """
    def number(x) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool)

    effect, seeds = (v.get("min_effect", 0.02), v.get("min_seeds", 2)) if isinstance(v, dict) else (None, None)
    if not isinstance(v, dict) or set(v) - {"min_effect", "min_seeds"} or not (number(effect) and 0 < effect < math.inf) \
            or not (number(seeds) and isinstance(seeds, int) and seeds >= 1):
        raise KeelError("study [verdict] takes min_effect (a number > 0, nats) and min_seeds (an integer >= 1) only, "
                        f"got {v!r}")
    return float(effect), seeds


# keys a claim of each test reads: (required, optional); "groups" lists, the rest are names
CLAIM_KEYS = {"margin_grows": ({"groups", "scheme", "baseline"}, set()),
              "lr_transfer": ({"group"}, {"scheme"}),
              "init_margin": ({"group", "reference_group", "scheme", "baseline"}, set()),
              "max_lr_order": ({"group", "order"}, {"extended_group"})}
GRID_KEYS = {"model.residual", "model.n_layers", "train.lr", "train.seed"}  # set per run by the groups


def _check_claim(c: dict, groups: dict[str, "Group"]) -> None:
    """Raise KeelError naming the first problem of one ``[[claims]]`` entry: not a table, no id /
    title / known test, a missing or unknown key, a group this scale does not size, a scheme
    the group does not train, a ramp test on a train group (or the reverse)."""
    if not isinstance(c, dict) or not c.get("id") or not c.get("title"):
        raise KeelError("every [[claims]] entry needs an id and a title")
    test = c.get("test")
    if test not in CLAIM_KEYS:
        raise KeelError(f"study claim {c['id']!r}: test must be one of {', '.join(CLAIM_KEYS)}, got {test!r}")
    need, opt = CLAIM_KEYS[test]
    missing, unknown = need - set(c), set(c) - need - opt - {"id", "title", "test", "note"}
    if missing or unknown:
        raise KeelError(f"study claim {c['id']!r} ({test}): " + (f"missing {', '.join(sorted(missing))}" if missing
                                                               else f"unknown key(s) {', '.join(sorted(unknown))}"))
    if not isinstance(c.get("note", ""), str):
        raise KeelError(f"study claim {c['id']!r}: note must be a string (printed under the claim's rule)")
    names = list(c["groups"]) if isinstance(c.get("groups"), list) else [c.get("groups")] if "groups" in c else []
    names += [c[k] for k in ("group", "reference_group") if k in c]
    if c.get("extended_group") in groups:  # optional: a scale whose ramp peak suffices does not size it
        names.append(c["extended_group"])
    for g in names:
        if g not in groups:
            raise KeelError(f"study claim {c['id']!r}: group {g!r} is not sized by this scale")
        if (groups[g].kind == "ramp") != (test == "max_lr_order"):
            raise KeelError(f"study claim {c['id']!r}: {test} cannot read {groups[g].kind} group {g!r}")
    if "groups" in c and not isinstance(c["groups"], list):
        raise KeelError(f"study claim {c['id']!r}: groups must be a list of group names")
    if c.get("extended_group") in groups:
        _check_extended_ramp(c, groups[c["group"]], groups[c["extended_group"]])
    schemes = set().union(*(groups[g].schemes for g in names))
    wanted = [c[k] for k in ("scheme", "baseline") if k in c] + list(c.get("order", []))
    if set(wanted) - schemes:
        raise KeelError(f"study claim {c['id']!r}: scheme(s) {', '.join(sorted(set(wanted) - schemes))} "
                        f"not trained by its group(s)")


def _check_extended_ramp(c: dict, ramp: "Group", ext: "Group") -> None:
    """Raise KeelError unless ``ext`` continues ``ramp``: the same LR per step (``peak_lr /
    ramp_steps``, so both ramps give step k the same LR and the extended runs repeat the first
    ramp up to its end) to a higher peak."""
    same_slope = math.isclose(ext.peak_lr / ext.ramp_steps, ramp.peak_lr / ramp.ramp_steps, rel_tol=1e-9)
    if ext is ramp or not same_slope or ext.peak_lr <= ramp.peak_lr:
        raise KeelError(f"study claim {c['id']!r}: extended_group {ext.name!r} must continue group {ramp.name!r}'s "
                        f"ramp: the same LR per step ({ramp.peak_lr:g} / {ramp.ramp_steps} steps) to a higher peak, "
                        f"got {ext.peak_lr:g} / {ext.ramp_steps} steps")


# ----------------------------------------------------------------------------- verdicts
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


# ----------------------------------------------------------------------------- jobs
def group_jobs(study: Study, g: Group, data_dir: str, out: Path,
               lr_for: dict[str, float] | None = None) -> tuple[list[GridJob], list[GridJob]]:
    """(reference jobs, jobs) of one group: the stress test's for a ramp group, else one
    :func:`keel.experiments.sweep.build_jobs` grid in the order depth, scheme (as the group lists
    them), LR, seed: the seeds of one cell run side by side, so a partial group already holds
    paired cells (every verdict needs >= 2 seeds) for its first schemes, instead of one seed of
    every scheme. ``lr_for``: ``{scheme: [LR, ...]}`` of an ``lr_from`` group (:func:`stepped_lrs`).
    Raises KeelError on a bad config."""
    sets = study.all_sets(g)
    if g.kind == "ramp":
        return ST.stress_jobs(resolve_config_path(study.base), sets, g.schemes, g.sublayers, g.seeds, g.peak_lr,
                              g.ramp_steps, Path(data_dir), out / g.name)
    jobs = []
    for scheme in g.schemes:
        lrs = lr_for[scheme] if lr_for is not None else g.lrs
        grid = {"model.n_layers": [L // 2 for L in g.sublayers], "train.seed": g.seeds,
                "model.residual": [scheme], "train.lr": sorted(lrs)}
        jobs += build_jobs(study.base, grid, sets, data_path=data_dir)
    order = {s: i for i, s in enumerate(g.schemes)}
    jobs.sort(key=lambda j: (j.values["model.n_layers"], order[j.values["model.residual"]], j.values["train.lr"],
                             j.values["train.seed"]))
    return [], jobs


def transferred_lrs(runs: list[dict], g: Group) -> dict[str, float] | None:
    """``{scheme: optimal LR}`` of group ``g.lr_from`` at ``g.lr_from_sublayers``: the argmin of
    the seed-mean capped loss over its LR grid (:func:`keel.experiments.sensitivity.cell_summary`);
    None until every scheme has every seed finished there."""
    out = {}
    for scheme in g.schemes:
        rs = [r for r in runs if r["group"] == g.lr_from and r["scheme"] == scheme
              and r["sublayers"] == g.lr_from_sublayers]
        lrs = sorted({r["lr"] for r in rs})
        curves = [LS.seed_curve([r["result"] for r in rs if r["seed"] == s], lrs) for s in g.seeds]
        if not rs or any(c is None for c in curves):
            return None
        out[scheme] = LS.cell_summary(curves, lrs)["opt_lr"]
    return out


def stepped_lrs(study: Study, g: Group, opt: dict[str, float]) -> dict[str, list[float]]:
    """``{scheme: [peak LR, ...]}`` of an ``lr_from`` group: the points of the source group's LR
    grid ``g.lr_from_steps`` grid steps from each scheme's transferred optimum ``opt[scheme]``
    (0 = the optimum, -1 = the next lower LR; a point off the grid is left out)."""
    grid = sorted(next(x.lrs for x in study.groups if x.name == g.lr_from))
    out = {}
    for scheme, lr in opt.items():
        i = min(range(len(grid)), key=lambda k: abs(math.log(grid[k] / lr)))
        out[scheme] = [grid[i + k] for k in sorted(g.lr_from_steps) if 0 <= i + k < len(grid)]
    return out


# ----------------------------------------------------------------------------- run records
def plateau_exit_step(records: Sequence[dict], level: float | None, window: int = PLATEAU_WINDOW) -> int | None:
    """First step whose trailing mean training loss over ``window`` steps is below ``level``
    (nats/token; the divergence classifier's stagnation level, 95% of the unigram entropy):
    the step the run leaves the unigram plateau. None if it never does (or no level)."""
    if level is None:
        return None
    losses = [(r["step"], r["loss"]) for r in records if "loss" in r and math.isfinite(r["loss"])]
    for i in range(window - 1, len(losses)):
        if statistics.fmean(x for _, x in losses[i - window + 1:i + 1]) < level:
            return losses[i][0]
    return None


def run_record(group: Group, job: GridJob, run_dir: Path, result: dict | None) -> dict:
    """One run's row of the report: coordinates, ``status`` (done / error / pending), ``tokens``
    trained, final / step-0 validation loss, ``capped_loss`` (final, or the step-0 loss when the
    run has no finite final loss), divergence verdict, max LR (ramp), plateau exit step."""
    v = job.values
    scheme = v.get("model.residual", v.get("scheme"))
    rec = {"group": group.name, "name": job.name, "scheme": scheme,
           "sublayers": v.get("sublayers", 2 * v.get("model.n_layers", 0)), "seed": v.get("train.seed", v.get("seed")),
           "lr": v.get("train.lr", v.get("peak_lr")), "status": "pending", "result": result or {}}
    if result is None:
        return rec
    final, first = result.get("final_val_loss"), result.get("first_val_loss")
    h1 = result.get("unigram_entropy")
    metrics = run_dir / "metrics.jsonl"
    records = read_metrics(metrics) if metrics.is_file() else []
    rec.update(status=result.get("status", "done"), tokens=result.get("tokens"), final_val_loss=final,
               first_val_loss=first, capped_loss=final if final is not None else first,
               verdict=result.get("verdict"), divergence=result.get("divergence"),
               diverged=result.get("diverged"), max_lr=result.get("max_lr"),
               peak_lr=group.peak_lr, wall_s=result.get("wall_s"),
               plateau_exit_step=plateau_exit_step(records, 0.95 * h1 if h1 else None))
    return rec


def collect(study: Study, data_dir: str, out: Path, *, train: bool | Sequence[str], workers: int = 1,
            threads: int | None = None) -> tuple[list[dict], list[str]]:
    """Run or only read every group in order; return the run records (:func:`run_record`) of
    every job, finished or not, and one line per group not planned yet: an ``lr_from`` group
    whose source has not finished is skipped (logged), and runs on a later invocation.
    ``train``: True trains every group, False none, a list of group names only those (the other
    groups are read, so the report still covers them)."""
    runs: list[dict] = []
    waiting = []
    for g in study.groups:
        trains = train is True or (bool(train) and g.name in train)
        lr_for = None
        if g.lr_from:
            opt = transferred_lrs(runs, g)
            lr_for = stepped_lrs(study, g, opt) if opt is not None else None
            if lr_for is None:
                n = len(g.schemes) * len(g.sublayers) * len(g.seeds) * len(g.lr_from_steps)
                waiting.append(f"group {g.name} ({n} runs) waits for group {g.lr_from} at {g.lr_from_sublayers} "
                               "sub-layers")
                if trains:
                    _log.info(f"study: {waiting[-1]}")
                continue
        refs, jobs = group_jobs(study, g, data_dir, out, lr_for)
        gdir = out / g.name
        errors = {}
        if trains:
            _log.info(f"study: group {g.name}: {len(jobs)} runs"
                      + (f" + {len(refs)} reference run{'s' if len(refs) > 1 else ''}" if refs else ""))
            if refs:
                run_grid(refs, gdir / ST.REFERENCES, train_task, workers=workers, resume=True, threads=threads,
                         check=check_train_job)
            got = run_grid(jobs, gdir, ST.stress_task if g.kind == "ramp" else train_task, workers=workers,
                           resume=True, threads=threads, check=check_train_job)
            errors = {j.name: r for j, r in zip(jobs, got) if r.get("status") == "error"}
        for j in jobs:
            res = cached_result(gdir / j.name)
            rec = run_record(g, j, gdir / j.name, res if res and res.get("status") == "done" else None)
            if j.name in errors:
                rec.update(status="error", message=errors[j.name].get("message"))
            runs.append(rec)
    return runs, waiting


# ----------------------------------------------------------------------------- estimate (dry run)
def flops_per_token(model_cfg, seq_len: int) -> float:
    """Training FLOPs per token, PaLM (Chowdhery et al. 2022, App. B): ``6 N + 12 n_layers d_model
    seq_len``, N = non-embedding parameters (:func:`keel.experiments.sweep.param_count`), so a
    ``vocab_size = "auto"`` (known only once the tokenizer exists) does not matter."""
    if model_cfg.vocab_size == "auto":
        model_cfg = replace(model_cfg, vocab_size=256)
    return 6.0 * param_count(model_cfg, non_embedding=True) + 12.0 * model_cfg.n_layers * model_cfg.d_model * seq_len


def plan_rows(study: Study, data_dir: str, out: Path, mfu: float, peak_tflops: float) -> list[dict]:
    """One row per group: runs (+ references), tokens per run (the planned budget; a ramp run
    stops earlier when it diverges), total tokens and estimated GPU-hours at ``mfu`` of a
    ``peak_tflops`` (dense bf16 TFLOP/s) GPU. An ``lr_from`` group is planned as if the optimum were
    the middle of its source's LR grid."""
    rows = []
    for g in study.groups:
        lr_for = None
        if g.lr_from:
            grid = sorted(next(x.lrs for x in study.groups if x.name == g.lr_from))
            lr_for = stepped_lrs(study, g, {s: grid[len(grid) // 2] for s in g.schemes})
        refs, jobs = group_jobs(study, g, data_dir, out, lr_for)
        flops = tokens = 0.0
        per_run = []
        for j in refs + jobs:
            cfg = config_from_dict(j.config)
            t = cfg.train.steps * cfg.train.batch_size * cfg.train.seq_len * cfg.train.grad_accum
            per_run.append(t)
            tokens += t
            flops += t * flops_per_token(cfg.model, cfg.train.seq_len)
        rows.append({"group": g.name, "kind": g.kind, "runs": len(jobs), "references": len(refs),
                     "schemes": g.schemes, "sublayers": g.sublayers, "seeds": g.seeds,
                     "lrs": list(g.lrs) if g.kind == "train" and not g.lr_from else [], "lr_plan": lr_plan_words(g),
                     "tokens_per_run": sorted(set(per_run)), "tokens": tokens, "flops": flops,
                     "gpu_hours": flops / (mfu * peak_tflops * 1e12) / 3600})
    return rows


def lr_plan_words(g: Group) -> str:
    """A group's LRs in words: ``0.0003, 0.001``, ``from lr-grid at 64, grid steps [0, -1]`` (an
    ``lr_from`` group: known once its source has finished) or ``ramp 0 -> 0.05 over 1000 steps``."""
    if g.kind == "ramp":
        return f"ramp 0 -> {g.peak_lr:g} over {g.ramp_steps} steps"
    if g.lr_from:
        return f"from {g.lr_from} at {g.lr_from_sublayers}, grid steps {g.lr_from_steps}"
    return ", ".join(f"{x:g}" for x in g.lrs)


def _hours(h: float) -> str:
    """GPU-hours for the plan: one decimal, or two significant digits below 1 (a cpu-scale group
    read "0.0")."""
    return f"{h:,.1f}" if h >= 1 else f"{h:.2g}"


def plan_markdown(study: Study, rows: list[dict], mfu: float, peak_tflops: float) -> str:
    """The ``--dry-run`` table."""
    lines = [f"Study {study.name}, scale {study.scale}: {study.note}".strip(), "",
             "| group | runs | schemes | sub-layers | seeds | LRs | tokens per run | total tokens | est. GPU-hours |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        runs = f"{r['runs']}" + (f" + {r['references']} ref." if r["references"] else "")
        lines.append(f"| {r['group']} | {runs} | {', '.join(r['schemes'])} | {', '.join(map(str, r['sublayers']))} | "
                     f"{', '.join(map(str, r['seeds']))} | {r['lr_plan']} | "
                     f"{', '.join(f'{t:,.0f}' for t in r['tokens_per_run'])} | {r['tokens']:.3g} | "
                     f"{_hours(r['gpu_hours'])} |")
    tot = sum(r["gpu_hours"] for r in rows)
    lines += ["", f"Total: {sum(r['runs'] + r['references'] for r in rows)} runs, "
                  f"{sum(r['tokens'] for r in rows):.3g} tokens, about {_hours(tot)} GPU-hours "
                  f"(training FLOPs 6N + 12 n_layers d T per token, PaLM App. B, at {mfu:.0%} MFU of "
                  f"{peak_tflops:g} TFLOP/s dense bf16{', an H100 SXM' if peak_tflops == 989 else ''}; "
                  "evaluation not counted)."]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- report
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


def _lrs(d: dict) -> str:
    """``[s0 X, s1 Y]``: one LR per seed (``none`` for a missing one)."""
    return "[" + ", ".join(f"s{seed} " + ("none" if x is None else f"{x:g}") for seed, x in d.items()) + "]"


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
                f"{_lrs(r.get('best_lr', {}).get(b, {}))}; {_lrs(r.get('best_lr', {}).get(s, {}))} | "
                f"{_exits(r.get('plateau_exit', {}).get(b, {}))}; {_exits(r.get('plateau_exit', {}).get(s, {}))} | "
                f"{_flagged(r)} |" for r in c["rows"]]
        out += ["", f"The classifier reports a run's first failure: a {b} run flagged as a stagnation (100 steps on "
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
                    f"{'never' if r.get('plateau_exit_step') is None else r['plateau_exit_step']} | "
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
    return out + [""]


def _loss(x: float | None) -> str:
    return "–" if x is None else f"{x:.3f}"


def plateau_table(runs: list[dict]) -> list[str]:
    """Markdown: per group, scheme and depth, the plateau exit step of each seed's best run
    (lowest capped loss over its LRs) and how many of the finished runs never left the plateau."""
    out = ["## When each scheme leaves the unigram plateau", "",
           "Plateau exit: the first step whose 10-step trailing mean training loss is below 95% of the unigram "
           "entropy. Per seed, the run at that seed's best LR; pending: a run of that seed is unfinished, so its "
           "best LR is not known yet (the finished runs' exit steps are in the last table).", "",
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


def runs_table(runs: list[dict]) -> list[str]:
    """Markdown: every run with its tokens, losses, plateau exit step and divergence verdict."""
    out = ["## Every run", "", "| group | scheme | sub-layers | LR | seed | status | tokens | final val loss | "
           "plateau exit step | verdict |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        f = r.get("final_val_loss")
        out.append(f"| {r['group']} | {r['scheme']} | {r['sublayers']} | {r['lr']:g} | {r['seed']} | {r['status']} | "
                   f"{r.get('tokens') or 0:,} | {'–' if f is None else f'{f:.4f}'} | "
                   f"{r.get('plateau_exit_step') if r.get('plateau_exit_step') is not None else '–'} | "
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


def claim_reads(claim: dict) -> set[tuple[str, str]]:
    """The ``(group, scheme)`` pairs whose runs a claim's verdict reads (an lr_transfer claim:
    its ``scheme`` only; the other schemes of its table are for comparison)."""
    groups = list(claim.get("groups", [])) + [claim[k] for k in ("group", "reference_group", "extended_group")
                                              if k in claim]
    schemes = [claim.get("scheme", "keel")] if claim["test"] == "lr_transfer" else \
        [claim[k] for k in ("scheme", "baseline") if k in claim] + list(claim.get("order", []))
    return {(g, s) for g in groups for s in schemes}


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


def report_markdown(study: Study, claims: list[tuple[dict, dict]], runs: list[dict], command: str,
                    waiting: Sequence[str] = ()) -> str:
    """``report.md``: the verdict table, one section per claim, every run."""
    done = [r for r in runs if r["status"] == "done"]
    lines = [f"# Study `{study.name}`, scale `{study.scale}`", "", study.note, "",
             f"Runs finished: {len(done)} of {len(runs)} planned so far{tokens_words(study, done)}."
             + unfinished_words(study, runs)
             + (" The ramp groups' reference runs (the scale's `--dry-run` counts them) are not counted."
                if any(g.kind == "ramp" for g in study.groups) else "")
             + (f" Not planned yet: {'; '.join(waiting)}." if waiting else ""),
             f"Command: `{command}`", "", "## Verdicts", "", verdict_rule(study, [cl for cl, _ in claims]), "",
             "| claim | verdict | numbers: mean ± sd [per seed] | unit |", "|---|---|---|---|"]
    lines += [f"| ({cl['id']}) {cl['title']} | **{c['verdict']}** | {claim_numbers(c)} | {CLAIM_UNITS[cl['test']]} |"
              for cl, c in claims]
    lines.append("")
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


# ----------------------------------------------------------------------------- driver
def run_study(name: str, scale: str, out: str | Path, sets: Sequence[str] = (), *, workers: int = 1,
              threads: int | None = None, resume: bool = False, report_only: bool = False, dry_run: bool = False,
              mfu: float = 0.35, peak_tflops: float = 989.0, command: str = "",
              groups: Sequence[str] = ()) -> dict:
    """Run (or continue, or only report, or only plan) study ``name`` at ``scale``.

    Args:
        name: a packaged study (``keel/configs/studies/NAME.toml``) or a TOML path.
        scale: a scale of the study (``tiny``, ``cpu``, ``gpu-1``, ``paper``).
        out: output folder (run folders, ``report.md``, ``report.json``, PNGs).
        sets: ``section.key=value`` applied to every run after the scale's keys.
        workers, threads: as :func:`keel.experiments.grid.run_grid`.
        resume: continue a non-empty ``out``; report_only: train nothing, report the finished runs.
        dry_run: prepare nothing and train nothing; return the plan (runs, tokens, estimated
            GPU-hours at ``mfu`` of ``peak_tflops`` dense bf16 TFLOP/s) as ``{"plan": rows, "markdown": ...}``.
        command: the command line; the report shows the one that started ``out`` (``study.json``).
        groups: train only these groups (still in the study's order; empty: all). The report
            covers every group's finished runs. An ``lr_from`` group still waits for its source.
    Returns:
        The ``report.json`` content: ``study``, ``scale``, ``claims`` (per claim its verdict and
        numbers), ``baseline_margins`` (:func:`baseline_margins` of each group, with ``group``),
        ``runs`` (every planned run's record, :func:`run_record`), ``plots``.
    Raises:
        KeelError: bad study or scale (:func:`load_study`), bad config, ``out`` not usable
            (:func:`_claim_out`: a file, another study's folder, non-empty without ``resume``);
            ``groups`` names a group the scale does not have.
    """
    study = load_study(name, scale, sets)
    unknown = [g for g in groups if g not in {x.name for x in study.groups}]
    if unknown:
        raise KeelError(f"study {study.name!r} at scale {scale!r} has no group(s) {', '.join(unknown)} "
                        f"(groups: {', '.join(x.name for x in study.groups)})")
    out = Path(out)
    if dry_run:
        rows = [r for r in plan_rows(study, "<data>", out, mfu, peak_tflops) if not groups or r["group"] in groups]
        return {"plan": rows, "markdown": plan_markdown(study, rows, mfu, peak_tflops)}
    check_pool(workers, threads)
    base = load_config(resolve_config_path(study.base), study.all_sets())  # a bad --set: refused before out is claimed
    first_command = _claim_out(out, study, command, resume=resume, report_only=report_only)
    # --report-only reads what the runs recorded: no dataset is prepared (or downloaded) for it
    data_dir = "<data>" if report_only else str(resolve_data(base, progress=False))
    train = False if report_only else (list(groups) or True)
    try:
        runs, waiting = collect(study, data_dir, out, train=train, workers=workers, threads=threads)
    except Interrupted as e:  # the grid's own hint names a group's folder and a run: continue the study instead
        raise Interrupted(f"stopped by {signal.Signals(e.signum).name}; continue: the same keel study command "
                          f"with --resume (out {out})", e.signum) from None
    claims = [(cl, CLAIM_TESTS[cl["test"]](study, runs, cl)) for cl in study.claims]
    h1 = next((r["result"]["unigram_entropy"] for r in runs if r["result"].get("unigram_entropy")), None) \
        if report_only else dataset_unigram_entropy(data_dir)
    make_dirs(out)
    plots = write_plots(study, runs, claims, out, h1)
    report = {"study": study.name, "scale": study.scale, "note": study.note, "command": first_command,
              "sets": [override_text(x) for x in study.all_sets()],
              "unigram_entropy": h1, "min_effect": study.min_effect, "min_seeds": study.min_seeds,
              "claims": [{"id": cl["id"], "title": cl["title"], **c} for cl, c in claims],
              "baseline_margins": [{"group": g.name, **r} for g in study.groups for r in baseline_margins(study, g, runs)],
              "runs": [{k: v for k, v in r.items() if k != "result"} for r in runs], "plots": plots}
    atomic_write_text(out / "report.json", json.dumps(report, indent=1, default=str))
    report["waiting"] = waiting
    atomic_write_text(out / "report.md", report_markdown(study, claims, runs, first_command, waiting))
    return report


def _claim_out(out: Path, study: Study, command: str, *, resume: bool, report_only: bool) -> str:
    """Check ``out`` for this invocation and mark it as this study's (``study.json``: study,
    scale, the command that started it); return that first command.

    Raises:
        KeelError: ``out`` is a file; not empty without ``resume`` / ``report_only`` (a folder
            holding only this study's ``study.json``, stopped before its first run, counts as
            empty); holds another study or scale; ``report_only`` on a folder that holds no study.
    """
    marker = out / "study.json"
    if out.exists() and not out.is_dir():
        raise KeelError(f"--out {out} exists and is not a folder")
    held = json.loads(marker.read_text()) if marker.is_file() else None
    if report_only and held is None:
        raise KeelError(f"{out} holds no study (no study.json): nothing to report; check --out")
    if held is not None and (held.get("study"), held.get("scale")) != (study.name, study.scale):
        raise KeelError(f"{out} holds study {held.get('study')!r} at scale {held.get('scale')!r}, "
                        f"not {study.name!r} at {study.scale!r}; use another --out")
    fresh = held is not None and [p.name for p in out.iterdir()] == [marker.name]  # stopped before any run began
    if not (resume or report_only or fresh) and out.is_dir() and any(out.iterdir()):
        raise KeelError(f"output folder {out} is not empty; use --resume to continue it, or another --out")
    if resume and held is None and out.is_dir() and any(out.iterdir()):
        raise KeelError(f"{out} holds no study (no study.json) but is not empty: nothing to resume; "
                        "check --out (a study's folder, not one of its groups)")
    if held is None or fresh:
        make_dirs(out)
        held = {"study": study.name, "scale": study.scale, "command": command}
        atomic_write_text(marker, json.dumps(held, indent=1))
    return held.get("command", command)
