"""The residual bench of 2026 (Peri-LN, Hyper-Connections, mHC, Attention Residuals): each
scheme's equations against a direct float64 transcription, whole models at n_layers 2 and 8
including the initial state; mHC's Sinkhorn-Knopp; AttnRes Block vs Full; a cross-check of
HC/mHC against the independent ``hyper-connections`` package (skipped when not installed)."""

import math

import pytest
import torch

from keel import ModelConfig, Transformer
from keel.diagnostics.gradflow import jacobian_spectral_norms, profile_model
from keel.model import RMSNorm
from keel.model.residual import AttnRes, HyperConnections, ManifoldHyperConnections, Residual
from keel.model.residual.multi_stream import sinkhorn_knopp

DEPTHS = [2, 8]


def cfg64(residual, n_layers, **kw):
    base = dict(vocab_size=53, d_model=16, n_layers=n_layers, n_heads=2, n_kv_heads=1, d_ff=24, max_seq_len=16,
                residual=residual, init_std=0.3)
    base.update(kw)
    return ModelConfig(**base)


def rms(x, g, eps):
    """RMSNorm(x) = x / sqrt(mean_d x^2 + eps) * g   (Zhang & Sennrich 2019, Eq. 4)."""
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * g


def model64(cfg, seed=0, perturb=True):
    """A float64 model; gains in [0.5, 1.5] and, with ``perturb``, the scheme's own maps moved
    off their init (so that every term of the equations matters)."""
    torch.manual_seed(seed)
    model = Transformer(cfg).double()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.weight.uniform_(0.5, 1.5)
            elif perturb and (isinstance(m, Residual) or m is model.stream):
                for p in m.parameters(recurse=False):
                    p.add_(0.5 * torch.randn_like(p))
    return model


def ids_for(cfg, T=7):
    return torch.randint(0, cfg.vocab_size, (2, T), generator=torch.Generator().manual_seed(3))


def sub_fns(model, T):
    """[(unit, F), ...] in the paper's order, F on [B, T, d] (attention with RoPE, or FFN)."""
    cos, sin = model.rope_cos[:T], model.rope_sin[:T]
    out = []
    for blk in model.blocks:
        out.append((blk.attn_residual, lambda h, blk=blk: blk.attn(h, cos, sin)))
        out.append((blk.ffn_residual, blk.ffn))
    return out


def head(model, x):
    """What the reference hands to the LM head: the final norm's input [B, T, d] (float64;
    the model's logits are fp32, so the comparison is made here)."""
    return x


def hidden(model, ids, module=None):
    """The input of ``module`` (default: the final norm; [B, T, d], float64) in ``model(ids)``."""
    seen = {}
    handle = (module or model.norm).register_forward_pre_hook(lambda m, args: seen.setdefault("x", args[0]))
    try:
        model(ids)
    finally:
        handle.remove()
    return seen["x"]


# ---- Peri-LN ---------------------------------------------------------------------------------

@pytest.mark.parametrize("embed_norm", [True, False])
@pytest.mark.parametrize("n_layers", DEPTHS)
def test_peri_ln_model_matches_transcription(n_layers, embed_norm):
    """x_0 = Norm_emb(E[ids]) (or E[ids]); x <- x + Norm_out(F(Norm_in(x))); Norm; LM head."""
    cfg = cfg64("peri_ln", n_layers, peri_ln_embed_norm=embed_norm)
    model, ids = model64(cfg), ids_for(cfg)
    eps = cfg.norm_eps
    x = model.tok_emb.weight[ids]
    if embed_norm:
        x = rms(x, model.stream.norm.weight, eps)
    else:
        assert model.stream is None
    for unit, f in sub_fns(model, ids.shape[1]):
        x = x + rms(f(rms(x, unit.norm_in.weight, eps)), unit.norm_out.weight, eps)
    torch.testing.assert_close(hidden(model, ids), head(model, x), rtol=1e-10, atol=1e-10)


# ---- Hyper-Connections -----------------------------------------------------------------------

def hc_reference(model, ids):
    """Zhu et al. 2025 (arXiv 2409.19606), Eqs. 1-4 and 10-13, written out per stream:
    H^0 = (h^0, ..., h^0); per sub-layer, with H_bar_j = Norm_hc(H_j),
    A_m[j] = A_m[j] + s_a tanh(H_bar_j . W_m), A_r[j, i] = A_r[j, i] + s_a tanh(H_bar_j . W_r[:, i]),
    B[i] = B[i] + s_b tanh(H_bar_i . W_b); h_0 = sum_j A_m[j] H_j;
    H_i <- sum_j A_r[j, i] H_j + B[i] F(Norm(h_0)); at the end Norm(sum_i H_i)."""
    cfg, eps = model.cfg, model.cfg.norm_eps
    n = cfg.hc_streams
    H = [model.tok_emb.weight[ids]] * n
    for unit, f in sub_fns(model, ids.shape[1]):
        A, Bs = unit.static_alpha, unit.static_beta
        if cfg.hc_dynamic:
            Hb = [rms(h, unit.hc_norm.weight, eps) for h in H]
            am = [A[j, 0] + unit.s_alpha * torch.tanh(Hb[j] @ unit.dynamic_alpha[:, 0]) for j in range(n)]
            ar = [[A[j, 1 + i] + unit.s_alpha * torch.tanh(Hb[j] @ unit.dynamic_alpha[:, 1 + i]) for i in range(n)]
                  for j in range(n)]
            b = [Bs[i] + unit.s_beta * torch.tanh(Hb[i] @ unit.dynamic_beta) for i in range(n)]
        else:
            am = [A[j, 0].expand(ids.shape) for j in range(n)]
            ar = [[A[j, 1 + i].expand(ids.shape) for i in range(n)] for j in range(n)]
            b = [Bs[i].expand(ids.shape) for i in range(n)]
        h0 = sum(am[j].unsqueeze(-1) * H[j] for j in range(n))
        out = f(rms(h0, unit.norm.weight, eps))
        H = [sum(ar[j][i].unsqueeze(-1) * H[j] for j in range(n)) + b[i].unsqueeze(-1) * out for i in range(n)]
    return head(model, sum(H))


