"""IJB-B / IJB-C 1:1 template verification, as insightface evaluates it.

Protocol (insightface ``recognition/arcface_torch/eval_ijbc.py``, reimplemented from
its description; the published IJB-B/IJB-C tables of ArcFace, Partial FC and the
model zoo use it):

1. Each image of ``loose_crop/`` is aligned onto the 112x112 ArcFace template from
   its five landmarks (:func:`align`) and embedded as ``f(x) + f(flip x)`` (the flip
   sum, "F2"; ``f(x)`` without flip), with the training normalisation
   ``(x / 255 - 0.5) / 0.5``. The image features are *not* normalised.
2. ``use_norm_score=False`` L2-normalises each image feature ("N0"); the default
   keeps its norm ("N1"). ``use_detector_score=True`` ("D1", the default) then
   multiplies each image feature by the detector's faceness score.
3. A template's feature: the mean of the features of each of its media (the frames
   of one video, or a single still), **summed** over the media, then L2-normalised. A
   zero sum stays zero (sklearn ``normalize``), which scores 0 against everything.
4. The score of a template pair is the dot product of the two template features
   (their cosine).
5. ROC with sklearn ``roc_curve`` semantics (:func:`roc_curve`), and TAR at each FAR
   is the TPR of the ROC point whose FPR is *nearest* to the FAR, the largest TPR
   among equally near points (:func:`tar_at_far`). Where a set has fewer than
   ``1 / far`` impostor pairs the nearest point can lie far from the target (often
   FPR 0): such a value is reported, as insightface reports it, and
   :attr:`IJBResult.achieved_far` says which FPR it was read at.

Numbers: everything after the features is computed in float64 (insightface mixes
float32 image features with float64 templates); the two agree to float32 rounding.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

__all__ = ["ARCFACE_TEMPLATE", "DEFAULT_FARS", "IJBMeta", "IJBResult", "align", "embed_images", "evaluate",
           "plot_roc", "pool_templates", "read_meta", "reference_landmarks", "roc_curve", "similarity_transform",
           "tar_at_far", "warp_affine"]

# insightface's ``arcface_dst`` (face_align.norm_crop): left eye, right eye, nose tip,
# left and right mouth corner of a 112x112 crop, (x, y) pixels, left/right as seen.
ARCFACE_TEMPLATE = ((38.2946, 51.6963), (73.5318, 51.5014), (56.0252, 71.7366), (41.5493, 92.3655),
                    (70.7299, 92.2041))
DEFAULT_FARS = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1)

# OpenCV's fixed-point bilinear warp: source coordinates in 1/1024 pixel, then rounded
# to 1/32 pixel (INTER_BITS = 5); tap weights in units of 2^-15.
_AB_SCALE = 1024
_TAB_SIZE = 32
_COEF_BITS = 15


# -- alignment ------------------------------------------------------------------------
def _as_points(name: str, value, num: int | None = None) -> torch.Tensor:
    try:
        pts = torch.as_tensor(value, dtype=torch.float64).detach().cpu()
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(f"{name} must be an array of (x, y) points, got {type(value).__name__}") from None
    if pts.dim() != 2 or pts.shape[1] != 2 or (num is not None and pts.shape[0] != num):
        want = f"[{num}, 2]" if num is not None else "[K, 2]"
        raise ValueError(f"{name} must have shape {want}, got {tuple(pts.shape)}")
    if not torch.isfinite(pts).all():
        raise ValueError(f"{name} contains NaN or Inf")
    return pts


def _flat_landmarks(value):
    """The 10 numbers ``x1 y1 .. x5 y5`` of a landmark line as ``[5, 2]``; anything else as is."""
    if isinstance(value, (list, tuple)) and len(value) == 10 and all(isinstance(v, (int, float)) for v in value):
        return [value[i:i + 2] for i in range(0, 10, 2)]
    shape = getattr(value, "shape", None)
    if shape is not None and tuple(shape) == (10,):
        return value.reshape(5, 2)
    return value


def reference_landmarks(image_size: int = 112) -> torch.Tensor:
    """float64 ``[5, 2]``: where :func:`align` puts the five landmarks in an
    ``image_size`` crop; insightface's ``estimate_norm`` (mode "arcface"): the
    112-pixel template scaled by ``image_size / 112`` for multiples of 112, else by
    ``image_size / 128`` and shifted right by ``8 * image_size / 128`` pixels."""
    if isinstance(image_size, bool) or not isinstance(image_size, int) or image_size < 16:
        raise ValueError(f"image_size must be an int >= 16, got {image_size!r}")
    dst = torch.tensor(ARCFACE_TEMPLATE, dtype=torch.float64)
    if image_size % 112 == 0:
        return dst * (image_size / 112.0)
    ratio = image_size / 128.0
    return dst * ratio + torch.tensor([8.0 * ratio, 0.0], dtype=torch.float64)


def similarity_transform(src, dst) -> torch.Tensor:
    """float64 ``[3, 3]``: the similarity (rotation, uniform scale, translation; no
    reflection) ``T`` minimising ``sum_k |T(src_k) - dst_k|^2``, as homogeneous matrix
    acting on column vectors ``(x, y, 1)``.

    Umeyama's closed form, as ``skimage.transform.SimilarityTransform.estimate``
    (which insightface uses): when the best orthogonal fit is a reflection, the best
    rotation is taken instead. ``src`` and ``dst`` are ``[K, 2]`` point sets, ``K >= 2``;
    ``src`` must not be a single repeated point (ValueError).
    """
    src = _as_points("src", src)
    dst = _as_points("dst", dst, src.shape[0])
    if src.shape[0] < 2:
        raise ValueError(f"src must hold at least 2 points, got {src.shape[0]}")
    num, dim = src.shape
    src_mean, dst_mean = src.mean(0), dst.mean(0)
    src_c, dst_c = src - src_mean, dst - dst_mean
    src_var = src_c.pow(2).sum(1).mean()
    if not src_var > 0:
        raise ValueError("src points all coincide: no similarity transform is determined")
    A = dst_c.T @ src_c / num
    d = torch.ones(dim, dtype=torch.float64)
    if torch.linalg.det(A) < 0:
        d[-1] = -1.0
    U, S, Vh = torch.linalg.svd(A)
    rank = int(torch.linalg.matrix_rank(A))
    T = torch.eye(dim + 1, dtype=torch.float64)
    if rank == 0:
        raise ValueError("dst points all coincide: no similarity transform is determined")
    if rank == dim - 1 and torch.linalg.det(U) * torch.linalg.det(Vh) <= 0:
        e = d.clone()
        e[-1] = -1.0
        R = U @ torch.diag(e) @ Vh
    elif rank == dim - 1:
        R = U @ Vh
    else:
        R = U @ torch.diag(d) @ Vh
    scale = (S @ d) / src_c.var(0, correction=0).sum()
    T[:dim, :dim] = scale * R
    T[:dim, dim] = dst_mean - scale * (R @ src_mean)
    return T


def _image_hwc(image) -> tuple[torch.Tensor, bool]:
    """(uint8 tensor [H, W, C], whether it came as a numpy array)."""
    from_numpy = type(image).__module__ == "numpy" and type(image).__name__ == "ndarray"
    if from_numpy:
        image = torch.from_numpy(image)
    if not isinstance(image, torch.Tensor):
        raise TypeError(f"image must be a uint8 numpy array or torch.Tensor [H, W, C], got {type(image).__name__}")
    if image.dtype != torch.uint8:
        raise TypeError(f"image must have dtype uint8, got {image.dtype}")
    if image.dim() == 2:
        image = image.unsqueeze(2)
    if image.dim() != 3 or image.shape[0] < 1 or image.shape[1] < 1 or not 1 <= image.shape[2] <= 4:
        raise ValueError(f"image must have shape [H, W, C] with C in 1..4 (channels last, as OpenCV), got "
                         f"{tuple(image.shape)}")
    return image, from_numpy


def _size_hw(size) -> tuple[int, int]:
    if isinstance(size, int) and not isinstance(size, bool):
        size = (size, size)
    if not (isinstance(size, (tuple, list)) and len(size) == 2
            and all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in size)):
        raise ValueError(f"size must be a positive int or a (height, width) pair of them, got {size!r}")
    return int(size[0]), int(size[1])


def warp_affine(image, matrix, size, *, border_value: int = 0):
    """Warp ``image`` (uint8 ``[H, W, C]``, numpy or torch) by the affine map
    ``matrix`` (``[2, 3]`` or ``[3, 3]``, source pixel -> output pixel) into an output of
    ``size`` (an int, or ``(height, width)``; note OpenCV's ``dsize`` is
    ``(width, height)``). Returns the same kind of array, uint8 ``[height, width, C]``.

    Semantics of ``cv2.warpAffine(image, matrix, (width, height))`` with its defaults
    (bilinear, constant border): pixel centres at integer coordinates; output pixel
    ``p`` samples the source at ``matrix^-1 p``; a tap outside the source reads
    ``border_value`` (in every channel; OpenCV's scalar ``borderValue=v`` fills only
    the first channel with ``v``). The arithmetic is OpenCV 4's fixed-point kernel,
    reproduced in integers: the inverse matrix as OpenCV computes it, source
    coordinates rounded to 1/1024 and then to 1/32 pixel, weights in units of
    ``2^-15``, the sum rounded half up. The output equals ``cv2.warpAffine``'s of
    OpenCV 4.10-4.12 bit for bit (checked on random images and similarities);
    OpenCV 5's floating-point kernel differs by up to 3 grey levels.
    """
    img, from_numpy = _image_hwc(image)
    out_h, out_w = _size_hw(size)
    M = torch.as_tensor(matrix, dtype=torch.float64).detach().cpu()
    if M.shape not in ((2, 3), (3, 3)):
        raise ValueError(f"matrix must have shape [2, 3] or [3, 3], got {tuple(M.shape)}")
    if not torch.isfinite(M).all():
        raise ValueError("matrix contains NaN or Inf")
    if isinstance(border_value, bool) or not isinstance(border_value, int) or not 0 <= border_value <= 255:
        raise ValueError(f"border_value must be an int in [0, 255], got {border_value!r}")
    m = [float(v) for v in M[:2].reshape(-1).tolist()]
    det = m[0] * m[4] - m[1] * m[3]
    if det == 0.0:
        raise ValueError(f"matrix is singular: {m}")
    # OpenCV's inversion, operation for operation.
    D = 1.0 / det
    a11, a22 = m[4] * D, m[0] * D
    i0, i1, i3, i4 = a11, m[1] * -D, m[3] * -D, a22
    i2 = -i0 * m[2] - i1 * m[5]
    i5 = -i3 * m[2] - i4 * m[5]

    xs = torch.arange(out_w, dtype=torch.float64)
    ys = torch.arange(out_h, dtype=torch.float64)
    half_bin = _AB_SCALE // _TAB_SIZE // 2
    # saturate_cast<int>(double) rounds half to even, as torch.round
    adelta = torch.round(i0 * xs * _AB_SCALE).long()
    bdelta = torch.round(i3 * xs * _AB_SCALE).long()
    x0 = torch.round((i1 * ys + i2) * _AB_SCALE).long() + half_bin
    y0 = torch.round((i4 * ys + i5) * _AB_SCALE).long() + half_bin
    shift = _AB_SCALE // _TAB_SIZE
    X = torch.div(x0.view(-1, 1) + adelta.view(1, -1), shift, rounding_mode="floor")     # 1/32 pixel
    Y = torch.div(y0.view(-1, 1) + bdelta.view(1, -1), shift, rounding_mode="floor")
    sx, ax = torch.div(X, _TAB_SIZE, rounding_mode="floor"), X.remainder(_TAB_SIZE)
    sy, ay = torch.div(Y, _TAB_SIZE, rounding_mode="floor"), Y.remainder(_TAB_SIZE)

    H, W, C = img.shape
    flat = img.reshape(H * W, C).long()
    acc = torch.zeros(out_h, out_w, C, dtype=torch.int64)
    # Bilinear weights in units of 2^-15: (32 - a) or a for each axis, times 32.
    scale = (1 << _COEF_BITS) // (_TAB_SIZE * _TAB_SIZE)
    for dy, wy in ((0, _TAB_SIZE - ay), (1, ay)):
        for dx, wx in ((0, _TAB_SIZE - ax), (1, ax)):
            tx, ty = sx + dx, sy + dy
            inside = (tx >= 0) & (tx < W) & (ty >= 0) & (ty < H)
            index = (ty.clamp(0, H - 1) * W + tx.clamp(0, W - 1)).reshape(-1)
            values = flat[index].view(out_h, out_w, C)
            values = torch.where(inside.unsqueeze(2), values, torch.full_like(values, border_value))
            acc += values * (wx * wy * scale).unsqueeze(2)
    out = torch.div(acc + (1 << (_COEF_BITS - 1)), 1 << _COEF_BITS, rounding_mode="floor").clamp_(0, 255)
    out = out.to(torch.uint8)
    return out.numpy() if from_numpy else out


def align(image, landmarks, *, image_size: int = 112):
    """The ArcFace 5-point alignment: ``image`` (uint8 ``[H, W, 3]``, numpy or torch,
    channels last) warped by the similarity that takes ``landmarks`` (``[5, 2]``, or
    the 10 numbers ``x1 y1 .. x5 y5`` of an insightface landmark line) onto
    :func:`reference_landmarks` (insightface's ``norm_crop`` template). Returns the
    same kind of array, uint8 ``[image_size, image_size, C]``.

    The landmarks are left eye, right eye, nose tip, left and right mouth corner as
    seen in the image, in pixels with pixel centres at integer coordinates.
    insightface reads landmarks and template as float32, and so does this; the
    transform is then estimated in float64 (:func:`similarity_transform`), where
    skimage, given float32 points, computes partly in float32: the matrices differ by
    about 1e-6 relative, which moves a sample across a 1/32-pixel step for about one
    output value in 10^4 (by a few grey levels at most, on sharp edges). The warp is
    :func:`warp_affine` with border value 0, like ``cv2.warpAffine``'s default.
    """
    pts = _as_points("landmarks", _flat_landmarks(landmarks), 5)
    dst = reference_landmarks(image_size)
    T = similarity_transform(pts.float().double(), dst.float().double())
    return warp_affine(image, T, image_size)


# -- IJB meta data --------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, eq=False)
class IJBMeta:
    """The image list and the protocol of an IJB release (:func:`read_meta`)."""

    root: str
    """The release's directory (holding ``meta/`` and ``loose_crop/``)."""
    target: str
    """``"IJBB"`` or ``"IJBC"`` (as given, upper case)."""
    image_dir: str
    """``<root>/loose_crop``."""
    names: tuple[str, ...]
    """Image file names under :attr:`image_dir`, in the order of the meta files."""
    landmarks: torch.Tensor
    """float64 ``[N, 5, 2]``: each image's five landmarks, (x, y) pixels."""
    faceness: torch.Tensor
    """float64 ``[N]``: the detector's score of each face."""
    templates: torch.Tensor
    """int64 ``[N]``: the template id of each image."""
    medias: torch.Tensor
    """int64 ``[N]``: the media id of each image (a video or a still)."""
    pairs: torch.Tensor
    """int64 ``[P, 2]``: the template ids of each verification pair."""
    labels: torch.Tensor
    """int64 ``[P]``: 1 for a genuine pair (one subject), 0 for an impostor pair."""

    @property
    def num_images(self) -> int:
        return len(self.names)

    @property
    def num_pairs(self) -> int:
        return self.pairs.shape[0]

    def image_path(self, index: int) -> str:
        return os.path.join(self.image_dir, self.names[index])


def _meta_file(root: str, target: str, suffix: str) -> str:
    path = os.path.join(root, "meta", f"{target.lower()}_{suffix}")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"IJB meta file not found: {path} (expected insightface's IJB layout: "
                                f"<root>/meta/{target.lower()}_{{face_tid_mid,template_pair_label,name_5pts_score}}"
                                f".txt and <root>/loose_crop/)")
    return path


