"""Hugging Face integration (keel.hf): KeelConfig / KeelForCausalLM against the native model,
KV-cache generation, save/load, tied embeddings, export-hf -> Auto* offline -> import-hf; exports
that load without keel (generated code + auto_map, checked with keel's import blocked), pre_ln as
a stock Llama both ways, and the Llama features import-hf refuses."""

import dataclasses
import json
import math
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")

from conftest import HANG_S, REPO, tiny_overrides
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

import keel.hf  # noqa: F401  (registers model_type "keel")
from keel.cli import main
from keel.config import ModelConfig, load_config
from keel.errors import KeelError
from keel.hf import KeelConfig, KeelForCausalLM
from keel.model import SCHEMES, Transformer

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
        KeelForCausalLM(KeelConfig(residual="nope", vocab_size=97))


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


def test_attention_mask_right_padding_and_bad_position_ids():
    _, hf = native_and_hf(tiny_cfg("keel"))
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = hf(ids).logits
        mask = torch.ones(2, 9, dtype=torch.long)
        mask[1, 6:] = 0  # right padding: real positions are unaffected
        torch.testing.assert_close(hf(ids, attention_mask=mask).logits[1, :6], ref[1, :6], atol=1e-5, rtol=0)
        with pytest.raises(KeelError, match="position_ids"):
            hf(ids, position_ids=torch.arange(9).expand(2, 9) + 1)
        with pytest.raises(KeelError, match="2-D attention_mask"):
            hf(ids, attention_mask=mask[:, :5])


def left_padded(prompts, pad_id=0):
    """ids [B, max_len] and attention_mask of ``prompts`` (lists of ids), padded on the left."""
    n = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (n - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (n - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


@pytest.mark.parametrize("scheme", SCHEME_NAMES)
def test_left_padded_batch_equals_one_by_one(scheme):
    """Prompts of 9, 5 and 1 tokens, left-padded into one batch: each row's logits at its real
    tokens equal the prompt's alone (1e-5), and batched greedy ``generate`` (HF, with the cache;
    keel's own, with and without the cache) equals generating each prompt alone, token for token."""
    _, hf = native_and_hf(tiny_cfg(scheme), seed=5)
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(1, 97, (n,), generator=g).tolist() for n in (9, 5, 1)]
    ids, mask = left_padded(prompts)
    with torch.no_grad():
        batch_logits = hf(ids, attention_mask=mask).logits
        batched = hf.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
        native = hf.model.generate(ids, 10, temperature=0, attention_mask=mask)
        native_nc = hf.model.generate(ids, 10, temperature=0, attention_mask=mask, use_cache=False)
        for row, p in enumerate(prompts):
            alone = torch.tensor([p])
            torch.testing.assert_close(batch_logits[row, -len(p):], hf(alone).logits[0], atol=1e-5, rtol=0)
            single = hf.generate(alone, max_new_tokens=10, do_sample=False, pad_token_id=0)[0, len(p):]
            assert batched[row, ids.shape[1]:].tolist() == single.tolist(), row
            assert native[row, ids.shape[1]:].tolist() == single.tolist(), row
            assert native_nc[row, ids.shape[1]:].tolist() == single.tolist(), row

@pytest.mark.parametrize("impl", ["static", "offloaded_static"])
@pytest.mark.parametrize("looped", [False, True], ids=["plain", "looped"])
def test_generate_with_a_static_cache_is_refused_naming_cache_implementation(looped, impl):
    """``generate(cache_implementation="static")`` (a preallocated StaticCache, which transformers pairs with a 4-D
    mask): one KeelError naming cache_implementation, the cache class and the default dynamic cache. It said
    'keel models take a 2-D attention_mask ... got shape (1, 1, 6, 7)'. A StaticCache given to forward: the same.
    The default and the "offloaded" dynamic caches still generate what no cache generates, looped models too."""
    from transformers import StaticCache

    loop = dict(n_layers=3, loop_prelude=1, loop_core=1, loop_repeats=2) if looped else {}
    _, hf = native_and_hf(tiny_cfg("keel", **loop), seed=3)
    prompt = torch.randint(1, 97, (1, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        with pytest.raises(KeelError, match=r"preallocated StaticCache.*cache_implementation.*default dynamic cache") as e:
            hf.generate(prompt, max_new_tokens=2, do_sample=False, pad_token_id=0, cache_implementation=impl)
        assert "\n" not in str(e.value) and "attention_mask" not in str(e.value)
        with pytest.raises(KeelError, match="StaticCache"):
            hf(prompt, cache=StaticCache(config=hf.config, max_cache_len=16), use_cache=True)
        plain = hf.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=0, use_cache=False)
        assert hf.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=0).tolist() == plain.tolist()
        if torch.cuda.is_available():  # the offloaded dynamic cache asserts a CUDA device
            got = hf.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=0, cache_implementation="offloaded")
            assert got.tolist() == plain.tolist()


def right_padded(prompts, pad_id=0):
    """ids [B, max_len] and attention_mask of ``prompts`` (lists of ids), padded on the right."""
    n = max(map(len, prompts))
    ids = torch.tensor([p + [pad_id] * (n - len(p)) for p in prompts])
    mask = torch.tensor([[1] * len(p) + [0] * (n - len(p)) for p in prompts])
    return ids, mask


