"""Row moves for the class bank: one Triton kernel that copies selected rows of one table
into selected rows of another, converting dtypes on the way.

``move_rows_(src, src_idx, dst, dst_idx, mask, round_dtype)`` does, for every ``i`` with
``mask[i]`` set (every ``i`` without a mask)::

    dst[dst_idx[i]] = src[src_idx[i]]        (as round_dtype, then as dst.dtype)

``src_idx``/``dst_idx`` None mean ``i`` itself. The bank uses it three ways, always on its
side stream and with row ids that never leave the device:

* fetch: ``src`` the bank table (device memory, or page-locked host memory mapped into the
  GPU's address space), ``src_idx`` the next step's rows, ``dst`` the slot, ``mask`` the
  cold rows (not held by the step in flight);
* write-back: ``src`` the stepped slot, ``dst`` the table, ``dst_idx`` the slot's rows,
  converted to the storage dtype;
* overlap patch: ``src`` the stepped slot, ``src_idx`` the positions of the next slot's rows
  in it, ``mask`` the rows it holds, rounded through the storage dtype as a write-back and a
  read would round them.

A masked-off row is neither read nor written, so a mapped host table is touched only at the
rows that move: each byte crosses PCIe once. The grid is capped (:data:`_TILES`'s
``MAX_PROGRAMS``) and each program strides over row blocks, so a fetch beside the backbone's
kernels occupies a few SMs, not the whole GPU.

:func:`ds_pfc.bank.rows.move_rows_torch_` does the same with torch ops; it is the bank's
path off CUDA and without Triton.

Under ``TRITON_INTERPRET=1`` (set before import) the kernel runs on CPU tensors.
"""
from __future__ import annotations

import os

import torch

from .._checks import check_row_move
from ._device import on_device
from . import _target

try:
    import triton
    import triton.language as tl
except ImportError:  # the module stays importable; available() says False
    triton = None
    tl = None

__all__ = ["available", "move_rows_"]

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

#: BLOCK_R rows x BLOCK_W columns per program iteration; at most MAX_PROGRAMS programs,
#: each striding over row blocks. On Hopper 4 x 256 is a warp per row with 16-byte
#: accesses over 256 contiguous columns (bf16: 512 B, fp32: 1 KiB per row and pass),
#: and 16 programs of 4 warps (an eighth of the SMs of an H100) keep enough bytes in
#: flight to fill a PCIe gen5 x16 link from mapped host memory. The interpreter's tiles
#: are small so that the tests' odd widths and row counts leave ragged edges and
#: several strides per program, and not smaller (it runs every program as Python).
_TILES = {
    #              BLOCK_R  BLOCK_W  num_warps  MAX_PROGRAMS
    "cuda":        (4,      256,     4,         16),
    "interpreter": (16,     16,      1,         2),
}

_TL_DTYPES = None


def available() -> bool:
    """True when the kernel can run here: Triton is installed and there is a CUDA device,
    or ``TRITON_INTERPRET=1`` was set before import (CPU tensors)."""
    return triton is not None and (_INTERPRET or torch.cuda.is_available())


def _tiles():
    return _TILES["interpreter" if _INTERPRET and not _target.active() else "cuda"]


