"""Residual schemes: how each sub-layer F (attention or FFN) joins the residual stream.

Every scheme is one small ``nn.Module`` with the same interface::

    unit = SCHEMES[cfg.residual](cfg, index)   # index = sub-layer index, 0 .. L-1
    x = unit(x, F)                               # x: [B, T, d_model], F: callable on [B, T, d_model]

``index`` counts sub-layers as the paper does: block ``b`` holds attention sub-layer
``2b`` and FFN sub-layer ``2b + 1``; L = 2 * n_layers. A unit may also

* set ``final_norm = True`` when the model needs a final RMSNorm before the LM head (or
  override the classmethod ``uses_final_norm(cfg)`` when that depends on the config);
* set ``attention_qkv_norm = True`` to have RMSNorm on q, k and v inside attention;
* override ``init_sublayer(F_module)`` to re-initialise the weights of the F it wraps;
* carry a stream other than one [B, T, d] tensor (multi-stream schemes: Hyper-Connections,
  mHC, Attention Residuals), or normalise the embedding (Peri-LN): the classmethod
  ``make_stream(cfg)`` returns a module with ``begin(emb) -> stream`` (run once on the
  token embedding [B, T, d]) and ``end(stream) -> [B, T, d]`` (run once after the last
  block, before the final norm); every unit then maps that stream to the next one. A
  multi-stream stream is one tensor ``[m, B, T, d]`` with an extra *leading* axis (m = n
  streams for HC/mHC; earlier block representations for AttnRes, m may grow with depth).
  The default ``make_stream`` returns None: the stream is the embedding itself and the six
  single-stream schemes run exactly as before (same parameters, same code path).

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

from keel.config import ModelConfig, check_key
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
    ``attention_qkv_norm`` (RMSNorm on q, k, v inside attention),
    ``activation_constants`` ((c_d, c_1) of the activation-memory model in
    ``benchmarks/memory_model.py``; None = measure it), ``version`` (its implementation
    version, raised whenever what it computes changes: it enters a run's identity, so a study
    retrains the scheme's cached and restored runs) and ``weight_decay`` (``{parameter name:
    decayed}`` where the scheme's paper departs from the optimiser's rule, decay for ndim >= 2;
    :func:`keel.train.optim.build_optimizer`).
    """

    final_norm = False
    attention_qkv_norm = False
    activation_constants: tuple[int, int] | None = None
    version = 1  # the scheme's implementation version: a run's identity (a changed scheme is not a cached run)
    weight_decay: dict[str, bool] = {}  # parameter name -> decayed, where it departs from ndim >= 2

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

    @classmethod
    def make_stream(cls, cfg: ModelConfig) -> nn.Module | None:
        """The model-level stream module (``begin(emb)``, ``end(stream)``, see the module
        docstring), or None (default): the stream is the [B, T, d] embedding itself."""
        return None

    def reset_scheme_parameters(self) -> None:
        """Re-initialise the unit's own non-norm parameters (HC/mHC/AttnRes maps); default:
        none. Called at construction and by :meth:`keel.model.Transformer.reset_parameters`."""

    def removed(self, x: torch.Tensor) -> torch.Tensor:
        """The unit's output when its sub-layer is removed (``keel ablate``); default: the
        input stream unchanged, ``x_{i+1} = x_i`` (F, and the unit's norms, skipped)."""
        return x

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
        KeelError: ``model.mix_ln_ratio`` outside its declared range [0, 1].
    """
    check_key(cfg, "model", "mix_ln_ratio")  # its range is declared in keel.config.ModelConfig
    return min(cfg.n_layers, math.floor(cfg.mix_ln_ratio * cfg.n_layers + 1e-9))


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


# ---------------------------------------------------------------------------------------
# The residual bench of 2026: Peri-LN, Hyper-Connections, mHC, Attention Residuals.
# HC, mHC and AttnRes carry a stream with an extra leading axis, [m, B, T, d]; their small
# mixing maps run in the stream's dtype with autocast off (a bf16 einsum would turn the
# fp32 stream into bf16), F itself runs under autocast as in every other scheme.

def _no_autocast(x: torch.Tensor):
    """A context in which autocast is off for x's device (the maps run in x's dtype)."""
    return torch.autocast(x.device.type, enabled=False)


def rms_reciprocal(x: torch.Tensor, eps: float, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``1 / sqrt(mean_d x^2 + eps)`` of x [..., d] as [..., 1] in ``dtype`` (default x's), the
    mean square and rsqrt in fp32 at least (an fp16 square overflows above 256). RMSNorm's scale
    (Zhang & Sennrich 2019, Eq. 4) for maps that apply it after a product: ``Norm(x) W = r * (x (g W))``."""
    f32 = torch.promote_types(x.dtype, torch.float32)
    # square + mean, not vector_norm: its backward takes four stream-sized ops (div, eq, masked_fill, mul)
    return torch.rsqrt(x.to(f32).square().mean(-1, keepdim=True) + eps).to(dtype or x.dtype)


