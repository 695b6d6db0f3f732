"""The many-class identity-feature setting: the data source (determinism, held-out
identities, stress wrapping, the loader), the mlp backbone, the config checks, and
the C x r sweep of ``launch/experiments.py`` (its cells, its per-step statistics,
a quick run, and a slow re-run of a recorded cell)."""
from __future__ import annotations

import copy
import json
import math
import os

import pytest
import torch
import torch.nn.functional as F

from _inprocess import call_main
from ds_pfc.data import DistributedIdentitySampler, IdentityFeatures, MicroBatchLoader, StressedDataset

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SWEEP = os.path.join(ROOT, "benchmarks", "results", "paper", "sweep.json")


# --- data source -----------------------------------------------------------------------

def _splitmix_py(x: int) -> int:
    m = (1 << 64) - 1
    x = (x + 0x9E3779B97F4A7C15) & m
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & m
    return x ^ (x >> 31)


def _normal_py(base: int, *keys: int) -> float:
    """Python-int reference of the source's hashed normal (Box-Muller of two hashes)."""
    state = base & ((1 << 64) - 1)
    for key in keys:
        state = _splitmix_py(state ^ key)
    second = _splitmix_py(state ^ 0x5BD1E995)
    u1 = ((state >> 11) + 0.5) / 2.0 ** 53
    u2 = (second >> 11) / 2.0 ** 53
    return math.sqrt(-2.0 * math.log(u1)) * math.cos(2.0 * math.pi * u2)


def test_hashed_normals_match_a_python_int_reference_and_are_standard():
    from ds_pfc.data.features import _normals
    base = 0xD1B54A32D192ED03
    ids = torch.tensor([[0], [7], [123456]])
    pos = torch.tensor([[0, 1, 95]])
    got = _normals(base, ids, pos)
    for i, ident in enumerate([0, 7, 123456]):
        for j, p in enumerate([0, 1, 95]):
            assert got[i, j].item() == pytest.approx(_normal_py(base, ident, p), rel=1e-12, abs=1e-12)
    many = _normals(base, torch.arange(200_000))
    assert abs(many.mean().item()) < 0.01 and abs(many.std().item() - 1) < 0.01


