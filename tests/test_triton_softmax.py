"""Triton kernels of the margin softmax against an independent float64 reference.

Without CUDA the kernels run on CPU tensors under Triton's interpreter, which must be switched on
before ``ds_pfc.kernels.triton_softmax`` is imported (Triton reads it at decoration time).
"""
import json
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

# Before anything imports triton: its own jit'd library is decorated at import time too.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton", reason="triton is not installed (pip install -e .[dev])")

from ds_pfc.kernels import triton_softmax as ts  # noqa: E402

if torch.cuda.is_available() and not ts._INTERPRET:
    DEVICE = "cuda"
elif ts._INTERPRET and ts._TRITON_INTERPRETED:
    DEVICE = "cpu"
else:
    pytest.skip("neither CUDA nor the Triton interpreter is usable: triton or "
                "ds_pfc.kernels.triton_softmax was imported before TRITON_INTERPRET=1 was set",
                allow_module_level=True)

# Unit roundoff (with a factor 2 of slack) of the G operand the backward rounds to compute dtype.
_ROUNDOFF = {torch.float32: 0.0, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
# Absolute error of rounding a tiny G entry to float16, in units of the largest |coef|: G is
# stored as G / max|coef| (subnormal spacing 2**-24, half of it).
_UNDERFLOW = {torch.float32: 0.0, torch.bfloat16: 0.0, torch.float16: 2.0 ** -25}
# Everything else differs from float64 by float32 accumulation and exp: the cosines by about
# d * 2**-24 ~ 1e-6 at most, i.e. up to ~1e-4 relative in exp(scale * cos) for scale 64.
_RTOL = 1e-4


def _data(n, s, d, *, seed, device=DEVICE):
    """Correlated embeddings and centers with raw norms, so some negatives pass a 0.2 filter."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(s, d, generator=g, dtype=torch.float64)
    w = w * (0.5 + 2.5 * torch.rand(s, 1, generator=g, dtype=torch.float64))
    near = torch.randint(0, max(s, 1), (n,), generator=g)
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    if s:
        pull = 1.5 * math.sqrt(d) * torch.rand(n, 1, generator=g)
        x = x + pull * torch.nn.functional.normalize(w[near], dim=1)
    x_hat = torch.nn.functional.normalize(x, dim=1).float()
    w = w.float()
    w_inv_norm = 1.0 / w.norm(dim=1)
    # Mix: target at the nearby center, target elsewhere, and not owned by this shard (-1).
    kind = torch.randint(0, 3, (n,), generator=g)
    other = torch.randint(0, max(s, 1), (n,), generator=g)
    target = torch.where(kind == 0, near, torch.where(kind == 1, other, torch.full_like(near, -1)))
    if s == 0:
        target = torch.full((n,), -1, dtype=torch.int64)
    coef = torch.randn(n, generator=g).float()
    return [t.to(device) for t in (x_hat, w, w_inv_norm, target, coef)]


def _operands(x_hat, w, w_inv_norm, compute_dtype):
    """float64 copies of the dot operands, rounded to the compute dtype as the kernels round them.

    The kernels form w_hat = w * w_inv_norm in float32 and then round; doing the same here makes
    the rounded operands bit-identical, so only accumulation order and the rounding of G differ.
    """
    w_hat32 = w * w_inv_norm[:, None]
    if compute_dtype == torch.float32:
        return x_hat.double(), w.double() * w_inv_norm.double()[:, None]
    return x_hat.to(compute_dtype).double(), w_hat32.to(compute_dtype).double()


def _reference(x_hat, w, w_inv_norm, target, *, scale, threshold, compute_dtype):
    x_c, w_c = _operands(x_hat.cpu(), w.cpu(), w_inv_norm.cpu(), compute_dtype)
    cos = x_c @ w_c.T
    n, s = cos.shape
    excluded = torch.zeros(n, s, dtype=torch.bool)
    own = torch.nonzero(target.cpu() >= 0).squeeze(1)
    excluded[own, target.cpu()[own]] = True
    if threshold is not None:
        # float32 accumulation may move a cosine by ~1e-6: keep the filter decision unambiguous.
        assert (cos - threshold).abs().min() > 1e-5, "test data lands on the threshold; change seed"
        excluded |= cos > threshold
    z = (scale * cos).masked_fill(excluded, float("-inf"))
    m = z.amax(dim=1) if s else torch.full((n,), float("-inf"), dtype=torch.float64)
    shift = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    l = torch.exp(z - shift[:, None]).sum(dim=1)
    target_mask = torch.zeros(n, s, dtype=torch.bool)
    target_mask[own, target.cpu()[own]] = True
    max_cos = cos.masked_fill(target_mask, float("-inf")).amax(dim=1) if s else \
        torch.full((n,), float("-inf"), dtype=torch.float64)
    return dict(x_c=x_c, w_c=w_c, z=z, excluded=excluded, m=m, l=l, max_cos=max_cos)


def _reference_grad(ref, x_hat, w, coef, row_max):
    """dx_hat = G @ w_hat, and dw through w_hat = w / ||w|| by autograd (not the closed form)."""
    g = coef.cpu().double()[:, None] * torch.exp(ref["z"] - row_max.cpu().double()[:, None])
    g = g.masked_fill(ref["excluded"], 0.0)
    dx_hat = g @ ref["w_c"]
    w64 = w.cpu().double().requires_grad_()
    w_hat = w64 / w64.norm(dim=1, keepdim=True)
    # The kernels use the rounded w_hat in the product, the exact one in the projection:
    # d/dw of <G^T x_c, w_hat> is exactly that projection of dw_hat = G^T x_c.
    (dw,) = torch.autograd.grad((g.T @ ref["x_c"] * w_hat).sum(), w64)
    return g, dx_hat, dw


def _assert_bounded(actual, expected, bound, name):
    err = (actual.cpu().double() - expected).abs()
    worst = (err - bound).max().item() if err.numel() else 0.0
    assert worst <= 0, f"{name}: error exceeds its bound by {worst:.3g} (max error {err.max().item():.3g})"


def _check(n, s, d, *, scale, threshold, compute_dtype, want_max_cos, seed, target=None, block_bytes=None,
           coef_scale=1.0, keep=False):
    """lse_stats and the backward against float64. ``keep``: the forward keeps the cosines
    (rounded to float16 for bf16/fp16 products) and the backward is grad_kept's G pass over
    them, whose extra error is that rounding: ``scale * 2**-12`` in a logit, i.e. a relative
    ``exp(scale * 2**-12) - 1`` in G, and ``2**-12`` per cosine in rho."""
    x_hat, w, w_inv_norm, tgt, coef = _data(n, s, d, seed=seed)
    coef = coef * coef_scale
    if target is not None:
        tgt = torch.as_tensor(target, dtype=torch.int64, device=DEVICE)
    kw = dict(scale=scale, threshold=threshold, compute_dtype=compute_dtype)
    ref = _reference(x_hat, w, w_inv_norm, tgt, **kw)

    exp = keep == "exp"
    if exp:
        kept = torch.full((s, n), float("nan"), dtype=torch.bfloat16, device=DEVICE)
        m, l, max_cos = ts.exp_stats(x_hat, w, w_inv_norm, tgt, want_max_cos=want_max_cos, keep=kept, **kw)
    else:
        kept = torch.full((s, n), float("nan"), dtype=ts.keep_dtype(compute_dtype), device=DEVICE) if keep else None
        m, l, max_cos = ts.lse_stats(x_hat, w, w_inv_norm, tgt, want_max_cos=want_max_cos, keep=kept, **kw)
    assert m.dtype == l.dtype == torch.float32 and m.shape == l.shape == (n,)
    if exp:
        # E = exp(z - scale / 2) rounded once to bf16 (0 where excluded), the shift fixed: the
        # statistics are then m = scale / 2 and l = sum E (float32), the same log-sum-exp.
        e_ref = torch.exp(ref["z"] - scale / 2).T
        # Below 2**-126 (z < scale / 2 - 87.3) entries are subnormal or flush to 0 (exp_scale_bound).
        torch.testing.assert_close(kept.cpu().double(), e_ref, rtol=_RTOL + 2.0 ** -8, atol=2.0 ** -126)
        assert bool((kept.cpu()[ref["excluded"].T] == 0).all())
        lse_ref = ref["m"] + torch.log(ref["l"])
        lse = m.cpu().double() + torch.log(l.cpu().double())
        assert bool((torch.isinf(lse) == torch.isinf(lse_ref)).all())
        fin = torch.isfinite(lse_ref)
        torch.testing.assert_close(lse[fin], lse_ref[fin], rtol=0, atol=_RTOL * 2)
    elif keep:
        # Every cosine, class-major, rounded once to the kept dtype from the float32 accumulation.
        cos64 = ref["x_c"] @ ref["w_c"].T
        if threshold is not None:     # filtered negatives are stored as +inf (the targets never are)
            cos64 = cos64.masked_fill(cos64 > threshold, float("inf"))
        torch.testing.assert_close(kept.cpu().double(), cos64.T.to(kept.dtype).double(), rtol=0,
                                   atol=2.0 ** -11 if kept.dtype == torch.float16 else 1e-6)
    # Forward statistics see only rounded operands (identical to the reference's) and float32
    # accumulation, so the fp32 tolerance applies to every compute dtype.
    if not exp:
        torch.testing.assert_close(m.cpu().double(), ref["m"], rtol=_RTOL, atol=_RTOL * scale * 0.1)
        torch.testing.assert_close(l.cpu().double(), ref["l"], rtol=_RTOL * 2, atol=1e-6)
    if want_max_cos:
        torch.testing.assert_close(max_cos.cpu().double(), ref["max_cos"], rtol=0, atol=1e-5)
    else:
        assert max_cos is None

    # A row max of at least the largest kept logit, as the caller's (which includes the target).
    g_gen = torch.Generator().manual_seed(seed + 1)
    base = torch.where(torch.isinf(ref["m"]), torch.full_like(ref["m"], scale * 0.5), ref["m"])
    row_max = (base + torch.rand(n, generator=g_gen, dtype=torch.float64)).float().to(DEVICE)
    if exp:
        dx_hat, dw = ts.grad_exp(kept, x_hat, w, w_inv_norm, coef, row_max, scale=scale, compute_dtype=compute_dtype)
    elif keep:
        dx_hat, dw = ts.grad_kept(kept, x_hat, w, w_inv_norm, tgt, coef, row_max, **kw)
    else:
        dx_hat, dw = ts.grad(x_hat, w, w_inv_norm, tgt, coef, row_max, block_bytes=block_bytes, **kw)
    assert dx_hat.shape == (n, d) and dw.shape == (s, d)
    assert dx_hat.dtype == dw.dtype == torch.float32
    g, dx_ref, dw_ref = _reference_grad(ref, x_hat, w, coef, row_max)

    # Elementwise error bounds: each output is a sum of G entries times operand entries; G
    # carries ~_RTOL from the recomputed exp plus the rounding of G to the compute dtype
    # (relative _ROUNDOFF, or absolute _UNDERFLOW for float16 subnormals) before the second dot.
    half_ulp = 2.0 ** -12 if keep is True and compute_dtype != torch.float32 else 0.0
    u = _RTOL + _ROUNDOFF[compute_dtype] + math.expm1(scale * half_ulp)
    under = _UNDERFLOW[compute_dtype] * coef.abs().max().item()
    abs_w, abs_x = ref["w_c"].abs(), ref["x_c"].abs()
    dx_bound = u * (g.abs() @ abs_w) + under * abs_w.sum(0) + 1e-7 * coef_scale
    _assert_bounded(dx_hat, dx_ref, dx_bound, "dx_hat")
    # dw = P(dw_hat) / ||w|| with P = I - w_hat w_hat^T: |P e|_i <= |e_i| + |w_hat_i| * ||e||_2.
    # exp-kept: the bf16 operand is x_hat * a rounded once (not x_hat rounded, then scaled):
    # one more bf16 rounding against the reference's x_c; rho is exact for that dw_hat.
    e = (u + (2.0 ** -8 if exp else 0.0)) * (g.abs().T @ abs_x) + under * abs_x.sum(0) + 1e-7
    w_hat = w.cpu().double() * w_inv_norm.cpu().double()[:, None]
    # rho from kept cosines: each G entry times a cosine off by up to half an ulp.
    rho_err = (half_ulp * g.abs().sum(0))[:, None]
    dw_bound = (e + w_hat.abs() * (e.norm(dim=1, keepdim=True) + rho_err)) * w_inv_norm.cpu().double()[:, None]
    _assert_bounded(dw, dw_ref, dw_bound + 1e-7 * coef_scale, "dw")
    if exp:
        # project=False (the row optimizers project in their update): the gradient of w_hat,
        # whose projection (float64, here) is the projected dw above.
        _, raw = ts.grad_exp(kept, x_hat, w, w_inv_norm, coef, row_max, scale=scale, compute_dtype=compute_dtype,
                             project=False)
        raw = raw.cpu().double()
        projected = (raw - w_hat * (w_hat * raw).sum(1, keepdim=True)) * w_inv_norm.cpu().double()[:, None]
        torch.testing.assert_close(dw.cpu().double(), projected, rtol=1e-5, atol=1e-6 * dw.abs().max().item() + 1e-12)
    return dict(ref, g=g, dx_hat=dx_hat, dw=dw, dx_ref=dx_ref, dw_ref=dw_ref)


CASES = [
    # n, s, d, scale, threshold, compute dtype, want_max_cos
    (37, 129, 40, 64.0, None, torch.float32, True),
    (70, 50, 24, 30.0, 0.2, torch.float32, False),
    (1, 129, 64, 64.0, 0.2, torch.float32, True),
    (70, 129, 64, 64.0, 0.2, torch.float32, True),
    (37, 1, 24, 30.0, None, torch.float32, True),
    (37, 129, 64, 64.0, 0.2, torch.bfloat16, True),
    (70, 50, 24, 30.0, None, torch.bfloat16, False),
    (37, 50, 40, 30.0, 0.2, torch.float16, True),
]


@pytest.mark.parametrize("n,s,d,scale,threshold,compute_dtype,want_max_cos", CASES)
def test_matches_float64_reference(n, s, d, scale, threshold, compute_dtype, want_max_cos):
    ref = _check(n, s, d, scale=scale, threshold=threshold, compute_dtype=compute_dtype,
                 want_max_cos=want_max_cos, seed=n * 1000 + s * 10 + d)
    if threshold is not None and s > 1:
        # The data must exercise the filter on negatives, not only on targets.
        assert bool((ref["x_c"] @ ref["w_c"].T > threshold).any())



@pytest.mark.parametrize("n,s,d,scale,threshold,compute_dtype,want_max_cos", CASES)
def test_kept_cosines_match_float64_reference(n, s, d, scale, threshold, compute_dtype, want_max_cos):
    """The keep path: the forward stores every cosine, the backward's G pass runs over them in
    place, and cuBLAS-style products and a projection pass follow; same bounds plus the float16
    rounding of the kept cosines."""
    _check(n, s, d, scale=scale, threshold=threshold, compute_dtype=compute_dtype, want_max_cos=want_max_cos,
           seed=n * 1000 + s * 10 + d + 1, keep=True)


EXP_CASES = [c for c in CASES if c[5] == torch.bfloat16] + [
    (37, 129, 64, 64.0, 0.2, torch.bfloat16, False),
    (70, 50, 24, 30.0, None, torch.bfloat16, True),
    (37, 129, 40, 140.0, None, torch.bfloat16, True),
]


@pytest.mark.parametrize("n,s,d,scale,threshold,compute_dtype,want_max_cos", EXP_CASES)
def test_exp_kept_matches_float64_reference(n, s, d, scale, threshold, compute_dtype, want_max_cos):
    """The exp-kept path: the forward stores bf16 E = exp(scale cos - scale / 2) with a fixed
    shift and sums it without a running max; the backward is two products over E with the
    per-sample factors folded in and the tangent projection from dw_hat itself (no G pass).
    Bounds: the recompute path's plus one bf16 rounding of the dW operand."""
    _check(n, s, d, scale=scale, threshold=threshold, compute_dtype=compute_dtype, want_max_cos=want_max_cos,
           seed=n * 1000 + s * 10 + d + 2, keep="exp")


def test_exp_kept_splits_and_nothing_kept():
    if not ts._INTERPRET:
        pytest.skip("the interpreter's small tiles and splits")
    # Several class splits and sample tiles with ragged edges; sample 0 owns the only class
    # column of a one-class shard: nothing kept (lse = -inf, G = 0), sample 1 keeps it.
    _check(200, 72, 40, scale=64.0, threshold=0.2, compute_dtype=torch.bfloat16, want_max_cos=False, seed=33,
           keep="exp")
    _check(2, 1, 24, scale=64.0, threshold=None, compute_dtype=torch.bfloat16, want_max_cos=True, seed=7,
           target=[0, -1], keep="exp")


def test_exp_kept_validation():
    x_hat, w, w_inv_norm, tgt, coef = _data(5, 7, 16, seed=2)
    e = torch.zeros(7, 5, dtype=torch.bfloat16, device=DEVICE)
    kw = dict(threshold=None, want_max_cos=False)
    assert 140 < ts.exp_scale_bound(800_000) < 150 and ts.exp_scale_bound(2 ** 31) > 128
    with pytest.raises(ValueError, match="scale: the exp-kept path is exact for"):
        ts.exp_stats(x_hat, w, w_inv_norm, tgt, scale=200.0, compute_dtype=torch.bfloat16, keep=e, **kw)
    with pytest.raises(ValueError, match="compute_dtype: the exp-kept path needs bf16"):
        ts.exp_stats(x_hat, w, w_inv_norm, tgt, scale=64.0, compute_dtype=torch.float16,
                     keep=e.half(), **kw)
    with pytest.raises(TypeError, match="keep: expected dtype torch.bfloat16"):
        ts.exp_stats(x_hat, w, w_inv_norm, tgt, scale=64.0, compute_dtype=torch.bfloat16, keep=e.half(), **kw)
    with pytest.raises(ValueError, match="keep: expected a contiguous"):
        ts.grad_exp(torch.zeros(5, 7, dtype=torch.bfloat16, device=DEVICE).t(), x_hat, w, w_inv_norm, coef, coef,
                    scale=64.0, compute_dtype=torch.bfloat16)


@pytest.mark.parametrize("d,compute_dtype", [(64, torch.bfloat16), (1024, torch.float16), (100, torch.float32)])
def test_kept_cosines_embedding_widths(d, compute_dtype):
    # S = 17: two class tiles (the last one class), and five row groups of the prepare and
    # projection passes, the last ragged; their d-loops dominate the interpreter's time
    # (S = 37 took 5.6 s at d = 1024).
    _check(19, 17, d, scale=64.0, threshold=0.2, compute_dtype=compute_dtype, want_max_cos=True, seed=d + 3,
           keep=True)


@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.bfloat16])
def test_kept_cosines_large_batch_splits_the_samples(compute_dtype):
    # N = 200 over the interpreter's 64-sample split: the G pass's partial rho must add up
    # (S = 72: five class tiles, the last ragged, each in 4 sample splits).
    if not ts._INTERPRET:
        pytest.skip("the GPU's split is 4096 samples: the interpreter runs the small one")
    _check(200, 72, 40, scale=64.0, threshold=0.2, compute_dtype=compute_dtype, want_max_cos=False, seed=32,
           keep=True)


