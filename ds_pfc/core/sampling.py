"""Positive-preserving negative sampling (paper: Eq. local_sampling).

``S_q = P_q ∪ Sample([0, C_q) \\ P_q, max(b_q - |P_q|, 0))`` with ``b_q = floor(r C_q)``.

How it is drawn: at step ``s`` every local class ``i`` gets a 62-bit key, the top
bits of output ``s C_q + i`` of a splitmix64 generator seeded with ``hash(seed,
rank)`` (:func:`class_keys`: each step reads the next ``C_q`` outputs); the
positives' keys are then overwritten with ``2**62``, above every random key, by one
indexed write (labels this rank does not own, ``-1``, write into a spare last key
that is never read). ``S_q`` is the ``k`` classes with the
largest keys, ascending, with ``k = max(b_q, |P_q|)`` (a radix select that sorts
only the boundary bucket of the keys' top 16 bits, :func:`_largest_ids`). Given the positives,
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
  device type (CPU and CUDA give identical sets), ``step`` may be a device tensor (a
  CUDA graph replay then draws the next step's set, as an eager step does), and no
  generator state is created per step.
- **Deterministic and resumable.** A pure function of ``(seed, step, rank,
  positives)``: a resumed run that restores ``step`` draws the same sets. Among
  equal keys the smaller class id is selected first: the positives all share
  ``2**62`` and are all selected (``k >= |P_q|``), and two random keys tie with
  probability below ``C_q**2 / 2**63`` per step. Without a tie at the boundary the
  set is the one ``torch.topk`` + ``torch.sort`` select. The selection sorts at most
  ``max(4096, C_q / 2048)`` keys of the boundary bucket; uniform keys exceed that with
  probability below ``2**-7000`` per step, and an excess stops the step with a
  device-side assert rather than draw another set.

Cost: O(C_q) per step on the device, where the sampler before this one cost
O(|S_q| log |S_q|) whatever ``C_q`` (it drew only ``|S_q|`` values, but
needed ``unique`` and a loop on its size: host syncs). The keys are one Triton kernel
on CUDA (8 bytes written per class; 14 elementwise int64 torch passes elsewhere). The
selection reads 22 bytes and writes 6 per class, plus 8 per selected id: the top
16-bit words of the keys as int32 buckets (8 read, the whole key's line or sector;
4 written), their histogram (4 read), the boundary bucket's mask (4 read, 1 written)
and its ``nonzero_static`` (1 read), the selection mask (4 read, 1 written) and its
``nonzero_static`` (1 read, 8 per id written), and ~30 small kernels on at most
16385 counters or ``max(4096, C_q / 2048)`` boundary keys. At ``C_q = 8M, r = 0.1``
that is ~230 MB (~50 us at an H200's 4.8 TB/s; estimated, not measured on a GPU),
where ``topk`` + sort (0.2-0.35 ms on an H200, estimated) pass over the 64 MB of
keys once per 8-bit radix digit. Scratch: ``6 C_q`` bytes besides the keys.
On one CPU thread (measured, best of 5, on a shared 2-core VM with other jobs
running, so +-30 %): the selection takes ~9 ms at ``C_q = 1M, r = 0.1`` (``topk`` +
sort: ~12 ms), ~37 ms at ``4M, r = 0.025`` (~59 ms) and ~83 ms at ``8M, r = 0.1``
(~235 ms); the whole sampler ~19 ms, ~100 ms and ~340-420 ms (~23 ms, ~110 ms and
~630 ms with ``topk`` + sort).
"""
from __future__ import annotations

import importlib.util
import math
import os
import sys

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
    return _largest_ids(keys, size)


# ----------------------------------------------------------------- the selection
_DIGIT_SHIFT = 48                                   # a key's bucket: its top 16-bit word
_NUM_BUCKETS = (POSITIVE_KEY >> _DIGIT_SHIFT) + 1   # random keys: [0, 2**14); POSITIVE_KEY: 2**14
_MIN_CAPACITY = 4096


