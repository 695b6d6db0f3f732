"""Process set-up shared by the commands that run under a launcher."""
from __future__ import annotations

import sys

__all__ = ["launch_env", "leave_process_groups"]


def launch_env():
    """Present the launcher's world to torch.distributed: rank, world size and local
    rank from whichever launcher started this process (torchrun, deepspeed, srun,
    mpirun, ...; none: a world of one process on a free port), checked against the
    scheduler's task count. Exits with ``error: ...`` when they disagree. Returns the
    :class:`ds_pfc.launchers.Launch`."""
    from ..launchers import LaunchError, export
    try:
        return export()
    except LaunchError as err:
        sys.exit(f"error: {err}")


def leave_process_groups() -> None:
    """At the end of a command run by a launcher: wait for every rank, then destroy the
    process groups. gloo's worker threads still alive at interpreter teardown abort
    the process ("terminate called without an active exception")."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
