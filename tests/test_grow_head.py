"""A trained head grows with new identities (``ds_pfc.train.init.class_map``,
:mod:`ds_pfc.app.grow`).

References, all independent of the code under test: the old head is read back with
``safetensors.torch.load_file`` shard by shard and put together by the class range
each shard's metadata states; the fresh rows come from a head built on one process;
the imprinted rows from a plain loop over the dataset, item by item, through a
float64 copy of the backbone. Sizes are small and odd (7 and 11 classes per shard,
3 ranks after 2).
"""
from __future__ import annotations

import copy
import json
import os
import re

import pytest
import torch

from _dist import TRAIN, run_ranks, run_script_ranks, run_train_forked

from ds_pfc.app.config import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
D = 12
C_OLD, C_NEW = 17, 23


def _head(num_classes, seed, optimizer="sgd", momentum=0.9):
    from ds_pfc.core.head import PartialFC
    kwargs = {"momentum": momentum} if optimizer == "sgd" else {}
    return PartialFC(num_classes, D, sample_rate=1.0, seed=seed, optimizer=optimizer, **kwargs)


def _train_and_save(rank, world_size, directory, num_classes, optimizer):
    """A few steps of a head on ``world_size`` ranks (so that the optimizer states are
    not zero), saved as shards."""
    from ds_pfc.checkpoint.shards import save_head_shard
    head = _head(num_classes, 3, optimizer)
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(3):
        x = torch.randn(9, D, generator=gen, requires_grad=True)
        y = torch.randint(0, num_classes, (9,), generator=gen)
        head(x, y).backward()
        head.step(0.3)
    save_head_shard(head, directory)


def _save_old_head(directory, world_size, num_classes=C_OLD, optimizer="sgd"):
    os.makedirs(directory, exist_ok=True)
    run_ranks(_train_and_save, world_size, directory, num_classes, optimizer)


def _merged_reference(directory):
    """Every state of the old head, ``[C, ...]``, from the shard files alone."""
    from safetensors import safe_open
    from safetensors.torch import load_file
    parts = []
    for name in sorted(os.listdir(directory)):
        if re.fullmatch(r"head-rank\d{5}-of-\d{5}\.safetensors", name):
            path = os.path.join(directory, name)
            with safe_open(path, "pt") as f:
                start = int(f.metadata()["class_start"])
            parts.append((start, load_file(path)))
    parts.sort(key=lambda p: p[0])
    return {key: torch.cat([p[1][key] for p in parts]) for key in parts[0][1]}


def _write_map(path, old_to_new, fmt):
    with open(path, "w") as f:
        if fmt == "json":
            json.dump({str(o): n for o, n in old_to_new.items()}, f)
        else:
            f.write("# old new\n\n")
            for i, (o, n) in enumerate(old_to_new.items()):
                f.write(f"{o},{n}\n" if i % 2 else f"{o}  {n}   # moved\n")
    return path


def _grow(rank, world_size, directory, map_path, num_classes, optimizer_states, optimizer):
    from ds_pfc.app.grow import grow_head, read_class_map
    head = _head(num_classes, 11, optimizer)
    grown = grow_head(head, directory, *read_class_map(map_path), optimizer_states=optimizer_states)
    state = head.state_dict()
    return {"class_start": head.class_start, "num_local": head.num_local, "grown": grown,
            "states": {k: state[k].clone() for k in head.bank.state_names()}}


def _permutation():
    """Old id -> new id: the old classes scattered over the new range (every new
    rank receives rows from both old shards), 6 new ids left free."""
    targets = torch.randperm(C_NEW, generator=torch.Generator().manual_seed(5))[:C_OLD].tolist()
    return {o: targets[o] for o in range(C_OLD)}


