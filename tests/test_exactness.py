"""Exactness contracts (DESIGN.md section 3): the distributed head equals a plain
single-process float64 softmax on the concatenated batch.

Every expected value here comes from ``_reference_ce`` below: a float64 full softmax
written in plain PyTorch (normalise, cosines, margin ``phi`` written from its formula,
filter, ``F.cross_entropy``), differentiated with ``torch.autograd``. The library is
never compared against itself. Multi-rank cases spawn gloo CPU ranks; each rank
returns what it observed and the parent process compares every rank's shard with the
reference.
"""
from __future__ import annotations

import importlib.util
import math
import os

import pytest
import torch
import torch.nn.functional as F

import ds_pfc
from _capture import CaptureRows
from _dist import run_ranks

D = 16

# Margin specs, written independently of the library: (kind, scale, *params).
ARC = ("arc", 64.0, 0.5)
ARC_ST = ("arc_st", 64.0, 0.5)        # straight-through: value of ArcFace, gradient of s*cos
COS = ("cos", 30.0, 0.35)
COMB = ("comb", 64.0, 1.2, 0.3, 0.2)  # cos(1.2*theta + 0.3) - 0.2


# ---------------------------------------------------------------------- reference
def _phi_combined(c, m1, m2, m3):
    """cos(m1*theta + m2) - m3; past theta* = (pi - m2)/m1 the documented linear
    continuation c - cos(theta*) - 1 - m3 (DESIGN: "theta + m > pi handled")."""
    theta = torch.acos(c)
    arc = torch.cos(m1 * theta + m2) - m3
    theta_star = (math.pi - m2) / m1
    if theta_star >= math.pi:
        return arc
    linear = c - math.cos(theta_star) - 1.0 - m3
    return torch.where(theta <= theta_star, arc, linear)


def _ref_phi(spec, c):
    kind = spec[0]
    if kind == "arc":
        return _phi_combined(c, 1.0, spec[2], 0.0)
    if kind == "arc_st":
        # value of ArcFace, derivative of the plain cosine
        return c + (_phi_combined(c, 1.0, spec[2], 0.0) - c).detach()
    if kind == "cos":
        return c - spec[2]
    if kind == "comb":
        return _phi_combined(c, spec[2], spec[3], spec[4])
    raise AssertionError(kind)


def _lib_margin(spec):
    kind = spec[0]
    if kind == "arc":
        return ds_pfc.ArcFace(spec[1], spec[2])
    if kind == "arc_st":
        return ds_pfc.ArcFace(spec[1], spec[2], straight_through=True)
    if kind == "cos":
        return ds_pfc.CosFace(spec[1], spec[2])
    if kind == "comb":
        return ds_pfc.CombinedMargin(spec[1], spec[2], spec[3], spec[4])
    raise AssertionError(kind)


def _reference_ce(X, y, W, spec, tau=None, cols=None):
    """Single-process float64 margin softmax CE over the classes ``cols`` (default all).

    Returns (loss, per_sample, correct, grad_X, grad_W) with grad_W of shape W.shape
    (zero outside ``cols``).
    """
    X = X.detach().to(torch.float64).clone().requires_grad_(True)
    W = W.detach().to(torch.float64).clone().requires_grad_(True)
    x_hat = X / X.norm(dim=1, keepdim=True)
    w_hat = W / W.norm(dim=1, keepdim=True)
    if cols is None:
        target = y.long()
    else:
        w_hat = w_hat[cols]
        target = torch.searchsorted(cols, y.long())
        assert bool((cols[target] == y).all()), "every label must be in the class subset"
    cos = x_hat @ w_hat.t()
    rows = torch.arange(X.shape[0])
    onehot = F.one_hot(target, cos.shape[1]).bool()
    scale = spec[1]
    target_logit = scale * _ref_phi(spec, cos[rows, target])
    logits = torch.where(onehot, target_logit[:, None], scale * cos)
    if tau is not None:
        logits = logits.masked_fill((cos.detach() > tau) & ~onehot, float("-inf"))
    per_sample = F.cross_entropy(logits, target, reduction="none")
    loss = per_sample.mean()
    loss.backward()
    raw = cos.detach()
    correct = raw[rows, target] >= raw.max(dim=1).values
    return loss.detach(), per_sample.detach(), correct, X.grad, W.grad


