"""The paper's sample-rate and robustness studies, at a scale a CPU runs in hours.

Four studies (``STUDIES``), each a list of cells; a cell is one training setting (a
sample rate, the PFC* filter or not, a stress transform of the training data) and is
run for several seeds. Every run is the training app (``python -m ds_pfc.cli.train``) on the
built-in synthetic faces, in its own process with a fixed number of threads, and is
scored by 1:1 verification on held-out identities (identities never trained on,
untouched by any stress transform):

- ``sample_rate``: r in {1.0, 0.4, 0.2, 0.1, 0.05} on clean data (the paper's
  WebFace4M rows of Table webface_sampling_rates).
- ``label_flip``: 0%, 20% and 40% of the training labels replaced by another class, for
  r = 1.0, 0.3 and 0.1, and PFC*-0.1 at 20% and 40% (Table webface_robustness).
- ``conflict``: a third of the identities split into three pseudo-classes, for
  FC-1.0, PFC-0.2, PFC-0.1, FC*-1.0 and PFC*-0.1.
- ``long_tail``: 90% of the identities reduced to 2-4 images, for r = 1.0, 0.2, 0.1.

A seed changes the backbone's and the centers' initialisation, the data order and
the stress transform's draw; the identities themselves (the synthetic data's seed)
are the same for every run, as the paper's data set is.

The same cells run on a job of your own (``run_cell(base=..., target=...,
launcher=...)``, ``launch/experiments.py --config``): its data source, model and
evaluation set, scored on the evaluation set named by ``target``.

The same cells run on the many-class identity-feature setting
(:func:`features_config`, ``setting_config("features", classes)``): feature vectors
per image (``ds_pfc.data.IdentityFeatures``) and a small MLP, the same head, sampler,
stress transforms and held-out verification, at a fixed batch and step count for every
class count. On it, the ``sweep`` (:func:`sweep_cells`, :func:`run_sweep_cell`)
crosses classes C in ``SWEEP_CLASSES`` with sample rates r in ``SWEEP_RATES``, so
that the number of active negatives per step varies both ways; each run records its
held-out TARs at every evaluation (the curve over training) and, replayed from its
data order, the mean active negatives per step and the share of classes absent from
a batch (:func:`batch_statistics`; every study's run records them too).

Results accumulate in ``<out>/<study>.json``: a run already recorded is skipped
unless ``force``, so a long study can be finished over several sittings, and
:func:`write_report` renders ``<study>.md`` (the table beside the paper's numbers)
and ``<study>.png`` (mean +- std per cell).
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Sequence

import torch

__all__ = ["Cell", "STUDIES", "base_config", "cell_config", "run_cell", "scoring_set", "load_results",
           "write_report", "PAPER", "QUICK", "SETTINGS", "features_config", "setting_config", "batch_statistics",
           "SweepCell", "SWEEP_CLASSES", "SWEEP_RATES", "sweep_cells", "sweep_config", "run_sweep_cell",
           "write_sweep_report", "curve_peak", "mechanism_means", "MECHANISM_KEYS"]

FILTER_TAU = 0.4
"""The paper's conflict-filter threshold (Table webface_robustness)."""


@dataclasses.dataclass(frozen=True)
class Cell:
    """One setting of a study."""

    name: str
    sample_rate: float
    filter: bool = False
    """PFC*: drop negatives whose cosine exceeds ``FILTER_TAU`` from the denominator."""
    stress: dict = dataclasses.field(default_factory=dict)
    """``ds_pfc.data.stress`` block (without the seed, which follows the run's seed)."""
    images_per_identity: int | None = None
    """Overrides the base images per identity (the long tail starts from more)."""

    def setting(self) -> dict:
        out = {"sample_rate": self.sample_rate, "filter_threshold": FILTER_TAU if self.filter else None,
               "stress": self.stress}
        if self.images_per_identity is not None:
            out["images_per_identity"] = self.images_per_identity
        return out


def _method(r: float, filt: bool) -> str:
    return ("FC" if r == 1.0 else "PFC") + ("*" if filt else "") + f"-{r:g}"


_CONFLICT = {"conflict": {"fraction": 1 / 3, "splits": 3}}
_LONG_TAIL = {"long_tail": {"tail_fraction": 0.9, "tail_images": [2, 4]}}

STUDIES: dict[str, list[Cell]] = {
    "sample_rate": [Cell(_method(r, False), r) for r in (1.0, 0.4, 0.2, 0.1, 0.05)],
    "label_flip": [Cell(f"flip{round(p * 100)}/{_method(r, False)}", r, stress={"label_flip": p} if p else {})
                   for p in (0.0, 0.2, 0.4) for r in (1.0, 0.3, 0.1)]
    + [Cell(f"flip{round(p * 100)}/{_method(0.1, True)}", 0.1, True, {"label_flip": p}) for p in (0.2, 0.4)],
    "conflict": [Cell(_method(r, f), r, f, _CONFLICT) for r, f in ((1.0, False), (0.2, False), (0.1, False),
                                                                   (1.0, True), (0.1, True))],
    "long_tail": [Cell(_method(r, False), r, stress=_LONG_TAIL) for r in (1.0, 0.2, 0.1)],
}

