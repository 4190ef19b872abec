"""Issue "Reliability and cluster v5": keel writes and deletes only what is its own, SIGHUP stops a
run cleanly, files that are not regular files, tracebacks left, silent waits, misleading messages."""

import json
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
    from keel.train.checkpoint import CheckpointManager

    model, run = _tiny_model(), tmp_path / "run"
    first = CheckpointManager(run, keep=1).save(1, model, {"step": 1})
    (first / "hf").mkdir()
    (first / "hf" / "config.json").write_text("{}")
    with caplog.at_level(logging.WARNING, logger="keel"):
        CheckpointManager(run, keep=1).save(2, model, {"step": 2})
    assert sorted(p.relative_to(first).as_posix() for p in first.rglob("*")) == ["hf", "hf/config.json"]
    assert "kept step_00000001" in caplog.text and "hf" in caplog.text
    CheckpointManager(run, keep=1).save(3, model, {"step": 3})  # the folder left is no checkpoint: not pruned again
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
    from keel.train.checkpoint import CheckpointManager

    model, run = _tiny_model(), tmp_path / "run"
    ckpt = CheckpointManager(run).save(1, model, {"step": 1})
    (ckpt / "notes.txt").write_text("mine")
    with pytest.raises(KeelError, match="holds files keel did not write"):
        CheckpointManager(run).save(1, model, {"step": 1})
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


# --- 3. a crash is a failed run, never a result; 6. the local worker pool survives its workers --------

def test_a_full_disk_in_a_grid_is_a_failed_run_that_resume_trains_again(tiny_data, tmp_path, keel_main):
    """A grid run whose checkpoint could not be written ("No space left on device") was recorded as
    `done` with verdict "instability", exit 0, and `--resume` said "0 to run". Here the fault is the
    kernel's own: a file-size limit (`ulimit -f`, EFBIG) below a checkpoint's size, above every other file."""
    import json
    import resource

    from test_run_safety import ENV, KEEL

    out = tmp_path / "sweep"
    sets_ = sum((["--set", s] for s in tiny_overrides(tiny_data, drop=("train.lr",), steps=4, checkpoint_every=2,
                                                      eval_every=2)), [])

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (40_000, resource.RLIM_INFINITY))

    res = subprocess.run([str(KEEL), "sweep", "--grid", "train.lr=1e-3", "--workers", "0", "--out", str(out), *sets_],
                         capture_output=True, text=True, env=ENV, timeout=HANG_S, preexec_fn=small_files)
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    run = out / "lr0.001"
    assert (f"[1/1] lr0.001: error: cannot write the checkpoint of step 2 in {run / 'checkpoints'}: File too large; "
            "last good checkpoint (intact): none") in res.stderr, res.stderr
    assert ("study: 1 run failed, with no result: lr0.001 (the reasons: the lines above, each run's run.log); the "
            "same command with --resume trains them again") in res.stderr, res.stderr
    assert not (run / "result.json").exists()
    assert [r["status"] for r in json.loads((out / "sweep.json").read_text())["runs"]] == ["error"]
    again = keel_main("sweep", "--out", out, "--resume")  # the disk has room again
    assert again.returncode == 0 and "0 finished already, 1 to run" in again.stderr, again.stderr
    runs = json.loads((out / "sweep.json").read_text())["runs"]
    assert [(r["status"], r["verdict"], r["step"]) for r in runs] == [("done", "healthy", 4)]


def _dies_once(job, run_dir, resume) -> dict:
    """Grid task (in a spawned worker): the job "oom" kills its own worker with SIGKILL, as the
    kernel's out-of-memory killer does, the first time it runs."""
    marker = Path(run_dir) / "killed-once"
    if job.name == "oom" and not marker.exists():
        marker.write_text("")
        os.kill(os.getpid(), signal.SIGKILL)
    return {"square": job.values["x"] ** 2}


