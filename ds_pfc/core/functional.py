"""Functional entry point: margin softmax cross-entropy against an explicit shard."""
from __future__ import annotations

from typing import NamedTuple

import torch

from . import collectives
from .._checks import check_embeddings, check_labels, check_values
from .margins import Margin
from .softmax import check_block_bytes, check_keep_bytes, default_compute_dtype, margin_softmax_cross_entropy, resolve_backend

__all__ = ["margin_cross_entropy", "CrossEntropyOutput"]


class CrossEntropyOutput(NamedTuple):
    loss: torch.Tensor             # scalar: mean over the global batch
    per_sample_loss: torch.Tensor  # [N] losses of this rank's own samples
    accuracy: torch.Tensor         # scalar: top-1 over the active set, global batch


def margin_cross_entropy(
    embeddings: torch.Tensor,
    labels: torch.Tensor,
    centers: torch.Tensor,
    *,
    margin: Margin,
    filter_threshold: float | None = None,
    group=None,
    batch_group=None,
    class_start: int = 0,
    compute_dtype: torch.dtype | None = None,
    return_details: bool = False,
    block_bytes: int | None = None,
    backend: str = "auto",
    validate: bool = True,
    update_state: bool | None = None,
    sub_centers: int = 1,
    keep_bytes: int | None = None,
):
    """Exact margin softmax cross-entropy with class-sharded centers.

    ``embeddings [N, d]`` and ``labels [N]`` are this rank's samples; they are gathered
    across ``batch_group`` here (None: ``group``). With a ``batch_group`` smaller than
    ``group`` (tensor parallelism: ``group`` = TP x DP, ``batch_group`` = DP), the
    ranks at the same position of their batch groups pass identical samples and each
    gets the gradient summed over the whole ``group``. ``centers [C_q, d]`` is this rank's shard, whose row ``i`` is
    global class ``class_start + i``; the shards of all ranks must tile ``[0, C)``.
    Differentiable with respect to ``embeddings`` and ``centers``. The loss is the mean
    over the global batch, and the gradient with respect to ``embeddings`` is that of
    this global mean (no data-parallel factor is applied here).

    ``filter_threshold=tau`` removes from sample n's denominator every negative whose
    unmargined cosine exceeds tau (PFC*). ``compute_dtype`` (bf16/fp16) runs the matrix
    products in reduced precision with float32 accumulation.

    ``block_bytes``: bytes of float32 logits computed per class block (None: 256 MiB
    on CUDA, 2 MiB on CPU). When the whole ``N x S`` logits exceed one block, backward
    recomputes them block by block instead of keeping them, up to ``keep_bytes`` (None:
    ``block_bytes`` when given, else 256 MiB of logits for torch and, for triton, half the
    device memory free at the forward on CUDA (4 GiB elsewhere) of cosines, float16 for
    bf16/fp16 products; 0: never keep). ``backend``: ``"auto"``
    (the fused Triton kernels on CUDA when triton imports, else ``"torch"``),
    ``"torch"`` or ``"triton"`` (CPU tensors only under ``TRITON_INTERPRET=1``).

    ``validate``: check the values (NaN/Inf embeddings, label ownership) with a host
    sync and a readable ``ValueError``; False checks ownership on the device only
    (``torch._assert_async``), so the call never waits for the device.

    ``sub_centers=K`` (sub-center ArcFace): ``centers`` holds ``K`` rows per class,
    row ``i K + k`` the k-th sub-center of class ``class_start + i``; a class's cosine
    is the largest of its sub-centers'. ``update_state``: whether a stateful margin (AdaFace, CurricularFace, ElasticFace)
    advances its running state with this batch (None: when gradients are enabled).
    Returns the loss, or with ``return_details=True`` a :class:`CrossEntropyOutput`.
    """
    try:
        if not isinstance(margin, Margin):
            raise TypeError(f"margin must be a ds_pfc Margin (ArcFace, CosFace, CombinedMargin, AdaFace, MagFace, "
                            f"CurricularFace, ElasticArcFace, ElasticCosFace), got {margin!r}")
        check_embeddings(embeddings)
        check_labels(labels, embeddings.shape[0])
        check_embeddings(centers, embeddings.shape[1], name="centers")
        if isinstance(sub_centers, bool) or not isinstance(sub_centers, int) or sub_centers < 1:
            raise ValueError(f"sub_centers must be a positive int, got {sub_centers!r}")
        if centers.shape[0] % sub_centers:
            raise ValueError(f"centers must have a multiple of sub_centers={sub_centers} rows (K rows per class), "
                             f"got {centers.shape[0]}")
        if isinstance(class_start, bool) or not isinstance(class_start, int) or class_start < 0:
            raise ValueError(f"class_start must be a non-negative int, got {class_start!r}")
        check_filter_threshold(filter_threshold)
        check_block_bytes(block_bytes)
        check_keep_bytes(keep_bytes)
        acc = torch.float64 if torch.float64 in (embeddings.dtype, centers.dtype) else torch.float32
        resolve_backend(backend, embeddings.device, compute_dtype or default_compute_dtype(embeddings.device, acc),
                        acc, margin)
        if validate:
            check_values(embeddings, labels, None)
        error = None
    except (TypeError, ValueError) as err:
        error = err
    device = embeddings.device if isinstance(embeddings, torch.Tensor) else None
    rows = embeddings.shape[0] if error is None else 0
    if batch_group is None or batch_group is group:
        sizes = collectives.gather_sizes(rows, group, device, error, what="embeddings/labels")
        x, y, sizes = collectives.all_gather_batch(embeddings, labels.long(), group, sizes)
        me = collectives.rank(group)
    else:
        from ..devices import collective_device
        small = collective_device(group, device)
        layout = collectives.batch_layout(group, batch_group, small)
        sizes = collectives.gather_batch_sizes(rows, group, layout, device, error, what="embeddings/labels")
        x, y, sizes = collectives.all_gather_batch_2d(embeddings, labels.long(), layout, sizes)
        if validate:
            collectives.check_same_labels(y, group, small)
        me = layout.batch_rank
    if x.shape[0] == 0:
        raise ValueError("embeddings: the global batch is empty (every rank passed 0 rows)")
    local = y.long() - class_start
    owned = (local >= 0) & (local < centers.shape[0] // sub_centers)
    target_col = torch.where(owned, local, torch.full_like(local, -1))
    result = margin_softmax_cross_entropy(
        x, centers, target_col, margin,
        filter_threshold=filter_threshold, group=group, compute_dtype=compute_dtype,
        return_correct=return_details, block_bytes=block_bytes, backend=backend, validate=validate,
        update_state=torch.is_grad_enabled() if update_state is None else bool(update_state),
        sub_centers=sub_centers, keep_bytes=keep_bytes)
    if not return_details:
        return result.loss
    offset = sum(sizes[:me])
    return CrossEntropyOutput(result.loss, result.per_sample[offset: offset + sizes[me]],
                              result.correct.mean())


def check_filter_threshold(value) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not -1.0 <= value <= 1.0:
        raise ValueError(f"filter_threshold must be None or a cosine in [-1, 1], got {value!r}")
