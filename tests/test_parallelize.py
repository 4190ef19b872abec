"""keel.train.parallelize in one process: activation checkpointing, torch.compile, gradient
clipping, the memory model, and Keel with a large alpha under bf16 autocast (backward)."""

import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from keel import KeelError
from keel.config import ModelConfig, TrainConfig
from keel.data import TokenLoader
from keel.model import SCHEMES, Transformer
from benchmarks import memory_model as MM
from keel.train import parallelize as par
from keel.train import state_dict as SD
from keel.train.checkpoint import CheckpointManager
from keel.train.optim import build_optimizer



@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run fastest on one thread (intra-op sync costs more than it saves,
    especially on a shared machine); restored afterwards."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)




def tiny(residual="keel", n_layers=3, d_model=32, **kw):
    kw = dict(vocab_size=64, d_model=d_model, n_layers=n_layers, n_heads=2, n_kv_heads=1, d_ff=64,
              max_seq_len=32, residual=residual) | kw
    return ModelConfig(**kw)


def grads_of(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(ids[:, :-1], ids[:, 1:])
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def twin(cfg):
    torch.manual_seed(0)
    a = Transformer(cfg)
    b = Transformer(cfg)
    b.load_state_dict(a.state_dict())
    return a, b


# --------------------------------------------------------------------------- activation checkpointing


@pytest.mark.parametrize("residual", sorted(SCHEMES))
@pytest.mark.parametrize("mode", ["block", "every_k"])
def test_activation_checkpointing_gives_identical_gradients(residual, mode):
    """Recomputation runs the same CPU kernels on the same inputs: bit-identical gradients."""
    ref, ac = twin(tiny(residual, n_layers=3))
    chosen = par.apply_activation_checkpointing(ac, mode, every_k=2)
    assert chosen == ([0, 1, 2] if mode == "block" else [0, 2])
    ids = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(1))
    loss_ref, g_ref = grads_of(ref, ids)
    loss_ac, g_ac = grads_of(ac, ids)
    assert torch.equal(loss_ref, loss_ac)
    assert g_ref.keys() == g_ac.keys()  # no renamed parameters
    for name in g_ref:
        assert torch.equal(g_ref[name], g_ac[name]), name
    if residual == "keel":  # generation (no grad, KV cache) goes through the plain forward
        out = ac.generate(ids[:1, :4], 3, temperature=0)
        assert torch.equal(out, ref.generate(ids[:1, :4], 3, temperature=0))


def test_activation_checkpointing_frees_block_activations():
    """With every block checkpointed, the forward keeps only the block inputs alive."""
    cfg = tiny("keel", n_layers=4)
    torch.manual_seed(0)
    model = Transformer(cfg)
    ids = torch.randint(0, 64, (2, 17))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def saved_bytes():
        seen = {}

        def pack(t):
            st = t.untyped_storage()
            if st.data_ptr() not in params:
                seen[st.data_ptr()] = st.nbytes()
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(ids[:, :-1], ids[:, 1:])
        return sum(seen.values())

    before = saved_bytes()
    par.apply_activation_checkpointing(model, "block")
    after = saved_bytes()
    per_block = MM.activation_bytes_per_block(2, 16, 32, 64, 2, 1, "keel")
    # each of the 4 blocks drops (activations - nothing): its input is saved by the next op anyway
    assert before - after >= 3 * per_block
    assert after < before / 2


@pytest.mark.parametrize("n,k", [(7, 1), (7, 2), (7, 3), (512, 4)])
def test_checkpointed_blocks_every_k(n, k):
    assert par.checkpointed_blocks(n, "every_k", k) == [b for b in range(n) if b % k == 0]
    assert par.checkpointed_blocks(n, "block") == list(range(n))
    assert par.checkpointed_blocks(n, "none") == []


def test_checkpointing_errors():
    with pytest.raises(KeelError, match=r"activation_checkpointing must be 'none' \| 'block' \| 'every_k', got 'layer'"):
        par.checkpointed_blocks(4, "layer")
    with pytest.raises(KeelError, match="train.activation_checkpoint_k must be >= 1"):
        par.checkpointed_blocks(4, "every_k", 0)


# --------------------------------------------------------------------------- memory model


@pytest.mark.parametrize("residual", sorted(SCHEMES))
@pytest.mark.parametrize("shape", [(1, 24, 48, 80, 4, 2), (3, 12, 64, 160, 8, 2), (2, 20, 40, 96, 5, 5)])
def test_activation_formula_matches_saved_tensors(residual, shape):
    B, T, d, f, H, K = shape
    cfg = ModelConfig(vocab_size=8, d_model=d, n_layers=3, n_heads=H, n_kv_heads=K, d_ff=f, max_seq_len=T,
                      residual=residual)
    measured = MM.measure_activation_bytes_per_block(cfg, B, T)
    assert MM.activation_bytes_per_block(B, T, d, f, H, K, residual) == measured
    if residual == "keel":  # the docstring's formula, transcribed
        hd, kv = d // H, K * (d // H)
        assert measured == 4 * (B * T * (9 * d + 4 * f + 2 * kv + H + 4) + T * hd)


