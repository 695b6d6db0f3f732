"""Held-out accuracy over seeds: ``python launch/bench.py accuracy [options]``.

One float32 training run is chaotic: rounding differences of one ulp in the first
steps (another summation order in a GEMM or a log-sum-exp) grow into a different
trajectory within tens of steps, and the held-out accuracy of one seed moves by
several points. A change in accuracy is therefore judged on a mean over seeds that
vary the data order, the head and the backbone together (``data.seed``,
``head.seed``, ``train.seed``), never on a single run.

Each run is the training app (``launch/train.py``) in a subprocess (one thread by default).
``--root`` runs another checkout's app and library (its ``launch/train.py`` with
its directory first on ``PYTHONPATH``), so two versions of the engine are measured
by the same harness on the same configs.

Configs (``--config``):

- ``quickstart``: ``configs/cpu_quickstart.json`` as it is (112 x 112 images, 300
  steps; a few minutes per run on one core).
- ``fast``: the quickstart's job (400 identities x 20 images, r = 0.2, CosFace,
  lr 0.1, 2.4 epochs of batch 64, 200 held-out identities) at 56 x 56 pixels and
  without checkpoints: the same job on smaller images, about 1.5 minutes per run on
  an idle core.
- ``guard``: a smaller job for the regression test (``tests/test_accuracy_guard.py``):
  200 identities x 10 images at 32 x 32, r = 0.2, 2.4 epochs of batch 32 (148
  steps), 400 pairs of 100 held-out identities; about 20 s per run on an idle core.
"""
from __future__ import annotations

import argparse
import copy
import datetime as _dt
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

from . import machine_info, versions
from .._args import parser

__all__ = ["CONFIGS", "STORAGES", "HEAD_PATHS", "job_config", "with_storage", "with_head_path", "seeded", "run_seed", "run_seeds", "mean_std", "guard_check", "guard_verdict",
           "load_guard_record", "build_parser", "main"]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = ("quickstart", "fast", "guard")


def _quickstart(root: str = ROOT) -> dict:
    with open(os.path.join(root, "configs", "cpu_quickstart.json")) as f:
        return json.load(f)


def job_config(name: str, root: str = ROOT) -> dict:
    """The job JSON of config ``name`` (one of :data:`CONFIGS`)."""
    if name not in CONFIGS:
        raise ValueError(f"config must be one of {CONFIGS}, got {name!r}")
    config = _quickstart(root)
    if name == "quickstart":
        return config
    pfc = config["ds_pfc"]
    pfc["checkpoint"] = {"every_steps": 0, "keep": 1, "resume": False, "export": False}
    pfc["train"]["log_every"] = 1000
    pfc["evaluation"]["every_steps"] = 0
    if name == "fast":
        size = 56
    else:
        size = 32
        config["train_micro_batch_size_per_gpu"] = 32
        pfc["head"]["num_classes"] = 200
        pfc["data"]["synthetic"].update(images_per_identity=10, held_out_identities=100)
        pfc["evaluation"]["synthetic_pairs"] = 400
    pfc["data"]["synthetic"]["image_size"] = size
    pfc["backbone"]["options"] = {"image_size": size}
    return config


def seeded(config: dict, seed: int) -> dict:
    """``config`` with the data order, head and backbone seeds all set to ``seed``
    (the identities' looks, ``data.synthetic.seed``, stay fixed)."""
    config = copy.deepcopy(config)
    pfc = config["ds_pfc"]
    pfc["head"]["seed"] = seed
    pfc.setdefault("data", {})["seed"] = seed
    pfc.setdefault("train", {})["seed"] = seed
    return config


def _subprocess(argv: list, env: dict, cwd: str, root: str) -> tuple[int, str, str]:
    proc = subprocess.run([sys.executable, os.path.join(root, "launch", "train.py"), *argv], env=env, cwd=cwd,
                          capture_output=True, text=True)
    return proc.returncode, proc.stdout, proc.stderr