# The paper's ICCV21-MFR "All" TAR (%) for the same cells (None: the paper has no such
# row). sample_rate: WebFace4M (its lowest rate is 0.04, shown for 0.05); label_flip
# 0%: clean WebFace12M; the rest: Table webface_robustness.
PAPER: dict[str, dict[str, float | None]] = {
    "sample_rate": {"FC-1": 86.3, "PFC-0.4": 86.8, "PFC-0.2": 86.4, "PFC-0.1": 85.8, "PFC-0.05": 74.1},
    "label_flip": {"flip0/FC-1": 91.7, "flip0/PFC-0.3": 91.8, "flip0/PFC-0.1": 91.2,
                   "flip20/FC-1": 85.4, "flip20/PFC-0.3": None, "flip20/PFC-0.1": 87.6,
                   "flip40/FC-1": 43.9, "flip40/PFC-0.3": None, "flip40/PFC-0.1": 78.5,
                   "flip20/PFC*-0.1": 88.2, "flip40/PFC*-0.1": 80.2},
    "conflict": {"FC-1": 79.9, "PFC-0.2": None, "PFC-0.1": 91.2, "FC*-1": 91.2, "PFC*-0.1": 91.6},
    "long_tail": {"FC-1": 87.4, "PFC-0.2": 92.0, "PFC-0.1": 91.9},
}
PAPER_NOTES = {
    "sample_rate": "paper: WebFace4M, IR50, ICCV21-MFR All TAR@FAR=1e-6 (%); its lowest rate is 0.04, "
                   "shown in the 0.05 row",
    "label_flip": "paper: WebFace12M, IR50, ICCV21-MFR All TAR@FAR=1e-6 (%); 0% is the clean WebFace12M row; "
                  "the paper has no r=0.3 rows under noise",
    "conflict": "paper: WebFace12M-Conflict (200K of 600K identities split into 3), IR50, ICCV21-MFR All "
                "TAR@FAR=1e-6 (%)",
    "long_tail": "paper: WebFace42M with 1.8M of 2M identities reduced to 2-4 images, IR50, ICCV21-MFR All "
                 "TAR@FAR=1e-6 (%)",
}


def base_config(quick: bool = False) -> dict:
    """The job every cell starts from (a DeepSpeed config with a ``ds_pfc`` block).

    Full: 1000 synthetic identities x 16 images at 56x56 pixels, a narrow
    MobileFaceNet (width 0.25), CosFace (s 32, m 0.3), SGD lr 0.03 with momentum, micro
    batch 32, 4 epochs (2000 steps, poly decay), 300 held-out identities and 3000
    verification pairs: about 0.9 held-out accuracy at r = 1 and 4-5 minutes per run
    on one core. ``r = 0.05`` activates 50 classes for a batch of at most 32
    positives (about 20 sampled negatives): the regime of the paper's smallest rates.
    Quick (for tests): 40 identities x 4 images at 32x32, 20 steps, seconds."""
    identities, images, held_out, pairs, size, micro, epochs = (
        (40, 4, 10, 40, 32, 8, 1.0) if quick else (1000, 16, 300, 3000, 56, 32, 4.0))
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 5.0,
        "steps_per_print": 10 ** 9,
        "optimizer": {"type": "SGD", "params": {"lr": 0.03, "momentum": 0.9, "weight_decay": 5e-4}},
        "zero_optimization": {"stage": 0},
        "ds_pfc": {
            "description": "paper study on synthetic faces (launch/experiments.py)",
            "head": {"num_classes": identities, "embedding_size": 128, "sample_rate": 1.0,
                     "margin": {"type": "cosface", "scale": 32.0, "margin": 0.3},
                     "optimizer": {"type": "sgd", "lr_ratio": 1.0, "momentum": 0.9, "weight_decay": 5e-4}},
            "backbone": {"name": "mobilefacenet", "width": 0.25, "options": {"image_size": size}},
            "data": {"source": "synthetic",
                     "synthetic": {"identities": identities, "images_per_identity": images,
                                   "held_out_identities": held_out, "image_size": size, "seed": 0},
                     "flip": True, "workers": 1, "prefetch_batches": 4},
            "train": {"epochs": epochs, "schedule": {"type": "poly", "warmup_epochs": 0.1, "power": 2.0},
                      "log_every": 100},
            "evaluation": {"every_steps": 0, "synthetic_pairs": pairs, "batch_size": 128, "far": [1e-3, 1e-2]},
            "checkpoint": {"every_steps": 0, "keep": 1, "resume": False, "export": False},
        },
    }


SETTINGS = ("faces", "features")
"""``faces``: :func:`base_config`'s 1000 synthetic faces (the recorded studies);
``features``: :func:`features_config`, identity feature vectors at any class count."""

FEATURES_BATCH = 128
"""Micro batch of the features setting, the same at every class count."""
FEATURES_STEPS = 1500
"""Optimizer steps of the features setting, the same at every class count."""
FEATURES_EVALS = 10
"""Held-out evaluations over a features run (every ``FEATURES_STEPS // FEATURES_EVALS`` steps)."""


