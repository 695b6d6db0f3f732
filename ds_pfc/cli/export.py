"""Export or reshard a ds_pfc training checkpoint.

    python launch/export.py safetensors --checkpoint runs/x/checkpoints [--tag T] --out model.safetensors
    python launch/export.py backbone --checkpoint runs/x/checkpoints --out r100-backbone
    python launch/export.py hub --checkpoint runs/x/checkpoints --out r100-hub [--results ijbc.json] \
        [--push me/r100-arcface]
    python launch/export.py reshard --checkpoint runs/x/checkpoints [--tag T] --world_size 5 --out runs/y/checkpoints
    python launch/export.py universal --checkpoint runs/x/checkpoints [--tag T] [--out DIR] [--workers 4]
    python launch/export.py onnx --model runs/x/export/model.safetensors --out backbone.onnx [--opset 17] \
        [--batch 1] [--fp16]
    python launch/export.py classifier --checkpoint runs/x/checkpoints [--tag T] --out head.safetensors [--dominant]
    python launch/export.py import-arcface --network r50 --backbone work_dirs/r50/model.pt \
        [--head work_dirs/r50 --world_size 8] --out imported/r50

``safetensors``: one file with the backbone's float32 weights (``backbone.*``) and
each head's full classifier (``heads.<name>.weight [C, d]``, classes in id order).
``backbone``: the backbone alone (``<out>/model.safetensors``, ``<out>/config.json``), what
people ship; ``hub``: the same plus a model card (``README.md``) for the Hugging Face Hub,
uploaded with ``--push REPO_ID`` (:mod:`ds_pfc.app.hub`).
``reshard``: a copy of the checkpoint for another number of ranks, exact for the
heads (resume from it by pointing ``ds_pfc.train.output_dir`` at the parent of
``--out``). ``universal``: the tag converted to DeepSpeed's universal checkpoint
(default ``<checkpoint>/<tag>-universal``), which resumes on any number of ranks
with ZeRO 1-3; the next resume on another number of ranks picks it up by itself
(ZeRO 0 checkpoints need no conversion). ``onnx``: the backbone (needs ``onnx``),
input ``images [B, 3, H, W]`` float32 RGB normalised as ``(x - 127.5) / 127.5``, output
``embeddings [B, d]``: a dynamic batch axis unless ``--batch N``, opset ``--opset``
(default 17), ``--fp16`` for float16 weights and arithmetic behind float32 ends; the
file loads in insightface's ``model_zoo.get_model`` as a recognition model.
``classifier``: one head's merged classifier with its optimizer states (``weight [C K, d]`` with ``K`` sub-centers per class); with
``--dominant`` also each class's dominant sub-center (``dominant [C]``,
``weight_dominant [C, d]``), found by embedding the job's training set with the
checkpoint's backbone (one pass, in this process). ``import-arcface``: arcface_torch's
backbone weights as ``<out>/model.safetensors`` (an export that ``launch/eval.py
--model`` reads; with ``--head`` it holds the merged classifier too) and its Partial
FC head files of any number of ranks as ds_pfc head shards for ``--world_size``
ranks (``<out>/head-rank*-of-*.safetensors``); see :mod:`ds_pfc.app.arcface_import`.
"""
from __future__ import annotations

import argparse
import sys

from .._args import parser


