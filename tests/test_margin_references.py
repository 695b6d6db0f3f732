"""Self-tests of the float64 margin-loss oracle in ``_margin_references.py``.

Fast, CPU-only, float64.  Hand-computed cases use only ``math`` on the chosen angles, the
reductions check that each loss collapses to plain ArcFace/CosFace where the papers say
it should, and the state tests replay the official running-state update rules.
"""

import math
import statistics

import pytest
import torch

import _margin_references as ref

F64 = torch.float64
S = 64.0


# --------------------------------------------------------------------------- helpers


def _ce(rows, labels):
    """Mean cross-entropy of python-float logit rows (log-sum-exp with max shift)."""
    total = 0.0
    for row, y in zip(rows, labels):
        mx = max(row)
        total += mx + math.log(sum(math.exp(v - mx) for v in row)) - row[y]
    return total / len(rows)


def _unit(angle, norm=1.0):
    return [norm * math.cos(angle), norm * math.sin(angle)]


# Hand geometry, d=2.  Class centers at angles CENTER_ANGLES (arbitrary norms, so the
# oracle's normalisation matters); sample 0 sits 0.3 rad from its class (label 0);
# sample 1 sits 2.8 rad from its class (label 1), so theta+m > pi for m >= 0.35.
CENTER_ANGLES = [0.0, 2.0, -2.2]
CENTER_NORMS = [2.0, 0.5, 3.0]
SAMPLE_ANGLES = [0.3, 4.8]
LABELS = [0, 1]


def _hand_inputs(sample_norms=(5.0, 7.0)):
    weight = torch.tensor([_unit(a, n) for a, n in zip(CENTER_ANGLES, CENTER_NORMS)], dtype=F64)
    emb = torch.tensor([_unit(a, n) for a, n in zip(SAMPLE_ANGLES, sample_norms)], dtype=F64)
    labels = torch.tensor(LABELS, dtype=torch.int64)
    return emb, weight, labels


def _hand_cos():
    """cos(sample_i, class_j) from the angles alone."""
    return [[math.cos(sa - ca) for ca in CENTER_ANGLES] for sa in SAMPLE_ANGLES]


def _rand_problem(seed=0, N=6, C=5, d=8, emb_scale=1.0, near=True):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(C, d, generator=g, dtype=F64) * (0.5 + torch.rand(C, 1, generator=g, dtype=F64))
    labels = torch.randint(0, C, (N,), generator=g)
    if near:  # samples near their class center: moderate target angles
        emb = torch.nn.functional.normalize(weight[labels]) * 2 + 0.6 * torch.randn(N, d, generator=g, dtype=F64)
    else:
        emb = torch.randn(N, d, generator=g, dtype=F64)
    return emb * emb_scale, weight, labels


def _grads(fn, emb, weight):
    emb = emb.clone().requires_grad_(True)
    weight = weight.clone().requires_grad_(True)
    out = fn(emb, weight)
    loss = out[0] if isinstance(out, tuple) else out
    ge, gw = torch.autograd.grad(loss, (emb, weight))
    return loss.detach(), ge, gw


def _assert_same(fn_a, fn_b, emb, weight, rtol=1e-11, atol=1e-12):
    la, gea, gwa = _grads(fn_a, emb, weight)
    lb, geb, gwb = _grads(fn_b, emb, weight)
    torch.testing.assert_close(la, lb, rtol=rtol, atol=atol)
    torch.testing.assert_close(gea, geb, rtol=rtol, atol=atol)
    torch.testing.assert_close(gwa, gwb, rtol=rtol, atol=atol)


# --------------------------------------------------------------------------- hand-computed cases


