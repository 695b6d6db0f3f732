"""Vision Transformer for 112x112 faces, as insightface's partial-FC ViTs are described:
patch 9, 8 heads, MLP ratio 4; ``vit_t`` dim 256 / depth 12, ``vit_s`` dim 512 / depth
12, ``vit_b`` dim 512 / depth 24, ``vit_l`` dim 768 / depth 24.

Written from the published description:

- patch embedding: a 9x9 conv with stride 9 -> a 12x12 grid = 144 tokens. 112 is not a
  multiple of 9: the last 4 rows and columns of the image are not seen (as in
  insightface); there is no class token;
- a learned position embedding per token;
- ``depth`` pre-norm blocks: ``x + Attn(LN(x))`` then ``x + MLP(LN(x))``, MLP ratio 4
  with GELU, optional stochastic depth (``drop_path_rate``, linear over depth);
- a final LayerNorm, then the head maps all tokens to the embedding: flatten
  (144 * dim) -> [dropout] -> FC -> BN1d -> FC -> BN1d (the last BN1d's gamma starts at
  1 and trains, as in arcface_torch's ViT; ``train_embedding_scale`` false fixes it).

Training-only token masking (``mask_ratio``): each sample keeps a random
``(1 - mask_ratio)`` of its tokens through the transformer blocks; the dropped positions
are refilled with a learned mask token before the head, which needs all 144.

``style="arcface"`` is the network exactly as arcface_torch defines its ViTs (the
default of ``vit_b`` and ``vit_l``): ReLU6 instead of GELU in the MLP, eps 2e-5 in the
head's two BatchNorms, and the mask tokens inserted after the final LayerNorm instead
of before it. Either style creates its tensors in arcface_torch's order and shapes
(``pos_embed``, ``mask_token`` when ``mask_ratio > 0``, patch embedding, per block
``norm1``, ``norm2``, ``qkv`` (no bias), ``proj``, the two MLP layers, the final
LayerNorm, the head), so its weights map onto arcface_torch's tensor for tensor;
with ``style="arcface"`` the outputs are the same too.

``checkpoint_blocks=True`` recomputes each transformer block in backward instead of
keeping its activations (training only; :mod:`ds_pfc.models.checkpointing`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .checkpointing import check_checkpoint_blocks, run_blocks
from .iresnet import INPUT_SHAPE, check_backbone_args, check_images, embedding_bn, scaled
from .norm import BatchNorm1d

__all__ = ["ViT"]

_PATCH = 9
_STYLES = {"default": (nn.GELU, 1e-5, False), "arcface": (nn.ReLU6, 2e-5, True)}
"""style -> (MLP activation, head BatchNorm eps, mask tokens inserted after the final LayerNorm)."""


def drop_path(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Stochastic depth: zero the whole residual branch per sample with probability ``p``."""
    if p == 0.0 or not training:
        return x
    keep = x.new_empty((x.shape[0],) + (1,) * (x.dim() - 1)).bernoulli_(1.0 - p)
    return x * keep / (1.0 - p)


