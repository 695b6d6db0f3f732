"""A host-tier state with a share of its rows kept in device memory.

``SplitStore`` holds rows ``[0, n_device)`` of a state in device memory and the rest in
(page-locked, mapped) host memory. Classes are sampled uniformly, so a share ``f`` of the
rows in device memory takes a share ``f`` of every step's cold fetches and write-backs
off PCIe and off host memory: host traffic scales by ``1 - f``. Used with mapped host
access (``TieredBank(..., host_access="mapped", hbm_share=f)``), where the row-move kernel
reads and writes either part in place; the staged path has no use for it (its rows go
through host staging buffers anyway) and the bank refuses the combination.
"""
from __future__ import annotations

import torch

from .stores import DeviceStore, HostStore, RowStore

__all__ = ["SplitStore"]


class SplitStore(RowStore):
    """Rows ``[0, n_device)`` on ``device``, the others in host memory (see the module
    docstring). ``tier`` is ``"host"``: the state is placed on the host tier, with a share
    cached in device memory."""

    tier = "host"

    def __init__(self, num_rows: int, width: int, dtype: torch.dtype, device, n_device: int, mapped: bool = True):
        super().__init__(num_rows, width, dtype)
        if not 0 <= n_device <= num_rows:
            raise ValueError(f"n_device must lie in [0, {num_rows}], got {n_device}")
        self.n_device = n_device
        self.device_part = DeviceStore(n_device, width, dtype, device)
        self.host_part = HostStore(num_rows - n_device, width, dtype, mapped=mapped, near=device if mapped else None)

    def tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        return (self.device_part.data, self.host_part.data)

    def _split(self, rows: torch.Tensor):
        low = rows < self.n_device
        return torch.nonzero(low).squeeze(1), torch.nonzero(~low).squeeze(1)

    def gather(self, rows):
        rows = rows.to("cpu", torch.int64)
        lo, hi = self._split(rows)
        out = torch.empty((rows.numel(),) + self.row_shape, dtype=self.dtype)
        if lo.numel():
            out[lo] = self.device_part.gather(rows[lo]).to("cpu")
        if hi.numel():
            out[hi] = self.host_part.gather(rows[hi] - self.n_device)
        return out

    def scatter(self, rows, values):
        rows = rows.to("cpu", torch.int64)
        values = values.to("cpu")
        lo, hi = self._split(rows)
        if lo.numel():
            self.device_part.scatter(rows[lo], values[lo])
        if hi.numel():
            self.host_part.scatter(rows[hi] - self.n_device, values[hi])
        self.versions[rows] += 1

    def read_all(self):
        return torch.cat([self.device_part.read_all(), self.host_part.read_all()])

    def write_all(self, values):
        self.device_part.write_all(values[: self.n_device])
        self.host_part.write_all(values[self.n_device:])
        self.versions += 1

    def nbytes(self):
        return self.device_part.nbytes() + self.host_part.nbytes()

    def nbytes_by_tier(self) -> dict[str, int]:
        return {"device": self.device_part.nbytes(), "host": self.host_part.nbytes()}

    def close(self):
        self.host_part.close()
