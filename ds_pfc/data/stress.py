"""Stress transforms for training data: label flips, inter-class conflicts, long tails.

The paper's robustness study (WebFace ablations) corrupts clean training sets in three
ways; :class:`StressedDataset` applies the same corruptions to any labelled dataset
(synthetic faces, RecordIO, Hugging Face, image folders), deterministically from a
seed, without touching the images:

- ``long_tail``: a random fraction (``long_tail``) of the identities, the tail, each
  keeps a random number of its images drawn from ``tail_images`` (inclusive range,
  default 2-4); the other identities keep all theirs. The paper keeps 200K of
  WebFace42M's 2M identities whole and reduces the other 1.8M to two to four images
  (``long_tail=0.9``).
- ``conflict``: a random ``fraction`` of the identities are each split into
  ``splits`` pseudo-classes, their images dealt round-robin (after a shuffle) so the
  pseudo-classes are as even as the image count allows; an identity with fewer images
  than ``splits`` gets one pseudo-class per image. Every pseudo-class is a negative for
  the images of its siblings: the paper's inter-class conflict (WebFace12M-Conflict
  splits 200K of 600K identities into 600K pseudo-classes: ``fraction=1/3``,
  ``splits=3``).
- ``label_flip``: exactly ``round(label_flip * len)`` samples, chosen uniformly, get
  a label drawn uniformly from the *other* classes (the paper's "flip" noise: a
  fraction of the image labels randomly replaced).

They compose in that order: the tail subsets images, the conflict renumbers classes,
the flips replace labels of the result. Class ids are renumbered only by
``conflict``: identity ``c`` becomes the pseudo-classes ``offset[c] ..
offset[c] + k_c - 1`` in identity order, so without conflict every label is kept.

Held-out evaluation data is never wrapped: only the training set is stressed.

Everything is a pure function of ``(seed, the base dataset's labels)``: every rank,
DataLoader worker and resumed run sees the same corrupted set.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import torch

from .._checks import check_int

__all__ = ["StressedDataset", "StressSummary"]


@dataclasses.dataclass(frozen=True)
class StressSummary:
    """What a :class:`StressedDataset` changed (for logs and experiment records)."""

    base_images: int
    base_classes: int
    images: int
    """Images kept (``long_tail`` removes some)."""
    classes: int
    """Classes after ``conflict`` (pseudo-classes count separately)."""
    tail_identities: int
    """Identities reduced to a few images."""
    split_identities: int
    """Identities split into several pseudo-classes."""
    flipped: int
    """Samples whose label was replaced by another class."""

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _check_fraction(name: str, value, *, high_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TypeError(f"{name} must be a number in [0, 1], got {value!r}")
    if not 0.0 <= value <= 1.0 or (high_open and value == 1.0):
        raise ValueError(f"{name} must be in [0, 1{')' if high_open else ']'}, got {value!r}")
    return float(value)


class StressedDataset(torch.utils.data.Dataset):
    """A labelled dataset with its training labels corrupted (see the module docstring).

    Args:
        base: a dataset of ``(image, label)`` items with ``labels() -> int64 [len]``
            (every dataset of :mod:`ds_pfc.data` has it).
        label_flip: fraction of samples in [0, 1) whose label is replaced.
        conflict: fraction of identities in [0, 1] split into pseudo-classes.
        conflict_splits: pseudo-classes per split identity, >= 2.
        long_tail: fraction of identities in [0, 1] reduced to a few images (``None``
            or 0: off). The rest keep all their images.
        tail_images: ``(low, high)`` images kept per tail identity, inclusive, >= 1.
        seed: any int; the corruption is a pure function of it and the base labels.
    """

    def __init__(self, base, *, label_flip: float = 0.0, conflict: float = 0.0, conflict_splits: int = 3,
                 long_tail: float | None = None, tail_images: Sequence[int] = (2, 4), seed: int = 0):
        if not hasattr(base, "labels") or not callable(base.labels):
            raise TypeError(f"base must be a dataset with a labels() method, got {type(base).__name__}")
        label_flip = _check_fraction("label_flip", label_flip, high_open=True)
        conflict = _check_fraction("conflict", conflict)
        conflict_splits = check_int("conflict_splits", conflict_splits, 2)
        long_tail = 0.0 if long_tail is None else _check_fraction("long_tail", long_tail)
        if (not isinstance(tail_images, (list, tuple)) or len(tail_images) != 2
                or any(isinstance(v, bool) or not isinstance(v, int) for v in tail_images)
                or not 1 <= tail_images[0] <= tail_images[1]):
            raise ValueError(f"tail_images must be two ints (low, high) with 1 <= low <= high, got {tail_images!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {type(seed).__name__} {seed!r}")
        base_labels = torch.as_tensor(base.labels(), dtype=torch.int64)
        if base_labels.dim() != 1 or len(base_labels) != len(base):
            raise ValueError(f"base.labels() must be int64 [{len(base)}], got shape {tuple(base_labels.shape)}")
        if len(base_labels) and int(base_labels.min()) < 0:
            raise ValueError("base.labels() holds negative class ids")
        self.base = base
        self.settings = {"label_flip": label_flip, "conflict": conflict, "conflict_splits": conflict_splits,
                         "long_tail": long_tail, "tail_images": list(tail_images), "seed": seed}
        num_base = int(base_labels.max()) + 1 if len(base_labels) else 0
        gen = torch.Generator().manual_seed(seed)

        # long tail: which images survive
        index = torch.arange(len(base_labels))
        order = torch.argsort(base_labels, stable=True)          # images grouped by identity, in index order
        counts = torch.bincount(base_labels, minlength=num_base)
        tail = torch.zeros(num_base, dtype=torch.bool)
        if long_tail > 0:
            tail[torch.randperm(num_base, generator=gen)[:round(long_tail * num_base)]] = True
            low, high = tail_images
            keep_n = torch.randint(low, high + 1, (num_base,), generator=gen)
            keep = torch.ones(len(base_labels), dtype=torch.bool)
            rank_in_class = _rank_within_groups(base_labels[order], torch.rand(len(order), generator=gen))
            kept_sorted = ~tail[base_labels[order]] | (rank_in_class < keep_n[base_labels[order]])
            keep[order] = kept_sorted
            index = index[keep]
        labels = base_labels[index]

        # conflict: split identities into pseudo-classes
        present = torch.bincount(labels, minlength=num_base)
        split = torch.zeros(num_base, dtype=torch.bool)
        if conflict > 0:
            split[torch.randperm(num_base, generator=gen)[:round(conflict * num_base)]] = True
        pieces = torch.where(split, present.clamp(min=1).clamp(max=conflict_splits), torch.ones_like(present))
        offset = torch.cumsum(pieces, 0) - pieces
        if conflict > 0:
            within = torch.argsort(labels, stable=True)
            slot = _rank_within_groups(labels[within], torch.rand(len(within), generator=gen))
            piece = torch.zeros_like(labels)
            piece[within] = slot % pieces[labels[within]]
            labels = offset[labels] + piece
        else:
            labels = offset[labels]
        num_classes = int(pieces.sum())

        # label flips: a uniformly chosen other class
        true_labels = labels
        flipped = round(label_flip * len(labels))
        if flipped and num_classes < 2:
            raise ValueError("label_flip needs at least 2 classes")
        if flipped:
            which = torch.randperm(len(labels), generator=gen)[:flipped]
            shift = torch.randint(1, num_classes, (flipped,), generator=gen)
            labels = labels.clone()
            labels[which] = (labels[which] + shift) % num_classes

        self._index, self._labels, self._num_classes = index, labels, num_classes
        self._true_labels = true_labels
        self.summary = StressSummary(base_images=len(base_labels), base_classes=num_base, images=len(index),
                                     classes=num_classes, tail_identities=int((tail & (counts > 0)).sum()),
                                     split_identities=int((split & (pieces > 1)).sum()), flipped=flipped)

    @property
    def num_classes(self) -> int:
        return self._num_classes

    def __len__(self) -> int:
        return len(self._index)

    def labels(self) -> torch.Tensor:
        """int64 ``[len(self)]``: the corrupted training label of every item."""
        return self._labels.clone()

    def true_labels(self) -> torch.Tensor:
        """int64 ``[len(self)]``: every item's label before ``label_flip`` (after
        ``conflict`` renumbering). A flip always changes the label, so the flipped items
        are exactly those where it differs from :meth:`labels`."""
        return self._true_labels.clone()

    def base_indices(self) -> torch.Tensor:
        """int64 ``[len(self)]``: the base dataset's index of every item."""
        return self._index.clone()

    def __getitem__(self, i: int):
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"index {i} out of range for a dataset of {n} images")
        image, _ = self.base[int(self._index[i])]
        return image, int(self._labels[i])

    def get_batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(uint8 images [m, 3, H, W], int64 labels [m])``: the base dataset's
        batched fetch (``get_batch`` or ``__getitems__`` when it has one) with the
        corrupted labels."""
        from .loader import _fetch
        indices = torch.as_tensor(indices, dtype=torch.int64)
        images, _ = _fetch(self.base, self._index[indices])
        return images, self._labels[indices]

    def __repr__(self) -> str:
        s = self.summary
        return (f"StressedDataset({type(self.base).__name__}: {s.images}/{s.base_images} images, "
                f"{s.classes} classes from {s.base_classes}; {s.tail_identities} tail identities, "
                f"{s.split_identities} split, {s.flipped} labels flipped; seed {self.settings['seed']})")


def _rank_within_groups(groups_sorted: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """For items sorted by group, each item's rank within its group when the group is
    ordered by ``keys`` (a random permutation within every group)."""
    if len(groups_sorted) == 0:
        return groups_sorted.clone()
    # sort by (group, key): keys in [0, 1), groups are integers
    order = torch.argsort(groups_sorted.to(torch.float64) + keys.to(torch.float64) * 0.5, stable=True)
    starts = torch.ones_like(groups_sorted, dtype=torch.bool)
    starts[1:] = groups_sorted[1:] != groups_sorted[:-1]
    first = torch.cummax(torch.where(starts, torch.arange(len(starts)), torch.zeros_like(groups_sorted)), 0).values
    rank = torch.empty_like(groups_sorted)
    rank[order] = torch.arange(len(order)) - first
    return rank
