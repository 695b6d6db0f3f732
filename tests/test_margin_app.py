"""Every margin loss trains in the app (``launch/train.py``'s entry, run in-process)
from its shipped CPU config, shrunk to seconds: the training accuracy rises, the loss
falls (MagFace's may not, see below) and held-out verification is above chance;
the stateful losses (AdaFace, CurricularFace, ElasticFace) resume bitwise from a
checkpoint taken mid-run (mid-epoch).

The app runs in this process, in a one-process world, as tests/test_run_outputs.py
runs it: a fresh interpreter per run would spend seconds importing torch, DeepSpeed
and torch._dynamo again each time (9 runs here); each run builds its own engine, head,
data and RNG state from the config and the checkpoint as a launched one does."""
from __future__ import annotations

import copy
import json
import os
import re
import shutil

import pytest
import torch

pytest.importorskip("deepspeed")

from _inprocess import call_main, train_here  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Checkpoints at steps 40, 80 and 90 (the last): the resume from 2 * EVERY re-trains the
# last 10 steps, from the middle of the third epoch (30 steps per epoch).
STEPS, EVERY = 90, 40
SIZE = 40           # pixels: the smallest the backbones' strides take that still learn in 90 steps
CONFIGS = ["cpu_adaface.json", "cpu_magface.json", "cpu_curricularface.json", "cpu_elastic_arcface.json",
           "cpu_elastic_cosface.json", "cpu_subcenter_arcface.json"]
STATEFUL = {"cpu_adaface.json", "cpu_curricularface.json", "cpu_elastic_arcface.json"}


def _small(name, out_dir):
    with open(os.path.join(ROOT, "configs", name)) as f:
        config = json.load(f)
    config = copy.deepcopy(config)
    config["train_micro_batch_size_per_gpu"] = 32
    config["optimizer"]["params"]["lr"] = 0.05
    pfc = config["ds_pfc"]
    pfc["head"]["num_classes"] = 120
    pfc["backbone"]["options"] = {"image_size": SIZE}
    pfc["data"]["synthetic"].update(images_per_identity=8, held_out_identities=60, image_size=SIZE)
    pfc["train"].update(epochs=100.0, max_steps=STEPS, log_every=15, output_dir=out_dir)
    pfc["evaluation"].update(synthetic_pairs=400)
    pfc["checkpoint"].update(every_steps=EVERY, keep=3, export=False)
    path = out_dir + ".json"
    with open(path, "w") as f:
        json.dump(config, f)
    return path


def _train(config, *args):
    """``launch/train.py --deepspeed_config config *args``; its console output."""
    return train_here(["--deepspeed_config", config, *args])


def _summary(out_dir):
    with open(os.path.join(out_dir, "summary.json")) as f:
        return json.load(f)


@pytest.mark.parametrize("name", CONFIGS)
def test_margin_loss_trains_in_the_app(name, tmp_path):
    out = str(tmp_path / "run")
    config = _small(name, out)
    log = _train(config)
    summary = _summary(out)
    losses = summary["losses"]
    assert len(losses) == STEPS
    first, last = sum(losses[:15]) / 15, sum(losses[-15:]) / 15
    accuracies = [float(a) for a in re.findall(r"^step \d+/\d+ .* acc ([0-9.]+)", log, re.M)]
    assert len(accuracies) == STEPS // 15 and accuracies[-1] > 3 * accuracies[0], (name, accuracies)
    if name == "cpu_magface.json":
        # MagFace's loss need not fall early: its margin grows with the feature norm
        # (up to u_m) and the regulariser is part of it; the fit shows in the accuracy.
        pass
    else:
        assert last < 0.9 * first, (name, first, last)
    accuracy = summary["evaluations"][str(STEPS)]["synthetic_held_out"]["accuracy"]
    assert accuracy > 0.6, (name, accuracy)          # chance is 0.5
    head_line = next(line for line in log.splitlines() if line.startswith("ds_pfc:"))
    assert ("sub_centers=3" in head_line) == (name == "cpu_subcenter_arcface.json"), head_line
    if name == "cpu_subcenter_arcface.json":
        _check_classifier_export(out, str(tmp_path / "classifier.safetensors"))
    if name not in STATEFUL:
        return
    # resume from the checkpoint of step 2 * EVERY (mid-epoch) in a copy: the same remaining losses, bitwise
    again = str(tmp_path / "again")
    shutil.copytree(out, again)
    os.remove(os.path.join(again, "summary.json"))
    _train(_small(name, again), "--resume_from", f"step{2 * EVERY:08d}")
    resumed = _summary(again)
    assert resumed["resumed"] and resumed["losses"] == losses, name
    assert resumed["evaluations"][str(STEPS)] == summary["evaluations"][str(STEPS)]


def _check_classifier_export(out, path):
    """``launch/export.py classifier --dominant``: the K rows of every class, and the
    dominant sub-center the reference computes from the same embeddings."""
    import torch
    from safetensors.torch import load_file

    import _margin_references as R
    from ds_pfc.data import SyntheticFaces
    from ds_pfc.data.transforms import normalize
    from ds_pfc.app.export import load_backbone
    from ds_pfc.cli.export import main         # launch/export.py's
    status, stdout, stderr = call_main(main, ["classifier", "--checkpoint", os.path.join(out, "checkpoints"),
                                              "--out", path, "--dominant"])
    assert status == 0, stdout[-2000:] + stderr[-2000:]
    got = load_file(path)
    assert got["weight"].shape == (120 * 3, 128) and got["dominant"].shape == (120,)
    backbone, config = load_backbone(os.path.join(out, "checkpoints"))
    s = config["ds_pfc"]["data"]["synthetic"]
    faces = SyntheticFaces(120, s["images_per_identity"], image_size=s["image_size"], seed=s["seed"])
    images = torch.stack([faces[i][0] for i in range(len(faces))])
    with torch.no_grad():
        emb = backbone(normalize(images))
    expected = R.dominant_subcenters(emb.double(), got["weight"].double(), faces.labels(), k=3)
    assert torch.equal(got["dominant"], expected)
    assert len(set(expected.tolist())) > 1                   # not a degenerate all-zero answer
    assert torch.equal(got["weight_dominant"], got["weight"][torch.arange(120) * 3 + expected])
