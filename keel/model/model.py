"""A decoder-only language model in the Llama style, with a switchable residual scheme.

Token embedding -> (the scheme's stream start, if any) -> n_layers blocks -> (the scheme's
stream end, if any) -> (final RMSNorm if the scheme asks for one) -> LM head.
A looped model (``cfg.loop_core >= 1``) applies its blocks as prelude, core x R, coda: blocks
0 .. P-1 once, blocks P .. P+C-1 R times with the same weights, then the rest once
(:meth:`Transformer.depth_order`; R = ``cfg.loop_repeats``, or a count given at run time).
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

import copy
import dataclasses
import hashlib
import math
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from keel.config import ModelConfig
from keel.errors import KeelError
from keel.keys import RENAMED_PARAMS
from keel.model.norm import RMSNorm
from keel.model.residual import Residual, check_model_config, get_scheme


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


def _mm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b``, in the autocast dtype when autocast is on for a's device (as the autograd
    backward of an autocast matmul would run), else in ``b``'s dtype (``b`` is a model
    tensor; an fp32 ``a`` -- softmax gradients -- is cast to it, as autograd casts the
    gradient of ``logits.float()`` back to a bf16/fp16 model's dtype); with ``out``, added
    into it (``out += a @ b``)."""
    dtype = torch.get_autocast_dtype(a.device.type) if torch.is_autocast_enabled(a.device.type) else b.dtype
    if out is not None and out.dtype == dtype:
        return out.addmm_(a.to(dtype), b.to(dtype))
    prod = torch.mm(a.to(dtype), b.to(dtype))
    return prod if out is None else out.add_(prod)


