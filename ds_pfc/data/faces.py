"""Procedural face-like identities: a built-in data set a small CNN can learn on CPU.

:class:`SyntheticFaces` renders RGB images of an unbounded space of identities defined
by ``seed``. Identity ``c`` is a set of shape and colour parameters drawn from a
generator seeded by a hash of ``(seed, c)``: face oval and jaw, skin tone, skin marks,
hair (colour, volume, length, hairline, parting, fringe, baldness), ears, eyes (spacing,
height, size, shape, tilt, iris colour), eyebrows, nose, mouth and lips, a beard and
glasses for some. Image ``n`` of identity ``c`` adds nuisances drawn from a hash of
``(seed, c, n)``:

- pose: in-plane rotation (up to 18 degrees), scale (0.9-1.1), translation, and a yaw
  that moves the inner features sideways inside the face oval;
- expression: smile, open mouth, eye openness, gaze, raised brows;
- scene: background grey level, tint and gradient, clothing colour, and in 15% of the
  images an occluding rectangle;
- lighting: brightness, contrast, a directional gradient and a colour cast;
- sensor: pixel noise (standard deviation 2-10 grey levels).

The nuisances are strong enough that raw pixels do not solve verification: the
cosine of raw pixels verifies held-out identities at about 0.55-0.65 accuracy, a
small CNN trained for a minute or two at about 0.9 (numbers in the tests and the
README), so a quickstart on this data measures open-set recognition.

Every image is a pure function of ``(seed, identity, image number, image_size)``: no
generator state is kept, so it is the same in every process, DataLoader worker and
resumed run, and the same whichever dataset object renders it. A held-out set is
``SyntheticFaces(n_val, k, first_identity=n_train, seed=same_seed)``.

How it is drawn: the face is rendered with alpha in a canonical, upright frame (each
inner feature only on the box it can occupy), warped by the pose with
``grid_sample``, composited over the background and lit. The per-pixel arithmetic is
+, -, * (no tensor division), sqrt, clamp and comparisons, with no reductions: each
is correctly rounded in the vectorised and the scalar kernels alike, so an image does
not depend on the batch it is rendered in nor on the number of threads. Cosines and
sines are computed per image in Python, the noise from uniforms by exact arithmetic.

Speed: about 0.6 ms per 112x112 image on one core for a batch (:meth:`render`,
``__getitems__``), about 1.8 ms for a single ``__getitem__`` (fixed per-call costs).
Rendering is a long chain of small element-wise ops: run it with one intra-op thread
(DataLoader workers have one); spread over several threads on busy cores it can be
many times slower.
"""
from __future__ import annotations

import functools
import hashlib
import math
import operator

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from .._checks import check_int
from .synthetic import check_pair_arguments, draw_pairs

__all__ = ["SyntheticFaces"]

_MASK63 = (1 << 63) - 1


def _hash_seed(*parts) -> int:
    """63-bit generator seed for ``parts`` (blake2b, the same in every process; the
    style of :func:`ds_pfc.data.sampler.epoch_seed`, in its own namespace)."""
    text = "faces:" + ":".join(str(p) for p in parts)
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") & _MASK63


# -- parameter tables -----------------------------------------------------------------
# Each entry: (name, low, high); a parameter is low + (high - low) * U[0, 1).
# Coordinates: canonical frame [-1, 1]^2, x to the right, y downwards.
_IDENTITY_PARAMS = (
    ("face_w", 0.46, 0.64), ("face_h", 0.60, 0.78), ("face_y", -0.04, 0.06), ("jaw", 0.0, 0.45),
    ("skin_tone", 0.0, 1.0), ("skin_r", -0.06, 0.06), ("skin_g", -0.05, 0.05), ("skin_b", -0.05, 0.05),
    ("hair_kind", 0.0, 1.0), ("hair_r", -0.08, 0.08), ("hair_g", -0.06, 0.06), ("hair_b", -0.06, 0.06),
    ("hair_volume", 0.03, 0.22), ("hair_top", 0.0, 0.16), ("hair_len", -0.25, 0.95),
    ("hairline", 0.22, 0.52), ("parting", -0.35, 0.35), ("fringe_curve", -0.1, 0.5), ("bald", 0.0, 1.0),
    ("ear", 0.7, 1.3),
    ("eye_y", -0.22, -0.04), ("eye_x", 0.16, 0.30), ("eye_w", 0.06, 0.10), ("eye_aspect", 0.38, 0.75),
    ("eye_tilt", -0.25, 0.25), ("iris_kind", 0.0, 1.0), ("iris_size", 0.42, 0.62),
    ("brow_gap", 0.06, 0.14), ("brow_len", 0.08, 0.16), ("brow_thick", 0.014, 0.040), ("brow_tilt", -0.35, 0.35),
    ("brow_dx", -0.03, 0.04),
    ("nose_len", 0.16, 0.30), ("nose_w", 0.045, 0.10), ("nostril", 0.016, 0.032),
    ("mouth_gap", 0.08, 0.20), ("mouth_w", 0.10, 0.22), ("lip", 0.018, 0.05), ("lip_r", 0.0, 1.0),
    ("beard", 0.0, 1.0), ("beard_density", 0.55, 0.95),
    ("mark_amp", 0.05, 0.3), ("glasses", 0.0, 1.0), ("glasses_size", 1.5, 2.1),
)
_NUM_MARKS = 4  # skin marks (moles, freckle patches, blemishes): position, radius, sign
_MARK_PARAMS = (("mx", -0.45, 0.45), ("my", -0.5, 0.6), ("mr", 0.025, 0.10), ("ms", -1.0, 0.6))

