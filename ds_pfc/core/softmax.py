"""Distributed margin-softmax cross-entropy over class-sharded active centers.

Each rank holds the gathered batch ``x [N, d]`` and its active centers ``w [S, d]``.
The softmax is normalised exactly over the union of all ranks' active sets
(paper: "Model Parallelism", Eq. sampled_probability).

Budget: forward 2 all-reduces of ``N x 2..3`` floats (max; sum-exp + target + owner
count [+ hit]); backward none.

The math is a few stateless steps shared by both backends:

- **Targets, once.** Each owned sample's target cosine is a row-wise dot of ``x_hat[n]``
  and its center (float32 or wider), its margin logit ``scale * phi(cos_t)`` is formed
  on ``N`` values, and the target column is *excluded* from the class blocks. The
  target term joins the log-sum-exp after the blocks, and its gradient is one indexed
  fix-up in backward. Nothing inside the block loop depends on the margin, so any
  margin (and later per-sample margins) goes through the same blocks and kernels.
- **Blocks of classes** (``block_bytes`` of float32 logits each): cosine GEMM,
  exclusion of the target and (PFC*) of filtered negatives, scale, and a per-sample
  log-sum-exp merged across blocks. No boolean-mask indexing and no host
  synchronisation inside the loop: the target is excluded by one indexed write into a
  spare row of the block.
- **Memory.** When the whole ``S x N`` logits fit in the keep budget they are kept
  for backward; otherwise backward recomputes each block from ``x`` and ``w`` (one more
  GEMM) and nothing of size ``N x S`` survives the forward. The keep budget is
  ``block_bytes`` when given; by default 256 MiB on every device (on CUDA that is one
  block; on CPU the kept logits are walked in cache-sized blocks). Peak extra memory
  is then about two blocks (recomputing) or the kept logits plus one block, plus
  ``O((N + S) d)``. On one rank (every class local, so a sample's softmax row is
  complete on it), when the keep budget spans several class blocks (the CPU
  default), the torch backend does not recompute: it walks the samples in chunks
  whose logits over all classes fit the keep budget, and forms each chunk's gradient
  in forward (three GEMMs a step instead of four; the gradient of ``w`` and the
  normalised centers, ``S x d`` each, are then held during the forward).

Backends: ``"torch"`` (the blocks above, the readable reference; runs anywhere) and
``"triton"`` (:mod:`ds_pfc.kernels.triton_softmax`). The triton backend has three paths, chosen
per training step by :func:`cosine_path` from the keep budget (``keep_bytes``; by default half
the device memory free at the forward on CUDA, :data:`COSINE_KEEP_BYTES` elsewhere; a step that
recomputes says why in one log line, :func:`say_why_recompute`), the compute dtype and the scale:

- **exp-kept** (bf16 products, ``N S`` bf16 values fit the budget, ``scale`` within
  ``kernels.exp_scale_bound(S)``, about 145 at S = 800k): the forward statistics kernel also
  stores every ``E = exp(scale cos - scale / 2)`` in bf16 (fixed shift, no running max); the
  backward is two cuBLAS products over E with the per-sample factors folded into an operand
  and a row scale, and a projection pass. No G pass. ``6 N S d`` matrix FLOPs per step.
- **kept cosines** (otherwise within the budget: fp16 products on GPUs without bf16, float32
  products, a larger scale; float16 cosines for bf16/fp16 products, 3.3 GB at N = 2048,
  S = 800k): the forward statistics kernel also stores every cosine; the backward forms ``G``
  over them in place in one streaming pass, then two cuBLAS products (``dX``, ``dW``) and a
  projection pass. ``6 N S d`` matrix FLOPs per step, two of the three products on cuBLAS.
- **recompute** (otherwise): nothing of size ``N x S`` is written in forward; the backward
  recomputes the cosines block by block (``block_bytes`` of ``G`` in the compute dtype) for a
  cuBLAS ``dX`` product and a dW kernel with the normalisation in its epilogue. ``8 N S d``. ``"auto"`` picks triton on CUDA for bf16/fp16
products (any embedding width, center dtype or layout) and torch for float32 products (cuBLAS
SGEMM outruns an FMA kernel) and everywhere else.

Compute dtype: ``compute_dtype=None`` means bf16 on CUDA (tensor cores; float32 accumulation, a
float32 softmax and float32 centers and gradients; about 12x the float32 GEMM rate on an H100;
fp16 on GPUs of compute capability 7.x, which have tensor cores without bf16, and float32 below)
and the accumulation dtype (float32, or float64 for float64 inputs) elsewhere (CPU bf16 GEMMs are
slow, and CPU runs serve tests and exactness checks). Pass ``torch.float32`` for IEEE float32
products on a GPU.
"""
from __future__ import annotations

import functools
import logging
import os
from typing import NamedTuple

import torch

from .collectives import all_reduce_, world_size
from .margins import Margin

__all__ = ["margin_softmax_cross_entropy", "SoftmaxResult", "default_block_bytes", "check_block_bytes",
           "resolve_backend", "default_compute_dtype", "class_blocks", "CPU_BLOCK_BYTES", "CUDA_BLOCK_BYTES", "KEEP_BYTES",
           "COSINE_KEEP_BYTES", "default_keep_bytes", "check_keep_bytes", "keeps_cosines", "cosine_path",
           "COSINE_PATHS", "BACKENDS", "COSINE_KEEP_SHARE", "cosine_keep_bytes", "say_why_recompute"]

_log = logging.getLogger(__name__)

_NORM_EPS = 1e-12
CPU_BLOCK_BYTES = 1 << 21     # ~2 MiB of logits: a block stays in a CPU core's cache
CUDA_BLOCK_BYTES = 1 << 28    # 256 MiB: a few large GEMMs per step instead of thousands of small ones
BACKENDS = ("auto", "torch", "triton")


class SoftmaxResult(NamedTuple):
    loss: torch.Tensor          # scalar, mean over the gathered batch
    per_sample: torch.Tensor    # [N] loss of every gathered sample
    correct: torch.Tensor       # [N] 1.0 where the target has the largest raw cosine


def default_block_bytes(device) -> int:
    """Logit bytes per class block when ``block_bytes=None``: 256 MiB on CUDA (a whole
    active set of up to 64M logits is one block), 2 MiB elsewhere (cache-sized)."""
    return CUDA_BLOCK_BYTES if torch.device(device).type == "cuda" else CPU_BLOCK_BYTES