def _make_case(seed, sizes, num_classes, d=D):
    """Global batch (X [N, d], y [N]) and full centers W [C, d], float64.

    Embeddings lean towards their class center by a random amount (target cosines
    spread over (-1, 1), some samples right, some wrong) and sample 0 points away from
    its center (target angle + margin > pi). Norms vary so normalisation matters.
    """
    gen = torch.Generator().manual_seed(seed)
    n = sum(sizes)
    W = torch.randn(num_classes, d, generator=gen, dtype=torch.float64)
    W = W * (0.5 + 2 * torch.rand(num_classes, 1, generator=gen, dtype=torch.float64))
    y = torch.randint(0, num_classes, (n,), generator=gen)
    w_hat = W / W.norm(dim=1, keepdim=True)
    lean = 3.0 * torch.rand(n, 1, generator=gen, dtype=torch.float64)
    noise = torch.randn(n, d, generator=gen, dtype=torch.float64) / math.sqrt(d)
    X = lean * w_hat[y] + noise
    if n:
        X[0] = -3.0 * w_hat[y[0]] + 0.1 * noise[0]
    X = X * (0.2 + 5 * torch.rand(n, 1, generator=gen, dtype=torch.float64))
    return X, y, W


def _expected_bounds(num_classes, world_size, rank):
    """Ownership contract written out: C_q in {floor(C/k), ceil(C/k)}, the first
    C mod k ranks own one more, intervals contiguous in rank order."""
    sizes = [num_classes // world_size + (q < num_classes % world_size) for q in range(world_size)]
    start = sum(sizes[:rank])
    return start, start + sizes[rank]


def _tol(dtype):
    return 1e-10 if dtype == torch.float64 else 1e-5


def _assert_close(actual, expected, dtype, what, whole=None):
    """Elementwise relative tolerance, with an absolute floor relative to the largest
    entry of ``whole`` (the global tensor ``expected`` is a rank's slice of; default
    ``expected``): a near-zero per-sample loss or gradient entry cannot carry more
    digits than the quantities it was computed from (e.g. a loss of 6e-12 is
    log-sum-exp minus a target logit of size ~scale)."""
    actual = actual.detach().to(torch.float64)
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    if expected.numel() == 0:
        return
    whole = expected if whole is None else whole
    tol = _tol(dtype)
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol * float(whole.abs().max()),
                               msg=lambda m: f"{what}: {m}")


def _slice(sizes, rank):
    off = sum(sizes[:rank])
    return slice(off, off + sizes[rank])


# ---------------------------------------------------------------------- partition
@pytest.mark.parametrize("num_classes,world_size", [(1021, 1), (1021, 2), (1021, 3), (1021, 4), (23, 4),
                                                    (2, 3), (2, 4), (1, 4), (10007, 3), (12, 4), (7, 7)])
def test_partition_matches_ownership_contract(num_classes, world_size):
    part = ds_pfc.Partition(num_classes, world_size)
    floor, ceil = num_classes // world_size, -(-num_classes // world_size)
    prev_end = 0
    for q in range(world_size):
        a, b = part.bounds(q)
        assert (a, b) == _expected_bounds(num_classes, world_size, q)
        assert a == prev_end, "intervals must be contiguous in rank order"
        assert b - a in (floor, ceil)
        assert (b - a == floor + 1) == (q < num_classes % world_size), "first C mod k ranks own one more"
        prev_end = b
    assert prev_end == num_classes
    # owner() agrees with the intervals for every class
    owners = part.owner(torch.arange(num_classes))
    expected = torch.tensor([q for q in range(world_size)
                             for _ in range(*_expected_bounds(num_classes, world_size, q))])
    assert torch.equal(owners, expected)


