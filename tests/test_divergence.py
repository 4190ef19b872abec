"""Divergence classifier: each of the paper's three failure modes, thresholds, online use, real runs."""

import json
import math
import random

import pytest

from keel.experiments.training import train_run

from conftest import REPO, tiny_overrides

from keel.config import load_config
from keel.diagnostics.divergence import (
    DEGRADATION,
    HEALTHY,
    INSTABILITY,
    STAGNATION,
    OnlineDivergenceMonitor,
    Thresholds,
    Verdict,
    build_monitor,
    classify,
    classify_metrics,
    read_reference,
)
from keel.errors import KeelError
from keel.train import TrainingStopped, train

T = Thresholds()


def decay(n, l0=7.0, floor=3.0, tau=30.0, noise=0.0, seed=0):
    """A healthy-looking curve: floor + (l0 - floor) exp(-(t-1)/tau) (+ uniform noise), steps 1..n."""
    rng = random.Random(seed)
    return [floor + (l0 - floor) * math.exp(-(t - 1) / tau) + noise * (2 * rng.random() - 1) for t in range(1, n + 1)]


def steps(n):
    return list(range(1, n + 1))


def online(losses, lrs=None, **kw):
    """Feed a curve step by step; return (call step at which a verdict came, verdict, later returns)."""
    mon = OnlineDivergenceMonitor(**kw)
    got, later = None, []
    for i, v in enumerate(losses):
        out = mon.update(i + 1, v, None if lrs is None else lrs[i])
        if got is None and out is not None:
            got = (i + 1, out)
        elif got is not None:
            later.append(out)
    return got, later


def ema_baseline(losses, beta=0.9):
    """Direct transcription: ema_t = b ema_{t-1} + (1-b) loss_t, ema_1 = loss_1; baseline = running min."""
    ema, out = losses[0], []
    for v in losses:
        ema = beta * ema + (1 - beta) * v
        out.append(ema)
    return [min(out[:i + 1]) for i in range(len(out))]


# --- healthy and instability ---------------------------------------------------------------

@pytest.mark.parametrize("noise", [0.0, 0.05, 0.2])
def test_healthy_noisy_decay(noise):
    v = classify(steps(400), decay(400, noise=noise, seed=1))
    assert v.mode == HEALTHY and v.step == 400 and not v.diverged


def test_irrecoverable_spike_online_and_offline():
    base = decay(200)
    losses = base + [7.5] * 100
    lrs = [1e-3 * t for t in steps(300)]
    (at, v), later = online(losses, lrs)
    # onset = step 201 (first loss above baseline + margin); decided W = 50 steps later, never before
    assert v.mode == INSTABILITY and v.step == 201 and at == 201 + T.recovery_window
    assert all(x is None for x in later)
    assert v.evidence["lr_at_step"] == pytest.approx(lrs[200]) and v.evidence["lr_before_step"] == pytest.approx(lrs[199])
    assert v.evidence["baseline"] == pytest.approx(ema_baseline(base)[-1])
    assert v.evidence["spike_loss"] == 7.5
    off = classify(steps(300), losses, lrs)
    assert off.to_dict() == v.to_dict()


@pytest.mark.parametrize("high_steps,mode", [(46, HEALTHY), (47, INSTABILITY)])
def test_recovery_window_borderline(high_steps, mode):
    # recovery needs recover_steps (5) low losses in a row, all within W = 50 steps of the onset (201):
    # high for k steps -> the 5th low loss is at step 201 + k + 4 <= 251 iff k <= 46
    losses = decay(200) + [7.5] * high_steps + [3.0] * (150 - high_steps)
    v = classify(steps(350), losses)
    assert v.mode == mode
    if mode == INSTABILITY:
        assert v.step == 201


def test_recoverable_spike_is_healthy():
    losses = decay(200, noise=0.05) + [9.0, 12.0, 8.0, 5.0, 3.5] + decay(195, l0=3.1, floor=2.9, noise=0.05)
    assert classify(steps(400), losses).mode == HEALTHY


@pytest.mark.parametrize("jump,mode", [(0.29, HEALTHY), (0.31, INSTABILITY)])
def test_spike_height_borderline(jump, mode):
    # 10 -> 3 then flat: baseline -> 3.0, noise -> 0, margin = max(0.1, 0.1 * 3.0, 0) = 0.3
    losses = decay(60, l0=10.0, floor=3.0, tau=5.0) + [3.0] * 140 + [3.0 + jump] * 80
    v = classify(steps(280), losses)
    assert v.mode == mode
    if mode == INSTABILITY:
        assert v.step == 201 and v.evidence["margin"] == pytest.approx(0.3, abs=1e-4)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("where", [1, 5, 150])
