"""Memory and transfer planner for the class bank: ``ds-pfc-bench plan`` (``launch/bench.py plan``).

For ``C`` classes of width ``d`` sharded over the ``k`` GPUs of one node (``C_q = ceil(C / k)``
classes per rank) and a sample rate ``r``, it computes per rank, from formulas (nothing runs):

* the bytes of each bank state (the centers and the row optimizer's state,
  :mod:`ds_pfc.core.optim`) in its storage dtype, and where they live for each way to place
  the bank: ``device`` (every state in GPU memory), ``host`` (GPU-direct host tier: page-locked
  host memory mapped into the GPU; GPU kernels gather the cold rows and write the stepped rows
  back, no CPU work, host memory touched once per byte moved), ``host-cpu`` (what
  :class:`~ds_pfc.bank.TieredBank` does today: CPU threads gather into pinned staging buffers
  and scatter back, host memory touched ~3.5 times per byte moved). NVMe is not a tier: the
  bank refuses it (:data:`ds_pfc.bank.tiered.NVME_REFUSED`), so the planner never offers it;
* the staged slots (:mod:`ds_pfc.bank.slots`): the active rows ``|S_q|`` of every state in its
  logical dtype, twice (the slot in use and the prefetched one), the gradient of the staged
  centers, the softmax's buffers and the sampler's keys;
* the backbone's share of GPU memory (constants measured from :mod:`ds_pfc.models`, below);
* per step: bytes over PCIe each way, host-memory traffic of the node, CPU-seconds, and how long each takes at the given rates; whether each tier fits and
  whether its transfers hide behind the step; and for every limit the largest class count at
  which it still holds (found by bisection on ``C``: every figure grows with ``C`` at fixed
  ``r``).

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
from ..core.softmax import COSINE_KEEP_BYTES, CUDA_BLOCK_BYTES

__all__ = ["plan", "PlanArgumentError", "GPUS", "BACKBONES", "TIERS", "DEFAULTS", "build_parser", "main",
           "format_plan", "format_sweep", "parse_classes"]

# --------------------------------------------------------------------- constants
TIERS = ("device", "host", "host-cpu")

GB = 1e9            # every "GB" here is 10^9 bytes, as the data sheets count
GPU_RESERVE_GB = 3.0  # CUDA context, cuBLAS/Triton workspaces, allocator fragmentation (assumed)

# GPU memory per GPU in GB, from the data sheets (decimal GB; nvidia-smi shows somewhat more
# bytes, e.g. 81559 MiB on an H100 80GB, so the decimal figure leaves a little extra margin).
GPUS = {
    "h100-80g": dict(name="H100 SXM 80GB", memory_gb=80.0, source="NVIDIA H100 data sheet: 80 GB HBM3"),
    "h200": dict(name="H200 SXM 141GB", memory_gb=141.0, source="NVIDIA H200 data sheet: 141 GB HBM3e"),
    "a100-40g": dict(name="A100 40GB", memory_gb=40.0, source="NVIDIA A100 data sheet: 40 GB HBM2"),
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

DEFAULTS = dict(optimizer="sgd", storage="fp32", backbone="none", batch=128, step_ms=300.0, host_gbps=450.0,
                pcie_gbps=50.0, zero_copy_gbps=45.0, host_ram_gb=2048.0, cpu_gbps=6.0, cpu_cores=112, hbm_share=0.0,
                block_bytes=CUDA_BLOCK_BYTES, keep_bytes=COSINE_KEEP_BYTES, momentum=0.9)

# CLI spelling of each argument (errors name the option to change).
FLAGS = {"classes": "--classes", "dim": "--dim", "gpus": "--gpus", "gpu": "--gpu", "sample_rate": "--sample_rate",
         "optimizer": "--optimizer", "storage": "--storage", "backbone": "--backbone", "batch": "--batch",
         "step_ms": "--step-ms", "host_gbps": "--host-gbps", "pcie_gbps": "--pcie-gbps",
         "zero_copy_gbps": "--zero-copy-gbps", "host_ram_gb": "--host-ram-gb",
         "cpu_gbps": "--cpu-gbps", "cpu_cores": "--cpu-cores",
         "hbm_share": "--hbm-share", "block_bytes": "--block-bytes", "keep_bytes": "--keep-bytes",
         "momentum": "--momentum"}


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
    for name in ("classes", "dim", "gpus", "batch", "block_bytes", "cpu_cores"):
        number(name, 1, integer=True)
    number("keep_bytes", 0, integer=True)
    number("sample_rate", 0.0, 1.0, low_open=True)
    number("hbm_share", 0.0, 1.0)
    number("momentum", 0.0, 1.0)
    if p["momentum"] >= 1.0:
        raise PlanArgumentError("momentum", f"must be < 1, got {p['momentum']!r}")
    for name in ("step_ms", "host_gbps", "pcie_gbps", "zero_copy_gbps", "host_ram_gb", "cpu_gbps"):
        number(name, 0.0, low_open=True)
    if p["classes"] < p["gpus"]:
        raise PlanArgumentError("classes", f"must be at least --gpus ({p['gpus']}) so that every rank holds a "
                                           f"class, got {p['classes']}")
    for name, choices in (("gpu", GPUS), ("optimizer", BACKBONE_BYTES_PER_PARAM), ("storage", STORAGES),
                          ("backbone", (*BACKBONES, "none"))):
        if p[name] not in choices:
            raise PlanArgumentError(name, f"must be one of {', '.join(choices)}, got {p[name]!r}")
    return p


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
    n_gathered = B * k
    states = _states(p["optimizer"], p["momentum"], d, p["storage"])
    row = sum(s["row_bytes"] for s in states)
    row_logical = sum(s["logical_row_bytes"] for s in states)
    nstates = len(states)

    # The active set (core/sampling.py): |S_q| = max(floor(r C_q), |P_q|); |P_q| <= N, so
    # |S_q| = floor(r C_q) exactly when that is at least N; else the expected distinct positives.
    budget = min(cq, math.floor(r * cq + 1e-9))
    positives = cq * -math.expm1(n_gathered * math.log1p(-1.0 / classes)) if classes > 1 else 1.0
    active = budget if budget >= n_gathered else max(budget, int(round(positives)))
    # A row of S(t+1) is in S(t) with probability |S_q| / C_q (uniform draws): the overlap is
    # copied on the GPU from the stepped slot, the rest ("cold") comes from the bank.
    cold = active * (1.0 - active / cq)
    host_rows = (1.0 - f) * cq                 # rows outside GPU memory (--hbm-share)
    moved_in, moved_out = (1.0 - f) * cold, (1.0 - f) * active

    # GPU memory besides the bank, per GPU.
    slot = active * row_logical
    staged = 2 * slot + active * d * 4                        # two slots + the centers' float32 gradient
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
    common_gpu = staged + softmax + sampler + bb_state + bb_act
    gpu_limit = GPUS[p["gpu"]]["memory_gb"] * GB - GPU_RESERVE_GB * GB
    host_limit = p["host_ram_gb"] * GB
    step_s = p["step_ms"] / 1e3

    bank_storage = cq * row
    counters = VERSION_BYTES * nstates * cq
    per_state = [dict(s, bytes=cq * s["row_bytes"]) for s in states]

    tiers = {}
    # -- device: every state in GPU memory; the tiered bank keeps its version counters on the host.
    gpu = bank_storage + common_gpu
    tiers["device"] = dict(
        gpu_bytes=gpu, gpu_bank_bytes=bank_storage, host_bytes_rank=counters, host_bytes_node=k * counters,
        pcie_in=0.0, pcie_out=0.0, host_traffic_node=0.0, cpu_seconds_rank=0.0,
        cpu_seconds_node=0.0, times={},
        checks=[("GPU memory per GPU", "memory", gpu, gpu_limit),
                ("host RAM per node", "memory", k * counters, host_limit)])
    # -- host tiers: the bank in host memory (a share --hbm-share of its rows in GPU memory).
    gpu_share = f * bank_storage
    pcie_in, pcie_out = moved_in * row, moved_out * row
    for tier in ("host", "host-cpu"):
        staging = 0.0 if tier == "host" else (moved_in + moved_out) * row   # pinned gather + write-back buffers
        host_rank = host_rows * row + counters + staging
        gpu = gpu_share + common_gpu
        traffic = HOST_TOUCHES[tier] * k * (pcie_in + pcie_out)
        cpu_s = 0.0 if tier == "host" else (pcie_in + pcie_out) / (p["cpu_gbps"] * GB)
        rate = (p["zero_copy_gbps"] if tier == "host" else p["pcie_gbps"]) * GB
        times = {"PCIe in": pcie_in / rate, "PCIe out": pcie_out / rate, "host memory": traffic / (p["host_gbps"] * GB)}
        if tier == "host-cpu":
            times["CPU"] = cpu_s / (p["cpu_cores"] / k)
        tiers[tier] = dict(
            gpu_bytes=gpu, gpu_bank_bytes=gpu_share, host_bytes_rank=host_rank, host_bytes_node=k * host_rank,
            host_staging_rank=staging, pcie_in=pcie_in, pcie_out=pcie_out,
            host_traffic_node=traffic, cpu_seconds_rank=cpu_s, cpu_seconds_node=k * cpu_s, times=times,
            checks=[("GPU memory per GPU", "memory", gpu, gpu_limit), ("host RAM per node", "memory", k * host_rank,
                                                                      host_limit)]
            + [(f"{name} time", "time", t, step_s) for name, t in times.items()])
    # Each state's bytes per rank, by where it lives, per tier (storage dtype).
    for tier, t in tiers.items():
        t["state_bytes"] = {
            s["name"]: ({"gpu": s["bytes"], "host": 0} if tier == "device" else
                        {"gpu": f * s["bytes"], "host": (1 - f) * s["bytes"]})
            for s in per_state}

    return dict(
        classes=classes, classes_per_rank=cq, gathered_batch=n_gathered, active_rows=active, budget_rows=budget,
        expected_positives=positives, cold_rows=cold, overlap_fraction=active / cq,
        host_rows_fraction=1.0 - f, moved_rows_in=moved_in, moved_rows_out=moved_out,
        states=per_state, row_bytes=row, logical_row_bytes=row_logical, bank_bytes_rank=bank_storage,
        bank_bytes_node=k * bank_storage, version_bytes_rank=counters,
        gpu=dict(slot_bytes=slot, slots=2, center_grad_bytes=active * d * 4, staged_bytes=staged,
                 logits_block_bytes=logits, cosines_kept=kept, softmax_bytes=softmax, sampler_bytes=sampler,
                 backbone_state_bytes=bb_state, backbone_activation_bytes=bb_act, backbone_params=bb_params,
                 common_bytes=common_gpu, limit_bytes=gpu_limit, reserve_bytes=GPU_RESERVE_GB * GB,
                 memory_bytes=GPUS[p["gpu"]]["memory_gb"] * GB),
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
            entry = dict(name=name, kind=kind, value=value, limit=limit, ok=_ok(value, limit))
            if stops:
                entry["max_classes"] = _max_classes(p, tier, name, cache)
            checks.append(entry)
        t["checks"] = checks
        available = t.get("available", True)
        t["available"] = available
        t["fits"] = available and all(c["ok"] for c in checks if c["kind"] == "memory")
        t["hides"] = available and all(c["ok"] for c in checks if c["kind"] == "time")
        t["endurance_ok"] = available and all(c["ok"] for c in checks if c["kind"] == "endurance")
        t["transfer_s"] = max(t["times"].values(), default=0.0)
        if stops:
            for kind in ("memory", "time", "endurance"):
                own = [c for c in checks if c["kind"] == kind]
                limits = [c["max_classes"] for c in own if c["max_classes"] is not None]
                best = min(limits) if limits else None
                key = {"memory": "max_classes_fit", "time": "max_classes_hide", "endurance": "max_classes_endurance"}
                t[key[kind]] = (best if available else 0) if own else None
                t[key[kind] + "_by"] = next((c["name"] for c in own if c["max_classes"] == best), None) \
                    if own and limits else None
    return fig


# --------------------------------------------------------------------- the API
def plan(classes: int, dim: int, gpus: int, gpu: str, sample_rate: float, *, hints: bool = True,
         stops: bool = True, **options) -> dict:
    """The plan for ``classes`` classes of width ``dim`` on ``gpus`` GPUs of kind ``gpu`` (a key
    of :data:`GPUS`) at ``sample_rate``; ``options`` override :data:`DEFAULTS` (``optimizer``,
    ``storage``, ``backbone``, ``batch``, ``step_ms``, ``host_gbps``, ``pcie_gbps``,
    ``zero_copy_gbps``, ``host_ram_gb``, ``cpu_gbps``, ``cpu_cores``, ``hbm_share``,
    ``block_bytes``, ``keep_bytes``, ``momentum``).

    Returns a dict: ``inputs``; per rank the classes, active and cold rows, each state's bytes;
    ``gpu`` (staged slots, softmax buffers, sampler, backbone); ``tiers`` (per tier: memory per
    GPU / node, bytes and times per step, ``checks`` each with ``value``, ``limit``, ``ok`` and
    ``max_classes``, ``fits``, ``hides``, ``max_classes_fit``, ``max_classes_hide``);
    ``fits_any``; ``refused`` (None, or why no tier fits and which arguments to change).
    Raises :class:`PlanArgumentError` (a ValueError naming the argument) for bad arguments."""
    unknown = sorted(set(options) - set(DEFAULTS))
    if unknown:
        raise TypeError(f"plan() got unexpected arguments {unknown}; it takes {sorted(DEFAULTS)}")
    p = _check_inputs(dict(DEFAULTS, classes=classes, dim=dim, gpus=gpus, gpu=gpu, sample_rate=sample_rate,
                           **options))
    out = _summarise(p, _figures(p, classes), stops)
    out["inputs"] = dict(p)
    out["fits_any"] = any(t["fits"] for t in out["tiers"].values())
    out["usable"] = [name for name, t in out["tiers"].items() if t["fits"] and t["hides"] and t["endurance_ok"]]
    out["refused"] = None if out["fits_any"] else _refusal(p, out, hints)
    return out


def _alternatives(p: dict) -> list[tuple[str, dict]]:
    """Single changes of one argument that may make a tier fit: (how to say it, overrides)."""
    alts = []
    if p["storage"] == "fp32":
        alts.append(("--storage bf16", dict(storage="bf16")))
    if p["storage"] != "bf16-int8m":
        alts.append(("--storage bf16-int8m", dict(storage="bf16-int8m")))
    for r in (p["sample_rate"] / 2, p["sample_rate"] / 4):
        alts.append((f"--sample_rate {r:g}", dict(sample_rate=r)))
    for k in (p["gpus"] * 2, p["gpus"] * 4):
        if k <= p["classes"]:
            alts.append((f"--gpus {k}", dict(gpus=k)))
    bigger = sorted((g for g in GPUS if GPUS[g]["memory_gb"] > GPUS[p["gpu"]]["memory_gb"]),
                    key=lambda g: GPUS[g]["memory_gb"])
    alts += [(f"a bigger --gpu {g}", dict(gpu=g)) for g in bigger]
    for share in (0.0, 0.25, 0.5, 0.75):
        if share != p["hbm_share"]:
            alts.append((f"--hbm-share {share:g}", dict(hbm_share=share)))
    if p["backbone"] != "none" and p["batch"] > 1:
        alts.append((f"--batch {p['batch'] // 2}", dict(batch=p["batch"] // 2)))
    alts.append((f"--host-ram-gb {p['host_ram_gb'] * 2:g}", dict(host_ram_gb=p["host_ram_gb"] * 2)))
    return alts


def _refusal(p: dict, out: dict, hints: bool) -> str:
    lines = ["no tier fits:"]
    for name, t in out["tiers"].items():
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
            fitting = [n for n, t in alt["tiers"].items() if t["fits"]]
            if fitting:
                fixes.append(f"{text} (then {', '.join(fitting)} " + ("fits)" if len(fitting) == 1 else "fit)"))
        if fixes:
            lines.append("change one of: " + "; ".join(fixes))
        else:
            lines.append("no single change of --storage bf16, --sample_rate, --gpus, --gpu, --hbm-share, --batch, "
                         "--host-ram-gb makes a tier fit: combine them (e.g. --storage bf16 with "
                         "a lower --sample_rate and more --gpus)")
    return "\n".join(lines)


# --------------------------------------------------------------------- output
def _gb(b: float) -> str:
    return f"{b / GB:,.2f}"


def _ms(s: float) -> str:
    return f"{s * 1e3:,.1f}"


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
    text = text.replace(",", "").rstrip("xKMB")
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
    bb = "no backbone" if p["backbone"] == "none" else f"{p['backbone']} at batch {p['batch']}"
    return (f"C = {p['classes']:,} classes, d = {p['dim']}, {p['gpus']} x {p['gpu']} "
            f"({GPUS[p['gpu']]['memory_gb'] - GPU_RESERVE_GB:g} GB usable each), r = {p['sample_rate']:g}, "
            f"{p['optimizer']}, {p['storage']} storage, {bb} (N = {p['batch'] * p['gpus']}), "
            f"step {p['step_ms']:g} ms, hbm-share {p['hbm_share']:g}")


def format_plan(out: dict) -> str:
    """The readable report of one plan."""
    p, g = out["inputs"], out["gpu"]
    lines = [f"Bank plan: {_describe(p)}", ""]
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
        return lambda x: _ms(x["times"][key]) if key in x["times"] else "-"

    def yes(v):
        return "yes" if v else "NO"
    rows = [
        row("GPU memory per GPU (GB)", lambda x: _gb(x["gpu_bytes"])),
        row("  of which bank rows (GB)", lambda x: _gb(x["gpu_bank_bytes"])),
        row("host RAM per node (GB)", lambda x: _gb(x["host_bytes_node"])),
        row("PCIe in per rank per step (GB)", lambda x: _gb(x["pcie_in"])),
        row("PCIe out per rank per step (GB)", lambda x: _gb(x["pcie_out"])),
        row("host memory traffic per node per step (GB)", lambda x: _gb(x["host_traffic_node"])),
        row("CPU-seconds per rank per step", lambda x: f"{x['cpu_seconds_rank']:.3f}"),
        row("time PCIe in (ms)", t("PCIe in")),
        row("time PCIe out (ms)", t("PCIe out")),
        row("time host memory (ms)", t("host memory")),
        row(f"time CPU, {p['cpu_cores'] / p['gpus']:g} cores per rank (ms)", t("CPU")),
        row("fits", lambda x: yes(x["fits"])),
        row(f"hides behind {p['step_ms']:g} ms", lambda x: yes(x["hides"])),
        row("verdict", _verdict),
    ]
    if "max_classes_fit" in tiers["device"]:
        rows += [row("fits up to (classes)", lambda x: _classes(x["max_classes_fit"])),
                 row("  limited by", lambda x: x["max_classes_fit_by"] or "-"),
                 row("hides up to (classes)",
                     lambda x: _classes(x["max_classes_hide"]) if x["times"] else "no transfers"),
                 row("  limited by", lambda x: x["max_classes_hide_by"] or "-")]
    lines.append(_table(["per tier"] + names, rows))
    lines.append("")
    if out["refused"]:
        lines.append("REFUSED: " + out["refused"])
    else:
        usable = out["usable"]
        fit = [n for n in names if tiers[n]["fits"]]
        lines.append("fits: " + ", ".join(fit) + "; fits and hides behind the step"
                     + ": "
                     + (", ".join(usable) if usable else "none"))
    return "\n".join(lines)


def _verdict(t: dict) -> str:
    if not t["available"]:
        return "n/a"
    if not t["fits"]:
        return "does not fit"
    words = ["fits", "hides" if t["hides"] else "slow"]
    return ", ".join(words)


def format_sweep(outs: list[dict]) -> str:
    """Per class count and tier: GPU memory per GPU, host RAM per node, the slowest
    transfer per step, and the verdict."""
    rows = []
    for out in outs:
        for i, (name, t) in enumerate(out["tiers"].items()):
            slowest = max(t["times"].items(), key=lambda kv: kv[1]) if t["times"] else None
            rows.append([_classes(out["classes"]) if i == 0 else "", _classes(out["active_rows"]) if i == 0 else "",
                         name, _gb(t["gpu_bytes"]), _gb(t["host_bytes_node"]),
                         f"{slowest[0]} {_ms(slowest[1])}" if slowest else "-", _verdict(t)])
    return _table(["classes", "|S_q|", "tier", "GPU GB per GPU", "host GB per node", "slowest transfer, ms per step",
                   "verdict"], rows)


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
    ap.add_argument("--gpus", type=_typed(int, 1), required=True, help="k: GPUs of the node (ranks)")
    ap.add_argument("--gpu", choices=list(GPUS), required=True, help="the GPU kind (its memory)")
    ap.add_argument("--sample_rate", "--sample-rate", dest="sample_rate", type=_typed(float, 0.0, 1.0, True),
                    required=True, help="r in (0, 1]")
    ap.add_argument("--optimizer", choices=list(BACKBONE_BYTES_PER_PARAM), default=d["optimizer"],
                    help="the row optimizer (and the backbone's)")
    ap.add_argument("--storage", choices=list(STORAGES), default=d["storage"],
                    help="storage of the bank: fp32, bf16, or bf16 with the first moment in 8 bits (bf16-int8m)")
    ap.add_argument("--backbone", choices=[*BACKBONES, "none"], default=d["backbone"],
                    help="the backbone whose weights, optimizer states and activations share GPU memory with the "
                         "bank (none: the head alone; default %(default)s)")
    ap.add_argument("--batch", type=_typed(int, 1), default=d["batch"], help="B: the per-GPU batch (N = B k)")
    ap.add_argument("--step-ms", "--step_ms", dest="step_ms", type=_typed(float, 0.0, None, True), default=d["step_ms"],
                    help="the step time the transfers must hide behind")
    ap.add_argument("--host-gbps", "--host_gbps", dest="host_gbps", type=_typed(float, 0.0, None, True),
                    default=d["host_gbps"], help="host-memory bandwidth of the node, GB/s")
    ap.add_argument("--pcie-gbps", "--pcie_gbps", dest="pcie_gbps", type=_typed(float, 0.0, None, True),
                    default=d["pcie_gbps"], help="copy-engine rate per GPU and direction, GB/s")
    ap.add_argument("--zero-copy-gbps", "--zero_copy_gbps", dest="zero_copy_gbps",
                    type=_typed(float, 0.0, None, True), default=d["zero_copy_gbps"],
                    help="rate of GPU kernels reading/writing mapped host rows, per GPU and direction, GB/s")
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
    ap.add_argument("--json", default=None, help="also write the inputs, the date and every number here")
    return ap


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    options = {k: v for k, v in vars(args).items() if k not in ("classes", "json")}
    outs = []
    for c in args.classes:
        try:
            outs.append(plan(c, **options))
        except PlanArgumentError as err:
            ap.error(f"argument {err}")     # exits 2, naming the option
    if len(outs) == 1:
        print(format_plan(outs[0]))
    else:
        print(f"Bank plans: {_describe(dict(outs[0]['inputs'], classes=0)).split(', ', 1)[1]}")
        print(format_sweep(outs))
        for out in outs:
            if out["refused"]:
                print(f"\nC = {out['classes']:,}: REFUSED: {out['refused']}")
    if args.json:
        doc = {"tool": "ds-pfc-bench plan", "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
               "inputs": dict(vars(args)), "plans": outs,
               "constants": {"gpus": GPUS, "gpu_reserve_gb": GPU_RESERVE_GB, "backbones": BACKBONES,
                             "backbone_bytes_per_param": BACKBONE_BYTES_PER_PARAM, "host_touches": HOST_TOUCHES,
                             "sampler_bytes_per_class": SAMPLER_BYTES_PER_CLASS}}
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


if __name__ == "__main__":
    sys.exit(main())