def build_parser() -> argparse.ArgumentParser:
    p = parser("ds-pfc-export", " ".join(__doc__.split("\n\n")[0].split()))
    sub = p.add_subparsers(dest="command", required=True, help="what to export or convert ('COMMAND --help' "
                                                                "lists its options)")
    s = sub.add_parser("safetensors", help="backbone + merged classifier in one file",
                       description="Write one .safetensors file with the backbone's float32 weights (backbone.*) "
                                   "and each head's full classifier (heads.<name>.weight [C, d], classes in id "
                                   "order).")
    s.add_argument("--checkpoint", required=True, help="the checkpoints directory (holds 'latest')")
    s.add_argument("--tag", default=None, help="the checkpoint tag to export (default: the one 'latest' names)")
    s.add_argument("--out", required=True, help="the .safetensors file to write")
    b = sub.add_parser("backbone", help="the backbone alone (model.safetensors + config.json): what people ship",
                       description="Write the backbone's float32 weights without the classifier to <out>/"
                                   "model.safetensors and its facts and job config to <out>/config.json (a folder "
                                   "that ds-pfc-eval --model and load_model read).")
    _model_source_arguments(b)
    h = sub.add_parser("hub", help="a Hugging Face model folder (backbone, config, model card); --push uploads it",
                       description="Write a Hugging Face model folder: the backbone (model.safetensors), config.json "
                                   "and a model card (README.md: the training config, data, results, what ran as the "
                                   "checkpoint records it (ranks, device, the backbone's and the head products' "
                                   "dtypes, versions), the code that loads it and how to install ds_pfc); with "
                                   "--push, upload it with huggingface_hub.")
    _model_source_arguments(h)
    h.add_argument("--name", default=None, help="the model card's title (default: the output folder's name)")
    h.add_argument("--summary", default=None,
                   help="the run's summary.json for the card's results (default: the one of the checkpoint's run)")
    h.add_argument("--results", action="append", default=[], metavar="JSON",
                   help="a ds-pfc-eval results JSON (verification or IJB) to add to the card (repeatable)")
    h.add_argument("--push", default=None, metavar="REPO_ID",
                   help="upload the folder to this Hub model repository (created if missing; the token comes from "
                        "HF_TOKEN or huggingface-cli login)")
    h.add_argument("--private", action="store_true", help="with --push: create the repository private")
    r = sub.add_parser("reshard", help="rewrite a checkpoint for another world size",
                       description="Copy a checkpoint for another number of ranks, exact for the heads (resume "
                                   "from it by pointing ds_pfc.train.output_dir at the parent of --out).")
    r.add_argument("--checkpoint", required=True, help="the checkpoints directory (holds 'latest')")
    r.add_argument("--tag", default=None, help="the checkpoint tag to reshard (default: the one 'latest' names)")
    r.add_argument("--world_size", type=int, required=True, help="ranks of the job that will resume from the copy")
    r.add_argument("--out", required=True, help="new checkpoints directory")
    u = sub.add_parser("universal", help="convert a ZeRO 1-3 checkpoint to DeepSpeed's universal checkpoint "
                                         "(resumes on any number of ranks)",
                       description="Convert a ZeRO 1-3 checkpoint tag to DeepSpeed's universal checkpoint, which "
                                   "resumes on any number of ranks (ZeRO 0 checkpoints need no conversion).")
    u.add_argument("--checkpoint", required=True, help="the checkpoints directory (holds 'latest')")
    u.add_argument("--tag", default=None, help="the checkpoint tag to convert (default: the one 'latest' names)")
    u.add_argument("--out", default=None, help="the new tag directory (default: <checkpoint>/<tag>-universal)")
    u.add_argument("--workers", type=int, default=4, help="parallel extraction processes / writer threads")
    u.add_argument("--impl", choices=("auto", "deepspeed", "ds_pfc"), default="auto",
                   help="converter: DeepSpeed's (Adam states only), ds_pfc's (any states), or auto")
    o = sub.add_parser("onnx", help="the backbone as ONNX",
                       description="Export the backbone as ONNX (needs onnx): input images [B, 3, H, W] float32 RGB "
                                   "normalised as (x - 127.5) / 127.5, output embeddings [B, d].")
    o.add_argument("--model", required=True, help="an export .safetensors or a checkpoints directory")
    o.add_argument("--tag", default=None, help="with a checkpoints directory: the checkpoint tag (default: the "
                                               "one 'latest' names)")
    o.add_argument("--out", required=True, help="the .onnx file to write")
    o.add_argument("--opset", type=int, default=17, help="ONNX opset, 9 .. 20 (default 17)")
    o.add_argument("--batch", type=int, default=None, help="a static batch size (default: a dynamic batch axis)")
    o.add_argument("--fp16", action="store_true", help="float16 weights and arithmetic (float32 input and output)")
    c = sub.add_parser("classifier", help="one head's merged classifier (and its dominant sub-centers)",
                       description="Write one head's merged classifier with its optimizer states (weight [C K, d] "
                                   "with K sub-centers per class), and with --dominant each class's dominant "
                                   "sub-center.")
    c.add_argument("--checkpoint", required=True, help="the checkpoints directory (holds 'latest')")
    c.add_argument("--tag", default=None, help="the checkpoint tag to export (default: the one 'latest' names)")
    c.add_argument("--head", default="head", help="the head's name (the training app's is 'head')")
    c.add_argument("--out", required=True, help="the .safetensors file to write")
    c.add_argument("--dominant", action="store_true", help="also the dominant sub-center of every class")
    c.add_argument("--batch_size", type=int, default=128,
                   help="with --dominant: images per batch when embedding the training set (default 128)")
    c.add_argument("--device", default="cpu",
                   help="with --dominant: the torch device that embeds the training set (default cpu)")
    a = sub.add_parser("import-arcface", help="arcface_torch's backbone (model.pt) and/or Partial FC head "
                                              "(per-rank files) as a ds_pfc model export and head shards",
                       description="Convert arcface_torch's backbone weights (model.pt) into a ds_pfc model export "
                                   "(<out>/model.safetensors) and its Partial FC head files of any number of ranks "
                                   "into ds_pfc head shards for --world_size ranks.")
    a.add_argument("--backbone", default=None, help="arcface_torch's model.pt (or a checkpoint_gpu_0.pt)")
    a.add_argument("--network", default=None, help="its arcface_torch network name: r18 r34 r50 r100 r200 mbf "
                                                   "mbf_large vit_t vit_s vit_b ...")
    a.add_argument("--head", default=None, help="the directory holding checkpoint_gpu_{rank}.pt or "
                                                "rank_{rank}_softmax_weight(_mom).pt of every rank")
    a.add_argument("--world_size", type=int, default=None, help="ranks of the ds_pfc job that will load the head")
    a.add_argument("--num_classes", type=int, default=None, help="check the head's class count")
    a.add_argument("--optimizer_states", choices=("auto", "zero_momentum", "zero_adamw", "none"), default="auto",
                   help="the head's optimizer states: auto as saved (SGD momentum or AdamW moments; the centers "
                        "alone where none were saved, which a head of any optimizer starts from at zero states), "
                        "zero_momentum a zero SGD momentum where none was saved, zero_adamw zero AdamW moments "
                        "and step 0 where none were saved, none the centers alone")
    a.add_argument("--config", default=None, help="a ds_pfc job config (JSON) to store with the model")
    a.add_argument("--out", required=True, help="output directory (model.safetensors, head-rank*.safetensors)")
    return p