@pytest.mark.parametrize("mode,k", [("none", 2), ("block", 2), ("every_k", 3)])
def test_memory_estimate_formula(mode, k):
    P, n, B, T, d, f, H, K, V = 1000, 10, 2, 16, 32, 64, 2, 1, 100
    est = MM.memory_estimate(P, n, B, T, d, f, H, K, V, "pre_ln", mode, k)
    a = MM.activation_bytes_per_block(B, T, d, f, H, K, "pre_ln")
    n_ckpt = {"none": 0, "block": n, "every_k": len(range(0, n, k))}[mode]
    acts = (n - n_ckpt) * a + n_ckpt * 4 * B * T * d + (a if n_ckpt else 0)
    assert est["params"] == est["grads"] == 4 * P and est["optimizer"] == 8 * P
    assert est["activations"] == acts
    assert est["head"] == 8 * B * T * V + 4 * B * T * d
    assert est["total"] == 16 * P + acts + est["head"]
    assert est["forward_peak"] == 12 * P + acts + est["head"]
    assert est["optimizer_peak"] == 20 * P
    assert est["peak"] == max(12 * P + acts + est["head"], 20 * P)
    fused = MM.memory_estimate(P, n, B, T, d, f, H, K, V, "pre_ln", mode, k, fused_adamw=True)
    assert fused["optimizer_peak"] == 16 * P


# --------------------------------------------------------------------------- gradient clipping


def test_clip_grad_norm_is_the_total_l2_norm():
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(s)) for s in ((3, 4), (5,), (2, 2, 2))]
    for p in ps:
        p.grad = torch.randn_like(p)
    before = [p.grad.clone() for p in ps]
    direct = math.sqrt(sum(float((g.double() ** 2).sum()) for g in before))
    norm = SD.clip_grad_norm_(ps, max_norm=0.5)
    assert norm == pytest.approx(direct, rel=1e-6)
    coef = min(1.0, 0.5 / (direct + 1e-6))
    for p, g in zip(ps, before):
        torch.testing.assert_close(p.grad, g * coef)
    assert SD.clip_grad_norm_(ps, float("inf")) == pytest.approx(0.5, rel=1e-5)


# --------------------------------------------------------------------------- torch.compile


@pytest.mark.compiles
def test_compiled_model_checkpoints_load_both_ways(tmp_path):
    """Whole-model torch.compile names parameters `_orig_mod.*`; checkpoints never do."""
    torch.manual_seed(0)
    plain = Transformer(tiny())
    compiled = torch.compile(Transformer(tiny()), backend="eager")
    assert all(k.startswith("_orig_mod.") for k in compiled.state_dict())

    ck = CheckpointManager(tmp_path / "a").save(1, compiled, {"step": 1})
    assert all(not k.startswith("_orig_mod.") for k in load_file(ck / "model.safetensors"))
    CheckpointManager.load_weights(plain, ck)  # compiled -> uncompiled
    assert all(torch.equal(plain.state_dict()[k], v) for k, v in par.unwrap(compiled).state_dict().items())

    torch.manual_seed(1)
    other = Transformer(tiny())
    ck2 = CheckpointManager(tmp_path / "b").save(1, other, {"step": 1})
    CheckpointManager.load_weights(compiled, ck2)  # uncompiled -> compiled
    ids = torch.randint(0, 64, (1, 8))
    # same weights; under compile the norms run as their composite form (fp32 rounding apart)
    torch.testing.assert_close(compiled(ids), other(ids), rtol=1e-5, atol=1e-6)

    # a file written from the compiled module's own state_dict (prefixed names) also loads
    raw = tmp_path / "raw"
    raw.mkdir()
    save_file({k: v.contiguous() for k, v in compiled.state_dict().items()}, str(raw / "model.safetensors"))
    fresh = Transformer(tiny())
    CheckpointManager.load_weights(fresh, raw)
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in other.state_dict().items())

    # per-block compile (what train.compile does) keeps the plain names
    blockwise = Transformer(tiny())
    par.apply_compile(blockwise, backend="eager")
    assert list(blockwise.state_dict()) == list(plain.state_dict())


