"""The class bank: persistent per-class state (centers and optimizer state).

A bank holds named state tensors whose row ``i`` belongs to local class ``i``: the
centers (``"weight"``, ``[C_q, d]``) and whatever the row optimizer keeps
(``"momentum_buffer"``, ``"exp_avg"``, ...). The head only ever reads and writes rows
through this interface, so where the rows live (device memory, host memory, a file)
is the bank's business.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from .._rng import generator_for

__all__ = ["ClassBank", "initial_centers", "INIT_BLOCK"]

INIT_BLOCK = 4096  # classes per initialisation block; part of the init contract


class ClassBank(ABC):
    """Rows ``[0, num_rows)`` of named per-class state; staged rows land on ``device``."""

    def __init__(self, num_rows: int, device: torch.device):
        self.num_rows = num_rows
        self.device = torch.device(device)

    @abstractmethod
    def add_state(self, name: str, width: int, dtype: torch.dtype, init: torch.Tensor | None = None) -> None:
        """Create state ``name`` of shape ``[num_rows, width]`` (``[num_rows]`` if
        ``width == 0``), zero-filled unless ``init`` is given: a tensor (the bank may
        keep it rather than a copy: the caller must not reuse it) or a function
        ``init(lo, hi) -> rows [lo, hi)`` so that a bank larger than memory is filled
        a chunk at a time."""

    @abstractmethod
    def state_names(self) -> list[str]:
        """Names of the states held, in creation order."""

    @abstractmethod
    def read(self, name: str, rows: torch.Tensor | None) -> torch.Tensor:
        """Rows of ``name`` on ``device``. With row ids the result is a new tensor the
        caller may modify; ``rows=None`` (all rows) may return a read-only view."""

    @abstractmethod
    def write(self, name: str, rows: torch.Tensor | None, values: torch.Tensor) -> None:
        """Store ``values`` into the rows of ``name`` (``rows=None``: all rows)."""

    @abstractmethod
    def export(self, name: str) -> torch.Tensor:
        """The whole of ``name`` as a new host (CPU) tensor that does not alias future
        updates. Never a second copy in device memory: at tens of millions of rows a
        device clone would not fit beside the bank."""

    def export_rows(self, name: str, lo: int, hi: int) -> torch.Tensor:
        """Rows ``[lo, hi)`` of ``name`` as a new CPU tensor (chunked saving)."""
        return self.read(name, torch.arange(lo, hi, device=self.device)).to("cpu")

    @abstractmethod
    def resident_bytes(self) -> dict[str, int]:
        """Bytes held per tier, e.g. ``{"device": ..., "host": 0, "nvme": 0}``."""

    def load(self, name: str, tensor: torch.Tensor) -> None:
        """Replace all rows of ``name``."""
        self.write(name, None, tensor)

    def load_rows(self, name: str, lo: int, values: torch.Tensor) -> None:
        """Replace rows ``[lo, lo + len(values))`` of ``name`` with ``values`` (any
        device, the state's dtype), as :meth:`load` would: a resume streams a state in
        row blocks through this, so that no whole state is ever in host or device memory.
        The bank moves the block to its tier; its memory is that of the block."""
        rows = torch.arange(lo, lo + values.shape[0], device=self.device)
        self.write(name, rows, values.to(self.device))


def initial_centers(seed: int, class_start: int, num: int, dim: int, std: float,
                    dtype: torch.dtype = torch.float32, device="cpu") -> torch.Tensor:
    """Centers ``[num, dim]`` of global classes ``[class_start, class_start + num)``.

    Each block of ``INIT_BLOCK`` global classes is drawn from N(0, std^2) by a
    generator seeded from ``(seed, block)``, so a class's initial center depends only
    on ``(seed, global id)``, never on how classes are split across ranks. Generated on
    ``device``: values are identical for every world size on the same device type.
    """
    out = torch.empty(num, dim, dtype=dtype, device=device)
    if num == 0:
        return out
    end = class_start + num
    for block in range(class_start // INIT_BLOCK, (end - 1) // INIT_BLOCK + 1):
        lo, hi = block * INIT_BLOCK, (block + 1) * INIT_BLOCK
        gen = generator_for(seed, 0x1A17, block, device=device)
        values = torch.empty(INIT_BLOCK, dim, dtype=torch.float32, device=device).normal_(0.0, std, generator=gen)
        a, b = max(lo, class_start), min(hi, end)
        out[a - class_start: b - class_start] = values[a - lo: b - lo]
    return out
