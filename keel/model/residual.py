"""Residual schemes: how each sub-layer F (attention or FFN) joins the residual stream.

Every scheme is one small ``nn.Module`` with the same interface::

    unit = SCHEMES[cfg.residual](cfg, index)   # index = sub-layer index, 0 .. L-1
    x = unit(x, F)                               # x: [B, T, d_model], F: callable on [B, T, d_model]

``index`` counts sub-layers as the paper does: block ``b`` holds attention sub-layer
``2b`` and FFN sub-layer ``2b + 1``; L = 2 * n_layers. A unit may also

* set ``final_norm = True`` when the model needs a final RMSNorm before the LM head (or
  override the classmethod ``uses_final_norm(cfg)`` when that depends on the config);
* set ``attention_qkv_norm = True`` to have RMSNorm on q, k and v inside attention;
* override ``init_sublayer(F_module)`` to re-initialise the weights of the F it wraps.

Norm is RMSNorm (gain init 1, no bias, eps = ``cfg.norm_eps``).

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

import math
from collections.abc import Callable

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from keel.config import ModelConfig
from keel.errors import KeelError

SubLayer = Callable[[torch.Tensor], torch.Tensor]


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


def add_to_stream(x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """``x + h`` in the stream's dtype: [B, T, d] each -> [B, T, d] in x's dtype.

    A bf16 ``h`` (autocast matmul output) added to an fp32 ``x`` is promoted inside the add
    (no separate fp32 copy of h); other dtype pairs cast h to x's dtype first.
    """
    if torch.promote_types(x.dtype, h.dtype) == x.dtype:
        return x + h
    return x + h.to(x.dtype)


class Residual(nn.Module):
    """Base class: the interface all schemes share. ``forward(x, F) -> x_next``.

    Class attributes a scheme may set: ``final_norm`` (a final RMSNorm before the LM head),
    ``attention_qkv_norm`` (RMSNorm on q, k, v inside attention) and
    ``activation_constants`` ((c_d, c_1) of the activation-memory model in
    ``benchmarks/memory_model.py``; None = measure it).
    """

    final_norm = False
    attention_qkv_norm = False
    activation_constants: tuple[int, int] | None = None

    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        self.index = index

    @classmethod
    def uses_final_norm(cls, cfg: ModelConfig) -> bool:
        """Whether a model of this scheme and config ends with a final RMSNorm before the LM
        head. Default: the class attribute ``final_norm``; a scheme whose answer depends on
        the config (Mix-LN) overrides this."""
        return cls.final_norm

    @classmethod
    def check_config(cls, cfg: ModelConfig) -> None:
        """Raise :class:`KeelError` naming the key if ``cfg`` is invalid for this scheme
        (called by :func:`check_model_config`); default: nothing scheme-specific."""

    def init_sublayer(self, sublayer: nn.Module) -> None:
        """Re-initialise the wrapped sub-layer's weights; default: keep N(0, init_std)."""

    def forward(self, x: torch.Tensor, f: SubLayer) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError


class PreLN(Residual):
    """Pre-LN: ``x <- x + F(Norm(x))``; the model ends with a final Norm (Xiong et al. 2020)."""

    activation_constants = (7, 2)

    final_norm = True

    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__(cfg, index)
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)

    def forward(self, x, f):
        return add_to_stream(x, f(self.norm(x)))


class PostLN(Residual):
    """Post-LN (Vaswani et al. 2017): ``x <- Norm(x + F(x))``."""

    activation_constants = (6, 2)  # the norm's output is the next matmul's input

    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__(cfg, index)
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)

    def forward(self, x, f):
        return scaled_sum_norm(self.norm, x, f(x))


class DeepNorm(Residual):
    """DeepNorm (Wang et al. 2022, "DeepNet", arXiv 2203.00555, Eq. 2 and Fig. 2):
    ``x <- Norm(alpha * x + F(x))``.

    Constants for a decoder-only model with M blocks (DeepNet Fig. 2 / Table 1):
    ``alpha = (2M)^(1/4) = L^(1/4)`` and ``beta = (8M)^(-1/4) = (4L)^(-1/4)``, L = 2M
    sub-layers. (The Keel paper's summary writes beta = L^(-1/4); we follow DeepNet.)

    Init (DeepNet Fig. 2): Xavier-normal with gain ``beta`` for the FFN weights and the
    attention value and output projections; q and k Xavier-normal with gain 1.
    """

    activation_constants = (6, 2)

    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__(cfg, index)
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.alpha = cfg.n_sublayers ** 0.25
        self.beta = (4 * cfg.n_sublayers) ** -0.25

    def init_sublayer(self, sublayer: nn.Module) -> None:
        for name, module in sublayer.named_children():
            if isinstance(module, nn.Linear):
                gain = 1.0 if name in ("wq", "wk") else self.beta
                nn.init.xavier_normal_(module.weight, gain=gain)

    def forward(self, x, f):
        return scaled_sum_norm(self.norm, x, f(x), self.alpha)


