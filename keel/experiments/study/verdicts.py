"""What the verdicts of several kinds of claim share: the typed verdict records (:class:`Condition`,
a claim's verdict under one condition; :class:`ClaimVerdict`, a claim's), :func:`combine` (a verdict
of parts), the conditions of a claim (:data:`CONDITIONS`, :func:`condition_groups`, :func:`judged`,
:func:`pending`, the waiting rule :func:`settled`), the max-LR noise floor, a bench group's
margins over its baselines, a run's divergence verdict in words, a group's one depth and its models' parameter counts. The
statistics (paired per-seed differences, :func:`keel.experiments.analysis.paired_verdict`) live
in :mod:`keel.experiments.analysis`; each kind's own arithmetic lives in its module of
:mod:`keel.experiments.study.claims`."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from keel.config import load_config, resolve_config_path
from keel.experiments.analysis import (INCONCLUSIVE, LEVEL, NOT_REPRODUCED, REPRODUCED, PairedVerdict,  # noqa: F401
                                       Record, Runs, best_losses, best_lrs, best_run, best_runs, bracketed, cell,
                                       loss_floor, lr_window, opt_lrs, optional, pair, paired_verdict,
                                       seed_mean_optimum, stored_keys, t_bounds, trend_verdict)
from keel.experiments.record import RunRecord
from keel.experiments.study.spec import Group, Study
from keel.model import count_parameters

MAX_LR_FLOOR = math.log10(1.05)  # noise floor of a max-LR pair (log10 of the ratio): a 5% difference


@dataclass
class Condition(Record):
    """A claim's verdict under one condition (``report.json``'s ``conditions``: an embedding init,
    :data:`CONDITIONS`; a ramp of ``max_lr_order``), typed; its fields are also those of a claim
    judged without conditions (:class:`ClaimVerdict`).

    ``verdict``: reproduced, not reproduced or inconclusive (:func:`combine` of the parts, or the
    kind's own rule). ``parts``: ``{name: PairedVerdict}``, the comparisons it combines, each
    judged by its one-sided Student-t bounds (:func:`keel.experiments.analysis.paired_verdict`;
    the unit in the part's name: nats/token, nats/token per doubling of depth in sub-layers or of
    tokens, log10 of a max-LR ratio, a share of sub-layers). ``rows``: the kind's table rows
    (one per depth in sub-layers, token budget, ramp ...). ``why``: why it is inconclusive before
    all its parts are in. ``parts``, ``rows`` and ``why`` are keys ``report.json`` holds only where
    the kind gives them (left out while None); ``stored``: the keys in the order the kind writes
    them where that is not the declared one (a pending verdict's ``why`` comes second:
    :meth:`pending`), so that a report written again is the same bytes.
    """

    verdict: str
    parts: dict[str, PairedVerdict] | None = optional()
    rows: list | None = optional()
    why: str | None = optional()
    stored: tuple[str, ...] = stored_keys()

    @classmethod
    def pending(cls, why: str, **rest):
        """An inconclusive verdict saying ``why``, with no parts unless ``rest`` gives them, and the
        fields ``rest``: keys ``verdict``, ``why``, ``parts``, then the others of ``rest`` in order."""
        parts = rest.pop("parts", {})
        return cls(verdict=INCONCLUSIVE, why=why, parts=parts, **rest, stored=("verdict", "why", "parts", *rest))


@dataclass
class ClaimVerdict(Condition):
    """A claim's verdict over the study's run records (:meth:`keel.experiments.study.claims.Claim.verdict`),
    typed: ``report.json``'s entry of ``claims`` after its ``id`` and ``title``.

    ``verdict``: the claim's (reproduced only where every condition is: :func:`judged`; a kind
    may read one condition, e.g. ``max_lr_order`` the paper's ramp). ``conditions``:
    ``{condition: Condition}`` (:data:`CONDITIONS`); a claim judged without conditions has its
    ``parts``, ``rows`` and ``why`` itself (:class:`Condition`'s fields). ``summary``: the claim's
    one line in the report (:func:`keel.experiments.study.report.claim_summary`), set when the
    study is judged (:func:`keel.experiments.study.judge.judge`), written last. A kind with more
    to say subclasses it (``MarginVerdict``, ``TransferVerdict``).
    """

    conditions: dict[str, Condition] | None = optional()
    summary: str | None = optional()


def combine(verdicts: Sequence[str]) -> str:
    """All parts reproduced -> reproduced; any part not reproduced -> not reproduced; else inconclusive."""
    if verdicts and all(v == REPRODUCED for v in verdicts):
        return REPRODUCED
    return NOT_REPRODUCED if NOT_REPRODUCED in verdicts else INCONCLUSIVE


@dataclass
class BaselineMargin(Record):
    """One depth and scheme of a bench group against one baseline (:func:`baseline_margins`; a
    ``bench`` claim's rows, ``report.json``'s ``baseline_margins`` after its ``group``):
    ``sublayers`` (depth, sub-layers), ``scheme`` (the group's), ``baseline`` (trained by its
    ``baselines_from`` group) and ``margin``: the paired per-seed ``loss(baseline) - loss(scheme)``
    (nats/token, each side at its seed's best LR; > 0: the scheme is better) as a
    :class:`PairedVerdict` (Student-t one-sided bounds against the study's floor)."""

    sublayers: int
    scheme: str
    baseline: str
    margin: PairedVerdict


def baseline_margins(study: Study, g: Group, runs: Runs) -> list[BaselineMargin]:
    """Per depth of group ``g``, scheme of ``g`` and baseline scheme (``g.baselines``, trained by
    group ``g.baselines_from``), the paired per-seed margin ``loss(baseline) - loss(scheme)``
    (nats/token; > 0: ``g``'s scheme is better), each side at its seed's best LR over every LR its
    own group trained (:func:`best_losses`: ``g``'s grid and the LRs it added to bracket an optimum
    at an edge; ``g.baselines_from``'s bracketed grid; both groups train the same tokens per run), as a
    :class:`PairedVerdict` (:func:`paired_verdict`): one :class:`BaselineMargin` each; empty when ``g``
    names no baselines. (Read over ``g``'s planned grid alone, the widened LRs were trained and never
    read, and a design whose best lay on the grid's edge was judged there.)"""
    if not g.baselines_from:
        return []
    return [BaselineMargin(sublayers=L, scheme=s, baseline=b,
                           margin=paired_verdict(pair(best_losses(runs, [g.baselines_from], b, L),
                                                      best_losses(runs, [g.name], s, L)),
                                                 study.min_effect, study.min_seeds))
            for L in g.sublayers for s in g.schemes for b in g.baselines]


CONDITIONS = {"paper_init": "at the paper's init", "embed_init": "at N(0, 1) embeddings"}


def condition_groups(paper: Sequence[str], init: Sequence[str]) -> dict[str, list[str]]:
    """``{condition: groups}``: a claim's ``paper`` groups at the paper's init and, when it names
    them, its ``init`` groups (both schemes at the other embedding init: :data:`CONDITIONS`)."""
    conds = {"paper_init": list(paper)}
    if init:
        conds["embed_init"] = list(init)
    return conds


def judged(conds: dict[str, Condition]) -> ClaimVerdict:
    """A claim's verdict over its conditions: reproduced only where every condition is."""
    return ClaimVerdict(verdict=combine([c.verdict for c in conds.values()]), conditions=conds)


def unfinished(runs: Runs, groups: Sequence[str], schemes: Sequence[str], sublayers: Sequence[int] | None = None) -> int:
    """The number of run records of ``schemes`` in ``groups`` (at ``sublayers``, default every
    depth) whose status is not ``done``: planned, running or stopped runs a verdict still waits for."""
    return sum(r.group in groups and r.scheme in schemes and r.status != "done"
               and (sublayers is None or r.sublayers in sublayers) for r in runs)


def settled(parts: dict[str, PairedVerdict], waiting: int, min_seeds: int) -> str:
    """The verdict of one condition of a claim over its parts (:func:`combine`), given only once it
    cannot move: no run the condition reads is unfinished (``waiting``: :func:`unfinished`) and
    every part has at least ``min_seeds`` paired seeds. Inconclusive before, even where a finished
    part is already not reproduced (a run still training, or an LR the study adds to bracket an
    optimum, can change the part's best loss). The one waiting rule of every kind of claim."""
    return INCONCLUSIVE if waits(parts, waiting, min_seeds) else combine([p.verdict for p in parts.values()])


def waits(parts: dict[str, PairedVerdict], waiting: int, min_seeds: int) -> bool:
    """Whether a condition with ``parts`` still waits (:func:`settled` gives it no verdict yet):
    ``waiting`` unfinished runs, no part, or a part with fewer than ``min_seeds`` paired seeds."""
    return bool(waiting) or not parts or any(p.n < min_seeds for p in parts.values())


def pending(why: str, **rest) -> Condition:
    """An inconclusive condition (no parts yet) saying ``why``, with the fields ``rest``
    (:meth:`Condition.pending`)."""
    return Condition.pending(why, **rest)


def left_plateau_later(rec: RunRecord) -> bool:
    """Whether the divergence classifier flagged ``rec`` as a stagnation and the run then left
    the unigram plateau (its :func:`plateau_exit_step` is after the flagged step): a first
    failure the run recovered from, e.g. Pre-LN at 256 sub-layers, flagged at step 221, below
    the plateau from step 617."""
    d = rec.divergence or {}
    left = rec.plateau_exit_step
    return d.get("mode") == "stagnation" and left is not None and left > d.get("step", math.inf)


def verdict_words(rec: RunRecord) -> str:
    """A run's divergence verdict, e.g. "instability from step 875 (LR 0.0437)", "healthy",
    "instability from step 994 (LR 0.0497), a spike still open when the curve ended" (the
    classifier's end-of-curve rule: a weaker verdict than a spike that did not recover within its
    recovery window), or "stagnation from step 221 (LR 0.000905), left the plateau at step 617":
    the classifier reports a run's first failure (here 100 steps on the unigram plateau), and
    :func:`plateau_exit_step` says when the run got below it afterwards."""
    d = rec.divergence or {}
    if not d or d.get("mode") == "healthy":
        return rec.verdict or "no verdict"
    lr = d.get("evidence", {}).get("lr_at_step")
    words = f"{d['mode']} from step {d['step']}" + (f" (LR {lr:.3g})" if lr is not None else "")
    if left_plateau_later(rec):
        words += f", left the plateau at step {rec.plateau_exit_step}"
    return words + (", a spike still open when the curve ended" if d.get("evidence", {}).get("open_at_end") else "")


def non_embedding_params(study: Study, group: str, scheme: str, sublayers: int) -> int:
    """Non-embedding parameters (:func:`keel.model.count_parameters`) of ``scheme`` at
    ``sublayers`` with group ``group``'s config (the scale's keys, its own ``set``)."""
    g = next(x for x in study.groups if x.name == group)
    cfg = load_config(resolve_config_path(study.base),
                      study.all_sets(g) + [("model.residual", scheme), ("model.n_layers", sublayers // 2)])
    return count_parameters(cfg.model, non_embedding=True)


def one_depth(study: Study, group: str) -> int:
    """The one depth (sub-layers) group ``group`` trains (claims (e) and (f) read one per group)."""
    return next(g.sublayers[0] for g in study.groups if g.name == group)
