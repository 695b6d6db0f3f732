"""A row store backed by a file, read and written through DeepSpeed's async I/O op.

``NvmeStore`` keeps ``[num_rows, width]`` rows (``[num_rows]`` when ``width == 0``) of
one storage dtype in a file and moves them with DeepSpeed's ``async_io`` op
(``deepspeed.ops.op_builder.AsyncIOBuilder``; libaio, ``O_DIRECT``). Host memory holds
only a page-locked staging buffer, a one-header buffer and the per-row versions.

File format (version 1; all integers little-endian)
---------------------------------------------------
``align`` is the I/O alignment unit, ``4096 * intra_op_parallelism`` bytes at creation
(a multiple of the ``1024 * intra_op_parallelism`` DeepSpeed needs, and of the 4 KiB
sector of 4Kn drives).

* Header, bytes ``[0, align)``: the struct ``<8sIIQQ16sIIQQQQQQQQ`` followed by a
  CRC-32 (``I``) of those bytes, then zeros up to ``align``. Fields in order:
  magic ``b"DSPFCNV\\0"``, format version (1), clean flag (1: the versions file
  matches the data; 0: data may have been written after the last versions flush),
  num_rows, width, dtype name (ASCII, NUL padded, e.g. ``"bfloat16"``), element size,
  reserved (0), block_rows, row_bytes (``max(width, 1) * element size``),
  block_bytes (``block_rows * row_bytes`` rounded up to ``align``), num_blocks
  (``ceil(num_rows / block_rows)``), align, data_offset (``align``), file_bytes
  (``data_offset + num_blocks * block_bytes``), stamp (a random 64-bit value that the
  versions file must repeat).
* Data, bytes ``[data_offset, file_bytes)``: ``num_blocks`` blocks of ``block_bytes``
  each. Block ``b`` holds rows ``[b * block_rows, (b + 1) * block_rows)`` packed row
  after row in the storage dtype; the rest of the block (padding, and the rows past
  ``num_rows`` in the last block) is zero. Every I/O offset and size is a multiple of
  ``align`` (DeepSpeed's op does not report misaligned writes: they silently leave an
  empty file, and reading past the end of a file aborts the process).

Versions file ``<path>.versions``: the struct ``<8sIIQQI`` (magic ``b"DSPFCVR\\0"``,
format version, reserved, num_rows, stamp, CRC-32 of the payload), then the payload:
``num_rows`` int64 counts. It is replaced atomically (write to ``<path>.versions.tmp``,
fsync, rename).

Durability protocol: the first ``scatter``/``write_all`` after an open or a flush
writes the header with clean = 0 before any data. ``flush()`` (and ``close()``) fsyncs
the data, writes the versions file with a fresh stamp, then the header with
clean = 1 and that stamp. Opening a file whose header says clean = 0 (a process died
between a write and the next flush) raises ``DirtyStoreError`` unless
``allow_dirty=True``; such an open loads the versions file if it is readable (else
zeros) and sets ``opened_dirty``: its versions may lag the data.

Use from one thread at a time. Gathers and scatters work through a staging buffer of
``stage_bytes`` (default 16 MiB), in batches: the blocks that hold requested rows are
read (adjacent blocks coalesced into one request), rows are picked or patched, and
touched blocks are written back (blocks whose rows are all overwritten are not read).
"""
from __future__ import annotations

import errno
import os
import resource
import secrets
import shutil
import struct
import zlib

import torch

from .._checks import check_int
from .stores import RowStore, pinned_empty

__all__ = ["NvmeStore", "DirtyStoreError", "load_aio_op", "SUPPORTED_DTYPES"]

MAGIC = b"DSPFCNV\x00"
VERSIONS_MAGIC = b"DSPFCVR\x00"
FORMAT_VERSION = 1
SECTOR = 4096                      # base alignment unit (bytes), times intra_op_parallelism
TARGET_BLOCK_BYTES = 128 * 1024    # default block size aimed at (64-256 KiB)
DEFAULT_STAGE_BYTES = 16 * 1024 * 1024
AIO_BLOCK_SIZE = 1024 * 1024       # bytes per libaio request inside one op

