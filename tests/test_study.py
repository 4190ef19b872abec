"""`keel study`: the verdict rule, each claim's computation on hand-made runs, the study
files of every shipped study, the paper-scale plan, and the tiny scale end to end."""

import json
import math
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from keel.errors import KeelError, plural
from keel.experiments.study import claims as SC, plan as SPlan, records as SRec, report as SR, run as SRun, spec as SS
from keel.experiments.study import judge as SJ, lrs as SLrs
from keel.experiments.study import verdicts as SV
from keel.experiments.study.cells import direction, lrs, short, window
from keel.experiments.grid import GridJob, _check_same_config
from keel.experiments.analysis import plain
from keel.experiments.record import RunRecord
from keel.config import Config, preset_names
from keel.model import SCHEMES
from keel.train.metrics import read_metrics
from conftest import REPO

R, NR, INC = SV.REPRODUCED, SV.NOT_REPRODUCED, SV.INCONCLUSIVE


def claim_of(test, **keys):
    """A claim of kind ``test`` with ``keys`` (id "x" and title "t" unless given), typed as load_study types it."""
    return SC.CLAIMS[test](**{"id": "x", "title": "t", "test": test, **keys})


# one-sided 95% Student-t quantiles t_{0.95, df} from a printed t table (df 1..4)
T95 = {1: 6.314, 2: 2.920, 3: 2.353, 4: 2.132}


def verdict_ref(diffs, f, k):
    """Direct transcription of the rule in claims.toml's [verdict] comment, with the t bounds
    mean -/+ t_{0.95, n-1} sd / sqrt(n) from the printed table above."""
    d = list(diffs)
    n = len(d)
    if n < max(2, k):
        return INC
    m = sum(d) / n
    half = T95[n - 1] * math.sqrt(sum((x - m) ** 2 for x in d) / (n - 1)) / math.sqrt(n)
    if m - half >= f:
        return R
    if m + half < f:
        return NR
    return INC


def run(group, scheme, L, seed, lr, loss, **kw):
    """A finished run's record, named as a study names it."""
    return RunRecord(**{"group": group, "name": f"L{L}_seed{seed}_{scheme}_lr{lr:g}", "scheme": scheme, "sublayers": L,
                        "seed": seed, "lr": lr, "status": "done", "capped_loss": loss, **kw})


def study(**kw):
    return SS.Study(**{"name": "t", "scale": "t", "description": "", "note": "", "base": "demo", "sets": [],
                       "groups": [], "claims": [], **kw})


@pytest.mark.parametrize("diffs", [[0.1, 0.05], [0.1, 0.09, 0.11], [-0.1, -0.3, -0.2], [0.01, -0.015, 0.0],
                                   [0.1, -0.1, 0.0], [0.5], [0.03, 0.02, 0.5], [0.3, 0.25, 0.35, 0.32], []])
def test_paired_verdict_transcription(diffs):
    v = SV.paired_verdict(dict(enumerate(diffs)), 0.02, 3)
    assert v.verdict == verdict_ref(diffs, 0.02, 3)
    if diffs:
        assert v.mean == pytest.approx(sum(diffs) / len(diffs))
        sd = math.sqrt(sum((x - v.mean) ** 2 for x in diffs) / (len(diffs) - 1)) if len(diffs) > 1 else 0.0
        assert v.sd == pytest.approx(sd)
    if len(diffs) > 1:  # the bounds themselves, against the printed table (3 decimals)
        half = T95[len(diffs) - 1] * v.sd / math.sqrt(len(diffs))
        assert (v.lo, v.hi) == pytest.approx((v.mean - half, v.mean + half), abs=2e-4)
    assert SV.combine([R, R]) == R and SV.combine([R, INC]) == INC and SV.combine([INC, NR]) == NR


def test_two_seeds_agreeing_are_no_longer_enough():
    """The v3 rule read two seeds both >= the floor as reproduced (a sign test, p = 0.25); the
    interval of two seeds 0.30 / 0.20 is 0.25 +- 6.314 * 0.0707 / 1.414 = [-0.066, +0.566]."""
    v = SV.paired_verdict({0: 0.30, 1: 0.20}, 0.02, 2)
    assert v.verdict == INC and v.lo == pytest.approx(-0.0657, abs=1e-3)


def test_trend_is_a_slope_over_every_depth():
    # seed margins at 16, 64, 256 sub-layers (log2: 4, 6, 8): slopes by hand, (m256 - m16) / 4 when linear
    margins = {16: {0: 0.1, 1: 0.2, 2: 0.0}, 64: {0: 0.3, 1: 0.4, 2: 0.2}, 256: {0: 0.5, 1: 0.6, 2: 0.45}}
    t = SV.trend_verdict(margins, 0.04, 3)
    by_hand = {sd: (margins[256][sd] - margins[16][sd]) / 4 for sd in (0, 1, 2)}  # x = 4, 6, 8: slope = (y3 - y1) / 4
    assert t.diffs == pytest.approx(by_hand) and t.depths == [16, 64, 256]
    assert t.min_effect == pytest.approx(0.04 / 4)  # the floor spread over log2(256 / 16) = 4 doublings
    assert t.verdict == verdict_ref(list(by_hand.values()), 0.01, 3) == R
    # a dip in the middle depth changes the slope (the v3 endpoint test would not see it)
    dip = {**margins, 64: {0: -0.5, 1: -0.5, 2: -0.5}}
    assert SV.trend_verdict(dip, 0.04, 3).diffs == pytest.approx(by_hand)  # symmetric: the slope ignores the middle
    skew = {16: {0: 0.0, 1: 0.0, 2: 0.0}, 64: {0: 0.4, 1: 0.4, 2: 0.4}, 256: {0: 0.4, 1: 0.4, 2: 0.4}}
    assert SV.trend_verdict(skew, 0.04, 3).diffs[0] == pytest.approx(0.1)  # least squares of (4,0),(6,.4),(8,.4)
    assert SV.trend_verdict({16: {0: 0.1}}, 0.04, 3).verdict == INC


def test_loss_floor_is_the_median_seed_spread():
    runs = [run("g", "keel", 16, sd, 1e-3, 3.0 + x) for sd, x in enumerate([0.0, 0.1, 0.2])]   # sd 0.1
    runs += [run("g", "pre_ln", 16, sd, 1e-3, 3.0 + x) for sd, x in enumerate([0.0, 0.02, 0.04])]  # sd 0.02
    runs += [run("g", "keel", 64, sd, 1e-3, 3.0 + x) for sd, x in enumerate([0.0, 0.5, 1.0])]  # sd 0.5
    f = SV.loss_floor(runs, [(["g"], "keel", 16), (["g"], "pre_ln", 16), (["g"], "keel", 64)], 0.02)
    assert f.floor == pytest.approx(0.1) and f.cells == 3 and f.max_sd == pytest.approx(0.5)
    assert SV.loss_floor(runs[3:6], [(["g"], "pre_ln", 16)], 0.05).floor == 0.05  # at least the minimum


def _margin_runs(margins, group="g", loss=3.0):
    """pre_ln and keel at 1e-3 / 3e-3 / 1e-2: keel's best 3e-3 (interior), pre_ln's best at 1e-3
    (an edge), margin[L][seed] = best(pre_ln) - best(keel)."""
    out = []
    for L, per in margins.items():
        for sd, m in per.items():
            out += [run(group, "keel", L, sd, 1e-3, loss + 0.2), run(group, "keel", L, sd, 3e-3, loss),
                    run(group, "keel", L, sd, 1e-2, loss + 0.1), run(group, "pre_ln", L, sd, 1e-3, loss + m),
                    run(group, "pre_ln", L, sd, 3e-3, loss + m + 0.05), run(group, "pre_ln", L, sd, 1e-2, loss + 1)]
    return out


def groups_study(**kw):
    return study(groups=[SS.Group("g", ["keel", "pre_ln"], [16, 64], [0, 1, 2], lrs=[1e-3, 3e-3, 1e-2]),
                         SS.Group("i", ["keel", "pre_ln"], [16, 64], [0, 1, 2], lrs=[1e-3, 3e-3, 1e-2])], **kw)


def test_the_lr_window_is_named_after_the_group_that_trained_that_depth():
    """The deepest depth is trained by the transfer group, not the LR grid: its window said "lr-grid" before."""
    st = study(groups=[SS.Group("g", ["keel", "pre_ln"], [16], [0, 1, 2], lrs=[1e-3, 3e-3, 1e-2]),
                       SS.Group("t", ["keel", "pre_ln"], [64], [0, 1, 2], lr_from="g")])
    runs = [replace(r, group="t" if r.sublayers == 64 else "g")
            for r in _margin_runs({16: {0: 0.1, 1: 0.1, 2: 0.1}, 64: {0: 0.5, 1: 0.5, 2: 0.5}})]
    c = claim_of("margin_grows", groups=["g", "t"], scheme="keel", baseline="pre_ln").verdict(st, runs)
    rows = c.conditions["paper_init"].rows
    assert [r.window["keel"] for r in rows] == [{"g": [3e-3, 1e-2]}, {"t": [3e-3, 1e-2]}]


@pytest.mark.parametrize("n, noun, text", [(0, "run", "0 runs"), (1, "run", "1 run"), (2, "run", "2 runs"),
                                           (1, "reference run", "1 reference run"), (3, "LR", "3 LRs")])
def test_counts_read_in_english(n, noun, text):
    """One plural rule for every message: the study log said "1 runs" for a group with one run left."""
    assert plural(n, noun) == text


def test_an_lr_window_counts_its_lrs():
    assert window({"g": [1e-3], "t": [1e-3, 3e-3], "u": []}) == "g 0.001–0.001 (1 LR); t 0.001–0.003 (2 LRs); u pending"


@pytest.mark.parametrize("m16, m64", [(0.1, 0.5), (0.5, 0.1)])
def test_a_margin_claim_gives_no_verdict_while_its_deepest_depth_is_still_training(m16, m64):
    """Judged over 16 and 64 sub-layers while 256 is planned, a margin that grows (or shrinks) gave
    "reproduced" (or "not reproduced") though the 256-sub-layer runs could overturn either part;
    now inconclusive until they are in, with the parts over the finished depths still reported."""
    st = study(groups=[SS.Group("g", ["keel", "pre_ln"], [16, 64], [0, 1, 2], lrs=[1e-3, 3e-3, 1e-2]),
                       SS.Group("t", ["keel", "pre_ln"], [256], [0, 1, 2], lr_from="g")])
    runs = _margin_runs({16: {0: m16, 1: m16 + 0.01, 2: m16 - 0.01}, 64: {0: m64, 1: m64 + 0.02, 2: m64 - 0.01}})
    claim = claim_of("margin_grows", groups=["g", "t"], scheme="keel", baseline="pre_ln")
    cond = claim.verdict(st, runs).conditions["paper_init"]
    words = [p.verdict for p in cond.parts.values()]
    assert words == ([R, R] if m64 > m16 else [R, NR]) and cond.verdict == INC
    assert list(cond.parts)[0] == "margin at 64 sub-layers (the deepest finished; 256 pending)"
    done = runs + [replace(r, group="t", sublayers=256) for r in runs if r.sublayers == 64]
    assert claim.verdict(st, done).conditions["paper_init"].verdict == (R if m64 > m16 else NR)


@pytest.mark.parametrize("widen, words", [
    ((0, 0), "(this scale does not widen LR grids: widen = 0)."),
    ((1, 1), "(the study widens such a cell by one LR beyond the edge, at most once per side)."),
    ((2, 2), "(the study widens such a cell by one LR beyond the edge, at most twice per side)."),
    ((1, 0), "(the study widens such a cell by one LR beyond the edge (at most widen times per side: g: 1, i: 0))."),
])
def test_the_margin_table_says_how_far_this_scale_widens(widen, words):
    """At tiny scale (widen 1 and 0) the report said "at most twice per side", the cpu scale's setting."""
    st = study(groups=[SS.Group("g", ["keel", "pre_ln"], [16, 64], [0, 1, 2], lrs=[1e-3, 3e-3, 1e-2], widen=widen[0]),
                       SS.Group("i", ["keel", "pre_ln"], [16, 64], [0, 1, 2], lrs=[1e-3, 3e-3, 1e-2], widen=widen[1])])
    claim = claim_of("margin_grows", id="b", groups=["g"], init_groups=["i"], scheme="keel", baseline="pre_ln")
    runs = _margin_runs({16: {0: 0.1, 1: 0.1, 2: 0.1}, 64: {0: 0.5, 1: 0.5, 2: 0.5}})
    c = claim.verdict(st, runs + [replace(r, group="i") for r in runs])
    line = next(x for x in claim.tables(c) if x.startswith("A best LR marked"))
    assert line.endswith(words), line


def test_a_study_of_ramps_only_has_no_empty_best_loss_table():
    """`keel stress`'s report showed "Best loss per scheme and depth" with a header and no row."""
    st = study(groups=[SS.Group("ramp", ["post_ln", "keel"], [4], [0], kind="ramp")])
    runs = [replace(run("ramp", s, 4, 0, 0.0, 5.0), max_lr=0.1) for s in ("post_ln", "keel")]
    assert SR.best_loss_table(st, runs) == []
    trained = study(groups=[SS.Group("g", ["keel"], [4], [0], lrs=[1e-3])])
    assert SR.best_loss_table(trained, [run("g", "keel", 4, 0, 1e-3, 3.0)])[-2].startswith("| g | 4 | keel | 3.000")


def test_margin_grows_at_both_inits():
    claim = claim_of("margin_grows", id="b", title="T", groups=["g"], init_groups=["i"], scheme="keel",
                     baseline="pre_ln")
    paper = _margin_runs({16: {0: 0.10, 1: 0.12, 2: 0.08}, 64: {0: 0.50, 1: 0.45, 2: 0.55}})
    # at the other init pre_ln is 0.45 nats better at every cell, keel 0.01 worse; that condition reads only the
    # init group (keel's paper-init runs are better, and are not taken: no choice between inits on the outcome)
    other = [replace(r, group="i", capped_loss=r.capped_loss - (0.45 if r.scheme == "pre_ln" else -0.01))
             for r in paper]
    c = claim.verdict(groups_study(), paper + other)
    pi, bi = c.conditions["paper_init"], c.conditions["embed_init"]
    assert pi.rows[1].margin.diffs == pytest.approx({0: 0.50, 1: 0.45, 2: 0.55}) and pi.verdict == R
    assert bi.rows[1].margin.diffs == pytest.approx({0: 0.04, 1: -0.01, 2: 0.09})
    assert bi.rows[1].best_group == {"pre_ln": {0: "i", 1: "i", 2: "i"}, "keel": {0: "i", 1: "i", 2: "i"}}
    assert bi.rows[0].margin.diffs == pytest.approx({0: -0.36, 1: -0.34, 2: -0.38})
    trend = next(v for k, v in bi.parts.items() if k.startswith("trend"))
    assert trend.diffs == pytest.approx({0: 0.2, 1: 0.165, 2: 0.235})  # (m64 - m16) / 2 doublings
    assert bi.verdict == INC and c.verdict == INC  # the margin at 64 is inside the floor's reach
    # where the optimum sits: keel's 3e-3 is bracketed, pre_ln's 1e-3 is an edge
    assert pi.rows[1].bracketed == {"pre_ln": {0: False, 1: False, 2: False}, "keel": {0: True, 1: True, 2: True}}
    assert pi.rows[1].window["keel"] == {"g": [3e-3, 1e-2]}  # within 0.1 nats of the best seed-mean loss
    line = SR.claim_summary(claim, c)
    assert line.startswith("(b) T: reproduced at the paper's init only (inconclusive at N(0, 1) embeddings) — ")
    md = "\n".join(SR.claim_section(claim, replace(c, summary=line)))
    assert "| 64 | +0.500 [90% CI +0.416, +0.584] (s0 +0.500, s1 +0.450, s2 +0.550) | keel better | " \
           "[s0 0.001*, s1 0.001*, s2 0.001*]; [s0 0.003, s1 0.003, s2 0.003] |" in md
    # the init group unfinished at a depth it is sized for: that seed has no N(0, 1) margin there
    part = [replace(r, status="pending") if (r.group, r.seed, r.sublayers) == ("i", 2, 64) else r
            for r in paper + other]
    bi = claim.verdict(groups_study(), part).conditions["embed_init"]
    assert list(bi.rows[1].margin.diffs) == [0, 1]


