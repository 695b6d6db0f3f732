"""Heads beside the engine: :func:`attach` (a head on a module, never registered),
:func:`head_spec` (a head declared now and built from the engine's groups), and the
checks :func:`~ds_pfc.deepspeed_plugin.initialize` runs on the heads it finds."""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..core.head import PartialFC

__all__ = ["attach", "attached_heads", "head_spec", "HeadSpec"]

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
