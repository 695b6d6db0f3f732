"""Where a Triton launch goes: Triton launches on the *current* CUDA device and its current
stream, which need not be the device of the tensors (a head on ``cuda:1`` while ``cuda:0`` is
current would fault), so every launch of this package runs under :func:`on_device`."""
from __future__ import annotations

import contextlib

import torch

__all__ = ["on_device"]


def on_device(device: torch.device):
    """Context in which a Triton launch goes to ``device`` (a no-op off CUDA)."""
    if device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()