def test_kept_cosines_validation():
    x_hat, w, w_inv_norm, tgt, coef = _data(5, 7, 16, seed=2)
    kw = dict(scale=64.0, threshold=None, compute_dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="keep: expected dtype torch.float16"):
        ts.lse_stats(x_hat, w, w_inv_norm, tgt, want_max_cos=False, keep=torch.empty(7, 5, device=DEVICE), **kw)
    with pytest.raises(ValueError, match=r"keep: expected shape \[7, 5\]"):
        ts.lse_stats(x_hat, w, w_inv_norm, tgt, want_max_cos=False,
                     keep=torch.empty(5, 7, dtype=torch.float16, device=DEVICE), **kw)
    with pytest.raises(ValueError, match="kept: expected a contiguous"):
        ts.grad_kept(torch.empty(5, 7, dtype=torch.float16, device=DEVICE).t(), x_hat, w, w_inv_norm, tgt, coef,
                     coef, **kw)


@pytest.mark.parametrize("d,compute_dtype", [(64, torch.bfloat16), (100, torch.float32), (256, torch.float16),
                                             (512, torch.bfloat16), (1024, torch.float32)])
def test_embedding_widths(d, compute_dtype):
    """The K-loop over d covers every width: multiples of the K step, ragged ones, and 1024."""
    _check(19, 37, d, scale=64.0, threshold=0.2, compute_dtype=compute_dtype, want_max_cos=True, seed=d)

