"""Benchmarks: ``ds-pfc-bench {head,bank,accuracy,data,plan,rows,hostpath,grow,clean-predict} [options]``
(``python launch/bench.py``
from a checkout; ``--help`` after the benchmark's name lists its options)."""
from __future__ import annotations

import argparse
import importlib
import sys

from .._args import parser

BENCHMARKS = {"head": "ds_pfc.bench.head", "bank": "ds_pfc.bench.bank", "accuracy": "ds_pfc.bench.accuracy",
              "data": "ds_pfc.bench.data", "plan": "ds_pfc.bench.plan", "rows": "ds_pfc.bench.rows",
              "hostpath": "ds_pfc.bench.hostpath", "grow": "ds_pfc.bench.grow",
              "clean-predict": "ds_pfc.bench.clean_predict"}


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's name, then its own options (checked by the benchmark's parser)."""
    p = parser("ds-pfc-bench", "Run one benchmark of ds_pfc: its name, then its own options "
               "('ds-pfc-bench NAME --help' lists them).")
    p.add_argument("benchmark", choices=list(BENCHMARKS), help="which benchmark to run")
    p.add_argument("options", nargs=argparse.REMAINDER,
                   help="the benchmark's own options, passed on to it unchanged")
    return p


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in BENCHMARKS:
        build_parser().parse_args(argv)     # --help, or a usage error naming the benchmarks (exits)
    module = importlib.import_module(BENCHMARKS[argv[0]])
    return module.main(argv[1:])


if __name__ == "__main__":     # python -m ds_pfc.cli.bench
    sys.exit(main())
