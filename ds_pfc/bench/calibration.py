"""The GPU step model calibrated by a measured step: ``launch/bench.py head --predict h200``.

The roofline model (:mod:`ds_pfc.bench.model`) bounds each kernel by assumed rates. A
calibration replaces them by what one GPU achieved on one step, read from the JSON that
``python -m ds_pfc.selfcheck`` wrote there (:data:`DEFAULT`:
``benchmarks/results/gpu-h200-20261126.json``, the standard step on one H200), with the op
counts of that same step (:data:`DEFAULT_COUNTS`, a ``--predict`` JSON of the case):

* **reference rates**: the GPU's own bf16 GEMM rate (``ceilings_measured.
  bf16_gemm_8192_flops_per_s``) and copy rate (``ceilings_measured.device_copy_bytes_per_s``);
* **efficiencies**, each an achieved rate over a reference rate: a Triton GEMM kernel's
  counted FLOPs per measured second over the GEMM rate; cuBLAS's the same, per backend (its
  shape: ``[N, b] x [b, d]`` products in triton, ``[b, d] x [d, N]`` blocks in torch); a
  streaming Triton kernel's distinct (HBM) bytes per second over the copy rate;
* **launch** (``launch_s``, the device time of one small kernel) and **aten streaming
  efficiency**: the two unknowns of the two backends' "torch other ops" groups, each the
  ops' bytes at that efficiency plus their launches, solved together;
* **topk and sort**, time per key: from a ``python -m ds_pfc.selfcheck --timing`` JSON of the
  same GPU when given (``sampler.topk_s`` per ``classes_per_rank`` key, ``sampler.sort_s`` per
  ``size`` key); else the estimates :data:`TOPK_PER_KEY_S` and :data:`SORT_PER_KEY_S` (the
  self-check JSON's rows group them with the other torch ops);
* **idle** (``idle_s``): the part of a ``validate=True`` step (one host sync) that no kernel
  covers: the measured step minus the sum of its measured groups, triton backend.

Each backend's measured case is ``model_check.case`` with that backend, or
``model_check.cases[backend]`` where the run names it (the triton step's ``cosines``: a run
before the kept-cosine path recomputed). Each value is the mean over the JSON's runs
(``model_check.runs``). Calibrated time of a
kernel: ``body / fill + launches * launch_s``, where ``body`` is ``max(FLOPs / (eff * GEMM
rate), distinct bytes / copy rate)`` for a product, ``distinct bytes / (eff * copy rate)``
for a streaming Triton kernel, ``bytes / (eff_aten * copy rate)`` for other aten ops and
``keys * per_key`` for topk and sort (their small kernels included). The step adds ``idle_s``.
A streaming Triton kernel the calibration did not see runs at the lowest streaming efficiency
it measured (of its Triton kernels); a product kernel it did not see keeps the roofline rule
at the measured reference rates, and so do products in another compute dtype; each row names
its ``rule``.

**Another GPU** of the same architecture (H100 from an H200 calibration): the same kernels
and counts (132 SMs on both), the same efficiencies, launch and idle; reference rates scaled
by the two GPUs' data-sheet peaks in :data:`~ds_pfc.bench.model.GPUS` (``tensor_peak`` for
the GEMM rate, ``hbm_peak`` for the copy rate and the per-key rules). That prediction is an
estimate (``estimate: True``), not a calibration of that GPU. Another architecture (A100,
sm_80) compiles other kernels: no calibrated prediction.

**The forward** is priced by three terms instead of one efficiency: its products at an MMA
efficiency, a fixed cost per logit (the epilogue and the pipeline refill, which do not shrink
with ``d``: :data:`FORWARD_FIXED_SHARE` of the measured forward, an estimate from the compiled
kernel's instruction counts), and its written bytes (the kept path's float16 cosines) at
:data:`STORE_EFFICIENCY` of the copy rate, not overlapped. The kept step's cuBLAS dW product
runs at :data:`DW_CUBLAS_SHARE` of the efficiency measured at the dX shape.

**What it validates.** The calibration reproduces its own run by construction (each
efficiency and the idle time are solved from it), which validates nothing. Its error on steps
it was not fitted to (:func:`out_of_sample`: the head benchmark at N = 512 on the same H200)
is -4% to -27% (all under-predictions); every calibrated prediction carries it. Away from the
measured ``d`` the per-logit split is an assumption. Each prediction gives the floor at the
model's assumed rates and at the calibration's measured ones (:func:`measured_floor`).
"""
from __future__ import annotations

import dataclasses
import json
import os

__all__ = ["Calibration", "load_calibration", "calibrated_prediction", "kernel_seconds", "measured_groups",
           "floor_parts", "groups", "format_comparison", "DEFAULT", "DEFAULT_COUNTS", "TOPK_PER_KEY_S",
           "SORT_PER_KEY_S", "TERMS", "FORWARD_FIXED_SHARE", "STORE_EFFICIENCY", "DW_CUBLAS_SHARE",
           "measured_floor", "out_of_sample"]