def test_max_lr_order_judges_the_papers_ramp_and_reports_the_extended_one():
    """At width 64 both Pre-LN and Keel reach about the ramp's 5e-2 peak: the verdict is the
    paper's ramp's; the same ramp continued to 0.1 is its own condition beside it."""
    st = SS.Study(name="t", scale="t", description="", note="", base="demo", sets=[], claims=[],
                  groups=[SS.Group("ramp", ["post_ln", "pre_ln", "keel"], [64], [0, 1, 2], kind="ramp"),
                          SS.Group("long", ["pre_ln", "keel"], [64], [0, 1, 2], kind="ramp", peak_lr=0.1, ramp_steps=2000)])
    claim = claim_of("max_lr_order", id="a", group="ramp", extended_group="long", order=["post_ln", "pre_ln", "keel"])
    rr = []
    for seed, (pre, keel) in enumerate([(4.4e-2, 8e-2), (4.6e-2, None), (4.5e-2, 7e-2)]):
        rr += [run("ramp", "post_ln", 64, seed, 5e-2, 0, max_lr=1e-2, peak_lr=5e-2),
               run("ramp", "pre_ln", 64, seed, 5e-2, 0, max_lr=pre, peak_lr=5e-2),
               run("ramp", "keel", 64, seed, 5e-2, 0, max_lr=None, peak_lr=5e-2),
               run("long", "pre_ln", 64, seed, 0.1, 0, max_lr=pre, peak_lr=0.1),
               run("long", "keel", 64, seed, 0.1, 0, max_lr=keel, peak_lr=0.1)]
    c = claim.verdict(st, rr)
    paper, ext = c.conditions["paper_ramp"], c.conditions["extended_ramp"]
    assert paper.parts["pre_ln < keel at 64"].diffs == pytest.approx(
        {0: math.log10(5e-2 / 4.4e-2), 1: math.log10(5e-2 / 4.6e-2), 2: math.log10(5e-2 / 4.5e-2)})
    assert paper.parts["post_ln < pre_ln at 64"].verdict == R
    assert set(ext.parts) == {"pre_ln < keel at 64"}  # the extended ramp trains no post_ln
    assert ext.parts["pre_ln < keel at 64"].diffs[1] == pytest.approx(math.log10(0.1 / 4.6e-2))
    assert c.verdict == paper.verdict == verdict_ref(
        list(paper.parts["pre_ln < keel at 64"].diffs.values()), SV.MAX_LR_FLOOR, 3) == R
    md = "\n".join(SR.claim_section(claim, c))
    assert "| 0.1 (long) | 64 | — | [s0 0.044, s1 0.046, s2 0.045] | [s0 0.08, s1 none, s2 0.07] |" in md
    assert "- ramp to 0.1, 64 sub-layers, keel s1: no verdict" in md
    # neither diverged in any seed: censored, no evidence
    both = [replace(r, max_lr=None) if r.scheme != "post_ln" else r for r in rr]
    c = claim.verdict(replace(st, groups=st.groups[:1]), both)
    assert c.conditions["paper_ramp"].parts["pre_ln < keel at 64"].n == 0 and c.verdict == INC


def test_lr_transfer_and_edges():
    runs = []
    for seed in (0, 1, 2):
        for L in (16, 64):
            for lr, loss in ((1e-3, 3.2), (3e-3, 3.0), (1e-2, 3.1)):
                runs.append(run("g", "keel", L, seed, lr, loss))
                runs.append(run("g", "post_ln", L, seed, lr, loss if L == 16 else {1e-3: 3.0, 3e-3: 3.1, 1e-2: 3.3}[lr]))
    c = claim_of("lr_transfer", group="g", scheme="keel").verdict(study(), runs)
    assert c.verdict == R and c.log10_shift == {0: 0.0, 1: 0.0, 2: 0.0}
    p = claim_of("lr_transfer", group="g", scheme="post_ln").verdict(study(), runs)
    assert p.verdict == INC  # its optimum moved to the grid's edge: the grid is too narrow to say


def test_lr_transfer_on_a_grid_of_one_lr_is_inconclusive():
    """One LR per cell locates no optimum: it is at both edges of its grid (it read "reproduced")."""
    runs = [run("g", "keel", L, seed, 1e-2, 3.0 + 0.01 * seed) for seed in (0, 1, 2) for L in (16, 64)]
    c = claim_of("lr_transfer", group="g", scheme="keel").verdict(study(), runs)
    assert c.verdict == INC and c.log10_shift == {0: 0.0, 1: 0.0, 2: 0.0}
    assert all(r.at_edge for r in c.rows)


@pytest.mark.parametrize("lrs, up, want", [([1e-3, 3e-3], True, 1e-2), ([3e-3, 1e-2], False, 1e-3),
                                            ([1e-2, 3e-2], True, 0.09), ([3e-4, 1e-3], False, 9e-5)])
def test_lr_beyond_follows_the_grid_then_mirrors_its_last_step(lrs, up, want):
    assert SLrs.lr_beyond(lrs, [3e-4, 1e-3, 3e-3, 1e-2, 3e-2], up) == pytest.approx(want)


def test_a_cell_with_its_optimum_on_an_edge_is_widened():
    g = SS.Group("g", ["keel", "pre_ln"], [16], [0, 1], lrs=[1e-3, 3e-3, 1e-2])
    st = study(groups=[g], claims=[{"id": "b", "test": "margin_grows", "groups": ["g"], "scheme": "keel",
                                    "baseline": "pre_ln"}])
    recs = _margin_runs({16: {0: 0.1, 1: 0.1}})  # pre_ln best at 1e-3 (low edge), keel at 3e-3 (inside)
    planned = {("keel", 16): [1e-3, 3e-3, 1e-2], ("pre_ln", 16): [1e-3, 3e-3, 1e-2]}
    wider = SLrs.widened_lrs(st, g, recs, planned, planned)
    assert wider == {("keel", 16): [1e-3, 3e-3, 1e-2], ("pre_ln", 16): pytest.approx([3.33e-4, 1e-3, 3e-3, 1e-2])}
    # two steps beyond the plan at most; an unfinished cell waits
    far = {("keel", 16): planned[("keel", 16)], ("pre_ln", 16): [9e-5, 3e-4, 1e-3, 3e-3, 1e-2]}
    low = [replace(r, lr={1e-3: 9e-5}.get(r.lr, r.lr)) for r in recs]
    assert SLrs.widened_lrs(st, g, low, far, planned) is None
    assert SLrs.widened_lrs(st, g, [replace(r, status="pending") for r in recs], planned, planned) is None


def test_an_lr_widened_from_runs_already_finished_trains_in_the_first_training_pass():
    """The study trained a whole pass of the group before widening from runs it had on disk or
    restored (the 256-sub-layer keel cell's 1e-3 waited behind 15 other runs): the first passes
    only read, so the widened LR is in the first pass that trains, in the group's order."""
    g = SS.Group("g", ["keel", "pre_ln"], [16], [0, 1], lrs=[1e-3, 3e-3, 1e-2])
    st = study(groups=[g], claims=[{"id": "b", "test": "margin_grows", "groups": ["g"], "scheme": "keel",
                                    "baseline": "pre_ln"}])
    finished = {(r.scheme, r.lr, r.seed): r for r in _margin_runs({16: {0: 0.1, 1: 0.1}})}
    calls = []

    def read(refs, jobs, now):
        calls.append((now, sorted({(j.values["model.residual"], f'{j.values["train.lr"]:.3g}') for j in jobs})))
        key = [(j.values["model.residual"], j.values["train.lr"], j.values["train.seed"]) for j in jobs]
        return [finished.get(k) or run("g", k[0], 16, k[2], k[1], 9.0, status="done" if now else "pending")
                for k in key]

    refs, jobs, recs = SLrs.group_records(st, g, [], "<data>", Path("unused"), read)
    lrs = [(s, lr) for s in ("keel", "pre_ln") for lr in ("0.001", "0.003", "0.01")]
    wide = sorted(lrs + [("pre_ln", "0.000333")])  # pre_ln's best is its lowest LR: one step below it
    assert [c[0] for c in calls] == [False, False, True]  # read, read again widened, then train once
    assert calls[0][1] == sorted(lrs) and calls[1][1] == calls[2][1] == wide
    assert len(jobs) == 14 and all(r["status"] == "done" for r in recs)


def test_thinned_curve_keeps_a_redrawable_curve():
    recs = [{"step": i, "loss": 6.0 - i / 100, "lr": 1e-3} for i in range(1, 1001)]
    recs += [{"step": 500, "val_loss": 4.0}, {"step": 1000, "val_loss": 3.5}, {"step": 7, "loss": None}]
    c = SRec.thinned_curve(recs, points=11, window=10)
    assert c["step"] == [1, 101, 201, 301, 401, 501, 600, 700, 800, 900, 1000]  # rounded even spacing
    assert c["loss"][-1] == pytest.approx(sum(6.0 - i / 100 for i in range(991, 1001)) / 10)
    assert c["val_step"] == [500, 1000] and c["val_loss"] == [4.0, 3.5]


@pytest.mark.parametrize("final, capped", [(math.nan, 5.5), (math.inf, 5.5), (None, 5.5), (3.25, 3.25)])
def test_a_run_without_a_finite_final_loss_is_judged_at_its_step_0_loss(tmp_path, final, capped):
    """A diverged run of an LR grid whose last evaluation is NaN counts as its step-0 loss. Before the
    fix its capped loss was NaN, and ``min`` over a seed's LRs then picked it whenever it came first."""
    cfg = {"model": {"residual": "pre_ln", "n_layers": 8}, "train": {"seed": 0, "lr": 1e-3}}
    job = GridJob("L16_seed0_pre_ln_lr0.001", cfg, {})
    group = SS.Group(name="g", schemes=["pre_ln"], sublayers=[16], seeds=[0], lrs=[1e-3])
    rec = SRec.run_record(group, job, tmp_path, {"status": "done", "final_val_loss": final, "first_val_loss": 5.5})
    assert rec["capped_loss"] == capped
    other = replace(rec, lr=3e-3, capped_loss=4.0)
    assert SV.best_runs([rec, other], ["g"], "pre_ln", 16)[0]["lr"] == (1e-3 if capped < 4.0 else 3e-3)


@pytest.mark.parametrize("divergence, words", [
    (None, "healthy"),
    ({"mode": "instability", "step": 875, "evidence": {"lr_at_step": 0.0437}}, "instability from step 875 (LR 0.0437)"),
    ({"mode": "instability", "step": 994, "evidence": {"lr_at_step": 0.0497, "open_at_end": 1.0}},
     "instability from step 994 (LR 0.0497), a spike still open when the curve ended"),
    ({"mode": "stagnation", "step": 122, "evidence": {}}, "stagnation from step 122"),
    ({"mode": "stagnation", "step": 221, "evidence": {"lr_at_step": 0.000905}, "plateau_exit_step": 617},
     "stagnation from step 221 (LR 0.000905), left the plateau at step 617"),
    ({"mode": "stagnation", "step": 221, "evidence": {}, "plateau_exit_step": 150}, "stagnation from step 221"),
])
def test_runs_verdicts_in_words(divergence, words):
    """The (a) section lists each ramp run's verdict, so that a max LR set by the classifier's
    weaker end-of-curve rule (both cpu-scale seed-1 runs of Pre-LN and Keel, step 994) is visible;
    a stagnation the run left later says so (Pre-LN at 256 sub-layers read "stagnation" at 4.34 nats)."""
    rec = run("ramp", "keel", 64, 1, 5e-2, 0, max_lr=None, peak_lr=5e-2)
    divergence = dict(divergence or {})
    rec.update(verdict=divergence.get("mode", "healthy"), divergence=divergence or None,
               plateau_exit_step=divergence.pop("plateau_exit_step", None))
    assert SV.verdict_words(rec) == words
    c = claim_of("max_lr_order", group="ramp", order=["pre_ln", "keel"]).verdict(study(), [rec])
    assert c.rows[0].verdicts == {"keel s1": words}


def test_claims_without_finished_runs_say_so():
    """Before any run finished, (d) printed "16 sub-layers [], 64 sub-layers []" and (e) "–"."""
    st = SC.load_study("claims", "cpu")
    runs, _ = SRun.collect(st, "unused", Path("unused"), train=False)
    words = {cl.id: cl.numbers(cl.verdict(st, runs)) for cl in st.claims}
    two = ("at the paper's init: needs paired results at two depths at least — at N(0, 1) embeddings: "
           "needs paired results at two depths at least")
    assert {k: words[k] for k in "abcd"} == {
        "a": "on the paper's ramp: no finished ramp runs — on the extended ramp: no finished ramp runs",
        "b": two, "c": two, "d": "no seed has keel's LR grid finished at both 16 and 64 sub-layers"}
    assert words["e"] == ("at the paper's init: 0 of 3 token budgets finished — at N(0, 1) embeddings: "
                          "0 of 3 token budgets finished")
    assert words["h"] == "0 of 30 runs of group spike (keel, pre_ln) finished"
    # (g) listed its 12 parts as "– (inconclusive)", which hid what it waits for
    assert words["g"] == ("at the paper's init: ablations pending (90 runs of spike, lr-grid unfinished) — at N(0, 1) "
                          "embeddings: no ablated runs yet (60 runs of init unfinished)")
    assert words["i"] == "at the paper's init: bench runs pending — at N(0, 1) embeddings: bench runs pending"


def test_groups_no_claim_reads_get_their_own_section():
    """The 1024-sub-layer showcase and the residual bench had no section: their runs showed only
    in the best-loss and every-run tables, without their note or their own settings."""
    st = SC.load_study("claims", "cpu")
    runs = [run("showcase", "keel", 1024, 0, 3e-3, 4.1, tokens=153_600, first_val_loss=6.24, final_val_loss=4.1,
                plateau_exit_step=41, verdict="healthy"),
            run("showcase", "post_ln", 1024, 0, 3e-3, 6.2, tokens=153_600, first_val_loss=6.24, final_val_loss=6.2,
                plateau_exit_step=None, verdict="stagnation"),
            replace(run("showcase", "pre_ln", 1024, 0, 3e-3, 0), status="pending"),
            run("lr-grid", "keel", 16, 0, 1e-2, 3.0)]
    md = SR.unclaimed_group_sections(st, runs)
    assert [x for x in md if x.startswith("## ")] == ["## Group showcase (no claim reads it)"]  # (i) reads the bench
    assert any(x.startswith("The paper's core claim at its deepest depth") for x in md)
    assert "Settings beyond the scale's: model.d_model=32, model.n_heads=2" in "\n".join(md)
    assert "Runs finished: 2 of 3." in md
    assert "| keel | 1024 | 0.003 | 0 | 153,600 | 6.240 → 4.100 | 41 | healthy |" in md
    assert "| post_ln | 1024 | 0.003 | 0 | 153,600 | 6.240 → 6.200 | never | stagnation |" in md


def test_plateau_exit_step():
    recs = [{"step": s, "loss": 6.0 if s < 20 else 4.0} for s in range(1, 41)]
    # trailing window ending at step s holds s - 19 losses of 4: mean (5*6 + 5*4)/10 = 5.0 at s = 24
    assert SRec.plateau_exit_step(recs, 5.0, window=10) == 25
    assert SRec.plateau_exit_step(recs, 5.01, window=10) == 24
    assert SRec.plateau_exit_step(recs, 3.0) is None and SRec.plateau_exit_step(recs, None) is None


def skip_unless_scale(name: str, scale: str) -> None:
    """Skip the test where shipped study ``name`` has no scale ``scale`` (a file without ``[scales]``
    has one size, at every scale): a study of one's own need not size every scale."""
    from keel.config import read_toml, resolve_config_path
    scales = read_toml(resolve_config_path(name, kind="studies"), "study").get("scales")
    if scales is not None and scale not in scales:
        pytest.skip(f"study {name} has no scale {scale} (the looped study ships tiny, cpu and gpu-1)")


@pytest.mark.parametrize("name", preset_names("studies"))
@pytest.mark.parametrize("scale", ["tiny", "cpu", "gpu-1", "paper"])
def test_shipped_studies_plan(name, scale):
    skip_unless_scale(name, scale)
    plan = SRun.run_study(name, scale, "unused", dry_run=True)
    rows = {r["group"]: r for r in plan["plan"]}
    assert rows and all(r["runs"] > 0 and r["tokens"] > 0 for r in rows.values())
    if name == "claims" and scale == "cpu":  # the looped study's own plan: tests/test_study_looped.py
        # 1,024,000 tokens per run but the showcase and claim (e)'s smaller budgets (a quarter and half of it)
        assert all(t >= 1_000_000 for g, r in rows.items() if g != "showcase" and not g.startswith("tokens-")
                   for t in r["tokens_per_run"])
        assert rows["tokens-quarter"]["tokens_per_run"] == [256_000] and rows["tokens-half"]["tokens_per_run"] == [512_000]
        assert rows["transfer"]["tokens_per_param"] == {256: pytest.approx(0.161, abs=5e-4)}
        assert all(len(r["seeds"]) >= 2 for g, r in rows.items() if g != "showcase")
    if name == "claims" and scale in ("cpu", "gpu-1"):  # optima fell on 1e-3 .. 1e-2 at cpu: the grid reaches past both
        assert min(rows["lr-grid"]["lrs"]) <= 3e-4 and max(rows["lr-grid"]["lrs"]) >= 3e-2
    if scale == "paper":  # the paper's own settings: Table 1 ramp, Table 3 depths at width 1024
        assert rows["ramp"]["lr_plan"] == "ramp 0 -> 0.05 over 5000 steps" and rows["ramp"]["sublayers"] == [64, 512]
        assert rows["lr-grid"]["sublayers"] == [64, 128, 512, 1024]
        assert rows["lr-grid"]["tokens_per_run"][0] == pytest.approx(250e9, rel=1e-3)
        assert "GPU-hours" in plan["markdown"]
    # JSON: lrs is always a list of numbers (was a sentence for the ramp and lr_from groups); the words are lr_plan
    assert all(isinstance(r["lrs"], list) and all(isinstance(x, float) for x in r["lrs"]) for r in rows.values())
    assert "transfer" not in rows or rows["transfer"]["lrs"] == [] and rows["transfer"]["lr_plan"].startswith("from lr-")


@pytest.mark.parametrize("scale", ["tiny", "cpu", "gpu-1", "paper"])
def test_groups_compared_with_each_other_train_the_same_tokens(scale):
    """(b) and (c) read the init groups beside the lr-grid's, and the bench is read against the
    lr-grid's rows: at the paper scale init and bench ran 23,842 steps
    against the lr-grid's 238,419 (a tenth of the tokens)."""
    rows = {r["group"]: r for r in SRun.run_study("claims", scale, "unused", dry_run=True)["plan"]}
    for group in ("init", "bench", "transfer"):
        assert rows[group]["tokens_per_run"] == rows["lr-grid"]["tokens_per_run"], group


