"""A GPU step model of the head, counted on a CPU: ``launch/bench.py head --predict h100``.

What is counted. One real head step (forward, backward, row optimizer) of a world-1
:class:`~ds_pfc.PartialFC` standing for one rank of the case (``C / k`` classes, the gathered
batch ``N``, width ``d``, the dtypes and backend of the case) runs on CPU tensors, and every
kernel it launches is counted:

* torch ops, through a dispatch mode (:class:`CostCounter`): the FLOPs of every matrix product
  (``2 m n k`` for mm/addmm/bmm/baddbmm and what matmul, linear and einsum decompose into) and
  the bytes each op reads and writes (a broadcast operand once; gathers and scatters
  (index, index_select, index_put, index_add, gather, scatter) move the indexed rows, not the
  whole source). A float32 cast of a bf16/fp16 product is folded into the product, as CUDA
  writes such a product in float32 directly (``mm(..., out_dtype=float32)``); an op that CUDA
  runs as several passes (logsumexp) counts all of them (:data:`_CUDA_PASSES`).
* Triton kernels, by instrumenting Triton's interpreter (``TRITON_INTERPRET=1``) inside
  :func:`ds_pfc.kernels._target.gpu_tiles`, so that every launch uses the GPU tile table and
  the target's SM count: per launch the dot FLOPs (``2 M N K`` per ``tl.dot``, over all
  programs), the bytes loaded and stored (masked-off lanes excluded, element size of the
  pointer) = traffic between L2 and the SMs, and the distinct bytes touched per tensor argument
  (a bitmap over each argument's storage, loads and stores apart) = HBM traffic.

Scaling. The counting step runs at the target ``N`` and ``d`` but at small ``S``: four runs
(two class-block sizes of the torch backend at S = 64, then S2 >= 320 and 2 S2; always with the
logits recomputed in backward, as at the target), and each kernel's launches, FLOPs and bytes
are fitted as ``a + b S + c B`` (``B`` the number of class blocks; :func:`fit_counts`) and
evaluated at the target ``S`` and its ``B`` (``block_bytes`` / 4N rows per block, 256 MiB by
default). Linear in ``S`` is exact for the torch blocks and for the streaming kernels at S
where their grids' class splits no longer change (:func:`_standard_runs` finds such S from
the grids alone); the counting step's labels draw from few classes so that positives never
exceed the small ``S``.

Time rule, per kernel: ``launches * launch + max(FLOPs / matrix rate, bytes / L2 rate,
unique bytes / HBM rate) / fill``. Triton kernels: the matrix rate is read from their machine
code compiled offline (``wgmma`` HGMMA: the tensor-core GEMM rate; ``mma.sync`` HMMA: half of
it on sm_90, all of it on sm_80; FFMA only: the float32 FMA rate); occupancy (CTAs per SM
from registers, shared memory and warps of the cubin) is reported, and ``fill`` = min(1,
programs per launch / SMs) charges grids that leave SMs idle. torch ops: products run at the
cuBLAS rate (bf16/fp16; float32 without TF32 at the SGEMM rate) with their bytes at the HBM
rate, everything else is bytes at the HBM rate. Floor: ``6 N S d`` FLOPs at the GEMM rate plus
the row optimizer's 20 bytes per element of ``S x d`` (SGD with momentum) at the HBM rate, at
the assumed rates of :data:`GPUS`; a calibrated prediction also gives it at the measured rates
(:func:`ds_pfc.bench.calibration.measured_floor`).
Collectives (world > 1) are not modelled. Constants and their sources: :data:`GPUS`.

Calibrated. The rule above is a roofline: it predicted 18.0 ms for the standard step that took
25.8-26.3 ms on an H200 (``benchmarks/results/gpu-h200-20261126.json``). :mod:`ds_pfc.bench.calibration`
replaces its assumed rates by what that GPU achieved, kernel by kernel, and adds the launch
and idle costs it measured and a cost per key of topk and sort; ``--predict`` prints both
predictions, the measurement where there is one, and the floor (``--calibration none``: the
roofline alone).
"""
from __future__ import annotations

import hashlib
import inspect
import json
import math
import os
import subprocess
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes


__all__ = ["GPUS", "CostCounter", "count_step", "fit_counts", "fit_case", "case_rows", "case_keeps", "cosines_path", "with_cosines_path",
           "predict", "predict_case",
           "kernel_time", "compare", "STANDARD_CASE", "saved_counts", "gpu_model_key", "group_predicted"]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# --------------------------------------------------------------------- constants
