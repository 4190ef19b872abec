"""Training loop: metrics, checkpoints, exact resume, non-finite steps, the CLI."""

import json
import math

import pytest
import torch

from conftest import REPO, tiny_overrides
from keel import KeelError
from keel.config import TrainConfig, load_config
from keel.data import TokenLoader
from keel.model import Transformer
from keel.train import TrainingStopped, train
from keel.train.callbacks import Callback
from keel.run import Run
from keel.train.checkpoint import CheckpointManager
from keel.train.optim import build_optimizer, lr_at


def metrics(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_lr_schedule_formula():
    cfg = TrainConfig(steps=100, lr=1e-2, min_lr=1e-7, warmup_steps=10)
    assert lr_at(0, cfg) == pytest.approx(1e-3)
    assert lr_at(9, cfg) == pytest.approx(1e-2)
    # cosine: min + (max - min) * (1 + cos(pi * p)) / 2, p = (step - warmup) / (steps - warmup)
    for step in (10, 32, 55, 99):
        p = (step - 10) / 90
        assert lr_at(step, cfg) == pytest.approx(1e-7 + (1e-2 - 1e-7) * 0.5 * (1 + math.cos(math.pi * p)))
    assert lr_at(100, cfg) == pytest.approx(1e-7)


def test_weight_decay_groups():
    model = Transformer(load_config(REPO / "keel" / "configs" / "demo.toml", ["model.vocab_size=8192"]).model)
    opt = build_optimizer(model, TrainConfig())
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.01 and no_decay["weight_decay"] == 0.0
    assert all(p.ndim == 2 for p in decay["params"]) and all(p.ndim == 1 for p in no_decay["params"])
    assert opt.defaults["betas"] == (0.9, 0.95)
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_run_directory_contents(tiny_config, tmp_path):
    run = tmp_path / "run"
    res = train(tiny_config(), run)
    recs = metrics(run)
    assert recs[0]["step"] == 0 and "val_loss" in recs[0]
    steps = [r for r in recs if r["step"] > 0]
    assert [r["step"] for r in steps] == list(range(1, 13))
    for r in steps:
        assert {"step", "tokens", "loss", "lr", "grad_norm", "tokens_per_s"} <= set(r)
        assert r["tokens"] == r["step"] * 4 * 32
    assert [r["step"] for r in recs if "val_loss" in r] == [0, 4, 8, 12]
    assert res.val_loss == pytest.approx(steps[-1]["val_loss"])
    assert (run / "config.toml").is_file() and (run / "loss.png").stat().st_size > 1000
    assert (run / "sample.txt").read_text().strip()
    assert (run / "tokenizer.json").is_file()
    ckpt = CheckpointManager(run).latest()
    assert ckpt.name == "step_00000012"
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_00000008", "step_00000012"]
    state = CheckpointManager.load_trainer_state(ckpt)  # weights_only=True
    assert state["step"] == 12 and state["loader"]
    # the resolved config reproduces the model
    assert load_config(run / "config.toml").model == tiny_config().model


def test_exact_resume_after_interruption(tiny_config, tmp_path, monkeypatch):
    """Losses after resuming from step 8 equal the uninterrupted run's, step for step."""
    full = tmp_path / "full"
    train(tiny_config(), full)

    part = tmp_path / "part"
    calls = {"n": 0}
    original = TokenLoader.next_batch

    def crash_at_step_10(self):
        calls["n"] += 1
        if calls["n"] == 10:
            raise KeyboardInterrupt
        return original(self)

    monkeypatch.setattr(TokenLoader, "next_batch", crash_at_step_10)
    with pytest.raises(KeyboardInterrupt):
        train(tiny_config(), part)
    monkeypatch.setattr(TokenLoader, "next_batch", original)
    assert CheckpointManager(part).latest().name == "step_00000008"
    train(tiny_config(), part, resume=True)

    a, b = metrics(full), metrics(part)
    assert [r["step"] for r in b] == [r["step"] for r in a]  # no duplicated lines after resume
    for ra, rb in zip(a, b):
        for key in ("loss", "grad_norm", "lr", "val_loss", "tokens"):
            assert ra.get(key) == rb.get(key), (ra["step"], key)
    wa = Run(full).load_model().state_dict()
    wb = Run(part).load_model().state_dict()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_model_learns(tiny_config, tmp_path):
    run = tmp_path / "learn"
    res = train(tiny_config(steps=60, eval_every=30, lr=1e-2, warmup_steps=5, batch_size=8), run)
    assert res.first_val_loss == pytest.approx(math.log(512), abs=0.3)
    assert res.val_loss < res.first_val_loss - 1.0


def test_non_finite_steps_are_skipped_then_stop(tiny_config, tmp_path, monkeypatch):
    run = tmp_path / "nan"
    calls = {"n": 0}
    original = Transformer.forward

    def nan_after_step_5(self, ids, targets=None):
        out = original(self, ids, targets)
        if targets is not None and self.training:
            calls["n"] += 1
            if calls["n"] > 5:
                return out * float("nan")
        return out

    monkeypatch.setattr(Transformer, "forward", nan_after_step_5)
    cfg = tiny_config(steps=20, max_bad_steps=3, checkpoint_every=4)
    with pytest.raises(TrainingStopped, match="3 non-finite steps in a row"):
        train(cfg, run)
    recs = [r for r in metrics(run) if r["step"] > 0]
    assert [r["step"] for r in recs if r.get("skipped")] == [6, 7, 8]
    # step 8's checkpoint was never written: the last good one (step 4) is intact and finite
    assert CheckpointManager(run).latest().name == "step_00000004"
    model = Run(run).load_model()
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_run_dir_in_use_is_refused(tiny_config, tmp_path):
    run = tmp_path / "r"
    train(tiny_config(steps=2, eval_every=2, checkpoint_every=2), run)
    with pytest.raises(KeelError, match="already holds a run"):
        train(tiny_config(steps=2), run)


def test_cli_train_generate_and_errors(keel_cli, keel_main, tiny_data, tmp_path):
    run = tmp_path / "cli-run"
    sets = [a for s in tiny_overrides(tiny_data, steps=4, eval_every=2, checkpoint_every=2) for a in ("--set", s)]
    r = keel_cli("train", "--run-dir", run, *sets)
    assert r.returncode == 0, r.stderr
    assert f"run: {run}" in r.stdout and "validation loss at step 4" in r.stdout and "sample:" in r.stdout

    r = keel_main("generate", "--run", run, "--prompt", "import os", "--max-new-tokens", "5", "--temperature", "0")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("import os")

    # resume with more steps
    r = keel_main("train", "--resume", run, "--set", "train.steps=6", "--set", "train.sample_tokens=0")
    assert r.returncode == 0, r.stderr
    assert "validation loss at step 6" in r.stdout
    assert "sample:" not in r.stdout  # no sample drawn: no empty "sample:" heading



@pytest.mark.parametrize("args,msg", [
    (("train", "--set", "model.widht=3"), "unknown config key model.widht"),
    (("train", "--set", "train.lr=fast"), "train.lr must be a number"),
    (("train", "--set", "train.steps=1.5"), "train.steps must be an integer"),
    (("train", "--set", "train.lr=true"), "train.lr must be a number, got True"),  # trained at lr 1.0
    (("train", "--set", "model.embed_init_std=false"), "model.embed_init_std must be a number, got False"),
    # Python's float() and int() read any script's digits: an Arabic-Indic one trained at lr 1.0 (issue 50)
    (("train", "--set", "train.lr=\u0661"), "train.lr must be a number"),
    (("train", "--set", "train.steps=\u0661\u0660"), "train.steps must be an integer"),
    (("train", "--set", "lr=1"), "--set expects section.key=value"),
    (("train", "--config", "nope"), "unknown config 'nope'"),
    (("train", "--config", "missing.toml"), "config file not found"),
    (("train", "--config", "."), ". is a folder, not a config file"),  # said "config file not found: ." (issue 50)
    (("study", "nofile.toml", "--dry-run"), "study file not found: nofile.toml"),  # it said "config file"
    (("sweep", "--preset", "nofile.toml", "--dry-run"), "sweep preset file not found: nofile.toml"),
    (("prepare", "--tokenizer", "bpe:99999999999"), "N must be from 257 (256 bytes + <|endoftext|>) to 2,147,483,647"),
    (("train", "--set", "model.residual=resnet"), "unknown model.residual"),
    (("train", "--set", "model.n_kv_heads=3"), "not divisible by model.n_kv_heads"),
    (("train", "--resume", "missing-run"), "no config.toml"),
    (("generate", "--run", "."), "not a run directory"),
    (("prepare", "--source", "absent-folder"), "no such file or directory"),
])
def test_cli_user_errors_are_one_line(args, msg, tmp_path, monkeypatch, capsys):
    from keel.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(list(args)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("keel: error:") and msg in err[0], err
    assert not any(tmp_path.iterdir())  # nothing half-written


@pytest.mark.parametrize("text, msg", [(b"[model\nd_model = 3", "cannot parse config"),
                                       (b"\xff\xfe[train]\n", "cannot read config"),  # was a UnicodeDecodeError traceback
                                       (b"[train]\nsteps = 3 # \xe9t\xe9\n", "cannot read config")])
@pytest.mark.parametrize("command", [("train", "--config"), ("config", "--show")])
def test_bad_toml_file(text, msg, command, tmp_path, capsys):
    from keel.cli import main

    bad = tmp_path / "bad.toml"
    bad.write_bytes(text)
    assert main([*command, str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"keel: error: {msg} {bad}"), err


@pytest.mark.parametrize("args,msg", [
    (("--max-new-tokens", "-3"), "--max-new-tokens must be >= 0"),
    (("--temperature", "-1"), "--temperature must be a finite number >= 0"),
    (("--top-k", "-3"), "--top-k must be >= 0, got -3"),  # named only the bad flag
    (("--num-samples", "0"), "--num-samples must be >= 1, got 0"),
])
def test_generate_rejects_bad_sampling_args(args, msg, capsys):
    """Found by a new-user trial: these were silently accepted (exit 0)."""
    from keel.cli import main

    assert main(["generate", "--run", "nowhere", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and msg in err[0]


def test_resume_without_checkpoint_refuses_then_restart(tiny_config, tmp_path, caplog):
    """A run with history but no checkpoint is never restarted silently (it used to start at
    step 0 and rewrite metrics.jsonl); restart=True (--restart) does it on request."""
    run = tmp_path / "r"
    train(tiny_config(steps=2, eval_every=2, checkpoint_every=2), run)
    import shutil

    shutil.rmtree(run / "checkpoints")  # as if interrupted before the first checkpoint
    before = (run / "metrics.jsonl").read_text()
    with pytest.raises(KeelError, match="has history but no intact checkpoint.*--restart") as e:
        train(tiny_config(steps=2, eval_every=2, checkpoint_every=2), run, resume=True)
    assert "\n" not in str(e.value)
    assert (run / "metrics.jsonl").read_text() == before  # history untouched
    train(tiny_config(steps=2, eval_every=2, checkpoint_every=2), run, resume=True, restart=True)
    assert [r["step"] for r in metrics(run)] == [0, 1, 2]


def test_resume_before_any_step_starts_at_zero(tiny_config, tmp_path, caplog):
    """Only the step-0 evaluation was logged: nothing to lose, the run starts (and says so)."""
    run = tmp_path / "r"
    train(tiny_config(steps=2, eval_every=2, checkpoint_every=2), run)
    import shutil

    shutil.rmtree(run / "checkpoints")
    (run / "metrics.jsonl").write_text(metrics(run)[0].__repr__().replace("'", '"') + "\n")
    with caplog.at_level("INFO", logger="keel"):
        train(tiny_config(steps=2, eval_every=2, checkpoint_every=2), run, resume=True)
    assert any("no checkpoint" in r.getMessage() and "step 0" in r.getMessage() for r in caplog.records)
    assert [r["step"] for r in metrics(run)] == [0, 1, 2]


def test_eval_tokens_below_seq_len_is_one_warning(tiny_config, tmp_path, caplog):
    """train.eval_tokens < train.seq_len evaluated one whole window (seq_len tokens) without a word
    (issue 49: the warning a line cap kept out)."""
    cfg = tiny_config(steps=1, warmup_steps=0, eval_every=1, checkpoint_every=1, sample_tokens=0)
    cfg.train.eval_tokens = cfg.train.seq_len - 1
    with caplog.at_level("INFO", logger="keel"):
        train(cfg, tmp_path / "run")
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warned == [f"warning: train.eval_tokens ({cfg.train.seq_len - 1}) < train.seq_len ({cfg.train.seq_len}): "
                      f"each evaluation reads one window of {cfg.train.seq_len} tokens"]


def test_a_key_the_scheme_ignores_is_one_warning(tiny_config, tmp_path, caplog):
    """`--set model.alpha=4` on a pre_ln run was accepted silently (only keel reads it): one
    warning line naming the key and its reader; a key at its default (hc_streams) and a key the
    scheme reads (alpha for keel) are not mentioned."""
    cfg = tiny_config(steps=1, warmup_steps=0, eval_every=1, checkpoint_every=1, sample_tokens=0)
    cfg.model.residual, cfg.model.alpha, cfg.model.hc_streams = "pre_ln", 4.0, 4
    with caplog.at_level("INFO", logger="keel"):
        train(cfg, tmp_path / "pre_ln")
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warned == ["model.alpha is read only by keel; model.residual=pre_ln ignores it"]
    caplog.clear()
    cfg.model.residual = "keel"
    with caplog.at_level("INFO", logger="keel"):
        train(cfg, tmp_path / "keel")
    assert not [r for r in caplog.records if r.levelname == "WARNING"]


class _SubnormalProbe(Callback):
    """Records, at every backward, what float32 arithmetic makes of a subnormal input."""

    def __init__(self):
        self.seen = []

    def on_gradients(self, state):
        self.seen.append((torch.tensor([1e-40]) * 1.0).item())


@pytest.mark.parametrize("flush", [True, False])
def test_flush_denormal_holds_during_training_only(tiny_config, tmp_path, flush):
    """train.flush_denormal (default on) flushes subnormals to zero in the training steps,
    the fix for the ~8x slower backward of a stagnating Post-LN (benchmarks/denormal.py),
    and leaves torch's default (off) behind."""
    probe = _SubnormalProbe()
    cfg = tiny_config(steps=3, eval_every=3)
    assert cfg.train.flush_denormal is True  # the default
    cfg.train.flush_denormal = flush
    train(cfg, tmp_path / "run", callbacks=[probe])
    assert len(probe.seen) == 3
    assert probe.seen == ([0.0] * 3 if flush else [pytest.approx(1e-40, rel=1e-4)] * 3)
    assert (torch.tensor([1e-40]) * 1.0).item() == pytest.approx(1e-40, rel=1e-4)


# ---------------------------------------------------------------- validation batching
def _trainer(cfg, run_dir):
    """A fresh run's Trainer (data, model, validation windows), nothing trained."""
    from keel.train import dist as D
    from keel.train.trainer import Trainer

    return Trainer(cfg, run_dir, False, [], D.init_distributed(torch.device("cpu")))


def _forward_passes(trainer) -> int:
    calls = []
    handle = trainer.model.register_forward_hook(lambda *_: calls.append(1))
    try:
        trainer.validate()
    finally:
        handle.remove()
    return len(calls)


def test_validation_of_one_token_windows_is_batched_by_tokens(tiny_config, tmp_path, caplog, one_thread):
    """seq_len=1, batch_size=1 validated 2,048 one-token windows in 2,048 forward passes (65,536 at the
    default train.eval_tokens: minutes of an apparent hang before step 1); now train.eval_batch_tokens
    (512) tokens per pass."""
    from keel.train.nll import eval_batch_size

    assert [eval_batch_size(1, 1, 512), eval_batch_size(4, 32, 512), eval_batch_size(16, 32, 512),
            eval_batch_size(16, 128, 512), eval_batch_size(3, 1000, 512)] == [512, 16, 16, 16, 3]
    trainer = _trainer(tiny_config(seq_len=1, batch_size=1, eval_tokens=2048), tmp_path / "one")
    assert tuple(trainer.val_windows.shape) == (2048, 2) and trainer.eval_bs == 512
    assert _forward_passes(trainer) == 4
    slow = _trainer(tiny_config(seq_len=1, batch_size=1, eval_tokens=2048, eval_batch_tokens=1), tmp_path / "slow")
    assert slow.eval_bs == 1 and _forward_passes(slow) == 2048
    with caplog.at_level("INFO", logger="keel"):
        slow._describe()
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("validation:")] == [
        "validation: 2,048 windows (train.eval_tokens = 2,048, train.seq_len = 1), 1 per forward pass on each "
        "process (train.eval_batch_tokens = 1): 2,048 forward passes per evaluation"]
    caplog.clear()
    with caplog.at_level("INFO", logger="keel"):
        trainer._describe()  # 4 passes: nothing to say
    assert not [r for r in caplog.records if r.getMessage().startswith("validation:")]
    # the same windows and, batched 512 at a time, the same loss as one window at a time (float rounding only)
    assert trainer.validate() == pytest.approx(slow.validate(), rel=1e-6)


def test_validation_loss_of_an_ordinary_config_is_unchanged(tiny_config, tmp_path, one_thread):
    """A micro-batch of train.eval_batch_tokens or more (16 x 32 = 512 tokens here; every shipped preset,
    sweep and CPU study) is validated in the batches it always was: the same val_loss to the last bit as
    the old path, train.batch_size windows per forward pass, written out here."""
    trainer = _trainer(tiny_config(batch_size=16, eval_tokens=4096), tmp_path / "r")
    windows, bs, model = trainer.val_windows, 16, trainer.model
    assert tuple(windows.shape) == (128, 33)
    model.eval()
    nats, n = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(windows), bs):
            batch = windows[i:i + bs]
            nats += float(model(batch[:, :-1], batch[:, 1:]).double() * batch[:, 1:].numel())
            n += batch[:, 1:].numel()
    model.train()
    assert n == 4096 and trainer.validate() == nats / n
