import json
import os
import signal
import sys
from pathlib import Path

import pytest

from keel.config import load_config

REPO = Path(__file__).resolve().parent.parent
# Tests bound work (steps, tokens, documents), never seconds: a subprocess or wait limit only
# catches a hang, far beyond what the slowest machine needs (issue 19: a 300 s limit failed at load 30).
HANG_S = 3600
if str(REPO) not in sys.path:  # the benchmarks/ scripts (e.g. benchmarks.memory_model) are tested too
    sys.path.insert(0, str(REPO))
# The signal tests model a user at a terminal. A suite started as a background job of a
# non-interactive shell (`make test &`, nohup) inherits SIGINT ignored, every keel subprocess
# would too, and Python then never raises KeyboardInterrupt (POSIX: an ignored signal stays
# ignored across exec). Take SIGINT back so that children start with its default disposition.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


# Under pytest-xdist (`make test` runs one worker per core) each worker, and every keel process
# it starts, uses one torch thread: two workers of two threads each on two cores spend their time
# waiting for each other's OpenMP threads (a tiny study took 4x longer).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["MKL_NUM_THREADS"] = "1"

# The end-to-end tier: a test that starts a process (``keel_cli``, ``spawns``: a subprocess, torch.multiprocessing,
# torchrun), runs torch.compile (``compiles``: graph capture takes seconds to minutes) or trains on the real-text
# dataset. ``pytest -m "not e2e"`` is the fast unit tier for development; ``make test`` and CI run both tiers.
E2E_FIXTURES = {"keel_cli", "tiny_data", "tiny_config", "tiny_reference_run"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if E2E_FIXTURES & set(getattr(item, "fixturenames", ())) or any(
                item.get_closest_marker(m) for m in ("spawns", "compiles")):
            item.add_marker(pytest.mark.e2e)
    # the longest tests first: under pytest-xdist no worker is then left running one alone at the end
    items.sort(key=lambda item: item.get_closest_marker("long") is None)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: one torch thread is much faster than two on a shared machine."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    """A small real-text dataset: ~300 kB of the Python standard library, BPE with 512 tokens."""
    from keel.data import prepare_dataset

    cache = tmp_path_factory.mktemp("data")
    return prepare_dataset("builtin:python-stdlib", "bpe:512", cache_dir=cache, max_bytes=300_000, progress=False)


def assert_report_section(out, group, stem):
    """The one report of a grid command (``keel sweep`` / ``stress`` / ``lr-sensitivity``) in ``out``:
    its group's table is a section of the engine's ``report.md`` (headings two levels down) and a key of
    ``report.json`` (``group_tables``); ``STEM.md`` / ``STEM.json`` are its deprecated aliases, the same
    text (after a first line saying so) and the same data."""
    report = json.loads((out / "report.json").read_text())
    assert report["group_tables"][group] == json.loads((out / f"{stem}.json").read_text())
    first, _, body = (out / f"{stem}.md").read_text().partition("\n\n")
    assert first.startswith("*deprecated: see report.md"), first
    section = "\n".join("##" + x if x.startswith("#") else x for x in body.rstrip("\n").split("\n"))
    md = (out / "report.md").read_text()
    assert f"\n## Group {group}: " in md and section in md


def tiny_overrides(data_dir, drop=(), **train):
    """``--set`` strings for a seconds-long run on ``data_dir``, less those of the keys in ``drop``
    (e.g. the keys a grid command sets per run, which it refuses in a ``--set``)."""
    t = dict(steps=12, lr=3e-3, warmup_steps=3, batch_size=4, seq_len=32, eval_every=4, eval_tokens=1024,
             checkpoint_every=4, progress=False, sample_tokens=8)
    t.update(train)
    sets = [f"data.path={data_dir}", "model.d_model=32", "model.n_layers=2", "model.n_heads=2",
            "model.n_kv_heads=1", "model.d_ff=64", "model.max_seq_len=64", "model.vocab_size=512"]
    sets += [f"train.{k}={v if not isinstance(v, bool) else str(v).lower()}" for k, v in t.items()]
    return [s for s in sets if s.split("=", 1)[0] not in drop]


@pytest.fixture(scope="session")
def tiny_reference_run(tiny_data, tmp_path_factory):
    """The uninterrupted run of :func:`tiny_overrides` on the demo preset (12 steps, checkpoints
    every 4), on one thread: what fault and resume tests compare with. Copy it, never change it."""
    import torch

    from keel.train import train

    run = tmp_path_factory.mktemp("ref") / "run"
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train(load_config(REPO / "keel" / "configs" / "demo.toml", tiny_overrides(tiny_data)), run)
    finally:
        torch.set_num_threads(n)
    return run


@pytest.fixture
def offline_one_thread(monkeypatch):
    """No network (as in CI), one torch thread (tiny models; a shared machine); for the
    lm-eval / transformers tests (``pytestmark = pytest.mark.usefixtures("offline_one_thread")``)."""
    import datasets.config
    import huggingface_hub.constants as hub_constants
    import torch

    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def wandb_rows(run_dir, n: int, limit_s: float = 300.0) -> list[dict]:
    """The W&B history rows of keel run ``run_dir`` (keel.train.loggers.wandb_history) once
    there are ``n`` of them: ``run.finish()`` returns before W&B's service has written the
    last rows of its log, so they are waited for (``limit_s`` only catches rows that never come)."""
    import time
    from pathlib import Path

    from keel.train.loggers import wandb_history

    run_dir = Path(run_dir)
    deadline = time.monotonic() + limit_s
    while True:
        rows = wandb_history(run_dir / "wandb", (run_dir / "wandb_id").read_text().strip())
        if len(rows) >= n or time.monotonic() > deadline:
            return rows
        time.sleep(0.2)


@pytest.fixture
def tiny_config(tiny_data):
    def make(**train):
        return load_config(REPO / "keel" / "configs" / "demo.toml", tiny_overrides(tiny_data, **train))
    return make


@pytest.fixture
def keel_cli():
    """Run the ``keel`` console script of this environment in a subprocess."""
    import subprocess

    exe = Path(sys.executable).parent / "keel"

    def run(*args, cwd=None, timeout=HANG_S):
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        return subprocess.run([str(exe), *map(str, args)], capture_output=True, text=True, cwd=cwd,
                              timeout=timeout, env=env)
    return run


@pytest.fixture
def keel_main(capsys, monkeypatch):
    """Run ``keel ARGS`` in this process (``keel.cli.main``), as :func:`keel_cli` does in a
    subprocess: returns a ``CompletedProcess`` (``returncode``, ``stdout``, ``stderr``). For commands
    whose process adds nothing to the test (a refusal, a plan, a report): each ``keel_cli`` call
    starts an interpreter and imports torch (~3 s on an idle core)."""
    import subprocess

    from keel.cli import main

    def run(*args, cwd=None):
        argv = [str(a) for a in args]
        capsys.readouterr()  # what the test printed before is not this command's output
        with monkeypatch.context() as m:
            if cwd is not None:
                m.chdir(cwd)
            try:
                code = main(argv)
            except SystemExit as e:  # argparse's own errors (exit 2) and --help (exit 0)
                code = e.code if isinstance(e.code, int) else int(e.code is not None)
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(["keel", *argv], code, out, err)
    return run


@pytest.fixture
def connect_attempts(monkeypatch):
    """Every outgoing TCP connection attempt of this process (``socket.connect``, which
    requests/urllib3 and httpx reach), as a list of addresses: "fails fast" is tested as a
    number of attempts, never as seconds."""
    import socket

    attempts, real = [], socket.socket.connect

    def connect(sock, address):
        attempts.append(address)
        return real(sock, address)

    monkeypatch.setattr(socket.socket, "connect", connect)
    return attempts

