"""Reproduce the paper's sample-rate and robustness studies on synthetic faces (CPU).

    python launch/experiments.py sample_rate                      # every cell, 3 seeds
    ds-pfc-experiments sample_rate --out results/paper           # the installed command
    python launch/experiments.py label_flip --cell "flip40/PFC-0.1" --seeds 1
    python launch/experiments.py conflict --jobs 2                # two runs at a time
    python launch/experiments.py long_tail --report               # tables and plots only
    python launch/experiments.py label_flip --config my_job.json --target lfw \
        --launcher "deepspeed --num_gpus 8" --out results/my_data   # the cells on your own job
    python launch/experiments.py sweep --seeds 3                  # C x r on identity features
    python launch/experiments.py sweep --classes 1000 --rate 0.1 --seeds 1 --name sweep_pilot
    python launch/experiments.py label_flip --setting features --classes 100000   # a study at 100k classes

Studies: sample_rate, label_flip, conflict, long_tail (see ds_pfc/app/experiments.py for
the cells and the setup). Results go to benchmarks/results/paper/<study>.json (plus
.md and .png); runs already recorded there are skipped unless --force, so a study
can be finished over several sittings. Each run trains in its own process with
--threads intra-op threads (1 by default: results are then reproducible on the same
machine type). --config runs the same cells on a job of your own (its data, model and
evaluation; --target names the evaluation set that scores a run).

sweep: classes C in {1000, 10000, 100000} x sample rate r in {1, 0.3, 0.1, 0.03, 0.01}
at a fixed batch and step count on the identity-feature setting
(ds_pfc.app.experiments.features_config); each run records its held-out TARs at every
evaluation, the active negatives per step and the share of classes absent from a
batch, into <out>/<name>.json (default sweep.json). --setting features --classes C runs
one of the four studies on that setting (results in <out>/features_c<C>/).
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
from concurrent.futures import ThreadPoolExecutor

from . import checkout_root
from .._args import parser

# The recorded studies of a source checkout; an installed package writes below the
# working directory.
DEFAULT_OUT = os.path.join(checkout_root() or os.curdir, "benchmarks", "results", "paper")


def build_parser() -> argparse.ArgumentParser:
    from ds_pfc.app.experiments import STUDIES

    p = parser("ds-pfc-experiments", " ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("study", choices=sorted(STUDIES) + ["sweep"], help="which study (sweep: classes x sample rate)")
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
    p.add_argument("--setting", choices=["faces", "features"], default=None,
                   help="faces: the 1000-class synthetic faces (default for the four studies); features: identity "
                        "feature vectors at --classes classes (the sweep's setting)")
    p.add_argument("--classes", type=int, action="append", default=None,
                   help="features setting: the class count (one; default 100000 for a study); sweep: only these "
                        "class counts (repeatable)")
    p.add_argument("--rate", type=float, action="append", default=None,
                   help="sweep: only these sample rates (repeatable)")
    p.add_argument("--name", default=None, help="sweep: results file name in --out (default sweep)")
    p.add_argument("--note", default=None, help="sweep: a line stored in the results and shown in the table")
    return p


def _sweep_cells(p, args) -> list:
    from ds_pfc.app.experiments import SWEEP_CLASSES, SWEEP_RATES, sweep_cells
    for key in ("config", "target", "launcher"):
        if getattr(args, key):
            p.error(f"--{key} does not apply to the sweep (it runs the built-in features setting)")
    if args.setting == "faces":
        p.error("the sweep runs on the features setting (--setting features or none)")
    if args.quick and args.name is None:
        p.error("--quick sweep runs need their own --name (the recorded sweep holds full runs)")
    for c in args.classes or ():
        if c not in SWEEP_CLASSES:
            p.error(f"--classes {c} is not a class count of the sweep {list(SWEEP_CLASSES)}")
    for r in args.rate or ():
        if r not in SWEEP_RATES:
            p.error(f"--rate {r} is not a sample rate of the sweep {list(SWEEP_RATES)}")
    cells = sweep_cells(args.classes or SWEEP_CLASSES, args.rate or SWEEP_RATES)
    if args.cell:
        names = [c.name for c in sweep_cells()]
        unknown = [c for c in args.cell if c not in names]
        if unknown:
            p.error(f"the sweep has no cell(s) {unknown}; its cells are {names}")
        cells = [c for c in cells if c.name in args.cell]
    return cells


def _run_all(runs, one, jobs: int) -> int:
    failed = 0
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for fut in [pool.submit(one, run) for run in runs]:
            try:
                fut.result()
            except (RuntimeError, ValueError) as err:
                failed += 1
                print(f"error: {err}", file=sys.stderr, flush=True)
    if failed:
        print(f"{failed} run(s) failed", file=sys.stderr)
    return failed


def _sweep(p, args) -> int:
    from ds_pfc.app.experiments import SWEEP, run_sweep_cell, write_sweep_report
    cells = _sweep_cells(p, args)
    name = args.name or SWEEP
    failed = 0
    if not args.report:
        runs = [(cell, seed) for seed in range(args.seeds) for cell in cells]
        print(f"sweep: {len(runs)} run(s) ({len(cells)} cell(s) x {args.seeds} seed(s)), {args.jobs} at a time, "
              f"results in {os.path.join(args.out, name + '.json')}", flush=True)

        def one(run):
            cell, seed = run
            rec = run_sweep_cell(cell, seed, out_dir=args.out, name=name, threads=args.threads, quick=args.quick,
                                 force=args.force, note=args.note, log=lambda line: print(line, flush=True))
            if rec is None:
                print(f"sweep/{cell.name} seed {seed}: recorded already (--force re-runs it)", flush=True)

        failed = _run_all(runs, one, args.jobs)
    md, png = write_sweep_report(args.out, name)
    print(f"report {md}" + (f", {png}" if png else " (no matplotlib: no plot)"))
    return 1 if failed else 0


def main(argv=None) -> int:
    from ds_pfc.app.experiments import STUDIES, run_cell, write_report

    p = build_parser()
    args = p.parse_args(argv)
    if args.seeds < 1 or args.jobs < 1 or args.threads < 1:
        p.error("--seeds, --jobs and --threads must be >= 1")
    if args.study == "sweep":
        return _sweep(p, args)
    for key in ("rate", "name", "note"):
        if getattr(args, key) is not None:
            p.error(f"--{key} applies to the sweep")
    if args.setting == "features":
        if args.config is not None:
            p.error("--setting features is a built-in setup; it does not combine with --config")
        if args.classes is not None and (len(args.classes) != 1 or args.classes[0] < 2):
            p.error("--setting features takes one --classes count >= 2")
    elif args.classes is not None:
        p.error("--classes applies to --setting features (the faces setting has 1000 classes)")
    if args.config is None and (args.target or args.launcher):
        p.error("--target and --launcher apply to --config runs")
    if args.config is not None and args.quick:
        p.error("--quick is the built-in tiny setup; it does not combine with --config")
    if args.config is not None and os.path.abspath(args.out) == os.path.abspath(DEFAULT_OUT):
        p.error(f"--config runs need their own --out directory ({DEFAULT_OUT} holds the synthetic-faces studies)")
    base = None
    if args.setting == "features":
        from ds_pfc.app.experiments import features_config
        classes = args.classes[0] if args.classes else 100_000
        base = features_config(classes, quick=args.quick)
        if os.path.abspath(args.out) == os.path.abspath(DEFAULT_OUT):
            args.out = os.path.join(DEFAULT_OUT, f"features_c{classes}")
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

        failed = _run_all(runs, one, args.jobs)
    md, png = write_report(args.study, args.out)
    print(f"report {md}" + (f", {png}" if png else " (no matplotlib: no plot)"))
    return 1 if not args.report and failed else 0


if __name__ == "__main__":     # python -m ds_pfc.cli.experiments
    sys.exit(main())