def test_load_weights_mismatch_is_a_keel_error(tmp_path):
    ck = CheckpointManager(tmp_path).save(1, Transformer(tiny(n_layers=2)), {"step": 1})
    with pytest.raises(KeelError, match="does not match the model"):
        CheckpointManager.load_weights(Transformer(tiny(n_layers=3)), ck)
    with pytest.raises(KeelError, match="does not match the model"):
        CheckpointManager.load_weights(Transformer(tiny(n_layers=2, d_ff=96)), ck)


def test_tied_embeddings_checkpoint_roundtrip(tmp_path):
    torch.manual_seed(0)
    a = Transformer(tiny(tie_embeddings=True))
    ck = CheckpointManager(tmp_path).save(1, dict(a.state_dict()), {"step": 1}, aliases={"tok_emb.weight": "lm_head.weight"})
    assert set(load_file(ck / "model.safetensors")) == set(a.state_dict()) - {"tok_emb.weight"}
    b = Transformer(tiny(tie_embeddings=True, init_std=0.5))
    CheckpointManager.load_weights(b, ck)
    assert b.lm_head.weight is b.tok_emb.weight and torch.equal(b.tok_emb.weight, a.tok_emb.weight)


@pytest.mark.compiles
@pytest.mark.parametrize("residual", [pytest.param(s, marks=pytest.mark.slow) if s == "mhc" else s for s in sorted(SCHEMES)])
def test_compile_with_checkpointing_matches_eager(residual):  # mhc: slow (~40 s); test_compile's [mhc-block] covers it
    """Dynamo + AOTAutograd (the graph capture and autograd of torch.compile) through the
    checkpointed blocks; inductor's C++ code generation is the slow test below."""
    # apply_compile is fullgraph: Block.forward's recompiles over 10 schemes in one process would
    # pass Dynamo's recompile limit (8) and fail; each scheme starts from a fresh Dynamo
    torch._dynamo.reset()
    ref, comp = twin(tiny(residual, n_layers=2))
    par.apply_activation_checkpointing(comp, "block")
    par.apply_compile(comp, backend="aot_eager")
    ids = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(2))
    loss_ref, g_ref = grads_of(ref, ids)
    loss_c, g_c = grads_of(comp, ids)
    torch.testing.assert_close(loss_c, loss_ref, rtol=1e-6, atol=0)
    for name in g_ref:
        torch.testing.assert_close(g_c[name], g_ref[name], rtol=1e-5, atol=1e-7)
    assert [n for n, _ in comp.named_parameters()] == [n for n, _ in ref.named_parameters()]
    if residual == "keel":  # generation with a KV cache takes the eager forward of each block
        torch.testing.assert_close(comp.generate(ids[:1, :4], 3, temperature=0),
                                   ref.generate(ids[:1, :4], 3, temperature=0), rtol=0, atol=0)


@pytest.mark.slow  # deselected by default (pyproject addopts); run with `pytest -m slow`
@pytest.mark.parametrize("residual", ["keel", "pre_ln"])
def test_inductor_compile_with_checkpointing_matches_eager(residual):
    """Real inductor (C++ codegen on CPU): ~1-3 min per scheme on a loaded 2-core machine.
    Fused kernels reorder fp32 reductions: ~1e-7 relative differences."""
    ref, comp = twin(tiny(residual, n_layers=2))
    par.apply_activation_checkpointing(comp, "block")
    par.apply_compile(comp)
    ids = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(2))
    for _ in range(2):  # second call reuses the compiled graphs
        loss_ref, g_ref = grads_of(ref, ids)
        loss_c, g_c = grads_of(comp, ids)
        torch.testing.assert_close(loss_c, loss_ref, rtol=1e-5, atol=0)
        for name in g_ref:
            torch.testing.assert_close(g_c[name], g_ref[name], rtol=1e-4, atol=1e-6)


# --------------------------------------------------------------------------- Keel, large alpha, bf16


@pytest.mark.parametrize("alpha", [1024.0, 2048.0])
def test_keel_large_alpha_bf16_autocast_gradients_match_fp32(alpha):
    """Backward of Keel with alpha >= 1024 under bf16 autocast vs fp32.

    Tolerance: bf16 keeps 8 significant bits, unit roundoff u = 2^-8 = 3.9e-3. Each matmul
    rounds its inputs once (relative error <= u each), the backward goes through ~3
    matmuls per gradient; independent roundings add in quadrature, so a gradient tensor's
    relative error is a small multiple of u: we allow 4u = 1.6e-2 per tensor (measured:
    at most 8.6e-3) and require a global cosine similarity > 0.9999. A residual sum formed
    in bf16 (alpha * x + F with alpha >= 256) would round F away and wreck both.
    """
    cfg = ModelConfig(vocab_size=128, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=32,
                      residual="keel", alpha=alpha)
    torch.manual_seed(0)
    model = Transformer(cfg)
    ids = torch.randint(0, 128, (4, 33), generator=torch.Generator().manual_seed(0))
    _, g32 = grads_of(model, ids)
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(ids[:, :-1], ids[:, 1:])
    loss.backward()
    g16 = {n: p.grad for n, p in model.named_parameters()}
    u = 2.0 ** -8
    for name, g in g32.items():
        rel = ((g16[name] - g).norm() / g.norm()).item()
        assert rel < 4 * u, (name, rel)
    flat32 = torch.cat([g.flatten() for g in g32.values()])
    flat16 = torch.cat([g16[n].flatten() for n in g32])
    assert torch.nn.functional.cosine_similarity(flat16, flat32, dim=0) > 0.9999


