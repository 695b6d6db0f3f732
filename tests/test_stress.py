"""Stress transforms of the training labels (``ds_pfc.data.StressedDataset`` and the
``ds_pfc.data.stress`` config block): checked by counting against the base dataset's
own labels, never with the transform's helpers."""
from __future__ import annotations

import collections
import copy
import json
import os

import pytest
import torch

from ds_pfc.app.config import ConfigError, split_config
from ds_pfc.data import StressedDataset, SyntheticFaces


class Labels(torch.utils.data.Dataset):
    """A labelled dataset whose 'images' are their own index (cheap to check)."""

    def __init__(self, labels):
        self._labels = torch.as_tensor(labels, dtype=torch.int64)

    def __len__(self):
        return len(self._labels)

    def __getitem__(self, i):
        return torch.full((3, 2, 2), i % 256, dtype=torch.uint8), int(self._labels[i])

    def labels(self):
        return self._labels.clone()

    @property
    def num_classes(self):
        return int(self._labels.max()) + 1


def _base(num_ids=60, per=9):
    return Labels(torch.arange(num_ids).repeat_interleave(per)[torch.randperm(num_ids * per,
                                                                              generator=torch.Generator().manual_seed(1))])


def _true(ds, base):
    return base.labels()[ds.base_indices()]


def test_label_flip_replaces_exactly_the_fraction_with_other_classes():
    base = _base()
    ds = StressedDataset(base, label_flip=0.4, seed=5)
    true, got = _true(ds, base), ds.labels()
    assert len(ds) == len(base) and ds.num_classes == 60
    changed = (true != got)
    assert int(changed.sum()) == round(0.4 * len(base)) == ds.summary.flipped
    assert got.min() >= 0 and got.max() < 60
    # the new labels spread over the classes (uniform over the 59 others: no class gets a third)
    counts = collections.Counter(got[changed].tolist())
    assert len(counts) > 40 and max(counts.values()) < len(changed.nonzero()) / 3
    # items carry their corrupted label and the base item's image
    for i in (0, 17, len(ds) - 1):
        image, label = ds[i]
        assert label == int(got[i]) and int(image[0, 0, 0]) == int(ds.base_indices()[i]) % 256


def test_conflict_splits_the_chosen_identities_evenly():
    base = _base(60, 9)
    ds = StressedDataset(base, conflict=1 / 3, conflict_splits=3, seed=2)
    true, got = _true(ds, base), ds.labels()
    pieces = collections.defaultdict(collections.Counter)
    for t, g in zip(true.tolist(), got.tolist()):
        pieces[t][g] += 1
    split = [t for t, p in pieces.items() if len(p) > 1]
    assert len(split) == 20 == ds.summary.split_identities
    for t in split:                  # 9 images dealt over 3 pseudo-classes: 3 each
        assert sorted(pieces[t].values()) == [3, 3, 3]
    owners = collections.Counter(g for p in pieces.values() for g in p)
    assert set(owners.values()) == {1}            # no pseudo-class mixes identities
    assert ds.num_classes == 40 + 60 == len(owners) and set(owners) == set(range(100))
    # identity order is kept: pseudo-classes of identity t come before those of t + 1
    firsts = [min(pieces[t]) for t in range(60)]
    assert firsts == sorted(firsts)


def test_conflict_with_fewer_images_than_splits():
    base = Labels([0, 0, 1, 1, 1, 1, 2])
    ds = StressedDataset(base, conflict=1.0, conflict_splits=3, seed=0)
    per_identity = collections.defaultdict(set)
    for t, g in zip(_true(ds, base).tolist(), ds.labels().tolist()):
        per_identity[t].add(g)
    assert [len(per_identity[t]) for t in range(3)] == [2, 3, 1] and ds.num_classes == 6


def test_long_tail_keeps_head_identities_whole_and_cuts_the_rest():
    base = _base(100, 12)
    ds = StressedDataset(base, long_tail=0.9, tail_images=(2, 4), seed=3)
    kept = collections.Counter(_true(ds, base).tolist())
    assert set(kept) == set(range(100))                      # every identity stays a class
    whole = [t for t, n in kept.items() if n == 12]
    assert len(whole) == 10 and ds.summary.tail_identities == 90
    assert all(2 <= n <= 4 for t, n in kept.items() if t not in whole)
    assert len(set(n for t, n in kept.items() if t not in whole)) == 3   # 2, 3 and 4 all occur
    assert torch.equal(ds.labels(), _true(ds, base))          # labels themselves untouched
    assert len(ds.base_indices().unique()) == len(ds)


