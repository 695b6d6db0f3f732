"""Distributed margin-softmax cross-entropy over class-sharded active centers.

Each rank holds the gathered batch ``x [N, d]`` and its active centers ``w [S, d]``.
The softmax is normalised exactly over the union of all ranks' active sets
(paper: "Model Parallelism", Eq. sampled_probability).

Budget: forward 2 all-reduces of ``N x 2`` floats (max; sum-exp + target + owner
count + hit); backward none.

Memory and traffic: one class-major ``S x N`` buffer in the accumulation dtype
(float32, or float64 for float64 inputs) holds the logits and then ``exp(logit -
max)``; nothing else of that size is allocated. All other work runs over blocks of
classes small enough to stay in cache: normalising the centers, the margin, the
filter, the gradient and the normalisation backward are fused into the block loop,
so the ``S x N`` buffer is streamed through memory only three times in forward and
once in backward. With a reduced ``compute_dtype`` the matrix products run in
bfloat16/float16 on normalised operands with float32 accumulation; the softmax stays
in float32.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .collectives import all_reduce_
from .margins import Margin

__all__ = ["margin_softmax_cross_entropy", "SoftmaxResult"]

_NORM_EPS = 1e-12
_BLOCK_BYTES = 1 << 21  # class block: ~2 MiB of logits, so a block stays in cache


class SoftmaxResult(NamedTuple):
    loss: torch.Tensor          # scalar, mean over the gathered batch
    per_sample: torch.Tensor    # [N] loss of every gathered sample
    correct: torch.Tensor       # [N] 1.0 where the target has the largest raw cosine


def _blocks(num_classes: int, num_rows: int, itemsize: int):
    step = max(64, _BLOCK_BYTES // max(1, num_rows * itemsize))
    for j in range(0, num_classes, step):
        yield j, min(num_classes, j + step)


def _targets_in(cols: torch.Tensor, j: int, k: int):
    """Which owned samples have their target in class block ``[j, k)``."""
    return (cols >= j) & (cols < k)


class _MarginSoftmaxCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, target_col, margin, threshold, group, compute_dtype, want_correct):
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        compute = acc if compute_dtype is None else compute_dtype
        n, s = x.shape[0], w.shape[0]
        scale = margin.scale
        x_norm = x.to(acc).norm(dim=1, keepdim=True).clamp_min(_NORM_EPS)
        x_hat = x.to(acc) / x_norm
        xc = x_hat.to(compute)
        w_norm = w.to(acc).norm(dim=1, keepdim=True).clamp_min(_NORM_EPS)
        rows = torch.nonzero(target_col >= 0).squeeze(1)
        cols = target_col[rows]
        cos_t = torch.empty(rows.numel(), dtype=acc, device=x.device)

        logits = torch.empty(s, n, dtype=acc, device=x.device)     # class-major
        maxes = torch.full((2, n), float("-inf"), dtype=acc, device=x.device)
        for j, k in _blocks(s, n, logits.element_size()):
            block = logits[j:k]
            w_hat = (w[j:k].to(acc) / w_norm[j:k]).to(compute)
            if compute == acc:
                torch.mm(w_hat, xc.t(), out=block)
            else:
                block.copy_(torch.mm(w_hat, xc.t()))
            hit = _targets_in(cols, j, k)
            cos_t[hit] = block[cols[hit] - j, rows[hit]]
            if want_correct:
                torch.maximum(maxes[1], block.amax(dim=0), out=maxes[1])
            if threshold is not None:
                # PFC* (Eq. noise_filtering): a negative above tau leaves the
                # denominator. Targets are rewritten below, so never filtered.
                block.masked_fill_(block > threshold, float("-inf"))
            block.mul_(scale)
            block[cols[hit] - j, rows[hit]] = scale * margin.phi(cos_t[hit])
            torch.maximum(maxes[0], block.amax(dim=0), out=maxes[0])
        all_reduce_(maxes, "max", group)
        row_max = maxes[0]

        stats = torch.zeros(4, n, dtype=acc, device=x.device)
        for j, k in _blocks(s, n, logits.element_size()):
            block = logits[j:k].sub_(row_max).exp_()
            stats[0] += block.sum(dim=0)
        stats[1, rows] = scale * margin.phi(cos_t) - row_max[rows]
        stats[2, rows] = 1.0
        if want_correct:
            stats[3, rows] = (cos_t >= maxes[1, rows]).to(acc)
        all_reduce_(stats, "sum", group)
        if not bool((stats[2] == 1.0).all()):
            bad = torch.nonzero(stats[2] != 1.0).squeeze(1)[:5].tolist()
            raise ValueError(
                f"labels: gathered samples {bad} have a label owned by no rank "
                "(labels must lie in [0, num_classes) of the sharded classifier)")
        sum_exp = stats[0]
        per_sample = torch.log(sum_exp) - stats[1]

        ctx.save_for_backward(logits, sum_exp, xc, x_hat, x_norm, w, w_norm, rows, cols, cos_t)
        ctx.margin, ctx.compute, ctx.in_dtypes = margin, compute, (x.dtype, w.dtype)
        correct = stats[3].clone()
        ctx.mark_non_differentiable(correct)
        return per_sample.mean(), per_sample, correct

    @staticmethod
    def backward(ctx, grad_loss, grad_per_sample, _grad_correct):
        exp, sum_exp, xc, x_hat, x_norm, w, w_norm, rows, cols, cos_t = ctx.saved_tensors
        margin, compute = ctx.margin, ctx.compute
        s, n = exp.shape
        acc = exp.dtype
        weight = torch.zeros(n, dtype=acc, device=exp.device)
        if grad_loss is not None:
            weight += grad_loss / n
        if grad_per_sample is not None:
            weight += grad_per_sample
        # dL/dcos = scale * w_n * (p - onehot), times phi'(cos) on the target.
        coef = weight * margin.scale / sum_exp
        target_grad = weight[rows] * margin.scale * margin.dphi(cos_t)
        dx_hat = torch.zeros(n, xc.shape[1], dtype=acc, device=exp.device)
        dw = torch.empty(w.shape, dtype=ctx.in_dtypes[1], device=exp.device)
        for j, k in _blocks(s, n, exp.element_size()):
            # The saved buffer is read, never written: backward may run more than once.
            g = exp[j:k] * coef
            hit = _targets_in(cols, j, k)
            r, c = rows[hit], cols[hit] - j
            g[c, r] = (exp[j:k][c, r] / sum_exp[r] - 1.0) * target_grad[hit]
            w_hat = w[j:k].to(acc) / w_norm[j:k]
            gc, wc = g.to(compute), w_hat.to(compute)
            dw_hat = torch.mm(gc, xc).to(acc)
            dx_hat.add_(torch.mm(gc.t(), wc))
            # Through the normalisation: tangent projection, then divide by the norm.
            dw[j:k] = (dw_hat - w_hat * (w_hat * dw_hat).sum(1, keepdim=True)) / w_norm[j:k]
        dx = (dx_hat - x_hat * (x_hat * dx_hat).sum(1, keepdim=True)) / x_norm
        return dx.to(ctx.in_dtypes[0]), dw, None, None, None, None, None, None


def margin_softmax_cross_entropy(
    x: torch.Tensor,
    w: torch.Tensor,
    target_col: torch.Tensor,
    margin: Margin,
    *,
    filter_threshold: float | None = None,
    group=None,
    compute_dtype: torch.dtype | None = None,
    return_correct: bool = False,
) -> SoftmaxResult:
    """Margin softmax CE of the gathered batch against this rank's active centers.

    ``x [N, d]``: gathered embeddings (identical on every rank of ``group``).
    ``w [S, d]``: this rank's active centers (raw; normalised here).
    ``target_col [N]``: column of each sample's target in ``w``, -1 where another
    rank owns it. Every sample's target must be owned by exactly one rank.
    Gradients flow to ``x`` (this rank's share; the ranks' shares are summed by a
    reduce-scatter) and to ``w``. ``correct`` is only computed with
    ``return_correct=True`` (one extra max per block); it is all zeros otherwise.
    """
    loss, per_sample, correct = _MarginSoftmaxCE.apply(
        x, w, target_col, margin, filter_threshold, group, compute_dtype, return_correct)
    return SoftmaxResult(loss, per_sample, correct)
