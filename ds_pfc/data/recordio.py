"""Insightface RecordIO (``.rec`` + ``.idx``) read directly, without MXNet.

Format (dmlc-core ``recordio.h``, as insightface's ``.rec`` datasets use it), written
here from the format as described below, not from MXNet's code:

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

import array
import hashlib
import logging
import math
import os
import socket
import struct
import sys
import threading
import time
import warnings
from typing import Callable, Sequence

import torch

__all__ = ["MAGIC", "IR_HEADER_SIZE", "RecordIOReader", "unpack_header", "InsightFaceRecord", "resolve_paths",
           "INDEX_CACHE_VERSION"]

_log = logging.getLogger(__name__)

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

    def __init__(self, rec_path: str | os.PathLike, idx_path: str | os.PathLike | None = None, *,
                 index: tuple[torch.Tensor, torch.Tensor] | None = None,
                 progress: Callable[[str], None] | None = None):
        self.rec_path = os.fspath(rec_path)
        self.idx_path = os.fspath(idx_path) if idx_path is not None else os.path.splitext(self.rec_path)[0] + ".idx"
        if not os.path.isfile(self.rec_path):
            raise FileNotFoundError(f"RecordIO file not found: {self.rec_path!r}")
        if not os.path.isfile(self.idx_path):
            raise FileNotFoundError(f"RecordIO index not found: {self.idx_path!r} (index of {self.rec_path!r})")
        # keys and byte offsets in .idx order, int64 tensors: 16 bytes a record, so an
        # index of tens of millions of records stays small (a dict would take GBs).
        keys, offsets = index if index is not None else _parse_idx(self.idx_path, progress)
        self._key_tensor, self._offset_tensor = keys, offsets
        self._size = os.path.getsize(self.rec_path)
        if len(keys):
            past = offsets >= self._size
            if bool(past.any()):
                i = int(past.nonzero()[0, 0])
                raise ValueError(f"{self.idx_path!r}: key {int(keys[i])} points at byte offset {int(offsets[i])}, "
                                 f"past the end of {self.rec_path!r} ({self._size} bytes)")
        self._build_lookup()
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
    def _build_lookup(self) -> None:
        keys = self._key_tensor
        n = len(keys)
        self._base = int(keys[0]) if n else 0
        # The usual index lists keys base, base+1, ... in order: a key's offset is then
        # offsets[key - base]. Any other index gets a sorted copy and a binary search.
        self._dense = n == 0 or bool((keys == torch.arange(self._base, self._base + n, dtype=torch.int64)).all())
        if self._dense:
            self._sorted_keys = self._sorted_offsets = None
        else:
            order = torch.argsort(keys)
            self._sorted_keys, self._sorted_offsets = keys[order], self._offset_tensor[order]
            dup = (self._sorted_keys[1:] == self._sorted_keys[:-1]).nonzero()
            if len(dup):
                raise ValueError(f"{self.idx_path!r}: duplicate key {int(self._sorted_keys[int(dup[0, 0])])}")

    def __len__(self) -> int:
        return len(self._key_tensor)

    @property
    def keys(self) -> list[int]:
        """Keys in ``.idx`` file order (a copy)."""
        return self._key_tensor.tolist()

    @property
    def key_tensor(self) -> torch.Tensor:
        """Keys in ``.idx`` file order, int64 (do not modify)."""
        return self._key_tensor

    @property
    def offset_tensor(self) -> torch.Tensor:
        """Byte offsets in ``.idx`` file order, int64 (do not modify)."""
        return self._offset_tensor

    def _find(self, key: int) -> int | None:
        if self._dense:
            i = key - self._base
            return self._offset_tensor[i].item() if 0 <= i < len(self._key_tensor) else None
        i = int(torch.searchsorted(self._sorted_keys, torch.tensor(key, dtype=torch.int64)))
        if i < len(self._sorted_keys) and int(self._sorted_keys[i]) == key:
            return int(self._sorted_offsets[i])
        return None

    def __contains__(self, key: int) -> bool:
        return self._find(int(key)) is not None

    def offset(self, key: int) -> int:
        found = self._find(int(key))
        if found is None:
            raise KeyError(f"key {key!r} is not in the index {self.idx_path!r}")
        return found

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


def _parse_idx(path: str, progress: Callable[[str], None] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(keys, offsets)`` int64 in file order, parsed in blocks of whole lines (with
    numpy's C parser when numpy is installed: tens of millions of lines take seconds).
    A block that is not exactly one ``key<TAB>offset`` per line is parsed again line
    by line, to skip blank lines or name the first bad one. ``progress`` gets a line of
    text after each block."""
    parts: list[torch.Tensor] = []
    line_no = 0
    rest = b""
    done, total = 0, os.path.getsize(path)
    with open(path, "rb") as f:
        while True:
            chunk = f.read(1 << 26)
            text = rest + chunk
            if not chunk:
                rest = b""
                if not text:
                    break
                if not text.endswith(b"\n"):
                    text += b"\n"
            else:
                cut = text.rfind(b"\n") + 1
                text, rest = text[:cut], text[cut:]
                if not text:
                    continue
            parts.append(_parse_block(path, text, line_no))
            line_no += text.count(b"\n")
            done += len(chunk)
            if progress is not None:
                progress(f"{done / 2**20:,.0f} of {total / 2**20:,.0f} MiB of {os.path.basename(path)} parsed")
            if not chunk:
                break
    pairs = torch.cat(parts).view(-1, 2) if parts else torch.empty(0, 2, dtype=torch.int64)
    keys, offsets = pairs[:, 0].contiguous(), pairs[:, 1].contiguous()
    if len(offsets) and bool((offsets < 0).any()):
        i = int((offsets < 0).nonzero()[0, 0])
        raise ValueError(f"{path!r}: negative byte offset {int(offsets[i])} for key {int(keys[i])}")
    return keys, offsets


