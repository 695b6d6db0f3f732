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
rows that move: each byte crosses PCIe once. The grid is capped (:class:`MoverConfig`, with
separate defaults for host reads, host writes and device-to-device moves) and each program
strides over passes of whole rows, so a fetch beside the backbone's kernels occupies a few
SMs, not the whole GPU.

8-bit rowwise states (int8 codes and a float32 scale per row, ``ds_pfc.bank.quantized``)
move as 8 bits: :func:`decode_rows_` reads ``d + 4`` bytes per row and decodes them in
registers, :func:`encode_rows_` finds each row's scale and writes its codes, and
``round_dtype="int8_rowwise"`` rounds rows as a write-back and a read would, with no float32
copy of a whole set anywhere. Codes are bitwise those of ``quantize_rows`` for finite rows
(a row holding a NaN has no meaningful codes either way).

:func:`ds_pfc.bank.rows.move_rows_torch_` does the same with torch ops; it is the bank's
path off CUDA and without Triton.

Under ``TRITON_INTERPRET=1`` (set before import) the kernel runs on CPU tensors.
"""
from __future__ import annotations

import contextlib
import os
import threading
from typing import NamedTuple

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

__all__ = ["available", "move_rows_", "decode_rows_", "encode_rows_", "MoverConfig", "default_config",
           "bytes_in_flight", "INT8_ROWWISE"]

#: ``round_dtype`` that rounds values as 8-bit rowwise codes would (encode, then decode).
INT8_ROWWISE = "int8_rowwise"

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

#: Rows in flight. A move's rate is the bytes it keeps in flight divided by the latency of
#: one access (Little's law: bytes in flight = rate x latency). Each program moves
#: ``rows_per_pass`` whole rows per pass (``block_w`` columns at a time; 0: the whole row
#: in one tile up to 1,024 columns), and loads the next pass's row ids before this
#: pass's rows, so an index load never stands between two row loads. The defaults are
#: stated arithmetic until a GPU measures them (``ds-pfc-bench rows``):
#:
#: * ``host_read`` (a kernel reading mapped host rows over PCIe): target 50 GB/s (gen5
#:   x16) at an assumed 2 us zero-copy read latency = 100 KB in flight per GPU; 16
#:   programs of 8 warps, each with >= 8 KiB of rows per pass (128 KiB in all, 16 x the
#:   previous design's one 512 B row per warp);
#: * ``host_write`` (stores to mapped host rows): posted writes wait for no reply, so the
#:   in-flight need is the write-combining buffers', not a round trip: 8 programs;
#: * ``d2d`` (device-tier rows, HBM to HBM): 1 us latency, 32 programs x 8 KiB = 256 KiB
#:   in flight, ~250 GB/s, a quarter of an H100's SMs at most.
#:
#: Rows per pass are the power of two that makes 8 KiB of source bytes, from 2 to 64,
#: and at most 8,192 values per pass (32 float32 registers per thread at 8 warps).
ASSUMED_LATENCY_US = {"host_read": 2.0, "host_write": 1.0, "d2d": 1.0}
TARGET_GBPS = {"host_read": 50.0, "host_write": 50.0, "d2d": 250.0}
MAX_PROGRAMS = {"host_read": 16, "host_write": 8, "d2d": 32}
NUM_WARPS = 8
BYTES_PER_PASS = 8 << 10
MAX_VALUES_PER_PASS = 8192
WHOLE_ROW_MAX = 1024
KINDS = tuple(MAX_PROGRAMS)


class MoverConfig(NamedTuple):
    """Launch parameters of a row move: warps per program, whole rows per pass (a power
    of two), the grid cap, and columns per tile (a power of two; 0: the whole row, up to
    :data:`WHOLE_ROW_MAX` columns, then tiles of 1,024)."""
    num_warps: int
    rows_per_pass: int
    max_programs: int
    block_w: int = 0


#: The interpreter's tiles are small, so that the tests' odd widths and row counts leave
#: ragged edges and several strides per program, and not smaller (it runs every program
#: as Python).
INTERPRETER_CONFIG = MoverConfig(num_warps=1, rows_per_pass=16, max_programs=2, block_w=16)

_TL_DTYPES = None

#: Triton's interpreter patches ``triton.language`` for the length of a launch, for the
#: whole process: two threads interpreting at once (the bank's I/O worker and the
#: training thread) would unpatch it under each other. Interpreted launches take turns.
_INTERPRET_LOCK = threading.Lock()


def available() -> bool:
    """True when the kernel can run here: Triton is installed and there is a CUDA device,
    or ``TRITON_INTERPRET=1`` was set before import (CPU tensors)."""
    return triton is not None and (_INTERPRET or torch.cuda.is_available())


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def default_config(kind: str, row_bytes: int, width: int) -> MoverConfig:
    """The stated default (see :data:`ASSUMED_LATENCY_US`) for a move of ``kind``
    (``"host_read"``, ``"host_write"`` or ``"d2d"``) of rows of ``row_bytes`` source bytes
    and ``width`` values."""
    if kind not in MAX_PROGRAMS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    rows = -(-BYTES_PER_PASS // max(1, row_bytes))
    rows = 1 << (rows - 1).bit_length()                           # up to a power of two
    tile_w = min(1 << (max(1, width) - 1).bit_length(), WHOLE_ROW_MAX)
    rows = max(2, min(64, rows, _pow2_floor(MAX_VALUES_PER_PASS // tile_w)))
    return MoverConfig(NUM_WARPS, rows, MAX_PROGRAMS[kind], 0)


def bytes_in_flight(config: MoverConfig, row_bytes: int) -> int:
    """Source bytes one launch has in flight at once: every program's rows of one pass."""
    return config.max_programs * config.rows_per_pass * row_bytes


