"""GPU self-check: ``python -m ds_pfc.selfcheck`` (or ``ds-pfc-selfcheck``; the command is
:mod:`ds_pfc.cli.selfcheck`, the checks are here).

Confirms on the user's machine what the project's CPU-only development and CI could
not: that the head is exact on the GPU, that a step stays within its launch and
sync budget, that the fused kernels run, and how fast the head and the bank are.

On a CUDA machine it runs, in order:

1. built-in checks on ``cuda:0``: a head step with each softmax backend against a
   float64 reference computed on the CPU; the fused row optimizer against the torch
   one; launches and syncs of a step at C = 1M; one full-softmax step with
   ``validate=False`` under ``torch.cuda.set_sync_debug_mode("error")`` (no host sync);
2. the CUDA-marked tests (``pytest -m cuda tests``), when run from a source checkout;
3. the bank tests again under ``TORCH_CUDA_SANITIZER=1`` (stream races);
4. each kernel of a head step at the standard case (scaled to fit one GPU) timed against
   the GPU model's prediction (:mod:`ds_pfc.bench.model`; fails beyond 2x, writes
   ``benchmarks/results/selfcheck-<gpu>-<date>.json``), then the head and bank benchmarks
   (``launch/bench.py head`` / ``bank`` on the GPU) and the mapped tier's check
   (``launch/bench.py rows --tier-check``, whose ``planner_defaults`` the planner reads);
5. with two or more GPUs, a 5-step ``deepspeed --num_gpus 2`` run of the training app.

It prints a pass/fail table and writes ``benchmarks/results/<gpu>-<date>.json`` (and
a PNG of the benchmark when matplotlib is installed). Without CUDA it says so, runs
the built-in checks on the CPU (the Triton kernels in Triton's interpreter), and
lists what it would run on a GPU.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback

import torch

__all__ = ["run_checks", "ROOT"]

# The directory that holds the ds_pfc package: the source checkout when run from one
# (then it also holds tests/ and launch/, see _has_tests), else site-packages.
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _has_tests() -> bool:
    return os.path.isdir(os.path.join(ROOT, "tests")) and os.path.isdir(os.path.join(ROOT, "launch"))


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


# --------------------------------------------------------------------- reference
def _reference(x, y, w, scale, margin):
    """float64 full-softmax ArcFace CE (plain PyTorch on the CPU): loss, dx, dw."""
    x = x.detach().cpu().double().requires_grad_(True)
    w = w.detach().cpu().double().requires_grad_(True)
    cos = torch.nn.functional.normalize(x, dim=1) @ torch.nn.functional.normalize(w, dim=1).t()
    rows = torch.arange(x.shape[0])
    theta = torch.acos(cos[rows, y.cpu()].clamp(-1, 1))
    # past theta + m > pi the library continues linearly; keep the data away from it
    target = torch.cos(theta + margin)
    logits = (scale * cos).index_put((rows, y.cpu()), scale * target)
    loss = torch.nn.functional.cross_entropy(logits, y.cpu())
    loss.backward()
    return loss.detach(), x.grad, w.grad


def _close(name, got, want, rtol):
    got = got.detach().cpu().double()
    err = float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))
    if not err <= rtol:
        raise AssertionError(f"{name}: max error {err:.2e} relative to its largest entry, allowed {rtol:.0e}")
    return err


# --------------------------------------------------------------------- checks
def check_exact_step(device, backend: str, compute=torch.float32) -> str:
    """One head step (r = 1, ArcFace, 2 ranks' worth of classes on one) against float64,
    at C = 1021 on a GPU and C = 131 on a CPU (Triton's interpreter runs a program at a
    time; 131 classes are still several class tiles with a ragged last one).
    ``compute`` is given explicitly: ``None`` would mean bf16 products on CUDA."""
    from ..core.margins import ArcFace
    from ..core.functional import margin_cross_entropy
    gen = torch.Generator().manual_seed(0)
    n, d, c = 37, 64, (1021 if device.type == "cuda" else 131)
    w = torch.randn(c, d, generator=gen)
    y = torch.randint(0, c, (n,), generator=gen)
    x = 2.0 * torch.nn.functional.normalize(w[y], dim=1) + torch.randn(n, d, generator=gen) / math.sqrt(d)
    loss_ref, dx_ref, dw_ref = _reference(x, y, w, 64.0, 0.5)
    xd = x.to(device).requires_grad_(True)
    wd = w.to(device).requires_grad_(True)
    loss = margin_cross_entropy(xd, y.to(device), wd, margin=ArcFace(64.0, 0.5), backend=backend,
                                compute_dtype=compute)
    loss.backward()
    # bf16 operands carry 2**-9 relative error: at scale 64 a logit moves by up to ~0.1,
    # which moves probabilities and gradients by a few percent (more on a CPU, whose
    # bf16 GEMM also rounds its output to bf16; CUDA writes it in float32).
    rtol = 1e-4 if compute == torch.float32 else 1e-1
    errs = [_close("loss", loss, loss_ref, rtol), _close("d embeddings", xd.grad, dx_ref, rtol),
            _close("d centers", wd.grad, dw_ref, rtol)]
    return f"max relative error {max(errs):.1e} (allowed {rtol:.0e})"


def check_fused_optimizer(device) -> str:
    """The fused Triton row update against the torch row update, 3 sampled steps
    (C = 4099 on a GPU, 515 in Triton's interpreter on a CPU)."""
    from ..core.head import PartialFC
    classes = 4099 if device.type == "cuda" else 515
    states = []
    for fused in (False, True):
        head = PartialFC(classes, 64, sample_rate=0.2, device=device, seed=1, data_parallel_grad=False, fused=fused,
                         momentum=0.9, weight_decay=5e-4)
        gen = torch.Generator().manual_seed(2)
        for _ in range(3):
            x = torch.randn(64, 64, generator=gen).to(device).requires_grad_()
            y = torch.randint(0, classes, (64,), generator=gen).to(device)
            head(x, y).backward()
            head.step(0.01)
        states.append(head.state_dict())
    err = max(_close(k, states[1][k].double(), states[0][k].cpu().double(), 1e-5)
              for k in ("weight", "momentum_buffer"))
    return f"max relative error {err:.1e}"


def check_budget(device) -> str:
    """Launches and host syncs of a step at C = 1M (d = 512, B = 512, r = 0.1) on the
    GPU, or the same op sequence counted on the CPU with a smaller C."""
    from .head import count_step
    classes = 1_000_000 if device.type == "cuda" else 100_000
    res = count_step(classes, 512, device=device, backend="torch")
    out = f"torch backend: {res['ops']} ops, {res['syncs']} syncs at C={classes:,}"
    if res["ops"] > 400 or res["syncs"] > 8:
        raise AssertionError(out + " (budget: 400 ops, 8 syncs)")
    if device.type == "cuda" and _triton_available():
        tri = count_step(classes, 512, device=device, backend="triton")
        out += f"; triton backend: {tri['ops']} ops ({sum(tri['launches'].values())} kernels), {tri['syncs']} syncs"
    return out


def check_no_sync_step(device) -> str:
    """r = 1, validate=False: a whole step (forward, backward, row update) with host
    synchronisation turned into an error."""
    from ..core.head import PartialFC
    head = PartialFC(100_003, 256, sample_rate=1.0, device=device, validate=False, data_parallel_grad=False)
    x = torch.randn(256, 256, device=device, requires_grad=True)
    y = torch.randint(0, 100_003, (256,), device=device)
    head(x, y).backward()           # warm-up: first-use allocations and kernel compilation
    head.step(0.1)
    torch.cuda.synchronize(device)
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss = head(x, y)
        loss.backward()
        head.step(0.1)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize(device)
    return "no host synchronisation in forward, backward and step"


# --------------------------------------------------------------------- the GPU model, measured


def fitting_case(free_bytes: int, dim: int = 512, sample_rate: float = 0.1, batch: int = 2048,
                 target_rows: int = 800_000) -> dict:
    """One rank of the standard case on one GPU: S = 800k active rows, fewer if the class
    table (weight and momentum, 8 d bytes per class of S / r classes) and a step's
    ``[S, d]`` float32 tensors (about 6 of them) do not fit in 70% of ``free_bytes``."""
    per_row = dim * (8 / sample_rate + 24)
    rows = int(min(target_rows, max(0.7 * free_bytes - (1 << 30), 0) // per_row))
    if rows < 1024:
        raise RuntimeError(f"only {free_bytes / 2**30:.1f} GiB free: too little for the model check")
    return dict(world=1, classes=math.ceil(rows / sample_rate), sample_rate=sample_rate, batch=batch, dim=dim,
                compute="bf16", embeddings="fp32", block_bytes=None)


def group_measured(events, triton_kernels) -> dict:
    """Seconds per comparison group from profiler rows ``(name, is_kernel, self_device_s)``:
    the kernels named in ``triton_kernels`` each by name (``triton:<kernel>``), the aten
    products together (``torch GEMMs``), every other aten op together (``torch other ops``).
    Other device rows (the kernels behind aten ops, copies) are already in their aten op."""
    from .model import _GEMM_OPS
    out = {}
    for name, is_kernel, seconds in events:
        if name.startswith("aten::"):
            key = "torch GEMMs" if name[6:] in _GEMM_OPS else "torch other ops"
        elif is_kernel and name in triton_kernels:
            key = "triton:" + name
        else:
            continue
        out[key] = out.get(key, 0.0) + seconds
    return out


def case_head(case: dict, dim: int, device, *, backend: str, validate: bool = True):
    """The head the timing checks step: ArcFace, SGD with momentum, the case's classes, rate
    and compute dtype, at width ``dim``; a triton case's ``cosines`` ("kept" or "recompute")
    sets its ``keep_bytes`` (absent: the default budget)."""
    from ..core.head import PartialFC
    from ..core.margins import ArcFace
    compute = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}[case["compute"]]
    keep = {"kept": 1 << 62, "recompute": 0}.get(case.get("cosines"))
    return PartialFC(case["classes"], dim, sample_rate=case["sample_rate"], margin=ArcFace(), device=device,
                     compute_dtype=compute, momentum=0.9, weight_decay=5e-4, data_parallel_grad=False,
                     backend=backend, validate=validate, keep_bytes=keep)


def _time_step(device, case: dict, backend: str, steps: int = 3):
    """``(seconds per step, profiler rows per step)`` of the case's head step on ``device``."""
    head = case_head(case, case["dim"], device, backend=backend)
    gen = torch.Generator().manual_seed(1)
    batch, dim = case["batch"], case["dim"]
    data = [(torch.randn(batch, dim, generator=gen).to(device).requires_grad_(),
             torch.randint(0, case["classes"], (batch,), generator=gen).to(device)) for _ in range(2 + steps)]

    def step(x, y):
        head(x, y).backward()
        head.step(0.1)

    for x, y in data[:2]:
        step(x, y)
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for x, y in data[2:]:
        step(x, y)
    end.record()
    torch.cuda.synchronize(device)
    seconds = start.elapsed_time(end) / 1e3 / steps
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for x, y in data[2:]:
            step(x, y)
        torch.cuda.synchronize(device)
    rows = []
    for evt in prof.key_averages():
        is_kernel = str(getattr(evt, "device_type", "")).endswith("CUDA")
        rows.append((evt.key, is_kernel, getattr(evt, "self_device_time_total", 0.0) / 1e6 / steps))
    head.close()
    return seconds, rows


def check_model(device, results_dir: str, stamp: str, gpu: str, factor: float = 2.0,
                counts_from: str | None = None, count: bool = True) -> str:
    """Each Triton kernel, the torch products, the other torch ops and the whole step of the
    standard case (scaled to fit this GPU) measured against ds_pfc.bench.model's prediction;
    fails where they differ by more than ``factor``. Counting a case takes minutes on the
    CPU; ``counts_from`` (a ``bench.py head --predict`` JSON of the same case) skips it, and
    ``count=False`` refuses to count (a RuntimeError when ``counts_from`` lacks the case)."""
    from . import model
    kind = model.gpu_model_key(torch.cuda.get_device_name(device))
    if kind is None:
        return f"skipped: the model has no constants for {torch.cuda.get_device_name(device)}"
    free, _ = torch.cuda.mem_get_info(device)
    base = fitting_case(free)
    doc, bad = {"gpu": kind, "case": base, "factor": factor, "backends": {}}, []
    for backend in ("torch", "triton") if _triton_available() else ("torch",):
        case = dict(base, backend=backend)
        from ..core.softmax import COSINE_KEEP_SHARE
        path = model.cosines_path(backend, case["batch"], model.case_rows(case), case["compute"],
                                  int(COSINE_KEEP_SHARE * free))
        if path is not None:
            case["cosines"] = path          # what the head's default keep budget makes the step do
        sms = model.GPUS[kind]["sms"]
        counts = model.saved_counts(counts_from, case, sms)
        if counts is None and not count:
            raise RuntimeError(f"no saved op counts of {case} for {sms} SMs in {counts_from} (counting takes "
                               "minutes: python -m ds_pfc.selfcheck --counts <a --predict JSON of this case>)")
        counts = counts or model._count_in_subprocess(case, sms, model.GPUS[kind]["arch"])
        pred = model.predict_case(case, kind, counts=counts)
        seconds, events = _time_step(device, case, backend)
        predicted = dict(model.group_predicted(pred), step=pred["step_s"])
        names = {k.split(":", 1)[1] for k in predicted if k.startswith("triton:")}
        measured = dict(group_measured(events, names), step=seconds)
        rows = model.compare(measured, predicted, factor=factor, min_seconds=0.5e-3)
        doc["backends"][backend] = {"case": case, "rows": rows, "prediction": pred, "profile": events}
        for r in rows:
            line = (f"{backend} {r['kernel']}: measured {1e3 * (r['measured_s'] or 0):.2f} ms, predicted "
                    f"{1e3 * (r['predicted_s'] or 0):.2f} ms")
            print(("  " if r["ok"] else "  MODEL OFF BY MORE THAN 2x: ") + line, flush=True)
            if not r["ok"]:
                bad.append(line)
    path = os.path.join(results_dir, f"selfcheck-{gpu}-{stamp}.json")
    os.makedirs(results_dir, exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)
    if bad:
        raise AssertionError(f"the GPU model is off by more than {factor:g}x for: " + "; ".join(bad)
                             + f" (details in {path})")
    return f"S={math.floor(base['sample_rate'] * base['classes']):,}: every kernel within {factor:g}x; wrote {path}"


def _run(cmd, env=None, timeout=None) -> str:
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=timeout)
    tail = (proc.stdout + proc.stderr).strip().splitlines()
    if proc.returncode != 0:
        raise AssertionError(f"exit code {proc.returncode}: " + " | ".join(tail[-4:]))
    return tail[-1] if tail else "ok"


def check_cuda_tests() -> str:
    return _run([sys.executable, "-m", "pytest", "-q", "-m", "cuda", "tests"], timeout=3600)


def check_sanitizer() -> str:
    env = dict(os.environ, TORCH_CUDA_SANITIZER="1")
    return _run([sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-k", "bank or tier", "tests"], env=env,
                timeout=3600)


def check_benchmarks(results_dir: str, stamp: str, gpu: str) -> str:
    head = os.path.join(results_dir, f"head-{gpu}-{stamp}.json")
    bank = os.path.join(results_dir, f"bank-{gpu}-{stamp}.json")
    _run([sys.executable, "launch/bench.py", "head", "--device", "cuda:0", "--classes", "1000000,8000000,32000000",
          "--extra-rate", "0.0125", "--out", head], timeout=3600)
    _run([sys.executable, "launch/bench.py", "bank", "--device", "cuda:0", "--out", bank], timeout=3600)
    tier = os.path.join(results_dir, f"tier-check-{gpu}-{stamp}.json")
    _run([sys.executable, "launch/bench.py", "rows", "--tier-check", "--out", tier], timeout=900)
    return f"wrote {os.path.relpath(head, ROOT)}, {os.path.relpath(bank, ROOT)} and {os.path.relpath(tier, ROOT)}"


def check_two_gpu_app() -> str:
    out = tempfile.mkdtemp(prefix="ds_pfc_selfcheck_")
    return _run(["deepspeed", "--num_gpus", "2", "launch/train.py", "--deepspeed_config",
                 "configs/cpu_quickstart.json", "--max_steps", "5", "--output_dir", out, "--no_resume"],
                timeout=1800)


def plan(device: torch.device, quick: bool) -> list[tuple[str, object]]:
    """``(name, callable)`` of every check for this machine; callables that only run
    on CUDA are replaced by a string saying why they are skipped."""
    cuda = device.type == "cuda"
    gpus = torch.cuda.device_count() if cuda else 0
    source = _has_tests()
    triton_ok = _triton_available() and (cuda or os.environ.get("TRITON_INTERPRET") == "1")
    no_gpu = "needs a CUDA device"
    checks = [
        ("head step, torch backend, fp32 vs float64", lambda: check_exact_step(device, "torch")),
        ("head step, torch backend, bf16 vs float64", lambda: check_exact_step(device, "torch", torch.bfloat16)),
        ("head step, triton backend, fp32 vs float64",
         (lambda: check_exact_step(device, "triton")) if triton_ok else "triton is not installed"),
        ("head step, triton backend, bf16 vs float64",
         (lambda: check_exact_step(device, "triton", torch.bfloat16)) if triton_ok else "triton is not installed"),
        ("fused row optimizer vs torch", (lambda: check_fused_optimizer(device)) if triton_ok
         else "triton is not installed"),
        ("launches and syncs per step", lambda: check_budget(device)),
        ("a step with no host sync (set_sync_debug_mode error)", (lambda: check_no_sync_step(device)) if cuda
         else no_gpu),
    ]
    need_source = "needs the source checkout (tests/, launch/)"
    slow = "skipped with --quick"
    checks += [
        ("CUDA-marked tests", (check_cuda_tests if source else need_source) if cuda else no_gpu),
        ("bank tests under TORCH_CUDA_SANITIZER=1", (check_sanitizer if source else need_source) if cuda else no_gpu),
    ]
    checks.append(("kernel times vs the GPU model (2x)", ("model" if not quick else slow) if cuda else no_gpu))
    if cuda and quick:
        checks.append(("head and bank benchmarks", slow))
    else:
        checks.append(("head and bank benchmarks", "bench" if cuda and source else (need_source if cuda else no_gpu)))
    checks.append(("2-GPU deepspeed launcher run (5 steps)",
                   (check_two_gpu_app if source else need_source) if gpus >= 2
                   else "needs 2 or more GPUs" if cuda else no_gpu))
    return checks


def run_checks(device, quick: bool = False, results_dir: str | None = None, stamp: str | None = None,
               counts_from: str | None = None, benchmarks: bool = True) -> list[dict]:
    device = torch.device(device)
    gpu = torch.cuda.get_device_name(device).replace(" ", "_") if device.type == "cuda" else "cpu"
    results_dir = results_dir or os.path.join(ROOT, "benchmarks", "results")
    rows = []
    for name, what in plan(device, quick):
        if what == "bench" and not benchmarks:
            what = "skipped with --no-benchmarks"
        elif what == "bench":
            what = (lambda: check_benchmarks(results_dir, stamp, gpu))
        elif what == "model":
            what = (lambda: check_model(device, results_dir, stamp or time.strftime("%Y%m%d-%H%M%S"), gpu,
                                        counts_from=counts_from))
        if isinstance(what, str):
            rows.append({"check": name, "status": "skipped", "detail": what, "seconds": 0.0})
            print(f"  - {name}: skipped ({what})", flush=True)
            continue
        print(f"  ... {name}", flush=True)
        start = time.perf_counter()
        try:
            detail, status = what(), "pass"
        except Exception as err:  # noqa: BLE001 - every failure is reported in the table
            detail, status = f"{type(err).__name__}: {err}", "FAIL"
            traceback.print_exc()
        rows.append({"check": name, "status": status, "detail": detail,
                     "seconds": round(time.perf_counter() - start, 2)})
        print(f"  {status}: {name}: {detail}", flush=True)
    return rows


def _plot(rows, path) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(8, 0.4 * len(rows) + 1))
    colors = {"pass": "tab:green", "FAIL": "tab:red", "skipped": "tab:gray"}
    ax.barh([r["check"] for r in rows], [max(r["seconds"], 0.05) for r in rows],
            color=[colors[r["status"]] for r in rows])
    ax.set_xscale("log")
    ax.set_xlabel("seconds (green pass, red fail, grey skipped)")
    fig.tight_layout()
    fig.savefig(path)
    return path
