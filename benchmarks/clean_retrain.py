"""Does a retrain on the cleaned labels close the gap that the corruption opened?

Three models of the same architecture and budget are trained from scratch, in one
process, with the library's pieces (the ``mlp`` backbone, ``PartialFC`` with CosFace,
SGD): on the clean identities, on the stressed labels (split identities and flips,
as in ``benchmarks/clean_study.py``) and on the labels ``ds-pfc-clean``'s analysis
gives from the stressed model (merged duplicates, flips relabelled, dropped images
left out; classes renumbered by its class map). Each is scored by TAR at FAR 1e-3 on
verification pairs of never-seen identities.

The cleaned labels take the training app's path: the analysis's ``labels.txt`` and
``class_map.json`` are written by ``ds-pfc-clean``'s writer, and the cleaned training
set is the one the app builds from a job config with the same stress and
``ds_pfc.data.labels`` naming that file (``ds_pfc.app.datasets.build_train_set``:
the file read and checked, the dropped images left out). The three trainings
themselves are the plain loop below, the same for all three, not the app's loop.

    PYTHONPATH=. python benchmarks/clean_retrain.py --out benchmarks/results/clean-retrain-features-cpu-2core.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from ds_pfc.app.cleaning import CleanSettings, clean_embeddings, write_report  # noqa: E402
from ds_pfc.app.config import split_config  # noqa: E402
from ds_pfc.app.datasets import build_train_set  # noqa: E402
from ds_pfc.bench.grow import FEATURES  # noqa: E402
from ds_pfc.core.head import PartialFC  # noqa: E402
from ds_pfc.core.margins import CosFace  # noqa: E402
from ds_pfc.data.features import IdentityFeatures  # noqa: E402
from ds_pfc.data.stress import StressedDataset  # noqa: E402
from ds_pfc.data.transforms import normalize  # noqa: E402
from ds_pfc.eval.verification import verification_metrics  # noqa: E402
from ds_pfc.models.mlp import MLP  # noqa: E402


def train(x: torch.Tensor, labels: torch.Tensor, num_classes: int, steps: int, seed: int, batch: int = 128):
    """The backbone after ``steps`` SGD steps on ``(x, labels)`` (CosFace s 32 m 0.3,
    every class a negative, lr 0.1 with poly decay, momentum 0.9, weight decay 5e-4)."""
    torch.manual_seed(seed)
    backbone = MLP(input_dim=x.shape[1] * x.shape[2] * x.shape[3], embedding_size=64, hidden=256, depth=2)
    head = PartialFC(num_classes, 64, sample_rate=1.0, margin=CosFace(scale=32.0, margin=0.3), seed=seed,
                     optimizer="sgd", momentum=0.9, weight_decay=5e-4)
    opt = torch.optim.SGD(backbone.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    gen = torch.Generator().manual_seed(seed)
    order, at = torch.randperm(len(labels), generator=gen), 0
    backbone.train()
    for step in range(steps):
        lr = 0.1 * (1 - step / steps) ** 2
        if at + batch > len(order):
            order, at = torch.randperm(len(labels), generator=gen), 0
        idx = order[at:at + batch]
        at += batch
        loss = head(backbone(x[idx]), labels[idx])
        opt.zero_grad()
        loss.backward()
        for group in opt.param_groups:
            group["lr"] = lr
        torch.nn.utils.clip_grad_norm_(backbone.parameters(), 5.0)
        opt.step()
        head.step(lr)
    return backbone.eval(), float(loss.detach())


def job_config(args, labels: str, num_classes: int) -> dict:
    """The app's job config of the cleaned retrain's data: the study's identity
    features with its stress, trained on ``labels`` (``ds_pfc.data.labels``)."""
    return {"train_micro_batch_size_per_gpu": 128, "gradient_clipping": 5.0, "ds_pfc": {
        "head": {"num_classes": num_classes, "embedding_size": 64},
        "backbone": {"name": "mlp", "options": {"input_dim": FEATURES["feature_dim"], "hidden": 256, "depth": 2}},
        "data": {"source": "features", "flip": False, "labels": labels,
                 "features": {"identities": args.identities, "images_per_identity": args.images, **FEATURES},
                 "stress": {"label_flip": args.flip, "conflict": {"fraction": args.conflict, "splits": 2},
                            "seed": 0}},
        "evaluation": {"flip": False}}}


def app_training_set(args, clean_dir: str, report) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, labels)`` of the cleaned retrain as the training app reads them: the
    report written by ``ds-pfc-clean``'s writer into ``clean_dir``, its ``labels.txt``
    applied by the app's data path."""
    paths = write_report(report, clean_dir, sheets=0)
    with open(paths["class_map.json"]) as f:
        num_classes = len(json.load(f))
    _, cfg = split_config(job_config(args, paths["labels.txt"], num_classes))
    data = build_train_set(cfg)
    items = data.__getitems__(list(range(len(data))))
    return normalize(torch.stack([torch.as_tensor(image) for image, _ in items])), data.labels()


