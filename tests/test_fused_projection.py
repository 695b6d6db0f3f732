"""The centers' gradient projected inside the row optimizer instead of in the backward.

The softmax can leave the centers' gradient as that of the normalised centers
(``project_w_grad=False``); the row optimizers then take it through the normalisation
``(g - w_hat <w_hat, g>) / ||w||`` of the weight they update (``project=True``: the torch
chunks and, as whole-row programs, the fused Triton kernels). Every check is against an
independent float64 reference (plain torch): the projection and the SGD / AdamW step written
out per row, or the head trained with the projection in the backward.

Without CUDA the kernels run on CPU tensors under Triton's interpreter (set before import).
"""
import os

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install -e .[dev])")
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before the @triton.jit kernels are defined

import ds_pfc  # noqa: E402
from ds_pfc.core.optim import RowAdamW, RowSGD, project_rows  # noqa: E402
from ds_pfc.core.softmax import margin_softmax_cross_entropy  # noqa: E402
from ds_pfc.kernels import triton_optim as K  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _project64(g, w):
    """float64 reference: the tangent projection of the rows of ``g`` through ``w / ||w||``."""
    g, w = g.double(), w.double()
    norm = w.norm(dim=1, keepdim=True).clamp_min(1e-12)
    w_hat = w / norm
    return (g - w_hat * (w_hat * g).sum(1, keepdim=True)) / norm


def _sgd64(w, buf, g, lr, momentum, weight_decay, nesterov):
    step = g + weight_decay * w if weight_decay else g
    if momentum:
        buf = momentum * buf + step
        step = step + momentum * buf if nesterov else buf
    return w - lr * step, buf


def _adamw64(w, m, v, t, g, lr, beta1, beta2, eps, weight_decay):
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    t = t.double()[:, None]
    denom = v.sqrt() / torch.sqrt(1 - beta2 ** t) + eps
    return w * (1 - lr * weight_decay) - lr * m / (denom * (1 - beta1 ** t)), m, v


def _rel_err(got, ref, before):
    """Largest error of a float32 result against its float64 reference, per row relative
    to that row's change, after one float32 rounding of the stored value (``2**-23 |ref|``:
    a float32 table cannot hold the float64 result closer than that)."""
    got, ref, before = got.double(), ref.double(), before.double()
    excess = ((got - ref).abs() - 2.0 ** -23 * ref.abs()).clamp_min(0.0)
    change = (ref - before).abs().max(dim=1, keepdim=True).values
    return (excess / change).max().item()


def _tables(num_rows, width, seed):
    gen = torch.Generator().manual_seed(seed)
    w = 0.01 * torch.randn(num_rows, width, generator=gen)
    w[3] *= 1e3                        # rows of very different norms
    return w, gen


# ------------------------------------------------------------------ the fused kernels
# d = 24: one sweep (the whole row in one tile); d = 40: two sweeps (sums, then update).
@pytest.mark.parametrize("width", [24, 40])
@pytest.mark.parametrize("momentum,weight_decay,nesterov", [(0.0, 0.0, False), (0.9, 5e-4, False),
                                                             (0.9, 5e-4, True)])
@pytest.mark.parametrize("rows_none", [False, True])
def test_sgd_kernel_projects_like_float64(width, momentum, weight_decay, nesterov, rows_none):
    num_rows = 9
    w, gen = _tables(num_rows, width, seed=width)
    buf = torch.randn(num_rows, width, generator=gen) * 0.1
    rows = None if rows_none else torch.tensor([0, 3, 4, 7])
    ids = torch.arange(num_rows) if rows is None else rows
    g = torch.randn(ids.numel(), width, generator=gen)
    w_ref, buf_ref = _sgd64(w.double()[ids], buf.double()[ids], _project64(g, w[ids]), 0.1, momentum, weight_decay,
                            nesterov)
    w0, buf0 = w.clone(), buf.clone()
    w, buf = w.to(DEVICE), buf.to(DEVICE)
    K.sgd_rows_(w, buf if momentum else None, None if rows is None else rows.to(DEVICE), g.to(DEVICE), lr=0.1,
                momentum=momentum, weight_decay=weight_decay, nesterov=nesterov, project=True)
    w, buf = w.cpu(), buf.cpu()
    assert _rel_err(w[ids], w_ref, w0[ids]) < 2e-6
    if momentum:
        assert _rel_err(buf[ids], buf_ref, torch.zeros_like(buf_ref)) < 2e-6
    else:
        assert torch.equal(buf, buf0)
    untouched = torch.ones(num_rows, dtype=torch.bool)
    untouched[ids] = False
    assert torch.equal(w[untouched], w0[untouched])


