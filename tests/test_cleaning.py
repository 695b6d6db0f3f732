"""``ds-pfc-clean`` (ds_pfc.app.cleaning, ds_pfc.cli.clean).

The analysis is checked on embeddings with planted truth (identities drawn on the
sphere, some split into two classes, some labels flipped) and its scores against a
float64 loop written here; the command on a 2-step training run of identity features,
its class map through the head growth a training run does, and its refusals."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from ds_pfc.app.cleaning import (CleanSettings, class_centres, clean_embeddings, find_overlap, image_scores,
                                 merge_label_spaces, plan_labels)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
D = 128


def _planted(num_identities=40, per=6, split=(3, 11, 17), flips=(5, 50, 101), seed=0, noise=0.35):
    """Unit embeddings of ``num_identities`` identities; identities in ``split`` get a
    second class (their last three images), appended after the others; the images in
    ``flips`` take the label of another identity's class. Returns the embeddings, the
    training labels, the class count, the duplicate class pairs and ``{image: true
    class}`` of the flips."""
    gen = torch.Generator().manual_seed(seed)
    proto = F.normalize(torch.randn(num_identities, D, generator=gen, dtype=torch.float64), dim=1)
    identity = torch.arange(num_identities).repeat_interleave(per)
    emb = F.normalize(proto[identity] + noise * torch.randn(len(identity), D, generator=gen,
                                                            dtype=torch.float64) / D ** 0.5, dim=1)
    labels = identity.clone()
    pairs = set()
    for n, i in enumerate(split):
        extra = num_identities + n
        labels[(identity == i).nonzero().view(-1)[per // 2:]] = extra
        pairs.add((i, extra))
    flipped = {}
    for j in flips:
        flipped[j] = int(labels[j])
        labels[j] = (int(labels[j]) + 7) % num_identities
        if labels[j] in split:
            labels[j] = (labels[j] + 1) % num_identities
    return emb.float(), labels, num_identities + len(split), pairs, flipped


def test_image_scores_match_a_float64_loop():
    emb, labels, num_classes, _, _ = _planted()
    sums, counts = class_centres(emb, labels, num_classes)
    own, other_cos, other_class = image_scores(emb, labels, sums, counts, block_rows=7)
    e = emb.double() / emb.double().norm(dim=1, keepdim=True)
    for i in range(0, len(labels), 5):
        rest = [j for j in range(len(labels)) if labels[j] == labels[i] and j != i]
        centre = e[rest].sum(0)
        assert abs(float(own[i]) - float(e[i] @ centre / centre.norm())) < 1e-5
        best, best_c = -2.0, -1
        for c in range(num_classes):
            if c != labels[i]:
                members = e[labels == c].sum(0)
                cos = float(e[i] @ members / members.norm())
                if cos > best:
                    best, best_c = cos, c
        assert int(other_class[i]) == best_c and abs(float(other_cos[i]) - best) < 1e-5


def test_finds_the_planted_duplicates_and_flips():
    emb, labels, num_classes, pairs, flipped = _planted()
    before = (emb.clone(), labels.clone())
    report = clean_embeddings(emb, labels, num_classes, CleanSettings(block_rows=16))
    assert torch.equal(emb, before[0]) and torch.equal(labels, before[1])
    assert {tuple(sorted(g)) for g in report.groups} == {tuple(sorted(p)) for p in pairs}
    # the kept id of a group is its class with the most images
    counts = torch.bincount(labels, minlength=num_classes)
    assert all(int(counts[g[0]]) == int(counts[g].max()) for g in map(torch.tensor, report.groups))
    found = {r["image"]: r["points_to"] for r in report.flips if r["kind"] == "flip"}
    assert set(found) == set(flipped)
    group_of = {c: g[0] for g in report.groups for c in g}
    assert all(found[i] == group_of.get(flipped[i], flipped[i]) for i in flipped)
    # cleaned labels: every image of a group carries the new id of the kept class; flips follow their identity
    new = report.new_labels
    for a, b in pairs:
        keep = group_of[a]
        assert set(new[(labels == a) | (labels == b)].tolist()) - {-1} <= {report.class_map[keep]} | {
            report.class_map[group_of.get(flipped[i], flipped[i])] for i in flipped}
    assert len(report.class_map) == num_classes - len(pairs)
    assert sorted(report.class_map.values()) == list(range(num_classes - len(pairs)))
    for i, true in flipped.items():
        assert int(new[i]) == report.class_map[group_of.get(true, true)]


def test_a_nearer_sibling_takes_the_votes_from_a_farther_candidate():
    """Class 0 (identity A) has two candidates above the threshold: class 1, the same
    identity, and class 2, another identity whose centre is closer than the threshold
    but farther than class 1's. Only (0, 1) is confirmed: the images name class 1."""
    gen = torch.Generator().manual_seed(3)
    a = F.normalize(torch.randn(D, generator=gen, dtype=torch.float64), dim=0)
    b = F.normalize(a + 1.2 * F.normalize(torch.randn(D, generator=gen, dtype=torch.float64), dim=0), dim=0)
    far = F.normalize(torch.randn(5, D, generator=gen, dtype=torch.float64), dim=1)
    protos = torch.stack([a, a, b, *far])
    labels = torch.arange(len(protos)).repeat_interleave(6)
    emb = F.normalize(protos[labels] + 0.2 * torch.randn(len(labels), D, generator=gen, dtype=torch.float64)
                      / D ** 0.5, dim=1).float()
    cos02 = float(a @ b)
    assert 0.4 < cos02 < 0.9
    report = clean_embeddings(emb, labels, len(protos), CleanSettings(duplicate_cos=0.3))
    pairs = {(r["class_a"], r["class_b"]): r for r in report.duplicate_pairs}
    assert (0, 2) in pairs and not pairs[(0, 2)]["confirmed"]
    assert pairs[(0, 1)]["confirmed"] and report.groups == [[0, 1]]
    # the centre threshold alone would have merged identity B into A; class 2's images all name
    # their nearest class, but no image of 0 or 1 names 2
    assert pairs[(0, 2)]["centre_cos"] >= 0.3 and pairs[(1, 2)]["centre_cos"] >= 0.3
    assert pairs[(1, 2)]["evidence_a_to_b"] == 0 and pairs[(0, 2)]["evidence_a_to_b"] == 0


