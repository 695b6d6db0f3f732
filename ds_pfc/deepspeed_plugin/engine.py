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
  ``loss.backward()`` and ``engine.scale(loss).backward()`` (DeepSpeed accepts them at
  ZeRO 1-3) divide the gradient of the engine's outputs instead; a head applied to
  those outputs gets the same division on its centers' gradient
  (:meth:`PfcEngine._center_grad_hook`).
- Loss scaling (``fp16``, or ``torch_autocast`` with float16): :meth:`PfcEngine.backward`
  checks, by behaviour, that the gradient reaching the loss carries the scale the
  optimizer will divide by, and multiplies it in where DeepSpeed did not (its fp16
  optimizers at ZeRO stage 0 divide by the scale without having multiplied by it).
  The scale in force during the accumulation window is read before ``engine.step()``
  and passed to ``head.step(grad_scale=)``.
- Overflow: a head whose gradient is not finite poisons its embedding gradient, so
  DeepSpeed's overflow check sees it and skips the step; when the engine skips (its
  optimizer's overflow flag, or a drop of a torch ``GradScaler``'s scale) the heads
  drop their gradients too. A head that overflows while the backbone did not (a
  detached embedding) skips alone and the loss scale is lowered as for an overflow.
- The heads' learning rate is the engine's (first parameter group) at that step,
  times each head's ``lr_ratio``.
- ``gradient_clipping`` applies to the engine's parameters only, as arcface_torch
  clips the backbone only; head rows are not clipped.

Refused at :func:`initialize`: a gradient all-reduce that does not average
(``gradient_allreduce_op`` other than the mean; the backbone would get W times the
heads' gradient); sequence parallelism. Refused elsewhere: a head built inside
``deepspeed.zero.Init`` (at construction) and a head recomputed by activation
checkpointing (in backward). DeepSpeed internals are read through
:mod:`ds_pfc._ds_internals`: a missing one raises, naming it and the DeepSpeed
version. ``managed_gradient_accumulation: false`` is supported: every ``step()`` is
then an optimizer boundary, for the heads as for DeepSpeed. With a decoupled
(asynchronous) checkpoint writer, :meth:`PfcEngine.save_checkpoint` waits for
DeepSpeed's commit before it writes the completion marker.
"""
from __future__ import annotations

import contextlib
import io
import json
import math
import os
import warnings
import random
import shutil
import uuid
from dataclasses import dataclass

import torch
from torch import nn

from . import checkpoint as ckpt
from . import checkpoint_tags as tags
from . import universal
from ._ds_internals import (DeepSpeedInternalsError, deepspeed_version, internal, none_is_missing,
                            require_internal)
from .checkpoint_tags import CheckpointError, CheckpointIncompleteError
from .devices import collective_device
from .head import PartialFC

__all__ = ["attach", "attached_heads", "head_spec", "HeadSpec", "init_distributed", "initialize", "PfcEngine",
           "loss_scale",
           "DeepSpeedInternalsError", "COMPLETE_MARKER", "CheckpointError", "CheckpointIncompleteError",
           "list_checkpoints", "remove_checkpoint"]

COMPLETE_MARKER = tags.COMPLETE_MARKER
_REGISTRY = "_ds_pfc_heads"


SHARDINGS = ("model", "data")


@dataclass
class HeadSpec:
    """A :class:`PartialFC` declared before :func:`initialize` and built inside it, on
    the engine's device and from the engine's process groups (which, with AutoTP's
    ``"tensor_parallel": {"autotp_size": N}``, exist only inside
    ``deepspeed.initialize``). Make one with :func:`head_spec`."""

    num_classes: int
    embedding_size: int
    shard: str
    kwargs: dict

    def build(self, *, group, batch_group, device) -> PartialFC:
        return PartialFC(self.num_classes, self.embedding_size, group=group, batch_group=batch_group, device=device,
                         **self.kwargs)


def head_spec(num_classes: int, embedding_size: int, *, shard: str = "model", **kwargs) -> HeadSpec:
    """Declare a head for :func:`attach` / ``initialize(heads=...)``, built by
    :func:`initialize` from the engine's groups:

    - ``shard="model"``: classes sharded over every rank of the tensor x data parallel
      grid (the paper's model parallelism over all GPUs), samples gathered over the
      data-parallel group; tensor-parallel peers share the classes.
    - ``shard="data"``: classes sharded over the data-parallel group only; each
      tensor-parallel rank holds a copy (TP times the memory).

    Without tensor parallelism both are the data-parallel group. ``kwargs`` go to
    :class:`PartialFC` (not ``group``, ``batch_group``, ``device``)."""
    if shard not in SHARDINGS:
        raise ValueError(f"shard must be one of {SHARDINGS}, got {shard!r}")
    taken = sorted({"group", "batch_group", "device"} & set(kwargs))
    if taken:
        raise TypeError(f"head_spec sets {taken} from the engine; do not pass them")
    return HeadSpec(num_classes, embedding_size, shard, dict(kwargs))


@dataclass
class _Attached:
    head: PartialFC | HeadSpec
    lr_ratio: float
    owner: nn.Module | None = None
    attr: str | None = None


def attach(module: nn.Module, name: str, head: PartialFC | HeadSpec, *,
           lr_ratio: float = 1.0) -> PartialFC | HeadSpec:
    """Make ``head`` available as ``module.<name>`` without registering it.

    The head takes no part in ``module.parameters()``, ``module.state_dict()``,
    ``module.to()`` or DeepSpeed's broadcast, averaging and ZeRO partitioning.
    :func:`initialize` finds it and :class:`PfcEngine` steps and checkpoints it.
    ``head`` may be a :class:`HeadSpec` (:func:`head_spec`): :func:`initialize` then
    builds the head from the engine's groups and puts it in its place.
    ``lr_ratio`` multiplies the engine's learning rate for this head."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
    if not isinstance(head, (PartialFC, HeadSpec)):
        raise TypeError(f"head must be a ds_pfc.PartialFC or a head_spec(...), got {type(head).__name__}")
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
    registry[name] = _Attached(head, float(lr_ratio), module, name)
    object.__setattr__(module, name, head)      # bypasses nn.Module.__setattr__: not a submodule
    return head


def attached_heads(module: nn.Module) -> dict[str, _Attached]:
    """Every head attached to ``module`` or its submodules, keyed by dotted path."""
    found = {}
    for prefix, sub in module.named_modules():
        for name, entry in sub.__dict__.get(_REGISTRY, {}).items():
            found[f"{prefix}.{name}" if prefix else name] = entry
    return found


def _grad_scaler(engine):
    """The torch ``GradScaler`` DeepSpeed uses for float16 autocast (ZeRO 0: the
    engine's; ZeRO 1-3: the optimizer's), or None without float16 autocast. With it
    and no scaler where this DeepSpeed keeps it, raises (the heads' gradients would
    stay multiplied by the scale)."""
    why = "to unscale the heads' gradients under float16 torch_autocast"
    enabled = internal(engine, "torch_autocast_enabled", owner="engine", why=why)
    if not enabled() or internal(engine, "torch_autocast_dtype", owner="engine", why=why)() != torch.float16:
        return None
    if engine.zero_optimization_stage() == 0:
        scaler = internal(engine, "torch_autocast_z0_gradscaler", owner="engine", why=why)
        return none_is_missing(scaler, "engine", "torch_autocast_z0_gradscaler", why)
    optimizer = engine.optimizer
    owner = f"optimizer ({type(optimizer).__name__})"
    scaler = internal(optimizer, "torch_autocast_gradscaler", owner=owner, why=why)
    return none_is_missing(scaler, owner, "torch_autocast_gradscaler", why)


def loss_scale(engine) -> float:
    """The factor the optimizer divides the gradients by at the next step (1.0 unless
    fp16 loss scaling or a float16-autocast grad scaler is active)."""
    scaler = _grad_scaler(engine)
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
    raise DeepSpeedInternalsError(f"fp16 is enabled but the loss scale of {type(engine.optimizer).__name__} "
                                  "cannot be read (neither cur_scale nor loss_scale) in the installed DeepSpeed "
                                  f"{deepspeed_version()}; the heads' gradients could not be unscaled")


def _uses_loss_scaling(engine) -> bool:
    return _grad_scaler(engine) is not None or bool(engine.fp16_enabled())


def _lower_loss_scale(engine) -> None:
    """Let the optimizer's loss scaler react as to an overflow (a dynamic scale comes
    down, after its hysteresis; a static one stays)."""
    scaler = _grad_scaler(engine)
    if scaler is not None:
        scaler.update(new_scale=scaler.get_scale() * scaler.get_backoff_factor())
        return
    # DeepSpeed's fp16 and ZeRO optimizers
    internal(engine.optimizer, "_update_scale", owner=f"optimizer ({type(engine.optimizer).__name__})",
             why="to lower the loss scale after a head gradient overflowed")(True)


class _LossScaleProbe(torch.autograd.Function):
    """forward: identity on the loss; backward: hands the incoming gradient to
    ``engine._scaled_grad`` with the loss scale and the divisor DeepSpeed applied to
    the loss (which may multiply the missing loss scale in)."""

    @staticmethod
    def forward(ctx, loss, engine, scale, divisor):
        ctx.engine, ctx.scale, ctx.divisor = engine, scale, divisor
        return loss.view_as(loss)

    @staticmethod
    def backward(ctx, grad):
        return ctx.engine._scaled_grad(grad, ctx.scale, ctx.divisor), None, None, None


def _checked_heads(model: nn.Module, heads: dict | None) -> dict[str, _Attached]:
    found = attached_heads(model)
    for name, value in (heads or {}).items():
        if isinstance(value, (PartialFC, HeadSpec)):
            value = _Attached(value, 1.0)
        elif isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], (PartialFC, HeadSpec)):
            value = _Attached(value[0], float(value[1]))
        else:
            raise TypeError(f"heads[{name!r}] must be a PartialFC or head_spec (optionally with an lr_ratio: "
                            f"(head, lr_ratio)), got {value!r}")
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


