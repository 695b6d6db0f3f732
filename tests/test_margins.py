"""Margins (DESIGN.md 3 "Margins") and the conflict filter (paper Eq. noise_filtering).

References written here in float64 plain PyTorch:
- ``ref_phi``: ``cos(m1 * acos(c) + m2) - m3`` (the normal region), differentiated
  by autograd for the true derivative;
- ``ref_loss``: margin softmax cross-entropy over all classes, with the conflict
  filter implemented two ways: as the paper defines it (negatives with unmargined
  cosine > tau leave sample n's denominator) and as insightface's arcface_torch does
  it (such logits multiplied by 0, so exp(0) stays in the denominator).
"""
from __future__ import annotations

import math

import pytest
import torch

import ds_pfc
from ds_pfc import ArcFace, CombinedMargin, CosFace

F64 = torch.float64


def ref_phi(c: torch.Tensor, m1: float, m2: float, m3: float) -> torch.Tensor:
    return torch.cos(m1 * torch.acos(c) + m2) - m3


def normal_region(m1, m2, num=401, margin=1e-3):
    """Cosines whose angle satisfies m1*theta + m2 <= pi (away from the ends)."""
    theta_max = min(math.pi, (math.pi - m2) / m1)
    theta = torch.linspace(margin, theta_max - margin, num, dtype=F64)
    return torch.cos(theta)


MARGINS = [
    # (constructor, (m1, m2, m3), scale)
    (lambda: ArcFace(64.0, 0.5), (1.0, 0.5, 0.0), 64.0),
    (lambda: ArcFace(30.0, 0.2), (1.0, 0.2, 0.0), 30.0),
    (lambda: CosFace(64.0, 0.4), (1.0, 0.0, 0.4), 64.0),
    (lambda: CombinedMargin(32.0, 1.0, 0.3, 0.2), (1.0, 0.3, 0.2), 32.0),
    (lambda: CombinedMargin(16.0, 1.35, 0.25, 0.1), (1.35, 0.25, 0.1), 16.0),
    (lambda: CombinedMargin(8.0, 2.0, 0.0, 0.0), (2.0, 0.0, 0.0), 8.0),
    (lambda: CombinedMargin(8.0, 0.8, 0.2, 0.05), (0.8, 0.2, 0.05), 8.0),  # never passes pi
]
IDS = ["arc.5", "arc.2", "cos.4", "comb1", "comb2", "sphere2", "comb.8"]


# ---------------------------------------------------------------- value and slope
@pytest.mark.parametrize("make,params,scale", MARGINS, ids=IDS)
def test_phi_matches_formula_in_normal_region(make, params, scale):
    margin = make()
    c = normal_region(*params[:2])
    torch.testing.assert_close(margin.phi(c), ref_phi(c, *params), rtol=0, atol=1e-13)
    torch.testing.assert_close(margin.target_logit(c), scale * ref_phi(c, *params), rtol=1e-13, atol=1e-12)


@pytest.mark.parametrize("make,params,scale", MARGINS, ids=IDS)
def test_dphi_matches_autograd_of_formula(make, params, scale):
    margin = make()
    c = normal_region(*params[:2], margin=1e-2).requires_grad_(True)
    (grad,) = torch.autograd.grad(ref_phi(c, *params).sum(), c)
    torch.testing.assert_close(margin.dphi(c.detach()), grad, rtol=1e-10, atol=1e-10)
    # and through the autograd Function on the target logit
    c2 = c.detach().clone().requires_grad_(True)
    margin.target_logit(c2).sum().backward()
    torch.testing.assert_close(c2.grad, scale * grad, rtol=1e-10, atol=1e-9)


@pytest.mark.parametrize("make,params,scale", MARGINS, ids=IDS)
def test_gradcheck_target_logit(make, params, scale):
    margin = make()
    m1, m2, _ = params
    # points in both regions, away from the kink at theta* and from c = +-1
    theta_star = (math.pi - m2) / m1
    theta = torch.tensor([0.3, 0.9, 1.7, 2.4, 2.9, 3.05], dtype=F64)
    theta = theta[(theta - theta_star).abs() > 0.05]
    c = torch.cos(theta).requires_grad_(True)
    assert torch.autograd.gradcheck(margin.target_logit, (c,), eps=1e-6, atol=1e-6, rtol=1e-6)


