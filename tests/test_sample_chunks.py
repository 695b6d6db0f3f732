"""The torch backend on one rank with logits larger than the keep budget: samples in
chunks whose logits over all classes are kept, their gradient formed in forward.

Expected values come from ``_reference_ce`` of ``test_exactness`` (a float64 full
softmax in plain PyTorch, differentiated by autograd). The budgets are shrunk so that
a small case takes that path with several class blocks per chunk.
"""
from __future__ import annotations

import pytest
import torch

from ds_pfc.core import softmax
from test_exactness import ARC, COS, _lib_margin, _make_case, _ref_phi, _reference_ce

C, N = 1021, 37


@pytest.fixture
def chunked(monkeypatch):
    """Keep 80 bytes of logits per class at most: chunks of 10 samples in float64
    (4 chunks), of 16 in float32 (3); blocks of 2 KiB of logits (several per chunk)."""
    calls = []
    monkeypatch.setattr(softmax, "KEEP_BYTES", 4 * C * 20)
    monkeypatch.setattr(softmax, "CPU_BLOCK_BYTES", 2048)
    inner = softmax._forward_backward_torch
    monkeypatch.setattr(softmax, "_forward_backward_torch",
                        lambda blocks, chunks, *a, **k: calls.append(len(chunks)) or inner(blocks, chunks, *a, **k))
    return calls


def _call(X, y, W, spec, tau=None, **kw):
    x = X.clone().requires_grad_(True)
    w = W.clone().requires_grad_(True)
    res = softmax.margin_softmax_cross_entropy(x, w, y, _lib_margin(spec), filter_threshold=tau,
                                               return_correct=True, backend="torch", **kw)
    return x, w, res


@pytest.mark.parametrize("spec,tau", [(ARC, None), (COS, None), (ARC, 0.2)])
def test_chunked_forward_gradient_equals_float64_softmax(chunked, spec, tau):
    X, y, W = _make_case(7, [N], C)
    x, w, res = _call(X, y, W, spec, tau)
    res.loss.backward()
    assert chunked == [4]
    loss, per_sample, correct, gx, gw = _reference_ce(X, y, W, spec, tau)
    torch.testing.assert_close(res.loss, loss, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(res.per_sample, per_sample, rtol=1e-10, atol=1e-10)
    assert torch.equal(res.correct.bool(), correct)
    torch.testing.assert_close(x.grad, gx, rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(w.grad, gw, rtol=1e-8, atol=1e-10)


def test_per_sample_gradient_and_second_backward_recompute(chunked):
    """A gradient through ``per_sample`` is not the one formed in forward: backward
    recomputes; so does a second backward (the formed gradient is used once)."""
    X, y, W = _make_case(8, [N], C)
    _, _, _, gx, gw = _reference_ce(X, y, W, ARC)
    x, w, res = _call(X, y, W, ARC)
    weights = torch.linspace(0.5, 2.0, N, dtype=torch.float64)
    (res.per_sample * weights).sum().backward()
    # Reference for the weighted sum: the float64 softmax's per-sample losses, by autograd.
    Xr = X.clone().requires_grad_(True)
    Wr = W.clone().requires_grad_(True)
    cos = (Xr / Xr.norm(dim=1, keepdim=True)) @ (Wr / Wr.norm(dim=1, keepdim=True)).t()
    target = ARC[1] * _ref_phi(ARC, cos[torch.arange(N), y])
    logits = torch.where(torch.nn.functional.one_hot(y, C).bool(), target[:, None], ARC[1] * cos)
    (torch.nn.functional.cross_entropy(logits, y, reduction="none") * weights).sum().backward()
    torch.testing.assert_close(x.grad, Xr.grad, rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(w.grad, Wr.grad, rtol=1e-8, atol=1e-10)

    x, w, res = _call(X, y, W, ARC)
    res.loss.backward(retain_graph=True)
    first = (x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    res.loss.backward()
    for got, want, ref in zip((x.grad, w.grad), first, (gx, gw)):
        torch.testing.assert_close(got, want, rtol=1e-8, atol=1e-12)
        torch.testing.assert_close(got, ref, rtol=1e-8, atol=1e-10)


def test_float32_and_bf16_compute_within_the_references_error(chunked):
    X, y, W = _make_case(9, [N], C)
    loss, _, _, gx, gw = _reference_ce(X, y, W, COS)
    for compute, tol in ((None, 1e-5), (torch.bfloat16, 3e-2)):
        x, w, res = _call(X.float(), y, W.float(), COS, compute_dtype=compute)
        res.loss.backward()
        assert abs(res.loss.item() - loss.item()) <= tol * abs(loss.item())
        for got, want in ((x.grad, gx), (w.grad, gw)):
            err = (got.double() - want).abs().max().item()
            assert err <= tol * want.abs().max().item(), (compute, err)
    assert chunked == [3, 3]


def test_no_chunks_without_gradients_or_with_gpu_sized_blocks(chunked):
    """Evaluation forwards, and a budget of one class block (block_bytes given: the
    kept logits and the blocks are the same size), keep the recomputing path."""
    X, y, W = _make_case(10, [N], C)
    with torch.no_grad():
        _call(X, y, W, ARC)
    x, w, res = _call(X, y, W, ARC, block_bytes=4 * C * 20)
    res.loss.backward()
    assert chunked == []
    torch.testing.assert_close(w.grad, _reference_ce(X, y, W, ARC)[4], rtol=1e-8, atol=1e-10)
