"""Mapped host access (``TieredBank(host_access="mapped")``): rows move by a kernel that
reads and writes the bank's tables in place, on the bank's side stream, with the row ids,
the split of the next active set and the masks on the device.

References, independent of the code under test:

* the row-move kernel (Triton, under the interpreter here) and its torch twin against a
  Python loop over rows with torch's own casts;
* every trajectory against the plain device bank (``bank=None``), bitwise, as
  ``tests/test_tiers.py`` checks the staged path: losses, centers, every state_dict
  tensor; bfloat16 storage against the device bank whose centers are rounded after every
  write;
* the traffic against the cold rows ``S(t+1) \\ S(t)`` counted with ``torch.isin`` from
  the sampler's sets;
* host work per step with the op counter: the bank's torch ops do not grow with |S|, and
  none of them synchronises with the device.

Trajectories run with the plain CPU runtime or the stream emulator (late,
out-of-order side-stream work, poisoned pool buffers, hazard checks).
"""
from __future__ import annotations

import os

import pytest
import torch

from ds_pfc import ArcFace, PartialFC
from ds_pfc.bank import Placement, TieredBank
from ds_pfc.bank.streams import DEBUG_ENV, StreamError
from ds_pfc.bench.counting import OpCounter
from ds_pfc.bank.rows import move_rows_torch_
from ds_pfc.kernels import triton_rows

C, D, STEPS = 1021, 16, 10
SAMPLE_RATE = 0.2
OPT = {
    "sgd": dict(optimizer="sgd", momentum=0.9, weight_decay=5e-4),
    "adamw": dict(optimizer="adamw", betas=(0.9, 0.99), eps=1e-6, weight_decay=0.01),
}
LR = {"sgd": 2.0, "adamw": 0.01}

needs_kernel = pytest.mark.skipif(not triton_rows.available(),
                                  reason="triton is not installed or TRITON_INTERPRET=1 was not set before import")


def _streams(monkeypatch, mode: str) -> None:
    """Run with the plain CPU runtime ("sync") or the stream emulator ("emulated")."""
    monkeypatch.setenv(DEBUG_ENV, "1" if mode == "emulated" else "0")


# ---------------------------------------------------------------- the kernel
def _reference_move(src, src_idx, dst, dst_idx, mask, round_dtype):
    out = dst.clone()
    for i in range(len(mask) if mask is not None else (len(src_idx) if src_idx is not None else len(dst_idx))):
        if mask is not None and not bool(mask[i]):
            continue
        s = int(src_idx[i]) if src_idx is not None else i
        d = int(dst_idx[i]) if dst_idx is not None else i
        v = src[s]
        if round_dtype is not None:
            v = v.to(round_dtype)
        out[d] = v.to(dst.dtype)
    return out


def _awkward_floats(n: int, width: int) -> torch.Tensor:
    """float32 values whose bfloat16 rounding is hard: exact ties (even and odd), values
    that carry into the exponent, the largest finite floats (round to inf), subnormals,
    signed zeros, inf and NaN, then random bits."""
    special = torch.tensor([0x3F808000, 0x3F818000, 0x3F7FFFFF, 0x7F7FFFFF, 0xFF7FFFFF, 0x00000001, 0x807FFFFF,
                            0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0x3F80FFFF],
                           dtype=torch.int64)
    bits = torch.randint(0, 2 ** 32, (n * max(width, 1),), dtype=torch.int64)
    bits[: special.numel()] = special
    bits = torch.where(bits >= 2 ** 31, bits - 2 ** 32, bits).to(torch.int32)
    return bits.view(torch.float32).reshape((n, width) if width else (n,))


