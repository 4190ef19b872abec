"""Where a grid's runs go (keel.experiments.executor): GPUs per local worker, Slurm parameters,
submitit's local executor end to end (sweep and study), its job ledger, and a preempted job that
requeues itself and resumes to the uninterrupted run's losses."""

from __future__ import annotations

import json
import shlex
import os
import re
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
        "slurm_qos": "high", "slurm_additional_parameters": {"exclusive": True, "mail-type": "END"}}
    # without gpus=, a Slurm job asks for the GPUs of a run; the time limit defaults to a day
    assert E.slurm_parameters(E.Executor("slurm", gpus_per_run=4)) == {"timeout_min": 1440, "gpus_per_node": 4,
                                                                       "tasks_per_node": 4}
    assert E.slurm_parameters(E.Executor("slurm", {"gpus": "0"})) == {"timeout_min": 1440}  # a CPU partition


@pytest.mark.parametrize("args,match", [
    (["--slurm", "partition"], "--slurm takes KEY=VALUE"),
    (["--slurm", "time=abc"], "--slurm time= must be a whole number >= 1, got 'abc'"),
    (["--slurm", "nodes=0"], "--slurm nodes= must be a whole number >= 1"),
    (["--slurm", "time=5", "--slurm", "time=6"], "--slurm time is given twice"),
    (["--slurm", "Partition=gpu"], "--slurm Partition=: Slurm's option names are lower case; did you mean partition=\\?"),
    (["--executor", "local", "--slurm", "time=5"], "use it with --executor slurm"),
    (["--gpus-per-run", "0"], "--gpus-per-run must be >= 1"),
    (["--share-gpus"], "--share-gpus lets local workers share this machine's GPUs"),  # it was accepted, did nothing
    # "0 = in this process" became 1 job at a time (`--array=0-1%1`), silently
    (["--workers", "0"], r"--workers 0 runs the grid in this process; with --executor slurm give the runs at once"),
    (["--executor", "submitit-local", "--workers", "0"], "--workers 0 runs the grid in this process; with --executor "
     "submitit-local"),
])
def test_bad_executor_flags_are_one_line_errors(args, match, tmp_path, capsys):
    from keel.cli import main

    full = ["--executor", "slurm", *args] if "--executor" not in args else args
    assert main(["sweep", "--grid", "train.lr=1e-3", "--out", str(tmp_path / "o"), *full]) == 2
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and re.search(match, err), err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("on_path,missing", [((), "sbatch"), (("sbatch",), "srun")])
def test_executor_slurm_without_slurm_is_one_line_and_writes_nothing(on_path, missing, tmp_path, capsys, monkeypatch):
    """submitit's `Could not detect "srun"` traceback came after study.json and grid.json were written (also
    where sbatch was on PATH but srun, which the job script and submitit need, was not)."""
    from keel.cli import main

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in on_path:
        (bin_dir / name).write_text("#!/bin/sh\nexit 1\n")
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    assert main(["sweep", "--grid", "train.lr=1e-3", "--out", str(tmp_path / "o"), "--executor", "slurm"]) == 2
    assert capsys.readouterr().err == (f"keel: error: --executor slurm needs Slurm ({missing} is not on PATH here); run "
                                       "on a Slurm login node, or use --executor local or submitit-local\n")
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
    # it runs as a controller of this grid's jobs does (submitit's module on the grid's submitit/ folder): keel
    # waits only on a process that is its job (test_a_pid_that_is_not_this_grids_job_...)
    stand_in = subprocess.Popen([sys.executable, "-c", "import os, sys, time\nwhile not os.path.exists(sys.argv[1]): "
                                 "time.sleep(0.1)", str(flag), "submitit.local._local", str((out / "submitit").absolute())])
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
    entry = json.loads((out / "jobs.json").read_text())["jobs"]["seed0"]  # one job id, started twice
    assert entry["job_id"] == controller and entry["attempts"] == 2 and entry["requeued"] == 1
    assert f"  seed0: running (job {controller}): requeued (attempt 2)" in err


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


# ---------------------------------------------------------------- Slurm: one job array, capped (a fake Slurm)
TESTS = Path(__file__).resolve().parent


