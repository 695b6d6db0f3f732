"""Which GPU the kernels' launch parameters are chosen for, also under Triton's interpreter.

Under ``TRITON_INTERPRET=1`` the kernel modules pick small interpreter tiles and a pretend SM
count (fast CPU tests). The step model (:mod:`ds_pfc.bench.model`) needs the opposite: it runs
the kernels in the interpreter to count what they load, store and multiply, and the counts are
only those of the GPU when the launches use the GPU's tile-table rows, grids and splits. So::

    with gpu_tiles(sms=132):     # an H100's SM count
        ...                      # launches choose their GPU tiles, and 132 SMs for grid sizing

Contract for kernel modules (a few lines each): wherever a tile size or block choice
distinguishes the interpreter from a GPU, choose the GPU row when :func:`active` is true, and
wherever a grid depends on the device's SM count, use :func:`sms` when it is not None.

``GPU_ONLY_CONSTEXPRS`` names constexprs that exist only to work around the interpreter
(``UPCAST``: bf16/fp16 dot operands kept in float32 there); compiling a launch for the GPU
(the model reads the sm_90 machine code) sets them to these values.
"""
from __future__ import annotations

import contextlib
import threading

__all__ = ["gpu_tiles", "active", "sms", "arch", "GPU_ONLY_CONSTEXPRS"]

GPU_ONLY_CONSTEXPRS = {"UPCAST": False}

_state = threading.local()


def active() -> bool:
    """True inside :func:`gpu_tiles`: launches use the GPU tile table."""
    return getattr(_state, "sms", None) is not None


def sms() -> int | None:
    """The target's SM count inside :func:`gpu_tiles`, else None (use the device's)."""
    return getattr(_state, "sms", None)


def arch() -> int | None:
    """The target's compute capability (``90`` for sm_90) inside :func:`gpu_tiles`, else None
    (use the device's): tile-table rows may differ by architecture (mma.sync before Hopper)."""
    return getattr(_state, "arch", None) if active() else None


@contextlib.contextmanager
def gpu_tiles(sms: int = 132, arch: int = 90):
    """Launch with the GPU tile table of compute capability ``arch`` and ``sms`` SMs for grid
    sizing (see the module doc)."""
    if isinstance(sms, bool) or not isinstance(sms, int) or sms < 1:
        raise ValueError(f"sms must be a positive int, got {sms!r}")
    if isinstance(arch, bool) or not isinstance(arch, int) or not 70 <= arch < 200:
        raise ValueError(f"arch must be a compute capability such as 80 or 90, got {arch!r}")
    previous = getattr(_state, "sms", None), getattr(_state, "arch", None)
    _state.sms, _state.arch = sms, arch
    try:
        yield
    finally:
        _state.sms, _state.arch = previous