CASTS = {  # (src dtype, dst dtype, round dtype)
    "bf16->fp32": (torch.bfloat16, torch.float32, None),
    "fp32->bf16": (torch.float32, torch.bfloat16, None),
    "fp32->fp32 via bf16": (torch.float32, torch.float32, torch.bfloat16),
    "fp32->fp16": (torch.float32, torch.float16, None),
    "fp32->fp32": (torch.float32, torch.float32, None),
    "int32": (torch.int32, torch.int32, None),
}


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")    # fp16: huge floats become inf, as in torch
@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("cast", list(CASTS))
@pytest.mark.parametrize("width", [0, 1, 13])
@pytest.mark.parametrize("use", ["gather-masked", "scatter", "scatter-masked", "patch"])
def test_move_rows_matches_a_loop_over_rows(impl, cast, width, use):
    if impl == "triton" and not triton_rows.available():
        pytest.skip("triton is not installed or TRITON_INTERPRET=1 was not set before import")
    move = triton_rows.move_rows_ if impl == "triton" else move_rows_torch_
    src_dtype, dst_dtype, round_dtype = CASTS[cast]
    g = torch.Generator().manual_seed(width * 31 + len(cast))
    torch.manual_seed(width * 31 + len(cast))
    shape = lambda n: (n, width) if width else (n,)
    if src_dtype.is_floating_point:
        table = _awkward_floats(83, width).to(src_dtype)
    else:
        table = torch.randint(-1000, 1000, shape(83), dtype=src_dtype, generator=g)
    n = 71          # 5 blocks of 16 rows on 2 programs: ragged, and several strides per program
    if use == "gather-masked":      # fetch: table rows -> slot positions, where the mask is set
        src, src_idx, dst_idx = table, torch.randperm(83, generator=g)[:n], None
        dst = torch.zeros(shape(n), dtype=dst_dtype) - 3
        mask = torch.rand(n, generator=g) < 0.6
    elif use.startswith("scatter"):  # write-back: slot positions -> table rows (masked: those leaving)
        src, src_idx, dst_idx = table[:n].clone(), None, torch.randperm(83, generator=g)[:n]
        dst = torch.zeros(shape(83), dtype=dst_dtype) + 5
        mask = torch.rand(n, generator=g) < 0.6 if use == "scatter-masked" else None
    else:                           # patch: slot A's positions -> slot B positions, where held
        src, src_idx, dst_idx = table, torch.randint(0, 83, (n,), generator=g), None
        dst = torch.zeros(shape(n), dtype=dst_dtype) + 7
        mask = torch.rand(n, generator=g) < 0.5
    expected = _reference_move(src, src_idx, dst, dst_idx, mask, round_dtype)
    got = move(src, src_idx, dst.clone(), dst_idx, mask, round_dtype, unique_dst=use == "scatter-masked")
    assert got.dtype == expected.dtype
    same = (got == expected) | (got.isnan() & expected.isnan()) if got.is_floating_point() else got == expected
    assert bool(same.all()), f"{impl} {cast} width {width} {use}: {int((~same).sum())} values differ"
    if got.is_floating_point():     # and signed zeros keep their sign
        assert torch.equal(torch.signbit(got[~got.isnan()]), torch.signbit(expected[~expected.isnan()]))


def test_move_rows_rejects_bad_arguments():
    t = torch.zeros(4, 3)
    with pytest.raises(ValueError, match="src and dst must have rows of one shape"):
        move_rows_torch_(t, None, torch.zeros(4, 2), None)
    with pytest.raises(ValueError, match="mask must be a 1-d torch.bool"):
        move_rows_torch_(t, torch.arange(3), torch.zeros(3, 3), None, torch.ones(3))
    with pytest.raises(ValueError, match="src_idx must be"):
        move_rows_torch_(t, torch.arange(3.0), torch.zeros(3, 3), None)
    with pytest.raises(ValueError, match="dst needs at least 4 rows"):
        move_rows_torch_(t, None, torch.zeros(2, 3), None)
    with pytest.raises(TypeError, match="both be floating or both integer"):
        move_rows_torch_(t, None, torch.zeros(4, 3, dtype=torch.int32), None)
    with pytest.raises(ValueError, match="contiguous along its last dimension"):
        move_rows_torch_(torch.zeros(3, 4).t(), None, torch.zeros(4, 3), None)
    if triton_rows.available():
        with pytest.raises(ValueError, match="src and dst must have rows of one shape"):
            triton_rows.move_rows_(t, None, torch.zeros(4, 2), None)
        with pytest.raises(TypeError, match="from float32 only"):
            triton_rows.move_rows_(torch.zeros(2, 3, dtype=torch.float64), None,
                                   torch.zeros(2, 3, dtype=torch.bfloat16), None)