# ---------------------------------------------------------------------- functional, r = 1
# (margin spec, filter tau, dtype of embeddings and centers[, softmax options])
# Tiny ``block_bytes`` split the classes into many blocks whose logits are recomputed in
# backward (the memory-lean path); the default keeps these small logits whole.
_RECOMPUTE = {"block_bytes": 2048}
FUNCTIONAL_CASES = [
    (ARC, None, torch.float64),
    (ARC_ST, None, torch.float64),
    (COS, None, torch.float64),
    (COMB, None, torch.float64),
    (ARC, 0.25, torch.float64),
    (COS, 0.1, torch.float64),
    (ARC, None, torch.float32),
    (COMB, 0.25, torch.float32),
    (ARC, 0.25, torch.float64, _RECOMPUTE),
    (COMB, None, torch.float64, _RECOMPUTE),
    (COS, 0.1, torch.float32, _RECOMPUTE),
]
if importlib.util.find_spec("triton") is not None and os.environ.get("TRITON_INTERPRET") == "1":
    # The fused kernels in Triton's interpreter (CPU tensors; conftest.py sets it when
    # there is no GPU; on a GPU test_triton_softmax.py and test_gpu_path.py run them).
    FUNCTIONAL_CASES += [
        (ARC, None, torch.float32, {"backend": "triton"}),
        (ARC_ST, 0.25, torch.float32, {"backend": "triton"}),
        (COS, 0.1, torch.float32, {"backend": "triton"}),
        (COMB, 0.25, torch.float32, {"backend": "triton"}),
        # The recompute path (the default above keeps the cosines for backward).
        (ARC_ST, 0.25, torch.float32, {"backend": "triton", "keep_bytes": 0}),
        (COMB, None, torch.float32, {"backend": "triton", **_RECOMPUTE}),
    ]

# The interpreter runs every Triton program in Python (~6 s per case at 1021 classes): its
# cases take at most this many classes, still several of its 16-class tiles per rank with a
# ragged last one, several class splits of the forward and, with _RECOMPUTE, several
# backward blocks (k1: 9 tiles in 3 splits and 9 blocks; k2: 66 + 65 classes, 5 tiles in 2
# splits each).
_TRITON_CLASSES = 131


def _case_classes(options, num_classes):
    """Classes of a FUNCTIONAL_CASES entry's problem at the parametrised ``num_classes``."""
    if options and options[0].get("backend") == "triton":
        return min(num_classes, _TRITON_CLASSES)
    return num_classes


def _functional_ranks(rank, world_size, sizes, num_classes, seed):
    sl = _slice(sizes, rank)
    out = []
    for spec, tau, dtype, *options in FUNCTIONAL_CASES:
        kw = options[0] if options else {}
        classes = _case_classes(options, num_classes)
        X, y, W = _make_case(seed, sizes, classes)
        a, b = ds_pfc.Partition(classes, world_size).bounds(rank)
        x = X[sl].to(dtype).clone().requires_grad_(True)
        w = W[a:b].to(dtype).clone().requires_grad_(True)
        res = ds_pfc.margin_cross_entropy(x, y[sl], w, margin=_lib_margin(spec), filter_threshold=tau,
                                          class_start=a, return_details=True, **kw)
        res.loss.backward()
        plain = ds_pfc.margin_cross_entropy(x.detach(), y[sl], w.detach(), margin=_lib_margin(spec),
                                            filter_threshold=tau, class_start=a, **kw)
        out.append({"loss": res.loss.detach(), "plain": plain, "per": res.per_sample_loss.detach(),
                    "acc": res.accuracy, "gx": x.grad, "gw": w.grad, "dtypes": (res.loss.dtype, x.grad.dtype)})
    return out