@pytest.mark.parametrize("scheme", SCHEME_NAMES)
def test_right_padded_forward_equals_each_row_alone(scheme):
    """A plain forward (no cache, as lm-eval's scoring runs) of prompts of 9, 5 and 1 tokens padded on the right:
    each row's logits at its real tokens equal the prompt's alone (1e-5)."""
    _, hf = native_and_hf(tiny_cfg(scheme), seed=5)
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(1, 97, (n,), generator=g).tolist() for n in (9, 5, 1)]
    ids, mask = right_padded(prompts, pad_id=7)
    with torch.no_grad():
        batch_logits = hf(ids, attention_mask=mask).logits
        for row, p in enumerate(prompts):
            alone = hf(torch.tensor([p])).logits[0]
            torch.testing.assert_close(batch_logits[row, :len(p)], alone, atol=1e-5, rtol=0)


@pytest.mark.parametrize("scheme", ["keel", "mhc"])
def test_generate_from_a_right_padded_batch_says_to_pad_on_the_left(scheme):
    """HF ``generate`` (with or without the cache) and keel's own ``generate`` from a right-padded batch (row 1's
    mask 1 1 1 1 0 0): one KeelError saying the batch is right-padded and to pad on the left, before any token is
    drawn. It said 'keel models derive positions from the cache length and the attention mask; position_ids must
    equal them ...' at the second step. A forward with the cache whose mask has new tokens after padding: the same."""
    _, hf = native_and_hf(tiny_cfg(scheme), seed=5)
    ids = torch.randint(1, 97, (2, 6), generator=torch.Generator().manual_seed(6))
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, 4:] = 0
    message = r"right-padded.*row 1.*padding_side='left'"
    with torch.no_grad():
        for use_cache in (True, False):
            with pytest.raises(KeelError, match=message) as e:
                hf.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0,
                            use_cache=use_cache)
            assert "\n" not in str(e.value)
        with pytest.raises(KeelError, match=message):
            hf.model.generate(ids, 3, temperature=0, attention_mask=mask)
        out = hf(ids, attention_mask=mask, use_cache=True)
        step = torch.ones(2, 7, dtype=torch.long)
        step[1, 4:6] = 0
        with pytest.raises(KeelError, match=message):
            hf(ids[:, -1:], attention_mask=step, cache=out.cache, position_ids=torch.tensor([[6], [1]]))


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


def test_ablate_hf_on_a_keel_export_is_the_runs_ablation(trained_run, tmp_path, capsys):
    """`keel ablate --hf` on a keel export (not Llama) asked for trust_remote_code and crashed on
    its prompt (found by a new-user trial). It now ablates the wrapped native model by sub-layer:
    the same ΔPPL as `keel ablate --run` on the run's validation text, decoded and re-tokenized."""
    from keel.cli import main
    from keel.diagnostics.ablate import ablate_model, text_windows
    from keel.run import Run

    out = tmp_path / "hf"
    assert main(["export-hf", "--run", str(trained_run), "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["ablate", "--hf", str(out), "--run", str(trained_run), "--tokens", "256", "--seq-len", "32",
                 "--out", str(tmp_path / "abl"), "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    run = Run(trained_run)
    sub = 2 * run.config.model.n_layers
    assert res["unit"] == "sub-layer" and len(res["units"]) == sub == res["sublayers"]
    from keel.diagnostics.ablate import ablation_text
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(out)
    w = text_windows(tok(ablation_text(None, str(trained_run), 256), add_special_tokens=False)["input_ids"], 32, 256)
    want = ablate_model(run.load_model(device="cpu"), w, batch_size=16)
    assert [u["delta_ppl"] for u in res["units"]] == pytest.approx([u["delta_ppl"] for u in want["units"]], rel=1e-4)


def test_export_auto_load_offline_generate_import(trained_run, tmp_path, monkeypatch, capsys):
    import huggingface_hub.constants as hub_constants

    from keel.run import Run
    from keel.train.checkpoint import CheckpointManager

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    out = tmp_path / "hf"
    assert main(["export-hf", "--run", str(trained_run), "--out", str(out)]) == 0
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "keel_config.toml"):
        assert (out / f).is_file(), f
    assert json.loads((out / "config.json").read_text())["model_type"] == "keel"

    native, tok = Run(trained_run).load_model(), Run(trained_run).tokenizer()
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(model) is KeelForCausalLM  # keel.hf is imported: keel's own code, no trust_remote_code
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
    a = load_file(CheckpointManager(trained_run).latest() / "model.safetensors")
    b = load_file(CheckpointManager(back).latest() / "model.safetensors")
    # the step of the export is kept (resumable; the LR is a function of it: no schedule state)
    from keel.train.checkpoint import CheckpointManager

    assert CheckpointManager(back).latest().name == CheckpointManager(trained_run).latest().name == "step_00000004"
    state = CheckpointManager.load_trainer_state(CheckpointManager(back).latest())
    assert state["step"] == 4 and "scheduler" not in state
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


@pytest.mark.parametrize("residual", ["keel", "pre_ln"])  # a KeelConfig and a stock LlamaConfig
def test_imported_run_keeps_step_and_tokens(trained_run, pre_ln_run, residual, tmp_path, keel_main):
    """An imported run had step 4 but 0 tokens: `keel runs` showed it as `new` with `-` for step
    and tokens, and a resume counted its tokens from 0 (step 5 logged 128 tokens, not 640)."""
    from keel.train.metrics import read_metrics

    run = trained_run if residual == "keel" else pre_ln_run
    step, tokens = (read_metrics(run / "metrics.jsonl")[-1][k] for k in ("step", "tokens"))
    assert step > 0 and tokens == step * 4 * 32  # tiny_overrides: batch 4 x 32 tokens
    assert keel_main("export-hf", "--run", run, "--out", tmp_path / "hf").returncode == 0
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["keel_step"], config["keel_tokens"]) == (step, tokens)
    assert keel_main("import-hf", "--hf", tmp_path / "hf", "--out", tmp_path / "runs" / "back").returncode == 0
    r = keel_main("runs", tmp_path / "runs", "--json")
    (row,) = json.loads(r.stdout)
    assert (row["step"], row["tokens"], row["status"]) == (step, tokens, "finished")
    r = keel_main("train", "--resume", tmp_path / "runs" / "back", "--set", f"train.steps={step + 1}")
    assert r.returncode == 0, r.stderr
    last = read_metrics(tmp_path / "runs" / "back" / "metrics.jsonl")[-1]
    assert (last["step"], last["tokens"]) == (step + 1, tokens + 4 * 32)
    # `keel import-hf --help` said the checkpoint "is step 0" whatever the export's step
    description = " ".join(keel_main("import-hf", "--help").stdout.split())
    assert "checkpoint is step 0" not in description
    assert "its checkpoint is the step and tokens the export was made at, 0 for a stock Llama" in description