def test_non_finite_is_instability_at_once(bad, where):
    losses = decay(200)
    losses[where - 1] = bad
    (at, v), later = online(losses)
    assert v.mode == INSTABILITY and v.step == where and at == where and v.evidence["non_finite"] == 1.0
    assert all(x is None for x in later)
    json.dumps(v.to_dict(), allow_nan=False)  # JSON-safe


def test_open_spike_at_end_of_curve():
    # offline only: a spike that never comes back before the curve ends counts after end_open_steps steps
    base = decay(100)
    assert classify(steps(105), base + [8.0] * 5).mode == INSTABILITY
    assert classify(steps(104), base + [8.0] * 4).mode == HEALTHY


@pytest.mark.parametrize("n", [0, 1, 2, 9])
def test_short_curves(n):
    v = classify(steps(n), decay(n))
    assert v.mode == HEALTHY and v.step == n


def test_spike_in_the_first_steps():
    # an explosion right after step 1 (absurd LR) is caught: margin = max(0.1, 0.1 * L0) before the noise settles
    losses = [6.25, 18.6, 59.6, 105.8] + [100.0 - t for t in range(60)]
    v = classify(steps(len(losses)), losses)
    assert v.mode == INSTABILITY and v.step == 2


# --- stagnation -----------------------------------------------------------------------------

@pytest.mark.parametrize("floor,mode", [(7.05, STAGNATION), (6.95, HEALTHY)])
def test_stagnation_progress_borderline(floor, mode):
    # L0 = 10; without a reference "behind" = progress < min_progress * L0 = 3.0 nats
    losses = decay(300, l0=10.0, floor=floor, tau=5.0)
    v = classify(steps(300), losses)
    assert v.mode == mode
    if mode == STAGNATION:
        assert v.evidence["progress"] < 3.0 and v.evidence["expected_progress"] == pytest.approx(3.0)


def test_stagnation_step_is_plateau_start():
    losses = decay(300, l0=10.0, floor=8.0, tau=5.0)
    base = ema_baseline(losses)
    # transcription of the improvement rule: anchor moves when baseline < anchor - tol * (L0 - anchor)
    anchor, start = losses[0], 1
    for t, b in enumerate(base, start=1):
        if b < anchor - T.plateau_tol * (losses[0] - anchor):
            anchor, start = b, t
    (at, v), _ = online(losses)
    assert v.mode == STAGNATION and v.step == start and at == start + T.plateau_steps
    assert 5 < start < 60 and v.evidence["plateau_steps"] == T.plateau_steps


def test_plateau_length_borderline():
    # stagnation is declared exactly plateau_steps (100) steps after the plateau began, not one earlier
    losses = decay(300, l0=10.0, floor=8.0, tau=5.0)
    start = classify(steps(300), losses).step
    assert classify(steps(start + T.plateau_steps), losses[:start + T.plateau_steps]).mode == STAGNATION
    assert classify(steps(start + T.plateau_steps - 1), losses[:start + T.plateau_steps - 1]).mode == HEALTHY


# --- degradation (needs a reference) --------------------------------------------------------

@pytest.mark.parametrize("ratio,mode", [(0.45, DEGRADATION), (0.55, HEALTHY), (1.0, HEALTHY)])
def test_degradation_against_reference(ratio, mode):
    ref = decay(300, l0=7.0, floor=2.0, tau=150.0)
    # progress exactly `ratio` of the reference's (the EMA is linear, so it carries over)
    losses = [7.0 - ratio * (7.0 - r) for r in ref]
    v = classify(steps(300), losses, reference=(steps(300), ref))
    assert v.mode == mode
    if mode == DEGRADATION:
        ref_p = [7.0 - b for b in ema_baseline(ref)]
        first = next(t for t in steps(300) if ref_p[t - 1] >= T.min_ref_progress * 7.0)  # reference has moved
        assert v.step == first and v.evidence["streak_steps"] == T.degrade_steps
        assert v.evidence["progress"] == pytest.approx(ratio * v.evidence["ref_progress"], rel=1e-6)
    # without a reference the same curve is never called degraded
    assert classify(steps(300), losses).mode != DEGRADATION


