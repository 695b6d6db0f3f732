"""Fused Triton row optimizers: one pass over memory for the rows a step activated.

:func:`sgd_rows_` and :func:`adamw_rows_` apply, in place, the update of
:class:`ds_pfc.core.optim.RowSGD` / :class:`ds_pfc.core.optim.RowAdamW` to the rows ``rows`` of a
``[C, d]`` weight table and its optimizer state. The unfused path gathers the rows,
runs several elementwise ops and scatters them back; here each program loads a tile of
row ids once, reads gradient, weight and state for that tile, and writes weight and
state back, so every element of every tensor crosses memory exactly once.

Rows not listed in ``rows`` (and their state) are never read nor written. ``rows`` must
hold sorted, unique, in-range ids: checking that would cost a host sync, so it is the
caller's contract (duplicate ids would race).

Under ``TRITON_INTERPRET=1`` (set before this module is imported) the kernels run on
CPU tensors with Triton's interpreter, which is how the tests exercise them.
"""
from __future__ import annotations

import math
import os

import torch

from .._checks import check_number as _number
from ._device import on_device
from . import _target

try:
    import triton
    import triton.language as tl
except ImportError:  # the module stays importable; available() says False
    triton = None
    tl = None

__all__ = ["available", "sgd_rows_", "adamw_rows_"]

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

#: Tile shapes. BLOCK_R x BLOCK_D is the (rows x columns) tile of one program of the
#: update kernels; BLOCK_STEP is the number of rows per program of the step-count
#: increment. On Hopper, 8 x 256 fp32 is 8 KiB per tensor per program: 4 warps issue
#: 16-byte vector loads over 256 contiguous columns, and for d = 512 the grid has
#: 2 column tiles per 8 rows, enough programs to fill 132 SMs from a few thousand rows.
#: The interpreter runs each program as Python, so its tiles are small (and leave
#: ragged edges for the tests at d = 24 and 40) rather than fast.
_TILES = {
    #              BLOCK_R  BLOCK_D  num_warps  BLOCK_STEP
    "cuda":        (8,      256,     4,         1024),
    "interpreter": (4,      16,      1,         16),
}

#: Whole-row programs of the projecting update (``project=True``), which needs two sums over
#: each row before it can update any element: (widest row read in one sweep, column tile of
#: the two-sweep form for wider rows, elements per program). A row of up to ONE_SWEEP columns
#: is one ``BLOCK_R x next_pow2(d)`` tile, read once; a wider one is read in column tiles,
#: once for the sums and once for the update. On Hopper, d = 512 gives 4 rows x 512 columns
#: per program (as many elements as the 8 x 256 tile of the plain update); the interpreter's
#: bounds make the tests' d = 24 one sweep and d = 40 two.
_ROW_TILES = {
    #              ONE_SWEEP  SWEEP_D  ELEMENTS
    "cuda":        (2048,     1024,    2048),
    "interpreter": (32,       16,      64),
}

#: Smallest row norm the projection divides by (as the softmax's normalisation).
_NORM_EPS = 1e-12


def available() -> bool:
    """True when the kernels can run here: Triton is installed and there is a CUDA
    device, or ``TRITON_INTERPRET=1`` was set before import (CPU tensors)."""
    return triton is not None and (_INTERPRET or torch.cuda.is_available())


def _tiles():
    return _TILES["interpreter" if _INTERPRET and not _target.active() else "cuda"]


