"""IResNet, the "improved ResNet" of ArcFace (Deng et al., CVPR'19, Sec. 3 "IR" block),
for 112x112 aligned faces.

Written from the published description:

- stem: 3x3 conv (stride 1) -> BN -> PReLU at 112x112;
- four stages of basic blocks, 64/128/256/512 channels; the first block of each stage
  halves the resolution (112 -> 56 -> 28 -> 14 -> 7);
- the IR block is BN -> 3x3 conv -> BN -> PReLU -> 3x3 conv (stride here, in the
  second conv) -> BN, plus the shortcut (identity, or 1x1 conv + BN when the block
  changes shape); no activation after the sum;
- output ("option E"): BN2d -> dropout -> flatten (512x7x7) -> FC -> BN1d.

The final BN1d keeps its scale (gamma) fixed at 1 and not trainable, as ArcFace and
arcface_torch's IResNet do (MXNet's ``fix_gamma``; ``train_embedding_scale`` true
trains it); its shift (beta) trains. The embedding is
L2-normalized by the margin head, so a learned per-dimension scale would only reweight
dimensions of the cosine.

This module also holds the small helpers the other backbones share (input check,
argument checks, channel scaling, the embedding BN1d).
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import nn

from .checkpointing import check_checkpoint_blocks, run_blocks
from .norm import BatchNorm1d, BatchNorm2d

__all__ = ["IResNet", "IBasicBlock", "INPUT_SHAPE"]

INPUT_SHAPE = (3, 112, 112)
"""[C, H, W] every backbone takes: RGB, 112x112 aligned faces."""

_BN_EPS = 1e-5


# --- helpers shared by all backbones ------------------------------------------------

def check_images(images, name: str = "images", image_size: int = INPUT_SHAPE[1]) -> None:
    """``images`` must be a float [B, 3, S, S] tensor (S = ``image_size``, 112 unless
    the backbone was built for another size); raise naming the expected shape."""
    if not isinstance(images, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(images).__name__}")
    if not images.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {images.dtype}")
    expected = (3, image_size, image_size)
    if images.dim() != 4 or tuple(images.shape[1:]) != expected:
        raise ValueError(f"{name} must have shape [B, {', '.join(map(str, expected))}] "
                         f"(aligned {image_size}x{image_size} RGB faces), got shape {tuple(images.shape)}")


def check_backbone_args(embedding_size, width, dropout) -> None:
    """Arguments common to every backbone; each error names the argument."""
    if isinstance(embedding_size, bool) or not isinstance(embedding_size, int) or embedding_size < 1:
        raise ValueError(f"embedding_size must be a positive int, got {embedding_size!r}")
    if isinstance(width, bool) or not isinstance(width, (int, float)) or not math.isfinite(width) or width <= 0:
        raise ValueError(f"width must be a positive finite number (1.0 = published size), got {width!r}")
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")


def scaled(channels: int, width: float, divisor: int = 1) -> int:
    """``channels * width`` rounded to a positive multiple of ``divisor``."""
    return max(divisor, int(round(channels * width / divisor)) * divisor)


def embedding_bn(num_features: int, train_scale) -> BatchNorm1d:
    """The BN1d every backbone ends with: gamma starts at 1 and is trained only when
    ``train_scale`` is true (arcface_torch's rule per family: its IResNets freeze it,
    its MobileFaceNets and ViTs train it); beta is always trained."""
    if not isinstance(train_scale, bool):
        raise ValueError(f"train_embedding_scale must be true, false or null (the family's rule), "
                         f"got {train_scale!r}")
    bn = BatchNorm1d(num_features, eps=_BN_EPS)
    nn.init.ones_(bn.weight)
    bn.weight.requires_grad_(train_scale)
    return bn


# --- IResNet ------------------------------------------------------------------------

def init_convs(module: nn.Module) -> None:
    """He-normal (fan-out) initialisation of every Conv2d in ``module``."""
    for m in module.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")


def _conv3x3(in_channels: int, out_channels: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)


class IBasicBlock(nn.Module):
    """BN -> conv3x3 -> BN -> PReLU -> conv3x3(stride) -> BN, plus shortcut."""

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1):
        super().__init__()
        self.bn1 = BatchNorm2d(in_channels, eps=_BN_EPS)
        self.conv1 = _conv3x3(in_channels, out_channels)
        self.bn2 = BatchNorm2d(out_channels, eps=_BN_EPS)
        self.prelu = nn.PReLU(out_channels)
        self.conv2 = _conv3x3(out_channels, out_channels, stride)
        self.bn3 = BatchNorm2d(out_channels, eps=_BN_EPS)
        self.shortcut = None
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                BatchNorm2d(out_channels, eps=_BN_EPS),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn3(self.conv2(self.prelu(self.bn2(self.conv1(self.bn1(x))))))
        return out + (x if self.shortcut is None else self.shortcut(x))


class IResNet(nn.Module):
    """IResNet for [B, 3, 112, 112] -> [B, embedding_size].

    Args:
        layers: blocks per stage, e.g. ``(3, 4, 14, 3)`` for IResNet-50.
        embedding_size: output dimension (512 published).
        width: channel multiplier (1.0 = 64/128/256/512 channels); for small CPU runs.
        dropout: dropout probability on the 7x7 feature map before the FC.
        checkpoint_blocks: recompute each basic block's activations in backward instead
            of keeping them (training only; see :mod:`ds_pfc.models.checkpointing`).
        train_embedding_scale: train the final BatchNorm's scale (gamma); None (default)
            keeps it fixed at 1, as arcface_torch's IResNets do.
    """

    def __init__(self, layers: Sequence[int], *, embedding_size: int = 512, width: float = 1.0,
                 dropout: float = 0.0, checkpoint_blocks: bool = False, train_embedding_scale: bool | None = None):
        super().__init__()
        check_backbone_args(embedding_size, width, dropout)
        self.checkpoint_blocks = check_checkpoint_blocks(checkpoint_blocks)
        layers = tuple(layers)
        if len(layers) != 4 or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in layers):
            raise ValueError(f"layers must be 4 positive ints (blocks per stage), got {layers!r}")
        self.layers = layers
        self.embedding_size = embedding_size

        stem_channels = scaled(64, width)
        self.stem = nn.Sequential(
            _conv3x3(3, stem_channels),
            BatchNorm2d(stem_channels, eps=_BN_EPS),
            nn.PReLU(stem_channels),
        )
        stages = []
        in_channels = stem_channels
        for i, num_blocks in enumerate(layers):
            out_channels = stem_channels * 2 ** i
            blocks = [IBasicBlock(in_channels, out_channels, stride=2)]
            blocks += [IBasicBlock(out_channels, out_channels) for _ in range(num_blocks - 1)]
            stages.append(nn.Sequential(*blocks))
            in_channels = out_channels
        self.stages = nn.Sequential(*stages)

        spatial = INPUT_SHAPE[1] // 2 ** len(layers)  # 7
        self.bn = BatchNorm2d(in_channels, eps=_BN_EPS)
        self.dropout = nn.Dropout(dropout)
        self.fc = nn.Linear(in_channels * spatial * spatial, embedding_size)
        self.features = embedding_bn(embedding_size, False if train_embedding_scale is None else train_embedding_scale)

        init_convs(self)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        check_images(images)
        blocks = (block for stage in self.stages for block in stage)
        x = run_blocks(blocks, self.stem(images), checkpointed=self.checkpoint_blocks, training=self.training)
        x = self.dropout(self.bn(x)).flatten(1)
        return self.features(self.fc(x))