def _kind(src: torch.Tensor, dst: torch.Tensor) -> str:
    """Which cap a move on a GPU takes: host tables are CPU tensors mapped into the GPU."""
    if src.device.type == "cpu" and dst.device.type != "cpu":
        return "host_read"
    if dst.device.type == "cpu" and src.device.type != "cpu":
        return "host_write"
    return "d2d"


def _check_config(config) -> MoverConfig:
    if not isinstance(config, MoverConfig):
        raise TypeError(f"config must be a MoverConfig, got {type(config).__name__}")
    for name, v in config._asdict().items():
        if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "block_w" else 1):
            raise ValueError(f"config.{name} must be an int >= {0 if name == 'block_w' else 1}, got {v!r}")
    for name in ("rows_per_pass", "block_w", "num_warps"):
        v = getattr(config, name)
        if v and v & (v - 1):
            raise ValueError(f"config.{name} must be a power of two, got {v}")
    return config


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
    def _rint(v):
        """float32 ``v`` (|v| < 2^22) rounded to an integer, ties to even, as ``torch.round``
        rounds: adding 1.5 x 2^23 leaves no fraction bits in the float32 sum, which is
        rounded to nearest even, and subtracting it back is exact (libdevice's rint is not
        in the interpreter)."""
        return (v + 12582912.0) - 12582912.0

    @triton.jit
    def _row_ids(start, R, src_idx_ptr, dst_idx_ptr, mask_ptr, HAS_SRC_IDX: tl.constexpr,
                 HAS_DST_IDX: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK_R: tl.constexpr):
        """The live positions of the pass at ``start`` and their source and destination rows."""
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
        return live, src_row, dst_row

    @triton.jit
    def _load_values(src_ptr, src_scale_ptr, src_row, live, cols, m, stride_src,
                     SRC_BF16: tl.constexpr, DECODE: tl.constexpr):
        """A tile of source rows as values: bfloat16 widened on the bits (exact; the
        interpreter's cast is not), 8-bit codes decoded (``q * scale``, float32)."""
        v = tl.load(src_ptr + src_row[:, None] * stride_src + cols[None, :], mask=m, other=0)
        if SRC_BF16:
            v = (v.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        if DECODE:
            s = tl.load(src_scale_ptr + src_row, mask=live, other=0.0)
            v = v.to(tl.float32) * s[:, None]
        return v

    @triton.jit
    def _move_rows_kernel(src_ptr, src_idx_ptr, dst_ptr, dst_idx_ptr, mask_ptr, src_scale_ptr, dst_scale_ptr,
                          R, W, stride_src, stride_dst,
                          HAS_SRC_IDX: tl.constexpr, HAS_DST_IDX: tl.constexpr, HAS_MASK: tl.constexpr,
                          ROUND: tl.constexpr, ROUND_DTYPE: tl.constexpr, ROUND_BF16: tl.constexpr,
                          DST_BF16: tl.constexpr, SRC_BF16: tl.constexpr,
                          DECODE: tl.constexpr, ENCODE: tl.constexpr, ROUND_Q8: tl.constexpr,
                          AMAX: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr):
        step = tl.num_programs(0) * BLOCK_R
        first = tl.program_id(0) * BLOCK_R
        live, src_row, dst_row = _row_ids(first, R, src_idx_ptr, dst_idx_ptr, mask_ptr,
                                          HAS_SRC_IDX, HAS_DST_IDX, HAS_MASK, BLOCK_R)
        for start in range(first, R, step):
            # Hoisted: the next pass's ids load before this pass's rows do.
            next_live, next_src, next_dst = _row_ids(start + step, R, src_idx_ptr, dst_idx_ptr, mask_ptr,
                                                     HAS_SRC_IDX, HAS_DST_IDX, HAS_MASK, BLOCK_R)
            if AMAX:            # 8-bit codes out: each row's scale from its largest |value|
                amax = tl.zeros([BLOCK_R], dtype=tl.float32)
                for w0 in range(0, W, BLOCK_W):
                    cols = w0 + tl.arange(0, BLOCK_W)
                    m = live[:, None] & (cols < W)[None, :]
                    v = _load_values(src_ptr, src_scale_ptr, src_row, live, cols, m, stride_src, SRC_BF16, DECODE)
                    amax = tl.maximum(amax, tl.max(tl.abs(v.to(tl.float32)), axis=1))
                scale = tl.math.div_rn(amax, 127.0)
                safe = tl.where(scale > 0, scale, 1.0)
            for w0 in range(0, W, BLOCK_W):
                cols = w0 + tl.arange(0, BLOCK_W)
                m = live[:, None] & (cols < W)[None, :]
                v = _load_values(src_ptr, src_scale_ptr, src_row, live, cols, m, stride_src, SRC_BF16, DECODE)
                if AMAX:
                    q = _rint(tl.math.div_rn(v.to(tl.float32), safe[:, None]))
                    q = tl.minimum(tl.maximum(q, -127.0), 127.0)
                    if ENCODE:
                        tl.store(dst_ptr + dst_row[:, None] * stride_dst + cols[None, :], q.to(tl.int8), mask=m)
                    else:
                        v = q * scale[:, None]
                if not ENCODE:
                    if ROUND:
                        v = _round(v, ROUND_DTYPE, ROUND_BF16)
                    v = _narrow(v, dst_ptr.dtype.element_ty, DST_BF16)
                    tl.store(dst_ptr + dst_row[:, None] * stride_dst + cols[None, :], v, mask=m)
            if ENCODE:
                tl.store(dst_scale_ptr + dst_row, scale, mask=live)
            live, src_row, dst_row = next_live, next_src, next_dst


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
               mask: torch.Tensor | None = None, round_dtype: torch.dtype | str | None = None, *,
               count: int | None = None, max_programs: int | None = None, kind: str | None = None,
               config: MoverConfig | None = None, unique_dst: bool = False) -> torch.Tensor:
    """``dst[dst_idx[i]] = src[src_idx[i]]`` for the ``i`` with ``mask[i]`` (see the module
    docstring), with the Triton kernel, on the current stream of ``dst``'s device (``src``
    may be host memory mapped into that device's address space). Indices must be in range
    and ``dst_idx`` unique where ``mask`` is set: checking would cost a host sync (the
    kernel never writes a masked-off row, so ``unique_dst``, which the torch twin needs to
    avoid a sync, changes nothing here). ``round_dtype`` may also be
    ``"int8_rowwise"``: each row rounded as 8-bit codes with a scale would leave it.
    ``config`` sets the launch (default: :func:`default_config` for ``kind``, which is
    found from where ``src`` and ``dst`` live); ``max_programs`` overrides its grid cap.
    Returns ``dst``."""
    _need_triton()
    count = check_row_move(src, src_idx, dst, dst_idx, mask, count)
    if round_dtype == INT8_ROWWISE and not (src.is_floating_point() and src.dim() == 2):
        raise ValueError(f"round_dtype={INT8_ROWWISE!r} needs float rows [rows, width], got {src.dtype} "
                         f"of shape {list(src.shape)}")
    _launch(src, src_idx, dst, dst_idx, mask, count, round_dtype, None, None, kind, config, max_programs)
    return dst


