"""The single-stream schemes: the stream is one [B, T, d] tensor (Pre-LN, Post-LN, DeepNorm,
Keel, HybridNorm, Mix-LN, Peri-LN). The interface is :class:`keel.model.residual.base.Residual`."""

from __future__ import annotations

import math

import torch
from torch import nn

from keel.config import ModelConfig
from keel.errors import KeelError
from keel.keys import check_key
from keel.model.norm import RMSNorm, scaled_sum_norm
from keel.model.residual.base import Residual, add_to_stream


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
    L is ``cfg.n_sublayers``, the effective depth: a looped model's ``2 (P + R C + Q)`` sub-layers
    (the unrolled network the derivation bounds), not its ``2 n_layers`` blocks of weights.

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
    ``alpha = cfg.alpha``, unset: L = ``cfg.n_sublayers`` (constant, not learned). L is the
    effective depth, the sub-layers one forward pass applies: a looped model's ``2 (P + R C + Q)``
    with R = ``cfg.loop_repeats`` (the paper's alpha = L is the product bound over the unrolled path,
    Sec. 3; a count set at test time, ``Transformer.set_loops``, keeps the trained alpha).

    First-layer rule (paper v2), when ``cfg.keel_first_layer_rule``: sub-layer 0 (first
    attention) is plain Pre-LN, ``x + F(Norm_in(x))`` with no outer norm and alpha = 1;
    sub-layer 1 (first FFN) uses alpha = 1 and keeps its outer norm. A looped model keeps the
    rule on the very first sub-layers by placing block 0 in the prelude: with ``loop_prelude = 0``
    block 0 would be repeated, so the rule would hold at every application (refused, :meth:`check_config`).
    """

    activation_constants = (9, 4)  # two RMSNorms per sub-layer
    config_keys = ("alpha", "keel_first_layer_rule")

    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__(cfg, index)
        first_rule = cfg.keel_first_layer_rule and index < 2
        self.alpha = 1.0 if first_rule else float(cfg.alpha if cfg.alpha is not None else cfg.n_sublayers)
        self.norm_in = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.norm_out = None if (first_rule and index == 0) else RMSNorm(cfg.d_model, cfg.norm_eps)

    @classmethod
    def check_config(cls, cfg: ModelConfig) -> None:
        """Refuse a loop whose core holds block 0 while the first-layer rule is on (KeelError)."""
        if cfg.loop_core and not cfg.loop_prelude and cfg.keel_first_layer_rule:
            raise KeelError("model.loop_prelude = 0 puts Keel's first sub-layers (model.keel_first_layer_rule) in the "
                            "repeated core: set model.loop_prelude >= 1 or model.keel_first_layer_rule = false")

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
      QKV-Norm still on: a subclass with ``first_block_pre_norm = True`` (not registered; the
      tests build it). The registered ``"hybridnorm"`` is the plain scheme that the Keel paper's
      Table 1 names.

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
    A looped model splits its ``n_layers`` blocks of weights (so a shared core block is the same
    kind at every application), not its effective depth.

    Final norm: the reference model (HF ``LlamaModel``) always applies its final RMSNorm.
    We keep it whenever a Pre-LN block exists, since a Pre-LN stream is un-normalised and
    grows with depth; with rho = 1 (all Post-LN) the last block's output is already
    normalised and we drop it, so that ``mix_ln`` with rho = 1 is exactly ``post_ln`` and
    with rho = 0 exactly ``pre_ln`` (same parameter names, same functions).
    """

    activation_constants = (7, 2)  # its Pre-LN blocks; Post-LN blocks need less
    config_keys = ("mix_ln_ratio",)

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

    @classmethod
    def config_notes(cls, cfg: ModelConfig) -> list[str]:
        """A ratio above 0 that rounds down to no Post-LN block at this depth: the model is exactly
        pre_ln (e.g. the default 0.25 with fewer than 4 blocks)."""
        if cfg.mix_ln_ratio == 0 or mix_ln_post_blocks(cfg):
            return []
        return [f"warning: model.mix_ln_ratio={cfg.mix_ln_ratio:g} of {cfg.n_layers} blocks gives 0 Post-LN blocks: "
                "this mix_ln model is exactly pre_ln"]

    def forward(self, x, f):
        if self.post:
            return scaled_sum_norm(self.norm, x, f(x))
        return add_to_stream(x, f(self.norm(x)))


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
    config_keys = ("peri_ln_embed_norm",)

    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__(cfg, index)
        self.norm_in = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.norm_out = RMSNorm(cfg.d_model, cfg.norm_eps)

    @classmethod
    def make_stream(cls, cfg: ModelConfig) -> nn.Module | None:
        return EmbeddingNorm(cfg) if cfg.peri_ln_embed_norm else None

    def forward(self, x, f):
        return add_to_stream(x, self.norm_out(f(self.norm_in(x))))
