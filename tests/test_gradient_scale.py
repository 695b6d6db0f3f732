"""Gradient-scale contract, world-size-independent initial centers, and ranks that
disagree at construction (DESIGN.md section 3).

The data-parallel setting is modelled exactly as DDP/DeepSpeed run it: a backbone
replicated on every rank, each rank its own batch, ``loss.backward()``, then the
backbone gradients are *averaged* with ``all_reduce / k``. The expected gradients come
from a float64 single-process reference on the concatenated batch written here in
plain PyTorch.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import ds_pfc
from _capture import CaptureRows
from _dist import run_ranks

IN_FEATURES, D, C = 6, 8, 23
ARC_SCALE, ARC_MARGIN = 64.0, 0.5   # PartialFC's default margin, ArcFace(64, 0.5)


def _phi_arcface(c, m):
    """cos(theta + m); past theta + m = pi the documented continuation
    c - cos(pi - m) - 1 (so the reference covers every target cosine)."""
    theta = torch.acos(c)
    return torch.where(theta <= math.pi - m, torch.cos(theta + m), c - math.cos(math.pi - m) - 1.0)


def _reference_loss(emb, y, W):
    """Global mean ArcFace CE on the concatenated batch (float64, plain PyTorch)."""
    cos = F.normalize(emb, dim=1) @ F.normalize(W, dim=1).t()
    rows = torch.arange(emb.shape[0])
    target = ARC_SCALE * _phi_arcface(cos[rows, y], ARC_MARGIN)
    logits = torch.where(F.one_hot(y, W.shape[0]).bool(), target[:, None], ARC_SCALE * cos)
    return F.cross_entropy(logits, y)


def _backbone():
    torch.manual_seed(1234)   # the same replica on every rank and in the reference
    return nn.Linear(IN_FEATURES, D).double()


def _batch(sizes, seed=77):
    gen = torch.Generator().manual_seed(seed)
    n = sum(sizes)
    inputs = torch.randn(n, IN_FEATURES, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, C, (n,), generator=gen)
    return inputs, labels


def _data_parallel_ranks(rank, world_size, sizes):
    inputs, labels = _batch(sizes)
    off = sum(sizes[:rank])
    sl = slice(off, off + sizes[rank])
    out = {}
    for data_parallel_grad in (True, False):
        backbone = _backbone()
        capture = CaptureRows()
        kwargs = {} if data_parallel_grad else {"data_parallel_grad": False}
        head = ds_pfc.PartialFC(C, D, dtype=torch.float64, optimizer=capture, seed=3, **kwargs)
        centers = head.centers()
        loss = head(backbone(inputs[sl]), labels[sl])
        loss.backward()
        head.step(0.1)
        # what DDP / DeepSpeed do to a replicated module: average over the ranks
        averaged = []
        for p in backbone.parameters():
            g = p.grad.clone()
            dist.all_reduce(g)
            averaged.append(g / world_size)
        out[data_parallel_grad] = {"loss": loss.detach(), "averaged": averaged, "centers": centers,
                                   "center_grad": capture.calls[0][1], "bounds": (head.class_start, head.class_end)}
    return out


@pytest.mark.parametrize("sizes", [[3, 1, 4], [5, 0]], ids=["k3-uneven", "k2-empty-rank"])
def test_averaged_backbone_gradient_equals_global_mean_loss_gradient(sizes):
    world_size = len(sizes)
    results = run_ranks(_data_parallel_ranks, world_size, sizes)
    inputs, labels = _batch(sizes)

    for dpg in (True, False):
        W = torch.cat([results[q][dpg]["centers"] for q in range(world_size)])
        assert W.shape == (C, D)
        # reference: one process, the concatenated batch, the global mean loss
        backbone = _backbone()
        Wr = W.clone().requires_grad_(True)
        loss = _reference_loss(backbone(inputs), labels, Wr)
        loss.backward()
        ref_grads = [p.grad for p in backbone.parameters()]
        # data_parallel_grad=True: the average is the true gradient. False: nothing
        # compensates the averaging, so it is 1/k of it -- the factor lives in the head.
        factor = 1.0 if dpg else 1.0 / world_size
        for q in range(world_size):
            r = results[q][dpg]
            what = f"data_parallel_grad={dpg} rank {q}"
            torch.testing.assert_close(r["loss"], loss.detach(), rtol=1e-10, atol=0, msg=what)
            for name, got, ref in zip(("weight", "bias"), r["averaged"], ref_grads):
                torch.testing.assert_close(got, factor * ref, rtol=1e-10, atol=1e-10 * float(ref.abs().max()),
                                           msg=lambda m: f"{what} backbone {name}: {m}")
            # the centers' gradient is the gradient of the global mean loss, never scaled
            a, b = r["bounds"]
            torch.testing.assert_close(r["center_grad"], Wr.grad[a:b], rtol=1e-10,
                                       atol=1e-10 * float(Wr.grad.abs().max()),
                                       msg=lambda m: f"{what} centers: {m}")


# ---------------------------------------------------------------------- initial centers
INIT_C, INIT_D = 10007, 4   # 4096-class init blocks straddle the rank boundaries


def _init_ranks(rank, world_size):
    return {seed: (ds_pfc.PartialFC(INIT_C, INIT_D, seed=seed).centers(),
                   ds_pfc.PartialFC(INIT_C, INIT_D, seed=seed, dtype=torch.float64).centers())
            for seed in (0, 1)}


def test_initial_centers_do_not_depend_on_world_size():
    if dist.is_available() and dist.is_initialized():
        pytest.skip("needs a single process without a process group for the 1-rank head")
    results = run_ranks(_init_ranks, 3)
    bounds = [(0, 3336), (3336, 6672), (6672, 10007)]
    assert any(a // 4096 != (b - 1) // 4096 for a, b in bounds[1:]), "a block must straddle a boundary"
    for seed in (0, 1):
        for k, dtype in enumerate((torch.float32, torch.float64)):
            shards = [results[q][seed][k] for q in range(3)]
            assert [s.shape[0] for s in shards] == [b - a for a, b in bounds]
            assert all(s.dtype == dtype for s in shards)
            single = ds_pfc.PartialFC(INIT_C, INIT_D, seed=seed, dtype=dtype).centers()
            assert single.shape == (INIT_C, INIT_D)
            assert torch.equal(torch.cat(shards), single), f"seed {seed} {dtype}: 3 ranks != 1 rank"
    a, b = results[0][0][0], results[0][1][0]
    assert not torch.isclose(a, b).all(dim=1).any(), "different seeds must give different centers (every row)"
    single = ds_pfc.PartialFC(INIT_C, INIT_D, seed=0).centers()
    assert bool(torch.isfinite(single).all()) and single.abs().max() > 0


# ---------------------------------------------------------------------- disagreement
def _disagree_ranks(rank, world_size):
    out = {}
    cases = {
        "num_classes": dict(num_classes=100 + (rank == world_size - 1), embedding_size=8),
        "embedding_size": dict(num_classes=100, embedding_size=8 + (rank == 1)),
        "sample_rate": dict(num_classes=100, embedding_size=8, sample_rate=0.5 if rank == 0 else 0.25),
        "seed": dict(num_classes=100, embedding_size=8, seed=3 if rank == 1 else 7),
        "filter_threshold": dict(num_classes=100, embedding_size=8, filter_threshold=0.4 if rank == 0 else None),
        "margin": dict(num_classes=100, embedding_size=8,
                       margin=ds_pfc.CosFace(64.0, 0.4) if rank == 2 else ds_pfc.ArcFace(64.0, 0.5)),
        # One rank's own argument is invalid: it raises its own error, and the others must
        # not wait forever in the agreement collective but fail too.
        "invalid_on_one_rank": dict(num_classes=100, embedding_size=8, sample_rate=1.5 if rank == 1 else 0.5),
    }
    for name, kwargs in cases.items():
        kwargs = dict(kwargs)
        args = (kwargs.pop("num_classes"), kwargs.pop("embedding_size"))
        try:
            ds_pfc.PartialFC(*args, **kwargs)
            out[name] = None
        except ValueError as err:
            out[name] = str(err)
    head = ds_pfc.PartialFC(100, 8)   # agreeing ranks still construct afterwards
    out["ok"] = (head.class_start, head.class_end)
    # Bad forward input on one rank only: every rank must fail (none may wait forever
    # in the gather) and nothing changes, so the next good step runs in lockstep.
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(rank))
    y = torch.arange(5) * 7
    bad = x.clone()
    if rank == 1:
        bad[2, 3] = float("nan")
    try:
        head(bad, y)
        out["nan_on_one_rank"] = None
    except ValueError as err:
        out["nan_on_one_rank"] = str(err)
    loss = float(head(x, y))
    out["after"] = (head.sample_step, loss)
    return out


def test_ranks_disagreeing_at_construction_fail_on_every_rank():
    world_size = 3
    results = run_ranks(_disagree_ranks, world_size)
    expected_values = {"num_classes": ("100", "101"), "embedding_size": ("8", "9"), "sample_rate": ("0.5", "0.25"),
                       "seed": ("3.0", "7.0"), "filter_threshold": ("0.4",), "margin": ()}
    for q, r in enumerate(results):
        nan = r["nan_on_one_rank"]
        assert nan is not None, f"rank {q}: no error when rank 1 passed NaN embeddings"
        assert ("NaN" in nan) if q == 1 else ("ranks [1]" in nan and "embeddings" in nan), nan
        assert r["after"][0] == 1 and r["after"][1] == results[0]["after"][1], "ranks out of step after the error"
        invalid = r["invalid_on_one_rank"]
        assert invalid is not None, f"rank {q}: no error when rank 1 passed sample_rate=1.5"
        if q == 1:
            assert "sample_rate" in invalid and "1.5" in invalid, invalid
        else:
            assert "ranks [1]" in invalid, f"rank {q}: the error must name the failing rank: {invalid!r}"
        for name, values in expected_values.items():
            msg = r[name]
            assert msg is not None, f"rank {q}: no ValueError for differing {name}"
            assert name in msg, f"rank {q}: the error must name {name}: {msg!r}"
            assert all(v in msg for v in values), f"rank {q}: the error must show the values: {msg!r}"
        assert r["ok"] == ds_pfc.Partition(100, world_size).bounds(q)