@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.bfloat16])
def test_sample_with_nothing_kept(compute_dtype):
    # S == 1: sample 0's only column is its target, so m = -inf, l = 0, G = 0 for it, while
    # sample 1 (not owned) keeps the column.
    ref = _check(2, 1, 24, scale=64.0, threshold=None, compute_dtype=compute_dtype,
                 want_max_cos=True, seed=7, target=[0, -1])
    assert ref["m"][0] == float("-inf") and math.isfinite(ref["m"][1])
    x_hat, w, w_inv_norm, _, coef = _data(2, 1, 24, seed=7)
    tgt = torch.tensor([0, -1], device=DEVICE)
    m, l, max_cos = ts.lse_stats(x_hat, w, w_inv_norm, tgt, scale=64.0, threshold=None,
                                 compute_dtype=compute_dtype, want_max_cos=True)
    # Sample 0's only class is its target: no other cosine to compare with.
    assert m[0].item() == float("-inf") and l[0].item() == 0.0 and max_cos[0].item() == float("-inf")
    assert math.isfinite(max_cos[1].item())
    # An infinite row max must not turn into nan either.
    row_max = torch.tensor([float("-inf"), 0.0], device=DEVICE)
    dx_hat, dw = ts.grad(x_hat, w, w_inv_norm, tgt, coef, row_max, scale=64.0, threshold=None,
                         compute_dtype=compute_dtype)
    assert torch.isfinite(dx_hat).all() and torch.isfinite(dw).all()
    assert (dx_hat[0] == 0).all()