def _read_int_table(path: str, num_columns: int) -> torch.Tensor:
    """int64 ``[rows, num_columns]`` from a whitespace-separated text file."""
    import numpy as np
    try:
        table = np.loadtxt(path, dtype=np.int64, ndmin=2)
    except ValueError as err:
        raise ValueError(f"{path}: expected {num_columns} integer columns per line ({err})") from None
    if table.size == 0:
        raise ValueError(f"{path} is empty")
    if table.shape[1] != num_columns:
        raise ValueError(f"{path}: expected {num_columns} columns per line, got {table.shape[1]}")
    return torch.from_numpy(table)


def _rows(path: str, num_fields: int, layout: str):
    """``(line number, line, fields)`` of each non-blank line of the text file at
    ``path``, each line checked to hold ``num_fields`` whitespace-separated fields."""
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            parts = line.split()
            if not parts:
                continue
            if len(parts) != num_fields:
                raise ValueError(f"{path}:{line_no}: expected {layout} ({num_fields} fields), got {len(parts)}: "
                                 f"{line.rstrip()!r}")
            yield line_no, line, parts


def read_meta(root: str | os.PathLike, target: str) -> IJBMeta:
    """Read insightface's packaged IJB-B/IJB-C release at ``root``:

    - ``meta/<target>_face_tid_mid.txt``: per image, ``name template_id media_id``;
    - ``meta/<target>_name_5pts_score.txt``: per image, in the same order, ``name``,
      the ten landmark coordinates ``x1 y1 .. x5 y5`` and the faceness score;
    - ``meta/<target>_template_pair_label.txt``: per pair, ``template1 template2
      label`` (1 genuine, 0 impostor);
    - ``loose_crop/``: the images (only the directory is checked here).

    ``<target>`` is ``target`` in lower case (``"ijbc"``). A missing file raises
    FileNotFoundError naming it; malformed lines, the two per-image files disagreeing
    on the image names, or a pair naming a template without images raise ValueError.
    """
    if not isinstance(target, str) or not target.isalnum():
        raise ValueError(f"target must be a name such as 'IJBC' or 'IJBB', got {target!r}")
    root = os.fspath(root)
    if not os.path.isdir(root):
        raise FileNotFoundError(f"IJB root directory not found: {root}")
    tid_mid_path = _meta_file(root, target, "face_tid_mid.txt")
    pair_path = _meta_file(root, target, "template_pair_label.txt")
    lmk_path = _meta_file(root, target, "name_5pts_score.txt")
    image_dir = os.path.join(root, "loose_crop")
    if not os.path.isdir(image_dir):
        raise FileNotFoundError(f"IJB image directory not found: {image_dir}")

    names, tid_mid = [], []
    for line_no, line, parts in _rows(tid_mid_path, 3, "'name template_id media_id'"):
        try:
            tid_mid.append((int(parts[1]), int(parts[2])))
        except ValueError:
            raise ValueError(f"{tid_mid_path}:{line_no}: template and media ids must be integers, "
                             f"got {line!r}") from None
        names.append(parts[0])
    if not names:
        raise ValueError(f"{tid_mid_path} lists no images")
    lmk, score = [], []
    for line_no, line, parts in _rows(lmk_path, 12, "'name x1 y1 .. x5 y5 score'"):
        i = len(lmk)
        if i >= len(names) or parts[0] != names[i]:
            other = names[i] if i < len(names) else "nothing (past its end)"
            raise ValueError(f"{lmk_path}:{line_no} names {parts[0]!r} where {tid_mid_path} has {other}: the "
                             f"two files must list the same images in the same order")
        try:
            values = [float(v) for v in parts[1:]]
        except ValueError:
            raise ValueError(f"{lmk_path}:{line_no}: landmarks and score must be numbers, got {line!r}") from None
        lmk.append(values[:10])
        score.append(values[10])
    if len(lmk) != len(names):
        raise ValueError(f"{lmk_path} lists {len(lmk)} images, {tid_mid_path} {len(names)}")
    ids = torch.tensor(tid_mid, dtype=torch.int64)
    table = _read_int_table(pair_path, 3)
    labels = table[:, 2].contiguous()
    if not ((labels == 0) | (labels == 1)).all():
        raise ValueError(f"{pair_path}: labels (third column) must be 0 or 1")
    pairs = table[:, :2].contiguous()
    known = torch.unique(ids[:, 0])
    missing = torch.unique(pairs[~torch.isin(pairs, known)])
    if missing.numel():
        raise ValueError(f"{pair_path}: templates {missing[:10].tolist()}{' ...' if missing.numel() > 10 else ''} "
                         f"have no images in {tid_mid_path}")
    return IJBMeta(root=root, target=target.upper(), image_dir=image_dir, names=tuple(names),
                   landmarks=torch.tensor(lmk, dtype=torch.float64).view(-1, 5, 2),
                   faceness=torch.tensor(score, dtype=torch.float64), templates=ids[:, 0].contiguous(),
                   medias=ids[:, 1].contiguous(), pairs=pairs, labels=labels)


