"""Row moves between host memory and the GPU: ``ds-pfc-bench rows [options]``.

What the mapped host tier (``TieredBank(host_access="mapped")``) rests on, measured on one
GPU (two with ``--two-gpus``) and printed next to the figure the planner assumes
(``docs/planner.md``):

* page-locked DMA, host to device and back (``copy_`` of a pinned buffer): the copy
  engines' rate, the ceiling of any PCIe transfer;
* the row mover (``ds_pfc.kernels.triton_rows``) gathering random rows of a mapped host
  table into a device slot (host reads) and scattering them back (host writes), for rows
  of 256 B to 2 KiB (bfloat16, d = 128 to 1024), swept over its launch parameters (warps
  per program, whole rows per pass, grid cap); the same for a device-memory table
  (device-to-device) and for 8-bit rows (codes and a scale, ``d + 4`` bytes, decoded and
  coded in registers); the table in ordinary 4 KiB pages and, where the kernel allows, in
  2 MiB huge pages (``MAP_HUGETLB``);
* ``--gemm``: a bfloat16 GEMM timed alone and beside a continuous move on another stream
  (its slowdown, and the move's rate beside it);
* ``--two-gpus``: the gather on two GPUs at once, each from its own table (two GPUs behind
  one PCIe uplink share it);
* ``--tier-check``: the GPU check of the mapped tier in under five minutes (table
  registration time, a sweep on a ``--table-gb`` table, and a mapped-bank step loop beside
  a synthetic 300 ms load with the fetch stream's busy time), writing one JSON whose
  ``planner_defaults`` the planner can read;
* ``--int8-momentum-study``: 8-bit momentum against float32 over 10^4 write-backs per row
  (CPU, small scale), :func:`int8_momentum_study`.

Every figure is GB/s of row data moved (one direction), with its ratio to the assumed
zero-copy rate. ``--dry`` runs the same code at toy sizes on the CPU (the kernel in
Triton's interpreter when ``TRITON_INTERPRET=1``, else torch ops; no timing meaning, it
checks the harness); on a GPU the table is ``--table-gb`` large (default 32).
"""
from __future__ import annotations

import argparse
import itertools
import mmap
import os
import sys
import time

import torch

from . import format_table, write_json
from .._args import parser

__all__ = ["build_parser", "main", "mapped_table"]

ASSUMED_ZERO_COPY_GBPS = 45.0     # planner default (PCIe gen5 x16, GPU kernel on mapped rows)
ASSUMED_DMA_GBPS = 50.0
_MAP_HUGETLB = 0x40000            # Linux


def mapped_table(num_rows: int, width: int, dtype: torch.dtype, huge: bool = False, times: dict | None = None):
    """A host table ``[num_rows, width]`` registered mapped and portable for the GPU, in
    4 KiB pages or 2 MiB huge pages (``huge``: reserved ones if the kernel has them, else
    transparent huge pages by ``madvise``). Returns ``(table, release)``; ``times`` (a dict)
    receives the seconds spent faulting the pages in (``fault_s``) and registering them
    (``register_s``)."""
    times = {} if times is None else times
    t0 = time.perf_counter()
    esize = torch.empty((), dtype=dtype).element_size()
    nbytes = num_rows * width * esize
    keep = None
    if huge:
        size = -(-nbytes // (2 << 20)) * (2 << 20)
        try:        # reserved huge pages (vm.nr_hugepages), else transparent ones on request
            buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_HUGETLB)
        except OSError:
            buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            buf.madvise(mmap.MADV_HUGEPAGE)
        table = torch.frombuffer(buf, dtype=dtype, count=num_rows * width).view(num_rows, width)
        keep = buf
    else:
        table = torch.empty(num_rows, width, dtype=dtype)
    table.zero_()                                     # pre-fault every page before registering
    t1 = time.perf_counter()
    times["fault_s"], times["register_s"] = t1 - t0, 0.0
    if not torch.cuda.is_available():
        return table, lambda: None
    err = torch.cuda.cudart().cudaHostRegister(table.data_ptr(), nbytes, 3)   # portable | mapped
    times["register_s"] = time.perf_counter() - t1
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with CUDA error {int(err)}")

    def release(table=table, keep=keep):
        torch.cuda.cudart().cudaHostUnregister(table.data_ptr())
        if keep is not None:
            del table
    return table, release


