"""Process groups: :func:`init_distributed`, the engine's data-parallel and
tensor-parallel groups the heads are built from and checked against, and the
engine options under which the heads would train wrong."""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .._ds_internals import internal

if TYPE_CHECKING:
    from ..core.head import PartialFC
    from .heads import HeadSpec

__all__ = ["init_distributed"]


_SHM_DIR = "/dev/shm"
_SHM_PREFIX = "deepspeed_allreduce_buffer"


def init_distributed(dist_backend: str | None = None, environ=os.environ, **kwargs) -> None:
    """``deepspeed.init_distributed``, then unlink the name of this rank's segment of
    DeepSpeed's CPU shared-memory all-reduce.

    On the CPU accelerator, when every rank is on one machine (``LOCAL_SIZE`` equals
    the world size, as the ``deepspeed`` launcher and a single-process run set it),
    DeepSpeed maps a 69 MB segment per rank under ``/dev/shm`` and never unlinks it:
    each run leaves ``world_size`` x 69 MB of memory behind until reboot. Every rank
    has mapped every peer's segment when ``deepspeed.init_distributed`` returns, so
    after one barrier each rank unlinks its own name; the mappings stay valid for the
    life of the processes and the memory goes back when they exit, killed or not.
    ``dist_backend`` defaults to the accelerator's communication backend."""
    import deepspeed
    from deepspeed.comm import comm as ds_comm
    from deepspeed.accelerator import get_accelerator

    deepspeed.init_distributed(dist_backend=dist_backend or get_accelerator().communication_backend_name(),
                               **kwargs)
    if getattr(ds_comm.cdb, "shm_comm_op", None) is None:
        return                                  # no shared-memory all-reduce (GPU accelerators)
    import torch.distributed as dist
    world = dist.get_world_size()
    local = environ.get("LOCAL_SIZE", "")
    if not (local.isdigit() and int(local) == world):
        return                                  # DeepSpeed maps segments only when all ranks are local
    if world > 1:
        dist.barrier()                          # every peer has opened this rank's segment
    name = (f"{_SHM_PREFIX}_{os.getuid()}_{environ.get('MASTER_ADDR', '')}_{environ.get('MASTER_PORT', '')}"
            f"_{dist.get_rank()}")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(_SHM_DIR, name))


@dataclass
class _EngineGroups:
    """The engine's data-parallel and tensor-parallel groups, and their ranks."""

    dp_group: object
    tp_group: object
    dp_ranks: list
    tp_ranks: list
    model_ranks: list
    """Every rank of the tensor x data parallel grid this rank is in (the union of
    the tensor-parallel groups of the data-parallel ranks)."""
    device: torch.device
    _model_group: object = None

    @classmethod
    def of(cls, engine, mpu) -> "_EngineGroups":
        from ..core.collectives import group_ranks
        dp = internal(engine, "data_parallel_group", owner="engine", why="to build and check the heads' groups")
        tp = _tensor_parallel_group(engine, mpu)
        dp_ranks = sorted(group_ranks(dp))
        tp_ranks = sorted(group_ranks(tp)) if tp is not None else [torch.distributed.get_rank()
                                                                   if torch.distributed.is_initialized() else 0]
        device = torch.device(engine.device)
        model_ranks = dp_ranks
        if len(tp_ranks) > 1:       # the TP groups of every DP rank, gathered over DP
            if len(dp_ranks) > 1:
                table = [None] * len(dp_ranks)
                torch.distributed.all_gather_object(table, tp_ranks, group=dp)
            else:
                table = [tp_ranks]
            model_ranks = sorted({r for ranks in table for r in ranks})
        return cls(dp, tp, dp_ranks, tp_ranks, model_ranks, device)

    def _groups_for(self, shard: str):
        if shard == "data" or len(self.tp_ranks) == 1:
            return self.dp_group, self.dp_group
        if self._model_group is None:
            world = torch.distributed.get_world_size()
            self._model_group = torch.distributed.group.WORLD if len(self.model_ranks) == world else \
                torch.distributed.new_group(self.model_ranks, use_local_synchronization=True)
        return self._model_group, self.dp_group

    def build(self, spec: HeadSpec) -> PartialFC:
        group, batch_group = self._groups_for(spec.shard)
        return spec.build(group=group, batch_group=batch_group, device=self.device)

    def check(self, name: str, head: PartialFC) -> None:
        """Refuse a head whose groups are not the engine's, by membership."""
        from ..core.collectives import group_ranks
        # Also without data_parallel_grad: a head gathering over other ranks than the
        # engine's data-parallel group trains on duplicated or missing samples.
        batch = sorted(group_ranks(head.batch_group))
        if batch != self.dp_ranks:
            raise ValueError(f"head {name!r} gathers its samples over ranks {batch}, but the engine's data-parallel "
                             f"group is ranks {self.dp_ranks}: build it with the engine's data-parallel group "
                             "(or declare it with ds_pfc.deepspeed_plugin.head_spec)")
        classes = sorted(group_ranks(head.group))
        if classes not in (self.dp_ranks, self.model_ranks):
            allowed = f"ranks {self.dp_ranks} (data parallel)"
            if self.model_ranks != self.dp_ranks:
                allowed += f" or ranks {self.model_ranks} (tensor x data parallel)"
            raise ValueError(f"head {name!r} shards its classes over ranks {classes}, but with the engine's groups "
                             f"they must be sharded over {allowed}")


