"""Activation checkpointing of backbone blocks (``checkpoint_blocks=True``).

Each block (an IResNet basic block, a MobileFaceNet layer, a transformer block) runs
under ``torch.utils.checkpoint`` (non-reentrant) in training: its inner activations are
dropped after the forward pass and recomputed during backward, which trades one more
forward of the blocks for activation memory. Nothing changes in eval or without grad.

The recomputation must not be a second training step for the BatchNorm layers: a
plain recompute would update their running statistics (and ``num_batches_tracked``)
twice per step. While a block is recomputed, :func:`recomputing` is true and the
BatchNorm layers of :mod:`ds_pfc.models.norm` normalise with the batch statistics, as
in the first pass, without touching the running ones. Random masks (dropout, stochastic
depth) are replayed from the saved RNG state, so the recomputed block is the same
function and the gradients equal those of the plain run.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["run_blocks", "recomputing", "check_checkpoint_blocks"]

_STATE = threading.local()


def recomputing() -> bool:
    """True while a checkpointed block is being recomputed for backward (this thread)."""
    return getattr(_STATE, "recomputing", False)


@contextlib.contextmanager
def _recompute():
    previous = recomputing()
    _STATE.recomputing = True
    try:
        yield
    finally:
        _STATE.recomputing = previous


def _contexts():
    return contextlib.nullcontext(), _recompute()


def check_checkpoint_blocks(value) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"checkpoint_blocks must be true or false, got {value!r}")
    return value


def run_blocks(blocks: Iterable[nn.Module], x: torch.Tensor, *, checkpointed: bool, training: bool) -> torch.Tensor:
    """``x`` through ``blocks`` in order, each checkpointed when ``checkpointed`` and
    ``training`` and autograd is recording."""
    if not (checkpointed and training and torch.is_grad_enabled()):
        for block in blocks:
            x = block(x)
        return x
    for block in blocks:
        x = checkpoint(block, x, use_reentrant=False, context_fn=_contexts)
    return x