def _last_stage_heads(model: nn.Module, found: dict[str, _Attached]) -> dict[str, _Attached]:
    """On a DeepSpeed ``PipelineModule`` the heads live on the last stage, the one that
    runs ``loss_fn``: elsewhere head_spec declarations are not built and a built
    head is refused."""
    from deepspeed.pipe import PipelineModule
    if not isinstance(model, PipelineModule) or model.mpu().is_last_stage:
        return found
    built = sorted(name for name, entry in found.items() if isinstance(entry.head, PartialFC))
    if built:
        grid = model.mpu()
        raise ValueError(f"heads {built} are on pipeline stage {grid.get_stage_id()} of "
                         f"{grid.get_pipe_parallel_world_size()}, but heads belong to the last stage (its loss_fn "
                         "calls them): build them only where model.mpu().is_last_stage, over "
                         "model.mpu().get_data_parallel_group(), or declare them with head_spec")
    return {}


_SHM_DIR = "/dev/shm"
_SHM_PREFIX = "deepspeed_allreduce_buffer"


def init_distributed(dist_backend: str | None = None, environ=os.environ, **kwargs) -> None:
    """``deepspeed.init_distributed``, then unlink the name of this rank's segment of
    DeepSpeed's CPU shared-memory all-reduce.

    On the CPU accelerator, when every rank is on one machine (``LOCAL_SIZE`` equals
    the world size, as the ``deepspeed`` launcher and a single-process run set it),
    DeepSpeed maps a 69 MB segment per rank under ``/dev/shm`` and never unlinks it:
    each run leaves ``world_size`` x 69 MB of memory behind until reboot. Every rank
    has mapped every peer's segment when ``deepspeed.init_distributed`` returns, so
    after one barrier each rank unlinks its own name; the mappings stay valid for the
    life of the processes and the memory goes back when they exit, killed or not.
    ``dist_backend`` defaults to the accelerator's communication backend."""
    import deepspeed
    from deepspeed.comm import comm as ds_comm
    from deepspeed.accelerator import get_accelerator

    deepspeed.init_distributed(dist_backend=dist_backend or get_accelerator().communication_backend_name(),
                               **kwargs)
    if getattr(ds_comm.cdb, "shm_comm_op", None) is None:
        return                                  # no shared-memory all-reduce (GPU accelerators)
    import torch.distributed as dist
    world = dist.get_world_size()
    local = environ.get("LOCAL_SIZE", "")
    if not (local.isdigit() and int(local) == world):
        return                                  # DeepSpeed maps segments only when all ranks are local
    if world > 1:
        dist.barrier()                          # every peer has opened this rank's segment
    name = (f"{_SHM_PREFIX}_{os.getuid()}_{environ.get('MASTER_ADDR', '')}_{environ.get('MASTER_PORT', '')}"
            f"_{dist.get_rank()}")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(_SHM_DIR, name))


