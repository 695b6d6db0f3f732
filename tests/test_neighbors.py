"""Blockwise exact top-k / threshold neighbours (ds_pfc.core.neighbors) against a dense
float64 reference written here: the full cosine matrix, masked, sorted."""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from ds_pfc.core.neighbors import nearest, sharded_nearest
from ds_pfc.core.partition import Partition
from _dist import run_ranks


def _reference(queries, keys, k, threshold=None, query_ids=None):
    """Dense float64: every cosine, masked, sorted; missing slots -inf / -1."""
    q = queries.double() / queries.double().norm(dim=1, keepdim=True)
    c = keys.double() / keys.double().norm(dim=1, keepdim=True)
    scores = q @ c.T
    if threshold is not None:
        scores[scores < threshold] = float("-inf")
    if query_ids is not None:
        for i, j in enumerate(query_ids.tolist()):
            if 0 <= j < scores.shape[1]:
                scores[i, j] = float("-inf")
    values, indices = torch.sort(scores, dim=1, descending=True)
    values, indices = values[:, :k], indices[:, :k]
    pad = k - values.shape[1]
    if pad > 0:
        values = torch.cat([values, torch.full((values.shape[0], pad), float("-inf"), dtype=values.dtype)], 1)
        indices = torch.cat([indices, torch.full((indices.shape[0], pad), -1)], 1)
    indices = torch.where(torch.isinf(values), torch.full_like(indices, -1), indices)
    return values, indices


def _rows(n, d, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=gen, dtype=torch.float64)


@pytest.mark.parametrize("k,threshold,block", [(5, None, 7), (3, 0.25, 4), (40, 0.1, 16), (1, None, 1000)])
def test_nearest_matches_dense_float64(k, threshold, block):
    keys = _rows(53, 9, 2)
    ids = torch.randperm(53, generator=torch.Generator().manual_seed(3))[:37]
    queries = torch.cat([keys[ids[:20]], _rows(17, 9, 1)])      # 20 queries that are keys: the self-mask decides
    ids[20:] = torch.randint(0, 53, (17,), generator=torch.Generator().manual_seed(4))
    for query_ids in (None, ids):
        values, indices = nearest(queries, keys, k, threshold=threshold, query_ids=query_ids, block_rows=block)
        ref_v, ref_i = _reference(queries, keys, k, threshold, query_ids)
        assert torch.equal(indices, ref_i)
        finite = torch.isfinite(ref_v)
        assert torch.equal(torch.isfinite(values), finite)
        torch.testing.assert_close(values[finite], ref_v[finite], rtol=0, atol=1e-12)


def test_nearest_float32_within_float32_error():
    queries, keys = _rows(64, 32, 4), _rows(300, 32, 5)
    values, indices = nearest(queries.float(), keys.float(), 4, block_rows=50)
    ref_v, ref_i = _reference(queries, keys, 4)
    torch.testing.assert_close(values.double(), ref_v, rtol=0, atol=1e-5)
    # an index may differ only where two cosines are closer than float32 resolves
    q = queries / queries.norm(dim=1, keepdim=True)
    c = keys / keys.norm(dim=1, keepdim=True)
    picked = torch.gather(q @ c.T, 1, indices)
    torch.testing.assert_close(picked, ref_v, rtol=0, atol=1e-5)


def test_nearest_bad_inputs():
    q, c = _rows(4, 3, 0), _rows(5, 3, 1)
    with pytest.raises(ValueError, match="k must"):
        nearest(q, c, 0)
    with pytest.raises(ValueError, match="threshold"):
        nearest(q, c, 1, threshold=1.5)
    with pytest.raises(ValueError, match="keys must have the queries' width 3"):
        nearest(q, _rows(5, 4, 1), 1)
    with pytest.raises(ValueError, match="query_ids"):
        nearest(q, c, 1, query_ids=torch.zeros(3, dtype=torch.int64))
    with pytest.raises(TypeError, match="queries"):
        nearest(q.numpy(), c, 1)