_HEADER = struct.Struct("<8sIIQQ16sIIQQQQQQQQ")
_CRC = struct.Struct("<I")
_VHEADER = struct.Struct("<8sIIQQI")

SUPPORTED_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
    "bfloat16": torch.bfloat16, "int64": torch.int64, "int32": torch.int32,
    "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8,
}
_DTYPE_NAMES = {v: k for k, v in SUPPORTED_DTYPES.items()}


class DirtyStoreError(ValueError):
    """The file holds data written after its versions were last saved."""


# ----------------------------------------------------------------------------- aio op
_AIO_OP = None
_LOCKED_BYTES = 0  # page-locked bytes this module holds (for the RLIMIT_MEMLOCK check)


def load_aio_op():
    """DeepSpeed's ``async_io`` op, loaded (JIT-built on first use) once per process.

    Raises RuntimeError when the op cannot work here (libaio missing)."""
    global _AIO_OP
    if _AIO_OP is not None:
        return _AIO_OP
    hint = ("DeepSpeed's async_io op is unavailable: it needs libaio. Install the Debian "
            "package libaio-dev (apt-get install -y libaio-dev) and retry")
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder
    except Exception as exc:  # pragma: no cover - deepspeed is a dependency
        raise RuntimeError(f"cannot import deepspeed's AsyncIOBuilder ({exc}); {hint}") from exc
    builder = AsyncIOBuilder()
    if not builder.is_compatible():
        raise RuntimeError(hint)
    try:
        _AIO_OP = builder.load()
    except Exception as exc:
        raise RuntimeError(f"{hint} (loading failed: {exc})") from exc
    return _AIO_OP


def _lock_budget() -> int | None:
    """Bytes this process may still lock, or None if unlimited."""
    if os.geteuid() == 0:
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY:
        return None
    return max(0, soft - _LOCKED_BYTES)


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def _fsync_path(path: str, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------- store
def _lock_file(path: str, create: bool) -> int:
    """Open ``path`` and hold an exclusive flock on it while the store is open: two
    stores on one file (two banks with the same name, classes and directory) would
    overwrite each other's rows. Returns the descriptor that holds the lock."""
    import fcntl
    directory = os.path.dirname(os.path.abspath(path))
    if create and not os.path.isdir(directory):
        raise FileNotFoundError(errno.ENOENT, f"NvmeStore: directory {directory!r} does not exist "
                                f"(creating {path!r})", directory)
    if not create and not os.path.exists(path):
        raise FileNotFoundError(errno.ENOENT, f"NvmeStore: file {path!r} not found", path)
    fd = os.open(path, (os.O_RDWR | os.O_CREAT) if create else os.O_RDONLY, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RuntimeError(f"NvmeStore: {path!r} is in use by another open store (another head or bank with the "
                           "same classes and nvme_dir); give each head its own nvme_dir") from None
    except BaseException:
        os.close(fd)
        raise
    return fd


class NvmeStore(RowStore):
    """Rows in a file, moved with DeepSpeed async I/O (see the module docstring).

    ``create=True`` makes (or overwrites) ``path``: zeros, or ``init``. ``create=False``
    opens an existing file and checks it against ``num_rows``/``width``/``dtype`` (and
    ``block_rows`` when given). ``versions`` (int64 ``[num_rows]``, CPU) counts the
    completed scatters of each row (``write_all`` counts as one for every row); it is
    saved by ``flush``/``close`` and restored on open.
    """

    tier = "nvme"

    def __init__(self, path, num_rows: int, width: int, dtype: torch.dtype, *, create: bool,
                 init: torch.Tensor | None = None, block_rows: int | None = None,
                 intra_op_parallelism: int = 1, queue_depth: int = 32,
                 stage_bytes: int = DEFAULT_STAGE_BYTES, allow_dirty: bool = False):
        self._closed = True  # until fully built: close()/__del__ are no-ops
        self._handle = None
        self._locked: list[torch.Tensor] = []
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
        path = os.fspath(path)
        if not isinstance(path, str):
            raise TypeError("path must be a text path, not bytes")
        check_int("num_rows", num_rows, 0)
        check_int("width", width, 0)
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}")
        if dtype not in _DTYPE_NAMES:
            raise ValueError(f"dtype {dtype} is not supported; supported: {sorted(SUPPORTED_DTYPES)}")
        if not isinstance(create, bool):
            raise TypeError(f"create must be a bool, got {type(create).__name__}")
        if block_rows is not None:
            check_int("block_rows", block_rows, 1)
        check_int("intra_op_parallelism", intra_op_parallelism, 1)
        check_int("queue_depth", queue_depth, 1)
        check_int("stage_bytes", stage_bytes, 1)
        if init is not None:
            if not create:
                raise ValueError("init is only used with create=True")
            if not isinstance(init, torch.Tensor):
                raise TypeError(f"init must be a torch.Tensor, got {type(init).__name__}")
        super().__init__(num_rows, width, dtype)
        if init is not None and tuple(init.shape) != self.shape:
            raise ValueError(f"init must have shape {list(self.shape)}, got {list(init.shape)}")
        self.path = path
        self.versions_path = path + ".versions"
        self.intra_op_parallelism = intra_op_parallelism
        self.opened_dirty = False
        self._row_elems = max(width, 1)

        existed = os.path.exists(path)
        self._lock_fd = _lock_file(path, create)
        try:
            if create:
                self._layout_new(block_rows)
                self._create(init, queue_depth, stage_bytes)
            else:
                self._open(block_rows, allow_dirty, queue_depth, stage_bytes)
        except BaseException:
            self._release_lock()
            if create and not existed and os.path.exists(path):     # never leave the empty file behind
                os.unlink(path)
            raise

    # ------------------------------------------------------------------ layout / header
    def _layout_new(self, block_rows):
        self._align = SECTOR * self.intra_op_parallelism
        rb = self.row_bytes()
        if block_rows is None:
            br = max(1, TARGET_BLOCK_BYTES // rb)
            br = max(1, _round_up(br * rb, self._align) // rb)  # fill the padded block
            block_rows = min(br, max(self.num_rows, 1))
        self._set_layout(block_rows)
        self._clean = 1
        self._stamp = 0

    def _set_layout(self, block_rows):
        self.block_rows = block_rows
        self._block_bytes = _round_up(block_rows * self.row_bytes(), self._align)
        self._num_blocks = -(-self.num_rows // block_rows)
        self._data_offset = self._align
        self._file_bytes = self._data_offset + self._num_blocks * self._block_bytes

    def _header_bytes(self) -> bytes:
        body = _HEADER.pack(MAGIC, FORMAT_VERSION, self._clean, self.num_rows, self.width,
                            _DTYPE_NAMES[self.dtype].encode(), torch.empty((), dtype=self.dtype).element_size(),
                            0, self.block_rows, self.row_bytes(), self._block_bytes, self._num_blocks,
                            self._align, self._data_offset, self._file_bytes, self._stamp)
        return body + _CRC.pack(zlib.crc32(body))

    def _write_header(self):
        raw = self._header_bytes()
        buf = self._hdr_buf
        buf.zero_()
        buf[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        self._io([(True, buf, 0)], read=False)

    # ------------------------------------------------------------------ create / open
    def _create(self, init, queue_depth, stage_bytes):
        directory = os.path.dirname(os.path.abspath(self.path))
        if not os.path.isdir(directory):
            raise FileNotFoundError(errno.ENOENT, f"NvmeStore: directory {directory!r} does not exist "
                                    f"(creating {self.path!r})", directory)
        load_aio_op()
        versions_bytes = _VHEADER.size + 8 * self.num_rows
        needed = self._file_bytes + versions_bytes
        reclaim = sum(os.path.getsize(p) for p in (self.path, self.versions_path) if os.path.isfile(p))
        free = shutil.disk_usage(directory).free + reclaim
        if needed > free:
            raise OSError(errno.ENOSPC, f"NvmeStore: not enough free disk space for {self.path!r}: "
                          f"needs {needed} bytes, {free} bytes free")
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            try:
                os.posix_fallocate(fd, 0, self._file_bytes)
            except OSError as exc:
                if exc.errno == errno.ENOSPC:
                    raise OSError(errno.ENOSPC, f"NvmeStore: not enough free disk space for {self.path!r}: "
                                  f"needs {needed} bytes") from exc
                os.ftruncate(fd, self._file_bytes)  # fallocate unsupported here: sparse zeros
        except BaseException:
            os.close(fd)
            os.unlink(self.path)
            raise
        os.close(fd)
        self._stamp = secrets.randbits(63)
        self.versions = torch.zeros(self.num_rows, dtype=torch.int64)
        try:
            self._setup(queue_depth, stage_bytes)
            if init is not None and self.num_rows:
                self._write_rows(torch.arange(self.num_rows), init)
            self._dirty = True
            self.flush()
            size = os.path.getsize(self.path)
            if size != self._file_bytes:  # the op's silent failure mode: never go on with it
                raise OSError(errno.EIO, f"NvmeStore: {self.path!r} is {size} bytes after creation, "
                              f"expected {self._file_bytes}")
        except BaseException:
            self._dirty = False  # never mark a half-written file clean
            self.close()
            for p in (self.path, self.versions_path):
                if os.path.exists(p):
                    os.unlink(p)
            raise

    def _open(self, block_rows, allow_dirty, queue_depth, stage_bytes):
        path = self.path
        if not os.path.exists(path):
            raise FileNotFoundError(errno.ENOENT, f"NvmeStore: file {path!r} not found", path)
        actual = os.path.getsize(path)
        with open(path, "rb") as f:
            raw = f.read(_HEADER.size + _CRC.size)
        if len(raw) < len(MAGIC) or raw[:len(MAGIC)] != MAGIC:
            raise ValueError(f"NvmeStore: {path!r} is not a ds_pfc NvmeStore file (bad magic)")
        if len(raw) < _HEADER.size + _CRC.size:
            raise ValueError(f"NvmeStore: {path!r} is truncated: {actual} bytes, shorter than its header")
        body, (crc,) = raw[:_HEADER.size], _CRC.unpack(raw[_HEADER.size:])
        if zlib.crc32(body) != crc:
            raise ValueError(f"NvmeStore: {path!r} has a corrupted header (CRC mismatch)")
        (_, version, clean, f_rows, f_width, f_dtype, f_esize, _, f_br, f_rb, f_bb, f_nb, f_align,
         f_doff, f_fbytes, stamp) = _HEADER.unpack(body)
        if version != FORMAT_VERSION:
            raise ValueError(f"NvmeStore: {path!r} has format version {version}, this code reads "
                             f"version {FORMAT_VERSION}")
        f_dtype = f_dtype.rstrip(b"\x00").decode("ascii", "replace")
        expected = {"num_rows": self.num_rows, "width": self.width, "dtype": _DTYPE_NAMES[self.dtype]}
        found = {"num_rows": f_rows, "width": f_width, "dtype": f_dtype}
        if block_rows is not None:
            expected["block_rows"], found["block_rows"] = block_rows, f_br
        bad = [f"{k}: expected {expected[k]}, found {found[k]}" for k in expected if expected[k] != found[k]]
        if bad:
            raise ValueError(f"NvmeStore: {path!r} was made for another store: " + "; ".join(bad))
        self._align = f_align
        if f_br < 1 or f_align < SECTOR or f_align % SECTOR:
            raise ValueError(f"NvmeStore: {path!r} has an inconsistent header (block_rows {f_br}, align {f_align})")
        self._set_layout(f_br)
        derived = (torch.empty((), dtype=self.dtype).element_size(), self.row_bytes(), self._block_bytes,
                   self._num_blocks, self._data_offset, self._file_bytes)
        if (f_esize, f_rb, f_bb, f_nb, f_doff, f_fbytes) != derived:
            raise ValueError(f"NvmeStore: {path!r} has an inconsistent header (sizes "
                             f"{(f_esize, f_rb, f_bb, f_nb, f_doff, f_fbytes)}, expected {derived})")
        if actual != self._file_bytes:
            what = "truncated" if actual < self._file_bytes else "longer than its header says"
            raise ValueError(f"NvmeStore: {path!r} is {what}: expected {self._file_bytes} bytes, "
                             f"found {actual}")
        need = SECTOR * self.intra_op_parallelism
        if self._align % need:
            raise ValueError(f"NvmeStore: {path!r} was created with {self._align}-byte alignment, which "
                             f"intra_op_parallelism={self.intra_op_parallelism} cannot use (needs a "
                             f"multiple of {need}); use intra_op_parallelism dividing {self._align // SECTOR}")
        if not clean and not allow_dirty:
            raise DirtyStoreError(
                f"NvmeStore: {path!r} is dirty: data was written after its versions were last flushed "
                f"(the writer did not flush/close). Its per-row versions may be stale; pass "
                f"allow_dirty=True to open it anyway")
        versions = self._load_versions(stamp, strict=bool(clean))
        self._clean, self._stamp = clean, stamp
        load_aio_op()
        self._setup(queue_depth, stage_bytes)
        self.versions = versions
        if not clean:
            self.opened_dirty = True
            self._dirty = True  # the next flush/close accepts the data as is

    def _load_versions(self, stamp, strict):
        vp = self.versions_path
        try:
            with open(vp, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            if strict:
                raise FileNotFoundError(errno.ENOENT, f"NvmeStore: versions file {vp!r} of {self.path!r} "
                                        f"not found", vp) from None
            return torch.zeros(self.num_rows, dtype=torch.int64)
        problem = None
        if len(raw) < _VHEADER.size or raw[:8] != VERSIONS_MAGIC:
            problem = "not a versions file (bad magic)"
        else:
            magic, version, _, rows, vstamp, crc = _VHEADER.unpack(raw[:_VHEADER.size])
            payload = raw[_VHEADER.size:]
            if version != FORMAT_VERSION:
                problem = f"format version {version}, expected {FORMAT_VERSION}"
            elif rows != self.num_rows or len(payload) != 8 * rows:
                problem = f"holds {len(payload) // 8} rows (header {rows}), expected {self.num_rows}"
            elif zlib.crc32(payload) != crc:
                problem = "corrupted (CRC mismatch)"
            elif vstamp != stamp and strict:
                problem = "stale: its stamp does not match the data file's (it belongs to another flush)"
        if problem is not None:
            if strict:
                raise ValueError(f"NvmeStore: versions file {vp!r}: {problem}")
            return torch.zeros(self.num_rows, dtype=torch.int64)
        if self.num_rows == 0:
            return torch.zeros(0, dtype=torch.int64)
        return torch.frombuffer(bytearray(payload), dtype=torch.int64).clone()

    def _setup(self, queue_depth, stage_bytes):
        """The aio handle and the page-locked buffers."""
        op = load_aio_op()
        self._handle = op.aio_handle(AIO_BLOCK_SIZE, queue_depth, False, True, self.intra_op_parallelism)
        self._pending = 0
        self._stage_blocks = min(self._num_blocks, max(1, stage_bytes // self._block_bytes))
        want = self._align + self._stage_blocks * self._block_bytes
        budget = _lock_budget()
        if budget is not None and want > budget:
            fit = (budget - self._align) // self._block_bytes
            if fit < min(1, self._num_blocks):
                raise RuntimeError(
                    f"NvmeStore: cannot page-lock {self._align + self._block_bytes} bytes for I/O buffers "
                    f"(RLIMIT_MEMLOCK leaves {budget}); raise the limit (ulimit -l) or use smaller block_rows")
            self._stage_blocks = min(self._stage_blocks, fit)
        self._closed = False
        self._dirty = False
        example = torch.empty(0, dtype=torch.uint8)
        self._hdr_buf = self._alloc_locked(self._align, example)
        if self._stage_blocks:
            self._stage = self._alloc_locked(self._stage_blocks * self._block_bytes, example)
            self._stage.zero_()
            block_elems = self._block_bytes // torch.empty((), dtype=self.dtype).element_size()
            # [slot, row in block, element]: the used part of each staged block
            self._stage_rows = self._stage.view(self.dtype).as_strided(
                (self._stage_blocks, self.block_rows, self._row_elems), (block_elems, self._row_elems, 1))
            # Faster picking when a padded block is a whole number of rows: staging as
            # [slot * rows_per_slot + row in block, element], for index_select/index_copy_.
            self._slot_rows = block_elems // self._row_elems if block_elems % self._row_elems == 0 else 0
            if self._slot_rows:
                self._stage_flat = self._stage.view(self.dtype).view(-1, self._row_elems)
        else:
            self._stage = None

    def _alloc_locked(self, nbytes, example):
        global _LOCKED_BYTES
        t = self._handle.new_cpu_locked_tensor(nbytes, example)
        if t.numel() != nbytes or t.data_ptr() == 0:
            raise RuntimeError(f"NvmeStore: could not page-lock {nbytes} bytes")
        self._locked.append(t)
        _LOCKED_BYTES += nbytes
        return t

    # ------------------------------------------------------------------ raw I/O
    def _io(self, requests, read: bool):
        """Submit ``(ok, buffer, file_offset)`` requests asynchronously, then wait for all."""
        submit = self._handle.async_pread if read else self._handle.async_pwrite
        error = None
        try:
            for _, buf, offset in requests:
                nbytes = buf.numel() * buf.element_size()
                if offset % SECTOR or nbytes % self._align or not buf.is_contiguous():
                    raise RuntimeError(f"NvmeStore internal error: misaligned I/O (offset {offset}, "
                                       f"{nbytes} bytes, alignment {self._align})")
                if read and offset + nbytes > self._file_bytes:
                    raise RuntimeError("NvmeStore internal error: read past the end of the file")
                if submit(buf, self.path, offset) != 0:
                    raise OSError(errno.EIO, f"NvmeStore: async {'read' if read else 'write'} of {nbytes} "
                                  f"bytes at {offset} in {self.path!r} failed to start")
                self._pending += 1
        except BaseException as exc:
            error = exc
        if self._pending:
            done = self._handle.wait()
            expected, self._pending = self._pending, 0
            if error is None and done != expected:
                error = OSError(errno.EIO, f"NvmeStore: {expected} I/O requests on {self.path!r}, "
                                f"{done} completed")
        if error is not None:
            raise error

    def _check_file(self):
        if self._closed:
            raise RuntimeError(f"NvmeStore {self.path!r} is closed")
        try:
            size = os.path.getsize(self.path)
        except FileNotFoundError:
            raise FileNotFoundError(errno.ENOENT, f"NvmeStore: file {self.path!r} disappeared", self.path) from None
        if size < self._file_bytes:  # reading past the end would abort the process
            raise ValueError(f"NvmeStore: {self.path!r} is truncated: expected {self._file_bytes} bytes, "
                             f"found {size}")

    @staticmethod
    def _runs(blocks: list[int], slots: list[int]):
        """Maximal ``(slot, block, count)`` runs, consecutive in both slot and block."""
        runs = []
        for s, b in zip(slots, blocks):
            if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == b:
                runs[-1][2] += 1
            else:
                runs.append([s, b, 1])
        return runs

    def _requests(self, runs):
        bb = self._block_bytes
        return [(True, self._stage[s * bb:(s + c) * bb], self._data_offset + b * bb) for s, b, c in runs]

    def _check_rows(self, rows) -> torch.Tensor:
        if not isinstance(rows, torch.Tensor):
            raise TypeError(f"rows must be a torch.Tensor, got {type(rows).__name__}")
        if rows.dim() != 1 or rows.is_floating_point() or rows.is_complex() or rows.dtype == torch.bool:
            raise TypeError(f"rows must be a 1-D integer tensor, got {rows.dtype} of shape {list(rows.shape)}")
        rows = rows.to(device="cpu", dtype=torch.int64)
        if rows.numel():
            lo, hi = int(rows.min()), int(rows.max())
            if lo < 0 or hi >= self.num_rows:
                raise ValueError(f"rows must lie in [0, {self.num_rows}), got values in [{lo}, {hi}]")
        return rows

    def _plan(self, rows_sorted: torch.Tensor):
        """Blocks of the (sorted) rows, and per staging batch the slice of rows it serves."""
        blk = rows_sorted // self.block_rows
        ublocks, inverse, counts = torch.unique_consecutive(blk, return_inverse=True, return_counts=True)
        n_ub = ublocks.numel()
        edges = torch.arange(0, n_ub + self._stage_blocks, self._stage_blocks).clamp_(max=n_ub)
        row_edges = torch.searchsorted(inverse, edges).tolist()
        return blk, ublocks, inverse, counts, edges.tolist(), row_edges

    # ------------------------------------------------------------------ RowStore API
    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        rows = self._check_rows(rows)
        self._check_file()
        n = rows.numel()
        out = pinned_empty((n,) + self.row_shape, self.dtype)
        if n == 0:
            return out
        perm = None
        if n > 1 and not bool((rows[1:] >= rows[:-1]).all()):
            rows, perm = torch.sort(rows)
        flat = out.view(n, self._row_elems) if perm is None else torch.empty(n, self._row_elems, dtype=self.dtype)
        blk, ublocks, inverse, _, edges, row_edges = self._plan(rows)
        ub = ublocks.tolist()
        for k in range(len(edges) - 1):
            i0, i1, r0, r1 = edges[k], edges[k + 1], row_edges[k], row_edges[k + 1]
            if i0 == i1:
                continue
            self._io(self._requests(self._runs(ub[i0:i1], list(range(i1 - i0)))), read=True)
            slots, inb = inverse[r0:r1] - i0, rows[r0:r1] - blk[r0:r1] * self.block_rows
            if self._slot_rows:
                torch.index_select(self._stage_flat, 0, slots * self._slot_rows + inb, out=flat[r0:r1])
            else:
                flat[r0:r1] = self._stage_rows[slots, inb]
        if perm is not None:
            out.view(n, self._row_elems)[perm] = flat
        return out

    def scatter(self, rows: torch.Tensor, values: torch.Tensor) -> None:
        rows = self._check_rows(rows)
        self._check_file()
        values = self._check_values(values, rows.numel(), "values")
        if rows.numel() == 0:
            return
        self._write_rows(rows, values)
        self.versions.index_put_((rows,), torch.ones(1, dtype=torch.int64), accumulate=True)

    def _check_values(self, values, n, name):
        if not isinstance(values, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(values).__name__}")
        want = (n,) + self.row_shape
        if tuple(values.shape) != want:
            raise ValueError(f"{name} must have shape {list(want)}, got {list(values.shape)}")
        return values

    def _write_rows(self, rows: torch.Tensor, values: torch.Tensor) -> None:
        n = rows.numel()
        values = values.detach().to(device="cpu", dtype=self.dtype).reshape(n, self._row_elems)
        if n > 1 and not bool((rows[1:] > rows[:-1]).all()):
            rows, perm = torch.sort(rows)
            if n > 1 and bool((rows[1:] == rows[:-1]).any()):
                raise ValueError("rows passed to scatter must be unique")
            values = values[perm]
        if not self._dirty:
            self._clean = 0
            self._write_header()  # mark dirty before any data changes
            self._dirty = True
        blk, ublocks, inverse, counts, edges, row_edges = self._plan(rows)
        br, last = self.block_rows, self._num_blocks - 1
        full = torch.full_like(ublocks, br)
        full[ublocks == last] = self.num_rows - last * br
        partial = (counts < full).tolist()
        ub = ublocks.tolist()
        phantom = self._num_blocks * br - self.num_rows  # rows past num_rows in the last block
        for k in range(len(edges) - 1):
            i0, i1, r0, r1 = edges[k], edges[k + 1], row_edges[k], row_edges[k + 1]
            if i0 == i1:
                continue
            need = [i for i in range(i0, i1) if partial[i]]
            if need:
                self._io(self._requests(self._runs([ub[i] for i in need], [i - i0 for i in need])), read=True)
            if phantom and ub[i1 - 1] == last:
                self._stage_rows[i1 - 1 - i0, br - phantom:] = 0
            slots, inb = inverse[r0:r1] - i0, rows[r0:r1] - blk[r0:r1] * br
            if self._slot_rows:
                self._stage_flat.index_copy_(0, slots * self._slot_rows + inb, values[r0:r1])
            else:
                self._stage_rows[slots, inb] = values[r0:r1]
            self._io(self._requests(self._runs(ub[i0:i1], list(range(i1 - i0)))), read=False)

    def read_all(self) -> torch.Tensor:
        return self.gather(torch.arange(self.num_rows))

    def write_all(self, values: torch.Tensor) -> None:
        self._check_file()
        self._check_values(values, self.num_rows, "values")
        if self.num_rows == 0:
            return
        rows = torch.arange(self.num_rows)
        self._write_rows(rows, values)
        self.versions += 1

    def nbytes(self) -> int:
        """Host memory held: the page-locked buffers and the versions (not the file)."""
        if self._closed:
            return 0
        return sum(t.numel() * t.element_size() for t in self._locked) + self.versions.numel() * 8

    def file_bytes(self) -> int:
        """Size of the data file in bytes (the versions file adds 32 + 8 * num_rows)."""
        return self._file_bytes

    def flush(self) -> None:
        """Make every completed scatter durable: fsync the data, save the versions,
        mark the file clean."""
        if self._closed:
            raise RuntimeError(f"NvmeStore {self.path!r} is closed")
        if not self._dirty:
            return
        self._check_file()
        _fsync_path(self.path)
        stamp = secrets.randbits(63)
        payload = self.versions.contiguous().numpy().tobytes()
        head = _VHEADER.pack(VERSIONS_MAGIC, FORMAT_VERSION, 0, self.num_rows, stamp, zlib.crc32(payload))
        tmp = self.versions_path + ".tmp"
        with open(tmp, "wb") as f:
            f.write(head)
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.versions_path)
        _fsync_path(os.path.dirname(os.path.abspath(self.path)), directory=True)
        self._clean, self._stamp = 1, stamp
        self._write_header()
        _fsync_path(self.path)
        self._dirty = False

    def _release_lock(self) -> None:
        fd, self._lock_fd = getattr(self, "_lock_fd", None), None
        if fd is not None:
            os.close(fd)      # closing the descriptor drops the flock

    def close(self) -> None:
        """Flush and release the buffers and the file's lock; idempotent."""
        global _LOCKED_BYTES
        if self._closed:
            self._release_lock()
            return
        try:
            if self._dirty and os.path.exists(self.path):
                self.flush()
        finally:
            self._closed = True
            self._stage = self._stage_rows = self._stage_flat = self._hdr_buf = None
            for t in self._locked:
                _LOCKED_BYTES -= t.numel() * t.element_size()
                self._handle.free_cpu_locked_tensor(t)
            self._locked = []
            self._handle = None
            self._release_lock()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self):
        return (f"NvmeStore({self.path!r}, num_rows={self.num_rows}, width={self.width}, dtype={self.dtype}, "
                f"block_rows={getattr(self, 'block_rows', None)}, closed={self._closed})")
