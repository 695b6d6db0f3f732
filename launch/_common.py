"""Shared bits of the launch scripts (not part of the library)."""
from __future__ import annotations

import os
import socket
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:    # run from a checkout without installing
    sys.path.insert(0, ROOT)


def single_process_env() -> None:
    """Run without a launcher: present a world of one process to torch.distributed."""
    if "RANK" in os.environ or "OMPI_COMM_WORLD_RANK" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))


def leave_process_groups() -> None:
    """At the end of a script run by a launcher: wait for every rank, then destroy the
    process groups. gloo's worker threads still alive at interpreter teardown abort
    the process ("terminate called without an active exception")."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