@pytest.mark.parametrize("width", [24, 40])
def test_adamw_kernel_projects_like_float64_and_counts_steps_in_one_launch(width, monkeypatch):
    num_rows = 9
    w, gen = _tables(num_rows, width, seed=width + 1)
    m = 1e-3 * torch.randn(num_rows, width, generator=gen)
    v = 1e-6 * torch.rand(num_rows, width, generator=gen)
    step = torch.randint(0, 50, (num_rows,), generator=gen, dtype=torch.int32)
    rows = torch.tensor([1, 3, 8])
    g = torch.randn(rows.numel(), width, generator=gen)
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.05)
    w_ref, m_ref, v_ref = _adamw64(w.double()[rows], m.double()[rows], v.double()[rows], step[rows] + 1,
                                   _project64(g, w[rows]), **hyper)
    w0, step0 = w.clone(), step.clone()
    tables = [t.to(DEVICE) for t in (w, m, v, step)]
    monkeypatch.setattr(K, "_increment_steps_kernel", None)     # not launched: the update bumps the counts
    K.adamw_rows_(*tables, rows.to(DEVICE), g.to(DEVICE), project=True, **hyper)
    w, m, v, step = (t.cpu() for t in tables)
    assert _rel_err(w[rows], w_ref, w0[rows]) < 5e-6
    assert _rel_err(m[rows], m_ref, torch.zeros_like(m_ref)) < 2e-6
    assert _rel_err(v[rows], v_ref, torch.zeros_like(v_ref)) < 2e-6
    expected = step0.clone()
    expected[rows] += 1
    assert torch.equal(step, expected)


# ------------------------------------------------------------------ the optimizers' two paths
@pytest.mark.parametrize("optimizer", [RowSGD(0.9, 5e-4, nesterov=True), RowAdamW(weight_decay=0.05)])
@pytest.mark.parametrize("fused", [False, True])
def test_row_optimizer_projects_on_both_paths(optimizer, fused):
    """``update(project=True)`` on the torch chunks (several, a small block_bytes) and in the
    fused kernel equals the float64 projection followed by the plain float64 step."""
    from ds_pfc.bank import DeviceBank
    num_rows, width = 12, 24
    w, gen = _tables(num_rows, width, seed=5)
    bank = DeviceBank(num_rows, device=DEVICE)
    bank.add_state("weight", width, torch.float32)
    for name, dim, dtype in optimizer.state_specs:
        bank.add_state(name, width if dim == "d" else 0, dtype)
    bank.load("weight", w.to(DEVICE))
    rows = torch.tensor([0, 2, 3, 5, 6, 11])
    g = torch.randn(rows.numel(), width, generator=gen)
    optimizer.fused = fused
    optimizer.update(bank, rows.to(DEVICE), g.to(DEVICE), 0.1, block_bytes=2 * width * 4, project=True)
    gp = _project64(g, w[rows])
    if isinstance(optimizer, RowSGD):
        w_ref, _ = _sgd64(w.double()[rows], torch.zeros_like(gp), gp, 0.1, 0.9, 5e-4, True)
    else:
        w_ref, _, _ = _adamw64(w.double()[rows], torch.zeros_like(gp), torch.zeros_like(gp),
                               torch.ones(rows.numel(), dtype=torch.int32), gp, 0.1, 0.9, 0.999, 1e-8, 0.05)
    got = bank.read("weight", rows.to(DEVICE)).cpu()
    assert _rel_err(got, w_ref, w[rows]) < 5e-6


