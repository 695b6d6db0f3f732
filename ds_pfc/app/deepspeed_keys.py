"""Which keys DeepSpeed 0.19 reads inside the blocks of a job config, derived from
DeepSpeed's own code (the ``ds_pfc`` block and the top level are
:mod:`ds_pfc.app.config`'s):

- the blocks that DeepSpeed parses with a pydantic model
  (``zero_optimization`` with its offload blocks, ``fp16``, ``bf16``, the monitors
  ``tensorboard``/``wandb``/``csv_monitor``/``comet``, ``compile``, ``comms_logger``,
  ``hybrid_engine``, ``tensor_parallel``, ``weight_quantization``, ``timers.throughput``):
  the model's fields and their aliases;
- ``optimizer``: ``type``, ``params``, ``legacy_fusion``; ``optimizer.params``: the
  parameters of the class DeepSpeed builds for ``optimizer.type``, resolved as
  DeepSpeed resolves it (:func:`optimizer_params`);
- ``scheduler``: ``type``, ``params``; ``scheduler.params``: the parameters of the
  scheduler class DeepSpeed builds for ``scheduler.type``.

In DeepSpeed's other blocks (read key by key, such as ``aio`` or
``activation_checkpointing``) nothing is known beyond the job's own keys.

:func:`place` answers for ``--set`` (:func:`ds_pfc.app.config.set_values`);
:func:`check_optimizer_params` refuses optimizer params the optimizer does not take
before anything is built."""
from __future__ import annotations

import dataclasses
import importlib
import inspect
import typing
from typing import NamedTuple

from .._checks import ConfigError

__all__ = ["Place", "place", "optimizer_params", "check_optimizer_params", "did_you_mean"]


class Place(NamedTuple):
    """The keys known at one place of a job config."""

    keys: frozenset | None
    """The keys the schema knows there (None: it does not describe this object)."""
    what: str
    """Where they come from, for messages."""


# DeepSpeed blocks parsed by a pydantic model: block -> (module, class).
_DEEPSPEED_MODELS = {
    "zero_optimization": ("deepspeed.runtime.zero.config", "DeepSpeedZeroConfig"),
    "fp16": ("deepspeed.runtime.precision_config", "DeepSpeedFP16Config"),
    "bf16": ("deepspeed.runtime.precision_config", "DeepSpeedBF16Config"),
    "bfloat16": ("deepspeed.runtime.precision_config", "DeepSpeedBF16Config"),
    "tensorboard": ("deepspeed.monitor.config", "TensorBoardConfig"),
    "wandb": ("deepspeed.monitor.config", "WandbConfig"),
    "csv_monitor": ("deepspeed.monitor.config", "CSVConfig"),
    "comet": ("deepspeed.monitor.config", "CometConfig"),
    "compile": ("deepspeed.compile.config", "CompileConfig"),
    "comms_logger": ("deepspeed.comm.config", "CommsLoggerConfig"),
    "hybrid_engine": ("deepspeed.runtime.config", "HybridEngineConfig"),
    "tensor_parallel": ("deepspeed.runtime.tensor_parallel.config", "TPTrainingConfig"),
    "weight_quantization": ("deepspeed.inference.config", "WeightQuantConfig"),
}

# Keys DeepSpeed takes out of optimizer.params before it builds the optimizer (its own
# switches), per optimizer name; and the keyword arguments it then passes itself.
_ADAM_SWITCHES = frozenset({"adam_w_mode", "torch_adam", "fp32_optimizer_states"})


def did_you_mean(unknown, known) -> str:
    """``did you mean 'x'?`` for the unknown keys that are close to a known one ('' if none)."""
    import difflib
    guesses = []
    for key in unknown:
        close = difflib.get_close_matches(str(key), [str(k) for k in known], n=1, cutoff=0.6)
        if close:
            guesses.append(f"{key!r} -> {close[0]!r}" if len(unknown) > 1 else repr(close[0]))
    return f"did you mean {', '.join(guesses)}?" if guesses else ""