NUM_KEYS, NUM_QUERIES, D = 61, 23, 7


def _sharded_rank(rank, world_size, k, threshold, block):
    keys = _rows(NUM_KEYS, D, 11)
    part = Partition(NUM_KEYS, world_size)
    start, count = part.class_start(rank), part.num_local(rank)
    queries = _rows(NUM_QUERIES + rank, D, 20 + rank)          # uneven query counts per rank
    ids = torch.arange(NUM_QUERIES + rank) * (rank + 1) % NUM_KEYS
    return sharded_nearest(queries, keys[start:start + count], k, threshold=threshold, query_ids=ids,
                           block_rows=block)


@pytest.mark.parametrize("world_size", [1, 3])
def test_sharded_nearest_matches_dense(world_size):
    keys = _rows(NUM_KEYS, D, 11)
    for k, threshold, block in [(4, None, 5), (6, 0.3, 64)]:
        results = run_ranks(_sharded_rank, world_size, k, threshold, block)
        for rank, (values, indices) in enumerate(results):
            queries = _rows(NUM_QUERIES + rank, D, 20 + rank)
            ids = torch.arange(NUM_QUERIES + rank) * (rank + 1) % NUM_KEYS
            ref_v, ref_i = _reference(queries, keys, k, threshold, ids)
            assert torch.equal(indices, ref_i), (world_size, rank, k)
            finite = torch.isfinite(ref_v)
            torch.testing.assert_close(values[finite], ref_v[finite], rtol=0, atol=1e-12)


def _empty_shard_rank(rank, world_size):
    keys = _rows(2, D, 12)                    # 2 keys on 4 ranks: ranks 2 and 3 hold none
    part = Partition(2, world_size)
    start, count = part.class_start(rank), part.num_local(rank)
    return sharded_nearest(_rows(3, D, 30 + rank), keys[start:start + count], 3, block_rows=1)


def test_sharded_nearest_with_empty_shards():
    keys = _rows(2, D, 12)
    for rank, (values, indices) in enumerate(run_ranks(_empty_shard_rank, 4)):
        ref_v, ref_i = _reference(_rows(3, D, 30 + rank), keys, 3)
        assert torch.equal(indices, ref_i)
        assert torch.isinf(values[:, 2]).all()