def test_items_are_a_pure_function_of_seed_identity_and_image():
    a = IdentityFeatures(50, 4, feature_dim=48, seed=3)
    b = IdentityFeatures(50, 4, feature_dim=48, seed=3)
    idx = torch.tensor([5, 199, 0, 77])
    xa, la = a.get_batch(idx)
    xb, lb = b.get_batch(idx.flip(0))
    assert torch.equal(xa, xb.flip(0)) and torch.equal(la, lb.flip(0))
    assert torch.equal(la, idx // 4)
    single, label = a[77]
    assert torch.equal(single, xa[3]) and label == 77 // 4
    assert xa.shape == (4, 3, 1, 16) and xa.dtype == torch.float32
    assert float(xa.min()) >= 0 and float(xa.max()) <= 255
    other = IdentityFeatures(50, 4, feature_dim=48, seed=4).get_batch(idx)[0]
    assert not torch.allclose(other, xa)
    # two images of one identity differ (the nuisance), the identity's signal is shared
    same = F.cosine_similarity(a.vectors(torch.zeros(200, dtype=torch.long), torch.arange(200)),
                               a.vectors(torch.zeros(200, dtype=torch.long), torch.arange(200, 400)))
    diff = F.cosine_similarity(a.vectors(torch.arange(200), torch.zeros(200, dtype=torch.long)),
                               a.vectors(torch.arange(200, 400), torch.zeros(200, dtype=torch.long)))
    assert same.mean() > diff.mean() + 0.2 and (same < 0.999).all()


def test_vectors_follow_the_documented_model():
    ds = IdentityFeatures(10, 3, feature_dim=24, latent_dim=8, nuisance=0.7, noise=0.2, seed=1)
    from ds_pfc.data.features import _LATENT, _NOISE, _NUISANCE
    from ds_pfc._rng import _chain
    ident, num = 4, 2
    z = torch.tensor([_normal_py(_chain(1, _LATENT), ident, k) for k in range(8)], dtype=torch.float64)
    v = torch.tensor([_normal_py(_chain(1, _NUISANCE), ident, num, k) for k in range(8)], dtype=torch.float64)
    e = torch.tensor([_normal_py(_chain(1, _NOISE), ident, num, k) for k in range(24)], dtype=torch.float64)
    expect = torch.tanh(z @ ds.identity_map + 0.7 * v @ ds.nuisance_map + 0.2 * e)
    got = ds.vectors(torch.tensor([ident]), torch.tensor([num]))[0].double()
    torch.testing.assert_close(got, expect, rtol=0, atol=1e-6)


def test_held_out_identities_are_new_and_pairs_are_fresh_images():
    from ds_pfc.app.config import FeaturesDataConfig
    cfg = FeaturesDataConfig(identities=30, images_per_identity=4, held_out_identities=12, feature_dim=48,
                             nuisance=0.0, noise=0.0)
    train, held = cfg.build(), cfg.build(held_out=True)
    assert held.first_identity == 30 and held.num_identities == 12
    # without nuisance and noise a vector is its identity's: no held-out one is a training one
    train_vecs = train.vectors(torch.arange(30), torch.zeros(30, dtype=torch.long))
    held_vecs = held.vectors(torch.arange(30, 42), torch.zeros(12, dtype=torch.long))
    assert torch.cdist(held_vecs, train_vecs).min() > 0.5
    images, issame = held.pairs(40, seed=0)
    assert images.shape == (80, 3, 1, 16) and sum(issame) == 20
    vecs = images.view(80, -1) / 127.5 - 1
    dist = torch.cdist(vecs, held_vecs).min(1).values      # every pair image is a held-out identity's
    assert dist.max() < 1e-2      # (cdist rounding; identities lie > 0.5 apart)
    assert torch.cdist(vecs, train_vecs).min() > 0.5
    again, same_again = held.pairs(40, seed=0)
    assert torch.equal(again, images) and same_again == issame


def test_stress_transforms_wrap_the_feature_set():
    base = IdentityFeatures(40, 6, feature_dim=30, seed=2)
    flipped = StressedDataset(base, label_flip=0.25, seed=5)
    assert flipped.summary.flipped == round(0.25 * 240)
    changed = (flipped.labels() != base.labels()).sum().item()
    assert changed == flipped.summary.flipped                   # flips go to another class
    idx = torch.tensor([3, 100, 239])
    images, _ = flipped.get_batch(idx)
    assert torch.equal(images, base.get_batch(flipped.base_indices()[idx])[0])
    conflict = StressedDataset(base, conflict=0.5, conflict_splits=3, seed=5)
    assert conflict.num_classes == 20 + 20 * 3
    tail = StressedDataset(base, long_tail=0.9, tail_images=(2, 4), seed=5)
    counts = torch.bincount(tail.labels(), minlength=40)
    assert (counts == 6).sum() == 4 and ((counts >= 2) & (counts <= 4)).sum() == 36


def test_the_loader_delivers_the_vectors():
    ds = IdentityFeatures(20, 4, feature_dim=24, seed=0)
    sampler = DistributedIdentitySampler(len(ds), rank=0, world_size=1, seed=1, block_size=8)
    loader = iter(MicroBatchLoader(ds, sampler, flip=False, workers=0))
    images, labels = next(loader)
    order = sampler.shard()[:8]
    assert torch.equal(labels, order // 4)
    torch.testing.assert_close(images.view(8, -1), ds.vectors(order // 4, order % 4), rtol=0, atol=1e-5)


# --- mlp backbone ----------------------------------------------------------------------

def _reference_mlp(model, x):
    """The MLP's forward written out with torch.nn.functional, from its parameters."""
    h = x.flatten(1)
    for block in model.body:
        lin, bn, act = block
        h = F.linear(h, lin.weight)
        h = F.batch_norm(h, bn.running_mean, bn.running_var, bn.weight, bn.bias, False, 0.0, bn.eps)
        h = F.prelu(h, act.weight)
    h = F.linear(h, model.fc.weight)
    bn = model.features
    return F.batch_norm(h, bn.running_mean, bn.running_var, bn.weight, bn.bias, False, 0.0, bn.eps)


def test_mlp_forward_matches_a_functional_reference_and_trains_every_parameter():
    from ds_pfc.models import FEATURE_BACKBONES, build_backbone
    assert "mlp" in FEATURE_BACKBONES
    torch.manual_seed(0)
    model = build_backbone("mlp", embedding_size=16, width=0.5, input_dim=48, hidden=64, depth=3)
    assert [b[0].out_features for b in model.body] == [32, 32, 32]
    x = torch.randn(10, 3, 1, 16)
    model.train()
    out = model(x)
    (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(1))).sum().backward()
    for name, p in model.named_parameters():
        if name == "features.weight":
            assert not p.requires_grad and torch.equal(p, torch.ones(16))
        else:
            assert p.grad is not None and p.grad.abs().max() > 0, name
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(x), _reference_mlp(model, x), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="input_dim"):
        model(torch.randn(2, 3, 1, 15))
    with pytest.raises(ValueError, match="depth"):
        build_backbone("mlp", input_dim=48, depth=0)
    with pytest.raises(TypeError, match="input_dim"):
        build_backbone("mlp")


# --- config ----------------------------------------------------------------------------

def _features_job(**pfc_changes) -> dict:
    from ds_pfc.app.experiments import features_config
    config = features_config(100, quick=True)
    for path, value in pfc_changes.items():
        node = config["ds_pfc"]
        keys = path.split("__")
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        if value is _DELETE:
            node.pop(keys[-1], None)
        else:
            node[keys[-1]] = value
    return config


_DELETE = object()


@pytest.mark.parametrize("changes, key", [
    ({"backbone": {"name": "mobilefacenet", "width": 0.25, "options": {"image_size": 32}}}, "ds_pfc.backbone.name"),
    ({"backbone__options__input_dim": 99}, "ds_pfc.backbone.options.input_dim"),
    ({"backbone__options": {}}, "ds_pfc.backbone.options.input_dim"),
    ({"data__flip": True}, "ds_pfc.data.flip"),
    ({"evaluation__flip": _DELETE}, "ds_pfc.evaluation.flip"),
    ({"data__features__feature_dim": 95, "backbone__options__input_dim": 95}, "ds_pfc.data.features.feature_dim"),
    ({"data__features__identities": 99}, "ds_pfc.data.features.identities"),
    ({"data__features__held_out_identities": 1}, "ds_pfc.data.features.held_out_identities"),
    ({"data__features__nuisance": -1.0}, "ds_pfc.data.features.nuisance"),
    ({"data__features__colour": 1}, "ds_pfc.data.features"),
    ({"data__path": "/tmp/x"}, "ds_pfc.data.path"),
])
def test_feature_config_errors_name_the_key(changes, key):
    from ds_pfc.app.config import ConfigError, split_config
    config = _features_job(**changes)
    with pytest.raises(ConfigError) as err:
        split_config(config)
    assert key in str(err.value)


def test_features_block_and_mlp_need_the_features_source():
    from ds_pfc.app.config import ConfigError, split_config
    from ds_pfc.app.experiments import base_config
    faces = base_config(quick=True)
    with_block = copy.deepcopy(faces)
    with_block["ds_pfc"]["data"]["features"] = {"feature_dim": 48}
    with pytest.raises(ConfigError, match="ds_pfc.data.features is set"):
        split_config(with_block)
    mlp = copy.deepcopy(faces)
    mlp["ds_pfc"]["backbone"] = {"name": "mlp", "options": {"input_dim": 3 * 32 * 32}}
    with pytest.raises(ConfigError, match="ds_pfc.data.source"):
        split_config(mlp)
    _, cfg = split_config(_features_job())
    assert cfg.data.features.identities == 100
    stressed = _features_job(data__stress={"conflict": {"fraction": 0.5, "splits": 3}, "seed": 0},
                             head__num_classes=200)
    from ds_pfc.app.datasets import build_train_set
    assert build_train_set(split_config(stressed)[1]).num_classes == 200      # 50 + 50 x 3 pseudo-classes


# --- sweep -----------------------------------------------------------------------------

def test_sweep_cells():
    from ds_pfc.app.experiments import SWEEP_CLASSES, SWEEP_RATES, find_sweep_cell, sweep_cells
    cells = sweep_cells()
    assert SWEEP_CLASSES == (1000, 10000, 100000) and SWEEP_RATES == (1.0, 0.3, 0.1, 0.03, 0.01)
    assert [(c.classes, c.sample_rate) for c in cells] == [(c, r) for c in SWEEP_CLASSES for r in SWEEP_RATES]
    assert [c.budget for c in cells[:5]] == [1000, 300, 100, 30, 10]
    assert cells[0].name == "C1000/FC-1" and cells[-1].name == "C100000/PFC-0.01"
    assert find_sweep_cell("C10000/PFC-0.03").budget == 300
    # a cell whose budget floor(r C) is below one class is left out
    assert [(c.classes, c.sample_rate) for c in sweep_cells((50, 1000), (1.0, 0.01))] == \
        [(50, 1.0), (1000, 1.0), (1000, 0.01)]
    with pytest.raises(ValueError, match="rates"):
        sweep_cells((1000,), (0.0,))


def test_label_flip_cells_of_the_features_setting_log_the_mechanism():
    from ds_pfc.app.experiments import STUDIES, base_config, cell_config, features_config
    by_name = {c.name: c for c in STUDIES["label_flip"]}
    on = lambda config: config["ds_pfc"].get("train", {}).get("diagnostics", {}).get("flip_mechanism", False)
    features = features_config(300, quick=True)
    assert on(cell_config(by_name["flip40/PFC-0.1"], 0, quick=True, base=features))
    assert on(cell_config(by_name["flip20/FC-1"], 0, quick=True, base=features))
    assert not on(cell_config(by_name["flip0/FC-1"], 0, quick=True, base=features))        # nothing flipped
    assert not on(cell_config(by_name["flip40/PFC-0.1"], 0, quick=True, base=base_config(quick=True)))
    assert not on(features)                                                               # the base is untouched


def _seed_with_curve(values, **extra):
    curve = [{"step": 100 * i, "verification_acc": 0.5, "tar_at_far": {"0.01": v}} for i, v in enumerate(values)]
    return dict({"curve": curve}, **extra)


def test_curve_peak_is_the_best_point_of_the_mean_curve():
    from ds_pfc.app.experiments import curve_peak
    seeds = [_seed_with_curve([0.1, 0.6, 0.5, 0.2]), _seed_with_curve([0.3, 0.4, 0.7, 0.4])]
    # mean curve 0.2, 0.5, 0.6, 0.3: best 0.6 at step 200, final 0.3
    peak, step, final = curve_peak(seeds)
    assert (step, peak, final) == (200, pytest.approx(0.6), pytest.approx(0.3))
    assert curve_peak([_seed_with_curve([None, None, None])]) is None                # no measurable TAR
    assert curve_peak([_seed_with_curve([0.4])]) is None                             # one point is no curve
    assert curve_peak([_seed_with_curve([0.4, 0.4])])[1] == 0                        # a tie: the earliest


def test_mechanism_means_weight_intervals_by_their_flipped_samples(tmp_path):
    from ds_pfc.app.experiments import MECHANISM_KEYS, mechanism_means, write_report

    def interval(lo, hi, flipped, share):
        values = {k: share * 2 for k in MECHANISM_KEYS}
        values.update(steps=[lo, hi], flipped=flipped, true_active_share=share)
        return values
    seed = {"flip_mechanism": {"10": interval(1, 10, 5, 0.2), "20": interval(11, 20, 15, 0.6),
                               "30": interval(21, 30, 0, 0.0)}}
    means = mechanism_means(seed)
    assert means["true_active_share"] == pytest.approx((5 * 0.2 + 15 * 0.6) / 20)
    assert means["dcos_true"] == pytest.approx((5 * 0.4 + 15 * 1.2) / 20)
    assert mechanism_means(seed, first_step=10)["true_active_share"] == pytest.approx(0.6)
    assert mechanism_means({}) is None
    # the label-flip report tabulates them next to the accuracy
    record = dict(_seed_with_curve([0.2, 0.5, 0.4]), seed=0, verification_acc=0.8, tar_at_far={"0.01": 0.4},
                  images_per_second=100.0, active_negatives_mean=12.0, flip_mechanism=seed["flip_mechanism"])
    data = {"experiment": "label_flip", "cells": [{"cell": "flip40/PFC-0.1", "seeds": [record]}],
            "setting": "identity features, 300 classes, MLP backbone"}
    with open(tmp_path / "label_flip.json", "w") as f:
        json.dump(data, f)
    md, _ = write_report("label_flip", str(tmp_path))
    text = open(md).read()
    assert "| flip40/PFC-0.1 | 1 | 0.8000 +- 0.0000 | 0.4000 +- 0.0000 | 0.5000 (100) | 12 |" in text
    assert "| flip40/PFC-0.1 | 0.500 | 1.000 |" in text       # intervals ending after step 3, by flipped samples


@pytest.mark.parametrize("rate", [1.0, 0.1, 0.01])
def test_batch_statistics_replay_the_trainers_batches(rate):
    """Reference: the sampler walked index by index as the trainer consumes it (a new
    epoch when less than a step is left), python sets, and the head's own sampler for
    the size of the active set."""
    from ds_pfc.app.config import split_config
    from ds_pfc.app.datasets import build_train_set
    from ds_pfc.app.experiments import Cell, batch_statistics, cell_config, features_config
    from ds_pfc.core.sampling import sample_active
    config = cell_config(Cell("x", rate), 0, quick=True, base=features_config(300, quick=True))
    config["ds_pfc"]["data"]["features"]["images_per_identity"] = 2      # 600 images: several epochs in 50 steps
    steps, micro = 50, 16
    got = batch_statistics(config, steps)
    _, cfg = split_config(config)
    labels = build_train_set(cfg).labels().tolist()
    sampler = DistributedIdentitySampler(len(labels), rank=0, world_size=1, seed=cfg.data.seed, block_size=micro)
    negatives, absent, positives_all = [], [], []
    for step in range(steps):
        if len(sampler) < micro:
            sampler.set_epoch(sampler.epoch + 1)
        batch = [labels[i] for i in list(iter(sampler))[:micro]]
        sampler.advance(micro)
        positives = len(set(batch))
        if rate < 1:
            active = sample_active(torch.tensor(batch), 300, rate, seed=0, step=step, rank=0)
            active = active[0] if isinstance(active, tuple) else active
            size = len(active)
        else:
            size = 300
        negatives.append(size - positives)
        absent.append(1 - positives / 300)
        positives_all.append(positives)
    assert got["active_negatives_mean"] == pytest.approx(sum(negatives) / steps, abs=1e-9)
    assert got["absent_class_share"] == pytest.approx(sum(absent) / steps, abs=1e-9)
    assert got["positives_mean"] == pytest.approx(sum(positives_all) / steps, abs=1e-9)


def _run(*args):
    """``launch/experiments.py *args``, its ``main`` called in this process (each training
    run is still its own process, started by the runner; a fresh interpreter for the
    runner would only import torch and ds_pfc again); its stdout."""
    from ds_pfc.cli.experiments import main
    status, out, err = call_main(main, args)
    assert status == 0, out[-3000:] + err[-3000:]
    return out


def test_quick_sweep_run_records_curves_and_sampling(tmp_path):
    pytest.importorskip("deepspeed")
    out = str(tmp_path)
    _run("sweep", "--quick", "--classes", "1000", "--rate", "0.1", "--seeds", "1", "--out", out, "--name", "q",
         "--note", "a quick test")
    with open(os.path.join(out, "q.json")) as f:
        text = f.read()
    data = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))
    assert data["experiment"] == "sweep" and data["note"] == "a quick test"
    (entry,) = data["cells"]
    assert entry["cell"] == "C1000/PFC-0.1" and entry["budget"] == 100
    (seed,) = entry["seeds"]
    assert [p["step"] for p in seed["curve"]] == [0, 10, 20, 30] and seed["steps"] == 30
    assert seed["curve"][-1]["verification_acc"] == seed["verification_acc"]
    # batch 16 of 1000 classes: 100 active, so 100 - |P| negatives, |P| <= 16
    assert 84 <= seed["active_negatives_mean"] <= 99
    assert seed["active_negatives_mean"] == pytest.approx(100 - seed["positives_mean"])
    assert seed["absent_class_share"] == pytest.approx(1 - seed["positives_mean"] / 1000)
    assert data["base_configs"]["1000"]["ds_pfc"]["data"]["source"] == "features"
    md = open(os.path.join(out, "q.md")).read()
    assert "| 1000 | 0.1 | 100 | 1 |" in md and "a quick test" in md
    # a recorded (cell, seed) is not run again
    from ds_pfc.app.experiments import SweepCell, run_sweep_cell
    assert run_sweep_cell(SweepCell(1000, 0.1), 0, out_dir=out, name="q", quick=True, log=pytest.fail) is None


