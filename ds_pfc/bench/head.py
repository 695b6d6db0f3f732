"""Head benchmark: step time and peak memory against the number of classes.

Implementations (each case in its own subprocess):

- ``ds_pfc``: :class:`~ds_pfc.PartialFC` with sparse row SGD (momentum 0.9, wd 5e-4).
- ``dense``: the same sampled margin softmax, but the centers are one dense
  ``nn.Parameter [C, d]`` updated by ``torch.optim.SGD`` with momentum: what
  arcface_torch's PartialFC_V2 does. Its gradient, weight decay and momentum cover
  all ``C`` rows every step.
- ``dense_plain``: that dense baseline written as plain PyTorch ops the way
  PartialFC_V2 is (``rand(C)`` + ``topk`` sampling, ``F.normalize``, ``F.linear``,
  margin, ``F.cross_entropy``), float32 as it runs on a CPU.
- ``linear_ce``: PyTorch's own ``F.linear_cross_entropy`` (torch >= 2.13) on
  normalised operands at ``r = 1``: ``linear_cross_entropy(s * x_hat, w_hat, y)``,
  logits ``s <x_hat, w_hat>`` over all ``C`` classes, with a dense ``[C, d]``
  parameter and ``torch.optim.SGD`` as in ``dense``. It cannot put a margin on the
  target logit, so it runs against ``ds_pfc/cos``: ds_pfc at ``r = 1`` with
  ``CosFace(margin=0)``, the same logits and the same loss. Variants
  (``--lce-options``): ``none`` (``options=None``, the reference path: the whole
  ``[N, C]`` logits), ``auto`` (``LinearCrossEntropyOptions()``, chunks sized by its
  heuristic) and ``b<rows>`` (``batch_chunk_size=rows``). These cases run at the
  smallest ``--classes`` value; ``--vs-linear-ce`` is the preset comparison at
  ``N = 2048, d = 256, C = 200k``, float32.

``ds_pfc`` runs with ``--backends`` (``torch``; on CUDA also ``triton``, the fused
kernels). ``cpu ms``: the process's CPU time per step (median), which on a machine
shared with other work is steadier than the wall time (with ``--threads 1`` it is the
step's own compute). Memory per case: ``state MiB`` is what stays resident after the timed steps
(weights, optimizer state) above the process before the head was built; ``step MiB``
is the peak during a step above the memory held just before it (median over the
timed steps): allocated memory on CUDA, the resident set on CPU (its high-water mark
reset through ``/proc/self/clear_refs`` before each step); ``peak MiB`` is the
process's overall peak above that start. One extra step per case is counted with :class:`~.counting.OpCounter`:
aten ops (about one kernel launch each on a GPU) and host synchronisations.

Roofline, chosen not to flatter: a step must do ``6 N d S`` GEMM FLOPs (logits,
``dX``, ``dW``; recomputation is ours to pay) and move at least ``28 S d`` bytes
(gather the S active rows, write their gradient, and the SGD update's 20 B per
element: read weight, momentum, gradient; write weight, momentum). Logits need not
touch memory at all. The GEMM rate is measured at the head's own shape
(``[S, d] x [d, N]`` in the compute dtype, capped at 256 MiB of output); the memory
rate is the published HBM bandwidth of the GPU model when known (H100, H200, A100),
else the copy bandwidth measured in the same run (CPU). The floor is the sum of both.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

from . import (Timer, current_memory_bytes, format_table, machine_info, peak_memory_bytes, reset_peak_memory,
               run_case_subprocess, summarize, window_peak_bytes, write_json)
from .._args import parser

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# --------------------------------------------------------------------- baselines
class DenseHead(torch.nn.Module):
    """The sampled margin softmax with a dense parameter and ``torch.optim.SGD``."""

    def __init__(self, num_classes, dim, sample_rate, margin, compute_dtype, device, seed=0):
        super().__init__()
        from ..bank import initial_centers
        self.weight = torch.nn.Parameter(initial_centers(seed, 0, num_classes, dim, 0.01, device=device))
        self.sample_rate, self.margin, self.compute_dtype, self.seed = sample_rate, margin, compute_dtype, seed
        self.optimizer = torch.optim.SGD([self.weight], lr=0.1, momentum=0.9, weight_decay=5e-4)
        self.steps = 0

    def forward(self, x, y):
        from ..core.sampling import remap_labels, sample_active
        from ..core.softmax import margin_softmax_cross_entropy
        active = sample_active(torch.unique(y), self.weight.shape[0], self.sample_rate,
                               seed=self.seed, step=self.steps, rank=0)
        self.steps += 1
        return margin_softmax_cross_entropy(x, self.weight[active], remap_labels(y, active), self.margin,
                                            compute_dtype=self.compute_dtype).loss

    def step(self, lr):
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


class DensePlainHead(torch.nn.Module):
    """PartialFC_V2's recipe in plain PyTorch ops, float32."""

    def __init__(self, num_classes, dim, sample_rate, scale=64.0, margin=0.5, device="cpu"):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.normal(0, 0.01, (num_classes, dim), device=device))
        self.num_sample = int(sample_rate * num_classes)
        self.scale, self.m = scale, margin
        self.optimizer = torch.optim.SGD([self.weight], lr=0.1, momentum=0.9, weight_decay=5e-4)

    def forward(self, x, y):
        with torch.no_grad():
            positive = torch.unique(y)
            perm = torch.rand(self.weight.shape[0], device=x.device)
            perm[positive] = 2.0
            index = torch.sort(torch.topk(perm, k=self.num_sample)[1])[0]
            target = torch.searchsorted(index, y)
        cos = F.linear(F.normalize(x), F.normalize(self.weight[index])).clamp(-1, 1)
        rows = torch.arange(x.shape[0], device=x.device)
        target_cos = cos[rows, target].clamp(-1 + 1e-7, 1 - 1e-7)
        logits = cos.index_put((rows, target), torch.cos(torch.acos(target_cos) + self.m)) * self.scale
        return F.cross_entropy(logits, target)

    def step(self, lr):
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def lce_options(variant: str):
    """``LinearCrossEntropyOptions`` of a ``linear_ce`` variant: ``"none"`` (None, the
    reference path), ``"auto"`` (the defaults) or ``"b<rows>"`` (that batch chunk)."""
    if variant == "none":
        return None
    from torch.nn import LinearCrossEntropyOptions
    if variant == "auto":
        return LinearCrossEntropyOptions()
    if variant.startswith("b") and variant[1:].isdigit() and int(variant[1:]) > 0:
        return LinearCrossEntropyOptions(chunking_method=None, batch_chunk_size=int(variant[1:]))
    raise ValueError(f"linear_ce variant must be 'none', 'auto' or 'b<rows>', got {variant!r}")