@pytest.fixture
def fake_slurm(tmp_path, monkeypatch):
    """Slurm's commands on PATH (tests/fake_slurm.py): sbatch runs each array task, at most the array's cap at
    a time; the jobs import the grid task from tests/ (PYTHONPATH)."""
    import fake_slurm

    for k, v in fake_slurm.install(tmp_path / "bin", tmp_path / "slurm").items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("PYTHONPATH", str(TESTS))
    return tmp_path / "slurm"


def test_a_slurm_grid_is_one_job_array_with_a_cap_a_name_setup_lines_and_the_jobs_own_cpus(fake_slurm, tmp_path,
                                                                                            caplog):
    """--executor slurm used to submit one sbatch job per run, all at once (a cluster's submit limit), each
    named "submitit", with threads from the login node's cores. Now: one sbatch (a job array, --workers as
    its cap), named after the study and grid, the setup lines before the job, each job's threads from its
    allocation; one ledger line per run."""
    import fake_slurm as F

    jobs = [G.GridJob(f"r{i}", {"i": i}) for i in range(2)]
    ex = E.Executor("slurm", E.parse_slurm(["partition=debug", "gpus=0", "cpus=1", "setup=export FAKE_SETUP=yes"]),
                    poll_s=0.1, label="claims")
    caplog.set_level("INFO", logger="keel")
    res = G.run_grid(jobs, tmp_path / "showcase", F.job_env, workers=1, executor=ex)
    [script] = [p.read_text() for p in (fake_slurm / "submissions").iterdir()]  # one submission for the grid
    for line in ("#SBATCH --array=0-1%1", "#SBATCH --job-name=keel-claims-showcase", "#SBATCH --cpus-per-task=1",
                 "#SBATCH --partition=debug"):
        assert line in script.splitlines(), script
    assert script.index("export FAKE_SETUP=yes") < script.index("submitit.core._submit")
    assert (fake_slurm / "max_running").read_text() == "1"
    assert [r["status"] for r in res] == ["done", "done"]
    assert [(r["array_task"], r["job_name"], r["setup"]) for r in res] == [
        ("0", "keel-claims-showcase", "yes"), ("1", "keel-claims-showcase", "yes")]
    assert [r["threads"] for r in res] == [1, 1]  # the allocation's one CPU, not this machine's cores / workers
    ledger = json.loads((tmp_path / "showcase" / "jobs.json").read_text())
    assert ledger["executor"] == "slurm"
    assert {k: (v["job_id"], v["state"], v["attempts"]) for k, v in ledger["jobs"].items()} == {
        "r0": ("1000_0", "done", 1), "r1": ("1000_1", "done", 1)}
    assert "(Slurm job array, at most 1 run(s) at a time, threads: each job's CPUs)" in caplog.text
    assert "submitted job array 1000 (2 runs, at most 1 at a time, job name keel-claims-showcase)" in caplog.text
    # --threads N asks Slurm for N CPUs per run (unless --slurm cpus= says otherwise); a name is settable
    params = E._make_executor(E.Executor("slurm", E.parse_slurm(["job-name=mine"])), tmp_path / "s", 3, 4
                              )._executor.parameters
    assert (params["cpus_per_task"], params["array_parallelism"], params["job_name"]) == (3, 4, "mine")
    assert E.job_name(E.Executor("slurm", E.parse_slurm(["job-name=mine"])), tmp_path / "g") == "mine"


def test_a_resume_marks_runs_that_finished_while_the_driver_was_away_done_in_the_ledger(fake_slurm, tmp_path):
    """The driver stopped (Ctrl-C) while its jobs ran; they finished; `--resume` found every run finished and
    left jobs.json saying "running" for each, for good. Now their entries say "done"."""
    import fake_slurm as F

    jobs = [G.GridJob(f"r{i}", {"i": i}) for i in range(2)]
    ex = E.Executor("slurm", E.parse_slurm(["gpus=0"]), poll_s=0.1)
    G.run_grid(jobs, tmp_path / "g", F.job_env, workers=2, executor=ex)
    ledger_file = tmp_path / "g" / "jobs.json"
    ledger = json.loads(ledger_file.read_text())
    for entry in ledger["jobs"].values():
        entry["state"] = "running"  # what the driver had written when it was stopped
    ledger_file.write_text(json.dumps(ledger))
    G.run_grid(jobs, tmp_path / "g", F.job_env, workers=2, executor=ex, resume=True)
    assert {k: v["state"] for k, v in json.loads(ledger_file.read_text())["jobs"].items()} == {
        "r0": "done", "r1": "done"}