def place(config: dict, path) -> Place:
    """The keys DeepSpeed knows in the object at ``path`` (a sequence of keys from the
    top, the first a DeepSpeed top-level key) of the job ``config``; the job's own keys
    are not included."""
    path = tuple(path)
    name = ".".join(path)
    if path[0] == "optimizer":
        if len(path) == 1:
            return Place(frozenset({"type", "params", "legacy_fusion"}), "DeepSpeed's optimizer block")
        if path[1:] == ("params",):
            label, keys = optimizer_params(config)
            return Place(keys, f"the parameters of {label}" if keys is not None else
                         f"{label}: its parameters cannot be listed")
    elif path[0] == "scheduler":
        if len(path) == 1:
            return Place(frozenset({"type", "params"}), "DeepSpeed's scheduler block")
        if path[1:] == ("params",):
            label, keys = _scheduler_params(config)
            return Place(keys, f"the parameters of {label}" if keys is not None else
                         f"{label}: its parameters cannot be listed")
    elif path[0] == "timers":
        if len(path) == 1:
            return Place(frozenset({"throughput"}), "DeepSpeed's timers block")
        if path[1] == "throughput":
            return _model_place(_model("deepspeed.utils.config", "DeepSpeedThroughputTimerConfig"), path, 2)
    elif path[0] in _DEEPSPEED_MODELS:
        return _model_place(_model(*_DEEPSPEED_MODELS[path[0]]), path, 1)
    elif len(path) == 1:
        return Place(None, f"ds_pfc has no list of the keys of DeepSpeed's {path[0]!r} block")
    return Place(None, f"ds_pfc has no list of the keys of {name}")


# ------------------------------------------------------------------------- DeepSpeed models
def _model(module: str, name: str):
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):       # pragma: no cover - another DeepSpeed layout
        return None


def _model_keys(model) -> frozenset:
    keys = set()
    for name, info in model.model_fields.items():
        keys.add(name)
        if info.alias:
            keys.add(info.alias)
    return frozenset(keys)


def _model_place(model, path, start: int) -> Place:
    if model is None:                           # pragma: no cover
        return Place(None, f"no DeepSpeed model found for {'.'.join(path[:start])}")
    for depth in range(start, len(path)):
        part = path[depth]
        fields = {n: f for n, f in model.model_fields.items()}
        fields.update({f.alias: f for f in model.model_fields.values() if f.alias})
        if part not in fields:
            return Place(None, f"{'.'.join(path[:depth])} has no key {part!r}")
        options = typing.get_args(fields[part].annotation) or (fields[part].annotation,)
        models = [a for a in options if inspect.isclass(a) and hasattr(a, "model_fields")]
        if not models:
            where = ".".join(path[:depth + 1])
            return Place(None, f"{where} is not an object DeepSpeed describes")
        model = models[0]
    return Place(_model_keys(model), f"DeepSpeed's {model.__name__}")


# ------------------------------------------------------------------------- optimizer
def _signature_keys(cls, *, drop=()) -> frozenset | None:
    """The keyword parameters of ``cls.__init__`` after the parameters argument (None: it
    takes any keyword)."""
    parameters = list(inspect.signature(cls.__init__).parameters.values())[2:]
    if any(p.kind == p.VAR_KEYWORD for p in parameters):
        return None
    return frozenset(p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)) \
        - frozenset(drop)


def _optimizer_offloaded(ds_config: dict) -> bool:
    """Whether DeepSpeed builds its CPU optimizer (ZeRO offloads the optimizer to the CPU
    or NVMe: ``zero_use_cpu_optimizer``)."""
    zero = ds_config.get("zero_optimization")
    if not isinstance(zero, dict):
        return False
    offload = zero.get("offload_optimizer")
    if isinstance(offload, dict):
        return str(offload.get("device", "none")).lower() in ("cpu", "nvme")
    return zero.get("cpu_offload") is True


def _optimizer_names() -> list:
    from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS
    return list(DEEPSPEED_OPTIMIZERS)


def _torch_optimizers() -> list:
    import torch
    return sorted(n for n in dir(torch.optim) if inspect.isclass(getattr(torch.optim, n))
                  and issubclass(getattr(torch.optim, n), torch.optim.Optimizer) and n != "Optimizer")