# The checkout that holds benchmarks/ (absent from an installed package).
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT = "benchmarks/results/gpu-h200-20261126.json"
DEFAULT_COUNTS = "benchmarks/results/predict-h200-d512-s800k-k1.json"

# torch.topk(keys, k, sorted=False) on CUDA is a multi-block radix select: 8 passes of 8 bits over
# the int64 keys (64 MB at C_q = 8M) plus ~30 small kernels, estimated at 0.2-0.35 ms for 8M keys
# on an H200; the midpoint per key. The sort of the selected 800k int64 keys that follows: a radix
# sort estimated at 0.05-0.1 ms; the midpoint per key. Neither is in
# benchmarks/results/gpu-h200-20261126.json on its own: its profiler rows group them with the
# other torch ops ("torch other ops"), which the launch and aten terms then account for.
TOPK_PER_KEY_S = 0.275e-3 / 8_000_000
SORT_PER_KEY_S = 0.075e-3 / 800_000
_KEY_BYTES = 8              # the sampler's keys are int64: keys = bytes the op reads / 8

# What a calibration calibrates, by name (``without=`` drops any of them back to the roofline):
# a kernel's name ("triton:_g_kernel"), "cublas" (the torch products), "aten" (aten streaming
# ops), "launch", "topk" (topk and sort) and "idle".
TERMS = ("cublas", "aten", "launch", "topk", "idle")

# The forward kernel (``_lse_kernel``, :data:`_FORWARD`) is priced as three terms, each from the
# measured run or a stated assumption:
# * its products, ``2 N S d`` FLOPs at an MMA efficiency;
# * a fixed cost per logit (``N S``), the epilogue (exp, masks, the running max and sum, about 11
#   issue slots and one MUFU op per logit) and the refill of the operand pipeline per tile, which
#   does not shrink with ``d``. Assumed: FORWARD_FIXED_SHARE of the measured forward's time at the
#   measured ``d`` (0.98 of 4.53 ms at d = 512, an estimate from the compiled kernel's instruction
#   counts); the per-logit seconds and the MMA efficiency are then solved from the measured run;
# * the cosines it stores for backward (``keep=``: ``2 N S`` bytes), its written bytes at
#   STORE_EFFICIENCY of the copy rate, not overlapped with the products (one CTA per SM, and the
#   store's layout conversion through shared memory holds a barrier per part).
FORWARD_FIXED_SHARE = 0.98 / 4.53
STORE_EFFICIENCY = 1.0
# cuBLAS's dW product of the kept-cosine step ([S, N] x [N, d], float32 output) was not on the
# measured step: it runs at DW_CUBLAS_SHARE of the efficiency measured at the dX shape (90%: the
# pessimistic end of 90-95%, as the calibrated model under-predicts every step it was not fitted to).
DW_CUBLAS_SHARE = 0.90
# Kernels priced by the forward rule (products + fixed per logit + store).
_FORWARD = ("triton:_lse_kernel",)
# Steps the calibration was not fitted to: the head benchmark at N = 512 on the same H200 (each
# of forward, backward and update timed between device syncs) and the op counts of each case.
OUT_OF_SAMPLE = "benchmarks/results/head-h200-n512-20261126.json"
OUT_OF_SAMPLE_COUNTS = (
    ("benchmarks/results/predict-h200-n512-d512-s1600k-k1.json", "triton", 16_000_000, 0.1),
    ("benchmarks/results/predict-h200-n512-d512-s800k-k1.json", "torch", 8_000_000, 0.1),
    ("benchmarks/results/predict-h200-n512-d512-s800k-k1.json", "triton", 8_000_000, 0.1),
    ("benchmarks/results/predict-h200-n512-d512-s400k-c16m-k1.json", "triton", 16_000_000, 0.025),
    ("benchmarks/results/predict-h200-n512-d512-s100k-k1.json", "triton", 1_000_000, 0.1))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Calibration:
    """What one GPU achieved on one step (:func:`load_calibration`)."""

    gpu: str
    """Key of :data:`~ds_pfc.bench.model.GPUS` of the measured GPU."""
    source: str
    """The measured JSON, relative to the checkout."""
    date: str
    """The measurement's date (the JSON's ``date``)."""
    counts_source: str
    """The ``--predict`` JSON holding the op counts of the measured case."""
    case: dict
    """The measured case: one rank's classes, rate, N, d, dtypes (``model_check.case``)."""
    gemm_rate: float
    """Measured bf16 GEMM rate at 8192^3, FLOP/s."""
    copy_rate: float
    """Measured device copy rate, bytes read + written per second."""
    matrix: dict
    """Achieved FLOP/s over ``gemm_rate``: Triton GEMM kernels by name, ``cublas:<backend>``."""
    stream: dict
    """Achieved distinct bytes/s over ``copy_rate``: streaming Triton kernels by name, ``aten``."""
    launch_s: float
    """Device seconds of one small kernel."""
    idle_s: float
    """Seconds of a ``validate=True`` step covered by no kernel (the host sync and what follows)."""
    topk_per_key_s: float = TOPK_PER_KEY_S
    sort_per_key_s: float = SORT_PER_KEY_S
    select_source: str = "estimate"
    """Where the topk and sort times per key come from: a timing JSON, or ``estimate``."""
    measured: dict = dataclasses.field(default_factory=dict)
    """backend -> group -> measured seconds (mean over runs), with ``step`` and ``idle``."""
    triton_cosines: str = "recompute"
    """What the measured triton step did with its cosines: ``kept`` or ``recompute``."""
    mma: dict = dataclasses.field(default_factory=dict)
    """Forward kernels by name: their products' efficiency over ``gemm_rate`` once the fixed
    per-logit and store terms are taken out (see FORWARD_FIXED_SHARE)."""
    per_logit_s: dict = dataclasses.field(default_factory=dict)
    """Forward kernels by name: device seconds per logit (``N S``) that do not shrink with ``d``."""

    def rates(self, gpu_name: str) -> dict:
        """Reference rates on ``gpu_name``: this calibration's, or scaled by data-sheet peaks."""
        from .model import GPUS
        if gpu_name not in GPUS:
            raise ValueError(f"gpu_name must be one of {sorted(GPUS)}, got {gpu_name!r}")
        own, other = GPUS[self.gpu], GPUS[gpu_name]
        if other["arch"] != own["arch"]:
            raise ValueError(f"gpu_name {gpu_name!r} is sm_{other['arch']}; this calibration ({self.source}) "
                             f"is of sm_{own['arch']} kernels on {self.gpu}")
        return {"gemm": self.gemm_rate * other["tensor_peak"] / own["tensor_peak"],
                "copy": self.copy_rate * other["hbm_peak"] / own["hbm_peak"],
                "estimate": gpu_name != self.gpu}

    def describe(self, gpu_name: str) -> dict:
        r = self.rates(gpu_name)
        return {"source": self.source, "date": self.date, "gpu": self.gpu, "counts": self.counts_source,
                "case": dict(self.case), "topk_sort": self.select_source, "estimate": r["estimate"],
                "gemm_rate": r["gemm"], "copy_rate": r["copy"]}