@pytest.mark.spawns
def test_a_worker_killed_by_sigkill_fails_its_job_only_and_resume_runs_it(tmp_path, caplog):
    """A grid worker killed by SIGKILL gave a BrokenProcessPool traceback and abandoned the rest of the
    grid (the other workers' running jobs included). Now its job is an error naming the signal, a new
    worker takes its place (one worker here: it runs the jobs after it), and `--resume` runs the failed job alone."""
    from keel.experiments.grid import GridJob, run_grid

    jobs = [GridJob(n, {"x": x}, {"x": x}) for x, n in enumerate(["a", "oom", "b", "c", "d"])]
    with caplog.at_level(logging.INFO, logger="keel"):
        res = run_grid(jobs, tmp_path / "g", _dies_once, workers=1, threads=1)
    assert [r["status"] for r in res] == ["done", "error", "done", "done", "done"]
    assert [r.get("square") for r in res] == [0, None, 4, 9, 16]
    why = "its worker process was killed by SIGKILL (as the kernel's out-of-memory killer does); --resume runs it again"
    assert res[1]["message"] == why and any(m.startswith(f"[2/5] oom: error: {why} (") for m in caplog.messages)
    assert not (tmp_path / "g" / "oom" / "result.json").exists()
    assert (tmp_path / "g" / "oom" / "run.log").read_text().splitlines()[-1].endswith(f"oom failed: {why}")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="keel"):
        again = run_grid(jobs, tmp_path / "g", _dies_once, workers=1, threads=1, resume=True)
    assert [r["status"] for r in again] == ["done"] * 5 and again[1]["square"] == 1
    assert any("4 finished already, 1 to run" in m for m in caplog.messages)


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/fd")
def test_no_file_descriptor_left_for_a_worker_is_one_line_and_leaves_nothing(tmp_path):
    """`ulimit -n 12`: an EMFILE traceback from the pool's spawn and a half-written grid folder. Here every
    descriptor but one is taken (a real EMFILE: a worker's pipe needs two)."""
    import resource

    from keel.experiments.grid import GridJob, run_grid

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    limit = max(int(fd) for fd in os.listdir("/proc/self/fd")) + 8
    taken = []
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
    try:
        with pytest.raises(KeelError) as e:
            while True:
                try:
                    taken.append(os.open(os.devnull, os.O_RDONLY))
                except OSError:
                    os.close(taken.pop())  # one left: enough for grid.json, not for a worker's pipe
                    run_grid([GridJob("a", {"x": 1})], tmp_path / "g", _dies_once, workers=1, threads=1)
    finally:
        for fd in taken:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert str(e.value) == (f"cannot start a worker process for the grid: Too many open files (the limit on open "
                            f"files, ulimit -n, is {limit}); raise the limit, or use fewer --workers (0 runs the "
                            "jobs in this process)")
    assert not (tmp_path / "g").exists()  # nothing half-written: its grid.json and folder went again


# --- 9. silent wrongs: two prepares of one folder; an import whose seq_len the model cannot hold --------

def test_two_prepares_of_one_folder_at_once_do_not_both_say_prepared(tmp_path):
    """Two `keel prepare --out O` at once with other tokenizers both said "prepared O" (O held the
    second). Each now waits for the lock of O (held here by the test until both wait); then one
    prepares O and the other refuses O's dataset of other inputs in one line."""
    import json

    from test_run_safety import ENV, KEEL
    from keel.data.prepare import prepare_lock

    out = tmp_path / "O"
    procs, logs = [], []
    with prepare_lock(out):
        for bpe in (300, 400):
            logs.append(tmp_path / f"bpe{bpe}.err")
            with open(logs[-1], "w") as err:
                procs.append(subprocess.Popen([str(KEEL), "prepare", "--source", "builtin:python-stdlib", "--tokenizer",
                                               f"bpe:{bpe}", "--max-bytes", "20000", "--out", str(out)],
                                              stdout=subprocess.DEVNULL, stderr=err, env=ENV))
        deadline = time.monotonic() + HANG_S
        while not all("waiting for keel process" in p.read_text() for p in logs):
            assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, [p.read_text() for p in logs]
            time.sleep(0.1)
        assert not out.exists()
    codes = [p.wait(timeout=HANG_S) for p in procs]
    errs = [p.read_text() for p in logs]
    assert sorted(codes) == [0, 2] and all("Traceback" not in e for e in errs), errs
    won = codes.index(0)
    assert f"prepared {out}" in errs[won] and f"prepared {out}" not in errs[1 - won]
    assert errs[1 - won].strip().splitlines()[-1].startswith(f"keel: error: refusing to replace {out}: it holds a "
                                                             "dataset prepared from other inputs (tokenizer 'bpe:")
    assert json.loads((out / "meta.json").read_text())["tokenizer"] == f"bpe:{(300, 400)[won]}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["O", "bpe300.err", "bpe400.err"]  # no lock file left


