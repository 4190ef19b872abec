"""The base of every kind of claim: :class:`Claim` (the keys every ``[[claims]]`` entry has, and
what a kind provides), the registry :data:`CLAIMS` it fills as each kind's class is defined, the
key sets several kinds share (:class:`Paired`, :class:`OneGroup`, :class:`InitGroups`: one
declaration per key) and the table helpers the kinds' sections share."""

from __future__ import annotations

from dataclasses import MISSING, dataclass
from pathlib import Path
from typing import Callable, ClassVar

from keel.experiments.analysis import Runs
from keel.experiments.study import verdicts as V
from keel.experiments.study.cells import CONDITION_WORDS, parts, short, upper_first
from keel.experiments.study.spec import Group, Study
from keel.experiments.table import markdown_table
from keel.keys import key

# The one list of claim kinds, ``{kind: class}``: a claim's ``test`` names one. Each subclass of
# Claim that sets ``kind`` adds itself (Claim.__init_subclass__); the package imports every module.
CLAIMS: dict[str, type[Claim]] = {}


@dataclass(kw_only=True)
class Claim:
    """One checked ``[[claims]]`` entry, typed: its keys as attributes, and what its kind
    provides (its verdict over the study's run records, the groups and schemes it reads, its
    rule, its numbers in one line, its tables in the report). A subclass that sets ``kind`` is a
    kind of claim and registers itself in :data:`CLAIMS`."""

    kind: ClassVar[str] = ""  # the value of ``test`` that names the kind
    unit: ClassVar[str] = ""  # of the numbers in the verdict table
    group_kind: ClassVar[str] = "train"  # the kind of group it reads (spec.Group.kind)
    own_rule: ClassVar[bool] = False  # judged by a rule of its own, not the paired-difference one
    figure: ClassVar[str] = ""  # the report's PNG its kind draws over all its claims (:meth:`plot`); "" for none

    id: str = key(MISSING, "the claim's label in the report, e.g. \"b\".", nonempty=True)
    title: str = key(MISSING, "what the paper claims, one line.", nonempty=True)
    test: str = key(MISSING, "the kind of claim: a name in keel.experiments.study.claims.CLAIMS.", nonempty=True)
    note: str = key("", "text printed under the claim's rule in the report.")

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if cls.__dict__.get("kind"):  # a kind of its own (a shared key set such as Paired sets none)
            CLAIMS[cls.kind] = cls

    def verdict(self, study: Study, runs: Runs) -> V.ClaimVerdict:  # pragma: no cover
        """The claim's verdict over the study's run records."""
        raise NotImplementedError

    def groups_read(self) -> list[str]:
        """The names of the groups whose runs the verdict reads."""
        return []

    def optional_groups(self) -> list[str]:
        """Of :meth:`groups_read`, those a scale may leave unsized without leaving the claim unjudged."""
        return []

    def schemes_read(self) -> list[str]:
        """The schemes whose runs the verdict reads (each must be trained by its groups)."""
        return []

    def reads(self) -> set[tuple[str, str]]:
        """The ``(group, scheme)`` pairs whose runs the claim's verdict reads."""
        return {(g, s) for g in self.groups_read() for s in self.schemes_read()}

    def rule(self) -> str:
        """The claim's rule in one line: the first paragraph of its verdict's docstring, with the
        claim's ``scheme`` (default keel), ``baseline``, ``order`` and ``group`` filled in, and any
        other key as ``{claim.KEY}``."""
        text = " ".join((type(self).verdict.__doc__ or "").strip().split("\n\n")[0].split())
        return text.format(scheme=getattr(self, "scheme", "keel"), baseline=getattr(self, "baseline", "the baseline"),
                           order=" < ".join(getattr(self, "order", [])), group=getattr(self, "group", "G"), claim=self)

    @classmethod
    def numbers(cls, c: V.ClaimVerdict) -> str:
        """One cell: the numbers behind the verdict ``c``, per condition."""
        if c.conditions is not None:
            return " — ".join(f"{CONDITION_WORDS.get(k, k)}: " + parts(v) for k, v in c.conditions.items())
        if c.parts and any(p.n for p in c.parts.values()):  # a claim of one condition, e.g. (h): its parts' numbers
            return "; ".join(f"{k} {short(p)}" for k, p in c.parts.items()) + (f"; {c.why}" if c.why else "")
        return c.why or "–"

    @classmethod
    def phrase(cls, conds: dict[str, V.Condition]) -> str:
        """The summary's verdict words over the conditions ``conds`` (which init)."""
        if set(conds) == {"paper_init", "embed_init"}:
            vp, vb = conds["paper_init"].verdict, conds["embed_init"].verdict
            if vp == vb:
                return f"{vp} at both inits"
            if V.REPRODUCED in (vp, vb):
                first, other = ("paper_init", "embed_init") if vp == V.REPRODUCED else ("embed_init", "paper_init")
                return f"reproduced {CONDITION_WORDS[first]} only ({conds[other].verdict} {CONDITION_WORDS[other]})"
            return f"{vp} {CONDITION_WORDS['paper_init']}, {vb} {CONDITION_WORDS['embed_init']}"
        return "; ".join(f"{v.verdict} {CONDITION_WORDS.get(k, k)}" for k, v in conds.items())

    def tables(self, c: V.ClaimVerdict) -> list[str]:
        """Markdown lines of the claim's section after its rule and note, from its verdict ``c``."""
        return []

    def own_floors(self) -> str:
        """The floors of a kind judged by the paired rule on numbers that are not losses, in words
        for the report's rule (e.g. "a share of sub-layers, f = 0.05"); "" for the loss floor."""
        return ""

    def check(self, groups: dict[str, Group]) -> None:
        """Raise KeelError naming what this kind needs beyond its keys' declarations."""

    def floor_cells(self, study: Study) -> list[tuple[tuple[str, ...], str, int]]:
        """The ``((group,), scheme, sub-layers)`` cells whose seed-to-seed spread of the best loss
        sets the study's loss floor (:func:`keel.experiments.study.judge.study_floor`); none by default."""
        return []

    @classmethod
    def plot(cls, verdicts: list[tuple[Claim, V.ClaimVerdict]], out: Path) -> bool:
        """Draw the kind's :attr:`figure` over ``verdicts`` (the study's claims of this kind, each with
        its verdict) to the PNG ``out``; False (nothing written) when there is nothing to draw."""
        return False