def _path(path: str) -> str:
    """``path`` as given when it exists (absolute or from the working directory), else from the checkout."""
    return path if os.path.isabs(path) or os.path.exists(path) else os.path.join(ROOT, path)


def _rel(path: str) -> str:
    full = os.path.abspath(_path(path))
    return os.path.relpath(full, ROOT) if full.startswith(ROOT + os.sep) else full


def _mean_groups(runs: dict, backend: str) -> dict:
    """group -> mean measured seconds over the runs, plus ``idle`` = step - sum of groups."""
    per = {}
    for run in runs.values():
        for row in run.get(backend, []):
            if row.get("measured_s") is not None:
                per.setdefault(row["kernel"], []).append(row["measured_s"])
    out = {k: sum(v) / len(v) for k, v in per.items()}
    if "step" in out:
        out["idle"] = out["step"] - sum(v for k, v in out.items() if k != "step")
    return out


def _is_select(name: str) -> str | None:
    op = name.split(":", 1)[1].split("[")[0] if name.startswith("aten:") else ""
    return op if op in ("topk", "sort") else None


def _is_gemm(row: dict) -> bool:
    return row["kind"] == "gemm"


def load_calibration(path: str = DEFAULT, counts: str = DEFAULT_COUNTS, timing: str | None = None) -> Calibration:
    """The calibration of the step measured in ``path`` (a ``python -m ds_pfc.selfcheck`` JSON
    with ``ceilings_measured`` and ``model_check``), with that case's op counts from
    ``counts`` (a ``launch/bench.py head --predict`` JSON holding the same case, counted for
    the GPU's SM count) and, when given, topk and sort times from ``timing`` (a
    ``python -m ds_pfc.selfcheck --timing`` JSON of the same GPU model). A relative path is
    taken from the working directory when it exists there, else from the checkout."""
    from . import model
    for name, p in (("path", path), ("counts", counts), ("timing", timing)):
        if p is not None and not os.path.exists(_path(p)):
            raise FileNotFoundError(f"{name}: no such file {p!r} (calibrations live in a source checkout's "
                                    "benchmarks/results)")
    with open(_path(path)) as f:
        doc = json.load(f)
    try:
        ceilings, check = doc["ceilings_measured"], doc["model_check"]
        gemm_rate = float(ceilings["bf16_gemm_8192_flops_per_s"])
        copy_rate = float(ceilings["device_copy_bytes_per_s"])
        gpu, base, runs = check["gpu_model"], dict(check["case"]), check["runs"]
    except KeyError as err:
        raise ValueError(f"path: {path!r} has no {err} (expected a self-check JSON with ceilings_measured "
                         "and model_check)") from None
    if gpu not in model.GPUS:
        raise ValueError(f"path: {path!r} measured gpu_model {gpu!r}, not one of {sorted(model.GPUS)}")
    measured = {b: _mean_groups(runs, b) for b in ("torch", "triton")}
    if not measured["triton"].get("step") or not measured["torch"].get("step"):
        raise ValueError(f"path: {path!r} needs model_check runs of both backends (torch, triton)")
    topk_per_key, sort_per_key, select_source = TOPK_PER_KEY_S, SORT_PER_KEY_S, "estimate"
    if timing is not None:
        with open(_path(timing)) as f:
            tdoc = json.load(f)
        if model.gpu_model_key(str(tdoc.get("gpu", "")).replace("_", " ")) != gpu:
            raise ValueError(f"timing: {timing!r} is of gpu {tdoc.get('gpu')!r}, the calibration of {gpu}")
        sampler = tdoc.get("sampler") or {}
        try:
            topk_per_key = float(sampler["topk_s"]) / int(sampler["classes_per_rank"])
            sort_per_key = float(sampler["sort_s"]) / int(sampler["size"])
        except (KeyError, TypeError, ValueError, ZeroDivisionError):
            raise ValueError(f"timing: {timing!r} has no sampler topk_s, sort_s, classes_per_rank and size "
                             f"(got {sampler})") from None
        select_source = _rel(timing)
    fitted = {}
    for backend in ("torch", "triton"):
        # A run may name each backend's exact case (``model_check.cases``: the triton step's
        # cosine path); else the base case, whose triton step recomputed (model.with_cosines_path).
        case = dict((check.get("cases") or {}).get(backend) or dict(base, backend=backend))
        saved = model.saved_counts(_path(counts), case, model.GPUS[gpu]["sms"])
        if not saved:
            raise ValueError(f"counts: {counts!r} holds no counts of {case} for {model.GPUS[gpu]['sms']} SMs")
        fitted[backend] = model.fit_case(case, saved)
        if backend == "triton":
            triton_cosines = model.with_cosines_path(case)["cosines"]

    # launch_s and the aten streaming efficiency: each backend's "torch other ops" is its aten
    # ops' bytes / (eff * copy) + their launches * launch_s + topk and sort.
    system = []
    for backend in ("torch", "triton"):
        moved = launches = select = 0.0
        for key, c in fitted[backend].items():
            if not key.startswith("aten:") or _is_gemm(c):
                continue
            op = _is_select(key)
            if op:
                select += c["read"] / _KEY_BYTES * (topk_per_key if op == "topk" else sort_per_key)
            else:
                moved += c["read"] + c["written"]
                launches += c["launches"]
        system.append((moved / copy_rate, launches, measured[backend]["torch other ops"] - select))
    (a1, b1, y1), (a2, b2, y2) = system
    det = a1 * b2 - a2 * b1
    if det == 0:
        raise ValueError(f"counts: {counts!r}: the two backends' other ops do not separate launches from bytes")
    per_byte, launch_s = (y1 * b2 - y2 * b1) / det, (a1 * y2 - a2 * y1) / det
    if not (per_byte > 0 and launch_s > 0):
        raise ValueError(f"path: {path!r}: the torch-other-ops groups less topk and sort ({select_source}) give "
                         f"no positive launch time and streaming efficiency (launch {launch_s:.3g} s, "
                         f"efficiency {1 / per_byte:.3g})")
    matrix = {}
    stream = {"aten": 1.0 / per_byte}
    tri = measured["triton"]
    mma, per_logit = {}, {}
    triton_case = dict((check.get("cases") or {}).get("triton") or dict(base, backend="triton"))
    for key, c in fitted["triton"].items():
        if key.startswith("triton:") and key in tri:
            busy = (tri[key] - c["launches"] * launch_s) * _fill(c, model.GPUS[gpu])
            if c["flops"]:
                matrix[key] = c["flops"] / busy / gemm_rate
                if key in _FORWARD:
                    # The measured forward = products + fixed per-logit work + its store.
                    logits = c["flops"] / (2 * triton_case["dim"])
                    rest = busy - c["unique_written"] / (STORE_EFFICIENCY * copy_rate)
                    per_logit[key] = FORWARD_FIXED_SHARE * rest / logits
                    mma[key] = c["flops"] / ((1 - FORWARD_FIXED_SHARE) * rest) / gemm_rate
            else:
                stream[key] = (c["unique_read"] + c["unique_written"]) / busy / copy_rate
    for backend in ("torch", "triton"):
        gemms = [c for c in fitted[backend].values() if _is_gemm(c)]
        busy = measured[backend]["torch GEMMs"] - sum(c["launches"] for c in gemms) * launch_s
        matrix[f"cublas:{backend}"] = sum(c["flops"] for c in gemms) / busy / gemm_rate
    return Calibration(gpu=gpu, source=_rel(path), date=str(doc.get("date", "?")), counts_source=_rel(counts),
                       case=base, gemm_rate=gemm_rate, copy_rate=copy_rate, matrix=matrix, stream=stream,
                       launch_s=launch_s, idle_s=tri["idle"], topk_per_key_s=topk_per_key,
                       sort_per_key_s=sort_per_key, select_source=select_source, measured=measured,
                       triton_cosines=triton_cosines, mma=mma, per_logit_s=per_logit)


