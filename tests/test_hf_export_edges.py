"""Issue 19, items 9-12: lm-eval scores task by task whatever one task's requests are; the
exported tokenizer tokenizes exactly as keel; exports never share a cached module; to_llama
returns an independent copy."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("lm_eval")
pytest.importorskip("transformers")

from conftest import HANG_S, REPO, tiny_overrides  # noqa: E402
from keel.cli import main  # noqa: E402
from keel.config import ModelConfig, load_config  # noqa: E402
from keel.data.text import encode_text  # noqa: E402
from keel.model import Transformer  # noqa: E402
from keel.run import Run  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

MC_TASK = "keel_python_completion"


pytestmark = [pytest.mark.usefixtures("offline_one_thread"), pytest.mark.spawns]  # conftest: no network, one thread


@pytest.fixture(scope="module")
def run_dir(tiny_data, tmp_path_factory):
    from keel.train import train

    run = tmp_path_factory.mktemp("v3hf") / "run"
    train(load_config(REPO / "keel" / "configs" / "demo.toml", tiny_overrides(tiny_data, steps=4, eval_every=4)), run)
    return run


@pytest.fixture(scope="module")
def export(run_dir, tmp_path_factory):
    from keel.hf.convert import export_hf

    return export_hf(run_dir, tmp_path_factory.mktemp("v3exp") / "model")


# ---------------------------------------------------------------- 9. one bad task does not stop the others
def test_a_task_lm_eval_cannot_score_is_one_line_and_the_others_run(export, tmp_path, capsys):
    """A continuation longer than the model's window (64 tokens) made lm-eval's bare assert
    end all of `keel eval` (exit 1, traceback, no task scored)."""
    long = " ".join(f"word{i}" for i in range(300))
    (tmp_path / "long.jsonl").write_text(json.dumps({"q": "x = ", "choices": [long, "1"], "answer": 1}) + "\n")
    (tmp_path / "long.yaml").write_text(
        "task: keel_test_long\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: long.jsonl\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{q}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: answer\nmetric_list:\n  - metric: acc\n")
    rc = main(["eval", "--hf", str(export), "--tasks", f"keel_test_long,{MC_TASK}", "--task-dir", str(tmp_path),
               "--limit", "4", "--json"])
    captured = capsys.readouterr()
    assert rc == 1
    lines = [ln for ln in captured.err.splitlines() if ln.startswith("task ")]
    assert len(lines) == 1 and lines[0].startswith("task keel_test_long: could not be scored: AssertionError")
    assert "window of 64 tokens" in lines[0]
    res = json.loads(captured.out)["tasks"]
    assert "error" in res["keel_test_long"] and 0 <= res[MC_TASK]["acc"] <= 1


# ---------------------------------------------------------------- 10. the export tokenizes as keel does
TEXTS = ["x = '<|endoftext|>'\nprint(x)\n", "<|endoftext|>", "a<|endoftext|>b<|endoftext|>", "def f():\n    pass\n",
         "<|endoftext|><|endoftext|> end", "plain text with no special token"]


@pytest.mark.parametrize("text", TEXTS)
def test_exported_tokenizer_gives_keel_ids(export, run_dir, text):
    """A stock AutoTokenizer on the export, and lm-eval's HFLM encoding, give keel's ids
    (before: 12 tokens instead of 19 on the first text: the literal became the special token)."""
    from transformers import AutoTokenizer

    want = encode_text(Run(run_dir).tokenizer(), text)
    tok = AutoTokenizer.from_pretrained(export)
    assert tok(text, add_special_tokens=False)["input_ids"] == want
    assert tok.encode(text, add_special_tokens=False) == want


# ---------------------------------------------------------------- 11. exports never share a cached module
LOAD_BOTH = textwrap.dedent('''
    import json, sys
    from transformers import AutoModelForCausalLM
    out = []
    for folder in sys.argv[1:]:
        m = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
        out.append(getattr(sys.modules[type(m).__module__], "KEEL_MARKER", None))
    print("RESULT " + json.dumps(out))
''')

EXPORT_MARKED = textwrap.dedent('''
    import sys
    import keel.hf.remote as R
    real = R.generate_remote_code

    def marked():  # another keel version: other code
        files = real()
        files[R.MODELING_FILE] += "\\nKEEL_MARKER = " + repr(sys.argv[3]) + "\\n"
        return files

    R.generate_remote_code = marked
    from keel.hf.convert import export_hf
    export_hf(sys.argv[1], sys.argv[2])
''')


def test_two_exports_with_one_base_name_keep_their_own_code(run_dir, tmp_path):
    """a/model and b/model, made by two keel versions (different code), loaded in one process
    with trust_remote_code: each runs its own code (before: b ran a's)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    for name in ("a", "b"):
        r = subprocess.run([sys.executable, "-c", EXPORT_MARKED, str(run_dir), str(tmp_path / name / "model"), name],
                           capture_output=True, text=True, env=env, timeout=HANG_S)
        assert r.returncode == 0, r.stderr[-2000:]
    r = subprocess.run([sys.executable, "-c", LOAD_BOTH, str(tmp_path / "a" / "model"), str(tmp_path / "b" / "model")],
                       capture_output=True, text=True, env=dict(env, PYTHONPATH=""), cwd=tmp_path, timeout=HANG_S)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout.split("RESULT ")[-1]) == ["a", "b"]


