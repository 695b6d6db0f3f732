"""The GPU path, checked on CPU: launch and sync budget, memory of the lean backward,
backend choice, the fused row optimizer inside the head.

Counts come from a ``TorchDispatchMode`` counter run on CPU tensors with the CUDA
default block size, which reproduces the op sequence a GPU runs (DESIGN section 6).
Exactness of both backends against the float64 reference is in test_exactness.py.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import ds_pfc
from ds_pfc.bench.counting import OpCounter
from ds_pfc.bench.head import count_step
from ds_pfc.core.softmax import CPU_BLOCK_BYTES, CUDA_BLOCK_BYTES, default_block_bytes, resolve_backend

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pip install -e .[dev])")
# The kernels run on the GPU when there is one, else in Triton's interpreter (conftest.py).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

MAX_OPS, MAX_SYNCS, MAX_GROWTH = 400, 8, 2.5


# ---------------------------------------------------------------------- the counter itself
def test_counter_counts_launches_and_every_kind_of_sync():
    x = torch.randn(6, 5)
    with OpCounter() as c:
        x.t(), x[1:3], x.view(-1), torch.empty(3)          # views and allocations launch nothing
    assert (c.ops, c.syncs) == (0, 0)
    with OpCounter() as c:
        y = x * 2 + 1                                         # 2 launches, no sync
        y[torch.tensor([0, 2])] = 0.0                         # integer scatter: no sync
    assert (c.ops, c.syncs) == (3, 0), c.summary()
    with OpCounter() as c:
        x[x > 0]                                              # boolean mask: count first
        x.tolist()                                            # never reaches the dispatcher
        torch.unique(x)
        float(x.sum())
        torch.nonzero(x)
        torch.equal(x, x)
    assert c.syncs == 6, c.sync_ops
    assert torch.Tensor.tolist.__name__ == "tolist" and c._tolist is not None   # restored on exit
    assert x.tolist() == x.tolist()


# ---------------------------------------------------------------------- budget
@pytest.mark.slow
def test_head_step_launch_and_sync_budget():
    """B = 512, world 1, block_bytes = 256 MiB (the CUDA default): forward, backward and
    optimizer step within 400 aten ops and 8 host syncs with 100k active classes (C = 1M,
    r = 0.1: one class block of 131,072 = 256 MiB / (4 B) and one optimizer chunk) and with
    800k (r = 0.8: 7 class blocks and 2 optimizer chunks of 256 MiB / (4 d) = 524,288 rows);
    the 8x larger active set costs a few ops per extra block, not per class.

    d = 128 and C = 1M for both: the op sequence depends on the active set's blocks and
    chunks, not on C or d otherwise (counted alike: 217 ops and 1 sync at C = 1M with
    d = 512 or 128, 381 and 1 at 800k active out of C = 8M or 1M), and a table of
    8M x 128 (with its momentum) took ~40 s of a 2-core CPU to allocate and fill."""
    small = count_step(1_000_000, 128)
    large = count_step(1_000_000, 128, sample_rate=0.8)
    assert large["active"] == 8 * small["active"] == 800_000
    for name, res in (("100k active", small), ("800k active", large)):
        assert res["ops"] <= MAX_OPS, (name, res)
        assert res["syncs"] <= MAX_SYNCS, (name, res)
    assert large["ops"] <= MAX_GROWTH * small["ops"], (small["ops"], large["ops"])


def test_op_count_grows_with_blocks_not_classes():
    """At fixed block size the ops grow by a constant per extra block; no per-class or
    per-sample loops, and the same syncs whatever the number of blocks."""
    one = count_step(4096, 16, batch=64, block_bytes=64 * 4096 * 4)      # 410 active: one block
    many = count_step(4096, 16, batch=64, block_bytes=64 * 4 * 64)       # 64 classes per block: 7
    more = count_step(4096, 16, batch=64, block_bytes=64 * 4 * 32)       # 32 per block: 13
    assert one["syncs"] == many["syncs"] == more["syncs"] <= MAX_SYNCS
    per_block = (more["ops"] - many["ops"]) / 6
    assert 10 <= per_block <= 40, (one["ops"], many["ops"], more["ops"])
    assert many["ops"] - one["ops"] <= 6 * 40 + 20


@pytest.mark.parametrize("backend", ["torch"] + (["triton"] if HAS_TRITON else []))
def test_without_validation_a_full_softmax_step_never_waits_for_the_device(backend):
    """validate=False: forward, backward and the row update issue no host
    synchronisation at all (the data checks become a device-side assert), so the step
    can run ahead of the GPU; at r < 1 too (the sampler has a fixed size: 102 classes at
    r = 0.1, at least the 64 labels). C = 1024: the Triton kernels run in the interpreter,
    whose time grows with C (at 4096 the full step took 20 s); the syncs do not."""
    full = count_step(1024, 16, batch=64, sample_rate=1.0, validate=False, backend=backend,
                      fused=True if backend == "triton" else None)
    assert full["syncs"] == 0, full["sync_ops"]
    sampled = count_step(1024, 16, batch=64, sample_rate=0.1, validate=False, backend=backend)
    assert sampled["syncs"] == 0, sampled["sync_ops"]


def test_without_validation_bad_labels_still_fail_on_the_device():
    x, w = torch.randn(3, 8), torch.randn(5, 8)
    with pytest.raises(RuntimeError, match="owned by no rank"):
        ds_pfc.margin_cross_entropy(x, torch.tensor([0, 1, 7]), w, margin=ds_pfc.ArcFace(), validate=False)


# ---------------------------------------------------------------------- memory
_MEMORY_SCRIPT = textwrap.dedent("""
    import json, sys, torch
    torch.set_num_threads(1)
    import ds_pfc

    def status(key):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

    def rss():
        # Reset the high-water mark first (ru_maxrss would carry the parent's peak
        # across fork + exec).
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return status("VmRSS:")

    n, d, c = 2048, 128, 250_000
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, d, generator=g).requires_grad_()
    w = torch.randn(c, d, generator=g).requires_grad_()
    y = torch.randint(0, c, (n,), generator=g)
    before = rss()
    loss = ds_pfc.margin_cross_entropy(x, y, w, margin=ds_pfc.ArcFace())
    loss.backward()
    peak = status("VmHWM:")
    print(json.dumps({"growth": peak - before, "grad_bytes": w.grad.numel() * 4,
                      "logits_bytes": n * c * 4, "loss": loss.item()}))
