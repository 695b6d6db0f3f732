"""Who started this process: rank, world size and local rank from the launcher's
environment, checked against the scheduler's task count, and exported as the
variables ``torch.distributed`` (``env://``) and DeepSpeed read.

A training process is one rank bound to one GPU. Each launcher says so differently:

========================  ============================================================
launcher                  variables each process gets
========================  ============================================================
``torchrun``              ``RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR
                          MASTER_PORT`` (+ ``GROUP_RANK``, ``TORCHELASTIC_RUN_ID``)
``deepspeed`` (pdsh,      ``RANK WORLD_SIZE LOCAL_RANK LOCAL_SIZE MASTER_ADDR
local)                    MASTER_PORT CROSS_RANK CROSS_SIZE``
``deepspeed --launcher    ``RANK LOCAL_RANK`` per process, ``WORLD_SIZE LOCAL_SIZE
impi|mpich``              MASTER_ADDR MASTER_PORT`` for all, and Hydra's ``PMI_*``
OpenMPI ``mpirun``        ``OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE}``
(``--launcher openmpi``)
MVAPICH                   ``MV2_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE}``
(``--launcher mvapich``)
Intel MPI / MPICH Hydra   ``PMI_RANK PMI_SIZE MPI_LOCALRANKID MPI_LOCALNRANKS``
PMIx servers              ``PMIX_RANK`` (the size comes from another layer)
Slurm ``srun``            ``SLURM_PROCID SLURM_LOCALID SLURM_STEP_NUM_TASKS
(``--launcher slurm``)    SLURM_STEP_TASKS_PER_NODE SLURM_STEP_NODELIST SLURMD_NODENAME
                          SLURM_JOB_ID SLURM_STEP_ID``
========================  ============================================================

The MPI launchers and ``srun`` set no ``RANK``: without this module every such task
would see a world of one process of its own. :func:`discover` reads them all;
:func:`export` writes ``RANK WORLD_SIZE LOCAL_RANK LOCAL_SIZE LOCAL_WORLD_SIZE
MASTER_ADDR MASTER_PORT``. When ``torch.distributed`` variables are present as well
(exported by hand, or by a batch script), they must agree with the scheduler's:
``WORLD_SIZE=8`` in a 16-task ``srun`` step, or ``RANK=0`` exported to every task, is
refused (:class:`LaunchError`) instead of training 16 separate one-rank jobs.

``torchrun`` and ``deepspeed``'s own per-node launcher spawn the ranks themselves: a
Slurm or MPI task around them is a node agent, not a rank, and is not compared.

The order at start-up is: :func:`export`, then ``init_distributed`` (which may still
run DeepSpeed's MPI discovery, see :func:`export`), then
:func:`check_process_group`, then :func:`ds_pfc.devices.bind_local_device`.
"""
from __future__ import annotations

import os
import re
import socket
import zlib
from dataclasses import dataclass, replace

from ._checks import ConfigError

__all__ = ["Launch", "LaunchError", "discover", "export", "check_process_group", "expand_hostlist",
           "expand_task_counts", "TORCH_VARIABLES"]

TORCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
DEFAULT_PORT = 29500            # torch's and DeepSpeed's default


class LaunchError(ConfigError):
    """The launch environment is inconsistent (the message names the variables and
    their values); starting would train the wrong world."""


@dataclass(frozen=True)
class Launch:
    """This process's place in the job."""
    launcher: str                   #: "torchrun", "deepspeed", "openmpi", "mvapich", "impi/mpich", "pmix", "slurm",
                                    #: "env" (torch.distributed variables only) or "none" (a one-process world)
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int | None    #: ranks on this node; None when the launcher does not say
    master_addr: str | None         #: None: only MPI can tell (see :func:`export`)
    master_port: int | None         #: None: a free port is chosen (a one-process world)

    def torch_environ(self) -> dict[str, str]:
        """The ``torch.distributed`` variables of this launch (only the known ones)."""
        env = {"RANK": str(self.rank), "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": str(self.local_rank)}
        if self.local_world_size is not None:
            env["LOCAL_SIZE"] = env["LOCAL_WORLD_SIZE"] = str(self.local_world_size)
        if self.master_addr is not None:
            env["MASTER_ADDR"] = self.master_addr
        if self.master_port is not None:
            env["MASTER_PORT"] = str(self.master_port)
        return env

    def __str__(self) -> str:
        local = f"{self.local_rank}" + (f" of {self.local_world_size}" if self.local_world_size else "")
        return (f"{self.launcher}: rank {self.rank} of {self.world_size}, local rank {local}, "
                f"master {self.master_addr}:{self.master_port}")