@dataclass(kw_only=True)
class Paired(Claim):
    """The keys of a claim that compares two schemes: the one the paper says is better and the
    one it beats."""

    scheme: str = key(MISSING, "the scheme the paper says is better, e.g. \"keel\".", nonempty=True)
    baseline: str = key(MISSING, "the scheme it is compared with, e.g. \"pre_ln\".", nonempty=True)

    def schemes_read(self) -> list[str]:
        return [self.scheme, self.baseline]


@dataclass(kw_only=True)
class OneGroup(Claim):
    """The key of a claim that reads one group (its kind's verdict says of which kind)."""

    group: str = key(MISSING, "the group the claim reads (its kind's verdict says which runs it needs).",
                     nonempty=True)

    def groups_read(self) -> list[str]:
        return [self.group]


@dataclass(kw_only=True)
class InitGroups(Claim):
    """The keys of a claim judged over a list of train groups at the paper's init and, optionally,
    the same groups at the other embedding init (conditions ``paper_init`` and ``embed_init``:
    :data:`keel.experiments.study.verdicts.CONDITIONS`)."""

    groups: list[str] = key(MISSING, "train groups at the paper's init, e.g. the depths of a margin.", nonempty=True,
                            note="group names")
    init_groups: list[str] = key([], "the same groups at the other embedding init: the claim is also judged with "
                                     "both schemes at that init.", note="group names")

    def groups_read(self) -> list[str]:
        return list(self.groups) + list(self.init_groups)


def cond_head(cond: str, c: V.Condition) -> list[str]:
    """Markdown: the bold verdict line of one condition ``cond`` of a verdict, then a blank line."""
    return [f"**{upper_first(CONDITION_WORDS[cond])}: {c.verdict}.** {parts(c)}", ""]


def condition_tables(c: V.ClaimVerdict, head: list[str], rows: Callable[[V.Condition], list[list]]) -> list[str]:
    """Markdown: per condition of verdict ``c`` its verdict line (:func:`cond_head`), a table of
    header ``head`` and rows ``rows(the condition's verdict)``, and a blank line."""
    return [line for cond, cc in c.conditions.items()
            for line in cond_head(cond, cc) + markdown_table(head, rows(cc)) + [""]]


def edge(bracketed: dict) -> dict:
    """``{seed: at an edge}`` from ``{seed: bracketed}`` (what :func:`keel.experiments.study.cells.lrs` marks)."""
    return {sd: not ok for sd, ok in bracketed.items()}
