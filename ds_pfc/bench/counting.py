"""Count aten ops and host-synchronising ops, on any device.

On a GPU every aten op that computes is about one kernel launch, and an op whose
result the host must read (``.item()``, ``.tolist()``, ``bool(t)``, ``nonzero``,
``unique``, boolean-mask indexing, ``torch.equal``) stalls the host until the device
has caught up. Both are properties of the op sequence, not of the device, so counting
them on CPU tensors (with the CUDA path's block sizes) describes the GPU step.

``OpCounter`` counts every aten op that reaches the dispatcher except views and bare
allocations (they launch nothing), and the synchronising subset. ``Tensor.tolist``
never reaches the dispatcher, so it is counted by wrapping it while the counter is
active. A Triton kernel launch counts as one op (``triton:<kernel>``); under Triton's
interpreter the torch work the interpreter does to emulate the kernel is not counted.
"""
from __future__ import annotations

import sys
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

__all__ = ["OpCounter"]

_aten = torch.ops.aten
# Allocations and aliasing: no kernel runs.
_FREE = {
    _aten.empty.memory_format, _aten.empty_strided.default, _aten.empty_like.default, _aten.new_empty.default,
    _aten.new_empty_strided.default, _aten.detach.default, _aten.lift_fresh.default, _aten.alias.default,
}
_INDEXING = {_aten.index.Tensor, _aten.index_put_.default, _aten.index_put.default, _aten._index_put_impl_.default}


def _is_sync(func, args) -> bool:
    tags = func.tags
    if torch.Tag.data_dependent_output in tags:
        return True
    if func in _INDEXING:
        # Integer indices are plain gathers/scatters; a boolean mask needs its count first.
        indices = args[1] if len(args) > 1 else ()
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices if i is not None)
    return torch.Tag.dynamic_output_shape in tags


class OpCounter(TorchDispatchMode):
    """``with OpCounter() as c: ...``; then ``c.ops``, ``c.syncs`` and ``c.by_op``.

    ``c.sync_ops`` names each synchronising op in call order, to say where they are.
    """

    def __init__(self):
        super().__init__()
        self.ops = 0
        self.syncs = 0
        self.by_op: Counter = Counter()
        self.sync_ops: list[str] = []
        self._tolist = None
        self._patched: list[tuple[object, str, object]] = []

    def __enter__(self):
        original = torch.Tensor.tolist
        counter = self

        def tolist(tensor, *args, **kwargs):
            counter.syncs += 1
            counter.sync_ops.append("Tensor.tolist")
            return original(tensor, *args, **kwargs)

        self._tolist = original
        torch.Tensor.tolist = tolist
        if "triton" in sys.modules:
            self._patch_triton()
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        for owner, name, original in reversed(self._patched):
            setattr(owner, name, original)
        self._patched = []
        return super().__exit__(*exc)

    def _patch_triton(self) -> None:
        """Count each kernel launch once, compiled (``JITFunction.run``) or interpreted."""
        from triton.runtime import interpreter, jit
        counter = self
        for owner in (jit.JITFunction, interpreter.InterpretedFunction):
            original = owner.run

            def run(fn, *args, _original=original, **kwargs):
                if not kwargs.get("warmup", False):
                    name = "triton:" + getattr(fn, "__name__", "kernel")
                    counter.ops += 1
                    counter.by_op[name] += 1
                with _disable_current_modes():
                    return _original(fn, *args, **kwargs)

            self._patched.append((owner, "run", original))
            owner.run = run

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not (func.is_view or func in _FREE):
            name = str(func.overloadpacket.__name__)
            self.ops += 1
            self.by_op[name] += 1
            if _is_sync(func, args):
                self.syncs += 1
                self.sync_ops.append(name)
        return func(*args, **kwargs)

    def summary(self) -> dict:
        return {"ops": self.ops, "syncs": self.syncs, "sync_ops": list(self.sync_ops),
                "top_ops": dict(self.by_op.most_common(12))}
