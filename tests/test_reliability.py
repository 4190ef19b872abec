"""Issue 11, sections 1, 2, 5 and 6: a run's history is never lost, the config is checked
up front and never silently ignored, sampling at any temperature, small ones.

Each test is one example of the issue with the right value asserted."""

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch

from conftest import REPO, tiny_overrides
from keel import KeelError
from keel.config import Config, ModelConfig, TrainConfig, load_config, resolve_vocab_size
from keel.run import Run
from keel.train import TrainingStopped, train
from keel.train.checkpoint import CheckpointManager, NonFiniteWeights, checkpoint_problem
from keel.train.metrics import JsonlSink, read_metrics
from keel.train.optim import apply_config, build_optimizer, lr_at, set_lr
from keel.train.trainer import perplexity


def recs(run):
    return read_metrics(run / "metrics.jsonl")


def losses(run):
    return {r["step"]: (r.get("loss"), r.get("val_loss"), r.get("lr")) for r in recs(run) if "config_change" not in r}


def cfg_for(data, *extra, **train_keys):
    return load_config(REPO / "keel" / "configs" / "demo.toml", tiny_overrides(data, **train_keys) + list(extra))


@pytest.fixture(scope="module")
def base_run(tiny_data, tmp_path_factory):
    """A finished 12-step run with checkpoints at steps 8 and 12."""
    run = tmp_path_factory.mktemp("base") / "run"
    torch.set_num_threads(1)
    train(cfg_for(tiny_data), run)
    return run


@pytest.fixture
def copy_of(base_run, tmp_path):
    def make():
        dst = tmp_path / "copy"
        shutil.copytree(base_run, dst)
        return dst
    return make


# ---------------------------------------------------------------- 1. history is never lost
def test_manifest_sizes_and_checksums(tmp_path):
    model = torch.nn.Linear(4, 3)
    ck = CheckpointManager(tmp_path).save(5, model, {"step": 5})
    manifest = json.loads((ck / "manifest.json").read_text())
    assert manifest["step"] == 5
    assert manifest["files"]["model.safetensors"]["bytes"] == (ck / "model.safetensors").stat().st_size
    import hashlib

    assert manifest["files"]["trainer.pt"]["sha256"] == hashlib.sha256((ck / "trainer.pt").read_bytes()).hexdigest()
    assert checkpoint_problem(ck) is None
    # model.safetensors follows the umask like every other file (it was 0600)
    assert (ck / "model.safetensors").stat().st_mode & 0o777 == (ck / "trainer.pt").stat().st_mode & 0o777
    data = (ck / "trainer.pt").read_bytes()
    (ck / "trainer.pt").write_bytes(bytes(len(data)))  # overwritten, same size
    assert checkpoint_problem(ck) == "trainer.pt does not match its sha256 in the manifest"
    (ck / "model.safetensors").write_bytes(b"x" * 10)
    assert checkpoint_problem(ck).startswith("model.safetensors has 10 bytes, the manifest says")


def _truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


