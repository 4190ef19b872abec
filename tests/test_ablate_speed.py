"""benchmarks/ablate_speed.py: both paths on the study's importance cell, their results and the work each runs."""

from __future__ import annotations

from benchmarks import ablate_speed as AS


def test_the_benchmark_compares_equal_results_and_counts_the_sub_layers_each_path_runs(capsys):
    """4 sub-layers, one batch: recomputing runs the full pass (4) and 4 passes of 3; starting from the kept
    state before sub-layer i runs the full pass and 3 + 2 + 1 + 0 (sub-layers i + 1 .. 3)."""
    assert AS.main(["--sublayers", "4", "--tokens", "256", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    assert "keel, 4 sub-layers x width 64, 256 tokens per pass (5 passes)" in out
    assert "| recompute | 16 |" in out and "| kept | 10 |" in out
    assert "same result, bit for bit: True" in out