def test_arcface_hand_computed_all_three_pi_conventions():
    emb, weight, labels = _hand_inputs()
    cos = _hand_cos()
    m = 0.5
    assert SAMPLE_ANGLES[1] - CENTER_ANGLES[1] + m > math.pi  # sample 1 is past the pi boundary

    def rows(t0, t1):
        return [[S * t0, S * cos[0][1], S * cos[0][2]], [S * cos[1][0], S * t1, S * cos[1][2]]]

    t0 = math.cos(0.3 + m)  # ordinary branch
    expected_threshold = _ce(rows(t0, math.cos(2.8) - math.sin(math.pi - m) * m), LABELS)
    expected_plain = _ce(rows(t0, math.cos(2.8 + m)), LABELS)
    expected_easy = _ce(rows(t0, math.cos(2.8)), LABELS)  # cos(2.8) < 0 -> unchanged

    got = ref.arcface_loss(emb, weight, labels, m=m)
    assert abs(got.item() - expected_threshold) < 1e-10
    got = ref.arcface_loss(emb, weight, labels, m=m, threshold=False)
    assert abs(got.item() - expected_plain) < 1e-10
    got = ref.arcface_loss(emb, weight, labels, m=m, easy_margin=True)
    assert abs(got.item() - expected_easy) < 1e-10
    # arcface_torch HEAD: plain forward value
    got = ref.arcface_loss(emb, weight, labels, m=m, threshold=False, straight_through=True)
    assert abs(got.item() - expected_plain) < 1e-10


def test_cosface_hand_computed():
    emb, weight, labels = _hand_inputs()
    cos = _hand_cos()
    m = 0.4
    rows = [[S * (cos[0][0] - m), S * cos[0][1], S * cos[0][2]],
            [S * cos[1][0], S * (cos[1][1] - m), S * cos[1][2]]]
    got = ref.cosface_loss(emb, weight, labels, m=m)
    assert abs(got.item() - _ce(rows, LABELS)) < 1e-10


def test_adaface_hand_computed_uses_freshly_updated_stats():
    # t_alpha=1: the stats become exactly this batch's mean / unbiased std, so the margin
    # scaler is only right if the update happens BEFORE the scaler is computed.
    norms = (10.0, 30.0)
    emb, weight, labels = _hand_inputs(norms)
    cos = _hand_cos()
    m, h, eps = 0.4, 0.333, 1e-3
    mean, std = statistics.mean(norms), statistics.stdev(norms)
    scalers = [max(-1.0, min(1.0, (n - mean) / (std + eps) * h)) for n in norms]
    targets = []
    for theta, sc in zip((0.3, 2.8), scalers):
        g_ang = -m * sc
        theta_m = min(max(theta + g_ang, eps), math.pi - eps)
        targets.append(math.cos(theta_m) - (m + m * sc))
    rows = [[S * targets[0], S * cos[0][1], S * cos[0][2]],
            [S * cos[1][0], S * targets[1], S * cos[1][2]]]
    loss, state = ref.adaface_loss(emb, weight, labels, ref.adaface_initial_state(), m=m, h=h, t_alpha=1.0)
    assert abs(loss.item() - _ce(rows, LABELS)) < 1e-10
    assert abs(state["batch_mean"].item() - mean) < 1e-12
    assert abs(state["batch_std"].item() - std) < 1e-12
    # with the stale initial stats (20, 100) the answer would differ:
    stale = [max(-1.0, min(1.0, (n - 20.0) / (100.0 + eps) * h)) for n in norms]
    assert abs(stale[0] - scalers[0]) > 0.1