_IMAGE_PARAMS = (
    ("angle", -18.0, 18.0), ("scale", 0.9, 1.1), ("tx", -0.09, 0.09), ("ty", -0.08, 0.10), ("yaw", -0.8, 0.8),
    ("smile", -0.25, 0.45), ("open", -0.03, 0.045), ("eye_open", 0.35, 1.15), ("gaze_x", -0.3, 0.3),
    ("gaze_y", -0.15, 0.15), ("brow_raise", -0.015, 0.03),
    ("bg", 0.1, 0.9), ("bg_r", -0.18, 0.18), ("bg_g", -0.18, 0.18), ("bg_b", -0.18, 0.18), ("bg_gx", -0.2, 0.2),
    ("bg_gy", -0.2, 0.2),
    ("cloth_r", 0.05, 0.9), ("cloth_g", 0.05, 0.9), ("cloth_b", 0.05, 0.9),
    ("gain", 0.65, 1.3), ("contrast", 0.7, 1.15), ("light_angle", 0.0, 2 * math.pi), ("light", 0.0, 0.45),
    ("cast_r", -0.10, 0.10), ("cast_g", -0.08, 0.08), ("cast_b", -0.10, 0.10),
    ("occlude", 0.0, 1.0), ("oc_x0", -1.0, 0.6), ("oc_y0", -1.0, 0.6), ("oc_w", 0.25, 0.9), ("oc_h", 0.25, 0.9),
    ("oc_r", 0.0, 1.0), ("oc_g", 0.0, 1.0), ("oc_b", 0.0, 1.0),
    ("noise", 2.0, 10.0),
)
_OCCLUDE_P = 0.15

_SKIN_LIGHT = (0.96, 0.80, 0.68)
_SKIN_DARK = (0.34, 0.21, 0.13)
_HAIR = ((0.07, 0.06, 0.06), (0.30, 0.18, 0.10), (0.55, 0.36, 0.18), (0.85, 0.70, 0.42),
         (0.62, 0.24, 0.10), (0.62, 0.62, 0.62))
_IRIS = ((0.28, 0.16, 0.08), (0.45, 0.30, 0.12), (0.25, 0.45, 0.72), (0.30, 0.50, 0.30), (0.12, 0.10, 0.10))
_NUM_ID = len(_IDENTITY_PARAMS) + _NUM_MARKS * len(_MARK_PARAMS)
_NUM_IMG = len(_IMAGE_PARAMS)


def _table(spec):
    low = torch.tensor([lo for _, lo, _ in spec], dtype=torch.float64)
    high = torch.tensor([hi for _, _, hi in spec], dtype=torch.float64)
    return {name: i for i, (name, _, _) in enumerate(spec)}, low, high - low


_ID_INDEX, _ID_LOW, _ID_SPAN = _table(_IDENTITY_PARAMS)
_IMG_INDEX, _IMG_LOW, _IMG_SPAN = _table(_IMAGE_PARAMS)
_MARK_LOW = torch.tensor([lo for _, lo, _ in _MARK_PARAMS], dtype=torch.float64)
_MARK_SPAN = torch.tensor([hi - lo for _, lo, hi in _MARK_PARAMS], dtype=torch.float64)


class _P:
    """Named columns of a ``[B, K]`` float64 parameter table as ``[B, 1, 1]`` float32."""

    def __init__(self, values: torch.Tensor, index: dict[str, int]):
        self._v, self._i = values.float(), index

    def __getattr__(self, name: str) -> torch.Tensor:
        column = self._v[:, self._i[name]].view(-1, 1, 1)
        setattr(self, name, column)  # later reads skip __getattr__
        return column


# Per-pixel arithmetic below is +, -, * (never a tensor division: a divisor of one
# element may take another code path), sqrt, clamp and comparisons: every one is
# correctly rounded in the vectorised and the scalar kernels alike, so a pixel does
# not depend on where it lies in the batch or on how the work is split into threads.

def _ramp(inside: torch.Tensor, edge: float) -> torch.Tensor:
    """Anti-aliased coverage from a signed "inside" measure (> 0 inside), ``edge`` wide."""
    return (inside * (1.0 / edge) + 0.5).clamp_(0.0, 1.0)


