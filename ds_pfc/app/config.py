"""Typed configuration of the ``ds_pfc`` block of a DeepSpeed JSON config.

The JSON a job runs with is DeepSpeed's own config plus one ``"ds_pfc"`` block. The
block is parsed into kw-only dataclasses; every key is checked: an unknown key is an
error naming the key, where it was found and the keys allowed there. DeepSpeed
silently ignores unknown *top-level* keys (a typo such as
``train_micro_batch_size_per_gpuu``), so :func:`split_config` refuses them, and it
refuses ``optimizer.params`` keys the optimizer does not take before anything is built
(:mod:`ds_pfc.app.deepspeed_keys`).

    ds_config, pfc = split_config(json.load(open(path)))
    head = pfc.head.build(group=None, device=device)
"""
from __future__ import annotations

import contextvars
import copy
import dataclasses
import json
import math
import os
import re
import typing
import warnings
from dataclasses import dataclass, field

import torch

from .._checks import ConfigError
from .deepspeed_keys import Place, check_optimizer_params, did_you_mean as _did_you_mean, place as _deepspeed_place

__all__ = ["MarginConfig", "OptimizerConfig", "BankConfig", "HeadConfig", "BackboneConfig", "SyntheticDataConfig",
           "DataConfig", "ScheduleConfig", "InitConfig", "DiagnosticsConfig", "TrainConfig", "EvaluationConfig",
           "CheckpointConfig", "DsPfcConfig", "split_config", "set_values", "known_keys",
           "from_dict", "DEEPSPEED_TOP_LEVEL_KEYS", "DEEPSPEED_REMOVED_KEYS", "ConfigError"]


# Top-level keys DeepSpeed 0.19 reads (its DeepSpeedConfig, and sequence_parallel_size read at
# initialize); anything else is refused by split_config.
DEEPSPEED_TOP_LEVEL_KEYS = frozenset("""
train_batch_size train_micro_batch_size_per_gpu gradient_accumulation_steps steps_per_print optimizer
scheduler fp16 bf16 bfloat16 torch_autocast gradient_clipping prescale_gradients gradient_predivide_factor
gradient_allreduce_op zero_optimization zero_allow_untested_optimizer zero_force_ds_cpu_optimizer
activation_checkpointing wall_clock_breakdown memory_breakdown flops_profiler tensorboard wandb csv_monitor
comet comms_logger communication_data_type seq_parallel_communication_data_type aio
data_efficiency data_types checkpoint autotuning pipeline dataloader_drop_last compile
weight_quantization hybrid_engine timers datastates_ckpt sequence_parallel_size
tensor_parallel dump_state disable_allgather disable_python_gc log_level
managed_gradient_accumulation use_data_before_expert_parallelism vocabulary_size
expert_parallel
""".split())

# Top-level keys DeepSpeed 0.19 removed (it refuses them at initialize).
DEEPSPEED_REMOVED_KEYS = frozenset("""
amp compression_training curriculum_learning eigenvalue elasticity graph_harvesting nebula
progressive_layer_drop quantize_training sparse_attention sparse_gradients
""".split())

_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
           "fp16": torch.float16, "float16": torch.float16, "fp64": torch.float64, "float64": torch.float64}


def _dtype(name: str, where: str, allowed=("fp32", "bf16", "fp16")) -> torch.dtype:
    if name not in _DTYPES or not any(_DTYPES[a] == _DTYPES[name] for a in allowed):
        raise ConfigError(f"{where} must be one of {list(allowed)}, got {name!r}")
    return _DTYPES[name]