def test_quick_study_on_the_features_setting(tmp_path):
    pytest.importorskip("deepspeed")
    out = str(tmp_path)
    _run("label_flip", "--setting", "features", "--classes", "200", "--quick", "--seeds", "1",
         "--cell", "flip40/PFC-0.1", "--out", out)
    data = json.load(open(os.path.join(out, "label_flip.json")))
    assert data["setting"].startswith("identity features, 200 classes")
    (seed,) = data["cells"][0]["seeds"]
    assert len(seed["curve"]) == 4 and seed["active_negatives_mean"] > 0
    assert os.path.exists(os.path.join(out, "label_flip.md"))


@pytest.mark.parametrize("args, message", [
    (["sweep", "--classes", "5000"], "not a class count of the sweep"),
    (["sweep", "--rate", "0.2"], "not a sample rate of the sweep"),
    (["sweep", "--setting", "faces"], "features setting"),
    (["sweep", "--config", "x.json"], "--config does not apply"),
    (["sweep", "--cell", "C7/FC-1"], "has no cell"),
    (["sample_rate", "--classes", "1000"], "--classes applies to --setting features"),
    (["sample_rate", "--rate", "0.1"], "--rate applies to the sweep"),
    (["sample_rate", "--setting", "features", "--config", "x.json"], "does not combine with --config"),
])
def test_cli_refuses_bad_combinations(args, message, capsys):
    from ds_pfc.cli.experiments import main
    with pytest.raises(SystemExit) as err:
        main(args)
    assert err.value.code == 2 and message in capsys.readouterr().err


