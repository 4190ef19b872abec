"""``KeelForCausalLM``: the native keel model (:class:`keel.model.Transformer`) behind the
Hugging Face ``PreTrainedModel`` / ``GenerationMixin`` interface.

There is no second copy of the architecture: ``KeelForCausalLM(config).model`` *is* a
``keel.model.Transformer`` built from ``config.to_model_config()``; its parameter names
appear with the prefix ``model.`` in ``model.safetensors``. With tied embeddings
(``tie_word_embeddings``) ``model.lm_head.weight`` is the same tensor as
``model.tok_emb.weight`` and is saved once.

KV cache: the native model takes any object with ``update(k, v, layer_idx)`` and
``get_seq_length()``, which ``transformers.DynamicCache`` has, so ``generate()`` with
``use_cache=True`` passes its cache straight through; RoPE positions start at the cache's
length.

Padding: a 2-D ``attention_mask`` [B, past + T] (1 = real token, 0 = padding) goes to the
native model, which takes RoPE positions from it (each row's real tokens count from 0) and
masks padded keys (:func:`keel.model.model.padding_attention_mask`): left-padded batched
``generate`` gives each row what it gives alone, and lm-evaluation-harness' ``generate_until``
runs at any batch size. Right padding needs nothing in a forward pass (causal attention never
lets a real token see a later pad); ``generate`` refuses it (KeelError: it would continue each
row from its padding), as it refuses a preallocated ``StaticCache`` (``cache_implementation="static"``).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from transformers import DynamicCache, GenerationMixin, PreTrainedModel, StaticCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from keel.errors import KeelError
from keel.hf.configuration import KeelConfig
from keel.keys import RENAMED_PARAMS
from keel.model import RMSNorm, Transformer, rope_tables
from keel.model.model import check_left_padded

_OUTPUT_FIELDS = {f.name for f in dataclasses.fields(CausalLMOutputWithPast)}
_CACHE_FIELD = "cache" if "cache" in _OUTPUT_FIELDS else "past_key_values"
# transformers' ``key_mapping`` (pattern -> replacement) from the names a folder exported before a
# parameter rename stores to the current ones (keel.keys.RENAMED_PARAMS): model.blocks.N.attn_res.* ...
OLD_NAME_PATTERNS = {rf"blocks\.(\d+)\.{old}\.": rf"blocks.\1.{new}." for old, new in RENAMED_PARAMS.items()}


def check_growing_cache(cache) -> None:
    """Raise KeelError, in one line, if ``cache`` is a preallocated one (``transformers.StaticCache``, what
    ``generate(cache_implementation="static" / "offloaded_static")`` makes, or any cache transformers deems
    compileable and pairs with a 4-D mask): keel's model appends each step's keys and values and takes its
    length from them, as ``DynamicCache`` and :class:`keel.model.KVCache` do."""
    if isinstance(cache, StaticCache) or getattr(cache, "is_compileable", False) is True:
        raise KeelError(f"keel models grow their own KV cache and cannot use a preallocated {type(cache).__name__} "
                        "(generate's cache_implementation='static' or 'offloaded_static'); leave cache_implementation "
                        "unset for the default dynamic cache (DynamicCache)")


def check_attention_mask(attention_mask: torch.Tensor | None, past_length: int, total: int) -> None:
    """Raise KeelError unless ``attention_mask`` is None or 2-D [B, past_length + T] = ``total`` (0/1)."""
    if attention_mask is None:
        return
    if attention_mask.dim() != 2 or attention_mask.shape[1] != total:
        raise KeelError(f"keel models take a 2-D attention_mask [batch, past + new tokens] = [*, {total}] of 0/1, "
                        f"got shape {tuple(attention_mask.shape)} (past {past_length})")


def _check_position_ids(position_ids: torch.Tensor, attention_mask: torch.Tensor | None, past: int, T: int) -> None:
    """Raise KeelError unless ``position_ids`` [B, T] are the positions the native model uses."""
    if attention_mask is None:
        expected = torch.arange(past, past + T, device=position_ids.device).expand(position_ids.shape[0], T)
        real = torch.ones_like(expected, dtype=torch.bool)
    else:
        m = attention_mask.to(position_ids.device).long()
        expected, real = (m.cumsum(-1) - 1)[:, past:], m[:, past:].bool()
    if position_ids.shape != expected.shape or not torch.equal(position_ids[real], expected[real]):
        check_left_padded(attention_mask)  # generate's positions after right padding: say what is wrong
        raise KeelError("keel models derive positions from the cache length and the attention mask; position_ids "
                        "must equal them (past + arange(T), or the count of real tokens before each one)")


def _kept(logits: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
    """The positions of logits [B, T, V] that ``logits_to_keep`` keeps (transformers' argument):
    an int k > 0 the last k, 0 all, a tensor those indices."""
    if isinstance(logits_to_keep, int):
        return logits[:, -logits_to_keep:] if logits_to_keep > 0 else logits
    return logits[:, logits_to_keep]


class KeelPreTrainedModel(PreTrainedModel):
    """Base class: config class, weight init and the parts of the HF interface all keel models share."""

    config_class = KeelConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = False
    _no_split_modules = ["Block"]

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """``PreTrainedModel.from_pretrained``, where a folder exported before a parameter rename
        (:data:`keel.keys.RENAMED_PARAMS`) loads too: its names are mapped to the current ones
        (:data:`OLD_NAME_PATTERNS`, before a ``key_mapping`` of the caller's). transformers then
        saves such a model under the names it was loaded with (``save_original_format``)."""
        kwargs["key_mapping"] = {**OLD_NAME_PATTERNS, **(kwargs.get("key_mapping") or {})}
        return super().from_pretrained(*args, **kwargs)

    @torch.no_grad()
    def _init_weights(self, module: torch.nn.Module) -> None:
        """Initialise ``module`` the native way (called by transformers on fresh or partly loaded models).

        On the native :class:`Transformer`: the RoPE tables (non-persistent buffers, never
        saved) are recomputed; if none of its parameters was loaded from a checkpoint, the
        whole native init runs (:meth:`Transformer.reset_parameters`, including a scheme's
        own sub-layer init, e.g. DeepNorm's); otherwise only parameters that were missing
        from the checkpoint get N(0, init_std^2) (matrices, embedding) or 1 (RMSNorm gains).
        """
        if not isinstance(module, Transformer):
            return
        cfg = module.cfg
        cos, sin = rope_tables(cfg.max_seq_len, cfg.head_dim, cfg.rope_theta)
        module.rope_cos.copy_(cos.to(module.rope_cos.device))
        module.rope_sin.copy_(sin.to(module.rope_sin.device))
        params = list(module.parameters())
        if not any(getattr(p, "_is_hf_initialized", False) for p in params):
            module.reset_parameters()
            return
        for sub in module.modules():
            w = getattr(sub, "weight", None)
            if not isinstance(w, torch.nn.Parameter) or getattr(w, "_is_hf_initialized", False):
                continue
            if isinstance(sub, RMSNorm):
                w.fill_(1.0)
            else:
                w.normal_(0.0, cfg.init_std)


class KeelForCausalLM(KeelPreTrainedModel, GenerationMixin):
    """A keel decoder-only LM for ``transformers``: ``from_pretrained``, ``save_pretrained``, ``generate``.

    ``KeelForCausalLM(config)`` builds a fresh native model from ``config``
    (:class:`KeelConfig`); :meth:`from_native` wraps an existing
    :class:`keel.model.Transformer` without copying its weights.

    A looped model runs its core ``config.loops`` times per forward pass (None: the trained count,
    ``loop_repeats``), read at every forward, so ``model.config.loops = R`` (or back to None) takes effect
    at the next call and is what ``save_pretrained`` writes; the wrapped native model's
    :attr:`keel.model.Transformer.loops` follows it. The cache then holds a layer per applied block
    (:class:`keel.model.CacheSlot`).

    Raises:
        KeelError: an impossible config (from :meth:`KeelConfig.to_model_config`), or a ``config.loops``
            that is not an int >= 1 or is set for a model that does not loop (one line naming
            ``config.loops`` and the folder it was loaded from).
    """

    _tied_weights_keys = {"model.lm_head.weight": "model.tok_emb.weight"}

    def __init__(self, config: KeelConfig, model: Transformer | None = None):
        super().__init__(config)
        self.model = model if model is not None else Transformer(config.to_model_config())
        self._apply_loops()  # test-time depth (KeelConfig): checked now, not at the first forward
        self.vocab_size = config.vocab_size
        self.post_init()

    def _apply_loops(self) -> None:
        """Set the native model's loop count to ``config.loops`` (None: ``loop_repeats``).

        Raises:
            KeelError: one line naming ``config.loops`` and where it came from, for a count that is
                not an int >= 1 or is set for a model that does not loop.
        """
        loops = self.config.loops
        try:
            self.model.set_loops(loops)
        except KeelError as e:  # name where the count came from: a file's key, a kwarg or an attribute
            where = getattr(self.config, "name_or_path", "") or ""
            raise KeelError(f"config.loops = {loops!r} (config.json's loops{' in ' + where if where else ''}, "
                            f"from_pretrained(..., loops=R) or model.config.loops): {e}") from None

    @classmethod
    def from_native(cls, model: Transformer, **config_kwargs) -> "KeelForCausalLM":
        """Wrap a native :class:`keel.model.Transformer` (shared, not copied) as a KeelForCausalLM.

        ``config_kwargs`` go to :class:`KeelConfig` (e.g. ``eos_token_id``). The wrapper
        shares ``model``'s parameters, device, dtype and train/eval mode, and runs at its current
        loop count (:meth:`keel.model.Transformer.set_loops`; ``config.loops``) unless
        ``config_kwargs`` names ``loops``.
        """
        if model.loops != model.cfg.loop_repeats:  # a count set at test time (keel eval --loops)
            config_kwargs.setdefault("loops", model.loops)
        config = KeelConfig.from_model_config(model.cfg, **config_kwargs)
        with torch.device("meta"):  # transformers skips its weight init under a meta device
            return cls(config, model=model)

    def get_input_embeddings(self) -> torch.nn.Embedding:
        return self.model.tok_emb

    def set_input_embeddings(self, value: torch.nn.Embedding) -> None:
        self.model.tok_emb = value

    def get_output_embeddings(self) -> torch.nn.Linear:
        return self.model.lm_head

    def set_output_embeddings(self, value: torch.nn.Linear) -> None:
        self.model.lm_head = value

    def prepare_inputs_for_generation(self, input_ids: torch.LongTensor, *args, **kwargs) -> dict:
        """``GenerationMixin``'s inputs for the next step, cropped as ``keel generate`` crops them
        (:meth:`keel.model.Transformer.generate`): once the context ``input_ids`` [B, T] outgrows
        ``max_seq_len``, its last ``max_seq_len`` tokens (and attention mask columns) are run
        again from an empty cache, every step from then on. Without this the step past
        ``max_seq_len`` raised KeelError (a RoPE table of ``max_seq_len`` positions).

        Raises:
            KeelError: a preallocated cache (:func:`check_growing_cache`: ``cache_implementation="static"``)
                or a right-padded ``attention_mask`` (:func:`keel.model.model.check_left_padded`).
        """
        check_left_padded(kwargs.get("attention_mask"))
        inputs = super().prepare_inputs_for_generation(input_ids, *args, **kwargs)
        window, key = self.model.cfg.max_seq_len, "cache" if "cache" in inputs else "past_key_values"
        cache = inputs.get(key)
        check_growing_cache(cache)  # before the looped model's cache swap below, and the 4-D mask's check
        past = cache.get_seq_length() if cache is not None else 0
        if past == 0 and self.model.cfg.loop_core:  # generate's cache has a layer per block of weights, a looped
            inputs[key] = None  # model needs one per applied block (keel.model.CacheSlot): forward makes a growing one
        if past + inputs["input_ids"].shape[1] <= window:
            return inputs
        inputs[key] = None  # the window runs from an empty cache (forward makes one with use_cache)
        inputs["input_ids"] = input_ids[:, -window:].contiguous()
        if inputs.get("attention_mask") is not None:
            inputs["attention_mask"] = inputs["attention_mask"][:, -window:]
        inputs.pop("position_ids", None)  # derived again from the cropped mask
        return inputs

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache=None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        past_key_values=None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """Logits (and loss) of the native model, in the Hugging Face output format.

        Args:
            input_ids: LongTensor [B, T]; they follow the ``cache``'s positions, if any.
            attention_mask: optional 0/1 [B, past + T]; see the module docstring (left
                padding is supported).
            position_ids: optional [B, T]; must equal the positions the native model derives
                (``past + arange(T)``, or with a mask, the count of real tokens before each
                real token; padding positions are not checked), else KeelError (one saying the
                batch is right-padded where the mask has padding after real tokens).
            cache / past_key_values: a ``transformers.DynamicCache`` (or
                :class:`keel.model.KVCache`), extended in place; with ``use_cache`` and no
                cache given, a new ``DynamicCache`` is made and returned. A preallocated
                ``StaticCache`` is refused (KeelError, :func:`check_growing_cache`).
            inputs_embeds: not supported (KeelError).
            labels: optional LongTensor [B, T] aligned with ``input_ids`` (shifted inside,
                -100 ignored); the loss is the mean next-token cross-entropy, nats/token.
            logits_to_keep: int k > 0 keeps the last k positions' logits; 0 keeps all.
        Returns:
            ``CausalLMOutputWithPast`` with ``logits`` fp32 [B, T (or k), V], ``loss`` (scalar
            fp32 or None) and the cache.
        Raises:
            KeelError: unsupported inputs (above) or a sequence longer than max_seq_len.
        """
        if inputs_embeds is not None:
            raise KeelError("keel models take input_ids, not inputs_embeds")
        if input_ids is None:
            raise KeelError("input_ids is required")
        cache = cache if cache is not None else past_key_values
        if use_cache is None:
            use_cache = bool(getattr(self.config, "use_cache", False)) and not self.training
        if cache is None and use_cache:
            cache = DynamicCache()
        check_growing_cache(cache)
        past = cache.get_seq_length() if cache is not None else 0
        T = input_ids.shape[1]
        check_attention_mask(attention_mask, past, past + T)
        if position_ids is not None:
            _check_position_ids(position_ids, attention_mask, past, T)
        self._apply_loops()  # config.loops may have changed since the last call (None: loop_repeats)
        logits = self.model(input_ids, cache=cache, attention_mask=attention_mask)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)),
                                   labels[:, 1:].reshape(-1).to(logits.device), ignore_index=-100)
        out = {"loss": loss, "logits": _kept(logits, logits_to_keep), _CACHE_FIELD: cache if use_cache else None}
        return CausalLMOutputWithPast(**out)