@pytest.mark.parametrize("name", preset_names("studies"))
def test_claim_rules_name_the_claims_schemes(name):
    """The report states each claim's rule with its schemes (was the docstring's
    ``claim["order"]``/``scheme`` placeholders, verbatim)."""
    skip_unless_scale(name, "cpu")
    st = SC.load_study(name, "cpu")
    for claim in st.claims:
        rule = claim.rule()
        assert "claim[" not in rule and "``" not in rule and "{" not in rule
        for key in ("scheme", "baseline"):
            if hasattr(claim, key):
                assert getattr(claim, key) in rule
    claims = {c.id: c.rule() for c in st.claims}
    if name == "claims":
        assert claims["a"].endswith("increases along post_ln < deepnorm < pre_ln < keel, on the paper's ramp.")
        assert claims["b"].startswith("keel beats pre_ln at the deepest depth")
        c = st.claims[0].verdict(st, [])
        assert "peak LR 0" not in "\n".join(SR.claim_section(st.claims[0], c))  # no "peak LR 0" without ramp runs


def test_group_jobs_run_the_seeds_of_a_cell_side_by_side(tmp_path):
    """Order depth, scheme, LR, seed: the first 2k jobs of a partial grid are k paired cells
    (seed-major order left every cell of a 64-sub-layer group unpaired for hours)."""
    study = SC.load_study("claims", "cpu")
    g = next(g for g in study.groups if g.name == "lr-grid")
    _, jobs = SLrs.group_jobs(study, g, "unused", tmp_path)
    key = [(j.values["model.n_layers"], j.values["model.residual"], j.values["train.lr"], j.values["train.seed"])
           for j in jobs]
    rank = {s: i for i, s in enumerate(g.schemes)}
    assert key == sorted(key, key=lambda k: (k[0], rank[k[1]], k[2], k[3]))
    assert [k[3] for k in key[:6]] == [0, 1, 2, 0, 1, 2] and len({k[:3] for k in key[:3]}) == 1
    # depths x LRs x (3 seeds for keel, pre_ln, post_ln; 2 for deepnorm: its seeds_for)
    assert key[0][:2] == (8, "keel") and len(key) == len(set(key)) == 2 * 5 * (3 * 3 + 2)
    assert {k[3] for k in key if k[1] == "deepnorm"} == {0, 1}


def test_report_counts_say_what_is_left_out(tmp_path):
    """Before anything ran, the report names the runs of a group not planned yet and says
    that a ramp group's reference runs are not counted, so its total (110 lr-grid + 12 ramp + 6
    ramp-long + 90 init + 3 showcase + 30 spike + 48 bench + 36 bench-init = 335 at the cpu scale)
    reconciles with --dry-run's."""
    study = SC.load_study("claims", "cpu")
    runs, waiting = SRun.collect(study, "unused", tmp_path, train=False)
    assert len(runs) == 335 and all(r["status"] == "pending" for r in runs)
    words = [SR.waiting_words(w) for w in waiting]
    assert words[:3] == ["group transfer (33 runs) waits for group lr-grid at 64 sub-layers",
                         "group transfer-init (27 runs) waits for group init at 64 sub-layers",
                         "group tokens-quarter (18 runs) waits for group transfer at 256 sub-layers"]
    assert len(words) == 11
    assert words[-1] == "group importance-deep-init (6 runs) waits for group transfer-init at 256 sub-layers"
    md = SR.report_markdown(study, [], runs, "keel study claims --scale cpu", waiting)
    assert ("Runs finished: 0 of 335 planned so far. Unfinished: lr-grid 110 (keel, pre_ln, post_ln, deepnorm; "
            "read by (b), (c), (d), (g)); ramp 12 (post_ln, deepnorm, pre_ln, keel; read by (a)); ") in md
    assert ("bench-init 36 (peri_ln, hyper_connections, mhc, attn_res; read by (i)). The ramp groups' reference runs "
            "(the scale's `--dry-run` counts them) are not counted. Not planned yet: group transfer (33 runs) waits "
            "for group lr-grid") in md
    # DeepNorm's lr-grid runs and the groups of the v5 claims still to run
    done = [replace(r, status="done") if r.group not in ("bench", "bench-init", "spike") and r.scheme != "deepnorm"
            else r for r in runs]
    assert SR.unfinished_words(study, done) == (
        " Unfinished: lr-grid 20 (deepnorm; read by no claim); ramp 3 (deepnorm; read by (a)); spike 30 (keel, pre_ln; "
        "read by (g), (h)); bench 48 (peri_ln, hyper_connections, mhc, attn_res; read by (i)); bench-init 36 "
        "(peri_ln, hyper_connections, mhc, attn_res; read by (i)).")


def test_the_report_states_the_run_time_recorded_and_left():
    """Recorded = the finished runs' wall times summed; left = sum over the runs to go (unfinished
    records and the runs of groups not planned yet) of the median wall time of the finished runs
    of the same group kind and depth, written out by hand for the cpu study's groups; a depth with
    no finished run is counted apart."""
    study = SC.load_study("claims", "cpu")

    def rec(group, L, status, wall=None):
        return RunRecord(group=group, name="r", sublayers=L, status=status, wall_s=wall)
    runs = [rec("lr-grid", 16, "done", w) for w in (300, 360, 600)] + [rec("init", 16, "done", 330)]
    runs += [rec("ramp", 64, "done", 1200), rec("lr-grid", 64, "done", 500), rec("init", 64, "done", 700)]
    runs += [rec("init", 16, "pending")] * 3 + [rec("init", 64, "pending")] * 2 + [rec("ramp", 64, "running", 90)]
    waiting = [{"group": "transfer-init", "runs": 4, "sublayers": [256], "source": "init", "source_sublayers": 64}]
    recorded = (300 + 360 + 600 + 330 + 1200 + 500 + 700) / 3600
    # medians: train 16 -> 345 s (of 300, 330, 360, 600), train 64 -> 600 s, ramp 64 -> 1200 s; 256: none yet
    left = (3 * 345 + 2 * 600 + 1 * 1200) / 3600
    head = (f" Run time: {recorded:.1f} worker-hours recorded over the 7 finished runs that record one (each run's "
            "wall time as trained: a machine's `--workers` share its cores); ")
    assert SR.run_time_words(study, runs, waiting) == head + (
        f"about {left:.1f} worker-hours left for 6 of the 10 runs to go (the other 4 at a depth with no finished run "
        "yet), each at the median wall time of this study's finished runs of its kind and depth (16 sub-layers "
        "5.8 min, 64 sub-layers 10.0 min, 64 sub-layers (ramp) 20.0 min).")
    runs.append(rec("transfer", 256, "done", 2000))
    assert f"; about {left + 4 * 2000 / 3600:.1f} worker-hours left for the 10 runs to go," in SR.run_time_words(
        study, runs, waiting)
    assert SR.run_time_words(study, runs[-1:]) == (" Run time: 0.6 worker-hours recorded over the 1 finished runs "
                                                   "that record one (each run's wall time as trained: a machine's "
                                                   "`--workers` share its cores).")
    assert SR.run_time_words(study, [rec("init", 16, "pending")], waiting) == (
        " Run time: the 5 runs to go are not estimated (no finished run yet of their kind and depth).")
    assert SR.run_time_words(study, []) == ""


@pytest.mark.parametrize("diffs, words", [({0: 0.3, 1: 0.2, 2: 0.25}, "keel better"),
                                          ({0: -0.3, 1: -0.2, 2: -0.25}, "pre_ln better"),
                                          ({0: 0.001, 1: -0.001, 2: 0.0}, "no keel advantage"),
                                          ({0: 0.3, 1: -0.2, 2: 0.1}, "undecided"), ({0: 0.3}, "too few seeds"),
                                          ({0: -0.001, 1: -0.0004, 2: -0.0007}, "no keel advantage")])
def test_a_depths_margin_is_said_in_words_not_as_a_verdict(diffs, words):
    """A depth's row said "not reproduced" where the shallow depth merely favoured the baseline;
    two tiny negative margins (inside the 0.02 floor) read "pre_ln better"."""
    assert direction(SV.paired_verdict(diffs, 0.02, 3), "keel", "pre_ln") == words


@pytest.mark.parametrize("diffs, words", [
    ({}, "no paired seed yet"), ({0: None, 1: None}, "no finite paired difference (2 seeds without a loss on a side)"),
    ({0: None}, "no finite paired difference (1 seed without a loss on a side)"), ({0: 0.5}, "+0.500, 1 seed")])
def test_a_margin_without_a_finite_difference_says_why(diffs, words):
    """Both seeds finished but censored (no loss on a side) read "no paired seed yet"."""
    assert short(SV.paired_verdict(diffs, 0.02, 3)) == words


def test_the_report_states_which_rule_each_claim_follows():
    st = SC.load_study("claims", "cpu")
    rule = SR.verdict_rule(st, st.claims)
    assert rule.startswith("Rule of (a), (b), (c), (e), (f), (g), (h), (i): per seed the paired difference d")
    assert "for (a) log10 ratios of max LR, f = log10 1.05 = 0.021, a 5% ratio" in rule  # said "d ≥ 0.02" for (a)
    # (g) is judged on a share of sub-layers and a log10 PPL ratio, not on the loss floor in nats the rule gave it
    assert ("; for (g) the redundant share, a share of sub-layers, f = 0.05; the first-two ratio, log10 of a PPL "
            "ratio, f = log10 1.05 = 0.021)") in rule
    assert rule.endswith("(d) has its own rule, stated in its section.")
    d_only = [c for c in st.claims if c.own_rule]  # a study of own-rule claims only read "Rule of : per seed ..."
    assert SR.verdict_rule(st, d_only) == "(d) has its own rule, stated in its section."
    assert SR.verdict_rule(st, d_only * 2).startswith("(d), (d) have their own rule")
    assert SR.verdict_rule(st, []) == ""
    assert all(kind.unit and kind.verdict.__doc__ for kind in SC.CLAIMS.values())
    # every claim before any run finished (an (e) without init runs crashed the report: rows [] .items())
    claims = [(c, c.verdict(st, [])) for c in st.claims]
    for c, v in claims:
        v.summary = SR.claim_summary(c, v)
    md = SR.report_markdown(st, claims, [], "keel study claims --scale cpu").splitlines()
    table = md[md.index("| claim | at the paper's init | at N(0, 1) embeddings | unit |"):][2:6]
    assert [row.rsplit("|", 2)[1].strip() for row in table] == ["log10 of the max-LR ratio", "nats/token",
                                                                "nats/token", "peak LR"]
    d = next(c for c in st.claims if c.id == "d")
    assert "deepest depth of group lr-grid, which trains its whole LR grid" in d.rule()
    assert "own rule" in d.rule() and "edge of the LR grid" in d.rule()
    b = next(c for c in st.claims if c.id == "b")
    section = SR.claim_section(b, b.verdict(st, []))
    assert any(line.startswith("What the paper shows: Table 3 gives benchmark averages") for line in section)


def test_transfer_group_trains_the_optimum_and_the_grid_steps_around_it(tmp_path):
    """lr_from_steps [0, -1]: each scheme at its transferred optimum and the next lower LR of the
    source grid (Keel at 256 sub-layers stagnated at the 64-sub-layer optimum 1e-2 in one seed);
    points off the grid are left out. (The cpu scale now takes [-1, 0, 1] and widens edges.)"""
    study = SC.load_study("claims", "cpu")
    g = next(x for x in study.groups if x.name == "transfer")
    assert g.lr_from_steps == [-1, 0, 1]
    g = replace(g, lr_from_steps=[0, -1])
    lrs = SLrs.stepped_lrs(study, g, {"keel": 1e-2, "pre_ln": 3e-3, "post_ln": 3e-4, "deepnorm": 0.0100001})
    assert lrs == {"keel": [3e-3, 1e-2], "pre_ln": [1e-3, 3e-3], "post_ln": [3e-4], "deepnorm": [3e-3, 1e-2]}
    _, jobs = SLrs.group_jobs(study, g, "unused", tmp_path, {(s, 256): x for s, x in lrs.items()})
    assert sorted((j.values["model.residual"], j.values["train.lr"], j.values["train.seed"]) for j in jobs
                  if j.values["model.residual"] == "keel") == [("keel", 3e-3, 0), ("keel", 3e-3, 1), ("keel", 3e-3, 2),
                                                              ("keel", 1e-2, 0), ("keel", 1e-2, 1), ("keel", 1e-2, 2)]
    assert all(j.values["model.n_layers"] == 128 for j in jobs) and len(jobs) == 3 * (2 + 2 + 1) + 2 * 2


def test_bad_study_input(tmp_path):
    with pytest.raises(KeelError, match="no scale 'huge'"):
        SC.load_study("claims", "huge")
    with pytest.raises(KeelError, match="unknown study 'nope'"):
        SC.load_study("nope", "cpu")
    bad = tmp_path / "s.toml"
    bad.write_text('[groups.g]\nschemes = ["keel", "nonsense"]\n[scales.x.groups.g]\nsublayers=[2]\nseeds=[0]\nlrs=[1e-3]\n')
    with pytest.raises(KeelError, match="unknown scheme"):
        SC.load_study(str(bad), "x")
    bad.write_text('[groups.g]\nschemes = ["keel"]\n[scales.x.groups.g]\nsublayers=[3]\nseeds=[0]\nlrs=[1e-3]\n')
    with pytest.raises(KeelError, match=r"sublayers must be a non-empty list of distinct integers >= 2 \(even\), got 3"):
        SC.load_study(str(bad), "x")


RAMPS = ('[groups.r]\nkind = "ramp"\nschemes = ["pre_ln", "keel"]\n'
         '[groups.long]\nkind = "ramp"\nschemes = ["pre_ln", "keel"]\n'
         '[scales.x.groups.r]\nsublayers = [2]\nseeds = [0]\npeak_lr = 0.05\nramp_steps = 10\n'
         '[scales.x.groups.long]\nsublayers = [2]\nseeds = [0]\npeak_lr = 0.1\nramp_steps = 20\n')
RAMP_CLAIM = ('[[claims]]\nid = "a"\ntitle = "t"\ntest = "max_lr_order"\ngroup = "r"\nextended_group = "long"\n'
              'order = ["pre_ln", "keel"]\n')
CLAIM = '[[claims]]\nid = "b"\ntitle = "t"\ntest = "margin_grows"\ngroups = ["g"]\nscheme = "keel"\nbaseline = "pre_ln"\n'
GROUP = '[groups.g]\nschemes = ["keel", "pre_ln"]\n[scales.x.groups.g]\nsublayers = [2]\nseeds = [0]\nlrs = [1e-3]\n'
BENCH = ('[groups.b]\nschemes = ["peri_ln"]\nbaselines_from = "g"\nbaselines = ["keel"]\n'
         '[scales.x.groups.b]\nsublayers = [2]\nseeds = [0]\nlrs = [1e-3]\n')


