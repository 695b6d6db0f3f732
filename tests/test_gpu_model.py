"""The GPU step model (ds_pfc/bench/model.py): its counts against hand-computed ones, the
linear scaling in S, the time rule and the measured-vs-predicted comparison.

The Triton counts need the interpreter (``TRITON_INTERPRET=1`` before triton is imported,
which the conftest sets on a machine without CUDA); those tests skip elsewhere.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from ds_pfc.bench import model, predict  # noqa: E402
from ds_pfc.kernels import _target  # noqa: E402

try:
    import triton
    import triton.language as tl
    INTERPRETED = type(tl.zeros).__name__ == "InterpretedFunction"
except ImportError:       # pragma: no cover - triton is a dev dependency
    triton = tl = None
    INTERPRETED = False
needs_interpreter = pytest.mark.skipif(not INTERPRETED, reason="needs triton running in its interpreter "
                                       "(TRITON_INTERPRET=1 set before triton was imported)")


# --------------------------------------------------------------------- torch ops
def test_a_product_counts_2mnk_flops_and_its_operands_and_result():
    a, b = torch.randn(7, 5), torch.randn(5, 3)
    with model.CostCounter() as c:
        torch.mm(a, b)
    k = c.kernels()
    assert list(k) == ["aten:mm[fp32]"]
    rec = k["aten:mm[fp32]"]
    assert rec["launches"] == 1
    assert rec["flops"] == 2 * 7 * 5 * 3
    assert rec["read"] == (7 * 5 + 5 * 3) * 4
    assert rec["written"] == 7 * 3 * 4


def test_gathers_and_scatters_move_the_indexed_rows_not_the_table():
    table = torch.randn(1000, 8)
    index = torch.tensor([3, 1, 4, 1, 5])
    with model.CostCounter() as c:
        rows = table.index_select(0, index)
        table.index_add_(0, index, rows)
    k = c.kernels()
    moved = 5 * 8 * 4
    assert k["aten:index_select"]["read"] == moved + 5 * 8        # rows + int64 index
    assert k["aten:index_select"]["written"] == moved
    assert k["aten:index_add_"]["read"] == 5 * 8 + 2 * moved       # index, source, the rows added to
    assert k["aten:index_add_"]["written"] == moved


def test_a_broadcast_operand_counts_once_and_in_place_ops_read_and_write():
    x, col = torch.randn(64, 32), torch.randn(64, 1)
    with model.CostCounter() as c:
        x.mul_(col.expand(64, 32))
        x.fill_(1.0)
    k = c.kernels()
    assert k["aten:mul_"]["read"] == (64 * 32 + 64) * 4
    assert k["aten:mul_"]["written"] == 64 * 32 * 4
    assert k["aten:fill_"]["read"] == 0 and k["aten:fill_"]["written"] == 64 * 32 * 4


def test_a_float32_copy_of_a_bf16_product_is_the_product_writing_float32():
    a, b = torch.randn(6, 16).bfloat16(), torch.randn(16, 4).bfloat16()
    with model.CostCounter() as c:
        torch.mm(a, b).float()
    k = c.kernels()
    assert list(k) == ["aten:mm[bf16]"], "the cast is folded into the product, as CUDA's out_dtype does"
    assert k["aten:mm[bf16]"]["written"] == 6 * 4 * 4
    assert k["aten:mm[bf16]"]["read"] == (6 * 16 + 16 * 4) * 2


# --------------------------------------------------------------------- Triton kernels
if INTERPRETED:
    @triton.jit
    def _twice_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
        """Loads each element twice (one distinct read), stores the masked range once."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n
        a = tl.load(src_ptr + offs, mask=ok, other=0.0)
        b = tl.load(src_ptr + offs, mask=ok, other=0.0)
        tl.store(dst_ptr + offs, a + b, mask=ok)

    @triton.jit
    def _dot_kernel(a_ptr, b_ptr, c_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr):
        rm, rn, rk = tl.arange(0, M), tl.arange(0, N), tl.arange(0, K)
        a = tl.load(a_ptr + rm[:, None] * K + rk[None, :])
        b = tl.load(b_ptr + rk[:, None] * N + rn[None, :])
        tl.store(c_ptr + rm[:, None] * N + rn[None, :], tl.dot(a, b))


@needs_interpreter
def test_triton_loads_and_stores_count_live_lanes_and_distinct_bytes():
    n, block = 100, 32                      # 4 programs, the last one 4 lanes live
    src = torch.randn(n, dtype=torch.float32)
    dst = torch.empty(n, dtype=torch.float32)
    with model.CostCounter() as c:
        _twice_kernel[(triton.cdiv(n, block),)](src, dst, n, BLOCK=block)
    rec = c.kernels()["triton:_twice_kernel"]
    assert rec["launches"] == 1 and rec["programs"] == 4
    assert rec["read"] == 2 * n * 4 and rec["unique_read"] == n * 4
    assert rec["written"] == n * 4 and rec["unique_written"] == n * 4
    assert rec["flops"] == 0
    torch.testing.assert_close(dst, 2 * src)
    assert rec["meta"]["signature"] == {"src_ptr": "*fp32", "dst_ptr": "*fp32", "n": "i32"}
    assert rec["meta"]["constexprs"] == {"BLOCK": 32}


@needs_interpreter
def test_triton_dots_count_2mnk_per_program():
    M, N, K = 16, 32, 64
    a, b, out = torch.randn(M, K), torch.randn(K, N), torch.empty(M, N)
    with model.CostCounter() as c:
        _dot_kernel[(3,)](a, b, out, M=M, N=N, K=K)
    rec = c.kernels()["triton:_dot_kernel"]
    assert rec["flops"] == 3 * 2 * M * N * K
    assert rec["read"] == 3 * (M * K + K * N) * 4 and rec["unique_read"] == (M * K + K * N) * 4
    assert rec["written"] == 3 * M * N * 4 and rec["unique_written"] == M * N * 4


