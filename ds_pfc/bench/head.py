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

Roofline: a step must do ``6 N d S`` GEMM FLOPs and move at least
``(8 S d + 4 S N) * 4`` bytes (stage S rows, write their gradient, read+write
weight and momentum, write the logits, one exp pass, one backward read). The floor is
the GEMM time at the machine's measured GEMM rate plus that traffic at its measured
copy bandwidth, both measured in the same run.
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

from . import (Timer, format_table, machine_info, peak_memory_bytes, run_case_subprocess, summarize,
               write_json)

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
        from ..sampling import remap_labels, sample_active
        from ..softmax import margin_softmax_cross_entropy
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


# --------------------------------------------------------------------- one case
def run_case(case: dict) -> dict:
    from .. import ArcFace, PartialFC
    device = torch.device(case["device"])
    if case.get("threads"):
        torch.set_num_threads(case["threads"])
    torch.manual_seed(0)
    num_classes, dim, batch, rate = case["classes"], case["dim"], case["batch"], case["sample_rate"]
    compute = _DTYPES[case["compute"]]
    base_mem = peak_memory_bytes(device)
    t0 = time.perf_counter()
    if case["impl"] == "ds_pfc":
        head = PartialFC(num_classes, dim, sample_rate=rate, margin=ArcFace(), device=device,
                         compute_dtype=None if compute == torch.float32 else compute,
                         optimizer="sgd", momentum=0.9, weight_decay=5e-4, data_parallel_grad=False)
    elif case["impl"] == "dense":
        head = DenseHead(num_classes, dim, rate, ArcFace(), None if compute == torch.float32 else compute, device)
    elif case["impl"] == "dense_plain":
        head = DensePlainHead(num_classes, dim, rate, device=device)
    else:
        raise ValueError(f"unknown impl {case['impl']!r}")
    build_s = time.perf_counter() - t0
    fwd, bwd, upd, total = [], [], [], []
    gen = torch.Generator().manual_seed(1)
    for it in range(case["warmup"] + case["steps"]):
        x = torch.randn(batch, dim, generator=gen).to(device).requires_grad_()
        y = torch.randint(0, num_classes, (batch,), generator=gen).to(device)
        with Timer(device) as t_f:
            loss = head(x, y)
        with Timer(device) as t_b:
            loss.backward()
        with Timer(device) as t_u:
            head.step(0.1)
        if it >= case["warmup"]:
            fwd.append(t_f.seconds), bwd.append(t_b.seconds), upd.append(t_u.seconds)
            total.append(t_f.seconds + t_b.seconds + t_u.seconds)
    active = max(math.floor(rate * num_classes + 1e-9), 1)
    return {**case, "active": active, "build_s": build_s, "loss": loss.item(), "step": summarize(total),
            "forward": summarize(fwd), "backward": summarize(bwd), "update": summarize(upd),
            "peak_bytes": peak_memory_bytes(device), "base_bytes": base_mem}


# --------------------------------------------------------------------- roofline
def measure_machine(device, dim: int, batch: int) -> dict:
    """GEMM rate (per compute dtype, the head's block shape) and copy bandwidth."""
    out = {}
    for name, dtype in _DTYPES.items():
        if name == "fp16" and device.type == "cpu":
            continue
        a = torch.randn(1024, dim, device=device).to(dtype)
        b = torch.randn(batch, dim, device=device).to(dtype)
        reps = 200
        for _ in range(5):
            torch.mm(a, b.t())
        with Timer(device) as t:
            for _ in range(reps):
                torch.mm(a, b.t())
        out[f"gemm_gflops_{name}"] = 2 * 1024 * dim * batch * reps / t.seconds / 1e9
    src = torch.empty(64 << 20, dtype=torch.float32, device=device).fill_(1.0)  # 256 MiB
    dst = torch.empty_like(src)
    dst.copy_(src)
    with Timer(device) as t:
        for _ in range(5):
            dst.copy_(src)
    out["copy_gbps"] = 5 * 2 * src.numel() * 4 / t.seconds / 1e9   # read + write
    return out


def floor_seconds(active: int, dim: int, batch: int, gemm_gflops: float, copy_gbps: float) -> dict:
    flops = 6 * batch * dim * active
    traffic = (8 * active * dim + 4 * active * batch) * 4
    return {"flops": flops, "bytes": traffic, "gemm_s": flops / gemm_gflops / 1e9,
            "memory_s": traffic / copy_gbps / 1e9}