# --- Slurm's compressed lists -------------------------------------------------------------
def _split_top(text: str) -> list[str]:
    """Split at commas outside brackets."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in host list {text!r}")
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"unbalanced '[' in host list {text!r}")
    items.append(text[start:])
    return [item for item in items if item]


def _expand_ranges(body: str, text: str) -> list[str]:
    out = []
    for part in body.split(","):
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"bad range {part!r} in host list {text!r}")
        if not sep:
            out.append(lo)
            continue
        if int(hi) < int(lo):
            raise ValueError(f"descending range {part!r} in host list {text!r}")
        out.extend(str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1))
    return out


def expand_hostlist(text: str) -> list[str]:
    """Slurm's compressed host list in order: ``"gpu[003-005,007],cpu1"`` ->
    ``["gpu003", "gpu004", "gpu005", "gpu007", "cpu1"]``; several bracket groups in
    one name expand left to right (``"r[1-2]n[1-2]"`` -> r1n1, r1n2, r2n1, r2n2)."""
    hosts = []
    for item in _split_top(text.strip()):
        names = [""]
        for literal, body in re.findall(r"([^\[]*)(?:\[([^\]]*)\])?", item):
            names = [n + literal for n in names]
            if body:
                names = [n + r for n in names for r in _expand_ranges(body, text)]
        hosts.extend(names)
    return hosts


def expand_task_counts(text: str) -> list[int]:
    """Slurm's per-node task counts: ``"2(x3),1"`` -> ``[2, 2, 2, 1]``."""
    counts = []
    for item in text.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if not m:
            raise ValueError(f"bad task count {item!r} in {text!r}")
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts


# --- reading the environment --------------------------------------------------------------
def _int(environ, name: str) -> int | None:
    value = environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise LaunchError(f"{name}={value!r} is not an integer") from None


@dataclass(frozen=True)
class _Tasks:
    """What one scheduler / MPI layer says about this process."""
    name: str
    rank: int
    size: int | None
    local_rank: int | None
    local_size: int | None
    names: tuple          # the variable names (rank, size, local rank, local size) for messages