def optimizer_params(ds_config: dict) -> tuple[str, frozenset | None]:
    """``(label, keys)``: the class DeepSpeed builds for the config's ``optimizer`` (as
    ``engine._configure_basic_optimizer`` resolves ``type``: its own names in any case,
    else a ``torch.optim`` class by its exact name) and the keys its ``params`` may hold
    (None: they cannot be listed, e.g. the class takes any keyword or is not installed).
    An unknown ``type`` is a :class:`ConfigError`."""
    block = ds_config.get("optimizer")
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        return "the job's optimizer block has no type", None
    given = block["type"]
    name = given.lower() if given.lower() in _optimizer_names() else given
    params = block.get("params") if isinstance(block.get("params"), dict) else {}
    offloaded = _optimizer_offloaded(ds_config)
    if name in ("adam", "adamw"):
        if params.get("torch_adam"):
            import torch
            w_mode = name == "adamw" or params.get("adam_w_mode", True)
            cls = torch.optim.AdamW if w_mode else torch.optim.Adam
            return f"torch.optim.{cls.__name__}", _signature_keys(cls) | _ADAM_SWITCHES
        if offloaded:
            from deepspeed.ops.adam import DeepSpeedCPUAdam
            return "deepspeed.ops.adam.DeepSpeedCPUAdam", \
                _signature_keys(DeepSpeedCPUAdam, drop=("adamw_mode",)) | _ADAM_SWITCHES
        from deepspeed.ops.adam import FusedAdam
        return "deepspeed.ops.adam.FusedAdam", _signature_keys(FusedAdam) | _ADAM_SWITCHES
    if name == "adagrad":
        if offloaded:
            from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad
            return "deepspeed.ops.adagrad.DeepSpeedCPUAdagrad", _signature_keys(DeepSpeedCPUAdagrad)
        import torch
        return "torch.optim.Adagrad", _signature_keys(torch.optim.Adagrad)
    if name == "lamb":
        from deepspeed.ops.lamb import FusedLamb
        return "deepspeed.ops.lamb.FusedLamb", _signature_keys(FusedLamb)
    if name == "lion":
        from deepspeed.ops.lion import DeepSpeedCPULion, FusedLion
        cls = DeepSpeedCPULion if offloaded else FusedLion
        return f"deepspeed.ops.lion.{cls.__name__}", _signature_keys(cls)
    if name == "muon":
        from deepspeed.runtime.engine import DeepSpeedEngine
        keys = set(DeepSpeedEngine._MUON_HALF_KEYS) | set(DeepSpeedEngine._ADAM_HALF_KEYS)
        return "DeepSpeed's Muon (MuonWithAuxAdam)", frozenset(keys | {"muon_lr", "adam_lr", "foreach"}) \
            | _ADAM_SWITCHES
    if name in ("muadam", "muadamw", "musgd"):
        try:
            cls = getattr(importlib.import_module("mup"), {"muadam": "MuAdam", "muadamw": "MuAdamW",
                                                           "musgd": "MuSGD"}[name])
        except (ImportError, AttributeError):
            return f"mup's {name} (mup is not installed)", None
        return f"mup.{cls.__name__}", _signature_keys(cls)
    import torch
    cls = getattr(torch.optim, name, None)
    if not (inspect.isclass(cls) and issubclass(cls, torch.optim.Optimizer)) or cls is torch.optim.Optimizer:
        known = _optimizer_names() + _torch_optimizers()
        same = [k for k in known if k.lower() == given.lower()]
        guess = f"did you mean {same[0]!r}?" if same else did_you_mean([given], known)
        raise ConfigError(f"optimizer.type {given!r} is not an optimizer DeepSpeed builds: DeepSpeed's own "
                          f"{_optimizer_names()} (any case) or a torch.optim class by its exact name "
                          f"{_torch_optimizers()}{'; ' + guess if guess else ''}")
    return f"torch.optim.{cls.__name__}", _signature_keys(cls)


def check_optimizer_params(ds_config: dict) -> None:
    """Refuse a ``type`` DeepSpeed cannot build and ``params`` keys its optimizer does not
    take (DeepSpeed would fail only inside ``deepspeed.initialize``), one line naming the
    key, the class and the closest key it takes."""
    block = ds_config.get("optimizer")
    if block is None:
        return
    if not isinstance(block, dict):
        raise ConfigError(f"optimizer must be an object with 'type' and 'params', got {block!r}")
    label, keys = optimizer_params(ds_config)
    params = block.get("params", {})
    if params is None:
        return
    if not isinstance(params, dict):
        raise ConfigError(f"optimizer.params must be an object of {label}'s parameters, got {params!r}")
    if "max_grad_norm" in params:
        raise ConfigError("optimizer.params.max_grad_norm is refused by DeepSpeed: set the top-level "
                          "gradient_clipping instead")
    if keys is None:
        return
    unknown = sorted(set(params) - keys)
    if unknown:
        guess = did_you_mean(unknown, keys)
        raise ConfigError(f"optimizer.params: unknown key{'s' if len(unknown) > 1 else ''} {unknown} for optimizer "
                          f"type {block.get('type')!r} ({label} takes {sorted(keys)}"
                          f"{'; ' + guess if guess else ''})")


# ------------------------------------------------------------------------- scheduler
def _scheduler_params(ds_config: dict) -> tuple[str, frozenset | None]:
    """The scheduler class DeepSpeed builds for ``scheduler.type`` (``_scheduler_from_config``:
    DeepSpeed's lr_schedules, else torch.optim.lr_scheduler) and its parameters."""
    block = ds_config.get("scheduler")
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        return "the job's scheduler block has no type", None
    name = block["type"]
    from deepspeed.runtime import lr_schedules
    import torch
    for module, prefix in ((lr_schedules, "deepspeed.runtime.lr_schedules"),
                           (torch.optim.lr_scheduler, "torch.optim.lr_scheduler")):
        cls = getattr(module, name, None)
        if inspect.isclass(cls):
            return f"{prefix}.{name}", _signature_keys(cls)
    return f"scheduler type {name!r} (not a scheduler DeepSpeed knows)", None
