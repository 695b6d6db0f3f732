"""The flip-mechanism diagnostic (``ds_pfc.train.diagnostics.flip_mechanism``).

The oracle of every number is computed here in float64 from the full center matrix
before and after each step (every rank's shard gathered) and the batch's labels:

- a class was in a step's active set exactly when its center row changed in that
  step (the head updates only active rows, and an active negative always gets a
  non-zero gradient and weight decay);
- the expected share is the uniform positive-preserving sampling probability from
  the batch's labels and the class partition, written out here;
- the cosines and drifts are plain normalised dot products.

With FC (r = 1) the share must be exactly 1; with PFC it must match the recount
exactly and the expectation within binomial tolerance. The app runs check the
wiring: off by default, summary.json strict JSON, FC share 1, PFC share equal to a
recount of the sampler's active sets over the run's own batches.
"""
from __future__ import annotations

import copy
import hashlib
import json
import math
import os

import pytest
import torch

from _dist import one_process_world, run_ranks

from ds_pfc import PartialFC
from ds_pfc.app.diagnostics import FLIP_MECHANISM_FIELDS, FlipMechanism

FIELDS = ("flipped", "true_active_share", "true_active_expected", "true_in_batch_share", "control_active_share",
          "cos_true", "cos_label", "dcos_true", "dcos_true_active", "dcos_label", "dcos_control", "drift_true",
          "drift_control")


# ----------------------------------------------------------------------------- reference
def _shard_sizes(num_classes: int, world: int) -> list[int]:
    return [num_classes // world + (q < num_classes % world) for q in range(world)]


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(a @ b / (a.norm() * b.norm()))


def _best(x, w_rows):
    return max(_cos(x, w) for w in w_rows)


def _controls(seed, step, positives, true_flipped, num_classes, n):
    """The documented control rule, written out: uniform over the classes that are no
    label and no flipped true class of the batch, from a generator seeded by
    blake2b('flip_mechanism:<seed>:<step>')."""
    digest = hashlib.blake2b(f"flip_mechanism:{seed}:{step}".encode(), digest_size=8).digest()
    g = torch.Generator().manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))
    allowed = [c for c in range(num_classes) if c not in positives and c not in true_flipped]
    picks = torch.randint(len(allowed), (n,), generator=g).tolist()
    return [allowed[i] for i in picks]


def _reference(steps, *, num_classes, world, sample_rate, sub_centers, seed):
    """Interval numbers from ``steps``: per step ``(X [M, d], y [M], t [M], W0, W1)``
    with the full centers ``[C K, d]`` before and after (float64), samples in
    rank-major order."""
    sizes = _shard_sizes(num_classes, world)
    starts = [sum(sizes[:q]) for q in range(world)]
    acc = {k: 0.0 for k in ("flipped", "active", "expected", "in_batch", "cos_true", "dcos_true", "dcos_true_active",
                            "drift_true", "cos_label", "dcos_label", "controls", "control_active", "dcos_control",
                            "drift_control")}
    k = sub_centers

    def rows(W, c):
        return W[c * k:(c + 1) * k]

    def changed(W0, W1, c):
        return not torch.equal(rows(W0, c), rows(W1, c))

    def drift(W0, W1, c):
        return sum(1 - _cos(a, b) for a, b in zip(rows(W0, c), rows(W1, c))) / k

    for step, (X, y, t, W0, W1) in enumerate(steps):
        y, t = y.tolist(), t.tolist()
        positives = set(y)
        flipped = [i for i in range(len(y)) if y[i] != t[i]]
        controls = _controls(seed, step, positives, {t[i] for i in flipped}, num_classes, len(flipped))
        for i, u in zip(flipped, controls):
            x, c = X[i], t[i]
            q = max(r for r in range(world) if starts[r] <= c)
            owned_pos = sum(1 for p in positives if starts[q] <= p < starts[q] + sizes[q])
            budget = sizes[q] if sample_rate >= 1 else math.floor(sample_rate * sizes[q] + 1e-9)
            p = 1.0 if c in positives else max(budget - owned_pos, 0) / (sizes[q] - owned_pos)
            active = changed(W0, W1, c)
            before = _best(x, rows(W0, c))
            d = _best(x, rows(W1, c)) - before
            acc["flipped"] += 1
            acc["active"] += active
            acc["expected"] += p
            acc["in_batch"] += c in positives
            acc["cos_true"] += before
            acc["dcos_true"] += d
            acc["dcos_true_active"] += d if active else 0.0
            acc["drift_true"] += drift(W0, W1, c)
            lb = _best(x, rows(W0, y[i]))
            acc["cos_label"] += lb
            acc["dcos_label"] += _best(x, rows(W1, y[i])) - lb
            acc["controls"] += 1
            acc["control_active"] += changed(W0, W1, u)
            acc["dcos_control"] += _best(x, rows(W1, u)) - _best(x, rows(W0, u))
            acc["drift_control"] += drift(W0, W1, u)
    n = acc["flipped"]
    return {"flipped": n, "true_active_share": acc["active"] / n, "true_active_expected": acc["expected"] / n,
            "true_in_batch_share": acc["in_batch"] / n, "control_active_share": acc["control_active"] / n,
            "cos_true": acc["cos_true"] / n, "cos_label": acc["cos_label"] / n, "dcos_true": acc["dcos_true"] / n,
            "dcos_true_active": acc["dcos_true_active"] / acc["active"] if acc["active"] else math.nan,
            "dcos_label": acc["dcos_label"] / n, "dcos_control": acc["dcos_control"] / n,
            "drift_true": acc["drift_true"] / n, "drift_control": acc["drift_control"] / n}


