"""The sampler's class keys (:func:`ds_pfc.core.sampling.class_keys`) in one Triton kernel.

The torch form is 14 elementwise int64 passes over the rank's ``C_q`` classes; this kernel
reads the step from the device and writes each key once (8 bytes per class). Bit for bit the
same keys: splitmix64's output function on ``base + (step C_q + i + 1) gamma`` (mod 2**64),
top 62 bits. Importing this module imports triton.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._device import on_device

__all__ = ["class_keys_"]

_BLOCK = 1024


@triton.jit(do_not_specialize=["num_local", "total"])
def _keys_kernel(out_ptr, step_ptr, num_local, total, base_plus_gamma, gamma, mul1, mul2, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < total
    step = tl.load(step_ptr).to(tl.uint64, bitcast=True)
    j = step * num_local.to(tl.uint64) + i.to(tl.uint64)
    z = j * gamma.to(tl.uint64, bitcast=True) + base_plus_gamma.to(tl.uint64, bitcast=True)
    z = z ^ (z >> 30)
    z = z * mul1.to(tl.uint64, bitcast=True)
    z = z ^ (z >> 27)
    z = z * mul2.to(tl.uint64, bitcast=True)
    z = z ^ (z >> 31)
    tl.store(out_ptr + i, (z >> 2).to(tl.int64, bitcast=True), mask=ok)


def class_keys_(out: torch.Tensor, step: torch.Tensor, num_local: int, base_plus_gamma: int, gamma: int,
                mul1: int, mul2: int) -> torch.Tensor:
    """Fill int64 ``out`` with the keys of classes ``0 .. len(out) - 1`` at the device step
    ``step`` (0-d int64); the constants are int64 bit patterns (see ds_pfc.core.sampling)."""
    total = out.numel()
    if total:
        with on_device(out.device):
            _keys_kernel[(triton.cdiv(total, _BLOCK),)](out, step, num_local, total, base_plus_gamma, gamma,
                                                         mul1, mul2, BLOCK=_BLOCK, num_warps=4)
    return out
