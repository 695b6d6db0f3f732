"""Triton kernels of the Partial-FC margin softmax: statistics in the forward, the gradient in the backward.

One step at the standard shape (N = 2048 gathered samples, S = 800k active classes per rank,
d = 512, bf16) is ``8 N S d`` matrix FLOPs in four products of equal size, and the design keeps
every one of them on the tensor cores at a high arithmetic intensity:

1. ``prepare`` (one pass over the centers): ``w_inv = 1 / ||w||`` and ``w_hat = w * w_inv``
   rounded once to the compute dtype. Every later kernel loads 2-byte operands and does no
   normalisation or conversion in its inner loop. Accepts float32/bf16/fp16 centers with any
   row stride.
2. ``lse_stats`` (forward, ``2 N S d``): 2-D output tiles (samples x classes) with a K-loop over
   ``d``, so a tile of ``BM x BN`` logits costs ``(BM + BN) d`` operand bytes from L2 (64 FLOP/B at
   128 x 128). The epilogue excludes the target and filtered negatives, scales, and folds the
   tile into an online (running max, rescaled sum) log-sum-exp per sample. Programs are laid out
   as (sample tiles, class splits); only ``[SPLITS, N]`` partials reach memory.
3. ``grad`` (backward), per block of classes (``block_bytes`` of G):

   * the G kernel (``2 N S d``) recomputes each cosine tile the same way and writes
     ``G / c = coef / c * exp(z - row_max)`` (``c = max |coef|``) in the compute dtype, class-major,
     plus ``rho[j] = sum_n G[n, j] cos[n, j] / c`` (the radial part of ``dw_hat``, needed by the
     projection) -- the only ``N x S``-sized buffer, bounded by ``block_bytes``;
   * ``dx_hat += c * G^T w_hat`` is a cuBLAS product (``2 N S d``; float32 output);
   * the dW kernel (``2 N S d``) is a GEMM ``G x_hat`` with the normalisation projection
     ``dw = c * w_inv * (G x_hat - w_hat rho)`` in its epilogue, so ``dw_hat`` never reaches memory.

   Scaling G by ``1 / c`` keeps it in range: at initialisation ``coef`` is ~5e-9 (N = 2048, 6.4M
   classes), below float16's smallest subnormal; relative to the largest row coefficient every
   entry that matters is representable, and ``c`` is applied in float32 afterwards.

With bf16 products and a scale within :func:`exp_scale_bound`, a training step can keep the
exponentials instead (:func:`exp_stats`, :func:`grad_exp`): the forward stores bf16
``E = exp(scale cos - scale / 2)`` (a fixed shift: no running max), and the backward is two
cuBLAS products over E with the per-sample factors folded in, then the projection pass, with
no G kernel or G pass. :func:`grad_kept` (kept float16 cosines) serves fp16 products.

The target entry of each sample (the caller applies the margin to it) and, with a ``threshold``,
negatives whose cosine exceeds it (PFC's noise filter) are excluded from the statistics and from G.

Importing this module imports triton; ``TRITON_INTERPRET=1`` must be set before that import to
run the kernels on CPU tensors with Triton's interpreter (this is how the tests run without a GPU).
"""
from __future__ import annotations

import functools
import math
import os

import torch
import triton
import triton.language as tl

from . import _target
from ._device import on_device

__all__ = ["available", "check_device", "prepare", "lse_stats", "grad", "grad_kept", "keep_dtype", "tile_config",
           "TILES", "on_device", "exp_stats", "grad_exp", "exp_scale_bound", "EXP_SHIFT"]

# Triton decides at decoration time whether ``@triton.jit`` yields an interpreted function, so
# what counts is the environment when this module was imported, not later. The kernels also call
# triton's own jit'd library (tl.zeros, tl.cdiv, ...), decorated when triton was first imported:
# if that happened before TRITON_INTERPRET=1 was set, the interpreter cannot run them either.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_TRITON_INTERPRETED = type(tl.zeros).__name__ == "InterpretedFunction"

_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
_NORM_EPS = 1e-12

# ---------------------------------------------------------------------------------------------
# Tile table: the ONLY place where tile sizes and launch parameters are chosen.
#
# (kernel, operand kind) -> (BLOCK_A, BLOCK_B, BLOCK_K, num_warps, num_stages):
#   "lse": A = samples, B = classes, K over d. Grid (sample tiles, class splits).
#   "g":   A = classes, B = samples, K over d. Grid (class tiles of the block,); each program
#          walks every sample tile, so it owns complete sums rho of its classes.
#   "dw":  A = classes, B = dims,    K over samples. Grid (class tiles, pairs of dim tiles).
#   "prep": A = rows, B = dims per chunk (K unused): A x B elements per program. A row of up to
#          A x B elements (next_pow2(d)) is read once, whole, by programs of A x B / next_pow2(d)
#          rows; a wider one in B-column chunks, twice (the norm first, then the scaled copy).
# Each kernel computes several B tiles per loaded A slice (lse and dw four, g two), so its
# operand traffic is that of one A x (parts * B) tile while only one part's epilogue is live in
# registers. "lowp" (bf16/fp16), 8 warps (two warpgroups, as Hopper's wgmma wants), K step 64:
# * lse: 128 samples x 4 x 64 classes: (128 + 256) * 64 * 2 B = 48 KiB of operands per stage for
#   2 * 128 * 256 * 64 FLOP, 85 FLOP per byte of L2 traffic; "lse_max" (with a threshold, when
#   the largest cosine must be tracked apart from the log-sum-exp): 4 x 32 classes, 64 FLOP/B;
# * g: 128 classes x 2 x 64 samples, 64 FLOP/B (its epilogue writes G and sums rho: four parts
#   of 64 spill);
# * dw: 128 classes x 4 x 64 dims, 85 FLOP/B.
# Larger tiles spill on sm_90: the exp epilogue of a part plus the other parts' accumulators
# exceed 255 registers.
TILES = {
    ("lse", "lowp"): (128, 64, 64, 8, 3),
    ("lse_max", "lowp"): (128, 32, 64, 8, 3),
    ("g", "lowp"): (128, 64, 64, 8, 3),
    ("dw", "lowp"): (128, 64, 64, 8, 3),
    ("lse", "fp32"): (64, 32, 32, 4, 2),
    ("lse_max", "fp32"): (64, 32, 32, 4, 2),
    ("g", "fp32"): (64, 32, 32, 4, 2),
    ("dw", "fp32"): (64, 32, 32, 4, 2),
    ("prep", "lowp"): (8, 256, 0, 4, 1),
    ("prep", "fp32"): (8, 256, 0, 4, 1),
    ("gpass", "lowp"): (32, 128, 0, 8, 1),
    ("gpass", "fp32"): (32, 128, 0, 8, 1),
    ("proj", "lowp"): (8, 256, 0, 4, 1),
    ("proj", "fp32"): (8, 256, 0, 4, 1),
}
# Before Hopper (mma.sync: sm_80 A100, sm_86 A10 / RTX 30, sm_89 L40S / RTX 40) the forward's
# accumulators live in the registers of all eight warps rather than in wgmma's: 128 x 4 x 64
# with its epilogue needs more than 255 registers and spills 34-58 words. 128 x 4 x 32 classes
# with a K step of 32 holds 177-191 registers and spills nothing in every specialisation (plain,
# with a threshold, tracking the largest cosine, storing cosines or E; checked offline for
# sm_80/86/89 by tests/test_grids_and_budgets.py), 64 FLOP per byte of operand traffic.
MMA_SYNC_TILES = {
    ("lse", "lowp"): (128, 32, 32, 8, 3),
    ("lse_max", "lowp"): (128, 32, 32, 8, 3),
}
# Under the interpreter every program runs as numpy on the CPU: small tiles keep tests fast and
# make the small test shapes span several tiles, K steps and splits (ragged edges everywhere).
_INTERPRET_TILES = {"lse": (16, 16, 16, 1, 1), "lse_max": (16, 16, 16, 1, 1), "g": (16, 16, 16, 1, 1), "dw": (16, 16, 16, 1, 1),
                    "prep": (4, 16, 0, 1, 1), "gpass": (16, 16, 0, 1, 1), "proj": (4, 16, 0, 1, 1)}
# Programs per SM the class split of the forward aims for (a few waves), and the pretend SM
# count of the interpreter (small, so that CPU tests still exercise several splits).
_WAVES = 4
_INTERPRET_SMS = 2
# Resident CTAs per SM of the forward kernel (_lse_kernel, "lse" tiles): its sm_90 cubin holds
# 246 registers x 256 threads, one CTA per SM (ds_pfc.bench.model.machine_code reads it).
_LSE_CTAS_PER_SM = 1
# Samples per split of the backward kernels (G and dW): above it they also split the samples
# over programs, so that a large batch with few active classes per rank (e.g. N = 24,576 at a
# few thousand classes per class block) still fills the GPU. A function of N alone, so results
# do not depend on the GPU's SM count; a multiple of the G kernel's two sample tiles and of the
# dW kernel's K step in every tile row. Under the interpreter: small, so that tests split.
SAMPLES_PER_SPLIT = 4096
_INTERPRET_SAMPLES_PER_SPLIT = 64


