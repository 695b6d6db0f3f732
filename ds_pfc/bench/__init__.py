"""Benchmarks and the GPU self-check's checks (``ds-pfc-bench``, ``launch/bench.py``,
``ds_pfc.bench.selfcheck``): machine facts, timing, JSON sink, the GPU step model.

Each case runs in its own subprocess so that peak memory is the case's own; times
are medians over measured steps after warm-up, with min and max as the spread.

May import: ds_pfc._checks, ds_pfc.devices, ds_pfc.kernels, ds_pfc.bank, ds_pfc.core,
ds_pfc.data; torch.
Never: ds_pfc.checkpoint, ds_pfc.deepspeed_plugin, ds_pfc.app, ds_pfc.cli, the root package.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

import torch

__all__ = ["machine_info", "versions", "sync", "Timer", "summarize", "run_case_subprocess",
           "write_json", "peak_memory_bytes", "current_memory_bytes", "reset_peak_memory",
           "window_peak_bytes", "format_table"]


def machine_info() -> dict:
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else None
    info = {"host": platform.node(), "system": platform.platform(), "cpu": cpu,
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "memory_bytes": mem}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_memory_bytes"] = torch.cuda.get_device_properties(0).total_memory
    return info


def versions() -> dict:
    out = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("deepspeed", "ds_pfc"):
        try:
            module = __import__(name)
            out[name] = getattr(module, "__version__", "?")
        except Exception:  # noqa: BLE001 - an absent optional package is recorded, not fatal
            out[name] = None
    if torch.cuda.is_available():
        out["cuda"] = torch.version.cuda
    return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Timer:
    """Wall time of a block, synchronising ``device`` on both ends."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.seconds = 0.0

    def __enter__(self):
        sync(self.device)
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        sync(self.device)
        self.seconds = time.perf_counter() - self._start


def summarize(samples: list[float]) -> dict:
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples), "n": len(samples)}


def peak_memory_bytes(device: torch.device) -> int:
    """Peak device memory (CUDA) or peak resident set size of this process (CPU)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _proc_status_bytes(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def current_memory_bytes(device: torch.device) -> int | None:
    """Memory held now: allocated device memory (CUDA) or this process's resident set
    (CPU, from ``/proc/self/status``; None where that is not available)."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    return _proc_status_bytes("VmRSS")


def reset_peak_memory(device: torch.device) -> bool:
    """Start a new peak window for :func:`window_peak_bytes`; False where the peak
    cannot be reset (a CPU without a writable ``/proc/self/clear_refs``)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")        # resets the resident set's high-water mark (VmHWM)
    except OSError:
        return False
    return True


def window_peak_bytes(device: torch.device) -> int | None:
    """Peak since the last :func:`reset_peak_memory`: allocated device memory (CUDA)
    or the resident set's high-water mark (CPU)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return _proc_status_bytes("VmHWM")


def run_case_subprocess(module: str, case: dict, timeout: float | None = None) -> dict:
    """Run ``python -m module --case JSON`` and return the JSON it prints last."""
    cmd = [sys.executable, "-m", module, "--case", json.dumps(case)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"error": " | ".join(tail) or f"exit code {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def write_json(path: str, kind: str, config: dict, results: list[dict], extra: dict | None = None) -> str:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    doc = {"benchmark": kind, "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
           "machine": machine_info(), "versions": versions(), "config": config, "results": results}
    if extra:
        doc.update(extra)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=2)
    os.replace(tmp, path)
    return path


def format_table(headers: list[str], rows: list[list]) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
