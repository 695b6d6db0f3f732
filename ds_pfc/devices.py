"""Device placement rules, in one place.

- ``"cuda"`` without an index means *the current CUDA device* and is normalised to
  ``cuda:<current_device()>`` at once, so that a head built with ``device="cuda"``
  accepts the ``cuda:3`` tensors of the rank bound to GPU 3 (``torch.device("cuda")``
  never compares equal to ``torch.device("cuda", 3)``).
- A head whose group communicates through NCCL lives on the current CUDA device by
  default; a CPU head on an NCCL group is refused with a clear error (NCCL cannot move
  CPU tensors).
- A launched process binds ``cuda:<local rank>`` right after ``init_distributed``
  and before it touches CUDA (:func:`bind_local_device`): DeepSpeed binds the device
  only inside ``deepspeed.initialize``, so every rank would otherwise build its head,
  batches and evaluation on GPU 0. The local rank is the launcher's
  (:func:`ds_pfc.launchers.discover`: ``LOCAL_RANK``, ``OMPI_COMM_WORLD_LOCAL_RANK``,
  ``SLURM_LOCALID``, ...), so an ``mpirun`` or ``srun`` task binds its own GPU too.
- Worker threads that issue CUDA work set their device first
  (:func:`set_thread_device`), so no rank creates a context on GPU 0.
- Large host tables that a GPU reads in place are placed near it: :func:`local_cpus`
  finds the CPUs of the GPU's NUMA node, :func:`place_host_table` asks for huge pages
  and touches every page first from those CPUs, so that the kernel's default
  first-touch policy allocates them on that node. Only CPUs the job may run on are
  used (the node's CPUs intersected with ``os.sched_getaffinity``): a job whose cpuset
  excludes the node gets a warning and an unbound touch, never an error; the placement
  achieved (pages per node, from ``/proc/self/numa_maps``) is reported
  (:func:`host_placement`), since a ``numactl`` policy may override the touch.
- Half-precision products on a CPU run at speed only with the CPU's bf16/fp16
  instructions (:func:`cpu_native_half`); elsewhere torch emulates them, many times
  slower than float32, and the head warns.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import threading
import warnings

import torch
import torch.distributed as dist

__all__ = ["normalize_device", "group_uses_nccl", "head_device", "collective_device", "bind_local_device",
           "set_thread_device", "local_cpus", "place_host_table", "host_placement"]


def normalize_device(device) -> torch.device:
    """``torch.device`` with the CUDA index filled in (``"cuda"`` -> ``cuda:<current>``)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def group_uses_nccl(group=None) -> bool:
    """Whether ``group`` (None: the default group, if initialised) communicates via NCCL."""
    if not (dist.is_available() and dist.is_initialized()):
        return False
    try:
        backend = dist.get_backend(group)
    except (RuntimeError, ValueError):
        return False
    return "nccl" in str(backend).lower()


def head_device(device, group=None) -> torch.device:
    """Where a head built with ``device`` on ``group`` lives.

    None: the current CUDA device when the group uses NCCL, else the CPU. An explicit
    CPU device on an NCCL group raises ``ValueError``.
    """
    nccl = group_uses_nccl(group)
    if device is None:
        return normalize_device("cuda") if nccl else torch.device("cpu")
    device = normalize_device(device)
    if nccl and device.type != "cuda":
        raise ValueError(f"device must be a CUDA device for a head whose group uses NCCL (NCCL moves only CUDA "
                         f"tensors), got {device}; pass device='cuda' (the current device) or use a gloo group")
    return device


def collective_device(group, device) -> torch.device:
    """The device of the small tensors (sizes, agreement tables) sent over ``group``:
    the current CUDA device under NCCL, else ``device``."""
    if group_uses_nccl(group):
        return normalize_device("cuda")
    return torch.device(device)


