"""Bank benchmark: step time of the device and host tiers, with and without
prefetch, around a simulated backbone window.

Every iteration is ``forward, backward, step, [prefetch(next labels)], window``: the
window stands for the backbone's forward and backward of the next batch (``sleep``:
the accelerator computes and the host is idle, as on a GPU; ``compute``: the host's
cores are busy with matrix products). With prefetch the next step's rows move while
the window runs, so a host-tier step should cost what a device-tier step costs as
long as the transfer fits in the window. Bytes moved per step come from the bank's
counters; the machine's copy bandwidth is measured in the same run.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import torch

from . import Timer, format_table, peak_memory_bytes, run_case_subprocess, summarize, write_json
from .._args import parser

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _window(kind: str, ms: float, device) -> None:
    if ms <= 0:
        return
    if kind == "sleep":
        time.sleep(ms / 1e3)
        return
    end = time.perf_counter() + ms / 1e3
    a = torch.randn(256, 256, device=device)
    while time.perf_counter() < end:
        a = torch.tanh(a @ a)


def run_case(case: dict) -> dict:
    from ..core.head import PartialFC
    from ..bank import TieredBank
    device = torch.device(case["device"])
    tier, prefetch = case["tier"], case["prefetch"]
    storage = _DTYPES[case["storage"]]
    workdir = None
    if tier == "device-bank":
        bank = None
    else:
        placements = {name: (t, storage) for name, t in case.get("placements", {}).items()}
        default = (tier, storage) if tier != "mixed" else ("device", storage)
        bank = TieredBank.factory(placements, default=default)
    base = peak_memory_bytes(device)
    t0 = time.perf_counter()
    head = PartialFC(case["classes"], case["dim"], sample_rate=case["sample_rate"], device=device, bank=bank,
                     compute_dtype=torch.bfloat16 if case["compute"] == "bf16" else None,
                     optimizer="sgd", momentum=0.9, weight_decay=5e-4, data_parallel_grad=False)
    build_s = time.perf_counter() - t0
    gen = torch.Generator().manual_seed(1)
    total = case["warmup"] + case["steps"]
    labels = [torch.randint(0, case["classes"], (case["batch"],), generator=gen).to(device) for _ in range(total + 1)]
    steps, moved = [], []
    try:
        for it in range(total):
            x = torch.randn(case["batch"], case["dim"], generator=gen).to(device).requires_grad_()
            with Timer(device) as t:
                loss = head(x, labels[it])
                loss.backward()
                head.step(0.1)
                # The lookahead goes out as the next batch's backbone starts: its rows
                # move during that window (on a GPU machine the host is idle then).
                if prefetch:
                    head.prefetch(labels[it + 1])
                _window(case["window_kind"], case["window_ms"], device)
            if it >= case["warmup"]:
                steps.append(t.seconds)
                traffic = head.last_step_traffic
                moved.append(traffic.get("staged_in", 0) + traffic.get("written_back", 0))
            if case.get("progress"):
                print(f"  step {it + 1}/{total}: {t.seconds:.2f} s", file=sys.stderr, flush=True)
        report = head.memory_report()
        head.close()
    finally:
        if workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    return {**case, "build_s": build_s, "step": summarize(steps), "bytes_per_step": sum(moved) / max(len(moved), 1),
            "resident": report["resident"], "peak_bytes": peak_memory_bytes(device), "base_bytes": base,
            "loss": loss.item()}


STORAGE_VARIANTS = (
    # name, placements, default, bytes per row of weight + momentum at d = 512
    ("float32 (device bank)", None, None, 4096),
    ("weight bf16 (host)", {"weight": ("host", torch.bfloat16)}, "host", 3072),
    ("weight+momentum bf16 (host)", {}, ("host", torch.bfloat16), 2048),
    ("weight bf16 + momentum int8 (host)", {"weight": ("host", torch.bfloat16),
                                            "momentum_buffer": ("host", "int8_rowwise")}, "host", 1540),
)


def storage_effect(steps: int = 300, classes: int = 5000, seeds=(0, 1, 2)) -> list[dict]:
    """Train the synthetic-identity task with each storage placement (:data:`STORAGE_VARIANTS`)
    and report the final loss and held-out verification accuracy per seed, and their mean
    and standard deviation; every variant sees the same data and initial values per seed."""
    import statistics
    from ..core.margins import CosFace
    from ..core.head import PartialFC
    from ..bank import TieredBank
    from ..data import SyntheticIdentities, verification_accuracy
    out = []
    for name, placements, default, row_bytes in STORAGE_VARIANTS:
        runs = []
        for seed in seeds:
            bank = None if default is None else TieredBank.factory(placements, default=default)
            torch.manual_seed(seed)
            data = SyntheticIdentities(classes + 1000, seed=seed)
            backbone = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 128),
                                           torch.nn.BatchNorm1d(128))
            head = PartialFC(classes, 128, sample_rate=0.1, margin=CosFace(32.0, 0.3), bank=bank,
                             compute_dtype=torch.bfloat16, seed=seed)
            opt = torch.optim.SGD(backbone.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
            gen = torch.Generator().manual_seed(seed + 7)
            losses = []
            for step in range(steps):
                lr = 0.05 * (1 - step / steps)
                labels = torch.randint(0, classes, (256,), generator=gen)
                loss = head(backbone(data.sample(labels)), labels)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                for group in opt.param_groups:
                    group["lr"] = lr
                opt.step()
                head.step(lr)
                losses.append(loss.item())
            head.close()
            tail = losses[-30:]
            runs.append({"seed": seed, "final_loss": sum(tail) / len(tail),
                         "verification": verification_accuracy(backbone, data, classes)})
        ver = [r["verification"] for r in runs]
        loss = [r["final_loss"] for r in runs]
        spread = (lambda xs: statistics.stdev(xs) if len(xs) > 1 else 0.0)
        out.append({"storage": name, "bytes_per_row_d512": row_bytes, "runs": runs,
                    "verification_mean": statistics.mean(ver), "verification_std": spread(ver),
                    "final_loss_mean": statistics.mean(loss), "final_loss_std": spread(loss)})
        print(f"  {name}: loss {out[-1]['final_loss_mean']:.3f} +- {out[-1]['final_loss_std']:.3f}, held-out "
              f"verification {out[-1]['verification_mean']:.3f} +- {out[-1]['verification_std']:.3f} "
              f"({len(runs)} seeds)", flush=True)
    return out


def copy_bandwidth(device) -> float:
    src = torch.ones(64 << 20, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    with Timer(device) as t:
        for _ in range(5):
            dst.copy_(src)
    return 5 * 2 * src.numel() * 4 / t.seconds / 1e9


def build_parser() -> argparse.ArgumentParser:
    p = parser("ds-pfc-bench bank", " ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--classes", type=int, default=1_000_000, help="C: classes of the head (default 1000000)")
    p.add_argument("--dim", type=int, default=512, help="d: the embedding width (default 512)")
    p.add_argument("--batch", type=int, default=256, help="N: samples per step (default 256)")
    p.add_argument("--sample-rate", type=float, default=0.05,
                   help="r: the share of the classes sampled per step, in (0, 1] (default 0.05)")
    p.add_argument("--windows", default="0,100,400", help="simulated backbone windows, ms")
    p.add_argument("--window-kind", choices=["sleep", "compute"], default="sleep",
                   help="what fills the window: sleep (the host idles, as beside a GPU) or compute (the host's "
                        "cores run matrix products) (default sleep)")
    p.add_argument("--tiers", default="device-bank,device,host,mixed",
                   help="device-bank (the default DeviceBank), device/host (TieredBank), "
                        "mixed (weight on host, momentum on device)")
    p.add_argument("--storage", choices=sorted(_DTYPES), default="fp32", help="storage dtype of the states")
    p.add_argument("--compute", choices=["fp32", "bf16"], default="bf16",
                   help="dtype of the head's matrix products (default bf16)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per case (default 5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before the timed ones (default 2)")
    p.add_argument("--prefetch", choices=["both", "on", "off"], default="both",
                   help="run each tier with the next step's rows prefetched, without, or both (default both)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="the torch device of the head (default cuda when available, else cpu)")
    p.add_argument("--out", default=None,
                   help="JSON path (default benchmarks/results/bank-<device>-<date>.json, or "
                        "bank-storage-<date>.json with --storage-effect)")
    p.add_argument("--storage-effect", action="store_true",
                   help="instead: train the synthetic-identity task with float32, bfloat16 and 8-bit storage")
    p.add_argument("--seeds", type=int, default=3, help="seeds per storage variant (--storage-effect)")
    p.add_argument("--case", default=None, help=argparse.SUPPRESS)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.case:
        print(json.dumps(run_case(json.loads(args.case))))
        return 0
    if args.storage_effect:
        seeds = tuple(range(args.seeds))
        print(f"training the synthetic-identity task (5000 classes, 300 steps) per storage, {len(seeds)} seeds ...",
              flush=True)
        results = storage_effect(seeds=seeds)
        base = results[0]
        print(format_table(["storage", "bytes/row (d=512)", "held-out verification", "vs float32", "final loss"],
                           [[r["storage"], r["bytes_per_row_d512"],
                             f"{r['verification_mean']:.3f} +- {r['verification_std']:.3f}",
                             f"{r['verification_mean'] - base['verification_mean']:+.3f}",
                             f"{r['final_loss_mean']:.3f} +- {r['final_loss_std']:.3f}"] for r in results]))
        out = args.out or os.path.join("benchmarks", "results", f"bank-storage-{time.strftime('%Y%m%d-%H%M%S')}.json")
        write_json(out, "bank-storage-effect", vars(args), results)
        print(f"wrote {out}")
        return 0

    device = torch.device(args.device)
    bandwidth = copy_bandwidth(device)
    print(f"copy bandwidth on {device}: {bandwidth:.1f} GB/s", flush=True)
    cases = []
    for window in [float(w) for w in args.windows.split(",")]:
        for tier in args.tiers.split(","):
            modes = {"both": [False, True], "on": [True], "off": [False]}[args.prefetch]
            for prefetch in ([False] if tier == "device-bank" else modes):
                case = {"tier": tier, "prefetch": prefetch, "window_ms": window, "window_kind": args.window_kind,
                        "classes": args.classes, "dim": args.dim, "batch": args.batch,
                        "sample_rate": args.sample_rate, "storage": args.storage, "compute": args.compute,
                        "steps": args.steps, "warmup": args.warmup, "device": args.device}
                if tier == "mixed":
                    case["placements"] = {"weight": "host"}
                cases.append(case)
    results = []
    for i, case in enumerate(cases, 1):
        label = f"[{i}/{len(cases)}] {case['tier']} prefetch={case['prefetch']} window={case['window_ms']:.0f} ms"
        print(f"{label} ...", end=" ", flush=True)
        res = {**case, **run_case_subprocess("ds_pfc.bench.bank", case)}
        print(f"{res['step']['median'] * 1e3:.0f} ms/step" if "step" in res else f"failed: {res['error']}",
              flush=True)
        results.append(res)

    def find(tier, prefetch, window):
        for r in results:
            if r["tier"] == tier and r["prefetch"] == prefetch and r["window_ms"] == window and "step" in r:
                return r
        return None

    rows = []
    for r in results:
        if "step" not in r:
            rows.append([r["tier"], r["prefetch"], r["window_ms"], r.get("error", "?")[:50]] + [""] * 6)
            continue
        ref = find("device-bank", False, r["window_ms"])
        sync = find(r["tier"], False, r["window_ms"])
        extra = r["step"]["median"] - (ref["step"]["median"] if ref else 0.0)
        gbps = r["bytes_per_step"] / (sync["step"]["median"] - ref["step"]["median"]) / 1e9 \
            if sync and ref and sync["step"]["median"] > ref["step"]["median"] and r["bytes_per_step"] else None
        rows.append([r["tier"], r["prefetch"], f"{r['window_ms']:.0f}",
                     f"{r['step']['median'] * 1e3:.0f} [{r['step']['min'] * 1e3:.0f}-{r['step']['max'] * 1e3:.0f}]",
                     f"{r['step']['median'] / ref['step']['median']:.2f}" if ref else "",
                     f"{extra * 1e3:+.0f}",
                     f"{r['bytes_per_step'] / 2**20:,.0f}",
                     "" if gbps is None or r["prefetch"] else f"{gbps:.1f}",
                     f"{r['resident'].get('device', 0) / 2**20:,.0f}/{r['resident'].get('host', 0) / 2**20:,.0f}",
                     f"{(r['peak_bytes'] - r['base_bytes']) / 2**20:,.0f}"])
    print()
    print(format_table(["tier", "prefetch", "window ms", "step ms [min-max]", "x device", "extra ms",
                        "MiB moved/step", "GB/s (sync)", "resident MiB dev/host", "peak MiB"], rows))
    for r in results:
        if "step" in r:
            print(f"{r['tier']} prefetch={r['prefetch']} window={r['window_ms']:.0f}: "
                  f"{1 / r['step']['median']:.3f} steps/s, bank built in {r['build_s']:.0f} s")
    out = args.out or os.path.join("benchmarks", "results", f"bank-{device.type}-{time.strftime('%Y%m%d-%H%M%S')}.json")
    write_json(out, "bank", vars(args), results, {"copy_gbps": bandwidth})
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