def run_seed(config: dict, seed: int, *, root: str = ROOT, threads: int = 1, env: dict | None = None,
             launch=None) -> dict:
    """Train ``config`` with ``seed`` using the app and library under ``root`` (``env``: extra
    environment of the run); returns ``{"seed", "accuracy", "accuracy_std", "final_loss",
    "steps", "wall_seconds"}``. ``launch(argv, env, cwd) -> (exit code, stdout, stderr)``
    runs the train command with ``argv`` in a process of its own; by default a fresh
    interpreter runs ``root``'s ``launch/train.py`` (a ``launch`` of one's own decides
    which code runs: ``root`` then only sets ``PYTHONPATH``)."""
    job = seeded(config, seed)
    with tempfile.TemporaryDirectory(prefix="ds_pfc-accuracy-") as tmp:
        cfg_path = os.path.join(tmp, "job.json")
        with open(cfg_path, "w") as f:
            json.dump(job, f)
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
                   PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env or {}))
        for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(key, None)
        argv = ["--deepspeed_config", cfg_path, "--output_dir", os.path.join(tmp, "run")]
        start = time.perf_counter()
        if launch is None:
            code, stdout, stderr = _subprocess(argv, env, tmp, root)
        else:
            code, stdout, stderr = launch(argv, env, tmp)
        wall = time.perf_counter() - start
        if code != 0:
            tail = (stdout[-2000:] + stderr[-3000:]).strip()
            raise RuntimeError(f"seed {seed} under {root} failed (exit {code}):\n{tail}")
        with open(os.path.join(tmp, "run", "summary.json")) as f:
            summary = json.load(f)
    final = summary["evaluations"][str(summary["steps"])]
    if len(final) != 1:
        raise RuntimeError(f"expected one evaluation set, got {sorted(final)}")
    (result,) = final.values()
    return {"seed": seed, "accuracy": result["accuracy"], "accuracy_std": result["accuracy_std"],
            "final_loss": summary["final_loss"], "steps": summary["steps"], "wall_seconds": round(wall, 1)}


def run_seeds(config: dict, seeds, *, root: str = ROOT, threads: int = 1, jobs: int = 1, log=None,
              env: dict | None = None, launch=None) -> list[dict]:
    """:func:`run_seed` for each seed, ``jobs`` runs at a time (each with ``threads``
    threads; a run's result does not depend on ``jobs``). Sorted by seed."""
    def one(seed):
        rec = run_seed(config, seed, root=root, threads=threads, env=env, launch=launch)
        if log is not None:
            log(f"seed {seed}: accuracy {rec['accuracy']:.4f}, final loss {rec['final_loss']:.3f}, "
                f"{rec['wall_seconds']:.0f} s")
        return rec
    if jobs <= 1:
        return [one(s) for s in seeds]
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(jobs) as pool:
        return sorted(pool.map(one, seeds), key=lambda r: r["seed"])


def mean_std(values) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value)."""
    values = list(values)
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


#: Bank storage of the head's state (``--storage``): the config as it is (float32), or the
#: compact device bank: bf16 weight and moments, or bf16 weight with 8-bit first moments (a
#: float32 scale per row); the staged rows are float32 in every case.
STORAGES = ("fp32", "bf16", "bf16-int8m")


def with_storage(config: dict, storage: str) -> dict:
    """``config`` with its head's bank stored as ``storage`` (:data:`STORAGES`)."""
    if storage not in STORAGES:
        raise ValueError(f"storage must be one of {STORAGES}, got {storage!r}")
    config = copy.deepcopy(config)
    if storage == "fp32":
        return config
    head = config["ds_pfc"]["head"]
    bank = {"default": ["device", "bf16"]}
    if storage == "bf16-int8m":
        moment = "exp_avg" if head.get("optimizer", {}).get("type", "sgd") == "adamw" else "momentum_buffer"
        bank["placements"] = {moment: ["device", "int8_rowwise"]}
    head["bank"] = bank
    return config


#: How the head's softmax runs (``--head-path``): the config as it is (the torch backend and
#: float32 products on a CPU), or the GPU's default path: the Triton kernels with bf16 products
#: and what the forward keeps for backward (with bf16 products and the guard's scale: the bf16
#: exponentials of the exp-kept path), run by Triton's interpreter on the CPU
#: (``TRITON_INTERPRET=1``; about 2 minutes per guard run instead of 20 s).
HEAD_PATHS = ("default", "triton-kept")


def with_head_path(config: dict, path: str) -> tuple[dict, dict]:
    """``(config, env)``: ``config`` with its head's softmax run as ``path`` (:data:`HEAD_PATHS`)
    and the environment the runs need."""
    if path not in HEAD_PATHS:
        raise ValueError(f"head_path must be one of {HEAD_PATHS}, got {path!r}")
    config = copy.deepcopy(config)
    if path == "default":
        return config, {}
    head = config["ds_pfc"]["head"]
    head.update(backend="triton", compute_dtype="bf16", keep_bytes=None)
    return config, {"TRITON_INTERPRET": "1"}


GUARD_RECORD = os.path.join(ROOT, "benchmarks", "results", "accuracy_guard.json")
GUARD_ENGINE = "main"
GUARD_SEEDS = tuple(range(6))
GUARD_Z = 3.0


