"""Synthetic identity features: a face-recognition task with many classes that a CPU trains.

Identity ``c`` has a latent ``z_c`` (``latent_dim`` standard normal values); image
``n`` of identity ``c`` is the feature vector

    x = tanh(z_c A + nuisance * v_{c,n} B + noise * e_{c,n})          (feature_dim values)

where the nuisance ``v`` (``latent_dim`` values, think pose and lighting) and the
noise ``e`` are redrawn for every image, and ``A``, ``B`` are fixed random maps
(scaled so that each term has unit variance per value before ``nuisance`` /
``noise``). It is the model of :class:`ds_pfc.data.SyntheticIdentities` with a
saturating output, so the nuisance does not lie in a subspace a linear map removes:
a network has to learn to see through it, which 1:1 verification on identities
held out of training measures.

Every value is a counter-based hash of ``(seed, identity, image number, position)``
(splitmix64 on int64 tensors), not a generator's stream: an item is the same
whatever order, batch or process fetches it, a million identities cost no memory,
and held-out identities (``first_identity`` past the training ones) are new
latents from the same distribution.

Items travel through the image pipeline: a vector is laid out as
``[3, 1, feature_dim // 3]`` float32 in pixel units (``127.5 (x + 1)``, inside [0,
255]), so :func:`ds_pfc.data.normalize` returns ``x`` and the loader, the stress
transforms and the verification code handle it as any dataset. A horizontal flip
would permute the values: train and evaluate it without flips. The ``mlp``
backbone (:mod:`ds_pfc.models.mlp`) reads it.
"""
from __future__ import annotations

import math

import torch

from .._checks import check_int
from .._rng import _GAMMA, _MUL1, _MUL2, _chain, _signed, generator_for
from .synthetic import check_pair_arguments, draw_pairs

__all__ = ["IdentityFeatures"]

_LATENT, _NUISANCE, _NOISE, _MAPS, _PAIRS = 1, 2, 3, 4, 5     # hash domains


