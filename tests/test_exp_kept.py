"""The exp-kept path of the triton backend (bf16 products: the forward stores bf16
``E = exp(scale cos - scale / 2)``, the backward is two products over E with per-sample
factors, no G pass) through ``margin_cross_entropy``, against float64 references:

- every margin the fused backend takes (ArcFace, CosFace, combined, AdaFace, MagFace,
  ElasticFace; CurricularFace and sub-centers run on the torch backend only),
  one rank, against the float64 transcriptions of the official code
  (``_margin_references.py``), within a small multiple of the reference's own error when
  its inputs are rounded to bf16;
- 3 gloo ranks with uneven batches and uneven class shards and the PFC* filter, against a
  plain float64 softmax over all classes written here;
- the path rule (:func:`ds_pfc.core.softmax.cosine_path`).

The kernels run in Triton's interpreter on a CPU (TRITON_INTERPRET=1, set by conftest.py).
"""
from __future__ import annotations

import importlib.util
import math
import os

import pytest
import torch

import _margin_references as R
from _dist import run_ranks
import ds_pfc
from ds_pfc.core.margins import AdaFace, ElasticArcFace, ElasticCosFace, MagFace

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or (os.environ.get("TRITON_INTERPRET") != "1"
                                                   and not torch.cuda.is_available()),
    reason="the triton kernels need a GPU or Triton's interpreter (TRITON_INTERPRET=1, set by conftest.py)")

DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
D = 24


def _case(seed, n, num_classes, *, norm_lo=0.5, norm_hi=4.0):
    """Embeddings leaning towards their class's center (so the filter has hard negatives to
    drop and the softmax is far from uniform), norms spread over [norm_lo, norm_hi]."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(num_classes, D, generator=g, dtype=torch.float64)
    y = torch.randint(0, num_classes, (n,), generator=g)
    lean = 2.5 * torch.rand(n, 1, generator=g, dtype=torch.float64)
    x = lean * torch.nn.functional.normalize(w[y], dim=1) + torch.randn(n, D, generator=g, dtype=torch.float64) / 3
    x = torch.nn.functional.normalize(x, dim=1) * (norm_lo + (norm_hi - norm_lo) * torch.rand(n, 1, generator=g,
                                                                                               dtype=torch.float64))
    return x, y, w


def _elastic(fn, plus, factory):
    def ref(e, w, y):
        lib = factory()
        probe = type(lib)(lib.scale, lib.m, lib.std, plus=False, seed=lib.seed)   # the raw draws of step 0
        return fn(e, w, y, probe.margins(torch.zeros(len(y), dtype=torch.float64), 0), plus=plus)
    return ref


def _combined(e, w, y, m1=1.2, m2=0.2, m3=0.1, scale=64.0):
    """``scale (cos(m1 theta + m2) - m3)`` on the target, plain float64 (the data keeps every
    target angle below (pi - m2) / m1, where no continuation convention applies)."""
    cos = torch.nn.functional.normalize(e, dim=1) @ torch.nn.functional.normalize(w, dim=1).T
    theta = torch.acos(cos.gather(1, y[:, None]).clamp(-1.0, 1.0))
    assert bool((m1 * theta + m2 < torch.pi).all())
    logits = cos.scatter(1, y[:, None], torch.cos(m1 * theta + m2) - m3) * scale
    return torch.nn.functional.cross_entropy(logits, y)


# name -> (library margin, float64 reference loss(emb, weight, labels), norm range)
MARGINS = {
    "combined": (lambda: ds_pfc.CombinedMargin(64.0, 1.2, 0.2, 0.1), _combined, (0.5, 4.0)),
    "arcface": (lambda: ds_pfc.ArcFace(), lambda e, w, y: R.subcenter_arcface_loss(e, w, y, k=1, threshold=False),
                (0.5, 4.0)),
    "cosface": (lambda: ds_pfc.CosFace(), lambda e, w, y: R.cosface_loss(e, w, y), (0.5, 4.0)),
    "adaface": (lambda: AdaFace(), lambda e, w, y: R.adaface_loss(e, w, y, R.adaface_initial_state())[0],
                (2.0, 40.0)),
    "magface": (lambda: MagFace(), lambda e, w, y: R.magface_loss(e, w, y, easy_margin=True), (5.0, 130.0)),
    "elastic-arc": (lambda: ElasticArcFace(seed=4),
                    _elastic(R.elastic_arcface_loss, False, lambda: ElasticArcFace(seed=4)), (0.5, 4.0)),
    "elastic-cos-plus": (lambda: ElasticCosFace(plus=True, seed=4),
                         _elastic(R.elastic_cosface_loss, True, lambda: ElasticCosFace(plus=True, seed=4)),
                         (0.5, 4.0)),
}


def _grads(ref, x, w, y):
    x = x.detach().double().clone().requires_grad_(True)
    w = w.detach().double().clone().requires_grad_(True)
    loss = ref(x, w, y)
    return (loss.detach(), *torch.autograd.grad(loss, (x, w)))


def _bf16_directions(t):
    """``t`` with each row's direction rounded to bf16 and its norm kept: the rounding the
    kernels' bf16 products apply (to the normalised embeddings and centers)."""
    norm = t.norm(dim=1, keepdim=True)
    return (t / norm).bfloat16().double() * norm