""")


@pytest.mark.slow
def test_backward_recomputes_instead_of_keeping_logits():
    """N = 2048, d = 128, C = S = 250,000 at world 1 with default settings: the logits
    would take 2 GB; forward + backward grow the process by at most 512 MiB beyond the
    inputs, the centers and their gradient."""
    proc = subprocess.run([sys.executable, "-c", _MEMORY_SCRIPT], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["logits_bytes"] > 1.9e9
    extra = res["growth"] - res["grad_bytes"]
    assert extra <= 512 * 2 ** 20, f"peak growth beyond the centers' gradient: {extra / 2 ** 20:.0f} MiB"


# ---------------------------------------------------------------------- backend choice
def test_default_block_bytes_per_device():
    assert default_block_bytes(torch.device("cuda", 3)) == default_block_bytes("cuda") == CUDA_BLOCK_BYTES
    assert default_block_bytes("cpu") == CPU_BLOCK_BYTES
    assert CUDA_BLOCK_BYTES >= 256 * 2 ** 20


def test_backend_resolution(monkeypatch):
    f32 = torch.float32
    assert resolve_backend("auto", "cpu", f32, f32) == "torch"
    assert resolve_backend("torch", "cuda", f32, f32) == "torch"
    assert resolve_backend("auto", "cuda", f32, torch.float64) == "torch"        # float64: torch only
    expected = "triton" if HAS_TRITON else "torch"
    assert resolve_backend("auto", torch.device("cuda", 1), torch.bfloat16, f32) == expected
    with pytest.raises(ValueError, match="backend must be one of"):
        resolve_backend("cuda", "cpu", f32, f32)
    if HAS_TRITON:
        with pytest.raises(ValueError, match="use backend='torch'"):
            resolve_backend("triton", "cuda", torch.float64, torch.float64)
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
            resolve_backend("triton", "cpu", f32, f32)


def test_bad_block_bytes_and_backend_are_refused_by_name():
    x, y, w = torch.randn(4, 8), torch.tensor([0, 1, 2, 3]), torch.randn(5, 8)
    for bad in (0, -1, 1.5, "1MiB", True):
        with pytest.raises(ValueError, match="block_bytes"):
            ds_pfc.margin_cross_entropy(x, y, w, margin=ds_pfc.ArcFace(), block_bytes=bad)
        with pytest.raises(ValueError, match="block_bytes"):
            ds_pfc.PartialFC(5, 8, block_bytes=bad)
    with pytest.raises(ValueError, match="backend"):
        ds_pfc.margin_cross_entropy(x, y, w, margin=ds_pfc.ArcFace(), backend="cuda")
    with pytest.raises(ValueError, match="backend"):
        ds_pfc.PartialFC(5, 8, backend="fused")


# ---------------------------------------------------------------------- the head on both paths
def _train(head, steps, seed, n=23, d=24):
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        x = torch.randn(n, d, generator=gen, dtype=head.dtype).to(head.device).requires_grad_()
        y = torch.randint(0, head.num_classes, (n,), generator=gen).to(head.device)
        loss = head(x, y)
        loss.backward()
        head.step(1e-3)           # centers start with norm ~0.05: keep the steps small
        losses.append(float(loss.detach()))
    return losses, {k: v.clone() for k, v in head.state_dict().items() if k != "meta"}


@needs_triton
@pytest.mark.parametrize("optimizer,kwargs", [("sgd", {"momentum": 0.9, "weight_decay": 5e-4}),
                                              ("sgd", {"momentum": 0.9, "nesterov": True}),
                                              ("adamw", {"weight_decay": 0.05})])
@pytest.mark.parametrize("tiered", [False, True], ids=["device-bank", "host-slots"])
def test_fused_row_optimizer_follows_the_torch_path(optimizer, kwargs, tiered):
    """The fused Triton row update (interpreter on CPU) against the chunked torch update
    (bitwise torch.optim per row) over a few sampled steps, on the device bank and on a
    tiered bank's staged slots."""
    bank = ds_pfc.TieredBank.factory(default="host") if tiered else None
    runs = []
    for fused in (False, True):
        head = ds_pfc.PartialFC(41, 24, sample_rate=0.4, optimizer=optimizer, bank=bank, seed=3, device=DEVICE,
                                data_parallel_grad=False, fused=fused, **kwargs)
        runs.append(_train(head, 3, seed=9))
        head.close()
    (loss_a, state_a), (loss_b, state_b) = runs
    torch.testing.assert_close(torch.tensor(loss_b), torch.tensor(loss_a), rtol=1e-6, atol=0)
    assert state_a.keys() == state_b.keys()
    for key in state_a:
        # float32 rounding of one update, relative to the size of the state (an entry
        # near zero after a step carries the absolute error of its larger terms)
        scale = float(state_a[key].abs().max()) if state_a[key].is_floating_point() else 0.0
        torch.testing.assert_close(state_b[key], state_a[key], rtol=1e-5, atol=1e-6 * scale, msg=key)


