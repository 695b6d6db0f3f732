"""Contiguous class ownership (paper: "Distributed Approximation").

Rank ``q`` of ``k`` owns the global interval ``[a_q, a_q + C_q)`` with
``C_q = floor(C / k) + (q < C mod k)``: the first ``C mod k`` ranks own one class
more. ``C < k`` is allowed; the last ranks then own nothing.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Partition"]


@dataclass(frozen=True)
class Partition:
    """Ownership of ``num_classes`` classes by ``world_size`` ranks."""

    num_classes: int
    world_size: int

    def __post_init__(self) -> None:
        if not isinstance(self.num_classes, int) or isinstance(self.num_classes, bool) or self.num_classes < 1:
            raise ValueError(f"num_classes must be a positive int, got {self.num_classes!r}")
        if not isinstance(self.world_size, int) or isinstance(self.world_size, bool) or self.world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {self.world_size!r}")

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank}")

    def num_local(self, rank: int) -> int:
        """``C_q``: how many classes ``rank`` owns."""
        self._check_rank(rank)
        base, extra = divmod(self.num_classes, self.world_size)
        return base + (rank < extra)

    def class_start(self, rank: int) -> int:
        """``a_q``: the first global class id owned by ``rank``."""
        self._check_rank(rank)
        base, extra = divmod(self.num_classes, self.world_size)
        return base * rank + min(rank, extra)

    def bounds(self, rank: int) -> tuple[int, int]:
        """``(a_q, a_q + C_q)``."""
        start = self.class_start(rank)
        return start, start + self.num_local(rank)

    def owner(self, labels: torch.Tensor) -> torch.Tensor:
        """The rank owning each global class id in ``labels``."""
        base, extra = divmod(self.num_classes, self.world_size)
        labels = labels.long()
        # Ranks < extra own base + 1 classes; the boundary between the two regimes
        # is at class (base + 1) * extra.
        pivot = (base + 1) * extra
        big = labels // (base + 1)
        small = extra + (labels - pivot) // max(base, 1)
        return torch.where(labels < pivot, big, small)

    def to_local(self, labels: torch.Tensor, rank: int) -> torch.Tensor:
        """Global ids to ``rank``'s local ids; ids ``rank`` does not own become -1."""
        start, end = self.bounds(rank)
        labels = labels.long()
        owned = (labels >= start) & (labels < end)
        return torch.where(owned, labels - start, torch.full_like(labels, -1))

    def to_global(self, local_ids: torch.Tensor, rank: int) -> torch.Tensor:
        """Local ids of ``rank`` to global class ids."""
        return local_ids.long() + self.class_start(rank)
