"""Memory model of fp32 AdamW training on one process: what the benchmarks and the tests
compare measured peaks against (bytes). Not used by training itself.
"""

from __future__ import annotations

import torch

from keel.model.residual import SCHEMES
from keel.train.parallelize import checkpointed_blocks


def activation_bytes_per_block(batch: int, seq_len: int, d_model: int, d_ff: int, n_heads: int,
                               n_kv_heads: int, residual: str = "keel", bytes_per_el: int = 4) -> int:
    """Bytes autograd keeps alive for one block's backward (fp32, no checkpointing, CPU SDPA),
    not counting the block's input, which belongs to the previous block.

    With E = B·T tokens, hd = d/H, kv = K·hd (the width of k and v)::

        floats = E · (c_d·d + 4·f + 2·kv + H + c_1) + T·hd

    * ``4·f``: SwiGLU keeps w1·x, w3·x, silu(w1·x) and their product ([E, f] each);
    * ``2·kv``: the k and v of grouped-query attention before the GQA broadcast;
    * ``H``: SDPA's logsumexp, one float per head and token;
    * ``T·hd``: the RoPE cos/sin slices ([T, hd/2] each), shared by the batch;
    * ``c_d·d + c_1``: every other [E, d] tensor (normed inputs, q, q after RoPE, SDPA
      output and its reshaped copy, the normalised value each RMSNorm keeps for its
      hand-written backward, :func:`keel.model.norm.rms_norm_of_sum`) and every
      per-token 1/rms of an RMSNorm. Pre-LN and Mix-LN (its Pre-LN blocks; its Post-LN blocks
      need less): ``c_d = 7, c_1 = 2``; Post-LN and DeepNorm, whose norm output is the next
      sub-layer's matmul input (one tensor, saved once): ``c_d = 6, c_1 = 2``; Keel, whose
      sub-layers carry two RMSNorms each (Norm_in and Norm_out): ``c_d = 9, c_1 = 4``.

    The coefficients were read off ``torch.autograd.graph.saved_tensors_hooks`` (unique
    storages) by an exact least-squares fit over 72 shapes (residual 0); the test suite
    re-measures at other shapes (:func:`measure_activation_bytes_per_block`). Each scheme
    declares its coefficients (``Residual.activation_constants``); schemes without them (e.g. ``hybridnorm``) are measured directly on a 1-block model.
    Per-block accounting follows Korthikanti et al. 2022, "Reducing Activation Recomputation
    in Large Transformer Models", Sec. 4.1 (their 34·s·b·h counts bf16 bytes with dropout).

    Returns bytes (int).
    """
    constants = SCHEMES[residual].activation_constants
    if constants is None:
        from keel.config import ModelConfig

        cfg = ModelConfig(vocab_size=8, d_model=d_model, n_layers=3, n_heads=n_heads, n_kv_heads=n_kv_heads,
                          d_ff=d_ff, max_seq_len=seq_len, residual=residual)
        return measure_activation_bytes_per_block(cfg, batch, seq_len) * bytes_per_el // 4
    hd = d_model // n_heads
    kv = n_kv_heads * hd
    c_d, c_1 = constants
    floats = batch * seq_len * (c_d * d_model + 4 * d_ff + 2 * kv + n_heads + c_1) + seq_len * hd
    return floats * bytes_per_el