def initialize(*, model: nn.Module, config: dict, heads: dict | None = None, model_parameters=None,
               optimizer=None, lr_scheduler=None, mpu=None, **kwargs) -> "PfcEngine":
    """``deepspeed.initialize`` for ``model`` plus the Partial FC heads attached to it
    (and any given in ``heads``: name -> PartialFC, head_spec, or (either, lr_ratio)).

    ``config`` is DeepSpeed's config dict (without the ``ds_pfc`` block). ``mpu``: a
    Megatron-style model-parallel unit (``get_data_parallel_group``,
    ``get_tensor_model_parallel_group``, ...), passed on to DeepSpeed. The process
    groups come from one place: ``mpu`` when given, else the engine's (a pipeline's
    grid; ``deepspeed.utils.groups``, where AutoTP puts its groups). Heads declared with
    :func:`head_spec` are built here from them; every head's groups are then
    compared by membership with the engine's data-parallel
    and tensor-parallel groups, and a mismatch is refused
    naming the head and both rank lists. With a ``PipelineModule`` only last-stage
    ranks hold heads (:meth:`PfcEngine.train_batch`); their tensor-parallel group is the
    pipeline grid's tensor-slicing group. Sequence parallelism is refused. Build heads
    outside ``deepspeed.zero.Init`` (a head built inside it is refused).
    Returns a :class:`PfcEngine`."""
    import deepspeed

    if not isinstance(config, dict):
        raise TypeError(f"config must be DeepSpeed's config dict, got {type(config).__name__}")
    if "ds_pfc" in config:
        raise ValueError("config still holds the 'ds_pfc' block; pass the DeepSpeed part "
                         "(ds_pfc.config.split_config returns both)")
    found = _checked_heads(model, heads)
    found = _last_stage_heads(model, found)
    if model_parameters is None:
        model_parameters = [p for p in model.parameters() if p.requires_grad]
    if mpu is not None:
        kwargs["mpu"] = mpu
    engine, _, _, _ = deepspeed.initialize(model=model, config=config, model_parameters=model_parameters,
                                           optimizer=optimizer, lr_scheduler=lr_scheduler, **kwargs)
    _check_engine(engine, found)
    layout = _EngineGroups.of(engine, mpu)
    for name, entry in found.items():
        if isinstance(entry.head, HeadSpec):
            entry.head = layout.build(entry.head)
            if entry.owner is not None:
                object.__setattr__(entry.owner, entry.attr, entry.head)
        layout.check(name, entry.head)
    return PfcEngine(engine, found)


@dataclass
class _EngineGroups:
    """The engine's data-parallel and tensor-parallel groups, and their ranks."""

    dp_group: object
    tp_group: object
    dp_ranks: list
    tp_ranks: list
    model_ranks: list
    """Every rank of the tensor x data parallel grid this rank is in (the union of
    the tensor-parallel groups of the data-parallel ranks)."""
    device: torch.device
    _model_group: object = None

    @classmethod
    def of(cls, engine, mpu) -> "_EngineGroups":
        from .collectives import group_ranks
        dp = internal(engine, "data_parallel_group", owner="engine", why="to build and check the heads' groups")
        tp = _tensor_parallel_group(engine, mpu)
        dp_ranks = sorted(group_ranks(dp))
        tp_ranks = sorted(group_ranks(tp)) if tp is not None else [torch.distributed.get_rank()
                                                                   if torch.distributed.is_initialized() else 0]
        device = torch.device(engine.device)
        model_ranks = dp_ranks
        if len(tp_ranks) > 1:       # the TP groups of every DP rank, gathered over DP
            if len(dp_ranks) > 1:
                table = [None] * len(dp_ranks)
                torch.distributed.all_gather_object(table, tp_ranks, group=dp)
            else:
                table = [tp_ranks]
            model_ranks = sorted({r for ranks in table for r in ranks})
        return cls(dp, tp, dp_ranks, tp_ranks, model_ranks, device)

    def _groups_for(self, shard: str):
        if shard == "data" or len(self.tp_ranks) == 1:
            return self.dp_group, self.dp_group
        if self._model_group is None:
            world = torch.distributed.get_world_size()
            self._model_group = torch.distributed.group.WORLD if len(self.model_ranks) == world else \
                torch.distributed.new_group(self.model_ranks, use_local_synchronization=True)
        return self._model_group, self.dp_group

    def build(self, spec: HeadSpec) -> PartialFC:
        group, batch_group = self._groups_for(spec.shard)
        return spec.build(group=group, batch_group=batch_group, device=self.device)

    def check(self, name: str, head: PartialFC) -> None:
        """Refuse a head whose groups are not the engine's, by membership."""
        from .collectives import group_ranks
        # Also without data_parallel_grad: a head gathering over other ranks than the
        # engine's data-parallel group trains on duplicated or missing samples.
        batch = sorted(group_ranks(head.batch_group))
        if batch != self.dp_ranks:
            raise ValueError(f"head {name!r} gathers its samples over ranks {batch}, but the engine's data-parallel "
                             f"group is ranks {self.dp_ranks}: build it with the engine's data-parallel group "
                             "(or declare it with ds_pfc.deepspeed_plugin.head_spec)")
        classes = sorted(group_ranks(head.group))
        if classes not in (self.dp_ranks, self.model_ranks):
            allowed = f"ranks {self.dp_ranks} (data parallel)"
            if self.model_ranks != self.dp_ranks:
                allowed += f" or ranks {self.model_ranks} (tensor x data parallel)"
            raise ValueError(f"head {name!r} shards its classes over ranks {classes}, but with the engine's groups "
                             f"they must be sharded over {allowed}")


def _tensor_parallel_group(engine, mpu):
    """The engine's tensor-parallel group, or None without tensor parallelism: the
    caller's ``mpu`` (Megatron's ``get_tensor_model_parallel_group``), else the engine's
    own ``mpu`` (a pipeline's grid, whose tensor-slicing group is
    ``get_slice_parallel_group``; DeepSpeed's groups module under AutoTP), else
    DeepSpeed's tensor-parallel group if one was created."""
    from deepspeed.utils import groups
    why = "to find the tensor-parallel group the heads' classes are sharded over"
    for unit in (mpu, internal(engine, "mpu", owner="engine", why=why)):
        if unit is None or unit is groups:      # AutoTP's engine.mpu: its group is read below
            continue
        if hasattr(unit, "get_tensor_model_parallel_group"):
            return unit.get_tensor_model_parallel_group()
        if hasattr(unit, "get_slice_parallel_group"):       # PipelineParallelGrid
            return unit.get_slice_parallel_group()
    return internal(groups, "_TENSOR_MODEL_PARALLEL_GROUP", owner="deepspeed.utils.groups", why=why)


