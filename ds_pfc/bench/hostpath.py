"""Host path benchmark: the host tier's gather and scatter, and the split of a sorted
set, each next to its floor measured in the same run on the same cores.

- ``gather``: ``HostStore.gather_into`` of ``--rows`` random sorted rows of a
  ``--table-gb`` table into a staging buffer; floor: a contiguous ``copy_`` of the same
  bytes from the table into the buffer.
- ``scatter``: ``HostStore.scatter`` of the buffer into random sorted rows (row
  versions counted); floor: a contiguous ``copy_`` of the same bytes into the table.
- ``before``: the previous implementation of each, for reference (``index_select`` and
  ``index_copy_`` + ``versions[rows] += 1``, one thread), against the same floor.
- ``split``: the mask of a's elements found in b, for sorted unique int64 sets a and b
  of ``--rows`` each, drawn from ``16 * --rows`` ids (half of a in b): ``torch.isin``
  (the old way) next to ``torch.searchsorted`` + equality (the reference, no sort).

Every repeat draws new rows, so the table's rows are as cold as in training; the floor
copies a new range of the table each time. With ``--threads N`` the store uses N
threads and the floor is split over N threads the same way. torch's intra-op pool is
set to one thread, as torchrun sets it. Times are medians of ``--repeats`` runs after
one warm-up, as wall time and as CPU time of the process (``time.process_time``: all
its threads), since a shared machine's wall time is noisy.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from . import format_table, write_json
from .._args import parser

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _ints(text: str) -> list[int]:
    return [int(v) for v in str(text).split(",") if v.strip()]


def _sorted_rows(num: int, universe: int, gen: torch.Generator) -> torch.Tensor:
    """``num`` distinct sorted row ids below ``universe``, uniformly at random."""
    if num * 2 >= universe:
        return torch.randperm(universe, generator=gen)[:num].sort().values
    rows = torch.empty(0, dtype=torch.int64)
    while rows.numel() < num:
        extra = torch.randint(0, universe, (int(num * 1.2) + 16,), generator=gen)
        rows = torch.unique(torch.cat([rows, extra]))
    keep = torch.randperm(rows.numel(), generator=gen)[:num].sort().values
    return rows[keep]


def _measure(fn, repeats: int) -> dict:
    """Median wall and CPU seconds of ``fn(i)`` for i in 1..repeats, after ``fn(0)``."""
    walls, cpus = [], []
    for i in range(repeats + 1):
        c0, t0 = time.process_time(), time.perf_counter()
        fn(i)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        if i:
            walls.append(wall)
            cpus.append(cpu)
    return {"wall_s": statistics.median(walls), "cpu_s": statistics.median(cpus),
            "wall_min_s": min(walls), "wall_max_s": max(walls)}


class _Split:
    """``fn(lo, hi)`` over ``[0, num)`` in ``threads`` contiguous parts: the first on the
    calling thread, the rest on a pool (as the store splits its rows)."""

    def __init__(self, threads: int):
        self.threads = threads
        self.pool = ThreadPoolExecutor(max_workers=threads - 1) if threads > 1 else None

    def __call__(self, num: int, fn) -> None:
        bounds = [num * i // self.threads for i in range(self.threads + 1)]
        parts = [(lo, hi) for lo, hi in zip(bounds, bounds[1:]) if hi > lo]
        futures = [self.pool.submit(fn, lo, hi) for lo, hi in parts[1:]] if self.pool else []
        if parts:
            fn(*parts[0])
        for fut in futures:
            fut.result()

    def close(self):
        if self.pool is not None:
            self.pool.shutdown()


def _row_case(store, dtype_name: str, num: int, threads: int, repeats: int, gen: torch.Generator,
              before: bool) -> list[dict]:
    """gather and scatter of ``num`` rows with ``threads`` threads, with their floors."""
    table, versions = store.data, store.versions
    total = store.num_rows
    store.threads = threads
    # Rows of every repeat drawn up front, so that drawing them is never timed.
    rowsets = [_sorted_rows(num, total, gen) for _ in range(repeats + 1)]
    starts = torch.randint(0, total - num + 1, (repeats + 1,), generator=gen).tolist()
    values = torch.randn((num,) + store.row_shape, generator=gen).to(store.dtype)
    out = torch.empty_like(values)
    out.zero_()
    nbytes = values.numel() * values.element_size()
    split = _Split(threads)
    try:
        floor_read = _measure(lambda i: split(num, lambda lo, hi: out[lo:hi].copy_(
            table[starts[i] + lo:starts[i] + hi])), repeats)
        gather = _measure(lambda i: store.gather_into(rowsets[i], out), repeats)
        floor_write = _measure(lambda i: split(num, lambda lo, hi: table[starts[i] + lo:starts[i] + hi].copy_(
            values[lo:hi])), repeats)
        scatter = _measure(lambda i: store.scatter(rowsets[i], values), repeats)
        old_gather = old_scatter = None
        if before:
            old_gather = _measure(lambda i: torch.index_select(table, 0, rowsets[i], out=out), repeats)

            def old_scatter_fn(i):
                table.index_copy_(0, rowsets[i], values)
                versions[rowsets[i]] += 1
            old_scatter = _measure(old_scatter_fn, repeats)
    finally:
        split.close()
    base = {"dtype": dtype_name, "dim": store.width, "rows": num, "threads": threads, "bytes": nbytes,
            "table_rows": total, "table_bytes": table.numel() * table.element_size()}
    results = []
    for op, got, floor, old in (("gather", gather, floor_read, old_gather),
                                ("scatter", scatter, floor_write, old_scatter)):
        rec = {"op": op, **base, **got, "floor_wall_s": floor["wall_s"], "floor_cpu_s": floor["cpu_s"],
               "ratio_wall": got["wall_s"] / floor["wall_s"], "ratio_cpu": got["cpu_s"] / max(floor["cpu_s"], 1e-9),
               "gbps": nbytes / got["wall_s"] / 1e9, "floor_gbps": nbytes / floor["wall_s"] / 1e9}
        if old is not None:
            rec.update({"before_wall_s": old["wall_s"], "before_cpu_s": old["cpu_s"],
                        "before_ratio_wall": old["wall_s"] / floor["wall_s"],
                        "before_ratio_cpu": old["cpu_s"] / max(floor["cpu_s"], 1e-9)})
        results.append(rec)
    return results


def _split_case(num: int, universe: int, repeats: int, gen: torch.Generator) -> dict:
    """The mask of a's elements found in b: isin against searchsorted + equality. a and
    b are drawn from ids below ``universe``; half of a is in b."""
    a = _sorted_rows(num, universe, gen)
    shared = a[torch.randperm(num, generator=gen)[:num // 2]]
    b = torch.unique(torch.cat([shared, _sorted_rows(num - num // 2, universe, gen)]))   # sorted, unique

    def searched(_i):
        pos = torch.searchsorted(b, a).clamp_(max=max(b.numel() - 1, 0))
        return b.index_select(0, pos) == a

    def isin(_i):
        return torch.isin(a, b, assume_unique=True)
    if b.numel() == 0:
        raise ValueError("the split needs --rows of at least 1")
    if not torch.equal(searched(0), isin(0)):
        raise AssertionError("searchsorted and isin disagree")
    ref = _measure(searched, repeats)
    old = _measure(isin, repeats)
    return {"op": "split", "rows": num, "b_rows": b.numel(), "threads": 1, **old,
            "floor_wall_s": ref["wall_s"], "floor_cpu_s": ref["cpu_s"],
            "ratio_wall": old["wall_s"] / ref["wall_s"], "ratio_cpu": old["cpu_s"] / max(ref["cpu_s"], 1e-9),
            "reference": "searchsorted + equality", "figure": "torch.isin"}


def _ms(seconds) -> str:
    return "" if seconds is None else f"{seconds * 1e3:.2f}"


def _ratio(value) -> str:
    return "" if value is None else f"{value:.2f}"


def build_parser() -> argparse.ArgumentParser:
    p = parser("ds-pfc-bench hostpath", " ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--rows", default="100000,1000000", help="rows per gather/scatter (comma-separated list)")
    p.add_argument("--dim", default="128,512", help="row widths (comma-separated list)")
    p.add_argument("--dtype", default="fp32,bf16", help="storage dtypes: fp32, bf16 (comma-separated list)")
    p.add_argument("--table-gb", type=float, default=2.0,
                   help="table size in GiB per dtype and width (at least twice the largest --rows)")
    p.add_argument("--threads", default=None,
                   help="store threads (comma-separated list; default: 1 and the store's default, "
                        "$DS_PFC_BANK_THREADS or min(8, cpus)")
    p.add_argument("--repeats", type=int, default=5, help="measured runs per figure (the median is reported)")
    p.add_argument("--no-before", action="store_true", help="skip the previous implementation's figures")
    p.add_argument("--json", default=None, metavar="PATH",
                   help="where to write the results (default benchmarks/results/hostpath-<date>.json)")
    return p


def main(argv=None) -> int:
    from ..bank.stores import default_threads
    p = build_parser()
    args = p.parse_args(argv)
    dtypes = [d for d in args.dtype.split(",") if d]
    for d in dtypes:
        if d not in _DTYPES:
            p.error(f"--dtype must be among {sorted(_DTYPES)}, got {d!r}")
    rows_list, dims = _ints(args.rows), _ints(args.dim)
    threads_list = _ints(args.threads) if args.threads else sorted({1, default_threads()})
    if not rows_list or not dims or min(rows_list) < 1 or min(dims) < 1 or min(threads_list) < 1 or args.repeats < 1:
        p.error("--rows, --dim, --threads and --repeats must be >= 1")

    saved_threads = torch.get_num_threads()
    torch.set_num_threads(1)            # as under torchrun: the store's threads are its own
    try:
        return _run(args, dtypes, rows_list, dims, threads_list)
    finally:
        torch.set_num_threads(saved_threads)


def _run(args, dtypes, rows_list, dims, threads_list) -> int:
    from ..bank.stores import HostStore
    gen = torch.Generator().manual_seed(0)
    results = []
    max_rows = max(rows_list)
    for dtype_name in dtypes:
        dtype = _DTYPES[dtype_name]
        for dim in dims:
            row_bytes = dim * torch.empty((), dtype=dtype).element_size()
            table_rows = max(int(args.table_gb * 2**30) // row_bytes, 2 * max_rows, 1)
            print(f"{dtype_name} d={dim}: a table of {table_rows:,} rows ({table_rows * row_bytes / 2**30:.2f} GiB) "
                  f"...", flush=True)
            t0 = time.perf_counter()
            store = HostStore(table_rows, dim, dtype, threads=1)
            print(f"  allocated and zeroed in {time.perf_counter() - t0:.1f} s", flush=True)
            try:
                for num in rows_list:
                    for threads in threads_list:
                        case = _row_case(store, dtype_name, num, threads, args.repeats, gen, not args.no_before)
                        for rec in case:
                            print(f"  {rec['op']:7s} rows={num:,} threads={threads}: {rec['wall_s'] * 1e3:.2f} ms, "
                                  f"floor {rec['floor_wall_s'] * 1e3:.2f} ms (x{rec['ratio_wall']:.2f})", flush=True)
                        results.extend(case)
            finally:
                store.close()
                del store
    for num in rows_list:
        results.append(_split_case(num, 16 * num, args.repeats, gen))

    rows = []
    for r in results:
        if r["op"] == "split":
            rows.append(["split (isin / searchsorted)", "int64", "", f"{r['rows']:,}", 1, "",
                         _ms(r["wall_s"]), _ms(r["floor_wall_s"]), _ratio(r["ratio_wall"]),
                         _ms(r["cpu_s"]), _ms(r["floor_cpu_s"]), _ratio(r["ratio_cpu"]), "", ""])
            continue
        rows.append([r["op"], r["dtype"], r["dim"], f"{r['rows']:,}", r["threads"], f"{r['bytes'] / 1e6:,.1f}",
                     _ms(r["wall_s"]), _ms(r["floor_wall_s"]), _ratio(r["ratio_wall"]),
                     _ms(r["cpu_s"]), _ms(r["floor_cpu_s"]), _ratio(r["ratio_cpu"]),
                     _ms(r.get("before_wall_s")), _ratio(r.get("before_ratio_wall"))])
    print()
    print(format_table(["op", "dtype", "dim", "rows", "threads", "MB", "wall ms", "floor ms", "x floor",
                        "cpu ms", "floor cpu ms", "x floor (cpu)", "before ms", "before x floor"], rows))
    print("floor: a contiguous copy_ of the same bytes on the same threads; for the split, searchsorted + "
          "equality (x floor: isin's time over it)")
    config = {**vars(args), "rows": rows_list, "dim": dims, "dtype": dtypes, "threads": threads_list,
              "torch_threads": torch.get_num_threads()}
    out = args.json or os.path.join("benchmarks", "results", f"hostpath-{time.strftime('%Y%m%d-%H%M%S')}.json")
    write_json(out, "hostpath", config, results,
               {"platform": platform.platform(), "cpu_count": os.cpu_count(), "torch_version": torch.__version__})
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
