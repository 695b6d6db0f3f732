"""Import of arcface_torch checkpoints: backbone weights and Partial FC head shards.

Backbone. arcface_torch's ``model.pt`` is the backbone's plain ``state_dict()`` (its
training script saves the DDP module's inner module, so the keys carry no
``module.`` prefix). ds_pfc builds the same networks with other module names but the
same tensors in the same order, so the import pairs the file's tensors with the
ds_pfc backbone's state dict by position, and checks every pair: equal shapes and the
same kind of tensor (the last component of the name: ``weight``, ``bias``,
``running_mean``, ...). Where the two differ in what they hold, an explicit rule
says so (:data:`_DROPPED`: arcface_torch's ViT always holds a ``mask_token``, which
ds_pfc's ViT holds only when it masks tokens in training).

Head. arcface_torch shards the classifier over its ranks as ds_pfc does (rank ``r``
of ``W`` owns ``C // W + (r < C % W)`` classes from ``C // W * r + min(r, C % W)``),
so the rows of all ranks concatenated in rank order are the classifier in class-id
order. Two layouts are read:

- ``checkpoint_gpu_{r}.pt`` (``train_v2.py`` with ``save_all_states``): a dict whose
  ``state_dict_softmax_fc`` holds the rank's ``weight [C_r, d]``; the SGD momentum of
  that weight is in ``state_optimizer`` (the head's parameter is the last parameter
  group's only parameter). The state dict of the earlier ``PartialFC`` (sampling
  version 1: buffers ``weight`` and ``weight_mom``, or the parameter
  ``weight_activated`` at sample rate 1) is read too.
- ``rank_{r}_softmax_weight.pt`` / ``rank_{r}_softmax_weight_mom.pt`` (the first
  ``partial_fc.py``): plain tensors ``[C_r, d]``, weight and momentum.

They become ds_pfc head shards (:mod:`ds_pfc.checkpoint`'s format) for any number of
ranks: ``weight`` and the optimizer's states of it where they were saved, SGD's
``momentum_buffer`` for :class:`~ds_pfc.core.optim.RowSGD` (torch's SGD buffer, the same
quantity), or AdamW's ``exp_avg``, ``exp_avg_sq`` and step for
:class:`~ds_pfc.core.optim.RowAdamW`. A head of that world size loads its shard with
:func:`ds_pfc.checkpoint.load_head_shard`.
"""
from __future__ import annotations

import json
import os
import re
import warnings

import torch

__all__ = ["ArcfaceImportError", "NETWORKS", "read_backbone", "import_backbone", "ArcfaceHead", "read_head",
           "import_head", "import_arcface"]


class ArcfaceImportError(ValueError):
    """An arcface_torch file that cannot be imported; the message names the file and
    what was expected."""


# arcface_torch's network names (backbones.get_model) -> (ds_pfc backbone name,
# constructor options that reproduce arcface_torch's network). ViT options: stochastic
# depth and token masking as arcface_torch's recipes train them (training only).
_VIT = {"drop_path_rate": 0.1, "mask_ratio": 0.1}
NETWORKS = {
    "r18": ("iresnet18", {}), "r34": ("iresnet34", {}), "r50": ("iresnet50", {}), "r100": ("iresnet100", {}),
    "r200": ("iresnet200", {}),
    "mbf": ("mobilefacenet", {}), "mbf_large": ("mobilefacenet_large", {}),
    "vit_t": ("vit_t", _VIT), "vit_s": ("vit_s", _VIT), "vit_b": ("vit_b", _VIT),
    "vit_t_dp005_mask0": ("vit_t", {"drop_path_rate": 0.05}),
    "vit_s_dp005_mask_0": ("vit_s", {"drop_path_rate": 0.05}),
    "vit_b_dp005_mask_005": ("vit_b", {"drop_path_rate": 0.05, "mask_ratio": 0.05}),
    "vit_l_dp005_mask_005": ("vit_l", {"drop_path_rate": 0.05, "mask_ratio": 0.05}),
}
"""arcface_torch network name -> (ds_pfc backbone, its constructor options)."""

