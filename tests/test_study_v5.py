"""The study's v5 claims (e)-(i) and the fixed init conditions, each rule checked against a direct
transcription of its definition (written from the rule's text, not from keel's code)."""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import replace

import numpy as np
import pytest
from scipy import stats

from keel.experiments.grid import GridJob
from keel.experiments.record import RunRecord
from keel.experiments.study import claims as SC
from keel.experiments.study import records as SR
from keel.experiments.study import spec as SS
from keel.experiments.study import verdicts as SV
from keel.experiments.study import report as SRep
from keel.experiments.study.claims import layer_importance as LI


def run(group, scheme, L, seed, lr, loss, **kw):
    """A finished run's record, named as a study names it."""
    return RunRecord(**{"group": group, "name": f"L{L}_seed{seed}_{scheme}_lr{lr:g}", "scheme": scheme, "sublayers": L,
                        "seed": seed, "lr": lr, "status": "done", "capped_loss": loss, **kw})


def claim_of(test, **keys):
    """A claim of kind ``test`` with ``keys`` (id "x" and title "t" unless given), typed as load_study types it."""
    return SC.CLAIMS[test](**{"id": "x", "title": "t", "test": test, **keys})


def study(groups, **kw):
    return SS.Study(**{"name": "t", "scale": "t", "description": "", "note": "", "base": "demo",
                       "sets": [("model.vocab_size", 512)],
                       "groups": groups, "claims": [], "min_effect": 0.05, "min_seeds": 3, **kw})


def t_bounds_ref(xs, level=0.95):
    """mean ± t_{level, n-1} · sd / sqrt(n), from scipy's two-sided interval at 2·level − 1."""
    lo, hi = stats.t.interval(2 * level - 1, len(xs) - 1, loc=np.mean(xs), scale=stats.sem(xs))
    return lo, hi


# ----------------------------------------------------------------------------- the early spike (h)
def spike_ref(losses, window=10):
    """S = max_i (m_i − min_{j ≤ i − w} m_j), m the w-step trailing mean, 0 if it never rises."""
    x = np.asarray(losses, float)
    m = np.convolve(x, np.ones(window) / window, mode="valid")  # m[k] = mean of x[k .. k + w - 1]
    best = 0.0
    for k in range(window, len(m)):
        best = max(best, m[k] - m[: k - window + 1].min())
    return best


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_early_spike_is_the_largest_rise_of_the_trailing_mean(seed):
    rng = np.random.default_rng(seed)
    x = 6.0 - np.linspace(0, 2, 300) + rng.normal(0, 0.05, 300)
    x[120 + 40 * seed: 140 + 40 * seed] += 0.8 * (seed + 1) / 4  # a spike of a few steps
    recs = [{"step": i + 1, "loss": float(v)} for i, v in enumerate(x)]
    assert SR.early_spike(recs) == pytest.approx(spike_ref(x), abs=1e-12)
    assert SR.early_spike(recs, steps=100) == pytest.approx(spike_ref(x[:100]), abs=1e-12)


def test_early_spike_of_a_falling_loss_is_zero_and_a_nan_is_the_cap():
    recs = [{"step": i, "loss": 5.0 - 0.01 * i} for i in range(1, 60)]
    assert SR.early_spike(recs) == 0.0
    recs[30]["loss"] = float("nan")
    assert SR.early_spike(recs, cap=6.2) == 6.2
    assert SR.early_spike(recs[:15]) is None  # fewer than two windows


def test_early_spike_by_hand():
    """Hand-computed from the rule's words (window 3 here): trailing means m_3..m_8 of
    [6, 5, 4, 3, 2, 1, 4, 4] are 5, 4, 3, 2, 7/3, 3; the rises over the lowest mean at least one
    window earlier are m_6 - m_3 = -3, m_7 - min(m_3, m_4) = 7/3 - 4, m_8 - min(m_3..m_5) = 0:
    never above 0, so 0. With loss 10 at step 8: m_8 = 5, and 5 - 3 = 2."""
    loss = [6, 5, 4, 3, 2, 1, 4, 4]
    recs = [{"step": i + 1, "loss": float(x)} for i, x in enumerate(loss)]
    assert SR.early_spike(recs, window=3) == 0.0
    recs[-1]["loss"] = 10.0
    assert SR.early_spike(recs, window=3) == pytest.approx(2.0)
    assert SR.early_spike(recs, steps=7, window=3) == 0.0  # step 8 is past the early phase


