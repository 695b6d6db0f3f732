"""Sparse row optimizers: update only the rows a step activated (Eq. pfc_center_update).

Each optimizer reads the active rows of the weight and of its state from the bank,
updates them, and writes them back; rows that were not active, and their state, are
untouched. For every row the update is exactly what the matching ``torch.optim``
optimizer would do to a parameter holding that row alone, stepped only at the steps
where the row was active ("lazy" semantics: no decay or momentum while inactive).
"""
from __future__ import annotations

import inspect
from abc import ABC, abstractmethod

import torch

from .._checks import check_number as _number
from ..bank.base import ClassBank
from .softmax import default_block_bytes

__all__ = ["RowOptimizer", "RowSGD", "RowAdamW", "make_row_optimizer", "project_rows"]

_NORM_EPS = 1e-12


def project_rows(grad: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``grad`` (rows: the gradient of the normalised rows ``w_hat = w / ||w||``) taken through
    the normalisation of ``weight``: ``(g - w_hat <w_hat, g>) / max(||w||, 1e-12)`` per row, in
    ``grad``'s dtype; a new tensor. The same arithmetic as the softmax's own projection."""
    w = weight.to(grad.dtype)
    w_inv = w.norm(dim=1).clamp_min(_NORM_EPS).reciprocal()
    w_hat = w * w_inv[:, None]
    radial = (w_hat * grad).sum(1, keepdim=True)
    return torch.addcmul(grad, w_hat, radial, value=-1.0).mul_(w_inv[:, None])

def _chunks(rows: torch.Tensor | None, num_rows: int, width: int, device, chunk_bytes: int):
    """``(row ids, slice of the gradient)`` per chunk of ``chunk_bytes`` of float32
    rows; ``rows=None`` means all rows."""
    total = num_rows if rows is None else rows.numel()
    step = max(1, chunk_bytes // (4 * max(width, 1)))
    for lo in range(0, total, step):
        hi = min(total, lo + step)
        ids = torch.arange(lo, hi, device=device) if rows is None else rows[lo:hi]
        yield ids, slice(lo, hi)


class RowOptimizer(ABC):
    """Updates rows of the bank's ``"weight"`` given their gradient.

    Two paths with the same per-row semantics: chunks of torch ops on rows read from and
    written to the bank (any bank, any device; bitwise as ``torch.optim`` on CPU), and,
    where the bank exposes its tables in memory (the device bank, a staged slot), a
    fused Triton kernel that reads gradient, weight and state once and writes weight and
    state once (:mod:`ds_pfc.kernels.triton_optim`). ``fused``: None uses the kernel on
    CUDA when triton imports; True insists (on CPU only under ``TRITON_INTERPRET=1``);
    False never uses it.
    """

    #: (state name, width relative to the embedding: "d" for [C, d], 0 for [C], dtype)
    state_specs: tuple = ()
    fused: bool | None = None

    def update(self, bank: ClassBank, rows: torch.Tensor | None, grad: torch.Tensor, lr: float,
               staged_weight: torch.Tensor | None = None, block_bytes: int | None = None,
               project: bool = False) -> None:
        """Apply one step to ``rows`` (``None``: all rows) with gradient ``grad``.

        ``staged_weight``: the current values of those rows when the caller already
        holds them (the forward staged them), which saves reading them again.
        ``block_bytes``: float32 bytes of rows per chunk (None: the device's default,
        cache-sized on CPU; on CUDA 256 MiB, so a step is one pass of a few kernels).
        The result does not depend on the chunking: every operation is per row.
        ``project``: ``grad`` is the gradient of the normalised rows (the softmax left it
        unprojected, ``project_w_grad=False``); each row is first taken through the
        normalisation of its current weight (:func:`project_rows`; inside the fused kernel).
        """
        tables = self._fused_tables(bank, grad)
        if tables is not None:
            self.fused_update(tables, rows, grad, lr, project=project)
            return
        chunk_bytes = default_block_bytes(grad.device) if block_bytes is None else block_bytes
        for ids, part in _chunks(rows, bank.num_rows, grad.shape[1], grad.device, chunk_bytes):
            weight = None if staged_weight is None else staged_weight[part].clone()
            g = grad[part]
            if project:
                weight = bank.read("weight", ids) if weight is None else weight
                g = project_rows(g, weight)
            self.update_rows(bank, ids, g, lr, weight)

    def _fused_tables(self, bank: ClassBank, grad: torch.Tensor) -> dict | None:
        """The bank's state tables when the fused kernel will update them, else None."""
        if self.fused is False or (self.fused is None and not grad.is_cuda):
            return None
        tables = bank.state_tensors() if hasattr(bank, "state_tensors") else None
        from ..kernels import triton_optim
        usable = tables is not None and triton_optim.available() and grad.dtype == torch.float32 and all(
            t.dtype == dtype for (name, _, dtype) in (("weight", "d", torch.float32),) + tuple(self.state_specs)
            for t in [tables[name]])
        if self.fused and not usable:
            raise RuntimeError(f"{self!r} was asked for the fused kernel, but it needs triton (on CPU with "
                               "TRITON_INTERPRET=1), a bank that holds its rows in memory (DeviceBank or a "
                               "staged slot) and float32 states")
        return tables if usable else None

    def fused_update(self, tables: dict, rows: torch.Tensor | None, grad: torch.Tensor, lr: float,
                     project: bool = False) -> None:
        """One fused kernel over ``rows`` of the in-memory ``tables`` (``project``: as in :meth:`update`)."""
        raise NotImplementedError(f"{type(self).__name__} has no fused kernel; set fused=False")

    @abstractmethod
    def update_rows(self, bank: ClassBank, rows: torch.Tensor, grad: torch.Tensor, lr: float,
                    weight: torch.Tensor | None) -> None:
        """One step on a chunk of rows: read (unless ``weight`` is given), update, write back."""

    @abstractmethod
    def config(self) -> dict:
        """The hyper-parameters, for checkpoints and reprs."""

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v}" for k, v in self.config().items())
        return f"{type(self).__name__}({args})"