class Keel(Residual):
    """Keel (Chen & Wei 2026, arXiv 2601.19895, Sec. 3, Fig. 2):
    ``x <- Norm_out(alpha * x + F(Norm_in(x)))``, two RMSNorms per sub-layer,
    ``alpha = cfg.keel_alpha`` (default L, the number of sub-layers; constant, not learned).

    First-layer rule (paper v2), when ``cfg.keel_first_layer_rule``: sub-layer 0 (first
    attention) is plain Pre-LN, ``x + F(Norm_in(x))`` with no outer norm and alpha = 1;
    sub-layer 1 (first FFN) uses alpha = 1 and keeps its outer norm.
    """

    activation_constants = (9, 4)  # two RMSNorms per sub-layer

    @classmethod
    def check_config(cls, cfg: ModelConfig) -> None:
        if cfg.alpha is not None and not (math.isfinite(cfg.alpha) and cfg.alpha > 0):
            raise KeelError(f"model.alpha must be a finite number > 0 (omit it for the default L), got {cfg.alpha}")

    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__(cfg, index)
        first_rule = cfg.keel_first_layer_rule and index < 2
        self.alpha = 1.0 if first_rule else cfg.keel_alpha
        self.norm_in = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.norm_out = None if (first_rule and index == 0) else RMSNorm(cfg.d_model, cfg.norm_eps)

    def forward(self, x, f):
        h = f(self.norm_in(x))
        if self.norm_out is None:
            return add_to_stream(x, h)
        return scaled_sum_norm(self.norm_out, x, h, self.alpha)


class HybridNorm(Residual):
    """HybridNorm (Zhuo et al. 2025, "HybridNorm: Towards Stable and Efficient Transformer
    Training via Hybrid Normalization", arXiv 2503.04598): "QKV normalization within the
    attention mechanism and Post-Norm in the feed-forward network (FFN) of each transformer
    block" (abstract). For block ``l`` with input ``X``::

        Y       = X + MHA_QKV(X)                    # attention sub-layer (index 2l): no norm here
        X_next  = Norm(Y) + FFN(Norm(Y))            # FFN sub-layer (index 2l + 1)

    where ``MHA_QKV`` RMS-normalises q, k and v right after their projections (done inside
    :class:`keel.model.model.Attention`, switched on by ``attention_qkv_norm = True``).

    Sources, detail by detail:

    * The two equations: the official configs in github.com/BryceZhuo/HybridNorm
      (``dense_model/configs/exps/1.2B-dense-HybriedNorm.yaml``,
      ``MoE_model/configs/exps/MoE-1B-7B-HybridNorm.yaml``; OLMo code base):
      ``attn_norm: false`` -- no norm before attention, so the attention residual is
      ``x + Attn_QKVnorm(x)``, not ``x + Attn(Norm(x))``; ``attn_residual_after_norm:
      false``; ``ffn_norm: true`` with ``ffn_residual_after_norm: true`` -- the FFN's
      residual starts from the *normalised* tensor, ``Norm(Y) + FFN(Norm(Y))``;
      ``use_query_norm / use_key_norm / use_value_norm: true``; ``layer_norm_type: rms``.
      The paper's block equations (method section) have the same form.
    * QKV-Norm per head (over head_dim; one gain of size head_dim per projection, shared by
      the heads): the paper applies Norm inside each head's attention,
      ``head_i = attn_QKV(X W_i^Q, X W_i^K, X W_i^V)`` with
      ``attn_QKV(Q, K, V) = softmax(Norm(Q) Norm(K)^T / sqrt(d_k)) Norm(V)``, and an
      extraction of the official ``MoE_model/olmo/model.py`` builds q/k/v norms of size
      head_dim. (OLMo-2's own QK-norm is over the full projection width; HybridNorm's is not.)
    * Final norm before the LM head: yes. The reference model is OLMo, whose ``ln_f`` is
      applied after the last block in every configuration, and HybridNorm's last block ends
      with the un-normalised sum ``Norm(Y) + FFN(Norm(Y))``.
    * HybridNorm* (the variant with a special first block; official README:
      ``norm_pos_special_config="_{0:{'attn_norm':True,'ffn_residual':False}}_"``): block 0
      is Pre-Norm in both sub-layers (``X + MHA_QKV(Norm(X))`` then ``Y + FFN(Norm(Y))``),
      QKV-Norm still on. That is :class:`HybridNormStar` (``first_block_pre_norm = True``);
      the registered ``"hybridnorm"`` is the plain scheme that the Keel paper's Table 1 names.

    Every weight keeps the model's N(0, init_std^2) init (the HybridNorm runs use Megatron
    init; the Keel paper compares all schemes under one init).
    """

    final_norm = True
    attention_qkv_norm = True
    activation_constants = None
    first_block_pre_norm = False

    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__(cfg, index)
        self.is_attention = index % 2 == 0
        self.pre_norm = self.first_block_pre_norm and index < 2
        needs_norm = self.pre_norm or not self.is_attention
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps) if needs_norm else None

    def forward(self, x, f):
        if self.pre_norm:  # HybridNorm*, block 0: Pre-Norm
            return add_to_stream(x, f(self.norm(x)))
        if self.is_attention:  # x + MHA_QKV(x)
            return add_to_stream(x, f(x))
        h = self.norm(x)  # Norm(Y) + FFN(Norm(Y))
        return add_to_stream(h, f(h))


