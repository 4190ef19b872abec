"""CPU dry run of benchmarks/gpu_check.sh: every code path the GPU check uses (bf16-vs-fp32
forward of every scheme, timed training steps eager and compiled, checkpointed memory rows,
``keel prepare`` + ``keel train --config paper-64``), at tiny shapes, through the shell
script itself, so that the first GPU run does not fail on a typo."""

import math
import os
import re
import subprocess
import sys
from pathlib import Path

from keel.model import SCHEMES

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu_check.sh"


def run_script(*args, timeout=900):
    env = dict(os.environ, PYTHON=sys.executable, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    return subprocess.run(["bash", str(SCRIPT), *map(str, args)], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=timeout, check=False)


def test_usage_error_without_output_file():
    proc = run_script()
    assert proc.returncode == 2 and "usage:" in proc.stderr


def test_dry_run_exercises_every_section(tmp_path):
    out = tmp_path / "gpu_check.md"
    proc = run_script(out, "--dry-run")
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = out.read_text()
    assert text.strip() in proc.stdout  # printed and written
    rows = [ln.split(" | ") for ln in text.splitlines() if ln.startswith("| ") and not ln.startswith("| section")]
    sections = [r[0].lstrip("| ") for r in rows]
    assert sections.count("bf16") == len(SCHEMES)
    assert sections.count("speed") == 8  # 2 depths x (pre_ln, keel) x (eager, compiled)
    assert sections.count("memory") == 2 and sections.count("train") == 1
    assert sorted(r[1] for r in rows if r[0].endswith("levers")) == ["ce", "ffn", "qkv"]
    for r in rows:
        if r[0].endswith("bf16"):
            err = float(re.search(r"max rel\. logit err ([0-9.e+-]+)", r[-1]).group(1))
            assert 0 < err < 0.05, r  # bf16 matmul inputs: ~2^-8 relative
        if r[0].endswith(("speed", "memory")):
            loss = float(re.search(r"loss ([0-9.]+)", r[-1]).group(1))
            assert math.isfinite(loss) and 3.0 < loss < 8.0, r  # ~ln(256) = 5.5 at init
    losses = [float(v) for v in re.findall(r"\d+: ([0-9.]+)", rows[sections.index("train")][-1])]
    assert len(losses) == 2 and all(math.isfinite(v) and v > 0 for v in losses)