@pytest.mark.parametrize("dynamic", [True, False], ids=["dynamic", "static"])
@pytest.mark.parametrize("n_layers", DEPTHS)
def test_hyper_connections_model_matches_transcription(n_layers, dynamic):
    cfg = cfg64("hyper_connections", n_layers, hc_dynamic=dynamic, hc_streams=3)
    model, ids = model64(cfg), ids_for(cfg)
    assert hasattr(model.blocks[0].attn_residual, "dynamic_alpha") == dynamic
    torch.testing.assert_close(hidden(model, ids), hc_reference(model, ids), rtol=1e-10, atol=1e-10)


def test_hyper_connections_init_is_the_papers():
    """Eq. 14 / App. J: A_m = e_{k mod n}, A_r = I, B = 1, W = 0, s = 0.01 (k = sub-layer index)."""
    model = Transformer(cfg64("hyper_connections", 4))
    n = model.cfg.hc_streams
    assert n == 4 and model.cfg.hc_dynamic
    for k, unit, _ in model.sublayers():
        assert torch.equal(unit.static_alpha[:, 0], torch.eye(n)[k % n])
        assert torch.equal(unit.static_alpha[:, 1:], torch.eye(n))
        assert torch.equal(unit.static_beta, torch.ones(n))
        assert not unit.dynamic_alpha.any() and not unit.dynamic_beta.any()
        assert unit.s_alpha.item() == pytest.approx(0.01) and unit.s_beta.item() == pytest.approx(0.01)


def shared_weights_pre_ln(model):
    """A pre_ln model holding ``model``'s embedding, attention, FFN, per-sub-layer input norms and final norm."""
    ref = Transformer(ModelConfig(**{**vars(model.cfg), "residual": "pre_ln"})).double()
    missing = ref.load_state_dict(model.state_dict(), strict=False).missing_keys
    assert not missing, missing
    return ref


@pytest.mark.parametrize("scheme", ["hyper_connections", "mhc"])
@pytest.mark.parametrize("n_layers", DEPTHS)
def test_hc_and_mhc_start_as_a_pre_ln_network(scheme, n_layers):
    """At init the n streams stay equal copies of the Pre-LN stream, so the logits are Pre-LN's
    (with the same weights) up to RMSNorm's eps, here 1e-30 (Norm(n x) vs Norm(x))."""
    cfg = cfg64(scheme, n_layers, norm_eps=1e-30)
    model, ids = model64(cfg, perturb=False), ids_for(cfg)
    ref = shared_weights_pre_ln(model)
    torch.testing.assert_close(hidden(model, ids, model.lm_head), hidden(ref, ids, ref.lm_head), rtol=1e-10, atol=1e-10)


# ---- mHC -------------------------------------------------------------------------------------

def sinkhorn_reference(logits, iters):
    """mHC (Xie et al. 2025, arXiv 2512.24880) Sec. 4.2 on one matrix: M^(0) = exp(logits),
    M^(t) = T_r(T_c(M^(t-1))) with T_c dividing each column by its sum and T_r each row."""
    m = logits.exp()
    for _ in range(iters):
        m = torch.stack([c / c.sum() for c in m.T]).T  # T_c
        m = torch.stack([r / r.sum() for r in m])  # T_r, last: the rows sum to 1
    return m


def mhc_reference(model, ids):
    """Xie et al. 2025 (arXiv 2512.24880), Eqs. 3 and 7-8, token by token: x_vec = vec(x) [n d],
    x' = RMSNorm(x_vec); H_pre = sigmoid(a_pre x' phi_pre + b_pre), H_post = 2 sigmoid(...),
    H_res = SK(a_res mat(x' phi_res) + b_res); x <- H_res x + H_post^T F(Norm(H_pre x))."""
    cfg, eps = model.cfg, model.cfg.norm_eps
    n, (B, T) = cfg.hc_streams, ids.shape
    x = model.tok_emb.weight[ids].unsqueeze(2).repeat(1, 1, n, 1)  # [B, T, n, d]: rows are streams
    for unit, f in sub_fns(model, T):
        h_in = torch.empty(B, T, cfg.d_model, dtype=x.dtype)
        mixed, posts = torch.empty_like(x), torch.empty(B, T, n, dtype=x.dtype)
        for b in range(B):
            for t in range(T):
                xv = rms(x[b, t].reshape(-1), 1.0, eps)  # the paper's RMSNorm(x_vec): no gain
                pre = torch.sigmoid(unit.alpha_pre * (xv @ unit.phi_pre) + unit.b_pre)
                posts[b, t] = 2 * torch.sigmoid(unit.alpha_post * (xv @ unit.phi_post) + unit.b_post)
                res = sinkhorn_reference(unit.alpha_res * (xv @ unit.phi_res).reshape(n, n) + unit.b_res,
                                         cfg.mhc_sinkhorn_iters)
                h_in[b, t] = pre @ x[b, t]
                mixed[b, t] = res @ x[b, t]
        out = f(rms(h_in, unit.norm.weight, eps))
        x = mixed + posts.unsqueeze(-1) * out.unsqueeze(2)
    return head(model, x.sum(2))


