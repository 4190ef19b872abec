"""A model too large for this machine is a user mistake (a mistyped depth): one line with the
numbers and exit 2 before anything is built or written. Found by a fresh-user trial: ``keel
gradflow --sublayers 2000000`` built blocks until memory ran out; ``keel stress`` recorded
every run as an error and wrote an empty report with exit 0."""

import re

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


def _one_line_error(capsys, rc: int, what: str = "GiB for their fp32 weights alone") -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and not any("Traceback" in line for line in err)
    assert err[-1].startswith("keel: error: ") and what in err[-1]
    return err[-1]


def test_train_refuses_before_writing_the_run(tmp_path, capsys):
    run = tmp_path / "run"
    rc = main(["train", "--run-dir", str(run), "--set", f"model.n_layers={HUGE_BLOCKS}"])
    assert f"{2 * HUGE_BLOCKS:,} sub-layers" in _one_line_error(capsys, rc)
    assert not run.exists()


def test_gradflow_refuses_a_huge_depth_before_preparing_data(tmp_path, capsys):
    cache = tmp_path / "cache"
    rc = main(["gradflow", "--sublayers", str(2 * HUGE_BLOCKS), "--residual", "keel", "--set", f"data.cache_dir={cache}"])
    _one_line_error(capsys, rc, "weights and gradients and the activations of 4 x 64 tokens need at least")
    assert not cache.exists()  # was: the corpus was tokenized first (15 s), then the model refused


@pytest.mark.parametrize("loop", [None, "1,2,1"])
def test_gradflow_refuses_a_profile_whose_gradients_and_activations_do_not_fit(tmp_path, capsys, monkeypatch, loop):
    """`keel gradflow --loop 1,2,1 --sublayers 100000` passed the check of fp32 weights alone (9.8 GiB of 24)
    and was killed by the kernel after 7 minutes: a profile's forward and backward also hold the gradients
    (4 bytes per parameter) and the activations. The floor, transcribed: 8 bytes per parameter of the
    unrolled model plus activation_floor_bytes at --batch-size x --seq-len tokens; here the weights fit
    and the whole does not."""
    from keel.config import TrainConfig, load_config, resolve_config_path
    from keel.diagnostics import gradflow as G

    L, cache = 68, tmp_path / "cache"
    cfg = G._init_config(load_config(resolve_config_path(None)), "keel", L, 64, 64, 1)  # unlooped, 2 heads of 32
    assert (cfg.n_layers, cfg.d_model, cfg.d_ff, cfg.n_heads, cfg.loop_core) == (L // 2, 64, 192, 2, 0)
    n = count_parameters(cfg)
    need = 8 * n + DV.activation_floor_bytes(cfg, TrainConfig(batch_size=4, seq_len=64), loops=1)
    monkeypatch.setattr(G, "host_memory_bytes", lambda: need - 1)
    monkeypatch.setattr(DV, "host_memory_bytes", lambda: need - 1)  # the fp32 weights alone (4n) fit
    rc = main(["gradflow", "--sublayers", str(L), "--residual", "keel", "--set", f"data.cache_dir={cache}"]
              + (["--loop", loop] if loop else []))
    line = _one_line_error(capsys, rc, "")
    assert line == (f"keel: error: {L} sub-layers at width 64: {n:,} parameters' weights and gradients and the "
                    f"activations of 4 x 64 tokens need at least {need / 2**30:,.1f} GiB, more than the "
                    f"{(need - 1) / 2**30:,.1f} GiB this process may use; profile fewer sub-layers, or lower "
                    "--batch-size, --seq-len or --d-model")
    assert not cache.exists()
    monkeypatch.setattr(G, "host_memory_bytes", lambda: need)
    G.check_profile_fits(cfg, 4, 64)  # exactly fits


@pytest.mark.parametrize("command", ["stress", "lr-sensitivity"])
def test_grids_check_every_run_before_the_first_starts(tiny_data, tmp_path, capsys, command):
    out = tmp_path / "grid"
    rc = main([command, "--sublayers", f"4,{2 * HUGE_BLOCKS}", "--residual", "keel", "--seeds", "0", "--workers", "0",
               "--out", str(out), "--set", f"data.path={tiny_data}"])
    assert "run " in _one_line_error(capsys, rc)  # names the run
    assert not out.exists()  # not even the 4-sub-layer run started


@pytest.mark.parametrize("ac", ["none", "block"])
def test_activation_floor_is_the_rope_tables_and_the_saved_inputs(ac):
    """The floor, transcribed: cos + sin (max_seq_len x head_dim fp32 each), plus per token and block
    the inputs of q, k, v, o and of the FFN's up and down projections (4 d + 2 d_ff fp32 values), or
    one d-vector per block when blocks are recomputed."""
    from keel.config import TrainConfig

    m = ModelConfig(d_model=32, n_layers=3, n_heads=2, n_kv_heads=1, d_ff=64, max_seq_len=128, vocab_size=512)
    t = TrainConfig(batch_size=5, seq_len=16, activation_checkpointing=ac)
    per_block = (4 * 32 + 2 * 64) if ac == "none" else 32
    assert DV.activation_floor_bytes(m, t) == 2 * 128 * 16 * 4 + 5 * 16 * 3 * per_block * 4
    assert DV.activation_floor_bytes(m, t, world_size=2) == 2 * 128 * 16 * 4 + 3 * 16 * 3 * per_block * 4


@pytest.mark.parametrize("scheme,m", [("hyper_connections", 4), ("mhc", 1000), ("attn_res", 1 + 8), ("keel", 1)])
def test_activation_floor_counts_a_multi_stream_schemes_copies(scheme, m):
    """HC/mHC keep n stream copies per sub-layer input, Block AttnRes up to N + 1 sources: each
    sub-layer's stream input (m d values per token) is kept for the backward. hc_streams = 1000
    (a run killed by the OOM killer with no keel line) is now refused before it starts."""
    from keel.config import TrainConfig

    cfg = ModelConfig(d_model=32, n_layers=8, n_heads=2, n_kv_heads=1, d_ff=64, max_seq_len=128, vocab_size=512,
                      residual=scheme, hc_streams=m if scheme in ("hyper_connections", "mhc") else 4)
    t = TrainConfig(batch_size=5, seq_len=16)
    extra = 2 * m * 32 if m > 1 else 0
    assert DV.activation_floor_bytes(cfg, t) == 2 * 128 * 16 * 4 + 5 * 16 * 8 * (4 * 32 + 2 * 64 + extra) * 4
    ckpt = TrainConfig(batch_size=5, seq_len=16, activation_checkpointing="block")
    assert DV.activation_floor_bytes(cfg, ckpt) == 2 * 128 * 16 * 4 + 5 * 16 * 8 * m * 32 * 4


def _limited(limit_bytes: int):
    def preexec():
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, limit_bytes))
    return preexec


