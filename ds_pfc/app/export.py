"""Exports of a training checkpoint: one safetensors file with the backbone and the
merged classifier(s), and the backbone as ONNX.

A checkpoint tag directory (see :class:`~ds_pfc.deepspeed_plugin.PfcEngine`) holds
DeepSpeed's engine files and per-rank head shards. The backbone's state dict comes
from DeepSpeed's files (:func:`backbone_state_dict`); the classifier from
:func:`ds_pfc.checkpoint.merge_shards`.
"""
from __future__ import annotations

import glob
import json
import os

import torch

from . import checkpoint as ckpt
from .deepspeed_plugin import COMPLETE_MARKER

__all__ = ["backbone_state_dict", "export_checkpoint", "export_onnx", "resolve_tag", "EXPORT_FORMAT"]

EXPORT_FORMAT = "ds_pfc.model/1"


def resolve_tag(checkpoint_dir: str, tag: str | None = None) -> str:
    """``checkpoint_dir/tag``, checked complete and intact (every file there, sizes as
    saved, checksums of the ``torch.save`` files). Without ``tag``: the tag ``latest``
    names, or the newest complete one when ``latest`` is missing or lags behind it
    (a warning says so). A damaged checkpoint raises
    :class:`~ds_pfc.checkpoint_tags.CheckpointError` naming the file and the newest
    intact tag; a directory without checkpoints raises FileNotFoundError."""
    import warnings

    from . import checkpoint_tags as tags
    if not os.path.isdir(checkpoint_dir):
        raise FileNotFoundError(f"checkpoint directory {checkpoint_dir} does not exist")
    choice = tags.choose_tag(checkpoint_dir, tag)
    if choice is None:
        raise FileNotFoundError(f"{checkpoint_dir} holds no complete ds_pfc checkpoint (no {COMPLETE_MARKER})")
    tag_dir = os.path.join(checkpoint_dir, choice.tag)
    try:
        tags.verify_tag(tag_dir, choice.marker)
    except tags.CheckpointError as err:
        err = tags.with_fallback(err, checkpoint_dir, exclude=(choice.tag,))
        if err.fallback is not None:
            err = type(err)(f"{err}; pass that tag explicitly", path=err.path, fallback=err.fallback)
        raise err from None
    if choice.note:
        warnings.warn(choice.note, stacklevel=2)
    return tag_dir


def backbone_state_dict(tag_dir: str) -> dict[str, torch.Tensor]:
    """The engine module's full state dict (every parameter, frozen ones included, and
    every persistent buffer), floating-point tensors in float32, in the module's order.

    Where ZeRO optimizer partitions exist (ZeRO 1-3), the trainable parameters are
    DeepSpeed's ``zero_to_fp32`` reconstruction of the float32 master weights. It holds
    frozen parameters only at ZeRO 2 and 3, where DeepSpeed saves their fragments; at
    ZeRO 1 they, and everything at ZeRO 0, come whole from rank 0's module states file,
    which also holds the buffers (rank 0's BatchNorm statistics). Under fp16/bf16 at
    ZeRO 0 the module states hold the 16-bit weights, widened here."""
    if os.path.isdir(os.path.join(tag_dir, "zero")):     # a universal checkpoint (ds_pfc.universal)
        from .universal import universal_state_dict
        return {k: (v.float() if v.is_floating_point() else v).contiguous()
                for k, v in universal_state_dict(tag_dir).items()}
    # ZeRO 0-2 write mp_rank_00_model_states.pt (rank 0 only); ZeRO 3 writes
    # zero_pp_rank_<r>_mp_rank_00_model_states.pt on every rank, parameters as empty placeholders.
    sharded = os.path.join(tag_dir, "zero_pp_rank_0_mp_rank_00_model_states.pt")
    whole = os.path.join(tag_dir, "mp_rank_00_model_states.pt")
    path = whole if os.path.isfile(whole) else sharded
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{tag_dir} holds no DeepSpeed module states of rank 0 "
                                f"({os.path.basename(whole)} or {os.path.basename(sharded)})")
    saved = torch.load(path, map_location="cpu", weights_only=False)
    state = dict(saved["module"])
    if glob.glob(os.path.join(tag_dir, "*zero_pp_rank_*_optim_states.pt")):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
        merged = get_fp32_state_dict_from_zero_checkpoint(os.path.dirname(os.path.abspath(tag_dir)),
                                                          os.path.basename(os.path.normpath(tag_dir)))
        unknown = sorted(set(merged) - set(state))
        if unknown:
            raise ValueError(f"{tag_dir}: the ZeRO partitions hold tensors the module states do not: {unknown}")
        if path == sharded:
            # e.g. a checkpoint saved with exclude_frozen_parameters=True
            placeholders = sorted(set(state) - set(merged) - set(saved["buffer_names"]))
            if placeholders:
                raise ValueError(f"{tag_dir}: ZeRO-3 checkpoint without the values of parameters {placeholders}")
        state.update(merged)
    return {k: (v.float() if v.is_floating_point() else v).contiguous() for k, v in state.items()}


