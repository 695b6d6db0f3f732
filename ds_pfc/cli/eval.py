"""Verification of a trained backbone: 1:1 pairs of insightface .bin sets, or IJB-B/IJB-C templates.

    python launch/eval.py --model runs/x/export/model.safetensors --bins lfw.bin cfp_fp.bin agedb_30.bin
    python launch/eval.py --model runs/x/checkpoints            # the latest checkpoint
    python launch/eval.py --ijb /data/IJB_release/IJBC --target IJBC --model a.safetensors --model b.safetensors
    python launch/eval.py --model work_dirs/r50/model.pt --network r50 --bins lfw.bin    # arcface_torch
    python launch/eval.py --model backbone.onnx --bins lfw.bin                           # ONNX (onnxruntime)

Pair sets: flip test-time augmentation, 10-fold accuracy with threshold selection on
the other folds, TAR at FAR 1e-4 and 1e-6 (NaN where a set has too few impostor
pairs). Without ``--bins`` or ``--ijb`` a synthetic-data model is evaluated on its
held-out identities. Images are decoded with Pillow (a dependency; torchvision when it is
installed and works), checked on a tiny test image before any model is loaded.

Models: a ds_pfc export or checkpoint directory; arcface_torch's ``model.pt`` (or a
``checkpoint_gpu_*.pt``) with ``--network`` (its arcface_torch name, ``--width`` for
narrower networks), rebuilt in memory as the ds_pfc backbone; an ``.onnx`` file run by
onnxruntime (input ``[B, 3, H, W]`` RGB normalised as ``(x - 127.5) / 127.5``, a static
batch size run in padded chunks). All are scored by the same protocols, flip-summed
features included (``ds_pfc.app.eval_models``). Pair sets of models other than ds_pfc's
need ``--bins`` and report TAR at FAR 1e-4 and 1e-6.

IJB (``--ijb ROOT``, insightface's packaged release with ``meta/`` and
``loose_crop/``): every image aligned from its five landmarks, flip-summed features,
detector-score weighting, media-averaged and summed templates, TAR at FAR 1e-6 ..
1e-1 by insightface's rule (``ds_pfc.eval.ijb``). Writes ``ijb_<target>.json``
(TAR@FAR per model, settings, sha256 of each model file) and ``ijb_<target>.png``
(the ROCs, one curve per ``--model``; needs matplotlib) into ``--out`` (default: the
first model's directory). ``--identification`` adds 1:N identification (rank-1/5/10
and TPIR at FPIR 0.01 and 0.1 as insightface's ``ijb_1n.py`` defines them;
``ds_pfc.eval.ijb_1n``) from the release's ``meta/<target>_1N_*.csv`` files.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
import warnings

from .._args import parser


def _sha256(path: str) -> str | None:
    if not os.path.isfile(path):
        return None     # a checkpoint directory
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _labels(paths: list[str]) -> list[str]:
    """The shortest path suffixes that tell the models apart (exports are all
    ``model.safetensors``)."""
    parts = [os.path.normpath(os.path.abspath(p)).split(os.sep) for p in paths]
    for k in range(1, max(len(p) for p in parts) + 1):
        labels = [os.path.join(*p[-k:]) for p in parts]
        if len(set(labels)) == len(labels):
            return labels
    return [f"{i}: {p}" for i, p in enumerate(paths)]


class _Progress:
    """A bar on a terminal, else a line every 10%."""

    def __init__(self, label: str):
        self.label, self.tty, self.start, self.shown = label, sys.stderr.isatty(), time.time(), -1

    def __call__(self, done: int, total: int) -> None:
        elapsed = time.time() - self.start
        rate = done / elapsed if elapsed > 0 else 0.0
        eta = (total - done) / rate if rate > 0 else 0.0
        text = f"{self.label}: {done}/{total} images, {rate:.1f} images/s, eta {eta:.0f}s"
        if self.tty:
            width = 30
            fill = int(width * done / total)
            print(f"\r[{'#' * fill}{'.' * (width - fill)}] {text}", end="\n" if done == total else "",
                  file=sys.stderr, flush=True)
        else:
            tenth = 10 * done // total
            if tenth > self.shown:
                self.shown = tenth
                print(text, file=sys.stderr, flush=True)


def _ijb(args) -> dict:
    import torch

    from ds_pfc.data.transforms import check_decoder
    from ds_pfc.eval import ijb
    target = args.target.upper()
    try:
        meta = ijb.read_meta(args.ijb, target)
        check_decoder(f"--ijb {args.ijb}")          # the loose crops: before any model is loaded
    except (FileNotFoundError, ValueError) as err:
        sys.exit(f"error: {err}")
    protocol = None
    if args.identification:
        from ds_pfc.eval import ijb_1n
        try:
            protocol = ijb_1n.read_identification(args.ijb, target)
        except (FileNotFoundError, ValueError) as err:
            sys.exit(f"error: {err}")
    num_genuine = int(meta.labels.sum())
    print(f"{target}: {meta.num_images} images, {int(torch.unique(meta.templates).numel())} templates, "
          f"{meta.num_pairs} pairs ({num_genuine} genuine, {meta.num_pairs - num_genuine} impostor)")
    out_dir = args.out or os.path.dirname(os.path.abspath(args.model[0]))
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, f"ijb_{target.lower()}")
    device = torch.device(args.device)
    labels = _labels(args.model)
    results, entries, identified = {}, [], {}
    for label, path in zip(labels, args.model):
        try:
            backbone, _, _ = _load_model(path, args)
        except (FileNotFoundError, ValueError, RuntimeError) as err:
            sys.exit(f"error: {err}")
        try:
            features = ijb.embed_images(backbone.to(device), meta, batch_size=args.batch_size,
                                        flip=not args.no_flip, device=device, num_workers=args.workers,
                                        progress=_Progress(label))
        except (FileNotFoundError, ValueError) as err:    # an image unreadable, an ONNX model refusing them
            sys.exit(f"error: {err}")
        r = ijb.evaluate(features, meta.templates, meta.medias, meta.pairs, meta.labels, faceness=meta.faceness,
                         use_norm_score=not args.no_norm_score, use_detector_score=not args.no_detector_score)
        results[label] = r
        entries.append({"label": label, "path": os.path.abspath(path), "sha256": _sha256(path),
                        "tar_at_far": {f"{k:g}": v for k, v in r.tar_at_far.items()},
                        "achieved_far": {f"{k:g}": v for k, v in r.achieved_far.items()}, "auc": r.auc})
        if protocol is not None:
            try:
                n = ijb_1n.identify(features, meta.templates, meta.medias, protocol, faceness=meta.faceness,
                                    use_norm_score=not args.no_norm_score,
                                    use_detector_score=not args.no_detector_score)
            except ValueError as err:
                sys.exit(f"error: {err}")
            identified[label] = n
            entries[-1]["identification"] = {
                "rank": {str(k): v for k, v in n.rank_rate.items()},
                "tpir_at_fpir": {f"{k:g}": v for k, v in n.tpir_at_fpir.items()},
                "threshold_at_fpir": {f"{k:g}": v for k, v in n.threshold_at_fpir.items()},
                "num_probes": n.num_probes, "num_gallery": n.num_gallery}
    fars = list(ijb.DEFAULT_FARS)
    header = f"{'model':<40} " + " ".join(f"{f:>8g}" for f in fars) + "      AUC"
    print(f"TAR (%) at FAR on {target}\n{header}")
    for label, r in results.items():
        print(f"{label[-40:]:<40} " + " ".join(f"{100 * r.tar_at_far[f]:8.2f}" for f in fars) + f"  {r.auc:.5f}")
    if identified:
        n0 = next(iter(identified.values()))
        cols = [f"rank-{k}" for k in n0.rank_rate] + [f"TPIR@{f:g}" for f in n0.tpir_at_fpir]
        print(f"1:N identification (%) on {target}: {n0.num_probes} probes, {n0.num_gallery} gallery templates\n"
              f"{'model':<40} " + " ".join(f"{c:>10}" for c in cols))
        for label, n in identified.items():
            vals = list(n.rank_rate.values()) + list(n.tpir_at_fpir.values())
            print(f"{label[-40:]:<40} " + " ".join(f"{100 * v:10.2f}" for v in vals))
    out = {"target": target, "root": os.path.abspath(args.ijb), "num_images": meta.num_images,
           "num_templates": int(torch.unique(meta.templates).numel()), "num_pairs": meta.num_pairs,
           "num_genuine": num_genuine,
           "settings": {"flip": not args.no_flip, "use_norm_score": not args.no_norm_score,
                        "use_detector_score": not args.no_detector_score, "batch_size": args.batch_size,
                        "image_size": 112, "fars": fars, "tar_rule": "nearest FPR (insightface)",
                        "roc": "sklearn roc_curve, drop_intermediate=True"},
           "models": entries}
    try:
        out["roc_png"] = ijb.plot_roc(results, stem + ".png", title=f"ROC on {target}", fars=fars)
    except RuntimeError as err:       # matplotlib missing: the numbers still count
        warnings.warn(f"no ROC plot: {err}", stacklevel=1)
        out["roc_png"] = None
    for path in [stem + ".json"] + ([args.json] if args.json else []):
        with open(path, "w") as f:
            json.dump(out, f, indent=1)
    print(f"wrote {stem}.json" + (f" and {out['roc_png']}" if out["roc_png"] else ""))
    return out


def _load_model(path: str, args):
    """``(model, config, kind)``; ``--network``/``--width`` go to the ``.pt`` models."""
    from ds_pfc.app.eval_models import load_model, model_kind
    pt = model_kind(path) == "arcface_torch"
    return load_model(path, network=args.network if pt else None, width=args.width if pt else 1.0, tag=args.tag,
                      device=args.device)


def _bin_sets(paths: list[str]) -> dict:
    """``name -> (uint8 images, issame)`` of each ``.bin`` (as the training app reads them)."""
    import torch

    from ds_pfc.data.transforms import decode_image
    from ds_pfc.eval.verification import load_bin
    sets = {}
    for path in paths:
        images, issame = load_bin(path, decode=decode_image)
        sets[os.path.splitext(os.path.basename(path))[0]] = (torch.stack(images), issame)
    return sets


def build_parser() -> argparse.ArgumentParser:
    p = parser("ds-pfc-eval", " ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--model", required=True, action="append",
                   help="an export .safetensors, a checkpoints directory, arcface_torch's model.pt (with --network) "
                        "or an .onnx file (several with --ijb: one ROC each)")
    p.add_argument("--network", default=None, help="arcface_torch's network name of a .pt model: r18 r34 r50 r100 "
                                                   "r200 mbf vit_t vit_s vit_b ...")
    p.add_argument("--width", type=float, default=1.0, help="with --network: the network's width multiplier")
    p.add_argument("--tag", default=None, help="checkpoint tag (default: latest)")
    p.add_argument("--bins", nargs="*", default=None, help="verification .bin files")
    p.add_argument("--ijb", default=None, metavar="ROOT", help="an IJB release (meta/ and loose_crop/)")
    p.add_argument("--target", default="IJBC", type=str.upper, choices=["IJBB", "IJBC"],
                   help="with --ijb: which IJB set to score, IJBB or IJBC (default IJBC)")
    p.add_argument("--batch_size", "--batch-size", dest="batch_size", type=int, default=64,
                   help="images per forward pass of the backbone (default 64)")
    p.add_argument("--no_flip", "--no-flip", dest="no_flip", action="store_true",
                   help="no flip test-time augmentation")
    p.add_argument("--no_norm_score", "--no-norm-score", dest="no_norm_score", action="store_true",
                   help="with --ijb: L2-normalise each image feature before pooling")
    p.add_argument("--no_detector_score", "--no-detector-score", dest="no_detector_score", action="store_true",
                   help="with --ijb: do not weight image features by the faceness score")
    p.add_argument("--identification", action="store_true",
                   help="with --ijb: also 1:N identification (meta/<target>_1N_gallery_*.csv, _1N_probe_mixed.csv)")
    p.add_argument("--workers", type=int, default=2, help="with --ijb: threads decoding and aligning images")
    p.add_argument("--out", default=None, help="with --ijb: output directory (default: the first model's)")
    p.add_argument("--device", default="cpu", help="the torch device that runs the backbone (default cpu)")
    p.add_argument("--json", default=None, help="also write the results here")
    return p


def run(argv=None) -> dict:
    p = build_parser()
    args = p.parse_args(argv)
    if args.batch_size < 1:
        p.error(f"--batch_size must be >= 1, got {args.batch_size}")
    from ds_pfc.app.eval_models import model_kind
    if (args.network is not None or args.width != 1.0) and \
            not any(model_kind(m) == "arcface_torch" for m in args.model):
        sys.exit(f"error: --network / --width are for arcface_torch .pt state dicts; no --model is one "
                 f"({', '.join(args.model)})")
    if args.identification and args.ijb is None:
        p.error("--identification is for --ijb")
    if args.ijb is not None:
        if args.bins is not None:
            p.error("--ijb and --bins exclude each other")
        if args.workers < 0:
            p.error(f"--workers must be >= 0, got {args.workers}")
        return _ijb(args)
    if len(args.model) > 1:
        p.error("several --model are for --ijb; evaluate pair sets one model at a time")
    args.model = args.model[0]

    import torch

    from ds_pfc.app.config import EvaluationConfig, split_config
    from ds_pfc.app.training import _format_eval, build_eval_sets, evaluate
    try:
        if args.bins:
            from ds_pfc.data.transforms import check_decoder
            check_decoder(f"--bins {args.bins[0]}")    # before the model is loaded
        backbone, config, _ = _load_model(args.model, args)
        if config is not None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                _, cfg = split_config(config, strict=False)
            if args.bins is not None:
                cfg.evaluation.bins = list(args.bins)
                cfg.evaluation.synthetic_pairs = 0
            sets, far = build_eval_sets(cfg), cfg.evaluation.far
        else:
            sets, far = _bin_sets(args.bins or []), EvaluationConfig().far
    except (FileNotFoundError, ValueError, RuntimeError) as err:
        sys.exit(f"error: {err}")
    if not sets:
        sys.exit("error: nothing to evaluate: pass --bins")
    device = torch.device(args.device)
    try:
        results = evaluate(backbone.to(device), sets, batch_size=args.batch_size, flip=not args.no_flip,
                           far=far, device=device, dtype=torch.float32)
    except ValueError as err:       # an ONNX model refusing the images' shape
        sys.exit(f"error: {err}")
    print(_format_eval(results))
    out = {name: {"accuracy": r.accuracy, "accuracy_std": r.accuracy_std,
                  "tar_at_far": {str(k): v for k, v in r.tar_at_far.items()}} for name, r in results.items()}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


def main(argv=None) -> int:
    """``ds-pfc-eval`` / ``launch/eval.py``: :func:`run`, exit status 0 (errors exit with ``error: ...``)."""
    run(argv)
    return 0


if __name__ == "__main__":     # python -m ds_pfc.cli.eval
    sys.exit(main())
