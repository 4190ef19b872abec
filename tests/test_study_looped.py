"""The looped study (keel/configs/studies/looped.toml): its group keys (loop, test_loops), its claims'
rules checked against direct transcriptions of their text (written from the rule, not from keel's
code), its cpu plan, and the tiny scale end to end."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from keel.errors import KeelError
from keel.experiments.record import RunRecord
from keel.experiments.study import claims as SC
from keel.experiments.study import plan as SPlan
from keel.experiments.study import run as SRun
from keel.experiments.study import spec as SS
from keel.experiments.study import verdicts as SV
from keel.experiments.study.claims import loop_max_lr as LM
from keel.experiments.study.claims import test_depth as TD

H1 = 5.0  # a unigram entropy (nats): the plateau level is 0.95 x 5.0 = 4.75
LRS = (1e-3, 3e-3, 1e-2)
DEPTHS = (68, 260, 1028)  # the cpu scale's: loop [1, 8, 1], R = 4, 16, 64


def run(group, scheme, L, seed, lr, final, exit_step=50, **kw):
    """A finished looped run's record, named as the study names it."""
    return RunRecord(group=group, name=f"L{L}_seed{seed}_{scheme}_lr{lr:g}", scheme=scheme, sublayers=L, seed=seed,
                     lr=lr, status="done", final_val_loss=final, first_val_loss=6.2,
                     capped_loss=final if final is not None and math.isfinite(final) else 6.2,
                     plateau_exit_step=exit_step, unigram_entropy=H1, **kw)


def cpu_study():
    return SC.load_study("looped", "cpu")


def t_interval(xs):
    """(lo, hi): the one-sided 95% Student-t bounds of the mean, from scipy's two-sided 90% interval."""
    return stats.t.interval(0.9, len(xs) - 1, loc=np.mean(xs), scale=stats.sem(xs))


# ----------------------------------------------------------------------------- the group keys
def test_a_loop_group_trains_effective_depths_named_by_them():
    g = next(x for x in cpu_study().groups if x.name == "looped")
    assert [g.loop_repeats(L) for L in DEPTHS] == [4, 16, 64]  # (L/2 - P - Q) / C
    assert g.loop_sets(260) == [("model.n_layers", 10), ("model.loop_prelude", 1), ("model.loop_core", 8),
                                ("model.loop_repeats", 16)]
    assert [g.test_counts(L) for L in DEPTHS] == [[2, 8], [8, 32], [32, 128]]  # R/2 and 2R
    jobs = SPlan.planned_jobs(cpu_study(), "<data>", Path("unused"))[0][2]
    j = next(j for j in jobs if j.name == "L1028_seed2_pre_ln_lr0.01")
    m = j.config["model"]
    assert (m["n_layers"], m["loop_prelude"], m["loop_core"], m["loop_repeats"], m["loop_sampling"]) == \
        (10, 1, 8, 64, "poisson_lognormal")


@pytest.mark.parametrize("spec, words", [
    ({"loop": [1, 8, 1], "sublayers": [70]}, "sublayers 70 is not an effective depth of loop [1, 8, 1]"),
    ({"loop": [1, 8, 1], "sublayers": [2]}, "sublayers 2 is not an effective depth"),
    ({"loop": [1, 0, 1], "sublayers": [68]}, "loop must be [P, C, Q] (prelude, core, coda blocks) with C >= 1"),
    ({"loop": [1, 8], "sublayers": [68]}, "loop must be [P, C, Q]"),
    ({"test_loops": [2.0], "sublayers": [68]}, "test_loops needs loop = [P, C, Q]"),
    ({"loop": [1, 1, 1], "sublayers": [6], "test_loops": [0.2]}, "test_loops 0.2 x R = 0.2 at 6 sub-layers rounds below 1"),
    ({"loop": [1, 8, 1], "sublayers": [68], "set": {"model.loop_repeats": 3}}, "set model.loop_repeats: loop = [1, 8, 1]"),
    # R' above --loops' cap max(64, 16 R) (keel.config.max_loops): R = 4 x 1000 would evaluate for days
    ({"loop": [1, 8, 1], "sublayers": [68], "test_loops": [0.5, 1000.0]},
     "test_loops 1000 x R = 4000 at 68 sub-layers is above 64, the cap of --loops"),
    ({"loop": [1, 8, 1], "sublayers": [1028], "test_loops": [16.5]},
     "test_loops 16.5 x R = 1056 at 1028 sub-layers is above 1024, the cap of --loops (max(64, 16 x R (64) = 1024))"),
])
def test_a_bad_loop_is_refused_in_one_line(spec, words):
    with pytest.raises(KeelError) as e:
        SS._group("g", {"schemes": ["keel"], "seeds": [0], "lrs": [1e-3], **spec}, {})
    assert words in str(e.value) and "\n" not in str(e.value)