KEEP_BYTES = CUDA_BLOCK_BYTES   # logits kept for backward by default, on every device (torch backend)
# Cosines the triton backend keeps for backward by default (float16 for bf16/fp16 products), off
# CUDA: the standard rank (N = 2048, S = 800k) keeps 3.3 GB, and its backward then runs no
# recompute product. On CUDA the default is COSINE_KEEP_SHARE of the device memory available
# when the forward runs (:func:`cosine_keep_bytes`): the cosines live from the head's forward to
# its backward, which also holds dW (S d float32) and what the backbone's backward needs; half
# leaves the other half for those. N = 4096 at S = 800k (6.6 GB) then keeps on an 80-141 GB GPU.
COSINE_KEEP_BYTES = 4 << 30
COSINE_KEEP_SHARE = 0.5
_log = logging.getLogger(__name__)
_keep_budgets: dict = {}


def cosine_keep_bytes(device) -> int:
    """The triton backend's default keep budget on ``device``: :data:`COSINE_KEEP_SHARE` of its
    free memory (``torch.cuda.mem_get_info``) plus what torch's caching allocator holds unused;
    :data:`COSINE_KEEP_BYTES` off CUDA. While a CUDA graph is being captured, the budget last
    computed for the device (a graph replays the path it captured)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return COSINE_KEEP_BYTES
    index = device.index if device.index is not None else torch.cuda.current_device()
    if torch.cuda.is_current_stream_capturing():
        return _keep_budgets.get(index, COSINE_KEEP_BYTES)
    free, _ = torch.cuda.mem_get_info(index)
    cached = max(0, torch.cuda.memory_reserved(index) - torch.cuda.memory_allocated(index))
    _keep_budgets[index] = budget = int(COSINE_KEEP_SHARE * (free + cached))
    return budget


def default_keep_bytes(backend: str, block_bytes: int | None, device=None) -> int:
    """The keep budget for ``keep_bytes=None``: ``block_bytes`` when given, else for the triton
    backend :func:`cosine_keep_bytes` of ``device`` (None: :data:`COSINE_KEEP_BYTES`) and
    :data:`KEEP_BYTES` for torch."""
    if block_bytes is not None:
        return block_bytes
    if backend != "triton":
        return KEEP_BYTES
    return COSINE_KEEP_BYTES if device is None else cosine_keep_bytes(device)


_said_recompute: set = set()


def say_why_recompute(n: int, s: int, compute_dtype: torch.dtype, keep_bytes: int) -> str | None:
    """Log, once per shape and budget, why a triton training step of ``n`` samples and ``s``
    active rows recomputes its cosines instead of keeping them (None when it keeps them)."""
    if keeps_cosines(n, s, compute_dtype, keep_bytes):
        return None
    item = 4 if compute_dtype == torch.float32 else 2
    line = (f"triton backend recomputes its cosines in backward: N x S = {n} x {s} cosines take "
            f"{n * s * item / 1e9:.2f} GB, over keep_bytes = {keep_bytes / 1e9:.2f} GB"
            + (" (keep_bytes=0)" if keep_bytes == 0 else " (set keep_bytes, or free device memory, to keep them: "
               "the backward then runs no recompute product)"))
    if (n, s, keep_bytes) not in _said_recompute:
        _said_recompute.add((n, s, keep_bytes))
        (_log.info if keep_bytes == 0 else _log.warning)(line)
    return line


def check_block_bytes(value, name: str = "block_bytes") -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be None (the device's default) or a positive int of bytes, got {value!r}")


def check_keep_bytes(value, name: str = "keep_bytes") -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be None (the default budget) or a non-negative int of bytes (0: never keep), "
                         f"got {value!r}")


def default_compute_dtype(device, acc_dtype) -> torch.dtype:
    """The product dtype for ``compute_dtype=None``: on CUDA when accumulating in float32, the
    tensor cores' 2-byte type: bf16 from compute capability 8.0 (Ampere) on, fp16 on 7.x
    (Volta, Turing: tensor cores without bf16), float32 below 7.0 (no tensor cores); else the
    accumulation dtype itself (see the module docstring for why)."""
    device = torch.device(device)
    if device.type == "cuda" and acc_dtype == torch.float32:
        return _cuda_products(device.index if device.index is not None else torch.cuda.current_device())
    return acc_dtype


@functools.lru_cache(maxsize=None)
def _cuda_products(index: int) -> torch.dtype:
    major = torch.cuda.get_device_capability(index)[0]
    return torch.bfloat16 if major >= 8 else torch.float16 if major >= 7 else torch.float32


def keeps_cosines(n: int, s: int, compute_dtype: torch.dtype, keep_bytes: int) -> bool:
    """Whether a triton training step keeps its ``[S, N]`` cosines for backward (float16 for
    bf16/fp16 products, float32 otherwise) within ``keep_bytes``."""
    item = 4 if compute_dtype == torch.float32 else 2
    return n * s * item <= keep_bytes


COSINE_PATHS = ("exp", "kept", "recompute")


def cosine_path(n: int, s: int, compute_dtype: torch.dtype, keep_bytes: int, scale: float) -> str:
    """What a triton training step of ``n`` samples over ``s`` active classes keeps for its
    backward; the one place the choice is made (each choice is logged once per process):

    - ``"exp"``: bf16 products, the ``[S, N]`` bf16 exponentials ``E = exp(scale cos - scale / 2)``
      fit ``keep_bytes`` (:func:`keeps_cosines`), and ``scale <= exp_scale_bound(s)`` (about 145
      at ``s = 800k``: the float32 range of ``sum E``). The backward is two cuBLAS products over E,
      no G pass.
    - ``"kept"``: otherwise when the cosines fit ``keep_bytes`` -- fp16 products (GPUs of compute
      capability 7.x, without bf16), float32 products, or a scale beyond the exp bound: float16
      (float32) cosines, a G pass over them, then the two products.
    - ``"recompute"``: over the budget; nothing of size ``N x S`` survives the forward.
    """
    if not keeps_cosines(n, s, compute_dtype, keep_bytes):
        path, why = "recompute", f"{n} x {s} cosines exceed keep_bytes={keep_bytes}"
    elif compute_dtype != torch.bfloat16:
        path, why = "kept", f"{compute_dtype} products (exp-kept needs bf16)"
    else:
        from ..kernels import triton_softmax as kernels
        bound = kernels.exp_scale_bound(s)
        if scale <= bound:
            path, why = "exp", f"bf16 products, scale {scale:g} <= {bound:.1f}"
        else:
            path, why = "kept", f"scale {scale:g} beyond the exp-kept bound {bound:.1f} at {s} classes"
    _log_path(path, why)
    return path


_LOGGED_PATHS: set = set()


def _log_path(path: str, why: str) -> None:
    if path not in _LOGGED_PATHS:
        _LOGGED_PATHS.add(path)
        _log.info("triton softmax: %s cosine path (%s)", path, why)


def class_blocks(backend: str, n: int, s: int, compute_dtype: torch.dtype, block_bytes: int) -> int:
    """Class blocks one call of ``backend`` ("torch" or "triton") walks for ``n`` samples and
    ``s`` active classes: torch blocks hold ``block_bytes`` of float32 logits, triton blocks
    ``block_bytes`` of the gradient ``G`` in the compute dtype (a whole number of class tiles)."""
    if s <= 0:
        return 0
    if backend == "triton":
        from ..kernels import triton_softmax as kernels
        step = kernels.block_classes(n, s, compute_dtype, block_bytes, interpret=False)
    else:
        step = max(1, min(s, block_bytes // max(1, n * 4)))
    return -(-s // step)


def resolve_backend(backend: str, device, compute_dtype, acc_dtype, margin: Margin | None = None) -> str:
    """``"torch"`` or ``"triton"`` for ``backend`` in :data:`BACKENDS` (checked).

    ``"auto"`` never returns a backend that would then refuse the inputs: triton on CUDA for
    bf16/fp16 products with float32 accumulation and a margin the kernels implement (the
    kernels take float32/bf16/fp16 centers of any layout and any width), torch otherwise --
    float32 products included, which cuBLAS runs faster than an FMA kernel. A margin the
    kernels do not implement (``margin.fused`` False: a transform of the negatives) makes
    ``"triton"`` an error."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    device = torch.device(device)
    supported = acc_dtype == torch.float32 and compute_dtype in (torch.float32, torch.bfloat16, torch.float16)
    if margin is not None and not margin.fused:
        if backend == "triton":
            raise ValueError(f"backend='triton' does not implement {type(margin).__name__}'s transform of the "
                             "negative logits; use backend='torch' (or 'auto', which picks it)")
        return "torch"
    if backend == "auto":
        if device.type == "cuda" and supported and compute_dtype != torch.float32 and _triton_available():
            return "triton"
        return "torch"
    if backend == "triton":
        if not _triton_available():
            raise RuntimeError("backend='triton' needs the triton package (pip install triton, or "
                               "pip install -e .[dev]); use backend='torch' or 'auto'")
        if not supported:
            raise ValueError(f"backend='triton' supports float32 accumulation with compute_dtype float32, "
                             f"bfloat16 or float16; got accumulation {acc_dtype} and compute {compute_dtype}; "
                             "use backend='torch'")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError(f"backend='triton' needs a CUDA device, got tensors on {device}; on a CPU set "
                               "TRITON_INTERPRET=1 (before ds_pfc.kernels.triton_softmax is imported) to run the "
                               "kernels in Triton's interpreter, or use backend='torch'")
    return backend


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