# -- embedding ------------------------------------------------------------------------
@torch.no_grad()
def embed_images(model: Callable[[torch.Tensor], torch.Tensor], meta: IJBMeta, *, batch_size: int = 128,
                 flip: bool = True, device: torch.device | str | None = None, dtype: torch.dtype = torch.float32,
                 decode: Callable[[bytes], torch.Tensor] | None = None, num_workers: int = 2,
                 progress: Callable[[int, int], None] | None = None) -> torch.Tensor:
    """float32 ``[N, d]``: the features of every image of ``meta``, in its order.

    Each image is read from :attr:`IJBMeta.image_dir`, decoded (``decode(bytes) ->
    uint8 [3, H, W]`` RGB; default :func:`ds_pfc.data.transforms.decode_image`),
    aligned with :func:`align` and normalised to ``(x / 255 - 0.5) / 0.5``; the
    feature is ``f(x) + f(flip x)`` with ``flip`` (flipped along the width), else
    ``f(x)``, *not* normalised (see the protocol in the module docstring). Batches of
    ``batch_size`` run on ``device`` in ``dtype``; ``num_workers`` threads read, decode
    and align the next batches meanwhile (0: in the calling thread). A module is put
    in eval mode and its mode restored afterwards. ``progress(done, total)`` is called
    after each batch.
    """
    from concurrent.futures import ThreadPoolExecutor

    from ..data.transforms import decode_image, normalize
    if not isinstance(meta, IJBMeta):
        raise TypeError(f"meta must be an IJBMeta (read_meta), got {type(meta).__name__}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
        raise ValueError(f"num_workers must be an int >= 0, got {num_workers!r}")
    decode = decode if decode is not None else decode_image

    def load(index: int) -> torch.Tensor:
        path = meta.image_path(index)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as err:
            raise FileNotFoundError(f"IJB image {path} could not be read: {err}") from None
        try:
            image = decode(data)
        except Exception as err:  # decoders raise many types
            raise ValueError(f"IJB image {path} could not be decoded ({type(err).__name__}: {err})") from err
        return align(image.permute(1, 2, 0), meta.landmarks[index]).permute(2, 0, 1)

    def load_batch(start: int) -> torch.Tensor:
        return torch.stack([load(i) for i in range(start, min(start + batch_size, meta.num_images))])

    was_training = getattr(model, "training", None)
    if was_training is not None:
        model.eval()
    total = meta.num_images
    starts = list(range(0, total, batch_size))
    out = []
    pool = ThreadPoolExecutor(max_workers=num_workers) if num_workers else None
    try:
        pending = [pool.submit(load_batch, s) for s in starts[:num_workers + 1]] if pool else []
        for k, start in enumerate(starts):
            if pool:
                images = pending.pop(0).result()
                if k + num_workers + 1 < len(starts):
                    pending.append(pool.submit(load_batch, starts[k + num_workers + 1]))
            else:
                images = load_batch(start)
            x = normalize(images).to(device or "cpu", dtype)
            feat = model(x).float()
            if flip:
                feat = feat + model(x.flip(3)).float()
            out.append(feat.cpu())
            if progress is not None:
                progress(min(start + batch_size, total), total)
    finally:
        if pool:
            pool.shutdown(wait=True, cancel_futures=True)
        if was_training is not None:
            model.train(was_training)
    return torch.cat(out)


# -- scores and metrics ---------------------------------------------------------------
def _int_vector(name: str, value, num: int | None = None) -> torch.Tensor:
    t = torch.as_tensor(value)
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise TypeError(f"{name} must hold integers, got dtype {t.dtype}")
    t = t.to("cpu", torch.int64)
    if t.dim() != 1 or (num is not None and t.shape[0] != num):
        raise ValueError(f"{name} must have shape [{num if num is not None else 'N'}], got {tuple(t.shape)}")
    return t


def pool_templates(features, templates, medias) -> tuple[torch.Tensor, torch.Tensor]:
    """``(template_ids [T], template_features [T, d])``: one L2-normalised float64
    feature per distinct template id (ascending), from the image ``features [N, d]``
    with their ``templates [N]`` and ``medias [N]`` ids.

    A template's feature is the mean of its images' features within each media,
    summed over its media (not averaged: insightface's choice), then L2-normalised; a
    zero sum stays zero. Images of one media id in two templates count in each.
    """
    feats = torch.as_tensor(features)
    if not feats.is_floating_point() or feats.dim() != 2:
        raise ValueError(f"features must be a floating-point [N, d] array, got "
                         f"{feats.dtype} {tuple(feats.shape)}")
    feats = feats.detach().to("cpu", torch.float64)
    if not torch.isfinite(feats).all():
        raise ValueError("features contain NaN or Inf")
    num = feats.shape[0]
    templates = _int_vector("templates", templates, num)
    medias = _int_vector("medias", medias, num)
    template_ids, t_index = torch.unique(templates, return_inverse=True)
    _, group = torch.unique(torch.stack([t_index, medias], 1), dim=0, return_inverse=True)
    num_groups = int(group.max()) + 1 if num else 0
    counts = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, group, torch.ones(num, dtype=torch.float64))
    media_mean = torch.zeros(num_groups, feats.shape[1], dtype=torch.float64).index_add_(0, group, feats)
    media_mean /= counts.unsqueeze(1)
    group_template = torch.zeros(num_groups, dtype=torch.int64).scatter_(0, group, t_index)
    pooled = torch.zeros(template_ids.shape[0], feats.shape[1], dtype=torch.float64)
    pooled.index_add_(0, group_template, media_mean)
    norm = pooled.norm(dim=1, keepdim=True)
    pooled = torch.where(norm > 0, pooled / torch.where(norm > 0, norm, 1.0), pooled)
    return template_ids, pooled


