"""NVMe benchmark: the NVMe store's row gathers and scatters, and raw async I/O requests,
next to fio on the same file, at the same queue depth and request sizes.

One scratch file of ``--file-gb`` in ``--dir`` serves every part (written whole first, so
that reads hit real extents):

* **raw**: ``--requests`` requests of each ``--block-kib`` size, random and sequential,
  read and written, through the store's libaio engine (one context, ``--queue-depth``
  in flight), through DeepSpeed's async_io handles (batched over several handles, and one
  op per ``wait()`` as the store used it before), and through fio (``--ioengine=libaio
  --direct=1``) with the same pattern, size and queue depth;
* **store**: ``NvmeStore`` gathers and scatters of ``r x rows`` random rows for each
  ``--rates`` r; the store records the requests it issued and fio replays them
  (``--read_iolog``, ``--replay_no_stall``) at the same queue depth: the floor for that
  I/O (a scatter's reads and writes replayed without their dependencies; the requests
  moved by half the file, same sizes, gaps and order, since the host of a VM may cache
  what the store just read: replayed in place, fio gained 10-15% on the review VM);
* **sequential**: ``read_all`` and ``write_all`` against fio's sequential 1 MiB reads and
  writes of the same bytes.

Rates are medians over ``--repeats`` runs, each run paired with a fio run right after it
(the disk of a shared VM drifts); "x fio" is the ratio of the medians. Without fio on
PATH the floor reads n/a. JSON (``--json``) has the machine, versions, config and date.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

from . import format_table, write_json
from .._args import parser

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_MIN_FIO_REQUESTS = 4000        # a replay shorter than this is repeated (fio times in ms)


# ----------------------------------------------------------------------------- fio
def fio_binary() -> str | None:
    return shutil.which("fio")


def fio_version() -> str | None:
    exe = fio_binary()
    if exe is None:
        return None
    try:
        return subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def _run_fio(args: list[str], timeout: float = 600) -> dict:
    """fio's JSON result for one job: requests, bytes and seconds (reads + writes)."""
    proc = subprocess.run([fio_binary(), *args, "--output-format=json"], capture_output=True, text=True,
                          timeout=timeout)
    text = proc.stdout
    if proc.returncode != 0 or "{" not in text:
        raise RuntimeError(f"fio failed ({proc.returncode}): {(proc.stderr or text).strip()[-400:]}")
    job = json.loads(text[text.index("{"):])["jobs"][0]
    if job.get("error"):
        raise RuntimeError(f"fio job error {job['error']}")
    ios = job["read"]["total_ios"] + job["write"]["total_ios"]
    nbytes = job["read"]["io_bytes"] + job["write"]["io_bytes"]
    seconds = max(job["read"]["runtime"], job["write"]["runtime"], 1) / 1e3
    return {"requests": ios, "bytes": nbytes, "seconds": seconds}


def fio_synthetic(path: str, rw: str, bs: int, qd: int, requests: int, offset: int, size: int) -> dict:
    """fio with ``rw`` (randread, read, randwrite, write) requests of ``bs`` bytes over
    ``[offset, offset + size)`` of ``path``."""
    return _run_fio(["--name=floor", f"--filename={path}", f"--rw={rw}", f"--bs={bs}", f"--iodepth={qd}",
                     "--direct=1", "--ioengine=libaio", f"--offset={offset}", f"--size={size}",
                     f"--io_size={requests * bs}", "--randrepeat=0", "--norandommap", "--invalidate=0"])