def _parse_block(path: str, text: bytes, line_no: int) -> torch.Tensor:
    lines = text.count(b"\n")
    values = None
    try:
        import numpy as np
    except ImportError:
        try:
            values = torch.frombuffer(array.array("q", map(int, text.split())), dtype=torch.int64).clone()
        except (ValueError, OverflowError):
            pass
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                values = torch.from_numpy(np.fromstring(text, dtype=np.int64, sep=" "))
            except ValueError:
                pass
    if values is not None and len(values) == 2 * lines and text.count(b"\t") == lines:
        return values
    out = array.array("q")
    for line in text.split(b"\n"):
        line_no += 1
        stripped = line.decode("ascii", errors="replace").strip()
        if not stripped:
            continue
        fields = stripped.split("\t")
        try:
            if len(fields) != 2:
                raise ValueError
            out.extend((int(fields[0]), int(fields[1])))
        except ValueError:
            raise ValueError(f"{path!r} line {line_no}: expected 'key<TAB>byte_offset', got {stripped!r}") from None
    return torch.frombuffer(out, dtype=torch.int64).clone() if len(out) else torch.empty(0, dtype=torch.int64)


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

    ``rec_path`` may also be the dataset directory holding ``train.rec`` and
    ``train.idx`` (and, optionally, ``property``); a missing file is named in the error.

    Start-up does not read every record (see :meth:`labels`): the labels come from an
    index cache when a valid one exists, else from the header's identity records, else
    from one read of every record header, whose result is then cached. ``cache``:
    ``True`` (default) keeps the index cache in ``cache_dir`` (default ``$DS_PFC_CACHE_DIR``,
    else ``~/.cache/ds_pfc``; never in the dataset's directory); ``False`` neither reads nor
    writes one. ``label_source`` says which
    source was used (also logged at INFO on the ``ds_pfc.data.recordio`` logger).
    ``progress`` (optional) is called with a line of text as the index is built (the
    ``.idx`` parsed, record headers read); it is not kept for data-loading workers.
    """

    def __init__(self, rec_path: str | os.PathLike, idx_path: str | os.PathLike | None = None,
                 decode: Callable[[bytes], object] | None = None, *, cache: bool = True,
                 cache_dir: str | os.PathLike | None = None, cache_wait: float = 3600.0,
                 progress: Callable[[str], None] | None = None):
        if decode is not None and not callable(decode):
            raise TypeError(f"decode must be a callable taking bytes or None, got {type(decode).__name__}")
        rec_path, idx_path = resolve_paths(rec_path, idx_path)
        self._cache = _IndexCache(rec_path, idx_path, cache_dir, cache_wait) if cache else None
        entry = self._cache.load() if self._cache is not None else None
        index = (entry["keys"], entry["offsets"]) if entry is not None else None
        self._progress = progress
        self.reader = RecordIOReader(rec_path, idx_path, index=index, progress=progress)
        self.decode = decode
        self.header: tuple[int, int] | None = self._find_header()
        self._image_keys: Sequence[int] = range(1, self.header[0]) if self.header else self.reader.key_tensor
        self._labels: torch.Tensor | None = None
        self._num_classes: int | None = None
        self.label_source: str | None = None
        if entry is not None and len(entry["labels"]) == len(self._image_keys):
            self._labels = entry["labels"].to(torch.int64)
            self._set_source(f"index cache {self._cache.path!r} ({entry['label_source']})")

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_progress"] = None           # a caller's callback: not for the workers
        return state

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
        a, b = self._exact_bounds(int(label[0]), int(label[1]))
        refuse = (f"{where}, like an insightface header [A, B] = [{a}, {b}] (images at keys 1..A-1, identity "
                  f"records at A..B-1), but {reader.idx_path!r} does not match it: ")
        keys = reader.key_tensor
        # Keys are unique, so exactly B of them between 0 and B-1 is the whole layout;
        # only an index that is not that gets counted.
        if len(keys) != b or int(keys.min()) < 0 or int(keys.max()) >= b:
            num_images = int(((keys >= 1) & (keys < a)).sum())
            if num_images < a - 1:
                last = next(k for k in range(a - 1, 0, -1) if k not in reader)
                raise ValueError(f"{refuse}header says images are keys 1..{a - 1} but key {last} is not in the "
                                 f"index ({a - 1 - num_images} of those {a - 1} keys are missing)")
            outside = keys[(keys < 0) | (keys >= b)]
            if len(outside):
                raise ValueError(f"{refuse}{len(outside)} key(s) lie outside 0..{b - 1}, the first being "
                                 f"{int(outside[0])}")
        for key in sorted({a, b - 1}):
            if a <= key < b and key in reader:
                id_flag, _, _, _, id_rest = unpack_header(reader.read(key))
                if id_flag != 2 or id_rest:
                    raise ValueError(f"{refuse}record {key} should be an identity record (flag=2, no image "
                                     f"bytes) and has flag={id_flag} with {len(id_rest)} image bytes")
        return a, b

    def _is_identity(self, key: int):
        """The label of record ``key`` when it is an identity record (flag 2, no image
        bytes), else None."""
        if key not in self.reader:
            return None
        flag, label, _, _, rest = unpack_header(self.reader.read(key))
        return label if flag == 2 and not rest else None

    def _exact_bounds(self, a: int, b: int) -> tuple[int, int]:
        """The header's ``[A, B]`` is float32: past 2**24 it is rounded to a multiple of
        2 (of 4 past 2**25, ...). The exact ``A`` is the first identity record (range
        starting at image 1) within half a step of it, the exact ``B`` one past the
        last identity record; unchanged when none is found (the checks then refuse)."""
        def near(v):
            half = _float32_step(v) // 2
            return range(v - half, v + half + 1)

        if a >= _FLOAT32_EXACT:
            for c in near(a):
                first = self._is_identity(c)
                if first is not None and first[0] == 1 and self._is_identity(c - 1) is None:
                    a = c
                    break
        if b >= _FLOAT32_EXACT:
            for c in near(b):
                if self._is_identity(c - 1) is not None and self._is_identity(c) is None:
                    b = c
                    break
        return a, b

    def __len__(self) -> int:
        return len(self._image_keys)

    def key(self, index: int) -> int:
        """The record key of item ``index``."""
        if not 0 <= index < len(self._image_keys):
            raise IndexError(f"index {index} out of range for {len(self._image_keys)} images")
        return int(self._image_keys[index])

    def __getitem__(self, index: int):
        flag, label, _, _, image = unpack_header(self.reader.read(self.key(index)))
        label = _class_of(label)
        return (self.decode(image) if self.decode is not None else image), label

    def labels(self) -> torch.Tensor:
        """Every item's class id, int64 ``[len(self)]`` (cached), from the first of:

        1. the index cache, when it matches the size and modification time of the
           ``.rec`` and ``.idx`` and this version of the format;
        2. the header's identity records (insightface layout): record ``A + g`` holds
           the image range ``[start, end)`` of class ``g``. The ranges must tile
           ``1 .. A-1``; the labels of the first and last image of up to 64 classes
           (first, last, evenly spaced) must read ``base + g``. Reads ``B - A`` small
           records in large blocks and at most 128 image headers;
        3. one read of every record header (``im2rec`` layout, identity records
           missing or contradicted by the checks, or class ids that are not
           consecutive).

        Then the index cache is written (atomically) by the first process to take its
        lock; the others wait for it (up to ``cache_wait`` seconds) and read it.
        """
        if self._labels is None:
            cache = self._cache
            if cache is not None and not cache.acquire():
                entry = cache.wait()
                if entry is not None and len(entry["labels"]) == len(self._image_keys):
                    self._labels = entry["labels"].to(torch.int64)
                    self._set_source(f"index cache {cache.path!r} ({entry['label_source']}, written by another "
                                     f"process)")
                    return self._labels
                cache = None            # timed out or unwritable: compute here, write nothing
            try:
                labels, source = self._labels_from_identities() if self.header is not None else (None, None)
                if labels is None:
                    labels = self._scan_labels()
                    source = "a read of every record header" + (f" ({source})" if source else "")
                self._labels = labels
                self._set_source(source)
                if cache is not None:
                    cache.write(self.reader, labels, source)
            finally:
                if cache is not None:
                    cache.release()
        return self._labels

    def _set_source(self, source: str) -> None:
        self.label_source = source
        _log.info("%s: %d labels from %s", self.reader.rec_path, len(self._image_keys), source)

    def _label_of(self, key: int) -> int:
        prefix = self.reader.read_prefix(key, _PREFIX_READ - 8)
        if len(prefix) >= IR_HEADER_SIZE:
            flag = _IR_FORMAT.unpack_from(prefix)[0]
            if IR_HEADER_SIZE + 4 * flag > len(prefix):
                prefix = self.reader.read(key)
        return _class_of(unpack_header(prefix)[1])

    def _scan_labels(self) -> torch.Tensor:
        out = torch.empty(len(self._image_keys), dtype=torch.int64)
        total = len(out)
        for i, key in enumerate(self._image_keys):
            out[i] = self._label_of(int(key))
            if self._progress is not None and i % 65536 == 0:
                self._progress(f"{i:,} of {total:,} record headers read")
        return out

    def _labels_from_identities(self) -> tuple[torch.Tensor | None, str]:
        """Labels from the identity records, or ``(None, why not)``."""
        a, b = self.header
        groups = b - a
        reader = self.reader
        if groups <= 0:
            return None, "the header lists no identity records"
        if sys.byteorder != "little":
            return None, "identity records are read in bulk on little-endian machines only"
        if not all(k in reader for k in (a, b - 1)) or (not reader._dense and any(
                k not in reader for k in range(a, b))) or (reader._dense and not (
                reader._base <= a and b - 1 < reader._base + len(reader))):
            return None, "identity records missing from the index"
        first = a - reader._base if reader._dense else None
        offsets = reader.offset_tensor[first:first + groups] if first is not None else torch.tensor(
            [reader.offset(k) for k in range(a, b)], dtype=torch.int64)
        ranges = torch.empty(groups, 2, dtype=torch.float32)
        words = 12                    # record header (2) + IRHeader (6) + two labels (2) + slack
        chunk = 1 << 18
        for lo in range(0, groups, chunk):
            offs = offsets[lo:lo + chunk]
            start = int(offs.min())
            span = int(offs.max()) - start + 4 * words
            if span > 64 << 20:
                return None, "identity records are not stored together"
            data = reader._pread(span, start)
            buf = torch.zeros(span, dtype=torch.uint8)
            if data:
                buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            where = (offs - start).unsqueeze(1) + torch.arange(4 * words)
            rec = buf[where].view(torch.int32)                       # [n, words]
            magic_ok = rec[:, 0] == MAGIC - (1 << 32)
            lrec = rec[:, 1].to(torch.int64) & 0xFFFFFFFF
            if not bool((magic_ok & (lrec >> 29 == 0) & ((lrec & _LENGTH_MASK) >= IR_HEADER_SIZE + 8)
                         & (rec[:, 2] == 2)).all()):
                return None, "an identity record is not flag=2 with two labels"
            ranges[lo:lo + chunk] = rec[:, 8:10].contiguous().view(torch.float32)
        if not bool(torch.isfinite(ranges).all()) or not bool((ranges == ranges.round()).all()):
            return None, "an identity record's range is not integral"
        starts, ends = ranges[:, 0].to(torch.int64), ranges[:, 1].to(torch.int64)
        counts = ends - starts
        if int(starts[0]) != 1 or int(ends[-1]) != _float32_round(a) or \
                bool((counts < 0).any()) or bool((starts[1:] != ends[:-1]).any()):
            return None, f"the identity records' ranges do not tile the images 1..{a - 1}"
        nonempty = (counts > 0).nonzero().flatten()
        if not len(nonempty):
            return None, "every identity record's range is empty"
        base = self._label_of(1) - int(nonempty[0])
        checked = 1
        # Boundaries past 2**24 are float32-rounded: find each exact one within half a
        # step, where the labels change from class g-1 to class g (a few reads each).
        rounded = (starts >= _FLOAT32_EXACT).nonzero().flatten().tolist()
        if rounded:
            if bool((counts[rounded[0]:] == 0).any()):
                return None, "identity ranges past 2**24 images (float32-rounded) include empty classes"
            starts = starts.clone()
            for g in rounded:
                r = int(starts[g])
                half = _float32_step(r) // 2
                for k in range(max(r - half, int(starts[g - 1]) + 1), min(r + half, a - 1) + 1):
                    checked += 1
                    if self._label_of(k) == base + g:
                        starts[g] = k
                        break
                else:
                    return None, f"no image near {r} has the label {base + g} of identity record {a + g}"
            ends = torch.cat([starts[1:], torch.tensor([a])])
            counts = ends - starts
            if bool((counts <= 0)[rounded[0]:].any()):
                return None, "the exact identity ranges past 2**24 images do not tile the images"
        picks = torch.linspace(0, len(nonempty) - 1, min(64, len(nonempty))).round().long().unique()
        sample = nonempty[picks].tolist()
        for g in sample:
            for key in sorted({int(starts[g]), int(ends[g]) - 1}):
                checked += 1
                got = self._label_of(key)
                if got != base + g:
                    return None, (f"image {key} of identity record {a + g} has label {got}, not {base + g}: the "
                                  f"labels do not follow the identity records")
        labels = torch.repeat_interleave(base + torch.arange(groups, dtype=torch.int64), counts)
        return labels, (f"the header's {groups} identity records ({checked} image labels checked, class ids "
                        f"{base}..{base + groups - 1})")

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


_FLOAT32_EXACT = 1 << 24        # integers past this are rounded by a float32 label


def _float32_step(v: int) -> int:
    """Spacing of float32 values around the integer ``v`` (1 below 2**24)."""
    return 1 << max(0, max(v, 1).bit_length() - _FLOAT32_EXACT.bit_length() + 1)


def _float32_round(v: int) -> int:
    """``v`` as a float32 label stores it (to the nearest step, ties to even)."""
    step = _float32_step(v)
    return round(v / step) * step


def resolve_paths(path: str | os.PathLike, idx_path: str | os.PathLike | None = None) -> tuple[str, str]:
    """``(rec, idx)`` for a ``.rec`` file or a dataset directory holding ``train.rec``
    and ``train.idx`` (insightface's layout, with ``property`` beside them). A missing
    file is named in a ``FileNotFoundError`` listing everything that is missing."""
    path = os.fspath(path)
    if os.path.isdir(path):
        rec = os.path.join(path, "train.rec")
        idx = os.fspath(idx_path) if idx_path is not None else os.path.join(path, "train.idx")
        missing = [p for p in (rec, idx) if not os.path.isfile(p)]
        if missing:
            present = sorted(os.listdir(path))[:10]
            raise FileNotFoundError(
                f"RecordIO dataset directory {path!r} lacks {', '.join(repr(os.path.basename(p)) for p in missing)} "
                f"(expected train.rec, train.idx and optionally property; it holds "
                f"{', '.join(present) if present else 'nothing'}{' ...' if len(os.listdir(path)) > 10 else ''})")
        return rec, idx
    idx = os.fspath(idx_path) if idx_path is not None else os.path.splitext(path)[0] + ".idx"
    missing = [p for p in (path, idx) if not os.path.isfile(p)]
    if missing:
        raise FileNotFoundError(f"RecordIO files not found: {', '.join(repr(p) for p in missing)} (give the .rec "
                                f"file with its .idx beside it, or the directory holding train.rec and train.idx)")
    return path, idx


INDEX_CACHE_VERSION = 1


def _stamp(path: str) -> list[int]:
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns]


def default_cache_dir() -> str:
    """Where index caches go when no ``cache_dir`` is given: ``$DS_PFC_CACHE_DIR``, else
    ``~/.cache/ds_pfc``."""
    return os.environ.get("DS_PFC_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "ds_pfc")


class _IndexCache:
    """Keys, byte offsets and labels of a ``.rec``, saved once and reused while the
    ``.rec`` and ``.idx`` keep their size and modification time.

    Kept in ``cache_dir`` (default :func:`default_cache_dir`: ``$DS_PFC_CACHE_DIR``, else
    ``~/.cache/ds_pfc``), never beside the data, as ``<hash>-<name>.rec.ds_pfc-index.pt``
    (the hash of the ``.rec``'s absolute path). One process writes it: the first
    to create ``<cache>.lock``; the others wait for the file. A lock whose holder on
    this host has exited, or older than ``wait`` seconds, is taken as left by a dead
    process."""

    def __init__(self, rec: str, idx: str, cache_dir, wait: float):
        self.rec, self.idx, self.wait_s = os.path.abspath(rec), os.path.abspath(idx), float(wait)
        folder = os.fspath(cache_dir) if cache_dir is not None else default_cache_dir()
        digest = hashlib.sha1(self.rec.encode()).hexdigest()[:16]
        self.path = os.path.join(folder, f"{digest}-{os.path.basename(self.rec)}.ds_pfc-index.pt")
        self.lock = self.path + ".lock"
        self._held = False

    def _expected(self) -> dict:
        return {"version": INDEX_CACHE_VERSION, "rec": _stamp(self.rec), "idx": _stamp(self.idx)}

    def load(self) -> dict | None:
        if not os.path.isfile(self.path):
            return None
        try:
            entry = torch.load(self.path, map_location="cpu", weights_only=True)
            expected = self._expected()
            if not isinstance(entry, dict) or any(entry.get(k) != v for k, v in expected.items()):
                _log.info("%s: stale or foreign index cache, not used", self.path)
                return None
            if len(entry["keys"]) != len(entry["offsets"]):
                return None
            return entry
        except Exception as exc:  # noqa: BLE001 - a damaged cache is rebuilt, never fatal
            _log.warning("%s: unreadable index cache (%s), not used", self.path, exc)
            return None

    def acquire(self) -> bool:
        """True when this process is to compute and write the cache."""
        if self._held:
            return True
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            for _ in range(2):
                try:
                    fd = os.open(self.lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
                except FileExistsError:
                    try:
                        if self._stale():
                            os.unlink(self.lock)     # left by a process that died
                            continue
                    except FileNotFoundError:
                        continue
                    return False
                os.write(fd, f"{socket.gethostname()} {os.getpid()}\n".encode())
                os.close(fd)
                self._held = True
                return True
        except OSError as exc:
            _log.warning("%s: cannot create the index cache (%s); labels are computed without it", self.path, exc)
            self.path = None
        return True

    def _stale(self) -> bool:
        """The lock is older than ``wait`` seconds, or its holder (on this host) is gone."""
        if time.time() - os.path.getmtime(self.lock) > self.wait_s:
            return True
        try:
            with open(self.lock) as f:
                host, pid = f.read().split()
            if host == socket.gethostname():
                os.kill(int(pid), 0)
        except ProcessLookupError:
            return True
        except (OSError, ValueError):
            pass                      # being written, or not ours to judge: wait
        return False

    def wait(self) -> dict | None:
        deadline = time.monotonic() + self.wait_s
        while time.monotonic() < deadline:
            entry = self.load()
            if entry is not None:
                return entry
            try:
                if not os.path.exists(self.lock) or self._stale():
                    return self.load()
            except FileNotFoundError:
                return self.load()
            time.sleep(0.2)
        return None

    def write(self, reader: RecordIOReader, labels: torch.Tensor, source: str) -> None:
        if self.path is None:
            return
        small = labels.numel() == 0 or (int(labels.min()) >= -(1 << 31) and int(labels.max()) < (1 << 31))
        entry = {**self._expected(), "keys": reader.key_tensor, "offsets": reader.offset_tensor,
                 "labels": labels.to(torch.int32) if small else labels, "label_source": source}
        tmp = f"{self.path}.tmp.{socket.gethostname()}.{os.getpid()}"
        try:
            torch.save(entry, tmp)
            os.replace(tmp, self.path)
            _log.info("%s: index cache written", self.path)
        except OSError as exc:
            _log.warning("%s: index cache not written (%s)", self.path, exc)
            try:
                os.unlink(tmp)
            except OSError:
                pass

    def release(self) -> None:
        if self._held:
            self._held = False
            try:
                os.unlink(self.lock)
            except OSError:
                pass
