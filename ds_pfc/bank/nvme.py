"""A row store backed by a file, read and written with Linux native async I/O.

``NvmeStore`` keeps ``[num_rows, width]`` rows (``[num_rows]`` when ``width == 0``) of
one storage dtype in a file and moves them with ``O_DIRECT`` async I/O (libaio): by
default straight through libaio's ``io_submit``/``io_getevents`` (``io_engine="libaio"``),
or through DeepSpeed's ``async_io`` op (``io_engine="deepspeed"``,
``deepspeed.ops.op_builder.AsyncIOBuilder``). Host memory holds only a staging buffer,
a one-header buffer and the per-row versions.

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

How rows move
-------------
Use from one thread at a time. The unit of I/O is the *page* (``align`` bytes), not
the block: a gather reads the pages that hold requested rows, a scatter writes the
pages its rows touch and first reads those of them it does not overwrite whole (pages
it covers whole are zero-filled, then patched, so padding stays zero). Touched pages
closer than ``coalesce_gap_bytes`` are read as one request (reading the gap costs
less than a second request); requests are capped at ``max_request_bytes``. All
requests of a batch are queued at once and kept ``queue_depth`` deep; the staging
buffer (``stage_bytes``, default 16 MiB) is split in two halves when it holds two
blocks or more, so that one half's I/O overlaps the other half's picking or patching
(a gather reads batch k + 1 while it picks batch k; a scatter writes batch k while
it reads batch k + 1). ``read_all``/``write_all`` and the initial fill move whole
blocks in ``max_request_bytes`` requests, ``queue_depth`` deep. The plans are
vectorised torch ops over the rows and pages; Python loops run per batch only.
"""
from __future__ import annotations

import bisect
import collections
import ctypes
import ctypes.util
import errno
import os
import resource
import secrets
import shutil
import struct
import sys
import threading
import time
import zlib

import numpy as np
import torch

from .._checks import check_int
from .stores import RowStore, pinned_empty

__all__ = ["NvmeStore", "DirtyStoreError", "load_aio_op", "load_libaio", "SUPPORTED_DTYPES", "IO_ENGINES"]

MAGIC = b"DSPFCNV\x00"
VERSIONS_MAGIC = b"DSPFCVR\x00"
FORMAT_VERSION = 1
SECTOR = 4096                      # base alignment unit (bytes), times intra_op_parallelism
TARGET_BLOCK_BYTES = 128 * 1024    # default block size aimed at (64-256 KiB)
DEFAULT_STAGE_BYTES = 16 * 1024 * 1024
AIO_BLOCK_SIZE = 1024 * 1024       # bytes per libaio request inside one DeepSpeed op
DEFAULT_QUEUE_DEPTH = 32
DEFAULT_GAP_BYTES = 16 * 1024      # read up to this many untouched bytes to save a request
DEFAULT_MAX_REQUEST_BYTES = 1024 * 1024
IO_ENGINES = ("libaio", "deepspeed")
STAGE_BUFFERS = 2                  # the stage is cut in this many buffers, a batch each (2: double buffering)
# Batches a scatter reads ahead, per number of buffers: the read of batch j waits for the
# write of batch j - buffers (measured on the review VM: 3 or 4 buffers gained nothing).
SCATTER_AHEAD = {1: 0, 2: 1, 3: 1}
DEEPSPEED_MAX_PENDING = 256        # DeepSpeed ops queued before a wait() (each holds a descriptor)
DEEPSPEED_HANDLES = 8              # DeepSpeed handles (each its own thread) a store spreads ops over

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
_LIBAIO = None
_LOCKED_BYTES = 0  # page-locked bytes this module holds (for the RLIMIT_MEMLOCK check)
_HINT = ("it needs libaio. Install the Debian package libaio-dev (apt-get install -y libaio-dev) and retry")


def load_aio_op():
    """DeepSpeed's ``async_io`` op, loaded (JIT-built on first use) once per process.

    Raises RuntimeError when the op cannot work here (libaio missing)."""
    global _AIO_OP
    if _AIO_OP is not None:
        return _AIO_OP
    hint = f"DeepSpeed's async_io op is unavailable: {_HINT}"
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


def _libaio_names() -> list[str]:
    found = ctypes.util.find_library("aio")
    return ([found] if found else []) + ["libaio.so.1"]


def load_libaio():
    """libaio (``libaio.so.1``) through ctypes, loaded once per process.

    Raises RuntimeError when it is not installed."""
    global _LIBAIO
    if _LIBAIO is not None:
        return _LIBAIO
    if sys.byteorder != "little" or ctypes.sizeof(ctypes.c_void_p) != 8:   # the iocb layout written below
        raise RuntimeError("NvmeStore's I/O engine 'libaio' supports 64-bit little-endian machines only; "
                           "use io_engine='deepspeed'")
    lib, problem = None, "libaio.so not found"
    for name in _libaio_names():
        try:
            lib = ctypes.CDLL(name)        # CDLL: every call releases the GIL
            break
        except OSError as exc:
            problem = str(exc)
    if lib is None:
        raise RuntimeError(f"libaio is unavailable ({problem}): NvmeStore's I/O engine 'libaio' {_HINT}")
    vp, long = ctypes.c_void_p, ctypes.c_long
    lib.io_setup.argtypes, lib.io_setup.restype = [ctypes.c_int, ctypes.POINTER(vp)], ctypes.c_int
    lib.io_destroy.argtypes, lib.io_destroy.restype = [vp], ctypes.c_int
    lib.io_submit.argtypes, lib.io_submit.restype = [vp, long, vp], ctypes.c_int
    lib.io_getevents.argtypes, lib.io_getevents.restype = [vp, long, long, vp, vp], ctypes.c_int
    _LIBAIO = lib
    return lib


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


