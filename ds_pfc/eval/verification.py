"""1:1 face verification on insightface ``.bin`` pair sets (LFW, CFP-FP, AgeDB-30, ...).

Protocol (insightface's ``.bin`` verification, reimplemented from its description):

- A ``.bin`` holds ``2N`` encoded images; pair ``i`` is images ``2i`` and ``2i+1``.
- Embedding = L2-normalise(f(x) + f(flip_width(x))) ("Accuracy-Flip").
- Pair distance = squared L2 between the normalised embeddings, in ``[0, 4]``
  (``= 2 - 2 cos``); a pair is called "same" when ``distance < threshold``.
- Accuracy: thresholds ``0, 0.01, .., 3.99``; ``nfolds``-fold cross-validation over
  contiguous, unshuffled folds (sklearn ``KFold`` sizes: the first ``N % nfolds``
  folds get one pair more); per fold, the threshold with the best accuracy on the
  other folds (the first such one on ties) is applied to the held-out fold. The mean
  and the population standard deviation of the held-out accuracies are reported.
- TAR@FAR over all pairs: see :func:`verification_metrics`.

Images are not decoded here: no image library is a dependency. :func:`load_bin`
returns the encoded bytes unless given ``decode``; the caller builds the
``[2N, 3, H, W]`` tensor with the normalisation used in training (insightface:
RGB, ``(x / 255 - 0.5) / 0.5``).
"""
from __future__ import annotations

import math
import os
import pickle
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

__all__ = ["UnsafePickleError", "load_bin", "embed", "embed_pairs", "VerificationResult",
           "verification_metrics", "DEFAULT_THRESHOLDS"]

# insightface: numpy.arange(0, 4, 0.01) = i * 0.01 in float64, 400 values.
DEFAULT_THRESHOLDS = torch.arange(400, dtype=torch.float64) * 0.01


# -- .bin loading ---------------------------------------------------------------------
class UnsafePickleError(pickle.UnpicklingError, ValueError):
    """A pickle asked for a global outside the ``.bin`` allow-list."""


# Everything an insightface .bin needs, and nothing that can run code: containers and
# bytes; ``_codecs.encode`` (how Python 3 pickles bytes under protocols 0-2); numpy
# arrays (``cv2.imencode`` returns a uint8 ndarray, which build_eval_pack.py stores
# as is) and numpy scalars (a ``numpy.bool_`` in issame_list), under their numpy 1
# (``numpy.core``) and numpy 2 (``numpy._core``) module names. Python 2 pickles name
# the builtins module ``__builtin__``.
_ALLOWED_GLOBALS = frozenset(
    [(mod, name) for mod in ("builtins", "__builtin__") for name in ("bytes", "bytearray", "list", "tuple", "bool")]
    + [("_codecs", "encode"), ("numpy", "ndarray"), ("numpy", "dtype")]
    + [(f"numpy.{core}.multiarray", name) for core in ("core", "_core") for name in ("_reconstruct", "scalar")]
    + [(f"numpy.{core}.numeric", "_frombuffer") for core in ("core", "_core")]
)


class _BinUnpickler(pickle.Unpickler):
    def __init__(self, file, path: str):
        super().__init__(file, encoding="bytes")
        self._path = path

    def find_class(self, module: str, name: str):
        if (module, name) not in _ALLOWED_GLOBALS:
            raise UnsafePickleError(
                f"{self._path!r}: refusing to unpickle global '{module}.{name}'; a verification .bin may only "
                f"hold lists/tuples of bytes, bools and numpy arrays (a pickle that names other globals can run "
                f"arbitrary code when loaded)")
        return super().find_class(module, name)

    def persistent_load(self, pid):
        raise UnsafePickleError(f"{self._path!r}: refusing persistent id {pid!r} in a verification .bin")