# Rates in FLOP/s and bytes/s. Sources: NVIDIA data sheets and whitepapers (peaks); achievable
# GEMM and HBM rates are typical measured fractions of them (cuBLAS at large shapes, STREAM-like
# copies); the L2 -> SM rates are assumptions (NVIDIA publishes none for H100), see "sources".
GPUS = {
    "h100": dict(
        name="H100 SXM", memory_bytes=80e9, arch=90, sms=132, clock_ghz=1.755,
        tensor_peak=989e12, gemm=700e12, sgemm=50e12, fma=67e12,
        hbm_peak=3.35e12, hbm=2.9e12, l2=6.5e12, launch_s=4e-6,
        regs_per_sm=65536, smem_per_sm=228 * 1024, smem_per_block=227 * 1024, warps_per_sm=64, ctas_per_sm=32,
        sources={"tensor_peak": "H100 SXM data sheet: 989 TF/s dense bf16",
                 "gemm": "cuBLAS bf16 at large shapes reaches ~70% of peak (assumed 700 TF/s)",
                 "sgemm": "float32 without TF32: ~75% of the 67 TF/s FMA peak (assumed 50 TF/s)",
                 "fma": "data sheet: 67 TF/s float32",
                 "hbm_peak": "data sheet: 3.35 TB/s", "hbm": "copies reach ~87% of peak (assumed 2.9 TB/s)",
                 "l2": "assumed 6.5 TB/s L2 -> SM (microbenchmarks report 5.5-7 TB/s)",
                 "launch_s": "assumed 4 us per launch (launch + tail of a stream-ordered kernel)"}),
    "h200": dict(
        name="H200 SXM", memory_bytes=141e9, arch=90, sms=132, clock_ghz=1.755,
        tensor_peak=989e12, gemm=700e12, sgemm=50e12, fma=67e12,
        hbm_peak=4.8e12, hbm=4.2e12, l2=6.5e12, launch_s=4e-6,
        regs_per_sm=65536, smem_per_sm=228 * 1024, smem_per_block=227 * 1024, warps_per_sm=64, ctas_per_sm=32,
        sources={"tensor_peak": "H200 data sheet: same SMs and clocks as H100 SXM, 989 TF/s dense bf16",
                 "gemm": "as H100 (assumed 700 TF/s)", "sgemm": "as H100 (assumed 50 TF/s)",
                 "fma": "as H100: 67 TF/s", "hbm_peak": "data sheet: 4.8 TB/s",
                 "hbm": "~87% of peak, as on H100 (assumed 4.2 TB/s)", "l2": "as H100 (assumed 6.5 TB/s)",
                 "launch_s": "assumed 4 us"}),
    "a100": dict(
        name="A100 SXM4 80GB", memory_bytes=80e9, arch=80, sms=108, clock_ghz=1.41,
        tensor_peak=312e12, gemm=250e12, sgemm=18e12, fma=19.5e12,
        hbm_peak=2.04e12, hbm=1.75e12, l2=4.5e12, launch_s=4e-6,
        regs_per_sm=65536, smem_per_sm=164 * 1024, smem_per_block=163 * 1024, warps_per_sm=64, ctas_per_sm=32,
        sources={"tensor_peak": "A100 data sheet: 312 TF/s dense bf16",
                 "gemm": "cuBLAS bf16 reaches ~80% of peak (assumed 250 TF/s)",
                 "sgemm": "~90% of the 19.5 TF/s FMA peak (assumed 18 TF/s)", "fma": "data sheet: 19.5 TF/s",
                 "hbm_peak": "data sheet (80 GB SXM4): 2.04 TB/s", "hbm": "~86% of peak (assumed 1.75 TB/s)",
                 "l2": "assumed 4.5 TB/s: the A100 whitepaper's 5120 B/clk x 1.41 GHz = 7.2 TB/s peak, "
                       "at the ~62% that H100's assumed rate is of its own",
                 "launch_s": "assumed 4 us"}),
}
# One rank of the standard case: k = 8 GPUs, C = 64M classes, r = 0.1 (S = 800k active rows per
# rank), N = 2048 gathered samples, d = 512, bf16 products, float32 embeddings.
STANDARD_CASE = dict(world=8, classes=64_000_000, sample_rate=0.1, batch=2048, dim=512, compute="bf16",
                     embeddings="fp32", backend="triton", block_bytes=None)

# --------------------------------------------------------------------- torch op costs
_aten = torch.ops.aten
_FREE = {_aten.empty.memory_format, _aten.empty_strided.default, _aten.empty_like.default, _aten.new_empty.default,
         _aten.new_empty_strided.default, _aten.detach.default, _aten.lift_fresh.default, _aten.alias.default,
         _aten.set_.source_Storage_storage_offset, _aten._local_scalar_dense.default}
# Positions of the two factors among each product's arguments.
_GEMMS = {"mm": (0, 1), "addmm": (1, 2), "addmm_": (1, 2), "bmm": (0, 1), "baddbmm": (1, 2), "baddbmm_": (1, 2),
          "mv": (0, 1), "addmv": (1, 2), "addmv_": (1, 2), "dot": (0, 1), "vdot": (0, 1)}
# Ops whose first tensor argument is written, never read.
_WRITE_ONLY = {"fill_", "zero_", "copy_", "normal_", "uniform_", "random_", "bernoulli_", "exponential_"}
_GATHERS = {"index", "index_select", "gather", "embedding", "take", "take_along_dim"}
_SCATTERS = {"index_put", "index_put_", "_index_put_impl_", "index_add", "index_add_", "index_copy", "index_copy_",
             "scatter", "scatter_", "scatter_add", "scatter_add_", "scatter_reduce", "scatter_reduce_",
             "index_fill", "index_fill_", "masked_scatter_"}


# Ops that one aten call runs as several full passes on CUDA: (reads, writes) of the input's
# size and launches. logsumexp over a dim is amax, sub, exp_, sum, log_, add_ (ATen's
# ReduceOps.cpp logsumexp_out_impl).
_CUDA_PASSES = {"logsumexp": (4, 2, 7)}


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)