# ---------------------------------------------------------------- trajectories
def _batches(steps: int, seed: int = 0):
    """Labels from a pool of 120 classes (consecutive active sets overlap), embeddings
    near a per-class prototype (the loss falls), batch sizes that change."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.randperm(C, generator=g)[:120]
    proto = torch.randn(C, D, generator=g)
    out = []
    for t in range(steps):
        y = pool[torch.randint(0, pool.numel(), (5 + (3 * t) % 7,), generator=g)]
        out.append((proto[y] + 0.3 * torch.randn(y.numel(), D, generator=g), y))
    return out


def _head(opt, bank=None, **kw):
    return PartialFC(C, D, sample_rate=SAMPLE_RATE, margin=ArcFace(16.0, 0.3), seed=7, bank=bank, **OPT[opt], **kw)


def _round_bf16(head):
    head.load_centers(head.centers().to(torch.bfloat16).to(torch.float32))


def _train(head, batches, lr, *, prefetch, accum=1, after_step=None, on_step=None):
    losses, hits = [], {"n": 0}
    stager = head._stager
    if stager is not None:
        take = stager.take

        def counted(*args):
            slot = take(*args)
            hits["n"] += slot is not None
            return slot
        stager.take = counted
    for i, (x, y) in enumerate(batches):
        loss = head(x, y)
        loss.backward()
        losses.append(loss.item())
        if prefetch and i + 1 < len(batches):
            head.prefetch(batches[i + 1][1])
        if (i + 1) % accum == 0:
            head.step(lr)
            if after_step is not None:
                after_step(head)
            if on_step is not None:
                on_step(head, i)
    return losses, hits["n"]


def _run(opt, bank, batches, *, prefetch, accum=1, mover=None, after_step=None):
    head = _head(opt, bank)
    if mover is not None:
        head._stager._move = mover
    losses, hits = _train(head, batches, LR[opt], prefetch=prefetch, accum=accum, after_step=after_step)
    out = dict(losses=losses, centers=head.centers(), hits=hits,
               state={k: v.clone() for k, v in head.state_dict().items()})
    if head._stager is not None:
        out["mapped"] = head._stager.mapped
        out["move"] = head._stager._move
    head.close()
    return out


def _assert_same(got, ref, what):
    diff = [i for i, (a, b) in enumerate(zip(got["losses"], ref["losses"])) if a != b]
    assert len(got["losses"]) == len(ref["losses"]) and not diff, f"{what}: losses differ at forwards {diff[:5]}"
    assert torch.equal(got["centers"], ref["centers"]), f"{what}: centers differ"
    assert got["state"].keys() == ref["state"].keys()
    for k in ref["state"]:
        assert torch.equal(got["state"][k], ref["state"][k]), f"{what}: state_dict[{k!r}] differs"


PLACEMENTS = {
    "host": ({}, "host"),
    "device": ({}, "device"),
    "w-host/m-device": ({"weight": "host"}, "device"),
    "adamw-mixed": ({"weight": "host", "exp_avg": "device", "step": "host"}, "host"),
}


# (placement, prefetch, mover, streams): every placement through both movers with prefetch
# under the emulator, and the other combinations once each (the interpreter is slow).
BITWISE = [(p, True, m, "emulated") for p in PLACEMENTS for m in ("kernel", "torch")] + [
    ("host", False, "kernel", "sync"), ("host", True, "kernel", "sync"), ("w-host/m-device", False, "torch", "emulated"),
    ("adamw-mixed", False, "torch", "sync"), ("device", True, "torch", "sync")]


@pytest.mark.parametrize("placement,prefetch,mover,streams", BITWISE, ids=["-".join(map(str, c)) for c in BITWISE])
def test_mapped_access_matches_device_bank_bitwise(monkeypatch, placement, prefetch, mover, streams):
    _streams(monkeypatch, streams)
    if mover == "kernel" and not triton_rows.available():
        pytest.skip("triton is not installed or TRITON_INTERPRET=1 was not set before import")
    opt = "adamw" if placement.startswith("adamw") else "sgd"
    placements, default = PLACEMENTS[placement]
    b = _batches(STEPS)
    ref = _run(opt, None, b, prefetch=False)
    got = _run(opt, TieredBank.factory(placements, default=default, host_access="mapped"), b, prefetch=prefetch,
               mover=None if mover == "kernel" else move_rows_torch_)
    assert got["mapped"]
    assert got["move"] is (triton_rows.move_rows_ if mover == "kernel" else move_rows_torch_)
    _assert_same(got, ref, f"{placement} prefetch={prefetch} {mover}")
    assert got["hits"] == (STEPS - 1 if prefetch else 0), "the prefetched slot was not used"
    assert sum(ref["losses"][-3:]) < sum(ref["losses"][:3]), "the reference run does not train"


@pytest.mark.parametrize("opt,accum", [("sgd", 2), ("adamw", 3)])
def test_mapped_gradient_accumulation_with_prefetch_matches_device_bank(monkeypatch, opt, accum):
    _streams(monkeypatch, "emulated")
    b = _batches(3 * accum, seed=1)
    ref = _run(opt, None, b, prefetch=False, accum=accum)
    # torch moves for AdamW (four states: slow under the interpreter), the kernel for SGD
    got = _run(opt, TieredBank.factory(default="host", host_access="mapped"), b, prefetch=True, accum=accum,
               mover=move_rows_torch_ if opt == "adamw" else None)
    _assert_same(got, ref, f"accumulation {opt} x{accum}")
    assert got["hits"] == len(b) - 1        # within a step and across steps


@pytest.mark.parametrize("prefetch,streams", [(False, "sync"), (True, "sync"), (True, "emulated")])
def test_mapped_bf16_host_weights_round_at_every_write(monkeypatch, prefetch, streams):
    """bfloat16 storage through the kernel rounds as torch rounds: the run equals the
    device bank whose centers are rounded to bfloat16 after every write, and a prefetched
    slot's overlap rows (patched from the stepped slot) are rounded too."""
    _streams(monkeypatch, streams)
    b = _batches(STEPS)
    ref = _head("sgd")
    _round_bf16(ref)
    losses, _ = _train(ref, b, LR["sgd"], prefetch=False, after_step=_round_bf16)
    expected = dict(losses=losses, centers=ref.centers(), state={k: v.clone() for k, v in ref.state_dict().items()})
    got = _run("sgd", TieredBank.factory({"weight": ("host", torch.bfloat16)}, host_access="mapped"), b,
               prefetch=prefetch)
    c = got["centers"]
    assert torch.equal(c, c.to(torch.bfloat16).to(torch.float32))
    _assert_same(got, expected, f"bf16 prefetch={prefetch}")


