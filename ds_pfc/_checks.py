"""Argument checks shared by the functional and module entry points.

Each raises ``TypeError``/``ValueError`` naming the argument, the expected and the
actual value, before anything is changed.
"""
from __future__ import annotations

import math

import torch

_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


class ConfigError(ValueError):
    """A ``ds_pfc`` config value or key is wrong; the message names it and the fix.
    (Defined here, below every layer, so the launchers' errors can derive from it;
    the app re-exports it as ``ds_pfc.app.config.ConfigError``.)"""


def check_embeddings(embeddings, embedding_size: int | None = None, name: str = "embeddings") -> None:
    if not isinstance(embeddings, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(embeddings).__name__}")
    if not embeddings.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {embeddings.dtype}")
    if embeddings.dim() != 2:
        raise ValueError(f"{name} must have shape [N, d], got shape {tuple(embeddings.shape)}")
    if embedding_size is not None and embeddings.shape[1] != embedding_size:
        raise ValueError(f"{name} must have {embedding_size} columns (embedding_size), "
                         f"got shape {tuple(embeddings.shape)}")


def check_labels(labels, num_rows: int, name: str = "labels") -> None:
    if not isinstance(labels, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(labels).__name__}")
    if labels.dtype not in _INT_DTYPES:
        raise TypeError(f"{name} must be an integer tensor, got dtype {labels.dtype}")
    if labels.dim() != 1 or labels.shape[0] != num_rows:
        raise ValueError(f"{name} must have shape [{num_rows}] (one per embedding), "
                         f"got shape {tuple(labels.shape)}")


def check_values(embeddings: torch.Tensor, labels: torch.Tensor, num_classes: int | None,
                 names=("embeddings", "labels")) -> None:
    """NaN/Inf embeddings and out-of-range labels, in one host sync."""
    if embeddings.numel() == 0:
        return
    probe = torch.stack([
        (~torch.isfinite(embeddings)).any().to(torch.float64),
        labels.min().to(torch.float64),
        labels.max().to(torch.float64),
    ]).tolist()
    if probe[0]:
        raise ValueError(f"{names[0]} contain NaN or Inf values")
    upper = "num_classes" if num_classes is None else num_classes
    if probe[1] < 0 or (num_classes is not None and probe[2] >= num_classes):
        raise ValueError(f"{names[1]} must lie in [0, {upper}), got values in "
                         f"[{int(probe[1])}, {int(probe[2])}]")


def check_int(name: str, value, minimum: int) -> int:
    """An int (not a bool) >= ``minimum``; returns it."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_number(name: str, value, low: float = 0.0, high: float | None = None, high_open: bool = False) -> float:
    """A finite number (not a bool) in ``[low, high]`` (``[low, high)`` with
    ``high_open``; no upper bound without ``high``); returns it as a float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TypeError(f"{name} must be a finite number, got {value!r}")
    if value < low or (high is not None and (value > high or (high_open and value == high))):
        bound = f"in [{low}, {high}{')' if high_open else ']'}" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be {bound}, got {value}")
    return float(value)


# ------------------------------------------------------------ one sync per step
# Columns of a rank's row in the table a validating forward gathers over its group.
PROBE_FIELDS = ("num_rows", "ok", "nonfinite", "label_min", "label_max", "label_hash")
_HASH_MOD = (1 << 31) - 1


def batch_probe(embeddings, labels, error: Exception | None, device) -> torch.Tensor:
    """This rank's row ``[len(PROBE_FIELDS)]`` (int64, on ``device``) of the checks of a
    validating forward, computed on the device with no host sync: the row count,
    whether the local checks of types and shapes passed (``error`` is None), whether an
    embedding is NaN/Inf (``embeddings`` None: none checked), the labels' min and max,
    and a position-weighted hash of the labels (tensor-parallel peers must hold the
    same samples). Gathered over the group and read with one ``.tolist()``:
    :func:`check_batch_table` judges it."""
    row = torch.zeros(len(PROBE_FIELDS), dtype=torch.int64, device=device)
    if error is not None:
        return row                         # ok = 0; the tensors may be unusable
    n = labels.shape[0]
    row[0], row[1] = n, 1
    if n == 0:
        row[3], row[4] = 0, -1             # an empty range: nothing out of bounds
        return row
    y = labels.long()
    weights = torch.arange(1, n + 1, dtype=torch.int64, device=y.device) % _HASH_MOD
    nonfinite = y.new_zeros(()) if embeddings is None else (~torch.isfinite(embeddings)).any().long()
    row[2:] = torch.stack([
        nonfinite, y.min(), y.max(),
        ((y % _HASH_MOD) * weights % _HASH_MOD).sum() % _HASH_MOD,
    ]).to(device)
    return row


class NonFiniteError(ValueError):
    """A training forward refused NaN or Inf embeddings (on this rank or another one of
    the group), before anything changed on any rank."""