def docs_snippet(marker: str) -> str:
    """The one ```python block of docs/hf.md (the Hugging Face page) that contains ``marker``."""
    blocks = (REPO / "docs" / "hf.md").read_text(encoding="utf-8").split("```python\n")[1:]
    (code,) = [b.split("```")[0] for b in blocks if marker in b.split("```")[0]]
    return code


def test_docs_batched_generation_pads_on_the_left(trained_run, tmp_path, monkeypatch, capsys):
    """docs/hf.md's batched-generation snippet, run on an export in hf/keel: its tokenizer pads on
    the left (transformers' default is the right, which a decoder-only model continues from the
    padding), and each row generates what its prompt generates alone."""
    from keel.hf.convert import export_hf

    export_hf(trained_run, tmp_path / "hf" / "keel")
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(docs_snippet('padding_side="left"'), scope)
    tok, model, batch, out = scope["tok"], scope["model"], scope["batch"], scope["out"]
    assert tok.padding_side == "left" and batch["attention_mask"][1, 0] == 1 and batch["attention_mask"][0, 0] == 0
    width = batch["input_ids"].shape[1]
    printed = capsys.readouterr().out
    for row, prompt in enumerate(["def parse(", "import os\nimport sys\n"]):
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            alone = model.generate(ids, max_new_tokens=40, do_sample=False)[0, ids.shape[1]:]
        assert out[row, width:width + len(alone)].tolist() == alone.tolist(), row
        assert tok.decode(alone, skip_special_tokens=True) in printed


@pytest.mark.spawns
def test_tokenizer_loads_without_keel(trained_run, tmp_path):
    """AutoTokenizer needs no keel (import blocked) and no trust_remote_code. (On a terminal,
    transformers first asks whether to run the folder's config code: either answer works.)"""
    from keel.hf.convert import export_hf

    out = export_hf(trained_run, tmp_path / "hf")
    code = BLOCK_KEEL + ("from transformers import AutoTokenizer; t = AutoTokenizer.from_pretrained(sys.argv[1]); "
                         "print('RESULT', t('import os').input_ids, t.eos_token)")
    r = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True, env=_offline_env(),
                       timeout=HANG_S, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr
    from tokenizers import Tokenizer

    expected = Tokenizer.from_file(str(trained_run / "tokenizer.json")).encode("import os").ids
    assert r.stdout.split("RESULT ")[-1].strip() == f"{expected} <|endoftext|>"


# ---------------------------------------------------------------- exports that load without keel
BLOCK_KEEL = '''
import importlib.abc, sys
class BlockKeel(importlib.abc.MetaPathFinder):
    """Any import of keel fails, as in a Python where keel is not installed."""
    def find_spec(self, name, path=None, target=None):
        if name == "keel" or name.startswith("keel."):
            raise ImportError("keel is blocked in this test: " + name)
sys.meta_path.insert(0, BlockKeel())
'''

REMOTE_CHECK = BLOCK_KEEL + '''
import json, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
folder, ref_path = sys.argv[1], sys.argv[2]
try:
    import keel  # noqa: F401
    raise SystemExit("keel was importable")
except ImportError:
    pass
try:
    AutoModelForCausalLM.from_pretrained(folder)
    raise SystemExit("loaded without trust_remote_code")
except ValueError as e:
    assert "trust_remote_code" in str(e), e
model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
tok = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
ref = torch.load(ref_path)
ids = torch.tensor([tok(ref["text"]).input_ids])
seen = []
model.model.register_forward_pre_hook(lambda m, a, k: seen.append((a[0].shape[1], k.get("cache") is not None)),
                                      with_kwargs=True)
with torch.no_grad():
    logits = model(ids).logits
    gen = model.generate(ids, max_new_tokens=8, do_sample=False, use_cache=True)
print("RESULT " + json.dumps({"class": type(model).__module__ + "." + type(model).__name__,
                  "max_diff": float((logits - ref["logits"]).abs().max()), "ids": ids[0].tolist(),
                  "gen": gen[0].tolist(), "calls": seen[1:], "keel_modules": [m for m in sys.modules if
                  m == "keel" or m.startswith("keel.")]}))
'''