@torch.no_grad()
def embed(backbone, x):
    return torch.nn.functional.normalize(torch.cat([backbone(x[i:i + 2048]) for i in range(0, len(x), 2048)]), dim=1)


def tar(backbone, pairs_x, issame, far=1e-3) -> float:
    e = embed(backbone, pairs_x)
    return verification_metrics(e[0::2], e[1::2], issame, far_targets=(far,)).tar_at_far[far]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Retrain on cleaned labels against the stressed and clean runs.")
    p.add_argument("--out", required=True, help="the JSON to write")
    p.add_argument("--identities", type=int, default=2000, help="identities before the conflict split")
    p.add_argument("--images", type=int, default=8, help="images per identity")
    p.add_argument("--steps", type=int, default=4000, help="training steps of every model")
    p.add_argument("--conflict", type=float, default=0.1, help="share of identities split in two")
    p.add_argument("--flip", type=float, default=0.05, help="share of labels flipped")
    p.add_argument("--pairs", type=int, default=6000, help="verification pairs of never-seen identities")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="training seeds")
    p.add_argument("--clean-dir", default=None,
                   help="where the analysis's labels.txt and class_map.json go (default: a temporary folder)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    started = time.time()
    base = IdentityFeatures(args.identities, args.images, **FEATURES)
    stressed = StressedDataset(base, label_flip=args.flip, conflict=args.conflict, conflict_splits=2, seed=0)
    x_all = normalize(base.get_batch(torch.arange(len(base)))[0])
    x = x_all[stressed.base_indices()]
    clean_labels = base.labels()[stressed.base_indices()]
    unseen = IdentityFeatures(1000, args.images, first_identity=args.identities, **FEATURES)
    pairs_x, issame = unseen.pairs(args.pairs, seed=0)
    pairs_x = normalize(pairs_x)
    runs = []
    for seed in args.seeds:
        row = {"seed": seed}
        model, loss = train(x, clean_labels, args.identities, args.steps, seed)
        row["clean"] = {"tar": tar(model, pairs_x, issame), "loss": loss, "classes": args.identities}
        model, loss = train(x, stressed.labels(), stressed.num_classes, args.steps, seed)
        row["stressed"] = {"tar": tar(model, pairs_x, issame), "loss": loss, "classes": stressed.num_classes}
        report = clean_embeddings(embed(model, x), stressed.labels(), stressed.num_classes, CleanSettings())
        keep = report.new_labels >= 0
        with tempfile.TemporaryDirectory() as tmp:
            x_kept, kept_labels = app_training_set(args, os.path.join(args.clean_dir or tmp, f"seed{seed}"),
                                                   report)
        # the app's data path gives the images and labels the report meant
        if not (torch.equal(x_kept, x[keep]) and torch.equal(kept_labels, report.new_labels[keep])):
            raise RuntimeError("the training set built from labels.txt differs from the report's cleaned labels")
        model, loss = train(x_kept, kept_labels, len(report.class_map), args.steps, seed)
        row["cleaned"] = {"tar": tar(model, pairs_x, issame), "loss": loss, "classes": len(report.class_map),
                          "images": int(keep.sum()), "summary": {k: v for k, v in report.summary().items()
                                                                 if k != "settings"}}
        gap = row["clean"]["tar"] - row["stressed"]["tar"]
        row["gap_closed"] = round((row["cleaned"]["tar"] - row["stressed"]["tar"]) / gap, 3) if gap else None
        print(json.dumps(row), flush=True)
        runs.append(row)
    result = {"benchmark": "clean-retrain", "date": time.strftime("%Y-%m-%d"),
              "machine": {"host": "2-core CPU VM", "platform": platform.platform(), "threads": 1},
              "versions": {"torch": torch.__version__, "python": platform.python_version()},
              "config": {**{k: v for k, v in vars(args).items() if k != "out"}, "far": 1e-3, "features": FEATURES,
                         "model": "mlp 2 x 256 -> 64, CosFace s 32 m 0.3, r = 1.0, SGD 0.1 poly, batch 128",
                         "cleaned_data": "labels.txt and class_map.json from write_report, read back through "
                                         "ds_pfc.data.labels (build_train_set); training: the plain loop"},
              "runs": runs, "seconds": round(time.time() - started, 1)}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
