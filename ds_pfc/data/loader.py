"""Micro batches for one rank, prepared ahead by background worker processes.

The loader walks a :class:`~ds_pfc.data.sampler.DistributedIdentitySampler` from its
current position in micro batches of ``block_size`` samples, fetches them (a
dataset's batched ``get_batch(indices)`` when it has one, else ``dataset[i]`` per
item with decoding of encoded images), flips and normalises, and hands out
``(images float32 [m, 3, H, W] in [-1, 1], labels int64 [m])``. The flip of sample
``i`` in epoch ``e`` is a pure function of ``(seed, e, i)``, like the order itself,
so a resumed or re-sharded run sees exactly the same inputs.

With ``decode_on_device=True`` the workers leave JPEG payloads encoded (uint8 1-D
tensors, other formats they still decode) and pass each micro batch's flip mask
along; the training process decodes the batch on ``device`` in one
:func:`~ds_pfc.data.transforms.decode_jpeg_batch` call, then flips with that mask
and normalises as the workers would have.

The training loop tells the sampler what it consumed (``sampler.advance``); the
loader only reads ahead, so its look-ahead never counts as trained.
"""
from __future__ import annotations

import os
from typing import Iterator, Mapping

import torch

from .sampler import DistributedIdentitySampler, epoch_seed
from . import transforms
from .transforms import decode_image, is_jpeg, normalize

__all__ = ["MicroBatchLoader", "flip_mask", "default_workers"]

_MIX = 0x9E3779B97F4A7C15 - (1 << 64)   # as a signed int64


def flip_mask(indices: torch.Tensor, seed: int, epoch: int) -> torch.Tensor:
    """bool ``[len(indices)]``: whether sample ``i`` is flipped in ``epoch`` (a
    splitmix64-style hash of ``(seed, epoch, i)``, about half of them)."""
    z = indices.to(torch.int64) * _MIX + (epoch_seed(seed, epoch) - (1 << 62))
    z = (z ^ (z >> 31)) * (0xBF58476D1CE4E5B9 - (1 << 64))
    z = z ^ (z >> 29)
    return (z & (1 << 20)) != 0