def _offline_env():
    return dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONPATH="")


def test_generated_code_has_no_keel_import_and_rejects_lazy_ones():
    import ast

    from keel.hf import remote

    files = remote.generate_remote_code()
    assert set(files) == {"configuration_keel.py", "modeling_keel.py"}
    for name, code in files.items():
        for node in ast.walk(ast.parse(code)):
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                assert not node.module.startswith("keel"), (name, node.module)
            if isinstance(node, ast.Import):
                assert not any(a.name.startswith("keel") for a in node.names), name
    # the architecture is keel's own source, not a copy kept by hand
    import inspect

    import keel.model.model as mm
    assert inspect.getsource(mm.Transformer) in files["modeling_keel.py"]
    assert inspect.getsource(ModelConfig) in files["configuration_keel.py"]
    # a lazy keel import inside the model code would make the export unusable: refused at export
    with pytest.raises(KeelError, match="still imports keel"):
        remote._join([("keel/x.py", "import torch\n\ndef f():\n    from keel.data import read_meta\n")], "t")
    _, body = remote._strip('"""doc"""\nfrom __future__ import annotations\nfrom keel.model import RMSNorm as N\n'
                            'x = 1\n', "keel/y.py")
    assert body == "x = 1\n\nN = RMSNorm"


@pytest.mark.spawns
def test_export_loads_with_keel_import_blocked(trained_run, tmp_path):
    """trust_remote_code in a Python where `import keel` fails: same logits (1e-5), KV-cache
    generation equal to the native greedy decoding, the tokenizer."""
    from keel.hf.convert import export_hf
    from keel.run import Run

    out = export_hf(trained_run, tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    h = config["auto_map"]["AutoConfig"].split(".")[0].rsplit("_", 1)[1]
    assert len(h) == 12 and config["auto_map"] == {"AutoConfig": f"configuration_keel_{h}.KeelConfig",
                                                   "AutoModelForCausalLM": f"modeling_keel_{h}.KeelForCausalLM"}
    native, tok = Run(trained_run).load_model(), Run(trained_run).tokenizer()
    text = "def parse(self, text):\n    return text.split()\n"
    ids = torch.tensor([tok.encode(text).ids])
    with torch.no_grad():
        torch.save({"text": text, "logits": native(ids)}, tmp_path / "ref.pt")
        expected = native.generate(ids, 8, temperature=0, use_cache=False)[0].tolist()
    r = subprocess.run([sys.executable, "-c", REMOTE_CHECK, str(out), str(tmp_path / "ref.pt")], capture_output=True,
                       text=True, env=_offline_env(), timeout=HANG_S, cwd=tmp_path, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.split("RESULT ")[-1])
    assert res["class"].startswith("transformers_modules.") and res["class"].endswith(f"modeling_keel_{h}.KeelForCausalLM")
    assert res["keel_modules"] == []
    assert res["ids"] == ids[0].tolist()
    assert res["max_diff"] <= 1e-5
    assert res["gen"] == expected
    # generate used the cache: the prompt once, then one new token per forward
    assert res["calls"] == [[ids.shape[1], True]] + [[1, True]] * 7


@pytest.fixture(scope="module")
def pre_ln_run(tiny_data, tmp_path_factory):
    from keel.train import train

    run = tmp_path_factory.mktemp("prerun") / "run"
    sets = tiny_overrides(tiny_data, steps=2, eval_every=2, checkpoint_every=2) + ["model.residual=pre_ln"]
    train(load_config(REPO / "keel" / "configs" / "demo.toml", sets), run)
    return run


def test_pre_ln_exports_as_stock_llama(pre_ln_run, tmp_path):
    from transformers import LlamaForCausalLM

    from keel.hf.convert import export_hf
    from keel.run import Run

    out = export_hf(pre_ln_run, tmp_path / "llama")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert "auto_map" not in config and not list(out.glob("*.py"))
    assert config["keel_step"] == 2  # import-hf restores the step
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(model) is LlamaForCausalLM
    native = Run(pre_ln_run).load_model()
    ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, native(ids), atol=1e-5, rtol=0)
        gen = model.generate(ids[:1, :9], max_new_tokens=6, do_sample=False)
    assert torch.equal(gen, native.generate(ids[:1, :9], 6, temperature=0))


def _stock_llama(folder, tokenizer_file, **config):
    """A random Llama written by transformers, with the tokenizer of tokenizer_file."""
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    kw = dict(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False,
              eos_token_id=0, bos_token_id=None, pad_token_id=None)
    kw.update(config)
    torch.manual_seed(7)
    model = LlamaForCausalLM(LlamaConfig(**kw)).eval()
    with torch.no_grad():  # non-trivial norm gains
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(folder)
    PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_file), eos_token="<|endoftext|>").save_pretrained(folder)
    return model


def _looped_export(folder, tokenizer_file, loops):
    """A random looped keel model (P, C, R, Q = 1, 1, 3, 1) saved as keel export-hf writes one, its
    config.json's ``loops`` set, with the tokenizer of tokenizer_file."""
    from transformers import PreTrainedTokenizerFast

    torch.manual_seed(7)
    cfg = tiny_cfg("keel", vocab_size=512, n_layers=3, loop_prelude=1, loop_core=1, loop_repeats=3)
    native = Transformer(cfg).eval()
    KeelForCausalLM.from_native(native, loops=loops).save_pretrained(folder)
    PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_file), eos_token="<|endoftext|>").save_pretrained(folder)
    native.set_loops(3)
    return native


