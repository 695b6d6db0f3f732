"""Exact nearest neighbours by cosine between row sets, block by block, with the keys
sharded over ranks.

:func:`nearest` gives every query row its ``k`` most similar key rows (cosine of the
rows as given, each normalised to unit length), keeping only those at or above
``threshold`` when one is given, and never the key whose global id equals the query's
``query_ids`` entry (a class against itself, an image against its own label). The
threshold and the top-k are applied to each ``[query block, key block]`` product as it
is computed and merged into a running ``[Q, k]`` result, so memory beyond the inputs
and the result is one block of products (``block_rows x (block_rows + k)`` scores),
never the ``Q x K`` matrix.

:func:`sharded_nearest` does the same when each rank holds a contiguous shard of the
keys (rank ``r`` the global ids after those of ranks ``0 .. r - 1``, as
:class:`~ds_pfc.core.partition.Partition` lays out a head) and its own queries: the
shards are broadcast one key block at a time from their owner, every rank merges each
block into the result of its queries. Per rank: one received block, one block of
products, the result. Communication: every key row once to every rank (``K d``
elements per rank, the same as an all-gather, but never held at once).

The result is exact: a missing slot (fewer than ``k`` keys pass) holds value ``-inf``
and index ``-1``; among equal cosines the order of indices is unspecified.
Products run in float32 (float64 when either input is float64; always float32 with
``impl="triton"``, whose kernel fuses the threshold and a per-tile top-k into the
product so that only ``k`` candidates per query and key tile leave it, and with
``impl="faiss"``).

``impl="faiss"`` (CPU tensors, the optional ``faiss-cpu`` package, ``pip install
ds_pfc[faiss]``) searches each key block with an exact flat inner-product index
(``faiss.IndexFlatIP`` over the unit rows, so inner product = cosine) for ``k`` (``k +
1`` when ``query_ids`` may remove one) candidates per query, then applies the
threshold and the own-id mask and merges like the torch path. Its OpenMP threads are
set to ``torch.get_num_threads()`` before each search, so one setting
(``torch.set_num_threads``, ``OMP_NUM_THREADS``) governs both backends.
``impl="auto"`` picks faiss for float32 CPU inputs when faiss is installed (measured
faster on CPU: ``benchmarks/neighbors_faiss.py``) and torch otherwise.
"""
from __future__ import annotations

import importlib.util

import torch
import torch.distributed as dist
import torch.nn.functional as F

from . import collectives

__all__ = ["nearest", "sharded_nearest", "resolve_impl", "NEIGHBOR_BLOCK_ROWS", "IMPLS"]

IMPLS = ("auto", "torch", "triton", "faiss")
"""The neighbour-search backends :func:`nearest` accepts."""

NEIGHBOR_BLOCK_ROWS = 4096
"""Rows of queries and of keys in one block of products (64 MiB of float32 scores)."""


def _check_rows(name: str, rows) -> None:
    if not isinstance(rows, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(rows).__name__}")
    if rows.dim() != 2:
        raise ValueError(f"{name} must have shape [rows, d], got shape {tuple(rows.shape)}")
    if not rows.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {rows.dtype}")


def _faiss():
    try:
        import faiss
    except ImportError as err:
        raise ImportError("impl='faiss' needs the faiss-cpu package: pip install ds_pfc[faiss] "
                          "(or faiss-cpu)") from err
    return faiss