def test_fused_row_optimizer_refuses_what_it_cannot_do():
    head = ds_pfc.PartialFC(11, 8, sample_rate=1.0, data_parallel_grad=False, dtype=torch.float64, fused=True)
    x = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    head(x, torch.tensor([0, 5, 9])).backward()
    with pytest.raises(RuntimeError, match="fused kernel"):
        head.step(0.1)
    with pytest.raises(TypeError, match="fused"):
        ds_pfc.RowSGD(fused="yes")


@needs_triton
@pytest.mark.parametrize("compute", [None, torch.bfloat16])
def test_head_triton_backend_matches_torch_backend(compute):
    """Sampled head with the PFC* filter and per-sample details: the fused kernels and
    the torch blocks (each checked against float64 in test_exactness.py) agree step by
    step, including the sparse row updates."""
    runs = []
    for backend in ("torch", "triton"):
        head = ds_pfc.PartialFC(97, 24, sample_rate=0.3, filter_threshold=0.3, compute_dtype=compute, seed=5,
                                data_parallel_grad=False, backend=backend, device=DEVICE,
                                margin=ds_pfc.CombinedMargin(30, 1.1, 0.2, 0.1))
        gen = torch.Generator().manual_seed(2)
        out = []
        for _ in range(2):
            x = torch.randn(19, 24, generator=gen).to(DEVICE).requires_grad_()
            y = torch.randint(0, 97, (19,), generator=gen).to(DEVICE)
            res = head(x, y, return_details=True)
            res.loss.backward()
            head.step(1e-2)
            out.append((res.loss.detach(), res.per_sample_loss.detach(), res.accuracy, x.grad))
        runs.append((out, head.centers()))
    tol = 1e-5 if compute is None else 2e-2
    for a, b in zip(runs[0][0], runs[1][0]):
        for u, v in zip(a, b):
            torch.testing.assert_close(v, u, rtol=tol, atol=tol * float(u.abs().max()))
    torch.testing.assert_close(runs[1][1], runs[0][1], rtol=tol, atol=tol * float(runs[0][1].abs().max()))


# ---------------------------------------------------------------------- self-check
def test_selfcheck_runs_the_cpu_subset_and_names_what_needs_a_gpu(tmp_path):
    """``python -m ds_pfc.selfcheck`` without CUDA: says so, passes its CPU checks,
    lists the GPU-only ones as skipped, writes its JSON."""
    if torch.cuda.is_available():
        pytest.skip("on a GPU machine the self-check runs the GPU checks (minutes); run it directly")
    out = tmp_path / "selfcheck.json"
    proc = subprocess.run([sys.executable, "-m", "ds_pfc.selfcheck", "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "No CUDA device here" in proc.stdout
    rows = {r["check"]: r for r in json.loads(out.read_text())["selfcheck"]}
    assert rows["head step, torch backend, fp32 vs float64"]["status"] == "pass"
    assert rows["launches and syncs per step"]["status"] == "pass"
    if HAS_TRITON:
        assert rows["head step, triton backend, fp32 vs float64"]["status"] == "pass"
        assert rows["fused row optimizer vs torch"]["status"] == "pass"
    gpu_only = [r for r in rows.values() if r["detail"] == "needs a CUDA device"]
    assert len(gpu_only) >= 4 and all(r["status"] == "skipped" for r in gpu_only)