def test_a_records_early_phase_is_the_first_half_of_a_short_run(tmp_path):
    """The rule reads "the first 1,000 steps" (paper Figure 1a/4, of a 238k-step run). A cpu run is
    1,000 steps, so that was the whole run, and a healthy run's largest rise fell at steps 700-990
    (cosine LR under 20% of its peak), at the same step for every scheme and LR of a seed: the data
    order, not a spike (the cpu study's wide / wide-init runs: 0.13-0.28 nats over 1,000 steps,
    0.07-0.21 over the first 500). The early phase is now the first half of a run, at most 1,000
    steps, at least two windows."""
    assert [SR.spike_steps(n) for n in (20, 250, 1000, 1500, 238419, None)] == [20, 125, 500, 750, 1000, 1000]
    loss = [5.0 - 0.001 * i for i in range(1, 1001)]
    for i in range(800, 810):
        loss[i] += 1.0  # a rise at steps 801-810, in the second half
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": i + 1, "loss": x}) + "\n"
                                                    for i, x in enumerate(loss)))
    cfg = {"model": {"residual": "pre_ln", "n_layers": 32}, "train": {"seed": 0, "lr": 1e-2, "steps": 1000}}
    job = GridJob("L64_seed0_pre_ln_lr0.01", cfg, {})
    group = SS.Group(name="spike", schemes=["pre_ln"], sublayers=[64], seeds=[0], lrs=[1e-2])
    rec = SR.run_record(group, job, tmp_path, {"status": "done", "final_val_loss": 4.0, "first_val_loss": 6.2})
    assert rec.early_spike == 0.0  # the loss falls throughout the first 500 steps
    # over all 1,000 steps: the 10-step mean at step 810 (5 - 0.8055 + 1) over the one at step 800 (5 - 0.7955)
    assert SR.early_spike([{"step": i + 1, "loss": x} for i, x in enumerate(loss)]) == pytest.approx(0.99)


def _spike_runs(spikes):
    """spikes: {(scheme, seed, lr): (spike, verdict)}"""
    return [run("s", x, 64, sd, lr, 3.0, early_spike=v, verdict=w) for (x, sd, lr), (v, w) in spikes.items()]


def test_claim_h_reads_only_the_lrs_where_keel_is_healthy():
    st = study([SS.Group("s", ["keel", "pre_ln"], [64], [0, 1, 2], lrs=[1e-3, 1e-2])])
    sp = {}
    for sd in range(3):
        sp[("keel", sd, 1e-3)] = (0.02, "healthy")
        sp[("pre_ln", sd, 1e-3)] = (0.30 + 0.05 * sd, "healthy")
        sp[("keel", sd, 1e-2)] = (2.0, "instability")  # not a healthy Keel LR: left out
        sp[("pre_ln", sd, 1e-2)] = (0.0, "healthy")
    c = claim_of("early_spike", group="s", scheme="keel", baseline="pre_ln").verdict(st, _spike_runs(sp))
    part = next(iter(c.parts.values()))
    d = [0.30 - 0.02, 0.35 - 0.02, 0.40 - 0.02]
    assert part.diffs == pytest.approx(dict(enumerate(d)))
    lo, _ = t_bounds_ref(d)
    assert part.lo == pytest.approx(lo) and c.verdict == ("reproduced" if lo >= 0.05 else "inconclusive")


def test_claim_h_waits_for_every_run():
    st = study([SS.Group("s", ["keel", "pre_ln"], [64], [0, 1, 2], lrs=[1e-3, 1e-2])])
    sp = {("keel", 0, 1e-3): (0.0, "healthy"), ("pre_ln", 0, 1e-3): (1.0, "healthy")}
    c = claim_of("early_spike", group="s", scheme="keel", baseline="pre_ln").verdict(st, _spike_runs(sp))
    assert c.verdict == "inconclusive" and "of 12 runs" in c.why


# ----------------------------------------------------------------------------- layer importance (g)
def test_redundant_share_and_first_critical_transcribe_their_definitions():
    ab = {"ppl_full": 100.0, "delta_ppl": [50.0, 20.0, 0.5, 0.9, 3.0, -0.2, 0.1, 8.0]}
    # shallow half = first 4: ΔPPL < 1% of 100 = 1.0 -> 0.5, 0.9 -> 2 of 4
    assert LI.redundant_share(ab, 0.01, 0.5) == 2 / 4
    ppl = [100 + d for d in ab["delta_ppl"]]
    assert LI.first_critical(ab) == pytest.approx(math.log10(((150 + 120) / 2) / statistics.median(ppl)))