def test_mapped_overlap_copied_before_step_is_caught():
    """The injected ordering bug (overlap rows patched at prefetch, before the step
    updated them) must change the run, and the same run without it must not."""
    b = _batches(STEPS)
    ref = _run("sgd", None, b, prefetch=False)
    head = _head("sgd", TieredBank.factory(default="host", host_access="mapped"))
    head._stager.patch_before_step = True
    losses, _ = _train(head, b, LR["sgd"], prefetch=True)
    centers = head.centers()
    head.close()
    assert losses[0] == ref["losses"][0]
    assert losses != ref["losses"] and not torch.equal(centers, ref["centers"])


# ---------------------------------------------------------------- duplex
def _written_then_refetched(batches) -> int:
    """Rows of S(t+2) that S(t) wrote back and S(t+1) does not hold, over the run: the
    rows a fetch must read only after the write-back landed."""
    head = _head("sgd")
    sets = [head.active_set(head.partition.to_local(y, 0), t) for t, (_, y) in enumerate(batches)]
    head.close()
    return sum(int((torch.isin(sets[t + 2], sets[t]) & ~torch.isin(sets[t + 2], sets[t + 1])).sum())
               for t in range(len(sets) - 2))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_duplex_fetch_reads_rows_after_their_write_back_landed(monkeypatch, seed):
    """Write-backs run on their own stream, slowed down here, in an order the emulator
    draws from ``seed``: the run still matches the device bank bitwise. Fetching every
    row at once, before the last write-back landed, is caught by the emulator (a read
    of rows a write on another stream has not finished) or changes the run."""
    monkeypatch.setenv(DEBUG_ENV, "1")
    monkeypatch.setenv(DEBUG_ENV + "_SEED", str(seed))
    b = _batches(STEPS, seed=seed)
    assert _written_then_refetched(b) > 0
    ref = _run("sgd", None, b, prefetch=False)

    def slow_writes(head):
        head._stager.runtime.stream_delay["write"] = 0.01

    def train(bug: bool):
        head = _head("sgd", TieredBank.factory(default="host", host_access="mapped"))
        slow_writes(head)
        head._stager.fetch_before_landing = bug
        try:
            losses, _ = _train(head, b, LR["sgd"], prefetch=True)
            return dict(losses=losses, centers=head.centers(), state={k: v.clone() for k, v in head.state_dict().items()})
        finally:
            head.close()
    _assert_same(train(False), ref, "duplex")
    try:
        got = train(True)
    except StreamError as err:
        assert "no event orders them" in str(err)
    else:
        assert got["losses"] != ref["losses"] or not torch.equal(got["centers"], ref["centers"])