def samples_per_split(compute_dtype: torch.dtype, interpret: bool | None = None) -> int:
    """Samples each program of the G and dW kernels covers (see :data:`SAMPLES_PER_SPLIT`)."""
    if interpret if interpret is not None else (_INTERPRET and not _target.active()):
        return _INTERPRET_SAMPLES_PER_SPLIT
    return SAMPLES_PER_SPLIT


def tile_config(kernel: str, compute_dtype: torch.dtype, interpret: bool | None = None, arch: int | None = None):
    """``(BLOCK_A, BLOCK_B, BLOCK_K, num_warps, num_stages)`` of ``kernel`` for a compute dtype on
    compute capability ``arch`` (``80`` for sm_80; None: Hopper's rows)."""
    if interpret if interpret is not None else (_INTERPRET and not _target.active()):
        return _INTERPRET_TILES[kernel]
    key = (kernel, "fp32" if compute_dtype == torch.float32 else "lowp")
    if arch is not None and arch < 90 and key in MMA_SYNC_TILES:
        return MMA_SYNC_TILES[key]
    return TILES[key]


def _arch(device: torch.device) -> int | None:
    """The compute capability launches on ``device`` choose tiles for: the target's inside
    :func:`ds_pfc.kernels._target.gpu_tiles`, the GPU's on CUDA, else None."""
    target = _target.arch()
    if target is not None:
        return target
    return _device_arch(device) if device.type == "cuda" else None


@functools.lru_cache(maxsize=None)
def _device_arch(device: torch.device) -> int:
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


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


def _split(held_tiles: int, stream_tiles: int, device: torch.device,
           ctas_per_sm: int = 1) -> tuple[int, int]:
    """``(splits, tiles_per_split)`` over the streamed class tiles for ``held_tiles`` sample tiles.

    Aim for ``_WAVES`` programs per SM in total, in whole waves: a wave is the SMs times the
    kernel's resident CTAs per SM (``ctas_per_sm``), and a grid of ``held_tiles x splits``
    programs takes ``ceil(programs / wave)`` waves of ``tiles_per_split`` tiles each. Of the
    split counts up to twice the aim, take the one with the fewest such tile-waves (the time of
    the grid), the closest to the aim on a tie: N = 4096 (32 sample tiles) on 132 SMs takes 33
    splits (1056 programs, 8 whole waves), not 17 (544 programs, 5 waves of which the last is
    0.1 full). Never more splits than class tiles, and no empty split (each split gets
    ``tiles_per_split`` tiles, the last possibly fewer).
    """
    held = max(1, held_tiles)
    wave = _num_sms(device) * max(1, ctas_per_sm)
    want = max(1, min(stream_tiles, triton.cdiv(_WAVES * wave, held)))
    best = None
    for splits in range(1, max(1, min(stream_tiles, 2 * want)) + 1):
        per = triton.cdiv(stream_tiles, splits)
        real = triton.cdiv(stream_tiles, per)
        cost = (triton.cdiv(held * real, wave) * per, abs(real - want))
        if best is None or cost < best[0]:
            best = (cost, real, per)
    return best[1], best[2]


# ---------------------------------------------------------------------------------------------
# Kernel building blocks