def test_pure_function_of_the_seed():
    base = _base()
    a = StressedDataset(base, label_flip=0.2, conflict=0.3, long_tail=0.5, seed=9)
    b = StressedDataset(base, label_flip=0.2, conflict=0.3, long_tail=0.5, seed=9)
    c = StressedDataset(base, label_flip=0.2, conflict=0.3, long_tail=0.5, seed=10)
    assert torch.equal(a.labels(), b.labels()) and torch.equal(a.base_indices(), b.base_indices())
    assert not torch.equal(a.base_indices(), c.base_indices()) or not torch.equal(a.labels(), c.labels())


def test_nothing_set_changes_nothing():
    base = _base()
    ds = StressedDataset(base)
    assert torch.equal(ds.labels(), base.labels()) and torch.equal(ds.base_indices(), torch.arange(len(base)))


@pytest.mark.parametrize("kwargs, match", [
    ({"label_flip": 1.0}, "label_flip"), ({"label_flip": -0.1}, "label_flip"), ({"conflict": 1.5}, "conflict"),
    ({"conflict_splits": 1}, "conflict_splits"), ({"long_tail": 2.0}, "long_tail"),
    ({"tail_images": (3, 2)}, "tail_images"), ({"seed": 1.5}, "seed")])
def test_bad_arguments_name_themselves(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        StressedDataset(_base(), **kwargs)


def test_batched_fetch_matches_items_on_synthetic_faces():
    base = SyntheticFaces(12, 4, image_size=32, seed=0)
    ds = StressedDataset(base, label_flip=0.25, long_tail=0.5, seed=1)
    idx = torch.tensor([0, 3, len(ds) - 1])
    images, labels = ds.get_batch(idx)
    for j, i in enumerate(idx.tolist()):
        image, label = ds[i]
        assert torch.equal(images[j], image) and int(labels[j]) == label
        assert torch.equal(image, base[int(ds.base_indices()[i])][0])


# ---------------------------------------------------------------------------- config
def _job(**stress):
    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs",
                           "cpu_quickstart.json")) as f:
        job = json.load(f)
    job = copy.deepcopy(job)
    job["ds_pfc"]["data"]["stress"] = stress
    return job


def test_config_builds_the_stressed_training_set_and_leaves_evaluation_alone():
    from ds_pfc.app.training import build_eval_sets, build_train_set
    _, clean = split_config(_job())
    _, noisy = split_config(_job(label_flip=0.3, long_tail={"tail_fraction": 0.5}, seed=4))
    train = build_train_set(noisy)
    assert isinstance(train, StressedDataset) and train.summary.flipped == round(0.3 * len(train))
    assert train.settings["seed"] == 4 and train.settings["tail_images"] == [2, 4]
    clean.evaluation.synthetic_pairs = noisy.evaluation.synthetic_pairs = 20
    a, b = build_eval_sets(clean), build_eval_sets(noisy)
    assert torch.equal(a["synthetic_held_out"][0], b["synthetic_held_out"][0])
    assert a["synthetic_held_out"][1] == b["synthetic_held_out"][1]


def test_conflict_needs_the_head_sized_for_the_pseudo_classes():
    from ds_pfc.app.training import build_train_set
    job = _job(conflict={"fraction": 0.5, "splits": 3})
    job["ds_pfc"]["data"]["synthetic"]["identities"] = 400
    _, cfg = split_config(job)
    with pytest.raises(ConfigError, match=r"num_classes must be \d+") as err:
        build_train_set(cfg)
    wanted = int(str(err.value).split("must be ")[1].split()[0])
    job["ds_pfc"]["head"]["num_classes"] = wanted
    _, cfg = split_config(job)
    assert build_train_set(cfg).num_classes == wanted > 400


@pytest.mark.parametrize("stress, match", [
    ({"label_flip": 1.0}, "label_flip"), ({"conflict": {"fraction": 0.2, "splits": 1}}, "conflict.splits"),
    ({"long_tail": {"tail_fraction": 0.5, "tail_images": [0, 2]}}, "tail_images"),
    ({"long_tail": {"fraction": 0.5}}, "unknown key"), ({"flip": 0.1}, "unknown key")])
def test_bad_stress_config_names_the_key(stress, match):
    with pytest.raises(ConfigError, match=match):
        split_config(_job(**stress))
