"""HybridNorm and Mix-LN: each unit against a direct transcription of its paper's equations
(float64, random norm gains), QKV-Norm inside attention, GQA shapes, gradients, and Mix-LN's
Post-LN/Pre-LN split at its boundaries."""

import math

import pytest
import torch
import torch.nn as nn

from keel import KeelError, ModelConfig, Transformer
from keel.model import SCHEMES, Attention, RMSNorm, apply_rope, rope_tables
from keel.model.residual.single_stream import HybridNorm, MixLN, mix_ln_post_blocks
from test_model import rmsnorm_ref  # the RMSNorm transcription shared by the scheme tests


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


class HybridNormStar(HybridNorm):
    """HybridNorm* (Zhuo et al. 2025, arXiv 2503.04598; official README's
    ``norm_pos_special_config``): :class:`HybridNorm`, except that block 0 (sub-layers 0 and
    1) is Pre-Norm: ``x + F(Norm(x))`` for both its attention (QKV-Norm still on) and its FFN.

    Not registered in ``SCHEMES``, so ``model.residual`` does not accept it; defined here, where
    it is used.
    """

    first_block_pre_norm = True


def small_cfg(**kw):
    base = dict(vocab_size=97, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=48, max_seq_len=32)
    base.update(kw)
    return ModelConfig(**base)


# ---- direct transcriptions (float64) ----------------------------------------------------



def randomize_gains(module, seed=1):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, RMSNorm):
                m.weight.copy_(torch.rand(m.weight.shape, generator=gen, dtype=m.weight.dtype) + 0.5)


def make_f(d, seed=0):
    torch.manual_seed(seed)
    lin = nn.Linear(d, d, bias=False).double()
    return lambda h: torch.tanh(lin(h)) * 3.0


def unit(cls, cfg, index):
    u = cls(cfg, index).double()
    randomize_gains(u, seed=index + 1)
    return u


# ---- HybridNorm (Zhuo et al. 2025, arXiv 2503.04598; official configs) ---------------------

@pytest.mark.parametrize("index", [0, 2, 6])
def test_hybridnorm_attention_unit_is_plain_residual(index):
    """Y = X + MHA_QKV(X): no norm around the attention sub-layer (attn_norm: false)."""
    cfg = small_cfg(residual="hybridnorm")
    u = unit(HybridNorm, cfg, index)
    assert u.norm is None and list(u.parameters()) == []
    x = torch.randn(2, 5, cfg.d_model, dtype=torch.float64)
    f = make_f(cfg.d_model)
    torch.testing.assert_close(u(x, f), x + f(x), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("index", [1, 3, 7])
def test_hybridnorm_ffn_unit_matches_formula(index):
    """X_next = FFN(Norm(Y)) + Norm(Y) (ffn_norm: true, ffn_residual_after_norm: true)."""
    cfg = small_cfg(residual="hybridnorm")
    u = unit(HybridNorm, cfg, index)
    x = torch.randn(2, 5, cfg.d_model, dtype=torch.float64) * 3
    f = make_f(cfg.d_model)
    h = rmsnorm_ref(x, u.norm.weight, cfg.norm_eps)
    ref = f(h) + h
    out = u(x, f)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    # not Post-LN's Norm(x + F(x)), not Pre-LN's x + F(Norm(x))
    assert (out - rmsnorm_ref(x + f(x), u.norm.weight, cfg.norm_eps)).abs().max() > 0.1
    assert (out - (x + f(h))).abs().max() > 0.1


def test_hybridnorm_star_first_block_is_pre_norm():
    """HybridNorm*: block 0 is Pre-Norm for attention and FFN; later blocks as HybridNorm."""
    cfg = small_cfg(residual="hybridnorm")
    x = torch.randn(2, 5, cfg.d_model, dtype=torch.float64) * 2
    f = make_f(cfg.d_model)
    for index in (0, 1):
        u = unit(HybridNormStar, cfg, index)
        ref = x + f(rmsnorm_ref(x, u.norm.weight, cfg.norm_eps))
        torch.testing.assert_close(u(x, f), ref, rtol=1e-12, atol=1e-12)
    a, b = unit(HybridNormStar, cfg, 2), unit(HybridNormStar, cfg, 3)
    torch.testing.assert_close(a(x, f), x + f(x), rtol=1e-12, atol=1e-12)
    h = rmsnorm_ref(x, b.norm.weight, cfg.norm_eps)
    torch.testing.assert_close(b(x, f), h + f(h), rtol=1e-12, atol=1e-12)
    assert HybridNormStar.attention_qkv_norm and HybridNormStar.final_norm


@pytest.mark.parametrize("n_heads,n_kv_heads", [(4, 4), (4, 2), (4, 1), (6, 3)])
def test_qkv_norm_attention_matches_explicit(n_heads, n_kv_heads):
    """attn_QKV(Q, K, V) = softmax(Norm(Q_i) Norm(K_i)^T / sqrt(hd)) Norm(V_i) per head i,
    the norm over head_dim with one gain per projection, applied before RoPE."""
    cfg = small_cfg(d_model=48, n_heads=n_heads, n_kv_heads=n_kv_heads)
    torch.manual_seed(0)
    attn = Attention(cfg, qkv_norm=True).double()
    randomize_gains(attn)
    assert attn.q_norm.weight.shape == attn.k_norm.weight.shape == attn.v_norm.weight.shape == (cfg.head_dim,)
    B, T, hd = 2, 9, cfg.head_dim
    x = torch.randn(B, T, cfg.d_model, dtype=torch.float64)
    cos, sin = (t.double() for t in rope_tables(T, hd, cfg.rope_theta))
    out = attn(x, cos, sin)
    assert out.shape == (B, T, cfg.d_model) and out.dtype == torch.float64
    eps = cfg.norm_eps
    q = rmsnorm_ref((x @ attn.wq.weight.T).view(B, T, n_heads, hd), attn.q_norm.weight, eps)
    k = rmsnorm_ref((x @ attn.wk.weight.T).view(B, T, n_kv_heads, hd), attn.k_norm.weight, eps)
    v = rmsnorm_ref((x @ attn.wv.weight.T).view(B, T, n_kv_heads, hd), attn.v_norm.weight, eps)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    rep = n_heads // n_kv_heads
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(hd)
    scores = scores.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf"))
    y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, -1) @ attn.wo.weight.T
    torch.testing.assert_close(out, y, rtol=1e-10, atol=1e-10)


