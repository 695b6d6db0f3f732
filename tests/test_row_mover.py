"""The row mover's launch parameters and its 8-bit rows, in Triton's interpreter.

References, independent of the code under test:

* every launch parameter the mover exposes (warps per program, whole rows per pass, the
  grid cap, columns per tile, whole rows or tiles) against plain torch indexing, bitwise;
* 8-bit rowwise codes encoded, decoded and round-tripped in the kernel against
  ``ds_pfc.bank.quantized`` (today's rounding) and against a float64 quantizer written
  here from the definition, which rounds to float32 after every operation as float32
  arithmetic does (a float64 quotient or product of float32 values rounded once to
  float32 is the float32 result);
* the stated defaults against the Little's-law arithmetic they claim.
"""
from __future__ import annotations

import itertools

import pytest
import torch

from ds_pfc.bank.quantized import dequantize_rows, quantize_rows
from ds_pfc.kernels import triton_rows as tr

pytestmark = pytest.mark.skipif(not tr.available() or not tr._INTERPRET,
                                reason="triton is not installed or TRITON_INTERPRET=1 was not set before import "
                                       "(these tests run the kernel in the interpreter)")

CONFIGS = [tr.MoverConfig(w, r, p, b) for w, r, p, b in itertools.product((1, 4), (1, 4, 64), (1, 3), (0, 8))]


def _ref_move(src, src_idx, dst, dst_idx, mask, round_dtype=None):
    out = dst.clone()
    n = src_idx.numel() if src_idx is not None else (dst_idx.numel() if dst_idx is not None else src.shape[0])
    for i in range(n):
        if mask is not None and not bool(mask[i]):
            continue
        v = src[int(src_idx[i]) if src_idx is not None else i]
        if round_dtype is not None:
            v = v.to(round_dtype)
        out[int(dst_idx[i]) if dst_idx is not None else i] = v.to(dst.dtype)
    return out


def _case(use, g, width=21, rows=53, n=37):
    table = torch.randn(rows, width, generator=g) * torch.logspace(-4, 4, rows)[:, None]
    if use == "gather":         # fetch: bf16 table rows -> float32 slot, where cold
        return (table.to(torch.bfloat16), torch.randperm(rows, generator=g)[:n], torch.full((n, width), -3.0),
                None, torch.rand(n, generator=g) < 0.6, None)
    if use == "scatter":        # write-back: float32 slot -> bf16 table rows
        return (table[:n].clone(), None, torch.full((rows, width), 5.0, dtype=torch.bfloat16),
                torch.randperm(rows, generator=g)[:n], None, None)
    return (table, torch.randint(0, rows, (n,), generator=g), torch.full((n, width), 7.0),   # patch
            None, torch.rand(n, generator=g) < 0.5, torch.bfloat16)


@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize("use", ["gather", "scatter", "patch"])
def test_every_launch_parameter_moves_rows_as_torch_indexing(config, use):
    g = torch.Generator().manual_seed(hash((use, tuple(config))) % 1000)
    src, src_idx, dst, dst_idx, mask, rnd = _case(use, g)
    expected = _ref_move(src, src_idx, dst, dst_idx, mask, rnd)
    got = tr.move_rows_(src, src_idx, dst.clone(), dst_idx, mask, rnd, config=config)
    assert torch.equal(got, expected), f"{config} {use}"


# ---------------------------------------------------------------------- 8-bit rows
def _f32(x: torch.Tensor) -> torch.Tensor:
    """float64 values rounded to float32 and held in float64."""
    return x.to(torch.float32).to(torch.float64)


def _quantize_f64(v: torch.Tensor):
    """Rowwise int8 codes from the definition: s = max|v| / 127, q = round-half-even(v / s)
    clamped to +-127 (s = 0: q = 0), every quotient rounded to float32 once."""
    v = v.to(torch.float64)
    scale = _f32(v.abs().amax(dim=1) / 127.0)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(_f32(v / safe[:, None])).clamp(-127, 127)
    return q.to(torch.int8), scale.to(torch.float32)


def _dequantize_f64(q, scale):
    return _f32(q.to(torch.float64) * scale.to(torch.float64)[:, None]).to(torch.float32)