# ----------------------------------------------------------------------------- I/O engines
# What DeepSpeed's async_io op offers (deepspeed 0.19.8: csrc/aio/py_lib/deepspeed_py_io_handle.cpp,
# deepspeed_aio_thread.cpp, deepspeed_cpu_op.cpp, csrc/aio/common/deepspeed_aio_common.cpp,
# op_builder/async_io.py), and why the default engine calls libaio itself:
#
# * aio_handle(block_size, queue_depth, single_submit, overlap_events, intra_op_parallelism)
#   starts intra_op_parallelism threads, each with its own libaio context of queue_depth
#   iocbs. An op (async_pread/async_pwrite of one buffer at one offset) is pushed to every
#   thread's queue; each thread moves its 1/intra_op_parallelism slice, cut into block_size
#   iocbs, queue_depth of them in flight (overlap_events: refilled as they complete;
#   otherwise in groups of queue_depth, each group waited for; single_submit: one
#   io_submit per iocb instead of one per group).
# * Many ops may be queued before one wait(), but a thread runs its ops one after another:
#   queue depth and block size only act *inside* one op. Small random ops queued on one
#   handle run at queue depth 1, whatever queue_depth says; only several handles (threads)
#   overlap them. wait() blocks until every pending op of the handle is done, closes the
#   descriptors the ops opened and returns their count (it asserts, i.e. aborts the
#   process, when nothing is pending).
# * Per op, in the caller: async_pread stat()s the file (an offset + size past its end is an
#   assert: the process aborts), open()s it with O_DIRECT, and hands the op to the threads
#   (mutex + condition variable; the GIL is held meanwhile); wait() close()s it, so every
#   queued read holds a descriptor: past RLIMIT_NOFILE queued reads, the opens fail (EMFILE;
#   seen here with 20000 queued 4 KiB reads and the default limit of 1024). The only
#   call that skips the open is async_pwrite(buffer, fd, offset) (a descriptor the caller
#   opened); there is no read by descriptor, no vectored or multi-offset op, and no way to
#   submit requests at several offsets as one op. One large op is the only way to get
#   queue_depth requests in flight on one thread: the op cuts it into block_size requests.
# * Completions' results (io_event.res) are never checked: a failed or short read or write
#   (EIO, ENOSPC on a sparse file) is reported as done. Buffers neither torch-pinned nor
#   from new_cpu_locked_tensor go through a page-locked bounce buffer and a copy per op.
#   The op is built with -O0.
# * Measured on this project's 2-core review VM (virtio disk; fio libaio O_DIRECT 4 KiB random
#   reads ~80-95k IOPS at queue depth 32; ds_pfc.bench.nvme): 4 KiB random reads, one op per
#   wait(), 6-12k/s; 64 ops per wait() on one handle 10k/s; on 4-8 handles 20-29k/s (~25-35%
#   of fio; 38-55 us of CPU per op); 128 KiB: 7.6-10k/s on 8 handles (~55% of fio). Calling
#   libaio directly from one context, requests built as an iocb array (vectorised) and kept
#   32 deep: 72-81k/s at 4 KiB (~85-100% of fio; ~5 us of CPU per request).
#
# So: io_engine="libaio" (default) opens the file once with O_DIRECT, builds every request
# of a batch as one numpy iocb table, submits them from the caller and keeps queue_depth in
# flight across the batch and the next one (the stage's other buffer) from a completion
# thread, which also checks every completion's result (short or failed requests raise
# OSError: EIO, ENOSPC, ...). io_engine="deepspeed" goes through DeepSpeed's handles: the
# requests of a batch are spread over DEEPSPEED_HANDLES handles (threads) before one wait()
# per handle; writes use the descriptor overload (no open per write); reads still pay
# DeepSpeed's stat + open + close per request, and failed requests go undetected.

_IOCB_PREAD, _IOCB_PWRITE = 0, 1


class _Ticket:
    __slots__ = ("n", "done", "error", "table", "ptrs", "nbytes", "offsets", "submitted", "write")


def _count(engine, write: bool, file_off: np.ndarray, nbytes: np.ndarray) -> None:
    """Requests and bytes issued (``stats``), and the requests themselves while ``trace`` is a list."""
    kind = "write" if write else "read"
    engine.stats[kind + "_requests"] += int(nbytes.size)
    engine.stats[kind + "_bytes"] += int(nbytes.sum())
    if engine.trace is not None:
        engine.trace.append((write, np.array(file_off, dtype=np.int64), np.array(nbytes, dtype=np.int64)))


