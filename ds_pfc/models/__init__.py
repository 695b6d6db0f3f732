"""Face-recognition backbones: [B, 3, 112, 112] aligned faces -> [B, embedding_size].

``build_backbone(name, ...)`` builds one of ``BACKBONES`` (aliases in ``ALIASES``);
``count_macs`` / ``count_flops`` measure the compute of one forward pass.

Every backbone ends with a BN1d whose scale (gamma) starts at 1. Whether it trains
follows arcface_torch per family (option ``train_embedding_scale``, None = the rule):
the IResNets (and ``mlp``) keep it fixed (``requires_grad=False``, ArcFace's
``fix_gamma``), the MobileFaceNets and ViTs train it. It is the only parameter ever
frozen.
Precision is left to the caller (DeepSpeed's fp16/bf16 casting, or ``torch.autocast``):
the modules have no fp16 switch of their own. Their BatchNorm layers
(:mod:`ds_pfc.models.norm`) run with 16-bit parameters beside float32 running
statistics, the state DeepSpeed's fp16/bf16 modes leave a module in.

May import: ds_pfc._checks, ds_pfc.devices; torch.
Never: ds_pfc.core and any layer above it, ds_pfc.data, the root package.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from .iresnet import INPUT_SHAPE, IResNet
from .mlp import MLP
from .mobilefacenet import MobileFaceNet
from .vit import ViT

__all__ = ["build_backbone", "count_macs", "count_flops", "BACKBONES", "FEATURE_BACKBONES", "ALIASES", "INPUT_SHAPE",
           "IResNet", "MLP", "MobileFaceNet", "ViT"]

# name -> (class, fixed architecture, defaults the options may override). The numbers
# are insightface's (arcface_torch ``get_model``); vit_b and vit_l default to its
# network and to its stochastic depth and mask ratio for them (vit_l: its WebFace42M
# setting, the only vit_l it defines).
_SPECS = {
    "iresnet18": (IResNet, {"layers": (2, 2, 2, 2)}, {}),
    "iresnet34": (IResNet, {"layers": (3, 4, 6, 3)}, {}),
    "iresnet50": (IResNet, {"layers": (3, 4, 14, 3)}, {}),
    "iresnet100": (IResNet, {"layers": (3, 13, 30, 3)}, {}),
    "iresnet200": (IResNet, {"layers": (6, 26, 60, 6)}, {}),
    "mobilefacenet": (MobileFaceNet, {"blocks": (1, 4, 6, 2), "scale": 2}, {}),
    "mobilefacenet_large": (MobileFaceNet, {"blocks": (2, 8, 12, 4), "scale": 4}, {}),
    "vit_t": (ViT, {"dim": 256, "depth": 12, "num_heads": 8}, {}),
    "vit_s": (ViT, {"dim": 512, "depth": 12, "num_heads": 8}, {}),
    "vit_b": (ViT, {"dim": 512, "depth": 24, "num_heads": 8},
              {"style": "arcface", "drop_path_rate": 0.1, "mask_ratio": 0.1}),
    "vit_l": (ViT, {"dim": 768, "depth": 24, "num_heads": 8},
              {"style": "arcface", "drop_path_rate": 0.05, "mask_ratio": 0.05}),
}
# Backbones of feature-vector inputs (the identity-feature source), not of face images.
_FEATURE_SPECS = {"mlp": (MLP, {}, {})}
BACKBONES = tuple(_SPECS)
"""Canonical backbone names (face images in)."""

FEATURE_BACKBONES = tuple(_FEATURE_SPECS)
"""Backbones of feature vectors (``mlp``: the many-class identity-feature setting)."""

ALIASES = {"r18": "iresnet18", "r34": "iresnet34", "r50": "iresnet50", "r100": "iresnet100",
           "r200": "iresnet200", "mbf": "mobilefacenet", "mbf_large": "mobilefacenet_large"}
"""insightface's short names."""


def build_backbone(name: str, *, embedding_size: int = 512, width: float = 1.0, dropout: float = 0.0,
                   **options) -> nn.Module:
    """Build backbone ``name`` (a ``BACKBONES`` entry or an ``ALIASES`` key).

    Args:
        embedding_size: output dimension (512 published).
        width: channel multiplier; 1.0 is the published size, smaller for CPU tests.
        dropout: dropout probability before the embedding FC.
        **options: constructor-specific extras: ``checkpoint_blocks`` (every
            backbone: recompute each block in backward, training only);
            ``train_embedding_scale`` (every backbone: train the final BatchNorm's
            scale; None: the IResNets and ``mlp`` keep it at 1, the MobileFaceNets
            and ViTs train it, as arcface_torch does);
            ``drop_path_rate``, ``mask_ratio`` and ``style`` for the ViTs (vit_t and
            vit_s: 0, 0, ``"default"``; vit_b: 0.1, 0.1, ``"arcface"``; vit_l: 0.05,
            0.05, ``"arcface"``, as insightface trains them); ``image_size`` for the
            MobileFaceNets; ``input_dim`` (required), ``hidden`` and ``depth`` for
            ``mlp`` (a ``FEATURE_BACKBONES`` entry: feature vectors in, see
            :mod:`ds_pfc.models.mlp`).
    """
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    canonical = ALIASES.get(name, name)
    specs = {**_SPECS, **_FEATURE_SPECS}
    if canonical not in specs:
        raise ValueError(f"unknown backbone {name!r}; valid names: {', '.join(BACKBONES + FEATURE_BACKBONES)} "
                         f"(aliases: {', '.join(ALIASES)})")
    cls, spec, defaults = specs[canonical]
    return cls(**spec, embedding_size=embedding_size, width=width, dropout=dropout, **{**defaults, **options})


def count_macs(model: nn.Module, input_size: Sequence[int] = (1, *INPUT_SHAPE)) -> int:
    """Multiply-accumulates of one eval-mode forward pass on ``input_size``.

    Counts what actually runs through convolutions, matrix products and attention
    (``torch.utils.flop_counter``); BN, activations and additions are not counted.
    Works on a model built under ``torch.device("meta")``, which computes nothing, so
    the full-size models cost milliseconds. The "GFLOPs" insightface publishes for its
    backbones are multiply-accumulates in this sense (ptflops' convention).
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    param = next(model.parameters())
    images = torch.zeros(tuple(input_size), device=param.device, dtype=param.dtype)
    was_training = model.training
    model.eval()
    try:
        # The math attention backend runs as plain matmuls, which every device counts;
        # the fused CPU kernel has no flop formula and would count as zero.
        with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
            model(images)
    finally:
        model.train(was_training)
    return counter.get_total_flops() // 2


def count_flops(model: nn.Module, input_size: Sequence[int] = (1, *INPUT_SHAPE)) -> int:
    """Floating-point operations of one eval-mode forward pass: ``2 * count_macs``."""
    return 2 * count_macs(model, input_size)