def _ablated(group, scheme, L, seed, lr, loss, share_pattern):
    return run(group, scheme, L, seed, lr, loss, ablation={"ppl_full": 10.0, "delta_ppl": share_pattern})


def test_claim_g_takes_the_seed_mean_optimum_and_pairs_the_shares(tmp_path):
    st = study([SS.Group("g", ["keel", "pre_ln"], [8], [0, 1, 2], lrs=[1e-3, 1e-2]),
                SS.Group("a", ["keel", "pre_ln"], [8], [0, 1, 2], lrs=[1e-3, 1e-2], ablate=True)])
    runs = []
    keel = [5.0, 2.0, 1.0, 0.5, 0.01, 0.5, 0.5, 0.5]  # shallow half: no redundant sub-layer
    pre = [5.0, 0.01, 0.02, 1.0, 0.5, 0.5, 0.5, 0.5]  # shallow half: 2 of 4 redundant (< 0.1)
    for sd in range(3):
        for x in ("keel", "pre_ln"):
            runs += [run("g", x, 8, sd, 1e-3, 3.0), run("g", x, 8, sd, 1e-2, 2.9 if x == "keel" else 3.1)]
            opt = 1e-2 if x == "keel" else 1e-3  # seed-mean optimum of the LR group
            for lr in (1e-3, 1e-2):
                pat = (keel if x == "keel" else pre) if lr == opt else [0.0] * 8  # the other LR must not be read
                runs.append(_ablated("a", x, 8, sd, lr, 3.0, pat))
    claim = claim_of("layer_importance", groups=["a"], optimum_groups=["g"], scheme="keel", baseline="pre_ln")
    c = claim.verdict(st, runs)
    cond = c.conditions["paper_init"]
    share = next(v for k, v in cond.parts.items() if k.startswith("redundant"))
    assert share.diffs == {0: 0.5, 1: 0.5, 2: 0.5}
    assert cond.rows[0].lr == {"keel": 1e-2, "pre_ln": 1e-3}
    from keel.experiments.study.claims.layer_importance import LayerImportance
    assert LayerImportance.plot([(claim, c)], tmp_path / "importance.png")
    assert (tmp_path / "importance.png").stat().st_size > 1000
    empty = SV.ClaimVerdict(verdict=SV.INCONCLUSIVE, conditions={"paper_init": SV.Condition(verdict=SV.INCONCLUSIVE,
                                                                                          rows=[])})
    assert not LayerImportance.plot([(claim, empty)], tmp_path / "none.png")


# ----------------------------------------------------------------------------- data scaling (e)
def test_claim_e_slope_is_the_least_squares_fit_against_log2_tokens():
    budgets = {"b1": 256_000, "b2": 512_000, "b3": 1_024_000}
    st = study([SS.Group(g, ["keel", "pre_ln"], [256], [0, 1, 2], lrs=[1e-3, 3e-3, 1e-2]) for g in budgets])
    margin = {("b1", 0): 0.05, ("b2", 0): 0.15, ("b3", 0): 0.30, ("b1", 1): 0.00, ("b2", 1): 0.20,
              ("b3", 1): 0.35, ("b1", 2): 0.10, ("b2", 2): 0.18, ("b3", 2): 0.31}
    runs = []
    for (g, sd), m in margin.items():
        for lr in (1e-3, 3e-3, 1e-2):
            bump = 0.0 if lr == 3e-3 else 0.4  # each scheme's best at the middle LR
            runs += [run(g, "keel", 256, sd, lr, 3.0 + bump, tokens=budgets[g]),
                     run(g, "pre_ln", 256, sd, lr, 3.0 + m + bump, tokens=budgets[g])]
    c = claim_of("data_scaling", budgets=list(budgets), scheme="keel", baseline="pre_ln").verdict(st, runs)
    cond = c.conditions["paper_init"]
    x = np.log2(list(budgets.values()))
    slopes = [np.polyfit(x, [margin[(g, sd)] for g in budgets], 1)[0] for sd in range(3)]
    trend = next(v for k, v in cond.parts.items() if k.startswith("trend"))
    assert list(trend.diffs.values()) == pytest.approx(slopes)
    lo, hi = t_bounds_ref(slopes)
    assert (trend.lo, trend.hi) == pytest.approx((lo, hi))
    assert trend.min_effect == pytest.approx(0.05 / 2)  # the floor spread over log2(4) doublings
    top = next(v for k, v in cond.parts.items() if k.startswith("margin"))
    assert top.diffs == pytest.approx({0: 0.30, 1: 0.35, 2: 0.31})
    assert cond.rows[0].tokens_per_param["keel"] == pytest.approx(
        256_000 / SV.non_embedding_params(st, "b1", "keel", 256))


