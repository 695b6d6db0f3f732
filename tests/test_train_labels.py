"""Training on a label file (``ds_pfc.data.labels``, the ``labels.txt`` of ``ds-pfc-clean``):
the file read and checked, the dataset it keeps, every rank's shard of it, and the round
trip train -> clean (its own writer) -> retrain with the labels and the grown head."""
from __future__ import annotations

import copy
import json
import os

import pytest
import torch

from _dist import one_process_world, run_ranks

from ds_pfc.app.config import ConfigError, split_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IDS, PER_ID = 21, 5                   # 105 images: odd sizes


def _write_labels(path, values) -> str:
    with open(path, "w") as f:
        f.write("".join(f"{v}\n" for v in values))
    return str(path)


def _job(labels=None, num_classes=IDS, steps=4, micro=8) -> dict:
    """A tiny identity-features job of the app (mlp backbone, CPU)."""
    from ds_pfc.app.experiments import features_config
    config = features_config(IDS, quick=True)
    config["train_micro_batch_size_per_gpu"] = micro
    pfc = config["ds_pfc"]
    pfc["head"]["num_classes"] = num_classes
    pfc["backbone"]["options"].update(hidden=32)
    pfc["head"]["embedding_size"] = 16
    pfc["data"]["features"].update(identities=IDS, images_per_identity=PER_ID, held_out_identities=10)
    pfc["train"].update(max_steps=steps, log_every=1)
    pfc["evaluation"].update(every_steps=0, synthetic_pairs=20, at_start=False)
    pfc["checkpoint"] = {"every_steps": 0, "keep": 0, "export": False}
    if labels is not None:
        pfc["data"]["labels"] = labels
    return config


def _base_features():
    """The job's images and their own labels, from the feature set itself (no label file)."""
    data = split_config(_job())[1].data.features.build()
    images, labels = data.get_batch(torch.arange(len(data)))
    return images.float(), labels


def _plan(base_labels):
    """Cleaned labels and class map as ``ds-pfc-clean`` plans them (its own functions): a
    pair and a triple merged, a class dropped (test overlap), one image flipped to
    another class, one outlier dropped."""
    from ds_pfc.app.cleaning import plan_labels
    flips = [{"image": 7, "kind": "flip", "points_to": 9}, {"image": 40, "kind": "outlier", "points_to": -1},
             {"image": 52, "kind": "flip", "points_to": 12}]
    return plan_labels(base_labels, IDS, [[3, 17], [10, 11, 12]], flips, drop_classes=[15])


def _write_clean_outputs(directory, base_labels):
    from ds_pfc.app.cleaning import CleanReport, CleanSettings, write_report
    new_labels, class_map, _ = _plan(base_labels)
    report = CleanReport(num_images=len(base_labels), num_classes=IDS, settings=CleanSettings(),
                         new_labels=new_labels, class_map=class_map)
    paths = write_report(report, str(directory), sheets=0)
    return paths["labels.txt"], paths["class_map.json"]


# ------------------------------------------------------------------ the file and the dataset
def test_read_labels_and_the_kept_set_match_a_python_loop(tmp_path):
    from ds_pfc.data import RelabelledDataset, SyntheticFaces, read_labels
    from ds_pfc.data.stress import StressedDataset
    base = StressedDataset(SyntheticFaces(7, 3, image_size=16, seed=1), label_flip=0.2, seed=3)
    values = [(-1 if i % 4 == 1 else (5 * i) % 9) for i in range(len(base))]
    path = tmp_path / "labels.txt"
    path.write_text("".join(f"  {v} \n" for v in values) + "\n\n")        # spaces and trailing blank lines
    labels, digest = read_labels(str(path), len(base))
    import hashlib
    assert digest == hashlib.sha256(path.read_bytes()).hexdigest()
    data = RelabelledDataset(base, labels, digest=digest)
    kept = [i for i, v in enumerate(values) if v != -1]
    assert len(data) == len(kept) and data.dropped == len(values) - len(kept)
    assert data.num_classes == max(values) + 1
    assert data.labels().tolist() == [values[i] for i in kept]
    assert data.base_indices().tolist() == kept
    for j in (0, 3, len(kept) - 1):
        image, label = data[j]
        assert label == values[kept[j]] and torch.equal(image, base[kept[j]][0])
    items = data.__getitems__([4, 0, 2])
    assert [lab for _, lab in items] == [values[kept[j]] for j in (4, 0, 2)]
    for (image, _), j in zip(items, (4, 0, 2)):
        assert torch.equal(torch.as_tensor(image), base[kept[j]][0])
    with pytest.raises(IndexError):
        data[len(kept)]