class LinearCEHead(torch.nn.Module):
    """``F.linear_cross_entropy(scale * x_hat, w_hat, y)`` over all classes (``r = 1``),
    a dense parameter with ``torch.optim.SGD``; the same initial centers as ds_pfc."""

    def __init__(self, num_classes, dim, scale=64.0, variant="none", device="cpu", seed=0):
        super().__init__()
        if not hasattr(F, "linear_cross_entropy"):
            raise RuntimeError(f"linear_ce needs torch >= 2.13 (F.linear_cross_entropy), got {torch.__version__}")
        from ..bank import initial_centers
        self.weight = torch.nn.Parameter(initial_centers(seed, 0, num_classes, dim, 0.01, device=device))
        self.scale, self.options = scale, lce_options(variant)
        self.optimizer = torch.optim.SGD([self.weight], lr=0.1, momentum=0.9, weight_decay=5e-4)

    def forward(self, x, y):
        # F.normalize's eps (1e-12, a floor on the norm) is ds_pfc's.
        return F.linear_cross_entropy(self.scale * F.normalize(x), F.normalize(self.weight), y,
                                      options=self.options)

    def step(self, lr):
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def make_margin(name: str):
    """``"arcface"``: ``ArcFace()``; ``"cos"``: ``CosFace(margin=0)``, plain scaled cosine logits."""
    from ..core.margins import ArcFace, CosFace
    if name == "arcface":
        return ArcFace()
    if name == "cos":
        return CosFace(margin=0.0)
    raise ValueError(f"margin must be 'arcface' or 'cos', got {name!r}")


