"""Seeded random streams: a splitmix64 hash of ``(seed, *keys)`` seeds a torch generator,
so equal inputs give equal streams on every rank and after a restart. Used by the
class sampler (ds_pfc.core.sampling) and the class banks' initial centers (ds_pfc.bank)."""
from __future__ import annotations

import torch

__all__ = ["generator_for"]

_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15
_MUL1, _MUL2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _splitmix64(value: int) -> int:
    value = (value + _GAMMA) & _MASK64
    value = ((value ^ (value >> 30)) * _MUL1) & _MASK64
    value = ((value ^ (value >> 27)) * _MUL2) & _MASK64
    return value ^ (value >> 31)


def _signed(value: int) -> int:
    """The int64 with the bit pattern of the uint64 ``value``."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def generator_for(seed: int, *keys: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator seeded from a hash of ``(seed, *keys)``; equal inputs give equal streams."""
    gen = torch.Generator(device=device)
    gen.manual_seed(_chain(seed, *keys) >> 1)  # manual_seed wants a value < 2**63
    return gen


def _chain(seed: int, *keys: int) -> int:
    state = _splitmix64(int(seed) & _MASK64)
    for key in keys:
        state = _splitmix64(state ^ (int(key) & _MASK64))
    return state
