"""A decoder-only language model in the Llama style, with a switchable residual scheme.

Token embedding -> n_layers blocks -> (final RMSNorm if the scheme asks for one) -> LM head.
Each block is two sub-layers: grouped-query attention with RoPE, then a SwiGLU FFN; the
residual scheme (``cfg.residual``, see :mod:`keel.model.residual`) decides how each
sub-layer joins the residual stream. No biases, no dropout. Every weight starts as
N(0, init_std^2) (the Keel paper's init); a scheme may re-initialise its sub-layers
(DeepNorm does).

Shapes: B = batch, T = sequence length (tokens), d = d_model, H = n_heads,
K = n_kv_heads, hd = d / H, V = vocab_size. The residual stream has the parameters'
dtype (fp32, also under bf16 autocast, where only the matmuls run in bf16).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from keel.config import ModelConfig
from keel.errors import KeelError
from keel.model.residual import SCHEMES, RMSNorm


def rope_tables(seq_len: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables for RoPE (Su et al. 2021, Eq. 34), each fp32 [seq_len, head_dim/2].

    Frequencies ``theta^(-2i/hd)`` for i = 0 .. hd/2 - 1; angle = position * frequency.
    """
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (i, i + hd/2) of x [B, H, T, hd] by the angles in cos/sin [T, hd/2].

    This is the "rotate half" layout used by Llama/HF. Returns x's dtype.
    """
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.to(x.dtype)


class Attention(nn.Module):
    """Causal grouped-query self-attention (Ainslie et al. 2023) with RoPE.

    x [B, T, d] -> [B, T, d]. K = n_kv_heads key/value heads are shared by H / K query
    heads each; the kernel is ``F.scaled_dot_product_attention(is_causal=True)``.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv_heads != self.n_heads)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    """SwiGLU FFN (Shazeer 2020): ``w2(silu(w1 x) * w3 x)``. x [B, T, d] -> [B, T, d]."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.w3 = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.w2 = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """One block = attention sub-layer (index 2b) + FFN sub-layer (index 2b + 1)."""

    def __init__(self, cfg: ModelConfig, block_index: int):
        super().__init__()
        scheme = SCHEMES[cfg.residual]
        self.attn = Attention(cfg)
        self.attn_res = scheme(cfg, 2 * block_index)
        self.ffn = FeedForward(cfg)
        self.ffn_res = scheme(cfg, 2 * block_index + 1)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = self.attn_res(x, lambda h: self.attn(h, cos, sin))
        return self.ffn_res(x, self.ffn)


class Transformer(nn.Module):
    """The LM. ``Transformer(cfg)(input_ids)`` -> logits; with ``targets`` -> the loss.

    Args of forward:
        input_ids: LongTensor [B, T], T <= cfg.max_seq_len.
        targets: optional LongTensor [B, T]; entries equal to -100 are ignored.
    Returns:
        logits FloatTensor [B, T, V] (fp32) when targets is None, else the mean
        next-token cross-entropy (scalar fp32 tensor, nats per token).
    Raises:
        KeelError: invalid config (see :meth:`ModelConfig.validate`) or T too long.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg.validate()
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList([Block(cfg, b) for b in range(cfg.n_layers)])
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps) if SCHEMES[cfg.residual].final_norm else None
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        cos, sin = rope_tables(cfg.max_seq_len, cfg.head_dim, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """N(0, init_std^2) for every weight matrix and the embedding, gains 1; then each
        residual unit may re-initialise the sub-layer it wraps (DeepNorm)."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=self.cfg.init_std)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
        for block in self.blocks:
            block.attn_res.init_sublayer(block.attn)
            block.ffn_res.init_sublayer(block.ffn)

    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        T = input_ids.shape[1]
        if T > self.cfg.max_seq_len:
            raise KeelError(f"sequence of {T} tokens is longer than model.max_seq_len = {self.cfg.max_seq_len}")
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        x = self.tok_emb(input_ids)
        for block in self.blocks:
            x = block(x, cos, sin)
        if self.norm is not None:
            x = self.norm(x)
        logits = self.lm_head(x).float()
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-100)

    def num_params(self, non_embedding: bool = False) -> int:
        """Number of parameters (tied weights counted once); optionally without the embedding."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.tok_emb.weight.numel() if non_embedding else n

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
        """Sample ``max_new_tokens`` tokens after ``input_ids`` [B, T0]; returns [B, T0 + n].

        temperature 0 means greedy. The context is cropped to the last max_seq_len tokens.
        """
        ids = input_ids
        for _ in range(max_new_tokens):
            logits = self(ids[:, -self.cfg.max_seq_len:])[:, -1, :]
            if temperature <= 0:
                nxt = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None and top_k > 0:
                    kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                nxt = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
            ids = torch.cat([ids, nxt], dim=1)
        return ids
