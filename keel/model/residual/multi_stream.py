"""The multi-stream schemes of the 2026 residual bench: Hyper-Connections and mHC carry a stream
with an extra leading axis, [n, B, T, d], Attention Residuals a tuple of m [B, T, d] sources; their
small mixing maps run in the stream's dtype with autocast off (a bf16 einsum would turn the fp32
stream into bf16), F itself runs under autocast as in every other scheme. (Peri-LN, the bench's fourth design, is a
single-stream scheme: :mod:`keel.model.residual.single_stream`.)"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from keel.config import ModelConfig
from keel.errors import KeelError
from keel.keys import check_key
from keel.model.norm import RMSNorm, rms_reciprocal
from keel.model.residual.base import Residual


def _no_autocast(x: torch.Tensor):
    """A context in which autocast is off for x's device (the maps run in x's dtype)."""
    return torch.autocast(x.device.type, enabled=False)


class ExpandedStream(nn.Module):
    """HC/mHC stream module (Zhu et al. 2025, arXiv 2409.19606, Sec. 2 and Fig. 2): the
    embedding h^0 [B, T, d] is copied into n streams, ``begin(h) = [h, ..., h]`` [n, B, T,
    d]; at the end the n streams are summed, ``end(H) = sum_i H_i`` [B, T, d], before the
    final norm and the LM head. No parameters."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n = cfg.hc_streams

    def begin(self, x: torch.Tensor) -> torch.Tensor:
        return x.unsqueeze(0).expand(self.n, *x.shape)

    def end(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum(0)


class ExpandedStreamScheme(Residual):
    """A scheme whose stream is n copies of the embedding (:class:`ExpandedStream`, n =
    ``cfg.hc_streams``): Hyper-Connections and mHC."""

    config_keys = ("hc_streams",)

    @classmethod
    def make_stream(cls, cfg: ModelConfig) -> nn.Module | None:
        return ExpandedStream(cfg)

    @classmethod
    def stream_copies(cls, cfg: ModelConfig) -> int:
        return cfg.hc_streams


class HyperConnections(ExpandedStreamScheme):
    """Hyper-Connections (Zhu et al. 2025, "Hyper-Connections", ICLR 2025, arXiv 2409.19606).

    The stream is H [n, B, T, d], n = ``cfg.hc_streams`` (expansion rate, paper default 4),
    started as n copies of the embedding and summed at the end (:class:`ExpandedStream`).
    Per sub-layer, with A [n, n+1] = (A_m | A_r) and B [n] (the paper's (n+1) x (n+1) HC
    matrix has first row (0, B) and other rows (A_m, A_r); Sec. 2.1)::

        (h_0, H'_1 .. H'_n) = A^T H          h_0 = sum_j A_m[j] H_j   (width connections)
        H_i <- H'_i + B_i * F(Norm(h_0))     (depth connections)

    Dynamic HC (``cfg.hc_dynamic``, default True; Sec. 2.2), with H_bar = Norm_hc(H)
    per stream::

        A_m(H) = A_m + s_alpha * tanh(H_bar W_m),   A_r(H) = A_r + s_alpha * tanh(H_bar W_r)
        B(H)   = B   + s_beta  * tanh(H_bar W_beta)

    (W_m | W_r) is ``dynamic_alpha`` [d, n+1], W_beta ``dynamic_beta`` [d]; static HC uses
    A and B alone. Init (paper, Sec. 2.3, and its App. J pseudo-code): ``A_m = e_{k mod n}`` (sub-
    layer k reads stream k mod n; k = the sub-layer index, our choice of counter), ``A_r =
    I_n``, ``B = 1``, W = 0, s_alpha = s_beta = 0.01. The model therefore starts as a plain
    Pre-LN residual network: the n streams stay equal copies of the Pre-LN stream x,
    ``H_i <- x + F(Norm(x))``, and the final ``Norm(sum_i H_i) = Norm(n x)`` equals Pre-LN's
    ``Norm(x)`` up to RMSNorm's eps (the transcription test checks this).

    Norms: ``norm`` (F's input norm, as in Pre-LN; the paper's T includes it), ``hc_norm``
    (dynamic only; the paper uses LayerNorm, we use RMSNorm, gain init 1, as keel does
    everywhere and as the ``hyper-connections`` package does), and the model's final norm.
    The maps run in the stream's dtype (fp32) with autocast off.

    The paper's Sec. 4 (implementation details), both since version 2: (i) weight decay on the
    dynamic parameters (W_m|W_r and W_beta) and none on the static ones (A = A_m|A_r, B) or the
    scale factors; (ii) the output projections of F (attention's ``wo``, the FFN's ``w2``) start
    with their standard deviation divided by sqrt(n), so that the n summed streams start at
    the variance of one Pre-LN stream.

    Removed (``keel ablate``): the n streams pass unchanged (no width mixing, no F).
    """

    final_norm = True
    version = 2  # Sec. 4: weight decay on the dynamic parameters only, output projections / sqrt(n)
    weight_decay = {"static_alpha": False, "static_beta": False, "dynamic_alpha": True, "dynamic_beta": True}
    config_keys = ExpandedStreamScheme.config_keys + ("hc_dynamic",)

    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__(cfg, index)
        n, d = cfg.hc_streams, cfg.d_model
        self.n = n
        self.dynamic = cfg.hc_dynamic
        self.norm = RMSNorm(d, cfg.norm_eps)
        self.static_alpha = nn.Parameter(torch.empty(n, n + 1))
        self.static_beta = nn.Parameter(torch.empty(n))
        if self.dynamic:
            self.hc_norm = RMSNorm(d, cfg.norm_eps)
            self.dynamic_alpha = nn.Parameter(torch.empty(d, n + 1))
            self.dynamic_beta = nn.Parameter(torch.empty(d))
            self.s_alpha = nn.Parameter(torch.empty(1))
            self.s_beta = nn.Parameter(torch.empty(1))
        self.reset_scheme_parameters()

    @torch.no_grad()
    def init_sublayer(self, sublayer: nn.Module) -> None:
        scale_output_projection(sublayer, self.n)

    @torch.no_grad()
    def reset_scheme_parameters(self) -> None:
        n = self.static_beta.shape[0]
        self.static_alpha.zero_()
        self.static_alpha[self.index % n, 0] = 1.0  # A_m = e_{k mod n}
        self.static_alpha[:, 1:].copy_(torch.eye(n))  # A_r = I
        self.static_beta.fill_(1.0)  # B = 1
        if self.dynamic:
            self.dynamic_alpha.zero_()
            self.dynamic_beta.zero_()
            self.s_alpha.fill_(0.01)
            self.s_beta.fill_(0.01)

    def connections(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Width connections of the stream x [n, B, T, d]: ``(h_0, H', B(H))`` with h_0 [B, T, 1, d],
        H' [B, T, n, d] (``A(H)^T H`` split into its first row and the rest) and B(H) [B, T, n]
        (static: [n]).

        ``Norm_hc(H) W = r * (H @ (g * W))`` with ``r = 1 / rms(H)`` per stream (an identity), so
        the normalised stream is never formed; the mixing is one batched product over the tokens
        in the [B, T, n, d] layout (:meth:`forward` stores the stream that way), sliced into h_0
        and H' (slices, not ``split``: a split's backward concatenates gradients, which autocast
        refuses for a bf16/fp16 pair; not two products: h_0's alone has a contraction of 1 in its
        backward, ~4x slower on CPU than the whole mixing)."""
        xs = x.movedim(0, -2)  # [B, T, n, d]
        if not self.dynamic:
            alpha, beta = self.static_alpha.to(x.dtype), self.static_beta
        else:
            n = self.n
            w = self.hc_norm.weight[:, None] * torch.cat([self.dynamic_alpha, self.dynamic_beta[:, None]], 1)
            proj = torch.tanh((xs @ w.to(x.dtype)) * rms_reciprocal(xs, self.hc_norm.eps))  # [B, T, n, n+2]
            alpha = self.static_alpha + self.s_alpha * proj[..., : n + 1]
            beta = self.static_beta + self.s_beta * proj[..., n + 1]
        mixed = torch.matmul(alpha.transpose(-1, -2), xs)  # [B, T, n+1, d]
        return mixed[..., :1, :], mixed[..., 1:, :], beta

    def forward(self, x, f):
        with _no_autocast(x):
            h0, rest, beta = self.connections(x)
        out = f(self.norm(h0.squeeze(-2)))
        with _no_autocast(x):  # autocast's addcmul rejects a bf16 F under an fp16 stream (and the reverse)
            return torch.addcmul(rest, beta.unsqueeze(-1).to(x.dtype), out.unsqueeze(-2).to(x.dtype)).movedim(-2, 0)


def scale_output_projection(sublayer: nn.Module, n: int) -> None:
    """Divide the weights of F's output projection (attention's ``wo``, the FFN's ``w2``: the
    linear layers that write into the stream) by ``sqrt(n)`` (Hyper-Connections, Zhu et al. 2025,
    Sec. 4: with n streams summed at the end, the output layers' standard deviation is scaled by
    1 / sqrt(n)). Other sub-layers' weights are left as they are."""
    for name in ("wo", "w2"):
        layer = getattr(sublayer, name, None)
        if isinstance(layer, nn.Linear):
            layer.weight.div_(math.sqrt(n))


def sinkhorn_knopp(logits: torch.Tensor, iters: int) -> torch.Tensor:
    """Sinkhorn-Knopp projection onto the doubly stochastic matrices (mHC, Xie et al. 2025,
    arXiv 2512.24880, Sec. 4.2, Eq. for H_res; Sinkhorn & Knopp 1967): ``M_0 = exp(logits)``,
    then ``iters`` times ``M_t = T_r(T_c(M_{t-1}))``: divide every column by its sum, then every
    row by its sum.

    The largest logit of each matrix is subtracted first (a constant factor, removed exactly by
    the first normalisation; it keeps exp finite). After the last step every row sums to 1 up to
    rounding (each output stream ``sum_j M[i, j] x_j`` is a convex mix of the input streams: the
    forward gain is exactly 1, the paper's Fig. 7) and the columns to 1 up to the remaining
    Sinkhorn error; entries are > 0. (Before version 2 of mHC the order was rows, then columns.)

    Computed in Sinkhorn and Knopp's own form, ``M_t = diag(u_t) K diag(v_t)`` with ``K =
    exp(logits)``: a column step is ``v_t = 1 / (u_{t-1}^T K)``, a row step ``u_t = 1 / (K v_t)``
    (``u_0 = 1``), the same matrices as the alternating divisions up to rounding, on vectors of
    n instead of matrices of n^2. In eager mode the gradient is the hand-written reverse pass of
    :class:`_SinkhornKnopp` (only K and the 2 ``iters`` scaling vectors are kept: 2 n ``iters``
    numbers per matrix, not autograd's 2 (n^2 + n) ``iters``); under ``torch.compile`` the same
    iteration is written as plain ops (:func:`_sinkhorn_scalings`) and the compiler derives it.

    Args:
        logits: [..., n, n], any float dtype (the result has it).
        iters: number of column+row normalisations (mHC's t_max, default 20), >= 1.
    Returns:
        [..., n, n], logits' dtype.
    """
    # tokens last, [n, n, N]: on CPU a reduction over a leading dim of n runs vectorised over
    # the N tokens, ~3x faster than over a trailing dim of n (benchmarks/README.md, the bench)
    lt = logits.flatten(0, -3).permute(1, 2, 0) if logits.dim() > 2 else logits.unsqueeze(-1)
    if torch.compiler.is_compiling():
        k = torch.exp(lt - lt.amax(dim=(0, 1), keepdim=True).detach())
        u, v = _sinkhorn_scalings(k, iters)[2:]
        m = u.unsqueeze(1) * k * v.unsqueeze(0)
    else:
        m = _SinkhornKnopp.apply(lt.contiguous(), iters)[0]
    return m.permute(2, 0, 1).reshape(logits.shape)


def _sinkhorn_scalings(k: torch.Tensor, iters: int) -> tuple[list, list, torch.Tensor, torch.Tensor]:
    """The scaling vectors of :func:`sinkhorn_knopp` for K [n, n, N] (N matrices, last):
    ``([u_0 .. u_T], [v_1 .. v_T], u_T, v_T)``, each [n, N]."""
    u = torch.ones_like(k[0])
    us, vs = [u], []
    for _ in range(iters):
        v = torch.reciprocal((u.unsqueeze(1) * k).sum(0))  # column sums of diag(u) K
        u = torch.reciprocal((k * v.unsqueeze(0)).sum(1))  # row sums of K diag(v)
        us.append(u)
        vs.append(v)
    return us, vs, u, v


class _SinkhornKnopp(torch.autograd.Function):
    """:func:`sinkhorn_knopp` on logits [n, n, N] (N matrices, last) with a hand-written reverse
    pass (and forward-mode ``jvp``, for :mod:`keel.diagnostics.gradflow`): outputs ``(M, K, U,
    V)`` [n, n, N], [n, n, N], [T+1, n, N], [T, n, N]; U = [u_0 .. u_T] and V = [v_1 .. v_T] are
    non-differentiable (kept for the derivatives).

    Reverse pass, from ``M = diag(u_T) K diag(v_T)`` back through each step ``u_t = 1 / r_t, r_t
    = K v_t`` and ``v_t = 1 / c_t, c_t = K^T u_{t-1}``: ``g_r = -g_u u_t^2``, ``g_v += K^T g_r``,
    ``g_c = -g_v v_t^2``, ``g_u = K g_c``; ``g_K = G * u_T v_T^T + sum_t (g_r_t v_t^T + u_{t-1}
    g_c_t^T)``, ``g_logits = g_K * K``."""

    @staticmethod
    def forward(logits, iters):
        k = torch.exp(logits - logits.amax(dim=(0, 1), keepdim=True))
        us, vs, u, v = _sinkhorn_scalings(k, iters)
        return u.unsqueeze(1) * k * v.unsqueeze(0), k, torch.stack(us), torch.stack(vs)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, k, us, vs = output
        ctx.mark_non_differentiable(k, us, vs)
        ctx.save_for_backward(k, us, vs)
        ctx.save_for_forward(k, us, vs)

    @staticmethod
    def backward(ctx, gm, _gk, _gus, _gvs):
        k, us, vs = ctx.saved_tensors
        with torch.autocast(k.device.type, enabled=False):  # as the forward (autocast's stack rejects bf16 under fp16)
            return _SinkhornKnopp._reverse(gm, k, us, vs), None

    @staticmethod
    def _reverse(gm, k, us, vs):
        usq, vsq = us.square(), vs.square()
        w = gm * k
        gu = (w * vs[-1].unsqueeze(0)).sum(1)
        gv = (w * us[-1].unsqueeze(1)).sum(0)
        grs, gcs = [], []
        for t in reversed(range(vs.shape[0])):  # vs[t] = v_{t+1}, us[t + 1] = u_{t+1}
            gr = -gu * usq[t + 1]
            gc = -(gv + (gr.unsqueeze(1) * k).sum(0)) * vsq[t]
            gu, gv = (k * gc.unsqueeze(0)).sum(1), 0
            grs.append(gr)
            gcs.append(gc)
        gr, gc = torch.stack(grs[::-1]), torch.stack(gcs[::-1])  # [T, n, N]
        gk = gm * us[-1].unsqueeze(1) * vs[-1].unsqueeze(0) + (
            gr.unsqueeze(2) * vs.unsqueeze(1) + us[:-1].unsqueeze(2) * gc.unsqueeze(1)).sum(0)
        return gk * k

    @staticmethod
    def jvp(ctx, logits_t, _iters_t):
        k, us, vs = ctx.saved_tensors
        dk = logits_t * k  # the subtracted max is a constant (M does not depend on it)
        du, dv = torch.zeros_like(us[0]), None
        for t in range(vs.shape[0]):
            dv = -((du.unsqueeze(1) * k + us[t].unsqueeze(1) * dk).sum(0)) * vs[t].square()
            du = -((dk * vs[t].unsqueeze(0) + k * dv.unsqueeze(0)).sum(1)) * us[t + 1].square()
        u, v = us[-1].unsqueeze(1), vs[-1].unsqueeze(0)
        return du.unsqueeze(1) * k * v + u * dk * v + u * k * dv.unsqueeze(0), None, None, None


class ManifoldHyperConnections(ExpandedStreamScheme):
    """mHC (Xie et al. 2025, DeepSeek, "mHC: Manifold-Constrained Hyper-Connections", arXiv
    2512.24880, Sec. 4). Stream x [n, B, T, d] as in :class:`HyperConnections` (n =
    ``cfg.hc_streams``, paper default 4; n copies of the embedding, summed at the end)::

        x_{l+1} = H_res x_l + H_post^T F(Norm(H_pre x_l))

    with, per token, the flattened stream ``x_vec`` [n d] and (the paper's parametrisation,
    Sec. 4.2)::

        x' = RMSNorm(x_vec)
        H_pre  = sigmoid(alpha_pre  * (x' phi_pre)  + b_pre)                   [1 x n]
        H_post = 2 sigmoid(alpha_post * (x' phi_post) + b_post)                [1 x n]
        H_res  = Sinkhorn-Knopp(alpha_res * mat(x' phi_res) + b_res)          [n x n]

    ``H_res`` is doubly stochastic (:func:`sinkhorn_knopp`, ``cfg.mhc_sinkhorn_iters``
    iterations, the paper's t_max = 20); H_pre in (0, 1) and H_post in (0, 2) are the
    paper's non-negativity constraints on the pre/post maps.

    Constants and init. Paper: n = 4, t_max = 20, gating factors alpha init 0.01. The paper
    is silent on the biases; our choice makes the model start as a plain Pre-LN network (a
    doubly stochastic H_res maps equal streams to equal streams, ``H_post = 2 sigmoid(0) = 1``
    adds F once, F's input norm removes the scale of ``H_pre x``) and breaks the symmetry of
    the n equal streams, which otherwise get equal gradients and stay equal: phi = 0;
    ``b_pre = e_{k mod n}``, so ``H_pre = sigmoid(b_pre)`` = 0.731 on stream k mod n and 0.5 on
    the others (sub-layer k weights its own stream 1.46x, a mild preference, not "mostly
    stream k": a stronger logit would start the sigmoid in saturation); ``b_res = I_n``, so
    ``H_res = Sinkhorn(exp(I))`` has 0.475 on the diagonal and 0.175 elsewhere for n = 4 (an
    even mix tilted towards identity, not near the identity); ``b_post = 0``. ``b_pre`` and
    ``b_res`` are the ``hyper-connections`` package's, so its mHC checks ours (that package
    starts H_post from 2 sigmoid(1) = 1.46, we from 1, HC's B = 1).

    Weight decay as HC's Sec. 4 gives it: the dynamic projections phi are decayed, the static
    biases b and the gating factors alpha are not (version 2; version 1 decayed b_res).

    Norms: ``norm`` (F's input norm) and the RMS normalisation of the flattened n*d vector,
    which has no gain (the paper's RMSNorm(x_vec) carries none; version 1 had one), and the
    model's final norm. The maps run in the stream's dtype, autocast off.

    Removed (``keel ablate``): the n streams pass unchanged.
    """

    final_norm = True
    version = 2  # Sinkhorn columns then rows (rows exact), no gain on the stream norm, b_res not decayed
    weight_decay = {"b_res": False, "phi_pre": True, "phi_post": True, "phi_res": True}
    config_keys = ExpandedStreamScheme.config_keys + ("mhc_sinkhorn_iters",)

    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__(cfg, index)
        n, d = cfg.hc_streams, cfg.d_model
        self.iters = cfg.mhc_sinkhorn_iters
        self.eps = cfg.norm_eps
        self.norm = RMSNorm(d, cfg.norm_eps)
        self.phi_pre = nn.Parameter(torch.empty(n * d, n))
        self.phi_post = nn.Parameter(torch.empty(n * d, n))
        self.phi_res = nn.Parameter(torch.empty(n * d, n * n))
        self.alpha_pre = nn.Parameter(torch.empty(1))
        self.alpha_post = nn.Parameter(torch.empty(1))
        self.alpha_res = nn.Parameter(torch.empty(1))
        self.b_pre = nn.Parameter(torch.empty(n))
        self.b_post = nn.Parameter(torch.empty(n))
        self.b_res = nn.Parameter(torch.empty(n, n))
        self.reset_scheme_parameters()

    @torch.no_grad()
    def reset_scheme_parameters(self) -> None:
        n = self.b_pre.shape[0]
        for p in (self.phi_pre, self.phi_post, self.phi_res, self.b_pre, self.b_post):
            p.zero_()
        for p in (self.alpha_pre, self.alpha_post, self.alpha_res):
            p.fill_(0.01)
        self.b_pre[self.index % n] = 1.0
        self.b_res.copy_(torch.eye(n))

    def maps(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(H_pre, H_post, H_res)`` of x [n, B, T, d]: [B, T, n], [B, T, n], [B, T, n, n].

        One product with ``(phi_pre | phi_post | phi_res)`` [n d, n^2 + 2n] (the paper fuses
        these projections in its infrastructure section), and ``RMSNorm(x_vec) phi = r * (x_vec
        phi)``, ``r = 1 / rms(x_vec)`` (an identity), so the normalised vector is never formed."""
        n = x.shape[0]
        xv = x.movedim(0, -2).flatten(-2)  # [B, T, n d]: a view when the stream is stored [B, T, n, d]
        r = rms_reciprocal(xv, self.eps)
        phi = torch.cat([self.phi_pre, self.phi_post, self.phi_res], 1).to(x.dtype)
        proj = (xv @ phi) * r  # [B, T, n^2 + 2n]
        h_pre = torch.sigmoid(self.alpha_pre * proj[..., :n] + self.b_pre)
        h_post = 2 * torch.sigmoid(self.alpha_post * proj[..., n : 2 * n] + self.b_post)
        logits = self.alpha_res * proj[..., 2 * n :].unflatten(-1, (n, n)) + self.b_res
        return h_pre, h_post, sinkhorn_knopp(logits, self.iters)

    def forward(self, x, f):
        with _no_autocast(x):
            h_pre, h_post, h_res = self.maps(x)
            # (H_pre; H_res) x as one batched product over the tokens, in the stream's [B, T, n, d]
            # storage, then sliced (see HyperConnections.connections)
            both = torch.cat([h_pre.unsqueeze(-2), h_res], -2) @ x.movedim(0, -2)  # [B, T, n+1, d]
            h, mixed = both[..., :1, :], both[..., 1:, :]
        out = f(self.norm(h.squeeze(-2)))
        with _no_autocast(x):  # autocast's addcmul rejects a bf16 F under an fp16 stream (and the reverse)
            return torch.addcmul(mixed, h_post.unsqueeze(-1).to(x.dtype), out.unsqueeze(-2).to(x.dtype)).movedim(-2, 0)


def depth_attention(v: Sequence[torch.Tensor], query: torch.Tensor, key_norm: RMSNorm) -> torch.Tensor:
    """Attention over depth (Attention Residuals, Kimi Team 2026, arXiv 2603.15031, Eq. for
    h_l; official pseudo-code ``block_attn_res``): ``h = sum_i softmax_i(w . Norm(v_i)) v_i``.

    The keys ``Norm(v_i)`` are never formed: ``w . (v_i / rms(v_i) * g) = (v_i . (w * g)) /
    rms(v_i)`` with ``rms(v) = sqrt(mean_d v^2 + eps)`` (an identity), so only v is kept for
    the backward pass. No 1/sqrt(d) scale on the logits (the official pseudo-code has none).
    Each source is read where it lies (no stacked copy): autograd keeps the sources themselves,
    which every later sub-layer shares, and per call only [m, B, T] logits and weights.

    Args:
        v: the sources, m >= 1 tensors [B, T, d] of one dtype.
        query: the pseudo-query w [d].
        key_norm: the RMSNorm of the keys (gain g [d], its eps).
    Returns:
        [B, T, d] in v's dtype (the logits, the RMS and the softmax run in fp32 at least); the
        weighted sum runs over the sources in order, ``((w_0 v_0 + w_1 v_1) + w_2 v_2) + ...``.
    """
    dtype = v[0].dtype
    w = query.to(dtype) * key_norm.weight.to(dtype)
    # the mean square, rsqrt and softmax in fp32 at least: in fp16 the backward of rsqrt overflows
    f32 = torch.promote_types(dtype, torch.float32)
    logits = torch.stack([(s @ w).to(f32) * rms_reciprocal(s, key_norm.eps, f32).squeeze(-1) for s in v])  # [m, B, T]
    weights = torch.softmax(logits, dim=0).to(dtype).unsqueeze(-1)  # [m, B, T, 1]
    # indexed, not unbind: unbind's backward is a stack, which autocast refuses for a bf16/fp16 pair
    h = weights[0] * v[0]
    for i in range(1, len(v)):
        h = h + weights[i] * v[i]
    return h


class DepthAttentionReadout(nn.Module):
    """AttnRes stream module: ``begin(emb) = (emb,)`` (the embedding is the first source,
    b_0 = h_1 in the paper; the stream is a tuple of m sources [B, T, d], see :class:`AttnRes`);
    ``end(S)`` = :func:`depth_attention` over every
    block representation and the last partial sum, with its own pseudo-query (init 0) and
    key norm, before the model's final norm (``cfg.attn_res_readout = "attend"``, default).
    The official pseudo-code shows one layer only, not how the last hidden state is formed:
    this is our choice, as the public reproductions' final aggregation (``final_res_proj``)
    does; ``"sum"`` instead reads out the sum of all sources (the embedding plus every
    sub-layer output: what a plain residual stream would hold), no parameters."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attend = cfg.attn_res_readout == "attend"
        if self.attend:
            self.query = nn.Parameter(torch.zeros(cfg.d_model))
            self.key_norm = RMSNorm(cfg.d_model, cfg.norm_eps)

    @torch.no_grad()
    def reset_scheme_parameters(self) -> None:
        if self.attend:
            self.query.zero_()

    def begin(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (x,)

    def end(self, s: Sequence[torch.Tensor]) -> torch.Tensor:
        if not self.attend:  # in order, as depth_attention sums (equal to a stacked tensor's sum(0))
            out = s[0]
            for v in s[1:]:
                out = out + v
            return out
        with _no_autocast(s[0]):
            return depth_attention(s, self.query, self.key_norm)


def attn_res_block_size(cfg: ModelConfig) -> int:
    """Sub-layers per AttnRes block: 1 for Full AttnRes; ``ceil(L / N)`` for Block AttnRes
    with N = ``cfg.attn_res_blocks`` (so at most N blocks; the last may be shorter).

    Raises:
        KeelError: ``model.attn_res_variant`` or ``model.attn_res_blocks`` outside its
            declaration (keel.config.ModelConfig).
    """
    for name in ("attn_res_variant", "attn_res_blocks"):
        check_key(cfg, "model", name)
    if cfg.attn_res_variant == "full":
        return 1
    return -(-cfg.n_sublayers // cfg.attn_res_blocks)


class AttnRes(Residual):
    """Attention Residuals (Kimi Team 2026, "Attention Residuals", arXiv 2603.15031; official
    repository MoonshotAI/Attention-Residuals, its PyTorch pseudo-code). Each sub-layer's
    input is a softmax-weighted sum over earlier representations, weights from one learned
    pseudo-query w_l [d] per sub-layer over RMS-normalised sources (:func:`depth_attention`)::

        h_l = sum_i softmax_i(w_l . Norm_l(v_i)) v_i,    out_l = F_l(Norm(h_l))

    Full AttnRes: the sources are v_0 = the embedding and every earlier sub-layer output.
    Block AttnRes (default, ``cfg.attn_res_variant = "block"``): the L sub-layers are cut
    into blocks of S = ceil(L / N) sub-layers (N = ``cfg.attn_res_blocks``, default 8, the
    paper's "N ~ 8 recovers most of Full's gain"); the sources are b_0 = the embedding, the
    completed blocks' sums b_n = sum of their sub-layers' outputs, and the current block's
    partial sum. As in the official code, a block closes right before a sub-layer whose
    index is a multiple of S (that sub-layer still attends over the closed block, then
    starts a new partial sum). With S = 1 Block equals Full.

    The stream is a tuple of m sources [B, T, d] (the official code's list ``blocks`` plus its
    ``partial_block``): the completed blocks and, last, the partial sum (begun as (embedding,)
    by :class:`DepthAttentionReadout`, which also forms the model's output by a last depth
    attention). A sub-layer passes the completed blocks on as they are (the same tensors) and
    appends or replaces only the partial sum, so autograd keeps each source once however many
    sub-layers read it (version 1 re-stacked an [m, B, T, d] tensor at every sub-layer, and
    kept each stack). The official pseudo-code counts blocks in layers (attention + MLP); we
    count in sub-layers, so S may be odd (e.g. 1).

    Init: w_l = 0 (the paper: zero-initialised pseudo-queries, uniform weights at start);
    norms' gains 1. Sub-layer 0 has a single source (the embedding, weight 1), hence no
    pseudo-query or key norm (the official code creates them; they never get a gradient).
    Norms per sub-layer: ``norm`` (F's input norm; the official ``attn_norm``/``mlp_norm``)
    and ``key_norm`` (``attn_res_norm``/``mlp_res_norm``); the readout's key norm; the
    model's final norm. The depth attention runs in the stream's dtype with autocast off.

    Removed (``keel ablate``): F's output is taken as 0 -- the block structure stays, the
    sub-layer adds nothing to its block's partial sum (for S >= 2 an exact drop; in Full
    AttnRes the source v_i = 0 still takes softmax weight, at logit 0).
    """

    final_norm = True
    version = 2  # the sources as a tuple: the forward's values are v1's, the gradients' summation order is not
    config_keys = ("attn_res_variant", "attn_res_blocks", "attn_res_readout")

    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__(cfg, index)
        self.opens_block = index % attn_res_block_size(cfg) == 0
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        if index > 0:  # sub-layer 0 has one source, the embedding: weight 1, nothing to learn
            self.key_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
            self.query = nn.Parameter(torch.zeros(cfg.d_model))

    @classmethod
    def make_stream(cls, cfg: ModelConfig) -> nn.Module | None:
        return DepthAttentionReadout(cfg)

    @classmethod
    def check_config(cls, cfg: ModelConfig) -> None:
        """A looped model is refused: the sources, the block boundaries (S = ceil(L / N)) and the
        pseudo-query w_l belong to one effective sub-layer l, so one unit shared by R applications
        would open blocks and attend over a different set of sources at each."""
        if cfg.loop_core:
            raise KeelError("model.residual = attn_res cannot loop (model.loop_core >= 1): its pseudo-queries and block "
                            "boundaries belong to one effective sub-layer each, which shared core weights cannot be")

    @classmethod
    def stream_copies(cls, cfg: ModelConfig) -> int:
        return 1 + -(-cfg.n_sublayers // attn_res_block_size(cfg))  # the embedding and every block's sum

    @torch.no_grad()
    def reset_scheme_parameters(self) -> None:
        if self.index > 0:
            self.query.zero_()

    def removed(self, x):
        return AttnRes.forward(self, x, torch.zeros_like)

    def forward(self, x, f):
        """x: the sources, a tuple of m tensors [B, T, d]; returns the next tuple (m + 1 sources when
        this sub-layer opens a block, else m, the last one the new partial sum)."""
        if self.index == 0:
            h = x[0]
        else:
            with _no_autocast(x[0]):
                h = depth_attention(x, self.query, self.key_norm)
        out = f(self.norm(h)).to(x[0].dtype)
        if self.opens_block:  # the partial sum becomes a block; out starts the next one
            return (*x, out)
        return (*x[:-1], x[-1] + out)
