"""Two groups: classes sharded over every rank (tensor parallel x data parallel),
samples gathered over the data-parallel group only.

4 gloo ranks as TP = 2 x DP = 2: rank r has TP index r % 2 and DP index r // 2; the
data-parallel groups are {0, 2} and {1, 3}, and TP peers (same DP index) pass
identical samples, as the two halves of a tensor-parallel backbone would. Reference:
the float64 full softmax of ``test_exactness`` on the concatenated distinct samples
(position 0's batch, then position 1's), differentiated with autograd. Batches are
uneven (5 and 3 samples), the sample rate is 0.4, and the centers go through 3 steps
of the head's sparse SGD, against dense float64 SGD on the union of the active sets.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import ds_pfc
from _capture import CaptureRows
from _dist import run_ranks
from test_exactness import COS, D, _assert_close, _expected_bounds, _lib_margin, _make_case, _reference_ce

WORLD, TP, SIZES, C, SEED, RATE, STEPS, LR = 4, 2, [5, 3], 37, 5, 0.4, 3, 0.5


def _position(rank):
    return rank // TP


def _dp_groups():
    """Every rank creates every data-parallel group, in the same order."""
    groups = [dist.new_group([p * TP + t for p in range(WORLD // TP)]) for t in range(TP)]
    return groups


def _worker(rank, world_size):
    dp = _dp_groups()[rank % TP]
    X, y, W = _make_case(SEED, SIZES, C)
    pos = _position(rank)
    rows = slice(sum(SIZES[:pos]), sum(SIZES[:pos + 1]))
    a, b = _expected_bounds(C, WORLD, rank)
    out = {"bounds": (a, b)}

    # functional, r = 1: loss and gradients against the full softmax
    x = X[rows].clone().requires_grad_(True)
    w = W[a:b].clone().requires_grad_(True)
    res = ds_pfc.margin_cross_entropy(x, y[rows], w, margin=_lib_margin(COS), batch_group=dp, class_start=a,
                                      return_details=True)
    res.loss.backward()
    out["functional"] = {"loss": res.loss.detach(), "per": res.per_sample_loss.detach(), "gx": x.grad,
                         "gw": w.grad}

    # head, r = 0.4, sparse SGD over several steps (momentum 0: dense SGD is the reference)
    head = ds_pfc.PartialFC(C, D, sample_rate=RATE, margin=_lib_margin(COS), batch_group=dp, dtype=torch.float64,
                            seed=11, optimizer="sgd", momentum=0.0, weight_decay=0.0)
    head.load_centers(W[a:b])
    local = torch.where((y >= a) & (y < b), y - a, torch.full_like(y, -1))
    steps = []
    for _ in range(STEPS):
        active = head.active_set(local, head.sample_step)
        x = X[rows].clone().requires_grad_(True)
        res = head(x, y[rows], return_details=True)
        res.loss.backward()
        head.step(LR)
        steps.append({"active": active, "loss": res.loss.detach(), "per": res.per_sample_loss.detach(),
                      "gx": x.grad, "centers": head.centers()})
    out["head"] = steps
    out["layout"] = (head.batch_rank, head.batch_world_size, head.rank, head.world_size)

    # a peer passing other labels is refused on every rank, nothing changed
    bad_y = y[rows].clone()
    if rank == 1:
        bad_y[0] = (bad_y[0] + 1) % C
    capture = CaptureRows()
    probe = ds_pfc.PartialFC(C, D, batch_group=dp, optimizer=capture)
    try:
        probe(X[rows].float(), bad_y)
        out["peer_check"] = None
    except ValueError as err:
        out["peer_check"] = str(err)

    # a batch group that is not inside the class group is refused on every rank
    tp_groups = [dist.new_group([p * TP + t for t in range(TP)]) for p in range(WORLD // TP)]
    try:
        ds_pfc.PartialFC(C, D, group=tp_groups[pos], batch_group=dp)
        out["membership"] = None
    except ValueError as err:
        out["membership"] = str(err)
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_worker, WORLD)


def test_layout(results):
    for r, out in enumerate(results):
        assert out["layout"] == (_position(r), WORLD // TP, r, WORLD)


def test_functional_equals_full_softmax(results):
    X, y, W = _make_case(SEED, SIZES, C)
    loss, per, _, gX, gW = _reference_ce(X, y, W, COS)
    for r, out in enumerate(results):
        f, (a, b), pos = out["functional"], out["bounds"], _position(r)
        rows = slice(sum(SIZES[:pos]), sum(SIZES[:pos + 1]))
        _assert_close(f["loss"], loss, torch.float64, f"rank {r} loss")
        _assert_close(f["per"], per[rows], torch.float64, f"rank {r} per-sample", whole=per)
        # every TP peer gets the whole gradient of its samples (summed over all 4 class shards)
        _assert_close(f["gx"], gX[rows], torch.float64, f"rank {r} grad embeddings", whole=gX)
        _assert_close(f["gw"], gW[a:b], torch.float64, f"rank {r} grad centers", whole=gW)


def test_head_sampled_sparse_sgd_equals_dense_float64(results):
    X, y, W = _make_case(SEED, SIZES, C)
    W = W.clone()
    for t in range(STEPS):
        union = torch.cat([out["head"][t]["active"] + out["bounds"][0] for out in results])
        assert union.numel() < C, "sampling must leave classes out"
        loss, per, _, gX, gW = _reference_ce(X, y, W, COS, cols=union)
        W = W - LR * gW
        for r, out in enumerate(results):
            s, (a, b), pos = out["head"][t], out["bounds"], _position(r)
            rows = slice(sum(SIZES[:pos]), sum(SIZES[:pos + 1]))
            what = f"step {t} rank {r}"
            _assert_close(s["loss"], loss, torch.float64, what + " loss")
            _assert_close(s["per"], per[rows], torch.float64, what + " per-sample", whole=per)
            # data_parallel_grad: times the data-parallel size (2), which DeepSpeed averages over
            _assert_close(s["gx"], 2 * gX[rows], torch.float64, what + " grad embeddings", whole=2 * gX)
            _assert_close(s["centers"], W[a:b], torch.float64, what + " centers", whole=W)


def test_peers_with_different_labels_are_refused(results):
    for out in results:
        assert out["peer_check"] is not None and "tensor-parallel peers" in out["peer_check"]


def test_batch_group_outside_the_class_group_is_refused(results):
    for out in results:
        assert out["membership"] is not None and "outside group" in out["membership"]