def default_workers(environ: Mapping[str, str] | None = None, cpus: int | None = None) -> int:
    """Worker processes per rank when ``workers="auto"``: the CPUs this process may run
    on, shared by the ranks of this machine (``LOCAL_WORLD_SIZE`` from torchrun,
    ``LOCAL_SIZE`` from the deepspeed launcher, else 1), less one for the training
    process itself; at least 1, at most 8 (decoding 112x112 JPEGs, 8 workers feed
    several thousand images/s)."""
    environ = os.environ if environ is None else environ
    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    local = 1
    for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        try:
            local = max(1, int(environ.get(name, "")))
            break
        except ValueError:
            continue
    return max(1, min(8, cpus // local - 1))


def _fetch(dataset, indices: torch.Tensor, keep_jpeg: bool = False):
    """``(images uint8/float [m, 3, H, W], labels int64 [m])``; with ``keep_jpeg`` the
    images are a list whose JPEG items stay encoded (uint8 1-D tensors)."""
    get_batch = getattr(dataset, "get_batch", None)
    if get_batch is not None:
        return get_batch(indices)
    get_items = getattr(dataset, "__getitems__", None)       # batched rendering (SyntheticFaces)
    items = get_items(indices.tolist()) if get_items is not None else (dataset[i] for i in indices.tolist())
    images, labels = [], []
    for image, label in items:
        if isinstance(image, (bytes, bytearray, memoryview)):
            if keep_jpeg and is_jpeg(image):
                image = torch.frombuffer(bytearray(image), dtype=torch.uint8)
            else:
                image = decode_image(image)
        images.append(torch.as_tensor(image))
        labels.append(int(label))
    labels = torch.tensor(labels, dtype=torch.int64)
    if keep_jpeg:
        return images, labels
    return _stack(images), labels


def _stack(images: list[torch.Tensor]) -> torch.Tensor:
    shapes = {tuple(t.shape) for t in images}
    if len(shapes) > 1:
        raise ValueError(f"images of one batch differ in shape {sorted(shapes)}; the data must be aligned "
                         "faces of one size (insightface: 112x112)")
    return torch.stack(images)


def _decode_on(images, mask, device) -> torch.Tensor:
    """The training-process half of ``decode_on_device``: decode the JPEG items of a
    worker's list on ``device``, stack, flip with the worker's mask, normalise."""
    if isinstance(images, torch.Tensor):
        batch = images.to(device)
    else:
        jpegs = [i for i, t in enumerate(images) if t.dim() == 1]
        decoded = transforms.decode_jpeg_batch([images[i] for i in jpegs], device) if jpegs else []
        out = [t.to(device) for t in images]
        for i, image in zip(jpegs, decoded):
            if not (isinstance(image, torch.Tensor) and image.dtype == torch.uint8 and image.dim() == 3
                    and image.shape[0] == 3):
                raise ValueError(f"the device JPEG decoder must return uint8 [3, H, W] tensors, got {image!r:.80}")
            out[i] = image.to(device)
        batch = _stack(out)
    if mask is not None:
        batch = torch.where(mask.to(device).view(-1, 1, 1, 1), batch.flip(-1), batch)
    return normalize(batch)


class _MicroBatches(torch.utils.data.Dataset):
    """Micro batch ``i`` of an epoch's order: fetched, flipped, normalised."""

    def __init__(self, dataset, order: torch.Tensor, micro_batch: int, flip: bool, seed: int, epoch: int,
                 keep_jpeg: bool = False):
        self.dataset, self.order, self.m = dataset, order, micro_batch
        self.flip, self.seed, self.epoch, self.keep_jpeg = flip, seed, epoch, keep_jpeg

    def __len__(self) -> int:
        return len(self.order) // self.m

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = self.order[i * self.m:(i + 1) * self.m]
        if self.keep_jpeg:
            images, labels = _fetch(self.dataset, idx, keep_jpeg=True)
            return images, labels, (flip_mask(idx, self.seed, self.epoch) if self.flip else None)
        images, labels = _fetch(self.dataset, idx)
        if self.flip:
            mask = flip_mask(idx, self.seed, self.epoch).view(-1, 1, 1, 1)
            images = torch.where(mask, images.flip(-1), images)
        return normalize(images), labels


class MicroBatchLoader:
    """Iterate the rest of the sampler's current epoch in micro batches.

    Args:
        dataset: items ``(image, label)``; image uint8/float ``[3, H, W]`` in pixel
            units or encoded bytes; or a ``get_batch(indices) -> (uint8 [m, 3, H, W],
            int64 [m])`` method; a ``__getitems__(indices)`` (the DataLoader's batched
            fetch) is used when there is no ``get_batch``.
        sampler: this rank's sampler; its ``block_size`` is the micro batch.
        flip: random horizontal flip (see :func:`flip_mask`).
        workers: background worker processes preparing micro batches (0: in the
            training process, no look-ahead; ``"auto"``: :func:`default_workers`). Processes, not threads: decoding or
            rendering then never competes with the training thread's intra-op
            threads, and a worker's result does not depend on timing.
        prefetch: micro batches each worker prepares ahead.
        device, dtype: where and as what the images are delivered (labels stay
            int64 on ``device``). CUDA copies go through pinned memory, non-blocking.
        decode_on_device: workers hand JPEG items over encoded and the training
            process decodes each micro batch on ``device`` with
            :func:`~ds_pfc.data.transforms.decode_jpeg_batch` (``torchvision.io.decode_jpeg``;
            nvJPEG on CUDA). Flips and normalisation are the same as without it.
    """

    def __init__(self, dataset, sampler: DistributedIdentitySampler, *, flip: bool = True, seed: int = 0,
                 workers: int | str = "auto", prefetch: int = 2, device=None, dtype: torch.dtype = torch.float32,
                 decode_on_device: bool = False):
        if not isinstance(sampler, DistributedIdentitySampler):
            raise TypeError(f"sampler must be a DistributedIdentitySampler, got {type(sampler).__name__}")
        if workers == "auto":
            workers = default_workers()
        for name, value, low in (("workers", workers, 0), ("prefetch", prefetch, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        self.dataset, self.sampler = dataset, sampler
        self.flip, self.seed, self.workers, self.prefetch = bool(flip), seed, workers, prefetch
        self.device = torch.device("cpu" if device is None else device)
        self.dtype = dtype
        self.decode_on_device = bool(decode_on_device)
        self.micro_batch = sampler.block_size

    def __len__(self) -> int:
        """Micro batches left in the sampler's current epoch."""
        return len(self.sampler) // self.micro_batch

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        order = self.sampler.shard()[self.sampler.consumed:]
        batches = _MicroBatches(self.dataset, order, self.micro_batch, self.flip, self.seed, self.sampler.epoch,
                               keep_jpeg=self.decode_on_device)
        cuda = self.device.type == "cuda"
        loader = torch.utils.data.DataLoader(
            batches, batch_size=None, shuffle=False, num_workers=self.workers, pin_memory=cuda,
            prefetch_factor=self.prefetch if self.workers else None,
            multiprocessing_context="fork" if self.workers and "fork" in _start_methods() else None)
        if self.decode_on_device:
            for images, labels, mask in loader:
                yield (_decode_on(images, mask, self.device).to(self.dtype), labels.to(self.device, non_blocking=cuda))
            return
        for images, labels in loader:
            yield (images.to(self.device, self.dtype, non_blocking=cuda), labels.to(self.device, non_blocking=cuda))


def _start_methods() -> list[str]:
    import multiprocessing
    return multiprocessing.get_all_start_methods()
