"""Issue 20 (items 1, 5, 6, 8): the LR as a pure function of the step (no scheduler object,
old checkpoints still resume bit for bit), one public entry point that honours the whole
config, the on_train_end hook, a Trainer that leaves the caller's Config alone, and one
parameter count."""

import copy
import gc
import json
import shutil
import types

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

import pytest
import torch
from safetensors.torch import load_file

import keel
from conftest import REPO, tiny_overrides
from keel.cli import main
from keel.config import load_config
from keel.diagnostics.divergence import INSTABILITY, classify_metrics
from keel.errors import KeelError
from keel.experiments import overview
from keel.experiments.training import run_callbacks, train_run
from keel.model import SCHEMES, Transformer, count_parameters
from keel.run import Run
from keel.train import Callback, TrainingStopped, train
from keel.train import dist as D
from keel.train.checkpoint import CheckpointManager
from keel.train.optim import lr_at
from keel.train.trainer import Trainer

DEMO = REPO / "keel" / "configs" / "demo.toml"


def cfg_for(data, *extra, **train_keys):
    return load_config(DEMO, tiny_overrides(data, **train_keys) + list(extra))


def records(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def reachable(root, skip=(types.ModuleType, types.FunctionType, type)):
    """Every object reachable from ``root`` through references (modules, functions and
    classes are not followed: their globals reach the whole interpreter)."""
    seen, todo = {id(root)}, [root]
    while todo:
        for ref in gc.get_referents(todo.pop()):
            if id(ref) not in seen and not isinstance(ref, skip):
                seen.add(id(ref))
                todo.append(ref)
                yield ref


# ----------------------------------------------------------------- item 1: the LR schedule
def test_no_lr_scheduler_object_in_checkpoints(tiny_data, tmp_path, one_thread):
    cfg = cfg_for(tiny_data, steps=4, eval_every=4, checkpoint_every=2)
    trainer = Trainer(cfg, tmp_path / "r", False, [], D.init_distributed(torch.device("cpu")))
    trainer.fit()
    assert not any(isinstance(o, torch.optim.lr_scheduler.LRScheduler) for o in reachable(trainer))
    for ckpt in (tmp_path / "r" / "checkpoints").glob("step_*"):
        state = CheckpointManager.load_trainer_state(ckpt)
        assert "scheduler" not in state
        assert all("initial_lr" not in g for g in state["optimizer"]["param_groups"])  # LambdaLR's mark
    # the LR of every step is lr_at(step) itself, written into both param groups
    recs = [r for r in records(tmp_path / "r") if "loss" in r]
    assert [r["lr"] for r in recs] == [lr_at(s, cfg.train) for s in range(4)]
    assert [g["lr"] for g in trainer.optimizer.param_groups] == [lr_at(3, cfg.train)] * 2


def old_format(run, step, cfg):
    """Rewrite checkpoint ``step`` of ``run`` as the trainer wrote it before the LR became a
    function: a ``scheduler`` entry (the state of ``LambdaLR(opt, lr_at / lr)`` after
    ``step`` steps) and ``initial_lr`` in every param group of the optimizer state."""
    ckpt = run / "checkpoints" / f"step_{step:08d}"
    weights, state = load_file(ckpt / "model.safetensors"), CheckpointManager.load_trainer_state(ckpt)
    opt = torch.optim.AdamW([{"params": [torch.nn.Parameter(torch.zeros(2, 2))]},
                             {"params": [torch.nn.Parameter(torch.zeros(2))]}], lr=cfg.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_at(s, cfg) / cfg.lr)
    for _ in range(step):
        opt.step()
        sched.step()
    state["scheduler"] = sched.state_dict()
    for group in state["optimizer"]["param_groups"]:
        group["initial_lr"] = cfg.lr
    for p in (run / "checkpoints").glob("step_*"):
        shutil.rmtree(p)
    CheckpointManager(run, keep=0).save(step, weights, state)


def test_old_checkpoint_with_a_scheduler_entry_resumes_exactly(tiny_reference_run, tmp_path, one_thread):
    """A checkpoint of the old format (with the LambdaLR state) resumes from step 8 with the
    uninterrupted run's LRs, losses and final weights, bit for bit."""
    run = tmp_path / "old"
    shutil.copytree(tiny_reference_run, run)
    cfg = load_config(run / "config.toml")
    old_format(run, 8, cfg.train)
    assert CheckpointManager.load_trainer_state(CheckpointManager(run).latest())["scheduler"]["last_epoch"] == 8
    train(cfg, run, resume=True)
    a, b = records(tiny_reference_run), records(run)
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b):
        for key in ("loss", "grad_norm", "lr", "val_loss", "tokens"):
            assert ra.get(key) == rb.get(key), (ra["step"], key)
    wa, wb = Run(tiny_reference_run).load_model().state_dict(), Run(run).load_model().state_dict()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