def test_magface_hand_computed():
    norms = (20.0, 60.0)
    emb, weight, labels = _hand_inputs(norms)
    cos = _hand_cos()
    l_a, u_a, l_m, u_m, lam = 10.0, 110.0, 0.45, 0.8, 35.0
    ms = [(u_m - l_m) / (u_a - l_a) * (n - l_a) + l_m for n in norms]
    assert 2.8 + ms[1] > math.pi
    t0 = math.cos(0.3 + ms[0])
    t1 = math.cos(2.8) - math.sin(math.pi - ms[1]) * ms[1]  # per-sample threshold branch
    rows = [[S * t0, S * cos[0][1], S * cos[0][2]], [S * cos[1][0], S * t1, S * cos[1][2]]]
    reg = statistics.mean(n / u_a ** 2 + 1 / n for n in norms)
    got = ref.magface_loss(emb, weight, labels)
    assert abs(got.item() - (_ce(rows, LABELS) + lam * reg)) < 1e-10
    # easy margin (the official MagLinear default): sample 1 has cos < 0 -> unchanged
    rows_easy = [[S * t0, S * cos[0][1], S * cos[0][2]], [S * cos[1][0], S * math.cos(2.8), S * cos[1][2]]]
    got = ref.magface_loss(emb, weight, labels, easy_margin=True)
    assert abs(got.item() - (_ce(rows_easy, LABELS) + lam * reg)) < 1e-10


def test_curricularface_hand_computed_hard_negatives_and_order():
    # Add a 4th class that sample 1 sees at cosine -0.99: between cos(theta_y+m) = cos(3.3)
    # and the thresholded target cos(2.8) - sin(pi-m)m.  The official mask compares with the
    # UN-thresholded cos(theta_y+m), so this column is NOT a hard negative.
    extra_angle = 4.8 - math.acos(-0.99)
    angles = CENTER_ANGLES + [extra_angle]
    weight = torch.tensor([_unit(a, 1.0 + i) for i, a in enumerate(angles)], dtype=F64)
    emb = torch.tensor([_unit(a, 3.0) for a in SAMPLE_ANGLES], dtype=F64)
    labels = torch.tensor(LABELS, dtype=torch.int64)
    cos = [[math.cos(sa - ca) for ca in angles] for sa in SAMPLE_ANGLES]
    m, t0 = 0.5, 0.2
    cos_tm = [math.cos(0.3 + m), math.cos(2.8 + m)]
    t_new = 0.01 * statistics.mean([math.cos(0.3), math.cos(2.8)]) + 0.99 * t0
    finals = [cos_tm[0], math.cos(2.8) - math.sin(math.pi - m) * m]
    assert finals[1] < -0.99 < cos_tm[1]
    rows = []
    for i in range(2):
        row = []
        for j in range(4):
            c = cos[i][j]
            if j == LABELS[i]:
                v = finals[i]
            elif c > cos_tm[i]:
                v = c * (t_new + c)
            else:
                v = c
            row.append(S * v)
        rows.append(row)
    n_hard = sum(1 for i in range(2) for j in range(4) if j != LABELS[i] and cos[i][j] > cos_tm[i])
    assert n_hard == 2  # sample 1's classes 0 and 2
    loss, state = ref.curricularface_loss(emb, weight, labels, {"t": t0}, m=m)
    assert abs(state["t"].item() - t_new) < 1e-14
    assert abs(loss.item() - _ce(rows, LABELS)) < 1e-10


# --------------------------------------------------------------------------- reductions


def test_adaface_h0_is_cosface():
    emb, weight, labels = _rand_problem(1, emb_scale=5.0)
    state = ref.adaface_initial_state()
    _assert_same(lambda e, w: ref.adaface_loss(e, w, labels, state, h=0.0, m=0.4),
                 lambda e, w: ref.cosface_loss(e, w, labels, m=0.4), emb, weight)


def test_adaface_saturated_low_norm_is_plain_arcface():
    # frozen stats (t_alpha=0) far above the norms: margin_scaler clips to -1, so
    # g_angular = m and g_add = 0: plain cos(theta + m) (no threshold; clip at pi-eps unused)
    emb, weight, labels = _rand_problem(2)
    state = {"batch_mean": torch.tensor(50.0, dtype=F64), "batch_std": torch.tensor(1.0, dtype=F64)}
    cos_t = ref._normalized_cosines(emb, weight).gather(1, labels.view(-1, 1))
    assert float(cos_t.acos().max()) + 0.4 < math.pi - 1e-3 and float(cos_t.max()) < 1 - 1e-3
    _assert_same(lambda e, w: ref.adaface_loss(e, w, labels, state, m=0.4, t_alpha=0.0),
                 lambda e, w: ref.arcface_loss(e, w, labels, m=0.4, threshold=False), emb, weight)
    _, new_state = ref.adaface_loss(emb, weight, labels, state, t_alpha=0.0)
    assert new_state["batch_mean"].item() == 50.0 and new_state["batch_std"].item() == 1.0


