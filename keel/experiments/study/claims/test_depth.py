"""Claim kind ``test_depth``: more loops at test time do not hurt a looped scheme (non-inferiority)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import ClassVar

from keel.config import load_config, resolve_config_path
from keel.errors import KeelError
from keel.experiments.analysis import (INCONCLUSIVE, NOT_REPRODUCED, REPRODUCED, PairedVerdict, Record, Runs, best_runs,
                                       pair, paired_verdict)
from keel.experiments.record import RunRecord
from keel.experiments.study.cells import pm
from keel.experiments.study.claims.base import condition_tables
from keel.experiments.study.claims.loop_max_lr import LoopMaxLr
from keel.experiments.study.spec import Group, Study
from keel.experiments.study.verdicts import (ClaimVerdict, Condition, combine, condition_groups, judged, pending,
                                             unfinished, waits)
from keel.keys import key


@dataclass
class TestDepthRow(Record):
    """One depth of a ``test_depth`` condition: ``sublayers`` (effective depth, sub-layers), ``loops``
    (the trained loop count R), ``d``: per scheme ``{R': PairedVerdict}`` of ``loss(R') - loss(R)`` per
    seed (nats/token; Student-t one-sided bounds), and ``vs``: ``{R': PairedVerdict}`` of
    ``d(scheme) - d(baseline)`` paired per seed."""

    __test__: ClassVar[bool] = False  # a row, not a pytest test class
    sublayers: int
    loops: int
    d: dict[str, dict[int, PairedVerdict]]
    vs: dict[int, PairedVerdict]


@dataclass
class TestDepthVerdict(ClaimVerdict):
    """A ``test_depth`` verdict: :class:`~keel.experiments.study.verdicts.ClaimVerdict`'s ``verdict`` and
    ``conditions``, and ``loop_sampling``: ``{group: model.loop_sampling}`` of the groups read, as the study
    trains their runs (:func:`loop_sampling`: the scale's keys, the group's ``set``, the user's ``--set``)."""

    __test__: ClassVar[bool] = False  # a verdict, not a pytest test class
    loop_sampling: dict[str, str] = field(default_factory=dict)


# How each model.loop_sampling draws the core's applications per training step (keel.model.loop_count), and
# what that makes of a count other than R at test time.
SAMPLING_WORDS = {
    "fixed": "R at every step, so a count other than R at test time is one these runs never trained at",
    "uniform": "uniform on 1 .. 2R − 1, of mean R, so the runs trained at counts around R",
    "poisson_lognormal": "1 + Poisson(e^τ) of mean R (Geiping et al. 2025, Sec. 3.3), so the runs trained at "
                         "counts around R",
}


def loop_sampling(study: Study, groups: list[str]) -> dict[str, str]:
    """``{group: model.loop_sampling}`` of each of ``groups`` (looped groups of ``study``), in the study's order:
    the value its runs train with, from the study's base config, the scale's keys, the group's own ``set`` and the
    user's ``--set`` (:meth:`keel.experiments.study.spec.Study.all_sets`), with its loop keys."""
    out = {}
    for g in study.groups:
        if g.name in groups:
            sets = study.all_sets(g) + g.loop_sets(g.sublayers[0])  # the base config alone has no loop
            out[g.name] = load_config(resolve_config_path(study.base), sets).model.loop_sampling
    return out


def sampling_words(sampling: dict[str, str]) -> str:
    """The report's sentence on how the runs read drew their loop count per training step (``sampling``:
    :func:`loop_sampling`): one value for every group, or each group's."""
    values = list(dict.fromkeys(sampling.values()))
    if len(values) == 1:
        return f"The runs read trained with model.loop_sampling = {values[0]}: {SAMPLING_WORDS[values[0]]}."
    return ("The runs read trained with model.loop_sampling = " + "; ".join(
        f"{v} in {g} ({SAMPLING_WORDS[v]})" for g, v in sampling.items()) + ".")


@dataclass(kw_only=True)
class TestDepth(LoopMaxLr):
    """The keys of a ``test_depth`` claim: a ``loop_max_lr`` claim's (``groups``: looped groups that also
    test loop counts, ``test_loops``) and the ``factor`` judged; its verdict and tables."""

    kind: ClassVar[str] = "test_depth"
    unit: ClassVar[str] = "nats/token"
    needs_test_loops: ClassVar[bool] = True
    __test__: ClassVar[bool] = False  # a claim kind, not a pytest test class

    factor: float = key(2.0, "the test-loop factor judged: R' = round(factor R), one of the groups' test_loops.", gt=0)

    def verdict(self, study: Study, runs: Runs) -> TestDepthVerdict:
        """More loops at test time do not hurt {scheme} (reported beside {baseline}): at every effective depth,
        its validation loss with the core applied 2R times is not worse than at the trained R by the floor or
        more (every depth must hold), at the paper's init and with both schemes at N(0, 1) embeddings.

        Per depth and seed, the run at that seed's best LR (:func:`best_runs`; groups with ``test_loops``) and
        ``d = loss(R') − loss(R)`` (nats/token; R' = round(f R) on the windows of its final validation loss, a
        non-finite loss counted as the step-0 loss). Per depth the part is :func:`paired_verdict` of d at
        R' = 2R (the claim's ``factor``) with the study's floor f, read as non-inferiority: reproduced when its
        upper bound hi < f, not reproduced when its lower bound lo >= f (more loops cost at least f),
        inconclusive otherwise. Reported, not judged: d at every R' the groups test (R/2 too) for {scheme}
        and {baseline}, d({scheme}) − d({baseline}) paired per seed, and the loop sampling the runs read
        trained with (``loop_sampling``)."""
        v = judged({k: _test_depth_condition(study, runs, self, gs)
                    for k, gs in condition_groups(self.groups, self.init_groups).items()})
        return TestDepthVerdict(verdict=v.verdict, conditions=v.conditions,
                                loop_sampling=loop_sampling(study, self.groups_read()),
                                stored=("verdict", "conditions", "loop_sampling"))

    def check(self, groups: dict[str, Group]) -> None:
        """:meth:`LoopMaxLr.check`, and ``factor`` one of the groups' ``test_loops``."""
        super().check(groups)
        gs = [groups[g] for g in self.groups_read() if g in groups]
        if gs and self.factor not in gs[0].test_loops:
            raise KeelError(f"study claim {self.id!r}: factor {self.factor:g} is not one of the "
                            f"groups' test_loops {gs[0].test_loops}")

    def tables(self, c: TestDepthVerdict) -> list[str]:
        s, b = self.scheme, self.baseline
        return condition_tables(
            c, ["sub-layers", "R", "R'", f"loss(R') − loss(R), {s}: mean [CI] (per seed)", b,
                f"{s} − {b} in that difference"],
            lambda cc: [[r.sublayers, r.loops, n, pm(r.d[s][n]), pm(r.d[b][n]), pm(r.vs[n])]
                        for r in cc.rows or [] for n in r.d[s]]) + [
            "Each seed's run at its best LR, evaluated with its core applied R' times on the validation "
            "windows of its final loss (nats/token); > 0: the loss rises at R'. " + sampling_words(c.loop_sampling)]


def loop_losses(rec: RunRecord, repeats: int) -> dict[int, float]:
    """``{R': validation loss}`` of a looped run (nats/token): its ``test_loops`` and, at its trained
    ``repeats`` R, its capped final loss; a non-finite loss counts as the step-0 loss (as ``capped_loss``)."""
    out = {int(n): x if x is not None else rec.first_val_loss for n, x in (rec.test_loops or {}).items()}
    return {**out, repeats: rec.capped_loss}


NON_INFERIOR = {REPRODUCED: NOT_REPRODUCED, NOT_REPRODUCED: REPRODUCED}  # a paired verdict read the other way


def _test_depth_condition(study: Study, runs: Runs, claim: TestDepth, groups: list[str]) -> Condition:
    """One condition of :meth:`TestDepth.verdict`: per depth, d per R' of both schemes at each seed's best LR."""
    s, b, f = claim.scheme, claim.baseline, claim.factor
    gs = [g for g in study.groups if g.name in groups]
    parts, rows = {}, []
    for L in sorted({L for g in gs for L in g.sublayers}):
        R, counts = gs[0].loop_repeats(L), gs[0].test_counts(L)
        loss = {x: {sd: loop_losses(r, R) for sd, r in best_runs(runs, groups, x, L).items()} for x in (s, b)}
        d = {x: {n: {sd: v[n] - v[R] for sd, v in loss[x].items() if n in v} for n in counts} for x in (s, b)}
        rows.append(TestDepthRow(
            sublayers=L, loops=R,
            d={x: {n: paired_verdict(v, study.min_effect, study.min_seeds) for n, v in d[x].items()} for x in (s, b)},
            vs={n: paired_verdict(pair(d[s][n], d[b][n]), study.min_effect, study.min_seeds) for n in counts}))
        v = rows[-1].d[s].get(round(f * R))
        if v is not None:
            parts[f"loss({round(f * R)}) − loss({R}), {s} at {L}"] = replace(
                v, verdict=NON_INFERIOR.get(v.verdict, INCONCLUSIVE))
    if waits(parts, unfinished(runs, groups, (s, b)), study.min_seeds):
        return pending("runs with test loops pending", parts=parts, rows=rows)
    return Condition(verdict=combine([p.verdict for p in parts.values()]), parts=parts, rows=rows)
