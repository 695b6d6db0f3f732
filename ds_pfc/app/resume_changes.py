"""What changed between the job a checkpoint was trained with and the job resuming it.

The training app saves its job config (DeepSpeed's keys plus the ``ds_pfc`` block,
with the command-line overrides) in every checkpoint's marker. A resume compares it
with its own and sorts every difference, by dotted key, into one of four kinds:

- ``batch``: ``train_batch_size``, ``train_micro_batch_size_per_gpu``,
  ``gradient_accumulation_steps``. Governed by the global-batch rule (the product
  micro x accumulation x ranks must stay, else ``allow_batch_change``).
- ``harmless``: logging, monitors, diagnostics, evaluation, checkpoint cadence and retention,
  the output directory, data-loading workers, the NVMe bank directory and how the
  bank moves rows (``host_access``), the head's kernel backend and block size, and the run's length (``ds_pfc.train.epochs``,
  ``max_steps``: extending or shortening a run is the usual reason to resume; with a
  ``poly`` schedule the decay then spans the new length). Logged.
- ``fixed``: what the checkpoint cannot be loaded into (the head's classes,
  embedding size and sub-centers, the backbone's architecture, the optimizers'
  types). Refused always: such a job needs a new output directory.
- ``training``: everything else (head, margin, sample rate, optimizer settings,
  learning rate and schedule, data, seeds, precision, ZeRO, clipping, dropout, and
  any key not named above). Needs ``allow_config_change``; then the new values
  take effect.

The ``ds_pfc`` block is compared after defaults are filled in (a default written
out is no change); DeepSpeed's keys as written.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

__all__ = ["Change", "differences", "effective_config", "BATCH_KEYS"]

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")

_HARMLESS = (
    "steps_per_print", "wall_clock_breakdown", "memory_breakdown", "flops_profiler", "tensorboard", "wandb",
    "csv_monitor", "comet", "monitor_config", "timers", "dump_state", "log_level", "disable_python_gc", "aio",
    "checkpoint",
    "ds_pfc.description", "ds_pfc.train.log_every", "ds_pfc.train.output_dir", "ds_pfc.train.max_steps",
    "ds_pfc.train.epochs", "ds_pfc.train.diagnostics", "ds_pfc.evaluation", "ds_pfc.checkpoint",
    "ds_pfc.data.workers", "ds_pfc.data.decode",
    "ds_pfc.data.prefetch_batches", "ds_pfc.head.backend", "ds_pfc.head.block_bytes",
    "ds_pfc.head.keep_bytes", "ds_pfc.head.validate",
    # How rows move between the bank's tables and the slots: the values are the same.
    "ds_pfc.head.bank.host_access", "ds_pfc.head.bank.hbm_share", "ds_pfc.head.bank.pin_failure",
    "ds_pfc.head.bank.slot_sets",
    # What preemption and non-finite steps do: no value changes until one happens.
    "ds_pfc.train.preempt_signals", "ds_pfc.train.on_nonfinite", "ds_pfc.train.max_consecutive_skips",
    "ds_pfc.train.rollback_lr_factor", "ds_pfc.train.max_rollbacks",
    # Whether the embedding BatchNorm's scale trains: DeepSpeed's optimizer loads a checkpoint only
    # into the tensors it trained, so what resumes trains as before (0.2.0 checkpoints of a
    # MobileFaceNet or ViT, saved without the key, resume with it false).
    "ds_pfc.backbone.options.train_embedding_scale",
    # Pretrained weights are read only by a fresh run.
    "ds_pfc.train.init.backbone", "ds_pfc.train.init.head", "ds_pfc.train.init.class_map",
    "ds_pfc.train.init.new_rows", "ds_pfc.train.init.optimizer_states",
)
_FIXED = (
    "ds_pfc.head.num_classes", "ds_pfc.head.embedding_size", "ds_pfc.head.sub_centers", "ds_pfc.head.optimizer.type",
    "ds_pfc.backbone.name", "ds_pfc.backbone.width", "ds_pfc.backbone.options", "optimizer.type",
)
_UNSET = object()


@dataclass(frozen=True)
class Change:
    key: str
    old: object
    new: object
    kind: str
    """``batch``, ``harmless``, ``fixed`` or ``training``."""

    def __str__(self) -> str:
        return f"{self.key}: {_show(self.old)} -> {_show(self.new)}"


def _show(value) -> str:
    return "(unset)" if value is _UNSET else repr(value)


def effective_config(config: dict, overrides: dict | None) -> dict:
    """``config`` with the overrides of ``ds_pfc.train`` keys (``output_dir``,
    ``max_steps``) that the run applied on top of it."""
    if not overrides:
        return config
    out = dict(config)
    pfc = dict(out.get("ds_pfc") or {})
    train = dict(pfc.get("train") or {})
    train.update(overrides)
    pfc["train"] = train
    out["ds_pfc"] = pfc
    return out


def _resolved_pfc(block):
    """The ``ds_pfc`` block with its defaults filled in (the raw block when it no
    longer parses, e.g. written by another version)."""
    from .config import ConfigError, DsPfcConfig, InitConfig, from_dict
    try:
        cfg = from_dict(DsPfcConfig, block)
    except ConfigError:
        return block
    plain = dataclasses.asdict(cfg)
    if plain["train"].get("init") is None:       # no init block: its defaults (no weights, no scaling)
        plain["train"]["init"] = dataclasses.asdict(InitConfig())
    plain["head"]["margin"] = {"type": cfg.head.margin.type, "scale": cfg.head.margin.scale,
                               **cfg.head.margin.params()}
    return plain


def _flatten(value, prefix: str, out: dict) -> dict:
    """Dotted keys of the leaves; an empty object has none (it sets nothing)."""
    if isinstance(value, dict):
        for k, v in value.items():
            _flatten(v, f"{prefix}.{k}" if prefix else str(k), out)
    else:
        out[prefix] = list(value) if isinstance(value, tuple) else value
    return out


def _kind(key: str) -> str:
    def under(prefixes):
        return any(key == p or key.startswith(p + ".") for p in prefixes)
    if key in BATCH_KEYS:
        return "batch"
    if key in _HARMLESS:                 # a key named exactly, under a fixed block
        return "harmless"
    if under(_FIXED):
        return "fixed"
    if under(_HARMLESS):
        return "harmless"
    return "training"


def differences(saved: dict, current: dict) -> list[Change]:
    """Every difference between two job configs (effective ones: see
    :func:`effective_config`), as dotted keys in sorted order."""
    def flat(config):
        config = config if isinstance(config, dict) else {}
        out = _flatten({k: v for k, v in config.items() if k != "ds_pfc"}, "", {})
        if "ds_pfc" in config:
            _flatten(_resolved_pfc(config["ds_pfc"]), "ds_pfc", out)
        return out

    old, new = flat(saved), flat(current)
    return [Change(key, old.get(key, _UNSET), new.get(key, _UNSET), _kind(key))
            for key in sorted(set(old) | set(new)) if not _equal(old.get(key, _UNSET), new.get(key, _UNSET))]


def _equal(a, b) -> bool:
    if a is _UNSET or b is _UNSET:
        return a is b
    numbers = (int, float)
    if isinstance(a, numbers) and isinstance(b, numbers) and not isinstance(a, bool) and not isinstance(b, bool):
        return a == b
    return type(a) is type(b) and a == b