def _time(fn, device, repeats: int) -> float:
    """Median seconds of ``fn`` over ``repeats`` runs after one warm-up, timed by events on
    ``device``'s current stream (made the current device, so that a second GPU's launches
    and its events share a stream)."""
    if device.type == "cuda":
        with torch.cuda.device(device):
            return _time_here(fn, device, repeats)
    return _time_here(fn, device, repeats)


def _time_here(fn, device, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def _dma(device, nbytes: int, repeats: int) -> list[dict]:
    if device.type != "cuda":
        return []
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    out = []
    for name, fn in (("H2D", lambda: dev.copy_(host, non_blocking=True)),
                     ("D2H", lambda: host.copy_(dev, non_blocking=True))):
        s = _time(fn, device, repeats)
        out.append({"what": f"pinned DMA {name}", "gbps": nbytes / s / 1e9, "assumed_gbps": ASSUMED_DMA_GBPS})
    return out


def _movers():
    """(move, decode, encode) of the row mover where it runs here, else torch twins."""
    from ..kernels import triton_rows
    if triton_rows.available():
        return triton_rows.move_rows_, triton_rows.decode_rows_, triton_rows.encode_rows_
    from ..bank.rows import move_rows_torch_
    from ..bank.quantized import dequantize_rows, quantize_rows

    def decode(q, scale, src_idx, dst, dst_idx, mask=None, **_):
        dst.copy_(dequantize_rows(q.index_select(0, src_idx.to(q.device)), scale.index_select(0, src_idx.to(q.device))))

    def encode(src, src_idx, q, scale, dst_idx, mask=None, **_):
        cq, cs = quantize_rows(src)
        q.index_copy_(0, dst_idx.to(q.device), cq.to(q.device))
        scale.index_copy_(0, dst_idx.to(q.device), cs.to(q.device))
    return (lambda *a, config=None, kind=None, **k: move_rows_torch_(*a, **k)), decode, encode


def sweep_configs(kind: str, row_bytes: int, width: int, warps, rows_per_pass, programs) -> list:
    """The stated default first, then every combination asked for (0 or empty: the
    default's value)."""
    from ..kernels.triton_rows import MoverConfig, default_config
    base = default_config(kind, row_bytes, width)
    out = [base]
    for w, r, p in itertools.product(warps or [base.num_warps], rows_per_pass or [base.rows_per_pass],
                                     programs or [base.max_programs]):
        cfg = MoverConfig(w or base.num_warps, r or base.rows_per_pass, p or base.max_programs, 0)
        if cfg not in out:
            out.append(cfg)
    return out


def _rate_entry(what, kind, cfg, row_bytes, rows, seconds, label, **extra) -> dict:
    from ..kernels.triton_rows import bytes_in_flight
    return {"what": f"{what} {label}".strip(), "kind": kind, "row_bytes": row_bytes, "rows": rows,
            "config": dict(cfg._asdict()), "programs": cfg.max_programs,
            "bytes_in_flight": bytes_in_flight(cfg, row_bytes), "gbps": rows * row_bytes / seconds / 1e9,
            "assumed_gbps": ASSUMED_ZERO_COPY_GBPS, **extra}


def _moves(device, table, rows: int, sweep: dict, repeats: int, label: str) -> list[dict]:
    """Gather (host reads) and scatter (host writes) of ``rows`` random rows of ``table``
    for every launch configuration of the sweep."""
    move, _, _ = _movers()
    width = table.shape[1]
    g = torch.Generator().manual_seed(0)
    idx = torch.randperm(table.shape[0], generator=g)[:rows].sort().values.to(device)
    slot = torch.empty(rows, width, dtype=torch.float32, device=device)
    row_bytes = width * table.element_size()
    out = []
    for kind, what in (("host_read", "gather"), ("host_write", "scatter")):
        for cfg in sweep_configs(kind, row_bytes, width, **sweep):
            if kind == "host_read":
                fn = lambda cfg=cfg: move(table, idx, slot, None, config=cfg, kind=kind)
            else:
                fn = lambda cfg=cfg: move(slot, None, table, idx, config=cfg, kind=kind)
            out.append(_rate_entry(what, kind, cfg, row_bytes, rows, _time(fn, device, repeats), label))
    return out


def _device_moves(device, width: int, rows: int, sweep: dict, repeats: int) -> list[dict]:
    """Device-to-device gathers of a bfloat16 table of ``4 rows`` rows in device memory."""
    move, _, _ = _movers()
    table = torch.zeros(4 * rows, width, dtype=torch.bfloat16, device=device)
    idx = torch.randperm(4 * rows)[:rows].sort().values.to(device)
    slot = torch.empty(rows, width, dtype=torch.float32, device=device)
    row_bytes = width * 2
    return [_rate_entry("gather", "d2d", cfg, row_bytes, rows,
                        _time(lambda cfg=cfg: move(table, idx, slot, None, config=cfg, kind="d2d"), device, repeats),
                        f"{row_bytes} B rows, device table")
            for cfg in sweep_configs("d2d", row_bytes, width, **sweep)]


def _int8_moves(device, num_rows: int, width: int, rows: int, repeats: int) -> list[dict]:
    """8-bit rows of a mapped host table (codes and scales): decoded into a float32 slot
    and coded back, ``d + 4`` bytes a row, with the stated defaults."""
    from ..kernels.triton_rows import launch_config
    _, decode, encode = _movers()
    q, release_q = mapped_table(num_rows, width, torch.int8)
    scale, release_s = mapped_table(num_rows, 1, torch.float32)
    try:
        scale = scale.view(-1)
        idx = torch.randperm(num_rows)[:rows].sort().values.to(device)
        slot = torch.randn(rows, width, device=device)
        row_bytes = width + 4
        out = []
        for kind, what, fn in (("host_write", "int8 encode", lambda: encode(slot, None, q, scale, idx)),
                               ("host_read", "int8 decode", lambda: decode(q, scale, idx, slot, None))):
            cfg = launch_config(q if kind == "host_read" else slot, slot if kind == "host_read" else q, kind)
            out.append(_rate_entry(what, kind, cfg, row_bytes, rows, _time(fn, device, repeats),
                                   f"{row_bytes} B rows (d = {width})"))
        return out
    finally:
        release_q()
        release_s()


def gemm_beside_move(device, move_fn, repeats: int, size: int = 8192) -> dict:
    """A bfloat16 GEMM timed alone, then with ``move_fn`` looping on a side stream for as
    long as it runs: the GEMM's slowdown and the moves done meanwhile."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(size, size, dtype=dtype, device=device)
    gemm = lambda: a @ a
    alone = _time(gemm, device, repeats)
    if device.type != "cuda":          # no second stream: one after the other (harness check)
        beside = _time(lambda: (move_fn(), gemm()), device, repeats)
        return {"what": "GEMM beside a continuous move", "gemm_alone_ms": alone * 1e3,
                "gemm_beside_ms": beside * 1e3, "slowdown": beside / alone, "moves_beside": 1}
    move_s = _time(move_fn, device, 1)
    loops = max(1, int(alone / max(move_s, 1e-6)) + 1)
    side = torch.cuda.Stream(device)
    times = []
    for _ in range(repeats):
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(loops):
                move_fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        gemm()
        end.record()
        torch.cuda.current_stream(device).wait_stream(side)
        torch.cuda.synchronize(device)
        times.append(start.elapsed_time(end) / 1e3)
    beside = sorted(times)[len(times) // 2]
    return {"what": "GEMM beside a continuous move", "gemm_alone_ms": alone * 1e3, "gemm_beside_ms": beside * 1e3,
            "slowdown": beside / alone, "moves_beside": loops, "move_alone_ms": move_s * 1e3,
            "tflops_alone": 2 * size ** 3 / alone / 1e12}


def two_gpu_gather(devices, num_rows: int, width: int, rows: int, repeats: int) -> dict:
    """The gather on every device of ``devices`` at once, each from its own mapped table
    (on one machine: two GPUs share host memory, and behind one uplink the link): each
    GPU's rate alone and together, and the sum."""
    import threading
    move, _, _ = _movers()
    tables = [mapped_table(num_rows, width, torch.bfloat16) for _ in devices]
    try:
        work = []
        for dev, (table, _) in zip(devices, tables):
            idx = torch.randperm(num_rows)[:rows].sort().values.to(dev)
            slot = torch.empty(rows, width, dtype=torch.float32, device=dev)
            work.append((dev, lambda t=table, i=idx, s=slot: move(t, i, s, None, kind="host_read")))
        alone = [_time(fn, dev, repeats) for dev, fn in work]
        barrier = threading.Barrier(len(work))
        together = [0.0] * len(work)

        def run(i):
            dev, fn = work[i]
            if dev.type == "cuda":
                torch.cuda.set_device(dev)
            fn()
            barrier.wait()
            together[i] = _time(fn, dev, repeats)
        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(work))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        nbytes = rows * width * 2
        return {"what": f"gather on {len(work)} devices at once", "devices": [str(d) for d, _ in work],
                "gbps_alone": [nbytes / t / 1e9 for t in alone], "gbps_together": [nbytes / t / 1e9 for t in together],
                "gbps_sum_together": sum(nbytes / t / 1e9 for t in together), "row_bytes": width * 2, "rows": rows}
    finally:
        for _, release in tables:
            release()