def _fill(c: dict, gpu: dict) -> float:
    if c["kind"] != "triton":
        return 1.0
    per_launch = c["programs"] / max(c["launches"], 1)
    return min(1.0, per_launch / gpu["sms"]) if per_launch else 1.0


# Product kernels the calibration did not see, priced by the rule of the kernel whose products
# and tiles they share: the exp-kept forward is the statistics kernel with an exp and a bf16
# store of E in its epilogue (products + fixed per logit + its store, as the kept forward).
_CALIBRATED_AS = {"triton:_lse_exp_kernel": "triton:_lse_kernel"}
# Streaming kernels whose code changed after a calibration measured them: key -> (date of the
# change, what changed, the measured kernel of the new access pattern, a test on the counts that
# the launch is the new code). A calibration dated before the change measured the old code, so
# the new one is priced at the rate of the kernel it now moves bytes like. ``prepare`` read each
# row twice (its norm, then the scaled copy: 67% of copy on the H200); it now reads whole rows
# once by index, as the row update (_sgd_rows_kernel) does.
_CHANGED_SINCE = {
    "triton:_prep_kernel": ("2026-12-04", "one pass over whole rows", "triton:_sgd_rows_kernel",
                            lambda c: c["read"] <= 1.05 * c["unique_read"]),
}