class _LinearCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of ``h @ w^T`` against ``targets``, a chunk of rows at a time, with
    the gradients formed in the forward pass (the full [N, V] logits never exist at once).

    Per chunk of rows, with ``z = h_c w^T`` (fp32), ``p = softmax(z)`` and ``m`` the number
    of non-ignored targets: ``loss += sum(logsumexp(z) - z[target])``, ``dz = (p -
    onehot(target)) / m`` (0 on ignored rows), ``dh_c = dz w`` and ``dw += dz^T h_c``.
    Only ``dh`` [N, d] and ``dw`` [V, d] are kept for the backward, which scales them by
    the incoming gradient.
    """

    @staticmethod
    def forward(ctx, h, w, targets, chunk_rows):
        loss, dh, dw = _chunked_cross_entropy(h, w, targets, chunk_rows, with_grad=True)
        ctx.save_for_backward(dh, dw)
        return loss

    @staticmethod
    def backward(ctx, g):
        dh, dw = ctx.saved_tensors
        return ((dh * g).to(dh.dtype) if ctx.needs_input_grad[0] else None,
                (dw * g).to(dw.dtype) if ctx.needs_input_grad[1] else None, None, None)


def _chunked_cross_entropy(h, w, targets, chunk_rows, with_grad):
    """Loss (fp32 scalar) and, with ``with_grad``, (dh, dw) of :class:`_LinearCrossEntropy`."""
    valid = targets != -100
    n_valid = valid.sum()
    scale = valid.to(torch.float32) / n_valid.clamp_min(1)  # d loss / d (row's nll)
    safe = targets.masked_fill(~valid, 0).unsqueeze(1)  # another target out of [0, V) fails in gather, as in torch
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    dh = torch.empty_like(h) if with_grad else None
    dw = torch.zeros_like(w) if with_grad else None
    for i in range(0, h.shape[0], chunk_rows):
        rows = slice(i, i + chunk_rows)
        z = _mm(h[rows], w.t()).float()  # logits of the chunk [c, V], fp32
        lse = torch.logsumexp(z, dim=-1, keepdim=True)
        nll = (lse - z.gather(1, safe[rows])).squeeze(1)
        total = total + (nll * valid[rows]).sum()
        if with_grad:
            dz = z.sub_(lse).exp_()  # softmax, in place
            dz.scatter_add_(1, safe[rows], torch.full_like(lse, -1.0))
            dz.mul_(scale[rows].unsqueeze(1))
            dh[rows] = _mm(dz, w)
            _mm(dz.t(), h[rows], out=dw)
    return total / n_valid, dh, dw


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         chunk_rows: int = 256) -> torch.Tensor:
    """``F.cross_entropy(F.linear(h, weight).float(), targets, ignore_index=-100)`` in chunks.

    The LM head and the cross-entropy fused: the full fp32 [N, V] logits are never formed
    (``chunk_rows`` rows at a time); when autograd records, the gradients of ``h`` and
    ``weight`` are computed in the same pass (see :class:`_LinearCrossEntropy`). Under
    autocast the matmuls run in the autocast dtype and the softmax in fp32, as in the
    unfused form. Equal to the unfused form up to fp32 rounding (summation order).

    Args:
        h: [N, d] hidden states (the final norm's output).
        weight: [V, d] LM head weight.
        targets: LongTensor [N]; -100 = ignored; any other value outside [0, V) raises RuntimeError (an index out
            of bounds in gather; F.cross_entropy raises too).
        chunk_rows: rows per chunk (memory ~ chunk_rows x V fp32 per chunk).
    Returns:
        the mean next-token cross-entropy over non-ignored rows, fp32 scalar tensor (nats);
        NaN if every target is ignored (as ``F.cross_entropy``).
    """
    if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
        return _LinearCrossEntropy.apply(h, weight, targets, chunk_rows)
    return _chunked_cross_entropy(h, weight, targets, chunk_rows, with_grad=False)[0]


class KVCache:
    """Keys and values of past positions, per block, for incremental decoding.

    ``update(k, v, layer_idx)`` appends k, v [B, K, T_new, hd] for block ``layer_idx`` and
    returns the full [B, K, T_past + T_new, hd] tensors; ``get_seq_length()`` gives T_past
    (tokens). The same two methods as ``transformers.DynamicCache``, so either can be passed.
    """

    def __init__(self):
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def update(self, k: torch.Tensor, v: torch.Tensor, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        if layer_idx == len(self.keys):
            self.keys.append(k)
            self.values.append(v)
        else:
            self.keys[layer_idx] = torch.cat([self.keys[layer_idx], k], dim=2)
            self.values[layer_idx] = torch.cat([self.values[layer_idx], v], dim=2)
        return self.keys[layer_idx], self.values[layer_idx]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.keys[layer_idx].shape[2] if layer_idx < len(self.keys) else 0


class CacheSlot:
    """A KV cache (:class:`KVCache` or ``transformers.DynamicCache``) seen through one slot: every
    ``update(k, v, layer_idx)`` is filed under ``slot`` instead of the block's own index. A looped
    model's core block applied for the r-th time has its own keys and values at each position, so it
    stores them under its place in the effective order, ``P + r C + c`` (:meth:`Transformer.depth_order`),
    not under its block index, which every application shares."""

    def __init__(self, cache, slot: int):
        self.cache, self.slot = cache, slot

    def update(self, k: torch.Tensor, v: torch.Tensor, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cache.update(k, v, self.slot)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.cache.get_seq_length(self.slot)


class Attention(nn.Module):
    """Causal grouped-query self-attention (Ainslie et al. 2023) with RoPE.

    x [B, T, d] -> [B, T, d]. K = n_kv_heads key/value heads are shared by H / K query
    heads each; the kernel is ``F.scaled_dot_product_attention``. With ``qkv_norm`` (a
    scheme may ask for it), q, k and v are RMS-normalised right after their projections,
    per head (over head_dim, before RoPE), each with its own gain of size head_dim shared
    by the heads: ``softmax(Norm(Q_i) Norm(K_i)^T / sqrt(hd)) Norm(V_i)`` for head i, as
    HybridNorm defines QKV-Norm (Zhuo et al. 2025, arXiv 2503.04598; see
    :class:`keel.model.residual.single_stream.HybridNorm` for the sources).
    """

    def __init__(self, cfg: ModelConfig, layer_idx: int = 0, qkv_norm: bool = False):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=False)
        self.q_norm = self.k_norm = self.v_norm = None
        if qkv_norm:  # per head, over head_dim (HybridNorm, arXiv 2503.04598)
            self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
            self.v_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: KVCache | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, T, d]; cos, sin [T, hd/2] or, per row, [B, 1, T, hd/2]; ``mask``: optional bool
        [B, 1, T, S] (True = may attend; S = past + T keys, see :func:`padding_attention_mask`),
        replacing the causal mask. Returns [B, T, d]."""
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None:  # before RoPE, each head's vector on its own
            q, k, v = self.q_norm(q), self.k_norm(k), self.v_norm(v)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        causal = mask is None
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
            S = k.shape[2]
            if S != T and mask is None:  # queries are the last T of S positions
                causal = False
                mask = torch.ones(T, S, dtype=torch.bool, device=x.device).tril(diagonal=S - T)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                           enable_gqa=self.n_kv_heads != self.n_heads)
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


