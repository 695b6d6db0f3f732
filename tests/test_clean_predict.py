"""The all-pairs search's counts (ds_pfc.bench.clean_predict) against a count taken here
from the fused kernel's real launches: the shapes each launch received and returned,
walked tile by tile."""
from __future__ import annotations

import importlib.util
import math
import os

import pytest
import torch

from ds_pfc.bench.clean_predict import count_search, predict_search
from ds_pfc.core.partition import Partition

TRITON_ON_CPU = importlib.util.find_spec("triton") is not None and (
    torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1")


@pytest.mark.skipif(not TRITON_ON_CPU, reason="the fused kernel needs CUDA or Triton's interpreter "
                                              "(TRITON_INTERPRET=1, set by conftest.py without CUDA)")
@pytest.mark.parametrize("classes,world,rank,block,dim,k", [(300, 3, 1, 64, 40, 3), (131, 2, 0, 50, 33, 5),
                                                             (97, 1, 0, 40, 8, 2)])
def test_counts_match_the_kernels_launches(monkeypatch, classes, world, rank, block, dim, k):
    import ds_pfc.kernels.triton_neighbors as tn
    from ds_pfc.core.neighbors import nearest
    launches = []
    real = tn.tile_topk

    def recording(queries, keys, kk, **kw):
        values, indices = real(queries, keys, kk, **kw)
        launches.append((queries.shape[0], keys.shape[0], values.numel() * 4 + indices.numel() * 8))
        return values, indices

    monkeypatch.setattr(tn, "tile_topk", recording)
    centres = torch.randn(classes, dim, generator=torch.Generator().manual_seed(0))
    part = Partition(classes, world)
    start, count = part.class_start(rank), part.num_local(rank)
    queries = centres[start:start + count]
    # what sharded_nearest merges on this rank: every owner's shard, in blocks of `block` rows
    for owner in range(world):
        o0, size = part.class_start(owner), part.num_local(owner)
        nearest(queries, centres[o0:o0 + size], k, block_rows=block, impl="triton")
    flops = loaded = unique = written = programs = 0
    for num_q, num_k, out_bytes in launches:
        for q0 in range(0, num_q, tn.BLOCK_Q):
            for k0 in range(0, num_k, tn.BLOCK_K):
                programs += 1
                flops += 2 * tn.BLOCK_Q * tn.BLOCK_K * math.ceil(dim / tn.BLOCK_D) * tn.BLOCK_D
                loaded += (min(tn.BLOCK_Q, num_q - q0) + min(tn.BLOCK_K, num_k - k0)) * dim * 4
        unique += (num_q + num_k) * dim * 4
        written += out_bytes
    got = count_search(classes, world, dim=dim, k=k, block_rows=block, rank=rank)
    assert got["launches"] == len(launches) == got["merges"]
    assert (got["programs"], got["flops"], got["loaded"], got["unique"], got["written"]) == \
        (programs, flops, loaded, unique, written)
    assert got["useful_flops"] == 2 * count * classes * dim <= got["flops"]
    assert got["received_bytes"] == (0 if world == 1 else (classes - count) * dim * 4)
    assert got["broadcasts"] == (0 if world == 1 else sum(math.ceil(part.num_local(o) / block)
                                                          for o in range(world)))


def test_prediction_adds_its_parts_and_reports_what_does_not_fit():
    one = predict_search(100_000_000, 1)
    assert not one["fits"]                       # two float32 copies of 100M x 512 exceed 141 GB
    many = predict_search(1_000_000, 8)
    s = many["seconds"]
    assert many["fits"]
    assert s["total"] == pytest.approx(s["kernel"] + s["merge"] + s["broadcast"])
    assert s["products"] == pytest.approx(many["counts"]["flops"] / many["assumptions"]["products_rate"])
    # eight ranks share the products: the busiest does 1/8 of one GPU's (up to the rounding of shards)
    single = predict_search(1_000_000, 1)["counts"]["flops"]
    assert many["counts"]["flops"] == pytest.approx(single / 8, rel=1e-3)


def test_bad_inputs_name_the_argument():
    with pytest.raises(ValueError, match="classes"):
        count_search(0, 1)
    with pytest.raises(ValueError, match="world"):
        count_search(10, -1)
    with pytest.raises(ValueError, match="rank"):
        count_search(10, 2, rank=2)
    with pytest.raises(ValueError, match="k must be at most"):
        count_search(10, 1, k=65)
    with pytest.raises(ValueError, match="gpu_name"):
        predict_search(10, 1, gpu_name="b200")
