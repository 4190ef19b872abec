"""``train.precision = "fp16-autocast"``: fp32 master weights, fp16 autocast, ``torch.amp.GradScaler``
loss scaling (:mod:`keel.train.loss_scaling`), on CPU (CPU autocast supports float16).

What is checked: the key is accepted (and is what an old GPU without bf16 is pointed to); every
scheme trains a few fp16 steps to finite losses; the logged gradient norm is the unscaled one
(an fp32 run's first-step norm); an overflow (a huge initial scale) skips the update (weights and
AdamW state unchanged), halves the scale and is counted (``skipped``, ``skipped_steps``, the
progress line); the scaler's state is in every checkpoint (``torch.load(weights_only=True)``) and
a resumed run repeats the uninterrupted one step for step, loss scale included; checkpoints
without scaler state (fp32 runs, older ones) resume into fp16 and back; and the distributed paths
(DDP: GradScaler; FSDP2: ShardedGradScaler) match one process on gloo.
"""

import json
import logging
import math
from pathlib import Path

import pytest
import torch

from conftest import REPO, tiny_overrides
from spawn import truncate_to
from keel import KeelError
from keel.config import load_config
from keel.model import SCHEMES, Transformer
from keel.train import train
from keel.train import loss_scaling as LS
from keel.train.checkpoint import trainer_state_problem
from keel.train.device import autocast_context, resolve_precision
from keel.train.progress import ProgressReporter

FP16 = "fp16-autocast"
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _threads(one_thread):
    yield


def config(data, **train_keys):
    return load_config(REPO / "keel" / "configs" / "demo.toml", tiny_overrides(data, **train_keys))


def records(run) -> list[dict]:
    return [json.loads(ln) for ln in (Path(run) / "metrics.jsonl").read_text().splitlines() if ln.strip()]


def steps_of(run) -> dict[int, dict]:
    return {r["step"]: r for r in records(run) if "loss" in r}


def trainer_state(run, step) -> dict:
    return torch.load(Path(run) / "checkpoints" / f"step_{step:08d}" / "trainer.pt", map_location="cpu",
                      weights_only=True)


# ---------------------------------------------------------------- the key


def test_fp16_autocast_is_a_precision(monkeypatch):
    """Accepted by the config and resolved as itself on the CPU and on a GPU without bf16 (the
    V100/T4 case, where a bf16 precision is refused with a pointer to it); autocast in float16;
    ``auto`` never picks it."""
    assert load_config(None, [f"train.precision={FP16}"]).train.precision == FP16
    assert resolve_precision(CPU, FP16) == FP16
    assert autocast_context(CPU, FP16).fast_dtype == torch.float16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    cuda = torch.device("cuda")
    assert resolve_precision(cuda, FP16) == FP16
    assert resolve_precision(cuda, "auto") == "fp32"
    with pytest.raises(KeelError, match='use train.precision = "fp16-autocast" or "fp32"') as e:
        resolve_precision(cuda, "bf16-autocast")
    assert "\n" not in str(e.value)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert resolve_precision(cuda, "auto") == "bf16-autocast"  # auto keeps choosing bf16 where it exists


def test_bad_precision_is_one_line_naming_fp16_autocast(keel_main, tmp_path):
    proc = keel_main("train", "--run-dir", tmp_path / "r", "--set", "train.precision=fp16")
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    line = [ln for ln in proc.stderr.splitlines() if "train.precision" in ln]
    assert len(line) == 1 and "'fp16-autocast'" in line[0], proc.stderr