def _as_bytes(obj, index: int, path: str) -> bytes:
    if isinstance(obj, (bytes, bytearray)):
        return bytes(obj)
    if type(obj).__name__ == "ndarray" and getattr(obj, "dtype", None) is not None and obj.dtype.itemsize == 1 \
            and obj.dtype.kind in "uiSV":
        return obj.tobytes()
    raise ValueError(f"{path!r}: image {index} is a {type(obj).__module__}.{type(obj).__name__}; "
                     f"expected encoded bytes or a uint8 numpy array")


def _as_bool(obj, index: int, path: str) -> bool:
    if hasattr(obj, "item") and not isinstance(obj, (bool, int)):
        obj = obj.item()  # numpy.bool_ / numpy integer scalar
    if isinstance(obj, bool) or (isinstance(obj, int) and obj in (0, 1)):
        return bool(obj)
    raise ValueError(f"{path!r}: issame_list[{index}] = {obj!r}; expected a bool")


def load_bin(path: str | os.PathLike, decode: Callable[[bytes], object] | None = None):
    """Read an insightface verification ``.bin``: ``(images, issame)``.

    ``images`` holds the ``2N`` encoded images as ``bytes`` (``decode(bytes)`` of each
    when ``decode`` is given), ``issame`` the ``N`` pair labels as ``bool``.

    Security: a ``.bin`` is a Python pickle, and unpickling can run arbitrary code. It
    is read with a restricted unpickler that only resolves the globals such files
    need (containers, bytes, bools, numpy arrays and scalars; see
    ``_ALLOWED_GLOBALS``) and raises :class:`UnsafePickleError` for anything else,
    e.g. ``os.system``. That blocks code execution, not resource exhaustion: a
    hostile file can still ask for a lot of memory.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"verification .bin not found: {path!r}")
    if decode is not None and not callable(decode):
        raise TypeError(f"decode must be a callable taking bytes or None, got {type(decode).__name__}")
    with open(path, "rb") as f:
        try:
            data = _BinUnpickler(f, path).load()
        except UnsafePickleError:
            raise
        except Exception as exc:  # truncated/corrupt pickles raise many types
            raise ValueError(f"{path!r} is not a readable pickle ({type(exc).__name__}: {exc}); "
                             f"expected an insightface verification .bin") from exc
    if not isinstance(data, (tuple, list)) or len(data) != 2:
        shape = f"a {type(data).__name__}" + (f" of length {len(data)}" if isinstance(data, (tuple, list)) else "")
        raise ValueError(f"{path!r}: expected a pickled (bins, issame_list) pair, got {shape}")
    bins, issame = data
    if not isinstance(bins, (list, tuple)):
        raise ValueError(f"{path!r}: bins must be a list of encoded images, got {type(bins).__name__}")
    if type(issame).__name__ == "ndarray":
        issame = issame.reshape(-1).tolist()
    if not isinstance(issame, (list, tuple)):
        raise ValueError(f"{path!r}: issame_list must be a list of bools, got {type(issame).__name__}")
    if len(bins) != 2 * len(issame):
        raise ValueError(f"{path!r}: {len(bins)} images for {len(issame)} pairs; expected 2 images per pair "
                         f"({2 * len(issame)})")
    images = [_as_bytes(b, i, path) for i, b in enumerate(bins)]
    if decode is not None:
        images = [decode(b) for b in images]
    return images, [_as_bool(s, i, path) for i, s in enumerate(issame)]


# -- embeddings -----------------------------------------------------------------------
def _check_images(images) -> None:
    if not isinstance(images, torch.Tensor):
        raise TypeError(f"images must be a torch.Tensor, got {type(images).__name__}")
    if images.dim() != 4:
        raise ValueError(f"images must have shape [M, C, H, W], got shape {tuple(images.shape)}")


@torch.no_grad()
def embed(model: Callable[[torch.Tensor], torch.Tensor], images: torch.Tensor, batch_size: int,
          flip: bool = True, device: torch.device | str | None = None) -> torch.Tensor:
    """L2-normalised embeddings ``[M, D]`` (float32, CPU) of ``images [M, C, H, W]``.

    ``flip=True``: ``normalise(f(x) + f(x flipped along width))``; else
    ``normalise(f(x))``. Runs without autograd; a module is put in eval mode and its
    previous mode restored afterwards. Batches go to ``device`` when given.
    """
    _check_images(images)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    was_training = getattr(model, "training", None)
    if was_training is not None:
        model.eval()
    try:
        out = []
        for start in range(0, images.shape[0], batch_size):
            x = images[start:start + batch_size]
            if device is not None:
                x = x.to(device)
            feat = model(x).float()  # sum in float32 even for a half-precision model
            if flip:
                feat = feat + model(x.flip(3)).float()
            out.append(feat.cpu())
    finally:
        if was_training is not None:
            model.train(was_training)
    if not out:
        raise ValueError("images is empty")
    return F.normalize(torch.cat(out), dim=1)


def embed_pairs(model: Callable[[torch.Tensor], torch.Tensor], images: torch.Tensor, batch_size: int,
                flip: bool = True, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`embed` of ``images [2N, C, H, W]`` split into the pair sides
    ``(emb1_ND, emb2_ND)``: rows ``0, 2, 4, ..`` and ``1, 3, 5, ..``."""
    _check_images(images)
    if images.shape[0] % 2:
        raise ValueError(f"images must hold 2 images per pair (an even count), got {images.shape[0]}")
    emb = embed(model, images, batch_size, flip=flip, device=device)
    return emb[0::2], emb[1::2]


