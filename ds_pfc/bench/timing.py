"""The timing part of the self-check alone: ``python -m ds_pfc.selfcheck --timing``.

A few minutes on one GPU, one JSON (``benchmarks/results/timing-<gpu>-<date>.json``):

* ``steps``: the head's step (ArcFace, SGD with momentum, the triton backend where it runs)
  at the standard rank (``C_q = 8M``, ``r = 0.1``, ``N = 2048``, scaled down to fit the GPU's
  free memory) for ``d`` = 512, 256 and 128: eager with ``validate=True`` (the default, one
  host sync a step), eager with ``validate=False``, and a CUDA graph replay of the
  ``validate=False`` step (no launch or host cost at all); milliseconds per step. The gaps
  between the three are the host sync's and the launches' cost. These steps keep their
  cosines for backward (the default budget holds them at every width); the triton backend's
  recompute path (``keep_bytes=0``) is timed too, eager with ``validate=True`` and ``False``
  (``..._recompute``): the step before and after the kept-cosine design, kernel by kernel.
* ``products``: cuBLAS at the kept step's shapes, per ``d``: the cosines as an fp16 product
  ``[S, d] x [d, N]`` with fp16 output (a cuBLAS forward), ``dX`` (``[N, S] x [S, d]``) and
  ``dW`` (``[S, N] x [N, d]``), both bf16 with float32 output as the backward runs them;
  seconds and TF/s.
* ``forward``: the forward kernel (``lse_stats``) at ``d`` = 512 for N = 2048 and 4096, with
  and without storing the cosines, and its grid (programs and waves of the GPU's SMs).
* ``kernels``: the profiler's device time per kernel group of the ``validate=False`` step
  (the groups the model predicts: each Triton kernel, the torch products, other torch ops),
  per ``d``.
* ``sampler``: ``torch.topk`` of ``|S_q|`` among ``C_q`` keys and the sort of the result,
  and the whole sampler (:func:`~ds_pfc.core.sampling.sample_active`).
* ``model`` (unless ``--no-model``): the standard case's kernels against the GPU model's
  prediction (:func:`ds_pfc.bench.selfcheck.check_model`), with the committed op counts of the
  standard rank (:func:`standard_counts`; a GPU too small for it records an error instead of
  counting for minutes).

Each measurement that fails records its error and the others go on, so one call always
returns a file. The parts run in that order within :data:`BUDGET_S` seconds: one not started
by then is recorded as skipped (a run on an H200 is planned at well under it). Without CUDA it runs the same parts at toy sizes on the CPU (wall clock,
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

__all__ = ["DIMS", "BUDGET_S", "FORWARD_BATCHES", "run_timing", "time_step", "time_sampler", "time_products",
           "time_forward"]

DIMS = (512, 256, 128)
FORWARD_BATCHES = (2048, 4096)
# Seconds a --timing run may take before the parts not yet started are skipped (6 minutes with
# the JSON's writing and the process's start inside them).
BUDGET_S = 330.0
_TOY = dict(classes=20_000, sample_rate=0.1, batch=64, dim=64, compute="fp32", world=1)
_TOY_FORWARD_BATCHES = (16, 32)


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


def _rows(case: dict) -> int:
    return max(math.floor(case["sample_rate"] * math.ceil(case["classes"] / case.get("world", 1)) + 1e-9), 1)


def time_products(case: dict, device, dims, repeats: int) -> dict:
    """Seconds and TF/s of cuBLAS at the kept step's shapes for each ``d`` in ``dims``
    (``S`` the case's active rows, ``N`` its batch): ``forward_fp16`` ``[S, d] x [d, N]`` with
    fp16 operands and output, ``dx`` ``[N, S] x [S, d]`` and ``dw`` ``[S, N] x [N, d]`` in bf16
    with float32 output (the backward's own calls). On a CPU: float32, toy sizes."""
    from ..kernels.triton_softmax import _gemm_f32
    device = torch.device(device)
    cuda = device.type == "cuda"
    half, low = (torch.float16, torch.bfloat16) if cuda else (torch.float32, torch.float32)
    S, N = _rows(case), case["batch"]
    gen = torch.Generator(device=device).manual_seed(3)
    clock = _Clock(device)
    out = {"S": S, "N": N, "operands": {"forward_fp16": str(half), "dx": str(low), "dw": str(low)}}
    for d in dims:
        w = torch.randn(S, d, device=device, generator=gen).to(half)
        x = torch.randn(N, d, device=device, generator=gen).to(half)
        g = torch.randn(S, N, device=device, generator=gen).to(low)
        wb, xb = w.to(low), x.to(low)
        flops = 2 * N * S * d
        res = {}
        for name, fn in (("forward_fp16", lambda i: torch.mm(w, x.t())), ("dx", lambda i: _gemm_f32(g.t(), wb)),
                         ("dw", lambda i: _gemm_f32(g, xb))):
            fn(0)
            sec = clock(fn, repeats)
            res[name] = {"seconds": sec, "tflops": flops / sec / 1e12}
        out[f"d{d}"] = res
        del w, x, g, wb, xb
    return out


def time_forward(case: dict, device, batches, repeats: int) -> dict:
    """The forward kernel (:func:`~ds_pfc.kernels.triton_softmax.lse_stats`, no threshold) at
    the case's ``S`` and ``d`` for each batch ``N`` in ``batches``: seconds without and with
    the kept cosines' store, and its grid (sample tiles x class splits, programs per SM)."""
    from ..kernels import triton_softmax as K
    device = torch.device(device)
    compute = torch.bfloat16
    S, d = _rows(case), case["dim"]
    gen = torch.Generator(device=device).manual_seed(5)
    w = torch.randn(S, d, device=device, generator=gen)
    w_hat, w_inv = K.prepare(w, compute)
    block_n, block_s = K.tile_config("lse", compute, arch=K._arch(device))[:2]
    sms = K._num_sms(device)
    clock = _Clock(device)
    out = {"S": S, "dim": d, "sms": sms}
    for n in batches:
        x_hat = torch.nn.functional.normalize(torch.randn(n, d, device=device, generator=gen), dim=1)
        target = torch.randint(0, S, (n,), device=device, generator=gen)
        keep = torch.empty(S, n, dtype=K.keep_dtype(compute), device=device)

        def fwd(i, keep=None, x_hat=x_hat, target=target):
            K.lse_stats(x_hat, w, w_inv, target, scale=64.0, threshold=None, compute_dtype=compute,
                        want_max_cos=False, w_hat=w_hat, keep=keep)

        held = math.ceil(n / block_n)
        splits, _ = K._split(held, math.ceil(S / (4 * block_s)), device, K._LSE_CTAS_PER_SM)
        if device.type == "cuda":        # compiles the two specialisations before timing them
            fwd(0)
            fwd(0, keep)
        out[f"n{n}"] = {"seconds": clock(fwd, repeats), "seconds_keep": clock(lambda i: fwd(i, keep), repeats),
                        "programs": held * splits, "waves": held * splits / (sms * K._LSE_CTAS_PER_SM)}
        del keep
    return out


# The committed op counts of the standard rank (132 SMs): torch and triton recomputing, and the
# triton step keeping its cosines.
_STANDARD_COUNTS = ("benchmarks/results/predict-h200-d512-s800k-k1.json",
                    "benchmarks/results/predict-h200-d512-s800k-k1-kept.json",
                    "benchmarks/results/predict-h200-d512-s800k-k1-exp.json")


def standard_counts(path: str) -> str | None:
    """One ``--predict`` JSON at ``path`` holding every committed count of the standard rank
    (:data:`_STANDARD_COUNTS`), for the model check of a --timing run, which does not count
    (minutes on the CPU); None outside a checkout."""
    from .selfcheck import ROOT
    docs = []
    for name in _STANDARD_COUNTS:
        full = os.path.join(ROOT, name)
        if not os.path.exists(full):
            return None
        with open(full) as f:
            docs.append(json.load(f))
    merged = dict(docs[0], results=[r for d in docs for r in d["results"]])
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(merged, f)
    return path


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
    modes = []
    for d in dims:
        modes += [{"dim": d, "validate": True, "graph": False}, {"dim": d, "validate": False, "graph": False}]
        if cuda:
            modes.append({"dim": d, "validate": False, "graph": True})
        if _backend(device) == "triton":
            # The default step keeps its cosines when they fit (the default budget: all three
            # widths here); the recompute path of the same step, eager, for the before/after.
            modes += [{"dim": d, "validate": v, "graph": False, "cosines": "recompute"} for v in (True, False)]
    if cuda and _backend(device) == "triton":
        forward = list(FORWARD_BATCHES)
    elif not cuda:
        forward = list(_TOY_FORWARD_BATCHES)       # the interpreter, at toy sizes
    else:
        forward = []
    return {"case": case, "dims": list(dims), "backend": _backend(device), "modes": modes,
            "products": list(dims), "forward_batches": forward, "budget_s": BUDGET_S}


def run_timing(device, *, results_dir: str, stamp: str, gpu: str, model: bool = True, steps: int | None = None,
               log=print, budget_s: float | None = None) -> str:
    """Every part, one JSON; returns its path. ``budget_s`` (default :data:`BUDGET_S`): parts
    not started within it are recorded as skipped."""
    from . import machine_info, versions
    device = torch.device(device)
    cuda = device.type == "cuda"
    steps = steps or (10 if cuda else 1)
    what = plan(device)
    case = what["case"]
    doc = {"benchmark": "timing", "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
           "machine": machine_info(), "versions": versions(), "gpu": gpu, **what, "steps": {}, "sampler": {}}
    budget = BUDGET_S if budget_s is None else budget_s
    start = time.monotonic()

    def attempt(out, key, fn):
        if time.monotonic() - start > budget:
            out[key] = {"skipped": f"not started within the {budget:.0f} s budget"}
            log(f"  {key}: skipped (budget)")
            return
        _attempt(out, key, fn)

    for m in what["modes"]:
        key = f"d{m['dim']}_validate{int(m['validate'])}_graph{int(m['graph'])}"
        if m.get("cosines"):
            key += f"_{m['cosines']}"
        log(f"  step {key} ...")
        mode_case = dict(case, cosines=m["cosines"]) if m.get("cosines") else case
        attempt(doc["steps"], key, lambda m=m, c=mode_case: time_step(c, m["dim"], device, validate=m["validate"],
                                                                         graph=m["graph"], steps=steps))
        res = doc["steps"][key]
        if "seconds" in res:
            log(f"  step {key}: {res['seconds'] * 1e3:.3f} ms")
    log("  products ...")
    attempt(doc, "products", lambda: time_products(case, device, what["products"], repeats=10 if cuda else 1))
    if what["forward_batches"]:
        log("  forward ...")
        fcase = case if cuda else dict(case, classes=2_560)    # the interpreter: S = 256
        attempt(doc, "forward", lambda: time_forward(fcase, device, what["forward_batches"], repeats=10 if cuda else 1))
    else:
        doc["forward"] = {"skipped": "needs the triton backend"}
    log("  sampler ...")
    attempt(doc, "sampler", lambda: time_sampler(case, device, repeats=5 if cuda else 1))
    if model and cuda:
        from .selfcheck import check_model
        import tempfile
        with tempfile.TemporaryDirectory() as tmp:
            counts = standard_counts(os.path.join(tmp, "counts.json"))
            attempt(doc, "model", lambda: {"detail": check_model(device, results_dir, stamp, gpu,
                                                                 counts_from=counts, count=False)})
    else:
        doc["model"] = {"skipped": "needs a CUDA device" if model else "--no-model"}
    path = os.path.join(results_dir, f"timing-{gpu}-{stamp}.json")
    os.makedirs(results_dir, exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    return path