def test_head_rows_are_the_second_signal():
    emb, labels, num_classes, pairs, _ = _planted()
    gen = torch.Generator().manual_seed(5)
    head = torch.randn(num_classes, 2, D, generator=gen)
    report = clean_embeddings(emb, labels, num_classes, head_rows=head)
    row = next(r for r in report.duplicate_pairs if (r["class_a"], r["class_b"]) in pairs)
    a, b = row["class_a"], row["class_b"]
    want = float((F.normalize(head[a].double(), dim=1) @ F.normalize(head[b].double(), dim=1).T).max())
    assert abs(row["head_cos"] - want) < 1e-5


def test_overlap_and_merge_against_planted_identities():
    emb, labels, num_classes, _, _ = _planted(split=(), flips=())
    sums, _ = class_centres(emb, labels, num_classes)
    gen = torch.Generator().manual_seed(9)
    fresh = F.normalize(torch.randn(30, D, generator=gen), dim=1)
    # test images: one image of identities 4 and 9 (near their centres), thirty unrelated
    test = torch.cat([emb[labels == 4][:1], emb[labels == 9][:1], fresh])
    hits = find_overlap(sums, test, CleanSettings(overlap_cos=0.8))
    assert {r["class"] for r in hits} == {4, 9}
    with pytest.raises(ValueError, match="test_embeddings must be"):
        find_overlap(sums, test[:, :5], CleanSettings())
    # a second dataset: identities 2 and 7 again (other images), plus two new ones
    second = F.normalize(torch.stack([sums[2], sums[7], fresh[0].double(), fresh[1].double()]).float()
                         + 0.01 * torch.randn(4, D, generator=gen), dim=1)
    rows = merge_label_spaces(sums, second.double(), CleanSettings(merge_cos=0.6))
    assert [r["merged_id"] for r in rows] == [2, 7, num_classes, num_classes + 1]