def bind_local_device(environ=os.environ, local_rank: int | None = None) -> torch.device | None:
    """Bind this process to ``cuda:<local rank>`` when CUDA is available; returns the
    bound device, or None (no CUDA). ``local_rank`` defaults to the launcher's
    (:func:`ds_pfc.launchers.discover` on ``environ``, checked against the
    scheduler's variables). Call it after ``init_distributed`` and before any CUDA
    work. A local rank without a visible GPU of its own is refused."""
    if not torch.cuda.is_available():
        return None
    if local_rank is None:
        from .launchers import discover
        local_rank = discover(environ).local_rank
    count = torch.cuda.device_count()
    if not 0 <= local_rank < count:
        raise RuntimeError(f"LOCAL_RANK={local_rank} but this node has {count} visible CUDA device(s) "
                           f"(CUDA_VISIBLE_DEVICES={environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}): launch at most "
                           "one process per GPU, each seeing all of the node's GPUs (a scheduler that gives each task "
                           "only its own GPU, e.g. srun --gpus-per-task=1, needs --gpu-bind=none)")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def set_thread_device(device) -> None:
    """For a worker thread: make ``device`` current before it issues CUDA work (a new
    thread starts on device 0)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device.index)


def _parse_cpulist(text: str) -> set[int]:
    """``"0-3,8,10-11"`` -> {0, 1, 2, 3, 8, 10, 11}."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def local_cpus(device, sysfs: str = "/sys/bus/pci/devices") -> set[int] | None:
    """The CPUs of CUDA ``device``'s NUMA node, read from sysfs through the GPU's PCI
    address, or None where that is unknown (not CUDA, no PCI address in torch's device
    properties, no such file)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(device.index if device.index is not None else torch.cuda.current_device())
    ids = [getattr(props, name, None) for name in ("pci_domain_id", "pci_bus_id", "pci_device_id")]
    if any(not isinstance(i, int) for i in ids):
        return None
    path = os.path.join(sysfs, f"{ids[0]:04x}:{ids[1]:02x}:{ids[2]:02x}.0", "local_cpulist")
    try:
        with open(path) as f:
            cpus = _parse_cpulist(f.read())
    except (OSError, ValueError):
        return None
    return cpus or None


_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)


def _advise_huge_pages(table: torch.Tensor) -> bool:
    """Ask for transparent huge pages over the 2 MiB-aligned interior of ``table``'s
    memory (before it is touched). True if the kernel took the advice."""
    huge = 2 << 20
    start = table.data_ptr()
    end = start + table.numel() * table.element_size()
    lo, hi = -(-start // huge) * huge, end // huge * huge
    if hi <= lo:
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_HUGEPAGE) == 0
    except (OSError, AttributeError):
        return False


def place_host_table(table: torch.Tensor, cpus: set[int] | None = None, huge_pages: bool = True, *,
                     allowed: set[int] | None = None, numa_maps: str = "/proc/self/numa_maps",
                     maps: str = "/proc/self/maps") -> dict:
    """Zero a new (untouched) host ``table`` so that its pages land near a GPU: asks for
    huge pages first (``huge_pages``), then touches every page from a thread bound to
    ``cpus`` (the GPU's :func:`local_cpus`; None: the caller's CPUs).

    Only CPUs this job may run on are used: ``cpus`` is intersected with ``allowed``
    (None: ``os.sched_getaffinity(0)``, the job's cpuset). When nothing is left (a
    container or a scheduler's per-task binding that excludes the GPU's node), or the
    kernel refuses the binding, the table is touched unbound, from the caller's CPUs,
    with a warning: a slower placement, never a job that cannot start.

    Returns what was done: ``{"huge_pages": bool, "cpus": n or None, "requested_cpus":
    n or None, "fallback": reason or None, "nodes": {node: pages} or None}``, where
    ``nodes`` is the placement achieved (:func:`host_placement` over ``numa_maps`` and
    ``maps``; None where the system does not say)."""
    done = {"huge_pages": _advise_huge_pages(table) if huge_pages else False, "cpus": None,
            "requested_cpus": len(cpus) if cpus else None, "fallback": None, "nodes": None}
    flat = table.view(-1).view(torch.uint8) if table.numel() else None
    if flat is None:
        return done
    bind = None
    if cpus and hasattr(os, "sched_setaffinity"):
        if allowed is None:
            allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(cpus)
        bind = set(cpus) & set(allowed)
        if not bind:
            done["fallback"] = (f"none of the GPU's {len(cpus)} NUMA-local CPUs ({_cpulist(cpus)}) is in this job's "
                                f"CPU set ({_cpulist(allowed)})")
            bind = None
    errors: list[BaseException] = []

    def touch():
        try:
            if bind:
                try:
                    os.sched_setaffinity(0, bind)          # this thread only
                    done["cpus"] = len(bind)
                except OSError as err:
                    done["fallback"] = f"binding the touch to CPUs {_cpulist(bind)} failed ({err})"
            flat.numpy().fill(0)                      # one thread: the pages follow its CPUs
        except BaseException as err:  # noqa: BLE001 - re-raised in the caller
            errors.append(err)

    worker = threading.Thread(target=touch, name="ds_pfc-first-touch")
    worker.start()
    worker.join()
    if errors:
        raise errors[0]
    if done["fallback"]:
        warnings.warn(f"ds_pfc: host table of {flat.numel()} bytes placed without NUMA binding: {done['fallback']}; "
                      "its pages follow the caller's CPUs (GPU reads may cross sockets)", RuntimeWarning, stacklevel=2)
    done["nodes"] = host_placement(table, numa_maps=numa_maps, maps=maps)
    return done


def _cpulist(cpus) -> str:
    """{0, 1, 2, 3, 8} -> ``"0-3,8"``."""
    out, run = [], []
    for cpu in sorted(cpus):
        if run and cpu == run[-1] + 1:
            run.append(cpu)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [cpu]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def host_placement(table: torch.Tensor, *, numa_maps: str = "/proc/self/numa_maps",
                   maps: str = "/proc/self/maps") -> dict[int, int] | None:
    """Pages of host ``table``'s mapping per NUMA node, ``{node: pages}``, read from
    ``numa_maps`` (the ``N<node>=<pages>`` fields of the mapping that holds the table,
    found through ``maps``); None where unknown (no such files, the table shares a mapping
    with nothing to say, a kernel without NUMA)."""
    if not table.numel():
        return None
    ptr = table.data_ptr()
    try:
        with open(maps) as f:
            start = None
            for line in f:
                lo, _, hi = line.split(" ", 1)[0].partition("-")
                if int(lo, 16) <= ptr < int(hi, 16):
                    start = lo.lstrip("0") or "0"
                    break
        if start is None:
            return None
        with open(numa_maps) as f:
            for line in f:
                fields = line.split()
                if fields and (fields[0].lstrip("0") or "0") == start:
                    nodes = {}
                    for field in fields[1:]:
                        key, eq, value = field.partition("=")
                        if eq and key[:1] == "N" and key[1:].isdigit():
                            nodes[int(key[1:])] = int(value)
                    return nodes or None
    except (OSError, ValueError):
        return None
    return None


_HALF_FLAGS = {torch.bfloat16: ("avx512_bf16", "amx_bf16"), torch.float16: ("avx512_fp16", "amx_fp16")}


def cpu_native_half(dtype: torch.dtype, cpuinfo: str = "/proc/cpuinfo") -> bool | None:
    """Whether this CPU has instructions for ``dtype`` products (bf16: AVX512-BF16 or AMX-BF16;
    fp16: AVX512-FP16 or AMX-FP16), read from ``cpuinfo``'s flags; None when unknown (no
    such file, another platform); True for other dtypes."""
    flags = _HALF_FLAGS.get(dtype)
    if flags is None:
        return True
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    have = set(line.split(":", 1)[1].split())
                    return any(flag in have for flag in flags)
    except OSError:
        return None
    return None