def _batch(step, num_classes, batch, flip_share=0.5):
    """Global labels of one step: true classes, then about ``flip_share`` of them
    replaced by another class."""
    g = torch.Generator().manual_seed(1000 + step)
    t = torch.randint(num_classes, (batch,), generator=g)
    flip = torch.rand(batch, generator=g) < flip_share
    y = torch.where(flip, (t + torch.randint(1, num_classes, (batch,), generator=g)) % num_classes, t)
    return y, t


def _train(rank, world, *, num_classes, dim, micro, steps, sample_rate, sub_centers, seed):
    """``steps`` head steps on this rank's micro batches with the diagnostic; returns
    its interval numbers and what the reference needs (this rank's shards before and
    after, its embeddings and labels)."""
    head = PartialFC(num_classes, dim, sample_rate=sample_rate, seed=seed, dtype=torch.float64,
                     compute_dtype=torch.float64, optimizer="sgd", momentum=0.9, weight_decay=5e-4,
                     sub_centers=sub_centers, data_parallel_grad=False)
    diag = FlipMechanism(head, seed=seed)
    g = torch.Generator().manual_seed(7)
    mix = torch.randn(dim, dim, generator=g, dtype=torch.float64)
    means = torch.randn(num_classes, dim, generator=g, dtype=torch.float64)
    record = []
    for step in range(steps):
        y, t = _batch(step, num_classes, micro * world)
        mine = slice(rank * micro, (rank + 1) * micro)
        noise = torch.randn(micro * world, dim, generator=g, dtype=torch.float64)
        x = ((means[t] + 0.5 * noise) @ mix)[mine].requires_grad_(True)
        w0 = head.centers()
        loss = head(x, y[mine])
        diag.observe(x, y[mine], t[mine])
        loss.backward()
        head.step(0.5)
        diag.after_step(step + 1)
        record.append((x.detach(), y[mine], t[mine], w0, head.centers()))
    return diag.interval(), record


def _check(numbers, ref, steps):
    assert numbers["steps"] == [1, steps]
    assert set(FLIP_MECHANISM_FIELDS) == set(numbers)
    for key in FIELDS:
        assert numbers[key] == pytest.approx(ref[key], rel=1e-9, abs=1e-12, nan_ok=True), key


