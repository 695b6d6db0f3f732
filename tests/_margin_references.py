"""Independent float64 reference implementations ("oracle") of margin softmax losses.

Every function here is a plain-PyTorch transcription of a paper's OFFICIAL training
code, written for float64 on CPU, computing the full softmax over all classes and
returning ``nn.CrossEntropyLoss()`` (mean over the batch) exactly as those training
scripts do.  It does not import, and was written without reading, any ``ds_pfc`` source.

Layout conventions used throughout (the official heads store ``kernel`` as [d, C] and
normalise its columns; here ``weight`` is [C, d] and its rows are normalised, which is
the same thing transposed):

    emb     [N, d]  float64   raw (un-normalised) features
    weight  [C, d]  float64   raw class centers (sub-center ArcFace: [C*k, d])
    labels  [N]     int64     in [0, C)   (the ``-1`` "not on this rank" label of the
                                           partial-fc codes is not supported)

All functions are differentiable with autograd in float64.  Running states (AdaFace,
CurricularFace) are passed in as dicts and a NEW dict is returned; inputs are never
mutated.  States hold 0-dim float64 tensors (the official buffers are shape-[1] float32).

Two deliberate, value-preserving deviations shared by all functions:

* Non-target logits.  Several official heads push the WHOLE cosine matrix through
  ``acos``/``cos`` (ElasticArcFace, AdaFace, arcface_torch HEAD) or compute
  ``cos(theta+m)`` for every column and then blend with a one-hot (MagFace).  For the
  non-target columns that is the identity up to ~1 ulp, but its autograd graph yields
  NaN gradients where a non-target cosine is exactly +-1.  Here non-target logits are the
  (clamped) cosine itself, and only the target column goes through the margin function.
  Values agree to ~1e-16, gradients agree everywhere the official gradient is finite.
* Output assembly uses ``torch.where(one_hot, target, other)`` instead of in-place
  ``scatter_`` / ``cos_theta[mask] = ...``; same values, same gradients.

Sources actually read for this transcription (stored snapshots of the public repos):

    mk-minchul/AdaFace          head.py (AdaFace class unchanged from 9cb9816 to HEAD
                                c60eaa7), net.py (Backbone.forward), train_val.py,
                                config.py, scripts/run_ir50_ms1mv2.sh
    IrvingMeng/MagFace          models/magface.py (MagLinear, MagLoss; 719001a = HEAD
                                99bae61 for that file), run/trainer.py, run/run.sh,
                                models/parallel_maglinear.py, models/parallel_magloss.py
    HuangYG123/CurricularFace   head/metrics.py (d380265 = HEAD), train.py
    fdbtrs/ElasticFace          utils/losses.py (ea2c5af = HEAD 5496ec0), train.py,
                                config/config.py
    deepinsight/insightface     recognition/arcface_torch/losses.py (history: 2e2e8c9
                                and 657ae30 "fixed arcface impl" .. HEAD 7fadd42),
                                recognition/arcface_torch/partial_fc_v2.py,
                                recognition/subcenter_arcface/{train_parall.py, drop.py,
                                sample_config.py} (MXNet; formerly SubCenter-ArcFace/)
"""

from __future__ import annotations

import math
from typing import Dict, Tuple

import torch
import torch.nn.functional as F

__all__ = [
    "arcface_loss",
    "cosface_loss",
    "adaface_initial_state",
    "adaface_loss",
    "magface_margin",
    "magface_loss",
    "curricularface_initial_state",
    "curricularface_loss",
    "elastic_arcface_loss",
    "elastic_cosface_loss",
    "elastic_margins_plus",
    "subcenter_cosines",
    "subcenter_arcface_loss",
    "dominant_subcenters",
    "subcenter_drop_mask",
]

F64 = torch.float64


# --------------------------------------------------------------------------- helpers


def _check_inputs(emb: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, num_classes: int = None) -> int:
    assert emb.dtype == F64 and weight.dtype == F64, "oracle works in float64"
    assert emb.dim() == 2 and weight.dim() == 2 and emb.shape[1] == weight.shape[1], (emb.shape, weight.shape)
    assert labels.dtype == torch.int64 and labels.dim() == 1 and labels.shape[0] == emb.shape[0], labels.shape
    C = weight.shape[0] if num_classes is None else num_classes
    assert labels.numel() == 0 or (int(labels.min()) >= 0 and int(labels.max()) < C), "labels must lie in [0, C)"
    return C