def test_test_loops_is_kept_in_the_record_and_optional_in_a_report():
    d = {"group": "looped", "name": "L68_seed0_keel_lr0.001", "scheme": "keel", "sublayers": 68, "seed": 0,
         "lr": 1e-3, "status": "done", "tokens": 8, "final_val_loss": 4.0, "first_val_loss": 6.2, "capped_loss": 4.0,
         "verdict": "healthy", "divergence": None, "diverged": False, "max_lr": None, "peak_lr": None, "wall_s": 1.0,
         "plateau_exit_step": 50, "curve": None}
    rec = RunRecord.from_dict({**d, "test_loops": {"2": 4.3, "8": None}})
    assert rec.test_loops == {"2": 4.3, "8": None} and rec.to_dict()["test_loops"] == {"2": 4.3, "8": None}
    old = RunRecord.from_dict(d)  # a report written before test_loops: it loads, and is written back as it was
    assert old.test_loops is None and old.to_dict() == d
    for bad in ({"0": 4.0}, {"x": 4.0}, {"2": -1.0}, [4.0]):
        with pytest.raises(KeelError, match="test_loops must be"):
            RunRecord.from_dict({**d, "test_loops": bad})


# ----------------------------------------------------------------------------- (a) max LR over the grid
def test_trains_follows_its_rule():
    """Trains: finished, left the plateau, final validation loss finite and below 0.95 H1."""
    assert LM.trains(run("g", "keel", 68, 0, 1e-3, 4.0))
    assert not LM.trains(run("g", "keel", 68, 0, 1e-3, 4.0, exit_step=None))  # never left the plateau
    assert not LM.trains(run("g", "keel", 68, 0, 1e-3, math.nan))  # not finite
    assert not LM.trains(run("g", "keel", 68, 0, 1e-3, 4.8))  # left it, but ended above 4.75


def test_max_trained_lr_follows_its_rule():
    runs = lambda ok: [run("g", "keel", 68, 0, lr, 4.0 if t else 5.5) for lr, t in zip(LRS, ok)]
    assert LM.max_trained_lr(runs([True, True, False])) == (3e-3, "exact")
    assert LM.max_trained_lr(runs([True, True, True])) == (1e-2, "top")  # a lower bound
    lr, how = LM.max_trained_lr(runs([False, False, False]))  # one grid step below the lowest: 1e-3 / 3
    assert how == "none" and lr == pytest.approx(1e-3 ** 2 / 3e-3)


def grid(group, scheme, L, seed, top):
    """Three LR runs of one cell: those up to ``top`` (an LR, or None) train, the others end on the plateau."""
    return [run(group, scheme, L, seed, lr, 4.0 if top is not None and lr <= top else 5.5) for lr in LRS]


