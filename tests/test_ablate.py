"""keel ablate: ΔPPL_i = PPL(without sub-layer i) − PPL(full) (Keel paper, Appendix A)."""

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import keel
from keel.config import load_config
from keel.errors import KeelError
from keel.diagnostics.ablate import ablate_hf_model, ablate_model, layer_importance, removed_sublayer
from keel.train.nll import mean_nll
from keel.model import SCHEMES, Transformer


def _model(scheme, n_layers=2):
    cfg = load_config(None, [f"model.residual={scheme}", f"model.n_layers={n_layers}", "model.d_model=32",
                             "model.n_heads=2", "model.n_kv_heads=1", "model.d_ff=64", "model.vocab_size=97",
                             "model.max_seq_len=32", "model.init_std=0.2"]).model
    torch.manual_seed(0)
    return Transformer(cfg).eval()


def _windows(n=4, T=16, V=97):
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, V, (n, T + 1), generator=g)


def hand_forward(model, ids, skip):
    """Transcription of Transformer.forward with sub-layer ``skip`` left out (x_{i+1} = x_i,
    or the scheme's own ``removed``: AttnRes takes F = 0)."""
    T = ids.shape[1]
    cos, sin = model.rope_cos[:T], model.rope_sin[:T]
    x = model.tok_emb(ids)
    if model.stream is not None:
        x = model.stream.begin(x)
    for b, blk in enumerate(model.blocks):
        x = blk.attn_residual(x, lambda h: blk.attn(h, cos, sin)) if 2 * b != skip else blk.attn_residual.removed(x)
        x = blk.ffn_residual(x, blk.ffn) if 2 * b + 1 != skip else blk.ffn_residual.removed(x)
    if model.stream is not None:
        x = model.stream.end(x)
    if model.norm is not None:
        x = model.norm(x)
    return model.lm_head(x).float()


def ppl(logits, targets):
    return math.exp(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)).item())


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_delta_ppl_matches_hand_built_forward(scheme):
    model, w = _model(scheme), _windows()
    res = ablate_model(model, w, batch_size=4)
    with torch.no_grad():
        full = ppl(model(w[:, :-1]), w[:, 1:])
        assert res["ppl_full"] == pytest.approx(full, rel=1e-5)
        assert res["ppl_full"] == pytest.approx(math.exp(model(w[:, :-1], w[:, 1:]).item()), rel=1e-5)
        assert len(res["units"]) == 4 and res["sublayers"] == 4 and res["blocks"] == 2
        for u in res["units"]:
            want = ppl(hand_forward(model, w[:, :-1], u["index"]), w[:, 1:]) - full
            assert u["delta_ppl"] == pytest.approx(want, rel=1e-4, abs=1e-4 * full), (scheme, u)
            assert u["kind"] == ("attn" if u["index"] % 2 == 0 else "ffn") and u["block"] == u["index"] // 2
        # removal changes the model (the test could otherwise pass vacuously) ...
        assert max(abs(u["delta_ppl"]) for u in res["units"]) > 1e-3 * full
        # ... and is undone on exit: removing nothing is the full model, ΔPPL 0
        after = ppl(model(w[:, :-1]), w[:, 1:])
    assert after == full
    with removed_sublayer(model, None):
        assert mean_nll(model, w, 16, "cpu") == pytest.approx(math.log(full), rel=1e-6)