@pytest.mark.parametrize("world_size,sizes,num_classes", [
    (1, [37], 1021),
    (2, [20, 17], 1021),
    (3, [3, 1, 4], 23),
    (3, [5, 0, 2], 7),          # a rank with an empty batch
    (4, [10, 9, 11, 7], 2),     # C < world size: ranks 2 and 3 own nothing
], ids=["k1", "k2-C1021", "k3-C23", "k3-empty-batch", "k4-C2"])
def test_functional_r1_equals_full_softmax(world_size, sizes, num_classes):
    seed = 100 + world_size
    results = run_ranks(_functional_ranks, world_size, sizes, num_classes, seed)
    for i, (spec, tau, dtype, *options) in enumerate(FUNCTIONAL_CASES):
        classes = _case_classes(options, num_classes)
        X, y, W = _make_case(seed, sizes, classes)
        # the reference sees exactly the (possibly float32-rounded) inputs the ranks saw
        loss, per, correct, gX, gW = _reference_ce(X.to(dtype), y, W.to(dtype), spec, tau)
        if tau is not None:
            cos = F.normalize(X, dim=1) @ F.normalize(W, dim=1).t()
            onehot = F.one_hot(y, classes).bool()
            assert bool(((cos > tau) & ~onehot).any()), "the filter must have something to drop"
            assert bool(((cos > tau) & onehot).any()), "some target must lie above tau (never filtered)"
        for q, per_rank in enumerate(results):
            r = per_rank[i]
            what = f"case {i} {spec} tau={tau} {dtype} {options} C={classes} rank {q}"
            a, b = ds_pfc.Partition(classes, world_size).bounds(q)
            assert (a, b) == _expected_bounds(classes, world_size, q)
            assert r["dtypes"] == (dtype, dtype), what
            _assert_close(r["loss"], loss, dtype, what + " loss")
            _assert_close(r["plain"], loss, dtype, what + " loss (return_details=False)")
            _assert_close(r["per"], per[_slice(sizes, q)], dtype, what + " per-sample loss", whole=per)
            _assert_close(r["acc"], correct.double().mean(), dtype, what + " accuracy")
            _assert_close(r["gx"], gX[_slice(sizes, q)], dtype, what + " grad embeddings", whole=gX)
            _assert_close(r["gw"], gW[a:b], dtype, what + " grad centers", whole=gW)


# ---------------------------------------------------------------------- PartialFC, r = 1
HEAD_R1_CASES = [(ARC, None), (COS, 0.3), (COMB, 0.2)]


def _head_r1_ranks(rank, world_size, sizes, num_classes, seed):
    X, y, _ = _make_case(seed, sizes, num_classes)
    sl = _slice(sizes, rank)
    out = []
    for j, (spec, tau) in enumerate(HEAD_R1_CASES):
        capture = CaptureRows()
        head = ds_pfc.PartialFC(num_classes, D, sample_rate=1.0, margin=_lib_margin(spec), filter_threshold=tau,
                                dtype=torch.float64, data_parallel_grad=False, optimizer=capture, seed=7 + j)
        centers = head.centers()
        x = X[sl].clone().requires_grad_(True)
        res = head(x, y[sl], return_details=True)
        res.loss.backward()
        updated = head.step(1.0)
        out.append({"centers": centers, "bounds": (head.class_start, head.class_end), "loss": res.loss.detach(),
                    "per": res.per_sample_loss.detach(), "acc": res.accuracy, "gx": x.grad,
                    "calls": capture.calls, "updated": updated})
    return out


def test_head_r1_equals_full_softmax_with_own_centers():
    world_size, sizes, num_classes, seed = 3, [20, 0, 17], 1021, 5
    results = run_ranks(_head_r1_ranks, world_size, sizes, num_classes, seed)
    X, y, _ = _make_case(seed, sizes, num_classes)
    for j, (spec, tau) in enumerate(HEAD_R1_CASES):
        bounds = [results[q][j]["bounds"] for q in range(world_size)]
        assert bounds == [_expected_bounds(num_classes, world_size, q) for q in range(world_size)]
        W = torch.cat([results[q][j]["centers"] for q in range(world_size)])
        assert W.shape == (num_classes, D) and W.dtype == torch.float64
        loss, per, correct, gX, gW = _reference_ce(X, y, W, spec, tau)
        for q in range(world_size):
            r = results[q][j]
            what = f"head {spec} tau={tau} rank {q}"
            a, b = bounds[q]
            _assert_close(r["loss"], loss, torch.float64, what + " loss")
            _assert_close(r["per"], per[_slice(sizes, q)], torch.float64, what + " per-sample", whole=per)
            _assert_close(r["acc"], correct.double().mean(), torch.float64, what + " accuracy")
            _assert_close(r["gx"], gX[_slice(sizes, q)], torch.float64, what + " grad embeddings", whole=gX)
            assert len(r["calls"]) == 1, what
            rows, grad = r["calls"][0]
            assert rows is None, "r = 1 updates the whole shard"
            assert r["updated"] == b - a
            _assert_close(grad, gW[a:b], torch.float64, what + " grad centers", whole=gW)