def load_guard_record(record: str = GUARD_RECORD, engine: str = GUARD_ENGINE) -> tuple[dict, list[dict]]:
    """``(guard job config, recorded runs of engine)`` from ``record``, checked."""
    with open(record) as f:
        data = json.load(f)
    if data.get("config_name") != "guard":
        raise ValueError(f"{record} records config {data.get('config_name')!r}, not 'guard'")
    if data.get("config") != job_config("guard", ROOT):
        raise ValueError(f"{record} was recorded with another guard config; record it anew "
                         "(python launch/bench.py accuracy --config guard --seeds 0-9 --label main --out ...)")
    runs = data["engines"][engine]["runs"]
    if len(runs) < 2:
        raise ValueError(f"{record}: engine {engine!r} has {len(runs)} run(s); the guard needs a spread")
    return data, runs


def guard_verdict(runs: list[dict], recorded: list[dict], z: float = GUARD_Z) -> dict:
    """Compare ``runs`` (K seeds) with ``recorded`` (n seeds) of the guard config.

    Two checks, each against ``z`` standard errors of a difference of two means,
    ``z * sigma * sqrt(1/K + 1/n)`` with ``sigma`` the recorded seed-to-seed spread:

    - held-out accuracy: fails if the mean falls more than that below the record's
      (one-sided: a gain passes);
    - final training loss: fails if the mean moves more than that either way. The
      loss is the objective itself: a changed margin, momentum or loss scale moves it
      even where the accuracy of a short run does not drop, while rounding alone only
      redraws it from the same spread.

    With z = 3 an unchanged engine fails about once in 250 runs."""
    out = {"passed": True, "checks": {}}
    for key, sided in (("accuracy", "drop"), ("final_loss", "both")):
        mu, sigma = mean_std(r[key] for r in recorded)
        mean, std = mean_std(r[key] for r in runs)
        tolerance = z * sigma * math.sqrt(1.0 / len(runs) + 1.0 / len(recorded))
        ok = mean >= mu - tolerance if sided == "drop" else abs(mean - mu) <= tolerance
        out["checks"][key] = {"mean": mean, "std": std, "recorded_mean": mu, "recorded_std": sigma,
                              "tolerance": tolerance, "passed": ok, "fails_on": sided}
        out["passed"] &= ok
    out["seeds"], out["recorded_seeds"] = len(runs), len(recorded)
    return out


def guard_check(*, record: str = GUARD_RECORD, engine: str = GUARD_ENGINE, seeds=GUARD_SEEDS,
                root: str = ROOT, jobs: int = 2, z: float = GUARD_Z, storage: str = "fp32", head_path: str = "default",
                log=None, launch=None) -> dict:
    """Train the ``guard`` config for ``seeds`` with the engine under ``root`` and judge
    the runs against the ``engine`` entry of ``record`` (:func:`guard_verdict`).
    ``storage``: the head's bank storage of these runs (:data:`STORAGES`); ``head_path``:
    how its softmax runs (:data:`HEAD_PATHS`); ``launch``: as for :func:`run_seed`. The record
    is float32 with the torch backend, so a compact storage or the GPU path is judged by what
    it costs against it."""
    data, recorded = load_guard_record(record, engine)
    config, env = with_head_path(with_storage(data["config"], storage), head_path)
    runs = run_seeds(config, list(seeds), root=root, threads=data.get("threads", 1), jobs=jobs, log=log, env=env,
                     launch=launch)
    return dict(guard_verdict(runs, recorded, z), runs=runs, storage=storage, head_path=head_path)


def format_verdict(res: dict) -> str:
    lines = [f"guard {'passed' if res['passed'] else 'FAILED'} ({res['seeds']} seeds against {res['recorded_seeds']} "
             "recorded)"]
    for key, c in res["checks"].items():
        bound = (f">= {c['recorded_mean'] - c['tolerance']:.4f}" if c["fails_on"] == "drop" else
                 f"within {c['recorded_mean']:.4f} +- {c['tolerance']:.4f}")
        lines.append(f"  {key}: {c['mean']:.4f} +- {c['std']:.4f} (recorded {c['recorded_mean']:.4f} +- "
                     f"{c['recorded_std']:.4f}); needs {bound}: {'ok' if c['passed'] else 'FAIL'}")
    return "\n".join(lines)


