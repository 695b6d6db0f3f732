"""Each crossing between ranks on its own (ds_pfc.core.collectives), plus the head and the
functional entry point on an explicit process group.

Expected values are written out in plain PyTorch from the per-rank inputs, which
every rank (and the parent) regenerates from a seed.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import ds_pfc
from ds_pfc.core import collectives
from _capture import CaptureRows
from _dist import run_ranks

# Per-rank batch sizes tried in one spawn: uneven, with empty ranks, even (no padding).
GATHER_LAYOUTS = [[3, 1, 4], [2, 0, 3], [4, 4, 4], [0, 0, 1]]
GATHER_D = 5


def _gather_inputs(layout, rank, dtype):
    """Rank ``rank``'s embeddings and labels, and its upstream gradient for the gathered
    tensor. Integer-valued floats: sums are exact in any order."""
    gen = torch.Generator().manual_seed(1000 * len(layout) + 10 * sum(layout) + rank)
    n_total = sum(layout)
    x = torch.randint(-50, 50, (layout[rank], GATHER_D), generator=gen).to(dtype)
    y = torch.randint(0, 10 ** 6, (layout[rank],), generator=gen).to(torch.int32)
    upstream = torch.randint(-9, 10, (n_total, GATHER_D), generator=gen).to(dtype)
    return x, y, upstream


def _collective_ranks(rank, world_size):
    out = {"gather": {}}
    for dtype in (torch.float64, torch.float32):
        for i, layout in enumerate(GATHER_LAYOUTS):
            x, y, upstream = _gather_inputs(layout, rank, dtype)
            x = x.clone().requires_grad_(True)
            gathered, labels, sizes = collectives.all_gather_batch(x, y, None)
            requires_grad = gathered.requires_grad
            (gathered * upstream).sum().backward()
            out["gather"][dtype, i] = {
                "gathered": gathered.detach(), "labels": labels, "sizes": sizes, "grad": x.grad,
                "requires_grad": requires_grad,
                "input_unchanged": torch.equal(x.detach(), _gather_inputs(layout, rank, dtype)[0])}

    t = torch.tensor([float(rank), -float(rank), 2.5 * rank, 7.0], dtype=torch.float64)
    ptr = t.data_ptr()
    res = collectives.all_reduce_(t, "sum")
    out["sum"] = t.clone()
    out["sum_in_place"] = res is t and t.data_ptr() == ptr
    t = torch.tensor([[float(rank), -float(rank)], [3.0 - rank, float("-inf")]], dtype=torch.float32)
    res = collectives.all_reduce_(t, "max")
    out["max"] = t.clone()
    out["max_in_place"] = res is t
    out["scalars"] = collectives.all_gather_scalars([rank, 10 + rank, 0.5, 2 ** 40 + rank])
    out["ranks"] = (collectives.rank(), collectives.world_size())
    return out


WORLD = 3


@pytest.fixture(scope="module")
def collective_results():
    """One 3-rank spawn serves the tests of every collective below."""
    return run_ranks(_collective_ranks, WORLD)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("i", range(len(GATHER_LAYOUTS)), ids=[str(lay) for lay in GATHER_LAYOUTS])
def test_all_gather_batch_forward_is_concatenation_in_rank_order(collective_results, dtype, i):
    layout = GATHER_LAYOUTS[i]
    inputs = [_gather_inputs(layout, q, dtype) for q in range(WORLD)]
    expected_x = torch.cat([inp[0] for inp in inputs])
    expected_y = torch.cat([inp[1] for inp in inputs])
    for q in range(WORLD):
        r = collective_results[q]["gather"][dtype, i]
        assert r["sizes"] == layout, q
        assert r["gathered"].dtype == dtype and torch.equal(r["gathered"], expected_x), q
        # labels travel alongside, dtype kept
        assert r["labels"].dtype == torch.int32 and torch.equal(r["labels"], expected_y), q
        assert r["requires_grad"], q
        assert r["input_unchanged"], f"rank {q}: the caller's tensor was modified"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("i", range(len(GATHER_LAYOUTS)), ids=[str(lay) for lay in GATHER_LAYOUTS])
def test_all_gather_batch_backward_is_reduce_scatter(collective_results, dtype, i):
    """Rank r's loss is <gathered, G_r>; the gradient reaching rank q's input must be
    sum_r G_r[rows of q] (integer-valued, so exact in any summation order)."""
    layout = GATHER_LAYOUTS[i]
    total_upstream = sum(_gather_inputs(layout, q, dtype)[2] for q in range(WORLD))
    for q in range(WORLD):
        r = collective_results[q]["gather"][dtype, i]
        off = sum(layout[:q])
        assert r["grad"].shape == (layout[q], GATHER_D) and r["grad"].dtype == dtype, q
        assert torch.equal(r["grad"], total_upstream[off: off + layout[q]]), q


def test_all_reduce_sum_and_max_in_place(collective_results):
    ranks = range(WORLD)
    expected_sum = torch.tensor([sum(ranks), -sum(ranks), 2.5 * sum(ranks), 7.0 * WORLD], dtype=torch.float64)
    expected_max = torch.tensor([[WORLD - 1.0, 0.0], [3.0, float("-inf")]])
    for q, r in enumerate(collective_results):
        assert torch.equal(r["sum"], expected_sum) and r["sum_in_place"], q
        assert torch.equal(r["max"], expected_max) and r["max_in_place"], q
        assert r["ranks"] == (q, WORLD)


def test_all_gather_scalars_table(collective_results):
    expected = torch.tensor([[q, 10 + q, 0.5, 2 ** 40 + q] for q in range(WORLD)], dtype=torch.float64)
    for q, r in enumerate(collective_results):
        assert r["scalars"].dtype == torch.float64 and torch.equal(r["scalars"], expected), q


# ---------------------------------------------------------------------- single process
def _single_process_or_skip():
    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is initialised in the test process; the single-process path needs none")


def test_single_process_paths_need_no_process_group():
    _single_process_or_skip()
    assert collectives.world_size() == 1 and collectives.rank() == 0
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    y = torch.tensor([3, 1, 0, 2])
    gathered, labels, sizes = collectives.all_gather_batch(x, y)
    assert sizes == [4]
    assert torch.equal(gathered, x) and torch.equal(labels, y)
    upstream = torch.randn(4, 3, dtype=torch.float64)
    (gathered * upstream).sum().backward()
    assert torch.equal(x.grad, upstream)

    t = torch.tensor([1.0, -2.0])
    assert collectives.all_reduce_(t, "sum") is t and torch.equal(t, torch.tensor([1.0, -2.0]))
    assert collectives.all_reduce_(t, "max") is t and torch.equal(t, torch.tensor([1.0, -2.0]))
    table = collectives.all_gather_scalars([3, 0.25])
    assert table.dtype == torch.float64 and torch.equal(table, torch.tensor([[3.0, 0.25]], dtype=torch.float64))

    # the entry points run end to end without torch.distributed
    X, yy, W = _subgroup_case(0, [9], 11)
    spec = ("cos", 30.0, 0.35)
    loss_ref, gX, gW = _reference_ce(X, yy, W, spec)
    xx, ww = X.clone().requires_grad_(True), W.clone().requires_grad_(True)
    loss = ds_pfc.margin_cross_entropy(xx, yy, ww, margin=ds_pfc.CosFace(30.0, 0.35))
    loss.backward()
    _close(loss, loss_ref, "single-process functional loss")
    _close(xx.grad, gX, "single-process functional grad embeddings")
    _close(ww.grad, gW, "single-process functional grad centers")
    head = ds_pfc.PartialFC(11, W.shape[1], margin=ds_pfc.CosFace(30.0, 0.35), dtype=torch.float64)
    assert (head.rank, head.world_size, head.class_start, head.class_end) == (0, 1, 0, 11)
    head.load_centers(W)
    xx = X.clone().requires_grad_(True)
    head(xx, yy).backward()
    _close(xx.grad, gX, "single-process head grad embeddings (no data-parallel factor on one rank)")
    assert not dist.is_initialized()


def test_all_reduce_rejects_unknown_op():
    _single_process_or_skip()
    with pytest.raises(ValueError, match="op"):
        collectives.all_reduce_(torch.zeros(2), "min")


# ---------------------------------------------------------------------- explicit group
SUB_D = 6
SUB_SPEC = ("arc", 64.0, 0.5)


def _subgroup_case(seed, sizes, num_classes, d=SUB_D):
    gen = torch.Generator().manual_seed(seed)
    n = sum(sizes)
    W = torch.randn(num_classes, d, generator=gen, dtype=torch.float64)
    y = torch.randint(0, num_classes, (n,), generator=gen)
    X = 2.0 * F.normalize(W, dim=1)[y] + torch.randn(n, d, generator=gen, dtype=torch.float64)
    return X, y, W


def _reference_ce(X, y, W, spec):
    """Float64 full-softmax reference: normalise, cosines, margin on the target
    (cos(theta + m) for ArcFace, cos - m for CosFace), mean cross-entropy."""
    X = X.detach().clone().requires_grad_(True)
    W = W.detach().clone().requires_grad_(True)
    cos = (X / X.norm(dim=1, keepdim=True)) @ (W / W.norm(dim=1, keepdim=True)).t()
    rows = torch.arange(X.shape[0])
    c_t = cos[rows, y]
    if spec[0] == "arc":
        assert bool((torch.acos(c_t) + spec[2] <= math.pi).all()), "test data stays in the arc region"
        phi = torch.cos(torch.acos(c_t) + spec[2])
    else:
        phi = c_t - spec[2]
    logits = torch.where(F.one_hot(y, W.shape[0]).bool(), spec[1] * phi[:, None], spec[1] * cos)
    loss = F.cross_entropy(logits, y)
    loss.backward()
    return loss.detach(), X.grad, W.grad


def _close(actual, expected, what, tol=1e-10):
    actual = actual.detach().double()
    assert actual.shape == expected.shape, what
    if expected.numel():
        torch.testing.assert_close(actual, expected, rtol=tol, atol=tol * float(expected.abs().max()),
                                   msg=lambda m: f"{what}: {m}")


# Ranks 0 and 2 form one group, rank 1 a group of its own.
SUB_SIZES = {0: 4, 2: 3}      # batch sizes of the members of [0, 2], in group-rank order
SOLO_SIZE = 5
SUB_C = 23


def _subgroup_ranks(rank, world_size):
    assert world_size == 3
    pair = dist.new_group([0, 2])
    solo = dist.new_group([1])
    X, y, W = _subgroup_case(1, [SUB_SIZES[0], SUB_SIZES[2]], SUB_C)
    out = {}
    if rank in (0, 2):
        g_rank = collectives.rank(pair)
        out["group"] = (g_rank, collectives.world_size(pair))
        sizes = [SUB_SIZES[0], SUB_SIZES[2]]
        off = sum(sizes[:g_rank])
        sl = slice(off, off + sizes[g_rank])
        a, b = ds_pfc.Partition(SUB_C, 2).bounds(g_rank)
        x = X[sl].clone().requires_grad_(True)
        w = W[a:b].clone().requires_grad_(True)
        loss = ds_pfc.margin_cross_entropy(x, y[sl], w, margin=ds_pfc.ArcFace(64.0, 0.5), group=pair,
                                           class_start=a)
        loss.backward()
        out["functional"] = (loss.detach(), x.grad, w.grad)

        capture = CaptureRows()
        head = ds_pfc.PartialFC(SUB_C, SUB_D, margin=ds_pfc.ArcFace(64.0, 0.5), group=pair,
                                dtype=torch.float64, optimizer=capture)
        out["head_layout"] = (head.rank, head.world_size, head.class_start, head.class_end)
        head.load_centers(W[head.class_start:head.class_end])
        x = X[sl].clone().requires_grad_(True)
        loss = head(x, y[sl])
        loss.backward()
        head.step(0.1)
        out["head"] = (loss.detach(), x.grad, capture.calls[0][1])
    else:
        out["group"] = (collectives.rank(solo), collectives.world_size(solo))
        Xs, ys, Ws = _subgroup_case(2, [SOLO_SIZE], SUB_C)
        head = ds_pfc.PartialFC(SUB_C, SUB_D, margin=ds_pfc.CosFace(30.0, 0.35), group=solo,
                                dtype=torch.float64)
        out["head_layout"] = (head.rank, head.world_size, head.class_start, head.class_end)
        head.load_centers(Ws)
        x = Xs.clone().requires_grad_(True)
        loss = head(x, ys)
        loss.backward()
        out["head"] = (loss.detach(), x.grad)
    return out


def test_explicit_subgroup_only_involves_its_members():
    """Ranks 0 and 2 of a 3-rank job share the classifier over ``new_group([0, 2])``;
    rank 1 trains its own single-rank head at the same time. Each must equal the
    reference over its own group's batch only. (A collective issued on the default
    group instead would hang or mix rank 1's data in.)"""
    results = run_ranks(_subgroup_ranks, 3)
    X, y, W = _subgroup_case(1, [SUB_SIZES[0], SUB_SIZES[2]], SUB_C)
    loss, gX, gW = _reference_ce(X, y, W, SUB_SPEC)
    sizes = [SUB_SIZES[0], SUB_SIZES[2]]
    for world_rank, g_rank in ((0, 0), (2, 1)):
        r = results[world_rank]
        assert r["group"] == (g_rank, 2)
        a, b = ds_pfc.Partition(SUB_C, 2).bounds(g_rank)
        assert r["head_layout"] == (g_rank, 2, a, b)
        off = sum(sizes[:g_rank])
        sl = slice(off, off + sizes[g_rank])
        f_loss, f_gx, f_gw = r["functional"]
        _close(f_loss, loss, f"functional loss, world rank {world_rank}")
        _close(f_gx, gX[sl], f"functional grad embeddings, world rank {world_rank}")
        _close(f_gw, gW[a:b], f"functional grad centers, world rank {world_rank}")
        h_loss, h_gx, h_gw = r["head"]
        _close(h_loss, loss, f"head loss, world rank {world_rank}")
        # data_parallel_grad=True (default): the gradient to the embeddings carries the
        # group size (2), not the world size (3)
        _close(h_gx, 2.0 * gX[sl], f"head grad embeddings, world rank {world_rank}")
        _close(h_gw, gW[a:b], f"head grad centers, world rank {world_rank}")

    Xs, ys, Ws = _subgroup_case(2, [SOLO_SIZE], SUB_C)
    loss, gX, _ = _reference_ce(Xs, ys, Ws, ("cos", 30.0, 0.35))
    r = results[1]
    assert r["group"] == (0, 1)
    assert r["head_layout"] == (0, 1, 0, SUB_C)
    _close(r["head"][0], loss, "solo head loss")
    _close(r["head"][1], gX, "solo head grad embeddings (group of one: no factor)")
