"""A model too large for this machine is a user mistake (a mistyped depth): one line with the
numbers and exit 2 before anything is built or written. Found by a fresh-user trial: ``keel
gradflow --sublayers 2000000`` built blocks until memory ran out; ``keel stress`` recorded
every run as an error and wrote an empty report with exit 0."""

import pytest

from keel.cli import main
from keel.config import ModelConfig
from keel.errors import KeelError
from keel.model import count_parameters
from keel.train import device as DV

HUGE_BLOCKS = 100_000_000  # 2e8 sub-layers: tens of TiB of fp32 weights at any width here


@pytest.mark.parametrize("residual", ["keel", "pre_ln", "attn_res"])
def test_check_model_fits_at_the_boundary(monkeypatch, residual):
    cfg = ModelConfig(d_model=32, n_layers=3, n_heads=2, n_kv_heads=1, d_ff=64, vocab_size=512, residual=residual)
    need = count_parameters(cfg) * 4  # fp32 weights: 4 bytes per parameter
    monkeypatch.setattr(DV, "host_memory_bytes", lambda: need)
    DV.check_model_fits(cfg, 4, "their fp32 weights")  # exactly fits
    monkeypatch.setattr(DV, "host_memory_bytes", lambda: need - 1)
    with pytest.raises(KeelError, match=rf"6 sub-layers at width 32: {count_parameters(cfg):,} parameters need "
                                        r"0\.0 GiB for their fp32 weights alone, more than this machine's 0\.0 GiB"):
        DV.check_model_fits(cfg, 4, "their fp32 weights")


def _one_line_error(capsys, rc: int) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and not any("Traceback" in line for line in err)
    assert err[-1].startswith("keel: error: ") and "GiB for their fp32 weights alone" in err[-1]
    return err[-1]


def test_train_refuses_before_writing_the_run(tmp_path, capsys):
    run = tmp_path / "run"
    rc = main(["train", "--run-dir", str(run), "--set", f"model.n_layers={HUGE_BLOCKS}"])
    assert f"{2 * HUGE_BLOCKS:,} sub-layers" in _one_line_error(capsys, rc)
    assert not run.exists()


def test_gradflow_refuses_a_huge_depth_before_preparing_data(tmp_path, capsys):
    cache = tmp_path / "cache"
    rc = main(["gradflow", "--sublayers", str(2 * HUGE_BLOCKS), "--residual", "keel", "--set", f"data.cache_dir={cache}"])
    _one_line_error(capsys, rc)
    assert not cache.exists()  # was: the corpus was tokenized first (15 s), then the model refused


@pytest.mark.parametrize("command", ["stress", "lr-sensitivity"])
def test_grids_check_every_run_before_the_first_starts(tiny_data, tmp_path, capsys, command):
    out = tmp_path / "grid"
    rc = main([command, "--sublayers", f"4,{2 * HUGE_BLOCKS}", "--residual", "keel", "--seeds", "0", "--workers", "0",
               "--out", str(out), "--set", f"data.path={tiny_data}"])
    assert "run " in _one_line_error(capsys, rc)  # names the run
    assert not out.exists()  # not even the 4-sub-layer run started