def _count_exp(monkeypatch):
    """Calls of the exp-kept backward (and of the other two), recorded."""
    from ds_pfc.kernels import triton_softmax as ts
    calls = []
    for name in ("grad", "grad_kept", "grad_exp"):
        original = getattr(ts, name)
        monkeypatch.setattr(ts, name, lambda *a, _f=original, _n=name, **k: (calls.append(_n), _f(*a, **k))[1])
    return calls


@pytest.mark.parametrize("name", sorted(MARGINS))
def test_every_fused_margin_matches_the_official_code(monkeypatch, name):
    """One rank: loss and gradients of the exp-kept step against the float64 reference, to
    within 1.5x the error the reference itself makes when the directions of its inputs are
    rounded to bf16 as the kernels round them (plus 5e-4)."""
    factory, ref, (lo, hi) = MARGINS[name]
    calls = _count_exp(monkeypatch)
    x64, y, w64 = _case(7, 21, 37, norm_lo=lo, norm_hi=hi)
    x = x64.float().to(DEVICE).requires_grad_(True)
    w = w64.float().to(DEVICE).requires_grad_(True)
    loss = ds_pfc.margin_cross_entropy(x, y.to(DEVICE), w, margin=factory(), backend="triton",
                                       compute_dtype=torch.bfloat16)
    got = (loss.detach(), *torch.autograd.grad(loss, (x, w)))
    assert calls == ["grad_exp"]
    exact = _grads(ref, x64, w64, y)
    rounded = _grads(ref, _bf16_directions(x64), _bf16_directions(w64), y)
    for label, g, e, r in zip(("loss", "d embeddings", "d centers"), got, exact, rounded):
        err = (g.cpu().double() - e).norm() / e.norm()
        own = (r - e).norm() / e.norm()
        assert err <= 1.5 * own + 5e-4, f"{name} {label}: relative error {err:.3g}, bf16 reference's own {own:.3g}"


# ---------------------------------------------------------------------- 3 ranks, uneven, filtered
# Seed 14: no cosine within 0.02 of the threshold (bf16 products move a cosine by up to ~4e-3, so
# no filter decision can flip), 8 negatives filtered.
SEED, SIZES, SHARDS, THRESHOLD, SCALE, M = 14, [6, 3, 8], [12, 20, 5], 0.45, 64.0, 0.35