# The first key of each family's state dict in arcface_torch: tells a file of one
# family given under the name of another.
_FIRST_KEY = {"iresnet": "conv1.weight", "mobilefacenet": "layers.0.layers.0.weight", "vit": "pos_embed"}
# arcface_torch tensors with no counterpart in a ds_pfc backbone that does not use them.
_DROPPED = {"vit": ("mask_token",)}
# arcface_torch's ViT differs from a plain pre-norm ViT in the MLP activation (ReLU6)
# and the epsilon of the head's BatchNorms (2e-5): ds_pfc's ViT builds it as style "arcface".
_VIT_ARCFACE_OPTIONS = {"style": "arcface"}


def _family(canonical: str) -> str:
    for family in ("iresnet", "mobilefacenet", "vit"):
        if canonical.startswith(family):
            return family
    raise AssertionError(canonical)


def _load(path: str, what: str):
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{what} not found: {path}")
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:      # not a torch.save file, or one holding more than tensors and containers
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except Exception:
            pass
        raise ArcfaceImportError(f"{path}: cannot read it as a torch.save file of tensors ({what}): "
                                 f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}") from None


def _resolve_network(network: str) -> tuple[str, dict]:
    from ..models import ALIASES, BACKBONES
    if not isinstance(network, str) or network not in NETWORKS:
        raise ArcfaceImportError(f"unknown arcface_torch network {network!r}; expected one of {sorted(NETWORKS)}")
    canonical, options = NETWORKS[network]
    canonical = ALIASES.get(canonical, canonical)
    if canonical not in BACKBONES:
        raise ArcfaceImportError(f"arcface_torch network {network!r} needs ds_pfc backbone {canonical!r}, which "
                                 f"this ds_pfc does not build (it builds {list(BACKBONES)})")
    options = dict(options)
    if _family(canonical) == "vit":
        options.update(_VIT_ARCFACE_OPTIONS)
    return canonical, options


def _build(canonical: str, options: dict, embedding_size: int, device=None):
    from ..models import build_backbone
    try:
        if device is not None:
            with torch.device(device):
                return build_backbone(canonical, embedding_size=embedding_size, **options)
        return build_backbone(canonical, embedding_size=embedding_size, **options)
    except TypeError as err:
        raise ArcfaceImportError(
            f"this ds_pfc's {canonical} cannot be built as arcface_torch's network (options {options}: {err}); "
            "arcface_torch's ViT has a ReLU6 MLP and BatchNorm eps 2e-5 in its head, and an import into "
            "other layers would not reproduce its embeddings") from None


def _state_dict_of(obj, path: str) -> dict:
    """The backbone state dict in a loaded file: a plain state dict, or a
    ``checkpoint_gpu_{r}.pt`` dict (its ``state_dict_backbone``)."""
    if isinstance(obj, dict) and "state_dict_backbone" in obj:
        obj = obj["state_dict_backbone"]
    if not isinstance(obj, dict) or not obj or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                      for k, v in obj.items()):
        raise ArcfaceImportError(f"{path}: expected arcface_torch's model.pt, a state dict of named tensors "
                                 f"(or a checkpoint_gpu_*.pt with 'state_dict_backbone'), got "
                                 f"{type(obj).__name__}")
    if all(k.startswith("module.") for k in obj):       # saved from the DDP wrapper
        obj = {k[len("module."):]: v for k, v in obj.items()}
    return dict(obj)


def _embedding_size(state: dict, path: str) -> int:
    vectors = [v for v in state.values() if v.dim() == 1]
    if not vectors:
        raise ArcfaceImportError(f"{path}: no 1-D tensor (the embedding BatchNorm) in the state dict")
    return int(vectors[-1].shape[0])