def _perturbed(model):
    """The schemes' own parameters off their init (several start where they change nothing)."""
    torch.manual_seed(2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "residual" in name or name.startswith("stream"):
                p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("kept", ["all", "every third"])
@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_resuming_from_the_kept_stream_gives_the_recomputed_numbers_bit_for_bit(scheme, kept):
    """The ablation pass that removes sub-layer i starts from the full pass's kept stream state before i
    (all states kept, or, in a budget that fits only some, every third); its numbers equal recomputing every
    sub-layer from the embedding (cache_bytes=0) exactly, for every scheme, and it runs fewer sub-layers."""
    model, w = _perturbed(_model(scheme, n_layers=4)), _windows(n=5)
    first = []  # the stream state after sub-layer 0, batch 0 (a tensor, or AttnRes's tuple)
    h = model.blocks[0].attn_residual.register_forward_hook(lambda m, a, out: first.append(out))
    with torch.no_grad():
        model(w[:2, :-1])
    h.remove()
    state = sum(t.nbytes for t in (first[0] if isinstance(first[0], tuple) else (first[0],))) * 3  # 3 batches
    cache_bytes = 8 * state if kept == "all" else 3 * state  # 8 sub-layers; a third of them
    calls = {"n": 0}

    def count(module, args, out):
        calls["n"] += 1

    handles = [blk.attn.register_forward_hook(count) for blk in model.blocks]
    plain = ablate_model(model, w, batch_size=2, cache_bytes=0)
    plain_calls, calls["n"] = calls["n"], 0
    fast = ablate_model(model, w, batch_size=2, cache_bytes=cache_bytes)
    for h in handles:
        h.remove()
    assert fast == plain
    assert plain_calls == 3 * 4 * (1 + 8) - 3 * 4  # 3 batches x 4 attention sub-layers x 9 passes, less the removed
    # with every state kept, the pass removing sub-layer 2b or 2b + 1 runs only the attention of blocks b + 1 .. 3
    # (3 - b of them; the full pass runs all 4), per batch
    assert calls["n"] < plain_calls
    if kept == "all":
        assert calls["n"] == 3 * (4 + (3 + 2 + 1 + 0) + (3 + 2 + 1 + 0))
    assert all("forward" not in vars(unit) for _, unit, _ in model.sublayers())  # every shadow undone


def test_a_looped_model_ablates_from_the_kept_stream_bit_for_bit():
    cfg = load_config(None, ["model.residual=keel", "model.n_layers=4", "model.loop_prelude=1", "model.loop_core=2",
                             "model.loop_repeats=3", "model.d_model=32", "model.n_heads=2", "model.n_kv_heads=1",
                             "model.d_ff=64", "model.vocab_size=97", "model.max_seq_len=32"]).model
    torch.manual_seed(0)
    model, w = _perturbed(Transformer(cfg).eval()), _windows(n=3)
    assert ablate_model(model, w, batch_size=2, cache_bytes=2**30) == ablate_model(model, w, batch_size=2, cache_bytes=0)


def test_keel_first_sublayer_removal_keeps_the_rest():
    """Keel's sub-layer 0 is plain Pre-LN (no outer norm): removing it feeds the embedding
    straight into sub-layer 1; the forward of every other unit is untouched."""
    model, w = _model("keel"), _windows()
    with torch.no_grad(), removed_sublayer(model, 0):
        x = model.tok_emb(w[:, :-1])
        assert model.blocks[0].attn_residual(x, lambda h: 1 / 0) is x  # F is never called
        inside = model(w[:, :-1])
    assert torch.equal(inside, hand_forward(model, w[:, :-1], 0))
    assert "forward" not in vars(model.blocks[0].attn_residual)
    with pytest.raises(KeelError, match="out of range"):
        with removed_sublayer(model, 4):
            pass


def test_ablate_cli_on_a_run(tiny_config, tmp_path, keel_cli, keel_main):
    from keel.data import validation_tokens
    from keel.train import train
    from keel.run import Run

    run = tmp_path / "run"
    train(tiny_config(steps=4, checkpoint_every=4, eval_every=4), run)
    r = keel_cli("ablate", "--run", run, "--tokens", 256, "--out", tmp_path / "abl", "--json", "--verbose")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)  # stdout: the JSON only; --verbose: one logged line per unit on stderr
    assert [ln.split(":")[0].strip() for ln in r.stderr.splitlines() if "PPL" in ln] == [f"unit {i}" for i in range(4)]
    assert res == json.loads((tmp_path / "abl" / "ablate.json").read_text())
    assert len(res["units"]) == 4 and res["tokens"] == 256
    assert (tmp_path / "abl" / "ablate.png").stat().st_size > 1000
    assert "| 3 | 1 | ffn |" in (tmp_path / "abl" / "ablate.md").read_text()
    model, _ = Run(run).load_model(), Run(run).tokenizer()
    cfg = load_config(run / "config.toml")
    w = validation_tokens(cfg.data.path, cfg.train.seq_len, 256)
    with torch.no_grad():
        full = ppl(model(w[:, :-1]), w[:, 1:])
        assert res["ppl_full"] == pytest.approx(full, rel=1e-5)
        want = ppl(hand_forward(model, w[:, :-1], 3), w[:, 1:]) - full
    assert res["units"][3]["delta_ppl"] == pytest.approx(want, rel=1e-4, abs=1e-6 * full)
    r = keel_main("ablate", "--run", tmp_path / "nowhere")
    assert r.returncode == 2 and "not a run directory" in r.stderr
    # --text with --run: the run's model on that text, in the run's tokenizer (it was ignored: the validation split)
    text = tmp_path / "t.txt"
    text.write_text(Path(keel.__file__).read_text() * 4)
    r = keel_main("ablate", "--run", run, "--text", text, "--tokens", 128, "--out", tmp_path / "t", "--json")
    assert r.returncode == 0, r.stderr
    ids = torch.tensor(Run(run).tokenizer().encode(text.read_text(), add_special_tokens=False).ids[:4 * 32 + 1])
    w = torch.stack([ids[i * 32:(i + 1) * 32 + 1] for i in range(4)])
    with torch.no_grad():
        assert json.loads(r.stdout)["ppl_full"] == pytest.approx(ppl(model(w[:, :-1]), w[:, 1:]), rel=1e-5) != full
    assert "note:" not in r.stderr
    # more tokens than the text gives: ablated on what it gives, and now said so (it was silent)
    r = keel_main("ablate", "--run", run, "--text", text, "--tokens", 10**8, "--out", tmp_path / "big", "--json")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)["tokens"]
    assert 32 <= got < 10**8 and got % 32 == 0
    assert f"note: --tokens 100,000,000: the text gives {got:,} tokens in whole windows of 32; ablated on those\n" \
        in r.stderr, r.stderr


