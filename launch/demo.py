"""Train a small backbone with a Partial FC head on synthetic identities (CPU is fine).

Each identity is a random latent vector; a sample is that latent seen through a fixed
random "camera" with noise. A linear backbone learns 128-d embeddings and the head
learns the class centers with sampled negatives. Prints the loss falling and the
throughput, then checks the embeddings on identities never seen in training.

    python launch/demo.py [--classes 5000] [--steps 300] [--sample-rate 0.1]
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from ds_pfc import CosFace, PartialFC


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


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--classes", type=int, default=5000, help="training identities")
    p.add_argument("--held-out", type=int, default=1000, help="identities kept for verification")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--sample-rate", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--log-every", type=int, default=30)
    args = p.parse_args(argv)

    torch.manual_seed(0)
    data = SyntheticIdentities(args.classes + args.held_out)
    # Face networks end in a BatchNorm1d on the embedding; without it a small MLP collapses.
    backbone = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 128),
                                   torch.nn.BatchNorm1d(128))
    head = PartialFC(args.classes, 128, sample_rate=args.sample_rate, margin=CosFace(scale=32.0, margin=0.3),
                     optimizer="sgd", momentum=0.9, weight_decay=5e-4, compute_dtype=torch.bfloat16)
    opt = torch.optim.SGD(backbone.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
    print(f"{head}\nverification accuracy on {args.held_out} held-out identities before training: "
          f"{verification_accuracy(backbone, data, args.classes):.3f}", flush=True)

    start, seen, window_loss = time.perf_counter(), 0, []
    for step in range(1, args.steps + 1):
        lr = args.lr * (1 - (step - 1) / args.steps)    # linear decay
        labels = torch.randint(0, args.classes, (args.batch,))
        loss = head(backbone(data.sample(labels)), labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()
        head.step(lr)
        seen += args.batch
        window_loss.append(loss.item())
        if step % args.log_every == 0 or step == args.steps:
            elapsed = time.perf_counter() - start
            print(f"step {step:4d}/{args.steps}  loss {sum(window_loss) / len(window_loss):7.3f}  lr {lr:.4f}  "
                  f"{seen / elapsed:8.0f} samples/s", flush=True)
            window_loss = []
    elapsed = time.perf_counter() - start
    print(f"throughput: {seen / elapsed:.0f} samples/s ({args.steps} steps of {args.batch} in {elapsed:.1f} s, "
          f"C={args.classes}, r={args.sample_rate})")
    print(f"verification accuracy on {args.held_out} held-out identities after training: "
          f"{verification_accuracy(backbone, data, args.classes):.3f}")


if __name__ == "__main__":
    main()