def test_project_rows_is_the_float64_projection():
    w, gen = _tables(7, 24, seed=9)
    g = torch.randn(7, 24, generator=gen)
    got = project_rows(g, w)
    ref = _project64(g, w)
    assert ((got.double() - ref).abs().max() / ref.abs().max()) < 1e-6
    assert torch.equal(project_rows(g.double(), w), project_rows(g.double(), w.double()))


# ------------------------------------------------------------------ the softmax's unprojected gradient
@pytest.mark.parametrize("backend,compute", [("torch", torch.float32), ("triton", torch.float32),
                                             ("triton", torch.bfloat16)])
@pytest.mark.parametrize("keep_bytes", [0, None])
def test_unprojected_gradient_projects_to_the_softmax_gradient(backend, compute, keep_bytes):
    """``project_w_grad=False`` leaves the gradient of ``w_hat``; its float64 projection is the
    projected gradient (torch's recompute and kept-logit paths; triton's recompute and kept
    cosines, whose own projection takes the radial part from the kept cosines: bf16 bound)."""
    gen = torch.Generator().manual_seed(3)
    n, s, d = 10, 37, 24
    x = torch.randn(n, d, generator=gen, dtype=torch.float64).float().to(DEVICE)
    w = torch.randn(s, d, generator=gen).to(DEVICE)
    target = torch.randint(0, s, (n,), generator=gen).to(DEVICE)
    grads = []
    for project in (True, False):
        wl = w.clone().requires_grad_(True)
        xl = x.clone().requires_grad_(True)
        out = margin_softmax_cross_entropy(xl, wl, target, ds_pfc.ArcFace(), backend=backend, compute_dtype=compute,
                                           keep_bytes=keep_bytes, project_w_grad=project, filter_threshold=0.9)
        out.loss.backward()
        grads.append((wl.grad, xl.grad))
    (dw, dx), (g_hat, dx_u) = grads
    assert torch.equal(dx, dx_u)
    ref = _project64(g_hat.cpu(), w.cpu())
    tol = 2e-6 if compute == torch.float32 else 2e-2
    assert (dw.cpu().double() - ref).abs().max() / ref.abs().max() < tol
    # Not already projected: a radial part is left.
    assert ((g_hat.double() * w.double()).sum(1).abs().max() / (g_hat.double().norm(dim=1) * w.double().norm(
        dim=1)).max()) > 1e-3


# ------------------------------------------------------------------ the head
def _train(fuse, *, optimizer="sgd", sub_centers=1, backend="torch", fused=None, compute=None, micro=2,
           grad_scale=1.0, hook=False, tier=None, **opt):
    torch.manual_seed(0)
    if tier is not None:            # a tiered bank (staged slots): weight storage tier and dtype
        from ds_pfc.bank import TieredBank
        opt["bank"] = TieredBank.factory({"weight": tier})
    head = ds_pfc.PartialFC(60, 24, sample_rate=0.5, data_parallel_grad=False, optimizer=optimizer,
                            sub_centers=sub_centers, backend=backend, fused=fused, seed=3, compute_dtype=compute,
                            device=DEVICE, **opt)
    head.fuse_projection = fuse
    if hook:
        seen = []
        head.center_grad_hook = lambda: (lambda grad: seen.append(grad.clone()) or grad)
    w0 = head.centers().clone()
    gen = torch.Generator().manual_seed(1)
    modes = []
    for _ in range(2):
        for _ in range(micro):
            x = torch.randn(12, 24, generator=gen).to(DEVICE).requires_grad_(True)
            y = torch.randint(0, 60, (12,), generator=gen).to(DEVICE)
            (head(x, y) * grad_scale).backward()
            modes.append(head._unprojected)
        head.step(0.2, grad_scale=grad_scale)
    return head.centers().cpu().double(), w0.cpu().double(), modes