TRITON_ON_CPU = importlib.util.find_spec("triton") is not None and (
    torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1")


@pytest.mark.skipif(not TRITON_ON_CPU, reason="the fused kernel needs CUDA or Triton's interpreter "
                                              "(TRITON_INTERPRET=1, set by conftest.py without CUDA)")
@pytest.mark.parametrize("k,threshold,block", [(5, None, 70), (5, 0.3, 33), (1, None, 200)])
def test_triton_kernel_matches_dense_float64(k, threshold, block):
    """Queries are keys themselves (the self-mask decides the top-1) and a threshold at
    which most rows keep fewer than k keys."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    keys = _rows(131, 40, 7)                                          # d = 40: a partial last d-block
    own = torch.randperm(131, generator=torch.Generator().manual_seed(8))[:37]
    queries = keys[own]
    for query_ids in (None, own):
        values, indices = nearest(queries.float().to(device), keys.float().to(device), k, threshold=threshold,
                                  query_ids=None if query_ids is None else query_ids.to(device), block_rows=block,
                                  impl="triton")
        ref_v, ref_i = _reference(queries, keys, k, threshold, query_ids)
        if threshold is not None:
            assert torch.isinf(ref_v).any()
        assert torch.equal(indices.cpu(), ref_i)
        finite = torch.isfinite(ref_v)
        assert torch.equal(torch.isfinite(values.cpu()), finite)
        torch.testing.assert_close(values.cpu().double()[finite], ref_v[finite], rtol=0, atol=1e-5)


FAISS = importlib.util.find_spec("faiss") is not None


@pytest.mark.skipif(not FAISS, reason="impl='faiss' needs the optional faiss-cpu package (pip install ds_pfc[faiss])")
@pytest.mark.parametrize("k,threshold,block", [(5, None, 7), (3, 0.25, 4), (40, 0.1, 16), (1, None, 1000)])
def test_faiss_matches_dense_float64(k, threshold, block):
    """As the torch test: queries that are keys (the own-id mask decides the top-1), a
    threshold that leaves slots empty, k near the key count, blocks of 4 keys."""
    keys = _rows(53, 9, 2)
    ids = torch.randperm(53, generator=torch.Generator().manual_seed(3))[:37]
    queries = torch.cat([keys[ids[:20]], _rows(17, 9, 1)])
    ids[20:] = torch.randint(0, 53, (17,), generator=torch.Generator().manual_seed(4))
    for query_ids in (None, ids):
        values, indices = nearest(queries.float(), keys.float(), k, threshold=threshold, query_ids=query_ids,
                                  block_rows=block, impl="faiss")
        ref_v, ref_i = _reference(queries, keys, k, threshold, query_ids)
        assert values.dtype == torch.float32
        assert torch.equal(indices, ref_i), (k, threshold, block)
        finite = torch.isfinite(ref_v)
        assert torch.equal(torch.isfinite(values), finite)
        torch.testing.assert_close(values.double()[finite], ref_v[finite], rtol=0, atol=1e-5)


@pytest.mark.skipif(not FAISS, reason="impl='faiss' needs the optional faiss-cpu package (pip install ds_pfc[faiss])")
def test_faiss_thread_count_follows_torch():
    import faiss
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        nearest(_rows(4, 3, 0).float(), _rows(5, 3, 1).float(), 2, impl="faiss")
        assert faiss.omp_get_max_threads() == 1
    finally:
        torch.set_num_threads(saved)


def _faiss_sharded_rank(rank, world_size, k, threshold, block):
    keys = _rows(NUM_KEYS, D, 11).float()
    part = Partition(NUM_KEYS, world_size)
    start, count = part.class_start(rank), part.num_local(rank)
    queries = _rows(NUM_QUERIES + rank, D, 20 + rank).float()
    ids = torch.arange(NUM_QUERIES + rank) * (rank + 1) % NUM_KEYS
    return sharded_nearest(queries, keys[start:start + count], k, threshold=threshold, query_ids=ids,
                           block_rows=block, impl="faiss")


@pytest.mark.skipif(not FAISS, reason="impl='faiss' needs the optional faiss-cpu package (pip install ds_pfc[faiss])")
def test_faiss_sharded_matches_dense():
    keys = _rows(NUM_KEYS, D, 11)
    for rank, (values, indices) in enumerate(run_ranks(_faiss_sharded_rank, 3, 4, 0.2, 5)):
        queries = _rows(NUM_QUERIES + rank, D, 20 + rank)
        ids = torch.arange(NUM_QUERIES + rank) * (rank + 1) % NUM_KEYS
        ref_v, ref_i = _reference(queries, keys, 4, 0.2, ids)
        assert torch.equal(indices, ref_i), rank
        finite = torch.isfinite(ref_v)
        torch.testing.assert_close(values.double()[finite], ref_v[finite], rtol=0, atol=1e-5)


def test_auto_picks_by_dtype_device_and_what_is_installed():
    from ds_pfc.core.neighbors import resolve_impl
    q32, q64 = _rows(3, 4, 0).float(), _rows(3, 4, 0)
    assert resolve_impl("auto", q64, q64) == "torch"            # float64 products only on the torch path
    assert resolve_impl("auto", q32, q32) == ("faiss" if FAISS else "torch")
    assert resolve_impl("triton", q32) == "triton"
    with pytest.raises(ValueError, match="impl must be one of"):
        resolve_impl("blas", q32)
    with pytest.raises(ValueError, match="impl must be one of"):
        nearest(q32, q32, 1, impl="blas")
