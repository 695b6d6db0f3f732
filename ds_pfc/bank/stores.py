"""Row stores: where one state tensor of a bank lives.

A store holds ``[num_rows, width]`` values (``[num_rows]`` when ``width == 0``) in its
storage dtype and moves whole rows in and out. ``gather`` returns rows on the
store's side (device memory for the device tier, host memory for the others, pinned
when CUDA is available); the bank moves them to the compute device and converts
dtypes. Row ids passed to a store are sorted, unique, int64 on the CPU.
"""
from __future__ import annotations

import ctypes
import os
import threading
import warnings
import weakref
from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor

import torch

from ..devices import local_cpus, place_host_table

__all__ = ["RowStore", "DeviceStore", "HostStore", "pinned_empty", "pinned_table", "unregister_table",
           "default_threads", "REGISTER_MIN_BYTES", "THREADS_ENV", "CHUNK_BYTES", "PIN_FAILURE", "HostRegisterError",
           "pin_limits"]

# Tables at least this large are page-locked with cudaHostRegister instead of the
# caching host allocator, which rounds every block up to a power of two (a 2.56 GB
# table would pin 4.29 GB) and never returns it to the system.
REGISTER_MIN_BYTES = 64 << 20

# cudaHostRegister flags: the registration is seen by every CUDA context (portable), and
# the pages are mapped into the devices' address space (kernels read and write them).
HOST_REGISTER_PORTABLE = 1
HOST_REGISTER_MAPPED = 2

#: What a failed page-lock (``cudaHostRegister``) of a large host table does
#: (``pin_failure=``): ``"refuse"`` (the default) raises :class:`HostRegisterError`, with
#: nothing left registered; ``"fallback"`` keeps the table in pageable memory, warns once
#: (the same one-line reason) and carries on: slower staged copies, and a bank with
#: mapped access falls back to staged access (the GPU cannot read pageable memory).
PIN_FAILURE = ("refuse", "fallback")

#: Environment variable with the default number of threads of a :class:`HostStore`.
THREADS_ENV = "DS_PFC_BANK_THREADS"
#: A gather or scatter is split into chunks of at least this many bytes (one per thread):
#: below it, handing a chunk to another thread costs more than it saves.
CHUNK_BYTES = 1 << 20


def default_threads() -> int:
    """Threads of a :class:`HostStore` when none are given: ``$DS_PFC_BANK_THREADS``, or
    ``min(8, os.cpu_count())``."""
    value = os.environ.get(THREADS_ENV, "").strip()
    if value:
        try:
            threads = int(value)
        except ValueError:
            threads = 0
        if threads < 1:
            raise ValueError(f"{THREADS_ENV} must be a positive integer, got {value!r}")
        return threads
    return max(1, min(8, os.cpu_count() or 1))


def pinned_empty(shape, dtype) -> torch.Tensor:
    """A host tensor, page-locked when CUDA is available (plain memory otherwise:
    pinning needs a CUDA driver)."""
    return torch.empty(shape, dtype=dtype, pin_memory=torch.cuda.is_available())


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


class HostRegisterError(RuntimeError):
    """``cudaHostRegister`` of a host table failed; the message is one line with the size,
    the CUDA error and the limits that likely caused it (:func:`pin_limits`)."""


