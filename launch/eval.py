"""1:1 verification of a trained backbone on insightface .bin pair sets.

    python launch/eval.py --model runs/x/export/model.safetensors --bins lfw.bin cfp_fp.bin agedb_30.bin
    python launch/eval.py --model runs/x/checkpoints            # the latest checkpoint

Flip test-time augmentation, 10-fold accuracy with threshold selection on the other
folds, TAR at FAR 1e-4 and 1e-6 (NaN where a set has too few impostor pairs).
Without ``--bins`` a synthetic-data model is evaluated on its held-out identities.
Decoding the images of a .bin needs torchvision or Pillow.
"""
from __future__ import annotations

import argparse
import json
import sys
import warnings

import _common  # noqa: F401


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="an export .safetensors or a checkpoints directory")
    p.add_argument("--tag", default=None, help="checkpoint tag (default: latest)")
    p.add_argument("--bins", nargs="*", default=None, help="verification .bin files")
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--no_flip", action="store_true", help="no flip test-time augmentation")
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)

    import torch

    from ds_pfc.config import split_config
    from ds_pfc.export import load_backbone
    from ds_pfc.training import _format_eval, build_eval_sets, evaluate
    try:
        backbone, config = load_backbone(args.model, args.tag)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _, cfg = split_config(config)
        if args.bins is not None:
            cfg.evaluation.bins = list(args.bins)
            cfg.evaluation.synthetic_pairs = 0
        sets = build_eval_sets(cfg)
    except (FileNotFoundError, ValueError, RuntimeError) as err:
        sys.exit(f"error: {err}")
    if not sets:
        sys.exit("error: nothing to evaluate: pass --bins")
    device = torch.device(args.device)
    results = evaluate(backbone.to(device), sets, batch_size=args.batch_size, flip=not args.no_flip,
                       far=cfg.evaluation.far, device=device, dtype=torch.float32)
    print(_format_eval(results))
    out = {name: {"accuracy": r.accuracy, "accuracy_std": r.accuracy_std,
                  "tar_at_far": {str(k): v for k, v in r.tar_at_far.items()}} for name, r in results.items()}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
