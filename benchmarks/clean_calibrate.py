"""Thresholds of ``ds-pfc-clean`` chosen on one study run and scored on another.

``benchmarks/clean_study.py`` scores every finding over a grid of thresholds on one
corrupted training set; reading the best grid point off that same run would flatter
it. Here the thresholds are chosen on a *calibration* run (another corruption seed:
other identities split, other labels flipped, another model trained) by a fixed rule,
and only then looked up in the *scored* run:

* duplicates: the grid point of highest recall among those with precision >= the
  duplicate precision target (ties: the higher evidence share, which does not chain look-alikes, then the
  lower cosine);
* flips: the margin of highest recall among those with precision >= the flip precision
  target (ties: the lower margin);
* test overlap: the highest cosine whose recall is >= the overlap recall target.

    PYTHONPATH=. python benchmarks/clean_calibrate.py --calibration CAL.json --scored SCORED.json --out OUT.json
"""
from __future__ import annotations

import argparse
import json

TARGETS = {"duplicates": {"precision": 0.99, "recall": 0.95}, "flips": {"precision": 0.95, "recall": 0.90},
           "overlap": {"recall": 0.99}}


def choose(cal: dict) -> dict:
    """The thresholds the rule of the module docstring picks on a study JSON ``cal``."""
    p_dup, p_flip, r_over = (TARGETS["duplicates"]["precision"], TARGETS["flips"]["precision"],
                             TARGETS["overlap"]["recall"])
    dup = [r for r in cal["duplicates"] if (r["precision"] or 0) >= p_dup]
    flip = [r for r in cal["flips"] if (r["precision"] or 0) >= p_flip]
    over = [r for r in cal["overlap"] if (r["recall"] or 0) >= r_over]
    if not (dup and flip and over):
        raise ValueError("calibration: no grid point meets a precision / recall target "
                         f"(duplicates {len(dup)}, flips {len(flip)}, overlap {len(over)} candidates)")
    d = max(dup, key=lambda r: (r["recall"], r["duplicate_evidence"], -r["duplicate_cos"]))
    f = max(flip, key=lambda r: (r["recall"], -r["flip_margin"]))
    o = max(over, key=lambda r: r["overlap_cos"])
    return {"duplicate_cos": d["duplicate_cos"], "duplicate_evidence": d["duplicate_evidence"],
            "flip_margin": f["flip_margin"], "overlap_cos": o["overlap_cos"]}


def score(doc: dict, chosen: dict) -> dict:
    """The scored run's rows at the chosen thresholds, and whether each target is met."""
    dup = next(r for r in doc["duplicates"] if r["duplicate_cos"] == chosen["duplicate_cos"]
               and r["duplicate_evidence"] == chosen["duplicate_evidence"])
    flip = next(r for r in doc["flips"] if r["flip_margin"] == chosen["flip_margin"])
    over = next(r for r in doc["overlap"] if r["overlap_cos"] == chosen["overlap_cos"])
    out = {}
    for name, row in (("duplicates", dup), ("flips", flip), ("overlap", over)):
        met = all((row[k] or 0) >= v for k, v in TARGETS[name].items())
        out[name] = {"precision": row["precision"], "recall": row["recall"], "predicted": row["predicted"],
                     "true": row["true"], "targets": TARGETS[name], "met": met}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Choose ds-pfc-clean's thresholds on one study run, score another.")
    p.add_argument("--calibration", required=True, help="the study JSON the thresholds are chosen on")
    p.add_argument("--scored", required=True, help="the study JSON they are scored on")
    p.add_argument("--out", required=True, help="the JSON to write")
    args = p.parse_args(argv)
    with open(args.calibration) as f:
        cal = json.load(f)
    with open(args.scored) as f:
        doc = json.load(f)
    chosen = choose(cal)
    result = {"benchmark": "clean-calibrated", "calibration": args.calibration, "scored": args.scored,
              "calibration_config": cal["config"], "scored_config": doc["config"], "rule": __doc__.split("\n\n")[1],
              "chosen": chosen, "on_calibration": score(cal, chosen), "on_scored": score(doc, chosen),
              "machine": doc["machine"], "versions": doc["versions"], "date": doc["date"]}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: result[k] for k in ("chosen", "on_scored")}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
