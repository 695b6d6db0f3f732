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


# -- what the card says ran, and how to install ds_pfc ---------------------------------------
def _tiny_run(tmp_path, steps: int = 2, output=None, extra_args=(), **head) -> str:
    """An in-process run of the tiny app config (head keys replaced by ``head``); its run directory."""
    from _inprocess import train_here
    from test_train_app import TINY
    config = json.loads(json.dumps(TINY))
    config["ds_pfc"]["head"].update(head)
    config["ds_pfc"]["evaluation"] = {"synthetic_pairs": 0}
    path = tmp_path / f"job-{len(os.listdir(tmp_path))}.json"
    path.write_text(json.dumps(config))
    out = output or str(tmp_path / "run")
    train_here(["--deepspeed_config", str(path), "--output_dir", out, "--max_steps", str(steps), *extra_args])
    return out


def _card(source, out) -> str:
    from ds_pfc.app.hub import export_hub
    return open(export_hub(str(source), str(out))["card"]).read()


def _row(card: str, name: str) -> str:
    [value] = re.findall(rf"^\| {re.escape(name)} \| (.*) \|$", card, re.M)
    return value


def _product_dtypes(compute_dtype: str) -> set:
    """The dtypes of the matrix products a head built from the tiny config with
    ``compute_dtype`` runs on this CPU, seen by a dispatch mode around its forward."""
    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode

    from _dist import one_process_world
    from ds_pfc.app.config import split_config
    from test_train_app import TINY
    config = json.loads(json.dumps(TINY))
    config["ds_pfc"]["head"]["compute_dtype"] = compute_dtype
    _, cfg = split_config(config)
    seen = set()
    aten = torch.ops.aten
    products = {aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten.matmul}

    class Products(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in products:        # any overload (mm.out too): the operands' dtype
                operands = [a for a in args if isinstance(a, torch.Tensor)][-2:]
                seen.update(str(a.dtype).removeprefix("torch.") for a in operands)
            return func(*args, **(kwargs or {}))
    with one_process_world():
        dist.init_process_group("gloo")
        head = cfg.head.build(device=torch.device("cpu"))
        x = torch.randn(8, cfg.head.embedding_size)
        with Products():
            head(x, torch.arange(8) % cfg.head.num_classes)
        head.close()
    return seen


def test_card_states_what_ran_on_a_cpu_not_the_config(tmp_path):
    import deepspeed

    from ds_pfc import __version__
    from ds_pfc.checkpoint.tags import read_marker
    run = _tiny_run(tmp_path)                      # compute_dtype "auto"
    card = _card(os.path.join(run, "checkpoints"), tmp_path / "hub")
    ran = _product_dtypes("auto")
    assert ran == {"float32"}                     # what a CPU head multiplies in, seen from outside
    assert _row(card, "precision (as run)") == "backbone float32, head products float32"
    assert _row(card, "device (as run)") == "cpu" and _row(card, "ranks") == "1"
    assert "bf16" not in card and "bfloat16" not in card
    assert f"Trained with ds_pfc {__version__}, torch {torch.__version__}, deepspeed {deepspeed.__version__}." in card
    marker = read_marker(os.path.join(run, "checkpoints", "step00000002"))
    assert marker["metadata"]["ran"] == [{"steps": [1, 2], "device": "cpu", "world_size": 1,
                                          "head_products": "float32", "backbone": "float32",
                                          "versions": f"ds_pfc {__version__}, torch {torch.__version__}, "
                                                      f"deepspeed {deepspeed.__version__}"}]
    # ds_pfc is on no package index: the card never tells people to install it from one
    assert "pip install ds_pfc`" not in card and "pip install ds_pfc " not in card
    assert "not on a package index" in card and f"ds_pfc {__version__}" in card
    # a model folder exported from it carries the record, and a card made from the folder says the same
    again = _card(tmp_path / "hub", tmp_path / "hub2")
    assert _row(again, "precision (as run)") == _row(card, "precision (as run)")
    assert _row(again, "steps") == "2"
    # and so does the run's own export
    again = _card(os.path.join(run, "export", "model.safetensors"), tmp_path / "hub3")
    assert _row(again, "precision (as run)") == _row(card, "precision (as run)")
    assert _row(again, "device (as run)") == "cpu" and _row(again, "steps") == "2"


def test_card_of_a_bf16_run_says_bf16_and_a_resume_in_fp32_says_both(tmp_path):
    import warnings
    ran = _product_dtypes("bf16")
    assert ran == {"bfloat16"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")          # bf16 products on a CPU without bf16 instructions
        run = _tiny_run(tmp_path, compute_dtype="bf16")
    card = _card(os.path.join(run, "checkpoints"), tmp_path / "hub")
    assert _row(card, "precision (as run)") == "backbone float32, head products bfloat16"
    _tiny_run(tmp_path, steps=4, output=run, extra_args=("--allow_config_change",), compute_dtype="fp32")
    card = _card(os.path.join(run, "checkpoints"), tmp_path / "hub2")
    assert _row(card, "precision (as run)") == ("steps 1-2: backbone float32, head products bfloat16; "
                                                 "steps 3-4: backbone float32, head products float32")
    assert _row(card, "device (as run)") == "cpu" and _row(card, "steps") == "4"


def test_card_of_a_checkpoint_without_the_record_says_not_recorded(tmp_path):
    from ds_pfc.checkpoint.tags import COMPLETE_MARKER
    run = _tiny_run(tmp_path)
    marker_path = os.path.join(run, "checkpoints", "step00000002", COMPLETE_MARKER)
    marker = json.load(open(marker_path))
    del marker["metadata"]["ran"]                  # as a checkpoint of an earlier version is
    with open(marker_path, "w") as f:
        json.dump(marker, f)
    card = _card(os.path.join(run, "checkpoints"), tmp_path / "hub")
    for row in ("precision (as run)", "device (as run)"):
        assert _row(card, row).startswith("not recorded"), card
    assert _row(card, "ranks") == "1 (in the run that wrote the checkpoint)"
    assert "The versions it was trained with: not recorded" in card
    assert "float32" not in _row(card, "precision (as run)") and "bf16" not in card
    # resumed, the old steps stay unrecorded and the new ones are
    _tiny_run(tmp_path, steps=4, output=run)
    card = _card(os.path.join(run, "checkpoints"), tmp_path / "hub2")
    assert re.fullmatch(r"steps 1-2: not recorded \(.*\); steps 3-4: backbone float32, head products float32",
                        _row(card, "precision (as run)"))


class _Dist:
    """An installed distribution as ``importlib.metadata`` gives it, with a ``direct_url.json``."""

    def __init__(self, direct_url, version="9.8.7"):
        self.version = version
        self._text = None if direct_url is None else json.dumps(direct_url)

    def read_text(self, name):
        return self._text if name == "direct_url.json" else None


@pytest.mark.parametrize("direct_url, line", [
    ({"url": "https://github.com/example/ds_pfc.git",
      "vcs_info": {"vcs": "git", "commit_id": "0123456789abcdef0123456789abcdef01234567",
                   "requested_revision": "main"}},
     'pip install "ds_pfc @ git+https://github.com/example/ds_pfc.git@0123456789abcdef0123456789abcdef01234567"'),
    ({"url": "https://example.org/wheels/ds_pfc-9.8.7-py3-none-any.whl",
      "archive_info": {"hashes": {"sha256": "ab" * 32}}},
     'pip install "ds_pfc @ https://example.org/wheels/ds_pfc-9.8.7-py3-none-any.whl"'),
    ({"url": "file:///home/someone/ds_pfc", "dir_info": {"editable": True}}, None),
    ({"url": "file:///home/someone/ds_pfc", "dir_info": {}}, None),
    ({"url": "file:///tmp/ds_pfc-9.8.7-py3-none-any.whl", "archive_info": {}}, None),
    (None, None),
], ids=["git", "wheel-url", "editable-dir", "local-dir", "local-wheel", "no-record"])
def test_install_line_follows_the_installed_distribution(monkeypatch, tmp_path, trained, direct_url, line):
    import importlib.metadata
    real = importlib.metadata.distribution

    def distribution(name):
        return _Dist(direct_url) if name == "ds_pfc" else real(name)
    monkeypatch.setattr(importlib.metadata, "distribution", distribution)
    run, _ = trained
    card = _card(run / "checkpoints", tmp_path / "hub")
    assert "pip install ds_pfc`" not in card and "pip install ds_pfc " not in card
    assert "ds_pfc 9.8.7, which is not on a package index" in card
    if line is not None:
        assert f"`{line}`" in card
    else:
        assert "pip install \"ds_pfc @" not in card
        assert "install ds_pfc 9.8.7 from its source or a wheel" in card


def test_install_line_without_an_installed_distribution(monkeypatch):
    import importlib.metadata

    from ds_pfc import __version__
    from ds_pfc.app.hub import install_text

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)
    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    text = install_text()
    assert f"install ds_pfc {__version__} from its source" in text and "pip install ds_pfc " not in text
