"""Device-resident bank: every state tensor lives on the compute device."""
from __future__ import annotations

import torch

from .base import ClassBank

__all__ = ["DeviceBank"]


class DeviceBank(ClassBank):
    """All state in memory of ``device`` (GPU memory, or plain memory on CPU)."""

    def __init__(self, num_rows: int, device="cpu", class_start: int = 0):
        super().__init__(num_rows, device)
        self._states: dict[str, torch.Tensor] = {}

    def add_state(self, name, width, dtype, init=None):
        if name in self._states:
            raise ValueError(f"state {name!r} already exists")
        shape = (self.num_rows,) if width == 0 else (self.num_rows, width)
        if callable(init):
            init = init(0, self.num_rows)
        if init is None:
            tensor = torch.zeros(shape, dtype=dtype, device=self.device)
        else:
            if tuple(init.shape) != shape:
                raise ValueError(f"init for state {name!r} must have shape {shape}, got {tuple(init.shape)}")
            # The bank takes ownership of ``init`` when it already has the right
            # device and dtype: at millions of rows a copy would double peak memory.
            tensor = init.to(device=self.device, dtype=dtype)
        self._states[name] = tensor

    def state_names(self):
        return list(self._states)

    def _get(self, name):
        try:
            return self._states[name]
        except KeyError:
            raise KeyError(f"bank has no state {name!r}; it holds {self.state_names()}") from None

    def read(self, name, rows):
        state = self._get(name)
        return state if rows is None else state.index_select(0, rows)

    def write(self, name, rows, values):
        state = self._get(name)
        if rows is None:
            if values.data_ptr() != state.data_ptr():
                state.copy_(values)
        else:
            state.index_copy_(0, rows, values.to(state.dtype))

    def load_rows(self, name, lo, values):
        state = self._get(name)
        state[lo:lo + values.shape[0]].copy_(values)      # one block moves and converts, no full-size temporary

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The live state tables (for in-place fused updates)."""
        return dict(self._states)

    def export(self, name):
        # Straight to host memory (a device -> host copy needs no device temporary).
        return self._get(name).detach().to("cpu", copy=True)

    def export_rows(self, name, lo, hi):
        return self._get(name)[lo:hi].detach().to("cpu", copy=True)

    def resident_bytes(self):
        total = sum(t.numel() * t.element_size() for t in self._states.values())
        return {"device": total, "host": 0, "nvme": 0}
