"""keel eval: perplexity / bits per byte against direct transcriptions, lm-eval tasks end to end
on the shipped local example tasks (offline), per-task failures, and in-training evaluation."""

import json
import math

import pytest
import torch

pytest.importorskip("lm_eval")
pytest.importorskip("transformers")

from conftest import HANG_S, REPO, tiny_overrides  # noqa: E402
from keel.cli import main  # noqa: E402
from keel.config import load_config  # noqa: E402
from keel.data import split_windows  # noqa: E402
from keel.errors import KeelError  # noqa: E402
from keel.eval.perplexity import bits_per_byte, text_perplexity  # noqa: E402
from keel.eval.tasks import EXAMPLE_TASK_DIR  # noqa: E402
from keel.run import Run  # noqa: E402

MC_TASK, ROLLING_TASK = "keel_python_completion", "keel_python_paragraphs"


pytestmark = pytest.mark.usefixtures("offline_one_thread")  # conftest: no network, one torch thread


@pytest.fixture(scope="module")
def run_dir(tiny_data, tmp_path_factory):
    from keel.train import train

    run = tmp_path_factory.mktemp("evalrun") / "run"
    train(load_config(REPO / "keel" / "configs" / "demo.toml", tiny_overrides(tiny_data, steps=8, eval_every=8)), run)
    return run


def direct_nats(model, ids: list[int]) -> float:
    """Summed -log p(ids[t] | ids[:t]) for t >= 1, one position at a time (no windows, no batching)."""
    total = 0.0
    if len(ids) < 2:
        return total
    with torch.no_grad():
        logits = model(torch.tensor([ids[:-1]]))[0]
        logp = torch.log_softmax(logits.double(), dim=-1)
        for t in range(1, len(ids)):
            total -= float(logp[t - 1, ids[t]])
    return total


def test_bits_per_byte_is_nats_over_ln2_over_bytes():
    assert bits_per_byte(1000.0, 500) == pytest.approx(1000.0 / math.log(2) / 500, rel=1e-15)
    # a model that spends exactly 8 bits on each byte: bits per byte 8
    assert bits_per_byte(8 * math.log(2) * 123, 123) == pytest.approx(8.0)
    with pytest.raises(ValueError):
        bits_per_byte(1.0, 0)


@pytest.mark.parametrize("n,seq_len", [(2, 1), (10, 3), (33, 8), (64, 63)])
def test_split_windows_predict_every_token_once(n, seq_len):
    ids = list(range(100, 100 + n))
    windows = split_windows(ids, seq_len, keep_tail=True)
    targets = [t for w in windows for t in w[1:].tolist()]
    assert targets == ids[1:]
    assert all(2 <= len(w) <= seq_len + 1 for w in windows)