def decode_rows_(q: torch.Tensor, scale: torch.Tensor, src_idx: torch.Tensor | None, dst: torch.Tensor,
                 dst_idx: torch.Tensor | None, mask: torch.Tensor | None = None, *, count: int | None = None,
                 kind: str | None = None, config: MoverConfig | None = None) -> torch.Tensor:
    """``dst[dst_idx[i]] = q[src_idx[i]] * scale[src_idx[i]]`` where ``mask[i]``: 8-bit rows
    decoded in the kernel's registers (``d + 4`` bytes read per row, no float32 copy of
    the codes), as ``ds_pfc.bank.quantized.dequantize_rows`` decodes them. Returns ``dst``."""
    _need_triton()
    _check_codes(q, scale, "q", "scale")
    if not dst.is_floating_point():
        raise TypeError(f"dst must be a floating tensor for decoded rows, got {dst.dtype}")
    count = check_row_move(q, src_idx, _int8_like(dst), dst_idx, mask, count)
    _launch(q, src_idx, dst, dst_idx, mask, count, None, scale, None, kind, config, None)
    return dst


def encode_rows_(src: torch.Tensor, src_idx: torch.Tensor | None, q: torch.Tensor, scale: torch.Tensor,
                 dst_idx: torch.Tensor | None, mask: torch.Tensor | None = None, *, count: int | None = None,
                 kind: str | None = None, config: MoverConfig | None = None) -> torch.Tensor:
    """``(q, scale)[dst_idx[i]] = codes of src[src_idx[i]]`` where ``mask[i]``: float rows
    coded in the kernel's registers as ``ds_pfc.bank.quantized.quantize_rows`` codes them
    (``d + 4`` bytes written per row). Returns ``q``."""
    _need_triton()
    _check_codes(q, scale, "q", "scale")
    if not src.is_floating_point() or src.dim() != 2:
        raise TypeError(f"src must be float rows [rows, width] to encode, got {src.dtype} of shape {list(src.shape)}")
    count = check_row_move(_int8_like(src), src_idx, q, dst_idx, mask, count)
    _launch(src, src_idx, q, dst_idx, mask, count, None, None, scale, kind, config, None)
    return q