# --------------------------------------------------------------------- stateless steps
def _mm(a: torch.Tensor, b: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """``a @ b`` with an ``acc`` result. On CUDA a reduced-precision product writes
    float32 directly (tensor cores, no rounding of the output to bf16)."""
    if a.dtype == acc:
        return torch.mm(a, b)
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=acc)
    return torch.mm(a, b).to(acc)


def _normalize(x: torch.Tensor, acc: torch.dtype):
    """``(x_hat, norm [N, 1])`` of the rows of ``x`` in ``acc``."""
    x = x.to(acc)
    norm = x.norm(dim=1, keepdim=True).clamp_min(_NORM_EPS)
    return x / norm, norm


def _target_terms(x_hat, w, w_inv, target_col, acc, sub_centers=1, rows=None):
    """Per owned sample its target column (0 where not owned: a safe index), center
    ``w_hat_t [N, d]``, cosine ``cos_t [N]`` (a row-wise dot in ``acc``) and the row
    of ``w`` that center is (with sub-centers: the target class's closest one).
    ``rows``: ``w`` is a table and the centers are ``w[rows]`` (sub_centers 1 only)."""
    owned = target_col >= 0
    col = target_col.clamp_min(0)
    if w_inv.shape[0] == 0:           # a rank may own no class (C < world size)
        return owned, x_hat.new_zeros(x_hat.shape), x_hat.new_zeros(x_hat.shape[0]), col
    if sub_centers == 1:
        src = col if rows is None else rows.index_select(0, col)
        w_hat_t = w.index_select(0, src).to(acc) * w_inv.index_select(0, col)[:, None]
        return owned, w_hat_t, (x_hat * w_hat_t).sum(dim=1), col
    k = sub_centers
    rows = (col[:, None] * k + torch.arange(k, device=col.device)).reshape(-1)            # [N K]
    w_hat_k = (w.index_select(0, rows).to(acc) * w_inv.index_select(0, rows)[:, None]).view(-1, k, w.shape[1])
    cos_k = torch.einsum("nkd,nd->nk", w_hat_k, x_hat)
    cos_t, pick = cos_k.max(dim=1)
    w_hat_t = w_hat_k[torch.arange(len(col), device=col.device), pick]
    return owned, w_hat_t, cos_t, col * k + pick


