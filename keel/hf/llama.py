"""A ``pre_ln`` keel model is a stock Llama: conversion both ways (``LlamaForCausalLM``).

Keel's ``pre_ln`` scheme computes ``x + F(Norm(x))`` for both sub-layers of every block
and ends with a final RMSNorm, with grouped-query attention, RoPE in the rotate-half
layout, a SwiGLU FFN and no biases: the function of ``transformers``'
``LlamaForCausalLM`` (Touvron et al. 2023), parameter for parameter. So a ``pre_ln`` run
exports as ``model_type: "llama"`` (no custom code; everything that reads Llama checkpoints
reads it), and a stock Llama folder imports as a ``pre_ln`` run.

Config fields: ``hidden_size`` = d_model, ``num_hidden_layers`` = n_layers,
``num_attention_heads`` = n_heads, ``num_key_value_heads`` = n_kv_heads,
``intermediate_size`` = d_ff, ``max_position_embeddings`` = max_seq_len,
``rms_norm_eps`` = norm_eps, ``rope_parameters.rope_theta`` = rope_theta,
``initializer_range`` = init_std, ``tie_word_embeddings`` = tie_embeddings. What keel does
not have is refused by :func:`model_config_from_llama` with a one-line KeelError naming it
(RoPE scaling, biases, another activation, a head_dim other than d_model / n_heads, ...).

Parameter names: :func:`llama_weight_map` is the one table between the two naming schemes
(used in both directions).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from keel.config import ModelConfig
from keel.errors import KeelError
from keel.model import Transformer

log = logging.getLogger(__name__)


def llama_weight_map(n_layers: int) -> list[tuple[str, list[str]]]:
    """``[(keel name, [Llama names])]`` for every parameter of a ``pre_ln`` model with
    ``n_layers`` blocks. A keel tensor is the concatenation, along dim 0, of its Llama
    tensors (one each today; a fused keel projection, e.g. q/k/v in one matrix, lists its
    parts in order). The LM head is listed even when tied (the caller drops the alias)."""
    table = [("tok_emb.weight", ["model.embed_tokens.weight"])]
    for i in range(n_layers):
        k, h = f"blocks.{i}.", f"model.layers.{i}."
        table += [
            (k + "attn_residual.norm.weight", [h + "input_layernorm.weight"]),
            (k + "attn.wq.weight", [h + "self_attn.q_proj.weight"]),
            (k + "attn.wk.weight", [h + "self_attn.k_proj.weight"]),
            (k + "attn.wv.weight", [h + "self_attn.v_proj.weight"]),
            (k + "attn.wo.weight", [h + "self_attn.o_proj.weight"]),
            (k + "ffn_residual.norm.weight", [h + "post_attention_layernorm.weight"]),
            (k + "ffn.w1.weight", [h + "mlp.gate_proj.weight"]),
            (k + "ffn.w3.weight", [h + "mlp.up_proj.weight"]),
            (k + "ffn.w2.weight", [h + "mlp.down_proj.weight"]),
        ]
    return table + [("norm.weight", ["model.norm.weight"]), ("lm_head.weight", ["lm_head.weight"])]


def llama_config_from_keel(cfg: ModelConfig, **kwargs):
    """The ``transformers.LlamaConfig`` of a ``pre_ln`` keel ModelConfig; ``kwargs`` go to
    LlamaConfig (e.g. ``eos_token_id``). Raises KeelError for another scheme."""
    if cfg.residual != "pre_ln":
        raise KeelError(f"only pre_ln models are Llama models; this one is {cfg.residual!r}")
    return LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim, hidden_act="silu", max_position_embeddings=cfg.max_seq_len,
        initializer_range=cfg.init_std, rms_norm_eps=cfg.norm_eps, tie_word_embeddings=cfg.tie_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": float(cfg.rope_theta)},
        attention_bias=False, mlp_bias=False, attention_dropout=0.0, **kwargs)


def _rope_theta(config) -> float:
    """RoPE base of a Llama config; KeelError for any RoPE scaling (keel has plain RoPE only)."""
    params = getattr(config, "rope_parameters", None) or {}
    scaling = getattr(config, "rope_scaling", None)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default" or (isinstance(scaling, dict) and scaling.get("rope_type", "default") != "default"):
        raise KeelError(f"unsupported Llama feature: rope_scaling (rope_type {rope_type!r}); "
                        "keel implements plain RoPE only")
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        raise KeelError("the Llama config names no rope_theta")
    return float(theta)


def model_config_from_llama(config) -> ModelConfig:
    """The ``pre_ln`` :class:`ModelConfig` of a ``transformers.LlamaConfig``.

    Raises:
        KeelError: naming the first feature keel lacks: another model_type, rope_scaling,
            attention_bias / mlp_bias, an activation other than silu, a head_dim other than
            hidden_size / num_attention_heads, pretraining_tp > 1.
    """
    if getattr(config, "model_type", None) != "llama":
        raise KeelError(f"not a Llama config (model_type {getattr(config, 'model_type', None)!r})")
    for flag in ("attention_bias", "mlp_bias"):
        if getattr(config, flag, False):
            raise KeelError(f"unsupported Llama feature: {flag}=true (keel has no biases)")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise KeelError(f"unsupported Llama feature: hidden_act={config.hidden_act!r} (keel's FFN is SwiGLU, silu)")
    if (getattr(config, "pretraining_tp", 1) or 1) > 1:
        raise KeelError(f"unsupported Llama feature: pretraining_tp={config.pretraining_tp}")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head_dim * config.num_attention_heads != config.hidden_size:
        raise KeelError(f"unsupported Llama feature: head_dim={head_dim} != hidden_size / num_attention_heads "
                        f"= {config.hidden_size} / {config.num_attention_heads}")
    if float(getattr(config, "attention_dropout", 0.0) or 0.0) > 0:
        log.warning("the Llama config has attention_dropout=%s; keel trains without dropout", config.attention_dropout)
    return ModelConfig(
        vocab_size=config.vocab_size, d_model=config.hidden_size, n_layers=config.num_hidden_layers,
        n_heads=config.num_attention_heads, n_kv_heads=config.num_key_value_heads or config.num_attention_heads,
        d_ff=config.intermediate_size, max_seq_len=config.max_position_embeddings, rope_theta=_rope_theta(config),
        norm_eps=config.rms_norm_eps, tie_embeddings=bool(config.tie_word_embeddings),
        init_std=config.initializer_range, residual="pre_ln")


def keel_to_llama_state(state: dict[str, torch.Tensor], n_layers: int,
                        shapes: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    """Keel parameter names -> Llama names (:func:`llama_weight_map`); a fused keel tensor is
    split by the row counts of the Llama ``shapes``. A tied head (absent from ``state``) is
    left out. Raises KeelError if a keel parameter is missing."""
    out = {}
    for keel_name, parts in llama_weight_map(n_layers):
        if keel_name not in state:
            if keel_name == "lm_head.weight":
                continue
            raise KeelError(f"keel weights have no {keel_name!r} (not a pre_ln model?)")
        pieces = torch.split(state[keel_name], [shapes[p][0] for p in parts], dim=0)
        out.update(zip(parts, pieces))
    return out


def llama_to_keel_state(state: dict[str, torch.Tensor], n_layers: int, tied: bool) -> dict[str, torch.Tensor]:
    """Llama parameter names -> keel names (:func:`llama_weight_map`), fused parts concatenated.

    Raises:
        KeelError: a weight is missing, an untied model has no ``lm_head.weight``, or the
            folder holds weights keel has no place for (biases, ...; they are named).
    """
    out, used = {}, set()
    for keel_name, parts in llama_weight_map(n_layers):
        if keel_name == "lm_head.weight" and tied:
            used.add("lm_head.weight")
            continue
        missing = [p for p in parts if p not in state]
        if missing:
            what = "an untied model (tie_word_embeddings false) needs" if keel_name == "lm_head.weight" else "missing"
            raise KeelError(f"Llama weights: {what} {missing[0]!r}")
        out[keel_name] = torch.cat([state[p] for p in parts], dim=0) if len(parts) > 1 else state[parts[0]]
        used.update(parts)
    extra = sorted(k for k in state if k not in used and not k.endswith("rotary_emb.inv_freq"))
    if extra:
        raise KeelError(f"unsupported Llama weights (keel has no place for them): {', '.join(extra[:3])}")
    return out


def to_llama(model, **config_kwargs):
    """A ``transformers.LlamaForCausalLM`` (fp32, eval mode, CPU) with a copy of the weights of
    a ``pre_ln`` :class:`keel.model.Transformer` (it shares no memory with ``model``: training
    one leaves the other as it was); ``config_kwargs`` go to LlamaConfig. Raises KeelError: a looped model."""
    if model.cfg.loop_core:
        raise KeelError("a looped model (model.loop_core >= 1) is not a stock Llama: export it as a keel model")
    config = llama_config_from_keel(model.cfg, **config_kwargs)
    with torch.device("meta"):
        llama = LlamaForCausalLM(config)
    shapes = {k: v.shape for k, v in llama.state_dict().items()}
    keel_state = {k: v.detach().to("cpu", torch.float32, copy=True) for k, v in model.state_dict().items()
                  if not k.startswith("rope_")}
    if model.cfg.tie_embeddings:
        keel_state.pop("lm_head.weight", None)
    weights = keel_to_llama_state(keel_state, model.cfg.n_layers, shapes)
    llama.load_state_dict(weights, strict=False, assign=True)
    if model.cfg.tie_embeddings:
        llama.tie_weights()
    llama.model.rotary_emb = type(llama.model.rotary_emb)(config=config)  # real inv_freq buffers, not meta
    return llama.eval()


def read_safetensors(folder) -> dict[str, torch.Tensor]:
    """Every tensor of ``folder/*.safetensors`` (a single file or shards), on the CPU.
    Raises KeelError if there is none."""
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise KeelError(f"no *.safetensors weights in {folder} (PyTorch .bin files are not read)")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def from_llama(config, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A ``pre_ln`` :class:`keel.model.Transformer` (fp32, eval mode) from a Llama config and
    its weights as stored (``{Llama name: tensor}``, e.g. :func:`read_safetensors`).

    Raises:
        KeelError: what keel lacks (:func:`model_config_from_llama`), missing or extra weights
            (:func:`llama_to_keel_state`), or a config with tied embeddings whose file holds
            a different ``lm_head.weight``.
    """
    cfg = model_config_from_llama(config)
    state = {k: v.to(torch.float32) for k, v in state.items()}
    head, emb = state.get("lm_head.weight"), state.get("model.embed_tokens.weight")
    if cfg.tie_embeddings and head is not None and emb is not None and not torch.equal(head, emb):
        raise KeelError("tie_word_embeddings is true but the weights hold an lm_head different from the embedding")
    model = Transformer(cfg)
    weights = llama_to_keel_state(state, cfg.n_layers, cfg.tie_embeddings)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    missing = [m for m in missing if not (cfg.tie_embeddings and m == "lm_head.weight")]
    if missing or unexpected:  # pragma: no cover - the table covers every parameter
        raise KeelError(f"Llama -> keel: missing {missing[:3]}, unexpected {unexpected[:3]}")
    return model.eval()
