"""Starting a training run from pretrained weights (``ds_pfc.train.init``).

A fresh run can take its backbone from a model export (``export/model.safetensors``
of a ds_pfc run, or an arcface_torch model brought in by ``launch/export.py
import-arcface``) and its head from a directory of head shards
(``head-rank*-of-*.safetensors``: the importer's output or a ds_pfc checkpoint tag),
and can keep the backbone frozen for its first steps or train it at a fraction of
the learning rate. The frozen steps and the backbone's learning-rate multiplier are
one factor on the backbone's learning rate (:class:`BackboneScaledLR`); the heads
follow the schedule without it. With a class map the head grows from the shards of
another run (any number of ranks and classes) into this job's classes
(:mod:`ds_pfc.app.grow`).
"""
from __future__ import annotations

import json
import os

import torch

from .config import ConfigError

__all__ = ["read_backbone_weights", "load_backbone_weights", "head_directory", "load_head_weights", "backbone_factor",
           "BackboneScaledLR"]

_KEY = "ds_pfc.train.init"


def read_backbone_weights(path: str) -> tuple[dict[str, torch.Tensor], dict]:
    """``(backbone state dict, job config)`` of a model export ``path``: its
    ``backbone.*`` tensors, prefix removed, and the job config stored with it."""
    from safetensors import SafetensorError, safe_open
    from ..checkpoint.export import EXPORT_FORMAT
    where = f"{_KEY}.backbone"
    if not os.path.isfile(path):
        raise ConfigError(f"{where}: no such file {path!r} (a model export, export/model.safetensors)")
    state = {}
    try:
        with safe_open(path, "pt") as f:
            metadata = f.metadata() or {}
            if metadata.get("format") != EXPORT_FORMAT:
                raise ConfigError(f"{where}: {path} is not a ds_pfc model export (format "
                                  f"{metadata.get('format')!r}, expected {EXPORT_FORMAT!r}); export a run with "
                                  "launch/export.py export or import arcface_torch weights with launch/export.py "
                                  "import-arcface")
            for key in f.keys():
                if key.startswith("backbone."):
                    state[key[len("backbone."):]] = f.get_tensor(key)
    except SafetensorError as err:
        raise ConfigError(f"{where}: {path} is not a safetensors file ({err})") from None
    if not state:
        raise ConfigError(f"{where}: {path} holds no backbone weights (no 'backbone.*' tensors)")
    try:
        config = json.loads(metadata.get("config") or "{}")
    except json.JSONDecodeError:
        config = {}
    return state, config


def load_backbone_weights(backbone: torch.nn.Module, path: str) -> None:
    """Copy the backbone weights of export ``path`` into ``backbone`` (every
    parameter and buffer; names and shapes must match exactly)."""
    state, config = read_backbone_weights(path)
    own = backbone.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    wrong = [f"{k} {tuple(state[k].shape)} vs {tuple(own[k].shape)}" for k in sorted(set(own) & set(state))
             if state[k].shape != own[k].shape]
    if missing or unexpected or wrong:
        saved = (config.get("ds_pfc") or {}).get("backbone") if isinstance(config, dict) else None
        detail = "; ".join(part for part in (
            f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''}" if missing else "",
            f"unexpected {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}" if unexpected else "",
            f"shape (file vs this backbone) {wrong[:3]}{' ...' if len(wrong) > 3 else ''}" if wrong else "")
            if part)
        raise ConfigError(f"{_KEY}.backbone: {path} does not fit this job's backbone ({detail})"
                          + (f"; the file was written for ds_pfc.backbone {json.dumps(saved)}" if saved else "")
                          + "; set ds_pfc.backbone (and ds_pfc.head.embedding_size) to what the file holds")
    with torch.no_grad():
        backbone.load_state_dict(state, strict=True)


def head_directory(path: str) -> tuple[str, str | None]:
    """``ds_pfc.train.init.head`` as a directory of head shards: ``(directory, note)``.
    A directory holding shards is itself (note None); a run's checkpoints directory is
    the tag its ``latest`` file names, or the newest complete one when ``latest`` lags
    or is missing, checked complete and intact, as ``launch/export.py`` reads it
    (:func:`ds_pfc.checkpoint.export.resolve_tag`); the note says which tag (and why
    when not ``latest``'s). A damaged or empty checkpoints directory is a ConfigError
    naming the key."""
    import re
    import warnings
    from ..checkpoint.export import resolve_tag
    from ..checkpoint.tags import CheckpointError
    where = f"{_KEY}.head"
    if not os.path.isdir(path):
        raise ConfigError(f"{where}: no such directory {path!r}")
    if any(re.fullmatch(r"head-rank\d{5}-of-\d{5}\.safetensors", n) for n in os.listdir(path)):
        return path, None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            tag_dir = resolve_tag(path)
        except (CheckpointError, FileNotFoundError) as err:
            raise ConfigError(f"{where}: {path} holds no head shards and no readable checkpoint ({err})") from None
    why = "; ".join(str(w.message) for w in caught)
    note = (f"init: {where} {path} is a checkpoints directory: reading its tag {os.path.basename(tag_dir)} "
            + (f"({why})" if why else "(the one 'latest' names)"))
    return tag_dir, note