def default_cases(classes, sample_rate, extra_rate, device, compute, memory_bytes, dim) -> list[dict]:
    cases = []
    for c in classes:
        cases.append({"impl": "ds_pfc", "classes": c, "sample_rate": sample_rate, "compute": compute})
    if extra_rate and len(classes) > 1:
        # The largest C at a rate giving the same |S| as the middle case: the step must
        # not grow with C at fixed |S|.
        cases.append({"impl": "ds_pfc", "classes": max(classes), "sample_rate": extra_rate, "compute": compute})
    if compute != "fp32":
        cases.append({"impl": "ds_pfc", "classes": classes[len(classes) // 2], "sample_rate": sample_rate,
                      "compute": "fp32"})
    for c in classes:
        cases.append({"impl": "dense", "classes": c, "sample_rate": sample_rate, "compute": compute})
        cases.append({"impl": "dense_plain", "classes": c, "sample_rate": sample_rate, "compute": "fp32"})
    for case in cases:
        # dense: weight + gradient + momentum + one temporary of [C, d] float32
        per_class = (4 if case["impl"] != "ds_pfc" else 2) * dim * 4
        case["est_bytes"] = case["classes"] * per_class
        if memory_bytes and case["est_bytes"] > 0.8 * memory_bytes:
            case["skip"] = f"needs ~{case['est_bytes'] / 2**30:.0f} GiB of {memory_bytes / 2**30:.0f} GiB"
    return cases


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="bench.py head", description=__doc__.split("\n")[0])
    p.add_argument("--classes", default="100000,1000000,4000000", help="comma-separated C values")
    p.add_argument("--sample-rate", type=float, default=0.1)
    p.add_argument("--extra-rate", type=float, default=0.025,
                   help="also run ds_pfc at the largest C at this rate (same |S| as the middle C at --sample-rate)")
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--compute", choices=sorted(_DTYPES), default="bf16", help="ds_pfc GEMM dtype")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--impl", default="ds_pfc,dense,dense_plain", help="which implementations to run")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/head-<device>-<date>.json)")
    p.add_argument("--case", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.case:
        print(json.dumps(run_case(json.loads(args.case))))
        return 0

    device = torch.device(args.device)
    classes = [int(c) for c in args.classes.split(",")]
    info = machine_info()
    memory = info.get("gpu_memory_bytes") if device.type == "cuda" else info.get("memory_bytes")
    impls = set(args.impl.split(","))
    cases = [c for c in default_cases(classes, args.sample_rate, args.extra_rate, args.device, args.compute,
                                      memory, args.dim) if c["impl"] in impls]
    print(f"measuring GEMM rate and copy bandwidth on {device} ...", flush=True)
    machine = measure_machine(device, args.dim, args.batch)
    print("  " + ", ".join(f"{k}={v:.1f}" for k, v in machine.items()), flush=True)
    results = []
    for i, case in enumerate(cases, 1):
        case.update(device=args.device, dim=args.dim, batch=args.batch, steps=args.steps, warmup=args.warmup)
        label = f"[{i}/{len(cases)}] {case['impl']} C={case['classes']:,} r={case['sample_rate']} {case['compute']}"
        if "skip" in case:
            print(f"{label}: skipped ({case['skip']})", flush=True)
            results.append(case)
            continue
        print(f"{label} ...", end=" ", flush=True)
        res = run_case_subprocess("ds_pfc.bench.head", case)
        res = {**case, **res}
        if "error" not in res:
            fl = floor_seconds(res["active"], args.dim, args.batch, machine[f"gemm_gflops_{res['compute']}"],
                               machine["copy_gbps"])
            res["floor"] = fl
            res["x_floor"] = res["step"]["median"] / (fl["gemm_s"] + fl["memory_s"])
            print(f"{res['step']['median'] * 1e3:.0f} ms/step", flush=True)
        else:
            print(f"failed: {res['error']}", flush=True)
        results.append(res)

    def find(impl, c, r, compute=None):
        for res in results:
            if res["impl"] == impl and res["classes"] == c and res["sample_rate"] == r and "step" in res \
                    and (compute is None or res["compute"] == compute):
                return res
        return None

    rows = []
    for res in results:
        if "step" not in res:
            rows.append([res["impl"], f"{res['classes']:,}", res["sample_rate"], "-", res["compute"],
                         res.get("skip") or res.get("error", "?")[:40], "", "", "", "", "", "", ""])
            continue
        mine = find("ds_pfc", res["classes"], res["sample_rate"], args.compute)
        speedup = (f"{res['step']['median'] / mine['step']['median']:.1f}x"
                   if mine is not None and res["impl"] != "ds_pfc" else "")
        gflops = res["floor"]["flops"] / res["step"]["median"] / 1e9
        rows.append([res["impl"], f"{res['classes']:,}", res["sample_rate"], f"{res['active']:,}", res["compute"],
                     f"{res['step']['median'] * 1e3:.0f} [{res['step']['min'] * 1e3:.0f}-{res['step']['max'] * 1e3:.0f}]",
                     f"{res['forward']['median'] * 1e3:.0f}", f"{res['backward']['median'] * 1e3:.0f}",
                     f"{res['update']['median'] * 1e3:.0f}",
                     f"{(res['peak_bytes'] - res['base_bytes']) / 2**20:,.0f}", f"{gflops:.0f}",
                     f"{res['x_floor']:.2f}", speedup])
    print()
    print(format_table(["impl", "C", "r", "|S|", "gemm", "step ms [min-max]", "fwd", "bwd", "update",
                        "peak MiB", "GFLOP/s", "x floor", "ds_pfc speedup"], rows))
    summary = {}
    mid = classes[len(classes) // 2] if len(classes) > 1 else classes[0]
    mine = find("ds_pfc", mid, args.sample_rate, args.compute)
    for impl in ("dense", "dense_plain"):
        other = find(impl, mid, args.sample_rate)
        if mine and other:
            summary[f"speedup_vs_{impl}_at_C={mid}"] = other["step"]["median"] / mine["step"]["median"]
    big = find("ds_pfc", max(classes), args.extra_rate, args.compute)
    if mine and big and big["active"] == mine["active"]:
        summary[f"step_ratio_C={max(classes)}_r={args.extra_rate}_vs_C={mid}_r={args.sample_rate}"] = \
            big["step"]["median"] / mine["step"]["median"]
    print()
    for k, v in summary.items():
        print(f"{k}: {v:.2f}")
    out = args.out or os.path.join("benchmarks", "results",
                                   f"head-{device.type}-{time.strftime('%Y%m%d-%H%M%S')}.json")
    write_json(out, "head", vars(args), results, {"machine_rates": machine, "summary": summary})
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