def test_hybridnorm_model_matches_block_equations():
    """The whole model: embedding -> [Y = X + MHA_QKV(X); X = Norm(Y) + FFN(Norm(Y))] x n -> Norm -> head."""
    cfg = small_cfg(residual="hybridnorm", n_layers=3)
    torch.manual_seed(0)
    model = Transformer(cfg).double()
    randomize_gains(model)
    ids = torch.randint(0, cfg.vocab_size, (2, 7))
    cos, sin = (t.double() for t in rope_tables(7, cfg.head_dim, cfg.rope_theta))
    x = model.tok_emb.weight[ids]
    for blk in model.blocks:
        assert blk.attn.q_norm is not None
        y = x + blk.attn(x, cos, sin)
        h = rmsnorm_ref(y, blk.ffn_residual.norm.weight, cfg.norm_eps)
        x = h + blk.ffn(h)
    ref = rmsnorm_ref(x, model.norm.weight, cfg.norm_eps) @ model.lm_head.weight.T
    torch.testing.assert_close(model(ids), ref.float(), rtol=1e-6, atol=1e-6)  # logits are cast to fp32


# ---- Mix-LN (Li et al. 2024, arXiv 2412.13795; reference code NORM_TYPE=post_pre) ----------

@pytest.mark.parametrize("ratio,n_layers,index,post", [
    (0.25, 4, 0, True), (0.25, 4, 1, True), (0.25, 4, 2, False), (0.25, 4, 7, False),
    (0.5, 4, 3, True), (0.5, 4, 4, False),
])
def test_mix_ln_unit_matches_formula(ratio, n_layers, index, post):
    cfg = small_cfg(residual="mix_ln", n_layers=n_layers, mix_ln_ratio=ratio)
    u = unit(MixLN, cfg, index)
    assert u.post == post
    x = torch.randn(2, 5, cfg.d_model, dtype=torch.float64) * 2
    f = make_f(cfg.d_model)
    g = u.norm.weight
    ref = rmsnorm_ref(x + f(x), g, cfg.norm_eps) if post else x + f(rmsnorm_ref(x, g, cfg.norm_eps))
    torch.testing.assert_close(u(x, f), ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("ratio,n_layers,expected", [
    (0.25, 4, 1), (0.25, 8, 2), (0.25, 3, 0), (0.3, 4, 1), (0.49, 4, 1), (0.5, 4, 2), (0.99, 4, 3),
    (0.3, 10, 3),    # 0.3 * 10 = 3.0000000000000004
    (0.29, 100, 29),  # 0.29 * 100 = 28.999999999999996 in floating point
    (0.7, 10, 7), (0.0, 6, 0), (1.0, 6, 6),
])
def test_mix_ln_split_is_floor_of_ratio_times_blocks(ratio, n_layers, expected):
    cfg = small_cfg(residual="mix_ln", n_layers=n_layers, mix_ln_ratio=ratio)
    assert mix_ln_post_blocks(cfg) == expected
    if n_layers <= 10:
        model = Transformer(cfg)
        posts = [(b.attn_residual.post, b.ffn_residual.post) for b in model.blocks]
        assert posts == [(i < expected, i < expected) for i in range(n_layers)]
        assert (model.norm is not None) == (expected < n_layers)


@pytest.mark.parametrize("ratio,same_as", [(0.0, "pre_ln"), (1.0, "post_ln")])
@pytest.mark.parametrize("n_layers", [1, 3])
def test_mix_ln_boundaries_equal_pre_ln_and_post_ln(ratio, same_as, n_layers):
    """rho = 0: every block Pre-LN (with final norm) == pre_ln; rho = 1: every block Post-LN
    (no final norm) == post_ln -- same parameters, same logits."""
    cfg = small_cfg(residual="mix_ln", n_layers=n_layers, mix_ln_ratio=ratio)
    torch.manual_seed(0)
    mix = Transformer(cfg)
    randomize_gains(mix)
    other = Transformer(small_cfg(residual=same_as, n_layers=n_layers))
    other.load_state_dict(mix.state_dict(), strict=True)
    ids = torch.randint(0, cfg.vocab_size, (2, 9))
    torch.testing.assert_close(mix(ids), other(ids), rtol=0, atol=0)


@pytest.mark.parametrize("ratio", [-0.1, 1.5, float("nan")])
def test_mix_ln_bad_ratio(ratio):
    with pytest.raises(KeelError, match=r"model.mix_ln_ratio must be between 0 and 1, got"):
        Transformer(small_cfg(residual="mix_ln", mix_ln_ratio=ratio))


# ---- both: whole model ------------------------------------------------------------------

def star(monkeypatch):
    monkeypatch.setitem(SCHEMES, "hybridnorm", HybridNormStar)


@pytest.mark.parametrize("variant", ["hybridnorm", "hybridnorm_star", "mix_ln"])
@pytest.mark.parametrize("n_heads,n_kv_heads,tie", [(4, 4, False), (4, 2, True), (4, 1, False)])
def test_gqa_shapes_and_gradients_reach_every_parameter(variant, n_heads, n_kv_heads, tie, monkeypatch):
    if variant == "hybridnorm_star":
        star(monkeypatch)
    scheme = "mix_ln" if variant == "mix_ln" else "hybridnorm"
    cfg = small_cfg(residual=scheme, n_heads=n_heads, n_kv_heads=n_kv_heads, tie_embeddings=tie,
                    mix_ln_ratio=0.5)
    torch.manual_seed(0)
    model = Transformer(cfg)
    ids = torch.randint(0, cfg.vocab_size, (3, 10))
    logits = model(ids)
    assert logits.shape == (3, 10, cfg.vocab_size) and logits.dtype == torch.float32
    model(ids, torch.roll(ids, -1, 1)).backward()
    names = [n for n, _ in model.named_parameters()]
    if scheme == "hybridnorm":
        assert any(n.endswith("attn.q_norm.weight") for n in names)
        assert any("attn_residual.norm" in n for n in names) == (variant == "hybridnorm_star")
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


def test_hybridnorm_star_model_first_block(monkeypatch):
    star(monkeypatch)
    model = Transformer(small_cfg(residual="hybridnorm"))
    b0, b1 = model.blocks[0], model.blocks[1]
    assert b0.attn_residual.pre_norm and b0.ffn_residual.pre_norm and b0.attn_residual.norm is not None
    assert not b1.attn_residual.pre_norm and b1.attn_residual.norm is None and b1.ffn_residual.norm is not None