def test_plan_labels_drops_overlap_and_renumbers():
    labels = torch.tensor([0, 1, 2, 3, 4, 4, 3])
    new, class_map, group_of = plan_labels(labels, 5, [[3, 1]], [{"image": 0, "kind": "outlier", "points_to": -1}],
                                           drop_classes=[4])
    assert class_map == {0: 0, 2: 1, 3: 2}
    assert new.tolist() == [-1, 2, 1, 2, -1, -1, 2]
    assert group_of.tolist() == [0, 3, 2, 3, 4]


def test_bad_inputs_name_the_argument():
    emb, labels, num_classes, _, _ = _planted()
    with pytest.raises(ValueError, match="labels must lie in"):
        clean_embeddings(emb, labels, num_classes - 1)
    with pytest.raises(ValueError, match="labels must be int64"):
        clean_embeddings(emb, labels[:-1], num_classes)
    with pytest.raises(ValueError, match=f"head_rows must be \\[{num_classes}, {D}\\]"):
        clean_embeddings(emb, labels, num_classes, head_rows=torch.zeros(num_classes + 1, D))
    with pytest.raises(ValueError, match="test_embeddings"):
        clean_embeddings(emb, labels, num_classes, test_embeddings=torch.zeros(4, D),
                         test_labels=torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="duplicate_cos"):
        CleanSettings(duplicate_cos=1.5)
    with pytest.raises(ValueError, match="duplicate_evidence"):
        CleanSettings(duplicate_evidence=1.5)
    with pytest.raises(ValueError, match="neighbours"):
        CleanSettings(neighbours=0)


# -- the command on a trained run ----------------------------------------------------