def test_claim_e_waits_for_every_budget():
    st = study([SS.Group(g, ["keel", "pre_ln"], [256], [0, 1, 2], lrs=[1e-3]) for g in ("b1", "b2")])
    runs = [run("b1", x, 256, sd, 1e-3, 3.0, tokens=1000) for x in ("keel", "pre_ln") for sd in range(3)]
    c = claim_of("data_scaling", budgets=["b1", "b2"], scheme="keel", baseline="pre_ln").verdict(st, runs)
    assert c.verdict == "inconclusive" and c.conditions["paper_init"].why == "1 of 2 token budgets finished"


@pytest.mark.parametrize("kind", ["data_scaling", "margin_grows"])
def test_a_condition_waits_while_a_run_it_reads_is_unfinished(kind):
    """(b), (c) and (e) judged a condition once each depth (budget) had one paired seed: with one
    Pre-LN run of the last budget still training, a finished "not reproduced" part decided the
    condition, while (f), (g), (i) waited. The one rule now (the report's words): a condition stays
    inconclusive while a run it reads has not finished. Here Keel is behind by 0.3 nats at every
    budget and seed, so the margin part is not reproduced either way."""
    groups = ["g1", "g2"]
    st = study([SS.Group(g, ["keel", "pre_ln"], [16 * 4 ** i], [0, 1, 2], lrs=[1e-3]) for i, g in enumerate(groups)]
               if kind == "margin_grows" else
               [SS.Group(g, ["keel", "pre_ln"], [256], [0, 1, 2], lrs=[1e-3]) for g in groups])
    runs = [run(g, x, (16 * 4 ** i) if kind == "margin_grows" else 256, sd, 1e-3, 3.3 if x == "keel" else 3.0,
                tokens=1000 * 2 ** i) for i, g in enumerate(groups) for x in ("keel", "pre_ln") for sd in range(3)]
    keys = {"budgets": groups} if kind == "data_scaling" else {"groups": groups}
    claim = claim_of(kind, scheme="keel", baseline="pre_ln", **keys)
    assert claim.verdict(st, runs).verdict == "not reproduced"
    runs[5].status = "running"  # pre_ln, seed 2, of the first budget / the shallowest depth
    c = claim.verdict(st, runs)
    parts = c.conditions["paper_init"].parts
    margin = next(v for k, v in parts.items() if k.startswith("margin"))
    trend = next(v for k, v in parts.items() if k.startswith("trend"))
    assert (margin.verdict, margin.n, trend.n) == ("not reproduced", 3, 2)  # the trend still lacks seed 2
    assert c.conditions["paper_init"].verdict == c.verdict == "inconclusive"
    assert SV.unfinished(runs, groups, ["keel", "pre_ln"]) == 1 and SV.unfinished(runs, groups, ["keel"]) == 0