@pytest.mark.parametrize("flags,error", [
    (["--seq-len", "0"], "--seq-len must be >= 1, got 0"),
    (["--seq-len", "65"], "--seq-len must be between 1 and model.max_seq_len = 64, got 65"),
    (["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
    (["--batch-size", "-1"], "--batch-size must be >= 1, got -1"),
    (["--tokens", "0"], "--tokens must be >= 1, got 0"),
    (["--tokens", "10"], "--tokens 10 is less than one window of 32 tokens (--seq-len); give at least 32"),
    (["--tokens", "31", "--seq-len", "32"],
     "--tokens 31 is less than one window of 32 tokens (--seq-len); give at least 32"),
])
def test_ablate_refuses_a_count_below_one_in_one_line(flags, error, tiny_reference_run, tmp_path, keel_main):
    """--seq-len 0 ablated at the run's seq_len; --batch-size 0 / -1 was a ZeroDivisionError traceback;
    --tokens below one window measured one whole window (more tokens than asked) without a word."""
    r = keel_main("ablate", "--run", tiny_reference_run, *flags, "--out", tmp_path / "abl")
    assert (r.returncode, r.stderr) == (2, f"keel: error: {error}\n")
    assert not (tmp_path / "abl").exists()


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_ablate_cli_on_a_run_of_every_scheme(scheme, tiny_data, tmp_path, capsys):
    """`keel ablate --run R` on a trained run of each scheme: a finite ΔPPL per sub-layer and all
    three outputs."""
    from conftest import REPO, tiny_overrides
    from keel.cli import main
    from keel.train import train

    run = tmp_path / "run"
    train(load_config(REPO / "keel" / "configs" / "demo.toml",
                      [*tiny_overrides(tiny_data, steps=2, eval_every=2, checkpoint_every=2, eval_tokens=64,
                                       sample_tokens=0), f"model.residual={scheme}"]), run)
    code = main(["ablate", "--run", str(run), "--tokens", "128", "--out", str(tmp_path / "abl"), "--json"])
    out = capsys.readouterr()
    assert code == 0 and "Traceback" not in out.err, out.err
    res = json.loads(out.out)
    assert len(res["units"]) == 4 and all(math.isfinite(u["delta_ppl"]) for u in res["units"])
    assert sorted(p.name for p in (tmp_path / "abl").iterdir()) == ["ablate.json", "ablate.md", "ablate.png"]


@pytest.fixture(scope="module")
def tiny_llama(tiny_data, tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("llama")
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                                   initializer_range=0.2)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tiny_data / "tokenizer.json"),
                                               eos_token="<|endoftext|>")
    tok.save_pretrained(path)
    return path