def features_config(classes: int, quick: bool = False) -> dict:
    """The features setting at ``classes`` classes: the same head, sampler, stress
    transforms and training app as :func:`base_config`, on identity feature vectors
    (``ds_pfc.data.IdentityFeatures``) and a small MLP, so that 100,000 classes train
    in minutes on one core.

    Fixed at every class count (so that ``r`` and ``C`` move the number of active
    negatives both ways): batch ``FEATURES_BATCH``, ``FEATURES_STEPS`` steps (poly
    decay), SGD lr 0.1 with momentum, CosFace (s 32, m 0.3), 64-d embeddings from a
    2 x 256 MLP on 96-d features (nuisance 1.5, noise 0.5), 8 images per identity,
    2000 held-out identities and 6000 verification pairs scored ``FEATURES_EVALS``
    times over training. Quick (for tests): batch 16, 30 steps, 3 evaluations."""
    from .._checks import check_int
    classes = check_int("classes", classes, 2)
    micro, steps, held_out, pairs = (16, 30, 20, 60) if quick else (FEATURES_BATCH, FEATURES_STEPS, 2000, 6000)
    evals = 3 if quick else FEATURES_EVALS
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 5.0,
        "steps_per_print": 10 ** 9,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9, "weight_decay": 5e-4}},
        "zero_optimization": {"stage": 0},
        "ds_pfc": {
            "description": f"paper study on identity features, {classes} classes (launch/experiments.py)",
            "head": {"num_classes": classes, "embedding_size": 64, "sample_rate": 1.0,
                     "margin": {"type": "cosface", "scale": 32.0, "margin": 0.3},
                     "optimizer": {"type": "sgd", "lr_ratio": 1.0, "momentum": 0.9, "weight_decay": 5e-4}},
            "backbone": {"name": "mlp", "options": {"input_dim": 96, "hidden": 256, "depth": 2}},
            "data": {"source": "features",
                     "features": {"identities": classes, "images_per_identity": 8, "held_out_identities": held_out,
                                  "feature_dim": 96, "latent_dim": 32, "nuisance": 1.5, "noise": 0.5, "seed": 0},
                     "flip": False, "workers": 0, "prefetch_batches": 4},
            # epochs only bounds max_steps: every class count and stress runs the same steps
            "train": {"epochs": 1e6, "max_steps": steps,
                      "schedule": {"type": "poly", "warmup_epochs": 0.0, "power": 2.0}, "log_every": 100},
            # the curves start at the untrained baseline (step 0)
            "evaluation": {"every_steps": steps // evals, "synthetic_pairs": pairs, "batch_size": 1024,
                           "flip": False, "far": [1e-3, 1e-2], "at_start": True},
            "checkpoint": {"every_steps": 0, "keep": 1, "resume": False, "export": False},
        },
    }


def setting_config(setting: str = "faces", classes: int | None = None, quick: bool = False) -> dict:
    """The base config of ``setting`` (``SETTINGS``); ``classes`` only for ``features``."""
    if setting not in SETTINGS:
        raise ValueError(f"setting must be one of {list(SETTINGS)}, got {setting!r}")
    if setting == "faces":
        if classes is not None:
            raise ValueError("classes applies to the features setting (the faces setting has 1000 classes)")
        return base_config(quick)
    if classes is None:
        raise ValueError("the features setting needs classes (e.g. 100000)")
    return features_config(classes, quick)


QUICK = "quick"


def cell_config(cell: Cell, seed: int, *, quick: bool = False, base: dict | None = None) -> dict:
    """The job JSON of one run: the base config (``base``, a job of your own, or
    :func:`base_config`) with the cell's setting and the seed. A conflict cell sizes
    the head for the pseudo-classes of the stressed training set; a label-flip cell of
    the features setting turns on the flip-mechanism diagnostic."""
    config = copy.deepcopy(base) if base is not None else base_config(quick)
    pfc = config["ds_pfc"]
    head, data = pfc["head"], pfc.setdefault("data", {})
    head["sample_rate"] = cell.sample_rate
    head["seed"] = seed
    if cell.filter:
        head["filter_threshold"] = FILTER_TAU
    elif base is not None:
        head.pop("filter_threshold", None)
    source = data.get("source", "synthetic")
    if cell.images_per_identity is not None and not quick and source in ("synthetic", "features"):
        data.setdefault(source, {})["images_per_identity"] = cell.images_per_identity
    data["seed"] = seed
    pfc.setdefault("train", {})["seed"] = seed
    data.pop("stress", None)
    if cell.stress:
        stress = dict(copy.deepcopy(cell.stress), seed=seed)
        if cell.stress.get("conflict"):       # pseudo-classes: the head has a class per piece
            head["num_classes"] = _stressed_classes(config, stress, head["num_classes"])
        data["stress"] = stress
        if cell.stress.get("label_flip") and source == "features":
            # the many-class studies log the paper's mechanism next to the accuracy
            pfc["train"].setdefault("diagnostics", {})["flip_mechanism"] = True
    return config


def _stressed_classes(config: dict, stress: dict, num_classes: int) -> int:
    """Classes of ``config``'s training set under ``stress``: exactly that for the
    built-in sets (the app requires equality), at least ``num_classes`` otherwise."""
    from .config import StressConfig, from_dict, split_config
    from .datasets import build_train_set, stressed
    _, cfg = split_config(config)
    wrapped = stressed(from_dict(StressConfig, stress, "ds_pfc.data.stress"), build_train_set(cfg))
    if cfg.data.source in ("synthetic", "features"):
        return wrapped.num_classes
    return max(num_classes, wrapped.num_classes)


def _find_cell(study: str, name: str) -> Cell:
    for cell in STUDIES[study]:
        if cell.name == name:
            return cell
    raise ValueError(f"study {study!r} has no cell {name!r}; its cells are {[c.name for c in STUDIES[study]]}")


def _machine() -> dict:
    from ..bench import machine_info, versions
    return {**machine_info(), **versions()}


def load_results(path: str, study: str) -> dict:
    """The study's result file, or a new empty record."""
    if os.path.exists(path):
        with open(path) as f:
            data = json.load(f)
        if data.get("experiment") != study:
            raise ValueError(f"{path} holds experiment {data.get('experiment')!r}, not {study!r}")
        return data
    return {"experiment": study, "cells": []}


