"""The interface every residual scheme shares: how a sub-layer F (attention or FFN) joins the
residual stream.

Every scheme is one small ``nn.Module`` with the same interface::

    unit = SCHEMES[cfg.residual](cfg, index)   # index = sub-layer index, 0 .. L-1
    x = unit(x, F)                               # x: [B, T, d_model], F: callable on [B, T, d_model]

``index`` counts sub-layers as the paper does: block ``b`` holds attention sub-layer
``2b`` and FFN sub-layer ``2b + 1``; L = 2 * n_layers. In a looped model (``cfg.loop_core``) a core
unit serves every application of its block and keeps its block's index, while a depth in a formula
is the effective ``cfg.n_sublayers`` = 2 (P + R C + Q); a scheme that cannot share a unit across
applications refuses a loop in ``check_config``. A unit may also

* set ``final_norm = True`` when the model needs a final RMSNorm before the LM head (or
  override the classmethod ``uses_final_norm(cfg)`` when that depends on the config);
* set ``attention_qkv_norm = True`` to have RMSNorm on q, k and v inside attention;
* override ``init_sublayer(F_module)`` to re-initialise the weights of the F it wraps;
* carry a stream other than one [B, T, d] tensor (multi-stream schemes: Hyper-Connections,
  mHC, Attention Residuals), or normalise the embedding (Peri-LN): the classmethod
  ``make_stream(cfg)`` returns a module with ``begin(emb) -> stream`` (run once on the
  token embedding [B, T, d]) and ``end(stream) -> [B, T, d]`` (run once after the last
  block, before the final norm); every unit then maps that stream to the next one. HC/mHC's
  stream is one tensor ``[n, B, T, d]`` with an extra *leading* axis (n streams); AttnRes' a
  tuple of m ``[B, T, d]`` sources (earlier block representations, m grows with depth).
  The default ``make_stream`` returns None: the stream is the embedding itself and the
  single-stream schemes that leave the embedding as it is run exactly as before (same
  parameters, same code path).

Norm is RMSNorm (gain init 1, no bias, eps = ``cfg.norm_eps``; :mod:`keel.model.norm`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from keel.config import ModelConfig

SubLayer = Callable[[torch.Tensor], torch.Tensor]


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
    :func:`keel.train.optim.build_optimizer`) and ``config_keys`` (the ``model.*`` keys only
    some schemes read, declared by each scheme that reads them: the one record of which scheme
    reads which key; a run whose scheme ignores such a key set to a non-default value says so,
    :func:`keel.model.residual.ignored_keys`).
    """

    final_norm = False
    attention_qkv_norm = False
    activation_constants: tuple[int, int] | None = None
    version = 1  # the scheme's implementation version: a run's identity (a changed scheme is not a cached run)
    weight_decay: dict[str, bool] = {}  # parameter name -> decayed, where it departs from ndim >= 2
    config_keys: tuple[str, ...] = ()  # the scheme-specific ModelConfig keys this scheme reads

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

    @classmethod
    def config_notes(cls, cfg: ModelConfig) -> list[str]:
        """Warnings about a valid ``cfg`` that builds something other than the scheme's name
        promises (logged by the trainer); default: none."""
        return []

    def init_sublayer(self, sublayer: nn.Module) -> None:
        """Re-initialise the wrapped sub-layer's weights; default: keep N(0, init_std)."""

    @classmethod
    def make_stream(cls, cfg: ModelConfig) -> nn.Module | None:
        """The model-level stream module (``begin(emb)``, ``end(stream)``, see the module
        docstring), or None (default): the stream is the [B, T, d] embedding itself."""
        return None

    @classmethod
    def stream_copies(cls, cfg: ModelConfig) -> int:
        """How many [B, T, d] tensors the stream holds between sub-layers, at most (memory floors,
        :func:`keel.train.device.activation_floor_bytes`): 1 for a single-stream scheme."""
        return 1

    def reset_scheme_parameters(self) -> None:
        """Re-initialise the unit's own non-norm parameters (HC/mHC/AttnRes maps); default:
        none. Called at construction and by :meth:`keel.model.Transformer.reset_parameters`."""

    def removed(self, x: torch.Tensor) -> torch.Tensor:
        """The unit's output when its sub-layer is removed (``keel ablate``); default: the
        input stream unchanged, ``x_{i+1} = x_i`` (F, and the unit's norms, skipped)."""
        return x

    def forward(self, x: torch.Tensor, f: SubLayer) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError
