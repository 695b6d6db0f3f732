"""Per-rank safetensors checkpoints of the :class:`~ds_pfc.core.head.PartialFC` bank.

Each rank writes its own shard ``{name}-rank{rank:05d}-of-{world:05d}.safetensors``
holding every bank state (``weight`` and the row optimizer's states, e.g.
``momentum_buffer`` or ``exp_avg``/``exp_avg_sq``/``step``) for its classes
``[class_start, class_start + num_local)``, plus string metadata (class range, world
size, sampler state, step counter, optimizer, dtypes, format version).

Shards never go through DeepSpeed's ``client_state`` (that is written by one rank
only). Because ownership is contiguous (:class:`~ds_pfc.core.partition.Partition`),
resharding is exact and offline: concatenate the shards in ``class_start`` order and
re-split with ``num_local = C // W + (r < C % W)`` (:func:`reshard`). A reader of
another world size needs only the shards that overlap its classes, and of them only
those rows: :func:`open_shards` checks a checkpoint's shards from their headers and
:meth:`ShardSet.read_rows` reads a class range by positional reads of those rows, so the
memory a reshard needs is that of the range read, never the whole head.

Writes are atomic: a temporary file in the same directory, ``fsync``, ``os.replace``
(and an ``fsync`` of the directory), so a crash leaves either the previous complete
file or the new complete file under the final name, never a partial one.
"""
from __future__ import annotations

import json
import os
import re
import struct
import zlib

import safetensors
import safetensors.torch
import torch

from ..core.partition import Partition
from .files import atomic_file as _atomic_file, fsync_dir as _fsync_dir

__all__ = ["save_head_shard", "load_head_shard", "merge_shards", "reshard", "export_classifier",
           "shard_file_name", "SubcenterCounter", "class_rows", "FORMAT", "open_shards", "ShardSet", "verify_shard",
           "ShardChecksumError", "ShardReadError", "load_resharded"]

FORMAT = "ds_pfc.head_shard/1"
CRC_KEY = "crc32"
"""Shard metadata: comma-separated CRC-32 (8 hex digits) of each state's bytes, in
``states`` order."""
CLASSIFIER_FORMAT = "ds_pfc.classifier/1"

# Integer metadata fields (the head's training_state() plus the rank).
_INT_FIELDS = ("num_classes", "embedding_size", "class_start", "num_local", "world_size", "rank", "seed",
               "sample_step", "step_count")
# Optional integer fields (absent in shards written before them), with their default.
_OPTIONAL_INT_FIELDS = {"sub_centers": 1}
# Fields every shard of one checkpoint must agree on.
_COMMON_FIELDS = ("format", "num_classes", "embedding_size", "world_size", "seed", "sample_step", "step_count",
                  "optimizer", "states", "dtypes", "sub_centers", "margin_state")


def shard_file_name(name: str, rank: int, world_size: int) -> str:
    return f"{name}-rank{rank:05d}-of-{world_size:05d}.safetensors"


def _shard_pattern(name: str) -> re.Pattern:
    return re.compile(re.escape(name) + r"-rank(\d{5})-of-(\d{5})\.safetensors")


def _list_shards(directory: str, name: str) -> dict[int, dict[int, str]]:
    """``{world_size: {rank: path}}`` of the shard files of ``name`` in ``directory``."""
    pattern = _shard_pattern(name)
    found: dict[int, dict[int, str]] = {}
    for entry in sorted(os.listdir(directory)):
        m = pattern.fullmatch(entry)
        if m:
            found.setdefault(int(m.group(2)), {})[int(m.group(1))] = os.path.join(directory, entry)
    return found


def _atomic_save(tensors: dict[str, torch.Tensor], path: str, metadata: dict[str, str]) -> str:
    """safetensors ``save_file`` to a temporary name next to ``path``, fsync, rename."""
    with _atomic_file(path) as tmp:
        safetensors.torch.save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, tmp,
                                    metadata=metadata)
    return path


# safetensors' dtype codes (its format: 8-byte little-endian header size, a JSON
# header with dtype, shape and byte offsets per tensor, then the raw bytes).
_ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL"}
_ST_CODES = {code: dtype for dtype, code in _ST_DTYPES.items()}
SAVE_CHUNK_BYTES = 64 << 20   # rows copied to host and written per step of a streamed save
READ_CHUNK_BYTES = 8 << 20
"""Bytes read per step of a sliced read or a checksum pass: the memory either needs
beyond the rows it returns."""
_MAX_HEADER_BYTES = 100 << 20


def _atomic_stream_save(specs: dict, chunks, path: str, metadata: dict[str, str]) -> str:
    """Write a safetensors file from ``chunks(name)``, an iterator of host tensors
    whose rows concatenate to tensor ``name`` of ``specs[name] = (shape, dtype)``:
    only one chunk is in memory at a time (``safetensors.torch.save_file`` would hold
    every tensor and a byte copy of it). Temporary name, fsync, rename, as
    :func:`_atomic_save`."""
    header, offset, sizes = {"__metadata__": dict(metadata)}, 0, {}
    for name, (shape, dtype) in specs.items():
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        sizes[name] = nbytes
        offset += nbytes
    # Each tensor's CRC-32 goes into the metadata once its bytes are written: a
    # fixed-width placeholder now, patched in place afterwards.
    header["__metadata__"][CRC_KEY] = ",".join("0" * 8 for _ in specs)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    placeholder = json.dumps({CRC_KEY: header["__metadata__"][CRC_KEY]}, separators=(",", ":"))[1:-1].encode()
    crc_at = 8 + encoded.index(placeholder) + len(placeholder) - len(header["__metadata__"][CRC_KEY]) - 1
    crcs = []
    with _atomic_file(path) as tmp, open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for name, (shape, dtype) in specs.items():
            written, crc = 0, 0
            for chunk in chunks(name):
                if chunk.dtype != dtype or tuple(chunk.shape[1:]) != tuple(shape[1:]):
                    raise ValueError(f"{path}: chunk of {name!r} is {chunk.dtype} {tuple(chunk.shape)}, "
                                     f"expected {dtype} rows of {tuple(shape[1:])}")
                raw = chunk.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
                f.write(raw.data)
                crc = zlib.crc32(raw.data, crc)
                written += raw.nbytes
            if written != sizes[name]:
                raise ValueError(f"{path}: {name!r} got {written} bytes, expected {sizes[name]}")
            crcs.append(f"{crc:08x}")
        f.seek(crc_at)
        f.write(",".join(crcs).encode())
    return path


class ShardChecksumError(OSError):
    """A head shard's tensor bytes do not match the CRC-32 its save recorded."""


class ShardReadError(OSError):
    """A head shard file is truncated or its safetensors header cannot be read."""


def _crc_message(path: str, name: str) -> str:
    return (f"{path}: the bytes of tensor {name!r} do not match the checksum its save recorded "
            "(the file is damaged)")


def _read_header(path: str) -> tuple[dict, dict]:
    """``(metadata, specs)`` of safetensors file ``path`` from its header alone:
    ``specs[name] = (shape, dtype, begin, end)`` with the absolute byte range of the
    tensor's data, checked to lie inside the file (:class:`ShardReadError` if not:
    the file is truncated or its header damaged)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        raw = f.read(8)
        if len(raw) < 8:
            raise ShardReadError(f"{path}: {size} bytes, too short for a safetensors file (truncated)")
        (length,) = struct.unpack("<Q", raw)
        if length > min(size - 8, _MAX_HEADER_BYTES):
            raise ShardReadError(f"{path}: its header claims {length} bytes but the file has {size} "
                                 "(truncated or damaged)")
        try:
            header = json.loads(f.read(length))
        except ValueError as err:     # also UnicodeDecodeError
            raise ShardReadError(f"{path}: unreadable safetensors header ({err})") from None
    if not isinstance(header, dict):
        raise ShardReadError(f"{path}: unreadable safetensors header (not a JSON object)")
    specs, data_start = {}, 8 + length
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _ST_CODES[entry["dtype"]]
            shape = tuple(int(n) for n in entry["shape"])
            begin, end = (int(n) for n in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as err:
            raise ShardReadError(f"{path}: unreadable header entry for tensor {name!r} ({err!r})") from None
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        if begin < 0 or end - begin != nbytes or data_start + end > size:
            raise ShardReadError(f"{path}: tensor {name!r} ({_dtype_name(dtype)} {shape}) does not fit in the "
                                 f"file's {size} bytes (truncated or damaged)")
        specs[name] = (shape, dtype, data_start + begin, data_start + end)
    metadata = header.get("__metadata__") or {}
    if not isinstance(metadata, dict):
        raise ShardReadError(f"{path}: unreadable safetensors metadata")
    return metadata, specs


def verify_shard(path: str, *, chunk_bytes: int | None = None) -> None:
    """Check the bytes of every tensor of shard ``path`` against the CRC-32s its save
    recorded, reading the file ``chunk_bytes`` at a time (default ``READ_CHUNK_BYTES``:
    the memory this needs does not grow with the shard). Raises :class:`ShardReadError` (truncated,
    unreadable header) or :class:`ShardChecksumError` (damaged bytes), naming the
    file; a shard written before shards carried checksums has nothing to check."""
    raw, specs = _read_header(path)
    recorded = raw.get(CRC_KEY)
    if recorded is None:
        return
    try:
        names = json.loads(raw["states"])
    except (KeyError, ValueError) as err:
        raise ShardReadError(f"{path}: malformed head shard metadata ({err!r})") from None
    values = recorded.split(",")
    if len(values) != len(names):
        raise ShardChecksumError(f"{path}: {len(values)} checksums recorded for {len(names)} tensors")
    buffer = bytearray(READ_CHUNK_BYTES if chunk_bytes is None else max(1, int(chunk_bytes)))
    view = memoryview(buffer)
    with open(path, "rb") as f:
        for name, want in zip(names, values):
            if name not in specs:
                raise ShardChecksumError(f"{path}: holds no tensor {name!r}, which its checksums list")
            _, _, begin, end = specs[name]
            f.seek(begin)
            crc, left = 0, end - begin
            while left:
                got = f.readinto(view[:min(left, len(buffer))])
                if not got:
                    raise ShardReadError(f"{path}: ends inside tensor {name!r} (truncated)")
                crc = zlib.crc32(view[:got], crc)
                left -= got
            if f"{crc:08x}" != want:
                raise ShardChecksumError(_crc_message(path, name))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _parse_meta(path: str, raw: dict, specs: dict) -> dict:
    """A shard's parsed metadata, checked against its tensors' ``(shape, dtype)``
    (ValueError if the file is not a head shard or they disagree)."""
    if raw.get("format") != FORMAT:
        raise ValueError(f"{path}: not a ds_pfc head shard (format {raw.get('format')!r}, expected {FORMAT!r})")
    try:
        meta = dict(raw)
        for key in _INT_FIELDS:
            meta[key] = int(raw[key])
        for key, default in _OPTIONAL_INT_FIELDS.items():
            meta[key] = int(raw.get(key, default))
        meta["margin_state"] = raw.get("margin_state", "{}")
        meta["states"] = json.loads(raw["states"])
        meta["dtypes"] = json.loads(raw["dtypes"])
    except (KeyError, ValueError) as err:
        raise ValueError(f"{path}: malformed head shard metadata ({err!r})") from None
    if sorted(specs) != sorted(meta["states"]):
        raise ValueError(f"{path}: holds tensors {sorted(specs)} but its metadata lists {meta['states']}")
    rows = meta["num_local"] * meta["sub_centers"]
    for key, (shape, dtype) in specs.items():
        if len(shape) == 0 or shape[0] != rows:
            raise ValueError(f"{path}: tensor {key!r} has shape {tuple(shape)}, expected {rows} rows")
        if _dtype_name(dtype) != meta["dtypes"].get(key):
            raise ValueError(f"{path}: tensor {key!r} is {dtype}, metadata says {meta['dtypes'].get(key)}")
    if specs.get("weight") is None or tuple(specs["weight"][0][1:]) != (meta["embedding_size"],):
        raise ValueError(f"{path}: 'weight' missing or not [num_local, {meta['embedding_size']}]")
    return meta


def _metadata(meta: dict, tensors: dict) -> dict[str, str]:
    """Shard metadata; ``tensors`` maps state names to tensors or to dtypes."""
    dtypes = {k: v if isinstance(v, torch.dtype) else v.dtype for k, v in tensors.items()}
    out = {"format": FORMAT, "optimizer": str(meta["optimizer"]),
           # the class dimension, as DeepSpeed tags a tensor-parallel parameter
           "tensor_model_parallel": "true", "partition_dim": "0",
           "states": json.dumps(list(tensors)),
           "dtypes": json.dumps({k: _dtype_name(v) for k, v in dtypes.items()}),
           "torch_version": torch.__version__}
    for key in _INT_FIELDS:
        out[key] = str(int(meta[key]))
    out["sub_centers"] = str(int(meta.get("sub_centers", 1)))
    # A stateful margin's running state (AdaFace's norm statistics, CurricularFace's t,
    # ElasticFace's draw counter): JSON floats are exact.
    state = meta.get("margin_state", "{}")
    out["margin_state"] = state if isinstance(state, str) else json.dumps(state)
    return out


# ---------------------------------------------------------------------- per rank
def save_head_shard(head, directory: str, *, name: str = "head") -> str:
    """Write this rank's shard of ``head`` to ``directory`` atomically; returns its path.

    Every rank of the head's group calls it (no collective is involved). The bank is
    flushed, then streamed to the file a chunk of rows at a time (device -> host ->
    file): saving needs ``SAVE_CHUNK_BYTES`` of extra memory, not a copy of the shard."""
    head.flush()
    meta = head.training_state()
    meta["rank"] = head.rank
    meta["optimizer"] = repr(head.optimizer)
    meta["margin_state"] = json.dumps(head.margin.state_dict(), sort_keys=True)
    bank, rows = head.bank, head.num_rows
    specs = {}
    for state in bank.state_names():
        probe = bank.read(state, torch.zeros(0, dtype=torch.long, device=head.device))
        specs[state] = ((rows,) + tuple(probe.shape[1:]), probe.dtype)

    def chunks(state):
        shape, dtype = specs[state]
        row_bytes = max(1, torch.Size(shape[1:]).numel() * torch.empty((), dtype=dtype).element_size())
        step = max(1, SAVE_CHUNK_BYTES // row_bytes)
        for lo in range(0, rows, step):
            yield bank.export_rows(state, lo, min(rows, lo + step))

    path = os.path.join(directory, shard_file_name(name, head.rank, head.world_size))
    return _atomic_stream_save(specs, chunks, path, _metadata(meta, {k: v[1] for k, v in specs.items()}))


def load_head_shard(head, directory: str, *, name: str = "head", optimizer_states: str = "saved",
                    chunk_bytes: int | None = None) -> None:
    """Load this rank's shard into ``head``, streamed row block by row block.

    The file for ``head.rank`` / ``head.world_size`` must exist and match the head's
    ``num_classes``, ``embedding_size``, class range, world size, states and dtypes;
    a checkpoint written at another world size must first go through :func:`reshard`.
    ``optimizer_states``: ``"saved"`` loads the optimizer states the file holds, which
    must be the head's; ``"zero"`` loads the centers (``weight``) alone and starts every
    other state of the head at zero, whatever the file holds: SGD's momentum, AdamW's
    moments and its per-row step (so AdamW starts as a fresh ``torch.optim.AdamW``).

    Memory: each state is read from the file ``chunk_bytes`` at a time (default
    :data:`READ_CHUNK_BYTES`) into one reused host buffer and handed to the bank as a
    block of rows (``bank.load_rows``), which moves it to the state's tier: no state is
    ever whole in host memory, nor moved whole to the GPU. The load needs the buffer plus
    what the bank needs to store one block (a dtype conversion, 8-bit coding), never
    memory that grows with the shard.

    All or nothing, as far as a file can say before it is used: the header, the
    metadata and every checksum (a streamed pass over the file, :func:`verify_shard`)
    are checked before anything changes; any error there leaves the head as it was. The
    rows are then read a second time, checked again; a file that changes or fails to read
    during the load raises :class:`ShardReadError` / :class:`ShardChecksumError` saying
    that the head is partly loaded (load again or rebuild it).
    """
    if optimizer_states not in ("saved", "zero"):
        raise ValueError(f"optimizer_states must be 'saved' or 'zero', got {optimizer_states!r}")
    if chunk_bytes is None:
        chunk_bytes = READ_CHUNK_BYTES
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be a positive integer, got {chunk_bytes!r}")
    shards = _list_shards(directory, name) if os.path.isdir(directory) else {}
    path = shards.get(head.world_size, {}).get(head.rank)
    if path is None:
        if shards:
            raise ValueError(
                f"no shard {shard_file_name(name, head.rank, head.world_size)} in {directory}: the checkpoint "
                f"was written with world_size={sorted(shards)} but this head has world_size={head.world_size}; "
                f"use ds_pfc.checkpoint.reshard({directory!r}, new_dir, {head.world_size}) first")
        raise FileNotFoundError(f"no {name!r} head shards in {directory}")
    raw, specs = _read_header(path)
    meta = _parse_meta(path, raw, {k: spec[:2] for k, spec in specs.items()})
    for key in ("num_classes", "embedding_size", "world_size", "class_start", "num_local"):
        if meta[key] != getattr(head, key):
            raise ValueError(
                f"{path}: checkpoint has {key}={meta[key]} but this head has {key}={getattr(head, key)} "
                f"(checkpoint classes [{meta['class_start']}, {meta['class_start'] + meta['num_local']}) of "
                f"C={meta['num_classes']}, d={meta['embedding_size']}, world_size={meta['world_size']}); "
                "a different C or d cannot be loaded; for another world size use ds_pfc.checkpoint.reshard")
    if meta["rank"] != head.rank:
        raise ValueError(f"{path}: metadata says rank={meta['rank']} but this head has rank={head.rank}")
    for key in ("sub_centers",):
        if meta[key] != getattr(head, key):
            raise ValueError(f"{path}: checkpoint has {key}={meta[key]} but this head has {key}={getattr(head, key)}")
    names = head.bank.state_names()
    empty = torch.zeros(0, dtype=torch.long, device=head.device)
    want = {}                              # state -> (row shape, dtype) the head holds
    for key in names:
        probe = head.bank.read(key, empty)
        want[key] = (tuple(probe.shape[1:]), probe.dtype)
    if optimizer_states == "zero":
        if "weight" not in specs:
            raise ValueError(f"{path}: holds no 'weight' (states {sorted(specs)})")
        sources = {key: "file" if key == "weight" else "zero" for key in names}
    else:
        if sorted(names) != sorted(specs):
            raise ValueError(f"{path}: checkpoint holds states {sorted(specs)} ({meta['optimizer']}) but this head "
                             f"holds {sorted(names)} (optimizer {head.optimizer}); load its centers alone with "
                             "optimizer_states='zero'")
        sources = {key: "file" for key in names}
    for key in names:
        if sources[key] != "file":
            continue
        shape, dtype = specs[key][:2]
        if dtype != want[key][1]:
            raise ValueError(f"{path}: state {key!r} is {dtype} but this head stores {want[key][1]}")
        if tuple(shape) != (head.num_rows,) + want[key][0]:
            raise ValueError(f"{path}: state {key!r} has shape {tuple(shape)}, this head holds "
                             f"{(head.num_rows,) + want[key][0]}")
    state = {key: meta[key] for key in head._META_FIELDS}
    state["margin_state"] = head._margin_state_from(head.margin_state_tensor(json.loads(meta["margin_state"])))
    verify_shard(path, chunk_bytes=chunk_bytes)
    # Checked: from here the head changes (staged rows dropped, counters set), then its bank, block by block.
    head.load_training_state(state)
    recorded = raw.get(CRC_KEY)
    crcs = dict(zip(meta["states"], recorded.split(","))) if recorded is not None else {}
    for key in names:
        row_shape, dtype = want[key]
        if sources[key] == "zero":
            row_bytes = max(1, torch.Size(row_shape).numel() * torch.empty((), dtype=dtype).element_size())
            zeros = torch.zeros((max(1, min(head.num_rows, chunk_bytes // row_bytes)),) + row_shape, dtype=dtype)
            for lo in range(0, head.num_rows, zeros.shape[0]):
                head.bank.load_rows(key, lo, zeros[:min(head.num_rows - lo, zeros.shape[0])])
            del zeros
            continue
        _stream_state(path, key, specs[key], crcs.get(key), chunk_bytes,
                      lambda lo, block, key=key: head.bank.load_rows(key, lo, block))


def _stream_state(path: str, key: str, spec: tuple, crc_want: str | None, chunk_bytes: int, sink) -> None:
    """Tensor ``key`` of shard ``path`` (``spec``: its header's shape, dtype and byte
    range) to ``sink(first_row, rows)``, a block of whole rows of at most
    ``chunk_bytes`` at a time (at least one row) read into one reused buffer: ``rows`` is
    a view of that buffer, valid until ``sink`` returns. The bytes are checked against
    ``crc_want`` as they pass; a mismatch or a short file raises after the blocks before it
    were handed over."""
    shape, dtype, begin, end = spec
    rows = shape[0]
    row_bytes = max(1, torch.Size(shape[1:]).numel() * torch.empty((), dtype=dtype).element_size())
    per = max(1, min(rows, chunk_bytes // row_bytes))
    buffer = torch.empty(per * row_bytes, dtype=torch.uint8)
    view = memoryview(buffer.numpy())
    crc = 0
    partly = "; the head is partly loaded: load the checkpoint again"
    with open(path, "rb") as f:
        f.seek(begin)
        for lo in range(0, rows, per):
            n = min(per, rows - lo)
            need, got = n * row_bytes, 0
            while got < need:
                step = f.readinto(view[got:need])
                if not step:
                    raise ShardReadError(f"{path}: ends inside tensor {key!r} (truncated while loading){partly}")
                got += step
            crc = zlib.crc32(view[:need], crc)
            sink(lo, buffer[:need].view(dtype).view((n,) + tuple(shape[1:])))
    if end - begin != rows * row_bytes:
        raise ShardReadError(f"{path}: tensor {key!r} spans {end - begin} bytes, not {rows} rows of {row_bytes}")
    if crc_want is not None and f"{crc:08x}" != crc_want:
        raise ShardChecksumError(_crc_message(path, key) + f" (it changed while loading){partly}")


# ---------------------------------------------------------------------- offline
class ShardSet:
    """The shards of one checkpoint of a head, checked from their headers alone
    (:func:`open_shards`): ``files[r]`` / ``metas[r]`` are rank ``r``'s file and
    parsed metadata, ``meta`` the fields every shard shares (``world_size`` is the
    source world size), ``states`` the state names and ``row_shapes`` /
    ``dtypes`` each state's trailing shape and dtype."""

    def __init__(self, directory: str, name: str, files: list[str], metas: list[dict], specs: list[dict]):
        self.directory, self.name = directory, name
        self.files, self.metas, self._specs = list(files), list(metas), list(specs)
        first = metas[0]
        self.meta = {k: first[k] for k in _COMMON_FIELDS}
        self.states = list(first["states"])
        self.row_shapes = {k: tuple(specs[0][k][0][1:]) for k in self.states}
        self.dtypes = {k: specs[0][k][1] for k in self.states}

    @property
    def world_size(self) -> int:
        return len(self.files)

    def row_range(self, rank: int) -> tuple[int, int]:
        """Rows ``[lo, hi)`` of the merged tensors that shard ``rank`` holds."""
        k = self.meta["sub_centers"]
        start = self.metas[rank]["class_start"]
        return start * k, (start + self.metas[rank]["num_local"]) * k

    def sources(self, start: int, end: int) -> list[int]:
        """The ranks whose shards hold rows of classes ``[start, end)``."""
        rows = class_rows(self.meta, start, end)
        lo, hi = rows.start, rows.stop
        return [r for r in range(self.world_size)
                if max(lo, self.row_range(r)[0]) < min(hi, self.row_range(r)[1])]

    def read_rows(self, start: int, end: int, *, verify: bool = True) -> dict[str, torch.Tensor]:
        """Every state's rows of classes ``[start, end)`` (``K`` rows per class), as
        new CPU tensors: only the shards holding them are opened and only those rows
        read (straight into the returned tensors), so the memory this needs is the
        returned rows plus a checksum pass's chunk. With ``verify`` each shard read
        from is checked against its checksums: one read in whole from the rows read,
        one read in part first, by a pass over the file (:func:`verify_shard`); pass
        False only when every shard of the set was verified already."""
        num_classes = self.meta["num_classes"]
        if not (isinstance(start, int) and isinstance(end, int) and 0 <= start <= end <= num_classes):
            raise ValueError(f"class range [{start!r}, {end!r}) is not within [0, {num_classes})")
        rows = class_rows(self.meta, start, end)
        lo, hi = rows.start, rows.stop
        out = {k: torch.empty((hi - lo,) + self.row_shapes[k], dtype=self.dtypes[k]) for k in self.states}
        for r in self.sources(start, end):
            r_lo, r_hi = self.row_range(r)
            a, b = max(lo, r_lo), min(hi, r_hi)
            whole = (a, b) == (r_lo, r_hi)
            if verify and not whole:
                verify_shard(self.files[r])
            for key, dst in out.items():
                _copy_rows(self.files[r], key, a - r_lo, b - r_lo, dst[a - lo:b - lo])
            if verify and whole:
                _check_rows(self.files[r], self.metas[r], {k: v[a - lo:b - lo] for k, v in out.items()})
        return out


def load_resharded(head, shards: ShardSet, *, verify: bool = True, chunk_bytes: int | None = None) -> None:
    """Load ``head``'s classes from ``shards``, a checkpoint of another world size
    (:func:`open_shards`), streamed: the classes are read ``chunk_bytes`` worth at a time
    (default :data:`READ_CHUNK_BYTES` per state; read from only the shards that hold
    them) and each block goes to the bank as rows (``bank.load_rows``), so the
    memory this needs is one block of every state, never the head's own shard.
    ``verify``: check the shards read from against their checksums first (a streamed
    pass; False when the caller checked every shard already). Everything is checked
    before the head changes: C, d, sub-centers, the states the head holds."""
    if chunk_bytes is None:
        chunk_bytes = READ_CHUNK_BYTES
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be a positive integer, got {chunk_bytes!r}")
    meta = shards.meta
    for key in ("num_classes", "embedding_size", "sub_centers"):
        if meta[key] != getattr(head, key):
            raise ValueError(f"{shards.directory}: head {shards.name!r} has {key}={meta[key]} but the model's has "
                             f"{getattr(head, key)}")
    names = head.bank.state_names()
    if sorted(names) != sorted(shards.states):
        raise ValueError(f"{shards.directory}: head {shards.name!r} holds states {sorted(shards.states)} "
                         f"({meta['optimizer']}) but this head holds {sorted(names)} (optimizer {head.optimizer})")
    empty = torch.zeros(0, dtype=torch.long, device=head.device)
    for key in names:
        want = tuple(head.bank.read(key, empty).shape[1:])
        if tuple(shards.row_shapes[key]) != want:
            raise ValueError(f"{shards.directory}: state {key!r} has rows of {tuple(shards.row_shapes[key])}, this "
                             f"head holds rows of {want}")
    lo, hi = head.class_start, head.class_end
    state = {"num_classes": head.num_classes, "embedding_size": head.embedding_size, "class_start": lo,
             "num_local": hi - lo, "sub_centers": head.sub_centers, "seed": meta["seed"],
             "sample_step": meta["sample_step"], "step_count": meta["step_count"]}
    state["margin_state"] = head._margin_state_from(head.margin_state_tensor(json.loads(meta["margin_state"])))
    if verify:
        for r in shards.sources(lo, hi):
            verify_shard(shards.files[r], chunk_bytes=chunk_bytes)
    head.load_training_state(state)
    k = head.sub_centers
    row_bytes = max(max(1, torch.Size(shards.row_shapes[key]).numel()) *
                    torch.empty((), dtype=shards.dtypes[key]).element_size() for key in names)
    per = max(1, chunk_bytes // (row_bytes * k))
    for c in range(lo, hi, per):
        part = shards.read_rows(c, min(hi, c + per), verify=False)
        for key in names:
            head.bank.load_rows(key, (c - lo) * k, part[key])
        del part


def _check_rows(path: str, meta: dict, tensors: dict[str, torch.Tensor]) -> None:
    """Every tensor of shard ``path``, as read into ``tensors``, against the CRC-32s
    its save recorded (``meta``: its parsed metadata)."""
    recorded = meta.get(CRC_KEY)
    if recorded is None:
        return
    values = recorded.split(",")
    if len(values) != len(meta["states"]):
        raise ShardChecksumError(f"{path}: {len(values)} checksums recorded for {len(meta['states'])} tensors")
    for name, want in zip(meta["states"], values):
        data = tensors[name].reshape(-1).view(torch.uint8).numpy()
        if f"{zlib.crc32(data):08x}" != want:
            raise ShardChecksumError(_crc_message(path, name))


def _copy_rows(path: str, key: str, a: int, b: int, dst: torch.Tensor) -> None:
    """Rows ``[a, b)`` of tensor ``key`` of ``path`` into ``dst``, read from the bytes
    at the offsets the file's header gives, straight into ``dst`` (one positional read,
    no mapping of the file, no intermediate copy: the memory this needs is ``dst``)."""
    _, specs = _read_header(path)
    if key not in specs:
        raise ShardReadError(f"{path}: holds no tensor {key!r} (the file changed while being read)")
    shape, dtype, begin, _ = specs[key]
    if dtype != dst.dtype or tuple(shape[1:]) != tuple(dst.shape[1:]) or not 0 <= a <= b <= shape[0] \
            or dst.shape[0] != b - a:
        raise ShardReadError(f"{path}: rows [{a}, {b}) of {key!r} are not in its {dtype} {tuple(shape)} as its "
                             f"header says now, expected {dst.dtype} rows of {tuple(dst.shape[1:])} (the file "
                             "changed while being read)")
    target = dst if dst.is_contiguous() else torch.empty_like(dst, memory_format=torch.contiguous_format)
    row_bytes = max(1, torch.Size(shape[1:]).numel()) * dst.element_size()
    view = memoryview(target.reshape(-1).view(torch.uint8).numpy())
    with open(path, "rb") as f:
        f.seek(begin + a * row_bytes)
        got = 0
        while got < len(view):
            step = f.readinto(view[got:])
            if not step:
                raise ShardReadError(f"{path}: ends inside tensor {key!r} (truncated while being read)")
            got += step
    if target is not dst:
        dst.copy_(target)


def open_shards(directory: str, *, name: str = "head", world_size: int | None = None) -> ShardSet:
    """The shards of head ``name`` in ``directory``, checked from their headers (no
    tensor data is read): exactly one world size present (or only the shards of
    ``world_size`` when given, ignoring others), ranks ``0..W-1`` all there, the
    shards agreeing on C, d, world size, seed, sampler/step counters, optimizer,
    states and dtypes, and their class ranges tiling ``[0, C)`` contiguously in the
    :class:`~ds_pfc.core.partition.Partition` layout. A truncated file or unreadable
    header raises :class:`ShardReadError`, a mismatch ValueError, naming the file."""
    shards = _list_shards(directory, name)
    if world_size is not None:
        shards = {w: files for w, files in shards.items() if w == world_size}
    if not shards:
        raise FileNotFoundError(f"no {name!r} head shards in {directory}"
                                + (f" for world_size={world_size}" if world_size is not None else ""))
    if len(shards) > 1:
        raise ValueError(f"{directory} holds {name!r} shards of several world sizes {sorted(shards)} "
                         "(extra shards of another run?); keep one set")
    (world, files), = shards.items()
    missing = [r for r in range(world) if r not in files]
    extra = sorted(r for r in files if r >= world)
    if extra:
        raise ValueError(f"{directory}: extra shard(s) for ranks {extra} outside world_size={world}")
    if missing:
        raise ValueError(f"{directory}: missing shard(s) for ranks {missing} of world_size={world}")
    metas, specs = [], []
    for r in range(world):
        raw, spec = _read_header(files[r])
        metas.append(_parse_meta(files[r], raw, {k: v[:2] for k, v in spec.items()}))
        specs.append(spec)
    first = metas[0]
    for r, meta in enumerate(metas):
        for key in _COMMON_FIELDS:
            if meta[key] != first[key]:
                raise ValueError(f"{files[r]}: {key}={meta[key]!r} differs from rank 0's {first[key]!r}")
        if meta["rank"] != r:
            raise ValueError(f"{files[r]}: metadata says rank={meta['rank']} but the file name says rank {r}")
        if meta["world_size"] != world:
            raise ValueError(f"{files[r]}: metadata says world_size={meta['world_size']} but the file name "
                             f"says {world}")
        for key in first["states"]:
            if specs[r][key][0][1:] != specs[0][key][0][1:]:
                raise ValueError(f"{files[r]}: state {key!r} has rows of shape {specs[r][key][0][1:]}, rank 0's "
                                 f"{specs[0][key][0][1:]}")
    C = first["num_classes"]
    order = sorted(range(world), key=lambda r: (metas[r]["class_start"], r))
    expected = 0
    for r in order:
        start, count = metas[r]["class_start"], metas[r]["num_local"]
        if start < expected:
            raise ValueError(f"{files[r]}: classes [{start}, {start + count}) overlap the previous shard, "
                             f"which ends at {expected}")
        if start > expected:
            raise ValueError(f"{directory}: classes [{expected}, {start}) are in no shard (gap before {files[r]})")
        expected = start + count
    if expected != C:
        raise ValueError(f"{directory}: the shards cover [0, {expected}) but num_classes={C}")
    partition = Partition(C, world)
    for r in range(world):
        bounds = (metas[r]["class_start"], metas[r]["class_start"] + metas[r]["num_local"])
        if bounds != partition.bounds(r):
            raise ValueError(f"{files[r]}: rank {r} holds classes {bounds}, expected {partition.bounds(r)}")
    return ShardSet(directory, name, [files[r] for r in range(world)], metas, specs)


def merge_shards(directory: str, *, name: str = "head",
                 world_size: int | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """Read every shard and return ``(tensors, meta)`` with full ``[C, ...]`` tensors.

    The checks of :func:`open_shards`, then every shard verified against its
    checksums and read into the merged tensors (no second copy). ``meta`` holds the
    common fields (``world_size`` is the source world size). To read one class range
    without the whole head use :func:`open_shards` and :meth:`ShardSet.read_rows`."""
    shards = open_shards(directory, name=name, world_size=world_size)
    return shards.read_rows(0, shards.meta["num_classes"]), dict(shards.meta)


def class_rows(meta: dict, start: int, end: int) -> slice:
    """The rows of classes ``[start, end)`` in merged tensors (``K`` rows per class)."""
    k = meta.get("sub_centers", 1)
    return slice(start * k, end * k)


def reshard(src_dir: str, dst_dir: str, world_size: int, *, name: str = "head") -> list[str]:
    """Rewrite the checkpoint in ``src_dir`` as ``world_size`` shards in ``dst_dir``.

    Exact: each new shard is the rows :class:`~ds_pfc.core.partition.Partition` gives it,
    read from the source shards that hold them (:meth:`ShardSet.read_rows`), so
    centers and optimizer states are bitwise those of the original run. Every source
    file is checked against its checksums first; one new shard is in memory at a
    time, and each is written with its own checksums. The metadata is
    carried over except the class range, rank and world size. ``seed`` and
    ``sample_step`` are carried over too, but the sampler is keyed by rank (and draws
    from each rank's local class range), so after a world-size change the sampled
    negative sets differ from what the original run would have drawn. That is
    expected; resumed training is then statistically, not bitwise, equivalent.

    ``dst_dir`` must differ from ``src_dir`` and hold no shards of ``name`` of another
    world size. Returns the written paths."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if os.path.isdir(dst_dir) and os.path.samefile(src_dir, dst_dir):
        raise ValueError("reshard: dst_dir must differ from src_dir")
    if os.path.isdir(dst_dir):
        other = sorted(w for w in _list_shards(dst_dir, name) if w != world_size)
        if other:
            raise ValueError(f"{dst_dir} already holds {name!r} shards for world_size={other}; use an empty directory")
    shards = open_shards(src_dir, name=name)
    for path in shards.files:        # each source file checked once, before anything is written
        verify_shard(path)
    meta = dict(shards.meta)
    partition = Partition(meta["num_classes"], world_size)
    paths = []
    for rank in range(world_size):     # one destination shard in memory at a time
        start, end = partition.bounds(rank)
        part = shards.read_rows(start, end, verify=False)
        shard_meta = dict(meta, class_start=start, num_local=end - start, world_size=world_size, rank=rank)
        path = os.path.join(dst_dir, shard_file_name(name, rank, world_size))
        specs = {k: (tuple(v.shape), v.dtype) for k, v in part.items()}
        paths.append(_atomic_stream_save(specs, lambda key, part=part: _row_chunks(part[key]), path,
                                         _metadata(shard_meta, {k: v[1] for k, v in specs.items()})))
        del part
    return paths


def _row_chunks(tensor: torch.Tensor):
    """``tensor`` in row blocks of about ``SAVE_CHUNK_BYTES``."""
    row_bytes = max(1, tensor[:1].numel() * tensor.element_size())
    step = max(1, SAVE_CHUNK_BYTES // row_bytes)
    for lo in range(0, tensor.shape[0], step):
        yield tensor[lo:lo + step]


def export_classifier(directory: str, out_path: str, *, name: str = "head", include_optimizer: bool = False,
                      dominant: torch.Tensor | None = None) -> str:
    """Write one safetensors file with the full ``weight [C K, d]`` (``K =
    sub_centers``, row ``c K + k`` the k-th sub-center of class c; ``[C, d]`` without
    sub-centers) and, if ``include_optimizer``, the optimizer states as
    ``optimizer.<state>``, plus metadata (format, num_classes, embedding_size,
    sub_centers, seed, sample_step, step_count, optimizer, source_world_size).
    ``dominant`` (int64 ``[C]``, see :func:`dominant_subcenters`) also writes
    ``dominant [C]`` and ``weight_dominant [C, d]``, each class's dominant sub-center.
    Atomic. Returns ``out_path``."""
    tensors, meta = merge_shards(directory, name=name)
    out = {"weight": tensors["weight"]}
    if dominant is not None:
        out.update(_dominant_tensors(tensors["weight"], dominant, meta["num_classes"], meta["sub_centers"]))
    if include_optimizer:
        out.update({f"optimizer.{k}": v for k, v in tensors.items() if k != "weight"})
    metadata = {"format": CLASSIFIER_FORMAT, "optimizer": meta["optimizer"], "source_world_size": str(meta["world_size"]),
                "dtypes": json.dumps({k: _dtype_name(v.dtype) for k, v in out.items()}),
                "torch_version": torch.__version__}
    for key in ("num_classes", "embedding_size", "sub_centers", "seed", "sample_step", "step_count"):
        metadata[key] = str(meta[key])
    return _atomic_save(out, out_path, metadata)


def _dominant_tensors(weight: torch.Tensor, dominant: torch.Tensor, num_classes: int, k: int) -> dict:
    dominant = torch.as_tensor(dominant)
    if dominant.dtype != torch.int64 or tuple(dominant.shape) != (num_classes,) or \
            (dominant.numel() and (int(dominant.min()) < 0 or int(dominant.max()) >= k)):
        raise ValueError(f"dominant must be int64 [{num_classes}] with values in [0, {k}), got "
                         f"{dominant.dtype} {tuple(dominant.shape)}")
    rows = torch.arange(num_classes) * k + dominant
    return {"dominant": dominant.clone(), "weight_dominant": weight[rows].contiguous()}


class SubcenterCounter:
    """Counts, per class, which of its ``K`` sub-centers each sample of the class is
    closest to: the sub-center paper's dominance statistic. Feed it the (trained)
    embeddings and labels of the training data, batch by batch; :meth:`dominant` is
    then, per class, the sub-center most of its samples picked (ties: the smaller
    index; a class no sample reached: 0).

    ``weight`` is the merged ``[C K, d]`` classifier (:func:`merge_shards`)."""

    def __init__(self, weight: torch.Tensor, sub_centers: int):
        if isinstance(sub_centers, bool) or not isinstance(sub_centers, int) or sub_centers < 1:
            raise ValueError(f"sub_centers must be a positive int, got {sub_centers!r}")
        if weight.dim() != 2 or weight.shape[0] % sub_centers:
            raise ValueError(f"weight must be [C * {sub_centers}, d], got {tuple(weight.shape)}")
        self.k = sub_centers
        self.num_classes = weight.shape[0] // sub_centers
        self.centers = torch.nn.functional.normalize(weight.float(), dim=1).view(self.num_classes, self.k, -1)
        self.counts = torch.zeros(self.num_classes, self.k, dtype=torch.int64)

    def update(self, embeddings: torch.Tensor, labels: torch.Tensor) -> None:
        labels = labels.to(torch.int64).cpu()
        if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= self.num_classes):
            raise ValueError(f"labels must lie in [0, {self.num_classes})")
        x = torch.nn.functional.normalize(embeddings.detach().float().cpu(), dim=1)
        sim = torch.einsum("nd,nkd->nk", x, self.centers[labels])
        self.counts.index_put_((labels, _first_max(sim)), torch.ones_like(labels), accumulate=True)

    def dominant(self) -> torch.Tensor:
        return _first_max(self.counts)


def _first_max(x: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax, ties to the smallest index."""
    index = torch.arange(x.shape[1]).expand_as(x)
    return torch.where(x == x.max(dim=1, keepdim=True).values, index, x.shape[1]).min(dim=1).values