def kernel_seconds(key: str, c: dict, cal: Calibration, gpu_name: str, backend: str, compute: str = "bf16",
                   without=(), *, dim: int | None = None, dw_flops: float = 0.0) -> tuple[float, str]:
    """``(seconds, rule)`` of one kernel's fitted counts ``c`` of a ``backend`` step with
    ``compute`` products on ``gpu_name`` under ``cal``; terms named in ``without`` (see
    :data:`TERMS`) fall back to the roofline rule, and so do Triton products in another compute
    dtype than the calibration's (other machine code). ``dim``: the step's ``d`` (the forward's
    logits are its FLOPs / 2d; default the calibration's); ``dw_flops``: the part of a cuBLAS
    record's FLOPs that is the kept step's dW product (priced at DW_CUBLAS_SHARE)."""
    from .model import GPUS, kernel_time
    gpu = GPUS[gpu_name]
    rates = cal.rates(gpu_name)
    gemm, copy = rates["gemm"], rates["copy"]
    launch = gpu["launch_s"] if "launch" in without else cal.launch_s
    unique = c["unique_read"] + c["unique_written"]
    moved = c["read"] + c["written"]
    fill = _fill(c, gpu)
    roofline = kernel_time(c, gpu)["seconds"]
    if key.startswith("triton:"):
        if key in without:
            return roofline, "roofline"
        if c["flops"] and compute != cal.case.get("compute"):
            return roofline, f"roofline ({compute} products; calibrated: {cal.case.get('compute')})"
        ruled = _CALIBRATED_AS.get(key, key)
        if ruled in cal.mma and ruled in cal.per_logit_s and c["flops"]:
            eff = cal.mma[ruled]
            logits = c["flops"] / (2 * (dim or cal.case["dim"]))
            fixed = logits * cal.per_logit_s[ruled] * cal.gemm_rate / gemm   # issue-bound: scales with the SMs' rate
            store = c["unique_written"] / (STORE_EFFICIENCY * copy)
            body = max(c["flops"] / (eff * gemm), c["unique_read"] / copy) + fixed + store
            return (body / fill + c["launches"] * launch,
                    f"{eff:.1%} of {gemm / 1e12:.0f} TF/s + {cal.per_logit_s[ruled] * 1e15:.0f} fs per logit "
                    f"+ store at {STORE_EFFICIENCY:.0%} of {copy / 1e12:.2f} TB/s"
                    + ("" if ruled == key else f", as {ruled.split(':', 1)[1]}"))
        if key in cal.matrix and c["flops"]:
            eff = cal.matrix[key]
            body = max(c["flops"] / (eff * gemm), unique / copy)
            return body / fill + c["launches"] * launch, f"{eff:.1%} of {gemm / 1e12:.0f} TF/s"
        changed = _CHANGED_SINCE.get(key)
        if changed and not c["flops"] and cal.date < changed[0] and changed[3](c) and changed[2] in cal.stream:
            eff = cal.stream[changed[2]]
            return (unique / (eff * copy) / fill + c["launches"] * launch,
                    f"{changed[1]} since {changed[0]} (measured before): {eff:.1%} of {copy / 1e12:.2f} TB/s, "
                    f"as {changed[2].split(':', 1)[1]}")
        if key in cal.stream and not c["flops"]:
            eff = cal.stream[key]
            return unique / (eff * copy) / fill + c["launches"] * launch, f"{eff:.1%} of {copy / 1e12:.2f} TB/s"
        if not c["flops"]:
            # A streaming kernel the calibration did not see: the least efficient streaming
            # Triton kernel it measured (no kernel is assumed to do better than what ran).
            measured = {k: v for k, v in cal.stream.items() if k.startswith("triton:")}
            if measured:
                worst = min(measured, key=measured.get)
                eff = measured[worst]
                return (unique / (eff * copy) / fill + c["launches"] * launch,
                        f"not calibrated: {eff:.1%} of {copy / 1e12:.2f} TB/s, as {worst.split(':', 1)[1]}")
        same = _CALIBRATED_AS.get(key)
        if same in cal.matrix and c["flops"]:
            eff = cal.matrix[same]
            body = max(c["flops"] / (eff * gemm), unique / copy)
            return (body / fill + c["launches"] * launch,
                    f"not calibrated: {eff:.1%} of {gemm / 1e12:.0f} TF/s, as {same.split(':', 1)[1]}")
        # A kernel the calibration did not see: the roofline at the calibrated reference rates.
        body = max(c["flops"] / gemm, unique / copy)
        return body / fill + c["launches"] * launch, "not calibrated: roofline at the measured rates"
    if _is_gemm(c):
        eff = cal.matrix.get(f"cublas:{backend}")
        if "cublas" in without or eff is None or c["dtype"] not in ("bfloat16", "float16"):
            return roofline, "roofline"
        dw = min(max(dw_flops, 0.0), c["flops"])
        products = (c["flops"] - dw) / (eff * gemm) + dw / (DW_CUBLAS_SHARE * eff * gemm)
        body = max(products, moved / copy)
        rule = f"cuBLAS {eff:.1%} of {gemm / 1e12:.0f} TF/s"
        if dw:
            rule += f" (dW at {DW_CUBLAS_SHARE:.0%} of it)"
        return body + c["launches"] * launch, rule
    op = _is_select(key)
    if op:
        if "topk" in without:
            return roofline, "roofline"
        per_key = cal.topk_per_key_s if op == "topk" else cal.sort_per_key_s
        per_key *= cal.copy_rate / copy          # memory passes: scale with the copy rate
        return c["read"] / _KEY_BYTES * per_key, f"{per_key * 1e12:.0f} ps per key"
    if "aten" in without:
        return roofline, "roofline"
    eff = cal.stream["aten"]
    return moved / (eff * copy) + c["launches"] * launch, f"{eff:.1%} of {copy / 1e12:.2f} TB/s"