@pytest.mark.parametrize("fmt", ["json", "text"])
def test_old_rows_and_momentum_move_bitwise_and_new_rows_stay_fresh(tmp_path, fmt):
    old = str(tmp_path / "old")
    _save_old_head(old, 2)
    mapping = _permutation()
    map_path = _write_map(str(tmp_path / ("map.json" if fmt == "json" else "map.txt")), mapping, fmt)
    results = run_ranks(_grow, 3, old, map_path, C_NEW, True, "sgd")
    reference = _merged_reference(old)
    assert reference["momentum_buffer"].abs().sum() > 0          # the old head did train
    fresh = _head(C_NEW, 11).centers()                            # one process: the fresh rows
    weight = torch.cat([r["states"]["weight"] for r in results])
    momentum = torch.cat([r["states"]["momentum_buffer"] for r in results])
    assert [(r["class_start"], r["num_local"]) for r in results] == [(0, 8), (8, 8), (16, 7)]
    for o, n in mapping.items():
        assert torch.equal(weight[n], reference["weight"][o]), (o, n)
        assert torch.equal(momentum[n], reference["momentum_buffer"][o]), (o, n)
    free = sorted(set(range(C_NEW)) - set(mapping.values()))
    assert len(free) == C_NEW - C_OLD
    for n in free:
        assert torch.equal(weight[n], fresh[n]), n
        assert not momentum[n].any(), n
    grown = results[0]["grown"]
    assert (grown.moved, grown.old_num_classes, grown.old_world_size) == (C_OLD, C_OLD, 2)
    assert grown.new_classes.tolist() == free and grown.states == ("weight", "momentum_buffer")


def test_optimizer_states_false_moves_the_centers_alone_and_adamw_states_move_too(tmp_path):
    old = str(tmp_path / "old")
    _save_old_head(old, 2, optimizer="adamw")
    mapping = {o: C_NEW - 1 - o for o in range(C_OLD)}          # reversed: every rank reads the other end
    map_path = _write_map(str(tmp_path / "map.txt"), mapping, "text")
    reference = _merged_reference(old)
    for states in (True, False):
        results = run_ranks(_grow, 2, old, map_path, C_NEW, states, "adamw")
        merged = {k: torch.cat([r["states"][k] for r in results]) for k in results[0]["states"]}
        assert sorted(merged) == ["exp_avg", "exp_avg_sq", "step", "weight"]
        for o, n in mapping.items():
            assert torch.equal(merged["weight"][n], reference["weight"][o])
            for key in ("exp_avg", "exp_avg_sq", "step"):
                if states:
                    assert torch.equal(merged[key][n], reference[key][o]), key
                else:
                    assert not merged[key][n].any(), key
        assert reference["step"].any() and reference["exp_avg"].any()


def test_sub_centers_move_as_whole_classes_and_imprint_sub_center_0(tmp_path):
    from ds_pfc.app.grow import grow_head, imprint_rows, read_class_map
    from ds_pfc.checkpoint.shards import save_head_shard
    from ds_pfc.core.head import PartialFC
    from ds_pfc.data.features import IdentityFeatures
    from ds_pfc.models.mlp import MLP
    k, old = 3, str(tmp_path / "old")
    os.makedirs(old)
    trained = PartialFC(5, D, seed=2, sub_centers=k, optimizer="sgd", momentum=0.9)
    save_head_shard(trained, old)
    reference = _merged_reference(old)["weight"].view(5, k, D)
    head = PartialFC(7, D, seed=8, sub_centers=k, optimizer="sgd", momentum=0.9)
    fresh = head.centers().view(7, k, D).clone()
    mapping = {0: 6, 1: 2, 2: 0, 3: 4, 4: 5}                      # free: 1, 3
    grown = grow_head(head, old, *read_class_map(_write_map(str(tmp_path / "m.txt"), mapping, "text")))
    torch.manual_seed(0)
    model = MLP(input_dim=24, embedding_size=D, hidden=8, depth=1)
    done = imprint_rows(head, model, IdentityFeatures(7, 2, feature_dim=24, latent_dim=4), grown.new_classes,
                        device="cpu", batch_size=3)
    weight = head.centers().view(7, k, D)
    for o, n in mapping.items():
        assert torch.equal(weight[n], reference[o])
    for n in (1, 3):
        assert torch.equal(weight[n, 1:], fresh[n, 1:])             # the other sub-centers stay fresh
        assert not torch.equal(weight[n, 0], fresh[n, 0]) and abs(float(weight[n, 0].norm()) - 1) < 1e-6
    assert (done.imprinted, done.images) == (2, 4)


class _Without(torch.utils.data.Dataset):
    """An identity-feature set without the images of the classes in ``drop`` (they
    keep their place in the label space)."""

    def __init__(self, base, drop):
        self.base = base
        keep = ~torch.isin(base.labels(), torch.tensor(sorted(drop), dtype=torch.int64))
        self.index = torch.nonzero(keep).view(-1)

    def __len__(self):
        return len(self.index)

    def labels(self):
        return self.base.labels()[self.index]

    def __getitem__(self, i):
        return self.base[int(self.index[i])]


N_IMPRINT = 13          # classes of the imprint test; the old head had 9 of them
DROPPED = (10,)         # a new class without training images


