"""Residual schemes: how each sub-layer F (attention or FFN) joins the residual stream.

Every scheme is one small ``nn.Module`` with the same interface::

    unit = SCHEMES[cfg.residual](cfg, index)   # index = sub-layer index, 0 .. L-1
    x = unit(x, F)                               # x: [B, T, d_model], F: callable on [B, T, d_model]

``index`` counts sub-layers as the paper does: block ``b`` holds attention sub-layer
``2b`` and FFN sub-layer ``2b + 1``; L = 2 * n_layers. A unit may also

* set ``final_norm = True`` when the model needs a final RMSNorm before the LM head;
* set ``attention_qkv_norm = True`` to have RMSNorm on q, k and v inside attention;
* override ``init_sublayer(F_module)`` to re-initialise the weights of the F it wraps.

Norm is RMSNorm (gain init 1, no bias, eps = ``cfg.norm_eps``).

Numerics of ``Norm(a * x + F)``: RMSNorm is scale-invariant up to its eps, and exactly
``Norm_eps(a * v) == Norm_{eps / a^2}(v)``. The units that scale the stream by ``a > 1``
(DeepNorm, Keel) therefore compute ``Norm_{eps / a^2}(x + F / a)``: the same function,
but the sum never grows to ``a * |x|``, F is upcast to the stream's dtype (fp32 under
autocast) before it is added, and the stream stays O(1). In bf16, ``a * x + F`` with
``a >= 256`` would round F away entirely (8 significant bits).
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as Fn

from keel.config import ModelConfig

SubLayer = Callable[[torch.Tensor], torch.Tensor]


class RMSNorm(nn.Module):
    """RMSNorm (Zhang & Sennrich 2019): ``y = x / sqrt(mean(x^2) + eps) * g``.

    Gain ``g`` is learnable, init 1, no bias. Computed in (at least) fp32 and returned in
    the input's dtype. ``eps`` may be overridden per call (see the module docstring).

    Shapes: x [..., d] -> [..., d].
    """

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, eps: float | None = None) -> torch.Tensor:
        eps = self.eps if eps is None else eps
        dtype = torch.promote_types(x.dtype, torch.float32)  # at least fp32
        return Fn.rms_norm(x.to(dtype), (x.shape[-1],), self.weight.to(dtype), eps).to(x.dtype)


def scaled_sum_norm(norm: RMSNorm, x: torch.Tensor, f: torch.Tensor, alpha: float) -> torch.Tensor:
    """``Norm(alpha * x + f)``, formed as ``Norm_{eps/alpha^2}(x + f / alpha)`` (exactly equal).

    Shapes: x, f [B, T, d] -> [B, T, d] in x's dtype; f is cast to x's dtype first.
    """
    if alpha == 1.0:
        return norm(x + f.to(x.dtype))
    return norm(x + f.to(x.dtype) / alpha, eps=norm.eps / (alpha * alpha))


class Residual(nn.Module):
    """Base class: the interface all schemes share. ``forward(x, F) -> x_next``."""

    final_norm = False
    attention_qkv_norm = False

    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        self.index = index

    def init_sublayer(self, sublayer: nn.Module) -> None:
        """Re-initialise the wrapped sub-layer's weights; default: keep N(0, init_std)."""

    def forward(self, x: torch.Tensor, f: SubLayer) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError


class PreLN(Residual):
    """Pre-LN: ``x <- x + F(Norm(x))``; the model ends with a final Norm (Xiong et al. 2020)."""

    final_norm = True

    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__(cfg, index)
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)

    def forward(self, x, f):
        return x + f(self.norm(x)).to(x.dtype)


class PostLN(Residual):
    """Post-LN (Vaswani et al. 2017): ``x <- Norm(x + F(x))``."""

    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__(cfg, index)
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)

    def forward(self, x, f):
        return self.norm(x + f(x).to(x.dtype))


class DeepNorm(Residual):
    """DeepNorm (Wang et al. 2022, "DeepNet", arXiv 2203.00555, Eq. 2 and Fig. 2):
    ``x <- Norm(alpha * x + F(x))``.

    Constants for a decoder-only model with M blocks (DeepNet Fig. 2 / Table 1):
    ``alpha = (2M)^(1/4) = L^(1/4)`` and ``beta = (8M)^(-1/4) = (4L)^(-1/4)``, L = 2M
    sub-layers. (The Keel paper's summary writes beta = L^(-1/4); we follow DeepNet.)

    Init (DeepNet Fig. 2): Xavier-normal with gain ``beta`` for the FFN weights and the
    attention value and output projections; q and k Xavier-normal with gain 1.
    """

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

    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__(cfg, index)
        first_rule = cfg.keel_first_layer_rule and index < 2
        self.alpha = 1.0 if first_rule else cfg.keel_alpha
        self.norm_in = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.norm_out = None if (first_rule and index == 0) else RMSNorm(cfg.d_model, cfg.norm_eps)

    def forward(self, x, f):
        h = f(self.norm_in(x))
        if self.norm_out is None:
            return x + h.to(x.dtype)
        return scaled_sum_norm(self.norm_out, x, h, self.alpha)


SCHEMES: dict[str, type[Residual]] = {
    "pre_ln": PreLN,
    "post_ln": PostLN,
    "deepnorm": DeepNorm,
    "keel": Keel,
}
