"""Distributed margin-softmax cross-entropy over class-sharded active centers.

Each rank holds the gathered batch ``x [N, d]`` and its active centers ``w [S, d]``.
The softmax is normalised exactly over the union of all ranks' active sets
(paper: "Model Parallelism", Eq. sampled_probability).

Budget: forward 2 all-reduces of ``N x 2`` floats (max; sum-exp + target + owner
count + hit); backward none. Memory: one ``N x S`` buffer in the accumulation dtype
(float32, or float64 for float64 inputs) holds the cosines, then the logits, then the
probabilities, which backward turns into the gradient one column block at a time
(a block of at most 4 Mi elements) without changing the buffer. With a reduced ``compute_dtype`` the matrix products
run in bfloat16/float16 with float32 accumulation; the softmax stays in float32.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .collectives import all_reduce_
from .margins import Margin

__all__ = ["margin_softmax_cross_entropy", "SoftmaxResult"]

_NORM_EPS = 1e-12
_CHUNK_ELEMS = 1 << 24  # rows per reduced-precision GEMM chunk: ~32 MiB of bf16 temp


class SoftmaxResult(NamedTuple):
    loss: torch.Tensor          # scalar, mean over the gathered batch
    per_sample: torch.Tensor    # [N] loss of every gathered sample
    correct: torch.Tensor       # [N] 1.0 where the target has the largest raw cosine


def _normalize(t: torch.Tensor, acc: torch.dtype):
    t = t.to(acc)
    norm = t.norm(dim=1, keepdim=True).clamp_min(_NORM_EPS)
    return t / norm, norm


def _cosines(x_hat, w_hat, acc, compute):
    """``x_hat @ w_hat.T`` into one ``acc`` buffer; reduced precision is chunked by rows."""
    n, s = x_hat.shape[0], w_hat.shape[0]
    out = torch.empty(n, s, dtype=acc, device=x_hat.device)
    if compute == acc:
        return torch.mm(x_hat, w_hat.t(), out=out), x_hat, w_hat
    xc, wc = x_hat.to(compute), w_hat.to(compute)
    step = max(1, _CHUNK_ELEMS // max(s, 1))
    for i in range(0, n, step):
        out[i: i + step] = torch.mm(xc[i: i + step], wc.t())
    return out, xc, wc


def _margin_and_filter_(cos, rows, cols, margin: Margin, threshold):
    """cos -> logits in place. Returns the target cosines of the owned rows."""
    cos_t = cos[rows, cols]
    if threshold is not None:
        # PFC* (Eq. noise_filtering): a negative above tau leaves the denominator.
        # Targets are rewritten below, so they are never filtered.
        cos.masked_fill_(cos > threshold, float("-inf"))
    cos.mul_(margin.scale)
    cos[rows, cols] = margin.scale * margin.phi(cos_t)
    return cos_t


class _MarginSoftmaxCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, target_col, margin, threshold, group, compute_dtype):
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        compute = acc if compute_dtype is None else compute_dtype
        n = x.shape[0]
        x_hat, x_norm = _normalize(x, acc)
        w_hat, w_norm = _normalize(w, acc)
        buf, xc, wc = _cosines(x_hat, w_hat, acc, compute)
        rows = torch.nonzero(target_col >= 0).squeeze(1)
        cols = target_col[rows]

        ninf = torch.full((n,), float("-inf"), dtype=acc, device=x.device)
        maxes = torch.stack([ninf, ninf], dim=1)
        if buf.shape[1]:
            maxes[:, 1] = buf.amax(dim=1)           # raw cosine, for top-1
        cos_t = _margin_and_filter_(buf, rows, cols, margin, threshold)
        if buf.shape[1]:
            maxes[:, 0] = buf.amax(dim=1)
        all_reduce_(maxes, "max", group)
        row_max = maxes[:, 0]

        buf.sub_(row_max[:, None]).exp_()
        stats = torch.zeros(n, 4, dtype=acc, device=x.device)
        stats[:, 0] = buf.sum(dim=1)
        stats[rows, 1] = margin.scale * margin.phi(cos_t) - row_max[rows]
        stats[rows, 2] = 1.0
        stats[rows, 3] = (cos_t >= maxes[rows, 1]).to(acc)
        all_reduce_(stats, "sum", group)
        if not bool((stats[:, 2] == 1.0).all()):
            bad = torch.nonzero(stats[:, 2] != 1.0).squeeze(1)[:5].tolist()
            raise ValueError(
                f"labels: gathered samples {bad} have a label owned by no rank "
                "(labels must lie in [0, num_classes) of the sharded classifier)")
        sum_exp = stats[:, 0]
        per_sample = torch.log(sum_exp) - stats[:, 1]
        buf.div_(sum_exp[:, None])                   # probabilities

        ctx.save_for_backward(buf, xc, wc, x_hat, w_hat, x_norm, w_norm, rows, cols, cos_t)
        ctx.margin, ctx.in_dtypes = margin, (x.dtype, w.dtype)
        correct = stats[:, 3].clone()
        ctx.mark_non_differentiable(correct)
        return per_sample.mean(), per_sample, correct

    @staticmethod
    def backward(ctx, grad_loss, grad_per_sample, _grad_correct):
        prob, xc, wc, x_hat, w_hat, x_norm, w_norm, rows, cols, cos_t = ctx.saved_tensors
        margin = ctx.margin
        n, s = prob.shape
        acc = prob.dtype
        weight = torch.zeros(n, dtype=acc, device=prob.device)
        if grad_loss is not None:
            weight += grad_loss / n
        if grad_per_sample is not None:
            weight += grad_per_sample
        # dL/dlogit = w_n (p - onehot); dL/dcos = scale * that, times phi' on targets.
        target_grad = weight[rows] * margin.scale * margin.dphi(cos_t)
        dx_hat = torch.zeros(n, xc.shape[1], dtype=acc, device=prob.device)
        dw_hat = torch.empty(s, wc.shape[1], dtype=acc, device=prob.device)
        # Column blocks of the probabilities become the gradient block by block; the
        # saved buffer is left as it is, so backward may run more than once.
        step = max(1, _CHUNK_ELEMS // 4 // max(n, 1))
        for j in range(0, s, step):
            k = min(s, j + step)
            g = prob[:, j:k] * (weight * margin.scale)[:, None]
            hit = (cols >= j) & (cols < k)
            g[rows[hit], cols[hit] - j] = (prob[rows[hit], cols[hit]] - 1.0) * target_grad[hit]
            if g.dtype == xc.dtype:
                torch.mm(g.t(), xc, out=dw_hat[j:k])
                dx_hat.addmm_(g, wc[j:k])
            else:
                g = g.to(xc.dtype)
                dw_hat[j:k] = torch.mm(g.t(), xc)
                dx_hat += torch.mm(g, wc[j:k])
        # Through the normalisation: project onto the tangent space, divide by the norm.
        dx = (dx_hat - x_hat * (x_hat * dx_hat).sum(1, keepdim=True)) / x_norm
        dw = (dw_hat - w_hat * (w_hat * dw_hat).sum(1, keepdim=True)) / w_norm
        return dx.to(ctx.in_dtypes[0]), dw.to(ctx.in_dtypes[1]), None, None, None, None, None


def margin_softmax_cross_entropy(
    x: torch.Tensor,
    w: torch.Tensor,
    target_col: torch.Tensor,
    margin: Margin,
    *,
    filter_threshold: float | None = None,
    group=None,
    compute_dtype: torch.dtype | None = None,
) -> SoftmaxResult:
    """Margin softmax CE of the gathered batch against this rank's active centers.

    ``x [N, d]``: gathered embeddings (identical on every rank of ``group``).
    ``w [S, d]``: this rank's active centers (raw; normalised here).
    ``target_col [N]``: column of each sample's target in ``w``, -1 where another
    rank owns it. Every sample's target must be owned by exactly one rank.
    Gradients flow to ``x`` (this rank's share; sum over ranks with a
    reduce-scatter) and to ``w``.
    """
    loss, per_sample, correct = _MarginSoftmaxCE.apply(
        x, w, target_col, margin, filter_threshold, group, compute_dtype)
    return SoftmaxResult(loss, per_sample, correct)