def _current_unit_names(module: nn.Module, state_dict: dict, prefix: str, *_) -> None:
    """``load_state_dict`` pre-hook of a :class:`Block`: keys saved under a unit's old name
    (:data:`keel.keys.RENAMED_PARAMS`, e.g. ``blocks.0.attn_res.norm.weight``) are renamed in place
    to the current one (``blocks.0.attn_residual.norm.weight``), so older weights keep loading."""
    for name in [k for k in state_dict if k.startswith(prefix)]:
        head, dot, rest = name[len(prefix):].partition(".")
        if head in RENAMED_PARAMS:
            state_dict[prefix + RENAMED_PARAMS[head] + dot + rest] = state_dict.pop(name)


class Block(nn.Module):
    """One block = attention sub-layer (index 2b) + FFN sub-layer (index 2b + 1); each sub-layer's
    residual-scheme unit is ``attn_residual`` / ``ffn_residual`` (``attn_res`` / ``ffn_res`` in weights
    saved before the rename, which still load)."""

    def __init__(self, cfg: ModelConfig, block_index: int):
        super().__init__()
        scheme = get_scheme(cfg.residual)
        self.attn = Attention(cfg, block_index, qkv_norm=scheme.attention_qkv_norm)
        self.attn_residual = scheme(cfg, 2 * block_index)
        self.ffn = FeedForward(cfg)
        self.ffn_residual = scheme(cfg, 2 * block_index + 1)
        self.register_load_state_dict_pre_hook(_current_unit_names)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: KVCache | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = self.attn_residual(x, lambda h: self.attn(h, cos, sin, cache, mask))
        return self.ffn_residual(x, self.ffn)


