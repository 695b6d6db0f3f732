"""The bank planner (``ds_pfc.bench.plan``, ``ds-pfc-bench plan``) against the real bank.

The planner computes its figures from formulas; these tests check them against what a
real :class:`~ds_pfc.PartialFC` with a :class:`~ds_pfc.bank.TieredBank` reports on a CPU
(world 1): resident bytes per tier and the staged slot exactly, bytes written back per
step exactly, bytes staged in per step within a statistical tolerance derived below; the
backbone constants against a fresh measurement of the model; the class count at which a
limit stops holding against closed forms written out here; refusals and bad arguments.
"""
from __future__ import annotations

import json
import math

import pytest
import torch

from ds_pfc import PartialFC
from ds_pfc.bank import TieredBank
from ds_pfc.bench import plan as planner
from ds_pfc.bench.plan import BACKBONES, PlanArgumentError, plan
from ds_pfc.cli import bench as bench_cli

C, D, R, BATCH, STEPS = 20_000, 32, 0.1, 16, 26
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


# ---------------------------------------------------------------- the real bank
def _train_and_measure(optimizer: str, storage: str, tier: str, access: str = "staged", seed: int = 0) -> dict:
    """Train a world-1 head on uniform random labels the way a trainer does (forward,
    backward, prefetch the next labels, step) and record what the bank reports."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    extra = {} if access == "staged" else {"host_access": access}
    if storage == "bf16-int8m":     # bf16, the first moment in 8 bits with a scale per row
        coded = {name: (tier, "int8_rowwise") for name in ("momentum_buffer", "exp_avg")
                 if (name == "momentum_buffer") == (optimizer == "sgd")}
        bank = TieredBank.factory(coded, default=(tier, torch.bfloat16), **extra)
    else:
        bank = TieredBank.factory(default=(tier, DTYPES[storage]), **extra)
    kwargs = dict(momentum=0.9) if optimizer == "sgd" else {}
    head = PartialFC(C, D, sample_rate=R, bank=bank, optimizer=optimizer, seed=seed, **kwargs)
    labels = [torch.randint(0, C, (BATCH,), generator=g) for _ in range(STEPS)]
    traffic, staged = [], []
    for t in range(STEPS):
        x = torch.randn(BATCH, D, generator=g, requires_grad=True)
        head(x, labels[t]).backward()
        staged.append(head.memory_report()["resident"]["staged"])
        if t + 1 < STEPS:
            head.prefetch(labels[t + 1])
        head.step(0.1)
        traffic.append(dict(head.last_step_traffic))
    report = head.memory_report()
    totals = (head.bank.bytes_in, head.bank.bytes_out)
    head.close()
    return dict(traffic=traffic, staged=staged, resident=report["resident"], totals=totals)


def _cold_tolerance_rows(active: int, rows: int, samples: int, sigmas: float = 5.0) -> float:
    """Tolerance on the mean number of cold rows per step.

    With uniform labels the active set S(t) is an exchangeable random subset of the C_q rows
    of size |S| (positives included), independent of S(t+1): the overlap |S(t) ∩ S(t+1)|
    is hypergeometric (population C_q, |S| marked, |S| drawn), mean |S|^2 / C_q and variance
    |S| p (1 - p) (C_q - |S|) / (C_q - 1) with p = |S| / C_q. Overlaps of consecutive pairs
    are uncorrelated (given S(t+1), the two overlaps are independent and their conditional
    means do not depend on S(t+1)), so the mean over ``samples`` steps has that variance
    divided by ``samples``; we allow ``sigmas`` standard deviations."""
    p = active / rows
    var = active * p * (1 - p) * (rows - active) / (rows - 1)
    return sigmas * math.sqrt(var / samples)


# (optimizer, storage, tier, host access). "staged" is the planner's host-cpu path (an I/O
# thread gathers and scatters rows); "mapped", where the bank offers it, is its GPU-direct
# host path (kernels read and write the tables in place). Both hold and move the same bytes.
CASES = [("sgd", "fp32", "host", "staged"), ("sgd", "bf16", "host", "staged"), ("adamw", "bf16", "host", "staged"),
         ("sgd", "bf16", "device", "staged"), ("adamw", "bf16", "host", "mapped"),
         ("sgd", "bf16-int8m", "device", "staged"), ("adamw", "bf16-int8m", "host", "staged")]


@pytest.fixture(scope="module")
def measured():
    with pytest.MonkeyPatch.context() as mp:
        # Mapped access moves rows with a Triton kernel, which this CPU run would interpret
        # (minutes); its torch twin moves the same rows. Only the byte counts matter here.
        import ds_pfc.core.head as head_module
        mp.setattr(head_module, "_row_mover", lambda bank: None)      # the bank's torch ops
        return {case: _train_and_measure(*case) for case in CASES}


@pytest.mark.parametrize("case", CASES, ids=["-".join(c) for c in CASES])
def test_resident_bytes_and_staged_slot_match_the_bank(measured, case):
    optimizer, storage, tier, _ = case
    got = measured[case]
    out = plan(C, D, 1, "h100-80g", R, optimizer=optimizer, storage=storage, batch=BATCH, stops=False)
    # Per-row bytes, written out independently: storage bytes of weight + optimizer state
    # (AdamW's int32 step keeps 4 bytes), and 2 x int32 version counters per row and state.
    width = 4 if storage == "fp32" else 2
    row = {"sgd": 2 * D * width, "adamw": 3 * D * width + 4}[optimizer]
    if storage == "bf16-int8m":     # the first moment: D int8 codes and a float32 scale instead of D bf16
        row += (D + 4) - D * width
    states = {"sgd": 2, "adamw": 4}[optimizer]
    assert out["row_bytes"] == row
    assert out["classes_per_rank"] == C
    if tier == "host":
        assert got["resident"]["host"] == out["tiers"]["host"]["host_bytes_rank"] == C * (row + 8 * states)
        assert got["resident"]["device"] == 0 == out["tiers"]["host"]["gpu_bank_bytes"]
        placed = out["tiers"]["host"]["state_bytes"]
        assert sum(v["host"] for v in placed.values()) + out["version_bytes_rank"] == got["resident"]["host"]
    else:
        assert got["resident"]["device"] == out["tiers"]["device"]["gpu_bank_bytes"] == C * row
        assert got["resident"]["host"] == out["tiers"]["device"]["host_bytes_rank"] == C * 8 * states
    # One staged slot: |S_q| = floor(r C_q) rows of every state in its logical dtype (float32;
    # AdamW's step int32), measured while the step's rows are staged.
    active = math.floor(R * C)
    assert out["active_rows"] == active
    logical = {"sgd": 2 * D * 4, "adamw": 3 * D * 4 + 4}[optimizer]
    assert set(got["staged"]) == {active * logical}
    assert out["gpu"]["slot_bytes"] == active * logical


HOST_CASES = [c for c in CASES if c[2] == "host"]


@pytest.mark.parametrize("case", HOST_CASES, ids=["-".join(c) for c in HOST_CASES])
def test_traffic_per_step_matches_the_bank(measured, case):
    optimizer, storage, tier, access = case
    got = measured[case]
    out = plan(C, D, 1, "h100-80g", R, optimizer=optimizer, storage=storage, batch=BATCH, stops=False)
    t = out["tiers"]["host" if access == "mapped" else "host-cpu"]
    # Bytes per row over PCIe, written out independently: the storage bytes (an 8-bit moment
    # crosses as its D codes and a float32 scale on both access modes: the row mover codes it).
    width = 4 if storage == "fp32" else 2
    moved = {"sgd": 2 * D * width, "adamw": 3 * D * width + 4}[optimizer]
    if storage == "bf16-int8m":
        moved += (D + 4) - D * width
    assert t["moved_row_bytes"] == moved
    # Out: mapped access writes back the stepped rows that leave the next set (|S_q| minus
    # the overlap, in expectation the cold rows); staged access every stepped row.
    out_rows = out["cold_rows"] if access == "mapped" else out["active_rows"]
    assert t["moved_rows_out"] == out_rows
    assert (t["pcie_in"], t["pcie_out"]) == (out["moved_rows_in"] * moved, out_rows * moved)
    # The bank counts rows in their storage bytes (for the decoded 8-bit moment that is less
    # than what crosses PCIe, which the count above takes from the staged fetch in bank/staged.py).
    row = out["row_bytes"]
    traffic = got["traffic"]
    # Step t reports its own write-back and the prefetch of step t + 1 issued before it; the
    # first step also stages its whole set synchronously and the last prefetches nothing.
    middle = traffic[1:-1]
    out_bytes = [s["written_back"] for s in middle]
    if access == "staged":
        assert set(out_bytes) == {out_rows * row}, "every step writes back all |S_q| stepped rows"
    else:
        mean_out = sum(out_bytes) / len(out_bytes) / row
        tol = _cold_tolerance_rows(out["active_rows"], C, len(out_bytes))
        assert abs(mean_out - out_rows) <= tol, f"mean rows written back {mean_out:.1f}, planned {out_rows:.1f}"
    in_bytes = [s["staged_in"] for s in middle]
    mean_rows = sum(in_bytes) / len(in_bytes) / row
    tol = _cold_tolerance_rows(out["active_rows"], C, len(in_bytes))
    assert abs(mean_rows - out["moved_rows_in"]) <= tol, \
        f"mean cold rows {mean_rows:.1f}, planned {out['moved_rows_in']:.1f} (tolerance {tol:.1f})"
    # The plan's cold rows are |S_q| (1 - r) here (|S_q| = r C_q exactly).
    assert out["moved_rows_in"] == pytest.approx(out["active_rows"] * (1 - R))
    first = traffic[0]["staged_in"] - out["active_rows"] * row
    assert abs(first / row - out["cold_rows"]) <= _cold_tolerance_rows(out["active_rows"], C, 1)
    assert traffic[-1]["staged_in"] == 0
    assert got["totals"] == (0, 0)                  # every step's report reset the counters
    # With --hbm-share f only the rows outside GPU memory move: (1 - f) of it.
    half = plan(C, D, 1, "h100-80g", R, optimizer=optimizer, storage=storage, batch=BATCH, stops=False,
                hbm_share=0.5)["tiers"]["host"]
    full = out["tiers"]["host"]
    assert half["pcie_in"] == pytest.approx(0.5 * full["pcie_in"])
    assert half["pcie_out"] == pytest.approx(0.5 * full["pcie_out"])


def test_tolerance_would_catch_a_model_without_overlap(measured):
    """The statistical tolerance is tight enough to tell the planned cold rows from
    |S_q| (no overlap credit) or from |S_q| (1 - r)^2."""
    tol = _cold_tolerance_rows(math.floor(R * C), C, STEPS - 2)
    active = math.floor(R * C)
    assert tol < 0.01 * active * (1 - R) < active * R * (1 - R)


# ---------------------------------------------------------------- backbone constants
def saved_tensor_bytes(name: str, batch: int) -> tuple[int, int]:
    """``(parameters, bytes saved for backward)`` of one training forward of backbone
    ``name`` on a bfloat16 batch at 112x112, its parameters cast to bfloat16 as DeepSpeed's
    fp16/bf16 modes cast them: every distinct storage saved for backward that is not a
    parameter. (How ds_pfc.bench.plan.BACKBONES was measured, at batch 2.)"""
    from ds_pfc.models import build_backbone
    torch.manual_seed(0)
    model = build_backbone(name).train()
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16)
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    saved = {}

    def pack(t):
        s = t.untyped_storage()
        if s._cdata not in params:
            saved[s._cdata] = s.nbytes()
        return t
    x = torch.randn(batch, 3, 112, 112).to(torch.bfloat16)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    return sum(p.numel() for p in model.parameters()), sum(saved.values())


def test_backbone_constant_matches_the_model():
    params, saved = saved_tensor_bytes("iresnet50", 2)
    const = BACKBONES["r50"]
    assert params == const["params"]
    assert saved == pytest.approx(const["saved_bytes_batch2"], rel=0.10)


# ---------------------------------------------------------------- scaling
H100 = dict(classes=128_000_000, dim=512, gpus=8, gpu="h100-80g", sample_rate=0.1)
# Written out here from the stated defaults (docs/planner.md), not taken from the planner.
MOVER_GBPS = 16 * 8 * 1024 / 2e-6 / 1e9       # 16 programs x 8 KiB of rows in flight / 2 us
PATCH_GBPS = 32 * 8 * 1024 / 1e-6 / 1e9       # 32 programs x 8 KiB / 1 us (HBM)
HEAD_FLOPS = 195e12                            # the head's effective rate on H100/H200


def _per_class_seconds(p: dict) -> dict:
    """Seconds of each transfer per class of the job (continuous C, |S_q| = r C / k), for SGD
    with momentum, mapped access: in (cold rows), patch (overlap rows, float32 on the GPU),
    out (the stepped rows that leave the next set: as many as the cold rows), the head's
    compute, and node host-memory traffic."""
    k, d, r = p["gpus"], p["dim"], p["sample_rate"]
    row = 2 * d * (2 if p["storage"] == "bf16" else 4)
    logical = 2 * d * 4
    zc = min(p.get("zero_copy_gbps") or MOVER_GBPS, p["pcie_gbps"] / p["gpus_per_uplink"]) * 1e9
    ranks = min(k, p["gpus_per_node"])
    return dict(t_in=r * (1 - r) * row / k / zc, t_patch=r * r * logical / k / (PATCH_GBPS * 1e9),
                t_out=r * (1 - r) * row / k / zc, head=3 * 2 * 128 * k * r * d / k / HEAD_FLOPS,
                host=ranks * 2 * r * (1 - r) * row / k / (p["host_gbps"] * 1e9))


def _closed_form(which: str, p: dict) -> float:
    """The class count at which a limit is reached, solved by hand (continuous C, C_q = C/k,
    |S_q| = r C_q), independently of the planner's code. Every time is linear in C and the
    window is the backbone's step plus the head's time (also linear in C)."""
    k, d, r = p["gpus"], p["dim"], p["sample_rate"]
    row = 2 * d * (2 if p["storage"] == "bf16" else 4)           # SGD: weight + momentum
    step = p["step_ms"] / 1e3
    x = _per_class_seconds(p)
    if which == "host RAM":
        # node: its ranks' C / k (row + 2 states x 8 B of counters) <= RAM
        return p["host_ram_gb"] * 1e9 * k / min(k, p["gpus_per_node"]) / (row + 16)
    if which == "2 sets":
        return step / (x["t_in"] + x["t_patch"] + x["t_out"] - x["head"])
    if which == "3 sets":
        return step / (max(x["t_in"] + x["t_patch"], x["t_out"]) - x["head"])
    if which == "host memory":
        return step / (x["host"] - x["head"])
    bb = BACKBONES["r100"]
    if which == "GPU memory":
        # device tier per GPU: bank row + 3 float32 slots (2 x 8 d B per row) + float32 gradient (4 d)
        # + normalised bf16 centers and norms (2 d + 4) + the kept float16 cosines (2 N, N = 128 k:
        # within the 4 GiB keep budget at these stops) per active row + 14 B sampler keys, per
        # class of the rank; the staged fetch's gather of the cold rows in storage dtype plus
        # their float32 copy (one state: row / 2 + 4 d per cold row); fixed: the backbone
        # (16 B/param + 128 x activations) and 3 x N x d float32 embeddings; 3 GB reserve.
        # With staged access the pool keeps a third slot set; the gather goes 32 MiB of float32
        # rows (16,384 rows at d = 512) at a time: a constant.
        n = 128 * k
        chunk_rows = (32 << 20) // (4 * d)
        fixed = bb["params"] * 16 + 128 * bb["saved_bytes_batch2"] / 2 + 3 * n * d * 4 + chunk_rows * (row / 2 + 4 * d)
        per_class = row + r * (3 * 8 * d + 4 * d + 2 * d + 4 + 2 * n) + 14
        return k * (77e9 - fixed) / per_class
    if which == "GPU memory at resume":
        # the bank, the backbone's state and the streamed resume's one chunk (8 MiB)
        return k * (77e9 - bb["params"] * 16 - (8 << 20)) / row
    raise KeyError(which)


SCALING = [
    ("host", "host RAM per node", "host RAM", dict(storage="bf16", host_ram_gb=512.0)),
    ("host", "host RAM per node", "host RAM", dict(storage="bf16", host_ram_gb=512.0, gpus=32)),
    ("host", "bank stream time", "2 sets", dict(storage="bf16", slot_sets=2)),
    ("host", "bank stream time", "2 sets", dict(storage="fp32", step_ms=150.0, sample_rate=0.2, slot_sets=2)),
    ("host", "bank stream time", "2 sets", dict(storage="bf16", zero_copy_gbps=45.0, gpus_per_uplink=2, slot_sets=2)),
    ("host", "bank stream time", "3 sets", dict(storage="fp32", step_ms=100.0, sample_rate=0.2)),
    ("host", "bank stream time", "3 sets", dict(storage="bf16", step_ms=60.0, zero_copy_gbps=20.0)),
    ("host", "host memory time", "host memory", dict(storage="bf16", host_gbps=100.0, zero_copy_gbps=45.0)),
    ("device", "GPU memory per GPU", "GPU memory", dict(storage="bf16")),
    ("device", "GPU memory per GPU", "GPU memory", dict(storage="fp32")),
    ("device", "GPU memory at resume", "GPU memory at resume", dict(storage="bf16")),
]


@pytest.mark.parametrize("tier,check,form,opts", SCALING, ids=[f"{s[0]}-{s[2]}-{i}" for i, s in enumerate(SCALING)])
def test_stop_class_count_is_where_the_figure_crosses_the_limit(tier, check, form, opts):
    args = dict(H100, **opts)
    out = plan(**args)
    entry = next(c for c in out["tiers"][tier]["checks"] if c["name"] == check)
    stop = entry["max_classes"]
    assert stop is not None and stop > 0
    # Independent closed form (continuous C; the planner's integer rounding moves it by far
    # less than 0.1%).
    expected = _closed_form(form, dict(planner.DEFAULTS, **args))
    assert stop == pytest.approx(expected, rel=1e-3)

    def at(c):
        e = next(x for x in plan(**dict(args, classes=c), stops=False)["tiers"][tier]["checks"] if x["name"] == check)
        return e["value"], e["limit"]
    below, above = at(stop), at(stop + args["gpus"])
    assert below[0] <= below[1] and above[0] > above[1]


# ---------------------------------------------------------------- what is built and shared
def test_two_slot_sets_take_turns_and_three_overlap_for_one_more_set():
    """At 256M on 8 H100s (bf16, SGD) the mapped tier's streams take in + patch + out with two
    slot sets (the fetch reuses the set the write-back reads) and max(in + patch, out) with
    three, which keep a third set of float32 slots on the GPU at every class count."""
    args = dict(H100, classes=256_000_000, storage="bf16", zero_copy_gbps=45.0)
    two = plan(**args, slot_sets=2, stops=False)
    three = plan(**args, stops=False)
    x = _per_class_seconds(dict(planner.DEFAULTS, **args))
    c = 256e6
    for out, want in ((two, (x["t_in"] + x["t_patch"] + x["t_out"]) * c),
                      (three, max(x["t_in"] + x["t_patch"], x["t_out"]) * c)):
        assert out["tiers"]["host"]["stream_s"] == pytest.approx(want, rel=1e-6)
    assert two["tiers"]["host"]["stream_s"] / three["tiers"]["host"]["stream_s"] == pytest.approx(2.0, abs=0.1)
    slot = 3_200_000 * 2 * 512 * 4
    assert three["tiers"]["host"]["third_slot_bytes"] == slot and two["tiers"]["host"]["third_slot_bytes"] == 0
    assert three["tiers"]["host"]["gpu_bytes"] - two["tiers"]["host"]["gpu_bytes"] == pytest.approx(slot)
    small = plan(**dict(args, classes=64_000_000), stops=False)["tiers"]["host"]
    assert small["third_slot_bytes"] == 3_200_000 // 4 * 2 * 512 * 4
    # Staged access keeps three sets whatever --slot-sets says.
    assert two["tiers"]["host-cpu"]["third_slot_bytes"] == slot
    with pytest.raises(ValueError, match="--slot-sets: must be one of 2, 3, got 4"):
        plan(**args, slot_sets=4)


def test_gpus_behind_one_uplink_share_it():
    """Two GPUs per x16 uplink: each gets half the link when the link, not the mover, binds."""
    args = dict(H100, storage="bf16", zero_copy_gbps=45.0)
    one = plan(**args, stops=False)["tiers"]
    two = plan(**args, gpus_per_uplink=2, stops=False)["tiers"]
    assert two["host"]["pcie_in_s"] == pytest.approx(one["host"]["pcie_in_s"] * 45.0 / 25.0)
    assert two["host-cpu"]["pcie_out_s"] == pytest.approx(one["host-cpu"]["pcie_out_s"] * 2)
    # The mover's stated launch (65.5 GB/s by its bytes in flight) is above the link: the link
    # binds, and two GPUs behind one uplink get half of it each.
    built = plan(**dict(H100, storage="bf16"), stops=False)
    assert MOVER_GBPS > 50.0 and built["rates"]["zero_copy_gbps"] == pytest.approx(50.0)
    assert plan(**dict(H100, storage="bf16"), gpus_per_uplink=2, stops=False)["rates"]["zero_copy_gbps"] == \
        pytest.approx(25.0)
    # A quarter of the programs: a quarter of the bytes in flight, and the mover binds.
    assert plan(**dict(H100, storage="bf16"), mover_programs=4, stops=False)["rates"]["zero_copy_gbps"] == \
        pytest.approx(MOVER_GBPS / 4)


def test_several_nodes_each_bring_their_own_host():
    """--gpus 32 is four nodes of 8: per node the host RAM, host-memory traffic and CPU of 8
    ranks, as on one node with a quarter of the classes; as one node of 32 it is 4x that."""
    four = plan(512_000_000, 512, 32, "h100-80g", 0.1, storage="bf16", stops=False)
    one = plan(128_000_000, 512, 8, "h100-80g", 0.1, storage="bf16", stops=False)
    big = plan(512_000_000, 512, 32, "h100-80g", 0.1, storage="bf16", gpus_per_node=32, stops=False)
    assert (four["nodes"], four["ranks_per_node"], big["nodes"], big["ranks_per_node"]) == (4, 8, 1, 32)
    for tier in ("host", "host-cpu"):
        for key in ("host_bytes_node", "host_traffic_node", "cpu_seconds_node", "pcie_in", "pcie_out"):
            assert four["tiers"][tier][key] == pytest.approx(one["tiers"][tier][key]), (tier, key)
        assert big["tiers"][tier]["host_bytes_node"] == pytest.approx(4 * one["tiers"][tier]["host_bytes_node"])
    assert "on 4 nodes of 8" in planner.format_plan(four).splitlines()[0]


def test_the_window_holds_the_head_and_the_mover_takes_sms():
    out = plan(**dict(H100, storage="bf16"), stops=False)
    active = 1_600_000
    head = 3 * 2 * 1024 * active * 512 / HEAD_FLOPS
    assert out["window"]["head_s"] == pytest.approx(head)
    assert out["window"]["window_s"] == pytest.approx(0.3 + head)
    t = out["tiers"]["host"]
    assert t["backbone_slowdown"] == pytest.approx(16 / 132 * min(1.0, t["stream_s"] / (0.3 + head)))
    assert plan(**dict(H100, storage="bf16"), head_ms=10.0, stops=False)["window"]["window_s"] == pytest.approx(0.31)


def test_temporaries_and_resume_are_counted():
    """Device tier, bf16 weight + 8-bit momentum on the torch int8 path (a bank without the
    row mover): its three float32 chunks of 32 MiB and the staged fetch's gather + float32 copy
    of a chunk of the weight's cold rows; none with the int8 path in the mover (as built) and mapped
    access. Resume: a whole float32 state on the GPU, or a chunk (as built: 8 MiB)."""
    args = dict(H100, storage="bf16-int8m", int8_in_mover=False, resume_chunk_mb=0.0)
    active, cold, d, cq = 1_600_000, 1_440_000, 512, 16_000_000
    t = plan(**args, stops=False)["tiers"]["device"]
    chunk_rows, chunk = (32 << 20) // (4 * d), 32 << 20     # the fetch's and the coding's chunks
    assert t["temporaries"] == {"int8 decode/encode (torch ops)": 3 * chunk,
                                "staged fetch gather + float32 copy": chunk_rows * (2 * d + 4 * d)}
    fused = plan(**dict(args, int8_in_mover=True), device_access="mapped", stops=False)["tiers"]["device"]
    assert fused["temporaries"] == {}
    assert t["gpu_bytes"] - fused["gpu_bytes"] == pytest.approx(sum(t["temporaries"].values()))
    assert t["gpu_resume_bytes"] == pytest.approx(cq * (2 * d + d + 4) + BACKBONES["r100"]["params"] * 16 + cq * d * 4)
    # Staged host access lands the cold rows on the GPU as they crossed PCIe (bf16 weight;
    # the 8-bit moment decoded on the host: float32) and widens them: the bf16 weight is widest.
    assert plan(**args, stops=False)["tiers"]["host-cpu"]["temporaries"] == {
        "staged fetch landing + float32 copy": chunk_rows * (2 * d + 4 * d)}
    coded = plan(**dict(args, int8_in_mover=True), stops=False)["tiers"]["host-cpu"]
    assert plan(**dict(H100, storage="bf16-int8m"), stops=False)["tiers"]["host-cpu"]["moved_row_bytes"] == \
        2 * d + d + 4                                           # the default: as built
    assert coded["moved_row_bytes"] == 2 * d + d + 4           # the codes cross PCIe, not float32
    assert plan(**args, stops=False)["tiers"]["host-cpu"]["moved_row_bytes"] == 2 * d + 4 * d
    assert plan(**dict(H100, storage="fp32"), stops=False)["tiers"]["host-cpu"]["temporaries"] == {
        "staged fetch landing + float32 copy": chunk_rows * 4 * d}
    assert cold > chunk_rows                                   # a whole-set temporary would be larger
    chunked = plan(**dict(args, resume_chunk_mb=256.0), stops=False)["tiers"]["device"]
    assert t["gpu_resume_bytes"] - chunked["gpu_resume_bytes"] == pytest.approx(cq * d * 4 - 256e6)
    built = plan(**dict(H100, storage="bf16-int8m"), stops=False)["tiers"]["device"]
    assert t["gpu_resume_bytes"] - built["gpu_resume_bytes"] == pytest.approx(cq * d * 4 - (8 << 20))


# ---------------------------------------------------------------- what the bank refuses
def test_planner_refuses_what_the_bank_refuses():
    """8-bit rows in mapped host memory on CUDA, and --hbm-share with staged access, are
    refused by the bank: the planner marks those tiers not built and never suggests them."""
    from ds_pfc.bank import Placement
    cuda = TieredBank(8, torch.device("cuda"), placements={"momentum_buffer": Placement("host", "int8_rowwise")},
                      default=Placement("host", torch.bfloat16), host_access="mapped")
    with pytest.raises(ValueError, match="8-bit rows in (mapped )?host memory"):
        cuda.add_state("momentum_buffer", 4, torch.float32)
    with pytest.raises(ValueError, match="hbm_share"):
        TieredBank.factory(default="host", hbm_share=0.5)               # staged access
    out = plan(**dict(H100, storage="bf16-int8m"), int8_in_mover=False, stops=False)
    assert not out["tiers"]["host"]["available"] and "not built" in planner.format_plan(out)
    assert out["tiers"]["host-cpu"]["available"]
    assert plan(**dict(H100, storage="bf16-int8m"), stops=False)["tiers"]["host"]["available"]     # as built
    share = plan(**dict(H100, storage="bf16"), hbm_share=0.5, stops=False)["tiers"]
    assert share["host"]["available"] and not share["host-cpu"]["available"]
    assert not share["host-cpu"]["fits"] and not share["host-cpu"]["hides"]


def _suggestions(text: str) -> list[tuple[str, list[str]]]:
    line = next(x for x in text.splitlines() if x.startswith("change one of: "))
    out = []
    for part in line[len("change one of: "):].split("; "):
        change, then = part.split(" (then ", 1) if " (then " in part else (part, "")
        out.append((change, [w.split()[0] for w in then.rstrip(")").split(", ")]))
    return out


def test_refuses_when_no_tier_fits(capsys):
    rc = bench_cli.main(["plan", *REFUSED])
    assert rc == 2
    err = capsys.readouterr()
    text = err.out + err.err
    assert "no tier fits" in text
    assert not any("nvme" in line.lower() for line in text.splitlines() if not line.startswith("  not a tier: "))
    # Each suggested change, re-planned, makes the tiers it names fit, and they are built.
    suggested = _suggestions(err.out)
    assert suggested
    base = dict(classes=64_000_000, dim=512, gpus=8, gpu="a100-40g", sample_rate=0.1, storage="fp32",
                backbone="r100", batch=128, host_ram_gb=200.0)
    for change, tiers in suggested:
        flag, value = change.split()[-2:] if change.startswith("a bigger") else change.split()[:2]
        key = planner.FLAGS_BY_OPTION[flag]
        q = dict(base, **{key: type(base.get(key, planner.DEFAULTS.get(key)))(value) if key != "gpu" else value})
        alt = plan(**q, stops=False)
        for tier in tiers:
            assert alt["tiers"][tier]["available"] and alt["tiers"][tier]["fits"], (change, tier)
    out = plan(**base)
    assert out["refused"] and not out["fits_any"]
    assert plan(**dict(base, gpus=32))["refused"] is None


def test_one_billion_classes_on_one_node_is_refused_and_four_nodes_are_offered(capsys):
    rc = bench_cli.main(["plan", "--classes", "1B", "--dim", "512", "--gpus", "8", "--gpu", "h100-80g",
                         "--sample_rate", "0.1", "--storage", "bf16"])
    assert rc == 2
    text = capsys.readouterr().out
    assert not any("nvme" in line.lower() for line in text.splitlines() if not line.startswith("  not a tier: "))
    suggested = dict(_suggestions(text))
    assert any(s.startswith("--gpus 32") for s in suggested)
    # nothing that models work not in the bank yet
    assert not any(flag in s for s in suggested for flag in ("--int8-in-mover", "--resume-chunk-mb"))
    four = plan(1_000_000_000, 512, 32, "h100-80g", 0.1, storage="bf16")
    assert four["nodes"] == 4 and four["tiers"]["host"]["fits"]


REFUSED = ["--classes", "64M", "--dim", "512", "--gpus", "8", "--gpu", "a100-40g", "--sample_rate", "0.1",
           "--storage", "fp32", "--backbone", "r100", "--batch", "128", "--host-ram-gb", "200"]


BAD = [
    (["--sample_rate", "0"], "--sample_rate"),
    (["--sample_rate", "1.5"], "--sample_rate"),
    (["--sample_rate", "abc"], "--sample_rate"),
    (["--gpus", "0"], "--gpus"),
    (["--gpu", "h100"], "--gpu"),
    (["--hbm-share", "1.2"], "--hbm-share"),
    (["--classes", "0"], "--classes"),
    (["--classes", "12X"], "--classes"),
    (["--classes", "4"], "--classes"),            # fewer classes than GPUs
    (["--storage", "fp16"], "--storage"),
    (["--optimizer", "adam"], "--optimizer"),
    (["--backbone", "r34"], "--backbone"),
    (["--batch", "-1"], "--batch"),
    (["--step-ms", "0"], "--step-ms"),
    (["--pcie-gbps", "nan"], "--pcie-gbps"),
    (["--gpus-per-uplink", "0"], "--gpus-per-uplink"),
    (["--gpus-per-uplink", "16"], "--gpus-per-uplink"),      # more than --gpus-per-node
    (["--gpus-per-node", "0"], "--gpus-per-node"),
    (["--slot-sets", "4"], "--slot-sets"),
    (["--zero-copy-gbps", "0"], "--zero-copy-gbps"),
    (["--head-ms", "-1"], "--head-ms"),
    (["--resume-chunk-mb", "-5"], "--resume-chunk-mb"),
    (["--device-access", "direct"], "--device-access"),
    (["--hbm-share", "1"], "--hbm-share"),
]
GOOD = {"--classes": "128M", "--dim": "512", "--gpus": "8", "--gpu": "h100-80g", "--sample_rate": "0.1"}


@pytest.mark.parametrize("change,flag", BAD, ids=[" ".join(b[0]) for b in BAD])
def test_bad_arguments_are_rejected_naming_the_argument(change, flag, capsys):
    argv = dict(GOOD)
    argv[change[0]] = change[1]
    with pytest.raises(SystemExit) as exc:
        planner.main([x for kv in argv.items() for x in kv])
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err


def test_api_errors_name_the_argument():
    with pytest.raises(PlanArgumentError) as exc:
        plan(1000, 64, 2, "h100-80g", 0.0)
    assert exc.value.argument == "sample_rate" and "--sample_rate" in str(exc.value)
    with pytest.raises(PlanArgumentError) as exc:
        plan(1000, 64, 2, "h100-80g", 0.1, hbm_share=-0.1)
    assert exc.value.argument == "hbm_share"
    with pytest.raises(TypeError):
        plan(1000, 64, 2, "h100-80g", 0.1, sample=0.1)


# ---------------------------------------------------------------- output
def test_cli_prints_the_table_and_writes_json(tmp_path, capsys):
    path = tmp_path / "plan.json"
    rc = bench_cli.main(["plan", *[x for kv in GOOD.items() for x in kv], "--storage", "bf16", "--backbone", "r100",
                         "--json", str(path)])
    assert rc == 0
    text = capsys.readouterr().out
    for word in ("device", "host-cpu", "fits up to", "hides up to", "PCIe in"):
        assert word in text
    doc = json.loads(path.read_text())
    assert doc["date"] and doc["inputs"]["sample_rate"] == 0.1
    got = doc["plans"][0]
    ref = plan(128_000_000, 512, 8, "h100-80g", 0.1, storage="bf16", backbone="r100")
    assert got["tiers"]["host"]["pcie_in"] == pytest.approx(ref["tiers"]["host"]["pcie_in"])
    assert got["tiers"]["device"]["max_classes_fit"] == ref["tiers"]["device"]["max_classes_fit"]
    # Bytes per state at 128M / 8 ranks, bf16: 16M rows x 1 KiB each.
    assert [s["bytes"] for s in got["states"]] == [16_000_000 * 1024] * 2


def test_sweep_prints_one_line_per_class_count(capsys):
    rc = planner.main(["--classes", "64M,128M", "--dim", "512", "--gpus", "8", "--gpu", "h200", "--sample_rate", "0.1",
                       "--storage", "bf16"])
    assert rc == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("64M") for line in lines) and any(line.startswith("128M") for line in lines)


@pytest.mark.parametrize("share", [0.25, 0.6])
def test_hbm_share_matches_the_banks_split(share):
    """--hbm-share f against a mapped bank with hbm_share=f: the rows kept in GPU memory
    and those left in host memory, exactly (C_q f is whole here)."""
    bank = TieredBank.factory(default=("host", torch.bfloat16), host_access="mapped", hbm_share=share)
    head = PartialFC(C, D, sample_rate=R, bank=bank, optimizer="sgd", momentum=0.9)
    resident = head.memory_report()["resident"]
    head.close()
    out = plan(C, D, 1, "h100-80g", R, optimizer="sgd", storage="bf16", hbm_share=share, batch=BATCH, stops=False)
    row = 2 * D * 2                                     # bf16 weight + bf16 momentum
    assert resident["device"] == out["tiers"]["host"]["gpu_bank_bytes"] == round(share * C) * row
    assert resident["host"] == out["tiers"]["host"]["host_bytes_rank"] == (C - round(share * C)) * row + C * 2 * 8


def test_kept_cosines_count_until_they_exceed_the_keep_budget():
    """The softmax's buffer is the float16 cosines N x |S_q| while they fit keep_bytes (the
    triton backend's default path), else one G block of block_bytes; nothing else changes."""
    args = dict(H100, storage="bf16", batch=128)
    cosines = 128 * 8 * 1_600_000 * 2
    kept = plan(**args)["gpu"]
    assert kept["cosines_kept"] and kept["logits_block_bytes"] == cosines
    recompute = plan(**args, keep_bytes=cosines - 1)["gpu"]
    assert not recompute["cosines_kept"] and recompute["logits_block_bytes"] == 1 << 28
    assert kept["common_bytes"] - recompute["common_bytes"] == cosines - (1 << 28)
    with pytest.raises(ValueError, match="--keep-bytes: must be >= 0"):
        plan(**args, keep_bytes=-1)