def _imprint_setup():
    """The backbone (with non-trivial BatchNorm statistics, so that eval mode matters)
    and the dataset, the same on every rank."""
    from ds_pfc.data.features import IdentityFeatures
    from ds_pfc.models.mlp import MLP
    torch.manual_seed(1)
    model = MLP(input_dim=24, embedding_size=D, hidden=16, depth=2)
    for m in model.modules():
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
    dataset = _Without(IdentityFeatures(N_IMPRINT, 3, feature_dim=24, latent_dim=8, seed=2), DROPPED)
    return model, dataset


def _imprint(rank, world_size, old, map_path):
    from ds_pfc.app.grow import grow_head, imprint_rows, read_class_map
    model, dataset = _imprint_setup()
    model.train()
    head = _head(N_IMPRINT, 11)
    grown = grow_head(head, old, *read_class_map(map_path))
    done = imprint_rows(head, model, dataset, grown.new_classes, device="cpu", batch_size=4)
    assert model.training                                     # its mode is given back
    return {"weight": head.state_dict()["weight"].clone(), "done": done, "new": grown.new_classes}


@pytest.mark.parametrize("world_size", [1, 2])
def test_imprinted_rows_are_the_normalised_mean_embedding(tmp_path, world_size):
    old = str(tmp_path / "old")
    _save_old_head(old, 1, num_classes=9)
    mapping = {0: 3, 1: 0, 2: 8, 3: 1, 4: 12, 5: 5, 6: 2, 7: 9, 8: 6}     # free: 4, 7, 10 (no images), 11
    map_path = _write_map(str(tmp_path / "map.json"), mapping, "json")
    results = run_ranks(_imprint, world_size, old, map_path)
    weight = torch.cat([r["weight"] for r in results])

    # The reference: item by item through a float64 copy of the backbone in eval mode.
    model, dataset = _imprint_setup()
    model64 = copy.deepcopy(model).double().eval()
    sums = torch.zeros(N_IMPRINT, D, dtype=torch.float64)
    seen = torch.zeros(N_IMPRINT, dtype=torch.int64)
    with torch.no_grad():
        for i in range(len(dataset)):
            image, label = dataset[i]
            x = (torch.as_tensor(image, dtype=torch.float64) - 127.5) / 127.5
            e = model64(x[None])[0]
            sums[label] += e / e.norm()
            seen[label] += 1
    fresh = _head(N_IMPRINT, 11).centers().double()
    old_rows = _merged_reference(old)["weight"]
    free = [4, 7, 10, 11]
    assert results[0]["new"].tolist() == free
    for o, n in mapping.items():
        assert torch.equal(weight[n], old_rows[o])
    for n in free:
        if seen[n] == 0:
            assert n in DROPPED and torch.equal(weight[n].double(), fresh[n])
            continue
        expected = sums[n] / sums[n].norm()                       # unit norm
        # float32's tolerance (the backbone runs in float32 there): another class's
        # direction, or the mean of unnormalised embeddings, is off by far more
        torch.testing.assert_close(weight[n].double(), expected, rtol=0, atol=2e-6)
    done = results[0]["done"]
    assert (done.imprinted, done.without_images, done.images) == (3, 1, 9)
    assert all(r["done"] == done for r in results)


@pytest.mark.parametrize("content, needle", [
    ("", "maps no class (an empty map)"),
    ("# nothing\n\n", "maps no class (an empty map)"),
    ("0 1\n1 1\n", "maps old ids 0 and 1 to the same new id 1"),
    ("0 1\n0 2\n", "lists old id 0 twice"),
    ("0 1 2\n", "line 1: expected two class ids"),
    ("0 -1\n", "line 1: expected two class ids"),
    ("old,new\n0,1\n", "line 1: expected two class ids"),
    ('{"0": 1, "1": 1}', "maps old ids 0 and 1 to the same new id 1"),
    ('{"0": 1, "0": 2}', "lists old id 0 twice"),
    ('{"a": 1}', "key 'a' is not an old class id"),
    ('{"0": 1.5}', "the new id of old id 0 must be an integer >= 0"),
    ('{"0": true}', "the new id of old id 0 must be an integer >= 0"),
    ('{"0": 1', "is not valid JSON"),
    ("{}", "maps no class (an empty map)"),
])
def test_a_bad_map_is_a_config_error_naming_the_key(tmp_path, content, needle):
    from ds_pfc.app.grow import read_class_map
    path = tmp_path / ("map.json" if content.startswith("{") else "map.txt")
    path.write_text(content)
    with pytest.raises(ConfigError) as err:
        read_class_map(str(path))
    assert str(err.value).startswith("ds_pfc.train.init.class_map: ") and needle in str(err.value)