def _cgroup_memory_limit(cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> int | None:
    """This process's cgroup memory limit in bytes (v2 ``memory.max``, v1
    ``memory.limit_in_bytes``), None when unlimited or unknown."""
    candidates = []
    try:
        with open(cgroup) as f:
            for line in f:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                path = path.lstrip("/")
                if controllers == "":                              # cgroup v2
                    candidates.append(os.path.join(root, path, "memory.max"))
                elif "memory" in controllers.split(","):           # cgroup v1
                    candidates.append(os.path.join(root, "memory", path, "memory.limit_in_bytes"))
    except (OSError, ValueError):
        pass
    candidates += [os.path.join(root, "memory.max"), os.path.join(root, "memory", "memory.limit_in_bytes")]
    for path in candidates:
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text == "max":
            return None
        try:
            value = int(text)
        except ValueError:
            continue
        return None if value >= 1 << 60 else value      # v1 writes "no limit" as a huge number
    return None


def pin_limits(*, cgroup: str = "/proc/self/cgroup", cgroup_root: str = "/sys/fs/cgroup") -> dict[str, int | None]:
    """The limits on how much host memory this process may page-lock, in bytes (None:
    unlimited or unknown): ``memlock`` (``RLIMIT_MEMLOCK``, ``ulimit -l``) and ``cgroup``
    (the memory limit of this process's cgroup)."""
    memlock = None
    try:
        import resource
        soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        memlock = None if soft == resource.RLIM_INFINITY else int(soft)
    except (ImportError, OSError, ValueError, AttributeError):
        pass
    return {"memlock": memlock, "cgroup": _cgroup_memory_limit(cgroup, cgroup_root)}


def _size(nbytes: int) -> str:
    """Bytes in the largest binary unit that keeps a number of at least 1."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes / (1 << shift):.3g} {unit}"
    return f"{nbytes} B"


def _register_failure_message(nbytes: int, flags: int, err: int, limits: dict) -> str:
    """One line: what failed, and which limit likely caused it."""
    found = []
    likely = []
    for name, what, fix in (("memlock", "memlock (ulimit -l)", "raise it (ulimit -l unlimited; in a container "
                                                                "--ulimit memlock=-1)"),
                            ("cgroup", "cgroup memory limit", "raise the job's memory limit")):
        value = limits.get(name)
        found.append(f"{what} {'unlimited' if value is None else _size(value)}")
        if value is not None and value < nbytes:
            likely.append(f"{what} {_size(value)} is below the table: {fix}")
    cause = "; likely cause: " + "; ".join(likely) if likely else \
        " (no memlock or cgroup limit below it: pinnable memory of the node or an IOMMU limit)"
    return (f"cudaHostRegister of a {nbytes}-byte host table ({_size(nbytes)}, flags {flags}) failed with CUDA "
            f"error {err}; limits: {', '.join(found)}{cause}")


_LIBCUDART = None


def _clear_cuda_error() -> int | None:
    """Clear the CUDA runtime's last error on this thread (``cudaGetLastError``), so that a
    failed call is not reported again by the next unrelated launch check; returns the
    error cleared, or None when no runtime function could be reached."""
    runtime = torch.cuda.cudart()
    fn = getattr(runtime, "cudaGetLastError", None)
    if fn is None:                      # torch's bindings lack it: the runtime library torch loaded
        global _LIBCUDART
        if _LIBCUDART is None:
            _LIBCUDART = _loaded_cudart() or False
        fn = getattr(_LIBCUDART, "cudaGetLastError", None) if _LIBCUDART else None
    if fn is None:
        return None
    try:
        return int(fn())
    except (OSError, TypeError, ValueError):
        return None


def _loaded_cudart(maps: str = "/proc/self/maps"):
    """The CUDA runtime library already loaded in this process (ctypes), or None."""
    try:
        with open(maps) as f:
            paths = {line.split()[-1] for line in f if "libcudart" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            return ctypes.CDLL(path, mode=getattr(os, "RTLD_NOLOAD", 0) | ctypes.RTLD_GLOBAL)
        except OSError:
            continue
    return None


# Registered tables by address: the finalizer that unregisters each. A table is
# unregistered by :func:`unregister_table` or, if its owner never calls it (a bank that
# failed half-built, one dropped without close()), when the table is collected.
_REGISTERED: dict[int, weakref.finalize] = {}
_REGISTERED_LOCK = threading.Lock()


def _unregister(ptr: int) -> int:
    with _REGISTERED_LOCK:
        _REGISTERED.pop(ptr, None)
    err = int(torch.cuda.cudart().cudaHostUnregister(ptr))
    if err != 0:
        _clear_cuda_error()
    return err


def _track(table: torch.Tensor) -> None:
    ptr = table.data_ptr()
    # The finalizer holds the address, not the table: it runs when the table is collected,
    # before its memory is freed, and never at interpreter exit (the driver is gone then).
    fin = weakref.finalize(table, _unregister, ptr)
    fin.atexit = False
    with _REGISTERED_LOCK:
        _REGISTERED[ptr] = fin


def registered_tables() -> int:
    """How many host tables are registered now (through :func:`pinned_table`)."""
    with _REGISTERED_LOCK:
        return len(_REGISTERED)


def pinned_table(shape, dtype, mapped: bool = False, near=None, *, pin_failure: str = "refuse",
                 report: dict | None = None) -> tuple[torch.Tensor, bool]:
    """A long-lived host table, page-locked when CUDA is available; returns it and
    whether it was registered (then :func:`unregister_table` releases it; a table never
    released is unregistered when it is collected).

    ``mapped=True``: the table is also mapped into the GPUs' address space, for kernels
    that read and write it directly. A large table is then pre-faulted (every page
    touched, as zeros) and registered with ``cudaHostRegisterPortable |
    cudaHostRegisterMapped``; a small one (below :data:`REGISTER_MIN_BYTES`) comes from
    the pinned allocator (``cudaHostAlloc``), whose memory is portable and mapped under
    unified addressing. Without CUDA the table is plain memory either way. ``near``: the
    CUDA device that will read a large mapped table; its pages are asked to be huge and
    are touched first from that GPU's NUMA node where the job's CPU set allows
    (:func:`ds_pfc.devices.place_host_table`).

    A failed registration clears the CUDA error it left and is reported in one line
    with the page-lock limits that likely caused it (:func:`pin_limits`); then
    ``pin_failure`` (:data:`PIN_FAILURE`) decides: ``"refuse"`` raises
    :class:`HostRegisterError` (nothing registered), ``"fallback"`` warns and returns the
    table unregistered, in pageable memory. ``report``: a dict filled with what happened
    (``"placement"``: the NUMA placement of a mapped table, ``"registered"``,
    ``"pinned"``, ``"pin_failure"``: the message of a failure that fell back).
    """
    if pin_failure not in PIN_FAILURE:
        raise ValueError(f"pin_failure must be one of {PIN_FAILURE}, got {pin_failure!r}")
    report = {} if report is None else report
    cuda = torch.cuda.is_available()
    report.update(placement=None, registered=False, pinned=cuda, pin_failure=None)
    nbytes = _numel(shape) * torch.empty((), dtype=dtype).element_size()
    if not cuda or nbytes < REGISTER_MIN_BYTES:
        return pinned_empty(shape, dtype), False
    table = torch.empty(shape, dtype=dtype)
    flags = 0
    if mapped:
        report["placement"] = place_host_table(table, local_cpus(near) if near is not None else None)  # zeroed
        flags = HOST_REGISTER_PORTABLE | HOST_REGISTER_MAPPED
    err = int(torch.cuda.cudart().cudaHostRegister(table.data_ptr(), nbytes, flags))
    if err != 0:
        _clear_cuda_error()
        message = _register_failure_message(nbytes, flags, err, pin_limits())
        if pin_failure == "refuse":
            raise HostRegisterError(f"{message}; pin_failure='fallback' would keep it in pageable memory")
        message += "; kept in pageable memory (pin_failure='fallback')"
        report.update(pin_failure=message, pinned=False)
        warnings.warn(f"ds_pfc: {message}", RuntimeWarning, stacklevel=2)
        return table, False
    _track(table)
    report["registered"] = True
    return table, True


def unregister_table(table: torch.Tensor) -> None:
    """Release a table that :func:`pinned_table` registered (a second call does nothing)."""
    with _REGISTERED_LOCK:
        fin = _REGISTERED.get(table.data_ptr())
    if fin is None or not fin.alive:
        return
    err = fin()
    if err:
        raise RuntimeError(f"cudaHostUnregister of a host table failed with CUDA error {err}")


def _count(versions: torch.Tensor, rows: torch.Tensor) -> None:
    """``versions[rows] += 1`` for unique ``rows``, in one pass (no gather and put)."""
    if rows.numel():
        versions.index_add_(0, rows, torch.ones((), dtype=versions.dtype).expand(rows.numel()))


class RowStore(ABC):
    """``num_rows`` rows of ``width`` values of ``dtype`` in one tier."""

    tier: str = "?"

    def __init__(self, num_rows: int, width: int, dtype: torch.dtype):
        self.num_rows, self.width, self.dtype = num_rows, width, dtype
        # Completed scatters per row. The bank counts the writes it *issued*; a row
        # whose counts differ is stale (its write-back has not landed) or torn.
        self.versions = torch.zeros(num_rows, dtype=torch.int32)

    @property
    def row_shape(self) -> tuple[int, ...]:
        return () if self.width == 0 else (self.width,)

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_rows,) + self.row_shape

    def row_bytes(self) -> int:
        return max(self.width, 1) * torch.empty((), dtype=self.dtype).element_size()

    def count_landed(self, rows: torch.Tensor) -> None:
        """Count one completed write of ``rows`` whose data was copied in by the
        caller (asynchronously, and has now landed)."""
        _count(self.versions, rows)

    @abstractmethod
    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        """Values of ``rows`` (sorted unique CPU int64), ``[len(rows), *row_shape]``."""

    def gather_into(self, rows: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """:meth:`gather` into ``out`` (contiguous, storage dtype, the store's side)
        where the store can; returns the values (``out`` or a new tensor)."""
        return self.gather(rows)

    @abstractmethod
    def scatter(self, rows: torch.Tensor, values: torch.Tensor) -> None:
        """Store ``values`` (any device, any float dtype) into ``rows``."""

    @abstractmethod
    def read_all(self) -> torch.Tensor:
        """All rows as a new host tensor in the storage dtype."""

    @abstractmethod
    def write_all(self, values: torch.Tensor) -> None:
        """Replace all rows."""

    @abstractmethod
    def nbytes(self) -> int:
        """Bytes this store keeps resident in its tier."""

    def flush(self) -> None:
        """Make every completed scatter durable (a no-op in memory)."""

    def close(self) -> None:
        """Release resources; the store must not be used afterwards."""


class _MemoryStore(RowStore):
    """A store whose rows are one tensor, ``self.data``."""

    data: torch.Tensor

    def read_all(self):
        """All rows as a new host tensor (never a second copy on the device)."""
        return self.data.to("cpu", copy=True)

    def write_all(self, values):
        self.data.copy_(values)
        self.versions += 1

    def nbytes(self):
        return self.data.numel() * self.data.element_size()


class DeviceStore(_MemoryStore):
    """Rows in memory of the compute device."""

    tier = "device"

    def __init__(self, num_rows, width, dtype, device, init: torch.Tensor | None = None):
        super().__init__(num_rows, width, dtype)
        self.device = torch.device(device)
        if init is None:
            self.data = torch.zeros(self.shape, dtype=dtype, device=self.device)
        else:
            self.data = init.to(device=self.device, dtype=dtype)

    def gather(self, rows):
        return self.data.index_select(0, rows.to(self.device))

    def scatter(self, rows, values):
        self.data.index_copy_(0, rows.to(self.device), values.to(device=self.device, dtype=self.dtype))
        _count(self.versions, rows)


class HostStore(_MemoryStore):
    """Rows in host memory: page-locked when CUDA is available, so that staged rows
    copy to the GPU asynchronously.

    ``threads``: how many threads a gather or scatter uses, the caller's included
    (None: ``$DS_PFC_BANK_THREADS``, else ``min(8, os.cpu_count())``; see
    :func:`default_threads`). The store's own, whatever torch's intra-op setting
    (``torch.set_num_threads``; torchrun sets it to 1): the rows are split into at most
    ``threads`` chunks of at least ``chunk_rows`` rows (default: 1 MiB worth,
    :data:`CHUNK_BYTES`); the caller runs the first one and a pool of ``threads - 1``
    threads, started at the first split and stopped by :meth:`close`, runs the others
    (torch ops release the GIL). With torch intra-op threads above 1 a chunk's ops may
    use them too (on 2 cores, 2 x 2 threads measured no slower than either alone).

    How rows move (sorted unique int64 row ids; measured by ``ds-pfc-bench hostpath``):
    a row is copied as a few wide words (the largest of 16, 8, 4 or 2 bytes that
    divides it and is wider than an element) rather than element by element: a gather
    is ``index_select`` into the caller's buffer, a scatter ``index_copy_`` of the same
    words (values of another dtype are converted first, as ``values.to(dtype)``
    would), bit for bit, and a scattered row's version is counted in the same chunk,
    right after its data (``index_add_``). A contiguous range of rows is copied as one
    slice. Row ids out of range raise ``IndexError`` before anything is written.

    ``mapped=True``: the table is also mapped into the GPUs' address space (see
    :func:`pinned_table`), for kernels that access it in place; :attr:`mapped` says
    whether it was asked for. ``pin_failure``: what a failed page-lock does
    (:data:`PIN_FAILURE`); :attr:`pinned` says whether the table is page-locked (or from
    the pinned allocator), :attr:`start_up` what start-up did (NUMA placement,
    registration, a failure that fell back).
    """

    tier = "host"

    def __init__(self, num_rows, width, dtype, init: torch.Tensor | None = None, *, threads: int | None = None,
                 mapped: bool = False, chunk_rows: int | None = None, near=None, pin_failure: str = "refuse"):
        super().__init__(num_rows, width, dtype)
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self.threads = default_threads() if threads is None else threads
        if chunk_rows is None:
            chunk_rows = max(1, CHUNK_BYTES // self.row_bytes())
        if int(chunk_rows) < 1:
            raise ValueError(f"chunk_rows must be a positive integer, got {chunk_rows!r}")
        self.chunk_rows = int(chunk_rows)
        self._mapped = bool(mapped)
        self.start_up: dict = {}
        self.data, self._registered = pinned_table(self.shape, dtype, mapped=self._mapped, near=near,
                                                   pin_failure=pin_failure, report=self.start_up)
        # Rows are moved as words of this dtype (None: element by element).
        self._word = _word_dtype(self.data, self.row_bytes()) if width else None
        if init is not None:
            self.data.copy_(init)
        elif self.start_up.get("placement") is None:       # a placed table is zeroed already
            self.data.zero_()

    # ---------------------------------------------------------------- threads
    @property
    def pinned(self) -> bool:
        """Whether the table is page-locked: registered, or from the pinned allocator
        (False without CUDA, and after a registration failure that fell back)."""
        return bool(self.start_up.get("pinned"))

    @property
    def mapped(self) -> bool:
        """Whether the table was asked to be mapped into the GPUs' address space
        (``mapped=True``; without CUDA it is plain host memory all the same)."""
        return self._mapped

    @property
    def threads(self) -> int:
        """Threads per gather or scatter, the caller's included (settable between
        operations, not during one)."""
        return self._threads

    @threads.setter
    def threads(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"threads must be a positive integer, got {value!r}")
        with self._pool_lock:
            pool, self._pool = self._pool, None
            self._threads = value
        if pool is not None:
            pool.shutdown(wait=True)

    def _chunks(self, num: int) -> list[tuple[int, int]]:
        per = max(self.chunk_rows, -(-num // self._threads))
        return [(lo, min(num, lo + per)) for lo in range(0, num, per)]

    def _run(self, num: int, fn) -> None:
        """``fn(lo, hi)`` over ``[0, num)`` in chunks: the first on this thread, the
        others on the pool; returns when all finished, raising the first error."""
        chunks = self._chunks(num)
        if len(chunks) <= 1:
            if num:
                fn(0, num)
            return
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=self._threads - 1, thread_name_prefix="ds_pfc-host-rows")
            pool = self._pool
        futures = [pool.submit(fn, lo, hi) for lo, hi in chunks[1:]]
        error = None
        try:
            fn(*chunks[0])
        except BaseException as exc:   # noqa: BLE001 - re-raised below, after every chunk finished
            error = exc
        for fut in futures:            # every chunk finishes before the buffers go back to the caller
            exc = fut.exception()
            if exc is not None and error is None:
                error = exc
        if error is not None:
            raise error

    # ---------------------------------------------------------------- rows
    def _check_rows(self, rows: torch.Tensor) -> tuple[torch.Tensor, int | None]:
        """``rows`` as int64, checked against the table; and the first row if they are
        a contiguous range (else None)."""
        if rows.dim() != 1 or rows.dtype not in (torch.int64, torch.int32) or rows.device.type != "cpu":
            raise ValueError(f"rows must be a 1-D int64 CPU tensor, got shape {tuple(rows.shape)}, {rows.dtype} "
                             f"on {rows.device}")
        rows = rows.to(torch.int64)
        num = rows.numel()
        if num == 0:
            return rows, None
        lo, hi = (int(v) for v in torch.aminmax(rows))
        if lo < 0 or hi >= self.num_rows:
            raise IndexError(f"row ids must lie in [0, {self.num_rows}), got ids from {lo} to {hi}")
        if int(rows[0]) == lo and hi - lo == num - 1 and (num <= 2 or bool((rows[1:] - rows[:-1] == 1).all())):
            return rows, lo
        return rows, None

    def _words(self, *tensors: torch.Tensor):
        """The word dtype that ``tensors`` (rows of this store, contiguous) can all be
        viewed as, or None."""
        word = self._word
        if word is None:
            return None
        size = torch.empty((), dtype=word).element_size()
        for t in tensors:
            if not t.is_contiguous() or t.data_ptr() % size:
                return None
        return word

    def gather(self, rows):
        return self.gather_into(rows, pinned_empty((rows.numel(),) + self.row_shape, self.dtype))

    def gather_into(self, rows, out):
        num = rows.numel()
        if tuple(out.shape) != (num,) + self.row_shape or out.dtype != self.dtype or out.device.type != "cpu" \
                or not out.is_contiguous():
            return torch.index_select(self.data, 0, rows, out=out)     # an unusual buffer: torch's own path
        rows, start = self._check_rows(rows)
        if start is not None:
            src = self.data[start:start + num]
            self._run(num, lambda lo, hi: out[lo:hi].copy_(src[lo:hi]))
            return out
        word = self._words(out)
        data, dst = (self.data, out) if word is None else (self.data.view(word), out.view(word))
        self._run(num, lambda lo, hi: torch.index_select(data, 0, rows[lo:hi], out=dst[lo:hi]))
        return out

    def scatter(self, rows, values):
        num = rows.numel()
        if tuple(values.shape) != (num,) + self.row_shape:
            raise ValueError(f"scatter of {num} rows of shape {self.row_shape} got values of shape "
                             f"{tuple(values.shape)}")
        if values.device.type != "cpu":
            values = values.to(device="cpu", dtype=self.dtype)
        rows, start = self._check_rows(rows)
        versions = self.versions
        if start is not None:
            dst = self.data[start:start + num]

            def copy_range(lo, hi):
                dst[lo:hi].copy_(values[lo:hi])          # converts as values.to(self.dtype) would
                versions[start + lo:start + hi] += 1
            self._run(num, copy_range)
            return
        convert = values.dtype != self.dtype
        if not convert:
            values = values.contiguous()
        word = self._words(self.data) if convert else self._words(values)
        data = self.data if word is None else self.data.view(word)

        def copy_rows(lo, hi):
            src = values[lo:hi]
            if convert:
                src = src.to(self.dtype).contiguous()
            ids = rows[lo:hi]
            data.index_copy_(0, ids, src if word is None else src.view(word))
            _count(versions, ids)
        self._run(num, copy_rows)

    def close(self):
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        if self._registered:
            self._registered = False
            unregister_table(self.data)


def _word_dtype(table: torch.Tensor, row_bytes: int) -> torch.dtype | None:
    """The widest word a row of ``table`` can be copied as, if wider than its element."""
    for dtype in (torch.complex128, torch.int64, torch.int32, torch.int16):
        size = torch.empty((), dtype=dtype).element_size()
        if size <= table.element_size():
            return None
        if row_bytes % size == 0 and table.data_ptr() % size == 0:
            return dtype
    return None