def _ranks(rank, world_size):
    x, y, w = _case(SEED, sum(SIZES), sum(SHARDS))
    sl = slice(sum(SIZES[:rank]), sum(SIZES[:rank + 1]))
    a, b = sum(SHARDS[:rank]), sum(SHARDS[:rank + 1])
    xs = x[sl].float().clone().requires_grad_(True)
    ws = w[a:b].float().clone().requires_grad_(True)
    loss = ds_pfc.margin_cross_entropy(xs, y[sl], ws, margin=ds_pfc.CosFace(SCALE, M), filter_threshold=THRESHOLD,
                                       group=torch.distributed.group.WORLD, class_start=a, backend="triton",
                                       compute_dtype=torch.bfloat16)
    from ds_pfc.core.softmax import cosine_path
    path = cosine_path(sum(SIZES), SHARDS[rank], torch.bfloat16, 1 << 30, SCALE)
    return {"path": path, "loss": loss.detach(), "gx": torch.autograd.grad(loss, (xs, ws))}


def _filtered_cosface(x, w, y):
    """CosFace over all classes with PFC*'s filter: a negative whose cosine exceeds the
    threshold is left out of the softmax (plain float64)."""
    cos = torch.nn.functional.normalize(x, dim=1) @ torch.nn.functional.normalize(w, dim=1).T
    target = torch.nn.functional.one_hot(y, w.shape[0]).bool()
    drop = (cos > THRESHOLD) & ~target
    logits = torch.where(target, SCALE * (cos - M), SCALE * cos).masked_fill(drop, float("-inf"))
    return (torch.logsumexp(logits, dim=1) - logits[target]).mean(), drop


def test_three_uneven_ranks_with_the_filter_match_one_softmax():
    results = run_ranks(_ranks, 3)
    x, y, w = _case(SEED, sum(SIZES), sum(SHARDS))
    x = x.clone().requires_grad_(True)
    w = w.clone().requires_grad_(True)
    loss, drop = _filtered_cosface(x, w, y)
    assert int(drop.sum()) > 0, "the data must exercise the filter"
    cos = torch.nn.functional.normalize(x.detach(), dim=1) @ torch.nn.functional.normalize(w.detach(), dim=1).T
    assert float((cos - THRESHOLD).abs().min()) > 0.01, "the data lands near the threshold; change SEED"
    gx, gw = torch.autograd.grad(loss, (x, w))
    xr = _bf16_directions(x.detach()).requires_grad_(True)
    wr = _bf16_directions(w.detach()).requires_grad_(True)
    own_gx, own_gw = (g - e for g, e in zip(torch.autograd.grad(_filtered_cosface(xr, wr, y)[0], (xr, wr)), (gx, gw)))
    for q, r in enumerate(results):
        assert r["path"] == "exp"
        torch.testing.assert_close(r["loss"].double(), loss.detach(), rtol=2e-3, atol=0)
        sl = slice(sum(SIZES[:q]), sum(SIZES[:q + 1]))
        rows = slice(sum(SHARDS[:q]), sum(SHARDS[:q + 1]))
        for label, got, exact, own in (("dx", r["gx"][0], gx[sl], own_gx[sl]), ("dw", r["gx"][1], gw[rows], own_gw[rows])):
            err = (got.double() - exact).norm() / exact.norm()
            # The reference's own error models the operands' rounding, not E's (0.2% more): 2.5x.
            bound = 2.5 * own.norm() / exact.norm() + 5e-4
            assert err <= bound, f"rank {q} {label}: relative error {err:.3g} > {bound:.3g}"


# ---------------------------------------------------------------------- the rule
def test_the_path_rule():
    from ds_pfc.core.softmax import cosine_path
    from ds_pfc.kernels.triton_softmax import exp_scale_bound
    n, s = 2048, 800_000
    assert 140 < exp_scale_bound(s) < 150
    assert cosine_path(n, s, torch.bfloat16, 4 << 30, 64.0) == "exp"
    assert cosine_path(n, s, torch.bfloat16, 4 << 30, 150.0) == "kept"          # beyond the bound
    assert cosine_path(n, s, torch.float16, 4 << 30, 64.0) == "kept"            # sm_7x: no bf16
    assert cosine_path(n, s, torch.float32, 1 << 40, 64.0) == "kept"
    assert cosine_path(n, s, torch.bfloat16, n * s * 2 - 1, 64.0) == "recompute"  # over the budget
    assert cosine_path(n, s, torch.bfloat16, 0, 64.0) == "recompute"


