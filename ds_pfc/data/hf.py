"""Local image/label datasets through Hugging Face ``datasets`` (never the Hub).

:func:`load_image_dataset` accepts

- a directory written by ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk``
  (``split`` picks from a DatasetDict);
- a ``.parquet`` file, or a directory holding ``.parquet`` files (recursively);
- an image folder: one subdirectory per class, class id = index of the sorted
  subdirectory name (torchvision ``ImageFolder`` order, as insightface uses).

Image folders are listed here, not through ``load_dataset("imagefolder")`` (that
builder encodes every file with Pillow first). Items carry the file's encoded bytes,
decoded by the data loader's workers.

Image columns of type ``datasets.Image`` are read with ``decode=False`` likewise
(their bytes, or the file at their path); ``binary`` columns are bytes; any
other column (nested lists, ``Array3D``) becomes a tensor. Pass ``decode`` to turn
bytes into tensors (see :mod:`ds_pfc.data.transforms`).
"""
from __future__ import annotations

import os
from typing import Callable

import torch

__all__ = ["load_image_dataset", "HFImageDataset", "ImageFolderBytes", "IMAGE_EXTENSIONS"]

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".ppm", ".pgm", ".tif", ".tiff")
_IMAGE_NAMES = ("image", "img", "images", "jpg", "png", "pixel_values")
_LABEL_NAMES = ("label", "labels", "class", "class_id", "identity", "id_label")


def _check_labels(labels: torch.Tensor, where: str) -> torch.Tensor:
    if labels.numel() and (labels.is_floating_point() or labels.is_complex()):
        if not torch.equal(labels, labels.round()):
            raise ValueError(f"{where}: labels must be integer class ids, found non-integer values")
    labels = labels.to(torch.int64)
    if labels.numel() and int(labels.min()) < 0:
        raise ValueError(f"{where}: labels must be >= 0, found {int(labels.min())}")
    return labels


class HFImageDataset(torch.utils.data.Dataset):
    """Map-style ``(image, int label)`` view of a ``datasets.Dataset``."""

    def __init__(self, ds, *, image_column: str | None = None, label_column: str | None = None,
                 decode: Callable[[bytes], object] | None = None, where: str = "dataset"):
        import datasets

        if decode is not None and not callable(decode):
            raise TypeError(f"decode must be a callable taking bytes or None, got {type(decode).__name__}")
        self.where = where
        features = ds.features
        self.image_column = _pick_column(
            "image_column", image_column, features,
            lambda n, f: isinstance(f, datasets.Image) or (isinstance(f, datasets.Value) and f.dtype in ("binary", "large_binary"))
            or n.lower() in _IMAGE_NAMES, where)
        self.label_column = _pick_column(
            "label_column", label_column, features,
            lambda n, f: n != self.image_column and (isinstance(f, datasets.ClassLabel) or n.lower() in _LABEL_NAMES),
            where)
        if self.image_column == self.label_column:
            raise ValueError(f"{where}: image_column and label_column are both {self.image_column!r}")
        ds = ds.select_columns([self.image_column, self.label_column])
        image_feature = features[self.image_column]
        self._image_is_file = isinstance(image_feature, datasets.Image)
        if self._image_is_file:
            ds = ds.cast_column(self.image_column, datasets.Image(decode=False))
        label_feature = features[self.label_column]
        self._class_label = label_feature if isinstance(label_feature, datasets.ClassLabel) else None
        self._ds = ds
        self.decode = decode
        self._labels: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self._ds)

    def __getitem__(self, index: int):
        if not -len(self) <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} items")
        row = self._ds[int(index)]
        image = row[self.image_column]
        if self._image_is_file:
            data = image.get("bytes")
            if data is None:
                with open(image["path"], "rb") as f:
                    data = f.read()
            image = data
        if isinstance(image, (bytes, bytearray)):
            image = self.decode(bytes(image)) if self.decode is not None else bytes(image)
        else:
            image = torch.as_tensor(image)
        label = row[self.label_column]
        if isinstance(label, float) and label != int(label) or int(label) < 0:
            raise ValueError(f"{self.where}: item {index} has label {label!r}, not a class id >= 0")
        return image, int(label)

    def labels(self) -> torch.Tensor:
        """Every item's class id, int64 ``[len(self)]``, read from the label column only."""
        if self._labels is None:
            column = self._ds.select_columns([self.label_column]).with_format("numpy")[self.label_column]
            self._labels = _check_labels(torch.as_tensor(column), self.where)
        return self._labels

    @property
    def num_classes(self) -> int:
        """``ClassLabel.num_classes`` when the column has one, else ``max(label) + 1``."""
        if self._class_label is not None:
            return self._class_label.num_classes
        labels = self.labels()
        return int(labels.max()) + 1 if len(labels) else 0


