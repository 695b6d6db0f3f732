"""8-bit row storage with a scale per row, for optimizer moments.

A state placed as ``(tier, "int8_rowwise")`` keeps each row ``v`` as int8 codes ``q`` and
one float32 scale ``s``::

    s = max|v| / 127          q = round_half_even(v / s), in [-127, 127]          v' = q * s

(an all-zero row has ``s = 0`` and ``q = 0``). A row of ``d`` values costs ``d + 4`` bytes
instead of ``4 d`` (float32) or ``2 d`` (bfloat16): SGD's weight in bfloat16 and its
momentum in 8 bits are 1.5 KiB per class at d = 512 instead of 2 KiB. The slots hold
float32 as for every state; the rounding happens at every write-back, and the overlap
rows of a prefetched slot are rounded the same way (as a write-back and a read would).

Rows move as 8 bits on every tier and access mode: ``d + 4`` bytes per row cross PCIe or
HBM, and with a :class:`RowCodec` (the row-move kernel's, which the head passes on CUDA
and under Triton's interpreter) they are decoded into the slot and coded from it in the
kernel's registers, with no float32 copy of the set. Without one the same codes are made
with torch ops (:func:`quantize_rows`, the reference the kernel matches bitwise) on the
device that holds the rows.

Every row has its own scale, so a row's error is at most half a code of its own largest
entry, whatever the other rows hold. Meant for momentum-like states; the weight keeps
a floating storage dtype (``TieredBank`` refuses 8-bit centers), and AdamW's second moment
spans too many orders of magnitude within a row for a linear code.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from .stores import RowStore, pinned_table, unregister_table

__all__ = ["INT8_ROWWISE", "RowCodec", "RowwiseInt8Store", "quantize_rows", "dequantize_rows", "CODE_CHUNK_BYTES"]

#: Without the codec kernels, rows are coded with torch ops this many bytes of float rows at
#: a time: the float32 temporaries of coding are bounded by it, not by the rows of a set.
CODE_CHUNK_BYTES = 32 << 20


def _chunks(num: int, values: torch.Tensor):
    row = max(1, values[:1].numel() * 4)
    step = max(1, CODE_CHUNK_BYTES // row)
    return ((lo, min(num, lo + step)) for lo in range(0, num, step))

#: The placement dtype that selects this storage (``Placement(tier, INT8_ROWWISE)``).
INT8_ROWWISE = "int8_rowwise"


class RowCodec(NamedTuple):
    """Row moves that code and decode 8-bit rows in registers (signatures of
    ``ds_pfc.kernels.triton_rows``): ``decode(q, scale, src_idx, dst, dst_idx, mask)``,
    ``encode(src, src_idx, q, scale, dst_idx, mask)``, and ``move(src, src_idx, dst,
    dst_idx, mask, "int8_rowwise")`` that rounds rows as a write-back and a read would."""
    decode: Callable
    encode: Callable
    move: Callable


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
    Codes move as codes (``d + 4`` bytes a row) and are made and decoded on the GPU: by a
    :class:`RowCodec` where the bank has one, else by torch ops on the tables' device
    (mapped access to a host table on CUDA needs the codec; ``mapped=True`` maps it)."""

    def __init__(self, num_rows: int, width: int, tier: str, device, mapped: bool = False):
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
            # ``mapped``: also mapped into the GPU's address space, for the codec kernels.
            near = torch.device(device) if mapped else None
            self.q, reg_q = pinned_table((num_rows, width), torch.int8, mapped=mapped, near=near)
            self.scale, reg_s = pinned_table((num_rows,), torch.float32, mapped=mapped, near=near)
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

    def write_rows(self, rows: torch.Tensor, values: torch.Tensor, codec: RowCodec | None = None,
                   mask: torch.Tensor | None = None) -> None:
        """Code ``values`` into ``rows`` (where ``mask``) on the current stream (no version
        count): in the codec's registers (``values`` on the GPU, the tables there or mapped
        into it), else with torch ops on the tables' device (no host sync: rows outside
        ``mask`` are rewritten with their own codes)."""
        if codec is not None:
            codec.encode(values, None, self.q, self.scale, rows.to(values.device), mask)
            return
        for lo, hi in _chunks(rows.shape[0], values):     # float32 temporaries of a chunk, not of the set
            q, scale = quantize_rows(values[lo:hi].to(self.q.device))
            at = rows[lo:hi].to(self.q.device)
            if mask is not None:
                keep = mask[lo:hi].to(self.q.device)
                q = torch.where(keep[:, None], q, self.q.index_select(0, at))
                scale = torch.where(keep, scale, self.scale.index_select(0, at))
            self.q.index_copy_(0, at, q)
            self.scale.index_copy_(0, at, scale)

    def fetch_into(self, rows: torch.Tensor, dst: torch.Tensor, positions: torch.Tensor | None = None,
                   mask: torch.Tensor | None = None, codec: RowCodec | None = None) -> None:
        """``dst[positions[i]] = row rows[i]`` decoded, where ``mask[i]`` (``positions`` None:
        ``i``), on the current stream of ``dst``'s device."""
        if codec is not None:
            codec.decode(self.q, self.scale, rows.to(dst.device), dst,
                         None if positions is None else positions.to(dst.device), mask)
            return
        values = self.read_rows(rows).to(dst.device)
        if mask is not None:
            values = torch.where(mask[:, None], values, dst if positions is None else dst.index_select(0, positions))
        if positions is None:
            dst.copy_(values)
        else:
            dst.index_copy_(0, positions.to(dst.device), values)

    def round_into(self, src: torch.Tensor, src_idx: torch.Tensor, dst: torch.Tensor, dst_idx: torch.Tensor | None,
                   mask: torch.Tensor, codec: RowCodec | None = None) -> None:
        """``dst[dst_idx[i]] = src[src_idx[i]]`` as a write-back and a read would leave it,
        where ``mask[i]`` (the overlap patch of a prefetched slot)."""
        if codec is not None:
            codec.move(src, src_idx, dst, dst_idx, mask, INT8_ROWWISE)
            return
        values = self.round_trip(src.index_select(0, src_idx))
        if dst_idx is None:
            dst.copy_(torch.where(mask[:, None], values, dst))
        else:
            keep = torch.nonzero(mask).squeeze(1)
            dst.index_copy_(0, dst_idx.index_select(0, keep), values.index_select(0, keep))

    # ------------------------------------------------- staged: codes cross PCIe as codes
    def gather_codes(self, rows_cpu: torch.Tensor, out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(host tier) the codes and scales of ``rows_cpu``: ``d + 4`` bytes a row (the codes
        into ``out``, a page-locked staging buffer, where given)."""
        q = self.q.index_select(0, rows_cpu) if out is None else torch.index_select(self.q, 0, rows_cpu, out=out)
        return q, self.scale.index_select(0, rows_cpu)

    @staticmethod
    def land_codes(dst: torch.Tensor, positions: torch.Tensor | None, q: torch.Tensor, scale: torch.Tensor,
                   codec: RowCodec | None = None) -> None:
        """Host codes ``q, scale`` copied to ``dst``'s device as codes and decoded into
        ``dst`` (rows ``positions``, or all of it), on the current stream."""
        q, scale = q.to(dst.device, non_blocking=True), scale.to(dst.device, non_blocking=True)
        pos = None if positions is None else positions.to(dst.device, non_blocking=True)
        if codec is not None:
            codec.decode(q, scale, None, dst, pos)
        elif pos is None:
            dst.copy_(dequantize_rows(q, scale))
        else:
            dst.index_copy_(0, pos, dequantize_rows(q, scale))

    @staticmethod
    def code_rows(values: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, codec: RowCodec | None = None) -> None:
        """``values`` coded into ``q, scale`` (same device), on the current stream."""
        if codec is not None:
            codec.encode(values, None, q, scale, None)
            return
        for lo, hi in _chunks(values.shape[0], values):
            cq, cs = quantize_rows(values[lo:hi])
            q[lo:hi].copy_(cq)
            scale[lo:hi].copy_(cs)

    def scatter_codes(self, rows_cpu: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> None:
        """(host tier) codes made elsewhere into ``rows_cpu``, versions counted."""
        self.q.index_copy_(0, rows_cpu, q)
        self.scale.index_copy_(0, rows_cpu, scale)
        self.versions[rows_cpu] += 1

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