# name, rank, size, local rank, local size: the MPI runtimes' own variables
_MPI_LAYERS = (
    ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("mvapich", "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_SIZE"),
    ("impi/mpich", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
)
# PMIx servers (Open MPI 5, srun --mpi=pmix) export only the rank; it is checked against
# the layer that gives the size, and serves alone only with WORLD_SIZE set.
_PMIX = ("pmix", "PMIX_RANK", None, None, None)


def _slurm_step(environ) -> bool:
    """Whether this process is a task of an ``srun`` step (a batch script also has
    ``SLURM_PROCID=0`` and ``SLURM_NTASKS``, but no step variables)."""
    return "SLURM_PROCID" in environ and any(k in environ for k in ("SLURM_STEP_NUM_TASKS", "SLURM_STEP_ID",
                                                                   "SLURM_STEPID"))


def _slurm_local_size(environ) -> int | None:
    counts = environ.get("SLURM_STEP_TASKS_PER_NODE")
    if counts:
        try:
            per_node = expand_task_counts(counts)
        except ValueError as err:
            raise LaunchError(f"SLURM_STEP_TASKS_PER_NODE: {err}") from None
        if len(set(per_node)) == 1:
            return per_node[0]
        node = environ.get("SLURMD_NODENAME")
        try:
            nodes = expand_hostlist(environ.get("SLURM_STEP_NODELIST", ""))
        except ValueError as err:
            raise LaunchError(f"SLURM_STEP_NODELIST: {err}") from None
        if node in nodes and len(nodes) == len(per_node):
            return per_node[nodes.index(node)]
        return None
    return _int(environ, "SLURM_NTASKS_PER_NODE")


def _task_layers(environ) -> list[_Tasks]:
    """The layers present, the one that serves first."""
    def mpi(name, rank, size, local_rank, local_size):
        return _Tasks(name, _int(environ, rank), size and _int(environ, size), local_rank and _int(environ, local_rank),
                      local_size and _int(environ, local_size), (rank, size, local_rank, local_size))
    layers = [mpi(*layer) for layer in _MPI_LAYERS if layer[1] in environ]
    if _slurm_step(environ):
        size_name = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in environ else "SLURM_NTASKS"
        layers.append(_Tasks("slurm", _int(environ, "SLURM_PROCID"), _int(environ, size_name),
                             _int(environ, "SLURM_LOCALID"), _slurm_local_size(environ),
                             ("SLURM_PROCID", size_name, "SLURM_LOCALID", "SLURM_STEP_TASKS_PER_NODE")))
    if _PMIX[1] in environ:
        layers.append(mpi(*_PMIX))
    return layers


def _spawner(environ) -> str | None:
    """A launcher that starts the ranks itself, below any scheduler task."""
    if "TORCHELASTIC_RUN_ID" in environ or "GROUP_RANK" in environ:
        return "torchrun"
    if "CROSS_RANK" in environ and "CROSS_SIZE" in environ:
        return "deepspeed"
    return None


def _job_port(key: str) -> int:
    """A port every task of one job derives alike (20000-29999: below Linux's
    ephemeral range)."""
    return 20000 + zlib.crc32(key.encode()) % 10000


def _show(environ, *names) -> str:
    return ", ".join(f"{n}={environ[n]}" for n in names if n and n in environ)


def discover(environ=os.environ) -> Launch:
    """This process's :class:`Launch` from ``environ``, checked. Raises
    :class:`LaunchError` naming the variables when the launcher's and the
    ``torch.distributed`` variables disagree, or a rank lies outside its world."""
    rank_env, world_env = _int(environ, "RANK"), _int(environ, "WORLD_SIZE")
    local_rank_env = _int(environ, "LOCAL_RANK")
    spawner = _spawner(environ)
    # Each spawner sets its own name for the ranks on this node and leaves the other
    # one as it found it (inherited from a parent process that exported both, say).
    names = {"torchrun": ("LOCAL_WORLD_SIZE",), "deepspeed": ("LOCAL_SIZE",)}.get(spawner,
                                                                                ("LOCAL_SIZE", "LOCAL_WORLD_SIZE"))
    local_sizes = {n: _int(environ, n) for n in names if _int(environ, n) is not None}
    if len(set(local_sizes.values())) > 1:
        raise LaunchError(f"{_show(environ, *local_sizes)} disagree: both give the number of ranks on this node")
    local_size_env = next(iter(local_sizes.values()), None)
    local_size_name = next(iter(local_sizes), names[0])
    master_addr = environ.get("MASTER_ADDR") or None
    master_port = _int(environ, "MASTER_PORT")

    layers = [] if spawner else _task_layers(environ)
    tasks = layers[0] if layers else None
    for other in layers[1:]:
        if other.name != "slurm" and other.rank != tasks.rank:
            # The MPI layers describe one process; a Slurm step under mpirun holds the
            # node daemons, not the ranks, so it is not compared.
            raise LaunchError(f"{_show(environ, tasks.names[0])} but {_show(environ, other.names[0])}: the "
                              f"{tasks.name} and {other.name} ranks of this process disagree")

    if rank_env is not None:
        if world_env is None:
            raise LaunchError(f"RANK={rank_env} is set but WORLD_SIZE is not")
        launcher = spawner or (tasks.name if tasks else "env")
        rank, world, local_rank = rank_env, world_env, local_rank_env
        local_size = local_size_env if local_size_env is not None else (tasks.local_size if tasks else None)
        if local_rank is None:
            if tasks is None or tasks.local_rank is None:
                raise LaunchError(f"RANK={rank_env} and WORLD_SIZE={world_env} are set but LOCAL_RANK is not "
                                  "(the rank's GPU on its node)")
            local_rank = tasks.local_rank
    elif tasks is not None:
        if tasks.size is None:
            raise LaunchError(f"{_show(environ, tasks.names[0])} gives this process's rank but no variable gives "
                              "the world size: set WORLD_SIZE")
        launcher, rank, world = tasks.name, tasks.rank, tasks.size
        local_rank = local_rank_env if local_rank_env is not None else tasks.local_rank
        local_size = local_size_env if local_size_env is not None else tasks.local_size
        if local_rank is None:
            raise LaunchError(f"{_show(environ, tasks.names[0], tasks.names[1])} give no local rank (the rank's "
                              "GPU on its node): set LOCAL_RANK")
    else:
        ntasks = _int(environ, "SLURM_NTASKS")
        if "SLURM_JOB_ID" in environ and ntasks is not None and ntasks > 1:
            raise LaunchError(f"SLURM_NTASKS={ntasks} in Slurm job {environ['SLURM_JOB_ID']}, but this process was "
                              "not started by srun (no SLURM_STEP_ID), so it would train alone: start the tasks with "
                              "`srun python ...` (one per GPU), or run the batch script with --ntasks=1")
        stale = [f"{n}={v}" for n, v, one in (("WORLD_SIZE", world_env, 1), ("LOCAL_RANK", local_rank_env, 0),
                                               (local_size_name, local_size_env, 1)) if v is not None and v != one]
        if stale:
            raise LaunchError(f"{', '.join(stale)} but no launcher gave this process a rank (no RANK, "
                              "OMPI_COMM_WORLD_RANK, PMI_RANK, SLURM_PROCID, ...): launch with torchrun, deepspeed, "
                              "srun or mpirun, or unset these variables for a one-process run")
        return Launch("none", 0, 1, 0, 1, "127.0.0.1", None)

    # The torch.distributed variables against the scheduler's, where one task is one rank.
    if tasks is not None:
        pairs = ((tasks.names[0], tasks.rank, "RANK", rank_env),
                 (tasks.names[1], tasks.size, "WORLD_SIZE", world_env),
                 (tasks.names[2], tasks.local_rank, "LOCAL_RANK", local_rank_env),
                 (tasks.names[3], tasks.local_size, local_size_name, local_size_env))
        for task_name, task_value, torch_name, torch_value in pairs:
            if task_value is not None and torch_value is not None and task_value != torch_value:
                raise LaunchError(
                    f"{torch_name}={torch_value} but {tasks.name} started this process with {task_name}="
                    f"{task_value}: every {tasks.name} task is one rank, so the two must agree (unset "
                    f"{torch_name} and ds_pfc takes it from {task_name}; launch one task per GPU)")

    if world < 1:
        raise LaunchError(f"WORLD_SIZE={world}: a world has at least one rank")
    if not 0 <= rank < world:
        raise LaunchError(f"rank {rank} is outside the world of {world} ranks ({_launch_vars(environ, tasks)})")
    if local_size is not None and not 1 <= local_size <= world:
        raise LaunchError(f"{local_size} ranks on this node but {world} in the world ({_launch_vars(environ, tasks)})")
    if not 0 <= local_rank <= rank or (local_size is not None and local_rank >= local_size):
        raise LaunchError(f"local rank {local_rank} does not fit rank {rank} of {world}"
                          + (f" with {local_size} ranks on this node" if local_size is not None else "")
                          + f" ({_launch_vars(environ, tasks)})")

    if master_addr is None:
        if world == 1 or local_size == world:
            master_addr = "127.0.0.1"
        elif tasks is not None and tasks.name == "slurm":
            nodes = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST") or ""
            try:
                hosts = expand_hostlist(nodes)
            except ValueError as err:
                raise LaunchError(f"SLURM_STEP_NODELIST: {err}") from None
            if not hosts:
                raise LaunchError("srun gave no SLURM_STEP_NODELIST to find rank 0's host in: set MASTER_ADDR")
            master_addr = hosts[0]
        elif environ.get("AZ_BATCH_MASTER_NODE"):       # Azure ML's MPI jobs: "host:port"
            master_addr = environ["AZ_BATCH_MASTER_NODE"].split(":")[0]
    if master_port is None and world > 1:
        if "SLURM_JOB_ID" in environ and tasks is not None and tasks.name == "slurm":
            step = environ.get("SLURM_STEP_ID", environ.get("SLURM_STEPID", ""))
            master_port = _job_port(f"{environ['SLURM_JOB_ID']}.{step}")
        elif environ.get("PMIX_NAMESPACE"):
            master_port = _job_port(environ["PMIX_NAMESPACE"])
        else:
            master_port = DEFAULT_PORT
    return Launch(launcher, rank, world, local_rank, local_size, master_addr, master_port)


def _launch_vars(environ, tasks) -> str:
    names = list(TORCH_VARIABLES[:5]) + (list(tasks.names) if tasks else [])
    return _show(environ, *names) or "no launcher variables"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def export(environ=os.environ) -> Launch:
    """:func:`discover`, then write its ``torch.distributed`` variables into
    ``environ`` (a one-process world gets ``127.0.0.1`` and a free port). Idempotent.

    An MPI job over several nodes without ``MASTER_ADDR`` has no variable naming rank
    0's host: with ``mpi4py`` installed, ``MASTER_ADDR`` is left unset and DeepSpeed's
    ``init_distributed`` broadcasts it (its MPI discovery), else :class:`LaunchError`
    asks for it (``mpirun -x MASTER_ADDR=<first host>``)."""
    launch = discover(environ)
    if launch.master_port is None:
        launch = replace(launch, master_port=_free_port())
    if launch.master_addr is None:
        try:
            import mpi4py  # noqa: F401
        except ImportError:
            raise LaunchError(f"{launch.launcher} runs {launch.world_size} ranks over several nodes "
                              f"({launch.local_world_size} on this one) and no variable names rank 0's host: "
                              "export MASTER_ADDR=<rank 0's host> (mpirun -x MASTER_ADDR, or a line in "
                              ".deepspeed_env for `deepspeed --launcher openmpi|mvapich`), or install mpi4py") from None
    environ.update(launch.torch_environ())
    return launch


def check_process_group(launch: Launch, group=None) -> None:
    """After ``init_distributed``: the process group has the rank and size
    :func:`export` found (DeepSpeed's MPI discovery may have set them itself)."""
    import torch.distributed as dist
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if (rank, world) != (launch.rank, launch.world_size):
        raise LaunchError(f"the process group made this process rank {rank} of {world}, but the launcher "
                          f"({launch}) says rank {launch.rank} of {launch.world_size}")