DAMAGE = {
    "latest missing": (lambda r: (r / "checkpoints" / "latest").unlink(), 12, "checkpoints/latest (the file is missing)"),
    "latest names a missing step": (lambda r: (r / "checkpoints" / "latest").write_text("step_00000099\n"), 12,
                                    "checkpoints/latest (it names step_00000099, which does not exist)"),
    "model.safetensors deleted": (lambda r: (r / "checkpoints" / "step_00000012" / "model.safetensors").unlink(), 8,
                                  "step_00000012: model.safetensors is missing"),
    "model.safetensors truncated": (lambda r: _truncate(r / "checkpoints" / "step_00000012" / "model.safetensors"),
                                    8, "step_00000012: model.safetensors has"),
    "trainer.pt truncated": (lambda r: _truncate(r / "checkpoints" / "step_00000012" / "trainer.pt"), 8,
                             "step_00000012: trainer.pt has"),
    "trainer.pt overwritten": (lambda r: (r / "checkpoints" / "step_00000012" / "trainer.pt").write_bytes(
        b"\xff" * (r / "checkpoints" / "step_00000012" / "trainer.pt").stat().st_size), 8,
        "step_00000012: trainer.pt does not match its sha256"),
    # reliability v4: a manifest of the wrong shape (a traceback) and a trainer state of another step with the
    # manifest rehashed (resume said "applied from step 999" and trained nothing)
    "manifest files is a string": (lambda r: (r / "checkpoints" / "step_00000012" / "manifest.json").write_text(
        '{"files": "model.safetensors"}'), 8, "step_00000012: manifest.json lists no files with their bytes"),
    "trainer state of another step": (lambda r: _restate(r / "checkpoints" / "step_00000012", step=999), 8,
                                      "step_00000012: its trainer state says step 999, the folder step 12"),
    # trainer state of the wrong shape, rehashed (each was a TypeError / AttributeError deep in the resume)
    **{f"trainer state {key} = {value!r}": (
        lambda r, key=key, value=value: _restate(r / "checkpoints" / "step_00000012", **{key: value}), 8,
        f"step_00000012: its trainer state's {key} must be ") for key, value in (
            ("tokens", "x"), ("elapsed_s", "x"), ("optimizer", 5), ("loader", 5), ("loader", {"epoch": "x"}),
            ("rng", 5), ("config", 5))},
    "trainer state a list": (lambda r: _restate(r / "checkpoints" / "step_00000012", whole=[1, 2]), 8,
                             "step_00000012: its trainer state must be a table of step, tokens"),
    "manifest of another step": (lambda r: _remanifest(r / "checkpoints" / "step_00000012", step="x"), 8,
                                 "step_00000012: manifest.json says step 'x', the folder step 12"),
    # a checkpoint without a manifest (written before manifests) counted as intact while both files were
    # non-empty: a cut model.safetensors was resumed from, past the intact step 8 (a new-user trial)
    "model.safetensors truncated, no manifest": (lambda r: _unmanifest(r, _truncate), 8,
                                                 "step_00000012: model.safetensors is damaged: its header does not read"),
    "trainer.pt truncated, no manifest": (lambda r: _unmanifest(r, _truncate, "trainer.pt"), 8,
                                          "step_00000012: trainer.pt cannot be read"),
}


def _unmanifest(run, damage, name="model.safetensors"):
    """Drop every checkpoint's manifest (as before manifests), then damage step 12's ``name``."""
    for m in (run / "checkpoints").glob("step_*/manifest.json"):
        m.unlink()
    damage(run / "checkpoints" / "step_00000012" / name)


def _remanifest(ckpt, **changes):
    manifest = json.loads((ckpt / "manifest.json").read_text())
    (ckpt / "manifest.json").write_text(json.dumps({**manifest, **changes}))


def _restate(ckpt, **changes):
    """Rewrite ckpt/trainer.pt with ``changes`` and rehash the manifest, as a careful forger would."""
    import hashlib
    state = torch.load(ckpt / "trainer.pt", weights_only=True)
    torch.save(changes["whole"] if "whole" in changes else {**state, **changes}, ckpt / "trainer.pt")
    manifest = json.loads((ckpt / "manifest.json").read_text())
    data = (ckpt / "trainer.pt").read_bytes()
    manifest["files"]["trainer.pt"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("keep, left", [(2, [15, 19]), (1, [19]), (0, [8, 15, 19])])
def test_retention_drops_the_checkpoints_of_an_abandoned_history(keep, left, tmp_path):
    """Resumed at step 15 past a damaged step 21, the run saves step 19: retention kept step 21
    (damaged, of the history the run left) and deleted the intact step 15 (a new-user trial)."""
    model = torch.nn.Linear(4, 3)
    for step in (8, 15, 21):
        CheckpointManager(tmp_path, keep=0).save(step, model, {"step": step})
    (tmp_path / "checkpoints" / "step_00000021" / "model.safetensors").write_bytes(b"x" * 10)
    ck = tmp_path / "checkpoints"
    assert checkpoint_problem(ck / "step_00000021") and checkpoint_problem(ck / "step_00000015") is None
    CheckpointManager(tmp_path, keep=keep).save(19, model, {"step": 19})
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*")) == [f"step_{s:08d}" for s in left]
    assert (ck / "latest").read_text() == "step_00000019\n"
    CheckpointManager(tmp_path, keep=2).save(23, model, {"step": 23})  # the plain rotation: the newest two
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*")) == ["step_00000019", "step_00000023"]


def test_a_damaged_checkpoint_past_the_resumed_step_never_counts_towards_keep(copy_of, tiny_data, one_thread):
    """Resumed at step 12 past a damaged step 14, the run saved step 16 and kept 16 and the damaged
    14, deleting the intact 12 (a new-user trial: pruning removed only checkpoints past the new step)."""
    run = copy_of()
    ck = run / "checkpoints"
    shutil.copytree(ck / "step_00000012", ck / "step_00000014")
    (ck / "step_00000014" / "model.safetensors").write_bytes(b"x" * 10)
    res = train(cfg_for(tiny_data, steps=16), run, resume=True)
    assert res.resumed_from == 12
    assert sorted(p.name for p in ck.glob("step_*")) == ["step_00000012", "step_00000016"]


def test_a_resume_drops_the_config_change_an_abandoned_resume_recorded_at_its_step(copy_of, base_run, tiny_data,
                                                                                  one_thread):
    """An earlier resume from step 12 (lr changed) whose continuation was lost left its config_change
    record; resuming from 12 again with other changes gave two records at step 12."""
    run = copy_of()
    with open(run / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 12, "config_change": {"train.lr": {"old": 3e-3, "new": 1e-2}}}) + "\n")
        f.write(json.dumps({"step": 13, "loss": 5.0}) + "\n")
    train(cfg_for(tiny_data, steps=16), run, resume=True)
    changes = [r for r in recs(run) if "config_change" in r]
    assert changes == [{"step": 12, "config_change": {"train.steps": {"old": 12, "new": 16}}}]
    assert losses(run) == {**losses(base_run), **{k: v for k, v in losses(run).items() if k > 12}}
    assert max(losses(run)) == 16


