"""DeepSpeed universal checkpoints of ds_pfc tags: resume ZeRO 1-3 on another number of ranks.

DeepSpeed saves ZeRO stage 1-3 optimizer states (and those of its bf16 optimizer)
as one partition per data-parallel rank and refuses to load them at another
data-parallel size. Its *universal* layout stores every parameter whole instead, and
an engine of any size re-partitions it on load::

    <tag>/zero/<parameter name>/fp32.pt          {"param": fp32 master weight, "cat_dim": 0}
    <tag>/zero/<parameter name>/<state>.pt       one per optimizer state (exp_avg, momentum_buffer, ...)
    <tag>/zero/<parameter name>/step.pt          the step count (ZeRO 1/2, when the optimizer keeps one)
    <tag>/zero/optimizer_state.pt                hyperparameters, loss scaler, scalar states
    <tag>/*model_states.pt                       DeepSpeed's module-states files, unchanged

:func:`to_universal` turns a complete ds_pfc tag into a new complete ds_pfc tag
(default: the sibling ``<tag>-universal``) holding that layout plus the tag's head
shards and ``rank_state`` files, and a marker whose ``universal`` field says what it
was converted from. The head shards keep their saved world size: ds_pfc reshards
them on load as for any other tag.

What DeepSpeed 0.19 provides and what ds_pfc adds:

- Conversion. ``deepspeed.checkpoint.ds_to_universal`` knows Adam's two states only
  (for SGD it fails with ``KeyError: 'exp_avg'``; it would silently drop any other
  state, e.g. AMSGrad's ``max_exp_avg_sq``). It is used when the states are exactly
  Adam's; otherwise ds_pfc's converter writes the same layout for whatever
  per-element states the optimizer holds: ``momentum_buffer`` for SGD with momentum,
  none for SGD without (then only the master weights). ``impl=`` picks one.
- Loading. DeepSpeed reads ``checkpoint.load_universal`` from the engine's config at
  every ``load_checkpoint`` call, so :func:`load_universal` switches it on for one
  call on an existing engine. ZeRO 1/2 and the bf16 optimizer then load every
  ``<state>.pt`` file they find; ZeRO 3's loader reads Adam's states only, so for
  other states :func:`load_universal` gives the engine's optimizer, for that call, a
  loader that does the same for the states present. DeepSpeed skips the module state
  on a universal load: persistent buffers (BatchNorm running statistics) and frozen
  parameters would keep their initial values, so :func:`load_universal` restores
  them from the module-states file.

A universal tag loads at the ZeRO stage family it was saved with (1 or 2, or 3), at
any number of ranks. ZeRO stage 0 checkpoints need no conversion: DeepSpeed loads
them at any world size as they are.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import math
import os
import re
import shutil
import sys
import types
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from . import checkpoint as ckpt
from .deepspeed_plugin.internals import internal, require_internal
# Attributes read at call time: deepspeed_plugin may import this module while it initialises.
from . import deepspeed_plugin as _plugin

__all__ = ["to_universal", "load_universal", "needs_universal", "is_universal", "loadable_tag",
           "universal_state_dict", "UniversalCheckpointError", "UNIVERSAL_SUFFIX", "IMPLS"]

UNIVERSAL_SUFFIX = "-universal"
IMPLS = ("auto", "deepspeed", "ds_pfc")

# DeepSpeed's checkpoint keys (deepspeed/checkpoint/constants.py), spelled out so that
# importing this module does not import DeepSpeed.
_OPTIMIZER_STATE_DICT = "optimizer_state_dict"
_BASE_OPTIMIZER_STATE = "base_optimizer_state"
_SINGLE_PARTITION_OF_FP32_GROUPS = "single_partition_of_fp32_groups"
_FP32_FLAT_GROUPS = "fp32_flat_groups"
_PARAM_SLICE_MAPPINGS = "param_slice_mappings"
_PARAM_GROUPS = "param_groups"
_PARTITION_COUNT = "partition_count"
_GROUP_PADDINGS = "group_paddings"
_ZERO_STAGE = "zero_stage"
_PARAM_SHAPES = "param_shapes"
_PARAM = "param"
_CAT_DIM = "cat_dim"
_FP32 = "fp32"
_STEP = "step"
_ADAM_STATES = ("exp_avg", "exp_avg_sq")

_OPTIM_FILE = re.compile(r"(?:bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")
_STAGE12_MODEL_FILE = "mp_rank_00_model_states.pt"
_STAGE3_MODEL_FILE = "zero_pp_rank_0_mp_rank_00_model_states.pt"     # rank 0's; buffers whole, parameters empty


class UniversalCheckpointError(RuntimeError):
    """A checkpoint cannot be converted to, or loaded as, a universal checkpoint; the
    message says why and what to do instead."""


# ---------------------------------------------------------------------------- inspection
@dataclass(frozen=True)
class _Source:
    tag_dir: str
    marker: dict
    zero_stage: int                  # 1 or 2 (same layout; also the bf16 optimizer's), or 3
    optim_files: tuple[str, ...]     # in data-parallel rank order
    model_files: tuple[str, ...]     # DeepSpeed's module-states files
    states: tuple[str, ...]          # per-element optimizer states, sorted
    scalars: tuple[str, ...]         # scalar optimizer states ("step")


def _read_marker(tag_dir: str) -> dict:
    if not os.path.isdir(tag_dir):
        raise FileNotFoundError(f"{tag_dir} is not a directory")
    path = os.path.join(tag_dir, _plugin.COMPLETE_MARKER)
    if not os.path.isfile(path):
        raise _plugin.CheckpointIncompleteError(f"{tag_dir} has no {_plugin.COMPLETE_MARKER}: the save did not "
                                                "finish; convert an earlier tag")
    with open(path) as f:
        return json.load(f)


def _optim_files(tag_dir: str) -> dict[int, str]:
    """``{data-parallel rank: path}`` of the ZeRO optimizer partitions in ``tag_dir``."""
    found = {}
    for entry in os.listdir(tag_dir):
        m = _OPTIM_FILE.fullmatch(entry)
        if m is None:
            continue
        if int(m.group(2)) != 0:
            raise UniversalCheckpointError(f"{tag_dir} holds model-parallel rank {int(m.group(2))} partitions; "
                                           "ds_pfc checkpoints are data parallel only")
        if int(m.group(1)) in found:
            raise UniversalCheckpointError(f"{tag_dir} holds two partitions of rank {int(m.group(1))}: "
                                           f"{os.path.basename(found[int(m.group(1))])} and {entry}")
        found[int(m.group(1))] = os.path.join(tag_dir, entry)
    return found


def _has_zero_partitions(tag_dir: str) -> bool:
    return any(_OPTIM_FILE.fullmatch(entry) for entry in os.listdir(tag_dir))


def _torch_load(path: str):
    """``torch.load`` of DeepSpeed's pickles (they hold DeepSpeed objects, so not
    ``weights_only``), memory-mapped where the file allows it: only the slices read
    are paged in."""
    try:
        return torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    except RuntimeError:    # files not in torch's zip format cannot be mapped
        return torch.load(path, map_location="cpu", weights_only=False)


def _split_states(group_state: dict, numel: int, padding: int, where: str) -> tuple[dict, dict]:
    """A partition's optimizer state: ``({per-element state: flat tensor}, {scalar: value})``.
    ``numel``: the partition's master weights; ZeRO 1/2 save them without the last
    rank's ``padding`` but the optimizer's states with it."""
    per_element, scalars = {}, {}
    for key, value in group_state.items():
        if torch.is_tensor(value) and value.dim() == 1 and value.numel() in (numel, numel + padding):
            per_element[key] = value
        elif key == _STEP and (not torch.is_tensor(value) or value.numel() == 1):
            scalars[key] = value
        else:
            shape = tuple(value.shape) if torch.is_tensor(value) else type(value).__name__
            raise UniversalCheckpointError(f"{where}: optimizer state {key!r} ({shape}) is neither a per-element "
                                           f"state of the {numel}-element partition nor the step count; the "
                                           "universal layout has no place for it")
    return per_element, scalars


def _padding(rank_sd: dict, group: int) -> int:
    paddings = rank_sd.get(_GROUP_PADDINGS)
    return int(paddings[group]) if paddings else 0


def _inspect(tag_dir: str) -> _Source:
    marker = _read_marker(tag_dir)
    if marker.get("universal"):
        raise UniversalCheckpointError(f"{tag_dir} is already universal (converted from "
                                       f"{marker['universal'].get('source_tag')!r}); load it with "
                                       "ds_pfc.universal.load_universal")
    files = _optim_files(tag_dir)
    if not files:
        raise UniversalCheckpointError(
            f"{tag_dir} holds no ZeRO optimizer partitions (ZeRO stage 0): DeepSpeed loads it at any world size "
            "as it is; there is nothing to convert")
    world = int(marker["world_size"])
    if sorted(files) != list(range(world)):
        raise UniversalCheckpointError(f"{tag_dir} was saved on {world} ranks but holds optimizer partitions of "
                                       f"ranks {sorted(files)}")
    if os.path.isdir(os.path.join(tag_dir, "offloaded_tensors")):
        raise UniversalCheckpointError(f"{tag_dir} holds NVMe-offloaded optimizer states, which DeepSpeed's "
                                       "universal layout does not cover; resume at the saved world size")
    first = _torch_load(files[0])[_OPTIMIZER_STATE_DICT]
    if _FP32_FLAT_GROUPS in first:
        stage = 3
        model_files = [os.path.join(tag_dir, f"zero_pp_rank_{r}_mp_rank_00_model_states.pt") for r in range(world)]
        groups = first[_OPTIMIZER_STATE_DICT]["state"]
        flats = first[_FP32_FLAT_GROUPS]
    elif _PARAM_SLICE_MAPPINGS in first:
        stage = int(first.get(_ZERO_STAGE, 1))     # the bf16 optimizer (ZeRO 1) records no stage
        model_files = [os.path.join(tag_dir, _STAGE12_MODEL_FILE)]
        if not isinstance(first[_BASE_OPTIMIZER_STATE], dict):
            raise UniversalCheckpointError(f"{tag_dir} was saved with zero_optimization.elastic_checkpoint, "
                                           "whose layout the universal converters do not read; resume at the "
                                           "saved world size")
        groups = first[_BASE_OPTIMIZER_STATE]["state"]
        flats = first[_SINGLE_PARTITION_OF_FP32_GROUPS]
    else:
        raise UniversalCheckpointError(f"{files[0]}: unknown ZeRO optimizer layout (keys {sorted(first)})")
    missing = [p for p in model_files if not os.path.isfile(p)]
    if missing:
        raise UniversalCheckpointError(f"{tag_dir} lacks DeepSpeed's module states {missing}")
    states, scalars = set(), set()
    for g, flat in enumerate(flats):
        per_element, scalar = _split_states(groups.get(g, {}), flat.numel(), _padding(first, g),
                                            f"{files[0]} group {g}")
        states |= set(per_element)
        scalars |= set(scalar)
    return _Source(tag_dir, marker, stage, tuple(files[r] for r in range(world)), tuple(model_files),
                   tuple(sorted(states)), tuple(sorted(scalars)))


def is_universal(tag_dir: str) -> bool:
    """Whether ``tag_dir`` is a complete ds_pfc tag written by :func:`to_universal`."""
    return bool(_read_marker(tag_dir).get("universal"))


def needs_universal(tag_dir: str, world_size: int) -> bool:
    """Whether loading the complete ds_pfc tag ``tag_dir`` on ``world_size`` ranks
    needs a universal conversion first: it was saved on another number of ranks, holds
    ZeRO 1-3 optimizer partitions, and is not universal itself. (ZeRO 0 tags load at
    any world size; a universal tag loads with :func:`load_universal`.)"""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    marker = _read_marker(tag_dir)
    if marker.get("universal") or int(marker["world_size"]) == world_size:
        return False
    return _has_zero_partitions(tag_dir)


def loadable_tag(load_dir: str, tag: str, world_size: int) -> tuple[str, bool]:
    """``(name, universal)``: the tag to load on ``world_size`` ranks for checkpoint
    ``tag`` of ``load_dir``, and whether to load it with :func:`load_universal`.
    ``(tag, False)`` when DeepSpeed loads it as it is (same world size, or ZeRO 0);
    ``(tag, True)`` when it is universal itself; ``(<tag>-universal, True)`` when that
    converted sibling exists and was made from this very save; otherwise
    :class:`UniversalCheckpointError` with the conversion recipe."""
    tag_dir = os.path.join(load_dir, tag)
    if is_universal(tag_dir):
        return tag, True
    if not needs_universal(tag_dir, world_size):
        return tag, False
    sibling = tag + UNIVERSAL_SUFFIX
    sibling_dir = os.path.join(load_dir, sibling)
    if os.path.isfile(os.path.join(sibling_dir, _plugin.COMPLETE_MARKER)):
        made_from = _read_marker(sibling_dir).get("universal") or {}
        if made_from.get("source_tag") != tag or made_from.get("source_marker_sha256") != _marker_digest(tag_dir):
            raise UniversalCheckpointError(f"{sibling_dir} was not converted from the current {tag_dir} (saved "
                                           "again since?); remove it and convert again")
        return sibling, True
    saved = _read_marker(tag_dir)["world_size"]
    raise UniversalCheckpointError(
        f"{tag_dir} holds ZeRO optimizer partitions of {saved} ranks, which DeepSpeed cannot load on "
        f"{world_size}. Convert it once to a universal checkpoint, which loads on any number of ranks:\n"
        f"    python launch/export.py universal --checkpoint {load_dir} --tag {tag}\n"
        f"(or ds_pfc.universal.to_universal({tag_dir!r})); the next load on {world_size} ranks then uses "
        f"{sibling}. Or resume on {saved} ranks.")


# ---------------------------------------------------------------------------- conversion
def _param_shapes(model_file: str) -> list[dict]:
    shapes = _torch_load(model_file)[_PARAM_SHAPES]
    if not isinstance(shapes, (list, tuple)) or not all(isinstance(g, dict) for g in shapes):
        raise UniversalCheckpointError(f"{model_file}: no per-group parameter shapes ({_PARAM_SHAPES})")
    return list(shapes)


def _rank_groups(src: _Source, rank_sd: dict, num_groups: int, keys: tuple[str, ...], where: str) -> list[dict]:
    """Per group: ``{"fp32" and each state: flat partition}`` plus ``"_scalars"``."""
    if src.zero_stage == 3:
        flats, groups = rank_sd[_FP32_FLAT_GROUPS], rank_sd[_OPTIMIZER_STATE_DICT]["state"]
    else:
        flats, groups = rank_sd[_SINGLE_PARTITION_OF_FP32_GROUPS], rank_sd[_BASE_OPTIMIZER_STATE]["state"]
    if len(flats) != num_groups:
        raise UniversalCheckpointError(f"{where}: {len(flats)} optimizer groups, the module states list "
                                       f"{num_groups}")
    out = []
    for g, flat in enumerate(flats):
        per_element, scalars = _split_states(groups.get(g, {}), flat.numel(), _padding(rank_sd, g),
                                             f"{where} group {g}")
        if tuple(sorted(per_element)) != keys:
            raise UniversalCheckpointError(f"{where} group {g}: optimizer states {sorted(per_element)}, rank 0 "
                                           f"has {list(keys)}")
        out.append({_FP32: flat, **per_element, "_scalars": scalars})
    return out


def _gather_stage12(src: _Source, ranks: list[dict], shapes: list[dict]):
    """Yield ``(name, {state: full tensor}, step)`` per parameter of a ZeRO 1/2 (or bf16
    optimizer) checkpoint: each rank's partition of a group's flat buffer holds
    contiguous fragments of parameters at the offsets its slice mappings give."""
    world = len(ranks)
    per_rank = []
    for r, sd in enumerate(ranks):
        counts = sd.get(_PARTITION_COUNT)
        if counts is not None and any(int(c) != world for c in counts):
            raise UniversalCheckpointError(f"{src.optim_files[r]}: partitioned over {counts} ranks, the "
                                           f"checkpoint has {world}")
        per_rank.append((sd[_PARAM_SLICE_MAPPINGS], _rank_groups(src, sd, len(shapes), src.states,
                                                                 src.optim_files[r])))
    for g, group_shapes in enumerate(shapes):
        for name, shape in group_shapes.items():
            pieces = [(groups[g], mappings[g][name]) for mappings, groups in per_rank if name in mappings[g]]
            numel = math.prod(shape)
            if sum(m.numel for _, m in pieces) != numel:
                raise UniversalCheckpointError(f"{src.tag_dir}: the partitions hold "
                                               f"{sum(m.numel for _, m in pieces)} elements of {name!r} "
                                               f"{tuple(shape)}, not {numel}")
            full = {key: torch.cat([part[key].narrow(0, m.start, m.numel) for part, m in pieces]).view(shape)
                    for key in (_FP32,) + src.states}
            steps = [part["_scalars"][_STEP] for part, _ in pieces if _STEP in part["_scalars"]]
            if any(not _same(s, steps[0]) for s in steps[1:]):
                raise UniversalCheckpointError(f"{src.tag_dir}: the ranks holding {name!r} disagree on its step "
                                               f"count: {steps}")
            yield name, full, (steps[0] if steps else None)


def _gather_stage3(src: _Source, ranks: list[dict], shapes: list[dict]):
    """Yield ``(name, {state: full tensor}, None)`` per parameter of a ZeRO 3 checkpoint:
    every parameter is split into ``ceil(numel / world)`` elements per rank (the last
    rank's share padded), laid out one after another in each rank's group buffer."""
    world = len(ranks)
    per_rank = []
    for r, sd in enumerate(ranks):
        if int(sd.get(_PARTITION_COUNT, world)) != world or any(
                int(meta.get("partition_count", world)) != world for meta in sd.get("ds_zero_partition_groups") or []):
            raise UniversalCheckpointError(f"{src.optim_files[r]}: ZeRO 3 partitions over a group other than the "
                                           f"{world} data-parallel ranks (MiCS or hierarchical partitioning), "
                                           "which the converter does not read")
        per_rank.append(_rank_groups(src, sd, len(shapes), src.states, src.optim_files[r]))
    for g, group_shapes in enumerate(shapes):
        need = sum(math.ceil(math.prod(shape) / world) for shape in group_shapes.values())
        if need > per_rank[0][g][_FP32].numel():
            raise UniversalCheckpointError(f"{src.tag_dir}: group {g} holds {per_rank[0][g][_FP32].numel()} "
                                           f"elements per rank, its parameters need {need}")
        offset = 0
        for name, shape in group_shapes.items():
            numel = math.prod(shape)
            share = math.ceil(numel / world)
            full = {key: torch.cat([groups[g][key].narrow(0, offset, max(0, min(share, numel - r * share)))
                                    for r, groups in enumerate(per_rank)]).view(shape)
                    for key in (_FP32,) + src.states}
            offset += share
            yield name, full, None


def _same(a, b) -> bool:
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.equal(torch.as_tensor(a), torch.as_tensor(b))
    return a == b


def _write_param(zero_dir: str, name: str, tensors: dict, step) -> None:
    param_dir = os.path.join(zero_dir, name)
    os.makedirs(param_dir, exist_ok=True)
    for key, tensor in tensors.items():
        torch.save({_PARAM: tensor, _CAT_DIM: 0}, os.path.join(param_dir, f"{key}.pt"))
    if step is not None:
        torch.save(step.clone() if torch.is_tensor(step) else step, os.path.join(param_dir, f"{_STEP}.pt"))


def _common_optimizer_state(src: _Source, rank0: dict) -> dict:
    """``zero/optimizer_state.pt``: rank 0's optimizer state without the partitions."""
    if src.zero_stage == 3:
        inner = rank0[_OPTIMIZER_STATE_DICT]
        scalars = {}
        for g, flat in enumerate(rank0[_FP32_FLAT_GROUPS]):
            _, scalar = _split_states(inner["state"].get(g, {}), flat.numel(), 0, src.optim_files[0])
            scalars[g] = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in scalar.items()}
        out = {k: v for k, v in rank0.items() if k not in (_FP32_FLAT_GROUPS, _OPTIMIZER_STATE_DICT)}
        out[_OPTIMIZER_STATE_DICT] = {"state": scalars, _PARAM_GROUPS: inner[_PARAM_GROUPS]}
        out[_PARAM_GROUPS] = inner[_PARAM_GROUPS]
        return out
    sharded = (_BASE_OPTIMIZER_STATE, _PARAM_SLICE_MAPPINGS, _SINGLE_PARTITION_OF_FP32_GROUPS)
    out = {k: v for k, v in rank0.items() if k not in sharded}
    out[_PARAM_GROUPS] = rank0[_BASE_OPTIMIZER_STATE][_PARAM_GROUPS]
    return out