class EmbeddingNorm(nn.Module):
    """Peri-LN's stream module: ``begin(emb) = Norm(emb)`` (an RMSNorm of the embedding
    output, gain init 1), ``end(x) = x``. Shapes [B, T, d] -> [B, T, d]."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)

    def begin(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x)

    def end(self, x: torch.Tensor) -> torch.Tensor:
        return x


class PeriLN(Residual):
    """Peri-LN (Kim et al. 2025, "Peri-LN: Revisiting Normalization Layer in the Transformer
    Architecture", ICML 2025, arXiv 2502.02732, Sec. 3): a norm on both the input and the
    output of every module, the residual itself un-normalised::

        x <- x + Norm_out(F(Norm_in(x)))

    also called sandwich norm (Gemma 2/3, OLMo 2 use the output norm). Norms: RMSNorm
    ``norm_in`` and ``norm_out`` per sub-layer (gain init 1; the paper uses LayerNorm, keel
    RMSNorm everywhere); a final Norm before the LM head (the stream is a Pre-LN-like sum
    that grows with depth); and, when ``cfg.peri_ln_embed_norm`` (default True), an RMSNorm
    of the embedding output (the paper's "Peri-LN" applies LN to the embedding layer's
    output as well, Sec. 3; switchable here because models that call themselves sandwich
    norm, e.g. Gemma, do not). Every weight keeps the model's N(0, init_std^2) init.

    Removed (``keel ablate``): ``x``, the default.
    """

    final_norm = True

    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__(cfg, index)
        self.norm_in = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.norm_out = RMSNorm(cfg.d_model, cfg.norm_eps)

    @classmethod
    def make_stream(cls, cfg: ModelConfig) -> nn.Module | None:
        return EmbeddingNorm(cfg) if cfg.peri_ln_embed_norm else None

    def forward(self, x, f):
        return add_to_stream(x, self.norm_out(f(self.norm_in(x))))


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


class HyperConnections(Residual):
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

    @classmethod
    def make_stream(cls, cfg: ModelConfig) -> nn.Module | None:
        return ExpandedStream(cfg)

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


class ManifoldHyperConnections(Residual):
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

    @classmethod
    def make_stream(cls, cfg: ModelConfig) -> nn.Module | None:
        return ExpandedStream(cfg)

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


def depth_attention(v: torch.Tensor, query: torch.Tensor, key_norm: RMSNorm) -> torch.Tensor:
    """Attention over depth (Attention Residuals, Kimi Team 2026, arXiv 2603.15031, Eq. for
    h_l; official pseudo-code ``block_attn_res``): ``h = sum_i softmax_i(w . Norm(v_i)) v_i``.

    The keys ``Norm(v_i)`` are never formed: ``w . (v_i / rms(v_i) * g) = (v_i . (w * g)) /
    rms(v_i)`` with ``rms(v) = sqrt(mean_d v^2 + eps)`` (an identity), so only v is kept for
    the backward pass. No 1/sqrt(d) scale on the logits (the official pseudo-code has none).

    Args:
        v: the sources [m, B, T, d].
        query: the pseudo-query w [d].
        key_norm: the RMSNorm of the keys (gain g [d], its eps).
    Returns:
        [B, T, d] in v's dtype (the logits, the RMS and the softmax run in fp32 at least).
    """
    w = query.to(v.dtype) * key_norm.weight.to(v.dtype)
    # the mean square, rsqrt and softmax in fp32 at least: in fp16 the backward of rsqrt overflows
    f32 = torch.promote_types(v.dtype, torch.float32)
    r = rms_reciprocal(v, key_norm.eps, f32).squeeze(-1)  # [m, B, T]
    weights = torch.softmax((v @ w).to(f32) * r, dim=0).to(v.dtype)
    # a broadcast product summed over the sources, not an einsum: that is a batched product of
    # B T [1, m] x [m, d] matrices, which CPU runs one small matrix at a time
    return (weights.unsqueeze(-1) * v).sum(0)


class DepthAttentionReadout(nn.Module):
    """AttnRes stream module: ``begin(emb) = emb[None]`` (the embedding is the first source,
    b_0 = h_1 in the paper) [1, B, T, d]; ``end(S)`` = :func:`depth_attention` over every
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

    def begin(self, x: torch.Tensor) -> torch.Tensor:
        return x.unsqueeze(0)

    def end(self, s: torch.Tensor) -> torch.Tensor:
        if not self.attend:
            return s.sum(0)
        with _no_autocast(s):
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

    The stream is S [m, B, T, d]: the completed blocks and, last, the partial sum (begun as
    [embedding] by :class:`DepthAttentionReadout`, which also forms the model's output by a
    last depth attention). The official pseudo-code counts blocks in layers (attention +
    MLP); we count in sub-layers, so S may be odd (e.g. 1).

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

    @torch.no_grad()
    def reset_scheme_parameters(self) -> None:
        if self.index > 0:
            self.query.zero_()

    def removed(self, x):
        return AttnRes.forward(self, x, torch.zeros_like)

    def forward(self, x, f):
        if self.index == 0:
            h = x[0]
        else:
            with _no_autocast(x):
                h = depth_attention(x, self.query, self.key_norm)
        out = f(self.norm(h)).to(x.dtype)
        with _no_autocast(x):  # autocast's cat rejects a bf16 stream under fp16 autocast (and the reverse)
            if self.opens_block:  # the partial sum becomes a block; out starts the next one
                return torch.cat([x, out.unsqueeze(0)])
            return torch.cat([x[:-1], (x[-1] + out).unsqueeze(0)])


# The one list of residual schemes: config validation, the CLI defaults, gradflow, the
# benchmarks and the tests all read it. Adding a scheme = a class above + a line here.
SCHEMES: dict[str, type[Residual]] = {
    "pre_ln": PreLN,
    "post_ln": PostLN,
    "deepnorm": DeepNorm,
    "keel": Keel,
    "hybridnorm": HybridNorm,
    "mix_ln": MixLN,
    "peri_ln": PeriLN,
    "hyper_connections": HyperConnections,
    "mhc": ManifoldHyperConnections,
    "attn_res": AttnRes,
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