# --- the recorded sweep ----------------------------------------------------------------

RERUN = ("C1000/FC-1", 0)
"""The recorded cell the re-run checks, and the documented command (docs/paper-studies.md)."""
RERUN_COMMAND = ["sweep", "--classes", "1000", "--rate", "1.0", "--seeds", "1", "--name", "sweep_rerun"]


def test_documented_rerun_command_parses():
    from ds_pfc.app.experiments import sweep_cells
    from ds_pfc.cli.experiments import build_parser
    args = build_parser().parse_args(RERUN_COMMAND + ["--out", "/tmp/x"])
    assert args.study == "sweep" and args.classes == [1000] and args.rate == [1.0] and args.seeds == 1
    assert [c.name for c in sweep_cells(args.classes, args.rate)] == [RERUN[0]]
    docs = open(os.path.join(ROOT, "docs", "paper-studies.md")).read()
    assert "python launch/experiments.py " + " ".join(RERUN_COMMAND) in docs


@pytest.mark.slow
def test_a_recorded_sweep_cell_reruns_to_its_value(tmp_path):
    """Re-runs C1000/FC-1 seed 0 of the committed sweep. On the CPU model that recorded
    it: its held-out TARs within 0.02. On another CPU the float32 rounding of its kernels
    differs, and a training run drifts like another seed (an Intel AVX-512 machine gave
    0.597 against the recorded 0.656 at FAR 1e-3): there the values must lie within the
    recorded seeds' range, widened by 0.05."""
    pytest.importorskip("deepspeed")
    from ds_pfc.bench import machine_info
    with open(SWEEP) as f:
        sweep = json.load(f)
    entry = next(e for e in sweep["cells"] if e["cell"] == RERUN[0])
    recorded = next(s for s in entry["seeds"] if s["seed"] == RERUN[1])
    _run(*RERUN_COMMAND, "--out", str(tmp_path))
    with open(os.path.join(str(tmp_path), "sweep_rerun.json")) as f:
        rerun = json.load(f)["cells"][0]["seeds"][0]
    same_cpu = machine_info()["cpu"] == sweep["machine"]["cpu"]
    values = [(f"TAR@FAR={far}", rerun["tar_at_far"][far], recorded["tar_at_far"][far],
               [s["tar_at_far"][far] for s in entry["seeds"]]) for far in recorded["tar_at_far"]]
    values.append(("verification", rerun["verification_acc"], recorded["verification_acc"],
                   [s["verification_acc"] for s in entry["seeds"]]))
    for what, got, want, seeds in values:
        if same_cpu:
            assert got == pytest.approx(want, abs=0.02), what
        else:
            assert min(seeds) - 0.05 <= got <= max(seeds) + 0.05, (what, got, seeds)