@pytest.mark.parametrize("n_layers", DEPTHS)
def test_mhc_model_matches_transcription(n_layers):
    cfg = cfg64("mhc", n_layers, hc_streams=3, mhc_sinkhorn_iters=7)
    model, ids = model64(cfg), ids_for(cfg, T=5)
    torch.testing.assert_close(hidden(model, ids), mhc_reference(model, ids), rtol=1e-10, atol=1e-10)


def test_mhc_defaults_and_init():
    """Paper: n = 4, t_max = 20, gating factors 0.01; ours: phi = 0, b_pre = e_{k mod n},
    b_post = 0, b_res = I (documented in ManifoldHyperConnections)."""
    model = Transformer(cfg64("mhc", 4))
    assert model.cfg.hc_streams == 4 and model.cfg.mhc_sinkhorn_iters == 20
    for k, unit, _ in model.sublayers():
        assert unit.iters == 20
        for a in (unit.alpha_pre, unit.alpha_post, unit.alpha_res):
            assert a.item() == pytest.approx(0.01)
        assert not (unit.phi_pre.any() or unit.phi_post.any() or unit.phi_res.any() or unit.b_post.any())
        assert torch.equal(unit.b_pre, torch.eye(4)[k % 4]) and torch.equal(unit.b_res, torch.eye(4))


