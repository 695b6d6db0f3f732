"""Positive-preserving negative sampling (paper: Eq. local_sampling).

``S_q = P_q ∪ Sample([0, C_q) \\ P_q, max(b_q - |P_q|, 0))`` with ``b_q = floor(r C_q)``.

How it is drawn: at step ``s`` every local class ``i`` gets a 62-bit key, the top
bits of output ``s C_q + i`` of a splitmix64 generator seeded with ``hash(seed,
rank)`` (:func:`class_keys`: each step reads the next ``C_q`` outputs); the
positives' keys are then overwritten with ``2**62``, above every random key, by one
indexed write (labels this rank does not own, ``-1``, write into a spare last key
that is never read). ``S_q`` is the ``k`` classes with the
largest keys (``topk``), sorted, with ``k = max(b_q, |P_q|)``. Given the positives,
the negatives' keys are i.i.d. uniform, so the ``k - |P_q|`` largest of them are a
uniform ``(k - |P_q|)``-subset of the negatives: exactly the paper's distribution.

Why this form:

- **Fixed size, no host sync.** ``|P_q|`` is only known on the device, but whenever
  ``b_q >= N`` (``N`` = the number of label entries, at least ``|P_q|``) the set has
  exactly ``b_q`` members, a size the host knows: no boolean-mask indexing, no
  ``unique``, no loop on a device value. For ``b_q < N`` (tiny classifiers or tiny
  rates: a step's positives may exceed the budget) the size ``max(b_q, |P_q|)`` is
  read back from the device, one host sync, and the same keys decide the set.
- **Counter-based.** The keys are a hash of ``(seed, step, rank, class)`` computed
  with int64 tensor ops, not a ``torch.Generator``: the draw is the same on every
  device type (CPU and CUDA give identical sets, ties aside), ``step`` may be a device tensor (a
  CUDA graph replay then draws the next step's set, as an eager step does), and no
  generator state is created per step.
- **Deterministic and resumable.** A pure function of ``(seed, step, rank,
  positives)``: a resumed run that restores ``step`` draws the same sets. Two random
  keys tie with probability below ``C_q**2 / 2**63`` per step; ``topk`` breaks ties
  by its own fixed rule.

Cost: O(C_q) per step on the device, where the sampler before this one cost
O(|S_q| log |S_q|) whatever ``C_q`` (it drew only ``|S_q|`` values, but needed
``unique`` and a loop on its size: host syncs). The keys are 14 elementwise int64
passes over ``C_q`` (written so that one fused kernel could replace them), then one
``topk(b_q)`` of ``C_q`` keys and a sort of ``b_q`` indices; scratch about ``16 C_q``
bytes. Estimated, not measured, at ``C_q = 8M`` on an H100: ~2 GB of memory traffic
for the keys (~0.7 ms at 3.35 TB/s) plus a ``topk`` over 64 MB of keys (a radix
select, or a radix sort where PyTorch sorts large single slices), ~1-3 ms in all,
against ~4 ms for the step's ``6 N d b_q`` GEMM FLOPs at ``N = 1024, d = 512, r =
0.1`` in bf16; both grow linearly in ``C_q``, so the ratio holds at every size. On one
CPU thread (measured, best of 5 on a shared 2-core VM): ~30 ms at ``C_q = 1M, r =
0.1`` (~19 ms before), ~150 ms at ``4M, r = 0.025`` (~15 ms before), ~0.55 s at
``8M, r = 0.1`` (~0.2 s before).
"""
from __future__ import annotations

import importlib.util
import math
import os

import torch

__all__ = ["activation_budget", "sample_active", "remap_labels", "generator_for", "class_keys",
           "POSITIVE_KEY"]

from .._rng import _GAMMA, _MASK64, _MUL1, _MUL2, _chain, _signed, _splitmix64, generator_for  # noqa: F401

POSITIVE_KEY = 1 << 62      # every random key lies in [0, 2**62)