class HybridNormStar(HybridNorm):
    """HybridNorm* (Zhuo et al. 2025, arXiv 2503.04598; official README's
    ``norm_pos_special_config``): :class:`HybridNorm`, except that block 0 (sub-layers 0 and
    1) is Pre-Norm: ``x + F(Norm(x))`` for both its attention (QKV-Norm still on) and its FFN.

    Not registered in :data:`SCHEMES`, so ``model.residual`` does not accept it.
    """

    first_block_pre_norm = True


def mix_ln_post_blocks(cfg: ModelConfig) -> int:
    """Number of Post-LN blocks of Mix-LN: ``floor(mix_ln_ratio * n_layers)`` (Li et al. 2024,
    arXiv 2412.13795, method section). A tolerance of 1e-9 absorbs binary rounding of the product
    (0.29 * 100 is 28.999999999999996 in floating point; it counts as 29).

    Raises:
        KeelError: ``model.mix_ln_ratio`` not a finite number in [0, 1].
    """
    ratio = cfg.mix_ln_ratio
    if not (math.isfinite(ratio) and 0.0 <= ratio <= 1.0):
        raise KeelError(f"model.mix_ln_ratio must be a number in [0, 1], got {ratio}")
    return min(cfg.n_layers, math.floor(ratio * cfg.n_layers + 1e-9))


class MixLN(Residual):
    """Mix-LN (Li et al. 2024, "Mix-LN: Unleashing the Power of Deeper Layers by Combining
    Pre-LN and Post-LN", arXiv 2412.13795, method section): Post-LN in the first
    ``floor(rho * n_layers)`` blocks, Pre-LN in the rest, ``rho = cfg.mix_ln_ratio``
    (paper default 0.25). Sub-layer ``index`` belongs to block ``index // 2``::

        Post-LN block:  x <- Norm(x + F(x))       (both sub-layers)
        Pre-LN block:   x <- x + F(Norm(x))

    The split is by block, as in the reference code (``LlamaDecoderLayer`` with
    ``NORM_TYPE=post_pre``: ``layer_index < POST_NUM`` is Post-LN for attention and MLP).

    Final norm: the reference model (HF ``LlamaModel``) always applies its final RMSNorm.
    We keep it whenever a Pre-LN block exists, since a Pre-LN stream is un-normalised and
    grows with depth; with rho = 1 (all Post-LN) the last block's output is already
    normalised and we drop it, so that ``mix_ln`` with rho = 1 is exactly ``post_ln`` and
    with rho = 0 exactly ``pre_ln`` (same parameter names, same functions).
    """

    activation_constants = (7, 2)  # its Pre-LN blocks; Post-LN blocks need less

    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__(cfg, index)
        self.post = (index // 2) < mix_ln_post_blocks(cfg)
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)

    @classmethod
    def uses_final_norm(cls, cfg: ModelConfig) -> bool:
        return mix_ln_post_blocks(cfg) < cfg.n_layers

    @classmethod
    def check_config(cls, cfg: ModelConfig) -> None:
        mix_ln_post_blocks(cfg)  # raises on a ratio outside [0, 1]

    def forward(self, x, f):
        if self.post:
            return scaled_sum_norm(self.norm, x, f(x))
        return add_to_stream(x, f(self.norm(x)))


# The one list of residual schemes: config validation, the CLI defaults, gradflow, the
# benchmarks and the tests all read it. Adding a scheme = a class above + a line here.
SCHEMES: dict[str, type[Residual]] = {
    "pre_ln": PreLN,
    "post_ln": PostLN,
    "deepnorm": DeepNorm,
    "keel": Keel,
    "hybridnorm": HybridNorm,
    "mix_ln": MixLN,
}


def get_scheme(name: str) -> type[Residual]:
    """The :class:`Residual` class registered as ``name`` in :data:`SCHEMES`.

    Raises:
        KeelError: ``name`` is not a registered scheme (the message lists them).
    """
    if name not in SCHEMES:
        raise KeelError(f"unknown model.residual {name!r} (choose from {', '.join(SCHEMES)})")
    return SCHEMES[name]


def check_model_config(cfg: ModelConfig) -> ModelConfig:
    """Validate ``cfg``: its shape (:meth:`ModelConfig.validate`), the scheme name and the
    scheme's own checks (:meth:`Residual.check_config`). Returns ``cfg``.

    Raises:
        KeelError: naming the first bad key.
    """
    cfg.validate()
    get_scheme(cfg.residual).check_config(cfg)
    return cfg