def _hard_rows(g, rows=45, width=19) -> torch.Tensor:
    """Rows whose codes are hard: exact ties (max|v| = 127 makes s = 1, and k + 0.5 is a
    tie), an all-zero row, signed zeros, subnormals, the largest floats, one huge entry
    among tiny ones, then random rows over 16 decades."""
    v = torch.randn(rows, width, generator=g) * torch.logspace(-8, 8, rows)[:, None]
    v[0] = torch.arange(width) - width / 2 + 0.5
    v[0, 0] = 127.0
    v[1] = 0.0
    v[2] = -0.0
    v[2, 3] = 1e-40
    v[3] = torch.finfo(torch.float32).max * torch.linspace(-1, 1, width)
    v[4] = 1e-30
    v[4, 7] = 1e30
    v[5] = -torch.arange(width) - 0.5
    v[5, 0] = -127.0
    return v


def test_the_float64_reference_is_todays_rounding():
    g = torch.Generator().manual_seed(1)
    v = _hard_rows(g)
    q, s = quantize_rows(v)
    rq, rs = _quantize_f64(v)
    assert torch.equal(q, rq) and torch.equal(s, rs)
    assert torch.equal(dequantize_rows(q, s), _dequantize_f64(rq, rs))
    assert int((q[0].abs() % 2 == 0).sum()) > 0          # ties went to even


@pytest.mark.filterwarnings("ignore:overflow encountered")     # 127 x (max / 127) rounds to inf, as in torch
@pytest.mark.parametrize("config", [None, tr.MoverConfig(1, 1, 1, 0), tr.MoverConfig(4, 4, 3, 8),
                                    tr.MoverConfig(8, 64, 2, 0), tr.MoverConfig(2, 16, 2, 4)], ids=str)
def test_int8_rows_encode_decode_and_round_in_the_kernel_bitwise(config):
    g = torch.Generator().manual_seed(2)
    v = _hard_rows(g)
    n, width = v.shape
    rq, rs = _quantize_f64(v)
    ref_q, ref_s = quantize_rows(v)
    # write-back: slot rows -> table rows at dst_idx, codes made in the kernel
    at = torch.randperm(60, generator=g)[:n]
    q = torch.full((60, width), 9, dtype=torch.int8)
    s = torch.full((60,), 2.5)
    tr.encode_rows_(v, None, q, s, at, config=config)
    assert torch.equal(q[at], rq) and torch.equal(s[at], rs) and torch.equal(q[at], ref_q)
    untouched = torch.ones(60, dtype=torch.bool)
    untouched[at] = False
    assert bool((q[untouched] == 9).all()) and bool((s[untouched] == 2.5).all())
    # masked write-back: masked-off rows keep their codes and scale
    keep = torch.rand(n, generator=g) < 0.5
    q2, s2 = q.clone(), s.clone()
    tr.encode_rows_(-v, None, q2, s2, at, keep, config=config)
    nq, ns = _quantize_f64(-v)
    assert torch.equal(q2[at[keep]], nq[keep]) and torch.equal(s2[at[keep]], ns[keep])
    assert torch.equal(q2[at[~keep]], q[at[~keep]]) and torch.equal(s2[at[~keep]], s[at[~keep]])
    # fetch: table codes -> float32 slot where cold, decoded in the kernel
    rows = torch.randperm(60, generator=g)[:30]
    cold = torch.rand(30, generator=g) < 0.7
    dst = torch.full((30, width), -1.0)
    tr.decode_rows_(q, s, rows, dst, None, cold, config=config)
    want = torch.where(cold[:, None], _dequantize_f64(q[rows], s[rows]), torch.full_like(dst, -1.0))
    assert torch.equal(dst, want)
    # decode straight to bfloat16
    dst16 = torch.zeros(30, width, dtype=torch.bfloat16)
    tr.decode_rows_(q, s, rows, dst16, None, config=config)
    assert torch.equal(dst16, _dequantize_f64(q[rows], s[rows]).to(torch.bfloat16))
    # overlap patch: slot rows rounded as a write-back and a read would leave them
    pos = torch.randint(0, n, (n,), generator=g)
    hit = torch.rand(n, generator=g) < 0.5
    out = torch.full((n, width), 4.0)
    tr.move_rows_(v, pos, out, None, hit, tr.INT8_ROWWISE, config=config)
    rt = _dequantize_f64(rq, rs)[pos]
    assert torch.equal(out, torch.where(hit[:, None], rt, torch.full_like(out, 4.0)))


