"""The one loss evaluator: summed next-token negative log-likelihood over token windows.

Training validation (``val_loss``), ``keel eval`` (perplexity, bits per byte), ``keel
ablate`` (ΔPPL) and the experiment commands all score text through :func:`summed_nll`, on
windows cut by :func:`keel.data.split_windows`, so their numbers agree exactly. The trainer's
windows per validation pass: :func:`eval_batch_size`; a loss as a perplexity: :func:`perplexity`.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from keel.model import Transformer
from keel.train.dist import DistInfo, all_reduce_sum

LogitsFn = Callable[[torch.Tensor], torch.Tensor]

# Largest loss whose perplexity is printed as a number; beyond it exp(loss) is reported as inf.
MAX_PPL_LOSS = 50.0


def perplexity(loss: float | None) -> float:
    """``exp(loss)``; ``inf`` for a loss above :data:`MAX_PPL_LOSS` (50 nats: a perplexity
    of 5e21, far beyond any vocabulary, so a blown-up run prints ``inf`` rather than an
    87-digit number) and for a non-finite or missing loss."""
    if loss is None or not math.isfinite(loss) or loss > MAX_PPL_LOSS:
        return math.inf
    return math.exp(loss)


def eval_batch_size(batch_size: int, seq_len: int, min_tokens: int) -> int:
    """Windows per validation forward pass on each process: the training micro-batch
    (``batch_size`` windows of ``seq_len`` predicted tokens), or, when it predicts fewer than
    ``min_tokens`` (``train.eval_batch_tokens``), as many whole windows as ``min_tokens``
    fill. One window per pass made a ``seq_len=1, batch_size=1`` run validate 65,536 windows
    in as many forward passes; a micro-batch of ``min_tokens`` or more is kept as it is, so
    an ordinary config's ``val_loss`` is computed exactly as before."""
    return max(batch_size, min_tokens // seq_len)


def _groups(windows: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Windows grouped by length, each group stacked [n, T+1]; ascending lengths."""
    if isinstance(windows, torch.Tensor):
        return [windows] if windows.shape[0] else []
    by_len: dict[int, list[torch.Tensor]] = {}
    for w in windows:
        by_len.setdefault(int(w.shape[0]), []).append(w)
    return [torch.stack(by_len[n]) for n in sorted(by_len)]


@torch.no_grad()
def summed_nll(model: torch.nn.Module | LogitsFn, windows: torch.Tensor | Sequence[torch.Tensor],
               batch_size: int, device: torch.device | str, amp=None,
               dist: DistInfo | None = None) -> tuple[float, int]:
    """Summed next-token cross-entropy (nats) over ``windows`` and the number of predicted tokens.

    Args:
        model: a module or function mapping input ids [B, T] (int64) to logits [B, T, V], or a
            keel ``Transformer``, scored through its chunked loss (no [B, T, V] logits); an
            ``nn.Module`` is put in eval mode for the call and restored afterwards.
        windows: LongTensor [N, T+1], or a sequence of 1-D LongTensors (lengths >= 2, may
            differ; equal lengths are batched together). Each window predicts its tokens
            1.. from the ones before (inputs ``w[:-1]``, targets ``w[1:]``).
        batch_size: windows per forward pass on each process.
        device: where the ids go (the model must already be there).
        amp: an autocast context (default none).
        dist: with a process group, rank r scores windows r, r + world, ... of each length
            group and the sums are all-reduced, so every rank returns the totals over all
            windows. Every rank runs the same number of forward passes (a rank with no
            window left scores one with weight 0), as FSDP's all-gathers require.
    Returns:
        (total nats, accumulated in float64; number of predicted tokens).
    """
    dist = dist or DistInfo(device=torch.device(device))
    ws = dist.world_size if dist.distributed else 1
    module = model if isinstance(model, torch.nn.Module) else None
    was_training = module.training if module is not None else False
    if module is not None:
        module.eval()
    total = torch.zeros(2, dtype=torch.float64)
    try:
        for group in _groups(windows):
            mine = group[dist.rank::ws] if ws > 1 else group
            for i in range(-(-group.shape[0] // (ws * batch_size))):  # same count on every rank
                batch, weight = mine[i * batch_size:(i + 1) * batch_size], 1.0
                if batch.shape[0] == 0:
                    batch, weight = group[:1], 0.0
                total += weight * _batch_nll(model, batch.to(device), amp)
    finally:
        if module is not None:
            module.train(was_training)
    total = all_reduce_sum(total, dist)
    return float(total[0]), int(total[1])


def _batch_nll(model, batch: torch.Tensor, amp) -> torch.Tensor:
    """[summed nats, predicted tokens] of one batch [B, T+1], float64.

    A keel :class:`~keel.model.Transformer` (also sharded by FSDP2) is asked for its loss
    (``model(ids, targets)``: the chunked LM head + cross-entropy, so the fp32 [B, T, V]
    logits and their log-softmax never exist); its mean times the token count is the sum.
    Any other model or function gives logits, scored with ``F.cross_entropy``.
    """
    targets = batch[:, 1:]
    with amp if amp is not None else contextlib.nullcontext():
        if isinstance(model, Transformer):
            nll = model(batch[:, :-1], targets).double() * targets.numel()
        else:
            logits = model(batch[:, :-1])
            nll = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                  reduction="sum")
    return torch.tensor([float(nll.double()), targets.numel()], dtype=torch.float64)


def mean_nll(model: torch.nn.Module | LogitsFn, windows: torch.Tensor | Sequence[torch.Tensor], batch_size: int,
             device: torch.device | str, amp=None, dist: DistInfo | None = None) -> float:
    """Mean next-token cross-entropy in nats per token: :func:`summed_nll`'s total / count."""
    nats, n = summed_nll(model, windows, batch_size, device, amp, dist)
    return nats / n