def test_duplex_write_back_runs_beside_the_next_fetch(monkeypatch):
    """The write stream waits for the step alone, never for the fetch stream, and each
    prefetch queues the fetch of rows the last write-back does not write before the
    fetch stream waits for that write-back: the two directions overlap."""
    monkeypatch.setenv(DEBUG_ENV, "1")
    head = _head("sgd", TieredBank.factory(default="host", host_access="mapped"))
    stager, rt = head._stager, head._stager.runtime
    log, phase = [], {"name": None}
    real_run, real_wait = rt.run, rt.wait

    def run(stream, fn, *args, **kw):
        log.append((phase["name"], stream.name, "run", None))
        return real_run(stream, fn, *args, **kw)

    def wait(stream, event):
        log.append((phase["name"], stream.name, "wait", None if event is None else event.stream.name))
        return real_wait(stream, event)
    rt.run, rt.wait = run, wait
    for name in ("prefetch", "after_step"):
        original = getattr(stager, name)

        def wrapped(*args, _original=original, _name=name):
            phase["name"] = _name
            try:
                return _original(*args)
            finally:
                phase["name"] = None
        setattr(stager, name, wrapped)
    _train(head, _batches(STEPS), LR["sgd"], prefetch=True)
    del rt.run, rt.wait
    head.close()
    assert not [e for e in log if e[1] == "write" and e[2] == "wait" and e[3] == "fetch"]
    prefetches, current = [], None
    for e in log:
        if e[0] == "prefetch":
            if current is None:
                current = []
                prefetches.append(current)
            current.append(e)
        else:
            current = None
    checked = 0
    for ops in prefetches:
        fetch = [(kind, on) for _, stream, kind, on in ops if stream == "fetch"]
        if ("wait", "write") in fetch:
            first_wait = fetch.index(("wait", "write"))
            assert ("run", None) in fetch[:first_wait], fetch
            checked += 1
    assert checked >= STEPS - 3, checked


def _scripted(head, batches, lr):
    """Training with every way a prefetched or staged slot can end other than its step:
    an evaluation forward and ``centers()`` between a step and the next forward (the next
    slot then carries rows newer than the tables), a lookahead replaced by a second one,
    ``zero_grad`` with a prefetch pending, a prefetch that the forward does not take, and
    ``zero_grad`` with the forward's slot (taken from the prefetch, carrying) unstepped."""
    losses, seen = [], []
    for i, (x, y) in enumerate(batches):
        if i == 6:                          # the forward does not use the prefetched labels
            x, y = batches[5]
        head.train()
        loss = head(x, y)
        loss.backward()
        losses.append(loss.item())
        if i == 8:                          # the forward's slot dropped unstepped
            head.zero_grad()
            continue
        if i + 1 < len(batches):
            if i == 3:                      # replaced by a second lookahead
                head.prefetch(batches[0][1])
            head.prefetch(batches[i + 1][1])
        head.step(lr)
        if i == 1:
            head.eval()
            with torch.no_grad():
                losses.append(head(*batches[i + 1]).item())
            seen.append(head.centers())
        if i == 4:
            head.zero_grad()                # drops the prefetched slot
    return dict(losses=losses, centers=head.centers(), seen=seen,
                state={k: v.clone() for k, v in head.state_dict().items()})


@pytest.mark.parametrize("placement", ["host", "w-host/m-device"])
def test_rows_carried_by_the_next_slot_are_never_lost(monkeypatch, placement):
    """Write-backs leave the overlap to the next slot; whatever ends that slot (a step,
    an evaluation forward, ``centers()``, ``zero_grad``, a replaced or unused
    prefetch), the run matches the device bank bitwise."""
    monkeypatch.setenv(DEBUG_ENV, "1")
    b = _batches(STEPS)
    ref_head = _head("sgd")
    ref = _scripted(ref_head, b, LR["sgd"])
    ref_head.close()
    placements, default = PLACEMENTS[placement]
    head = _head("sgd", TieredBank.factory(placements, default=default, host_access="mapped"))
    head._stager.runtime.stream_delay["write"] = 0.005
    carried = []
    after_step = head._stager.after_step

    def watched(updated):
        after_step(updated)
        carried.append(len(head._stager._carrying))
    head._stager.after_step = watched
    got = _scripted(head, b, LR["sgd"])
    head.close()
    assert sum(carried) >= STEPS - 5, carried       # the next slot carried rows at most steps
    _assert_same(got, ref, "carrying")
    for a, e in zip(got["seen"], ref["seen"]):
        assert torch.equal(a, e), "centers() between a step and the next forward differ"