class _LibaioEngine:
    """Requests through libaio: one context, one ``O_DIRECT`` descriptor, numpy iocbs.

    The caller submits (``start``); a completion thread reaps completions, checks their
    results and refills the queue, so that the queue stays ``queue_depth`` deep while the
    caller picks or patches rows (its torch ops and the thread's system calls run
    without the GIL)."""

    name = "libaio"

    def __init__(self, path: str, queue_depth: int, max_request_bytes: int):
        self._lib = load_libaio()
        self.queue_depth = queue_depth
        self.max_request_bytes = max_request_bytes
        self.path = path
        self.fd = os.open(path, os.O_RDWR | os.O_DIRECT | os.O_CLOEXEC)
        ctx = ctypes.c_void_p(0)
        rc = self._lib.io_setup(queue_depth, ctypes.byref(ctx))
        if rc < 0:
            os.close(self.fd)
            raise OSError(-rc, f"NvmeStore: io_setup({queue_depth}) failed: {os.strerror(-rc)} (queue_depth too "
                          f"large, or /proc/sys/fs/aio-max-nr exhausted)")
        self._ctx = ctx
        self._events = np.zeros((queue_depth, 4), dtype=np.int64)   # struct io_event: data, obj, res, res2
        self._tickets: dict[int, _Ticket] = {}
        self._fifo: collections.deque[int] = collections.deque()    # tickets with requests not yet submitted
        self._inflight = 0
        self._seq = 0
        self._cond = threading.Condition()
        self._closing = False
        self._fatal: BaseException | None = None
        self._thread: threading.Thread | None = None
        self.stats = {"read_requests": 0, "read_bytes": 0, "write_requests": 0, "write_bytes": 0}
        self.trace: list | None = None

    def alloc(self, nbytes: int) -> torch.Tensor:
        """A page-aligned uint8 buffer (O_DIRECT needs aligned memory, not locked memory)."""
        raw = torch.empty(nbytes + 4096, dtype=torch.uint8)
        skip = (-raw.data_ptr()) % 4096
        return raw[skip:skip + nbytes]

    def free(self, t: torch.Tensor) -> None:
        pass

    def start(self, write: bool, buf: torch.Tensor, buf_off: np.ndarray, file_off: np.ndarray,
              nbytes: np.ndarray) -> int:
        """Queue requests (int64 byte offsets into ``buf`` and the file, sizes); returns a ticket."""
        n = int(file_off.size)
        t = _Ticket()
        t.n, t.done, t.error, t.submitted, t.write = n, 0, None, 0, write
        if n:
            _count(self, write, file_off, nbytes)
            table = np.zeros((n, 8), dtype=np.int64)       # struct iocb, 64 bytes
            table[:, 2] = (_IOCB_PWRITE if write else _IOCB_PREAD) | (self.fd << 32)   # opcode, prio, fildes
            table[:, 3] = buf_off + buf.data_ptr()                                   # aio_buf
            t.nbytes = np.array(nbytes, dtype=np.int64)
            t.offsets = np.array(file_off, dtype=np.int64)
            table[:, 4] = t.nbytes                                                   # aio_nbytes
            table[:, 5] = t.offsets                                                  # aio_offset
            t.table = table
            t.ptrs = table.ctypes.data + 64 * np.arange(n, dtype=np.int64)          # struct iocb *[]
        with self._cond:
            if self._fatal is not None:
                raise self._fatal
            seq = self._seq = (self._seq + 1) & 0x7FFFFFFF
            self._tickets[seq] = t
            if n:
                t.table[:, 0] = (seq << 32) | np.arange(n, dtype=np.int64)          # aio_data
                self._fifo.append(seq)
                self._pump()
                if self._thread is None:
                    self._thread = threading.Thread(target=self._complete_loop, name="ds_pfc-nvme-aio",
                                                    daemon=True)
                    self._thread.start()
                self._cond.notify_all()
        return seq

    def _pump(self) -> None:
        """(holding the lock) Submit queued requests while the queue has room."""
        lib, qd, busy = self._lib, self.queue_depth, 0
        while self._fifo and self._inflight < qd:
            seq = self._fifo[0]
            t = self._tickets[seq]
            k = min(qd - self._inflight, t.n - t.submitted)
            rc = lib.io_submit(self._ctx, k, t.ptrs.ctypes.data + 8 * t.submitted)
            if rc == -errno.EAGAIN or rc == 0:
                if self._inflight:
                    return                  # retried after completions
                busy += 1
                if busy > 2000:
                    rc = -errno.EAGAIN
                else:
                    time.sleep(0.001)
                    continue
            if rc == -errno.EINTR:
                continue
            if rc < 0:                      # nothing of this ticket's rest was submitted
                if t.error is None:
                    t.error = self._error(t, -rc, t.submitted)
                t.done += t.n - t.submitted
                t.submitted = t.n
                self._cond.notify_all()     # its waiter may be done
            else:
                t.submitted += rc
                self._inflight += rc
            if t.submitted == t.n:
                self._fifo.popleft()

    def _error(self, t: _Ticket, code: int, i: int, short: int | None = None) -> OSError:
        what = "write" if t.write else "read"
        at = f"{int(t.nbytes[i])} bytes at offset {int(t.offsets[i])} of {self.path!r}"
        if short is not None:
            return OSError(errno.ENOSPC if t.write else errno.EIO,
                           f"NvmeStore: short {what}: {short} of {at} (disk full or file truncated?)")
        return OSError(code, f"NvmeStore: async {what} of {at} failed: {os.strerror(code)}")

    def _complete_loop(self) -> None:
        """(the completion thread) Reap, refill, check; until the engine closes."""
        try:
            self._reap_until_closed()
        except BaseException as exc:  # pragma: no cover - a bug here must not leave waiters hanging
            with self._cond:
                self._fatal = OSError(errno.EIO, f"NvmeStore: the I/O completion thread failed: {exc!r}")
                self._cond.notify_all()

    def _reap_until_closed(self) -> None:
        lib, events, qd = self._lib, self._events, self.queue_depth
        while True:
            with self._cond:
                while not self._inflight and not self._closing:
                    self._cond.wait()
                if not self._inflight:
                    return
            rc = lib.io_getevents(self._ctx, 1, qd, events.ctypes.data, None)
            with self._cond:
                if rc < 0 and rc != -errno.EINTR:
                    self._fatal = OSError(-rc, f"NvmeStore: io_getevents failed: {os.strerror(-rc)}")
                    self._cond.notify_all()
                    return
                if rc > 0:
                    self._inflight -= rc
                    self._pump()                    # refill first: the checks can wait
                    if self._account(events[:rc]):
                        self._cond.notify_all()

    def _account(self, ev: np.ndarray) -> bool:
        """(holding the lock) Count completions per ticket, keeping each ticket's first
        error; whether a ticket finished."""
        seqs, idx, res = ev[:, 0] >> 32, ev[:, 0] & 0xFFFFFFFF, ev[:, 2]
        first = int(seqs[0])
        groups = [first] if bool((seqs == first).all()) else np.unique(seqs).tolist()
        finished = False
        for seq in groups:
            sel = slice(None) if len(groups) == 1 else (seqs == seq)
            t = self._tickets[int(seq)]
            i, r = idx[sel], res[sel]
            bad = r != t.nbytes[i]
            if t.error is None and bool(bad.any()):
                k = int(np.argmax(bad))
                code = int(r[k])
                t.error = self._error(t, -code, int(i[k])) if code < 0 else \
                    self._error(t, 0, int(i[k]), short=code)
            t.done += int(i.shape[0])
            finished = finished or t.done >= t.n
        return finished

    def wait(self, seq: int) -> None:
        """Until every request of ticket ``seq`` completed; raises its first error."""
        with self._cond:
            t = self._tickets[seq]
            while t.done < t.n:
                if self._fatal is not None:
                    raise self._fatal
                self._cond.wait()
            del self._tickets[seq]
        if t.error is not None:
            raise t.error

    def drain(self) -> None:
        """Wait for everything queued; errors are dropped (used while another error unwinds)."""
        for seq in list(self._tickets):
            try:
                self.wait(seq)
            except OSError:
                pass

    def close(self) -> None:
        if self._ctx is None:
            return
        try:
            if self._fatal is None:
                self.drain()
        finally:
            with self._cond:
                self._closing = True
                self._cond.notify_all()
            if self._thread is not None and self._fatal is None:
                self._thread.join()
            self._lib.io_destroy(self._ctx)     # waits for anything still in flight
            self._ctx = None
            os.close(self.fd)


