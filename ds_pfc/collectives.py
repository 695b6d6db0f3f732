"""Every crossing between ranks, each one tiny autograd Function.

``group=None`` means the default process group when ``torch.distributed`` is
initialised and a single process otherwise; the single-process path never touches
``torch.distributed``. Batches may differ in size between ranks: gloo rejects uneven
all-gathers, so rows are padded to the largest batch and the padding is dropped.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

__all__ = ["world_size", "rank", "gather_sizes", "all_gather_batch", "all_gather_rows", "all_reduce_",
           "all_gather_scalars"]

# torch >= 2.10 renamed the tensor-in/tensor-out collectives; keep both spellings working.
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def world_size(group=None) -> int:
    """Size of ``group``; 1 when running as a single process."""
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def rank(group=None) -> int:
    """This process's rank in ``group``; 0 when running as a single process."""
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return 0
    return dist.get_rank(group)


def all_reduce_(tensor: torch.Tensor, op: str, group=None) -> torch.Tensor:
    """In-place all-reduce (``op`` in {"sum", "max"}); a no-op on one rank."""
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}
    if op not in ops:
        raise ValueError(f"op must be one of {sorted(ops)}, got {op!r}")
    if world_size(group) > 1:
        dist.all_reduce(tensor, op=ops[op], group=group)
    return tensor


def all_gather_scalars(values: Sequence[int | float], group=None, device=None) -> torch.Tensor:
    """``[world, len(values)]`` float64 table of every rank's ``values``."""
    k = world_size(group)
    if k == 1:
        return torch.tensor([list(values)], dtype=torch.float64)
    row = torch.tensor([list(values)], dtype=torch.float64, device=device)
    out = torch.empty(k, row.shape[1], dtype=row.dtype, device=row.device)
    _all_gather_tensor(out, row, group=group)
    return out


def _gather_rows(x: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    """All-gather along dim 0 of ``x`` whose per-rank row counts are ``sizes``."""
    k, longest = len(sizes), max(sizes)
    if x.shape[0] < longest:
        x = torch.cat([x, x.new_zeros((longest - x.shape[0],) + tuple(x.shape[1:]))])
    out = x.new_empty((k * longest,) + tuple(x.shape[1:]))
    _all_gather_tensor(out, x.contiguous(), group=group)
    if all(n == longest for n in sizes):
        return out
    return torch.cat([out[q * longest: q * longest + n] for q, n in enumerate(sizes)])


class _AllGatherRows(torch.autograd.Function):
    """forward: all-gather along dim 0 (uneven sizes padded);
    backward: reduce-scatter (sum) of the gradient, each rank keeps its own rows."""

    @staticmethod
    def forward(ctx, x, sizes, group):
        ctx.sizes, ctx.group = sizes, group
        return _gather_rows(x, sizes, group)

    @staticmethod
    def backward(ctx, grad):
        sizes, group = ctx.sizes, ctx.group
        k, longest, me = len(sizes), max(sizes), rank(group)
        grad = grad.contiguous()
        if any(n != longest for n in sizes):
            padded = grad.new_zeros((k * longest,) + tuple(grad.shape[1:]))
            offset = 0
            for q, n in enumerate(sizes):
                padded[q * longest: q * longest + n] = grad[offset: offset + n]
                offset += n
            grad = padded
        out = grad.new_empty((longest,) + tuple(grad.shape[1:]))
        _reduce_scatter_tensor(out, grad, op=dist.ReduceOp.SUM, group=group)
        return out[: sizes[me]], None, None


def gather_sizes(num_rows: int, group=None, device=None, error: Exception | None = None,
                 what: str = "input") -> list[int]:
    """Every rank's row count, and whether every rank's input passed its checks.

    A rank whose input failed its local checks passes its ``error``: it still joins
    this all-gather (so no other rank waits forever in a later collective) and then
    raises it; the other ranks raise a ``ValueError`` naming the failed ranks. Nothing
    has been changed on any rank at that point.
    """
    if world_size(group) == 1:
        if error is not None:
            raise error
        return [num_rows]
    row = torch.tensor([[num_rows, int(error is None)]], dtype=torch.int64, device=device)
    table = row.new_empty(world_size(group), 2)
    _all_gather_tensor(table, row, group=group)
    if error is not None:
        raise error
    failed = [q for q, ok in enumerate(table[:, 1].tolist()) if not ok]
    if failed:
        raise ValueError(f"{what}: ranks {failed} of the group rejected their {what} (see their errors); "
                         "nothing was changed on any rank")
    return [int(n) for n in table[:, 0].tolist()]


def all_gather_rows(tensor: torch.Tensor, group=None, sizes: list[int] | None = None) -> torch.Tensor:
    """All-gather (no autograd) of every rank's ``tensor [N_q, ...]`` in rank order.
    forward: 1 all-gather of sizes (unless given), 1 of rows."""
    if world_size(group) == 1:
        return tensor
    sizes = gather_sizes(tensor.shape[0], group, tensor.device) if sizes is None else sizes
    return _gather_rows(tensor, sizes, group)


def all_gather_batch(embeddings: torch.Tensor, labels: torch.Tensor, group=None, sizes: list[int] | None = None):
    """Gather every rank's ``embeddings [N_q, d]`` and ``labels [N_q]`` in rank order.

    Returns ``(embeddings [N_total, d], labels [N_total], sizes)`` where ``sizes[q]``
    is rank ``q``'s batch. forward: 1 all-gather of sizes (unless ``sizes`` from
    :func:`gather_sizes` is given), 1 of embeddings, 1 of labels; backward: 1
    reduce-scatter of the embedding gradient (sum).
    """
    k = world_size(group)
    if k == 1:
        return embeddings, labels, [embeddings.shape[0]]
    sizes = gather_sizes(embeddings.shape[0], group, embeddings.device) if sizes is None else sizes
    gathered = _AllGatherRows.apply(embeddings, sizes, group)
    gathered_labels = _gather_rows(labels, sizes, group)
    return gathered, gathered_labels, sizes