@pytest.mark.parametrize("text, match", [
    ("[scales.x]\n", "a study needs groups, and its claims are \\[\\[claims\\]\\] entries"),
    # a scale that sized none of the declared groups (sizes in the groups' own tables) trained nothing, exit 0
    ('[groups.g]\nschemes = ["keel", "pre_ln"]\nsublayers = [2]\nseeds = [0]\nlrs = [1e-3]\n[scales.x]\nnote = "n"\n'
     + CLAIM, "study scale 'x' sizes none of the groups \\(g\\)"),
    (GROUP + '[claims.b]\ntitle = "t"\n', "its claims are \\[\\[claims\\]\\] entries \\(an array of tables"),
    (GROUP + CLAIM.replace('id = "b"\n', ""), "needs an id"),
    (GROUP + CLAIM + CLAIM, "repeat an id"),
    (GROUP + CLAIM.replace('["g"]', '["h"]'), "group 'h' is not a group of the study"),
    (GROUP + CLAIM.replace('"margin_grows"', '"max_lr_order"'), "missing group, order"),
    (GROUP + CLAIM + "colour = 1\n", "unknown key\\(s\\) colour"),
    (GROUP + CLAIM + "note = 1\n", "note must be a string"),
    (GROUP.replace("[scales", "lr_from_steps = [0, 0]\n[scales") + CLAIM, "lr_from_steps must be .* got \\[0, 0\\]"),
    (GROUP.replace("[scales", "lr_from_steps = -1\n[scales") + CLAIM, "lr_from_steps must be .* got -1"),
    (GROUP + CLAIM.replace('baseline = "pre_ln"', 'baseline = "post_ln"'), "post_ln not trained"),
    (GROUP + CLAIM + "[verdict]\nmin_effect = -1\n", "min_effect"),
    (GROUP + "[scales.x.groups.zzz]\nseeds = [0]\n" + CLAIM, "undeclared group"),
    (GROUP.replace("[scales", 'lr_from = "g"\nlr_from_sublayers = 2\n[scales').replace("lrs = [1e-3]\n", "") + CLAIM,
     "lr_from must name another"),
    # wrong TOML types (were tracebacks, or "unknown scheme(s) k, e, e, l" for schemes = "keel")
    (GROUP.replace("lrs = [1e-3]", "lrs = 1e-3") + CLAIM, "lrs must be a list of distinct numbers > 0, got 0.001"),
    (GROUP.replace('lrs = [1e-3]', 'lrs = ["1e-3"]') + CLAIM, "lrs must be a list of distinct numbers > 0, got '1e-3'"),
    (GROUP.replace("sublayers = [2]", "sublayers = 4") + CLAIM, "sublayers must be .* integers >= 2 .* got 4"),
    (GROUP.replace("seeds = [0]", "seeds = 0") + CLAIM,
     "seeds must be a non-empty list of distinct integers between 0 and 2\\*\\*32 - 1 \\(train.seed's range\\), got 0"),
    (GROUP.replace('schemes = ["keel", "pre_ln"]', 'schemes = "keel"') + CLAIM, "schemes must be .* strings, got 'keel'"),
    (GROUP.replace("lrs = [1e-3]", "lrs = [0.0]") + CLAIM, "lrs must be a list of distinct numbers > 0, got 0.0"),
    (GROUP.replace("[scales", 'set = 1\n[scales') + CLAIM, "set must be a table of config keys"),
    (GROUP.replace("[scales", 'peak_lr = "high"\n[scales') + CLAIM, "peak_lr must be a finite number > 0, got 'high'"),
    (GROUP.replace("[scales", 'note = 1\n[scales') + CLAIM, "group 'g': note must be of type str, got 1"),
    # found by a fresh-user trial: tracebacks (ValueError, ZeroDivisionError) or values quietly changed / ignored
    (GROUP + CLAIM + '[verdict]\nmin_effect = "big"\n', "min_effect \\(a number > 0, nats\\)"),
    (GROUP + CLAIM + '[verdict]\nmin_seeds = "two"\n', "min_seeds \\(an integer >= 2\\)"),
    (GROUP + CLAIM + "[verdict]\nmin_seeds = 1.7\n", "min_seeds \\(an integer >= 2\\)"),
    (GROUP + CLAIM + "[verdict]\nmin_seeds = 1\n", "min_seeds \\(an integer >= 2\\)"),
    (GROUP + CLAIM + "[verdict]\nfloor_from_spread = 1\n", "floor_from_spread \\(true or false\\)"),
    (GROUP + CLAIM + "[verdict]\nmin_effect = nan\n", "min_effect \\(a number > 0"),
    ("verdict = 3\n" + GROUP + CLAIM, "study \\[verdict\\] takes"),
    # a user's trial: an unknown [verdict] key, an unknown scheme in a claim, named
    (GROUP + CLAIM + "[verdict]\nmin_seed = 2\n",
     "study \\[verdict\\]: unknown key\\(s\\) min_seed \\(did you mean min_seeds\\?\\) \\(it takes min_effect"),
    (GROUP + CLAIM.replace('scheme = "keel"', 'scheme = "kell"'),
     "study claim 'b': unknown scheme\\(s\\) kell \\(available: "),
    (RAMPS.replace("ramp_steps = 10", "ramp_steps = 0") + RAMP_CLAIM, "group 'r': ramp_steps must be >= 1, got 0"),
    (GROUP.replace("[scales", "peak_lr = 0.1\n[scales") + CLAIM,
     "group 'g': peak_lr belong\\(s\\) to a ramp group, not to this train group"),
    (RAMPS.replace("ramp_steps = 10", "ramp_steps = 10\nlrs = [1e-3]") + RAMP_CLAIM,
     "group 'r': lrs belong\\(s\\) to a train group, not to this ramp group"),
    (GROUP.replace("lrs = [1e-3]", "lrs = [1e-3, 1e-2]") + '[groups.t]\nschemes = ["keel"]\nlr_from = "g"\n'
     "[scales.x.groups.t]\nsublayers = [4]\nseeds = [0]\nlr_from_sublayers = 2\nlr_from_steps = [0, -5]\n" + CLAIM,
     "group 't': lr_from_steps \\[-5\\] reach past group 'g''s 2-point LR grid \\(at most 1 steps"),
    (RAMPS.replace("ramp_steps = 20", "ramp_steps = 30") + RAMP_CLAIM,
     "extended_group 'long' must continue group 'r''s ramp: the same LR per step \\(0.05 / 10 steps\\)"),
    (RAMPS.replace("peak_lr = 0.1", "peak_lr = 0.025").replace("ramp_steps = 20", "ramp_steps = 5") + RAMP_CLAIM,
     "to a higher peak, got 0.025 / 5 steps"),
    (GROUP + RAMPS + RAMP_CLAIM.replace('extended_group = "long"', 'extended_group = "g"'), "cannot read train group"),
    # baselines_from / baselines (the residual bench paired with the lr-grid): each mistake named
    # (ten different ones gave one line "must name another train group ... at this group's depths and LRs")
    (GROUP + BENCH.replace('baselines = ["keel"]\n', "") + CLAIM, "group 'b': baselines_from .* and baselines .* "
     "come together"),
    (GROUP + BENCH.replace('baselines_from = "g"\n', "") + CLAIM, "group 'b': baselines_from .* come together"),
    (GROUP + BENCH.replace('"g"', '"r"') + RAMPS + CLAIM, "baselines_from 'r' must name another train group of this "
     "scale with its own lrs \\(g\\)"),
    (GROUP + BENCH.replace('"g"', '"b"') + CLAIM, "baselines_from 'b' must name another train group"),
    (GROUP + BENCH.replace('["keel"]', '["preln"]') + CLAIM, "baselines name an unknown scheme \\(preln; available: "),
    (GROUP + BENCH.replace('["keel"]', '["keel", "keel"]') + CLAIM,
     "baselines must be a list of distinct strings, got \\['keel', 'keel'\\]"),
    (GROUP + BENCH.replace('["keel"]', '["post_ln"]') + CLAIM, "group 'g' \\(baselines_from\\) trains no schemes post_ln"),
    (GROUP + BENCH.replace("sublayers = [2]", "sublayers = [4]") + CLAIM, "trains no sub-layers 4; the pairs need them"),
    (GROUP + BENCH.replace("lrs = [1e-3]", "lrs = [1e-3, 1e-2]") + CLAIM, "trains no LRs 0.01"),
    (GROUP + BENCH.replace("seeds = [0]", "seeds = [0, 5]") + CLAIM, "trains no seeds 5"),
    (GROUP + BENCH.replace("[scales.x.groups.b]", 'set = { "train.steps" = 12 }\n[scales.x.groups.b]') + CLAIM,
     "group 'b': its set \\(train.steps=12\\) differs from group 'g''s \\(none\\); paired runs must train the same"),
    (GROUP + BENCH.replace('baselines = ["keel"]', 'baselines = "keel"') + CLAIM,
     "baselines must be a list of distinct strings, got 'keel'"),
    (GROUP + BENCH.replace('baselines_from = "g"', "baselines_from = 1") + CLAIM, "baselines_from must be of type str"),
    (RAMPS.replace("ramp_steps = 10", 'ramp_steps = 10\nbaselines = ["keel"]') + RAMP_CLAIM,
     "group 'r': baselines belong\\(s\\) to a train group"),
    # a key the grid sets per run, in a group's set, was accepted and silently overridden (report.md listed it)
    (GROUP.replace("[scales", 'set = { "model.n_layers" = 3 }\n[scales') + CLAIM,
     "group 'g': set model.n_layers: the group's schemes, sublayers, lrs and seeds set it per run"),
    # a train or ramp group's set of data.* keys was silently ignored: its runs trained on the study's one dataset
    (GROUP.replace("[scales", 'set = { "data.max_bytes" = 300000 }\n[scales') + CLAIM,
     "group 'g': set data.max_bytes: the runs of a train group share the study's one dataset"),
    (RAMPS.replace("ramp_steps = 10", 'ramp_steps = 10\nset = { "data.tokenizer" = "bpe:512" }') + RAMP_CLAIM,
     "group 'r': set data.tokenizer: the runs of a ramp group share the study's one dataset"),
    # reliability v4: files of the wrong shape were tracebacks (or, for note = 7, a failure after every run)
    ("scales = 5\n" + GROUP.split("[scales")[0] + CLAIM, "scales must be a table, got 5"),
    ("[groups]\nx = 5\n", "\\[groups.x\\] must be a table, got 5"),
    (GROUP + "[scales.x.groups]\ninit = 5\n" + CLAIM, "\\[scales.x.groups.init\\] must be a table"),
    ('description = 5\n' + GROUP + CLAIM, "description must be text, got 5"),
    (GROUP + "[scales.x]\nnote = 7\n" + CLAIM, "\\[scales.x\\] note must be text, got 7"),
    (GROUP + "[scales.x]\nset = 5\n" + CLAIM, "scale 'x': set must be a table of config keys, got 5"),
    (GROUP + '[scales.x.set]\n"train.lr" = 0.1\n' + CLAIM, "scale 'x': set train.lr: the groups'"),
    (GROUP + CLAIM.replace('scheme = "keel"', 'scheme = ["keel"]'), "scheme must be a string, got \\['keel'\\]"),
    (GROUP + CLAIM.replace('id = "b"', 'id = ["b"]'), "id must be a string"),
    (GROUP.replace('[groups.g]', '[groups.g]\nkind = "ramp"').replace("lrs = [1e-3]\n", "")
     + '[[claims]]\nid = "a"\ntitle = "t"\ntest = "max_lr_order"\ngroup = "g"\norder = "post_ln"\n',
     "order must be a list of two or more scheme names"),
])
def test_bad_study_files(tmp_path, text, match):
    p = tmp_path / "s.toml"
    p.write_text(text)
    with pytest.raises(KeelError, match=match):
        SC.load_study(str(p), "x")
    with pytest.raises(KeelError, match="set by the study's groups"):
        SC.load_study("claims", "tiny", ["model.residual=keel"])


def test_a_bad_key_in_a_groups_set_names_the_group_and_an_empty_scales_table_is_named(tmp_path, keel_main):
    """A user's trial: a bad key in a group's own `set` was refused as if it were a --set (no group named), and
    a [scales] table with no scale said "has scales (): give one with --scale"."""
    p = tmp_path / "s.toml"
    p.write_text('[groups.g]\nschemes = ["keel", "pre_ln"]\nsublayers = [4]\nseeds = [0]\nlrs = [1e-3]\n'
                 'set = { "train.steps" = -1 }\n')
    r = keel_main("study", p, "--dry-run", "--out", tmp_path / "o")
    assert r.returncode == 2 and r.stderr == ("keel: error: study group 'g' (its set train.steps=-1): train.steps must "
                                              "be between 1 and 1e+12, got -1\n"), r.stderr
    r = keel_main("study", p, "--dry-run", "--out", tmp_path / "o", "--set", "train.steps=0")  # the --set's own words
    assert r.returncode == 2 and r.stderr == "keel: error: train.steps must be between 1 and 1e+12, got 0\n", r.stderr
    p.write_text('[groups.g]\nschemes = ["keel"]\nsublayers = [4]\nseeds = [0]\nlrs = [1e-3]\n[scales]\n')
    r = keel_main("study", p, "--dry-run", "--out", tmp_path / "o")
    assert r.returncode == 2 and "has a [scales] table with no scale in it: add [scales.NAME] tables" in r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "o").exists()


@pytest.mark.parametrize("line, message", [
    ("lrs = 1e-3", "lrs must be a list of distinct numbers > 0, got 0.001"),  # a list key given one value
    ('seeds = [0, "1"]', "seeds must be a non-empty list of distinct integers between 0 and 2**32 - 1 (train.seed's "
     "range), got '1'"),  # a bad item: named
    # a user's trial: a negative seed was refused by the run's config, as train.seed, naming neither group nor key
    ("seeds = [-1, 1]", "seeds must be a non-empty list of distinct integers between 0 and 2**32 - 1 (train.seed's "
     "range), got -1"),
    ("lrs = [1e-3, -1e-3]", "lrs must be a list of distinct numbers > 0, got -0.001"),  # every LR > 0
    ("lrs = [1e-3, 1e-3]", "lrs must be a list of distinct numbers > 0, got [0.001, 0.001]"),
    ("sublayers = [2, true]", "sublayers must be a non-empty list of distinct integers >= 2 (even), got True"),
    ("ramp_steps = 1.5", "ramp_steps must be an integer >= 1, got 1.5"),
    ("widen = -1", "widen must be >= 0 (LRs added per side), got -1"),
    ('kind = "grd"', "kind must be 'train' | 'ramp' | 'grid', got 'grd'"),
    ('kind = "grid"', "lrs, schemes, seeds, sublayers belong(s) to a train group, not to this grid group"),
    ("seeds_for = { keel = [] }", "seeds_for must be a table of non-empty lists of distinct integers between 0 and "
     "2**32 - 1 (scheme = [seeds], in train.seed's range), got {'keel': []}"),
    ("lrss = [1e-3]", "unknown key(s) lrss (did you mean lrs?)"),  # as an unknown config key is refused
    ("colour = 1", "unknown key(s) colour"),
])
def test_a_bad_group_key_is_one_line_naming_the_group(tmp_path, line, message):
    """Each key of a study group is checked by its declaration (keel.keys.check_key on spec.Group)."""
    p = tmp_path / "s.toml"
    p.write_text(re.sub(f"^{line.split(' = ')[0]} = .*\n", "", GROUP, flags=re.M) + line + "\n" + CLAIM)  # in the scale
    with pytest.raises(KeelError) as e:
        SC.load_study(str(p), "x")
    assert str(e.value) == f"study group 'g': {message}"


def test_a_new_kind_of_group_is_one_class_registered_where_it_is_defined(tmp_path):
    """Issue code v4: a group kind costs one place. A class decorated with kinds.group_kind (here
    defined outside keel, before the study spec is imported, as a class of kinds.py is) is a kind a
    study file may name: Group.kind takes every registered name, its help says what each is, and the
    group's kind_class is the new class. (The kind names were a Literal spelled in spec.py too.)"""
    p = tmp_path / "s.toml"
    p.write_text(GROUP.replace("[scales", 'kind = "toy"\n[scales'))
    script = f"""
from keel.experiments.study import kinds as K
@K.group_kind
class ToyKind(K.TrainKind):
    name = "toy"
    summary = "a toy kind"
from keel.experiments.study import spec
study = spec.read_study({str(p)!r}, "x")
from keel.keys import key_field
print(study.groups[0].kind_class.__name__, "|", key_field(spec.Group, "kind").metadata["help"])
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, check=True)
    kind_class, help_text = out.stdout.strip().split(" | ")
    assert kind_class == "ToyKind"
    assert help_text.endswith("; toy, a toy kind."), help_text
    with pytest.raises(KeelError, match="kind must be 'train' \\| 'ramp' \\| 'grid', got 'toy'"):
        SC.load_study(str(p), "x")  # in this process no toy kind was registered


def _named(name: str) -> str:
    """GROUP and CLAIM with the group called ``name`` (a TOML quoted key)."""
    return GROUP.replace("groups.g]", f'groups."{name}"]') + CLAIM.replace('["g"]', f'["{name}"]')


@pytest.mark.parametrize("text, message", [
    # a group name is the folder of its runs under --out: "../escape" wrote them to OUT/../escape
    *[(_named(n), f"study 's': group name {n!r} must be a simple name (letters, digits, _ . -, starting with a "
       "letter or digit): it names the folder of its runs under --out") for n in ("../escape", "a/b", ".", "..", "/abs")],
    # unknown keys of a [scales.S] table were ignored
    (GROUP + '[scales.x.sett]\n"train.steps" = 3\n' + CLAIM,
     "study 's': [scales.x] unknown key(s) sett (did you mean set?) (it takes note, set, groups)"),
    (GROUP + '[scales.x]\nnotes = "x"\n' + CLAIM,
     "study 's': [scales.x] unknown key(s) notes (did you mean note?) (it takes note, set, groups)"),
    (GROUP + "[scales.x]\nseeds = [0]\n" + CLAIM, "study 's': [scales.x] unknown key(s) seeds (it takes note, set, groups)"),
    # claims: a key that named nothing, or named a scheme twice, was accepted
    (RAMPS + RAMP_CLAIM.replace('"long"', '"zz"'),
     "study 's': claim 'a': extended_group 'zz' names no group of the study (groups: r, long)"),
    (RAMPS + RAMP_CLAIM.replace('["pre_ln", "keel"]', '["keel", "keel"]'),
     "study claim 'a': order must be a non-empty list of distinct strings (two or more scheme names), got ['keel', 'keel']"),
    (GROUP + CLAIM.replace('baseline = "pre_ln"', 'baseline = "keel"'),
     "study claim 'b': scheme and baseline are both 'keel'; the margin is between two different schemes"),
    # groups: lr_from's keys given without it, or lrs given with it (ignored)
    (GROUP.replace("[scales", '[groups.t]\nschemes = ["keel"]\nlr_from = "g"\n[scales') + CLAIM
     + "[scales.x.groups.t]\nsublayers = [4]\nseeds = [0]\nlr_from_sublayers = 2\nlrs = [1e-3]\n",
     "study group 't': lrs is ignored with lr_from (the group trains lr_from's optimum and its lr_from_steps); give one"),
    (GROUP.replace("[scales", "lr_from_steps = [0]\n[scales") + CLAIM,
     "study group 'g': lr_from_steps need(s) lr_from (the train group whose optimal LR it trains)"),
    (GROUP.replace("[scales", "lr_from_sublayers = 2\n[scales") + CLAIM,
     "study group 'g': lr_from_sublayers need(s) lr_from (the train group whose optimal LR it trains)"),
])
def test_a_study_key_that_would_be_ignored_or_escape_out_is_refused(tmp_path, text, message):
    """Found by a fresh user: each was accepted silently (the runs of group "../escape" written
    outside --out); each is now one line naming the study, group or claim and the key."""
    p = tmp_path / "s.toml"
    p.write_text(text)
    with pytest.raises(KeelError) as e:
        SC.load_study(str(p), "x")
    assert str(e.value) == message


def test_a_study_file_that_is_not_utf8(tmp_path):
    p = tmp_path / "bin.toml"
    p.write_bytes(b"\xff\xfe[groups]\n")
    with pytest.raises(KeelError, match="cannot read study .*bin.toml: not UTF-8 text"):
        SC.load_study(str(p), "x")


def test_set_wins_over_a_groups_own_keys(tmp_path):
    """`--set` reaches every run, as --help says: it used to lose to a group's `set` (the
    showcase kept its own train.steps, the init group its embed_init_std)."""
    st = SC.load_study("claims", "tiny", ["train.steps=7", "model.embed_init_std=0.5"])
    for name in ("showcase", "init", "lr-grid"):
        g = next(x for x in st.groups if x.name == name)
        _, jobs = SLrs.group_jobs(st, g, "unused", tmp_path)
        assert {(j.config["train"]["steps"], j.config["model"]["embed_init_std"]) for j in jobs} == {(7, 0.5)}
    plain = SC.load_study("claims", "tiny")
    g = next(x for x in plain.groups if x.name == "showcase")
    assert {j.config["train"]["steps"] for j in SLrs.group_jobs(plain, g, "unused", tmp_path)[1]} == {4}


def test_study_command_is_the_one_that_trains_everything():
    """The report's Command line was the first invocation, e.g. with `--groups ramp`."""
    from keel.cli.commands.science import study_command

    argv = ["claims", "--scale", "cpu", "--workers", "2", "--out", "runs/a b", "--resume", "--groups", "ramp,init",
            "--json", "--groups=init"]
    assert study_command(argv) == "keel study claims --scale cpu --workers 2 --out 'runs/a b'"


