"""The fused RMSNorm of a scaled sum (keel.model.norm.rms_norm_of_sum): forward against
a transcription of the formula, hand-written backward against autograd (float64 gradcheck,
fp32, bf16 autocast), what it saves for backward, and whole-model gradients of every scheme
with and without activation checkpointing against the composite (autograd) formulation."""

import pytest
import torch

from keel import ModelConfig, Transformer
from keel.model import SCHEMES, norm, residual
from keel.model.norm import RMSNorm, rms_norm_of_sum, scaled_sum_norm
from keel.train.parallelize import apply_activation_checkpointing

ALL = sorted(SCHEMES)


def rmsnorm_ref(v, g, eps):
    """RMSNorm(v) = v / sqrt(mean_i v_i^2 + eps) * g   (Zhang & Sennrich 2019, Eq. 4)."""
    return v / torch.sqrt((v * v).mean(-1, keepdim=True) + eps) * g


def composite(x, f, weight, scale=1.0, eps=1e-5):
    """The same function written with plain autograd ops (the pre-fusion formulation): the
    sum upcast to at least fp32, the composite RMSNorm, the result in x's dtype."""
    cd = torch.promote_types(x.dtype, torch.float32)
    s = x.to(cd) if f is None else x.to(cd) + f.to(cd) * scale
    return (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) * weight.to(cd)).to(x.dtype)


@pytest.mark.parametrize("scale,eps", [(1.0, 1e-5), (1 / 3, 1e-5 / 9), (1 / 1024, 1e-5 / 1024 ** 2)])
def test_forward_matches_formula(scale, eps):
    torch.manual_seed(0)
    x, f = torch.randn(3, 5, 16, dtype=torch.float64), torch.randn(3, 5, 16, dtype=torch.float64) * 4
    g = torch.rand(16, dtype=torch.float64) + 0.5
    ref = rmsnorm_ref(x + scale * f, g, eps)
    torch.testing.assert_close(rms_norm_of_sum(x, f, g, scale, eps), ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(rms_norm_of_sum(x, None, g, 1.0, eps), rmsnorm_ref(x, g, eps), rtol=1e-12, atol=1e-12)


def test_scaled_sum_norm_is_norm_of_alpha_x_plus_f():
    """Norm_eps(a*x + f) == Norm_{eps/a^2}(x + f/a): scaled_sum_norm computes the left side."""
    torch.manual_seed(1)
    norm = RMSNorm(16, eps=1e-5).double()
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x, f = torch.randn(2, 7, 16, dtype=torch.float64), torch.randn(2, 7, 16, dtype=torch.float64)
    for a in (1.0, 5.0, 2048.0):
        ref = rmsnorm_ref(a * x + f, norm.weight, 1e-5)
        torch.testing.assert_close(scaled_sum_norm(norm, x, f, a), ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("scale", [1.0, 0.25, 1 / 3])
@pytest.mark.parametrize("with_f", [True, False])
def test_gradcheck_float64(scale, with_f):
    torch.manual_seed(2)
    x = torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True)
    f = torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True) if with_f else None
    g = (torch.rand(8, dtype=torch.float64) + 0.5).requires_grad_()
    args = (x, f, g) if with_f else (x, g)

    def fn(*a):
        return rms_norm_of_sum(a[0], a[1] if with_f else None, a[-1], scale, 1e-3)

    assert torch.autograd.gradcheck(fn, args)


def _grads(fn, x, f, g, dy):
    leaves = [t for t in (x, f, g) if t is not None]
    return torch.autograd.grad(fn(x, f, g), leaves, dy)


@pytest.mark.parametrize("scale", [1.0, 1 / 64])
def test_fp32_gradients_equal_autograd(scale):
    torch.manual_seed(3)
    x = torch.randn(4, 16, 64, requires_grad=True)
    f = (torch.randn(4, 16, 64) * 8).requires_grad_()
    g = (torch.rand(64) + 0.5).requires_grad_()
    dy = torch.randn(4, 16, 64)
    eps = 1e-5 * scale * scale
    fused = _grads(lambda a, b, c: rms_norm_of_sum(a, b, c, scale, eps), x, f, g, dy)
    ref = _grads(lambda a, b, c: composite(a, b, c, scale, eps), x, f, g, dy)
    for a, b in zip(fused, ref):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-6)