@pytest.mark.parametrize("sample_rate,sub_centers", [(1.0, 1), (0.2, 1), (0.3, 2)])
def test_one_rank_matches_the_float64_reference(sample_rate, sub_centers):
    C, steps = 41, 30
    numbers, record = _train(0, 1, num_classes=C, dim=6, micro=7, steps=steps, sample_rate=sample_rate,
                             sub_centers=sub_centers, seed=3)
    ref = _reference(record, num_classes=C, world=1, sample_rate=sample_rate, sub_centers=sub_centers, seed=3)
    _check(numbers, ref, steps)
    assert numbers["flipped"] > 60
    if sample_rate == 1.0:
        assert numbers["true_active_share"] == 1.0 and numbers["true_active_expected"] == 1.0
        assert numbers["control_active_share"] == 1.0
    else:
        assert numbers["true_active_share"] < 0.8
    # the noisy label's center, this sample's positive, is pulled towards the image
    assert numbers["dcos_label"] > 0


def test_interval_resets_and_counts_nothing_without_flips():
    head = PartialFC(11, 4, sample_rate=0.5, dtype=torch.float64, compute_dtype=torch.float64)
    diag = FlipMechanism(head)
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    y = torch.tensor([0, 1, 2, 3, 4])
    head(x, y).backward()
    diag.observe(x, y, y)
    head.step(0.1)
    diag.after_step(1)
    out = diag.interval()
    assert out["flipped"] == 0 and out["steps"] == [1, 1] and math.isnan(out["true_active_share"])
    assert diag.interval()["steps"] == [None, None]


def test_bad_arguments():
    head = PartialFC(11, 4)
    with pytest.raises(TypeError, match="head must be a PartialFC"):
        FlipMechanism(torch.nn.Linear(2, 2))
    diag = FlipMechanism(head)
    with pytest.raises(ValueError, match="embeddings must be"):
        diag.observe(torch.zeros(3, 5), torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="true_labels must be"):
        diag.observe(torch.zeros(3, 4), torch.zeros(3, dtype=torch.long), torch.zeros(2, dtype=torch.long))


def test_share_matches_sampling_expectation_statistically():
    """Many steps at r = 0.2 of 200 classes, batches of 8: the measured share (a count
    of the draws) and its expectation (from the labels alone) agree within 4
    binomial standard errors; a control class (never a positive) is active with the
    negatives' probability (b - |P|) / (C - |P|), about (40 - 7.9) / (200 - 7.9)."""
    C, steps = 200, 300
    numbers, _ = _train(0, 1, num_classes=C, dim=4, micro=8, steps=steps, sample_rate=0.2, sub_centers=1, seed=11)
    n, p = numbers["flipped"], numbers["true_active_expected"]
    assert n > 1000
    se = math.sqrt(p * (1 - p) / n)
    assert abs(numbers["true_active_share"] - p) < 4 * se
    # the true class is a label of the batch for about 1 - (199/200)^7 ~ 3.4% of the flipped samples
    assert 0.01 < numbers["true_in_batch_share"] < 0.07
    negatives = (40 - 7.86) / (200 - 7.86)
    assert p == pytest.approx(numbers["true_in_batch_share"] + (1 - numbers["true_in_batch_share"]) * negatives,
                              abs=0.005)
    assert abs(numbers["control_active_share"] - negatives) < 4 * math.sqrt(negatives * (1 - negatives) / n)


def test_stressed_dataset_true_labels():
    """The labels before the flips: the base labels (no conflict), or the conflict's
    pseudo-classes of the same seed without flips; they differ from the training
    labels at exactly the flipped samples."""
    from ds_pfc.data import StressedDataset

    class Labels(torch.utils.data.Dataset):
        def __init__(self, labels):
            self._labels = labels

        def __len__(self):
            return len(self._labels)

        def labels(self):
            return self._labels.clone()

    order = torch.randperm(150, generator=torch.Generator().manual_seed(2))
    base = Labels(torch.arange(30).repeat_interleave(5)[order])
    flipped = StressedDataset(base, label_flip=0.4, seed=3)
    assert torch.equal(flipped.true_labels(), base.labels())
    assert int((flipped.labels() != flipped.true_labels()).sum()) == flipped.summary.flipped == 60
    both = StressedDataset(base, label_flip=0.3, conflict=0.5, seed=4)
    split = StressedDataset(base, conflict=0.5, seed=4)
    assert torch.equal(both.true_labels(), split.labels())
    assert int((both.labels() != split.labels()).sum()) == both.summary.flipped == 45