def _guess(state: dict, width: float = 1.0) -> list[str]:
    """arcface_torch networks (at ``width``) whose tensor count and shapes ``state`` matches."""
    shapes = [tuple(v.shape) for v in state.values()]
    d = _embedding_size(state, "")
    found = []
    for network in NETWORKS:
        try:
            canonical, options = _resolve_network(network)
            model = _build(canonical, dict(options, width=width), d, device="meta")
        except (ArcfaceImportError, ValueError):
            continue
        target = model.state_dict()
        dropped = [k for k in _DROPPED.get(_family(canonical), ()) if k not in target]
        source = [s for k, s in zip(state, shapes) if k not in dropped]
        if source == [tuple(v.shape) for v in target.values()]:
            found.append(network)
    return found


def _pair(state: dict, target: dict, family: str, network: str, path: str, width: float = 1.0) -> dict:
    """``{ds_pfc key: tensor}`` from ``state`` paired with ``target`` by position."""
    first = next(iter(state))
    if first != _FIRST_KEY[family]:
        other = [f for f, k in _FIRST_KEY.items() if k == first]
        raise ArcfaceImportError(
            f"{path}: does not look like arcface_torch's {network} ({family}): its first tensor is {first!r}, "
            f"expected {_FIRST_KEY[family]!r}" + (f" (it looks like a {other[0]})" if other else ""))
    source = dict(state)
    for key in _DROPPED.get(family, ()):
        if key in source and key not in target:
            source.pop(key)
    if len(source) != len(target):
        hint = _guess(state, width)
        raise ArcfaceImportError(
            f"{path}: {len(source)} tensors, but arcface_torch's {network} has {len(target)}"
            + (f"; the file matches {hint} (pass that network name)" if hint else
               _first_difference(source, target)))
    out = {}
    for (src_key, value), (dst_key, expected) in zip(source.items(), target.items()):
        if src_key.rsplit(".", 1)[-1] != dst_key.rsplit(".", 1)[-1] or tuple(value.shape) != tuple(expected.shape):
            hint = _guess(state, width)
            raise ArcfaceImportError(
                f"{path}: tensor {src_key!r} {tuple(value.shape)} does not match ds_pfc's {dst_key!r} "
                f"{tuple(expected.shape)} of {network}" + (f"; the file matches {hint}" if hint else
                                                           " (a network of another width or depth?)"))
        if value.is_floating_point() != expected.is_floating_point():
            raise ArcfaceImportError(f"{path}: tensor {src_key!r} is {value.dtype}, ds_pfc's {dst_key!r} is "
                                     f"{expected.dtype}")
        out[dst_key] = value.to(expected.dtype) if value.is_floating_point() else value.to(torch.int64)
    return out


def _first_difference(source: dict, target: dict) -> str:
    for i, ((sk, sv), (tk, tv)) in enumerate(zip(source.items(), target.items())):
        if sk.rsplit(".", 1)[-1] != tk.rsplit(".", 1)[-1] or tuple(sv.shape) != tuple(tv.shape):
            return (f"; the first difference is tensor {i}: the file's {sk!r} {tuple(sv.shape)} against "
                    f"ds_pfc's {tk!r} {tuple(tv.shape)}")
    longer, name = (source, "the file") if len(source) > len(target) else (target, "ds_pfc's network")
    extra = list(longer)[min(len(source), len(target)):]
    return f"; {name} has {len(extra)} more tensor(s), from {extra[0]!r}"


def read_backbone(path: str, network: str, *, embedding_size: int | None = None, width: float = 1.0):
    """The ds_pfc backbone holding the weights of arcface_torch's ``network`` saved in
    ``path`` (``model.pt``, or the ``state_dict_backbone`` of a ``checkpoint_gpu_*.pt``),
    in eval mode, float32, and its ``backbone`` config block
    (``{"name", "width", "options"}``). ``embedding_size`` is read from the file
    (checked when given); ``width`` is for networks narrower than the published one.

    Raises :class:`ArcfaceImportError` naming the file and what was expected: an
    unknown network, a file of another network (the message names the networks it
    matches), tensors missing, extra or of other shapes (naming both keys)."""
    canonical, options = _resolve_network(network)
    state = _state_dict_of(_load(path, "arcface_torch backbone"), path)
    d = _embedding_size(state, path)
    if embedding_size is not None and embedding_size != d:
        raise ArcfaceImportError(f"{path}: the embedding size is {d}, expected {embedding_size}")
    if width != 1.0:
        options = dict(options, width=width)
    model = _build(canonical, options, d)
    family = _family(canonical)
    if family == "vit":
        _check_vit_matches(model, canonical)
    model.load_state_dict(_pair(state, model.state_dict(), family, network, path, width))
    block = {"name": canonical, "width": float(options.pop("width", 1.0)), "options": options}
    return model.float().eval(), block