# ----------------------------------------------------------------------------- deeper vs wider (f)
def test_claim_f_pairs_keel_deep_with_pre_ln_deep_and_wide():
    st = study([SS.Group("d", ["keel", "pre_ln"], [256], [0, 1, 2], lrs=[1e-3, 3e-3],
                         sets=[("model.d_model", 64), ("model.d_ff", 192)]),
                SS.Group("w", ["keel", "pre_ln"], [64], [0, 1, 2], lrs=[1e-3, 3e-3],
                         sets=[("model.d_model", 128), ("model.d_ff", 384)])],
               sets=[("model.vocab_size", 512), ("model.n_heads", 4), ("model.n_kv_heads", 2)])
    loss = {("keel", "d"): [3.0, 3.1, 3.05], ("pre_ln", "d"): [3.3, 3.35, 3.28],
            ("keel", "w"): [3.2, 3.2, 3.2], ("pre_ln", "w"): [3.02, 3.2, 3.1]}
    runs = [run(g, x, 256 if g == "d" else 64, sd, lr, v[sd] + (0.2 if lr == 1e-3 else 0.0))
            for (x, g), v in loss.items() for sd in range(3) for lr in (1e-3, 3e-3)]
    c = claim_of("deep_vs_wide", deep="d", wide="w", scheme="keel", baseline="pre_ln").verdict(st, runs)
    p = c.conditions["paper_init"].parts
    deep, wide = p["pre_ln deep (256) − keel deep"], p["pre_ln wide (64) − keel deep"]
    assert deep.diffs == pytest.approx({0: 0.3, 1: 0.25, 2: 0.23})
    assert wide.diffs == pytest.approx({0: 0.02, 1: 0.1, 2: 0.05})
    assert deep.verdict == "reproduced" and wide.verdict == "inconclusive" and c.verdict == "inconclusive"
    params = c.conditions["paper_init"].params
    assert abs(params["pre_ln wide"] - params["pre_ln deep"]) / params["pre_ln deep"] < 0.01  # equal parameters


# ----------------------------------------------------------------------------- no choice on the outcome (b, c)
def test_the_n01_condition_reads_only_the_init_groups_never_the_better_of_two():
    """Before v5 the second condition took per scheme, depth and seed the better of the two inits: a
    Keel run of the paper's-init group that beat its N(0, 1) run was taken, on the losses then judged."""
    st = study([SS.Group("g", ["keel", "pre_ln"], [16, 64], [0, 1, 2], lrs=[1e-3]),
                SS.Group("i", ["keel", "pre_ln"], [16, 64], [0, 1, 2], lrs=[1e-3])])
    runs = []
    for L in (16, 64):
        for sd in range(3):
            runs += [run("g", "keel", L, sd, 1e-3, 2.0), run("g", "pre_ln", L, sd, 1e-3, 3.0),
                     run("i", "keel", L, sd, 1e-3, 3.0), run("i", "pre_ln", L, sd, 1e-3, 2.9)]
    claim = claim_of("margin_grows", groups=["g"], init_groups=["i"], scheme="keel", baseline="pre_ln")
    c = claim.verdict(st, runs)
    assert set(c.conditions) == {"paper_init", "embed_init"}
    rows = c.conditions["embed_init"].rows
    assert all(r.margin.diffs == pytest.approx({0: -0.1, 1: -0.1, 2: -0.1}) for r in rows)
    assert all(set(g for v in r.best_group["keel"].values() for g in [v]) == {"i"} for r in rows)


# ----------------------------------------------------------------------------- the bench (i)
def test_claim_i_judges_each_design_against_pre_ln_and_reports_keel():
    st = study([SS.Group("lr", ["keel", "pre_ln"], [64], [0, 1, 2], lrs=[1e-3, 1e-2]),
                SS.Group("b", ["peri_ln"], [64], [0, 1, 2], lrs=[1e-3, 1e-2], baselines_from="lr",
                         baselines=["keel", "pre_ln"])])
    runs = []
    for sd in range(3):
        for lr in (1e-3, 1e-2):
            runs += [run("lr", "pre_ln", 64, sd, lr, 3.5 + sd * 0.01), run("lr", "keel", 64, sd, lr, 3.0),
                     run("b", "peri_ln", 64, sd, lr, 3.2)]
    c = claim_of("bench", group="b", designs=["peri_ln"], baseline="pre_ln").verdict(st, runs)
    part = c.conditions["paper_init"].parts["pre_ln − peri_ln at 64"]
    assert part.diffs == pytest.approx({0: 0.3, 1: 0.31, 2: 0.32}) and part.verdict == "reproduced"
    vs_keel = next(r for r in c.conditions["paper_init"].rows if r.baseline == "keel")
    assert vs_keel.margin.mean == pytest.approx(-0.2)