def test_backbone_is_counted_by_default_and_named_first():
    assert planner.DEFAULTS["backbone"] == "r100"
    out = plan(**H100, stops=False)
    assert planner.format_plan(out).startswith("Bank plan: backbone r100 at batch 128 counted; ")
    bare = plan(**H100, backbone="none", stops=False)
    assert planner.format_plan(bare).startswith("Bank plan: no backbone (--backbone none: the head alone); ")
    assert out["gpu"]["common_bytes"] - bare["gpu"]["common_bytes"] == pytest.approx(
        BACKBONES["r100"]["params"] * 16 + 128 * BACKBONES["r100"]["saved_bytes_batch2"] / 2)


def test_margins_replace_yes_and_no():
    out = plan(**dict(H100, storage="bf16"))
    for t in out["tiers"].values():
        for c in t["checks"]:
            assert c["margin"] == pytest.approx(c["limit"] - c["value"])
        assert t["gpu_margin_bytes"] == min(c["margin"] for c in t["checks"] if c["name"].startswith("GPU"))
    text = planner.format_plan(out)
    assert "GPU memory margin (GB)" in text and "time margin in the" in text
    assert " yes " not in text and " NO " not in text


def test_the_256m_mapped_plan_states_its_assumptions(capsys):
    rc = bench_cli.main(["plan", "--classes", "256M", "--gpus", "8", "--gpu", "h100-80g", "--storage", "bf16-int8m",
                         "--dim", "512", "--sample_rate", "0.1"])
    text = capsys.readouterr().out
    assert rc == 0
    for words in ("Assumptions:", "3 slot sets, the two directions overlap", "128 KiB in flight (16 programs x 8 rows x 1024 B) / 2 us = 65.5 GB/s "
                  "(Little's law, not measured), capped by the uplink", "head 51.6 ms estimated",
                  "writes back only the rows that leave the next set", "8-bit rows: coded in the mover",
                  "resume: streamed in chunks of 8.4 MB", "not a tier: nvme"):
        assert words in text, words