@needs_interpreter
def test_gpu_tiles_make_the_interpreter_launch_with_the_gpu_rows():
    from ds_pfc.kernels import triton_optim, triton_softmax as ts
    assert ts.tile_config("lse", torch.bfloat16) == ts._INTERPRET_TILES["lse"]
    with _target.gpu_tiles(sms=108):
        assert ts.tile_config("lse", torch.bfloat16) == ts.TILES[("lse", "lowp")]
        assert ts._num_sms(torch.device("cpu")) == 108
        assert triton_optim._tiles() == triton_optim._TILES["cuda"]
    assert ts._num_sms(torch.device("cpu")) == ts._INTERPRET_SMS
    assert triton_optim._tiles() == triton_optim._TILES["interpreter"]
    with pytest.raises(ValueError, match="sms"):
        with _target.gpu_tiles(sms=0):
            pass


# --------------------------------------------------------------------- a whole step
def _torch_step(S, block_rows, N=32, d=16):
    return model.count_step(S, batch=N, dim=d, sample_rate=0.25, compute="fp32", backend="torch",
                            block_rows=block_rows)


def _gemm_totals(kernels):
    flops = sum(r["flops"] for r in kernels.values())
    moved = sum(r["read"] + r["written"] for k, r in kernels.items() if r["kind"] == "gemm")
    return flops, moved


@needs_interpreter     # the fused row update runs in the interpreter
def test_the_torch_step_does_8NSd_flops_and_its_products_move_what_they_touch():
    N, d, S, rows = 32, 16, 64, 32
    out = _torch_step(S, rows, N, d)
    B = out["blocks"]
    assert B == 2
    flops, moved = _gemm_totals(out["kernels"])
    # Per block of b classes, recomputed in backward (two blocks: nothing kept): cosines
    # (w_hat [b, d], x [N, d] -> [b, N]) twice, dW (G [b, N], x -> [b, d]) and dX added into
    # [N, d] (read and written). float32 elements.
    assert flops == 8 * N * S * d
    assert moved == 4 * (4 * S * d + 4 * S * N + 5 * B * N * d)
    # The row update: weight and momentum read and written, the gradient and the row ids read
    # (20 B per element, 8 per row).
    sgd = out["kernels"]["triton:_sgd_rows_kernel"]
    assert sgd["unique_read"] == sgd["read"] == 12 * S * d + 8 * S
    assert sgd["unique_written"] == sgd["written"] == 8 * S * d


def test_the_fit_is_exact_for_linear_counts():
    def fake(S, B):
        return {"S": S, "blocks": B, "kernels": {"k": dict(kind="elementwise", dtype=None, meta=None,
                                                           launches=3 + 2 * B, flops=0, read=7 + 5 * S + 11 * B,
                                                           written=S, unique_read=0, unique_written=0,
                                                           programs=0)}}
    runs = [fake(128, 2), fake(256, 4), fake(128, 4)]
    got = model.fit_counts(runs, 800_000, 25)["k"]
    assert got["launches"] == pytest.approx(3 + 2 * 25)
    assert got["read"] == pytest.approx(7 + 5 * 800_000 + 11 * 25)
    assert got["written"] == pytest.approx(800_000)
    with pytest.raises(ValueError, match="runs"):
        model.fit_counts([fake(128, 2), fake(256, 4), fake(384, 6)], 10, 1)
    # Four runs: B's share from two steps at one small S, where a kernel's grid (and so its
    # per-launch work) may still grow with S: that part must not leak into the per-S rate.
    small = [fake(64, 2), fake(64, 4)]
    for r in small:
        r["kernels"]["k"]["read"] += 1000         # what an unsaturated grid adds at S = 64
    got = model.fit_counts(small + [fake(320, 2), fake(640, 4)], 800_000, 25)["k"]
    assert got["read"] == pytest.approx(7 + 5 * 800_000 + 11 * 25)
    assert got["launches"] == pytest.approx(3 + 2 * 25)
    with pytest.raises(ValueError, match="runs"):
        model.fit_counts([fake(64, 2), fake(128, 4), fake(320, 2), fake(640, 4)], 10, 1)


@needs_interpreter
def test_counts_fitted_on_small_steps_match_a_counted_larger_step():
    runs = [_torch_step(64, 32), _torch_step(128, 32), _torch_step(64, 16)]
    direct = _torch_step(192, 32)                       # 6 blocks
    fitted = model.fit_counts(runs, 192, direct["blocks"])
    for key in ("aten:mm[fp32]", "aten:addmm_[fp32]", "triton:_sgd_rows_kernel", "aten:mul_"):
        for q in ("launches", "flops", "read", "written"):
            assert fitted[key][q] == pytest.approx(direct["kernels"][key][q], rel=1e-9, abs=1e-6), (key, q)
    total = lambda ks: sum(r["read"] + r["written"] for r in ks.values())
    assert total(fitted) == pytest.approx(total(direct["kernels"]), rel=0.02)


# --------------------------------------------------------------------- the time rule
H100, A100 = model.GPUS["h100"], model.GPUS["a100"]


def _counts(kind="triton", **kw):
    base = dict(kind=kind, dtype="bfloat16", launches=1, flops=0, read=0, written=0, unique_read=0,
                unique_written=0, programs=10_000)
    base.update(kw)
    return base