def check_batch_table(table: list[list[int]], me: int, error: Exception | None, num_classes: int,
                      what: str = "embeddings/labels", names=("embeddings", "labels")) -> list[int]:
    """Every rank's row count, after the checks of every rank's probe row
    (:func:`batch_probe`); raises on every rank together when any rank's input is bad.

    This rank raises its own ``error``, or a readable ``ValueError`` for its NaN/Inf
    embeddings or out-of-range labels; the other ranks raise a ``ValueError`` naming the
    failed ranks. Nothing has been changed on any rank at that point."""
    if error is not None:
        raise error
    mine = table[me]
    if mine[2]:
        raise NonFiniteError(f"{names[0]} contain NaN or Inf values")
    if mine[0] and (mine[3] < 0 or mine[4] >= num_classes):
        raise ValueError(f"{names[1]} must lie in [0, {num_classes}), got values in [{mine[3]}, {mine[4]}]")
    failed = [q for q, row in enumerate(table)
              if not row[1] or row[2] or (row[0] and (row[3] < 0 or row[4] >= num_classes))]
    if failed:
        reasons = []
        for q in failed:
            row = table[q]
            if not row[1]:
                reasons.append(f"rank {q}: its arguments (see its error)")
            elif row[2]:
                reasons.append(f"rank {q}: {names[0]} contain NaN or Inf values")
            else:
                reasons.append(f"rank {q}: {names[1]} in [{row[3]}, {row[4]}], outside [0, {num_classes})")
        # Only NaN/Inf embeddings: a NonFiniteError on every rank (a policy may drop the step).
        nonfinite = all(table[q][1] and table[q][2] for q in failed)
        raise (NonFiniteError if nonfinite else ValueError)(
            f"{what}: ranks {failed} of the group rejected their {what} ({'; '.join(reasons)}); "
            "nothing was changed on any rank")
    return [row[0] for row in table]


def check_peers(table: list[list[int]], positions, batch_world: int, what: str = "embeddings/labels") -> list[int]:
    """One row count per batch position from a table of :func:`batch_probe` rows over a
    class group laid out in batch groups (``positions[q]``: rank q's position): ranks at
    the same position (tensor-parallel peers) must pass the same number of samples and
    the same labels (equal hashes), or they would train on mixed-up targets."""
    sizes: dict[int, set] = {}
    hashes: dict[int, set] = {}
    for q, row in enumerate(table):
        sizes.setdefault(positions[q], set()).add(row[0])
        hashes.setdefault(positions[q], set()).add(row[5])
    bad = {p: sorted(v) for p, v in sizes.items() if len(v) > 1}
    if bad:
        raise ValueError(f"{what}: ranks at the same batch position (tensor-parallel peers) must pass the same "
                         f"samples, but their batch sizes differ: position -> sizes {bad}")
    if any(len(v) > 1 for v in hashes.values()):
        raise ValueError("labels: the ranks of the class group gathered different labels; tensor-parallel peers "
                         "(the same position in their batch groups) must pass identical samples")
    return [sizes[p].pop() for p in range(batch_world)]


def check_row_move(src, src_idx, dst, dst_idx, mask, count) -> int:
    """Arguments of a row move ``dst[dst_idx[i]] = src[src_idx[i]]`` where ``mask[i]``
    (``ds_pfc.kernels.triton_rows``, ``ds_pfc.bank.rows``): shapes and dtypes. Returns the
    number of positions ``i``."""
    for name, t in (("src", src), ("dst", dst)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() not in (1, 2):
            raise ValueError(f"{name} must be [rows] or [rows, width], got shape {list(t.shape)}")
        if t.dim() == 2 and t.shape[1] > 1 and t.stride(1) != 1:
            raise ValueError(f"{name} must be contiguous along its last dimension, got strides {t.stride()}")
    if src.shape[1:] != dst.shape[1:]:
        raise ValueError(f"src and dst must have rows of one shape, got {list(src.shape)} and {list(dst.shape)}")
    if src.is_floating_point() != dst.is_floating_point():
        raise TypeError(f"src ({src.dtype}) and dst ({dst.dtype}) must both be floating or both integer")
    lengths = [t.shape[0] for t in (src_idx, dst_idx, mask) if t is not None]
    if count is None:
        count = lengths[0] if lengths else src.shape[0]
    for name, t, dtypes in (("src_idx", src_idx, (torch.int64, torch.int32)),
                            ("dst_idx", dst_idx, (torch.int64, torch.int32)), ("mask", mask, (torch.bool,))):
        if t is None:
            continue
        if t.dtype not in dtypes or t.dim() != 1 or t.shape[0] != count:
            raise ValueError(f"{name} must be a 1-d {' or '.join(map(str, dtypes))} tensor of {count} entries, got "
                             f"{t.dtype} of shape {list(t.shape)}")
    if src_idx is None and count > src.shape[0]:
        raise ValueError(f"without src_idx, src needs at least {count} rows, got {src.shape[0]}")
    if dst_idx is None and count > dst.shape[0]:
        raise ValueError(f"without dst_idx, dst needs at least {count} rows, got {dst.shape[0]}")
    return count