@pytest.mark.usefixtures("offline_one_thread")
def test_import_of_a_model_with_fewer_positions_than_seq_len_fits_seq_len(cli_run, tiny_data, tmp_path, capsys):
    """A stock Llama of 64 positions imported with keel's default train.seq_len (128): import said
    "continue with --resume", then the resume refused (seq_len cannot change on resume) and eval blamed
    a --seq-len never given. The import sets seq_len to the model's 64 (said), or refuses one given."""
    from keel.run import load_run

    export = tmp_path / "hf"
    assert main(["export-hf", "--run", str(cli_run), "--out", str(export)]) == 0
    llama = _llama_folder(export, tmp_path / "llama")
    capsys.readouterr()
    run = tmp_path / "imported"
    common = ["import-hf", "--hf", str(llama), "--out", str(run), "--set", f"data.path={tiny_data}"]
    assert main([*common, "--set", "train.seq_len=128"]) == 2
    err = error_lines(capsys)
    assert err == [f"keel: error: train.seq_len=128 exceeds the 64 positions of the model in {llama} "
                   "(max_position_embeddings in its config.json); give train.seq_len <= 64"] and not run.exists()
    assert main([*common, "--set", "train.steps=2", "--set", "train.progress=false"]) == 0
    assert f"train.seq_len: 64, the model's positions (max_position_embeddings in {llama / 'config.json'})" \
        in capsys.readouterr().err
    assert load_run(run).config.train.seq_len == 64
    assert main(["train", "--resume", str(run)]) == 0
    assert main(["eval", "--run", str(run)]) == 0


# --- issue 50: break-trial cases ---------------------------------------------------------------------

@pytest.mark.usefixtures("offline_one_thread")
def test_outputs_inside_a_runs_checkpoints_are_refused_through_a_symlink_too(cli_run, tiny_data, tmp_path, capsys):
    """After `ln -s RUN/checkpoints L`, train --run-dir L/new, prepare / export-hf / import-hf /
    sweep --out L/x all wrote inside RUN/checkpoints; sweep --out RUN/checkpoints/sw wrote grid.json,
    study.json and its reports there before each run failed; plot --out RUN/checkpoints/x.png was written."""
    run = tmp_path / "r"
    shutil.copytree(cli_run, run)
    link = tmp_path / "L"
    link.symlink_to(run / "checkpoints")
    src = tmp_path / "corpus"
    src.mkdir()
    (src / "a.txt").write_text("hello world\n" * 50)
    before = _files(run / "checkpoints")
    sweep = ["sweep", "--grid", "model.residual=keel,pre_ln", *sets(tiny_data, steps=2)]
    for argv, out in ((["train", "--run-dir", str(link / "new"), *sets(tiny_data, steps=2)], link / "new"),
                      (["prepare", "--source", str(src), "--tokenizer", "bpe:300", "--out", str(link / "data")],
                       link / "data"),
                      (["export-hf", "--run", str(run), "--out", str(link / "hf")], link / "hf"),
                      (["import-hf", "--hf", str(tiny_data), "--out", str(link / "imp")], link / "imp"),
                      ([*sweep, "--out", str(link / "sw")], link / "sw"),
                      ([*sweep, "--out", str(run / "checkpoints" / "sw")], run / "checkpoints" / "sw"),
                      (["plot", "loss", str(run), "--out", str(run / "checkpoints" / "x.png")],
                       run / "checkpoints" / "x.png")):
        assert main(argv) == 2, argv
        err = error_lines(capsys)
        assert len(err) == 1 and "inside the checkpoints folder of the run" in err[0], (argv, err)
        assert not out.exists(), argv
    assert _files(run / "checkpoints") == before


def test_resume_at_the_last_step_writes_the_final_files_a_stop_left_out(cli_run, tmp_path, capsys, caplog):
    """SIGTERM (or a full disk) after the last step, before loss.png / sample.txt: --resume said
    "already at step N ... nothing to do" and never wrote them, while `keel runs` listed it finished."""
    run = tmp_path / "r"
    shutil.copytree(cli_run, run)
    (run / "loss.png").unlink()
    (run / "sample.txt").unlink()
    with caplog.at_level(logging.INFO, logger="keel"):
        assert main(["train", "--resume", str(run)]) == 0
    said = [r.getMessage() for r in caplog.records if "already at step 4" in r.getMessage()]
    assert said == [f"{run} is already at step 4 (train.steps = 4): wrote the final files it lacked (loss.png, "
                    "sample.txt); nothing left to train"], said
    assert (run / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (run / "sample.txt").read_text() == (cli_run / "sample.txt").read_text()  # same seed, same model
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="keel"):
        assert main(["train", "--resume", str(run)]) == 0  # nothing lacking now: nothing to do
    assert any("nothing to do" in r.getMessage() for r in caplog.records)


def test_a_run_whose_metrics_jsonl_is_a_fifo_is_refused_not_waited_on(cli_run, tmp_path):
    """metrics.jsonl a FIFO (named pipe): `keel train --resume` and `keel runs DIR` waited for ever."""
    from test_run_safety import ENV, KEEL

    run = tmp_path / "r"
    shutil.copytree(cli_run, run)
    (run / "metrics.jsonl").unlink()
    os.mkfifo(run / "metrics.jsonl")
    said = f"metrics file {run / 'metrics.jsonl'} is not a regular file (a FIFO (named pipe))"
    res = subprocess.run([str(KEEL), "train", "--resume", str(run)], capture_output=True, text=True, env=ENV,
                         timeout=HANG_S)
    err = [ln for ln in res.stderr.splitlines() if ln.strip() and not ln.startswith("resuming ")]
    assert res.returncode == 2 and err == [f"keel: error: {said}"], res.stderr
    res = subprocess.run([str(KEEL), "runs", str(run)], capture_output=True, text=True, env=ENV, timeout=HANG_S)
    assert res.returncode == 0 and res.stderr.splitlines() == [f"skipping {run}: {said}"], res.stderr
    assert res.stdout == f"no runs under {run}\n"


