"""Benchmarks: ``python launch/bench.py {head,bank,accuracy,data} [options]`` (``--help`` per benchmark)."""
import sys

BENCHMARKS = {"head": "ds_pfc.bench.head", "bank": "ds_pfc.bench.bank", "accuracy": "ds_pfc.bench.accuracy",
              "data": "ds_pfc.bench.data"}


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1] not in BENCHMARKS:
        print(f"usage: python launch/bench.py {{{','.join(BENCHMARKS)}}} [options]", file=sys.stderr)
        return 2
    module = __import__(BENCHMARKS[sys.argv[1]], fromlist=["main"])
    return module.main(sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