def test_straight_through_keeps_value_gradient_is_scale():
    true = ArcFace(64.0, 0.5)
    st = ArcFace(64.0, 0.5, straight_through=True)
    c = torch.cos(torch.linspace(0.05, 3.1, 257, dtype=F64)).requires_grad_(True)
    assert torch.equal(st.target_logit(c), true.target_logit(c))
    normal = c.detach() >= math.cos(math.pi - 0.5)
    torch.testing.assert_close(st.phi(c.detach())[normal], ref_phi(c.detach()[normal], 1.0, 0.5, 0.0),
                               rtol=0, atol=1e-13)
    (g_st,) = torch.autograd.grad(st.target_logit(c).sum(), c)
    assert torch.equal(g_st, torch.full_like(g_st, 64.0))
    (g_true,) = torch.autograd.grad(true.target_logit(c).sum(), c)
    assert not torch.allclose(g_true, g_st)   # the default is the true derivative


def test_cosface_derivative_exactly_one():
    margin = CosFace(64.0, 0.35)
    c = torch.linspace(-1.0, 1.0, 101, dtype=F64).requires_grad_(True)
    out = margin.target_logit(c)
    torch.testing.assert_close(out, 64.0 * (c.detach() - 0.35), rtol=1e-15, atol=1e-13)
    (g,) = torch.autograd.grad(out.sum(), c)
    assert torch.equal(g, torch.full_like(g, 64.0))
    assert torch.equal(margin.dphi(c.detach()), torch.ones_like(g))


def test_every_combined_margin_parameter_is_effective():
    base = dict(scale=20.0, m1=1.2, m2=0.3, m3=0.1)
    c = normal_region(1.3, 0.35, num=33)   # inside the normal region of every variant
    ref = base["scale"] * ref_phi(c, base["m1"], base["m2"], base["m3"])
    torch.testing.assert_close(CombinedMargin(**base).target_logit(c), ref, rtol=1e-12, atol=1e-12)
    for name, value in (("scale", 24.0), ("m1", 1.3), ("m2", 0.35), ("m3", 0.15)):
        args = {**base, name: value}
        got = CombinedMargin(**args).target_logit(c)
        expected = args["scale"] * ref_phi(c, args["m1"], args["m2"], args["m3"])
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
        assert (got - ref).abs().max() > 1e-3, f"{name} has no effect"


# ---------------------------------------------------------------- theta + m > pi
PAST_PI = [
    (ArcFace(64.0, 0.5), (1.0, 0.5, 0.0)),
    (ArcFace(64.0, 1.2), (1.0, 1.2, 0.0)),
    (CombinedMargin(32.0, 1.5, 0.2, 0.15), (1.5, 0.2, 0.15)),
    (CombinedMargin(32.0, 2.0, 0.0, 0.0), (2.0, 0.0, 0.0)),
    (CombinedMargin(32.0, 1.0, 0.4, -0.1), (1.0, 0.4, -0.1)),
]


