"""``PartialFC`` as a module: gradient accumulation, checkpoints, centers, memory
report, bad input (DESIGN.md 3 "Bad input gets a clear error and changes nothing")
and reduced-precision compute.

Single process (no process group: the head is rank 0 of 1). Expected values come
from a float64 margin-softmax reference written here and from ``torch.optim``.
"""
from __future__ import annotations

import copy
import io

import pytest
import torch

from _reference import arcface_ref_loss
from ds_pfc import ArcFace, CosFace, PartialFC

F64 = torch.float64
C, D, N = 211, 7, 37
SCALE, MARGIN = 16.0, 0.4


def ref_loss(x, w, target_col, scale=SCALE, m=MARGIN):
    return arcface_ref_loss(x, w, target_col, scale, m)


def make_head(num_classes=C, embedding_size=D, **kw):
    args = dict(sample_rate=0.2, margin=ArcFace(SCALE, MARGIN), seed=5, dtype=F64)
    if "optimizer" not in kw:
        args.update(optimizer="sgd", momentum=0.9, weight_decay=5e-4)
    args.update(kw)
    return PartialFC(num_classes, embedding_size, **args)


def batch(gen, n=N, num_classes=C, d=D, dtype=F64):
    return torch.randn(n, d, generator=gen, dtype=dtype), torch.randint(0, num_classes, (n,), generator=gen)


def snapshot(head):
    """Everything a failed call must leave alone."""
    return (copy.deepcopy(head.state_dict()), head.sample_step, head.step_count, head.seed,
            len(head._pending))


def assert_same_snapshot(a, b):
    sd_a, *rest_a = a
    sd_b, *rest_b = b
    assert rest_a == rest_b
    assert sd_a.keys() == sd_b.keys()
    for k in sd_a:
        assert torch.equal(sd_a[k], sd_b[k]), k


# ---------------------------------------------------------------- accumulation
OPTS = {
    "sgd": (dict(optimizer="sgd", momentum=0.9, weight_decay=5e-4),
            lambda p, lr: torch.optim.SGD([p], lr=lr, momentum=0.9, weight_decay=5e-4)),
    "adamw": (dict(optimizer="adamw", betas=(0.9, 0.99), eps=1e-7, weight_decay=0.01),
              lambda p, lr: torch.optim.AdamW([p], lr=lr, betas=(0.9, 0.99), eps=1e-7, weight_decay=0.01,
                                              foreach=False)),
}


@pytest.mark.parametrize("sample_rate", [0.2, 1.0])
@pytest.mark.parametrize("opt", list(OPTS))
def test_accumulation_equals_one_step_with_summed_gradient(opt, sample_rate):
    head_kw, make_opt = OPTS[opt]
    head = make_head(sample_rate=sample_rate, **head_kw)
    w0 = head.centers()
    gen = torch.Generator().manual_seed(1)
    (x1, y1), (x2, y2) = batch(gen), batch(gen, n=23)
    grad = torch.zeros_like(w0)
    union = torch.zeros(C, dtype=torch.bool)
    for step, (x, y) in enumerate(((x1, y1), (x2, y2))):
        active = head.active_set(y, step)
        active = torch.arange(C) if active is None else active
        col = {c: j for j, c in enumerate(active.tolist())}
        w = w0[active].clone().requires_grad_(True)
        loss = ref_loss(x, w, torch.tensor([col[c] for c in y.tolist()]))
        (g,) = torch.autograd.grad(loss, w)
        grad[active] += g
        union[active] = True
        out = head(x, y)
        torch.testing.assert_close(out.detach(), loss.detach(), rtol=1e-12, atol=1e-12)
        out.backward()
    if sample_rate < 1:
        a1, a2 = head.active_set(y1, 0), head.active_set(y2, 1)
        assert not torch.equal(a1, a2) and bool(torch.isin(a1, a2).any()), "want overlapping, distinct sets"
    lr = 0.05
    assert head.step(lr) == int(union.sum())
    assert head.step_count == 1 and head.sample_step == 2
    expected = w0.clone()
    for i in torch.nonzero(union).squeeze(1).tolist():
        p = torch.nn.Parameter(w0[i].clone())
        p.grad = grad[i].clone()
        make_opt(p, lr).step()
        expected[i] = p.detach()
    got = head.centers()
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-14)
    assert torch.equal(got[~union], w0[~union])