class Attention(nn.Module):
    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        B, T, D = x_BTD.shape
        qkv = self.qkv(x_BTD).view(B, T, 3, self.num_heads, D // self.num_heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])  # [B, heads, T, D/heads]
        return self.proj(out.transpose(1, 2).reshape(B, T, D))


class Block(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, dim: int, num_heads: int, drop_path_rate: float = 0.0, mlp_ratio: int = 4,
                 activation: type[nn.Module] = nn.GELU):
        super().__init__()
        # Both norms first: the tensors then come in arcface_torch's order.
        self.norm1 = nn.LayerNorm(dim)
        self.norm2 = nn.LayerNorm(dim)
        self.attn = Attention(dim, num_heads)
        self.mlp = nn.Sequential(nn.Linear(dim, mlp_ratio * dim), activation(), nn.Linear(mlp_ratio * dim, dim))
        self.drop_path_rate = drop_path_rate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + drop_path(self.attn(self.norm1(x)), self.drop_path_rate, self.training)
        return x + drop_path(self.mlp(self.norm2(x)), self.drop_path_rate, self.training)


class ViT(nn.Module):
    """ViT for [B, 3, 112, 112] -> [B, embedding_size].

    Args:
        dim: token width at ``width=1`` (256 for vit_t, 512 for vit_s).
        depth: number of transformer blocks.
        num_heads: attention heads; ``dim * width`` is rounded to a multiple of it.
        embedding_size: output dimension (512 published).
        width: multiplier on ``dim`` (1.0 = published size); depth and heads are kept.
        dropout: dropout probability on the flattened tokens before the head's first FC.
        drop_path_rate: stochastic-depth rate of the last block (0 disables).
        mask_ratio: fraction of tokens dropped per sample in training (0 disables).
        style: ``"default"`` or ``"arcface"`` (arcface_torch's network; see the module
            docstring).
        checkpoint_blocks: recompute each block's activations in backward (training only).
        train_embedding_scale: train the final BatchNorm's scale (gamma); None (default)
            trains it, as arcface_torch's ViTs do.
    """

    def __init__(self, dim: int = 256, depth: int = 12, num_heads: int = 8, *, embedding_size: int = 512,
                 width: float = 1.0, dropout: float = 0.0, drop_path_rate: float = 0.0, mask_ratio: float = 0.0,
                 style: str = "default", checkpoint_blocks: bool = False,
                 train_embedding_scale: bool | None = None):
        super().__init__()
        check_backbone_args(embedding_size, width, dropout)
        if not isinstance(style, str) or style not in _STYLES:
            raise ValueError(f"style must be one of {sorted(_STYLES)}, got {style!r}")
        activation, head_eps, self._mask_after_norm = _STYLES[style]
        self.style = style
        self.checkpoint_blocks = check_checkpoint_blocks(checkpoint_blocks)
        for name, value in (("dim", dim), ("depth", depth), ("num_heads", num_heads)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for name, value in (("drop_path_rate", drop_path_rate), ("mask_ratio", mask_ratio)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {value!r}")
        self.dim = scaled(dim, width, divisor=num_heads)
        self.embedding_size = embedding_size
        self.mask_ratio = float(mask_ratio)
        grid = INPUT_SHAPE[1] // _PATCH  # 12
        self.num_tokens = grid * grid

        self.patch_embed = nn.Conv2d(INPUT_SHAPE[0], self.dim, _PATCH, stride=_PATCH)
        self.pos_embed = nn.Parameter(torch.zeros(1, self.num_tokens, self.dim))
        self.mask_token = nn.Parameter(torch.zeros(1, 1, self.dim)) if mask_ratio > 0 else None
        rates = [drop_path_rate * i / max(depth - 1, 1) for i in range(depth)]
        self.blocks = nn.Sequential(*(Block(self.dim, num_heads, r, activation=activation) for r in rates))
        self.norm = nn.LayerNorm(self.dim)
        self.dropout = nn.Dropout(dropout)
        self.head = nn.Sequential(
            nn.Linear(self.num_tokens * self.dim, self.dim, bias=False),
            BatchNorm1d(self.dim, eps=head_eps),
            nn.Linear(self.dim, embedding_size, bias=False),
        )
        self.features = embedding_bn(embedding_size, True if train_embedding_scale is None else train_embedding_scale)
        self.features.eps = head_eps

        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        if self.mask_token is not None:
            nn.init.trunc_normal_(self.mask_token, std=0.02)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    def _masked_blocks(self, x_BTD: torch.Tensor) -> torch.Tensor:
        """Run the blocks on a random subset of tokens per sample; refill the rest with
        the mask token; return the tokens after the final LayerNorm."""
        B, T, D = x_BTD.shape
        num_keep = max(1, int(T * (1.0 - self.mask_ratio)))
        keep_BK = torch.rand(B, T, device=x_BTD.device).argsort(dim=1)[:, :num_keep]
        index = keep_BK.unsqueeze(-1).expand(-1, -1, D)
        kept = self._blocks(torch.gather(x_BTD, 1, index))
        if self._mask_after_norm:
            kept = self.norm(kept)
        full = self.mask_token.to(kept.dtype).expand(B, T, D).scatter(1, index, kept)
        return full if self._mask_after_norm else self.norm(full)

    def _blocks(self, x_BTD: torch.Tensor) -> torch.Tensor:
        return run_blocks(self.blocks, x_BTD, checkpointed=self.checkpoint_blocks, training=self.training)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        check_images(images)
        x = self.patch_embed(images).flatten(2).transpose(1, 2) + self.pos_embed  # [B, 144, dim]
        if self.training and self.mask_token is not None:
            x = self._masked_blocks(x)  # normalised
        else:
            x = self.norm(self._blocks(x))
        x = self.dropout(x.flatten(1))
        return self.features(self.head(x))
