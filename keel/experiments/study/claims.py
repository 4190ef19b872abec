"""The kinds of claim a study makes, one class per kind: the keys of its ``[[claims]]`` entry
(declared with :func:`keel.keys.key`), its verdict (a function of :mod:`.verdicts`, whose
docstring is the rule the report states), the groups and schemes it reads, its numbers in one
line, and its tables in the report. :data:`CLAIMS` is the one list of kinds (a claim's
``test`` names one); :func:`load_study` reads a study file and checks every claim against its
kind before anything trains.

A new kind of claim is one class here, its line in :data:`CLAIMS`, and a ``[[claims]]`` block.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import MISSING, dataclass
from typing import ClassVar, Sequence

from keel.errors import KeelError
from keel.experiments.record import RunRecord
from keel.experiments.study import verdicts as V
from keel.experiments.study.cells import (CONDITION_WORDS, direction, exits, flagged, lrs, max_lr_cell, parts, pm,
                                          upper_first, window)
from keel.experiments.study.spec import Group, Study, read_study
from keel.experiments.table import markdown_table
from keel.keys import check_keys, key, key_type


@dataclass(kw_only=True)
class Claim:
    """The keys every ``[[claims]]`` entry has, and what a kind of claim provides (class methods
    on the claim's table as a dict and its verdict dict)."""

    kind: ClassVar[str] = ""  # the value of ``test`` that names the kind
    unit: ClassVar[str] = ""  # of the numbers in the verdict table
    group_kind: ClassVar[str] = "train"  # the kind of group it reads (spec.Group.kind)
    own_rule: ClassVar[bool] = False  # judged by a rule of its own, not the paired-difference one

    id: str = key(MISSING, "the claim's label in the report, e.g. \"b\".", nonempty=True)
    title: str = key(MISSING, "what the paper claims, one line.", nonempty=True)
    test: str = key(MISSING, "the kind of claim: a name in keel.experiments.study.claims.CLAIMS.", nonempty=True)
    note: str = key("", "text printed under the claim's rule in the report.")

    @staticmethod
    def verdict(study: Study, runs: list[RunRecord], claim: dict) -> dict:  # pragma: no cover
        """``{"verdict": ..., ...}`` of the claim over the study's run records."""
        raise NotImplementedError

    @classmethod
    def groups_read(cls, claim: dict) -> list[str]:
        return [claim["group"]] + ([claim["extended_group"]] if claim.get("extended_group") else [])

    @classmethod
    def schemes_read(cls, claim: dict) -> list[str]:
        return [claim[k] for k in ("scheme", "baseline") if k in claim]

    @classmethod
    def reads(cls, claim: dict) -> set[tuple[str, str]]:
        """The ``(group, scheme)`` pairs whose runs the claim's verdict reads."""
        return {(g, s) for g in cls.groups_read(claim) for s in cls.schemes_read(claim)}

    @classmethod
    def rule(cls, claim: dict) -> str:
        """The claim's rule in one line: the first paragraph of its verdict's docstring, with the
        claim's ``scheme`` (default keel), ``baseline``, ``order`` and ``group`` filled in."""
        text = " ".join((cls.verdict.__doc__ or "").strip().split("\n\n")[0].split())
        return text.format(scheme=claim.get("scheme", "keel"), baseline=claim.get("baseline", "the baseline"),
                           order=" < ".join(claim.get("order", [])), group=claim.get("group", "G"))

    @classmethod
    def numbers(cls, c: dict) -> str:
        """One cell: the numbers behind the verdict ``c``, per condition."""
        if "conditions" in c:
            return " — ".join(f"{CONDITION_WORDS.get(k, k)}: " + parts(v) for k, v in c["conditions"].items())
        return c.get("why", "–")

    @classmethod
    def phrase(cls, conds: dict) -> str:
        """The summary's verdict words over the conditions ``conds`` (which init, which ramp)."""
        if set(conds) == {"paper_init", "embed_init"}:
            vp, vb = conds["paper_init"]["verdict"], conds["embed_init"]["verdict"]
            if vp == vb:
                return f"{vp} at both inits"
            if V.REPRODUCED in (vp, vb):
                first, other = ("paper_init", "embed_init") if vp == V.REPRODUCED else ("embed_init", "paper_init")
                return f"reproduced {CONDITION_WORDS[first]} only ({conds[other]['verdict']} {CONDITION_WORDS[other]})"
            return f"{vp} {CONDITION_WORDS['paper_init']}, {vb} {CONDITION_WORDS['embed_init']}"
        return "; ".join(f"{v['verdict']} {CONDITION_WORDS.get(k, k)}"
                         + (f" (to {v['peak_lr']:g})" if v.get("peak_lr") else "") for k, v in conds.items())

    @classmethod
    def tables(cls, claim: dict, c: dict) -> list[str]:
        """Markdown lines of the claim's section after its rule and note."""
        return []

    @classmethod
    def check(cls, claim: dict, groups: dict[str, Group]) -> None:
        """Raise KeelError naming what this kind needs beyond its keys' declarations."""


@dataclass(kw_only=True)
class MarginGrows(Claim):
    kind: ClassVar[str] = "margin_grows"
    unit: ClassVar[str] = "nats/token"

    groups: list[str] = key(MISSING, "train groups at the paper's init, the depths of the margin.", nonempty=True,
                            note="group names")
    scheme: str = key(MISSING, "the scheme the paper says wins, e.g. \"keel\".", nonempty=True)
    baseline: str = key(MISSING, "the scheme it beats, e.g. \"pre_ln\".", nonempty=True)
    init_groups: list[str] = key([], "the same depths at another embedding init: the claim is also judged with "
                                     "both schemes at that init.", note="group names")
    verdict = staticmethod(V.claim_margin_grows)

    @classmethod
    def groups_read(cls, claim: dict) -> list[str]:
        return list(claim["groups"]) + list(claim.get("init_groups", []))

    @classmethod
    def check(cls, claim: dict, groups: dict[str, Group]) -> None:
        if claim["scheme"] == claim["baseline"]:
            raise KeelError(f"study claim {claim['id']!r}: scheme and baseline are both {claim['scheme']!r}; "
                            "the margin is between two different schemes")

    @classmethod
    def tables(cls, claim: dict, c: dict) -> list[str]:
        out = [line for cond, cc in c["conditions"].items() for line in _margin_table(claim, cond, cc)]
        out += ["A best LR marked with an asterisk is not bracketed: it is the lowest or highest LR that seed trained "
                f"({widen_words(c.get('widen', {}))}).", "",
                f"The classifier reports a run's first failure: a {claim['baseline']} run flagged as a stagnation (100 "
                "steps on the unigram plateau) may leave the plateau later and still be that seed's best run (each "
                "run's verdict and plateau exit step: the last table)."]
        if c.get("equal_lr"):
            out += ["", "The same margin at equal peak LR at the paper's init (both schemes at that LR; not part of "
                    "the verdict):", ""] + markdown_table(
                ["sub-layers", "LR", "margin (baseline − scheme, nats) mean [CI] (per seed)"],
                [[r["sublayers"], f"{r['lr']:g}", pm(r["margin"])] for r in c["equal_lr"]])
        return out


def _margin_table(claim: dict, cond: str, c: dict) -> list[str]:
    """Markdown: one condition of a margin claim, a row per depth."""
    s, b = claim["scheme"], claim["baseline"]
    head = ["sub-layers", f"margin ({b} − {s}, nats) mean [CI] (per seed)", "at this depth", f"best LR per seed: {b}; {s}",
            f"init of the best run: {b}; {s}", f"plateau exit step at that LR: {b}; {s}",
            f"healthy-LR window (within {V.WINDOW:g} nats of the best seed-mean loss): {b}; {s}",
            f"{b} runs flagged by the divergence classifier"]
    rows = []
    for r in c["rows"]:
        edge = {x: {sd: not ok for sd, ok in r["bracketed"][x].items()} for x in (b, s)}
        rows.append([r["sublayers"], pm(r["margin"]), direction(r["margin"], s, b),
                     f"{lrs(r['best_lr'][b], edge[b])}; {lrs(r['best_lr'][s], edge[s])}",
                     "; ".join("[" + ", ".join(f"s{sd} {g}" for sd, g in r["best_group"][x].items()) + "]"
                               for x in (b, s)),
                     f"{exits(r['plateau_exit'][b])}; {exits(r['plateau_exit'][s])}",
                     f"{window(r['window'][b])} / {window(r['window'][s])}", flagged(r)])
    return [f"**{upper_first(CONDITION_WORDS[cond])}: {c['verdict']}.** {parts(c)}", ""] + markdown_table(head, rows) + [""]


@dataclass(kw_only=True)
class LrTransfer(Claim):
    kind: ClassVar[str] = "lr_transfer"
    unit: ClassVar[str] = "peak LR"
    own_rule: ClassVar[bool] = True

    group: str = key(MISSING, "a train group with its whole LR grid at two or more depths.", nonempty=True)
    scheme: str = key("keel", "the scheme whose optimal LR should transfer.", nonempty=True)
    verdict = staticmethod(V.claim_lr_transfer)

    @classmethod
    def schemes_read(cls, claim: dict) -> list[str]:
        return [claim.get("scheme", "keel")]  # the other schemes of its table are for comparison

    @classmethod
    def numbers(cls, c: dict) -> str:
        if "log10_shift" not in c:
            return super().numbers(c)
        row = next(r for r in c["rows"] if r["scheme"] == c["scheme"])
        lo, hi = c["depths"]
        return (f"{c['scheme']} optimal LR per seed: {lo} sub-layers {lrs(row['opt_lr'][lo])}, "
                f"{hi} sub-layers {lrs(row['opt_lr'][hi])}" + ("; at an edge of the LR grid" if row["at_edge"] else ""))

    @classmethod
    def tables(cls, claim: dict, c: dict) -> list[str]:
        return markdown_table(["scheme", "optimal LR per seed, by depth", "optimum at a grid edge"],
                              [[r["scheme"], "; ".join(f"{L}: {lrs(v)}" for L, v in r["opt_lr"].items()),
                                "yes" if r["at_edge"] else "no"] for r in c["rows"]])


@dataclass(kw_only=True)
class MaxLrOrder(Claim):
    kind: ClassVar[str] = "max_lr_order"
    unit: ClassVar[str] = "log10 of the max-LR ratio"
    group_kind: ClassVar[str] = "ramp"

    group: str = key(MISSING, "the ramp group on the paper's ramp (its verdict).", nonempty=True)
    order: list[str] = key(MISSING, "the schemes from the lowest max LR to the highest.", nonempty=True,
                           unique=True, note="two or more scheme names")
    extended_group: str = key("", "the same ramp continued at the same LR per step to a higher peak, reported "
                                  "beside it (optional per scale).")
    verdict = staticmethod(V.claim_max_lr_order)

    @classmethod
    def schemes_read(cls, claim: dict) -> list[str]:
        return list(claim["order"])

    @classmethod
    def check(cls, claim: dict, groups: dict[str, Group]) -> None:
        order = claim["order"]
        if len(order) < 2:
            raise KeelError(f"study claim {claim['id']!r}: order must be a list of two or more scheme names, "
                            f"e.g. order = [\"post_ln\", \"keel\"], got {order!r}")
        if claim.get("extended_group") in groups:
            _check_extended_ramp(claim, groups[claim["group"]], groups[claim["extended_group"]])

    @classmethod
    def tables(cls, claim: dict, c: dict) -> list[str]:
        out = []
        for cond, cc in c["conditions"].items():
            out += [f"**{upper_first(CONDITION_WORDS[cond])}" + (f" (to {cc['peak_lr']:g})" if cc.get("peak_lr") else "")
                    + f": {cc['verdict']}.** {parts(cc)}", ""]
        out += markdown_table(["ramp to", "sub-layers", *claim["order"]],
                              [[f"{r['peak_lr']:g} ({r['group']})", r["sublayers"],
                                *(lrs(r["max_lr"][s]) if r["max_lr"][s] else "—" for s in claim["order"])]
                               for r in c["rows"]])
        out += ["", "Max LR per seed; none = no divergence up to the ramp's peak LR; — = not run on that ramp. "
                "A none counts as the peak LR (censored: the pair's difference is then a lower bound); a seed where "
                "both schemes of a pair are none is left out. The verdict is the paper's ramp's; the extended ramp "
                "(the same LR per step to a higher peak) is reported beside it. Pair verdicts use log10 ratios of "
                "max LR with a 5% floor (log10 1.05 = 0.021). A spike still open when the curve ended counts as a "
                "divergence. Each run's verdict:", ""]
        return out + [f"- ramp to {r['peak_lr']:g}, {r['sublayers']} sub-layers, {run}: {text}" for r in c["rows"]
                      for run, text in r.get("verdicts", {}).items()]


def _check_extended_ramp(c: dict, ramp: Group, ext: Group) -> None:
    """Raise KeelError unless ``ext`` continues ``ramp``: the same LR per step (``peak_lr /
    ramp_steps``, so both ramps give step k the same LR and the extended runs repeat the first
    ramp up to its end) to a higher peak."""
    same_slope = math.isclose(ext.peak_lr / ext.ramp_steps, ramp.peak_lr / ramp.ramp_steps, rel_tol=1e-9)
    if ext is ramp or not same_slope or ext.peak_lr <= ramp.peak_lr:
        raise KeelError(f"study claim {c['id']!r}: extended_group {ext.name!r} must continue group {ramp.name!r}'s "
                        f"ramp: the same LR per step ({ramp.peak_lr:g} / {ramp.ramp_steps} steps) to a higher peak, "
                        f"got {ext.peak_lr:g} / {ext.ramp_steps} steps")


def _cond_head(cond: str, c: dict) -> list[str]:
    return [f"**{upper_first(CONDITION_WORDS[cond])}: {c['verdict']}.** {parts(c)}", ""]


def _edge(bracketed: dict) -> dict:
    return {sd: not ok for sd, ok in bracketed.items()}


@dataclass(kw_only=True)
class DataScaling(Claim):
    kind: ClassVar[str] = "data_scaling"
    unit: ClassVar[str] = "nats/token"

    budgets: list[str] = key(MISSING, "train groups of one depth at growing token budgets, paper's init.",
                             nonempty=True, unique=True, note="group names")
    init_budgets: list[str] = key([], "the same budgets with both schemes at the other embedding init.",
                                  unique=True, note="group names")
    scheme: str = key(MISSING, "the scheme the paper says gains with data, e.g. \"keel\".", nonempty=True)
    baseline: str = key(MISSING, "the scheme it is compared with, e.g. \"pre_ln\".", nonempty=True)
    verdict = staticmethod(V.claim_data_scaling)

    @classmethod
    def groups_read(cls, claim: dict) -> list[str]:
        return list(claim["budgets"]) + list(claim.get("init_budgets", []))

    @classmethod
    def check(cls, claim: dict, groups: dict[str, Group]) -> None:
        depths = {g: groups[g].sublayers for g in cls.groups_read(claim) if g in groups}
        if any(len(v) != 1 for v in depths.values()) or len({v[0] for v in depths.values()}) > 1:
            raise KeelError(f"study claim {claim['id']!r}: every budget group trains the same one depth, got "
                            + ", ".join(f"{g} {v}" for g, v in depths.items()))

    @classmethod
    def tables(cls, claim: dict, c: dict) -> list[str]:
        s, b = claim["scheme"], claim["baseline"]
        out = []
        for cond, cc in c["conditions"].items():
            out += _cond_head(cond, cc) + markdown_table(
                ["group", "tokens", f"tokens per non-embedding parameter ({b}; {s})",
                 f"margin ({b} − {s}, nats) mean [CI] (per seed)", f"best LR per seed: {b}; {s}"],
                [[r["group"], f"{r['tokens']:,}", f"{r['tokens_per_param'][b]:.3f}; {r['tokens_per_param'][s]:.3f}",
                  pm(r["margin"]), f"{lrs(r['best_lr'][b], _edge(r['bracketed'][b]))}; "
                  f"{lrs(r['best_lr'][s], _edge(r['bracketed'][s]))}"] for r in cc.get("rows", [])]) + [""]
        return out + ["A best LR marked with an asterisk is not bracketed (the study widens such a cell)."]


@dataclass(kw_only=True)
class DeepVsWide(Claim):
    kind: ClassVar[str] = "deep_vs_wide"
    unit: ClassVar[str] = "nats/token"

    deep: str = key(MISSING, "the train group of the deep shape, paper's init.", nonempty=True)
    wide: str = key(MISSING, "the train group of the wide shape (same parameters), paper's init.", nonempty=True)
    init_deep: str = key("", "the deep shape at the other embedding init.")
    init_wide: str = key("", "the wide shape at the other embedding init.")
    scheme: str = key(MISSING, "the scheme whose deep model should win, e.g. \"keel\".", nonempty=True)
    baseline: str = key(MISSING, "the scheme it beats at both shapes, e.g. \"pre_ln\".", nonempty=True)
    verdict = staticmethod(V.claim_deep_vs_wide)

    @classmethod
    def groups_read(cls, claim: dict) -> list[str]:
        return [claim[k] for k in ("deep", "wide", "init_deep", "init_wide") if claim.get(k)]

    @classmethod
    def check(cls, claim: dict, groups: dict[str, Group]) -> None:
        if bool(claim.get("init_deep")) != bool(claim.get("init_wide")):
            raise KeelError(f"study claim {claim['id']!r}: init_deep and init_wide come together")
        for k in ("deep", "wide", "init_deep", "init_wide"):
            g = groups.get(claim.get(k, ""))
            if g is not None and len(g.sublayers) != 1:
                raise KeelError(f"study claim {claim['id']!r}: group {g.name!r} ({k}) must train one depth, "
                                f"got {g.sublayers}")

    @classmethod
    def tables(cls, claim: dict, c: dict) -> list[str]:
        out = []
        for cond, cc in c["conditions"].items():
            out += _cond_head(cond, cc) + markdown_table(
                ["model", "non-embedding parameters", "best loss per seed (nats)", "best LR per seed"],
                [[name, f"{cc['params'][name]:,}", "[" + ", ".join(f"s{sd} {x:.3f}" for sd, x in v["loss"].items()) + "]",
                  lrs(v["lr"], _edge(v["bracketed"]))] for name, v in cc["cells"].items()]) + [""]
        return out


@dataclass(kw_only=True)
class LayerImportance(Claim):
    kind: ClassVar[str] = "layer_importance"
    unit: ClassVar[str] = "share of sub-layers; log10 PPL ratio"

    groups: list[str] = key(MISSING, "train groups with ablate = true, paper's init.", nonempty=True, note="group names")
    optimum_groups: list[str] = key(MISSING, "the train groups whose seed-mean optimal LR picks the ablated run.",
                                    nonempty=True, note="group names")
    init_groups: list[str] = key([], "ablated groups at the other embedding init.", note="group names")
    init_optimum_groups: list[str] = key([], "their LR source at the other init.", note="group names")
    scheme: str = key(MISSING, "the scheme with less shallow redundancy, e.g. \"keel\".", nonempty=True)
    baseline: str = key(MISSING, "the scheme with more, e.g. \"pre_ln\".", nonempty=True)
    share_floor: float = key(0.05, "the floor of the redundant-share difference.", gt=0, le=1)
    verdict = staticmethod(V.claim_layer_importance)

    @classmethod
    def groups_read(cls, claim: dict) -> list[str]:
        return [g for k in ("groups", "optimum_groups", "init_groups", "init_optimum_groups") for g in claim.get(k, [])]

    @classmethod
    def check(cls, claim: dict, groups: dict[str, Group]) -> None:
        plain = [g for g in [*claim["groups"], *claim.get("init_groups", [])] if g in groups and not groups[g].ablate]
        if plain:
            raise KeelError(f"study claim {claim['id']!r}: group(s) {', '.join(plain)} need ablate = true")
        if bool(claim.get("init_groups")) != bool(claim.get("init_optimum_groups")):
            raise KeelError(f"study claim {claim['id']!r}: init_groups and init_optimum_groups come together")

    @classmethod
    def tables(cls, claim: dict, c: dict) -> list[str]:
        s, b = claim["scheme"], claim["baseline"]
        out = []
        for cond, cc in c["conditions"].items():
            fmt = lambda d: "[" + ", ".join(f"s{sd} {x:.3f}" for sd, x in d.items()) + "]"
            out += _cond_head(cond, cc) + markdown_table(
                ["sub-layers", f"LR: {b}; {s}", f"redundant share of the shallow half per seed: {b}; {s}",
                 f"first two over the median (log10) per seed: {b}; {s}"],
                [[r["sublayers"], f"{r['lr'][b]}; {r['lr'][s]}", f"{fmt(r['share'][b])}; {fmt(r['share'][s])}",
                  f"{fmt(r['critical'][b])}; {fmt(r['critical'][s])}"] for r in cc.get("rows", [])]) + [""]
        return out + [f"Redundant: removing the sub-layer raises PPL by less than {V.REDUNDANT_BELOW:.0%}; the shallow "
                      f"half: the first {V.SHALLOW:.0%} of sub-layers. ΔPPL per sub-layer of every ablated run: "
                      "report.json (`ablation` of each run), drawn in importance.png."]


@dataclass(kw_only=True)
class EarlySpike(Claim):
    kind: ClassVar[str] = "early_spike"
    unit: ClassVar[str] = "nats/token"

    group: str = key(MISSING, "a train group whose runs read every step's loss (trained by this version).",
                     nonempty=True)
    scheme: str = key(MISSING, "the scheme that converges smoothly, e.g. \"keel\".", nonempty=True)
    baseline: str = key(MISSING, "the scheme that spikes, e.g. \"pre_ln\".", nonempty=True)
    verdict = staticmethod(V.claim_early_spike)

    @classmethod
    def tables(cls, claim: dict, c: dict) -> list[str]:
        s, b = claim["scheme"], claim["baseline"]
        cell = lambda d: "[" + ", ".join(f"s{sd} {x:.2f}" + ("" if v == "healthy" else f" ({v})")
                                         for sd, (x, v) in sorted(d.items())) + "]"
        return markdown_table(["sub-layers", "LR", f"largest early spike per seed (nats): {b}", s],
                              [[r["sublayers"], f"{r['lr']:g}", cell(r[b]), cell(r[s])] for r in c.get("rows", [])])


@dataclass(kw_only=True)
class Bench(Claim):
    kind: ClassVar[str] = "bench"
    unit: ClassVar[str] = "nats/token"

    group: str = key(MISSING, "the bench group (baselines_from a train group), paper's init.", nonempty=True)
    init_group: str = key("", "the bench at the other embedding init.")
    designs: list[str] = key(MISSING, "the residual designs judged (schemes the bench group trains).", nonempty=True,
                             unique=True, note="scheme names")
    baseline: str = key("pre_ln", "the scheme every design should beat.", nonempty=True)
    verdict = staticmethod(V.claim_bench)

    @classmethod
    def groups_read(cls, claim: dict) -> list[str]:
        return [claim["group"]] + ([claim["init_group"]] if claim.get("init_group") else [])

    @classmethod
    def schemes_read(cls, claim: dict) -> list[str]:
        return list(claim["designs"])  # the baseline is trained by the bench's baselines_from group

    @classmethod
    def check(cls, claim: dict, groups: dict[str, Group]) -> None:
        for name in cls.groups_read(claim):
            g = groups.get(name)
            if g is not None and claim.get("baseline", "pre_ln") not in g.baselines:
                raise KeelError(f"study claim {claim['id']!r}: group {name!r} names no baseline "
                                f"{claim.get('baseline', 'pre_ln')!r} (baselines)")

    @classmethod
    def tables(cls, claim: dict, c: dict) -> list[str]:
        out = []
        for cond, cc in c["conditions"].items():
            out += _cond_head(cond, cc) + markdown_table(
                ["sub-layers", "design", "against", "margin (against − design, nats) mean [CI] (per seed)", "in words"],
                [[r["sublayers"], r["scheme"], r["baseline"], pm(r["margin"]), direction(r["margin"], r["scheme"],
                                                                                    r["baseline"])]
                 for r in cc.get("rows", [])]) + [""]
        return out


@dataclass(kw_only=True)
class LoopMaxLr(Claim):
    kind: ClassVar[str] = "loop_max_lr"
    unit: ClassVar[str] = "log10 of the max-LR ratio"

    groups: list[str] = key(MISSING, "looped train groups at the paper's init, the effective depths.", nonempty=True,
                            note="group names")
    init_groups: list[str] = key([], "the same looped groups at the other embedding init.", note="group names")
    scheme: str = key(MISSING, "the scheme that should train at a higher max LR, e.g. \"keel\".", nonempty=True)
    baseline: str = key(MISSING, "the scheme it is compared with, e.g. \"pre_ln\".", nonempty=True)
    verdict = staticmethod(V.claim_loop_max_lr)

    @classmethod
    def groups_read(cls, claim: dict) -> list[str]:
        return list(claim["groups"]) + list(claim.get("init_groups", []))

    @classmethod
    def check(cls, claim: dict, groups: dict[str, Group]) -> None:
        """Every group read is looped, all with one loop geometry; a test_depth claim's also test loop counts
        (``test_loops``), its ``factor`` among them."""
        gs, tests = [groups[g] for g in cls.groups_read(claim) if g in groups], cls.kind == "test_depth"
        bad = [g.name for g in gs if not g.loop or (tests and not g.test_loops)]
        if bad or len({(tuple(g.loop), tuple(g.test_loops)) for g in gs}) > 1:
            raise KeelError(f"study claim {claim['id']!r}: its groups must be looped, with one loop = [P, C, Q]"
                            + (" and test_loops" if tests else "") + f" (check {', '.join(bad or [gs[0].name])})")
        if tests and gs and claim.get("factor", 2.0) not in gs[0].test_loops:
            raise KeelError(f"study claim {claim['id']!r}: factor {claim.get('factor', 2.0):g} is not one of the "
                            f"groups' test_loops {gs[0].test_loops}")

    @classmethod
    def tables(cls, claim: dict, c: dict) -> list[str]:
        s, b = claim["scheme"], claim["baseline"]
        out = []
        for cond, cc in c["conditions"].items():
            out += _cond_head(cond, cc) + markdown_table(
                ["sub-layers", f"max LR per seed: {b}", s, f"log10 ratio ({s} / {b}) mean [CI] (per seed)"],
                [[r["sublayers"], max_lr_cell(r["max_lr"][b]), max_lr_cell(r["max_lr"][s]),
                  "neither trains" if r["neither"] else pm(r["d"])] for r in cc.get("rows", [])]) + [""]
        return out + ["Max LR: the largest grid LR whose run left the unigram plateau and ended finite below it (+: "
                      "at the highest LR run; <: at none). A seed bounded alike on both sides is left out."]


@dataclass(kw_only=True)
class TestDepth(LoopMaxLr):  # the same keys (groups: looped groups with test_loops), and the factor judged
    kind: ClassVar[str] = "test_depth"
    unit: ClassVar[str] = "nats/token"

    factor: float = key(2.0, "the test-loop factor judged: R' = round(factor R), one of the groups' test_loops.", gt=0)
    verdict = staticmethod(V.claim_test_depth)

    @classmethod
    def tables(cls, claim: dict, c: dict) -> list[str]:
        s, b = claim["scheme"], claim["baseline"]
        out = []
        for cond, cc in c["conditions"].items():
            out += _cond_head(cond, cc) + markdown_table(
                ["sub-layers", "R", "R'", f"loss(R') − loss(R), {s}: mean [CI] (per seed)", b,
                 f"{s} − {b} in that difference"],
                [[r["sublayers"], r["loops"], n, pm(r["d"][s][n]), pm(r["d"][b][n]), pm(r["vs"][n])]
                 for r in cc.get("rows", []) for n in r["d"][s]]) + [""]
        return out + ["Each seed's run at its best LR, evaluated with its core applied R' times on the validation "
                      "windows of its final loss (nats/token); > 0: the loss rises at R'."]


# The one list of claim kinds: a claim's ``test`` names one.
CLAIMS: dict[str, type[Claim]] = {c.kind: c for c in (MarginGrows, LrTransfer, MaxLrOrder, DataScaling, DeepVsWide,
                                                      LayerImportance, EarlySpike, Bench, LoopMaxLr, TestDepth)}


def widen_words(widen: dict[str, int]) -> str:
    """How far the study widens an edge optimum, from each read group's ``widen`` (spec.Group)."""
    per = sorted(set(widen.values()))
    if per == [0]:
        return "this scale does not widen LR grids: widen = 0"
    head = "the study widens such a cell by one LR beyond the edge"
    if len(per) != 1:
        return head + ("" if not per else " (at most widen times per side: "
                       + ", ".join(f"{g}: {n}" for g, n in widen.items()) + ")")
    return head + ", " + {1: "at most once", 2: "at most twice"}.get(per[0], f"at most {per[0]} times") + " per side"


def claim_kind(claim: dict) -> type[Claim]:
    """The :class:`Claim` subclass of a (checked) claim's ``test``."""
    return CLAIMS[claim["test"]]


def _check_types(cls: type[Claim], c: dict) -> None:
    """Raise KeelError naming a key whose TOML type is not its declared one: a name given as a
    list or a number (``scheme = ["keel"]``), a list of names given as one string."""
    for f in dataclasses.fields(cls):
        if f.name not in c:
            continue
        v, base = c[f.name], key_type(cls, f.name).base
        if base is str and not isinstance(v, str):
            raise KeelError(f"study claim {c.get('id')!r}: {f.name} must be a string, got {v!r}")
        if base is list and not (isinstance(v, list) and all(isinstance(x, str) for x in v)
                                 and (v or not f.metadata["nonempty"])):
            raise KeelError(f"study claim {c.get('id')!r}: {f.name} must be a list of {f.metadata['note'] or 'names'}, "
                            f"got {v!r}")


def _check_key_names(c: dict, cls: type[Claim]) -> None:
    """Raise KeelError naming the missing keys of claim ``c`` (the fields of its kind ``cls`` without a
    default), else its unknown ones (keys ``cls`` does not declare)."""
    declared = {f.name: f for f in dataclasses.fields(cls)}
    missing = sorted(k for k, f in declared.items() if k not in c and f.default is MISSING and
                     f.default_factory is MISSING)
    unknown = sorted(set(c) - set(declared))
    if missing or unknown:
        raise KeelError(f"study claim {c['id']!r} ({cls.kind}): " + (f"missing {', '.join(missing)}" if missing
                                                                      else f"unknown key(s) {', '.join(unknown)}"))


def _check_groups_read(c: dict, cls: type[Claim], groups: dict[str, Group]) -> None:
    """Raise KeelError for the first group claim ``c`` reads that is not a group of the study at this
    scale (an ``extended_group`` may be missing: an extended ramp is optional per scale) or is of
    another kind than its kind ``cls`` reads (train / ramp)."""
    for g in cls.groups_read(c):
        if g not in groups and g != c.get("extended_group"):  # an extended ramp is optional per scale
            raise KeelError(f"study claim {c['id']!r}: group {g!r} is not a group of the study (declare it as [groups.{g}])")
        if g in groups and groups[g].kind != cls.group_kind:
            raise KeelError(f"study claim {c['id']!r}: {cls.kind} cannot read {groups[g].kind} group {g!r}")


def check_claim(c: object, groups: dict[str, Group]) -> None:
    """Raise KeelError naming the first problem of one ``[[claims]]`` entry: not a table, no id /
    title / known test, a key of the wrong type, missing or unknown, a group this scale does not
    size or of the other kind (train / ramp), a scheme the groups do not train, and what the
    kind checks itself (:meth:`Claim.check`)."""
    if not isinstance(c, dict) or not c.get("id") or not c.get("title"):
        raise KeelError("every [[claims]] entry needs an id and a title")
    _check_types(Claim, c)
    cls = CLAIMS.get(c.get("test"))
    if cls is None:
        raise KeelError(f"study claim {c['id']!r}: test must be one of {', '.join(CLAIMS)}, got {c.get('test')!r}")
    _check_types(cls, c)
    _check_key_names(c, cls)
    check_keys(cls(**c), f"study claim {c['id']!r}", sep=": ")
    _check_groups_read(c, cls, groups)
    cls.check(c, groups)
    schemes = set().union(*(groups[g].schemes for g in cls.groups_read(c) if g in groups))
    if set(cls.schemes_read(c)) - schemes:
        raise KeelError(f"study claim {c['id']!r}: scheme(s) {', '.join(sorted(set(cls.schemes_read(c)) - schemes))} "
                        f"not trained by its group(s)")


def load_study(name: str, scale: str, user_sets: Sequence[str] = ()) -> Study:
    """Read study ``name`` at ``scale`` (:func:`keel.experiments.study.spec.read_study`) and check
    every claim against its kind (:func:`check_claim`): the whole file is checked before anything
    trains.

    A claim that reads a group the file declares but ``scale`` does not size is not judged at
    that scale (moved to ``study.unjudged``; e.g. the test-suite scale sizes a few groups only).

    Raises:
        KeelError: everything :func:`read_study` raises; a bad claim (naming it and the key),
            including one naming a group the file does not declare.
    """
    study = read_study(name, scale, user_sets)
    groups = {g.name: g for g in study.groups}
    judged = []
    for c in study.claims:
        cls = CLAIMS.get(c.get("test")) if isinstance(c, dict) else None
        names = cls.groups_read(c) if cls is not None and all(
            k in c for k in (f.name for f in dataclasses.fields(cls) if f.default is MISSING)) else []
        unsized = [g for g in names if isinstance(g, str) and g not in groups and g in study.declared
                   and g != c.get("extended_group")]
        if unsized:
            study.unjudged.append({"id": c.get("id"), "groups": unsized})
            continue
        check_claim(c, groups)
        judged.append(c)
    study.claims = judged
    ids = [c["id"] for c in study.claims]
    if len(set(ids)) != len(ids):
        raise KeelError(f"study claims repeat an id: {', '.join(ids)}")
    return study