@pytest.mark.parametrize("content,needle", [
    ("0\n1\n", "has 2 labels but the training set has 3 images"),
    ("0\n1\n2\n3\n", "has 4 labels but the training set has 3 images"),
    ("0\nx\n1\n", "line 2 is 'x', not an integer label"),
    ("0\n1.5\n1\n", "line 2 is '1.5', not an integer label"),
    ("0\n-2\n1\n", "line 2 is -2; a label is a class id >= 0, or -1"),
    ("-1\n-1\n-1\n", "leaves out every image"),
])
def test_a_bad_label_file_is_refused_naming_the_argument(tmp_path, content, needle):
    from ds_pfc.data import read_labels
    path = tmp_path / "labels.txt"
    path.write_text(content)
    with pytest.raises(ValueError) as err:
        read_labels(str(path), 3, name="ds_pfc.data.labels")
    assert str(err.value).startswith("ds_pfc.data.labels: ") and needle in str(err.value)


def test_the_config_key_is_checked_naming_it(tmp_path):
    from ds_pfc.app.datasets import build_train_set
    _, base_labels = _base_features()
    good = _write_labels(tmp_path / "good.txt", _plan(base_labels)[0].tolist())
    classes = int(_plan(base_labels)[0].max()) + 1
    with pytest.raises(ConfigError, match="ds_pfc.data.labels: no such file"):
        split_config(_job(labels=str(tmp_path / "missing.txt"), num_classes=classes))
    no_ids = _job(labels=good, num_classes=classes)
    del no_ids["ds_pfc"]["data"]["features"]["identities"]
    with pytest.raises(ConfigError, match="ds_pfc.data.features.identities must be set with ds_pfc.data.labels"):
        split_config(no_ids)
    with pytest.raises(ConfigError, match=rf"ds_pfc.data.labels: .* \({classes} classes\) but "
                                          rf"ds_pfc.head.num_classes is {classes + 1}"):
        build_train_set(split_config(_job(labels=good, num_classes=classes + 1))[1])
    short = _write_labels(tmp_path / "short.txt", _plan(base_labels)[0].tolist()[:-1])
    with pytest.raises(ConfigError, match=f"ds_pfc.data.labels: .* has {IDS * PER_ID - 1} labels but the "
                                          f"training set has {IDS * PER_ID} images"):
        build_train_set(split_config(_job(labels=short, num_classes=classes))[1])
    bad = _write_labels(tmp_path / "bad.txt", ["-3"] + _plan(base_labels)[0].tolist()[1:])
    with pytest.raises(ConfigError, match="ds_pfc.data.labels: .* line 1 is -3"):
        build_train_set(split_config(_job(labels=bad, num_classes=classes))[1])
    synthetic = copy.deepcopy(_job())
    synthetic["ds_pfc"] = {"head": {"num_classes": 4}, "data": {"labels": good}}
    with pytest.raises(ConfigError, match="ds_pfc.data.synthetic.identities must be set"):
        split_config(synthetic)


def _rank_batches(rank, world_size, config):
    """This rank's epoch through the app's data path: the training set the app builds,
    its sampler (as Trainer.setup makes it) and the loader."""
    from ds_pfc.app.datasets import build_train_set
    from ds_pfc.data import DistributedIdentitySampler, MicroBatchLoader
    _, cfg = split_config(config)
    data = build_train_set(cfg)
    micro = config["train_micro_batch_size_per_gpu"]
    sampler = DistributedIdentitySampler(len(data), rank=rank, world_size=world_size, seed=cfg.data.seed,
                                         shuffle=cfg.data.shuffle, drop_last=True, block_size=micro)
    sampler.set_epoch(1)
    batches = list(MicroBatchLoader(data, sampler, flip=cfg.data.flip, seed=cfg.data.seed, workers=0))
    return torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])


def _base_index_of(images, base_images):
    """The base image each loaded image is: the one it equals after the loader's
    normalisation, exactly."""
    from ds_pfc.data.transforms import normalize
    reference = normalize(base_images).reshape(len(base_images), -1)
    equal = (images.reshape(len(images), 1, -1) == reference.unsqueeze(0)).all(-1)      # [loaded, base]
    assert equal.sum(1).tolist() == [1] * len(images)
    return equal.int().argmax(1)


