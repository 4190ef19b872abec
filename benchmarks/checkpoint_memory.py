"""Checkpoint size on disk and peak host RAM of each rank of a 2-process FSDP run on the CPU.

Runs ``keel train --nproc 2`` (torchrun, gloo) with ``train.parallelism = "fsdp"`` on a small
real dataset for a few steps, checkpointing at the end, while polling every process of the
run (``/proc/PID/status``: ``VmHWM``, the peak resident set size) every 0.1 s. Reports the
size of the final checkpoint folder and each rank's peak RSS in MiB. ``--keel-src`` points
at another keel source tree (e.g. an older commit, ``git archive``-d) to measure it the same
way: it goes first on ``PYTHONPATH``.

Example (before/after of issue 17)::

    git archive main | tar -x -C /tmp/keel_before
    python benchmarks/checkpoint_memory.py --keel-src /tmp/keel_before
    python benchmarks/checkpoint_memory.py
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _rank_of(pid: int) -> int | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in env:
        if item.startswith(b"RANK="):
            return int(item[5:])
    return None


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            kids = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:
            kids = []
        out += [int(k) for k in kids]
        todo += [int(k) for k in kids]
    return out


def _hwm_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--keel-src", default=None, help="a keel source tree to measure instead of the installed one")
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--blocks", "--layers", dest="layers", type=int, default=8,
                   help="transformer blocks = model.n_layers (--layers: the old name)")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--sample-tokens", type=int, default=0, help="train.sample_tokens (0: no end-of-run sample)")
    p.add_argument("--work", default=None, help="folder for the data and the run (default: a temporary one)")
    a = p.parse_args(argv)
    work = Path(a.work or tempfile.mkdtemp(prefix="ckpt_mem."))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if a.keel_src:
        env["PYTHONPATH"] = a.keel_src + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    keel = [sys.executable, "-m", "keel"]
    data = work / "data"
    if not (data / "meta.json").exists():
        subprocess.run(keel + ["prepare", "--source", "builtin:python-stdlib", "--tokenizer", "bpe:2048",
                               "--out", str(data), "--max-bytes", "2000000"], check=True, env=env)
    run = work / f"run_{int(time.time())}"
    sets = [f"data.path={data}", f"model.d_model={a.d_model}", f"model.n_layers={a.layers}", "model.n_heads=8",
            "model.n_kv_heads=4", f"model.d_ff={3 * a.d_model}", "model.max_seq_len=64", "model.vocab_size=auto",
            f"train.steps={a.steps}", f"train.checkpoint_every={a.steps}", f"train.eval_every={a.steps}",
            "train.eval_tokens=512", "train.batch_size=2", "train.seq_len=64", "train.parallelism=fsdp",
            "train.progress=false", f"train.sample_tokens={a.sample_tokens}", "train.device=cpu", "train.warmup_steps=0"]
    cmd = keel + ["train", "--nproc", "2", "--run-dir", str(run)] + [x for s in sets for x in ("--set", s)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    peaks: dict[int, float] = {}
    while proc.poll() is None:
        for pid in _descendants(proc.pid):
            rank, hwm = _rank_of(pid), _hwm_mib(pid)
            if rank is not None and hwm is not None and Path(f"/proc/{pid}/cmdline").read_bytes().count(b"keel"):
                peaks[rank] = max(peaks.get(rank, 0.0), hwm)
        time.sleep(0.1)
    err = proc.stderr.read()
    if proc.returncode != 0:
        print(err[-3000:], file=sys.stderr)
        return proc.returncode
    ckpt = run / "checkpoints" / f"step_{a.steps:08d}"
    size = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())
    n_params = next((ln for ln in err.splitlines() if "parameters" in ln), "")
    result = {"keel_src": a.keel_src or "installed", "checkpoint_mib": size / 2**20,
              "files": sorted(str(f.relative_to(ckpt)) for f in ckpt.rglob("*") if f.is_file()),
              "peak_rss_mib": {str(r): round(v, 1) for r, v in sorted(peaks.items())}, "model": n_params.strip()}
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
