"""Fault injection (issue 11): a training run killed while writing a checkpoint or a metrics
line resumes with no lost or duplicated step, no temporaries left, and exactly the
uninterrupted run's losses.

Deterministic faults raise inside the writer at a chosen point; one test kills a real
training process with SIGKILL (``kill -9``) in the middle of a checkpoint write."""

import os
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest

from conftest import HANG_S, REPO, tiny_overrides
from keel.config import load_config
from keel.train import train
from keel.train import checkpoint as C
from keel.train.metrics import JsonlSink, read_metrics

pytestmark = pytest.mark.spawns  # starts processes: the e2e tier (tests/conftest.py)


class Killed(BaseException):
    """Stands in for a kill: not an Exception, so nothing on the way up handles it."""


def cfg(data):
    return load_config(REPO / "keel" / "configs" / "demo.toml", tiny_overrides(data))


def losses(run):
    return [(r["step"], r.get("loss"), r.get("val_loss"), r.get("lr"), r.get("tokens"))
            for r in read_metrics(run / "metrics.jsonl")]


def no_temporaries(run):
    return not list(run.glob(".*.tmp")) and not list((run / "checkpoints").glob(".*"))


@pytest.fixture
def reference(tiny_reference_run):
    return tiny_reference_run


@pytest.mark.parametrize("point", ["after model.safetensors", "after trainer.pt", "after the manifest",
                                   "before latest"])
def test_kill_during_checkpoint_write(point, reference, tiny_data, tmp_path, monkeypatch, one_thread):
    """Killed while writing the step-8 checkpoint: the resume starts from step 4."""
    run = tmp_path / "run"
    real_save_file, real_torch_save, real_replace = C.save_file, C.torch.save, C.os.replace
    real_atomic = C.atomic_write_text

    def at_step_8(path):
        return "step_00000008" in str(path)

    def save_file(weights, path, metadata=None):
        real_save_file(weights, path, metadata=metadata)
        if point == "after model.safetensors" and at_step_8(path):
            raise Killed

    def torch_save(obj, path):
        real_torch_save(obj, path)
        if point == "after trainer.pt" and at_step_8(path):
            raise Killed

    def replace(src, dst):
        if point == "after the manifest" and at_step_8(dst):
            raise Killed
        real_replace(src, dst)

    def atomic_write_text(path, text):
        if point == "before latest" and "step_00000008" in text:
            raise Killed
        real_atomic(path, text)

    monkeypatch.setattr(C, "save_file", save_file)
    monkeypatch.setattr(C.torch, "save", torch_save)
    monkeypatch.setattr(C.os, "replace", replace)
    monkeypatch.setattr(C, "atomic_write_text", atomic_write_text)
    with pytest.raises(Killed):
        train(cfg(tiny_data), run)
    monkeypatch.undo()
    ckpt, _ = C.CheckpointManager(run).find_intact()
    # "before latest": step 8 was complete (renamed, manifest verified) but latest still said step 4
    assert ckpt.name == ("step_00000008" if point == "before latest" else "step_00000004")
    res = train(cfg(tiny_data), run, resume=True)
    assert res.resumed_from == int(ckpt.name[5:])
    assert losses(run) == losses(reference)
    assert no_temporaries(run)


@pytest.mark.parametrize("cut", [0, 7, -1])
def test_kill_during_metrics_write(cut, reference, tiny_data, tmp_path, monkeypatch, one_thread):
    """Killed while appending the step-10 record (``cut`` characters of it written; -1 = all
    but the newline): the torn line is dropped and steps 9..12 are trained again."""
    run = tmp_path / "run"
    real_write = JsonlSink.write

    def write(self, record):
        if record.get("step") == 10:
            import json

            line = json.dumps(record)
            with open(self.path, "a") as f:
                f.write(line[:cut] if cut >= 0 else line)
            raise Killed
        real_write(self, record)

    monkeypatch.setattr(JsonlSink, "write", write)
    with pytest.raises(Killed):
        train(cfg(tiny_data), run)
    monkeypatch.undo()
    train(cfg(tiny_data), run, resume=True)
    assert losses(run) == losses(reference)
    assert no_temporaries(run)


KILLER = textwrap.dedent('''
    import os, signal, sys
    import torch
    sys.path.insert(0, sys.argv[3])
    from conftest import HANG_S, REPO, tiny_overrides
    from keel.config import load_config
    from keel.train import checkpoint as C, train

    real = C.save_file
    def save_file(weights, path, metadata=None):
        real(weights, path, metadata=metadata)
        if "step_00000008" in str(path):
            os.kill(os.getpid(), signal.SIGKILL)  # kill -9 with model.safetensors written, nothing else
    C.save_file = save_file
    torch.set_num_threads(1)
    train(load_config(REPO / "keel" / "configs" / "demo.toml", tiny_overrides(sys.argv[2])), sys.argv[1])
''')


def test_real_kill_9_during_checkpoint_write(reference, tiny_data, tmp_path, one_thread):
    run = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", KILLER, str(run), str(tiny_data), str(REPO / "tests")],
                          env=env, capture_output=True, text=True, timeout=HANG_S)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    leftovers = list((run / "checkpoints").glob(".step_00000008.*.tmp"))
    assert len(leftovers) == 1 and (leftovers[0] / "model.safetensors").is_file()  # what a kill leaves
    res = train(cfg(tiny_data), run, resume=True)
    assert res.resumed_from == 4
    assert losses(run) == losses(reference)
    assert no_temporaries(run)
    shutil.rmtree(run)
