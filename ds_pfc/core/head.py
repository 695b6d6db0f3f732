"""``PartialFC``: the class-sharded, sampled margin-softmax head as an ``nn.Module``."""
from __future__ import annotations

import math
import warnings
import zlib
from typing import Callable

import torch
from torch import nn

from . import collectives
from .._checks import PROBE_FIELDS, batch_probe, check_batch_table, check_embeddings, check_labels, check_peers
from ..bank import ClassBank, DeviceBank, TieredBank, initial_centers
from ..bank.mapped import MappedStager
from ..bank.slots import SlotBank, merge_slots
from ..bank.staged import StagedStager
from .late import LateRead
from ..devices import collective_device, cpu_native_half, head_device
from .functional import CrossEntropyOutput, check_filter_threshold
from .margins import ArcFace, Margin
from .optim import RowOptimizer, make_row_optimizer
from .partition import Partition
from .sampling import remap_labels, sample_active
from .softmax import (BACKENDS, check_block_bytes, check_keep_bytes, default_compute_dtype, margin_softmax_cross_entropy,
                      resolve_backend)

__all__ = ["PartialFC"]

#: Bytes of a state moved to the bank per block when a state dict is loaded.
LOAD_CHUNK_BYTES = 8 << 20
_COMPUTE_DTYPES = (None, torch.float32, torch.float64, torch.bfloat16, torch.float16)


class _ScaleGrad(torch.autograd.Function):
    """forward: identity; backward: gradient times ``factor``."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


VALIDATE_MODES = (True, False, "immediate", "deferred")


def _checked_validate(validate):
    """``validate`` as the head keeps it: True, False or ``"deferred"``."""
    if isinstance(validate, bool):
        return validate
    if validate == "immediate":
        return True
    if validate == "deferred":
        return validate
    raise ValueError(f"validate must be True, False, 'immediate' or 'deferred', got {validate!r}")


def _checked_arguments(num_classes, embedding_size, sample_rate, margin, filter_threshold, seed, compute_dtype,
                       dtype, optimizer, optimizer_kwargs, block_bytes, backend, device):
    """Local validation of the constructor's arguments; returns (margin, row optimizer)."""
    for name, value in (("num_classes", num_classes), ("embedding_size", embedding_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, (int, float)) \
            or not 0.0 < sample_rate <= 1.0 or math.isnan(sample_rate):
        raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate!r}")
    margin = ArcFace() if margin is None else margin
    if not isinstance(margin, Margin):
        raise TypeError(f"margin must be a ds_pfc Margin (ArcFace, CosFace, CombinedMargin), got {margin!r}")
    check_filter_threshold(filter_threshold)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {seed!r}")
    if not 0 <= seed < 2 ** 63:
        raise ValueError(f"seed must be in [0, 2**63) (it is stored as int64), got {seed}")
    if compute_dtype not in _COMPUTE_DTYPES:
        raise ValueError(f"compute_dtype must be one of {_COMPUTE_DTYPES}, got {compute_dtype!r}")
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"dtype must be torch.float32 or torch.float64, got {dtype!r}")
    check_block_bytes(block_bytes)
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "triton":
        resolve_backend(backend, device, compute_dtype or default_compute_dtype(device, dtype), dtype)
    if isinstance(optimizer, RowOptimizer):
        if optimizer_kwargs:
            raise TypeError(f"optimizer is a RowOptimizer instance; unexpected arguments {sorted(optimizer_kwargs)}")
        return margin, optimizer
    return margin, make_row_optimizer(optimizer, **optimizer_kwargs)


