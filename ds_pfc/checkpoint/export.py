"""Exports read from a checkpoint's files alone: one safetensors file with the backbone
and the merged classifier(s) (:func:`export_checkpoint`), the backbone's state dict from
DeepSpeed's files (:func:`backbone_state_dict`), and a copy of a checkpoint for another
number of ranks (:func:`reshard_checkpoint`).

A checkpoint tag directory (see :class:`~ds_pfc.deepspeed_plugin.PfcEngine`) holds
DeepSpeed's engine files, per-rank head shards (:mod:`ds_pfc.checkpoint.shards`), the
per-rank data state and the completion marker (:mod:`ds_pfc.checkpoint.tags`).
"""
from __future__ import annotations

import glob
import json
import os

import torch

from . import shards as ckpt
from . import tags
from .files import atomic_torch_save, atomic_write
from .tags import COMPLETE_MARKER, read_marker

__all__ = ["backbone_state_dict", "export_checkpoint", "reshard_checkpoint", "resolve_tag", "read_marker",
           "EXPORT_FORMAT"]

EXPORT_FORMAT = "ds_pfc.model/1"


def resolve_tag(checkpoint_dir: str, tag: str | None = None) -> str:
    """``checkpoint_dir/tag``, checked complete and intact (every file there, sizes as
    saved, checksums of the ``torch.save`` files). Without ``tag``: the tag ``latest``
    names, or the newest complete one when ``latest`` is missing or lags behind it
    (a warning says so). A damaged checkpoint raises
    :class:`~ds_pfc.checkpoint.tags.CheckpointError` naming the file and the newest
    intact tag; a directory without checkpoints raises FileNotFoundError."""
    import warnings

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
    if os.path.isdir(os.path.join(tag_dir, "zero")):     # a universal checkpoint (ds_pfc.checkpoint.universal)
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
    (format, heads, num_classes, embedding size, the job's ds_pfc config if given, the
    marker's record of what ran).
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
    ran = (marker.get("metadata") or {}).get("ran")
    if isinstance(ran, list):
        metadata["ran"] = json.dumps(ran)          # what ran (the model card reads it)
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    return ckpt._atomic_save(tensors, out_path, metadata)


def reshard_checkpoint(tag_dir: str, out_dir: str, world_size: int) -> str:
    """Copy checkpoint ``tag_dir`` to ``out_dir/<tag>`` for ``world_size`` ranks: head
    shards resharded exactly (:func:`ds_pfc.checkpoint.reshard`), DeepSpeed's files
    copied (ZeRO stage 0 module/optimizer states load at any world size; ZeRO 1-3
    optimizer partitions need DeepSpeed's universal checkpoint conversion), the
    per-rank data state rewritten for the new ranks (the sampler position is global;
    RNG states are dropped). Writes ``out_dir/latest``. Returns the new tag dir."""
    import shutil

    marker = tags.read_marker(tag_dir)
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
    state = torch.load(os.path.join(tag_dir, tags.rank_state_name(0, marker["world_size"])), map_location="cpu",
                       weights_only=False)
    for rank in range(world_size):
        atomic_torch_save(dict(state, rng=None, rank=rank, world_size=world_size),
                           os.path.join(dst, tags.rank_state_name(rank, world_size)))
    new_marker = dict(marker, world_size=world_size)
    if marker.get("head_layouts"):       # every head now sharded over the new ranks, rank r writing shard r
        new_marker["head_layouts"] = {
            name: dict(layout, world_size=world_size, writers={str(r): r for r in range(world_size)})
            for name, layout in marker["head_layouts"].items()}
    atomic_write(os.path.join(dst, COMPLETE_MARKER), json.dumps(new_marker).encode())
    atomic_write(os.path.join(out_dir, "latest"), tag.encode())
    return dst
