"""Positive-preserving negative sampling (paper: Eq. local_sampling).

``S_q = P_q ∪ Sample([0, C_q) \\ P_q, max(b_q - |P_q|, 0))`` with ``b_q = floor(r C_q)``.

The draw is a pure function of ``(seed, step, rank, positives)``: a resumed run that
restores ``step`` samples exactly the same sets. Its cost is O(|S_q| log |S_q|) and
does not grow with ``C_q``: negatives are drawn in a compressed index space of size
``C_q - |P_q|`` (never materialised) and mapped to class ids by a binary search over
the positives.
"""
from __future__ import annotations

import math

import torch

__all__ = ["activation_budget", "sample_active", "remap_labels", "generator_for"]

_MASK64 = (1 << 64) - 1


def _splitmix64(value: int) -> int:
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def generator_for(seed: int, *keys: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator seeded from a hash of ``(seed, *keys)``; equal inputs give equal streams."""
    state = _splitmix64(int(seed) & _MASK64)
    for key in keys:
        state = _splitmix64(state ^ (int(key) & _MASK64))
    gen = torch.Generator(device=device)
    gen.manual_seed(state >> 1)  # manual_seed wants a value < 2**63
    return gen


def activation_budget(num_local: int, sample_rate: float) -> int:
    """``b_q = floor(r * C_q)`` (a 1e-9 slack absorbs binary rounding of ``r``)."""
    return min(num_local, math.floor(sample_rate * num_local + 1e-9))


def _distinct_uniform(num_draw: int, space: int, gen: torch.Generator, device) -> torch.Tensor:
    """``num_draw`` distinct values, uniform without replacement, from ``[0, space)``.

    Dense regime (``num_draw >= space / 4``): a prefix of a permutation, O(space) =
    O(num_draw). Sparse regime: oversampled i.i.d. draws, deduplicated, then a random
    ``num_draw``-subset of the distinct values. Conditioned on its size the distinct set
    of i.i.d. uniform draws is a uniform random subset (the law is invariant under any
    relabelling of ``[0, space)``), so the result is uniform too.
    """
    if 4 * num_draw >= space:
        return torch.randperm(space, generator=gen, device=device)[:num_draw]
    draws = torch.randint(0, space, (num_draw + num_draw // 4 + 32,), generator=gen, device=device)
    distinct = torch.unique(draws)
    while distinct.numel() < num_draw:
        more = torch.randint(0, space, (num_draw - distinct.numel() + 32,), generator=gen, device=device)
        distinct = torch.unique(torch.cat([distinct, more]))
    if distinct.numel() > num_draw:
        distinct = distinct[torch.randperm(distinct.numel(), generator=gen, device=device)[:num_draw]]
    return distinct


def sample_active(
    positives: torch.Tensor,
    num_local: int,
    sample_rate: float,
    *,
    seed: int,
    step: int,
    rank: int,
) -> torch.Tensor:
    """The sorted active set ``S_q`` (local ids, int64) of one rank for one step.

    ``positives`` must be the sorted unique local ids of the positives this rank owns
    (``torch.unique`` output). Every positive is active, negatives are uniform without
    replacement, ``|S_q| = max(floor(r C_q), |P_q|)``. With ``r = 1`` no sampling work
    is done.
    """
    device = positives.device
    if sample_rate >= 1.0:
        return torch.arange(num_local, device=device)
    num_pos = positives.numel()
    num_neg = activation_budget(num_local, sample_rate) - num_pos
    if num_neg <= 0:
        return positives.long()
    gen = generator_for(seed, step, rank, device=device)
    slots = _distinct_uniform(num_neg, num_local - num_pos, gen, device)
    # The i-th negative class id is i + #{positives p : p - rank(p) <= i}.
    shifted = positives.long() - torch.arange(num_pos, device=device)
    negatives = slots + torch.searchsorted(shifted, slots, right=True)
    return torch.sort(torch.cat([positives.long(), negatives])).values


def remap_labels(local_labels: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    """Local label -> column in the active set (``searchsorted``); -1 stays -1.

    Every owned label must be in ``active`` (positives always are).
    """
    cols = torch.searchsorted(active, local_labels.clamp_min(0))
    return torch.where(local_labels >= 0, cols, torch.full_like(cols, -1))
