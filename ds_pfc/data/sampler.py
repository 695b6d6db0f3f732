"""Distributed sampler whose every epoch is a pure function of ``(seed, epoch)``.

Insightface's arcface_torch sampler broadcasts a seed from rank 0 and pads by
repetition. Here each rank builds the same permutation from a generator seeded by
``(seed, epoch)`` alone, so no communication is needed, and takes a strided shard of
it in blocks: with ``block_size = b`` the permutation is cut into blocks of ``b`` and
rank ``q`` takes blocks ``q, q + W, q + 2W, ..``. With ``b`` = the micro batch, the
``k``-th micro batch of rank ``q`` is block ``k W + q`` of the epoch, so the global
composition of every micro batch depends on ``W x gradient accumulation`` only: one
rank accumulating 2 micro batches sees exactly the batches two ranks see in one step
(BatchNorm statistics included). The position inside the epoch is explicit state
(``consumed``) so a run stopped mid-epoch resumes with exactly the remaining indices.

A resume with another number of ranks, block size or ``drop_last`` (any step, mid-epoch
included) keeps the position in samples: the ranks always consume a prefix of the
epoch's order (``position`` samples), and the new ranks split the rest of the order
in blocks from there (``start``). Over the epoch every sample is then seen exactly
once, except a tail shorter than one ``world_size x block_size`` of the ranks that
finish the epoch (``drop_last=True``; ``False`` pads that tail from the order's start).
"""
from __future__ import annotations

import hashlib
import math
from typing import Iterator

import torch
from torch.utils.data import Sampler

from .._checks import check_int

__all__ = ["DistributedIdentitySampler", "epoch_seed"]


