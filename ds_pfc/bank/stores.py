"""Row stores: where one state tensor of a bank lives.

A store holds ``[num_rows, width]`` values (``[num_rows]`` when ``width == 0``) in its
storage dtype and moves whole rows in and out. ``gather`` returns rows on the
store's side (device memory for the device tier, host memory for the others, pinned
when CUDA is available); the bank moves them to the compute device and converts
dtypes. Row ids passed to a store are sorted, unique, int64 on the CPU.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

__all__ = ["RowStore", "DeviceStore", "HostStore", "pinned_empty", "REGISTER_MIN_BYTES"]

# Tables at least this large are page-locked with cudaHostRegister instead of the
# caching host allocator, which rounds every block up to a power of two (a 2.56 GB
# table would pin 4.29 GB) and never returns it to the system.
REGISTER_MIN_BYTES = 64 << 20


def pinned_empty(shape, dtype) -> torch.Tensor:
    """A host tensor, page-locked when CUDA is available (plain memory otherwise:
    pinning needs a CUDA driver)."""
    return torch.empty(shape, dtype=dtype, pin_memory=torch.cuda.is_available())


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def pinned_table(shape, dtype) -> tuple[torch.Tensor, bool]:
    """A long-lived host table, page-locked when CUDA is available; returns it and
    whether it was registered (then :func:`unregister_table` must release it)."""
    nbytes = _numel(shape) * torch.empty((), dtype=dtype).element_size()
    if not torch.cuda.is_available() or nbytes < REGISTER_MIN_BYTES:
        return pinned_empty(shape, dtype), False
    table = torch.empty(shape, dtype=dtype)
    err = torch.cuda.cudart().cudaHostRegister(table.data_ptr(), nbytes, 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of a {nbytes}-byte host table failed with CUDA error {int(err)}")
    return table, True


def unregister_table(table: torch.Tensor) -> None:
    err = torch.cuda.cudart().cudaHostUnregister(table.data_ptr())
    if int(err) != 0:
        raise RuntimeError(f"cudaHostUnregister of a host table failed with CUDA error {int(err)}")


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
        self.versions[rows] += 1

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
        self.versions[rows] += 1


class HostStore(_MemoryStore):
    """Rows in host memory: page-locked when CUDA is available, so that staged rows
    copy to the GPU asynchronously. Gathers and scatters run on torch's intra-op
    thread pool (``torch.set_num_threads``)."""

    tier = "host"

    def __init__(self, num_rows, width, dtype, init: torch.Tensor | None = None):
        super().__init__(num_rows, width, dtype)
        self.data, self._registered = pinned_table(self.shape, dtype)
        if init is None:
            self.data.zero_()
        else:
            self.data.copy_(init)

    def gather(self, rows):
        return self.gather_into(rows, pinned_empty((rows.numel(),) + self.row_shape, self.dtype))

    def gather_into(self, rows, out):
        return torch.index_select(self.data, 0, rows, out=out)

    def scatter(self, rows, values):
        self.data.index_copy_(0, rows, values.to(device="cpu", dtype=self.dtype))
        self.versions[rows] += 1

    def close(self):
        if self._registered:
            self._registered = False
            unregister_table(self.data)
