"""Train a small backbone with a Partial FC head on synthetic identities (CPU is fine).

Each identity is a latent vector; every image of it is that latent mixed with
nuisance factors (think pose and lighting) that dominate the signal. A small MLP
learns 128-d embeddings, the head learns the class centers with sampled negatives.
Prints the loss falling and the throughput, then measures 1:1 verification on
identities never seen in training (``ds_pfc.data.SyntheticIdentities``).

    python launch/demo.py [--classes 5000] [--steps 300] [--sample-rate 0.1]
"""
from __future__ import annotations

import argparse
import time

import torch

from ds_pfc import CosFace, PartialFC
from ds_pfc._args import parser
from ds_pfc.data import SyntheticIdentities, verification_accuracy


def build_parser() -> argparse.ArgumentParser:
    p = parser("python launch/demo.py", " ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--classes", type=int, default=5000, help="training identities")
    p.add_argument("--held-out", type=int, default=1000, help="identities kept for verification")
    p.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    p.add_argument("--batch", type=int, default=256, help="samples per step (default 256)")
    p.add_argument("--sample-rate", type=float, default=0.1,
                   help="the share of the classes sampled per step, in (0, 1] (default 0.1)")
    p.add_argument("--lr", type=float, default=0.05,
                   help="initial learning rate of the backbone and the head, decayed linearly to 0 (default 0.05)")
    p.add_argument("--log-every", type=int, default=30,
                   help="print the mean loss and the throughput every this many steps (default 30)")
    return p


def main(argv=None) -> None:
    p = build_parser()
    args = p.parse_args(argv)
    for name in ("classes", "held_out", "steps", "batch", "log_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0.0 < args.sample_rate <= 1.0:
        p.error(f"--sample-rate must be in (0, 1], got {args.sample_rate}")
    if not args.lr > 0.0:
        p.error(f"--lr must be > 0, got {args.lr}")

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
