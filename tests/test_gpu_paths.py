"""GPU-only decisions proven on CPU: which GPU a torchrun rank takes, ``train.precision`` (checked at
load, refused on a GPU without native bf16), the FSDP2 bf16 MixedPrecisionPolicy (gloo), and
validation through the chunked loss (no [B, T, V] logits)."""

import logging

import pytest
import torch
import torch.nn.functional as F

from conftest import REPO
from keel import KeelError, ModelConfig, Transformer
from keel.config import load_config
from keel.train.device import PRECISIONS, autocast_context, resolve_precision
from keel.train.dist import rank_device
from keel.train.nll import summed_nll

pytestmark = pytest.mark.spawns  # starts processes: the e2e tier (tests/conftest.py)

CUDA = torch.device("cuda")


@pytest.mark.parametrize("spec", ["cuda", "cuda:0", "cuda:1"])
def test_every_rank_takes_its_local_gpu(spec):
    """``train.device = "cuda:0"`` under torchrun: rank r uses cuda:r, not GPU 0 for everyone."""
    assert [rank_device(torch.device(spec), r, 4) for r in range(4)] == [torch.device("cuda", r) for r in range(4)]
    assert rank_device(torch.device("cpu"), 3, 0) == torch.device("cpu")
    with pytest.raises(KeelError, match="LOCAL_RANK 2 has no GPU"):
        rank_device(torch.device(spec), 2, 2)


def test_precision_keys_checked_at_load(tiny_data):
    for p in PRECISIONS:
        assert load_config(REPO / "keel" / "configs" / "demo.toml", [f"train.precision={p}"]).train.precision == p
    with pytest.raises(KeelError, match="train.precision"):
        load_config(REPO / "keel" / "configs" / "demo.toml", ["train.precision=fp16"])


@pytest.mark.parametrize("native", [True, False])
def test_bf16_only_where_the_gpu_has_it(monkeypatch, caplog, native):
    """auto = bf16-autocast on an Ampere+ GPU, fp32 (said in the log) on an older one, where an
    explicit bf16 precision is a one-line error; the CPU autocasts only when asked."""
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: native)
    with caplog.at_level(logging.WARNING, logger="keel"):
        assert resolve_precision(CUDA, "auto") == ("bf16-autocast" if native else "fp32")
    assert ("no native bf16" in caplog.text) == (not native)
    for p in ("bf16", "bf16-autocast"):
        if native:
            assert resolve_precision(CUDA, p) == p
        else:
            with pytest.raises(KeelError, match="needs a GPU with native bf16") as e:
                resolve_precision(CUDA, p)
            assert "\n" not in str(e.value)
    assert resolve_precision(CUDA, "fp32") == "fp32"
    cpu = torch.device("cpu")
    assert resolve_precision(cpu, "auto") == "fp32"
    assert autocast_context(cpu, "bf16-autocast").fast_dtype == torch.bfloat16
    assert autocast_context(cpu, "bf16").fast_dtype == torch.bfloat16  # not sharded: autocast
    assert not isinstance(autocast_context(cpu, "bf16", sharded=True), torch.autocast)  # FSDP2's policy instead
    assert not isinstance(autocast_context(cpu, "fp32"), torch.autocast)


def tiny(scheme="keel"):
    return ModelConfig(vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=16,
                       residual=scheme)


def test_validation_never_forms_full_logits(one_thread):
    """summed_nll on a keel model goes through the chunked loss: the LM head module is never
    called (no [B, T, V] logits), and the sum equals the logits-based cross-entropy."""
    torch.manual_seed(0)
    model = Transformer(tiny())
    windows = torch.randint(0, 61, (5, 13), generator=torch.Generator().manual_seed(1))
    calls = []
    handle = model.lm_head.register_forward_hook(lambda *a: calls.append(1))
    nats, n = summed_nll(model, windows, 2, "cpu")
    assert calls == [] and n == 5 * 12
    handle.remove()
    with torch.no_grad():
        logits = model(windows[:, :-1])
    ref = F.cross_entropy(logits.reshape(-1, 61), windows[:, 1:].reshape(-1), reduction="sum")
    assert nats == pytest.approx(float(ref), rel=1e-6)


def _fsdp_bf16_worker(rank, world_size, port, out):
    import os

    import torch.distributed as dist

    from keel.train.parallelize import apply_fsdp

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        torch.manual_seed(0)
        model = Transformer(tiny())
        ref = Transformer(tiny())
        ref.load_state_dict(model.state_dict())
        apply_fsdp(model, bf16=True)
        seen = []
        model.blocks[0].attn.wq.register_forward_pre_hook(lambda m, a: seen.append(m.weight.dtype))
        ids = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(rank))
        loss = model(ids, ids.roll(-1, 1))
        loss.backward()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ref_loss = ref(ids, ids.roll(-1, 1))
        p = model.blocks[0].attn.wq.weight
        if rank == 0:
            torch.save({"seen": [str(d) for d in seen], "param": str(p.dtype), "grad": str(p.grad.dtype),
                        "loss": float(loss), "ref": float(ref_loss)}, out)
    finally:
        dist.destroy_process_group()


def test_fsdp2_bf16_mixed_precision_policy_on_gloo(tmp_path):
    """train.precision = "bf16" under FSDP2 (2 processes, gloo): the blocks compute with bf16
    parameters, the shards and their gradients stay fp32, and the loss is the bf16-autocast one
    within bf16 rounding."""
    import torch.multiprocessing as mp

    from spawn import free_port

    out = tmp_path / "r.pt"
    mp.start_processes(_fsdp_bf16_worker, args=(2, free_port(), str(out)), nprocs=2, join=True,
                       start_method="spawn")
    r = torch.load(out)
    assert r["seen"] == ["torch.bfloat16"]
    assert r["param"] == r["grad"] == "torch.float32"
    assert r["loss"] == pytest.approx(r["ref"], rel=2e-2)
