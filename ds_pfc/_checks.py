"""Argument checks shared by the functional and module entry points.

Each raises ``TypeError``/``ValueError`` naming the argument, the expected and the
actual value, before anything is changed.
"""
from __future__ import annotations

import math

import torch

_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def check_embeddings(embeddings, embedding_size: int | None = None, name: str = "embeddings") -> None:
    if not isinstance(embeddings, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(embeddings).__name__}")
    if not embeddings.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {embeddings.dtype}")
    if embeddings.dim() != 2:
        raise ValueError(f"{name} must have shape [N, d], got shape {tuple(embeddings.shape)}")
    if embedding_size is not None and embeddings.shape[1] != embedding_size:
        raise ValueError(f"{name} must have {embedding_size} columns (embedding_size), "
                         f"got shape {tuple(embeddings.shape)}")


def check_labels(labels, num_rows: int, name: str = "labels") -> None:
    if not isinstance(labels, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(labels).__name__}")
    if labels.dtype not in _INT_DTYPES:
        raise TypeError(f"{name} must be an integer tensor, got dtype {labels.dtype}")
    if labels.dim() != 1 or labels.shape[0] != num_rows:
        raise ValueError(f"{name} must have shape [{num_rows}] (one per embedding), "
                         f"got shape {tuple(labels.shape)}")


def check_values(embeddings: torch.Tensor, labels: torch.Tensor, num_classes: int | None,
                 names=("embeddings", "labels")) -> None:
    """NaN/Inf embeddings and out-of-range labels, in one host sync."""
    if embeddings.numel() == 0:
        return
    probe = torch.stack([
        (~torch.isfinite(embeddings)).any().to(torch.float64),
        labels.min().to(torch.float64),
        labels.max().to(torch.float64),
    ]).tolist()
    if probe[0]:
        raise ValueError(f"{names[0]} contain NaN or Inf values")
    upper = "num_classes" if num_classes is None else num_classes
    if probe[1] < 0 or (num_classes is not None and probe[2] >= num_classes):
        raise ValueError(f"{names[1]} must lie in [0, {upper}), got values in "
                         f"[{int(probe[1])}, {int(probe[2])}]")


def check_int(name: str, value, minimum: int) -> int:
    """An int (not a bool) >= ``minimum``; returns it."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_number(name: str, value, low: float = 0.0, high: float | None = None, high_open: bool = False) -> float:
    """A finite number (not a bool) in ``[low, high]`` (``[low, high)`` with
    ``high_open``; no upper bound without ``high``); returns it as a float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TypeError(f"{name} must be a finite number, got {value!r}")
    if value < low or (high is not None and (value > high or (high_open and value == high))):
        bound = f"in [{low}, {high}{')' if high_open else ']'}" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be {bound}, got {value}")
    return float(value)
