"""Claim kind ``deep_vs_wide``: a scheme at a deep shape beats a baseline at the deep shape and at a
wide shape of equal parameters (Keel paper Table 5)."""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field
from typing import ClassVar

from keel.errors import KeelError
from keel.experiments.analysis import Record, Runs, best_runs, bracketed, pair, paired_verdict
from keel.experiments.study.cells import lrs
from keel.experiments.study.claims.base import Paired, condition_tables, edge
from keel.experiments.study.spec import Group, Study
from keel.experiments.study.verdicts import (ClaimVerdict, Condition, judged, non_embedding_params,
                                             one_depth, settled, unfinished)
from keel.keys import key


@dataclass
class ShapeCell(Record):
    """One scheme at one shape of a ``deep_vs_wide`` condition, per seed: ``loss``, its best capped final
    validation loss (nats/token); ``lr``, the peak LR of that run; ``bracketed``, whether that LR lies
    inside the LRs the seed trained."""

    loss: dict[int, float]
    lr: dict[int, float]
    bracketed: dict[int, bool]


@dataclass
class ShapeCondition(Condition):
    """One condition of a ``deep_vs_wide`` verdict: :class:`~keel.experiments.study.verdicts.Condition`'s
    ``verdict`` and ``parts`` (the margins ``best(baseline, shape) - best(scheme, deep)``, nats/token,
    Student-t one-sided bounds), and ``groups``: its deep and wide group; ``params``: non-embedding
    parameters per ``"scheme shape"``; ``cells``: per ``"scheme shape"`` the best loss per seed
    (:class:`ShapeCell`)."""

    groups: list[str] = field(default_factory=list)
    params: dict[str, int] = field(default_factory=dict)
    cells: dict[str, ShapeCell] = field(default_factory=dict)


@dataclass(kw_only=True)
class DeepVsWide(Paired):
    """The keys of a ``deep_vs_wide`` claim (a train group per shape and init, each of one depth), its
    verdict and tables."""

    kind: ClassVar[str] = "deep_vs_wide"
    unit: ClassVar[str] = "nats/token"

    deep: str = key(MISSING, "the train group of the deep shape, paper's init.", nonempty=True)
    wide: str = key(MISSING, "the train group of the wide shape (same parameters), paper's init.", nonempty=True)
    init_deep: str = key("", "the deep shape at the other embedding init.")
    init_wide: str = key("", "the wide shape at the other embedding init.")

    def verdict(self, study: Study, runs: Runs) -> ClaimVerdict:
        """{scheme} at the deep shape beats {baseline} at the deep shape and {baseline} at the wide
        shape of equal parameters (both parts must hold), at the paper's init and with both schemes
        at N(0, 1) embeddings.

        Per seed ``m = best(baseline, shape) - best(scheme, deep)`` (nats/token, each at its seed's
        best LR over its group's LRs), :func:`paired_verdict` per part; groups ``deep``/``wide`` (and
        ``init_deep``/``init_wide``), each at the one depth it trains. Keel paper Table 5:
        at ~3B parameters Keel deep 55.5, Pre-LN deep 52.3, Pre-LN wide 52.2 (benchmark average)."""
        s, b = self.scheme, self.baseline
        conds = {}
        for k, (deep, wide) in {"paper_init": (self.deep, self.wide),
                                **({"embed_init": (self.init_deep, self.init_wide)}
                                   if self.init_deep else {})}.items():
            Ld, Lw = one_depth(study, deep), one_depth(study, wide)
            cells = {(x, shape): best_runs(runs, [g], x, L) for x in (s, b)
                     for shape, g, L in (("deep", deep, Ld), ("wide", wide, Lw))}
            loss = {c: {sd: r.capped_loss for sd, r in v.items()} for c, v in cells.items()}
            parts = {f"{b} deep ({Ld}) − {s} deep": pair(loss[(b, "deep")], loss[(s, "deep")]),
                     f"{b} wide ({Lw}) − {s} deep": pair(loss[(b, "wide")], loss[(s, "deep")])}
            parts = {n: paired_verdict(m, study.min_effect, study.min_seeds) for n, m in parts.items()}
            conds[k] = ShapeCondition(
                verdict=settled(parts, unfinished(runs, [deep, wide], (s, b)), study.min_seeds),
                parts=parts, groups=[deep, wide],
                params={f"{x} {shape}": non_embedding_params(study, g, x, L) for x in (s, b)
                        for shape, g, L in (("deep", deep, Ld), ("wide", wide, Lw))},
                cells={f"{x} {shape}": ShapeCell(loss=loss[(x, shape)],
                                                 lr={sd: r.lr for sd, r in cells[(x, shape)].items()},
                                                 bracketed={sd: bracketed(runs, r) for sd, r in cells[(x, shape)].items()})
                       for x, shape in cells})
        return judged(conds)

    def groups_read(self) -> list[str]:
        return [g for g in self.shapes().values() if g]

    def shapes(self) -> dict[str, str]:
        """``{key: group}`` of the shape groups it names ("" for an init shape it does not)."""
        return {"deep": self.deep, "wide": self.wide, "init_deep": self.init_deep, "init_wide": self.init_wide}

    def check(self, groups: dict[str, Group]) -> None:
        if bool(self.init_deep) != bool(self.init_wide):
            raise KeelError(f"study claim {self.id!r}: init_deep and init_wide come together")
        for k, name in self.shapes().items():
            g = groups.get(name)
            if g is not None and len(g.sublayers) != 1:
                raise KeelError(f"study claim {self.id!r}: group {g.name!r} ({k}) must train one depth, "
                                f"got {g.sublayers}")

    def tables(self, c: ClaimVerdict) -> list[str]:
        return condition_tables(
            c, ["model", "non-embedding parameters", "best loss per seed (nats)", "best LR per seed"],
            lambda cc: [[name, f"{cc.params[name]:,}", "[" + ", ".join(f"s{sd} {x:.3f}" for sd, x in v.loss.items())
                         + "]", lrs(v.lr, edge(v.bracketed))] for name, v in cc.cells.items()])