def _check_vit_matches(model, canonical: str) -> None:
    acts = {type(m).__name__ for m in model.modules() if isinstance(m, (torch.nn.GELU, torch.nn.ReLU6))}
    if acts != {"ReLU6"}:
        raise ArcfaceImportError(f"this ds_pfc's {canonical} uses {sorted(acts)} in its MLPs, arcface_torch's "
                                 "ReLU6; the import would not reproduce its embeddings")


def import_backbone(path: str, network: str, out_path: str, *, config: dict | None = None,
                    embedding_size: int | None = None, width: float = 1.0, head=None) -> str:
    """Write the backbone of :func:`read_backbone` as a ds_pfc model export
    (:data:`ds_pfc.checkpoint.export.EXPORT_FORMAT`: ``backbone.<name>`` float32 weights, and
    ``heads.head.weight [C, d]`` when ``head`` (an :class:`ArcfaceHead`) is given),
    which ``launch/eval.py --model`` and :func:`ds_pfc.app.export.load_backbone` read.
    The export's job config is ``config`` (a full job config; its
    ``ds_pfc.backbone`` is set to the imported network) or a minimal one. Atomic.
    Returns ``out_path``."""
    from ..checkpoint import shards as ckpt
    from ..checkpoint.export import EXPORT_FORMAT
    model, block = read_backbone(path, network, embedding_size=embedding_size, width=width)
    d = _embedding_size(model.state_dict(), path)
    if head is not None and head.embedding_size != d:
        raise ArcfaceImportError(f"the head's embedding size {head.embedding_size} ({head.source}) differs from "
                                 f"the backbone's {d} ({path})")
    config = _job_config(config, block, d, head.num_classes if head is not None else None)
    tensors = {f"backbone.{k}": v.detach().contiguous() for k, v in model.state_dict().items()}
    metadata = {"format": EXPORT_FORMAT, "heads": json.dumps(["head"] if head is not None else []),
                "global_steps": "0", "source_world_size": str(head.world_size if head is not None else 1),
                "config": json.dumps(config), "imported_from": f"arcface_torch {network}"}
    if head is not None:
        tensors["heads.head.weight"] = head.weight.float().contiguous()
        metadata["heads.head.num_classes"] = str(head.num_classes)
        metadata["heads.head.embedding_size"] = str(head.embedding_size)
    return ckpt._atomic_save(tensors, out_path, metadata)


def _job_config(config: dict | None, block: dict, embedding_size: int, num_classes: int | None) -> dict:
    """The job config stored with an export: ``config`` with its backbone block set,
    or a minimal one (one class when no head is imported)."""
    if config is None:
        return {"gradient_clipping": 5.0,
                "ds_pfc": {"head": {"num_classes": num_classes or 1, "embedding_size": embedding_size},
                           "backbone": block, "evaluation": {"synthetic_pairs": 0}}}
    if not isinstance(config, dict) or not isinstance(config.get("ds_pfc"), dict):
        raise ArcfaceImportError("config must be a job config with a 'ds_pfc' block")
    config = json.loads(json.dumps(config))
    head = config["ds_pfc"].get("head", {})
    if head.get("embedding_size", 512) != embedding_size:
        raise ArcfaceImportError(f"config: ds_pfc.head.embedding_size is {head.get('embedding_size', 512)}, the "
                                 f"imported backbone's is {embedding_size}")
    if num_classes is not None and head.get("num_classes") != num_classes:
        raise ArcfaceImportError(f"config: ds_pfc.head.num_classes is {head.get('num_classes')!r}, the imported "
                                 f"head has {num_classes} classes")
    config["ds_pfc"]["backbone"] = dict(config["ds_pfc"].get("backbone", {}), **block)
    return config


