"""Insightface RecordIO (``.rec`` + ``.idx``) read directly, without MXNet.

Format (dmlc-core ``recordio.h``; notes/insightface.md 4.1), written here from the
description, not from MXNet's code:

- ``.idx`` is text, one ``key<TAB>byte_offset`` line per logical record; the offset
  points at the record's first magic word.
- A physical record is ``uint32 magic = 0xCED7230A``, ``uint32 lrec``, ``length``
  payload bytes, zero padding up to a 4-byte boundary (all little-endian), with
  ``length = lrec & (2**29 - 1)`` and ``cflag = lrec >> 29``.
- ``cflag`` 0 is a whole record. The writer cuts a payload wherever the magic word
  appears at a 4-byte-aligned offset and drops those four bytes: the parts carry
  ``cflag`` 1 (first), 2 (middle), 3 (last), and the reader joins them with the
  magic word put back between them.
- A payload starts with an ``IRHeader`` (``'IfQQ'``: uint32 flag, float32 label,
  uint64 id, uint64 id2; 24 bytes). When ``flag > 0``, ``flag`` float32 labels follow
  and stand for the label; the rest of the payload is the encoded image.

Insightface layout (:class:`InsightFaceRecord`): record 0 is a header with
``flag = 2``, label ``[A, B]`` and an empty payload; image records are keys
``1 .. A-1``, identity records ``A .. B-1`` (one per class, empty payload), and a
``property`` text file beside the ``.rec`` holds ``num_classes,h,w``. Recs made by
``im2rec`` have no header and every key is an image; with ``--pack-label`` their
record 0 may also have ``flag = 2`` and two integer labels, but it carries the image,
which a header never does.

Nothing here decodes images: there is no image library among the dependencies, so
items carry the encoded bytes unless the caller passes ``decode``.
"""
from __future__ import annotations

import math
import os
import struct
import threading
import warnings
from typing import Callable, Sequence

import torch

__all__ = ["MAGIC", "IR_HEADER_SIZE", "RecordIOReader", "unpack_header", "InsightFaceRecord"]

MAGIC = 0xCED7230A
# dmlc-core before 2015 used this magic with a 30-bit length; named only to say so.
_OLD_MAGIC = 0x3ED7230A
_MAGIC_BYTES = struct.pack("<I", MAGIC)
_LENGTH_MASK = (1 << 29) - 1
_IR_FORMAT = struct.Struct("<IfQQ")
IR_HEADER_SIZE = _IR_FORMAT.size  # 24
# First read of a record in labels(): record header + IRHeader + up to 10 labels,
# enough for every layout seen in practice without touching the image bytes.
_PREFIX_READ = 8 + IR_HEADER_SIZE + 4 * 10


