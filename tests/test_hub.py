"""Sharing a trained model offline: the backbone alone, a Hugging Face model folder (model
card with the training config, results and versions, loading code that runs), ``load_model``
on such a folder, and the upload through ``huggingface_hub``'s API (a recording stand-in)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 2-step run of the tiny app config: its checkpoints, summary and full export."""
    from test_train_app import TINY
    tmp = tmp_path_factory.mktemp("hub")
    config = json.loads(json.dumps(TINY))
    path = tmp / "job.json"
    path.write_text(json.dumps(config))
    out = tmp / "run"
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    env.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(ROOT, ".torch_extensions"))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "launch", "train.py"), "--deepspeed_config",
                           str(path), "--output_dir", str(out), "--max_steps", "2"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, tmp


def _export(*args):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "ds_pfc.cli.export", *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def _embed(model):
    torch.manual_seed(0)
    images = torch.rand(3, 3, 112, 112) * 2 - 1
    with torch.no_grad():
        return model(images)


def test_backbone_export_holds_the_backbone_alone_and_loads_back_exactly(trained, tmp_path):
    from ds_pfc.app.eval_models import load_model
    run, _ = trained
    folder = tmp_path / "backbone"
    proc = _export("backbone", "--checkpoint", str(run / "checkpoints"), "--out", str(folder))
    assert proc.returncode == 0, proc.stderr[-2000:]
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert keys and all(k.startswith("backbone.") for k in keys)          # no classifier
    full = run / "export" / "model.safetensors"
    with safe_open(str(full), "pt") as f:
        assert any(k.startswith("heads.") for k in f.keys())
        for key in keys:                                                     # the same weights, bitwise
            with safe_open(str(folder / "model.safetensors"), "pt") as g:
                assert torch.equal(f.get_tensor(key), g.get_tensor(key)), key
    assert os.path.getsize(folder / "model.safetensors") < os.path.getsize(full)
    facts = json.load(open(folder / "config.json"))
    assert (facts["backbone"], facts["embedding_size"], facts["num_classes"]) == ("vit_t", 32, 24)
    assert facts["job_config"]["ds_pfc"]["head"]["num_classes"] == 24 and facts["global_steps"] == 2
    model, config, kind = load_model(str(folder))
    reference, _, _ = load_model(str(full))
    assert kind == "ds_pfc" and config == facts["job_config"]
    assert torch.equal(_embed(model), _embed(reference))


def test_hub_folder_has_a_model_card_whose_code_runs(trained, tmp_path):
    run, _ = trained
    ijb = tmp_path / "ijb.json"
    ijb.write_text(json.dumps({"IJBC": {"tar_at_far": {"1e-05": 0.91, "0.0001": 0.95}}}))
    folder = tmp_path / "hub"
    proc = _export("hub", "--checkpoint", str(run / "checkpoints"), "--out", str(folder), "--name",
                   "tiny-vit-cosface", "--results", str(ijb))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert sorted(os.listdir(folder)) == ["README.md", "config.json", "model.safetensors"]
    card = open(folder / "README.md").read()
    assert card.startswith("---\nlibrary_name: ds_pfc\n") and "# tiny-vit-cosface" in card
    summary = json.load(open(run / "summary.json"))
    last = max(summary["evaluations"], key=int)
    [(name, result)] = summary["evaluations"][last].items()
    assert f"1:1 verification at step {last}" in card
    assert f"| {name} | {result['accuracy']:.4f} +- {result['accuracy_std']:.4f} |" in card
    assert "| IJBC | | TAR@FAR=1e-05: 0.9100, TAR@FAR=0.0001: 0.9500 |" in card
    assert "| identities (classes) | 24 |" in card and "| margin | cosface margin 0.2, scale 16.0 |" in card
    assert "| steps | 2 |" in card and "| global batch | 8 |" in card
    assert f"torch {torch.__version__}" in card
    # the card's code loads the model from the folder and embeds
    [code] = re.findall(r"```python\n(.*?)```", card, re.S)
    scope = {}
    exec(code.replace("path/to/this/folder", str(folder)), scope)          # noqa: S102 - our own card
    assert scope["embeddings"].shape == (2, 32) and -1.0 <= scope["similarity"] <= 1.0


class _RecordingHub:
    """What ds_pfc asks of huggingface_hub.HfApi, recorded."""

    def __init__(self):
        self.calls = []

    def create_repo(self, **kwargs):
        self.calls.append(("create_repo", kwargs))
        return f"https://huggingface.co/{kwargs['repo_id']}"

    def upload_folder(self, **kwargs):
        self.calls.append(("upload_folder", {**kwargs, "files": sorted(os.listdir(kwargs["folder_path"]))}))


def test_push_uploads_the_folder_through_the_hub_api(trained, tmp_path):
    from huggingface_hub import HfApi

    from ds_pfc.app.hub import export_hub, push_to_hub
    run, _ = trained
    folder = tmp_path / "hub"
    export_hub(str(run / "checkpoints"), str(folder))
    hub = _RecordingHub()
    url = push_to_hub(str(folder), "someone/tiny-face", private=True, api=hub)
    assert url == "https://huggingface.co/someone/tiny-face"
    assert [name for name, _ in hub.calls] == ["create_repo", "upload_folder"]
    assert hub.calls[0][1] == {"repo_id": "someone/tiny-face", "repo_type": "model", "private": True,
                               "exist_ok": True}
    upload = hub.calls[1][1]
    assert upload["repo_id"] == "someone/tiny-face" and upload["repo_type"] == "model"
    assert upload["files"] == ["README.md", "config.json", "model.safetensors"]
    # the real client takes these keyword arguments
    import inspect
    for name, kwargs in hub.calls:
        params = inspect.signature(getattr(HfApi, name)).parameters
        assert set(kwargs) - {"files"} <= set(params), name
    with pytest.raises(ValueError, match="not a model folder"):
        push_to_hub(str(tmp_path), "someone/x", api=hub)

    class Offline(_RecordingHub):
        def upload_folder(self, **kwargs):
            raise OSError("connection refused")
    with pytest.raises(RuntimeError, match="uploading .* to someone/tiny-face failed: OSError: connection refused"):
        push_to_hub(str(folder), "someone/tiny-face", api=Offline())