def padding_attention_mask(attention_mask: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions and the attention mask of a padded batch (left padding, as batched generation uses).

    Args:
        attention_mask: 0/1 [B, S] over the past ``start`` tokens and the T = S - start new ones
            (1 = a real token, 0 = padding).
        start: tokens already in the KV cache.
    Returns:
        ``(positions, allowed)``: the RoPE position of each new token, LongTensor [B, T], which
        counts the real tokens before it (``cumsum(mask) - 1``, so a row's first real token is at
        position 0 whatever its padding, and its logits equal the unpadded row's); and bool
        [B, 1, T, S], True where new token i may attend key j: ``j <= start + i`` (causal) and
        key j is real -- or j is the token itself, so a padding query (whose output nothing
        reads) never has an empty softmax.
    """
    m = attention_mask.to(torch.bool)
    S = m.shape[1]
    positions = (m.long().cumsum(-1) - 1).clamp_min(0)[:, start:]
    q = torch.arange(start, S, device=m.device).unsqueeze(1)  # [T, 1] absolute query index
    j = torch.arange(S, device=m.device).unsqueeze(0)  # [1, S]
    allowed = (j <= q) & (m[:, None, :] | (j == q))  # [B, T, S]
    return positions, allowed.unsqueeze(1)



def check_left_padded(attention_mask: torch.Tensor | None) -> None:
    """Raise KeelError, in one line, if a row of the 0/1 ``attention_mask`` [B, S] of a batch to generate from has
    padding (0) after a real token (1): a right-padded batch, whose rows would be continued from their padding
    (each row's next token is drawn from the last column). A left-padded mask (0s, then 1s) or None passes."""
    if attention_mask is None or attention_mask.dim() != 2:
        return
    real = attention_mask.bool()
    pad_after_real = (real.long().cumsum(-1) > 0) & ~real
    rows = pad_after_real.any(-1).nonzero().flatten().tolist()
    if rows:
        raise KeelError(f"the batch is right-padded (row {rows[0]} of attention_mask has padding after its tokens), so "
                        "generation would continue from the padding; pad the prompts on the left: "
                        "tokenizer(..., padding_side='left') or AutoTokenizer.from_pretrained(..., padding_side='left')")


def check_generate_args(input_ids: torch.Tensor, max_new_tokens: int, temperature: float, top_k: int | None,
                        vocab_size: int) -> None:
    """Raise KeelError, in one line, for :meth:`Transformer.generate` arguments it would misread: a negative
    temperature (it sampled greedily without a word), top_k or token count, an empty prompt, or a token id
    outside the vocabulary (an IndexError, on a GPU a device-side assert), a token count that is not an int, a NaN
    temperature (torch.multinomial failed on the NaN probabilities), or an empty batch."""
    for name, n in (("max_new_tokens", max_new_tokens), ("top_k", top_k)):
        if n is not None and (isinstance(n, bool) or not isinstance(n, int)):
            raise KeelError(f"generate: {name} must be an integer, got {n!r}")
    if not temperature >= 0 or (top_k is not None and top_k < 0) or max_new_tokens < 0:  # `not >=`: NaN too
        raise KeelError(f"generate: temperature, top_k and max_new_tokens must be >= 0, got {temperature}, {top_k}, "
                        f"{max_new_tokens}")
    if input_ids.ndim != 2 or 0 in input_ids.shape:
        raise KeelError(f"generate: input_ids must be [batch, prompt tokens] with at least one row and one token, "
                        f"got shape {tuple(input_ids.shape)}")
    lo, hi = int(input_ids.min()), int(input_ids.max())
    if lo < 0 or hi >= vocab_size:
        raise KeelError(f"generate: token ids must be in [0, {vocab_size}) (model.vocab_size), got {lo}..{hi}")


def check_forward_args(input_ids: torch.Tensor, targets: torch.Tensor | None, attention_mask: torch.Tensor | None,
                       start: int) -> None:
    """Raise KeelError, in one line, for :meth:`Transformer.forward` inputs of the wrong shape or dtype: ``input_ids``
    not an int64 / int32 [B, T] with B, T >= 1 (a 1-D or 3-D tensor failed deep in attention, an empty one in a reshape),
    ``targets`` of another shape, ``attention_mask`` not [B, start + T] (a mask of ones of any shape was taken
    as no mask). Shapes and dtypes only: the ids' values are not read (a device sync per step); an id outside
    the vocabulary fails in the embedding, as in torch, and :meth:`Transformer.generate` checks its prompt's."""
    if input_ids.dim() != 2 or 0 in input_ids.shape or input_ids.dtype not in (torch.int64, torch.int32):
        raise KeelError(f"input_ids must be an int64 or int32 tensor [batch, tokens] (nn.Embedding's index types) with "
                        f"at least one row and one token, got {input_ids.dtype} of shape {tuple(input_ids.shape)}")
    if targets is not None and targets.shape != input_ids.shape:
        raise KeelError(f"targets must have the shape of input_ids {tuple(input_ids.shape)}, got {tuple(targets.shape)}")
    want = (input_ids.shape[0], start + input_ids.shape[1])
    if attention_mask is not None and tuple(attention_mask.shape) != want:
        raise KeelError(f"attention_mask must be [batch, cached + new tokens] = {want}, got {tuple(attention_mask.shape)}")


class Transformer(nn.Module):
    """The LM. ``Transformer(cfg)(input_ids)`` -> logits; with ``targets`` -> the loss
    (:meth:`forward` gives the arguments). ``cfg``: a :class:`keel.config.ModelConfig` (a
    :class:`keel.config.Config`'s ``.model``). Raises KeelError: another object, or an invalid config
    (:meth:`ModelConfig.validate`)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = check_model_config(cfg)  # first: a whole Config failed on a missing attribute
        if cfg.vocab_size == "auto":  # resolved from the tokenizer when a run starts
            raise KeelError('model.vocab_size is "auto": give a number, or resolve it from a tokenizer with '
                            "keel.config.resolve_vocab_size")
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList([Block(cfg, b) for b in range(cfg.n_layers)])
        # a multi-stream scheme's begin/end of the stream (None: the stream is the embedding)
        self.stream = get_scheme(cfg.residual).make_stream(cfg)
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps) if get_scheme(cfg.residual).uses_final_norm(cfg) else None
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        cos, sin = rope_tables(cfg.max_seq_len, cfg.head_dim, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.loops = cfg.loop_repeats  # the core's applications per forward pass (set_loops)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """N(0, init_std^2) for every weight matrix and the embedding (the embedding:
        N(0, embed_init_std^2) when that is set and the embedding is not tied), gains 1; then each
        residual unit may re-initialise the sub-layer it wraps (DeepNorm) and resets its own
        maps (HC/mHC/AttnRes, :meth:`Residual.reset_scheme_parameters`)."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=self.cfg.init_std)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
        if self.cfg.embed_init_std is not None and not self.cfg.tie_embeddings:
            nn.init.normal_(self.tok_emb.weight, mean=0.0, std=self.cfg.embed_init_std)
        for _, unit, sublayer in self.sublayers():
            unit.reset_scheme_parameters()
            unit.init_sublayer(sublayer)
        if hasattr(self.stream, "reset_scheme_parameters"):
            self.stream.reset_scheme_parameters()

    def sublayers(self) -> Iterator[tuple[int, Residual, nn.Module]]:
        """``(index, residual unit, F)`` for every sub-layer, in the paper's order: block b's
        attention is sub-layer 2b, its FFN 2b + 1 (index 0 .. 2 n_layers - 1). A looped model's core
        sub-layers appear once: one unit and one F serve every application."""
        for b, block in enumerate(self.blocks):
            yield 2 * b, block.attn_residual, block.attn
            yield 2 * b + 1, block.ffn_residual, block.ffn

    def set_loops(self, loops: int | None) -> None:
        """Apply a looped model's core ``loops`` times per forward pass from now on (test-time depth;
        the weights, and every constant fixed at construction such as Keel's alpha, stay those of
        ``cfg.loop_repeats``). ``None``: back to the trained count, ``cfg.loop_repeats`` (any model).
        Raises KeelError: an int count for a model that does not loop, or a count that is not an int >= 1."""
        self.loops = self.cfg.loop_repeats if loops is None else self._checked_loops(loops)

    def _checked_loops(self, loops: int) -> int:
        return checked_loop_count(self.cfg, loops)

    def loop_shape(self) -> dict | None:
        """A looped model's loop in blocks of weights, at its current count: ``{"prelude": P, "core": C,
        "coda": Q, "repeats": loops, "trained_repeats": cfg.loop_repeats}`` (the ``loop`` of the JSON
        reports of ``keel eval``, ``ablate`` and ``gradflow``); None for a model that does not loop."""
        mc = self.cfg
        if not mc.loop_core:
            return None
        return {"prelude": mc.loop_prelude, "core": mc.loop_core, "coda": mc.n_layers - mc.loop_prelude - mc.loop_core,
                "repeats": self.loops, "trained_repeats": mc.loop_repeats}

    def depth_order(self, loops: int | None = None) -> list[int]:
        """The block indices one forward pass applies, in order: the prelude ``0 .. P-1``, the core
        ``P .. P+C-1`` repeated ``loops`` times (default :attr:`loops`), the coda ``P+C .. n_layers-1``.
        Position i in this list is the block's place in the effective (unrolled) model and its
        KV-cache slot; without a loop it is ``[0 .. n_layers-1]``."""
        P, C = self.cfg.loop_prelude, self.cfg.loop_core
        repeats = self.loops if loops is None else self._checked_loops(loops)
        return [*range(P), *list(range(P, P + C)) * repeats, *range(P + C, self.cfg.n_layers)]

    def unrolled(self, loops: int | None = None, share_weights: bool = True) -> "Transformer":
        """This model as an unlooped one that applies the same blocks: block i of the result is a copy of
        block ``depth_order(loops)[i]`` (its residual units keep their constants, e.g. Keel's alpha of
        ``cfg.loop_repeats``), so its logits equal this model's at ``loops``, and each application of a
        core sub-layer is a module of its own (what per-application diagnostics hook or bypass: ``keel
        gradflow``, ``keel ablate``). Its config is this one with ``n_layers = P + loops C + Q`` and no loop.

        ``share_weights``: the copies are new modules over this model's parameters (no new memory;
        a core weight's gradient is still the sum over its applications); else every copy has
        parameters of its own, whose gradients are each application's part of that sum. A model without
        a loop gives a copy of itself. Raises KeelError: a bad ``loops`` (:meth:`set_loops`), or blocks
        whose forward was replaced (compiled or checkpointed: copies would run the original's forward)."""
        if any("forward" in vars(block) for block in self.blocks):
            raise KeelError("unroll the plain model: its blocks' forward was replaced (torch.compile or "
                            "activation checkpointing, keel.train.parallelize)")
        order = self.depth_order(loops)
        memo = {id(t): t for t in (*self.parameters(), *self.buffers())} if share_weights else {}
        flat = copy.deepcopy(self, dict(memo))
        flat.blocks = nn.ModuleList(copy.deepcopy(self.blocks[b], dict(memo)) for b in order)
        for i, block in enumerate(flat.blocks):
            block.attn.layer_idx = i  # its own KV-cache slot
        flat.cfg = dataclasses.replace(self.cfg, n_layers=len(order), **_NO_LOOP)
        flat.loops = flat.cfg.loop_repeats
        return flat

    def _check_cache_loops(self, cache, start: int, order: list[int]) -> None:
        """Raise KeelError (one line) when the non-empty ``cache`` (``start`` positions) was filled at
        another loop count than ``order`` applies: its slots are not exactly ``len(order)`` (the coda
        would read a core application's keys, and an application beyond the filled ones none)."""
        n = len(order)
        if cache.get_seq_length(n - 1) == start and cache.get_seq_length(n) == 0:
            return
        slots = n  # the filled slots, counted from n up or down
        while cache.get_seq_length(slots):
            slots += 1
        while slots and not cache.get_seq_length(slots - 1):
            slots -= 1
        C = self.cfg.loop_core
        filled = (slots - (self.cfg.n_layers - C)) / C
        raise KeelError(f"this KV cache was filled at {filled:g} loops ({slots} applied blocks), not at "
                        f"{(n - (self.cfg.n_layers - C)) // C} loops: a cache serves only the loop count it was "
                        "filled at (start a new cache, or keep the count)")

    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor | None = None,
                cache: KVCache | None = None, attention_mask: torch.Tensor | None = None,
                loops: int | None = None) -> torch.Tensor:
        """Logits of ``input_ids``, or with ``targets`` the loss.

        Args:
            input_ids: integer tensor [B, T] (B, T >= 1), start + T <= cfg.max_seq_len (start: the cache's length).
            targets: optional LongTensor [B, T]; entries equal to -100 are ignored (another value outside
                [0, V) raises RuntimeError, as ``F.cross_entropy``).
            cache: optional :class:`KVCache` (or ``transformers.DynamicCache``) holding the
                keys/values of earlier positions; it is extended in place, and ``input_ids``
                are taken to follow them (RoPE positions start at its length).
            attention_mask: optional 0/1 [B, start + T] (1 = real token): with zeros (padding,
                e.g. left padding of a batch of prompts), RoPE positions count each row's real
                tokens and padded keys are masked out (:func:`padding_attention_mask`), so a
                row's real tokens get the logits they would get alone. All ones = no mask.
            loops: a looped model's core applications in this pass, an int >= 1 (default :attr:`loops`,
                ``cfg.loop_repeats`` until :meth:`set_loops`); a cache filled at one count serves only it.
        Returns:
            logits FloatTensor [B, T, V] (fp32) when targets is None, else the mean
            next-token cross-entropy (scalar fp32 tensor, nats per token; NaN when every target is -100),
            computed by :func:`linear_cross_entropy` (LM head and loss in chunks of rows: the [B, T, V]
            logits are never materialised).
        Raises:
            KeelError: inputs of the wrong shape or dtype (:func:`check_forward_args`), start + T too long,
                or a bad ``loops``. An id outside [0, V) fails in the embedding (IndexError), as in torch.
        """
        start = cache.get_seq_length() if cache is not None else 0
        check_forward_args(input_ids, targets, attention_mask, start)
        T = start + input_ids.shape[1]
        if T > self.cfg.max_seq_len:
            raise KeelError(f"sequence of {T} tokens is longer than model.max_seq_len = {self.cfg.max_seq_len}")
        cos, sin, mask = self.rope_cos[start:T], self.rope_sin[start:T], None
        if attention_mask is not None and not bool(attention_mask.all()):  # padding: per-row positions
            positions, mask = padding_attention_mask(attention_mask, start)
            cos, sin = self.rope_cos[positions].unsqueeze(1), self.rope_sin[positions].unsqueeze(1)
        x = self.tok_emb(input_ids)
        if self.stream is not None:  # e.g. n copies of the embedding [n, B, T, d]
            x = self.stream.begin(x)
        order = self.depth_order(loops)
        if start and self.cfg.loop_core:  # one slot per applied block: a cache serves only the count it was filled at
            self._check_cache_loops(cache, start, order)
        for slot, b in enumerate(order):
            block, kv = self.blocks[b], cache if cache is None or slot == b else CacheSlot(cache, slot)
            x = block(x, cos, sin, kv) if mask is None else block(x, cos, sin, kv, mask)
        if self.stream is not None:  # back to [B, T, d]
            x = self.stream.end(x)
        if self.norm is not None:
            x = self.norm(x)
        if targets is None:
            return self.lm_head(x).float()
        return linear_cross_entropy(x.reshape(-1, x.shape[-1]), self.lm_head.weight, targets.reshape(-1))

    def num_params(self, non_embedding: bool = False) -> int:
        """Number of parameters (tied weights counted once); optionally without the embedding."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.tok_emb.weight.numel() if non_embedding else n

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, generator: torch.Generator | None = None,
                 use_cache: bool = True, attention_mask: torch.Tensor | None = None,
                 loops: int | None = None, on_token=None) -> torch.Tensor:
        """Sample ``max_new_tokens`` tokens after ``input_ids`` [B, T0]; returns [B, T0 + n].
        ``on_token``, if given, is called with each step's new tokens [B, 1] as they are drawn
        (``keel generate`` prints the text as it comes).

        Prompts of different lengths go in one batch left-padded, with ``attention_mask`` 0/1
        [B, T0] marking the padding (0): each row then generates what it would alone.

        temperature 0 (or below the smallest normal float of the logits' dtype) means greedy;
        any small positive temperature is safe (a tiny one samples the argmax). With
        ``use_cache`` the keys/values of earlier positions are kept (:class:`KVCache`); without
        it, or once the context outgrows max_seq_len, the context is re-run every step,
        cropped to its last max_seq_len tokens. ``loops``: a looped model's core applications per
        token (default :attr:`loops`); the cache keeps one slot per applied block (:class:`CacheSlot`).

        Raises:
            KeelError: a negative ``temperature``, ``top_k`` or ``max_new_tokens``; ``input_ids`` not [B, T0]
                with T0 >= 1, or holding an id outside [0, vocab_size); a right-padded ``attention_mask``
                (:func:`check_left_padded`).
        """
        check_generate_args(input_ids, max_new_tokens, temperature, top_k, self.cfg.vocab_size)
        check_left_padded(attention_mask)
        ids = input_ids
        cache = KVCache() if use_cache else None
        step_input = ids
        mask = attention_mask if attention_mask is not None else torch.ones_like(ids)
        for _ in range(max_new_tokens):
            if cache is not None and cache.get_seq_length() + step_input.shape[1] > self.cfg.max_seq_len:
                cache = None  # the context outgrew max_seq_len: re-run a cropped window from now on
            if cache is None:
                window = -self.cfg.max_seq_len
                logits = self(ids[:, window:], attention_mask=mask[:, window:], loops=loops)[:, -1, :]
            else:
                logits = self(step_input, cache=cache, attention_mask=mask, loops=loops)[:, -1, :]
            if temperature < torch.finfo(logits.dtype).tiny:  # 0, or too small to divide by: greedy
                nxt = logits.argmax(dim=-1, keepdim=True)
            else:  # shifted so that the largest is 0: x / T never overflows to inf - inf = nan
                logits = (logits - logits.max(dim=-1, keepdim=True).values) / temperature
                if top_k is not None and top_k > 0:
                    kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                nxt = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
            ids = torch.cat([ids, nxt], dim=1)
            mask = torch.cat([mask, torch.ones_like(nxt)], dim=1)
            step_input = nxt
            if on_token is not None:
                on_token(nxt)
        return ids


def checked_loop_count(cfg: ModelConfig, loops: int) -> int:
    """``loops``, a count of the core's applications for a model of ``cfg``: an int >= 1 (not a bool) of a
    looped model (``cfg.loop_core >= 1``). Returns it.

    Raises:
        KeelError: one line, a model that does not loop or a count that is not an int >= 1.
    """
    if not cfg.loop_core:
        raise KeelError("a loop count needs a looped model (model.loop_core >= 1)")
    if isinstance(loops, bool) or not isinstance(loops, int) or loops < 1:
        raise KeelError(f"the loop count must be an integer >= 1, got {loops!r}")
    return loops


def loop_count(cfg: ModelConfig, seed: int, step: int) -> int | None:
    """The core's applications in training step ``step`` of a run seeded ``seed`` (a looped model,
    ``cfg.loop_sampling``), of mean R = ``cfg.loop_repeats``:

    * ``fixed``: None, nothing drawn (the model applies its R every step);
    * ``uniform``: uniform on the integers 1 .. 2R - 1;
    * ``poisson_lognormal`` (Geiping et al. 2025, arXiv 2502.05171, Sec. 3.3, the log-normal Poisson
      draw of the recurrence): ``tau ~ N(log(R - 1) - sigma^2 / 2, sigma^2)``, ``r = 1 + Poisson(e^tau)``
      with sigma = 1/2; ``E[e^tau] = R - 1``, so ``E[r] = R`` (their mean r_bar + 1 with r_bar = R - 1),
      with a long right tail (at R = 8, r > 3R in about 0.7% of the steps, r > 5R in about 1 in 3000).

    A pure function of (seed, step): a resumed run draws what the uninterrupted one drew, and every
    process of a distributed run draws the same count. Returns an int >= 1 (1 when R = 1), or None.
    """
    R = cfg.loop_repeats
    if cfg.loop_sampling == "fixed":
        return None
    if R == 1:
        return 1
    digest = hashlib.sha256(f"keel.loop_count:{seed}:{step}".encode()).digest()
    g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") % 2**63)
    if cfg.loop_sampling == "uniform":
        return 1 + int(torch.randint(0, 2 * R - 1, (), generator=g))
    sigma = 0.5
    tau = torch.normal(math.log(R - 1) - sigma**2 / 2, sigma, (1,), generator=g, dtype=torch.float64)
    return 1 + int(torch.poisson(tau.exp(), generator=g))


LARGEST_LOOP_DRAWS = 100_000  # poisson_lognormal steps largest_loop_count draws (~10 us each: about 1 s)


def largest_loop_count(cfg: ModelConfig, seed: int, steps: int) -> int:
    """The most core applications a training step of a run of ``steps`` steps seeded ``seed`` runs
    (:func:`loop_count`), what a memory check must size the run at: R = ``cfg.loop_repeats`` with
    ``fixed`` (and 1 for a model that does not loop), 2R - 1 with ``uniform`` (the largest it draws).
    ``poisson_lognormal`` has no largest (a Poisson count of a log-normal mean: a run of a few thousand
    steps reaches about 5R, 318 at R = 64, and a longer run more), so it is the largest count the
    run itself draws, known before it starts (a pure function of (seed, step)), over its first
    :data:`LARGEST_LOOP_DRAWS` steps (about 1 s; a longer run's later steps may draw more)."""
    if cfg.loop_sampling == "fixed" or cfg.loop_repeats == 1:
        return cfg.loop_repeats
    if cfg.loop_sampling == "uniform":
        return 2 * cfg.loop_repeats - 1
    return max(loop_count(cfg, seed, step) for step in range(min(steps, LARGEST_LOOP_DRAWS)))


# the loop keys at their defaults: a model of the same blocks, unlooped
_NO_LOOP = {name: getattr(ModelConfig(), name) for name in ("loop_prelude", "loop_core", "loop_repeats", "loop_sampling")}


# (repr(config), non_embedding) -> parameters: a study's plan prices hundreds of runs of a few shapes,
# and building even a 2-block model on the meta device takes ~25 ms (its initialisation included)
_PARAMETER_COUNTS: dict[tuple[str, bool], int] = {}


def count_parameters(model_cfg: ModelConfig, non_embedding: bool = False) -> int:
    """Parameters of ``Transformer(model_cfg)`` (tied weights once), as
    :meth:`Transformer.num_params` counts them, without allocating: the model is built on
    the ``meta`` device. ``non_embedding`` leaves out the token embedding (the LM head
    still counts). The one parameter count of keel (``keel overview``, sweeps, studies). A looped
    model's shared core counts once: its ``n_layers`` blocks of weights.

    Raises:
        KeelError: an invalid shape or loop (:func:`keel.model.check_model_config`), which no model has.
    """
    check_model_config(model_cfg)

    def count(n_layers: int) -> int:
        cfg = dataclasses.replace(model_cfg, n_layers=n_layers, **_NO_LOOP)
        memo = (repr(cfg), non_embedding)  # every field is in a config's repr
        if memo not in _PARAMETER_COUNTS:
            with torch.device("meta"):
                _PARAMETER_COUNTS[memo] = Transformer(cfg).num_params(non_embedding=non_embedding)
        return _PARAMETER_COUNTS[memo]

    # Blocks after the first are identical in size (block 0 may differ, e.g. Keel's first-layer
    # rule), so two small models give the exact count at any depth without building 512 blocks.
    if model_cfg.n_layers <= 2:
        return count(model_cfg.n_layers)
    one, two = count(1), count(2)
    return one + (model_cfg.n_layers - 1) * (two - one)


def flops_per_token(model_cfg: ModelConfig, seq_len: int, loops: int | None = None) -> float:
    """Training FLOPs per token (forward + backward) of ``Transformer(model_cfg)`` on sequences of
    ``seq_len`` tokens, PaLM (Chowdhery et al. 2022, App. B): ``6 N + 12 n_layers d_model seq_len``,
    N = non-embedding parameters (:func:`count_parameters`; the LM head counts). A
    ``vocab_size = "auto"`` (known only once the tokenizer exists) is priced at 256 ids. The
    numerator of MFU (the trainer's per-step ``mfu``, ``benchmarks/mfu.py``, a study's dry run). A looped
    model is priced as its unrolled equivalent of ``cfg.effective_layers`` blocks (the core's weights
    work R = ``loop_repeats`` times per token; R is also the mean of a sampled count, :func:`loop_count`);
    ``loops`` (an int >= 1, a looped model only) prices P + loops x C + Q blocks instead: one training
    step's drawn count, what that step's ``mfu`` divides by. None = R.

    Raises:
        KeelError: an invalid shape or loop (:func:`count_parameters`), or a ``loops`` no model runs
            (:func:`checked_loop_count`).
    """
    if model_cfg.vocab_size == "auto":
        model_cfg = dataclasses.replace(model_cfg, vocab_size=256)
    check_model_config(model_cfg)  # the config's own R, before a count replaces it
    if loops is not None:
        model_cfg = dataclasses.replace(model_cfg, loop_repeats=checked_loop_count(model_cfg, loops))
    unrolled = dataclasses.replace(model_cfg, n_layers=model_cfg.effective_layers, **_NO_LOOP)
    return 6.0 * count_parameters(unrolled, non_embedding=True) + 12.0 * unrolled.n_layers * model_cfg.d_model * seq_len