def test_loop_max_lr_transcription():
    """d = log10(maxLR(keel) / maxLR(pre_ln)) per seed; reproduced when the lower t bound clears log10 1.05; a
    seed where both train at their highest LR is left out; a depth where neither trains is not judged."""
    st, runs = cpu_study(), []
    pre = {0: 3e-3, 1: 1e-3, 2: 3e-3}
    for g in ("looped", "looped-init"):
        for L in DEPTHS:
            for sd in (0, 1, 2):
                if L == 1028:  # neither trains at any LR: reported, not judged
                    runs += grid(g, "keel", L, sd, None) + grid(g, "pre_ln", L, sd, None)
                elif g == "looped":
                    runs += grid(g, "keel", L, sd, 1e-2) + grid(g, "pre_ln", L, sd, pre[sd])
                else:  # seed 0: both at their highest LR (censored alike: left out)
                    runs += grid(g, "keel", L, sd, 1e-2) + grid(g, "pre_ln", L, sd, 1e-2 if sd == 0 else 3e-3)
    claim = next(c for c in st.claims if c.id == "a")
    v = claim.verdict(st, runs)
    paper = v.conditions["paper_init"]
    d = [math.log10(1e-2 / pre[sd]) for sd in (0, 1, 2)]
    lo, hi = t_interval(d)
    part = paper.parts["log10 max LR, keel over pre_ln at 68"]
    assert part.lo == pytest.approx(lo) and part.hi == pytest.approx(hi) and lo >= math.log10(1.05)
    assert sorted(paper.parts) == ["log10 max LR, keel over pre_ln at 260", "log10 max LR, keel over pre_ln at 68"]
    assert paper.verdict == SV.REPRODUCED and paper.rows[-1].neither
    embed = v.conditions["embed_init"]
    assert embed.parts["log10 max LR, keel over pre_ln at 68"].n == 2 and embed.verdict == SV.INCONCLUSIVE
    assert v.verdict == SV.INCONCLUSIVE
    table = "\n".join(claim.tables(v))
    assert "[s0 0.003, s1 0.001, s2 0.003]" in table and "[s0 0.01+, s1 0.01+, s2 0.01+]" in table
    assert "neither trains" in table