def test_a_failed_squeue_is_not_read_as_the_jobs_having_ended(fake_slurm, tmp_path):
    """One squeue that timed out (a busy controller) listed no job: the driver reported every running job
    "ended without a result (killed, or out of time)", wrote the report and exited, the jobs still running
    (and a --resume submitted them again). Now a poll whose squeue fails changes nothing; a job squeue no
    longer knows ("Invalid job id specified") has left the queue."""
    import fake_slurm as F

    (fake_slurm / "squeue_fails").write_text("3")
    jobs = [G.GridJob(f"r{i}", {"i": i}) for i in range(2)]
    res = G.run_grid(jobs, tmp_path / "g", F.slow_job_env, workers=2,
                     executor=E.Executor("slurm", E.parse_slurm(["gpus=0"]), poll_s=0.1))
    assert [r["status"] for r in res] == ["done", "done"], res
    assert (fake_slurm / "squeue_fails").read_text() == "0"


@pytest.mark.parametrize("rc,stderr,listed", [
    (0, "", {"4711_0": "RUNNING"}),
    (1, "slurm_load_jobs error: Socket timed out on send/recv operation", None),  # not known: no answer
    (1, "slurm_load_jobs error: Invalid job id specified", {}),  # a job the controller has forgotten
])
def test_squeue_says_when_it_could_not_list_the_queue(rc, stderr, listed, monkeypatch):
    out = "4711_0|RUNNING\n" if rc == 0 else ""
    monkeypatch.setattr(E.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, rc, out, stderr))
    assert E._squeue(["4711_0"]) == listed


@pytest.mark.parametrize("sets", [["train.device=cuda"], ["train.batch_size=4000000"]])
def test_a_slurm_grid_is_not_refused_for_what_the_login_node_lacks(sets, tiny_data, fake_slurm, tmp_path, keel_main):
    """The driver checked each run against this machine: a login node without a GPU refused
    `--set train.device=cuda`, one with less memory than the compute nodes a model or batch too large for
    itself, though the runs go to Slurm's nodes. Now a Slurm grid is submitted (here the fake Slurm's job,
    on this machine, fails in its place, as on a node without the GPU it asked for)."""
    out = tmp_path / "o"
    r = keel_main("sweep", *_sets(tiny_data, drop=("train.lr",)), *sum((["--set", s] for s in sets), []),
                  "--grid", "train.lr=1e-3", "--out", out, "--executor", "slurm", "--slurm", "gpus=0")
    assert len(list((fake_slurm / "submissions").iterdir())) == 1, r.stderr
    assert r.returncode == 1 and "(job 1000)" in r.stderr and "[1/1] lr0.001: error: " in r.stderr, r.stderr
    # the same grid here (submitit-local) is still checked against this machine, before anything starts
    r = keel_main("sweep", *_sets(tiny_data, drop=("train.lr",)), *sum((["--set", s] for s in sets), []),
                  "--grid", "train.lr=1e-3", "--out", tmp_path / "here", "--executor", "submitit-local")
    assert r.returncode == 2 and r.stderr.splitlines()[-1].startswith("keel: error: run lr0.001: "), r.stderr
    assert not (tmp_path / "here" / "lr0.001").exists()


@pytest.mark.parametrize("executor", [["--executor", "slurm", "--slurm", "nodes=2"], ["--executor", "submitit-local"]])
def test_a_batch_that_does_not_split_over_a_runs_ranks_is_refused_before_submitting(executor, tiny_data, fake_slurm,
                                                                                   tmp_path, keel_main):
    """--gpus-per-run 2 with train.batch_size 3: the array was submitted ("submitted job array 4711") and each run
    failed in its job (submitit-local: exit 1, the error in the report). Checked before anything is submitted or
    written now, as `keel train --nproc 2` does: the ranks of a run are --gpus-per-run x --slurm nodes= (here 4
    and 2)."""
    out = tmp_path / "o"
    ranks = 4 if "nodes=2" in executor else 2
    r = keel_main("sweep", *_sets(tiny_data, batch_size=6 if ranks == 4 else 3, parallelism="ddp"), "--grid",
                  "train.seed=0,1", "--out", out, *executor, "--gpus-per-run", "2")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.splitlines()[-1] == (f"keel: error: run seed0: train.batch_size ({6 if ranks == 4 else 3}, the "
                                         "global number of sequences per micro-batch) is not divisible by the world "
                                         f"size ({ranks})")
    assert not (fake_slurm / "submissions").exists() or not any((fake_slurm / "submissions").iterdir())
    assert not (out / "seed0").exists()