def test_time_is_the_largest_bound_plus_launches():
    launch = H100["launch_s"]
    # 8 FLOP/B through L2 with mma.sync at d = 512: L2 bound.
    c = _counts(flops=8e11, read=1e11, unique_read=1e9)
    t = model.kernel_time(c, H100, {"hmma": 10, "regs": 128, "shared": 0, "num_warps": 8})
    assert t["bound"] == "L2" and t["mma"] == "mma.sync"
    assert t["seconds"] == pytest.approx(1e11 / H100["l2"] + launch)
    # A product-heavy kernel: mma.sync runs at half the tensor rate on sm_90, all of it on sm_80.
    c = _counts(flops=1e13, read=1e9, unique_read=1e9)
    hmma = {"hmma": 10}
    assert model.kernel_time(c, H100, hmma)["seconds"] == pytest.approx(1e13 / (H100["gemm"] / 2) + launch)
    assert model.kernel_time(c, H100, {"hgmma": 10})["seconds"] == pytest.approx(1e13 / H100["gemm"] + launch)
    assert model.kernel_time(c, A100, hmma)["seconds"] == pytest.approx(1e13 / A100["gemm"] + launch)
    assert model.kernel_time(c, H100, {"ffma": 10})["seconds"] == pytest.approx(1e13 / H100["fma"] + launch)
    # Distinct bytes bound by HBM.
    c = _counts(read=1e10, unique_read=1e10)
    assert model.kernel_time(c, H100, {})["bound"] == "HBM"
    # A grid of 33 programs on 132 SMs runs at a quarter of the rates.
    c = _counts(read=1e10, unique_read=1e10, programs=33)
    assert model.kernel_time(c, H100, {})["seconds"] == pytest.approx(4 * 1e10 / H100["hbm"] + launch)
    # Many tiny launches: launch bound.
    c = _counts(kind="elementwise", launches=100, read=1000, written=1000)
    t = model.kernel_time(c, H100)
    assert t["bound"] == "launch" and t["seconds"] == pytest.approx(100 * launch + 2000 / H100["hbm"])
    # cuBLAS: bf16 at the GEMM rate, float32 (no TF32) at the SGEMM rate.
    c = _counts(kind="gemm", flops=1e12, read=1e6)
    assert model.kernel_time(c, H100)["seconds"] == pytest.approx(1e12 / H100["gemm"] + launch)
    c["dtype"] = "float32"
    assert model.kernel_time(c, H100)["seconds"] == pytest.approx(1e12 / H100["sgemm"] + launch)


def test_floor_and_occupancy():
    assert model.floor_time(800_000, 2048, 512, H100) == pytest.approx(
        6 * 2048 * 800_000 * 512 / 700e12 + 20 * 800_000 * 512 / 2.9e12)
    # 128 registers x 256 threads = 32768 of 65536: 2 CTAs; 100 KB of shared memory: 2; warps: 8.
    assert model.occupancy({"regs": 128, "shared": 100_000, "num_warps": 8}, H100) == 2
    # 64 registers x 128 threads: 8 CTAs by registers (16 by warps).
    assert model.occupancy({"regs": 64, "shared": 0, "num_warps": 4}, H100) == 8
    assert model.occupancy({"regs": 32, "shared": 300_000, "num_warps": 4}, H100) == 0


def test_compare_flags_kernels_off_by_more_than_the_factor():
    rows = model.compare({"a": 1.0, "b": 3.0, "c": 0.4, "d": 1e-6}, {"a": 1.9, "b": 1.0, "c": 0.2, "e": 1e-6},
                         factor=2.0, min_seconds=1e-3)
    by = {r["kernel"]: r for r in rows}
    assert by["a"]["ok"] and by["c"]["ok"]
    assert not by["b"]["ok"] and by["b"]["ratio"] == pytest.approx(3.0)
    assert by["d"]["ok"] and by["e"]["ok"] and by["d"]["ratio"] is None      # negligible, one side only
    with pytest.raises(ValueError, match="factor"):
        model.compare({}, {}, factor=1.0)


# --------------------------------------------------------------------- the self-check's parts
def test_selfcheck_groups_profiler_rows_and_predictions_alike():
    from ds_pfc.bench import selfcheck
    events = [("aten::mm", False, 0.010), ("aten::addmm_", False, 0.002), ("aten::mul_", False, 0.003),
              ("aten::copy_", False, 0.001), ("_lse_kernel", True, 0.030), ("_lse_kernel", True, 0.001),
              ("sm90_xmma_gemm_bf16", True, 0.012), ("void at::native::kernel", True, 0.004),
              ("aten::linear", False, 0.0)]
    got = selfcheck.group_measured(events, {"_lse_kernel", "_grad_w_kernel"})
    assert got == pytest.approx({"torch GEMMs": 0.012, "torch other ops": 0.004, "triton:_lse_kernel": 0.031})
    pred = {"kernels": [{"kernel": "aten:mm[bf16]", "seconds": 0.01}, {"kernel": "aten:addmm_[fp32]", "seconds": 0.001},
                        {"kernel": "aten:mul_", "seconds": 0.002}, {"kernel": "triton:_lse_kernel", "seconds": 0.03}]}
    assert model.group_predicted(pred) == pytest.approx(
        {"torch GEMMs": 0.011, "torch other ops": 0.002, "triton:_lse_kernel": 0.03})
    assert model.gpu_model_key("NVIDIA H100 80GB HBM3") == "h100"
    assert model.gpu_model_key("NVIDIA H200") == "h200"
    assert model.gpu_model_key("NVIDIA A100-SXM4-80GB") == "a100"
    assert model.gpu_model_key("NVIDIA L4") is None


def test_selfcheck_case_is_the_standard_rank_or_as_much_as_fits():
    from ds_pfc.bench import selfcheck
    case = selfcheck.fitting_case(78 << 30)
    assert case["classes"] == 8_000_000 and case["batch"] == 2048 and case["dim"] == 512
    small = selfcheck.fitting_case(24 << 30)
    rows = small["classes"] * small["sample_rate"]
    table = 8 * 512 * small["classes"]                          # weight and momentum
    assert 100_000 < rows < 800_000 and table + 24 * 512 * rows <= 0.7 * (24 << 30)
    with pytest.raises(RuntimeError, match="free"):
        selfcheck.fitting_case(1 << 30)


def test_logsumexp_counts_the_passes_cuda_makes():
    x = torch.randn(100, 8)
    with model.CostCounter() as c:
        torch.logsumexp(x, dim=0)
    rec = c.kernels()["aten:logsumexp"]
    # amax (read), x - max (read, write), exp_ (read, write), sum (read), then [8]-sized ops.
    assert rec["read"] == 4 * 100 * 8 * 4 and rec["written"] == 2 * 100 * 8 * 4 + 8 * 4
    assert rec["launches"] == 7


def test_grids_agree_when_each_dimension_stays_or_scales():
    assert model._grids_agree({"k": [(4, 5, 1)], "w": [(10, 2, 1)]}, {"k": [(4, 5, 1)], "w": [(20, 2, 1)]}, 2)
    assert not model._grids_agree({"k": [(32, 10, 1)]}, {"k": [(32, 14, 1)]}, 2)      # splits still growing
    assert not model._grids_agree({"k": [(4, 5, 1)]}, {"k": [(4, 5, 1)], "j": [(1, 1, 1)]}, 2)