# ----------------------------------------------------------------------------- the study file
def test_every_table_is_widened_not_only_the_cells_a_claim_reads():
    """DeepNorm at 256 sub-layers was best at its lowest LR in both seeds and was not widened: no
    claim read it. Every cell of a train group is bracketed now."""
    from keel.experiments.study.lrs import widened_lrs
    g = SS.Group("g", ["deepnorm"], [256], [0, 1], lrs=[1e-3, 3e-3, 1e-2])
    st = study([g])  # no claim reads anything
    recs = [run("g", "deepnorm", 256, sd, lr, 3.0 + (lr > 1e-3)) for sd in (0, 1) for lr in (1e-3, 3e-3, 1e-2)]
    lr_for = {("deepnorm", 256): [1e-3, 3e-3, 1e-2]}
    wider = widened_lrs(st, g, recs, lr_for, dict(lr_for))
    assert wider == {("deepnorm", 256): [3.33e-4, 1e-3, 3e-3, 1e-2]}  # the mirrored step: 1e-3 · 1e-3 / 3e-3


def test_lr_from_follows_a_chain_to_a_group_with_lrs():
    a = SS.Group("a", ["keel"], [64], [0], lrs=[1e-2, 1e-3, 3e-3])
    b = SS.Group("b", ["keel"], [256], [0], lr_from="a", lr_from_sublayers=64)
    c = SS.Group("c", ["keel"], [256], [0], lr_from="b", lr_from_sublayers=256)
    assert SS.lr_ladder([a, b, c], c) == [1e-3, 3e-3, 1e-2]
    loop = SS.Group("x", ["keel"], [8], [0], lr_from="x", lr_from_sublayers=8)
    assert SS.lr_ladder([loop], loop) == []


def test_the_cpu_scale_judges_every_claim_and_tiny_leaves_out_what_it_does_not_size():
    from keel.experiments.study.claims import load_study
    cpu = load_study("claims", "cpu")
    assert [c.id for c in cpu.claims] == list("abcdefghi") and not cpu.unjudged
    tiny = load_study("claims", "tiny")
    assert "h" in [c.id for c in tiny.claims] and {u["id"] for u in tiny.unjudged} == set("efgi")


def test_claim_h_table_says_what_is_pending():
    """Before any spike run finished, (h)'s section was a table header over no row; part-way, a
    scheme without a finished seed at an LR read "[]". Now: "Pending: ..." with the count, and
    "s<seed> pending" in a cell."""
    st = study([SS.Group("s", ["keel", "pre_ln"], [64], [0, 1, 2], lrs=[1e-3, 1e-2])])
    claim = claim_of("early_spike", group="s", scheme="keel", baseline="pre_ln")
    c = claim.verdict(st, [])
    assert claim.tables(c) == ["Pending: 0 of 12 runs of group s (keel, pre_ln) finished; no spike measured yet."]
    sp = {("keel", 0, 1e-3): (0.05, "healthy"), ("pre_ln", 0, 1e-3): (0.5, "healthy"),
          ("keel", 1, 1e-3): (0.07, "healthy"), ("keel", 0, 1e-2): (0.9, "instability")}
    lines = claim.tables(claim.verdict(st, _spike_runs(sp)))
    assert lines[0] == "Pending: 4 of 12 runs of group s (keel, pre_ln) finished."
    assert lines[-2:] == ["| 64 | 0.001 | [s0 0.50, s1 pending] | [s0 0.05, s1 0.07] |",
                          "| 64 | 0.01 | [s0 pending, s1 pending] | [s0 0.90 (instability), s1 pending] |"]


def test_claim_h_counts_a_finished_run_without_a_spike_as_finished():
    """A run stopped before two 10-step windows (divergence) has no spike measure; it was counted
    as unfinished, so the claim said "pending" for ever once every run had finished."""
    st = study([SS.Group("s", ["keel", "pre_ln"], [64], [0, 1, 2], lrs=[1e-3])])
    sp = {(x, sd, 1e-3): (0.0 if x == "keel" else 0.4 + 0.1 * sd, "healthy") for x in ("keel", "pre_ln") for sd in range(3)}
    sp[("pre_ln", 2, 1e-3)] = (None, "instability")
    c = claim_of("early_spike", group="s", scheme="keel", baseline="pre_ln").verdict(st, _spike_runs(sp))
    part = next(iter(c.parts.values()))
    assert c.why is None and part.diffs == pytest.approx({0: 0.4, 1: 0.5}) and c.verdict == "inconclusive"


