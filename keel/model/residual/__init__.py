"""Residual schemes: how each sub-layer F (attention or FFN) joins the residual stream, one
small ``nn.Module`` per scheme behind one interface (:mod:`keel.model.residual.base`):
single-stream schemes in :mod:`~keel.model.residual.single_stream`, multi-stream ones (HC,
mHC, AttnRes) in :mod:`~keel.model.residual.multi_stream`, and here the registry
:data:`SCHEMES`, the one list of scheme names."""

from __future__ import annotations

import dataclasses

from keel.config import ModelConfig
from keel.errors import KeelError
from keel.model.residual.base import Residual
from keel.model.residual.multi_stream import AttnRes, HyperConnections, ManifoldHyperConnections
from keel.model.residual.single_stream import DeepNorm, HybridNorm, Keel, MixLN, PeriLN, PostLN, PreLN

# The one list of residual schemes: config validation, the CLI defaults, gradflow, the
# benchmarks and the tests all read it. Adding a scheme = a class in single_stream.py or
# multi_stream.py + a line here.
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


def scheme_readers(name: str) -> list[str]:
    """The registered schemes that read the model key ``name``, as each scheme's class declares
    it (``config_keys``); [] for a key no scheme declares (one the whole model reads, or none)."""
    return [scheme for scheme, cls in SCHEMES.items() if name in cls.config_keys]


def ignored_keys(cfg: ModelConfig) -> list[str]:
    """One line per scheme-specific model key (:func:`scheme_readers`) that ``cfg`` sets to a
    value other than its default although ``cfg.residual`` does not read it, e.g. ``model.alpha
    is read only by keel; model.residual=pre_ln ignores it`` (the trainer logs them as warnings)."""
    default, lines = ModelConfig(), []
    for f in dataclasses.fields(cfg):
        readers = scheme_readers(f.name)
        if readers and cfg.residual not in readers and getattr(cfg, f.name) != getattr(default, f.name):
            who = readers[0] if len(readers) == 1 else f"{', '.join(readers[:-1])} and {readers[-1]}"
            lines.append(f"model.{f.name} is read only by {who}; model.residual={cfg.residual} ignores it")
    return lines


def check_model_config(cfg: ModelConfig) -> ModelConfig:
    """Validate ``cfg``: its shape (:meth:`ModelConfig.validate`), the scheme name and the
    scheme's own checks (:meth:`Residual.check_config`). Returns ``cfg``.

    Raises:
        KeelError: naming the first bad key; ``cfg`` not a ModelConfig (a whole Config, or a model, failed on
            a missing attribute).
    """
    if not all(hasattr(cfg, k) for k in ("residual", "n_layers", "validate")):  # not isinstance: an HF export's
        # generated code holds a ModelConfig class of its own
        raise KeelError(f"expected a keel.config.ModelConfig (a Config's .model), got {type(cfg).__name__}")
    cfg.validate()
    get_scheme(cfg.residual).check_config(cfg)
    return cfg


__all__ = ["SCHEMES", "AttnRes", "DeepNorm", "HybridNorm", "HyperConnections", "Keel", "ManifoldHyperConnections",
           "MixLN", "PeriLN", "PostLN", "PreLN", "Residual", "check_model_config", "get_scheme", "ignored_keys",
           "scheme_readers"]