@pytest.mark.usefixtures("offline_one_thread")
def test_an_export_whose_config_json_disagrees_with_its_weights_is_one_line(cli_run, tmp_path, capsys):
    """config.json's n_layers raised over fewer layers' weights: import-hf and eval --hf built the extra
    block at random (exit 0); d_model changed: transformers' RuntimeError traceback."""
    export = tmp_path / "hf"
    assert main(["export-hf", "--run", str(cli_run), "--out", str(export)]) == 0
    text = tmp_path / "t.txt"
    text.write_text("def parse(x):\n    return x\n" * 100)
    config = json.loads((export / "config.json").read_text())
    capsys.readouterr()
    layers, width = config["n_layers"], config["d_model"]
    for key, value, said in (("n_layers", layers + 1, f"config.json says {layers + 1} layers; model.safetensors "
                                                      f"holds weights for {layers}"),
                             ("d_model", width * 2, "model.tok_emb.weight the shape [")):
        folder = tmp_path / f"hf-{key}"
        shutil.copytree(export, folder)
        (folder / "config.json").write_text(json.dumps({**config, key: value}))
        for argv in (["import-hf", "--hf", str(folder), "--out", str(tmp_path / "imported")],
                     ["eval", "--hf", str(folder), "--text", str(text)]):
            assert main(argv) == 2, argv
            err = error_lines(capsys)
            assert len(err) == 1 and said in err[0] and str(folder) in err[0], (argv, err)
            assert not (tmp_path / "imported").exists()


# --- issue 50: the second new-user trial's open cases ---------------------------------------------------------------

@pytest.mark.parametrize("item,said", [
    ("partition=", "--slurm partition= is empty"),
    ("setup=", "--slurm setup= is empty"),
    ("time=99999999", "--slurm time= is in minutes and at most 527040"),
])
def test_empty_or_absurd_slurm_values_are_refused_in_one_line(item, said, tmp_path, keel_main):
    """--slurm partition= (sbatch got --partition=), setup= (dropped without a word) and time=99999999 passed."""
    r = keel_main("sweep", "--grid", "train.lr=1e-3", "--out", tmp_path / "o", "--executor", "slurm", "--dry-run",
                  "--slurm", item)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and said in r.stderr, r.stderr
    assert not (tmp_path / "o").exists()


def test_ablate_stress_and_study_outputs_inside_a_runs_checkpoints_are_refused(cli_run, tmp_path, capsys):
    """`keel ablate / stress / study --out RUN/checkpoints/x` lacked the check train, sweep and plot make."""
    run = tmp_path / "r"
    shutil.copytree(cli_run, run)
    before = _files(run / "checkpoints")
    out = run / "checkpoints" / "x"
    for argv in (["ablate", "--run", str(run), "--tokens", "64", "--out", str(out)],
                 ["stress", "--residual", "keel", "--sublayers", "4", "--seeds", "0", "--dry-run", "--out", str(out)],
                 ["study", "claims", "--scale", "tiny", "--dry-run", "--out", str(out)]):
        assert main(argv) == 2, argv
        err = error_lines(capsys)
        assert len(err) == 1 and "inside the checkpoints folder of the run" in err[0], (argv, err)
        assert not out.exists(), argv
    assert _files(run / "checkpoints") == before


def test_a_grid_value_repeated_in_another_spelling_or_in_a_preset_is_refused(tmp_path, keel_main):
    """--grid model.n_layers=2,2.0 and a preset's grid = {"train.lr" = [1e-3, 1e-3]}: --dry-run counted
    each repeat as one more run (of the same config)."""
    preset = tmp_path / "p.toml"
    preset.write_text('[groups.sweep]\nkind = "grid"\ngrid = {"train.lr" = [1e-3, 0.001]}\n')
    for flags, said in ((["--grid", "model.n_layers=2,2.0"], "--grid model.n_layers repeats a value: '2,2.0'"),
                        (["--preset", str(preset)],
                         f"sweep preset {preset}: study group 'sweep': grid 'train.lr' repeats a value")):
        r = keel_main("sweep", *flags, "--out", tmp_path / "o", "--dry-run")
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and said in r.stderr, r.stderr
        assert not (tmp_path / "o").exists()