@pytest.mark.parametrize("world_size", [1, 3])
def test_every_rank_sees_the_file_labels_and_never_a_dropped_image(tmp_path, world_size):
    base_images, base_labels = _base_features()
    new_labels = _plan(base_labels)[0]
    path = _write_labels(tmp_path / "labels.txt", new_labels.tolist())
    config = _job(labels=path, num_classes=int(new_labels.max()) + 1, micro=4)
    results = run_ranks(_rank_batches, world_size, config)
    seen = []
    for images, labels in results:
        index = _base_index_of(images, base_images)
        assert torch.equal(labels, new_labels[index])                     # the file's label of that image
        assert bool((new_labels[index] >= 0).all())                      # no image marked -1
        seen += index.tolist()
    kept = int((new_labels >= 0).sum())
    assert len(seen) == len(set(seen))                                     # the shards are disjoint
    assert len(seen) == kept // (4 * world_size) * 4 * world_size          # drop_last: the rest of the epoch


# ------------------------------------------------------------------ the round trip through the app
def test_train_clean_retrain_round_trip(tmp_path):
    """A first run; labels.txt and class_map.json written by the cleaning tool's writer
    from its own plan; a second run with the labels and the head grown by the map: the
    head receives exactly the file's labels, the kept classes' rows are the old rows
    through the map, bitwise, and it trains."""
    pytest.importorskip("deepspeed")
    from _inprocess import one_thread, train_here

    from ds_pfc.app.training import Trainer
    base_images, base_labels = _base_features()
    first = tmp_path / "first"
    job = tmp_path / "first.json"
    job.write_text(json.dumps(_job()))
    train_here(["--deepspeed_config", str(job), "--output_dir", str(first)])
    labels_path, map_path = _write_clean_outputs(tmp_path / "clean", base_labels)
    new_labels = torch.tensor([int(v) for v in open(labels_path).read().split()])
    class_map = {int(k): v for k, v in json.load(open(map_path)).items()}
    classes = len(class_map)
    assert classes == int(new_labels.max()) + 1 == IDS - 4

    config = _job(labels=labels_path, num_classes=classes, steps=5)
    config["ds_pfc"]["train"]["init"] = {"head": str(first / "checkpoints"), "class_map": map_path}
    seen_images, seen_labels = [], []
    with one_process_world(), one_thread():
        trainer = Trainer(copy.deepcopy(config), output_dir=str(tmp_path / "second"))
        trainer.setup()
        grown = trainer.head.centers()
        backbone = trainer.engine.engine.module
        backbone.register_forward_pre_hook(lambda m, args: seen_images.append(args[0].detach().clone())
                                           if m.training else None)
        trainer.head.register_forward_pre_hook(lambda m, args: seen_labels.append(args[1].clone()))
        summary = trainer.run()
    # (a) the labels the head received are the file's labels of the images it received
    images, labels = torch.cat(seen_images), torch.cat(seen_labels)
    assert len(labels) == 5 * 8
    index = _base_index_of(images, base_images)
    assert torch.equal(labels, new_labels[index])
    assert bool((new_labels[index] >= 0).all())
    # (b) the grown head's kept rows are the first run's rows through the map, bitwise
    from safetensors.torch import load_file
    tag = open(first / "checkpoints" / "latest").read().strip()
    shards = [load_file(str(first / "checkpoints" / tag / n)) for n in sorted(os.listdir(first / "checkpoints" / tag))
              if n.startswith("head-rank")]
    old = torch.cat([s["weight"] for s in shards])
    assert old.shape == (IDS, 16)
    for o, n in class_map.items():
        assert torch.equal(grown[n], old[o]), (o, n)
    # (c) it trains
    assert trainer.engine.global_steps == 5 and len(summary["losses"]) == 5
    assert all(torch.isfinite(torch.tensor(summary["losses"])))

    # A resume with another label file at the same path is refused, naming the key.
    changed = new_labels.clone()
    changed[0] = -1
    _write_labels(labels_path, changed.tolist())
    with one_process_world(), one_thread():
        trainer = Trainer(copy.deepcopy(config), output_dir=str(tmp_path / "second"), max_steps=6)
        with pytest.raises(ConfigError, match="ds_pfc.data.labels: this job trains on the label file"):
            trainer.run()
    # Allowed, the next epoch starts from its start on the new labels.
    lines = []
    with one_process_world(), one_thread():
        trainer = Trainer(copy.deepcopy(config), output_dir=str(tmp_path / "second"), max_steps=6,
                          allow_config_change=True, log=lines.append)
        summary = trainer.run()
    assert summary["resumed"] and trainer.engine.global_steps == 6 and trainer.sampler.epoch == 1
    assert any("training continues with epoch 1 from its start" in line for line in lines), lines[-10:]


