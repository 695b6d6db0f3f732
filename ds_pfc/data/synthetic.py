"""Synthetic identities for demos, benchmarks and tests that must learn something.

Identity ``c`` has a latent ``z_c``; an input is ``A z_c + B v + noise`` where the
nuisance ``v`` (think pose and lighting) is redrawn for every image and dominates
the signal. A network has to learn to ignore the nuisance, which is what 1:1
verification on identities held out of training measures.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["SyntheticIdentities", "verification_accuracy"]


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
