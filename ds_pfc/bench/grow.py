"""Growing a trained head with new identities: imprinted vs random new rows.

    python -m ds_pfc.bench.grow [--seeds 0,1,2] [--out benchmarks/results/grow-cpu.json]
    ds-pfc-bench grow ...

On the identity-feature data (``data.source: features``, :class:`ds_pfc.data.IdentityFeatures`)
and the ``mlp`` backbone, which a CPU trains in seconds:

1. a base model trains on ``N_OLD`` identities (one run);
2. it grows to ``N_OLD + N_NEW`` identities (``ds_pfc.train.init``: the base export's
   backbone, the base head's shards and a class map keeping every old id), once with
   ``new_rows: imprint`` and once with ``new_rows: random``, for each seed (the seed
   sets the new runs' data order, fresh rows and sampler; the base model is shared);
3. every grown run is scored every ``EVAL_EVERY`` steps, from step 0, by 1:1
   verification on pairs of held-out images (image numbers never trained on) of the
   ``N_NEW`` new identities: TAR at FAR 1e-2 (2000 pairs, 1000 of them impostor
   pairs). The first step each reaches ``THRESHOLDS`` is the headline; the curves,
   the training loss of the first steps and the TAR on never-seen identities (the
   app's own held-out set) are recorded too.

Every run is the training app (``python -m ds_pfc.cli.train``) in its own process. The
new identities' pairs reach it as an insightface verification ``.bin``
(``ds_pfc.evaluation.bins``): each feature vector written as an 8-bit PNG of its
``[3, 1, feature_dim / 3]`` pixel-unit layout, so the app decodes and scores it as any
pair set. The rounding to 8 bits moves a value by at most ``1 / 255`` of its range,
far below the data's own per-image noise; training reads the exact float vectors.
Needs Pillow (to write the PNGs).
"""
from __future__ import annotations

import argparse
import copy
import io
import json
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from . import format_table, write_json
from .._args import parser

__all__ = ["N_OLD", "N_NEW", "THRESHOLDS", "base_config", "grown_config", "write_pairs_bin", "steps_to",
           "run_study", "build_parser", "main"]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
N_OLD, N_NEW = 100, 100
IMAGES = 8
BASE_STEPS, GROWN_STEPS, EVAL_EVERY = 300, 100, 5
PAIRS = 2000
FAR = "0.01"
THRESHOLDS = (0.85, 0.90)
"""TARs at FAR 1e-2 on the new identities' pairs whose first step is reported (set
from a 2-seed pilot: the base model starts at 0.84 and training levels off near 0.93)."""
QUICK = {"n_old": 24, "n_new": 6, "base_steps": 6, "grown_steps": 4, "eval_every": 2, "pairs": 200}
FEATURES = {"feature_dim": 96, "latent_dim": 32, "nuisance": 1.5, "noise": 0.5, "seed": 0}


def base_config(*, n_old: int = N_OLD, steps: int = BASE_STEPS, pairs: int = PAIRS) -> dict:
    """The base model's job: ``n_old`` identities x ``IMAGES`` images, a 2 x 256 MLP to
    64-d embeddings, CosFace (s 32, m 0.3) over every class, SGD lr 0.1 (poly decay),
    batch 128; the export and the final checkpoint (its head shards) are kept."""
    return {
        "train_micro_batch_size_per_gpu": 128,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 5.0,
        "steps_per_print": 10 ** 9,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9, "weight_decay": 5e-4}},
        "zero_optimization": {"stage": 0},
        "ds_pfc": {
            "description": "grow study: the base model (ds_pfc.bench.grow)",
            "head": {"num_classes": n_old, "embedding_size": 64, "sample_rate": 1.0,
                     "margin": {"type": "cosface", "scale": 32.0, "margin": 0.3},
                     "optimizer": {"type": "sgd", "momentum": 0.9, "weight_decay": 5e-4}},
            "backbone": {"name": "mlp", "options": {"input_dim": FEATURES["feature_dim"], "hidden": 256,
                                                    "depth": 2}},
            "data": {"source": "features",
                     "features": dict(FEATURES, identities=n_old, images_per_identity=IMAGES,
                                      held_out_identities=200),
                     "flip": False, "workers": 0},
            "train": {"epochs": 1e6, "max_steps": steps, "log_every": 50,
                      "schedule": {"type": "poly", "warmup_epochs": 0.0, "power": 2.0}},
            "evaluation": {"synthetic_pairs": pairs, "batch_size": 1024, "flip": False, "far": [1e-2]},
            "checkpoint": {"every_steps": 0, "keep": 1, "resume": False, "export": True},
        },
    }


