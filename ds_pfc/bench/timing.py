"""The timing part of the self-check alone: ``python -m ds_pfc.selfcheck --timing``.

A few minutes on one GPU, one JSON (``benchmarks/results/timing-<gpu>-<date>.json``):

* ``steps``: the head's step (ArcFace, SGD with momentum, the triton backend where it runs)
  at the standard rank (``C_q = 8M``, ``r = 0.1``, ``N = 2048``, scaled down to fit the GPU's
  free memory) for ``d`` = 512, 256 and 128: eager with ``validate=True`` (the default, one
  host sync a step), eager with ``validate=False``, and a CUDA graph replay of the
  ``validate=False`` step (no launch or host cost at all); milliseconds per step. The gaps
  between the three are the host sync's and the launches' cost. These steps keep their
  cosines for backward (the default budget holds them at every width); the triton backend's
  recompute path (``keep_bytes=0``) is timed too, eager with ``validate=False``
  (``..._recompute``): the step before and after the kept-cosine design, kernel by kernel.
* ``kernels``: the profiler's device time per kernel group of the ``validate=False`` step
  (the groups the model predicts: each Triton kernel, the torch products, other torch ops),
  per ``d``.
* ``sampler``: ``torch.topk`` of ``|S_q|`` among ``C_q`` keys and the sort of the result,
  and the whole sampler (:func:`~ds_pfc.core.sampling.sample_active`).
* ``model`` (unless ``--no-model``): the standard case's kernels against the GPU model's
  prediction (:func:`ds_pfc.bench.selfcheck.check_model`).

Each measurement that fails records its error and the others go on, so one call always
returns a file. Without CUDA it runs the same parts at toy sizes on the CPU (wall clock,
no graphs) to check the harness; those numbers mean nothing.
"""
from __future__ import annotations

import datetime as _dt
import json
import math
import os
import time
import traceback

import torch

__all__ = ["DIMS", "run_timing", "time_step", "time_sampler"]

DIMS = (512, 256, 128)
_TOY = dict(classes=20_000, sample_rate=0.1, batch=64, dim=64, compute="fp32", world=1)


class _Clock:
    """Elapsed seconds of work queued on ``device``: CUDA events, or the wall clock."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"

    def __call__(self, fn, repeats: int) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for i in range(repeats):
                fn(i)
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / 1e3 / repeats
        t0 = time.perf_counter()
        for i in range(repeats):
            fn(i)
        return (time.perf_counter() - t0) / repeats


def _backend(device) -> str:
    from .selfcheck import _triton_available
    return "triton" if torch.device(device).type == "cuda" and _triton_available() else "torch"


def time_step(case: dict, dim: int, device, *, validate: bool, graph: bool, steps: int) -> dict:
    """Seconds per head step, eager or as a replayed CUDA graph (static inputs refilled
    before each step, as a training loop would). With ``profile``-able eager steps, also
    the profiler's device seconds per kernel group of one step."""
    device = torch.device(device)
    if graph and device.type != "cuda":
        raise ValueError("graph=True needs a CUDA device")
    from .selfcheck import case_head
    head = case_head(case, dim, device, backend=_backend(device), validate=validate)
    try:
        batch, classes = case["batch"], case["classes"]
        gen = torch.Generator(device=device).manual_seed(1)
        xs = [torch.randn(batch, dim, device=device, generator=gen) for _ in range(4)]
        ys = [torch.randint(0, classes, (batch,), device=device, generator=gen) for _ in range(4)]
        x = torch.zeros(batch, dim, device=device, requires_grad=True)
        y = torch.zeros(batch, dtype=torch.int64, device=device)

        def feed(i):
            with torch.no_grad():
                x.copy_(xs[i % 4])
                y.copy_(ys[i % 4])

        def step():
            x.grad = None
            head(x, y).backward()
            head.step(0.1)

        if graph:
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):          # warm-up off the capture stream, as CUDA graphs ask
                for i in range(3):
                    feed(i)
                    step()
            torch.cuda.current_stream(device).wait_stream(side)
            captured = torch.cuda.CUDAGraph()
            with torch.cuda.graph(captured):
                step()

            def run(i):
                feed(i)
                captured.replay()
        else:
            for i in range(2):
                feed(i)
                step()

            def run(i):
                feed(i)
                step()
        out = {"seconds": _Clock(device)(run, steps)}
        if not graph:
            out["kernels"] = _kernel_groups(run, device)
        return out
    finally:
        head.close()