class _DeepSpeedEngine:
    """Requests through DeepSpeed's async_io handles (see the notes above)."""

    name = "deepspeed"

    def __init__(self, path: str, queue_depth: int, max_request_bytes: int, intra_op_parallelism: int,
                 handles: int = DEEPSPEED_HANDLES):
        op = load_aio_op()
        self.path = path
        self.queue_depth = queue_depth
        self.max_request_bytes = max_request_bytes
        self.fd = os.open(path, os.O_RDWR | os.O_DIRECT | os.O_CLOEXEC)
        self._handles = [op.aio_handle(AIO_BLOCK_SIZE, queue_depth, False, True, intra_op_parallelism)
                         for _ in range(handles)]
        self._pending = [0] * handles
        # Each queued read holds a descriptor DeepSpeed opened until wait(): stay well
        # below RLIMIT_NOFILE (past it, opens fail with EMFILE).
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        self._max_pending = max(handles, min(DEEPSPEED_MAX_PENDING, (soft if soft > 0 else 1024) // 4))
        self._next = 0
        self._tickets: dict[int, list] = {}
        self._seq = 0
        self._lost: OSError | None = None
        self.stats = {"read_requests": 0, "read_bytes": 0, "write_requests": 0, "write_bytes": 0}
        self.trace: list | None = None

    def alloc(self, nbytes: int) -> torch.Tensor:
        t = self._handles[0].new_cpu_locked_tensor(nbytes, torch.empty(0, dtype=torch.uint8))
        if t.numel() != nbytes or t.data_ptr() == 0:
            raise RuntimeError(f"NvmeStore: could not page-lock {nbytes} bytes")
        return t

    def free(self, t: torch.Tensor) -> None:
        self._handles[0].free_cpu_locked_tensor(t)

    def start(self, write: bool, buf: torch.Tensor, buf_off: np.ndarray, file_off: np.ndarray,
              nbytes: np.ndarray) -> int:
        self._seq += 1
        ticket = self._tickets[self._seq] = [None]
        handles, H = self._handles, len(self._handles)
        if file_off.size:
            _count(self, write, file_off, nbytes)
        for bo, fo, nb in zip(buf_off.tolist(), file_off.tolist(), nbytes.tolist()):
            if sum(self._pending) >= self._max_pending:
                self._wait_handles()
            h = self._next
            self._next = (h + 1) % H
            piece = buf[bo:bo + nb]
            rc = handles[h].async_pwrite(piece, self.fd, fo) if write else \
                handles[h].async_pread(piece, self.path, fo)
            if rc != 0:
                ticket[0] = OSError(errno.EIO, f"NvmeStore: async {'write' if write else 'read'} of {nb} bytes at "
                                    f"{fo} in {self.path!r} failed to start")
                break
            self._pending[h] += 1
        return self._seq

    def _wait_handles(self) -> None:
        for h, n in enumerate(self._pending):
            if n:
                self._pending[h] = 0
                done = self._handles[h].wait()
                if done != n and self._lost is None:
                    self._lost = OSError(errno.EIO, f"NvmeStore: {n} I/O requests on {self.path!r}, {done} completed")

    def wait(self, seq: int) -> None:
        """Waits for every handle: all tickets complete together; raises ``seq``'s error."""
        self._wait_handles()
        mine = self._tickets.pop(seq, [None])
        error, self._lost = self._lost or mine[0], None
        if error is not None:
            raise error

    def drain(self) -> None:
        for seq in list(self._tickets) or [0]:
            try:
                self.wait(seq)
            except OSError:
                pass

    def close(self) -> None:
        if self._handles is not None:
            try:
                self.drain()
            finally:
                self._handles = None
                os.close(self.fd)


# ----------------------------------------------------------------------------- planning helpers
# Plans are numpy (single-threaded, ~1 us per call): torch's intra-op threads stall on small
# arrays when the cores are shared (measured: 4 ms per op on the 2-core review VM under load).
def _group(pages: np.ndarray, gap: int) -> tuple[np.ndarray, np.ndarray]:
    """Runs ``[start, end)`` over sorted unique ``pages``: pages at most ``gap`` apart join."""
    if pages.size == 0:
        return pages, pages
    new = np.empty(pages.size, dtype=bool)
    new[0] = True
    np.greater(np.diff(pages), gap + 1, out=new[1:])
    first = np.flatnonzero(new)
    last = np.append(first[1:] - 1, pages.size - 1)
    return pages[first], pages[last] + 1


def _expand(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Every integer of the intervals ``[starts, ends)``, interval after interval."""
    lens = ends - starts
    total = int(lens.sum()) if lens.size else 0
    if total == 0:
        return np.empty(0, dtype=np.int64)
    skip = np.cumsum(lens) - lens                       # position of each interval's first integer
    return np.repeat(starts - skip, lens) + np.arange(total, dtype=np.int64)


def _unique_sorted(values: np.ndarray) -> np.ndarray:
    """The distinct values of a sorted array."""
    if values.size < 2:
        return values
    keep = np.empty(values.size, dtype=bool)
    keep[0] = True
    np.not_equal(values[1:], values[:-1], out=keep[1:])
    return values[keep]


def _member(sorted_set: np.ndarray, values: np.ndarray) -> np.ndarray:
    """``values`` in ``sorted_set`` (both sorted; binary search)."""
    if sorted_set.size == 0:
        return np.zeros(values.size, dtype=bool)
    pos = np.minimum(np.searchsorted(sorted_set, values), sorted_set.size - 1)
    return sorted_set[pos] == values


def _runs_of(pages: np.ndarray, mask: np.ndarray | None, max_pages: int, batch: np.ndarray | None = None):
    """Requests over sorted unique ``pages`` (position ``i`` in the stage holds
    ``pages[i]``) where ``mask`` holds: maximal runs consecutive in the file (and within
    one ``batch``), cut to ``max_pages``. Returns ``(position of the first page, first
    page, pages)``."""
    idx = np.arange(pages.size, dtype=np.int64) if mask is None else np.flatnonzero(mask)
    if idx.size == 0:
        return idx, idx, idx
    p = pages[idx]
    new = np.empty(idx.size, dtype=bool)
    new[0] = True
    new[1:] = (np.diff(p) != 1) | (np.diff(idx) != 1)
    if batch is not None:
        new[1:] |= np.diff(batch[idx]) != 0
    first = np.flatnonzero(new)
    lens = np.diff(first, append=idx.size)
    slot, page = idx[first], p[first]
    if (lens > max_pages).any():
        pieces = (lens + max_pages - 1) // max_pages
        k = np.arange(int(pieces.sum()), dtype=np.int64) - np.repeat(np.cumsum(pieces) - pieces, pieces)
        slot = np.repeat(slot, pieces) + k * max_pages
        page = np.repeat(page, pieces) + k * max_pages
        lens = np.minimum(np.repeat(lens, pieces) - k * max_pages, max_pages)
    return slot, page, lens


class _Plan:
    """Requests of every batch, planned at once, in bytes: per batch ``k``, requests
    ``[edges[k], edges[k + 1])``, buffer offsets relative to the batch's buffer."""

    def __init__(self, pages, mask, max_pages, starts: np.ndarray, batch: np.ndarray, n_batches: int,
                 align: int):
        pos, page, npages = _runs_of(pages, mask, max_pages, batch)
        b = batch[pos]
        self.buf_off = (pos - starts[b]) * align
        self.file_off = page * align
        self.nbytes = npages * align
        self.edges = np.searchsorted(b, np.arange(n_batches + 1)).tolist()

    def batch(self, k):
        q0, q1 = self.edges[k], self.edges[k + 1]
        return self.buf_off[q0:q1], self.file_off[q0:q1], self.nbytes[q0:q1]


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
    """Rows in a file, moved with ``O_DIRECT`` async I/O (see the module docstring).

    ``create=True`` makes (or overwrites) ``path``: zeros, or ``init``. ``create=False``
    opens an existing file and checks it against ``num_rows``/``width``/``dtype`` (and
    ``block_rows`` when given). ``versions`` (int64 ``[num_rows]``, CPU) counts the
    completed scatters of each row (``write_all`` counts as one for every row); it is
    saved by ``flush``/``close`` and restored on open.

    I/O options (none changes the file): ``io_engine`` (:data:`IO_ENGINES`: ``"libaio"``,
    the default, or ``"deepspeed"``), ``queue_depth`` (requests in flight),
    ``coalesce_gap_bytes`` (untouched bytes read to join two requests into one),
    ``coalesce_write_gap_bytes`` (default 0: a scatter writes only the pages it touches;
    more: it also writes back, unchanged, untouched pages it read in gaps up to this
    size, trading bytes written, i.e. drive endurance, for fewer requests),
    ``max_request_bytes``, ``stage_bytes`` (the staging buffer), and
    ``intra_op_parallelism`` (threads per DeepSpeed op; new files align to
    ``4096 * intra_op_parallelism``).
    """

    tier = "nvme"

    def __init__(self, path, num_rows: int, width: int, dtype: torch.dtype, *, create: bool,
                 init: torch.Tensor | None = None, block_rows: int | None = None,
                 intra_op_parallelism: int = 1, queue_depth: int = DEFAULT_QUEUE_DEPTH,
                 stage_bytes: int = DEFAULT_STAGE_BYTES, allow_dirty: bool = False,
                 io_engine: str = "libaio", coalesce_gap_bytes: int = DEFAULT_GAP_BYTES,
                 coalesce_write_gap_bytes: int = 0, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES):
        self._closed = True  # until fully built: close()/__del__ are no-ops
        self._engine = None
        self._pid = os.getpid()
        self._locked: list[torch.Tensor] = []
        self._buffers: list[torch.Tensor] = []
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
        check_int("coalesce_gap_bytes", coalesce_gap_bytes, 0)
        check_int("coalesce_write_gap_bytes", coalesce_write_gap_bytes, 0)
        check_int("max_request_bytes", max_request_bytes, 1)
        if io_engine not in IO_ENGINES:
            raise ValueError(f"io_engine must be one of {IO_ENGINES}, got {io_engine!r}")
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
        self.io_engine = io_engine
        self.opened_dirty = False
        self._row_elems = max(width, 1)
        self._io_options = (queue_depth, stage_bytes, coalesce_gap_bytes, max_request_bytes)
        self._write_gap_bytes = coalesce_write_gap_bytes

        existed = os.path.exists(path)
        self._lock_fd = _lock_file(path, create)
        try:
            if create:
                self._layout_new(block_rows)
                self._create(init)
            else:
                self._open(block_rows, allow_dirty)
        except BaseException:
            self._closed = True
            self._close_engine()
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
        zero = np.zeros(1, dtype=np.int64)
        self._run(self._engine.start(True, buf, zero, zero, np.array([self._align], dtype=np.int64)))

    def _mark_dirty(self):
        if not self._dirty:
            self._clean = 0
            self._write_header()  # mark dirty before any data changes
            self._dirty = True

    # ------------------------------------------------------------------ create / open
    def _create(self, init):
        directory = os.path.dirname(os.path.abspath(self.path))
        if not os.path.isdir(directory):
            raise FileNotFoundError(errno.ENOENT, f"NvmeStore: directory {directory!r} does not exist "
                                    f"(creating {self.path!r})", directory)
        self._load_engine_library()
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
            self._setup()
            if init is not None and self.num_rows:
                self._write_sequential(init)
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

    def _load_engine_library(self):
        """Fail early, with the install hint, when the engine cannot run here."""
        if self.io_engine == "deepspeed":
            load_aio_op()
        else:
            load_libaio()

    def _open(self, block_rows, allow_dirty):
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
        self._load_engine_library()
        self._setup()
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

    def _setup(self):
        """The I/O engine and the buffers."""
        queue_depth, stage_bytes, gap, max_request = self._io_options
        A, bb = self._align, self._block_bytes
        self._stage_blocks = min(self._num_blocks, max(1, stage_bytes // bb))
        if self.io_engine == "deepspeed":
            want = A + self._stage_blocks * bb
            budget = _lock_budget()
            if budget is not None and want > budget:
                fit = (budget - A) // bb
                if fit < min(1, self._num_blocks):
                    raise RuntimeError(
                        f"NvmeStore: cannot page-lock {A + bb} bytes for I/O buffers "
                        f"(RLIMIT_MEMLOCK leaves {budget}); raise the limit (ulimit -l), use smaller block_rows "
                        f"or io_engine='libaio' (which locks nothing)")
                self._stage_blocks = min(self._stage_blocks, fit)
            self._engine = _DeepSpeedEngine(self.path, queue_depth, max_request, self.intra_op_parallelism)
        else:
            self._engine = _LibaioEngine(self.path, queue_depth, max_request)
        self._gap_pages = gap // A
        self._write_gap_pages = self._write_gap_bytes // A
        self._max_pages = max(1, max_request // A)
        self._closed = False
        self._dirty = False
        self._hdr_buf = self._alloc(A)
        if self._stage_blocks:
            self._stage = self._alloc(self._stage_blocks * bb)
            self._stage.zero_()
            # The stage is cut into buffers (a batch each): while one buffer's rows are
            # picked or patched, the others' reads and writes are in flight.
            self._nbuf = min(STAGE_BUFFERS, self._stage_blocks)
            self._buf_blocks = self._stage_blocks // self._nbuf
            self._buf_bytes = self._buf_blocks * bb
            self._buf_pages = self._buf_bytes // A
            esize = torch.empty((), dtype=self.dtype).element_size()
            # [slot, row in block, element]: the rows of each block-sized slot (whole-block I/O)
            self._stage_rows = self._stage.view(self.dtype).as_strided(
                (self._stage_blocks, self.block_rows, self._row_elems), (bb // esize, self._row_elems, 1))
            self._stage_pages = self._stage.view(-1, A)
            self._stage_elems = self._stage.view(self.dtype)
            rb = self.row_bytes()
            # Rows at whole-row offsets in the stage (a row never straddles a page, or rows
            # are whole pages): picked and patched as rows of a [*, row] view.
            self._one_page = A % rb == 0
            self._flat_ok = self._one_page or (rb % A == 0 and bb == self.block_rows * rb)
            self._stage_flat = self._stage_elems.view(-1, self._row_elems) if self._flat_ok else None
            # Otherwise rows start at any element: [start element, element of the row], overlapping windows.
            n_elems = self._stage_elems.numel()
            self._stage_windows = self._stage_elems.as_strided((n_elems - self._row_elems + 1, self._row_elems), (1, 1))
            self._buf_elems = self._buf_bytes // esize
            self._elems = torch.arange(self._row_elems)
        else:
            self._stage = None

    def _alloc(self, nbytes):
        global _LOCKED_BYTES
        t = self._engine.alloc(nbytes)
        self._buffers.append(t)
        if self.io_engine == "deepspeed":
            self._locked.append(t)
            _LOCKED_BYTES += nbytes
        return t

    # ------------------------------------------------------------------ I/O plans
    def _run(self, ticket):
        """Wait for one ticket; on an error, wait for everything else in flight first."""
        try:
            self._engine.wait(ticket)
        except BaseException:
            self._engine.drain()
            raise

    def _start(self, write: bool, base: int, buf_off: np.ndarray, file_off: np.ndarray, nbytes: np.ndarray):
        """Requests at byte offsets into the buffer at ``base`` and into the file."""
        return self._engine.start(write, self._stage, buf_off + base, file_off, nbytes)

    def _check_file(self):
        if self._closed:
            raise RuntimeError(f"NvmeStore {self.path!r} is closed")
        try:
            size = os.path.getsize(self.path)
        except FileNotFoundError:
            raise FileNotFoundError(errno.ENOENT, f"NvmeStore: file {self.path!r} disappeared", self.path) from None
        if size < self._file_bytes:  # reading past the end would abort the process (deepspeed)
            raise ValueError(f"NvmeStore: {self.path!r} is truncated: expected {self._file_bytes} bytes, "
                             f"found {size}")

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

    def _row_pages(self, rows: np.ndarray):
        """File byte offset and first page of each (sorted) row, and the sorted unique
        pages the rows touch."""
        A, rb, br = self._align, self.row_bytes(), self.block_rows
        blk = rows // br
        start = self._data_offset + blk * self._block_bytes + (rows - blk * br) * rb
        first = start // A
        if self._one_page:
            return start, first, _unique_sorted(first)
        last = (start + (rb - 1)) // A
        return start, first, _unique_sorted(_expand(first, last + 1))

    def _batches(self, pages: np.ndarray):
        """Cut the sorted stage pages into batches of at most one stage buffer, between
        blocks (a row never straddles two blocks, so it never straddles two batches).
        Returns the ``(start, end)`` positions, the starts, and the batch of every page."""
        spans = self._cut(pages)
        starts = np.array([a for a, _ in spans] or [0], dtype=np.int64)
        batch = np.repeat(np.arange(len(spans), dtype=np.int64), [b - a for a, b in spans])
        return spans, starts, batch

    def _cut(self, pages: np.ndarray) -> list[tuple[int, int]]:
        n, S = pages.size, self._buf_pages
        if n <= S:
            return [(0, n)] if n else []
        blk = (pages - self._data_offset // self._align) // (self._block_bytes // self._align)
        cuts = [0] + (np.flatnonzero(np.diff(blk)) + 1).tolist() + [n]
        out, i0 = [], 0
        while i0 < n:
            i1 = cuts[bisect.bisect_right(cuts, i0 + S) - 1]
            if i1 <= i0:  # pragma: no cover - a block never exceeds a stage buffer
                raise RuntimeError("NvmeStore internal error: a block does not fit the staging buffer")
            out.append((i0, i1))
            i0 = i1
        return out

    def _row_units(self, off: np.ndarray) -> torch.Tensor:
        """Rows at byte offsets ``off`` into a buffer, in rows of the ``[*, row]`` view
        (rows at whole-row offsets) or in elements."""
        return torch.from_numpy(off // (self.row_bytes() if self._flat_ok else self.row_bytes() // self._row_elems))

    def _pick(self, units: torch.Tensor, h: int, out: torch.Tensor) -> None:
        """Rows of buffer ``h`` at ``units`` (:meth:`_row_units`) into ``out``."""
        if self._flat_ok:
            torch.index_select(self._stage_flat, 0, units + h * (self._buf_bytes // self.row_bytes()), out=out)
        else:
            torch.index_select(self._stage_windows, 0, units + h * self._buf_elems, out=out)

    def _patch(self, units: torch.Tensor, h: int, values: torch.Tensor) -> None:
        """``values`` into buffer ``h`` at ``units`` (:meth:`_row_units`)."""
        if self._flat_ok:
            self._stage_flat.index_copy_(0, units + h * (self._buf_bytes // self.row_bytes()), values)
            return
        units = units + h * self._buf_elems
        try:        # rows never overlap one another, although the windows do
            self._stage_windows.index_copy_(0, units, values)
        except RuntimeError:  # pragma: no cover - a torch that refuses writes through overlapping windows
            self._stage_elems[units.unsqueeze(1) + self._elems] = values

    def _gather_sorted(self, rows: torch.Tensor, flat: torch.Tensor) -> None:
        """Rows (sorted, repeats allowed) into ``flat`` ``[n, row]``."""
        A, H = self._align, self._nbuf
        start, first, pages = self._row_pages(rows.numpy())
        run_start, run_end = _group(pages, self._gap_pages)
        stage_pages = _expand(run_start, run_end)               # pages read, gaps included
        pos = np.searchsorted(stage_pages, first)
        batches, starts, batch = self._batches(stage_pages)
        edges = np.searchsorted(pos, [b[0] for b in batches] + [stage_pages.size]).tolist()
        plan = _Plan(stage_pages, None, self._max_pages, starts, batch, len(batches), A)
        # stage byte offset of each row within its batch's buffer
        units = self._row_units((pos - starts[batch[pos]]) * A + (start - first * A))
        tickets = [None] * len(batches)
        try:
            issued = 0
            for k in range(len(batches)):
                while issued < len(batches) and issued < k + H:   # buffer issued % H was picked (batch issued - H)
                    tickets[issued] = self._start(False, (issued % H) * self._buf_bytes, *plan.batch(issued))
                    issued += 1
                ticket, tickets[k] = tickets[k], None
                self._engine.wait(ticket)
                r0, r1 = edges[k], edges[k + 1]
                self._pick(units[r0:r1], k % H, flat[r0:r1])
        except BaseException:
            self._engine.drain()
            raise

    def _scatter_sorted(self, rows: torch.Tensor, values: torch.Tensor) -> None:
        """Rows (sorted, unique) from ``values`` ``[n, row]`` (storage dtype, CPU)."""
        A, rb, br, H = self._align, self.row_bytes(), self.block_rows, self._nbuf
        rows_np = rows.numpy()
        start, first, touched = self._row_pages(rows_np)
        # A touched page is read first unless the rows written cover all of its real rows.
        q = touched - self._data_offset // A
        per_block = self._block_bytes // A
        blk = q // per_block
        inpage = q - blk * per_block
        lo = blk * br + (inpage * A) // rb
        hi = np.minimum(np.minimum(blk * br + ((inpage + 1) * A + rb - 1) // rb, blk * br + br), self.num_rows)
        covered = np.searchsorted(rows_np, hi) - np.searchsorted(rows_np, lo)
        run_start, run_end = _group(touched[covered < hi - lo], self._gap_pages)
        loaded_pages = _expand(run_start, run_end)
        stage_pages = np.union1d(touched, loaded_pages) if loaded_pages.size else touched
        loaded = _member(loaded_pages, stage_pages)
        written = _member(touched, stage_pages)
        fill = written & ~loaded                                # written whole: zero-filled, then patched
        out = written
        if self._write_gap_pages:       # also write back pages read in small gaps: fewer, larger writes
            run_start, run_end = _group(touched, self._write_gap_pages)
            run = np.maximum(np.searchsorted(run_start, stage_pages, side="right") - 1, 0)
            out = written | (loaded & (stage_pages < run_end[run]) & (stage_pages >= run_start[run]))
        pos = np.searchsorted(stage_pages, first)
        batches, starts, batch = self._batches(stage_pages)
        edges = np.searchsorted(pos, [b[0] for b in batches] + [stage_pages.size]).tolist()
        read_plan = _Plan(stage_pages, loaded, self._max_pages, starts, batch, len(batches), A)
        write_plan = _Plan(stage_pages, out, self._max_pages, starts, batch, len(batches), A)
        zero = np.flatnonzero(fill)
        zero_edges = np.searchsorted(zero, starts).tolist() + [zero.size]
        zero_units = torch.from_numpy(zero - starts[batch[zero]])       # pages into the batch's buffer
        units = self._row_units((pos - starts[batch[pos]]) * A + (start - first * A))
        reads, writes = [None] * len(batches), [None] * H

        def issue_read(k):
            h = k % H
            if writes[h] is not None:                           # the buffer is free once its write landed
                ticket, writes[h] = writes[h], None
                self._engine.wait(ticket)
            requests = read_plan.batch(k)
            if requests[0].size:
                reads[k] = self._start(False, h * self._buf_bytes, *requests)
        try:
            ahead = SCATTER_AHEAD.get(H, H - 2)
            issued = 0
            for k in range(len(batches)):
                if issued == k:
                    issue_read(k)
                    issued += 1
                if reads[k] is not None:
                    ticket, reads[k] = reads[k], None
                    self._engine.wait(ticket)
                while issued < len(batches) and issued <= k + ahead:  # reads ahead overlap this batch's patch and write
                    issue_read(issued)
                    issued += 1
                h = k % H
                if zero_edges[k + 1] > zero_edges[k]:
                    self._stage_pages.index_fill_(0, zero_units[zero_edges[k]:zero_edges[k + 1]] + h * self._buf_pages,
                                                  0)
                r0, r1 = edges[k], edges[k + 1]
                self._patch(units[r0:r1], h, values[r0:r1])
                writes[h] = self._start(True, h * self._buf_bytes, *write_plan.batch(k))
            self._wait_all(writes)
        except BaseException:
            self._engine.drain()
            raise

    def _wait_all(self, tickets: list) -> None:
        """Wait for every outstanding ticket in ``tickets`` and clear it."""
        for h, ticket in enumerate(tickets):
            if ticket is not None:
                tickets[h] = None
                self._engine.wait(ticket)

    def _block_batches(self):
        hb = self._buf_blocks
        return [(b, min(b + hb, self._num_blocks)) for b in range(0, self._num_blocks, hb)]

    def _start_blocks(self, write: bool, h: int, b0: int, b1: int):
        """Whole blocks ``[b0, b1)`` to or from buffer ``h``, in max_request_bytes requests."""
        total = (b1 - b0) * self._block_bytes
        step = self._max_pages * self._align
        at = np.arange(0, total, step, dtype=np.int64)
        return self._start(write, h * self._buf_bytes, at, self._data_offset + b0 * self._block_bytes + at,
                           np.minimum(total - at, step))

    def _read_sequential(self, flat: torch.Tensor) -> None:
        """Every row into ``flat`` ``[num_rows, row]``: whole blocks, large requests."""
        H, br, N = self._nbuf, self.block_rows, self.num_rows
        batches = self._block_batches()
        tickets = [None] * len(batches)
        try:
            issued = 0
            for k, (b0, b1) in enumerate(batches):
                while issued < len(batches) and issued < k + H:
                    tickets[issued] = self._start_blocks(False, issued % H, *batches[issued])
                    issued += 1
                ticket, tickets[k] = tickets[k], None
                self._engine.wait(ticket)
                src = self._stage_rows[(k % H) * self._buf_blocks:]
                count = min(b1 * br, N) - b0 * br
                full = count // br
                flat[b0 * br:b0 * br + full * br].view(full, br, self._row_elems).copy_(src[:full])
                if count > full * br:
                    flat[b0 * br + full * br:b0 * br + count].copy_(src[full, :count - full * br])
        except BaseException:
            self._engine.drain()
            raise

    def _write_sequential(self, values: torch.Tensor) -> None:
        """Every row from ``values`` (any device and dtype; converted a batch at a time)."""
        H, br, N, bb = self._nbuf, self.block_rows, self.num_rows, self._block_bytes
        values = values.detach().reshape(N, self._row_elems)
        self._mark_dirty()
        padded = bb > br * self.row_bytes()
        writes = [None] * H
        try:
            for k, (b0, b1) in enumerate(self._block_batches()):
                h = k % H
                if writes[h] is not None:
                    ticket, writes[h] = writes[h], None
                    self._engine.wait(ticket)
                nblk = b1 - b0
                if padded:           # the stage held pages anywhere: padding must be zero again
                    self._stage[h * self._buf_bytes:h * self._buf_bytes + nblk * bb].view(nblk, bb)[
                        :, br * self.row_bytes():].zero_()
                dst = self._stage_rows[h * self._buf_blocks:h * self._buf_blocks + nblk]
                count = min(b1 * br, N) - b0 * br
                full = count // br
                dst[:full].copy_(values[b0 * br:b0 * br + full * br].reshape(full, br, self._row_elems))
                if count > full * br:
                    dst[full, :count - full * br].copy_(values[b0 * br + full * br:b0 * br + count])
                    dst[full, count - full * br:].zero_()       # rows past num_rows
                writes[h] = self._start_blocks(True, h, b0, b1)
            self._wait_all(writes)
        except BaseException:
            self._engine.drain()
            raise

    # ------------------------------------------------------------------ RowStore API
    def _gather_to(self, rows: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        n = rows.numel()
        if n == 0:
            return out
        perm = None
        if n > 1 and not bool((rows[1:] >= rows[:-1]).all()):
            rows, perm = torch.sort(rows)
        flat = out.view(n, self._row_elems) if perm is None else torch.empty(n, self._row_elems, dtype=self.dtype)
        self._gather_sorted(rows, flat)
        if perm is not None:
            out.view(n, self._row_elems)[perm] = flat
        return out

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        rows = self._check_rows(rows)
        self._check_file()
        return self._gather_to(rows, pinned_empty((rows.numel(),) + self.row_shape, self.dtype))

    def gather_into(self, rows: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """:meth:`gather` straight into ``out`` when it is a contiguous CPU tensor of the
        storage dtype and the rows' shape (else a new tensor, as :meth:`gather`)."""
        rows = self._check_rows(rows)
        self._check_file()
        want = (rows.numel(),) + self.row_shape
        if not (isinstance(out, torch.Tensor) and out.device.type == "cpu" and out.dtype == self.dtype
                and tuple(out.shape) == want and out.is_contiguous()):
            out = pinned_empty(want, self.dtype)
        return self._gather_to(rows, out)

    def scatter(self, rows: torch.Tensor, values: torch.Tensor) -> None:
        rows = self._check_rows(rows)
        self._check_file()
        values = self._check_values(values, rows.numel(), "values")
        n = rows.numel()
        if n == 0:
            return
        values = values.detach().to(device="cpu", dtype=self.dtype).reshape(n, self._row_elems)
        if n > 1 and not bool((rows[1:] > rows[:-1]).all()):
            rows, perm = torch.sort(rows)
            if bool((rows[1:] == rows[:-1]).any()):
                raise ValueError("rows passed to scatter must be unique")
            values = values[perm]
        self._mark_dirty()
        self._scatter_sorted(rows, values)
        self.versions.index_put_((rows,), torch.ones(1, dtype=torch.int64), accumulate=True)

    def _check_values(self, values, n, name):
        if not isinstance(values, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(values).__name__}")
        want = (n,) + self.row_shape
        if tuple(values.shape) != want:
            raise ValueError(f"{name} must have shape {list(want)}, got {list(values.shape)}")
        return values

    def read_all(self) -> torch.Tensor:
        self._check_file()
        out = pinned_empty(self.shape, self.dtype)
        if self.num_rows:
            self._read_sequential(out.view(self.num_rows, self._row_elems))
        return out

    def write_all(self, values: torch.Tensor) -> None:
        self._check_file()
        self._check_values(values, self.num_rows, "values")
        if self.num_rows == 0:
            return
        self._write_sequential(values)
        self.versions += 1

    def io_stats(self) -> dict:
        """Requests and bytes issued since the store was opened, and the I/O settings."""
        queue_depth, stage_bytes, gap, max_request = self._io_options
        stats = dict(self._engine.stats) if self._engine is not None else {}
        return {**stats, "io_engine": self.io_engine, "queue_depth": queue_depth, "stage_bytes": stage_bytes,
                "coalesce_gap_bytes": gap, "coalesce_write_gap_bytes": self._write_gap_bytes,
                "max_request_bytes": max_request, "align": self._align}

    def record_io(self, on: bool = True) -> list | None:
        """Start (``on``) or stop recording requests; returns the list being filled, of
        ``(write, file offsets, sizes)`` per group of requests issued together (numpy
        int64 arrays), e.g. to replay them with fio."""
        if self._closed:
            raise RuntimeError(f"NvmeStore {self.path!r} is closed")
        self._engine.trace = [] if on else None
        return self._engine.trace

    def nbytes(self) -> int:
        """Host memory held: the staging and header buffers and the versions (not the file)."""
        if self._closed:
            return 0
        return sum(t.numel() * t.element_size() for t in self._buffers) + self.versions.numel() * 8

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
        os.fsync(self._engine.fd)
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
        os.fsync(self._engine.fd)
        self._dirty = False

    def _release_lock(self) -> None:
        fd, self._lock_fd = getattr(self, "_lock_fd", None), None
        if fd is not None:
            os.close(fd)      # closing the descriptor drops the flock

    def close(self) -> None:
        """Flush and release the buffers, the I/O engine and the file's lock; idempotent."""
        if self._closed:
            if self._engine is not None:      # a failed construction
                self._close_engine()
            self._release_lock()
            return
        if os.getpid() != self._pid:          # a forked child (e.g. a loader worker): its parent owns the file
            self._closed, self._engine, self._locked, self._buffers, self._lock_fd = True, None, [], [], None
            return
        try:
            if self._dirty and os.path.exists(self.path):
                self.flush()
        finally:
            self._closed = True
            self._stage = self._stage_rows = self._stage_flat = self._stage_pages = None
            self._stage_elems = self._stage_windows = self._hdr_buf = None
            self._close_engine()
            self._release_lock()

    def _close_engine(self):
        global _LOCKED_BYTES
        engine, self._engine = self._engine, None
        try:
            if engine is not None:
                engine.drain()
                for t in self._locked:
                    _LOCKED_BYTES -= t.numel() * t.element_size()
                    engine.free(t)
        finally:
            self._locked, self._buffers = [], []
            if engine is not None:
                engine.close()

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
                f"block_rows={getattr(self, 'block_rows', None)}, io_engine={getattr(self, 'io_engine', None)!r}, "
                f"closed={self._closed})")