def calibrated_prediction(pred: dict, cal: Calibration, gpu_name: str | None = None, without=()) -> dict:
    """The calibrated twin of a :func:`ds_pfc.bench.model.predict_case` result ``pred`` (which
    carries its case and counts): per kernel ``{kernel, seconds, rule}``, ``idle_s``,
    ``step_s``, the floor at the model's assumed rates (``floor_s``, ``x_floor``) and at the
    calibration's measured rates (``floor_measured_s``, ``x_floor_measured``), ``calibration``
    (source, date, whether an estimate) and ``out_of_sample`` (:func:`out_of_sample`: this
    calibration's error on steps it was not fitted to) on ``gpu_name`` (default: the
    prediction's GPU). ``without``: calibrated terms to drop (:data:`TERMS` or a kernel's name)."""
    from . import model
    gpu_name = gpu_name or pred["gpu"]
    unknown = [t for t in without if t not in TERMS and not t.startswith("triton:")]
    if unknown:
        raise ValueError(f"without: expected names from {TERMS} or 'triton:<kernel>', got {unknown}")
    case = pred["case"]
    fitted = model.fit_case(case, pred["counts"])
    # The kept-cosine step runs dW (2 N S d FLOPs) on cuBLAS beside dX.
    dw = 2 * case["batch"] * pred["S"] * case["dim"] if model.case_keeps(case) else 0.0
    rows = []
    for key, c in fitted.items():
        seconds, rule = kernel_seconds(key, c, cal, gpu_name, case["backend"], case["compute"], without,
                                       dim=case["dim"], dw_flops=dw if key == f"aten:mm[{case['compute']}]" else 0.0)
        rows.append({"kernel": key, "seconds": seconds, "rule": rule})
    rows.sort(key=lambda r: -r["seconds"])
    idle = 0.0 if "idle" in without else cal.idle_s
    step = sum(r["seconds"] for r in rows) + idle
    floor = model.floor_time(pred["S"], case["batch"], case["dim"], model.GPUS[gpu_name])
    floor_m = measured_floor(cal, gpu_name, pred["S"], case["batch"], case["dim"])
    return {"kernels": rows, "idle_s": idle, "step_s": step, "floor_s": floor, "x_floor": step / floor,
            "floor_measured_s": floor_m, "x_floor_measured": step / floor_m,
            "calibration": cal.describe(gpu_name), "out_of_sample": out_of_sample(cal)}


def measured_floor(cal: Calibration, gpu_name: str, S: int, batch: int, dim: int) -> float:
    """The floor's formula (:func:`ds_pfc.bench.model.floor_time`: ``6 N S d`` FLOPs plus the
    SGD update's ``20 S d`` bytes) at the calibration's measured GEMM and copy rates on
    ``gpu_name`` (scaled by data-sheet peaks on another GPU, :meth:`Calibration.rates`)."""
    from .model import floor_time
    r = cal.rates(gpu_name)
    return floor_time(S, batch, dim, {"gemm": r["gemm"], "hbm": r["copy"]})