@pytest.mark.parametrize("perturbed", [False, True], ids=["init", "moved"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_mhc_residual_matrix_is_doubly_stochastic(dtype, perturbed):
    """After the paper's 20 Sinkhorn-Knopp iterations: entries >= 0, rows sum to 1 to rounding
    (the last step normalises them), columns within 1e-6, at init and with the maps moved
    (b_res + N(0, 0.5^2), phi + N(0, 0.05^2), gates + N(0, 0.1^2): logits of spread ~0.5)."""
    cfg = cfg64("mhc", 2)
    unit = ManifoldHyperConnections(cfg, 1).to(dtype)
    if perturbed:
        with torch.no_grad():
            for p, s in ((unit.b_res, 0.5), (unit.phi_res, 0.05), (unit.alpha_res, 0.1), (unit.b_pre, 1.0),
                         (unit.b_post, 1.0), (unit.phi_pre, 0.05), (unit.phi_post, 0.05)):
                p.add_(s * torch.randn_like(p))
    x = torch.randn(4, 3, 5, cfg.d_model, dtype=dtype)
    h_pre, h_post, h_res = unit.maps(x)
    assert h_res.shape == (3, 5, 4, 4)
    assert (h_res >= 0).all()
    one = torch.ones((), dtype=dtype)
    exact = 1e-14 if dtype == torch.float64 else 1e-6
    torch.testing.assert_close(h_res.sum(-1), one.expand(3, 5, 4), rtol=0, atol=exact)
    torch.testing.assert_close(h_res.sum(-2), one.expand(3, 5, 4), rtol=0, atol=1e-6)
    assert ((h_pre > 0) & (h_pre < 1)).all() and ((h_post > 0) & (h_post < 2)).all()


@pytest.mark.parametrize("scale", [1.0, 3.0])
def test_sinkhorn_rows_are_exact_so_the_forward_gain_is_one(scale):
    """The paper's order ends with T_r: every row of H_res sums to 1, so each output stream is a
    convex mix of the input streams and the composite map over many sub-layers keeps a forward
    gain of exactly 1 (the paper's Fig. 7: only the backward gain deviates). keel v1 ended with the
    columns: rows off by up to 1.2e-3 at N(0, 1) logits and 5.8e-2 at N(0, 9), a composite forward
    gain of 1.0052 over 60 sub-layers. Columns keep the remaining Sinkhorn error."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(10_000, 4, 4, dtype=torch.float64, generator=g) * scale
    m = sinkhorn_knopp(logits, 20)
    assert (m.sum(-1) - 1).abs().max() < 1e-14
    assert 0 < (m.sum(-2) - 1).abs().max() < (1e-1 if scale == 3.0 else 1e-2)  # not exact: finite Sinkhorn
    prod = torch.eye(4, dtype=torch.float64)
    for k in range(60):  # composite map of 60 sub-layers
        prod = m[k] @ prod
    assert (prod.sum(-1) - 1).abs().max() < 1e-13  # forward gain (max row sum) exactly 1


def test_sinkhorn_matches_reference_and_survives_large_logits():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 4, 4, dtype=torch.float64, generator=g) * 3
    got = sinkhorn_knopp(logits, 20)
    for k in range(3):
        torch.testing.assert_close(got[k], sinkhorn_reference(logits[k], 20), rtol=1e-12, atol=1e-14)
    big = sinkhorn_knopp(torch.tensor([[800.0, 0.0], [0.0, 800.0]]), 20)  # exp(800) = inf without the shift
    assert torch.isfinite(big).all() and torch.allclose(big, torch.eye(2), atol=1e-6)


@pytest.mark.parametrize("iters", [1, 3, 20])
def test_sinkhorn_derivatives_match_the_transcription(iters):
    """sinkhorn_knopp's hand-written reverse pass and jvp (the scaling form, diag(u) K diag(v))
    against autograd through :func:`sinkhorn_reference`, matrix by matrix, float64."""
    g = torch.Generator().manual_seed(iters)
    logits = (torch.randn(2, 3, 4, 4, dtype=torch.float64, generator=g) * 2).requires_grad_()
    cot, tan = torch.randn(2, 3, 4, 4, dtype=torch.float64, generator=g), torch.randn(2, 3, 4, 4, dtype=torch.float64)
    got, = torch.autograd.grad((sinkhorn_knopp(logits, iters) * cot).sum(), logits)
    _, got_jvp = torch.func.jvp(lambda z: sinkhorn_knopp(z, iters), (logits.detach(),), (tan,))
    for b in range(2):
        for t in range(3):
            lg = logits[b, t].detach().requires_grad_()
            want, = torch.autograd.grad((sinkhorn_reference(lg, iters) * cot[b, t]).sum(), lg)
            torch.testing.assert_close(got[b, t], want, rtol=1e-11, atol=1e-13)
            _, want_jvp = torch.func.jvp(lambda z: sinkhorn_reference(z, iters), (logits[b, t].detach(),), (tan[b, t],))
            torch.testing.assert_close(got_jvp[b, t], want_jvp, rtol=1e-11, atol=1e-13)


def saved_numbers(fn, *args) -> int:
    """Numbers in the distinct storages autograd keeps for the backward of ``fn(*args)``,
    leaving out those of ``args`` (alive anyway) and of parameters."""
    keep = {a.untyped_storage().data_ptr() for a in args if torch.is_tensor(a)}
    seen = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in keep and not isinstance(t, torch.nn.Parameter):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes() // t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return sum(seen.values())


def test_sinkhorn_keeps_only_k_and_the_scaling_vectors():
    """For N matrices of n x n and T iterations the backward keeps K (N n^2) and the scaling
    vectors u_0..u_T, v_1..v_T (N n (2T + 1)); autograd through the alternating divisions kept
    every intermediate matrix and sum, 2 T (n^2 + n) N (4.4x more at n = 4, T = 20)."""
    n, T, N = 4, 20, 6
    logits = torch.randn(N, n, n, requires_grad=True)
    assert saved_numbers(sinkhorn_knopp, logits, T) == N * n * n + N * n * (2 * T + 1)


@pytest.mark.parametrize("scheme", ["hyper_connections", "mhc"])
def test_stream_maps_do_not_keep_a_normalised_copy_of_the_stream(scheme):
    """HC's dynamic maps read Norm_hc(H), mHC's RMSNorm(x_vec): both are computed as r * (H W)
    (r = 1 / rms), the mixing reads the stream where it lies ([B, T, n, d], as the model stores
    it) and mHC's Sinkhorn keeps its scaling vectors only. One sub-layer with F = identity then
    keeps at most (2 n + 1) B T d numbers plus its per-token maps (measured: HC 4.1, mHC 12.1
    B T d at n = 4, d = 64); keel v2 kept 14.8 and 19.6 (a normalised copy, permuted copies,
    every Sinkhorn iterate)."""
    cfg = cfg64(scheme, 2, d_model=64)
    unit = (HyperConnections if scheme == "hyper_connections" else ManifoldHyperConnections)(cfg, 1)
    n, B, T, d, iters = cfg.hc_streams, 2, 8, cfg.d_model, cfg.mhc_sinkhorn_iters
    x = torch.randn(B, T, n, d).add(1).requires_grad_()
    x = x.movedim(-2, 0) * 1.0  # a non-leaf stream [n, B, T, d], stored [B, T, n, d]
    saved = saved_numbers(lambda s: unit(s, lambda h: h * 1.0), x)
    per_token = n * (n + 2) + 3 * n + 2 if scheme == "hyper_connections" else 2 * n * n + n * (2 * iters + 1) + 10 * n
    assert saved <= (2 * n + 1) * B * T * d + B * T * per_token, saved / (B * T * d)


# ---- Attention Residuals ---------------------------------------------------------------------

def attend_ref(sources, w, g, eps):
    """h = sum_i softmax_i(w . Norm(v_i)) v_i  (AttnRes, arXiv 2603.15031; keys RMS-normalised)."""
    logits = torch.stack([(rms(v, g, eps) * w).sum(-1) for v in sources])
    a = torch.softmax(logits, dim=0)
    return sum(a[i].unsqueeze(-1) * v for i, v in enumerate(sources))


def full_attn_res_reference(model, ids):
    """Full AttnRes: sources v_0 = embedding, v_l = F_l(Norm(h_l)); h_l attends over v_0 .. v_{l-1};
    the output attends over all sources with the readout's query; final Norm; LM head."""
    eps = model.cfg.norm_eps
    sources = [model.tok_emb.weight[ids]]
    for k, (unit, f) in enumerate(sub_fns(model, ids.shape[1])):
        h = sources[0] if k == 0 else attend_ref(sources, unit.query, unit.key_norm.weight, eps)
        sources.append(f(rms(h, unit.norm.weight, eps)))
    out = attend_ref(sources, model.stream.query, model.stream.key_norm.weight, eps)
    return head(model, out)


def block_attn_res_reference(model, ids, S):
    """Block AttnRes as the official pseudo-code: ``blocks`` (b_0 = embedding, then completed
    block sums) and ``partial``; before sub-layer k, h = attend(blocks + [partial]); if k is a
    multiple of S the partial closes (appended to blocks) and the next starts at F's output."""
    eps = model.cfg.norm_eps
    blocks, partial = [], model.tok_emb.weight[ids]
    for k, (unit, f) in enumerate(sub_fns(model, ids.shape[1])):
        srcs = blocks + [partial]
        h = srcs[0] if k == 0 else attend_ref(srcs, unit.query, unit.key_norm.weight, eps)
        if k % S == 0:
            blocks, partial = blocks + [partial], None
        out = f(rms(h, unit.norm.weight, eps))
        partial = out if partial is None else partial + out
    final = attend_ref(blocks + [partial], model.stream.query, model.stream.key_norm.weight, eps)
    return head(model, final)


@pytest.mark.parametrize("n_layers", DEPTHS)
def test_full_attn_res_matches_transcription(n_layers):
    cfg = cfg64("attn_res", n_layers, attn_res_variant="full")
    model, ids = model64(cfg), ids_for(cfg)
    torch.testing.assert_close(hidden(model, ids), full_attn_res_reference(model, ids), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("n_layers,blocks,size", [(2, 2, 2), (8, 8, 2), (8, 4, 4), (8, 3, 6), (2, 8, 1)])
def test_block_attn_res_matches_transcription(n_layers, blocks, size):
    """N blocks of S = ceil(L / N) sub-layers (8 blocks at L = 4: S = 1, i.e. Full)."""
    cfg = cfg64("attn_res", n_layers, attn_res_blocks=blocks)
    model, ids = model64(cfg), ids_for(cfg)
    assert cfg.attn_res_variant == "block" and (-(-2 * n_layers // blocks)) == size
    assert [u.opens_block for _, u, _ in model.sublayers()] == [k % size == 0 for k in range(2 * n_layers)]
    torch.testing.assert_close(hidden(model, ids), block_attn_res_reference(model, ids, size), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("n_layers", DEPTHS)
def test_block_attn_res_with_one_sub_layer_per_block_is_full(n_layers):
    full = model64(cfg64("attn_res", n_layers, attn_res_variant="full"))
    block = Transformer(cfg64("attn_res", n_layers, attn_res_blocks=2 * n_layers)).double()
    block.load_state_dict(full.state_dict())
    ids = ids_for(full.cfg)
    assert torch.equal(hidden(block, ids), hidden(full, ids))


def attn_res_v1_hidden(model, ids):
    """The final norm's input as AttnRes version 1 computed it (commit cd706e3): the stream one stacked
    tensor [m, B, T, d], concatenated anew at every sub-layer, the depth attention batched over it."""
    def attend(v, query, key_norm):
        w = query * key_norm.weight
        r = torch.rsqrt(v.square().mean(-1, keepdim=True) + key_norm.eps).squeeze(-1)
        return (torch.softmax((v @ w) * r, dim=0).unsqueeze(-1) * v).sum(0)

    x = model.tok_emb(ids).unsqueeze(0)
    for unit, f in sub_fns(model, ids.shape[1]):
        h = x[0] if unit.index == 0 else attend(x, unit.query, unit.key_norm)
        out = f(unit.norm(h))
        x = torch.cat([x, out[None]]) if unit.opens_block else torch.cat([x[:-1], (x[-1] + out)[None]])
    return attend(x, model.stream.query, model.stream.key_norm) if model.stream.attend else x.sum(0)


@pytest.mark.parametrize("kw", [{}, {"attn_res_variant": "full"}, {"attn_res_blocks": 3, "attn_res_readout": "sum"}])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_attn_res_sources_as_a_tuple_compute_what_the_stacked_stream_did(kw, dtype):
    """Version 2 keeps the sources as a tuple (no [m, B, T, d] stack per sub-layer): the same forward
    values as version 1's stacked stream, and gradients that differ only by the order autograd sums a
    source's contributions (float64: within 1e-12 relative; float32: ~1e-6, hence the new version)."""
    cfg = cfg64("attn_res", 4, **kw)
    model, ids = model64(cfg).to(dtype), ids_for(cfg)
    probe = torch.randn(2, 7, cfg.d_model, dtype=dtype, generator=torch.Generator().manual_seed(5))
    grads = []
    for fn in (hidden, attn_res_v1_hidden):
        model.zero_grad()
        h = fn(model, ids)
        (h * probe).sum().backward()
        grads.append((h.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    (h2, g2), (h1, g1) = grads
    tol = 1e-12 if dtype == torch.float64 else 1e-4
    torch.testing.assert_close(h2, h1, rtol=tol, atol=0)
    assert len(g2) == len(g1) > 20
    for a, b in zip(g2, g1, strict=True):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol * b.abs().max().item())
    assert AttnRes.version == 2


def test_attn_res_init_and_readout_sum():
    """Pseudo-queries start at 0 (uniform weights); readout "sum" = embedding + every output."""
    model = Transformer(cfg64("attn_res", 2))
    assert model.cfg.attn_res_blocks == 8 and model.cfg.attn_res_variant == "block"
    assert not hasattr(model.blocks[0].attn_residual, "query")  # one source: nothing to learn
    assert all(not u.query.any() for k, u, _ in model.sublayers() if k > 0) and not model.stream.query.any()
    cfg = cfg64("attn_res", 2, attn_res_readout="sum", attn_res_variant="full")
    model, ids = model64(cfg), ids_for(cfg)
    eps, stream = cfg.norm_eps, [model.tok_emb.weight[ids]]
    for k, (unit, f) in enumerate(sub_fns(model, ids.shape[1])):
        h = stream[0] if k == 0 else attend_ref(stream, unit.query, unit.key_norm.weight, eps)
        stream.append(f(rms(h, unit.norm.weight, eps)))
    torch.testing.assert_close(hidden(model, ids), head(model, sum(stream)), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("key,value,msg", [
    ("attn_res_variant", "half", "model.attn_res_variant must be 'block' \\| 'full', got 'half'"),
    ("attn_res_blocks", 0, "model.attn_res_blocks must be >= 1, got 0"),
    ("attn_res_readout", "max", "model.attn_res_readout must be 'attend' \\| 'sum', got 'max'"),
])
def test_attn_res_config_errors(key, value, msg):
    from keel import KeelError
    with pytest.raises(KeelError, match=msg):
        Transformer(cfg64("attn_res", 2, **{key: value}))


@pytest.mark.parametrize("scheme,key,value,msg", [
    ("hyper_connections", "hc_streams", 0, "model.hc_streams must be >= 1, got 0"),
    ("mhc", "mhc_sinkhorn_iters", 0, "model.mhc_sinkhorn_iters must be >= 1, got 0"),
])
def test_hc_config_errors(scheme, key, value, msg):
    from keel import KeelError
    with pytest.raises(KeelError, match=msg):
        Transformer(cfg64(scheme, 2, **{key: value}))


# ---- gradient flow over the streams ------------------------------------------------------------

@pytest.mark.parametrize("scheme", ["hyper_connections", "mhc", "attn_res"])
def test_shortcut_jacobian_of_a_multi_stream_unit(scheme):
    """J* of a multi-stream unit is per token over all its m x d stream entries: against
    torch.autograd.functional.jacobian of one token's [m, d] -> output entries."""
    cfg = cfg64(scheme, 2, attn_res_variant="full")
    model = model64(cfg)
    unit = model.blocks[1].attn_residual  # sub-layer 2: AttnRes has 3 sources there
    m = 3 if scheme == "attn_res" else cfg.hc_streams
    x = torch.randn(m, 2, 3, cfg.d_model, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    if scheme == "attn_res":  # its stream: a tuple of m sources [B, T, d]
        x = tuple(x.unbind(0))
    f_fixed = torch.randn(2, 3, cfg.d_model, dtype=torch.float64)
    from keel.diagnostics.gradflow import _per_token
    fn, z = _per_token(unit, x, lambda _h: f_fixed)
    sigma = jacobian_spectral_norms(fn, z, group_dims=2, iters=m * cfg.d_model)
    for b, t in [(0, 0), (1, 2)]:
        def one_token(v, b=b, t=t):
            zz = z.clone()
            zz[b, t] = v
            return fn(zz)[b, t]
        J = torch.autograd.functional.jacobian(one_token, z[b, t]).reshape(-1, m * cfg.d_model)
        assert sigma[b, t].item() == pytest.approx(torch.linalg.matrix_norm(J, ord=2).item(), rel=1e-6)


@pytest.mark.parametrize("scheme", ["peri_ln", "hyper_connections", "mhc", "attn_res"])
def test_gradflow_profile_runs(scheme):
    cfg = cfg64(scheme, 2, init_std=0.02)
    torch.manual_seed(0)
    model = Transformer(cfg)
    batch = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    r = profile_model(model, batch, jacobian_iters=4)
    assert len(r["jacobian_star"]) == 4 and all(math.isfinite(v) and v > 0 for v in r["jacobian_star"])
    assert all(v > 0 for v in r["stream_grad_norm"]) and math.isfinite(r["log10_jacobian_product"])


# ---- cross-check: the independent `hyper-connections` package (PyPI) ---------------------------

def _to_theirs(x):  # ours [n, B, T, d] -> theirs [(B n), T, d]
    n, B, T, d = x.shape
    return x.permute(1, 0, 2, 3).reshape(B * n, T, d)


def assert_same_unit(ours, theirs, cfg, tol):
    """Our unit and the package's on the same random streams and the same F (theirs applies
    F to its branch input, ours to Norm(branch input): we give theirs F(Norm(.)))."""
    n, d = cfg.hc_streams, cfg.d_model
    lin = torch.nn.Linear(d, d, bias=False).double()
    f = lambda h: torch.tanh(lin(h))  # noqa: E731
    x = torch.randn(n, 2, 5, d, dtype=torch.float64)
    branch_in, add_residual = theirs(_to_theirs(x))
    want = add_residual(f(rms(branch_in, ours.norm.weight, cfg.norm_eps)))
    torch.testing.assert_close(_to_theirs(ours(x, f)), want, rtol=tol, atol=tol)


def test_hyper_connections_equal_the_hyper_connections_package():
    hc_pkg = pytest.importorskip("hyper_connections")
    cfg = cfg64("hyper_connections", 2, norm_eps=1e-30)
    ours = model64(cfg).blocks[0].ffn_residual  # sub-layer 1, maps perturbed
    n, d = cfg.hc_streams, cfg.d_model
    with torch.no_grad():
        ours.hc_norm.weight.fill_(1.0)  # theirs: F.normalize * sqrt(d) * (gamma + 1), gamma = 0
    theirs = hc_pkg.HyperConnections(n, dim=d, layer_index=1).double()
    with torch.no_grad():
        theirs.static_alpha.copy_(ours.static_alpha)
        theirs.dynamic_alpha_fn.copy_(ours.dynamic_alpha)
        theirs.dynamic_alpha_scale.copy_(ours.s_alpha[0])
        theirs.static_beta.copy_(ours.static_beta)
        theirs.dynamic_beta_fn.copy_(ours.dynamic_beta)
        theirs.dynamic_beta_scale.copy_(ours.s_beta[0])
    assert_same_unit(ours, theirs, cfg, tol=1e-10)


def test_mhc_static_maps_equal_the_hyper_connections_package():
    """The package's mHC normalises each stream (ours: the flattened n*d vector, as the paper),
    so only the static part is comparable: phi = 0 (ours) and dynamic fns = 0 (theirs); then
    H_pre = sigmoid(b_pre), H_post = 2 sigmoid(b_post), H_res = SK(b_res) in both. Theirs runs
    in fp32."""
    hc_pkg = pytest.importorskip("hyper_connections")
    cfg = cfg64("mhc", 2)
    ours = model64(cfg).blocks[0].ffn_residual
    n, d = cfg.hc_streams, cfg.d_model
    with torch.no_grad():
        for p in (ours.phi_pre, ours.phi_post, ours.phi_res):
            p.zero_()
    theirs = hc_pkg.ManifoldConstrainedHyperConnections(n, dim=d, layer_index=1).double()
    with torch.no_grad():
        theirs.static_alpha.copy_(torch.cat([ours.b_pre.unsqueeze(1), ours.b_res.T], dim=1))  # alpha[s, t] = H[t, s]
        theirs.static_beta.copy_(ours.b_post)
    assert_same_unit(ours, theirs, cfg, tol=1e-5)


def test_removed_attn_res_sub_layer_adds_nothing():
    """keel ablate on AttnRes: F's output is 0; in a block of S >= 2 the stream is unchanged
    except that an opening sub-layer starts an empty (zero) partial sum."""
    cfg = cfg64("attn_res", 2, attn_res_blocks=2)
    unit = AttnRes(cfg, 1).double()
    x = tuple(torch.randn(2, 2, 3, cfg.d_model, dtype=torch.float64).unbind(0))
    assert not unit.opens_block and all(torch.equal(a, b) for a, b in zip(unit.removed(x), x, strict=True))
    opener = AttnRes(cfg, 2).double()
    out = opener.removed(x)
    assert len(out) == 3 and out[:2] == x and not out[2].any()  # the completed blocks: the same tensors


def test_hc_units_reject_single_stream_misuse():
    """HC's unit maps [n, B, T, d] -> [n, B, T, d]; AttnRes' grows by one at a block's start."""
    cfg = cfg64("hyper_connections", 2)
    unit = HyperConnections(cfg, 0)
    x = torch.randn(cfg.hc_streams, 1, 2, cfg.d_model)
    assert unit(x, lambda h: h).shape == x.shape


# ---- FSDP2 and the trainer -----------------------------------------------------------------------

def test_new_schemes_train_the_same_under_fsdp2(tiny_data, tmp_path):
    """Each new scheme trains (4 steps, with a checkpoint and a resume-able run dir) and FSDP2
    over 2 CPU processes (gloo) follows the single-process losses and gradient norms."""
    import json

    from conftest import REPO, tiny_overrides
    from keel.config import load_config
    from keel.train import train
    from spawn import spawn_training

    schemes = ["peri_ln", "hyper_connections", "mhc", "attn_res"]

    def cfg(scheme, **kw):
        sets = tiny_overrides(tiny_data, steps=4, eval_every=4, checkpoint_every=4, **kw) + [f"model.residual={scheme}"]
        return load_config(REPO / "keel" / "configs" / "demo.toml", sets)

    spawn_training([(cfg(s, parallelism="fsdp"), tmp_path / f"fsdp-{s}", False) for s in schemes], world_size=2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for s in schemes:
            train(cfg(s), tmp_path / s)
    finally:
        torch.set_num_threads(threads)
    for s in schemes:
        a, b = ([json.loads(line) for line in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
                for d in (s, f"fsdp-{s}"))
        assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(5))
        assert a[-1]["loss"] < a[1]["loss"], s
        for ra, rb in zip(a, b):
            for key in ("loss", "grad_norm", "val_loss"):
                if key in ra:
                    assert rb[key] == pytest.approx(ra[key], rel=1e-4), (s, ra["step"], key)


# ---- Hyper-Connections Sec. 4 and mHC: weight decay, output projections ----------------------

def _decayed(model):
    from keel.config import TrainConfig
    from keel.train.optim import build_optimizer
    opt = build_optimizer(model, TrainConfig())
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)] for p in opt.param_groups[0]["params"]}, {names[id(p)] for p in opt.param_groups[1]["params"]}


@pytest.mark.parametrize("dynamic", [True, False])
def test_hyper_connections_decay_the_dynamic_parameters_only(dynamic):
    """HC Sec. 4: no weight decay on the static matrices (A_m | A_r, B), decay on the dynamic
    ones (W_m | W_r, W_beta). keel v1 did the opposite for two of them (decayed A, not W_beta)."""
    decay, no_decay = _decayed(Transformer(cfg64("hyper_connections", 2, hc_dynamic=dynamic)))
    unit = "blocks.0.attn_residual."
    assert {unit + "static_alpha", unit + "static_beta"} <= no_decay
    if dynamic:
        assert {unit + "dynamic_alpha", unit + "dynamic_beta"} <= decay
        assert {unit + "s_alpha", unit + "s_beta", unit + "hc_norm.weight"} <= no_decay
    assert "blocks.0.attn.wq.weight" in decay and "blocks.0.attn.wo.weight" in decay


def test_mhc_decays_its_projections_not_its_biases():
    decay, no_decay = _decayed(Transformer(cfg64("mhc", 2)))
    unit = "blocks.1.ffn_residual."
    assert {unit + x for x in ("phi_pre", "phi_post", "phi_res")} <= decay
    assert {unit + x for x in ("b_pre", "b_post", "b_res", "alpha_pre", "alpha_post", "alpha_res")} <= no_decay
    assert not any("hc_norm" in n for n, _ in Transformer(cfg64("mhc", 2)).named_parameters())  # no gain (paper)


@pytest.mark.parametrize("n", [2, 4])
def test_hyper_connections_scale_the_output_projections(n):
    """HC Sec. 4: the output layers of F (attention's output projection, the FFN's second
    linear) start with std / sqrt(n); every other matrix keeps N(0, init_std^2)."""
    cfg = cfg64("hyper_connections", 4, hc_streams=n, d_model=128, d_ff=256, init_std=0.02)
    torch.manual_seed(0)
    model = Transformer(cfg)
    for block in model.blocks:
        for w, want in ((block.attn.wo.weight, 0.02 / math.sqrt(n)), (block.ffn.w2.weight, 0.02 / math.sqrt(n)),
                        (block.attn.wq.weight, 0.02), (block.ffn.w1.weight, 0.02)):
            assert w.std().item() == pytest.approx(want, rel=0.05)
    torch.manual_seed(0)
    pre = Transformer(cfg64("mhc", 4, hc_streams=n, d_model=128, d_ff=256, init_std=0.02))
    assert pre.blocks[0].attn.wo.weight.std().item() == pytest.approx(0.02, rel=0.05)  # mHC: not scaled


def test_scheme_versions_name_new_runs():
    """A changed scheme gets a new implementation version, and its grid runs a new name, so a
    study never takes a run of the old implementation for a cached one."""
    from keel.experiments.sweep import build_jobs
    assert (HyperConnections.version, ManifoldHyperConnections.version, Residual.version) == (2, 2, 1)
    jobs = build_jobs("demo", {"model.residual": ["hyper_connections", "keel"], "model.n_layers": [2]})
    assert [j.name for j in jobs] == ["hyper_connections_L4_v2", "keel_L4"]
    assert jobs[0].values["scheme_version"] == 2 and "scheme_version" not in jobs[1].values


@pytest.mark.parametrize("readout", ["attend", "sum"])
@pytest.mark.parametrize("variant", [{"attn_res_variant": "full"}, {"attn_res_blocks": 4}, {"attn_res_blocks": 3}])
def test_attn_res_with_zero_queries_is_a_pre_ln_network(variant, readout):
    """AttnRes (arXiv 2603.15031) with every pseudo-query 0 (its init) weights all earlier
    representations alike: each sub-layer reads their mean, which F's input norm makes the
    Pre-LN stream emb + sum of outputs (Norm(mean) = Norm(sum) up to eps, here 1e-30); the same
    holds for the final readout. So the logits equal Pre-LN's with the same weights."""
    cfg = cfg64("attn_res", 4, norm_eps=1e-30, attn_res_readout=readout, **variant)
    model, ids = model64(cfg, perturb=False), ids_for(cfg)
    assert all(not u.query.any() for k, u, _ in model.sublayers() if k > 0)
    ref = shared_weights_pre_ln(model)
    torch.testing.assert_close(hidden(model, ids, model.lm_head), hidden(ref, ids, ref.lm_head), rtol=1e-10, atol=1e-10)