@pytest.mark.parametrize("doc", ["README.md", "docs/planner.md"])
def test_docs_show_what_the_planner_prints(doc):
    """Every planner block in the docs is the planner's output for the arguments it names
    (regenerate with ``python -c "from ds_pfc.bench.plan import refresh_docs; refresh_docs()"``)."""
    import pathlib
    text = (pathlib.Path(__file__).resolve().parents[1] / doc).read_text()
    assert "<!-- ds-pfc-bench plan " in text
    assert planner.refresh_text(text) == text


def test_a_tier_check_json_sets_the_measured_rates(tmp_path, capsys):
    """--measured reads a tier check's planner_defaults: the slower of the mover's read and
    write, the device-to-device rate and the slower DMA direction replace the stated defaults,
    an option given on the command line wins, and a file without them is refused by name."""
    doc = {"planner_defaults": {"zero_copy_read_gbps": 31.5, "zero_copy_write_gbps": 27.0, "d2d_gbps": 900.0,
                                "dma_h2d_gbps": 48.0, "dma_d2h_gbps": 44.0, "register_gbps": None}}
    path = tmp_path / "tier-check.json"
    path.write_text(json.dumps(doc))
    args = ["plan", "--classes", "256M", "--gpus", "8", "--gpu", "h100-80g", "--storage", "bf16", "--dim", "512",
            "--sample_rate", "0.1", "--json", str(tmp_path / "plan.json")]
    assert bench_cli.main(args + ["--measured", str(path)]) == 0
    out = json.loads((tmp_path / "plan.json").read_text())["plans"][0]
    assert "measured rates from" in capsys.readouterr().out
    assert out["rates"]["zero_copy_gbps"] == pytest.approx(27.0)          # below the 44 GB/s link
    assert out["rates"]["patch_gbps"] == pytest.approx(900.0)
    assert out["inputs"]["pcie_gbps"] == pytest.approx(44.0)
    assert bench_cli.main(args + ["--measured", str(path), "--zero-copy-gbps", "40"]) == 0
    out = json.loads((tmp_path / "plan.json").read_text())["plans"][0]
    assert out["rates"]["zero_copy_gbps"] == pytest.approx(40.0)
    bad = tmp_path / "other.json"
    bad.write_text("{}")
    with pytest.raises(SystemExit) as err:
        bench_cli.main(args + ["--measured", str(bad)])
    assert err.value.code == 2
    assert "--measured" in capsys.readouterr().err