def test_import_of_a_looped_export_says_its_loops_are_not_imported(tiny_data, tmp_path, capsys):
    """config.json's loops (the count the Hugging Face model runs at) is no run key: the imported run
    loops at the trained model.loop_repeats, as before, but a warning line now says so (it was dropped
    silently, and the run computed another function than the folder)."""
    from keel.run import Run

    folder, run = tmp_path / "hf", tmp_path / "run"
    native = _looped_export(folder, tiny_data / "tokenizer.json", loops=6)
    capsys.readouterr()
    assert main(["import-hf", "--hf", str(folder), "--out", str(run), "--set", "train.seq_len=32"]) == 0
    err = capsys.readouterr().err
    assert err == (f"config.json's loops = 6 in {folder} was not imported: the run loops at the trained "
                   "model.loop_repeats = 3 (give --loops 6 to keel eval, generate, ablate or gradflow to run it at "
                   "the folder's count)\n")
    imported = Run(run).load_model()
    assert imported.cfg.loop_repeats == imported.loops == 3
    ids = torch.randint(0, 512, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for r in (3, 6):
            torch.testing.assert_close(imported(ids, loops=r), native(ids, loops=r), atol=1e-5, rtol=0)
    _looped_export(tmp_path / "hf3", tiny_data / "tokenizer.json", loops=3)  # loops = loop_repeats: nothing lost
    assert main(["import-hf", "--hf", str(tmp_path / "hf3"), "--out", str(tmp_path / "run3"), "--set",
                 "train.seq_len=32"]) == 0
    assert "loops" not in capsys.readouterr().err


def test_import_of_a_looped_export_above_the_loops_cap_hints_no_refused_count(tiny_data, tmp_path, capsys):
    """config.json's loops = 1000 (above --loops' cap, 64 at R = 3) is not imported, and the warning no longer
    tells the user to give --loops 1000, which every command it names refuses."""
    folder, run = tmp_path / "hf", tmp_path / "run"
    _looped_export(folder, tiny_data / "tokenizer.json", loops=1000)
    capsys.readouterr()
    assert main(["import-hf", "--hf", str(folder), "--out", str(run), "--set", "train.seq_len=32"]) == 0
    assert capsys.readouterr().err == (
        f"config.json's loops = 1000 in {folder} was not imported: the run loops at the trained model.loop_repeats = 3 "
        "(1000 is above 64, the cap of --loops (max(64, 16 x model.loop_repeats (3) = 48)): give keel eval, generate, "
        "ablate or gradflow --loops R with R <= 64)\n")
    assert main(["eval", "--run", str(run), "--loops", "1000", "--max-tokens", "32"]) == 2  # the hint it gave before


@pytest.mark.parametrize("bad", [0, -2, 2.5, "3", True])
def test_a_bad_config_json_loops_is_refused_naming_config_json(tiny_data, tmp_path, capsys, bad):
    """A config.json loops that is no count >= 1 was refused as "the loop count must be an integer >= 1, got 0",
    naming neither the file nor the key (`keel eval --hf F --loops 4` said it of a count the user never gave)."""
    folder, text = tmp_path / "hf", tmp_path / "text.txt"
    _looped_export(folder, tiny_data / "tokenizer.json", loops=None)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "loops": bad}))
    text.write_text("def main(argv):\n    return 0\n" * 20)
    line = (f"config.loops = {bad!r} (config.json's loops in {folder}, from_pretrained(..., loops=R) or "
            f"model.config.loops): the loop count must be an integer >= 1, got {bad!r}")
    for command in (["eval", "--hf", str(folder), "--text", str(text), "--loops", "4"],
                    ["import-hf", "--hf", str(folder), "--out", str(tmp_path / "run")]):
        capsys.readouterr()
        assert main(command) == 2
        assert capsys.readouterr().err == f"keel: error: {line}\n"
    assert not (tmp_path / "run").exists()
    with pytest.raises(KeelError) as e:
        AutoModelForCausalLM.from_pretrained(folder)
    assert str(e.value) == line