def _need_triton():
    if triton is None:
        raise RuntimeError("triton is not installed (pip install -e .[dev])")


def _int8_like(t: torch.Tensor) -> torch.Tensor:
    """A tensor of ``t``'s shape and strides and no storage, for the shape checks."""
    return torch.empty_strided(t.shape, t.stride(), dtype=torch.int8, device="meta")


def _check_codes(q, scale, qname: str, sname: str) -> None:
    if not isinstance(q, torch.Tensor) or q.dtype != torch.int8 or q.dim() != 2:
        raise TypeError(f"{qname} must be an int8 tensor [rows, width], got "
                        f"{getattr(q, 'dtype', type(q).__name__)} of shape {list(getattr(q, 'shape', []))}")
    if (not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32 or scale.dim() != 1
            or scale.shape[0] != q.shape[0] or scale.device != q.device):
        raise ValueError(f"{sname} must be a 1-d float32 tensor of {q.shape[0]} entries on {q.device}, got "
                         f"{getattr(scale, 'dtype', type(scale).__name__)} of shape "
                         f"{list(getattr(scale, 'shape', []))}")


def launch_config(src: torch.Tensor, dst: torch.Tensor, kind: str | None = None,
                  config: MoverConfig | None = None) -> MoverConfig:
    """The launch a move from ``src`` to ``dst`` takes: ``config``, else the interpreter's
    tiles under the interpreter, else :func:`default_config` for ``kind`` (default: from
    where the tensors live) and the source's row bytes (``+ 4`` for 8-bit codes)."""
    if kind is not None and kind not in MAX_PROGRAMS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if config is not None:
        return _check_config(config)
    if _INTERPRET and not _target.active():
        return INTERPRETER_CONFIG
    width = src.shape[1] if src.dim() == 2 else 1
    row_bytes = width * src.element_size() + (4 if src.dtype == torch.int8 else 0)
    return default_config(kind or _kind(src, dst), row_bytes, width)