def test_a_map_or_head_that_does_not_fit_is_a_config_error_naming_the_key(tmp_path):
    from ds_pfc.app.grow import grow_head, read_class_map
    old = str(tmp_path / "old")
    _save_old_head(old, 2)
    cases = [({0: 1, C_OLD: 2}, C_NEW, D, "ds_pfc.train.init.class_map: old id 17 is not a class of the old head"),
             ({0: C_NEW}, C_NEW, D, "ds_pfc.train.init.class_map: new id 23 is not a class of this head"),
             ({0: 1}, C_NEW, D + 1, "ds_pfc.train.init.head: " + old + " holds centers of embedding size 12")]
    for i, (mapping, classes, dim, needle) in enumerate(cases):
        from ds_pfc.core.head import PartialFC
        head = PartialFC(classes, dim, seed=1, optimizer="sgd", momentum=0.9)
        with pytest.raises(ConfigError) as err:
            grow_head(head, old, *read_class_map(_write_map(str(tmp_path / f"m{i}.txt"), mapping, "text")))
        assert needle in str(err.value)
    no_momentum = _head(C_NEW, 1, momentum=0.0)
    with pytest.raises(ConfigError, match=r"ds_pfc.train.init.head: .* holds states \['momentum_buffer', "
                                          r"'weight'\] .*init.optimizer_states false"):
        grow_head(no_momentum, old, *read_class_map(_write_map(str(tmp_path / "ok.txt"), {0: 1}, "text")))
    grown = grow_head(no_momentum, old, *read_class_map(str(tmp_path / "ok.txt")), optimizer_states=False)
    assert grown.states == ("weight",)


@pytest.mark.parametrize("init, needle", [
    ({"class_map": "/no/such/map.json", "head": "."}, "ds_pfc.train.init.class_map: no such file"),
    ({"class_map": __file__}, "ds_pfc.train.init.class_map maps the classes of a trained head"),
    ({"new_rows": "zeros"}, "ds_pfc.train.init.new_rows must be imprint or random"),
    ({"optimizer_states": "no"}, "ds_pfc.train.init.optimizer_states must be bool"),
    ({"optimizer_states": False}, "ds_pfc.train.init.optimizer_states false applies to the rows of"),
])
def test_bad_init_keys_are_config_errors(tmp_path, init, needle):
    from ds_pfc.app.config import split_config
    if init.get("head") == ".":
        _save_old_head(str(tmp_path / "old"), 1)
        init = dict(init, head=str(tmp_path / "old"))
    config = _tiny()
    config["ds_pfc"]["train"]["init"] = init
    with pytest.raises(ConfigError) as err:
        split_config(config)
    assert needle in str(err.value)


# ------------------------------------------------------------------ the train command
def _tiny() -> dict:
    """The train app's tiny job, with 30 classes, 3 steps and no checkpoints between."""
    from test_train_app import TINY
    config = copy.deepcopy(TINY)
    config.pop("csv_monitor")
    config["ds_pfc"]["head"]["num_classes"] = 30
    config["ds_pfc"]["train"]["max_steps"] = 3
    config["ds_pfc"]["evaluation"]["synthetic_pairs"] = 20
    config["ds_pfc"]["checkpoint"] = {"every_steps": 0, "keep": 0}
    return config


def _save_head_of(directory, num_classes, embedding_size):
    """A 24-class head on one process, rewritten as 2 shards (an old run's layout)."""
    from ds_pfc.checkpoint.shards import reshard, save_head_shard
    from ds_pfc.core.head import PartialFC
    head = PartialFC(num_classes, embedding_size, seed=4, optimizer="sgd", momentum=0.9)
    one = directory + "-1"
    os.makedirs(one)
    save_head_shard(head, one)
    reshard(one, directory, 2)