@pytest.mark.parametrize("margin,params", PAST_PI, ids=[repr(m) for m, _ in PAST_PI])
def test_past_pi_continuous_monotone_below_cosine(margin, params):
    m1, m2, m3 = params
    theta_star = (math.pi - m2) / m1
    c_star = math.cos(theta_star)
    # continuity at theta*: the value there is cos(pi) - m3 from the formula
    for eps in (1e-6, 1e-9):
        pts = torch.tensor([c_star - eps, c_star, c_star + eps], dtype=F64)
        vals = margin.phi(pts)
        assert abs(float(vals[1]) - (-1.0 - m3)) < 1e-9
        assert float((vals[2] - vals[0]).abs()) <= 3 * eps
    # monotone non-decreasing in c on a fine grid over [-1, 1]
    grid = torch.linspace(-1.0, 1.0, 40001, dtype=F64)
    vals = margin.phi(grid)
    assert bool(torch.isfinite(vals).all())
    assert float(torch.diff(vals).min()) >= -1e-12
    # in the normal region it is the formula
    normal = grid >= c_star
    torch.testing.assert_close(vals[normal], ref_phi(grid[normal], *params), rtol=0, atol=1e-12)
    # the target is still penalised past theta*: phi(c) < c. This holds for a
    # non-negative m3 only (a negative additive margin is a bonus by construction:
    # past theta* phi(c) - c = -(1 + c* + m3), which is > 0 when m3 < -(1 + c*)).
    past = grid < c_star
    assert past.any()
    if m3 >= 0:
        assert bool((vals[past] < grid[past] - 1e-9).all())
        below = grid < 1.0
        assert bool((vals[below] < grid[below]).all())
    else:
        torch.testing.assert_close(vals[past] - grid[past],
                                   torch.full_like(vals[past], -(1 + c_star + m3)))
    # past theta* the target logit has the slope of the cosine and no jump:
    # it does not *rise* as the angle grows (insightface's fallback jumps here).
    dvals = margin.dphi(grid[past])
    assert bool((dvals > 0).all())
    # dphi is the derivative of phi everywhere except at the kink
    h = 1e-6
    pts = grid[(grid - c_star).abs() > 1e-3][::197]
    pts = pts[(pts > -1 + 2 * h) & (pts < 1 - 1e-2)]
    numeric = (margin.phi(pts + h) - margin.phi(pts - h)) / (2 * h)
    torch.testing.assert_close(margin.dphi(pts), numeric, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- full loss
def ref_loss(x, w, labels, scale, m1, m2, m3, tau=None, filter_style="paper"):
    """Margin softmax CE over all classes in float64, written from the formulas."""
    xh = x / x.norm(dim=1, keepdim=True)
    wh = w / w.norm(dim=1, keepdim=True)
    cos = xh @ wh.t()
    n = torch.arange(x.shape[0])
    cos_t = cos[n, labels]
    theta_star = (math.pi - m2) / m1
    if theta_star < math.pi:   # documented linear continuation past theta*
        c_star = math.cos(theta_star)
        phi_t = torch.where(cos_t >= c_star, ref_phi(cos_t, m1, m2, m3), cos_t - c_star - 1.0 - m3)
    else:
        phi_t = ref_phi(cos_t, m1, m2, m3)
    onehot = torch.zeros_like(cos, dtype=torch.bool)
    onehot[n, labels] = True
    logits = torch.where(onehot, scale * phi_t[:, None].expand_as(cos), scale * cos)
    if tau is not None:
        conflict = (cos > tau) & ~onehot
        if filter_style == "paper":       # M_{n,j} = 0: out of the denominator
            logits = logits.masked_fill(conflict, float("-inf"))
        else:                             # arcface_torch: logit * 0 -> exp(0) stays
            logits = torch.where(conflict, torch.zeros_like(logits), logits)
    return (torch.logsumexp(logits, dim=1) - logits[n, labels]).mean()


LOSS_MARGINS = [
    (ArcFace(10.0, 0.5), (10.0, 1.0, 0.5, 0.0)),
    (CosFace(10.0, 0.35), (10.0, 1.0, 0.0, 0.35)),
    (CombinedMargin(10.0, 1.1, 0.2, 0.1), (10.0, 1.1, 0.2, 0.1)),
]


def _small_problem(seed=0, n=5, c=7, d=4):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=gen, dtype=F64)
    w = torch.randn(c, d, generator=gen, dtype=F64)
    y = torch.randint(0, c, (n,), generator=gen)
    return x, w, y


@pytest.mark.parametrize("tau", [None, 0.3])
@pytest.mark.parametrize("margin,params", LOSS_MARGINS, ids=["arc", "cos", "comb"])
def test_gradcheck_margin_cross_entropy(margin, params, tau):
    x, w, y = _small_problem(seed=1)
    if tau is not None:
        with torch.no_grad():
            cos = torch.nn.functional.normalize(x, dim=1) @ torch.nn.functional.normalize(w, dim=1).t()
        neg = torch.ones_like(cos, dtype=torch.bool)
        neg[torch.arange(5), y] = False
        assert bool((cos[neg] > tau).any()), "the filter must act in this case"
        assert float((cos - tau).abs().min()) > 1e-4, "no cosine may sit on the threshold"
    x.requires_grad_(True)
    w.requires_grad_(True)

    def fn(x_, w_):
        return ds_pfc.margin_cross_entropy(x_, y, w_, margin=margin, filter_threshold=tau)

    assert torch.autograd.gradcheck(fn, (x, w), eps=1e-6, atol=1e-6, rtol=1e-5)
    # value and gradients against the independent reference
    loss = fn(x, w)
    ref = ref_loss(x, w, y, *params, tau=tau)
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)
    g = torch.autograd.grad(loss, (x, w))
    g_ref = torch.autograd.grad(ref, (x, w))
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def _conflict_problem():
    """Class 3 duplicates class 1 (conflict), samples lie near their centers."""
    gen = torch.Generator().manual_seed(7)
    c, d, n = 11, 7, 9
    w = torch.randn(c, d, generator=gen, dtype=F64)
    w[3] = w[1] + 0.2 * torch.randn(d, generator=gen, dtype=F64)
    y = torch.tensor([1, 1, 0, 2, 5, 1, 7, 10, 4])
    x = w[y] + 0.3 * torch.randn(n, d, generator=gen, dtype=F64)
    return x, w, y


