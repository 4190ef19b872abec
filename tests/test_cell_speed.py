"""benchmarks/cell_speed.py: the study's reference cell it builds, and its projection of a run's time."""

from __future__ import annotations

import pytest

from benchmarks import cell_speed as CS


def test_the_reference_cell_is_the_cpu_studys_deepest_transfer_run():
    """256 sub-layers x width 64 (claims.toml, scale cpu, group transfer), 8 x 128 tokens, 1,000 steps."""
    cfg = CS.cell_config("claims", "cpu", "transfer", "keel", None)
    m, t = cfg.model, cfg.train
    assert (m.residual, m.n_layers, m.d_model, m.n_heads, m.n_kv_heads, m.d_ff, m.vocab_size) == \
        ("keel", 128, 64, 4, 2, 192, 512)
    assert (t.batch_size, t.seq_len, t.steps, t.eval_every, t.eval_tokens, t.compile) == (8, 128, 1000, 125, 16384, False)
    with pytest.raises(SystemExit, match="has no group 'nope'"):
        CS.cell_config("claims", "cpu", "nope", "keel", None)


def test_a_projected_run_is_start_up_compile_steps_and_validation():
    """run = start-up + compile (first step and first validation less steady ones) + steps x step + passes x pass."""
    out = {"steps": 1000, "evals": 9, "tokens_per_step": 1024, "paths": {"compiled": {
        "startup_s": 0.5, "first_step": (31.0, 21.0), "first_val": (7.0, 5.0),
        "rounds": [{"step_wall": w, "step_cpu": c, "val_wall": 2.0, "val_cpu": 1.5, "load": 2.0}
                   for w, c in ((1.0, 0.8), (1.2, 0.9), (5.0, 0.7))]}}}
    CS.project(out, "compiled")
    d = out["paths"]["compiled"]
    assert (d["step_wall"], d["step_cpu"], d["compile_wall"], d["compile_cpu"]) == (1.2, 0.8, 29.8 + 5.0, 20.2 + 3.5)
    assert d["run_cpu"] == pytest.approx(0.5 + 23.7 + 1000 * 0.8 + 9 * 1.5)
    assert d["tokens_per_s_cpu"] == pytest.approx(1000 * 1024 / d["run_cpu"])