def test_int8_error_is_at_most_half_a_code_per_row():
    g = torch.Generator().manual_seed(3)
    v = torch.randn(40, 33, generator=g) * torch.logspace(-6, 6, 40)[:, None]
    out = torch.empty_like(v)
    tr.move_rows_(v, None, out, None, None, tr.INT8_ROWWISE)
    half_code = v.abs().amax(dim=1, keepdim=True) / 127 / 2
    assert bool(((out - v).abs() <= half_code * (1 + 1e-5)).all())


def test_bad_arguments_are_named_and_change_nothing():
    q = torch.zeros(8, 4, dtype=torch.int8)
    s = torch.zeros(8)
    dst = torch.full((8, 4), 3.0)
    for kwargs, words in (({"config": tr.MoverConfig(3, 4, 1)}, "num_warps"),
                          ({"config": tr.MoverConfig(4, 6, 1)}, "rows_per_pass"),
                          ({"config": tr.MoverConfig(4, 4, 0)}, "max_programs"),
                          ({"config": tr.MoverConfig(4, 4, 1, 12)}, "block_w"),
                          ({"config": (4, 4, 1, 0)}, "config"),
                          ({"kind": "h2d"}, "kind")):
        with pytest.raises((ValueError, TypeError), match=words):
            tr.decode_rows_(q, s, None, dst, None, **kwargs)
    with pytest.raises(ValueError, match="scale"):
        tr.decode_rows_(q, torch.zeros(7), None, dst, None)
    with pytest.raises(TypeError, match="q must"):
        tr.decode_rows_(q.float(), s, None, dst, None)
    with pytest.raises(TypeError, match="dst"):
        tr.decode_rows_(q, s, None, q.clone(), None)
    with pytest.raises(TypeError, match="src"):
        tr.encode_rows_(q, None, q.clone(), s, None)
    with pytest.raises(ValueError, match="round_dtype"):
        tr.move_rows_(torch.zeros(8), None, torch.zeros(8), None, None, tr.INT8_ROWWISE)
    assert bool((dst == 3.0).all())


@pytest.mark.parametrize("kind", tr.KINDS)
@pytest.mark.parametrize("d", [128, 256, 512, 1024])
@pytest.mark.parametrize("bytes_per_value,extra", [(2, 0), (4, 0), (1, 4)], ids=["bf16", "fp32", "int8"])
def test_defaults_keep_the_stated_bytes_in_flight(kind, d, bytes_per_value, extra):
    """Little's law: bytes in flight >= rate x latency, for host reads from every program's
    rows of one pass (writes and device moves: their stated grid), within the register cap."""
    row_bytes = d * bytes_per_value + extra
    cfg = tr.default_config(kind, row_bytes, d)
    assert cfg.rows_per_pass & (cfg.rows_per_pass - 1) == 0
    assert cfg.rows_per_pass * min(d, tr.WHOLE_ROW_MAX) <= tr.MAX_VALUES_PER_PASS
    assert cfg.max_programs == tr.MAX_PROGRAMS[kind]
    if kind == "host_read":
        need = tr.TARGET_GBPS[kind] * 1e9 * tr.ASSUMED_LATENCY_US[kind] * 1e-6
        assert tr.bytes_in_flight(cfg, row_bytes) >= need, (cfg, row_bytes)


# ---------------------------------------------------------------------- the 8-bit store
def _codec():
    from ds_pfc.bank.quantized import RowCodec
    return RowCodec(tr.decode_rows_, tr.encode_rows_, tr.move_rows_)


