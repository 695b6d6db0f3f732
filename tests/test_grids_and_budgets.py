"""Launch grids and memory budgets of the triton backend, checked on a CPU: the forward's class
splits in whole waves of a GPU (a mocked SM count), the default keep budget as a share of the
free device memory (a mocked ``torch.cuda``), and every shipped config's choice of the kept path
at its GPU count."""
import glob
import json
import logging
import math
import os
import re

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from ds_pfc.core import softmax  # noqa: E402
from ds_pfc.kernels import _target  # noqa: E402

ts = pytest.importorskip("ds_pfc.kernels.triton_softmax")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU = torch.device("cpu")


def _tile_waves(held, splits, per, wave):
    """The grid's time in tiles: whole waves of programs, each wave as long as a split."""
    return math.ceil(held * splits / wave) * per


@pytest.mark.parametrize("sms", [132, 108, 114])
def test_forward_splits_fill_whole_waves(sms):
    """Brute force over every split count: the chosen one takes no more tile-waves than any
    split count up to twice the aim, and within 5% of the ideal (every SM busy all along) once
    there are many waves of work. 132 SMs: H100/H200; 108: A100; 114: H100 PCIe."""
    with _target.gpu_tiles(sms=sms):
        for n in (512, 1024, 2048, 4096, 8192, 24_576):
            held = math.ceil(n / 128)
            for s in (9_656, 100_000, 800_000, 1_600_000):
                stream = math.ceil(s / 512)
                splits, per = ts._split(held, stream, CPU)
                assert 1 <= splits <= stream and (splits - 1) * per < stream <= splits * per
                got = _tile_waves(held, splits, per, sms)
                aim = min(stream, math.ceil(4 * sms / held))
                for other in range(1, min(stream, 2 * aim) + 1):
                    p = math.ceil(stream / other)
                    assert got <= _tile_waves(held, math.ceil(stream / p), p, sms), (n, s, other)
                if held * stream >= 64 * sms:
                    assert got <= 1.05 * held * stream / sms, (n, s, splits, per)


def test_n4096_at_s800k_runs_whole_waves_on_132_sms():
    """32 sample tiles x 17 splits = 544 programs is 4.12 waves of 132: five waves, the last
    0.1 full. The split now gives a whole number of waves."""
    with _target.gpu_tiles(sms=132):
        splits, per = ts._split(32, math.ceil(800_000 / 512), CPU)
        assert (32 * splits) % 132 == 0 and splits != 17
        # N = 2048 was already 16 x 33 = 528 = 4 waves: unchanged.
        assert ts._split(16, math.ceil(800_000 / 512), CPU) == (33, 48)
        # Two CTAs per SM: a wave is 264 programs.
        splits, _ = ts._split(32, math.ceil(800_000 / 512), CPU, ctas_per_sm=2)
        assert (32 * splits) % 264 == 0


class _FakeCuda:
    """The part of ``torch.cuda`` the keep budget reads."""

    def __init__(self, free, reserved=0, allocated=0, capturing=False):
        self.free, self.reserved, self.allocated, self.capturing = free, reserved, allocated, capturing
        self.calls = 0

    def install(self, monkeypatch):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: self.capturing)
        monkeypatch.setattr(torch.cuda, "mem_get_info", self._info)
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: self.reserved)
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: self.allocated)
        monkeypatch.setattr(softmax, "_keep_budgets", {})
        return self

    def _info(self, device=None):
        self.calls += 1
        return self.free, 80 << 30


def test_keep_budget_is_half_the_free_device_memory(monkeypatch):
    assert softmax.cosine_keep_bytes("cpu") == 4 << 30
    assert softmax.default_keep_bytes("triton", None) == 4 << 30
    fake = _FakeCuda(free=20 << 30, reserved=6 << 30, allocated=4 << 30).install(monkeypatch)
    # free + (reserved - allocated): what the caching allocator holds unused is free to torch.
    want = (20 + 6 - 4) * (1 << 30) // 2
    assert softmax.cosine_keep_bytes("cuda") == want
    assert softmax.default_keep_bytes("triton", None, "cuda:0") == want
    assert softmax.default_keep_bytes("triton", 123, "cuda") == 123          # block_bytes given
    assert softmax.default_keep_bytes("torch", None, "cuda") == softmax.KEEP_BYTES
    # N = 4096 at S = 800k (6.55 GB of float16 cosines) now keeps where 4 GiB did not.
    assert not softmax.keeps_cosines(4096, 800_000, torch.bfloat16, 4 << 30)
    assert softmax.keeps_cosines(4096, 800_000, torch.bfloat16, want)
    # While a CUDA graph is captured: the last budget, without asking the device.
    fake.capturing, fake.free, calls = True, 1 << 30, fake.calls
    assert softmax.cosine_keep_bytes("cuda") == want and fake.calls == calls