class ImageFolderBytes(torch.utils.data.Dataset):
    """``root/<class>/<...>/<file>``: encoded bytes (or ``decode(bytes)``) and the index
    of ``<class>`` among the sorted subdirectory names. Files are found recursively,
    keep only :data:`IMAGE_EXTENSIONS` (case-insensitive) and are sorted per class."""

    def __init__(self, root: str | os.PathLike, decode: Callable[[bytes], object] | None = None):
        self.root = os.fspath(root)
        self.classes = sorted(e.name for e in os.scandir(self.root) if e.is_dir() and not e.name.startswith("."))
        if not self.classes:
            raise ValueError(f"{self.root!r} has no class subdirectories (nor save_to_disk or parquet files)")
        self.paths: list[str] = []
        labels: list[int] = []
        for class_id, name in enumerate(self.classes):
            found = []
            for dirpath, dirnames, filenames in os.walk(os.path.join(self.root, name)):
                dirnames.sort()
                found += [os.path.join(dirpath, f) for f in filenames if f.lower().endswith(IMAGE_EXTENSIONS)]
            self.paths += sorted(found)
            labels += [class_id] * len(found)
        if not self.paths:
            raise ValueError(f"{self.root!r}: class subdirectories hold no files ending in {IMAGE_EXTENSIONS}")
        self._labels = torch.tensor(labels, dtype=torch.int64)
        self.decode = decode

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int):
        with open(self.paths[index], "rb") as f:
            data = f.read()
        return (self.decode(data) if self.decode is not None else data), int(self._labels[index])

    def labels(self) -> torch.Tensor:
        return self._labels

    @property
    def num_classes(self) -> int:
        return len(self.classes)


def _pick_column(arg: str, given: str | None, features, is_candidate, where: str) -> str:
    names = list(features)
    if given is not None:
        if given not in features:
            raise ValueError(f"{where}: {arg}={given!r} is not a column; available: {names}")
        return given
    found = [n for n in names if is_candidate(n, features[n])]
    if len(found) == 1:
        return found[0]
    if not found:
        raise ValueError(f"{where}: cannot infer {arg}: no candidate column; pass {arg}= one of {names}")
    raise ValueError(f"{where}: {arg} is ambiguous between {found}; pass {arg}= one of {names}")


def _parquet_files(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path] if path.endswith(".parquet") else []
    out = []
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames.sort()
        out += [os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".parquet")]
    return out


def load_image_dataset(path_or_dir: str | os.PathLike, *, split: str = "train", image_column: str | None = None,
                       label_column: str | None = None, decode: Callable[[bytes], object] | None = None,
                       cache_dir: str | os.PathLike | None = None):
    """Open a local dataset (see module docstring) as a map-style torch Dataset of
    ``(image, int label)`` with ``num_classes`` and ``labels()``.

    ``image_column``/``label_column`` default to the single column that looks like one
    (``Image``/binary type or a usual name; ``ClassLabel`` or a usual name); none or
    several is a ValueError naming the available columns. ``cache_dir`` is where
    ``datasets`` writes its Arrow cache for parquet input (its default otherwise).
    ``split`` only applies to a saved ``DatasetDict``; parquet files and image folders
    are one split each.
    """
    path = os.fspath(path_or_dir)
    if not os.path.exists(path):
        raise FileNotFoundError(f"dataset path not found: {path!r}")
    if os.path.isdir(path) and (os.path.isfile(os.path.join(path, "dataset_dict.json"))
                                or os.path.isfile(os.path.join(path, "state.json"))):
        import datasets

        ds = datasets.load_from_disk(path)
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise ValueError(f"{path!r}: split={split!r} not found; available splits: {list(ds)}")
            ds = ds[split]
        return HFImageDataset(ds, image_column=image_column, label_column=label_column, decode=decode, where=path)
    files = _parquet_files(path)
    if files:
        import datasets

        ds = datasets.Dataset.from_parquet(files, cache_dir=None if cache_dir is None else os.fspath(cache_dir))
        return HFImageDataset(ds, image_column=image_column, label_column=label_column, decode=decode, where=path)
    if os.path.isfile(path):
        raise ValueError(f"{path!r} is a file but not .parquet; expected a save_to_disk directory, parquet, "
                         f"or an image folder")
    if image_column is not None or label_column is not None:
        raise ValueError(f"{path!r} is an image folder: image_column/label_column do not apply")
    return ImageFolderBytes(path, decode=decode)
