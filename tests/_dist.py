"""Run a function on ``world_size`` CPU ranks with the gloo backend.

``run_ranks(fn, world_size, *args)`` spawns the ranks, calls ``fn(rank, world_size,
*args)`` in each (``fn`` must be a module-level function), and returns the list of
their return values (anything ``torch.save`` can store). An exception in any rank
fails the calling test with that rank's traceback.
"""
from __future__ import annotations

import datetime
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank, world_size, init_file, out_dir, fn, args):
    torch.set_num_threads(1)
    # A collective that some rank never joins fails after 2 minutes instead of hanging.
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=120))
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(out_dir, f"{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_ranks(fn, world_size: int, *args):
    # A fresh port for workers that set up DeepSpeed's env:// rendezvous themselves.
    os.environ["DS_PFC_TEST_PORT"] = str(free_port())
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        mp.spawn(_entry, args=(world_size, init_file, tmp, fn, args), nprocs=world_size, join=True)
        return [torch.load(os.path.join(tmp, f"{r}.pt"), weights_only=False) for r in range(world_size)]


def free_port() -> int:
    """A TCP port nobody listens on now (for MASTER_PORT: DeepSpeed names its shared
    memory after the port, so a fixed one can meet a stale buffer of an earlier run)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