class RowSGD(RowOptimizer):
    """``torch.optim.SGD`` semantics (dampening 0) on the active rows."""

    def __init__(self, momentum: float = 0.9, weight_decay: float = 5e-4, nesterov: bool = False,
                 fused: bool | None = None):
        self.fused = _fused_flag(fused)
        self.momentum = _number("momentum", momentum, 0.0, 1.0, high_open=True)
        self.weight_decay = _number("weight_decay", weight_decay)
        if nesterov and self.momentum == 0.0:
            raise ValueError("nesterov=True needs momentum > 0")
        self.nesterov = bool(nesterov)
        self.state_specs = (("momentum_buffer", "d", torch.float32),) if self.momentum else ()

    def config(self):
        return {"momentum": self.momentum, "weight_decay": self.weight_decay, "nesterov": self.nesterov}

    def fused_update(self, tables, rows, grad, lr, project=False):
        from ..kernels.triton_optim import sgd_rows_
        sgd_rows_(tables["weight"], tables.get("momentum_buffer"), rows, grad, lr=lr, momentum=self.momentum,
                  weight_decay=self.weight_decay, nesterov=self.nesterov, project=project)

    def update_rows(self, bank, rows, grad, lr, weight=None):
        weight = bank.read("weight", rows) if weight is None else weight
        step = grad.add(weight, alpha=self.weight_decay) if self.weight_decay else grad
        if self.momentum:
            buf = bank.read("momentum_buffer", rows).mul_(self.momentum).add_(step)
            bank.write("momentum_buffer", rows, buf)
            step = step.add(buf, alpha=self.momentum) if self.nesterov else buf
        bank.write("weight", rows, weight.add_(step, alpha=-lr))


class RowAdamW(RowOptimizer):
    """``torch.optim.AdamW`` semantics on the active rows, with a step count per row
    (so bias correction follows each row's own number of updates)."""

    def __init__(self, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2,
                 fused: bool | None = None):
        self.fused = _fused_flag(fused)
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise TypeError(f"betas must be a pair of floats, got {betas!r}")
        self.betas = (_number("betas[0]", betas[0], 0.0, 1.0, True), _number("betas[1]", betas[1], 0.0, 1.0, True))
        self.eps = _number("eps", eps)
        self.weight_decay = _number("weight_decay", weight_decay)
        self.state_specs = (("exp_avg", "d", torch.float32), ("exp_avg_sq", "d", torch.float32),
                            ("step", 0, torch.int32))

    def config(self):
        return {"betas": self.betas, "eps": self.eps, "weight_decay": self.weight_decay}

    def fused_update(self, tables, rows, grad, lr, project=False):
        from ..kernels.triton_optim import adamw_rows_
        adamw_rows_(tables["weight"], tables["exp_avg"], tables["exp_avg_sq"], tables["step"], rows, grad, lr=lr,
                    beta1=self.betas[0], beta2=self.betas[1], eps=self.eps, weight_decay=self.weight_decay,
                    project=project)

    def update_rows(self, bank, rows, grad, lr, weight=None):
        beta1, beta2 = self.betas
        weight = bank.read("weight", rows) if weight is None else weight
        steps = bank.read("step", rows) + 1
        exp_avg = bank.read("exp_avg", rows).mul(beta1).add_(grad, alpha=1 - beta1)
        exp_avg_sq = bank.read("exp_avg_sq", rows).mul(beta2).addcmul_(grad, grad, value=1 - beta2)
        weight.mul_(1 - lr * self.weight_decay)
        t = steps.to(torch.float64)[:, None]
        bias1 = (1 - torch.pow(beta1, t)).to(weight.dtype)
        bias2_sqrt = torch.sqrt(1 - torch.pow(beta2, t)).to(weight.dtype)
        denom = (exp_avg_sq.sqrt() / bias2_sqrt).add_(self.eps)
        weight.addcdiv_(exp_avg, denom * bias1, value=-lr)
        bank.write("weight", rows, weight)
        bank.write("exp_avg", rows, exp_avg)
        bank.write("exp_avg_sq", rows, exp_avg_sq)
        bank.write("step", rows, steps)


def _fused_flag(value):
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"fused must be None (auto: on CUDA when triton imports), True or False, got {value!r}")
    return value


def make_row_optimizer(name: str, **kwargs) -> RowOptimizer:
    """``"sgd"`` -> :class:`RowSGD`, ``"adamw"`` -> :class:`RowAdamW`."""
    table = {"sgd": RowSGD, "adamw": RowAdamW}
    if name not in table:
        raise ValueError(f"optimizer must be one of {sorted(table)}, got {name!r}")

    allowed = [p for p in inspect.signature(table[name]).parameters]
    unknown = sorted(set(kwargs) - set(allowed))
    if unknown:
        raise TypeError(f"optimizer={name!r} does not take {unknown}; its arguments are {allowed}")
    return table[name](**kwargs)
