"""Model tests: each formula against a direct transcription of its equation, parametrized
over residual schemes and shapes."""

import dataclasses
import math

import pytest
import torch
import torch.nn as nn

import keel.config
from keel import KeelError, ModelConfig, Transformer
from keel.model import SCHEMES, Attention, FeedForward, RMSNorm, apply_rope, rope_tables
from keel.model.residual import DeepNorm, Residual, scheme_readers

ALL = sorted(SCHEMES)
torch.set_default_dtype(torch.float32)


def small_cfg(**kw):
    base = dict(vocab_size=97, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=48, max_seq_len=32)
    base.update(kw)
    return ModelConfig(**base)


# ---- direct transcriptions of the equations (float64) ----------------------------------

def rmsnorm_ref(x, g, eps):
    """RMSNorm(x) = x / sqrt(mean_i x_i^2 + eps) * g   (Zhang & Sennrich 2019, Eq. 4)."""
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * g


def randomize_gains(module):
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, RMSNorm):
                m.weight.copy_(torch.rand_like(m.weight) + 0.5)


def make_f(d, seed=0):
    torch.manual_seed(seed)
    lin = nn.Linear(d, d, bias=False).double()
    return lambda h: torch.tanh(lin(h)) * 3.0


def unit_and_norms(scheme, cfg, index):
    unit = SCHEMES[scheme](cfg, index).double()
    randomize_gains(unit)
    return unit