if triton is not None:

    @triton.jit
    def _bf16_bits(v):
        """float32 ``v`` rounded to bfloat16 (nearest even, as torch rounds), as the bits of
        the float32 that holds that value exactly. Done on the bits, with no float cast:
        Triton's interpreter truncates float32 -> bfloat16 and mishandles subnormals, the
        GPU rounds; the bits agree everywhere. A NaN becomes the quiet NaN (rounding its
        bits could carry into the sign, or leave a payload that truncates to inf)."""
        bits = v.to(tl.uint32, bitcast=True)
        bits = (bits + (((bits >> 16) & 1) + 0x7FFF)) & 0xFFFF0000
        return tl.where(v != v, 0x7FC00000, bits)

    @triton.jit
    def _round(v, dtype, BF16_FROM_F32: tl.constexpr):
        """``v`` rounded through ``dtype`` and kept in its own (wider) dtype."""
        if BF16_FROM_F32:
            return _bf16_bits(v).to(tl.float32, bitcast=True)
        return v.to(dtype).to(v.dtype)

    @triton.jit
    def _narrow(v, dtype, BF16_FROM_F32: tl.constexpr):
        """``v`` as ``dtype`` (narrowing casts round to nearest even, as torch's do)."""
        if BF16_FROM_F32:
            return (_bf16_bits(v) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        return v.to(dtype)

    @triton.jit
    def _move_rows_kernel(src_ptr, src_idx_ptr, dst_ptr, dst_idx_ptr, mask_ptr, R, W,
                          stride_src, stride_dst,
                          HAS_SRC_IDX: tl.constexpr, HAS_DST_IDX: tl.constexpr, HAS_MASK: tl.constexpr,
                          ROUND: tl.constexpr, ROUND_DTYPE: tl.constexpr, ROUND_BF16: tl.constexpr,
                          DST_BF16: tl.constexpr, SRC_BF16: tl.constexpr,
                          BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr):
        step = tl.num_programs(0) * BLOCK_R
        for start in range(tl.program_id(0) * BLOCK_R, R, step):
            pos = start + tl.arange(0, BLOCK_R).to(tl.int64)
            live = pos < R
            if HAS_MASK:
                live = live & (tl.load(mask_ptr + pos, mask=live, other=0) != 0)
            if HAS_SRC_IDX:
                src_row = tl.load(src_idx_ptr + pos, mask=live, other=0).to(tl.int64)
            else:
                src_row = pos
            if HAS_DST_IDX:
                dst_row = tl.load(dst_idx_ptr + pos, mask=live, other=0).to(tl.int64)
            else:
                dst_row = pos
            for w0 in range(0, W, BLOCK_W):
                cols = w0 + tl.arange(0, BLOCK_W)
                m = live[:, None] & (cols < W)[None, :]
                v = tl.load(src_ptr + src_row[:, None] * stride_src + cols[None, :], mask=m)
                if SRC_BF16:        # widened on the bits (exact; the interpreter's cast is not)
                    v = (v.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
                if ROUND:
                    v = _round(v, ROUND_DTYPE, ROUND_BF16)
                v = _narrow(v, dst_ptr.dtype.element_ty, DST_BF16)
                tl.store(dst_ptr + dst_row[:, None] * stride_dst + cols[None, :], v, mask=m)


def _tl_dtype(dtype: torch.dtype):
    global _TL_DTYPES
    if _TL_DTYPES is None:
        _TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16,
                      torch.float64: tl.float64}
    try:
        return _TL_DTYPES[dtype]
    except KeyError:
        raise TypeError(f"round_dtype must be one of {sorted(map(str, _TL_DTYPES))}, got {dtype}") from None


def _narrows(a: torch.dtype, b: torch.dtype) -> bool:
    """A cast from float dtype ``a`` to ``b`` loses bits."""
    return a != b and torch.finfo(b).bits <= torch.finfo(a).bits


def _bf16_from_f32(a: torch.dtype, b: torch.dtype) -> bool:
    """A float32 -> bfloat16 cast (rounded on the bits in the kernel). Other narrowing
    casts to bfloat16 would round twice: refused."""
    if b == torch.bfloat16 and a not in (torch.float32, torch.bfloat16):
        raise TypeError(f"the row-move kernel narrows to bfloat16 from float32 only, got {a}; use move_rows_torch_")
    return a == torch.float32 and b == torch.bfloat16


def _as_2d(t: torch.Tensor) -> torch.Tensor:
    return t.unsqueeze(1) if t.dim() == 1 else t


def move_rows_(src: torch.Tensor, src_idx: torch.Tensor | None, dst: torch.Tensor, dst_idx: torch.Tensor | None,
               mask: torch.Tensor | None = None, round_dtype: torch.dtype | None = None, *,
               count: int | None = None, max_programs: int | None = None) -> torch.Tensor:
    """``dst[dst_idx[i]] = src[src_idx[i]]`` for the ``i`` with ``mask[i]`` (see the module
    docstring), with the Triton kernel, on the current stream of ``dst``'s device (``src``
    may be host memory mapped into that device's address space). Indices must be in range
    and ``dst_idx`` unique: checking would cost a host sync. ``max_programs`` caps the
    grid (default: the tile table's). Returns ``dst``."""
    if triton is None:
        raise RuntimeError("triton is not installed (pip install -e .[dev])")
    count = check_row_move(src, src_idx, dst, dst_idx, mask, count)
    if not _INTERPRET and dst.device.type != "cuda":
        raise ValueError(f"dst must be a CUDA tensor (or set TRITON_INTERPRET=1 before import), got {dst.device}")
    if count == 0 or src.numel() == 0:
        return dst
    s2, d2 = _as_2d(src), _as_2d(dst)
    block_r, block_w, num_warps, cap = _tiles()
    if max_programs is not None:
        if isinstance(max_programs, bool) or not isinstance(max_programs, int) or max_programs < 1:
            raise ValueError(f"max_programs must be an int >= 1, got {max_programs!r}")
        cap = max_programs
    grid = (max(1, min(cap, triton.cdiv(count, block_r))),)
    # Rounding through a dtype only matters when it is narrower than the values.
    rnd = round_dtype is not None and src.is_floating_point() and _narrows(src.dtype, round_dtype)
    src_bf16 = src.dtype == torch.bfloat16 and dst.dtype != torch.bfloat16
    value_dtype = torch.float32 if src_bf16 else src.dtype     # after the load
    round_bf16 = rnd and _bf16_from_f32(value_dtype, round_dtype)
    dst_bf16 = dst.is_floating_point() and _bf16_from_f32(value_dtype, dst.dtype)
    dummy = dst if mask is None else mask
    with on_device(dst.device):
        _move_rows_kernel[grid](
            s2, src_idx if src_idx is not None else s2, d2, dst_idx if dst_idx is not None else d2,
            mask.view(torch.uint8) if mask is not None else dummy, count, s2.shape[1],
            s2.stride(0), d2.stride(0),
            HAS_SRC_IDX=src_idx is not None, HAS_DST_IDX=dst_idx is not None, HAS_MASK=mask is not None,
            ROUND=rnd, ROUND_DTYPE=_tl_dtype(round_dtype) if rnd else tl.float32,
            ROUND_BF16=round_bf16, DST_BF16=dst_bf16, SRC_BF16=src_bf16,
            BLOCK_R=block_r, BLOCK_W=block_w, num_warps=num_warps)
    return dst