@pytest.mark.parametrize("args,match", [
    (["--slurm", "array=0-9"], "--slurm array= is keel's to set: a grid is one job array; its cap is --workers N"),
    (["--slurm", "name="], "--slurm name= is empty"),
    (["--slurm", "signal_delay_s=0"], "--slurm signal_delay_s= must be a whole number >= 1"),
    (["--slurm", "max_num_timeout=x"], "--slurm max_num_timeout= must be a whole number, got 'x'"),
    # the same sbatch option twice, spelt two ways: one was dropped silently (mem=4G won over mem_gb=8)
    (["--slurm", "mem=4G", "--slurm", "mem_gb=8"], "--slurm mem= and mem_gb= both set sbatch's --mem; give one"),
    (["--slurm", "gpus=1", "--slurm", "gpus-per-node=2"], "--slurm gpus-per-node= and gpus= both set sbatch's"),
    # a run's processes per node are --gpus-per-run's: a second --ntasks-per-node line came after the user's
    (["--slurm", "ntasks-per-node=4"], "--slurm ntasks-per-node= is keel's to set: a run's processes per node"),
    (["--slurm", "ntasks_per_node=4"], "--slurm ntasks_per_node= is keel's to set: a run's processes per node"),
    # the warning before the time limit at or before the job's start: every attempt stopped after one step
    (["--slurm", "time=1"], "--slurm signal_delay_s=90 (the default) is not below time=1 (60 s)"),
    (["--slurm", "time=60", "--slurm", "signal_delay_s=3600"], "--slurm signal_delay_s=3600 is not below time=60"),
])
def test_slurm_keys_keel_sets_or_checks_are_one_line_errors(args, match, tmp_path, keel_main):
    r = keel_main("sweep", "--grid", "train.lr=1e-3", "--out", tmp_path / "o", "--executor", "slurm", "--dry-run", *args)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and match in r.stderr, r.stderr


@pytest.mark.parametrize("items,option,lines", [
    (["exclusive="], "exclusive", ["#SBATCH --exclusive"]),  # was --exclusive='': sbatch refuses an empty value
    (["requeue="], "requeue", ["#SBATCH --requeue"]),
    (["mail-type=END"], "mail-type", ["#SBATCH --mail-type=END"]),
    # sbatch's own spelling of the GPUs per node replaces the default (--gpus-per-run), not a second line after it
    (["gpus-per-node=a100:2"], "gpus-per-node", ["#SBATCH --gpus-per-node=a100:2"]),
])
def test_a_passed_on_sbatch_option_reaches_the_job_script_as_sbatch_takes_it(items, option, lines, fake_slurm,
                                                                              tmp_path):
    """An sbatch option keel does not know goes into the job script as given; ``KEY=`` with no value is the
    flag ``--KEY`` (docs/cluster.md: ``exclusive=``), not ``--KEY=''``, which sbatch refuses."""
    sub = E._make_executor(E.Executor("slurm", E.parse_slurm(items)), tmp_path / "s", None, 1)._executor
    script = sub._make_submission_file_text("true", "uid").splitlines()
    assert [line for line in script if line.startswith(f"#SBATCH --{option}")] == lines, script


@pytest.mark.parametrize("setup,python", [
    ([], shlex.quote(sys.executable)),  # the driver's own Python
    (["setup=module load cuda"], shlex.quote(sys.executable)),
    (["setup=source /shared/venv/bin/activate"], "python"),  # the Python that setup line put first on PATH
    (["setup=module load cuda", "setup=conda activate keel"], "python"),
])
def test_a_job_starts_the_python_a_setup_line_activates(setup, python, fake_slurm, tmp_path):
    """docs/cluster.md: a job starts the driver's Python (sys.executable) unless a setup line activates another;
    the job script started sys.executable even after `source .../bin/activate`."""
    sub = E._make_executor(E.Executor("slurm", E.parse_slurm(setup)), tmp_path / "s", None, 1)._executor
    script = sub._make_submission_file_text(sub._submitit_command_str, "uid")
    assert f" {python} -u -m submitit.core._submit " in script, script