WIDE = ["model.d_model=256", "model.d_ff=1024", "model.n_layers=16", "model.n_heads=4", "model.n_kv_heads=2"]


@pytest.mark.parametrize("keys,match", [
    (["train.batch_size=2000", *WIDE], r"train\.batch_size 2000 x train\.seq_len 32 on 32 sub-layers at width 256 "
                                       r"needs at least 12\.0 GiB with its activations, more than the 5\.6 GiB "
                                       r"this process may use; lower the batch"),
    (["model.max_seq_len=200000000"], r"model\.max_seq_len 200,000,000: RoPE's cos and sin tables alone need "
                                    r"23\.8 GiB, more than the 5\.6 GiB"),
])
def test_a_batch_or_context_that_cannot_fit_is_one_line_under_an_address_space_limit(keys, match, tiny_data, tmp_path):
    """Under ``ulimit -v`` 6e9 bytes these ended in the allocator's 81-line traceback (the issue's
    ``batch_size=40000`` is first refused by the corpus-size check on this small corpus: a wider model
    with a batch of 2000 breaks the same bound)."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    from conftest import HANG_S, tiny_overrides

    sets = [a for s in tiny_overrides(tiny_data) for a in ("--set", s)]
    sets += [a for k in keys for a in ("--set", k)]
    r = subprocess.run([str(Path(sys.executable).parent / "keel"), "train", "--run-dir", str(tmp_path / "run"), *sets],
                       capture_output=True, text=True, timeout=HANG_S, preexec_fn=_limited(6 * 10**9))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr[-2000:]
    assert re.search(match, r.stderr), r.stderr
    assert not (tmp_path / "run").exists()


def test_an_allocation_failure_the_estimate_missed_is_one_line(tiny_data, tmp_path):
    """A run that passes the activation floor and still runs out of memory (here mHC's streams and
    the attention under ``ulimit -v`` 3e9 bytes) ended in the allocator's traceback; it is one line
    saying what was asked for and which settings to lower (keel.train.device.memory_errors)."""
    import subprocess
    import sys
    from pathlib import Path

    from conftest import HANG_S, tiny_overrides

    keys = ["train.steps=1", "train.eval_tokens=64", "train.batch_size=1000", "train.seq_len=64", "model.d_model=256",
            "model.d_ff=1024", "model.residual=mhc"]
    sets = [a for s in [*tiny_overrides(tiny_data), *keys] for a in ("--set", s)]
    r = subprocess.run([str(Path(sys.executable).parent / "keel"), "train", "--run-dir", str(tmp_path / "run"), *sets],
                       capture_output=True, text=True, timeout=HANG_S, preexec_fn=_limited(3 * 10**9))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1].startswith(
        "keel: error: out of memory while training (it asked for "), r.stderr[-2000:]
    assert "MiB more): lower train.batch_size (1000) or train.seq_len (64) (raise train.grad_accum, now 1, to keep " \
           "the batch), set train.activation_checkpointing, or train a smaller model" in r.stderr


@pytest.mark.parametrize("error, asked", [
    (RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you "
                  "tried to allocate 196608000 bytes. Error code 12 (Cannot allocate memory)"),
     " (it asked for 188 MiB more)"),
    (RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.2 GiB total capacity)"),
     " (it asked for 2,048 MiB more)"),
    (MemoryError(), ""),
])
def test_memory_errors_names_the_settings_to_lower(error, asked):
    from keel.config import TrainConfig

    with pytest.raises(KeelError, match=rf"^out of memory while training{re.escape(asked)}: lower train\.batch_size "
                                        r"\(8\) or train\.seq_len \(128\)"):
        with DV.memory_errors(TrainConfig(batch_size=8, seq_len=128)):
            raise error
    with pytest.raises(RuntimeError, match="shape mismatch"):  # any other error passes through
        with DV.memory_errors(TrainConfig()):
            raise RuntimeError("shape mismatch")
