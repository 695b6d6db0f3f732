"""Reproduce the paper's sample-rate and robustness studies on synthetic faces (CPU).

    python launch/experiments.py sample_rate                      # every cell, 3 seeds
    ds-pfc-experiments sample_rate --out results/paper           # the installed command
    python launch/experiments.py label_flip --cell "flip40/PFC-0.1" --seeds 1
    python launch/experiments.py conflict --jobs 2                # two runs at a time
    python launch/experiments.py long_tail --report               # tables and plots only
    python launch/experiments.py label_flip --config my_job.json --target lfw \
        --launcher "deepspeed --num_gpus 8" --out results/my_data   # the cells on your own job

Studies: sample_rate, label_flip, conflict, long_tail (see ds_pfc/app/experiments.py for
the cells and the setup). Results go to benchmarks/results/paper/<study>.json (plus
.md and .png); runs already recorded there are skipped unless --force, so a study
can be finished over several sittings. Each run trains in its own process with
--threads intra-op threads (1 by default: results are then reproducible on the same
machine type). --config runs the same cells on a job of your own (its data, model and
evaluation; --target names the evaluation set that scores a run).
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
from concurrent.futures import ThreadPoolExecutor

from . import checkout_root

# The recorded studies of a source checkout; an installed package writes below the
# working directory.
DEFAULT_OUT = os.path.join(checkout_root() or os.curdir, "benchmarks", "results", "paper")


def build_parser() -> argparse.ArgumentParser:
    from ds_pfc.app.experiments import STUDIES

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("study", choices=sorted(STUDIES), help="which study")
    p.add_argument("--seeds", type=int, default=3, help="seeds 0..K-1 per cell (default 3)")
    p.add_argument("--cell", action="append", default=None,
                   help="run only this cell (repeatable; quote names with * or /)")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"results directory (default {DEFAULT_OUT})")
    p.add_argument("--force", action="store_true", help="re-run runs that are already recorded")
    p.add_argument("--jobs", type=int, default=1, help="runs at a time (each uses --threads threads)")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per run")
    p.add_argument("--quick", action="store_true", help="a tiny setup that runs in seconds (for tests)")
    p.add_argument("--report", action="store_true", help="only write the .md and .png from the recorded runs")
    p.add_argument("--config", default=None,
                   help="a job config of your own to run the cells on (default: the synthetic-faces setup)")
    p.add_argument("--target", default=None,
                   help="with --config: the evaluation set that scores a run (default: the only one)")
    p.add_argument("--launcher", default="",
                   help='with --config: a command prefix for each run, e.g. "deepspeed --num_gpus 8"')
    return p


def main(argv=None) -> int:
    from ds_pfc.app.experiments import STUDIES, run_cell, write_report

    p = build_parser()
    args = p.parse_args(argv)
    if args.seeds < 1 or args.jobs < 1 or args.threads < 1:
        p.error("--seeds, --jobs and --threads must be >= 1")
    if args.config is None and (args.target or args.launcher):
        p.error("--target and --launcher apply to --config runs")
    if args.config is not None and args.quick:
        p.error("--quick is the built-in tiny setup; it does not combine with --config")
    if args.config is not None and os.path.abspath(args.out) == os.path.abspath(DEFAULT_OUT):
        p.error(f"--config runs need their own --out directory ({DEFAULT_OUT} holds the synthetic-faces studies)")
    base = None
    if args.config is not None:
        from ds_pfc.app.experiments import scoring_set
        from ds_pfc.app.training import load_config
        try:
            base = load_config(args.config)
            scoring_set(base, args.target)
        except (OSError, ValueError) as err:
            p.error(f"--config {args.config}: {err}")
    names = [c.name for c in STUDIES[args.study]]
    cells = args.cell or names
    unknown = [c for c in cells if c not in names]
    if unknown:
        p.error(f"study {args.study} has no cell(s) {unknown}; its cells are {names}")

    if not args.report:
        runs = [(cell, seed) for seed in range(args.seeds) for cell in cells]
        print(f"{args.study}: {len(runs)} run(s) ({len(cells)} cell(s) x {args.seeds} seed(s)), "
              f"{args.jobs} at a time, results in {args.out}", flush=True)

        def one(run):
            cell, seed = run
            rec = run_cell(args.study, cell, seed, out_dir=args.out, threads=args.threads, quick=args.quick,
                           force=args.force, base=base, target=args.target, launcher=shlex.split(args.launcher),
                           log=lambda line: print(line, flush=True))
            if rec is None:
                print(f"{args.study}/{cell} seed {seed}: recorded already (--force re-runs it)", flush=True)
            return rec

        failed = 0
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            for run, fut in [(run, pool.submit(one, run)) for run in runs]:
                try:
                    fut.result()
                except (RuntimeError, ValueError) as err:
                    failed += 1
                    print(f"error: {err}", file=sys.stderr, flush=True)
        if failed:
            print(f"{failed} run(s) failed", file=sys.stderr)
    md, png = write_report(args.study, args.out)
    print(f"report {md}" + (f", {png}" if png else " (no matplotlib: no plot)"))
    return 1 if not args.report and failed else 0


if __name__ == "__main__":     # python -m ds_pfc.cli.experiments
    sys.exit(main())