def _nbytes(t: torch.Tensor) -> int:
    """Bytes of the distinct elements of ``t`` (a broadcast dimension, stride 0, once)."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            n *= size
    return n * t.element_size() if t.numel() else 0


def _gemm_flops(name: str, args) -> int:
    i, j = _GEMMS[name]
    a, b = args[i], args[j]
    if name in ("dot", "vdot"):
        return 2 * a.numel()
    if name.startswith(("mv", "addmv")):
        return 2 * a.shape[0] * a.shape[1]
    if name.startswith(("bmm", "baddbmm")):
        return 2 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]
    return 2 * a.shape[0] * a.shape[1] * b.shape[1]


def _op_bytes(name: str, args, kwargs, out) -> tuple[int, int]:
    """``(read, written)`` bytes of one aten op."""
    outs = list(_tensors(out))
    written = sum(_nbytes(t) for t in outs)
    if name in _GATHERS:      # the indices, the indexed rows of the source (= the result), the result
        index = sum(_nbytes(t) for t in _tensors(args[1:]) if not t.is_floating_point())
        return index + written, written
    if name in _SCATTERS:     # indices and values read; the indexed rows of self read (add) and written
        self_t = args[0]
        moved = list(_tensors(args[1:]))
        values = sum(_nbytes(t) for t in moved if t.is_floating_point() == self_t.is_floating_point()
                     and t.dtype == self_t.dtype)
        index = sum(_nbytes(t) for t in moved) - values
        if name.startswith(("index_put", "_index_put")):
            # the written elements: the values broadcast to the indexed shape
            idx = [t for t in args[1] if t is not None]
            rows = torch.broadcast_shapes(*[t.shape for t in idx]) if idx else ()
            tail = self_t.shape[len(idx):]
            values_out = math.prod(rows) * math.prod(tail) * self_t.element_size()
            acc = bool(args[3]) if len(args) > 3 else bool(kwargs.get("accumulate", False))
            return index + values + (values_out if acc else 0), values_out
        if "add" in name or "reduce" in name:
            return index + 2 * values, values
        return index + values, values
    read = 0
    skip = set()
    if name in _WRITE_ONLY and args and isinstance(args[0], torch.Tensor):
        skip.add(id(args[0]))
    for t in _tensors(args):
        if id(t) not in skip:
            read += _nbytes(t)
    for k, v in kwargs.items():
        if k != "out":
            read += sum(_nbytes(t) for t in _tensors(v))
    return read, written


class _Record:
    __slots__ = ("kind", "launches", "flops", "read", "written", "unique_read", "unique_written", "programs",
                 "dtype", "meta")

    def __init__(self, kind):
        self.kind = kind
        self.launches = self.flops = self.read = self.written = 0
        self.unique_read = self.unique_written = self.programs = 0
        self.dtype = None
        self.meta = None

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__slots__}


class CostCounter(TorchDispatchMode):
    """``with CostCounter() as c: ...``; then ``c.kernels()``: per kernel or aten op
    (``"aten:<op>"``, products per dtype ``"aten:mm[bf16]"``; ``"triton:<kernel>"``) its
    launches, FLOPs, bytes read and written and (Triton) distinct bytes and programs.

    Triton kernels are counted only when they run in Triton's interpreter; their launches'
    tile sizes are whatever the kernel modules choose (use it inside ``gpu_tiles``).
    """

    def __init__(self):
        super().__init__()
        self.records: dict[str, _Record] = {}
        self._last_mm = None
        self._patched = []
        self._launch = None

    # ----------------------------------------------------------------- torch
    def _record(self, key, kind) -> _Record:
        if key not in self.records:
            self.records[key] = _Record(kind)
        return self.records[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = str(func.overloadpacket.__name__)
        if func.is_view or func in _FREE or name == "set_":
            return out
        if name == "_to_copy" and self._last_mm is not None and args and args[0] is self._last_mm[0] \
                and kwargs.get("dtype") == torch.float32 and len(kwargs) <= 2:
            # A float32 copy of a bf16/fp16 product: on CUDA the product writes float32 itself.
            rec = self._last_mm[1]
            rec.written += args[0].numel() * 2
            rec.unique_written += args[0].numel() * 2
            self._last_mm = None
            return out
        read, written = _op_bytes(name, args, kwargs, out)
        if name in _GEMMS:
            i, _ = _GEMMS[name]
            dtype = str(args[i].dtype).replace("torch.", "")
            rec = self._record(f"aten:{name}[{_short(args[i].dtype)}]", "gemm")
            rec.flops += _gemm_flops(name, args)
            rec.dtype = dtype
            if isinstance(out, torch.Tensor) and out.dtype in (torch.bfloat16, torch.float16):
                self._last_mm = (out, rec)
        else:
            rec = self._record(f"aten:{name}", "elementwise")
        if name in _CUDA_PASSES and args and isinstance(args[0], torch.Tensor):
            reads, writes, launches = _CUDA_PASSES[name]
            read, written = reads * _nbytes(args[0]), writes * _nbytes(args[0]) + written
            rec.launches += launches - 1
        rec.launches += 1
        rec.read += read
        rec.written += written
        rec.unique_read += read
        rec.unique_written += written
        return out

    # ----------------------------------------------------------------- triton
    def __enter__(self):
        if "triton" in sys.modules:
            self._patch_triton()
        return super().__enter__()

    def __exit__(self, *exc):
        for owner, name, original in reversed(self._patched):
            setattr(owner, name, original)
        self._patched = []
        return super().__exit__(*exc)

    def _patch(self, owner, name, new):
        self._patched.append((owner, name, getattr(owner, name)))
        setattr(owner, name, new)

    def _patch_triton(self) -> None:
        from triton.runtime import interpreter as interp
        counter = self
        builder = interp.interpreter_builder
        original_run = interp.InterpretedFunction.run

        def run(fn, *args, grid, warmup, **kwargs):
            if warmup:
                return original_run(fn, *args, grid=grid, warmup=warmup, **kwargs)
            counter._launch = _Launch(fn, args, kwargs)
            try:
                with _disable_current_modes():
                    return original_run(fn, *args, grid=grid, warmup=warmup, **kwargs)
            finally:
                counter._finish_launch()

        load, store, dot, grid_dim = (builder.create_masked_load, builder.create_masked_store, builder.create_dot,
                                      builder.set_grid_dim)

        def create_masked_load(ptrs, mask, other, cache_policy, is_volatile):
            if counter._launch is not None:
                counter._launch.access(ptrs, mask, store=False)
            return load(ptrs, mask, other, cache_policy, is_volatile)

        def create_masked_store(ptrs, value, mask, cache_policy):
            if counter._launch is not None:
                counter._launch.access(ptrs, mask, store=True)
            return store(ptrs, value, mask, cache_policy)

        def create_dot(a, b, d, input_precision, max_num_imprecise_acc):
            if counter._launch is not None:
                m, k = a.data.shape[-2:]
                n = b.data.shape[-1]
                batch = math.prod(a.data.shape[:-2])
                counter._launch.flops += 2 * batch * m * n * k
            return dot(a, b, d, input_precision, max_num_imprecise_acc)

        def set_grid_dim(nx, ny, nz):
            if counter._launch is not None:
                counter._launch.programs = nx * ny * nz
            return grid_dim(nx, ny, nz)

        self._patch(interp.InterpretedFunction, "run", run)
        self._patch(builder, "create_masked_load", create_masked_load)
        self._patch(builder, "create_masked_store", create_masked_store)
        self._patch(builder, "create_dot", create_dot)
        self._patch(builder, "set_grid_dim", set_grid_dim)

    def _finish_launch(self):
        launch, self._launch = self._launch, None
        rec = self._record("triton:" + launch.name, "triton")
        rec.launches += 1
        rec.flops += launch.flops
        rec.read += launch.read
        rec.written += launch.written
        rec.unique_read += launch.unique(store=False)
        rec.unique_written += launch.unique(store=True)
        rec.programs += launch.programs
        rec.meta = launch.meta

    def kernels(self) -> dict:
        return {k: r.as_dict() for k, r in self.records.items()}


def _short(dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}.get(
        dtype, str(dtype).replace("torch.", ""))


_SIG_DTYPES = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float64: "*fp64",
               torch.int64: "*i64", torch.int32: "*i32", torch.int16: "*i16", torch.int8: "*i8",
               torch.uint8: "*u8", torch.bool: "*i1"}


class _Launch:
    """Counts of one interpreted launch, and what compiling it for a GPU needs (``meta``)."""

    def __init__(self, fn, args, kwargs):
        import numpy as np
        self.np = np
        self.name = fn.__name__
        self.flops = self.read = self.written = self.programs = 0
        self.ranges = []          # (base address, nbytes) of each tensor argument's storage
        names = list(fn.arg_names)
        params = inspect.signature(fn.fn).parameters
        bound = dict(zip(names, args))
        bound.update({k: v for k, v in kwargs.items() if k in params})
        signature, constexprs, divisible = {}, {}, []
        for name in names:
            p = params[name]
            value = bound.get(name, p.default)
            if "constexpr" in str(p.annotation):
                constexprs[name] = _constexpr_json(value)
                continue
            tensor = value.base if hasattr(value, "base") and hasattr(getattr(value, "base"), "data_ptr") else value
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                self.ranges.append((storage.data_ptr(), storage.nbytes()))
                signature[name] = _SIG_DTYPES[tensor.dtype]
                # Triton specialises a launch on 16-byte aligned pointers ("tt.divisibility"),
                # which decides vector widths and asynchronous copies: the machine code differs.
                if isinstance(value, torch.Tensor) and value.data_ptr() % 16 == 0:
                    divisible.append(name)
            elif isinstance(value, bool):
                signature[name] = "i1"
            elif isinstance(value, int) and value == 1:
                signature[name] = "constexpr"          # as Triton specialises an integer 1
                constexprs[name] = 1
            elif isinstance(value, int):
                signature[name] = "i32" if -2 ** 31 <= value < 2 ** 31 else "i64"
                if value % 16 == 0:
                    divisible.append(name)             # and integers that are multiples of 16
            elif isinstance(value, float):
                signature[name] = "fp32"
            else:
                signature[name] = "constexpr"
                constexprs[name] = _constexpr_json(value)
        self.ranges = sorted(set(self.ranges))
        self.bases = np.array([b for b, _ in self.ranges], dtype=np.uint64)
        self.maps = {False: {}, True: {}}
        self.meta = {"module": fn.fn.__module__, "kernel": self.name, "signature": signature,
                     "constexprs": constexprs, "divisible": divisible, "num_warps": int(kwargs.get("num_warps", 4)),
                     "num_stages": int(kwargs.get("num_stages", 3))}

    def access(self, ptrs, mask, store: bool):
        np = self.np
        addr = np.asarray(ptrs.data)
        live = np.broadcast_to(np.asarray(mask.data, dtype=bool), addr.shape) if mask is not None else None
        addr = addr[live] if live is not None else addr.reshape(-1)
        if addr.size == 0:
            return
        size = max(1, ptrs.get_element_ty().primitive_bitwidth // 8)
        if store:
            self.written += addr.size * size
        else:
            self.read += addr.size * size
        which = np.searchsorted(self.bases, addr, side="right").astype(np.int64) - 1
        maps = self.maps[store]
        for i in np.unique(which):
            if i < 0:
                continue
            base, nbytes = self.ranges[i]
            off = (addr[which == i] - np.uint64(base)).astype(np.int64)
            off = off[off < nbytes]
            if i not in maps:
                maps[i] = np.zeros(nbytes + 16, dtype=bool)
            maps[i][(off[:, None] + np.arange(size)[None, :]).reshape(-1)] = True

    def unique(self, store: bool) -> int:
        return int(sum(int(m.sum()) for m in self.maps[store].values()))


def _constexpr_json(value):
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    name = getattr(value, "name", None) or str(value)
    return {"tl": str(name)}       # a triton dtype such as tl.bfloat16


# --------------------------------------------------------------------- one counted step
def count_step(S: int, *, batch: int, dim: int, sample_rate: float, compute: str = "bf16",
               embeddings: str = "fp32", backend: str = "triton", block_rows: int | None = None,
               world: int = 1, sms: int = 132, arch: int = 90, seed: int = 0, grids_only: bool = False,
               keep: bool | str = False) -> dict:
    """Counts of one head step (forward, backward, fused row SGD) with ``S`` active rows.

    ``grids_only``: launch no Triton kernel, only record each launch's grid (in seconds:
    what follows a launch computes on uninitialised outputs); returns ``{name: [grids]}``.

    ``keep``: the triton backend keeps for backward (``keep_bytes`` unbounded) what
    :func:`ds_pfc.core.softmax.cosine_path` picks (True or ``"exp"``: the bf16 exponentials for
    bf16 products, else the cosines; ``"kept"``: the cosines, by a margin scale beyond the
    exp-kept bound -- the counts do not depend on the scale), else it recomputes them
    (``keep_bytes=0``); the torch backend ignores it.

    ``block_rows``: class rows per block of the torch backend (None: a 256 MiB block). Runs on
    CPU tensors; Triton kernels need ``TRITON_INTERPRET=1`` set before triton was imported.
    Returns ``{"kernels": {name: counts}, "S": S, "blocks": B}``.
    """
    from ..core.margins import ArcFace
    from ..core.head import PartialFC
    from ..kernels._target import gpu_tiles
    num_classes = max(S, math.ceil(S / sample_rate - 1e-9))
    while max(math.floor(sample_rate * num_classes + 1e-9), 1) < S:
        num_classes += 1
    compute_dtype = _DTYPES[compute]
    # A class block of ``rows`` classes: torch blocks hold float32 logits, triton blocks the
    # gradient G in the compute dtype (softmax.class_blocks says how many each walks).
    item = 4 if backend == "torch" else torch.empty((), dtype=compute_dtype).element_size()
    rows = block_rows or (256 << 20) // (item * batch)
    block_bytes = rows * batch * item
    margin = ArcFace(scale=_KEPT_COUNT_SCALE) if keep == "kept" else ArcFace()
    head = PartialFC(num_classes, dim, sample_rate=sample_rate, margin=margin, device="cpu",
                     compute_dtype=None if compute_dtype == torch.float32 else compute_dtype, optimizer="sgd",
                     momentum=0.9, weight_decay=5e-4, data_parallel_grad=False, block_bytes=block_bytes,
                     backend=backend, seed=seed, fused=True,
                     keep_bytes=(1 << 62 if keep else 0) if backend == "triton" else None)
    if backend == "triton" or os.environ.get("TRITON_INTERPRET") == "1":
        # Imported before counting starts, so that the counter instruments its interpreter.
        from ..kernels import triton_optim  # noqa: F401
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(batch, dim, generator=gen).to(_DTYPES[embeddings]).requires_grad_()
    # One rank owns about N / k of the gathered labels; few distinct ones keep |P| << S.
    positives = max(1, min(batch // max(1, world), S // 4))
    y = torch.randint(0, positives, (batch,), generator=gen) * (num_classes // positives)
    if grids_only:
        with gpu_tiles(sms=sms, arch=arch), _GridRecorder() as grids:
            head(x, y).backward()
            head.step(0.1)
        head.close()
        return grids.grids
    with gpu_tiles(sms=sms, arch=arch), CostCounter() as counter:
        loss = head(x, y)
        loss.backward()
        head.step(0.1)
    head.close()
    from ..core.softmax import class_blocks
    return {"kernels": counter.kernels(), "S": S, "blocks": class_blocks(backend, batch, S, compute_dtype, block_bytes),
            "block_rows": rows}


# Kernels whose outputs steer the step's control flow or indices (the sampler's keys pick the
# active set): the grid recorder still runs them. They are cheap.
_RUN_WHEN_RECORDING = {"_keys_kernel"}


class _GridRecorder:
    """Within it, interpreted Triton launches only record their grid (padded to 3-D)."""

    def __enter__(self):
        from triton.runtime import interpreter as interp
        self.grids, self._owner, self._run = {}, interp.InterpretedFunction, interp.InterpretedFunction.run
        recorder = self

        def run(fn, *args, grid, warmup, **kwargs):
            if not warmup:
                if fn.__name__ in _RUN_WHEN_RECORDING:      # its output decides indices: compute it
                    recorder._run(fn, *args, grid=grid, warmup=warmup, **kwargs)
                if callable(grid):
                    grid = grid(dict(zip(fn.arg_names, args), **kwargs))
                grid = tuple(int(g) for g in grid) + (1,) * (3 - len(grid))
                recorder.grids.setdefault(fn.__name__, []).append(grid)

        self._owner.run = run
        return self

    def __exit__(self, *exc):
        self._owner.run = self._run
        return False


def _grids_agree(small: dict, large: dict, ratio: float, probe: dict | None = None, probe_ratio: float = 1.0) -> bool:
    """Whether each dimension of every launch's grid is the same at both S (and at the probe's
    S), or grows with S: ``ratio`` (``probe_ratio``) times larger, up to rounding."""
    if small.keys() != large.keys() or (probe is not None and probe.keys() != small.keys()):
        return False
    for name in small:
        others = [large[name]] + ([probe[name]] if probe is not None else [])
        if any(len(o) != len(small[name]) for o in others):
            return False
        for i, g in enumerate(small[name]):
            h = large[name][i]
            p = probe[name][i] if probe is not None else None
            for d, (a, b) in enumerate(zip(g, h)):
                same = b == a and (p is None or p[d] == a)
                grows = b == ratio * a and (p is None or abs(p[d] - probe_ratio * a) <= probe_ratio)
                if not (same or grows):
                    return False
    return True


def fit_counts(runs: list[dict], S: int, blocks: int) -> dict:
    """Each kernel's counts at ``S`` rows and ``blocks`` class blocks, fitted as
    ``a + b S + c B``. Four runs (what :func:`predict_case` counts): the first two share one
    S and differ in B (they give ``c``, and may lie below the S where the kernels' grids stop
    growing), the last two give ``a`` and ``b``. Three runs: solved exactly; two: ``c = 0``.
    Negative extrapolations become 0."""
    keys = sorted({k for r in runs for k in r["kernels"]})
    if len(runs) == 4:
        (s0, b0), (s1, b1), (s2, b2), (s3, b3) = [(r["S"], r["blocks"]) for r in runs]
        if s0 != s1 or b0 == b1 or s2 == s3:
            raise ValueError("runs: expected two steps at one S with different blocks, then two at different S")

        def value(v):
            c = (v[1] - v[0]) / (b1 - b0)
            u2, u3 = v[2] - c * b2, v[3] - c * b3
            b = (u3 - u2) / (s3 - s2)
            return (u2 - b * s2) + b * S + c * blocks

        weights = torch.tensor([value([float(i == j) for j in range(4)]) for i in range(4)], dtype=torch.float64)
    else:
        if len(runs) == 3:
            basis = [[1.0, r["S"], r["blocks"]] for r in runs]
            target = [1.0, S, blocks]
        elif len(runs) == 2:
            basis = [[1.0, r["S"]] for r in runs]
            target = [1.0, S]
        else:
            raise ValueError(f"runs: expected 2, 3 or 4 counted steps, got {len(runs)}")
        A = torch.tensor(basis, dtype=torch.float64)
        if abs(float(torch.linalg.det(A))) < 1e-9:
            raise ValueError("runs: the counted steps' (S, blocks) do not determine the fit")
        weights = torch.linalg.solve(A.T, torch.tensor(target, dtype=torch.float64))   # value = w . counts
    out = {}
    for key in keys:
        recs = [r["kernels"].get(key) for r in runs]
        base = next(r for r in recs if r is not None)
        fitted = dict(kind=base["kind"], dtype=base["dtype"], meta=base["meta"])
        for q in ("launches", "flops", "read", "written", "unique_read", "unique_written", "programs"):
            vals = torch.tensor([float(r[q]) if r else 0.0 for r in recs], dtype=torch.float64)
            fitted[q] = max(0.0, float(weights @ vals))
        out[key] = fitted
    return out


# --------------------------------------------------------------------- machine code
def _cache_dir() -> str:
    return os.environ.get("DS_PFC_MODEL_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "ds_pfc", "model")


_COMPILE = r"""
import json, os, re, subprocess, sys, tempfile, importlib
os.environ.pop("TRITON_INTERPRET", None)
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from ds_pfc.kernels._target import GPU_ONLY_CONSTEXPRS
job = json.loads(sys.argv[1])
kernel = getattr(importlib.import_module(job["module"]), job["kernel"])
consts = {}
for k, v in job["constexprs"].items():
    v = GPU_ONLY_CONSTEXPRS.get(k, v)
    consts[k] = tl.dtype(v["tl"]) if isinstance(v, dict) else v
