"""DeepSpeed integration: the backbone in a DeepSpeed engine, Partial FC heads beside it.

DeepSpeed broadcasts every registered parameter from rank 0 at start-up, averages
every gradient over the data-parallel group, partitions parameters under ZeRO and
saves the module from one rank only. All four are wrong for a class-sharded head, so
heads are never registered: :func:`attach` stores a head on a module without
``nn.Module`` registration (the module can still call it in ``forward``), and
:class:`PfcEngine` steps the heads itself.

    model = MyModel()                                 # backbone + task layers
    attach(model, "identity", PartialFC(C, 512, sample_rate=0.1, group=None, device=dev))
    engine = initialize(model=model, config=ds_config)
    for x, y in loader:
        loss = engine(x, y)                           # model.forward calls self.identity(emb, y)
        engine.backward(loss)
        engine.step()                                 # heads step at the optimizer boundary

Gradient scale, per optimizer step of the engine:

- ``engine.backward`` divides the loss by the gradient accumulation steps; the heads'
  gradients are therefore the mean over the micro batches, like the backbone's.
- fp16: the loss is also multiplied by the current loss scale. The scale in force
  during the accumulation window is read before ``engine.step()`` and passed to
  ``head.step(grad_scale=)``; when DeepSpeed skips the step (overflow) the heads
  drop their gradients too.
- The heads' learning rate is the engine's (first parameter group) at that step,
  times each head's ``lr_ratio``.
- ``gradient_clipping`` applies to the engine's parameters only; head rows are not
  clipped (their gradients are already averaged over the global batch).
"""
from __future__ import annotations

import json
import os
import random
import shutil
import uuid
from dataclasses import dataclass

import torch
from torch import nn

from . import checkpoint as ckpt
from .head import PartialFC

__all__ = ["attach", "attached_heads", "initialize", "PfcEngine", "loss_scale", "COMPLETE_MARKER",
           "CheckpointIncompleteError", "list_checkpoints"]

COMPLETE_MARKER = "ds_pfc_complete.json"
_REGISTRY = "_ds_pfc_heads"


class CheckpointIncompleteError(RuntimeError):
    """A checkpoint tag directory lacks the completion marker (a save was interrupted)."""


@dataclass
class _Attached:
    head: PartialFC
    lr_ratio: float


