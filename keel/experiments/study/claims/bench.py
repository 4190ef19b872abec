"""Claim kind ``bench``: each residual design of a bench group beats a baseline (each design's own paper)."""

from __future__ import annotations

from dataclasses import MISSING, dataclass
from typing import ClassVar

from keel.errors import KeelError
from keel.experiments.analysis import Runs
from keel.experiments.study.cells import direction, pm
from keel.experiments.study.claims.base import OneGroup, condition_tables
from keel.experiments.study.spec import Group, Study
from keel.experiments.study.verdicts import (ClaimVerdict, Condition, baseline_margins, judged, settled,
                                             unfinished, waits)
from keel.keys import key


@dataclass(kw_only=True)
class Bench(OneGroup):
    """The keys of a ``bench`` claim (``group``: the bench group, ``baselines_from`` a train group, at
    the paper's init), its verdict and tables."""

    kind: ClassVar[str] = "bench"
    unit: ClassVar[str] = "nats/token"

    init_group: str = key("", "the bench at the other embedding init.")
    designs: list[str] = key(MISSING, "the residual designs judged (schemes the bench group trains).", nonempty=True,
                             unique=True, note="scheme names")
    baseline: str = key("pre_ln", "the scheme every design should beat.", nonempty=True)

    def verdict(self, study: Study, runs: Runs) -> ClaimVerdict:
        """Each residual design of the bench beats {baseline} at the bench's depth (every part must
        hold), at the paper's init and with every scheme at N(0, 1) embeddings; each is also
        compared with Keel (reported, not part of the verdict).

        Per design X and seed ``m = best(baseline) - best(X)`` (nats/token, each at its seed's best
        LR over every LR its own group trained, widened until bracketed; the baseline trained by the
        ``baselines_from`` group at the same seeds and tokens: :func:`baseline_margins`),
        :func:`paired_verdict` with the study's loss floor. The claim of each design's own paper
        (Peri-LN, Hyper-Connections, mHC, AttnRes: better than Pre-LN), not of the Keel paper."""
        conds = {}
        for k, gname in {"paper_init": self.group, **({"embed_init": self.init_group} if self.init_group
                                                       else {})}.items():
            g = next(x for x in study.groups if x.name == gname)
            rows = baseline_margins(study, g, runs)
            rows = [r for r in rows if r.scheme in self.designs]
            parts = {f"{r.baseline} − {r.scheme} at {r.sublayers}": r.margin for r in rows if r.baseline == self.baseline}
            waiting = unfinished(runs, [g.name, g.baselines_from], [*self.designs, self.baseline], g.sublayers)
            conds[k] = Condition(verdict=settled(parts, waiting, study.min_seeds), parts=parts, rows=rows,
                                 why="bench runs pending" if waits(parts, waiting, study.min_seeds) else None)
        return judged(conds)

    def groups_read(self) -> list[str]:
        return [self.group] + ([self.init_group] if self.init_group else [])

    def schemes_read(self) -> list[str]:
        return list(self.designs)  # the baseline is trained by the bench's baselines_from group

    def check(self, groups: dict[str, Group]) -> None:
        for name in self.groups_read():
            g = groups.get(name)
            if g is not None and self.baseline not in g.baselines:
                raise KeelError(f"study claim {self.id!r}: group {name!r} names no baseline "
                                f"{self.baseline!r} (baselines)")

    def tables(self, c: ClaimVerdict) -> list[str]:
        return condition_tables(
            c, ["sub-layers", "design", "against", "margin (against − design, nats) mean [CI] (per seed)", "in words"],
            lambda cc: [[r.sublayers, r.scheme, r.baseline, pm(r.margin), direction(r.margin, r.scheme, r.baseline)]
                        for r in cc.rows or []])



