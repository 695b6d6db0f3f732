"""Contiguous class ownership: ``ds_pfc.core.partition.Partition(C, k)``.

Every expectation is derived from a brute-force reference built here: the list of
per-rank sizes from the definition (first ``C mod k`` ranks own ``ceil(C/k)``, the
others ``floor(C/k)``), the intervals as running sums of those sizes, and an
explicit class -> (rank, local id) table obtained by walking the intervals.
"""
from __future__ import annotations

import math

import pytest
import torch

from ds_pfc.core.partition import Partition

# (C, k): odd sizes, uneven splits, exact splits, C < k, k = 1, C = 1.
CASES = [
    (1021, 1), (1021, 2), (1021, 3), (1021, 7), (1021, 8), (1024, 8), (37, 5),
    (5, 8), (1, 1), (1, 4), (7, 7), (13, 12), (100003, 16), (3, 2),
]


def reference_sizes(num_classes: int, world: int) -> list[int]:
    """Sizes by the definition, computed without divmod tricks: hand out classes
    one at a time round-robin-by-size (the first ranks get the remainder)."""
    floor_size = num_classes // world
    ceil_size = -(-num_classes // world)
    remainder = num_classes - floor_size * world
    return [ceil_size if q < remainder else floor_size for q in range(world)]


def reference_table(num_classes: int, world: int):
    """class id -> (owner, local id), by walking the contiguous intervals."""
    owners, locals_ = [], []
    for q, size in enumerate(reference_sizes(num_classes, world)):
        owners.extend([q] * size)
        locals_.extend(range(size))
    return owners, locals_


@pytest.mark.parametrize("num_classes,world", CASES)
def test_sizes_floor_or_ceil_first_ranks_larger(num_classes, world):
    part = Partition(num_classes, world)
    sizes = [part.num_local(q) for q in range(world)]
    assert sizes == reference_sizes(num_classes, world)
    assert sum(sizes) == num_classes
    lo, hi = math.floor(num_classes / world), math.ceil(num_classes / world)
    assert all(s in (lo, hi) for s in sizes)
    # the larger ranks come first: sizes are non-increasing
    assert all(a >= b for a, b in zip(sizes, sizes[1:]))
    assert sum(s == hi for s in sizes) == (num_classes % world if hi != lo else world)


@pytest.mark.parametrize("num_classes,world", CASES)
def test_intervals_tile_contiguously(num_classes, world):
    part = Partition(num_classes, world)
    expected_start = 0
    for q in range(world):
        start, end = part.bounds(q)
        assert part.class_start(q) == start == expected_start
        assert end - start == part.num_local(q)
        expected_start = end
    assert expected_start == num_classes


def test_fewer_classes_than_ranks_leaves_last_ranks_empty():
    part = Partition(5, 8)
    assert [part.num_local(q) for q in range(8)] == [1, 1, 1, 1, 1, 0, 0, 0]
    for q in range(5, 8):
        start, end = part.bounds(q)
        assert start == end == 5
        ids = torch.arange(5)
        assert (part.to_local(ids, q) == -1).all()


@pytest.mark.parametrize("num_classes,world", CASES)
def test_owner_to_local_to_global_brute_force(num_classes, world):
    part = Partition(num_classes, world)
    owners, locals_ = (torch.tensor(t, dtype=torch.int64) for t in reference_table(num_classes, world))
    ids = torch.arange(num_classes)
    assert torch.equal(part.owner(ids), owners)
    for q in range(world):
        local = part.to_local(ids, q)
        expected = torch.where(owners == q, locals_, torch.full_like(locals_, -1))
        assert local.dtype == torch.int64
        assert torch.equal(local, expected)
        owned = local >= 0
        # round trip for owned ids
        assert torch.equal(part.to_global(local[owned], q), ids[owned])


def test_owner_accepts_int32_and_arbitrary_order():
    num_classes, world = 1021, 7
    part = Partition(num_classes, world)
    owners, locals_ = reference_table(num_classes, world)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, num_classes, (37,), generator=gen, dtype=torch.int32)
    assert part.owner(ids).tolist() == [owners[i] for i in ids.tolist()]
    for q in range(world):
        assert part.to_local(ids, q).tolist() == [
            locals_[i] if owners[i] == q else -1 for i in ids.tolist()]


@pytest.mark.parametrize("bad", [0, -3, 2.0, "7", None, True])
def test_bad_num_classes(bad):
    with pytest.raises(ValueError, match="num_classes"):
        Partition(bad, 2)


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2", None, False])
def test_bad_world_size(bad):
    with pytest.raises(ValueError, match="world_size"):
        Partition(11, bad)


@pytest.mark.parametrize("rank", [-1, 3, 100])
def test_bad_rank(rank):
    part = Partition(11, 3)
    for method in (part.num_local, part.class_start, part.bounds):
        with pytest.raises(ValueError, match="rank"):
            method(rank)
    with pytest.raises(ValueError, match="rank"):
        part.to_local(torch.arange(3), rank)