def int8_momentum_study(steps: int = 10_000, classes: int = 256, dim: int = 64, batch: int = 256,
                        seeds: int = 3, lr: float = 0.1, momentum: float = 0.9, weight_decay: float = 5e-4,
                        scale: float = 30.0, noise: float = 0.2, every: int = 1000, quantize: bool = True) -> dict:
    """8-bit momentum against float32 over ``steps`` write-backs of every row (CPU, float32).

    A cosine-softmax head (``scale * x . w / |w|``, cross-entropy) on ``classes`` classes of
    ``dim``-d features (unit class means plus Gaussian noise of ``noise`` per coordinate,
    renormalised), every class in every step's softmax, so each row is stepped and written
    back once per step. SGD with momentum as the bank runs it: the slot holds float32, the
    step uses the float32 buffer ``m = momentum m + g + wd w``, and the write-back rounds
    ``m`` to int8 rowwise codes (``quantize_rows``; ``quantize=False``: float32, a check that
    the two runs are then identical). The learning rate drops 10x at 50% and 75% of the
    steps. Both runs see the same batches; every ``every`` steps the held-out loss and
    accuracy of each, the relative distance of the weights and of the momenta, and the mean
    cosine of corresponding rows are recorded."""
    from ..bank.quantized import dequantize_rows, quantize_rows
    runs = []
    for seed in range(seeds):
        g = torch.Generator().manual_seed(seed)
        means = torch.nn.functional.normalize(torch.randn(classes, dim, generator=g), dim=1)

        def draw(n):
            y = torch.randint(0, classes, (n,), generator=g)
            x = torch.nn.functional.normalize(means[y] + noise * torch.randn(n, dim, generator=g), dim=1)
            return x, y
        ex, ey = draw(4096)
        w0 = torch.nn.functional.normalize(torch.randn(classes, dim, generator=g), dim=1)
        w = {"fp32": w0.clone(), "int8": w0.clone()}
        m = {"fp32": torch.zeros(classes, dim), "int8": torch.zeros(classes, dim)}
        curve = []

        def loss_acc(weights, x, y):
            logits = scale * x @ torch.nn.functional.normalize(weights, dim=1).t()
            return torch.nn.functional.cross_entropy(logits, y), (logits.argmax(1) == y).float().mean()
        for step in range(1, steps + 1):
            x, y = draw(batch)
            rate = lr * (0.1 if step > steps // 2 else 1.0) * (0.1 if step > 3 * steps // 4 else 1.0)
            for name in ("fp32", "int8"):
                wt = w[name].clone().requires_grad_(True)
                loss, _ = loss_acc(wt, x, y)
                (grad,) = torch.autograd.grad(loss, wt)
                buf = momentum * m[name] + grad + weight_decay * w[name]
                w[name] = w[name] - rate * buf
                m[name] = dequantize_rows(*quantize_rows(buf)) if (name == "int8" and quantize) else buf
            if step % every == 0 or step == steps:
                with torch.no_grad():
                    point = {"step": step}
                    for name in ("fp32", "int8"):
                        loss, acc = loss_acc(w[name], ex, ey)
                        point[f"{name}_loss"], point[f"{name}_acc"] = float(loss), float(acc)
                    point["weight_rel_dist"] = float((w["int8"] - w["fp32"]).norm() / w["fp32"].norm())
                    point["momentum_rel_dist"] = float((m["int8"] - m["fp32"]).norm() / m["fp32"].norm().clamp_min(1e-30))
                    point["row_cosine_mean"] = float(torch.nn.functional.cosine_similarity(w["int8"], w["fp32"], dim=1).mean())
                    curve.append(point)
        runs.append({"seed": seed, "curve": curve})
    final = [r["curve"][-1] for r in runs]
    mean = lambda k: sum(p[k] for p in final) / len(final)
    summary = {k: mean(k) for k in ("fp32_loss", "int8_loss", "fp32_acc", "int8_acc", "weight_rel_dist",
                                    "momentum_rel_dist", "row_cosine_mean")}
    summary["acc_diff_max"] = max(abs(p["int8_acc"] - p["fp32_acc"]) for p in final)
    summary["write_backs_per_row"] = steps
    return {"config": {"steps": steps, "classes": classes, "dim": dim, "batch": batch, "seeds": seeds, "lr": lr,
                       "momentum": momentum, "weight_decay": weight_decay, "scale": scale, "noise": noise,
                       "quantize": quantize},
            "summary": summary, "runs": runs}


def _load(ms: float, device):
    """A synthetic backbone on the compute stream: bfloat16 GEMMs for about ``ms`` ms
    (calibrated once), or on the CPU small products for ``ms`` ms of wall time."""
    if device.type != "cuda":
        a = torch.randn(128, 128)

        def run():
            end = time.perf_counter() + ms / 1e3
            while time.perf_counter() < end:
                torch.tanh(a @ a)
        return run
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    one = _time(lambda: a @ a, device, 3)
    loops = max(1, int(ms / 1e3 / one))
    return lambda: [a @ a for _ in range(loops)]


def _fetch_busy(stager, device):
    """Wrap the stager's runtime so that every operation on its fetch stream is bracketed
    by timing events; returns a function giving (and resetting) the busy seconds since.
    Operations on one stream run in order, so the busy time is the sum of the brackets."""
    rt, fetch = stager.runtime, stager._fetch_stream
    orig, spans = rt.run, []

    def run(stream, fn, *args, **kwargs):
        if stream is not fetch:
            return orig(stream, fn, *args, **kwargs)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(fetch)
            orig(stream, fn, *args, **kwargs)
            end.record(fetch)
            spans.append((start, end))
        else:
            t0 = time.perf_counter()
            orig(stream, fn, *args, **kwargs)
            spans.append(time.perf_counter() - t0)
    rt.run = run

    def take() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            busy = sum(a.elapsed_time(b) for a, b in spans) / 1e3
        else:
            busy = sum(spans)
        spans.clear()
        return busy
    return take


def bank_step_loop(device, classes: int, dim: int, batch: int, sample_rate: float, steps: int, load_ms: float,
                   warmup: int = 2) -> dict:
    """A mapped-bank head (weight bfloat16, momentum 8-bit, both in host memory) stepping
    beside a synthetic ``load_ms`` backbone with the next step's rows prefetched: step
    time, and how long the fetch stream was busy per step (its moves must fit the load)."""
    from ..bank import TieredBank
    from ..core.head import PartialFC
    bank = TieredBank.factory({"momentum_buffer": ("host", "int8_rowwise")}, default=("host", torch.bfloat16),
                              host_access="mapped")
    t0 = time.perf_counter()
    head = PartialFC(classes, dim, sample_rate=sample_rate, device=device, bank=bank, optimizer="sgd",
                     momentum=0.9, weight_decay=5e-4, data_parallel_grad=False)
    build_s = time.perf_counter() - t0
    load = _load(load_ms, device)
    gen = torch.Generator().manual_seed(1)
    labels = [torch.randint(0, classes, (batch,), generator=gen).to(device) for _ in range(warmup + steps + 1)]
    take = _fetch_busy(head._stager, device)
    step_s, busy_s, moved = [], [], []
    try:
        for it in range(warmup + steps):
            x = torch.randn(batch, dim, generator=gen).to(device).requires_grad_()
            take()
            t = time.perf_counter()
            loss = head(x, labels[it])
            loss.backward()
            head.step(0.1)
            head.prefetch(labels[it + 1])
            load()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            elapsed = time.perf_counter() - t
            if it >= warmup:
                step_s.append(elapsed)
                busy_s.append(take())
                traffic = head.last_step_traffic
                moved.append(traffic.get("staged_in", 0) + traffic.get("written_back", 0))
    finally:
        head.close()
    med = lambda v: sorted(v)[len(v) // 2]
    return {"what": "mapped bank step beside a synthetic load", "classes": classes, "dim": dim, "batch": batch,
            "sample_rate": sample_rate, "load_ms": load_ms, "build_s": build_s, "step_ms": med(step_s) * 1e3,
            "fetch_busy_ms": med(busy_s) * 1e3, "bytes_per_step": med(moved),
            "fetch_gbps": med(moved) / max(med(busy_s), 1e-9) / 1e9, "hidden": med(busy_s) * 1e3 < load_ms}


def tier_check(device, dry: bool, table_gb: float = 32.0, repeats: int = 5) -> tuple[list[dict], dict]:
    """The GPU check of the mapped tier (under five minutes on an H100/H200): returns the
    results and the ``planner_defaults`` they give."""
    from ..kernels.triton_rows import default_config
    results = _dma(device, 1 << 30, repeats)
    nbytes = int(table_gb * 1e9) if not dry else 1 << 20
    rows = 400_000 if not dry else 64
    times: dict = {}
    table, release = mapped_table(nbytes // 1024, 512, torch.bfloat16, times=times)
    results.append({"what": "register a mapped table", "bytes": nbytes, **times,
                    "register_gbps": nbytes / max(times["register_s"], 1e-9) / 1e9})
    sweep = {"warps": [4, 8], "rows_per_pass": [0, 32] if not dry else [0], "programs": [8, 16, 32]}
    try:
        for width in (512, 128):
            results += _moves(device, table.view(-1, width), rows, sweep, repeats, f"{width * 2} B rows, 4 KiB pages")
        move, _, _ = _movers()
        idx = torch.randperm(table.shape[0])[:rows].sort().values.to(device)
        slot = torch.empty(rows, 512, device=device)
        results.append(gemm_beside_move(device, lambda: move(table, idx, slot, None, kind="host_read"), repeats,
                                        size=8192 if not dry else 64))
    finally:
        release()
        del table
    results += _device_moves(device, 512, rows, {"warps": [], "rows_per_pass": [], "programs": []}, repeats)
    results += _int8_moves(device, (nbytes // 8) // 516 if not dry else 256, 512, rows, repeats)
    results.append(bank_step_loop(device, classes=4_000_000 if not dry else 2000, dim=512 if not dry else 16,
                                  batch=1024 if not dry else 32, sample_rate=0.1, steps=8 if not dry else 2,
                                  load_ms=300.0 if not dry else 20.0))
    return results, planner_defaults(results)


def planner_defaults(results: list[dict]) -> dict:
    """The figures the planner takes as defaults, from a tier check's results (None where
    the run did not measure them). Rates are GB/s of row data, one direction."""
    from ..kernels.triton_rows import default_config

    def rate(kind, what, row_bytes, default_only=True):
        hits = [r for r in results if r.get("kind") == kind and r["what"].startswith(what)
                and r.get("row_bytes") == row_bytes]
        if default_only and hits:
            want = dict(default_config(kind, row_bytes, row_bytes // 2)._asdict())
            hits = [r for r in hits if r.get("config") == want] or hits[:1]
        return max((r["gbps"] for r in hits), default=None)

    def best(kind, what, row_bytes):
        hits = [r for r in results if r.get("kind") == kind and r["what"].startswith(what)
                and r.get("row_bytes") == row_bytes]
        top = max(hits, key=lambda r: r["gbps"], default=None)
        return None if top is None else {"gbps": top["gbps"], "config": top["config"]}
    find = lambda prefix: next((r for r in results if r["what"].startswith(prefix)), {})
    dma = {r["what"]: r["gbps"] for r in results if r["what"].startswith("pinned DMA")}
    step, gemm, reg = find("mapped bank step"), find("GEMM beside"), find("register a mapped")
    int8 = {r["kind"]: r["gbps"] for r in results if r["what"].startswith("int8")}
    return {
        "zero_copy_read_gbps": rate("host_read", "gather", 1024),
        "zero_copy_write_gbps": rate("host_write", "scatter", 1024),
        "zero_copy_read_gbps_d128": rate("host_read", "gather", 256),
        "zero_copy_write_gbps_d128": rate("host_write", "scatter", 256),
        "best_read_d512": best("host_read", "gather", 1024),
        "best_write_d512": best("host_write", "scatter", 1024),
        "int8_read_gbps": int8.get("host_read"),
        "int8_write_gbps": int8.get("host_write"),
        "d2d_gbps": rate("d2d", "gather", 1024),
        "dma_h2d_gbps": dma.get("pinned DMA H2D"),
        "dma_d2h_gbps": dma.get("pinned DMA D2H"),
        "register_gbps": reg.get("register_gbps"),
        "gemm_slowdown_beside_move": gemm.get("slowdown"),
        "fetch_busy_ms_per_step": step.get("fetch_busy_ms"),
        "fetch_gbps_in_step": step.get("fetch_gbps"),
        "step_ms_beside_load": step.get("step_ms"),
        "load_ms": step.get("load_ms"),
        "mover_default_host_read_d512": dict(default_config("host_read", 1024, 512)._asdict()),
    }


def _ints(text: str) -> list[int]:
    return [int(x) for x in str(text).split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = parser("ds-pfc-bench rows", "Row moves between host memory and the GPU: page-locked DMA and the row mover "
               "on a mapped host table, swept over its launch parameters, next to the figures the planner assumes; "
               "--tier-check for the five-minute GPU check of the mapped tier.")
    p.add_argument("--table-gb", type=float, default=32.0,
                   help="mapped host table size, GB (10^9 bytes; GPU runs, default 32)")
    p.add_argument("--rows", type=int, default=400_000, help="rows moved per launch")
    p.add_argument("--row-bytes", default="256,1024,2048", help="bfloat16 row sizes")
    p.add_argument("--warps", default="", help="warps per program to sweep (default: the stated default only)")
    p.add_argument("--rows-per-pass", default="", help="whole rows per pass to sweep, powers of two (default: the "
                   "stated default only)")
    p.add_argument("--programs", default="2,4,8,16,32", help="grid caps to sweep")
    p.add_argument("--huge", choices=["no", "yes", "both"], default="both", help="2 MiB huge pages too")
    p.add_argument("--gemm", action="store_true", help="also time a bf16 GEMM (8192^3) alone and beside a continuous "
                   "move (its slowdown)")
    p.add_argument("--two-gpus", action="store_true", help="also run the gather on two GPUs at once")
    p.add_argument("--int8", action="store_true", help="also move 8-bit rows (codes and scale, d + 4 bytes)")
    p.add_argument("--tier-check", action="store_true", help="the GPU check of the mapped tier (under 5 minutes): "
                   "registration, a sweep on a --table-gb table, a mapped-bank step loop beside a 300 ms load; its "
                   "JSON has planner_defaults")
    p.add_argument("--int8-momentum-study", action="store_true", help="8-bit momentum against float32 over 10^4 "
                   "write-backs per row (CPU)")
    p.add_argument("--study-steps", type=int, default=10_000, help="steps (write-backs per row) of the study")
    p.add_argument("--repeats", type=int, default=5,
                   help="timed runs per figure after one warm-up; the median is reported (default 5)")
    p.add_argument("--dry", action="store_true", help="toy sizes on the CPU: checks the harness, times mean nothing")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/rows-<device>-<date>.json)")
    return p


def _print(results: list[dict]) -> None:
    rows = []
    for r in results:
        if "gbps" in r:
            cfg = r.get("config")
            cfg = f"{cfg['num_warps']}w {cfg['rows_per_pass']}r {cfg['max_programs']}p" if cfg else ""
            rows.append([r["what"], cfg, f"{r.get('bytes_in_flight', 0) / 1024:.0f}" if cfg else "",
                         f"{r['gbps']:.1f}", f"{r['gbps'] / r['assumed_gbps']:.2f}" if "assumed_gbps" in r else ""])
        elif "slowdown" in r:
            rows.append([r["what"], "", "", f"x{r['slowdown']:.3f}", ""])
        elif "fetch_busy_ms" in r:
            rows.append([r["what"], f"load {r['load_ms']:.0f} ms", "", f"busy {r['fetch_busy_ms']:.1f} ms",
                         f"step {r['step_ms']:.0f} ms"])
        elif "gbps_sum_together" in r:
            rows.append([r["what"], "", "", f"{r['gbps_sum_together']:.1f}", ""])
        elif "register_s" in r:
            rows.append([r["what"], f"{r['bytes'] / 1e9:.1f} GB", "", f"{r['register_s']:.2f} s", ""])
        else:
            rows.append([r["what"], "", "", str(r.get("error", ""))[:60], ""])
    print(format_table(["what", "launch", "KiB in flight", "GB/s (or)", "x assumed"], rows))


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    for name in ("table_gb", "rows", "repeats", "study_steps"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be > 0")
    try:
        sweep = {"warps": _ints(args.warps), "rows_per_pass": _ints(args.rows_per_pass),
                 "programs": _ints(args.programs)}
        row_sizes = _ints(args.row_bytes)
    except ValueError as err:
        p.error(f"--warps, --rows-per-pass, --programs and --row-bytes take comma-separated integers ({err})")
    for name, values in (("warps", sweep["warps"]), ("rows-per-pass", sweep["rows_per_pass"])):
        if any(v < 1 or v & (v - 1) for v in values):
            p.error(f"--{name} takes powers of two, got {values}")
    if any(v < 1 for v in sweep["programs"]) or any(v < 2 or v % 2 for v in row_sizes):
        p.error("--programs must be >= 1 and --row-bytes even and >= 2")
    stamp = time.strftime('%Y%m%d-%H%M%S')
    if args.int8_momentum_study:
        study = int8_momentum_study(steps=args.study_steps if not args.dry else 20, seeds=3 if not args.dry else 1,
                                    every=1000 if not args.dry else 10)
        print(format_table(["", "value"], [[k, f"{v:.6g}" if isinstance(v, float) else v]
                                            for k, v in study["summary"].items()]))
        out = args.out or os.path.join("benchmarks", "results", f"int8-momentum-study-cpu-{stamp}.json")
        write_json(out, "int8-momentum-study", study["config"], study["runs"], {"summary": study["summary"]})
        print(f"wrote {out}")
        return 0
    device = torch.device("cuda" if torch.cuda.is_available() and not args.dry else "cpu")
    if device.type != "cuda" and not args.dry:
        p.error("needs a CUDA device (or --dry for a harness check on the CPU)")
    if args.tier_check:
        t0 = time.perf_counter()
        results, defaults = tier_check(device, args.dry, args.table_gb, args.repeats)
        _print(results)
        print(format_table(["planner default", "value"], [[k, v] for k, v in defaults.items()]))
        print(f"tier check: {time.perf_counter() - t0:.0f} s")
        out = args.out or os.path.join("benchmarks", "results", f"tier-check-{device.type}-{stamp}.json")
        write_json(out, "tier-check", vars(args), results, {"planner_defaults": defaults,
                                                             "seconds": time.perf_counter() - t0})
        print(f"wrote {out}")
        return 0
    table_bytes = int(args.table_gb * 1e9) if not args.dry else 1 << 20
    rows = args.rows if not args.dry else 64
    results = _dma(device, min(table_bytes, 1 << 30), args.repeats)
    for row_bytes in row_sizes:
        width = row_bytes // 2
        for huge in {"no": [False], "yes": [True], "both": [False, True]}[args.huge]:
            label = f"{row_bytes} B rows, {'2 MiB' if huge else '4 KiB'} pages"
            try:
                table, release = mapped_table(max(rows, table_bytes // row_bytes), width, torch.bfloat16, huge)
            except (OSError, RuntimeError) as err:
                results.append({"what": f"table {label}", "error": str(err)})
                continue
            try:
                results += _moves(device, table, rows, sweep, args.repeats, label)
                if args.gemm and not huge:
                    move, _, _ = _movers()
                    idx = torch.randperm(table.shape[0])[:rows].sort().values.to(device)
                    slot = torch.empty(rows, width, device=device)
                    entry = gemm_beside_move(device, lambda: move(table, idx, slot, None, kind="host_read"),
                                             args.repeats, size=8192 if not args.dry else 64)
                    results.append({**entry, "what": f"{entry['what']} ({label})"})
            finally:
                release()
                del table
        results += _device_moves(device, width, rows, sweep, args.repeats)
        if args.int8:
            results += _int8_moves(device, max(rows, table_bytes // (width + 4)), width, rows, args.repeats)
    if args.two_gpus:
        devices = ([torch.device("cuda", i) for i in range(2)] if device.type == "cuda" else [device, device])
        if len(devices) == 2 and (device.type != "cuda" or torch.cuda.device_count() >= 2):
            results.append(two_gpu_gather(devices, max(rows, table_bytes // 1024), 512, rows, args.repeats))
        else:
            results.append({"what": "gather on 2 devices at once", "error": "needs two CUDA devices"})
    _print(results)
    if args.dry:
        print("(--dry: toy sizes on the CPU; the figures mean nothing)")
    out = args.out or os.path.join("benchmarks", "results", f"rows-{device.type}-{stamp}.json")
    write_json(out, "rows", vars(args), results)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
