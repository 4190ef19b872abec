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

A resumed run always uses the schedule of its current config at the step it resumes from
(see :func:`keel.train.trainer.Trainer`); when that differs from the LR the old config
gave, the trainer says so.
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
      MiniCPM's ``f(s - T) * lr`` with the exponential ``f(s - T) = (min_lr / lr) ** q``,
      q = min(1, (step - T) / D): a half-life of D * ln 2 / ln(lr / min_lr) steps, so the
      LR reaches ``min_lr`` at ``step = steps``;
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
        q = min(1.0, (step - stable_end) / decay)
        return cfg.lr * (cfg.min_lr / cfg.lr) ** q
    decay_steps = max(1, cfg.steps - cfg.warmup_steps)
    p = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * 0.5 * (1.0 + math.cos(math.pi * p))


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW with two groups: decay for params with ndim >= 2, no decay for gains.

    Uses torch's fused AdamW kernel (CPU and CUDA: one pass over each tensor, no
    temporaries; ~10x faster than foreach on CPU at 9M parameters). Tied weights appear once.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8, fused=True)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """``LambdaLR`` whose multiplier is ``lr_at(step) / lr``; its state is in the checkpoint."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_at(step, cfg) / cfg.lr)


def apply_config(optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR,
                 cfg: TrainConfig) -> None:
    """After loading saved optimiser/scheduler states, make ``cfg`` the one in effect.

    ``load_state_dict`` brings back the saved hyperparameters (the saved ``lr``, betas,
    weight decay and the scheduler's base LR); a resumed run must use its current config's
    instead. Sets each group's betas and weight decay (decay group first, as
    :func:`build_optimizer` makes them), the scheduler's base LR and each group's LR to
    ``lr_at(step)`` for the step the scheduler is at. Unchanged values give the same floats
    as an uninterrupted run.
    """
    scheduler.base_lrs = [cfg.lr for _ in optimizer.param_groups]
    for i, group in enumerate(optimizer.param_groups):
        group["betas"] = (cfg.beta1, cfg.beta2)
        group["weight_decay"] = cfg.weight_decay if i == 0 else 0.0
        group["initial_lr"] = cfg.lr
    lrs = [base * fn(scheduler.last_epoch) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = lrs