signature = {k: ("constexpr" if k in consts else v) for k, v in job["signature"].items()}
for k in consts:
    signature[k] = "constexpr"
signature = {name: signature[name] for name in kernel.arg_names}
attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in job.get("divisible", [])
         if signature.get(name) != "constexpr"}
compiled = triton.compile(ASTSource(kernel, signature, consts, attrs), target=GPUTarget("cuda", job["arch"], 32),
                          options={"num_warps": job["num_warps"], "num_stages": job["num_stages"]})
cuobjdump = triton.knobs.nvidia.cuobjdump.path
with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "k.cubin")
    with open(path, "wb") as f:
        f.write(compiled.asm["cubin"])
    usage = subprocess.run([cuobjdump, "--dump-resource-usage", path], capture_output=True, text=True,
                           check=True).stdout
    sass = subprocess.run([cuobjdump, "-sass", path], capture_output=True, text=True, check=True).stdout
field = lambda key: int(re.search(key + r":(\d+)", usage).group(1))
count = lambda op: len(re.findall(r"\b" + op + r"\b", sass))
print(json.dumps(dict(regs=field("REG"), shared=compiled.metadata.shared,
                      spills=(field("STACK") + field("LOCAL")) // 4, hgmma=count("HGMMA\.[\w.]*|HGMMA"),
                      hmma=count("HMMA\.[\w.]*|HMMA"), ffma=count("FFMA"), num_warps=job["num_warps"])))