def test_accumulation_keeps_one_gradient_not_one_per_micro_batch(monkeypatch):
    """With the device bank, each micro step's staged centers and gradient are folded
    into one accumulator at the next forward and released; the update is bitwise the
    one of keeping them all until the step."""
    import gc
    import weakref
    head, twin = make_head(sample_rate=0.2), make_head(sample_rate=0.2)
    monkeypatch.setattr(twin, "_fold_finished", lambda: None)      # keeps every micro step
    gen = torch.Generator().manual_seed(4)
    batches = [batch(gen) for _ in range(4)]
    staged = []
    for i, b in enumerate(batches):
        head(*b).backward()
        twin(*b).backward()
        staged.append(weakref.ref(head._pending[-1][1]))
        assert len(head._pending) == 1, "earlier micro steps live on as one accumulator"
        if i:
            assert head._acc is not None and head._acc[1].shape[0] == head._acc[0].numel()
    gc.collect()
    assert all(ref() is None for ref in staged[:-1]), "staged centers of folded micro steps are released"
    assert len(twin._pending) == 4
    assert head.step(0.1) == twin.step(0.1)
    assert torch.equal(head.centers(), twin.centers())
    assert torch.equal(head.state_dict()["momentum_buffer"], twin.state_dict()["momentum_buffer"])


def test_zero_grad_forgets_accumulated_passes():
    head, twin = make_head(), make_head()
    gen = torch.Generator().manual_seed(2)
    b1, b2 = batch(gen), batch(gen)
    head(*b1).backward()
    head.zero_grad()
    head(*b2).backward()
    head.step(0.1)
    # twin: same sample steps (the sampler advanced for b1), only b2's gradient
    with torch.no_grad():
        twin.sample_step = 1
    twin(*b2).backward()
    twin.step(0.1)
    assert torch.equal(head.centers(), twin.centers())


def test_inference_forward_changes_nothing():
    head = make_head()
    gen = torch.Generator().manual_seed(3)
    x, y = batch(gen)
    before = snapshot(head)
    with torch.no_grad():
        l1 = head(x, y)
    head.eval()
    l2 = head(x, y)
    assert head.step(0.1) == 0
    head.train()
    assert_same_snapshot(before, snapshot(head))
    assert torch.equal(l1, l2.detach())


# ---------------------------------------------------------------- state_dict
def train(head, gen, steps, lr=0.1, dtype=F64):
    losses = []
    for _ in range(steps):
        x, y = batch(gen, num_classes=head.num_classes, d=head.embedding_size, dtype=dtype)
        loss = head(x, y)
        loss.backward()
        head.step(lr)
        losses.append(loss.detach())
    return losses


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_state_dict_contents(opt):
    head = make_head(**OPTS[opt][0])
    train(head, torch.Generator().manual_seed(4), 3)
    sd = head.state_dict()
    expected_states = {"sgd": {"momentum_buffer"}, "adamw": {"exp_avg", "exp_avg_sq", "step"}}[opt]
    assert {"weight"} | expected_states <= set(sd)
    assert torch.equal(sd["weight"], head.centers())
    assert sd["weight"].shape == (C, D) and sd["weight"].dtype == F64
    for name in expected_states:
        assert sd[name].shape[0] == C
        assert bool((sd[name] != 0).any()), f"{name} was never written"
    # sampler state, step count and class range travel in the checkpoint
    meta = dict(zip(PartialFC._META_FIELDS, sd["meta"].tolist()))
    assert meta["num_classes"] == C and meta["embedding_size"] == D
    assert meta["class_start"] == 0 and meta["num_local"] == C
    assert meta["seed"] == 5 and meta["sample_step"] == 3 and meta["step_count"] == 3
    assert meta["world_size"] == 1
    # the checkpoint is a copy: training on does not change it
    saved = copy.deepcopy(sd)
    train(head, torch.Generator().manual_seed(5), 1)
    for k in sd:
        assert torch.equal(sd[k], saved[k]), k


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_state_dict_round_trip_continues_identical_trajectory(opt):
    kw = OPTS[opt][0]
    head = make_head(**kw)
    train(head, torch.Generator().manual_seed(6), 3)
    buf = io.BytesIO()
    torch.save(head.state_dict(), buf)
    buf.seek(0)
    resumed = make_head(seed=99, **kw)   # different seed: the checkpoint's wins
    resumed.load_state_dict(torch.load(buf))
    assert (resumed.seed, resumed.sample_step, resumed.step_count) == (5, 3, 3)
    gen_a, gen_b = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    la = train(head, gen_a, 4)
    lb = train(resumed, gen_b, 4)
    assert all(torch.equal(a, b) for a, b in zip(la, lb))
    sa, sb = head.state_dict(), resumed.state_dict()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