class PartialFC(nn.Module):
    """Partial FC head: class-sharded centers, positive-preserving sampling, exact
    distributed margin softmax, sparse row updates.

    ``loss = head(embeddings, labels)`` with this rank's ``embeddings [N, d]`` and global
    ``labels [N]``; after ``loss.backward()`` (possibly several times, to accumulate),
    ``head.step(lr)`` updates exactly the rows that were active. The centers are not
    ``nn.Parameter`` s: a data-parallel wrapper must never average or broadcast them.

    Args:
        num_classes: ``C``, the global number of classes.
        embedding_size: ``d``.
        sample_rate: ``r`` in (0, 1]; each rank activates its positives plus uniform
            negatives up to ``floor(r * C_q)``. ``1.0`` is exact model parallelism.
        margin: an :class:`~ds_pfc.core.margins.Margin`; default ``ArcFace(64, 0.5)``.
        filter_threshold: PFC* conflict filter ``tau`` (None: off).
        group: process group the classes are sharded over (None: the default group
            if initialised, else a single process).
        batch_group: process group the samples are gathered over (None: ``group``).
            Under tensor parallelism (TP) x data parallelism (DP) the classes can be
            sharded over every rank (``group`` = TP x DP) while the distinct samples
            are gathered over the data-parallel group: TP peers, which hold identical
            embeddings, then share the classes instead of each holding a copy, and
            each gets the complete embedding gradient. Every rank of ``batch_group``
            must be in ``group``; all batch groups have one size.
        device: where the bank and the computation live. None: the current CUDA
            device when ``group`` uses NCCL, else the CPU; ``"cuda"`` means the current
            CUDA device (``cuda:<torch.cuda.current_device()>``).
        seed: seeds the initial centers (per global class id) and the sampler.
        optimizer: ``"sgd"`` (``momentum``, ``weight_decay``, ``nesterov``) or
            ``"adamw"`` (``betas``, ``eps``, ``weight_decay``), or a RowOptimizer.
        compute_dtype: dtype of the matrix products. None: bf16 on CUDA (tensor cores),
            the accumulation dtype (float32, float64 for float64 centers) elsewhere;
            ``torch.float32`` asks for IEEE float32 products on a GPU too. The softmax,
            the centers and their gradients are always float32 or wider.
        init_std: standard deviation of the initial centers.
        dtype: storage dtype of the centers (float32; float64 for exactness checks).
        data_parallel_grad: the backbone producing ``embeddings`` is data parallel over
            ``batch_group`` and its gradients get *averaged* (DDP, DeepSpeed). The
            gradient returned to ``embeddings`` is then multiplied by that group's
            size, here and only here, so that the average equals the gradient of the
            global mean loss. Set False if nothing averages (single process, or summed
            gradients).
        bank: a factory ``(num_rows, device, class_start=...) -> ClassBank`` (default:
            DeviceBank); one with ``takes_owner = True`` (``TieredBank.factory``) also
            gets ``owner="rank<global rank>"``, which names it in messages.
        block_bytes: bytes of float32 logits per class block of the softmax, and of
            rows per chunk of the row optimizer (None: 256 MiB on CUDA, 2 MiB on CPU).
            Torch backend: logits larger than one block are recomputed in backward.
        keep_bytes: the most bytes of logits (torch) or, triton, of bf16 exponentials
            (bf16 products, exp-kept) or cosines (float16 for fp16 products) a training
            step keeps for backward instead of recomputing them; 0 never keeps (None:
            ``block_bytes`` when given, else for triton half the device memory free at the
            forward on CUDA, 4 GiB elsewhere, and 256 MiB for torch).
        backend: softmax backend, ``"auto"`` (the Triton kernels on CUDA for bf16/fp16
            products when triton imports; torch for float32 products and off CUDA),
            ``"torch"`` or ``"triton"``.
        sub_centers: ``K`` centers per class (sub-center ArcFace): the bank holds
            ``K`` rows per class, row ``i K + k`` the k-th sub-center of local class
            ``i``; a class's cosine is the largest of its sub-centers'; sampling picks
            whole classes. Works with every margin (torch backend).
        validate: check every rank's embeddings (NaN/Inf) and labels (range, hence
            ownership) and batch size every forward. ``True`` (or ``"immediate"``,
            the default): all in one host sync, before anything changes, with a
            readable error on every rank; batches may differ in size between ranks.
            ``"deferred"``: the same checks, read one step late with no host sync (a
            non-blocking copy into pinned memory behind an event): a training
            forward's checks are judged at the start of the next forward or
            prefetch, or at :meth:`check_deferred` / :meth:`flush` / a state dict,
            with the same error text naming the forward they belong to; that bad
            step may already have been applied (recover from a checkpoint). The
            ranks must pass equal batch sizes (asserted on the device); a label
            outside ``[0, C)`` is trained as class ``label mod C`` until the check reports it.
            Evaluation forwards (no grad or ``eval()``) check at once.
            False: no checks and no host sync at all (device bank,
            ``floor(r C_q) >= N``; a CUDA graph can capture the step); the ranks must
            pass equal batch sizes, and sizes and label ownership are asserted on the
            device (``torch._assert_async``): bad values fail as a device-side assert.
        optimizer_kwargs: hyper-parameters of the row optimizer.
    """

    def __init__(
        self,
        num_classes: int,
        embedding_size: int,
        *,
        sample_rate: float = 1.0,
        margin: Margin | None = None,
        filter_threshold: float | None = None,
        group=None,
        batch_group=None,
        device=None,
        seed: int = 0,
        optimizer: str | RowOptimizer = "sgd",
        compute_dtype: torch.dtype | None = None,
        init_std: float = 0.01,
        dtype: torch.dtype = torch.float32,
        data_parallel_grad: bool = True,
        bank: Callable[[int, torch.device], ClassBank] | None = None,
        block_bytes: int | None = None,
        backend: str = "auto",
        validate: bool | str = True,
        sub_centers: int = 1,
        keep_bytes: int | None = None,
        **optimizer_kwargs,
    ):
        super().__init__()
        self.group = group
        self.world_size = collectives.world_size(group)
        self.rank = collectives.rank(group)
        self.device = torch.device("cpu")
        try:
            self.device = head_device(device, group)
            margin, row_optimizer = _checked_arguments(
                num_classes, embedding_size, sample_rate, margin, filter_threshold, seed, compute_dtype, dtype,
                optimizer, optimizer_kwargs, block_bytes, backend, self.device)
            if isinstance(sub_centers, bool) or not isinstance(sub_centers, int) or sub_centers < 1:
                raise ValueError(f"sub_centers must be a positive int, got {sub_centers!r}")
            check_keep_bytes(keep_bytes)
            validate = _checked_validate(validate)
            if sub_centers > 1 and backend == "triton":
                raise ValueError("backend='triton' does not implement sub-centers; use backend='torch' or 'auto'")
            _check_tensor_constructors(dtype)
            error = None
        except (TypeError, ValueError, RuntimeError) as err:   # RuntimeError: torch.device("bogus")
            error = err
        # Every rank takes part in the agreement check even when its own arguments are
        # bad, so that one rank's error never leaves the others waiting in a collective.
        self._check_agreement(error, num_classes, embedding_size, sample_rate, seed, filter_threshold, margin,
                              sub_centers)
        # Two groups: the layout of the samples over the class group (a collective).
        self.batch_group = group if batch_group is None else batch_group
        self._layout = None
        if batch_group is not None and batch_group is not group:
            self._layout = collectives.batch_layout(group, batch_group, collective_device(group, self.device))
        self.batch_world_size = self.world_size if self._layout is None else self._layout.batch_world
        self.batch_rank = self.rank if self._layout is None else self._layout.batch_rank

        if self.device.type == "cpu" and compute_dtype in (torch.bfloat16, torch.float16) \
                and cpu_native_half(compute_dtype) is False:
            warnings.warn(f"compute_dtype={compute_dtype} on a CPU without {compute_dtype} instructions: torch "
                          f"emulates these products, tens of times slower than float32; pass "
                          f"compute_dtype=torch.float32 (the default off CUDA)", stacklevel=2)
        self.num_classes, self.embedding_size = num_classes, embedding_size
        self.sample_rate = float(sample_rate)
        self.margin, self.filter_threshold = margin, filter_threshold
        self.compute_dtype, self.dtype, self.init_std = compute_dtype, dtype, init_std
        self.data_parallel_grad = bool(data_parallel_grad)
        # True, False or "deferred" ("immediate" is True).
        self.block_bytes, self.backend, self.validate = block_bytes, backend, validate
        # validate="deferred": (LateRead of a probe table, what, names, forward it checks, peers) per check
        # not judged yet, oldest first.
        self._late: list[tuple] = []
        self.keep_bytes = keep_bytes
        # Set by PfcEngine under loss scaling: a non-finite center gradient makes the
        # embedding gradient NaN, so the engine's overflow check skips the step.
        self.guard_nonfinite = False
        # Set by PfcEngine: called by each training forward, returns a hook for the
        # centers' gradient (or None); see PfcEngine._center_grad_hook.
        self.center_grad_hook = None
        # Whether the row optimizer may take the centers' gradient through the normalisation
        # (see _projects_in_step, the rule); False always projects in the backward.
        self.fuse_projection = True
        self._unprojected: bool | None = None   # how the pending gradients were formed
        self.optimizer = row_optimizer
        self.partition = Partition(num_classes, self.world_size)
        self.class_start, self.class_end = self.partition.bounds(self.rank)
        self.num_local = self.class_end - self.class_start
        self.sub_centers = sub_centers
        self.num_rows = self.num_local * sub_centers      # bank rows: K per class

        self.seed = seed
        self._step_t = torch.zeros((), dtype=torch.int64, device=self.device)   # the sampler's step, on the device
        self.sample_step = 0   # forward passes taken in training mode: drives the sampler
        self.step_count = 0    # optimizer steps taken
        self._pending: list[tuple] = []   # (active rows, staged centers leaf, slot or None)
        # Device bank: the summed gradient of the micro steps already back-propagated,
        # (rows or None, grad); their staged centers are released (one accumulator).
        self._acc: tuple | None = None
        # Loss scaling: whether the gradients pending since the last step are finite, ANDed in by
        # each backward without a host sync (None: no verdict yet), and whether every pending
        # forward passed it (else pending_grads_finite reads the gradients themselves).
        self._finite: torch.Tensor | None = None
        self._finite_complete = True
        self._last_traffic: dict = {}

        factory = bank or DeviceBank
        owner = {"owner": f"rank{_global_rank()}"} if getattr(factory, "takes_owner", False) else {}
        # Bank rows are numbered like the global rows c K + k, so the initial centers (a
        # function of the seed and the global row) do not depend on the world size.
        start = self.class_start * sub_centers
        self.bank = factory(self.num_rows, self.device, class_start=start, **owner)
        specs = [(name, embedding_size if width == "d" else width, dtype if state_dtype == torch.float32
                  else state_dtype) for name, width, state_dtype in row_optimizer.state_specs]
        if isinstance(self.bank, TieredBank):
            self.bank.row_codec = _row_codec(self.bank)
        self.bank.add_state("weight", embedding_size, dtype, init=lambda lo, hi: initial_centers(
            seed, start + lo, hi - lo, embedding_size, init_std, device=self.device))
        for name, width, state_dtype in specs:
            self.bank.add_state(name, width, state_dtype)
        # Tiered banks stage rows into slots and can prefetch the next step's rows.
        self._stager = None
        if isinstance(self.bank, TieredBank):
            self.bank.check_placements()
            self._stager = (MappedStager(self.bank, mover=_row_mover(self.bank)) if self.bank.mapped
                            else StagedStager(self.bank))
        self._closed = False
        self._lookahead = None   # (sample_step, gathered labels, active set, its bank rows) of the last prefetch

    def _check_agreement(self, error, num_classes, embedding_size, sample_rate, seed, filter_threshold, margin,
                         sub_centers):
        if error is None:
            key = zlib.crc32(margin.key().encode())       # type and every hyper-parameter
            row = [1.0, num_classes, embedding_size, sample_rate, seed >> 32, seed & 0xFFFFFFFF,
                   -2.0 if filter_threshold is None else filter_threshold,
                   margin.scale, key >> 16, key & 0xFFFF, sub_centers, 0.0]
        else:
            row = [0.0] + [float("nan")] * 11
        table = collectives.all_gather_scalars(row, self.group, device=collective_device(self.group, self.device))
        if error is not None:
            raise error
        failed = [q for q, ok in enumerate(table[:, 0].tolist()) if ok != 1.0]
        if failed:
            raise ValueError(f"ranks {failed} of the group rejected their PartialFC arguments (see their errors)")
        names = ("num_classes", "embedding_size", "sample_rate", "seed", "seed", "filter_threshold",
                 "margin", "margin", "margin", "sub_centers", "margin")
        for col, name in enumerate(names, start=1):
            values = table[:, col].tolist()
            if any(v != values[0] for v in values):
                shown = {"num_classes": num_classes, "embedding_size": embedding_size, "sample_rate": sample_rate,
                         "seed": seed, "filter_threshold": filter_threshold, "margin": margin,
                         "sub_centers": sub_centers}[name]
                raise ValueError(f"{name} differs between ranks of the group (this rank {self.rank} has "
                                 f"{shown!r}; column values {values}); every rank must construct the head "
                                 "with the same value")

    @property
    def product_dtype(self) -> torch.dtype:
        """The dtype of the head's matrix products as they run on this rank's device:
        ``compute_dtype``, or for ``None`` the device's default (bf16 on CUDA from
        Ampere on, fp16 on Volta/Turing, else the float32 accumulation dtype)."""
        if self.compute_dtype is not None:
            return self.compute_dtype
        acc = torch.float64 if self.dtype == torch.float64 else torch.float32
        return default_compute_dtype(self.device, acc)

    def extra_repr(self) -> str:
        return (f"num_classes={self.num_classes}, embedding_size={self.embedding_size}, "
                f"sample_rate={self.sample_rate}, margin={self.margin}, "
                + (f"sub_centers={self.sub_centers}, " if self.sub_centers > 1 else "")
                + f"filter_threshold={self.filter_threshold}, classes=[{self.class_start}, {self.class_end}) "
                f"of rank {self.rank}/{self.world_size}, optimizer={self.optimizer}")

    # ------------------------------------------------------------------ forward
    def _rows(self, active: torch.Tensor | None) -> torch.Tensor:
        """Bank rows of the active local classes (None: all): ``K`` per class."""
        if active is None:
            return torch.arange(self.num_rows, device=self.device)
        if self.sub_centers == 1:
            return active
        k = self.sub_centers
        return (active[:, None] * k + torch.arange(k, device=active.device)).reshape(-1)

    def active_set(self, local_labels: torch.Tensor, sample_step: int | None = None) -> torch.Tensor | None:
        """Sorted active local ids for gathered local labels (-1: another rank's; None:
        every class). ``sample_step`` None: the head's own step counter, read on the
        device (no host sync; a CUDA graph replay draws the next step's set)."""
        if self.sample_rate >= 1.0:
            return None
        step = self._step_t if sample_step is None else sample_step
        return sample_active(local_labels, self.num_local, self.sample_rate,
                             seed=self.seed, step=step, rank=self.rank)

    @property
    def sample_step(self) -> int:
        """Training forwards taken so far: the sampler draws step ``sample_step``'s set
        next. A replayed CUDA graph advances the sampler's counter on the device only
        (no Python runs): after replays, assign the true count before saving."""
        return self._sample_step

    @sample_step.setter
    def sample_step(self, value: int) -> None:
        self._sample_step = int(value)
        # The sampler reads the step from the device, so a captured step can advance it.
        self._step_t.fill_(self._sample_step)

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor, *, return_details: bool = False):
        """Mean margin-softmax loss over the global batch (same value on every rank).

        Host syncs (device bank): with ``validate=False`` none, at any sample rate and
        world size, when ``floor(sample_rate * C_q) >= N`` (the gathered batch; below
        that a step's positives may outnumber the budget and the sampler reads their
        count back); the ranks must then pass batches of one size. With
        ``validate=True``, one: every rank's checks and batch size in one small table.
        With ``validate="deferred"`` a training forward has none either: its table is
        copied to the host behind an event and judged at the start of the next forward
        (the checks of the previous step, which raise here, naming that step).
        """
        self._check_open()
        self._judge_late()
        try:
            check_embeddings(embeddings, self.embedding_size)
            check_labels(labels, embeddings.shape[0])
            for name, t in (("embeddings", embeddings), ("labels", labels)):
                if t.device != self.device:
                    raise ValueError(f"{name} must be on the head's device {self.device}, got {t.device}")
            error = None
        except (TypeError, ValueError) as err:
            error = err
        training = self.training and torch.is_grad_enabled()
        if training and _in_backward():
            # Every rank recomputes, so every rank raises here, before any collective.
            raise RuntimeError(
                "PartialFC's training forward ran again inside a backward pass (activation checkpointing "
                "around the head: torch.utils.checkpoint or deepspeed.checkpointing): the recomputation would "
                "sample another active class set and update stateful margins twice. Checkpoint the backbone "
                "blocks, not the head")
        # Every rank joins the checks' collective even with bad input, so none is left waiting.
        sizes = self._batch_sizes(embeddings, labels, error, "embeddings/labels", late=training)
        x, y = self._gather(embeddings, labels, sizes)
        if training and self.validate == "deferred":
            y = self._in_range(y)
        local = self.partition.to_local(y, self.rank)
        lookahead, self._lookahead = self._lookahead, None
        rows = None
        if training and lookahead is not None and lookahead[0] == self.sample_step and torch.equal(lookahead[1], y):
            active, rows = lookahead[2], lookahead[3]   # prefetch sampled this step's set already
        else:
            active = self.active_set(local)
        target_col = local if active is None else remap_labels(local, active)
        slot = None
        bank_rows = active if active is None or self.sub_centers == 1 else self._rows(active)
        unprojected, hook = False, None
        if training:
            # Asked once per training forward: the hook (or None) for the centers' gradient.
            hook = self.center_grad_hook() if self.center_grad_hook is not None else None
            unprojected = self._projects_in_step(hook)
        source = None
        if self._stager is None:
            source = self._indexed_centers(bank_rows, x.dtype, training, unprojected)
            if source is not None:
                # Shape only: the softmax reads the rows from the bank's table by index.
                count = self.num_rows if bank_rows is None else bank_rows.shape[0]
                centers = torch.empty((), dtype=self.dtype, device=self.device).expand(count, self.embedding_size)
            else:
                centers = self.bank.read("weight", bank_rows).detach()
        else:
            rows = self._rows(active) if rows is None else rows     # the prefetched slot's own rows
            live = [p[2] for p in self._pending]
            if training:
                slot = self._stager.take(rows, self.sample_step, live)
            slot = slot or self._stager.stage(rows, pooled=training)
            centers = slot.states["weight"].detach()
        if training:
            centers.requires_grad_(True)
            if hook is not None:
                centers.register_hook(hook)
        # With validate=True every rank's labels were checked to lie in [0, C), so each
        # has exactly one owner: the softmax's ownership check stays on the device.
        result = margin_softmax_cross_entropy(
            x, centers, target_col, self.margin, filter_threshold=self.filter_threshold,
            group=self.group, compute_dtype=self.compute_dtype, return_correct=return_details,
            block_bytes=self.block_bytes, backend=self.backend, validate=False,
            guard_nonfinite=training and self.guard_nonfinite, update_state=training, sub_centers=self.sub_centers,
            keep_bytes=self.keep_bytes, project_w_grad=not unprojected, w_source=source,
            grad_finite=self._finite_verdict(x.device, hook) if training else None)
        if training:
            self._unprojected = unprojected
            self._fold_finished()
            self._pending.append((bank_rows, centers, slot))
            self._step_t.add_(1)            # on the device too: a captured step advances it on replay
            self._sample_step += 1
        if not return_details:
            return result.loss
        offset = sum(sizes[: self.batch_rank])
        return CrossEntropyOutput(result.loss, result.per_sample[offset: offset + sizes[self.batch_rank]],
                                  result.correct.mean())

    def _in_range(self, y: torch.Tensor) -> torch.Tensor:
        """``validate="deferred"``: labels outside ``[0, C)`` become ``label mod C`` (one op
        on the device), so that the step runs to its end (no device assert ends the CUDA
        context) and the check a step later gives the readable error."""
        return y.remainder(self.num_classes)

    def _batch_sizes(self, embeddings, labels, error, what, label_name="labels", late=False) -> list[int]:
        """Rows per batch rank, after the input checks, in one host sync at most.

        ``validate=True``: every rank's probe row (:func:`~ds_pfc._checks.batch_probe`:
        size, NaN/Inf, label range, label hash) is all-gathered over the class group and
        read back with one ``.tolist()``; every rank raises together on bad input, and
        uneven batches are allowed (padded in the gather). ``validate=False``: the local
        size is everyone's size, asserted on the device (no host sync).
        ``validate="deferred"`` and ``late``: the probe table is gathered as with
        ``validate=True`` but read a step late (:meth:`_judge_late`); the local size is
        everyone's, asserted on the device."""
        if self.validate == "deferred" and late:
            kind = "prefetch" if label_name == "next_labels" else "batch"
            return self._late_probe(embeddings, labels, error, what, ("embeddings", label_name), kind)
        if not self.validate:
            device = collective_device(self.group, self.device)
            if error is not None:
                if self.world_size > 1:      # join the sizes' all-gather with size -1: the others' assert fails
                    collectives.all_gather_row(torch.full((1,), -1, dtype=torch.int64, device=device), self.group)
                raise error
            n = labels.shape[0]
            if self.world_size > 1:
                collectives.assert_equal_sizes(n, self.group, device, what)
            return [n] * self.batch_world_size
        device = collective_device(self.group, self.device)
        table = collectives.all_gather_row(batch_probe(embeddings, labels, error, device), self.group).tolist()
        check_batch_table(table, self.rank, error, self.num_classes, what, names=("embeddings", label_name))
        if self._layout is None:
            return [row[0] for row in table]
        return check_peers(table, self._layout.positions, self._layout.batch_world, what)

    def _late_probe(self, embeddings, labels, error, what, names, kind) -> list[int]:
        """The probe table of ``validate="deferred"``: gathered now, judged a step late."""
        device = collective_device(self.group, self.device)
        if error is not None:
            if self.world_size > 1:      # join the all-gather with size -1: the others' size assert fails
                row = torch.zeros(len(PROBE_FIELDS), dtype=torch.int64, device=device)
                row[0] = -1
                collectives.all_gather_row(row, self.group)
            raise error
        n = labels.shape[0]
        table = collectives.all_gather_row(batch_probe(embeddings, labels, None, device), self.group)
        if self.world_size > 1:
            torch._assert_async((table[:, 0] == n).all(),
                                f"{what}: the ranks passed batches of different sizes; validate='deferred' needs "
                                "equal batch sizes on every rank (validate=True pads uneven batches)")
        self._late.append((LateRead(table), what, names, self.sample_step, kind, self.rank))
        return [n] * self.batch_world_size

    def _judge_late(self) -> None:
        """Judge the checks ``validate="deferred"`` put off (oldest first), raising the
        error the immediate check would have raised, naming the forward it belongs to."""
        late, self._late = self._late, []
        for read, what, names, forward, kind, me in late:
            table = read.values()
            try:
                check_batch_table(table, me, None, self.num_classes, what, names=names)
                if self._layout is not None and len(table) == self.world_size:
                    check_peers(table, self._layout.positions, self._layout.batch_world, what)
            except ValueError as err:
                if kind == "prefetch":      # judged before the forward that would use them
                    where = (f"checked at the next forward, validate='deferred': the next_labels of the prefetch "
                             f"for training forward {forward} (sample_step {forward}), which has not run")
                else:
                    where = (f"checked one step late, validate='deferred': the batch of training forward "
                             f"{forward} (sample_step {forward}), whose update may already have been applied; "
                             "resume from a checkpoint, or pass validate=True to check before anything changes")
                raise type(err)(f"{err} ({where})") from None

    def check_deferred(self) -> None:
        """``validate="deferred"``: judge now the checks not judged yet (the last
        training forward's, a prefetch's), raising their error; nothing otherwise.
        Called by :meth:`flush`, :meth:`training_state` and a state dict, so that no
        checkpoint is written over a step whose input was bad. Waits for that step's
        small copy to reach the host (one host sync when something is pending)."""
        self._judge_late()

    def _gather(self, embeddings, labels, sizes):
        """The global batch ``(x, y)``; the gradient path scales for data-parallel
        averaging and sums over the class group."""
        if sum(sizes) == 0:
            raise ValueError("embeddings: the global batch is empty (every rank passed 0 rows)")
        if self.data_parallel_grad and self.batch_world_size > 1:
            embeddings = _ScaleGrad.apply(embeddings, float(self.batch_world_size))
        # int64 before any collective: NCCL has no int16, and every rank must agree on one dtype.
        if self._layout is None:
            x, y, _ = collectives.all_gather_batch(embeddings, labels.long(), self.group, sizes)
        else:
            x, y, _ = collectives.all_gather_batch_2d(embeddings, labels.long(), self._layout, sizes)
        return x, y

    def prefetch(self, next_labels: torch.Tensor) -> None:
        """Lookahead: this rank's labels of the *next* training forward.

        A collective over the head's group (every rank calls it at the same point,
        e.g. right after ``loss.backward()`` or while the backbone runs). With a
        tiered bank the next active set is computed now and its rows are staged in
        the background, stale-free (see :mod:`ds_pfc.bank.slots`); the next forward
        must then use exactly these labels or the prefetch is discarded. With the
        device bank there is nothing to stage and this returns at once.
        ``validate="deferred"``: ``next_labels`` are checked at the next forward,
        before it changes anything (no host sync here).
        """
        self._check_open()
        try:
            if not isinstance(next_labels, torch.Tensor):
                raise TypeError(f"next_labels must be a torch.Tensor, got {type(next_labels).__name__}")
            if next_labels.dim() != 1:
                raise ValueError(f"next_labels must be a 1-d tensor of global class ids, got shape "
                                 f"{tuple(next_labels.shape)}")
            check_labels(next_labels, next_labels.shape[0], name="next_labels")
            if next_labels.device != self.device:
                raise ValueError(f"next_labels must be on the head's device {self.device}, got {next_labels.device}")
            error = None
        except (TypeError, ValueError) as err:
            error = err
        if self._stager is None:        # nothing to stage: no collective either
            if error is not None:
                raise error
            if self.validate == "deferred" and next_labels.numel():   # judged at the next forward
                row = batch_probe(None, next_labels, None, next_labels.device)
                self._late.append((LateRead(row.reshape(1, -1)), "next_labels", ("embeddings", "next_labels"),
                                   self.sample_step, "prefetch", 0))
            elif self.validate and next_labels.numel():       # one host sync
                low, high = torch.stack([next_labels.min(), next_labels.max()]).tolist()
                if low < 0 or high >= self.num_classes:
                    raise ValueError(f"next_labels must lie in [0, {self.num_classes}), got values in "
                                     f"[{low}, {high}]")
            return
        # The checks and sizes as in forward: one host sync with validate, none without.
        sizes = self._batch_sizes(None, next_labels, error, "next_labels", label_name="next_labels", late=True)
        group = self.group if self._layout is None else self._layout.batch_group
        y = collectives.all_gather_rows(next_labels.long(), group, sizes)
        if self.validate == "deferred":
            y = self._in_range(y)           # as the forward will see them
        local = self.partition.to_local(y, self.rank)
        active = self.active_set(local)
        rows = self._rows(active)
        self._lookahead = (self.sample_step, y, active, rows)
        self._stager.prefetch(rows, self.sample_step, [p[2] for p in self._pending])

    # ------------------------------------------------------------------ update
    def _projects_in_step(self, hook) -> bool:
        """The rule, decided per training forward: the centers' gradient is left as the
        gradient of the normalised centers and the row optimizer takes it through the
        normalisation inside its update (one pass over the rows fewer: the fused kernel
        reads weight and gradient anyway) exactly when

        * ``fuse_projection`` is True (the default),
        * no hook reads the centers' gradient (``center_grad_hook`` gave none), and
        * the optimizer is ds_pfc's own (a :class:`RowOptimizer` whose ``update`` is the base
          class's, which projects on both of its paths).

        Exact because the projection is linear in the gradient and the centers do not change
        between backward and step: the sum over micro steps, the ``grad_scale`` division and
        the finiteness check commute with it. Only the gradient left on the staged centers
        differs (unprojected), which is why a hook turns it off. The micro steps of one
        optimizer step must agree."""
        fused = self.fuse_projection and hook is None and isinstance(self.optimizer, RowOptimizer) \
            and type(self.optimizer).update is RowOptimizer.update
        pending = self._unprojected if (self._pending or self._acc is not None) else None
        if pending is not None and pending != fused:
            raise RuntimeError("the micro steps of one optimizer step disagree on whether the centers' gradient is "
                               "projected in the backward (a center_grad_hook or fuse_projection changed between "
                               "them); step or zero_grad first")
        return fused

    def _projection_kwargs(self) -> dict:
        # Only ds_pfc's own update() takes ``project`` (an optimizer that overrides update
        # never gets unprojected gradients: see _projects_in_step).
        return {"project": True} if self._unprojected else {}

    def _indexed_centers(self, bank_rows, x_dtype, training: bool, unprojected: bool):
        """``(table, rows)`` when the softmax can read this step's centers from the bank's
        weight table by index instead of from a gathered ``[S, d]`` copy, else None: the triton
        backend without sub-centers on an in-memory bank (its ``prepare`` reads the rows by index),
        and for training only where nothing reads the staged values afterwards (the projection
        is in the step, ``_projects_in_step``)."""
        if self.sub_centers != 1 or not hasattr(self.bank, "state_tensors") or \
                self.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return None
        acc = torch.float64 if x_dtype == torch.float64 else torch.float32     # as the softmax decides
        compute = self.compute_dtype or default_compute_dtype(self.device, acc)
        if resolve_backend(self.backend, self.device, compute, acc, self.margin) != "triton":
            return None
        if training and not unprojected:
            return None
        return self.bank.state_tensors()["weight"], bank_rows

    @torch.no_grad()
    def step(self, lr: float, *, grad_scale: float = 1.0) -> int:
        """Apply the row optimizer to the union of the rows activated since the last
        step, with the gradients accumulated over those forward/backward passes.

        ``grad_scale``: the factor the loss was multiplied by before ``backward``
        (an fp16 loss scale); the gradients are divided by it before the update.
        Returns the number of rows updated."""
        self._check_open()
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr < 0:
            raise ValueError(f"lr must be a finite number >= 0, got {lr!r}")
        if isinstance(grad_scale, bool) or not isinstance(grad_scale, (int, float)) or \
                not math.isfinite(grad_scale) or grad_scale <= 0:
            raise ValueError(f"grad_scale must be a finite number > 0, got {grad_scale!r}")
        if grad_scale != 1.0:
            for _, c, _ in self._pending:
                if c.grad is not None:
                    c.grad.div_(grad_scale)
            if self._acc is not None:
                self._acc[1].div_(grad_scale)
        if self._stager is not None:
            return self._step_slots(float(lr))
        pending = ([(self._acc[0], self._acc[1], None)] if self._acc is not None else []) + \
            [(rows, c.grad, c) for rows, c, _ in self._pending if c.grad is not None]
        self._pending, self._acc = [], None
        self._forget_finite()
        if not pending:
            return 0
        staged = None
        if len(pending) == 1:
            rows, grad, staged = pending[0]
            # The staged rows still hold the bank's values: nothing wrote them since (unless
            # they were only a shape: the softmax read the bank by index).
            staged = None if staged is None or staged.stride(0) == 0 else staged.detach()
        else:
            rows, grad = self._combine([(r, g) for r, g, _ in pending])
        self.optimizer.update(self.bank, rows, grad.to(self.dtype), float(lr), staged_weight=staged,
                              block_bytes=self.block_bytes, **self._projection_kwargs())
        self.step_count += 1
        return self.num_rows if rows is None else rows.numel()

    def _combine(self, parts: list[tuple]) -> tuple:
        """``(rows, grad)`` summing ``(rows or None for all rows, grad)`` parts in order."""
        if any(r is None for r, _ in parts):
            grad = torch.zeros(self.num_rows, self.embedding_size, dtype=self.dtype, device=self.device)
            for r, g in parts:
                grad.add_(g) if r is None else grad.index_add_(0, r, g)
            return None, grad
        rows = torch.unique(torch.cat([r for r, _ in parts]))
        grad = torch.zeros(rows.numel(), self.embedding_size, dtype=self.dtype, device=self.device)
        for r, g in parts:
            grad.index_add_(0, torch.searchsorted(rows, r), g)
        return rows, grad

    def _fold_finished(self) -> None:
        """Device bank, gradient accumulation: sum the gradients of the micro steps that
        were back-propagated into one accumulator and drop their staged centers, so
        memory holds one gradient, not one staged copy and gradient per micro step."""
        if self._stager is not None:
            return
        done = [(rows, c.grad) for rows, c, _ in self._pending if c.grad is not None]
        if not done:
            return
        self._pending = [p for p in self._pending if p[1].grad is None]
        parts = ([self._acc] if self._acc is not None else []) + done
        self._acc = parts[0] if len(parts) == 1 else self._combine(parts)

    def _step_slots(self, lr: float) -> int:
        pending = [(c.grad, slot) for _, c, slot in self._pending if c.grad is not None]
        self._pending = []
        self._forget_finite()
        if not pending:
            return 0
        if len(pending) == 1:
            grad, slot = pending[0]
        else:
            slot, inverse = merge_slots([s for _, s in pending])
            for _, s in pending:        # their rows now live in the merged slot
                self._stager.release(s)
            grad = torch.zeros(slot.rows.numel(), self.embedding_size, dtype=self.dtype, device=self.device)
            offset = 0
            for g, s in pending:       # in order, as the device path accumulates
                grad.index_add_(0, inverse[offset: offset + g.shape[0]], g)
                offset += g.shape[0]
        self.optimizer.update(SlotBank(slot), None, grad.to(self.dtype), lr, block_bytes=self.block_bytes,
                              **self._projection_kwargs())
        self._stager.after_step(slot)
        self.step_count += 1
        self._last_traffic = self.bank.take_traffic()      # no host sync: read when asked for
        return slot.rows.numel()

    @property
    def last_step_traffic(self) -> dict[str, int]:
        """Bytes the bank was asked to move between the previous step and the last one:
        ``staged_in`` (rows staged in, including a prefetch issued in that interval) and
        ``written_back`` (the last step's write-back). Reading it may wait for the device
        (with mapped host access the cold rows are counted there)."""
        return {k: int(v) for k, v in self._last_traffic.items()}

    def memory_report(self) -> dict:
        """Bytes of head state resident per tier, and the bytes the bank was asked to
        move between the previous step and the last one (rows staged in, including
        a prefetch issued in that interval, and the last step's write-back)."""
        resident = dict(self.bank.resident_bytes())
        staged = sum(t.numel() * t.element_size() for _, _, slot in self._pending if slot is not None
                     for t in slot.states.values())
        resident["staged"] = staged
        return {"resident": resident, "last_step": dict(self.last_step_traffic)}

    def flush(self) -> None:
        """Judge the deferred checks (:meth:`check_deferred`), then wait until every
        write-back has landed in the bank (and on disk)."""
        self._judge_late()
        self._drain()

    def _drain(self) -> None:
        if self._stager is not None and not self._closed:
            self._stager.drain()
            self.bank.flush()

    def close(self) -> None:
        """Finish write-backs and release the bank.
        The head cannot train afterwards."""
        if self._stager is not None and not self._closed:
            try:
                self._stager.close()
            finally:
                self.bank.close()
        self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this PartialFC is closed; build a new one and load its checkpoint")

    def _finite_verdict(self, device: torch.device, hook) -> torch.Tensor | None:
        """The tensor a training forward's backward ANDs its gradient's finiteness into, under
        loss scaling (``guard_nonfinite``) and where no hook may change that gradient afterwards;
        else None, and :meth:`pending_grads_finite` reads the gradients instead."""
        if not self.guard_nonfinite or hook is not None:
            self._finite_complete = False
            return None
        if self._finite is None:
            self._finite = torch.ones((), dtype=torch.bool, device=device)
        return self._finite

    def _forget_finite(self) -> None:
        self._finite, self._finite_complete = None, True

    def pending_grads_finite(self) -> torch.Tensor:
        """A 0-d bool tensor on the head's device: every gradient accumulated since the
        last step is finite (no host sync). Under loss scaling the backward of each step
        has already decided it (on the exp-kept path from N-sized values, see
        :func:`ds_pfc.core.softmax.margin_softmax_cross_entropy`'s ``grad_finite``): no pass
        over the gradients here."""
        if self._finite is not None and self._finite_complete:
            return self._finite.clone()
        grads = [c.grad for _, c, _ in self._pending if c.grad is not None]
        if self._acc is not None:
            grads.append(self._acc[1])
        ok = torch.ones((), dtype=torch.bool, device=self.device)
        for g in grads:
            ok = ok & torch.isfinite(g).all()
        return ok

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget the gradients accumulated since the last step."""
        self._pending, self._acc = [], None
        self._forget_finite()
        if self._stager is not None:
            self._stager.discard()
        super().zero_grad(set_to_none)

    # ------------------------------------------------------------------ state
    def centers(self) -> torch.Tensor:
        """This rank's shard ``[C_q K, d]`` (a copy), row ``i K + k`` = sub-center k of
        global class ``class_start + i`` (``K = sub_centers``, 1 by default)."""
        self._drain()
        return self.bank.export("weight")

    def load_centers(self, centers: torch.Tensor) -> None:
        """Replace this rank's shard; optimizer state is kept."""
        check_embeddings(centers, self.embedding_size, name="centers")
        self._late = []             # the state they concern is replaced
        if centers.shape[0] != self.num_rows:
            raise ValueError(f"centers must have shape [{self.num_rows}, {self.embedding_size}] "
                             f"(classes [{self.class_start}, {self.class_end})), got {tuple(centers.shape)}")
        if not bool(torch.isfinite(centers).all()):
            raise ValueError("centers contain NaN or Inf values")
        self.flush()
        self._drop_staged()
        self.bank.load("weight", centers.to(device=self.device, dtype=self.dtype))

    def _drop_staged(self) -> None:
        """Forget staged and prefetched rows: the bank is about to be replaced."""
        self._pending, self._acc = [], None
        self._forget_finite()
        self._lookahead = None
        if self._stager is not None:
            self._stager.discard()

    def resident_bytes(self) -> dict[str, int]:
        """Bytes of head state per tier (the bank's report)."""
        return self.bank.resident_bytes()

    def training_state(self) -> dict:
        """Everything but the bank: class range, sampler state, step counters and the
        margin's running state (``margin_state``).

        The bank's rows are saved apart, as streamed shards (:mod:`ds_pfc.checkpoint`)."""
        self._judge_late()
        state = dict(zip(self._META_FIELDS, self._meta().tolist()))
        state["margin_state"] = self.margin.state_dict()
        return state

    def load_training_state(self, state: dict) -> None:
        """Restore :meth:`training_state` (checked against this head's class range)."""
        for key in ("num_classes", "embedding_size", "class_start", "num_local"):
            if state.get(key) != getattr(self, key):
                raise ValueError(f"state is for {key}={state.get(key)} but this head has {key}={getattr(self, key)}")
        if int(state.get("sub_centers", 1)) != self.sub_centers:
            raise ValueError(f"state is for sub_centers={state.get('sub_centers', 1)} but this head has "
                             f"sub_centers={self.sub_centers}")
        if "margin_state" in state:
            self.margin.load_state_dict(dict(state["margin_state"]))
        self._late = []             # the state they concern is replaced
        self.flush()
        self._drop_staged()
        self.seed, self.sample_step, self.step_count = int(state["seed"]), int(state["sample_step"]), \
            int(state["step_count"])

    def _meta(self) -> torch.Tensor:
        return torch.tensor([self.num_classes, self.embedding_size, self.class_start, self.num_local,
                             self.world_size, self.seed, self.sample_step, self.step_count, self.sub_centers],
                            dtype=torch.int64)

    _META_FIELDS = ("num_classes", "embedding_size", "class_start", "num_local", "world_size", "seed",
                    "sample_step", "step_count", "sub_centers")

    def margin_state_tensor(self, state: dict | None = None) -> torch.Tensor:
        """The margin's running state (``state``, else the current one) as float64
        ``[n]`` in sorted key order: how ``state_dict()`` stores it."""
        state = self.margin.state_dict() if state is None else state
        return torch.tensor([float(state[k]) for k in sorted(state)], dtype=torch.float64)

    def _margin_state_from(self, t: torch.Tensor) -> dict:
        keys = sorted(self.margin.state_dict())
        if t.dim() != 1 or t.numel() != len(keys):
            raise ValueError(f"margin_state must hold {len(keys)} values ({keys}) for {self.margin}, got shape "
                             f"{tuple(t.shape)}")
        return dict(zip(keys, t.tolist()))

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        self.flush()
        destination[prefix + "meta"] = self._meta()
        if self.margin.state_dict():       # stateful margins only
            destination[prefix + "margin_state"] = self.margin_state_tensor()
        for name in self.bank.state_names():
            destination[prefix + name] = self.bank.export(name)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        names = ["meta"] + self.bank.state_names()
        absent = [prefix + n for n in names if prefix + n not in state_dict]
        names.append("margin_state")      # optional: absent from checkpoints of stateless margins before it
        if absent:
            raise ValueError(f"state_dict is missing {absent} for this PartialFC")
        # Keys of another optimizer's state would otherwise be dropped silently.
        extra = [k for k in state_dict if k.startswith(prefix) and "." not in k[len(prefix):]
                 and k[len(prefix):] not in names]
        if extra and strict:
            raise ValueError(f"state_dict has {extra}, which this PartialFC (optimizer {self.optimizer}) "
                             f"does not hold; it holds {names}")
        meta = dict(zip(self._META_FIELDS, state_dict[prefix + "meta"].tolist()))
        meta.setdefault("sub_centers", 1)           # meta of 8 fields: written before sub-centers
        margin_state = None
        if prefix + "margin_state" in state_dict:
            margin_state = self._margin_state_from(state_dict[prefix + "margin_state"])
        for key in ("num_classes", "embedding_size", "class_start", "num_local", "sub_centers"):
            if meta[key] != getattr(self, key):
                raise ValueError(
                    f"state_dict is for {key}={meta[key]} but this head has {key}={getattr(self, key)} "
                    f"(checkpoint classes [{meta['class_start']}, {meta['class_start'] + meta['num_local']}) of "
                    f"C={meta['num_classes']}, d={meta['embedding_size']}); reshard it for this world size")
        tensors = {n: state_dict[prefix + n] for n in self.bank.state_names()}
        for name, t in tensors.items():
            expected = tuple(self.bank.read(name, torch.zeros(0, dtype=torch.long, device=self.device)).shape[1:])
            if tuple(t.shape) != (self.num_rows,) + expected:
                raise ValueError(f"state_dict[{prefix + name!r}] must have shape "
                                 f"{(self.num_rows,) + expected}, got {tuple(t.shape)}")
        if margin_state is not None:
            self.margin.load_state_dict(margin_state)
        self._late = []             # the state they concern is replaced
        self.flush()
        self._drop_staged()
        for name, t in tensors.items():       # in row blocks: never a whole state on the device
            row_bytes = max(1, t[:1].numel() * t.element_size())
            step = max(1, LOAD_CHUNK_BYTES // row_bytes)
            for lo in range(0, t.shape[0], step):
                self.bank.load_rows(name, lo, t[lo:lo + step])
        self.seed, self.sample_step, self.step_count = meta["seed"], meta["sample_step"], meta["step_count"]


def _row_mover(bank):
    """The row-move kernel for a bank with mapped access: Triton's on CUDA (and on CPU
    tensors under ``TRITON_INTERPRET=1``) when every slot state is float32 or an integer
    (the kernel narrows to bfloat16 from float32 only); None otherwise (the bank's torch
    ops)."""
    from ..kernels import triton_rows
    if not triton_rows.available() or (bank.device.type != "cuda" and not triton_rows._INTERPRET):
        return None
    if {bank._logical[n] for n in bank.state_names()} <= {torch.float32, torch.int32, torch.int64}:
        return triton_rows.move_rows_
    return None


def _row_codec(bank):
    """The kernels that code and decode a bank's 8-bit rows in registers: Triton's on CUDA
    (and on CPU tensors under ``TRITON_INTERPRET=1``); None otherwise (torch ops)."""
    from ..bank.quantized import RowCodec
    from ..kernels import triton_rows
    if not triton_rows.available() or (bank.device.type != "cuda" and not triton_rows._INTERPRET):
        return None
    return RowCodec(triton_rows.decode_rows_, triton_rows.encode_rows_, triton_rows.move_rows_)


def _in_backward() -> bool:
    """Whether this code runs inside an autograd backward pass (where activation
    checkpointing recomputes its forwards)."""
    return torch._C._current_graph_task_id() != -1


def _check_tensor_constructors(dtype: torch.dtype) -> None:
    """Refuse to build a head while ``torch.zeros`` does not return the dtype it is
    asked for: ``deepspeed.zero.Init`` casts every floating tensor created inside it
    to the ZeRO dtype (bf16, fp16), which would put the centers' optimizer state (or,
    with other banks, the centers) in half precision without any error."""
    for make in (torch.zeros, torch.empty, torch.ones):
        got = make(1, dtype=dtype, device="cpu").dtype
        if got != dtype:
            raise RuntimeError(f"PartialFC is being built where torch.{make.__name__}(..., dtype={dtype}) returns "
                               f"{got} (inside deepspeed.zero.Init, which casts new floating tensors to the ZeRO "
                               "dtype): its centers and optimizer state must stay float32. Build the head outside "
                               "deepspeed.zero.Init (e.g. attach it after constructing the model, or declare it "
                               "with ds_pfc.deepspeed_plugin.head_spec)")


def _global_rank() -> int:
    """This process's rank in the default group (0 without torch.distributed): names
    the files a bank keeps per process."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return 0
    return torch.distributed.get_rank()
