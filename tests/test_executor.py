"""Where a grid's runs go (keel.experiments.executor): GPUs per local worker, Slurm parameters,
submitit's local executor end to end (sweep and study), its job ledger, and a preempted job that
requeues itself and resumes to the uninterrupted run's losses."""

from __future__ import annotations

import json
import shlex
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import HANG_S, tiny_overrides
from keel.config import load_config
from keel.errors import KeelError
from keel.experiments import executor as E
from keel.experiments import grid as G
from keel.train import train as train_run
from keel.train.metrics import read_metrics

pytestmark = pytest.mark.spawns  # starts processes: the e2e tier (tests/conftest.py)

REPO = Path(__file__).resolve().parents[1]
KEEL = Path(sys.executable).parent / "keel"


# ---------------------------------------------------------------- GPUs per local worker
@pytest.mark.parametrize("workers,per_run,count,share,expected", [
    (2, 1, 4, False, ["0", "1"]),
    (2, 2, 4, False, ["0,1", "2,3"]),
    (4, 2, 8, False, ["0,1", "2,3", "4,5", "6,7"]),
    (3, 1, 2, True, ["0", "1", "0"]),  # shared round robin
    (3, 2, 5, True, ["0,1", "2,3", "0,1"]),  # 5 GPUs hold two 2-GPU slots
    (2, 1, 0, False, [None, None]),  # no GPU: the CPU, nothing set
])
def test_each_local_worker_gets_its_own_gpus(workers, per_run, count, share, expected):
    assert E.assign_devices(workers, per_run, count, share) == expected


@pytest.mark.parametrize("workers,per_run,count,match", [
    (3, 1, 2, "3 workers x 1 GPU.* need 3 GPUs but this machine has 2; .*--share-gpus"),
    (2, 2, 3, "need 4 GPUs but this machine has 3"),
    (1, 4, 2, "each run needs 4 GPU.* this machine has 2"),
])
def test_more_workers_than_gpus_is_refused_unless_shared(workers, per_run, count, match):
    with pytest.raises(KeelError, match=match):
        E.assign_devices(workers, per_run, count)