def test_adaface_gradient_flows_only_through_normalisation():
    emb, weight, labels = _rand_problem(3, emb_scale=4.0)
    _, ge, gw = _grads(lambda e, w: ref.adaface_loss(e, w, labels, ref.adaface_initial_state()), emb, weight)
    radial = (ge * emb).sum(dim=1)
    assert radial.abs().max() < 1e-12 * ge.abs().max() * emb.abs().max() * 10
    assert ge.abs().max() > 1e-3 and torch.isfinite(gw).all()


@pytest.mark.parametrize("easy", [False, True])
def test_magface_constant_margin_is_arcface_plus_regulariser(easy):
    emb, weight, labels = _rand_problem(4, emb_scale=12.0)
    norms = emb.norm(dim=1)
    assert float(norms.min()) > 10 and float(norms.max()) < 110
    lam, u_a = 35.0, 110.0

    def arc_plus_reg(e, w):
        x = e.norm(dim=1, keepdim=True).clamp(10.0, u_a)
        reg = torch.mean(x / u_a ** 2 + 1 / x)
        return ref.arcface_loss(e, w, labels, m=0.5, easy_margin=easy) + lam * reg

    _assert_same(lambda e, w: ref.magface_loss(e, w, labels, l_m=0.5, u_m=0.5, easy_margin=easy),
                 arc_plus_reg, emb, weight)


def test_elastic_equal_margins_are_arcface_and_cosface():
    emb, weight, labels = _rand_problem(5)
    n = labels.shape[0]
    arc_m = torch.full((n,), 0.5, dtype=F64)
    cos_m = torch.full((n,), 0.35, dtype=F64)
    for plus in (False, True):
        _assert_same(lambda e, w: ref.elastic_arcface_loss(e, w, labels, arc_m, plus=plus),
                     lambda e, w: ref.arcface_loss(e, w, labels, m=0.5, threshold=False), emb, weight)
        _assert_same(lambda e, w: ref.elastic_cosface_loss(e, w, labels, cos_m, plus=plus),
                     lambda e, w: ref.cosface_loss(e, w, labels, m=0.35), emb, weight)


def test_subcenter_k1_and_replicated_centers_are_arcface():
    emb, weight, labels = _rand_problem(6)
    for kw in ({}, {"threshold": False}, {"easy_margin": True}):
        _assert_same(lambda e, w: ref.subcenter_arcface_loss(e, w, labels, k=1, **kw),
                     lambda e, w: ref.arcface_loss(e, w, labels, **kw), emb, weight)
    # k=3 identical sub-centers per class: same loss; the weight gradient lands on one
    # sub-center per class and sums to ArcFace's
    k = 3
    l_sc, ge_sc, gw_sc = _grads(lambda e, w: ref.subcenter_arcface_loss(e, w, labels, k=k),
                                emb, weight.repeat_interleave(k, dim=0))
    l_a, ge_a, gw_a = _grads(lambda e, w: ref.arcface_loss(e, w, labels), emb, weight)
    torch.testing.assert_close(l_sc, l_a, rtol=1e-12, atol=0)
    torch.testing.assert_close(ge_sc, ge_a, rtol=1e-11, atol=1e-12)
    torch.testing.assert_close(gw_sc.view(-1, k, weight.shape[1]).sum(1), gw_a, rtol=1e-11, atol=1e-12)