def test_deep_narrow_keel_learns_under_bf16_autocast(tiny_data):
    """A 24-sub-layer Keel with alpha = 1024, width 32, trained 30 steps in bf16 autocast.

    At init the loss is ln 512 = 6.24 (uniform); a model whose sub-layers' contributions were
    rounded away would stay near there. Measured: 6.24 -> ~5.4 (mean of the last 5 steps)."""
    cfg = ModelConfig(vocab_size=512, d_model=32, n_layers=12, n_heads=2, n_kv_heads=1, d_ff=64, max_seq_len=32,
                      residual="keel", alpha=1024.0)
    torch.manual_seed(0)
    model = Transformer(cfg)
    tc = TrainConfig(lr=1e-2)
    opt = build_optimizer(model, tc)
    loader = TokenLoader(tiny_data, batch_size=8, seq_len=32, seed=0)
    losses = []
    for step in range(30):
        batch = loader.next_batch()
        for g in opt.param_groups:
            g["lr"] = tc.lr * min(1.0, (step + 1) / 5)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(batch[:, :-1], batch[:, 1:])
        loss.backward()
        SD.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert losses[0] == pytest.approx(math.log(512), abs=0.3)
    assert all(math.isfinite(x) for x in losses)
    assert sum(losses[-5:]) / 5 < losses[0] - 0.6, losses


# --------------------------------------------------------------------------- MFU accounting


@pytest.mark.parametrize("residual,tie", [("keel", False), ("pre_ln", True), ("post_ln", False)])
def test_flops_per_token_is_palm_appendix_b(residual, tie):
    """6 N + 12 n d T with N = parameters without the input embedding (PaLM, App. B)."""
    from keel.model import flops_per_token

    cfg = tiny(residual, n_layers=3, d_model=64, n_heads=4, n_kv_heads=2, d_ff=160, tie_embeddings=tie)
    model = Transformer(cfg)
    n = sum(p.numel() for p in model.parameters()) - model.tok_emb.weight.numel()
    assert flops_per_token(cfg, 32) == 6 * n + 12 * 3 * 64 * 32
    # and by hand, per block: q,o d*d each; k,v d*(K*hd) each; FFN 3*d*f; norms
    kv = 2 * 16  # K * head_dim
    norms = {"keel": 4 * 64, "pre_ln": 2 * 64, "post_ln": 2 * 64}[residual]
    if residual == "keel":
        norms_total = 3 * norms - 64  # sub-layer 0 has no outer norm (first-layer rule)
    else:
        norms_total = 3 * norms
    per_block = 2 * 64 * 64 + 2 * 64 * kv + 3 * 64 * 160
    final = 64 if residual == "pre_ln" else 0
    head = 0 if tie else 64 * 64  # vocab 64 x d 64; tied: the head is the embedding, excluded
    assert n == 3 * per_block + norms_total + final + head


def test_gpu_peak_table():
    from keel.train.device import gpu_peak_flops, peak_flops

    assert peak_flops(torch.device("cpu")) is None and peak_flops(torch.device("cpu"), 2.5) == 2.5e12
    assert gpu_peak_flops("NVIDIA H200") == 989e12
    assert gpu_peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert gpu_peak_flops("NVIDIA H100 PCIe") == 756e12
    assert gpu_peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert gpu_peak_flops("Some Future GPU") is None


def test_trainer_activation_checkpointing_changes_nothing_but_memory(tiny_config, tmp_path):
    """train.activation_checkpointing through keel.train.train: the same losses, bit for bit."""
    import json

    from keel.train import train

    def losses(run, **kw):
        train(tiny_config(steps=3, eval_every=3, checkpoint_every=3, **kw), run)
        return [(r.get("loss"), r.get("grad_norm"), r.get("val_loss"))
                for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())]

    ref = losses(tmp_path / "plain")
    assert losses(tmp_path / "block", activation_checkpointing="block") == ref
    assert losses(tmp_path / "every_k", activation_checkpointing="every_k", activation_checkpoint_k=2) == ref