def _looped_copy(cli_run, tmp_path) -> Path:
    """A copy of ``cli_run`` whose config says it loops its last block once (loop_repeats 1, prelude 1)."""
    run = tmp_path / "looped"
    shutil.copytree(cli_run, run)
    text = (run / "config.toml").read_text()
    assert "\nloop_core = 0\n" in text
    text = text.replace("\nloop_core = 0\n", "\nloop_core = 1\n", 1).replace("\nloop_prelude = 0\n", "\nloop_prelude = 1\n")
    (run / "config.toml").write_text(text)
    return run


@pytest.mark.parametrize("command", ["eval", "generate"])
def test_an_absurd_loops_count_is_refused_in_one_line(command, cli_run, tmp_path, keel_main):
    """`keel eval / generate --loops 100000000` ran silently for hours: at most max(64, 16 x loop_repeats)."""
    run = _looped_copy(cli_run, tmp_path)
    r = keel_main(command, "--run", run, "--loops", 65, *(["--max-new-tokens", 1] if command == "generate" else []))
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"keel: error: --loops must be at most 64 (max(64, 16 x model.loop_repeats (1) = 16) for {run}), got 65: each "
        "token would apply the core 65 times"], r.stderr
    assert "at most max(64, 16 x model.loop_repeats)" in " ".join(keel_main(command, "--help").stdout.split())


def test_plot_out_overwrites_only_a_plot_keel_wrote(cli_run, tmp_path, capsys):
    """`keel plot loss RUN --out photo.png` replaced someone's photo.png (and gradflow --plot the same)."""
    photo = tmp_path / "photo.png"
    photo.write_bytes(b"\x89PNG\r\n\x1a\n my holiday")
    for argv in (["plot", "loss", str(cli_run), "--out", str(photo)],
                 ["gradflow", "--residual", "keel", "--sublayers", "4", "--plot", str(photo)]):
        assert main(argv) == 2, argv
        err = error_lines(capsys)
        assert len(err) == 1 and "exists and is not a plot keel wrote" in err[0] and str(photo) in err[0], err
        assert photo.read_bytes() == b"\x89PNG\r\n\x1a\n my holiday"
    for name in ("mine.png", "mine.svgz", "mine.pdf"):  # keel's own plot: overwritten, as before
        out = tmp_path / name
        for _ in range(2):
            assert main(["plot", "loss", str(cli_run), "--out", str(out)]) == 0
        assert out.is_file()
    jpg = tmp_path / "mine.jpg"
    assert main(["plot", "loss", str(cli_run), "--out", str(jpg)]) == 0
    before = jpg.read_bytes()
    assert main(["plot", "loss", str(cli_run), "--out", str(jpg)]) == 2  # a .jpg carries no mark: not overwritten
    assert "a .jpg file carries no mark of keel's" in error_lines(capsys)[-1] and jpg.read_bytes() == before


def _started_study(tmp_path, tiny_data, keel_main):
    """A one-run study trained into ``tmp_path/o`` with --set flags: (study file, folder, the flags)."""
    study = tmp_path / "s.toml"
    study.write_text('[groups.g]\nschemes = ["keel"]\n[scales.x.groups.g]\nsublayers = [2]\nseeds = [0]\nlrs = [1e-3]\n')
    sets = [a for s in (f"data.path={tiny_data}", "train.steps=2", "train.batch_size=2", "train.seq_len=16",
                        "train.eval_every=2", "train.eval_tokens=64", "train.sample_tokens=0", "model.d_model=16",
                        "model.d_ff=32") for a in ("--set", s)]
    out = tmp_path / "o"
    assert keel_main("study", study, "--scale", "x", "--out", out, "--workers", 0, *sets).returncode == 0
    return study, out, sets


def test_study_resume_keeps_the_sets_it_was_started_with(tmp_path, tiny_data, keel_main):
    """`keel study S --out D --resume` dropped the --set flags the study started with (keel sweep kept
    them): it was refused as "started with other settings" or would train with other keys."""
    study, out, sets = _started_study(tmp_path, tiny_data, keel_main)
    r = keel_main("study", study, "--scale", "x", "--out", out, "--resume")
    assert r.returncode == 0, r.stderr
    assert json.loads((out / "report.json").read_text())["runs"][0]["status"] == "done"
    r = keel_main("study", study, "--scale", "x", "--out", out, "--resume", "--set", "train.steps=3")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "other settings (train.steps)" in r.stderr, r.stderr