def _number(value, where: str, low=None, high=None, low_open=False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{where} must be a number, got {value!r}")
    if low is not None and (value < low or (low_open and value == low)):
        raise ConfigError(f"{where} must be {'>' if low_open else '>='} {low}, got {value}")
    if high is not None and value > high:
        raise ConfigError(f"{where} must be <= {high}, got {value}")


_MARGIN_PARAMS = {
    # type: {parameter: default}; every parameter of a type is optional.
    "arcface": {"scale": 64.0, "margin": 0.5, "straight_through": False},
    "cosface": {"scale": 64.0, "margin": 0.4},
    "combined": {"scale": 64.0, "m1": 1.0, "m2": 0.5, "m3": 0.0, "straight_through": False},
    "adaface": {"scale": 64.0, "m": 0.4, "h": 0.333, "t_alpha": 0.01, "eps": 1e-3},
    "magface": {"scale": 64.0, "l_a": 10.0, "u_a": 110.0, "l_m": 0.45, "u_m": 0.8, "lambda_g": 35.0,
                "easy_margin": True},
    "curricularface": {"scale": 64.0, "m": 0.5},
    "elastic_arcface": {"scale": 64.0, "m": 0.5, "std": 0.05, "plus": False, "seed": 0},
    "elastic_cosface": {"scale": 64.0, "m": 0.35, "std": 0.0125, "plus": False, "seed": 0},
}


@dataclass(kw_only=True)
class MarginConfig:
    """The margin loss: ``type`` and that type's parameters (each optional, defaulting
    to its paper's value):

    - arcface: ``scale``, ``margin`` (0.5), ``straight_through``
    - cosface: ``scale``, ``margin`` (0.4)
    - combined: ``scale``, ``m1``, ``m2``, ``m3``, ``straight_through``
    - adaface: ``scale``, ``m`` (0.4), ``h`` (0.333), ``t_alpha`` (0.01), ``eps``
    - magface: ``scale``, ``l_a`` (10), ``u_a`` (110), ``l_m`` (0.45), ``u_m`` (0.8),
      ``lambda_g`` (35), ``easy_margin`` (true)
    - curricularface: ``scale``, ``m`` (0.5)
    - elastic_arcface: ``scale``, ``m`` (0.5), ``std`` (0.05), ``plus``, ``seed``
    - elastic_cosface: ``scale``, ``m`` (0.35), ``std`` (0.0125), ``plus``, ``seed``

    ``scale`` defaults to 64 everywhere. A parameter of another type is an error."""

    type: str = "arcface"
    """arcface, cosface, combined, adaface, magface, curricularface, elastic_arcface or
    elastic_cosface."""
    scale: float = 64.0
    """Logit scale ``s``."""
    margin: float | None = None
    """arcface/cosface margin (default 0.5 for arcface, 0.4 for cosface)."""
    m1: float | None = None
    """combined: multiplicative angular margin (1.0)."""
    m2: float | None = None
    """combined: additive angular margin (0.5)."""
    m3: float | None = None
    """combined: additive cosine margin (0.0)."""
    straight_through: bool | None = None
    """arcface/combined: back-propagate as if the margin were a constant shift (arcface_torch)."""
    m: float | None = None
    """adaface, curricularface, elastic_*: the margin."""
    h: float | None = None
    """adaface: how strongly the margin follows the feature norm."""
    t_alpha: float | None = None
    """adaface: momentum of the running norm statistics."""
    eps: float | None = None
    """adaface: clamp of the cosine and of the angle."""
    l_a: float | None = None
    """magface: lower magnitude bound."""
    u_a: float | None = None
    """magface: upper magnitude bound."""
    l_m: float | None = None
    """magface: margin at l_a."""
    u_m: float | None = None
    """magface: margin at u_a."""
    lambda_g: float | None = None
    """magface: weight of the magnitude regulariser."""
    easy_margin: bool | None = None
    """magface: apply the margin only where cos > 0 (the official default)."""
    std: float | None = None
    """elastic_*: standard deviation of the per-sample margins."""
    plus: bool | None = None
    """elastic_*: ElasticFace+ (margins handed out by the target cosines)."""
    seed: int | None = None
    """elastic_*: seeds the per-sample margins (with the draw counter)."""

    def __post_init__(self):
        if self.type not in _MARGIN_PARAMS:
            raise ConfigError(f"ds_pfc.head.margin.type must be one of {list(_MARGIN_PARAMS)}, got {self.type!r}")
        _number(self.scale, "ds_pfc.head.margin.scale", low=0, low_open=True)
        allowed = _MARGIN_PARAMS[self.type]
        given = [f.name for f in dataclasses.fields(self) if f.name not in ("type", "scale")
                 and getattr(self, f.name) is not None]
        foreign = sorted(set(given) - set(allowed))
        if foreign:
            raise ConfigError(f"ds_pfc.head.margin: {foreign} do not apply to type {self.type!r}; its parameters are "
                              f"{sorted(allowed)}")
        self.build()          # the margin's own checks (ranges), named by the parameter

    def params(self) -> dict:
        """This type's parameters, defaults filled in."""
        out = dict(_MARGIN_PARAMS[self.type])
        for name in out:
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        return out

    def build(self):
        from ..core import margins
        p = self.params()
        try:
            if self.type == "arcface":
                return margins.ArcFace(p["scale"], p["margin"], straight_through=p["straight_through"])
            if self.type == "cosface":
                return margins.CosFace(p["scale"], p["margin"])
            if self.type == "combined":
                return margins.CombinedMargin(p["scale"], p["m1"], p["m2"], p["m3"],
                                              straight_through=p["straight_through"])
            if self.type == "adaface":
                return margins.AdaFace(p["scale"], p["m"], p["h"], p["t_alpha"], p["eps"])
            if self.type == "magface":
                return margins.MagFace(p["scale"], p["l_a"], p["u_a"], p["l_m"], p["u_m"], p["lambda_g"],
                                       easy_margin=p["easy_margin"])
            if self.type == "curricularface":
                return margins.CurricularFace(p["scale"], p["m"])
            cls = margins.ElasticArcFace if self.type == "elastic_arcface" else margins.ElasticCosFace
            return cls(p["scale"], p["m"], p["std"], plus=p["plus"], seed=p["seed"])
        except (TypeError, ValueError) as err:
            raise ConfigError(f"ds_pfc.head.margin: {err}") from None


@dataclass(kw_only=True)
class OptimizerConfig:
    """The head's sparse row optimizer. Its learning rate follows the engine's,
    times ``lr_ratio``."""

    type: str = "sgd"
    """sgd or adamw."""
    lr_ratio: float = 1.0
    """Head learning rate = engine learning rate x lr_ratio."""
    momentum: float = 0.9
    """sgd momentum."""
    nesterov: bool = False
    """sgd Nesterov momentum."""
    weight_decay: float | None = None
    """Default 5e-4 for sgd, 0.01 for adamw."""
    betas: tuple[float, float] = (0.9, 0.999)
    """adamw betas."""
    eps: float = 1e-8
    """adamw epsilon."""

    def __post_init__(self):
        if self.type not in ("sgd", "adamw"):
            raise ConfigError(f"ds_pfc.head.optimizer.type must be sgd or adamw, got {self.type!r}")
        _number(self.lr_ratio, "ds_pfc.head.optimizer.lr_ratio", low=0)
        self.betas = tuple(self.betas)

    def kwargs(self) -> dict:
        if self.type == "sgd":
            return {"momentum": self.momentum, "nesterov": self.nesterov,
                    "weight_decay": 5e-4 if self.weight_decay is None else self.weight_decay}
        return {"betas": self.betas, "eps": self.eps, "weight_decay": 0.01 if self.weight_decay is None
                else self.weight_decay}


@dataclass(kw_only=True)
class BankConfig:
    """Where the centers and their optimizer state live (see ds_pfc.bank.TieredBank)."""

    default: str | list = "device"
    """Tier for states not named in ``placements``: device or host, or [tier, dtype]."""
    placements: dict = field(default_factory=dict)
    """State name (weight, momentum_buffer, exp_avg, exp_avg_sq, step) -> tier or [tier, dtype]; dtype fp32,
    bf16, fp16, fp64, or int8_rowwise (8-bit codes with a scale per row; optimizer moments only)."""
    host_access: str = "staged"
    """How rows move: staged (an I/O thread and page-locked staging buffers) or mapped (GPU
    kernels read and write the tables in place; device and host tiers only)."""
    hbm_share: float = 0.0
    """With mapped access: the share of each host-tier state's rows kept in GPU memory."""
    pin_failure: str = "refuse"
    """What a host table that cannot be page-locked (cudaHostRegister) does: refuse (stop, naming the
    limit that caused it: ulimit -l, the cgroup's memory limit) or fallback (pageable memory; mapped
    access becomes staged)."""
    slot_sets: int = 3
    """With mapped access: sets of slot buffers (the step's active rows on the GPU). 3: fetch and
    write-back overlap; 2: one set less of GPU memory, the fetch after the write-back."""

    def _placement(self, value, where):
        from ..bank.tiered import NVME_REFUSED, TIERS
        if isinstance(value, str):
            tier, dtype = value, None
        elif isinstance(value, (list, tuple)) and len(value) == 2 and value[1] == "int8_rowwise":
            tier, dtype = value[0], "int8_rowwise"          # 8-bit codes, a scale per row (moments)
        elif isinstance(value, (list, tuple)) and len(value) == 2:
            tier, dtype = value[0], _dtype(value[1], f"{where}[1]", ("fp32", "bf16", "fp16", "fp64"))
        else:
            raise ConfigError(f"{where} must be a tier name or [tier, dtype], got {value!r}")
        if tier == "nvme":
            raise ConfigError(f"{where}: {NVME_REFUSED}")
        if tier not in TIERS:
            raise ConfigError(f"{where} tier must be one of {list(TIERS)}, got {tier!r}")
        return (tier, dtype)

    def __post_init__(self):
        self._placement(self.default, "ds_pfc.head.bank.default")
        if not isinstance(self.placements, dict):
            raise ConfigError(f"ds_pfc.head.bank.placements must be an object, got {self.placements!r}")
        for name, value in self.placements.items():
            self._placement(value, f"ds_pfc.head.bank.placements.{name}")
        from ..bank.tiered import HOST_ACCESS
        if self.host_access not in HOST_ACCESS:
            raise ConfigError(f"ds_pfc.head.bank.host_access must be one of {list(HOST_ACCESS)}, "
                              f"got {self.host_access!r}")
        from ..bank.stores import PIN_FAILURE
        if self.pin_failure not in PIN_FAILURE:
            raise ConfigError(f"ds_pfc.head.bank.pin_failure must be one of {list(PIN_FAILURE)}, "
                              f"got {self.pin_failure!r}")
        _number(self.hbm_share, "ds_pfc.head.bank.hbm_share", 0.0, 1.0)
        if self.hbm_share >= 1.0 or (self.hbm_share > 0 and self.host_access != "mapped"):
            raise ConfigError(f"ds_pfc.head.bank.hbm_share must be in [0, 1) and needs host_access 'mapped', got "
                              f"{self.hbm_share!r} with host_access {self.host_access!r}")
        from ..bank.tiered import SLOT_SETS
        if isinstance(self.slot_sets, bool) or self.slot_sets not in SLOT_SETS or (
                self.slot_sets == 2 and self.host_access != "mapped"):
            raise ConfigError(f"ds_pfc.head.bank.slot_sets must be one of {list(SLOT_SETS)} (2 needs host_access "
                              f"'mapped'), got {self.slot_sets!r} with host_access {self.host_access!r}")

    def is_default(self) -> bool:
        return self.default == "device" and not self.placements

    def build(self):
        """The ``bank=`` factory for PartialFC (None: the device bank)."""
        if self.is_default():
            return None
        from ..bank import TieredBank
        try:
            return TieredBank.factory(
                {n: self._placement(v, n) for n, v in self.placements.items()},
                default=self._placement(self.default, "default"), host_access=self.host_access,
                hbm_share=self.hbm_share, pin_failure=self.pin_failure, slot_sets=self.slot_sets)
        except (TypeError, ValueError) as err:
            raise ConfigError(f"ds_pfc.head.bank: {err}") from None


@dataclass(kw_only=True)
class HeadConfig:
    """One Partial FC head."""

    num_classes: int
    """C, the number of classes (identities)."""
    embedding_size: int = 512
    """d, the embedding size the backbone produces."""
    sample_rate: float = 1.0
    """r in (0, 1]: positives plus uniform negatives up to floor(r C_q) per rank."""
    filter_threshold: float | None = None
    """PFC* conflict filter tau (None: off)."""
    seed: int = 0
    """Seeds the initial centers (per class id) and the sampler."""
    compute_dtype: str = "auto"
    """GEMM dtype: auto (bf16 on CUDA, fp32 on a CPU), fp32 (IEEE float32 products, also on a
    GPU), bf16 or fp16; float32 accumulation and softmax in every case."""
    block_bytes: int | None = None
    """Bytes of float32 logits per class block of the softmax and of rows per optimizer
    chunk (null: 256 MiB on CUDA, 2 MiB on CPU); larger logits are recomputed in backward."""
    keep_bytes: int | None = None
    """Most bytes a training step keeps for backward instead of recomputing: float32 logits
    (torch backend), or bf16 exponentials (triton, bf16 products: the exp-kept path) or
    float16 cosines (triton, fp16 products; the standard rank of
    N = 2048, S = 800k keeps 3.3 GB and its backward runs no recompute product). null:
    block_bytes when set, else half the device memory free at the forward on CUDA (triton; 4 GiB
    off CUDA) or 256 MiB (torch); 0: never keep."""
    backend: str = "auto"
    """Softmax backend: auto (fused Triton kernels on CUDA when triton imports), torch or triton."""
    sub_centers: int = 1
    """K centers per class (sub-center ArcFace); a class's cosine is the largest of its K."""
    validate: str = "deferred"
    """When the head's input checks (labels in range, NaN/Inf embeddings, equal batch sizes)
    and the step's loss and accuracy are read: ``deferred`` (no host sync in a step: read one
    step late; a bad batch's step may be applied before the run stops, and no checkpoint is
    written over it) or ``immediate`` (one host sync a step: refused before anything
    changes). ``on_nonfinite`` skip and rollback always check immediately."""
    margin: MarginConfig = field(default_factory=MarginConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    bank: BankConfig = field(default_factory=BankConfig)

    def __post_init__(self):
        if isinstance(self.num_classes, bool) or not isinstance(self.num_classes, int) or self.num_classes < 1:
            raise ConfigError(f"ds_pfc.head.num_classes must be a positive integer, got {self.num_classes!r}")
        if isinstance(self.embedding_size, bool) or not isinstance(self.embedding_size, int) or self.embedding_size < 1:
            raise ConfigError(f"ds_pfc.head.embedding_size must be a positive integer, got {self.embedding_size!r}")
        _number(self.sample_rate, "ds_pfc.head.sample_rate", low=0, high=1, low_open=True)
        if self.filter_threshold is not None:
            _number(self.filter_threshold, "ds_pfc.head.filter_threshold", low=-1, high=1)
        if self.compute_dtype != "auto" and (self.compute_dtype not in _DTYPES or _DTYPES[self.compute_dtype] not in
                                             (torch.float32, torch.bfloat16, torch.float16)):
            raise ConfigError(f"ds_pfc.head.compute_dtype must be one of ['auto', 'fp32', 'bf16', 'fp16'], "
                              f"got {self.compute_dtype!r}")
        if self.block_bytes is not None and (isinstance(self.block_bytes, bool) or not isinstance(self.block_bytes, int)
                                             or self.block_bytes < 1):
            raise ConfigError(f"ds_pfc.head.block_bytes must be null or a positive integer of bytes, "
                              f"got {self.block_bytes!r}")
        if self.keep_bytes is not None and (isinstance(self.keep_bytes, bool) or not isinstance(self.keep_bytes, int)
                                            or self.keep_bytes < 0):
            raise ConfigError(f"ds_pfc.head.keep_bytes must be null or a non-negative integer of bytes (0: never "
                              f"keep), got {self.keep_bytes!r}")
        if isinstance(self.sub_centers, bool) or not isinstance(self.sub_centers, int) or self.sub_centers < 1:
            raise ConfigError(f"ds_pfc.head.sub_centers must be a positive integer, got {self.sub_centers!r}")
        if self.validate not in VALIDATE_MODES:
            raise ConfigError(f"ds_pfc.head.validate must be one of {list(VALIDATE_MODES)}, got {self.validate!r}")
        from ..core.softmax import BACKENDS
        if self.backend not in BACKENDS:
            raise ConfigError(f"ds_pfc.head.backend must be one of {list(BACKENDS)}, got {self.backend!r}")

    def build(self, *, group=None, device=None, data_parallel_grad: bool = True, validate: str | None = None):
        """A :class:`~ds_pfc.PartialFC` for this config (``validate``: overrides
        :attr:`validate`)."""
        from ..core.head import PartialFC
        compute = None if self.compute_dtype == "auto" else _dtype(self.compute_dtype, "ds_pfc.head.compute_dtype")
        return PartialFC(self.num_classes, self.embedding_size, sample_rate=self.sample_rate,
                         margin=self.margin.build(), filter_threshold=self.filter_threshold, group=group,
                         device=device, seed=self.seed, optimizer=self.optimizer.type,
                         compute_dtype=compute,
                         data_parallel_grad=data_parallel_grad, bank=self.bank.build(), block_bytes=self.block_bytes,
                         backend=self.backend, sub_centers=self.sub_centers, keep_bytes=self.keep_bytes,
                         validate=validate or self.validate, **self.optimizer.kwargs())


@dataclass(kw_only=True)
class BackboneConfig:
    """The embedding network (``ds_pfc.models.build_backbone``); its output size is
    ``head.embedding_size``."""

    name: str = "iresnet50"
    """iresnet18/34/50/100/200, mobilefacenet(_large), vit_t/s/b/l (or r18...r200, mbf, mbf_large);
    ``mlp`` for feature vectors (``data.source: features``; options ``input_dim`` = the
    feature dimension, ``hidden``, ``depth``)."""
    width: float = 1.0
    """Channel multiplier: 1.0 is the published network; smaller for CPU runs."""
    dropout: float = 0.0
    """Dropout before the embedding layer."""
    options: dict = field(default_factory=dict)
    """Constructor extras, e.g. ``{"drop_path_rate": 0.1}`` for the ViTs, or
    ``{"checkpoint_blocks": true}`` (any backbone) to recompute each block's
    activations in backward instead of keeping them."""

    def __post_init__(self):
        from ..models import ALIASES, BACKBONES, FEATURE_BACKBONES
        if ALIASES.get(self.name, self.name) not in BACKBONES + FEATURE_BACKBONES:
            raise ConfigError(f"ds_pfc.backbone.name must be one of {list(BACKBONES + FEATURE_BACKBONES)} or "
                              f"{list(ALIASES)}, "
                              f"got {self.name!r}")
        _number(self.width, "ds_pfc.backbone.width", low=0, low_open=True)
        _number(self.dropout, "ds_pfc.backbone.dropout", low=0, high=1)

    def build(self, embedding_size: int):
        from ..models import build_backbone
        try:
            return build_backbone(self.name, embedding_size=embedding_size, width=self.width, dropout=self.dropout,
                                  **self.options)
        except TypeError as err:
            raise ConfigError(f"ds_pfc.backbone.options: {err}") from None
        except ValueError as err:  # an option's value (the other fields are checked above)
            raise ConfigError(f"ds_pfc.backbone: {err}") from None


@dataclass(kw_only=True)
class SyntheticDataConfig:
    """The built-in procedural identity set (``ds_pfc.data.SyntheticFaces``)."""

    identities: int | None = None
    """Training identities (default and only allowed value: head.num_classes)."""
    images_per_identity: int = 16
    """Images of each training identity per epoch."""
    held_out_identities: int = 200
    """Further identities never trained on; verification pairs are drawn from them."""
    image_size: int = 112
    """Side of the square images."""
    seed: int = 0
    """Defines the identities' looks."""

    def __post_init__(self):
        for key in ("identities", "images_per_identity", "held_out_identities", "image_size"):
            if getattr(self, key) is not None:
                _positive_int(getattr(self, key), f"ds_pfc.data.synthetic.{key}")


@dataclass(kw_only=True)
class FeaturesDataConfig:
    """The built-in identity-feature set (``ds_pfc.data.IdentityFeatures``): a
    feature vector per image instead of a face, for many-class runs on a CPU."""

    identities: int | None = None
    """Training identities (default and only allowed value: head.num_classes, or the
    identities that ``data.stress.conflict`` splits into head.num_classes pseudo-classes)."""
    images_per_identity: int = 8
    """Images of each training identity per epoch."""
    held_out_identities: int = 1000
    """Further identities never trained on; verification pairs are drawn from them."""
    feature_dim: int = 96
    """Values per vector, a multiple of 3 (``ds_pfc.backbone.options.input_dim`` of the mlp)."""
    latent_dim: int = 32
    """Size of an identity's latent (and of an image's nuisance)."""
    nuisance: float = 1.5
    """Strength of the per-image nuisance (0: images of an identity differ only by noise)."""
    noise: float = 0.5
    """Strength of the per-value noise."""
    seed: int = 0
    """Defines the identities and their images."""

    def __post_init__(self):
        for key in ("identities", "images_per_identity", "held_out_identities", "feature_dim", "latent_dim"):
            if getattr(self, key) is not None:
                _positive_int(getattr(self, key), f"ds_pfc.data.features.{key}")
        if self.feature_dim % 3:
            raise ConfigError(f"ds_pfc.data.features.feature_dim must be a multiple of 3 (a vector travels as "
                              f"[3, 1, feature_dim / 3]), got {self.feature_dim}")
        if self.held_out_identities < 2:
            raise ConfigError(f"ds_pfc.data.features.held_out_identities must be >= 2 (verification pairs of "
                              f"different identities), got {self.held_out_identities}")
        _number(self.nuisance, "ds_pfc.data.features.nuisance", low=0)
        _number(self.noise, "ds_pfc.data.features.noise", low=0)

    def build(self, *, held_out: bool = False):
        """The training set, or (``held_out``) the held-out identities past it."""
        from ..data.features import IdentityFeatures
        kwargs = dict(feature_dim=self.feature_dim, latent_dim=self.latent_dim, nuisance=self.nuisance,
                      noise=self.noise, seed=self.seed)
        if held_out:
            return IdentityFeatures(self.held_out_identities, self.images_per_identity,
                                    first_identity=self.identities, **kwargs)
        return IdentityFeatures(self.identities, self.images_per_identity, **kwargs)


@dataclass(kw_only=True)
class ConflictConfig:
    """Inter-class conflict: identities split into pseudo-classes."""

    fraction: float
    """Fraction of the identities split (the paper: 1/3 of WebFace12M's)."""
    splits: int = 3
    """Pseudo-classes per split identity (the paper: 3)."""

    def __post_init__(self):
        _number(self.fraction, "ds_pfc.data.stress.conflict.fraction", low=0, high=1)
        if isinstance(self.splits, bool) or not isinstance(self.splits, int) or self.splits < 2:
            raise ConfigError(f"ds_pfc.data.stress.conflict.splits must be an integer >= 2, got {self.splits!r}")


@dataclass(kw_only=True)
class LongTailConfig:
    """Long-tailed identities: most identities reduced to a few images."""

    tail_fraction: float
    """Fraction of the identities reduced (the paper: 0.9, 1.8M of WebFace42M's 2M)."""
    tail_images: list = field(default_factory=lambda: [2, 4])
    """``[low, high]``: images each tail identity keeps, drawn uniformly (the paper: 2-4)."""

    def __post_init__(self):
        _number(self.tail_fraction, "ds_pfc.data.stress.long_tail.tail_fraction", low=0, high=1)
        t = self.tail_images
        if (len(t) != 2 or any(isinstance(v, bool) or not isinstance(v, int) for v in t)
                or not 1 <= t[0] <= t[1]):
            raise ConfigError(f"ds_pfc.data.stress.long_tail.tail_images must be [low, high] integers with "
                              f"1 <= low <= high, got {t!r}")


@dataclass(kw_only=True)
class StressConfig:
    """Deterministic corruption of the training labels (``ds_pfc.data.StressedDataset``),
    for the paper's robustness studies. Held-out evaluation data is never affected."""

    label_flip: float = 0.0
    """Fraction of training images whose label is replaced by a random other class."""
    conflict: ConflictConfig | None = None
    """Split identities into pseudo-classes (null: off)."""
    long_tail: LongTailConfig | None = None
    """Reduce most identities to a few images (null: off)."""
    seed: int = 0
    """Seeds the corruption (independent of the data order's seed)."""

    def __post_init__(self):
        _number(self.label_flip, "ds_pfc.data.stress.label_flip", low=0, high=1)
        if self.label_flip >= 1:
            raise ConfigError(f"ds_pfc.data.stress.label_flip must be < 1, got {self.label_flip!r}")

    @property
    def active(self) -> bool:
        return bool(self.label_flip or self.conflict is not None or self.long_tail is not None)


@dataclass(kw_only=True)
class DataConfig:
    """Training data, sampling and augmentation."""

    source: str = "synthetic"
    """synthetic, features (identity feature vectors for the ``mlp`` backbone: many
    classes on a CPU), recordio (insightface ``train.rec`` + ``train.idx``) or hf (a
    ``datasets`` ``save_to_disk`` directory, parquet files or an image folder)."""
    path: str | None = None
    """recordio: the dataset directory (``train.rec``, ``train.idx``, optional ``property``)
    or the ``.rec`` file (``.idx`` beside it); hf: the dataset directory/files."""
    split: str = "train"
    """hf: the split to train on."""
    image_column: str | None = None
    """hf: image column (default: the only image/bytes column)."""
    label_column: str | None = None
    """hf: label column (default: the only integer column)."""
    synthetic: SyntheticDataConfig = field(default_factory=SyntheticDataConfig)
    features: FeaturesDataConfig = field(default_factory=FeaturesDataConfig)
    """source features: the identity-feature set."""
    flip: bool = True
    """Random horizontal flip (a pure function of seed, epoch and sample index)."""
    shuffle: bool = True
    """Reshuffle every epoch (a pure function of seed and epoch)."""
    seed: int = 0
    """Seeds shuffling and augmentation."""
    workers: int | str = "auto"
    """Worker processes preparing micro batches ahead (0: in the training process);
    ``auto``: ``min(8, CPUs per local rank - 1)``, at least 1 (see
    ``ds_pfc.data.loader.default_workers``)."""
    prefetch_batches: int = 2
    """Micro batches each worker prepares ahead."""
    decode: str = "cpu"
    """Where JPEG training images are decoded: ``cpu`` (in the loader workers), ``cuda``
    (the workers pass the encoded bytes and each rank decodes its micro batch on its
    GPU with ``torchvision.io.decode_jpeg``; needs torchvision and CUDA, and pixels may
    differ from the CPU decode by a few levels) or ``auto`` (``cuda`` when both are
    there, else ``cpu``). Flips are the same either way; other formats (PNG) are
    still decoded in the workers, and JPEGs then bypass a ``set_image_decoder`` decoder."""
    stress: StressConfig = field(default_factory=StressConfig)
    """Label flips, inter-class conflicts or a long tail applied to the training set."""
    labels: str | None = None
    """A label file (``labels.txt`` of ``ds-pfc-clean``): one integer per line, the label
    of every image of the training set in dataset order (after ``stress``), ``-1`` for
    an image left out. The run trains on these labels instead of the dataset's own and
    never sees the images marked ``-1``; ``ds_pfc.head.num_classes`` must be the largest
    label plus one (and with source ``synthetic``/``features`` the dataset's own
    ``identities`` must be set). null: the dataset's labels."""

    def __post_init__(self):
        if self.labels is not None and (not isinstance(self.labels, str) or not os.path.isfile(self.labels)):
            raise ConfigError(_not_found("ds_pfc.data.labels", self.labels, "one label per training image, -1: "
                                         "left out (labels.txt of ds-pfc-clean)"))
        if self.source not in ("synthetic", "features", "recordio", "hf"):
            raise ConfigError(f"ds_pfc.data.source must be synthetic, features, recordio or hf, got {self.source!r}")
        if self.source != "features" and self.features != FeaturesDataConfig():
            raise ConfigError(f"ds_pfc.data.features is set but ds_pfc.data.source is {self.source!r} "
                              "(the block configures source \"features\")")
        if self.source == "features" and self.path:
            raise ConfigError("ds_pfc.data.path is set but ds_pfc.data.source is \"features\" (built in: it reads "
                              "no files)")
        if self.source == "features" and self.flip:
            raise ConfigError("ds_pfc.data.flip must be false for ds_pfc.data.source \"features\" (a flip would "
                              "permute a feature vector's values)")
        if self.source not in ("synthetic", "features") and not self.path:
            raise ConfigError(f"ds_pfc.data.path is required for source {self.source!r}")
        if isinstance(self.prefetch_batches, bool) or not isinstance(self.prefetch_batches, int) or \
                self.prefetch_batches < 1:
            raise ConfigError(f"ds_pfc.data.prefetch_batches must be an integer >= 1, got {self.prefetch_batches!r}")
        if self.workers != "auto" and (isinstance(self.workers, bool) or not isinstance(self.workers, int)
                                       or self.workers < 0):
            raise ConfigError(f"ds_pfc.data.workers must be an integer >= 0 or \"auto\", got {self.workers!r}")
        if self.decode not in ("cpu", "cuda", "auto"):
            raise ConfigError(f"ds_pfc.data.decode must be cpu, cuda or auto, got {self.decode!r}")

    def decode_on(self, device) -> bool:
        """Whether ``decode`` puts JPEG decoding on ``device`` (the rank's training
        device); ``cuda`` that cannot run there raises :class:`ConfigError`."""
        from ..data.transforms import device_decode_available
        if self.decode == "cpu":
            return False
        why = device_decode_available(device)
        if why is not None and self.decode == "cuda":
            raise ConfigError(f"ds_pfc.data.decode is \"cuda\" but {why}; decoding on the GPU needs torchvision "
                              "and a CUDA training device (use \"cpu\" or \"auto\")")
        return why is None


@dataclass(kw_only=True)
class ScheduleConfig:
    """A learning-rate schedule DeepSpeed does not offer, stepped per optimizer step.
    The peak learning rate is the DeepSpeed optimizer's ``lr``. Leave this out to use
    DeepSpeed's own ``scheduler`` block (or a constant learning rate)."""

    type: str = "poly"
    """poly: linear warm-up, then ``lr (1 - t/T)^power``; step: warm-up, then
    ``lr * gamma^k`` after the k-th milestone; arcface: arcface_torch's
    ``PolynomialLRWarmup`` as its ``train_v2.py`` steps it, once per micro batch: the
    full ``lr`` for the first micro batch, ``k / w`` of it for micro batch ``k`` of a
    warm-up of ``w``, then ``lr (1 - (k - w) / (t - w))^power`` down to 0 at micro batch
    ``t``; an optimizer step takes the learning rate of its last micro batch. ``w`` and
    ``t`` are counted as arcface_torch counts them: ``images_per_epoch // (micro batch x
    ranks)`` micro batches per epoch, times ``warmup_epochs`` and ``ds_pfc.train.epochs``."""
    warmup_epochs: float = 0.0
    """Linear warm-up from 0 over this many epochs (arcface: from the full lr's first
    micro batch, then 1/w, 2/w, ...)."""
    power: float = 2.0
    """poly, arcface: decay exponent."""
    milestones: list = field(default_factory=list)
    """step: epochs at which the learning rate is multiplied by ``gamma``."""
    gamma: float = 0.1
    """step: decay factor."""
    images_per_epoch: int | None = None
    """arcface: the epoch size its schedule is counted from (arcface_torch's
    ``config.num_image``, which need not be the data's size); null: the training set's
    size. The run's length is still ``epochs`` of the training set."""

    def __post_init__(self):
        if self.type not in ("poly", "step", "arcface"):
            raise ConfigError(f"ds_pfc.train.schedule.type must be poly, step or arcface, got {self.type!r}")
        if self.images_per_epoch is not None:
            if self.type != "arcface":
                raise ConfigError(f"ds_pfc.train.schedule.images_per_epoch applies to type arcface only (this "
                                  f"schedule is {self.type!r}); remove it")
            _positive_int(self.images_per_epoch, "ds_pfc.train.schedule.images_per_epoch")
        _number(self.warmup_epochs, "ds_pfc.train.schedule.warmup_epochs", low=0)
        _number(self.power, "ds_pfc.train.schedule.power", low=0)
        _number(self.gamma, "ds_pfc.train.schedule.gamma", low=0)
        for m in self.milestones:
            _number(m, "ds_pfc.train.schedule.milestones[]", low=0)
        if list(self.milestones) != sorted(self.milestones):
            raise ConfigError(f"ds_pfc.train.schedule.milestones must be increasing, got {self.milestones}")


_SOURCE = contextvars.ContextVar("ds_pfc_config_source", default=None)
"""The job config file being parsed (:func:`split_config`'s ``source``), for the hints
of a missing path."""


def _not_found(key: str, value, what: str, kind: str = "file") -> str:
    """The error of a config path ``value`` (``key``) that does not exist: the absolute
    path looked for and the working directory relative paths are read from; when a file
    of that name sits beside the job config file, that too."""
    if not isinstance(value, str) or not value:
        return f"{key}: no such {kind} {value!r} ({what})"
    text = f"{key}: no such {kind} {value!r} (looked for {os.path.abspath(value)}"
    if not os.path.isabs(value):
        text += f"; relative paths in the job config are read from the working directory {os.getcwd()}"
    text += f"; {what})"
    source = _SOURCE.get()
    if source and not os.path.isabs(value):
        beside = os.path.join(os.path.dirname(os.path.abspath(source)), value)
        if os.path.exists(beside):
            text += (f"; {beside} exists beside the job config {source}: give that path (absolute, or relative "
                     "to the working directory)")
    return text


def _is_checkpoints_directory(path: str) -> bool:
    """Whether ``path`` is a run's ``checkpoints/`` directory: a ``latest`` file or a
    complete tag in it (which tag is read is decided when the weights load)."""
    from ..checkpoint import tags
    return os.path.isfile(os.path.join(path, tags.LATEST)) or bool(tags.complete_tags(path))


@dataclass(kw_only=True)
class InitConfig:
    """Pretrained weights a fresh run starts from, and how the backbone trains from
    them. The weights are read only when the run does not resume a checkpoint (a
    resumed run has its own); the frozen steps and the learning-rate multiplier are
    part of the schedule and apply by optimizer step, resumed or not."""

    backbone: str | None = None
    """A model export (``export/model.safetensors`` of a ds_pfc run, or the
    ``model.safetensors`` ``launch/export.py import-arcface`` writes): its backbone
    weights replace the random ones. ``ds_pfc.backbone`` must build the same network."""
    head: str | None = None
    """A directory of head shards ``head-rank*-of-*.safetensors`` for this job's number
    of ranks (``launch/export.py import-arcface --world_size N`` writes them; a ds_pfc
    checkpoint tag holds them too): the head starts from those centers (and optimizer
    states). A run's checkpoints directory (``<output_dir>/checkpoints``) stands for the
    tag its ``latest`` file names (the newest complete one when ``latest`` lags or is
    missing), as for ``launch/export.py``; the log names the tag read. With
    ``class_map``, shards of any number of ranks and classes. null: a fresh head."""
    class_map: str | None = None
    """Grow ``head`` (a trained head) into this job's ``ds_pfc.head.num_classes``
    classes: a file mapping old class ids to new ones, a JSON object ``{"old": new,
    ...}`` (``.json``) or a text file of ``old new`` lines (whitespace or a comma
    between; blank lines and ``#`` comments skipped). Each listed old row (and, with
    ``optimizer_states``, its optimizer states) moves bitwise to its new id; the new
    ids no old id maps to start as ``new_rows`` says. null: ``head`` must hold
    exactly this job's classes."""
    new_rows: str = "imprint"
    """With ``class_map``: how the classes no old id maps to start. ``imprint``: the
    unit vector along the mean of their training images' L2-normalised embeddings
    under the initial backbone (one pass over those images before the first step,
    shared by the ranks); a class without images keeps its fresh row. ``random``: the
    head's fresh rows (``ds_pfc.head.seed``)."""
    optimizer_states: bool = True
    """Carry the optimizer states saved with ``head`` (SGD momentum, AdamW moments)
    with their rows; false: start every state at zero."""
    freeze_backbone_steps: int = 0
    """The backbone's learning rate is 0 for this many optimizer steps (the head
    trains alone), then follows the schedule."""
    backbone_lr_scale: float = 1.0
    """The backbone's learning rate is the schedule's times this (the heads' is not
    scaled)."""

    def __post_init__(self):
        if self.backbone is not None and not os.path.isfile(self.backbone):
            raise ConfigError(_not_found("ds_pfc.train.init.backbone", self.backbone,
                                         "a model export, export/model.safetensors"))
        if self.head is not None:
            if not os.path.isdir(self.head):
                raise ConfigError(_not_found("ds_pfc.train.init.head", self.head, "a directory of head shards "
                                             "head-rank*-of-*.safetensors, or a run's checkpoints directory",
                                             "directory"))
            if not any(re.fullmatch(r"head-rank\d{5}-of-\d{5}\.safetensors", n) for n in os.listdir(self.head)) \
                    and not _is_checkpoints_directory(self.head):
                raise ConfigError(f"ds_pfc.train.init.head: {self.head} holds no head shards "
                                  "(head-rank*-of-*.safetensors; launch/export.py import-arcface writes them) and "
                                  "is no checkpoints directory (one holding 'latest' or complete checkpoint tags)")
        if self.class_map is not None:
            if not isinstance(self.class_map, str) or not os.path.isfile(self.class_map):
                raise ConfigError(_not_found("ds_pfc.train.init.class_map", self.class_map, "old class id -> new "
                                             "class id: a JSON object {\"old\": new} or lines 'old new'"))
            if self.head is None:
                raise ConfigError("ds_pfc.train.init.class_map maps the classes of a trained head: set "
                                  "ds_pfc.train.init.head to its shards (or remove class_map)")
        if self.new_rows not in ("imprint", "random"):
            raise ConfigError(f"ds_pfc.train.init.new_rows must be imprint or random, got {self.new_rows!r}")
        if not isinstance(self.optimizer_states, bool):
            raise ConfigError(f"ds_pfc.train.init.optimizer_states must be true or false, "
                              f"got {self.optimizer_states!r}")
        if not self.optimizer_states and self.head is None:
            raise ConfigError("ds_pfc.train.init.optimizer_states false applies to the rows of "
                              "ds_pfc.train.init.head, which is not set (a fresh head's states start at zero)")
        if isinstance(self.freeze_backbone_steps, bool) or not isinstance(self.freeze_backbone_steps, int) or \
                self.freeze_backbone_steps < 0:
            raise ConfigError(f"ds_pfc.train.init.freeze_backbone_steps must be an integer >= 0, "
                              f"got {self.freeze_backbone_steps!r}")
        _number(self.backbone_lr_scale, "ds_pfc.train.init.backbone_lr_scale", low=0)

    @property
    def scales_backbone(self) -> bool:
        """Whether the backbone's learning rate differs from the schedule's."""
        return self.freeze_backbone_steps > 0 or self.backbone_lr_scale != 1.0


@dataclass(kw_only=True)
class DiagnosticsConfig:
    """Opt-in measurements written to ``summary.json`` beside the evaluations; off,
    they cost nothing."""

    flip_mechanism: bool = False
    """Under ``ds_pfc.data.stress.label_flip``: how often the true class of a
    flipped sample is an active negative, and how its center moves
    (:mod:`ds_pfc.app.diagnostics`)."""
    every_steps: int = 0
    """Optimizer steps per reported interval (0: the evaluation intervals,
    ``ds_pfc.evaluation.every_steps``, and the end of the run)."""

    def __post_init__(self):
        if not isinstance(self.every_steps, int) or isinstance(self.every_steps, bool) or self.every_steps < 0:
            raise ConfigError(f"ds_pfc.train.diagnostics.every_steps must be an integer >= 0, "
                              f"got {self.every_steps!r}")


NONFINITE_POLICIES = ("stop", "skip", "rollback")
VALIDATE_MODES = ("deferred", "immediate")


@dataclass(kw_only=True)
class TrainConfig:
    """Length of training, schedule, logging and the output directory."""

    epochs: float = 1.0
    """Passes over the training set (fractions allowed)."""
    max_steps: int | None = None
    """Stop after this many optimizer steps (overrides ``epochs`` when smaller). 0: no
    training: everything is built (pretrained ``init`` weights loaded), the initial
    state is saved as checkpoint ``step00000000`` (and exported), and a later run with
    more steps resumes from it."""
    schedule: ScheduleConfig | None = None
    """ds_pfc's learning-rate schedule (None: DeepSpeed's ``scheduler`` block, if any)."""
    seed: int = 0
    """Seeds the backbone's initialisation."""
    log_every: int = 50
    """Optimizer steps between log lines."""
    output_dir: str = "runs/default"
    """Checkpoints, exports and logs go here (relative to the working directory)."""
    init: InitConfig | None = None
    """Start from pretrained weights (null: random initialisation)."""
    diagnostics: DiagnosticsConfig = field(default_factory=DiagnosticsConfig)
    """Opt-in training diagnostics (all off by default)."""
    preempt_signals: list = field(default_factory=lambda: ["SIGTERM", "SIGUSR1"])
    """Signals that preempt the run: every rank finishes its step, a complete checkpoint is
    written and the command exits with code 75 (requeue it; the rerun resumes). Under
    DeepSpeed's launcher, the end of the launcher or of the ``deepspeed`` command that
    started it preempts alike. ``[]``: the signals keep their default action (and the
    launcher is not watched)."""
    on_nonfinite: str = "stop"
    """What a step whose embeddings (on any rank) or loss are NaN or Inf does, on every rank
    together: ``stop`` (the run ends with one error line naming the newest checkpoint and the
    fixes), ``skip`` (the step is dropped: no backbone, head, momentum, loss-scale or
    BatchNorm state changes, its batch is consumed and counted; for a bad batch), or
    ``rollback`` (the newest complete checkpoint is reloaded and the learning rate multiplied
    by ``rollback_lr_factor``; for a diverging model). ``skip`` and ``rollback`` need
    ``gradient_accumulation_steps`` 1."""
    max_consecutive_skips: int = 10
    """``skip``: this many skipped steps in a row stop the run (the model itself has diverged;
    ``rollback`` is the cure for that)."""
    rollback_lr_factor: float = 0.5
    """``rollback``: the learning rate (backbone and heads, the whole schedule) is multiplied by
    this at every rollback; the product stays with the run's checkpoints."""
    max_rollbacks: int = 3
    """``rollback``: the run stops at the next non-finite step after this many rollbacks."""

    def __post_init__(self):
        _number(self.epochs, "ds_pfc.train.epochs", low=0, low_open=True)
        if self.on_nonfinite not in NONFINITE_POLICIES:
            raise ConfigError(f"ds_pfc.train.on_nonfinite must be one of {list(NONFINITE_POLICIES)}, "
                              f"got {self.on_nonfinite!r}")
        _positive_int(self.max_consecutive_skips, "ds_pfc.train.max_consecutive_skips")
        _number(self.rollback_lr_factor, "ds_pfc.train.rollback_lr_factor", low=0, high=1, low_open=True)
        _positive_int(self.max_rollbacks, "ds_pfc.train.max_rollbacks")
        if self.max_steps is not None and (isinstance(self.max_steps, bool) or not isinstance(self.max_steps, int)
                                           or self.max_steps < 0):
            raise ConfigError(f"ds_pfc.train.max_steps must be an integer >= 0 (0: write the initial state, no "
                              f"training), got {self.max_steps!r}")
        _positive_int(self.log_every, "ds_pfc.train.log_every")
        import signal
        names = self.preempt_signals
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise ConfigError(f"ds_pfc.train.preempt_signals must be a list of signal names, got {names!r}")
        for name in names:
            if not name.startswith("SIG") or name.startswith("SIG_") or not hasattr(signal, name) \
                    or name in ("SIGKILL", "SIGSTOP"):
                raise ConfigError(f"ds_pfc.train.preempt_signals: {name!r} is not a signal that can be caught "
                                  "(e.g. SIGTERM, SIGUSR1, SIGUSR2, SIGINT)")


@dataclass(kw_only=True)
class EvaluationConfig:
    """1:1 verification during and after training."""

    every_steps: int = 0
    """Optimizer steps between evaluations (0: only at the end)."""
    bins: list = field(default_factory=list)
    """insightface ``.bin`` pair sets (lfw.bin, cfp_fp.bin, agedb_30.bin, ...)."""
    synthetic_pairs: int = 1000
    """synthetic faces or identity features: pairs drawn from the held-out identities (0: none)."""
    batch_size: int = 64
    """Images per forward pass."""
    flip: bool = True
    """Flip test-time augmentation."""
    far: list = field(default_factory=lambda: [1e-4, 1e-6])
    """False accept rates at which TAR is reported."""
    at_start: bool = False
    """Also evaluate before the first step of a fresh run (the untrained baseline; off by
    default: at scale it idles every GPU for minutes)."""

    def __post_init__(self):
        if not isinstance(self.every_steps, int) or self.every_steps < 0:
            raise ConfigError(f"ds_pfc.evaluation.every_steps must be an integer >= 0, got {self.every_steps!r}")
        if not isinstance(self.synthetic_pairs, int) or self.synthetic_pairs < 0:
            raise ConfigError(f"ds_pfc.evaluation.synthetic_pairs must be an integer >= 0, "
                              f"got {self.synthetic_pairs!r}")
        _positive_int(self.batch_size, "ds_pfc.evaluation.batch_size")
        for b in self.bins:
            if not isinstance(b, str):
                raise ConfigError(f"ds_pfc.evaluation.bins must list file paths, got {b!r}")
        for f in self.far:
            _number(f, "ds_pfc.evaluation.far[]", low=0, high=1, low_open=True)


@dataclass(kw_only=True)
class CheckpointConfig:
    """Checkpoints (engine + head shards + data/RNG state in one tag directory) and the
    final export."""

    every_steps: int = 0
    """Optimizer steps between checkpoints (0: only at the end)."""
    every_minutes: float = 0.0
    """Wall-clock minutes between checkpoints (0: off), counted on rank 0 from the start
    or the last checkpoint and agreed by every rank at the end of a step; with
    ``every_steps`` too, whichever comes first."""
    keep: int = 2
    """Complete checkpoints to keep (older ones are deleted; 0 keeps all)."""
    resume: bool = True
    """Continue from the latest complete checkpoint in ``output_dir`` if there is one."""
    export: bool = True
    """Write ``export/model.safetensors`` (backbone + merged classifier) at the end."""

    def __post_init__(self):
        for key in ("every_steps", "keep"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"ds_pfc.checkpoint.{key} must be an integer >= 0, got {value!r}")
        m = self.every_minutes
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not math.isfinite(m) or m < 0:
            raise ConfigError(f"ds_pfc.checkpoint.every_minutes must be a number of minutes >= 0 (0: off), got {m!r}")
        self.every_minutes = float(m)


@dataclass(kw_only=True)
class DsPfcConfig:
    """The ``ds_pfc`` block."""

    head: HeadConfig
    """The identity head."""
    description: str = ""
    """Free text: what the job is, e.g. the paper setup a config reproduces."""
    backbone: BackboneConfig = field(default_factory=BackboneConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def __post_init__(self):
        synthetic = self.data.synthetic
        if synthetic.identities is None:
            if self.data.labels is not None and self.data.source == "synthetic":
                raise ConfigError("ds_pfc.data.synthetic.identities must be set with ds_pfc.data.labels: the "
                                  "dataset's identities, while ds_pfc.head.num_classes counts the classes of the "
                                  "label file")
            synthetic.identities = self.head.num_classes
        conflict = self.data.stress.conflict is not None and self.data.stress.conflict.fraction > 0
        self._check_features(conflict)
        backbone_size = self.backbone.options.get("image_size", 112)
        if self.data.source == "synthetic" and synthetic.image_size != backbone_size:
            raise ConfigError(f"ds_pfc.data.synthetic.image_size ({synthetic.image_size}) must equal the backbone's "
                              f"input size ({backbone_size}; set ds_pfc.backbone.options.image_size, which "
                              "mobilefacenet accepts)")
        relabelled = self.data.labels is not None
        if self.data.source == "synthetic" and synthetic.identities != self.head.num_classes and not conflict \
                and not relabelled:
            raise ConfigError(f"ds_pfc.head.num_classes ({self.head.num_classes}) must equal "
                              f"ds_pfc.data.synthetic.identities ({self.data.synthetic.identities})")

    def _check_features(self, conflict: bool) -> None:
        """The identity-feature source goes with the mlp backbone (and only it), unflipped."""
        from ..models import ALIASES, FEATURE_BACKBONES
        features, backbone = self.data.features, self.backbone
        feature_backbone = ALIASES.get(backbone.name, backbone.name) in FEATURE_BACKBONES
        if self.data.source != "features":
            if feature_backbone:
                raise ConfigError(f"ds_pfc.backbone.name {backbone.name!r} reads feature vectors: it needs "
                                  f"ds_pfc.data.source \"features\", got {self.data.source!r}")
            return
        if not feature_backbone:
            raise ConfigError(f"ds_pfc.data.source \"features\" needs a feature backbone: ds_pfc.backbone.name must "
                              f"be one of {list(FEATURE_BACKBONES)}, got {backbone.name!r}")
        if features.identities is None:
            if self.data.labels is not None:
                raise ConfigError("ds_pfc.data.features.identities must be set with ds_pfc.data.labels: the "
                                  "dataset's identities, while ds_pfc.head.num_classes counts the classes of the "
                                  "label file")
            features.identities = self.head.num_classes
        if backbone.options.get("input_dim") != features.feature_dim:
            raise ConfigError(f"ds_pfc.backbone.options.input_dim must equal ds_pfc.data.features.feature_dim "
                              f"({features.feature_dim}), got {backbone.options.get('input_dim')!r}")
        if self.evaluation.flip:
            raise ConfigError("ds_pfc.evaluation.flip must be false for ds_pfc.data.source \"features\" (a flip "
                              "would permute a feature vector's values)")
        if features.identities != self.head.num_classes and not conflict and self.data.labels is None:
            raise ConfigError(f"ds_pfc.head.num_classes ({self.head.num_classes}) must equal "
                              f"ds_pfc.data.features.identities ({features.identities})")


def _positive_int(value, where: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{where} must be a positive integer, got {value!r}")


def _field_types(cls) -> dict[str, typing.Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def from_dict(cls, data, where: str = "ds_pfc"):
    """Build dataclass ``cls`` from a JSON object, strictly: unknown keys, missing
    required keys and values of the wrong type are :class:`ConfigError`."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must be an object, got {type(data).__name__}")
    types = _field_types(cls)
    unknown = sorted(set(data) - set(types))
    if unknown:
        guess = _did_you_mean(unknown, types)
        raise ConfigError(f"{where}: unknown key{'s' if len(unknown) > 1 else ''} {unknown}"
                          f"{f' ({guess})' if guess else ''}; "
                          f"allowed keys are {sorted(types)}")
    missing = [f.name for f in dataclasses.fields(cls)
               if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING and f.name not in data]
    if missing:
        raise ConfigError(f"{where}: missing required key{'s' if len(missing) > 1 else ''} {missing}")
    kwargs = {}
    for name, value in data.items():
        hint = types[name]
        inner = [a for a in typing.get_args(hint) if dataclasses.is_dataclass(a)]
        if dataclasses.is_dataclass(hint) or (inner and value is not None):
            kwargs[name] = from_dict(hint if dataclasses.is_dataclass(hint) else inner[0], value, f"{where}.{name}")
        else:
            kwargs[name] = _check_type(value, hint, f"{where}.{name}")
    try:
        return cls(**kwargs)
    except TypeError as err:
        raise ConfigError(f"{where}: {err}") from None


def _check_type(value, hint, where):
    origin = typing.get_origin(hint)
    options = typing.get_args(hint) if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)) \
        else (hint,)
    for option in options:
        if option is type(None) and value is None:
            return value
        base = typing.get_origin(option) or option
        if base is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if base is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if base in (str, bool, dict) and isinstance(value, base):
            return value
        if base in (tuple, list) and isinstance(value, (list, tuple)):
            return value
    names = [getattr(o, "__name__", str(o)) for o in options]
    raise ConfigError(f"{where} must be {' or '.join(names)}, got {value!r}")


def known_keys(config: dict, path) -> Place:
    """The keys the schema knows in the object at ``path`` (a sequence of keys from the
    top) of the job ``config``, the job's own keys not included: at the top level
    DeepSpeed's top-level keys and ``ds_pfc``; in the ``ds_pfc`` block the fields of its
    config classes; in DeepSpeed's blocks what :func:`ds_pfc.app.deepspeed_keys.place`
    knows. ``keys`` is None where nothing is known (a free-form object such as
    ``ds_pfc.backbone.options``)."""
    path = tuple(path)
    if not path:
        return Place(frozenset(DEEPSPEED_TOP_LEVEL_KEYS | {"ds_pfc", "$schema"}),
                     "DeepSpeed 0.19's top-level keys and 'ds_pfc'")
    if path[0] != "ds_pfc":
        return _deepspeed_place(config, path)
    if path[1:] == ("backbone", "options"):
        return _backbone_options(config)
    cls = DsPfcConfig
    for depth, part in enumerate(path[1:], start=1):
        types = _field_types(cls)
        if part not in types:
            return Place(None, f"{'.'.join(path[:depth])} has no key {part!r}")
        hint = types[part]
        options = typing.get_args(hint) or (hint,)
        inner = [a for a in options if dataclasses.is_dataclass(a)]
        if not inner:
            where = ".".join(path[:depth + 1])
            if dict in [typing.get_origin(a) or a for a in options]:
                return Place(None, f"{where} is an object of free-form keys")
            return Place(None, f"{where} is a value, not an object")
        cls = inner[0]
    return Place(frozenset(f.name for f in dataclasses.fields(cls)), f"ds_pfc's {cls.__name__}")


def _backbone_options(config: dict) -> Place:
    """The constructor options of the job's backbone (``ds_pfc.backbone.name``)."""
    import inspect
    from ..models import ALIASES, _FEATURE_SPECS, _SPECS
    block = (config.get("ds_pfc") or {}).get("backbone") if isinstance(config, dict) else None
    name = block.get("name", BackboneConfig.name) if isinstance(block, dict) else BackboneConfig.name
    spec = {**_SPECS, **_FEATURE_SPECS}.get(ALIASES.get(name, name)) if isinstance(name, str) else None
    if spec is None:
        return Place(None, f"ds_pfc.backbone.options of an unknown backbone {name!r}")
    cls, fixed, _ = spec
    taken = set(fixed) | {"self", "embedding_size", "width", "dropout"}
    keys = frozenset(p.name for p in inspect.signature(cls.__init__).parameters.values()
                     if p.name not in taken and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
    return Place(keys, f"the options of backbone {name} ({cls.__name__})")


def set_values(config: dict, assignments) -> dict:
    """A copy of ``config`` with each ``"a.b.c=value"`` of ``assignments`` set (``--set``
    on the command line): the value is read as JSON when it parses (numbers, true/false,
    null, lists, objects, quoted strings), else taken as a string.

    Every key of the path must exist: in the job, or as a key the schema knows at that
    place (the ``ds_pfc`` config classes, DeepSpeed's top-level keys and the blocks it
    describes with pydantic models, the parameters of the configured optimizer and
    scheduler; :func:`known_keys`); known objects missing from the job
    are created. Anything else is a :class:`ConfigError` naming the key, where it was
    looked for and the closest known key, unless the key is marked new with a leading
    ``+`` (``"+a.b.c=value"``, which creates what is missing on the way and is refused
    for a key that exists). The result is checked by :func:`split_config` like any
    config; ``config`` is never changed."""
    if assignments and not isinstance(config, dict):
        raise ConfigError(f"--set needs a config that is a JSON object, got {type(config).__name__}")
    out = copy.deepcopy(config)
    for item in assignments or ():
        item = str(item)
        key, eq, text = item.partition("=")
        key = key.strip()
        new = key.startswith("+")
        dotted = key[1:] if new else key
        parts = dotted.split(".")
        if not eq or not all(parts):
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE with a dotted key, e.g. ds_pfc.train.max_steps=100 "
                              "(+KEY=VALUE for a key the job does not have)")
        try:
            value = json.loads(text)
        except ValueError:
            value = text
        node = out
        for depth, part in enumerate(parts):
            where = f"in {'.'.join(parts[:depth])}" if depth else "at the top level"
            known = known_keys(out, parts[:depth]) if part not in node else None
            exists = part in node or (known.keys is not None and part in known.keys)
            if not exists and not new:
                guess = _did_you_mean([part], set(node) | set(known.keys or ()))
                looked = f"the job and {known.what}" if known.keys is not None else f"the job only: {known.what}"
                raise ConfigError(f"--set {item}: no key {part!r} {where} (looked in {looked}"
                                  f"{'; ' + guess if guess else ''}); to add a key the job does not have, mark it "
                                  f"new: --set +{dotted}={text}")
            if depth == len(parts) - 1:
                if new and exists:
                    found = "in the job" if part in node else f"a key of {known.what}"
                    raise ConfigError(f"--set {item}: {dotted} exists ({found}); drop the '+' to set it: "
                                      f"--set {dotted}={text}")
                node[part] = value
                break
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"--set {item}: {'.'.join(parts[:depth + 1])} is {child!r}, not an object")
            node = child
    return out


def split_config(config: dict, *, strict: bool = True, source: str | None = None) -> tuple[dict, DsPfcConfig]:
    """Split a job's JSON into DeepSpeed's config and the parsed ``ds_pfc`` block.
    ``source``: the file it was read from (a missing relative path found beside it is
    named in the error; paths are still read from the working directory).

    Refuses top-level keys DeepSpeed does not read (DeepSpeed would ignore them) and
    ``optimizer.params`` keys the optimizer does not take
    (:func:`ds_pfc.app.deepspeed_keys.check_optimizer_params`); warns about a missing
    ``gradient_clipping`` (DeepSpeed's default clips at 1.0). ``strict=False`` (a
    config stored with a model or checkpoint, read back) only warns about the
    top-level keys and leaves the optimizer alone."""
    if not isinstance(config, dict):
        raise ConfigError(f"the config must be a JSON object, got {type(config).__name__}")
    if "ds_pfc" not in config:
        raise ConfigError("the config has no 'ds_pfc' block (the Partial FC head's settings)")
    ds_config = {k: v for k, v in config.items() if k != "ds_pfc"}
    removed = sorted(set(ds_config) & DEEPSPEED_REMOVED_KEYS)
    if removed:
        raise ConfigError(f"top-level config keys {removed} were removed from DeepSpeed 0.19 (their features no "
                          "longer exist); delete them")
    unknown = sorted(set(ds_config) - DEEPSPEED_TOP_LEVEL_KEYS - {"$schema"})
    if unknown:
        guess = _did_you_mean(unknown, DEEPSPEED_TOP_LEVEL_KEYS | {"ds_pfc"})
        text = (f"top-level config key{'s' if len(unknown) > 1 else ''} {unknown} {'are' if len(unknown) > 1 else 'is'}"
                f" not {'' if len(unknown) > 1 else 'a '}DeepSpeed key{'s' if len(unknown) > 1 else ''} (DeepSpeed "
                f"would ignore {'them' if len(unknown) > 1 else 'it'}{'; ' + guess if guess else ''})")
        if strict:
            raise ConfigError(f"{text}: fix or remove {'them' if len(unknown) > 1 else 'it'}")
        warnings.warn(text, stacklevel=2)
    if strict:
        check_optimizer_params(ds_config)
    if "gradient_clipping" not in ds_config:
        warnings.warn("the config does not set gradient_clipping; DeepSpeed then clips gradients at norm 1.0. "
                      "Set it explicitly (0.0 disables clipping).", stacklevel=2)
    token = _SOURCE.set(source)
    try:
        return ds_config, from_dict(DsPfcConfig, config["ds_pfc"])
    finally:
        _SOURCE.reset(token)
