"""Several training steps of the sampled head equal an independent float64 model.

The reference below is plain PyTorch: the full ``[C, d]`` centers and momentum
buffer, a margin softmax over the step's active classes written from the formulas,
autograd for the gradients, and ``torch.optim.SGD``'s update (dampening 0, weight
decay added to the gradient) applied to the active rows only, each step with its own
learning rate. Agreement to 1e-10 over eight steps pins what a step does: which rows
get weight decay and momentum (only the active ones; the others keep centers and
buffer), the margin on the target logit, the mean over the batch, the learning rate
and the gradient's scale. A change to any of them moves the trajectory by far more
than float64 rounding. (Which classes are active is the sampler's business, tested in
test_sampler.py and test_exactness.py; the reference takes the head's active set.)
"""
from __future__ import annotations

import math

import pytest
import torch

from _reference import arcface_ref_loss
from ds_pfc import ArcFace, CosFace, PartialFC

F64 = torch.float64
C, D, N, STEPS = 97, 9, 23, 8
MOMENTUM, WEIGHT_DECAY = 0.9, 5e-4
LRS = [0.05 * (1 + t) / STEPS + 0.1 * math.sin(t) ** 2 for t in range(STEPS)]   # a different lr every step


def cosface_ref_loss(x, w, target_col, scale, m):
    """CosFace softmax CE over the rows ``w``: target logit ``s * (cos - m)``."""
    cos = (x / x.norm(dim=1, keepdim=True)) @ (w / w.norm(dim=1, keepdim=True)).t()
    n = torch.arange(x.shape[0])
    logits = scale * cos - scale * m * torch.nn.functional.one_hot(target_col, w.shape[0]).to(cos.dtype)
    return (torch.logsumexp(logits, dim=1) - logits[n, target_col]).mean()


MARGINS = {
    "cosface": (lambda: CosFace(16.0, 0.3), lambda x, w, t: cosface_ref_loss(x, w, t, 16.0, 0.3)),
    "arcface": (lambda: ArcFace(16.0, 0.4), lambda x, w, t: arcface_ref_loss(x, w, t, 16.0, 0.4)),
}


@pytest.mark.parametrize("sample_rate", [0.25, 1.0])
@pytest.mark.parametrize("margin", list(MARGINS))
def test_eight_steps_equal_float64_reference(margin, sample_rate):
    make_margin, ref_loss = MARGINS[margin]
    head = PartialFC(C, D, sample_rate=sample_rate, margin=make_margin(), seed=11, dtype=F64,
                     optimizer="sgd", momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)
    gen = torch.Generator().manual_seed(3)
    w_ref = head.centers().clone()
    buf_ref = torch.zeros_like(w_ref)
    untouched_seen = False
    for t in range(STEPS):
        x = torch.randn(N, D, generator=gen, dtype=F64)
        # Labels from a third of the classes, so that sampled negatives exist and some rows stay inactive.
        y = torch.randint(0, C // 3, (N,), generator=gen) * 3
        active = head.active_set(y, sample_step=t)
        cols = torch.arange(C) if active is None else active
        assert bool(torch.isin(torch.unique(y), cols).all())

        # Reference step.
        xr = x.clone().requires_grad_(True)
        wr = w_ref[cols].clone().requires_grad_(True)
        target = torch.searchsorted(cols, y)
        loss_ref = ref_loss(xr, wr, target)
        loss_ref.backward()
        g = wr.grad + WEIGHT_DECAY * w_ref[cols]
        buf_ref[cols] = MOMENTUM * buf_ref[cols] + g
        w_ref[cols] -= LRS[t] * buf_ref[cols]

        # The head's step.
        before = head.centers()
        xh = x.clone().requires_grad_(True)
        loss = head(xh, y)
        loss.backward()
        head.step(LRS[t])

        what = f"{margin} r={sample_rate} step {t + 1}"
        torch.testing.assert_close(loss.detach(), loss_ref.detach(), rtol=1e-10, atol=0, msg=what + " loss")
        torch.testing.assert_close(xh.grad, xr.grad, rtol=1e-10, atol=1e-14, msg=what + " embedding gradient")
        state = head.state_dict()
        torch.testing.assert_close(state["weight"], w_ref, rtol=1e-10, atol=1e-14, msg=what + " centers")
        torch.testing.assert_close(state["momentum_buffer"], buf_ref, rtol=1e-10, atol=1e-14,
                                   msg=what + " momentum buffer")
        if active is not None:
            idle = torch.ones(C, dtype=torch.bool)
            idle[cols] = False
            untouched_seen |= bool(idle.any())
            assert torch.equal(state["weight"][idle], before[idle]), what + ": an inactive row moved"
    assert untouched_seen == (sample_rate < 1.0)
