"""Exports of a training checkpoint that need the job: the backbone as ONNX
(:func:`export_onnx`), the backbone rebuilt from its job config (:func:`load_backbone`)
and the dominant sub-centers over the job's training set (:func:`dominant_subcenters`).
The file-only exports live in :mod:`ds_pfc.checkpoint.export` and are re-exported here.
"""
from __future__ import annotations

import json
import os

import torch

from ..checkpoint import shards as ckpt
from ..checkpoint.export import (EXPORT_FORMAT, backbone_state_dict, export_checkpoint, read_marker,  # noqa: F401
                                 reshard_checkpoint, resolve_tag)

__all__ = ["backbone_state_dict", "export_checkpoint", "export_onnx", "resolve_tag", "EXPORT_FORMAT",
           "backbone_weights", "load_backbone", "is_model_folder", "MODEL_FILE", "reshard_checkpoint", "dominant_subcenters"]


class _HalfInside(torch.nn.Module):
    """Runs a float16 copy of a backbone behind a float32 input and output."""

    def __init__(self, backbone: torch.nn.Module):
        super().__init__()
        self.backbone = backbone

    def forward(self, x):
        return self.backbone(x.half()).float()


def export_onnx(backbone: torch.nn.Module, out_path: str, *, image_size: int = 112, opset: int = 17,
                batch: int | None = None, fp16: bool = False) -> str:
    """Export ``backbone`` (eval mode, CPU) to ONNX: input ``images [B, 3, H, W]``
    float32 RGB normalised as ``(x - 127.5) / 127.5``, output ``embeddings [B, d]``
    float32 (unnormalised), no preprocessing inside the graph, which is what
    insightface's ``model_zoo.get_model`` expects of a recognition model.

    ``batch``: None for a dynamic batch axis (default), else the static batch size.
    ``opset``: the ONNX opset (9 .. 20). ``fp16``: float16 weights and arithmetic
    (the input and output stay float32, casts at the graph's ends). The export works
    on a copy; ``backbone`` is left as it was. Needs the ``onnx`` package
    (``pip install ds_pfc[onnx]``)."""
    import copy
    import warnings
    if isinstance(opset, bool) or not isinstance(opset, int) or not 9 <= opset <= 20:
        raise ValueError(f"opset must be an int in 9 .. 20, got {opset!r}")
    if batch is not None and (isinstance(batch, bool) or not isinstance(batch, int) or batch < 1):
        raise ValueError(f"batch must be None (dynamic) or a positive int, got {batch!r}")
    if isinstance(image_size, bool) or not isinstance(image_size, int) or image_size < 1:
        raise ValueError(f"image_size must be a positive int, got {image_size!r}")
    try:
        import onnx  # noqa: F401  (the exporter needs it)
    except ImportError:
        raise RuntimeError("ONNX export needs the 'onnx' package: pip install onnx") from None
    model = copy.deepcopy(backbone).cpu().eval()
    model = _HalfInside(model.half()).eval() if fp16 else model.float()
    example = torch.zeros(batch or 2, 3, image_size, image_size)
    dynamic = None if batch else {"images": {0: "batch"}, "embeddings": {0: "batch"}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            torch.onnx.export(model, (example,), out_path, dynamo=False, opset_version=opset,
                              input_names=["images"], output_names=["embeddings"], dynamic_axes=dynamic)
        except Exception as err:      # an operator without a symbolic in this opset, ...
            first = str(err).strip().splitlines()[0] if str(err).strip() else ""
            raise RuntimeError(f"ONNX export at opset {opset} failed ({type(err).__name__}: {first})") from None
    return out_path


MODEL_FILE = "model.safetensors"
"""The weights file of a model folder (``ds-pfc-export backbone``/``hub``)."""
CONFIG_FILE = "config.json"


def is_model_folder(path: str) -> bool:
    """Whether ``path`` is a folder written by ``ds-pfc-export backbone``/``hub``."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, MODEL_FILE)) \
        and os.path.isfile(os.path.join(path, CONFIG_FILE))


def backbone_weights(path: str, tag: str | None = None) -> tuple[dict, dict, dict | None, str | None]:
    """``(float32 state dict, job config, marker, tag directory)`` of the backbone in an
    export (``.safetensors``; marker and tag directory None), a model folder of
    ``ds-pfc-export backbone``/``hub`` (:mod:`ds_pfc.app.hub`) or a checkpoint directory
    (its ``latest`` tag unless ``tag``; a tag directory works too)."""
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load_file

    if is_model_folder(path):
        path = os.path.join(path, MODEL_FILE)
    if not os.path.exists(path) and path.endswith(".safetensors"):
        raise FileNotFoundError(f"model file not found: {path!r}")
    if os.path.isfile(path):
        try:
            with safe_open(path, "pt") as f:
                metadata = f.metadata() or {}
        except SafetensorError as err:
            raise ValueError(f"{path} is not a safetensors file ({err}); give a ds_pfc model export "
                             "(export/model.safetensors) or a checkpoint directory") from None
        if metadata.get("format") != EXPORT_FORMAT or "config" not in metadata:
            raise ValueError(f"{path} is not a ds_pfc model export (format {metadata.get('format')!r})")
        state = {k[len("backbone."):]: v for k, v in load_file(path).items() if k.startswith("backbone.")}
        return state, json.loads(metadata["config"]), None, None
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no checkpoint directory, model folder or model export at {path!r}")
    tag_dir = resolve_tag(path, tag)
    marker = read_marker(tag_dir)
    config = (marker.get("metadata") or {}).get("config")
    if config is None:
        raise ValueError(f"{tag_dir} does not record its job config; export it with the training app")
    return backbone_state_dict(tag_dir), config, marker, tag_dir


def load_backbone(path: str, tag: str | None = None):
    """``(backbone, config)`` from an export (``.safetensors``), a model folder of
    ``ds-pfc-export backbone``/``hub`` or a checkpoint directory (its ``latest`` tag unless
    ``tag``; see :func:`backbone_weights`); the backbone is rebuilt from the job config
    stored with it and holds the trained float32 weights, in eval mode."""
    import warnings

    from .config import split_config
    state, config, _, _ = backbone_weights(path, tag)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, cfg = split_config(config, strict=False)
    backbone = cfg.backbone.build(cfg.head.embedding_size)
    backbone.load_state_dict(state)
    return backbone.eval(), config


def dominant_subcenters(tag_dir: str, *, name: str = "head", batch_size: int = 128, device="cpu",
                        log=None) -> "torch.Tensor":
    """The dominant sub-center of every class of head ``name`` in checkpoint
    ``tag_dir`` (int64 ``[C]``): the sub-center paper's statistic, the one most
    training images of the class are closest to, with the checkpoint's backbone
    embedding the job's training set (as the job built it, stress transforms
    included). One pass over the training data in this process."""
    import warnings

    from ..checkpoint.shards import SubcenterCounter
    from .config import split_config
    from ..data.loader import _fetch
    from ..data.transforms import normalize
    from .datasets import build_train_set
    log = log or (lambda line: None)
    backbone, config = load_backbone(os.path.dirname(os.path.normpath(tag_dir)), os.path.basename(
        os.path.normpath(tag_dir)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, cfg = split_config(config, strict=False)
    tensors, meta = ckpt.merge_shards(tag_dir, name=name)
    counter = SubcenterCounter(tensors["weight"], meta["sub_centers"])
    dataset = build_train_set(cfg)
    backbone = backbone.to(device)
    total = len(dataset)
    with torch.no_grad():
        for start in range(0, total, batch_size):
            index = torch.arange(start, min(total, start + batch_size))
            images, labels = _fetch(dataset, index)
            counter.update(backbone(normalize(images).to(device)), labels)
            if (start // batch_size) % 50 == 0:
                log(f"dominant sub-centers: {min(total, start + batch_size)}/{total} images")
    return counter.dominant()