def test_eval_and_ablate_hf_cap_config_json_loops_as_loops(tiny_data, tmp_path, capsys):
    """config.json's loops = 1000 ran `keel eval --hf` (and `keel ablate --hf`) with the core applied 1000 times
    a token, where `--loops 1000` is refused: now refused the same way, in one line naming config.json's loops
    and the cap; --loops (checked on its own) overrides it."""
    folder, text = tmp_path / "hf", tmp_path / "text.txt"
    _looped_export(folder, tiny_data / "tokenizer.json", loops=1000)
    text.write_text("def main(argv):\n    return 0\n" * 20)
    cap = (f"keel: error: config.json's loops = 1000 in {folder} is above 64, the cap of --loops (max(64, 16 x "
           "model.loop_repeats (3) = 48)): each token would apply the core 1000 times; give --loops R (R <= 64) to run "
           "another count\n")
    for command in (["eval", "--hf", str(folder), "--text", str(text)],
                    ["ablate", "--hf", str(folder), "--text", str(text), "--out", str(tmp_path / "ablate")]):
        capsys.readouterr()
        assert main(command) == 2
        assert capsys.readouterr().err == cap
    assert main(["eval", "--hf", str(folder), "--text", str(text), "--loops", "6", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["loop"]["repeats"] == 6


def test_import_refuses_a_tokenizer_larger_than_the_vocabulary_and_steps_below_the_export(tiny_data, tmp_path,
                                                                                          capsys):
    """A Llama of vocab_size 300 with a 512-id tokenizer was imported; `keel generate` then died of an
    IndexError traceback. `--set train.steps=10` on an export of step 30 was accepted, and every resume
    refused it."""
    llama_dir = tmp_path / "llama"
    _stock_llama(llama_dir, tiny_data / "tokenizer.json", vocab_size=300)
    capsys.readouterr()
    assert main(["import-hf", "--hf", str(llama_dir), "--out", str(tmp_path / "a")]) == 2
    assert capsys.readouterr().err == (f"keel: error: {llama_dir}: its tokenizer has 512 ids but config.json's "
                                       "vocab_size is 300: ids from 300 on have no embedding row\n")
    assert not (tmp_path / "a").exists()
    llama_dir = tmp_path / "llama30"  # as an export of step 30 says
    _stock_llama(llama_dir, tiny_data / "tokenizer.json")
    config = json.loads((llama_dir / "config.json").read_text())
    (llama_dir / "config.json").write_text(json.dumps({**config, "keel_step": 30}))
    capsys.readouterr()
    assert main(["import-hf", "--hf", str(llama_dir), "--out", str(tmp_path / "b"), "--set", "train.steps=10"]) == 2
    assert capsys.readouterr().err == (f"keel: error: train.steps=10 is below the step {llama_dir} was exported at "
                                       "(30); give train.steps >= 30\n")
    assert not (tmp_path / "b").exists()
    assert main(["import-hf", "--hf", str(llama_dir), "--out", str(tmp_path / "b"), "--set", "train.steps=30"]) == 0


@pytest.mark.parametrize("sets, words", [
    (["train.activation_checkpoint_min_loops=4"], "needs a looped model (model.loop_core > 0)"),
    (["train.activation_checkpointing=every_k", "train.activation_checkpoint_k=0"], "activation_checkpoint_k"),
])
def test_import_hf_refuses_train_keys_that_train_refuses(tiny_data, tmp_path, capsys, sets, words):
    """A fresh-user trial: import-hf --set wrote a run whose config `keel train --resume` then refused (min_loops
    on a model that does not loop); it now makes the trainer's checks before anything is written."""
    llama_dir = tmp_path / "llama"
    _stock_llama(llama_dir, tiny_data / "tokenizer.json")
    capsys.readouterr()
    assert main(["import-hf", "--hf", str(llama_dir), "--out", str(tmp_path / "b")]
                + [a for x in sets + ["train.activation_checkpointing=block"] * (len(sets) == 1) for a in ("--set", x)]
                ) == 2
    last = capsys.readouterr().err.splitlines()[-1]  # after import-hf's info line on train.seq_len
    assert last.startswith("keel: error: ") and words in last
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("command", ["import-hf", "eval"])
def test_a_folder_without_tokenizer_json_is_one_line(tiny_data, tmp_path, capsys, command):
    """A Llama folder whose tokenizer.json was left out: import-hf and eval --hf printed transformers'
    five-line 'Couldn't instantiate the backend tokenizer ... sentencepiece or tiktoken' message."""
    llama_dir = tmp_path / "llama"
    _stock_llama(llama_dir, tiny_data / "tokenizer.json")
    (llama_dir / "tokenizer.json").unlink()
    argv = {"import-hf": ["import-hf", "--hf", str(llama_dir), "--out", str(tmp_path / "run")],
            "eval": ["eval", "--hf", str(llama_dir), "--text", str(llama_dir / "config.json")]}[command]
    capsys.readouterr()
    assert main(argv) == 2
    assert capsys.readouterr().err == (f"keel: error: cannot load the tokenizer of {llama_dir}: no tokenizer.json "
                                       "there (keel needs a fast tokenizer): copy it there, or export the run again\n")
    assert not (tmp_path / "run").exists()


def test_import_refuses_a_data_path_the_run_could_not_train_on(tiny_data, tmp_path, capsys):
    """`keel import-hf --set data.path=/nonexistent` was accepted; every later resume or eval of the run failed.
    A dataset of a tokenizer with more ids than the model's rows is refused too; a good one is taken."""
    llama_dir = tmp_path / "llama"
    _stock_llama(llama_dir, tiny_data / "tokenizer.json")
    capsys.readouterr()
    missing = tmp_path / "nonexistent"
    assert main(["import-hf", "--hf", str(llama_dir), "--out", str(tmp_path / "a"), "--set", f"data.path={missing}"]) == 2
    assert capsys.readouterr().err == (f"keel: error: --set data.path: not a prepared dataset: {missing} (run `keel "
                                       "prepare` first)\n")
    assert not (tmp_path / "a").exists()
    assert main(["import-hf", "--hf", str(llama_dir), "--out", str(tmp_path / "b"), "--set", f"data.path={tiny_data}",
                 "--set", "train.seq_len=32"]) == 0
    assert f'path = "{tiny_data}"' in (tmp_path / "b" / "config.toml").read_text()
    from keel.data import prepare_dataset

    big = prepare_dataset("builtin:python-stdlib", "bpe:1024", cache_dir=tmp_path / "data", max_bytes=120_000,
                          progress=False)
    capsys.readouterr()
    assert main(["import-hf", "--hf", str(llama_dir), "--out", str(tmp_path / "c"), "--set", f"data.path={big}"]) == 2
    assert capsys.readouterr().err == (f"keel: error: --set data.path: {big}'s tokenizer has 1024 ids, more than the "
                                       "model's 512 embedding rows; give a dataset prepared with the folder's "
                                       "tokenizer\n")
    assert not (tmp_path / "c").exists()


def test_resuming_an_import_on_a_data_path_says_to_give_it_at_import(tiny_data, tmp_path, capsys):
    """`keel train --resume IMPORTED --set data.path=D` was refused naming data.max_bytes and
    data.tokenizer, keys the user never set, with no word on what to do."""
    llama_dir, run = tmp_path / "llama", tmp_path / "run"
    _stock_llama(llama_dir, tiny_data / "tokenizer.json")
    assert main(["import-hf", "--hf", str(llama_dir), "--out", str(run), "--set", "train.seq_len=32"]) == 0
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--set", f"data.path={tiny_data}", "--set", "train.steps=5"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"keel: error: cannot resume {run} with data.") and len(err.splitlines()) == 1
    assert err.endswith(f"would make it another run (data.path {tiny_data} was prepared otherwise than the data this "
                        "run was made with; a run imported with keel import-hf takes its data.path there: --set "
                        "data.path=...); start a new run instead\n")


def test_import_stock_llama_then_resume_training_and_generate(tiny_data, tmp_path, capsys):
    from tokenizers import Tokenizer

    from keel.run import Run
    from keel.train.metrics import read_metrics

    llama_dir, run = tmp_path / "llama", tmp_path / "run"
    llama = _stock_llama(llama_dir, tiny_data / "tokenizer.json")
    sets = [s for s in tiny_overrides(tiny_data, steps=3, eval_every=3, checkpoint_every=3)
            if not s.startswith("model.")]
    assert main(["import-hf", "--hf", str(llama_dir), "--out", str(run), "--set", "model.d_model=8"]) == 2
    assert "--set only data.* and train.* keys" in capsys.readouterr().err
    assert main(["import-hf", "--hf", str(llama_dir), "--out", str(run)] + [a for s in sets for a in ("--set", s)]) == 0
    assert capsys.readouterr().out == (f"imported {llama_dir} -> run {run} (continue training with `keel train --resume "
                                       f"{run}`: a fresh optimiser, and the data from its first batch, as an HF folder "
                                       "keeps no data position)\n")
    cfg = load_config(run / "config.toml")
    assert cfg.model.residual == "pre_ln" and (cfg.model.d_model, cfg.model.n_layers) == (32, 2)
    native = Run(run).load_model()
    ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        torch.testing.assert_close(native(ids), llama(ids).logits, atol=1e-5, rtol=0)
    tok = Tokenizer.from_file(str(tiny_data / "tokenizer.json"))
    prompt = "def main(argv):\n    "
    p_ids = tok.encode(prompt).ids
    assert main(["generate", "--run", str(run), "--prompt", prompt, "--max-new-tokens", "6",
                 "--temperature", "0"]) == 0
    with torch.no_grad():
        expected = llama.generate(torch.tensor([p_ids]), max_new_tokens=6, do_sample=False)[0].tolist()
    assert capsys.readouterr().out.strip() == tok.decode(expected).strip()
    # keel train --resume continues the imported run from its step-0 checkpoint
    assert main(["train", "--resume", str(run)]) == 0
    recs = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in recs] == [1, 2, 3] and all(math.isfinite(r["loss"]) for r in recs)
    assert Run(run).latest_checkpoint().name == "step_00000003"
    # step 1's loss is the imported Llama's loss on the run's first batch
    from keel.data import TokenLoader

    cfg = load_config(run / "config.toml")
    batch = TokenLoader(tiny_data, "train", batch_size=4, seq_len=32, seed=cfg.train.seed).next_batch()
    with torch.no_grad():
        assert recs[0]["loss"] == pytest.approx(float(llama(batch, labels=batch).loss), abs=1e-5)


@pytest.mark.parametrize("change,message", [
    (dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}), "rope_scaling"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(mlp_bias=True), "mlp_bias"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(head_dim=8), "head_dim"),
], ids=["rope_scaling", "attention_bias", "mlp_bias", "hidden_act", "head_dim"])
def test_import_refuses_llama_features_keel_lacks(tiny_data, tmp_path, capsys, change, message):
    _stock_llama(tmp_path / "llama", tiny_data / "tokenizer.json", **change)
    capsys.readouterr()
    assert main(["import-hf", "--hf", str(tmp_path / "llama"), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("keel: error: unsupported Llama feature: " + message) and "\n" not in err
    assert not (tmp_path / "run").exists()


def test_import_refuses_tied_untied_mismatch(tiny_data, tmp_path, capsys):
    from safetensors.torch import save_file

    folder = tmp_path / "llama"
    _stock_llama(folder, tiny_data / "tokenizer.json", tie_word_embeddings=True)  # stores no lm_head
    config = json.loads((folder / "config.json").read_text())
    config["tie_word_embeddings"] = False
    (folder / "config.json").write_text(json.dumps(config))
    assert main(["import-hf", "--hf", str(folder), "--out", str(tmp_path / "run")]) == 2
    assert "untied model (tie_word_embeddings false) needs 'lm_head.weight'" in capsys.readouterr().err
    weights = load_file(folder / "model.safetensors")
    weights["lm_head.weight"] = torch.randn_like(weights["model.embed_tokens.weight"])
    save_file(weights, str(folder / "model.safetensors"))
    config["tie_word_embeddings"] = True
    (folder / "config.json").write_text(json.dumps(config))
    assert main(["import-hf", "--hf", str(folder), "--out", str(tmp_path / "run")]) == 2
    assert "lm_head different from the embedding" in capsys.readouterr().err


@pytest.mark.parametrize("scheme", SCHEME_NAMES)
def test_generated_code_equals_native_for_every_scheme(scheme, tmp_path):
    """The generated files (loaded by transformers as remote code) compute keel's function for
    every residual scheme, tied and untied."""
    from keel.hf.remote import write_remote_code

    native, hf = native_and_hf(tiny_cfg(scheme, tie=scheme == "keel"))
    hf.save_pretrained(tmp_path)
    auto_map = write_remote_code(tmp_path)
    # trust_remote_code's own loader: here keel.hf is imported, and transformers prefers classes
    # registered explicitly (keel's) over a folder's code, so Auto* would not use the files
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    cls = get_class_from_dynamic_module(auto_map["AutoModelForCausalLM"], str(tmp_path))
    assert cls.__module__.startswith("transformers_modules.") and cls is not KeelForCausalLM
    remote = cls.from_pretrained(tmp_path).eval()
    assert type(remote.config).__module__.startswith("transformers_modules.")
    ids = torch.randint(0, 97, (2, 13), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        torch.testing.assert_close(remote(ids).logits, native(ids), atol=1e-5, rtol=0)


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_llama_weight_map_covers_every_parameter(tie):
    """The one name table (keel.hf.llama.llama_weight_map) names every pre_ln parameter and
    every LlamaForCausalLM parameter exactly once (a renamed or fused keel weight fails here)."""
    from transformers import LlamaForCausalLM

    from keel.hf.llama import llama_config_from_keel, llama_weight_map

    cfg = tiny_cfg("pre_ln", tie)
    table = llama_weight_map(cfg.n_layers)
    keel_names = {k for k in Transformer(cfg).state_dict() if not k.startswith("rope_")}
    assert {k for k, _ in table} == keel_names
    llama_names = [p for _, parts in table for p in parts]
    assert sorted(llama_names) == sorted(LlamaForCausalLM(llama_config_from_keel(cfg)).state_dict())


def test_generated_code_left_padded_generate(tmp_path):
    """The exported modeling_keel.py (transformers' remote-code loader): batched left-padded greedy
    generate equals one-by-one generation, token for token."""
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    from keel.hf.remote import write_remote_code

    _, hf = native_and_hf(tiny_cfg("keel"), seed=5)
    hf.save_pretrained(tmp_path)
    auto_map = write_remote_code(tmp_path)
    remote = get_class_from_dynamic_module(auto_map["AutoModelForCausalLM"], str(tmp_path)).from_pretrained(tmp_path)
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(1, 97, (n,), generator=g).tolist() for n in (9, 5, 1)]
    ids, mask = left_padded(prompts)
    with torch.no_grad():
        batched = remote.eval().generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
        for row, p in enumerate(prompts):
            single = remote.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False, pad_token_id=0)
            assert batched[row, ids.shape[1]:].tolist() == single[0, len(p):].tolist(), row


@pytest.mark.parametrize("scheme", ["keel", "mhc"])
def test_generate_past_max_seq_len_crops_the_window_as_keel_generate(scheme, tmp_path):
    """The exported model (remote code) generating past max_seq_len (48): greedy tokens equal the
    native generate's, which re-runs the last 48 tokens each step once the context outgrows them;
    with a left-padded batch too. It raised KeelError at the 49th position."""
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    from keel.hf.remote import write_remote_code

    native, hf = native_and_hf(tiny_cfg(scheme), seed=3)
    hf.save_pretrained(tmp_path)
    remote = get_class_from_dynamic_module(write_remote_code(tmp_path)["AutoModelForCausalLM"],
                                           str(tmp_path)).from_pretrained(tmp_path).eval()
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(1, 97, (n,), generator=g).tolist() for n in (40, 33)]
    ids, mask = left_padded(prompts)
    with torch.no_grad():
        want = native.generate(ids, 20, temperature=0, attention_mask=mask)
        for use_cache in (True, False):
            got = remote.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=0,
                                  use_cache=use_cache)
            assert got.shape == (2, 60) and got.tolist() == want.tolist(), use_cache


def test_import_of_non_finite_weights_names_the_folder_not_a_training_step(tiny_data, tmp_path, capsys):
    """An HF folder whose weights hold a NaN (damaged data, or a diverged model) was refused as "refusing to
    checkpoint step 0: non-finite values in ...", which reads as a training failure."""
    from safetensors.torch import save_file

    folder = tmp_path / "llama"
    _stock_llama(folder, tiny_data / "tokenizer.json")
    weights = load_file(folder / "model.safetensors")
    weights["model.layers.0.mlp.down_proj.weight"][0, 0] = float("nan")
    save_file(weights, str(folder / "model.safetensors"))
    capsys.readouterr()
    assert main(["import-hf", "--hf", str(folder), "--out", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (f"keel: error: {folder}'s weights hold non-finite values "
                                                        "(damaged, or a diverged model): non-finite values in "
                                                        "blocks.0.ffn.w2.weight")
    assert not (tmp_path / "run").exists()