# --------------------------------------------------------------------- one case
def make_head(case: dict, num_classes: int):
    """The head of ``case`` (its ``impl``, margin, backend, variant) with ``num_classes``."""
    from ..core.margins import ArcFace
    from ..core.head import PartialFC
    device = torch.device(case["device"])
    dim, rate, compute = case["dim"], case["sample_rate"], _DTYPES[case["compute"]]
    if case["impl"] == "ds_pfc":
        return PartialFC(num_classes, dim, sample_rate=rate, margin=make_margin(case.get("margin", "arcface")),
                         device=device, compute_dtype=None if compute == torch.float32 else compute,
                         optimizer="sgd", momentum=0.9, weight_decay=5e-4, data_parallel_grad=False,
                         backend=case.get("backend", "torch"), block_bytes=case.get("block_bytes"))
    if case["impl"] == "dense":
        return DenseHead(num_classes, dim, rate, ArcFace(), None if compute == torch.float32 else compute, device)
    if case["impl"] == "dense_plain":
        return DensePlainHead(num_classes, dim, rate, device=device)
    if case["impl"] == "linear_ce":
        if rate != 1.0 or compute != torch.float32:
            raise ValueError("linear_ce runs at sample_rate 1 with float32 compute")
        return LinearCEHead(num_classes, dim, variant=case.get("lce", "none"), device=device)
    raise ValueError(f"unknown impl {case['impl']!r}")


def run_case(case: dict) -> dict:
    device = torch.device(case["device"])
    if case.get("threads"):
        torch.set_num_threads(case["threads"])
    torch.manual_seed(0)
    num_classes, dim, batch, rate = case["classes"], case["dim"], case["batch"], case["sample_rate"]
    # One step of a tiny head of the same kind first: the modules a step imports
    # lazily are then loaded, and do not count as the real head's resident state.
    tiny = make_head(case, 64)
    tiny(torch.randn(8, dim, device=device, requires_grad=True), torch.arange(8, device=device)).backward()
    tiny.step(0.1)
    if hasattr(tiny, "close"):
        tiny.close()
    del tiny
    base_mem = peak_memory_bytes(device)
    start_mem = current_memory_bytes(device)
    t0 = time.perf_counter()
    head = make_head(case, num_classes)
    build_s = time.perf_counter() - t0
    fwd, bwd, upd, total, cpu, step_mem, peak_mem = [], [], [], [], [], [], 0
    budget = case.get("budget_s")
    gen = torch.Generator().manual_seed(1)
    for it in range(case["warmup"] + case["steps"]):
        x = torch.randn(batch, dim, generator=gen).to(device).requires_grad_()
        y = torch.randint(0, num_classes, (batch,), generator=gen).to(device)
        before = current_memory_bytes(device)
        # Resetting the window forgets the peak so far: keep the process's own.
        peak_mem = max(peak_mem, window_peak_bytes(device) or 0)
        windowed = reset_peak_memory(device)
        cpu0 = time.process_time()
        with Timer(device) as t_f:
            loss = head(x, y)
        with Timer(device) as t_b:
            loss.backward()
        with Timer(device) as t_u:
            head.step(0.1)
        if it >= case["warmup"]:
            fwd.append(t_f.seconds), bwd.append(t_b.seconds), upd.append(t_u.seconds)
            total.append(t_f.seconds + t_b.seconds + t_u.seconds)
            cpu.append(time.process_time() - cpu0)
            if windowed and before is not None:
                step_mem.append(window_peak_bytes(device) - before)
        del x, y, loss
        if total and budget is not None and time.perf_counter() - t0 > budget:
            break       # a very slow case: the steps measured so far (their count is in "n")
    state = current_memory_bytes(device)
    # One more step, counted (the counter's Python overhead stays out of the timings);
    # a case past its time budget is not counted.
    counted = budget is None or time.perf_counter() - t0 <= budget
    if counted:
        counter, loss = _counted_step(head, batch, dim, num_classes, gen, device)
    active = max(math.floor(rate * num_classes + 1e-9), 1)
    return {**case, "active": active, "build_s": build_s, "loss": loss.item() if counted else None,
            "step": summarize(total), "step_cpu": summarize(cpu), "ops": counter.ops if counted else None,
            "syncs": counter.syncs if counted else None, "sync_ops": counter.sync_ops if counted else None,
            "forward": summarize(fwd), "backward": summarize(bwd), "update": summarize(upd),
            "peak_bytes": max(peak_mem, peak_memory_bytes(device)), "base_bytes": base_mem,
            "state_bytes": None if state is None or start_mem is None else state - start_mem,
            "step_peak_bytes": summarize(step_mem) if step_mem else None}