def test_scaler_kinds_and_no_op_for_other_precisions():
    """FSDP2-sharded: ShardedGradScaler (all ranks agree on an overflow); otherwise GradScaler;
    the other precisions: no scaler, the loss untouched, no state, no record fields."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    assert type(LS.LossScaling(CPU, FP16).scaler) is torch.amp.GradScaler
    assert isinstance(LS.LossScaling(CPU, FP16, sharded=True).scaler, ShardedGradScaler)
    for p in ("fp32", "bf16-autocast", "bf16", "auto"):
        off = LS.LossScaling(CPU, p)
        loss = torch.tensor(2.5)
        assert off.scaler is None and off.scale(loss) is loss and off.state_dict() is None and off.update(False) == {}


def test_a_damaged_scaler_state_is_a_damaged_checkpoint():
    """A trainer state whose grad_scaler entry has the wrong shape is named (the checkpoint is
    then skipped for the previous intact one, as any trainer state of the wrong shape)."""
    good = LS.LossScaling(CPU, FP16).state_dict()
    assert LS.is_scaler_state(good) and good["scale"] == LS.INIT_SCALE and good["skipped_steps"] == 0
    for bad in ({**good, "scale": float("nan")}, {**good, "skipped_steps": -1}, {"scale": 1.0}, "x"):
        state = {"step": 3, "tokens": 0, "elapsed_s": 0.0, "loader": {"epoch": 0, "position": 0},
                 "rng": torch.get_rng_state(), "grad_scaler": bad}
        assert "grad_scaler must be a loss-scaler state" in trainer_state_problem(state, 3)
        with pytest.raises(ValueError):
            LS.LossScaling(CPU, FP16).load_state_dict(bad)


def test_progress_line_counts_skipped_steps():
    rep = ProgressReporter(10, 0, 128, use_bar=False, clock=lambda: 0.0)
    assert "skipped 2" in rep.line({"step": 3, "loss": 5.0, "lr": 1e-3, "skipped_steps": 2}, 1.0)
    assert "skipped" not in rep.line({"step": 3, "loss": 5.0, "lr": 1e-3}, 1.0)


# ---------------------------------------------------------------- training


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_every_scheme_trains_in_fp16(tiny_data, tmp_path, scheme):
    """A few fp16-autocast steps of every scheme: finite losses and gradient norms, no step skipped
    at the default scale, the scale in every record."""
    cfg = config(tiny_data, steps=3, eval_every=3, checkpoint_every=3, sample_tokens=0, precision=FP16)
    cfg.model.residual = scheme
    train(cfg, tmp_path / "run")
    recs = steps_of(tmp_path / "run")
    assert sorted(recs) == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in recs.values()), recs
    assert [r["skipped_steps"] for r in recs.values()] == [0, 0, 0]
    assert all(r["loss_scale"] == LS.INIT_SCALE for r in recs.values())


RESUMED_AT = (6, 9)


@pytest.fixture(scope="module")
def fp16_runs(tiny_data, tmp_path_factory):
    """An fp16 run of 12 steps whose scale moves (initial scale 2**24, growth every 3 clean steps:
    overflows, growth and back-off all happen) and the fp32 run of the same config; the fp16 run
    interrupted after its checkpoints of steps 6 and 9 (every 3 steps) and resumed."""
    root = tmp_path_factory.mktemp("fp16")
    mp = pytest.MonkeyPatch()
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        mp.setattr(LS, "INIT_SCALE", 2.0 ** 24)
        mp.setattr(LS, "GROWTH_INTERVAL", 3)
        fp16 = config(tiny_data, precision=FP16, keep_checkpoints=0, checkpoint_every=3)
        train(fp16, root / "fp16")
        for k in RESUMED_AT:
            train(fp16, truncate_to(root / "fp16", root / f"resumed_{k}", k), resume=True)
        mp.undo()
        train(config(tiny_data, precision="fp32", keep_checkpoints=0), root / "fp32")
    finally:
        mp.undo()
        torch.set_num_threads(n)
    return root


def test_fp16_run_writes_scaler_state(fp16_runs):
    """Every checkpoint of the fp16 run holds the scaler (loadable with weights_only=True) at the
    scale and skipped count of its step's record; an fp32 run writes no scaler state and no fields."""
    recs = steps_of(fp16_runs / "fp16")
    for step in (3, 6, 9, 12):
        st = trainer_state(fp16_runs / "fp16", step)["grad_scaler"]
        assert LS.is_scaler_state(st) and st["growth_interval"] == 3
        assert st["skipped_steps"] == recs[step]["skipped_steps"]
        assert st["scale"] in (recs[step]["loss_scale"] * 2, recs[step]["loss_scale"], recs[step]["loss_scale"] / 2)
    assert "grad_scaler" not in trainer_state(fp16_runs / "fp32", 4)
    assert not any("loss_scale" in r or "skipped_steps" in r for r in records(fp16_runs / "fp32"))