def _row_tiles(width: int):
    """``(BLOCK_R, BLOCK_D, ONE_SWEEP)`` of the whole-row (projecting) kernels for rows of ``width``."""
    one_sweep, sweep_d, elements = _ROW_TILES["interpreter" if _INTERPRET and not _target.active() else "cuda"]
    whole = triton.next_power_of_2(max(width, 1))
    block_d = whole if whole <= one_sweep else sweep_d
    return max(1, elements // block_d), block_d, whole <= one_sweep


if triton is not None:

    @triton.jit
    def _row_ids(rows_ptr, stride_rows, R, HAS_ROWS: tl.constexpr, BLOCK_R: tl.constexpr):
        """This program's positions in ``grad`` and row ids in the tables, as int64
        (row * stride overflows int32 on tables of millions of rows)."""
        pos = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
        in_range = pos < R
        if HAS_ROWS:
            row = tl.load(rows_ptr + pos * stride_rows, mask=in_range, other=0)
        else:
            row = pos
        return pos, row, in_range

    @triton.jit
    def _project(g, w, sum_ww, sum_wg):
        """The tangent projection of a tile of ``g`` (the gradient of ``w_hat = w / ||w||``)
        through the normalisation of its rows ``w``: ``(g - w_hat <w_hat, g>) / ||w||``, from the
        rows' sums ``||w||^2`` and ``<w, g>`` (float32)."""
        inv = tl.div_rn(1.0, tl.maximum(tl.sqrt_rn(sum_ww), 1e-12))
        radial = sum_wg * inv
        return (g - (w * inv[:, None]) * radial[:, None]) * inv[:, None]

    @triton.jit
    def _row_tile(w_ptr, g_ptr, pos, row, in_range, cols, D, stride_w, stride_g):
        """Columns ``cols`` of this program's rows: ``(g, w, w's addresses, mask)``."""
        mask = in_range[:, None] & (cols < D)[None, :]
        g = tl.load(g_ptr + pos[:, None] * stride_g + cols[None, :], mask=mask, other=0.0)
        w_at = w_ptr + row[:, None] * stride_w + cols[None, :]
        w = tl.load(w_at, mask=mask, other=0.0)
        return g, w, w_at, mask

    @triton.jit
    def _row_sums(w_ptr, g_ptr, pos, row, in_range, D, stride_w, stride_g,
                  BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
        """``(||w_r||^2, <w_r, g_r>)`` of this program's rows, one sweep over their columns."""
        sum_ww = tl.zeros([BLOCK_R], tl.float32)
        sum_wg = tl.zeros([BLOCK_R], tl.float32)
        for k0 in range(0, D, BLOCK_D):
            g, w, w_at, mask = _row_tile(w_ptr, g_ptr, pos, row, in_range, k0 + tl.arange(0, BLOCK_D), D,
                                         stride_w, stride_g)
            sum_ww += tl.sum(w * w, axis=1)
            sum_wg += tl.sum(w * g, axis=1)
        return sum_ww, sum_wg

    @triton.jit
    def _sgd_tile(g, w, w_at, buf_ptr, row, cols, mask, stride_buf, lr, momentum, weight_decay,
                  HAS_MOMENTUM: tl.constexpr, HAS_WEIGHT_DECAY: tl.constexpr, NESTEROV: tl.constexpr):
        """The SGD update of one loaded tile (gradient ``g``, weight ``w``): stores weight and buffer."""
        # The flags are constexpr so that a zero hyper-parameter skips its term
        # exactly as RowSGD does (g + 0 * w would turn an inf weight into nan).
        step = g
        if HAS_WEIGHT_DECAY:
            step = g + weight_decay * w
        if HAS_MOMENTUM:
            buf_at = buf_ptr + row[:, None] * stride_buf + cols[None, :]
            # RowSGD's zero-initialised buffer: momentum * 0 + step == step on the
            # first update, which is what torch.optim.SGD's buffer init amounts to.
            buf = momentum * tl.load(buf_at, mask=mask) + step
            tl.store(buf_at, buf, mask=mask)
            if NESTEROV:
                step = step + momentum * buf
            else:
                step = buf
        tl.store(w_at, w - lr * step, mask=mask)

    @triton.jit
    def _sgd_rows_kernel(w_ptr, buf_ptr, rows_ptr, g_ptr, R, D,
                         stride_w, stride_buf, stride_rows, stride_g,
                         lr, momentum, weight_decay,
                         HAS_ROWS: tl.constexpr, HAS_MOMENTUM: tl.constexpr,
                         HAS_WEIGHT_DECAY: tl.constexpr, NESTEROV: tl.constexpr,
                         PROJECT: tl.constexpr, ONE_SWEEP: tl.constexpr,
                         BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
        """Grid (row tiles, column tiles); with PROJECT, (row tiles,): whole rows, ``g`` taken
        through the normalisation of the row first (one sweep when ONE_SWEEP, else a sweep for
        the row sums and one for the update)."""
        pos, row, in_range = _row_ids(rows_ptr, stride_rows, R, HAS_ROWS, BLOCK_R)
        if PROJECT:
            if ONE_SWEEP:
                cols = tl.arange(0, BLOCK_D)
                g, w, w_at, mask = _row_tile(w_ptr, g_ptr, pos, row, in_range, cols, D, stride_w, stride_g)
                g = _project(g, w, tl.sum(w * w, axis=1), tl.sum(w * g, axis=1))
                _sgd_tile(g, w, w_at, buf_ptr, row, cols, mask, stride_buf, lr, momentum, weight_decay,
                          HAS_MOMENTUM, HAS_WEIGHT_DECAY, NESTEROV)
            else:
                sum_ww, sum_wg = _row_sums(w_ptr, g_ptr, pos, row, in_range, D, stride_w, stride_g,
                                           BLOCK_R, BLOCK_D)
                for k0 in range(0, D, BLOCK_D):
                    cols = k0 + tl.arange(0, BLOCK_D)
                    g, w, w_at, mask = _row_tile(w_ptr, g_ptr, pos, row, in_range, cols, D, stride_w, stride_g)
                    g = _project(g, w, sum_ww, sum_wg)
                    _sgd_tile(g, w, w_at, buf_ptr, row, cols, mask, stride_buf, lr, momentum, weight_decay,
                              HAS_MOMENTUM, HAS_WEIGHT_DECAY, NESTEROV)
        else:
            cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
            mask = in_range[:, None] & (cols < D)[None, :]
            g = tl.load(g_ptr + pos[:, None] * stride_g + cols[None, :], mask=mask)
            w_at = w_ptr + row[:, None] * stride_w + cols[None, :]
            w = tl.load(w_at, mask=mask)
            _sgd_tile(g, w, w_at, buf_ptr, row, cols, mask, stride_buf, lr, momentum, weight_decay,
                      HAS_MOMENTUM, HAS_WEIGHT_DECAY, NESTEROV)

    @triton.jit
    def _one_minus_pow(log_beta, t):
        """``1 - beta**t`` from ``log(beta)`` (<= 0) and ``t`` >= 1, in float32.

        ``1 - exp(x)`` cancels when ``beta**t`` is near 1 (beta2 = 0.999 at small t
        loses ~4 digits), so for x > -1 it is ``-expm1(x)`` by its Taylor series
        (terms to x**11 / 11!: the rest is < 3e-9). Below -1, exp(x) < 0.37 and the
        subtraction is well conditioned. Error: ~2e-7 relative, mostly the float32
        rounding of log(beta) and of t * log(beta).
        """
        x = t * log_beta
        p = 2.505210838544172e-08          # 1/11!
        p = p * x + 2.755731922398589e-07  # 1/10!
        p = p * x + 2.755731922398589e-06  # 1/9!
        p = p * x + 2.480158730158730e-05  # 1/8!
        p = p * x + 1.984126984126984e-04  # 1/7!
        p = p * x + 1.388888888888889e-03  # 1/6!
        p = p * x + 8.333333333333333e-03  # 1/5!
        p = p * x + 4.166666666666666e-02  # 1/4!
        p = p * x + 1.666666666666667e-01  # 1/3!
        p = p * x + 0.5
        p = p * x + 1.0
        return tl.where(x > -1.0, -x * p, 1.0 - tl.exp(x))

    @triton.jit
    def _adamw_tile(g, w, w_at, m_ptr, v_ptr, row, cols, mask, stride_m, stride_v, lr, beta1, beta2,
                    one_minus_beta1, one_minus_beta2, eps, decay, bias1, bias2_sqrt):
        """The AdamW update of one loaded tile: stores weight and both moments."""
        m_at = m_ptr + row[:, None] * stride_m + cols[None, :]
        v_at = v_ptr + row[:, None] * stride_v + cols[None, :]
        m = tl.load(m_at, mask=mask) * beta1 + one_minus_beta1 * g
        v = tl.load(v_at, mask=mask) * beta2 + one_minus_beta2 * g * g
        # Same operation order as RowAdamW; IEEE sqrt/div (not the approximate ones)
        # keep it within a few ulps of torch, and cost nothing in a memory-bound kernel.
        denom = tl.div_rn(tl.sqrt_rn(v), bias2_sqrt) + eps
        w = w * decay - lr * tl.div_rn(m, denom * bias1)
        tl.store(w_at, w, mask=mask)
        tl.store(m_at, m, mask=mask)
        tl.store(v_at, v, mask=mask)

    @triton.jit
    def _adamw_rows_kernel(w_ptr, m_ptr, v_ptr, step_ptr, rows_ptr, g_ptr, R, D,
                           stride_w, stride_m, stride_v, stride_step, stride_rows, stride_g,
                           lr, beta1, beta2, one_minus_beta1, one_minus_beta2,
                           log_beta1, log_beta2, eps, decay,
                           HAS_ROWS: tl.constexpr, PROJECT: tl.constexpr, ONE_SWEEP: tl.constexpr,
                           BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
        """Grid (row tiles, column tiles); with PROJECT, (row tiles,): whole rows, ``g`` taken
        through the normalisation of the row first, and the step count bumped here (each row
        belongs to one program)."""
        pos, row, in_range = _row_ids(rows_ptr, stride_rows, R, HAS_ROWS, BLOCK_R)
        # The step count is only read here when rows are split over column tiles (every
        # tile of a row needs the same t); _increment_steps_kernel bumps it after this launch.
        t_int = tl.load(step_ptr + row * stride_step, mask=in_range, other=0) + 1
        t = t_int.to(tl.float32)
        bias1 = _one_minus_pow(log_beta1, t)[:, None]
        bias2_sqrt = tl.sqrt_rn(_one_minus_pow(log_beta2, t))[:, None]
        if PROJECT:
            if ONE_SWEEP:
                cols = tl.arange(0, BLOCK_D)
                g, w, w_at, mask = _row_tile(w_ptr, g_ptr, pos, row, in_range, cols, D, stride_w, stride_g)
                g = _project(g, w, tl.sum(w * w, axis=1), tl.sum(w * g, axis=1))
                _adamw_tile(g, w, w_at, m_ptr, v_ptr, row, cols, mask, stride_m, stride_v, lr, beta1, beta2,
                            one_minus_beta1, one_minus_beta2, eps, decay, bias1, bias2_sqrt)
            else:
                sum_ww, sum_wg = _row_sums(w_ptr, g_ptr, pos, row, in_range, D, stride_w, stride_g,
                                           BLOCK_R, BLOCK_D)
                for k0 in range(0, D, BLOCK_D):
                    cols = k0 + tl.arange(0, BLOCK_D)
                    g, w, w_at, mask = _row_tile(w_ptr, g_ptr, pos, row, in_range, cols, D, stride_w, stride_g)
                    g = _project(g, w, sum_ww, sum_wg)
                    _adamw_tile(g, w, w_at, m_ptr, v_ptr, row, cols, mask, stride_m, stride_v, lr, beta1, beta2,
                                one_minus_beta1, one_minus_beta2, eps, decay, bias1, bias2_sqrt)
            tl.store(step_ptr + row * stride_step, t_int, mask=in_range)
        else:
            cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
            mask = in_range[:, None] & (cols < D)[None, :]
            g = tl.load(g_ptr + pos[:, None] * stride_g + cols[None, :], mask=mask)
            w_at = w_ptr + row[:, None] * stride_w + cols[None, :]
            w = tl.load(w_at, mask=mask)
            _adamw_tile(g, w, w_at, m_ptr, v_ptr, row, cols, mask, stride_m, stride_v, lr, beta1, beta2,
                        one_minus_beta1, one_minus_beta2, eps, decay, bias1, bias2_sqrt)

    @triton.jit
    def _increment_steps_kernel(step_ptr, rows_ptr, R, stride_step, stride_rows,
                                HAS_ROWS: tl.constexpr, BLOCK_STEP: tl.constexpr):
        pos, row, in_range = _row_ids(rows_ptr, stride_rows, R, HAS_ROWS, BLOCK_STEP)
        at = step_ptr + row * stride_step
        tl.store(at, tl.load(at, mask=in_range) + 1, mask=in_range)


# ----------------------------------------------------------------------------- checks

def _check_tensor(name, t, dtype, shape, device):
    """``t`` is a tensor of ``dtype`` and ``shape`` on ``device`` whose last dimension
    is contiguous (the kernels take one stride per tensor: the row stride)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{name} must have dtype {dtype}, got {t.dtype}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device} (the device of grad), got {t.device}")
    if t.dim() == 2 and t.shape[1] > 1 and t.stride(1) != 1:
        raise ValueError(f"{name} must be contiguous along its last dimension, got strides {t.stride()}")


def _check_common(weight, rows, grad):
    """Checks grad, rows and weight; returns ``(R, d)``."""
    if triton is None:
        raise RuntimeError("triton is not installed (pip install -e .[dev])")
    if not isinstance(grad, torch.Tensor):
        raise TypeError(f"grad must be a torch.Tensor, got {type(grad).__name__}")
    if grad.dim() != 2:
        raise ValueError(f"grad must have shape [R, d], got {list(grad.shape)}")
    if not _INTERPRET and grad.device.type != "cuda":
        raise ValueError(f"grad must be a CUDA tensor (or set TRITON_INTERPRET=1 before import), "
                         f"got device {grad.device}")
    num_rows, width = grad.shape
    _check_tensor("grad", grad, torch.float32, grad.shape, grad.device)
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"weight must be a torch.Tensor, got {type(weight).__name__}")
    if rows is None:
        _check_tensor("weight", weight, torch.float32, (num_rows, width), grad.device)
    else:
        if not isinstance(rows, torch.Tensor):
            raise TypeError(f"rows must be a torch.Tensor or None, got {type(rows).__name__}")
        if rows.dtype != torch.int64:
            raise TypeError(f"rows must have dtype torch.int64, got {rows.dtype}")
        if rows.dim() != 1 or rows.shape[0] != num_rows:
            raise ValueError(f"rows must have shape [{num_rows}] (one per row of grad), got {list(rows.shape)}")
        if rows.device != grad.device:
            raise ValueError(f"rows must be on {grad.device} (the device of grad), got {rows.device}")
        if weight.dim() != 2:
            raise ValueError(f"weight must have shape [C, {width}], got {list(weight.shape)}")
        _check_tensor("weight", weight, torch.float32, (weight.shape[0], width), grad.device)
    return num_rows, width


def _rows_args(rows, grad):
    """``(rows pointer, rows stride, HAS_ROWS)``; grad stands in as a never-read pointer."""
    return (grad, 0, False) if rows is None else (rows, rows.stride(0), True)


# ------------------------------------------------------------------------------- API

def sgd_rows_(weight: torch.Tensor, momentum_buffer: torch.Tensor | None, rows: torch.Tensor | None,
              grad: torch.Tensor, *, lr: float, momentum: float, weight_decay: float,
              nesterov: bool, project: bool = False) -> None:
    """In place, ``RowSGD.update_rows``: ``torch.optim.SGD`` (dampening 0) on each row.

    Per row ``r = rows[i]`` with ``g = grad[i]``::

        step = g + weight_decay * weight[r]
        buf[r] = momentum * buf[r] + step            # zero-initialised buffer
        step = step + momentum * buf[r] if nesterov else buf[r]
        weight[r] -= lr * step

    Args:
        weight: ``[C, d]`` float32, updated at ``rows``.
        momentum_buffer: ``[C, d]`` float32, updated at ``rows``; required when
            ``momentum > 0``, ignored (left untouched) when ``momentum == 0``.
        rows: ``[R]`` int64 sorted unique row ids, or None for rows ``0..R-1`` (then
            the tables have exactly ``R`` rows).
        grad: ``[R, d]`` float32, row ``i`` the gradient of row ``rows[i]``.
        project: ``grad`` is the gradient of the normalised rows ``w_hat = w / ||w||``
            (what the softmax leaves unprojected when the optimizer projects it); each row
            is first taken through the normalisation of the weight it updates,
            ``g = (g - w_hat <w_hat, g>) / max(||w||, 1e-12)``, in float32, by whole-row
            programs (the two row sums need all of a row before any element is updated).
            The traffic stays that of the plain update for rows up to 2048 columns (one
            read of each row); wider rows read grad and weight twice.

    Memory traffic per element: with momentum 12 B read (grad, weight, buffer) and
    8 B written (weight, buffer) = 20 B; without, 8 B read + 4 B written = 12 B. Plus
    8 B per row and column tile for the row id. The weight change agrees with
    ``torch.optim.SGD`` to within 5e-7 relative (rounding order only).
    """
    num_rows, width = _check_common(weight, rows, grad)
    lr = _number("lr", lr, 0.0)
    momentum = _number("momentum", momentum, 0.0, 1.0, high_open=True)
    weight_decay = _number("weight_decay", weight_decay, 0.0)
    if nesterov and momentum == 0.0:
        raise ValueError("nesterov=True needs momentum > 0")
    if momentum:
        if momentum_buffer is None:
            raise ValueError("momentum_buffer is required when momentum > 0")
        _check_tensor("momentum_buffer", momentum_buffer, torch.float32, weight.shape, grad.device)
    if num_rows == 0 or width == 0:
        return

    block_r, block_d, num_warps, _ = _tiles()
    one_sweep = False
    if project:
        block_r, block_d, one_sweep = _row_tiles(width)
    rows_ptr, stride_rows, has_rows = _rows_args(rows, grad)
    buf = momentum_buffer if momentum else weight  # never read without momentum
    grid = (triton.cdiv(num_rows, block_r), 1 if project else triton.cdiv(width, block_d))
    with on_device(grad.device):    # Triton launches on the current device, not the tensors'
        _sgd_rows_kernel[grid](
            weight, buf, rows_ptr, grad, num_rows, width,
            weight.stride(0), buf.stride(0), stride_rows, grad.stride(0),
            lr, momentum, weight_decay,
            HAS_ROWS=has_rows, HAS_MOMENTUM=momentum != 0.0, HAS_WEIGHT_DECAY=weight_decay != 0.0,
            NESTEROV=bool(nesterov), PROJECT=bool(project), ONE_SWEEP=one_sweep,
            BLOCK_R=block_r, BLOCK_D=block_d, num_warps=num_warps)


def adamw_rows_(weight: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                step: torch.Tensor, rows: torch.Tensor | None, grad: torch.Tensor, *, lr: float,
                beta1: float, beta2: float, eps: float, weight_decay: float, project: bool = False) -> None:
    """In place, ``RowAdamW.update_rows``: ``torch.optim.AdamW`` on each row, with the
    bias corrections of that row's own step count.

    Per row ``r = rows[i]`` with ``g = grad[i]`` and ``t = step[r] + 1``::

        m[r] = beta1 * m[r] + (1 - beta1) * g
        v[r] = beta2 * v[r] + (1 - beta2) * g * g
        denom = sqrt(v[r]) / sqrt(1 - beta2**t) + eps
        weight[r] = weight[r] * (1 - lr * weight_decay) - lr * m[r] / (denom * (1 - beta1**t))
        step[r] = t

    Args:
        weight, exp_avg, exp_avg_sq: ``[C, d]`` float32, updated at ``rows``.
        step: ``[C]`` int32, incremented at ``rows``.
        rows, grad, project: as in :func:`sgd_rows_`; with ``project`` the step count is
            bumped by the update's own launch (a row is one program), not by a second one.

    Memory traffic per element: 16 B read (grad, weight, exp_avg, exp_avg_sq) and 12 B
    written (weight, exp_avg, exp_avg_sq) = 28 B. Per row: 8 B row id + 4 B step read
    per column tile, then the increment launch reads 8 B + 4 B and writes 4 B.

    The bias corrections are computed per row in float32 (``RowAdamW`` uses float64);
    the weight change agrees with ``torch.optim.AdamW`` to within 1e-6 relative
    (measured ~2.5e-7; see tests/test_triton_optim.py).
    """
    num_rows, width = _check_common(weight, rows, grad)
    _check_tensor("exp_avg", exp_avg, torch.float32, weight.shape, grad.device)
    _check_tensor("exp_avg_sq", exp_avg_sq, torch.float32, weight.shape, grad.device)
    _check_tensor("step", step, torch.int32, weight.shape[:1], grad.device)
    lr = _number("lr", lr, 0.0)
    beta1 = _number("beta1", beta1, 0.0, 1.0, high_open=True)
    beta2 = _number("beta2", beta2, 0.0, 1.0, high_open=True)
    eps = _number("eps", eps, 0.0)
    weight_decay = _number("weight_decay", weight_decay, 0.0)
    if num_rows == 0:
        return

    block_r, block_d, num_warps, block_step = _tiles()
    rows_ptr, stride_rows, has_rows = _rows_args(rows, grad)
    # beta == 0 gives beta**t == 0 for t >= 1: log(0) = -inf, exp(-inf) = 0.
    log_beta1 = math.log(beta1) if beta1 > 0 else -math.inf
    log_beta2 = math.log(beta2) if beta2 > 0 else -math.inf
    with on_device(grad.device):    # Triton launches on the current device, not the tensors'
        _adamw_launches(weight, exp_avg, exp_avg_sq, step, rows_ptr, grad, num_rows, width, stride_rows, has_rows,
                        lr, beta1, beta2, log_beta1, log_beta2, eps, weight_decay, block_r, block_d, num_warps,
                        block_step, bool(project))


def _adamw_launches(weight, exp_avg, exp_avg_sq, step, rows_ptr, grad, num_rows, width, stride_rows, has_rows,
                    lr, beta1, beta2, log_beta1, log_beta2, eps, weight_decay, block_r, block_d, num_warps,
                    block_step, project=False):
    if width and project:
        # Whole rows: the launch that updates a row also bumps its step count.
        block_r, block_d, one_sweep = _row_tiles(width)
        _adamw_rows_kernel[(triton.cdiv(num_rows, block_r), 1)](
            weight, exp_avg, exp_avg_sq, step, rows_ptr, grad, num_rows, width,
            weight.stride(0), exp_avg.stride(0), exp_avg_sq.stride(0), step.stride(0),
            stride_rows, grad.stride(0),
            lr, beta1, beta2, 1.0 - beta1, 1.0 - beta2, log_beta1, log_beta2, eps,
            1.0 - lr * weight_decay,
            HAS_ROWS=has_rows, PROJECT=True, ONE_SWEEP=one_sweep, BLOCK_R=block_r, BLOCK_D=block_d,
            num_warps=num_warps)
        return
    if width:
        # Every column tile of a row reads the same step count, so the count cannot be
        # bumped in this launch without racing; the second launch does it after.
        grid = (triton.cdiv(num_rows, block_r), triton.cdiv(width, block_d))
        _adamw_rows_kernel[grid](
            weight, exp_avg, exp_avg_sq, step, rows_ptr, grad, num_rows, width,
            weight.stride(0), exp_avg.stride(0), exp_avg_sq.stride(0), step.stride(0),
            stride_rows, grad.stride(0),
            lr, beta1, beta2, 1.0 - beta1, 1.0 - beta2, log_beta1, log_beta2, eps,
            1.0 - lr * weight_decay,
            HAS_ROWS=has_rows, PROJECT=False, ONE_SWEEP=False, BLOCK_R=block_r, BLOCK_D=block_d,
            num_warps=num_warps)
    _increment_steps_kernel[(triton.cdiv(num_rows, block_step),)](
        step, rows_ptr, num_rows, step.stride(0), stride_rows,
        HAS_ROWS=has_rows, BLOCK_STEP=block_step, num_warps=num_warps)
