"""``KeelConfig``: the Hugging Face configuration of a keel model (``model_type = "keel"``).

Its fields are exactly those of :class:`keel.config.ModelConfig`, read from the dataclass
(so a field added there, e.g. ``mix_ln_ratio``, is carried without a change here), plus
the usual :class:`transformers.PretrainedConfig` keys. The standard Hugging Face names are
aliases of keel's (``attribute_map``): ``hidden_size`` = ``d_model``,
``num_hidden_layers`` = ``n_layers`` (blocks; the paper's depth L in sub-layers is
``2 * n_layers``), ``num_attention_heads`` = ``n_heads``, ``num_key_value_heads`` =
``n_kv_heads``, ``intermediate_size`` = ``d_ff``, ``max_position_embeddings`` =
``max_seq_len`` (tokens), ``rms_norm_eps`` = ``norm_eps``, ``initializer_range`` =
``init_std`` and ``tie_word_embeddings`` = ``tie_embeddings``.

A looped model (keel's ``loop_prelude``, ``loop_core``, ``loop_repeats``, ``loop_sampling``) has one
more key, ``loops``: the core's applications per forward pass (test-time depth), ``None`` (the default,
so written by ``keel export-hf``) = ``loop_repeats``. ``loop_repeats`` is the count the model was trained
at, and it fixes depth constants (Keel's alpha, DeepNorm's alpha and beta): leave it as exported and run
at another count with ``from_pretrained(folder, loops=R)`` or ``model.config.loops = R``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from transformers import PretrainedConfig

from keel.config import ModelConfig

MODEL_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(ModelConfig))
_DEFAULTS = ModelConfig()


class KeelConfig(PretrainedConfig):
    """Hugging Face config holding every :class:`keel.config.ModelConfig` field.

    ``KeelConfig(**kwargs)``: any ModelConfig field by keel's name (or by its Hugging Face
    alias, see the module docstring), and ``loops`` (a looped model's core applications per
    forward pass, int >= 1; None = ``loop_repeats``; checked when the model is built); other keys
    go to ``PretrainedConfig``. Missing fields take ModelConfig's defaults.
    :meth:`to_model_config` gives the validated ModelConfig (raises :class:`keel.errors.KeelError` on an impossible shape).
    """

    model_type = "keel"
    attribute_map = {
        "hidden_size": "d_model",
        "num_hidden_layers": "n_layers",
        "num_attention_heads": "n_heads",
        "num_key_value_heads": "n_kv_heads",
        "intermediate_size": "d_ff",
        "max_position_embeddings": "max_seq_len",
        "rms_norm_eps": "norm_eps",
        "initializer_range": "init_std",
        "tie_word_embeddings": "tie_embeddings",
    }

    def __init__(self, **kwargs: Any):
        values = {}
        reverse = {v: k for k, v in self.attribute_map.items()}
        for name in MODEL_FIELDS:
            default = getattr(_DEFAULTS, name)
            value = kwargs.pop(name, default)
            alias = reverse.get(name)
            if alias is not None and alias in kwargs:
                alias_value = kwargs.pop(alias)
                if name not in values and value == default:
                    value = alias_value
            values[name] = value
        values["loops"] = kwargs.pop("loops", None)  # test-time depth (module docstring)
        super().__init__(**kwargs)
        # Set after PretrainedConfig.__init__, which may assign defaults to aliased names
        # (e.g. tie_word_embeddings) in some transformers versions.
        for name, value in values.items():
            setattr(self, name, value)

    @classmethod
    def from_model_config(cls, cfg: ModelConfig, **kwargs: Any) -> "KeelConfig":
        """The KeelConfig of a keel ModelConfig (all fields copied); ``kwargs`` go to PretrainedConfig."""
        return cls(**dataclasses.asdict(cfg), **kwargs)

    def to_model_config(self) -> ModelConfig:
        """A :class:`keel.config.ModelConfig` with this config's fields, its shape validated
        (the scheme is checked when the model is built, by ``check_model_config``).

        Raises:
            KeelError: an impossible shape.
        """
        # Not check_model_config (keel.model): this module is copied into exported folders as
        # configuration_keel.py, which must not need the model code (keel.hf.remote).
        return ModelConfig(**{name: getattr(self, name) for name in MODEL_FIELDS}).validate()
