"""The device-dependent paths on a real GPU (marker ``cuda``; skipped without CUDA).

``python -m ds_pfc.selfcheck`` runs these on a GPU machine, the bank tests a second
time under ``TORCH_CUDA_SANITIZER=1``. Every expected value comes from the CPU: a
float64 head (itself checked against an independent float64 softmax in
test_exactness.py) or the same computation on the CPU, with tolerances stated per test.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile

import pytest
import torch

import ds_pfc
from ds_pfc.checkpoint import shards as ckpt

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA device: `python -m ds_pfc.selfcheck` runs these on a GPU machine"),
]
DEV = "cuda"
HAS_TRITON = importlib.util.find_spec("triton") is not None
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _batches(num, n, d, classes, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, d, generator=gen), torch.randint(0, classes, (n,), generator=gen)) for _ in range(num)]


def _train(head, batches, lr=0.01, accum=1, prefetch=False, device=DEV, dtype=torch.float32):
    losses = []
    for i, (x, y) in enumerate(batches):
        x = x.to(device, dtype).requires_grad_()
        y = y.to(device)
        loss = head(x, y)
        loss.backward()
        if prefetch and i + 1 < len(batches):
            head.prefetch(batches[i + 1][1].to(device))
        if (i + 1) % accum == 0:
            head.step(lr)
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.parametrize("backend,compute,rtol", [
    ("torch", torch.float32, 1e-5), ("torch", torch.bfloat16, 5e-2),
    ("triton", torch.float32, 1e-5), ("triton", torch.bfloat16, 5e-2)])
def test_head_steps_on_the_gpu_follow_the_float64_cpu_head(backend, compute, rtol):
    """Sampled head (r = 0.3), PFC* filter, 3 steps with momentum: losses and centers on
    the GPU against the float64 CPU head. fp32: 1e-5; bf16 operands: 5e-2 (2**-9
    relative error per operand, times a scale of 64 in the logits). The compute dtype is
    explicit: ``None`` means bf16 products on CUDA.

    Initial centers and sampled sets come from per-device random streams, so both heads
    start from the same float32 centers and the GPU head takes the CPU head's active set
    of each step: the comparison is of the step's arithmetic on one sampled set."""
    if backend == "triton" and not HAS_TRITON:
        pytest.skip("triton is not installed")
    batches = _batches(3, 96, 64, 5003)
    kw = dict(sample_rate=0.3, filter_threshold=0.4, seed=3, data_parallel_grad=False, momentum=0.9)
    ref = ds_pfc.PartialFC(5003, 64, dtype=torch.float64, device="cpu", **kw)
    gpu = ds_pfc.PartialFC(5003, 64, device=DEV, backend=backend, compute_dtype=compute, **kw)
    gpu.load_centers(ref.centers().float())
    ref.load_centers(gpu.centers().double())      # both from the same float32 values

    def cpu_active_set(local_labels, sample_step=None):
        step = gpu.sample_step if sample_step is None else sample_step
        return ref.active_set(local_labels.cpu(), step).to(DEV)

    gpu.active_set = cpu_active_set
    ref_losses = _train(ref, batches, device="cpu", dtype=torch.float64)
    gpu_losses = _train(gpu, batches)
    torch.testing.assert_close(torch.tensor(gpu_losses, dtype=torch.float64),
                               torch.tensor(ref_losses, dtype=torch.float64), rtol=rtol, atol=0)
    want = ref.centers()
    torch.testing.assert_close(gpu.centers().double(), want, rtol=rtol, atol=rtol * float(want.abs().max()))


@pytest.mark.parametrize("access", ["staged", "mapped"])
@pytest.mark.parametrize("placement", ["host", ("host", torch.bfloat16)], ids=["host", "host-bf16"])
def test_tiered_bank_with_prefetch_and_accumulation_on_the_gpu(placement, access):
    """Weight (and momentum) in pinned host memory, rows staged on side streams with
    prefetch and 2-step accumulation: the same trajectory as the device bank on the GPU
    (the same kernels). Not bitwise: on CUDA the device bank itself is not bitwise
    reproducible with accumulation (two runs of it differed by ~1 ulp in a few rows on an
    H200, most likely from the order of atomic additions), so centers are compared to 1e-6 of
    their largest entry; a stale or lost row would differ by a whole step's update.
    ``mapped``: the row-move kernel reads and writes the mapped host tables in place."""
    if access == "mapped" and not HAS_TRITON:
        pytest.skip("mapped host access moves rows with Triton, which is not installed")
    batches = _batches(8, 64, 32, 3001, seed=1)
    kw = dict(sample_rate=0.2, seed=5, data_parallel_grad=False, momentum=0.9, device=DEV)
    ref = ds_pfc.PartialFC(3001, 32, **kw)
    tiered = ds_pfc.PartialFC(3001, 32, bank=ds_pfc.TieredBank.factory({"weight": placement}, default="host",
                                                                       host_access=access), **kw)
    assert tiered._stager.mapped == (access == "mapped")
    if placement != "host":   # bf16 storage: start both from the rounded centers
        ref.load_centers(ref.centers().to(torch.bfloat16).float())
        tiered.load_centers(ref.centers())
    ref_losses = _train(ref, batches, accum=2)
    got = _train(tiered, batches, accum=2, prefetch=True)
    if placement == "host":
        torch.testing.assert_close(torch.tensor(got), torch.tensor(ref_losses), rtol=1e-6, atol=0)
        want = ref.centers()
        torch.testing.assert_close(tiered.centers(), want, rtol=0, atol=1e-6 * float(want.abs().max()))
    else:
        torch.testing.assert_close(torch.tensor(got), torch.tensor(ref_losses), rtol=1e-2, atol=0)
    tiered.close()