# -- metrics --------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class VerificationResult:
    accuracy: float
    """Mean held-out accuracy over the folds."""
    accuracy_std: float
    """Population standard deviation (ddof 0, as insightface) of the fold accuracies."""
    fold_accuracies: tuple[float, ...]
    """Held-out accuracy of each fold."""
    best_thresholds: tuple[float, ...]
    """Squared-L2 threshold chosen for each fold on the other folds."""
    tar_at_far: dict[float, float]
    """True accept rate at each target false accept rate; NaN when not measurable."""
    far_thresholds: dict[float, float]
    """Squared-L2 threshold behind each TAR@FAR value (NaN alongside a NaN TAR)."""


def _fold_bounds(num: int, nfolds: int) -> list[tuple[int, int]]:
    size, extra = divmod(num, nfolds)
    bounds, start = [], 0
    for f in range(nfolds):
        stop = start + size + (1 if f < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def _tar_at_far(dist: torch.Tensor, same: torch.Tensor, far: float) -> tuple[float, float]:
    pos, neg = dist[same], dist[~same].sort().values
    # Allowed false accepts: floor(far * num_neg), with slack for far*num_neg = 1 - 1ulp.
    allowed = math.floor(far * neg.numel() * (1 + 1e-9))
    if pos.numel() == 0 or allowed < 1:
        return math.nan, math.nan
    threshold = neg[allowed].item() if allowed < neg.numel() else math.inf
    return (pos < threshold).double().mean().item(), threshold


def verification_metrics(embeddings1: torch.Tensor, embeddings2: torch.Tensor, issame: Sequence[bool] | torch.Tensor,
                         nfolds: int = 10, *, thresholds: torch.Tensor | Sequence[float] | None = None,
                         far_targets: Sequence[float] = (1e-4, 1e-6)) -> VerificationResult:
    """Verification accuracy (k-fold, insightface protocol) and TAR@FAR for pairs
    ``(embeddings1[i], embeddings2[i])`` labelled ``issame[i]``.

    Distance: both sides are L2-normalised (a no-op for :func:`embed` output) and the
    pair distance is the squared L2 distance, ``2 - 2 cos``; "same" means
    ``distance < threshold``. ``thresholds`` default to :data:`DEFAULT_THRESHOLDS`
    (``0, 0.01, .., 3.99``). Computed in float64.

    TAR@FAR, over all pairs (no folds): with ``M`` impostor (not-same) pairs, at most
    ``k = floor(far * M)`` of them may be accepted; the threshold is the ``(k+1)``-th
    smallest impostor distance (every threshold when ``k >= M``), so the accepted
    impostors number ``<= k`` even with ties, and TAR is the fraction of genuine pairs
    below it, the largest TAR over all thresholds whose FAR is ``<= far``. When
    ``far * M < 1`` (fewer than ``1/far`` impostor pairs; e.g. FAR=1e-4 needs 10,000,
    so LFW/CFP-FP/AgeDB with 3,000-3,500 give NaN) or there is no genuine pair, the
    TAR is not measurable and is NaN.
    """
    for name, emb in (("embeddings1", embeddings1), ("embeddings2", embeddings2)):
        if not isinstance(emb, torch.Tensor) or not emb.is_floating_point() or emb.dim() != 2:
            raise ValueError(f"{name} must be a floating-point tensor [N, D], got "
                             f"{tuple(emb.shape) if isinstance(emb, torch.Tensor) else type(emb).__name__}")
    if embeddings1.shape != embeddings2.shape:
        raise ValueError(f"embeddings1 and embeddings2 must have the same shape, got {tuple(embeddings1.shape)} "
                         f"and {tuple(embeddings2.shape)}")
    num = embeddings1.shape[0]
    same = torch.as_tensor(issame).reshape(-1).cpu()
    if same.dtype != torch.bool:
        if same.is_floating_point() or same.is_complex() or not ((same == 0) | (same == 1)).all():
            raise ValueError(f"issame must hold bools (or 0/1), got dtype {same.dtype}")
        same = same.bool()
    if same.numel() != num:
        raise ValueError(f"issame must have one entry per pair ({num}), got {same.numel()}")
    if isinstance(nfolds, bool) or not isinstance(nfolds, int) or not 2 <= nfolds <= num:
        raise ValueError(f"nfolds must be an int in [2, number of pairs = {num}], got {nfolds!r}")
    thr = DEFAULT_THRESHOLDS if thresholds is None else torch.as_tensor(thresholds, dtype=torch.float64).reshape(-1)
    if thr.numel() == 0:
        raise ValueError("thresholds must not be empty")
    fars = tuple(float(f) for f in far_targets)
    for far in fars:
        if not 0 < far <= 1:
            raise ValueError(f"far_targets must lie in (0, 1], got {far}")

    e1 = F.normalize(embeddings1.detach().double().cpu(), dim=1)
    e2 = F.normalize(embeddings2.detach().double().cpu(), dim=1)
    dist = (e1 - e2).pow(2).sum(1)
    if not torch.isfinite(dist).all():
        raise ValueError("embeddings contain NaN or Inf")

    # correct_FT[f, t]: pairs of fold f classified right at threshold t, counted by
    # binary search on the fold's sorted genuine / impostor distances.
    bounds = _fold_bounds(num, nfolds)
    correct_FT = torch.empty(nfolds, thr.numel(), dtype=torch.int64)
    for f, (lo, hi) in enumerate(bounds):
        d, s = dist[lo:hi], same[lo:hi]
        pos, neg = d[s].sort().values, d[~s].sort().values
        accepted_pos = torch.searchsorted(pos, thr, side="left")  # genuine with d < t
        rejected_neg = neg.numel() - torch.searchsorted(neg, thr, side="left")  # impostor with d >= t
        correct_FT[f] = accepted_pos + rejected_neg
    total_T = correct_FT.sum(0)
    fold_acc, best = [], []
    for f, (lo, hi) in enumerate(bounds):
        t = int(torch.argmax(total_T - correct_FT[f]))  # first maximum, like numpy
        best.append(thr[t].item())
        fold_acc.append(correct_FT[f, t].item() / (hi - lo))
    acc = torch.tensor(fold_acc, dtype=torch.float64)

    tar, far_thr = {}, {}
    for far in fars:
        tar[far], far_thr[far] = _tar_at_far(dist, same, far)
    return VerificationResult(accuracy=acc.mean().item(), accuracy_std=acc.std(correction=0).item(),
                              fold_accuracies=tuple(fold_acc), best_thresholds=tuple(best),
                              tar_at_far=tar, far_thresholds=far_thr)
