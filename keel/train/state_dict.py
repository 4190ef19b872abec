"""Whole-model views that must see every parameter, whatever the sharding.

:func:`clip_grad_norm_` (the full L2 norm of all gradients, also when they are FSDP2
``DTensor`` shards), :func:`full_model_state_dict` / :func:`full_optimizer_state_dict`
(gathered, on CPU, keyed by parameter name: what a single-process checkpoint stores),
:func:`load_optimizer_state_dict`, and the sharded views that ``torch.distributed.checkpoint``
saves and loads in multi-process runs (:func:`sharded_state_dict`,
:func:`load_sharded_state_dict`); and :class:`TrainState`, the trainer's own resumable state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from keel.errors import KeelError
from keel.keys import current_param_name
from keel.train.parallelize import unwrap


def clip_grad_norm_(parameters, max_norm: float) -> float:
    """Clip gradients in place to total L2 norm ``max_norm``; return the norm before clipping.

    The norm is ``sqrt(sum_p ||grad_p||_2^2)`` over all parameters of the model, computed
    by ``torch.nn.utils.get_total_norm``. Under FSDP2 the gradients are ``DTensor`` shards
    and that norm is a ``DTensor`` with a pending (partial) reduction; ``.full_tensor()``
    completes it across ranks, so the value equals the single-process/DDP norm (torchtitan,
    ``dist_utils.clip_grad_norm_``; a local-shard norm would be wrong by up to sqrt(world
    size) and worse). Scaling is ``torch.nn.utils.clip_grads_with_norm_``: every gradient is
    multiplied by ``min(1, max_norm / (norm + 1e-6))``. ``max_norm = inf`` only measures.

    Returns a Python float (``nan``/``inf`` when a gradient is not finite).
    """
    from torch.distributed.tensor import DTensor  # lazy: +1-2 s of import; keel eval / generate / runs never need it

    params = [p for p in parameters if p.grad is not None]
    if not params:
        return 0.0
    total = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return float(total.item())


def _full_options():
    # lazy: +1-2 s of import; keel eval / generate / runs never need it
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True)


def full_model_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full (unsharded) weights on CPU, keyed by the plain model's parameter names.

    ``torch.distributed.checkpoint.state_dict.get_model_state_dict`` with
    ``full_state_dict=True, cpu_offload=True``: FSDP2 shards are all-gathered, DDP's
    ``module.`` and compile's ``_orig_mod.`` prefixes are dropped. Collective under FSDP
    (call it on every rank); in a process group only rank 0 receives the tensors, the other
    ranks get ``{}``. Tied weights appear under every name.
    """
    # lazy: +1-2 s of import; keel eval / generate / runs never need it
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(unwrap(model), options=_full_options())


def full_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The full optimizer state on CPU, keyed by parameter name (not by index), so it loads
    at any world size and with or without FSDP. Collective under FSDP; only rank 0 receives
    it in a process group (``{}`` elsewhere). Format: ``{"state": {name: {"step", "exp_avg",
    "exp_avg_sq"}}, "param_groups": [{..., "params": [names]}]}`` for AdamW."""
    # lazy: +1-2 s of import; keel eval / generate / runs never need it
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(unwrap(model), optimizer, options=_full_options())


def load_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Load a state from :func:`full_optimizer_state_dict` (every rank passes the full state;
    each keeps its own shard under FSDP2). A legacy index-keyed ``optimizer.state_dict()``
    is loaded directly when the model is not sharded.

    Raises:
        KeelError: an index-keyed state with a sharded (FSDP) model.
    """
    # lazy: +1-2 s of import; keel eval / generate / runs never need it
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
    from torch.distributed.fsdp import FSDPModule

    keys = list(state.get("state", {}))
    if keys and isinstance(keys[0], int):
        if isinstance(unwrap(model), FSDPModule):
            raise KeelError("this checkpoint's optimizer state is index-keyed (old format); "
                            "resume it without FSDP first")
        optimizer.load_state_dict(state)
        return
    set_optimizer_state_dict(unwrap(model), optimizer, renamed_optimizer_state(state),
                             options=StateDictOptions(full_state_dict=True))


