"""Optimiser and learning-rate schedule of the paper's recipe (Keel paper, Sec. 5 / App.).

AdamW, betas (0.9, 0.95), weight decay 0.01 on weight matrices and embeddings (every
parameter with >= 2 dims), none on RMSNorm gains; linear warm-up then cosine decay.
"""

from __future__ import annotations

import math

import torch

from keel.config import TrainConfig


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate (absolute) used for optimiser step ``step`` (0-based).

    Warm-up: ``lr * (step + 1) / warmup_steps`` for step < warmup_steps (linear from
    lr/warmup_steps, so the first step is not wasted at 0). Then cosine decay from ``lr``
    to ``min_lr`` over the remaining steps:
    ``min_lr + (lr - min_lr) * 0.5 * (1 + cos(pi * p))`` with p = (step - warmup) / (steps - warmup).
    """
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
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