@contextlib.contextmanager
def _locked(path: str):
    import fcntl
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with _THREAD_LOCK, open(path + ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


_THREAD_LOCK = threading.Lock()


def _save_results(path: str, data: dict) -> None:
    from ..checkpoint.files import atomic_write
    from .run_outputs import strict_json
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    atomic_write(path, (strict_json(data) + "\n").encode())      # NaN -> null: any JSON parser reads it


def _record(data: dict, cell: Cell, quick: bool) -> dict:
    for entry in data["cells"]:
        if entry["cell"] == cell.name:
            return entry
    entry = {"cell": cell.name, "sample_rate": cell.sample_rate, "setting": cell.setting(), "seeds": []}
    if quick:
        entry["quick"] = True
    data["cells"].append(entry)
    order = [c.name for c in STUDIES[data["experiment"]]]
    data["cells"].sort(key=lambda e: order.index(e["cell"]) if e["cell"] in order else len(order))
    return entry


def run_cell(study: str, cell_name: str, seed: int, *, out_dir: str, threads: int = 1, quick: bool = False,
             force: bool = False, base: dict | None = None, target: str | None = None,
             launcher: Sequence[str] = (), log=print) -> dict | None:
    """Run one (cell, seed) and record it in ``<out_dir>/<study>.json``; returns the
    seed's record, or None when it was recorded already (and not ``force``).

    ``base``: a job config of your own (any data source and evaluation) instead of
    the synthetic setup; ``target``: the evaluation set that scores the run (needed
    when ``base`` evaluates on several); ``launcher``: a command prefix such as
    ``["deepspeed", "--num_gpus", "8"]`` (default: one process)."""
    if study not in STUDIES:
        raise ValueError(f"unknown study {study!r}; studies are {list(STUDIES)}")
    cell = _find_cell(study, cell_name)
    setup = base if base is not None else base_config(quick)
    path = os.path.join(out_dir, f"{study}.json")
    data = load_results(path, study)
    if data.get("base_config") not in (None, setup):
        raise ValueError(f"{path} holds runs of another base setup (another --config, or "
                         "ds_pfc.experiments.base_config changed); record these in another --out directory")
    entry = _record(data, cell, quick)
    if not force and any(s["seed"] == seed for s in entry["seeds"]):
        return None
    scored_on = scoring_set(setup, target)
    config = cell_config(cell, seed, quick=quick, base=base)
    summary, wall = _train(config, f"{study}/{cell.name} seed {seed}", threads=threads, launcher=launcher)
    record = _run_record(summary, config, scored_on, seed, wall, threads, single=not launcher)
    with _locked(path):           # other runs (threads or processes) record into the same file
        data = load_results(path, study)
        entry = _record(data, cell, quick)
        entry["seeds"] = [s for s in entry["seeds"] if s["seed"] != seed] + [record]
        entry["seeds"].sort(key=lambda s: s["seed"])
        data["machine"] = _machine()
        data["base_config"] = setup
        data["scored_on"] = scored_on
        data["launcher"] = " ".join(launcher) or None
        data["paper_note"] = PAPER_NOTES[study]
        data["setting"] = _setting_text(setup)
        _save_results(path, data)
    log(f"{study}/{cell.name} seed {seed}: verification {record['verification_acc']:.4f} "
        f"({record['steps']} steps, {record['images_per_second']:.0f} images/s, {wall:.0f} s)")
    return record


def _train(config: dict, label: str, *, threads: int, launcher: Sequence[str] = ()) -> tuple[dict, float]:
    """Run the training app on ``config`` in its own process; ``(summary, wall seconds)``."""
    # The directory that holds the ds_pfc package (a source checkout, or site-packages):
    # each run imports this same library.
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    script = os.path.join(root, "launch", "train.py")
    if launcher and not os.path.isfile(script):
        raise ValueError(f"a launcher ({' '.join(launcher)}) runs a script: it needs the source checkout's "
                         f"launch/train.py, which {root} does not hold")
    with tempfile.TemporaryDirectory(prefix="ds_pfc-experiment-") as tmp:
        cfg_path = os.path.join(tmp, "job.json")
        with open(cfg_path, "w") as f:
            json.dump(config, f)
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
                   PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
        for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(key, None)
        cmd = ([*launcher, script] if launcher else [sys.executable, "-m", "ds_pfc.cli.train"]) + [
            "--deepspeed_config", cfg_path, "--output_dir", os.path.join(tmp, "run")]
        start = time.perf_counter()
        proc = subprocess.run(cmd, env=env, cwd=tmp, capture_output=True, text=True)
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            tail = (proc.stdout[-2000:] + proc.stderr[-3000:]).strip()
            raise RuntimeError(f"{label} failed (exit {proc.returncode}):\n{tail}")
        with open(os.path.join(tmp, "run", "summary.json")) as f:
            return json.load(f), wall


def _run_record(summary: dict, config: dict, scored_on: str, seed: int, wall: float, threads: int,
                single: bool) -> dict:
    """One run's record: the final held-out metrics, the curve over training and (for
    a one-process run) what the sampler activated."""
    final = summary["evaluations"][str(summary["steps"])][scored_on]
    curve = [{"step": int(step), "verification_acc": ev[scored_on]["accuracy"],
              "tar_at_far": ev[scored_on]["tar_at_far"]}
             for step, ev in sorted(summary["evaluations"].items(), key=lambda kv: int(kv[0])) if scored_on in ev]
    record = {"seed": seed, "verification_acc": final["accuracy"], "verification_acc_std": final["accuracy_std"],
              "tar_at_far": final["tar_at_far"], "steps": summary["steps"], "final_loss": summary["final_loss"],
              "images_per_second": summary["train_samples"] / summary["train_elapsed_s"],
              "steps_per_second": summary["steps"] / summary["train_elapsed_s"],
              "wall_seconds": wall, "threads": threads, "curve": curve,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    if single:
        record.update(batch_statistics(config, summary["steps"]))
    if "flip_mechanism" in summary:       # ds_pfc.train.diagnostics.flip_mechanism was on
        record["flip_mechanism"] = summary["flip_mechanism"]
    return record


def batch_statistics(config: dict, steps: int) -> dict:
    """What the head activated over the first ``steps`` steps of a one-process run of
    ``config``, replayed from its data order (the training app's sampler and epochs,
    the stressed labels) and the sampling rule ``|S| = max(floor(r C), |P|)`` (all C
    classes at r = 1), per micro batch:

    - ``active_negatives_mean``: mean of ``|S| - |P|``, the classes a step pushes as
      negatives;
    - ``absent_class_share``: mean of ``1 - |P| / C``, the share of the classes with
      no sample in the batch;
    - ``positives_mean``: mean of ``|P|``, the distinct classes of a batch."""
    from ..core.sampling import activation_budget
    from ..data.sampler import DistributedIdentitySampler
    from .config import split_config
    from .datasets import build_train_set
    ds, cfg = split_config(config)
    micro = ds["train_micro_batch_size_per_gpu"]
    gas = ds.get("gradient_accumulation_steps", 1)
    labels = build_train_set(cfg).labels()
    sampler = DistributedIdentitySampler(len(labels), rank=0, world_size=1, seed=cfg.data.seed,
                                         shuffle=cfg.data.shuffle, drop_last=True, block_size=micro)
    per_epoch = sampler.num_per_rank // (micro * gas) * micro * gas
    batches, epoch, need = [], 0, steps * gas
    while sum(len(b) for b in batches) < need:
        order = sampler.shard(epoch)[:per_epoch]
        batches.append(labels[order].view(-1, micro))
        epoch += 1
    batch = torch.cat(batches)[:need]
    ordered = batch.sort(dim=1).values
    positives = 1 + (ordered[:, 1:] != ordered[:, :-1]).sum(1)
    classes, rate = cfg.head.num_classes, cfg.head.sample_rate
    active = torch.full_like(positives, classes) if rate >= 1.0 else \
        positives.clamp(min=activation_budget(classes, rate))
    return {"active_negatives_mean": float((active - positives).double().mean()),
            "absent_class_share": float((1 - positives.double() / classes).mean()),
            "positives_mean": float(positives.double().mean())}


def _setting_text(config: dict) -> str:
    pfc = config["ds_pfc"]
    source = pfc.get("data", {}).get("source", "synthetic")
    if source == "features":
        return f"identity features, {pfc['head']['num_classes']} classes, MLP backbone"
    if source == "synthetic":
        return f"synthetic faces, {pfc['head']['num_classes']} classes"
    return f"{source} data"


def scoring_set(config: dict, target: str | None = None) -> str:
    """The evaluation set that scores a run of ``config``: ``target`` when it is one
    of the job's sets, else the synthetic held-out pairs or the job's only set."""
    from .config import split_config
    _, cfg = split_config(config)
    ev = cfg.evaluation
    builtin = cfg.data.source in ("synthetic", "features")
    names = (["synthetic_held_out"] if builtin and ev.synthetic_pairs else [])
    names += [os.path.splitext(os.path.basename(path))[0] for path in ev.bins]
    if not names:
        raise ValueError("the job evaluates on nothing: give it ds_pfc.evaluation.bins (or synthetic pairs)")
    if target is None:
        if len(names) > 1 and "synthetic_held_out" not in names:
            raise ValueError(f"the job evaluates on {names}: name the one that scores a run (--target)")
        return "synthetic_held_out" if "synthetic_held_out" in names else names[0]
    if target not in names:
        raise ValueError(f"target {target!r} is not among the job's evaluation sets {names}")
    return target


# ---------------------------------------------------------------------------- report
def _stats(values: list[float]) -> tuple[float, float]:
    values = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    if not values:
        return math.nan, math.nan
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def _paper(study: str, cell: str):
    return PAPER.get(study, {}).get(cell.replace("-1.0", "-1"))


def summarize(data: dict) -> list[dict]:
    """Per cell: mean and std over seeds of accuracy and each TAR."""
    rows = []
    for entry in data["cells"]:
        seeds = entry["seeds"]
        if not seeds:
            continue
        acc = _stats([s["verification_acc"] for s in seeds])
        fars = sorted({k for s in seeds for k in s["tar_at_far"]}, key=float)
        tars = {far: _stats([s["tar_at_far"].get(far) for s in seeds]) for far in fars}
        rows.append({"cell": entry["cell"], "seeds": len(seeds), "accuracy": acc, "tar_at_far": tars,
                     "images_per_second": _stats([s["images_per_second"] for s in seeds])[0],
                     "paper": _paper(data["experiment"], entry["cell"])})
    return rows


def write_report(study: str, out_dir: str) -> tuple[str, str | None]:
    """``<study>.md`` and ``<study>.png`` from ``<study>.json``; returns their paths
    (the PNG's is None when matplotlib is not installed)."""
    data = load_results(os.path.join(out_dir, f"{study}.json"), study)
    rows = summarize(data)
    fars = sorted({f for r in rows for f in r["tar_at_far"]}, key=float)
    scored_on = data.get("scored_on", "synthetic_held_out")
    if scored_on == "synthetic_held_out":
        where = "identity features" if data.get("setting", "").startswith("identity features") else "synthetic faces"
    else:
        where = f"the evaluation set {scored_on!r}"
    setting = f" Setting: {data['setting']}." if data.get("setting") else ""
    key = "0.01" if "0.01" in fars else (fars[-1] if fars else "verification_acc")
    seeds_of = {e["cell"]: e["seeds"] for e in data["cells"]}
    peaks = {r["cell"]: curve_peak(seeds_of[r["cell"]], key) for r in rows}
    with_peaks = any(p is not None for p in peaks.values())
    negatives = any("active_negatives_mean" in s for e in data["cells"] for s in e["seeds"])
    peak_head = f" best TAR@FAR={key} over training (step) |" if with_peaks else ""
    neg_head = " active negatives/step |" if negatives else ""
    lines = [f"# {study}", "", f"Held-out 1:1 verification on {where}, mean +- std over seeds; "
             f"{PAPER_NOTES[study]}.{setting}", "",
             "| cell | seeds | verification acc | " + " | ".join(f"TAR@FAR={f}" for f in fars)
             + f" |{peak_head}{neg_head} images/s | paper |",
             "|---|---|---|" + "---|" * len(fars) + "---|" * (with_peaks + negatives) + "---|---|"]
    for r in rows:
        acc = r["accuracy"]
        tars = " | ".join(f"{r['tar_at_far'][f][0]:.4f} +- {r['tar_at_far'][f][1]:.4f}" for f in fars)
        paper = "-" if r["paper"] is None else f"{r['paper']:.1f}"
        extra = ""
        if with_peaks:
            extra += f" {_peak_text(peaks[r['cell']])} |"
        if negatives:
            extra += f" {_stats([s.get('active_negatives_mean') for s in seeds_of[r['cell']]])[0]:.0f} |"
        lines.append(f"| {r['cell']} | {r['seeds']} | {acc[0]:.4f} +- {acc[1]:.4f} | {tars} |{extra} "
                     f"{r['images_per_second']:.0f} | {paper} |")
    lines += _mechanism_table(data)
    machine = data.get("machine", {})
    threads = sorted({s.get("threads", 1) for e in data["cells"] for s in e["seeds"]}) or [1]
    per = "one thread" if threads == [1] else f"{'/'.join(map(str, threads))} threads"
    runs = f"runs under `{data['launcher']}`, {per} per process" if data.get("launcher") else f"runs of {per} each"
    lines += ["", f"Machine: {machine.get('cpu', '?')}, torch {machine.get('torch', '?')}; "
              f"{runs} (`launch/experiments.py {study}`)."]
    curves = [(e["cell"], e["seeds"]) for e in data["cells"] if any(len(s.get("curve", [])) > 1 for s in e["seeds"])]
    if curves:
        lines += ["", f"Held-out curves over training: `{study}_curves.png`."]
    md = os.path.join(out_dir, f"{study}.md")
    with open(md, "w") as f:
        f.write("\n".join(lines) + "\n")
    if curves:
        # cells named "<group>/<method>" (label_flip's noise levels): a panel per group
        groups: dict[str, list] = {}
        for name, seeds in curves:
            group, _, method = name.rpartition("/")
            groups.setdefault(group, []).append((method, seeds))
        panels = [(f"{study} {group} ({where})", lines) for group, lines in groups.items()] if len(groups) > 1 else None
        _curve_plot(curves, key, f"{study} over training ({where})", os.path.join(out_dir, f"{study}_curves.png"),
                    panels=panels)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return md, None
    fig, ax = plt.subplots(figsize=(max(5.0, 0.9 * len(rows) + 2), 3.8))
    xs = range(len(rows))
    ax.errorbar(xs, [r["accuracy"][0] for r in rows], yerr=[r["accuracy"][1] for r in rows], fmt="o", capsize=4,
                label="verification accuracy (held out)")
    for far in fars:
        ax.errorbar(xs, [r["tar_at_far"][far][0] for r in rows], yerr=[r["tar_at_far"][far][1] for r in rows],
                    fmt="s", capsize=3, alpha=0.7, label=f"TAR@FAR={far}")
    ax.set_xticks(list(xs), [r["cell"] for r in rows], rotation=30, ha="right")
    ax.set_ylabel(f"{where} (mean +- std)")
    ax.set_title(f"{study}: {len(rows)} cells, {min((r['seeds'] for r in rows), default=0)}+ seeds each")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    png = os.path.join(out_dir, f"{study}.png")
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return md, png


def _peak_text(peak: tuple[float, int, float] | None) -> str:
    return "-" if peak is None else f"{peak[0]:.4f} ({peak[1]})"


def _mechanism_table(data: dict) -> list[str]:
    """Markdown lines: the flip-mechanism means per cell (mean +- std over seeds), over
    the intervals after the first tenth of training; empty without such records."""
    cells = [(e["cell"], e["seeds"]) for e in data["cells"] if any("flip_mechanism" in s for s in e["seeds"])]
    if not cells:
        return []
    last = max(int(k) for _, seeds in cells for s in seeds for k in s.get("flip_mechanism", {}))
    first = last // 10
    lines = ["", f"Flip mechanism (`ds_pfc.train.diagnostics.flip_mechanism`), over the flipped samples of steps "
             f"{first + 1}-{last}, mean +- std over seeds: how often a flipped sample's true class was active "
             "(and what uniform sampling gives for the same batches), the cosine of the image to its true center, "
             "and how much that cosine changes per step, against a control class that is only a negative:", "",
             "| cell | true class active | expected | cos(image, true) | dcos true/step | dcos true when active "
             "| dcos control/step | turn true | turn control |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, seeds in cells:
        means = [m for m in (mechanism_means(s, first) for s in seeds) if m is not None]
        cols = []
        for key in MECHANISM_KEYS:
            mean, std = _stats([m[key] for m in means])
            cols.append(f"{mean:.3f}" if key.startswith("true_active") else f"{mean:.2e} +- {std:.1e}")
        lines.append(f"| {name} | " + " | ".join(cols) + " |")
    return lines


# ---------------------------------------------------------------------------- curves
def _mean_curve(seeds: list[dict], key: str) -> tuple[list[int], list[float], list[float]]:
    """Steps, mean and std over seeds of a curve value (``verification_acc`` or a FAR)."""
    by_step: dict[int, list[float]] = {}
    for s in seeds:
        for point in s.get("curve", []):
            value = point["verification_acc"] if key == "verification_acc" else point["tar_at_far"].get(key)
            by_step.setdefault(point["step"], []).append(value)
    steps = sorted(by_step)
    stats = [_stats(by_step[step]) for step in steps]
    return steps, [m for m, _ in stats], [d for _, d in stats]


def curve_peak(seeds: list[dict], key: str = "0.01") -> tuple[float, int, float] | None:
    """``(peak, step of the peak, final)`` of the mean-over-seeds curve of ``key`` (a
    FAR or ``verification_acc``): where a run's held-out score was best, and how far it
    fell from there by the end. None without a curve of two or more points."""
    steps, mean, _ = _mean_curve(seeds, key)
    points = [(m, step) for step, m in zip(steps, mean) if not math.isnan(m)]
    if len(points) < 2:
        return None
    best, at = max(points, key=lambda p: (p[0], -p[1]))
    return best, at, points[-1][0]


MECHANISM_KEYS = ("true_active_share", "true_active_expected", "cos_true", "dcos_true", "dcos_true_active",
                  "dcos_control", "drift_true", "drift_control")
"""The flip-mechanism numbers a label-flip report tabulates (``ds_pfc.app.diagnostics``)."""


def mechanism_means(seed: dict, first_step: int = 0) -> dict[str, float] | None:
    """One run's flip-mechanism numbers over its intervals that end after
    ``first_step``, each weighted by the interval's flipped samples (a control class is
    drawn per flipped sample); None when the run has no such record."""
    intervals = [v for v in seed.get("flip_mechanism", {}).values() if v["steps"][1] > first_step]
    if not intervals:
        return None
    out = {}
    for key in MECHANISM_KEYS:
        pairs = [(v[key], v["flipped"]) for v in intervals if v.get(key) is not None]
        total = sum(w for _, w in pairs)
        out[key] = sum(x * w for x, w in pairs) / total if total else math.nan
    return out


def _curve_plot(series: list[tuple[str, list[dict]]], key: str, title: str, path: str, panels=None) -> str | None:
    """Mean +- std curves over training, one line per ``(label, seeds)``; ``panels``:
    ``[(panel title, series)]`` side by side instead. None without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    panels = panels or [(title, series)]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 3.8), squeeze=False, sharey=True)
    label = "held-out accuracy" if key == "verification_acc" else f"held-out TAR@FAR={key}"
    for ax, (panel, lines) in zip(axes[0], panels):
        for name, seeds in lines:
            steps, mean, std = _mean_curve(seeds, key)
            if not steps:
                continue
            ax.plot(steps, mean, marker=".", label=name)
            ax.fill_between(steps, [m - d for m, d in zip(mean, std)], [m + d for m, d in zip(mean, std)],
                            alpha=0.15)
        ax.set_title(panel, fontsize=9)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel(f"{label} (mean +- std)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------- sweep
SWEEP_CLASSES = (1_000, 10_000, 100_000)
"""Class counts of the sweep (the features setting)."""
SWEEP_RATES = (1.0, 0.3, 0.1, 0.03, 0.01)
"""Sample rates of the sweep."""
SWEEP = "sweep"


@dataclasses.dataclass(frozen=True)
class SweepCell:
    """One (classes, sample rate) point of the sweep, clean data, no filter."""

    classes: int
    sample_rate: float

    @property
    def name(self) -> str:
        return f"C{self.classes}/{_method(self.sample_rate, False)}"

    @property
    def budget(self) -> int:
        """``floor(r C)``: the classes a step activates when its positives are fewer."""
        return math.floor(self.sample_rate * self.classes + 1e-9)


def sweep_cells(classes: Sequence[int] = SWEEP_CLASSES, rates: Sequence[float] = SWEEP_RATES) -> list[SweepCell]:
    """The sweep's cells, classes-major; a cell whose budget ``floor(r C)`` is below 1
    (no class at all drawn beyond the positives) is left out."""
    for c in classes:
        if isinstance(c, bool) or not isinstance(c, int) or c < 2:
            raise ValueError(f"classes must be integers >= 2, got {c!r}")
    for r in rates:
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 < r <= 1:
            raise ValueError(f"rates must lie in (0, 1], got {r!r}")
    cells = [SweepCell(c, float(r)) for c in classes for r in rates]
    return [cell for cell in cells if cell.budget >= 1]


def find_sweep_cell(name: str) -> SweepCell:
    for cell in sweep_cells():
        if cell.name == name:
            return cell
    raise ValueError(f"the sweep has no cell {name!r}; its cells are {[c.name for c in sweep_cells()]}")


def sweep_config(cell: SweepCell, seed: int, quick: bool = False) -> dict:
    """The job of one sweep run: :func:`features_config` at the cell's classes, its
    sample rate, the seed."""
    return cell_config(Cell(cell.name, cell.sample_rate), seed, quick=quick,
                       base=features_config(cell.classes, quick))


def run_sweep_cell(cell: SweepCell, seed: int, *, out_dir: str, name: str = SWEEP, threads: int = 1,
                   quick: bool = False, force: bool = False, note: str | None = None, log=print) -> dict | None:
    """Run one sweep (cell, seed) and record it in ``<out_dir>/<name>.json`` (None when
    recorded already and not ``force``). The record holds the final held-out metrics,
    the curve over training, the sampler's active negatives and absent classes per
    step (:func:`batch_statistics`), steps/s and wall time."""
    path = os.path.join(out_dir, f"{name}.json")
    setup = features_config(cell.classes, quick)
    data = load_results(path, SWEEP)
    recorded = data.get("base_configs", {}).get(str(cell.classes))
    if recorded not in (None, setup):
        raise ValueError(f"{path} holds runs of another features setup at {cell.classes} classes "
                         "(ds_pfc.experiments.features_config changed); record these in another --out or --name")
    entry = _sweep_entry(data, cell, quick)
    if not force and any(s["seed"] == seed for s in entry["seeds"]):
        return None
    config = sweep_config(cell, seed, quick)
    summary, wall = _train(config, f"{SWEEP}/{cell.name} seed {seed}", threads=threads)
    record = _run_record(summary, config, "synthetic_held_out", seed, wall, threads, single=True)
    with _locked(path):
        data = load_results(path, SWEEP)
        entry = _sweep_entry(data, cell, quick)
        entry["seeds"] = sorted([s for s in entry["seeds"] if s["seed"] != seed] + [record], key=lambda s: s["seed"])
        data["machine"] = _machine()
        data.setdefault("base_configs", {})[str(cell.classes)] = setup
        data["scored_on"] = "synthetic_held_out"
        data["setting"] = "identity features (ds_pfc.experiments.features_config), MLP backbone"
        if note is not None:
            data["note"] = note
        _save_results(path, data)
    tar = record["tar_at_far"].get("0.01")
    log(f"{SWEEP}/{cell.name} seed {seed}: TAR@FAR=1e-2 {tar if tar is None else round(tar, 4)}, "
        f"{record['active_negatives_mean']:.0f} active negatives/step, {record['steps']} steps, "
        f"{record['steps_per_second']:.1f} steps/s, {wall:.0f} s")
    return record


def _sweep_entry(data: dict, cell: SweepCell, quick: bool) -> dict:
    for entry in data["cells"]:
        if entry["cell"] == cell.name:
            return entry
    entry = {"cell": cell.name, "classes": cell.classes, "sample_rate": cell.sample_rate, "budget": cell.budget,
             "seeds": []}
    if quick:
        entry["quick"] = True
    data["cells"].append(entry)
    data["cells"].sort(key=lambda e: (e["classes"], -e["sample_rate"]))
    return entry


def write_sweep_report(out_dir: str, name: str = SWEEP) -> tuple[str, str | None]:
    """``<name>.md`` (per cell: active negatives, absent classes, final TARs, steps/s)
    and ``<name>.png`` (TAR@FAR=1e-2 over training, a panel per class count)."""
    data = load_results(os.path.join(out_dir, f"{name}.json"), SWEEP)
    cells = [e for e in data["cells"] if e["seeds"]]
    fars = sorted({f for e in cells for s in e["seeds"] for f in s["tar_at_far"]}, key=float)
    lines = [f"# {name}", "", "Classes C x sample rate r at a fixed batch and step count, identity-feature setting "
             "(`ds_pfc.experiments.features_config`): held-out 1:1 verification, mean +- std over seeds; active "
             "negatives and absent classes are means over the steps.", ""]
    if data.get("note"):
        lines += [f"**{data['note']}**", ""]
    key = "0.01" if "0.01" in fars else (fars[-1] if fars else "verification_acc")
    lines += ["| C | r | floor(rC) | seeds | active negatives/step | classes absent from a batch | "
              "verification acc | " + " | ".join(f"TAR@FAR={f}" for f in fars)
              + f" | best TAR@FAR={key} over training (step) | steps/s | wall s |",
              "|---|---|---|---|---|---|---|" + "---|" * len(fars) + "---|---|---|"]
    for e in cells:
        seeds = e["seeds"]
        acc = _stats([s["verification_acc"] for s in seeds])
        tars = " | ".join("{:.4f} +- {:.4f}".format(*_stats([s["tar_at_far"].get(f) for s in seeds])) for f in fars)
        lines.append(f"| {e['classes']} | {e['sample_rate']:g} | {e['budget']} | {len(seeds)} | "
                     f"{_stats([s['active_negatives_mean'] for s in seeds])[0]:.1f} | "
                     f"{_stats([s['absent_class_share'] for s in seeds])[0]:.4f} | {acc[0]:.4f} +- {acc[1]:.4f} | "
                     f"{tars} | {_peak_text(curve_peak(seeds, key))} | "
                     f"{_stats([s['steps_per_second'] for s in seeds])[0]:.2f} | "
                     f"{_stats([s['wall_seconds'] for s in seeds])[0]:.0f} |")
    machine = data.get("machine", {})
    lines += ["", f"Machine: {machine.get('cpu', '?')}, torch {machine.get('torch', '?')}; one process per run "
              f"(`launch/experiments.py sweep`)."]
    md = os.path.join(out_dir, f"{name}.md")
    with open(md, "w") as f:
        f.write("\n".join(lines) + "\n")
    key = "0.01" if "0.01" in fars else (fars[-1] if fars else "verification_acc")
    panels = [(f"C = {c}", [(f"r = {e['sample_rate']:g}", e["seeds"]) for e in cells if e["classes"] == c])
              for c in sorted({e["classes"] for e in cells})]
    png = _curve_plot([], key, name, os.path.join(out_dir, f"{name}.png"), panels=panels) if panels else None
    return md, png