def test_bf16_branch_under_autocast_equals_autograd():
    """Under autocast the branch f is bf16 and the stream fp32: the output stays fp32, df
    comes back in bf16, and all three gradients match autograd's composite."""
    torch.manual_seed(4)
    x = torch.randn(4, 16, 64, requires_grad=True)
    f = torch.randn(4, 16, 64).bfloat16().requires_grad_()
    g = (torch.rand(64) + 0.5).requires_grad_()
    dy = torch.randn(4, 16, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = rms_norm_of_sum(x, f, g, 1 / 32, 1e-5 / 32 ** 2)
        fused = _grads(lambda a, b, c: rms_norm_of_sum(a, b, c, 1 / 32, 1e-5 / 32 ** 2), x, f, g, dy)
        ref = _grads(lambda a, b, c: composite(a, b, c, 1 / 32, 1e-5 / 32 ** 2), x, f, g, dy)
    assert out.dtype == torch.float32
    assert [t.dtype for t in fused] == [torch.float32, torch.bfloat16, torch.float32]
    torch.testing.assert_close(fused[0], ref[0], rtol=2e-5, atol=2e-6)
    torch.testing.assert_close(fused[2], ref[2], rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(fused[1], ref[1], rtol=2 ** -8, atol=1e-6)  # one bf16 rounding


def test_bf16_stream_computes_in_fp32():
    """A bf16 stream (model cast to bf16) is normalised in fp32 and returned in bf16."""
    torch.manual_seed(5)
    x, f = torch.randn(2, 4, 32).bfloat16(), torch.randn(2, 4, 32).bfloat16()
    g = torch.rand(32) + 0.5
    out = rms_norm_of_sum(x, f, g, 0.5, 1e-5)
    assert out.dtype == torch.bfloat16
    ref = rmsnorm_ref(x.double() + 0.5 * f.double(), g.double(), 1e-5)
    torch.testing.assert_close(out.double(), ref, rtol=2 ** -8, atol=1e-6)


def _saved_numel(fn):
    sizes = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(sizes)


def test_saves_only_normalised_sum_and_rstd():
    B, T, d = 2, 8, 32
    x = torch.randn(B, T, d, requires_grad=True)
    f = torch.randn(B, T, d, requires_grad=True)
    g = torch.ones(d, requires_grad=True)
    fused = _saved_numel(lambda: rms_norm_of_sum(x, f, g, 0.5, 1e-5))
    assert fused == B * T * d + B * T + d  # n, 1/rms, gain
    assert _saved_numel(lambda: composite(x, f, g, 0.5, 1e-5)) > 2 * B * T * d


# ---- whole models: every scheme, checkpointing on/off, fp32 and bf16 autocast -------------

def _model_grads(scheme, reference, checkpointing, bf16, monkeypatch):
    cfg = ModelConfig(vocab_size=61, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=48, max_seq_len=16,
                      residual=scheme, alpha=8.0)
    torch.manual_seed(0)
    model = Transformer(cfg)
    with torch.no_grad():  # gains away from 1 so that dg and g * dy are exercised
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.weight.uniform_(0.5, 1.5)
            elif isinstance(m, residual.Residual) or m is model.stream:  # HC/mHC/AttnRes maps off their
                for p in m.parameters(recurse=False):  # init, where the streams are equal and some
                    p.add_(0.1 * torch.randn_like(p))  # gradients vanish (rounding noise only)
    if checkpointing:
        apply_activation_checkpointing(model, "block")
    ids = torch.randint(0, 61, (2, 16), generator=torch.Generator().manual_seed(1))
    with monkeypatch.context() as mp:
        if reference:
            mp.setattr(norm, "rms_norm_of_sum", composite)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(ids, ids)
        loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "ckpt"])
@pytest.mark.parametrize("scheme", ALL)
def test_model_gradients_equal_autograd(scheme, checkpointing, bf16, monkeypatch):
    fused = _model_grads(scheme, False, checkpointing, bf16, monkeypatch)
    ref = _model_grads(scheme, True, False, bf16, monkeypatch)
    assert fused.keys() == ref.keys()
    # fp32: rounding only. bf16: a last-bit fp32 difference may flip one bf16 rounding of a
    # matmul input downstream, so compare norm-wise against bf16's unit roundoff 2^-8.
    tol = 1e-5 if not bf16 else 2 ** -8
    for name in ref:
        # relative to the gradient, or to 1e-3 of the largest one where it is nearly 0 (mHC's
        # maps at sub-layer 0 see n equal streams: their true gradient is ~0, rounding noise)
        floor = 1e-3 * max(g.norm() for g in ref.values())
        err = (fused[name] - ref[name]).norm() / ref[name].norm().clamp_min(max(floor, 1e-30))
        assert err < tol, (name, err.item())


def test_forward_mode_jvp_equals_composite():
    """torch.func.jvp (used by keel.diagnostics.gradflow) runs through the hand-written jvp."""
    from torch.func import jvp

    torch.manual_seed(6)
    prims = [torch.randn(2, 3, 8, dtype=torch.float64), torch.randn(2, 3, 8, dtype=torch.float64),
             torch.rand(8, dtype=torch.float64) + 0.5]
    tangents = [torch.randn_like(p) for p in prims]
    cases = [(lambda x, f, g: rms_norm_of_sum(x, f, g, 0.25, 1e-3), lambda x, f, g: composite(x, f, g, 0.25, 1e-3)),
             (lambda x, f, g: rms_norm_of_sum(x, None, g, 1.0, 1e-3), lambda x, f, g: composite(x, None, g, 1.0, 1e-3))]
    for fused, ref in cases:
        out, tan = jvp(fused, tuple(prims), tuple(tangents))
        out_ref, tan_ref = jvp(ref, tuple(prims), tuple(tangents))
        torch.testing.assert_close(out, out_ref, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(tan, tan_ref, rtol=1e-12, atol=1e-12)


def test_second_derivatives_raise_instead_of_being_wrong():
    x = torch.randn(2, 8, dtype=torch.float64, requires_grad=True)
    g = torch.ones(8, dtype=torch.float64, requires_grad=True)
    (dx,) = torch.autograd.grad(rms_norm_of_sum(x, None, g, 1.0, 1e-5).pow(2).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError):
        dx.sum().backward()