# ------------------------------------------------- item 5: one entry point, the whole config
@pytest.mark.parametrize("settings,key", [
    (["train.stop_on_divergence=true"], "train.stop_on_divergence"),
    (["train.gradflow_every=2"], "train.gradflow_every"),
    (["train.eval_tasks='keel_python_completion'", "train.eval_tasks_every=2"], "train.eval_tasks"),
    (["train.divergence_reference='{ref}'"], "train.divergence_reference"),
])
def test_low_level_train_refuses_keys_it_cannot_honour(settings, key, tiny_data, tmp_path):
    """These keys were silently ignored by keel.train.train without the experiments layer."""
    (tmp_path / "ref").mkdir()  # a reference run's curve (its callback reads it when it is made)
    (tmp_path / "ref" / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 5.0, "lr": 1e-3}) + "\n")
    cfg = cfg_for(tiny_data, *[s.format(ref=tmp_path / "ref") for s in settings])
    with pytest.raises(KeelError) as e:
        train(cfg, tmp_path / "r")
    assert key in str(e.value) and "keel.train_run" in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "r").exists()
    # with the callbacks the config asks for, the same config is accepted
    assert key in {k for cb in run_callbacks(cfg) for k in cb.config_keys}


def test_public_entry_point_stops_on_divergence_as_keel_train_does(tiny_data, tmp_path, one_thread):
    assert keel.train_run is train_run
    sets = tiny_overrides(tiny_data, steps=200, lr=3.0, eval_every=1000, checkpoint_every=1000, batch_size=2,
                          seq_len=16, stop_on_divergence=True)
    with pytest.raises(TrainingStopped, match="stop_on_divergence"):
        keel.train_run(load_config(DEMO, sets), tmp_path / "api")
    argv = ["train", "--config", str(DEMO), "--run-dir", str(tmp_path / "cli")]
    assert main(argv + [x for s in sets for x in ("--set", s)]) != 0
    timing = ("tokens_per_s", "elapsed_s")
    api, cli = ([{k: v for k, v in r.items() if k not in timing} for r in records(tmp_path / d)] for d in ("api", "cli"))
    assert api == cli and "divergence" in api[-1] and api[-1]["divergence"]["mode"] == INSTABILITY


class ResetWeights(Callback):
    """After step ``at``, put the initial weights back: the loss jumps to ~log V and, with
    the cosine tail's small LR, stays up to the end (a spike still open at the last step)."""

    def __init__(self, at):
        self.at = at

    def on_train_start(self, state):
        self.initial = copy.deepcopy(state.model.state_dict())

    def on_step_end(self, state):
        if state.step == self.at:
            state.model.load_state_dict(self.initial)