def test_fp16_overflow_is_skipped_counted_and_backs_off(fp16_runs):
    """At 2**24 the first step overflows: skipped, grad_norm not finite (null), the count rises, the
    next step runs at half the scale; the scale grows again after 3 clean steps; a step with
    finite gradients is never skipped; the cumulative count equals the skipped flags."""
    recs = steps_of(fp16_runs / "fp16")
    assert recs[1].get("skipped") is True and recs[1]["grad_norm"] is None and recs[1]["skipped_steps"] == 1
    assert recs[2]["loss_scale"] == recs[1]["loss_scale"] / 2 == 2.0 ** 23
    flags = [bool(recs[s].get("skipped")) for s in sorted(recs)]
    assert [recs[s]["skipped_steps"] for s in sorted(recs)] == [sum(flags[:i + 1]) for i in range(len(flags))]
    assert all((r["grad_norm"] is None) == bool(r.get("skipped")) for r in recs.values())
    grew = [s for s in sorted(recs)[1:] if recs[s]["loss_scale"] > recs[s - 1]["loss_scale"]]
    assert grew and all(not any(flags[s - 4:s - 1]) for s in grew), (grew, flags)  # after 3 clean steps
    assert not all(flags)


def test_fp16_overflow_leaves_the_weights_unchanged(fp16_runs, tiny_data, tmp_path):
    """A run whose every step overflows (initial scale 2**60, 2 steps): its checkpoint's weights are
    the initial weights and its AdamW moments are zero; both steps are counted as skipped."""
    from safetensors.torch import load_file

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(LS, "INIT_SCALE", 2.0 ** 60)
        cfg = config(tiny_data, steps=2, checkpoint_every=2, eval_every=2, sample_tokens=0, precision=FP16)
        train(cfg, tmp_path / "run")
    recs = steps_of(tmp_path / "run")
    assert [(r["skipped"], r["skipped_steps"]) for r in recs.values()] == [(True, 1), (True, 2)]
    torch.manual_seed(cfg.train.seed)
    initial = Transformer(cfg.model).state_dict()
    saved = load_file(str(tmp_path / "run" / "checkpoints" / "step_00000002" / "model.safetensors"))
    assert saved and all(torch.equal(saved[k], initial[k]) for k in saved)
    state = trainer_state(tmp_path / "run", 2)
    # torch materialises an untouched AdamW's state for the checkpoint (zero moments): nothing was learnt
    moments = [t for v in state["optimizer"]["state"].values() for k, t in v.items() if k.startswith("exp_avg")]
    assert all(not t.any() for t in moments) and state["grad_scaler"]["scale"] == 2.0 ** 58


def test_logged_grad_norm_is_unscaled(fp16_runs, tiny_data, tmp_path):
    """The first step of an fp16 run at the default scale (2**16, no overflow) logs the gradient
    norm of the fp32 run's first step (same weights, same batch; fp16 rounding: within 2 %), not
    the scaled one (x 65536); its clipping used that norm (the loss of step 2 follows fp32's)."""
    train(config(tiny_data, steps=2, eval_every=2, checkpoint_every=2, sample_tokens=0, precision=FP16),
          tmp_path / "run")
    fp16, fp32 = steps_of(tmp_path / "run"), steps_of(fp16_runs / "fp32")
    assert fp16[1]["loss_scale"] == 2.0 ** 16 and not fp16[1].get("skipped")
    assert fp16[1]["loss"] == pytest.approx(fp32[1]["loss"], rel=1e-3)
    assert fp16[1]["grad_norm"] == pytest.approx(fp32[1]["grad_norm"], rel=2e-2)
    assert fp16[2]["loss"] == pytest.approx(fp32[2]["loss"], rel=1e-3)