@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 2-step training run of stressed identity features (a split identity, flips)."""
    from ds_pfc.bench.grow import base_config
    from ds_pfc.data.features import IdentityFeatures
    from ds_pfc.data.stress import StressedDataset
    from ds_pfc.bench.grow import FEATURES
    tmp = tmp_path_factory.mktemp("clean")
    stress = {"label_flip": 0.1, "conflict": {"fraction": 0.2, "splits": 2}, "seed": 1}
    classes = StressedDataset(IdentityFeatures(20, 6, **FEATURES), label_flip=0.1, conflict=0.2,
                              conflict_splits=2, seed=1).num_classes
    config = base_config(n_old=classes, steps=2, pairs=50)
    config["train_micro_batch_size_per_gpu"] = 16
    config["ds_pfc"]["data"]["features"].update(identities=20, images_per_identity=6)
    config["ds_pfc"]["data"]["stress"] = stress
    path = tmp / "job.json"
    path.write_text(json.dumps(config))
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "ds_pfc.cli.train", "--deepspeed_config", str(path),
                           "--output_dir", str(tmp / "run")], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp, classes


def test_command_writes_tables_labels_and_a_class_map_that_grows_a_head(run, capsys):
    from ds_pfc.app.grow import grow_head, read_class_map
    from ds_pfc.checkpoint.shards import merge_shards
    from ds_pfc.cli.clean import main
    from ds_pfc.core.head import PartialFC
    tmp, classes = run
    out = tmp / "clean"
    # a low duplicate threshold so that an untrained model merges classes: the map is not the identity
    assert main(["--model", str(tmp / "run" / "checkpoints"), "--out", str(out), "--duplicate-cos", "0.0",
                 "--duplicate-evidence", "0.3", "--sheets", "2"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["classes"] == classes and summary["images"] == 20 * 6
    labels = [int(v) for v in (out / "labels.txt").read_text().split()]
    assert len(labels) == 120 and summary["kept_images"] == sum(v >= 0 for v in labels)
    assert summary["kept_classes"] < classes and os.listdir(out / "sheets")
    old_ids, new_ids = read_class_map(str(out / "class_map.json"))
    assert len(old_ids) == summary["kept_classes"] and sorted(new_ids.tolist()) == list(range(len(new_ids)))
    assert set(labels) - {-1} == set(new_ids.tolist()) or set(labels) - {-1} <= set(new_ids.tolist())
    # the map in a training run's head growth: every kept class's row moves to its new id
    tag = os.path.join(tmp / "run" / "checkpoints", open(tmp / "run" / "checkpoints" / "latest").read().strip())
    old = merge_shards(tag)[0]["weight"]
    head = PartialFC(len(new_ids), old.shape[1], sample_rate=1.0, seed=3, optimizer="sgd", momentum=0.9)
    grow_head(head, tag, old_ids, new_ids)
    assert torch.equal(head.state_dict()["weight"][new_ids], old[old_ids])
    assert "classes kept" in capsys.readouterr().out
    pq = pytest.importorskip("pyarrow.parquet", reason="Parquet tables are written only when pyarrow is installed")
    with open(out / "duplicates.csv") as f:
        assert pq.read_table(out / "duplicates.parquet").num_rows == len(f.read().splitlines()) - 1


def _export_without_data(tmp_path):
    """An export whose job config names RecordIO data that is not there (an untrained
    backbone of the tiny app config: the refusal comes before any image)."""
    from safetensors.torch import save_file
    from ds_pfc.app.config import split_config
    from ds_pfc.checkpoint.export import EXPORT_FORMAT
    from test_train_app import TINY
    config = json.loads(json.dumps(TINY))
    config["ds_pfc"]["data"] = {"source": "recordio", "path": str(tmp_path / "gone" / "train.rec")}
    _, cfg = split_config(config, strict=False)
    state = cfg.backbone.build(cfg.head.embedding_size).state_dict()
    path = tmp_path / "model.safetensors"
    save_file({f"backbone.{k}": v.contiguous() for k, v in state.items()}, str(path),
              metadata={"format": EXPORT_FORMAT, "config": json.dumps(config)})
    return path


def test_command_refuses_a_run_without_its_data_and_bad_inputs(run, tmp_path, capsys):
    from ds_pfc.cli.clean import main
    tmp, _ = run
    moved = _export_without_data(tmp_path)
    assert main(["--model", str(moved), "--out", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "training data" in err and "--data" in err, err
    assert not (tmp_path / "o").exists()
    export = tmp / "run" / "export" / "model.safetensors"
    assert main(["--model", str(export), "--out", str(tmp_path / "o"), "--test", str(tmp_path / "no.bin")]) == 1
    assert "--test" in capsys.readouterr().err
    assert main(["--model", str(export), "--out", str(tmp_path / "o"), "--duplicate-cos", "2"]) == 1
    assert "duplicate_cos" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_command_checks_a_test_set_against_the_training_images(run, tmp_path, capsys):
    import io
    import pickle

    from PIL import Image

    from ds_pfc.bench.grow import write_pairs_bin
    from ds_pfc.cli.clean import main
    tmp, _ = run
    export = tmp / "run" / "export" / "model.safetensors"
    # held-out images of the training identities: the right size, scored
    good = write_pairs_bin(str(tmp_path / "held.bin"), first_identity=0, identities=20, pairs=10,
                           images_per_identity=6)
    assert main(["--model", str(export), "--out", str(tmp_path / "o"), "--test", good, "--overlap-cos", "-1",
                 "--sheets", "0"]) == 0
    with open(tmp_path / "o" / "overlap.csv") as f:
        assert len(f.read().splitlines()) == 1 + 24            # at cosine -1 every class matches
    # a test set of another image size
    buf = io.BytesIO()
    Image.new("RGB", (112, 112)).save(buf, format="PNG")
    with open(tmp_path / "big.bin", "wb") as f:
        pickle.dump(([buf.getvalue()] * 2, [True]), f)
    capsys.readouterr()
    assert main(["--model", str(export), "--out", str(tmp_path / "o2"), "--test", str(tmp_path / "big.bin")]) == 1
    err = capsys.readouterr().err
    assert "--test" in err and "(3, 112, 112)" in err and "(3, 1, 32)" in err, err
    assert not (tmp_path / "o2").exists()


def _second_dataset():
    """A second dataset: the images of every other planted class, relabelled in reverse
    order, and fresh identities far from every planted one."""
    emb, labels, num_classes, _, _ = _planted()
    keep = labels % 2 == 0
    kept = labels[keep] // 2
    fresh = torch.nn.functional.normalize(torch.randn(5, emb.shape[1], generator=torch.Generator().manual_seed(9)),
                                          dim=1)
    new = fresh.repeat_interleave(3, 0)
    classes_b = int(kept.max()) + 1 + 5
    labels_b = torch.cat([int(kept.max()) - kept, int(kept.max()) + 1 + torch.arange(5).repeat_interleave(3)])
    return torch.cat([emb[keep], new]), labels_b, classes_b


def _sharded_clean(rank, world_size):
    from ds_pfc.app.cleaning import clean_sharded
    emb, labels, num_classes, _, _ = _planted()
    index = torch.arange(rank, len(labels), world_size)          # a strided share per rank
    test = emb[labels == 4][:1]
    emb_b, labels_b, classes_b = _second_dataset()
    index_b = torch.arange(rank, len(labels_b), world_size)
    report = clean_sharded(emb[index], labels[index], index, num_classes, len(labels),
                           CleanSettings(block_rows=5), test_embeddings=test,
                           second=(emb_b[index_b], labels_b[index_b], index_b, classes_b, len(labels_b)))
    return {"groups": report.groups, "flips": sorted((r["image"], r["kind"], r["points_to"]) for r in report.flips),
            "class_map": report.class_map, "new_labels": report.new_labels, "overlap": report.overlap,
            "pairs": [(r["class_a"], r["class_b"], r["confirmed"]) for r in report.duplicate_pairs],
            "merge": [(r["class_b"], r["merged_id"], r["joined"]) for r in report.merge],
            "second_labels": report.second_labels}


@pytest.mark.parametrize("world_size", [2, 3])
def test_sharded_analysis_equals_the_single_process_one(world_size):
    from _dist import run_ranks
    emb, labels, num_classes, _, _ = _planted()
    second = _second_dataset()
    want = clean_embeddings(emb, labels, num_classes, CleanSettings(block_rows=5),
                            test_embeddings=emb[labels == 4][:1], second=second)
    assert want.groups and want.flips
    # The merge, against what the second dataset was built from: each kept class joins the
    # planted class it came from (unless that class has images elsewhere pulling its centre
    # away), the fresh identities do not join and get new ids after the first label space.
    emb_b, labels_b, classes_b = second
    joined = {r["class_b"]: r for r in want.merge}
    fresh = range(classes_b - 5, classes_b)
    assert all(not joined[c]["joined"] and joined[c]["merged_id"] >= num_classes for c in fresh)
    assert len({joined[c]["merged_id"] for c in fresh}) == 5
    kept_max = classes_b - 6
    assert sum(joined[c]["joined"] and joined[c]["merged_id"] == 2 * (kept_max - c) for c in range(kept_max + 1)) \
        >= (kept_max + 1) // 2
    for got in run_ranks(_sharded_clean, world_size):
        assert got["merge"] == [(r["class_b"], r["merged_id"], r["joined"]) for r in want.merge]
        assert torch.equal(got["second_labels"], want.second_labels)
        assert got["groups"] == want.groups
        assert got["flips"] == sorted((r["image"], r["kind"], r["points_to"]) for r in want.flips)
        assert got["class_map"] == want.class_map and torch.equal(got["new_labels"], want.new_labels)
        assert got["overlap"] == want.overlap
        assert sorted(got["pairs"]) == sorted((r["class_a"], r["class_b"], r["confirmed"])
                                              for r in want.duplicate_pairs)


def _clean_command_rank(rank, world_size, model, out, extra=()):
    from ds_pfc.cli.clean import main
    return main(["--model", model, "--out", out, "--duplicate-cos", "0.0", "--duplicate-evidence", "0.3",
                 "--sheets", "0", *extra])


def test_command_merges_a_second_dataset(run, tmp_path):
    """The run's own job as the second dataset: its classes join themselves, and its images
    carry the ids they join."""
    from ds_pfc.cli.clean import main
    tmp, classes = run
    assert main(["--model", str(tmp / "run" / "checkpoints"), "--out", str(tmp_path / "m"), "--second",
                 str(tmp / "job.json"), "--merge-cos", "0.99", "--sheets", "0"]) == 0
    import csv
    with open(tmp_path / "m" / "merge.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == classes
    assert all(r["joined"] == "True" and int(r["merged_id"]) == int(r["class_b"]) for r in rows)
    second = [int(v) for v in (tmp_path / "m" / "second_labels.txt").read_text().split()]
    assert second == [int(v) for v in _stressed_labels()]
    assert main(["--model", str(tmp / "run" / "checkpoints"), "--out", str(tmp_path / "m2"), "--second",
                 str(tmp_path / "none.json")]) == 1


def _stressed_labels():
    from ds_pfc.bench.grow import FEATURES
    from ds_pfc.data.features import IdentityFeatures
    from ds_pfc.data.stress import StressedDataset
    return StressedDataset(IdentityFeatures(20, 6, **FEATURES), label_flip=0.1, conflict=0.2, conflict_splits=2,
                           seed=1).labels().tolist()


def test_command_on_ranks_writes_what_one_process_writes(run, tmp_path):
    """Three ranks write what one process writes, a merged second dataset included."""
    from _dist import run_ranks
    from ds_pfc.cli.clean import main
    tmp, _ = run
    model = str(tmp / "run" / "checkpoints")
    assert main(["--model", model, "--out", str(tmp_path / "one"), "--duplicate-cos", "0.0",
                 "--duplicate-evidence", "0.3", "--sheets", "0", "--impl", "torch",
                 "--second", str(tmp / "job.json"), "--merge-cos", "0.99"]) == 0
    assert run_ranks(_clean_command_rank, 3, model, str(tmp_path / "three"),
                     ["--impl", "torch", "--second", str(tmp / "job.json"), "--merge-cos", "0.99"]) == [0, 0, 0]
    for name in ("labels.txt", "class_map.json", "images.csv", "merge.csv", "second_labels.txt"):
        assert (tmp_path / "one" / name).read_text() == (tmp_path / "three" / name).read_text(), name
    one = json.loads((tmp_path / "one" / "summary.json").read_text())
    three = json.loads((tmp_path / "three" / "summary.json").read_text())
    assert one == three and one["duplicate_groups"] > 0


@pytest.mark.skipif(importlib.util.find_spec("triton") is None
                    or not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
                    reason="the fused kernel needs CUDA or Triton's interpreter (TRITON_INTERPRET=1)")
def test_the_fused_kernel_gives_the_same_report():
    emb, labels, num_classes, _, _ = _planted()
    want = clean_embeddings(emb, labels, num_classes, CleanSettings(block_rows=50, impl="torch"))
    got = clean_embeddings(emb, labels, num_classes, CleanSettings(block_rows=50, impl="triton"))
    assert got.groups == want.groups and got.class_map == want.class_map
    assert [r["image"] for r in got.flips] == [r["image"] for r in want.flips]
    assert torch.equal(got.new_labels, want.new_labels)


@pytest.mark.skipif(importlib.util.find_spec("faiss") is None,
                    reason="impl='faiss' needs the optional faiss-cpu package (pip install ds_pfc[faiss])")
@pytest.mark.parametrize("impl", ["faiss", "auto"])
def test_faiss_gives_the_same_report(impl):
    emb, labels, num_classes, _, _ = _planted()
    want = clean_embeddings(emb, labels, num_classes, CleanSettings(block_rows=50, impl="torch"))
    got = clean_embeddings(emb, labels, num_classes, CleanSettings(block_rows=50, impl=impl))
    assert got.groups == want.groups and got.class_map == want.class_map and got.groups
    assert [r["image"] for r in got.flips] == [r["image"] for r in want.flips]
    assert torch.equal(got.new_labels, want.new_labels)