def measure_activation_bytes_per_block(cfg, batch: int, seq_len: int, block_index: int = -1) -> int:
    """Measured bytes autograd saves for one block's backward: the sum of the unique
    storages packed by ``torch.autograd.graph.saved_tensors_hooks`` during the forward of
    block ``block_index`` of a fresh fp32 ``Transformer(cfg)`` on a random input
    x [batch, seq_len, d] (for a multi-stream scheme, the stream that block receives: the
    earlier blocks run first, without grad) (parameters and x itself are not counted). Needs
    ``cfg.n_layers >= 3`` for the default last block to be a generic (not first) one."""
    from keel.model import Transformer

    model = Transformer(cfg)
    block = model.blocks[block_index]
    x = torch.randn(batch, seq_len, cfg.d_model, requires_grad=True)
    if model.stream is not None:  # a multi-stream scheme: the block's real input stream
        with torch.no_grad():
            x = model.stream.begin(x.detach())
            for b in model.blocks[:block_index % len(model.blocks)]:
                x = b(x, model.rope_cos[:seq_len], model.rope_sin[:seq_len])
        # AttnRes' stream is a tuple of sources [B, T, d]; HC/mHC's one tensor [n, B, T, d]
        x = tuple(t.contiguous().requires_grad_() for t in x) if isinstance(x, tuple) else x.contiguous().requires_grad_()
    inputs = x if isinstance(x, tuple) else (x,)
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()} | {t.untyped_storage().data_ptr() for t in inputs}
    sizes: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            sizes[st.data_ptr()] = max(sizes.get(st.data_ptr(), 0), st.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x, model.rope_cos[:seq_len], model.rope_sin[:seq_len])
    return sum(sizes.values())


def memory_estimate(n_params: int, n_blocks: int, batch: int, seq_len: int, d_model: int, d_ff: int,
                    n_heads: int, n_kv_heads: int, vocab_size: int, residual: str = "keel",
                    activation_checkpointing: str = "none", checkpoint_k: int = 2,
                    fused_adamw: bool = False) -> dict[str, int]:
    """Bytes of fp32 AdamW training steps on one process (no sharding).

    * parameters 4·P, gradients 4·P, AdamW state (exp_avg, exp_avg_sq) 8·P: 16·P bytes;
    * stored activations: for a checkpointed block only its input, 4·B·T·d bytes, kept from
      forward to backward; for any other block :func:`activation_bytes_per_block`; plus,
      while one checkpointed block is recomputed in the backward pass, one block's full
      activations (at most one at a time);
    * the head: logits and their softmax for cross-entropy, fp32 [B·T, V] twice (8·B·T·V),
      plus the final hidden state (4·B·T·d).

    Peak: the terms do not all coexist. Right after the forward pass of a step (after the
    first), parameters, AdamW state, activations and the head are live, gradients are not
    (``zero_grad(set_to_none=True)``): ``forward_peak = 12·P + activations + head``. In the
    backward pass gradients grow as activations are freed. In the optimizer step, the
    foreach AdamW (CPU) adds a temporary ``sqrt(exp_avg_sq)`` list of 4·P bytes
    (``torch/optim/adamw.py``, ``_multi_tensor_adamw``): ``optimizer_peak = 20·P`` (16·P with
    ``fused=True``, as on CUDA). ``peak = max(forward_peak, optimizer_peak)``; ``total`` is
    the plain sum of all terms, an upper bound.

    Sources: Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
    Transformer Models", Sec. 4) for the per-block accounting; Chen et al. 2016 ("Training
    Deep Nets with Sublinear Memory Cost") for checkpointing. Returns a dict of byte counts:
    ``params``, ``grads``, ``optimizer``, ``activations``, ``head``, ``total``,
    ``forward_peak``, ``optimizer_peak``, ``peak`` (``fused_adamw=True``: no 4·P temporary).
    """
    per_block = activation_bytes_per_block(batch, seq_len, d_model, d_ff, n_heads, n_kv_heads, residual)
    ckpt = set(checkpointed_blocks(n_blocks, activation_checkpointing, checkpoint_k))
    block_input = 4 * batch * seq_len * d_model
    acts = sum(block_input if b in ckpt else per_block for b in range(n_blocks))
    if ckpt:
        acts += per_block  # one block recomputed at a time
    head = 8 * batch * seq_len * vocab_size + 4 * batch * seq_len * d_model
    out = {"params": 4 * n_params, "grads": 4 * n_params, "optimizer": 8 * n_params,
           "activations": acts, "head": head}
    out["total"] = sum(out.values())
    out["forward_peak"] = out["params"] + out["optimizer"] + acts + head
    out["optimizer_peak"] = out["params"] + out["grads"] + out["optimizer"] + (0 if fused_adamw else 4 * n_params)
    out["peak"] = max(out["forward_peak"], out["optimizer_peak"])
    return out