@pytest.mark.parametrize("index", [2, 5])
def test_pre_ln_matches_formula(index):
    cfg = small_cfg(residual="pre_ln")
    unit = unit_and_norms("pre_ln", cfg, index)
    x = torch.randn(2, 5, cfg.d_model, dtype=torch.float64)
    f = make_f(cfg.d_model)
    ref = x + f(rmsnorm_ref(x, unit.norm.weight, cfg.norm_eps))
    torch.testing.assert_close(unit(x, f), ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("index", [0, 3])
def test_post_ln_matches_formula(index):
    cfg = small_cfg(residual="post_ln")
    unit = unit_and_norms("post_ln", cfg, index)
    x = torch.randn(2, 5, cfg.d_model, dtype=torch.float64)
    f = make_f(cfg.d_model)
    ref = rmsnorm_ref(x + f(x), unit.norm.weight, cfg.norm_eps)
    torch.testing.assert_close(unit(x, f), ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("n_layers", [2, 8, 64])
def test_deepnorm_matches_formula(n_layers):
    cfg = small_cfg(residual="deepnorm", n_layers=n_layers)
    L = 2 * n_layers
    unit = unit_and_norms("deepnorm", cfg, 1)
    alpha = L ** 0.25
    assert unit.alpha == pytest.approx(alpha) and alpha != 1
    x = torch.randn(2, 5, cfg.d_model, dtype=torch.float64)
    f = make_f(cfg.d_model)
    ref = rmsnorm_ref(alpha * x + f(x), unit.norm.weight, cfg.norm_eps)
    torch.testing.assert_close(unit(x, f), ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("alpha", [None, 3.7, 0.5, 2048.0])
@pytest.mark.parametrize("index", [2, 3, 7])
def test_keel_matches_formula(alpha, index):
    cfg = small_cfg(residual="keel", n_layers=4, alpha=alpha)
    a = alpha if alpha is not None else 8.0  # default alpha = L = 2 * n_layers
    unit = unit_and_norms("keel", cfg, index)
    assert unit.alpha == a
    x = torch.randn(2, 5, cfg.d_model, dtype=torch.float64)
    f = make_f(cfg.d_model)
    ref = rmsnorm_ref(a * x + f(rmsnorm_ref(x, unit.norm_in.weight, cfg.norm_eps)), unit.norm_out.weight, cfg.norm_eps)
    torch.testing.assert_close(unit(x, f), ref, rtol=1e-10, atol=1e-10)


def test_keel_first_layer_rule():
    cfg = small_cfg(residual="keel", n_layers=4, alpha=5.0)
    x = torch.randn(2, 5, cfg.d_model, dtype=torch.float64)
    f = make_f(cfg.d_model)
    first_attn = unit_and_norms("keel", cfg, 0)
    assert first_attn.norm_out is None and first_attn.alpha == 1.0
    ref0 = x + f(rmsnorm_ref(x, first_attn.norm_in.weight, cfg.norm_eps))
    torch.testing.assert_close(first_attn(x, f), ref0, rtol=1e-12, atol=1e-12)
    first_ffn = unit_and_norms("keel", cfg, 1)
    assert first_ffn.alpha == 1.0
    ref1 = rmsnorm_ref(x + f(rmsnorm_ref(x, first_ffn.norm_in.weight, cfg.norm_eps)), first_ffn.norm_out.weight,
                       cfg.norm_eps)
    torch.testing.assert_close(first_ffn(x, f), ref1, rtol=1e-12, atol=1e-12)

    off = small_cfg(residual="keel", n_layers=4, alpha=5.0, keel_first_layer_rule=False)
    unit = unit_and_norms("keel", off, 0)
    assert unit.alpha == 5.0 and unit.norm_out is not None
    ref = rmsnorm_ref(5.0 * x + f(rmsnorm_ref(x, unit.norm_in.weight, cfg.norm_eps)), unit.norm_out.weight, cfg.norm_eps)
    torch.testing.assert_close(unit(x, f), ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("scheme,index", [("keel", 4), ("deepnorm", 4)])
def test_scale_on_stream_not_on_branch(scheme, index):
    """Norm(a*x + F) must not be confused with Norm(x + a*F) (a bug shipped in DeepNorm ports)."""
    cfg = small_cfg(residual=scheme, n_layers=8, alpha=16.0)
    unit = unit_and_norms(scheme, cfg, index)
    a = unit.alpha
    assert a > 1.5
    x = torch.randn(2, 5, cfg.d_model, dtype=torch.float64)
    f = make_f(cfg.d_model)
    inner = (lambda h: rmsnorm_ref(h, unit.norm_in.weight, cfg.norm_eps)) if scheme == "keel" else (lambda h: h)
    outer = unit.norm_out if scheme == "keel" else unit.norm
    right = rmsnorm_ref(a * x + f(inner(x)), outer.weight, cfg.norm_eps)
    wrong = rmsnorm_ref(x + a * f(inner(x)), outer.weight, cfg.norm_eps)
    out = unit(x, f)
    torch.testing.assert_close(out, right, rtol=1e-10, atol=1e-10)
    assert (out - wrong).abs().max() > 0.1


def test_deepnorm_init_gains():
    n_layers = 32
    L = 2 * n_layers
    cfg = small_cfg(residual="deepnorm", n_layers=n_layers, d_model=256, n_heads=4, n_kv_heads=4, d_ff=512)
    torch.manual_seed(0)
    model = Transformer(cfg)
    beta = (4 * L) ** -0.25  # DeepNet decoder-only: (8M)^(-1/4), M = L/2 blocks
    blk = model.blocks[3]

    def xavier_std(w, gain):
        fan_out, fan_in = w.shape
        return gain * math.sqrt(2.0 / (fan_in + fan_out))

    for name, lin, gain in [("wq", blk.attn.wq, 1.0), ("wk", blk.attn.wk, 1.0), ("wv", blk.attn.wv, beta),
                            ("wo", blk.attn.wo, beta), ("w1", blk.ffn.w1, beta), ("w2", blk.ffn.w2, beta),
                            ("w3", blk.ffn.w3, beta)]:
        expected = xavier_std(lin.weight, gain)
        assert lin.weight.std().item() == pytest.approx(expected, rel=0.03), name
    assert model.tok_emb.weight.std().item() == pytest.approx(cfg.init_std, rel=0.03)
    assert isinstance(blk.attn_residual, DeepNorm)


@pytest.mark.parametrize("scheme", [s for s in ALL if s != "deepnorm"])  # DeepNorm: test above
def test_init_std_is_paper_default(scheme):
    torch.manual_seed(0)
    model = Transformer(small_cfg(residual=scheme, d_model=128, d_ff=256))
    # a scheme's own maps (HC/mHC/AttnRes) have their papers' init: tests/test_residual_bench.py
    own = {id(p) for m in model.modules() if isinstance(m, Residual) or m is model.stream
           for p in m.parameters(recurse=False)}
    for name, p in model.named_parameters():
        if id(p) in own:
            continue
        # HC: F's output projections start at std / sqrt(n) (its Sec. 4; tests/test_residual_bench.py)
        scaled = scheme == "hyper_connections" and name.endswith(("wo.weight", "w2.weight"))
        if p.ndim == 2:
            want = 0.02 / math.sqrt(model.cfg.hc_streams) if scaled else 0.02
            assert p.std().item() == pytest.approx(want, rel=0.05), name
        else:
            assert torch.all(p == 1), name


@pytest.mark.parametrize("scheme", ALL)
@pytest.mark.parametrize("std", [0.02, 1.0])
def test_embed_init_std_sets_only_the_embedding(scheme, std):
    torch.manual_seed(0)
    model = Transformer(small_cfg(residual=scheme, d_model=128, d_ff=256, vocab_size=512, embed_init_std=std))
    assert model.tok_emb.weight.std().item() == pytest.approx(std, rel=0.03)
    assert model.lm_head.weight.std().item() == pytest.approx(0.02, rel=0.05)  # init_std, untouched
    with pytest.raises(KeelError, match="model.embed_init_std"):
        Transformer(small_cfg(residual=scheme, embed_init_std=-1.0))


# ---- building blocks -----------------------------------------------------------------

def test_rmsnorm_formula():
    norm = RMSNorm(16, eps=1e-5).double()
    randomize_gains(norm)
    x = torch.randn(3, 7, 16, dtype=torch.float64) * 5
    torch.testing.assert_close(norm(x), rmsnorm_ref(x, norm.weight, 1e-5), rtol=1e-12, atol=1e-12)


def test_rope_formula_and_relative_position():
    hd, T, theta = 8, 11, 10000.0
    cos, sin = rope_tables(T, hd, theta)
    x = torch.randn(1, 1, T, hd, dtype=torch.float64)
    out = apply_rope(x, cos.double(), sin.double())
    # Transcription: pair (i, i + hd/2) as a complex number, rotated by m * theta^(-2i/hd).
    for m in range(T):
        for i in range(hd // 2):
            ang = m * theta ** (-2 * i / hd)
            z = complex(x[0, 0, m, i], x[0, 0, m, i + hd // 2]) * complex(math.cos(ang), math.sin(ang))
            assert out[0, 0, m, i].item() == pytest.approx(z.real, abs=1e-6)
            assert out[0, 0, m, i + hd // 2].item() == pytest.approx(z.imag, abs=1e-6)
    # <R_m q, R_n k> depends on m - n only.
    q, k = torch.randn(hd, dtype=torch.float64), torch.randn(hd, dtype=torch.float64)
    Q = apply_rope(q.expand(1, 1, T, hd), cos.double(), sin.double())[0, 0]
    K = apply_rope(k.expand(1, 1, T, hd), cos.double(), sin.double())[0, 0]
    assert (Q[5] @ K[2]).item() == pytest.approx((Q[8] @ K[5]).item(), rel=1e-5)


def test_swiglu_formula():
    cfg = small_cfg()
    ffn = FeedForward(cfg).double()
    x = torch.randn(2, 3, cfg.d_model, dtype=torch.float64)
    a = x @ ffn.w1.weight.T
    ref = ((a * torch.sigmoid(a)) * (x @ ffn.w3.weight.T)) @ ffn.w2.weight.T
    torch.testing.assert_close(ffn(x), ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("n_heads,n_kv_heads", [(4, 4), (4, 2), (4, 1), (6, 3)])
def test_gqa_attention_matches_explicit(n_heads, n_kv_heads):
    cfg = small_cfg(d_model=48, n_heads=n_heads, n_kv_heads=n_kv_heads)
    torch.manual_seed(0)
    attn = Attention(cfg).double()
    B, T, hd = 2, 9, cfg.head_dim
    x = torch.randn(B, T, cfg.d_model, dtype=torch.float64)
    cos, sin = (t.double() for t in rope_tables(T, hd, cfg.rope_theta))
    out = attn(x, cos, sin)
    assert out.shape == (B, T, cfg.d_model) and out.dtype == torch.float64
    q = apply_rope((x @ attn.wq.weight.T).view(B, T, n_heads, hd).transpose(1, 2), cos, sin)
    k = apply_rope((x @ attn.wk.weight.T).view(B, T, n_kv_heads, hd).transpose(1, 2), cos, sin)
    v = (x @ attn.wv.weight.T).view(B, T, n_kv_heads, hd).transpose(1, 2)
    rep = n_heads // n_kv_heads
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)  # head h uses kv head h // rep
    scores = q @ k.transpose(-1, -2) / math.sqrt(hd)
    scores = scores.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf"))
    y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, -1) @ attn.wo.weight.T
    torch.testing.assert_close(out, y, rtol=1e-10, atol=1e-10)


# ---- the whole model -----------------------------------------------------------------

@pytest.mark.parametrize("scheme", ALL)
@pytest.mark.parametrize("shape", [dict(n_heads=4, n_kv_heads=2), dict(n_heads=4, n_kv_heads=1, tie_embeddings=True),
                                   dict(n_heads=2, n_kv_heads=2, n_layers=1)])
def test_shapes_dtypes_and_loss(scheme, shape):
    cfg = small_cfg(residual=scheme, **shape)
    torch.manual_seed(0)
    model = Transformer(cfg)
    ids = torch.randint(0, cfg.vocab_size, (3, 10))
    logits = model(ids)
    assert logits.shape == (3, 10, cfg.vocab_size) and logits.dtype == torch.float32
    targets = torch.randint(0, cfg.vocab_size, (3, 10))
    loss = model(ids, targets)
    assert loss.shape == () and loss.dtype == torch.float32
    ref = nn.functional.cross_entropy(logits.reshape(-1, cfg.vocab_size), targets.reshape(-1))
    assert loss.item() == pytest.approx(ref.item(), rel=1e-6)
    assert abs(loss.item() - math.log(cfg.vocab_size)) < 0.5  # near-uniform at init


@pytest.mark.parametrize("scheme", ALL)
@pytest.mark.parametrize("tie", [False, True])
def test_gradients_reach_every_parameter(scheme, tie):
    cfg = small_cfg(residual=scheme, tie_embeddings=tie)
    torch.manual_seed(0)
    model = Transformer(cfg)
    with torch.no_grad():  # HC/mHC/AttnRes start where some of their maps have zero gradient
        for m in model.modules():  # (W = 0, phi = 0, query = 0, by their papers): move off it
            if isinstance(m, Residual) or m is model.stream:
                for p in m.parameters(recurse=False):
                    p.add_(0.1 * torch.randn_like(p))
    ids = torch.randint(0, cfg.vocab_size, (2, 12))
    model(ids, torch.roll(ids, -1, 1)).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("scheme", ALL)
def test_final_norm(scheme):
    """Schemes whose last sub-layer leaves the stream un-normalised end with a final norm
    (small_cfg has 3 blocks, so Mix-LN's last block is Pre-LN)."""
    model = Transformer(small_cfg(residual=scheme))
    assert (model.norm is not None) == (scheme in ("pre_ln", "hybridnorm", "mix_ln", "peri_ln", "hyper_connections",
                                                   "mhc", "attn_res"))


def test_sublayer_count():
    cfg = small_cfg(n_layers=5)
    assert cfg.n_sublayers == 10
    model = Transformer(cfg)
    assert {b.ffn_residual.alpha for b in model.blocks[1:]} == {10.0}  # Keel's alpha, unset: L
    assert [b.attn_residual.index for b in model.blocks] == [0, 2, 4, 6, 8]
    assert [b.ffn_residual.index for b in model.blocks] == [1, 3, 5, 7, 9]


@pytest.mark.parametrize("kw,msg", [
    (dict(d_model=30, n_heads=4), "not divisible by model.n_heads"),
    (dict(n_heads=4, n_kv_heads=3), "not divisible by model.n_kv_heads"),
    (dict(alpha=0.0), "model.alpha must be"),
    (dict(alpha=-2.0), "model.alpha must be"),
    (dict(alpha=float("nan")), "model.alpha must be"),
    (dict(residual="pre_layernorm"), "unknown model.residual"),
    (dict(n_layers=0), "model.n_layers must be >= 1"),
])
def test_bad_config_raises_clear_error(kw, msg):
    with pytest.raises(KeelError, match=msg):
        Transformer(small_cfg(**kw))


def test_sequence_too_long():
    model = Transformer(small_cfg(max_seq_len=8))
    with pytest.raises(KeelError, match="longer than model.max_seq_len"):
        model(torch.zeros(1, 9, dtype=torch.long))


# ---- numerics: Keel with a large alpha under bf16 autocast ------------------------------

def test_keel_alpha_2048_bf16_autocast_matches_fp32():
    """A bf16-autocast forward of Keel with alpha = 2048 matches the fp32 forward.

    Tolerance: bf16 keeps 8 significant bits (unit roundoff u = 2^-8 ~ 3.9e-3). Each
    matmul input is rounded once (fp32 accumulation), the residual sum and the norms run in
    fp32, and every sub-layer output is re-normalised, so errors do not compound with
    depth; we allow 8u relative error on the logits (about 3%). A formulation that let
    bf16 round F away would be off by the whole update, checked separately below.
    """
    cfg = ModelConfig(vocab_size=256, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=128,
                      max_seq_len=64, residual="keel", alpha=2048.0, init_std=0.05)
    torch.manual_seed(0)
    model = Transformer(cfg)
    ids = torch.randint(0, 256, (2, 32))
    ref = model(ids)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(ids)
    u = 2.0 ** -8
    rel = (out - ref).norm() / (ref - ref.mean()).norm()
    assert rel < 8 * u, rel


def test_keel_update_survives_bf16():
    """The sub-layer's contribution F/alpha survives: the change it makes to the output under
    autocast matches fp32, while a naive bf16 ``alpha*x + F`` loses F entirely."""
    cfg = small_cfg(residual="keel", d_model=64, n_layers=8, alpha=2048.0)
    unit = SCHEMES["keel"](cfg, 5)
    torch.manual_seed(0)
    x = torch.randn(4, 8, 64)
    fval = torch.randn(4, 8, 64)
    f, zero = (lambda h: fval.bfloat16()), (lambda h: torch.zeros_like(h).bfloat16())
    ref_delta = unit(x, lambda h: fval.bfloat16().float()) - unit(x, lambda h: torch.zeros_like(h))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = unit(x, f)
        delta = out - unit(x, zero)
    assert out.dtype == torch.float32  # the residual stream stays fp32
    assert ref_delta.abs().max() > 1e-4
    torch.testing.assert_close(delta, ref_delta, rtol=1e-3, atol=1e-6)
    # The naive form in bf16: alpha*x + F rounds F away, so most of the update is lost.
    xb = x.bfloat16()
    naive = (2048.0 * xb + fval.bfloat16()).float() - (2048.0 * xb).float()
    kept = 1 - (naive - fval).abs().mean() / fval.abs().mean()
    assert kept < 0.25


@pytest.mark.parametrize("scheme", ALL)
def test_kv_cache_matches_full_forward(scheme):
    from keel.model import KVCache

    cfg = small_cfg(residual=scheme)
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 14))
    full = model(ids)
    cache = KVCache()
    parts = [model(ids[:, :5], cache=cache), model(ids[:, 5:6], cache=cache), model(ids[:, 6:], cache=cache)]
    assert cache.get_seq_length() == 14
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=1e-5, atol=1e-5)
    greedy_cached = model.generate(ids[:, :4], 8, temperature=0, use_cache=True)
    greedy_plain = model.generate(ids[:, :4], 8, temperature=0, use_cache=False)
    assert torch.equal(greedy_cached, greedy_plain)


def test_generate_past_max_seq_len():
    """Sampling more tokens than max_seq_len allows crops the context (bug: the cached path
    raised 'sequence longer than max_seq_len' at the end of training when seq_len == max_seq_len)."""
    cfg = small_cfg(max_seq_len=8)
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, 6))
    out = model.generate(ids, 10, temperature=0)
    assert out.shape == (1, 16)
    assert torch.equal(out, model.generate(ids, 10, temperature=0, use_cache=False))


@pytest.mark.parametrize("args, words", [
    (dict(temperature=-0.5), "temperature, top_k and max_new_tokens must be >= 0, got -0.5, None, 3"),  # was greedy
    (dict(top_k=-2), "got 1.0, -2, 3"),  # was no top-k
    (dict(max_new_tokens=-1), "got 1.0, None, -1"),  # was the prompt back
    (dict(ids=torch.zeros(1, 0, dtype=torch.long)), r"at least one row and one token, got shape \(1, 0\)"),  # RuntimeError
    (dict(ids=torch.tensor([[1, 2, 64]])), r"token ids must be in \[0, 64\) \(model.vocab_size\), got 1..64"),  # IndexError
    (dict(ids=torch.tensor([[-1, 2]])), "got -1..2"),
    # a fresh-user trial (Python API): min() of an empty batch failed inside the id check; NaN reached multinomial
    (dict(ids=torch.zeros(0, 3, dtype=torch.long)), r"at least one row and one token, got shape \(0, 3\)"),
    (dict(temperature=float("nan")), "got nan, None, 3"),
    (dict(max_new_tokens=2.5), "max_new_tokens must be an integer, got 2.5"),  # a TypeError in range()
    (dict(top_k=2.0), "top_k must be an integer, got 2.0"),
])
def test_generate_refuses_arguments_it_would_misread_in_one_line(args, words):
    """Transformer.generate sampled greedily at a negative temperature, ignored a negative top_k, and raised
    RuntimeError / IndexError (on a GPU a device-side assert) for an empty prompt or an id outside the vocabulary."""
    model = Transformer(small_cfg(vocab_size=64)).eval()
    ids = args.pop("ids", torch.tensor([[1, 2, 3]]))
    kw = {"max_new_tokens": 3, "temperature": 1.0, **args}
    with pytest.raises(KeelError, match=words):
        model.generate(ids, **kw)
    assert model.generate(torch.tensor([[1, 63]]), 2, temperature=0).shape == (1, 4)  # the edges of the range pass


@pytest.mark.parametrize("call, words", [
    (lambda m, ids: m(ids[0]), r"must be an int64 or int32 tensor \[batch, tokens\].*got torch.int64 of shape \(8,\)"),
    (lambda m, ids: m(ids.to(torch.uint8)), r"got torch.uint8 of shape \(2, 8\)"),  # nn.Embedding's own error
    (lambda m, ids: m(ids[None]), r"of shape \(1, 2, 8\)"),  # 'too many values to unpack', deep in attention
    (lambda m, ids: m(ids[:0]), r"of shape \(0, 8\)"),  # 'cannot reshape tensor of 0 elements'
    (lambda m, ids: m(ids[:, :0]), r"of shape \(2, 0\)"),
    (lambda m, ids: m(ids.float()), r"got torch.float32 of shape \(2, 8\)"),
    (lambda m, ids: m(ids, ids[:, :4]), r"targets must have the shape of input_ids \(2, 8\), got \(2, 4\)"),
    # a mask of ones of the wrong shape was taken as no mask; with one 0 it failed 16 frames deep
    (lambda m, ids: m(ids, attention_mask=torch.ones(2, 5)), r"attention_mask must be .* = \(2, 8\), got \(2, 5\)"),
    (lambda m, ids: m(ids, attention_mask=torch.ones(2, 5).index_fill(1, torch.tensor([0]), 0)), r"got \(2, 5\)"),
])
def test_forward_refuses_inputs_of_the_wrong_shape_or_dtype_in_one_line(call, words):
    """Transformer.forward's inputs are checked by shape and dtype (a fresh-user trial of the Python API met
    IndexError / ValueError / RuntimeError from inside torch for each of these)."""
    torch.manual_seed(0)
    model = Transformer(small_cfg(vocab_size=64)).eval()
    ids = torch.randint(0, 64, (2, 8))
    with pytest.raises(KeelError, match=words):
        call(model, ids)
    assert model(ids, attention_mask=torch.ones(2, 8)).shape == (2, 8, 64)  # the right shapes pass
    assert model(ids.int()).shape == (2, 8, 64)


def test_a_model_takes_a_model_config_and_says_so():
    """``Transformer(run.config)`` (the whole Config) and ``count_parameters(model)`` failed with an
    AttributeError on a missing key."""
    from keel.config import Config
    from keel.model import count_parameters
    with pytest.raises(KeelError, match=r"^expected a keel.config.ModelConfig \(a Config's .model\), got Config$"):
        Transformer(Config())
    with pytest.raises(KeelError, match="got Transformer$"):
        count_parameters(Transformer(small_cfg()))


@pytest.mark.parametrize("key", ["tie_embeddings", "keel_first_layer_rule", "hc_dynamic", "peri_ln_embed_norm"])
@pytest.mark.parametrize("value", ["false", None, 0])
def test_a_bool_key_must_be_a_bool(key, value):
    """``ModelConfig(tie_embeddings="false")`` validated, and the model read the truthy string as True (a tied
    model) where the trainer's coerce_key read it as False."""
    with pytest.raises(KeelError, match=rf"^model.{key} must be True or False \(a bool\), got {value!r}$"):
        ModelConfig(**{key: value}).validate()


# ---- which scheme reads which model key ---------------------------------------------------

class _RecordingConfig(ModelConfig):
    """A ModelConfig that notes every key read while ``_RecordingConfig.reads`` is a set."""

    reads: set | None = None

    def __getattribute__(self, name):
        reads = type(self).reads
        if reads is not None and name in MODEL_KEYS:
            reads.add(name)
        return super().__getattribute__(name)


MODEL_KEYS = {f.name for f in dataclasses.fields(ModelConfig)}


def keys_read(scheme: str, monkeypatch) -> set[str]:
    """The model keys a ``scheme`` model reads: built, its memory floor, one forward pass
    (the load-time check of every key, which reads them all, is left out)."""
    monkeypatch.setattr(keel.config, "check_keys", lambda obj, section: None)
    cfg = _RecordingConfig(**{**small_cfg().__dict__, "residual": scheme, "n_layers": 4})
    _RecordingConfig.reads = set()
    try:
        torch.manual_seed(0)
        model = Transformer(cfg)
        SCHEMES[scheme].stream_copies(cfg)
        model(torch.randint(0, cfg.vocab_size, (1, 6)))
        return set(_RecordingConfig.reads)
    finally:
        _RecordingConfig.reads = None


def test_scheme_config_keys_are_the_keys_each_scheme_reads(monkeypatch):
    """``config_keys`` on a scheme's class, the one record of which scheme reads which
    ``model.*`` key (what warns of ``model.alpha`` set for pre_ln), is what the code does: each
    declared key is a ModelConfig key the scheme reads, no scheme reads a key other schemes
    declare without declaring it, and every key that some schemes read and others do not is declared."""
    reads = {s: keys_read(s, monkeypatch) for s in ALL}
    declared = {s: set(SCHEMES[s].config_keys) for s in ALL}
    specific = set().union(*declared.values())
    assert specific <= MODEL_KEYS
    assert specific == {"alpha", "keel_first_layer_rule", "mix_ln_ratio", "peri_ln_embed_norm", "hc_streams",
                        "hc_dynamic", "mhc_sinkhorn_iters", "attn_res_variant", "attn_res_blocks", "attn_res_readout"}
    for s in ALL:
        assert declared[s] <= reads[s], (s, declared[s] - reads[s])
        assert reads[s] & specific <= declared[s], (s, reads[s] & specific - declared[s])
    some = {k for k in MODEL_KEYS if 0 < sum(k in reads[s] for s in ALL) < len(ALL)}
    assert some <= specific, some - specific
    assert scheme_readers("hc_streams") == ["hyper_connections", "mhc"] and scheme_readers("d_model") == []
