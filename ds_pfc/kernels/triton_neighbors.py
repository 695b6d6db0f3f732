"""Cosine products with the threshold and a per-tile top-k fused in (one Triton kernel).

For a block of unit query rows ``[Q, d]`` and unit key rows ``[K, d]`` (global ids
``key_start ..``), each program computes one ``[BLOCK_Q, BLOCK_K]`` tile of products
in registers, drops products below ``threshold`` and the key whose id equals the
query's ``query_ids`` entry, and writes only the tile's ``k`` best per query (value and
global key id; ``-inf`` / ``-1`` when fewer pass): ``[Q, ceil(K / BLOCK_K) k]``
candidates instead of ``Q K`` products. The caller merges them
(:mod:`ds_pfc.core.neighbors`). Products accumulate in float32 with IEEE (not TF32)
inputs, so they match a float32 matrix product to rounding. Importing this module
imports triton.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._device import on_device

__all__ = ["tile_topk", "BLOCK_K"]

BLOCK_Q, BLOCK_K, BLOCK_D = 32, 64, 32


@triton.jit
def _tile_topk_kernel(q_ptr, k_ptr, qid_ptr, out_v_ptr, out_i_ptr, num_q, num_k, dim, key_start, threshold,
                      stride_q, stride_k, num_tiles, HAS_IDS: tl.constexpr, TOP: tl.constexpr,
                      BQ: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr):
    pid_q = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_q * BQ + tl.arange(0, BQ)
    cols = pid_k * BK + tl.arange(0, BK)
    acc = tl.zeros((BQ, BK), dtype=tl.float32)
    for d0 in range(0, dim, BD):
        dd = d0 + tl.arange(0, BD)
        q = tl.load(q_ptr + rows[:, None] * stride_q + dd[None, :], mask=(rows[:, None] < num_q) & (dd[None, :] < dim),
                    other=0.0)
        k = tl.load(k_ptr + cols[:, None] * stride_k + dd[None, :], mask=(cols[:, None] < num_k) & (dd[None, :] < dim),
                    other=0.0)
        acc += tl.dot(q, tl.trans(k), input_precision="ieee")
    neg = float("-inf")
    ids = key_start + cols
    keep = (cols[None, :] < num_k) & (acc >= threshold)
    if HAS_IDS:
        qid = tl.load(qid_ptr + rows, mask=rows < num_q, other=-1)
        keep = keep & (qid[:, None] != ids[None, :])
    acc = tl.where(keep, acc, neg)
    for t in tl.static_range(TOP):
        best = tl.max(acc, axis=1)
        where = tl.argmax(acc, axis=1)
        found = best > neg
        out = rows * (num_tiles * TOP) + pid_k * TOP + t
        tl.store(out_v_ptr + out, best, mask=rows < num_q)
        tl.store(out_i_ptr + out, tl.where(found, key_start + pid_k * BK + where, -1), mask=rows < num_q)
        acc = tl.where(tl.arange(0, BK)[None, :] == where[:, None], neg, acc)


def tile_topk(queries: torch.Tensor, keys: torch.Tensor, k: int, *, threshold: float | None = None,
              query_ids: torch.Tensor | None = None, key_start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values [Q, T k], indices [Q, T k])`` with ``T = ceil(K / BLOCK_K)``: every key
    tile's ``k`` best products per query (float32 unit rows in, see the module
    docstring). ``k`` is at most ``BLOCK_K``."""
    if not 1 <= k <= BLOCK_K:
        raise ValueError(f"k must be in [1, {BLOCK_K}] for the fused kernel, got {k}")
    queries = queries.float().contiguous()
    keys = keys.float().contiguous()
    num_q, num_k, dim = queries.shape[0], keys.shape[0], queries.shape[1]
    tiles = triton.cdiv(num_k, BLOCK_K)
    values = torch.empty(num_q, tiles * k, dtype=torch.float32, device=queries.device)
    indices = torch.empty(num_q, tiles * k, dtype=torch.int64, device=queries.device)
    if num_q == 0 or tiles == 0:
        return values, indices
    ids = query_ids.contiguous() if query_ids is not None else indices     # unused without ids
    with on_device(queries.device):
        _tile_topk_kernel[(triton.cdiv(num_q, BLOCK_Q), tiles)](
            queries, keys, ids, values, indices, num_q, num_k, dim, key_start,
            float("-inf") if threshold is None else float(threshold), queries.stride(0), keys.stride(0), tiles,
            HAS_IDS=query_ids is not None, TOP=k, BQ=BLOCK_Q, BK=BLOCK_K, BD=BLOCK_D)
    return values, indices