def test_report_says_its_command_trains_the_whole_study():
    """report.md's `Command: keel study claims ... --out runs/st` of a folder started with
    `--groups ramp` read as the command that was run; it says what it is now."""
    from keel.experiments.study.report import report_markdown

    md = report_markdown(SC.load_study("claims", "tiny"), [], [], "keel study claims --scale tiny --out runs/st")
    assert ("\nCommand (it trains every run of the study; flags that pick what one call trains, such as `--groups` "
            "and `--resume`, are left out): `keel study claims --scale tiny --out runs/st`\n") in md


def test_a_folder_stopped_before_its_first_run_starts_again_without_resume(tmp_path):
    """Ctrl-C before the first grid left only study.json: the same command was then refused as
    "not empty; use --resume"."""
    st = SC.load_study("claims", "tiny")
    out = tmp_path / "s"
    assert SRun._claim_out(out, st, "keel study claims --scale tiny --groups ramp", resume=False, report_only=False)
    assert SRun._claim_out(out, st, "keel study claims --scale tiny", resume=False,
                         report_only=False) == "keel study claims --scale tiny"
    (out / "ramp").mkdir()
    with pytest.raises(KeelError, match="is not empty; use --resume"):
        SRun._claim_out(out, st, "keel study claims --scale tiny", resume=False, report_only=False)
    # a folder of other files: --resume is refused there too, so it is not advised (a user's trial)
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("x")
    with pytest.raises(KeelError, match=r"is not empty and holds no study \(no study.json\); give an empty or new --out$"):
        SRun._claim_out(other, st, "keel study claims --scale tiny", resume=False, report_only=False)
    with pytest.raises(KeelError, match="holds no study"):
        SRun._claim_out(other, st, "keel study claims --scale tiny", resume=True, report_only=False)


def test_out_belongs_to_one_study_and_scale(tmp_path, keel_main):
    (tmp_path / "file").write_text("x")
    with pytest.raises(KeelError, match="not a folder"):
        SRun.run_study("claims", "tiny", tmp_path / "file", resume=True)
    with pytest.raises(KeelError, match="holds no study"):
        SRun.run_study("claims", "tiny", tmp_path / "nothing", report_only=True)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "study.json").write_text(json.dumps({"study": "claims", "scale": "cpu"}))
    with pytest.raises(KeelError, match="holds study 'claims' at scale 'cpu'"):
        SRun.run_study("claims", "tiny", tmp_path / "other", resume=True)
    r = keel_main("study", "claims", "--scale", "tiny", "--threads", "-2", "--workers", "0", "--out", tmp_path / "t")
    assert r.returncode == 2 and "--threads must be >= 0" in r.stderr and "Traceback" not in r.stderr
    # a bad --set is refused before the folder is claimed (was: study.json written, the fixed command refused)
    with pytest.raises(KeelError, match="train.compile must be true or false"):
        SRun.run_study("claims", "tiny", tmp_path / "bad-set", ["train.compile=maybe"])
    assert not (tmp_path / "bad-set").exists()


def test_interrupted_run_without_checkpoint_trains_again(tiny_config, tmp_path, caplog):
    """A grid job killed before its first checkpoint (history, no intact checkpoint) is trained
    again on resume; before, the study's --resume failed on it forever ("pass --restart")."""
    from keel.config import dump_config
    from keel.experiments.sweep import train_task

    cfg = tiny_config(steps=6, checkpoint_every=100, eval_every=6, sample_tokens=0)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    dump_config(cfg, run_dir / "config.toml")  # a keel run writes it before its metrics (another tool's folder: refused)
    (run_dir / "metrics.jsonl").write_text('{"step": 0, "tokens": 0, "val_loss": 6.2}\n'
                                           '{"step": 1, "tokens": 128, "loss": 6.2}\n')
    with caplog.at_level("INFO", logger="keel"):
        out = train_task(GridJob("run", cfg.to_dict()), run_dir, True)
    assert out["step"] == 6 and out["final_val_loss"] is not None
    assert any("no intact checkpoint to resume from" in r.getMessage() for r in caplog.records)  # logged
    assert out["note"] == "trained again from step 0: it had no intact checkpoint"  # on the grid's progress line
    assert "note" not in train_task(GridJob("run", cfg.to_dict()), run_dir, True)  # finished: nothing restarted
    fresh = tmp_path / "never-started"  # a resumed grid's job that never started: trained, not "trained again"
    fresh.mkdir()
    with caplog.at_level("INFO", logger="keel"):
        caplog.clear()
        out = train_task(GridJob("fresh", cfg.to_dict()), fresh, True)
    assert out["step"] == 6 and "note" not in out
    assert not any("no intact checkpoint" in r.getMessage() for r in caplog.records)


def test_grid_worker_dies_with_its_parent(tmp_path):
    """kill -9 of a grid process must not leave its workers training (PR_SET_PDEATHSIG)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    pid_file = tmp_path / "child.pid"
    child = ("from keel.io import die_with_parent; import os, time; die_with_parent(); "
             f"open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(120)")
    parent_code = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {child!r}]); time.sleep(120)"
    parent = subprocess.Popen([sys.executable, "-c", parent_code])
    for _ in range(600):
        if pid_file.is_file() and pid_file.read_text():
            break
        time.sleep(0.1)
    pid = int(pid_file.read_text())
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    for _ in range(100):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
        time.sleep(0.1)
    else:
        os.kill(pid, signal.SIGKILL)
        pytest.fail("the worker outlived its killed parent")


def test_grid_accepts_a_job_stored_before_a_new_config_key(tmp_path):
    """A run started before a config key existed (its job.json lacks it) is the same run when the
    new key holds its default; failed before the grid filled in defaults (a resumed study would
    refuse every cached run after a keel upgrade)."""
    cfg = Config().to_dict()
    old = json.loads(json.dumps(cfg))
    del old["model"]["mix_ln_ratio"], old["train"]["max_bad_steps"]  # as if written before these keys existed
    (tmp_path / "job.json").write_text(json.dumps({"name": "r", "config": old, "values": {}}))
    _check_same_config(tmp_path, GridJob("r", cfg))
    cfg["model"]["mix_ln_ratio"] = 0.5
    with pytest.raises(KeelError, match="model.mix_ln_ratio"):
        _check_same_config(tmp_path, GridJob("r", cfg))


@pytest.mark.long
def test_study_tiny_end_to_end(keel_cli, keel_main, tiny_data, tmp_path):
    out = tmp_path / "study"
    args = ["study", "claims", "--scale", "tiny", "--workers", "0", "--out", out, "--set", f"data.path={tiny_data}"]
    r = keel_cli(*args)
    assert r.returncode == 0, r.stderr
    rep = json.loads((out / "report.json").read_text())
    assert [c["id"] for c in rep["claims"]] == ["a", "b", "c", "d", "h"] and len(rep["summary"]) == 5
    assert all(c["verdict"] in (R, NR, INC) for c in rep["claims"])
    assert all(x["status"] == "done" and x["tokens"] == 6 * 4 * 32 or x["group"] in ("showcase", "ramp-long", "spike")
               for x in rep["runs"])
    assert all(len(x["curve"]["step"]) > 0 for x in rep["runs"])  # a thinned curve per run, for a restored report
    # an lr-grid cell whose best LR sat on an edge of 1e-3, 1e-2 was widened by one LR (widen = 1)
    grid = {(x["scheme"], x["sublayers"]): set() for x in rep["runs"] if x["group"] == "lr-grid"}
    for x in rep["runs"]:
        if x["group"] == "lr-grid":
            grid[(x["scheme"], x["sublayers"])].add(x["lr"])
    assert all(len(v) in (2, 3) for v in grid.values()) and any(len(v) == 3 for v in grid.values())
    # ramp-long continues the ramp at the same LR per step: its runs repeat the ramp's steps exactly
    for name in ("keel-4sl-seed0", "pre_ln-4sl-seed0"):
        short, long = (read_metrics(out / g / name / "metrics.jsonl") for g in ("ramp", "ramp-long"))
        losses = [[(r["step"], r["lr"], r["loss"]) for r in m if "loss" in r] for m in (short, long)]
        assert len(losses[1]) == 12 and losses[1][:6] == losses[0]
    # the transfer group ran each scheme at the optimum of the LR grid at 4 sub-layers
    b = next(c for c in rep["claims"] if c["id"] == "b")
    rows = b["conditions"]["paper_init"]["rows"]
    assert [row["sublayers"] for row in rows] == [2, 4, 8]
    assert [row["sublayers"] for row in b["conditions"]["embed_init"]["rows"]] == [2, 4, 8]
    # the spike group (ablate = true): every run keeps its early spike and a ΔPPL per sub-layer
    spike = [x for x in rep["runs"] if x["group"] == "spike"]
    assert len(spike) == 8 and all(x["early_spike"] >= 0 for x in spike)
    assert all(len(x["ablation"]["delta_ppl"]) == 4 and x["ablation"]["ppl_full"] > 1 for x in spike)
    h = next(c for c in rep["claims"] if c["id"] == "h")
    assert len(h["rows"]) == 2 and "spike(pre_ln) − spike(keel) at 4, keel's healthy LRs" in h["parts"]
    # one block: Keel (first-layer rule, outer norm = final norm) is Pre-LN exactly -> margin 0 at 2 sub-layers
    assert all(abs(x) < 1e-6 for x in rows[0]["margin"]["diffs"].values())
    md = (out / "report.md").read_text()
    assert "## Verdicts" in md and "plateau exit step" in md and "## Summary" in md
    assert "Not judged at this scale (it does not size the groups they read): (e): tokens-quarter" in md
    # the bench is paired seed by seed with the lr-grid's schemes at its depth, each side at its best over
    # every LR its group trained (a widened one too)
    bm = [x for x in rep["baseline_margins"] if x["group"] == "bench"]
    assert len(bm) == 4 * 3 and all(x["margin"]["n"] == 2 and x["sublayers"] == 4 for x in bm)

    def best(group, scheme, seed):
        return min(x["capped_loss"] for x in rep["runs"] if (x["group"], x["scheme"], x["sublayers"], x["seed"])
                   == (group, scheme, 4, seed))
    row = next(x for x in bm if (x["scheme"], x["baseline"]) == ("mhc", "pre_ln"))
    assert row["margin"]["diffs"]["1"] == pytest.approx(best("lr-grid", "pre_ln", 1) - best("bench", "mhc", 1))
    assert "| sub-layers | scheme | vs keel | vs pre_ln | vs post_ln |" in md and "\n| 4 | attn_res | " in md
    assert "bench.png" in rep["plots"]
    assert all((out / p).stat().st_size > 1000 for p in rep["plots"]) and "margins.png" in rep["plots"]
    again = keel_main(*args, "--resume")
    assert again.returncode == 0 and "0 to run" in again.stderr and "Traceback" not in again.stderr
    assert keel_main(*args).returncode == 2  # not empty without --resume
    # --report-only needs no dataset (it used to prepare one, at gpu-1 scale a download) and takes no --set
    rep_only = keel_main(*args[:-2], "--report-only", "--json", cwd=tmp_path)
    assert rep_only.returncode == 0 and json.loads(rep_only.stdout)["claims"][1]["verdict"] == b["verdict"]
    assert json.loads((out / "report.json").read_text())["unigram_entropy"] == rep["unigram_entropy"]
    assert not (tmp_path / "data").exists()
    refused = keel_main(*args[:-2], "--report-only", "--set", "train.eval_tokens=512")
    assert refused.returncode == 2 and "do not combine it with --set" in refused.stderr


def test_groups_flag_trains_only_the_named_groups(keel_main, tiny_data, tmp_path):
    """`--groups init,showcase` trains those groups and only reads the rest, so a long study
    can run its cheap groups first; the report still lists every group's runs."""
    out = tmp_path / "study"
    r = SRun.run_study("claims", "tiny", out, [f"data.path={tiny_data}"], workers=0, groups=["showcase", "init"])
    status = {}
    for x in r["runs"]:
        status.setdefault(x["group"], set()).add(x["status"])
    assert status == {"lr-grid": {"pending"}, "ramp": {"pending"}, "ramp-long": {"pending"}, "init": {"done"},
                      "showcase": {"done"}, "transfer-init": {"pending"}, "spike": {"pending"},
                      "bench": {"pending"}}  # transfer: waits for the lr-grid, not planned
    assert any(w["group"] == "transfer" and w["source"] == "lr-grid" for w in r["waiting"])
    bad = keel_main("study", "claims", "--scale", "tiny", "--out", tmp_path / "x", "--groups", "init,nope")
    assert bad.returncode == 2 and "has no group(s) nope (groups: lr-grid, transfer, ramp" in bad.stderr
    assert "Traceback" not in bad.stderr and not (tmp_path / "x").exists()
    both = keel_main("study", "claims", "--scale", "tiny", "--out", out, "--groups", "init", "--report-only")
    assert both.returncode == 2 and "do not combine it with --report-only" in both.stderr


def test_report_tells_ramp_budgets_from_training_budgets():
    """The count line listed every distinct token count (282,624, 306,176, ... 1,024,000), so a
    ramp run stopped at its divergence read like a training run short of the 1M budget."""
    s = SC.load_study("claims", "cpu")
    done = [run("lr-grid", "keel", 16, 0, 1e-2, 3.0, tokens=1_024_000),
            run("showcase", "keel", 1024, 0, 3e-3, 5.0, tokens=153_600),
            run("ramp", "post_ln", 64, 0, 5e-2, 0, tokens=306_176), run("ramp", "keel", 64, 0, 5e-2, 0, tokens=1_024_000)]
    assert SR.tokens_words(s, done) == (" (tokens per finished run: training runs 153,600, 1,024,000; "
                                        "ramp runs 306,176–1,024,000 (a ramp run stops at its divergence))")
    assert SR.tokens_words(s, done[:1]) == " (tokens per finished run: training runs 1,024,000)"
    assert SR.tokens_words(s, []) == ""


def test_study_flags_refused_before_anything_is_written(keel_main, tmp_path):
    """Each mistake is one line, exit 2, and leaves no folder behind (a bad --workers used to
    leave study.json, so the corrected command was refused as "not empty")."""
    base = ["study", "claims", "--scale", "tiny"]
    cases = [(["--groups", "", "--out", tmp_path / "a"], "--groups needs group names"),
             (["--groups", ",", "--out", tmp_path / "a"], "--groups needs group names"),
             (["--workers", "-1", "--out", tmp_path / "a"], "--workers must be >= 0"),
             (["--dry-run", "--peak-tflops", "nan"], "--peak-tflops a finite number > 0"),
             (["--dry-run", "--workers", "-1"], "--workers must be >= 0"),  # the plan used to accept it
             (["--out", ""], "--out is empty: give an output folder")]
    for extra, message in cases:
        r = keel_main(*base, *extra)
        assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, (extra, r.stderr)
    assert not (tmp_path / "a").exists()
    plan = json.loads(keel_main(*base, "--dry-run", "--json").stdout)  # was a bare list of groups, with no totals
    # lr-grid 24, transfer 6, ramp 4, ramp-long 2, init 24 (2 depths), transfer-init 6, showcase 3, spike 8, bench 16
    assert plan["total"]["runs"] == sum(g["runs"] for g in plan["groups"]) == 93 and plan["total"]["references"] == 2
    r = keel_main("study", "", "--scale", "tiny", "--dry-run")  # said "unknown study 'demo'"
    assert r.returncode == 2 and "the study name is empty" in r.stderr and "Traceback" not in r.stderr
    # --resume on a folder that is not a study's (e.g. one of its groups, as the grid's stop hint named it)
    (tmp_path / "group").mkdir()
    (tmp_path / "group" / "L4_seed0_keel_lr0.01").mkdir()
    r = keel_main(*base, "--resume", "--out", tmp_path / "group")
    assert r.returncode == 2 and "holds no study (no study.json) but is not empty; check --out" in r.stderr
    assert not (tmp_path / "group" / "study.json").exists()


def test_dry_run_prices_the_named_groups():
    """--groups with --dry-run plans only those groups; the H100 is named only for its own peak."""
    full = SRun.run_study("claims", "paper", "unused", dry_run=True)
    part = SRun.run_study("claims", "paper", "unused", dry_run=True, groups=["ramp", "init"], peak_tflops=1978)
    assert [r["group"] for r in part["plan"]] == ["ramp", "init"]
    assert part["total"]["runs"] == sum(r["runs"] for r in part["plan"]) and part["total"]["gpu_hours"] == \
        pytest.approx(sum(r["gpu_hours"] for r in part["plan"]))
    ramp = next(r for r in full["plan"] if r["group"] == "ramp")
    assert next(r for r in part["plan"] if r["group"] == "ramp")["gpu_hours"] == pytest.approx(ramp["gpu_hours"] / 2)
    assert "1978 TFLOP/s dense bf16;" in part["markdown"] and "H100" not in part["markdown"]
    assert "989 TFLOP/s dense bf16, an H100 SXM;" in full["markdown"]


