"""Memory and transfer planner for the class bank: ``ds-pfc-bench plan`` (``launch/bench.py plan``).

For ``C`` classes of width ``d`` sharded over ``k`` GPUs (``C_q = ceil(C / k)`` classes per
rank) on nodes of ``gpus_per_node`` GPUs, each with its own host memory, links and CPUs, and
a sample rate ``r``, it computes per rank and per node, from formulas (nothing runs):

* the bytes of each bank state (the centers and the row optimizer's state,
  :mod:`ds_pfc.core.optim`) in its storage dtype, and where they live for each way to place
  the bank that the bank builds: ``device`` (every state in GPU memory), ``host`` (mapped
  access: page-locked host memory mapped into the GPU; the row mover gathers the cold rows and
  writes the stepped rows back, host memory touched once per byte moved), ``host-cpu``
  (staged access: CPU threads gather into pinned staging buffers and scatter back, host memory
  touched ~3.5 times per byte moved). A tier the bank refuses (8-bit rows in mapped host
  memory, ``hbm_share`` with staged access) is marked not built and never suggested; NVMe is
  not a tier (:data:`ds_pfc.bank.tiered.NVME_REFUSED`);
* GPU memory: the staged slots (:mod:`ds_pfc.bank.slots`: two sets, and the third that
  ``--slot-sets 3`` keeps so that fetch and write-back overlap), the gradient of the staged
  centers, the softmax's buffers, the sampler's keys, the fetch's temporaries (a chunk), the
  backbone (counted by default), and the peak at resume;
* per step: bytes over PCIe each way (the mapped tier writes back only the rows that leave
  the next set), the bank's streams (duplex with three slot sets, in turn with two), the
  row mover's rate from its bytes in flight and the uplink's share, node host-memory traffic
  at a read/write mix, CPU-seconds, the window (backbone plus the head's compute) and the
  backbone's slowdown from the SMs the mover holds; margins for every check, and for every
  limit the largest class count at which it still holds (found by bisection on ``C``: every
  figure grows with ``C`` at fixed ``r``).

The model's assumptions, sources and how to read the table: ``docs/planner.md``.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import re
import sys

from .._args import parser
from ..bank.quantized import CODE_CHUNK_BYTES
from ..bank.staged import FETCH_CHUNK_BYTES
from ..bank.tiered import SLOT_SETS
from ..core.head import LOAD_CHUNK_BYTES
from ..core.softmax import COSINE_KEEP_BYTES, CUDA_BLOCK_BYTES

__all__ = ["plan", "PlanArgumentError", "GPUS", "BACKBONES", "TIERS", "DEFAULTS", "build_parser", "main",
           "format_plan", "format_sweep", "format_limits", "parse_classes", "mover_gbps", "refresh_docs"]

# --------------------------------------------------------------------- constants
TIERS = ("device", "host", "host-cpu")

GB = 1e9            # every "GB" here is 10^9 bytes, as the data sheets count
GPU_RESERVE_GB = 3.0  # CUDA context, cuBLAS/Triton workspaces, allocator fragmentation (assumed)

# GPU memory per GPU in GB, from the data sheets (decimal GB; nvidia-smi shows somewhat more
# bytes, e.g. 81559 MiB on an H100 80GB, so the decimal figure leaves a little extra margin),
# and the streaming multiprocessors the row mover's programs take from the backbone.
GPUS = {
    "h100-80g": dict(name="H100 SXM 80GB", memory_gb=80.0, sms=132, source="NVIDIA H100 data sheet: 80 GB HBM3"),
    "h200": dict(name="H200 SXM 141GB", memory_gb=141.0, sms=132, source="NVIDIA H200 data sheet: 141 GB HBM3e"),
    "a100-40g": dict(name="A100 40GB", memory_gb=40.0, sms=108, source="NVIDIA A100 data sheet: 40 GB HBM2"),
}

# Backbones at 112x112 in the precision of the paper configs in configs/ (IR50/IR100: fp16,
# ViT-S: bf16). Measured once on a CPU (torch 2.13.0, 1 thread) by
# tests/test_plan.py::saved_tensor_bytes: build_backbone(name) in train mode, its parameters
# cast to bfloat16 as DeepSpeed's fp16/bf16 modes cast them (buffers stay float32; fp16 and bf16
# both take 2 bytes), one forward of a bfloat16 batch of 2 under
# torch.autograd.graph.saved_tensors_hooks, summing the bytes of every distinct storage saved
# for backward that is not a parameter. "saved_bytes_batch2" is that sum for the batch of 2
# (at a batch of 4 it was 1.995x, 1.994x and 2.000x of it: linear in the batch);
# "params" counts every parameter. On a GPU ViT attention saves what the CPU's fused
# attention saves (q, k, v, the output and the log-sum-exp).
BACKBONES = {
    "r50": dict(model="iresnet50", params=43_590_848, saved_bytes_batch2=71_181_824, precision="fp16"),
    "r100": dict(model="iresnet100", params=65_156_160, saved_bytes_batch2=112_440_320, precision="fp16"),
    "vit_s": dict(model="vit_s", params=76_022_784, saved_bytes_batch2=57_529_472, precision="bf16"),
}
# Backbone bytes per parameter under DeepSpeed mixed precision, ZeRO stage 0 (as the paper
# configs run): 16-bit weight (2) and gradient (2), float32 master weight (4) and its float32
# gradient (4), and the optimizer's float32 state: SGD momentum (4), AdamW's two moments (8).
BACKBONE_BYTES_PER_PARAM = {"sgd": 16, "adamw": 20}

HOST_TOUCHES = {"host": 1.0, "host-cpu": 3.5}   # host-memory bytes per byte moved (assumed)
SAMPLER_BYTES_PER_CLASS = 14   # int64 keys, int32 buckets and two byte masks of the select (core/sampling.py)
VERSION_BYTES = 8   # per row and state: the bank's int32 "issued" and the store's int32 "versions"

#: The row mover's rate is its stated launch (``ds_pfc.kernels.triton_rows``:
#: ``default_config``, ``bytes_in_flight``, ``ASSUMED_LATENCY_US``) by Little's law: bytes in
#: flight / latency. At d = 512 with bf16 rows a mapped read keeps 16 programs x 8 rows x 1 KiB
#: = 128 KiB in flight, / 2 us = 65.5 GB/s (the uplink binds first); the device-to-device
#: overlap patch 256 KiB / 1 us. Stated defaults until a GPU measures them
#: (``ds-pfc-bench rows --tier-check``); ``--zero-copy-gbps`` / ``--patch-gbps`` override them.
#: The head's effective matrix rate, TFLOP/s: one H200 step at S = 800k, N = 2048, d = 512
#: (bf16 products, three GEMM-shaped passes of 2 N S d flops) took 25.8 ms (docs/gpu.md),
#: 195 TFLOP/s; H100 SXM has the same bf16 tensor rate. A100: scaled by 312/989.
HEAD_TFLOPS = {"h100-80g": 195.0, "h200": 195.0, "a100-40g": 61.5}
#: fp32 ``[|S_q|, d]`` temporaries the torch int8 path keeps at its peak per coded state on
#: the device (decode, scale, select in the overlap patch; ``bank/quantized.py``).
INT8_TEMPORARIES = 3

DEVICE_ACCESS = ("staged", "mapped")

DEFAULTS = dict(optimizer="sgd", storage="fp32", backbone="r100", batch=128, step_ms=300.0, head_ms=None,
                host_gbps=370.0, pcie_gbps=50.0, zero_copy_gbps=None, patch_gbps=None,
                mover_programs=16, gpus_per_node=8, gpus_per_uplink=1, slot_sets=3, int8_in_mover=True,
                device_access="staged", resume_chunk_mb=LOAD_CHUNK_BYTES / 1e6, host_ram_gb=2048.0, cpu_gbps=6.0, cpu_cores=112,
                hbm_share=0.0, block_bytes=CUDA_BLOCK_BYTES, keep_bytes=COSINE_KEEP_BYTES, momentum=0.9)

# CLI spelling of each argument (errors name the option to change).
FLAGS = {"classes": "--classes", "dim": "--dim", "gpus": "--gpus", "gpu": "--gpu", "sample_rate": "--sample_rate",
         "optimizer": "--optimizer", "storage": "--storage", "backbone": "--backbone", "batch": "--batch",
         "step_ms": "--step-ms", "head_ms": "--head-ms", "host_gbps": "--host-gbps", "pcie_gbps": "--pcie-gbps",
         "zero_copy_gbps": "--zero-copy-gbps", "patch_gbps": "--patch-gbps", "mover_programs": "--mover-programs",
         "gpus_per_node": "--gpus-per-node", "gpus_per_uplink": "--gpus-per-uplink", "slot_sets": "--slot-sets",
         "int8_in_mover": "--int8-in-mover", "device_access": "--device-access",
         "resume_chunk_mb": "--resume-chunk-mb", "host_ram_gb": "--host-ram-gb",
         "cpu_gbps": "--cpu-gbps", "cpu_cores": "--cpu-cores",
         "hbm_share": "--hbm-share", "block_bytes": "--block-bytes", "keep_bytes": "--keep-bytes",
         "momentum": "--momentum"}


FLAGS_BY_OPTION = {flag: name for name, flag in FLAGS.items()}


class PlanArgumentError(ValueError):
    """A bad argument; ``argument`` is its name (``sample_rate``), ``flag`` its CLI option."""

    def __init__(self, argument: str, message: str):
        self.argument, self.flag = argument, FLAGS.get(argument, "--" + argument)
        super().__init__(f"{self.flag}: {message}")


# --------------------------------------------------------------------- inputs
def _check_inputs(p: dict) -> dict:
    def number(name, low=None, high=None, low_open=False, integer=False):
        v = p[name]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)) \
                or (isinstance(v, float) and not math.isfinite(v)):
            raise PlanArgumentError(name, f"must be {'an integer' if integer else 'a finite number'}, got {v!r}")
        if low is not None and (v <= low if low_open else v < low):
            raise PlanArgumentError(name, f"must be {'>' if low_open else '>='} {low}, got {v!r}")
        if high is not None and v > high:
            raise PlanArgumentError(name, f"must be <= {high}, got {v!r}")
    for name in ("classes", "dim", "gpus", "batch", "block_bytes", "cpu_cores", "mover_programs", "gpus_per_node",
                 "gpus_per_uplink"):
        number(name, 1, integer=True)
    number("keep_bytes", 0, integer=True)
    number("sample_rate", 0.0, 1.0, low_open=True)
    number("hbm_share", 0.0, 1.0)
    number("momentum", 0.0, 1.0)
    number("resume_chunk_mb", 0.0)
    if p["momentum"] >= 1.0:
        raise PlanArgumentError("momentum", f"must be < 1, got {p['momentum']!r}")
    if p["hbm_share"] >= 1.0:
        raise PlanArgumentError("hbm_share", f"must be < 1 (the bank keeps a share of a host-tier state's rows in "
                                             f"GPU memory; 1 is the device tier), got {p['hbm_share']!r}")
    for name in ("step_ms", "host_gbps", "pcie_gbps", "host_ram_gb", "cpu_gbps"):
        number(name, 0.0, low_open=True)
    for name in ("zero_copy_gbps", "patch_gbps"):
        if p[name] is not None:
            number(name, 0.0, low_open=True)
    if p["head_ms"] is not None:
        number("head_ms", 0.0)
    if p["gpus_per_uplink"] > p["gpus_per_node"]:
        raise PlanArgumentError("gpus_per_uplink", f"must be at most --gpus-per-node ({p['gpus_per_node']}), "
                                                   f"got {p['gpus_per_uplink']}")
    if p["classes"] < p["gpus"]:
        raise PlanArgumentError("classes", f"must be at least --gpus ({p['gpus']}) so that every rank holds a "
                                           f"class, got {p['classes']}")
    if isinstance(p["slot_sets"], bool):
        raise PlanArgumentError("slot_sets", f"must be one of {SLOT_SETS}, got {p['slot_sets']!r}")
    if not isinstance(p["int8_in_mover"], bool):
        raise PlanArgumentError("int8_in_mover", f"must be True or False, got {p['int8_in_mover']!r}")
    for name, choices in (("gpu", GPUS), ("optimizer", BACKBONE_BYTES_PER_PARAM), ("storage", STORAGES),
                          ("backbone", (*BACKBONES, "none")), ("slot_sets", SLOT_SETS),
                          ("device_access", DEVICE_ACCESS)):
        if p[name] not in choices:
            raise PlanArgumentError(name, f"must be one of {', '.join(map(str, choices))}, got {p[name]!r}")
    return p


def _mover_latency() -> dict:
    from ..kernels.triton_rows import ASSUMED_LATENCY_US
    return dict(ASSUMED_LATENCY_US)


def mover_gbps(p: dict) -> tuple[float, float, str]:
    """(zero-copy GB/s per GPU and direction, device-to-device patch GB/s, how each was set)."""
    from ..kernels.triton_rows import ASSUMED_LATENCY_US, bytes_in_flight, default_config
    row = (4 if p["storage"] == "fp32" else 2) * p["dim"]        # the weight's rows, the widest moved
    read = default_config("host_read", row, p["dim"])
    inflight = bytes_in_flight(read, row) * p["mover_programs"] / read.max_programs
    link = p["pcie_gbps"] / p["gpus_per_uplink"]
    if p["zero_copy_gbps"] is None:
        latency = ASSUMED_LATENCY_US["host_read"]
        mover = inflight / (latency * 1e-6) / GB
        how = (f"{inflight / 1024:g} KiB in flight ({p['mover_programs']} programs x {read.rows_per_pass} rows x "
               f"{row} B) / {latency:g} us = {mover:.1f} GB/s (Little's law, not measured)")
    else:
        mover, how = p["zero_copy_gbps"], f"--zero-copy-gbps {p['zero_copy_gbps']:g}"
    rate = min(mover, link)
    if rate < mover:
        how += f", capped by the uplink: {p['pcie_gbps']:g} / {p['gpus_per_uplink']} GPUs = {link:.1f} GB/s"
    d2d = default_config("d2d", row, p["dim"])
    patch = bytes_in_flight(d2d, row) / (ASSUMED_LATENCY_US["d2d"] * 1e-6) / GB if p["patch_gbps"] is None \
        else p["patch_gbps"]
    return rate, patch, how


#: Storage of the bank's floating states: all float32, all bfloat16, or bfloat16 with the
#: first moment (SGD's momentum, AdamW's exp_avg) in 8 bits with a scale per row
#: (``int8_rowwise``: d + 4 bytes a row).
STORAGES = ("fp32", "bf16", "bf16-int8m")
_CODED = ("momentum_buffer", "exp_avg")


def _states(optimizer: str, momentum: float, dim: int, storage: str) -> list[dict]:
    """The bank's states (``PartialFC`` adds ``weight``, then the optimizer's ``state_specs``):
    name, width, bytes per row in storage and in the logical dtype."""
    s = 4 if storage == "fp32" else 2
    specs = [("weight", dim, "float")]
    if optimizer == "sgd":
        if momentum:
            specs.append(("momentum_buffer", dim, "float"))
    else:
        specs += [("exp_avg", dim, "float"), ("exp_avg_sq", dim, "float"), ("step", 0, "int32")]
    out = []
    for name, width, kind in specs:
        elems = max(width, 1)
        # A storage dtype applies to floating states; AdamW's int32 "step" keeps its own.
        store = (storage if kind == "float" else "int32")
        if store == "bf16-int8m" and name in _CODED:
            out.append(dict(name=name, width=width, storage_dtype="int8_rowwise", row_bytes=width + 4,
                            logical_row_bytes=elems * 4))
            continue
        out.append(dict(name=name, width=width, storage_dtype="float32" if store == "fp32" else
                        ("int32" if store == "int32" else "bfloat16"),
                        row_bytes=elems * (s if kind == "float" else 4), logical_row_bytes=elems * 4))
    return out


# --------------------------------------------------------------------- the figures
def _figures(p: dict, classes: int) -> dict:
    """Every number of the plan at ``classes`` (other inputs from ``p``)."""
    k, d, r, f, B = p["gpus"], p["dim"], p["sample_rate"], p["hbm_share"], p["batch"]
    cq = -(-classes // k)
    ranks = min(k, p["gpus_per_node"])              # ranks on the busiest node
    nodes = -(-k // p["gpus_per_node"])
    n_gathered = B * k
    states = _states(p["optimizer"], p["momentum"], d, p["storage"])
    row = sum(s["row_bytes"] for s in states)
    row_logical = sum(s["logical_row_bytes"] for s in states)
    nstates = len(states)
    coded = [s for s in states if s["storage_dtype"] == "int8_rowwise"]

    # The active set (core/sampling.py): |S_q| = max(floor(r C_q), |P_q|); |P_q| <= N, so
    # |S_q| = floor(r C_q) exactly when that is at least N; else the expected distinct positives.
    budget = min(cq, math.floor(r * cq + 1e-9))
    positives = cq * -math.expm1(n_gathered * math.log1p(-1.0 / classes)) if classes > 1 else 1.0
    active = budget if budget >= n_gathered else max(budget, int(round(positives)))
    # A row of S(t+1) is in S(t) with probability |S_q| / C_q (uniform draws): the overlap is
    # copied on the GPU from the stepped slot, the rest ("cold") comes from the bank.
    cold = active * (1.0 - active / cq)
    overlap = active - cold
    host_rows = (1.0 - f) * cq                 # rows outside GPU memory (--hbm-share)
    # In: the cold rows. Out: mapped access writes back the stepped rows that leave the next
    # set (|S_q| - overlap = the cold rows; the next slot carries the overlap), staged access
    # every stepped row.
    moved_in, moved_out = (1.0 - f) * cold, (1.0 - f) * active

    # The step's window: the backbone's step and the head's own compute (three GEMM-shaped
    # passes of 2 N |S_q| d flops), both of which the bank's stream overlaps.
    head_s = (p["head_ms"] / 1e3 if p["head_ms"] is not None
              else 3 * 2 * n_gathered * active * d / (HEAD_TFLOPS[p["gpu"]] * 1e12))
    step_s = p["step_ms"] / 1e3
    window = step_s + head_s
    zero_copy, patch_rate, zero_copy_how = mover_gbps(p)
    link = p["pcie_gbps"] / p["gpus_per_uplink"]

    # GPU memory besides the bank, per GPU.
    slot = active * row_logical
    grad = active * d * 4                       # the float32 gradient of the staged centers
    # The Triton backend keeps the float16 cosines (G is then formed over them) within keep_bytes,
    # else one class block of G in bf16.
    cosines = n_gathered * active * 2
    kept = cosines <= p["keep_bytes"]
    logits = cosines if kept else min(p["block_bytes"], cosines)
    softmax = logits + active * (2 * d + 4) + 3 * n_gathered * d * 4   # + normalised centers, norms, x/x_hat/dx
    sampler = SAMPLER_BYTES_PER_CLASS * cq
    bb = BACKBONES.get(p["backbone"])
    bb_params = bb["params"] if bb else 0
    bb_state = bb_params * BACKBONE_BYTES_PER_PARAM[p["optimizer"]]
    bb_act = (bb["saved_bytes_batch2"] / 2) * B if bb else 0.0
    common_gpu = 2 * slot + grad + softmax + sampler + bb_state + bb_act
    gpu_limit = GPUS[p["gpu"]]["memory_gb"] * GB - GPU_RESERVE_GB * GB
    host_limit = p["host_ram_gb"] * GB

    bank_storage = cq * row
    counters = VERSION_BYTES * nstates * cq
    per_state = [dict(s, bytes=cq * s["row_bytes"]) for s in states]
    # Resume (checkpoint/shards.py, core/head.py): each state is read whole into host memory as
    # float32 and moved whole to the GPU, unless --resume-chunk-mb bounds both by a chunk.
    whole = max(cq * s["logical_row_bytes"] for s in states)
    chunk = p["resume_chunk_mb"] * 1e6
    resume_gpu = min(whole, chunk) if chunk else whole
    resume_host_rank = min(cq * row_logical, chunk) if chunk else cq * row_logical
    # fp32 temporaries of the torch int8 path for coded states on the device (none once the
    # mover codes and decodes rows in its registers).
    # Coded a chunk at a time (bank/quantized.py: CODE_CHUNK_BYTES of float32 rows).
    int8_temp = 0.0 if p["int8_in_mover"] else INT8_TEMPORARIES * min(active * d * 4, CODE_CHUNK_BYTES) * len(coded)
    # The staged fetch gathers, widens and lands rows a chunk at a time (bank/staged.py).
    fetch_chunk_rows = max(1, FETCH_CHUNK_BYTES // (d * 4))

    def temporaries(tier: str) -> dict:
        out = {}
        if tier == "device":
            if coded:
                out["int8 decode/encode (torch ops)"] = int8_temp
            if p["device_access"] == "staged":
                # the staged device-tier fetch gathers the cold rows in storage dtype and
                # widens them: one state at a time, the widest counts.
                widest = max(s["row_bytes"] + s["logical_row_bytes"] for s in states if s not in coded)
                out["staged fetch gather + float32 copy"] = min(cold, fetch_chunk_rows) * widest
        elif f > 0 and coded:
            out["int8 decode/encode (torch ops)"] = int8_temp
        if tier == "host-cpu":
            # the staged fetch lands the pinned cold rows on the GPU in the dtype they crossed
            # PCIe in (8-bit rows decoded on the host: float32) and widens them to float32
            def landed(s):
                if s in coded and p["int8_in_mover"]:
                    return 0                # the mover decodes the codes into the slot
                moved = s["logical_row_bytes"] if s in coded else s["row_bytes"]
                return moved + (s["logical_row_bytes"] if moved != s["logical_row_bytes"] else 0)
            out["staged fetch landing + float32 copy"] = min(moved_in, fetch_chunk_rows) * max(landed(s)
                                                                                               for s in states)
        return {name: v for name, v in out.items() if v}

    tiers = {}
    # -- device: every state in GPU memory; the tiered bank keeps its version counters on the host.
    temp = temporaries("device")
    # A third slot set: kept by mapped access with --slot-sets 3, and by staged access (its pool).
    third_device = slot if p["slot_sets"] == 3 or p["device_access"] == "staged" else 0.0
    gpu = bank_storage + common_gpu + third_device + sum(temp.values())
    at_resume = bank_storage + bb_state + resume_gpu
    tiers["device"] = dict(
        available=True, reason=None,
        gpu_bytes=gpu, gpu_bank_bytes=bank_storage, temporaries=temp, third_slot_bytes=third_device,
        gpu_resume_bytes=at_resume, host_bytes_rank=counters, host_bytes_node=ranks * counters,
        host_resume_node=ranks * (counters + resume_host_rank),
        pcie_in=0.0, pcie_out=0.0, host_traffic_node=0.0, cpu_seconds_rank=0.0, cpu_seconds_node=0.0,
        times={}, stream_s=0.0, mover_busy=0.0, backbone_slowdown=0.0,
        checks=[("GPU memory per GPU", "memory", gpu, gpu_limit),
                ("GPU memory at resume", "memory", at_resume, gpu_limit),
                ("host RAM per node", "memory", ranks * counters, host_limit),
                ("host RAM per node at resume", "memory", ranks * (counters + resume_host_rank), host_limit)])

    # -- host tiers: the bank in host memory (a share --hbm-share of its rows in GPU memory).
    gpu_share = f * bank_storage
    for tier in ("host", "host-cpu"):
        available, reason = True, None
        if tier == "host" and coded and not p["int8_in_mover"]:
            available, reason = False, ("8-bit rows in host memory are decoded by the host, so mapped access "
                                        "cannot read them in place (the bank refuses it on CUDA); plan with "
                                        "--int8-in-mover once the row mover codes rows, or use host-cpu")
        if tier == "host-cpu" and f > 0:
            available, reason = False, "--hbm-share needs mapped access (the bank refuses it with staged access)"
        # Bytes per row over PCIe: as built the staged path decodes 8-bit rows on the host and
        # moves float32 (bank/staged.py); once the mover codes rows, both paths move the codes.
        moved_row = sum(s["logical_row_bytes"] if (s in coded and tier == "host-cpu" and not p["int8_in_mover"])
                        else s["row_bytes"] for s in states)
        out_rows = moved_in if tier == "host" else moved_out
        pcie_in, pcie_out = moved_in * moved_row, out_rows * moved_row
        staging = 0.0 if tier == "host" else (moved_in + out_rows) * moved_row    # pinned gather + write-back
        host_rank = host_rows * row + counters + staging
        traffic = HOST_TOUCHES[tier] * ranks * (pcie_in + pcie_out)
        cpu_s = 0.0 if tier == "host" else (pcie_in + pcie_out) / (p["cpu_gbps"] * GB)
        rate = (zero_copy if tier == "host" else link) * GB
        t_in, t_out = pcie_in / rate, pcie_out / rate
        t_patch = overlap * row_logical / (patch_rate * GB)
        # Fetch (and patch) and write-back run on two streams. With three slot sets (staged
        # access always) the fetch of t + 2 fills a third set while the write-back of t reads
        # its own: max(in + patch, out), for one more set held. With two it fills the set the
        # write-back reads, after it: in + patch + out.
        sets = p["slot_sets"] if tier == "host" else 3
        stream = max(t_in + t_patch, t_out) if sets == 3 else t_in + t_patch + t_out
        wb = t_out
        third = slot if sets == 3 else 0.0
        temp = temporaries(tier)
        gpu = gpu_share + common_gpu + third + sum(temp.values())
        at_resume = gpu_share + bb_state + resume_gpu
        times = {"bank stream": stream, "host memory": traffic / (p["host_gbps"] * GB)}
        if tier == "host-cpu":
            times["CPU"] = cpu_s / (p["cpu_cores"] / ranks)
        # The mover's programs hold SMs while they run (the host tier's row moves and every
        # tier's overlap patch): a backbone kernel that needs every SM runs that much slower.
        busy = min(1.0, (stream if tier == "host" else t_patch) / window)
        slowdown = p["mover_programs"] / GPUS[p["gpu"]]["sms"] * busy
        tiers[tier] = dict(
            available=available, reason=reason,
            gpu_bytes=gpu, gpu_bank_bytes=gpu_share, temporaries=temp, third_slot_bytes=third,
            gpu_resume_bytes=at_resume, host_bytes_rank=host_rank, host_bytes_node=ranks * host_rank,
            host_resume_node=ranks * (host_rank + resume_host_rank), host_staging_rank=staging,
            moved_row_bytes=moved_row, moved_rows_out=out_rows, slot_sets=sets,
            pcie_in=pcie_in, pcie_out=pcie_out, host_traffic_node=traffic,
            cpu_seconds_rank=cpu_s, cpu_seconds_node=ranks * cpu_s,
            pcie_in_s=t_in, pcie_out_s=t_out, patch_s=t_patch, write_back_s=wb, stream_s=stream,
            times=times, mover_busy=busy, backbone_slowdown=slowdown,
            checks=[("GPU memory per GPU", "memory", gpu, gpu_limit),
                    ("GPU memory at resume", "memory", at_resume, gpu_limit),
                    ("host RAM per node", "memory", ranks * host_rank, host_limit),
                    ("host RAM per node at resume", "memory", ranks * (host_rank + resume_host_rank), host_limit)]
            + [(f"{name} time", "time", t, window) for name, t in times.items()])
    # Each state's bytes per rank, by where it lives, per tier (storage dtype).
    for tier, t in tiers.items():
        t["state_bytes"] = {
            s["name"]: ({"gpu": s["bytes"], "host": 0} if tier == "device" else
                        {"gpu": f * s["bytes"], "host": (1 - f) * s["bytes"]})
            for s in per_state}

    return dict(
        classes=classes, classes_per_rank=cq, ranks_per_node=ranks, nodes=nodes, gathered_batch=n_gathered,
        active_rows=active, budget_rows=budget, expected_positives=positives, cold_rows=cold,
        overlap_rows=overlap, overlap_fraction=active / cq, host_rows_fraction=1.0 - f, moved_rows_in=moved_in,
        states=per_state, row_bytes=row, logical_row_bytes=row_logical,
        bank_bytes_rank=bank_storage, bank_bytes_node=ranks * bank_storage, version_bytes_rank=counters,
        gpu=dict(slot_bytes=slot, slots=2, center_grad_bytes=grad, staged_bytes=2 * slot + grad,
                 logits_block_bytes=logits, cosines_kept=kept, softmax_bytes=softmax, sampler_bytes=sampler,
                 backbone_state_bytes=bb_state, backbone_activation_bytes=bb_act, backbone_params=bb_params,
                 common_bytes=common_gpu, limit_bytes=gpu_limit, reserve_bytes=GPU_RESERVE_GB * GB,
                 memory_bytes=GPUS[p["gpu"]]["memory_gb"] * GB, resume_state_bytes=resume_gpu),
        window=dict(step_s=step_s, head_s=head_s, window_s=window,
                    head_estimated=p["head_ms"] is None),
        rates=dict(zero_copy_gbps=zero_copy, zero_copy_how=zero_copy_how, patch_gbps=patch_rate, link_gbps=link),
        host_limit_bytes=host_limit, step_s=step_s, tiers=tiers)


def _ok(value: float, limit: float) -> bool:
    return value <= limit * (1 + 1e-12)


def _max_classes(p: dict, tier: str, check: str, cache: dict) -> int | None:
    """The largest class count at which ``check`` of ``tier`` holds (0: not even at one class
    per rank; None: at every count up to 2**60)."""
    def holds(c: int) -> bool:
        if c not in cache:
            cache[c] = _figures(p, c)
        for name, _, value, limit in cache[c]["tiers"][tier]["checks"]:
            if name == check:
                return _ok(value, limit)
        raise KeyError(check)
    lo = p["gpus"]
    if not holds(lo):
        return 0
    hi = lo * 2
    while holds(hi):
        lo, hi = hi, hi * 2
        if hi > 1 << 60:
            return None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if holds(mid):
            lo = mid
        else:
            hi = mid
    return lo


def _summarise(p: dict, fig: dict, stops: bool) -> dict:
    cache: dict = {}
    for tier, t in fig["tiers"].items():
        checks = []
        for name, kind, value, limit in t["checks"]:
            entry = dict(name=name, kind=kind, value=value, limit=limit, ok=_ok(value, limit), margin=limit - value)
            if stops:
                entry["max_classes"] = _max_classes(p, tier, name, cache) if t["available"] else 0
            checks.append(entry)
        t["checks"] = checks
        available = t["available"]
        t["fits"] = available and all(c["ok"] for c in checks if c["kind"] == "memory")
        t["hides"] = available and all(c["ok"] for c in checks if c["kind"] == "time")
        t["transfer_s"] = max(t["times"].values(), default=0.0)
        gpu = [c for c in checks if c["kind"] == "memory" and c["name"].startswith("GPU")]
        host = [c for c in checks if c["kind"] == "memory" and c["name"].startswith("host")]
        time = [c for c in checks if c["kind"] == "time"]
        t["gpu_margin_bytes"] = min(c["margin"] for c in gpu)
        t["host_margin_bytes"] = min(c["margin"] for c in host)
        t["time_margin_s"] = min((c["margin"] for c in time), default=None)
        if stops:
            for kind, key in (("memory", "max_classes_fit"), ("time", "max_classes_hide")):
                own = [c for c in checks if c["kind"] == kind]
                limits = [c["max_classes"] for c in own if c["max_classes"] is not None]
                best = min(limits) if limits else None
                t[key] = (best if available else 0) if own else None
                t[key + "_by"] = next((c["name"] for c in own if c["max_classes"] == best), None) \
                    if own and limits else None
            both = [v for v in (t["max_classes_fit"], t["max_classes_hide"]) if v is not None]
            t["max_classes_usable"] = min(both) if both else None
    return fig


# --------------------------------------------------------------------- the API
def plan(classes: int, dim: int, gpus: int, gpu: str, sample_rate: float, *, hints: bool = True,
         stops: bool = True, **options) -> dict:
    """The plan for ``classes`` classes of width ``dim`` on ``gpus`` GPUs of kind ``gpu`` (a key
    of :data:`GPUS`) at ``sample_rate``; ``options`` override :data:`DEFAULTS` (``optimizer``,
    ``storage``, ``backbone`` (counted by default: ``"r100"``), ``batch``, ``step_ms`` (the
    backbone's step), ``head_ms`` (None: estimated), ``host_gbps``, ``pcie_gbps``,
    ``zero_copy_gbps`` / ``patch_gbps`` (None: the mover's rates by Little's law),
    ``mover_programs``, ``gpus_per_node``, ``gpus_per_uplink``, ``slot_sets`` (2 or 3), ``int8_in_mover``, ``device_access``, ``resume_chunk_mb``, ``host_ram_gb``,
    ``cpu_gbps``, ``cpu_cores``, ``hbm_share``, ``block_bytes``, ``keep_bytes``, ``momentum``).

    Returns a dict: ``inputs``; per rank the classes, active, cold and overlap rows, each
    state's bytes; ``gpu`` (staged slots, softmax buffers, sampler, backbone); ``window``
    (backbone, head); ``rates``; ``tiers`` (per tier: ``available`` and, if not, ``reason``
    (what the bank refuses); memory per GPU / node, temporaries, bytes and times per step,
    ``checks`` each with ``value``, ``limit``, ``margin``, ``ok`` and ``max_classes``;
    ``fits``, ``hides``, margins, ``max_classes_fit``, ``max_classes_hide``,
    ``max_classes_usable``); ``fits_any``; ``usable``; ``refused`` (None, or why no tier fits
    and which arguments to change). Raises :class:`PlanArgumentError` (a ValueError naming the
    argument) for bad arguments."""
    unknown = sorted(set(options) - set(DEFAULTS))
    if unknown:
        raise TypeError(f"plan() got unexpected arguments {unknown}; it takes {sorted(DEFAULTS)}")
    p = _check_inputs(dict(DEFAULTS, classes=classes, dim=dim, gpus=gpus, gpu=gpu, sample_rate=sample_rate,
                           **options))
    out = _summarise(p, _figures(p, classes), stops)
    out["inputs"] = dict(p)
    out["fits_any"] = any(t["fits"] for t in out["tiers"].values())
    out["usable"] = [name for name, t in out["tiers"].items() if t["fits"] and t["hides"]]
    out["refused"] = None if out["fits_any"] else _refusal(p, out, hints)
    return out


def _alternatives(p: dict) -> list[tuple[str, dict]]:
    """Single changes of one argument that may make a tier fit: (how to say it, overrides).
    Only what the bank builds today: no NVMe tier, --hbm-share only where mapped access has it,
    none of the options that model work not yet in the bank (--int8-in-mover,
    --resume-chunk-mb)."""
    alts = []
    if p["slot_sets"] == 3:
        alts.append(("--slot-sets 2", dict(slot_sets=2)))
    if p["storage"] == "fp32":
        alts.append(("--storage bf16", dict(storage="bf16")))
    if p["storage"] != "bf16-int8m":
        alts.append(("--storage bf16-int8m", dict(storage="bf16-int8m")))
    for r in (p["sample_rate"] / 2, p["sample_rate"] / 4):
        alts.append((f"--sample_rate {r:g}", dict(sample_rate=r)))
    for k in (p["gpus"] * 2, p["gpus"] * 4):
        if k <= p["classes"]:
            alts.append((f"--gpus {k} ({-(-k // p['gpus_per_node'])} nodes)", dict(gpus=k)))
    bigger = sorted((g for g in GPUS if GPUS[g]["memory_gb"] > GPUS[p["gpu"]]["memory_gb"]),
                    key=lambda g: GPUS[g]["memory_gb"])
    alts += [(f"a bigger --gpu {g}", dict(gpu=g)) for g in bigger]
    for share in (0.0, 0.25, 0.5):
        if share != p["hbm_share"]:
            alts.append((f"--hbm-share {share:g}", dict(hbm_share=share)))
    if p["backbone"] != "none" and p["batch"] > 1:
        alts.append((f"--batch {p['batch'] // 2}", dict(batch=p["batch"] // 2)))
    alts.append((f"--host-ram-gb {p['host_ram_gb'] * 2:g}", dict(host_ram_gb=p["host_ram_gb"] * 2)))
    return alts


def _refusal(p: dict, out: dict, hints: bool) -> str:
    lines = ["no tier fits:"]
    for name, t in out["tiers"].items():
        if not t["available"]:
            lines.append(f"  {name}: not built: {t['reason']}")
            continue
        bad = [c for c in t["checks"] if c["kind"] == "memory" and not c["ok"]]
        lines.append(f"  {name}: " + "; ".join(f"{c['name']} {c['value'] / GB:,.1f} GB > {c['limit'] / GB:,.1f} GB"
                                              for c in bad))
    if hints:
        fixes = []
        for text, change in _alternatives(p):
            q = dict(p, **change)
            inputs = {key: q[key] for key in ("classes", "dim", "gpus", "gpu", "sample_rate")}
            rest = {key: v for key, v in q.items() if key not in inputs}
            try:
                alt = plan(**inputs, **rest, hints=False, stops=False)
            except PlanArgumentError:
                continue
            fitting = [(n, t) for n, t in alt["tiers"].items() if t["available"] and t["fits"]]
            if fitting:
                fixes.append(f"{text} (then " + ", ".join(f"{n} fits" + (" and hides" if t["hides"] else
                                                                          " but does not hide")
                                                          for n, t in fitting) + ")")
        if fixes:
            lines.append("change one of: " + "; ".join(fixes))
        else:
            lines.append("no single change of --storage, --sample_rate, --gpus, --gpu, --hbm-share, --batch "
                         "or --host-ram-gb makes a tier fit: combine them (e.g. --storage bf16 "
                         "with a lower --sample_rate and more --gpus)")
    return "\n".join(lines)


# --------------------------------------------------------------------- output
def _gb(b: float) -> str:
    return f"{b / GB:,.2f}"


def _ms(s: float) -> str:
    return f"{s * 1e3:,.1f}"


def _signed_gb(b: float) -> str:
    return f"{b / GB:+,.1f}"


def _signed_ms(s) -> str:
    return "-" if s is None else f"{s * 1e3:+,.0f}"


def _classes(c) -> str:
    if c is None:
        return "no limit"
    if c >= 1e9:
        return f"{c / 1e9:.3g}B"
    if c >= 1e6:
        return f"{c / 1e6:.4g}M"
    if c >= 1e3:
        return f"{c / 1e3:.4g}K"
    return str(c)


def _numeric(text: str) -> bool:
    text = text.replace(",", "").lstrip("+").rstrip("xKMB%")
    try:
        float(text)
    except ValueError:
        return text in ("-", "", "n/a")
    return True


def _table(headers, rows) -> str:
    """Columns of mostly numbers right-aligned, the first column and columns of words left-aligned."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    right = [i > 0 and 2 * sum(_numeric(r[i]) for r in cells[1:]) > len(cells) - 1 for i in range(len(headers))]
    lines = ["  ".join((c.rjust(w) if right[i] else c.ljust(w)) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
             for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _describe(p: dict) -> str:
    bb = ("no backbone (--backbone none: the head alone)" if p["backbone"] == "none"
          else f"backbone {p['backbone']} at batch {p['batch']} counted")
    nodes = -(-p["gpus"] // p["gpus_per_node"])
    where = (f"{p['gpus']} x {p['gpu']}" if nodes == 1 else
             f"{p['gpus']} x {p['gpu']} on {nodes} nodes of {p['gpus_per_node']}")
    return (f"{bb}; C = {p['classes']:,} classes, d = {p['dim']}, {where} "
            f"({GPUS[p['gpu']]['memory_gb'] - GPU_RESERVE_GB:g} GB usable each, {p['gpus_per_uplink']} per PCIe "
            f"uplink), r = {p['sample_rate']:g}, {p['optimizer']}, {p['storage']} storage, "
            f"N = {p['batch'] * p['gpus']}, backbone step {p['step_ms']:g} ms, {p['slot_sets']} slot sets, "
            f"hbm-share {p['hbm_share']:g}")


def _assumptions(out: dict) -> list[str]:
    p, w, rates = out["inputs"], out["window"], out["rates"]
    head = (f"{w['head_s'] * 1e3:.1f} ms estimated: 3 x 2 N |S_q| d flops at {HEAD_TFLOPS[p['gpu']]:g} TFLOP/s "
            f"(--head-ms to set it)" if w["head_estimated"] else f"{w['head_s'] * 1e3:g} ms (--head-ms)")
    streams = ("fetch + overlap patch and write-back on two streams; host (mapped): "
               + ("3 slot sets, the two directions overlap: max(fetch + patch, write-back)" if p["slot_sets"] == 3
                  else "2 slot sets, the fetch after the write-back it reuses the set of: fetch + patch + write-back")
               + "; host-cpu (staged): 3 slot sets, overlapping; the host tier writes back only the rows that leave "
                 "the next set, host-cpu every stepped row")
    temps = [f"{2 if p['slot_sets'] == 2 else 3} slot sets (host-cpu and staged device access: 3)"]
    if p["storage"] == "bf16-int8m":
        temps.append("8-bit rows: " + ("coded in the mover, d + 4 bytes moved" if p["int8_in_mover"] else
                                       f"torch ops a chunk at a time ({INT8_TEMPORARIES} float32 chunks of "
                                       f"{CODE_CHUNK_BYTES >> 20} MiB at peak) "
                                       "on the device, float32 over PCIe with staged access, refused in mapped "
                                       "host memory"))
    if p["device_access"] == "staged":
        temps.append(f"device tier with staged access: the fetch's gather and float32 copy, "
                     f"{FETCH_CHUNK_BYTES >> 20} MiB of rows at a time")
    temps.append("resume: " + (f"streamed in chunks of {p['resume_chunk_mb']:.1f} MB" if p["resume_chunk_mb"] else
                               "a whole float32 state moved to the GPU, all states in host memory "
                               "(--resume-chunk-mb 0)"))
    return [
        f"  window: backbone {p['step_ms']:g} ms + head {head} = {w['window_s'] * 1e3:.0f} ms per step",
        f"  bank stream: {streams}",
        f"  row mover (host tier): {rates['zero_copy_how']}; overlap patch on the GPU at "
        f"{rates['patch_gbps']:.1f} GB/s; {p['mover_programs']} programs hold "
        f"{p['mover_programs']}/{GPUS[p['gpu']]['sms']} SMs while they run",
        f"  copy engines (host-cpu): {p['pcie_gbps']:g} GB/s per uplink and direction / {p['gpus_per_uplink']} "
        f"GPU(s) = {rates['link_gbps']:.1f} GB/s per GPU",
        f"  host memory: {p['host_gbps']:g} GB/s per node at the bank's mix of random row reads and writes; "
        f"{p['host_ram_gb']:g} GB per node; {out['ranks_per_node']} ranks per node",
        "  GPU memory counts: " + "; ".join(temps) + f"; a {GPU_RESERVE_GB:g} GB reserve",
        "  not a tier: nvme (refused by the bank: random row I/O every step); none of the rates is measured "
        "on a GPU yet",
    ]


def format_plan(out: dict) -> str:
    """The readable report of one plan."""
    p, g = out["inputs"], out["gpu"]
    lines = [f"Bank plan: {_describe(p)}", "", "Assumptions:", *_assumptions(out), ""]
    lines.append(f"Per rank: C_q = {out['classes_per_rank']:,} classes; active rows |S_q| = {out['active_rows']:,}; "
                 f"cold rows per step {out['cold_rows']:,.0f} ({out['cold_rows'] / max(out['active_rows'], 1):.1%} "
                 f"of |S_q|); rows outside GPU memory {out['host_rows_fraction']:.0%}")
    lines.append("")
    rows = [[s["name"], s["storage_dtype"], f"[C_q, {s['width']}]" if s["width"] else "[C_q]", s["row_bytes"],
             _gb(s["bytes"])] for s in out["states"]]
    rows.append(["total", "", "", out["row_bytes"], _gb(out["bank_bytes_rank"])])
    rows.append(["version counters", "int32 x 2", "", 8 * len(out["states"]), _gb(out["version_bytes_rank"])])
    lines.append(_table(["state (per rank)", "storage", "shape", "B/row", "GB"], rows))
    lines.append("  device: all in GPU memory; host, host-cpu: in host memory (a share --hbm-share in GPU memory); "
                 "version counters in host memory for every tier")
    lines.append("")
    bb = BACKBONES.get(p["backbone"])
    rows = [["staged slots", f"2 x {out['active_rows']:,} rows x {out['logical_row_bytes']} B (logical dtype)",
             _gb(2 * g["slot_bytes"])],
            ["gradient of the staged centers", f"{out['active_rows']:,} x {p['dim']} x 4 B",
             _gb(g["center_grad_bytes"])],
            ["softmax buffers", ("kept cosines (G formed over them)" if g["cosines_kept"] else "G block")
             + f" {_gb(g['logits_block_bytes'])} GB, normalised centers, embeddings",
             _gb(g["softmax_bytes"])],
            ["sampler keys", f"{SAMPLER_BYTES_PER_CLASS} B x C_q", _gb(g["sampler_bytes"])]]
    if bb:
        rows += [[f"backbone {p['backbone']} parameters + optimizer",
                  f"{bb['params']:,} x {BACKBONE_BYTES_PER_PARAM[p['optimizer']]} B", _gb(g["backbone_state_bytes"])],
                 [f"backbone {p['backbone']} activations", f"{p['batch']} x {bb['saved_bytes_batch2'] / 2e6:.1f} MB",
                  _gb(g["backbone_activation_bytes"])]]
    rows.append(["total besides the bank", f"limit {_gb(g['limit_bytes'])} GB = {_gb(g['memory_bytes'])} GB - "
                 f"{GPU_RESERVE_GB:g} GB reserve", _gb(g["common_bytes"])])
    lines.append(_table(["GPU memory per GPU", "", "GB"], rows))
    lines.append("")

    tiers = out["tiers"]
    names = list(tiers)

    def row(label, fn):
        return [label] + [fn(tiers[n]) if tiers[n]["available"] else "n/a" for n in names]

    def t(key):
        return lambda x: _ms(x[key]) if x.get(key) is not None and x["times"] else "-"
    rows = [
        row("GPU memory per GPU (GB)", lambda x: _gb(x["gpu_bytes"])),
        row("  of which bank rows (GB)", lambda x: _gb(x["gpu_bank_bytes"])),
        row("  of which temporaries (GB)", lambda x: _gb(sum(x["temporaries"].values()))),
        row("  of which a third slot set (GB)", lambda x: _gb(x["third_slot_bytes"])),
        row("GPU memory at resume (GB)", lambda x: _gb(x["gpu_resume_bytes"])),
        row("host RAM per node (GB)", lambda x: _gb(x["host_bytes_node"])),
        row("host RAM per node at resume (GB)", lambda x: _gb(x["host_resume_node"])),
        row("PCIe in per rank per step (GB)", lambda x: _gb(x["pcie_in"])),
        row("PCIe out per rank per step (GB)", lambda x: _gb(x["pcie_out"])),
        row("host memory traffic per node per step (GB)", lambda x: _gb(x["host_traffic_node"])),
        row("CPU-seconds per rank per step", lambda x: f"{x['cpu_seconds_rank']:.3f}"),
        row("time fetch in (ms)", t("pcie_in_s")),
        row("time overlap patch (ms)", t("patch_s")),
        row("time write-back out (ms)", t("pcie_out_s")),
        row("time bank streams (ms)", lambda x: _ms(x["times"]["bank stream"])
            if "bank stream" in x["times"] else "-"),
        row("time host memory (ms)", lambda x: _ms(x["times"]["host memory"]) if "host memory" in x["times"]
            else "-"),
        row(f"time CPU, {p['cpu_cores'] / out['ranks_per_node']:g} cores per rank (ms)",
            lambda x: _ms(x["times"]["CPU"]) if "CPU" in x["times"] else "-"),
        row("backbone slowdown, mover SMs", lambda x: f"{x['backbone_slowdown']:.1%}"),
        row("GPU memory margin (GB)", lambda x: _signed_gb(x["gpu_margin_bytes"])),
        row("host RAM margin per node (GB)", lambda x: _signed_gb(x["host_margin_bytes"])),
        row(f"time margin in the {out['window']['window_s'] * 1e3:.0f} ms window (ms)",
            lambda x: _signed_ms(x["time_margin_s"])),
    ]
    if "max_classes_fit" in tiers["device"]:
        rows += [row("fits up to (classes)", lambda x: _classes(x["max_classes_fit"])),
                 row("  limited by", lambda x: x["max_classes_fit_by"] or "-"),
                 row("hides up to (classes)",
                     lambda x: _classes(x["max_classes_hide"]) if x["times"] else "no transfers"),
                 row("  limited by", lambda x: x["max_classes_hide_by"] or "-")]
    lines.append(_table(["per tier"] + names, rows))
    for n in names:
        if not tiers[n]["available"]:
            lines.append(f"  {n}: not built: {tiers[n]['reason']}")
    lines.append("")
    if out["refused"]:
        lines.append("REFUSED: " + out["refused"])
    else:
        fit = [n for n in names if tiers[n]["fits"]]
        lines.append("fits: " + ", ".join(fit) + "; fits and hides behind the window: "
                     + (", ".join(out["usable"]) if out["usable"] else "none"))
    return "\n".join(lines)


def _verdict(t: dict) -> str:
    if not t["available"]:
        return "not built"
    if not t["fits"]:
        short = [f"{where} {_signed_gb(m)} GB" for where, m in (("GPU", t["gpu_margin_bytes"]),
                                                             ("host RAM", t["host_margin_bytes"])) if m < 0]
        return "short: " + ", ".join(short)
    words = [f"fits ({_signed_gb(t['gpu_margin_bytes'])} GB GPU)"]
    if t["time_margin_s"] is not None:
        words.append(f"{'hides' if t['hides'] else 'slow'} ({_signed_ms(t['time_margin_s'])} ms)")
    return ", ".join(words)


def format_sweep(outs: list[dict]) -> str:
    """Per class count and tier: GPU memory per GPU, host RAM per node, the slowest
    transfer per step, and the margins."""
    rows = []
    for out in outs:
        for i, (name, t) in enumerate(out["tiers"].items()):
            slowest = max(t["times"].items(), key=lambda kv: kv[1]) if t["times"] else None
            rows.append([_classes(out["classes"]) if i == 0 else "", _classes(out["active_rows"]) if i == 0 else "",
                         name, _gb(t["gpu_bytes"]) if t["available"] else "n/a",
                         _gb(t["host_bytes_node"]) if t["available"] else "n/a",
                         f"{slowest[0]} {_ms(slowest[1])}" if slowest and t["available"] else "-",
                         f"{out['window']['window_s'] * 1e3:,.0f}" if i == 0 else "", _verdict(t)])
    return _table(["classes", "|S_q|", "tier", "GPU GB per GPU", "host GB per node", "slowest, ms per step",
                   "window ms", "verdict (margin)"], rows)


def format_limits(out: dict) -> str:
    """Per tier, the largest class count that fits, that hides and that does both."""
    rows = []
    for name, t in out["tiers"].items():
        if not t["available"]:
            rows.append([name, "not built", "", "", ""])
            continue
        rows.append([name, _classes(t["max_classes_fit"]),
                     _classes(t["max_classes_hide"]) if t["times"] else "no transfers",
                     _classes(t["max_classes_usable"]),
                     " / ".join(x for x in (t["max_classes_fit_by"], t["max_classes_hide_by"]) if x)])
    return _table(["tier", "fits up to", "hides up to", "fits and hides up to", "limited by (fit / hide)"], rows)


# --------------------------------------------------------------------- CLI
_SUFFIX = {"": 1, "K": 10 ** 3, "M": 10 ** 6, "B": 10 ** 9, "G": 10 ** 9}


def parse_classes(text: str) -> list[int]:
    """``"128M"``, ``"1B"``, ``"64e6"``, ``"1_000_000"`` or a comma list of them."""
    out = []
    for part in str(text).split(","):
        part = part.strip().replace("_", "")
        m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)([KMBG]?)", part, re.IGNORECASE)
        if not m:
            raise argparse.ArgumentTypeError(f"expected a class count such as 128000000, 128M or 1B (or a comma "
                                             f"list), got {part!r}")
        value = float(m.group(1)) * _SUFFIX[m.group(2).upper()]
        if value != int(value) or value < 1:
            raise argparse.ArgumentTypeError(f"must be a positive whole number of classes, got {part!r}")
        out.append(int(value))
    return out


def _typed(kind, low=None, high=None, low_open=False):
    def parse(text):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, got {text!r}")
        if isinstance(v, float) and not math.isfinite(v):
            raise argparse.ArgumentTypeError(f"must be finite, got {text!r}")
        if low is not None and (v <= low if low_open else v < low):
            raise argparse.ArgumentTypeError(f"must be {'>' if low_open else '>='} {low:g}, got {text}")
        if high is not None and v > high:
            raise argparse.ArgumentTypeError(f"must be <= {high:g}, got {text}")
        return v
    return parse


def build_parser() -> argparse.ArgumentParser:
    d = DEFAULTS
    ap = parser("ds-pfc-bench plan", "Memory and transfer planner for the class bank: per rank, the bytes of each "
                "way to place the bank and the transfers of a step, computed from formulas (nothing runs).",
                epilog="Assumptions and how to read the table: docs/planner.md")
    ap.add_argument("--classes", type=parse_classes, required=True,
                    help="C: the global class count (128000000, 128M, 1B; a comma list prints one line per count)")
    ap.add_argument("--dim", type=_typed(int, 1), required=True, help="d: the embedding width")
    ap.add_argument("--gpus", type=_typed(int, 1), required=True,
                    help="k: GPUs of the job, one rank each (over --gpus-per-node GPUs per node)")
    ap.add_argument("--gpus-per-node", "--gpus_per_node", dest="gpus_per_node", type=_typed(int, 1),
                    default=d["gpus_per_node"], help="GPUs per node: each node has its own host RAM, host memory "
                    "bandwidth, CPU cores and PCIe links (default %(default)s)")
    ap.add_argument("--gpus-per-uplink", "--gpus_per_uplink", dest="gpus_per_uplink", type=_typed(int, 1),
                    default=d["gpus_per_uplink"], help="GPUs sharing one PCIe x16 uplink to the host, e.g. 2 behind "
                    "one switch port: they move rows at the same moments, so each gets the link / this "
                    "(default %(default)s)")
    ap.add_argument("--gpu", choices=list(GPUS), required=True, help="the GPU kind (its memory)")
    ap.add_argument("--sample_rate", "--sample-rate", dest="sample_rate", type=_typed(float, 0.0, 1.0, True),
                    required=True, help="r in (0, 1]")
    ap.add_argument("--optimizer", choices=list(BACKBONE_BYTES_PER_PARAM), default=d["optimizer"],
                    help="the row optimizer (and the backbone's)")
    ap.add_argument("--storage", choices=list(STORAGES), default=d["storage"],
                    help="storage of the bank: fp32, bf16, or bf16 with the first moment in 8 bits (bf16-int8m)")
    ap.add_argument("--backbone", choices=[*BACKBONES, "none"], default=d["backbone"],
                    help="the backbone whose weights, optimizer states and activations share GPU memory with the "
                         "bank (counted by default: %(default)s; none: the head alone)")
    ap.add_argument("--batch", type=_typed(int, 1), default=d["batch"], help="B: the per-GPU batch (N = B k)")
    ap.add_argument("--step-ms", "--step_ms", dest="step_ms", type=_typed(float, 0.0, None, True), default=d["step_ms"],
                    help="the backbone's forward and backward per step, ms; the bank's stream also overlaps the "
                         "head's compute (--head-ms)")
    ap.add_argument("--head-ms", "--head_ms", dest="head_ms", type=_typed(float, 0.0), default=d["head_ms"],
                    help="the head's own compute per step, ms (default: estimated from its flops)")
    ap.add_argument("--slot-sets", "--slot_sets", dest="slot_sets", type=int, choices=list(SLOT_SETS),
                    default=d["slot_sets"],
                    help="slot buffer sets of mapped access (ds_pfc.head.bank.slot_sets): 3 overlaps fetch and "
                         "write-back for one more set of GPU memory; 2 runs them in turn (default %(default)s)")
    ap.add_argument("--host-gbps", "--host_gbps", dest="host_gbps", type=_typed(float, 0.0, None, True),
                    default=d["host_gbps"], help="host-memory bandwidth of a node at the bank's mix of random row "
                    "reads and writes, GB/s (default %(default)s: about 60%% of two sockets' DDR5 peak)")
    ap.add_argument("--pcie-gbps", "--pcie_gbps", dest="pcie_gbps", type=_typed(float, 0.0, None, True),
                    default=d["pcie_gbps"], help="rate of one PCIe uplink per direction, GB/s (copy engines)")
    ap.add_argument("--zero-copy-gbps", "--zero_copy_gbps", dest="zero_copy_gbps",
                    type=_typed(float, 0.0, None, True), default=d["zero_copy_gbps"],
                    help="rate of the row mover reading/writing mapped host rows, per GPU and direction, GB/s "
                         "(default: its stated launch's bytes in flight / 2 us, until measured: --measured)")
    ap.add_argument("--patch-gbps", "--patch_gbps", dest="patch_gbps", type=_typed(float, 0.0, None, True),
                    default=d["patch_gbps"], help="rate of the mover's device-to-device overlap patch, GB/s "
                    "(default: its bytes in flight / 1 us)")
    ap.add_argument("--measured", default=None, metavar="TIER_CHECK_JSON",
                    help="a 'ds-pfc-bench rows --tier-check' JSON of the GPU: its planner_defaults set "
                         "--zero-copy-gbps (the slower of the mover's read and write at d = 512), --patch-gbps "
                         "(its device-to-device rate) and --pcie-gbps (the slower pinned DMA direction) where "
                         "they are not given")
    ap.add_argument("--mover-programs", "--mover_programs", dest="mover_programs", type=_typed(int, 1),
                    default=d["mover_programs"], help="programs (SMs) of the row mover; its bytes in flight "
                    "scale with them (default %(default)s)")
    ap.add_argument("--int8-in-mover", "--int8_in_mover", dest="int8_in_mover",
                    action=argparse.BooleanOptionalAction, default=d["int8_in_mover"],
                    help="8-bit rows coded and decoded in the mover's registers on every tier and access (d + 4 "
                         "bytes moved, no float32 temporaries, mapped host tier allowed), as built; "
                         "--no-int8-in-mover: the torch path a bank without Triton takes")
    ap.add_argument("--device-access", "--device_access", dest="device_access", choices=list(DEVICE_ACCESS),
                    default=d["device_access"], help="host_access of the device tier's bank (staged: its fetch "
                    "keeps a gather and float32 copy of the cold rows; default %(default)s)")
    ap.add_argument("--resume-chunk-mb", "--resume_chunk_mb", dest="resume_chunk_mb", type=_typed(float, 0.0),
                    default=d["resume_chunk_mb"], help="resume's chunk, MB (default: the streamed resume's "
                    "%(default).1f MB; 0: a whole float32 state at once)")
    ap.add_argument("--host-ram-gb", "--host_ram_gb", dest="host_ram_gb", type=_typed(float, 0.0, None, True),
                    default=d["host_ram_gb"], help="host RAM of the node, GB")
    ap.add_argument("--cpu-gbps", "--cpu_gbps", dest="cpu_gbps", type=_typed(float, 0.0, None, True),
                    default=d["cpu_gbps"], help="row gather/scatter rate of one CPU core, GB/s")
    ap.add_argument("--cpu-cores", "--cpu_cores", dest="cpu_cores", type=_typed(int, 1), default=d["cpu_cores"],
                    help="CPU cores of the node, shared evenly by the ranks")
    ap.add_argument("--hbm-share", "--hbm_share", dest="hbm_share", type=_typed(float, 0.0, 1.0),
                    default=d["hbm_share"], help="fraction f of each rank's rows kept in GPU memory")
    ap.add_argument("--block-bytes", "--block_bytes", dest="block_bytes", type=_typed(int, 1),
                    default=d["block_bytes"], help="the head's block_bytes (default 256 MiB, as on CUDA)")
    ap.add_argument("--keep-bytes", "--keep_bytes", dest="keep_bytes", type=_typed(int, 0),
                    default=d["keep_bytes"], help="the head's keep_bytes: float16 cosines kept for backward "
                    "when they fit (default 4 GiB, the triton backend's)")
    ap.add_argument("--limits", action="store_true",
                    help="print only, per tier, the largest class counts that fit, hide, and do both")
    ap.add_argument("--json", default=None, help="also write the inputs, the date and every number here")
    return ap


def measured_rates(path: str) -> dict:
    """The planner options a tier check measured (``ds-pfc-bench rows --tier-check``'s
    ``planner_defaults``): ``zero_copy_gbps`` (the slower of the mover's read and write of
    1 KiB rows), ``patch_gbps`` and ``pcie_gbps`` (the slower pinned DMA direction), each only
    where the run measured it."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError) as err:
        raise PlanArgumentError("measured", f"cannot read a tier-check JSON at {path!r}: {err}") from None
    got = doc.get("planner_defaults") if isinstance(doc, dict) else None
    if not isinstance(got, dict):
        raise PlanArgumentError("measured", f"{path!r} has no planner_defaults (write it with "
                                            "'ds-pfc-bench rows --tier-check')")

    def slowest(*keys):
        values = [got.get(k) for k in keys]
        values = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0]
        return min(values) if values else None
    out = {"zero_copy_gbps": slowest("zero_copy_read_gbps", "zero_copy_write_gbps"),
           "patch_gbps": slowest("d2d_gbps"), "pcie_gbps": slowest("dma_h2d_gbps", "dma_d2h_gbps")}
    return {k: v for k, v in out.items() if v is not None}


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.measured:
        try:
            rates = measured_rates(args.measured)
        except PlanArgumentError as err:
            ap.error(f"argument {err}")
        given = set(argv if argv is not None else sys.argv[1:])
        for name, value in rates.items():
            flag = "--" + name.replace("_", "-")
            if not any(a == flag or a.startswith(flag + "=") or a == "--" + name or a.startswith(f"--{name}=")
                       for a in given):
                setattr(args, name, value)
        print(f"measured rates from {args.measured}: "
              + (", ".join(f"{k} {v:.1f} GB/s" for k, v in rates.items()) or "none"), flush=True)
    options = {k: v for k, v in vars(args).items() if k not in ("classes", "json", "limits", "measured")}
    outs = []
    for c in args.classes:
        try:
            outs.append(plan(c, **options))
        except PlanArgumentError as err:
            ap.error(f"argument {err}")     # exits 2, naming the option
    if args.limits:
        for out in outs:
            print(f"Largest class counts: {_describe(out['inputs']).split('; C = ', 1)[0]}; "
                  f"{_describe(out['inputs']).split(' classes, ', 1)[1]}")
            print(format_limits(out))
    elif len(outs) == 1:
        print(format_plan(outs[0]))
    else:
        desc = _describe(outs[0]["inputs"])
        print(f"Bank plans: {desc.split('; C = ', 1)[0]}; {desc.split(' classes, ', 1)[1]}")
        print(format_sweep(outs))
        for out in outs:
            if out["refused"]:
                print(f"\nC = {out['classes']:,}: REFUSED: {out['refused']}")
    if args.json:
        doc = {"tool": "ds-pfc-bench plan", "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
               "inputs": dict(vars(args)), "plans": outs,
               "constants": {"gpus": GPUS, "gpu_reserve_gb": GPU_RESERVE_GB, "backbones": BACKBONES,
                             "backbone_bytes_per_param": BACKBONE_BYTES_PER_PARAM, "host_touches": HOST_TOUCHES,
                             "sampler_bytes_per_class": SAMPLER_BYTES_PER_CLASS,
                             "mover_latency_us": _mover_latency(), "head_tflops": HEAD_TFLOPS,
                             "int8_temporaries": INT8_TEMPORARIES, "fetch_chunk_bytes": FETCH_CHUNK_BYTES,
                             "code_chunk_bytes": CODE_CHUNK_BYTES}}
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        tmp = args.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=2, default=str)
        os.replace(tmp, args.json)
    refused = [o for o in outs if o["refused"]]
    if refused:
        if len(outs) == 1:
            print(f"ds-pfc-bench plan: refused: {refused[0]['refused']}", file=sys.stderr)
        else:
            print(f"ds-pfc-bench plan: {len(refused)} of {len(outs)} plans refused (no tier fits)", file=sys.stderr)
        return 2
    return 0


# --------------------------------------------------------------------- docs
_BLOCK = re.compile(r"(<!-- ds-pfc-bench plan (?P<args>[^>]*?) -->\n```\n)(?P<body>.*?)(```)", re.S)


def refresh_text(text: str) -> str:
    """``text`` with every block that follows a ``<!-- ds-pfc-bench plan ARGS -->`` marker
    replaced by what ``ds-pfc-bench plan ARGS`` prints."""
    import contextlib
    import io
    import shlex

    def run(m):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(io.StringIO()):
            main(shlex.split(m.group("args")))
        return m.group(1) + buf.getvalue() + m.group(4)
    return _BLOCK.sub(run, text)


def refresh_docs(paths=None) -> list[str]:
    """Rewrite the planner's output blocks in ``paths`` (default: the checkout's README.md and
    docs/planner.md); returns the paths that changed."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    paths = paths or [os.path.join(root, "README.md"), os.path.join(root, "docs", "planner.md")]
    changed = []
    for path in paths:
        with open(path) as f:
            old = f.read()
        new = refresh_text(old)
        if new != old:
            with open(path, "w") as f:
                f.write(new)
            changed.append(path)
    return changed


if __name__ == "__main__":
    sys.exit(main())
