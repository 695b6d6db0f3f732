"""Loss scaling through DeepSpeed: fp16 at every ZeRO stage, float16 autocast, and
overflows, for a backbone with an attached Partial FC head.

DeepSpeed's CPU accelerator supports fp16 only where oneDNN has it, so the worker
declares fp16 supported: the engine and its fp16 optimizers then run the same Python
as on a GPU, with CPU kernels. Reference: one SGD step computed in float64 by plain
PyTorch from the same starting weights (the backbone's rounded to fp16 where the
engine holds them in fp16). Each case compares the update, not the weights, so a
missing or doubled loss scale shows as a factor of 256 or 65536.
"""
from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.nn.functional as F

from _dist import free_port, run_ranks

pytest.importorskip("deepspeed")

D_IN, D, C, N, LR = 16, 8, 10, 4, 10.0


def _reference_update(w0, b0, c0, x, y, scale, margin):
    """float64 SGD updates (lr LR) of the Linear weight and the centers for CosFace."""
    w = w0.double().clone().requires_grad_(True)
    b = b0.double().clone().requires_grad_(True)
    c = c0.double().clone().requires_grad_(True)
    e = x.double() @ w.T + b
    cos = F.normalize(e) @ F.normalize(c).T
    logits = scale * (cos - margin * F.one_hot(y, C))
    F.cross_entropy(logits, y).backward()
    return -LR * w.grad, -LR * c.grad


def _engine(stage, precision, *, head_scale=4.0, compute_dtype=None, initial_scale_power=8, weight_gain=None):
    from ds_pfc import CosFace, PartialFC
    from ds_pfc.deepspeed_plugin import initialize
    torch.manual_seed(0)
    model = torch.nn.Linear(D_IN, D)
    if weight_gain is None and precision == "autocast":
        # A large weight gives embeddings of norm ~100 from inputs of norm ~4: every
        # gradient of the float16 backward times autocast's 65536 stays in range.
        weight_gain = 50.0
    if weight_gain is not None:
        model.weight.data.mul_(weight_gain)
    head = PartialFC(C, D, sample_rate=1.0, margin=CosFace(head_scale, 0.2), optimizer="sgd", momentum=0.0,
                     weight_decay=0.0, compute_dtype=compute_dtype, device="cpu")
    cfg = {"train_micro_batch_size_per_gpu": N, "gradient_accumulation_steps": 1, "steps_per_print": 10 ** 9,
           "gradient_clipping": 0.0, "optimizer": {"type": "SGD", "params": {"lr": LR}},
           "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True}
    if precision == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": initial_scale_power, "hysteresis": 1}
    elif precision == "autocast":
        cfg["torch_autocast"] = {"enabled": True, "dtype": "float16"}
    w0 = model.weight.detach().clone()
    b0 = model.bias.detach().clone()
    if precision == "fp16":     # the engine holds the backbone in fp16
        w0, b0 = w0.half().float(), b0.half().float()
    engine = initialize(model=model, config=cfg, heads={"identity": head})
    return engine, head, w0, b0


def _weight(engine):
    import deepspeed
    with deepspeed.zero.GatheredParameters([engine.module.weight], enabled=hasattr(engine.module.weight, "ds_id")):
        return engine.module.weight.detach().float().clone()


def _one_step(stage, precision, *, upstream_fixed=False):
    from ds_pfc.deepspeed_plugin import loss_scale
    engine, head, w0, b0 = _engine(stage, precision)
    if upstream_fixed:
        # What DeepSpeed's fix for its fp16 optimizers at ZeRO 0 does: multiply the
        # loss by the scale in backward. The plugin must then not multiply again.
        inner, original = engine.engine, engine.engine.backward

        def fixed_backward(loss, **kwargs):
            return original(loss * loss_scale(inner), **kwargs)
        inner.backward = fixed_backward
    c0 = head.centers().clone()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(N, D_IN, generator=g), torch.randint(0, C, (N,), generator=g)
    if precision == "fp16":
        x = 50 * x       # embeddings of norm ~100, as the autocast cases get from their weights
    scale = loss_scale(engine.engine)
    loss = head(engine(x.to(engine.dtype)).float(), y)
    engine.backward(loss)
    applied = engine.step()
    ref_w, ref_c = _reference_update(w0, b0, c0, x, y, 4.0, 0.2)
    got_w, got_c = _weight(engine) - w0, head.centers() - c0
    return {"applied": applied, "scale": scale, "ds_scales_loss": engine._ds_scales_loss,
            "backbone": float((got_w.double() - ref_w).norm() / ref_w.norm()),
            "backbone_ratio": float(got_w.double().norm() / ref_w.norm()),
            "head": float((got_c.double() - ref_c).norm() / ref_c.norm()),
            "head_ratio": float(got_c.double().norm() / ref_c.norm())}


def _autocast_overflow(stage):
    """ArcFace-like scale 64 at GradScaler's initial 65536: the first step overflows;
    the scale must come down until steps apply again."""
    from ds_pfc.deepspeed_plugin import loss_scale
    engine, head, w0, _ = _engine(stage, "autocast", head_scale=64.0, weight_gain=1.0)
    c0 = head.centers().clone()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(N, D_IN, generator=g), torch.randint(0, C, (N,), generator=g)
    before = loss_scale(engine.engine)
    engine.backward(head(engine(x).float(), y))
    applied = engine.step()
    out = {"applied": applied, "before": before, "after": loss_scale(engine.engine),
           "backbone_moved": not torch.equal(_weight(engine), w0), "head_moved": not torch.equal(head.centers(), c0),
           "skipped": engine.skipped_steps}
    later = []
    for _ in range(12):
        engine.backward(head(engine(x).float(), y))
        later.append(engine.step())
    out["later"] = later
    return out


def _detached_head_overflow():
    """A head on detached embeddings whose gradient overflows while the backbone's own loss
    does not: the heads skip alone and the loss scale comes down. (fp16 products alone no longer
    overflow: G is rounded relative to its largest coefficient and scaled back in float32; a
    logit scale of 1e35 under the 2**16 loss scale overflows float32 itself.)"""
    from ds_pfc.deepspeed_plugin import loss_scale
    engine, head, w0, _ = _engine(0, "fp16", head_scale=1e35, compute_dtype=torch.float16,
                                  initial_scale_power=16)
    c0 = head.centers().clone()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(N, D_IN, generator=g), torch.randint(0, C, (N,), generator=g)
    before = loss_scale(engine.engine)
    e = engine(x.half())
    loss = 1e-3 * e.float().pow(2).mean() + head(e.detach().float(), y)
    engine.backward(loss)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        applied = engine.step()
    return {"applied": applied, "before": before, "after": loss_scale(engine.engine),
            "backbone_moved": not torch.equal(_weight(engine), w0),
            "head_finite": bool(torch.isfinite(head.centers()).all()),
            "head_moved": not torch.equal(head.centers(), c0),
            "warned": any("head gradient overflowed" in str(w.message) for w in caught)}


def _worker(rank, world_size, port):
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    type(get_accelerator()).is_fp16_supported = lambda self: True
    deepspeed.init_distributed(dist_backend="gloo")
    out = {}
    for stage in (0, 1, 2, 3):
        out[("fp16", stage)] = _one_step(stage, "fp16")
    out[("fp16-upstream-fixed", 0)] = _one_step(0, "fp16", upstream_fixed=True)
    for stage in (0, 1, 2, 3):
        out[("autocast", stage)] = _one_step(stage, "autocast")
    for stage in (0, 1, 2, 3):
        out[("autocast-overflow", stage)] = _autocast_overflow(stage)
    out["detached-overflow"] = _detached_head_overflow()
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_worker, 1, free_port())[0]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fp16_updates_match_float64_at_every_stage(results, stage):
    r = results[("fp16", stage)]
    assert r["applied"] and r["scale"] == 256.0
    # At stage 0 DeepSpeed's fp16 optimizer divides by a scale it never multiplied
    # in: the plugin saw that and supplied it; ZeRO multiplies itself.
    assert r["ds_scales_loss"] is (stage != 0)
    assert r["backbone"] < 0.02, r
    assert r["head"] < 0.02, r


