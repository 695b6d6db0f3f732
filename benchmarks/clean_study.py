"""Precision and recall of ``ds-pfc-clean`` against known corruptions.

A model is trained (the training app, in its own process) on identity features
(:mod:`ds_pfc.data.features`) corrupted by ``StressedDataset``: a share of the
identities split into pseudo-classes (duplicates with known truth) and a share of the
labels flipped. The trained backbone then embeds the training set, and the analysis of
:mod:`ds_pfc.app.cleaning` runs over a grid of thresholds; every finding is scored
against the corruption's ground truth. A test set of held-out images of some training
identities plus never-seen identities scores the overlap finding.

    PYTHONPATH=. python benchmarks/clean_study.py --out benchmarks/results/clean-features-cpu-2core.json
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

from ds_pfc.app.cleaning import (CleanSettings, _union_find, class_centres, embed_dataset,  # noqa: E402
                                 find_duplicates, find_flips, find_overlap, image_scores, load_run)
from ds_pfc.bench.grow import FEATURES, _train, base_config  # noqa: E402
from ds_pfc.data.features import IdentityFeatures  # noqa: E402
from ds_pfc.data.stress import StressedDataset  # noqa: E402

DUP_COS = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8)
EVIDENCE = (0.0, 0.3, 0.5, 0.7)
FLIP_MARGIN = (0.0, 0.05, 0.1, 0.2, 0.3)
OVERLAP_COS = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8)


def job(identities: int, images: int, steps: int, conflict: float, flip: float, sample_rate: float, seed: int):
    base = IdentityFeatures(identities, images, **{k: v for k, v in FEATURES.items()})
    stressed = StressedDataset(base, label_flip=flip, conflict=conflict, conflict_splits=2, seed=seed)
    config = base_config(n_old=stressed.num_classes, steps=steps, pairs=1000)
    pfc = config["ds_pfc"]
    pfc["description"] = "clean study: a stressed model (benchmarks/clean_study.py)"
    pfc["data"]["features"].update(identities=identities, images_per_identity=images)
    pfc["data"]["stress"] = {"label_flip": flip, "conflict": {"fraction": conflict, "splits": 2}, "seed": seed}
    pfc["head"]["sample_rate"] = sample_rate
    pfc["checkpoint"]["export"] = False
    return config, stressed


def pr(predicted: set, truth: set) -> dict:
    hit = len(predicted & truth)
    return {"precision": round(hit / len(predicted), 4) if predicted else None,
            "recall": round(hit / len(truth), 4) if truth else None, "predicted": len(predicted), "true": len(truth)}


def pairs_of(groups) -> set:
    return {(a, b) for g in groups for a in g for b in g if a < b}


def pair_stats(checkpoints: str, args) -> dict:
    """For a trained run: the cosines of the head's rows and of the centres for the
    true duplicate pairs against random pairs, and duplicate precision and recall at the
    defaults (are a person's two labels pushed apart when every class is a negative?)."""
    backbone, dataset, head_rows = load_run(checkpoints)
    emb, labels = embed_dataset(backbone, dataset, batch_size=1024)
    num_classes = dataset.num_classes
    identity = IdentityFeatures(args.identities, args.images, **FEATURES).labels()[dataset.base_indices()]
    class_identity = torch.full((num_classes,), -1, dtype=torch.int64)
    class_identity[dataset.true_labels()] = identity
    by_identity: dict[int, list[int]] = {}
    for c, i in enumerate(class_identity.tolist()):
        by_identity.setdefault(i, []).append(c)
    truth = pairs_of([g for g in by_identity.values() if len(g) > 1])
    sums, counts = class_centres(emb, labels, num_classes)
    _, _, other_class = image_scores(emb, labels, sums, counts)
    _, groups = find_duplicates(labels, sums, counts, other_class, CleanSettings(), head_rows)
    head = torch.nn.functional.normalize(head_rows[:, 0].double(), dim=1)
    centres = torch.nn.functional.normalize(sums, dim=1)
    a, b = (torch.tensor(v) for v in zip(*sorted(truth)))
    gen = torch.Generator().manual_seed(0)
    ra, rb = torch.randint(0, num_classes, (20000,), generator=gen), torch.randint(0, num_classes, (20000,),
                                                                                   generator=gen)
    other = ra != rb
    return {"head_cos_true_pairs": round(float((head[a] * head[b]).sum(1).mean()), 4),
            "head_cos_random_pairs": round(float((head[ra[other]] * head[rb[other]]).sum(1).mean()), 4),
            "centre_cos_true_pairs": round(float((centres[a] * centres[b]).sum(1).mean()), 4),
            "centre_cos_random_pairs": round(float((centres[ra[other]] * centres[rb[other]]).sum(1).mean()), 4),
            "duplicates_at_defaults": pr(pairs_of(groups), truth)}


def _q(values: torch.Tensor, *qs: float) -> dict:
    values = values.double()
    return {f"q{round(q * 100):02d}": round(float(values.quantile(q)), 4) for q in qs} if len(values) else {}


def diagnose(emb, labels, true, sums, dup_rows, truth_pairs, flipped_truth, own, other_cos, other_class,
             class_identity, test_emb, test_identity, overlap: int) -> dict:
    """What separates the true findings from the false ones at the defaults: image votes
    of true duplicate pairs against other candidates, where a flipped image sits (its
    own, mislabelled centre against its true one, as clean images sit), and the best
    test image of an overlapping class against the best unrelated test image of any class."""
    cand = {(r["class_a"], r["class_b"]): r for r in dup_rows}
    true_ev = torch.tensor([cand[p]["evidence"] for p in truth_pairs if p in cand])
    false_ev = torch.tensor([r["evidence"] for p, r in cand.items() if p not in truth_pairs and r["evidence"] > 0])
    counts = torch.bincount(labels, minlength=sums.shape[0])
    split = torch.tensor(sorted({c for p in truth_pairs for c in p}))
    unit = torch.nn.functional.normalize(emb.double(), dim=1)
    centres = torch.nn.functional.normalize(sums, dim=1)
    flipped = torch.tensor(sorted(flipped_truth))
    clean = torch.ones(len(labels), dtype=torch.bool)
    clean[flipped] = False
    missed = flipped[other_cos[flipped] < own[flipped]]          # flip_margin 0: the rule misses these
    cos = centres @ torch.nn.functional.normalize(test_emb.double(), dim=1).T
    same = class_identity[:, None] == test_identity[None, :]
    best_same = torch.where(same, cos, torch.full_like(cos, -2)).max(1).values[class_identity < overlap]
    best_other = torch.where(~same, cos, torch.full_like(cos, -2)).max(1).values[class_identity >= overlap]
    return {
        "images_per_split_label": round(float(counts[split].double().mean()), 2),
        "duplicates": {"true_pair_evidence": {"n": len(true_ev), "min": round(float(true_ev.min()), 4),
                                              **_q(true_ev, 0.1, 0.5)},
                       "other_candidate_evidence_above_0": {"n": len(false_ev), "max": round(float(false_ev.max()), 4)
                                                            if len(false_ev) else None, **_q(false_ev, 0.9, 0.99)}},
        "flips": {"flipped_own_loo_cos": _q(own[flipped], 0.1, 0.5, 0.9),
                  "flipped_cos_to_true_centre": _q((unit[flipped] * centres[true[flipped]]).sum(1), 0.05, 0.5),
                  "clean_cos_to_own_centre": _q((unit[clean] * centres[true[clean]]).sum(1), 0.01, 0.05, 0.5),
                  "missed": len(missed),
                  "missed_naming_true_class": int((other_class[missed] == true[missed]).sum()),
                  "missed_other_minus_own": _q(other_cos[missed] - own[missed], 0.1, 0.5, 0.9)},
        "overlap": {"overlap_class_best_same_identity_test_cos": {"min": round(float(best_same.min()), 4),
                                                                  **_q(best_same, 0.02, 0.5)},
                    "other_class_best_unrelated_test_cos": {"max": round(float(best_other.max()), 4),
                                                            **_q(best_other, 0.5, 0.9, 0.99)}}}


def throughput(num: int, dim: int, k: int = 8, threshold: float = 0.4) -> dict:
    """Seconds of one exact all-pairs top-k (``num`` x ``num`` cosines of ``dim`` values,
    float32, blocks of 4096) on this machine's torch threads, and the rate it implies."""
    from ds_pfc.core.neighbors import nearest
    rows = torch.nn.functional.normalize(torch.randn(num, dim, generator=torch.Generator().manual_seed(0)), dim=1)
    nearest(rows[:4096], rows[:4096], k, threshold=threshold)          # warm-up
    t0 = time.perf_counter()
    nearest(rows, rows, k, threshold=threshold, query_ids=torch.arange(num))
    seconds = time.perf_counter() - t0
    return {"classes": num, "dim": dim, "k": k, "threshold": threshold, "seconds": round(seconds, 2),
            "gflops_per_s": round(2 * num * num * dim / seconds / 1e9, 1), "threads": torch.get_num_threads()}


def study(args) -> dict:
    started = time.time()
    config, stressed = job(args.identities, args.images, args.steps, args.conflict, args.flip, 1.0, args.seed)
    work = args.work or tempfile.mkdtemp(prefix="clean-study-")
    done = os.path.join(work, "r1", "run", "summary.json")
    if args.work and os.path.isfile(done):          # the analysis again on a kept run
        with open(done) as f:
            summary = json.load(f)
    else:
        summary, _ = _train(config, os.path.join(work, "r1"), threads=args.threads)
    train_s = time.time() - started
    print(f"trained r=1.0 in {train_s:.0f} s", flush=True)
    checkpoints = os.path.join(work, "r1", "run", "checkpoints")
    backbone, dataset, head_rows = load_run(checkpoints)
    assert dataset.num_classes == stressed.num_classes
    t0 = time.time()
    emb, labels = embed_dataset(backbone, dataset, batch_size=1024)
    embed_s = time.time() - t0
    num_classes = dataset.num_classes
    true = dataset.true_labels()
    identity_of_item = IdentityFeatures(args.identities, args.images, **FEATURES).labels()[dataset.base_indices()]
    class_identity = torch.full((num_classes,), -1, dtype=torch.int64)
    class_identity[true] = identity_of_item
    by_identity: dict[int, list[int]] = {}
    for c, i in enumerate(class_identity.tolist()):
        by_identity.setdefault(i, []).append(c)
    truth_pairs = pairs_of([g for g in by_identity.values() if len(g) > 1])
    flipped_truth = set(torch.nonzero(labels != true).view(-1).tolist())

    t0 = time.time()
    sums, counts = class_centres(emb, labels, num_classes)
    own, other_cos, other_class = image_scores(emb, labels, sums, counts)
    score_s = time.time() - t0
    duplicates = []
    best_groups = None
    for evidence in EVIDENCE:
        for cos in DUP_COS:
            s = CleanSettings(duplicate_cos=cos, duplicate_evidence=evidence)
            t0 = time.time()
            rows, groups = find_duplicates(labels, sums, counts, other_class, s, head_rows)
            row = {"duplicate_cos": cos, "duplicate_evidence": evidence, "seconds": round(time.time() - t0, 3),
                   **pr(pairs_of(groups), truth_pairs)}
            duplicates.append(row)
            if cos == CleanSettings().duplicate_cos and evidence == CleanSettings().duplicate_evidence:
                best_groups, dup_rows = groups, rows
    # the field's rule: every candidate above the centre threshold, merged without evidence
    centre_only = []
    for cos in DUP_COS:
        rows, _ = find_duplicates(labels, sums, counts, other_class, CleanSettings(duplicate_cos=cos), head_rows)
        roots = _union_find(num_classes, [(r["class_a"], r["class_b"]) for r in rows])
        members: dict[int, list[int]] = {}
        for c in {c for r in rows for c in (r["class_a"], r["class_b"])}:
            members.setdefault(roots[c], []).append(c)
        centre_only.append({"duplicate_cos": cos, **pr(pairs_of(members.values()), truth_pairs)})
    group_of = torch.arange(num_classes)
    for g in best_groups:
        group_of[torch.tensor(g)] = g[0]
    # true-duplicate pairs vs other candidates: the head's own rows
    head_true = [r["head_cos"] for r in dup_rows if (r["class_a"], r["class_b"]) in truth_pairs]
    head_other = [r["head_cos"] for r in dup_rows if (r["class_a"], r["class_b"]) not in truth_pairs]
    centre_true = [r["centre_cos"] for r in dup_rows if (r["class_a"], r["class_b"]) in truth_pairs]
    flips = []
    for margin in FLIP_MARGIN:
        s = CleanSettings(flip_margin=margin)
        rows = find_flips(labels, own, other_cos, other_class, s, group_of)
        predicted = {r["image"] for r in rows if r["kind"] == "flip"}
        right = sum(1 for r in rows if r["kind"] == "flip" and r["image"] in flipped_truth
                    and class_identity[r["points_to"]] == class_identity[true[r["image"]]])
        flips.append({"flip_margin": margin, **pr(predicted, flipped_truth),
                      "points_to_true_identity": round(right / max(1, len(predicted & flipped_truth)), 4),
                      "outliers": sum(r["kind"] == "outlier" for r in rows)})
    # test overlap: held-out images of the first `overlap` identities, plus never-seen identities
    feats = IdentityFeatures(args.identities, args.images, **FEATURES)
    seen = torch.arange(args.overlap).repeat_interleave(2)
    numbers = torch.arange(args.images, args.images + 2).repeat(args.overlap)
    unseen = IdentityFeatures(args.unseen, 2, first_identity=args.identities, **FEATURES)
    test_images = torch.cat([feats._as_images(feats.vectors(seen, numbers)), unseen.get_batch(torch.arange(
        2 * args.unseen))[0]])

    class _Set(torch.utils.data.Dataset):
        def __len__(self):
            return len(test_images)

        def get_batch(self, index):
            return test_images[index], torch.zeros(len(index), dtype=torch.int64)
    test_emb, _ = embed_dataset(backbone, _Set(), batch_size=1024)
    overlap_truth = set(torch.nonzero(class_identity < args.overlap).view(-1).tolist())
    overlap = []
    for cos in OVERLAP_COS:
        rows = find_overlap(sums, test_emb, CleanSettings(overlap_cos=cos))
        overlap.append({"overlap_cos": cos, **pr({r["class"] for r in rows}, overlap_truth)})

    why = diagnose(emb, labels, true, sums, dup_rows, truth_pairs, flipped_truth, own, other_cos, other_class,
                   class_identity, test_emb, torch.cat([seen, torch.arange(args.identities, args.identities
                                                                           + args.unseen).repeat_interleave(2)]),
                   args.overlap)

    def stats(values):
        v = torch.tensor([float(x) for x in values]) if values else torch.zeros(0)
        return {"n": len(values), "mean": round(float(v.mean()), 4) if len(values) else None,
                "min": round(float(v.min()), 4) if len(values) else None}
    # the same data and steps at sample rate 0.1: the head's rows of a person's two labels
    t0 = time.time()
    config01, _ = job(args.identities, args.images, args.steps, args.conflict, args.flip, 0.1, args.seed)
    if not (args.work and os.path.isfile(os.path.join(work, "r01", "run", "summary.json"))):
        _train(config01, os.path.join(work, "r01"), threads=args.threads)
    head_finding = {"r=1.0": pair_stats(checkpoints, args),
                    "r=0.1": pair_stats(os.path.join(work, "r01", "run", "checkpoints"), args),
                    "seconds_r01": round(time.time() - t0, 1)}
    rate = throughput(args.rate_classes, 128)
    return {"benchmark": "clean-study", "date": time.strftime("%Y-%m-%d"),
            "machine": {"host": "2-core CPU VM", "platform": platform.platform(), "threads": args.threads},
            "versions": {"torch": torch.__version__, "python": platform.python_version()},
            "config": {"identities": args.identities, "images_per_identity": args.images, "steps": args.steps,
                       "conflict_fraction": args.conflict, "conflict_splits": 2, "label_flip": args.flip,
                       "seed": args.seed, "classes": num_classes, "images": len(labels),
                       "overlap_identities": args.overlap, "unseen_identities": args.unseen,
                       "features": FEATURES, "model": "mlp 2 x 256 -> 64, CosFace s 32 m 0.3, r = 1.0"},
            "train_summary": {k: summary[k] for k in summary if isinstance(summary[k], (int, float, str))},
            "defaults": {k: v for k, v in CleanSettings().__dict__.items()},
            "all_pairs_rate": rate,
            "duplicates": duplicates, "duplicates_centre_only": centre_only, "flips": flips, "overlap": overlap,
            "head_rows_r1_vs_r01": head_finding, "why": why,
            "head_rows_at_default": {"true_duplicate_pairs_head_cos": stats(head_true),
                                     "other_candidates_head_cos": stats(head_other),
                                     "true_duplicate_pairs_centre_cos": stats(centre_true)},
            "seconds": {"train": round(train_s, 1), "embed": round(embed_s, 2),
                        "centres_and_image_scores": round(score_s, 2),
                        "total": round(time.time() - started, 1)}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Precision and recall of ds-pfc-clean against known corruptions.")
    p.add_argument("--out", required=True, help="the JSON to write")
    p.add_argument("--identities", type=int, default=2000, help="identities before the conflict split")
    p.add_argument("--images", type=int, default=8, help="images per identity")
    p.add_argument("--steps", type=int, default=600, help="training steps")
    p.add_argument("--conflict", type=float, default=0.1, help="share of identities split in two")
    p.add_argument("--flip", type=float, default=0.05, help="share of labels flipped")
    p.add_argument("--overlap", type=int, default=100, help="training identities with images in the test set")
    p.add_argument("--unseen", type=int, default=400, help="never-seen identities in the test set")
    p.add_argument("--rate-classes", type=int, default=20000, help="classes of the all-pairs timing")
    p.add_argument("--seed", type=int, default=0, help="the corruption's seed")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the training run")
    p.add_argument("--work", default=None, help="where the run goes (default: a temporary folder)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    result = study(args)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    shown = ("all_pairs_rate", "duplicates_centre_only", "duplicates", "flips", "overlap", "head_rows_r1_vs_r01")
    print(json.dumps({k: result[k] for k in shown})[:6000])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
