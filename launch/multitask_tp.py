"""A multi-task model with a tensor-parallel backbone and two Partial FC heads.

    deepspeed --num_gpus 4 launch/multitask_tp.py --tp 2          # CPU: 4 processes, TP 2 x DP 2

The backbone is a two-layer MLP that DeepSpeed splits over the tensor-parallel ranks
(AutoTP with a ``partition_config``: the first layer column-wise, the second
row-wise). Two heads read its embedding:

- ``identity`` (``head_spec(shard="model")``): classes sharded over every rank of
  the TP x DP grid, samples gathered over the data-parallel group; TP peers share the
  classes and each gets the whole embedding gradient.
- ``attribute`` (``head_spec(shard="data")``): a small label space sharded over the
  data-parallel group only, one copy per TP rank.

The heads are declared before ``initialize``, because AutoTP's groups exist only
inside ``deepspeed.initialize``, and built there from them. The data is synthetic:
features drawn around a random center per identity; both TP peers of a data-parallel
position read the same samples, as a tensor-parallel job must feed them.
"""
from __future__ import annotations

import argparse
import os

import _common  # noqa: F401  (puts the checkout on sys.path)

import torch

from ds_pfc._args import parser


class Mlp(torch.nn.Module):
    def __init__(self, d_in: int, hidden: int, d: int):
        super().__init__()
        self.fc1 = torch.nn.Linear(d_in, hidden)
        self.fc2 = torch.nn.Linear(hidden, d)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def ds_config(tp: int, micro: int, lr: float) -> dict:
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
            "steps_per_print": 10 ** 9, "optimizer": {"type": "SGD", "params": {"lr": lr, "momentum": 0.9}},
            "tensor_parallel": {"autotp_size": tp, "partition_config": {"use_default_specs": False, "layer_specs": [
                {"patterns": [r".*fc1\.weight$"], "partition_type": "column"},
                {"patterns": [r".*fc2\.weight$"], "partition_type": "row"}]}}}


def layout_line(name: str, head) -> str:
    """Which group shards what, for one rank."""
    rows = head.num_local
    row_bytes = head.embedding_size * 4 * len(head.bank.state_names())      # weight and optimizer states
    return (f"{name}: classes [{head.class_start}, {head.class_end}) of {head.num_classes} "
            f"(rank {head.rank} of {head.world_size} in its class group), samples gathered over "
            f"{head.batch_world_size} rank(s) (position {head.batch_rank}); {rows * row_bytes / 2 ** 10:.1f} KiB of "
            f"centers and optimizer state")


def build_parser() -> argparse.ArgumentParser:
    p = parser("deepspeed launch/multitask_tp.py", " ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel degree (divides the number of ranks)")
    p.add_argument("--steps", type=int, default=40, help="training steps (default 40)")
    p.add_argument("--micro", type=int, default=16, help="samples per data-parallel rank and step")
    p.add_argument("--lr", type=float, default=0.1,
                   help="SGD learning rate (default 0.1; the attribute head trains at half of it)")
    p.add_argument("--identities", type=int, default=41,
                   help="classes of the identity head, sharded over every rank (default 41)")
    p.add_argument("--attributes", type=int, default=5,
                   help="classes of the attribute head, sharded over the data-parallel group (default 5)")
    p.add_argument("--local_rank", type=int, default=None, help="set by the deepspeed launcher")
    return p


def main(argv=None) -> list[float]:
    p = build_parser()
    args = p.parse_args(argv)
    for name in ("tp", "steps", "micro", "identities", "attributes"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if not args.lr > 0.0:
        p.error(f"--lr must be > 0, got {args.lr}")
    _common.launch_env()

    from ds_pfc import CosFace
    from ds_pfc.deepspeed_plugin import attach, head_spec, init_distributed, initialize
    from ds_pfc.devices import bind_local_device

    init_distributed()
    bind_local_device()                       # cuda:LOCAL_RANK after init, before any CUDA work
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    if world % args.tp:
        raise SystemExit(f"error: --tp {args.tp} does not divide the {world} ranks")
    d_in, d = 32, 16

    torch.manual_seed(0)                      # the same backbone on every rank before DeepSpeed splits it
    model = Mlp(d_in, 64, d)
    attach(model, "identity", head_spec(args.identities, d, shard="model", sample_rate=0.5,
                                        margin=CosFace(16.0, 0.2)))
    attach(model, "attribute", head_spec(args.attributes, d, shard="data", margin=CosFace(8.0, 0.1)), lr_ratio=0.5)
    engine = initialize(model=model, config=ds_config(args.tp, args.micro, args.lr))
    for name in ("identity", "attribute"):
        line = layout_line(name, getattr(model, name))
        for r in range(world):                 # one line per rank, in rank order
            if r == rank:
                print(f"[rank {rank}] {line}", flush=True)
            torch.distributed.barrier()

    # Synthetic data: identity centers in input space; the attribute is a function of the identity.
    g = torch.Generator().manual_seed(1)
    centers = torch.randn(args.identities, d_in, generator=g)
    position, positions = model.identity.batch_rank, model.identity.batch_world_size
    losses = []
    for step in range(args.steps):
        gen = torch.Generator().manual_seed(1000 * step + position)      # TP peers draw the same samples
        ids = torch.randint(0, args.identities, (args.micro,), generator=gen)
        x = centers[ids] + 0.5 * torch.randn(args.micro, d_in, generator=gen)
        device = engine.device
        emb = engine(x.to(device))
        loss = model.identity(emb, ids.to(device)) + 0.5 * model.attribute(emb, (ids % args.attributes).to(device))
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step + 1}/{args.steps} loss {losses[-1]:.4f} ({positions} data-parallel positions x "
                  f"{args.micro} samples)", flush=True)
    engine.destroy()
    return losses


if __name__ == "__main__":
    main()
    _common.leave_process_groups()