def test_fp16_upstream_fix_is_not_doubled(results):
    r = results[("fp16-upstream-fixed", 0)]
    assert r["ds_scales_loss"] is True
    assert r["backbone"] < 0.02 and r["head"] < 0.02, r


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_autocast_fp16_heads_unscaled_with_the_scaler_deepspeed_uses(results, stage):
    r = results[("autocast", stage)]
    assert r["applied"] and r["scale"] == 65536.0       # the optimizer's GradScaler at stages 1-3
    assert r["backbone"] < 0.02, r
    assert r["head"] < 0.02, r


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_autocast_overflow_skips_heads_with_the_backbone(results, stage):
    r = results[("autocast-overflow", stage)]
    assert r["after"] < r["before"]            # the scale came down (at ZeRO 1-3 the plugin lowers it)
    assert not r["backbone_moved"]
    assert r["applied"] is False and not r["head_moved"] and r["skipped"] == 1
    assert r["later"][-1] is True              # and training goes on once the scale fits


def test_head_overflow_alone_skips_heads_and_lowers_the_scale(results):
    r = results["detached-overflow"]
    assert r["backbone_moved"]                 # the backbone's own gradient was finite
    assert r["applied"] is False and r["warned"]
    assert r["head_finite"] and not r["head_moved"]
    assert r["after"] == r["before"] / 2


def test_guard_makes_the_embedding_gradient_nan_when_the_centers_overflow():
    """Many samples of one class, a loss scaled to 1e37: the class's center gradient (a sum
    over the batch) overflows float32 while each embedding's (a sum over 4 classes) does not.
    (With fp16 products G is rounded relative to its largest coefficient, so a merely
    fp16-sized loss scale overflows nothing.)"""
    from ds_pfc import CosFace
    from ds_pfc.core.softmax import margin_softmax_cross_entropy
    torch.manual_seed(0)
    x = (torch.randn(1, D).repeat(64, 1) + 0.01 * torch.randn(64, D)).requires_grad_(True)
    w = torch.randn(4, D, requires_grad=True)
    target = torch.zeros(64, dtype=torch.long)
    for guard in (False, True):
        x.grad = w.grad = None
        out = margin_softmax_cross_entropy(x, w, target, CosFace(64.0, 0.4), compute_dtype=torch.float16,
                                           guard_nonfinite=guard)
        (out.loss * 1e37).backward()
        assert not torch.isfinite(w.grad).all()
        assert bool(torch.isfinite(x.grad).all()) is (not guard)