# ----------------------------------------------------------------------------- two ranks
def _two_rank_worker(rank, world, sample_rate, sub_centers):
    return _train(rank, world, num_classes=37, dim=5, micro=3, steps=12, sample_rate=sample_rate,
                  sub_centers=sub_centers, seed=5)


@pytest.mark.parametrize("sample_rate,sub_centers", [(1.0, 1), (0.3, 2)])
def test_two_gloo_ranks_count_exactly(sample_rate, sub_centers):
    results = run_ranks(_two_rank_worker, 2, sample_rate, sub_centers)
    (n0, rec0), (n1, rec1) = results
    assert n0 == n1 or all(n0[k] == pytest.approx(n1[k], nan_ok=True) for k in n0)
    steps = []
    for (x0, y0, t0, a0, b0), (x1, y1, t1, a1, b1) in zip(rec0, rec1):
        steps.append((torch.cat([x0, x1]), torch.cat([y0, y1]), torch.cat([t0, t1]), torch.cat([a0, a1]),
                      torch.cat([b0, b1])))
    ref = _reference(steps, num_classes=37, world=2, sample_rate=sample_rate, sub_centers=sub_centers, seed=5)
    _check(n0, ref, 12)
    if sample_rate == 1.0:
        assert n0["true_active_share"] == 1.0


# ----------------------------------------------------------------------------- the app
TINY = {
    "train_micro_batch_size_per_gpu": 8,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 0.0,
    "steps_per_print": 10 ** 9,
    "optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9, "weight_decay": 5e-4}},
    "zero_optimization": {"stage": 0},
    "ds_pfc": {
        "head": {"num_classes": 24, "embedding_size": 16, "sample_rate": 1.0,
                 "margin": {"type": "cosface", "scale": 16.0, "margin": 0.2}},
        "backbone": {"name": "mobilefacenet", "width": 0.25, "options": {"image_size": 32}},
        "data": {"synthetic": {"images_per_identity": 4, "held_out_identities": 6, "image_size": 32}, "workers": 0,
                 "prefetch_batches": 1, "stress": {"label_flip": 0.4, "seed": 1}},
        "train": {"epochs": 10, "max_steps": 6, "log_every": 3},
        "evaluation": {"every_steps": 3, "synthetic_pairs": 20, "batch_size": 16, "far": [0.1]},
        "checkpoint": {"every_steps": 0, "keep": 0, "export": False},
    },
}


def _strict_load(path):
    def refuse(name):
        raise ValueError(f"non-standard JSON constant {name}")
    with open(path) as f:
        return json.load(f, parse_constant=refuse)


def _train_app(tmp_path, name, edit, *args):
    from ds_pfc.cli.train import run
    config = copy.deepcopy(TINY)
    edit(config["ds_pfc"])
    path = os.path.join(tmp_path, f"{name}.json")
    with open(path, "w") as f:
        json.dump(config, f)
    out = os.path.join(tmp_path, name)
    run(["--deepspeed_config", path, "--output_dir", out, *args])
    return _strict_load(os.path.join(out, "summary.json")), config