def test_bank_state_dict_allocates_nothing_on_the_gpu():
    """A checkpoint copies the bank to host memory directly: no device clone."""
    head = ds_pfc.PartialFC(2_000_000, 128, sample_rate=0.01, device=DEV, data_parallel_grad=False)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    state = head.state_dict()
    assert all(t.device.type == "cpu" for t in state.values())
    assert torch.cuda.max_memory_allocated() - before <= 64 << 20


def test_checkpoint_save_load_reshard_from_the_gpu():
    batches = _batches(2, 32, 16, 1009, seed=2)
    head = ds_pfc.PartialFC(1009, 16, sample_rate=0.5, device=DEV, data_parallel_grad=False, momentum=0.9)
    _train(head, batches)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt.save_head_shard(head, tmp)
        cpu = ds_pfc.PartialFC(1009, 16, sample_rate=0.5, device="cpu", data_parallel_grad=False, momentum=0.9)
        ckpt.load_head_shard(cpu, tmp)
        assert torch.equal(cpu.centers(), head.centers())
        back = ds_pfc.PartialFC(1009, 16, sample_rate=0.5, device=DEV, data_parallel_grad=False, momentum=0.9)
        ckpt.load_head_shard(back, tmp)
        assert torch.equal(back.centers(), head.centers())
        out = ckpt.reshard(tmp, os.path.join(tmp, "two"), 2)
        assert len(out) == 2


@pytest.mark.parametrize("sample_rate", [1.0, 0.1])
def test_a_step_never_waits_for_the_gpu_without_validation(sample_rate):
    head = ds_pfc.PartialFC(100_003, 128, sample_rate=sample_rate, device=DEV, validate=False,
                            data_parallel_grad=False)
    x = torch.randn(128, 128, device=DEV, requires_grad=True)
    y = torch.randint(0, 100_003, (128,), device=DEV)
    head(x, y).backward()
    head.step(0.1)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        head(x, y).backward()
        head.step(0.1)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@pytest.mark.parametrize("backend", ["torch"] + (["triton"] if HAS_TRITON else []))
def test_a_sampled_step_is_captured_whole_in_a_cuda_graph(backend):
    """validate=False, r = 0.1: forward, backward and ``head.step`` captured in one CUDA
    graph; each replay (new batch copied into the static inputs) equals an eager step of
    an identical head: loss, embedding gradient and centers. The sampler's step lives
    on the device, so every replay draws the next step's set as the eager head does."""
    classes, d, n, lr = 20_011, 64, 96, 0.05
    kw = dict(sample_rate=0.1, device=DEV, validate=False, data_parallel_grad=False, backend=backend, seed=3,
              momentum=0.9)
    graphed, eager = ds_pfc.PartialFC(classes, d, **kw), ds_pfc.PartialFC(classes, d, **kw)
    batches = [(x.to(DEV), y.to(DEV)) for x, y in _batches(8, n, d, classes, seed=4)]
    static_x = torch.zeros(n, d, device=DEV, requires_grad=True)
    static_y = torch.zeros(n, dtype=torch.int64, device=DEV)

    def graphed_step():
        static_x.grad = None
        loss = graphed(static_x, static_y)
        loss.backward()
        graphed.step(lr)
        return loss

    def eager_step(x, y):
        x = x.clone().requires_grad_()
        loss = eager(x, y)
        loss.backward()
        eager.step(lr)
        return loss.detach(), x.grad

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):         # warm-up (allocator, cuBLAS, kernel compilation) off the capture
        for x, y in batches[:3]:
            with torch.no_grad():
                static_x.copy_(x)
                static_y.copy_(y)
            graphed_step()
    torch.cuda.current_stream().wait_stream(side)
    for x, y in batches[:3]:
        eager_step(x, y)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = graphed_step()
    for x, y in batches[3:]:
        with torch.no_grad():
            static_x.copy_(x)
            static_y.copy_(y)
        graph.replay()
        loss, grad = eager_step(x, y)
        torch.testing.assert_close(static_loss.detach(), loss, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(static_x.grad, grad, rtol=1e-5, atol=1e-7)
    torch.cuda.synchronize()
    assert int(graphed._step_t) == eager.sample_step == 8
    torch.testing.assert_close(graphed.centers(), eager.centers(), rtol=1e-5, atol=1e-7)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_training_app_on_two_gpus(tmp_path):
    """The app through the deepspeed launcher on 2 GPUs: every rank on its own GPU."""
    proc = subprocess.run(["deepspeed", "--num_gpus", "2", "launch/train.py", "--deepspeed_config",
                           "configs/cpu_quickstart.json", "--max_steps", "5", "--output_dir", str(tmp_path),
                           "--no_resume"], cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert os.path.exists(os.path.join(tmp_path, "summary.json"))