def _kernel_groups(run, device, top: int = 40) -> dict:
    """Seconds of one step: the aten products and the other aten ops (each op's own
    kernels), and the ``top`` longest device kernels by name (Triton's by their function
    name). On a CPU, host time stands in for device time."""
    from torch.profiler import ProfilerActivity, profile

    from .selfcheck import group_measured
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        run(0)
        if cuda:
            torch.cuda.synchronize(device)
    rows = []
    for evt in prof.key_averages():
        on_device = str(getattr(evt, "device_type", "")).endswith("CUDA")
        micros = getattr(evt, "self_device_time_total", 0.0) if cuda else getattr(evt, "self_cpu_time_total", 0.0)
        rows.append((evt.key, on_device, micros / 1e6))
    kernels = sorted(((name, sec) for name, on_device, sec in rows if on_device), key=lambda r: -r[1])[:top]
    return {**group_measured(rows, set()), "device kernels": dict(kernels)}


def time_sampler(case: dict, device, repeats: int) -> dict:
    """Seconds of ``topk`` of ``|S_q|`` among ``C_q`` keys, of sorting its result, and of
    the whole sampler, at the case's ``C_q``."""
    from ..core.sampling import activation_budget, class_keys, sample_active
    device = torch.device(device)
    num_local = math.ceil(case["classes"] / case.get("world", 1))
    size = activation_budget(num_local, case["sample_rate"])
    keys = class_keys(num_local, 7, 3, 0, device)
    chosen = torch.topk(keys, size, sorted=False).indices
    labels = torch.randint(0, num_local, (case["batch"],), device=device)
    clock = _Clock(device)
    return {"classes_per_rank": num_local, "size": size,
            "topk_s": clock(lambda i: torch.topk(keys, size, sorted=False), repeats),
            "sort_s": clock(lambda i: torch.sort(chosen), repeats),
            "sample_active_s": clock(lambda i: sample_active(labels, num_local, case["sample_rate"], seed=1, step=i,
                                                             rank=0), repeats)}


def _attempt(out: dict, key: str, fn) -> None:
    try:
        out[key] = fn()
    except Exception as err:  # noqa: BLE001 - recorded; the other measurements go on
        out[key] = {"error": f"{type(err).__name__}: {str(err)[:400]}"}
        traceback.print_exc()
    finally:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def plan(device) -> dict:
    """What :func:`run_timing` measures on ``device``: the case and the step modes."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    if cuda:
        from .selfcheck import fitting_case
        free, _ = torch.cuda.mem_get_info(device)
        case = fitting_case(free)
        dims = DIMS
    else:
        case, dims = dict(_TOY), (_TOY["dim"],)
    modes = [(d, True, False) for d in dims[:1]] + [(d, False, g) for d in dims for g in ((False, True) if cuda
                                                                                              else (False,))]
    modes = [{"dim": d, "validate": v, "graph": g} for d, v, g in modes]
    if _backend(device) == "triton":
        # The default step keeps its cosines when they fit (4 GiB: all three widths here);
        # the recompute path of the same step, eager, for the before/after per kernel.
        modes += [{"dim": d, "validate": False, "graph": False, "cosines": "recompute"} for d in dims]
    return {"case": case, "dims": list(dims), "backend": _backend(device), "modes": modes}


def run_timing(device, *, results_dir: str, stamp: str, gpu: str, model: bool = True, steps: int | None = None,
               log=print) -> str:
    """Every part, one JSON; returns its path."""
    from . import machine_info, versions
    device = torch.device(device)
    cuda = device.type == "cuda"
    steps = steps or (10 if cuda else 1)
    what = plan(device)
    case = what["case"]
    doc = {"benchmark": "timing", "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
           "machine": machine_info(), "versions": versions(), "gpu": gpu, **what, "steps": {}, "sampler": {}}
    for m in what["modes"]:
        key = f"d{m['dim']}_validate{int(m['validate'])}_graph{int(m['graph'])}"
        if m.get("cosines"):
            key += f"_{m['cosines']}"
        log(f"  step {key} ...")
        mode_case = dict(case, cosines=m["cosines"]) if m.get("cosines") else case
        _attempt(doc["steps"], key, lambda m=m, c=mode_case: time_step(c, m["dim"], device, validate=m["validate"],
                                                                         graph=m["graph"], steps=steps))
        res = doc["steps"][key]
        if "seconds" in res:
            log(f"  step {key}: {res['seconds'] * 1e3:.3f} ms")
    log("  sampler ...")
    _attempt(doc, "sampler", lambda: time_sampler(case, device, repeats=5 if cuda else 1))
    if model and cuda:
        from .selfcheck import check_model
        _attempt(doc, "model", lambda: {"detail": check_model(device, results_dir, stamp, gpu)})
    else:
        doc["model"] = {"skipped": "needs a CUDA device" if model else "--no-model"}
    path = os.path.join(results_dir, f"timing-{gpu}-{stamp}.json")
    os.makedirs(results_dir, exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    return path