@pytest.mark.parametrize("sets", [2, 3])
def test_slot_sets_bound_the_slot_buffers_and_keep_the_run_exact(monkeypatch, sets):
    """``slot_sets`` bounds the sets of slot buffers; at the bound the next-but-one fetch
    reuses the set the last write-back reads, ordered after it on the device (slowed
    down here), and the run still matches the device bank bitwise."""
    monkeypatch.setenv(DEBUG_ENV, "1")
    b = _batches(STEPS)
    ref = _run("sgd", None, b, prefetch=False)
    head = _head("sgd", TieredBank.factory(default="host", host_access="mapped", slot_sets=sets))
    stager = head._stager
    stager.runtime.stream_delay["write"] = 0.01
    made, reused_pending = [], []
    empty_slot = stager._empty_slot

    def watched(rows, pooled=True):
        waits = []
        real_wait = stager.runtime.wait
        stager.runtime.wait = lambda stream, event: (waits.append(event), real_wait(stream, event))
        try:
            slot = empty_slot(rows, pooled)
        finally:
            del stager.runtime.wait
        made.append(stager._sets)
        reused_pending.append(any(e is not None and e.stream.name == "write" for e in waits))
        return slot
    stager._empty_slot = watched
    losses, _ = _train(head, b, LR["sgd"], prefetch=True)
    got = dict(losses=losses, centers=head.centers(), state={k: v.clone() for k, v in head.state_dict().items()})
    head.close()
    _assert_same(got, ref, f"slot_sets={sets}")
    assert max(made) <= sets, made
    if sets == 2:       # the write-back was still running at most prefetches: the device ordered the reuse
        assert sum(reused_pending) >= STEPS // 2, reused_pending


def test_slot_sets_are_checked():
    with pytest.raises(ValueError, match="slot_sets must be one of"):
        TieredBank.factory(default="host", host_access="mapped", slot_sets=4)
    with pytest.raises(ValueError, match="slot_sets=2 needs host_access='mapped'"):
        TieredBank(10, "cpu", default=Placement("host"), slot_sets=2)
    from ds_pfc.app.config import BankConfig, ConfigError
    with pytest.raises(ConfigError, match="ds_pfc.head.bank.slot_sets must be one of"):
        BankConfig(default="host", slot_sets=2)
    assert BankConfig(default="host", host_access="mapped", slot_sets=2).build()(12, "cpu").slot_sets == 2


# ---------------------------------------------------------------- traffic, host work
def test_mapped_traffic_counts_the_cold_rows():
    """With prefetch, staged_in is the cold rows of the next set times the bytes of a
    row of every state in its storage dtype (counted on the device), written_back the
    stepped rows that leave the next set (the next slot carries the others on)."""
    b = _batches(STEPS)
    bank = TieredBank.factory({"weight": ("host", torch.bfloat16)}, default="host", host_access="mapped")
    head = _head("sgd", bank)
    row_bytes = D * 2 + D * 4
    sets = [head.active_set(head.partition.to_local(y, 0), t) for t, (_, y) in enumerate(b)]
    seen = []

    def on_step(h, i):
        seen.append((i, h.last_step_traffic))
    _train(head, b, LR["sgd"], prefetch=True, on_step=on_step)
    head.close()
    for i, traffic in seen:
        # step i wrote S(i) back; the prefetch of S(i+1) was issued before it.
        cold_next = int((~torch.isin(sets[i + 1], sets[i])).sum()) if i + 1 < len(sets) else 0
        staged = cold_next + (sets[0].numel() if i == 0 else 0)    # step 0 also staged S(0) whole
        leaving = int((~torch.isin(sets[i], sets[i + 1])).sum()) if i + 1 < len(sets) else sets[i].numel()
        assert traffic == {"staged_in": staged * row_bytes, "written_back": leaving * row_bytes}, i
    assert any(0 < int((~torch.isin(sets[i + 1], sets[i])).sum()) < sets[i + 1].numel() for i in range(STEPS - 1))


