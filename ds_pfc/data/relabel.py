"""Training on a label file: one label per image of a dataset, ``-1`` for an image to leave out.

``ds-pfc-clean`` writes such a file (``labels.txt``: the cleaned label of every training
image in dataset order); :func:`read_labels` reads and checks one, and
:class:`RelabelledDataset` is the dataset restricted to the images the file keeps, each
with its label from the file. Dropping is an index map, not a filter in the loader:
the kept images are numbered ``0 .. kept - 1`` in dataset order, so a sampler over
``len(RelabelledDataset)`` never draws a dropped image, and every rank, DataLoader
worker and resumed run, which all read the same file, sees the same numbering.
"""
from __future__ import annotations

import hashlib

import torch

__all__ = ["read_labels", "RelabelledDataset"]


def read_labels(path: str, num_images: int, *, name: str = "labels") -> tuple[torch.Tensor, str]:
    """``(labels int64 [num_images], sha256 hex of the file)``: one integer per line
    (surrounding whitespace and blank lines at the end allowed), ``-1`` or a class id
    >= 0. ``ValueError`` naming ``name`` for a file of another length than
    ``num_images``, a line that is no integer, a label below -1 or no kept image."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as err:
        raise ValueError(f"{name}: cannot read {path!r} ({err.strerror or err})") from None
    digest = hashlib.sha256(raw).hexdigest()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{name}: {path} is not a text file of one integer label per line") from None
    lines = text.splitlines()
    while lines and not lines[-1].strip():
        lines.pop()
    if len(lines) != num_images:
        raise ValueError(f"{name}: {path} has {len(lines)} labels but the training set has {num_images} images "
                         "(one label per image, in dataset order; was it written for another dataset, or for "
                         "the data before or after ds_pfc.data.stress?)")
    values = []
    for number, line in enumerate(lines, 1):
        item = line.strip()
        try:
            value = int(item)
        except ValueError:
            raise ValueError(f"{name}: {path} line {number} is {line!r}, not an integer label") from None
        if value < -1:
            raise ValueError(f"{name}: {path} line {number} is {value}; a label is a class id >= 0, or -1 for "
                             "an image left out")
        values.append(value)
    labels = torch.tensor(values, dtype=torch.int64)
    if num_images and not bool((labels >= 0).any()):
        raise ValueError(f"{name}: {path} leaves out every image (all labels are -1)")
    return labels, digest


class RelabelledDataset(torch.utils.data.Dataset):
    """The images of ``base`` whose label in ``labels`` is not ``-1``, in ``base``'s
    order, each with that label.

    Args:
        base: a dataset of ``(image, label)`` items (its ``get_batch`` or
            ``__getitems__`` serves batched fetches when it has one).
        labels: int64 ``[len(base)]``, ``-1`` or a class id >= 0 per image (see
            :func:`read_labels`).
        digest: what identifies the label file (its sha256), kept for checkpoints.
    """

    def __init__(self, base, labels: torch.Tensor, *, digest: str | None = None):
        if not isinstance(labels, torch.Tensor) or labels.dtype != torch.int64 or labels.dim() != 1:
            raise TypeError(f"labels must be an int64 tensor [len(base)], got {labels!r:.60}")
        if len(labels) != len(base):
            raise ValueError(f"labels must have one entry per image of base ({len(base)}), got {len(labels)}")
        if len(labels) and int(labels.min()) < -1:
            raise ValueError(f"labels must be -1 or >= 0, got {int(labels.min())}")
        self.base, self.digest = base, digest
        self._index = torch.nonzero(labels >= 0).view(-1)
        self._labels = labels[self._index]
        self._num_classes = int(self._labels.max()) + 1 if len(self._labels) else 0
        self.dropped = len(labels) - len(self._index)
        """Images of ``base`` left out (label ``-1``)."""

    @property
    def num_classes(self) -> int:
        """The largest label plus one."""
        return self._num_classes

    def __len__(self) -> int:
        return len(self._index)

    def labels(self) -> torch.Tensor:
        """int64 ``[len(self)]``: every kept image's label."""
        return self._labels.clone()

    def base_indices(self) -> torch.Tensor:
        """int64 ``[len(self)]``: the base dataset's index of every kept image."""
        return self._index.clone()

    def __getitem__(self, i: int):
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"index {i} out of range for a dataset of {n} images")
        image, _ = self.base[int(self._index[i])]
        return image, int(self._labels[i])

    def __getitems__(self, indices) -> list:
        """The kept images ``indices`` as ``(image, label)`` items, fetched through the
        base dataset's batched fetch when it has one. Items, not a stacked batch, so
        that encoded images stay encoded for the loader (``decode_on_device``)."""
        index = self._index[torch.as_tensor(indices, dtype=torch.int64)]
        labels = self._labels[torch.as_tensor(indices, dtype=torch.int64)].tolist()
        get_batch = getattr(self.base, "get_batch", None)
        if get_batch is not None:
            images = get_batch(index)[0]
        else:
            get_items = getattr(self.base, "__getitems__", None)
            items = get_items(index.tolist()) if get_items is not None else [self.base[i] for i in index.tolist()]
            images = [image for image, _ in items]
        return list(zip(images, labels))

    def __repr__(self) -> str:
        return (f"RelabelledDataset({type(self.base).__name__}: {len(self)}/{len(self.base)} "
                f"images kept, {self.num_classes} classes)")