def resolve_impl(impl: str, queries: torch.Tensor, *keys: torch.Tensor) -> str:
    """The backend ``impl`` stands for with these inputs: ``"auto"`` becomes ``"faiss"``
    for float32 (or lower) CPU inputs when faiss is installed, else ``"torch"``; any
    other name is returned as it is."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {', '.join(map(repr, IMPLS))}, got {impl!r}")
    if impl != "auto":
        return impl
    tensors = (queries, *keys)
    on_cpu = all(t.device.type == "cpu" for t in tensors)
    # float64 inputs keep their float64 products, which only the torch path computes
    if on_cpu and _dtype(*tensors) == torch.float32 and importlib.util.find_spec("faiss") is not None:
        return "faiss"
    return "torch"


def _check_args(queries, k, threshold, query_ids, block_rows, impl="torch") -> None:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {', '.join(map(repr, IMPLS))}, got {impl!r}")
    if impl == "triton" and isinstance(k, int) and k > 64:
        raise ValueError(f"k must be at most 64 with impl='triton', got {k}")
    _check_rows("queries", queries)
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be a positive int, got {k!r}")
    if threshold is not None and (isinstance(threshold, bool) or not isinstance(threshold, (int, float))
                                  or not -1.0 <= float(threshold) <= 1.0):
        raise ValueError(f"threshold must be None or a cosine in [-1, 1], got {threshold!r}")
    if query_ids is not None:
        if not isinstance(query_ids, torch.Tensor) or query_ids.dtype != torch.int64 \
                or tuple(query_ids.shape) != (queries.shape[0],):
            raise ValueError(f"query_ids must be None or int64 [{queries.shape[0]}] (one id per query), got "
                             f"{getattr(query_ids, 'dtype', type(query_ids).__name__)} "
                             f"{tuple(getattr(query_ids, 'shape', ()))}")
    if isinstance(block_rows, bool) or not isinstance(block_rows, int) or block_rows < 1:
        raise ValueError(f"block_rows must be a positive int, got {block_rows!r}")


def _dtype(*tensors: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


class _Running:
    """The running top-k of every query, merged with one key block at a time."""

    def __init__(self, queries: torch.Tensor, k: int, threshold, query_ids, block_rows: int, dtype,
                 impl: str = "torch"):
        if impl in ("triton", "faiss"):
            dtype = torch.float32
        if impl == "faiss" and queries.device.type != "cpu":
            raise ValueError(f"impl='faiss' needs CPU tensors, got queries on {queries.device}")
        self.q = F.normalize(queries.to(dtype), dim=1)
        self.k, self.threshold, self.query_ids, self.block_rows = k, threshold, query_ids, block_rows
        self.impl = impl
        num = queries.shape[0]
        self.values = torch.full((num, k), float("-inf"), dtype=dtype, device=queries.device)
        self.indices = torch.full((num, k), -1, dtype=torch.int64, device=queries.device)

    def merge(self, keys: torch.Tensor, start: int) -> None:
        """Merge key rows ``keys`` (global ids ``start ..``) into every query's top-k."""
        if keys.shape[0] == 0:
            return
        keys = F.normalize(keys.to(self.q.dtype), dim=1)
        ids = torch.arange(start, start + keys.shape[0], device=keys.device)
        index = self._faiss_index(keys) if self.impl == "faiss" else None
        for q0 in range(0, self.q.shape[0], self.block_rows):
            q1 = min(self.q.shape[0], q0 + self.block_rows)
            if self.impl == "triton":
                from ..kernels.triton_neighbors import tile_topk
                scores, block_ids = tile_topk(self.q[q0:q1], keys, self.k, threshold=self.threshold, key_start=start,
                                              query_ids=None if self.query_ids is None else self.query_ids[q0:q1])
            elif self.impl == "faiss":
                scores, block_ids = self._faiss_search(index, q0, q1, start)
            else:
                scores = self.q[q0:q1] @ keys.T
                if self.threshold is not None:
                    scores.masked_fill_(scores < self.threshold, float("-inf"))
                if self.query_ids is not None:
                    scores.masked_fill_(self.query_ids[q0:q1, None] == ids[None, :], float("-inf"))
                block_ids = ids.expand(q1 - q0, -1)
            values = torch.cat([self.values[q0:q1], scores], dim=1)
            indices = torch.cat([self.indices[q0:q1], block_ids], dim=1)
            top, where = torch.topk(values, min(self.k, values.shape[1]), dim=1)
            picked = torch.gather(indices, 1, where)
            self.values[q0:q1] = top
            self.indices[q0:q1] = torch.where(torch.isinf(top), torch.full_like(picked, -1), picked)

    def _faiss_index(self, keys: torch.Tensor):
        faiss = _faiss()
        # one thread setting for both backends: torch's (torch.set_num_threads / OMP_NUM_THREADS)
        faiss.omp_set_num_threads(torch.get_num_threads())
        index = faiss.IndexFlatIP(keys.shape[1])
        index.add(keys.detach().cpu().contiguous().numpy())
        return index

    def _faiss_search(self, index, q0: int, q1: int, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Candidates ``[q1 - q0, k']`` of one key block: ``k + 1`` when the own id may
        be among them (it is removed here), threshold and missing slots as ``-inf``."""
        wanted = min(index.ntotal, self.k + (self.query_ids is not None))
        values, found = index.search(self.q[q0:q1].detach().contiguous().numpy(), wanted)
        scores, local = torch.from_numpy(values), torch.from_numpy(found)
        block_ids = torch.where(local >= 0, local + start, torch.full_like(local, -1))
        drop = local < 0
        if self.threshold is not None:
            drop |= scores < self.threshold
        if self.query_ids is not None:
            drop |= block_ids == self.query_ids[q0:q1, None]
        return scores.masked_fill(drop, float("-inf")), block_ids


def nearest(queries: torch.Tensor, keys: torch.Tensor, k: int, *, threshold: float | None = None,
            query_ids: torch.Tensor | None = None, block_rows: int = NEIGHBOR_BLOCK_ROWS, impl: str = "torch"
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values [Q, k], indices [Q, k])``: for every row of ``queries [Q, d]`` the
    ``k`` rows of ``keys [K, d]`` of highest cosine, best first, at or above
    ``threshold`` when given, skipping key ``query_ids[i]`` for query ``i`` when
    ``query_ids`` (int64 ``[Q]``) is given. Missing slots: ``-inf`` and ``-1``. Blocks
    of ``block_rows`` queries times ``block_rows`` keys (see the module docstring).
    ``impl``: ``"torch"`` (matrix products, any device) or ``"triton"`` (the fused
    kernel of :mod:`ds_pfc.kernels.triton_neighbors`: float32, ``k`` <= 64, CUDA
    tensors or Triton's interpreter), ``"faiss"`` (exact flat inner-product index,
    float32, CPU tensors, faiss-cpu installed) or ``"auto"`` (:func:`resolve_impl`)."""
    _check_args(queries, k, threshold, query_ids, block_rows, impl)
    _check_rows("keys", keys)
    impl = resolve_impl(impl, queries, keys)
    if keys.shape[1] != queries.shape[1]:
        raise ValueError(f"keys must have the queries' width {queries.shape[1]}, got shape {tuple(keys.shape)}")
    run = _Running(queries, k, threshold, query_ids, block_rows, _dtype(queries, keys), impl)
    for start in range(0, keys.shape[0], block_rows):
        run.merge(keys[start:start + block_rows].to(queries.device), start)
    return run.values, run.indices


def sharded_nearest(queries: torch.Tensor, local_keys: torch.Tensor, k: int, *, threshold: float | None = None,
                    query_ids: torch.Tensor | None = None, group=None, device=None,
                    block_rows: int = NEIGHBOR_BLOCK_ROWS, impl: str = "torch") -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`nearest` of this rank's ``queries`` against the keys of every rank of
    ``group``, where ``local_keys [K_r, d]`` is this rank's contiguous shard (global ids
    start after the shards of the lower ranks; a rank may hold none, ``[0, d]``).
    ``device``: where the collectives run (the tensors' device when None). Every rank
    of ``group`` must call it, with the same ``k``, ``threshold`` and ``block_rows``
    and keys of the same width; indices are global key ids. ``impl``: as :func:`nearest`."""
    _check_args(queries, k, threshold, query_ids, block_rows, impl)
    _check_rows("local_keys", local_keys)
    if local_keys.shape[1] != queries.shape[1]:
        raise ValueError(f"local_keys must have the queries' width {queries.shape[1]}, got shape "
                         f"{tuple(local_keys.shape)}")
    world = collectives.world_size(group)
    if world == 1:
        return nearest(queries, local_keys, k, threshold=threshold, query_ids=query_ids, block_rows=block_rows,
                       impl=impl)
    device = device if device is not None else local_keys.device
    table = collectives.all_gather_scalars([local_keys.shape[0], local_keys.shape[1], block_rows,
                                            local_keys.dtype == torch.float64], group=group, device=device)
    sizes, widths = [int(v) for v in table[:, 0]], {int(v) for v in table[:, 1]}
    if len(widths) != 1 or len({int(v) for v in table[:, 2]}) != 1:
        raise ValueError(f"every rank must give local_keys of one width and the same block_rows; got "
                         f"widths {sorted(widths)}, block_rows {[int(v) for v in table[:, 2]]}")
    # blocks travel in float64 when any rank's keys are float64, else in float32
    key_dtype = torch.float64 if bool(table[:, 3].any()) else torch.float32
    # float64 blocks from any rank keep every rank on the float64 torch path
    impl = resolve_impl("torch" if impl == "auto" and key_dtype == torch.float64 else impl, queries, local_keys)
    run = _Running(queries, k, threshold, query_ids, block_rows,
                   torch.float64 if key_dtype == torch.float64 else _dtype(queries), impl)
    me, ranks = collectives.rank(group), collectives.group_ranks(group)
    start = 0
    for owner, size in enumerate(sizes):
        for b0 in range(0, size, block_rows):
            rows = min(block_rows, size - b0)
            if owner == me:
                block = local_keys[b0:b0 + rows].to(device=device, dtype=key_dtype).contiguous()
            else:
                block = torch.empty(rows, queries.shape[1], dtype=key_dtype, device=device)
            dist.broadcast(block, src=ranks[owner], group=group)
            run.merge(block.to(queries.device), start + b0)
        start += size
    return run.values, run.indices