def attach(module: nn.Module, name: str, head: PartialFC, *, lr_ratio: float = 1.0) -> PartialFC:
    """Make ``head`` available as ``module.<name>`` without registering it.

    The head takes no part in ``module.parameters()``, ``module.state_dict()``,
    ``module.to()`` or DeepSpeed's broadcast, averaging and ZeRO partitioning.
    :func:`initialize` finds it and :class:`PfcEngine` steps and checkpoints it.
    ``lr_ratio`` multiplies the engine's learning rate for this head."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
    if not isinstance(head, PartialFC):
        raise TypeError(f"head must be a ds_pfc.PartialFC, got {type(head).__name__}")
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"name must be a Python identifier, got {name!r}")
    if isinstance(lr_ratio, bool) or not isinstance(lr_ratio, (int, float)) or not lr_ratio >= 0:
        raise ValueError(f"lr_ratio must be a number >= 0, got {lr_ratio!r}")
    if name in module._modules or name in module._parameters or name in module._buffers:
        raise ValueError(f"module already has a registered member {name!r}")
    registry = module.__dict__.get(_REGISTRY)
    if registry is None:
        registry = {}
        object.__setattr__(module, _REGISTRY, registry)
    registry[name] = _Attached(head, float(lr_ratio))
    object.__setattr__(module, name, head)      # bypasses nn.Module.__setattr__: not a submodule
    return head


def attached_heads(module: nn.Module) -> dict[str, _Attached]:
    """Every head attached to ``module`` or its submodules, keyed by dotted path."""
    found = {}
    for prefix, sub in module.named_modules():
        for name, entry in sub.__dict__.get(_REGISTRY, {}).items():
            found[f"{prefix}.{name}" if prefix else name] = entry
    return found


def loss_scale(engine) -> float:
    """The factor DeepSpeed multiplies the loss by in ``engine.backward`` (1.0 unless
    fp16 loss scaling or a torch-autocast grad scaler is active)."""
    scaler = getattr(engine, "torch_autocast_z0_gradscaler", None)
    if scaler is not None:
        return float(scaler.get_scale())
    if not engine.fp16_enabled():
        return 1.0
    for attr in ("cur_scale", "loss_scale"):
        value = getattr(engine.optimizer, attr, None)
        if isinstance(value, torch.Tensor):
            value = value.item()
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    raise RuntimeError(f"fp16 is enabled but the loss scale of {type(engine.optimizer).__name__} cannot be read; "
                       "the heads' gradients could not be unscaled")


def _checked_heads(model: nn.Module, heads: dict | None) -> dict[str, _Attached]:
    found = attached_heads(model)
    for name, value in (heads or {}).items():
        if isinstance(value, PartialFC):
            value = _Attached(value, 1.0)
        elif isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], PartialFC):
            value = _Attached(value[0], float(value[1]))
        else:
            raise TypeError(f"heads[{name!r}] must be a PartialFC or (PartialFC, lr_ratio), got {value!r}")
        if name in found and found[name].head is not value.head:
            raise ValueError(f"heads[{name!r}] differs from the head attached to the model under that name")
        found[name] = value
    registered = [n for n, m in model.named_modules() if isinstance(m, PartialFC)]
    if registered:
        raise ValueError(f"PartialFC head(s) {registered} are registered submodules of the model: DeepSpeed would "
                         "overwrite their shards with rank 0's and average their state. Use "
                         "ds_pfc.deepspeed_plugin.attach(model, name, head) instead of assigning them")
    ids = [id(a.head) for a in found.values()]
    if len(set(ids)) != len(ids):
        raise ValueError("the same PartialFC is attached under several names")
    return found


def initialize(*, model: nn.Module, config: dict, heads: dict | None = None, model_parameters=None,
               optimizer=None, lr_scheduler=None, **kwargs) -> "PfcEngine":
    """``deepspeed.initialize`` for ``model`` plus the Partial FC heads attached to it
    (and any given in ``heads``: name -> PartialFC or (PartialFC, lr_ratio)).

    ``config`` is DeepSpeed's config dict (without the ``ds_pfc`` block). Build the
    heads outside ``deepspeed.zero.Init``: ZeRO-3 would partition a shard created
    inside it. Returns a :class:`PfcEngine`."""
    import deepspeed

    if not isinstance(config, dict):
        raise TypeError(f"config must be DeepSpeed's config dict, got {type(config).__name__}")
    if "ds_pfc" in config:
        raise ValueError("config still holds the 'ds_pfc' block; pass the DeepSpeed part "
                         "(ds_pfc.config.split_config returns both)")
    found = _checked_heads(model, heads)
    if model_parameters is None:
        model_parameters = [p for p in model.parameters() if p.requires_grad]
    engine, _, _, _ = deepspeed.initialize(model=model, config=config, model_parameters=model_parameters,
                                           optimizer=optimizer, lr_scheduler=lr_scheduler, **kwargs)
    dp = engine.dp_world_size
    for name, entry in found.items():
        head = entry.head
        if head.data_parallel_grad and head.world_size != dp:
            raise ValueError(f"head {name!r} is sharded over {head.world_size} ranks but the engine is data "
                             f"parallel over {dp}; build the head with the engine's data-parallel group")
    return PfcEngine(engine, found)


class PfcEngine:
    """A DeepSpeed engine plus the Partial FC heads it must not touch.

    Calls, ``backward`` and attribute reads go to the engine; :meth:`step` also steps
    the heads at the optimizer boundary; :meth:`save_checkpoint` /
    :meth:`load_checkpoint` keep the engine, the heads' per-rank shards and each
    rank's own state (data position, RNG) in one tag directory, completed by a
    marker file only once every rank has written everything."""

    def __init__(self, engine, heads: dict[str, _Attached]):
        self.engine = engine
        self.heads = {name: a.head for name, a in heads.items()}
        self.lr_ratios = {name: a.lr_ratio for name, a in heads.items()}
        self.last_lr: float | None = None
        self.skipped_steps = 0

    # -- training -------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        return self.engine(*args, **kwargs)

    @property
    def module(self) -> nn.Module:
        return self.engine.module

    @property
    def device(self) -> torch.device:
        return self.engine.device

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the engine runs the module in (inputs should match)."""
        if self.engine.fp16_enabled():
            return torch.float16
        if self.engine.bfloat16_enabled():
            return torch.bfloat16
        return torch.float32

    def backward(self, loss: torch.Tensor):
        return self.engine.backward(loss)

    def get_lr(self) -> float:
        return float(self.engine.get_lr()[0])

    def step(self) -> bool:
        """``engine.step()``; at the optimizer boundary also step every head with the
        learning rate the engine applied (times its ratio), unscaling fp16 gradients,
        or drop the heads' gradients when the engine skipped the step. Returns True
        when an optimizer step was applied."""
        boundary = self.engine.is_gradient_accumulation_boundary()
        if boundary:
            lr, scale = self.get_lr(), loss_scale(self.engine)
        self.engine.step()
        if not boundary:
            return False
        if not self.engine.was_step_applied():
            self.skipped_steps += 1
            for head in self.heads.values():
                head.zero_grad()
            return False
        self.last_lr = lr
        for name, head in self.heads.items():
            head.step(lr * self.lr_ratios[name], grad_scale=scale)
        return True

    @property
    def global_steps(self) -> int:
        return int(self.engine.global_steps)

    # -- checkpoints ----------------------------------------------------------------
    @property
    def rank(self) -> int:
        return int(self.engine.global_rank)

    @property
    def world_size(self) -> int:
        return int(self.engine.world_size)

    def _barrier(self):
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.barrier()

    def save_checkpoint(self, save_dir: str, tag: str, *, client_state: dict | None = None,
                        rank_state: dict | None = None, metadata: dict | None = None) -> str:
        """Write checkpoint ``tag`` under ``save_dir`` on every rank (a collective).

        Layout of ``save_dir/tag``: DeepSpeed's files (module, optimizer, scheduler,
        ``client_state``), ``<head>-rankXXXXX-of-XXXXX.safetensors`` per head and
        rank, ``rank_state-XXXXX-of-XXXXX.pt`` (``rank_state`` plus this rank's RNG
        states), and, last, ``ds_pfc_complete.json``, written by rank 0 after every
        rank finished (it also holds ``metadata``, JSON); then ``save_dir/latest`` is
        pointed at ``tag``. A crash at any point leaves the previous complete
        checkpoint and ``latest`` intact."""
        if not isinstance(tag, str) or not tag or "/" in tag or tag.startswith("."):
            raise ValueError(f"tag must be a plain directory name, got {tag!r}")
        tag_dir = os.path.join(save_dir, tag)
        if os.path.exists(os.path.join(tag_dir, COMPLETE_MARKER)):
            raise FileExistsError(f"checkpoint {tag_dir} exists and is complete; use a new tag")
        self.engine.save_checkpoint(save_dir, tag, client_state=client_state or {}, save_latest=False)
        os.makedirs(tag_dir, exist_ok=True)
        for name, head in self.heads.items():
            ckpt.save_head_shard(head, tag_dir, name=name)
        state = {"user": rank_state or {}, "rng": _rng_state(), "world_size": self.world_size, "rank": self.rank,
                 "skipped_steps": self.skipped_steps}
        _atomic_torch_save(state, os.path.join(tag_dir, _rank_file(self.rank, self.world_size)))
        self._barrier()
        if self.rank == 0:
            marker = {"tag": tag, "world_size": self.world_size, "global_steps": self.global_steps,
                      "heads": sorted(self.heads), "metadata": metadata or {}}
            _atomic_write(os.path.join(tag_dir, COMPLETE_MARKER), json.dumps(marker, indent=1).encode())
            _atomic_write(os.path.join(save_dir, "latest"), tag.encode())
        self._barrier()
        return tag_dir

    def load_checkpoint(self, load_dir: str, tag: str | None = None, *, restore_rng: bool = True) -> dict | None:
        """Load checkpoint ``tag`` (default: the one ``load_dir/latest`` names) on every
        rank. Returns ``{"tag", "client_state", "rank_state", "world_size"}`` or None
        when there is no checkpoint. ``rank_state`` is this rank's own when the world
        size is unchanged, else rank 0's (sampler positions are global); RNG states
        are restored only at the same world size. Heads saved at another world size
        are resharded in memory (every rank reads every shard: for very large heads
        reshard offline with ``launch/export.py reshard``)."""
        if tag is None:
            latest = os.path.join(load_dir, "latest")
            if not os.path.isfile(latest):
                return None
            with open(latest) as f:
                tag = f.read().strip()
        tag_dir = os.path.join(load_dir, tag)
        marker_path = os.path.join(tag_dir, COMPLETE_MARKER)
        if not os.path.isfile(marker_path):
            raise CheckpointIncompleteError(f"{tag_dir} has no {COMPLETE_MARKER}: the save did not finish; "
                                            "load an earlier tag")
        with open(marker_path) as f:
            marker = json.load(f)
        missing = sorted(set(marker["heads"]) ^ set(self.heads))
        if missing:
            raise ValueError(f"{tag_dir} holds heads {marker['heads']} but this model has {sorted(self.heads)}")
        path, client_state = self.engine.load_checkpoint(load_dir, tag)
        if path is None:
            raise FileNotFoundError(f"DeepSpeed found no engine checkpoint in {tag_dir}")
        saved_world = int(marker["world_size"])
        for name, head in self.heads.items():
            if saved_world == head.world_size:
                ckpt.load_head_shard(head, tag_dir, name=name)
            else:
                _load_resharded(head, tag_dir, name)
        same_world = saved_world == self.world_size
        rank_file = os.path.join(tag_dir, _rank_file(self.rank if same_world else 0, saved_world))
        state = torch.load(rank_file, map_location="cpu", weights_only=False)
        if same_world and restore_rng and state.get("rng") is not None:
            _set_rng_state(state["rng"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        return {"tag": tag, "client_state": client_state, "rank_state": state["user"], "world_size": saved_world}


def list_checkpoints(save_dir: str) -> list[str]:
    """Complete checkpoint tags in ``save_dir``, oldest first (by modification time)."""
    if not os.path.isdir(save_dir):
        return []
    tags = [t for t in os.listdir(save_dir) if os.path.isfile(os.path.join(save_dir, t, COMPLETE_MARKER))]
    return sorted(tags, key=lambda t: os.path.getmtime(os.path.join(save_dir, t, COMPLETE_MARKER)))


def _load_resharded(head: PartialFC, tag_dir: str, name: str) -> None:
    tensors, meta = ckpt.merge_shards(tag_dir, name=name)
    for key in ("num_classes", "embedding_size"):
        if meta[key] != getattr(head, key):
            raise ValueError(f"{tag_dir}: head {name!r} has {key}={meta[key]} but the model's has "
                             f"{getattr(head, key)}")
    lo, hi = head.class_start, head.class_end
    state = {k: v[lo:hi].clone() for k, v in tensors.items()}
    state["meta"] = torch.tensor([head.num_classes, head.embedding_size, lo, hi - lo, head.world_size,
                                  meta["seed"], meta["sample_step"], meta["step_count"]], dtype=torch.int64)
    head.load_state_dict(state)


def _rank_file(rank: int, world_size: int) -> str:
    return f"rank_state-{rank:05d}-of-{world_size:05d}.pt"


def _rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _atomic_write(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp-{uuid.uuid4().hex}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _atomic_torch_save(obj, path: str) -> None:
    tmp = f"{path}.tmp-{uuid.uuid4().hex}"
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def remove_checkpoint(save_dir: str, tag: str) -> None:
    """Delete a checkpoint tag directory (the marker first, so a half-deleted tag is
    never taken for complete)."""
    tag_dir = os.path.join(save_dir, tag)
    marker = os.path.join(tag_dir, COMPLETE_MARKER)
    if os.path.exists(marker):
        os.remove(marker)
    shutil.rmtree(tag_dir, ignore_errors=True)
