"""keel.train.checkpoint.CheckpointManager: the one path that saves, finds, loads and removes a run's
checkpoints, in both formats (full: safetensors + trainer.pt; sharded: torch.distributed.checkpoint).

Real tiny models, real files in tmp_path; every test checks the values it gets back."""

import logging

import pytest
import torch
import torch.distributed as dist

from keel import KeelError
from keel.config import ModelConfig, TrainConfig
from keel.model import Transformer
from keel.rundir import RunDir
from keel.train.checkpoint import (LATEST, MANIFEST, CheckpointManager, NonFiniteWeights, checkpoint_problem,
                                   is_sharded, step_name)
from keel.train.dist import DistInfo
from keel.train.optim import build_optimizer
from keel.train.state_dict import TrainState


def tiny_model(seed=0):
    torch.manual_seed(seed)
    return Transformer(ModelConfig(d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32, vocab_size=64,
                                   max_seq_len=16))


class Loader:
    """A data loader's resumable position (what TrainState saves of a keel.data.TokenLoader)."""

    def __init__(self, position=0):
        self.position = position

    def state_dict(self):
        return {"epoch": 0, "position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


def trained(model, steps=2):
    """``model`` and an AdamW with ``steps`` real updates (non-zero moments)."""
    opt = build_optimizer(model, TrainConfig())
    for _ in range(steps):
        loss = model(torch.randint(0, 64, (2, 8))).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    return opt


def state_of(step):
    """A trainer state of step ``step`` that find_intact accepts (keel.train.checkpoint.TRAINER_STATE)."""
    return {"step": step, "tokens": 16 * step, "elapsed_s": 0.1 * step, "loader": {"epoch": 0, "position": step},
            "rng": torch.get_rng_state()}


def same_tensors(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_save_keeps_the_newest_and_points_latest_to_the_last(tmp_path):
    model, run = tiny_model(), tmp_path / "run"
    ckpts = CheckpointManager(run, keep=2)
    saved = [ckpts.save(step, model, state_of(step)) for step in (3, 6, 9)]
    root = RunDir(run).checkpoints
    assert saved == [root / step_name(s) for s in (3, 6, 9)]
    assert sorted(p.name for p in root.iterdir()) == [LATEST, step_name(6), step_name(9)]
    assert (root / LATEST).read_text() == step_name(9) + "\n"
    assert ckpts.steps() == [6, 9]
    assert ckpts.complete() == [root / step_name(6), root / step_name(9)]
    assert ckpts.find_intact() == (root / step_name(9), [])
    assert ckpts.latest() == root / step_name(9)
    assert ckpts.has_folders()
    assert not CheckpointManager(tmp_path / "empty").has_folders()


def test_keep_zero_keeps_all_and_prune_removes_the_oldest(tmp_path):
    model = tiny_model()
    ckpts = CheckpointManager(tmp_path, keep=0)
    for step in (1, 2, 3, 4):
        ckpts.save(step, model, state_of(step))
    assert ckpts.steps() == [1, 2, 3, 4]
    removed = ckpts.prune(keep=1)
    assert [p.name for p in removed] == [step_name(3), step_name(2), step_name(1)]
    assert ckpts.steps() == [4]


def test_load_weights_and_trainer_state_are_bit_equal(tmp_path):
    model = tiny_model(seed=1)
    state = {"step": 5, "tokens": 640, "rng": torch.get_rng_state()}
    ckpt = CheckpointManager(tmp_path).save(5, model, state)
    fresh = tiny_model(seed=2)
    assert not same_tensors(fresh.state_dict(), model.state_dict())
    CheckpointManager.load_weights(fresh, ckpt)
    assert same_tensors(fresh.state_dict(), model.state_dict())
    back = CheckpointManager.load_trainer_state(ckpt)
    assert back["step"] == 5 and back["tokens"] == 640 and torch.equal(back["rng"], state["rng"])


def test_a_damaged_newest_checkpoint_is_skipped(tmp_path, caplog):
    model = tiny_model()
    ckpts = CheckpointManager(tmp_path, keep=0)
    for step in (3, 6, 9):
        ckpts.save(step, model, state_of(step))
    newest = ckpts.root / step_name(9)
    weights = newest / "model.safetensors"
    weights.write_bytes(b"\0" * weights.stat().st_size)  # same size, other bytes
    assert checkpoint_problem(newest) == "model.safetensors does not match its sha256 in the manifest"
    found, reasons = ckpts.find_intact()
    assert found == ckpts.root / step_name(6)
    assert reasons == [f"{step_name(9)}: model.safetensors does not match its sha256 in the manifest"]
    with caplog.at_level(logging.WARNING, logger="keel.train.checkpoint"):
        assert ckpts.latest() == ckpts.root / step_name(6)
    assert f"skipping {step_name(9)}: model.safetensors does not match" in caplog.text
    assert ckpts.steps() == [3, 6, 9]  # complete() lists files, it does not verify them


def test_remove_after_remove_all_and_temporaries(tmp_path, caplog):
    model = tiny_model()
    ckpts = CheckpointManager(tmp_path, keep=0)
    for step in (2, 4, 6):
        ckpts.save(step, model, state_of(step))
    stray = ckpts.root / ".step_00000008.abc.tmp"
    stray.mkdir()
    (stray / "model.safetensors").write_bytes(b"half")
    with caplog.at_level(logging.WARNING, logger="keel.train.checkpoint"):
        assert [p.name for p in ckpts.remove_after(3)] == [step_name(6), step_name(4)]
    assert f"removing {step_name(6)}, a checkpoint past step 3" in caplog.text
    assert ckpts.steps() == [2]
    assert ckpts.clean_temporaries() == [stray] and not stray.exists()
    ckpts.remove_all()
    assert not ckpts.root.exists() and ckpts.find_intact() == (None, [])


def test_a_non_finite_weight_is_never_written(tmp_path):
    model = tiny_model()
    ckpts = CheckpointManager(tmp_path)
    ckpts.save(1, model, state_of(1))
    with torch.no_grad():
        next(model.parameters())[0] = float("nan")
    with pytest.raises(NonFiniteWeights, match="refusing to checkpoint step 2"):
        ckpts.save(2, model, state_of(2))
    assert ckpts.steps() == [1] and (ckpts.root / LATEST).read_text() == step_name(1) + "\n"


def test_full_training_state_round_trips_through_save_and_restore(tmp_path):
    model = tiny_model(seed=3)
    opt = trained(model)
    ts = TrainState(Loader(position=37), {"train": {}}, step=2, tokens=32, elapsed=1.5)
    rng = torch.get_rng_state()
    ckpt = CheckpointManager(tmp_path).save(2, model, ts, optimizer=opt)
    assert set(CheckpointManager.load_trainer_state(ckpt)) == {"step", "tokens", "elapsed_s", "loader", "rng",
                                                               "config", "optimizer"}
    torch.manual_seed(99)  # another RNG state: restore puts the saved one back
    fresh = tiny_model(seed=4)
    CheckpointManager.load_weights(fresh, ckpt)
    fresh_opt = build_optimizer(fresh, TrainConfig())
    back = TrainState(Loader(), {})
    CheckpointManager.restore(ckpt, fresh, fresh_opt, back)
    assert (back.step, back.tokens, back.elapsed, back.loader.position) == (2, 32, 1.5, 37)
    assert torch.equal(torch.get_rng_state(), rng)
    assert same_tensors(fresh.state_dict(), model.state_dict())
    for p, q in zip(model.parameters(), fresh.parameters()):
        assert same_tensors(opt.state[p], fresh_opt.state[q])


def test_the_sharded_format_saves_and_loads_through_the_same_manager(tmp_path, one_thread):
    """A process group of one: save writes dcp/ shards; weights and AdamW state load back bit-equal
    in one process (as keel export-hf / eval / a resume at another world size read them)."""
    model = tiny_model(seed=5)
    opt = trained(model)
    state = state_of(4)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        ckpt = CheckpointManager(tmp_path / "run", DistInfo(), keep=1).save(4, model, state, optimizer=opt)
    finally:
        dist.destroy_process_group()
    ckpts = CheckpointManager(tmp_path / "run")
    assert is_sharded(ckpt) and checkpoint_problem(ckpt) is None and (ckpt / MANIFEST).is_file()
    assert ckpts.find_intact() == (ckpt, []) and ckpts.steps() == [4]
    assert "optimizer" not in CheckpointManager.load_trainer_state(ckpt)  # it lies with the shards
    weights_only = tiny_model(seed=6)
    CheckpointManager.load_weights(weights_only, ckpt)
    assert same_tensors(weights_only.state_dict(), model.state_dict())
    fresh = tiny_model(seed=7)
    fresh_opt = build_optimizer(fresh, TrainConfig())
    CheckpointManager.restore(ckpt, fresh, fresh_opt)
    assert same_tensors(fresh.state_dict(), model.state_dict())
    for p, q in zip(model.parameters(), fresh.parameters()):
        assert same_tensors(opt.state[p], fresh_opt.state[q])


def test_loading_a_missing_checkpoint_says_where(tmp_path):
    with pytest.raises(KeelError, match="no model weights at"):
        CheckpointManager.load_weights(tiny_model(), tmp_path)
    with pytest.raises(KeelError, match="no trainer state at"):
        CheckpointManager.load_trainer_state(tmp_path)
