"""CPU dry run of benchmarks/gpu_check.sh: every code path the GPU check uses (bf16-vs-fp32
forward of every scheme, the zero-graph-break check, timed training steps eager and compiled,
checkpointed memory rows, ``keel prepare`` + ``keel train --config paper-64``, and the
2-process FSDP2 + sharded-checkpoint save/resume on gloo, the fp16-autocast rows), at tiny shapes, through the shell
script itself, so that the first GPU run does not fail on a typo. The main dry run takes
about 15 s of CPU (user + sys) on 2 cores; the FSDP section (two torchrun launches, ~80 s on
2 busy cores) is marked slow."""

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from keel.model import SCHEMES

pytestmark = pytest.mark.spawns  # every test runs the shell script (the e2e tier)

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu_check.sh"


def run_script(*args, timeout=900):
    env = dict(os.environ, PYTHON=sys.executable, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    return subprocess.run(["bash", str(SCRIPT), *map(str, args)], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=timeout, check=False)


def rows_of(text: str) -> list[list[str]]:
    return [ln.strip("| ").split(" | ") for ln in text.splitlines()
            if ln.startswith("| ") and not ln.startswith("| section")]


def test_usage_error_without_output_file():
    proc = run_script()
    assert proc.returncode == 2 and "usage:" in proc.stderr


def test_dry_run_exercises_every_section(tmp_path):
    out = tmp_path / "gpu_check.md"
    proc = run_script(out, "--dry-run", "--sections", "bf16,compile,speed,memory,levers,train")
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = out.read_text()
    assert text.strip() in proc.stdout  # printed and written
    rows = rows_of(text)
    sections = [r[0] for r in rows]
    assert sections.count("bf16") == len(SCHEMES)
    assert sections.count("compile") == 4  # (keel, attn_res) x (AC off, on) in the dry run; every scheme on the GPU
    # 1 depth x (pre_ln, keel, the bench's mhc) x (eager, compiled)
    assert sorted(r[1] for r in rows if r[0] == "speed") == ["keel"] * 2 + ["mhc"] * 2 + ["pre_ln"] * 2
    assert sections.count("memory") == 2 and sections.count("train") == 1
    assert sorted(r[1] for r in rows if r[0] == "levers") == ["ce", "ffn", "qkv"]
    assert [r[-1] for r in rows] == ["pass"] * len(rows)  # every row says pass / FAIL / skip
    assert f"gpu_check: {len(rows)} pass, 0 FAIL, 0 skip" in proc.stderr
    for r in rows:
        if r[0] == "bf16":
            err = float(re.search(r"max rel\. logit err ([0-9.e+-]+)", r[-2]).group(1))
            assert 0 < err < 0.05, r  # bf16 matmul inputs: ~2^-8 relative
        if r[0] in ("speed", "memory", "compile"):
            loss = float(re.search(r"loss ([0-9.]+)", r[-2]).group(1))
            assert math.isfinite(loss) and 3.0 < loss < 8.0, r  # ~ln(256) = 5.5 at init
            assert re.search(r"\b0 graph breaks", r[-2]), r
    losses = [float(v) for v in re.findall(r"\d+: ([0-9.]+)", rows[sections.index("train")][-2])]
    assert len(losses) == 2 and all(math.isfinite(v) and v > 0 for v in losses)


@pytest.mark.slow  # ~40 s of processes; tests/test_hf.py covers left padding and generation for every scheme
def test_dry_run_hf_section(tmp_path):
    """The Hugging Face rows: every scheme's left-padded batch generates as one prompt at a time,
    and pre_ln / keel are timed against transformers' Llama of the same shape (same weights:
    pre_ln's logits equal the Llama's)."""
    out = tmp_path / "hf.md"
    proc = run_script(out, "--dry-run", "--sections", "hf")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = rows_of(out.read_text())
    assert sorted(r[1] for r in rows if r[0] == "hf") == sorted(SCHEMES)
    assert all("3 of 3 rows equal" in r[-2] and r[-1] == "pass" for r in rows if r[0] == "hf")
    llama = [r for r in rows if r[0] == "hf-llama"]
    assert [r[1] for r in llama] == ["pre_ln", "keel"]
    for r in llama:
        speed = float(re.search(r"speed ([0-9.]+)x", r[-2]).group(1))
        assert 0.05 < speed < 20, r
    dlogits = float(re.search(r"max abs logit difference ([0-9.e+-]+)", llama[0][-2]).group(1))
    assert dlogits < 1e-4, llama[0]  # fp32 on the CPU: the same function


def test_dry_run_fp16_section(tmp_path):
    """The fp16-autocast rows: every scheme's fp16 logits and loss-scaled, unscaled gradient norm
    against fp32, and a paper-64 fp16 run cut back to its half-way checkpoint and resumed to the
    same losses and loss scales, its scaler state checkpointed."""
    out = tmp_path / "fp16.md"
    proc = run_script(out, "--dry-run", "--sections", "fp16")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = rows_of(out.read_text())
    assert sorted(r[1] for r in rows if r[0] == "fp16") == sorted(SCHEMES)
    assert [r[-1] for r in rows] == ["pass"] * len(rows)
    for r in rows:
        if r[0] == "fp16":
            err = float(re.search(r"max rel\. logit err ([0-9.e+-]+)", r[-2]).group(1))
            assert 0 < err < 0.01, r  # fp16 matmul inputs: ~2^-11 relative
    (train,) = [r for r in rows if r[0] == "fp16-train"]
    assert "resumed from step 2" in train[-2] and "scaler state checkpointed" in train[-2]


@pytest.mark.slow  # two torchrun launches: ~80 s on 2 busy cores (tests/test_distributed.py covers the path)
def test_dry_run_fsdp_save_resume(tmp_path):
    """The 2-process FSDP2 + DCP row on gloo: sharded checkpoint written, resumed losses equal."""
    out = tmp_path / "fsdp.md"
    proc = run_script(out, "--dry-run", "--sections", "fsdp")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = rows_of(out.read_text())
    assert row[0] == "fsdp" and row[-1] == "pass", row
    assert "2 shard files" in row[-2]


def test_failed_row_fails_the_script():
    """A row over its threshold reads FAIL and makes the exit status 1."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import gpu_check

    rows = [{"section": "bf16", "scheme": "keel", "max_rel_logit_err": 0.2, "logit_rms": 1.0},
            {"section": "compile", "scheme": "keel", "compile": True, "ckpt": "none", "graph_breaks": 3,
             "graphs": 4, "loss": 5.0, "finite": True},
            {"section": "fsdp", "scheme": "keel", "skipped": "needs 2 GPUs (1 visible)"},
            {"section": "fp16", "scheme": "keel", "max_rel_logit_err": 1e-3, "grad_norm": float("nan"),
             "grad_norm_fp32": 2.0}]  # gradients that overflowed at every scale tried
    assert [gpu_check.status(r, rows, False) for r in rows] == ["FAIL", "FAIL", "skip", "FAIL"]