def fio_replay(path: str, trace: list, qd: int, workdir: str, lo: int = 0, hi: int | None = None,
               shift: int = 0) -> dict:
    """fio replaying requests recorded by ``NvmeStore.record_io``: those inside
    ``[lo, hi)`` (the data; the header left out), moved by ``shift`` bytes within it
    (wrapping; a request that would cross ``hi`` ends there), so that the host's cache
    does not hold what the store just read; repeated until at least a few thousand."""
    ops, offs, sizes = [], [], []
    for write, off, size in trace:
        keep = off >= lo
        ops.append(np.full(int(keep.sum()), 1 if write else 0))
        offs.append(off[keep])
        sizes.append(size[keep])
    if not ops or sum(len(o) for o in ops) == 0:
        return {"requests": 0, "bytes": 0, "seconds": 0.0, "times": 0}
    op, off, size = np.concatenate(ops), np.concatenate(offs), np.concatenate(sizes)
    if shift and hi is not None:
        off = lo + (off - lo + shift) % (hi - lo)
        off = np.minimum(off, hi - size)
    times = max(1, -(-_MIN_FIO_REQUESTS // len(op)))
    names = np.array(["read", "write"])[op]
    body = "".join(f"{path} {n} {o} {s}\n" for n, o, s in zip(names.tolist(), off.tolist(), size.tolist()))
    log = os.path.join(workdir, "replay.iolog")
    with open(log, "w") as f:
        f.write(f"fio version 2 iolog\n{path} add\n{path} open\n")
        for _ in range(times):
            f.write(body)
        f.write(f"{path} close\n")
    try:
        res = _run_fio(["--name=replay", f"--read_iolog={log}", "--replay_no_stall=1", f"--iodepth={qd}",
                        "--ioengine=libaio", "--direct=1", "--invalidate=0"])
    finally:
        os.unlink(log)
    return {"requests": res["requests"] / times, "bytes": res["bytes"] / times, "seconds": res["seconds"] / times,
            "times": times}


# ----------------------------------------------------------------------------- raw requests
def _offsets(pattern: str, bs: int, n: int, lo: int, hi: int, gen: torch.Generator) -> torch.Tensor:
    slots = (hi - lo) // bs
    if pattern == "random":
        return lo + torch.randint(0, slots, (n,), generator=gen, dtype=torch.int64) * bs
    start = int(torch.randint(0, slots, (), generator=gen))
    return lo + ((start + torch.arange(n, dtype=torch.int64)) % slots) * bs


def raw_engine(engine, write: bool, offsets: torch.Tensor, bs: int) -> float:
    """Seconds for one batch of requests, all queued at once, through a store engine."""
    n = offsets.numel()
    slots = min(n, 64)
    buf = engine.alloc(slots * bs)
    try:
        buf_off = (np.arange(n, dtype=np.int64) % slots) * bs
        sizes = np.full(n, bs, dtype=np.int64)
        t = time.perf_counter()
        engine.wait(engine.start(write, buf, buf_off, offsets.numpy(), sizes))
        return time.perf_counter() - t
    finally:
        engine.free(buf)


def raw_deepspeed_one_per_wait(path: str, write: bool, offsets: torch.Tensor, bs: int, qd: int) -> float:
    """Seconds for the requests through one DeepSpeed handle, one op per wait() (how
    NvmeStore used the op before: each run of blocks its own op)."""
    from ..bank.nvme import AIO_BLOCK_SIZE, load_aio_op
    handle = load_aio_op().aio_handle(AIO_BLOCK_SIZE, qd, False, True, 1)
    buf = handle.new_cpu_locked_tensor(bs, torch.empty(0, dtype=torch.uint8))
    try:
        submit = handle.async_pwrite if write else handle.async_pread
        t = time.perf_counter()
        for off in offsets.tolist():
            if submit(buf, path, off) != 0:
                raise OSError(f"deepspeed request at {off} failed to start")
            handle.wait()
        return time.perf_counter() - t
    finally:
        handle.free_cpu_locked_tensor(buf)


# ----------------------------------------------------------------------------- helpers
def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _fmt(x, spec=",.0f"):
    return "n/a" if x is None else format(x, spec)


def _ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


def _filesystem(path: str) -> dict:
    try:
        out = subprocess.run(["findmnt", "-n", "-o", "FSTYPE,SOURCE", "--target", path], capture_output=True,
                             text=True, timeout=10).stdout.split()
        return {"type": out[0], "device": out[1]} if len(out) >= 2 else {}
    except (OSError, subprocess.SubprocessError):
        return {}


def _fill(store, chunk_rows: int, gen: torch.Generator) -> float:
    """Write every row once (random values), a chunk of whole blocks at a time; seconds
    in the store (scatters and the flush)."""
    seconds = 0.0
    for lo in range(0, store.num_rows, chunk_rows):
        hi = min(store.num_rows, lo + chunk_rows)
        values = torch.randn((hi - lo,) + store.row_shape, generator=gen).to(store.dtype)
        t = time.perf_counter()
        store.scatter(torch.arange(lo, hi), values)
        seconds += time.perf_counter() - t
    t = time.perf_counter()
    store.flush()
    return seconds + time.perf_counter() - t


# ----------------------------------------------------------------------------- parts
def bench_raw(args, path: str, lo: int, hi: int, use_fio: bool, gen) -> list[dict]:
    from ..bank.nvme import _DeepSpeedEngine, _LibaioEngine
    out = []
    engines = [e for e in args.raw_engines.split(",") if e]
    for bs in [int(float(k) * 1024) for k in args.block_kib.split(",")]:
        for pattern in args.patterns.split(","):
            for rw in args.rw.split(","):
                write = rw == "write"
                fio_rw = {("random", False): "randread", ("random", True): "randwrite",
                          ("sequential", False): "read", ("sequential", True): "write"}[(pattern, write)]
                samples = {e: [] for e in engines}
                fio_samples = []
                for _ in range(args.repeats):
                    for e in engines:
                        n = args.requests if e != "deepspeed-1" else max(1, args.requests // 4)
                        offsets = _offsets(pattern, bs, n, lo, hi, gen)
                        try:
                            if e == "libaio":
                                engine = _LibaioEngine(path, args.queue_depth, bs)
                            elif e == "deepspeed":
                                engine = _DeepSpeedEngine(path, args.queue_depth, bs, 1)
                            else:
                                engine = None
                            try:
                                secs = raw_engine(engine, write, offsets, bs) if engine is not None else \
                                    raw_deepspeed_one_per_wait(path, write, offsets, bs, args.queue_depth)
                            finally:
                                if engine is not None:
                                    engine.close()
                            samples[e].append(n / secs)
                        except Exception as exc:  # noqa: BLE001 - an engine that cannot run here is reported
                            samples[e].append(None)
                            print(f"  {e}: {type(exc).__name__}: {exc}", file=sys.stderr)
                    if use_fio:
                        f = fio_synthetic(path, fio_rw, bs, args.queue_depth, args.requests, lo, hi - lo)
                        fio_samples.append(f["requests"] / f["seconds"])
                fio_rate = _median(fio_samples)
                for e in engines:
                    rate = _median(samples[e])
                    out.append({"part": "raw", "engine": e, "block_bytes": bs, "pattern": pattern, "rw": rw,
                                "queue_depth": args.queue_depth if e != "deepspeed-1" else 1,
                                "requests_per_s": rate, "mb_per_s": None if rate is None else rate * bs / 1e6,
                                "samples": samples[e], "fio_requests_per_s": fio_rate,
                                "fio_mb_per_s": None if fio_rate is None else fio_rate * bs / 1e6,
                                "fio_samples": fio_samples, "ratio_to_fio": _ratio(rate, fio_rate)})
                    print(f"  raw {e:>11} {bs >> 10:>4} KiB {pattern:>10} {rw:>5}: {_fmt(rate)} req/s "
                          f"(fio {_fmt(fio_rate)}; x{_fmt(_ratio(rate, fio_rate), '.2f')})", flush=True)
    return out


def bench_store(args, store, workdir: str, use_fio: bool, gen) -> list[dict]:
    out = []
    n_rows = store.num_rows
    rb = store.row_bytes()
    for rate in [float(r) for r in args.rates.split(",")]:
        k = max(1, int(round(rate * n_rows)))
        res = {op: {"t": [], "req": [], "bytes": [], "fio_t": [], "fio_req": [], "fio_bytes": []}
               for op in ("gather", "scatter")}
        for _ in range(args.repeats):
            rows = torch.randperm(n_rows, generator=gen)[:k].sort().values
            for op in ("gather", "scatter"):
                trace = store.record_io(True)
                before = store.io_stats()
                t = time.perf_counter()
                if op == "gather":
                    values = store.gather(rows)
                else:
                    store.scatter(rows, values)
                secs = time.perf_counter() - t
                after = store.io_stats()
                store.record_io(False)
                req = sum(after[f"{x}_requests"] - before[f"{x}_requests"] for x in ("read", "write"))
                nbytes = sum(after[f"{x}_bytes"] - before[f"{x}_bytes"] for x in ("read", "write"))
                r = res[op]
                r["t"].append(secs)
                r["req"].append(req)
                r["bytes"].append(nbytes)
                if use_fio:
                    data = store.file_bytes() - store._data_offset
                    f = fio_replay(store.path, trace, args.queue_depth, workdir, lo=store._data_offset,
                                   hi=store.file_bytes(), shift=data // 2 // store._align * store._align)
                    r["fio_t"].append(f["seconds"])
                    r["fio_req"].append(f["requests"])
                    r["fio_bytes"].append(f["bytes"])
        step = [g + s for g, s in zip(res["gather"]["t"], res["scatter"]["t"])]
        for op in ("gather", "scatter"):
            r = res[op]
            t, req, nbytes = _median(r["t"]), _median(r["req"]), _median(r["bytes"])
            ft = _median(r["fio_t"])
            fio_req_s = _median([a / b for a, b in zip(r["fio_req"], r["fio_t"]) if b]) if ft else None
            fio_mb_s = _median([a / b / 1e6 for a, b in zip(r["fio_bytes"], r["fio_t"]) if b]) if ft else None
            row = {"part": "store", "op": op, "rate": rate, "rows": k, "row_bytes": rb, "seconds": t,
                   "seconds_samples": r["t"], "requests": req, "disk_bytes": nbytes,
                   "requests_per_s": req / t if t else None, "mb_per_s": nbytes / t / 1e6 if t else None,
                   "row_mb_per_s": k * rb / t / 1e6 if t else None,
                   "fio_seconds": ft, "fio_requests_per_s": fio_req_s, "fio_mb_per_s": fio_mb_s,
                   "ratio_to_fio": _ratio(ft, t), "step_seconds": _median(step)}
            out.append(row)
            print(f"  store {op:>7} r={rate:g} ({k:,} rows): {t * 1e3:,.1f} ms, {_fmt(row['requests_per_s'])} req/s, "
                  f"{_fmt(row['mb_per_s'], ',.1f')} MB/s (fio replay {_fmt(None if ft is None else ft * 1e3, ',.1f')} "
                  f"ms; x{_fmt(row['ratio_to_fio'], '.2f')})", flush=True)
        print(f"  store step (gather + scatter) r={rate:g}: {_median(step) * 1e3:,.1f} ms", flush=True)
    return out


def bench_sequential(args, store, use_fio: bool) -> list[dict]:
    out = []
    data = store.file_bytes() - store._data_offset
    times = {"read_all": [], "write_all": []}
    fio = {"read_all": [], "write_all": []}
    values = None
    for _ in range(args.repeats):
        t = time.perf_counter()
        values = store.read_all()
        times["read_all"].append(time.perf_counter() - t)
        if use_fio:
            f = fio_synthetic(store.path, "read", 1 << 20, args.queue_depth, -(-data // (1 << 20)),
                              store._data_offset, data)
            fio["read_all"].append(f["bytes"] / f["seconds"])
        t = time.perf_counter()
        store.write_all(values)
        times["write_all"].append(time.perf_counter() - t)
        if use_fio:
            f = fio_synthetic(store.path, "write", 1 << 20, args.queue_depth, -(-data // (1 << 20)),
                              store._data_offset, data)
            fio["write_all"].append(f["bytes"] / f["seconds"])
    del values
    for op in ("read_all", "write_all"):
        t = _median(times[op])
        rate, fio_rate = data / t, _median(fio[op])
        out.append({"part": "sequential", "op": op, "bytes": data, "seconds": t, "seconds_samples": times[op],
                    "mb_per_s": rate / 1e6, "fio_mb_per_s": None if fio_rate is None else fio_rate / 1e6,
                    "ratio_to_fio": _ratio(rate, fio_rate)})
        fio_mb = None if fio_rate is None else fio_rate / 1e6
        print(f"  {op}: {rate / 1e6:,.0f} MB/s (fio 1 MiB sequential {_fmt(fio_mb)} MB/s; "
              f"x{_fmt(_ratio(rate, fio_rate), '.2f')})", flush=True)
    return out


# ----------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    p = parser("ds-pfc-bench nvme", " ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--dir", default=None, help="directory on the file system to measure (default: a temp dir)")
    p.add_argument("--file-gb", type=float, default=2.0, help="size of the scratch file (GB)")
    p.add_argument("--block-kib", default="4,128", help="raw request sizes, KiB")
    p.add_argument("--requests", type=int, default=20000, help="raw requests per measurement")
    p.add_argument("--queue-depth", type=int, default=32,
                   help="I/O requests in flight, for the store, the raw engines and fio alike (default 32)")
    p.add_argument("--patterns", default="random,sequential",
                   help="raw request patterns: random and/or sequential (comma-separated list)")
    p.add_argument("--rw", default="read,write",
                   help="raw request directions: read and/or write (comma-separated list)")
    p.add_argument("--raw-engines", default="libaio,deepspeed,deepspeed-1",
                   help="libaio (the store's engine), deepspeed (batched over the store's DeepSpeed handles), "
                        "deepspeed-1 (one DeepSpeed op per wait, as the store did before)")
    p.add_argument("--rates", default="0.001,0.01,0.1", help="fractions of the rows gathered and scattered")
    p.add_argument("--dim", type=int, default=512, help="row width")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16", help="the store's row dtype (default bf16)")
    p.add_argument("--store-block-kib", type=float, default=None, help="the store's block size (default ~128 KiB)")
    p.add_argument("--engine", default="libaio", choices=["libaio", "deepspeed"], help="the store's io_engine")
    p.add_argument("--gap-kib", type=float, default=None, help="the store's coalesce_gap_bytes, KiB")
    p.add_argument("--parts", default="raw,store,sequential",
                   help="which parts to run: raw, store and/or sequential (comma-separated list)")
    p.add_argument("--repeats", type=int, default=3,
                   help="runs per figure, each paired with a fio run; medians are reported (default 3)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: as the bank's I/O worker)")
    p.add_argument("--no-fio", action="store_true", help="do not run fio")
    p.add_argument("--seed", type=int, default=0, help="seed of the random rows and offsets (default 0)")
    p.add_argument("--json", default=None, help="write results here (default benchmarks/results/nvme-<date>.json)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from ..bank.nvme import NvmeStore
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(args.seed)
    use_fio = not args.no_fio and fio_binary() is not None
    if not use_fio:
        print("fio " + ("not run (--no-fio)" if args.no_fio else "not found on PATH") + ": the floor is n/a",
              flush=True)
    parts = set(args.parts.split(","))
    workdir = tempfile.mkdtemp(prefix="ds_pfc_nvme_", dir=args.dir)
    results = []
    try:
        dtype = _DTYPES[args.dtype]
        esize = torch.empty((), dtype=dtype).element_size()
        rb = max(args.dim, 1) * esize
        n_rows = max(1, int(args.file_gb * 1e9) // rb)
        opts = {"io_engine": args.engine, "queue_depth": args.queue_depth}
        if args.store_block_kib:
            opts["block_rows"] = max(1, int(args.store_block_kib * 1024) // rb)
        if args.gap_kib is not None:
            opts["coalesce_gap_bytes"] = int(args.gap_kib * 1024)
        path = os.path.join(workdir, "bench.bank")
        print(f"scratch file {path}: {n_rows:,} rows of {rb} bytes ({args.dim} x {args.dtype}), queue depth "
              f"{args.queue_depth}, torch threads {args.threads}", flush=True)
        store = NvmeStore(path, n_rows, args.dim, dtype, create=True, **opts)
        try:
            fill_s = _fill(store, max(1, (64 << 20) // rb), gen)
            data_bytes = store.file_bytes() - store._data_offset
            print(f"  filled {data_bytes / 1e9:.2f} GB in {fill_s:.1f} s ({data_bytes / fill_s / 1e6:,.0f} MB/s, "
                  f"scatter of whole blocks)", flush=True)
            results.append({"part": "fill", "bytes": data_bytes, "seconds": fill_s})
            if "raw" in parts:
                results += bench_raw(args, path, store._data_offset, store.file_bytes(), use_fio, gen)
            if "store" in parts:
                results += bench_store(args, store, workdir, use_fio, gen)
            if "sequential" in parts:
                results += bench_sequential(args, store, use_fio)
            layout = {"block_rows": store.block_rows, "block_bytes": store._block_bytes, **store.io_stats()}
        finally:
            store.close()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    raw = [r for r in results if r["part"] == "raw"]
    if raw:
        print()
        print(format_table(["engine", "size", "pattern", "rw", "QD", "req/s", "MB/s", "fio req/s", "fio MB/s", "x fio"],
                           [[r["engine"], f"{r['block_bytes'] >> 10} KiB", r["pattern"], r["rw"], r["queue_depth"],
                             _fmt(r["requests_per_s"]), _fmt(r["mb_per_s"], ",.1f"), _fmt(r["fio_requests_per_s"]),
                             _fmt(r["fio_mb_per_s"], ",.1f"), _fmt(r["ratio_to_fio"], ".2f")] for r in raw]))
    store_rows = [r for r in results if r["part"] == "store"]
    if store_rows:
        print()
        print(format_table(["op", "r", "rows", "ms", "requests", "req/s", "MB/s (disk)", "MB/s (rows)",
                            "fio req/s", "fio MB/s", "x fio", "step ms"],
                           [[r["op"], f"{r['rate']:g}", f"{r['rows']:,}", f"{r['seconds'] * 1e3:,.1f}",
                             f"{r['requests']:,.0f}", _fmt(r["requests_per_s"]), _fmt(r["mb_per_s"], ",.1f"),
                             _fmt(r["row_mb_per_s"], ",.1f"), _fmt(r["fio_requests_per_s"]),
                             _fmt(r["fio_mb_per_s"], ",.1f"), _fmt(r["ratio_to_fio"], ".2f"),
                             f"{r['step_seconds'] * 1e3:,.1f}"] for r in store_rows]))
    seq = [r for r in results if r["part"] == "sequential"]
    if seq:
        print()
        print(format_table(["op", "GB", "MB/s", "fio MB/s", "x fio"],
                           [[r["op"], f"{r['bytes'] / 1e9:.2f}", _fmt(r["mb_per_s"]), _fmt(r["fio_mb_per_s"]),
                             _fmt(r["ratio_to_fio"], ".2f")] for r in seq]))
    out = args.json or os.path.join("benchmarks", "results", f"nvme-{time.strftime('%Y%m%d-%H%M%S')}.json")
    extra = {"fio": fio_version() if use_fio else None, "kernel": platform.release(),
             "filesystem": _filesystem(args.dir or tempfile.gettempdir()), "store": layout,
             "target": "requests/s >= 0.8 x fio at the same queue depth and request sizes"}
    write_json(out, "nvme", vars(args), results, extra)
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