def _tensor_parallel_group(engine, mpu):
    """The engine's tensor-parallel group, or None without tensor parallelism: the
    caller's ``mpu`` (Megatron's ``get_tensor_model_parallel_group``), else the engine's
    own ``mpu`` (a pipeline's grid, whose tensor-slicing group is
    ``get_slice_parallel_group``; DeepSpeed's groups module under AutoTP), else
    DeepSpeed's tensor-parallel group if one was created."""
    from deepspeed.utils import groups
    why = "to find the tensor-parallel group the heads' classes are sharded over"
    for unit in (mpu, internal(engine, "mpu", owner="engine", why=why)):
        if unit is None or unit is groups:      # AutoTP's engine.mpu: its group is read below
            continue
        if hasattr(unit, "get_tensor_model_parallel_group"):
            return unit.get_tensor_model_parallel_group()
        if hasattr(unit, "get_slice_parallel_group"):       # PipelineParallelGrid
            return unit.get_slice_parallel_group()
    return internal(groups, "_TENSOR_MODEL_PARALLEL_GROUP", owner="deepspeed.utils.groups", why=why)


def _check_engine(engine, heads: dict) -> None:
    """Refuse engine options under which the heads would train wrong."""
    if not heads:
        return
    names = sorted(heads)
    sequence_parallel = internal(engine, "sequence_parallel_size", owner="engine",
                                 why="to refuse sequence parallelism, which the heads do not support")
    if sequence_parallel > 1:
        raise ValueError(f"heads {names}: sequence parallelism (sequence_parallel_size={sequence_parallel}) is not "
                         "supported: DeepSpeed reduces the backbone's gradients over the sequence x data parallel "
                         "ranks but divides by the data-parallel size only, so the embedding gradient a head "
                         "returns would be wrong by a factor that depends on how the embedding is pooled over the "
                         "sequence-parallel ranks. Train the heads without sequence parallelism "
                         "(sequence_parallel_size 1)")
    average = internal(engine, "gradient_average", owner="engine",
                       why="to check that the engine averages gradients over the data-parallel ranks")
    if not average and any(a.head.data_parallel_grad for a in heads.values()):
        raise ValueError(f"heads {names}: the engine sums gradients over the data-parallel ranks "
                         f"(gradient_allreduce_op={engine._config.gradient_allreduce_op!r}), but a head's embedding "
                         "gradient is that of the mean loss over the global batch, which DeepSpeed must average; "
                         "use the default gradient_allreduce_op (mean)")
    if engine.use_node_local_storage():
        raise ValueError(f"heads {names}: checkpoint.use_node_local_storage is not supported: ds_pfc's checkpoints "
                         "need one output directory that every rank reads and writes (rank 0 writes the marker and "
                         "latest; a resume on another number of ranks reads every rank's head shards)")
