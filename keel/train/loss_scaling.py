"""fp16 loss scaling: ``train.precision = "fp16-autocast"`` (fp32 master weights, fp16 autocast).

fp16 has 5 exponent bits: gradients below ~6e-8 flush to zero and values above 65504 overflow.
The recipe is PyTorch's automatic mixed precision ("Working with unscaled gradients" in the AMP
examples), with ``torch.amp.GradScaler`` (CPU and CUDA; ``torch.distributed.fsdp.sharded_grad_scaler.
ShardedGradScaler`` when the model is FSDP2-sharded, which all-reduces the overflow flag so that
every rank takes the same decision and keeps the same scale). One optimiser step of the trainer:

1. the loss of each micro-batch is multiplied by the scale S before its backward
   (:meth:`LossScaling.scale`), so the fp16 activation gradients stay in range;
2. the accumulated gradients (fp32, as the weights) are divided by S (:meth:`LossScaling.unscale_`)
   before anything reads them: the gradient callbacks, the clipping, and the logged ``grad_norm``
   (the norm of the true, unscaled gradient);
3. if the unscaled gradient norm, the loss or the LR is not finite (an fp16 overflow shows as an
   infinite norm) the update is skipped, as every precision skips a non-finite step
   (:class:`keel.train.trainer.Trainer`): the weights and the AdamW state do not change;
4. :meth:`LossScaling.update`: S is halved after a step with an overflow and doubled after 2000
   steps in a row without one (GradScaler's defaults: init 2**16, growth 2, backoff 0.5,
   interval 2000).

A skipped step still counts as a step: the step counter, the tokens, the data position and
the LR schedule (a pure function of the step, :func:`keel.train.optim.set_lr`) all advance, as
the scheduler of PyTorch's recipe steps whatever the scaler did; the step's batch is not trained on.
Skipped updates count towards ``train.max_bad_steps`` (in a row) like any non-finite step: the
scale halves at each one, so ten in a row mean gradients that overflow at a scale 1024x lower.

The scaler's state (scale, growth tracker, factors) and the number of skipped steps are part of
the trainer state in every checkpoint (``trainer.pt``, key ``"grad_scaler"``, plain floats and
ints: ``torch.load(weights_only=True)`` reads it), so a resumed fp16 run repeats the losses of
an uninterrupted one step for step. fp32 and bf16 runs have no scaler and write no such key.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch

FP16 = "fp16-autocast"  # the train.precision value that trains with a loss scaler
INIT_SCALE = 2.0 ** 16  # S of a run's first step (GradScaler's default)
GROWTH_INTERVAL = 2000  # clean steps in a row after which S doubles (GradScaler's default)

# GradScaler.state_dict()'s keys and what each must be (checked before a checkpoint is chosen)
_SCALER_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _is_count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def is_scaler_state(x: Any) -> bool:
    """Whether ``x`` is a :meth:`LossScaling.state_dict`: a finite scale >= 0, factors and a growth
    interval, an integer growth tracker and skipped-step count >= 0."""
    return (isinstance(x, dict) and all(_is_number(x.get(k)) for k in _SCALER_KEYS) and x["scale"] >= 0
            and _is_count(x.get("_growth_tracker")) and _is_count(x.get("growth_interval"))
            and _is_count(x.get("skipped_steps")))


class LossScaling:
    """The loss scaler of one run, or a no-op for the precisions that need none.

    Args:
        device: the device the run computes on (``cpu`` or ``cuda``: both have a GradScaler).
        precision: ``train.precision``; only ``"fp16-autocast"`` enables scaling.
        sharded: the model is FSDP2-sharded (``train.parallelism = "fsdp"`` in a process group):
            ``ShardedGradScaler``, whose :meth:`unscale_` all-reduces the overflow flag.
        init_scale: the scale of the first step (S, dimensionless); None: :data:`INIT_SCALE`.
        growth_interval: clean steps in a row before S doubles; None: :data:`GROWTH_INTERVAL`.

    ``skipped_steps`` counts the updates skipped since the run began in fp16 (any cause: an
    overflow, a non-finite loss or LR), carried over a resume.
    """

    def __init__(self, device: torch.device, precision: str, sharded: bool = False, init_scale: float | None = None,
                 growth_interval: int | None = None):
        self.enabled = precision == FP16
        self.skipped_steps = 0
        self.scaler: torch.amp.GradScaler | None = None
        if self.enabled:
            kwargs = {"init_scale": INIT_SCALE if init_scale is None else init_scale,
                      "growth_interval": GROWTH_INTERVAL if growth_interval is None else growth_interval}
            if sharded:
                # lazy: +1.3 s of import; only FSDP runs need it
                from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

                self.scaler = ShardedGradScaler(device.type, **kwargs)
            else:
                self.scaler = torch.amp.GradScaler(device.type, **kwargs)

    @property
    def scale_value(self) -> float:
        """The current scale S (1.0 when disabled)."""
        return self.scaler.get_scale() if self.scaler is not None else 1.0

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` (a scalar tensor, nats) times S, to backpropagate; ``loss`` itself when disabled."""
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the gradients of ``optimizer``'s parameters by S in place, noting whether any is
        inf/NaN (all ranks agree under FSDP). Once per step, after the last backward and before the
        gradients are read or clipped; nothing when disabled."""
        if self.scaler is not None:
            with warnings.catch_warnings():  # ShardedGradScaler's [1]-shaped overflow flag meets DTensor gradients
                warnings.filterwarnings("ignore", message="Found a non-scalar tensor with numel=1")
                self.scaler.unscale_(optimizer)

    def update(self, applied: bool) -> dict[str, Any]:
        """End the step: adjust S (halved after an overflow, doubled after ``growth_interval``
        clean steps) and count the step if its update was not ``applied``.

        Returns:
            ``{"loss_scale": S used by this step, "skipped_steps": count so far}`` for the step's
            metrics record; ``{}`` when disabled.
        """
        if self.scaler is None:
            return {}
        used = self.scaler.get_scale()
        self.scaler.update()
        self.skipped_steps += 0 if applied else 1
        return {"loss_scale": used, "skipped_steps": self.skipped_steps}

    def overflow_line(self, record: dict, in_row: int) -> str | None:
        """The log line for a skipped step (``record``: its metrics, ``in_row`` the skipped steps in a
        row) whose loss and LR are finite under loss scaling, i.e. whose fp16 gradients overflowed:
        expected now and then while the scale calibrates (an INFO line, not a warning). None for
        any other step, and when disabled."""
        if self.scaler is None or not (math.isfinite(record["loss"]) and math.isfinite(record["lr"])):
            return None
        return (f"step {record['step']}: fp16 gradients overflowed at loss scale {record['loss_scale']:g} (grad norm "
                f"{record['grad_norm']}); update skipped, loss scale now {self.scale_value:g} ({in_row} in a row)")

    def state_dict(self) -> dict[str, Any] | None:
        """GradScaler's state (``scale``, ``growth_factor``, ``backoff_factor``, ``growth_interval``,
        ``_growth_tracker``: Python floats and ints) and ``skipped_steps``; None when disabled.
        Call between steps (after :meth:`update`)."""
        if self.scaler is None:
            return None
        return {**self.scaler.state_dict(), "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` (nothing when disabled).

        Raises:
            ValueError: ``state`` is not such a state (:func:`is_scaler_state`).
        """
        if self.scaler is None:
            return
        if not is_scaler_state(state):
            raise ValueError(f"not a loss-scaler state: {state!r}"[:200])
        self.scaler.load_state_dict({k: state[k] for k in _SCALER_KEYS})
        self.skipped_steps = state["skipped_steps"]
