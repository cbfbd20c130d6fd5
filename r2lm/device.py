"""Which torch device a command may use: a name the user gave, checked against this machine."""

from __future__ import annotations

import torch


def device_available(device: torch.device) -> bool:
    """Whether this machine has `device` (cuda:N, mps); other kinds have no common probe: using them will tell."""
    if device.type == "cuda":
        return torch.cuda.is_available() and (device.index or 0) < torch.cuda.device_count()
    if device.type == "mps":
        return torch.backends.mps.is_available()
    return True


def resolve_device(name: str | None) -> torch.device:
    """`name` (default: cuda when available, else cpu) as a device this machine has; ValueError naming it otherwise."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise ValueError(f"device {name!r}: {err}") from None
    if not device_available(device):
        raise ValueError(f"device {name!r}: this machine has none (CUDA devices: {torch.cuda.device_count()})")
    return device