def test_dry_run_says_what_compile_adds_per_run():
    """A grid that compiles (train.compile) says in its plan what compile adds per run and in all; one that
    does not says nothing of it (the plan used to be silent either way)."""
    from keel.experiments.study.plan import COMPILE_CPU_S

    eager = SRun.run_study("claims", "cpu", "unused", dry_run=True, groups=["transfer"])
    assert "train.compile" not in eager["markdown"] and eager["plan"][0]["compiled"] == 0
    got = SRun.run_study("claims", "cpu", "unused", ["train.compile=true"], dry_run=True, groups=["transfer"])
    n = got["plan"][0]["compiled"]
    assert n == got["total"]["runs"] + got["total"]["references"] > 0
    assert (f"train.compile is on for {n} of these runs: each compiles its blocks when it starts, about "
            f"{COMPILE_CPU_S['cold']:.0f} s of CPU on a cold cache") in got["markdown"]
    assert f"at most {n * COMPILE_CPU_S['cold'] / 3600:.2g} CPU-hours in all" in got["markdown"]


def test_dry_run_with_restore_plans_the_widened_lrs_and_prices_what_is_left():
    """With the committed CPU report restored, the plan said 319 runs and "323 of these runs are
    restored" (its table left out the LRs the restored runs widened), and priced all 319."""
    report = Path(__file__).resolve().parents[1] / "docs" / "results" / "study-cpu" / "report.json"
    rep = json.loads(report.read_text())
    got = SRun.run_study("claims", "cpu", "unused", dry_run=True, restore=report)
    # a run of an older implementation of its scheme (its `version` has risen since: AttnRes 2) is not restored
    current = [r for r in rep["runs"]
               if r["status"] == "done" and r.get("scheme_version", 1) == SCHEMES[r["scheme"]].version]
    tot, done = got["total"], len(current)
    assert got["restored"] == tot["restored"] == done and done <= tot["runs"]
    assert all(r["restored"] <= r["runs"] for r in got["plan"])
    per_group = {g: sum(r["group"] == g for r in current) for g in {r["group"] for r in current}}
    # every run of the report is planned and restored (LR widening included); the plan may add runs the report
    # lacks (groups and seeds added since, cells widened by the restored runs' optima)
    assert {r["group"]: r["restored"] for r in got["plan"] if r["group"] in per_group} == per_group
    left = [r for r in got["plan"] if r["restored"] < r["runs"]]
    assert all(r["gpu_hours_left"] > 0 for r in left) and tot["gpu_hours_left"] < tot["gpu_hours"]
    assert all(r["gpu_hours_left"] == 0 for r in got["plan"] if r not in left)  # references of restored runs too
    assert f"{done} of these runs are restored from {report} and would not train: about " in got["markdown"]


def test_dry_run_of_a_study_whose_vocab_size_is_auto(tmp_path):
    """model.vocab_size = "auto" (the demo base's default) is resolved only once the tokenizer
    exists; --dry-run used to refuse such a study with a Python hint."""
    p = tmp_path / "s.toml"
    p.write_text(GROUP + CLAIM + '[scales.x.set]\n"model.vocab_size" = "auto"\n')
    plan = SRun.run_study(str(p), "x", tmp_path / "out", dry_run=True)["plan"]
    assert plan[0]["runs"] == 2 and plan[0]["gpu_hours"] > 0 and not (tmp_path / "out").exists()


@pytest.mark.parametrize("hours, words", [(0.000531, "0.00053"), (0.25, "0.25"), (1.0, "1.0"), (6.63, "6.6"),
                                          (990_123.4, "990,123.4")])
def test_plan_gpu_hours_words(hours, words):
    """The cpu-scale plan read "about 0.0 GPU-hours" for every group."""
    assert SPlan.hours_words(hours) == words


def test_ctrl_c_says_how_to_continue_the_study(tiny_data, tmp_path):
    """SIGINT during a run of `keel study --workers 0`: the hint names the study's command and
    folder, not `keel train --resume <one run>` or a group's folder."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    out = tmp_path / "study"
    exe = Path(sys.executable).parent / "keel"
    proc = subprocess.Popen([str(exe), "study", "claims", "--scale", "tiny", "--workers", "0", "--out", str(out),
                             "--set", f"data.path={tiny_data}", "--set", "train.steps=100000"],
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    from conftest import HANG_S

    deadline = time.time() + HANG_S
    while time.time() < deadline and not list(out.glob("lr-grid/*/metrics.jsonl")):
        time.sleep(0.2)
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=HANG_S)
    assert proc.returncode == 130, err
    assert f"continue: the same command with --resume (out {out})" in err
    assert "keel train --resume" not in err and "Traceback" not in err


def test_baseline_margins_pair_each_seed_over_every_lr_each_group_trained(tmp_path):
    """The bench's margin against a baseline = the baseline's best loss minus the scheme's, per seed,
    each side over every LR its own group trained: the baseline's better loss at an LR the bench did
    not plan (3e-4) counts, and so does the bench's LR added beyond its grid's edge (3e-4 for
    peri_ln seed 0, 3e-2 for seed 1); a seed with an unfinished run is left out; a best LR on an
    edge of the LRs trained is named under the table. (Over the bench's planned grid alone, the
    widened runs were trained and never read: seed 0 read 3.10 − 3.00.)"""
    p = tmp_path / "s.toml"
    p.write_text(GROUP.replace("lrs = [1e-3]", "lrs = [3e-4, 1e-3, 1e-2]").replace("seeds = [0]", "seeds = [0, 1, 2]")
                 + BENCH.replace("lrs = [1e-3]", "lrs = [1e-3, 1e-2]").replace("seeds = [0]", "seeds = [0, 1, 2]")
                 + CLAIM)
    st = SC.load_study(str(p), "x")
    bench = next(g for g in st.groups if g.name == "b")
    keel = {0: (3.05, 3.10, 3.30), 1: (3.60, 3.20, 3.30), 2: (3.50, 3.10, 3.20)}  # at 3e-4, 1e-3, 1e-2
    peri = {0: {3e-4: 2.95, 1e-3: 3.00, 1e-2: 3.40}, 1: {1e-3: 3.30, 1e-2: 3.05, 3e-2: 3.10},
            2: {1e-3: 3.0, 1e-2: 3.0}}
    runs = [run("g", "keel", 2, sd, lr, x) for sd, xs in keel.items() for lr, x in zip((3e-4, 1e-3, 1e-2), xs)]
    runs += [run("b", "peri_ln", 2, sd, lr, x) for sd, d in peri.items() for lr, x in d.items()]
    runs[-1].status = "running"  # seed 2 of peri_ln unfinished
    rows = SV.baseline_margins(st, bench, runs)
    assert [(r.sublayers, r.scheme, r.baseline) for r in rows] == [(2, "peri_ln", "keel")]
    m = rows[0].margin
    assert m.diffs == pytest.approx({0: 3.05 - 2.95, 1: 3.20 - 3.05})
    assert m.verdict == INC and m.n == 2  # two seeds: the t interval (6.314 x sd / sqrt 2) spans 0
    table = SR.baseline_table(st, bench, runs)
    assert table[2:4] == ["| sub-layers | scheme | vs keel |", "|---|---|---|"]
    assert table[4] == "| 2 | peri_ln | +0.125 [90% CI -0.033, +0.283] (s0 +0.100, s1 +0.150) (undecided) |"
    assert table[6] == ("Best LR on an edge of the LRs trained (not bracketed): peri_ln s0 (0.0003, group b), "
                        "keel s0 (0.0003, group g).")
    assert SV.baseline_margins(st, next(g for g in st.groups if g.name == "g"), runs) == []


def test_a_best_lr_at_an_edge_of_the_lrs_trained_is_marked():
    """(b) and (c) read each seed's best LR at 256 sub-layers from two transferred LRs, where the
    best is always an edge (Pre-LN the top, Keel the bottom), and the report did not say so."""
    runs = [run("g", "keel", 64, 0, lr, loss) for lr, loss in ((1e-3, 3.3), (3e-3, 3.1), (1e-2, 3.2))]
    runs += [run("g", "keel", 64, 1, lr, loss) for lr, loss in ((1e-3, 3.3), (3e-3, 3.4), (1e-2, 3.2))]
    assert [SV.bracketed(runs, min((r for r in runs if r.seed == sd), key=lambda r: r.capped_loss))
            for sd in (0, 1)] == [True, False]
    assert lrs({0: 3e-3, 1: 1e-2}, {0: False, 1: True}) == "[s0 0.003, s1 0.01*]"


def test_a_bad_key_in_a_later_groups_set_is_refused_before_anything_trains(tmp_path, tiny_data):
    """--dry-run refused it, a real run trained every group before it (hours at the cpu scale),
    then stopped with no report and its folder left behind."""
    p = tmp_path / "s.toml"
    p.write_text(GROUP + '[groups.h]\nschemes = ["keel"]\n[scales.x.groups.h]\nsublayers = [2]\nseeds = [0]\n'
                 'lrs = [1e-3]\nset = { "model.nonsense" = 1 }\n' + CLAIM)
    sets = [f"data.path={tiny_data}", "train.steps=2", "train.batch_size=2", "train.seq_len=16", "train.eval_every=2",
            "train.eval_tokens=64", "train.sample_tokens=0", "model.d_model=16", "model.d_ff=32"]
    with pytest.raises(KeelError, match="model.nonsense"):
        SRun.run_study(str(p), "x", tmp_path / "out", sets, workers=0)
    assert not (tmp_path / "out").exists()


def test_the_bench_table_says_why_a_pair_is_missing():
    """`--groups bench` on a fresh folder printed a table of "–" with no word on why."""
    st = SC.load_study("claims", "cpu")
    bench = next(g for g in st.groups if g.name == "bench")
    runs = [run("bench", "peri_ln", 64, seed, lr, 3.0) for seed in (0, 1) for lr in bench.lrs]
    table = SR.baseline_table(st, bench, runs)
    assert "| 64 | peri_ln | – | – | – |" in table  # against keel, pre_ln, post_ln
    assert table[-2] == ("–: no seed has both sides finished yet (all of this group's LRs for the scheme and all of "
                         "group lr-grid's for the baseline, at that depth).")
    assert SR._exit_words(runs[0]) == "never" and SR._exit_words(replace(runs[0], status="pending")) == "–"


def test_a_study_of_groups_only_reports_its_bench(tmp_path, tiny_data):
    """A bench needs no claim of the paper: a study with groups and no [[claims]] (it was refused)
    trains them and reports the bench's pairs, with no verdict table."""
    p = tmp_path / "bench.toml"
    p.write_text(GROUP + BENCH)
    sets = [f"data.path={tiny_data}", "train.steps=2", "train.batch_size=2", "train.seq_len=16", "train.eval_every=2",
            "train.eval_tokens=64", "train.sample_tokens=0", "model.d_model=16", "model.d_ff=32"]
    r = SRun.run_study(str(p), "x", tmp_path / "out", sets, workers=0)
    assert r["claims"] == [] and [x["status"] for x in r["runs"]] == ["done"] * 3  # keel, pre_ln; peri_ln
    (m,) = r["baseline_margins"]
    keel, peri = (next(x["capped_loss"] for x in r["runs"] if x["scheme"] == s) for s in ("keel", "peri_ln"))
    assert (m["scheme"], m["baseline"], m["margin"]["diffs"]) == ("peri_ln", "keel", {0: pytest.approx(keel - peri)})
    md = (tmp_path / "out" / "report.md").read_text()
    assert "## Verdicts" not in md and "## Group b (no claim reads it)" in md and "| 2 | peri_ln | " in md


def test_restore_reports_an_earlier_reports_runs_without_training_them(tmp_path, tiny_data, keel_main):
    """`--restore report.json` (the committed report, when runs/ is gone): its finished runs are
    not trained again and give the same numbers and pairs; a run it lacks is trained; a report
    of another study, scale or settings is refused in one line."""
    p = tmp_path / "bench.toml"
    p.write_text(GROUP + BENCH)
    sets = [f"data.path={tiny_data}", "train.steps=2", "train.batch_size=2", "train.seq_len=16", "train.eval_every=2",
            "train.eval_tokens=64", "train.sample_tokens=0", "model.d_model=16", "model.d_ff=32"]
    first = SRun.run_study(str(p), "x", tmp_path / "a", sets, workers=0)
    old = json.loads((tmp_path / "a" / "report.json").read_text())
    old["runs"] = [r for r in old["runs"] if r["scheme"] != "peri_ln"]  # as if the report was committed before it ran
    (tmp_path / "old.json").write_text(json.dumps(old))
    again = SRun.run_study(str(p), "x", tmp_path / "b", sets, workers=0, restore=tmp_path / "old.json")
    assert [(x["scheme"], bool(x.get("restored"))) for x in again["runs"]] == [
        ("keel", True), ("pre_ln", True), ("peri_ln", False)]
    assert not (tmp_path / "b" / "g").exists()  # group g: nothing trained
    assert (tmp_path / "b" / "b" / first["runs"][2]["name"] / "result.json").is_file()
    strip = ("restored", "wall_s")
    assert [{k: v for k, v in x.items() if k not in strip} for x in again["runs"]] == \
        [{k: v for k, v in x.items() if k not in strip} for x in first["runs"]]
    assert again["baseline_margins"] == first["baseline_margins"] and again["restored_from"] == str(tmp_path / "old.json")
    assert "2 of the finished runs were restored from" in (tmp_path / "b" / "report.md").read_text()
    # --report-only --restore: the report of the committed runs alone, in a new folder, training nothing
    only = SRun.run_study(str(p), "x", tmp_path / "r", sets, report_only=True, restore=tmp_path / "old.json")
    assert [x["status"] for x in only["runs"]] == ["done", "done", "pending"]
    assert [m["margin"]["n"] for m in only["baseline_margins"]] == [0]  # peri_ln has not run there
    # the restored records carry their thinned loss curves: group g's loss-curve plot is redrawn from them
    assert sorted(x.name for x in (tmp_path / "r").iterdir()) == ["g.png", "report.json", "report.md", "study.json"]
    # the numbers stay with a run's coordinates: a record whose LR contradicts its own name was dropped silently
    # (and its run trained again); it is refused, naming the record and the field
    old["runs"][0]["lr"] = 3e-3
    (tmp_path / "old.json").write_text(json.dumps(old))
    with pytest.raises(KeelError, match=r"runs\[0\], run L2_seed0_keel_lr0.001: lr must be the one its name spells "
                                        r"\(0.001\), got 0.003$"):
        SRun.run_study(str(p), "x", tmp_path / "c", sets, workers=0, restore=tmp_path / "old.json")
    assert not (tmp_path / "c").exists()
    cases = [(tmp_path / "nope.json", "no such file"), (p, "cannot read it as JSON"),
             (tmp_path / "a" / "study.json", "not a study report"),
             # a runs list but no study (the table keel stress writes) said "holds study None at scale None"
             (REPO / "docs" / "results" / "stress-v2-cpu.json", r"not a study report \(it names no study\)")]
    for bad, message in cases:
        with pytest.raises(KeelError, match=message):
            SRun.run_study(str(p), "x", tmp_path / "d", sets, workers=0, restore=bad)
    r = keel_main("study", p, "--scale", "x", "--out", tmp_path / "d", *[a for s in sets[1:] for a in ("--set", s)],
                 "--set", f"data.path={tiny_data}", "--set", "train.steps=3", "--restore", tmp_path / "a" / "report.json")
    assert r.returncode == 2 and "its runs were trained with other settings (train.steps 2 in the report, 3 now)" \
        in r.stderr and "Traceback" not in r.stderr
    other = keel_main("study", "claims", "--scale", "tiny", "--out", tmp_path / "d", "--restore",
                     tmp_path / "a" / "report.json")
    assert other.returncode == 2 and "holds study 'bench' at scale 'x', not 'claims' at 'tiny'" in other.stderr
    assert not (tmp_path / "d").exists()