def test_two_ranks_train_on_the_labels(tmp_path):
    """The train command on 2 gloo ranks with a label file: it trains and says what it kept."""
    pytest.importorskip("deepspeed")
    from test_train_app import _forked
    _, base_labels = _base_features()
    new_labels = _plan(base_labels)[0]
    path = _write_labels(tmp_path / "labels.txt", new_labels.tolist())
    job = tmp_path / "job.json"
    job.write_text(json.dumps(_job(labels=path, num_classes=int(new_labels.max()) + 1, micro=4)))
    out = _forked(["--deepspeed_config", str(job), "--output_dir", str(tmp_path / "run")], 2)
    kept = int((new_labels >= 0).sum())
    assert f"labels from {path}: {kept} of {IDS * PER_ID} images kept" in out
    with open(tmp_path / "run" / "summary.json") as f:
        summary = json.load(f)
    assert summary["steps"] == 4 and all(torch.isfinite(torch.tensor(summary["losses"])))


def test_a_recordio_set_keeps_its_encoded_images_and_takes_the_file_labels(tmp_path, monkeypatch):
    """RecordIO (encoded images, read by record): the kept records' payloads, untouched
    (so ``data.decode: cuda`` still receives JPEG bytes), with the file's labels."""
    from _recordio_writers import ir_pack, write_rec

    def fake_image(k):           # a JPEG marker, then bytes of the record's own
        return b"\xff\xd8\xff" + bytes((k * 7 + j) % 251 for j in range(4 + 3 * k))

    from ds_pfc.app.datasets import build_train_set
    from ds_pfc.data.loader import _fetch
    from ds_pfc.data.recordio import InsightFaceRecord
    monkeypatch.setenv("DS_PFC_CACHE_DIR", str(tmp_path / "cache"))
    own = [k % 5 for k in range(23)]
    rec, _, _ = write_rec(tmp_path, [(k, ir_pack(float(c), fake_image(k), id1=k)) for k, c in enumerate(own)])
    values = [(-1 if k in (0, 6, 22) else (3 * k) % 4) for k in range(23)]
    path = _write_labels(tmp_path / "labels.txt", values)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "ds_pfc": {"head": {"num_classes": 4}, "data": {"source": "recordio", "path": rec, "labels": path},
                         "train": {"output_dir": str(tmp_path / "run")}}}
    data = build_train_set(split_config(config)[1])
    kept = [k for k, v in enumerate(values) if v != -1]
    assert len(data) == 20 and data.labels().tolist() == [values[k] for k in kept]
    base = InsightFaceRecord(rec, cache=False)
    images, labels = _fetch(data, torch.tensor([0, 5, 19]), keep_jpeg=True)
    assert labels.tolist() == [values[kept[j]] for j in (0, 5, 19)]
    for image, j in zip(images, (0, 5, 19)):
        assert image.dim() == 1 and bytes(image.tolist()) == bytes(base[kept[j]][0])
    config["ds_pfc"]["head"]["num_classes"] = 5
    with pytest.raises(ConfigError, match=r"ds_pfc.data.labels: .* \(4 classes\) but ds_pfc.head.num_classes is 5"):
        build_train_set(split_config(config)[1])


def test_an_image_folder_under_stress_is_relabelled_after_the_stress(tmp_path):
    """hf source (an image folder) with ``ds_pfc.data.stress``: the file indexes the
    stressed set (as ``ds-pfc-clean`` reads it), so its length is the stressed set's and
    each kept item is that set's image."""
    from ds_pfc.app.datasets import build_train_set
    from ds_pfc.data.hf import load_image_dataset
    from ds_pfc.data.stress import StressedDataset
    root = tmp_path / "folder"
    for c in range(4):
        for k in range(3):
            (root / f"id{c}").mkdir(parents=True, exist_ok=True)
            (root / f"id{c}" / f"{k}.jpg").write_bytes(b"\xff\xd8\xff" + bytes([c, k]))
    stress = {"long_tail": {"tail_fraction": 0.5, "tail_images": [1, 2]}, "seed": 2}
    reference = StressedDataset(load_image_dataset(root), long_tail=0.5, tail_images=(1, 2), seed=2)
    assert len(reference) < 12
    values = [(k % 3) - 1 for k in range(len(reference))]          # -1, 0, 1, -1, ...
    path = _write_labels(tmp_path / "labels.txt", values)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "ds_pfc": {"head": {"num_classes": 2},
                         "data": {"source": "hf", "path": str(root), "labels": path, "stress": stress}}}
    data = build_train_set(split_config(config)[1])
    kept = [k for k, v in enumerate(values) if v != -1]
    assert [data[j] for j in range(len(data))] == [(reference[k][0], values[k]) for k in kept]
    _write_labels(tmp_path / "labels.txt", values + [0])
    with pytest.raises(ConfigError, match=f"has {len(reference) + 1} labels but the training set has "
                                          f"{len(reference)} images"):
        build_train_set(split_config(config)[1])