def _frozen_params(src: _Source) -> dict[str, torch.Tensor]:
    """The parameters outside the optimizer (frozen ones, such as the fixed gamma of
    the backbones' embedding BatchNorm), whole, in float32: from rank 0's module
    states at ZeRO 1/2, from every rank's saved fragments at ZeRO 3."""
    first = _torch_load(src.model_files[0])
    trained = {name for group in first[_PARAM_SHAPES] for name in group}
    names = [n for n in first["module"] if n not in trained and n not in set(first.get("buffer_names") or ())]
    if src.zero_stage != 3:
        return {name: first["module"][name].float() for name in names}
    shapes = first.get("frozen_param_shapes") or {}
    if set(names) - set(shapes):
        raise UniversalCheckpointError(f"{src.tag_dir} holds no values of the frozen parameters "
                                       f"{sorted(set(names) - set(shapes))} (saved with exclude_frozen_parameters?)")
    ranks = [_torch_load(path)["frozen_param_fragments"] for path in src.model_files] if shapes else []
    return {name: torch.cat([fragments[name].reshape(-1) for fragments in ranks]).narrow(0, 0, math.prod(shape))
            .view(shape).float() for name, shape in shapes.items()}


def _write_frozen(src: _Source, out_dir: str) -> None:
    """``zero/<name>/fp32.pt`` for frozen parameters (DeepSpeed's ZeRO 1/2 converter
    writes these too; its ZeRO 3 converter and its universal loaders ignore them)."""
    for name, value in _frozen_params(src).items():
        if not os.path.isfile(os.path.join(out_dir, "zero", name, f"{_FP32}.pt")):
            _write_param(os.path.join(out_dir, "zero"), name, {_FP32: value.clone()}, None)