@pytest.mark.parametrize("case", list(DAMAGE))
def test_resume_takes_newest_intact_checkpoint(case, copy_of, base_run, tiny_data, caplog, one_thread):
    """It used to restart from step 0 and rewrite metrics.jsonl, or crash with a traceback."""
    damage, expect_step, reason = DAMAGE[case]
    run = copy_of()
    damage(run)
    ckpt, reasons = CheckpointManager(run).find_intact()
    assert ckpt.name == f"step_{expect_step:08d}"
    assert any(reason in r for r in reasons), reasons
    with caplog.at_level("INFO", logger="keel"):
        res = train(cfg_for(tiny_data), run, resume=True)
    assert res.resumed_from == expect_step
    assert any(reason in r.getMessage() for r in caplog.records)
    assert losses(run) == losses(base_run)  # nothing lost, nothing duplicated, bitwise the same losses


def test_resume_refuses_when_no_checkpoint_is_intact(copy_of, tiny_data):
    run = copy_of()
    for step in (8, 12):
        _truncate(run / "checkpoints" / f"step_{step:08d}" / "model.safetensors")
    before = (run / "metrics.jsonl").read_bytes()
    with pytest.raises(KeelError) as e:
        train(cfg_for(tiny_data), run, resume=True)
    msg = str(e.value)
    assert "\n" not in msg and "no intact checkpoint" in msg and "--restart" in msg
    assert "step_00000012: model.safetensors has" in msg and "step_00000008" in msg
    assert (run / "metrics.jsonl").read_bytes() == before


def test_load_model_of_damaged_checkpoint_is_one_line(copy_of):
    run = copy_of()
    _truncate(run / "checkpoints" / "step_00000012" / "model.safetensors")
    with pytest.raises(KeelError, match="cannot read .*model.safetensors"):
        Run(run).load_model(checkpoint=run / "checkpoints" / "step_00000012")
    assert Run(run).latest_checkpoint().name == "step_00000008"  # falls back, with a warning


def test_torn_metrics_line_is_dropped_on_resume(copy_of, base_run, tiny_data, caplog, one_thread):
    run = copy_of()
    shutil.rmtree(run / "checkpoints" / "step_00000012")  # killed before the step-12 checkpoint ...
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 13, "tokens": 16')  # ... while writing a line
    with caplog.at_level("WARNING", logger="keel"):
        train(cfg_for(tiny_data), run, resume=True)
    assert any("partial last line" in r.getMessage() for r in caplog.records)
    assert losses(run) == losses(base_run)