def test_slurm_setup_lines_signal_delay_and_requeue_limit_reach_submitit(fake_slurm, tmp_path):
    ex = E.Executor("slurm", E.parse_slurm(["setup=module load cuda", "setup=source .venv/bin/activate",
                                            "signal_delay_s=300", "max_num_timeout=7"]))
    sub = E._make_executor(ex, tmp_path / "s", None, 1)._executor
    assert sub.parameters["setup"] == ["module load cuda", "source .venv/bin/activate"]
    assert sub.parameters["signal_delay_s"] == 300 and sub.max_num_timeout == 7


# ---------------------------------------------------------------- a job id is not trusted as a PID
def test_a_pid_that_is_not_this_grids_job_is_neither_waited_on_nor_signalled_and_jobs_keep_to_visible_gpus(
        tmp_path, monkeypatch, caplog):
    """A stale submitit-local ledger (the driver killed, the machine rebooted) named PIDs that other programs
    hold now: --resume waited on them and signalled them on Ctrl-C (PID 1 too). Now a PID counts as the job
    only while it is this grid's controller; the runs are submitted again. With an inherited
    CUDA_VISIBLE_DEVICES=5,7 (2 faked GPUs), the two job slots get 5 and 7 (submitit-local used to hide every
    GPU: CUDA_VISIBLE_DEVICES empty)."""
    import fake_slurm as F

    monkeypatch.setenv("PYTHONPATH", str(TESTS))
    monkeypatch.setattr(G, "gpu_count", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")
    other = subprocess.Popen(["sleep", "600"])  # a program that took a PID the ledger names
    out = tmp_path / "grid"
    out.mkdir()
    (out / "jobs.json").write_text(json.dumps({"executor": "submitit-local", "jobs": {
        "a": {"job_id": str(other.pid), "attempts": 1, "state": "running"},
        "b": {"job_id": "1", "attempts": 1, "state": "running"}}}))
    caplog.set_level("INFO", logger="keel")
    try:
        res = G.run_grid([G.GridJob("a", {"i": 0}), G.GridJob("b", {"i": 1})], out, F.job_env, workers=2, threads=1,
                         resume=True, executor=E.Executor("submitit-local", poll_s=0.1))
        E._signal_job(E._job_handle("submitit-local", out / "submitit", str(other.pid)), {"job_id": str(other.pid)})
        time.sleep(0.2)
        assert other.poll() is None  # never signalled
    finally:
        other.kill()
        other.wait()
    assert [r["status"] for r in res] == ["done", "done"]
    assert f"a: job {other.pid}'s process id belongs to another program now" in caplog.text
    ledger = json.loads((out / "jobs.json").read_text())["jobs"]
    assert all(e["attempts"] == 2 and e["job_id"] not in (str(other.pid), "1") and e["process"] for e in ledger.values())
    assert sorted(e["devices"] for e in ledger.values()) == ["5", "7"]
    assert sorted(r["devices"] for r in res) == ["5", "7"]


def test_local_workers_get_gpus_within_an_inherited_cuda_visible_devices(monkeypatch):
    """CUDA_VISIBLE_DEVICES=8,9,10,11 set by the user (or a scheduler): workers got 0..3, outside it."""
    monkeypatch.setattr(G, "gpu_count", lambda: 4)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "8,9,10,11")
    assert G.worker_devices(2, E.Executor(gpus_per_run=2)) == ["8,9", "10,11"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-a,GPU-b")
    monkeypatch.setattr(G, "gpu_count", lambda: 2)
    assert G.worker_devices(3, E.Executor(share_gpus=True)) == ["GPU-a", "GPU-b", "GPU-a"]


# ---------------------------------------------------------------- one Ctrl-C: one stop request per job
@pytest.mark.skipif(sys.platform != "linux", reason="a terminal's Ctrl-C: SIGINT to the process group")
def test_one_ctrl_c_stops_each_submitit_local_job_once_after_its_step_and_says_so(tiny_data, tmp_path):
    """Ctrl-C in a terminal signals the whole foreground process group: the jobs got the terminal's SIGINT and
    the driver's SIGTERM (a second signal: stop at once, steps since the checkpoint lost), submitit's
    controllers printed KeyboardInterrupt tracebacks, and the driver said every job checkpointed. Now each
    job gets one stop request, checkpoints its last step, and the driver repeats what the job said."""
    train = dict(steps=5000, eval_every=5000, checkpoint_every=5000, seed=0)
    out = tmp_path / "sweep"
    args = ["sweep", *_sets(tiny_data, drop=("train.seed",), **train), "--grid", "train.seed=0", "--out", out,
            "--executor", "submitit-local", "--threads", "1"]
    proc = subprocess.Popen([str(KEEL), *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # its own process group, as a shell's foreground job
    try:
        metrics, deadline = out / "seed0" / "metrics.jsonl", time.monotonic() + HANG_S
        while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 10):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)  # the terminal's Ctrl-C
        _, err = proc.communicate(timeout=HANG_S)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    log = (out / "seed0" / "run.log").read_text()
    assert log.count("received: stopping after this step") == 1, log  # one stop request reached the job
    last = max(r["step"] for r in read_metrics(out / "seed0" / "metrics.jsonl"))
    ckpt = out / "seed0" / "checkpoints" / f"step_{last:08d}"
    assert ckpt.is_dir()  # every step it trained is in the checkpoint: none lost
    assert "seed0: stopped (job " in err and f"stopped by SIGTERM after step {last}: checkpoint {ckpt} written" in err
    assert "stopped by SIGINT (the running job finished its step and checkpointed;" in err


def test_a_failed_jobs_words_are_keels_own_line_and_its_error_log():
    """After a scancel the driver showed submitit's last line (the path of the job's .out log) instead of
    keel's "stopped by SIGTERM after step 186: checkpoint ... written"."""
    text = ("Job (task=0) failed during processing with trace:\n----------------------\nTraceback (most recent call "
            "last):\n  File \"x.py\", line 1, in f\n    raise TrainingInterrupted(...)\n"
            "keel.train.interrupt.TrainingInterrupted: stopped by SIGTERM after step 186: checkpoint /r/checkpoints/"
            "step_00000186 written; resume with: keel train --resume /r\n----------------------\nYou can check full "
            "logs with 'job.stderr(0)' and 'job.stdout(0)'or at paths:\n  - /g/submitit/7_0_log.err\n"
            "  - /g/submitit/7_0_log.out")
    assert E.failure_words(text) == "stopped by SIGTERM after step 186: checkpoint /r/checkpoints/step_00000186 written"
    assert E.failure_words(text.replace("keel.train.interrupt.TrainingInterrupted: stopped by SIGTERM after step 186: "
                                        "checkpoint /r/checkpoints/step_00000186 written; resume with: keel train "
                                        "--resume /r", "torch.OutOfMemoryError: CUDA out of memory")) == \
        "OutOfMemoryError: CUDA out of memory"


# ---------------------------------------------------------------- a grid folder resumes with its executor
def test_a_bare_resume_takes_the_folders_executor_and_another_is_refused(tiny_data, tmp_path, keel_main, fake_slurm):
    """`keel sweep --out D --resume` dropped --executor slurm and trained the run here, beside its Slurm job."""
    from keel.experiments.study.run import engine_executor

    out = tmp_path / "sweep"
    out.mkdir()
    started = E.Executor("slurm", E.parse_slurm(["partition=debug", "time=30"]), gpus_per_run=2)
    command = shlex.join(["keel", "sweep", *_sets(tiny_data), "--grid", "train.seed=0", "--out", str(out)])
    (out / "study.json").write_text(json.dumps({"study": "sweep", "scale": "cli", "command": command,
                                                "executor": {**started.record(), "workers": 3, "threads": 2}}))
    (out / "jobs.json").write_text(json.dumps({"executor": "slurm", "jobs": {}}))  # its jobs were submitted
    ex, workers, threads = engine_executor(out, None, None, None, "sweep")
    assert (ex.kind, dict(ex.slurm), ex.gpus_per_run, ex.label, workers, threads) == (
        "slurm", {"partition": "debug", "time": "30"}, 2, "sweep", 3, 2)
    r = keel_main("sweep", *_sets(tiny_data), "--grid", "train.seed=0", "--out", out, "--resume",
                  "--executor", "submitit-local")
    assert r.returncode == 2 and r.stderr == (
        f"keel: error: {out} was started with --executor slurm, not submitit-local; continue it with --executor "
        f"slurm (or leave --executor out: {out / 'study.json'} holds its settings), or use another --out\n")
    assert not (out / "seed0").exists()
    fresh = tmp_path / "fresh"  # a new folder records what it was started with
    engine_executor(_claimed(fresh), E.Executor("submitit-local"), 2, None, "sweep")
    assert json.loads((fresh / "study.json").read_text())["executor"] == {
        "kind": "submitit-local", "slurm": {}, "gpus_per_run": 1, "share_gpus": False, "workers": 2, "threads": None}


@pytest.mark.parametrize("given,kept", [
    (["time=240"], {"partition": "cpu", "gpus": "0", "setup": "module load x", "time": "240"}),
    (["setup=module load y"], {"partition": "cpu", "gpus": "0", "setup": "module load y", "time": "30"}),
])
def test_resume_with_new_slurm_settings_replaces_those_keys_and_keeps_the_others(given, kept, tmp_path, fake_slurm):
    """docs/cluster.md: on resume, the same executor with new settings (a longer time=) replaces them. A
    `--resume --executor slurm --slurm time=240` dropped every other recorded key (partition, gpus=0, setup),
    so the jobs submitted again went to the default partition, asked for a GPU and ran without their setup."""
    from keel.experiments.study.run import engine_executor

    out = tmp_path / "sweep"
    out.mkdir()
    started = E.Executor("slurm", E.parse_slurm(["partition=cpu", "gpus=0", "setup=module load x", "time=30"]))
    (out / "study.json").write_text(json.dumps({"study": "sweep", "scale": "cli", "command": "keel sweep",
                                                "executor": {**started.record(), "workers": 3, "threads": None}}))
    ex, workers, _ = engine_executor(out, E.Executor("slurm", E.parse_slurm(given)), None, None, "sweep")
    assert (dict(ex.slurm), workers) == (kept, 3)
    assert json.loads((out / "study.json").read_text())["executor"]["slurm"] == kept


@pytest.mark.parametrize("flags, gpus", [([], 2), (["--gpus-per-run", "4"], 4)])
def test_a_resume_with_slurm_settings_keeps_the_recorded_gpus_per_run(flags, gpus, tmp_path, fake_slurm):
    """`--resume --executor slurm --slurm time=60` reset a folder's recorded --gpus-per-run 2 to the default 1: the
    jobs submitted again asked for one GPU and ran one process each. A flag not given now keeps the folder's.
    `--resume --slurm time=60` without --executor was refused ("use it with --executor slurm")."""
    import argparse

    from keel.cli.commands.science import executor_of
    from keel.experiments.study.run import engine_executor

    out = tmp_path / "sweep"
    out.mkdir()
    started = E.Executor("slurm", E.parse_slurm(["time=30"]), gpus_per_run=2)
    (out / "study.json").write_text(json.dumps({"study": "sweep", "scale": "cli", "command": "keel sweep",
                                                "executor": {**started.record(), "workers": 3, "threads": None}}))
    given = argparse.Namespace(executor=None, slurm=["time=60"], share_gpus=False, dry_run=False, resume=True,
                               gpus_per_run=int(flags[1]) if flags else None)  # --executor slurm: the folder's
    ex, _, _ = engine_executor(out, executor_of(given), None, None, "sweep")
    assert (ex.gpus_per_run, dict(ex.slurm)) == (gpus, {"time": "60"})
    assert json.loads((out / "study.json").read_text())["executor"]["gpus_per_run"] == gpus


def test_a_resume_with_slurm_settings_of_a_folder_of_another_executor_names_it(tmp_path, monkeypatch):
    """`keel sweep --out DIR --resume --slurm time=30` of a folder started with --executor submitit-local said
    "--executor slurm needs Slurm (sbatch is not on PATH here)", of a flag the user never gave."""
    import argparse

    from keel.cli.commands.science import executor_of
    from keel.experiments.study.run import engine_executor

    monkeypatch.setenv("PATH", str(tmp_path / "no-bin"))  # no sbatch, no srun
    out = tmp_path / "sweep"
    out.mkdir()
    started = E.Executor("submitit-local")
    (out / "study.json").write_text(json.dumps({"study": "sweep", "scale": "cli", "command": "keel sweep",
                                                "executor": {**started.record(), "workers": 1, "threads": None}}))
    given = argparse.Namespace(executor=None, slurm=["time=30"], share_gpus=False, dry_run=False, resume=True,
                               gpus_per_run=None)
    with pytest.raises(KeelError) as e:
        engine_executor(out, executor_of(given), None, None, "sweep")
    assert str(e.value) == (f"{out} was started with --executor submitit-local: --slurm sets the Slurm parameters "
                            f"of a folder started with --executor slurm; drop it ({out / 'study.json'} holds its "
                            "settings), or use another --out")
    given.executor = "slurm"  # asked for by name: Slurm must be here (checked before the folder is read)
    with pytest.raises(KeelError, match=r"--executor slurm needs Slurm \(sbatch is not on PATH here\)"):
        executor_of(given)


def _claimed(out: Path) -> Path:
    out.mkdir()
    (out / "study.json").write_text(json.dumps({"study": "sweep", "scale": "cli", "command": "keel sweep"}))
    return out


def test_local_slurm_sh_refuses_a_non_empty_folder_it_did_not_make(tmp_path):
    """examples/slurm/local_slurm.sh ran `rm -rf` on whatever folder it was given. (Should the check ever go,
    the daemons it would start are shell functions here that stop the script at once.)"""
    (tmp_path / "mine.txt").write_text("keep")
    stubs = "stop_here() { exit 99; }; munged() { stop_here; }; slurmctld() { stop_here; }; slurmd() { stop_here; }"
    r = subprocess.run(["bash", "-c", f"{stubs}; export -f stop_here munged slurmctld slurmd; "
                        f"exec bash {REPO / 'examples' / 'slurm' / 'local_slurm.sh'} {tmp_path}"],
                       capture_output=True, text=True, timeout=HANG_S)
    assert r.returncode == 2, r.stderr
    assert r.stderr == f"local_slurm.sh: {tmp_path} is not empty and was not made by this script; give a new or " \
                       "empty folder\n"
    assert [p.name for p in tmp_path.iterdir()] == ["mine.txt"] and (tmp_path / "mine.txt").read_text() == "keep"


@pytest.mark.parametrize("state,expected", [
    ((), ["--config", "demo", "--run-dir", "RUN", "--set", "train.parallelism=fsdp", "--set", "train.steps=40"]),
    (("config.toml",), ["--config", "demo", "--run-dir", "RUN", "--set", "train.parallelism=fsdp",
                        "--set", "train.steps=40", "--restart"]),  # requeued before its first checkpoint
    # a requeued job, or a new sbatch of the same run: its arguments reach keel's resume rules (a changed
    # train.steps applies, a model.* key is refused in one line) instead of being dropped without a word
    (("config.toml", "checkpoints/latest"), ["--resume", "RUN", "--set", "train.steps=40"]),
])
def test_train_sbatch_passes_its_arguments_to_keel_train_also_when_it_resumes(state, expected, tmp_path):
    """examples/slurm/train.sbatch: what it runs under srun, for a new run, one without a checkpoint and
    one with. `sbatch train.sbatch --set model.residual=pre_ln` over an existing run resumed that run and
    ignored the --set (exit 0)."""
    run = tmp_path / "run"
    for rel in state:
        (run / rel).parent.mkdir(parents=True, exist_ok=True)
        (run / rel).write_text("x")
    python = tmp_path / "python"  # records what keel train would get
    python.write_text(f"#!/bin/sh\nprintf '%s\\n' \"$@\" > {tmp_path / 'argv'}\n")
    python.chmod(0o755)
    stubs = ("srun() { while [ \"${1#-}\" != \"$1\" ]; do shift; done; \"$@\"; }; scontrol() { echo node1; }; "
             "export -f srun scontrol")
    env = {**os.environ, "SLURM_JOB_ID": "7", "SLURM_JOB_NAME": "t", "SLURM_JOB_NODELIST": "node1",
           "CONFIG": "demo", "RUN": str(run), "KEEL_PYTHON": str(python), "MASTER_PORT": "29500"}
    r = subprocess.run(["bash", "-c", f"{stubs}; exec bash {REPO / 'examples' / 'slurm' / 'train.sbatch'} "
                        "--set train.steps=40"], env=env, capture_output=True, text=True, timeout=HANG_S)
    assert r.returncode == 0, r.stderr
    argv = (tmp_path / "argv").read_text().splitlines()
    assert argv == ["-m", "keel", "train", *[str(run) if a == "RUN" else a for a in expected]], argv