def grown_config(base: dict, new_rows: str, seed: int, *, export: str, head: str, class_map: str, bins: str,
                 n_new: int = N_NEW, steps: int = GROWN_STEPS, eval_every: int = EVAL_EVERY) -> dict:
    """The grown job: ``base``'s data with ``n_new`` more identities, started from the
    base model (``export``, ``head``, ``class_map``) with ``new_rows``; SGD lr 0.05
    (poly decay) for ``steps`` steps, scored on ``bins`` and the never-seen identities
    every ``eval_every`` steps from step 0."""
    config = copy.deepcopy(base)
    pfc = config["ds_pfc"]
    classes = pfc["head"]["num_classes"] + n_new
    pfc["description"] = f"grow study: {new_rows} new rows, seed {seed} (ds_pfc.bench.grow)"
    pfc["head"].update(num_classes=classes, seed=seed)
    pfc["data"]["features"]["identities"] = classes
    pfc["data"]["seed"] = seed
    config["optimizer"]["params"]["lr"] = 0.05
    pfc["train"].update(max_steps=steps, seed=seed, log_every=10 ** 6,
                        init={"backbone": export, "head": head, "class_map": class_map, "new_rows": new_rows})
    pfc["evaluation"].update(every_steps=eval_every, at_start=True, bins=[bins])
    pfc["checkpoint"].update(export=False)
    return config


def write_pairs_bin(path: str, *, first_identity: int, identities: int, pairs: int, images_per_identity: int,
                    seed: int = 0) -> str:
    """An insightface verification ``.bin`` of ``pairs`` pairs among identities
    ``[first_identity, first_identity + identities)`` of the feature data (held-out
    images of those identities: image numbers ``>= images_per_identity``), each vector
    an 8-bit PNG of its pixel-unit layout (module docstring)."""
    from ..data.features import IdentityFeatures
    try:
        from PIL import Image
    except ImportError:
        raise RuntimeError("the grow study writes its pair set as PNG images: install Pillow") from None
    data = IdentityFeatures(identities, images_per_identity, first_identity=first_identity, **FEATURES)
    images, issame = data.pairs(pairs, seed=seed)
    pixels = images.round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).contiguous().numpy()
    encoded = []
    for p in pixels:
        buf = io.BytesIO()
        Image.fromarray(p, mode="RGB").save(buf, format="PNG")
        encoded.append(buf.getvalue())
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "wb") as f:
        pickle.dump((encoded, list(issame)), f)
    return path


def _launch(argv: list, env: dict, cwd: str) -> tuple[int, str, str]:
    """The train command with ``argv`` in a fresh interpreter: ``(exit code, stdout, stderr)``."""
    proc = subprocess.run([sys.executable, "-m", "ds_pfc.cli.train", *argv], env=env, cwd=cwd, capture_output=True,
                          text=True)
    return proc.returncode, proc.stdout, proc.stderr


def _train(config: dict, out: str, *, threads: int) -> tuple[dict, str]:
    """One run of the training app in its own process (:func:`_launch`); ``(summary, stdout)``."""
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "job.json")
    with open(path, "w") as f:
        json.dump(config, f)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    argv = ["--deepspeed_config", path, "--output_dir", os.path.join(out, "run")]
    code, stdout, stderr = _launch(argv, env, out)
    if code != 0:
        raise RuntimeError(f"ds-pfc-train {' '.join(argv)} failed (exit {code}):\n"
                           f"{(stdout[-2000:] + stderr[-3000:]).strip()}")
    with open(os.path.join(out, "run", "summary.json")) as f:
        return json.load(f), stdout


