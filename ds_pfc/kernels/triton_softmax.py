"""Fused Triton kernels for the Partial-FC margin softmax: log-sum-exp statistics and the gradient.

The logits ``z = scale * <x_hat[n], w_hat[j]>`` of an ``N x S`` block are recomputed tile by tile
in registers and never written to memory: the forward keeps an online (running max, rescaled
sum) log-sum-exp per sample, the backward forms ``G = coef * exp(z - row_max)`` per tile and feeds
it straight into the second matrix product. The normalised centers ``w_hat = w * w_inv_norm`` are
formed on the loaded tile, so no normalised copy of ``w`` exists either.

Every kernel holds one tile resident for its whole life and streams the other operand past it:

* ``lse_stats`` and the ``dx_hat`` half of ``grad`` hold a tile of samples and stream class tiles.
  The class dimension is split over ``SPLITS`` programs per sample tile (N is small, S large);
  each writes per-split partials that a few torch ops combine.
* the ``dw`` half of ``grad`` holds a tile of classes and streams every sample tile, so it owns
  complete rows of ``dw_hat`` and can project them through the normalisation in its epilogue.

The target entry of each sample (handled by the caller, which applies the margin) and, with a
``threshold``, negatives whose cosine exceeds it (PFC's noise filter) are excluded from ``m``,
``l`` and ``G``.

Importing this module imports triton; ``TRITON_INTERPRET=1`` must be set before that import to
run the kernels on CPU tensors with Triton's interpreter (this is how the tests run without a GPU).
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from . import _target

__all__ = ["available", "check_device", "lse_stats", "grad", "tile_config"]

# Triton decides at decoration time whether ``@triton.jit`` yields an interpreted function, so
# what counts is the environment when this module was imported, not later. The kernels also call
# triton's own jit'd library (tl.zeros, tl.cdiv, ...), decorated when triton was first imported:
# if that happened before TRITON_INTERPRET=1 was set, the interpreter cannot run them either.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_TRITON_INTERPRETED = type(tl.zeros).__name__ == "InterpretedFunction"

_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}

# ---------------------------------------------------------------------------------------------
# Tile table: the ONLY place where tile sizes and launch parameters are chosen.
#
# Key: (operand kind, largest padded width D it serves). Value: (HELD, STREAMED, num_warps,
# num_stages). Every kernel keeps a HELD-row tile of one operand (with its [HELD, D] float32
# accumulator in the backward) and loops over STREAMED-row tiles of the other:
#   lse_stats, dx kernel: HELD = BLOCK_N (samples),  STREAMED = BLOCK_S (classes)
#   dw kernel:            HELD = BLOCK_S (classes),  STREAMED = BLOCK_N (samples)
# so one entry bounds both backward kernels' registers and shared memory alike.
#
# Sized for Hopper (sm_90: 227 KiB = 232448 bytes of shared memory per block, at most 255
# registers per thread) from what Triton 3.9 and its bundled ptxas (13.4, sm_90a) compile each
# kernel to: tests/test_triton_softmax.py::test_kernels_compile_for_sm90 compiles every row up to
# D = 512 for sm_90 without a GPU and checks shared memory and register spills. Observations that
# shaped the rows (reasoned from compiler output, not autotuned on a GPU):
# * Shared memory is never the limit (at most 149504 bytes up to D = 512); registers are. The dw
#   kernel is the most demanding: besides its [HELD, D] float32 accumulator it keeps the held w
#   operand and the [HELD, STREAMED] cosine and G tiles live, so a row that suits lse/dx can still
#   spill there.
# * "lowp" (bf16/fp16) dots run on tensor cores. With 8 warps, HELD = 64 is spill-free up to
#   D = 128 (with STREAMED <= 32); at D = 256 / 512 every HELD = 64 (or 128) row spills in the dw
#   kernel (16 warps cap registers at 128 and spill more), hence HELD = 32 / 16 there.
# * "fp32" dots use input_precision="ieee": FMA, no TF32, and each thread's operand rows span the
#   whole K = D, so tiles are small. ptxas either fits such a kernel or falls back to ~32
#   registers with hundreds of spilled 4-byte words (Triton's n_spills), and which one depends on
#   num_stages in opposite ways for the kernels: at D = 512 lse/dx fit only with num_stages = 1
#   and dw only with >= 2. No shared row avoids that; the row chosen keeps lse/dx spill-free and
#   leaves ~550 spilled words in the fp32 dw kernel at D = 512 (D = 256: <= 52 words in lse/dx,
#   dw clean).
_TILES = {
    ("lowp", 64): (64, 32, 8, 3),    # also serves D = 16, 32
    ("lowp", 128): (64, 16, 8, 3),
    ("lowp", 256): (32, 32, 8, 3),
    ("lowp", 512): (16, 32, 8, 3),
    ("fp32", 64): (16, 64, 8, 2),
    ("fp32", 128): (16, 16, 8, 2),
    ("fp32", 256): (16, 16, 8, 2),
    ("fp32", 512): (16, 32, 16, 1),
    # Beyond the practical range (d <= 512); wider D reuses the last row. Compiled for sm_90 once
    # (lowp: 36 spilled words, in dw; fp32: dw spills ~1500 words), not covered by the test.
    ("lowp", 1024): (16, 16, 8, 2),
    ("fp32", 1024): (16, 16, 8, 1),
}
# Under the interpreter every program runs as numpy on the CPU: small tiles keep tests fast and
# make the small test shapes span several tiles and splits (ragged edges, partial combines).
_INTERPRET_TILES = (16, 16, 1, 1)
# Programs per SM the class split aims for (a few waves), and the pretend SM count of the
# interpreter (small, so that CPU tests still exercise several splits).
_WAVES = 4
_INTERPRET_SMS = 2


def tile_config(compute_dtype: torch.dtype, D: int, interpret: bool | None = None):
    """``(HELD, STREAMED, num_warps, num_stages)`` for a compute dtype and padded width ``D``."""
    if interpret if interpret is not None else (_INTERPRET and not _target.active()):
        return _INTERPRET_TILES
    kind = "fp32" if compute_dtype == torch.float32 else "lowp"
    widths = sorted(w for k, w in _TILES if k == kind)
    width = next((w for w in widths if D <= w), widths[-1])
    return _TILES[(kind, width)]


# ---------------------------------------------------------------------------------------------
# Device helpers


def available() -> bool:
    """Whether the triton backend can be used at all (triton importable)."""
    try:
        import triton  # noqa: F401, F811
    except ImportError:
        return False
    return True


def check_device(t: torch.Tensor) -> None:
    """Raise a clear error when ``t`` lives where these kernels cannot run."""
    if t.device.type == "cpu" and not (_INTERPRET and _TRITON_INTERPRETED):
        raise RuntimeError(
            "the triton backend needs a CUDA device, or TRITON_INTERPRET=1 for the CPU interpreter, "
            "which must be set before ds_pfc.kernels.triton_softmax (and triton itself) is imported")
    if t.device.type not in ("cpu", "cuda"):
        raise RuntimeError(f"the triton backend does not support tensors on {t.device}")


def _num_sms(device: torch.device) -> int:
    return _target.sms() or _device_sms(device)   # inside _target.gpu_tiles: the target's SMs


@functools.lru_cache(maxsize=None)
def _device_sms(device: torch.device) -> int:
    if _INTERPRET or device.type != "cuda":
        return _INTERPRET_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def _split(held_tiles: int, stream_tiles: int, device: torch.device) -> tuple[int, int]:
    """``(splits, tiles_per_split)`` over the streamed class tiles for ``held_tiles`` sample tiles.

    Aim for ``_WAVES`` programs per SM in total, but never more splits than class tiles, and
    no empty split (each split gets ``tiles_per_split`` tiles, the last possibly fewer).
    """
    want = triton.cdiv(_WAVES * _num_sms(device), max(1, held_tiles))
    splits = max(1, min(stream_tiles, want))
    per = triton.cdiv(stream_tiles, splits)
    return triton.cdiv(stream_tiles, per), per


# ---------------------------------------------------------------------------------------------
# Kernel building blocks


@triton.jit
def _operand(t, COMPUTE: tl.constexpr, UPCAST: tl.constexpr):
    """Round a float32 tile to the dot's operand dtype (round to nearest even, as on the GPU).

    UPCAST (interpreter only) works around two bugs of Triton's interpreter, both reproduced on
    triton 3.9.0: ``tl.dot`` on bf16 operands multiplies raw bit patterns (triton-lang/triton
    #11584), and the float32 -> bf16 cast truncates instead of rounding to nearest. There the
    tile is rounded by hand and kept in float32: products of bf16/fp16 values are exact in
    float32, so the dot equals a bf16/fp16 dot with float32 accumulation. On the GPU the tile is
    cast to COMPUTE and the dot runs on tensor cores.
    """
    if UPCAST:
        if COMPUTE == tl.bfloat16:
            # Round to nearest even at bit 16: add 0x7FFF plus the lowest kept bit, then truncate.
            bits = t.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            t = bits.to(tl.float32, bitcast=True)
        else:
            t = t.to(COMPUTE).to(tl.float32)
    else:
        t = t.to(COMPUTE)
    return t


@triton.jit
def _load_rows(ptr, rows, row_ok, dims, dim_ok, d):
    """float32 [len(rows), D] tile of a row-major [*, d] matrix; padding and ragged rows are 0."""
    # int64 offsets: S * d exceeds 2**31 for the largest shards.
    offs = rows.to(tl.int64)[:, None] * d + dims[None, :]
    return tl.load(ptr + offs, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)


@triton.jit
def _negative_logits(cos, col, tgt, valid, scale, threshold, HAS_THRESHOLD: tl.constexpr):
    """Per-entry transform shared by all kernels: ``(z, keep)`` for a tile of cosines.

    ``col`` / ``tgt`` broadcast against ``cos`` (class index of each column, target column of
    each sample; either orientation). The target entry is excluded (the caller adds it back with
    its margin), as are filtered negatives (``cos > threshold``) and out-of-range padding.

    Extension point: per-sample margin parameters or a transform of the negative logits (e.g.
    CurricularFace's ``cos * (t + cos)`` for hard negatives ``cos > cos_theta_m``) belong here:
    load the per-sample tensors by row next to ``tgt`` in each kernel, pass them in, and select the
    transform with a new ``MODE: tl.constexpr``; the backward then also needs dz/dcos here.
    """
    keep = valid & (col != tgt)
    if HAS_THRESHOLD:
        keep = keep & (cos <= threshold)
    z = cos * scale
    return z, keep


@triton.jit
def _grad_entries(cos, col, tgt, valid, coef, row_max, scale, threshold,
                  HAS_THRESHOLD: tl.constexpr):
    """``G = coef * exp(z - row_max)`` on kept entries, exactly 0 on excluded ones."""
    z, keep = _negative_logits(cos, col, tgt, valid, scale, threshold, HAS_THRESHOLD)
    # ``where`` (not a product with a 0/1 mask): exp may overflow to inf on excluded entries,
    # e.g. for a sample with nothing kept whose row_max is -inf.
    return tl.where(keep, coef * tl.exp(z - row_max), 0.0)


# ---------------------------------------------------------------------------------------------
# Kernels


@triton.jit
def _sample_tile(x_ptr, tgt_ptr, N, d, pid_n, BLOCK_N: tl.constexpr, D: tl.constexpr,
                 COMPUTE: tl.constexpr, UPCAST: tl.constexpr):
    """The held sample tile of the forward and dX kernels: row ids and mask, padded
    dims and mask, the embeddings as dot operands, the target columns."""
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    dims = tl.arange(0, D)
    dim_ok = dims < d
    x = _operand(_load_rows(x_ptr, rows, row_ok, dims, dim_ok, d), COMPUTE, UPCAST)
    tgt = tl.load(tgt_ptr + rows, mask=row_ok, other=-1)
    return rows, row_ok, dims, dim_ok, x, tgt


@triton.jit
def _class_tile(w_ptr, w_inv_ptr, t, S, dims, dim_ok, d, BLOCK_S: tl.constexpr):
    """Class tile ``t``: column ids and mask, and the normalised centers (float32)."""
    cols = t * BLOCK_S + tl.arange(0, BLOCK_S)
    col_ok = cols < S
    w_inv = tl.load(w_inv_ptr + cols, mask=col_ok, other=0.0)
    return cols, col_ok, _load_rows(w_ptr, cols, col_ok, dims, dim_ok, d) * w_inv[:, None]


@triton.jit
def _lse_kernel(x_ptr, w_ptr, w_inv_ptr, tgt_ptr, m_ptr, l_ptr, max_cos_ptr,
                N, S, d, tiles_per_split, scale, threshold,
                HAS_THRESHOLD: tl.constexpr, WANT_MAX_COS: tl.constexpr,
                COMPUTE: tl.constexpr, UPCAST: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr, D: tl.constexpr):
    """Grid (sample tiles, splits): partial m, l (and max cos) of one sample tile over one split."""
    pid_k = tl.program_id(1)
    rows, row_ok, dims, dim_ok, x, tgt = _sample_tile(x_ptr, tgt_ptr, N, d, tl.program_id(0), BLOCK_N, D,
                                                      COMPUTE, UPCAST)

    m = tl.full([BLOCK_N], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_N], tl.float32)
    max_cos = tl.full([BLOCK_N], float("-inf"), tl.float32)
    first = pid_k * tiles_per_split
    last = tl.minimum(first + tiles_per_split, tl.cdiv(S, BLOCK_S))
    for t in range(first, last):
        cols, col_ok, w_hat = _class_tile(w_ptr, w_inv_ptr, t, S, dims, dim_ok, d, BLOCK_S)
        cos = tl.dot(x, tl.trans(_operand(w_hat, COMPUTE, UPCAST)), input_precision="ieee")
        if WANT_MAX_COS:
            # Raw cosines of every class but the target (filtered negatives included): the
            # caller compares the target's cosine with this for top-1 accuracy.
            other = col_ok[None, :] & (cols[None, :] != tgt[:, None])
            max_cos = tl.maximum(max_cos, tl.max(tl.where(other, cos, float("-inf")), axis=1))
        z, keep = _negative_logits(cos, cols[None, :], tgt[:, None], col_ok[None, :],
                                   scale, threshold, HAS_THRESHOLD)
        z = tl.where(keep, z, float("-inf"))
        m_new = tl.maximum(m, tl.max(z, axis=1))
        # Shift by 0 while a row has kept nothing yet: exp(-inf - -inf) would be nan, while
        # exp(-inf - 0) = 0 leaves l = 0 as it should.
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        l = l * tl.exp(m - shift) + tl.sum(tl.exp(z - shift[:, None]), axis=1)
        m = m_new

    out = pid_k * N + rows
    tl.store(m_ptr + out, m, mask=row_ok)
    tl.store(l_ptr + out, l, mask=row_ok)
    if WANT_MAX_COS:
        tl.store(max_cos_ptr + out, max_cos, mask=row_ok)


@triton.jit
def _grad_x_kernel(x_ptr, w_ptr, w_inv_ptr, tgt_ptr, coef_ptr, row_max_ptr, dx_ptr,
                   N, S, d, tiles_per_split, scale, threshold,
                   HAS_THRESHOLD: tl.constexpr, COMPUTE: tl.constexpr, UPCAST: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr, D: tl.constexpr):
    """Grid (sample tiles, splits): partial ``dx_hat = G @ w_hat`` of one sample tile, one split."""
    pid_k = tl.program_id(1)
    rows, row_ok, dims, dim_ok, x, tgt = _sample_tile(x_ptr, tgt_ptr, N, d, tl.program_id(0), BLOCK_N, D,
                                                      COMPUTE, UPCAST)
    coef = tl.load(coef_ptr + rows, mask=row_ok, other=0.0)
    row_max = tl.load(row_max_ptr + rows, mask=row_ok, other=0.0)

    acc = tl.zeros([BLOCK_N, D], tl.float32)
    first = pid_k * tiles_per_split
    last = tl.minimum(first + tiles_per_split, tl.cdiv(S, BLOCK_S))
    for t in range(first, last):
        cols, col_ok, w_hat = _class_tile(w_ptr, w_inv_ptr, t, S, dims, dim_ok, d, BLOCK_S)
        w_op = _operand(w_hat, COMPUTE, UPCAST)
        cos = tl.dot(x, tl.trans(w_op), input_precision="ieee")
        g = _grad_entries(cos, cols[None, :], tgt[:, None], row_ok[:, None] & col_ok[None, :],
                          coef[:, None], row_max[:, None], scale, threshold, HAS_THRESHOLD)
        acc = tl.dot(_operand(g, COMPUTE, UPCAST), w_op, acc, input_precision="ieee")

    offs = (pid_k * N + rows).to(tl.int64)[:, None] * d + dims[None, :]
    tl.store(dx_ptr + offs, acc, mask=row_ok[:, None] & dim_ok[None, :])


@triton.jit
def _grad_w_kernel(x_ptr, w_ptr, w_inv_ptr, tgt_ptr, coef_ptr, row_max_ptr, dw_ptr,
                   N, S, d, scale, threshold,
                   HAS_THRESHOLD: tl.constexpr, COMPUTE: tl.constexpr, UPCAST: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr, D: tl.constexpr):
    """Grid (class tiles,): ``dw`` of one class tile, over all samples, projected in the epilogue."""
    pid = tl.program_id(0)
    cols = pid * BLOCK_S + tl.arange(0, BLOCK_S)
    col_ok = cols < S
    dims = tl.arange(0, D)
    dim_ok = dims < d
    w_inv = tl.load(w_inv_ptr + cols, mask=col_ok, other=0.0)
    w_op = _operand(_load_rows(w_ptr, cols, col_ok, dims, dim_ok, d) * w_inv[:, None],
                    COMPUTE, UPCAST)

    # Class-major throughout (cos^T, G^T), so G^T feeds the second dot without a transpose.
    acc = tl.zeros([BLOCK_S, D], tl.float32)
    for n0 in range(0, N, BLOCK_N):
        rows = n0 + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        x = _operand(_load_rows(x_ptr, rows, row_ok, dims, dim_ok, d), COMPUTE, UPCAST)
        tgt = tl.load(tgt_ptr + rows, mask=row_ok, other=-1)
        coef = tl.load(coef_ptr + rows, mask=row_ok, other=0.0)
        row_max = tl.load(row_max_ptr + rows, mask=row_ok, other=0.0)
        cos_t = tl.dot(w_op, tl.trans(x), input_precision="ieee")
        g_t = _grad_entries(cos_t, cols[:, None], tgt[None, :], col_ok[:, None] & row_ok[None, :],
                            coef[None, :], row_max[None, :], scale, threshold, HAS_THRESHOLD)
        acc = tl.dot(_operand(g_t, COMPUTE, UPCAST), x, acc, input_precision="ieee")

    # Through w_hat = w / ||w||: remove the radial part (with the float32 w_hat, as autograd
    # would), then divide by the norm. Reloaded rather than kept live through the loop.
    w_hat = _load_rows(w_ptr, cols, col_ok, dims, dim_ok, d) * w_inv[:, None]
    radial = tl.sum(w_hat * acc, axis=1)
    dw = (acc - w_hat * radial[:, None]) * w_inv[:, None]
    offs = cols.to(tl.int64)[:, None] * d + dims[None, :]
    tl.store(dw_ptr + offs, dw, mask=col_ok[:, None] & dim_ok[None, :])


# ---------------------------------------------------------------------------------------------
# Python entry points


def _validate(x_hat, w, w_inv_norm, target_col, compute_dtype, **per_sample):
    tensors = dict(x_hat=x_hat, w=w, w_inv_norm=w_inv_norm, target_col=target_col, **per_sample)
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if x_hat.dim() != 2:
        raise ValueError(f"x_hat: expected shape [N, d], got {tuple(x_hat.shape)}")
    if w.dim() != 2 or w.shape[1] != x_hat.shape[1]:
        raise ValueError(f"w: expected shape [S, {x_hat.shape[1]}], got {tuple(w.shape)}")
    n, s = x_hat.shape[0], w.shape[0]
    shapes = dict(w_inv_norm=(s,), target_col=(n,), **{k: (n,) for k in per_sample})
    for name, shape in shapes.items():
        if tuple(tensors[name].shape) != shape:
            raise ValueError(f"{name}: expected shape {list(shape)}, got {list(tensors[name].shape)}")
    for name, t in tensors.items():
        want = torch.int64 if name == "target_col" else torch.float32
        if t.dtype != want:
            raise TypeError(f"{name}: expected dtype {want}, got {t.dtype}")
        if not t.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous tensor")
        if t.device != x_hat.device:
            raise ValueError(f"{name}: on {t.device}, but x_hat is on {x_hat.device}")
    if compute_dtype not in _TL_DTYPES:
        raise TypeError(f"compute_dtype: expected one of {list(_TL_DTYPES)}, got {compute_dtype}")
    check_device(x_hat)


def _launch_args(x_hat, compute_dtype, threshold):
    d = x_hat.shape[1]
    D = max(16, triton.next_power_of_2(d))   # tl.dot needs K >= 16
    held, streamed, num_warps, num_stages = tile_config(compute_dtype, D)
    consts = dict(HAS_THRESHOLD=threshold is not None, COMPUTE=_TL_DTYPES[compute_dtype],
                  UPCAST=_INTERPRET and compute_dtype != torch.float32, D=D)
    launch = dict(num_warps=num_warps, num_stages=num_stages)
    return held, streamed, consts, launch


def lse_stats(x_hat, w, w_inv_norm, target_col, *, scale, threshold, compute_dtype,
              want_max_cos: bool):
    """Per-sample log-sum-exp statistics of the non-target, unfiltered logits of this shard.

    Returns ``(m, l, max_cos)``, float32 ``[N]``: ``m`` the largest kept logit ``scale * cos``
    (-inf if none), ``l = sum exp(z - m)`` over kept entries (0 if none), and with
    ``want_max_cos`` the largest cosine over all classes but the target, filtered ones
    included (-inf when there is none); otherwise ``None``. Only ``[SPLITS, N]`` partials touch memory.
    """
    _validate(x_hat, w, w_inv_norm, target_col, compute_dtype)
    n, d = x_hat.shape
    s = w.shape[0]
    dev = x_hat.device
    m = torch.full((n,), float("-inf"), dtype=torch.float32, device=dev)
    l = torch.zeros(n, dtype=torch.float32, device=dev)
    max_cos = torch.full((n,), float("-inf"), dtype=torch.float32, device=dev) if want_max_cos else None
    if n == 0 or s == 0:
        return m, l, max_cos

    block_n, block_s, consts, launch = _launch_args(x_hat, compute_dtype, threshold)
    n_tiles = triton.cdiv(n, block_n)
    splits, per = _split(n_tiles, triton.cdiv(s, block_s), dev)
    m_k = torch.empty(splits, n, dtype=torch.float32, device=dev)
    l_k = torch.empty_like(m_k)
    max_cos_k = torch.empty_like(m_k) if want_max_cos else m_k   # dummy pointer when unused
    _lse_kernel[(n_tiles, splits)](
        x_hat, w, w_inv_norm, target_col, m_k, l_k, max_cos_k,
        n, s, d, per, float(scale), float(threshold if threshold is not None else 0.0),
        WANT_MAX_COS=bool(want_max_cos), BLOCK_N=block_n, BLOCK_S=block_s, **consts, **launch)

    m = m_k.amax(dim=0)
    # Same guard as in the kernel: a row with nothing kept anywhere has m = -inf.
    shift = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    l = (l_k * torch.exp(m_k - shift)).sum(dim=0)
    if want_max_cos:
        max_cos = max_cos_k.amax(dim=0)
    return m, l, max_cos


def grad(x_hat, w, w_inv_norm, target_col, coef, row_max, *, scale, threshold, compute_dtype):
    """Backward of the non-target logits: ``(dx_hat [N, d], dw [S, d])``, float32.

    With ``G[n, j] = coef[n] * exp(z[n, j] - row_max[n])`` on kept entries (0 on the target and
    filtered ones): ``dx_hat = G @ w_hat`` and ``dw`` = ``dw_hat = G^T @ x_hat`` taken through the
    normalisation ``w_hat = w * w_inv_norm``. Logits are recomputed; nothing N x S is stored.

    Cost: both kernels recompute the cosines, so 8 N S d FLOPs (vs 2 N S d for the forward).
    Memory beyond the outputs: ``[SPLITS, N, d]`` float32 partials of dx_hat (SPLITS is at most
    ~4 x SMs / sample tiles, e.g. ~20 MiB for N = 2048, d = 512 on 132 SMs with 16-sample tiles).
    """
    _validate(x_hat, w, w_inv_norm, target_col, compute_dtype, coef=coef, row_max=row_max)
    n, d = x_hat.shape
    s = w.shape[0]
    dev = x_hat.device
    if n == 0 or s == 0:
        return (torch.zeros(n, d, dtype=torch.float32, device=dev),
                torch.zeros(s, d, dtype=torch.float32, device=dev))

    held, streamed, consts, launch = _launch_args(x_hat, compute_dtype, threshold)
    args = (float(scale), float(threshold if threshold is not None else 0.0))

    # dx: hold sample tiles, stream class tiles split over programs, sum the partials.
    n_tiles = triton.cdiv(n, held)
    splits, per = _split(n_tiles, triton.cdiv(s, streamed), dev)
    dx_k = torch.empty(splits, n, d, dtype=torch.float32, device=dev)
    _grad_x_kernel[(n_tiles, splits)](
        x_hat, w, w_inv_norm, target_col, coef, row_max, dx_k, n, s, d, per, *args,
        BLOCK_N=held, BLOCK_S=streamed, **consts, **launch)
    dx_hat = dx_k.sum(dim=0) if splits > 1 else dx_k[0]

    # dw: hold class tiles (complete rows of dw_hat, for the projection), stream all samples.
    # One program per class tile fills the GPU for S >~ 4 x SMs x HELD; for smaller shards the
    # sample loop could be split too (the projection is linear, so partials may be projected
    # separately and summed), not done as such shards are cheap anyway.
    dw = torch.empty(s, d, dtype=torch.float32, device=dev)
    _grad_w_kernel[(triton.cdiv(s, held),)](
        x_hat, w, w_inv_norm, target_col, coef, row_max, dw, n, s, d, *args,
        BLOCK_N=streamed, BLOCK_S=held, **consts, **launch)
    return dx_hat, dw
