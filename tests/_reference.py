"""Independent float64 references shared by the single-process tests."""
import math

import torch


def arcface_ref_loss(x, w, target_col, scale, m):
    """ArcFace softmax CE over the rows ``w`` (float64): target logit
    ``s * cos(theta + m)``, continued linearly past theta* = pi - m as documented."""
    xh = x / x.norm(dim=1, keepdim=True)
    wh = w / w.norm(dim=1, keepdim=True)
    cos = xh @ wh.t()
    n = torch.arange(x.shape[0])
    cos_t = cos[n, target_col]
    c_star = math.cos(math.pi - m)
    phi = torch.where(cos_t >= c_star, torch.cos(torch.acos(cos_t.clamp(-1, 1)) + m), cos_t - c_star - 1.0)
    logits = (scale * cos).index_put((n, target_col), scale * phi)
    return (torch.logsumexp(logits, dim=1) - logits[n, target_col]).mean()