class RecordIOReader:
    """Random access to the logical records of a ``.rec`` file through its ``.idx``.

    ``idx_path`` defaults to ``rec_path`` with its extension replaced by ``.idx``.
    Reads use ``os.pread`` on a descriptor opened lazily per process, so one reader
    can be shared by threads and by forked or spawned DataLoader workers.
    """

    def __init__(self, rec_path: str | os.PathLike, idx_path: str | os.PathLike | None = None):
        self.rec_path = os.fspath(rec_path)
        self.idx_path = os.fspath(idx_path) if idx_path is not None else os.path.splitext(self.rec_path)[0] + ".idx"
        if not os.path.isfile(self.rec_path):
            raise FileNotFoundError(f"RecordIO file not found: {self.rec_path!r}")
        if not os.path.isfile(self.idx_path):
            raise FileNotFoundError(f"RecordIO index not found: {self.idx_path!r} (index of {self.rec_path!r})")
        self._keys, self._offsets = _parse_idx(self.idx_path)
        self._size = os.path.getsize(self.rec_path)
        for key in self._keys:
            if self._offsets[key] >= self._size:
                raise ValueError(f"{self.idx_path!r}: key {key} points at byte offset {self._offsets[key]}, "
                                 f"past the end of {self.rec_path!r} ({self._size} bytes)")
        self._fd: int | None = None
        self._pid: int | None = None
        self._lock = threading.Lock()

    # -- file handle ---------------------------------------------------------------
    def _file(self) -> int:
        # A forked child must not share the parent's descriptor bookkeeping; a spawned
        # one arrives without a descriptor (see __getstate__).
        pid = os.getpid()
        if self._fd is None or self._pid != pid:
            with self._lock:
                if self._fd is None or self._pid != pid:
                    self._fd = os.open(self.rec_path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
                    self._pid = pid
        return self._fd

    def close(self) -> None:
        if self._fd is not None and self._pid == os.getpid():
            os.close(self._fd)
        self._fd = None
        self._pid = None

    def __enter__(self) -> "RecordIOReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_fd"] = None
        state["_pid"] = None
        del state["_lock"]
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()

    # -- index ---------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._keys)

    @property
    def keys(self) -> list[int]:
        """Keys in ``.idx`` file order (a copy)."""
        return list(self._keys)

    def __contains__(self, key: int) -> bool:
        return key in self._offsets

    def offset(self, key: int) -> int:
        try:
            return self._offsets[key]
        except KeyError:
            raise KeyError(f"key {key!r} is not in the index {self.idx_path!r}") from None

    # -- records -------------------------------------------------------------------
    def _pread(self, size: int, offset: int) -> bytes:
        fd = self._file()
        if hasattr(os, "pread"):
            return os.pread(fd, size, offset)
        with self._lock:  # no pread (Windows): seek + read under the lock
            os.lseek(fd, offset, os.SEEK_SET)
            return os.read(fd, size)

    def _physical_header(self, offset: int, key: int) -> tuple[int, int]:
        head = self._pread(8, offset)
        if len(head) < 8:
            raise ValueError(f"{self.rec_path!r}: truncated record header for key {key} at byte offset {offset} "
                             f"(got {len(head)} of 8 bytes)")
        return self._decode_header(head, offset, key)

    def _decode_header(self, head: bytes, offset: int, key: int) -> tuple[int, int]:
        magic, lrec = struct.unpack_from("<II", head)
        if magic != MAGIC:
            hint = " (old dmlc RecordIO magic 0x3ED7230A, not supported)" if magic == _OLD_MAGIC else ""
            raise ValueError(f"{self.rec_path!r}: bad magic 0x{magic:08X} for key {key} at byte offset {offset}, "
                             f"expected 0x{MAGIC:08X}{hint}; is {self.idx_path!r} the index of this file?")
        return lrec & _LENGTH_MASK, lrec >> 29

    def read(self, key: int) -> bytes:
        """The payload of one logical record (split parts joined, padding removed)."""
        return self.read_at(self.offset(key), key=key)

    def read_at(self, offset: int, key: int | None = None) -> bytes:
        """The logical record whose first physical record starts at ``offset``."""
        parts: list[bytes] = []
        pos = offset
        while True:
            length, cflag = self._physical_header(pos, key)
            if cflag > 3:
                raise ValueError(f"{self.rec_path!r}: invalid cflag {cflag} for key {key} at byte offset {pos}")
            first = not parts
            if first and cflag not in (0, 1):
                raise ValueError(f"{self.rec_path!r}: record for key {key} at byte offset {pos} starts with "
                                 f"cflag {cflag} (a continuation part); the index offset is wrong")
            if not first and cflag not in (2, 3):
                raise ValueError(f"{self.rec_path!r}: split record for key {key} (starting at byte offset "
                                 f"{offset}) is interrupted at byte offset {pos} by cflag {cflag}")
            padded = (length + 3) & ~3
            body = self._pread(padded, pos + 8) if padded else b""
            if len(body) < padded:
                raise ValueError(f"{self.rec_path!r}: truncated record for key {key} at byte offset {pos}: "
                                 f"header says {length} payload bytes ({padded} padded), file has "
                                 f"{len(body)} left")
            parts.append(body[:length])
            pos += 8 + padded
            if cflag in (0, 3):
                break
        return parts[0] if len(parts) == 1 else _MAGIC_BYTES.join(parts)

    def read_prefix(self, key: int, size: int) -> bytes:
        """At least the first ``size`` bytes of a record's payload when it has that many
        (the whole payload otherwise), reading as little of the file as it can."""
        offset = self.offset(key)
        head = self._pread(8 + size, offset)
        if len(head) >= 8:
            length, cflag = self._decode_header(head[:8], offset, key)
            if cflag == 0 and len(head) - 8 >= min(size, length):
                return head[8:8 + min(size, length)]
        return self.read_at(offset, key=key)


def _parse_idx(path: str) -> tuple[list[int], dict[int, int]]:
    keys: list[int] = []
    offsets: dict[int, int] = {}
    with open(path, "r", encoding="ascii", errors="strict") as f:
        for line_no, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            fields = line.split("\t")
            try:
                if len(fields) != 2:
                    raise ValueError
                key, offset = int(fields[0]), int(fields[1])
            except ValueError:
                raise ValueError(f"{path!r} line {line_no}: expected 'key<TAB>byte_offset', got {line!r}") from None
            if offset < 0:
                raise ValueError(f"{path!r} line {line_no}: negative byte offset {offset}")
            if key in offsets:
                raise ValueError(f"{path!r} line {line_no}: duplicate key {key}")
            keys.append(key)
            offsets[key] = offset
    return keys, offsets