def load_head_weights(head, directory: str, *, seed: int | None = None, optimizer_states: bool = True) -> str:
    """Load this rank's shard of the head shards in ``directory`` into ``head``
    (:func:`ds_pfc.checkpoint.load_head_shard`); the shards must be written for
    ``head.world_size`` ranks. ``seed``: the head's sampling seed afterwards (the
    job's, not the one stored with the shards). ``optimizer_states`` False: the
    optimizer's states start at zero (the centers as saved). Shards that hold the
    centers alone (``import-arcface --optimizer_states none``, or a source that saved no
    optimizer state) start every optimizer at zero too: SGD's momentum, AdamW's moments
    and step (a fresh ``torch.optim.AdamW``). A head of other classes or another number
    of ranks grows from the shards with a class map instead (:mod:`ds_pfc.app.grow`).
    Returns what the optimizer states start from, for the log."""
    from ..checkpoint import shards as ckpt
    where = f"{_KEY}.head"
    if not os.path.isdir(directory):
        raise ConfigError(f"{where}: no such directory {directory!r}")
    shards = ckpt._list_shards(directory, "head")
    if not shards:
        raise ConfigError(f"{where}: {directory} holds no head shards (head-rank*-of-*.safetensors)")
    if head.world_size not in shards:
        raise ConfigError(
            f"{where}: {directory} holds head shards for world_size={sorted(shards)}, but this job runs "
            f"{head.world_size} rank(s). Write shards for {head.world_size} rank(s): for arcface_torch files, "
            f"python launch/export.py import-arcface --head <arcface_torch dir> --world_size {head.world_size} "
            f"--out <new dir>; for ds_pfc shards, ds_pfc.checkpoint.reshard({directory!r}, <new dir>, "
            f"{head.world_size}), or load them as they are with ds_pfc.train.init.class_map (a map of each "
            "old id to its id here)")
    others = [name for name in head.bank.state_names() if name != "weight"]
    try:
        saved = [name for name in ckpt.open_shards(directory, world_size=head.world_size).states if name != "weight"]
        zero = not optimizer_states or (bool(others) and not saved)
        ckpt.load_head_shard(head, directory, optimizer_states="zero" if zero else "saved")
    except (ValueError, FileNotFoundError) as err:
        raise ConfigError(f"{where}: {err}") from None
    if seed is not None:
        head.seed = int(seed)
    if not others:
        return "no optimizer states"
    if not optimizer_states:
        return f"optimizer states {others} zeroed"
    if zero:
        return (f"the shards hold the centers alone: {type(head.optimizer).__name__} starts at zero "
                f"({', '.join(others)})")
    return f"optimizer states {others} as saved"


def backbone_factor(factor, *, freeze_steps: int = 0, scale: float = 1.0):
    """``step -> factor(step) x m(step)``: ``m`` is 0 for the first ``freeze_steps``
    optimizer steps (0-based steps ``0 .. freeze_steps - 1``) and ``scale`` after."""
    freeze_steps, scale = int(freeze_steps), float(scale)

    def scaled(step: int) -> float:
        return factor(step) * (0.0 if step < freeze_steps else scale)
    return scaled


class BackboneScaledLR(torch.optim.lr_scheduler.LambdaLR):
    """The backbone's learning rate ``base lr x factor(step) x m(step)``
    (:func:`backbone_factor`). :meth:`head_lr` is the unscaled ``base lr x
    factor(step)`` that :class:`~ds_pfc.deepspeed_plugin.PfcEngine` gives the heads
    (times their ratio), so that the head trains while the backbone is frozen."""

    def __init__(self, optimizer, factor, *, freeze_steps: int = 0, scale: float = 1.0):
        self._factor = factor
        super().__init__(optimizer, backbone_factor(factor, freeze_steps=freeze_steps, scale=scale))

    def head_lr(self) -> float:
        """The learning rate of the next step without the backbone's multiplier."""
        return self.base_lrs[0] * self._factor(self.last_epoch)

    def state_dict(self) -> dict:
        state = super().state_dict()
        state.pop("_factor", None)
        return state
