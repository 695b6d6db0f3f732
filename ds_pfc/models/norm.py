"""BatchNorm layers that run under any mix of parameter and running-statistics dtypes.

DeepSpeed's fp16 and bf16 modes cast a module's parameters to 16 bits and leave its
buffers alone (``DeepSpeedEngine._cast_module_mixed_precision``; buffers change only
with ``data_types.buffer_dtype``), so every BatchNorm holds a 16-bit weight and bias
next to float32 running statistics. torch's batch-norm kernels take either one dtype
for everything or a 16-bit input with float32 weight, bias and statistics; the
parameter dtype is taken from the weight. With a 16-bit weight the CPU kernel reads the
float32 running mean as 16-bit and fails ("expected scalar type BFloat16 but found
Float"), in training and in eval.

These layers hand the kernel its weight and bias in the running statistics' dtype: a
16-bit input then meets float32 weight, bias and statistics, the layout the
mixed-precision kernels are written for (and the one ``torch.autocast`` produces, as
it leaves the module in float32). The statistics are accumulated in float32 and the
cast's gradient reaches the 16-bit parameters in their own dtype. When parameters and
statistics share a dtype nothing is cast, so float32 runs are unchanged bit for bit.
The state dict is that of ``nn.BatchNorm1d``/``nn.BatchNorm2d``.

While a checkpointed block is recomputed for backward
(:mod:`ds_pfc.models.checkpointing`) they normalise with the batch statistics and leave
the running statistics alone, so a checkpointed step updates them once.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .checkpointing import recomputing

__all__ = ["BatchNorm1d", "BatchNorm2d"]


class _StatsDtypeBatchNorm(nn.modules.batchnorm._BatchNorm):
    """``_BatchNorm.forward`` with weight and bias cast to the running statistics' dtype."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if self.training and recomputing() and self.running_mean is not None:
            # A checkpointed block replayed for backward: the same batch-statistics
            # normalisation as the first pass (the same op, so it saves the same
            # tensors for backward), its statistics update going to throwaway copies.
            return F.batch_norm(input, self.running_mean.clone(), self.running_var.clone(), *self._affine(), True,
                                0.0 if self.momentum is None else self.momentum, self.eps)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        # Batch statistics in training, and in eval when no running statistics exist;
        # running statistics are passed only where they are read or updated.
        use_batch_stats = self.training or (self.running_mean is None and self.running_var is None)
        tracked = not self.training or self.track_running_stats
        running_mean = self.running_mean if tracked else None
        running_var = self.running_var if tracked else None
        weight, bias = self._affine()
        return F.batch_norm(input, running_mean, running_var, weight, bias, use_batch_stats, factor, self.eps)

    def _affine(self):
        weight, bias = self.weight, self.bias
        stats_dtype = self.running_mean.dtype if self.running_mean is not None else None
        if stats_dtype is not None and weight is not None and weight.dtype != stats_dtype:
            weight, bias = weight.to(stats_dtype), bias.to(stats_dtype)
        return weight, bias


class BatchNorm1d(_StatsDtypeBatchNorm, nn.BatchNorm1d):
    """``nn.BatchNorm1d`` that also runs with 16-bit parameters and float32 statistics."""


class BatchNorm2d(_StatsDtypeBatchNorm, nn.BatchNorm2d):
    """``nn.BatchNorm2d`` that also runs with 16-bit parameters and float32 statistics."""