def test_restore_reports_a_grid_groups_runs(tmp_path, tiny_data):
    """`keel study FILE --report-only --restore report.json` of a study with a grid group (a sweep)
    stopped with a traceback (KeyError ''): a restored run's grid result had no name. Now the
    group's sweep table lists every restored run with the measures it keeps (final loss, tokens,
    verdict) and what they and its planned config give (best loss, steps: dashes until restored_summary;
    not the parameters here: a report alone prepares no data, and the vocabulary is "auto"), and its
    best-over table is the original's."""
    p = tmp_path / "s.toml"
    p.write_text('[groups.sw]\nkind = "grid"\ngrid = { "model.residual" = ["keel", "pre_ln"], '
                 '"train.lr" = [1e-3, 3e-3] }\nbest_over = "train.lr"\n')
    sets = [f"data.path={tiny_data}", "train.steps=2", "train.batch_size=2", "train.seq_len=16", "train.eval_every=2",
            "train.eval_tokens=64", "train.sample_tokens=0", "model.d_model=16", "model.d_ff=32"]
    first = SRun.run_study(str(p), "default", tmp_path / "a", sets, workers=0)
    again = SRun.run_study(str(p), "default", tmp_path / "r", sets, report_only=True,
                           restore=tmp_path / "a" / "report.json")
    a, b = first["group_tables"]["sw"], again["group_tables"]["sw"]
    assert [r["name"] for r in b["runs"]] == [r["name"] for r in a["runs"]] == \
        ["keel_lr0.001", "keel_lr0.003", "pre_ln_lr0.001", "pre_ln_lr0.003"]
    assert [r["final_val_loss"] for r in b["runs"]] == [r["final_val_loss"] for r in a["runs"]]
    assert b["best"] == a["best"] and len(b["best"]) == 2
    md = (tmp_path / "r" / "report.md").read_text()
    row = next(line for line in md.splitlines() if line.startswith("| keel | 0.001 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    trained = next(line for line in (tmp_path / "a" / "report.md").read_text().splitlines()
                   if line.startswith("| keel | 0.001 |"))
    assert cells[2] == f"{a['runs'][0]['final_val_loss']:.4f}" and cells[:7] == [
        c.strip() for c in trained.strip("|").split("|")][:7] and "—" not in cells[:7], (row, trained)
    assert cells[7:9] == ["—"] * 2 and b["held_fixed"] == {"tokens": 64, "steps": 2}


def test_dry_run_restore_plans_a_transfer_group_at_the_restored_optimum(tmp_path, tiny_data, keel_main):
    """`--dry-run --restore` planned an lr_from group at the middle of its source's LR grid, so the
    restored runs at the real optimum were not counted (the committed CPU report: "155 restored",
    where --resume --restore trains only 4 of 163)."""
    p = tmp_path / "t.toml"
    p.write_text('[groups.g]\nschemes = ["keel"]\n[groups.t]\nschemes = ["keel"]\nlr_from = "g"\n'
                 '[scales.x.groups.g]\nsublayers = [2]\nseeds = [0]\nlrs = [1e-3, 3e-3, 1e-2]\n'
                 '[scales.x.groups.t]\nsublayers = [4]\nseeds = [0]\nlr_from_sublayers = 2\n')
    sets = [f"data.path={tiny_data}", "train.steps=2", "train.batch_size=2", "train.seq_len=16", "train.eval_every=2",
            "train.eval_tokens=64", "train.sample_tokens=0", "model.d_model=16", "model.d_ff=32"]
    SRun.run_study(str(p), "x", tmp_path / "a", sets, workers=0, command="keel study p.toml --scale x")
    rep = json.loads((tmp_path / "a" / "report.json").read_text())
    for r in rep["runs"]:  # as if the optimum at 2 sub-layers were 1e-2 (the grid's top, not its middle)
        if r["group"] == "g" and r["lr"] == 1e-2:
            r["final_val_loss"] = r["capped_loss"] = 0.5
        if r["group"] == "t":
            r["name"], r["lr"] = r["name"].replace(f"lr{r['lr']:g}", "lr0.01"), 1e-2
    (tmp_path / "r.json").write_text(json.dumps(rep))
    plan = keel_main("study", p, "--scale", "x", "--dry-run", "--json", *[a for s in sets for a in ("--set", s)],
                    "--restore", tmp_path / "r.json")
    assert plan.returncode == 0, plan.stderr
    got = json.loads(plan.stdout)
    # g's 3 LRs (and the LR beyond 1e-2 that brackets its restored optimum there) and t's 1 at the restored
    # optimum: every planned run is restored, none is left to train (t at the middle of g's grid was not restored)
    n = got["total"]["runs"]
    assert 4 <= n <= len(rep["runs"]) and (got["restored"], got["restored_from"]) == (n, str(tmp_path / "r.json"))
    only = SRun.run_study(str(p), "x", tmp_path / "o", sets, report_only=True, restore=tmp_path / "r.json",
                          command="keel study p.toml --scale x --report-only --restore r.json")
    # the report names the command that trained its runs (it named this --report-only one)
    md = (tmp_path / "o" / "report.md").read_text()
    assert only["command"] == "keel study p.toml --scale x" in md and "--report-only" not in md
    assert [(x["group"], x["lr"], x["status"]) for x in only["runs"]][-1] == ("t", 1e-2, "done")


def test_resume_with_other_settings_is_refused_before_the_data_is_prepared(tmp_path, tiny_data, keel_main):
    """`--resume` with another --set used to prepare (at gpu-1 scale: download) the dataset first
    and only then fail in the grid; the runs already started are compared first, data.path aside.
    `--report-only` with another --set is refused the same way."""
    p = tmp_path / "g.toml"
    p.write_text(GROUP)
    sets = [f"data.path={tiny_data}", "train.steps=2", "train.batch_size=2", "train.seq_len=16", "train.eval_every=2",
            "train.eval_tokens=64", "train.sample_tokens=0", "model.d_model=16", "model.d_ff=32"]
    SRun.run_study(str(p), "x", tmp_path / "a", sets, workers=0)
    flags = [a for s in sets[1:] for a in ("--set", s)]
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    r = keel_main("study", p, "--scale", "x", "--out", tmp_path / "a", "--resume", *flags, "--set", "train.steps=3",
                 cwd=elsewhere)  # no data.path: the built-in corpus would be prepared under ./data
    assert r.returncode == 2 and "was started with other settings (train.steps)" in r.stderr, r.stderr
    assert not (elsewhere / "data").exists() and "Traceback" not in r.stderr
    # --report-only of the edited study reported the old runs under the new settings (a user's trial)
    before = (tmp_path / "a" / "report.json").read_bytes()
    edited = [s.replace("train.steps=2", "train.steps=3") for s in sets]  # as an edited study file's keys
    with pytest.raises(KeelError, match=r"was started with other settings \(train.steps\)"):
        SRun.run_study(str(p), "x", tmp_path / "a", edited, report_only=True)
    assert (tmp_path / "a" / "report.json").read_bytes() == before


def test_restore_refuses_malformed_or_mismatched_reports(tmp_path, tiny_data, keel_main):
    """What a new user's trial of --restore broke: a record with a loss that is text (a traceback
    after the folder was made), a run listed twice (the last one won silently), a group's own set
    changed in the study file (accepted), the same --set value spelt twice (refused), and a plain
    --report-only on a restored folder (it silently dropped the restored runs)."""
    p = tmp_path / "s.toml"
    p.write_text(GROUP.replace("lrs = [1e-3]\n", 'lrs = [1e-3]\nset = { "train.eval_tokens" = 64 }\n'))
    sets = [f"data.path={tiny_data}", "train.steps=2", "train.batch_size=2", "train.seq_len=16", "train.eval_every=2",
            "train.sample_tokens=0", "model.d_model=16", "model.d_ff=32"]
    SRun.run_study(str(p), "x", tmp_path / "a", sets, workers=0)
    rep = json.loads((tmp_path / "a" / "report.json").read_text())
    assert rep["group_sets"] == {"g": ["train.eval_tokens=64"]}

    def refused(report, match, study=p, extra=()):
        (tmp_path / "r.json").write_text(json.dumps(report))
        with pytest.raises(KeelError, match=match):
            SRun.run_study(str(study), "x", tmp_path / "o", [*sets, *extra], report_only=True,
                           restore=tmp_path / "r.json")
        assert not (tmp_path / "o").exists()

    bad = json.loads(json.dumps(rep))
    bad["runs"][0]["final_val_loss"] = "abc"
    refused(bad, "run L2_seed0_keel_lr0.001: final_val_loss must be a loss >= 0 or null, got 'abc'")
    for key, value, words in (("capped_loss", -50, r"capped_loss must be a finite loss >= 0 \(nats/token\), got -50"),
                              ("curve", {"step": "x"}, "curve must be a thinned loss curve or null")):
        refused({**rep, "runs": [{**rep["runs"][0], key: value}, *rep["runs"][1:]]}, words)  # -50 entered the verdicts
    bad = json.loads(json.dumps(rep))
    bad["runs"][1]["divergence"] = "abc"
    refused(bad, "divergence must be a divergence verdict")
    # accepted before: a scheme or LR that contradicts the run's name (the record was dropped silently), a
    # negative wall time, a curve whose lists differ in length (issue 50)
    curve = rep["runs"][0]["curve"]
    for key, value, words in (
            ("scheme", "pre_ln", r"run L2_seed0_keel_lr0.001: scheme must be the one its name spells \(keel\), "
                                 "got 'pre_ln'$"),
            ("lr", 0.01, r"run L2_seed0_keel_lr0.001: lr must be the one its name spells \(0.001\), got 0.01$"),
            ("wall_s", -1, r"run L2_seed0_keel_lr0.001: wall_s must be seconds >= 0 or null, got -1$"),
            ("curve", {**curve, "loss": curve["loss"][:-1]}, r"run L2_seed0_keel_lr0.001: curve must be a thinned "
                                                             r"loss curve or null \(step, loss and lr lists of one"),
            ("curve", {**curve, "val_loss": [*curve["val_loss"], 1.0]}, "curve must be a thinned loss curve")):
        refused({**rep, "runs": [{**rep["runs"][0], key: value}, *rep["runs"][1:]]}, words)
    bad = json.loads(json.dumps(rep))
    del bad["runs"][0]["capped_loss"]
    refused(bad, "capped_loss must be a finite loss >= 0")
    bad = json.loads(json.dumps(rep))
    bad["runs"].append(dict(bad["runs"][0], capped_loss=1.0))
    refused(bad, "run L2_seed0_keel_lr0.001 of group g is listed twice")
    refused({k: v for k, v in rep.items() if k != "sets"}, "records no settings")
    # a group's settings that are not a list: a TypeError traceback; a group_sets that is not a table: ignored
    for group_sets in ({"g": 5}, 7, {"g": "train.eval_tokens=64"}):
        refused({**rep, "group_sets": group_sets}, "group_sets must map each group to a list of section.key=value texts")
    edited = tmp_path / "edited" / "s.toml"
    edited.parent.mkdir()
    edited.write_text(p.read_text().replace('"train.eval_tokens" = 64', '"train.eval_tokens" = 128'))
    refused(rep, "group g: train.eval_tokens 64 in the report, 128 now", study=edited)
    refused(rep, "train.steps 2 in the report, 3 now", extra=["train.steps=3"])
    # the same values, spelt otherwise or given twice: the same settings
    same = SRun.run_study(str(p), "x", tmp_path / "b", [*sets, "train.steps=2", "model.d_model = 16"],
                          report_only=True, restore=tmp_path / "a" / "report.json")
    assert [x["restored"] for x in same["runs"]] == [True, True]
    assert "| g | keel | 2 | 0.001 | 0 | done (restored) |" in (tmp_path / "b" / "report.md").read_text()
    lost = keel_main("study", p, "--scale", "x", "--out", tmp_path / "b", "--report-only")
    assert lost.returncode == 2 and "holds 2 runs restored from" in lost.stderr and "give --restore" in lost.stderr
    plan = keel_main("study", p, "--scale", "x", "--dry-run", *[a for s in sets for a in ("--set", s)],
                    "--restore", tmp_path / "a" / "report.json")
    assert plan.returncode == 0 and "2 of these runs are restored from" in plan.stdout
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "study.json").write_text("garbage")
    r = keel_main("study", p, "--scale", "x", "--out", tmp_path / "c", "--report-only")
    assert r.returncode == 2 and "is not a study's marker" in r.stderr and "Traceback" not in r.stderr
    # --report-only --restore into a folder that is not a study's (it said "nothing to resume" though
    # --resume was not given)
    (tmp_path / "d" / "x").mkdir(parents=True)
    r = keel_main("study", p, "--scale", "x", "--out", tmp_path / "d", "--report-only",
                 *[a for s in sets for a in ("--set", s)], "--restore", tmp_path / "a" / "report.json")
    assert r.returncode == 2 and "holds no study (no study.json) but is not empty; check --out" in r.stderr
    assert "resume" not in r.stderr and not (tmp_path / "d" / "study.json").exists()


# The committed CPU reports: (study file, folder under docs/results, the page that quotes its summary lines)
COMMITTED_REPORTS = [("claims", "study-cpu", "README.md"), ("looped", "study-looped-cpu", "docs/looped.md")]


@pytest.mark.parametrize("study_name,folder,page", COMMITTED_REPORTS)
def test_the_committed_report_regenerates_from_its_own_records(study_name, folder, page):
    """A committed CPU report's run records read back (:meth:`RunRecord.from_dict`) and written again are
    the same JSON, key order included, and judged again give its floor, verdicts, numbers and margins, and
    its report.md byte for byte: a change of the record, the statistics or the tables that moves one digit
    fails here (issue 49; `keel study claims --scale cpu --report-only --restore` of that report plans the
    same records, unless a scheme's version has risen since, which supersedes its runs)."""
    root = Path(__file__).resolve().parents[1]
    rep = json.loads((root / "docs/results" / folder / "report.json").read_text(encoding="utf-8"))
    runs = [RunRecord.from_dict(r, f"runs[{i}]") for i, r in enumerate(rep["runs"])]
    assert json.dumps([r.to_dict() for r in runs]) == json.dumps(rep["runs"])
    study, floor, claims = SJ.judge(SC.load_study(study_name, "cpu"), runs)
    assert floor.to_dict() == rep["floor"] and [c.summary for _, c in claims] == rep["summary"]
    assert json.loads(json.dumps([{"id": cl.id, "title": cl.title, **plain(c)} for cl, c in claims])) == rep["claims"]
    margins = [{"group": g.name, **plain(r)} for g in study.groups for r in SV.baseline_margins(study, g, runs)]
    assert json.loads(json.dumps(margins)) == rep["baseline_margins"]
    md = SR.report_markdown(study, claims, runs, rep["command"], [], rep["restored_from"], floor)
    assert md + SR.superseded_words(rep["superseded_runs"]) == \
        (root / "docs/results" / folder / "report.md").read_text(encoding="utf-8")


@pytest.mark.parametrize("study_name,folder,page", COMMITTED_REPORTS)
def test_the_committed_report_restores_into_its_own_study(study_name, folder, page):
    """``--restore`` of a committed CPU report into its own study and scale reads back every finished run
    it holds. The looped report refused itself ("the report's settings do not load (model.loop_sampling
    = 'poisson_lognormal' needs a loop ...)": a group's ``model.loop_*`` keys were read without the loop
    each run of the group sets), so the looped study could only resume from a ``runs/`` folder."""
    path = Path(__file__).resolve().parents[1] / "docs/results" / folder / "report.json"
    rep = json.loads(path.read_text(encoding="utf-8"))
    got = SRec.load_restored(path, SC.load_study(study_name, "cpu"))
    done = {(r["group"], r["name"]) for r in rep["runs"] + rep["superseded_runs"] if not RunRecord.trains_again(r)}
    assert done and set(got) == done and all(r.status == "done" for r in got.values())


def test_restore_still_refuses_a_looped_report_of_other_settings(tmp_path):
    """Reading a looped group's settings with its loop does not hide a difference: the committed looped
    report with one group's ``model.loop_sampling`` changed is refused, naming the group and the key."""
    rep = json.loads((Path(__file__).resolve().parents[1] / "docs/results/study-looped-cpu/report.json").read_text())
    rep["group_sets"]["looped-init"] = ['model.loop_sampling="uniform"', "model.embed_init_std=1.0"]
    (tmp_path / "r.json").write_text(json.dumps(rep))
    with pytest.raises(KeelError, match=r"group looped-init: model\.loop_sampling 'uniform' in the report, "
                                        r"'poisson_lognormal' now"):
        SRec.load_restored(tmp_path / "r.json", SC.load_study("looped", "cpu"))


def test_a_paired_verdict_reads_back_from_the_committed_report():
    """Every part of the committed report's claims read back (:meth:`PairedVerdict.from_dict`; a trend,
    with ``depths``, as a :class:`TrendVerdict`) and written again (:meth:`Record.to_dict`) is the same
    JSON, key order included."""
    from keel.experiments.analysis import PairedVerdict, TrendVerdict

    rep = json.loads((Path(__file__).resolve().parents[1] / "docs/results/study-cpu/report.json").read_text())
    parts = [p for c in rep["claims"] for cc in (c.get("conditions") or {"": c}).values()
             for p in (cc.get("parts") or {}).values()]
    assert parts and any("depths" in p for p in parts) and not all("depths" in p for p in parts)
    for p in parts:
        v = PairedVerdict.from_dict(p)
        assert isinstance(v, TrendVerdict) == ("depths" in p)
        assert json.dumps(v.to_dict()) == json.dumps(p)


@pytest.mark.parametrize("study_name,folder,page", COMMITTED_REPORTS)
def test_readme_quotes_the_committed_reports_summary_lines(study_name, folder, page):
    """The page's study summary (README.md for the claims study, docs/looped.md for the looped one) is the
    committed report's own lines (written by :func:`keel.experiments.study.report.claim_summary`; copied by
    docs/results/refresh.sh), not a paraphrase."""
    root = Path(__file__).resolve().parents[1]
    rep = json.loads((root / "docs/results" / folder / "report.json").read_text(encoding="utf-8"))
    text = (root / page).read_text(encoding="utf-8")
    block = text.split("<!-- study-summary:start -->")[1].split("<!-- study-summary:end -->")[0]
    assert [x[2:] for x in block.strip().splitlines()] == rep["summary"] and len(rep["summary"]) == len(rep["claims"])
    md = (root / "docs/results" / folder / "report.md").read_text(encoding="utf-8")
    assert all(f"- {x}" in md for x in rep["summary"])


def test_one_training_study_per_folder(tmp_path, tiny_data):
    """Two studies on one --out interleaved their runs, and the last report marked finished runs
    "error"; a training study now holds the folder's OS lock, and --report-only still reads it."""
    from keel.io import RunLock
    p = tmp_path / "s.toml"
    p.write_text(GROUP + CLAIM)
    sets = [f"data.path={tiny_data}", "train.steps=2", "train.batch_size=2", "train.seq_len=16", "train.eval_every=2",
            "train.eval_tokens=64", "train.sample_tokens=0", "model.d_model=16", "model.d_ff=32"]
    out = tmp_path / "a"
    SRun.run_study(str(p), "x", out, sets, workers=0)
    with RunLock(out):  # as a running `keel study` holds it
        with pytest.raises(KeelError, match=r"study folder .* is in use by another keel study \(pid \d+\)"):
            SRun.run_study(str(p), "x", out, sets, workers=0, resume=True)
        rep = SRun.run_study(str(p), "x", out, sets[1:], workers=0, report_only=True)
        assert all(r["status"] == "done" for r in rep["runs"])
    assert SRun.run_study(str(p), "x", out, sets, workers=0, resume=True)["runs"]