def _importance_study_and_runs():
    """Group g (the LR source: each scheme's seed-mean optimum, Keel 1e-2, Pre-LN 1e-3) and group a
    (ablate = true) at 8 sub-layers, 3 seeds; a's runs not yet finished."""
    st = study([SS.Group("g", ["keel", "pre_ln"], [8], [0, 1, 2], lrs=[1e-3, 1e-2]),
                SS.Group("a", ["keel", "pre_ln"], [8], [0, 1, 2], lrs=[1e-3, 1e-2], ablate=True)])
    runs = []
    for sd in range(3):
        for x in ("keel", "pre_ln"):
            runs += [run("g", x, 8, sd, 1e-3, 3.0), run("g", x, 8, sd, 1e-2, 2.9 if x == "keel" else 3.1)]
            runs += [replace(run("a", x, 8, sd, lr, 3.0), status="pending", capped_loss=None) for lr in (1e-3, 1e-2)]
    return st, runs


def test_claim_g_table_says_what_is_pending():
    """The (g) table read "None; None | []; []" before any ablation: the LR came from the ablated
    runs, not from the optimum (known already), and a seed without an ablation was left out. Now:
    the seed-mean optimum, "s<seed> pending", and the condition's line says what it waits for."""
    st, runs = _importance_study_and_runs()
    claim = claim_of("layer_importance", groups=["a"], optimum_groups=["g"], scheme="keel", baseline="pre_ln")
    c = claim.verdict(st, runs)
    cond = c.conditions["paper_init"]
    assert cond.why == "ablations pending (12 runs of a unfinished)"
    lines = claim.tables(c)
    assert lines[0] == "**At the paper's init: inconclusive.** ablations pending (12 runs of a unfinished)"
    pend = "[s0 pending, s1 pending, s2 pending]"
    assert lines[4] == f"| 8 | 0.001; 0.01 | {pend}; {pend} | {pend}; {pend} |"
    c.summary = SRep.claim_summary(claim, c)
    assert c.summary == ("(x) t: inconclusive at the paper's init — at the paper's init: "
                         "ablations pending (12 runs of a unfinished).")


def test_claim_g_names_a_run_at_the_optimum_that_finished_without_an_ablation():
    """A run stopped early (diverged) has no ablation; (g) said "ablations pending" for ever once
    every run had finished. Now the seed reads "no ablation" and the condition says why."""
    st, runs = _importance_study_and_runs()
    ab = {"ppl_full": 10.0, "delta_ppl": [5.0, 2.0, 1.0, 0.5, 0.01, 0.5, 0.5, 0.5]}
    for r in runs:
        if r.group == "a":
            r.update(status="done", capped_loss=3.0, ablation=dict(ab))
    dead = next(r for r in runs if (r.group, r.scheme, r.seed, r.lr) == ("a", "pre_ln", 2, 1e-3))
    dead.update(ablation=None, capped_loss=6.2)
    claim = claim_of("layer_importance", groups=["a"], optimum_groups=["g"], scheme="keel", baseline="pre_ln")
    c = claim.verdict(st, runs)
    cond = c.conditions["paper_init"]
    assert cond.verdict == "inconclusive"
    assert cond.why == "too few ablated seeds (pre_ln s2 at 8: finished without an ablation, stopped early)"
    assert cond.rows[0].missing == {"pre_ln": {2: "no ablation"}}
    assert "[s0 0.000, s1 0.000, s2 no ablation]; [s0 0.000, s1 0.000, s2 0.000]" in claim.tables(c)[4]


def test_layer_importance_metrics_by_hand():
    """Literal values worked by hand from the rule's words. Redundant share: of the shallow half
    (the first ⌈n/2⌉ sub-layers) those whose removal raises the PPL by less than 1%; with n = 5 and
    PPL 40 the first 3 count, ΔPPL 0.39 (< 0.4) and -1.0 (removal helped) are redundant, 0.4 is
    not: 2/3. First two over the median: PPLs without each sub-layer 150, 120, 100.5, 100.9, 103,
    99.8, 100.1, 108; median (100.9 + 103) / 2 = 101.95; log10(135 / 101.95) = 0.121947."""
    assert LI.redundant_share({"ppl_full": 40.0, "delta_ppl": [0.39, 0.4, -1.0, 0.0, 0.0]}, 0.01, 0.5) == 2 / 3
    ab = {"ppl_full": 100.0, "delta_ppl": [50.0, 20.0, 0.5, 0.9, 3.0, -0.2, 0.1, 8.0]}
    assert LI.first_critical(ab) == pytest.approx(0.121947, abs=1e-6)