"""


def machine_code(meta: dict, arch: int) -> dict:
    """Registers, shared memory, spills and MMA instructions of a Triton launch compiled for
    ``sm_<arch>`` (offline: Triton's compiler and bundled cuobjdump, no GPU needed); cached
    on disk by kernel module source, constexprs and launch options. ``{"error": ...}`` when
    it cannot be compiled here."""
    module = sys.modules.get(meta["module"])
    source = inspect.getsource(module) if module is not None else meta["module"]
    job = dict(meta, arch=arch)
    key = hashlib.sha256((source + json.dumps(job, sort_keys=True)).encode()).hexdigest()[:24]
    path = os.path.join(_cache_dir(), f"{meta['kernel']}-sm{arch}-{key}.json")
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-c", _COMPILE, json.dumps(job)], capture_output=True, text=True,
                          env=env, cwd=root, timeout=900)
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["compile failed"])[-1][:200]}
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(info, f)
    os.replace(path + ".tmp", path)
    return info


def occupancy(info: dict, gpu: dict) -> int:
    """Resident CTAs per SM: the least of what registers, shared memory and warps allow."""
    threads = 32 * info["num_warps"]
    regs = math.ceil(max(info["regs"], 1) * threads / 256) * 256     # allocated per warp in 256s
    by_regs = gpu["regs_per_sm"] // regs
    by_smem = gpu["smem_per_sm"] // (info["shared"] + 1024) if info["shared"] else gpu["ctas_per_sm"]
    by_warps = gpu["warps_per_sm"] // info["num_warps"]
    if info["shared"] > gpu["smem_per_block"]:
        return 0
    return int(min(by_regs, by_smem, by_warps, gpu["ctas_per_sm"]))


# --------------------------------------------------------------------- the time rule
def kernel_time(counts: dict, gpu: dict, code: dict | None = None) -> dict:
    """Predicted seconds of one kernel (all its launches in a step) and what bounds it.

    ``counts``: launches, flops, read, written, unique_read, unique_written, programs, kind,
    dtype. ``code``: the Triton kernel's machine code (:func:`machine_code`), None for torch.
    """
    launches = counts["launches"]
    moved = counts["read"] + counts["written"]
    unique = counts["unique_read"] + counts["unique_written"]
    if counts["kind"] == "triton":
        code = code or {}
        if code.get("hgmma"):
            rate, mma = gpu["gemm"], "wgmma"
        elif code.get("hmma"):
            rate, mma = (gpu["gemm"] / 2 if gpu["arch"] >= 90 else gpu["gemm"]), "mma.sync"
        elif code and "error" not in code:
            rate, mma = gpu["fma"], "ffma"
        else:   # not compiled: assume the best case
            rate, mma = gpu["gemm"], "unknown"
        if not counts["flops"]:
            mma = ""
        bounds = {"matrix": counts["flops"] / rate, "L2": moved / gpu["l2"], "HBM": unique / gpu["hbm"]}
        per_launch = counts["programs"] / max(launches, 1)
        fill = min(1.0, per_launch / gpu["sms"]) if per_launch else 1.0
    else:
        if counts["kind"] == "gemm":
            rate = gpu["sgemm"] if counts["dtype"] in ("float32", "float64") else gpu["gemm"]
            mma = "cuBLAS"
        else:
            rate, mma = None, ""
        bounds = {"matrix": counts["flops"] / rate if rate else 0.0, "HBM": moved / gpu["hbm"]}
        fill = 1.0
    bound = max(bounds, key=bounds.get)
    body = bounds[bound] / fill if fill > 0 else float("inf")
    seconds = body + launches * gpu["launch_s"]
    if launches * gpu["launch_s"] > body:
        bound = "launch"
    return {"seconds": seconds, "bound": bound, "mma": mma, "fill": fill, "bounds": bounds}


def floor_time(S: int, batch: int, dim: int, gpu: dict) -> float:
    """``6 N S d`` FLOPs at the GEMM rate plus SGD-with-momentum's 20 B per element at HBM rate
    (``gpu["gemm"]``, ``gpu["hbm"]``: a :data:`GPUS` entry's assumed rates, or measured ones)."""
    return 6 * batch * S * dim / gpu["gemm"] + 20 * S * dim / gpu["hbm"]


def predict(fitted: dict, gpu: dict, *, S: int, batch: int, dim: int, compile_code: bool = True) -> dict:
    """Per-kernel prediction and the step's total and x floor for fitted counts."""
    rows = []
    for key, c in fitted.items():
        code = None
        if c["kind"] == "triton" and c.get("meta") and compile_code:
            code = machine_code(c["meta"], gpu["arch"])
        t = kernel_time(c, gpu, code)
        moved = c["read"] + c["written"]
        rows.append(dict(kernel=key, launches=c["launches"], flops=c["flops"], bytes=moved,
                         unique_bytes=c["unique_read"] + c["unique_written"],
                         intensity=c["flops"] / moved if moved else 0.0, programs=c["programs"],
                         occupancy=(occupancy(code, gpu) if code and "error" not in code else None),
                         regs=(code or {}).get("regs"), spills=(code or {}).get("spills"),
                         compile_error=(code or {}).get("error"), **t))
    rows.sort(key=lambda r: -r["seconds"])
    step = sum(r["seconds"] for r in rows)
    floor = floor_time(S, batch, dim, gpu)
    return {"kernels": rows, "step_s": step, "floor_s": floor, "x_floor": step / floor}


def _standard_runs(case: dict) -> list[tuple[int, int | None]]:
    """``(S, block_rows)`` of the four counted steps (see :func:`fit_counts`): two class-block
    sizes at S = 64 (always >= 2 blocks, so that backward recomputes the logits as it does at
    the target), then ``S2`` and ``2 S2``, the smallest ``S2 >= 320`` (a multiple of 32) at
    which every Triton launch's grid has each dimension either the same at S2, 2 S2 and a
    probe at min(target S, 64k), or growing in proportion to S. Below that, a grid still
    growing towards its cap (the class splits of a streaming kernel, a few waves of
    programs) would have its per-split work taken for work per class. Grids are found by
    launching the step with the Triton kernels skipped (:class:`_GridRecorder`)."""
    grids = {}
    target = case.get("S") or 1 << 16

    def at(S, rate=case["sample_rate"]):
        if S not in grids:
            grids[S] = count_step(S, batch=case["batch"], dim=case["dim"], sample_rate=rate,
                                  compute=case["compute"], embeddings=case["embeddings"], backend=case["backend"],
                                  block_rows=S // 2, world=case["world"], sms=case.get("sms", 132), grids_only=True,
                                  arch=case.get("arch", 90),
                                  keep=case_keeps(case))
        return grids[S]

    # The probe: the grids at (up to) 64k rows, with every class active (a small table).
    probe_rows = min(target, 1 << 16)
    probe = at(probe_rows, 1.0)
    S2 = 320
    while S2 < 4096 and not _grids_agree(at(S2), at(2 * S2), 2, probe, probe_rows / S2):
        S2 += 32
    if S2 >= 4096:
        print(f"warning: the Triton grids did not settle below S = 4096 (the probe at S = {probe_rows}); "
              "per-split work may be extrapolated as per-class work", file=sys.stderr)
    if case["backend"] == "triton":
        # Triton blocks are whole class tiles of the dW/G kernels: two block sizes at 2 tiles,
        # then S2 rounded up to whole tiles with one tile per block.
        from ..kernels.triton_softmax import tile_config
        tile = max(tile_config(k, _DTYPES[case["compute"]], interpret=False)[0] for k in ("g", "dw"))
        S2 = -(-S2 // tile) * tile
        return [(2 * tile, tile), (2 * tile, 2 * tile), (S2, tile), (2 * S2, tile)]
    return [(64, 32), (64, 16), (S2, S2 // 2), (2 * S2, S2 // 2)]


def with_cosines_path(case):
    """``case`` with its triton ``cosines`` path spelled out: cases that name none were
    counted (or measured) before the kept-cosine path existed, and recompute."""
    if isinstance(case, dict) and case.get("backend") == "triton" and "cosines" not in case:
        return dict(case, cosines="recompute")
    return case


# A scale beyond the exp-kept bound at every counted S, so that a count of a "kept" case takes
# the kept-cosine path whatever its compute dtype (ds_pfc.core.softmax.cosine_path).
_KEPT_COUNT_SCALE = 200.0


def case_keeps(case: dict) -> bool | str:
    """What the case's triton step keeps for backward, as :func:`count_step`'s ``keep``:
    ``"exp"`` (bf16 exponentials), ``"kept"`` (cosines) or False (recompute;
    :func:`with_cosines_path`)."""
    if case.get("backend") != "triton":
        return False
    path = with_cosines_path(case)["cosines"]
    return path if path in ("exp", "kept") else False


#: What a prediction assumes the rest of a rank holds in GPU memory at the head's first step,
#: besides the head's bank: the backbone, its optimizer state and activations and the step's
#: other tensors. With it, :func:`default_keep_budget` is the head's default keep budget.
OTHER_RESIDENT_BYTES = 16 << 30


def default_keep_budget(case: dict, gpu_name: str) -> int:
    """The keep budget the head's default gives a rank of ``case`` on ``gpu_name``:
    :data:`ds_pfc.core.softmax.COSINE_KEEP_SHARE` of the memory free at its first step, taken as
    the GPU's memory less the rank's bank (float32 centers and SGD momentum: ``8 ceil(C / k) d``
    bytes) and :data:`OTHER_RESIDENT_BYTES`. The budget is what the head reads from the device
    (:func:`ds_pfc.core.softmax.cosine_keep_bytes`); this is its estimate before any GPU runs."""
    from ..core.softmax import COSINE_KEEP_SHARE
    bank = 8 * math.ceil(case["classes"] / case["world"]) * case["dim"]
    free = GPUS[gpu_name]["memory_bytes"] - bank - OTHER_RESIDENT_BYTES
    return max(0, int(COSINE_KEEP_SHARE * free))


def cosines_path(backend: str, batch: int, S: int, compute: str, keep_bytes: int | None,
                 scale: float = 64.0) -> str | None:
    """``"exp"``, ``"kept"`` or ``"recompute"``: what a triton step of ``batch`` samples and
    ``S`` active rows does under ``keep_bytes`` (None: the budget off CUDA,
    :data:`ds_pfc.core.softmax.COSINE_KEEP_BYTES`; a prediction passes
    :func:`default_keep_budget`) at the margin's ``scale``
    (:func:`ds_pfc.core.softmax.cosine_path`); None for the torch backend."""
    from ..core.softmax import COSINE_KEEP_BYTES, cosine_path
    if backend != "triton":
        return None
    budget = COSINE_KEEP_BYTES if keep_bytes is None else keep_bytes
    return cosine_path(batch, S, _DTYPES[compute], budget, scale)


def case_rows(case: dict) -> int:
    """S: the active rows of one rank of ``case`` (``floor(r * ceil(C / k))``, at least 1)."""
    return max(math.floor(case["sample_rate"] * math.ceil(case["classes"] / case["world"]) + 1e-9), 1)


def fit_case(case: dict, counts: list[dict]) -> dict:
    """Each kernel's counts at the case's S and class blocks, fitted from its counted ``counts``."""
    from ..core.softmax import class_blocks
    S = case_rows(case)
    block_bytes = case.get("block_bytes") or (256 << 20)
    return fit_counts(counts, S, class_blocks(case["backend"], case["batch"], S, _DTYPES[case["compute"]],
                                              block_bytes))


def predict_case(case: dict, gpu_name: str, *, counts: list[dict] | None = None, compile_code: bool = True) -> dict:
    """Count (or take ``counts``), fit and predict one case on ``gpu_name`` (a key of GPUS)."""
    gpu = GPUS[gpu_name]
    S = case_rows(case)
    if counts is None:
        counts = [count_step(s, batch=case["batch"], dim=case["dim"], sample_rate=case["sample_rate"],
                             compute=case["compute"], embeddings=case["embeddings"], backend=case["backend"],
                             block_rows=b, world=case["world"], sms=gpu["sms"], arch=gpu["arch"],
                             keep=case_keeps(case))
                  for s, b in _standard_runs(dict(case, sms=gpu["sms"], arch=gpu["arch"], S=S))]
    fitted = fit_case(case, counts)
    out = predict(fitted, gpu, S=S, batch=case["batch"], dim=case["dim"], compile_code=compile_code)
    out.update(case=dict(case), gpu=gpu_name, gpu_name=gpu["name"], S=S, counts=counts)
    return out


def _count_in_subprocess(case: dict, sms: int, arch: int = 90) -> list[dict]:
    """The counted steps in a child process with ``TRITON_INTERPRET=1`` (it must be set before
    triton is imported, which this process may already have done)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "ds_pfc.bench.model", "--count", json.dumps(dict(case, sms=sms, arch=arch))],
                          capture_output=True, text=True, env=env, cwd=root)
    if proc.returncode != 0:
        raise RuntimeError("counting step failed: " + " | ".join(proc.stderr.strip().splitlines()[-4:]))
    return json.loads(proc.stdout.strip().splitlines()[-1])


def format_prediction(pred: dict) -> str:
    from . import format_table
    rows = []
    for r in pred["kernels"]:
        rows.append([r["kernel"], f"{r['launches']:.0f}", f"{r['flops'] / 1e9:,.0f}", f"{r['bytes'] / 1e9:,.1f}",
                     f"{r['unique_bytes'] / 1e9:,.1f}", f"{r['intensity']:.1f}", r["mma"] or "-",
                     "-" if r["occupancy"] is None else r["occupancy"], r["bound"], f"{r['seconds'] * 1e3:.2f}"])
    c = pred["case"]
    head = (f"{pred['gpu_name']}: C={c['classes']:,} k={c['world']} r={c['sample_rate']} S={pred['S']:,} "
            f"N={c['batch']} d={c['dim']} compute={c['compute']} embeddings={c['embeddings']} "
            f"backend={c['backend']}")
    table = format_table(["kernel", "launches", "GFLOP", "GB L2", "GB HBM", "FLOP/B", "mma", "CTA/SM", "bound",
                          "ms"], rows)
    tail = (f"predicted step {pred['step_s'] * 1e3:.1f} ms; floor {pred['floor_s'] * 1e3:.1f} ms; "
            f"x floor {pred['x_floor']:.2f}")
    return "\n".join([head, table, tail])




# --------------------------------------------------------------------- measured vs predicted
def compare(measured: dict, predicted: dict, factor: float = 2.0, min_seconds: float = 0.0) -> list[dict]:
    """Rows ``{kernel, measured_s, predicted_s, ratio, ok}`` for every kernel in either dict
    (seconds per step); ``ok`` is False where they differ by more than ``factor`` either way.
    Kernels under ``min_seconds`` on both sides are reported but never fail."""
    if factor <= 1:
        raise ValueError(f"factor must be > 1, got {factor}")
    rows = []
    for key in sorted(set(measured) | set(predicted)):
        m, p = measured.get(key), predicted.get(key)
        if m is None or p is None:
            rows.append(dict(kernel=key, measured_s=m, predicted_s=p, ratio=None,
                             ok=max(m or 0.0, p or 0.0) < min_seconds))
            continue
        ratio = m / p if p > 0 else float("inf")
        small = max(m, p) < min_seconds
        rows.append(dict(kernel=key, measured_s=m, predicted_s=p, ratio=ratio,
                         ok=small or (1 / factor <= ratio <= factor)))
    return rows


def _count_main(spec: str) -> int:
    case = json.loads(spec)
    case["S"] = max(math.floor(case["sample_rate"] * math.ceil(case["classes"] / case["world"]) + 1e-9), 1)
    out = [count_step(s, batch=case["batch"], dim=case["dim"], sample_rate=case["sample_rate"],
                      compute=case["compute"], embeddings=case["embeddings"], backend=case["backend"], block_rows=b,
                      world=case["world"], sms=case["sms"], arch=case.get("arch", 90), keep=case_keeps(case))
           for s, b in _standard_runs(case)]
    print(json.dumps(out))
    return 0



# The aten ops the comparison groups count as "torch GEMMs" (the rest: "torch other ops").
_GEMM_OPS = {"mm", "addmm", "addmm_", "bmm", "baddbmm", "baddbmm_", "mv", "addmv", "addmv_", "dot", "vdot",
             "matmul", "linear", "_scaled_mm"}


def gpu_model_key(name: str) -> str | None:
    """The :data:`ds_pfc.bench.model.GPUS` key of a CUDA device name (None: not modelled)."""
    name = name.upper()
    for key in ("H200", "H100", "A100"):
        if key in name:
            return key.lower()
    return None


def saved_counts(path: str | None, case: dict, sms: int) -> list[dict] | None:
    """The op counts of ``case`` from a ``ds-pfc-bench head --predict`` JSON, if it holds
    that exact case counted for ``sms`` multiprocessors (counts do not depend on the GPU
    that runs the step, only on the case and the tile plan)."""
    if not path:
        return None
    with open(path) as f:
        doc = json.load(f)
    if doc.get("gpu_constants", {}).get("sms") != sms:
        return None
    for result in doc.get("results", []):
        if with_cosines_path(result.get("case")) == with_cosines_path(case) and result.get("counts"):
            return result["counts"]
    return None


def group_predicted(prediction: dict) -> dict:
    """The same groups from :func:`ds_pfc.bench.model.predict_case`'s kernels."""
    out = {}
    for row in prediction["kernels"]:
        name = row["kernel"]
        if name.startswith("triton:"):
            key = name
        else:
            op = name.split(":", 1)[1].split("[")[0]
            key = "torch GEMMs" if op in _GEMM_OPS else "torch other ops"
        out[key] = out.get(key, 0.0) + row["seconds"]
    return out


if __name__ == "__main__":      # the counting subprocess of _count_in_subprocess
    if len(sys.argv) != 3 or sys.argv[1] != "--count":
        sys.exit("usage: python -m ds_pfc.bench.model --count CASE_JSON (internal; predictions: "
                 "ds-pfc-bench head --predict)")
    sys.exit(_count_main(sys.argv[2]))