def test_verdict_roundtrip_and_summary():
    v = classify(steps(300), decay(200) + [7.5] * 100, [1e-3] * 300)
    d = json.loads(json.dumps(v.to_dict()))
    assert Verdict.from_dict(d) == v
    s = v.summary()
    assert "instability" in s and "201" in s and "\n" not in s
    assert classify([], []).summary() == "healthy through step 0"


def test_bad_input():
    with pytest.raises(ValueError, match="same length"):
        classify([1, 2], [1.0])
    with pytest.raises(ValueError):
        OnlineDivergenceMonitor(reference=([1], [float("nan")]))


@pytest.mark.parametrize("steps", [[1, 3, 2, 4], [1, 2, 2, 3]])
def test_steps_that_do_not_increase_are_refused(steps):
    """A curve's steps out of order (or repeated) were accepted and judged: a spike's length and the
    plateau's patience are counted in steps, so the verdict's step and evidence were wrong without a word."""
    with pytest.raises(ValueError, match=rf"steps must increase: step {steps[2]} \(position 2\) follows step "
                                         rf"{steps[1]}"):
        classify(steps, [5.0, 4.0, 3.0, 2.0])


# --- real runs --------------------------------------------------------------------------------

@pytest.fixture
def one_thread():
    """Tiny models run fastest on one thread on a loaded machine; restored afterwards."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _metrics(run):
    return [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]


def test_real_runs_healthy_and_blown_up(tiny_data, tmp_path, one_thread):
    sets = tiny_overrides(tiny_data, steps=20, eval_every=1000, checkpoint_every=1000)
    ok = tmp_path / "ok"
    train(load_config(REPO / "keel" / "configs" / "demo.toml", sets), ok)
    assert classify_metrics(_metrics(ok)).mode == HEALTHY
    bad = tmp_path / "bad"
    train(load_config(REPO / "keel" / "configs" / "demo.toml", sets + ["train.lr=3.0"]), bad)
    v = classify_metrics(_metrics(bad))
    assert v.mode == INSTABILITY and v.step <= 5


def test_stop_on_divergence(tiny_data, tmp_path, one_thread):
    sets = tiny_overrides(tiny_data, steps=200, lr=3.0, eval_every=1000, checkpoint_every=1000, batch_size=2,
                          seq_len=16, stop_on_divergence=True)
    run = tmp_path / "crazy"
    with pytest.raises(TrainingStopped, match="stop_on_divergence"):
        train_run(load_config(REPO / "keel" / "configs" / "demo.toml", sets), run)
    recs = _metrics(run)
    div = [r for r in recs if "divergence" in r]
    assert len(div) == 1 and div[0] is recs[-1]
    v = div[0]["divergence"]
    # decided early (blow-up: loss > 2 L0 for 5 steps) or after the recovery window
    assert v["mode"] == INSTABILITY and v["step"] + T.blowup_steps - 1 <= recs[-1]["step"] < v["step"] + T.recovery_window
    # the online verdict equals the offline one on the same curve
    assert classify_metrics(recs).to_dict() == v


# --- issue 10: the three curves, the unigram plateau, the blow-up, online == offline ----------

ISSUE_STEPS = list(range(1, 1001))
OK = [3 + 6 * math.exp(-k / 60) for k in ISSUE_STEPS]  # a healthy run
SLOW = [9 - 4 * k / 1000 for k in ISSUE_STEPS]  # smooth and slow
PLATEAU = [max(5.8, 9 - k / 50) for k in ISSUE_STEPS]  # stuck at 5.8
H1 = 5.97  # unigram entropy of the BPE-1024 corpus the 5.8-5.99 nats plateaus came from


@pytest.mark.parametrize("h1", [None, H1])
def test_issue_curves_with_a_reference(h1):
    ref = (ISSUE_STEPS, OK)
    assert classify(ISSUE_STEPS, OK, reference=ref, unigram_entropy=h1).mode == HEALTHY
    slow = classify(ISSUE_STEPS, SLOW, reference=ref, unigram_entropy=h1)
    assert slow.mode == DEGRADATION and slow.evidence["progress"] < 0.5 * slow.evidence["ref_progress"]
    # the plateau curve is also far slower than the reference from the start: the first failure
    # is a degradation (only the first failure is reported), never "healthy"
    plateau = classify(ISSUE_STEPS, PLATEAU, reference=ref, unigram_entropy=h1)
    assert plateau.mode == DEGRADATION and plateau.step < 160


def test_issue_curves_without_a_reference():
    assert classify(ISSUE_STEPS, OK, unigram_entropy=H1).mode == HEALTHY
    # degradation needs a reference; without one the slow curve (still moving) is healthy
    assert classify(ISSUE_STEPS, SLOW, unigram_entropy=H1).mode == HEALTHY
    v = classify(ISSUE_STEPS, PLATEAU, unigram_entropy=H1)
    level = (1 - T.stagnation_margin) * H1
    assert v.mode == STAGNATION and v.evidence["stagnation_level"] == pytest.approx(level)
    assert v.evidence["baseline"] == pytest.approx(5.8, abs=1e-3) and 150 <= v.step <= 165
    assert "unigram" in v.summary()
    # before the fix: no reference, no unigram entropy -> all three "healthy"
    assert {classify(ISSUE_STEPS, c).mode for c in (OK, SLOW, PLATEAU)} == {HEALTHY}


@pytest.mark.parametrize("vocab_l0", [6.3, 7.0, 9.0, 11.0])
@pytest.mark.parametrize("floor,mode", [(5.68, STAGNATION), (5.66, HEALTHY)])
def test_unigram_stagnation_borderline_and_vocab_free(vocab_l0, floor, mode):
    # level = (1 - 0.05) * 5.97 = 5.6715; the verdict depends on the floor, not on L0 (~ log V)
    losses = decay(400, l0=vocab_l0, floor=floor, tau=10.0)
    assert classify(steps(400), losses, unigram_entropy=H1).mode == mode


def test_blow_up_caught_online_early():
    # the issue's run: post_ln, lr = 3: loss 9 -> 740, still 208 at the end (40 steps)
    losses = [9.0, 9.0, 60.0, 400.0, 740.0, 600.0] + [600 - 12.5 * k for k in range(1, 35)]
    assert losses[-1] == pytest.approx(175.0)
    (at, v), _ = online(losses)
    assert v.mode == INSTABILITY and v.step == 3 and at == 3 + T.blowup_steps - 1
    assert classify(steps(len(losses)), losses).to_dict() == v.to_dict()
    # not a blow-up: a spike to 1.9 L0 that stays up is only decided after the recovery window
    high = decay(100, l0=7.0) + [13.0] * 100
    (at, v), _ = online(high)
    assert v.step == 101 and at == 101 + T.recovery_window


def _replay(records, **kw):
    """Online: feed every logged step, finalize at the end; return (verdict, step when it came)."""
    mon = build_monitor(**kw)
    when = None
    for r in records:
        if "loss" in r and mon.update(r["step"], r["loss"], r.get("lr")) is not None and when is None:
            when = r["step"]
    return mon.finalize(), when


def test_online_equals_offline_on_logged_runs(tiny_data, tmp_path, one_thread):
    from keel.data.stats import dataset_unigram_entropy

    h1 = dataset_unigram_entropy(tiny_data)
    base = tiny_overrides(tiny_data, steps=30, eval_every=1000, checkpoint_every=1000, divergence_warnings=False)
    runs = {}
    for name, extra in (("ok", []), ("post_ln_lr3", ["model.residual=post_ln", "train.lr=3.0"])):
        train(load_config(REPO / "keel" / "configs" / "demo.toml", base + extra), tmp_path / name)
        runs[name] = _metrics(tmp_path / name)
    for name, recs in runs.items():
        for ref in (None, tmp_path / "ok"):
            on, when = _replay(recs, reference_dir=ref, unigram_entropy=h1)
            ref_recs = runs["ok"] if ref else None
            off = classify_metrics(recs, reference=ref_recs, unigram_entropy=h1)
            assert on.to_dict() == off.to_dict(), (name, ref)
    blown, when = _replay(runs["post_ln_lr3"], unigram_entropy=h1)
    assert blown.mode == INSTABILITY and blown.step <= 5 and when is not None and when < 30  # online, before the end
    assert _replay(runs["ok"], reference_dir=tmp_path / "ok", unigram_entropy=h1)[0].mode == HEALTHY


def test_build_monitor_errors(tmp_path):
    with pytest.raises(KeelError, match="not a run directory"):
        build_monitor(tmp_path / "nope")
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0, "val_loss": 6.0}) + "\n")
    with pytest.raises(KeelError, match="no finite training loss"):
        build_monitor(tmp_path)
    assert build_monitor("", 5.0).h1 == 5.0 and build_monitor(None).ref is None


def test_run_verdict_one_vocabulary():
    from keel.diagnostics.divergence import MODES, run_verdict

    recs = [{"step": 0, "val_loss": 7.0}] + [{"step": t, "loss": v, "lr": 1e-3} for t, v in zip(steps(50), decay(50))]
    assert run_verdict(recs).mode == HEALTHY
    # a non-finite validation loss is an instability at that step
    bad = recs + [{"step": 50, "val_loss": float("nan")}]
    v = run_verdict(bad)
    assert v.mode == INSTABILITY and v.step == 50 and v.evidence["non_finite"] == 1.0
    # a stopped run is never healthy: its logged online verdict, else instability at its last step
    logged = dict(recs[-1], divergence={"mode": STAGNATION, "step": 7, "evidence": {}})
    assert run_verdict(recs[:-1] + [logged], stopped="stopped").to_dict()["mode"] == STAGNATION
    v = run_verdict(recs, stopped="max_bad_steps")
    assert v.mode == INSTABILITY and v.step == 50 and "instability at step 50" == v.summary()
    # the classifier's own failure wins over the stop message
    assert run_verdict(recs[:5] + [{"step": 5, "loss": float("inf")}], stopped="x").step == 5
    assert {run_verdict(recs).mode, v.mode} <= set(MODES)


# a slow plateau exit: on the unigram plateau (5.8 > level 5.67) until step 300, then learning
LATE_EXIT = [9 - k / 50 if k < 160 else (5.8 if k < 300 else 3 + 2.8 * math.exp(-(k - 300) / 60)) for k in ISSUE_STEPS]


def test_no_unigram_stagnation_while_the_reference_is_on_the_plateau_too():
    """The stress ramp's Pre-LN run was called stagnant at step 122 against its own reference
    curve (the same run without the stop), which left the plateau at step ~260 and learnt:
    a run on the plateau while its reference is too is not stagnating."""
    before = classify(ISSUE_STEPS, LATE_EXIT, unigram_entropy=H1)  # no reference: the H1 test alone
    assert before.mode == STAGNATION and before.step < 170
    assert classify(ISSUE_STEPS, LATE_EXIT, reference=(ISSUE_STEPS, LATE_EXIT), unigram_entropy=H1).mode == HEALTHY
    # against a reference that left the plateau early the same curve still fails (first failure:
    # degradation, as for PLATEAU in test_issue_curves_with_a_reference)
    assert classify(ISSUE_STEPS, LATE_EXIT, reference=(ISSUE_STEPS, OK), unigram_entropy=H1).mode != HEALTHY
    # a reference that never leaves the plateau does not rescue a run that never leaves it either:
    # the run is "behind" only by H1 once the reference is below the level, so it stays healthy
    # only while both are stuck; a reference that leaves at step 300 makes PLATEAU stagnant after it
    late = classify(ISSUE_STEPS, PLATEAU, reference=(ISSUE_STEPS, LATE_EXIT), unigram_entropy=H1)
    assert late.mode == STAGNATION and late.step >= 150 and late.evidence["stagnation_level"] == pytest.approx(
        (1 - T.stagnation_margin) * H1)


def test_a_bad_divergence_reference_is_refused_before_the_run_folder_is_made(tiny_data, tmp_path, one_thread):
    """It was read at the training start, after the run folder, its config and the step-0
    evaluation were written: a typo left a half-made run behind."""
    sets = tiny_overrides(tiny_data, steps=2, eval_every=1000, checkpoint_every=1000, divergence_warnings=True)
    run = tmp_path / "run"
    missing = tmp_path / "no-such-run"
    with pytest.raises(KeelError, match=f"^divergence reference {missing} is not a run directory"):
        train_run(load_config(REPO / "keel" / "configs" / "demo.toml", sets + [f"train.divergence_reference={missing}"]),
                  run)
    assert not run.exists()


def test_a_reference_with_a_non_finite_loss_reads_it_as_nan(tmp_path):
    """The trainer writes a non-finite loss as ``null``; read_reference raised a TypeError on it (float(None)),
    so a reference run that had one spike to inf could not be a reference at all."""
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in [
        {"step": 1, "loss": 5.5}, {"step": 2, "loss": None}, {"step": 3, "loss": 4.0}, {"step": 3, "val_loss": 4.1}]))
    steps, losses = read_reference(tmp_path)
    assert steps == [1, 2, 3] and losses[0] == 5.5 and math.isnan(losses[1]) and losses[2] == 4.0
    assert build_monitor(tmp_path) is not None  # the trainer's path: it raised the same TypeError
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": None}))
    with pytest.raises(KeelError, match="has no finite training loss"):
        read_reference(tmp_path)