# ---------------------------------------------------------------------------- head
_ROW_STATES = {"momentum_buffer": "RowSGD", "exp_avg": "RowAdamW", "exp_avg_sq": "RowAdamW", "step": "RowAdamW"}
_OPTIMIZER_STATES = {"RowSGD": ("momentum_buffer",), "RowAdamW": ("exp_avg", "exp_avg_sq", "step")}


class ArcfaceHead:
    """arcface_torch's classifier as its per-rank files hold it: ``parts[state][r]``
    is rank ``r``'s tensor of ``state``: ``weight [C_r, d]`` and the optimizer's
    states of it, ``momentum_buffer`` (SGD) or ``exp_avg``, ``exp_avg_sq``
    ``[C_r, d]`` and ``step [C_r]`` (AdamW), under the names ds_pfc's row optimizer
    (``optimizer``: ``"RowSGD"``, ``"RowAdamW"`` or None) gives them. ``world_size``
    is the source's, ``source`` the directory read. The tensors stay as loaded
    (memory-mapped where the file allows); :meth:`rows` reads a class range."""

    def __init__(self, parts: dict[str, list], world_size: int, source: str):
        self.parts, self.world_size, self.source = parts, world_size, source
        self._starts = [0]
        for part in parts["weight"]:
            self._starts.append(self._starts[-1] + int(part.shape[0]))
        names = [k for k in parts if k != "weight"]
        self.optimizer = _ROW_STATES[names[0]] if names else None

    @property
    def num_classes(self) -> int:
        return self._starts[-1]

    @property
    def embedding_size(self) -> int:
        return int(self.parts["weight"][0].shape[1])

    @property
    def states(self) -> list[str]:
        return list(self.parts)

    def rows(self, start: int, end: int, state: str = "weight") -> torch.Tensor:
        """Rows of classes ``[start, end)`` of ``state``: float32, ``step`` int32."""
        if state not in self.parts:
            raise ValueError(f"{self.source}: no {state!r} was saved (it holds {self.states})")
        first = self.parts[state][0]
        dtype = torch.int32 if state == "step" else torch.float32
        out = torch.empty((end - start,) + tuple(first.shape[1:]), dtype=dtype)
        for r, part in enumerate(self.parts[state]):
            lo, hi = max(start, self._starts[r]), min(end, self._starts[r + 1])
            if lo < hi:
                out[lo - start:hi - start].copy_(part[lo - self._starts[r]:hi - self._starts[r]])
        return out

    @property
    def weight(self) -> torch.Tensor:
        """The whole classifier ``[C, d]``, float32, in class-id order."""
        return self.rows(0, self.num_classes)


_V2 = re.compile(r"checkpoint_gpu_(\d+)\.pt")
_V1 = re.compile(r"rank_(\d+)_softmax_weight\.pt")


def _rank_files(directory: str) -> tuple[str, dict[int, str]]:
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"arcface_torch output directory not found: {directory}")
    entries = sorted(os.listdir(directory))
    found = {}
    for kind, pattern in (("checkpoint_gpu", _V2), ("softmax_weight", _V1)):
        ranks = {int(m.group(1)): os.path.join(directory, e) for e in entries for m in [pattern.fullmatch(e)] if m}
        if ranks:
            found[kind] = ranks
    if not found:
        raise FileNotFoundError(f"{directory} holds no arcface_torch head files (checkpoint_gpu_{{rank}}.pt or "
                                "rank_{rank}_softmax_weight.pt)")
    if len(found) > 1:
        raise ArcfaceImportError(f"{directory} holds both checkpoint_gpu_*.pt and rank_*_softmax_weight.pt files; "
                                 "keep one set")
    (kind, ranks), = found.items()
    world = max(ranks) + 1
    missing = [r for r in range(world) if r not in ranks]
    if missing:
        example = "checkpoint_gpu_{}.pt" if kind == "checkpoint_gpu" else "rank_{}_softmax_weight.pt"
        raise ArcfaceImportError(f"{directory}: missing {', '.join(example.format(r) for r in missing)} "
                                 f"(files of ranks 0..{world - 1} are there)")
    return kind, ranks