def test_hf_layer_removal_equals_a_model_without_that_layer(tiny_llama):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    w = _windows(n=4, T=16, V=512)
    res = ablate_hf_model(model, w, batch_size=2)
    assert len(res["units"]) == 3 and res["unit"] == "decoder layer"
    with torch.no_grad():
        full = ppl(model(input_ids=w[:, :-1]).logits, w[:, 1:])
    assert res["ppl_full"] == pytest.approx(full, rel=1e-5)
    for i in range(3):  # the transcription: a 2-layer model holding the other layers' weights
        short = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
        short.model.layers = torch.nn.ModuleList([lay for j, lay in enumerate(short.model.layers) if j != i])
        short.config.num_hidden_layers = 2
        with torch.no_grad():
            want = ppl(short(input_ids=w[:, :-1], use_cache=False).logits, w[:, 1:]) - full
        assert res["units"][i]["delta_ppl"] == pytest.approx(want, rel=1e-4, abs=1e-5 * full)
    assert max(abs(u["delta_ppl"]) for u in res["units"]) > 1e-3 * full
    with torch.no_grad():  # layers restored
        assert ppl(model(input_ids=w[:, :-1]).logits, w[:, 1:]) == pytest.approx(full, rel=1e-6)


def test_hf_cli_with_text(tiny_llama, tmp_path, keel_cli, keel_main):
    import json as _json

    text = tmp_path / "t.txt"
    text.write_text(_json.__doc__ * 4)
    r = keel_cli("ablate", "--hf", tiny_llama, "--text", text, "--seq-len", 32, "--tokens", 128,
                 "--out", tmp_path / "o", "--json")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert len(res["units"]) == 3 and res["tokens"] == 128 and res["scheme"] == "hf:LlamaForCausalLM"
    assert "unit 0: PPL" not in r.stderr  # the per-unit lines only with --verbose
    assert (tmp_path / "o" / "ablate.png").is_file()
    r = keel_main("ablate", "--hf", tiny_llama, "--out", tmp_path / "o2")
    assert r.returncode == 2 and "--text" in r.stderr


@pytest.mark.parametrize("source", ["run", "hf"])
def test_ablate_text_report_names_the_file_not_validation_tokens(source, tiny_reference_run, tiny_llama, tmp_path,
                                                                 keel_main):
    """`keel ablate --text FILE` measured on FILE but its report said "N validation tokens" and
    ablate.json did not name the file."""
    text = tmp_path / "t.txt"
    text.write_text(json.__doc__ * 4)
    model = ["--run", tiny_reference_run] if source == "run" else ["--hf", tiny_llama]
    r = keel_main("ablate", *model, "--text", text, "--seq-len", 32, "--tokens", 64, "--out", tmp_path / "o")
    assert r.returncode == 0, r.stderr
    assert f"; 64 tokens of {text} in windows of 32 tokens. " in (tmp_path / "o" / "ablate.md").read_text()
    assert "validation tokens" not in r.stdout
    assert json.loads((tmp_path / "o" / "ablate.json").read_text())["text"] == str(text)


def test_ablate_text_encodes_a_literal_endoftext_as_text_as_eval_does(tiny_reference_run, tmp_path, keel_main):
    """`keel ablate --run R --text F` encoded a literal <|endoftext|> in F as the EOS id, where
    `keel eval --text`, prepare and generate read it as text: the two full-model losses differed."""
    text = tmp_path / "t.txt"
    text.write_text(("x = 1\n<|endoftext|>\ny = [2, 3]\n" * 40))
    r = keel_main("ablate", "--run", tiny_reference_run, "--text", text, "--seq-len", 32, "--tokens", 10 ** 6,
                  "--out", tmp_path / "o", "--json")
    assert r.returncode == 0, r.stderr
    ablated = json.loads(r.stdout)
    r = keel_main("eval", "--run", tiny_reference_run, "--text", text, "--seq-len", 32, "--json")
    assert r.returncode == 0, r.stderr
    ppl = json.loads(r.stdout)["perplexity"]
    whole = (ppl["tokens"] - 1) // 32 * 32  # ablate scores whole windows only; eval also the first token and the tail
    assert ablated["tokens"] == whole