def test_a_full_exp_kept_step_never_waits_for_the_device():
    """validate=False: the exp-kept head step (forward storing E, two products, the row update
    projecting the rows) issues no host synchronisation, and runs no G pass, G kernel or
    separate projection pass."""
    import warnings
    from ds_pfc.bench.head import count_step
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")            # bf16 products on a CPU: the head's speed warning
        full = count_step(1024, 16, batch=64, sample_rate=1.0, validate=False, backend="triton", fused=True,
                          compute="bf16")
    assert full["syncs"] == 0, full["sync_ops"]
    launches = full["launches"]
    assert launches.get("triton:_lse_exp_kernel") == 1 and launches.get("triton:_sgd_rows_kernel") == 1, launches
    assert not any(k in launches for k in ("triton:_lse_kernel", "triton:_g_pass_kernel", "triton:_g_kernel",
                                           "triton:_dw_kernel", "triton:_project_kernel")), launches


def test_the_step_model_counts_the_exp_kept_step():
    """The step model's count of a bf16 triton step that keeps (``keep="exp"``: what the rule
    picks at s = 64) has the forward storing E and two bf16 products of 2 N S d FLOPs each, and
    no G pass, and the forward's products are the kept path's; ``keep="kept"`` counts the kept-cosine step (its G pass) for the same case."""
    from ds_pfc.bench import model
    n, d, S = 64, 16, 256
    exp = model.count_step(S, batch=n, dim=d, sample_rate=1.0, compute="bf16", keep="exp")["kernels"]
    kept = model.count_step(S, batch=n, dim=d, sample_rate=1.0, compute="bf16", keep="kept")["kernels"]
    assert "triton:_lse_exp_kernel" in exp and "triton:_g_pass_kernel" not in exp and "triton:_lse_kernel" not in exp
    assert "triton:_g_pass_kernel" in kept and "triton:_lse_exp_kernel" not in kept
    assert exp["aten:mm[bf16]"]["flops"] == pytest.approx(4 * n * S * d, rel=0.05)
    # Nothing but the two products and the row update passes over [S, d] or E: no torch op of
    # the step moves, per launch, as many bytes as the float32 gradient of the centers.
    big = {k: c["read"] + c["written"] for k, c in exp.items()
           if k.startswith("aten:") and not k.startswith("aten:mm")
           and (c["read"] + c["written"]) / max(c["launches"], 1) >= S * d * 4}
    assert not big, big
    # The forward's products on the GPU's tiles (padded at this small shape): the kept forward's.
    assert exp["triton:_lse_exp_kernel"]["flops"] == kept["triton:_lse_kernel"]["flops"]
    assert model.cosines_path("triton", 2048, 800_000, "bf16", None) == "exp"
    assert model.cosines_path("triton", 2048, 800_000, "fp16", None) == "kept"
    assert model.case_keeps({"backend": "triton", "cosines": "exp"}) == "exp"
    assert model.case_keeps({"backend": "triton"}) is False      # named no path: counted as recompute