def test_read_metrics_drops_torn_last_line_only(tmp_path, caplog):
    p = tmp_path / "m.jsonl"
    p.write_text('{"step": 1}\n{"step": 2}\n{"ste')
    with caplog.at_level("WARNING"):
        assert read_metrics(p) == [{"step": 1}, {"step": 2}]
    p.write_text('{"step": 1}\n{"ste\n{"step": 3}\n')
    with pytest.raises(KeelError, match="line 2 is not valid JSON"):
        read_metrics(p)


@pytest.mark.parametrize("line, words", [
    ("5", "line 2 is not a JSON object (one record per line), got 5"),
    ('[{"step": 2}]', "line 2 is not a JSON object"),
    ('{"step": "x"}', "line 2: step must be a non-negative integer, got 'x'"),
    ('{"step": -1}', "line 2: step must be a non-negative integer, got -1"),
    ('{"step": 2, "loss": "abc"}', "line 2: loss must be a number or null, got 'abc'"),
])
def test_metrics_records_of_the_wrong_shape_are_one_line(copy_of, tiny_data, line, words, capsys):
    """Valid JSON that is not a record (reliability v4): `keel train --resume`, `keel runs` and
    `keel plot loss` ended in "'int' object has no attribute 'items'" or a TypeError."""
    from keel.cli import main
    run = copy_of()
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("\n".join([lines[0], line, *lines[1:]]) + "\n")
    with pytest.raises(KeelError, match=re.escape(words)):
        read_metrics(run / "metrics.jsonl")
    for argv in (["train", "--resume", str(run)], ["plot", "loss", str(run), "--out", str(run / "x.png")]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert words in err and "Traceback" not in err, (argv, err)
    main(["runs", str(run)])  # a listing: the run's row says why it cannot be read
    out = capsys.readouterr()
    assert "Traceback" not in out.err + out.out, out


def test_stale_temporaries_are_removed_at_resume(copy_of, tiny_data, one_thread):
    run = copy_of()
    tmp_ck = run / "checkpoints" / ".step_00000016.ab12cd.tmp"
    tmp_ck.mkdir()
    (tmp_ck / "model.safetensors").write_bytes(b"0" * 1000)
    (run / "checkpoints" / ".latest.xyz.tmp").write_text("step_00000016")
    (run / ".config.toml.q1.tmp").write_text("")
    train(cfg_for(tiny_data, steps=13), run, resume=True)
    assert not list(run.glob(".*.tmp")) and not list((run / "checkpoints").glob(".*.tmp"))
    assert CheckpointManager(run).clean_temporaries() == []


def test_metrics_are_strict_json_nan_is_null(tmp_path):
    sink = JsonlSink(tmp_path / "m.jsonl")
    sink.write({"step": 1, "loss": float("nan"), "grad_norm": float("inf"), "g": [1.0, float("-inf")]})
    line = (tmp_path / "m.jsonl").read_text()
    assert "NaN" not in line and "Infinity" not in line

    def strict(name):
        raise ValueError(name)
    assert json.loads(line, parse_constant=strict) == {"step": 1, "loss": None, "grad_norm": None, "g": [1.0, None]}


# ---------------------------------------------------------------- 2. the config
@pytest.mark.parametrize("setting,msg", [
    ("train.beta1=2", "train.beta1 must be in [0, 1), got 2.0"),
    ("train.beta2=-0.1", "train.beta2 must be in [0, 1)"),
    ("train.weight_decay=-1", "train.weight_decay must be a finite number >= 0, got -1.0"),
    ("train.lr=inf", "train.lr must be a finite number > 0, got inf"),
    ("train.lr=nan", "train.lr must be a finite number > 0, got nan"),
    ("train.lr=0", "train.lr must be a finite number > 0"),
    ("train.min_lr=1", "train.min_lr must be a finite number between 0 and train.lr"),
    ("train.grad_clip=-1", "train.grad_clip must be a finite number >= 0"),
    ("train.schedule='linear'", "train.schedule must be 'cosine' | 'wsd' | 'constant'"),
    ("train.decay_fraction=0", "train.decay_fraction must be in (0, 1]"),
    ("train.eval_tokens=0", "train.eval_tokens must be >= 1"),
    ("train.warmup_steps=-1", "train.warmup_steps must be >= 0"),
    ("train.precision='fp16'", "train.precision must be"),
    ("model.norm_eps=-1", "model.norm_eps must be a finite number > 0, got -1.0"),
    ("model.rope_theta=0", "model.rope_theta must be a finite number > 0"),
    ("model.init_std=nan", "model.init_std must be a finite number > 0"),
    ("model.vocab_size=0", "model.vocab_size must be"),
    ("data.val_fraction=1", "data.val_fraction must be between 0 and 1"),
    ("data.max_bytes=-5", "data.max_bytes must be >= 0"),
    ("data.text_field=''", "data.text_field must be a non-empty string"),
])
def test_every_key_is_range_checked_up_front(setting, msg):
    with pytest.raises(KeelError) as e:
        load_config(None, [setting])
    assert msg in str(e.value) and "\n" not in str(e.value)


def test_non_finite_lr_is_a_skipped_step(tiny_data, tmp_path, monkeypatch, one_thread):
    import keel.train.optim as optim

    real = optim.lr_at
    monkeypatch.setattr(optim, "lr_at", lambda step, cfg: math.inf if step == 4 else real(step, cfg))
    run = tmp_path / "r"
    train(cfg_for(tiny_data, steps=8), run)
    r = {x["step"]: x for x in recs(run)}
    assert r[5].get("skipped") and math.isnan(r[5]["lr"])  # inf -> null in the file, read back as NaN
    assert '"lr": null' in (run / "metrics.jsonl").read_text().splitlines()[5]
    assert not any(r[s].get("skipped") for s in (1, 2, 3, 4, 6, 7, 8))
    assert all(torch.isfinite(p).all() for p in Run(run).load_model().parameters())


def test_non_finite_weights_are_never_checkpointed(tiny_data, tmp_path, one_thread):
    from keel.train.callbacks import Callback

    class Poison(Callback):
        def on_step_end(self, state):
            if state.step == 6:
                with torch.no_grad():
                    next(state.model.parameters()).fill_(float("inf"))

    with pytest.raises(TrainingStopped, match="stopped at step 8: refusing to checkpoint step 8: non-finite"):
        train(cfg_for(tiny_data), tmp_path / "r", callbacks=[Poison()])
    assert CheckpointManager(tmp_path / "r").latest().name == "step_00000004"
    assert not (tmp_path / "r" / "checkpoints" / "step_00000008").exists()
    with pytest.raises(NonFiniteWeights):
        CheckpointManager(tmp_path / "x").save(1, {"w": torch.tensor([1.0, float("nan")])}, {"step": 1})
    assert not (tmp_path / "x" / "checkpoints" / "latest").exists()


def test_resume_applies_a_new_lr_and_records_it(copy_of, tiny_data, caplog, one_thread):
    """It wrote lr = 0.006 into config.toml while the old schedule's LR was used."""
    run = copy_of()
    shutil.rmtree(run / "checkpoints" / "step_00000012")
    new = cfg_for(tiny_data, lr=6e-3)
    with caplog.at_level("WARNING", logger="keel"):
        train(new, run, resume=True)
    r = {x["step"]: x for x in recs(run) if "loss" in x}
    for step in (9, 10, 11, 12):
        assert r[step]["lr"] == pytest.approx(lr_at(step - 1, new.train), rel=1e-12)
    change = [x for x in recs(run) if "config_change" in x]
    assert change == [{"step": 8, "config_change": {"train.lr": {"old": 3e-3, "new": 6e-3}}}]
    assert load_config(run / "config.toml").train.lr == 6e-3
    assert any("train.lr changed from 0.003 to 0.006" in x.getMessage() for x in caplog.records)


def test_extending_a_cosine_run_says_the_lr_jumps(copy_of, tiny_data, caplog, one_thread):
    """12 -> 24 steps made the LR jump 1.49e-4 -> 1e-7 -> 1.87e-3 with no warning."""
    run = copy_of()
    new = cfg_for(tiny_data, steps=24, eval_every=12, checkpoint_every=12)
    with caplog.at_level("WARNING", logger="keel"):
        train(new, run, resume=True)
    old = cfg_for(tiny_data).train
    jump = f"the learning rate of step 13 changes from {lr_at(12, old):.4g} to {lr_at(12, new.train):.4g}"
    assert any(jump in x.getMessage() for x in caplog.records)
    r = {x["step"]: x for x in recs(run) if "loss" in x}
    assert r[13]["lr"] == pytest.approx(lr_at(12, new.train), rel=1e-12)
    assert [x for x in recs(run) if "config_change" in x][0]["config_change"]["train.steps"] == {"old": 12, "new": 24}


def test_extending_a_wsd_run_in_its_stable_phase_keeps_the_lr(tiny_data, tmp_path, caplog, one_thread):
    run = tmp_path / "w"
    train(cfg_for(tiny_data, "train.schedule='wsd'", "train.decay_fraction=0.25"), run)
    shutil.rmtree(run / "checkpoints" / "step_00000012")  # resume at step 8: stable phase (decay from 9)
    new = cfg_for(tiny_data, "train.schedule='wsd'", "train.decay_fraction=0.25", steps=24)
    with caplog.at_level("WARNING", logger="keel"):
        train(new, run, resume=True)
    assert not any("learning rate of step" in x.getMessage() for x in caplog.records)
    r = {x["step"]: x for x in recs(run) if "loss" in x}
    assert [r[s]["lr"] for s in (8, 9, 10)] == [3e-3, 3e-3, 3e-3]


@pytest.mark.parametrize("setting,key", [("train.seed=1", "train.seed"), ("model.d_model=64", "model.d_model"),
                                         ("train.batch_size=8", "train.batch_size")])
def test_resume_refuses_changes_that_make_another_run(setting, key, copy_of, tiny_data):
    run = copy_of()
    before = (run / "config.toml").read_text()
    with pytest.raises(KeelError) as e:
        train(cfg_for(tiny_data, setting), run, resume=True)
    assert str(e.value).startswith(f"cannot resume {run} with {key} = ") and "\n" not in str(e.value)
    assert (run / "config.toml").read_text() == before


@pytest.mark.parametrize("tokenizer", ["bpe:300", "bpe:1000"])
def test_a_refused_data_change_is_refused_before_the_dataset_is_prepared(tokenizer, tiny_data, tmp_path, one_thread):
    """A new tokenizer on resume trained it (minutes on a real corpus) before the refusal; a larger
    one was refused as a model.vocab_size error, not by its own key (a new-user trial)."""
    cache = tmp_path / "cache"
    shutil.copytree(tiny_data, cache / Path(tiny_data).name)  # the run's dataset, found in its cache
    sets = ["data.path=''", "data.max_bytes=300000", "data.tokenizer='bpe:512'", f"data.cache_dir='{cache}'"]
    run = tmp_path / "run"
    train(cfg_for(tiny_data, *sets, steps=2, eval_every=2, checkpoint_every=2), run)
    assert len(list(cache.iterdir())) == 1  # the copy was used, nothing prepared
    with pytest.raises(KeelError) as e:
        train(cfg_for(tiny_data, *sets, f"data.tokenizer='{tokenizer}'", steps=4, eval_every=2, checkpoint_every=2),
              run, resume=True)
    assert str(e.value).startswith(f"cannot resume {run} with data.tokenizer = '{tokenizer}'"), str(e.value)
    assert len(list(cache.iterdir())) == 1  # nothing was prepared


def _files(run):
    return {p.relative_to(run): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file() and p.name != ".keel.lock"}


def test_resume_refuses_fewer_steps_than_the_run_reached(copy_of, tiny_data):
    """train.steps=5 on a run at step 12 wrote steps = 5 and a config_change record ("step 12/5" in keel runs)."""
    run = copy_of()
    before = _files(run)
    with pytest.raises(KeelError) as e:
        train(cfg_for(tiny_data, steps=5), run, resume=True)
    assert str(e.value) == (f"cannot resume {run}: train.steps=5 is below the step this run reached (12); "
                            "give train.steps >= 12")
    assert _files(run) == before


def test_a_resume_with_nothing_left_to_train_applies_and_writes_no_change(copy_of, tiny_data, caplog, one_thread):
    """eval_every=3 on a finished run went into config.toml but not into the checkpoint, so every later
    resume reported "train.eval_every changed from 4 to 3" again. Nothing trains, so nothing is applied:
    one line says so, nothing is written, and a later resume sees no change."""
    run = copy_of()
    before = _files(run)
    with caplog.at_level("INFO", logger="keel"):
        res = train(cfg_for(tiny_data, eval_every=3), run, resume=True)
    assert res.steps_run == 0 and res.step == 12
    said = [r.getMessage() for r in caplog.records if "already at step" in r.getMessage() or "changed" in r.getMessage()]
    assert said == [f"{run} is already at step 12 (train.steps = 12): nothing left to train; not applied and not "
                    "written: train.eval_every = 3 (raise train.steps with --set to train further)"]
    assert _files(run) == before and Run(run).config.train.eval_every == 4
    caplog.clear()
    with caplog.at_level("INFO", logger="keel"):
        again = train(Run(run).config, run, resume=True)  # what `keel train --resume RUN` loads
    assert again.steps_run == 0 and not [r for r in caplog.records if r.levelname == "WARNING"]
    # the change, asked for where there is something to train, is applied and recorded once
    train(cfg_for(tiny_data, eval_every=3, steps=15), run, resume=True)
    assert [x for x in recs(run) if "config_change" in x] == [{"step": 12, "config_change": {
        "train.eval_every": {"old": 4, "new": 3}, "train.steps": {"old": 12, "new": 15}}}]
    assert [x["step"] for x in recs(run) if "val_loss" in x] == [0, 4, 8, 12, 15]


def test_apply_config_sets_new_hyperparameters_after_loading():
    model = torch.nn.Linear(3, 3)
    old, new = TrainConfig(weight_decay=0.01, beta1=0.9), TrainConfig(weight_decay=0.1, beta1=0.8, lr=1e-3)
    opt = build_optimizer(model, old)
    opt2 = build_optimizer(model, new)
    opt2.load_state_dict(opt.state_dict())
    apply_config(opt2, new)
    assert opt2.param_groups[0]["weight_decay"] == 0.1 and opt2.param_groups[1]["weight_decay"] == 0.0
    assert opt2.param_groups[0]["betas"] == (0.8, 0.95)
    assert [g["lr"] for g in opt2.param_groups] == [old.lr] * 2  # the saved LR, until set_lr writes the step's
    assert set_lr(opt2, 0, new) == lr_at(0, new) and [g["lr"] for g in opt2.param_groups] == [lr_at(0, new)] * 2


def test_wsd_formula_transcription():
    """MiniCPM (arXiv 2404.06395) Eq. 1 over the 1-based steps s = 1..S: s/W*eta (s <= W),
    eta (W < s <= T), f(s-T)*eta (T < s <= S), f exponential with f(S-T) = min_lr/eta."""
    c = TrainConfig(steps=100, lr=1e-2, min_lr=1e-4, warmup_steps=10, schedule="wsd", decay_fraction=0.2)
    W, T, S, D, eta = 10, 80, 100, 20, 1e-2
    for s in range(1, S + 1):
        if s <= W:
            want = s / W * eta
        elif s <= T:
            want = eta
        else:
            want = eta * 0.5 ** ((s - T) / (D * math.log(2) / math.log(eta / 1e-4)))
        assert lr_at(s - 1, c) == pytest.approx(want, rel=1e-12), s
    assert lr_at(S - 1, c) == pytest.approx(1e-4)  # the run's last step is at min_lr


@pytest.mark.parametrize("steps", [2, 5, 14])
def test_a_short_wsd_run_decays_on_its_last_step(steps):
    """round(0.1 * steps) <= 1: one decay step, at min_lr (it ran at lr: the run never decayed)."""
    c = TrainConfig(steps=steps, lr=1e-2, min_lr=1e-5, warmup_steps=1, schedule="wsd", decay_fraction=0.1)
    assert [lr_at(s, c) for s in range(steps)] == [1e-2] * (steps - 1) + [pytest.approx(1e-5, rel=1e-12)]
    const = TrainConfig(steps=100, lr=1e-2, warmup_steps=10, schedule="constant")
    assert [lr_at(s, const) for s in (9, 10, 99, 500)] == [1e-2] * 4


def test_vocab_size_follows_the_tokenizer():
    assert ModelConfig().vocab_size == "auto"
    assert resolve_vocab_size("auto", 2048) == 2048
    assert resolve_vocab_size("auto", 2050) == 2112
    assert resolve_vocab_size("auto", 2050, multiple=1) == 2050
    assert resolve_vocab_size(8192, 2048) == 8192
    with pytest.raises(KeelError, match="model.vocab_size = 1000 is smaller than the tokenizer's vocabulary"):
        resolve_vocab_size(1000, 2048)
    assert load_config(None, ["model.vocab_size=auto"]).model.vocab_size == "auto"
    assert load_config(None, ["model.vocab_size=4096"]).model.vocab_size == 4096


def test_auto_vocab_run_has_only_the_tokenizer_rows(tiny_data, tmp_path, one_thread):
    """bpe:2048 with the default kept 8,192 rows; now the rows follow the tokenizer."""
    run = tmp_path / "v"
    train(cfg_for(tiny_data, "model.vocab_size='auto'", steps=1, eval_every=1, checkpoint_every=1), run)
    assert Run(run).config.model.vocab_size == 512  # config.toml shows what is in effect
    assert Run(run).load_model().tok_emb.weight.shape[0] == 512
    with pytest.raises(KeelError, match="smaller than the tokenizer"):
        train(cfg_for(tiny_data, "model.vocab_size=100", steps=1), tmp_path / "w")


# ---------------------------------------------------------------- 6. small ones
def test_resuming_a_finished_run_does_nothing(copy_of, tiny_data, caplog):
    run = copy_of()
    before = (run / "metrics.jsonl").read_bytes()
    with caplog.at_level("INFO", logger="keel"):
        res = train(cfg_for(tiny_data), run, resume=True)
    assert res.steps_run == 0 and res.step == 12 and res.resumed_from == 12
    assert any("already at step 12" in r.getMessage() and "nothing to do" in r.getMessage() for r in caplog.records)
    assert (run / "metrics.jsonl").read_bytes() == before
    assert res.val_loss == recs(run)[-1]["val_loss"]


def test_perplexity_of_a_blown_up_loss_is_inf():
    assert perplexity(2.0) == pytest.approx(math.exp(2.0))
    assert perplexity(200.0) == math.inf  # was an 87-digit number
    assert perplexity(float("nan")) == math.inf and perplexity(None) == math.inf


def test_config_default_is_demo_val_fraction():
    from keel.config import DEFAULT_VAL_FRACTION

    assert Config().data.val_fraction == DEFAULT_VAL_FRACTION == load_config(
        REPO / "keel" / "configs" / "demo.toml").data.val_fraction


def test_null_numbers_read_back_as_nan_and_classify(tmp_path):
    """A non-finite loss is written as null; the one reader gives NaN back, so the offline
    classifier (which failed on None before) calls the run unstable at that step."""
    from keel.diagnostics.divergence import INSTABILITY, classify_metrics
    from keel.train.metrics import JsonlSink

    sink = JsonlSink(tmp_path / "metrics.jsonl")
    for step, loss in enumerate([6.0, 5.5, float("nan"), float("inf")], start=1):
        sink.write({"step": step, "loss": loss, "lr": 1e-3, "note": None})
    text = (tmp_path / "metrics.jsonl").read_text()
    assert text.count('"loss": null') == 2
    got = read_metrics(tmp_path / "metrics.jsonl")
    assert [math.isnan(r["loss"]) for r in got] == [False, False, True, True]
    assert got[0]["note"] is None  # only numeric fields are restored
    v = classify_metrics(got)
    assert v.mode == INSTABILITY and v.step == 3


@pytest.mark.parametrize("loss, grad_norm, lr, words", [
    (6.2384, float("nan"), 3e-3, "step 7: non-finite grad norm nan (loss 6.2384, LR 0.003); update skipped (2 in a row)"),
    (float("inf"), float("nan"), 1e30, "step 7: non-finite loss inf, grad norm nan (LR 1e+30); update skipped (2 in a row)"),
    (float("nan"), 1.5, 3e-3, "step 7: non-finite loss nan (grad norm 1.5, LR 0.003); update skipped (2 in a row)"),
])
def test_a_skipped_steps_warning_names_what_was_not_finite(loss, grad_norm, lr, words):
    """The warning read "non-finite loss 6.238..., grad norm nan or LR 0.003", as if the finite loss were the cause."""
    from keel.train.trainer import skipped_step_words

    assert skipped_step_words(7, {"loss": loss, "grad_norm": grad_norm, "lr": lr}, 2) == words