def test_study_report_only_keeps_the_sets_it_was_started_with(tmp_path, tiny_data, keel_main):
    """`keel study S --out D --report-only` (which refuses --set) rewrote report.json with no `sets`, though
    the runs were trained with the folder's --set flags: a later --restore of it with those flags was refused
    as "trained with other settings", and one without them restored runs onto other settings."""
    study, out, sets = _started_study(tmp_path, tiny_data, keel_main)
    started = json.loads((out / "report.json").read_text())["sets"]
    r = keel_main("study", study, "--scale", "x", "--out", out, "--report-only")
    assert r.returncode == 0, r.stderr
    assert json.loads((out / "report.json").read_text())["sets"] == started
    r = keel_main("study", study, "--scale", "x", "--out", tmp_path / "r", "--report-only",
                  "--restore", out / "report.json", *sets)
    assert r.returncode == 0, r.stderr


def test_prepare_removes_the_build_folders_of_killed_preparations_only(tmp_path, caplog):
    """`keel prepare` killed by SIGKILL left OUT.tmp-PID behind, and no later prepare removed it."""
    src = tmp_path / "corpus"
    src.mkdir()
    (src / "a.txt").write_text("hello world, a small corpus\n" * 40)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    out = tmp_path / "data"
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    stale, live, foreign = (tmp_path / f"data.tmp-{dead.pid}", tmp_path / f"data.tmp-{alive.pid}",
                            tmp_path / "other.tmp-7")
    for folder in (stale, live, foreign):
        folder.mkdir()
        (folder / "train.docs").write_bytes(b"half")
    mine = tmp_path / f"data.tmp-{dead.pid + 1000000}"  # a dead PID, but a file keel does not write there
    mine.mkdir()
    (mine / "notes.txt").write_text("mine\n")
    try:
        with caplog.at_level(logging.INFO, logger="keel"):
            assert main(["prepare", "--source", str(src), "--tokenizer", "bpe:300", "--out", str(out)]) == 0
    finally:
        alive.kill()
        alive.wait()
    assert (out / "meta.json").is_file() and not stale.exists()
    assert live.is_dir() and foreign.is_dir() and (mine / "notes.txt").read_text() == "mine\n"
    said = [r.getMessage() for r in caplog.records if "removed" in r.getMessage()]
    assert said == [f"removed {stale}, left by keel prepare process {dead.pid}, which was killed before it finished"]


def test_too_many_open_files_in_the_data_loader_is_one_line(tiny_data, tmp_path, monkeypatch, capsys):
    """`ulimit -n 5; keel train`: the EMFILE of np.memmap in keel/data/loader.py was a traceback."""
    import errno

    import keel.data.loader as loader

    def emfile(path):
        raise OSError(errno.EMFILE, os.strerror(errno.EMFILE), str(path))

    monkeypatch.setattr(loader, "read_shard", emfile)
    assert main(["train", "--run-dir", str(tmp_path / "run"), *sets(tiny_data, steps=2)]) == 2
    err = error_lines(capsys)
    assert len(err) == 1 and err[0].startswith("keel: error: Too many open files (the limit on open files, ulimit -n, "
                                               "is "), err
    assert "train.bin" in err[0] and err[0].endswith("raise it (e.g. ulimit -n 4096) and run it again"), err