def _bank_ops(classes: int, batch: int, mover, access: str = "mapped"):
    """Host ops and syncs of the bank's calls (prefetch, take, after_step) on the
    training thread over steps 2..4 of a host bank, with validate=False."""
    head = PartialFC(classes, D, sample_rate=SAMPLE_RATE, seed=7, validate=False, optimizer="sgd", momentum=0.9,
                     bank=TieredBank.factory(default="host", host_access=access))
    stager = head._stager
    if mover is not None:
        stager._move = mover
    counter = {"on": False, "ops": 0, "syncs": 0, "names": []}
    for name in ("prefetch", "take", "after_step"):
        original = getattr(stager, name)

        def wrapped(*args, _original=original):
            if not counter["on"]:
                return _original(*args)
            with OpCounter() as c:
                out = _original(*args)
            # The emulator poisons each new buffer (fill_): whether the pool had one free
            # depends on timing, and a GPU allocation launches nothing.
            counter["ops"] += c.ops - c.by_op.get("fill_", 0)
            counter["syncs"] += c.syncs
            counter["names"] += c.sync_ops
            return out
        setattr(stager, name, wrapped)
    g = torch.Generator().manual_seed(3)
    labels = [torch.randint(0, classes, (batch,), generator=g) for _ in range(6)]
    for i in range(5):
        counter["on"] = i >= 2
        head(torch.randn(batch, D, generator=g), labels[i]).backward()
        head.prefetch(labels[i + 1])
        head.step(0.1)
    head.close()
    return counter


@pytest.mark.parametrize("mover,sizes", [("torch", (1009, 16411)), ("kernel", (509, 2039))])
def test_mapped_bank_host_work_is_constant_in_rows_and_never_syncs(monkeypatch, mover, sizes):
    """Per step the mapped bank issues the same number of host ops (a kernel launch is
    one) for a few hundred active rows as for thousands, and none synchronises with the
    device. (The op counter sees the calling thread: with the plain CPU runtime every
    side-stream op runs where it is issued.)"""
    if mover == "kernel" and not triton_rows.available():
        pytest.skip("triton is not installed or TRITON_INTERPRET=1 was not set before import")
    monkeypatch.setenv(DEBUG_ENV, "0")
    move = triton_rows.move_rows_ if mover == "kernel" else move_rows_torch_
    small, large = _bank_ops(sizes[0], 24, move), _bank_ops(sizes[1], 24, move)
    assert small["syncs"] == 0 and large["syncs"] == 0, (small["names"], large["names"])
    assert small["ops"] > 0 and small["ops"] == large["ops"], (small["ops"], large["ops"])


def test_staged_bank_does_no_row_work_on_the_training_thread(monkeypatch):
    """The staged path: the training thread queues the same ops for a few hundred
    active rows as for thousands and never waits for row ids (the split, the version
    counts and the host gathers and scatters run on the I/O worker; the overlap patch
    is found on the device). Side-stream work runs on the emulator's thread, as on a
    GPU, so the counter sees the training thread alone."""
    monkeypatch.setenv(DEBUG_ENV, "1")
    small, large = _bank_ops(1009, 24, None, "staged"), _bank_ops(16411, 24, None, "staged")
    assert small["syncs"] == 0 and large["syncs"] == 0, (small["names"], large["names"])
    assert small["ops"] > 0 and small["ops"] == large["ops"], (small["ops"], large["ops"])


def test_a_prefetched_slot_is_matched_by_identity_without_a_sync(monkeypatch):
    """The forward hands the prefetched rows tensor itself back to the bank, which then
    needs no comparison of row ids; the counter sees the sync a comparison would cost."""
    monkeypatch.setenv(DEBUG_ENV, "0")
    head = PartialFC(1009, D, sample_rate=SAMPLE_RATE, seed=7, validate=False,
                     bank=TieredBank.factory(default="host", host_access="mapped"))
    head._stager._move = move_rows_torch_
    rows = torch.arange(0, 1009, 5)
    syncs = []
    for given in (rows, rows.clone()):
        head._stager.prefetch(rows, 0, [])
        with OpCounter() as c:
            slot = head._stager.take(given, 0, [])
        assert slot is not None and torch.equal(slot.rows, rows)
        syncs.append(c.syncs)
        head._stager.release(slot)
    head.close()
    assert syncs[0] == 0 and syncs[1] >= 1, syncs


# ---------------------------------------------------------------- arguments
def test_host_access_is_checked(tmp_path):
    with pytest.raises(ValueError, match="host_access must be one of"):
        TieredBank.factory(default="host", host_access="direct")
    bank = TieredBank(10, "cpu", host_access="staged")
    assert not bank.mapped


def test_config_host_access(tmp_path):
    from ds_pfc.app.config import BankConfig, ConfigError
    with pytest.raises(ConfigError, match="ds_pfc.head.bank.host_access must be one of"):
        BankConfig(default="host", host_access="gpu")
    factory = BankConfig(default="host", host_access="mapped").build()
    bank = factory(12, "cpu")
    assert bank.mapped and bank.host_access == "mapped"
    with pytest.raises(ConfigError, match="hbm_share must be in \\[0, 1\\) and needs host_access 'mapped'"):
        BankConfig(default="host", hbm_share=0.5)
    with pytest.raises(ConfigError, match="ds_pfc.head.bank.hbm_share must be"):
        BankConfig(default="host", host_access="mapped", hbm_share="half")
    assert BankConfig(default="host", host_access="mapped", hbm_share=0.5).build()(12, "cpu").hbm_share == 0.5