def _matrix(value, path: str, what: str, like: torch.Tensor | None = None) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.dim() != 2 or not value.is_floating_point():
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ArcfaceImportError(f"{path}: {what} must be a floating-point [num_local, d] tensor, got {shape}")
    if like is not None and value.shape != like.shape:
        raise ArcfaceImportError(f"{path}: {what} is {tuple(value.shape)}, expected the weight's shape "
                                 f"{tuple(like.shape)}")
    return value


def _read_v2(path: str) -> dict[str, torch.Tensor]:
    obj = _load(path, "arcface_torch head checkpoint")
    if not isinstance(obj, dict) or "state_dict_softmax_fc" not in obj:
        keys = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
        raise ArcfaceImportError(f"{path}: expected arcface_torch's checkpoint dict with 'state_dict_softmax_fc', "
                                 f"got {keys}")
    fc = obj["state_dict_softmax_fc"]
    if not isinstance(fc, dict):
        raise ArcfaceImportError(f"{path}: 'state_dict_softmax_fc' must be a state dict, got {type(fc).__name__}")
    if isinstance(fc.get("weight"), torch.Tensor) and fc["weight"].numel():
        out = {"weight": _matrix(fc["weight"], path, "state_dict_softmax_fc['weight']")}
        if isinstance(fc.get("weight_mom"), torch.Tensor) and fc["weight_mom"].numel():   # sampling version 1
            out["momentum_buffer"] = _matrix(fc["weight_mom"], path, "state_dict_softmax_fc['weight_mom']",
                                             out["weight"])
            return out
    elif isinstance(fc.get("weight_activated"), torch.Tensor):          # version 1 at sample rate 1
        out = {"weight": _matrix(fc["weight_activated"], path, "state_dict_softmax_fc['weight_activated']")}
    else:
        raise ArcfaceImportError(f"{path}: 'state_dict_softmax_fc' has no 'weight' (it holds {sorted(fc)})")
    out.update(_optimizer_states(obj.get("state_optimizer"), out["weight"], path))
    return out


def _optimizer_states(opt, weight: torch.Tensor, path: str) -> dict[str, torch.Tensor]:
    """The optimizer's states of the head's weight, the last parameter group's one
    parameter (arcface_torch puts the head's parameters last): SGD's
    ``momentum_buffer``, or AdamW's ``exp_avg``, ``exp_avg_sq`` and ``step`` (the
    step, one number, becomes every row's step count)."""
    if not isinstance(opt, dict) or not opt.get("param_groups"):
        return {}
    params = opt["param_groups"][-1].get("params", [])
    if len(params) != 1:
        raise ArcfaceImportError(f"{path}: the optimizer's last parameter group holds {len(params)} parameters, "
                                 "expected the head's weight alone")
    state = opt.get("state", {}).get(params[0], {})
    if state.get("momentum_buffer") is not None:
        return {"momentum_buffer": _matrix(state["momentum_buffer"], path, "the head weight's momentum_buffer",
                                           weight)}
    if "exp_avg" in state and "exp_avg_sq" in state and "step" in state:
        step = torch.as_tensor(state["step"])
        if step.numel() != 1:
            raise ArcfaceImportError(f"{path}: the head weight's AdamW step has {step.numel()} values, expected one")
        return {"exp_avg": _matrix(state["exp_avg"], path, "the head weight's exp_avg", weight),
                "exp_avg_sq": _matrix(state["exp_avg_sq"], path, "the head weight's exp_avg_sq", weight),
                "step": torch.full((weight.shape[0],), int(step.item()), dtype=torch.int32)}
    if state:
        warnings.warn(f"{path}: the head's optimizer states {sorted(state)} are neither SGD's nor AdamW's; "
                      "importing the weights only", stacklevel=3)
    return {}


