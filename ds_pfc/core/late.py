"""Values a host reads one step late, without stalling for the device.

:class:`LateRead` takes a small device tensor now and gives its values later: on CUDA
a non-blocking copy into pinned host memory and an event recorded behind it; reading
waits on that event, which the device passed long before (a step ago), then reads host
memory. Nothing in between blocks the host, so the host keeps queueing work. On CPU the
copy is a plain clone, read the same way, so the op sequence (and a sync count taken on
CPU) is the one a GPU runs.
"""
from __future__ import annotations

import torch

__all__ = ["LateRead"]


class LateRead:
    """``LateRead(t)`` now, ``.values()`` (a nested list, like ``tolist``) later."""

    __slots__ = ("_host", "_event")

    def __init__(self, tensor: torch.Tensor):
        t = tensor.detach()
        if t.is_cuda:
            self._host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self._host.copy_(t, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = t.clone()
            self._event = None

    def ready(self) -> bool:
        """The values have landed on the host (always on CPU)."""
        return self._event is None or self._event.query()

    def values(self) -> list:
        """The values, as ``tensor.tolist()`` would give them. Waits for the copy's
        event (the device got past it long ago when read a step later); reads host
        memory only, never the device."""
        if self._event is not None:
            self._event.synchronize()
        return self._host.numpy().tolist()
