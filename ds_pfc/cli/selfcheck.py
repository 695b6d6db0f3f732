"""``ds-pfc-selfcheck`` / ``python -m ds_pfc.selfcheck``: the GPU self-check of
:mod:`ds_pfc.bench.selfcheck` (what it runs is described there)."""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import sys
import time

from .._args import parser

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    p = parser("ds-pfc-selfcheck", "The GPU self-check: exactness, launch and sync budgets, kernels and speed "
               "(without a GPU, the CPU subset with the Triton kernels in Triton's interpreter).")
    p.add_argument("--quick", action="store_true", help="skip the model check and the benchmarks")
    p.add_argument("--no-benchmarks", action="store_true",
                   help="skip the head and bank benchmarks (the model check still runs)")
    p.add_argument("--counts", default=None, metavar="JSON",
                   help="op counts for the model check from 'ds-pfc-bench head --predict' of the same case "
                        "(saves the minutes of counting on this machine's CPU)")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/<gpu>-<date>.json)")
    p.add_argument("--timing", action="store_true",
                   help="only the timing work, under 6 minutes on a GPU: step times at d = 512/256/128 with "
                        "validate on and off, kept and recomputed cosines, and as a CUDA graph, kernel times, "
                        "cuBLAS at the kept step's shapes, the forward kernel at N = 2048 and 4096, topk and the "
                        "sampler, the model check; one JSON, benchmarks/results/timing-<gpu>-<date>.json")
    p.add_argument("--no-model", action="store_true", help="with --timing: skip the model check")
    p.add_argument("--dry", action="store_true", help="with --timing: print what would be measured and stop")
    return p


def main(argv=None) -> int:
    """``ds-pfc-selfcheck`` / ``python -m ds_pfc.selfcheck``: exit status 1 when a check fails."""
    import torch

    from ..bench import format_table, machine_info, versions
    from ..bench.selfcheck import ROOT, _plot, run_checks

    args = build_parser().parse_args(argv)

    cuda = torch.cuda.is_available()
    if not cuda:
        # The kernels then run in Triton's interpreter, chosen when triton is imported.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    gpu = torch.cuda.get_device_name(device) if cuda else None
    if args.timing or args.dry or args.no_model:
        return _timing(args, device, gpu, stamp)
    if cuda:
        print(f"ds_pfc self-check on {gpu} ({torch.cuda.device_count()} GPU(s)), torch {torch.__version__}, "
              f"CUDA {torch.version.cuda}")
    else:
        print("No CUDA device here: running the CPU subset (the Triton kernels in Triton's interpreter). "
              "On a GPU machine this command also runs the checks marked 'needs a CUDA device' below.")
    out = args.out or os.path.join(ROOT, "benchmarks", "results",
                                   f"{(gpu or 'cpu').replace(' ', '_')}-{stamp}.json")
    rows = run_checks(device, quick=args.quick, results_dir=os.path.dirname(os.path.abspath(out)), stamp=stamp,
                      counts_from=args.counts, benchmarks=not args.no_benchmarks)

    print()
    print(format_table(["check", "status", "detail"], [[r["check"], r["status"], r["detail"][:90]] for r in rows]))
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    doc = {"selfcheck": rows, "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
           "machine": machine_info(), "versions": versions(), "cuda": cuda}
    with open(out, "w") as f:
        json.dump(doc, f, indent=2)
    png = _plot(rows, os.path.splitext(out)[0] + ".png")
    failed = [r["check"] for r in rows if r["status"] == "FAIL"]
    print(f"\nwrote {out}" + (f" and {png}" if png else " (install matplotlib for a PNG)"))
    print(f"{sum(r['status'] == 'pass' for r in rows)} passed, {len(failed)} failed, "
          f"{sum(r['status'] == 'skipped' for r in rows)} skipped")
    return 1 if failed else 0


def _timing(args, device, gpu, stamp) -> int:
    from ..bench.selfcheck import ROOT
    from ..bench.timing import plan, run_timing
    if not args.timing:
        raise SystemExit("--dry and --no-model go with --timing")
    what = plan(device)
    print(f"timing on {device}: case {what['case']}, backend {what['backend']}")
    for m in what["modes"]:
        print(f"  step d={m['dim']} validate={m['validate']} graph={m['graph']}"
              + (f" cosines={m['cosines']}" if m.get("cosines") else ""))
    print(f"  cuBLAS at the kept step's shapes (fp16 cosines, dX, dW) at d = {', '.join(map(str, what['products']))}")
    if what["forward_batches"]:
        print(f"  the forward kernel at N = {', '.join(map(str, what['forward_batches']))}, with and without its store")
    print("  topk, sort and the sampler at the case's C_q" + ("" if args.no_model else "; the model check"))
    print(f"  within {what['budget_s']:.0f} s: parts not started by then are skipped")
    if args.dry:
        return 0
    results = os.path.dirname(os.path.abspath(args.out)) if args.out else os.path.join(ROOT, "benchmarks", "results")
    path = run_timing(device, results_dir=results, stamp=stamp, gpu=(gpu or "cpu").replace(" ", "_"),
                      model=not args.no_model)
    if args.out and os.path.abspath(args.out) != os.path.abspath(path):
        os.replace(path, args.out)
        path = args.out
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
