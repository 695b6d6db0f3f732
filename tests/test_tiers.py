"""Tiered class bank (``TieredBank``: device / host tiers, per-state placement
and storage dtype, the stale-free prefetcher of ``ds_pfc.bank.slots``).

Reference: the plain device bank, ``PartialFC(..., bank=None)``. It never stages rows
into slots: the forward reads ``bank.read(active)``, the optimizer updates the bank's
rows in place. The tiered bank instead stages every active row of every state into a
slot, runs the optimizer on the slot, prefetches the next slot and writes back in the
background. In float32 on the CPU both paths do the same arithmetic on the same
values, so a tiered run must equal the reference *bitwise*: losses, centers and every
state_dict tensor. bfloat16 storage is checked against the device bank with its
centers rounded to bfloat16 after every write (which is what storing them does).

Multi-rank runs use three gloo ranks (``run_ranks``) with uneven batches, C = 1021
classes and sample rate 0.2. Each spawn runs every variant of its family and returns
everything, so the module spawns once per stream mode.
"""
from __future__ import annotations

import os

import pytest
import torch

from _dist import run_ranks
from ds_pfc import ArcFace, PartialFC
from ds_pfc.bank import Placement, StaleRowError, TieredBank, debug_streams_active
from ds_pfc.bank.streams import DEBUG_ENV

C, D, WORLD, STEPS = 1021, 16, 3, 14
SAMPLE_RATE = 0.2
OPT = {
    "sgd": dict(optimizer="sgd", momentum=0.9, weight_decay=5e-4),
    "adamw": dict(optimizer="adamw", betas=(0.9, 0.99), eps=1e-6, weight_decay=0.01),
}
LR = {"sgd": 2.0, "adamw": 0.01}


@pytest.fixture(scope="module", autouse=True, params=["streams-sync", "streams-emulated"])
def stream_mode(request):
    """Every test runs twice: with the plain CPU runtime, and with the stream emulator
    (late, out-of-order side-stream copies, poisoned pool buffers, hazard checks).
    The spawned ranks inherit the environment."""
    old = os.environ.get(DEBUG_ENV)
    os.environ[DEBUG_ENV] = "1" if request.param == "streams-emulated" else "0"
    assert debug_streams_active() == (request.param == "streams-emulated")
    yield request.param
    if old is None:
        os.environ.pop(DEBUG_ENV, None)
    else:
        os.environ[DEBUG_ENV] = old


