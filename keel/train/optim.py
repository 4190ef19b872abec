"""Optimiser and learning-rate schedules of the paper's recipe (Keel paper, Sec. 5 / App.).

AdamW, betas (0.9, 0.95), weight decay 0.01 on weight matrices and embeddings (every
parameter with >= 2 dims), none on RMSNorm gains; linear warm-up, then one of three
schedules (``train.schedule``):

* ``cosine`` (default, the paper's): cosine decay from ``lr`` to ``min_lr`` over the whole
  run. The curve depends on ``train.steps``: extending a run (resume with a larger
  ``train.steps``) changes the LR of the steps already planned, so it jumps at the resume.
* ``wsd`` (warmup-stable-decay, MiniCPM, Hu et al. 2024, arXiv 2404.06395, Eq. 1): ``lr``
  until the last ``decay_fraction`` of the steps, then an exponential decay to ``min_lr``.
  A run extended while still in its stable phase continues without any LR change.
* ``constant``: ``lr`` after warm-up. A run can be extended freely.

The LR is a pure function of the step, written into the optimiser before every step
(:func:`set_lr`); nothing about the schedule is checkpointed. A resumed run therefore always
uses the schedule of its current config at the step it resumes from (see
:func:`keel.train.trainer.Trainer`); when that differs from the LR the old config gave, the
trainer says so. Checkpoints written before this change hold a ``scheduler`` entry (a
``LambdaLR`` state); it is ignored on resume.
"""

from __future__ import annotations

import math

import torch

from keel.config import TrainConfig


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate (absolute) used for optimiser step ``step`` (0-based).

    Warm-up (all schedules): ``lr * (step + 1) / warmup_steps`` for step < warmup_steps
    (linear from lr/warmup_steps, so the first step is not wasted at 0). Then:

    * cosine: ``min_lr + (lr - min_lr) * 0.5 * (1 + cos(pi * p))`` with
      p = (step - warmup) / (steps - warmup), clipped to [0, 1];
    * wsd: ``lr`` for step < T = steps - D, D = max(1, round(decay_fraction * steps)), then
      MiniCPM's ``f(s - T) * lr`` at the 1-based step s = step + 1 (as the warm-up counts),
      with the exponential ``f(s - T) = (min_lr / lr) ** q``, q = min(1, (s - T) / D): a
      half-life of D * ln 2 / ln(lr / min_lr) steps; the run's last step (step = steps - 1)
      runs at ``min_lr``, so even a run with D = 1 decays;
    * constant: ``lr``.
    """
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    if cfg.schedule == "wsd":
        decay = max(1, round(cfg.decay_fraction * cfg.steps))
        stable_end = max(cfg.warmup_steps, cfg.steps - decay)
        if step < stable_end:
            return cfg.lr
        q = min(1.0, (step + 1 - stable_end) / max(1, cfg.steps - stable_end))
        return cfg.lr * (cfg.min_lr / cfg.lr) ** q
    decay_steps = max(1, cfg.steps - cfg.warmup_steps)
    p = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * 0.5 * (1.0 + math.cos(math.pi * p))


def decay_overrides(model: torch.nn.Module) -> dict[int, bool]:
    """``{id(parameter): decayed}`` from every module's ``weight_decay`` table (``{name:
    decayed}``, e.g. a residual scheme whose paper decays its dynamic maps and not its static
    ones: :class:`keel.model.residual.multi_stream.HyperConnections`)."""
    out = {}
    for module in model.modules():
        for name, decayed in getattr(module, "weight_decay", {}).items():
            p = getattr(module, name, None)
            if isinstance(p, torch.nn.Parameter):
                out[id(p)] = decayed
    return out


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW with two groups: decay for params with ndim >= 2, no decay for gains, except where
    a module's ``weight_decay`` table says otherwise (:func:`decay_overrides`).

    Uses torch's fused AdamW kernel (CPU and CUDA: one pass over each tensor, no
    temporaries; ~10x faster than foreach on CPU at 9M parameters). Tied weights appear once.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    chosen = decay_overrides(model)
    decay = [p for p in params if chosen.get(id(p), p.ndim >= 2)]
    no_decay = [p for p in params if not chosen.get(id(p), p.ndim >= 2)]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8, fused=True)


def set_lr(optimizer: torch.optim.Optimizer, step: int, cfg: TrainConfig) -> float:
    """Write ``lr_at(step, cfg)`` into every param group before optimiser step ``step``
    (0-based: the number of steps already done); returns that LR (absolute).

    The LR is a pure function of the step (as nanoGPT's ``get_lr``): no scheduler object and
    no schedule state in checkpoints, so a resumed run recomputes it from its current config.
    Adding a schedule is :func:`lr_at` plus its name in ``TrainConfig.schedule``. Both groups
    of :func:`build_optimizer` take the same LR (there is no per-group multiplier).
    """
    lr = lr_at(step, cfg)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


def without_scheduler_marks(optim_state: dict) -> dict:
    """``optim_state`` (a full optimizer state dict, as a checkpoint holds it) without the
    ``initial_lr`` that the ``LambdaLR`` of checkpoints written before the LR became a pure
    function put into every param group: the optimizer of this version has no such key,
    and loading a state with it fails (``KeyError`` in ``set_optimizer_state_dict``)."""
    groups = [{k: v for k, v in g.items() if k != "initial_lr"} for g in optim_state["param_groups"]]
    return {**optim_state, "param_groups": groups}


def apply_config(optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> None:
    """After loading a saved optimiser state, make ``cfg``'s hyperparameters the ones in effect.

    ``load_state_dict`` brings back the saved betas and weight decay; a resumed run must use
    its current config's. Sets each group's betas and weight decay (decay group first, as
    :func:`build_optimizer` makes them). The LR needs nothing: :func:`set_lr` writes it
    before every step. Unchanged values give the same floats as an uninterrupted run.
    """
    for i, group in enumerate(optimizer.param_groups):
        group["betas"] = (cfg.beta1, cfg.beta2)
        group["weight_decay"] = cfg.weight_decay if i == 0 else 0.0