def export_checkpoint(tag_dir: str, out_path: str, *, config: dict | None = None) -> str:
    """Write ``out_path`` (safetensors): ``backbone.<name>`` float32 weights and, per
    head, ``heads.<head>.weight [C, d]`` (classes in global id order), with metadata
    (format, heads, num_classes, embedding size, the job's ds_pfc config if given).
    Atomic. Returns ``out_path``."""
    with open(os.path.join(tag_dir, COMPLETE_MARKER)) as f:
        marker = json.load(f)
    tensors = {f"backbone.{k}": v for k, v in backbone_state_dict(tag_dir).items()}
    metadata = {"format": EXPORT_FORMAT, "heads": json.dumps(marker["heads"]),
                "global_steps": str(marker["global_steps"]), "source_world_size": str(marker["world_size"])}
    for name in marker["heads"]:
        merged, meta = ckpt.merge_shards(tag_dir, name=name)
        tensors[f"heads.{name}.weight"] = merged["weight"].float().contiguous()
        metadata[f"heads.{name}.num_classes"] = str(meta["num_classes"])
        metadata[f"heads.{name}.embedding_size"] = str(meta["embedding_size"])
    if config is not None:
        metadata["config"] = json.dumps(config)
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    return ckpt._atomic_save(tensors, out_path, metadata)


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


def read_marker(tag_dir: str) -> dict:
    with open(os.path.join(tag_dir, COMPLETE_MARKER)) as f:
        return json.load(f)


def load_backbone(path: str, tag: str | None = None):
    """``(backbone, config)`` from an export (``.safetensors``) or a checkpoint
    directory (its ``latest`` tag unless ``tag``); the backbone is rebuilt from the
    job config stored with it and holds the trained float32 weights, in eval mode."""
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load_file

    from .config import split_config
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
        config = json.loads(metadata["config"])
        state = {k[len("backbone."):]: v for k, v in load_file(path).items() if k.startswith("backbone.")}
    else:
        tag_dir = resolve_tag(path, tag)
        config = read_marker(tag_dir).get("metadata", {}).get("config")
        if config is None:
            raise ValueError(f"{tag_dir} does not record its job config; export it with the training app")
        state = backbone_state_dict(tag_dir)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, cfg = split_config(config)
    backbone = cfg.backbone.build(cfg.head.embedding_size)
    backbone.load_state_dict(state)
    return backbone.eval(), config


def reshard_checkpoint(tag_dir: str, out_dir: str, world_size: int) -> str:
    """Copy checkpoint ``tag_dir`` to ``out_dir/<tag>`` for ``world_size`` ranks: head
    shards resharded exactly (:func:`ds_pfc.checkpoint.reshard`), DeepSpeed's files
    copied (ZeRO stage 0 module/optimizer states load at any world size; ZeRO 1-3
    optimizer partitions need DeepSpeed's universal checkpoint conversion), the
    per-rank data state rewritten for the new ranks (the sampler position is global;
    RNG states are dropped). Writes ``out_dir/latest``. Returns the new tag dir."""
    import shutil

    from .deepspeed_plugin import _atomic_torch_save, _atomic_write, _rank_file
    marker = read_marker(tag_dir)
    tag = os.path.basename(os.path.normpath(tag_dir))
    dst = os.path.join(out_dir, tag)
    if os.path.exists(os.path.join(dst, COMPLETE_MARKER)):
        raise FileExistsError(f"{dst} already holds a complete checkpoint")
    os.makedirs(dst, exist_ok=True)
    for name in marker["heads"]:
        ckpt.reshard(tag_dir, dst, world_size, name=name)
    shard_names = tuple(f"{name}-rank" for name in marker["heads"])
    for entry in os.listdir(tag_dir):
        if entry.startswith(shard_names) or entry.startswith("rank_state-") or entry == COMPLETE_MARKER:
            continue
        src = os.path.join(tag_dir, entry)
        if os.path.isfile(src):
            shutil.copy2(src, os.path.join(dst, entry))
    state = torch.load(os.path.join(tag_dir, _rank_file(0, marker["world_size"])), map_location="cpu",
                       weights_only=False)
    for rank in range(world_size):
        _atomic_torch_save(dict(state, rng=None, rank=rank, world_size=world_size),
                           os.path.join(dst, _rank_file(rank, world_size)))
    new_marker = dict(marker, world_size=world_size)
    if marker.get("head_layouts"):       # every head now sharded over the new ranks, rank r writing shard r
        new_marker["head_layouts"] = {
            name: dict(layout, world_size=world_size, writers={str(r): r for r in range(world_size)})
            for name, layout in marker["head_layouts"].items()}
    _atomic_write(os.path.join(dst, COMPLETE_MARKER), json.dumps(new_marker).encode())
    _atomic_write(os.path.join(out_dir, "latest"), tag.encode())
    return dst


def dominant_subcenters(tag_dir: str, *, name: str = "head", batch_size: int = 128, device="cpu",
                        log=None) -> "torch.Tensor":
    """The dominant sub-center of every class of head ``name`` in checkpoint
    ``tag_dir`` (int64 ``[C]``): the sub-center paper's statistic, the one most
    training images of the class are closest to, with the checkpoint's backbone
    embedding the job's training set (as the job built it, stress transforms
    included). One pass over the training data in this process."""
    import warnings

    from .checkpoint import SubcenterCounter
    from .config import split_config
    from .data.loader import _fetch
    from .data.transforms import normalize
    from .training import build_train_set
    log = log or (lambda line: None)
    backbone, config = load_backbone(os.path.dirname(os.path.normpath(tag_dir)), os.path.basename(
        os.path.normpath(tag_dir)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, cfg = split_config(config)
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
