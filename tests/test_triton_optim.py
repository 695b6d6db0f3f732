"""The fused Triton row optimizers against torch.optim, one parameter per row.

Without CUDA the kernels run on CPU tensors under Triton's interpreter.

The reference is ``torch.optim.SGD`` / ``torch.optim.AdamW`` (float32, ``foreach=False``)
on each row held as its own parameter and stepped only on the steps where the row is
active, which is the lazy per-row semantics of ``ds_pfc.core.optim``. float32 rather than
float64: the tables are float32, so a float64 reference would differ from any float32
implementation by the storage rounding of the weight (~6e-8 absolute on weights ~1,
i.e. ~1e-4 of an lr=1e-3 update); in float32 the only differences left are the order
and fusion of the arithmetic, which is what the tolerances below bound.
"""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install -e .[dev])")
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before the @triton.jit kernels are defined

from ds_pfc.kernels import triton_optim as K  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# Relative error of the weight change (max |w - w_ref| / max |w_ref - w_init|) and of
# the state (max |s - s_ref| / max |s_ref|). Measured under the interpreter: SGD
# <= 1.5e-7 (weight; torch's CPU add(alpha=) rounds once where the kernel rounds
# twice), buffer bitwise; AdamW <= 2.5e-7 (weight), <= 1.1e-7 (moments), and
# <= 1.7e-7 per row against float64 at step counts up to 1e5 (float32 bias
# corrections, where 1 - exp(x) alone gives ~1e-5). The bounds leave room for the
# GPU contracting a*b+c into one fma.
SGD_RTOL = 5e-7
ADAMW_RTOL = 1e-6