# ----------------------------------------------------------------- int64 tensor hash
def _shr(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of the uint64 bit patterns held in int64 ``z`` (a new tensor)."""
    out = z >> bits
    out &= (1 << (64 - bits)) - 1
    return out


def _mix_(z: torch.Tensor) -> torch.Tensor:
    """In place: splitmix64's output function on int64 ``z`` (wrapping arithmetic is
    arithmetic mod 2**64, so the bit patterns equal the uint64 computation's)."""
    z ^= _shr(z, 30)
    z *= _signed(_MUL1)
    z ^= _shr(z, 27)
    z *= _signed(_MUL2)
    z ^= _shr(z, 31)
    return z


def _keys_kernel_usable(device: torch.device) -> bool:
    """The one-pass Triton kernel for the keys: on CUDA when triton imports, and on a CPU
    while a GPU step is counted in Triton's interpreter (ds_pfc.bench.model)."""
    if importlib.util.find_spec("triton") is None:
        return False
    if device.type == "cuda":
        return True
    from ..kernels import _target
    return device.type == "cpu" and _target.active() and os.environ.get("TRITON_INTERPRET") == "1"


def class_keys(num_local: int, seed: int, step, rank: int, device=None, spare: int = 0) -> torch.Tensor:
    """int64 keys ``[num_local + spare]`` in ``[0, 2**62)`` of step ``step``: key ``i`` is
    the top 62 bits of output ``j = step * num_local + i`` of the splitmix64 generator
    seeded with ``hash(seed, rank)``, i.e. ``splitmix64(base + j γ) >> 2``. Each rank
    has its own stream and each step the next ``num_local`` outputs of it.

    ``step``: an int, or a 0-d integer tensor (no host sync: a CUDA graph can capture
    it and a replay reads the step the device holds then)."""
    base = _chain(seed, rank)
    if _keys_kernel_usable(torch.device(device) if device is not None else torch.device("cpu")):
        # One pass (ds_pfc.kernels.triton_keys), the same bits as the torch ops below.
        from ..kernels.triton_keys import class_keys_
        out = torch.empty(num_local + spare, dtype=torch.int64, device=device)
        if isinstance(step, torch.Tensor):
            step_t = step.to(device=device, dtype=torch.int64).reshape(())
        else:
            step_t = torch.full((), _signed(int(step)), dtype=torch.int64, device=device)
        return class_keys_(out, step_t, num_local, _signed(base + _GAMMA), _signed(_GAMMA), _signed(_MUL1),
                           _signed(_MUL2))
    z = torch.arange(num_local + spare, dtype=torch.int64, device=device)
    if isinstance(step, torch.Tensor):
        z += step.to(device=device, dtype=torch.int64) * num_local
    else:
        z += _signed(int(step) * num_local)
    z *= _signed(_GAMMA)
    z += _signed(base + _GAMMA)
    z = _mix_(z)
    z >>= 2
    z &= (1 << 62) - 1
    return z


# ----------------------------------------------------------------- the sampler
def activation_budget(num_local: int, sample_rate: float) -> int:
    """``b_q = floor(r * C_q)`` (a 1e-9 slack absorbs binary rounding of ``r``)."""
    return min(num_local, math.floor(sample_rate * num_local + 1e-9))


def sample_active(
    labels: torch.Tensor,
    num_local: int,
    sample_rate: float,
    *,
    seed: int,
    step,
    rank: int,
) -> torch.Tensor:
    """The sorted active set ``S_q`` (local ids, int64) of one rank for one step.

    ``labels``: local ids of the positives, in any order and with repeats; ``-1``
    marks a label another rank owns (the gathered labels through
    :meth:`~ds_pfc.core.partition.Partition.to_local` qualify as they are). ``step``: an
    int or a 0-d integer tensor (same draw). Every positive is active, negatives are
    uniform without replacement, ``|S_q| = max(floor(r C_q), |P_q|)``. With ``r = 1``
    every class is active and nothing is drawn.

    Host syncs: none when ``floor(r C_q) >= labels.numel()`` (the size is then
    ``floor(r C_q)`` whatever the positives); one otherwise (the size depends on
    ``|P_q|``).
    """
    device = labels.device
    if sample_rate >= 1.0:
        return torch.arange(num_local, device=device)
    budget = activation_budget(num_local, sample_rate)
    if isinstance(step, torch.Tensor):
        step = step.to(device)
    # A spare key at index num_local takes the writes of labels this rank does not own.
    keys = class_keys(num_local, seed, step, rank, device, spare=1)
    owned = labels.reshape(-1).long()
    owned = torch.where(owned >= 0, owned, torch.full_like(owned, num_local))
    keys.index_fill_(0, owned, POSITIVE_KEY)
    keys = keys[:num_local]
    size = budget
    if budget < owned.numel():       # |P_q| may exceed the budget: the size needs the device
        size = max(budget, int((keys == POSITIVE_KEY).sum()))
    if size == 0:
        return torch.zeros(0, dtype=torch.int64, device=device)
    chosen = torch.topk(keys, size, sorted=False).indices
    return torch.sort(chosen).values


def remap_labels(local_labels: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    """Local label -> column in the active set (``searchsorted``); -1 stays -1.

    Every owned label must be in ``active`` (positives always are).
    """
    cols = torch.searchsorted(active, local_labels.clamp_min(0))
    return torch.where(local_labels >= 0, cols, torch.full_like(cols, -1))