def _l2_norm(x: torch.Tensor, dim: int) -> torch.Tensor:
    """The official ``l2_norm`` of AdaFace / CurricularFace / ElasticFace:
    ``torch.div(x, torch.norm(x, 2, dim, True))`` -- no epsilon (a zero row gives NaN)."""
    return torch.div(x, torch.norm(x, 2, dim, True))


def _one_hot(labels: torch.Tensor, num_classes: int) -> torch.Tensor:
    return F.one_hot(labels, num_classes).bool()


def _target(cos: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """cos[i, labels[i]] as an [N] tensor (differentiable gather)."""
    return cos.gather(1, labels.view(-1, 1)).squeeze(1)


def _assemble(cos: torch.Tensor, target: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Logits equal to ``cos`` except column ``labels[i]`` of row i, which is ``target[i]``."""
    return torch.where(_one_hot(labels, cos.shape[1]), target.view(-1, 1), cos)


def _cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    # nn.CrossEntropyLoss() defaults: reduction="mean", no label smoothing, no weights.
    return F.cross_entropy(logits, labels)


def _arc_target(cos_t: torch.Tensor, m, *, easy_margin: bool, threshold: bool) -> torch.Tensor:
    """Target logit cos(theta + m) with one of the three theta+m>pi conventions.

    ``cos_t``: [N] target cosines (already clamped to [-1, 1]); ``m``: float or [N] tensor.

    * easy_margin=True (insightface/CurricularFace/MagFace ``easy_margin`` branch):
          where(cos_t > 0, cos(theta+m), cos_t)
    * threshold=True (the ``th``/``threshold``/``theta`` + ``mm``/``sinmm`` branch):
          where(cos_t > cos(pi-m), cos(theta+m), cos_t - sin(pi-m)*m)
      with cos(theta+m) computed as cos_t*cos(m) - sqrt(1-cos_t^2)*sin(m).
    * both False ("plain"): cos(acos(cos_t) + m), no special handling: for theta+m>pi the
      logit wraps back up (MXNet insightface combined margin, ElasticArcFace).
    """
    if easy_margin or threshold:
        if isinstance(m, (int, float)):
            cos_m, sin_m = math.cos(m), math.sin(m)
            th, mm = math.cos(math.pi - m), math.sin(math.pi - m) * m
        else:
            cos_m, sin_m = torch.cos(m), torch.sin(m)
            th, mm = torch.cos(math.pi - m), torch.sin(math.pi - m) * m
        sin_t = torch.sqrt(1.0 - torch.pow(cos_t, 2))
        cos_tm = cos_t * cos_m - sin_t * sin_m
        if easy_margin:
            return torch.where(cos_t > 0, cos_tm, cos_t)
        return torch.where(cos_t > th, cos_tm, cos_t - mm)
    return torch.cos(torch.acos(cos_t) + m)


def _normalized_cosines(emb: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """arcface_torch (partial_fc_v2.py): linear(normalize(emb), normalize(weight)).clamp(-1, 1).
    ``F.normalize`` divides by max(||x||, 1e-12)."""
    return F.linear(F.normalize(emb), F.normalize(weight)).clamp(-1, 1)


def _arcface_from_cos(cos: torch.Tensor, labels: torch.Tensor, *, scale: float, m: float, easy_margin: bool,
                      threshold: bool, straight_through: bool) -> torch.Tensor:
    if straight_through:
        # arcface_torch HEAD (losses.py ArcFace / CombinedMarginLoss m1==1, m3==0, since
        # commit 657ae30 "fixed arcface impl"): the margin is applied IN PLACE UNDER
        # torch.no_grad() to the whole logit matrix:
        #     logits.arccos_(); logits[i, y_i] += m; logits.cos_(); logits = logits * s
        # so the forward value is the plain cos(theta+m) (no threshold) and cos(acos(c)) for
        # non-targets, while backward treats the margin as identity: dL/dcos = s*(p - onehot).
        assert not easy_margin, "arcface_torch's no_grad ArcFace has no easy_margin branch"
        with torch.no_grad():
            onehot = _one_hot(labels, cos.shape[1]).to(cos.dtype)
            modified = torch.cos(torch.acos(cos) + m * onehot)
        logits = cos + (modified - cos.detach())
        return _cross_entropy(logits * scale, labels)
    target = _arc_target(_target(cos, labels), m, easy_margin=easy_margin, threshold=threshold)
    return _cross_entropy(_assemble(cos, target, labels) * scale, labels)


# --------------------------------------------------------------------------- ArcFace / CosFace


def arcface_loss(emb: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, scale: float = 64.0,
                 m: float = 0.5, easy_margin: bool = False, threshold: bool = True,
                 straight_through: bool = False) -> torch.Tensor:
    """ArcFace, insightface ``recognition/arcface_torch`` conventions.

    Transcribes deepinsight/insightface recognition/arcface_torch/losses.py ``ArcFace`` /
    ``CombinedMarginLoss(s, 1.0, m, 0.0)`` as of commit 2e2e8c9 (Jan-Dec 2022) together with
    partial_fc_v2.py's logit computation.  Conventions:

    * cos = linear(F.normalize(emb), F.normalize(weight)).clamp(-1, 1)  (normalize eps 1e-12)
    * target: cos(theta+m) = cos*cos(m) - sqrt(1-cos^2)*sin(m)
    * theta+m>pi: default ``threshold=True`` -> where(cos > cos(pi-m), cos(theta+m),
      cos - sin(pi-m)*m)  (arcface_torch's ``easy_margin = False`` path; identical to
      CurricularFace's ArcFace and MagFace's non-easy path).
      ``easy_margin=True`` -> where(cos > 0, cos(theta+m), cos).
      ``threshold=False`` -> plain cos(acos(cos)+m) (insightface MXNet / SubCenter code and
      ElasticFace ArcFace; also the forward VALUE of arcface_torch HEAD).
    * ``straight_through=True`` reproduces arcface_torch HEAD exactly (margin applied under
      no_grad => plain forward value, identity backward through the margin).
    * logits * s, nn.CrossEntropyLoss (mean).  (arcface_torch's DistCrossEntropy computes
      -log(max(p_y, 1e-30)); identical unless a per-sample loss exceeds ~69.08.)
    * Edge: d/dcos of sqrt(1-cos^2) (or of acos) is infinite at cos_y = +-1 -> NaN gradient,
      as in the official code.
    """
    _check_inputs(emb, weight, labels)
    cos = _normalized_cosines(emb, weight)
    return _arcface_from_cos(cos, labels, scale=scale, m=m, easy_margin=easy_margin, threshold=threshold,
                             straight_through=straight_through)


def cosface_loss(emb: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, scale: float = 64.0,
                 m: float = 0.4) -> torch.Tensor:
    """CosFace, insightface recognition/arcface_torch/losses.py ``CosFace`` (s=64, m=0.40).

    cos = linear(F.normalize(emb), F.normalize(weight)).clamp(-1, 1); target logit cos_y - m;
    logits * s; nn.CrossEntropyLoss (mean).  No other clamp.
    """
    _check_inputs(emb, weight, labels)
    cos = _normalized_cosines(emb, weight)
    target = _target(cos, labels) - m
    return _cross_entropy(_assemble(cos, target, labels) * scale, labels)


# --------------------------------------------------------------------------- AdaFace


def adaface_initial_state() -> Dict[str, torch.Tensor]:
    """AdaFace buffers at construction (head.py): batch_mean = 20, batch_std = 100.
    (The official head also registers an unused buffer ``t`` = 0; omitted.)"""
    return {"batch_mean": torch.tensor(20.0, dtype=F64), "batch_std": torch.tensor(100.0, dtype=F64)}


def adaface_loss(emb: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, state: Dict, *,
                 scale: float = 64.0, m: float = 0.4, h: float = 0.333, t_alpha: float = 0.01,
                 eps: float = 1e-3) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """AdaFace, transcribed from mk-minchul/AdaFace head.py ``AdaFace.forward`` (+ net.py,
    train_val.py).

    Defaults: m=0.4, h=0.333 as in scripts/run_ir50_ms1mv2.sh and the AdaFace class
    defaults; t_alpha=0.01 as config.py's argparse default (the class default is 1.0, but
    training always passes hparams.t_alpha); s=64; eps=1e-3 (``self.eps``).  Note config.py's
    argparse defaults are m=0.5, h=0.0 -- the README/scripts use 0.4/0.333.

    Interface mapping: the official head receives ``embbedings`` and ``norms`` from the
    backbone (net.py ``Backbone.forward``: ``norm = torch.norm(x, 2, 1, True);
    output = torch.div(x, norm); return output, norm``).  Here ``norms = ||emb||`` and
    ``emb_n = emb / norms`` are computed the same way (no eps, gradient through both the
    numerator and the norm).  The head then clips and DETACHES the norms
    (``safe_norms = clip(norms, 0.001, 100).clone().detach()``), so the loss depends on
    ``emb`` differentiably ONLY through ``emb / ||emb||``: d loss / d emb is orthogonal
    to emb row-wise.

    Forward, in the official order:
      1. kernel_norm = l2_norm(kernel, axis=0)  (no eps);  cosine = emb_n @ kernel_norm
      2. cosine = cosine.clamp(-1+eps, 1-eps)
      3. safe_norms = clip(norms, 0.001, 100), detached
      4. UPDATE running stats first (no_grad), from the current batch:
             batch_mean = mean(safe_norms) * t_alpha + (1 - t_alpha) * batch_mean
             batch_std  = std(safe_norms)  * t_alpha + (1 - t_alpha) * batch_std
         (torch.std: unbiased, N-1; N == 1 gives NaN exactly like the official code)
      5. margin_scaler = (safe_norms - batch_mean) / (batch_std + eps) * h, clipped to
         [-1, 1]  -- uses the JUST-UPDATED stats; constant w.r.t. autograd.
      6. g_angular = m * margin_scaler * -1 added to theta = acos(cosine) of the target
         column only; theta_m = clip(theta + g_angular, eps, pi - eps); cosine = cos(theta_m)
      7. g_add = m + m * margin_scaler subtracted from the target column
      8. logits = cosine * s; nn.CrossEntropyLoss (mean).
    Edge conventions: theta+m>pi is handled by the clip at pi-eps (no threshold branch);
    theta+g_angular<eps is clipped at eps (clip kills the gradient there); non-target
    columns are the clamped cosine (official: cos(clip(acos(c))) == c up to rounding,
    since acos(1-1e-3) ~ 0.0447 > eps).  The stats are updated on every call (the official
    forward has no ``self.training`` guard).
    """
    _check_inputs(emb, weight, labels)
    batch_mean = torch.as_tensor(state["batch_mean"], dtype=F64).reshape(())
    batch_std = torch.as_tensor(state["batch_std"], dtype=F64).reshape(())

    norms = torch.norm(emb, 2, 1, True)                        # [N, 1]  (net.py)
    emb_n = torch.div(emb, norms)                               # net.py output
    kernel_norm = _l2_norm(weight, 1)                           # rows == official columns
    cosine = emb_n.mm(kernel_norm.t())
    cosine = cosine.clamp(-1 + eps, 1 - eps)

    safe_norms = torch.clip(norms, min=0.001, max=100)
    safe_norms = safe_norms.clone().detach()

    with torch.no_grad():
        mean = safe_norms.mean().detach()
        std = safe_norms.std().detach()
        new_mean = mean * t_alpha + (1 - t_alpha) * batch_mean
        new_std = std * t_alpha + (1 - t_alpha) * batch_std

    margin_scaler = (safe_norms - new_mean) / (new_std + eps)
    margin_scaler = margin_scaler * h
    margin_scaler = torch.clip(margin_scaler, -1, 1)            # [N, 1], no grad
    margin_scaler = margin_scaler.view(-1)

    cos_t = _target(cosine, labels)
    g_angular = m * margin_scaler * -1
    theta = cos_t.acos()
    theta_m = torch.clip(theta + g_angular, min=eps, max=math.pi - eps)
    cos_t = theta_m.cos()
    g_add = m + (m * margin_scaler)
    cos_t = cos_t - g_add

    logits = _assemble(cosine, cos_t, labels) * scale
    loss = _cross_entropy(logits, labels)
    return loss, {"batch_mean": new_mean.detach().clone(), "batch_std": new_std.detach().clone()}


# --------------------------------------------------------------------------- MagFace


def magface_margin(x_norm: torch.Tensor, *, l_a: float = 10.0, u_a: float = 110.0, l_m: float = 0.45,
                   u_m: float = 0.8) -> torch.Tensor:
    """MagFace ``SoftmaxBuilder._margin``: linear m(a) = (u_m-l_m)/(u_a-l_a)*(a-l_a) + l_m."""
    return (u_m - l_m) / (u_a - l_a) * (x_norm - l_a) + l_m


def magface_loss(emb: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, scale: float = 64.0,
                 l_a: float = 10.0, u_a: float = 110.0, l_m: float = 0.45, u_m: float = 0.8,
                 lambda_g: float = 35.0, easy_margin: bool = False) -> torch.Tensor:
    """MagFace, transcribed from IrvingMeng/MagFace models/magface.py (``MagLinear.forward``,
    ``MagLoss``, ``SoftmaxBuilder._margin``) and run/trainer.py (``loss = loss_id +
    args.lambda_g * loss_g``).  Defaults from run/run.sh (l_a=10, u_a=110, l_m=0.45,
    u_m=0.8, lambda_g=35; trainer.py's argparse default lambda_g is 20), s=64.

    * x_norm = ||emb||.clamp(l_a, u_a)  -- NOT detached: gradient flows into the feature
      norm through both the adaptive margin and the regulariser (zero outside [l_a, u_a]).
    * ada_margin = magface_margin(x_norm)  (per sample)
    * cos_theta = F.normalize(emb) @ F.normalize(weight).T, clamp(-1, 1)  (eps 1e-12)
    * cos(theta+m) = cos*cos(m) - sqrt(1 - cos^2)*sin(m)
    * theta+m>pi: ``easy_margin=False`` -> where(cos > cos(pi - m_i), cos(theta+m_i),
      cos - sin(pi - m_i)*m_i) with the per-sample margin (threshold and mm are tensors that
      carry gradient to x_norm);  ``easy_margin=True`` -> where(cos > 0, cos(theta+m), cos).
      NOTE: the official ``MagLinear`` (and ``ParallelMagLinear``) has ``easy_margin=True`` as
      its constructor default and the official builders never override it, so official
      training runs the EASY branch.  This function keeps ``easy_margin=False`` as default
      per the caller's requested interface -- pass ``easy_margin=True`` to match the
      shipped training configuration.
    * logits: s*cos(theta+m) on the target, s*cos elsewhere; loss_id = F.cross_entropy mean
    * loss_g = mean(x_norm / u_a**2 + 1 / x_norm)  (``MagLoss.calc_loss_G``)
    * returns loss_id + lambda_g * loss_g
    (MagLoss's ``cut_off`` and ``large_value`` are computed but unused in the official code.)
    """
    _check_inputs(emb, weight, labels)
    x_norm = torch.norm(emb, dim=1, keepdim=True).clamp(l_a, u_a)           # [N, 1]
    ada_margin = magface_margin(x_norm, l_a=l_a, u_a=u_a, l_m=l_m, u_m=u_m).view(-1)

    weight_norm = F.normalize(weight, dim=1)
    cos_theta = torch.mm(F.normalize(emb), weight_norm.t())
    cos_theta = cos_theta.clamp(-1, 1)

    target = _arc_target(_target(cos_theta, labels), ada_margin, easy_margin=easy_margin, threshold=True)
    logits = _assemble(scale * cos_theta, scale * target, labels)
    loss_id = _cross_entropy(logits, labels)
    loss_g = torch.mean(1 / (u_a ** 2) * x_norm + 1 / x_norm)
    return loss_id + lambda_g * loss_g


# --------------------------------------------------------------------------- CurricularFace


def curricularface_initial_state() -> Dict[str, torch.Tensor]:
    """CurricularFace buffer ``t`` = zeros(1) at construction (head/metrics.py)."""
    return {"t": torch.tensor(0.0, dtype=F64)}


def curricularface_loss(emb: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, state: Dict, *,
                        scale: float = 64.0, m: float = 0.5,
                        momentum: float = 0.01) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """CurricularFace, transcribed from HuangYG123/CurricularFace head/metrics.py
    ``CurricularFace.forward`` (s=64, m=0.5; loss = nn.CrossEntropyLoss in train.py).
    ``momentum`` is the hard-coded 0.01 of the official EMA.

    Forward, in the official order:
      1. emb_n = l2_norm(emb), kernel_norm = l2_norm(kernel, axis=0)  (no eps)
         cos_theta = emb_n @ kernel_norm, clamp(-1, 1)
      2. target_logit = cos_theta[i, y_i];  sin = sqrt(1 - target^2)
         cos_theta_m = target*cos(m) - sin*sin(m)                    # cos(theta_y + m)
      3. mask = cos_theta > cos_theta_m  (all columns, compared with the UN-thresholded
         cos(theta_y+m) even when theta_y+m > pi; a boolean, so no gradient)
      4. final_target = where(target > cos(pi-m), cos_theta_m, target - sin(pi-m)*m)
      5. UPDATE t first, under no_grad:  t = mean(target_logit)*0.01 + (1-0.01)*t
         (target_logit = clamped target cosine, before any margin)
      6. hard negatives: cos_theta[mask] = c * (t + c) with the NEW t (a constant for
         autograd; gradient through both factors of c, i.e. t + 2c)
      7. the target column is overwritten with final_target (so the mask's value on the
         target column is irrelevant), logits * s, cross-entropy mean.
    t is updated on every call (no ``self.training`` guard).  Edge: NaN gradient at
    cos_y = +-1 through the sqrt, as in the official code.
    """
    _check_inputs(emb, weight, labels)
    t = torch.as_tensor(state["t"], dtype=F64).reshape(())
    cos_m, sin_m = math.cos(m), math.sin(m)
    threshold = math.cos(math.pi - m)
    mm = math.sin(math.pi - m) * m

    emb_n = _l2_norm(emb, 1)
    kernel_norm = _l2_norm(weight, 1)
    cos_theta = torch.mm(emb_n, kernel_norm.t())
    cos_theta = cos_theta.clamp(-1, 1)

    target_logit = _target(cos_theta, labels).view(-1, 1)                 # [N, 1]
    sin_theta = torch.sqrt(1.0 - torch.pow(target_logit, 2))
    cos_theta_m = target_logit * cos_m - sin_theta * sin_m
    mask = (cos_theta > cos_theta_m).detach()
    final_target_logit = torch.where(target_logit > threshold, cos_theta_m, target_logit - mm)

    with torch.no_grad():
        t_new = target_logit.mean() * momentum + (1 - momentum) * t

    logits = torch.where(mask, cos_theta * (t_new + cos_theta), cos_theta)
    logits = _assemble(logits, final_target_logit.view(-1), labels)
    loss = _cross_entropy(logits * scale, labels)
    return loss, {"t": t_new.detach().clone()}


# --------------------------------------------------------------------------- ElasticFace


def _elastic_cosines(emb: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # train.py: features = F.normalize(backbone(img)); the header then applies l2_norm again
    # (no eps) to the features and to the kernel columns; clamp(-1, 1).
    emb_n = _l2_norm(F.normalize(emb), 1)
    kernel_norm = _l2_norm(weight, 1)
    return torch.mm(emb_n, kernel_norm.t()).clamp(-1, 1)


def elastic_margins_plus(cos_target: torch.Tensor, margins: torch.Tensor, *,
                         official_indexing: bool = True) -> torch.Tensor:
    """ElasticFace+ margin reassignment, transcribed from fdbtrs/ElasticFace utils/losses.py
    (``ElasticArcFace``/``ElasticCosFace`` with ``plus=True``), done under no_grad:

        distmat = cos_theta[index, label]            # clamped target cosines, [N]
        _, idicate_cosie = torch.sort(distmat, dim=0, descending=True)
        margin, _ = torch.sort(margin, dim=0)        # ascending
        m_hot.scatter_(1, label[index, None], margin[idicate_cosie])

    i.e. sample i receives ``sorted_margins[argsort_desc(cos)[i]]`` -- a GATHER with the
    descending-cosine permutation.  ``official_indexing=True`` (default) reproduces exactly
    that.  Note it is NOT in general the rank assignment "highest cosine gets the smallest
    margin" (that would be the inverse permutation, a scatter); ``official_indexing=False``
    returns that rank assignment for comparison.  The two coincide whenever the
    permutation is an involution (e.g. cosines already sorted ascending or descending).

    Ties: torch.sort's order among equal values is unspecified in the official code; here
    ``stable=True`` (equal cosines keep index order, equal margins are interchangeable).
    ``cos_target`` [N] and ``margins`` [N] (or [N, 1]); returns [N] float64, no grad.
    """
    with torch.no_grad():
        cos_target = cos_target.detach().reshape(-1)
        margins = torch.as_tensor(margins, dtype=F64).detach().reshape(-1)
        assert cos_target.shape == margins.shape
        _, order = torch.sort(cos_target, dim=0, descending=True, stable=True)
        sorted_margins, _ = torch.sort(margins, dim=0, stable=True)
        if official_indexing:
            return sorted_margins[order].clone()
        out = torch.empty_like(sorted_margins)
        out[order] = sorted_margins
        return out


def _elastic_prepare(emb, weight, labels, margins, plus):
    _check_inputs(emb, weight, labels)
    cos = _elastic_cosines(emb, weight)
    margins = torch.as_tensor(margins, dtype=F64).reshape(-1)
    assert margins.shape[0] == labels.shape[0], "one margin per sample"
    cos_t = _target(cos, labels)
    if plus:
        margins = elastic_margins_plus(cos_t, margins)
    return cos, cos_t, margins.detach()


def elastic_arcface_loss(emb: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, margins: torch.Tensor, *,
                         scale: float = 64.0, plus: bool = False) -> torch.Tensor:
    """ElasticFace-Arc, transcribed from fdbtrs/ElasticFace utils/losses.py ``ElasticArcFace``.

    ``margins`` [N] are the per-sample draws the official code makes with
    ``torch.normal(mean=m, std=std, size=[N, 1])`` (official config: m=0.5, std=0.05 for
    ElasticArcFace, std=0.0175 for ElasticArcFacePlus; the class default std=0.0125 is
    overridden by config).  The draws are NOT clamped (the ``.clamp(m-std, m+std)`` is
    commented out in the official code).  ``plus=True`` first applies
    ``elastic_margins_plus`` to them (official indexing).

    cos = clamp(l2_norm(F.normalize(emb)) @ l2_norm(kernel), -1, 1);
    target logit = cos(acos(cos_y) + margin_i) -- plain, NO theta+m>pi handling (wraps);
    logits * s, nn.CrossEntropyLoss (mean).  Edge: acos has infinite slope at cos_y = +-1.
    """
    cos, cos_t, margins = _elastic_prepare(emb, weight, labels, margins, plus)
    target = torch.cos(torch.acos(cos_t) + margins)
    return _cross_entropy(_assemble(cos, target, labels) * scale, labels)


def elastic_cosface_loss(emb: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, margins: torch.Tensor, *,
                         scale: float = 64.0, plus: bool = False) -> torch.Tensor:
    """ElasticFace-Cos, transcribed from fdbtrs/ElasticFace utils/losses.py ``ElasticCosFace``.

    Official config: m=0.35, std=0.05 (ElasticCosFace) / std=0.02 (ElasticCosFacePlus).
    cos as in ``elastic_arcface_loss``; target logit = cos_y - margin_i (no clamp after);
    logits * s; nn.CrossEntropyLoss (mean).  ``plus=True`` applies ``elastic_margins_plus``.
    """
    cos, cos_t, margins = _elastic_prepare(emb, weight, labels, margins, plus)
    target = cos_t - margins
    return _cross_entropy(_assemble(cos, target, labels) * scale, labels)


# --------------------------------------------------------------------------- Sub-center ArcFace


def subcenter_cosines(emb: torch.Tensor, weight: torch.Tensor, *, k: int) -> torch.Tensor:
    """Class cosines [N, C] = max over each class's k sub-centers.

    insightface recognition/subcenter_arcface/train_parall.py: fc7 = FullyConnected(
    L2Normalization(emb), L2Normalization(W)) with W of shape [C*K, d], then
    ``reshape(fc7, (-1, C, K))`` and ``max(axis=2)`` -- so row ``c*k + j`` of ``weight`` is
    sub-center j of class c.  Normalisation/clamp here follow arcface_torch
    (F.normalize eps 1e-12, clamp(-1, 1); MXNet's L2Normalization uses
    x / sqrt(sum x^2 + 1e-10) and no clamp -- differences are rounding-level).
    Gradient of the max goes to a single sub-center (torch's max(dim) picks one index;
    MXNet's reduce-max backward would pass it to every tied element -- exact ties only).
    """
    assert weight.shape[0] % k == 0, "weight must be [C*k, d]"
    cos_all = _normalized_cosines(emb, weight)                            # [N, C*k]
    N = cos_all.shape[0]
    return cos_all.view(N, weight.shape[0] // k, k).max(dim=2).values


def subcenter_arcface_loss(emb: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, k: int,
                           scale: float = 64.0, m: float = 0.5, easy_margin: bool = False, threshold: bool = True,
                           straight_through: bool = False) -> torch.Tensor:
    """Sub-center ArcFace: class cosine = max over k sub-centers (``subcenter_cosines``), then
    the ArcFace margin of ``arcface_loss`` on the target class, logits * s, CE mean.

    Official defaults (sample_config.py): K=3, s=64, m=0.5.  theta+m>pi convention: the
    same keywords as ``arcface_loss`` (default ``threshold=True``, the arcface_torch 2022
    ``easy_margin=False`` branch).  The official MXNet sub-center code applies the plain
    cos(arccos(cos)+m) (no threshold): pass ``threshold=False`` for that.
    With k=1 this is exactly ``arcface_loss``.
    """
    assert weight.shape[0] % k == 0, "weight must be [C*k, d]"
    _check_inputs(emb, weight, labels, num_classes=weight.shape[0] // k)
    cos = subcenter_cosines(emb, weight, k=k)
    return _arcface_from_cos(cos, labels, scale=scale, m=m, easy_margin=easy_margin, threshold=threshold,
                             straight_through=straight_through)


def _first_argmax(x: torch.Tensor) -> torch.Tensor:
    """argmax along dim 1 with ties resolved to the SMALLEST index (numpy.argmax semantics)."""
    idx = torch.arange(x.shape[1], device=x.device).expand_as(x)
    is_max = x == x.max(dim=1, keepdim=True).values
    return torch.where(is_max, idx, torch.full_like(idx, x.shape[1])).min(dim=1).values


def dominant_subcenters(emb: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, k: int) -> torch.Tensor:
    """Dominant sub-center of every class, as the sub-center paper's dropping step defines it
    (insightface recognition/subcenter_arcface/drop.py):

        for each sample x of class c (x and W L2-normalised):
            sim = W[c*k:(c+1)*k] @ x ; K_stat[argmax(sim)] += 1
        dominant(c) = argmax(K_stat)

    i.e. the sub-center that the largest number of the class's samples are closest to.
    Ties (in a sample's similarities or in the counts) -> smallest index (numpy.argmax).
    A class with no sample in ``emb`` gets 0 (argmax of an all-zero count vector).
    Returns int64 [C], C = weight.shape[0] // k.  No gradient (a pure statistic).
    """
    assert weight.shape[0] % k == 0, "weight must be [C*k, d]"
    C = weight.shape[0] // k
    _check_inputs(emb, weight, labels, num_classes=C)
    with torch.no_grad():
        x = F.normalize(emb)
        W = F.normalize(weight).view(C, k, -1)
        sim = torch.einsum("nd,nkd->nk", x, W[labels])                     # [N, k]
        pick = _first_argmax(sim)
        counts = torch.zeros(C, k, dtype=torch.int64)
        counts.index_put_((labels, pick), torch.ones_like(pick), accumulate=True)
        return _first_argmax(counts)


def subcenter_drop_mask(emb: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, k: int,
                        threshold_deg: float = 75.0) -> torch.Tensor:
    """drop.py's keep rule: a sample is kept iff cos(x, dominant sub-center of its class) >
    cos(pi * threshold / 180) (default threshold 75 degrees).  Dominance is computed over the
    samples given here.  Returns bool [N] (True = keep)."""
    dom = dominant_subcenters(emb, weight, labels, k=k)
    C = weight.shape[0] // k
    with torch.no_grad():
        W = F.normalize(weight).view(C, k, -1)
        centers = W[labels, dom[labels]]                                    # [N, d]
        sim = (F.normalize(emb) * centers).sum(dim=1)
        return sim > math.cos(math.pi * threshold_deg / 180.0)