def test_subcenter_class_cosine_is_max_over_subcenters():
    emb, weight, labels = _rand_problem(7, C=4)
    k = 2
    w_sc = torch.cat([weight, -weight + 0.3], dim=0)[torch.tensor([0, 4, 1, 5, 2, 6, 3, 7])]  # rows c*k+j
    cos = ref.subcenter_cosines(emb, w_sc, k=k)
    full = torch.nn.functional.normalize(emb) @ torch.nn.functional.normalize(w_sc).t()
    torch.testing.assert_close(cos, torch.maximum(full[:, 0::2], full[:, 1::2]), rtol=0, atol=1e-15)


def test_curricularface_without_hard_negatives_is_arcface():
    d, C, N = 8, 5, 6
    g = torch.Generator().manual_seed(8)
    weight = torch.eye(C, d, dtype=F64) * (1 + torch.rand(C, 1, generator=g, dtype=F64))
    labels = torch.tensor([0, 1, 2, 3, 4, 0])
    emb = torch.eye(C, d, dtype=F64)[labels] * 3 + 0.1 * torch.randn(N, d, generator=g, dtype=F64)
    cos = ref._normalized_cosines(emb, weight)
    cos_tm = torch.cos(cos.gather(1, labels.view(-1, 1)).acos() + 0.5)
    others = cos.masked_fill(torch.nn.functional.one_hot(labels, C).bool(), -2)
    assert (others <= cos_tm).all()  # precondition: no hard negatives
    state = ref.curricularface_initial_state()
    assert float(state["t"]) == 0.0
    _assert_same(lambda e, w: ref.curricularface_loss(e, w, labels, state),
                 lambda e, w: ref.arcface_loss(e, w, labels, m=0.5), emb, weight)


def test_curricularface_hard_negative_gradient_treats_t_as_constant():
    emb, weight, labels = _rand_problem(9, near=False)
    state = {"t": torch.tensor(0.3, dtype=F64)}
    _, new_state = ref.curricularface_loss(emb, weight, labels, state)
    t_new = new_state["t"]

    def manual(e, w):  # independent re-statement with t frozen at the updated value
        c = (e / e.norm(dim=1, keepdim=True)) @ (w / w.norm(dim=1, keepdim=True)).t()
        c = c.clamp(-1, 1)
        ct = c.gather(1, labels.view(-1, 1))
        ctm = torch.cos(ct.acos() + 0.5)
        hard = (c > ctm.detach())
        z = torch.where(hard, c * (t_new + c), c)
        tgt = torch.where(ct > math.cos(math.pi - 0.5), ctm, ct - math.sin(math.pi - 0.5) * 0.5)
        z = torch.where(torch.nn.functional.one_hot(labels, c.shape[1]).bool(), tgt, z)
        return torch.nn.functional.cross_entropy(z * S, labels)

    _assert_same(lambda e, w: ref.curricularface_loss(e, w, labels, state), manual, emb, weight, rtol=1e-10)