class _Blocks:
    """The class blocks of one call and the per-block steps of the torch backend.

    ``slot [N]``: for each sample, the row of the current block holding its target, or
    the block's spare last row when the target lies outside the block (or on another
    rank). Excluding the targets is then one indexed write per block, with no
    boolean-mask indexing (which would synchronise with the host).
    """

    def __init__(self, x_hat, w, w_inv, target_col, threshold, scale, compute, acc, block_bytes, keep_bytes=0,
                 neg_above=None, neg_t=None, sub_centers=1):
        # With K sub-centers per class, w has S*K rows; a block is a range of classes
        # and a class's cosine is the max over its rows (backward recomputes it).
        self.k = sub_centers
        self.x_hat, self.target_col = x_hat, target_col
        self.n, self.s = x_hat.shape[0], w.shape[0] // sub_centers
        if sub_centers > 1:
            keep_bytes = 0
        self.w, self.w_inv, self.threshold, self.scale, self.acc = w, w_inv, threshold, scale, acc
        # CurricularFace: negatives above neg_above[n] become c (t + c); kept logits
        # would lose the raw cosines the derivative needs, so such calls recompute.
        self.neg_above, self.neg_t = neg_above, neg_t
        if neg_above is not None:
            keep_bytes = 0
        self.compute = compute
        self.xc = x_hat.to(compute)
        itemsize = torch.empty((), dtype=acc).element_size()
        self.step = max(1, min(self.s, block_bytes // max(1, self.n * itemsize)))
        # Keep all logits for backward in one [S + 1, N] buffer when they fit: block
        # [j, k) is rows j..k and its spare row k is the next block's first row, which
        # that block's GEMM overwrites afterwards.
        self.keep = self.s * self.n * itemsize <= keep_bytes
        self.cols = torch.arange(self.n, device=x_hat.device)
        # Target column, or a value outside every block for samples this rank does not own.
        self.where = torch.where(target_col >= 0, target_col, torch.full_like(target_col, -1 - self.s))
        self.neg_inf = torch.full((self.n,), float("-inf"), dtype=acc, device=x_hat.device)
        self.buffer = None

    def __iter__(self):
        for j in range(0, self.s, self.step):
            yield j, min(self.s, j + self.step)

    w_hat_all = None     # all normalised centers, when a caller formed them once for several walks

    def w_hat(self, j, k):
        """Normalised centers of classes ``[j, k)`` (their ``(k - j) K`` rows)."""
        j, k = j * self.k, k * self.k
        if self.w_hat_all is not None:
            return self.w_hat_all[j:k]
        return self.w[j:k].to(self.acc) * self.w_inv[j:k, None]

    def cosines(self, j, k, w_hat):
        """Raw cosines ``[k - j, N]`` (class-major) in a buffer with one spare row."""
        b = k - j
        if self.keep:
            if self.buffer is None:
                self.buffer = torch.empty(self.s + 1, self.n, dtype=self.acc, device=self.xc.device)
            block = self.buffer[j: k + 1]
        else:
            if self.buffer is None or self.buffer.shape[0] < b + 1:
                self.buffer = torch.empty(b + 1, self.n, dtype=self.acc, device=self.xc.device)
            block = self.buffer[: b + 1]
        if self.k > 1:
            rows = _mm(w_hat.to(self.compute), self.xc.t(), self.acc).view(b, self.k, self.n)
            values, self.pick = rows.max(dim=1)       # pick [b, N]: the sub-center behind each class cosine
            block[:b] = values
        elif w_hat.dtype == self.compute and self.compute == self.acc:
            torch.mm(w_hat, self.xc.t(), out=block[:b])
        else:
            block[:b] = _mm(w_hat.to(self.compute), self.xc.t(), self.acc)
        return block

    def logits(self, j, k, block, max_cos=None, factor=None):
        """In place: exclude targets and filtered negatives (-inf), transform the hard
        negatives (CurricularFace), scale. Returns the ``[k - j, N]`` logits;
        ``max_cos`` (if given) takes the running max of the raw non-target cosines;
        ``factor`` (a list, if given) receives the transform's derivative ``[k - j, N]``
        (None without a transform)."""
        b = k - j
        slot = (self.where - j).clamp_(-1, b).remainder_(b + 1)   # outside -> spare row b
        block.index_put_((slot, self.cols), self.neg_inf)
        block = block[:b]
        if max_cos is not None and b:
            torch.maximum(max_cos, block.amax(dim=0), out=max_cos)
        if self.threshold is not None:
            # PFC* (Eq. noise_filtering): a negative above tau leaves the denominator.
            block.masked_fill_(block > self.threshold, float("-inf"))
        if self.neg_above is not None:
            hard = block > self.neg_above       # excluded (-inf) entries are never hard
            if factor is not None:
                factor.append(torch.where(hard, self.neg_t + 2.0 * block, torch.ones_like(block)))
            block = torch.where(hard, block * (self.neg_t + block), block)
        elif factor is not None:
            factor.append(None)
        return block.mul_(self.scale)


def _forward_torch(blocks: _Blocks, want_correct: bool):
    """Per-sample log-sum-exp over this rank's non-target logits, and the max raw
    non-target cosine (``want_correct``), and the kept ``[S, N]`` logits (or None)."""
    n, acc = blocks.n, blocks.acc
    lse = torch.full((n,), float("-inf"), dtype=acc, device=blocks.xc.device)
    max_cos = torch.full((n,), float("-inf"), dtype=acc, device=lse.device) if want_correct else None
    for j, k in blocks:
        z = blocks.logits(j, k, blocks.cosines(j, k, blocks.w_hat(j, k)), max_cos)
        torch.logaddexp(lse, torch.logsumexp(z, dim=0), out=lse)
    kept = blocks.buffer[: blocks.s] if blocks.keep and blocks.buffer is not None else None
    return lse, max_cos, kept


def _backward_torch(blocks: _Blocks, kept, coef, row_max, w_dtype, dw_hat_sum=None, project=True):
    """``(dx_hat [N, d], dw [S K, d])`` of the non-target logits: ``G = coef * exp(z -
    row_max)`` per block (recomputed unless ``kept``; times the negative transform's
    derivative), through both GEMMs, and ``dw`` projected through the normalisation of
    ``w``. With sub-centers each class's ``G`` goes to the row that gave its cosine.
    With ``dw_hat_sum [S, d]`` (in ``acc``) the gradient of ``w_hat`` is added into it,
    unprojected, and ``dw`` is None (:func:`_project_dw` projects the sum once). ``project=False``:
    ``dw`` is the gradient of ``w_hat``, not taken through the normalisation."""
    n, acc, kk = blocks.n, blocks.acc, blocks.k
    dx_hat = torch.zeros(n, blocks.xc.shape[1], dtype=acc, device=coef.device)
    dw = None if dw_hat_sum is not None else torch.empty(blocks.w.shape, dtype=w_dtype, device=coef.device)
    direct = blocks.compute == acc == w_dtype     # GEMMs straight into dx_hat and dw
    c_max = None
    for j, k in blocks:
        rj, rk = j * kk, k * kk
        w_hat = blocks.w_hat(j, k)
        # The kept buffer is read, never written: backward may run more than once.
        factor = []
        z = kept[j:k] if kept is not None else blocks.logits(j, k, blocks.cosines(j, k, w_hat), factor=factor)
        g = (z - row_max).exp_().mul_(coef)
        if factor and factor[0] is not None:
            g.mul_(factor[0])
        if kk > 1:
            spread = torch.zeros(k - j, kk, n, dtype=g.dtype, device=g.device)
            g = spread.scatter_(1, blocks.pick[:, None, :], g[:, None, :]).view((k - j) * kk, n)
        if dw_hat_sum is not None:
            if blocks.compute == acc:
                dw_hat_sum[rj:rk].addmm_(g, blocks.xc)
                dx_hat.addmm_(g.t(), w_hat)
            else:
                gc = g.to(blocks.compute)
                dw_hat_sum[rj:rk].add_(_mm(gc, blocks.xc, acc))
                dx_hat.add_(_mm(gc.t(), w_hat.to(blocks.compute), acc))
            continue
        if direct:
            dw_hat = torch.mm(g, blocks.xc, out=dw[rj:rk])
            dx_hat.addmm_(g.t(), w_hat)
        elif blocks.compute == torch.float16:
            # G is ~5e-9 at initialisation, below float16's range: round G / c (c = max |coef|)
            # and scale the float32 products back.
            if c_max is None:
                c_max = coef.abs().amax().clamp_min(torch.finfo(torch.float32).tiny)
            gc = (g / c_max).to(blocks.compute)
            dw_hat = _mm(gc, blocks.xc, acc).mul_(c_max)
            dx_hat.add_(_mm(gc.t(), w_hat.to(blocks.compute), acc).mul_(c_max))
        else:
            gc = g.to(blocks.compute)
            dw_hat = _mm(gc, blocks.xc, acc)
            dx_hat.add_(_mm(gc.t(), w_hat.to(blocks.compute), acc))
        if project:
            _project_rows(dw_hat, w_hat, blocks.w_inv[rj:rk])
        if not direct:
            dw[rj:rk] = dw_hat
    return dx_hat, dw


def _project_rows(dw_hat, w_hat, w_inv):
    """In place: ``dw_hat`` through the normalisation of ``w`` (tangent projection,
    then divide by the norm)."""
    radial = (w_hat * dw_hat).sum(1, keepdim=True)
    return dw_hat.addcmul_(w_hat, radial, value=-1.0).mul_(w_inv[:, None])


def _project_dw(blocks: _Blocks, dw_hat_sum, w_dtype):
    """``dw`` from the summed gradient of ``w_hat``, block by block, in place."""
    for j, k in blocks:
        _project_rows(dw_hat_sum[j:k], blocks.w_hat(j, k), blocks.w_inv[j:k])
    return dw_hat_sum.to(w_dtype)


def _sample_chunks(n: int, s: int, itemsize: int, keep_bytes: int):
    """Row ranges of the samples whose ``[S, rows]`` logits fit in ``keep_bytes``
    together (balanced, rows a multiple of 16 where the budget allows: a logit row of
    64-byte multiples keeps the GEMMs that write and read it at full speed), or None
    when not even one sample's fit."""
    most = int(min(n, keep_bytes // max(1, s * itemsize)))
    if most < 1:
        return None
    count = -(-n // most)
    if count == 1:
        return [(0, n)]
    rows = -(-n // count)
    if most >= 16:
        rows = min(most // 16 * 16, -(-rows // 16) * 16)
    return [(a, min(n, a + rows)) for a in range(0, n, rows)]


def _forward_backward_torch(blocks: _Blocks, chunks, t_logit, want_correct, w_dtype, block_bytes, project=True):
    """One rank holds every class (world size 1), so a chunk of samples' softmax rows
    is complete once its logits over all classes are known: the logits of ``chunks``
    of samples are kept one chunk at a time (``keep_bytes``), and their gradient for
    a mean loss with ``dL/dloss = 1`` goes through both GEMMs at once. Every logit is
    computed and exponentiated once (three GEMMs per step, not four), and nothing of
    size ``N x S`` outlives a chunk. Returns ``lse [N]``, ``max_cos`` (or None) and the
    gradients ``(dx_hat [N, d], dw [S, d])``, which backward scales by ``dL/dloss``.

    Per block, while it is in cache: GEMM, exclusion, scale, then ``exp(z - m)`` in
    place against the running max ``m`` of its samples' logits (the target's
    included). Once the chunk's true max is known, each block's share is corrected by
    a per-sample factor ``exp(m_block - m)`` that goes into the GEMMs' ``N``-side
    operands (``x_hat`` rows for ``dw``, the ``dx`` rows), so the kept values are not
    touched again."""
    n, acc, compute = blocks.n, blocks.acc, blocks.compute
    lse = torch.empty(n, dtype=acc, device=t_logit.device)
    max_cos = torch.empty(n, dtype=acc, device=t_logit.device) if want_correct else None
    dx_hat = torch.zeros(n, blocks.xc.shape[1], dtype=acc, device=t_logit.device)
    dw_hat = torch.zeros(blocks.w.shape, dtype=acc, device=t_logit.device)
    # Every chunk walks all classes twice: normalise the centers once (S x d more memory).
    w_hat_all = blocks.w.to(acc) * blocks.w_inv[:, None] if len(chunks) > 1 else None
    for a, b in chunks:
        part = _Blocks(blocks.x_hat[a:b], blocks.w, blocks.w_inv, blocks.target_col[a:b], blocks.threshold,
                       blocks.scale, compute, acc, block_bytes, keep_bytes=float("inf"))
        part.w_hat_all = w_hat_all
        max_c = torch.full((b - a,), float("-inf"), dtype=acc, device=lse.device) if want_correct else None
        running = t_logit[a:b].clone()         # max so far of each sample's logits, -inf while none
        shifts, sums = [], []
        for j, k in part:
            z = part.logits(j, k, part.cosines(j, k, part.w_hat(j, k)), max_c)
            if k > j:
                torch.maximum(running, z.amax(dim=0), out=running)
            shifts.append(running.clone())
            sums.append(z.sub_(running.nan_to_num(neginf=0.0)).exp_().sum(dim=0))    # -inf -> 0
        m = running.nan_to_num(neginf=0.0)
        shifts = torch.stack(shifts)
        # exp(m_block - m) per block and sample; 0 where nothing was finite yet (its values are all 0).
        factor = torch.where(torch.isfinite(shifts), torch.exp(shifts.nan_to_num(neginf=0.0) - m), 0.0)
        sum_neg = (torch.stack(sums) * factor).sum(dim=0)
        lse[a:b] = m + torch.log(sum_neg)
        # The forward's statistics for these rows, against this chunk's max (shift-free).
        coef = blocks.scale / n / (sum_neg + torch.exp(t_logit[a:b] - m))
        kept = part.buffer
        dx_c = dx_hat[a:b]
        for i, (j, k) in enumerate(part):
            f = (coef * factor[i])[:, None]
            e, w_hat = kept[j:k], part.w_hat(j, k)
            if compute == acc:
                dw_hat[j:k].addmm_(e, part.xc * f)
                dx_c.addcmul_(torch.mm(e.t(), w_hat), f)
            else:
                ec = e.to(compute)
                dw_hat[j:k].add_(_mm(ec, (part.x_hat * f).to(compute), acc))
                dx_c.addcmul_(_mm(ec.t(), w_hat.to(compute), acc), f)
        if want_correct:
            max_cos[a:b] = max_c
        del part, kept, z, e        # views of the kept logits: free them before the next chunk's
    blocks.w_hat_all = w_hat_all
    dw = _project_dw(blocks, dw_hat, w_dtype) if project else dw_hat.to(w_dtype)
    blocks.w_hat_all = None
    return lse, max_cos, (dx_hat, dw)


# --------------------------------------------------------------------- autograd
def _dw_finite(dw, n_sized: bool, coef, x_hat, dw_t) -> torch.Tensor:
    """A 0-d bool tensor (no host sync): whether the centers' gradient ``dw`` is finite.

    ``n_sized`` (the exp-kept backward, :func:`ds_pfc.kernels.triton_softmax.grad_exp`): from
    N-sized values only, without reading ``dw``. There every non-target entry of G is
    ``coef[n] E[j, n]`` with ``E = exp(z - shift)`` and ``sum_exp >= E``, so ``|G| <= |weight| *
    scale``: the products ``E (x_hat a)`` are finite whenever ``coef`` (which carries the
    weights, the loss scale and the global sum) and ``x_hat`` are, and the target terms ``dw_t``
    are checked themselves. A non-finite center or embedding reaches ``sum_exp``, hence
    ``coef``, on every rank (it is all-reduced). Elsewhere: one pass over ``dw``."""
    if not n_sized:
        return torch.isfinite(dw).all()
    finite = torch.isfinite(coef).all() & torch.isfinite(x_hat).all()
    return finite if dw_t is None else finite & torch.isfinite(dw_t).all()


class _MarginSoftmaxCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, target_col, margin, threshold, group, compute_dtype, want_correct, block_bytes,
                keep_bytes, backend, validate, guard_nonfinite, update_state, sub_centers, want_grad,
                project_w=True, w_source=None, grad_finite=None):
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        compute = default_compute_dtype(x.device, acc) if compute_dtype is None else compute_dtype
        n = x.shape[0]
        scale = margin.scale
        x_hat, x_norm = _normalize(x, acc)
        w_hat_c = None
        if backend == "triton":
            # One pass over w: the norms and the normalised centers in the compute dtype, which
            # the backward reuses (S d compute-dtype bytes kept, half of a float32 w).
            from ..kernels import triton_softmax as kernels
            # With w_source the centers are read from the bank's table by index (w is then only
            # their shape, the leaf the gradient lands on): no gathered copy.
            w_hat_c, w_inv = kernels.prepare(w, compute) if w_source is None else \
                kernels.prepare(w_source[0], compute, rows=w_source[1])
        else:
            w_inv = w.to(acc).norm(dim=1).clamp_min(_NORM_EPS).reciprocal()
        if w_source is None:
            owned, w_hat_t, cos_t, t_row = _target_terms(x_hat, w, w_inv, target_col, acc, sub_centers)
        else:
            owned, w_hat_t, cos_t, t_row = _target_terms(x_hat, w_source[0], w_inv, target_col, acc, 1,
                                                         rows=w_source[1])
        if margin.needs_all_targets:     # every rank needs every sample's target cosine
            cos_all = torch.where(owned, cos_t, torch.zeros_like(cos_t))
            all_reduce_(cos_all, "sum", group)
        else:
            cos_all = cos_t
        plan = margin.plan(cos_all, x_norm[:, 0], update=update_state)
        t_logit = torch.where(owned, plan.target, torch.full_like(cos_t, float("-inf")))

        kept, blocks, pre = None, None, None
        cos_kept, path = None, None
        if backend == "triton":
            # A training step keeps its bf16 exponentials (kernels.grad_exp) or its cosines (float16
            # for fp16 products: kernels.grad_kept) when they fit the keep budget: the backward then
            # runs no recompute product. cosine_path is the rule; a step that recomputes says why.
            path = cosine_path(n, w.shape[0], compute, keep_bytes, scale) if want_grad else "recompute"
            if want_grad and path == "recompute":
                say_why_recompute(n, w.shape[0], compute, keep_bytes)
            if path == "exp":
                cos_kept = torch.empty(w.shape[0], n, dtype=torch.bfloat16, device=x.device)
                m, l, max_cos = kernels.exp_stats(x_hat, w, w_inv, target_col, scale=scale, threshold=threshold,
                                                  compute_dtype=compute, want_max_cos=want_correct, w_hat=w_hat_c,
                                                  keep=cos_kept)
            else:
                if path == "kept":
                    cos_kept = torch.empty(w.shape[0], n, dtype=kernels.keep_dtype(compute), device=x.device)
                m, l, max_cos = kernels.lse_stats(x_hat, w, w_inv, target_col, scale=scale, threshold=threshold,
                                                  compute_dtype=compute, want_max_cos=want_correct, w_hat=w_hat_c,
                                                  keep=cos_kept)
            lse = m + torch.log(l)
        else:
            blocks = _Blocks(x_hat, w, w_inv, target_col, threshold, scale, compute, acc, block_bytes, keep_bytes,
                             plan.neg_above, plan.neg_t, sub_centers)
            chunks = None
            # Only where the keep budget spans several class blocks (the CPU default:
            # cache-sized blocks): with one block per chunk the chunks' bookkeeping would
            # only add launches (the GPU-sized default).
            if not blocks.keep and keep_bytes > block_bytes and sub_centers == 1 and plan.neg_above is None \
                    and want_grad and world_size(group) == 1:
                chunks = _sample_chunks(n, blocks.s, x_hat.element_size(), keep_bytes)
            if chunks is not None:
                lse, max_cos, pre = _forward_backward_torch(blocks, chunks, t_logit, want_correct, w.dtype,
                                                            block_bytes, project_w)
            else:
                lse, max_cos, kept = _forward_torch(blocks, want_correct)

        # Global max of every logit (targets included), then the sums against it.
        maxes = torch.stack([torch.maximum(lse, t_logit)] + ([max_cos] if want_correct else []))
        all_reduce_(maxes, "max", group)
        row_max = maxes[0]
        stats = torch.stack([
            torch.exp(lse - row_max) + torch.exp(t_logit - row_max),
            torch.where(owned, t_logit - row_max, torch.zeros_like(t_logit)),
            owned.to(acc),
        ] + ([(owned & (cos_t >= maxes[1])).to(acc)] if want_correct else []))
        all_reduce_(stats, "sum", group)
        if validate:
            if not bool((stats[2] == 1.0).all()):
                bad = torch.nonzero(stats[2] != 1.0).squeeze(1)[:5].tolist()
                raise ValueError(
                    f"labels: gathered samples {bad} have a label owned by no rank "
                    "(labels must lie in [0, num_classes) of the sharded classifier)")
        else:
            # No host sync: the device checks it when it gets there (a failed device
            # assert ends the CUDA context; validate=True gives the readable error).
            torch._assert_async((stats[2] == 1.0).all(), "labels: a gathered sample has a label owned by no rank")
        sum_exp = stats[0]
        per_sample = torch.log(sum_exp) - stats[1]
        if plan.extra is not None:       # a per-sample loss term (MagFace's regulariser), the same on every rank
            per_sample = per_sample + plan.extra.to(acc)

        none = torch.empty(0)
        ctx.save_for_backward(x_hat, x_norm, w, w_inv, target_col, t_row, w_hat_t, cos_t, t_logit, row_max, sum_exp,
                              kept if kept is not None else none, w_hat_c if w_hat_c is not None else none,
                              plan.dtarget,
                              *(none if v is None else v for v in (plan.dtarget_dnorm, plan.dextra_dnorm,
                                                                    plan.neg_above, plan.neg_t)))
        ctx.has = tuple(v is not None for v in (plan.dtarget_dnorm, plan.dextra_dnorm, plan.neg_above))
        ctx.sub_centers = sub_centers
        ctx.margin, ctx.compute, ctx.in_dtypes = margin, compute, (x.dtype, w.dtype)
        ctx.threshold, ctx.block_bytes, ctx.backend, ctx.kept = threshold, block_bytes, backend, kept is not None
        ctx.guard_nonfinite = guard_nonfinite
        ctx.grad_finite = grad_finite
        ctx.project_w = project_w
        # The gradients formed in forward (world size 1, see _forward_backward_torch):
        # consumed by the first backward, which scales them in place.
        ctx.pre = pre
        # The kept cosines (triton): an attribute, not a saved tensor, so that the backward can
        # free them once G has been formed over them (a second backward recomputes).
        ctx.cos_kept, ctx.path = cos_kept, path
        ctx.set_materialize_grads(False)     # an unused output's gradient arrives as None, not zeros
        correct = stats[3].clone() if want_correct else torch.zeros(n, dtype=acc, device=x.device)
        ctx.mark_non_differentiable(correct)
        return per_sample.mean(), per_sample, correct

    @staticmethod
    def backward(ctx, grad_loss, grad_per_sample, _grad_correct):
        (x_hat, x_norm, w, w_inv, target_col, t_row, w_hat_t, cos_t, t_logit, row_max, sum_exp, kept, w_hat_c,
         dtarget,
         dtarget_dnorm, dextra_dnorm, neg_above, neg_t) = ctx.saved_tensors
        has_dnorm, has_extra, has_neg = ctx.has
        margin, compute = ctx.margin, ctx.compute
        n, acc = x_hat.shape[0], x_hat.dtype
        weight = torch.zeros(n, dtype=acc, device=x_hat.device)
        if grad_loss is not None:
            weight += grad_loss / n
        if grad_per_sample is not None:
            weight += grad_per_sample
        # dL/dcos = scale * weight * (p - onehot), times phi'(cos) on the target.
        coef = weight * margin.scale / sum_exp
        pre, ctx.pre = ctx.pre, None
        n_sized = False      # whether dw's finiteness follows from N-sized values (the exp-kept algebra)
        if pre is not None and grad_per_sample is None and grad_loss is not None:
            dx_hat, dw = pre[0].mul_(grad_loss), pre[1].mul_(grad_loss)
        elif ctx.backend == "triton":
            from ..kernels import triton_softmax as kernels
            cos_kept, ctx.cos_kept = ctx.cos_kept, None
            if cos_kept is not None and ctx.path == "exp":   # E is only read, but freed with the step
                dx_hat, dw = kernels.grad_exp(cos_kept, x_hat, w, w_inv, coef, row_max, scale=margin.scale,
                                              compute_dtype=compute, w_hat=w_hat_c, project=ctx.project_w)
                del cos_kept
                n_sized = True
            elif cos_kept is not None:     # G is formed over the kept cosines, in place: they are spent
                dx_hat, dw = kernels.grad_kept(cos_kept, x_hat, w, w_inv, target_col, coef, row_max,
                                               scale=margin.scale, threshold=ctx.threshold, compute_dtype=compute,
                                               w_hat=w_hat_c, project=ctx.project_w)
                del cos_kept
            else:
                dx_hat, dw = kernels.grad(x_hat, w, w_inv, target_col, coef, row_max, scale=margin.scale,
                                          threshold=ctx.threshold, compute_dtype=compute, w_hat=w_hat_c,
                                          block_bytes=ctx.block_bytes, project=ctx.project_w)
            dw = dw.to(ctx.in_dtypes[1])
        else:
            blocks = _Blocks(x_hat, w, w_inv, target_col, ctx.threshold, margin.scale, compute, acc,
                             ctx.block_bytes, neg_above=neg_above if has_neg else None,
                             neg_t=neg_t if has_neg else None, sub_centers=ctx.sub_centers)
            dx_hat, dw = _backward_torch(blocks, kept if ctx.kept else None, coef, row_max, ctx.in_dtypes[1],
                                         project=ctx.project_w)
        # The target terms, hoisted out of the blocks: one fix-up for dx and dw.
        owned = target_col >= 0
        p_t = torch.exp(t_logit - row_max) / sum_exp
        g_t = torch.where(owned, weight * dtarget * (p_t - 1.0), torch.zeros_like(cos_t))
        dx_hat.add_(g_t[:, None] * w_hat_t)
        dw_t = None
        if w.shape[0]:
            dw_hat_t = g_t[:, None] * x_hat
            dw_t = dw_hat_t if not ctx.project_w else \
                (dw_hat_t - w_hat_t * (w_hat_t * dw_hat_t).sum(1, keepdim=True)) * w_inv.index_select(0, t_row)[:, None]
            dw.index_add_(0, t_row, dw_t.to(dw.dtype))
        dx = (dx_hat - x_hat * (x_hat * dx_hat).sum(1, keepdim=True)) / x_norm
        if has_dnorm or has_extra:       # margins that read the norm: along x_hat, on the owner rank only
            g_norm = torch.zeros_like(cos_t)
            if has_dnorm:
                g_norm = g_norm + weight * (p_t - 1.0) * dtarget_dnorm
            if has_extra:
                g_norm = g_norm + weight * dextra_dnorm
            dx = dx + x_hat * torch.where(owned, g_norm, torch.zeros_like(g_norm))[:, None]
        if ctx.guard_nonfinite or ctx.grad_finite is not None:
            finite = _dw_finite(dw, n_sized, coef, x_hat, dw_t)
            if ctx.grad_finite is not None:
                ctx.grad_finite.logical_and_(finite)
            if ctx.guard_nonfinite:     # an overflow in dw reaches the embeddings, hence the overflow check
                dx = dx + torch.where(finite, 0.0, float("nan")).to(dx.dtype)
        return (dx.to(ctx.in_dtypes[0]), dw, None, None, None, None, None, None, None, None, None, None, None, None, None,
                None, None, None, None)


def margin_softmax_cross_entropy(
    x: torch.Tensor,
    w: torch.Tensor,
    target_col: torch.Tensor,
    margin: Margin,
    *,
    filter_threshold: float | None = None,
    group=None,
    compute_dtype: torch.dtype | None = None,
    return_correct: bool = False,
    block_bytes: int | None = None,
    backend: str = "auto",
    validate: bool = True,
    guard_nonfinite: bool = False,
    update_state: bool = False,
    sub_centers: int = 1,
    keep_bytes: int | None = None,
    project_w_grad: bool = True,
    w_source: tuple | None = None,
    grad_finite: torch.Tensor | None = None,
) -> SoftmaxResult:
    """Margin softmax CE of the gathered batch against this rank's active centers.

    ``x [N, d]``: gathered embeddings (identical on every rank of ``group``).
    ``w [S, d]``: this rank's active centers (raw; normalised here).
    ``target_col [N]``: column of each sample's target in ``w``, -1 where another
    rank owns it. Every sample's target must be owned by exactly one rank.
    Gradients flow to ``x`` (this rank's share; the ranks' shares are summed by a
    reduce-scatter) and to ``w``. ``correct`` is only computed with
    ``return_correct=True``; it is all zeros otherwise.

    ``block_bytes``: bytes of logits per class block (None: :func:`default_block_bytes` of
    the device). ``keep_bytes``: the most bytes of logits (torch) or of bf16 exponentials or
    cosines (triton, :func:`cosine_path`) a training step keeps for backward instead of recomputing them
    (None: ``block_bytes`` when given, else :func:`cosine_keep_bytes` for triton (half the free
    device memory on CUDA, :data:`COSINE_KEEP_BYTES` elsewhere) and :data:`KEEP_BYTES` for torch). ``backend``: one of :data:`BACKENDS`. ``validate=False``
    checks label ownership on the device (``torch._assert_async``) instead of with a
    host sync and a readable error. ``guard_nonfinite=True`` makes the gradient of
    ``x`` NaN when that of ``w`` is not finite (for loss-scaled training, whose
    overflow check sees the embeddings' gradients only). ``update_state``: a
    training forward, in which stateful margins advance their running state.
    ``sub_centers=K``: ``w`` holds ``S K`` rows, row ``c K + k`` the k-th sub-center
    of active class ``c``; a class's cosine is the largest of its sub-centers'
    (sub-center ArcFace), and ``target_col`` counts classes. torch backend only.
    ``project_w_grad=False``: the gradient of ``w`` is that of the normalised centers
    ``w_hat = w / ||w||``, not taken through the normalisation, for a caller that projects
    it itself just before it uses it (PartialFC's row optimizers, see ``PartialFC.step``):
    the projection is linear per row and ``w`` is the same at both ends, so sums over
    micro steps, scaling and finiteness checks may come first.
    ``w_source=(table [C, d], rows [S] int64)``: the centers' values are ``table[rows]``, read
    there by index (triton backend, no sub-centers, ``project_w_grad=False`` when training;
    ``rows`` None: the whole table); ``w`` then only gives their shape and dtype and receives
    the gradient (it may be a shape-only tensor such as ``torch.empty(()).expand(S, d)``).
    ``grad_finite``: a 0-d bool tensor on ``x``'s device; the backward ANDs into it, in place and
    without a host sync, whether the gradient of ``w`` is finite -- from N-sized values on the
    exp-kept path (no pass over the ``[S, d]`` gradient), by a pass over it elsewhere.
    """
    if grad_finite is not None and (not isinstance(grad_finite, torch.Tensor) or grad_finite.dim() != 0
                                    or grad_finite.dtype != torch.bool or grad_finite.device != x.device):
        raise ValueError(f"grad_finite must be a 0-d bool tensor on {x.device}, got "
                         f"{grad_finite if not isinstance(grad_finite, torch.Tensor) else (grad_finite.shape, grad_finite.dtype, grad_finite.device)}")
    check_block_bytes(block_bytes)
    check_keep_bytes(keep_bytes)
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    compute = default_compute_dtype(x.device, acc) if compute_dtype is None else compute_dtype
    if sub_centers != 1:
        if backend == "triton":
            raise ValueError("backend='triton' does not implement sub-centers; use backend='torch' or 'auto'")
        backend = "torch"
    backend = resolve_backend(backend, x.device, compute, acc if w.dtype != torch.float64 else torch.float64, margin)
    if w_source is not None:
        table, rows = w_source
        if backend != "triton" or sub_centers != 1 or (project_w_grad and w.requires_grad):
            raise ValueError("w_source needs backend='triton', sub_centers=1 and, for a gradient of w, "
                             "project_w_grad=False (the projection would read w)")
        if table.dim() != 2 or table.shape[1] != w.shape[1] or table.dtype != w.dtype or \
                (rows.shape[0] if rows is not None else table.shape[0]) != w.shape[0]:
            raise ValueError(f"w_source: a [C, {w.shape[1]}] {w.dtype} table and {w.shape[0]} row ids expected")
        w_source = (table, rows if rows is not None else torch.arange(table.shape[0], device=table.device))
    keep_bytes = default_keep_bytes(backend, block_bytes, x.device) if keep_bytes is None else keep_bytes
    block_bytes = default_block_bytes(x.device) if block_bytes is None else block_bytes
    loss, per_sample, correct = _MarginSoftmaxCE.apply(
        x, w, target_col, margin, filter_threshold, group, compute_dtype, return_correct, block_bytes, keep_bytes,
        backend, bool(validate), bool(guard_nonfinite), bool(update_state), int(sub_centers),
        torch.is_grad_enabled() and (x.requires_grad or w.requires_grad), bool(project_w_grad), w_source,
        grad_finite)
    return SoftmaxResult(loss, per_sample, correct)