# ---------------------------------------------------------------- helpers
def _batches(rank: int, world: int, steps: int, seed: int = 0):
    """Per-rank batches: labels from a pool of 120 classes (rows recur, so consecutive
    active sets overlap), embeddings near a per-class prototype (the loss can fall).
    Batch sizes differ between ranks and between steps."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.randperm(C, generator=g)[:120]
    proto = torch.randn(C, D, generator=g)
    out = []
    for t in range(steps):
        sizes = [3 + (5 * q + 3 * t) % 7 for q in range(world)]
        y = pool[torch.randint(0, pool.numel(), (sum(sizes),), generator=g)]
        x = proto[y] + 0.3 * torch.randn(sum(sizes), D, generator=g)
        lo = sum(sizes[:rank])
        out.append((x[lo: lo + sizes[rank]].clone(), y[lo: lo + sizes[rank]].clone()))
    return out


def _head(opt: str, bank=None) -> PartialFC:
    return PartialFC(C, D, sample_rate=SAMPLE_RATE, margin=ArcFace(16.0, 0.3), seed=7, bank=bank, **OPT[opt])


def _count_takes(head):
    """Count the forwards served by a prefetched slot (so that a prefetch variant
    really exercised the prefetch path instead of silently restaging)."""
    stats = {"hits": 0}
    stager = head._stager
    orig = stager.take

    def take(*args):
        slot = orig(*args)
        stats["hits"] += slot is not None
        return slot
    stager.take = take
    return stats


def _train(head, batches, lr, *, prefetch=False, accum=1, lookahead=None, after_step=None, on_backward=None):
    """A trainer's loop: forward, backward, prefetch the next forward's labels (after
    backward, before step), step every ``accum`` forwards. Returns the losses."""
    losses = []
    for i, (x, y) in enumerate(batches):
        loss = head(x, y)
        loss.backward()
        losses.append(loss.item())
        if on_backward is not None:
            on_backward(head, i)
        if prefetch and i + 1 < len(batches):
            head.prefetch(batches[i + 1][1] if lookahead is None else lookahead(i))
        if (i + 1) % accum == 0:
            head.step(lr)
            if after_step is not None:
                after_step(head)
    return losses


def _result(head, losses, **extra):
    state = {k: v.clone() for k, v in head.state_dict().items()}
    return dict(losses=losses, centers=head.centers(), state=state, **extra)


def _run(opt, bank, batches, *, prefetch=False, accum=1, **kw):
    head = _head(opt, bank)
    stats = _count_takes(head) if head._stager is not None else {"hits": 0}
    losses = _train(head, batches, LR[opt], prefetch=prefetch, accum=accum, **kw)
    out = _result(head, losses, hits=stats["hits"])
    if head._stager is not None:
        out["tiers"] = {name: head.bank.store(name).tier for name in head.bank.state_names()}
        out["dtypes"] = {name: head.bank.store(name).dtype for name in head.bank.state_names()}
    head.close()
    return out


def _assert_same(got, ref, what):
    """Bitwise: every loss, the centers, every state_dict tensor."""
    assert len(got["losses"]) == len(ref["losses"]), what
    diff = [i for i, (a, b) in enumerate(zip(got["losses"], ref["losses"])) if a != b]
    assert not diff, f"{what}: losses differ from the device bank at forwards {diff[:5]} " \
                     f"({got['losses'][diff[0]]!r} vs {ref['losses'][diff[0]]!r})"
    assert torch.equal(got["centers"], ref["centers"]), f"{what}: centers differ"
    assert got["state"].keys() == ref["state"].keys(), what
    for k in ref["state"]:
        assert got["state"][k].dtype == ref["state"][k].dtype, (what, k)
        assert torch.equal(got["state"][k], ref["state"][k]), f"{what}: state_dict[{k!r}] differs"


def _round_bf16(head):
    """The device bank with its centers as bfloat16 storage would leave them."""
    head.load_centers(head.centers().to(torch.bfloat16).to(torch.float32))


# ---------------------------------------------------------------- spawn 1: dense tiers
MIXED_DENSE = {
    "sgd:w-host/m-device": ("sgd", {"weight": "host", "momentum_buffer": "device"}, "device"),
    "sgd:w-host-f64/m-host": ("sgd", {"weight": ("host", torch.float64)}, "host"),  # wider storage: exact
    "adamw:w-host/avg-device/sq-host/step-device": (
        "adamw", {"weight": "host", "exp_avg": "device", "exp_avg_sq": "host", "step": "device"}, "host"),
}


def _dense_ranks(rank, world):
    torch.manual_seed(1234)
    out = {}
    b = _batches(rank, world, STEPS)
    for opt in ("sgd", "adamw"):
        out[(opt, "ref")] = _run(opt, None, b)
        for tier in ("device", "host"):
            for pf in (False, True):
                out[(opt, tier, pf)] = _run(opt, TieredBank.factory(default=tier), b, prefetch=pf)
    for name, (opt, placements, default) in MIXED_DENSE.items():
        out[name] = _run(opt, TieredBank.factory(placements, default=default), b, prefetch=True)

    # Gradient accumulation: 2 (SGD) and 3 (AdamW) forward/backward per step, with a
    # prefetch after every backward (inside a step and across steps).
    for opt, accum in (("sgd", 2), ("adamw", 3)):
        ba = _batches(rank, world, 10 * accum, seed=1)
        out[("accum", opt, "ref")] = _run(opt, None, ba, accum=accum)
        for tier in ("device", "host"):
            out[("accum", opt, tier)] = _run(opt, TieredBank.factory(default=tier), ba, prefetch=True, accum=accum)

    # Storage dtype: weights as bfloat16 in host memory, momentum float32 on the device.
    ref = _head("sgd")
    _round_bf16(ref)
    out[("bf16", "ref")] = _result(ref, _train(ref, b, LR["sgd"], after_step=_round_bf16))
    for pf in (False, True):
        out[("bf16", pf)] = _run("sgd", TieredBank.factory({"weight": ("host", torch.bfloat16)}), b, prefetch=pf)

    # The injected ordering bug: overlapping rows copied into the next slot at
    # prefetch time, i.e. before the optimizer step updated them.
    head = _head("sgd", TieredBank.factory(default="host"))
    out["normal-host"] = _result(head, _train(head, b, LR["sgd"], prefetch=True))
    # |S(t) ∩ S(t+1)| on this rank, from the global labels (the sampler is a pure
    # function of the labels and the step): the rows whose copy order matters.
    every = [_batches(q, world, STEPS) for q in range(world)]
    active = [head.active_set(head.partition.to_local(torch.cat([bq[t][1] for bq in every]), rank), t)
              for t in range(STEPS)]
    out["normal-host"]["overlaps"] = [int(torch.isin(active[t + 1], active[t]).sum()) for t in range(STEPS - 1)]
    head.close()
    head = _head("sgd", TieredBank.factory(default="host"))
    head._stager.patch_before_step = True
    out["patched-host"] = _result(head, _train(head, b, LR["sgd"], prefetch=True))
    head.close()

    # Wrong lookahead: the prefetched labels are another batch's, on every rank
    # (i % 3 == 0) or on rank 1 only (i % 3 == 1: the active sets are built from the
    # gathered labels, so other ranks' slots go stale too, unless their own classes
    # got the same positives, in which case the slot is rightly kept).
    def wrong(i):
        if i % 3 == 0 or (i % 3 == 1 and rank == 1):
            return b[(i + 5) % len(b)][1]
        return b[i + 1][1]
    out["mismatch"] = _run("sgd", TieredBank.factory(default="host"), b, prefetch=True, lookahead=wrong)

    # Bad next_labels at step 5, after a good prefetch was issued: each call raises,
    # names next_labels and leaves the pending lookahead alone.
    errors = []

    def bad_prefetch(head, i):
        if i != 5:
            return
        head.prefetch(b[i + 1][1])
        pending = head._stager._next
        good = b[i + 1][1]
        oob = good.clone()
        if rank == 1:   # one rank out of range: every rank must raise (checked after the gather)
            oob[0] = C
        bads = [good.to(torch.float32), good[:, None].expand(-1, 2), oob, -good - 1, good.tolist(),
                good.to("meta"), good.to(torch.bool)]
        for bad in bads:
            try:
                head.prefetch(bad)
                errors.append(None)
            except (TypeError, ValueError) as err:
                errors.append((type(err).__name__, str(err)))
        errors.append(head._stager._next is pending)
    out["bad-next-labels"] = _run("sgd", TieredBank.factory(default="host"), b, on_backward=bad_prefetch,
                                  prefetch=True)
    out["bad-next-labels"]["errors"] = errors
    return out


@pytest.fixture(scope="module")
def dense(stream_mode):
    return run_ranks(_dense_ranks, WORLD)


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
@pytest.mark.parametrize("tier", ["device", "host"])
@pytest.mark.parametrize("prefetch", [False, True], ids=["staged", "prefetch"])
def test_tier_matches_device_bank_bitwise(dense, opt, tier, prefetch):
    for rank, res in enumerate(dense):
        got = res[(opt, tier, prefetch)]
        _assert_same(got, res[(opt, "ref")], f"rank {rank} {opt} {tier} prefetch={prefetch}")
        assert set(got["tiers"].values()) == {tier}
        assert got["hits"] == (STEPS - 1 if prefetch else 0), "the prefetched slot was not used"
    losses = dense[0][(opt, "ref")]["losses"]
    assert len(losses) == STEPS and sum(losses[-5:]) < sum(losses[:5]), "the reference run does not train"


@pytest.mark.parametrize("name", list(MIXED_DENSE))
def test_mixed_placements_match_device_bank_bitwise(dense, name):
    opt, placements, default = MIXED_DENSE[name]
    for rank, res in enumerate(dense):
        got = res[name]
        _assert_same(got, res[(opt, "ref")], f"rank {rank} {name}")
        for state, tier in got["tiers"].items():
            assert tier == Placement.parse(placements.get(state, default)).tier, (state, got["tiers"])
        assert got["hits"] == STEPS - 1


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
@pytest.mark.parametrize("tier", ["device", "host"])
def test_gradient_accumulation_with_prefetch_matches_device_bank(dense, opt, tier):
    for rank, res in enumerate(dense):
        got = res[("accum", opt, tier)]
        _assert_same(got, res[("accum", opt, "ref")], f"rank {rank} accumulation {opt} {tier}")
        assert got["hits"] == len(got["losses"]) - 1  # within a step and across steps
        assert int(got["state"]["meta"][7]) == 10      # step_count: one per accumulated step


@pytest.mark.parametrize("prefetch", [False, True], ids=["staged", "prefetch"])
def test_bf16_host_weights_round_at_every_write(dense, prefetch):
    """bfloat16 storage is not float32 (first loss already differs: the initial
    centers are rounded), but it trains, every stored center is a bfloat16 value, and
    the run equals the device bank whose centers are rounded to bfloat16 after every
    write, with or without prefetch (a prefetched slot must not keep unrounded rows)."""
    for rank, res in enumerate(dense):
        got, ref32 = res[("bf16", prefetch)], res[("sgd", "ref")]
        assert got["dtypes"]["weight"] == torch.bfloat16 and got["dtypes"]["momentum_buffer"] == torch.float32
        assert got["tiers"] == {"weight": "host", "momentum_buffer": "device"}
        c = got["centers"]
        assert c.dtype == torch.float32 and torch.equal(c, c.to(torch.bfloat16).to(torch.float32))
        assert got["losses"] != ref32["losses"]
        losses = got["losses"]
        assert sum(losses[-5:]) < 0.7 * sum(losses[:5]), f"bf16 storage does not train: {losses}"
        _assert_same(got, res[("bf16", "ref")], f"rank {rank} bf16 prefetch={prefetch}")


def test_overlap_copied_before_step_is_caught(dense):
    """The overlapping rows S(t) ∩ S(t+1) of the prefetched slot must be copied after
    step t updated them. ``patch_before_step`` copies them at prefetch time (the
    pre-step values): that run must differ from the reference, otherwise this suite
    could not tell the ordering bug from the correct pipeline; and the same run
    without the hook must equal the reference bitwise."""
    for rank, res in enumerate(dense):
        ref, normal, patched = res[("sgd", "ref")], res["normal-host"], res["patched-host"]
        assert sum(n > 0 for n in normal["overlaps"]) >= STEPS // 2, "too few overlapping rows to test ordering"
        _assert_same(normal, ref, f"rank {rank} normal pipeline")
        assert patched["losses"][0] == ref["losses"][0]
        assert patched["losses"] != ref["losses"], "copying overlap rows before the step went unnoticed"
        assert not torch.equal(patched["centers"], ref["centers"])


def test_prefetch_with_other_labels_is_discarded(dense):
    for rank, res in enumerate(dense):
        got = res["mismatch"]
        _assert_same(got, res[("sgd", "ref")], f"rank {rank} wrong lookahead")
        right = sum(1 for i in range(STEPS - 1) if i % 3 == 2)
        wrong_everywhere = sum(1 for i in range(STEPS - 1) if i % 3 == 0)
        # Used when right; discarded when every rank's lookahead was wrong; with only
        # rank 1 wrong, a rank whose classes got the same positives keeps its slot.
        assert right <= got["hits"] <= STEPS - 1 - wrong_everywhere, got["hits"]


def test_prefetch_rejects_bad_next_labels_and_changes_nothing(dense):
    for rank, res in enumerate(dense):
        got = res["bad-next-labels"]
        errors = got["errors"]
        # float, 2-D, out of range on rank 1 only, negative, a list, on another device, bool
        kinds = ["TypeError", "ValueError", "ValueError", "ValueError", "TypeError", "ValueError", "TypeError"]
        assert len(errors) == len(kinds) + 1 and [e and e[0] for e in errors[:-1]] == kinds, errors
        for err in errors[:-1]:
            assert "next_labels" in err[1], err
        assert errors[-1] is True, "a rejected prefetch replaced the pending lookahead"
        _assert_same(got, res[("sgd", "ref")], f"rank {rank} after rejected prefetches")
        assert got["hits"] == STEPS - 1


# ---------------------------------------------------------------- single process
def _tiered(tier, tmp_path, opt="sgd", **kw):
    return _head(opt, TieredBank.factory(default=tier, **kw))


def _tiers():
    return ["host"]


def _next_active(head, labels):
    return head.active_set(head.partition.to_local(labels, head.rank), head.sample_step)


@pytest.mark.parametrize("tier", _tiers())
@pytest.mark.parametrize("state", ["weight", "momentum_buffer"])
def test_stale_row_is_detected(tier, state, tmp_path):
    """A write-back that never landed (stored version one behind the issued count)
    makes the next forward that stages the row raise StaleRowError naming it; the
    failed forward changes nothing, and once the version is right the run goes on
    exactly as the reference."""
    b = _batches(0, 1, 8)
    head, ref = _tiered(tier, tmp_path), _head("sgd")
    for h in (head, ref):
        _train(h, b[:4], LR["sgd"])
    head.flush()
    x, y = b[4]
    active = _next_active(head, y)
    r = int(active[len(active) // 2])
    outside = int(torch.nonzero(~torch.isin(torch.arange(C), active))[0])
    versions = head.bank.store(state).versions
    versions[r] -= 1
    versions[outside] -= 1        # a stale row outside the active set is not read
    with pytest.raises(StaleRowError, match=rf"'{state}'.*local rows \[{r}\] \(classes \[{r}\]\)"):
        head(x, y)
    assert head.sample_step == 4 and head.step_count == 4 and not head._pending
    versions[r] += 1
    assert _train(head, b[4:5], LR["sgd"]) == _train(ref, b[4:5], LR["sgd"])   # `outside` still stale
    versions[outside] += 1
    assert _train(head, b[5:], LR["sgd"]) == _train(ref, b[5:], LR["sgd"])
    _assert_same(_result(head, []), _result(ref, []), "after a caught stale row")
    head.close()


@pytest.mark.parametrize("tier", _tiers())
def test_corrupt_issued_count_is_detected_through_prefetch(tier, tmp_path):
    """The prefetched slot reads the row in the background: its StaleRowError must
    surface at the forward that takes the slot (or at prefetch), not be dropped."""
    b = _batches(0, 1, 6)
    head = _tiered(tier, tmp_path)
    _train(head, b[:3], LR["sgd"], prefetch=True)
    x, y = b[3]
    r = int(_next_active(head, y)[0])
    head.bank._issued["weight"][r] += 1   # as if a write was issued that never completed
    with pytest.raises(StaleRowError, match=rf"local rows \[{r}\]"):
        head.prefetch(y)
        head(x, y)
    head.bank._issued["weight"][r] -= 1
    head.close()


@pytest.mark.parametrize("tier", _tiers())
@pytest.mark.parametrize("where", ["forward", "prefetch", "flush"])
def test_failed_write_back_is_not_lost(tier, where, tmp_path):
    """A scatter that raises inside the I/O worker must surface at the next
    forward/prefetch that needs the rows (as the original error or as the version
    check's StaleRowError), and at flush as the original error."""
    b = _batches(0, 1, 6)
    head = _tiered(tier, tmp_path)
    _train(head, b[:2], LR["sgd"])
    head.flush()                             # so that the failure hits step 3's write-back
    store = head.bank.store("weight")
    orig, failed = store.scatter, []

    def scatter(rows, values):
        if not failed:
            failed.append(rows.clone())
            raise OSError(5, "injected write-back failure")
        return orig(rows, values)
    store.scatter = scatter
    written = _next_active(head, b[2][1])
    _train(head, b[2:3], LR["sgd"])          # its write-back raises in the worker (now or soon)
    x, y = b[3]
    assert bool(torch.isin(_next_active(head, y), written).any()), "the next step does not read a failed row"
    if where == "flush":
        with pytest.raises(OSError, match="injected write-back failure"):
            head.flush()
    else:
        with pytest.raises((StaleRowError, OSError)):
            if where == "prefetch":
                head.prefetch(y)
            head(x, y)
        with pytest.raises(OSError, match="injected write-back failure"):
            head.flush()
    assert len(failed) == 1 and torch.equal(failed[0], written)
    head.close()


@pytest.mark.parametrize("bad", [torch.tensor(3), torch.tensor(3.0)], ids=["0-d", "0-d-float"])
def test_prefetch_rejects_scalar_next_labels(bad):
    head = _head("sgd", TieredBank.factory(default="host"))
    with pytest.raises((TypeError, ValueError), match="next_labels"):
        head.prefetch(bad)
    head.close()


def test_bad_bank_arguments():
    # NVMe is not a per-step tier: the error names the tier and the supported ones.
    for make in (lambda: TieredBank.factory(default="nvme"), lambda: TieredBank.factory({"weight": "nvme"}),
                 lambda: TieredBank.factory({"momentum_buffer": ("nvme", torch.bfloat16)}),
                 lambda: Placement("nvme")):
        with pytest.raises(ValueError, match=r"tier 'nvme' is not a per-step tier.*'device' or 'host'"):
            make()
    with pytest.raises(TypeError):
        TieredBank.factory(default="host", nvme_dir="/tmp")
    with pytest.raises(ValueError, match="tier"):
        TieredBank.factory(default="ssd")
    with pytest.raises(ValueError, match="tier"):
        TieredBank.factory({"weight": ("gpu", None)})
    with pytest.raises(ValueError, match="tier"):
        Placement("HOST")
    with pytest.raises(TypeError, match="dtype"):
        Placement("host", "bfloat16")
    with pytest.raises(TypeError, match="dtype"):
        TieredBank.factory({"weight": ("host", float)})
    with pytest.raises(TypeError, match="placement"):
        TieredBank.factory({"weight": ("host", torch.bfloat16, "extra")})
    with pytest.raises(TypeError, match="placement"):
        TieredBank.factory({"weight": 3})


@pytest.mark.parametrize("dtype", [torch.int8, torch.int32, torch.bool])
def test_integer_storage_dtype_for_float_state_is_rejected(dtype):
    """Centers stored as integers are truncated to zero; the bank must refuse such a
    placement instead of training on it."""
    with pytest.raises((TypeError, ValueError), match="dtype"):
        _head("sgd", TieredBank.factory({"weight": ("host", dtype)}))


# ---------------------------------------------------------------- memory report
CASES = {
    "host": (dict(default="host"), {"weight": ("host", 4), "momentum_buffer": ("host", 4)}),
    "w-host/m-device": (dict(placements={"weight": "host"}, default="device"),
                        {"weight": ("host", 4), "momentum_buffer": ("device", 4)}),
    "w-host-bf16/m-device": (dict(placements={"weight": ("host", torch.bfloat16)}),
                             {"weight": ("host", 2), "momentum_buffer": ("device", 4)}),
}


def _check_report(head, expected, steps):
    """Resident bytes per tier as implied by the placements (host also holds the
    per-row version counters, at most 2 x 8 bytes per row and state), staged bytes
    while a step is pending, and
    the traffic of each step."""
    b = _batches(0, 1, steps)
    per_row_in = sum(esize * D for _, esize in expected.values())
    placed = {"device": 0, "host": 0}
    for tier, esize in expected.values():
        placed[tier] += C * D * esize
    report = head.memory_report()
    res = report["resident"]
    assert res["device"] == placed["device"]
    assert placed["host"] <= res["host"] <= placed["host"] + 16 * C * len(expected)
    assert res["staged"] == 0
    staged_rows = written = 0
    for i, (x, y) in enumerate(b):
        active = _next_active(head, y)
        head(x, y).backward()
        assert head.memory_report()["resident"]["staged"] == active.numel() * D * 4 * len(expected)
        head.step(LR["sgd"])
        report = head.memory_report()
        assert report["resident"]["staged"] == 0
        traffic = report["last_step"]
        assert traffic["staged_in"] == active.numel() * per_row_in      # no prefetch: this step's rows
        if i >= 1:
            assert traffic["written_back"] > 0
        staged_rows += active.numel()
        written += traffic["written_back"]
    head.flush()
    written += head.bank.reset_traffic()["written_back"]
    assert written == staged_rows * per_row_in
    return report


@pytest.mark.parametrize("case", list(CASES))
def test_memory_report_matches_placements(case):
    kw, expected = CASES[case]
    head = _head("sgd", TieredBank.factory(**kw))
    _check_report(head, expected, 4)
    head.close()