def _ellipse(u, v, cx, cy, a, b, edge):
    """Coverage of the axis-aligned ellipse centred ``(cx, cy)`` with half-axes ``a, b``
    (``u`` a row ``[., 1, w]``, ``v`` a column ``[., h, 1]``). The inside measure
    ``(1 - r) * min(a, b)`` approximates the distance to the border."""
    du, dv = (u - cx) * a.reciprocal(), (v - cy) * b.reciprocal()
    r = (du * du + dv * dv).sqrt_()
    return _ramp((1.0 - r) * torch.minimum(a, b), edge)


def _rotated_ellipse(u, v, cx, cy, a, b, tilt, edge):
    """:func:`_ellipse` turned by the small angle ``tilt`` (radians; cos, sin ~ 1 - t^2/2, t)."""
    cos_t, sin_t = 1.0 - tilt * tilt * 0.5, tilt
    du, dv = u - cx, v - cy
    ia, ib = a.reciprocal(), b.reciprocal()
    q = du * (cos_t * ia) + dv * (sin_t * ia)
    r = dv * (cos_t * ib) - du * (sin_t * ib)
    d = (q * q + r * r).sqrt_()
    return _ramp((1.0 - d) * torch.minimum(a, b), edge)


def _over(color, alpha, layer_rgb, layer_alpha):
    """Premultiplied "layer over image", in place: ``color [B, 3, h, w]`` and ``alpha
    [B, h, w]`` (or None: unchanged), a straight ``layer_rgb`` and its coverage
    ``layer_alpha [B, h, w]``."""
    a = layer_alpha.unsqueeze(1)
    color.mul_(1.0 - a).add_(layer_rgb * a)
    if alpha is not None:
        alpha.mul_(1.0 - layer_alpha).add_(layer_alpha)


def _palette(colors, choice: torch.Tensor) -> torch.Tensor:
    """Row ``floor(choice * len(colors))`` of ``colors`` for each entry of ``choice [B]``."""
    table = torch.tensor(colors, dtype=torch.float64)
    return table[(choice * len(colors)).long().clamp_(0, len(colors) - 1)]


@functools.lru_cache(maxsize=8)
def _noise_bank(size: int) -> torch.Tensor:
    """Zero-mean, unit-variance noise ``[3, 2 size, 2 size]``, a fixed function of
    ``size``: each image takes a window of it at a random offset (a copy, far cheaper
    than drawing ``3 size^2`` normals per image). Near-Gaussian: the sum of four
    uniforms (Irwin-Hall), built from ``torch.rand`` and exact arithmetic rather than
    ``randn``, whose vectorised transcendental math may differ between CPU types."""
    g = torch.Generator().manual_seed(_hash_seed("noise", size))
    u = torch.rand(4, 3, 2 * size, 2 * size, generator=g, dtype=torch.float64)
    return ((u[0] + u[1] + u[2] + u[3] - 2.0) * math.sqrt(3.0)).float()


