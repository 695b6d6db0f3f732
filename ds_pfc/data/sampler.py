"""Distributed sampler whose every epoch is a pure function of ``(seed, epoch)``.

Insightface (notes/insightface.md 1.4) broadcasts a seed from rank 0 and pads by
repetition. Here each rank builds the same permutation from a generator seeded by
``(seed, epoch)`` alone, so no communication is needed, and takes a strided shard of
it in blocks: with ``block_size = b`` the permutation is cut into blocks of ``b`` and
rank ``q`` takes blocks ``q, q + W, q + 2W, ..``. With ``b`` = the micro batch, the
``k``-th micro batch of rank ``q`` is block ``k W + q`` of the epoch, so the global
composition of every micro batch depends on ``W x gradient accumulation`` only: one
rank accumulating 2 micro batches sees exactly the batches two ranks see in one step
(BatchNorm statistics included). The position inside the epoch is explicit state
(``consumed``) so a run stopped mid-epoch resumes with exactly the remaining indices,
also on another number of ranks when the blocks consumed so far divide evenly.
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
        blocks = num_samples // unit if drop_last else math.ceil(num_samples / unit)
        self.num_per_rank = blocks * self.block_size
        self.total_size = self.num_per_rank * world_size
        self.epoch = 0
        self.consumed = 0

    # -- epoch position ------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Select the epoch. Moving to another epoch resets ``consumed`` to 0; setting
        the current one again keeps it, so ``load_state_dict`` followed by the usual
        ``set_epoch(epoch)`` at the top of the epoch loop still resumes mid-epoch."""
        check_int("epoch", epoch, 0)
        if epoch != self.epoch:
            self.epoch = epoch
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
        """The full (trimmed or padded) int64 order of ``epoch``, identical on all ranks."""
        epoch = self.epoch if epoch is None else check_int("epoch", epoch, 0)
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(epoch_seed(self.seed, epoch))
            perm = torch.randperm(self.num_samples, generator=g)
        else:
            perm = torch.arange(self.num_samples)
        if self.total_size <= self.num_samples:
            return perm[: self.total_size]
        return perm[torch.arange(self.total_size) % self.num_samples]

    def shard(self, epoch: int | None = None) -> torch.Tensor:
        """This rank's whole shard of ``epoch`` (ignores ``consumed``)."""
        perm = self.epoch_permutation(epoch).view(-1, self.block_size)
        return perm[self.rank:: self.world_size].reshape(-1)

    def __iter__(self) -> Iterator[int]:
        return iter(self.shard()[self.consumed:].tolist())

    def __len__(self) -> int:
        return self.num_per_rank - self.consumed

    # -- checkpoint --------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "consumed": self.consumed, "num_samples": self.num_samples,
                "world_size": self.world_size, "seed": self.seed, "shuffle": self.shuffle,
                "drop_last": self.drop_last, "block_size": self.block_size}

    def load_state_dict(self, state: dict) -> None:
        """Restore ``epoch`` and ``consumed``. The permutation must be the same one, so
        ``num_samples``, ``seed`` and ``shuffle`` must match. ``drop_last`` and
        ``block_size`` may change only at an epoch boundary (``consumed == 0``);
        ``world_size`` also mid-epoch when the blocks the old ranks consumed together
        split evenly over the new ones (consumed blocks are a prefix of the epoch)."""
        missing = {"epoch", "consumed"} - set(state)
        if missing:
            raise ValueError(f"sampler state lacks {sorted(missing)}; has {sorted(state)}")
        for key in ("num_samples", "seed", "shuffle"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(f"sampler state has {key}={state[key]!r} but this sampler has "
                                 f"{key}={getattr(self, key)!r}; the resumed order would differ")
        epoch = check_int("state['epoch']", state["epoch"], 0)
        consumed = check_int("state['consumed']", state["consumed"], 0)
        if consumed:
            for key in ("drop_last", "block_size"):
                if state.get(key, 1 if key == "block_size" else self.drop_last) != getattr(self, key):
                    raise ValueError(f"cannot resume mid-epoch (consumed={consumed}) with {key}="
                                     f"{getattr(self, key)!r}; the state was saved with {key}={state[key]!r}")
            old_world = state.get("world_size", self.world_size)
            if old_world != self.world_size:
                if consumed % self.block_size:
                    raise ValueError(f"state['consumed']={consumed} is not a whole number of blocks of "
                                     f"{self.block_size}")
                blocks = consumed // self.block_size * old_world
                if blocks % self.world_size:
                    raise ValueError(f"cannot resume mid-epoch on world_size={self.world_size}: the {old_world} "
                                     f"ranks consumed {blocks} blocks together, which {self.world_size} ranks "
                                     f"cannot split evenly; resume on {old_world} ranks or at an epoch boundary")
                consumed = blocks // self.world_size * self.block_size
        if consumed > self.num_per_rank:
            raise ValueError(f"state['consumed']={consumed} > num_per_rank={self.num_per_rank}")
        self.epoch = epoch
        self.consumed = consumed