@needs_interpreter
def test_the_counted_sizes_lie_where_the_triton_grids_have_settled():
    # N = 2048, d = 128 on 132 SMs: the forward's class split aims at 33 (4 waves of 16 sample
    # tiles) and hands out units of 4 x 64 classes, so it grows with S up to S = 33 * 256; the
    # search stops at S = 4096 and says so (only the [splits, N] partials are extrapolated from
    # below saturation; FLOPs and operand loads are linear in S at any split). Every other grid
    # stays or grows with S.
    case = dict(batch=2048, dim=128, sample_rate=0.1, compute="bf16", embeddings="fp32", backend="triton",
                world=8, S=800_000)
    (s0, r0), (s1, r1), (s2, _), (s3, _) = model._standard_runs(case)
    assert s0 == s1 and r0 != r1 and s3 == 2 * s2 >= 640
    grids = lambda S, rate=0.1: model.count_step(S, batch=2048, dim=128, sample_rate=rate, compute="bf16",
                                                 backend="triton", block_rows=S // 2, world=8, grids_only=True)
    small, large, probe = grids(s2), grids(s3), grids(1 << 16, 1.0)
    splits = [g["_lse_kernel"][0][1] for g in (small, large, probe)]
    def expected(S):        # ds_pfc.kernels.triton_softmax._split with 132 SMs and 16 sample tiles
        units = -(-S // 256)
        per = -(-units // min(units, 33))
        return -(-units // per)
    assert splits == [expected(s2), expected(s3), expected(1 << 16)]
    # (The sampler's key kernel covers C_q + 1 keys in blocks of 1024: it grows with S up to rounding.)
    others = lambda g: {k: v for k, v in g.items() if k not in ("_lse_kernel", "_keys_kernel")}
    assert model._grids_agree(others(small), others(large), 2)


def test_selfcheck_reuses_saved_counts_only_for_the_same_case_and_sm_count(tmp_path):
    """The model check takes op counts from a --predict JSON only when the case and the SM
    count match exactly; anything else is counted afresh (None here)."""
    import json

    from ds_pfc.bench.model import saved_counts as _saved_counts
    from ds_pfc.bench.selfcheck import fitting_case
    case = dict(fitting_case(139 << 30), backend="triton")
    counts = [{"S": 1, "kernels": {}}]
    path = tmp_path / "predict.json"
    path.write_text(json.dumps({"gpu_constants": {"sms": 132},
                                "results": [{"case": dict(case, backend="torch"), "counts": [{"other": 1}]},
                                            {"case": case, "counts": counts}]}))
    assert _saved_counts(str(path), case, 132) == counts
    assert _saved_counts(str(path), dict(case, backend="torch"), 132) == [{"other": 1}]
    assert _saved_counts(str(path), case, 108) is None
    assert _saved_counts(str(path), dict(case, classes=case["classes"] + 1), 132) is None
    assert _saved_counts(None, case, 132) is None
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    shipped = os.path.join(root, "benchmarks", "results", "predict-h200-d512-s800k-k1.json")
    assert _saved_counts(shipped, case, 132), "the shipped counts no longer match the selfcheck's case"


# --------------------------------------------------------------------- the calibrated model
# The measured H200 step (benchmarks/results/gpu-h200-20261126.json) against the model
# calibrated by it; the prediction side takes the committed op counts of that case.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
STEP_TOL, KERNEL_TOL = 0.10, 0.15


def _load(name):
    import json
    with open(os.path.join(RESULTS, name)) as f:
        return json.load(f)


def _measured_runs(backend):
    """Per run of the committed measurement: group -> seconds (``step`` included), read directly."""
    runs = _load("gpu-h200-20261126.json")["model_check"]["runs"]
    return [{r["kernel"]: r["measured_s"] for r in run[backend]} for run in runs.values()]


def _prediction(case, gpu, counts_file):
    from ds_pfc.bench.model import saved_counts as _saved_counts
    counts = _saved_counts(os.path.join(RESULTS, counts_file), case, model.GPUS[gpu]["sms"])
    assert counts, f"{counts_file} holds no counts of {case}"
    return model.predict_case(case, gpu, counts=counts, compile_code=False)


@pytest.fixture(scope="module")
def calibrated():
    """(calibration, {backend: roofline prediction of the measured case on the H200})."""
    from ds_pfc.bench import calibration
    cal = calibration.load_calibration()
    case = _load("gpu-h200-20261126.json")["model_check"]["case"]
    preds = {b: _prediction(dict(case, backend=b), "h200", "predict-h200-d512-s800k-k1.json")
             for b in ("torch", "triton")}
    return cal, preds


def _off(pred, want):
    return abs(pred / want - 1)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_the_calibrated_model_reproduces_the_measured_h200_step(calibrated, backend):
    from ds_pfc.bench import calibration
    cal, preds = calibrated
    cpred = calibration.calibrated_prediction(preds[backend], cal)
    assert cpred["calibration"]["source"] == "benchmarks/results/gpu-h200-20261126.json"
    assert cpred["calibration"]["date"] == "2026-11-26" and cpred["calibration"]["estimate"] is False
    for run in _measured_runs(backend):            # 25.8 and 26.3 ms (triton)
        assert _off(cpred["step_s"], run["step"]) < STEP_TOL, (cpred["step_s"], run["step"])
        # The roofline model does not: 18.0 ms against 25.8-26.3 (triton), 58.5 against 68 (torch).
        assert _off(preds[backend]["step_s"], run["step"]) > STEP_TOL
    if backend != "triton":
        return
    runs = _measured_runs("triton")
    got = calibration.groups(cpred)
    for key in runs[0]:
        want = sum(r[key] for r in runs) / len(runs)
        assert _off(got[key], want) < KERNEL_TOL, (key, got[key], want)
    idle = sum(r["step"] - sum(v for k, v in r.items() if k != "step") for r in runs) / len(runs)
    assert 1.2e-3 < idle < 2.0e-3 and _off(got["idle"], idle) < KERNEL_TOL
    # Per kernel the roofline is off by more than the tolerance for G, forward, dW and prepare.
    roof = calibration.groups(preds["triton"])
    for key in ("triton:_g_kernel", "triton:_lse_kernel", "triton:_dw_kernel", "triton:_prep_kernel"):
        assert _off(roof[key], sum(r[key] for r in runs) / len(runs)) > KERNEL_TOL, key


@pytest.mark.parametrize("term", ["triton:_g_kernel", "triton:_lse_kernel", "triton:_dw_kernel",
                                  "triton:_prep_kernel", "idle", "launch", "topk"])
def test_dropping_a_calibrated_term_breaks_the_reproduction(calibrated, term):
    from ds_pfc.bench import calibration
    cal, preds = calibrated
    runs = _measured_runs("triton")
    want = {k: sum(r[k] for r in runs) / len(runs) for k in runs[0]}
    want["idle"] = want["step"] - sum(v for k, v in want.items() if k != "step")
    got = calibration.groups(calibration.calibrated_prediction(preds["triton"], cal, without=(term,)))
    worst = max(_off(got[k], want[k]) / (STEP_TOL if k == "step" else KERNEL_TOL) for k in want)
    assert worst > 1, f"without {term} the step and every kernel still lie within tolerance"
    with pytest.raises(ValueError, match="without"):
        calibration.calibrated_prediction(preds["triton"], cal, without=("gemm",))


def test_the_calibration_is_read_from_the_measured_json(calibrated, tmp_path):
    import json

    from ds_pfc.bench import calibration
    cal, preds = calibrated
    # The efficiencies are the counted work over the measured time and rates of the JSON.
    assert cal.gemm_rate == _load("gpu-h200-20261126.json")["ceilings_measured"]["bf16_gemm_8192_flops_per_s"]
    assert 0.2 < cal.matrix["triton:_g_kernel"] < 0.3 and 0.9 < cal.matrix["cublas:triton"] <= 1.0
    assert 0.9 < cal.stream["triton:_sgd_rows_kernel"] <= 1.0 and 0 < cal.launch_s < 1e-5
    # A JSON in which the G kernel took twice as long halves its efficiency and doubles its time.
    doc = _load("gpu-h200-20261126.json")
    for run in doc["model_check"]["runs"].values():
        rows = {r["kernel"]: r for r in run["triton"]}
        rows["step"]["measured_s"] += rows["triton:_g_kernel"]["measured_s"]
        rows["triton:_g_kernel"]["measured_s"] *= 2
    slow = tmp_path / "slow-g.json"
    slow.write_text(json.dumps(doc))
    other = calibration.load_calibration(str(slow))
    # (13 launches of a few us stay out of the efficiency: not exactly half)
    assert other.matrix["triton:_g_kernel"] == pytest.approx(cal.matrix["triton:_g_kernel"] / 2, rel=5e-3)
    assert other.idle_s == pytest.approx(cal.idle_s)
    g = lambda c: calibration.groups(calibration.calibrated_prediction(preds["triton"], c))["triton:_g_kernel"]
    assert g(other) == pytest.approx(2 * g(cal), rel=1e-3)
    assert calibration.calibrated_prediction(preds["triton"], other)["calibration"]["source"] == str(slow)
    # Bad inputs name the argument.
    del doc["ceilings_measured"]
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="path"):
        calibration.load_calibration(str(broken))
    with pytest.raises(FileNotFoundError, match="counts"):
        calibration.load_calibration(counts=str(tmp_path / "none.json"))


def test_topk_and_sort_come_from_a_timing_json_when_given(calibrated, tmp_path):
    import json

    from ds_pfc.bench import calibration
    cal, preds = calibrated
    assert cal.select_source == "estimate"
    timing = tmp_path / "timing.json"
    sampler = {"classes_per_rank": 8_000_000, "size": 800_000, "topk_s": 0.32e-3, "sort_s": 0.06e-3}
    timing.write_text(json.dumps({"gpu": "NVIDIA_H200", "sampler": sampler}))
    timed = calibration.load_calibration(timing=str(timing))
    assert timed.topk_per_key_s == pytest.approx(0.32e-3 / 8_000_000)
    assert timed.sort_per_key_s == pytest.approx(0.06e-3 / 800_000)
    cpred = calibration.calibrated_prediction(preds["triton"], timed)
    assert cpred["calibration"]["topk_sort"] == str(timing)
    rows = {r["kernel"]: r["seconds"] for r in cpred["kernels"]}
    assert rows["aten:topk"] == pytest.approx(0.32e-3) and rows["aten:sort"] == pytest.approx(0.06e-3)
    # The other ops still sum to what was measured: launch and aten streaming take up the rest.
    got = calibration.groups(cpred)["torch other ops"]
    assert got == pytest.approx(cal.measured["triton"]["torch other ops"], rel=1e-9)
    # A topk that leaves no time for the other ops' launches is refused.
    timing.write_text(json.dumps({"gpu": "NVIDIA_H200", "sampler": dict(sampler, topk_s=1e-3)}))
    with pytest.raises(ValueError, match="launch"):
        calibration.load_calibration(timing=str(timing))
    timing.write_text(json.dumps({"gpu": "NVIDIA_H100_80GB_HBM3", "sampler": sampler}))
    with pytest.raises(ValueError, match="timing"):
        calibration.load_calibration(timing=str(timing))
    timing.write_text(json.dumps({"gpu": "NVIDIA_H200", "sampler": {"error": "OutOfMemoryError"}}))
    with pytest.raises(ValueError, match="timing"):
        calibration.load_calibration(timing=str(timing))


def test_the_calibration_carries_to_the_h100_as_an_estimate(calibrated):
    from ds_pfc.bench import calibration
    cal, _ = calibrated
    pred = _prediction(dict(model.STANDARD_CASE), "h100", "predict-h100-d512-fp32emb-triton.json")
    h100 = calibration.calibrated_prediction(pred, cal)
    assert h100["calibration"]["estimate"] is True and h100["calibration"]["gpu"] == "h200"
    h200 = calibration.calibrated_prediction(dict(pred, gpu="h200"), cal)
    assert h200["calibration"]["estimate"] is False
    a, b = calibration.groups(h100), calibration.groups(h200)
    # The same tensor-core peak: the products take the same time; memory passes scale with HBM.
    for key in ("triton:_g_kernel", "triton:_dw_kernel", "torch GEMMs"):
        assert a[key] == pytest.approx(b[key], rel=1e-9)
    # The forward's products and per-logit work too; its written bytes (the store term) scale with HBM.
    written = model.fit_case(pred["case"], pred["counts"])["triton:_lse_kernel"]["unique_written"]
    copy = _load("gpu-h200-20261126.json")["ceilings_measured"]["device_copy_bytes_per_s"]
    ratio = model.GPUS["h100"]["hbm_peak"] / model.GPUS["h200"]["hbm_peak"]
    assert a["triton:_lse_kernel"] - b["triton:_lse_kernel"] == pytest.approx(
        written / (copy * ratio) - written / copy, rel=1e-6)
    hbm = model.GPUS["h200"]["hbm_peak"] / model.GPUS["h100"]["hbm_peak"]
    sgd = cal.launch_s
    assert a["triton:_sgd_rows_kernel"] - sgd == pytest.approx((b["triton:_sgd_rows_kernel"] - sgd) * hbm, rel=1e-9)
    assert 1.02 < h100["step_s"] / h200["step_s"] < 1.15
    with pytest.raises(ValueError, match="gpu_name"):
        calibration.calibrated_prediction(pred, cal, "a100")


@pytest.mark.parametrize("counts_file,backend,classes,rate", [
    ("predict-h200-n512-d512-s800k-k1.json", "triton", 8_000_000, 0.1),
    ("predict-h200-n512-d512-s800k-k1.json", "torch", 8_000_000, 0.1),
    ("predict-h200-n512-d512-s1600k-k1.json", "triton", 16_000_000, 0.1),
    ("predict-h200-n512-d512-s400k-c16m-k1.json", "triton", 16_000_000, 0.025),
    ("predict-h200-n512-d512-s100k-k1.json", "triton", 1_000_000, 0.1)])
def test_the_calibration_predicts_steps_it_was_not_fitted_to(calibrated, counts_file, backend, classes, rate):
    """The head benchmark at N = 512 (benchmarks/results/head-h200-n512-20261126.json). It times
    forward, backward and update each between two device syncs, three host round trips where
    the calibrated step has one: both predictions lie below it, the calibrated one by less than
    half the roofline's error, and within the kernel tolerance from S = 400k up."""
    from ds_pfc.bench import calibration
    cal, _ = calibrated
    bench = _load("head-h200-n512-20261126.json")
    row = next(r for r in bench["results"] if r["impl"] == "ds_pfc" and r["backend"] == backend
               and r["classes"] == classes and r["sample_rate"] == rate)
    case = dict(world=1, classes=classes, sample_rate=rate, batch=512, dim=512, compute="bf16", embeddings="fp32",
                backend=backend, block_bytes=None)
    pred = _prediction(case, "h200", counts_file)
    cpred = calibration.calibrated_prediction(pred, cal)
    measured = row["step"]["median"]
    calibrated_off, roofline_off = cpred["step_s"] / measured - 1, pred["step_s"] / measured - 1
    assert roofline_off < calibrated_off < 0 and abs(calibrated_off) < abs(roofline_off) / 2
    if pred["S"] >= 400_000:
        assert abs(calibrated_off) < KERNEL_TOL < abs(roofline_off)


def test_predict_prints_measured_calibrated_roofline_and_floor(tmp_path, capsys):
    import json
    out = tmp_path / "p.json"
    # The measured step recomputed its cosines in backward (keep_bytes=0 today).
    argv = ["--predict", "h200", "--world", "1", "--classes", "8000000", "--backend", "triton", "--no-compile",
            "--keep-bytes", "0", "--counts", os.path.join(RESULTS, "predict-h200-d512-s800k-k1.json"),
            "--out", str(out)]
    assert predict.main(argv) == 0
    text = capsys.readouterr().out
    assert "calibrated by benchmarks/results/gpu-h200-20261126.json (2026-11-26" in text
    header = next(line for line in text.splitlines() if "measured" in line and "roofline" in line)
    assert header.split() == ["ms", "measured", "calibrated", "roofline", "floor", "part", "floor", "part",
                              "(measured", "rates)"]
    # Both floors: the formula at the model's assumed rates and at the rates the H200 measured.
    n, s, d = 2048, 800_000, 512
    ceilings = _load("gpu-h200-20261126.json")["ceilings_measured"]
    assumed = 6 * n * s * d / 700e12 + 20 * s * d / 4.2e12
    measured_rates = (6 * n * s * d / ceilings["bf16_gemm_8192_flops_per_s"]
                      + 20 * s * d / ceilings["device_copy_bytes_per_s"])
    step, roof = 0.02605, 0.01796
    for label, f in (("x floor (assumed rates)", assumed), ("x floor (measured rates)", measured_rates)):
        line = next(x for x in text.splitlines() if x.strip().startswith(label)).split()
        want = [step / f, step / f, roof / f, assumed / f, measured_rates / f]
        assert [float(v) for v in line[-5:]] == pytest.approx(want, abs=0.011), label
    assert "out-of-sample error of this calibration: -4% to -27%" in text
    result = json.loads(out.read_text())["results"][0]
    assert result["calibrated"]["calibration"]["source"] == "benchmarks/results/gpu-h200-20261126.json"
    assert result["measured"]["step"] == pytest.approx(0.02605, rel=1e-3)
    # The H100: an estimate, no measurement; the calibration can be turned off.
    argv = ["--predict", "h100", "--backend", "triton", "--no-compile", "--out", str(out), "--keep-bytes", "0",
            "--counts", os.path.join(RESULTS, "predict-h100-d512-fp32emb-triton.json")]
    assert predict.main(argv) == 0
    assert "ESTIMATE carried from the H200 calibration" in capsys.readouterr().out
    assert predict.main(argv + ["--calibration", "none"]) == 0
    assert "calibrated" not in capsys.readouterr().out
    assert "calibrated" not in json.loads(out.read_text())["results"][0]


def test_kept_cosine_step_counts_three_products_and_is_calibrated_conservatively():
    """The default triton step of the standard rank keeps its cosines (3.3 GB within 4 GiB):
    its counted products are exactly the forward's and cuBLAS's dX and dW (6 N S d FLOPs, no
    recompute kernel), and the calibrated prediction prices its two new streaming passes at
    the least efficient streaming rate the H200 run showed, below the measured step. The
    centers' gradient is projected in the row update (ds_pfc's own SGD): no projection pass."""
    import json
    from ds_pfc.bench import calibration
    doc = json.load(open(os.path.join(RESULTS, "predict-h200-d512-s800k-k1-kept.json")))
    res = doc["results"][0]
    assert res["case"]["cosines"] == "kept"
    pred = model.predict_case(res["case"], "h200", counts=res["counts"], compile_code=False)
    flops = {r["kernel"]: r["flops"] for r in pred["kernels"] if r["flops"]}
    n, s, d = 2048, 800_000, 512
    assert set(flops) == {"triton:_lse_kernel", "aten:mm[bf16]"}
    assert flops["triton:_lse_kernel"] == pytest.approx(2 * n * s * d, rel=1e-3)
    assert flops["aten:mm[bf16]"] == pytest.approx(4 * n * s * d, rel=1e-3)
    cal = calibration.load_calibration()
    out = calibration.calibrated_prediction(pred, cal)
    rules = {r["kernel"]: r["rule"] for r in out["kernels"]}
    worst = min(v for k, v in cal.stream.items() if k.startswith("triton:"))
    assert rules["triton:_g_pass_kernel"].startswith(f"not calibrated: {worst:.1%}"), rules["triton:_g_pass_kernel"]
    assert "triton:_project_kernel" not in rules
    assert out["step_s"] < 0.8 * cal.measured["triton"]["step"]
    # The measured case is the recompute path: its prediction is not compared with this one.
    assert calibration.measured_groups(cal, "h200", res["case"]) is None


def test_calibration_takes_each_backends_case_from_the_run(tmp_path):
    """A self-check run names each backend's exact case (``model_check.cases``): a triton step
    that kept its cosines is fitted with the kept path's counts, and only a kept prediction is
    compared with its measurement."""
    import json
    from ds_pfc.bench import calibration
    doc = json.load(open(os.path.join(RESULTS, "gpu-h200-20261126.json")))
    kept = json.load(open(os.path.join(RESULTS, "predict-h200-d512-s800k-k1-kept.json")))
    old = json.load(open(os.path.join(RESULTS, "predict-h200-d512-s800k-k1.json")))
    torch_result = next(r for r in old["results"] if r["case"]["backend"] == "torch")
    counts = dict(kept, results=[torch_result, kept["results"][0]])
    doc["model_check"]["cases"] = {"triton": kept["results"][0]["case"]}
    (tmp_path / "run.json").write_text(json.dumps(doc))
    (tmp_path / "counts.json").write_text(json.dumps(counts))
    cal = calibration.load_calibration(str(tmp_path / "run.json"), str(tmp_path / "counts.json"))
    assert cal.triton_cosines == "kept"
    case = kept["results"][0]["case"]
    assert calibration.measured_groups(cal, "h200", case) is not None
    assert calibration.measured_groups(cal, "h200", dict(case, cosines="recompute")) is None
    base = calibration.load_calibration()
    assert base.triton_cosines == "recompute"
    assert calibration.measured_groups(base, "h200", case) is None


def _measured_mean(kernel):
    runs = _measured_runs("triton")
    return sum(r[kernel] for r in runs) / len(runs)


def _kept(dim):
    import json
    doc = json.load(open(os.path.join(RESULTS, f"predict-h200-d{dim}-s800k-k1-kept.json")))
    res = doc["results"][0]
    return model.predict_case(res["case"], "h200", counts=res["counts"], compile_code=False)


@pytest.mark.parametrize("gpu", ["h200", "h100"])
def test_the_floor_is_given_at_the_measured_rates_beside_the_assumed_ones(calibrated, gpu):
    """6 N S d FLOPs + 20 S d bytes, at the model's assumed rates (700 TF/s, 4.2 or 2.9 TB/s) and
    at the H200's measured GEMM and copy rates (on the H100 scaled by the data-sheet peaks)."""
    from ds_pfc.bench import calibration
    cal, _ = calibrated
    ceilings = _load("gpu-h200-20261126.json")["ceilings_measured"]
    gemm, copy = ceilings["bf16_gemm_8192_flops_per_s"], ceilings["device_copy_bytes_per_s"]
    assert 7.8e14 < gemm < 7.9e14 and 4.2e12 < copy < 4.3e12
    if gpu == "h100":
        copy *= 3.35 / 4.8
    pred = _kept(512)
    out = calibration.calibrated_prediction(pred, cal, gpu)
    n, s = 2048, 800_000
    for d in (512, 256, 128):
        want = 6 * n * s * d / gemm + 20 * s * d / copy
        assert calibration.measured_floor(cal, gpu, s, n, d) == pytest.approx(want, rel=1e-9)
    assumed = 6 * n * s * 512 / 700e12 + 20 * s * 512 / (4.2e12 if gpu == "h200" else 2.9e12)
    assert out["floor_s"] == pytest.approx(assumed, rel=1e-9)
    assert out["floor_measured_s"] == pytest.approx(6 * n * s * 512 / gemm + 20 * s * 512 / copy, rel=1e-9)
    assert out["x_floor_measured"] == pytest.approx(out["step_s"] / out["floor_measured_s"], rel=1e-9)
    if gpu == "h200":     # 9.14 vs 8.35 ms: the measured-rate floor is the lower one
        assert out["floor_measured_s"] < 0.93 * out["floor_s"]


@pytest.mark.parametrize("dim", [512, 256, 128])
def test_the_kept_forward_is_products_plus_a_fixed_cost_per_logit_plus_its_store(calibrated, dim):
    """The forward measured at d = 512 (recomputing, nothing stored) less its launches is split
    into products (scaling with d) and FORWARD_FIXED_SHARE of fixed per-logit work (not
    scaling); the kept forward adds its stored bytes at STORE_EFFICIENCY of the copy rate. The
    arithmetic here is written from the measured JSON and the counts, not from the code."""
    from ds_pfc.bench import calibration
    cal, preds = calibrated
    assert calibration.FORWARD_FIXED_SHARE == pytest.approx(0.98 / 4.53)
    assert calibration.STORE_EFFICIENCY == 1.0
    copy = _load("gpu-h200-20261126.json")["ceilings_measured"]["device_copy_bytes_per_s"]
    measured = _measured_case_counts(preds)
    rest = _measured_mean("triton:_lse_kernel") - measured["launches"] * cal.launch_s \
        - measured["unique_written"] / copy
    mma0, fixed0 = (1 - 0.98 / 4.53) * rest, 0.98 / 4.53 * rest
    n, s = 2048, 800_000
    pred = _kept(dim)
    fitted = model.fit_case(pred["case"], pred["counts"])["triton:_lse_kernel"]
    assert fitted["unique_written"] >= 2 * n * s          # the float16 cosines
    want = mma0 * dim / 512 + fixed0 + fitted["unique_written"] / copy + fitted["launches"] * cal.launch_s
    got = calibration.groups(calibration.calibrated_prediction(pred, cal))["triton:_lse_kernel"]
    assert got == pytest.approx(want, rel=2e-3)
    # Constant efficiency (the rule before these terms) would give less at every d, far less at d = 128.
    constant = 2 * n * s * dim / (cal.matrix["triton:_lse_kernel"] * cal.gemm_rate)
    assert got > constant + 0.7e-3 + (0.7e-3 if dim == 128 else 0.0)


def _measured_case_counts(preds):
    return model.fit_case(preds["triton"]["case"], preds["triton"]["counts"])["triton:_lse_kernel"]


def test_the_kept_steps_dw_product_runs_at_90_percent_of_cuBLAS_at_the_dx_shape(calibrated):
    from ds_pfc.bench import calibration
    cal, _ = calibrated
    assert calibration.DW_CUBLAS_SHARE == 0.90
    pred = _kept(512)
    out = calibration.calibrated_prediction(pred, cal)
    row = next(r for r in out["kernels"] if r["kernel"] == "aten:mm[bf16]")
    fitted = model.fit_case(pred["case"], pred["counts"])["aten:mm[bf16]"]
    n, s, d = 2048, 800_000, 512
    eff = cal.matrix["cublas:triton"]
    other = fitted["flops"] - 2 * n * s * d          # dX and a few N-sized products
    want = other / (eff * cal.gemm_rate) + 2 * n * s * d / (0.9 * eff * cal.gemm_rate) \
        + fitted["launches"] * cal.launch_s
    assert row["seconds"] == pytest.approx(want, rel=1e-9) and "dW at 90%" in row["rule"]
    # The recompute step has no cuBLAS dW: its products keep the measured efficiency.
    cpred = calibration.calibrated_prediction(_prediction(dict(cal.case, backend="triton"), "h200",
                                                          "predict-h200-d512-s800k-k1.json"), cal)
    assert "dW" not in next(r for r in cpred["kernels"] if r["kernel"] == "aten:mm[bf16]")["rule"]


def test_every_calibrated_prediction_carries_its_out_of_sample_error(calibrated):
    """The head benchmark at N = 512 (five steps the calibration was not fitted to): each
    error is the calibrated step over the benchmark's median, all of them under-predictions."""
    from ds_pfc.bench import calibration
    cal, _ = calibrated
    bench = _load("head-h200-n512-20261126.json")
    out = calibration.calibrated_prediction(_kept(128), cal)["out_of_sample"]
    assert out["source"] == "benchmarks/results/head-h200-n512-20261126.json" and len(out["steps"]) == 5
    for step in out["steps"]:
        c = step["case"]
        row = next(r for r in bench["results"] if r["impl"] == "ds_pfc" and r["backend"] == c["backend"]
                   and r["classes"] == c["classes"] and r["sample_rate"] == c["sample_rate"])
        assert step["measured_s"] == row["step"]["median"]
        assert step["error"] == pytest.approx(step["predicted_s"] / row["step"]["median"] - 1)
        assert step["roofline_error"] == pytest.approx(step["roofline_s"] / row["step"]["median"] - 1)
        assert step["roofline_error"] < step["error"] < 0
    assert out["max_error"] == pytest.approx(-0.04, abs=0.01) and out["min_error"] == pytest.approx(-0.27, abs=0.01)
    assert out["roofline_min_error"] == pytest.approx(-0.63, abs=0.01)


def test_a_prepare_that_now_reads_each_row_once_is_priced_as_the_row_update(calibrated):
    """The calibration measured the two-pass ``prepare`` (each row read twice: the counts of its
    own run read twice the unique bytes) at its own rate; the one-pass kernel of today's counts
    (read = unique) moves bytes as the row update does and is priced at that kernel's measured
    rate. The bytes come from the counts, the rates from the measured run."""
    from ds_pfc.bench import calibration
    cal, _ = calibrated
    old = _load("predict-h200-d512-s800k-k1.json")["results"]
    old = next(r for r in old if r["case"]["backend"] == "triton")["counts"][0]["kernels"]["triton:_prep_kernel"]
    assert old["read"] >= 1.9 * old["unique_read"]
    seconds, rule = calibration.kernel_seconds("triton:_prep_kernel", old, cal, "h200", "triton")
    assert "since" not in rule and f"{cal.stream['triton:_prep_kernel']:.1%}" in rule
    one_pass = dict(old, read=old["unique_read"])
    seconds_now, rule_now = calibration.kernel_seconds("triton:_prep_kernel", one_pass, cal, "h200", "triton")
    assert "one pass" in rule_now and f"{cal.stream['triton:_sgd_rows_kernel']:.1%}" in rule_now
    unique = old["unique_read"] + old["unique_written"]
    from ds_pfc.bench.model import GPUS
    busy = (seconds_now - old["launches"] * cal.launch_s) * calibration._fill(old, GPUS["h200"])
    assert busy == pytest.approx(unique / (cal.stream["triton:_sgd_rows_kernel"] * cal.rates("h200")["copy"]),
                                 rel=1e-6)
    assert seconds_now < seconds