def test_arcface_straight_through_gradient():
    emb, weight, labels = _rand_problem(10)
    loss, ge, gw = _grads(lambda e, w: ref.arcface_loss(e, w, labels, threshold=False, straight_through=True),
                          emb, weight)
    plain = ref.arcface_loss(emb, weight, labels, threshold=False)
    torch.testing.assert_close(loss, plain, rtol=1e-12, atol=0)

    def surrogate(e, w):  # d loss / d cos = s * (softmax(modified logits) - onehot) / N
        c = ref._normalized_cosines(e, w)
        with torch.no_grad():
            onehot = torch.nn.functional.one_hot(labels, c.shape[1]).to(F64)
            p = torch.softmax(S * torch.cos(c.acos() + 0.5 * onehot), dim=1)
        return (S * c * (p - onehot)).sum() / c.shape[0]

    _, ge_s, gw_s = _grads(surrogate, emb, weight)
    torch.testing.assert_close(ge, ge_s, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(gw, gw_s, rtol=1e-10, atol=1e-12)


# --------------------------------------------------------------------------- running states


def test_adaface_running_stats_three_steps():
    state = ref.adaface_initial_state()
    assert state["batch_mean"].item() == 20.0 and state["batch_std"].item() == 100.0
    mean_ref, std_ref = 20.0, 100.0
    _, weight, _ = _rand_problem(11, C=4, d=3)
    batches = [(3.0, 15.0, 40.0), (150.0, 22.0, 8.0, 61.0), (0.0005, 9.0)]  # 150 -> clipped to 100, 5e-4 -> 1e-3
    g = torch.Generator().manual_seed(12)
    for norms in batches:
        dirs = torch.nn.functional.normalize(torch.randn(len(norms), 3, generator=g, dtype=F64))
        emb = dirs * torch.tensor(norms, dtype=F64).view(-1, 1)
        labels = torch.randint(0, 4, (len(norms),), generator=g)
        loss, state = ref.adaface_loss(emb, weight, labels, state)
        assert torch.isfinite(loss)
        safe = [min(max(n, 0.001), 100.0) for n in norms]
        mean_ref = statistics.mean(safe) * 0.01 + (1 - 0.01) * mean_ref
        std_ref = statistics.stdev(safe) * 0.01 + (1 - 0.01) * std_ref
        assert abs(state["batch_mean"].item() - mean_ref) < 1e-11
        assert abs(state["batch_std"].item() - std_ref) < 1e-11


def test_curricularface_t_three_steps():
    state = ref.curricularface_initial_state()
    t_ref = 0.0
    for step in range(3):
        emb, weight, labels = _rand_problem(20 + step, near=step != 1)
        cos_y = [float(torch.dot(emb[i], weight[labels[i]]) / (emb[i].norm() * weight[labels[i]].norm()))
                 for i in range(labels.shape[0])]
        loss, new_state = ref.curricularface_loss(emb, weight, labels, state)
        t_ref = statistics.mean(cos_y) * 0.01 + (1 - 0.01) * t_ref
        assert abs(new_state["t"].item() - t_ref) < 1e-13
        assert float(state["t"]) != float(new_state["t"])  # input state not mutated
        assert torch.isfinite(loss)
        state = new_state


def test_states_are_not_mutated():
    emb, weight, labels = _rand_problem(13)
    s0 = ref.adaface_initial_state()
    ref.adaface_loss(emb, weight, labels, s0)
    assert s0["batch_mean"].item() == 20.0 and s0["batch_std"].item() == 100.0


# --------------------------------------------------------------------------- ElasticFace+ / sub-center dominance


def test_elastic_plus_official_indexing():
    cos_t = torch.tensor([0.1, 0.9, 0.5], dtype=F64)
    margins = torch.tensor([0.6, 0.4, 0.5], dtype=F64)
    # sorted margins [0.4, 0.5, 0.6]; descending-cosine order [1, 2, 0]
    official = ref.elastic_margins_plus(cos_t, margins)
    torch.testing.assert_close(official, torch.tensor([0.5, 0.6, 0.4], dtype=F64), rtol=0, atol=0)
    ranked = ref.elastic_margins_plus(cos_t, margins, official_indexing=False)
    torch.testing.assert_close(ranked, torch.tensor([0.6, 0.4, 0.5], dtype=F64), rtol=0, atol=0)


def test_elastic_plus_loss_uses_reassigned_margins():
    emb, weight, labels = _rand_problem(14)
    g = torch.Generator().manual_seed(15)
    margins = 0.5 + 0.05 * torch.randn(labels.shape[0], generator=g, dtype=F64)
    cos_t = ref._elastic_cosines(emb, weight).gather(1, labels.view(-1, 1)).view(-1)
    reassigned = ref.elastic_margins_plus(cos_t, margins)
    assert sorted(reassigned.tolist()) == sorted(margins.tolist())
    for fn in (ref.elastic_arcface_loss, ref.elastic_cosface_loss):
        _assert_same(lambda e, w: fn(e, w, labels, margins, plus=True),
                     lambda e, w: fn(e, w, labels, reassigned), emb, weight)


def test_elastic_hand_computed_per_sample_margins():
    emb, weight, labels = _hand_inputs()
    cos = _hand_cos()
    margins = torch.tensor([0.45, 0.55], dtype=F64)
    rows = [[S * math.cos(0.3 + 0.45), S * cos[0][1], S * cos[0][2]],
            [S * cos[1][0], S * math.cos(2.8 + 0.55), S * cos[1][2]]]  # plain: wraps past pi
    assert abs(ref.elastic_arcface_loss(emb, weight, labels, margins).item() - _ce(rows, LABELS)) < 1e-10
    rows = [[S * (cos[0][0] - 0.45), S * cos[0][1], S * cos[0][2]],
            [S * cos[1][0], S * (cos[1][1] - 0.55), S * cos[1][2]]]
    assert abs(ref.elastic_cosface_loss(emb, weight, labels, margins).item() - _ce(rows, LABELS)) < 1e-10


def test_dominant_subcenters_and_drop():
    k, C = 3, 3
    sub_angles = [[0.0, 2.0, 4.0], [1.0, 3.0, 5.0], [0.5, 2.5, 4.5]]  # class 2 has no samples
    weight = torch.tensor([_unit(a, 1.0 + j) for row in sub_angles for j, a in enumerate(row)], dtype=F64)
    samples = [(0.1, 0), (-0.2, 0), (2.1, 0),   # class 0: sub-center 0 twice, 1 once -> 0
               (3.05, 1), (5.1, 1)]             # class 1: one each for 1 and 2 -> tie -> 1
    emb = torch.tensor([_unit(a, 2.0) for a, _ in samples], dtype=F64)
    labels = torch.tensor([c for _, c in samples], dtype=torch.int64)
    dom = ref.dominant_subcenters(emb, weight, labels, k=k)
    assert dom.dtype == torch.int64 and dom.tolist() == [0, 1, 0]
    keep = ref.subcenter_drop_mask(emb, weight, labels, k=k, threshold_deg=75.0)
    # angles to the dominant center: 0.1, 0.2, 2.1 (dropped), 0.05, 2.1 (dropped)
    assert keep.tolist() == [True, True, False, True, False]


# --------------------------------------------------------------------------- autograd


@pytest.mark.parametrize("name", ["arc_th", "arc_plain", "arc_easy", "cos", "mag", "mag_easy", "earc", "ecos", "sub"])
def test_gradcheck(name):
    emb, weight, labels = _rand_problem(30, N=3, C=4, d=5)
    g = torch.Generator().manual_seed(31)
    margins = 0.5 + 0.05 * torch.randn(3, generator=g, dtype=F64)
    fns = {
        "arc_th": lambda e, w: ref.arcface_loss(e, w, labels),
        "arc_plain": lambda e, w: ref.arcface_loss(e, w, labels, threshold=False),
        "arc_easy": lambda e, w: ref.arcface_loss(e, w, labels, easy_margin=True),
        "cos": lambda e, w: ref.cosface_loss(e, w, labels),
        "mag": lambda e, w: ref.magface_loss(e * 15, w, labels),
        "mag_easy": lambda e, w: ref.magface_loss(e * 15, w, labels, easy_margin=True),
        "earc": lambda e, w: ref.elastic_arcface_loss(e, w, labels, margins),
        "ecos": lambda e, w: ref.elastic_cosface_loss(e, w, labels, margins),
        "sub": lambda e, w: ref.subcenter_arcface_loss(e, w.repeat(2, 1) * torch.tensor(
            [[1.0]] * 4 + [[-0.7]] * 4, dtype=F64), labels, k=2),
    }
    assert torch.autograd.gradcheck(fns[name], (emb.requires_grad_(), weight.requires_grad_()))