_CASES = {
    "sgd": dict(),
    "sgd_nesterov": dict(momentum=0.9, weight_decay=5e-4, nesterov=True),
    "sgd_plain": dict(momentum=0.0, weight_decay=0.0),
    "adamw": dict(optimizer="adamw", weight_decay=0.05),
    "sub_centers": dict(sub_centers=3),
    "scaled": dict(grad_scale=1024.0, micro=3),
    "triton_sgd": dict(backend="triton", fused=True, compute=torch.float32),
    "triton_adamw": dict(backend="triton", fused=True, compute=torch.float32, optimizer="adamw"),
    "host_bank": dict(tier=("host", torch.float32)),
    "host_bank_adamw": dict(tier=("host", torch.float32), optimizer="adamw"),
}


@pytest.mark.parametrize("case", list(_CASES))
def test_head_with_the_projection_in_the_step_trains_as_with_it_in_the_backward(case):
    """Two optimizer steps of micro-step accumulation: the head that projects in the step
    ends where the head that projects in the backward does, to float32 rounding of the
    weight change (SGD with momentum, nesterov and weight decay, AdamW, sub-centers, a
    loss scale divided by ``grad_scale``, the torch chunks and the fused kernels)."""
    kw = _CASES[case]
    ref, w0, modes_ref = _train(False, **kw)
    got, _, modes = _train(True, **kw)
    assert set(modes_ref) == {False} and set(modes) == {True}
    change = (ref - w0).abs().max()
    assert change > 0
    assert (got - ref).abs().max() / change < 2e-5


def test_head_bf16_host_bank_with_the_projection_in_the_step():
    """bf16 storage (host tier, staged float32 slots): every write rounds to bf16, so the two
    heads may round a weight to neighbouring bf16 values; beyond one bf16 ulp they agree."""
    kw = dict(tier=("host", torch.bfloat16), momentum=0.9)
    ref, w0, _ = _train(False, **kw)
    got, _, modes = _train(True, **kw)
    assert set(modes) == {True}
    assert torch.equal(got, got.float().bfloat16().double())
    excess = ((got - ref).abs() - 2.0 ** -8 * ref.abs()).clamp_min(0.0)
    assert excess.max() / (ref - w0).abs().max() < 2e-5


def test_head_bf16_products_with_the_projection_in_the_step():
    """bf16 products on the triton path (kept cosines): the fused projection is the exact one
    of the gradient of ``w_hat``, the backward's takes the radial part from the float16 cosines
    and bf16 G, so they agree to the bf16 level with SGD (linear in the gradient)."""
    kw = dict(backend="triton", fused=True, compute=torch.bfloat16, momentum=0.9)
    ref, w0, _ = _train(False, **kw)
    got, _, _ = _train(True, **kw)
    assert (got - ref).abs().max() / (ref - w0).abs().max() < 2e-2


def test_a_gradient_hook_keeps_the_projection_in_the_backward():
    """A hook reads the centers' gradient: it must see the projected one, so the rule turns
    the fusion off; the result is that of the unfused head."""
    ref, _, _ = _train(False)
    got, _, modes = _train(True, hook=True)
    assert set(modes) == {False}
    assert torch.equal(got, ref)


def test_micro_steps_that_disagree_are_refused():
    head = ds_pfc.PartialFC(20, 8, sample_rate=1.0, data_parallel_grad=False, device=DEVICE)
    x = torch.randn(4, 8, device=DEVICE, requires_grad=True)
    y = torch.tensor([0, 3, 5, 7], device=DEVICE)
    head(x, y).backward()
    head.center_grad_hook = lambda: (lambda grad: grad)
    with pytest.raises(RuntimeError, match="disagree"):
        head(x, y)
    head.zero_grad()
    head(x, y).backward()      # after zero_grad a new accumulation may choose again
    assert head._unprojected is False
    head.step(0.1)