@pytest.mark.parametrize("k", RESUMED_AT)
def test_fp16_resume_repeats_the_uninterrupted_run(fp16_runs, k):
    """Interrupted after checkpoint k and resumed: every later step's loss, gradient norm, loss
    scale, skipped flag and count equal the uninterrupted run's exactly. The checkpoints resumed
    from hold a scale below the initial one and, one of them, a growth tracker past 0 (clean steps
    since the last overflow), so both must be restored for the scale to grow at the same step."""
    states = [trainer_state(fp16_runs / "fp16", j)["grad_scaler"] for j in RESUMED_AT]
    assert all(st["scale"] < 2.0 ** 24 for st in states) and any(st["_growth_tracker"] > 0 for st in states), states
    full, resumed = steps_of(fp16_runs / "fp16"), steps_of(fp16_runs / f"resumed_{k}")
    assert sorted(resumed) == sorted(full)
    keys = ("loss", "grad_norm", "loss_scale", "skipped_steps", "skipped", "lr")
    for s in range(k + 1, 13):
        assert {x: resumed[s].get(x) for x in keys} == {x: full[s].get(x) for x in keys}, s
    final = [trainer_state(fp16_runs / name, 12)["grad_scaler"] for name in (f"resumed_{k}", "fp16")]
    assert final[0] == final[1]


def test_precision_switches_on_resume(fp16_runs, tiny_data, tmp_path, caplog):
    """An fp32 checkpoint (no scaler state, as any checkpoint from before fp16) resumes in fp16: the
    scale starts at 2**16 (said in one line), the change is recorded; an fp16 checkpoint resumes in
    fp32: no scaler, no scaler fields."""
    into = truncate_to(fp16_runs / "fp32", tmp_path / "into", 4)
    with caplog.at_level(logging.INFO, logger="keel"):
        train(config(tiny_data, precision=FP16, keep_checkpoints=0), into, resume=True)
    assert "step_00000004 has no loss-scaler state: fp16 loss scale 65536" in caplog.text
    recs = records(into)
    assert {"step": 4, "config_change": {"train.precision": {"old": "fp32", "new": FP16}}} in recs
    after = steps_of(into)
    assert after[5]["loss_scale"] == 2.0 ** 16 and after[12]["skipped_steps"] == 0
    assert trainer_state(into, 12)["grad_scaler"]["scale"] == 2.0 ** 16
    out = truncate_to(fp16_runs / "fp16", tmp_path / "out", 9)
    train(config(tiny_data, precision="fp32", keep_checkpoints=0), out, resume=True)
    assert not any("loss_scale" in r for s, r in steps_of(out).items() if s > 9)
    assert "grad_scaler" not in trainer_state(out, 12)


# ---------------------------------------------------------------- several processes (gloo)


@pytest.mark.spawns
def test_fp16_ddp_and_fsdp_match_one_process(tiny_data, tmp_path):
    """fp16-autocast with 2 processes: DDP (GradScaler on the all-reduced gradients) and FSDP2
    (ShardedGradScaler: the overflow flag all-reduced) give the single-process losses and gradient
    norms (fp16 rounding of the reordered sums: rtol 1e-4), the same scale; the FSDP run's sharded
    checkpoint carries the scaler and resumes in one process to the same losses."""
    from spawn import spawn_training

    sets = dict(steps=6, eval_every=3, checkpoint_every=3, sample_tokens=0, precision=FP16)
    train(config(tiny_data, **sets), tmp_path / "single")
    spawn_training([(config(tiny_data, parallelism=p, **sets), tmp_path / p, False) for p in ("ddp", "fsdp")], 2)
    one = steps_of(tmp_path / "single")
    for p in ("ddp", "fsdp"):
        got = steps_of(tmp_path / p)
        for s in range(1, 7):
            assert got[s]["loss"] == pytest.approx(one[s]["loss"], rel=1e-4), (p, s)
            assert got[s]["grad_norm"] == pytest.approx(one[s]["grad_norm"], rel=1e-3), (p, s)
            assert (got[s]["loss_scale"], got[s]["skipped_steps"]) == (one[s]["loss_scale"], one[s]["skipped_steps"])
    assert trainer_state(tmp_path / "fsdp", 6)["grad_scaler"] == trainer_state(tmp_path / "single", 6)["grad_scaler"]
    resumed = truncate_to(tmp_path / "fsdp", tmp_path / "fsdp_to_one", 3)
    train(config(tiny_data, parallelism="fsdp", **sets), resumed, resume=True)
    full, again = steps_of(tmp_path / "fsdp"), steps_of(resumed)
    for s in (4, 5, 6):
        assert again[s]["loss"] == pytest.approx(full[s]["loss"], rel=1e-4)
        assert again[s]["loss_scale"] == full[s]["loss_scale"]