def test_the_exp_kept_prediction_prices_no_g_pass():
    """The committed prediction of the standard rank's exp-kept step: its products are the
    forward's (2 N S d) and cuBLAS's dX and dW (4 N S d), no G pass; calibrated, the forward
    takes the statistics kernel's measured efficiency, and the step is below the kept step's."""
    import json
    from ds_pfc.bench import calibration, model
    results = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "results")
    res = json.load(open(os.path.join(results, "predict-h200-d512-s800k-k1-exp.json")))["results"][0]
    assert res["case"]["cosines"] == "exp"
    pred = model.predict_case(res["case"], "h200", counts=res["counts"], compile_code=False)
    flops = {r["kernel"]: r["flops"] for r in pred["kernels"] if r["flops"]}
    n, s, d = 2048, 800_000, 512
    assert set(flops) == {"triton:_lse_exp_kernel", "aten:mm[bf16]"}
    assert flops["triton:_lse_exp_kernel"] == pytest.approx(2 * n * s * d, rel=1e-3)
    assert flops["aten:mm[bf16]"] == pytest.approx(4 * n * s * d, rel=1e-3)
    assert not any("_g_pass" in r["kernel"] or "_g_kernel" in r["kernel"] for r in pred["kernels"])
    cal = calibration.load_calibration()
    out = calibration.calibrated_prediction(pred, cal)
    rules = {r["kernel"]: r["rule"] for r in out["kernels"]}
    assert rules["triton:_lse_exp_kernel"].endswith("as _lse_kernel")
    kept = json.load(open(os.path.join(results, "predict-h200-d512-s800k-k1-kept.json")))["results"][0]
    kept_out = calibration.calibrated_prediction(
        model.predict_case(kept["case"], "h200", counts=kept["counts"], compile_code=False), cal)
    assert out["step_s"] < kept_out["step_s"] - 2e-3         # the G pass (2.29 ms) is gone


def _scaled_step(loss_scale, *, hook=False, nan_embedding=False, seed=3):
    """One loss-scaled training step of a bf16 triton head (the exp-kept path) with the
    overflow guard on: returns (the head's verdict, the verdict read from the gradients
    themselves, the shapes torch.isfinite was applied to, the forward's triton launches)."""
    from ds_pfc.core.head import PartialFC
    from ds_pfc.kernels import triton_softmax as ts
    c, d, n = 300, 16, 24
    head = PartialFC(c, d, sample_rate=1.0, device=DEVICE, compute_dtype=torch.bfloat16, backend="triton",
                     optimizer="sgd", data_parallel_grad=False, seed=seed, fused=True, validate=False)
    head.guard_nonfinite = True
    if hook:
        head.center_grad_hook = lambda: (lambda g: g)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=gen).to(DEVICE)
    if nan_embedding:
        x[5, 2] = float("nan")
    x.requires_grad_()
    y = torch.randint(0, c, (n,), generator=gen).to(DEVICE)
    seen, launched = [], []
    real_isfinite, real_exp = torch.isfinite, ts.exp_stats
    try:
        torch.isfinite = lambda t: (seen.append(tuple(t.shape)), real_isfinite(t))[1]
        ts.exp_stats = lambda *a, **k: (launched.append("exp"), real_exp(*a, **k))[1]
        loss = head(x, y)
        (loss * loss_scale).backward()
        verdict = bool(head.pending_grads_finite())
    finally:
        torch.isfinite, ts.exp_stats = real_isfinite, real_exp
    grads = [p[1].grad for p in head._pending if p[1].grad is not None]
    if head._acc is not None:
        grads.append(head._acc[1])
    truth = all(bool(real_isfinite(g).all()) for g in grads) and bool(grads)
    head.close()
    return verdict, truth, seen, launched


@pytest.mark.parametrize("loss_scale,nan_embedding", [(65536.0, False), (float("inf"), False), (1.0, True)])
def test_a_loss_scaled_exp_kept_step_decides_finiteness_from_n_sized_values(loss_scale, nan_embedding):
    """Under loss scaling the exp-kept backward decides whether the centers' gradient is finite
    without a pass over it (every value torch.isfinite reads is N-sized), and agrees with the
    gradient itself: finite at a normal scale, not at an infinite one or with a NaN embedding."""
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")           # bf16 products on a CPU: the head's speed warning
        verdict, truth, seen, launched = _scaled_step(loss_scale, nan_embedding=nan_embedding)
    assert launched == ["exp"]
    assert verdict == truth == (loss_scale == 65536.0)
    assert seen and all(math.prod(shape) <= 24 * 16 for shape in seen), seen


def test_a_hook_on_the_centers_gradient_makes_the_check_read_the_gradient():
    """A hook may change the gradient after the backward: the verdict then comes from the
    gradient itself (a pass over [S, d]), and is still right."""
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        verdict, truth, seen, _ = _scaled_step(float("inf"), hook=True)
    assert verdict is truth is False
    assert (300, 16) in seen
