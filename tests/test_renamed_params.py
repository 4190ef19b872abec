"""Checkpoints saved before a parameter rename keep loading (keel.keys.RENAMED_PARAMS): a Block's
residual-scheme units were ``attn_res`` / ``ffn_res`` and are ``attn_residual`` / ``ffn_residual``.
Each format is written here with the old names -- a single-process checkpoint (weights and the
name-keyed AdamW state), a sharded (torch.distributed.checkpoint) one, an exported Hugging Face
folder -- then loaded by the current code, which must give back every parameter and moment exactly."""

import json
import re
import shutil

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint import FileSystemReader

from keel.config import ModelConfig, load_config
from keel.keys import current_param_name
from keel.model import Transformer
from keel.run import Run
from keel.train import checkpoint as C
from keel.train import state_dict as SD
from keel.train import train
from keel.train.dist import DistInfo
from keel.train.optim import build_optimizer

STEP = 8  # the reference run checkpoints steps 4, 8 and 12 (conftest.tiny_overrides)


def old_name(name: str) -> str:
    """The name a checkpoint saved before the rename stores (written out here, not keel's table)."""
    return re.sub(r"(?<![^.])(blocks\.\d+\.)(attn|ffn)_residual\.", r"\1\2_res.", name)


def old_names(tensors: dict) -> dict:
    out = {old_name(k): v for k, v in tensors.items()}
    assert out.keys() != tensors.keys()  # some parameter lives in a block's unit: the test tests something
    return out


def old_optimizer_state(state: dict) -> dict:
    """A name-keyed optimizer state (state + param_groups) under the old names; tensors shared."""
    return {**state, "state": old_names(state["state"]),
            "param_groups": [{**g, "params": [old_name(p) for p in g["params"]]} for g in state["param_groups"]]}


def assert_same_model_and_moments(model, opt, ref_model, ref_opt):
    ref, got = ref_model.state_dict(), model.state_dict()
    assert ref.keys() == got.keys() and all(torch.equal(got[k], v) for k, v in ref.items())
    ref_state = SD.full_optimizer_state_dict(ref_model, ref_opt)["state"]
    got_state = SD.full_optimizer_state_dict(model, opt)["state"]
    assert ref_state.keys() == got_state.keys() and any(".attn_residual." in k for k in got_state)
    for k, moments in ref_state.items():
        assert moments.keys() == got_state[k].keys() == {"step", "exp_avg", "exp_avg_sq"}
        assert all(torch.equal(got_state[k][m], v) for m, v in moments.items()), k


