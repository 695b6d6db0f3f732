"""Centre top-k on CPU: the torch blocks against faiss's exact flat inner-product index.

The all-pairs search of ``ds-pfc-clean`` (every class centre against every other,
the own id masked) at ``--classes`` centres of width ``--dim``: ``--queries`` of them
search all centres (the full all-pairs time is that times ``classes / queries``, both
backends being linear in the queries). Every case is timed ``--repeats`` times (median
and spread reported) at each thread count; both backends must return the same
neighbours (indices compared where the float32 scores are not tied within 1e-5).

    PYTHONPATH=. python benchmarks/neighbors_faiss.py --out benchmarks/results/neighbors-faiss-cpu-2core.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from ds_pfc.bench import machine_info, versions  # noqa: E402
from ds_pfc.core.neighbors import NEIGHBOR_BLOCK_ROWS, nearest  # noqa: E402


def _time(fn, repeats: int) -> tuple[list[float], object]:
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return times, out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--classes", type=int, nargs="+", default=[50_000, 200_000])
    p.add_argument("--queries", type=int, default=4096)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    import faiss

    rows = []
    for classes in args.classes:
        gen = torch.Generator().manual_seed(classes)
        centres = torch.randn(classes, args.dim, generator=gen)
        queries, ids = centres[:args.queries], torch.arange(args.queries)
        for threads in args.threads:
            torch.set_num_threads(threads)
            results = {}
            for impl in ("torch", "faiss"):
                fn = lambda: nearest(queries, centres, args.k, query_ids=ids, impl=impl)  # noqa: E731
                fn()                                                                       # warm-up
                times, results[impl] = _time(fn, args.repeats)
                median = statistics.median(times)
                rows.append({"classes": classes, "queries": args.queries, "dim": args.dim, "k": args.k,
                             "threads": threads, "impl": impl, "median_s": median,
                             "min_s": min(times), "max_s": max(times),
                             "all_pairs_s": median * classes / args.queries,
                             "gflops": 2 * args.queries * classes * args.dim / median / 1e9})
                print(json.dumps(rows[-1]), flush=True)
            (tv, ti), (fv, fi) = results["torch"], results["faiss"]
            # an index may differ only between scores float32 cannot order
            differ = (ti != fi) & ((tv - fv).abs() > 1e-5)
            assert not differ.any(), f"backends disagree at {classes} classes"
            rows[-1]["max_value_diff"] = float((tv - fv).abs().max())
    out = {"benchmark": "neighbors-faiss", "date": datetime.date.today().isoformat(),
           "machine": machine_info(), "versions": {**versions(), "faiss": faiss.__version__},
           "config": {**vars(args), "block_rows": NEIGHBOR_BLOCK_ROWS, "data": "standard normal centres, "
                      "queries = the first centres, own id masked"},
           "rows": rows}
    speed = {(r["classes"], r["threads"]): {} for r in rows}
    for r in rows:
        speed[(r["classes"], r["threads"])][r["impl"]] = r["median_s"]
    out["faiss_speedup"] = [{"classes": c, "threads": t, "torch_over_faiss": v["torch"] / v["faiss"]}
                            for (c, t), v in speed.items()]
    print(json.dumps(out["faiss_speedup"]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