@pytest.mark.parametrize("other", [dict(num_classes=C + 1), dict(num_classes=C - 2),
                                   dict(embedding_size=D + 1)])
def test_load_checkpoint_for_other_size_raises_and_changes_nothing(other):
    source = make_head(**other)
    train(source, torch.Generator().manual_seed(8), 1)
    sd = source.state_dict()
    head = make_head()
    train(head, torch.Generator().manual_seed(9), 2)
    before = snapshot(head)
    name = next(iter(other))
    with pytest.raises(ValueError, match=name):
        head.load_state_dict(sd)
    assert_same_snapshot(before, snapshot(head))


def test_load_checkpoint_with_bad_tensors_raises_and_changes_nothing():
    head = make_head()
    train(head, torch.Generator().manual_seed(10), 2)
    source = make_head(seed=42)   # a checkpoint that would change every tensor of head
    train(source, torch.Generator().manual_seed(19), 3)
    good = source.state_dict()
    before = snapshot(head)
    for k in ("weight", "momentum_buffer"):
        assert not torch.equal(good[k], before[0][k])
    missing = {k: v for k, v in good.items() if k != "momentum_buffer"}
    with pytest.raises(ValueError, match="momentum_buffer"):
        head.load_state_dict(missing)
    bad_shape = dict(good, momentum_buffer=torch.zeros(C, D + 1, dtype=F64))
    with pytest.raises(ValueError, match="momentum_buffer"):
        head.load_state_dict(bad_shape)
    shifted = dict(good, meta=good["meta"].clone())
    shifted["meta"][PartialFC._META_FIELDS.index("class_start")] = 3
    with pytest.raises(ValueError, match="class_start"):
        head.load_state_dict(shifted)
    assert_same_snapshot(before, snapshot(head))


def test_strict_load_rejects_extra_optimizer_state():
    source = make_head(optimizer="adamw")
    train(source, torch.Generator().manual_seed(11), 1)
    head = make_head(optimizer="sgd", momentum=0.0)
    before = snapshot(head)
    with pytest.raises((ValueError, RuntimeError), match="exp_avg"):
        head.load_state_dict(source.state_dict(), strict=True)
    assert_same_snapshot(before, snapshot(head))


def test_seed_outside_int64_rejected_or_round_trips():
    try:
        head = PartialFC(C, D, seed=2 ** 63 + 5)
    except (TypeError, ValueError) as err:
        assert "seed" in str(err)
        return
    resumed = PartialFC(C, D)
    resumed.load_state_dict(head.state_dict())
    assert resumed.seed == head.seed


