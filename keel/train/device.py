"""Devices and precision: which device a run computes on and whether it autocasts to bf16."""

from __future__ import annotations

import contextlib

import torch

from keel.config import TrainConfig, choices
from keel.errors import KeelError

PRECISIONS = choices(TrainConfig, "precision")  # declared once, in keel.config.TrainConfig


def resolve_device(spec: str, key: str = "train.device") -> torch.device:
    """``auto`` -> cuda if available else cpu; otherwise ``torch.device(spec)``.

    Args:
        spec: "auto" | "cpu" | "cuda" | "cuda:N".
        key: how the user gave ``spec`` (a config key or a CLI flag), for the error message.
    Raises:
        KeelError: an unknown device string, or cuda without a CUDA device.
    """
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise KeelError(f"unknown {key} {spec!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise KeelError(f"{key} is cuda but no CUDA device is available")
    return device


def autocast_context(device: torch.device, precision: str):
    """bf16 autocast on CUDA ("auto" or "bf16"), fp32 elsewhere ("auto" or "fp32").

    Raises:
        KeelError: ``precision`` not in :data:`PRECISIONS`.
    """
    if precision not in PRECISIONS:
        raise KeelError(f"train.precision must be auto, fp32 or bf16, got {precision!r}")
    use_bf16 = precision == "bf16" or (precision == "auto" and device.type == "cuda")
    if not use_bf16:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
