"""``ds-pfc-bench head --predict {h100,h200,a100} [case options]``: a head step predicted on a
GPU model (:mod:`ds_pfc.bench.model`) from op counts taken on this machine, next to the
self-check's measurements where a calibration JSON exists (:mod:`ds_pfc.bench.calibration`)."""
from __future__ import annotations

import argparse
import os
import sys
import time

from .._args import parser
from . import calibration, write_json
from .model import (GPUS, STANDARD_CASE, _DTYPES, _count_in_subprocess, case_rows, cosines_path, default_keep_budget,
                    format_prediction, predict_case, saved_counts)

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``ds-pfc-bench head --predict {h100,h200,a100} [case options]``."""
    s = STANDARD_CASE
    p = parser("ds-pfc-bench head --predict", "Predict a head step on a GPU model from op counts taken on this "
               "machine (ds_pfc/bench/model.py).")
    p.add_argument("--predict", choices=sorted(GPUS), required=True,
                   help="the GPU model whose step is predicted")
    p.add_argument("--world", type=int, default=s["world"], help="k: GPUs the classes are sharded over")
    p.add_argument("--classes", type=int, default=s["classes"], help="C: total classes")
    p.add_argument("--sample-rate", type=float, default=s["sample_rate"],
                   help=f"r: the share of each rank's classes sampled per step, in (0, 1] (default {s['sample_rate']})")
    p.add_argument("--batch", type=int, default=s["batch"], help="N: gathered batch")
    p.add_argument("--dim", type=int, default=s["dim"], help=f"d: the embedding width (default {s['dim']})")
    p.add_argument("--compute", choices=sorted(_DTYPES), default=s["compute"],
                   help="dtype of the head's matrix products (default %(default)s)")
    p.add_argument("--embeddings-dtype", dest="embeddings", choices=sorted(_DTYPES), default=s["embeddings"],
                   help="dtype of the embeddings the head receives (default %(default)s)")
    p.add_argument("--backend", default="torch,triton", help="comma-separated softmax backends")
    p.add_argument("--block-bytes", type=int, default=None,
                   help="the head's block_bytes: bytes of float32 logits per class block of the softmax "
                        "(default: 256 MiB, as on CUDA)")
    p.add_argument("--keep-bytes", type=int, default=None,
                   help="the head's keep_bytes: the triton step keeps its bf16 exponentials (bf16 products) or "
                        "float16 cosines for backward when they fit (default: half the GPU's memory left by the rank's "
                        "bank and 16 GiB for the rest, as the head reads it from the device); 0 recomputes them")
    p.add_argument("--cosines", choices=("exp", "kept", "recompute"), default=None,
                   help="the triton step's path, instead of the one the head's rule picks for --keep-bytes at "
                        "scale 64 (exp-kept for bf16 products within the budget)")
    p.add_argument("--no-compile", action="store_true", help="skip reading the kernels' machine code")
    p.add_argument("--counts", default=None,
                   help="a --predict JSON whose op counts to reuse when it holds the same case counted for the "
                        "same SM count (else the case is counted here, which takes minutes)")
    p.add_argument("--calibration", default=calibration.DEFAULT,
                   help="a self-check JSON that calibrates the prediction (ds_pfc/bench/calibration.py), or "
                        "'none' (default: %(default)s)")
    p.add_argument("--calibration-counts", default=calibration.DEFAULT_COUNTS,
                   help="the op counts of the calibration's measured case (default: %(default)s)")
    p.add_argument("--calibration-timing", default=None,
                   help="a 'ds-pfc-selfcheck --timing' JSON of the same GPU: its topk and sort times "
                        "(default: estimates, see ds_pfc/bench/calibration.py)")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/predict-<gpu>-<date>.json)")
    return p


def main(argv=None) -> int:
    """``ds-pfc-bench head --predict {h100,h200,a100} [case options]``."""
    p = build_parser()
    args = p.parse_args(argv)
    for name in ("world", "classes", "batch", "dim"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be a positive int, got {getattr(args, name)}")
    if args.keep_bytes is not None and args.keep_bytes < 0:
        p.error(f"--keep-bytes must be a non-negative int, got {args.keep_bytes}")
    if not 0 < args.sample_rate <= 1:
        p.error(f"--sample-rate must lie in (0, 1], got {args.sample_rate}")
    for backend in args.backend.split(","):
        if backend not in ("torch", "triton"):
            p.error(f"--backend: expected torch and/or triton, got {backend!r}")
    if args.counts is not None and not os.path.exists(args.counts):
        p.error(f"--counts: no such file {args.counts!r}")
    cal = None
    if args.calibration.lower() != "none":
        try:
            cal = calibration.load_calibration(args.calibration, args.calibration_counts, args.calibration_timing)
            cal.rates(args.predict)
        except (OSError, ValueError) as err:
            print(f"no calibrated prediction: {err}\n", flush=True)
            cal = None
    results = []
    sms = GPUS[args.predict]["sms"]
    for backend in args.backend.split(","):
        case = dict(world=args.world, classes=args.classes, sample_rate=args.sample_rate, batch=args.batch,
                    dim=args.dim, compute=args.compute, embeddings=args.embeddings, backend=backend,
                    block_bytes=args.block_bytes)
        keep = args.keep_bytes if args.keep_bytes is not None else default_keep_budget(case, args.predict)
        path = cosines_path(backend, args.batch, case_rows(case), args.compute, keep)
        if path is not None and args.cosines is not None:
            path = args.cosines
        if path is not None:
            case["cosines"] = path
        counts = saved_counts(args.counts, case, sms) if args.counts else None
        if args.counts and counts is None:
            print(f"{args.counts} holds no counts of this case for {sms} SMs: counting it here", flush=True)
        counts = counts or _count_in_subprocess(case, sms, GPUS[args.predict]["arch"])
        pred = predict_case(case, args.predict, counts=counts, compile_code=not args.no_compile)
        print(format_prediction(pred) + "\n", flush=True)
        if cal is not None:
            pred["calibrated"] = calibration.calibrated_prediction(pred, cal)
            pred["measured"] = calibration.measured_groups(cal, args.predict, case)
            print(calibration.format_comparison(pred) + "\n", flush=True)
        results.append(pred)
    out = args.out or os.path.join("benchmarks", "results",
                                   f"predict-{args.predict}-{time.strftime('%Y%m%d-%H%M%S')}.json")
    write_json(out, "head-predict", vars(args), results, {"gpu_constants": GPUS[args.predict]})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":      # python -m ds_pfc.bench.predict
    sys.exit(main(sys.argv[1:]))