_OUT_OF_SAMPLE_CACHE: dict = {}


def out_of_sample(cal: Calibration) -> dict | None:
    """This calibration's error on the steps it was not fitted to (:data:`OUT_OF_SAMPLE`, on
    the calibration's own GPU): ``{source, steps: [{case, measured_s, predicted_s, error,
    roofline_s, roofline_error}], min_error, max_error, roofline_min_error,
    roofline_max_error}``, error = predicted / measured - 1 (the roofline's: the uncalibrated
    model's); None when those files are absent."""
    from . import model
    key = (cal.source, cal.date, cal.gemm_rate, cal.copy_rate, tuple(sorted(cal.matrix.items())))
    if key in _OUT_OF_SAMPLE_CACHE:
        return _OUT_OF_SAMPLE_CACHE[key]
    out = None
    path = _path(OUT_OF_SAMPLE)
    if os.path.exists(path):
        with open(path) as f:
            bench = json.load(f)
        steps = []
        for counts_path, backend, classes, rate in OUT_OF_SAMPLE_COUNTS:
            row = next((r for r in bench.get("results", []) if r.get("impl") == "ds_pfc"
                        and r.get("backend") == backend and r.get("classes") == classes
                        and r.get("sample_rate") == rate), None)
            if row is None or not os.path.exists(_path(counts_path)):
                continue
            case = dict(world=1, classes=classes, sample_rate=rate, batch=row.get("batch", 512),
                        dim=row.get("dim", 512), compute="bf16", embeddings="fp32", backend=backend, block_bytes=None)
            counts = model.saved_counts(_path(counts_path), case, model.GPUS[cal.gpu]["sms"])
            if not counts:
                continue
            fitted = model.fit_case(case, counts)
            roofline = model.predict_case(case, cal.gpu, counts=counts, compile_code=False)["step_s"]
            seconds = cal.idle_s + sum(kernel_seconds(k, c, cal, cal.gpu, backend, "bf16", dim=case["dim"])[0]
                                       for k, c in fitted.items())
            measured = row["step"]["median"]
            steps.append({"case": case, "S": model.case_rows(case), "measured_s": measured, "predicted_s": seconds,
                          "error": seconds / measured - 1, "roofline_s": roofline,
                          "roofline_error": roofline / measured - 1})
        if steps:
            errors = [s["error"] for s in steps]
            roof = [s["roofline_error"] for s in steps]
            out = {"source": _rel(path), "steps": steps, "min_error": min(errors), "max_error": max(errors),
                   "roofline_min_error": min(roof), "roofline_max_error": max(roof)}
    _OUT_OF_SAMPLE_CACHE[key] = out
    return out


def out_of_sample_line(cpred: dict) -> str:
    """One line stating the calibration's measured error away from its own run."""
    o = cpred.get("out_of_sample")
    if not o:
        return "out-of-sample error: unknown (no step measured apart from the calibration's own)"
    return (f"out-of-sample error of this calibration: {o['max_error']:+.0%} to {o['min_error']:+.0%} "
            f"({len(o['steps'])} head steps it was not fitted to, {o['source']}; negative: predicted faster "
            f"than measured; the roofline: {o['roofline_max_error']:+.0%} to {o['roofline_min_error']:+.0%}). It "
            f"reproduces its own run by construction, which validates nothing.")


def groups(prediction: dict) -> dict:
    """Seconds per comparison group (each Triton kernel, ``torch GEMMs``, ``torch other ops``,
    ``idle``, ``step``), as the self-check groups its profiler rows."""
    from .model import group_predicted
    out = group_predicted(prediction)
    out["idle"] = prediction.get("idle_s", 0.0)
    out["step"] = prediction["step_s"]
    return out


def measured_groups(cal: Calibration, gpu_name: str, case: dict) -> dict | None:
    """The calibration's measured groups when ``case`` is its measured one-rank shape on its own
    GPU (the same S, N, d, dtypes, blocks and backend), else None."""
    from .model import case_rows
    if gpu_name != cal.gpu:
        return None
    keys = ("batch", "dim", "compute", "embeddings", "block_bytes")
    if case_rows(case) != case_rows(cal.case) or any(case.get(k) != cal.case.get(k) for k in keys):
        return None
    from .model import with_cosines_path
    if case["backend"] == "triton" and with_cosines_path(case)["cosines"] != cal.triton_cosines:
        return None
    return cal.measured.get(case["backend"])


