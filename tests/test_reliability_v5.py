"""Issue "Reliability and cluster v5": keel writes and deletes only what is its own, SIGHUP stops a
run cleanly, files that are not regular files, tracebacks left, silent waits, misleading messages."""

import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import HANG_S, tiny_overrides
from keel.cli import main
from keel.errors import KeelError


def sets(data, **train):
    return [a for s in tiny_overrides(data, **train) for a in ("--set", s)]


def error_lines(capsys) -> list[str]:
    return [ln for ln in capsys.readouterr().err.strip().splitlines() if ln.strip()]


@pytest.fixture(scope="module")
def cli_run(tiny_data, tmp_path_factory):
    torch.set_num_threads(1)
    run = tmp_path_factory.mktemp("v5") / "run"
    assert main(["train", "--run-dir", str(run), *sets(tiny_data, steps=4, eval_every=2, checkpoint_every=2)]) == 0
    return run


# --- 1. keel deletes or writes into only what it created ------------------------------------------

def _files(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_restart_on_a_folder_of_another_tools_run_deletes_nothing(tiny_data, tmp_path, capsys):
    """`keel train --run-dir H --restart` deleted another tool's checkpoints/ and metrics.jsonl."""
    other = tmp_path / "other"
    (other / "checkpoints").mkdir(parents=True)
    (other / "checkpoints" / "epoch=3.ckpt").write_bytes(b"weights")
    (other / "metrics.jsonl").write_text('{"epoch": 3}\n')
    before = _files(other)
    for extra in ([], ["--restart"]):
        assert main(["train", "--run-dir", str(other), *extra, *sets(tiny_data, steps=2)]) == 2
        err = error_lines(capsys)
        assert len(err) == 1 and "is not a keel run" in err[0] and "checkpoints, metrics.jsonl" in err[0], err
        assert "--restart" not in err[0]  # it suggested --restart, which deleted both
        assert _files(other) == before and sorted(p.name for p in other.iterdir()) == ["checkpoints", "metrics.jsonl"]


def test_run_dir_of_a_home_like_folder_is_refused_and_left_as_it_was(tiny_data, tmp_path, capsys):
    """`keel train --run-dir /` (or a home folder) wrote config, checkpoints, metrics into it."""
    home = tmp_path / "home"
    home.mkdir()
    (home / ".bashrc").write_text("export X=1\n")
    (home / "notes.txt").write_text("mine\n")
    assert main(["train", "--run-dir", str(home), *sets(tiny_data, steps=2)]) == 2
    err = error_lines(capsys)
    assert len(err) == 1 and err[0].startswith(f"keel: error: --run-dir {home} is not a keel run"), err
    assert sorted(p.name for p in home.iterdir()) == [".bashrc", "notes.txt"]  # not even a lock file


def test_run_dir_holding_only_slurm_logs_is_a_new_run(tiny_data, tmp_path, capsys):
    """Under Slurm the job's folder already holds slurm-%j.out / .err when keel starts."""
    run = tmp_path / "job"
    run.mkdir()
    (run / "slurm-4242.out").write_text("started\n")
    (run / "slurm-4242_3.err").write_text("")
    assert main(["train", "--run-dir", str(run), *sets(tiny_data, steps=2, eval_every=2, checkpoint_every=2)]) == 0
    assert (run / "config.toml").is_file() and (run / "slurm-4242.out").read_text() == "started\n"


def test_run_dir_inside_a_runs_checkpoints_is_refused(cli_run, tmp_path, capsys):
    run = tmp_path / "r"
    shutil.copytree(cli_run, run)
    inner = run / "checkpoints" / "mine"
    assert main(["train", "--run-dir", str(inner), "--set", "train.steps=2"]) == 2
    err = error_lines(capsys)
    assert len(err) == 1 and "inside the checkpoints folder of the run" in err[0], err
    assert not inner.exists()


def test_export_hf_into_a_runs_checkpoints_is_refused(cli_run, tmp_path, capsys):
    """`export-hf --out RUN/checkpoints/step_5/hf` was accepted; pruning later deleted it silently."""
    run = tmp_path / "r"
    shutil.copytree(cli_run, run)
    out = run / "checkpoints" / "step_00000004" / "hf"
    assert main(["export-hf", "--run", str(run), "--out", str(out)]) == 2
    err = error_lines(capsys)
    assert len(err) == 1 and "inside the checkpoints folder of the run" in err[0], err
    assert not out.exists()


def _tiny_model():
    from keel import ModelConfig, Transformer

    torch.manual_seed(0)
    return Transformer(ModelConfig(d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32, vocab_size=64,
                                   max_seq_len=16))


def test_pruning_deletes_only_the_checkpoints_own_files(tmp_path, caplog):
    """Checkpoint pruning deleted a folder saved into RUN/checkpoints/step_N without a word."""
    from keel.train.checkpoint import save_checkpoint

    model, run = _tiny_model(), tmp_path / "run"
    first = save_checkpoint(run, 1, model, {"step": 1}, keep=1)
    (first / "hf").mkdir()
    (first / "hf" / "config.json").write_text("{}")
    with caplog.at_level(logging.WARNING, logger="keel"):
        save_checkpoint(run, 2, model, {"step": 2}, keep=1)
    assert sorted(p.relative_to(first).as_posix() for p in first.rglob("*")) == ["hf", "hf/config.json"]
    assert "kept step_00000001" in caplog.text and "hf" in caplog.text
    save_checkpoint(run, 3, model, {"step": 3}, keep=1)  # the folder left is no checkpoint: not pruned again
    assert (first / "hf" / "config.json").is_file() and not (run / "checkpoints" / "step_00000002").exists()


def test_restart_deletes_only_the_checkpoints_own_files(cli_run, tmp_path, capsys):
    """`--restart` removed RUN/checkpoints wholesale, with whatever else had been put there."""
    run = tmp_path / "r"
    shutil.copytree(cli_run, run)
    (run / "checkpoints" / "step_00000004" / "notes.txt").write_text("mine")
    (run / "checkpoints" / "README").write_text("mine")
    (run / "checkpoints" / ".my.tmp").write_text("not keel's temporary")
    assert main(["train", "--run-dir", str(run), "--restart", "--set", "train.steps=1"]) == 0
    capsys.readouterr()
    ckpts = run / "checkpoints"
    assert (ckpts / "README").is_file() and (ckpts / ".my.tmp").is_file()
    assert sorted(p.name for p in (ckpts / "step_00000004").iterdir()) == ["notes.txt"]  # keel's files went
    assert not (ckpts / "step_00000002").exists() and (ckpts / "latest").read_text().strip() == "step_00000001"


def test_checkpoint_of_a_step_holding_foreign_files_is_refused_not_deleted(tmp_path):
    from keel.train.checkpoint import save_checkpoint

    model, run = _tiny_model(), tmp_path / "run"
    ckpt = save_checkpoint(run, 1, model, {"step": 1})
    (ckpt / "notes.txt").write_text("mine")
    with pytest.raises(KeelError, match="holds files keel did not write"):
        save_checkpoint(run, 1, model, {"step": 1})
    assert (ckpt / "notes.txt").read_text() == "mine" and (ckpt / "model.safetensors").is_file()


def test_prepare_over_a_dataset_holding_foreign_files_is_refused(tiny_data, tmp_path, capsys):
    out = tmp_path / "ds"
    shutil.copytree(tiny_data, out)
    (out / "notes.txt").write_text("mine")
    src = tmp_path / "corpus"
    src.mkdir()
    (src / "a.txt").write_text("hello world\n" * 50)
    assert main(["prepare", "--source", str(src), "--tokenizer", "bpe:300", "--out", str(out), "--force"]) == 2
    err = error_lines(capsys)
    assert len(err) == 1 and "files keel did not write (notes.txt)" in err[0], err
    assert (out / "notes.txt").is_file() and (out / "meta.json").is_file()


# --- 5. SIGHUP is a stop request; SIGQUIT keeps its default ---------------------------------------

def test_sighup_from_a_closed_terminal_checkpoints_and_exits_129(tiny_data, tmp_path):
    """`keel train` in an SSH session that closes (its terminal hangs up: SIGHUP, and every later
    write to the terminal fails) died without a checkpoint. Now it finishes its step, checkpoints
    it and exits 129; the progress bar on the dead terminal does not end it first."""
    import fcntl
    import pty
    import termios

    from test_run_safety import ENV, KEEL
    from keel.train.checkpoint import checkpoint_problem
    from keel.train.metrics import read_metrics

    run = tmp_path / "run"
    sets_ = tiny_overrides(tiny_data, steps=100000, checkpoint_every=100000, eval_every=100000, progress=True)
    master, slave = pty.openpty()

    def controlling_terminal():  # after setsid (start_new_session): the pty becomes this session's terminal
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    proc = subprocess.Popen([str(KEEL), "train", "--run-dir", str(run), *sum((["--set", s] for s in sets_), [])],
                            stdin=slave, stdout=slave, stderr=slave, env=ENV, start_new_session=True,
                            preexec_fn=controlling_terminal)
    os.close(slave)
    try:
        deadline = time.monotonic() + HANG_S
        while not any(r.get("step", 0) >= 2 for r in read_metrics(run / "metrics.jsonl")):
            assert proc.poll() is None and time.monotonic() < deadline
            try:  # keep reading what it writes, as a terminal does
                os.read(master, 65536) if select_ready(master) else time.sleep(0.1)
            except OSError:
                time.sleep(0.1)
        os.close(master)  # the SSH session ends: the kernel hangs the terminal up and sends SIGHUP
        master = None
        assert proc.wait(timeout=HANG_S) == 129
    finally:
        if master is not None:
            os.close(master)
        if proc.poll() is None:
            proc.kill()
    steps = [r["step"] for r in read_metrics(run / "metrics.jsonl") if "step" in r]
    latest = run / "checkpoints" / "latest"
    assert latest.is_file() and latest.read_text().strip() == f"step_{steps[-1]:08d}"
    assert checkpoint_problem(run / "checkpoints" / latest.read_text().strip()) is None


def select_ready(fd) -> bool:
    import select

    return bool(select.select([fd], [], [], 0.1)[0])


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_sighup_to_a_grid_checkpoints_every_running_job(tiny_data, tmp_path):
    """SIGHUP to a grid with 2 workers (`keel study --workers 2`, here its engine through `keel
    sweep`) killed both workers without a checkpoint."""
    from test_run_safety import last_line, signal_while_training
    from keel.train.metrics import read_metrics

    out = tmp_path / "sweep"
    runs = [out / f"seed{k}" for k in range(2)]
    err, proc, left = signal_while_training(["sweep", "--grid", "train.seed=0,1", "--workers", "2", "--threads", "1",
                                             "--out", out], runs, "SIGHUP", tiny_data, tmp_path)
    assert left == [] and "Traceback" not in err, err
    assert proc.returncode == 129, err
    assert last_line(err).startswith("keel: stopped by SIGHUP (each running job finished its step and "
                                     "checkpointed its run"), err
    for run in runs:
        steps = [r["step"] for r in read_metrics(run / "metrics.jsonl")]
        assert (run / "checkpoints" / "latest").read_text().strip() == f"step_{steps[-1]:08d}"


def test_sigquit_is_deliberately_not_a_stop_request():
    """SIGQUIT (Ctrl-\\) keeps its default, quit at once; SIGHUP joins the stop signals."""
    from keel.io import STOP_SIGNALS
    from keel.train.interrupt import StopSignals

    assert signal.SIGHUP in STOP_SIGNALS and signal.SIGQUIT not in STOP_SIGNALS
    before = signal.getsignal(signal.SIGQUIT)
    with StopSignals(announce=False):
        assert signal.getsignal(signal.SIGQUIT) is before
        assert signal.getsignal(signal.SIGHUP) not in (signal.SIG_DFL, signal.SIG_IGN)


def test_sighup_outside_a_training_loop_unwinds_and_cleans_up(tmp_path, capsys, monkeypatch):
    """Outside the loop (preparing data) SIGHUP stops at once like SIGTERM: the half-built dataset
    is removed and one line says so (it used to kill the process where it stood)."""
    import keel.data.prepare as P

    src = tmp_path / "corpus"
    src.mkdir()
    (src / "a.txt").write_text("hello world\n" * 50)

    def hangup(*a, **k):
        os.kill(os.getpid(), signal.SIGHUP)
        time.sleep(5)
        raise AssertionError("SIGHUP did not stop it")

    def unhandled(signum, frame):  # what a SIGHUP that keel leaves alone meets here (not the test runner's death)
        raise AssertionError("keel did not handle SIGHUP")

    monkeypatch.setattr(P, "_train_bpe", hangup)
    out = tmp_path / "ds"
    saved = signal.signal(signal.SIGHUP, unhandled)
    try:
        assert main(["prepare", "--source", str(src), "--tokenizer", "bpe:300", "--out", str(out)]) == 129
    finally:
        signal.signal(signal.SIGHUP, saved)
    assert error_lines(capsys)[-1] == "keel: stopped by SIGHUP"
    assert not out.exists() and not list(tmp_path.glob("ds*"))


# --- 7. files that are not regular files -------------------------------------------------------------

def _unblock_fifo_later(fifo: Path):
    """Open ``fifo`` for writing in a thread (and close it at once): a reader that opened it gets
    an empty file instead of waiting for ever. Returns a function that ends the thread."""
    import threading

    t = threading.Thread(target=lambda: open(fifo, "wb").close(), daemon=True)
    t.start()

    def end():
        fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # lets the writer's open() return if nobody read it
        t.join(timeout=HANG_S)
        os.close(fd)
    return end


def test_corpus_folder_with_a_fifo_and_a_device_skips_them_by_name(tmp_path, caplog):
    """A FIFO in a corpus folder blocked `keel prepare` for ever with no output; a .txt linked to
    /dev/zero was read until MemoryError (/dev/null here: the same kind of file, without the risk)."""
    from keel.data.sources import SourceStats, iter_documents, source_fingerprint

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("real text\n")
    os.mkfifo(corpus / "b.txt")
    (corpus / "c.txt").symlink_to("/dev/null")
    (corpus / "d.txt").symlink_to(corpus / "gone.txt")
    end = _unblock_fifo_later(corpus / "b.txt")
    try:
        with caplog.at_level(logging.WARNING, logger="keel"):
            docs = list(iter_documents(str(corpus), stats=SourceStats()))
    finally:
        end()
    assert docs == ["real text\n"]
    assert f"skipping {corpus / 'b.txt'}: not a regular file (a FIFO (named pipe))" in caplog.text
    assert f"skipping {corpus / 'c.txt'}: not a regular file (a character device)" in caplog.text
    assert f"skipping {corpus / 'd.txt'}: not a regular file (a broken symbolic link)" in caplog.text
    assert source_fingerprint(str(corpus))  # a broken link was a FileNotFoundError traceback here


def test_special_files_given_by_name_are_refused_in_one_line(tmp_path, capsys):
    """Given by name, a FIFO was "the folder is empty" (prepare), "file not found" (--text, --config)."""
    from keel.config import resolve_config_path
    from keel.data.text import read_text_file

    fifo = tmp_path / "pipe.txt"
    os.mkfifo(fifo)
    assert main(["prepare", "--source", str(fifo), "--out", str(tmp_path / "ds")]) == 2
    err = error_lines(capsys)
    assert err == [f"keel: error: data source {fifo} is not a regular file (a FIFO (named pipe))"], err
    with pytest.raises(KeelError, match=r"^--text .* is not a regular file \(a FIFO"):
        read_text_file(fifo)
    (tmp_path / "dev.toml").symlink_to("/dev/null")
    with pytest.raises(KeelError, match=r"^config file .*dev.toml is not a regular file \(a character device\)"):
        resolve_config_path(str(tmp_path / "dev.toml"))
    assert not (tmp_path / "ds").exists()


# --- 8. tracebacks left ------------------------------------------------------------------------------

@pytest.mark.parametrize("argv", [
    ["train", "--run-dir", "{sub}/{long}"],
    ["train", "--resume", "{sub}/{long}"],
    ["prepare", "--source", "{corpus}", "--out", "{sub}/{long}"],
    ["prepare", "--source", "{corpus}", "--out", "{sub}/{near}"],  # fits, but OUT.tmp-PID beside it does not
    ["export-hf", "--run", "{run}", "--out", "{sub}/{long}"],
    ["export-hf", "--run", "{run}", "--out", "{sub}/{near}"],  # fits, but .OUT.XXXXXXXX.tmp beside it does not
    ["study", "claims", "--scale", "tiny", "--out", "{sub}/{long}"],
    ["sweep", "--grid", "train.seed=0", "--out", "{sub}/{long}"],
], ids=["train", "resume", "prepare", "prepare-tmp", "export-hf", "export-hf-tmp", "study", "sweep"])
def test_a_file_name_too_long_is_one_line_and_leaves_nothing(argv, cli_run, tmp_path, capsys):
    """A 260-character path component: "File name too long" was an OSError traceback in train,
    study, prepare and export-hf, after the folders above it were made."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("some text\n" * 20)
    sub = tmp_path / "sub"
    names = dict(sub=sub, long="x" * 260, near="y" * 250, corpus=corpus, run=cli_run)
    assert main([a.format(**names) for a in argv]) == 2
    err = error_lines(capsys)
    assert len(err) == 1 and err[0].startswith("keel: error: ") and "bytes long" in err[0], err
    assert not sub.exists()


def _llama_folder(export: Path, out: Path) -> Path:
    """A stock Llama folder (transformers' own class, no keel) with the export's tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    LlamaForCausalLM(config).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(export / name, out / name)
    return out


@pytest.mark.usefixtures("offline_one_thread")
def test_missing_or_truncated_weights_are_one_line(cli_run, tmp_path, capsys):
    """A missing or truncated model.safetensors: an OSError or SafetensorError traceback in
    import-hf, eval --hf and ablate --hf (keel exports and stock Llama folders alike)."""
    export = tmp_path / "hf"
    assert main(["export-hf", "--run", str(cli_run), "--out", str(export)]) == 0
    llama = _llama_folder(export, tmp_path / "llama")
    text = tmp_path / "t.txt"
    text.write_text("def parse(x):\n    return x\n" * 100)
    capsys.readouterr()
    for source in (export, llama):
        for damage in ("missing", "truncated"):
            folder = tmp_path / f"{source.name}-{damage}"
            shutil.copytree(source, folder)
            weights = folder / "model.safetensors"
            if damage == "missing":
                weights.unlink()
            else:
                with open(weights, "r+b") as f:
                    f.truncate(weights.stat().st_size // 2)
            for argv in (["import-hf", "--hf", str(folder), "--out", str(tmp_path / "imported")],
                         ["eval", "--hf", str(folder), "--text", str(text)],
                         ["ablate", "--hf", str(folder), "--text", str(text), "--out", str(tmp_path / "ab")]):
                assert main(argv) == 2, argv
                err = error_lines(capsys)
                wants = (("holds no model weights", "no *.safetensors weights in") if damage == "missing"
                         else ("cannot read the model weights in",))
                assert len(err) == 1 and any(w in err[0] for w in wants) and str(folder) in err[0], (argv, err)
                assert not (tmp_path / "imported").exists()


# --- 11. misleading messages -------------------------------------------------------------------------

def test_a_config_with_a_utf8_bom_is_read(tmp_path):
    """A byte-order mark (as Windows editors write one) was "Invalid statement (line 1, column 1)"."""
    from keel.config import load_config

    path = tmp_path / "bom.toml"
    path.write_bytes("\ufeff[train]\nsteps = 3\n".encode("utf-8"))
    assert load_config(path).train.steps == 3


def test_an_unquoted_dotted_key_in_a_study_scales_set_says_to_quote_it(tmp_path, capsys):
    """`set = { train.warmup_steps = 5 }` (TOML: a nested table) said "needs section.key, got 'train'"."""
    study = tmp_path / "s.toml"
    study.write_text('[groups.g]\nschemes = ["keel"]\n[scales.x]\nset = { train.warmup_steps = 5 }\n'
                     '[scales.x.groups.g]\nsublayers = [2]\nseeds = [0]\nlrs = [1e-3]\n')
    assert main(["study", str(study), "--scale", "x", "--dry-run"]) == 2
    err = error_lines(capsys)
    assert len(err) == 1 and 'quote the dotted key, "train.warmup_steps" = 5' in err[0], err


# --- 10. silent waits --------------------------------------------------------------------------------

def test_gradflow_of_a_deep_model_says_it_is_still_building(tiny_data, monkeypatch, caplog, capsys):
    """`keel gradflow --sublayers 200000` said nothing for 90 s of model building after its first
    line. Here the model build is slowed and "deep" starts at 4 sub-layers."""
    import keel.diagnostics.gradflow as G

    class Slow(G.Transformer):
        def __init__(self, cfg):
            time.sleep(0.5)
            super().__init__(cfg)

    monkeypatch.setattr(G, "Transformer", Slow)
    monkeypatch.setattr(G, "LONG_SUBLAYERS", 4)
    monkeypatch.setattr(G, "HEARTBEAT_S", 0.1, raising=False)
    with caplog.at_level(logging.INFO, logger="keel"):
        assert main(["gradflow", "--residual", "keel", "--sublayers", "4", "--d-model", "32", "--jacobian-iters", "2",
                     "--set", f"data.path={tiny_data}"]) == 0
    assert "gradflow: building the keel model of 4 sub-layers: still working" in caplog.text


def test_generate_streams_its_text_as_it_is_drawn(cli_run, capsys):
    """`keel generate --max-new-tokens 100000` printed nothing for minutes: the text came at the end."""
    from keel.run import Run
    from keel.train.sampling import sample_text

    run = Run(cli_run)
    model, tok = run.load_model(device="cpu"), run.tokenizer()
    forwards, seen = [0], []
    model.register_forward_pre_hook(lambda *a: forwards.__setitem__(0, forwards[0] + 1))
    text = sample_text(model, tok, "def parse(", 40, torch.device("cpu"), seed=3,
                       stream=lambda piece: seen.append((forwards[0], piece)))
    assert seen[0] == (0, "def parse(")  # the prompt, before the first forward pass
    assert len(seen) > 5 and seen[1][0] <= 3  # the continuation from its first tokens on, not at the end
    assert "".join(p for _, p in seen) == text == sample_text(model, tok, "def parse(", 40, torch.device("cpu"),
                                                              seed=3)
    capsys.readouterr()
    assert main(["generate", "--run", str(cli_run), "--prompt", "def parse(", "--max-new-tokens", "40", "--seed", "3",
                 "--temperature", "0.8", "--top-k", "50"]) == 0
    assert capsys.readouterr().out == text + "\n"


def test_a_mistyped_task_is_refused_without_indexing_lm_evals_registry(monkeypatch):
    """`keel eval --tasks` with a typo took 25 s (indexing lm-eval's whole registry) to say "unknown task"."""
    pytest.importorskip("lm_eval")
    import lm_eval.tasks

    from keel.eval.tasks import check_tasks

    real, full = lm_eval.tasks.TaskManager, []

    def recording(*a, include_defaults=True, **k):
        full.append(include_defaults)
        return real(*a, include_defaults=include_defaults, **k)

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", recording)
    with pytest.raises(KeelError, match="task keel_python_completon: unknown task .*did you mean keel_python_completion"):
        check_tasks(["keel_python_completon"])
    assert full == [False]  # the local index only


def test_every_task_of_lm_evals_registry_is_mentioned_in_its_task_folder():
    """What the quick refusal above relies on (keel.eval.tasks._mentioned_by_lm_eval): lm-eval's
    registry is built from the files of its task folder, so each name it holds is written there."""
    pytest.importorskip("lm_eval")
    import lm_eval.tasks
    from lm_eval.tasks import TaskManager

    blob = b"\n".join(p.read_bytes() for p in Path(lm_eval.tasks.__file__).parent.rglob("*")
                      if p.is_file() and "__pycache__" not in p.parts)
    names = TaskManager(include_defaults=True).all_tasks
    assert names and [n for n in names if n.encode() not in blob] == []
