"""Synthetic identities for demos, benchmarks and tests that must learn something.

Identity ``c`` has a latent ``z_c``; an input is ``A z_c + B v + noise`` where the
nuisance ``v`` (think pose and lighting) is redrawn for every image and dominates
the signal. A network has to learn to ignore the nuisance, which is what 1:1
verification on identities held out of training measures.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .._checks import check_int

__all__ = ["SyntheticIdentities", "verification_accuracy"]


def check_pair_arguments(num_pairs, seed, num_identities: int) -> int:
    """``num_pairs`` checked (an int >= 1), after ``seed`` (an int) and that a
    "different" pair has two identities to draw from; raises naming the argument."""
    num_pairs = check_int("num_pairs", num_pairs, 1)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__} {seed!r}")
    if num_pairs - num_pairs // 2 > 0 and num_identities < 2:
        raise ValueError(f"pairs needs num_identities >= 2 for its 'different' pairs, got {num_identities}")
    return num_pairs


def draw_pairs(num_pairs: int, num_identities: int, first_identity: int, images_per_identity: int,
               generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The identities and image numbers of ``num_pairs`` 1:1 verification pairs, in
    insightface ``.bin`` order (pair ``i`` is entries ``2i`` and ``2i + 1``), and their
    ``issame`` mask. ``num_pairs // 2`` pairs are "same" (two different images of one
    identity), the rest of two different identities, shuffled; the image numbers are
    ``>= images_per_identity`` (never a training image). The caller checks the
    arguments (:func:`check_pair_arguments`); a pure function of them and
    ``generator``'s state."""
    num_same = num_pairs // 2
    same = torch.zeros(num_pairs, dtype=torch.bool)
    same[torch.randperm(num_pairs, generator=generator)[:num_same]] = True
    first = torch.randint(0, num_identities, (num_pairs,), generator=generator)
    # A different identity: shift by 1 .. num_identities - 1 (modulo).
    shift = torch.randint(1, max(num_identities, 2), (num_pairs,), generator=generator) % num_identities
    second = torch.where(same, first, (first + shift) % num_identities)
    # Fresh image numbers above the training ones; the two images of a pair differ.
    span = 1 << 30
    n1 = torch.randint(0, span, (num_pairs,), generator=generator)
    n2 = (n1 + torch.randint(1, span, (num_pairs,), generator=generator)) % span
    identities = torch.stack([first, second], 1).reshape(-1) + first_identity
    numbers = torch.stack([n1, n2], 1).reshape(-1) + images_per_identity
    return identities, numbers, same


class SyntheticIdentities:
    """Identity ``c`` has a latent ``z_c``; an input is ``A z_c + B v + noise`` where the
    nuisance ``v`` (pose, lighting, ...) is redrawn for every image and dominates the
    signal. An untrained network mostly sees the nuisance; a trained one must learn to
    ignore it, which is what open-set verification on held-out identities measures."""

    def __init__(self, num_identities: int, latent: int = 32, nuisance: int = 32, input_dim: int = 256,
                 nuisance_std: float = 4.0, noise: float = 1.0, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.latents = torch.randn(num_identities, latent, generator=g)
        self.identity_map = torch.randn(latent, input_dim, generator=g) / latent ** 0.5
        self.nuisance_map = torch.randn(nuisance, input_dim, generator=g) / nuisance ** 0.5
        self.nuisance_std, self.noise = nuisance_std, noise
        self.gen = torch.Generator().manual_seed(seed + 1)

    def sample(self, ids: torch.Tensor) -> torch.Tensor:
        clean = self.latents[ids] @ self.identity_map
        nuisance = torch.randn(len(ids), self.nuisance_map.shape[0], generator=self.gen) * self.nuisance_std
        return clean + nuisance @ self.nuisance_map + self.noise * torch.randn(clean.shape, generator=self.gen)


def verification_accuracy(backbone, data: SyntheticIdentities, first_id: int, num_pairs: int = 2000) -> float:
    """1:1 verification on held-out identities: best-threshold accuracy over pairs."""
    g = torch.Generator().manual_seed(123)
    num = data.latents.shape[0] - first_id
    a = first_id + torch.randint(0, num, (num_pairs,), generator=g)
    same = torch.rand(num_pairs, generator=g) < 0.5
    b = torch.where(same, a, first_id + torch.randint(0, num, (num_pairs,), generator=g))
    same = a == b
    was_training = backbone.training
    backbone.eval()
    with torch.no_grad():
        score = (F.normalize(backbone(data.sample(a))) * F.normalize(backbone(data.sample(b)))).sum(1)
    backbone.train(was_training)
    thresholds = torch.linspace(-1, 1, 401)
    acc = ((score[None, :] > thresholds[:, None]) == same[None, :]).float().mean(1)
    return float(acc.max())