@pytest.mark.parametrize("margin,params", LOSS_MARGINS, ids=["arc", "cos", "comb"])
def test_filter_follows_paper_not_arcface_torch(margin, params):
    tau = 0.4
    x, w, y = _conflict_problem()
    with torch.no_grad():
        cos = torch.nn.functional.normalize(x, dim=1) @ torch.nn.functional.normalize(w, dim=1).t()
    n = torch.arange(len(y))
    conflict = cos > tau
    conflict[n, y] = False
    assert bool(conflict[y == 1, 3].all()), "duplicate center 3 must exceed tau for class-1 samples"
    assert bool((cos[n, y] > tau).all()), "every positive exceeds tau here"
    x.requires_grad_(True)
    w.requires_grad_(True)
    out = ds_pfc.margin_cross_entropy(x, y, w, margin=margin, filter_threshold=tau, return_details=True)
    paper = ref_loss(x, w, y, *params, tau=tau, filter_style="paper")
    insight = ref_loss(x, w, y, *params, tau=tau, filter_style="arcface_torch")
    unfiltered = ref_loss(x, w, y, *params, tau=None)
    torch.testing.assert_close(out.loss, paper, rtol=1e-12, atol=1e-12)
    assert abs(float((out.loss - insight).detach())) > 1e-3
    assert abs(float((out.loss - unfiltered).detach())) > 1e-3
    # per-sample: samples without any conflict are untouched by the filter
    per_ref = []
    for i in range(len(y)):
        per_ref.append(ref_loss(x[i:i + 1], w, y[i:i + 1], *params, tau=tau))
    torch.testing.assert_close(out.per_sample_loss, torch.stack(per_ref), rtol=1e-12, atol=1e-12)
    # gradients: a filtered center gets no gradient from the samples that filtered it
    g_x, g_w = torch.autograd.grad(out.loss, (x, w))
    r_x, r_w = torch.autograd.grad(paper, (x, w))
    torch.testing.assert_close(g_x, r_x, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(g_w, r_w, rtol=1e-10, atol=1e-12)


def test_positive_never_filtered_even_above_tau():
    """tau = -1: every negative is filtered; the positive stays, so each sample's
    denominator holds its target alone and the loss is exactly 0."""
    x, w, y = _conflict_problem()
    for margin in (ArcFace(10.0, 0.5), CosFace(10.0, 0.35)):
        out = ds_pfc.margin_cross_entropy(x, y, w, margin=margin, filter_threshold=-1.0,
                                          return_details=True)
        assert torch.equal(out.per_sample_loss, torch.zeros_like(out.per_sample_loss))
    # tau below every positive, above some negatives: target stays in the softmax
    tau = 0.4
    margin, params = LOSS_MARGINS[0]
    loss = ds_pfc.margin_cross_entropy(x, y, w, margin=margin, filter_threshold=tau)
    assert torch.isfinite(loss)
    torch.testing.assert_close(loss, ref_loss(x, w, y, *params, tau=tau), rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------- bad arguments
@pytest.mark.parametrize("factory,exc,name", [
    (lambda: ArcFace(0.0, 0.5), ValueError, "scale"),
    (lambda: ArcFace(-1.0, 0.5), ValueError, "scale"),
    (lambda: ArcFace(float("nan"), 0.5), TypeError, "scale"),
    (lambda: ArcFace(float("inf"), 0.5), TypeError, "scale"),
    (lambda: ArcFace("64", 0.5), TypeError, "scale"),
    (lambda: ArcFace(True, 0.5), TypeError, "scale"),
    (lambda: ArcFace(64.0, -0.1), ValueError, "margin"),
    (lambda: ArcFace(64.0, math.pi), ValueError, "margin"),
    (lambda: ArcFace(64.0, None), TypeError, "margin"),
    (lambda: ArcFace(64.0, 0.5, straight_through="yes"), TypeError, "straight_through"),
    (lambda: CosFace(64.0, float("nan")), TypeError, "margin"),
    (lambda: CosFace(64.0, "0.4"), TypeError, "margin"),
    (lambda: CombinedMargin(64.0, 0.0, 0.5, 0.0), ValueError, "m1"),
    (lambda: CombinedMargin(64.0, -1.0, 0.5, 0.0), ValueError, "m1"),
    (lambda: CombinedMargin(64.0, 1.0, -0.5, 0.0), ValueError, "m2"),
    (lambda: CombinedMargin(64.0, 1.0, 4.0, 0.0), ValueError, "m2"),
    (lambda: CombinedMargin(64.0, 1.0, 0.5, float("inf")), TypeError, "m3"),
])
def test_bad_margin_arguments(factory, exc, name):
    with pytest.raises(exc, match=name):
        factory()


def test_functional_rejects_non_margin():
    x, w, y = _small_problem()
    with pytest.raises(TypeError, match="margin"):
        ds_pfc.margin_cross_entropy(x, y, w, margin="arcface")
    for tau in (1.5, -1.01, float("nan"), "0.4", True):
        with pytest.raises(ValueError, match="filter_threshold"):
            ds_pfc.margin_cross_entropy(x, y, w, margin=ArcFace(), filter_threshold=tau)