# ---------------------------------------------------------------- the split
@pytest.mark.parametrize("sizes", [(0, 5), (7, 0), (1, 1), (300, 40), (40, 300), (1000, 1000)])
def test_split_of_sorted_sets_matches_isin(sizes):
    """Which rows of the next set the live sets hold, by binary search in the sorted
    sets (both paths use it), against torch.isin over their concatenation."""
    from ds_pfc.bank.slots import _held_by
    g = torch.Generator().manual_seed(sum(sizes))
    universe = 5 * max(sizes) + 3
    rows = torch.randperm(universe, generator=g)[: sizes[0]].sort().values
    live = [torch.randperm(universe, generator=g)[: sizes[1]].sort().values,
            torch.randperm(universe, generator=g)[: sizes[1] // 2].sort().values, torch.empty(0, dtype=torch.long)]
    held = _held_by(rows, live)
    expected = torch.isin(rows, torch.cat(live))
    if sizes[1] == 0:
        assert held is None
    else:
        assert torch.equal(held, expected)


def test_rows_benchmark_runs_dry(tmp_path):
    """The GPU row-move benchmark's harness, at toy sizes on the CPU: a table, a JSON with
    a rate and the planner's assumed rate per case."""
    import json
    from ds_pfc.cli import bench
    out = tmp_path / "rows.json"
    assert bench.main(["rows", "--dry", "--row-bytes", "256", "--programs", "2", "--huge", "no", "--repeats", "1",
                       "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    moves = [r for r in doc["results"] if r["what"].startswith(("gather", "scatter"))]
    assert {r["what"].split()[0] for r in moves} == {"gather", "scatter"}
    assert all(r["gbps"] > 0 and r["assumed_gbps"] == 45.0 and r["row_bytes"] == 256 for r in moves)


# ---------------------------------------------------------------- a share of rows in device memory
@pytest.mark.parametrize("share,mover,streams", [(0.3, "kernel", "emulated"), (0.3, "torch", "emulated"),
                                                 (0.95, "torch", "sync")])
def test_hbm_share_matches_device_bank_bitwise(monkeypatch, share, mover, streams):
    """Host-tier states with a share of their rows in device memory: each fetch and
    write-back splits into a move from (to) each part; same trajectory as the device bank."""
    _streams(monkeypatch, streams)
    if mover == "kernel" and not triton_rows.available():
        pytest.skip("triton is not installed or TRITON_INTERPRET=1 was not set before import")
    b = _batches(STEPS)
    ref = _run("sgd", None, b, prefetch=False)
    bank = TieredBank.factory({"weight": ("host", torch.bfloat16)}, default="host", host_access="mapped",
                              hbm_share=share)
    head = _head("sgd", bank)
    if mover == "torch":
        head._stager._move = move_rows_torch_
    n_dev = round(share * C)
    store = head.bank.store("momentum_buffer")
    assert store.n_device == n_dev
    resident = head.bank.resident_bytes()
    assert resident["device"] == n_dev * D * (2 + 4)           # bf16 weight + float32 momentum rows
    assert resident["host"] >= (C - n_dev) * D * (2 + 4)
    losses, _ = _train(head, b, LR["sgd"], prefetch=True)
    centers, momentum = head.centers(), head.bank.export("momentum_buffer")
    head.close()
    expected = _head("sgd")
    _round_bf16(expected)
    exp_losses, _ = _train(expected, b, LR["sgd"], prefetch=False, after_step=_round_bf16)
    assert losses == exp_losses
    assert torch.equal(centers, expected.centers())
    assert torch.equal(momentum, expected.bank.export("momentum_buffer"))
    assert losses != ref["losses"]          # bf16 weights: the rounding is real


def test_hbm_share_is_checked():
    with pytest.raises(ValueError, match="hbm_share must be a number in \\[0, 1\\)"):
        TieredBank.factory(default="host", host_access="mapped", hbm_share=1.0)
    with pytest.raises(ValueError, match="needs host_access='mapped'"):
        TieredBank.factory(default="host", hbm_share=0.5)
    with pytest.raises(ValueError, match="hbm_share must be"):
        TieredBank(10, "cpu", default=Placement("host"), host_access="mapped", hbm_share=True)