@pytest.mark.parametrize("tier", ["device", "host"])
@pytest.mark.filterwarnings("ignore:overflow encountered")
def test_int8_store_moves_codes_with_and_without_the_codec_alike(tier):
    """Every way the bank reads and writes an 8-bit store, with the kernel's codec and with
    torch ops, against the float64 reference: write-back, fetch where cold, fetch into
    positions, the overlap patch, and the staged path's codes crossing as codes."""
    from ds_pfc.bank.quantized import RowwiseInt8Store
    g = torch.Generator().manual_seed(4)
    width, n = 23, 40
    v = _hard_rows(g, rows=n, width=width)
    rows = torch.randperm(97, generator=g)[:n].sort().values
    cold = torch.rand(n, generator=g) < 0.6
    positions = torch.randperm(n + 5, generator=g)[:n]
    pos = torch.randint(0, n, (n,), generator=g)
    rq, rs = _quantize_f64(v)
    want = _dequantize_f64(rq, rs)
    results = []
    for codec in (None, _codec()):
        store = RowwiseInt8Store(97, width, tier, "cpu")
        store.write_rows(rows, v, codec)
        assert torch.equal(store.q[rows], rq) and torch.equal(store.scale[rows], rs)
        got = torch.full((n, width), -2.0)
        store.fetch_into(rows, got, None, cold, codec)
        assert torch.equal(got, torch.where(cold[:, None], want, torch.full_like(got, -2.0)))
        at = torch.zeros(n + 5, width)
        store.fetch_into(rows, at, positions, None, codec)
        assert torch.equal(at[positions], want)
        patched = torch.full((n, width), 6.0)
        store.round_into(v, pos, patched, None, cold, codec)
        assert torch.equal(patched, torch.where(cold[:, None], want[pos], torch.full_like(patched, 6.0)))
        q, s = store.gather_codes(rows)                 # staged: d + 4 bytes a row cross
        assert q.dtype == torch.int8 and s.dtype == torch.float32
        landed = torch.zeros(n + 5, width)
        store.land_codes(landed, positions, q, s, codec)
        assert torch.equal(landed[positions], want)
        cq, cs = torch.empty(n, width, dtype=torch.int8), torch.empty(n)
        store.code_rows(-v, cq, cs, codec)
        store.scatter_codes(rows, cq, cs)
        nq, ns = _quantize_f64(-v)
        assert torch.equal(store.q[rows], nq) and torch.equal(store.scale[rows], ns)
        assert int(store.versions[rows].min()) == 1
        results.append((store.q.clone(), store.scale.clone(), patched))
        store.close()
    assert all(torch.equal(a, b) for a, b in zip(*results))