# ---------------------------------------------------------------------- PartialFC, r < 1
UNION_HEADS = [  # (margin, tau, seed)
    (ARC, None, 3),
    (COMB, 0.3, 11),
]
UNION_RATE = 0.3
UNION_STEPS = 2


def _union_ranks(rank, world_size, sizes, num_classes, seed):
    X, y, W = _make_case(seed, sizes, num_classes)
    sl = _slice(sizes, rank)
    a, b = _expected_bounds(num_classes, world_size, rank)
    # gathered labels -> this rank's local ids, written out here (not the library's)
    local = torch.where((y >= a) & (y < b), y - a, torch.full_like(y, -1))
    out = []
    for spec, tau, head_seed in UNION_HEADS:
        capture = CaptureRows()
        head = ds_pfc.PartialFC(num_classes, D, sample_rate=UNION_RATE, margin=_lib_margin(spec),
                                filter_threshold=tau, dtype=torch.float64, data_parallel_grad=False,
                                optimizer=capture, seed=head_seed)
        # centers the embeddings lean towards, so that top-1 accuracy is non-trivial
        head.load_centers(W[a:b])
        centers = head.centers()
        steps = []
        for _ in range(UNION_STEPS):
            step = head.sample_step
            active = head.active_set(local, step)
            x = X[sl].clone().requires_grad_(True)
            res = head(x, y[sl], return_details=True)
            res.loss.backward()
            head.step(1.0)
            rows, grad = capture.calls[-1]
            steps.append({"step": step, "active": active, "rows": rows, "grad": grad, "loss": res.loss.detach(),
                          "per": res.per_sample_loss.detach(), "acc": res.accuracy, "gx": x.grad})
        out.append({"centers": centers, "steps": steps})
    return out


def test_head_sampled_equals_softmax_over_union_of_active_sets():
    world_size, sizes, num_classes, seed = 3, [13, 7, 17], 1021, 9
    results = run_ranks(_union_ranks, world_size, sizes, num_classes, seed)
    X, y, _ = _make_case(seed, sizes, num_classes)
    for h, (spec, tau, _) in enumerate(UNION_HEADS):
        W = torch.cat([results[q][h]["centers"] for q in range(world_size)])
        assert W.shape == (num_classes, D)
        previous = None
        for t in range(UNION_STEPS):
            union = []
            for q in range(world_size):
                s = results[q][h]["steps"][t]
                a, b = _expected_bounds(num_classes, world_size, q)
                active = s["active"]
                assert s["step"] == t
                # the rows that were handed a gradient are exactly the reported active set
                assert torch.equal(s["rows"], active), f"head {h} step {t} rank {q}"
                assert active.dtype == torch.int64
                assert bool((active[1:] > active[:-1]).all()), "active set sorted, no repeats"
                assert active.numel() == 0 or (0 <= int(active[0]) and int(active[-1]) < b - a)
                positives = torch.unique(y[(y >= a) & (y < b)]) - a
                assert bool(torch.isin(positives, active).all()), "every owned positive is active"
                assert active.numel() == max(math.floor(UNION_RATE * (b - a)), positives.numel())
                union.append(active + a)
            union = torch.cat(union)
            assert union.numel() < num_classes // 2, "sampling must actually leave classes out"
            if previous is not None:
                assert not torch.equal(union, previous), "the sampler should draw anew each step"
            previous = union

            loss, per, correct, gX, gW = _reference_ce(X, y, W, spec, tau, cols=union)
            assert 0.0 < float(correct.double().mean()) < 1.0, "accuracy check must be non-trivial"
            for q in range(world_size):
                s = results[q][h]["steps"][t]
                a, _ = _expected_bounds(num_classes, world_size, q)
                what = f"union head {h} step {t} rank {q}"
                _assert_close(s["loss"], loss, torch.float64, what + " loss")
                _assert_close(s["per"], per[_slice(sizes, q)], torch.float64, what + " per-sample", whole=per)
                _assert_close(s["acc"], correct.double().mean(), torch.float64, what + " accuracy")
                _assert_close(s["gx"], gX[_slice(sizes, q)], torch.float64, what + " grad embeddings", whole=gX)
                _assert_close(s["grad"], gW[s["active"] + a], torch.float64, what + " grad active centers", whole=gW)


