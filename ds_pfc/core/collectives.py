"""Every crossing between ranks, each one tiny autograd Function.

``group=None`` means the default process group when ``torch.distributed`` is
initialised and a single process otherwise; the single-process path never touches
``torch.distributed``. Batches may differ in size between ranks: gloo rejects uneven
all-gathers, so rows are padded to the largest batch and the padding is dropped.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

__all__ = ["world_size", "rank", "gather_sizes", "all_gather_batch", "all_gather_rows", "all_reduce_",
           "all_gather_scalars", "BatchLayout", "batch_layout", "group_ranks", "all_gather_row", "assert_equal_sizes"]

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


def all_gather_row(row: torch.Tensor, group=None) -> torch.Tensor:
    """``[world, m]``: every rank's ``row [m]`` (on the device ``row`` is on, which must
    suit the group's backend), without reading anything back to the host."""
    row = row.reshape(1, -1)
    k = world_size(group)
    if k == 1:
        return row
    out = row.new_empty(k, row.shape[1])
    _all_gather_tensor(out, row.contiguous(), group=group)
    return out


def assert_equal_sizes(num_rows: int, group=None, device=None, what: str = "input") -> list[int]:
    """Every rank's row count when all ranks pass ``num_rows`` rows: ``[num_rows] *
    world``, known to the host without asking the other ranks.

    The agreement is checked on the device (``torch._assert_async`` on an all-gather of
    the counts): no host sync, and a CUDA graph can capture it. Uneven batches fail as
    a device-side assert (on CPU at once, as a ``RuntimeError``); check them with
    :func:`gather_sizes` to pad them instead. forward: 1 all-gather of ``world`` int64.
    """
    k = world_size(group)
    if k > 1:
        table = all_gather_row(torch.full((1,), num_rows, dtype=torch.int64, device=device), group)
        torch._assert_async((table == num_rows).all(),
                             f"{what}: the ranks passed batches of different sizes; validate=False needs equal "
                             "batch sizes on every rank (validate=True pads uneven batches)")
    return [num_rows] * k


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
    has been changed on any rank at that point. One all-gather and one host sync (the
    sizes decide the padding of the gathers that follow).
    """
    if world_size(group) == 1:
        if error is not None:
            raise error
        return [num_rows]
    # torch.full, not torch.tensor: no copy from pageable host memory; one read back.
    row = torch.full((1, 2), num_rows, dtype=torch.int64, device=device)
    row[0, 1] = int(error is None)
    table = all_gather_row(row, group).tolist()
    if error is not None:
        raise error
    failed = [q for q, (_, ok) in enumerate(table) if not ok]
    if failed:
        raise ValueError(f"{what}: ranks {failed} of the group rejected their {what} (see their errors); "
                         "nothing was changed on any rank")
    return [int(n) for n, _ in table]


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


# ----------------------------------------------------------------- two groups
def group_ranks(group=None) -> list[int]:
    """Global ranks of ``group`` in group-rank order (``[0]`` for a single process)."""
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return [0]
    return list(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


@dataclass(frozen=True)
class BatchLayout:
    """How the samples are laid out over a class group ``G`` when they are gathered over
    a smaller batch group ``B`` (tensor parallelism: the ranks of ``G`` at the same
    position of their ``B`` are peers holding identical samples).

    ``positions[q]``: the position in its batch group of rank ``q`` of ``G``;
    ``peer_group``: this rank's peers (None when ``B`` spans ``G``: no peers);
    ``batch_rank`` / ``batch_world``: this rank's position in ``B`` and its size."""

    batch_group: object
    peer_group: object
    positions: tuple[int, ...]
    batch_rank: int
    batch_world: int

    @property
    def replicas(self) -> int:
        """Ranks of ``G`` per batch position (the tensor-parallel degree)."""
        return len(self.positions) // self.batch_world


_LAYOUTS: dict = {}