# ---------------------------------------------------------------------- the benchmark's harness
def test_rows_benchmark_sweeps_and_tier_check_run_dry(tmp_path):
    """``ds-pfc-bench rows`` at toy sizes on the CPU: the sweep over launch parameters (each
    entry carries its launch and bytes in flight), the GEMM beside a move, two devices at
    once, 8-bit rows; and the tier check's JSON with every planner default the planner reads."""
    import json
    from ds_pfc.bench import rows
    out = tmp_path / "rows.json"
    assert rows.main(["--dry", "--row-bytes", "256", "--huge", "no", "--repeats", "1", "--programs", "1,3",
                      "--warps", "4", "--rows-per-pass", "2,8", "--gemm", "--two-gpus", "--int8", "--out",
                      str(out)]) == 0
    res = json.loads(out.read_text())["results"]
    gathers = [r for r in res if r.get("kind") == "host_read" and r["what"].startswith("gather")]
    launches = {(r["config"]["num_warps"], r["config"]["rows_per_pass"], r["config"]["max_programs"]) for r in gathers}
    assert {(4, 2, 1), (4, 8, 1), (4, 2, 3), (4, 8, 3)} <= launches
    assert all(r["bytes_in_flight"] == r["config"]["max_programs"] * r["config"]["rows_per_pass"] * 256
               for r in gathers)
    assert {r.get("kind") for r in res if "gbps" in r} == {"host_read", "host_write", "d2d"}
    assert any(r["what"].startswith("int8 decode") and r["row_bytes"] == 128 + 4 for r in res)
    assert any("slowdown" in r for r in res) and any("gbps_sum_together" in r for r in res)
    out = tmp_path / "tier.json"
    assert rows.main(["--dry", "--tier-check", "--repeats", "1", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    defaults = doc["planner_defaults"]
    for key in ("zero_copy_read_gbps", "zero_copy_write_gbps", "int8_read_gbps", "int8_write_gbps", "d2d_gbps",
                "register_gbps", "gemm_slowdown_beside_move", "fetch_busy_ms_per_step", "step_ms_beside_load"):
        assert defaults[key] is not None and defaults[key] > 0, key
    step = next(r for r in doc["results"] if r["what"].startswith("mapped bank step"))
    assert step["bytes_per_step"] > 0 and step["fetch_busy_ms"] > 0


def test_rows_benchmark_refuses_bad_sweeps(capsys):
    from ds_pfc.bench import rows
    for argv in (["--dry", "--warps", "3"], ["--dry", "--rows-per-pass", "x"], ["--dry", "--programs", "0"]):
        with pytest.raises(SystemExit):
            rows.main(argv)
    assert "powers of two" in capsys.readouterr().err


def test_int8_momentum_study_tracks_float32_and_is_exact_without_codes():
    from ds_pfc.bench.rows import int8_momentum_study
    same = int8_momentum_study(steps=30, classes=16, dim=8, batch=32, seeds=1, every=10, quantize=False)
    assert same["summary"]["weight_rel_dist"] == 0.0 and same["summary"]["momentum_rel_dist"] == 0.0
    coded = int8_momentum_study(steps=30, classes=16, dim=8, batch=32, seeds=1, every=10)
    s = coded["summary"]
    assert 0 < s["momentum_rel_dist"] < 0.05 and 0 < s["weight_rel_dist"] < 0.05
    assert s["write_backs_per_row"] == 30


def test_the_codec_makes_no_float32_copy_of_a_set():
    """With the codec an 8-bit store's write-back, fetch and patch run no torch op that
    makes float32 values (the kernel decodes and codes in registers); without it they do
    (the torch path's set-sized temporaries), which shows the counter sees them. The
    interpreter's own argument copies are not counted: only arithmetic and gathers."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from ds_pfc.bank.quantized import RowwiseInt8Store
    value_ops = {"aten._to_copy.default", "aten.abs.default", "aten.amax.default", "aten.div.Tensor",
                 "aten.mul.Tensor", "aten.round.default", "aten.where.self", "aten.index_select.default"}

    class FloatOps(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.made = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if str(func) in value_ops:
                for t in out if isinstance(out, (tuple, list)) else (out,):
                    if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.dim() == 2:
                        self.made.append((str(func), tuple(t.shape)))
            return out
    store = RowwiseInt8Store(500, 64, "host", "cpu")
    rows, values = torch.arange(0, 400, 2), torch.randn(200, 64)
    dst, cold = torch.zeros(200, 64), torch.rand(200) < 0.5
    made = {}
    for name, codec in (("torch", None), ("kernel", _codec())):
        with FloatOps() as mode:
            store.write_rows(rows, values, codec)
            store.fetch_into(rows, dst, None, cold, codec)
            store.round_into(values, torch.arange(200), dst, None, cold, codec)
        made[name] = mode.made
    assert made["kernel"] == []
    assert (200, 64) in {shape for _, shape in made["torch"]}


def test_each_move_takes_its_own_cap():
    """Host tables are CPU tensors mapped into the GPU: a move from one to a device tensor
    reads the host, the other way writes it, device to device is neither (meta tensors
    stand in for device memory). With the GPU's tiles the launch is the stated default."""
    from ds_pfc.kernels import _target
    host, dev = torch.empty(4, 512, dtype=torch.bfloat16), torch.empty(4, 512, device="meta")
    assert tr._kind(host, dev) == "host_read"
    assert tr._kind(dev, host) == "host_write"
    assert tr._kind(dev, dev) == "d2d"
    with _target.gpu_tiles(sms=132):
        assert tr.launch_config(host, dev) == tr.default_config("host_read", 1024, 512)
        assert tr.launch_config(dev, host) == tr.default_config("host_write", 2048, 512)
        codes = torch.empty(4, 512, dtype=torch.int8)
        assert tr.launch_config(codes, dev).rows_per_pass == 16          # 516 B rows: 8 KiB a pass
    assert tr.launch_config(host, dev) == tr.INTERPRETER_CONFIG
