"""Hugging Face integration (keel.hf): KeelConfig / KeelForCausalLM against the native model,
KV-cache generation, save/load, tied embeddings, export-hf -> Auto* offline -> import-hf."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")

from safetensors.torch import load_file  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

import keel.hf  # noqa: E402,F401  (registers model_type "keel")
from conftest import REPO, tiny_overrides  # noqa: E402
from keel.cli import main  # noqa: E402
from keel.config import ModelConfig, load_config  # noqa: E402
from keel.errors import KeelError  # noqa: E402
from keel.hf import KeelConfig, KeelForCausalLM  # noqa: E402
from keel.model import SCHEMES, Transformer  # noqa: E402

SCHEME_NAMES = sorted(SCHEMES)


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run fastest on one thread, and the test machine is shared."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny_cfg(residual: str, tie: bool = False, **kw) -> ModelConfig:
    d = dict(vocab_size=97, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=48,
             residual=residual, tie_embeddings=tie)
    d.update(kw)
    return ModelConfig(**d)


def native_and_hf(cfg: ModelConfig, seed: int = 0):
    torch.manual_seed(seed)
    native = Transformer(cfg).eval()
    with torch.no_grad():  # non-trivial norm gains, so that a lost gain would show
        for p in native.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    hf = KeelForCausalLM(KeelConfig.from_model_config(cfg)).eval()
    hf.model.load_state_dict(native.state_dict())
    return native, hf


def test_config_covers_every_model_config_field():
    names = [f.name for f in dataclasses.fields(ModelConfig)]
    cfg = ModelConfig(vocab_size=101, d_model=48, n_layers=3, n_heads=6, n_kv_heads=3, d_ff=80, max_seq_len=40,
                      rope_theta=500.0, norm_eps=1e-6, tie_embeddings=True, init_std=0.03, residual="deepnorm",
                      alpha=3.5, keel_first_layer_rule=False, mix_ln_ratio=0.5)
    hc = KeelConfig.from_model_config(cfg)
    back = KeelConfig.from_dict(json.loads(hc.to_json_string())).to_model_config()
    for n in names:
        assert getattr(back, n) == getattr(cfg, n), n
    # the Hugging Face names are aliases of keel's
    assert (hc.hidden_size, hc.num_hidden_layers, hc.num_attention_heads, hc.num_key_value_heads) == (48, 3, 6, 3)
    assert (hc.max_position_embeddings, hc.intermediate_size, hc.tie_word_embeddings) == (40, 80, True)
    assert KeelConfig(hidden_size=64, n_heads=2).to_model_config().d_model == 64
    with pytest.raises(KeelError, match="residual"):
        KeelConfig(residual="nope").to_model_config()


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("scheme", SCHEME_NAMES)
def test_logits_and_loss_equal_native(scheme, tie):
    native, hf = native_and_hf(tiny_cfg(scheme, tie))
    ids = torch.randint(0, 97, (3, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = native(ids)
        out = hf(ids, labels=ids)
        wrapped = KeelForCausalLM.from_native(native)(ids).logits
    assert out.logits.dtype == torch.float32 and out.logits.shape == (3, 17, 97)
    torch.testing.assert_close(out.logits, ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(wrapped, ref, atol=1e-5, rtol=0)
    # HF labels are aligned with input_ids and shifted inside: the native next-token loss
    with torch.no_grad():
        torch.testing.assert_close(out.loss, native(ids[:, :-1], ids[:, 1:]), atol=1e-5, rtol=0)
        assert torch.equal(hf(ids, logits_to_keep=1).logits, out.logits[:, -1:])


@pytest.mark.parametrize("scheme", SCHEME_NAMES)
def test_generate_kv_cache_equals_no_cache(scheme):
    _, hf = native_and_hf(tiny_cfg(scheme), seed=3)
    prompt = torch.randint(0, 97, (1, 7), generator=torch.Generator().manual_seed(2))
    seen = []
    hook = hf.model.register_forward_pre_hook(lambda m, args, kwargs: seen.append(
        (args[0].shape[1], kwargs.get("cache") is not None)), with_kwargs=True)
    with torch.no_grad():
        cached = hf.generate(prompt, max_new_tokens=12, do_sample=False, use_cache=True)
        n_cached = len(seen)
        plain = hf.generate(prompt, max_new_tokens=12, do_sample=False, use_cache=False)
    hook.remove()
    # with the cache: the prompt once, then one token per step; without: the whole context each step
    assert seen[:n_cached] == [(7, True)] + [(1, True)] * 11
    assert seen[n_cached:] == [(7 + i, False) for i in range(12)]
    assert cached.shape == (1, 19)
    assert torch.equal(cached, plain)
    # and both equal the native greedy decoding
    assert torch.equal(cached, hf.model.generate(prompt, 12, temperature=0, use_cache=False))


def test_attention_mask_right_padding_ok_left_padding_raises():
    _, hf = native_and_hf(tiny_cfg("keel"))
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = hf(ids).logits
        mask = torch.ones(2, 9, dtype=torch.long)
        mask[1, 6:] = 0  # right padding: real positions are unaffected
        torch.testing.assert_close(hf(ids, attention_mask=mask).logits[1, :6], ref[1, :6], atol=0, rtol=0)
        mask[0, 0] = 0  # left padding
        with pytest.raises(KeelError, match="left padding"):
            hf(ids, attention_mask=mask)
        with pytest.raises(KeelError, match="position_ids"):
            hf(ids, position_ids=torch.arange(9).expand(2, 9) + 1)


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("scheme", SCHEME_NAMES)
def test_save_pretrained_round_trip(tmp_path, scheme, tie):
    _, hf = native_and_hf(tiny_cfg(scheme, tie))
    hf.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    assert ("model.lm_head.weight" in saved) != tie  # a tied head is stored once, as the embedding
    assert "model.rope_cos" not in saved
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is KeelForCausalLM
    assert (loaded.model.lm_head.weight is loaded.model.tok_emb.weight) == tie
    for name, p in hf.model.state_dict().items():
        assert torch.equal(loaded.model.state_dict()[name], p), name
    ids = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, hf(ids).logits, atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def trained_run(tiny_data, tmp_path_factory):
    """A 4-step run of the tiny fixture model with tied embeddings."""
    from keel.train import train

    run = tmp_path_factory.mktemp("hfrun") / "run"
    sets = tiny_overrides(tiny_data, steps=4, eval_every=4, checkpoint_every=4) + ["model.tie_embeddings=true"]
    train(load_config(REPO / "keel" / "configs" / "demo.toml", sets), run)
    return run


def test_export_auto_load_offline_generate_import(trained_run, tmp_path, monkeypatch, capsys):
    import huggingface_hub.constants as hub_constants

    from keel.run import Run
    from keel.train.checkpoint import latest_checkpoint

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    out = tmp_path / "hf"
    assert main(["export-hf", "--run", str(trained_run), "--out", str(out)]) == 0
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "keel_config.toml"):
        assert (out / f).is_file(), f
    assert json.loads((out / "config.json").read_text())["model_type"] == "keel"

    native, tok = Run(trained_run).load_model(), Run(trained_run).tokenizer()
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    hf_tok = AutoTokenizer.from_pretrained(out)
    text = "def parse(self, text):\n    return text.split()\n"
    ids = hf_tok(text, return_tensors="pt").input_ids
    assert ids[0].tolist() == tok.encode(text).ids
    assert hf_tok.eos_token == "<|endoftext|>" and hf_tok.eos_token_id == tok.token_to_id("<|endoftext|>")
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, native(ids), atol=1e-5, rtol=0)
        gen = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(gen, native.generate(ids, 8, temperature=0))
    assert hf_tok.decode(gen[0, : ids.shape[1]]) == text

    # the inverse: a run directory keel generate / keel eval accept, with the same weights
    back = tmp_path / "run-back"
    assert main(["import-hf", "--hf", str(out), "--out", str(back)]) == 0
    a = load_file(latest_checkpoint(trained_run) / "model.safetensors")
    b = load_file(latest_checkpoint(back) / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert load_config(back / "config.toml").model == load_config(trained_run / "config.toml").model
    capsys.readouterr()
    prompt = "def "
    assert main(["generate", "--run", str(back), "--prompt", prompt, "--max-new-tokens", "6",
                 "--temperature", "0"]) == 0
    expected = tok.decode(native.generate(torch.tensor([tok.encode(prompt).ids]), 6, temperature=0)[0].tolist())
    assert capsys.readouterr().out.strip() == expected.strip()

    # refusing to overwrite: one line, exit status 2
    assert main(["export-hf", "--run", str(trained_run), "--out", str(out)]) == 2
    assert "already exists" in capsys.readouterr().err


def test_tokenizer_loads_without_keel(trained_run, tmp_path):
    """AutoTokenizer needs no keel import (the model does: see keel.hf's docstring)."""
    from keel.hf.convert import export_hf

    out = export_hf(trained_run, tmp_path / "hf")
    code = ("import sys; from transformers import AutoTokenizer; t = AutoTokenizer.from_pretrained(sys.argv[1]); "
            "print(t('import os').input_ids, 'keel' in sys.modules)")
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    r = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    from tokenizers import Tokenizer

    expected = Tokenizer.from_file(str(trained_run / "tokenizer.json")).encode("import os").ids
    assert r.stdout.split("]")[0] + "]" == str(expected)
    assert r.stdout.strip().endswith("False")