def test_the_train_command_grows_a_24_class_head_to_30_and_trains(tmp_path):
    pytest.importorskip("deepspeed")
    old = str(tmp_path / "old")
    _save_head_of(old, 24, 32)
    mapping = {o: (7 * o) % 29 for o in range(24)}                # 24 distinct ids of 0..28; 6 free
    map_path = _write_map(str(tmp_path / "map.txt"), mapping, "text")
    config = _tiny()
    config["ds_pfc"]["train"]["init"] = {"head": old, "class_map": map_path}
    path = tmp_path / "job.json"
    path.write_text(json.dumps(config))
    out = str(tmp_path / "run")
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    env.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(ROOT, ".torch_extensions"))

    def train(*extra):        # a process of its own, forked from the tests' fork server
        [code], [(stdout, stderr)] = run_script_ranks(
            TRAIN, ["--deepspeed_config", str(path), "--output_dir", out, *extra], [env], ROOT)
        assert code == 0, f"{stdout[-3000:]}\n{stderr[-3000:]}"
        return stdout

    stdout = train()
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    assert summary["steps"] == 3 and len(summary["losses"]) == 3
    assert all(torch.isfinite(torch.tensor(summary["losses"])))
    line = [x for x in stdout.splitlines() if "init: head grown" in x]
    assert len(line) == 1, stdout[-3000:]
    assert "(24 classes on 2 rank(s)) to 30 classes" in line[0]
    assert "24 old rows moved (with optimizer states), 6 imprinted, 0 random (18 images embedded)" in line[0]
    # A resume reads the checkpoint, never the old head or the map again.
    os.remove(map_path)
    with open(map_path, "w") as f:
        f.write("this is no map\n")
    stdout = train("--resume", "--max_steps", "4")
    assert "init: head grown" not in stdout and "pretrained weights are not read" in stdout


# ------------------------------------------------------------------ the study
def test_the_study_pair_set_is_the_new_identities_held_out_vectors(tmp_path):
    pytest.importorskip("PIL")
    from ds_pfc.bench.grow import FEATURES, steps_to, write_pairs_bin
    from ds_pfc.data.features import IdentityFeatures
    from ds_pfc.data.transforms import decode_image
    from ds_pfc.eval.verification import load_bin
    path = write_pairs_bin(str(tmp_path / "new.bin"), first_identity=7, identities=5, pairs=11,
                           images_per_identity=3)
    images, issame = load_bin(path, decode=decode_image)
    expected, same = IdentityFeatures(5, 3, first_identity=7, **FEATURES).pairs(11)
    assert issame == same and len(images) == 22
    decoded = torch.stack(images).float()
    assert decoded.shape == expected.shape
    assert (decoded - expected).abs().max() <= 0.5           # 8-bit rounding of the pixel units, no more
    assert steps_to({0: 0.5, 5: 0.9, 10: 0.95}, 0.9) == 5 and steps_to({0: 0.5}, 0.9) is None


def test_the_study_runs_in_its_quick_version(tmp_path, monkeypatch):
    """The study's command in this process; its three training runs are processes of their
    own, forked from the tests' fork server instead of fresh interpreters."""
    pytest.importorskip("deepspeed")
    pytest.importorskip("PIL")
    from _inprocess import call_main

    from ds_pfc.bench import grow

    monkeypatch.setattr(grow, "_launch", run_train_forked)
    out = str(tmp_path / "grow.json")
    monkeypatch.chdir(tmp_path)
    code, stdout, stderr = call_main(grow.main, ["--quick", "--seeds", "0", "--out", out])
    assert code == 0, stdout[-2000:] + stderr[-2000:]
    assert "steps to 0.9" in stdout
    with open(out) as f:
        doc = json.load(f)
    assert [r["new_rows"] for r in doc["results"]] == ["imprint", "random"]
    lines = {r["new_rows"]: r["init_line"] for r in doc["runs"]}
    assert "24 old rows moved (with optimizer states), 6 imprinted, 0 random" in lines["imprint"]
    assert "24 old rows moved (with optimizer states), 0 imprinted, 6 random" in lines["random"]
    assert {"machine", "versions", "date", "config"} <= set(doc)


def test_the_studys_runs_are_fresh_interpreters_by_default(monkeypatch, tmp_path):
    """Without the tests' fork server, a study run is ``python -m ds_pfc.cli.train argv``."""
    import subprocess
    import sys

    from ds_pfc.bench import grow
    calls = []

    def run(cmd, **kwargs):
        calls.append((cmd, kwargs["env"], kwargs["cwd"]))
        return subprocess.CompletedProcess(cmd, 0, "out", "err")
    monkeypatch.setattr(grow.subprocess, "run", run)
    assert grow._launch(["--output_dir", "x"], {"A": "1"}, str(tmp_path)) == (0, "out", "err")
    assert calls == [([sys.executable, "-m", "ds_pfc.cli.train", "--output_dir", "x"], {"A": "1"}, str(tmp_path))]
