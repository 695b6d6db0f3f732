"""Row moves with torch ops: :func:`move_rows_torch_`, the twin of the Triton kernel
:func:`ds_pfc.kernels.triton_rows.move_rows_` on any device.

``dst[dst_idx[i]] = src[src_idx[i]]`` (through ``round_dtype``, then as ``dst.dtype``) for
every ``i`` with ``mask[i]`` set; ``src_idx``/``dst_idx`` None mean ``i`` itself. Gathers,
a ``where`` and an index copy: no host sync, and the same ops whatever the row count,
except for a masked write to indexed rows (``dst_idx`` and ``mask``), which selects the
rows first (``nonzero``: a host sync on a GPU), so that a masked-off position writes
nothing even where its index repeats another's; with ``unique_dst=True`` (every entry of
``dst_idx`` distinct, masked-off ones included) it rewrites the masked-off rows with
their own values instead, with no host sync.
The bank's mapped access uses it where the kernel cannot run (off CUDA, without Triton);
:class:`~ds_pfc.bank.mapped.MappedStager` takes the kernel from its caller (``core``).
"""
from __future__ import annotations

import torch

from .._checks import check_row_move

__all__ = ["move_rows_torch_"]


def move_rows_torch_(src: torch.Tensor, src_idx: torch.Tensor | None, dst: torch.Tensor,
                     dst_idx: torch.Tensor | None, mask: torch.Tensor | None = None,
                     round_dtype: torch.dtype | None = None, *, count: int | None = None,
                     unique_dst: bool = False) -> torch.Tensor:
    """See the module docstring. Returns ``dst``."""
    count = check_row_move(src, src_idx, dst, dst_idx, mask, count)
    if count == 0:
        return dst
    values = src[:count] if src_idx is None else src.index_select(0, src_idx.to(src.device))
    values = values.to(dst.device)
    if round_dtype is not None and round_dtype != values.dtype:
        values = values.to(round_dtype)
    values = values.to(dst.dtype)
    if dst_idx is None:
        target = dst[:count]
        if mask is None:
            target.copy_(values)
        else:
            target.copy_(torch.where(_expand(mask, values), values, target))
        return dst
    if mask is not None and unique_dst:
        dst_idx = dst_idx.to(dst.device)
        values = torch.where(_expand(mask.to(dst.device), values), values, dst.index_select(0, dst_idx))
    elif mask is not None:
        keep = torch.nonzero(mask).squeeze(1)
        dst_idx, values = dst_idx.index_select(0, keep), values.index_select(0, keep)
    dst.index_copy_(0, dst_idx, values)
    return dst


def _expand(mask: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    return mask.view((-1,) + (1,) * (values.dim() - 1))