_NO_LOCK = contextlib.nullcontext()


def _launch(src, src_idx, dst, dst_idx, mask, count, round_dtype, src_scale, dst_scale, kind, config,
            max_programs) -> None:
    if not _INTERPRET and dst.device.type != "cuda":
        raise ValueError(f"dst must be a CUDA tensor (or set TRITON_INTERPRET=1 before import), got {dst.device}")
    cfg = launch_config(src, dst, kind, config)
    if max_programs is not None:
        if isinstance(max_programs, bool) or not isinstance(max_programs, int) or max_programs < 1:
            raise ValueError(f"max_programs must be an int >= 1, got {max_programs!r}")
        cfg = cfg._replace(max_programs=max_programs)
    if count == 0 or src.numel() == 0:
        return
    s2, d2 = _as_2d(src), _as_2d(dst)
    width = s2.shape[1]
    block_w = cfg.block_w or min(triton.next_power_of_2(width), WHOLE_ROW_MAX)
    block_r = cfg.rows_per_pass
    grid = (max(1, min(cfg.max_programs, triton.cdiv(count, block_r))),)
    decode, encode = src_scale is not None, dst_scale is not None
    round_q8 = round_dtype == INT8_ROWWISE
    value_dtype = torch.float32 if (src.dtype == torch.bfloat16 and dst.dtype != torch.bfloat16) or decode \
        else src.dtype                                     # after the load
    # Rounding through a dtype only matters when it is narrower than the values.
    rnd = (round_dtype is not None and not round_q8 and src.is_floating_point()
           and _narrows(value_dtype, round_dtype))
    src_bf16 = src.dtype == torch.bfloat16 and dst.dtype != torch.bfloat16
    round_bf16 = rnd and _bf16_from_f32(value_dtype, round_dtype)
    dst_bf16 = dst.is_floating_point() and _bf16_from_f32(value_dtype, dst.dtype)
    dummy = dst if mask is None else mask
    with on_device(dst.device), (_INTERPRET_LOCK if _INTERPRET else _NO_LOCK):
        _move_rows_kernel[grid](
            s2, src_idx if src_idx is not None else s2, d2, dst_idx if dst_idx is not None else d2,
            mask.view(torch.uint8) if mask is not None else dummy,
            src_scale if decode else s2, dst_scale if encode else d2, count, width,
            s2.stride(0), d2.stride(0),
            HAS_SRC_IDX=src_idx is not None, HAS_DST_IDX=dst_idx is not None, HAS_MASK=mask is not None,
            ROUND=rnd, ROUND_DTYPE=_tl_dtype(round_dtype) if rnd else tl.float32,
            ROUND_BF16=round_bf16, DST_BF16=dst_bf16, SRC_BF16=src_bf16,
            DECODE=decode, ENCODE=encode, ROUND_Q8=round_q8, AMAX=encode or round_q8,
            BLOCK_R=block_r, BLOCK_W=block_w, num_warps=cfg.num_warps)