def read_head(directory: str, *, num_classes: int | None = None) -> ArcfaceHead:
    """arcface_torch's classifier from the per-rank files in ``directory`` (one set:
    ``checkpoint_gpu_{r}.pt``, or ``rank_{r}_softmax_weight.pt`` with optional
    ``rank_{r}_softmax_weight_mom.pt``), every rank's row count checked against
    arcface_torch's split of ``C`` (the sum, or ``num_classes`` when given) over
    the ranks found. The tensors are memory-mapped where torch can (files of
    ``torch.save``'s zip format): an import holds one destination shard in memory."""
    from ..core.partition import Partition
    kind, files = _rank_files(directory)
    world = len(files)
    per_rank = []
    for r in range(world):
        if kind == "checkpoint_gpu":
            states = _read_v2(files[r])
        else:
            states = {"weight": _matrix(_load(files[r], "arcface_torch head weight"), files[r],
                                        "the softmax weight")}
            mom_path = os.path.join(directory, f"rank_{r}_softmax_weight_mom.pt")
            if os.path.isfile(mom_path):
                states["momentum_buffer"] = _matrix(_load(mom_path, "arcface_torch head momentum"), mom_path,
                                                    "the softmax weight momentum", states["weight"])
        if per_rank and states["weight"].shape[1] != per_rank[0]["weight"].shape[1]:
            raise ArcfaceImportError(f"{files[r]}: embedding size {states['weight'].shape[1]}, rank 0's is "
                                     f"{per_rank[0]['weight'].shape[1]}")
        if per_rank and sorted(states) != sorted(per_rank[0]):
            raise ArcfaceImportError(f"{files[r]}: holds {sorted(states)}, rank 0's file {sorted(per_rank[0])}")
        per_rank.append(states)
    total = sum(s["weight"].shape[0] for s in per_rank)
    C = total if num_classes is None else num_classes
    partition = Partition(C, world)
    for r, states in enumerate(per_rank):
        if states["weight"].shape[0] != partition.num_local(r):
            raise ArcfaceImportError(
                f"{files[r]}: {states['weight'].shape[0]} classes, but arcface_torch's rank {r} of {world} holds "
                f"C // {world} + ({r} < C % {world}) = {partition.num_local(r)} of C={C} "
                f"(the files hold {total} classes in all)")
    return ArcfaceHead({k: [s[k] for s in per_rank] for k in per_rank[0]}, world, directory)


#: import_head's ``optimizer_states`` choices.
OPTIMIZER_STATE_CHOICES = ("auto", "zero_momentum", "zero_adamw", "none")


def _zero_state(name: str, rows: int, d: int, dtype: torch.dtype) -> torch.Tensor:
    """A state no optimizer step has touched: zero rows (of the centers' dtype); AdamW's
    per-row step 0 (int32)."""
    return torch.zeros(rows, dtype=torch.int32) if name == "step" else torch.zeros(rows, d, dtype=dtype)