def _shr(z: torch.Tensor, bits: int) -> torch.Tensor:
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def _splitmix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64 of the uint64 bit patterns in int64 ``z`` (wrapping int64 arithmetic)."""
    z = z + _signed(_GAMMA)
    z = (z ^ _shr(z, 30)) * _signed(_MUL1)
    z = (z ^ _shr(z, 27)) * _signed(_MUL2)
    return z ^ _shr(z, 31)


def _normals(base: int, *keys: torch.Tensor) -> torch.Tensor:
    """float64 standard normals, one per element of the broadcast ``keys``, a pure
    function of ``(base, *keys)`` (Box-Muller on two hashed uniforms)."""
    state = torch.tensor(_signed(base), dtype=torch.int64)
    for key in keys:
        state = _splitmix(state ^ key)
    second = _splitmix(state ^ 0x5BD1E995)
    u1 = (_shr(state, 11).to(torch.float64) + 0.5) / 2.0 ** 53
    u2 = _shr(second, 11).to(torch.float64) / 2.0 ** 53
    return torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2.0 * math.pi * u2)


class IdentityFeatures(torch.utils.data.Dataset):
    """``num_identities x images_per_identity`` feature vectors (module docstring).

    Item ``i`` is image ``i % images_per_identity`` of identity ``first_identity + i //
    images_per_identity``, labelled ``i // images_per_identity``.

    Args:
        num_identities, images_per_identity: >= 1.
        feature_dim: values per vector, a multiple of 3 (the ``[3, 1, feature_dim // 3]``
            layout), >= 3.
        latent_dim: identity (and nuisance) latent size, >= 1.
        nuisance: strength of the per-image nuisance, >= 0 (0: every image of an
            identity differs only by ``noise``).
        noise: strength of the per-value noise, >= 0.
        first_identity: id of the first identity (held-out sets start past the
            training identities), >= 0.
        seed: defines the identities and their images.
    """

    def __init__(self, num_identities: int, images_per_identity: int, *, feature_dim: int = 96,
                 latent_dim: int = 32, nuisance: float = 1.5, noise: float = 0.5, first_identity: int = 0,
                 seed: int = 0):
        self.num_identities = check_int("num_identities", num_identities, 1)
        self.images_per_identity = check_int("images_per_identity", images_per_identity, 1)
        self.feature_dim = check_int("feature_dim", feature_dim, 3)
        if feature_dim % 3:
            raise ValueError(f"feature_dim must be a multiple of 3 (vectors travel as [3, 1, feature_dim // 3]), "
                             f"got {feature_dim}")
        self.latent_dim = check_int("latent_dim", latent_dim, 1)
        for name, value in (("nuisance", nuisance), ("noise", noise)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        self.nuisance, self.noise = float(nuisance), float(noise)
        self.first_identity = check_int("first_identity", first_identity, 0)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {type(seed).__name__} {seed!r}")
        self.seed = seed
        g = generator_for(seed, _MAPS)
        scale = latent_dim ** -0.5
        self.identity_map = torch.randn(latent_dim, feature_dim, generator=g, dtype=torch.float64) * scale
        self.nuisance_map = torch.randn(latent_dim, feature_dim, generator=g, dtype=torch.float64) * scale

    def __len__(self) -> int:
        return self.num_identities * self.images_per_identity

    @property
    def num_classes(self) -> int:
        return self.num_identities

    def labels(self) -> torch.Tensor:
        """int64 ``[len(self)]``: the identity (class) of every item, from 0."""
        return torch.arange(self.num_identities, dtype=torch.int64).repeat_interleave(self.images_per_identity)

    def vectors(self, identities: torch.Tensor, numbers: torch.Tensor) -> torch.Tensor:
        """float32 ``[m, feature_dim]`` in (-1, 1): image ``numbers[j]`` of identity
        ``identities[j]`` (absolute ids, any image number >= 0)."""
        ids = torch.as_tensor(identities, dtype=torch.int64).view(-1, 1)
        nums = torch.as_tensor(numbers, dtype=torch.int64).view(-1, 1)
        latent = torch.arange(self.latent_dim, dtype=torch.int64).view(1, -1)
        position = torch.arange(self.feature_dim, dtype=torch.int64).view(1, -1)
        z = _normals(_chain(self.seed, _LATENT), ids, latent)
        pre = z @ self.identity_map
        if self.nuisance:
            pre += self.nuisance * (_normals(_chain(self.seed, _NUISANCE), ids, nums, latent) @ self.nuisance_map)
        if self.noise:
            pre += self.noise * _normals(_chain(self.seed, _NOISE), ids, nums, position)
        return torch.tanh(pre).to(torch.float32)

    def _as_images(self, vectors: torch.Tensor) -> torch.Tensor:
        return (127.5 * (vectors + 1.0)).view(len(vectors), 3, 1, self.feature_dim // 3)

    def get_batch(self, indices) -> tuple[torch.Tensor, torch.Tensor]:
        """``(float32 [m, 3, 1, feature_dim // 3] in pixel units, int64 labels [m])``."""
        index = torch.as_tensor(indices, dtype=torch.int64).view(-1)
        if len(index) and (int(index.min()) < 0 or int(index.max()) >= len(self)):
            raise IndexError(f"indices must lie in [0, {len(self)}), got {int(index.min())}..{int(index.max())}")
        label = index // self.images_per_identity
        vectors = self.vectors(label + self.first_identity, index % self.images_per_identity)
        return self._as_images(vectors), label

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"index {i} out of range for a dataset of {n} images")
        images, labels = self.get_batch(torch.tensor([i % n]))
        return images[0], int(labels[0])

    def pairs(self, num_pairs: int, *, seed: int = 0) -> tuple[torch.Tensor, list[bool]]:
        """1:1 verification pairs among this dataset's identities: ``(float32 [2P, 3, 1,
        feature_dim // 3] pixel units, issame [P])``, pair ``i`` being items ``2i`` and
        ``2i + 1``; ``P // 2`` "same" pairs (two different images of one identity), the
        rest of two different identities, shuffled. The images are new (image numbers
        ``>= images_per_identity``). A pure function of the dataset and ``seed``."""
        num_pairs = check_pair_arguments(num_pairs, seed, self.num_identities)
        g = generator_for(self.seed, _PAIRS, self.first_identity, self.num_identities, self.images_per_identity,
                          num_pairs, seed)
        identities, numbers, same = draw_pairs(num_pairs, self.num_identities, self.first_identity,
                                               self.images_per_identity, g)
        return self._as_images(self.vectors(identities, numbers)), same.tolist()

    def __repr__(self) -> str:
        return (f"IdentityFeatures({self.num_identities} identities x {self.images_per_identity} images, "
                f"feature_dim {self.feature_dim}, latent {self.latent_dim}, nuisance {self.nuisance:g}, "
                f"noise {self.noise:g}, first identity {self.first_identity}, seed {self.seed})")