def record_devices(job, run_dir, resume) -> dict:
    """Grid task: what this worker sees (runs in a spawned worker)."""
    time.sleep(0.5)  # both workers get a job
    return {"devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "pid": os.getpid()}


def test_local_workers_see_their_devices_with_a_faked_gpu_count(monkeypatch, tmp_path):
    """With 4 (faked) GPUs, 2 workers and 2 GPUs per run, each worker's jobs see its own pair."""
    monkeypatch.setattr(G, "gpu_count", lambda: 4)
    jobs = [G.GridJob(f"j{i}", {"i": i}) for i in range(4)]
    res = G.run_grid(jobs, tmp_path, record_devices, workers=2, threads=1, executor=E.Executor(gpus_per_run=2))
    by_pid: dict[int, set] = {}
    for r in res:
        by_pid.setdefault(r["pid"], set()).add(r["devices"])
    assert len(by_pid) == 2  # two workers ran the four jobs
    assert sorted(d for seen in by_pid.values() for d in seen) == ["0,1", "2,3"]  # one pair each, never shared
    with pytest.raises(KeelError, match="need 6 GPUs but this machine has 4"):
        G.run_grid(jobs, tmp_path / "x", record_devices, workers=3, executor=E.Executor(gpus_per_run=2))
    assert not (tmp_path / "x").exists()  # refused before anything was written


# ---------------------------------------------------------------- Slurm parameters
def test_slurm_parameters_map_to_submitit_and_sbatch():
    ex = E.Executor("slurm", E.parse_slurm(["partition=gpu", "account=lab", "time=120", "gpus=8", "nodes=2",
                                            "qos=high", "exclusive=", "mail-type=END"]), gpus_per_run=2)
    assert E.slurm_parameters(ex) == {
        "timeout_min": 120, "tasks_per_node": 2, "gpus_per_node": 8, "slurm_partition": "gpu", "slurm_account": "lab",
        "nodes": 2,
        "slurm_qos": "high", "slurm_additional_parameters": {"exclusive": "", "mail-type": "END"}}
    # without gpus=, a Slurm job asks for the GPUs of a run; the time limit defaults to a day
    assert E.slurm_parameters(E.Executor("slurm", gpus_per_run=4)) == {"timeout_min": 1440, "gpus_per_node": 4,
                                                                       "tasks_per_node": 4}
    assert E.slurm_parameters(E.Executor("slurm", {"gpus": "0"})) == {"timeout_min": 1440}  # a CPU partition


@pytest.mark.parametrize("args,match", [
    (["--slurm", "partition"], "--slurm takes KEY=VALUE"),
    (["--slurm", "time=abc"], "--slurm time= must be a whole number >= 1, got 'abc'"),
    (["--slurm", "nodes=0"], "--slurm nodes= must be a whole number >= 1"),
    (["--slurm", "time=5", "--slurm", "time=6"], "--slurm time is given twice"),
    (["--executor", "local", "--slurm", "time=5"], "use it with --executor slurm"),
    (["--gpus-per-run", "0"], "--gpus-per-run must be >= 1"),
])
def test_bad_executor_flags_are_one_line_errors(args, match, tmp_path, capsys):
    from keel.cli import main

    full = ["--executor", "slurm", *args] if "--executor" not in args else args
    assert main(["sweep", "--grid", "train.lr=1e-3", "--out", str(tmp_path / "o"), *full]) == 2
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and re.search(match, err), err
    assert not (tmp_path / "o").exists()


@pytest.mark.skipif(shutil.which("sbatch") is not None, reason="Slurm is installed here")
def test_executor_slurm_without_slurm_is_one_line_and_writes_nothing(tmp_path, capsys):
    """submitit's `Could not detect "srun"` traceback came after study.json and grid.json were written."""
    from keel.cli import main

    assert main(["sweep", "--grid", "train.lr=1e-3", "--out", str(tmp_path / "o"), "--executor", "slurm"]) == 2
    assert capsys.readouterr().err == ("keel: error: --executor slurm needs Slurm (sbatch is not on PATH here); run on a "
                                       "Slurm login node, or use --executor local or submitit-local\n")
    assert not (tmp_path / "o").exists()
    assert main(["sweep", "--grid", "train.lr=1e-3", "--out", str(tmp_path / "o"), "--executor", "slurm",
                 "--dry-run"]) == 0  # planning needs no Slurm


# ---------------------------------------------------------------- submitit's local executor
def _sets(tiny_data, **train) -> list[str]:
    return sum((["--set", s] for s in tiny_overrides(tiny_data, **train)), [])


def _keel(*args, **kw):
    return subprocess.run([str(KEEL), *map(str, args)], capture_output=True, text=True, timeout=HANG_S, **kw)


def test_sweep_through_submitit_local_keeps_a_ledger_and_never_submits_twice(tiny_data, tmp_path, keel_main):
    out = tmp_path / "sweep"
    args = ["sweep", *_sets(tiny_data, drop=("train.lr",)), "--grid", "train.lr=1e-3,3e-3", "--out", out,
            "--executor", "submitit-local", "--workers", "2", "--threads", "1"]
    r = _keel(*args)
    assert r.returncode == 0, r.stderr
    ledger = json.loads((out / "jobs.json").read_text())
    assert ledger["executor"] == "submitit-local" and set(ledger["jobs"]) == {"lr0.001", "lr0.003"}
    assert all(j["state"] == "done" and j["attempts"] == 1 for j in ledger["jobs"].values())
    for name in ("lr0.001", "lr0.003"):  # a status line per state change, naming the job
        job = ledger["jobs"][name]["job_id"]
        assert f"  {name}: queued (job {job})" in r.stderr and f"  {name}: done (job {job})" in r.stderr
    sweep = json.loads((out / "sweep.json").read_text())
    assert [x["status"] for x in sweep["runs"]] == ["done", "done"]
    # the same training as a local worker: the losses of a run equal a plain keel train's
    assert _losses(out / "lr0.001") == _losses(_plain_run(tiny_overrides(tiny_data, lr=1e-3), tmp_path / "plain"))
    again = keel_main(*args, "--resume")  # nothing to submit: no process of its own needed
    assert again.returncode == 0 and "0 to run" in again.stderr and "queued" not in again.stderr
    assert json.loads((out / "jobs.json").read_text()) == ledger


def _plain_run(sets: list[str], run: Path) -> Path:
    """The same run trained uninterrupted in this process, on one thread (as a grid job runs)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train_run(load_config(REPO / "keel" / "configs" / "demo.toml", sets), run)
    finally:
        torch.set_num_threads(n)
    return run


def _losses(run: Path) -> list:
    return [(m["step"], m["loss"]) for m in read_metrics(run / "metrics.jsonl") if "loss" in m]


def test_resume_waits_for_a_job_still_running_and_resubmits_one_that_ended_without_a_result(tiny_data, tmp_path):
    """The ledger names a job whose process still runs: --resume waits for it instead of submitting
    the run again; it ends without a result (here: it was not a keel job), so the run is an error;
    the next --resume submits it again, with a note, and it finishes."""
    out = tmp_path / "sweep"
    args = ["sweep", *_sets(tiny_data), "--grid", "train.seed=0", "--out", out, "--executor", "submitit-local",
            "--threads", "1"]
    out.mkdir()
    command = shlex.join(["keel", *map(str, args)])  # started by this very command
    (out / "study.json").write_text(json.dumps({"study": "sweep", "scale": "cli", "command": command}))
    flag = tmp_path / "end"  # the stand-in runs until the driver has re-attached to it (then a zombie until reaped)
    stand_in = subprocess.Popen(["bash", "-c", f"while [ ! -e {flag} ]; do sleep 0.1; done"])
    (out / "jobs.json").write_text(json.dumps({"executor": "submitit-local", "jobs": {
        "seed0": {"job_id": str(stand_in.pid), "attempts": 1, "state": "running"}}}))
    driver = subprocess.Popen([str(KEEL), *map(str, args), "--resume"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + HANG_S
    while "updated" not in json.loads((out / "jobs.json").read_text())["jobs"]["seed0"]:  # the driver noted it
        assert driver.poll() is None and time.monotonic() < deadline, driver.communicate()
        time.sleep(0.1)
    flag.touch()
    _, err = driver.communicate(timeout=HANG_S)
    stand_in.wait()
    r = subprocess.CompletedProcess(driver.args, driver.returncode, "", err)
    assert r.returncode == 1, r.stderr  # the run failed
    assert f"  seed0: running (job {stand_in.pid})" in r.stderr and "submitting it again" not in r.stderr
    assert f"job {stand_in.pid} ended without a result" in r.stderr
    r = _keel(*args, "--resume")
    assert r.returncode == 0, r.stderr
    assert f"seed0: job {stand_in.pid} ended (failed) without a result: submitting it again" in r.stderr
    entry = json.loads((out / "jobs.json").read_text())["jobs"]["seed0"]
    assert entry["attempts"] == 2 and entry["state"] == "done" and entry["job_id"] != str(stand_in.pid)


@pytest.mark.skipif(sys.platform != "linux", reason="finds the job's process in /proc")
def test_a_preempted_job_checkpoints_requeues_itself_and_resumes_to_the_uninterrupted_losses(tiny_data, tmp_path):
    """SIGUSR2 (what submitit asks Slurm for before a time limit) to the job's process mid-run: the
    trainer finishes its step and checkpoints, submitit requeues the job with resume=True, and the
    run continues from that step; its losses equal an uninterrupted run's."""
    train = dict(steps=60, eval_every=30, checkpoint_every=1000, seed=0)
    out = tmp_path / "sweep"
    args = ["sweep", *_sets(tiny_data, drop=("train.seed",), **train), "--grid", "train.seed=0", "--out", out,
            "--executor", "submitit-local", "--threads", "1"]
    proc = subprocess.Popen([str(KEEL), *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        metrics, deadline = out / "seed0" / "metrics.jsonl", time.monotonic() + HANG_S
        while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 20):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        controller = json.loads((out / "jobs.json").read_text())["jobs"]["seed0"]["job_id"]
        job_proc = int(Path(f"/proc/{controller}/task/{controller}/children").read_text().split()[0])
        os.kill(job_proc, signal.SIGUSR2)
        _, err = proc.communicate(timeout=HANG_S)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    log = (out / "seed0" / "run.log").read_text()
    assert "SIGUSR2 received: stopping after this step" in log
    step = int(log.split("resuming ")[1].split("from step ")[1].split()[0])
    assert 0 < step < 60 and (out / "seed0" / "checkpoints" / f"step_{step:08d}").is_dir()
    sub = "".join(p.read_text() for p in (out / "submitit").glob("*_log.out"))
    assert "Calling checkpoint method" in sub and f"Requeued job {controller}" in sub
    plain = _losses(_plain_run(tiny_overrides(tiny_data, **train), tmp_path / "plain"))
    assert _losses(out / "seed0") == plain and len(plain) == 60


def test_a_tiny_study_completes_through_submitit_local(tiny_data, tmp_path, keel_main):
    out = tmp_path / "study"
    args = ["study", "claims", "--scale", "tiny", "--groups", "showcase", "--out", out, "--set",
            f"data.path={tiny_data}", "--executor", "submitit-local", "--workers", "2", "--threads", "1"]
    r = _keel(*args)
    assert r.returncode == 0, r.stderr
    rep = json.loads((out / "report.json").read_text())
    runs = [x for x in rep["runs"] if x["group"] == "showcase"]
    assert sorted(x["scheme"] for x in runs) == ["keel", "post_ln", "pre_ln"]
    assert all(x["status"] == "done" and x["final_val_loss"] > 0 for x in runs)
    ledger = json.loads((out / "showcase" / "jobs.json").read_text())["jobs"]
    assert len(ledger) == 3 and all(j["state"] == "done" and j["attempts"] == 1 for j in ledger.values())
    again = keel_main(*args, "--resume")
    assert again.returncode == 0 and "queued" not in again.stderr, again.stderr


def test_a_run_on_two_processes_is_one_job_of_two_tasks(tiny_data, tmp_path):
    """--gpus-per-run 2: each run is a job of 2 tasks that join one process group as torchrun's
    workers would (here 2 CPU processes, gloo, DDP); rank 0 writes the result; the trajectory equals
    the one-process run with the same global batch (4 sequences per step)."""
    out = tmp_path / "sweep"
    two = dict(batch_size=2, grad_accum=2, parallelism="ddp", steps=8)
    r = _keel("sweep", *_sets(tiny_data, **two), "--grid", "train.seed=0", "--out", out,
              "--executor", "submitit-local", "--gpus-per-run", "2", "--threads", "1")
    assert r.returncode == 0, r.stderr
    assert "world size 2 (ddp" in (out / "seed0" / "run.log").read_text()
    assert len(list((out / "submitit").glob("*_1_log.out"))) == 1  # the second task's log: one job, two tasks
    plain = _losses(_plain_run(tiny_overrides(tiny_data, steps=8, seed=0), tmp_path / "plain"))
    got = _losses(out / "seed0")
    assert [s for s, _ in got] == [s for s, _ in plain] == list(range(1, 9))
    assert [v for _, v in got] == pytest.approx([v for _, v in plain], rel=1e-5)