def _curve(summary: dict, name: str) -> dict[int, float]:
    """``step -> TAR at FAR`` of set ``name`` (NaN where the set has too few impostor
    pairs for the FAR: the quick version's)."""
    out = {}
    for step, sets in summary["evaluations"].items():
        if name in sets:
            tar = sets[name]["tar_at_far"][FAR]
            out[int(step)] = float("nan") if tar is None else float(tar)
    return out


def steps_to(curve: dict[int, float], threshold: float) -> int | None:
    """The first evaluated step whose TAR is >= ``threshold`` (None: never)."""
    return next((step for step in sorted(curve) if curve[step] >= threshold), None)


def run_study(seeds, *, work: str, threads: int = 1, quick: bool = False, log=print) -> dict:
    """The base run, then ``imprint`` and ``random`` for every seed; the records."""
    q = QUICK if quick else {"n_old": N_OLD, "n_new": N_NEW, "base_steps": BASE_STEPS,
                             "grown_steps": GROWN_STEPS, "eval_every": EVAL_EVERY, "pairs": PAIRS}
    started = time.perf_counter()
    base = base_config(n_old=q["n_old"], steps=q["base_steps"], pairs=q["pairs"])
    summary, _ = _train(base, os.path.join(work, "base"), threads=threads)
    base_tar = _curve(summary, "synthetic_held_out")[summary["steps"]]
    log(f"base: {q['n_old']} identities, {summary['steps']} steps, TAR@FAR={FAR} on never-seen identities "
        f"{base_tar:.4f} ({time.perf_counter() - started:.0f} s)")
    class_map = os.path.join(work, "class_map.txt")
    with open(class_map, "w") as f:
        f.write("".join(f"{c} {c}\n" for c in range(q["n_old"])))
    bins = write_pairs_bin(os.path.join(work, "new_identities.bin"), first_identity=q["n_old"],
                           identities=q["n_new"], pairs=q["pairs"], images_per_identity=IMAGES)
    name = os.path.splitext(os.path.basename(bins))[0]
    runs = []
    for seed in seeds:
        for new_rows in ("imprint", "random"):
            t0 = time.perf_counter()
            config = grown_config(base, new_rows, seed, export=summary["export"], head=summary["checkpoint"],
                                  class_map=class_map, bins=bins, n_new=q["n_new"], steps=q["grown_steps"],
                                  eval_every=q["eval_every"])
            grown, stdout = _train(config, os.path.join(work, f"{new_rows}-{seed}"), threads=threads)
            line = next((x for x in stdout.splitlines() if "init: head grown" in x), "")
            curve = _curve(grown, name)
            runs.append({"new_rows": new_rows, "seed": seed, "tar_new": curve,
                         "tar_unseen": _curve(grown, "synthetic_held_out"), "losses": grown["losses"],
                         "init_line": line.split("init: ", 1)[-1], "wall_seconds": round(time.perf_counter() - t0, 1)})
            log(f"{new_rows} seed {seed}: TAR@FAR={FAR} on the new identities "
                + " ".join(f"{s}:{curve[s]:.3f}" for s in sorted(curve)) + f" ({runs[-1]['wall_seconds']:.0f} s)")
    return {"base": {"steps": summary["steps"], "tar_unseen": base_tar}, "runs": runs, "settings": q,
            "wall_seconds": round(time.perf_counter() - started, 1)}