def _recount(config, summary):
    """The share of (a) recounted from the run's own batches: the sampler's order,
    the stressed set's labels, the head's sampler at each step."""
    from ds_pfc.app.config import split_config
    from ds_pfc.app.datasets import build_train_set
    from ds_pfc.core.sampling import sample_active
    from ds_pfc.data.sampler import DistributedIdentitySampler
    _, cfg = split_config(config)
    data = build_train_set(cfg)
    labels, true = data.labels(), data.true_labels()
    micro = config["train_micro_batch_size_per_gpu"]
    sampler = DistributedIdentitySampler(len(data), rank=0, world_size=1, seed=cfg.data.seed, block_size=micro)
    order = sampler.shard()
    C, r = cfg.head.num_classes, cfg.head.sample_rate
    counts = {}
    for step in range(summary["steps"]):
        idx = order[step * micro:(step + 1) * micro]
        y, t = labels[idx], true[idx]
        active = set(sample_active(y, C, r, seed=cfg.head.seed, step=step, rank=0).tolist())
        flipped = (y != t).nonzero().flatten().tolist()
        c = counts.setdefault((step // 3 + 1) * 3, [0, 0])
        c[0] += len(flipped)
        c[1] += sum(int(t[i]) in active for i in flipped)
    return counts


def test_app_off_by_default_fc_exact_and_pfc_recount(tmp_path):
    pytest.importorskip("deepspeed")
    from ds_pfc.app.config import split_config
    assert split_config(copy.deepcopy(TINY))[1].train.diagnostics.flip_mechanism is False
    with one_process_world():
        off, _ = _train_app(str(tmp_path), "off", lambda c: c["train"].update(max_steps=2))
        fc, _ = _train_app(str(tmp_path), "fc", lambda c: c["train"].update(diagnostics={"flip_mechanism": True}))

        def pfc_edit(c):
            c["train"]["diagnostics"] = {"flip_mechanism": True}
            c["head"]["sample_rate"] = 0.5
        pfc, pfc_config = _train_app(str(tmp_path), "pfc", pfc_edit)
        # stopped after the first interval and resumed: the intervals carry over
        _train_app(str(tmp_path), "resumed", pfc_edit, "--max_steps", "3")
        resumed, _ = _train_app(str(tmp_path), "resumed", pfc_edit)
    assert "flip_mechanism" not in off
    assert resumed["resumed"] and sorted(resumed["flip_mechanism"], key=int) == ["3", "6"]
    for step, numbers in pfc["flip_mechanism"].items():
        for key, value in numbers.items():
            assert resumed["flip_mechanism"][step][key] == pytest.approx(value, rel=1e-6, abs=1e-9), (step, key)
    for summary in (fc, pfc):
        assert sorted(summary["flip_mechanism"], key=int) == ["3", "6"]        # the evaluation intervals
        assert [summary["flip_mechanism"][s]["steps"] for s in ("3", "6")] == [[1, 3], [4, 6]]
    for numbers in fc["flip_mechanism"].values():
        assert numbers["flipped"] > 0
        assert numbers["true_active_share"] == 1.0 and numbers["true_active_expected"] == 1.0
        assert numbers["sample_rate"] == 1.0
    counts = _recount(pfc_config, pfc)
    for step, numbers in pfc["flip_mechanism"].items():
        flipped, active = counts[int(step)]
        assert numbers["flipped"] == flipped > 0
        assert numbers["true_active_share"] == pytest.approx(active / flipped, abs=1e-12)
        assert numbers["sample_rate"] == 0.5


@pytest.mark.parametrize("edit,needle", [
    (lambda c: c["train"].update(diagnostics={"flip_mechanism": True, "bogus": 1}), "unknown key"),
    (lambda c: c["train"].update(diagnostics={"flip_mechanism": True, "every_steps": -1}), "every_steps"),
    (lambda c: c["train"].update(diagnostics={"flip_mechanism": "yes"}), "flip_mechanism"),
    (lambda c: (c["train"].update(diagnostics={"flip_mechanism": True}), c["data"].pop("stress")),
     "needs ds_pfc.data.stress.label_flip > 0"),
    (lambda c: (c["train"].update(diagnostics={"flip_mechanism": True}),
                c["head"].update(bank={"default": "host"})), "device bank"),
])
def test_bad_diagnostics_config(edit, needle):
    pytest.importorskip("deepspeed")
    from ds_pfc.app.config import ConfigError
    from ds_pfc.app.training import Trainer
    config = copy.deepcopy(TINY)
    edit(config["ds_pfc"])
    with pytest.raises(ConfigError, match=needle):
        Trainer(config)


def test_turning_the_diagnostic_on_or_off_is_a_harmless_change_on_resume():
    from ds_pfc.app.resume_changes import differences
    on = copy.deepcopy(TINY)
    on["ds_pfc"]["train"]["diagnostics"] = {"flip_mechanism": True, "every_steps": 2}
    changes = differences(TINY, on)
    assert {c.key for c in changes} == {"ds_pfc.train.diagnostics.flip_mechanism",
                                        "ds_pfc.train.diagnostics.every_steps"}
    assert {c.kind for c in changes} == {"harmless"}
    off = copy.deepcopy(TINY)
    off["ds_pfc"]["train"]["diagnostics"] = {"flip_mechanism": False}       # the default written out
    assert differences(TINY, off) == []