@triton.jit
def _round(t, COMPUTE: tl.constexpr, UPCAST: tl.constexpr):
    """Round a float32 tile to the compute dtype (round to nearest even, as on the GPU).

    UPCAST (interpreter only) works around two bugs of Triton's interpreter, both reproduced on
    triton 3.9.0: ``tl.dot`` on bf16 operands multiplies raw bit patterns (triton-lang/triton
    #11584), and the float32 -> bf16 cast truncates instead of rounding to nearest. There the
    tile is rounded by hand and kept in float32 (a store to a bf16 buffer then truncates exactly,
    and products of bf16/fp16 values are exact in float32). On the GPU the tile is cast.
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
def _dot_operand(t, UPCAST: tl.constexpr):
    """A loaded compute-dtype tile as a dot operand (upcast, exactly, under the interpreter)."""
    if UPCAST:
        t = t.to(tl.float32)
    return t


@triton.jit
def _cos_tile2(a_ptr, b_ptr, a_rows, a_ok, b_rows, b_ok, b2_rows, b2_ok, d,
               BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_K: tl.constexpr,
               UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """Two ``[BLOCK_A, BLOCK_B]`` cosine tiles that share their ``a`` rows: each ``a`` K-slice is
    loaded once for both products, so the pair has the arithmetic intensity of one
    ``BLOCK_A x 2 BLOCK_B`` tile while the epilogue holds one half at a time."""
    acc = tl.zeros([BLOCK_A, BLOCK_B], tl.float32)
    acc2 = tl.zeros([BLOCK_A, BLOCK_B], tl.float32)
    a_off = a_rows.to(tl.int64)[:, None] * d
    b_off = b_rows.to(tl.int64)[:, None] * d
    b2_off = b2_rows.to(tl.int64)[:, None] * d
    for k0 in range(0, d, BLOCK_K):
        dims = k0 + tl.arange(0, BLOCK_K)
        dim_ok = dims < d
        a = _dot_operand(tl.load(a_ptr + a_off + dims[None, :], mask=a_ok[:, None] & dim_ok[None, :], other=0.0),
                         UPCAST)
        b = tl.load(b_ptr + b_off + dims[None, :], mask=b_ok[:, None] & dim_ok[None, :], other=0.0)
        b2 = tl.load(b_ptr + b2_off + dims[None, :], mask=b2_ok[:, None] & dim_ok[None, :], other=0.0)
        acc = tl.dot(a, tl.trans(_dot_operand(b, UPCAST)), acc, input_precision=PRECISION)
        acc2 = tl.dot(a, tl.trans(_dot_operand(b2, UPCAST)), acc2, input_precision=PRECISION)
    return acc, acc2


@triton.jit
def _negative_logits(cos, col, tgt, valid, scale, threshold, HAS_THRESHOLD: tl.constexpr):
    """Per-entry transform shared by all kernels: ``(z, keep)`` for a tile of cosines.

    ``col`` / ``tgt`` broadcast against ``cos`` (class index of each column, target column of
    each sample; either orientation). The target entry is excluded (the caller adds it back with
    its margin), as are filtered negatives (``cos > threshold``) and out-of-range padding.

    Extension point: a transform of the negative logits (e.g. CurricularFace's ``cos * (t + cos)``
    for hard negatives) belongs here, selected by a new constexpr; the G kernel then also needs
    dz/dcos here. Per-sample target margins (AdaFace, MagFace, ElasticFace) need nothing here: the
    caller handles every target term.
    """
    keep = valid & (col != tgt)
    if HAS_THRESHOLD:
        keep = keep & (cos <= threshold)
    z = cos * scale
    return z, keep


# ---------------------------------------------------------------------------------------------
# Kernels


@triton.jit
def _prep_kernel(w_ptr, stride_r, stride_c, idx_ptr, wc_ptr, inv_ptr, S, d, eps,
                 COMPUTE: tl.constexpr, UPCAST: tl.constexpr, HAS_IDX: tl.constexpr, ONE_PASS: tl.constexpr,
                 ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """Grid (row tiles,): ``inv = 1 / max(||w_j||, eps)`` and ``wc_j = w_j * inv`` in COMPUTE, where
    ``w_j`` is row ``j`` of ``w`` or, with HAS_IDX, row ``idx[j]`` of it (the bank's table read by
    index: no gathered copy). ONE_PASS (BLOCK_D >= d): each row is loaded once."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < S
    if HAS_IDX:
        src_rows = tl.load(idx_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    else:
        src_rows = rows.to(tl.int64)
    src = src_rows[:, None] * stride_r
    dst = rows.to(tl.int64)[:, None] * d
    if ONE_PASS:
        dims = tl.arange(0, BLOCK_D)
        ok = row_ok[:, None] & (dims < d)[None, :]
        v = tl.load(w_ptr + src + dims[None, :].to(tl.int64) * stride_c, mask=ok, other=0.0).to(tl.float32)
        inv = 1.0 / tl.maximum(tl.sqrt(tl.sum(v * v, axis=1)), eps)
        tl.store(inv_ptr + rows, inv, mask=row_ok)
        tl.store(wc_ptr + dst + dims[None, :], _round(v * inv[:, None], COMPUTE, UPCAST), mask=ok)
    else:
        sq = tl.zeros([ROWS], tl.float32)
        for k0 in range(0, d, BLOCK_D):
            dims = k0 + tl.arange(0, BLOCK_D)
            ok = row_ok[:, None] & (dims < d)[None, :]
            v = tl.load(w_ptr + src + dims[None, :].to(tl.int64) * stride_c, mask=ok, other=0.0).to(tl.float32)
            sq += tl.sum(v * v, axis=1)
        inv = 1.0 / tl.maximum(tl.sqrt(sq), eps)
        tl.store(inv_ptr + rows, inv, mask=row_ok)
        for k0 in range(0, d, BLOCK_D):
            dims = k0 + tl.arange(0, BLOCK_D)
            ok = row_ok[:, None] & (dims < d)[None, :]
            v = tl.load(w_ptr + src + dims[None, :].to(tl.int64) * stride_c, mask=ok, other=0.0).to(tl.float32)
            tl.store(wc_ptr + dst + dims[None, :], _round(v * inv[:, None], COMPUTE, UPCAST), mask=ok)


@triton.jit
def _lse_part(cos, cols, col_ok, tgt, m, l, max_z, scale, threshold,
              HAS_THRESHOLD: tl.constexpr, WANT_MAX_COS: tl.constexpr):
    """Fold one ``[samples, classes]`` cosine tile into the running (m, l, max_z).

    ``max_z`` (``WANT_MAX_COS``): the largest ``scale * cos`` over every class but the target,
    filtered negatives included (the caller divides by ``scale``; top-1 accuracy compares the
    target's cosine with it)."""
    if WANT_MAX_COS:
        other = col_ok[None, :] & (cols[None, :] != tgt[:, None])
        max_z = tl.maximum(max_z, tl.max(tl.where(other, cos * scale, float("-inf")), axis=1))
    z, keep = _negative_logits(cos, cols[None, :], tgt[:, None], col_ok[None, :], scale, threshold, HAS_THRESHOLD)
    z = tl.where(keep, z, float("-inf"))
    m_new = tl.maximum(m, tl.max(z, axis=1))
    # Shift by 0 while a row has kept nothing yet: exp(-inf - -inf) would be nan, while
    # exp(-inf - 0) = 0 leaves l = 0 as it should.
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    l = l * tl.exp(m - shift) + tl.sum(tl.exp(z - shift[:, None]), axis=1)
    return m_new, l, max_z


@triton.jit
def _store_cos(cos_ptr, cos, rows, row_ok, cols, col_ok, N, threshold, HAS_THRESHOLD: tl.constexpr,
               KEEP: tl.constexpr):
    """Store a ``[samples, classes]`` cosine tile class-major (``cos_ptr[col * N + row]``) in KEEP.

    A cosine above the threshold is stored as +inf: the filter is decided here, on the float32
    cosine the statistics saw, and the backward reads that decision instead of comparing a
    rounded cosine with the threshold again (which could flip it)."""
    if HAS_THRESHOLD:
        cos = tl.where(cos > threshold, float("inf"), cos)
    offs = cols.to(tl.int64)[None, :] * N + rows[:, None]
    tl.store(cos_ptr + offs, cos.to(KEEP), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _lse_kernel(x_ptr, w_ptr, tgt_ptr, m_ptr, l_ptr, max_z_ptr, cos_ptr,
                N, S, d, tiles_per_split, scale, threshold,
                HAS_THRESHOLD: tl.constexpr, WANT_MAX_COS: tl.constexpr, STORE_COS: tl.constexpr,
                KEEP: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr):
    """Grid (sample tiles, splits): partial m, l (and max z) of one sample tile over one split.
    Class tiles go four at a time, sharing each loaded sample K-slice (``BLOCK_N x 4 BLOCK_S``
    operand reuse, one quarter's epilogue live at a time). ``WANT_MAX_COS`` is only needed with a
    threshold: without one, the largest non-target logit is ``m`` itself. ``STORE_COS``: every
    raw cosine is also stored, rounded to ``KEEP``, class-major ``[S, N]`` at ``cos_ptr`` (the
    kept cosines the backward's G pass reads; filtered negatives as +inf)."""
    pid_k = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    tgt = tl.load(tgt_ptr + rows, mask=row_ok, other=-1)

    m = tl.full([BLOCK_N], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_N], tl.float32)
    max_z = tl.full([BLOCK_N], float("-inf"), tl.float32)
    first = pid_k * tiles_per_split
    last = tl.minimum(first + tiles_per_split, tl.cdiv(S, BLOCK_S))
    end = tl.minimum(last * BLOCK_S, S)
    for t in range(first, last, 4):
        c0, c1, c2, c3 = _cos_tile4(x_ptr, w_ptr, rows, row_ok, t * BLOCK_S, end, d,
                                    BLOCK_N, BLOCK_S, BLOCK_K, UPCAST, PRECISION)
        cols = t * BLOCK_S + tl.arange(0, BLOCK_S)
        if STORE_COS:
            _store_cos(cos_ptr, c0, rows, row_ok, cols, cols < end, N, threshold, HAS_THRESHOLD, KEEP)
        m, l, max_z = _lse_part(c0, cols, cols < end, tgt, m, l, max_z, scale, threshold,
                                HAS_THRESHOLD, WANT_MAX_COS)
        cols += BLOCK_S
        if STORE_COS:
            _store_cos(cos_ptr, c1, rows, row_ok, cols, cols < end, N, threshold, HAS_THRESHOLD, KEEP)
        m, l, max_z = _lse_part(c1, cols, cols < end, tgt, m, l, max_z, scale, threshold,
                                HAS_THRESHOLD, WANT_MAX_COS)
        cols += BLOCK_S
        if STORE_COS:
            _store_cos(cos_ptr, c2, rows, row_ok, cols, cols < end, N, threshold, HAS_THRESHOLD, KEEP)
        m, l, max_z = _lse_part(c2, cols, cols < end, tgt, m, l, max_z, scale, threshold,
                                HAS_THRESHOLD, WANT_MAX_COS)
        cols += BLOCK_S
        if STORE_COS:
            _store_cos(cos_ptr, c3, rows, row_ok, cols, cols < end, N, threshold, HAS_THRESHOLD, KEEP)
        m, l, max_z = _lse_part(c3, cols, cols < end, tgt, m, l, max_z, scale, threshold,
                                HAS_THRESHOLD, WANT_MAX_COS)

    out = pid_k * N + rows
    tl.store(m_ptr + out, m, mask=row_ok)
    tl.store(l_ptr + out, l, mask=row_ok)
    if WANT_MAX_COS:
        tl.store(max_z_ptr + out, max_z, mask=row_ok)


@triton.jit
def _exp_part(cos, rows, row_ok, cols, col_ok, tgt, l, max_z, e_ptr, N, scale, shift, threshold,
              HAS_THRESHOLD: tl.constexpr, WANT_MAX_COS: tl.constexpr, UPCAST: tl.constexpr):
    """Epilogue of one ``[samples, classes]`` cosine tile of the exp-kept forward: store
    ``E = exp(z - shift)`` (bf16, class-major ``e_ptr[col * N + row]``; 0 on the target, on
    filtered negatives and on padding, the filter decided on this float32 cosine), add the
    float32 exponentials to ``l`` (a fixed shift: no running max, no rescale), and with
    ``WANT_MAX_COS`` track the largest ``scale * cos`` over every class but the target."""
    if WANT_MAX_COS:
        other = col_ok[None, :] & (cols[None, :] != tgt[:, None])
        max_z = tl.maximum(max_z, tl.max(tl.where(other, cos * scale, float("-inf")), axis=1))
    z, keep = _negative_logits(cos, cols[None, :], tgt[:, None], col_ok[None, :], scale, threshold, HAS_THRESHOLD)
    e = tl.where(keep, tl.exp(z - shift), 0.0)
    l += tl.sum(e, axis=1)
    offs = cols.to(tl.int64)[None, :] * N + rows[:, None]
    tl.store(e_ptr + offs, _round(e, tl.bfloat16, UPCAST), mask=row_ok[:, None] & col_ok[None, :])
    return l, max_z


@triton.jit
def _lse_exp_kernel(x_ptr, w_ptr, tgt_ptr, l_ptr, max_z_ptr, e_ptr,
                    N, S, d, tiles_per_split, scale, shift, threshold,
                    HAS_THRESHOLD: tl.constexpr, WANT_MAX_COS: tl.constexpr, UPCAST: tl.constexpr,
                    PRECISION: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr):
    """Grid (sample tiles, splits): the exp-kept forward. The products of :func:`_lse_kernel`
    (four class tiles per loaded sample K-slice); the epilogue (:func:`_exp_part`) stores every
    ``E = exp(scale * cos - shift)`` in bf16, class-major ``[S, N]`` at ``e_ptr``, and sums the
    partial ``l = sum E`` of the split (and the largest non-target logit with
    ``WANT_MAX_COS``)."""
    pid_k = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    tgt = tl.load(tgt_ptr + rows, mask=row_ok, other=-1)
    l = tl.zeros([BLOCK_N], tl.float32)
    max_z = tl.full([BLOCK_N], float("-inf"), tl.float32)
    first = pid_k * tiles_per_split
    last = tl.minimum(first + tiles_per_split, tl.cdiv(S, BLOCK_S))
    end = tl.minimum(last * BLOCK_S, S)
    for t in range(first, last, 4):
        c0, c1, c2, c3 = _cos_tile4(x_ptr, w_ptr, rows, row_ok, t * BLOCK_S, end, d,
                                    BLOCK_N, BLOCK_S, BLOCK_K, UPCAST, PRECISION)
        cols = t * BLOCK_S + tl.arange(0, BLOCK_S)
        l, max_z = _exp_part(c0, rows, row_ok, cols, cols < end, tgt, l, max_z, e_ptr, N, scale, shift, threshold,
                             HAS_THRESHOLD, WANT_MAX_COS, UPCAST)
        cols += BLOCK_S
        l, max_z = _exp_part(c1, rows, row_ok, cols, cols < end, tgt, l, max_z, e_ptr, N, scale, shift, threshold,
                             HAS_THRESHOLD, WANT_MAX_COS, UPCAST)
        cols += BLOCK_S
        l, max_z = _exp_part(c2, rows, row_ok, cols, cols < end, tgt, l, max_z, e_ptr, N, scale, shift, threshold,
                             HAS_THRESHOLD, WANT_MAX_COS, UPCAST)
        cols += BLOCK_S
        l, max_z = _exp_part(c3, rows, row_ok, cols, cols < end, tgt, l, max_z, e_ptr, N, scale, shift, threshold,
                             HAS_THRESHOLD, WANT_MAX_COS, UPCAST)
    out = pid_k * N + rows
    tl.store(l_ptr + out, l, mask=row_ok)
    if WANT_MAX_COS:
        tl.store(max_z_ptr + out, max_z, mask=row_ok)


@triton.jit
def _cos_tile4(a_ptr, b_ptr, a_rows, a_ok, b0, S_end, d,
               BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_K: tl.constexpr,
               UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    acc0 = tl.zeros([BLOCK_A, BLOCK_B], tl.float32)
    acc1 = tl.zeros([BLOCK_A, BLOCK_B], tl.float32)
    acc2 = tl.zeros([BLOCK_A, BLOCK_B], tl.float32)
    acc3 = tl.zeros([BLOCK_A, BLOCK_B], tl.float32)
    a_off = a_rows.to(tl.int64)[:, None] * d
    r0 = b0 + tl.arange(0, BLOCK_B)
    for k0 in range(0, d, BLOCK_K):
        dims = k0 + tl.arange(0, BLOCK_K)
        dim_ok = dims < d
        a = _dot_operand(tl.load(a_ptr + a_off + dims[None, :], mask=a_ok[:, None] & dim_ok[None, :], other=0.0), UPCAST)
        b = tl.load(b_ptr + r0.to(tl.int64)[:, None] * d + dims[None, :], mask=(r0 < S_end)[:, None] & dim_ok[None, :], other=0.0)
        acc0 = tl.dot(a, tl.trans(_dot_operand(b, UPCAST)), acc0, input_precision=PRECISION)
        r1 = r0 + BLOCK_B
        b = tl.load(b_ptr + r1.to(tl.int64)[:, None] * d + dims[None, :], mask=(r1 < S_end)[:, None] & dim_ok[None, :], other=0.0)
        acc1 = tl.dot(a, tl.trans(_dot_operand(b, UPCAST)), acc1, input_precision=PRECISION)
        r2 = r1 + BLOCK_B
        b = tl.load(b_ptr + r2.to(tl.int64)[:, None] * d + dims[None, :], mask=(r2 < S_end)[:, None] & dim_ok[None, :], other=0.0)
        acc2 = tl.dot(a, tl.trans(_dot_operand(b, UPCAST)), acc2, input_precision=PRECISION)
        r3 = r2 + BLOCK_B
        b = tl.load(b_ptr + r3.to(tl.int64)[:, None] * d + dims[None, :], mask=(r3 < S_end)[:, None] & dim_ok[None, :], other=0.0)
        acc3 = tl.dot(a, tl.trans(_dot_operand(b, UPCAST)), acc3, input_precision=PRECISION)
    return acc0, acc1, acc2, acc3


@triton.jit
def _g_part(cos_t, cols, col_ok, rows, row_ok, tgt_ptr, coef_ptr, row_max_ptr, g_ptr, N, scale, threshold,
            HAS_THRESHOLD: tl.constexpr, COMPUTE: tl.constexpr, UPCAST: tl.constexpr):
    """Epilogue of one ``[classes, samples]`` cosine tile: store its G, return its part of rho."""
    tgt = tl.load(tgt_ptr + rows, mask=row_ok, other=-1)
    coef = tl.load(coef_ptr + rows, mask=row_ok, other=0.0)
    row_max = tl.load(row_max_ptr + rows, mask=row_ok, other=0.0)
    z, keep = _negative_logits(cos_t, cols[:, None], tgt[None, :], col_ok[:, None] & row_ok[None, :],
                               scale, threshold, HAS_THRESHOLD)
    # ``where`` (not a product with a 0/1 mask): exp may overflow to inf on excluded entries,
    # e.g. for a sample with nothing kept whose row_max is -inf.
    g = _round(tl.where(keep, coef[None, :] * tl.exp(z - row_max[None, :]), 0.0), COMPUTE, UPCAST)
    offs = cols.to(tl.int64)[:, None] * N + rows[None, :]
    tl.store(g_ptr + offs, g, mask=col_ok[:, None] & row_ok[None, :])
    return tl.sum(g * cos_t, axis=1)


@triton.jit
def _g_kernel(x_ptr, w_ptr, tgt_ptr, coef_ptr, row_max_ptr, g_ptr, rho_ptr,
              N, S, d, scale, threshold,
              HAS_THRESHOLD: tl.constexpr, COMPUTE: tl.constexpr, UPCAST: tl.constexpr,
              PRECISION: tl.constexpr,
              BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_N: tl.constexpr):
    """Grid (class tiles, sample splits): ``G^T`` rows of one class tile over the split's
    ``SPLIT_N`` samples (a multiple of ``2 BLOCK_N``), class-major ``[S, N]`` in COMPUTE,
    and the split's part of ``rho = sum_n G^T cos`` per class (float32, row ``split`` of
    ``rho_ptr``'s ``[splits, S]``). ``coef`` is already divided by the block's scale ``c``;
    ``w_ptr`` points at the block's first center. Samples go two ``BLOCK_N`` tiles at a time,
    sharing each loaded class K-slice."""
    cols = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    col_ok = cols < S
    # The split's samples as a batch of their own (pointers moved to its first sample; G keeps
    # its row stride N), so that the loop is the unsplit kernel's. SPLIT_N is a constexpr, so
    # the moved pointers keep their alignment.
    n_lo = tl.program_id(1) * SPLIT_N
    n_here = tl.minimum(N - n_lo, SPLIT_N)
    x_ptr += n_lo.to(tl.int64) * d
    tgt_ptr += n_lo
    coef_ptr += n_lo
    row_max_ptr += n_lo
    g_ptr += n_lo
    rho = tl.zeros([BLOCK_S], tl.float32)
    for n0 in range(0, n_here, 2 * BLOCK_N):
        rows = n0 + tl.arange(0, BLOCK_N)
        row_ok = rows < n_here
        rows2 = rows + BLOCK_N
        row2_ok = rows2 < n_here
        cos_t, cos_t2 = _cos_tile2(w_ptr, x_ptr, cols, col_ok, rows, row_ok, rows2, row2_ok, d,
                                   BLOCK_S, BLOCK_N, BLOCK_K, UPCAST, PRECISION)
        rho += _g_part(cos_t, cols, col_ok, rows, row_ok, tgt_ptr, coef_ptr, row_max_ptr, g_ptr, N, scale,
                       threshold, HAS_THRESHOLD, COMPUTE, UPCAST)
        rho += _g_part(cos_t2, cols, col_ok, rows2, row2_ok, tgt_ptr, coef_ptr, row_max_ptr, g_ptr, N, scale,
                       threshold, HAS_THRESHOLD, COMPUTE, UPCAST)
    tl.store(rho_ptr + tl.program_id(1).to(tl.int64) * S + cols, rho, mask=col_ok)


@triton.jit
def _dw_part(acc, cols, col_ok, dims, w_ptr, stride_r, stride_c, inv, rho, c, dw_ptr, d, PROJECT: tl.constexpr):
    """Epilogue of one ``[classes, dims]`` tile of ``G^T x_hat``: project (unless not PROJECT:
    then ``c dw_hat``, for a caller that projects) and store ``dw``."""
    ok = col_ok[:, None] & (dims < d)[None, :]
    if PROJECT:
        w = tl.load(w_ptr + cols.to(tl.int64)[:, None] * stride_r + dims[None, :].to(tl.int64) * stride_c,
                    mask=ok, other=0.0).to(tl.float32)
        dw = (acc - (w * inv[:, None]) * rho[:, None]) * (inv * c)[:, None]
    else:
        dw = acc * c
    tl.store(dw_ptr + cols.to(tl.int64)[:, None] * d + dims[None, :], dw, mask=ok)


@triton.jit
def _dw_kernel(g_ptr, x_ptr, w_ptr, stride_r, stride_c, inv_ptr, rho_ptr, c_ptr, dw_ptr,
               N, S, d, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
               BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_N: tl.constexpr,
               PROJECT: tl.constexpr):
    """Grid (class tiles, quads of dim tiles, sample splits): ``dw = c * w_inv * (G^T x_hat -
    w_hat rho)``, each sample split's part into its own ``[S, d]`` of ``dw_ptr`` (the first
    split carries the ``w_hat rho`` term; the parts sum to ``dw``).

    The GEMM's K runs over the split's ``SPLIT_N`` samples (a multiple of ``BLOCK_K``), and
    each loaded G slice serves four ``BLOCK_D`` dim tiles. The epilogue applies the derivative
    of the normalisation ``w_hat = w * w_inv`` (the tangent projection, with the float32
    ``w_hat``)."""
    cols = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    col_ok = cols < S
    d0 = tl.program_id(1) * 4 * BLOCK_D + tl.arange(0, BLOCK_D)
    split = tl.program_id(2)
    n_lo = split * SPLIT_N
    acc0 = tl.zeros([BLOCK_S, BLOCK_D], tl.float32)
    acc1 = tl.zeros([BLOCK_S, BLOCK_D], tl.float32)
    acc2 = tl.zeros([BLOCK_S, BLOCK_D], tl.float32)
    acc3 = tl.zeros([BLOCK_S, BLOCK_D], tl.float32)
    for n0 in range(n_lo, tl.minimum(N, n_lo + SPLIT_N), BLOCK_K):
        rows = n0 + tl.arange(0, BLOCK_K)
        row_ok = rows < N
        g = _dot_operand(tl.load(g_ptr + cols.to(tl.int64)[:, None] * N + rows[None, :],
                                 mask=col_ok[:, None] & row_ok[None, :], other=0.0), UPCAST)
        x_off = x_ptr + rows.to(tl.int64)[:, None] * d
        dims = d0
        x = tl.load(x_off + dims[None, :], mask=row_ok[:, None] & (dims < d)[None, :], other=0.0)
        acc0 = tl.dot(g, _dot_operand(x, UPCAST), acc0, input_precision=PRECISION)
        dims += BLOCK_D
        x = tl.load(x_off + dims[None, :], mask=row_ok[:, None] & (dims < d)[None, :], other=0.0)
        acc1 = tl.dot(g, _dot_operand(x, UPCAST), acc1, input_precision=PRECISION)
        dims += BLOCK_D
        x = tl.load(x_off + dims[None, :], mask=row_ok[:, None] & (dims < d)[None, :], other=0.0)
        acc2 = tl.dot(g, _dot_operand(x, UPCAST), acc2, input_precision=PRECISION)
        dims += BLOCK_D
        x = tl.load(x_off + dims[None, :], mask=row_ok[:, None] & (dims < d)[None, :], other=0.0)
        acc3 = tl.dot(g, _dot_operand(x, UPCAST), acc3, input_precision=PRECISION)
    inv = tl.load(inv_ptr + cols, mask=col_ok, other=0.0)
    rho = tl.load(rho_ptr + cols, mask=col_ok, other=0.0) * (split == 0).to(tl.float32)
    c = tl.load(c_ptr)
    dw_ptr += split.to(tl.int64) * S * d
    _dw_part(acc0, cols, col_ok, d0, w_ptr, stride_r, stride_c, inv, rho, c, dw_ptr, d, PROJECT)
    _dw_part(acc1, cols, col_ok, d0 + BLOCK_D, w_ptr, stride_r, stride_c, inv, rho, c, dw_ptr, d, PROJECT)
    _dw_part(acc2, cols, col_ok, d0 + 2 * BLOCK_D, w_ptr, stride_r, stride_c, inv, rho, c, dw_ptr, d, PROJECT)
    _dw_part(acc3, cols, col_ok, d0 + 3 * BLOCK_D, w_ptr, stride_r, stride_c, inv, rho, c, dw_ptr, d, PROJECT)


@triton.jit
def _g_pass_kernel(cos_ptr, g_ptr, tgt_ptr, coef_ptr, row_max_ptr, rho_ptr, N, S, scale, threshold,
                   HAS_THRESHOLD: tl.constexpr, COMPUTE: tl.constexpr, UPCAST: tl.constexpr,
                   BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_N: tl.constexpr):
    """Grid (class tiles, sample splits): G over the kept cosines, in place. Reads the forward's
    cosines (class-major ``[S, N]`` at ``cos_ptr``), writes ``G / c = coef / c * exp(z - row_max)``
    in COMPUTE over the same storage (``g_ptr`` aliases ``cos_ptr``: same element size, and
    each program reads a tile before it writes it), 0 on the target and on filtered entries
    (stored as +inf by the forward, so ``threshold`` itself is not read again), and
    the split's part of ``rho = sum_n G^T cos`` per class (row ``split`` of ``[splits, S]``).
    No matrix product: one read and one write of each kept element."""
    cols = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    col_ok = cols < S
    n_lo = tl.program_id(1) * SPLIT_N
    n_hi = tl.minimum(N, n_lo + SPLIT_N)
    rho = tl.zeros([BLOCK_S], tl.float32)
    col_off = cols.to(tl.int64)[:, None] * N
    for n0 in range(n_lo, n_hi, BLOCK_N):
        rows = n0 + tl.arange(0, BLOCK_N)
        row_ok = rows < n_hi
        ok = col_ok[:, None] & row_ok[None, :]
        offs = col_off + rows[None, :]
        cos = tl.load(cos_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        tgt = tl.load(tgt_ptr + rows, mask=row_ok, other=-1)
        coef = tl.load(coef_ptr + rows, mask=row_ok, other=0.0)
        row_max = tl.load(row_max_ptr + rows, mask=row_ok, other=0.0)
        # The forward stored filtered negatives as +inf (its decision, on the float32 cosine).
        z, keep = _negative_logits(cos, cols[:, None], tgt[None, :], ok, scale, threshold, False)
        if HAS_THRESHOLD:
            keep = keep & (cos < float("inf"))
        g = _round(tl.where(keep, coef[None, :] * tl.exp(z - row_max[None, :]), 0.0), COMPUTE, UPCAST)
        tl.store(g_ptr + offs, g, mask=ok)
        rho += tl.sum(g.to(tl.float32) * tl.where(keep, cos, 0.0), axis=1)
    tl.store(rho_ptr + tl.program_id(1).to(tl.int64) * S + cols, rho, mask=col_ok)


@triton.jit
def _project_kernel(dw_ptr, w_ptr, stride_r, stride_c, inv_ptr, rho_ptr, c_ptr, S, d,
                    RHO_FROM_DW: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """Grid (row tiles,): in place, ``dw = c * w_inv * (dw_hat - w_hat rho)`` for a float32
    ``dw_hat = G^T x_hat`` (relative to ``c``) at ``dw_ptr``, with the float32 ``w_hat = w * w_inv``
    (the epilogue of :func:`_dw_kernel` as a pass of its own, after a cuBLAS dW).
    ``RHO_FROM_DW``: ``rho_ptr`` is not read; ``rho = <dw_hat_j, w_hat_j>`` is summed in float32
    by a first sweep over the row (the exact tangent projection; the exp-kept path)."""
    cols = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    col_ok = cols < S
    inv = tl.load(inv_ptr + cols, mask=col_ok, other=0.0)
    if RHO_FROM_DW:
        rho = tl.zeros([ROWS], tl.float32)
        for k0 in range(0, d, BLOCK_D):
            dims = k0 + tl.arange(0, BLOCK_D)
            ok = col_ok[:, None] & (dims < d)[None, :]
            acc = tl.load(dw_ptr + cols.to(tl.int64)[:, None] * d + dims[None, :], mask=ok, other=0.0)
            w = tl.load(w_ptr + cols.to(tl.int64)[:, None] * stride_r + dims[None, :].to(tl.int64) * stride_c,
                        mask=ok, other=0.0).to(tl.float32)
            rho += tl.sum(acc * w, axis=1)
        rho = rho * inv
    else:
        rho = tl.load(rho_ptr + cols, mask=col_ok, other=0.0)
    c = tl.load(c_ptr)
    for k0 in range(0, d, BLOCK_D):
        dims = k0 + tl.arange(0, BLOCK_D)
        ok = col_ok[:, None] & (dims < d)[None, :]
        acc = tl.load(dw_ptr + cols.to(tl.int64)[:, None] * d + dims[None, :], mask=ok, other=0.0)
        _dw_part(acc, cols, col_ok, dims, w_ptr, stride_r, stride_c, inv, rho, c, dw_ptr, d, True)


# ---------------------------------------------------------------------------------------------
# Python entry points


def _check_tensor(name, t, shape, dtypes, device=None):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {list(shape)}, got {list(t.shape)}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name}: expected dtype {' or '.join(map(str, dtypes))}, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: on {t.device}, but x_hat is on {device}")


def _validate(x_hat, w, w_inv_norm, target_col, compute_dtype, **per_sample):
    """Shapes, dtypes and devices of the entry points' arguments; ``w`` may be float32, bf16 or
    fp16 with any strides; everything else is checked exactly."""
    if not isinstance(x_hat, torch.Tensor):
        raise TypeError(f"x_hat: expected a torch.Tensor, got {type(x_hat).__name__}")
    if x_hat.dim() != 2:
        raise ValueError(f"x_hat: expected shape [N, d], got {tuple(x_hat.shape)}")
    n, d = x_hat.shape
    _check_tensor("x_hat", x_hat, (n, d), (torch.float32,))
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"w: expected a torch.Tensor, got {type(w).__name__}")
    if w.dim() != 2 or w.shape[1] != d:
        raise ValueError(f"w: expected shape [S, {d}], got {tuple(w.shape)}")
    s = w.shape[0]
    _check_tensor("w", w, (s, d), tuple(_TL_DTYPES), x_hat.device)
    if w_inv_norm is not None:
        _check_tensor("w_inv_norm", w_inv_norm, (s,), (torch.float32,), x_hat.device)
    if target_col is not None:
        _check_tensor("target_col", target_col, (n,), (torch.int64,), x_hat.device)
    for name, t in per_sample.items():
        _check_tensor(name, t, (n,), (torch.float32,), x_hat.device)
    if compute_dtype not in _TL_DTYPES:
        raise TypeError(f"compute_dtype: expected one of {list(_TL_DTYPES)}, got {compute_dtype}")
    check_device(x_hat)


def _consts(compute_dtype):
    lowp = compute_dtype != torch.float32
    return dict(UPCAST=_INTERPRET and lowp, PRECISION="ieee")


def prep_shape(d: int, compute_dtype: torch.dtype, interpret: bool | None = None):
    """``(ROWS, BLOCK_D, ONE_PASS)`` of :func:`prepare` for rows of ``d`` columns (the "prep" row of
    the tile table: whole rows read once while ``next_pow2(d)`` fits a program's elements)."""
    rows, block_d, _, _, _ = tile_config("prep", compute_dtype, interpret)
    whole = max(16, triton.next_power_of_2(d))
    if whole <= rows * block_d:
        return max(1, rows * block_d // whole), whole, True
    return rows, block_d, False


def prepare(w: torch.Tensor, compute_dtype: torch.dtype, rows: torch.Tensor | None = None):
    """``(w_hat [S, d] in compute_dtype, contiguous; w_inv_norm [S] float32)`` of centers ``w``
    (float32, bf16 or fp16, any strides): one read of ``w``, no normalised float32 copy.

    ``rows``: ``[S]`` int64 row ids into ``w`` (a bank's ``[C, d]`` table): the centers are
    ``w[rows]``, read in place by index (no gathered ``[S, d]`` copy); ids must lie in
    ``[0, C)`` (not checked: that would cost a host sync). Rows of up to a program's
    elements (2048 on a GPU) are read once, whole; wider ones twice."""
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        raise ValueError(f"w: expected a [S, d] tensor, got {getattr(w, 'shape', type(w).__name__)}")
    if w.dtype not in _TL_DTYPES:
        raise TypeError(f"w: expected dtype float32, bfloat16 or float16, got {w.dtype}")
    if compute_dtype not in _TL_DTYPES:
        raise TypeError(f"compute_dtype: expected one of {list(_TL_DTYPES)}, got {compute_dtype}")
    check_device(w)
    if rows is not None:
        if not isinstance(rows, torch.Tensor) or rows.dim() != 1 or rows.dtype != torch.int64:
            raise ValueError(f"rows: expected a 1-d int64 tensor, got "
                             f"{getattr(rows, 'dtype', type(rows).__name__)} {tuple(getattr(rows, 'shape', ()))}")
        if rows.device != w.device:
            raise ValueError(f"rows: on {rows.device}, but w is on {w.device}")
        rows = rows.contiguous()
    s, d = (w.shape[0] if rows is None else rows.shape[0]), w.shape[1]
    wc = torch.empty(s, d, dtype=compute_dtype, device=w.device)
    inv = torch.empty(s, dtype=torch.float32, device=w.device)
    if s == 0 or d == 0:
        return wc, inv.fill_(1.0 / _NORM_EPS)
    _, _, _, warps, stages = tile_config("prep", compute_dtype)
    block_r, block_d, one_pass = prep_shape(d, compute_dtype)
    with on_device(w.device):
        _prep_kernel[(triton.cdiv(s, block_r),)](
            w, w.stride(0), w.stride(1), rows if rows is not None else inv, wc, inv, s, d, _NORM_EPS,
            COMPUTE=_TL_DTYPES[compute_dtype], UPCAST=_consts(compute_dtype)["UPCAST"], HAS_IDX=rows is not None,
            ONE_PASS=one_pass, ROWS=block_r, BLOCK_D=block_d, num_warps=warps, num_stages=stages)
    return wc, inv


def keep_dtype(compute_dtype: torch.dtype) -> torch.dtype:
    """The dtype the forward keeps the cosines in for :func:`grad_kept`: float16 for bf16/fp16
    products (a cosine in [-1, 1] rounded to float16 moves a logit ``scale * cos`` by at most
    ``scale * 2**-12``, 0.016 at s = 64; bf16 would move it by up to 0.125), float32 otherwise.
    The same element size as the compute dtype, so G can be written over the kept cosines."""
    return torch.float32 if compute_dtype == torch.float32 else torch.float16


def lse_stats(x_hat, w, w_inv_norm, target_col, *, scale, threshold, compute_dtype, want_max_cos: bool,
              w_hat=None, keep=None):
    """Per-sample log-sum-exp statistics of the non-target, unfiltered logits of this shard.

    ``x_hat [N, d]`` float32 normalised embeddings, ``w [S, d]`` raw centers (float32, bf16 or
    fp16, any strides), ``w_inv_norm [S]`` (None: computed here), ``w_hat``: the output of
    :func:`prepare` when the caller has it (saves a pass over ``w``).

    Returns ``(m, l, max_cos)``, float32 ``[N]``: ``m`` the largest kept logit ``scale * cos``
    (-inf if none), ``l = sum exp(z - m)`` over kept entries (0 if none), and with
    ``want_max_cos`` the largest cosine over all classes but the target, filtered ones
    included (-inf when there is none); otherwise ``None``. Only ``[SPLITS, N]`` partials touch
    memory, unless ``keep`` is given: a contiguous class-major ``[S, N]`` tensor of
    :func:`keep_dtype` that receives every raw cosine (for :func:`grad_kept`).
    """
    _validate(x_hat, w, w_inv_norm, target_col, compute_dtype)
    n, d = x_hat.shape
    s = w.shape[0]
    dev = x_hat.device
    if keep is not None:
        _check_tensor("keep", keep, (s, n), (keep_dtype(compute_dtype),), dev)
        if not keep.is_contiguous():
            raise ValueError("keep: expected a contiguous [S, N] tensor")
    m = torch.full((n,), float("-inf"), dtype=torch.float32, device=dev)
    l = torch.zeros(n, dtype=torch.float32, device=dev)
    max_cos = torch.full((n,), float("-inf"), dtype=torch.float32, device=dev) if want_max_cos else None
    if n == 0 or s == 0:
        return m, l, max_cos
    if w_hat is None:
        w_hat, _ = prepare(w, compute_dtype)
    xc = x_hat.to(compute_dtype).contiguous()

    # With a threshold the largest non-target cosine includes filtered negatives, which the
    # log-sum-exp drops: the kernel tracks it separately, on the narrower "lse_max" tiles that
    # keep those extra live values in registers. Without one it is m / scale.
    track_max = bool(want_max_cos) and threshold is not None
    block_n, block_s, block_k, warps, stages = tile_config("lse_max" if track_max else "lse", compute_dtype,
                                                          arch=_arch(dev))
    n_tiles = triton.cdiv(n, block_n)
    # The split hands out QUADS of class tiles (the kernel's unit), so no split ends mid-quad.
    splits, per = _split(n_tiles, triton.cdiv(s, 4 * block_s), dev, _LSE_CTAS_PER_SM)
    m_k = torch.empty(splits, n, dtype=torch.float32, device=dev)
    l_k = torch.empty_like(m_k)
    max_z_k = torch.empty_like(m_k) if track_max else m_k   # dummy pointer when unused
    with on_device(dev):
        _lse_kernel[(n_tiles, splits)](
            xc, w_hat, target_col, m_k, l_k, max_z_k, keep if keep is not None else m_k,
            n, s, d, 4 * per, float(scale), float(threshold if threshold is not None else 0.0),
            HAS_THRESHOLD=threshold is not None, WANT_MAX_COS=track_max, STORE_COS=keep is not None,
            KEEP=_TL_DTYPES[keep_dtype(compute_dtype)],
            BLOCK_N=block_n, BLOCK_S=block_s, BLOCK_K=block_k, **_consts(compute_dtype),
            num_warps=warps, num_stages=stages)

    m = m_k.amax(dim=0)
    # Same guard as in the kernel: a row with nothing kept anywhere has m = -inf.
    shift = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    l = (l_k * torch.exp(m_k - shift)).sum(dim=0)
    if want_max_cos:
        max_cos = (max_z_k.amax(dim=0) if track_max else m) / scale
    return m, l, max_cos


def block_classes(n: int, s: int, compute_dtype: torch.dtype, block_bytes: int | None,
                  interpret: bool | None = None) -> int:
    """Classes per backward block: G of ``[block, N]`` in the compute dtype within ``block_bytes``
    (None: all of ``S``), a whole number of the G and dW kernels' class tiles, at least one."""
    if block_bytes is None:
        return s
    tile = max(tile_config(k, compute_dtype, interpret)[0] for k in ("g", "dw"))
    itemsize = torch.empty((), dtype=compute_dtype).element_size()
    per = block_bytes // max(1, n * itemsize)
    return max(tile, per // tile * tile)


def _gemm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` with a float32 result; bf16/fp16 operands run on tensor cores on CUDA and are
    upcast exactly on a CPU (where reduced-precision GEMMs are slow or unsupported)."""
    if a.dtype == torch.float32:
        return torch.mm(a, b)
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    if _target.active():
        # Counting a GPU step on a CPU (ds_pfc.bench.model): the op sequence CUDA runs, a
        # reduced-precision product whose float32 output the counter folds into it.
        return torch.mm(a, b).float()
    return torch.mm(a.float(), b.float())


def _zero_grads(n: int, s: int, d: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.zeros(n, d, dtype=torch.float32, device=device),
            torch.zeros(s, d, dtype=torch.float32, device=device))


def _backward_operands(x_hat, w, w_inv_norm, w_hat, coef, compute_dtype):
    """``(w_hat, w_inv_norm, xc, c, coef / c)`` of a backward: the normalised centers (from
    :func:`prepare` unless given), the embeddings in the compute dtype, and the largest row
    coefficient ``c`` (a device scalar: no host sync) that G is stored relative to."""
    if w_hat is None or w_inv_norm is None:
        w_hat, w_inv_norm = prepare(w, compute_dtype)
    xc = x_hat.to(compute_dtype).contiguous()
    c = coef.abs().amax().clamp_min(torch.finfo(torch.float32).tiny).reshape(1)
    return w_hat, w_inv_norm, xc, c, (coef / c).contiguous()


def grad(x_hat, w, w_inv_norm, target_col, coef, row_max, *, scale, threshold, compute_dtype,
         w_hat=None, block_bytes: int | None = None, project: bool = True):
    """Backward of the non-target logits: ``(dx_hat [N, d], dw [S, d])``, float32.

    With ``G[n, j] = coef[n] * exp(z[n, j] - row_max[n])`` on kept entries (0 on the target and
    filtered ones): ``dx_hat = G @ w_hat`` and ``dw`` = ``dw_hat = G^T @ x_hat`` taken through the
    normalisation ``w_hat = w * w_inv_norm``. ``w_hat``: :func:`prepare`'s output, if the caller
    kept it. ``block_bytes`` bounds the G buffer (``[classes, N]`` in the compute dtype; None:
    one block). Cost: ``6 N S d`` FLOPs (recompute, two products) and ``N S`` G elements written
    and read twice; memory beyond the outputs: G of one block and ``4 S`` bytes of ``rho``.
    ``project=False``: ``dw`` is ``dw_hat`` itself (the gradient of ``w_hat``), for a caller that
    projects it (the row optimizers, ``project=True`` there).
    """
    _validate(x_hat, w, w_inv_norm, target_col, compute_dtype, coef=coef, row_max=row_max)
    n, d = x_hat.shape
    s = w.shape[0]
    dev = x_hat.device
    if n == 0 or s == 0:
        return _zero_grads(n, s, d, dev)
    w_hat, w_inv_norm, xc, c, coef_rel = _backward_operands(x_hat, w, w_inv_norm, w_hat, coef, compute_dtype)
    consts = _consts(compute_dtype)
    tg = tile_config("g", compute_dtype)
    tw = tile_config("dw", compute_dtype)
    step = block_classes(n, s, compute_dtype, block_bytes)
    per_split = samples_per_split(compute_dtype)
    splits = triton.cdiv(n, per_split)
    g_buf = torch.empty(min(step, s), n, dtype=compute_dtype, device=dev)
    rho = torch.empty(s, dtype=torch.float32, device=dev)
    dx_hat = torch.zeros(n, d, dtype=torch.float32, device=dev)
    dw = torch.empty(s, d, dtype=torch.float32, device=dev)
    # Several sample splits: each writes its part of rho and dw, summed below in a fixed order.
    rho_parts = torch.empty(splits, min(step, s), dtype=torch.float32, device=dev) if splits > 1 else None
    dw_parts = torch.empty(splits, min(step, s), d, dtype=torch.float32, device=dev) if splits > 1 else None
    thr = float(threshold if threshold is not None else 0.0)
    with on_device(dev):
        for j in range(0, s, step):
            k = min(s, j + step)
            b = k - j
            g = g_buf[:b]
            rho_out = rho[j:k] if splits == 1 else rho_parts.view(-1)[:splits * b].view(splits, b)
            _g_kernel[(triton.cdiv(b, tg[0]), splits)](
                xc, w_hat[j:k], target_col - j, coef_rel, row_max, g, rho_out,
                n, b, d, float(scale), thr,
                HAS_THRESHOLD=threshold is not None, COMPUTE=_TL_DTYPES[compute_dtype], **consts,
                BLOCK_S=tg[0], BLOCK_N=tg[1], BLOCK_K=tg[2], SPLIT_N=per_split, num_warps=tg[3],
                num_stages=tg[4])
            if splits > 1:
                torch.sum(rho_out, 0, out=rho[j:k])
            dx_hat.add_(_gemm_f32(g.t(), w_hat[j:k]))
            w_blk = w[j:k]
            dw_out = dw[j:k] if splits == 1 else dw_parts.view(-1)[:splits * b * d].view(splits, b, d)
            _dw_kernel[(triton.cdiv(b, tw[0]), triton.cdiv(d, 4 * tw[1]), splits)](
                g, xc, w_blk, w_blk.stride(0), w_blk.stride(1), w_inv_norm[j:k], rho[j:k], c, dw_out,
                n, b, d, **consts,
                BLOCK_S=tw[0], BLOCK_D=tw[1], BLOCK_K=tw[2], SPLIT_N=per_split, PROJECT=bool(project),
                num_warps=tw[3], num_stages=tw[4])
            if splits > 1:
                torch.sum(dw_out, 0, out=dw[j:k])
    return dx_hat.mul_(c), dw


def grad_kept(kept, x_hat, w, w_inv_norm, target_col, coef, row_max, *, scale, threshold, compute_dtype, w_hat=None,
              project: bool = True):
    """:func:`grad` from the cosines the forward kept (:func:`lse_stats` with ``keep``): no
    recomputed product. ``kept [S, N]`` (class-major, :func:`keep_dtype`) is overwritten with
    ``G / c`` in the compute dtype by one pass that also sums ``rho``; then ``dx_hat = c G^T
    w_hat`` and ``dw_hat = G x_hat`` are two cuBLAS products with float32 output, and ``dw`` is
    ``dw_hat`` taken through the normalisation in place by one streaming pass. Cost: ``4 N S d``
    FLOPs, the kept elements read and written once and read by each product; memory beyond the
    outputs: ``4 S`` bytes of ``rho`` (per sample split). Returns ``(dx_hat, dw)``, float32; the
    kept cosines are gone afterwards. ``project=False``: no projection pass, ``dw = c dw_hat``
    (the gradient of ``w_hat``) for a caller that projects it (the row optimizers do, in
    their own pass over the rows)."""
    _validate(x_hat, w, w_inv_norm, target_col, compute_dtype, coef=coef, row_max=row_max)
    n, d = x_hat.shape
    s = w.shape[0]
    dev = x_hat.device
    _check_tensor("kept", kept, (s, n), (keep_dtype(compute_dtype),), dev)
    if not kept.is_contiguous():
        raise ValueError("kept: expected a contiguous [S, N] tensor")
    if n == 0 or s == 0:
        return _zero_grads(n, s, d, dev)
    w_hat, w_inv_norm, xc, c, coef_rel = _backward_operands(x_hat, w, w_inv_norm, w_hat, coef, compute_dtype)
    consts = _consts(compute_dtype)
    g = kept.view(compute_dtype)           # the same storage, reinterpreted: G is written over the cosines
    bs, bn, _, warps, stages = tile_config("gpass", compute_dtype)
    per_split = samples_per_split(compute_dtype)
    splits = triton.cdiv(n, per_split)
    rho_parts = torch.empty(splits, s, dtype=torch.float32, device=dev)
    with on_device(dev):
        _g_pass_kernel[(triton.cdiv(s, bs), splits)](
            kept, g, target_col, coef_rel, row_max, rho_parts, n, s, float(scale),
            float(threshold if threshold is not None else 0.0),
            HAS_THRESHOLD=threshold is not None, COMPUTE=_TL_DTYPES[compute_dtype], UPCAST=consts["UPCAST"],
            BLOCK_S=bs, BLOCK_N=bn, SPLIT_N=per_split, num_warps=warps, num_stages=stages)
        rho = rho_parts[0] if splits == 1 else rho_parts.sum(0)
        dx_hat = _gemm_f32(g.t(), w_hat).mul_(c)
        dw = _gemm_f32(g, xc)
        if not project:
            return dx_hat, dw.mul_(c)
        rows, block_d, _, warps, stages = tile_config("proj", compute_dtype)
        block_d = min(block_d, max(16, triton.next_power_of_2(d)))
        _project_kernel[(triton.cdiv(s, rows),)](
            dw, w, w.stride(0), w.stride(1), w_inv_norm, rho, c, s, d,
            RHO_FROM_DW=False, ROWS=rows, BLOCK_D=block_d, num_warps=warps, num_stages=stages)
    return dx_hat, dw


# ---------------------------------------------------------------------------------------------
# The exp-kept path (bf16 products): the forward stores E = exp(scale * cos - scale * EXP_SHIFT)
# in bf16, and the backward is two cuBLAS products over E with per-sample factors; no G pass.

EXP_SHIFT = 0.5                 # the fixed shift, as a fraction of the scale
# Range. A cosine of bf16-rounded unit vectors is at most about 1 + 2**-8 (1.01 below, with room),
# so an entry is at most exp(0.51 scale) and a rank's l = sum E at most S exp(0.51 scale); float32
# and bf16 share their largest finite value, e**88.72, and ``_LOG_MAX`` leaves headroom below it.
# No overflow therefore needs 0.51 scale + ln S <= 88: scale <= 145 at S = 800k, 141 at 8M, 130 at
# 2**31 (about s <= 150 for any practical rank). At the other end, an entry with
# z < scale / 2 - 87.3 flushes to 0 (below float32's and bf16's smallest normal, 2**-126): that is
# below float32's resolution of the softmax (e**-16.6) whenever some logit of the sample's row,
# the target's included, exceeds scale / 2 - 70 (s = 64: a cosine above -0.6; s = 128: above
# -0.05), which every trained or randomly initialised head satisfies by far.
_LOG_MAX = 88.0
_COS_MAX = 1.01


def exp_scale_bound(s: int) -> float:
    """The largest logit scale the exp-kept path (:func:`exp_stats`, :func:`grad_exp`) is exact
    for on a rank of ``s`` active classes: ``l = sum E`` cannot overflow float32 (see
    ``_LOG_MAX`` above); about 145 at ``s = 800k``."""
    return (_LOG_MAX - math.log(max(1, int(s)))) / (_COS_MAX - EXP_SHIFT)


def _check_exp_scale(scale, s: int) -> None:
    bound = exp_scale_bound(s)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale <= bound:
        raise ValueError(f"scale: the exp-kept path is exact for 0 < scale <= {bound:.1f} at {s} active classes "
                         f"(float32 range of sum exp(scale * cos - scale / 2)), got {scale!r}; use lse_stats "
                         "with keep= (grad_kept) or grad")


def _check_exp(e, s, n, compute_dtype, dev):
    if compute_dtype != torch.bfloat16:
        raise ValueError(f"compute_dtype: the exp-kept path needs bf16 products (E is bf16), got {compute_dtype}")
    _check_tensor("keep", e, (s, n), (torch.bfloat16,), dev)
    if not e.is_contiguous():
        raise ValueError("keep: expected a contiguous [S, N] tensor")


def exp_stats(x_hat, w, w_inv_norm, target_col, *, scale, threshold, compute_dtype, want_max_cos: bool, keep,
              w_hat=None):
    """:func:`lse_stats` that also stores, for the exp-kept backward (:func:`grad_exp`), every
    ``E = exp(scale * cos - scale * EXP_SHIFT)`` in bf16 into ``keep`` (a contiguous class-major
    ``[S, N]`` bf16 tensor): 0 on the target and on filtered negatives (``cos > threshold``,
    decided on the float32 cosine). bf16 products only (``compute_dtype`` bf16), and
    ``0 < scale <= exp_scale_bound(S)``.

    The shift is fixed, so the epilogue keeps no running max: ``l`` is the float32 sum of the
    exponentials and ``m`` is the shift itself (``lse = m + log(l)`` as with :func:`lse_stats`;
    -inf where nothing is kept). The largest non-target cosine is tracked only with
    ``want_max_cos``. Returns ``(m, l, max_cos)``, float32 ``[N]`` (``max_cos`` None unless asked).
    """
    _validate(x_hat, w, w_inv_norm, target_col, compute_dtype)
    n, d = x_hat.shape
    s = w.shape[0]
    dev = x_hat.device
    _check_exp(keep, s, n, compute_dtype, dev)
    _check_exp_scale(scale, s)
    shift = float(scale) * EXP_SHIFT
    m = torch.full((n,), shift if s else float("-inf"), dtype=torch.float32, device=dev)
    l = torch.zeros(n, dtype=torch.float32, device=dev)
    max_cos = torch.full((n,), float("-inf"), dtype=torch.float32, device=dev) if want_max_cos else None
    if n == 0 or s == 0:
        return m, l, max_cos
    if w_hat is None:
        w_hat, _ = prepare(w, compute_dtype)
    xc = x_hat.to(compute_dtype).contiguous()
    block_n, block_s, block_k, warps, stages = tile_config("lse_max" if want_max_cos else "lse", compute_dtype,
                                                          arch=_arch(dev))
    n_tiles = triton.cdiv(n, block_n)
    splits, per = _split(n_tiles, triton.cdiv(s, 4 * block_s), dev)
    l_k = torch.empty(splits, n, dtype=torch.float32, device=dev)
    max_z_k = torch.empty_like(l_k) if want_max_cos else l_k   # dummy pointer when unused
    with on_device(dev):
        _lse_exp_kernel[(n_tiles, splits)](
            xc, w_hat, target_col, l_k, max_z_k, keep,
            n, s, d, 4 * per, float(scale), shift, float(threshold if threshold is not None else 0.0),
            HAS_THRESHOLD=threshold is not None, WANT_MAX_COS=bool(want_max_cos),
            BLOCK_N=block_n, BLOCK_S=block_s, BLOCK_K=block_k, **_consts(compute_dtype),
            num_warps=warps, num_stages=stages)
    l = l_k.sum(dim=0)
    if want_max_cos:
        max_cos = max_z_k.amax(dim=0) / scale
    return m, l, max_cos


def grad_exp(e, x_hat, w, w_inv_norm, coef, row_max, *, scale, compute_dtype, w_hat=None, project: bool = True):
    """The backward of the non-target logits from :func:`exp_stats`' ``E`` (``e [S, N]`` bf16):
    ``G[n, j] = coef[n] exp(z - row_max[n]) = a[n] E[j, n]`` with the per-sample factor
    ``a = coef * exp(scale * EXP_SHIFT - row_max)``, folded into the products instead of
    forming G: ``dx_hat = a * (E^T w_hat)`` (a float32 row scale after a cuBLAS product) and
    ``dw_hat = E (x_hat a)``, the factor inside the bf16 operand: bf16 has float32's exponent
    range, so no rescaling is needed (a float16 operand would need one) and no pass over the
    ``[S, d]`` result is spent on it. ``dw`` is ``dw_hat`` taken through the normalisation by the
    projection pass, with ``rho = <dw_hat_j, w_hat_j>`` summed there in float32. No G pass; ``e``
    is only read. ``project=False``: no projection pass, ``dw = dw_hat`` (the gradient of
    ``w_hat``) for a caller that projects it (the row optimizers do, in their update): the
    backward is then the two products and nothing else over ``[S, d]``. Cost: ``4 N S d``
    FLOPs on cuBLAS, E read once by each product. Returns ``(dx_hat, dw)``, float32."""
    _validate(x_hat, w, w_inv_norm, None, compute_dtype, coef=coef, row_max=row_max)
    n, d = x_hat.shape
    s = w.shape[0]
    dev = x_hat.device
    _check_exp(e, s, n, compute_dtype, dev)
    _check_exp_scale(scale, s)
    if n == 0 or s == 0:
        return _zero_grads(n, s, d, dev)
    if w_hat is None or w_inv_norm is None:
        w_hat, w_inv_norm = prepare(w, compute_dtype)
    a = coef * torch.exp(float(scale) * EXP_SHIFT - row_max)
    xa = (x_hat * a[:, None]).to(compute_dtype)
    rows, block_d, _, warps, stages = tile_config("proj", compute_dtype)
    block_d = min(block_d, max(16, triton.next_power_of_2(d)))
    with on_device(dev):
        dx_hat = _gemm_f32(e.t(), w_hat).mul_(a[:, None])
        dw = _gemm_f32(e, xa)
        if not project:
            return dx_hat, dw
        one = torch.ones(1, dtype=torch.float32, device=dev)
        _project_kernel[(triton.cdiv(s, rows),)](
            dw, w, w.stride(0), w.stride(1), w_inv_norm, one, one, s, d,
            RHO_FROM_DW=True, ROWS=rows, BLOCK_D=block_d, num_warps=warps, num_stages=stages)
    return dx_hat, dw