# --------------------------------------------------------------------- launches and syncs
def _counted_step(head, batch, dim, num_classes, gen, device):
    """``(OpCounter, loss)`` of one forward, backward and optimizer step on random data."""
    from .counting import OpCounter
    x = torch.randn(batch, dim, generator=gen).to(device).requires_grad_()
    y = torch.randint(0, num_classes, (batch,), generator=gen).to(device)
    with OpCounter() as counter:
        loss = head(x, y)
        loss.backward()
        head.step(0.1)
    return counter, loss


def count_step(num_classes: int, dim: int, batch: int = 512, sample_rate: float = 0.1, *,
               block_bytes: int | None = 256 << 20, compute: str = "fp32", backend: str = "torch",
               optimizer: str = "sgd", fused: bool | None = None, validate: bool = True, device="cpu",
               seed: int = 0) -> dict:
    """Aten ops and host-synchronising ops of one head step (forward, backward,
    optimizer step) of a world-1 :class:`~ds_pfc.PartialFC` with the sparse row SGD.

    The default ``block_bytes`` is the CUDA default, so that on a CPU the count is
    the op sequence a GPU would run (with ``compute="fp32"``: with bf16 a CPU adds a cast
    of each GEMM result, which CUDA writes in float32 directly). ``backend="triton"`` and
    ``fused=True`` (the fused row update, CUDA's default) run in Triton's interpreter on
    a CPU; each kernel launch counts as one op. Returns
    ``{"ops", "syncs", "sync_ops", "top_ops", "launches", "active"}``.
    """
    from ..core.margins import ArcFace
    from ..core.head import PartialFC
    head = PartialFC(num_classes, dim, sample_rate=sample_rate, margin=ArcFace(), device=device,
                     compute_dtype=None if compute == "fp32" else _DTYPES[compute], optimizer=optimizer,
                     data_parallel_grad=False, block_bytes=block_bytes, backend=backend, seed=seed, fused=fused,
                     validate=validate)
    counter, _ = _counted_step(head, batch, dim, num_classes, torch.Generator().manual_seed(seed + 1), device)
    out = counter.summary()
    out["launches"] = {k: v for k, v in counter.by_op.items() if k.startswith("triton:")}
    out["active"] = max(math.floor(sample_rate * num_classes + 1e-9), 1)
    head.close()
    return out


# --------------------------------------------------------------------- roofline
# Published peak HBM bandwidth (bytes/s) by GPU model, from the vendors' data sheets.
HBM_BYTES_PER_S = {"H200": 4.8e12, "H100 PCIe": 2.0e12, "H100 NVL": 3.9e12, "H100": 3.35e12,
                   "A100-SXM4-80GB": 2.04e12, "A100 80GB PCIe": 1.94e12, "A100": 1.555e12}