def test_spike_open_at_the_last_step_is_reported_at_train_end(tiny_data, tmp_path, caplog, one_thread):
    """Before the on_train_end hook, the monitor's finalize() never ran online: no record."""
    cfg = cfg_for(tiny_data, steps=60, lr=1e-2, batch_size=8, eval_every=1000, checkpoint_every=1000,
                  sample_tokens=0)
    with caplog.at_level("WARNING", logger="keel"):
        train(cfg, tmp_path / "r", callbacks=run_callbacks(cfg) + [ResetWeights(54)])
    recs = records(tmp_path / "r")
    end = recs[-1]
    assert end["step"] == 60 and "loss" not in end and end["divergence"]["mode"] == INSTABILITY
    assert end["divergence"]["step"] == 55 and end["divergence"]["evidence"]["open_at_end"] == 1.0
    assert [r for r in recs if "divergence" in r] == [end]  # nothing fired before the end
    assert end["divergence"] == classify_metrics(recs).to_dict()  # online == offline
    assert any("divergence detected at the end of the run" in r.getMessage() for r in caplog.records)


# ------------------------------------------------- items 6 and 8: the caller's Config, keep 0
def test_callers_config_is_unchanged_and_keep_0_keeps_every_checkpoint(tiny_data, tmp_path, one_thread):
    cfg = cfg_for(tiny_data, "model.vocab_size='auto'", steps=6, eval_every=6, checkpoint_every=2,
                  keep_checkpoints=0, sample_tokens=0)
    before = copy.deepcopy(cfg)
    train(cfg, tmp_path / "r")
    assert cfg == before and cfg.model.vocab_size == "auto"  # the caller's object
    assert load_config(tmp_path / "r" / "config.toml").model.vocab_size == 512  # the run's resolved value
    names = sorted(p.name for p in (tmp_path / "r" / "checkpoints").glob("step_*"))
    assert names == ["step_00000002", "step_00000004", "step_00000006"]


@pytest.mark.parametrize("n_layers", [1, 2, 5])
@pytest.mark.parametrize("residual", sorted(SCHEMES))
def test_one_parameter_count(residual, n_layers):
    mc = load_config(DEMO, [f"model.residual={residual}", f"model.n_layers={n_layers}", "model.vocab_size=512",
                            "model.d_model=32", "model.n_heads=2", "model.n_kv_heads=1", "model.d_ff=64"]).model
    model = Transformer(mc)
    assert overview.count_parameters is count_parameters
    assert count_parameters(mc) == model.num_params() == sum(p.numel() for p in model.parameters())
    assert count_parameters(mc, non_embedding=True) == model.num_params(non_embedding=True)


@pytest.mark.parametrize("edit,match", [
    (lambda c: setattr(c.train, "stop_on_divergence", "maybe"), "train.stop_on_divergence must be true or false"),
    (lambda c: setattr(c.train, "steps", 0), r"train.steps must be between 1 and 1e\+12, got 0"),
    (lambda c: setattr(c.train, "foo", 1), "unknown config key train.foo"),
    (lambda c: setattr(c.model, "residual", "nope"), "nope"),
])
def test_a_config_edited_in_python_is_checked_as_the_cli_checks_it(edit, match, tiny_data, tmp_path):
    """A fresh-user trial set train.stop_on_divergence = "yes" in Python: the run trained and
    wrote the string into config.toml (the CLI refuses such values); an unknown attribute was
    ignored silently."""
    cfg = cfg_for(tiny_data, steps=2)
    edit(cfg)
    with pytest.raises(KeelError, match=match) as e:
        train_run(cfg, tmp_path / "r")
    assert "\n" not in str(e.value) and not (tmp_path / "r").exists()


def test_a_path_instead_of_a_config_is_a_keel_error(tmp_path):
    with pytest.raises(KeelError, match="expected a keel.config.Config .* got str"):
        train_run("keel/configs/demo.toml", tmp_path / "r")


def test_a_python_value_is_stored_as_the_cli_would_store_it(tiny_data, tmp_path, one_thread):
    cfg = cfg_for(tiny_data, steps=2, eval_every=2, checkpoint_every=2, sample_tokens=0)
    cfg.train.progress = "false"  # the string a TOML-less caller might write; --set would coerce it
    train_run(cfg, tmp_path / "r")
    assert tomllib.loads((tmp_path / "r" / "config.toml").read_text())["train"]["progress"] is False