def _model_source_arguments(p) -> None:
    """--checkpoint, --tag and --out of the commands that write a model folder."""
    p.add_argument("--checkpoint", required=True,
                   help="the checkpoints directory (holds 'latest'), a tag directory or a model export (.safetensors)")
    p.add_argument("--tag", default=None, help="the checkpoint tag to export (default: the one 'latest' names)")
    p.add_argument("--out", required=True, help="the output folder")


def run(argv=None) -> str:
    p = build_parser()
    args = p.parse_args(argv)

    if args.command == "import-arcface":
        return _import_arcface(args)
    from ds_pfc.app import export
    try:
        if args.command in ("backbone", "hub"):
            from ds_pfc.app import hub
            if args.command == "backbone":
                paths = hub.export_backbone(args.checkpoint, args.out, tag=args.tag)
            else:
                paths = hub.export_hub(args.checkpoint, args.out, tag=args.tag, name=args.name,
                                       summary=args.summary, results=args.results)
            for path in paths.values():
                print(path)
            if args.command == "hub" and args.push:
                print(f"uploaded to {hub.push_to_hub(args.out, args.push, private=args.private)}")
            return args.out
        if args.command == "classifier":
            from ds_pfc.checkpoint import shards as ckpt
            tag_dir = export.resolve_tag(args.checkpoint, args.tag)
            dominant = export.dominant_subcenters(tag_dir, name=args.head, batch_size=args.batch_size,
                                                  device=args.device, log=print) if args.dominant else None
            out = ckpt.export_classifier(tag_dir, args.out, name=args.head, include_optimizer=True,
                                         dominant=dominant)
        elif args.command == "safetensors":
            tag_dir = export.resolve_tag(args.checkpoint, args.tag)
            out = export.export_checkpoint(tag_dir, args.out, config=export.read_marker(tag_dir)
                                           .get("metadata", {}).get("config"))
        elif args.command == "universal":
            from ds_pfc.checkpoint import universal
            out = universal.to_universal(export.resolve_tag(args.checkpoint, args.tag), args.out,
                                         workers=args.workers, impl=args.impl)
        elif args.command == "reshard":
            if args.world_size < 1:
                raise ValueError(f"--world_size must be >= 1, got {args.world_size}")
            out = export.reshard_checkpoint(export.resolve_tag(args.checkpoint, args.tag), args.out, args.world_size)
        else:
            backbone, config = export.load_backbone(args.model, args.tag)
            size = config["ds_pfc"].get("data", {}).get("synthetic", {}).get("image_size", 112)
            out = export.export_onnx(backbone, args.out, image_size=size, opset=args.opset, batch=args.batch,
                                     fp16=args.fp16)
    except (FileNotFoundError, FileExistsError, ValueError, RuntimeError) as err:
        sys.exit(f"error: {err}")
    print(out)
    return out


def _import_arcface(args):
    import json

    from ds_pfc.app.arcface_import import import_arcface
    try:
        config = None
        if args.config is not None:
            with open(args.config) as f:
                try:
                    config = json.load(f)
                except ValueError as err:
                    raise ValueError(f"--config {args.config} is not JSON ({err})") from None
        out = import_arcface(args.out, backbone=args.backbone, network=args.network, head=args.head,
                             world_size=args.world_size, config=config, optimizer_states=args.optimizer_states,
                             num_classes=args.num_classes)
    except (FileNotFoundError, FileExistsError, ValueError, RuntimeError) as err:
        sys.exit(f"error: {err}")
    if out["model"]:
        print(out["model"])
    for path in out["head_shards"]:
        print(path)
    return out


def main(argv=None) -> int:
    """``ds-pfc-export`` / ``launch/export.py``: :func:`run`, exit status 0 (errors exit with ``error: ...``)."""
    run(argv)
    return 0


if __name__ == "__main__":     # python -m ds_pfc.cli.export
    sys.exit(main())