def published_hbm(device) -> float | None:
    """Peak HBM bandwidth of the GPU model of ``device`` (None: unknown or a CPU)."""
    if torch.device(device).type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, value in HBM_BYTES_PER_S.items():       # most specific names first
        if key in name:
            return value
    return None


def measure_machine(device, dim: int, batch: int, active: int, compute: str) -> dict:
    """GEMM rate of the head's own product ``[S, d] x [d, N]`` (S capped at 256 MiB of
    float32 output) in the compute dtype, and the memory rate: the published HBM figure
    on a known GPU, else the measured copy bandwidth."""
    out = {}
    dtype = _DTYPES[compute]
    rows = max(64, min(active, (256 << 20) // (4 * batch)))
    a = torch.randn(rows, dim, device=device).to(dtype)
    b = torch.randn(batch, dim, device=device).to(dtype)
    reps = max(3, min(200, int(2e11 // (2 * rows * dim * batch))))   # ~0.2 TFLOP per measurement
    for _ in range(3):
        torch.mm(a, b.t())
    with Timer(device) as t:
        for _ in range(reps):
            torch.mm(a, b.t())
    out["gemm_shape"] = [rows, dim, batch]
    out[f"gemm_gflops_{compute}"] = 2 * rows * dim * batch * reps / t.seconds / 1e9
    src = torch.empty(64 << 20, dtype=torch.float32, device=device).fill_(1.0)  # 256 MiB
    dst = torch.empty_like(src)
    dst.copy_(src)
    with Timer(device) as t:
        for _ in range(5):
            dst.copy_(src)
    out["copy_gbps"] = 5 * 2 * src.numel() * 4 / t.seconds / 1e9   # read + write
    hbm = published_hbm(device)
    out["memory_gbps"] = hbm / 1e9 if hbm else out["copy_gbps"]
    out["memory_source"] = "published HBM peak" if hbm else "measured copy bandwidth"
    return out


def floor_seconds(active: int, dim: int, batch: int, gemm_gflops: float, memory_gbps: float) -> dict:
    flops = 6 * batch * dim * active
    traffic = 28 * active * dim
    return {"flops": flops, "bytes": traffic, "gemm_s": flops / gemm_gflops / 1e9,
            "memory_s": traffic / memory_gbps / 1e9}


def default_cases(classes, sample_rate, extra_rate, device, compute, memory_bytes, dim,
                  backends=("torch",), lce_variants=(), batch=512) -> list[dict]:
    """The cases of one run. ``lce_variants``: ``linear_ce`` variants, each run at
    ``r = 1`` and the smallest C, next to ``ds_pfc/cos`` (the same loss) there."""
    cases = []
    for backend in backends:
        for c in classes:
            cases.append({"impl": "ds_pfc", "backend": backend, "classes": c, "sample_rate": sample_rate,
                          "compute": compute})
        if extra_rate and len(classes) > 1:
            # The largest C at a rate giving the same |S| as the middle case: the step must
            # not grow with C at fixed |S|.
            cases.append({"impl": "ds_pfc", "backend": backend, "classes": max(classes), "sample_rate": extra_rate,
                          "compute": compute})
    if compute != "fp32":
        cases.append({"impl": "ds_pfc", "backend": backends[0], "classes": classes[len(classes) // 2],
                      "sample_rate": sample_rate, "compute": "fp32"})
    for c in classes:
        cases.append({"impl": "dense", "classes": c, "sample_rate": sample_rate, "compute": compute})
        cases.append({"impl": "dense_plain", "classes": c, "sample_rate": sample_rate, "compute": "fp32"})
    if lce_variants:
        c = min(classes)
        for backend in backends:
            cases.append({"impl": "ds_pfc", "backend": backend, "margin": "cos", "classes": c, "sample_rate": 1.0,
                          "compute": "fp32"})
        for variant in lce_variants:
            lce_options(variant)        # a bad variant fails here, not in a subprocess
            cases.append({"impl": "linear_ce", "lce": variant, "classes": c, "sample_rate": 1.0, "compute": "fp32"})
    for case in cases:
        # dense: weight + gradient + momentum + one temporary of [C, d] float32
        per_class = (4 if case["impl"] != "ds_pfc" else 2) * dim * 4
        case["est_bytes"] = case["classes"] * per_class
        if case.get("lce") == "none":     # the whole [N, C] logits and their gradient
            case["est_bytes"] += 2 * 4 * batch * case["classes"]
        if memory_bytes and case["est_bytes"] > 0.8 * memory_bytes:
            case["skip"] = f"needs ~{case['est_bytes'] / 2**30:.0f} GiB of {memory_bytes / 2**30:.0f} GiB"
    return cases


def build_parser() -> argparse.ArgumentParser:
    p = parser("ds-pfc-bench head", " ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--predict", choices=("h100", "h200", "a100"),
                   help="predict the step on this GPU model instead (see ds_pfc/bench/model.py; --predict h100 -h)")
    p.add_argument("--classes", default="100000,1000000,4000000", help="comma-separated C values")
    p.add_argument("--sample-rate", type=float, default=0.1,
                   help="r: the share of the classes sampled per step, in (0, 1] (default 0.1)")
    p.add_argument("--extra-rate", type=float, default=0.025,
                   help="also run ds_pfc at the largest C at this rate (same |S| as the middle C at --sample-rate)")
    p.add_argument("--batch", type=int, default=512, help="N: samples per step (default 512)")
    p.add_argument("--dim", type=int, default=512, help="d: the embedding width (default 512)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per case (default 5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before the timed ones (default 2)")
    p.add_argument("--compute", choices=sorted(_DTYPES), default="bf16", help="ds_pfc GEMM dtype")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="the torch device the cases run on (default cuda when available, else cpu)")
    p.add_argument("--impl", default="ds_pfc,dense,dense_plain,linear_ce",
                   help="which implementations to run (linear_ce: F.linear_cross_entropy at r = 1, the smallest C)")
    p.add_argument("--lce-options", default=None,
                   help="linear_ce variants: none (options=None), auto (LinearCrossEntropyOptions()), b<rows> "
                        "(default: none,auto,b256 on CUDA; none,b256 elsewhere, where auto falls back to 2-row "
                        "chunks at float32 and takes minutes a step)")
    p.add_argument("--vs-linear-ce", action="store_true",
                   help="preset: ds_pfc/cos against linear_ce at r = 1, N = 2048, d = 256, C = 200k, fp32")
    p.add_argument("--threads", type=int, default=None, help="torch threads per case (default: torch's)")
    p.add_argument("--case-budget", type=float, default=600.0,
                   help="seconds after which a case stops taking steps (at least one is measured)")
    p.add_argument("--backends", default=None,
                   help="ds_pfc softmax backends (default: torch,triton on CUDA when triton imports, else torch)")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/head-<device>-<date>.json)")
    p.add_argument("--case", default=None, help=argparse.SUPPRESS)
    return p


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if any(a == "--predict" or a.startswith("--predict=") for a in argv):
        from . import predict   # a predicted step on a GPU model, counted here; its own case options
        return predict.main(argv)
    args = build_parser().parse_args(argv)
    if args.case:
        print(json.dumps(run_case(json.loads(args.case))))
        return 0

    if args.vs_linear_ce:
        args.classes, args.sample_rate, args.extra_rate, args.batch, args.dim = "200000", 1.0, 0.0, 2048, 256
        args.compute, args.impl = "fp32", "linear_ce"
    device = torch.device(args.device)
    classes = [int(c) for c in args.classes.split(",")]
    info = machine_info()
    memory = info.get("gpu_memory_bytes") if device.type == "cuda" else info.get("memory_bytes")
    impls = set(args.impl.split(","))
    if args.backends is None:
        from ..core.softmax import _triton_available
        args.backends = "torch,triton" if device.type == "cuda" and _triton_available() else "torch"
    backends = tuple(args.backends.split(","))
    if args.lce_options is None:
        args.lce_options = "none,auto,b256" if torch.device(args.device).type == "cuda" else "none,b256"
    lce_variants = tuple(args.lce_options.split(",")) if "linear_ce" in impls else ()
    # ds_pfc/cos is linear_ce's counterpart: it runs whenever linear_ce does.
    cases = [c for c in default_cases(classes, args.sample_rate, args.extra_rate, args.device, args.compute,
                                      memory, args.dim, backends, lce_variants, args.batch)
             if c["impl"] in impls or c.get("margin") == "cos"]
    rates = {}

    def machine_for(active, compute):
        """GEMM rate at this active-set shape (measured once per shape) and memory rate."""
        key = (min(active, (256 << 20) // (4 * args.batch)), compute)
        if key not in rates:
            rates[key] = measure_machine(device, args.dim, args.batch, active, compute)
            print(f"  GEMM {rates[key]['gemm_shape']} {compute}: {rates[key][f'gemm_gflops_{compute}']:.0f} GFLOP/s;"
                  f" memory {rates[key]['memory_gbps']:.0f} GB/s ({rates[key]['memory_source']})", flush=True)
        return rates[key]

    def name(res):
        """``ds_pfc/torch``, ``ds_pfc/torch/cos`` (CosFace(0)), ``linear_ce/b256``, ``dense``."""
        return res["impl"] + "".join(f"/{res[k]}" for k in ("backend", "margin", "lce") if res.get(k)
                                     and not (k == "margin" and res[k] == "arcface"))

    results = []
    for i, case in enumerate(cases, 1):
        case.update(device=args.device, dim=args.dim, batch=args.batch, steps=args.steps, warmup=args.warmup,
                    threads=args.threads, budget_s=args.case_budget)
        label = (f"[{i}/{len(cases)}] {name(case)} "
                 f"C={case['classes']:,} r={case['sample_rate']} {case['compute']}")
        if "skip" in case:
            print(f"{label}: skipped ({case['skip']})", flush=True)
            results.append(case)
            continue
        print(f"{label} ...", end=" ", flush=True)
        res = run_case_subprocess("ds_pfc.bench.head", case)
        res = {**case, **res}
        if "error" not in res:
            machine = machine_for(res["active"], res["compute"])
            fl = floor_seconds(res["active"], args.dim, args.batch, machine[f"gemm_gflops_{res['compute']}"],
                               machine["memory_gbps"])
            res["floor"] = fl
            res["x_floor"] = res["step"]["median"] / (fl["gemm_s"] + fl["memory_s"])
            print(f"{res['step']['median'] * 1e3:.0f} ms/step", flush=True)
        else:
            print(f"failed: {res['error']}", flush=True)
        results.append(res)

    def find(impl, c, r, compute=None, backend=None, margin="arcface", lce=None):
        for res in results:
            if res["impl"] == impl and res["classes"] == c and res["sample_rate"] == r and "step" in res \
                    and (compute is None or res["compute"] == compute) \
                    and (backend is None or res.get("backend") == backend) \
                    and (impl != "ds_pfc" or res.get("margin", "arcface") == margin) \
                    and (lce is None or res.get("lce") == lce):
                return res
        return None

    def counterpart(res):
        """The ds_pfc case a baseline is compared with: same C and r, the same loss."""
        if res["impl"] == "linear_ce":
            return find("ds_pfc", res["classes"], 1.0, "fp32", backends[0], margin="cos")
        return find("ds_pfc", res["classes"], res["sample_rate"], args.compute, backends[0])

    def mib(value):
        return "-" if value is None else f"{value / 2**20:,.0f}"

    rows = []
    for res in results:
        if "step" not in res:
            rows.append([name(res), f"{res['classes']:,}", res["sample_rate"], "-", res["compute"],
                         res.get("skip") or res.get("error", "?")[:40], "", "", "", "", "", "", "", "", "", "", "", ""])
            continue
        mine = counterpart(res)
        speedup = (f"{res['step']['median'] / mine['step']['median']:.1f}x"
                   if mine is not None and res["impl"] != "ds_pfc" else "")
        gflops = res["floor"]["flops"] / res["step"]["median"] / 1e9
        rows.append([name(res), f"{res['classes']:,}", res["sample_rate"], f"{res['active']:,}", res["compute"],
                     f"{res['step']['median'] * 1e3:.0f} [{res['step']['min'] * 1e3:.0f}-{res['step']['max'] * 1e3:.0f}]",
                     f"{res['step_cpu']['median'] * 1e3:.0f}" if "step_cpu" in res else "-",
                     f"{res['forward']['median'] * 1e3:.0f}", f"{res['backward']['median'] * 1e3:.0f}",
                     f"{res['update']['median'] * 1e3:.0f}",
                     mib(res.get("state_bytes")), mib((res.get("step_peak_bytes") or {}).get("median")),
                     mib(res['peak_bytes'] - res['base_bytes']), f"{gflops:.0f}",
                     f"{res['x_floor']:.2f}", res.get("ops") or "-", "-" if res.get("syncs") is None else res["syncs"],
                     speedup])
    print()
    print(format_table(["impl", "C", "r", "|S|", "gemm", "step ms [min-max]", "cpu ms", "fwd", "bwd", "update",
                        "state MiB", "step MiB", "peak MiB", "GFLOP/s", "x floor", "ops", "syncs", "ds_pfc speedup"], rows))
    summary = {}
    mid = classes[len(classes) // 2] if len(classes) > 1 else classes[0]
    mine = find("ds_pfc", mid, args.sample_rate, args.compute, backends[0])
    for impl in ("dense", "dense_plain"):
        other = find(impl, mid, args.sample_rate)
        if mine and other:
            summary[f"speedup_vs_{impl}_at_C={mid}"] = other["step"]["median"] / mine["step"]["median"]
    for variant in lce_variants:
        other = find("linear_ce", min(classes), 1.0, lce=variant)
        cos = find("ds_pfc", min(classes), 1.0, "fp32", backends[0], margin="cos")
        if cos and other:
            key = f"linear_ce/{variant}_vs_ds_pfc/cos_at_C={min(classes)}"
            summary[f"time_{key}"] = other["step"]["median"] / cos["step"]["median"]
            summary[f"cpu_time_{key}"] = other["step_cpu"]["median"] / cos["step_cpu"]["median"]
            # A tiny case can run within pages already resident: no growth, no ratio.
            if other.get("step_peak_bytes") and (cos.get("step_peak_bytes") or {}).get("median"):
                summary[f"step_memory_{key}"] = other["step_peak_bytes"]["median"] / cos["step_peak_bytes"]["median"]
            # Same initial centers, data and optimizer: the same loss after the same steps.
            if other["loss"] is not None and cos["loss"] is not None and other["step"]["n"] == cos["step"]["n"]:
                summary[f"loss_rel_diff_{key}"] = abs(other["loss"] - cos["loss"]) / abs(cos["loss"])
    big = find("ds_pfc", max(classes), args.extra_rate, args.compute, backends[0])
    if mine and big and big["active"] == mine["active"]:
        summary[f"step_ratio_C={max(classes)}_r={args.extra_rate}_vs_C={mid}_r={args.sample_rate}"] = \
            big["step"]["median"] / mine["step"]["median"]
    print()
    for k, v in summary.items():
        print(f"{k}: {v:.2g}" if k.startswith("loss_") else f"{k}: {v:.2f}")
    out = args.out or os.path.join("benchmarks", "results",
                                   f"head-{device.type}-{time.strftime('%Y%m%d-%H%M%S')}.json")
    machine_rates = [{"active_rows": k[0], "compute": k[1], **v} for k, v in rates.items()]
    write_json(out, "head", vars(args), results, {"machine_rates": machine_rates, "summary": summary})
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
