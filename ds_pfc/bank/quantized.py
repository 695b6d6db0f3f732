"""8-bit row storage with a scale per row, for optimizer moments.

A state placed as ``(tier, "int8_rowwise")`` keeps each row ``v`` as int8 codes ``q`` and
one float32 scale ``s``::

    s = max|v| / 127          q = round_half_even(v / s), in [-127, 127]          v' = q * s

(an all-zero row has ``s = 0`` and ``q = 0``). A row of ``d`` values costs ``d + 4`` bytes
instead of ``4 d`` (float32) or ``2 d`` (bfloat16): SGD's weight in bfloat16 and its
momentum in 8 bits are 1.5 KiB per class at d = 512 instead of 2 KiB. The slots hold
float32 as for every state; the rounding happens at every write-back, and the overlap
rows of a prefetched slot are rounded the same way (as a write-back and a read would).

Every row has its own scale, so a row's error is at most half a code of its own largest
entry, whatever the other rows hold. Meant for momentum-like states; the weight keeps
a floating storage dtype (``TieredBank`` refuses 8-bit centers), and AdamW's second moment
spans too many orders of magnitude within a row for a linear code.
"""
from __future__ import annotations

import torch

from .stores import RowStore, pinned_table, unregister_table

__all__ = ["INT8_ROWWISE", "RowwiseInt8Store", "quantize_rows", "dequantize_rows"]

#: The placement dtype that selects this storage (``Placement(tier, INT8_ROWWISE)``).
INT8_ROWWISE = "int8_rowwise"


def quantize_rows(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q int8 [n, d], scale float32 [n])`` of float rows ``values`` ``[n, d]``."""
    v = values.to(torch.float32)
    scale = v.abs().amax(dim=1) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(v / safe[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    return (q.to(torch.float32) * scale[:, None]).to(dtype)


class RowwiseInt8Store(RowStore):
    """Rows of a ``[num_rows, width]`` float state as int8 codes and a float32 scale per
    row, in device memory (``tier="device"``) or page-locked host memory (``"host"``).
    Codes are read and written with torch ops on the tables' own device: on CUDA a host
    table is coded on the host (the staged path), a device table on the GPU."""

    def __init__(self, num_rows: int, width: int, tier: str, device):
        if width < 1:
            raise ValueError(f"8-bit rowwise storage needs rows of at least one value, got width {width}")
        if tier not in ("device", "host"):
            raise ValueError(f"8-bit rowwise storage lives on the device or host tier, got {tier!r}")
        super().__init__(num_rows, width, torch.int8)
        self.tier = tier
        self.device = torch.device(device) if tier == "device" else torch.device("cpu")
        self._registered = []
        if tier == "device":
            self.q = torch.zeros(num_rows, width, dtype=torch.int8, device=self.device)
            self.scale = torch.zeros(num_rows, dtype=torch.float32, device=self.device)
        else:
            self.q, reg_q = pinned_table((num_rows, width), torch.int8)
            self.scale, reg_s = pinned_table((num_rows,), torch.float32)
            self.q.zero_()
            self.scale.zero_()
            self._registered = [t for t, reg in ((self.q, reg_q), (self.scale, reg_s)) if reg]

    # ---------------------------------------------------------------- the stager's view
    def tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        return (self.q, self.scale)

    def row_bytes(self) -> int:
        return self.width + 4

    def round_trip(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` as a write-back followed by a read would leave them."""
        return dequantize_rows(*quantize_rows(values), dtype=values.dtype)

    def read_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """float32 rows at ``rows`` (on this store's device), on the current stream."""
        rows = rows.to(self.q.device)
        return dequantize_rows(self.q.index_select(0, rows), self.scale.index_select(0, rows))

    def write_rows(self, rows: torch.Tensor, values: torch.Tensor) -> None:
        """Quantize ``values`` into ``rows`` on the current stream (no version count)."""
        q, scale = quantize_rows(values.to(self.q.device))
        rows = rows.to(self.q.device)
        self.q.index_copy_(0, rows, q)
        self.scale.index_copy_(0, rows, scale)

    # ---------------------------------------------------------------- RowStore
    def gather(self, rows):
        return self.read_rows(rows)

    def scatter(self, rows, values):
        self.write_rows(rows, values)
        self.versions[rows.to("cpu")] += 1

    def read_all(self):
        return dequantize_rows(self.q.to("cpu"), self.scale.to("cpu"))

    def write_all(self, values):
        q, scale = quantize_rows(values)
        self.q.copy_(q)
        self.scale.copy_(scale)
        self.versions += 1

    def nbytes(self):
        return self.q.numel() + self.scale.numel() * 4

    def close(self):
        for t in self._registered:
            unregister_table(t)
        self._registered = []