def test_a_step_that_recomputes_says_why_once(caplog):
    caplog.set_level(logging.INFO, logger="ds_pfc.core.softmax")
    n, s = 4096, 800_000
    assert softmax.say_why_recompute(n, s, torch.bfloat16, n * s * 2) is None
    assert not caplog.records
    for _ in range(3):
        line = softmax.say_why_recompute(n, s, torch.bfloat16, (4 << 30) + 7)
    assert [r.getMessage() for r in caplog.records] == [line]
    assert "4096 x 800000" in line and "6.55 GB" in line and "4.29 GB" in line


def _configs():
    for path in sorted(glob.glob(os.path.join(ROOT, "configs", "*.json"))):
        name = os.path.basename(path)
        match = re.search(r"_(\d+)gpu", name)
        yield name, json.load(open(path)), int(match.group(1)) if match else 1


# The free device memory assumed at the head's forward for every shipped config: 16 GiB of an
# 80 GB GPU (the backbone's activations, its optimizer state and the head's bank hold the rest).
ASSUMED_FREE = 16 << 30


@pytest.mark.parametrize("name,config,gpus", list(_configs()), ids=lambda v: v if isinstance(v, str) else "")
def test_every_shipped_config_keeps_its_cosines_at_its_gpu_count(monkeypatch, caplog, name, config, gpus):
    """Each config's triton step on CUDA (bf16 products, ``compute_dtype`` auto or bf16): the
    gathered batch (micro batch x GPUs) times its rank's active classes, in float16, within the
    default budget, so it stays on the kept path and logs nothing."""
    head = config["ds_pfc"]["head"]
    assert head.get("compute_dtype") in (None, "auto", "bf16")
    n = config["train_micro_batch_size_per_gpu"] * gpus
    s = max(math.floor(head.get("sample_rate", 1.0) * math.ceil(head["num_classes"] / gpus) + 1e-9), 1)
    _FakeCuda(free=ASSUMED_FREE).install(monkeypatch)
    budget = head.get("keep_bytes")
    if budget is None:
        budget = softmax.default_keep_bytes("triton", head.get("block_bytes"), "cuda")
    assert budget == (ASSUMED_FREE // 2 if head.get("block_bytes") is None else head["block_bytes"])
    caplog.set_level(logging.INFO, logger="ds_pfc.core.softmax")
    assert n * s * 2 <= ASSUMED_FREE // 2, f"{name}: {n} x {s} cosines do not fit"
    assert softmax.say_why_recompute(n, s, torch.bfloat16, budget) is None
    assert not caplog.records


# Every specialisation of the forward kernel that lse_stats launches, compiled for Ampere and Ada
# (sm_90 is compiled, with every other kernel, by tests/test_triton_softmax.py): bf16 products.
_COMPILE_LSE = r"""
import json, os, re, subprocess, sys, tempfile
os.environ.pop("TRITON_INTERPRET", None)
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from ds_pfc.kernels import triton_softmax as K

arch = int(sys.argv[1])
try:
    cuobjdump = triton.knobs.nvidia.cuobjdump.path
except (AttributeError, RuntimeError) as e:
    print("UNUSABLE:", repr(e))
    sys.exit(3)
jobs = [(K._lse_kernel, dtype, tiles, flags) for dtype in (torch.bfloat16, torch.float16) for tiles, flags in (
            ("lse", dict(HAS_THRESHOLD=False, WANT_MAX_COS=False, STORE_COS=False)),
            ("lse", dict(HAS_THRESHOLD=True, WANT_MAX_COS=False, STORE_COS=False)),
            ("lse", dict(HAS_THRESHOLD=False, WANT_MAX_COS=False, STORE_COS=True)),
            ("lse", dict(HAS_THRESHOLD=True, WANT_MAX_COS=False, STORE_COS=True)),
            ("lse_max", dict(HAS_THRESHOLD=True, WANT_MAX_COS=True, STORE_COS=False)),
            ("lse_max", dict(HAS_THRESHOLD=True, WANT_MAX_COS=True, STORE_COS=True)))]
# The exp-kept forward (bf16 only), the default training step where bf16 products are kept.
jobs += [(K._lse_exp_kernel, torch.bfloat16, tiles, flags) for tiles, flags in (
            ("lse", dict(HAS_THRESHOLD=False, WANT_MAX_COS=False)),
            ("lse", dict(HAS_THRESHOLD=True, WANT_MAX_COS=False)),
            ("lse_max", dict(HAS_THRESHOLD=False, WANT_MAX_COS=True)),
            ("lse_max", dict(HAS_THRESHOLD=True, WANT_MAX_COS=True)))]
ptr = {torch.bfloat16: "*bf16", torch.float16: "*fp16"}
for kernel, dtype, tiles, flags in jobs:
    n, s, k, warps, stages = K.tile_config(tiles, dtype, interpret=False, arch=arch)
    values = dict(flags, UPCAST=False, PRECISION="ieee", COMPUTE=K._TL_DTYPES[dtype],
                  KEEP=K._TL_DTYPES[K.keep_dtype(dtype)], BLOCK_N=n, BLOCK_S=s, BLOCK_K=k)
    constexprs = {p.name: values[p.name] for p in kernel.params if p.is_constexpr}
    signature, attrs = {}, {}
    for i, arg in enumerate(kernel.arg_names):
        if arg in constexprs:
            signature[arg] = "constexpr"
            continue
        if arg.endswith("_ptr"):
            signature[arg] = {"x_ptr": ptr[dtype], "w_ptr": ptr[dtype], "tgt_ptr": "*i64", "cos_ptr": "*fp16",
                              "e_ptr": "*bf16"}.get(arg, "*fp32")
        else:
            signature[arg] = "fp32" if arg in ("scale", "threshold", "shift") else "i32"
        if arg.endswith("_ptr") or arg in ("d", "N"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": warps, "num_stages": stages})
    cubin = compiled.asm.get("cubin") or b""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        open(path, "wb").write(cubin)
        usage = subprocess.run([cuobjdump, "--dump-resource-usage", path], capture_output=True, text=True,
                               check=True).stdout
        sass = subprocess.run([cuobjdump, "-sass", path], capture_output=True, text=True, check=True).stdout
    field = lambda key: int(re.search(key + r":(\d+)", usage).group(1))
    print(json.dumps(dict(kernel=kernel.__name__, dtype=str(dtype), tiles=tiles, flags=flags, config=[n, s, k, warps, stages],
                          cubin=len(cubin), shared=compiled.metadata.shared,
                          regs=field("REG"), spills=(field("STACK") + field("LOCAL")) // 4,
                          hgmma=sass.count("HGMMA"), hmma=sass.count("HMMA"))), flush=True)
"""
# Dynamic shared memory per block (opt-in maximum): A100 163 KiB; sm_86 and sm_89 99 KiB.
_SHARED = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024}
# Spilled 32-bit words allowed: none. On mma.sync Hopper's 128 x 4 x 64 forward tiles spill
# 34-58 words; the kernels choose MMA_SYNC_TILES there (ds_pfc.kernels.triton_softmax).
_SPILL_BUDGET = 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the kernels compile for the GPU at hand")
@pytest.mark.parametrize("arch", [80, 86, 89])
def test_every_forward_specialisation_compiles_for_ampere_and_ada(arch):
    import subprocess
    import sys
    pytest.importorskip("triton.compiler", reason="needs Triton's compiler API")
    env = dict(os.environ, TRITON_DEFAULT_FP_FUSION=os.environ.get("TRITON_DEFAULT_FP_FUSION", "1"))
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-c", _COMPILE_LSE, str(arch)], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=600)
    if proc.returncode == 3 and proc.stdout.startswith("UNUSABLE:"):
        pytest.skip(f"Triton's bundled CUDA tools are not usable here: {proc.stdout.strip()}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 16
    assert {r["kernel"] for r in rows} == {"_lse_kernel", "_lse_exp_kernel"}
    for r in rows:
        what = f"sm_{arch} {r['kernel']} {r['dtype']} {r['tiles']} {r['config']} {r['flags']}"
        assert r["cubin"] > 0, what
        assert r["shared"] <= _SHARED[arch], (what, r["shared"])
        assert r["regs"] <= 255, (what, r["regs"])
        assert r["spills"] <= _SPILL_BUDGET, (what, r["spills"])
        assert r["hmma"] > 0 and r["hgmma"] == 0, what          # tensor cores, mma.sync before Hopper



def _forward_blocks(monkeypatch, target_arch):
    """The (BLOCK_N, BLOCK_S, BLOCK_K, num_warps) of the exp-kept forward's launch inside
    ``gpu_tiles(arch=target_arch)``, recorded instead of run (the interpreter's launch is
    replaced)."""
    from triton.runtime import interpreter as interp
    seen = []

    def run(fn, *args, grid, warmup, **kwargs):
        if fn.__name__ == "_lse_exp_kernel":
            seen.append(tuple(kwargs[k] for k in ("BLOCK_N", "BLOCK_S", "BLOCK_K", "num_warps")))
    monkeypatch.setattr(interp.InterpretedFunction, "run", run)
    n, s, d = 40, 300, 32
    x = torch.nn.functional.normalize(torch.randn(n, d), dim=1)
    w_hat = torch.nn.functional.normalize(torch.randn(s, d), dim=1).to(torch.bfloat16)
    with _target.gpu_tiles(sms=8, arch=target_arch):
        ts.exp_stats(x, w_hat.float(), torch.ones(s), torch.randint(0, s, (n,)), scale=64.0, threshold=None,
                     compute_dtype=torch.bfloat16, want_max_cos=False, keep=torch.empty(s, n, dtype=torch.bfloat16),
                     w_hat=w_hat)
    monkeypatch.undo()
    assert len(seen) == 1
    return seen[0]


@pytest.mark.parametrize("arch", [80, 86, 89])
def test_the_forward_launches_the_mma_sync_tiles_before_hopper(monkeypatch, arch):
    """On sm_8x the forward launches the tiles that compile without spills there (the test above);
    Hopper keeps its own. The architecture is the GPU's compute capability (a mocked
    ``torch.cuda``), or the model's target inside ``gpu_tiles``."""
    hopper = _forward_blocks(monkeypatch, 90)
    assert hopper == (128, 64, 64, 8)
    assert _forward_blocks(monkeypatch, arch) == (128, 32, 32, 8)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: divmod(arch, 10))
    ts._device_arch.cache_clear()
    try:
        assert ts._arch(torch.device("cuda", 0)) == arch
        assert ts._arch(CPU) is None
        with _target.gpu_tiles(sms=132, arch=90):
            assert ts._arch(torch.device("cuda", 0)) == 90      # the target's, not the device's
    finally:
        ts._device_arch.cache_clear()


