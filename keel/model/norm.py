"""RMSNorm and the fused norm of a scaled sum: the one norm kernel of every residual scheme.

Numerics of ``Norm(a * x + F)``: RMSNorm is scale-invariant up to its eps, and exactly
``Norm_eps(a * v) == Norm_{eps / a^2}(v)``. The units that scale the stream by ``a > 1``
(DeepNorm, Keel) therefore compute ``Norm_{eps / a^2}(x + F / a)``: the same function,
but the sum never grows to ``a * |x|``, F is upcast to the stream's dtype (fp32 under
autocast) before it is added, and the stream stays O(1). In bf16, ``a * x + F`` with
``a >= 256`` would round F away entirely (8 significant bits).

Every norm of a sum (Post-LN, DeepNorm, Keel, Mix-LN's Post-LN blocks) and every plain
RMSNorm runs as one fused op, :func:`rms_norm_of_sum`: ``torch.add(x, F, alpha=1/a)``
(no ``F / a`` temporary, no separate upcast of a bf16 F) and a hand-written backward that
keeps only the normalised sum and the reciprocal RMS.
"""

from __future__ import annotations


import torch
from torch import nn
from torch.autograd.function import once_differentiable



class _ScaledSumRMSNorm(torch.autograd.Function):
    """``y = Norm_eps(x + scale * f) * g`` with hand-written derivatives (see :func:`rms_norm_of_sum`).

    Forward returns ``(y, n, r)``: the output, the normalised sum ``n = s * r`` [..., d]
    and the reciprocal RMS ``r = 1 / sqrt(mean_d s^2 + eps)`` [..., 1] (both in the compute
    dtype, marked non-differentiable); only ``n``, ``r`` and the gain are saved, where
    autograd's composite RMSNorm keeps the sum, its square and more. With ``dn = dy * g``::

        dg = sum_{rows} dy * n
        ds = r * (dn - n * mean_d(dn * n))          (vector-Jacobian product of RMSNorm)
        dx = ds,  df = scale * ds

    and for forward-mode AD (``torch.func.jvp``, used by :mod:`keel.diagnostics.gradflow`),
    with ``s' = x' + scale * f'``: ``n' = r * (s' - n * mean_d(n * s'))``, ``y' = n' * g + n * g'``.
    """

    @staticmethod
    def forward(x, f, weight, scale, eps):
        cd = torch.promote_types(x.dtype, torch.float32)  # at least fp32
        if f is None:
            s = x.to(cd)
        else:  # one pass: no f / alpha temporary, no separate upcast of a bf16 f
            s = torch.add(x if x.dtype == cd else x.to(cd), f, alpha=scale)
        r = torch.linalg.vector_norm(s, dim=-1, keepdim=True, dtype=cd)
        r = r.square_().div_(s.shape[-1]).add_(eps).rsqrt_()
        n = s.mul_(r) if s is not x else s * r
        return (n * weight.to(cd)).to(x.dtype), n, r

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, f, weight, scale, _ = inputs
        _, n, r = output
        ctx.mark_non_differentiable(n, r)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(n, r, weight)
        ctx.save_for_forward(n, r, weight)
        ctx.scale, ctx.x_dtype, ctx.w_dtype = scale, x.dtype, weight.dtype
        ctx.f_dtype = None if f is None else f.dtype

    @staticmethod
    @once_differentiable  # no second derivatives (nothing in keel takes them): raise, not silently wrong
    def backward(ctx, dy, _dn, _dr):
        if dy is None:
            return None, None, None, None, None
        n, r, w = ctx.saved_tensors
        w = w.to(n.dtype)
        dy = dy.to(n.dtype)
        t = dy * n
        dw = t.reshape(-1, t.shape[-1]).sum(0).to(ctx.w_dtype) if ctx.needs_input_grad[2] else None
        with torch.autocast(n.device.type, enabled=False):  # a backward called under autocast
            dot = (t @ w).unsqueeze(-1).div_(n.shape[-1])  # mean_d(dy * g * n), in n's dtype
        ds = torch.mul(dy, w).addcmul_(n, dot, value=-1).mul_(r)
        dx = ds.to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
        df = None
        if ctx.needs_input_grad[1]:
            df = (ds if ctx.scale == 1.0 else ds * ctx.scale).to(ctx.f_dtype)
        return dx, df, dw, None, None

    @staticmethod
    def jvp(ctx, x_t, f_t, w_t, _scale_t, _eps_t):
        n, r, w = ctx.saved_tensors
        s_t = torch.zeros_like(n) if x_t is None else x_t.to(n.dtype)
        if f_t is not None:
            s_t = s_t + ctx.scale * f_t.to(n.dtype)
        n_t = (s_t - n * (n * s_t).mean(-1, keepdim=True)) * r
        y_t = n_t * w.to(n.dtype)
        if w_t is not None:
            y_t = y_t + n * w_t.to(n.dtype)
        return y_t.to(ctx.x_dtype), None, None  # n and r are non-differentiable outputs