class SyntheticFaces(Dataset):
    """Identities ``first_identity .. first_identity + num_identities - 1`` of the
    procedural face space defined by ``seed``, ``images_per_identity`` images each.

    Item ``index`` is image ``index % images_per_identity`` of identity
    ``first_identity + index // images_per_identity`` and has label
    ``index // images_per_identity`` (identity minus ``first_identity``): a uint8
    ``[3, image_size, image_size]`` RGB image in pixel units. The face backbones of
    :mod:`ds_pfc.models` take ``image_size=112`` (the default) only.

    Args:
        num_identities: number of identities (classes), >= 1.
        images_per_identity: images per identity, >= 1; the training images are image
            numbers ``0 .. images_per_identity - 1``; :meth:`pairs` uses later ones.
        image_size: height and width in pixels, >= 16.
        first_identity: first identity of the unbounded space, >= 0.
        seed: defines the identity space and every image (any int).
    """

    def __init__(self, num_identities: int, images_per_identity: int, *, image_size: int = 112,
                 first_identity: int = 0, seed: int = 0):
        self.num_identities = check_int("num_identities", num_identities, 1)
        self.images_per_identity = check_int("images_per_identity", images_per_identity, 1)
        self.image_size = check_int("image_size", image_size, 16)
        self.first_identity = check_int("first_identity", first_identity, 0)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {type(seed).__name__} {seed!r}")
        self.seed = seed

    # -- Dataset -------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.num_identities * self.images_per_identity

    @property
    def num_classes(self) -> int:
        return self.num_identities

    def __getitem__(self, index) -> tuple[torch.Tensor, int]:
        label, image_number = self._locate(index)
        image = self.render(torch.tensor([self.first_identity + label]), torch.tensor([image_number]))[0]
        return image, label

    def __getitems__(self, indices) -> list[tuple[torch.Tensor, int]]:
        """``[self[i] for i in indices]``, rendered as one batch: the DataLoader calls
        this (instead of ``__getitem__`` per item) when the dataset has it."""
        items = [self._locate(index) for index in indices]
        if not items:
            return []
        labels = [label for label, _ in items]
        images = self.render(torch.tensor(labels) + self.first_identity, torch.tensor([n for _, n in items]))
        return list(zip(images.unbind(0), labels))

    def _locate(self, index) -> tuple[int, int]:
        """``(label, image number)`` of item ``index`` (negative counts from the end)."""
        try:
            i = operator.index(index)
        except TypeError:
            raise TypeError(f"index must be an int, got {type(index).__name__} {index!r}") from None
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"index {i} out of range for a dataset of {n} images")
        return divmod(i % n, self.images_per_identity)

    def labels(self) -> torch.Tensor:
        """int64 ``[len(self)]``: the label of every item, without rendering."""
        return torch.arange(self.num_identities, dtype=torch.int64).repeat_interleave(self.images_per_identity)

    def __repr__(self) -> str:
        return (f"SyntheticFaces(num_identities={self.num_identities}, images_per_identity="
                f"{self.images_per_identity}, image_size={self.image_size}, first_identity="
                f"{self.first_identity}, seed={self.seed})")

    # -- verification pairs --------------------------------------------------------------
    def pairs(self, num_pairs: int, *, seed: int = 0) -> tuple[torch.Tensor, list[bool]]:
        """1:1 verification pairs among this dataset's identities, in insightface
        ``.bin`` order: ``(images [2P, 3, H, W] uint8, issame [P])``, pair ``i`` being
        images ``2i`` and ``2i + 1``.

        ``P // 2`` pairs are "same" (two different images of one identity) and the
        rest "different" (two different identities), in a shuffled order. The images
        are new: their image numbers are ``>= images_per_identity``, so the pairs of a
        training set never show a training image. A pure function of the dataset and
        ``seed``. Needs ``num_identities >= 2`` when there is a "different" pair.
        """
        num_pairs = check_pair_arguments(num_pairs, seed, self.num_identities)
        g = torch.Generator().manual_seed(_hash_seed("pairs", self.seed, self.first_identity, self.num_identities,
                                                     self.images_per_identity, num_pairs, seed))
        identities, numbers, same = draw_pairs(num_pairs, self.num_identities, self.first_identity,
                                               self.images_per_identity, g)
        return self.render(identities, numbers), same.tolist()

    # -- rendering -----------------------------------------------------------------------
    def render(self, identities: torch.Tensor, image_numbers: torch.Tensor, *, chunk_size: int = 8) -> torch.Tensor:
        """uint8 ``[B, 3, H, W]``: image ``image_numbers[b]`` of identity ``identities[b]``.

        ``identities`` are absolute identity ids of this dataset's space (``seed``),
        any ``>= 0``, not labels; ``image_numbers`` any ``>= 0``. Both are integer
        tensors of shape ``[B]``. Rendered ``chunk_size`` images at a time (cache-sized
        working set); the result does not depend on ``chunk_size`` or on the batch.
        """
        ids, nums = self._check_images(identities, image_numbers)
        chunk_size = check_int("chunk_size", chunk_size, 1)
        size = self.image_size
        out = torch.empty(ids.shape[0], 3, size, size, dtype=torch.uint8)
        id_list, num_list = ids.tolist(), nums.tolist()
        # (The thread count is left alone: torch.set_num_threads is process-wide, and
        # changing it from a loader thread would change the training thread's kernels.)
        with torch.no_grad():
            for start in range(0, len(id_list), chunk_size):
                stop = min(start + chunk_size, len(id_list))
                out[start:stop].copy_(self._render_chunk(*self._draw(id_list[start:stop], num_list[start:stop])))
        return out

    def landmarks(self, identities: torch.Tensor, image_numbers: torch.Tensor, *,
                  chunk_size: int = 64) -> torch.Tensor:
        """float64 ``[B, 5, 2]``: the five face landmarks of the images :meth:`render`
        draws for the same ``identities`` and ``image_numbers``, as ``(x, y)`` pixel
        coordinates of this dataset's ``image_size``.

        The points, in insightface's order (left and right as seen in the image): the
        left eye, the right eye, the nose tip, the left and the right mouth corner. An
        eye is the centre of its pupil (it follows the gaze), the nose tip the centre of
        the drawn tip, a mouth corner the end of the lips. Pixel convention as OpenCV
        and insightface's landmark files: pixel ``(row i, column j)`` covers
        ``[j - 0.5, j + 0.5] x [i - 0.5, i + 0.5]``, so the top-left pixel's centre is
        ``(0, 0)``. Computed from the identity and pose parameters the renderer draws,
        the canonical points mapped through the pose (the inverse of the map the
        renderer samples with), without rendering; a point hidden by an occluder or
        the eyelids is still reported.
        """
        ids, nums = self._check_images(identities, image_numbers)
        chunk_size = check_int("chunk_size", chunk_size, 1)
        id_list, num_list = ids.tolist(), nums.tolist()
        id_v = torch.empty(len(id_list), len(_IDENTITY_PARAMS), dtype=torch.float64)
        img_v = torch.empty(len(id_list), _NUM_IMG, dtype=torch.float64)
        for start in range(0, len(id_list), chunk_size):
            stop = min(start + chunk_size, len(id_list))
            id_v[start:stop], _, img_v[start:stop], _ = self._draw(id_list[start:stop], num_list[start:stop])

        def p(name):
            return id_v[:, _ID_INDEX[name]]

        def q(name):
            return img_v[:, _IMG_INDEX[name]]

        # Canonical frame ([-1, 1]^2), the same expressions as _render_chunk.
        yaw = q("yaw")
        eye_y = p("face_y") + p("eye_y")
        eye_h = p("eye_w") * p("eye_aspect") * q("eye_open")
        pupil_x = yaw * 0.10 + q("gaze_x") * p("eye_w") * 0.5     # both pupils move with the gaze
        pupil_y = eye_y + q("gaze_y") * eye_h
        nose_bot = eye_y + 0.02 + p("nose_len")
        corner_y = nose_bot + p("mouth_gap") - q("smile") * 0.06   # the lips' centre line at |mu| = 1
        mouth_x = yaw * 0.09
        cu = torch.stack([pupil_x - p("eye_x"), pupil_x + p("eye_x"), yaw * 0.13,
                          mouth_x - p("mouth_w"), mouth_x + p("mouth_w")], 1)
        cv = torch.stack([pupil_y, pupil_y, nose_bot - p("nose_w") * 0.3, corner_y, corner_y], 1)

        # The renderer samples the canonical face at R(-angle) (x - t) / scale for an
        # image point x; a canonical point c is therefore drawn at scale R(angle) c + t.
        angle = torch.deg2rad(q("angle")).view(-1, 1)
        cos_a, sin_a = torch.cos(angle) * q("scale").view(-1, 1), torch.sin(angle) * q("scale").view(-1, 1)
        x = cu * cos_a - cv * sin_a + q("tx").view(-1, 1)
        y = cu * sin_a + cv * cos_a + q("ty").view(-1, 1)
        # grid_sample's align_corners=False: canonical u is pixel column (u + 1) size / 2 - 0.5.
        half = self.image_size / 2.0
        return torch.stack([(x + 1.0) * half - 0.5, (y + 1.0) * half - 0.5], 2)

    @classmethod
    def _check_images(cls, identities, image_numbers) -> tuple[torch.Tensor, torch.Tensor]:
        """``identities`` and ``image_numbers`` as int64 CPU tensors of one shape ``[B]``."""
        ids = cls._check_index_tensor("identities", identities)
        nums = cls._check_index_tensor("image_numbers", image_numbers)
        if ids.shape != nums.shape:
            raise ValueError(f"identities and image_numbers must have the same shape, got {tuple(ids.shape)} "
                             f"and {tuple(nums.shape)}")
        return ids, nums

    @staticmethod
    def _check_index_tensor(name: str, value) -> torch.Tensor:
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor of int64, got {type(value).__name__}")
        if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
            raise TypeError(f"{name} must be an integer tensor, got dtype {value.dtype}")
        if value.dim() != 1:
            raise ValueError(f"{name} must have shape [B], got shape {tuple(value.shape)}")
        value = value.to("cpu", torch.int64)
        if value.numel() and int(value.min()) < 0:
            raise ValueError(f"{name} must be >= 0, got a minimum of {int(value.min())}")
        return value

    def _draw(self, id_list, num_list):
        """The random draws of a chunk, each image's from generators seeded by hashes of
        ``(seed, identity)`` and ``(seed, identity, image number)``: identity parameters
        ``[B, K]`` and skin marks ``[B, M, 4]`` (float64), image parameters ``[B, K']``
        (float64) and the scaled pixel noise ``[B, 3, H, W]`` (float32)."""
        size = self.image_size
        bank = _noise_bank(size)
        id_u = torch.empty(len(id_list), _NUM_ID, dtype=torch.float64)
        img_u = torch.empty(len(id_list), _NUM_IMG + 2, dtype=torch.float64)
        noise = torch.empty(len(id_list), 3, size, size)
        cache: dict[int, torch.Tensor] = {}
        for b, (c, n) in enumerate(zip(id_list, num_list)):
            if c not in cache:
                g = torch.Generator().manual_seed(_hash_seed(self.seed, c))
                cache[c] = torch.rand(_NUM_ID, generator=g, dtype=torch.float64)
            id_u[b] = cache[c]
            g = torch.Generator().manual_seed(_hash_seed(self.seed, c, n))
            img_u[b] = torch.rand(_NUM_IMG + 2, generator=g, dtype=torch.float64)
        img_v = _IMG_LOW + _IMG_SPAN * img_u[:, :_NUM_IMG]
        offsets = (img_u[:, _NUM_IMG:] * size).long().clamp_(0, size - 1).tolist()
        sigma = img_v[:, _IMG_INDEX["noise"]].float().tolist()
        for b, ((ox, oy), s) in enumerate(zip(offsets, sigma)):
            torch.mul(bank[:, oy:oy + size, ox:ox + size], s, out=noise[b])
        marks = _MARK_LOW + _MARK_SPAN * id_u[:, len(_IDENTITY_PARAMS):].reshape(-1, _NUM_MARKS, len(_MARK_PARAMS))
        return _ID_LOW + _ID_SPAN * id_u[:, :len(_IDENTITY_PARAMS)], marks, img_v, noise

    def _render_chunk(self, id_v, marks, img_v, noise) -> torch.Tensor:
        B, size = id_v.shape[0], self.image_size
        p, q = _P(id_v, _ID_INDEX), _P(img_v, _IMG_INDEX)
        edge = 2.0 / size * 1.2  # anti-aliasing ramp, ~1.2 pixels
        coords = (torch.arange(size, dtype=torch.float32) * 2.0 + 1.0) * (1.0 / size) - 1.0
        u, v = coords.view(1, 1, size), coords.view(1, size, 1)

        def box(x0: float, x1: float, y0: float, y1: float):
            """Column and row slices of the canonical pixels covering [x0, x1] x [y0, y1]."""
            def axis(lo, hi):
                return slice(max(0, math.floor((lo + 1.0) * size / 2.0)), min(size, math.ceil((hi + 1.0) * size / 2.0)))
            return axis(x0, x1), axis(y0, y1)

        def rgb(values: torch.Tensor) -> torch.Tensor:
            return values.float().view(B, 3, 1, 1)

        def cols(v64: torch.Tensor, *names: str) -> torch.Tensor:
            return v64[:, [(_ID_INDEX if v64 is id_v else _IMG_INDEX)[n] for n in names]]

        # Colours (straight RGB, [B, 3, 1, 1]).
        tone = id_v[:, _ID_INDEX["skin_tone"]].view(-1, 1)
        light = torch.tensor(_SKIN_LIGHT, dtype=torch.float64)
        skin64 = light + (torch.tensor(_SKIN_DARK, dtype=torch.float64) - light) * tone
        skin64 = (skin64 + cols(id_v, "skin_r", "skin_g", "skin_b")).clamp(0.05, 1.0)
        skin = rgb(skin64)
        hair = rgb((_palette(_HAIR, id_v[:, _ID_INDEX["hair_kind"]]) + cols(id_v, "hair_r", "hair_g", "hair_b"))
                   .clamp(0.02, 1.0))
        iris = rgb(_palette(_IRIS, id_v[:, _ID_INDEX["iris_kind"]]))
        lip_mix = id_v[:, _ID_INDEX["lip_r"]].view(-1, 1)
        lip = rgb((skin64 * (0.75 - 0.15 * lip_mix) + torch.tensor([0.18, 0.0, 0.02], dtype=torch.float64) * lip_mix)
                  .clamp(0.0, 1.0))
        cloth = rgb(cols(img_v, "cloth_r", "cloth_g", "cloth_b"))
        white, black, dark = (torch.full((1, 3, 1, 1), c) for c in (0.92, 0.03, 0.12))

        # The canonical face: premultiplied RGB and alpha in one buffer.
        canvas = torch.empty(B, 4, size, size)
        color, alpha = canvas[:, :3], canvas[:, 3]
        yaw = q.yaw

        # Hair behind the head, down to face_y + hair_len; bald identities have none.
        # The first layer: written, not composited over an empty canvas.
        has_hair = (p.bald > 0.12).float()
        back = _ellipse(u, v, torch.zeros_like(yaw), p.face_y - p.hair_top * 0.5, p.face_w + p.hair_volume,
                        p.face_h + p.hair_top * 0.5 + p.hair_volume * 0.5, edge)
        back = back * (_ramp(p.face_y + p.hair_len - v, edge) * has_hair)
        torch.mul(hair, back.unsqueeze(1), out=color)
        alpha.copy_(back)

        # Neck and shoulders (the clothing colour is a nuisance).
        neck = _ramp(p.face_w * 0.45 - u.abs(), edge) * _ramp(v - p.face_y, edge)
        _over(color, alpha, skin * 0.78, neck)
        shoulders = _ellipse(u, v, torch.zeros_like(yaw), torch.full_like(yaw, 1.32), torch.ones_like(yaw),
                             torch.full_like(yaw, 0.5), edge)
        _over(color, alpha, cloth, shoulders)

        # Ears (mirrored about the face's axis).
        narrow = 1.0 - 0.05 * yaw.abs()  # a turned head looks a little narrower
        ear = _ellipse(u.abs(), v, p.face_w * narrow, p.face_y + p.eye_y + 0.1, 0.075 * p.ear, 0.13 * p.ear, edge)
        _over(color, alpha, skin * 0.9, ear)

        # Face: an ellipse whose width tapers towards the chin (jaw), darker at the rim,
        # with identity-specific skin marks.
        fy = v - p.face_y
        inv_h = p.face_h.reciprocal()
        t = (fy * inv_h).clamp(0.0, 1.0)
        half_w = p.face_w * narrow * (1.0 - p.jaw * t * t)
        du, dv = u * half_w.reciprocal(), fy * inv_h
        r2 = du * du + dv * dv
        face = _ramp((1.0 - r2.sqrt()) * torch.minimum(half_w, p.face_h), edge)
        shade = 1.0 - 0.22 * r2.clamp(0.0, 1.0)
        for k in range(_NUM_MARKS):
            m = marks[:, k].float()
            mx, my, radius, amp = (m[:, i].view(-1, 1, 1) for i in range(4))
            inv_r = radius.reciprocal()
            dx = (u - mx * p.face_w - yaw * 0.08) * inv_r
            dy = (fy - my * p.face_h) * inv_r
            bump = (1.0 - (dx * dx + dy * dy)).clamp_(0.0, 1.0)
            shade = shade + (bump * bump) * (p.mark_amp * amp)
        _over(color, alpha, skin * shade.unsqueeze(1), face)

        # Inner features, each on the canonical box it can occupy (bounds from the
        # parameter ranges); the yaw moves them sideways inside the oval. They lie
        # inside the face, so the alpha is unchanged.
        eye_y = p.face_y + p.eye_y
        sh_e = yaw * 0.10

        # Eyes and brows (mirrored): sclera, iris and pupil; the gaze moves both irises.
        C, R = box(-0.68, 0.68, -0.70, 0.12)
        uu, cv, cc = u[..., C], v[:, R], color[:, :, R, C]
        ux = (uu - sh_e).abs()
        side = torch.where(uu >= sh_e, 1.0, -1.0)
        eye_h = p.eye_w * p.eye_aspect * q.eye_open
        sclera = _rotated_ellipse(ux, cv, p.eye_x, eye_y, p.eye_w, eye_h, p.eye_tilt, edge)
        _over(cc, None, white, sclera)
        ir = p.eye_w * p.iris_size
        icx = p.eye_x + side * (q.gaze_x * p.eye_w * 0.5)
        icy = eye_y + q.gaze_y * eye_h
        _over(cc, None, iris, _ellipse(ux, cv, icx, icy, ir, ir, edge) * sclera)
        _over(cc, None, black, _ellipse(ux, cv, icx, icy, ir * 0.45, ir * 0.45, edge) * sclera)
        brow_y = eye_y - p.eye_w * p.eye_aspect - p.brow_gap - q.brow_raise
        brow = _rotated_ellipse(ux, cv, p.eye_x + p.brow_dx, brow_y, p.brow_len, p.brow_thick, p.brow_tilt, edge)
        _over(cc, None, hair * 0.75, brow * (0.5 + 0.5 * has_hair))
        # Glasses (some identities): a round frame about each eye and a bridge.
        gr = p.eye_w * p.glasses_size * 0.5 + 0.03
        ring = _ellipse(ux, cv, p.eye_x, eye_y, gr + 0.012, gr + 0.012, edge) \
            - _ellipse(ux, cv, p.eye_x, eye_y, gr - 0.012, gr - 0.012, edge)
        bridge = _ramp(p.eye_x - gr - ux, edge) * _ramp(0.012 - (cv - eye_y + 0.02).abs(), edge)
        _over(cc, None, black, (ring + bridge).clamp_(0.0, 1.0) * (p.glasses > 0.8).float())

        # Nose: a soft shadow along one side of the ridge, the tip, two nostrils.
        C, R = box(-0.36, 0.36, -0.26, 0.38)
        uu, cv, cc = u[..., C], v[:, R], color[:, :, R, C]
        sh_n = yaw * 0.13
        nose_top = eye_y + 0.02
        nose_bot = nose_top + p.nose_len
        ridge = _ellipse(uu, cv, sh_n + p.nose_w * 0.35, (nose_top + nose_bot) * 0.5, p.nose_w * 0.55,
                         p.nose_len * 0.5, edge)
        _over(cc, None, skin * 0.72, ridge * 0.45)
        tip = _ellipse(uu, cv, sh_n, nose_bot - p.nose_w * 0.3, p.nose_w, p.nose_w * 0.6, edge)
        _over(cc, None, skin * 0.86, tip * 0.6)
        nostril = _ellipse((uu - sh_n).abs(), cv, p.nose_w * 0.55, nose_bot - p.nostril * 0.3, p.nostril,
                           p.nostril * 0.6, edge)
        _over(cc, None, skin * 0.35, nostril)

        # Beard (some identities): the lower face below the nose.
        C, R = box(-1.0, 1.0, -0.10, 0.90)
        has_beard = (p.beard > 0.78).float() * p.beard_density
        beard = face[:, R, C] * (_ramp(v[:, R] - nose_bot - 0.03, edge * 2) * has_beard)
        _over(color[:, :, R, C], None, hair * 0.85, beard)

        # Mouth: lips bent by the smile, a dark gap when open.
        C, R = box(-0.36, 0.36, -0.10, 0.66)
        uu, cv, cc = u[..., C], v[:, R], color[:, :, R, C]
        sh_m = yaw * 0.09
        mu = (uu - sh_m) * p.mouth_w.reciprocal()
        bend = (nose_bot + p.mouth_gap) - (mu * mu) * (q.smile * 0.06)  # a smile raises the corners
        opening = q.open.clamp(min=0.0)
        lips = _ellipse(uu, cv, sh_m, bend, p.mouth_w, p.lip + opening * 0.5, edge)
        _over(cc, None, lip, lips)
        _over(cc, None, dark, _ellipse(uu, cv, sh_m, bend, p.mouth_w * 0.85, opening * 0.6 + 0.004, edge) * lips)

        # Fringe: hair over the forehead, above a parted, curved hairline.
        C, R = box(-1.0, 1.0, -0.90, 0.10)
        uu, cv = u[..., C], v[:, R]
        hairline = (p.face_y - p.face_h + p.hairline * p.face_h) + (uu - sh_e * 0.3) * (p.parting * 0.3) \
            + (uu * uu) * (p.fringe_curve * 0.5)
        _over(color[:, :, R, C], None, hair, face[:, R, C] * (_ramp(hairline - cv, edge) * has_hair))

        # Pose: each output pixel samples the canonical face at (x - t) turned by -angle,
        # over scale. cos and sin per image in Python (math): no vectorised
        # transcendental anywhere.
        ang = [math.radians(a) for a in img_v[:, _IMG_INDEX["angle"]].tolist()]
        inv_s = q.scale.reciprocal()
        cos_a = torch.tensor([math.cos(a) for a in ang]).view(-1, 1, 1) * inv_s
        sin_a = torch.tensor([math.sin(a) for a in ang]).view(-1, 1, 1) * inv_s
        x, y = u - q.tx, v - q.ty
        grid = torch.empty(B, size, size, 2)
        torch.add(x * cos_a, y * sin_a, out=grid[..., 0])
        torch.sub(y * cos_a, x * sin_a, out=grid[..., 1])
        warped = F.grid_sample(canvas, grid, mode="bilinear", padding_mode="border", align_corners=False)

        # Background in image coordinates (a grey level, tinted, with a linear
        # gradient) behind the warped face; in place from here on.
        image = rgb(cols(img_v, "bg_r", "bg_g", "bg_b") + img_v[:, _IMG_INDEX["bg"]].view(-1, 1)) \
            + (u * q.bg_gx + v * q.bg_gy).unsqueeze(1)
        image.mul_(1.0 - warped[:, 3:]).add_(warped[:, :3])

        # Occluder (some images): a flat rectangle.
        occluded = (img_v[:, _IMG_INDEX["occlude"]] < _OCCLUDE_P).nonzero().flatten().tolist()
        for b in occluded:
            x0, y0 = q.oc_x0[b], q.oc_y0[b]
            occ = (_ramp(u - x0, edge) * _ramp(x0 + q.oc_w[b] - u, edge)) \
                * (_ramp(v - y0, edge) * _ramp(y0 + q.oc_h[b] - v, edge))
            oc = cols(img_v, "oc_r", "oc_g", "oc_b")[b].float().view(3, 1, 1)
            image[b] += occ * (oc - image[b])

        # Lighting: brightness with a directional gradient, a colour cast, contrast;
        # then the sensor noise, in pixel units. Rounded and clamped: the caller's copy
        # into uint8 is exact.
        la = img_v[:, _IMG_INDEX["light_angle"]].tolist()
        lx = torch.tensor([math.cos(a) for a in la]).view(-1, 1, 1) * q.light
        ly = torch.tensor([math.sin(a) for a in la]).view(-1, 1, 1) * q.light
        contrast = q.contrast.unsqueeze(1)
        gain = rgb(1.0 + cols(img_v, "cast_r", "cast_g", "cast_b")) * (q.gain.unsqueeze(1) * contrast * 255.0)
        image.mul_(((1.0 + u * lx) + v * ly).unsqueeze(1) * gain)
        image.add_((0.5 - 0.5 * contrast) * 255.0).add_(noise)
        return image.round_().clamp_(0.0, 255.0)