def test_runs_of_a_superseded_implementation_stay_on_record(tmp_path, tiny_data):
    """A scheme whose implementation version rose (HC, mHC: 2) retrains its runs; the old runs'
    numbers leave the verdicts but stay in report.json's superseded_runs, through every later
    --restore (the committed report is the only copy once runs/ is gone)."""
    p = tmp_path / "s.toml"
    p.write_text(GROUP.replace('["keel", "pre_ln"]', '["keel", "hyper_connections"]'))
    sets = [f"data.path={tiny_data}", "train.steps=2", "train.batch_size=2", "train.seq_len=16", "train.eval_every=2",
            "train.eval_tokens=64", "train.sample_tokens=0", "model.d_model=16", "model.d_ff=32"]
    first = SRun.run_study(str(p), "x", tmp_path / "a", sets, workers=0)
    assert [r["name"] for r in first["runs"]] == ["L2_seed0_keel_lr0.001", "L2_seed0_hyper_connections_lr0.001_v2"]
    old = json.loads((tmp_path / "a" / "report.json").read_text())
    old["runs"][1]["name"] = "L2_seed0_hyper_connections_lr0.001"  # as a version-1 report named it
    (tmp_path / "old.json").write_text(json.dumps(old))
    rep = SRun.run_study(str(p), "x", tmp_path / "r", sets, report_only=True, restore=tmp_path / "old.json")
    assert [(r["name"], r["status"]) for r in rep["runs"]] == [("L2_seed0_keel_lr0.001", "done"),
                                                             ("L2_seed0_hyper_connections_lr0.001_v2", "pending")]
    assert [(r["name"], r["status"]) for r in rep["superseded_runs"]] == [("L2_seed0_hyper_connections_lr0.001",
                                                                          "superseded")]
    assert "## Superseded runs" in (tmp_path / "r" / "report.md").read_text()
    again = SRun.run_study(str(p), "x", tmp_path / "s", sets, report_only=True, restore=tmp_path / "r" / "report.json")
    assert again["superseded_runs"] == rep["superseded_runs"]


def test_superseded_runs_are_announced_only_while_their_replacements_train(tmp_path, tiny_data, caplog):
    """Every resume of a finished study said "N earlier runs of hyper_connections ... were trained by
    an older implementation of the scheme; they train again" though the new runs were done and
    nothing trained."""
    import shutil

    p = tmp_path / "s.toml"
    p.write_text(GROUP.replace('["keel", "pre_ln"]', '["keel", "hyper_connections"]'))
    sets = [f"data.path={tiny_data}", "train.steps=2", "train.batch_size=2", "train.seq_len=16", "train.eval_every=2",
            "train.eval_tokens=64", "train.sample_tokens=0", "model.d_model=16", "model.d_ff=32"]
    new = SRun.run_study(str(p), "x", tmp_path / "a", sets, workers=0)
    assert new["runs"][1]["status"] == "done"
    folder = next((tmp_path / "a").glob("*/L2_seed0_hyper_connections_lr0.001_v2"))
    shutil.copytree(folder, folder.with_name("L2_seed0_hyper_connections_lr0.001"))  # a version-1 run beside it
    with caplog.at_level("INFO", logger="keel"):
        SRun.run_study(str(p), "x", tmp_path / "a", sets, workers=0, resume=True)
    assert not [r for r in caplog.records if "older implementation" in r.getMessage()]
    shutil.rmtree(folder)  # the new run gone: it trains again, and the log says why
    caplog.clear()
    with caplog.at_level("INFO", logger="keel"):
        SRun.run_study(str(p), "x", tmp_path / "a", sets, workers=0, resume=True)
    assert [r.getMessage() for r in caplog.records if "older implementation" in r.getMessage()] == [
        "study: group g: 1 earlier run of hyper_connections was trained by an older implementation of the scheme; "
        "it trains again"]


@pytest.fixture(scope="module")
def finished_study(tiny_data, tmp_path_factory):
    """A finished two-run study (GROUP + CLAIM at scale x): copy it, never change it."""
    root = tmp_path_factory.mktemp("finished")
    p = root / "s.toml"
    p.write_text(GROUP + CLAIM)
    sets = [f"data.path={tiny_data}", "train.steps=2", "train.batch_size=2", "train.seq_len=16", "train.eval_every=2",
            "train.eval_tokens=64", "train.sample_tokens=0", "model.d_model=16", "model.d_ff=32"]
    SRun.run_study(str(p), "x", root / "out", sets, workers=0)
    return p, root / "out"


@pytest.mark.parametrize("change, words", [
    (lambda r: [1, 2], "a job's result must be a JSON object, got \\[1, 2\\]"),
    (lambda r: {**r, "final_val_loss": "abc"}, 'final_val_loss must be a loss >= 0 \\(nats/token\\) or null, got "abc"'),
    (lambda r: {**r, "unigram_entropy": "abc"}, 'unigram_entropy must be a loss >= 0 .* got "abc"'),
    (lambda r: {**r, "final_val_loss": -50}, "final_val_loss must be a loss >= 0 .* got -50"),
    (lambda r: {**r, "tokens": "x"}, 'tokens must be an integer >= 0 or null, got "x"'),
    (lambda r: {**r, "divergence": 5}, "divergence must be a divergence verdict \\(a table\\) or null, got 5"),
], ids=["a list", "final_val_loss text", "unigram_entropy text", "a negative loss", "tokens text", "divergence a number"])
def test_report_only_over_a_result_of_the_wrong_shape_is_one_line(finished_study, tmp_path, change, words):
    """`--report-only` over a run whose result.json is a list, or whose final_val_loss or
    unigram_entropy is text, ended in a TypeError / AttributeError inside the report (a
    negative loss entered the verdicts); result.json is checked by its declaration
    (keel.experiments.job_result.RESULT_KEYS), naming the file and the key."""
    import shutil

    p, finished = finished_study
    out = tmp_path / "out"
    shutil.copytree(finished, out)
    result = out / "g" / "L2_seed0_keel_lr0.001" / "result.json"
    result.write_text(json.dumps(change(json.loads(result.read_text()))))
    sets = json.loads((out / "report.json").read_text())["sets"]  # the keys its runs were trained with
    with pytest.raises(KeelError, match=f"{result}: {words}; delete the file to run the job again"):
        SRun.run_study(str(p), "x", out, sets, report_only=True)


def test_a_new_kind_of_claim_is_one_module_and_one_toml_block(tmp_path, monkeypatch):
    """A kind of claim declares its keys with key() (or takes a shared key set: OneGroup's group), its
    verdict and its tables in one class, which registers itself in CLAIMS by being defined (its module
    in keel/experiments/study/claims/ is all a new kind adds); a [[claims]] block uses it: checked at
    load (a missing or mistyped key is one line), typed, judged, and drawn in the report."""
    from dataclasses import MISSING, dataclass
    from typing import ClassVar

    from keel.keys import key

    monkeypatch.setitem(SC.CLAIMS, "loss_below", None)  # the class below registers itself; gone after the test

    @dataclass(kw_only=True)
    class LossBelow(SC.OneGroup):
        kind: ClassVar[str] = "loss_below"
        unit: ClassVar[str] = "nats/token"
        scheme: str = key(MISSING, "the scheme.", nonempty=True)
        baseline: str = key("3.0", "the loss to beat, nats.")

        def verdict(self, study, runs):
            """{scheme} reaches a final loss below {baseline} nats."""
            return SV.ClaimVerdict(verdict=SV.INCONCLUSIVE, why=f"no finished runs of {self.scheme}")

        def schemes_read(self):
            return [self.scheme]

        def tables(self, c):
            return [f"| {self.scheme} | {c.why} |"]

    assert SC.CLAIMS["loss_below"] is LossBelow
    block = '[[claims]]\nid = "z"\ntitle = "t"\ntest = "loss_below"\ngroup = "g"\nscheme = "keel"\n'
    p = tmp_path / "s.toml"
    p.write_text(GROUP + block)
    st = SC.load_study(str(p), "x")
    claim = st.claims[0]
    assert type(claim) is LossBelow and claim.reads() == {("g", "keel")} and claim.baseline == "3.0"
    section = SR.claim_section(claim, claim.verdict(st, []))
    assert "keel reaches a final loss below 3.0 nats." in section
    assert "| keel | no finished runs of keel |" in section
    for bad, match in [(block.replace('scheme = "keel"\n', ""), "\\(loss_below\\): missing scheme"),
                       (block.replace('"keel"', '["keel"]'), "scheme must be a string"),
                       (block.replace('"keel"', '"post_ln"'), "post_ln not trained")]:
        p.write_text(GROUP + bad)
        with pytest.raises(KeelError, match=match):
            SC.load_study(str(p), "x")


@pytest.mark.parametrize("bad", ["data.tokenizer=bpe:abc", "data.source=/nonexistent/corpus",
                                 "data.path=/nonexistent/data"])
def test_bad_data_is_refused_before_out_is_claimed_and_by_dry_run(tmp_path, keel_main, bad):
    """A bad data key gave the right one-line error but left --out behind holding study.json, and
    --dry-run accepted it (study and preset front-end alike)."""
    p = tmp_path / "s.toml"
    p.write_text(GROUP)
    sets = ["--set", f"data.cache_dir={tmp_path / 'cache'}", "--set", bad, "--set", "train.steps=2"]
    for cmd in (["study", p, "--scale", "x"], ["lr-sensitivity", "--sublayers", "2", "--lrs", "1e-3", "--seeds", "0"]):
        for extra in (["--out", tmp_path / "o"], ["--dry-run", "--out", tmp_path / "o"]):
            r = keel_main(*cmd, *sets, *extra)
            assert r.returncode == 2 and r.stderr.startswith("keel: error: ") and r.stderr.count("\n") == 1, r.stderr
            assert not (tmp_path / "o").exists() and not (tmp_path / "cache").exists()


def test_a_vocab_size_below_the_tokenizers_is_refused_before_any_run(tmp_path, tiny_data, keel_main):
    """model.vocab_size = 256 on a bpe:512 dataset failed run by run (an error line per run, exit 1,
    run folders and a report written): now one line before any run starts, and --out left unclaimed."""
    p = tmp_path / "s.toml"
    p.write_text(GROUP)
    sets = [f"data.path={tiny_data}", "model.vocab_size=256", "train.steps=2", "model.d_model=16", "model.d_ff=32"]
    r = keel_main("study", p, "--scale", "x", "--out", tmp_path / "o", *[a for s in sets for a in ("--set", s)])
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("keel: error: group g, run L2_seed0_keel_lr0.001: model.vocab_size = 256 is smaller "
                               "than the tokenizer's vocabulary (512 ids)")
    assert not (tmp_path / "o").exists()


def _no_final_loss(runs: list) -> list:
    return [{k: v for k, v in runs[0].items() if k != "final_val_loss"}, *runs[1:]]


@pytest.mark.parametrize("change, words", [
    (lambda runs: [5, *runs[1:]], r"runs\[0\] must be a run record \(a JSON object\), got 5"),
    (lambda runs: [{**runs[0], "status": "weird"}, *runs[1:]],
     r"runs\[0\], run L2_seed0_keel_lr0.001: status must be one of done, superseded, error, pending, got 'weird'"),
    (_no_final_loss, r"runs\[0\], run L2_seed0_keel_lr0.001: final_val_loss must be a loss >= 0 or null; "
                     "the record has no final_val_loss"),
    (lambda runs: [{**runs[0], "scheme": "pre_ln"}, *runs[1:]],
     r"runs\[0\], run L2_seed0_keel_lr0.001: scheme must be the one its name spells \(keel\), got 'pre_ln'"),
], ids=["not an object", "unknown status", "no final_val_loss", "scheme contradicts the name"])
def test_restore_refuses_a_malformed_record_in_one_line(finished_study, tmp_path, keel_main, change, words):
    """`--report-only --restore` dropped a record that is not an object or has an unknown status
    (exit 0, "15 of the finished runs were restored", the run pending), and restored a finished
    run without its final loss as done with no loss: each is refused, naming the record and key."""
    p, out = finished_study
    rep = json.loads((out / "report.json").read_text())
    (tmp_path / "r.json").write_text(json.dumps({**rep, "runs": change(rep["runs"])}))
    sets = [a for s in rep["sets"] for a in ("--set", s)]
    r = keel_main("study", p, "--scale", "x", *sets, "--report-only", "--restore", tmp_path / "r.json",
                  "--out", tmp_path / "o")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and re.search(words, r.stderr), r.stderr
    assert not (tmp_path / "o").exists()


def test_a_restored_ramp_run_does_not_train_its_reference_again(tmp_path, tiny_data):
    """A ramp group with one run left to train trained every depth's and seed's reference run again
    (three 2,000-step runs at the cpu scale for one seed's two runs), after each session's restore."""
    p = tmp_path / "ramp.toml"
    p.write_text('[groups.r]\nkind = "ramp"\nschemes = ["pre_ln", "keel"]\n'
                 '[scales.x.groups.r]\nsublayers = [2]\nseeds = [0, 1]\npeak_lr = 0.05\nramp_steps = 10\n')
    sets = [f"data.path={tiny_data}", "train.batch_size=2", "train.seq_len=16", "train.eval_every=5",
            "train.eval_tokens=64", "train.sample_tokens=0", "model.d_model=16", "model.d_ff=32"]
    SRun.run_study(str(p), "x", tmp_path / "a", sets, workers=0)
    assert sorted(x.name for x in (tmp_path / "a" / "r" / "references").iterdir() if x.is_dir()) == \
        ["pre_ln-2sl-seed0", "pre_ln-2sl-seed1"]
    old = json.loads((tmp_path / "a" / "report.json").read_text())
    old["runs"] = [r for r in old["runs"] if not (r["scheme"] == "keel" and r["seed"] == 1)]
    (tmp_path / "old.json").write_text(json.dumps(old))
    again = SRun.run_study(str(p), "x", tmp_path / "b", sets, workers=0, restore=tmp_path / "old.json")
    assert [(x["scheme"], x["seed"], bool(x.get("restored"))) for x in again["runs"]] == [
        ("pre_ln", 0, True), ("keel", 0, True), ("pre_ln", 1, True), ("keel", 1, False)]
    assert [x.name for x in (tmp_path / "b" / "r" / "references").iterdir() if x.is_dir()] == ["pre_ln-2sl-seed1"]


def test_restored_runs_the_study_does_not_plan_are_named_not_dropped(tmp_path, tiny_data, caplog):
    """`--restore` of a report with runs of a group the study no longer has (or at coordinates none of its runs
    has: the study file edited since) left them out of the new report without a word, so a later restore of that
    report lost them for good. Now a warning names how many, per group; a report whose runs are all planned
    gives none."""
    import logging

    p = tmp_path / "bench.toml"
    p.write_text(GROUP + BENCH)
    sets = [f"data.path={tiny_data}", "train.steps=2", "train.batch_size=2", "train.seq_len=16", "train.eval_every=2",
            "train.eval_tokens=64", "train.sample_tokens=0", "model.d_model=16", "model.d_ff=32"]
    SRun.run_study(str(p), "x", tmp_path / "a", sets, workers=0)
    caplog.set_level(logging.WARNING, logger="keel.experiments.study.run")
    SRun.run_study(str(p), "x", tmp_path / "same", sets, report_only=True, restore=tmp_path / "a" / "report.json")
    assert not [r for r in caplog.records if "--restore" in r.getMessage()]
    # restored into the folder whose runs it holds (docs/results/refresh.sh on a running grid): the runs come from
    # the folder, not the report, and are no less planned; they were all named as left out
    (tmp_path / "a.json").write_bytes((tmp_path / "a" / "report.json").read_bytes())
    SRun.run_study(str(p), "x", tmp_path / "a", sets, report_only=True, restore=tmp_path / "a.json")
    assert not [r for r in caplog.records if "--restore" in r.getMessage()]
    p.write_text(GROUP.replace('schemes = ["keel", "pre_ln"]', 'schemes = ["keel"]'))  # group b gone, pre_ln too
    SRun.run_study(str(p), "x", tmp_path / "r", sets, report_only=True, restore=tmp_path / "a" / "report.json")
    words = [r.getMessage() for r in caplog.records if "--restore" in r.getMessage()]
    assert words == [f"study: 2 finished runs of --restore {tmp_path / 'a' / 'report.json'} are not planned by this "
                     "study and left out of its report (group g: 1; group b: 1 (not a group of this study))"]
    kept = json.loads((tmp_path / "r" / "report.json").read_text())["runs"]
    assert [(r["scheme"], r["restored"]) for r in kept] == [("keel", True)]


@pytest.mark.parametrize("x,label", [("lr", "LR at that step (on the ramp)"), ("step", "step")])
def test_a_ramp_s_curves_are_plotted_against_the_lr_of_each_step(x, label, tmp_path, monkeypatch):
    """stress.png's x axis read "peak LR of the ramp at that step": its values are each step's LR (the
    curve's ``lr``), not the ramp's peak."""
    import matplotlib.pyplot as plt

    seen = {}
    monkeypatch.setattr(SR, "save_figure", lambda fig, out: seen.update(fig=fig))
    curve = {"step": [1, 2, 3], "lr": [0.01, 0.02, 0.03], "loss": [6.0, 5.5, 5.2]}
    assert SR.plot_record_curves([run("ramp", "keel", 4, 0, 0.05, 5.2, curve=curve)], tmp_path / "c.png", x=x, title="t")
    (ax,) = seen["fig"].axes
    assert ax.get_xlabel() == label
    assert list(ax.lines[0].get_xdata()) == curve[x]
    plt.close(seen["fig"])