def rms_norm_of_sum(x: torch.Tensor, f: torch.Tensor | None, weight: torch.Tensor, scale: float = 1.0,
                    eps: float = 1e-5) -> torch.Tensor:
    """Fused RMSNorm of a scaled sum: ``(x + scale * f) / sqrt(mean_d (x + scale * f)^2 + eps) * weight``.

    RMSNorm: Zhang & Sennrich 2019, Eq. 4. The sum is formed in one ``torch.add(x, f,
    alpha=scale)`` in the compute dtype, which is ``x``'s dtype promoted to at least fp32 (a
    bf16 ``f`` from an autocast matmul is upcast inside the add); the gradient is the
    hand-written backward of :class:`_ScaledSumRMSNorm`, equal to autograd's up to fp32
    rounding, and only the normalised sum and the reciprocal RMS are kept for it.

    Args:
        x: [..., d] (the residual stream).
        f: [..., d] or None (plain RMSNorm of x); any float dtype.
        weight: the gain [d].
        scale: the factor on f (1 / alpha for ``Norm(alpha * x + F)``, see the module doc).
        eps: added to the mean square.
    Under ``torch.compile`` (:func:`torch.compiler.is_compiling`) the same function is written
    as plain tensor ops (:func:`_rms_norm_of_sum_composite`): Dynamo cannot trace the custom
    ``jvp`` of :class:`_ScaledSumRMSNorm` (a graph break per norm), while the compiler fuses
    the composite form into one kernel and derives its backward itself. Eager calls, and
    the forward-mode AD of :mod:`keel.diagnostics.gradflow`, keep the hand-written derivatives.

    Returns:
        [..., d] in ``x``'s dtype.
    """
    if torch.compiler.is_compiling():
        return _rms_norm_of_sum_composite(x, f, weight, scale, eps)
    return _ScaledSumRMSNorm.apply(x, f, weight, scale, eps)[0]


def _rms_norm_of_sum_composite(x, f, weight, scale, eps):
    """:func:`rms_norm_of_sum` as plain differentiable ops (the traceable form used under compile)."""
    cd = torch.promote_types(x.dtype, torch.float32)
    s = x.to(cd) if f is None else torch.add(x.to(cd), f, alpha=scale)
    r = torch.rsqrt(s.square().mean(-1, keepdim=True) + eps)
    return (s * r * weight.to(cd)).to(x.dtype)


class RMSNorm(nn.Module):
    """RMSNorm (Zhang & Sennrich 2019): ``y = x / sqrt(mean(x^2) + eps) * g``.

    Gain ``g`` is learnable, init 1, no bias. Computed in (at least) fp32 and returned in
    the input's dtype, with the hand-written backward of :func:`rms_norm_of_sum`. ``eps``
    may be overridden per call (see the module docstring).

    Shapes: x [..., d] -> [..., d].
    """

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, eps: float | None = None) -> torch.Tensor:
        return rms_norm_of_sum(x, None, self.weight, 1.0, self.eps if eps is None else eps)


def scaled_sum_norm(norm: RMSNorm, x: torch.Tensor, f: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """``Norm(alpha * x + f)``, formed as ``Norm_{eps/alpha^2}(x + f / alpha)`` (exactly equal),
    in one fused op (:func:`rms_norm_of_sum` with ``scale = 1 / alpha``).

    Shapes: x, f [B, T, d] -> [B, T, d] in x's dtype; f may have another dtype (bf16 under
    autocast): the sum is formed in x's dtype promoted to at least fp32.
    """
    return rms_norm_of_sum(x, f, norm.weight, 1.0 / alpha, norm.eps / (alpha * alpha))


def rms_reciprocal(x: torch.Tensor, eps: float, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``1 / sqrt(mean_d x^2 + eps)`` of x [..., d] as [..., 1] in ``dtype`` (default x's), the
    mean square and rsqrt in fp32 at least (an fp16 square overflows above 256). RMSNorm's scale
    (Zhang & Sennrich 2019, Eq. 4) for maps that apply it after a product: ``Norm(x) W = r * (x (g W))``."""
    f32 = torch.promote_types(x.dtype, torch.float32)
    # square + mean, not vector_norm: its backward takes four stream-sized ops (div, eq, masked_fill, mul)
    return torch.rsqrt(x.to(f32).square().mean(-1, keepdim=True) + eps).to(dtype or x.dtype)