@pytest.mark.parametrize("damage,why", [("missing", "no tokenizer.json there (keel needs a fast tokenizer): copy it "
                                                    "there, or export the run again"),  # as import-hf and eval --hf
                                         ("corrupt", "Expecting value: line 1 column 1 (char 0)")])
def test_hf_folder_with_a_bad_tokenizer_is_one_line(damage, why, tiny_llama, tmp_path, keel_main):
    """`keel ablate --hf LLAMA` of a folder whose tokenizer.json was missing or damaged died of a
    Python traceback (transformers' ValueError / json's JSONDecodeError), exit 1."""
    import shutil

    folder = tmp_path / "llama"
    shutil.copytree(tiny_llama, folder)
    if damage == "missing":
        (folder / "tokenizer.json").unlink()
    else:
        (folder / "tokenizer.json").write_text("not json")
    text = tmp_path / "t.txt"
    text.write_text(json.__doc__)
    r = keel_main("ablate", "--hf", folder, "--text", text, "--out", tmp_path / "o")
    assert (r.returncode, r.stderr) == (2, f"keel: error: cannot load the tokenizer of {folder}: {why}\n")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("full,unit", [(800.0, 3.0), (3.0, 800.0), (720.0, 710.0)])
def test_layer_importance_of_a_blown_up_model_is_finite(full, unit):
    """A full-model NLL above ~709.8 nats raised OverflowError in exp (issue 20, item 8):
    both PPLs are exp(min(nll, 700)), so ΔPPL is a number."""
    res = layer_importance(2, lambda i: full if i is None else unit)
    assert res["ppl_full"] == math.exp(min(full, 700.0))
    assert [u["ppl"] for u in res["units"]] == [math.exp(min(unit, 700.0))] * 2
    assert all(math.isfinite(u["delta_ppl"]) for u in res["units"])
    assert res["units"][0]["delta_ppl"] == math.exp(min(unit, 700.0)) - math.exp(min(full, 700.0))


def test_hf_export_of_a_run_ablates_to_the_run_s_numbers(tiny_reference_run, tmp_path, keel_main):
    """`keel ablate --hf EXPORT --run RUN` re-encoded the run's decoded validation split with the HF
    tokenizer (EOS became text) in windows of 256, not train.seq_len: other ΔPPLs than `--run RUN`
    (4148.7 vs 4072.5 in a new user's trial); without --run it refused though the export names its dataset."""
    pytest.importorskip("transformers")
    assert keel_main("export-hf", "--run", tiny_reference_run, "--out", tmp_path / "hf").returncode == 0
    want = keel_main("ablate", "--run", tiny_reference_run, "--tokens", 256, "--out", tmp_path / "a", "--json")
    assert want.returncode == 0, want.stderr
    want = json.loads(want.stdout)
    for extra in (["--run", tiny_reference_run], []):
        got = keel_main("ablate", "--hf", tmp_path / "hf", *extra, "--tokens", 256, "--out", tmp_path / "b", "--json")
        assert got.returncode == 0, got.stderr
        got = json.loads(got.stdout)
        assert (got["tokens"], got["seq_len"]) == (want["tokens"], want["seq_len"]) == (256, 32)
        assert got["ppl_full"] == pytest.approx(want["ppl_full"], rel=1e-6)
        assert [u["delta_ppl"] for u in got["units"]] == pytest.approx([u["delta_ppl"] for u in want["units"]],
                                                                        rel=1e-5, abs=1e-6 * want["ppl_full"])


def test_an_out_that_is_a_training_run_is_named_so(keel_main, tiny_reference_run):
    """A fresh-user trial: `keel ablate --out RUN` (a run's folder) said it held files "which keel did not write"."""
    r = keel_main("ablate", "--run", tiny_reference_run, "--out", tiny_reference_run)
    lines = r.stderr.splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr
    assert lines[0] == (f"keel: error: --out {tiny_reference_run} is a training run's folder, not an ablation: give "
                        "--out a new or empty folder (e.g. RUN/ablate)")
    assert "which keel did not write" not in lines[0]