def summarize(study: dict, thresholds=THRESHOLDS) -> tuple[list[dict], str]:
    """Per method: the mean curve over seeds; for each threshold, the first step each
    seed reaches it and their mean (over the seeds that do; how many do); the mean
    training loss at steps 1, 5, 10 and 20; and the tables."""
    rows, table = [], []
    shortest = min(len(r["losses"]) for r in study["runs"])
    loss_steps = [s for s in (1, 5, 10, 20) if s <= shortest]
    for method in ("imprint", "random"):
        runs = [r for r in study["runs"] if r["new_rows"] == method]
        if not runs:
            continue
        steps = sorted(runs[0]["tar_new"])
        mean = {s: statistics.fmean(r["tar_new"][s] for r in runs) for s in steps}
        reached = {}
        for threshold in thresholds:
            per_seed = [steps_to(r["tar_new"], threshold) for r in runs]
            hit = [s for s in per_seed if s is not None]
            reached[str(threshold)] = {"per_seed": per_seed, "reached": len(hit),
                                       "mean_steps": statistics.fmean(hit) if hit else None}
        unseen_end = statistics.fmean(r["tar_unseen"][steps[-1]] for r in runs)
        row = {"new_rows": method, "seeds": len(runs), "mean_tar_new": mean, "steps_to": reached,
               "mean_loss_at": {s: statistics.fmean(r["losses"][s - 1] for r in runs) for s in loss_steps},
               "mean_tar_unseen_end": unseen_end}
        rows.append(row)
        table.append([method, len(runs), f"{mean[steps[0]]:.3f}", f"{mean[steps[-1]]:.3f}",
                      *(f"{v['mean_steps']:.1f} ({v['reached']}/{len(runs)})" if v["reached"] else
                        f"never (0/{len(runs)})" for v in reached.values()),
                      *(f"{row['mean_loss_at'][s]:.2f}" for s in loss_steps), f"{unseen_end:.3f}"])
    text = format_table(["new rows", "seeds", f"TAR@{FAR} new, step 0", f"at step {steps[-1]}",
                         *(f"steps to {t:g}" for t in thresholds), *(f"loss step {s}" for s in loss_steps),
                         "TAR never-seen, end"], table)
    curve_rows = [[s] + [f"{r['mean_tar_new'][s]:.3f}" for r in rows] for s in sorted(rows[0]["mean_tar_new"])]
    text += "\n\nmean TAR@FAR=" + FAR + " on the new identities by step\n" + format_table(
        ["step"] + [r["new_rows"] for r in rows], curve_rows)
    return rows, text


def build_parser() -> argparse.ArgumentParser:
    p = parser("ds-pfc-bench grow", "Grow a trained head with new identities: imprinted vs random new rows, "
               "steps to a TAR on the new identities' held-out pairs (identity features, a CPU, minutes).")
    p.add_argument("--seeds", default="0,1,2", help="seeds of the grown runs: a list 'a,b,c' (default 0,1,2)")
    p.add_argument("--thresholds", default=",".join(f"{t:g}" for t in THRESHOLDS),
                   help=f"TARs at FAR {FAR} on the new identities whose first step is reported "
                        f"(default {','.join(f'{t:g}' for t in THRESHOLDS)})")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads of each run (default 1)")
    p.add_argument("--quick", action="store_true", help="a tiny version that only checks the study runs (seconds)")
    p.add_argument("--work", default=None, help="keep the runs in this directory (default: a temporary one)")
    p.add_argument("--out", default=None, help="write the results as JSON here (with machine, versions, date)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    thresholds = [float(t) for t in args.thresholds.split(",") if t.strip()]
    if not seeds or not thresholds:
        raise SystemExit("--seeds and --thresholds: give at least one value each")

    def go(work):
        return run_study(seeds, work=work, threads=args.threads, quick=args.quick,
                         log=lambda line: print(line, flush=True))
    if args.work:
        os.makedirs(args.work, exist_ok=True)
        study = go(args.work)
    else:
        with tempfile.TemporaryDirectory(prefix="ds_pfc-grow-") as tmp:
            study = go(tmp)
    rows, text = summarize(study, thresholds)
    print(text, flush=True)
    if args.out:
        config = {"seeds": seeds, "thresholds": thresholds, "far": float(FAR), "threads": args.threads,
                  "quick": args.quick, **study["settings"]}
        write_json(args.out, "grow", config, rows, extra={"base": study["base"], "runs": study["runs"],
                                                          "wall_seconds": study["wall_seconds"]})
        print(f"wrote {args.out}", flush=True)
    return 0


if __name__ == "__main__":     # python -m ds_pfc.bench.grow
    sys.exit(main())