def import_head(head: ArcfaceHead | str, out_dir: str, world_size: int, *, name: str = "head",
                optimizer_states: str = "auto", num_classes: int | None = None) -> list[str]:
    """Write ``head`` (an :class:`ArcfaceHead`, or a directory :func:`read_head`
    reads) as ``world_size`` ds_pfc head shards of head ``name`` in ``out_dir``, rank
    ``r`` holding :class:`~ds_pfc.core.partition.Partition`'s classes, one shard in memory
    at a time. ``optimizer_states``: ``"auto"`` writes the optimizer states saved
    (SGD's ``momentum_buffer``, which a head with :class:`~ds_pfc.core.optim.RowSGD`
    momentum loads, or AdamW's for :class:`~ds_pfc.core.optim.RowAdamW`);
    ``"zero_momentum"`` the saved ones, or a zero ``momentum_buffer`` where none was
    saved; ``"zero_adamw"`` the saved AdamW states, or zero moments and step 0 (a fresh
    ``torch.optim.AdamW``) where none were saved (a saved SGD momentum is not written);
    ``"none"`` the weights only (which a head of any optimizer loads through
    ``ds_pfc.train.init.head``, starting its states at zero). Sampler and step counters
    start at 0. Returns the paths."""
    from ..checkpoint import shards as ckpt
    from ..core.partition import Partition
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if optimizer_states not in OPTIMIZER_STATE_CHOICES:
        raise ValueError(f"optimizer_states must be one of {list(OPTIMIZER_STATE_CHOICES)}, got {optimizer_states!r}")
    if isinstance(head, str):
        head = read_head(head, num_classes=num_classes)
    if os.path.isdir(out_dir):
        other = sorted(w for w in ckpt._list_shards(out_dir, name) if w != world_size)
        if other:
            raise ValueError(f"{out_dir} already holds {name!r} shards for world_size={other}; use an empty "
                             "directory")
    optimizer = head.optimizer
    if optimizer_states == "none":
        optimizer = None
    elif optimizer_states == "zero_momentum" and optimizer is None:
        optimizer = "RowSGD"
    elif optimizer_states == "zero_adamw" and optimizer != "RowAdamW":
        optimizer = "RowAdamW"
    names = ("weight",) + (_OPTIMIZER_STATES[optimizer] if optimizer else ())
    C, d = head.num_classes, head.embedding_size
    partition = Partition(C, world_size)
    paths = []
    for rank in range(world_size):
        start, end = partition.bounds(rank)
        weight = head.rows(start, end, "weight")
        part = {k: weight if k == "weight" else head.rows(start, end, k) if k in head.parts
                else _zero_state(k, end - start, d, weight.dtype) for k in names}
        meta = {"num_classes": C, "embedding_size": d, "class_start": start, "num_local": end - start,
                "world_size": world_size, "rank": rank, "seed": 0, "sample_step": 0, "step_count": 0,
                "sub_centers": 1, "margin_state": "{}", "optimizer": optimizer or "weights only"}
        specs = {k: (tuple(v.shape), v.dtype) for k, v in part.items()}
        path = os.path.join(out_dir, ckpt.shard_file_name(name, rank, world_size))
        paths.append(ckpt._atomic_stream_save(specs, lambda key, part=part: ckpt._row_chunks(part[key]), path,
                                              ckpt._metadata(meta, {k: v[1] for k, v in specs.items()})))
        del part
    return paths


def import_arcface(out_dir: str, *, backbone: str | None = None, network: str | None = None,
                   head: str | None = None, world_size: int | None = None, config: dict | None = None,
                   optimizer_states: str = "auto", num_classes: int | None = None) -> dict[str, object]:
    """Import what is given into ``out_dir``: the backbone (``backbone`` file of
    ``network``) as ``out_dir/model.safetensors`` (with the merged head when
    ``head`` is given too), the head (``head``: the directory of the per-rank files)
    as ``world_size`` shards ``out_dir/head-rank*-of-*.safetensors``
    (:func:`import_head`). Returns ``{"model": path or None, "head_shards": [paths]}``."""
    if backbone is None and head is None:
        raise ArcfaceImportError("nothing to import: give a backbone file (with its network) and/or a head directory")
    if backbone is not None and network is None:
        raise ArcfaceImportError("a backbone import needs the arcface_torch network name (e.g. r50)")
    if head is not None and world_size is None:
        raise ArcfaceImportError("a head import needs the target world size")
    if head is not None and (isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1):
        raise ArcfaceImportError(f"world_size must be a positive int, got {world_size!r}")
    read = read_head(head, num_classes=num_classes) if head is not None else None
    out = {"model": None, "head_shards": []}
    if backbone is not None:
        out["model"] = import_backbone(backbone, network, os.path.join(out_dir, "model.safetensors"),
                                       config=config, head=read)
    if read is not None:
        out["head_shards"] = import_head(read, out_dir, world_size, optimizer_states=optimizer_states)
    return out