@pytest.mark.parametrize("gpu,batch,path", [("h200", 4096, "exp"), ("h100", 4096, "exp"), ("h200", 2048, "exp")])
def test_a_prediction_takes_the_keep_budget_the_head_would_read_from_the_gpu(gpu, batch, path):
    """The standard rank at N = 4096 keeps 6.55 GB of bf16 exponentials: over the 4 GiB budget
    the head uses off CUDA, within half of what an H100's or H200's memory leaves beside the
    rank's float32 centers and momentum (8M x 512 x 8 B) and the rest of the step, which is
    the budget the head reads from the device there. The prediction takes the latter."""
    from ds_pfc.bench import model
    case = dict(world=1, classes=8_000_000, sample_rate=0.1, batch=batch, dim=512, compute="bf16")
    budget = model.default_keep_budget(case, gpu)
    free = model.GPUS[gpu]["memory_bytes"] - 8_000_000 * 512 * 8 - model.OTHER_RESIDENT_BYTES
    assert budget == int(softmax.COSINE_KEEP_SHARE * free)
    assert model.cosines_path("triton", batch, 800_000, "bf16", budget) == path
    if batch == 4096:
        assert model.cosines_path("triton", batch, 800_000, "bf16", None) == "recompute"   # off CUDA: 4 GiB
    # A rank whose bank leaves no room keeps nothing.
    assert model.default_keep_budget(dict(case, classes=40_000_000), gpu) == 0
