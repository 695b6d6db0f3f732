"""``ds-pfc-clean``: find duplicate identities, mislabelled images and test-set overlap in
a trained run's label space, and write a class map for the next run.

    ds-pfc-clean --model runs/x/checkpoints --out runs/x/clean [--test lfw.bin] [--second other-job.json]
    deepspeed --num_gpus 8 --module ds_pfc.cli.clean --model runs/x/checkpoints --out runs/x/clean --device cuda

``--model``: a checkpoint directory (its ``latest`` tag unless ``--tag``; the head's
rows are then compared too), a model folder of ``ds-pfc-export backbone`` or an export
``.safetensors``. The training data is the one of the job config stored with the
model (``--data`` points at another copy of it). Writes into ``--out``:
``duplicates.csv``, ``images.csv`` (flips and outliers), ``overlap.csv``,
``merge.csv``, ``labels.txt`` (the cleaned label of every training image, ``-1``:
dropped; ``ds_pfc.data.labels`` trains on it), ``second_labels.txt`` (with ``--second``: its images' merged ids),
``class_map.json`` (old id -> new id, for ``ds_pfc.train.init.class_map``),
``summary.json`` and contact sheets under ``sheets/``. The analysis is
:mod:`ds_pfc.app.cleaning`; the workflow and the thresholds: ``docs/cleaning.md``.
"""
from __future__ import annotations

import argparse
import os
import sys

from .._args import parser

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    from ..app.cleaning import IMPLS, CleanSettings
    d = CleanSettings()
    p = parser("ds-pfc-clean", "Find duplicate identities, mislabelled images and test-set overlap in a trained "
                               "run's label space and write a class map for the next run.")
    p.add_argument("--model", required=True, help="a checkpoint directory, a model folder or an export .safetensors")
    p.add_argument("--tag", default=None, help="the checkpoint tag (default: the one 'latest' names)")
    p.add_argument("--out", required=True, help="the folder to write the tables, labels and class map into")
    p.add_argument("--data", default=None, help="the training data's path when it moved since training "
                                                "(replaces ds_pfc.data.path of the stored job config)")
    p.add_argument("--test", action="append", default=[], metavar="BIN",
                   help="a verification .bin (LFW, CFP-FP, ...) whose images no training class may match "
                        "(repeatable)")
    p.add_argument("--second", default=None, metavar="JOB_JSON",
                   help="a job config whose training set is merged into this run's label space")
    p.add_argument("--no-head", action="store_true", help="do not compare the head's rows (checkpoints only)")
    p.add_argument("--keep-overlap", action="store_true",
                   help="keep the classes that overlap the test set in labels.txt and class_map.json")
    p.add_argument("--drop-flips", action="store_true",
                   help="drop flipped images instead of giving them the class they point to")
    p.add_argument("--duplicate-cos", type=float, default=d.duplicate_cos,
                   help=f"centre cosine of a candidate duplicate (default {d.duplicate_cos})")
    p.add_argument("--duplicate-evidence", type=float, default=d.duplicate_evidence,
                   help=f"share of images picking the other class that confirms it (default {d.duplicate_evidence})")
    p.add_argument("--neighbours", type=int, default=d.neighbours,
                   help=f"candidate duplicates per class (default {d.neighbours})")
    p.add_argument("--flip-margin", type=float, default=d.flip_margin,
                   help=f"how much another centre must beat the own one for a flip (default {d.flip_margin})")
    p.add_argument("--outlier-cos", type=float, default=d.outlier_cos,
                   help=f"cosine to the own centre below which an image is an outlier (default {d.outlier_cos})")
    p.add_argument("--overlap-cos", type=float, default=d.overlap_cos,
                   help=f"cosine of a training centre to a test image that counts as overlap (default "
                        f"{d.overlap_cos})")
    p.add_argument("--merge-cos", type=float, default=d.merge_cos,
                   help=f"centre cosine at which a second dataset's class joins one (default {d.merge_cos})")
    p.add_argument("--impl", choices=IMPLS, default=d.impl,
                   help="the neighbour search: torch matrix products, the fused Triton kernel (CUDA), faiss's exact "
                        "flat index (CPU, pip install ds_pfc[faiss]) or auto (faiss on CPU when installed, else torch; "
                        f"default {d.impl})")
    p.add_argument("--batch-size", type=int, default=256, help="images per inference batch (default 256)")
    p.add_argument("--device", default="cpu", help="where the backbone runs (default cpu)")
    p.add_argument("--flip", action="store_true", help="embed each image plus its horizontal flip (faces)")
    p.add_argument("--sheets", type=int, default=8, help="contact sheets per kind (default 8; 0: none)")
    return p


def main(argv=None) -> int:
    """``ds-pfc-clean``: exit status 1 with one ``error:`` line on a refused input. Under
    a launcher (``WORLD_SIZE`` > 1: ``deepspeed``, ``torchrun``) every rank embeds a
    share of the images and rank 0 writes the results."""
    args = build_parser().parse_args(argv)
    import torch.distributed as dist

    from ..app.cleaning import run_clean
    from ..app.config import ConfigError
    started = False
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        if args.device == "cuda" and "LOCAL_RANK" in os.environ:     # one GPU per local rank
            import torch
            args.device = f"cuda:{int(os.environ['LOCAL_RANK'])}"
            torch.cuda.set_device(args.device)
        dist.init_process_group("nccl" if str(args.device).startswith("cuda") else "gloo")
        started = True
    try:
        summary = run_clean(args, log=lambda line: print(line, flush=True))
    except (ValueError, FileNotFoundError, ConfigError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    finally:
        if started:
            dist.destroy_process_group()
    if dist.is_initialized() and dist.get_rank() != 0:
        return 0
    print(f"clean: {summary['duplicate_groups']} duplicate groups, {summary['flipped_images']} flipped and "
          f"{summary['outlier_images']} outlier images, {summary['overlapping_classes']} classes overlapping the "
          f"test set; {summary['kept_classes']} classes kept -> {args.out}")
    return 0


if __name__ == "__main__":     # python -m ds_pfc.cli.clean
    sys.exit(main())
