"""Run a function on ``world_size`` CPU ranks with the gloo backend.

``run_ranks(fn, world_size, *args)`` spawns the ranks, calls ``fn(rank, world_size,
*args)`` in each (``fn`` must be a module-level function), and returns the list of
their return values (anything ``torch.save`` can store). An exception in any rank
fails the calling test with that rank's traceback.
"""
from __future__ import annotations

import contextlib
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


@contextlib.contextmanager
def one_process_world():
    """The ``env://`` variables of a one-process world on a free port, for running the
    app in-process; afterwards the process group is destroyed, DeepSpeed's CPU
    shared-memory buffers of that port are removed and the variables restored."""
    import glob
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    saved = {k: os.environ.get(k) for k in keys}
    port = free_port()
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        yield port
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        for name in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_127.0.0.1_{port}_*"):
            os.remove(name)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