def _row_sets(num_rows, sizes, seed):
    """Sorted unique random row subsets of the given sizes, one per step."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randperm(num_rows, generator=gen)[:size].sort().values for size in sizes]


def _rel(actual, expected, scale):
    return ((actual - expected).abs().max() / scale.abs().max().clamp_min(1e-30)).item()


def _run(kind, num_rows, width, sizes, hyper, rows_none=False, seed=0):
    """Steps the kernel and the per-row torch.optim reference on the same gradients;
    returns the measured relative errors and checks that inactive rows stay bitwise."""
    gen = torch.Generator().manual_seed(seed)
    w_init = 0.01 * torch.randn(num_rows, width, generator=gen)  # Partial FC init: N(0, 0.01)
    row_sets = [torch.arange(num_rows)] * len(sizes) if rows_none else _row_sets(num_rows, sizes, seed)
    ever = torch.zeros(num_rows, dtype=torch.bool)
    for ids in row_sets:
        ever[ids] = True

    # State: zero where a row will be active (what the bank starts with), a random
    # sentinel elsewhere so that writes to inactive rows would show.
    def state(dtype=torch.float32, shape=(num_rows, width)):
        if dtype == torch.int32:
            t = torch.randint(1, 100, shape, generator=gen, dtype=dtype)
        else:
            t = torch.randn(*shape, generator=gen, dtype=dtype)
        t[ever] = 0
        return t.to(DEVICE)

    weight = w_init.clone().to(DEVICE)
    if kind == "sgd":
        states = {"momentum_buffer": state()} if hyper["momentum"] else {}
    else:
        states = {"exp_avg": state(), "exp_avg_sq": state(), "step": state(torch.int32, (num_rows,))}

    params = [torch.nn.Parameter(w_init[r].clone()) for r in range(num_rows)]
    if kind == "sgd":
        opts = [torch.optim.SGD([p], lr=hyper["lr"], momentum=hyper["momentum"], weight_decay=hyper["weight_decay"],
                                nesterov=hyper["nesterov"], foreach=False) for p in params]
    else:
        opts = [torch.optim.AdamW([p], lr=hyper["lr"], betas=(hyper["beta1"], hyper["beta2"]), eps=hyper["eps"],
                                  weight_decay=hyper["weight_decay"], foreach=False) for p in params]

    for ids in row_sets:
        grad = torch.randn(len(ids), width, generator=gen)
        before = [weight.clone()] + [s.clone() for s in states.values()]
        rows = None if rows_none else ids.to(DEVICE)
        if kind == "sgd":
            K.sgd_rows_(weight, states.get("momentum_buffer"), rows, grad.to(DEVICE), **hyper)
        else:
            K.adamw_rows_(weight, states["exp_avg"], states["exp_avg_sq"], states["step"], rows, grad.to(DEVICE),
                          **hyper)
        inactive = torch.ones(num_rows, dtype=torch.bool)
        inactive[ids] = False
        for old, new in zip(before, [weight] + list(states.values())):
            assert torch.equal(old[inactive.to(DEVICE)], new[inactive.to(DEVICE)]), "an inactive row changed"
        for i, r in enumerate(ids.tolist()):
            params[r].grad = grad[i].clone()
            opts[r].step()

    weight = weight.cpu()
    active = ever.nonzero().flatten().tolist()
    ref_w = torch.stack([params[r].detach() for r in active])
    errors = {"weight": _rel(weight[active], ref_w, ref_w - w_init[active])}
    assert torch.equal(weight[~ever], w_init[~ever])
    for name, table in states.items():
        table = table.cpu()
        ref = torch.stack([torch.as_tensor(opts[r].state[params[r]][name]) for r in active])
        if name == "step":
            assert torch.equal(table[active], ref.to(torch.int32)), "per-row step counts"
        else:
            errors[name] = _rel(table[active], ref, ref)
    return errors


SGD = dict(lr=0.1, momentum=0.9, weight_decay=5e-4, nesterov=False)
ADAMW = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-2)


@pytest.mark.parametrize("width", [24, 40])
@pytest.mark.parametrize("hyper", [SGD, dict(SGD, nesterov=True), dict(SGD, momentum=0.0, weight_decay=0.0),
                                   dict(SGD, momentum=0.0)],
                         ids=["momentum", "nesterov", "plain", "no-momentum-wd"])
def test_sgd_matches_torch(width, hyper):
    errors = _run("sgd", 37, width, [10, 1, 37, 20], hyper)
    assert max(errors.values()) <= SGD_RTOL, errors


@pytest.mark.parametrize("width", [24, 40])
@pytest.mark.parametrize("hyper", [ADAMW, dict(ADAMW, beta1=0.0, weight_decay=0.0)], ids=["wd", "beta1=0"])
def test_adamw_matches_torch(width, hyper):
    errors = _run("adamw", 37, width, [10, 1, 37, 20], hyper)
    assert max(errors.values()) <= ADAMW_RTOL, errors


@pytest.mark.parametrize("kind,hyper", [("sgd", SGD), ("adamw", ADAMW)])
def test_rows_none_means_all_rows(kind, hyper):
    errors = _run(kind, 37, 24, [37, 37, 37], hyper, rows_none=True)
    assert max(errors.values()) <= (SGD_RTOL if kind == "sgd" else ADAMW_RTOL), errors


def test_adamw_late_steps():
    """Large per-row step counts (bias corrections near 1, and the branch where
    1 - beta**t is computed from exp rather than the series)."""
    counts = [0, 3, 499, 999, 1200, 5000, 100000]
    weight = 0.01 * torch.randn(len(counts), 40, device=DEVICE)
    exp_avg = torch.randn(len(counts), 40, device=DEVICE) * 0.1
    exp_avg_sq = torch.rand(len(counts), 40, device=DEVICE) * 0.01
    step = torch.tensor(counts, dtype=torch.int32, device=DEVICE)
    grad = torch.randn(len(counts), 40, device=DEVICE)
    w0, m0, v0, s0 = (t.clone().double() for t in (weight, exp_avg, exp_avg_sq, step))
    hyper = dict(ADAMW, lr=0.1)  # updates >> the float32 rounding of the weight
    K.adamw_rows_(weight, exp_avg, exp_avg_sq, step, None, grad, **hyper)

    b1, b2 = hyper["beta1"], hyper["beta2"]
    t = (s0 + 1)[:, None]
    m = b1 * m0 + (1 - b1) * grad.double()
    v = b2 * v0 + (1 - b2) * grad.double() ** 2
    denom = v.sqrt() / (1 - b2 ** t).sqrt() + hyper["eps"]
    w = w0 * (1 - hyper["lr"] * hyper["weight_decay"]) - hyper["lr"] * m / (denom * (1 - b1 ** t))
    assert torch.equal(step.cpu(), (s0 + 1).int().cpu())
    # float64 reference, so the bound includes the float32 rounding of the result.
    errors = [_rel(weight[i].double(), w[i], w[i] - w0[i]) for i in range(len(counts))]
    assert max(errors) <= ADAMW_RTOL, dict(zip(counts, errors))


def _sgd_args(num_rows=6, width=8, active=3):
    return (torch.randn(num_rows, width, device=DEVICE), torch.zeros(num_rows, width, device=DEVICE),
            torch.arange(active, device=DEVICE), torch.randn(active, width, device=DEVICE))


def _adamw_args(num_rows=6, width=8, active=3):
    return (torch.randn(num_rows, width, device=DEVICE), torch.zeros(num_rows, width, device=DEVICE),
            torch.zeros(num_rows, width, device=DEVICE), torch.zeros(num_rows, dtype=torch.int32, device=DEVICE),
            torch.arange(active, device=DEVICE), torch.randn(active, width, device=DEVICE))


def _replace(args, index, value):
    args = list(args)
    args[index] = value
    return args


@pytest.mark.parametrize("index,value,error,match", [
    (2, torch.arange(3, dtype=torch.int32), TypeError, "rows must have dtype torch.int64"),
    (2, torch.arange(4), ValueError, r"rows must have shape \[3\]"),
    (2, torch.arange(3, device="meta"), ValueError, "rows must be on"),
    (3, torch.randn(3, 8, dtype=torch.float64), TypeError, "grad must have dtype"),
    (3, torch.randn(3, 8, 1), ValueError, r"grad must have shape \[R, d\]"),
    (0, torch.randn(6, 9), ValueError, r"weight must have shape \[6, 8\]"),
    (1, torch.zeros(7, 8), ValueError, r"momentum_buffer must have shape \[6, 8\]"),
    (1, None, ValueError, "momentum_buffer is required"),
    (0, torch.randn(8, 6).t(), ValueError, "weight must be contiguous"),
    (0, [[0.0] * 8] * 6, TypeError, "weight must be a torch.Tensor"),
])
def test_sgd_bad_arguments(index, value, error, match):
    if isinstance(value, torch.Tensor) and value.device.type == "cpu":
        value = value.to(DEVICE)
    args = _replace(_sgd_args(), index, value)
    with pytest.raises(error, match=match):
        K.sgd_rows_(*args, **SGD)


@pytest.mark.parametrize("index,value,error,match", [
    (1, torch.zeros(6, 7), ValueError, r"exp_avg must have shape \[6, 8\]"),
    (2, torch.zeros(6, 8, dtype=torch.float16), TypeError, "exp_avg_sq must have dtype torch.float32"),
    (3, torch.zeros(6, dtype=torch.int64), TypeError, "step must have dtype torch.int32"),
    (3, torch.zeros(5, dtype=torch.int32), ValueError, r"step must have shape \[6\]"),
    (4, None, ValueError, r"weight must have shape \[3, 8\]"),  # rows=None: tables of R rows
])
def test_adamw_bad_arguments(index, value, error, match):
    if isinstance(value, torch.Tensor):
        value = value.to(DEVICE)
    args = _replace(_adamw_args(), index, value)
    with pytest.raises(error, match=match):
        K.adamw_rows_(*args, **ADAMW)


@pytest.mark.parametrize("override,error,match", [
    (dict(momentum=0.0, nesterov=True), ValueError, "nesterov=True needs momentum > 0"),
    (dict(momentum=1.0), ValueError, "momentum must be in"),
    (dict(lr="0.1"), TypeError, "lr must be a finite number"),
    (dict(weight_decay=float("nan")), TypeError, "weight_decay must be a finite number"),
])
def test_bad_hyper_parameters(override, error, match):
    with pytest.raises(error, match=match):
        K.sgd_rows_(*_sgd_args(), **dict(SGD, **override))


def test_adamw_bad_beta():
    with pytest.raises(ValueError, match="beta2 must be in"):
        K.adamw_rows_(*_adamw_args(), **dict(ADAMW, beta2=1.0))


def test_empty_rows_launch_nothing(monkeypatch):
    class NoLaunch:
        def __getitem__(self, grid):
            raise AssertionError("a kernel was launched for R == 0")

    for name in ("_sgd_rows_kernel", "_adamw_rows_kernel", "_increment_steps_kernel"):
        monkeypatch.setattr(K, name, NoLaunch())
    sgd = _sgd_args(active=0)
    adamw = _adamw_args(active=0)
    before = [t.clone() for t in sgd + adamw]
    K.sgd_rows_(*sgd, **SGD)
    K.adamw_rows_(*adamw, **ADAMW)
    K.sgd_rows_(torch.zeros(0, 8, device=DEVICE), None, None, torch.zeros(0, 8, device=DEVICE),
                **dict(SGD, momentum=0.0))
    assert all(torch.equal(a, b) for a, b in zip(before, sgd + adamw))


def test_available():
    assert K.available()


# Compiles every kernel for Hopper (sm_90) down to a cubin with the ptxas bundled in the
# triton wheel; no GPU is needed. Runs in a subprocess because this module imported the
# kernels in interpreter mode.
_COMPILE_SM90 = textwrap.dedent("""
    import os
    os.environ.pop("TRITON_INTERPRET", None)
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from ds_pfc.kernels import triton_optim as K

    POINTERS = {"rows_ptr": "*i64", "step_ptr": "*i32"}
    block_r, block_d, num_warps, block_step = K._TILES["cuda"]
    tiles = dict(BLOCK_R=block_r, BLOCK_D=block_d, BLOCK_STEP=block_step, PROJECT=False, ONE_SWEEP=False)

    def compile_sm90(kernel, **flags):
        constexprs = {p.name: dict(tiles, **flags)[p.name] for p in kernel.params if p.is_constexpr}

        def kind(name):
            if name in constexprs:
                return "constexpr"
            if name.endswith("_ptr"):
                return POINTERS.get(name, "*fp32")
            return "i32" if name in ("R", "D") or name.startswith("stride_") else "fp32"
        signature = {name: kind(name) for name in kernel.arg_names}
        compiled = triton.compile(ASTSource(kernel, signature, constexprs), target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": num_warps})
        assert compiled.asm["cubin"]

    for rows in (True, False):
        compile_sm90(K._sgd_rows_kernel, HAS_ROWS=rows, HAS_MOMENTUM=True, HAS_WEIGHT_DECAY=True, NESTEROV=rows)
        compile_sm90(K._sgd_rows_kernel, HAS_ROWS=rows, HAS_MOMENTUM=False, HAS_WEIGHT_DECAY=False, NESTEROV=False)
        compile_sm90(K._adamw_rows_kernel, HAS_ROWS=rows)
        compile_sm90(K._increment_steps_kernel, HAS_ROWS=rows)
    # The projecting (whole-row) update: one sweep at d = 512, two sweeps for rows wider
    # than ONE_SWEEP, with the launch parameters sgd_rows_ / adamw_rows_ choose.
    for width in (512, 2 * K._ROW_TILES["cuda"][0]):
        row_r, row_d, one_sweep = K._row_tiles(width)
        row = dict(PROJECT=True, ONE_SWEEP=one_sweep, BLOCK_R=row_r, BLOCK_D=row_d)
        compile_sm90(K._sgd_rows_kernel, HAS_ROWS=True, HAS_MOMENTUM=True, HAS_WEIGHT_DECAY=True, NESTEROV=False,
                     **row)
        compile_sm90(K._adamw_rows_kernel, HAS_ROWS=True, **row)
    print("compiled")
""")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the other tests ran the kernels on the GPU")
def test_kernels_compile_for_sm90():
    pytest.importorskip("triton.compiler", reason="needs Triton's compiler API")
    env = dict(os.environ, TRITON_DEFAULT_FP_FUSION=os.environ.get("TRITON_DEFAULT_FP_FUSION", "1"))
    env.pop("TRITON_INTERPRET", None)
    result = subprocess.run([sys.executable, "-c", _COMPILE_SM90], capture_output=True, text=True, env=env,
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), timeout=300)
    if result.returncode and "No module named" in result.stderr and "triton" in result.stderr:
        pytest.skip(f"Triton's compiler is not usable here: {result.stderr.strip().splitlines()[-1]}")
    assert result.returncode == 0 and "compiled" in result.stdout, result.stderr[-3000:]