# ----------------------------------------------------------------------------- (c, d) test-time depth
def loops_run(group, scheme, L, seed, lr, final, at_half, at_double, R):
    return run(group, scheme, L, seed, lr, final, test_loops={str(R // 2): at_half, str(2 * R): at_double})


def test_test_depth_transcription():
    """Per depth and seed, at the seed's best LR, d = loss(2R) − loss(R); reproduced ("more loops do not hurt")
    when the upper t bound is below the floor, not reproduced when the lower bound reaches it."""
    st, runs = cpu_study(), []
    keel_d = {0: 0.001, 1: -0.004, 2: 0.003}
    pre_d = {0: 0.30, 1: 0.42, 2: 0.35}
    for g in ("looped", "looped-init"):
        for L, R in zip(DEPTHS, (4, 16, 64)):
            for sd in (0, 1, 2):
                base = 4.0 + 0.01 * sd
                # the best LR (lowest final loss) is 3e-3; the other LRs' test loops must not be read
                for lr, off in zip(LRS, (0.2, 0.0, 0.1)):
                    runs.append(loops_run(g, "keel", L, sd, lr, base + off, base + off + 0.5,
                                          base + off + keel_d[sd] + (9.0 if off else 0.0), R))
                    runs.append(loops_run(g, "pre_ln", L, sd, lr, base + 0.3 + off, None,
                                          base + 0.3 + off + pre_d[sd], R))
    keel_claim, pre_claim = (next(c for c in st.claims if c.id == i) for i in ("c", "d"))
    v = keel_claim.verdict(st, runs)
    part = v.conditions["paper_init"].parts["loss(128) − loss(64), keel at 1028"]
    lo, hi = t_interval(list(keel_d.values()))
    assert part.hi == pytest.approx(hi) and part.lo == pytest.approx(lo) and hi < 0.02
    assert part.verdict == SV.REPRODUCED and v.verdict == SV.REPRODUCED
    row = v.conditions["paper_init"].rows[0]
    assert row.loops == 4 and row.d["keel"][2].mean == pytest.approx(0.5)  # R/2, reported
    # pre_ln's R/2 loss is not finite: it counts as the step-0 loss (6.2)
    assert row.d["pre_ln"][2].diffs[1] == pytest.approx(6.2 - 4.31)
    assert row.vs[8].diffs == pytest.approx({sd: keel_d[sd] - pre_d[sd] for sd in (0, 1, 2)})
    w = pre_claim.verdict(st, runs)
    assert w.conditions["embed_init"].parts["loss(32) − loss(16), pre_ln at 260"].verdict == SV.NOT_REPRODUCED
    assert w.verdict == SV.NOT_REPRODUCED
    assert "| 1028 | 64 | 128 |" in "\n".join(keel_claim.tables(v))


@pytest.mark.parametrize("user_sets, sampling", [([], "poisson_lognormal"), (["model.loop_sampling=fixed"], "fixed"),
                                                 (["model.loop_sampling=uniform"], "uniform")])
def test_test_depth_states_the_loop_sampling_its_runs_trained_with(user_sets, sampling):
    """Claim (c) at the tiny scale: the line under its table and report.json's ``loop_sampling`` give the
    model.loop_sampling of the runs read, as the study sets it (the scale's groups, or the user's --set); the note
    says what the shipped scales set, not what every run was trained with. With --set model.loop_sampling=fixed
    the report still said the runs drew a random count per step (poisson_lognormal)."""
    st = SC.load_study("looped", "tiny", user_sets)
    runs = [loops_run(g, x, L, sd, 3e-3, 4.0 + 0.01 * sd, 4.2, 4.0 + 0.01 * sd + (0.002 if x == "keel" else 0.3), R)
            for g in ("looped", "looped-init") for L, R in ((8, 2), (12, 4)) for sd in (0, 1) for x in ("keel", "pre_ln")]
    claim = next(c for c in st.claims if c.id == "c")
    v = claim.verdict(st, runs)
    assert v.loop_sampling == {"looped": sampling, "looped-init": sampling}
    assert v.to_dict()["loop_sampling"] == v.loop_sampling and list(v.to_dict())[-1] == "loop_sampling"
    assert v.conditions["paper_init"].rows[1].loops == 4
    lines = claim.tables(v)
    assert lines[-1].endswith(f"The runs read trained with model.loop_sampling = {sampling}: "
                              f"{TD.SAMPLING_WORDS[sampling]}.")
    assert ("never trained at" in lines[-1]) == (sampling == "fixed")
    assert "Every shipped scale sets" in claim.note and "Trained with" not in claim.note
    # groups that differ: each is named with its own
    assert TD.sampling_words({"looped": "fixed", "looped-init": "uniform"}) == (
        f"The runs read trained with model.loop_sampling = fixed in looped ({TD.SAMPLING_WORDS['fixed']}); uniform "
        f"in looped-init ({TD.SAMPLING_WORDS['uniform']}).")


def test_test_depth_claims_need_looped_groups_with_the_factor(tmp_path):
    text = (SS.resolve_config_path("looped", kind="studies")).read_text()
    bad = tmp_path / "bad.toml"
    bad.write_text(text.replace("factor = 2.0\nnote", "factor = 3.0\nnote", 1))
    with pytest.raises(KeelError, match="factor 3 is not one of the groups' test_loops"):
        SC.load_study(str(bad), "cpu")


@pytest.mark.parametrize("old, new, words", [
    # claim (a) reads no test_loops: groups that differ only there are one geometry for it
    ("test_loops = [0.5, 2.0]\n\n[groups.looped-init]", "test_loops = [0.5, 2.0, 3.0]\n\n[groups.looped-init]",
     "claim 'c': its groups' test_loops differ: looped [0.5, 2, 3], looped-init [0.5, 2]"),
    ("loop = [1, 8, 1]\ntest_loops = [0.5, 2.0]\n\n[groups.looped-init]",
     "loop = [2, 8, 0]\ntest_loops = [0.5, 2.0]\n\n[groups.looped-init]",
     "claim 'a': its groups' loop differ: looped [2, 8, 0], looped-init [1, 8, 1]"),
])
def test_claim_groups_of_two_geometries_name_what_differs(tmp_path, old, new, words):
    """The groups a looped claim reads must share a loop (and, for test_depth, test_loops); the one-line
    refusal names the key that differs and each group's value (it said "must be looped ... (check looped)"
    of two looped groups that differed in test_loops alone)."""
    text = (SS.resolve_config_path("looped", kind="studies")).read_text()
    assert old in text
    bad = tmp_path / "bad.toml"
    bad.write_text(text.replace(old, new, 1))
    with pytest.raises(KeelError) as e:
        SC.load_study(str(bad), "cpu")
    assert words in str(e.value) and "\n" not in str(e.value)


# ----------------------------------------------------------------------------- the report's figure
def test_the_loss_against_lr_figure_draws_each_cell_s_widened_lrs(tmp_path, monkeypatch):
    """looped.png drew every cell over the group's three LRs only: Keel's run at 3.33e-4 at 1,028
    sub-layers (widened below its optimum at 1e-3) was in the report's tables but not in the figure."""
    import matplotlib.pyplot as plt

    from keel.experiments import sensitivity as LS
    from keel.experiments.study import report as SR

    figs = []
    monkeypatch.setattr(LS, "save_figure", lambda fig, out: figs.append(fig))
    keel_lrs = (3.33e-4, *LRS)
    runs = ([run("looped", "keel", 1028, sd, lr, 5.0 + abs(math.log10(lr / 1e-3)) / 10) for sd in range(3)
             for lr in keel_lrs]
            + [run("looped", "pre_ln", 1028, sd, lr, 5.3) for sd in range(3) for lr in LRS])
    assert SR.write_plots(cpu_study(), runs, [], tmp_path, H1) == ["looped.png"]
    (ax,) = figs[0].axes
    drawn = {c.get_label().split(" ")[0]: [float(x) for x in c.lines[0].get_xdata()] for c in ax.containers}
    assert drawn == {"keel": list(keel_lrs), "pre_ln": list(LRS)}
    keel_line = next(c for c in ax.containers if c.get_label().startswith("keel")).lines[0]
    assert list(keel_line.get_ydata()) == pytest.approx([5.0 + abs(math.log10(lr / 1e-3)) / 10 for lr in keel_lrs])
    plt.close(figs[0])


# ----------------------------------------------------------------------------- the plan and the tiny scale
def test_the_cpu_plan_fits_its_budget(keel_main, tmp_path):
    r = keel_main("study", "looped", "--scale", "cpu", "--dry-run", "--json", "--out", tmp_path / "x")
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert plan["total"]["runs"] == 108 and 14 <= plan["total"]["cpu_hours"] <= 20
    rows = {x["group"]: x for x in plan["groups"]}
    assert rows["looped"]["sublayers"] == [68, 260, 1028] and rows["looped"]["tokens_per_run"] == [204_800]
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("mode, k, n, sampling", [("none", 2, 0, "fixed"), ("block", 2, 0, "fixed"),
                                                  ("every_k", 2, 0, "fixed"), ("every_k", 3, 0, "fixed"),
                                                  ("block", 2, 4, "uniform"), ("block", 2, 99, "uniform")])
def test_the_plan_prices_the_forwards_checkpointing_recomputes(mode, k, n, sampling):
    """recompute_share, cpu_hours and the GPU-hours, written from their definitions: the recomputed share of the
    applied blocks (checkpointed blocks of weights over all; with min_loops n, only the steps that draw >= n,
    weighted by P + count C + Q blocks); a GPU does one more forward per recomputed block, 1/3 of the training
    FLOPs (PaLM App. B); the CPU 0.7 of a step's time (measured, plan.CPU_RECOMPUTE)."""
    from keel.config import Config, ModelConfig, TrainConfig
    from keel.model import loop_count

    m = ModelConfig(vocab_size=61, d_model=16, n_heads=2, n_kv_heads=1, d_ff=24, n_layers=4, loop_prelude=1,
                    loop_core=2, loop_repeats=3, loop_sampling=sampling)
    t = TrainConfig(steps=60, seed=5, activation_checkpointing=mode, activation_checkpoint_k=k,
                    activation_checkpoint_min_loops=n)
    chosen = {"none": 0, "block": 4, "every_k": len(range(0, 4, k))}[mode]  # blocks 0, k, 2k, ... of 4
    counts = [loop_count(m, 5, s) or 3 for s in range(60)]
    applied = [1 + 2 * c + 1 for c in counts]
    want = chosen / 4 * (sum(a for a, c in zip(applied, counts) if c >= n) / sum(applied) if n else 1)
    got = SPlan.recompute_share(Config(model=m, train=t))
    assert got == pytest.approx(want, rel=1e-12)
    if n == 4:
        assert 0 < got < 1 and min(counts) < 4 <= max(counts)
    if n == 99:
        assert got == 0
    tokens, flops = 204_800, 3.3e12
    assert SPlan.cpu_hours(tokens, flops, got) == pytest.approx(
        (tokens * 2.74e-4 + flops / 4.04e10 + 0.7 * got * flops / 4.04e10) / 3600, rel=1e-12)


def test_a_plans_gpu_hours_count_the_recomputed_forwards(tmp_path):
    """Block checkpointing on every run of a scale costs 4/3 of its GPU-hours without (gpu-1 of the looped study:
    every run checkpoints every step)."""
    with_ac = SPlan.plan_rows(SC.load_study("looped", "gpu-1"), "<data>", tmp_path / "x", 0.35, 989)
    plain = SC.load_study("looped", "gpu-1", ["train.activation_checkpointing=none"])
    without = SPlan.plan_rows(plain, "<data>", tmp_path / "x", 0.35, 989)
    assert len(with_ac) == len(without) == 2
    for a, b in zip(with_ac, without):
        assert a["flops"] == b["flops"] and a["gpu_hours"] == pytest.approx(b["gpu_hours"] * 4 / 3, rel=1e-12)


def test_the_plan_gives_each_schemes_tokens_per_parameter_where_they_differ(keel_main, tmp_path):
    """The dry run's 'tokens per non-embedding parameter, by depth' gives keel's and pre_ln's own ratios (Keel's
    extra norm gains make its count larger: 0.389 vs 0.39): it showed keel's alone, as every scheme's."""
    from dataclasses import replace

    from keel.config import config_from_dict
    from keel.model import count_parameters

    study = SC.load_study("looped", "cpu")
    want: dict[int, dict[str, float]] = {}
    for g, _, jobs in SPlan.planned_jobs(study, "<data>", tmp_path / "x"):
        if g.name == "looped":
            for j in jobs:
                m = config_from_dict(j.config).model
                n = count_parameters(replace(m, vocab_size=256) if m.vocab_size == "auto" else m, non_embedding=True)
                want.setdefault(m.n_sublayers, {})[m.residual] = 204_800 / n
    assert {L: sorted(by) for L, by in want.items()} == {L: ["keel", "pre_ln"] for L in (68, 260, 1028)}
    r = keel_main("study", "looped", "--scale", "cpu", "--dry-run", "--json", "--out", tmp_path / "x")
    rows = {x["group"]: x for x in json.loads(r.stdout)["groups"]}
    got = {int(L): by for L, by in rows["looped"]["tokens_per_param_by_scheme"].items()}
    assert got.keys() == want.keys() and all(got[L] == pytest.approx(want[L], rel=1e-9) for L in want)
    assert f"{want[68]['keel']:.3g}" != f"{want[68]['pre_ln']:.3g}"  # the weights loop: one ratio at every depth
    assert rows["looped"]["tokens_per_param"] == {str(L): pytest.approx(by["keel"]) for L, by in want.items()}
    md = keel_main("study", "looped", "--scale", "cpu", "--dry-run", "--out", tmp_path / "x").stdout
    cell = "; ".join(f"{L}: keel {want[L]['keel']:.3g}, pre_ln {want[L]['pre_ln']:.3g}" for L in (68, 260, 1028))
    assert cell.startswith("68: keel 0.389, pre_ln 0.39; 260: keel 0.389") and f"| {cell} |" in md


@pytest.mark.parametrize("scale, limit, min_loops", [("cpu", 2.6 * 2**30, 128), ("gpu-1", 40e9, 0)])
def test_every_run_keeps_its_largest_drawn_depth_in_memory_by_checkpointing(tmp_path, scale, limit, min_loops):
    """poisson_lognormal draws up to about 4R core applications; a 1,028-sub-layer step at seed 1's largest draw
    over the cpu runs (247) peaked at 13.6 GiB of RSS without activation checkpointing (two workers: past the 24 GiB
    here). Every run of both scales checkpoints each applied block, the cpu runs only on the steps that draw at
    least 128 applications (7.3 GiB measured at 127 without it), so a step's activations, sized by
    keel.train.device.activation_floor_bytes at the run's own largest draw, stay under 2.6 GiB per cpu run and
    under 40 GB per gpu-1 micro-batch (an H100 has 80; without checkpointing the floor alone is over 9x)."""
    from dataclasses import replace

    from keel.config import config_from_dict
    from keel.model import largest_loop_count
    from keel.train.device import activation_floor_bytes

    study = SC.load_study("looped", scale)
    floors, deep = {}, 0
    for g, _, jobs in SPlan.planned_jobs(study, "<data>", tmp_path / "x"):
        for j in jobs:
            cfg = config_from_dict(j.config)
            assert cfg.train.activation_checkpointing == "block", j.name
            assert cfg.train.activation_checkpoint_min_loops == min_loops, j.name
            floors[g.name, j.name] = activation_floor_bytes(cfg.model, cfg.train)
            plain = activation_floor_bytes(cfg.model, replace(cfg.train, activation_checkpointing="none"))
            largest = largest_loop_count(cfg.model, cfg.train.seed, cfg.train.steps)
            if not min_loops:
                assert plain > 9 * floors[g.name, j.name], j.name
                continue
            deep += largest >= min_loops  # the floor: the steps that keep every activation, at most 127 applications
            plain_below = activation_floor_bytes(cfg.model, replace(cfg.train, activation_checkpointing="none"),
                                                 loops=min(largest, min_loops - 1))
            assert floors[g.name, j.name] == plain_below and (plain > plain_below) == (largest >= min_loops)
    assert len(floors) == 108 and max(floors.values()) < limit
    assert max(floors, key=floors.get)[1].startswith("L1028_")
    if scale == "cpu":  # every run at 1,028 sub-layers draws past 128 in some step (and checkpoints it), none below
        assert deep == 36
    if scale == "gpu-1":  # 32 x 2048 tokens per step, as 4 micro-batches of 8
        train = config_from_dict(next(iter(SPlan.planned_jobs(study, "<data>", tmp_path / "x")))[2][0].config).train
        assert (train.batch_size, train.grad_accum, train.seq_len) == (8, 4, 2048)
        assert max(floors.values()) > 30e9  # at a micro-batch of 32 it would be 4x: past the H100


@pytest.mark.parametrize("key", ["model.loop_prelude", "model.loop_core", "model.loop_repeats"])
def test_a_set_of_a_key_the_loop_groups_set_per_run_is_refused(keel_main, tmp_path, key):
    # loop_core and loop_prelude were silently overridden by each group's loop = [P, C, Q] (the plan unchanged);
    # loop_repeats was refused as "needs a loop: set model.loop_core >= 1", which the study does set
    r = keel_main("study", "looped", "--scale", "cpu", "--dry-run", "--set", f"{key}=2", "--out", tmp_path / "x")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert f"--set {key} is set by the study's looped groups" in r.stderr and "needs a loop" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "x").exists()


def test_a_scale_set_of_a_key_the_loop_groups_set_per_run_is_refused(tmp_path):
    text = (SS.resolve_config_path("looped", kind="studies")).read_text()
    bad = tmp_path / "bad.toml"
    bad.write_text(text.replace('[scales.cpu.set]\n', '[scales.cpu.set]\n"model.loop_core" = 4\n', 1))
    with pytest.raises(KeelError, match=r"study scale 'cpu': set model.loop_core: the looped groups' loop = \[P, C, Q\]"):
        SC.load_study(str(bad), "cpu")


def test_a_set_of_the_loop_sampling_reaches_every_looped_run(keel_main, tmp_path):
    # it was refused ("needs a loop") by the check of the study's base config, which has no loop
    r = keel_main("study", "looped", "--scale", "cpu", "--dry-run", "--json", "--set", "model.loop_sampling=uniform",
                  "--out", tmp_path / "x")
    assert r.returncode == 0, r.stderr
    study = SC.load_study("looped", "cpu", ["model.loop_sampling=uniform"])
    jobs = [j for _, _, js in SPlan.planned_jobs(study, "<data>", tmp_path / "x") for j in js]
    assert len(jobs) == 108 and {j.config["model"]["loop_sampling"] for j in jobs} == {"uniform"}


@pytest.mark.long  # 16 tiny runs, each evaluated at two more loop counts: about 20 s on an idle core
def test_looped_study_tiny_end_to_end(tiny_data, tmp_path, keel_main):
    """Trains the tiny scale, evaluates each run at its test loop counts and judges every claim; then
    ``--report-only`` and ``--resume`` on its folder without ``--scale`` take the scale it was started at."""
    import torch

    from keel.data import validation_tokens
    from keel.run import Run
    from keel.train.nll import mean_nll

    out = tmp_path / "st"
    report = SRun.run_study("looped", "tiny", out, [f"data.path={tiny_data}"], workers=0,
                            command=f"keel study looped --scale tiny --set data.path={tiny_data}")
    recs = report["records"]
    assert len(recs) == 16 and all(r.status == "done" for r in recs)
    assert sorted({r.sublayers for r in recs}) == [8, 12]  # effective depths, from 3 blocks of weights
    assert all(set(r.test_loops) == ({"1", "4"} if r.sublayers == 8 else {"2", "8"}) for r in recs)
    # the test loops are scored like the run's own val_loss: at R the same evaluation gives its final loss
    r = next(r for r in recs if r.sublayers == 12 and r.scheme == "keel")
    run_dir = out / r.group / r.name
    model = Run(run_dir).load_model()
    windows = validation_tokens(Run(run_dir).data_dir(), 32, 512)
    torch.manual_seed(0)
    assert mean_nll(model, windows, 2, "cpu") == pytest.approx(r.final_val_loss, abs=1e-6)
    model.set_loops(8)
    assert mean_nll(model, windows, 2, "cpu") == pytest.approx(r.test_loops["8"], abs=1e-6)
    got = {c["id"]: c for c in json.loads((out / "report.json").read_text())["claims"]}
    assert sorted(got) == ["a", "b", "c", "d"]
    assert got["c"]["conditions"]["paper_init"]["rows"][1]["loops"] == 4  # judged (2 seeds: inconclusive)
    assert "test_loops" in json.loads((out / "report.json").read_text())["runs"][0]
    assert "Test-time depth" in (out / "report.md").read_text()
    assert got["c"]["loop_sampling"] == {"looped": "poisson_lognormal", "looped-init": "poisson_lognormal"}
    assert "The runs read trained with model.loop_sampling = poisson_lognormal: 1 + Poisson" in (
        out / "report.md").read_text()
    def verdicts():
        return [(c["id"], c["verdict"]) for c in json.loads((out / "report.json").read_text())["claims"]]

    before = verdicts()
    for flag in ("--report-only", "--resume"):  # both said "study 'looped' has scales (...): give one with --scale"
        r = keel_main("study", "looped", "--out", out, flag)
        assert r.returncode == 0, r.stderr
        assert "(c) inconclusive" in r.stdout and verdicts() == before
        assert json.loads((out / "report.json").read_text())["scale"] == "tiny"
    r = keel_main("study", "claims", "--out", out, "--report-only")
    assert r.returncode == 2 and f"{out} holds study 'looped' at scale 'tiny', not 'claims' at 'tiny'" in r.stderr


def test_the_dry_run_names_the_sets_that_reach_every_run(keel_main, tmp_path):
    """A fresh-user trial: `--dry-run --set model.loop_sampling=uniform` printed the scale's note ("loop count per
    step 1 + Poisson(e^tau) of mean R") and nothing of the --set its runs follow."""
    line = ("Every run also with --set model.loop_sampling=uniform (applied after the scale's keys: where it differs "
            "from them or from the scale's note above, the runs follow the --set).")
    given = keel_main("study", "looped", "--scale", "cpu", "--dry-run", "--out", tmp_path / "x",
                      "--set", "model.loop_sampling=uniform").stdout.splitlines()
    plain = keel_main("study", "looped", "--scale", "cpu", "--dry-run", "--out", tmp_path / "x").stdout.splitlines()
    assert line in given and given.index(line) < next(i for i, x in enumerate(given) if x.startswith("| group"))
    assert not any(x.startswith("Every run also with --set") for x in plain)