def renamed_optimizer_state(state: dict, old: bool = False) -> dict:
    """A name-keyed optimizer state (:func:`full_optimizer_state_dict`, or the ``"optim"`` part of a
    :func:`sharded_state_dict`) under the current parameter names (:func:`keel.keys.current_param_name`:
    a state saved before a parameter rename loads), or with ``old`` under the names from before it.
    The tensors are shared, not copied; an index-keyed state's integers stay as they are."""
    def name(n):
        return current_param_name(n, old) if isinstance(n, str) else n

    return {**state, "state": {name(k): v for k, v in state.get("state", {}).items()},
            "param_groups": [{**g, "params": [name(p) for p in g["params"]]} for g in state.get("param_groups", [])]}


def sharded_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """``{"model": ..., "optim": ...}`` as each rank holds it: FSDP2 parameters and AdamW state
    stay ``DTensor`` shards (nothing is gathered), keyed by the plain model's parameter names
    (``torch.distributed.checkpoint.state_dict`` with default options). What
    ``torch.distributed.checkpoint.save`` writes, one file per rank, and what ``load`` fills
    at any world size (it reshards). A fresh optimizer's state is materialised first (zeros),
    so that it can be loaded into. Without ``optimizer``: the model only."""
    # lazy: +1-2 s of import; keel eval / generate / runs never need it
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    out = {"model": get_model_state_dict(unwrap(model))}
    if optimizer is not None:
        out["optim"] = get_optimizer_state_dict(unwrap(model), optimizer)
    return out


def load_sharded_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer | None, state: dict) -> None:
    """Put a :func:`sharded_state_dict` (filled by ``torch.distributed.checkpoint.load``) back
    into ``model`` (strict) and ``optimizer``."""
    # lazy: +1-2 s of import; keel eval / generate / runs never need it
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    set_model_state_dict(unwrap(model), state["model"])
    if optimizer is not None:
        set_optimizer_state_dict(unwrap(model), optimizer, state["optim"])


@dataclass
class TrainState:
    """The trainer's resumable state beside the weights and the optimiser, checkpointed through
    its own ``state_dict`` / ``load_state_dict`` (``torch.distributed.checkpoint.stateful.Stateful``,
    as torchtitan's components): the optimiser ``step`` (0 = nothing trained), ``tokens`` trained
    (global, all ranks), ``elapsed`` training seconds, the data ``loader``'s position, the CPU RNG,
    ``config`` (the run's config as a dict, saved so that a resume can compare it) and, for an fp16
    run, the loss ``scaling`` (:class:`keel.train.loss_scaling.LossScaling`: scale and skipped steps).
    """

    loader: Any  # a keel.data.TokenLoader (its own state_dict / load_state_dict)
    config: dict
    step: int = 0
    tokens: int = 0
    elapsed: float = 0.0
    scaling: Any = None  # a keel.train.loss_scaling.LossScaling, or None

    def state_dict(self) -> dict:
        """``{"step", "tokens", "elapsed_s", "loader", "rng", "config"}`` (the checkpoint's keys), and
        ``"grad_scaler"`` (floats and ints) when the run scales its loss (``train.precision =
        "fp16-autocast"``)."""
        out = {"step": self.step, "tokens": self.tokens, "elapsed_s": self.elapsed,
               "loader": self.loader.state_dict(), "rng": torch.get_rng_state(), "config": self.config}
        scaler = self.scaling.state_dict() if self.scaling is not None else None
        if scaler is not None:
            out["grad_scaler"] = scaler
        return out

    def load_state_dict(self, state: dict) -> None:
        """Restore the counters, the loader's position, the CPU RNG and the loss scaler's state (not
        the config: a resume compares it, :func:`keel.train.resume.check_config_changes`, and keeps
        the new one). A checkpoint without ``"grad_scaler"`` (an fp32/bf16 run, an older one) leaves
        a scaler at its initial scale; a run without a scaler ignores the entry."""
        self.loader.load_state_dict(state["loader"])
        torch.set_rng_state(state["rng"])
        self.step, self.tokens, self.elapsed = state["step"], state["tokens"], state["elapsed_s"]
        if self.scaling is not None and state.get("grad_scaler") is not None:
            self.scaling.load_state_dict(state["grad_scaler"])