def unpack_header(payload: bytes) -> tuple[int, float | tuple[float, ...], int, int, bytes]:
    """Split a record payload into ``(flag, label, id, id2, rest)``.

    ``label`` is the float32 scalar when ``flag == 0``, otherwise the tuple of the
    ``flag`` float32 labels that follow the header (the scalar field is unused then).
    ``rest`` is what remains: the encoded image, or ``b""`` for header and identity
    records.
    """
    if len(payload) < IR_HEADER_SIZE:
        raise ValueError(f"record payload has {len(payload)} bytes, shorter than the {IR_HEADER_SIZE}-byte IRHeader")
    flag, label, id1, id2 = _IR_FORMAT.unpack_from(payload)
    start = IR_HEADER_SIZE
    if flag > 0:
        end = start + 4 * flag
        if len(payload) < end:
            raise ValueError(f"IRHeader says flag={flag} labels follow ({4 * flag} bytes) but the payload has only "
                             f"{len(payload) - start} bytes after the header")
        label = struct.unpack_from(f"<{flag}f", payload, start)
        start = end
    return flag, label, id1, id2, bytes(payload[start:])


def _class_of(label) -> int:
    value = label[0] if isinstance(label, tuple) else label
    if not math.isfinite(value) or value < 0 or value != int(value):
        raise ValueError(f"label {label!r} does not hold a non-negative integer class id")
    return int(value)


def _property_num_classes(rec_path: str) -> tuple[str, int] | None:
    """``(path, num_classes)`` from insightface's ``property`` file (``num_classes,h,w``)
    beside ``rec_path``; ``None`` without one. An unreadable one is ignored with a
    warning: nothing here depends on it."""
    path = os.path.join(os.path.dirname(os.path.abspath(rec_path)), "property")
    if not os.path.isfile(path):
        return None
    with open(path, "r", encoding="ascii", errors="replace") as f:
        text = f.read(256)
    try:
        value = int(text.split(",")[0].strip())
    except ValueError:
        warnings.warn(f"{path!r}: expected 'num_classes,height,width', got {text.strip()[:60]!r}; ignoring it",
                      stacklevel=3)
        return None
    return path, value