def _check_engine(engine, heads: dict) -> None:
    """Refuse engine options under which the heads would train wrong."""
    if not heads:
        return
    names = sorted(heads)
    sequence_parallel = internal(engine, "sequence_parallel_size", owner="engine",
                                 why="to refuse sequence parallelism, which the heads do not support")
    if sequence_parallel > 1:
        raise ValueError(f"heads {names}: sequence parallelism (sequence_parallel_size={sequence_parallel}) is not "
                         "supported: DeepSpeed reduces the backbone's gradients over the sequence x data parallel "
                         "ranks but divides by the data-parallel size only, so the embedding gradient a head "
                         "returns would be wrong by a factor that depends on how the embedding is pooled over the "
                         "sequence-parallel ranks. Train the heads without sequence parallelism "
                         "(sequence_parallel_size 1)")
    average = internal(engine, "gradient_average", owner="engine",
                       why="to check that the engine averages gradients over the data-parallel ranks")
    if not average and any(a.head.data_parallel_grad for a in heads.values()):
        raise ValueError(f"heads {names}: the engine sums gradients over the data-parallel ranks "
                         f"(gradient_allreduce_op={engine._config.gradient_allreduce_op!r}), but a head's embedding "
                         "gradient is that of the mean loss over the global batch, which DeepSpeed must average; "
                         "use the default gradient_allreduce_op (mean)")
    if engine.use_node_local_storage():
        raise ValueError(f"heads {names}: checkpoint.use_node_local_storage is not supported: ds_pfc's checkpoints "
                         "need one output directory that every rank reads and writes (rank 0 writes the marker and "
                         "latest; a resume on another number of ranks reads every rank's head shards)")


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
        # Loss scaling: whether DeepSpeed's backward multiplies the loss by the scale
        # (None until a backward with a scale != 1 has shown it), and the scale and
        # gradient accumulation divisor of the backward in flight.
        self._ds_scales_loss: bool | None = None
        self._scaling = _uses_loss_scaling(engine)
        # Inside engine(...) / engine.backward / train_batch: where the heads' forward
        # runs and which backward produces their gradients (see _center_grad_hook).
        self._forward_depth = 0
        self._backward_depth = 0
        for head in self.heads.values():
            head.guard_nonfinite = self._scaling
            head.center_grad_hook = self._center_grad_hook

    def __getattr__(self, name):
        # Only reached for names PfcEngine itself lacks: the engine answers them.
        if name == "engine":
            raise AttributeError(name)
        return getattr(self.engine, name)

    # -- training -------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        self._refuse_on_pipeline("engine(...)")
        self._forward_depth += 1
        try:
            return self.engine(*args, **kwargs)
        finally:
            self._forward_depth -= 1

    forward = __call__

    def _center_grad_hook(self):
        """Called by each head's training forward: a hook for its centers' gradient,
        or None.

        ``engine.backward(loss)`` divides the loss by the gradient accumulation steps
        (GAS). ``loss.backward()`` and ``engine.scale(loss).backward()`` (ZeRO 1-3)
        leave the loss alone: DeepSpeed divides the gradient of the engine's outputs
        instead. A head called inside the module's forward is upstream of those
        outputs and gets the division with the backbone; a head applied to the
        engine's outputs (``head(engine(x), y)``) is not, so its centers' gradient is
        divided here, when it did not come through :meth:`backward`."""
        if self._forward_depth:
            return None

        def hook(grad):
            if self._backward_depth:
                return grad
            return grad / self.engine.gradient_accumulation_steps()
        return hook

    def train(self, mode: bool = True) -> "PfcEngine":
        """Training mode for the engine's module and every head."""
        self.engine.train(mode)
        for head in self.heads.values():
            head.train(mode)
        return self

    def eval(self) -> "PfcEngine":
        return self.train(False)

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

    def backward(self, loss: torch.Tensor, **kwargs):
        """``engine.backward(loss)``, making sure the gradient carries the loss scale
        the optimizer will divide by (see the module docstring)."""
        self._refuse_on_pipeline("engine.backward")
        self._backward_depth += 1
        try:
            if not self._scaling:
                return self.engine.backward(loss, **kwargs)
            gas = self.engine.gradient_accumulation_steps() if kwargs.get("scale_wrt_gas", True) else 1
            return self.engine.backward(_LossScaleProbe.apply(loss, self, loss_scale(self.engine), float(gas)),
                                        **kwargs)
        finally:
            self._backward_depth -= 1

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``engine.scale(loss)``, for ``engine.scale(loss).backward()`` (DeepSpeed's
        ZeRO 1-3; at ZeRO 0 DeepSpeed accepts only ``engine.backward``): the loss
        times the loss scale, through the same check as :meth:`backward` that the
        gradient carries the scale the optimizer divides by. The heads' share of the
        gradient accumulation division is applied to their gradients."""
        self._refuse_on_pipeline("engine.scale")
        if self._scaling:
            loss = _LossScaleProbe.apply(loss, self, loss_scale(self.engine), 1.0)
        return self.engine.scale(loss)

    def _scaled_grad(self, grad: torch.Tensor, scale: float, gas: float) -> torch.Tensor:
        if scale == 1.0:
            return grad
        if self._ds_scales_loss is None:        # decided once, from what arrived (one host sync)
            got = float(grad) * gas
            if math.isclose(got, scale, rel_tol=1e-3):
                self._ds_scales_loss = True
            elif math.isclose(got, 1.0, rel_tol=1e-3):
                self._ds_scales_loss = False
            else:
                raise RuntimeError(f"the loss gradient DeepSpeed back-propagates is {got:g} / "
                                   f"gradient_accumulation_steps, neither 1 nor the loss scale {scale:g} its "
                                   f"optimizer ({type(self.engine.optimizer).__name__}) divides by; the heads' "
                                   "gradients cannot be unscaled")
        return grad if self._ds_scales_loss else grad * scale

    def get_lr(self) -> float:
        """The learning rate of the next optimizer step that the heads follow (times
        their ratios): the engine's first parameter group's, or, where the engine's
        scheduler scales the backbone's apart (it has a ``head_lr()`` method, e.g.
        :class:`ds_pfc.finetune.BackboneScaledLR`), the unscaled one it reports."""
        head_lr = getattr(getattr(self.engine, "lr_scheduler", None), "head_lr", None)
        if callable(head_lr):
            return float(head_lr())
        return float(self.engine.get_lr()[0])

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the next :meth:`step` is an optimizer step (every ``step()`` is one
        without managed gradient accumulation)."""
        managed = internal(self.engine, "managed_gradient_accumulation", owner="engine",
                           why="to know whether every step() is an optimizer boundary for the heads")
        if not managed():
            return True
        return bool(self.engine.is_gradient_accumulation_boundary())

    def step(self) -> bool:
        """``engine.step()``; at the optimizer boundary also step every head with the
        learning rate the engine applied (times its ratio), unscaling loss-scaled
        gradients, or drop the heads' gradients when the step is skipped. Returns True
        when an optimizer step was applied."""
        self._refuse_on_pipeline("engine.step")
        boundary = self.is_gradient_accumulation_boundary()
        heads_finite = True
        if boundary:
            lr, scale = self.get_lr(), loss_scale(self.engine)
            if self._scaling and self.heads:
                heads_finite = self._heads_finite()
        scaler = _grad_scaler(self.engine) if boundary else None
        self.engine.step()
        if not boundary:
            return False
        applied = bool(self.engine.was_step_applied())
        if scaler is not None:
            if scaler.get_scale() < scale:
                applied = False      # the GradScaler skipped the optimizer (the engine may not say so)
            elif not applied:
                # ZeRO 1-3 skip an overflowing step before their GradScaler sees the
                # overflow, so its scale would never come down and every later step
                # would overflow too: lower it as the GradScaler would have.
                scaler.update(new_scale=scale * scaler.get_backoff_factor())
        return self._step_heads(applied, heads_finite, lr, scale)

    def _step_heads(self, applied: bool, heads_finite: bool, lr: float, scale: float) -> bool:
        """After the engine's optimizer step: step the heads with ``lr`` (times each
        ratio), unscaling by ``scale``, or drop their gradients when the step was
        skipped. A head overflow on a step the engine applied (the backbone's gradient
        was finite: the head's embedding gradient did not reach it) skips the heads
        alone and lowers the loss scale. Returns whether the heads stepped."""
        if applied and not heads_finite:
            _lower_loss_scale(self.engine)
            warnings.warn(f"step {self.global_steps}: a head gradient overflowed at loss scale {scale:g}; the heads "
                          "skipped this step", RuntimeWarning, stacklevel=3)
        if not applied or not heads_finite:
            self.skipped_steps += 1
            for head in self.heads.values():
                head.zero_grad()
            return False
        self.last_lr = lr
        for name, head in self.heads.items():
            head.step(lr * self.lr_ratios[name], grad_scale=scale)
        return True

    # -- pipeline parallelism -------------------------------------------------------
    def _is_pipeline(self) -> bool:
        from deepspeed.runtime.pipe.engine import PipelineEngine
        return isinstance(self.engine, PipelineEngine)

    def _refuse_on_pipeline(self, what: str) -> None:
        if self._is_pipeline():
            raise RuntimeError(f"{what} is not available on a DeepSpeed pipeline (PipelineModule): its optimizer step "
                               "is one engine.train_batch(data_iter) call, which also steps the heads")

    def train_batch(self, data_iter=None):
        """One optimizer step of a DeepSpeed pipeline (``PipelineEngine.train_batch``:
        ``gradient_accumulation_steps`` micro batches through every stage), then the
        heads' step on the last stage with the learning rate the engine applied (times
        each head's ratio); a skipped step drops the heads' gradients. Every rank of
        the pipeline calls it. Returns DeepSpeed's loss (the mean over the micro
        batches and the data-parallel ranks).

        The last stage back-propagates each micro batch's ``loss_fn`` value divided by
        the number of micro batches (``DeepSpeedEngine.backward``), so the heads'
        gradients, like the backbone's, are the mean over the micro batches. Under fp16
        loss scaling the loss leaves ``loss_fn`` through the probe :meth:`backward`
        uses, which supplies the scale where DeepSpeed's optimizer divides by one it
        never multiplied in; the gradients sent to the earlier stages carry it too."""
        if not self._is_pipeline():
            raise RuntimeError("train_batch needs a DeepSpeed pipeline (a PipelineModule model); this engine trains "
                               "with engine(...), engine.backward(loss), engine.step()")
        engine = self.engine
        if _grad_scaler(engine) is not None:
            # torch's GradScaler takes no part in collectives: each stage would decide
            # alone to skip a step and lower its scale, and the stages would diverge.
            raise ValueError("float16 torch_autocast is not supported with pipeline parallelism: every stage's "
                             "GradScaler decides on overflow alone, so stages would skip different steps; use "
                             "\"fp16\" (DeepSpeed's loss scaler checks overflow over the whole pipeline) or bf16")
        if self._scaling and engine.module.loss_fn is None:
            raise ValueError("fp16 loss scaling on a pipeline needs the loss computed by PipelineModule(loss_fn=...) "
                             "(the heads' loss scale is checked where loss_fn's value enters backward)")
        lr, scale = self.get_lr(), loss_scale(engine)
        for head in self.heads.values():
            head.train()            # DeepSpeed puts the module in training mode for train_batch
        self._backward_depth += 1           # the last stage back-propagates through engine.backward
        try:
            with self._probed_loss_fn(scale):
                loss = engine.train_batch(data_iter)
        finally:
            self._backward_depth -= 1
        applied = bool(engine.was_step_applied())
        heads_finite = self._heads_finite_on_every_stage() if self._scaling else True
        self._step_heads(applied, heads_finite, lr, scale)
        return loss

    def eval_batch(self, data_iter, **kwargs):
        """``PipelineEngine.eval_batch`` with the heads in evaluation mode, as DeepSpeed
        leaves the module; :meth:`train_batch` puts both back in training mode."""
        if not self._is_pipeline():
            raise RuntimeError("eval_batch needs a DeepSpeed pipeline (a PipelineModule model)")
        for head in self.heads.values():
            head.eval()
        return self.engine.eval_batch(data_iter, **kwargs)

    @contextlib.contextmanager
    def _probed_loss_fn(self, scale: float):
        """On the last stage under loss scaling: the module's ``loss_fn`` returns its
        loss through :class:`_LossScaleProbe` inside the block."""
        module = self.engine.module
        if not self._scaling or not self.engine.is_last_stage():
            yield
            return
        loss_fn = module.loss_fn

        gas = float(self.engine.gradient_accumulation_steps())

        def probed(outputs, labels):
            return _LossScaleProbe.apply(loss_fn(outputs, labels), self, scale, gas)

        own = vars(module).get("loss_fn")          # None: a module loss_fn, registered in _modules
        object.__setattr__(module, "loss_fn", probed)
        try:
            yield
        finally:
            if own is None:
                del vars(module)["loss_fn"]
            else:
                object.__setattr__(module, "loss_fn", own)

    def _heads_finite_on_every_stage(self) -> bool:
        """:meth:`_heads_finite` for a pipeline, where only the last stage holds heads:
        every rank joins the all-reduce (one host sync, only under loss scaling)."""
        flag = torch.ones((), dtype=torch.float32, device=torch.device(self.device))
        for head in self.heads.values():
            flag = flag * head.pending_grads_finite().to(flag)
        flag = flag.reshape(1).to(collective_device(None, self.device))
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
        return bool(flag.item() == 1.0)

    def broadcast_buffers(self) -> None:
        """Give every data-parallel rank the module buffers of the group's first rank
        (BatchNorm running statistics). DeepSpeed never synchronises buffers, so each
        rank's statistics follow its own micro batches; an export holds rank 0's. The
        app calls this before evaluating and saving, so that every rank evaluates, and
        every checkpoint holds, the model the export will be (DDP, and so
        arcface_torch, broadcast them at every forward)."""
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return
        group = internal(self.engine, "data_parallel_group", owner="engine",
                         why="to broadcast the module's buffers over the data-parallel group")
        if torch.distributed.get_world_size(group) == 1:
            return
        source = torch.distributed.get_global_rank(group, 0) if group is not None else 0
        for buffer in self.engine.module.buffers():
            if buffer.is_floating_point() or buffer.dtype in (torch.int64, torch.int32):
                torch.distributed.broadcast(buffer.data, source, group=group)

    def _heads_finite(self) -> bool:
        """Whether every head's pending gradient is finite on every rank (one small
        all-reduce over the world and one host sync, only under loss scaling)."""
        flags = torch.stack([h.pending_grads_finite() for h in self.heads.values()]).all().to(torch.float32)
        flag = flags.reshape(1).to(collective_device(None, self.device))
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
        return bool(flag.item() == 1.0)

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

    def _head_layouts(self) -> dict[str, dict]:
        """Every head of the job, as every rank sees it (a collective over the world):
        ``name -> {"world_size": k, "num_classes": C, "embedding_size": d,
        "writers": {class rank: global rank}}``. A head's shards are indexed by its rank
        in its class group; ranks that hold the same shard (a head replicated over
        tensor-parallel ranks) leave it to the lowest global rank among them; ranks
        without the head (earlier pipeline stages) hold none."""
        mine = {name: (head.rank, head.world_size, head.num_classes, head.embedding_size)
                for name, head in self.heads.items()}
        if torch.distributed.is_available() and torch.distributed.is_initialized() and self.world_size > 1:
            table = [None] * self.world_size
            torch.distributed.all_gather_object(table, mine)
        else:
            table = [mine]
        layouts: dict[str, dict] = {}
        for global_rank, heads in enumerate(table):
            for name, (rank, k, num_classes, d) in heads.items():
                layout = layouts.setdefault(name, {"world_size": k, "num_classes": num_classes, "embedding_size": d,
                                                   "writers": {}})
                if (layout["world_size"], layout["num_classes"], layout["embedding_size"]) != (k, num_classes, d):
                    raise ValueError(f"head {name!r} is not the same head on every rank: rank {global_rank} has "
                                     f"{num_classes} classes of size {d} over {k} rank(s), another rank "
                                     f"{layout['num_classes']} of size {layout['embedding_size']} over "
                                     f"{layout['world_size']}")
                layout["writers"].setdefault(rank, global_rank)
        for name, layout in layouts.items():
            missing = sorted(set(range(layout["world_size"])) - set(layout["writers"]))
            if missing:
                raise ValueError(f"head {name!r}: no rank holds its shard(s) {missing} of {layout['world_size']}")
        return layouts

    def save_checkpoint(self, save_dir: str, tag: str, *, client_state: dict | None = None,
                        rank_state: dict | None = None, metadata: dict | None = None, replace: bool = False) -> str:
        """Write checkpoint ``tag`` under ``save_dir`` on every rank (a collective).

        Layout of ``save_dir/tag``: DeepSpeed's files (module, optimizer, scheduler,
        ``client_state``), ``<head>-rankXXXXX-of-XXXXX.safetensors`` per head and
        rank, ``rank_state-XXXXX-of-XXXXX.pt`` (``rank_state`` plus this rank's RNG
        states) and ``ds_pfc_complete.json`` (steps, world size, heads, the size of
        every DeepSpeed file, and ``metadata``, JSON).

        Every rank writes into a fresh staging directory ``<tag>.tmp-<hex>`` and
        fsyncs each file it wrote there (DeepSpeed's too, once DeepSpeed's
        checkpoint writer has committed them); after all ranks are done, rank 0
        writes the marker, renames the directory to ``tag``, fsyncs ``save_dir``,
        points ``save_dir/latest`` at the tag and deletes what interrupted saves left
        (:mod:`ds_pfc.checkpoint_tags`). A crash or power loss at any point leaves
        the previous complete checkpoints untouched and the new tag either absent or
        complete; files of another save never mix into it. A complete ``tag`` is
        replaced only with ``replace`` (FileExistsError otherwise). An error on any
        rank raises on every rank."""
        layouts = self._head_layouts()
        tag = tags.check_tag_name(tag)
        tag_dir = os.path.join(save_dir, tag)

        def prepare():
            os.makedirs(save_dir, exist_ok=True)
            if not replace and os.path.isfile(os.path.join(tag_dir, COMPLETE_MARKER)):
                raise FileExistsError(f"checkpoint {tag_dir} exists and is complete; use a new tag")
            return f"{tag}{tags.TMP_INFIX}{uuid.uuid4().hex}"

        staging = tags.on_rank0(prepare)
        staging_dir = os.path.join(save_dir, staging)
        error = None
        try:
            with _recorded_writes(self.engine) as written:
                self.engine.save_checkpoint(save_dir, staging, client_state=client_state or {}, save_latest=False)
                _wait_for_commit(self.engine)
            os.makedirs(staging_dir, exist_ok=True)
            for name, head in self.heads.items():
                if layouts[name]["writers"][head.rank] == self.rank:      # one copy of a replicated shard
                    written.append(ckpt.save_head_shard(head, staging_dir, name=name))
            state = {"user": rank_state or {}, "rng": _rng_state(), "world_size": self.world_size, "rank": self.rank,
                     "skipped_steps": self.skipped_steps}
            written.append(os.path.join(staging_dir, _rank_file(self.rank, self.world_size)))
            _atomic_torch_save(state, written[-1])
            _fsync_written(written, staging_dir, self.engine)
        except Exception as err:
            error = err
        try:
            tags.agree(error)
        except Exception:
            if self.rank == 0:
                shutil.rmtree(staging_dir, ignore_errors=True)
            raise
        marker = {"tag": tag, "world_size": self.world_size, "global_steps": self.global_steps,
                  "heads": sorted(layouts), "head_layouts": _layout_record(layouts), "metadata": metadata or {}}

        def commit():
            marker["engine_files"] = tags.engine_files(staging_dir, tags.head_world_sizes(marker), self.world_size)
            return tags.commit_staged(save_dir, staging, tag, marker)

        return tags.on_rank0(commit)

    def load_checkpoint(self, load_dir: str, tag: str | None = None, *, restore_rng: bool = True) -> dict | None:
        """Load checkpoint ``tag`` on every rank (a collective). Without ``tag``: the
        one ``load_dir/latest`` names, or the newest complete tag when ``latest`` is
        missing or lags behind it (:func:`ds_pfc.checkpoint_tags.choose_tag`).

        Rank 0 first checks that every file of the tag is there with the size its save
        wrote and a readable structure (headers only); then the ranks check the files'
        contents against their checksums, each its share
        (:func:`~ds_pfc.checkpoint_tags.verify_share`: the ``torch.save`` files and
        the shards read in slices; a shard read whole is checked by its reader), and
        agree on the outcome before anything is loaded. A missing, truncated or
        corrupt file, a ``latest`` that names no complete tag or an unreadable marker
        raises the same :class:`~ds_pfc.checkpoint_tags.CheckpointError` on every
        rank, naming the file and the newest intact tag to load instead.

        Returns ``{"tag", "client_state", "rank_state", "world_size", "metadata",
        "note"}`` (``note``: why the tag is not the one ``latest`` names, or None) or
        None when there is no checkpoint. ``rank_state`` is this rank's own when the
        world size is unchanged, else rank 0's (sampler positions are global); RNG
        states are restored only at the same world size. Heads saved at another world
        size are resharded as they load: each rank reads only the rows of its own
        classes, from the one or few shards that hold them (safetensors slices), so
        its memory is about that of its own shard, never the whole head."""
        layouts = self._head_layouts()

        def choose():
            choice = tags.choose_tag(load_dir, tag)
            if choice is not None:
                # Another world size and ZeRO partitions: DeepSpeed needs the universal
                # conversion of the tag (UniversalCheckpointError with the recipe without one).
                name, _ = universal.loadable_tag(load_dir, choice.tag, self.world_size)
                if name != choice.tag:
                    note = (f"{choice.tag} holds ZeRO partitions of {choice.marker['world_size']} rank(s): loading "
                            f"its universal conversion {name} on {self.world_size}")
                    choice = tags.Choice(name, tags.read_marker(os.path.join(load_dir, name)),
                                         f"{choice.note}; {note}" if choice.note else note)
                try:     # headers and sizes only: the ranks share the content checks below
                    tags.verify_tag(os.path.join(load_dir, choice.tag), choice.marker, deep=False)
                except tags.CheckpointError as err:
                    raise tags.with_fallback(err, load_dir, exclude=(choice.tag,)) from None
            return choice

        choice = tags.on_rank0(choose)
        if choice is None:
            return None
        marker, tag_dir = choice.marker, os.path.join(load_dir, choice.tag)
        if sorted(marker["heads"]) != sorted(layouts):
            raise ValueError(f"{tag_dir} holds heads {marker['heads']} but this model has {sorted(layouts)}")
        saved_world = int(marker["world_size"])
        head_shards = tags.head_world_sizes(marker)
        _verify_contents(self, load_dir, choice.tag, marker,
                         sorted(n for n, k in head_shards.items() if k != layouts[n]["world_size"]))
        error = state = client_state = None
        try:
            client_state, state = _load_files(self, load_dir, choice.tag, saved_world, head_shards,
                                              universal_tag=bool(marker.get("universal")))
        except Exception as err:
            error = tags.with_fallback(err, load_dir, exclude=(choice.tag,)) \
                if isinstance(err, tags.CheckpointError) else err
        tags.agree(error)
        if saved_world == self.world_size and restore_rng and state.get("rng") is not None:
            _set_rng_state(state["rng"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        return {"tag": choice.tag, "client_state": client_state, "rank_state": state["user"],
                "world_size": saved_world, "metadata": marker.get("metadata", {}), "note": choice.note}


def _layout_record(layouts: dict) -> dict:
    """The marker's ``head_layouts``: per head its number of shards and how they split
    the classes, described as DeepSpeed describes a tensor-parallel parameter
    (partitioned along dimension 0, the class dimension, contiguously, the first
    ``C mod k`` shards one row larger)."""
    return {name: {"world_size": lay["world_size"], "num_classes": lay["num_classes"],
                   "embedding_size": lay["embedding_size"], "partition_dim": 0, "tensor_model_parallel": True,
                   "partition": "contiguous; the first num_classes mod world_size shards hold one more class",
                   "writers": {str(r): g for r, g in sorted(lay["writers"].items())}}
            for name, lay in sorted(layouts.items())}


def _verify_contents(engine: PfcEngine, load_dir: str, tag: str, marker: dict, sliced_heads: list[str]) -> None:
    """The content checks of a load, spread over the ranks (each checks its share of
    the ``torch.save`` files and of the shards of ``sliced_heads``, the heads whose
    shards are read in slices: every file is checked by one rank), then agreed: a
    damaged file raises the same CheckpointError, naming it and the tag to fall back
    to, on every rank (a collective)."""
    error = None
    try:
        tags.verify_share(os.path.join(load_dir, tag), marker, rank=engine.rank, world_size=engine.world_size,
                          shard_heads=sliced_heads)
    except Exception as err:
        error = err
        if isinstance(err, tags.CheckpointError):
            try:
                error = tags.with_fallback(err, load_dir, exclude=(tag,))
            except Exception:     # no hint rather than a rank missing from the agreement
                pass
    tags.agree(error, same=True)


def _load_files(engine: PfcEngine, load_dir: str, tag: str, saved_world: int, head_shards: dict[str, int], *,
                universal_tag: bool = False) -> tuple[dict, dict]:
    """This rank's part of a load: DeepSpeed's files, the head shards, the per-rank
    state. Damaged files raise CheckpointCorruptError naming them; mismatches
    between checkpoint and model (classes, dimensions) raise ValueError. The
    shards of heads saved at another world size are read unverified: every rank
    checked its share of them first (:func:`_verify_contents`)."""
    tag_dir = os.path.join(load_dir, tag)
    try:
        if universal_tag:
            path, client_state = universal.load_universal(engine.engine, load_dir, tag)
        else:
            path, client_state = engine.engine.load_checkpoint(load_dir, tag)
    except universal.UniversalCheckpointError:
        raise       # the tag cannot load into this engine (ZeRO stage); not a damaged file
    except Exception as err:
        raise tags.CheckpointCorruptError(f"DeepSpeed could not load its files in {tag_dir} "
                                          f"({type(err).__name__}: {err})", path=tag_dir) from err
    if path is None:
        raise tags.CheckpointCorruptError(f"DeepSpeed found no engine checkpoint in {tag_dir}", path=tag_dir)
    for name, head in engine.heads.items():
        shard = os.path.join(tag_dir, ckpt.shard_file_name(name, head.rank, head.world_size))
        saved_shards = head_shards[name]
        try:
            if saved_shards == head.world_size:
                ckpt.load_head_shard(head, tag_dir, name=name)
            else:
                _load_resharded(head, tag_dir, name, saved_shards, verify=False)
        except (ValueError, TypeError):
            raise      # the model does not match the checkpoint (classes, dimensions, optimizer)
        except Exception as err:     # safetensors' own error type, OSError
            where = shard if saved_shards == head.world_size else f"the {name!r} shards in {tag_dir}"
            raise tags.CheckpointCorruptError(f"{where} could not be read ({type(err).__name__}: {err})",
                                              path=shard) from err
    same_world = saved_world == engine.world_size
    rank_file = os.path.join(tag_dir, _rank_file(engine.rank if same_world else 0, saved_world))
    try:
        state = torch.load(rank_file, map_location="cpu", weights_only=False)
    except Exception as err:
        raise tags.CheckpointCorruptError(f"{rank_file} could not be read ({type(err).__name__}: {err})",
                                          path=rank_file) from err
    return client_state, state


@contextlib.contextmanager
def _recorded_writes(engine):
    """Yields a list that collects the paths DeepSpeed's checkpoint writer saves to
    inside the block (every engine, optimizer and ZeRO file goes through its
    ``save(state_dict, path)``)."""
    written: list[str] = []
    why = "to fsync every file DeepSpeed writes into a checkpoint"
    writer = internal(engine, "checkpoint_engine", owner="engine", why=why)
    require_internal(writer, "save", owner=f"checkpoint_engine ({type(writer).__name__})", why=why)
    own = vars(writer).get("save")
    save = writer.save

    def recording_save(*args, **kwargs):
        result = save(*args, **kwargs)
        written.append(str(kwargs["path"] if "path" in kwargs else args[1]))
        return result

    writer.save = recording_save
    try:
        yield written
    finally:
        if own is None:
            del writer.save
        else:
            writer.save = own


def _wait_for_commit(engine) -> None:
    """Return once DeepSpeed's files are written: a decoupled (asynchronous) writer
    commits them only at the next optimizer step, or here, on request."""
    why = "to write the completion marker only after DeepSpeed's checkpoint writer has committed its files"
    writer = internal(engine, "checkpoint_engine", owner="engine", why=why)
    if not internal(writer, "is_decoupled", owner=f"checkpoint_engine ({type(writer).__name__})", why=why)():
        return
    internal(engine, "_commit_decoupled_checkpoint", owner="engine", why=why)()


def _fsync_written(paths: list[str], staging_dir: str, engine) -> None:
    """fsync the files this rank wrote for a checkpoint and the directories holding
    them (also DeepSpeed's copy of NVMe-offloaded optimizer state for this rank)."""
    files = {os.path.abspath(p) for p in paths if os.path.isfile(p)}
    offload = os.path.join(staging_dir, "offloaded_tensors")
    if os.path.isdir(offload):
        rank = engine.local_rank if engine.use_node_local_storage() else engine.global_rank
        for root, _, names in os.walk(os.path.join(offload, f"rank{rank:0>2d}")):
            files.update(os.path.join(root, n) for n in names)
    for path in sorted(files):
        tags.fsync_file(path)
    for directory in sorted({os.path.dirname(p) for p in files} | {os.path.abspath(staging_dir)}):
        tags.fsync_dir(directory)


def list_checkpoints(save_dir: str) -> list[str]:
    """Complete checkpoint tags in ``save_dir``, oldest first by the optimizer step
    their marker records (ties by name)."""
    return [info.name for info in tags.complete_tags(save_dir)]


def _load_resharded(head: PartialFC, tag_dir: str, name: str, world_size: int | None = None, *,
                    verify: bool = True) -> None:
    """Load ``head``'s classes from shards of another world size: only the shards
    that overlap its class range are read, and of them only its rows (safetensors
    slices), into the rows the head loads: the memory this needs is about that of
    the head's own shard. ``verify``: check the shards read from against their
    checksums first (False when the load checked every shard already)."""
    shards = ckpt.open_shards(tag_dir, name=name, world_size=world_size)
    meta = shards.meta
    for key in ("num_classes", "embedding_size", "sub_centers"):
        if meta[key] != getattr(head, key):
            raise ValueError(f"{tag_dir}: head {name!r} has {key}={meta[key]} but the model's has "
                             f"{getattr(head, key)}")
    lo, hi = head.class_start, head.class_end
    state = shards.read_rows(lo, hi, verify=verify)
    state["meta"] = torch.tensor([head.num_classes, head.embedding_size, lo, hi - lo, head.world_size,
                                  meta["seed"], meta["sample_step"], meta["step_count"], head.sub_centers],
                                 dtype=torch.int64)
    state["margin_state"] = head.margin_state_tensor(json.loads(meta["margin_state"]))
    head.load_state_dict(state)


def _rank_file(rank: int, world_size: int) -> str:
    return tags.rank_state_name(rank, world_size)


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
    """Temporary file, fsync, rename, directory fsync (:func:`ds_pfc.checkpoint_tags.atomic_write`)."""
    tags.atomic_write(path, data)


def _atomic_torch_save(obj, path: str) -> None:
    """``torch.save`` with :func:`_atomic_write`'s guarantees (for small objects: it
    is serialised in memory first)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    tags.atomic_write(path, buffer.getvalue())


def remove_checkpoint(save_dir: str, tag: str) -> None:
    """Delete a checkpoint tag directory: renamed away first, so it leaves the listings
    at once, and a crash during the deletion leaves a leftover the next save removes."""
    tags.remove_tag(save_dir, tag)