# ---------------------------------------------------------------- 12. to_llama copies
@pytest.mark.parametrize("tie", [False, True])
def test_to_llama_shares_no_memory_with_the_keel_model(tie):
    from keel.hf.llama import to_llama

    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=97, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64,
                                    max_seq_len=48, residual="pre_ln", tie_embeddings=tie))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    llama = to_llama(model)
    keel_ptrs = {p.data_ptr() for p in model.parameters()}
    assert not keel_ptrs & {p.data_ptr() for p in llama.parameters()}
    llama.train()
    opt = torch.optim.SGD(llama.parameters(), lr=0.5)
    ids = torch.randint(0, 97, (2, 12))
    llama(ids, labels=ids).loss.backward()
    opt.step()
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_export_hint_names_the_folder(run_dir, tmp_path, capsys):
    """Item 13: the hint printed a literal OUT."""
    out = tmp_path / "exported"
    assert main(["export-hf", "--run", str(run_dir), "--out", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == (f"load it with AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True), or "
                        "after `import keel.hf` without trust_remote_code")


def test_export_hint_of_a_pre_ln_run_says_it_is_a_stock_llama(tiny_data, tmp_path, capsys):
    """A pre_ln export is a LlamaForCausalLM: the hint said trust_remote_code=True was needed."""
    from keel.train import train

    run, out = tmp_path / "run", tmp_path / "exported"
    train(load_config(REPO / "keel" / "configs" / "demo.toml",
                      tiny_overrides(tiny_data, steps=2, eval_every=2) + ["model.residual=pre_ln",
                                                                          "model.rope_theta=500000"]), run)
    assert main(["export-hf", "--run", str(run), "--out", str(out)]) == 0
    assert capsys.readouterr().out.splitlines()[1] == (
        f"load it with AutoModelForCausalLM.from_pretrained({str(out)!r}): a stock Llama model, no keel or "
        "trust_remote_code needed")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    # readable by older readers too: transformers 5 wrote the RoPE base only in rope_parameters (4 and converters
    # took the default 10,000) and named the tokenizer class TokenizersBackend (unknown to transformers 4)
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"] == 500000.0
    assert json.loads((out / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
    from transformers import AutoConfig, AutoTokenizer

    assert AutoConfig.from_pretrained(out).rope_parameters["rope_theta"] == 500000.0
    text = "def parse(x):\n    return x  # <|endoftext|>"
    assert AutoTokenizer.from_pretrained(out)(text).input_ids == \
        encode_text(Tokenizer.from_file(str(run / "tokenizer.json")), text)


def test_export_of_a_run_with_a_damaged_latest_checkpoint_warns_once_and_names_its_step(tiny_data, tmp_path, capsys):
    """The newest checkpoint damaged: export-hf fell back to the older one as it should, but said
    "skipping step_00000004" twice (it looked for the latest checkpoint twice) and its success line
    did not say which step it exported."""
    from keel.train import train

    run, out = tmp_path / "run", tmp_path / "exported"
    train(load_config(REPO / "keel" / "configs" / "demo.toml",
                      tiny_overrides(tiny_data, steps=4, eval_every=4, checkpoint_every=2)), run)
    weights = run / "checkpoints" / "step_00000004" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    capsys.readouterr()
    assert main(["export-hf", "--run", str(run), "--out", str(out)]) == 0
    got = capsys.readouterr()
    assert got.err.count("skipping step_00000004") == 1, got.err
    assert got.out.splitlines()[0] == f"exported {run} (step 2) -> {out}"
    assert json.loads((out / "config.json").read_text())["keel_step"] == 2
    # every checkpoint damaged: one warning per checkpoint (it was said twice), then the one-line error
    older = run / "checkpoints" / "step_00000002" / "model.safetensors"
    older.write_bytes(older.read_bytes()[:1000])
    assert main(["export-hf", "--run", str(run), "--out", str(tmp_path / "none")]) == 2
    got = capsys.readouterr()
    assert got.err.count("skipping step_00000002") == 1 and got.err.count("skipping step_00000004") == 1, got.err
    assert got.err.splitlines()[-1].startswith(f"keel: error: run {run} has no intact checkpoint (step_00000004: ")
    assert not (tmp_path / "none").exists()
    # an existing file as --out: said so (an empty file read "already exists and is not empty")
    (tmp_path / "afile").write_text("")
    assert main(["export-hf", "--run", str(run), "--out", str(tmp_path / "afile")]) == 2
    assert capsys.readouterr().err == \
        f"keel: error: output {tmp_path / 'afile'} is a file, not a folder; choose another --out\n"