def test_ctrl_c_during_the_interpreters_exit_is_no_traceback(tmp_path):
    """Ctrl-C while `keel export-hf` ran its exit handlers (torch's, transformers') printed
    "Exception ignored in atexit callback" and a KeyboardInterrupt traceback. Here an exit handler
    of the process's own stands in for them: it is interrupted as they were."""
    code = ("import atexit, os, signal, sys, time\n"
            "atexit.register(lambda: (os.kill(os.getpid(), signal.SIGINT), time.sleep(5)))\n"
            "from keel.cli import main\n"
            "sys.exit(main())\n")
    res = subprocess.run([sys.executable, "-c", code, "runs", str(tmp_path)], capture_output=True, text=True,
                         timeout=HANG_S, env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert "Traceback" not in res.stderr and "KeyboardInterrupt" not in res.stderr, res.stderr
    assert res.returncode == -signal.SIGINT and res.stdout == f"no runs under {tmp_path}\n", res


def test_non_utf8_paths_and_values_are_refused_in_one_line_and_corpus_file_names_are_read(tiny_data, tmp_path,
                                                                                           capsys):
    """A path or --set value with byte 0xff (not UTF-8): UnicodeEncodeError tracebacks in prepare, in
    config.toml's writer and in keel sweep, and a run folder that trained but could not be resumed.
    A corpus file so named (not a path keel records) is read: its fingerprint was the traceback."""
    ff = os.fsdecode(b"\xff")
    src = tmp_path / "corpus"
    src.mkdir()
    (src / f"{ff}.txt").write_text("hello world, a small corpus\n" * 40)
    for argv, made in ((["train", "--run-dir", str(tmp_path / f"run{ff}"), *sets(tiny_data, steps=2)], f"run{ff}"),
                       (["train", "--run-dir", str(tmp_path / "r"), *sets(tiny_data, steps=2), "--set",
                         f"data.text_field={ff}"], "r"),
                       (["prepare", "--source", str(src), "--tokenizer", "bpe:300", "--out", str(tmp_path / f"d{ff}")],
                        f"d{ff}"),
                       (["sweep", "--grid", "train.lr=1e-3", "--out", str(tmp_path / f"sw{ff}"), *sets(tiny_data, steps=2)],
                        f"sw{ff}")):
        assert main(argv) == 2, argv
        err = error_lines(capsys)
        assert len(err) == 1 and err[0].startswith("keel: error: the argument ") and "b'" in err[0] and \
            "\\xff" in err[0] and "is not UTF-8 text" in err[0], err
        assert not (tmp_path / made).exists()
    assert main(["prepare", "--source", str(src), "--tokenizer", "bpe:300", "--out", str(tmp_path / "d")]) == 0
    assert main(["prepare", "--source", str(src), "--tokenizer", "bpe:300", "--out", str(tmp_path / "d")]) == 0
    assert "reusing cached dataset" in capsys.readouterr().err


# --- issue 50: the third new-user trial ----------------------------------------------------------------------------

def test_ablate_writes_only_into_a_new_or_empty_folder_or_its_own_ablation(cli_run, tmp_path, capsys):
    """`keel ablate --out DIR` overwrote the user's DIR/ablate.md, ablate.json and ablate.png (a text file),
    wrote into a folder of unrelated files (an HF export), and the default RUN/ablate/ablate.md (the
    user's notes) was overwritten: each is refused before the ablation, in one line naming the file."""
    run = tmp_path / "r"
    shutil.copytree(cli_run, run)
    cases = {"mine": {"ablate.md": "MY OWN DATA\n", "ablate.json": '{"mine": 1}\n'},
             "fa": {"ablate.png": "my text, not a plot\n"},
             "export": {"config.json": "{}\n", "model.safetensors": "x"}}
    for name, files in cases.items():
        (tmp_path / name).mkdir()
        for f, text in files.items():
            (tmp_path / name / f).write_text(text)
    (run / "ablate").mkdir()
    (run / "ablate" / "ablate.md").write_text("my notes\n")
    for out, foreign in ((tmp_path / "mine", "ablate.json, ablate.md"), (tmp_path / "fa", "ablate.png"),
                         (tmp_path / "export", "config.json, model.safetensors"), (None, "ablate.md")):
        argv = ["ablate", "--run", str(run), "--tokens", "64", *(["--out", str(out)] if out else [])]
        assert main(argv) == 2, argv
        err = error_lines(capsys)
        assert len(err) == 1 and f"holds {foreign}, which keel did not write" in err[0], err
    for name, files in cases.items():
        assert {f.name: f.read_text() for f in (tmp_path / name).iterdir()} == files
    assert [f.name for f in (run / "ablate").iterdir()] == ["ablate.md"]
    assert (run / "ablate" / "ablate.md").read_text() == "my notes\n"
    (run / "ablate" / "ablate.md").unlink()
    for _ in range(2):  # keel's own ablation (the default folder, then --out): written again
        assert main(["ablate", "--run", str(run), "--tokens", "64"]) == 0
        assert sorted(f.name for f in (run / "ablate").iterdir()) == ["ablate.json", "ablate.md", "ablate.png"]


def _files_and_bytes(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_checkpoint_folder_holding_foreign_files_is_refused_before_training(cli_run, tmp_path, capsys):
    """`keel train --resume RUN --restart` with the user's my.txt in RUN/checkpoints/step_N (N = train.steps)
    warned, trained every step, then exited 2 unable to write the final checkpoint: now one line first,
    nothing deleted, nothing trained. A resume whose later checkpoint folder holds such a file: the same."""
    run = tmp_path / "r"
    shutil.copytree(cli_run, run)
    final = run / "checkpoints" / "step_00000004"
    (final / "my.txt").write_text("mine\n")
    before = _files_and_bytes(run)
    assert main(["train", "--resume", str(run), "--restart"]) == 2
    err = error_lines(capsys)
    assert len(err) == 1 and f"its checkpoint folder {final} holds files keel did not write (my.txt)" in err[0], err
    assert _files_and_bytes(run) == before  # metrics and checkpoints as they were
    for f in final.iterdir():  # the final checkpoint's own files gone (its write failed): a resume from step 2
        if f.name != "my.txt":
            f.unlink()
    assert main(["train", "--resume", str(run)]) == 2
    err = error_lines(capsys)
    assert err[-1].startswith("keel: error: cannot train") and "holds files keel did not write (my.txt)" in err[-1], err
    assert not any(ln.startswith("step ") for ln in err)  # nothing trained
    (final / "my.txt").unlink()
    assert main(["train", "--resume", str(run)]) == 0
    assert (final / "model.safetensors").is_file()


def test_runs_calls_a_run_finished_only_with_its_final_checkpoint(cli_run, tmp_path, capsys):
    """`keel runs` listed a run as `4/4 finished` whose step-4 checkpoint was missing (its write had
    failed; `keel train --resume` retrains from step 2): it is stopped."""
    run = tmp_path / "r"
    shutil.copytree(cli_run, run)
    capsys.readouterr()
    assert main(["runs", str(run), "--json"]) == 0
    assert [(r["step"], r["status"]) for r in json.loads(capsys.readouterr().out)] == [(4, "finished")]
    shutil.rmtree(run / "checkpoints" / "step_00000004")
    assert main(["runs", str(run), "--json"]) == 0
    assert [(r["step"], r["status"]) for r in json.loads(capsys.readouterr().out)] == [(4, "stopped")]
    from keel.run import Run
    assert Run(run).saved_step() == 2


def test_a_sigterm_a_library_swallowed_still_ends_the_command_as_stopped(monkeypatch, capsys):
    """Case 242: a SIGTERM 3 s into `keel eval --tasks` was ignored once in 9 tries (exit 0, results
    printed): the exception keel's handler raises was caught by library code (a bare `except:`) that
    went on. The command now exits 143 and says so, whatever the library did with the exception."""
    import keel.cli as cli

    def swallowing_handler(args):
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises here
        except BaseException:  # noqa: BLE001 -- what the library did
            pass
        print("results")
        return 0

    monkeypatch.setattr(cli, "run_handler", swallowing_handler)
    assert cli.main(["runs", "."]) == 143
    out = capsys.readouterr()
    assert out.out == "results\n"
    assert out.err.strip().splitlines() == [
        "keel: stopped by SIGTERM (a library caught the signal and went on: the output above is complete)"]
    assert signal.getsignal(signal.SIGTERM) is not cli._terminated  # restored after the command


# --- issue 50: the fourth new-user trial ---

def test_a_plot_never_replaces_a_runs_own_loss_plot(cli_run, tmp_path, capsys):
    """`keel gradflow --run R --plot R/loss.png` and `keel plot loss OTHER --out R/loss.png` replaced
    run R's own loss curve (a keel plot, so the mark check passed): R then showed another run's curve."""
    run = tmp_path / "r"
    shutil.copytree(cli_run, run)
    own = run / "loss.png"
    before = own.read_bytes()
    for argv, flag in ((["plot", "loss", str(cli_run), "--out", str(own)], "--out"),
                       (["gradflow", "--run", str(run), "--plot", str(own)], "--plot")):
        assert main(argv) == 2, argv
        assert error_lines(capsys) == [f"keel: error: {own} is run {run}'s own loss plot; choose another {flag}"]
    assert own.read_bytes() == before
    from keel.train.plots import check_plot_out
    with pytest.raises(KeelError, match=r"is run .*'s own config; choose another --out"):
        check_plot_out(run / "config.toml")  # any file of the run's layout
    free = tmp_path / "not-a-run" / "loss.png"  # the same name outside a run: written, and overwritten
    for _ in range(2):
        assert main(["plot", "loss", str(run), "--out", str(free)]) == 0
    assert free.is_file()


def test_ablate_hf_needs_out(tmp_path, capsys):
    """`keel ablate --hf MODEL_DIR` wrote MODEL_DIR/ablate, inside a (maybe downloaded) folder keel did not create."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    before = sorted(p.name for p in model.iterdir())
    assert main(["ablate", "--hf", str(model), "--tokens", "8"]) == 2
    assert error_lines(capsys) == ["keel: error: ablate --hf needs --out: keel writes only into new folders or its own runs"]
    assert sorted(p.name for p in model.iterdir()) == before
    with pytest.raises(SystemExit):
        main(["ablate", "--help"])
    assert "required with --hf" in " ".join(capsys.readouterr().out.split())


def test_plot_loss_of_a_folder_keel_did_not_write_reads_nothing(tmp_path, capsys, caplog):
    """`keel plot loss DIR` with a foreign DIR/metrics.jsonl ("x") first logged "dropping a partial last
    line (a write was interrupted)" about a file keel never wrote, then refused."""
    d = tmp_path / "d"
    d.mkdir()
    (d / "metrics.jsonl").write_text("x")
    with caplog.at_level(logging.DEBUG):
        assert main(["plot", "loss", str(d), "--out", str(tmp_path / "o.png")]) == 2
    assert error_lines(capsys) == [f"keel: error: {d} is not a keel run (no config.toml)"]
    assert "partial" not in caplog.text
    assert not (tmp_path / "o.png").exists()
