"""Row moves between host memory and the GPU: ``ds-pfc-bench rows [options]``.

What the mapped host tier (``TieredBank(host_access="mapped")``) rests on, measured on one
GPU and printed next to the figure the planner assumes (``docs/planner.md``):

* page-locked DMA, host to device and back (``copy_`` of a pinned buffer): the copy
  engines' rate, the ceiling of any PCIe transfer;
* the row-move kernel gathering random rows of a mapped host table into a device slot,
  and scattering them back, for rows of 256 B to 2 KiB (bfloat16, d = 128 to 1024), with
  the grid capped at 2 to 16 programs; the table in ordinary 4 KiB pages and, where the
  kernel allows, in 2 MiB huge pages (``MAP_HUGETLB``);
* the same gather while a bfloat16 GEMM runs on another stream: how much each slows the
  other.

Every figure is GB/s of row data moved (one direction), with its ratio to the assumed
zero-copy rate. ``--dry`` runs the same code at toy sizes on the CPU (no timing meaning,
it checks the harness); on a GPU the table is ``--table-gb`` large (default 32).
"""
from __future__ import annotations

import argparse
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


def mapped_table(num_rows: int, width: int, dtype: torch.dtype, huge: bool = False):
    """A host table ``[num_rows, width]`` registered mapped and portable for the GPU, in
    4 KiB pages or 2 MiB huge pages (``huge``: reserved ones if the kernel has them, else
    transparent huge pages by ``madvise``). Returns ``(table, release)``."""
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
    if not torch.cuda.is_available():
        return table, lambda: None
    err = torch.cuda.cudart().cudaHostRegister(table.data_ptr(), nbytes, 3)   # portable | mapped
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with CUDA error {int(err)}")

    def release(table=table, keep=keep):
        torch.cuda.cudart().cudaHostUnregister(table.data_ptr())
        if keep is not None:
            del table
    return table, release


def _time(fn, device, repeats: int) -> float:
    """Median seconds of ``fn`` over ``repeats`` runs after one warm-up."""
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


def _moves(device, table, rows: int, programs: list[int], repeats: int, label: str, gemm=None) -> list[dict]:
    from ..kernels import triton_rows
    move = triton_rows.move_rows_ if triton_rows.available() else None
    width = table.shape[1]
    g = torch.Generator().manual_seed(0)
    idx = torch.randperm(table.shape[0], generator=g)[:rows].sort().values.to(device)
    slot = torch.empty(rows, width, dtype=torch.float32, device=device)
    nbytes = rows * width * table.element_size()
    out = []
    for p in programs:
        if move is None:
            gather = lambda: triton_rows.move_rows_torch_(table, idx.to(table.device), slot, None)
            scatter = lambda: triton_rows.move_rows_torch_(slot, None, table, idx.to(table.device))
        else:
            gather = lambda p=p: move(table, idx, slot, None, max_programs=p)
            scatter = lambda p=p: move(slot, None, table, idx, max_programs=p)
        for what, fn in (("gather", gather), ("scatter", scatter)):
            if gemm is not None:
                fn = _beside(fn, gemm)
            s = _time(fn, device, repeats)
            out.append({"what": f"{what} {label}", "row_bytes": width * table.element_size(), "programs": p,
                        "rows": rows, "gbps": nbytes / s / 1e9, "assumed_gbps": ASSUMED_ZERO_COPY_GBPS,
                        "beside_gemm": gemm is not None})
    return out


def _beside(fn, gemm):
    """``fn`` on the current stream while ``gemm`` runs on another."""
    side = torch.cuda.Stream()

    def run():
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            gemm()
        fn()
        torch.cuda.current_stream().wait_stream(side)
    return run


def build_parser() -> argparse.ArgumentParser:
    p = parser("ds-pfc-bench rows", "Row moves between host memory and the GPU: page-locked DMA and the row-move "
               "kernel on a mapped host table, measured on one GPU next to the figures the planner assumes.")
    p.add_argument("--table-gb", type=float, default=32.0,
                   help="mapped host table size, GB (10^9 bytes; GPU runs, default 32)")
    p.add_argument("--rows", type=int, default=400_000, help="rows moved per launch")
    p.add_argument("--row-bytes", default="256,1024,2048", help="bfloat16 row sizes")
    p.add_argument("--programs", default="2,4,8,16", help="grid caps of the row-move kernel")
    p.add_argument("--huge", choices=["no", "yes", "both"], default="both", help="2 MiB huge pages too")
    p.add_argument("--gemm", action="store_true", help="also measure beside a bf16 GEMM (8192^3)")
    p.add_argument("--repeats", type=int, default=5,
                   help="timed runs per figure after one warm-up; the median is reported (default 5)")
    p.add_argument("--dry", action="store_true", help="toy sizes on the CPU: checks the harness, times mean nothing")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/rows-<device>-<date>.json)")
    return p


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    for name in ("table_gb", "rows", "repeats"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be > 0")
    device = torch.device("cuda" if torch.cuda.is_available() and not args.dry else "cpu")
    if device.type != "cuda" and not args.dry:
        p.error("needs a CUDA device (or --dry for a harness check on the CPU)")
    row_sizes = [int(x) for x in args.row_bytes.split(",")]
    programs = [int(x) for x in args.programs.split(",")]
    table_bytes = int(args.table_gb * 1e9) if not args.dry else 1 << 20
    rows = args.rows if not args.dry else 64
    results = _dma(device, min(table_bytes, 1 << 30), args.repeats)
    gemm = None
    if args.gemm and device.type == "cuda":
        a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
        gemm = (lambda: a @ a)
        s = _time(gemm, device, args.repeats)
        results.append({"what": "bf16 GEMM 8192^3 alone", "tflops": 2 * 8192 ** 3 / s / 1e12})
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
                results += _moves(device, table, rows, programs, args.repeats, label)
                if gemm is not None:
                    results += _moves(device, table, rows, programs[-1:], args.repeats, label, gemm=gemm)
            finally:
                release()
                del table
    table_rows = []
    for r in results:
        if "gbps" in r:
            table_rows.append([r["what"], r.get("programs", ""), "yes" if r.get("beside_gemm") else "",
                               f"{r['gbps']:.1f}", f"{r['assumed_gbps']:.0f}", f"{r['gbps'] / r['assumed_gbps']:.2f}"])
        elif "tflops" in r:
            table_rows.append([r["what"], "", "", f"{r['tflops']:.0f} TF/s", "", ""])
        else:
            table_rows.append([r["what"], "", "", r.get("error", "")[:60], "", ""])
    print(format_table(["what", "programs", "beside GEMM", "GB/s", "assumed GB/s", "x assumed"], table_rows))
    if args.dry:
        print("(--dry: toy sizes on the CPU; the figures mean nothing)")
    out = args.out or os.path.join("benchmarks", "results", f"rows-{device.type}-{time.strftime('%Y%m%d-%H%M%S')}.json")
    write_json(out, "rows", vars(args), results)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