def epoch_seed(seed: int, epoch: int) -> int:
    """64-bit generator seed for ``(seed, epoch)``. Hashed rather than ``seed + epoch``
    (torch's DistributedSampler) so that ``(0, 1)`` and ``(1, 0)`` differ; blake2b, not
    Python's ``hash``, so it is the same in every process."""
    digest = hashlib.blake2b(f"{seed}:{epoch}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class DistributedIdentitySampler(Sampler[int]):
    """Indices of this rank's shard of a per-epoch permutation of ``range(num_samples)``.

    - Every rank draws the same permutation (``shuffle``) or uses ``arange`` and takes
      blocks ``rank, rank + world_size, ..`` of ``block_size`` indices (``block_size=1``:
      ``perm[rank::world_size]``); shards are disjoint and of equal size.
    - ``drop_last=True`` trims the permutation to a multiple of ``world_size *
      block_size`` (the trimmed samples change every epoch); ``False`` pads it by
      wrapping around to its start, so a few samples appear twice in the epoch.
    - ``consumed`` counts samples of the current epoch this rank has already trained
      on. The training loop advances it (:meth:`advance`) after each step: the sampler
      cannot count for itself, because a DataLoader draws indices ahead of training
      (prefetch), so the number yielded overstates what was consumed.
    - ``start``: samples of the epoch's order that earlier ranks (of a run resumed
      here with another world size or block size) consumed before this split began;
      the shards split ``perm[start:]``. 0 except after such a resume, and reset to 0
      by the next epoch.
    - ``__iter__`` yields the epoch's shard from position ``consumed``; ``__len__`` is
      that remaining count.
    """

    def __init__(self, num_samples: int, *, rank: int, world_size: int, seed: int = 0,
                 shuffle: bool = True, drop_last: bool = True, block_size: int = 1):
        self.num_samples = check_int("num_samples", num_samples, 0)
        self.world_size = check_int("world_size", world_size, 1)
        self.rank = check_int("rank", rank, 0)
        if rank >= world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {type(seed).__name__} {seed!r}")
        self.seed = seed
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
        self.block_size = check_int("block_size", block_size, 1)
        unit = world_size * self.block_size
        if drop_last and num_samples < unit:
            raise ValueError(f"num_samples={num_samples} < world_size x block_size={unit} with drop_last=True "
                             f"leaves every rank empty; use drop_last=False, fewer ranks or smaller blocks")
        if not drop_last and num_samples == 0:
            raise ValueError("num_samples=0 cannot be padded to world_size with drop_last=False")
        self.epoch = 0
        self.start = 0
        self.consumed = 0

    # -- geometry of the current split ------------------------------------------------
    def _blocks_per_rank(self, start: int) -> int:
        rest = max(self.num_samples - start, 0)
        unit = self.world_size * self.block_size
        return rest // unit if self.drop_last else math.ceil(rest / unit)

    @property
    def num_per_rank(self) -> int:
        """Samples of this rank's shard of the current epoch (from ``start``)."""
        return self._blocks_per_rank(self.start) * self.block_size

    @property
    def total_size(self) -> int:
        """Samples all ranks take from ``start`` on in the current epoch."""
        return self.num_per_rank * self.world_size

    @property
    def position(self) -> int:
        """Samples of the current epoch's order all ranks together have consumed (a
        prefix of :meth:`epoch_permutation`) when every rank consumed ``consumed``
        (whole blocks: the ranks advance in step)."""
        if self.consumed % self.block_size:
            raise ValueError(f"consumed={self.consumed} is not a whole number of blocks of {self.block_size}: the "
                             "samples consumed are not a prefix of the epoch's order")
        return self.start + self.consumed * self.world_size

    # -- epoch position ------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Select the epoch. Moving to another epoch resets ``consumed`` (and ``start``)
        to 0; setting the current one again keeps them, so ``load_state_dict``
        followed by the usual ``set_epoch(epoch)`` at the top of the epoch loop still
        resumes mid-epoch."""
        check_int("epoch", epoch, 0)
        if epoch != self.epoch:
            self.epoch = epoch
            self.start = 0
            self.consumed = 0

    def advance(self, num: int) -> None:
        """Record that this rank trained on ``num`` more samples of the current epoch."""
        check_int("num", num, 0)
        if self.consumed + num > self.num_per_rank:
            raise ValueError(f"advance({num}) past the end of the epoch: consumed={self.consumed}, "
                             f"num_per_rank={self.num_per_rank}")
        self.consumed += num

    # -- indices ---------------------------------------------------------------------
    def epoch_permutation(self, epoch: int | None = None) -> torch.Tensor:
        """The int64 order of ``epoch`` as the ranks walk it, identical on all ranks:
        the permutation up to ``start`` (the current epoch only), then the ``total_size``
        samples the ranks split (trimmed, or padded by wrapping around)."""
        epoch = self.epoch if epoch is None else check_int("epoch", epoch, 0)
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(epoch_seed(self.seed, epoch))
            perm = torch.randperm(self.num_samples, generator=g)
        else:
            perm = torch.arange(self.num_samples)
        start = self.start if epoch == self.epoch else 0
        size = start + self._blocks_per_rank(start) * self.block_size * self.world_size
        if size <= self.num_samples:
            return perm[:size]
        return perm[torch.arange(size) % self.num_samples]

    def shard(self, epoch: int | None = None) -> torch.Tensor:
        """This rank's whole shard of ``epoch`` from ``start`` (ignores ``consumed``)."""
        epoch = self.epoch if epoch is None else check_int("epoch", epoch, 0)
        start = self.start if epoch == self.epoch else 0
        perm = self.epoch_permutation(epoch)[start:].view(-1, self.block_size)
        return perm[self.rank:: self.world_size].reshape(-1)

    def __iter__(self) -> Iterator[int]:
        return iter(self.shard()[self.consumed:].tolist())

    def __len__(self) -> int:
        return self.num_per_rank - self.consumed

    # -- checkpoint --------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "start": self.start, "consumed": self.consumed,
                "num_samples": self.num_samples, "world_size": self.world_size, "seed": self.seed,
                "shuffle": self.shuffle, "drop_last": self.drop_last, "block_size": self.block_size}

    def load_state_dict(self, state: dict) -> None:
        """Restore the epoch and the position in it. The permutation must be the same
        one, so ``num_samples``, ``seed`` and ``shuffle`` must match.

        Saved with this ``world_size``, ``block_size`` and ``drop_last``: this rank
        continues its own shard where it stopped. Saved with others (any step): the
        saved ranks consumed the prefix ``start + consumed x world_size`` of the
        epoch's order (whole blocks: they advance in step; ``state`` may be any saved
        rank's), and the ranks of this sampler split the rest of it from there, so no
        sample of the epoch is seen twice or skipped (only the tail :attr:`num_per_rank`
        leaves out)."""
        missing = {"epoch", "consumed"} - set(state)
        if missing:
            raise ValueError(f"sampler state lacks {sorted(missing)}; has {sorted(state)}")
        for key in ("num_samples", "seed", "shuffle"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(f"sampler state has {key}={state[key]!r} but this sampler has "
                                 f"{key}={getattr(self, key)!r}; the resumed order would differ")
        epoch = check_int("state['epoch']", state["epoch"], 0)
        consumed = check_int("state['consumed']", state["consumed"], 0)
        start = check_int("state['start']", state.get("start", 0), 0)
        old_world = check_int("state['world_size']", state.get("world_size", self.world_size), 1)
        old_block = check_int("state['block_size']", state.get("block_size", 1), 1)
        old_drop = bool(state.get("drop_last", self.drop_last))
        if (old_world, old_block, old_drop) != (self.world_size, self.block_size, self.drop_last) and consumed:
            if consumed % old_block:
                raise ValueError(f"state['consumed']={consumed} is not a whole number of blocks of {old_block}; "
                                 f"resume with world_size={old_world}, block_size={old_block}")
            start, consumed = start + consumed * old_world, 0
        previous = (self.epoch, self.start, self.consumed)
        self.epoch, self.start, self.consumed = epoch, start, 0
        if consumed > self.num_per_rank:
            limit = self.num_per_rank
            self.epoch, self.start, self.consumed = previous
            raise ValueError(f"state['consumed']={consumed} > num_per_rank={limit}")
        self.consumed = consumed
