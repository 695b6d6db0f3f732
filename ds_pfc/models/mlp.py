"""A small MLP backbone for feature-vector inputs (the many-class identity-feature setting).

Its input is a batch ``[B, 3, H, W]`` whose ``3 * H * W`` values are one feature vector
(the identity-feature source, :class:`ds_pfc.data.IdentityFeatures`, lays a vector of
``feature_dim`` values out as ``[3, 1, feature_dim // 3]`` so that it travels through the
image pipeline unchanged); the MLP flattens it. ``depth`` hidden layers of
``round(hidden * width)`` units (Linear, BN1d, PReLU), dropout, a Linear to the
embedding and the fixed-gamma BN1d every backbone ends with.
"""
from __future__ import annotations

import torch
from torch import nn

from .checkpointing import check_checkpoint_blocks, run_blocks
from .iresnet import check_backbone_args, embedding_bn, scaled
from .norm import BatchNorm1d

__all__ = ["MLP"]


class MLP(nn.Module):
    """``[B, 3, H, W]`` (``3 * H * W == input_dim``) -> ``[B, embedding_size]``.

    Args:
        input_dim: values per input (the feature dimension), > 0.
        hidden: units of each hidden layer at ``width`` 1.0 (default 512).
        depth: hidden layers, >= 1 (default 2).
        embedding_size, width, dropout: as every backbone.
        checkpoint_blocks: recompute each hidden layer in backward.
        train_embedding_scale: train the final BatchNorm's scale (gamma); None (default)
            keeps it fixed at 1.
    """

    def __init__(self, *, input_dim: int, embedding_size: int = 512, width: float = 1.0, dropout: float = 0.0,
                 hidden: int = 512, depth: int = 2, checkpoint_blocks: bool = False,
                 train_embedding_scale: bool | None = None):
        super().__init__()
        check_backbone_args(embedding_size, width, dropout)
        for name, value in (("input_dim", input_dim), ("hidden", hidden), ("depth", depth)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.input_dim, self.checkpoint_blocks = input_dim, check_checkpoint_blocks(checkpoint_blocks)
        units = scaled(hidden, width)
        blocks, previous = [], input_dim
        for _ in range(depth):
            blocks.append(nn.Sequential(nn.Linear(previous, units, bias=False), BatchNorm1d(units), nn.PReLU(units)))
            previous = units
        self.body = nn.Sequential(*blocks)
        self.dropout = nn.Dropout(dropout)
        self.fc = nn.Linear(previous, embedding_size, bias=False)
        self.features = embedding_bn(embedding_size, False if train_embedding_scale is None else train_embedding_scale)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        if not isinstance(inputs, torch.Tensor) or inputs.dim() < 2 or inputs[0].numel() != self.input_dim:
            shape = list(inputs.shape) if isinstance(inputs, torch.Tensor) else type(inputs).__name__
            raise ValueError(f"the MLP backbone expects inputs [B, ...] of {self.input_dim} values each "
                             f"(its input_dim), got {shape}")
        x = run_blocks(self.body, inputs.flatten(1), checkpointed=self.checkpoint_blocks, training=self.training)
        return self.features(self.fc(self.dropout(x)))