def records(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def assert_resumes_like_the_reference(run, reference):
    """Resumed from step 8, the run's losses and final weights equal the uninterrupted run's, bit for bit."""
    train(load_config(run / "config.toml"), run, resume=True)
    a, b = records(reference), records(run)
    assert [r["step"] for r in a] == [r["step"] for r in b]
    assert all(ra.get("loss") == rb.get("loss") for ra, rb in zip(a, b))
    wa, wb = Run(reference).load_model().state_dict(), Run(run).load_model().state_dict()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def checkpoint_of(ckpt, cfg):
    """The model and AdamW of checkpoint folder ``ckpt`` (single-process format), loaded by keel."""
    model = Transformer(cfg.model)
    C.CheckpointManager.load_weights(model, ckpt)
    opt = build_optimizer(model, cfg.train)
    SD.load_optimizer_state_dict(model, opt, C.CheckpointManager.load_trainer_state(ckpt)["optimizer"])
    return model, opt


def copy_without_checkpoints(reference, tmp_path):
    run = tmp_path / "old"
    shutil.copytree(reference, run)
    for p in (run / "checkpoints").glob("step_*"):
        shutil.rmtree(p)
    return run


def test_the_name_table_renames_a_blocks_units_only():
    assert current_param_name("model.blocks.3.attn_res.norm.weight") == "model.blocks.3.attn_residual.norm.weight"
    assert current_param_name("optim.state.blocks.12.ffn_res.query.exp_avg") == \
        "optim.state.blocks.12.ffn_residual.query.exp_avg"
    for name in ("blocks.0.attn_residual.query", "blocks.0.attn_res_norm.weight", "attn_res.norm.weight",
                 "tok_emb.weight", "readout.key_norm.weight"):
        assert current_param_name(name) == name
    assert current_param_name("blocks.1.ffn_residual.norm.weight", old=True) == "blocks.1.ffn_res.norm.weight"


def test_single_process_checkpoint_with_old_names_loads_and_resumes(tiny_reference_run, tmp_path, one_thread):
    """model.safetensors and trainer.pt's AdamW state, both keyed by the old names."""
    ref_ckpt = tiny_reference_run / "checkpoints" / f"step_{STEP:08d}"
    cfg = load_config(tiny_reference_run / "config.toml")
    run = copy_without_checkpoints(tiny_reference_run, tmp_path)
    state = C.CheckpointManager.load_trainer_state(ref_ckpt)
    state["optimizer"] = old_optimizer_state(state["optimizer"])
    ckpt = C.CheckpointManager(run, keep=0).save(STEP, old_names(load_file(ref_ckpt / "model.safetensors")), state)
    assert any(".attn_res." in k for k in load_file(ckpt / "model.safetensors"))
    assert_same_model_and_moments(*checkpoint_of(ckpt, cfg), *checkpoint_of(ref_ckpt, cfg))
    assert_resumes_like_the_reference(run, tiny_reference_run)


def test_sharded_checkpoint_with_old_names_loads_and_resumes(tiny_reference_run, tmp_path, monkeypatch, one_thread):
    """A dcp/ checkpoint (weights and AdamW state, as CheckpointManager.save writes them in a
    process group) keyed by the old names: read in one process, as export, eval and a resume do."""
    ref_ckpt = tiny_reference_run / "checkpoints" / f"step_{STEP:08d}"
    cfg = load_config(tiny_reference_run / "config.toml")
    run = copy_without_checkpoints(tiny_reference_run, tmp_path)
    model, opt = checkpoint_of(ref_ckpt, cfg)
    state = {k: v for k, v in C.CheckpointManager.load_trainer_state(ref_ckpt).items() if k != "optimizer"}
    current = C.sharded_state_dict

    def as_an_older_keel_saved(model, opt):
        sd = current(model, opt)
        return {"model": old_names(sd["model"]), "optim": old_optimizer_state(sd["optim"])}

    with monkeypatch.context() as m:
        m.setattr(C, "sharded_state_dict", as_an_older_keel_saved)
        dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
        try:
            ckpt = C.CheckpointManager(run, DistInfo()).save(STEP, model, state, optimizer=opt)
        finally:
            dist.destroy_process_group()
    stored = FileSystemReader(ckpt / C.SHARDED_DIR).read_metadata().state_dict_metadata
    assert {"model.blocks.0.attn_res.norm_in.weight", "optim.state.blocks.0.ffn_res.norm_in.weight.exp_avg"} <= set(stored)
    assert C.checkpoint_problem(ckpt) is None
    fresh = Transformer(cfg.model)
    fresh_opt = build_optimizer(fresh, cfg.train)
    C.CheckpointManager.restore(ckpt, fresh, fresh_opt)
    assert_same_model_and_moments(fresh, fresh_opt, model, opt)
    weights_only = Transformer(cfg.model)
    C.CheckpointManager.load_weights(weights_only, ckpt)  # keel export-hf / eval / generate
    assert all(torch.equal(weights_only.state_dict()[k], v) for k, v in model.state_dict().items())
    assert_resumes_like_the_reference(run, tiny_reference_run)


def test_hf_folder_with_old_names_loads(tmp_path):
    """An exported keel folder (any scheme but pre_ln, which exports as a stock Llama) whose
    model.safetensors holds model.blocks.N.attn_res.*: transformers' Auto class loads it."""
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    from keel.hf import KeelForCausalLM

    cfg = ModelConfig(vocab_size=97, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=48,
                      residual="attn_res")
    torch.manual_seed(0)
    native = Transformer(cfg).eval()
    with torch.no_grad():  # no parameter at its initial value, so that a missed one shows
        for p in native.parameters():
            p.add_(0.1 * torch.randn_like(p))
    KeelForCausalLM.from_native(native).save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    save_file(old_names(weights), tmp_path / "model.safetensors", metadata={"format": "pt"})
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(loaded) is KeelForCausalLM
    got = loaded.model.state_dict()
    assert all(torch.equal(got[k], v) for k, v in native.state_dict().items())