# ---------------------------------------------------------------------- bfloat16 compute
BF16_SPECS = [COS, ARC]


def _bf16_ranks(rank, world_size, sizes, num_classes, seed):
    X, y, W = _make_case(seed, sizes, num_classes)
    a, b = ds_pfc.Partition(num_classes, world_size).bounds(rank)
    sl = _slice(sizes, rank)
    out = []
    for spec in BF16_SPECS:
        row = {}
        for name, compute in (("bf16", torch.bfloat16), ("fp32", None)):
            res = ds_pfc.margin_cross_entropy(X[sl].float(), y[sl], W[a:b].float(), margin=_lib_margin(spec),
                                              class_start=a, compute_dtype=compute, return_details=True)
            row[name] = (res.loss, res.per_sample_loss)
        out.append(row)
    return out


def test_bf16_compute_within_the_references_own_bf16_error():
    """With ``compute_dtype=bfloat16`` the cosines pass through bf16 (inputs rounded to
    bf16, products rounded back to bf16). The plain reference run the same way
    (``x_hat.bfloat16() @ w_hat.bfloat16().T``, margin and softmax in float64) moves
    sample n's logits by at most ``dz_n``. A per-sample CE loss is 2-Lipschitz in the
    max-norm of its logits (log-sum-exp is 1-Lipschitz, plus the target logit), so an
    implementation whose logit errors are of the reference's size (allow 2x for a
    different rounding path: float32 vs float64 normalisation, summation order) is
    within ``4 * dz_n`` of the exact per-sample loss, and the mean within the mean.
    (Observed: at most ~1/3 of that bound per sample.)
    """
    world_size, sizes, num_classes, seed = 2, [20, 17], 1021, 21
    results = run_ranks(_bf16_ranks, world_size, sizes, num_classes, seed)
    X, y, W = _make_case(seed, sizes, num_classes)
    X32, W32 = X.float().double(), W.float().double()
    x_hat, w_hat = F.normalize(X32, dim=1), F.normalize(W32, dim=1)
    cos_exact = x_hat @ w_hat.t()
    cos_bf16 = (x_hat.bfloat16() @ w_hat.bfloat16().t()).double()
    onehot = F.one_hot(y, num_classes).bool()
    rows = torch.arange(y.numel())
    for i, spec in enumerate(BF16_SPECS):
        def logits(cos):
            target = spec[1] * _ref_phi(spec, cos[rows, y])
            return torch.where(onehot, target[:, None], spec[1] * cos)

        bound = 4.0 * (logits(cos_bf16) - logits(cos_exact)).abs().amax(dim=1)   # [N]
        assert bool((bound > 0).all())
        loss, per, *_ = _reference_ce(X32, y, W32, spec)
        for q in range(world_size):
            loss16, per16 = results[q][i]["bf16"]
            loss32, _ = results[q][i]["fp32"]
            what = f"bf16 {spec} rank {q}"
            sl = _slice(sizes, q)
            err = (per16.double() - per[sl]).abs()
            assert bool((err <= bound[sl]).all()), f"{what}: per-sample error {err} exceeds {bound[sl]}"
            assert abs(float(loss16) - float(loss)) <= float(bound.mean()), \
                f"{what}: |{float(loss16)} - {float(loss)}| > {float(bound.mean())}"
            _assert_close(loss32, loss, torch.float32, what + " float32 control")
            # the option is not silently ignored: bf16 products change the result
            assert float(loss16) != float(loss32), what + ": compute_dtype=bfloat16 had no effect"