class InsightFaceRecord(torch.utils.data.Dataset):
    """Face images and class ids from an insightface ``.rec``/``.idx`` pair.

    Item ``i`` is ``(image, label)``: ``image`` is ``decode(encoded_bytes)`` when
    ``decode`` is given, else the encoded bytes (JPEG written from BGR by OpenCV in
    insightface's recs: decode to RGB to match its training); ``label`` is the int
    class id, the scalar label or index 0 of an array label.

    Layout, decided from record 0 and the index:

    - no key 0, or record 0 carries image bytes after its labels: no header (``im2rec``,
      with or without ``--pack-label``); every key in the index is an image, in index
      order. An ``im2rec --pack-label`` record 0 may well have two integer labels.
    - record 0 has ``flag=2``, label ``[A, B]`` and no image bytes: the insightface
      header, ``self.header = (A, B)``; images are keys ``1 .. A-1``. It is accepted
      only when the index agrees: every key ``1 .. A-1`` is there, no key lies outside
      ``0 .. B-1``, and the identity records ``A`` and ``B-1``, when present, have no
      image bytes either.
    - anything else (no image bytes but not ``[A, B]``, or an index that contradicts
      the header) is refused with a ``ValueError`` saying why: reading such a file
      either way could silently give wrong images or labels.

    ``num_classes`` is ``max(label) + 1`` over the items (see there).
    """

    def __init__(self, rec_path: str | os.PathLike, idx_path: str | os.PathLike | None = None,
                 decode: Callable[[bytes], object] | None = None):
        if decode is not None and not callable(decode):
            raise TypeError(f"decode must be a callable taking bytes or None, got {type(decode).__name__}")
        self.reader = RecordIOReader(rec_path, idx_path)
        self.decode = decode
        self.header: tuple[int, int] | None = self._find_header()
        self._image_keys: Sequence[int] = range(1, self.header[0]) if self.header else self.reader.keys
        self._labels: torch.Tensor | None = None
        self._num_classes: int | None = None

    def _find_header(self) -> tuple[int, int] | None:
        reader = self.reader
        if 0 not in reader:  # insightface looks at key 0 only
            return None
        flag, label, _, _, rest = unpack_header(reader.read(0))
        if flag == 0 or rest:
            return None  # an image record: a header never carries image bytes
        where = f"{reader.rec_path!r}: record 0 has flag={flag}, label {list(label)} and no image bytes"
        integral = all(math.isfinite(v) and v == int(v) for v in label)
        if flag != 2 or not integral or not 1 <= label[0] <= label[1]:
            raise ValueError(f"{where}, so it is not an image record, and it is not an insightface header "
                             f"either: that holds exactly two labels [A, B], integers with 1 <= A <= B. The "
                             f"layout of this file is unknown")
        a, b = int(label[0]), int(label[1])
        refuse = (f"{where}, like an insightface header [A, B] = [{a}, {b}] (images at keys 1..A-1, identity "
                  f"records at A..B-1), but {reader.idx_path!r} does not match it: ")
        keys = reader.keys
        # Keys are unique, so exactly B of them between 0 and B-1 is the whole layout;
        # only an index that is not that gets counted key by key.
        if len(keys) != b or min(keys) < 0 or max(keys) >= b:
            num_images = sum(1 for k in keys if 1 <= k < a)
            if num_images < a - 1:
                last = next(k for k in range(a - 1, 0, -1) if k not in reader)
                raise ValueError(f"{refuse}header says images are keys 1..{a - 1} but key {last} is not in the "
                                 f"index ({a - 1 - num_images} of those {a - 1} keys are missing)")
            outside = [k for k in keys if not 0 <= k < b]
            if outside:
                raise ValueError(f"{refuse}{len(outside)} key(s) lie outside 0..{b - 1}, the first being "
                                 f"{outside[0]}")
        for key in sorted({a, b - 1}):
            if a <= key < b and key in reader:
                id_flag, _, _, _, id_rest = unpack_header(reader.read(key))
                if id_flag != 2 or id_rest:
                    raise ValueError(f"{refuse}record {key} should be an identity record (flag=2, no image "
                                     f"bytes) and has flag={id_flag} with {len(id_rest)} image bytes")
        return a, b

    def __len__(self) -> int:
        return len(self._image_keys)

    def key(self, index: int) -> int:
        """The record key of item ``index``."""
        if not 0 <= index < len(self._image_keys):
            raise IndexError(f"index {index} out of range for {len(self._image_keys)} images")
        return self._image_keys[index]

    def __getitem__(self, index: int):
        flag, label, _, _, image = unpack_header(self.reader.read(self.key(index)))
        label = _class_of(label)
        return (self.decode(image) if self.decode is not None else image), label

    def labels(self) -> torch.Tensor:
        """Every item's class id, int64 ``[len(self)]``, read from the record headers
        only (cached)."""
        if self._labels is None:
            out = torch.empty(len(self._image_keys), dtype=torch.int64)
            for i, key in enumerate(self._image_keys):
                prefix = self.reader.read_prefix(key, _PREFIX_READ - 8)
                if len(prefix) >= IR_HEADER_SIZE:
                    flag = _IR_FORMAT.unpack_from(prefix)[0]
                    if IR_HEADER_SIZE + 4 * flag > len(prefix):
                        prefix = self.reader.read(key)
                out[i] = _class_of(unpack_header(prefix)[1])
            self._labels = out
        return self._labels

    @property
    def num_classes(self) -> int:
        """``max(label) + 1`` over the items (0 when there are none), from
        :meth:`labels` on first use (one read of every record header), cached.

        The counts written beside the data are checked, not trusted: insightface's
        ``property`` file (``num_classes,h,w`` next to the ``.rec``) and the header's
        ``B - A`` identity records. insightface's writers only require increasing
        labels, and 1-based or sparse class ids go past both counts: a head sized
        from them would fail at the first batch holding such a label. A declared
        count below ``max(label) + 1`` gives a warning naming it; a larger one
        (classes with no image in this file) is no error.
        """
        if self._num_classes is None:
            labels = self.labels()
            num_classes = int(labels.max()) + 1 if len(labels) else 0
            declared = []
            if self.header is not None:
                declared.append((f"the header [A, B] = [{self.header[0]}, {self.header[1]}] "
                                 f"(B - A identity records)", self.header[1] - self.header[0]))
            prop = _property_num_classes(self.reader.rec_path)
            if prop is not None:
                declared.append((f"{prop[0]!r}", prop[1]))
            for source, count in declared:
                if count < num_classes:
                    warnings.warn(f"{self.reader.rec_path!r}: {source} declares {count} classes but the largest "
                                  f"label is {num_classes - 1}; using num_classes = {num_classes}", stacklevel=2)
            self._num_classes = num_classes
        return self._num_classes