def roc_curve(scores, labels, *, drop_intermediate: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(fpr, tpr, thresholds)``, float64, of the pairs with ``scores`` (higher =
    more alike) and 0/1 ``labels``; sklearn's ``roc_curve`` semantics, which
    insightface calls with its defaults.

    One point per distinct score, in decreasing score order, a pair being accepted
    when its score is ``>= threshold``; a first point ``(0, 0)`` with threshold
    ``+inf``. ``drop_intermediate`` (sklearn's default, so insightface's) drops the
    points that lie in the middle of a straight run of the curve, i.e. where both the
    false and the true positive counts change by the same amounts on either side;
    this can move the point :func:`tar_at_far` picks. Needs at least one genuine and
    one impostor pair.
    """
    s = torch.as_tensor(scores).detach().to("cpu", torch.float64).reshape(-1)
    y = _int_vector("labels", labels, s.shape[0])
    if not ((y == 0) | (y == 1)).all():
        raise ValueError("labels must be 0 or 1")
    if not torch.isfinite(s).all():
        raise ValueError("scores contain NaN or Inf")
    num_pos = int(y.sum())
    if num_pos == 0 or num_pos == y.numel():
        raise ValueError(f"a ROC needs genuine and impostor pairs, got {num_pos} genuine of {y.numel()}")
    order = torch.argsort(s, descending=True, stable=True)
    s, y = s[order], y[order]
    last = torch.nonzero(s[1:] != s[:-1]).flatten()
    idx = torch.cat([last, torch.tensor([s.numel() - 1])])
    tps = torch.cumsum(y, 0)[idx]
    fps = idx + 1 - tps
    thresholds = s[idx]
    if drop_intermediate and tps.numel() > 2:
        bend = (torch.diff(fps, 2) != 0) | (torch.diff(tps, 2) != 0)
        keep = torch.cat([torch.tensor([True]), bend, torch.tensor([True])])
        tps, fps, thresholds = tps[keep], fps[keep], thresholds[keep]
    zero = torch.zeros(1, dtype=torch.int64)
    tps, fps = torch.cat([zero, tps]).double(), torch.cat([zero, fps]).double()
    thresholds = torch.cat([torch.tensor([math.inf], dtype=torch.float64), thresholds])
    return fps / fps[-1], tps / tps[-1], thresholds


def tar_at_far(fpr, tpr, fars: Sequence[float] = DEFAULT_FARS) -> tuple[dict[float, float], dict[float, float]]:
    """``(tar, achieved)``: for each target ``far``, the TPR of the ROC point whose
    FPR is nearest to ``far`` (``min |fpr - far|``; among equally near points the one
    with the largest TPR), and the FPR of that point. insightface's rule: it is *not*
    the best TPR at FPR <= far, and with fewer than ``1 / far`` impostor pairs it
    reads the point nearest to the target, often at FPR 0."""
    fpr = torch.as_tensor(fpr, dtype=torch.float64).reshape(-1)
    tpr = torch.as_tensor(tpr, dtype=torch.float64).reshape(-1)
    if fpr.shape != tpr.shape or fpr.numel() == 0:
        raise ValueError(f"fpr and tpr must be non-empty and of one length, got {fpr.numel()} and {tpr.numel()}")
    # insightface flips the curve and takes the first nearest point: on a ROC with
    # increasing FPR and TPR, the last (largest TPR) point of the original order.
    fpr_r, tpr_r = fpr.flip(0), tpr.flip(0)
    tar, achieved = {}, {}
    for far in fars:
        far = float(far)
        if not 0.0 < far <= 1.0:
            raise ValueError(f"fars must lie in (0, 1], got {far}")
        i = int(torch.argmin((fpr_r - far).abs()))
        tar[far], achieved[far] = float(tpr_r[i]), float(fpr_r[i])
    return tar, achieved


@dataclass(frozen=True, kw_only=True, eq=False)
class IJBResult:
    """What :func:`evaluate` measured."""

    tar_at_far: dict[float, float]
    """TAR at each target FAR (insightface's nearest-point rule, :func:`tar_at_far`)."""
    achieved_far: dict[float, float]
    """The FPR of the ROC point each TAR was read at."""
    auc: float
    """Area under the ROC (trapezoids, as sklearn ``auc``)."""
    fpr: torch.Tensor = field(repr=False)
    """float64 ROC false positive rates (:func:`roc_curve`)."""
    tpr: torch.Tensor = field(repr=False)
    """float64 ROC true positive rates."""
    thresholds: torch.Tensor = field(repr=False)
    """float64 score thresholds of the ROC points (the first is +inf)."""
    scores: torch.Tensor = field(repr=False)
    """float64 ``[P]``: the cosine score of each pair, in the pairs' order."""
    labels: torch.Tensor = field(repr=False)
    """int64 ``[P]``: the pairs' labels."""


def evaluate(features, templates, medias, pairs, labels, *, faceness=None, use_norm_score: bool = True,
             use_detector_score: bool = True, fars: Sequence[float] = DEFAULT_FARS,
             drop_intermediate: bool = True) -> IJBResult:
    """IJB 1:1 template verification from per-image features (insightface's
    pipeline, see the module docstring).

    Args:
        features: ``[N, d]`` per image, already ``f(x) + f(flip x)`` when flip
            testing (:func:`embed_images`), not normalised.
        templates, medias: ``[N]`` integer template and media id of each image.
        pairs: ``[P, 2]`` template ids of the pairs; every id must have images.
        labels: ``[P]`` 1 for genuine, 0 for impostor pairs.
        faceness: ``[N]`` detector scores; required when ``use_detector_score``.
        use_norm_score: keep each image feature's norm (insightface's default);
            False normalises them first.
        use_detector_score: weight each image feature by its faceness score.
        fars: target false accept rates.
        drop_intermediate: as in :func:`roc_curve` (sklearn's and insightface's
            default True).
    """
    feats = torch.as_tensor(features)
    if not feats.is_floating_point() or feats.dim() != 2:
        raise ValueError(f"features must be a floating-point [N, d] array, got {feats.dtype} {tuple(feats.shape)}")
    feats = feats.detach().to("cpu", torch.float64, copy=True)    # ours: scaled in place below
    num = feats.shape[0]
    if not torch.isfinite(feats).all():
        raise ValueError("features contain NaN or Inf")
    pairs = torch.as_tensor(pairs)
    if pairs.dtype.is_floating_point or pairs.dtype == torch.bool or pairs.dim() != 2 or pairs.shape[1] != 2:
        raise ValueError(f"pairs must be an integer [P, 2] array of template ids, got {pairs.dtype} "
                         f"{tuple(pairs.shape)}")
    pairs = pairs.to("cpu", torch.int64)
    labels = _int_vector("labels", labels, pairs.shape[0])
    if not use_norm_score:
        norm = feats.norm(dim=1, keepdim=True)
        feats.div_(torch.where(norm > 0, norm, 1.0))
    if use_detector_score:
        if faceness is None:
            raise ValueError("faceness is required with use_detector_score=True (pass the detector scores, or "
                             "use_detector_score=False)")
        score = torch.as_tensor(faceness).detach().to("cpu", torch.float64).reshape(-1)
        if score.shape[0] != num or not torch.isfinite(score).all():
            raise ValueError(f"faceness must hold {num} finite scores (one per image), got {tuple(score.shape)}")
        feats.mul_(score.unsqueeze(1))
    template_ids, pooled = pool_templates(feats, templates, medias)
    row = torch.searchsorted(template_ids, pairs)
    found = row < template_ids.numel()
    found &= template_ids[row.clamp(max=template_ids.numel() - 1)] == pairs
    if not found.all():
        missing = torch.unique(pairs[~found])
        raise ValueError(f"pairs name templates without images: {missing[:10].tolist()}"
                         f"{' ...' if missing.numel() > 10 else ''}")
    scores = torch.empty(pairs.shape[0], dtype=torch.float64)
    chunk = 16384   # bounded memory: the real IJB-C protocol has 15.7M pairs
    for start in range(0, pairs.shape[0], chunk):
        r = row[start:start + chunk]
        scores[start:start + chunk] = (pooled[r[:, 0]] * pooled[r[:, 1]]).sum(1)
    fpr, tpr, thresholds = roc_curve(scores, labels, drop_intermediate=drop_intermediate)
    tar, achieved = tar_at_far(fpr, tpr, fars)
    auc = float(torch.trapezoid(tpr, fpr))
    return IJBResult(tar_at_far=tar, achieved_far=achieved, auc=auc, fpr=fpr, tpr=tpr, thresholds=thresholds,
                     scores=scores, labels=labels)


# -- plot -----------------------------------------------------------------------------
def plot_roc(results: dict[str, IJBResult], path: str | os.PathLike, *, title: str = "ROC",
             fars: Sequence[float] = DEFAULT_FARS) -> str:
    """Write a PNG with one ROC curve per entry of ``results`` (``label ->
    IJBResult``): TPR against FPR on a log axis spanning ``fars`` to 1, with each
    curve's AUC in the legend. Points at FPR 0 cannot be drawn on a log axis. Needs
    matplotlib (``pip install ds_pfc[plots]``). Returns ``path``."""
    try:
        from matplotlib.figure import Figure   # no pyplot: no global backend or state
    except ImportError:
        raise RuntimeError("plotting the ROC needs matplotlib: pip install 'ds_pfc[plots]'") from None
    if not results:
        raise ValueError("results is empty: nothing to plot")
    low = min(float(f) for f in fars)
    fig = Figure(figsize=(7, 5.5), dpi=120)
    ax = fig.add_subplot()
    lowest = 1.0
    for label, r in results.items():
        visible = r.fpr >= low
        if visible.any():
            lowest = min(lowest, float(r.tpr[visible].min()))
        ax.plot(r.fpr.numpy(), r.tpr.numpy(), lw=1.2, label=f"{label} (AUC {r.auc:.4f})")
    ax.set_xscale("log")
    ax.set_xlim(low, 1.0)
    ax.set_ylim(max(0.0, min(0.3, math.floor(lowest * 10) / 10)), 1.0)
    ax.set_xticks([float(f) for f in fars] + ([1.0] if 1.0 not in fars else []))
    ax.grid(True, which="major", linestyle="--", linewidth=0.6)
    ax.set_xlabel("False Positive Rate")
    ax.set_ylabel("True Positive Rate")
    ax.set_title(title)
    ax.legend(loc="lower right")
    fig.tight_layout()
    path = os.fspath(path)
    fig.savefig(path)
    return path