def floor_parts(pred: dict, rates: dict | None = None) -> dict:
    """The floor split by group: ``2 N S d`` at the GEMM rate for each of the forward cosines,
    dX and dW, and the SGD update's ``20 S d`` bytes at the HBM rate (the model's assumed
    rates, or ``rates``: ``{"gemm": FLOP/s, "hbm": bytes/s}``)."""
    from .model import GPUS
    gpu, case, S = rates or GPUS[pred["gpu"]], pred["case"], pred["S"]
    gemm_pass = 2 * case["batch"] * S * case["dim"] / gpu["gemm"]
    sgd = 20 * S * case["dim"] / gpu["hbm"]
    if case["backend"] == "triton" and case.get("cosines") in ("kept", "exp"):     # dX and dW both on cuBLAS
        forward = "triton:_lse_exp_kernel" if case["cosines"] == "exp" else "triton:_lse_kernel"
        return {forward: gemm_pass, "torch GEMMs": 2 * gemm_pass, "triton:_sgd_rows_kernel": sgd}
    if case["backend"] == "triton":
        return {"triton:_lse_kernel": gemm_pass, "torch GEMMs": gemm_pass, "triton:_dw_kernel": gemm_pass,
                "triton:_sgd_rows_kernel": sgd}
    return {"torch GEMMs": 3 * gemm_pass, "triton:_sgd_rows_kernel": sgd}


_LABELS = {"triton:_lse_kernel": "forward (lse)", "triton:_g_kernel": "G", "triton:_dw_kernel": "dW",
           "triton:_g_pass_kernel": "G pass (kept cosines)", "triton:_project_kernel": "projection",
           "triton:_lse_exp_kernel": "forward (lse, storing exp)",
           "torch GEMMs": "torch GEMMs (cuBLAS)", "triton:_prep_kernel": "prepare",
           "triton:_sgd_rows_kernel": "SGD rows", "triton:_keys_kernel": "sampler keys",
           "torch other ops": "torch other ops", "idle": "idle (host sync)"}


def format_comparison(pred: dict) -> str:
    """Measured (when the calibration measured this case on this GPU), calibrated, roofline and
    the floor's part, per group and for the step, with each step's multiple of the floor, for a
    :func:`ds_pfc.bench.model.predict_case` result that carries ``calibrated`` (and ``measured``)."""
    from . import format_table
    cpred, measured = pred["calibrated"], pred.get("measured")
    about = cpred["calibration"]
    cal_g, roof_g, floor_g = groups(cpred), groups(pred), floor_parts(pred)
    floor_gm = floor_parts(pred, {"gemm": about["gemm_rate"], "hbm": about["copy_rate"]})
    ms = lambda v: "-" if v is None else f"{v * 1e3:.2f}"
    keys = sorted((k for k in cal_g if k != "step"), key=lambda k: -cal_g[k])
    rows = []
    for k in keys:
        m = measured.get(k) if measured else None
        rows.append([_LABELS.get(k, k), ms(m), ms(cal_g[k]), ms(roof_g.get(k) if k != "idle" else None),
                     ms(floor_g.get(k, 0.0)), ms(floor_gm.get(k, 0.0))])
    floor, floor_m = pred["floor_s"], cpred["floor_measured_s"]
    m_step = measured.get("step") if measured else None
    rows.append(["step", ms(m_step), ms(cpred["step_s"]), ms(pred["step_s"]), ms(floor), ms(floor_m)])
    for label, f in (("x floor (assumed rates)", floor), ("x floor (measured rates)", floor_m)):
        rows.append([label, "-" if m_step is None else f"{m_step / f:.2f}", f"{cpred['step_s'] / f:.2f}",
                     f"{pred['step_s'] / f:.2f}", f"{floor / f:.2f}", f"{floor_m / f:.2f}"])
    if about["estimate"]:
        head = (f"{pred['gpu_name']}, calibrated: an ESTIMATE carried from the {about['gpu'].upper()} calibration "
                f"{about['source']} ({about['date']}): the same kernels, efficiencies, launch and idle, reference "
                f"rates scaled by the data-sheet peaks to {about['gemm_rate'] / 1e12:.0f} TF/s GEMM and "
                f"{about['copy_rate'] / 1e12:.2f} TB/s copy; no measurement on this GPU")
    else:
        c = about["case"]
        head = (f"{pred['gpu_name']}, calibrated by {about['source']} ({about['date']}; counts {about['counts']}; "
                f"topk and sort: {about['topk_sort']}); "
                + (f"measured: the same rank shape, C={c['classes']:,} on k={c['world']}" if measured
                   else "this case was not measured"))
    table = format_table(["ms", "measured", "calibrated", "roofline", "floor part", "floor part (measured rates)"],
                         rows)
    floors = (f"floor {floor * 1e3:.2f} ms at the model's assumed rates ({pred['gpu_name']}: "
              f"{model_rates(pred)}); {floor_m * 1e3:.2f} ms at the calibration's measured rates "
              f"({about['gemm_rate'] / 1e12:.0f} TF/s, {about['copy_rate'] / 1e12:.2f} TB/s)")
    return "\n".join([head, table, floors, out_of_sample_line(cpred)])


def model_rates(pred: dict) -> str:
    from .model import GPUS
    gpu = GPUS[pred["gpu"]]
    return f"{gpu['gemm'] / 1e12:.0f} TF/s, {gpu['hbm'] / 1e12:.2f} TB/s"