# ---------------------------------------------------------------- centers
def test_centers_and_load_centers():
    head = make_head()
    train(head, torch.Generator().manual_seed(12), 2)
    centers = head.centers()
    assert centers.shape == (C, D) and centers.dtype == F64
    centers.zero_()                               # a copy: the head is unaffected
    assert bool((head.centers() != 0).any())
    momentum = head.state_dict()["momentum_buffer"]
    new = torch.randn(C, D, generator=torch.Generator().manual_seed(13), dtype=torch.float32)
    head.load_centers(new)
    assert torch.equal(head.centers(), new.to(F64))
    assert torch.equal(head.state_dict()["momentum_buffer"], momentum)   # optimizer state kept
    # the loaded centers are what the next loss uses
    x, y = batch(torch.Generator().manual_seed(14))
    active = head.active_set(y)
    col = {c: j for j, c in enumerate(active.tolist())}
    ref = ref_loss(x, new.to(F64)[active], torch.tensor([col[c] for c in y.tolist()]))
    torch.testing.assert_close(head(x, y).detach(), ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("bad,exc", [
    (torch.zeros(C + 1, D, dtype=F64), ValueError),
    (torch.zeros(C, D + 1, dtype=F64), ValueError),
    (torch.zeros(C * D, dtype=F64), ValueError),
    (torch.zeros(C, D, dtype=torch.int64), TypeError),
    (torch.full((C, D), float("nan"), dtype=F64), ValueError),
    (torch.full((C, D), float("inf"), dtype=F64), ValueError),
    ([[0.0] * D] * C, TypeError),
])
def test_load_centers_bad_input(bad, exc):
    head = make_head()
    train(head, torch.Generator().manual_seed(15), 1)
    before = snapshot(head)
    with pytest.raises(exc, match="centers"):
        head.load_centers(bad)
    assert_same_snapshot(before, snapshot(head))


# ---------------------------------------------------------------- memory report
@pytest.mark.parametrize("kw,rows_of_d,extra_per_row", [
    (dict(optimizer="sgd", momentum=0.9, dtype=torch.float32), 2, 0),
    (dict(optimizer="sgd", momentum=0.0, dtype=torch.float32), 1, 0),
    (dict(optimizer="sgd", momentum=0.9, dtype=F64), 2, 0),
    (dict(optimizer="adamw", dtype=torch.float32), 3, 4),   # + int32 step per row
    (dict(optimizer="adamw", dtype=F64), 3, 4),
])
def test_resident_bytes(kw, rows_of_d, extra_per_row):
    head = PartialFC(1021, 13, **kw)
    itemsize = torch.tensor([], dtype=kw["dtype"]).element_size()
    report = head.resident_bytes()
    assert report["device"] == 1021 * (13 * itemsize * rows_of_d + extra_per_row)
    assert report.get("host", 0) == 0 and report.get("nvme", 0) == 0


# ---------------------------------------------------------------- bad input
def _pending_head():
    """A head with one accumulated pass pending, and a twin in the same state."""
    heads = []
    for _ in range(2):
        h = make_head()
        gen = torch.Generator().manual_seed(16)
        train(h, gen, 2)
        h(*batch(gen)).backward()
        heads.append(h)
    return heads


def _good():
    return batch(torch.Generator().manual_seed(17))


BAD_FORWARD = [
    # (name, (embeddings, labels) builder, exception, argument named)
    ("label == C", lambda x, y: (x, y.index_fill(0, torch.tensor([3]), C)), ValueError, "labels", f"[0, {C})"),
    ("label == -1", lambda x, y: (x, y.index_fill(0, torch.tensor([0]), -1)), ValueError, "labels", f"[0, {C})"),
    ("label huge", lambda x, y: (x, y.index_fill(0, torch.tensor([5]), 2 ** 40)), ValueError, "labels"),
    ("labels float", lambda x, y: (x, y.double()), TypeError, "labels"),
    ("labels bool", lambda x, y: (x, y > 3), TypeError, "labels"),
    ("labels list", lambda x, y: (x, y.tolist()), TypeError, "labels"),
    ("labels [N, 1]", lambda x, y: (x, y[:, None]), ValueError, "labels", f"[{N}]"),
    ("labels too short", lambda x, y: (x, y[:-1]), ValueError, "labels", f"[{N}]"),
    ("labels 0-d", lambda x, y: (x, y[0]), ValueError, "labels"),
    ("embeddings 1-d", lambda x, y: (x[:, 0], y), ValueError, "embeddings"),
    ("embeddings 3-d", lambda x, y: (x[None], y), ValueError, "embeddings"),
    ("embeddings int", lambda x, y: (x.long(), y), TypeError, "embeddings"),
    ("embeddings list", lambda x, y: (x.tolist(), y), TypeError, "embeddings"),
    ("embedding size", lambda x, y: (torch.cat([x, x[:, :1]], 1), y), ValueError, "embedding", f"{D}"),
    ("embedding size small", lambda x, y: (x[:, :-2], y), ValueError, "embedding", f"{D}"),
    ("NaN", lambda x, y: (x.index_fill(0, torch.tensor([2]), float("nan")), y), ValueError, "embeddings"),
    ("+Inf", lambda x, y: (x.index_fill(0, torch.tensor([4]), float("inf")), y), ValueError, "embeddings"),
    ("-Inf", lambda x, y: (x.index_fill(0, torch.tensor([6]), float("-inf")), y), ValueError, "embeddings"),
    ("embeddings device", lambda x, y: (x.to("meta"), y), ValueError, "embeddings", "cpu"),
    ("labels device", lambda x, y: (x, y.to("meta")), ValueError, "labels", "cpu"),
]


@pytest.mark.parametrize("case", BAD_FORWARD, ids=[b[0] for b in BAD_FORWARD])
def test_bad_forward_input_raises_and_changes_nothing(case):
    name, build, exc, arg, *expect = case
    head, twin = _pending_head()
    before = snapshot(head)
    x, y = build(*_good())
    with pytest.raises(exc, match=arg) as info:
        head(x, y)
    for text in expect:   # the error also states the expected value
        assert text in str(info.value), (text, str(info.value))
    assert_same_snapshot(before, snapshot(head))
    # the pending gradient survived: the next step equals the twin's
    head.step(0.1)
    twin.step(0.1)
    assert_same_snapshot(snapshot(head), snapshot(twin))


@pytest.mark.parametrize("lr", [-0.1, float("nan"), float("inf"), -float("inf"), "0.1", True, None])
def test_bad_lr_raises_and_changes_nothing(lr):
    head, twin = _pending_head()
    before = snapshot(head)
    with pytest.raises(ValueError, match="lr"):
        head.step(lr)
    assert_same_snapshot(before, snapshot(head))
    head.step(0.1)
    twin.step(0.1)
    assert_same_snapshot(snapshot(head), snapshot(twin))


@pytest.mark.parametrize("kw,exc,arg", [
    (dict(sample_rate=0), ValueError, "sample_rate"),
    (dict(sample_rate=0.0), ValueError, "sample_rate"),
    (dict(sample_rate=1.5), ValueError, "sample_rate"),
    (dict(sample_rate=-0.2), ValueError, "sample_rate"),
    (dict(sample_rate=float("nan")), ValueError, "sample_rate"),
    (dict(sample_rate="0.5"), ValueError, "sample_rate"),
    (dict(sample_rate=True), ValueError, "sample_rate"),
    (dict(filter_threshold=1.5), ValueError, "filter_threshold"),
    (dict(filter_threshold=-1.5), ValueError, "filter_threshold"),
    (dict(filter_threshold=float("nan")), ValueError, "filter_threshold"),
    (dict(filter_threshold="0.4"), ValueError, "filter_threshold"),
    (dict(margin="arcface"), TypeError, "margin"),
    (dict(margin=0.5), TypeError, "margin"),
    (dict(optimizer="adam"), ValueError, "optimizer"),
    (dict(optimizer=None), ValueError, "optimizer"),
    (dict(optimizer="sgd", betas=(0.9, 0.99)), TypeError, "betas"),
    (dict(optimizer="adamw", momentum=0.9), TypeError, "momentum"),
    (dict(optimizer="sgd", momentum=1.0), ValueError, "momentum"),
    (dict(optimizer="sgd", momentum=-0.1), ValueError, "momentum"),
    (dict(optimizer="sgd", momentum=float("nan")), TypeError, "momentum"),
    (dict(optimizer="sgd", weight_decay=-1e-4), ValueError, "weight_decay"),
    (dict(optimizer="sgd", momentum=0.0, nesterov=True), ValueError, "nesterov"),
    (dict(optimizer="adamw", betas=(0.9,)), TypeError, "betas"),
    (dict(optimizer="adamw", betas=(1.0, 0.999)), ValueError, "betas"),
    (dict(optimizer="adamw", betas=(0.9, float("nan"))), TypeError, "betas"),
    (dict(optimizer="adamw", eps=-1e-8), ValueError, "eps"),
    (dict(optimizer="adamw", weight_decay=float("inf")), TypeError, "weight_decay"),
    (dict(compute_dtype=torch.int32), ValueError, "compute_dtype"),
    (dict(dtype=torch.float16), ValueError, "dtype"),
    (dict(seed="0"), TypeError, "seed"),
])
def test_bad_constructor_arguments(kw, exc, arg):
    base = dict(sample_rate=0.5)
    with pytest.raises(exc, match=arg):
        PartialFC(C, D, **{**base, **kw})


@pytest.mark.parametrize("num_classes,embedding_size,arg", [
    (0, D, "num_classes"), (-3, D, "num_classes"), (2.0, D, "num_classes"), (C, 0, "embedding_size"),
    (C, "7", "embedding_size"), (True, D, "num_classes"),
])
def test_bad_sizes(num_classes, embedding_size, arg):
    with pytest.raises(ValueError, match=arg):
        PartialFC(num_classes, embedding_size)


# ---------------------------------------------------------------- reduced precision
def test_bfloat16_compute_trains_and_tracks_float32():
    num_classes, d, n = 101, 32, 64
    gen = torch.Generator().manual_seed(0)
    protos = torch.randn(num_classes, d, generator=gen)
    data = []
    for _ in range(20):
        y = torch.randint(0, num_classes, (n,), generator=gen)
        data.append((protos[y] + 0.3 * torch.randn(n, d, generator=gen), y))
    losses = {}
    heads = {}
    for cd in (None, torch.bfloat16):
        head = PartialFC(num_classes, d, sample_rate=0.5, compute_dtype=cd, seed=3,
                         margin=ArcFace(32.0, 0.3), optimizer="sgd", momentum=0.9)
        ls = []
        for x, y in data:
            loss = head(x, y)
            loss.backward()
            head.step(0.1)
            ls.append(float(loss.detach()))
        losses[cd], heads[cd] = torch.tensor(ls), head
    f32, bf16 = losses[None], losses[torch.bfloat16]
    assert bool(torch.isfinite(bf16).all())
    assert float(bf16[-5:].mean()) < 0.3 * float(bf16[0]), bf16
    assert not torch.equal(f32, bf16), "bfloat16 compute took the float32 path"
    assert float(((f32 - bf16).abs() / f32).max()) < 0.03, (f32, bf16)
    c32, c16 = heads[None].centers(), heads[torch.bfloat16].centers()
    assert c16.dtype == torch.float32
    assert float((c32 - c16).norm() / c32.norm()) < 0.03


def test_float32_head_close_to_float64_reference():
    """The default float32 head against the float64 reference on one step."""
    head = PartialFC(C, D, sample_rate=0.3, margin=CosFace(SCALE, 0.35), seed=8)
    x, y = batch(torch.Generator().manual_seed(18), dtype=torch.float32)
    active = head.active_set(y)
    col = {c: j for j, c in enumerate(active.tolist())}
    w = head.centers().to(F64)[active].requires_grad_(True)
    xh = x.to(F64) / x.to(F64).norm(dim=1, keepdim=True)
    cos = xh @ (w / w.norm(dim=1, keepdim=True)).t()
    tc = torch.tensor([col[c] for c in y.tolist()])
    logits = (SCALE * cos).index_put((torch.arange(N), tc), SCALE * (cos[torch.arange(N), tc] - 0.35))
    ref = (torch.logsumexp(logits, 1) - logits[torch.arange(N), tc]).mean()
    torch.testing.assert_close(head(x, y).detach().double(), ref.detach(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("opt", list(OPTS))
def test_grad_scale_unscales_a_scaled_loss(opt):
    """fp16 training multiplies the loss by a loss scale; step(grad_scale=) must undo it:
    a head trained on 1024 x loss with grad_scale=1024 tracks torch.optim on the loss."""
    gen = torch.Generator().manual_seed(3)
    head = make_head(sample_rate=1.0, **OPTS[opt][0])
    ref_w = head.centers().clone().requires_grad_(True)
    ref_opt = OPTS[opt][1](ref_w, 0.1)
    for _ in range(3):
        x, y = batch(gen)
        (1024.0 * head(x, y)).backward()
        head.step(0.1, grad_scale=1024.0)
        ref_opt.zero_grad()
        ref_loss(x, ref_w, y).backward()
        ref_opt.step()
    torch.testing.assert_close(head.centers(), ref_w.detach(), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("scale", [0.0, -1.0, float("inf"), float("nan"), True])
def test_bad_grad_scale_raises_and_changes_nothing(scale):
    head, twin = _pending_head()
    before = snapshot(head)
    with pytest.raises(ValueError, match="grad_scale"):
        head.step(0.1, grad_scale=scale)
    assert_same_snapshot(before, snapshot(head))
    head.step(0.1)
    twin.step(0.1)
    assert_same_snapshot(snapshot(head), snapshot(twin))