def batch_layout(group, batch_group, device) -> BatchLayout:
    """The :class:`BatchLayout` of ``batch_group`` within ``group`` (a collective over
    ``group`` the first time for a pair of groups; cached after).

    Checks, on every rank together (so a bad layout fails everywhere instead of
    leaving some rank in a later collective): ``batch_group``'s ranks all belong to
    ``group``; every batch group has the same size; every position has the same
    number of peers. The peers' group is created among the peers only."""
    key = (id(group), id(batch_group))
    if key in _LAYOUTS:
        return _LAYOUTS[key][0]
    g_ranks = group_ranks(group)
    problem, b_rank, b_world = None, -1, -1
    try:
        b_ranks = group_ranks(batch_group)
        outside = sorted(set(b_ranks) - set(g_ranks))
        if outside:
            raise ValueError(f"batch_group has ranks {outside} outside group (its ranks {b_ranks}, the group's "
                             f"{g_ranks}); the samples must be gathered over a subset of the ranks the classes "
                             "are sharded over")
        b_rank, b_world = rank(batch_group), world_size(batch_group)
    except (TypeError, ValueError, RuntimeError) as err:
        problem = err
    table = all_gather_scalars([b_rank, b_world, int(problem is None)], group, device).long().tolist()
    if problem is not None:
        raise problem
    failed = [q for q, row in enumerate(table) if row[2] != 1]
    if failed:
        raise ValueError(f"ranks {failed} of the group rejected their batch_group (see their errors)")
    worlds = sorted({row[1] for row in table})
    positions = tuple(row[0] for row in table)
    counts = {p: positions.count(p) for p in range(worlds[0])}
    if len(worlds) > 1 or len(set(counts.values())) != 1 or sum(counts.values()) != len(g_ranks):
        layout = {g_ranks[q]: f"{positions[q]}/{table[q][1]}" for q in range(len(g_ranks))}
        raise ValueError(f"batch groups must split the group into equal data-parallel groups with every position "
                         f"held by the same number of ranks; rank -> position/size: {layout}")
    me = rank(group)
    peers = [g_ranks[q] for q in range(len(g_ranks)) if positions[q] == positions[me]]
    peer_group = None
    if len(peers) > 1:
        peer_group = dist.new_group(peers, use_local_synchronization=True)
    layout = BatchLayout(batch_group, peer_group, positions, positions[me], worlds[0])
    _LAYOUTS[key] = (layout, group, batch_group)     # the groups stay alive with their key
    return layout


def gather_batch_sizes(num_rows: int, group, layout: BatchLayout, device=None, error: Exception | None = None,
                       what: str = "input") -> list[int]:
    """:func:`gather_sizes` over ``group`` reduced to one size per batch position; peers
    must agree (they hold the same samples)."""
    sizes = gather_sizes(num_rows, group, device, error, what)
    per_position: dict[int, set] = {}
    for q, n in enumerate(sizes):
        per_position.setdefault(layout.positions[q], set()).add(n)
    bad = {p: sorted(v) for p, v in per_position.items() if len(v) > 1}
    if bad:
        raise ValueError(f"{what}: ranks at the same batch position (tensor-parallel peers) must pass the same "
                         f"samples, but their batch sizes differ: position -> sizes {bad}")
    return [per_position[p].pop() for p in range(layout.batch_world)]


class _PeerSum(torch.autograd.Function):
    """forward: identity; backward: all-reduce (sum) of the gradient over the peers
    (the ranks holding the same samples), so each gets the whole gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None


def all_gather_batch_2d(embeddings: torch.Tensor, labels: torch.Tensor, layout: BatchLayout, sizes: list[int]):
    """:func:`all_gather_batch` over ``layout.batch_group`` for a class group larger
    than it. backward: reduce-scatter over the batch group (each rank's own rows of
    the sum of the batch group's gradients), then an all-reduce over the peers: every
    peer gets the gradient summed over the whole class group."""
    if layout.peer_group is not None:
        embeddings = _PeerSum.apply(embeddings, layout.peer_group)
    if layout.batch_world == 1:
        return embeddings, labels, sizes
    gathered = _AllGatherRows.apply(embeddings, sizes, layout.batch_group)
    return gathered, _gather_rows(labels, sizes, layout.batch_group), sizes


def check_same_labels(y: torch.Tensor, group, device=None) -> None:
    """Every rank of ``group`` must hold the same gathered labels ``y`` (one small
    all-reduce and a host sync): tensor-parallel peers that feed different samples,
    or batch groups ordered differently, would otherwise train on mixed-up targets."""
    weights = torch.arange(1, y.numel() + 1, device=y.device, dtype=torch.float64)
    h = (y.double() * weights).sum()
    probe = torch.stack([h, -h]).to(device if device is not None else y.device)
    all_reduce_(probe, "max", group)
    if float(probe[0]) != -float(probe[1]):
        raise ValueError("labels: the ranks of the class group gathered different labels; tensor-parallel peers "
                         "(the same position in their batch groups) must pass identical samples")
