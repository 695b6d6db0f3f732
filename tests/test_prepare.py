"""``prepare``: inverse norms and normalised centers in one pass, reading the rows in place or
by index from a bank's table, against a float64 reference (plain torch).

Without CUDA the kernels run on CPU tensors under Triton's interpreter (set before import),
whose "prep" tile is 4 x 16 elements: d = 24 and 40 are read whole (one pass, 2 and 1 rows
per program), d = 72 in 16-column chunks (two passes).
"""
import os

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install -e .[dev])")
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before the @triton.jit kernels are defined

from ds_pfc.kernels import triton_softmax as ts  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The rounding of the compute dtype (half an ulp, relative) plus float32 arithmetic.
_TOL = {torch.float32: 1e-6, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


def _reference(w, rows=None):
    w = w.double() if rows is None else w.double()[rows]
    inv = 1.0 / w.norm(dim=1).clamp_min(1e-12)
    return w * inv[:, None], inv


def _table(c, d, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(c, d, generator=gen) * torch.logspace(-3, 2, c)[:, None]
    w[1] = 0.0                                  # a zero row: 1 / eps, zeros
    return w.to(dtype)


@pytest.mark.parametrize("d", [24, 40, 72])
@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("indexed", [False, True])
def test_prepare_matches_float64(d, w_dtype, compute, indexed):
    c = 13
    table = _table(c, d, w_dtype, seed=d)
    rows = torch.tensor([12, 0, 1, 5, 5, 9, 3]) if indexed else None
    w_hat, inv = ts.prepare(table.to(DEVICE), compute, rows=None if rows is None else rows.to(DEVICE))
    ref_hat, ref_inv = _reference(table, rows)
    assert w_hat.dtype == compute and w_hat.is_contiguous() and inv.dtype == torch.float32
    assert w_hat.shape == ref_hat.shape and inv.shape == ref_inv.shape
    assert ((inv.cpu().double() - ref_inv).abs() / ref_inv).max() < 1e-6
    err = (w_hat.cpu().double() - ref_hat).abs() - _TOL[compute] * ref_hat.abs()
    assert err.max() < 1e-7


def test_indexed_read_equals_the_gathered_copy_bitwise():
    """Reading row ``rows[j]`` of the table is reading row ``j`` of ``table[rows]``: the same
    values, the same arithmetic, bitwise; a strided table (a column slice) too."""
    for d in (24, 72):
        wide = _table(11, 2 * d, torch.float32, seed=1).to(DEVICE)
        table = wide[:, d:]                     # row stride 2d
        rows = torch.tensor([3, 10, 0, 7], device=DEVICE)
        for compute in (torch.float32, torch.bfloat16):
            a = ts.prepare(table, compute, rows=rows)
            b = ts.prepare(table.index_select(0, rows), compute)
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_prep_shape_reads_whole_rows_while_they_fit():
    for interpret in (True, False):
        rows, block_d, _, _, _ = ts.tile_config("prep", torch.bfloat16, interpret=interpret)
        elements = rows * block_d
        for d in (16, 24, 128, 512, 1000, 2048, 4096):
            r, b, one = ts.prep_shape(d, torch.bfloat16, interpret=interpret)
            if one:
                assert b >= d and r * b <= elements
            else:
                assert b == block_d and triton_next_pow2(d) > elements
    assert ts.prep_shape(512, torch.bfloat16, interpret=False) == (4, 512, True)


def triton_next_pow2(n):
    return 1 << (n - 1).bit_length()


def test_prepare_checks_rows():
    w = torch.zeros(4, 24, device=DEVICE)
    with pytest.raises(ValueError, match="rows"):
        ts.prepare(w, torch.float32, rows=torch.tensor([0, 1], dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="rows"):
        ts.prepare(w, torch.float32, rows=torch.zeros(2, 2, dtype=torch.int64, device=DEVICE))
    w_hat, inv = ts.prepare(w, torch.float32, rows=torch.zeros(0, dtype=torch.int64, device=DEVICE))
    assert w_hat.shape == (0, 24) and inv.shape == (0,)


# ------------------------------------------------------------------ the head's indexed read
def _head_run(monkeypatch, indexed, *, sample_rate, optimizer="sgd", compute=torch.float32):
    import ds_pfc
    if not indexed:     # today's path: the head gathers an [S, d] copy of the sampled centers
        monkeypatch.setattr(ds_pfc.PartialFC, "_indexed_centers", lambda self, *a: None)
    else:
        monkeypatch.undo()
    torch.manual_seed(0)
    head = ds_pfc.PartialFC(50, 24, sample_rate=sample_rate, data_parallel_grad=False, backend="triton",
                            fused=True, compute_dtype=compute, optimizer=optimizer, device=DEVICE, seed=4)
    gen = torch.Generator().manual_seed(2)
    losses, shapes = [], []
    for _ in range(2):
        for _ in range(2):
            x = torch.randn(12, 24, generator=gen).to(DEVICE).requires_grad_(True)
            y = torch.randint(0, 50, (12,), generator=gen).to(DEVICE)
            loss = head(x, y)
            shapes.append(head._pending[-1][1].stride())
            loss.backward()
            losses.append((loss.detach(), x.grad))
        head.step(0.3)
    head.eval()
    with torch.no_grad():
        x = torch.randn(12, 24, generator=gen).to(DEVICE)
        y = torch.randint(0, 50, (12,), generator=gen).to(DEVICE)
        losses.append((head(x, y), None))
    return losses, head.centers(), shapes


@pytest.mark.parametrize("sample_rate,optimizer,compute", [(0.4, "sgd", torch.float32), (1.0, "adamw", torch.float32),
                                                           (0.4, "sgd", torch.bfloat16)])
def test_head_reading_the_bank_by_index_equals_the_gathered_copy(monkeypatch, sample_rate, optimizer, compute):
    """The triton head with the projection in the step reads its sampled centers from the
    bank's table by index: the staged centers are a shape only (stride 0, no [S, d] copy), and
    losses, embedding gradients and the trained centers equal those of the gathered copy,
    bitwise (the same kernels see the same values), in training and in eval."""
    ref_losses, ref_centers, ref_shapes = _head_run(monkeypatch, False, sample_rate=sample_rate, optimizer=optimizer,
                                                    compute=compute)
    losses, centers, shapes = _head_run(monkeypatch, True, sample_rate=sample_rate, optimizer=optimizer,
                                        compute=compute)
    assert all(s == (0, 0) for s in shapes) and all(s != (0, 0) for s in ref_shapes)
    for (a, ga), (b, gb) in zip(losses, ref_losses):
        assert torch.equal(a, b)
        assert ga is None or torch.equal(ga, gb)
    assert torch.equal(centers, ref_centers)


def test_w_source_is_refused_where_the_centers_values_would_be_read():
    import ds_pfc
    from ds_pfc.core.softmax import margin_softmax_cross_entropy
    table = torch.randn(9, 24, device=DEVICE)
    rows = torch.tensor([1, 4, 6], device=DEVICE)
    x = torch.randn(5, 24, device=DEVICE)
    y = torch.tensor([0, 2, 1, 0, 2], device=DEVICE)
    shape = torch.empty((), device=DEVICE).expand(3, 24).requires_grad_(True)
    for kw in (dict(backend="torch", project_w_grad=False), dict(backend="triton", project_w_grad=True)):
        with pytest.raises(ValueError, match="w_source"):
            margin_softmax_cross_entropy(x, shape, y, ds_pfc.ArcFace(), w_source=(table, rows), **kw)
    with pytest.raises(ValueError, match="w_source"):
        margin_softmax_cross_entropy(x, shape, y, ds_pfc.ArcFace(), backend="triton", project_w_grad=False,
                                     w_source=(table, rows[:2]))