def test_everything_filtered_in_some_splits():
    # A low threshold with many class tiles leaves whole splits empty for some rows, which the
    # partial combine must treat as neutral (no nan from -inf - -inf).
    _check(37, 129, 24, scale=64.0, threshold=0.0, compute_dtype=torch.float32,
           want_max_cos=True, seed=11)


@pytest.mark.parametrize("n,s", [(0, 50), (37, 0), (0, 0)])
def test_empty(n, s):
    x_hat, w, w_inv_norm, tgt, coef = _data(n, s, 24, seed=3)
    m, l, max_cos = ts.lse_stats(x_hat, w, w_inv_norm, tgt, scale=64.0, threshold=0.2,
                                 compute_dtype=torch.float32, want_max_cos=True)
    assert m.shape == l.shape == max_cos.shape == (n,)
    assert (m == float("-inf")).all() and (l == 0).all() and (max_cos == float("-inf")).all()
    dx_hat, dw = ts.grad(x_hat, w, w_inv_norm, tgt, coef, torch.zeros(n, device=DEVICE),
                         scale=64.0, threshold=0.2, compute_dtype=torch.float32)
    assert dx_hat.shape == (n, 24) and dw.shape == (s, 24)
    assert (dx_hat == 0).all() and (dw == 0).all()


@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.bfloat16])
def test_gradient_in_several_blocks(compute_dtype):
    # block_bytes of G holding 16 classes (a bf16 block of 16 x 37 x 2 bytes): S = 129 runs in
    # 9 blocks, the last ragged; every block's G, dX product and dW tile must line up.
    item = torch.empty((), dtype=compute_dtype).element_size()
    _check(37, 129, 40, scale=64.0, threshold=0.2, compute_dtype=compute_dtype, want_max_cos=False,
           seed=21, block_bytes=16 * 37 * item)


@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.bfloat16])
def test_large_batch_splits_the_samples(compute_dtype):
    # N = 200 over samples_per_split (64 here: the interpreter's) runs the G and dW kernels in 4
    # sample splits, the last ragged, in 3 class blocks (S = 72 in blocks of 32: two class
    # tiles each, the last block one ragged tile): their partial rho and dW must add up.
    if not ts._INTERPRET:
        pytest.skip("the GPU's split is 4096 samples: the interpreter runs the small one")
    assert 2 * ts.samples_per_split(compute_dtype) < 200 < 4 * ts.samples_per_split(compute_dtype)
    item = torch.empty((), dtype=compute_dtype).element_size()
    assert ts.block_classes(200, 72, compute_dtype, 32 * 200 * item) == 32
    _check(200, 72, 40, scale=64.0, threshold=0.2, compute_dtype=compute_dtype, want_max_cos=False,
           seed=32, block_bytes=32 * 200 * item)


