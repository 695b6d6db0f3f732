"""MobileFaceNet (Chen et al., CCBR'18, Table 1) for 112x112 faces, in the widened
forms insightface trains as ``mbf`` (block counts ``(1, 4, 6, 2)``, ``scale=2``) and
``mbf_large`` (``(2, 8, 12, 4)``, ``scale=4``).

Written from the paper's table. With ``c`` the paper's channel count and ``t`` its
expansion factor:

    input        operator                       t   c     n            stride
    112x112x3    conv3x3                        -   64    1            2
    56x56        depthwise conv3x3              -   64    1            1
    56x56        bottleneck                     2   64    1+blocks[1]  2
    28x28        bottleneck                     4   128   1            2
    14x14        bottleneck                     2   128   blocks[2]    1
    14x14        bottleneck                     4   128   1            2
    7x7          bottleneck                     2   128   blocks[3]    1
    7x7          conv1x1                        -   512   1            1
    7x7          linear global depthwise 7x7    -   512   1            1
    1x1          linear FC + BN1d               -   emb   1            -

``scale`` multiplies the block channels ``c`` only; the expanded (depthwise) widths
stay ``t * c_paper`` and the ``56x56`` grouped conv keeps the paper's 64 groups (at
``scale=2`` each group sees 2 channels). ``blocks[0] > 1`` replaces that conv by
``blocks[0]`` residual bottlenecks (``t=2``). A bottleneck is 1x1 expand -> BN ->
PReLU -> 3x3 depthwise (stride) -> BN -> PReLU -> 1x1 project -> BN (linear), with an
identity shortcut when stride is 1 and the shape is kept.

The embedding head replaces the paper's final 1x1 linear conv by FC -> BN1d (gamma
starts at 1 and trains, as in arcface_torch's MobileFaceNet; ``train_embedding_scale``
false fixes it as the IResNets do); ``dropout`` acts on the flattened GDC output before
the FC.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from .checkpointing import check_checkpoint_blocks, run_blocks
from .iresnet import check_backbone_args, check_images, embedding_bn, init_convs, scaled
from .norm import BatchNorm2d

__all__ = ["MobileFaceNet", "DepthwiseBottleneck"]

_BN_EPS = 1e-5


class ConvBN(nn.Sequential):
    """conv (no bias) -> BN -> PReLU, or conv -> BN when ``act=False`` (linear)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int = 1, stride: int = 1,
                 groups: int = 1, act: bool = True, padding: int | None = None):
        padding = kernel_size // 2 if padding is None else padding
        layers = [nn.Conv2d(in_channels, out_channels, kernel_size, stride=stride, padding=padding,
                            groups=groups, bias=False),
                  BatchNorm2d(out_channels, eps=_BN_EPS)]
        if act:
            layers.append(nn.PReLU(out_channels))
        super().__init__(*layers)


class DepthwiseBottleneck(nn.Module):
    """1x1 expand -> 3x3 depthwise (stride) -> linear 1x1 project; residual if shape kept."""

    def __init__(self, in_channels: int, out_channels: int, expanded: int, stride: int = 1):
        super().__init__()
        self.expand = ConvBN(in_channels, expanded, 1)
        self.depthwise = ConvBN(expanded, expanded, 3, stride=stride, groups=expanded)
        self.project = ConvBN(expanded, out_channels, 1, act=False)
        self.residual = stride == 1 and in_channels == out_channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.project(self.depthwise(self.expand(x)))
        return x + out if self.residual else out


class MobileFaceNet(nn.Module):
    """MobileFaceNet for [B, 3, 112, 112] (or ``image_size``) -> [B, embedding_size].

    Args:
        blocks: ``(n0, n1, n2, n3)`` as in the module docstring; ``(1, 4, 6, 2)`` is ``mbf``.
        scale: block-channel multiplier (2 for ``mbf``, 1 for the paper's network).
        embedding_size: output dimension (512 published).
        width: channel multiplier applied to every width (1.0 = published size).
        dropout: dropout probability before the embedding FC.
        image_size: side of the square input, >= 16 (112 published). Four stride-2
            stages take it to ``ceil(image_size / 16)``, the global depthwise conv's
            kernel (7 at 112, 4 at 56): smaller faces for quick CPU studies.
        checkpoint_blocks: recompute each layer's activations in backward instead of
            keeping them (training only; see :mod:`ds_pfc.models.checkpointing`).
        train_embedding_scale: train the final BatchNorm's scale (gamma); None (default)
            trains it, as arcface_torch's MobileFaceNets do.
    """

    def __init__(self, blocks: Sequence[int] = (1, 4, 6, 2), scale: int = 2, *, embedding_size: int = 512,
                 width: float = 1.0, dropout: float = 0.0, image_size: int = 112,
                 checkpoint_blocks: bool = False, train_embedding_scale: bool | None = None):
        super().__init__()
        check_backbone_args(embedding_size, width, dropout)
        self.checkpoint_blocks = check_checkpoint_blocks(checkpoint_blocks)
        if isinstance(image_size, bool) or not isinstance(image_size, int) or image_size < 16:
            raise ValueError(f"image_size must be an int >= 16, got {image_size!r}")
        self.image_size = image_size
        gdc_size = image_size
        for _ in range(4):                     # 3x3 convs with stride 2 and padding 1: ceil(s / 2)
            gdc_size = (gdc_size + 1) // 2
        blocks = tuple(blocks)
        if len(blocks) != 4 or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in blocks):
            raise ValueError(f"blocks must be 4 positive ints, got {blocks!r}")
        if isinstance(scale, bool) or not isinstance(scale, int) or scale < 1:
            raise ValueError(f"scale must be a positive int, got {scale!r}")
        self.blocks = blocks
        self.embedding_size = embedding_size

        c64, c128, c256, c512 = (scaled(c, width) for c in (64, 128, 256, 512))
        narrow, wide = scale * c64, scale * c128  # block channels
        layers = [ConvBN(3, narrow, 3, stride=2)]
        if blocks[0] == 1:
            layers.append(ConvBN(narrow, narrow, 3, groups=c64))
        else:
            layers += [DepthwiseBottleneck(narrow, narrow, c128) for _ in range(blocks[0])]
        layers.append(DepthwiseBottleneck(narrow, narrow, c128, stride=2))              # -> 28x28
        layers += [DepthwiseBottleneck(narrow, narrow, c128) for _ in range(blocks[1])]
        layers.append(DepthwiseBottleneck(narrow, wide, c256, stride=2))                # -> 14x14
        layers += [DepthwiseBottleneck(wide, wide, c256) for _ in range(blocks[2])]
        layers.append(DepthwiseBottleneck(wide, wide, c512, stride=2))                  # -> 7x7
        layers += [DepthwiseBottleneck(wide, wide, c256) for _ in range(blocks[3])]
        layers.append(ConvBN(wide, c512, 1))
        self.body = nn.Sequential(*layers)

        # Global depthwise conv: a learned per-channel 7x7 weighting instead of average pooling.
        self.gdc = ConvBN(c512, c512, gdc_size, groups=c512, act=False, padding=0)
        self.dropout = nn.Dropout(dropout)
        self.fc = nn.Linear(c512, embedding_size, bias=False)
        self.features = embedding_bn(embedding_size, True if train_embedding_scale is None else train_embedding_scale)

        init_convs(self)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        check_images(images, image_size=self.image_size)
        x = run_blocks(self.body, images, checkpointed=self.checkpoint_blocks, training=self.training)
        x = self.gdc(x).flatten(1)
        return self.features(self.fc(self.dropout(x)))