def _bucket_capacity(num_keys: int) -> int:
    """How many keys of the boundary bucket the selection sorts: 8 times a bucket's
    mean count under uniform keys, at least 4096, at most ``num_keys`` (so up to 4096
    keys any bucket fits)."""
    mean = -(-num_keys // (_NUM_BUCKETS - 1))
    return min(num_keys, max(_MIN_CAPACITY, 8 * mean))


def _top_digit(keys: torch.Tensor) -> torch.Tensor:
    """int32 ``keys >> 48`` of the contiguous int64 ``keys``: on a little-endian layout
    (x86, ARM, CUDA) the fourth 16-bit word of each key, read without a shift."""
    if sys.byteorder == "little":
        return keys.view(torch.int16)[3::4].to(torch.int32)
    return (keys >> _DIGIT_SHIFT).to(torch.int32)


def _largest_ids(keys: torch.Tensor, size: int) -> torch.Tensor:
    """Ascending int64 ids of the ``size`` largest of the int64 ``keys`` (values in
    ``[0, POSITIVE_KEY]``); among equal keys the smaller id ranks first.

    Equal to ``torch.sort(torch.topk(keys, size).indices).values`` whenever the
    ``size``-th largest key is not tied with an unselected one (the set is then
    unique). No host sync: ``size`` is a host int, every data-dependent value (the
    boundary bucket, its counts, the ranks in it) stays on the device and every shape
    is fixed by ``size`` and ``keys.numel()``.

    A radix select on the top 16 bits that sorts the boundary bucket only:

    1. the bucket ``d = key >> 48`` of every key, and the buckets' histogram;
    2. its cumulative counts give the boundary bucket ``t`` (the one holding the
       ``size``-th largest key) and how many of its keys are selected, ``take``;
    3. ``t``'s ids (``nonzero_static``, ascending) sorted by key, descending and
       stable, so that among equal keys the smaller id comes first: all but the first
       ``take`` are cleared from the mask ``d >= t``;
    4. ``nonzero_static`` of that mask, of size ``size``: the ids, ascending.

    A boundary bucket split by the selection must hold at most
    :func:`_bucket_capacity` keys: always so for up to 4096 keys, and uniform keys
    exceed it with probability below ``2**-7000``. One that does stops the call with
    a device-side assert (a RuntimeError on CPU) rather than return another set.
    """
    if keys.dim() != 1 or keys.dtype != torch.int64:
        raise ValueError(f"keys: expected a 1-d int64 tensor, got a {keys.dim()}-d {keys.dtype} one")
    num_keys = keys.numel()
    if not isinstance(size, int) or not 0 <= size <= num_keys:
        raise ValueError(f"size: expected an int in [0, {num_keys}], got {size!r}")
    device = keys.device
    if size == 0:
        return torch.zeros(0, dtype=torch.int64, device=device)
    if size == num_keys:
        return torch.arange(num_keys, device=device)
    keys = keys.contiguous()
    digit = _top_digit(keys)
    hist = torch.zeros(_NUM_BUCKETS, dtype=torch.int64, device=device)
    hist.index_add_(0, digit, torch.ones((), dtype=torch.int64, device=device).expand(num_keys))
    count_le = hist.cumsum(0)                                   # keys in buckets <= j
    left_out = num_keys - size
    # The boundary bucket t: count_le[t - 1] <= left_out < count_le[t]. 0-d, so that the
    # int32 comparisons below stay int32; read through index_select (indexing with a
    # 0-d tensor would read it on the host).
    bound = torch.searchsorted(count_le, left_out, right=True)
    in_bound = hist.index_select(0, bound.reshape(1))
    take = count_le.index_select(0, bound.reshape(1)) - left_out     # in [1, in_bound]
    cap = _bucket_capacity(num_keys)
    torch._assert_async((in_bound <= cap) | (take == in_bound),
                        "sampler: the boundary bucket holds more keys than its capacity")
    members = torch.nonzero_static(digit == bound, size=cap, fill_value=num_keys).squeeze(1)
    member_keys = torch.where(members < num_keys, keys[members.clamp(max=num_keys - 1)], -1)  # padding last
    ranked = members[torch.sort(member_keys, descending=True, stable=True).indices]
    rank = torch.arange(cap, device=device)
    dropped = torch.where((rank >= take) & (rank < in_bound), ranked, num_keys)
    mask = torch.empty(num_keys + 1, dtype=torch.bool, device=device)   # [num_keys]: a dump slot
    torch.ge(digit, bound, out=mask[:num_keys])
    mask.index_fill_(0, dropped, False)
    return torch.nonzero_static(mask[:num_keys], size=size).squeeze(1)


def remap_labels(local_labels: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    """Local label -> column in the active set (``searchsorted``); -1 stays -1.

    Every owned label must be in ``active`` (positives always are).
    """
    cols = torch.searchsorted(active, local_labels.clamp_min(0))
    return torch.where(local_labels >= 0, cols, torch.full_like(cols, -1))