@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float16])
def test_reduced_precision_and_strided_centers(w_dtype):
    """Centers stored in bf16/fp16 and with a row stride (a view into a wider table) are taken as
    they are: prepare normalises them in float32 and the results match float64 on those values."""
    n, s, d = 23, 45, 40
    x_hat, w, _, tgt, coef = _data(n, s, d, seed=5)
    wide = torch.zeros(s, d + 8, dtype=w_dtype, device=DEVICE)
    wide[:, 3:3 + d] = w.to(w_dtype)
    view = wide[:, 3:3 + d]
    assert not view.is_contiguous()
    w_exact = view.float()                      # the values the kernels see, exactly
    w_inv = 1.0 / w_exact.double().norm(dim=1)
    w_hat_c, inv = ts.prepare(view, torch.bfloat16)
    torch.testing.assert_close(inv.double().cpu(), w_inv.cpu(), rtol=1e-6, atol=0)
    ref_hat = (w_exact.double() * w_inv[:, None]).to(torch.bfloat16)
    assert torch.equal(w_hat_c.cpu(), ref_hat.cpu())   # rounded to nearest, as the GPU casts
    kw = dict(scale=64.0, threshold=None, compute_dtype=torch.bfloat16)
    m, l, _ = ts.lse_stats(x_hat, view, None, tgt, want_max_cos=False, **kw)
    m32, l32, _ = ts.lse_stats(x_hat, w_exact.contiguous(), inv, tgt, want_max_cos=False, **kw)
    torch.testing.assert_close(m, m32, rtol=0, atol=0)
    torch.testing.assert_close(l, l32, rtol=1e-6, atol=0)
    row_max = m + 1.0
    dx, dw = ts.grad(x_hat, view, None, tgt, coef, row_max, **kw)
    dx32, dw32 = ts.grad(x_hat, w_exact.contiguous(), inv, tgt, coef, row_max, **kw)
    torch.testing.assert_close(dx, dx32, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(dw, dw32, rtol=1e-6, atol=1e-7)


def test_float16_keeps_initialisation_sized_gradients():
    """At initialisation G = scale p / N is ~5e-9 (N = 2048, millions of classes), below float16's
    smallest subnormal (6e-8): cast as it is, every negative's gradient would be 0. Stored
    relative to the largest row coefficient it keeps float16's relative precision, so dx_hat and
    dw match float64 to the float16 bound scaled down with coef."""
    out = _check(37, 129, 40, scale=64.0, threshold=None, compute_dtype=torch.float16, want_max_cos=False,
                 seed=31, coef_scale=5e-9)
    g = out["g"]
    assert g.abs().max().item() < 6e-8                       # the whole G lies below float16's range
    nonzero = out["dw_ref"].abs() > 0
    rel = ((out["dw"].cpu().double() - out["dw_ref"]).abs()[nonzero] / out["dw_ref"].abs()[nonzero])
    assert (out["dw"].cpu() != 0).float().mean().item() > 0.99   # nothing flushed to zero
    assert rel.median().item() < 1e-2


def test_auto_never_picks_a_backend_that_refuses():
    """Whatever backend="auto" picks on a CUDA device for a compute dtype, center dtype, layout and
    width, the chosen kernels accept those inputs (run here in the interpreter)."""
    from ds_pfc.core.margins import ArcFace
    from ds_pfc.core.softmax import default_compute_dtype, resolve_backend
    # what auto picks per GPU family: test_devices.py (mocked compute capabilities)
    assert default_compute_dtype("cpu", torch.float32) == torch.float32
    assert default_compute_dtype("cuda", torch.float64) == torch.float64
    picked = set()
    for compute in (torch.float32, torch.bfloat16, torch.float16):
        for w_dtype in (torch.float32, torch.bfloat16, torch.float16):
            for strided in (False, True):
                for d in (16, 40):
                    backend = resolve_backend("auto", "cuda", compute, torch.float32, ArcFace())
                    picked.add((compute, backend))
                    if backend != "triton":
                        continue
                    x_hat, w, _, tgt, coef = _data(9, 11, d, seed=d)
                    w = w.to(w_dtype)
                    if strided:
                        w = torch.cat([w, w], dim=1)[:, :d]
                    m, l, _ = ts.lse_stats(x_hat, w, None, tgt, scale=64.0, threshold=None,
                                           compute_dtype=compute, want_max_cos=True)
                    dx, dw = ts.grad(x_hat, w, None, tgt, coef, m + 1.0, scale=64.0, threshold=None,
                                     compute_dtype=compute)
                    assert torch.isfinite(dx).all() and torch.isfinite(dw).all()
    # float32 products go to cuBLAS (faster than an FMA kernel), bf16/fp16 to the kernels.
    assert picked == {(torch.float32, "torch"), (torch.bfloat16, "triton"), (torch.float16, "triton")}


def test_splits_cover_classes_without_empty_programs():
    dev = torch.device(DEVICE)
    for held_tiles in (1, 3, 1000):
        for stream_tiles in (1, 2, 9, 97, 100_000):
            splits, per = ts._split(held_tiles, stream_tiles, dev)
            assert 1 <= splits <= stream_tiles
            assert (splits - 1) * per < stream_tiles <= splits * per
    # The small test shapes do run several splits under the interpreter.
    assert ts._split(1, 9, dev)[0] > 1


def test_tile_table():
    for kernel in ("lse", "lse_max", "g", "dw", "prep"):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for interpret in (False, True):
                a, b, k, warps, stages = ts.tile_config(kernel, dtype, interpret)
                for block in (a, b) + ((k,) if kernel != "prep" else ()):
                    assert block >= (1 if kernel == "prep" else 16) and block & (block - 1) == 0
                assert warps >= 1 and stages >= 1
    # FLOP per byte of L2 traffic in bf16: the forward's four B tiles share each A slice (2 A (4B)
    # K FLOP for (A + 4B) K 2-byte operands: 85 at 128 x 256), the dW kernel's four dim tiles
    # likewise, and the G kernel's two sample tiles (64 at 128 x 128); 64 is the floor.
    intensity = {}
    for kernel, parts in (("lse", 4), ("lse_max", 4), ("g", 2), ("dw", 4)):
        a, b, k, _, _ = ts.tile_config(kernel, torch.bfloat16, interpret=False)
        intensity[kernel] = 2 * a * parts * b * k / ((a + parts * b) * k * 2)
    assert min(intensity.values()) >= 64 and intensity["lse"] >= 80, intensity


def test_validation():
    x_hat, w, w_inv_norm, tgt, coef = _data(4, 5, 24, seed=1)
    kw = dict(scale=64.0, threshold=None, compute_dtype=torch.float32, want_max_cos=False)
    with pytest.raises(ValueError, match="w:"):
        ts.lse_stats(x_hat, w[:, :16].contiguous(), w_inv_norm, tgt, **kw)
    with pytest.raises(ValueError, match="target_col"):
        ts.lse_stats(x_hat, w, w_inv_norm, tgt[:3], **kw)
    with pytest.raises(TypeError, match="target_col"):
        ts.lse_stats(x_hat, w, w_inv_norm, tgt.int(), **kw)
    with pytest.raises(TypeError, match="x_hat"):
        ts.lse_stats(x_hat.double(), w, w_inv_norm, tgt, **kw)
    with pytest.raises(ValueError, match="w_inv_norm"):
        ts.lse_stats(x_hat, w, w_inv_norm[:4], tgt, **kw)
    with pytest.raises(ValueError, match="w:"):
        ts.lse_stats(x_hat, w.t(), w_inv_norm, tgt, **kw)
    with pytest.raises(TypeError, match="compute_dtype"):
        ts.lse_stats(x_hat, w, w_inv_norm, tgt, **{**kw, "compute_dtype": torch.float64})
    with pytest.raises(ValueError, match="coef"):
        ts.grad(x_hat, w, w_inv_norm, tgt, coef[:2], coef, scale=64.0, threshold=None,
                compute_dtype=torch.float32)
    with pytest.raises(TypeError, match="row_max"):
        ts.grad(x_hat, w, w_inv_norm, tgt, coef, coef.double(), scale=64.0, threshold=None,
                compute_dtype=torch.float32)


def test_check_device_message(monkeypatch):
    assert ts.available()
    monkeypatch.setattr(ts, "_INTERPRET", False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        ts.check_device(torch.zeros(1))


# Compiles the kernels for Hopper (sm_90) with the launch parameters of the GPU tile table, in a
# subprocess: this module imported the kernels in interpreter mode. Needs no GPU, only Triton's
# compiler and the ptxas / cuobjdump bundled with it. Runs shard ``argv[1]`` of ``argv[2]`` and
# prints one JSON line per compiled kernel.
_COMPILE_SM90 = textwrap.dedent("""
    import json, os, re, subprocess, sys, tempfile
    os.environ.pop("TRITON_INTERPRET", None)
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from ds_pfc.kernels import triton_softmax as K

    try:
        cuobjdump = triton.knobs.nvidia.cuobjdump.path
        triton.knobs.nvidia.ptxas_blackwell.path  # what Triton uses for sm_90
    except (AttributeError, RuntimeError) as e:
        print("UNUSABLE:", repr(e))
        sys.exit(3)

    DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    PTR = {"float32": "*fp32", "bfloat16": "*bf16", "float16": "*fp16"}
    BLOCKS = {"lse": ("BLOCK_N", "BLOCK_S", "BLOCK_K"), "lse_max": ("BLOCK_N", "BLOCK_S", "BLOCK_K"), "g": ("BLOCK_S", "BLOCK_N", "BLOCK_K"),
              "dw": ("BLOCK_S", "BLOCK_D", "BLOCK_K"), "prep": ("ROWS", "BLOCK_D", None),
              "gpass": ("BLOCK_S", "BLOCK_N", None), "proj": ("ROWS", "BLOCK_D", None)}
    KERNELS = {"lse": K._lse_kernel, "lse_max": K._lse_kernel, "g": K._g_kernel, "dw": K._dw_kernel, "prep": K._prep_kernel,
               "gpass": K._g_pass_kernel, "proj": K._project_kernel,
               "exp": K._lse_exp_kernel, "exp_max": K._lse_exp_kernel}
    # The exp-kept forward runs on the forward's tiles (with max_cos: the narrower ones).
    TILE = {"exp": "lse", "exp_max": "lse_max"}
    BLOCKS.update(exp=BLOCKS["lse"], exp_max=BLOCKS["lse"])
    # Pointers in the compute dtype (the rest float32; targets int64; centers read by dw/prep as float32).
    COMPUTE_PTRS = {"x_ptr", "g_ptr", "wc_ptr"}
    KEEP_PTR = {"float32": "*fp32", "bfloat16": "*fp16", "float16": "*fp16"}    # the kept cosines

    def compile_sm90(name, dtype, **flags):
        kernel = KERNELS[name]
        a, b, k, num_warps, num_stages = K.tile_config(TILE.get(name, name), DTYPES[dtype], interpret=False)
        values = dict(flags, UPCAST=False, PRECISION="ieee", COMPUTE=K._TL_DTYPES[DTYPES[dtype]],
                      SPLIT_N=K.samples_per_split(DTYPES[dtype], interpret=False),
                      KEEP=K._TL_DTYPES[K.keep_dtype(DTYPES[dtype])])
        for key, v in zip(BLOCKS[name], (a, b, k)):
            if key:
                values[key] = v
        if name == "prep" and flags.get("ONE_PASS"):      # whole rows at the standard d = 512
            values["ROWS"], values["BLOCK_D"], _ = K.prep_shape(512, DTYPES[dtype], interpret=False)
            a, b = values["ROWS"], values["BLOCK_D"]
        constexprs = {p.name: values[p.name] for p in kernel.params if p.is_constexpr}
        if "stride_c" in kernel.arg_names:
            constexprs["stride_c"] = 1            # a real launch specialises a unit stride
        signature, attrs = {}, {}
        for i, arg in enumerate(kernel.arg_names):
            if arg in constexprs:
                signature[arg] = "constexpr"
                continue
            if arg.endswith("_ptr"):
                compute = arg in COMPUTE_PTRS or (arg == "w_ptr" and name in ("lse", "lse_max", "g", "exp", "exp_max"))
                signature[arg] = ("*i64" if arg in ("tgt_ptr", "idx_ptr") else KEEP_PTR[dtype] if arg == "cos_ptr"
                                  else "*bf16" if arg == "e_ptr" else PTR[dtype] if compute else "*fp32")
            else:
                signature[arg] = "fp32" if arg in ("scale", "shift", "threshold", "eps") else "i32"
            # As Triton specialises a launch at the standard shape: 16-byte aligned pointers and
            # d, N and the row stride multiples of 16 (S and block sizes need not be).
            if arg.endswith("_ptr") or arg in ("d", "N", "stride_r"):
                attrs[(i,)] = [["tt.divisibility", 16]]
        compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs),
                                  target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": num_warps, "num_stages": num_stages})
        cubin = compiled.asm.get("cubin") or b""
        # Registers and local memory as the driver would report them (Triton's n_regs and
        # n_spills = CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES / 4, i.e. ptxas's stack frame in words),
        # and the tensor-core instructions of the SASS: HGMMA is Hopper's wgmma, HMMA mma.sync.
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "kernel.cubin")
            with open(path, "wb") as f:
                f.write(cubin)
            usage = subprocess.run([cuobjdump, "--dump-resource-usage", path], capture_output=True,
                                   text=True, check=True).stdout
            sass = subprocess.run([cuobjdump, "-sass", path], capture_output=True, text=True, check=True).stdout
        field = lambda key: int(re.search(key + r":(\\d+)", usage).group(1))
        return dict(kernel=name, dtype=dtype, flags=flags, config=[a, b, k, num_warps, num_stages],
                    cubin=len(cubin), shared=compiled.metadata.shared, regs=field("REG"),
                    spills=(field("STACK") + field("LOCAL")) // 4,
                    hgmma=sass.count("HGMMA"), hmma=sass.count("HMMA"))

    jobs = []
    for dtype in DTYPES:
        # What lse_stats launches: the running max of the cosines only with a threshold, on
        # the lse_max tiles; without one it is the log-sum-exp's own max.
        jobs.append(("lse_max", dtype, dict(HAS_THRESHOLD=True, WANT_MAX_COS=True, STORE_COS=False)))
        for threshold in (True, False):
            jobs.append(("lse", dtype, dict(HAS_THRESHOLD=threshold, WANT_MAX_COS=False, STORE_COS=False)))
            jobs.append(("g", dtype, dict(HAS_THRESHOLD=threshold)))
        jobs.append(("dw", dtype, dict(PROJECT=True)))
        jobs.append(("prep", dtype, dict(HAS_IDX=False, ONE_PASS=False)))
        jobs.append(("prep", dtype, dict(HAS_IDX=True, ONE_PASS=True)))
        # The kept-cosine path: the forward with its side store, the in-place G pass.
        jobs.append(("lse", dtype, dict(HAS_THRESHOLD=True, WANT_MAX_COS=False, STORE_COS=True)))
        jobs.append(("gpass", dtype, dict(HAS_THRESHOLD=True)))
        if dtype == "bfloat16":
            jobs.append(("lse", dtype, dict(HAS_THRESHOLD=False, WANT_MAX_COS=False, STORE_COS=True)))
            jobs.append(("lse_max", dtype, dict(HAS_THRESHOLD=True, WANT_MAX_COS=True, STORE_COS=True)))
            jobs.append(("gpass", dtype, dict(HAS_THRESHOLD=False)))
            jobs.append(("proj", dtype, dict(RHO_FROM_DW=False)))   # no compute-dtype operand: one build covers all
            # The exp-kept path (bf16 only): the forward storing E, and rho summed by the projection.
            jobs.append(("exp", dtype, dict(HAS_THRESHOLD=True, WANT_MAX_COS=False)))
            jobs.append(("exp", dtype, dict(HAS_THRESHOLD=False, WANT_MAX_COS=False)))
            jobs.append(("exp_max", dtype, dict(HAS_THRESHOLD=True, WANT_MAX_COS=True)))
            jobs.append(("proj", dtype, dict(RHO_FROM_DW=True)))
    shard, shards = int(sys.argv[1]), int(sys.argv[2])
    for name, dtype, flags in jobs[shard::shards]:
        print(json.dumps(compile_sm90(name, dtype, **flags)), flush=True)
""")

# Hopper limits: dynamic shared memory per block (227 KiB, what Triton checks against the
# device's opt-in maximum at launch) and registers per thread.
_SM90_SHARED = 232448
_SM90_REGS = 255
# float32 rows (FMA; served on explicit request only) may park a few values; bf16/fp16 must not.
_MAX_SPILLS = {"float32": 64, "bfloat16": 0, "float16": 0}


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="with CUDA the other tests compile and run the kernels on the GPU")
def test_kernels_compile_for_sm90():
    """Every kernel, compute dtype and threshold on/off compiles for sm_90 with its tile-table row:
    fits Hopper's shared memory and registers, spills nothing in bf16/fp16, and its products
    run on wgmma (HGMMA), not Ampere's mma.sync (HMMA, half the rate)."""
    pytest.importorskip("triton.compiler", reason="needs Triton's compiler API")
    env = dict(os.environ, TRITON_DEFAULT_FP_FUSION=os.environ.get("TRITON_DEFAULT_FP_FUSION", "1"))
    env.pop("TRITON_INTERPRET", None)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    shards = max(1, min(4, os.cpu_count() or 1))
    procs = [subprocess.Popen([sys.executable, "-c", _COMPILE_SM90, str(i), str(shards)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                              cwd=root)
             for i in range(shards)]
    results = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        if proc.returncode and "No module named" in err and "triton" in err:
            pytest.skip(f"Triton's compiler is not usable here: {err.strip().splitlines()[-1]}")
        if proc.returncode == 3 and out.startswith("UNUSABLE:"):
            pytest.skip(f"Triton's bundled CUDA tools are not usable here: {out.strip()}")
        assert proc.returncode == 0, err[-3000:]
        results += [json.loads(line) for line in out.splitlines() if line.startswith("{")]

    assert len(results) == 3 * (1 + 2 + 2 + 1 + 2 + 2) + 4 + 4
    problems = []
    for r in results:
        what = f"{r['kernel']} {r['dtype']} {r['flags']} row={r['config']}"
        if not r["cubin"]:
            problems.append(f"{what}: no cubin")
        if r["shared"] > _SM90_SHARED:
            problems.append(f"{what}: {r['shared']} bytes of shared memory > {_SM90_SHARED}")
        if r["regs"] > _SM90_REGS:
            problems.append(f"{what}: {r['regs']} registers > {_SM90_REGS}")
        if r["spills"] > _MAX_SPILLS[r["dtype"]]:
            problems.append(f"{what}: {r['spills']} spilled words > {_MAX_SPILLS[r['dtype']]} ({r['regs']} registers)")
        if r["kernel"] not in ("prep", "gpass", "proj") and r["dtype"] != "float32" \
                and (r["hgmma"] == 0 or r["hmma"] > 0):
            problems.append(f"{what}: tensor-core products not on wgmma (HGMMA {r['hgmma']}, HMMA {r['hmma']})")
    assert not problems, "\n".join(problems)


def test_every_launch_runs_on_the_tensors_device(monkeypatch):
    """Triton launches on the current CUDA device; every kernel launch of the softmax and the row
    optimizer must happen inside on_device(tensors' device). Checked by recording the device that
    is entered and refusing any launch outside it."""
    import contextlib
    from triton.runtime import interpreter
    from ds_pfc.kernels import triton_optim as to
    entered = []

    @contextlib.contextmanager
    def recording(device):
        entered.append(device)
        try:
            yield
        finally:
            entered.pop()

    launches = []
    original = interpreter.InterpretedFunction.run

    def run(fn, *args, **kwargs):
        assert entered, f"{fn.__name__} launched outside on_device"
        launches.append((fn.__name__, entered[-1]))
        return original(fn, *args, **kwargs)

    monkeypatch.setattr(ts, "on_device", recording)
    monkeypatch.setattr(to, "on_device", recording)
    monkeypatch.setattr(interpreter.InterpretedFunction, "run", run)
    x_hat, w, w_inv_norm, tgt, coef = _data(9, 11, 24, seed=2)
    kw = dict(scale=64.0, threshold=None, compute_dtype=torch.bfloat16)
    m, _, _ = ts.lse_stats(x_hat, w, None, tgt, want_max_cos=False, **kw)
    ts.grad(x_hat, w, None, tgt, coef, m + 1.0, **kw)
    mom = torch.zeros_like(w)
    to.sgd_rows_(w, mom, torch.arange(3, device=DEVICE), torch.ones(3, 24, device=DEVICE), lr=0.1, momentum=0.9,
                 weight_decay=0.0, nesterov=False)
    names = {name for name, _ in launches}
    assert {"_prep_kernel", "_lse_kernel", "_g_kernel", "_dw_kernel", "_sgd_rows_kernel"} <= names
    assert all(dev == torch.device(DEVICE) for _, dev in launches)


def test_on_device_selects_the_tensors_cuda_device(monkeypatch):
    from ds_pfc.kernels import _device
    chosen = []

    class Fake:
        def __init__(self, device):
            chosen.append(device)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(_device.torch.cuda, "device", Fake)
    with _device.on_device(torch.device("cuda:1")):
        pass
    with _device.on_device(torch.device("cpu")):
        pass
    assert chosen == [torch.device("cuda:1")]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_float16_products_keep_tiny_gradients_end_to_end(backend):
    """Both backends through margin_softmax_cross_entropy with float16 products: a loss scaled so
    that every negative's gradient is ~1e-9 (as at initialisation with millions of classes) still
    gets float16-accurate center and embedding gradients, against the same call in float64."""
    from ds_pfc.core.margins import ArcFace
    from ds_pfc.core.softmax import margin_softmax_cross_entropy
    g = torch.Generator().manual_seed(3)
    n, s, d = 24, 300, 32
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    w = torch.randn(s, d, generator=g, dtype=torch.float64)
    target = torch.randint(0, s, (n,), generator=g)
    grads = {}
    for dtype, compute, bk in ((torch.float64, None, "torch"), (torch.float32, torch.float16, backend)):
        xs = x.to(DEVICE, dtype).detach().clone().requires_grad_()
        ws = w.to(DEVICE, dtype).detach().clone().requires_grad_()
        out = margin_softmax_cross_entropy(xs, ws, target.to(DEVICE), ArcFace(), compute_dtype=compute, backend=bk)
        (out.loss * 1e-9).backward()      # G = 64 p / N * 1e-9 ~ 1e-11
        grads[dtype] = (xs.grad.cpu().double(), ws.grad.cpu().double())
    (dx64, dw64), (dx16, dw16) = grads[torch.float64], grads[torch.float32]
    negatives = torch.ones(s, dtype=torch.bool)
    negatives[target] = False
    assert dw64[negatives].abs().max().item() < 1e-9        # far below float16's smallest subnormal
    for got, ref in ((dw16[negatives], dw64[negatives]), (dx16, dx64)):
        err = (got - ref).norm() / ref.norm()
        assert err.item() < 2e-2, f"relative error {err.item():.3g}"


@pytest.mark.parametrize("compute_dtype,kept", [(torch.float32, "grad_kept"), (torch.bfloat16, "grad_exp"),
                                                (torch.bfloat16, "grad_kept")])
def test_softmax_keeps_cosines_within_the_budget(monkeypatch, compute_dtype, kept):
    """Through the autograd function: a training step within keep_bytes runs grad_exp (bf16
    products within the exp-kept scale bound) or grad_kept (otherwise; here bf16 with the bound
    lowered below the scale), one over the budget or with keep_bytes=0 runs grad; all match a
    CosFace loss in float64 by autograd; a second backward (retain_graph) finds the kept tensor
    spent and recomputes."""
    from ds_pfc.core.margins import CosFace
    from ds_pfc.core.softmax import margin_softmax_cross_entropy
    n, s, d = 29, 53, 40
    x_hat, w, _, _, _ = _data(n, s, d, seed=41)
    tgt = torch.randint(0, s, (n,), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    # float32: roundoff only; bf16 products and float16 kept cosines: G within ~2% per entry
    tol = 1e-4 if compute_dtype == torch.float32 else 5e-2
    calls = []
    if compute_dtype == torch.bfloat16 and kept == "grad_kept":
        monkeypatch.setattr(ts, "exp_scale_bound", lambda s: 63.0)
    for name in ("grad", "grad_kept", "grad_exp"):
        original = getattr(ts, name)
        monkeypatch.setattr(ts, name, lambda *a, _f=original, _n=name, **k: (calls.append(_n), _f(*a, **k))[1])

    def run(keep_bytes, backward_twice=False):
        x = (x_hat * 3.0).detach().requires_grad_()
        ww = w.detach().clone().requires_grad_()
        res = margin_softmax_cross_entropy(x, ww, tgt, CosFace(64.0, 0.35), backend="triton", compute_dtype=compute_dtype,
                                           keep_bytes=keep_bytes)
        res.loss.backward(retain_graph=backward_twice)
        grads = (x.grad.clone(), ww.grad.clone())
        if backward_twice:
            res.loss.backward()
            # kept (float16 cosines) + recomputed: twice the first, to the float16 rounding of G
            torch.testing.assert_close(x.grad, 2 * grads[0], rtol=0, atol=2 * tol * grads[0].abs().max().item())
            torch.testing.assert_close(ww.grad, 2 * grads[1], rtol=0, atol=2 * tol * grads[1].abs().max().item())
        return res.loss.detach(), grads

    item = 4 if compute_dtype == torch.float32 else 2
    loss_k, (gx_k, gw_k) = run(n * s * item, backward_twice=True)
    assert calls == [kept, "grad"]
    calls.clear()
    loss_r, (gx_r, gw_r) = run(n * s * item - 1)
    assert calls == ["grad"]
    calls.clear()
    run(0)
    assert calls == ["grad"]
    assert torch.equal(loss_k, loss_r)            # keeping changes nothing in the forward

    # CosFace (s = 64, m = 0.35) in float64 by autograd.
    x64 = (x_hat * 3.0).double().cpu().requires_grad_()
    w64 = w.double().cpu().requires_grad_()
    xh = x64 / x64.norm(dim=1, keepdim=True)
    wh = w64 / w64.norm(dim=1, keepdim=True)
    cos = xh @ wh.T
    rows, cols = torch.arange(n), tgt.cpu()
    t = cos[rows, cols]
    logits = (64.0 * cos).index_put((rows, cols), 64.0 * (t - 0.35))
    loss64 = (torch.logsumexp(logits, dim=1) - logits[rows, cols]).mean()
    gx64, gw64 = torch.autograd.grad(loss64, (x64, w64))
    for what, gx, gw in (("kept", gx_k, gw_k), ("recompute", gx_r, gw_r)):
        torch.testing.assert_close(gx.cpu().double(), gx64, rtol=0, atol=tol * gx64.abs().max().item(),
                                   msg=lambda m: f"{what} dx: {m}")
        torch.testing.assert_close(gw.cpu().double(), gw64, rtol=0, atol=tol * gw64.abs().max().item(),
                                   msg=lambda m: f"{what} dw: {m}")