def _git_commit(root: str) -> str | None:
    try:
        return subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def build_parser() -> argparse.ArgumentParser:
    p = parser("ds-pfc-bench accuracy", "Held-out accuracy of the training app as a mean over seeds (one float32 "
               "run is chaotic, so a change in accuracy is judged on a mean over seeds, never on one run).")
    p.add_argument("--config", choices=CONFIGS, default="fast",
                   help="the job: quickstart (configs/cpu_quickstart.json as it is), fast (the quickstart's job at "
                        "56 x 56 pixels) or guard (the regression test's smaller job) (default fast)")
    p.add_argument("--seeds", default="0-9", help="seeds: a range 'A-B' (inclusive) or a list 'a,b,c'")
    p.add_argument("--root", default=ROOT, help="checkout whose app and library run (default: this one)")
    p.add_argument("--label", default=None, help="name of this engine in the results file (default: its commit)")
    p.add_argument("--note", default=None, help="a remark recorded with this engine's runs")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads of each training run (default 1)")
    p.add_argument("--storage", choices=STORAGES, default="fp32",
                   help="the head's bank storage: fp32 (the config as it is), bf16 (weight and moments), "
                        "bf16-int8m (bf16 weight, 8-bit first moment); recorded with the engine's runs")
    p.add_argument("--head-path", "--head_path", dest="head_path", choices=HEAD_PATHS, default="default",
                   help="how the head's softmax runs: default (the config as it is) or triton-kept (the GPU's "
                        "default path, bf16 products and the exp-kept backward, in Triton's interpreter; slow)")
    p.add_argument("--out", default=None, help="JSON results file; runs are added under --label")
    p.add_argument("--guard", action="store_true",
                   help=f"instead: the regression guard (seeds {GUARD_SEEDS[0]}-{GUARD_SEEDS[-1]} of the guard config, "
                        f"2 at a time, against the '{GUARD_ENGINE}' entry of benchmarks/results/accuracy_guard.json); "
                        "exit status 1 when it fails")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.guard:
        res = guard_check(root=os.path.abspath(args.root), storage=args.storage, head_path=args.head_path,
                          log=lambda s: print(s, flush=True))
        print(format_verdict(res), flush=True)
        if args.out:
            from . import write_json
            write_json(args.out, "accuracy-guard", vars(args), [res])
            print(f"wrote {args.out}", flush=True)
        return 0 if res["passed"] else 1
    if "-" in args.seeds:
        lo, hi = (int(v) for v in args.seeds.split("-"))
        seeds = list(range(lo, hi + 1))
    else:
        seeds = [int(v) for v in args.seeds.split(",")]
    root = os.path.abspath(args.root)
    commit = _git_commit(root)
    label = args.label or (commit[:7] if commit else root)
    config = job_config(args.config, ROOT)
    data = {}
    if args.out and os.path.exists(args.out):
        with open(args.out) as f:
            data = json.load(f)
        if data.get("config_name") != args.config or data.get("config") != config:
            raise SystemExit(f"{args.out} holds runs of another config; use another --out")
    print(f"{args.config}: {len(seeds)} seed(s) with the engine at {root} ({label}), {args.storage} bank storage, "
          f"{args.threads} thread(s)", flush=True)
    job, env = with_head_path(with_storage(config, args.storage), args.head_path)
    runs = run_seeds(job, seeds, root=root, threads=args.threads, log=lambda s: print(s, flush=True), env=env)
    mean, std = mean_std(r["accuracy"] for r in runs)
    print(f"{label}: held-out accuracy {mean:.4f} +- {std:.4f} over {len(runs)} seeds", flush=True)
    if args.out:
        engines = data.setdefault("engines", {})
        entry = engines.setdefault(label, {"commit": commit, "runs": []})
        if entry.get("storage", "fp32") != args.storage and entry["runs"]:
            raise SystemExit(f"{args.out}: engine {label!r} holds runs with storage {entry.get('storage', 'fp32')!r}; "
                             "use another --label")
        if entry.get("head_path", "default") != args.head_path and entry["runs"]:
            raise SystemExit(f"{args.out}: engine {label!r} holds runs with head path "
                             f"{entry.get('head_path', 'default')!r}; use another --label")
        entry["storage"] = args.storage
        if args.head_path != "default":
            entry["head_path"] = args.head_path
        done = {r["seed"] for r in runs}
        entry["runs"] = sorted([r for r in entry["runs"] if r["seed"] not in done] + runs, key=lambda r: r["seed"])
        entry["mean"], entry["std"] = mean_std(r["accuracy"] for r in entry["runs"])
        if args.note:
            entry["note"] = args.note
        entry["date"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
        data.update(config_name=args.config, config=config, threads=args.threads,
                    machine={**machine_info(), **versions()})
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1)
            f.write("\n")
        os.replace(tmp, args.out)
        print(f"wrote {args.out}", flush=True)
    return 0