def test_validation_perplexity_matches_trainer_and_direct_bytes(run_dir, capsys):
    assert main(["eval", "--run", str(run_dir), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    ppl = rep["perplexity"]
    last = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()][-1]
    # the same windows as the trainer's val_loss (train.seq_len, train.eval_tokens), fp32 on CPU
    assert ppl["loss"] == pytest.approx(last["val_loss"], abs=1e-5)
    assert ppl["perplexity"] == pytest.approx(math.exp(last["val_loss"]), rel=1e-4)
    # bytes: the UTF-8 bytes of the predicted tokens' text
    from keel.data import validation_tokens

    cfg = load_config(run_dir / "config.toml")
    w = validation_tokens(cfg.data.path, cfg.train.seq_len, cfg.train.eval_tokens)
    _, tok = Run(run_dir).load_model(), Run(run_dir).tokenizer()
    n_bytes = len(tok.decode(w[:, 1:].reshape(-1).tolist()).encode("utf-8"))
    assert ppl["tokens"] == w[:, 1:].numel() and ppl["bytes"] == n_bytes
    assert ppl["bits_per_byte"] == pytest.approx(ppl["nats"] / math.log(2) / n_bytes, rel=1e-12)
    assert rep["blocks"] == 2 and rep["sublayers"] == 4


def test_text_perplexity_against_direct_computation(run_dir, tmp_path, capsys):
    model, tok = Run(run_dir).load_model(), Run(run_dir).tokenizer()
    eos = tok.token_to_id("<|endoftext|>")
    text = "import os\n\ndef main(argv):\n    \"\"\"Print the arguments.\"\"\"\n    print(argv)  # é\n" * 3
    ids = [eos] + tok.encode(text).ids
    assert len(ids) > model.cfg.max_seq_len  # several windows
    res = text_perplexity(model, tok, text, seq_len=20, device="cpu", eos_id=eos)
    # direct: every text token predicted, with windows of 20 tokens of context
    nats = sum(direct_nats(model, w.tolist()) for w in split_windows(ids, 20, keep_tail=True))
    assert res.tokens == len(ids) - 1
    assert res.nats == pytest.approx(nats, rel=1e-5)
    assert res.bytes == len(text.encode("utf-8"))
    assert res.bits_per_byte == pytest.approx(nats / math.log(2) / len(text.encode("utf-8")), rel=1e-5)
    f = tmp_path / "held_out.txt"
    f.write_text(text, encoding="utf-8")
    assert main(["eval", "--run", str(run_dir), "--text", str(f), "--seq-len", "20", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["perplexity"]["nats"] == pytest.approx(res.nats, rel=1e-9)


def mc_direct(model, tok, limit):
    """acc and acc_norm of the shipped multiple-choice task, computed directly: lm-eval's
    log-likelihood of each choice after the context (trailing context spaces move to the
    choice; the choice's tokens are those of context+choice after the context's tokens)."""
    docs = [json.loads(ln) for ln in (EXAMPLE_TASK_DIR / "python_completion.jsonl").read_text().splitlines()]
    acc, acc_norm = [], []
    for doc in docs[:limit]:
        lls = []
        for choice in doc["choices"]:
            ctx = doc["context"]
            n_sp = len(ctx) - len(ctx.rstrip())
            cont = ctx[len(ctx) - n_sp:] + choice if n_sp else choice
            ctx = ctx[: len(ctx) - n_sp] if n_sp else ctx
            ctx_ids, whole = tok.encode(ctx).ids, tok.encode(ctx + cont).ids
            lls.append(-(direct_nats(model, whole) - direct_nats(model, ctx_ids)))
        acc.append(float(max(range(4), key=lambda i: lls[i]) == doc["answer"]))
        norm = [ll / len(c) for ll, c in zip(lls, doc["choices"])]
        acc_norm.append(float(max(range(4), key=lambda i: norm[i]) == doc["answer"]))
    return sum(acc) / len(acc), sum(acc_norm) / len(acc_norm)


def test_eval_example_tasks_end_to_end(run_dir, tmp_path, capsys):
    """Exported model, scored by lm-eval on the shipped local tasks (offline), equals a direct
    computation; a task whose dataset cannot be fetched gets one line and the others run."""
    (tmp_path / "remote.yaml").write_text(
        "task: keel_test_remote\ndataset_path: keel-no-such-org/no-such-dataset\noutput_type: multiple_choice\n"
        "test_split: test\ndoc_to_text: '{{q}}'\ndoc_to_choice: '{{choices}}'\ndoc_to_target: answer\n")
    # a rolling task over texts shorter than one window: lm-eval's bits_per_byte is then exactly
    # the summed -log p(text | <|endoftext|>) / ln 2 / UTF-8 bytes
    texts = ["def f(x):\n    return x\n", "import sys\nprint(sys.argv)\n", "class A:\n    pass\n"]
    (tmp_path / "short.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    (tmp_path / "short.yaml").write_text(
        "task: keel_test_short\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: short.jsonl\n"
        "test_split: test\noutput_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
        "metric_list:\n  - metric: bits_per_byte\n  - metric: byte_perplexity\n")
    (tmp_path / "missing.yaml").write_text(  # a local data file that is not there: no "(offline?)"
        (tmp_path / "short.yaml").read_text().replace("keel_test_short", "keel_test_missing")
        .replace("short.jsonl", "missing.jsonl"))
    hf_dir = tmp_path / "hf"
    assert main(["export-hf", "--run", str(run_dir), "--out", str(hf_dir)]) == 0
    capsys.readouterr()
    tasks = f"keel_test_remote,{MC_TASK},{ROLLING_TASK},keel_test_short,keel_test_missing"
    rc = main(["eval", "--hf", str(hf_dir), "--tasks", tasks, "--task-dir", str(tmp_path), "--limit", "6", "--json"])
    captured = capsys.readouterr()
    assert rc == 1  # one task could not run
    err_lines = sorted(ln for ln in captured.err.splitlines() if ln.startswith("task "))
    assert len(err_lines) == 2 and err_lines[1].startswith("task keel_test_remote: dataset could not be loaded "
                                                             "(offline?): ")
    assert err_lines[0].startswith("task keel_test_missing: dataset could not be loaded: ")
    assert "missing.jsonl" in err_lines[0]
    rep = json.loads(captured.out)
    res = rep["tasks"]
    assert "error" in res["keel_test_remote"]
    model, tok = Run(run_dir).load_model(), Run(run_dir).tokenizer()
    acc, acc_norm = mc_direct(model, tok, 6)
    assert res[MC_TASK]["acc"] == pytest.approx(acc) and res[MC_TASK]["acc_norm"] == pytest.approx(acc_norm)
    eos = tok.token_to_id("<|endoftext|>")
    nats = sum(direct_nats(model, [eos] + tok.encode(t).ids) for t in texts)
    n_bytes = sum(len(t.encode("utf-8")) for t in texts)
    assert res["keel_test_short"]["bits_per_byte"] == pytest.approx(nats / math.log(2) / n_bytes, rel=1e-5)
    assert res["keel_test_short"]["byte_perplexity"] == pytest.approx(math.exp(nats / n_bytes), rel=1e-5)
    bpb = res[ROLLING_TASK]["bits_per_byte"]
    assert 0 < bpb < 20 and res[ROLLING_TASK]["byte_perplexity"] == pytest.approx(2 ** bpb, rel=1e-6)
    # the exported folder's keel_config.toml names the run's data: the same held-out numbers as --run
    assert main(["eval", "--run", str(run_dir), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["perplexity"]["nats"] == pytest.approx(rep["perplexity"]["nats"])


def test_eval_user_errors(run_dir, tmp_path, capsys):
    assert main(["eval", "--run", str(run_dir), "--text", str(tmp_path / "missing.txt")]) == 2
    assert "--text file not found" in capsys.readouterr().err
    assert main(["eval", "--run", str(tmp_path)]) == 2
    assert "not a run directory" in capsys.readouterr().err
    assert main(["eval", "--run", str(run_dir), "--tasks", MC_TASK, "--task-dir", str(tmp_path / "nope")]) == 2
    assert "--task-dir" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["eval"])  # --run or --hf is required
    assert e.value.code == 2


def test_too_little_text_is_named_in_english(run_dir, tmp_path, capsys):
    """An empty --text file said "too little text to evaluate (1 tokens)": the one token was the
    end-of-text token keel puts in front."""
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert main(["eval", "--run", str(run_dir), "--text", str(empty)]) == 2
    assert capsys.readouterr().err == f"keel: error: {empty}: empty, no text to evaluate\n"
    run = Run(run_dir)
    with pytest.raises(KeelError, match=r"^t: too little text to evaluate \(1 token, at least 2 needed\)$"):
        text_perplexity(run.load_model(), run.tokenizer(), "a", seq_len=8, device="cpu", source="t")


def test_a_one_byte_text_is_counted_in_the_singular(run_dir, tmp_path, capsys):
    """`keel eval --text` of one byte printed "(1 tokens, 1 bytes, ...)"."""
    one = tmp_path / "one.txt"
    one.write_text("a")
    assert main(["eval", "--run", str(run_dir), "--text", str(one)]) == 0
    assert f"held-out text: {one} (1 token, 1 byte, windows of " in capsys.readouterr().out


def test_max_tokens_with_a_text_file_is_refused(run_dir, tmp_path, capsys):
    """`keel eval --text FILE --max-tokens 100` scored every token of the file (14,071 in the
    new-user trial) without a word: --max-tokens limits only the validation split."""
    f = tmp_path / "t.txt"
    f.write_text("def f(x):\n    return x + 1\n" * 50)
    assert main(["eval", "--run", str(run_dir), "--text", str(f), "--max-tokens", "100"]) == 2
    assert capsys.readouterr().err == (f"keel: error: --max-tokens limits the validation split; --text {f} is "
                                       "scored whole (shorten the file to score fewer tokens)\n")


def test_eval_checks_tasks_before_loading_the_model(run_dir, tmp_path, keel_main, monkeypatch):
    """A bad --task-dir or a misspelt task was reported after the model loaded and the held-out
    loss was computed (the misspelt one with exit 1): now one line, exit 2, nothing loaded."""
    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the tasks were checked")

    monkeypatch.setattr(Run, "load_model", no_load)
    r = keel_main("eval", "--run", run_dir, "--task-dir", tmp_path / "nonexistent", "--tasks", MC_TASK)
    assert (r.returncode, r.stderr) == (2, f"keel: error: --task-dir {tmp_path / 'nonexistent'} is not a folder\n")
    r = keel_main("eval", "--run", run_dir, "--tasks", f"{MC_TASK},keel_python_completon")
    assert r.returncode == 2 and r.stdout == "" and len(r.stderr.splitlines()) == 1
    assert r.stderr.startswith("keel: error: task keel_python_completon: unknown task (not in ")
    # a task file of --task-dir that does not parse: named, with the parser's reason (it read "unknown task")
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "bad2.yaml").write_text("task: bad2\n  : [ broken yaml\n")
    (tasks / "other.yaml").write_text("task: other\n  : [ broken too\n")  # names neither: not the reason
    r = keel_main("eval", "--run", run_dir, "--task-dir", tasks, "--tasks", "bad2")
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
    assert r.stderr.startswith(f"keel: error: task bad2: {tasks / 'bad2.yaml'} names it but does not load as a task "
                               "file (ParserError: while parsing a block mapping)"), r.stderr
    r = keel_main("eval", "--run", run_dir, "--task-dir", tasks, "--tasks", "bad3")
    assert r.stderr.startswith("keel: error: task bad3: unknown task (not in "), r.stderr


def test_train_checks_its_tasks_before_anything_trains(tmp_path, keel_main):
    """A misspelt train.eval_tasks trained on, with a warning at every evaluation."""
    r = keel_main("train", "--set", "train.eval_tasks=keel_python_completon", "--set", "train.eval_tasks_every=2",
                  "--run-dir", tmp_path / "run")
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
    assert r.stderr.startswith("keel: error: task keel_python_completon: unknown task (not in ")
    assert not (tmp_path / "run").exists()


def test_training_runs_example_task_every_two_steps(tiny_config, tmp_path):
    from keel.experiments.training import train_run
    from keel.train import train

    plain = train(tiny_config(steps=4, eval_every=100, checkpoint_every=100), tmp_path / "plain")
    cfg = tiny_config(steps=4, eval_every=100, checkpoint_every=100, eval_tasks=MC_TASK, eval_tasks_every=2,
                      eval_tasks_limit=4)
    res = train_run(cfg, tmp_path / "tasks")
    recs = [json.loads(ln) for ln in (tmp_path / "tasks" / "metrics.jsonl").read_text().splitlines()]
    with_tasks = {r["step"]: r["eval_tasks"] for r in recs if "eval_tasks" in r}
    assert sorted(with_tasks) == [2, 4]
    for metrics in with_tasks.values():
        assert set(metrics) == {MC_TASK}
        acc = metrics[MC_TASK]["acc"]
        assert acc in (0.0, 0.25, 0.5, 0.75, 1.0)  # 4 items
    # the final model's score equals a direct computation, and evaluation left training untouched
    model, tok = Run(tmp_path / "tasks").load_model(), Run(tmp_path / "tasks").tokenizer()
    assert with_tasks[4][MC_TASK]["acc"] == pytest.approx(mc_direct(model, tok, 4)[0])
    losses = [r["loss"] for r in recs if "loss" in r]
    plain_losses = [json.loads(ln)["loss"] for ln in (tmp_path / "plain" / "metrics.jsonl").read_text().splitlines()
                    if "loss" in json.loads(ln)]
    assert losses == plain_losses and res.val_loss == plain.val_loss


def test_eval_hf_finds_the_cached_dataset_of_the_export(tiny_data, tmp_path, monkeypatch, capsys):
    """A run trained on the derived cache (data.path empty, relative cache_dir): its export names
    the dataset by absolute path, so `keel eval --hf` from another folder reports the same
    held-out numbers as `keel eval --run`; an export whose dataset is gone says which it is."""
    from keel.train import train

    cache = tiny_data.parent
    sets = [s for s in tiny_overrides(tiny_data, steps=2, eval_every=2, checkpoint_every=2)
            if not s.startswith("data.")]
    sets += ["data.source=builtin:python-stdlib", "data.tokenizer=bpe:512", "data.max_bytes=300000",
             "data.cache_dir=" + cache.name]
    monkeypatch.chdir(cache.parent)  # cache_dir is relative, as in the default config
    cfg = load_config(REPO / "keel" / "configs" / "demo.toml", sets)
    assert cfg.data.path == ""
    train(cfg, tmp_path / "run")
    assert main(["export-hf", "--run", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 0
    capsys.readouterr()
    assert main(["eval", "--run", str(tmp_path / "run"), "--json"]) == 0
    want = json.loads(capsys.readouterr().out)["perplexity"]
    monkeypatch.chdir(tmp_path)  # elsewhere: the relative cache_dir would not be found
    assert load_config(tmp_path / "hf" / "keel_config.toml").data.path == str(tiny_data.resolve())
    assert main(["eval", "--hf", str(tmp_path / "hf"), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)["perplexity"]
    assert got["nats"] == pytest.approx(want["nats"], rel=1e-6) and got["tokens"] == want["tokens"]
    # the dataset it names does not exist here: one accurate line, no preparation
    toml = (tmp_path / "hf" / "keel_config.toml").read_text()
    (tmp_path / "hf" / "keel_config.toml").write_text(toml.replace(str(tiny_data.resolve()), str(tmp_path / "gone")))
    assert main(["eval", "--hf", str(tmp_path / "hf")]) == 0
    assert f"held-out text: none (the dataset keel_config.toml names (data.path {tmp_path / 'gone'}) is not prepared " \
           "here; pass --text FILE)" in capsys.readouterr().out
    # a dataset prepared there since with another tokenizer: its ids were scored as the export's text
    from keel.data import prepare_dataset

    other = prepare_dataset("builtin:python-stdlib", "bpe:300", tmp_path / "gone", max_bytes=100_000, progress=False)
    capsys.readouterr()
    assert main(["eval", "--hf", str(tmp_path / "hf")]) == 2
    assert capsys.readouterr().err == (f"keel: error: {other} was prepared with another tokenizer than the model's "
                                       "(their vocabularies or merges differ): its token ids are other text to this model; "
                                       "score it with --text, or prepare the model's dataset again\n")


def test_unreachable_hub_task_fails_after_one_probe(run_dir, tmp_path, monkeypatch, caplog, connect_attempts):
    """Without HF_HUB_OFFLINE set, a task whose dataset is on the hub fails after one
    reachability probe (this machine has no network) instead of huggingface_hub's retries;
    the local tasks still run."""
    import datasets.config
    import huggingface_hub.constants as hub_constants

    from keel.eval.tasks import run_tasks

    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False, raising=False)
    (tmp_path / "remote.yaml").write_text(
        "task: keel_test_remote\ndataset_path: keel-no-such-org/no-such-dataset\noutput_type: multiple_choice\n"
        "test_split: test\ndoc_to_text: '{{q}}'\ndoc_to_choice: '{{choices}}'\ndoc_to_target: answer\n")
    model, tok = Run(run_dir).load_model(), Run(run_dir).tokenizer()
    with caplog.at_level("WARNING", logger="keel"):
        res = run_tasks(model, tok, ["keel_test_remote"], limit=2, task_dir=tmp_path)
    lines = [r.getMessage() for r in caplog.records if r.name == "keel.eval.tasks"]
    # at most the probe (none where the hub's name does not resolve); huggingface_hub's retries never start
    assert len(connect_attempts) <= 1, connect_attempts
    assert len(lines) == 1 and lines[0].startswith("task keel_test_remote: dataset could not be loaded (offline?): ")
    assert res["keel_test_remote"] == {"error": lines[0].split(": ", 1)[1]}
    assert hub_constants.HF_HUB_OFFLINE is False  # offline mode only for that load


def test_eval_quiet_by_default_verbose_shows_lm_eval_bars(run_dir, capfd):
    assert main(["eval", "--run", str(run_dir), "--tasks", MC_TASK, "--limit", "2", "--max-tokens", "64"]) == 0
    quiet = capfd.readouterr()
    assert "task keel_python_completion: acc" in quiet.out
    assert "it/s]" not in quiet.err and "Running loglikelihood requests" not in quiet.err
    assert main(["eval", "--run", str(run_dir), "--tasks", MC_TASK, "--limit", "2", "--max-tokens", "64",
                 "--verbose"]) == 0
    assert "Running loglikelihood requests" in capfd.readouterr().err


def test_generate_until_task_at_batch_size_8(run_dir, capfd):
    """A generate_until task (the shipped keel_python_generate) through `keel eval` with the
    default --batch-size 8: lm-eval batches prompts of different lengths, left-padded."""
    assert main(["eval", "--run", str(run_dir), "--tasks", "keel_python_generate", "--limit", "8",
                 "--batch-size", "8", "--max-tokens", "64"]) == 0
    out = capfd.readouterr().out
    assert "task keel_python_generate: exact_match" in out


@pytest.mark.spawns
def test_shipped_tasks_load_with_plain_lm_eval_from_any_folder(tmp_path):
    """`lm_eval --include_path keel/eval/example_tasks` from another working directory: lm-eval's
    own TaskManager (no keel code) finds every shipped task and its data."""
    import subprocess
    import sys

    from keel.eval.tasks import EXAMPLE_TASK_DIR

    code = ("import json, sys\nfrom lm_eval.tasks import TaskManager\n"
            "tm = TaskManager(include_path=sys.argv[1], include_defaults=False)\n"
            "tasks = tm.load_task_or_group(['keel_python_completion', 'keel_python_paragraphs', "
            "'keel_python_generate'])\n"
            "print('RESULT', json.dumps({k: len(list(t.test_docs())) for k, t in tasks.items()}))\n")
    blocked = "import sys\nsys.modules['keel'] = None\n" + code  # keel not importable
    r = subprocess.run([sys.executable, "-c", blocked, str(EXAMPLE_TASK_DIR)], capture_output=True, text=True,
                       cwd=tmp_path, timeout=HANG_S)
    assert r.returncode == 0, r.stderr[-2000:]
    counts = json.loads(r.stdout.split("RESULT ")[-1])
    assert counts == {"keel_python_completion": 20, "keel_python_paragraphs": 6, "keel_python_generate": 20}


@pytest.mark.parametrize("command", ["eval", "ablate"])
def test_a_text_that_is_a_folder_is_named_as_one(run_dir, tmp_path, capsys, command):
    """`keel eval --run R --text /tmp` said "--text file not found: /tmp"."""
    assert main([command, "--run", str(run_dir), "--text", str(tmp_path), "--out" if command == "ablate" else "--json",
                 *([str(tmp_path / "abl")] if command == "ablate" else [])]) == 2
    assert capsys.readouterr().err == f"keel: error: --text {tmp_path} is a folder, not a text file\n"
    assert main([command, "--run", str(run_dir), "--text", str(tmp_path / "no.txt")]) == 2
    assert capsys.readouterr().err == f"keel: error: --text file not found: {tmp_path / 'no.txt'}\n"