def _convert_ds_pfc(src: _Source, out_dir: str, workers: int, say) -> None:
    zero_dir = os.path.join(out_dir, "zero")
    os.makedirs(zero_dir)
    shapes = _param_shapes(src.model_files[0])
    num_params = sum(len(g) for g in shapes)
    ranks = [_torch_load(path)[_OPTIMIZER_STATE_DICT] for path in src.optim_files]
    gather = _gather_stage3 if src.zero_stage == 3 else _gather_stage12
    say(f"converting {num_params} parameters from {len(ranks)} ZeRO-{src.zero_stage} partitions "
        f"(states: {', '.join((_FP32,) + src.states)})")
    every = max(1, num_params // 10)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        pending = []
        for i, (name, tensors, step) in enumerate(gather(src, ranks, shapes), 1):
            pending.append(pool.submit(_write_param, zero_dir, name, tensors, step))
            if len(pending) >= 2 * workers:     # bound the parameters held in memory
                pending.pop(0).result()
            if i % every == 0 or i == num_params:
                say(f"  {i}/{num_params} parameters")
        for future in pending:
            future.result()
    torch.save(_common_optimizer_state(src, ranks[0]), os.path.join(zero_dir, "optimizer_state.pt"))
    for path in src.model_files:
        shutil.copy2(path, out_dir)


def _convert_deepspeed(src: _Source, out_dir: str, workers: int, progress: bool) -> None:
    from deepspeed.checkpoint import ds_to_universal
    args = argparse.Namespace(input_folder=src.tag_dir, output_folder=out_dir, num_extract_workers=workers,
                              num_merge_workers=max(1, workers // 2), keep_temp_folder=False, strict=True,
                              inject_missing_state=True)
    if progress:
        ds_to_universal.main(args)
        return
    sink = io.StringIO()
    with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        ds_to_universal.main(args)


def _ds_pfc_files(src: _Source) -> list[str]:
    """The head shards (each head's own number of them) and the per-rank state files
    of the tag's world size."""
    from . import checkpoint as ckpt
    from .checkpoint_tags import head_world_sizes
    world = len(src.optim_files)
    names = [ckpt.shard_file_name(head, r, k) for head, k in head_world_sizes(src.marker).items()
             for r in range(k)] + [f"rank_state-{r:05d}-of-{world:05d}.pt" for r in range(world)]
    missing = [n for n in names if not os.path.isfile(os.path.join(src.tag_dir, n))]
    if missing:
        raise UniversalCheckpointError(f"{src.tag_dir} lacks {missing}")
    return names


def _engine_files(tag_dir: str, own: list[str]) -> dict[str, int]:
    """``relative path -> size`` of DeepSpeed's files in ``tag_dir`` (everything but
    ``own``, ds_pfc's files): the marker's ``engine_files``, which loaders check."""
    found = {}
    for directory, _, files in os.walk(tag_dir):
        for name in files:
            rel = os.path.relpath(os.path.join(directory, name), tag_dir)
            if rel not in own and rel != _plugin.COMPLETE_MARKER:
                found[rel] = os.path.getsize(os.path.join(directory, name))
    return found


def _marker_digest(tag_dir: str) -> str:
    with open(os.path.join(tag_dir, _plugin.COMPLETE_MARKER), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _link_or_copy(src: str, dst: str) -> None:
    """Hard link (ds_pfc replaces checkpoint files by renaming, never rewrites them in
    place, so a link is as good as a copy and costs no space), else copy."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _fsync_tree(root: str) -> None:
    for directory, _, files in os.walk(root, topdown=False):
        for name in files:
            fd = os.open(os.path.join(directory, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        ckpt._fsync_dir(directory)




def to_universal(tag_dir: str, out_dir: str | None = None, *, workers: int = 4, impl: str = "auto",
                 progress: bool = True) -> str:
    """Convert the complete ds_pfc checkpoint ``tag_dir`` (ZeRO stage 1, 2 or 3; fp32
    or bf16; any optimizer whose states are per-element tensors plus a step count:
    Adam/AdamW, SGD with or without momentum, ...) into a universal one, itself a
    complete ds_pfc tag, and return its directory.

    ``out_dir``: the new tag directory; default ``<tag_dir>-universal`` (the sibling
    that :func:`loadable_tag` looks for); it must not exist. The result holds
    DeepSpeed's universal layout (see the module docstring), the head shards and
    ``rank_state`` files (hard-linked where the file system allows, else copied), and
    ``ds_pfc_complete.json``: the source's marker with ``tag`` set to the new name,
    ``engine_files`` listing the new DeepSpeed files, and a ``universal`` field
    (``source_tag``, ``source_marker_sha256``, ``zero_stage``, ``optimizer_states``,
    ``converter``, ``deepspeed_version``). ``save_dir/latest`` is not changed. Written
    into a hidden ``.<name>.tmp-<hex>`` directory beside ``out_dir``, fsynced, then
    renamed: a crash leaves no partial ``out_dir``.

    ``impl``: ``"deepspeed"`` (``deepspeed.checkpoint.ds_to_universal``; Adam's
    states only), ``"ds_pfc"`` (any per-element states), ``"auto"`` (DeepSpeed's when
    the states are exactly ``exp_avg``/``exp_avg_sq``, else ds_pfc's). ``workers``:
    DeepSpeed's extraction processes, or ds_pfc's writer threads. ``progress``:
    report the steps on stderr (DeepSpeed's converter prints on stdout).

    Raises :class:`UniversalCheckpointError` for what cannot be converted (a ZeRO 0
    tag, which loads at any world size as it is; a universal tag; NVMe-offloaded or
    elastic optimizer states; an optimizer state that is neither per-element nor a
    step count), ``CheckpointIncompleteError`` for a tag without marker."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be an int >= 1, got {workers!r}")
    tag_dir = os.path.normpath(os.path.abspath(tag_dir))
    src = _inspect(tag_dir)
    adam = src.states == _ADAM_STATES and (src.zero_stage != 3 or _STEP in src.scalars)
    if impl == "deepspeed" and not adam:
        needed = "exp_avg, exp_avg_sq" + (", step" if src.zero_stage == 3 else "")
        raise UniversalCheckpointError(
            f"DeepSpeed's converter handles Adam's states ({needed}) only; {tag_dir} holds "
            f"{list(src.states + src.scalars) or 'no optimizer states'}. Use impl='ds_pfc'")
    converter = "deepspeed" if impl == "deepspeed" or (impl == "auto" and adam) else "ds_pfc"
    own = _ds_pfc_files(src)
    out_dir = os.path.normpath(os.path.abspath(out_dir if out_dir is not None else tag_dir + UNIVERSAL_SUFFIX))
    if os.path.exists(out_dir):
        raise FileExistsError(f"{out_dir} already exists; remove it or pass another out_dir")
    parent, name = os.path.split(out_dir)
    if name.startswith("."):
        raise ValueError(f"out_dir must name a visible tag directory, got {out_dir!r}")
    os.makedirs(parent, exist_ok=True)
    import deepspeed

    def say(message):
        if progress:
            print(f"[ds_pfc.universal] {message}", file=sys.stderr, flush=True)

    # DeepSpeed's converter writes 'latest_universal' beside its output folder: give
    # it a private parent, removed afterwards.
    scratch = os.path.join(parent, f".{name}.tmp-{uuid.uuid4().hex[:8]}")
    work = os.path.join(scratch, name)
    try:
        os.makedirs(work)
        say(f"{tag_dir} -> {out_dir} (ZeRO stage {src.zero_stage}, {len(src.optim_files)} ranks, "
            f"converter: {converter})")
        if converter == "deepspeed":
            _convert_deepspeed(src, work, workers, progress)
        else:
            _convert_ds_pfc(src, work, workers, say)
        _write_frozen(src, work)
        for entry in own:
            _link_or_copy(os.path.join(tag_dir, entry), os.path.join(work, entry))
        marker = dict(src.marker, tag=name, engine_files=_engine_files(work, own), universal={
            "source_tag": os.path.basename(tag_dir), "source_marker_sha256": _marker_digest(tag_dir),
            "zero_stage": src.zero_stage, "optimizer_states": list(src.states + src.scalars),
            "converter": converter, "deepspeed_version": deepspeed.__version__})
        marker_path = os.path.join(work, _plugin.COMPLETE_MARKER)
        _plugin._atomic_write(marker_path, json.dumps(marker, indent=1).encode())
        # As old as the source's: listings ordered by marker time keep the two together.
        source_marker = os.stat(os.path.join(tag_dir, _plugin.COMPLETE_MARKER))
        os.utime(marker_path, ns=(source_marker.st_atime_ns, source_marker.st_mtime_ns))
        say("syncing to disk")
        _fsync_tree(work)
        if os.path.exists(out_dir):
            raise FileExistsError(f"{out_dir} appeared during the conversion")
        os.rename(work, out_dir)
        ckpt._fsync_dir(parent)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    say(f"done: {out_dir}")
    return out_dir


def universal_state_dict(tag_dir: str) -> dict[str, torch.Tensor]:
    """The module state of a universal tag, in the module's order: parameters in
    float32 (``zero/<name>/fp32.pt``: the master weights, and frozen parameters),
    buffers as saved (rank 0's). Works for ZeRO 3 tags too, whose module-states files
    hold no parameters."""
    stage12 = os.path.join(tag_dir, _STAGE12_MODEL_FILE)
    model_file = stage12 if os.path.isfile(stage12) else os.path.join(tag_dir, _STAGE3_MODEL_FILE)
    if not os.path.isdir(os.path.join(tag_dir, "zero")) or not os.path.isfile(model_file):
        raise UniversalCheckpointError(f"{tag_dir} is not a universal checkpoint (no zero/ folder or module states)")
    saved = _torch_load(model_file)
    shapes = {name: shape for group in saved[_PARAM_SHAPES] for name, shape in group.items()}
    buffers = set(saved.get("buffer_names") or ())
    out = {}
    for name, value in saved["module"].items():
        path = os.path.join(tag_dir, "zero", name, f"{_FP32}.pt")
        if name not in buffers and (name in shapes or os.path.isfile(path)):
            loaded = torch.load(path, map_location="cpu", weights_only=False)
            value = loaded[_PARAM] if isinstance(loaded, dict) else loaded
            value = (value.reshape(shapes[name]) if name in shapes else value).float()
        out[name] = value.clone()
    return out


# ---------------------------------------------------------------------------- loading
def _universal_layout(tag_dir: str) -> tuple[int, set[str]]:
    """``(3 or 2, per-element state names)`` of a universal tag (2 stands for ZeRO 1/2)."""
    optim_path = os.path.join(tag_dir, "zero", "optimizer_state.pt")
    if not os.path.isfile(optim_path):
        raise UniversalCheckpointError(f"{tag_dir} is not a universal checkpoint (no zero/optimizer_state.pt); "
                                       "convert it with ds_pfc.universal.to_universal")
    stage = 3 if _OPTIMIZER_STATE_DICT in torch.load(optim_path, map_location="cpu", weights_only=False) else 2
    states = set()
    for entry in os.scandir(os.path.join(tag_dir, "zero")):
        if entry.is_dir():
            states |= _state_files(entry.path)
    return stage, states


def _state_files(folder: str) -> set[str]:
    """The per-element optimizer states of one parameter's universal folder."""
    return {f[:-3] for f in os.listdir(folder) if f.endswith(".pt")} - {_FP32, _STEP}


def _load_stage3_states(self, checkpoint_dir: str) -> None:
    """DeepSpeed's ZeRO-3 universal loader (``DeepSpeedZeroOptimizer_Stage3.
    load_hp_checkpoint_state_from_checkpoint_dir_stage3``, which reads ``exp_avg``,
    ``exp_avg_sq`` and a ``step`` only) for the per-element states the checkpoint
    holds; installed on the optimizer by :func:`load_universal` for one load."""
    if self.swap_optimizer:
        raise UniversalCheckpointError("ZeRO 3 with an NVMe-offloaded optimizer: universal loading of "
                                       "non-Adam states is not supported")
    zero_dir = os.path.join(checkpoint_dir, "zero")
    optim_sd = torch.load(os.path.join(zero_dir, "optimizer_state.pt"), map_location="cpu", weights_only=False)
    self._load_global_state_stage3(optim_sd)
    saved_scalars = optim_sd[_OPTIMIZER_STATE_DICT]["state"]
    for sub_group_id, group in enumerate(self.fp16_groups):
        fp32_param = self.fp32_partitioned_groups_flat[sub_group_id]
        folders = [os.path.join(zero_dir, self.param_names[p]) for p in group]
        keys = _state_files(folders[0]) if folders else set()
        for folder in folders[1:]:
            if _state_files(folder) != keys:
                raise UniversalCheckpointError(f"{folder} holds states {sorted(_state_files(folder))}, "
                                               f"{folders[0]} {sorted(keys)}")
        state = {k: (v.clone() if torch.is_tensor(v) else v)
                 for k, v in saved_scalars.get(sub_group_id, saved_scalars.get(0, {})).items()}
        for key in (_FP32,) + tuple(sorted(keys)):
            flat = torch.zeros_like(fp32_param)
            offset = 0
            for param, folder in zip(group, folders):
                part = self.load_hp_checkpoint_state(folder, key, param=param)
                flat.narrow(0, offset, part.numel()).copy_(part)
                offset += part.numel()
            if key == _FP32:
                fp32_param.data.copy_(flat)
            else:
                state[key] = flat
        self.optimizer.state[fp32_param] = state
    for param_group in self.optimizer.param_groups:
        for key, value in optim_sd[_OPTIMIZER_STATE_DICT][_PARAM_GROUPS][0].items():
            if key != "params":
                param_group[key] = value
    # As DeepSpeed's loader: the low-precision partitions from the fp32 ones.
    for sub_group_id, fp32_param in enumerate(self.fp32_partitioned_groups_flat):
        if sum(fp32_param.size()) > 0:
            self.fp16_partitioned_groups_flat[sub_group_id].data.copy_(fp32_param.data)
    for sub_group_id, flat in enumerate(self.fp16_partitioned_groups_flat):
        for partitioned, value in zip(self.fp16_partitioned_groups[sub_group_id],
                                      self.unflatten(flat, self.fp16_partitioned_groups[sub_group_id])):
            partitioned.data = value.data


def _restore_module_extras(engine, tag_dir: str, stage3: bool, strict: bool) -> None:
    """Persistent buffers (from the module-states file) and frozen parameters (from
    ``zero/<name>/fp32.pt``, else, at ZeRO 1/2, the module-states file): DeepSpeed's
    universal load restores only the optimizer's parameters. A collective at ZeRO 3
    (frozen parameters are partitioned there too)."""
    model_file = os.path.join(tag_dir, _STAGE3_MODEL_FILE if stage3 else _STAGE12_MODEL_FILE)
    saved = _torch_load(model_file)["module"]
    missing, frozen, values = [], [], []
    for name, param in engine.module.named_parameters():
        if param.requires_grad:
            continue
        path = os.path.join(tag_dir, "zero", name, f"{_FP32}.pt")
        if os.path.isfile(path):
            loaded = torch.load(path, map_location="cpu", weights_only=False)
            frozen.append(param)
            values.append(loaded[_PARAM] if isinstance(loaded, dict) else loaded)
        elif not stage3 and name in saved:
            frozen.append(param)
            values.append(saved[name])
        else:
            missing.append(name)
    with torch.no_grad():
        for module_name, module in engine.module.named_modules():
            for name, buf in module._buffers.items():
                if buf is None or name in module._non_persistent_buffers_set:
                    continue
                key = f"{module_name}.{name}" if module_name else name
                if key in saved:
                    buf.copy_(saved[key])
                else:
                    missing.append(key)
        gathered = contextlib.nullcontext()
        if stage3 and frozen:
            import deepspeed
            gathered = deepspeed.zero.GatheredParameters(frozen, modifier_rank=0)
        with gathered:
            for param, value in zip(frozen, values):
                param.data.copy_(value.reshape(param.shape))
    if missing and strict:
        raise UniversalCheckpointError(f"{tag_dir} lacks the module's {missing}")


def load_universal(engine, load_dir: str, tag: str, *, load_module_strict: bool = True,
                   load_lr_scheduler_states: bool = True):
    """``engine.load_checkpoint(load_dir, tag)`` of a universal checkpoint (from
    :func:`to_universal` or DeepSpeed's ``ds_to_universal``) into a DeepSpeed engine
    with ZeRO 1-3 and any number of ranks; a collective. Returns DeepSpeed's
    ``(load_path, client_state)``.

    Switches ``checkpoint.load_universal`` on for this call only (the engine's config
    is unchanged afterwards, so later loads of ordinary tags work); at ZeRO 3 with
    other states than Adam's, the optimizer gets ds_pfc's loader for this call; then
    restores persistent buffers and frozen parameters, which DeepSpeed's universal
    load leaves untouched. Heads and ``rank_state`` files are not read here
    (:class:`~ds_pfc.deepspeed_plugin.PfcEngine` does that)."""
    from deepspeed.runtime.engine import DeepSpeedEngine
    if not isinstance(engine, DeepSpeedEngine):
        raise TypeError(f"engine must be a DeepSpeed engine (for a PfcEngine: its .engine; the heads and rank "
                        f"states are PfcEngine.load_checkpoint's part), got {type(engine).__name__}")
    if not isinstance(tag, str) or not tag:
        raise ValueError(f"tag must name the universal tag directory, got {tag!r}")
    tag_dir = os.path.join(load_dir, tag)
    layout, states = _universal_layout(tag_dir)
    if not engine.zero_optimization():
        raise UniversalCheckpointError(
            "the engine does not use ZeRO (stage 0), and DeepSpeed's universal load restores weights through the "
            "ZeRO optimizer only. Load the tag it was converted from with engine.load_checkpoint: ZeRO 0 module and "
            "optimizer states load at any world size")
    stage3 = engine.zero_optimization_stage() == 3
    if stage3 != (layout == 3):
        raise UniversalCheckpointError(f"{tag_dir} was saved at ZeRO stage {'3' if layout == 3 else '1 or 2'}, the "
                                       f"engine runs stage {engine.zero_optimization_stage()}; a universal "
                                       "checkpoint loads at the stage family it was saved with")
    optimizer = engine.optimizer
    own_loader = stage3 and states != set(_ADAM_STATES)
    why = "to load a universal checkpoint through DeepSpeed's loader"
    config = internal(engine, "_config", owner="engine", why=why)
    was = internal(config, "load_universal_checkpoint", owner="engine._config", why=why)
    if own_loader:
        # Replacing a method DeepSpeed no longer calls would load the Adam states only.
        require_internal(optimizer, "load_hp_checkpoint_state_from_checkpoint_dir_stage3",
                         owner=f"optimizer ({type(optimizer).__name__})",
                         why="to load ZeRO 3 optimizer states other than Adam's from a universal checkpoint")
    config.load_universal_checkpoint = True
    if own_loader:
        optimizer.load_hp_checkpoint_state_from_checkpoint_dir_stage3 = types.MethodType(_load_stage3_states,
                                                                                         optimizer)
    try:
        path, client_state = engine.load_checkpoint(load_dir, tag, load_module_strict=load_module_strict,
                                                    load_optimizer_states=True,
                                                    load_lr_scheduler_states=load_lr_scheduler_states)
    finally:
        config.load_universal_checkpoint = was
        if own_loader:
            del optimizer.load_hp_checkpoint_state_from_checkpoint_dir_stage3
    if path is None:
        raise FileNotFoundError(f"DeepSpeed found no module states in {tag_dir}")
    _restore_module_extras(engine, tag_dir, stage3, load_module_strict)
    return path, client_state
