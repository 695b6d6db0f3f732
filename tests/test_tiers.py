"""Tiered class bank (``TieredBank``: device / host / NVMe tiers, per-state placement
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
everything, so the module spawns twice (dense tiers; NVMe tiers). The NVMe tests are
skipped when DeepSpeed's async_io op is not compatible with this machine.
"""
from __future__ import annotations

import os
import threading

import pytest
import torch

from _dist import run_ranks
from ds_pfc import ArcFace, PartialFC, Partition
from ds_pfc.bank import Placement, StaleRowError, TieredBank, debug_streams_active
from ds_pfc.bank.streams import DEBUG_ENV

C, D, WORLD, STEPS = 1021, 16, 3, 14
SAMPLE_RATE = 0.2
OPT = {
    "sgd": dict(optimizer="sgd", momentum=0.9, weight_decay=5e-4),
    "adamw": dict(optimizer="adamw", betas=(0.9, 0.99), eps=1e-6, weight_decay=0.01),
}
LR = {"sgd": 2.0, "adamw": 0.01}


def _aio_compatible() -> bool:
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder
        return bool(AsyncIOBuilder().is_compatible())
    except Exception:  # deepspeed missing or broken: no NVMe tier
        return False


AIO = _aio_compatible()
needs_aio = pytest.mark.skipif(
    not AIO, reason="DeepSpeed's AsyncIOBuilder().is_compatible() is False (libaio missing): "
                    "the nvme tier cannot run here")


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


# ---------------------------------------------------------------- spawn 2: NVMe tier
MIXED_NVME = {
    "sgd:w-nvme/m-host": ("sgd", {"weight": "nvme", "momentum_buffer": "host"}, "device"),
    "adamw:w-nvme/avg-host/sq-device/step-nvme": (
        "adamw", {"weight": "nvme", "exp_avg": "host", "exp_avg_sq": "device", "step": "nvme"}, "device"),
}
RESTART_AT = 9


def _nvme_ranks(rank, world, root):
    torch.manual_seed(1234)

    def fresh(name):
        path = os.path.join(root, name)
        os.makedirs(path, exist_ok=True)
        return path
    out = {}
    b = _batches(rank, world, STEPS)
    for opt in ("sgd", "adamw"):
        out[(opt, "ref")] = _run(opt, None, b)
        for pf in (False, True):
            d = fresh(f"{opt}-{pf}")
            out[(opt, "nvme", pf)] = _run(opt, TieredBank.factory(default="nvme", nvme_dir=d), b, prefetch=pf)
            out[(opt, "nvme", pf)]["files"] = sorted(os.listdir(d))
    for name, (opt, placements, default) in MIXED_NVME.items():
        d = fresh(name.replace("/", "_").replace(":", "_"))
        out[name] = _run(opt, TieredBank.factory(placements, default=default, nvme_dir=d), b, prefetch=True)

    ba = _batches(rank, world, 20, seed=1)
    out[("accum", "ref")] = _run("sgd", None, ba, accum=2)
    out[("accum", "nvme")] = _run("sgd", TieredBank.factory(default="nvme", nvme_dir=fresh("accum")), ba,
                                  prefetch=True, accum=2)

    # Restart: k steps, close, reopen the files with resume=True, restore the
    # non-bank state, continue. Compared with the uninterrupted reference.
    for how in ("training_state", "load_state_dict"):
        d = fresh(f"restart-{how}")
        head = _head("sgd", TieredBank.factory(default="nvme", nvme_dir=d))
        first = _train(head, b[:RESTART_AT], LR["sgd"], prefetch=True)
        saved = {k: v.clone() for k, v in head.state_dict().items()}
        training_state = head.training_state()
        head.close()
        head = _head("sgd", TieredBank.factory(default="nvme", nvme_dir=d, resume=True))
        resumed_weight = head.bank.export("weight")
        if how == "training_state":   # the bank files are the checkpoint of the rows
            head.load_training_state(training_state)
        else:
            head.load_state_dict(saved)
        rest = _train(head, b[RESTART_AT:], LR["sgd"], prefetch=True)
        out[("restart", how)] = _result(head, first + rest, resumed_weight=resumed_weight,
                                        saved_weight=saved["weight"])
        head.close()
    return out


@pytest.fixture(scope="module")
def nvme(stream_mode, tmp_path_factory):
    if not AIO:
        pytest.skip("DeepSpeed's AsyncIOBuilder().is_compatible() is False: no nvme tier here")
    return run_ranks(_nvme_ranks, WORLD, str(tmp_path_factory.mktemp("nvme-ranks")))


@needs_aio
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
@pytest.mark.parametrize("prefetch", [False, True], ids=["staged", "prefetch"])
def test_nvme_tier_matches_device_bank_bitwise(nvme, opt, prefetch):
    for rank, res in enumerate(nvme):
        got = res[(opt, "nvme", prefetch)]
        _assert_same(got, res[(opt, "ref")], f"rank {rank} {opt} nvme prefetch={prefetch}")
        assert set(got["tiers"].values()) == {"nvme"}
        assert got["hits"] == (STEPS - 1 if prefetch else 0)
        lo, hi = Partition(C, WORLD).bounds(rank)
        assert f"rank{rank}-weight-{lo}-{hi}.bank" in got["files"], got["files"]      # named by global rank


@needs_aio
@pytest.mark.parametrize("name", list(MIXED_NVME))
def test_nvme_mixed_placements_match_device_bank_bitwise(nvme, name):
    opt, placements, default = MIXED_NVME[name]
    for rank, res in enumerate(nvme):
        got = res[name]
        _assert_same(got, res[(opt, "ref")], f"rank {rank} {name}")
        for state, tier in got["tiers"].items():
            assert tier == Placement.parse(placements.get(state, default)).tier, (state, got["tiers"])


@needs_aio
def test_nvme_gradient_accumulation_with_prefetch_matches_device_bank(nvme):
    for rank, res in enumerate(nvme):
        _assert_same(res[("accum", "nvme")], res[("accum", "ref")], f"rank {rank} nvme accumulation")


@needs_aio
@pytest.mark.parametrize("how", ["training_state", "load_state_dict"])
def test_nvme_bank_survives_restart(nvme, how):
    """``resume=True`` reopens the files: the reopened weights are the saved ones
    (not the initial centers), and with the sampler counters restored the run
    continues exactly as the uninterrupted reference."""
    for rank, res in enumerate(nvme):
        got = res[("restart", how)]
        assert torch.equal(got["resumed_weight"], got["saved_weight"])
        _assert_same(got, res[("sgd", "ref")], f"rank {rank} restart via {how}")


# ---------------------------------------------------------------- single process
def _tiered(tier, tmp_path, opt="sgd", **kw):
    nvme_dir = str(tmp_path) if tier == "nvme" else None
    return _head(opt, TieredBank.factory(default=tier, nvme_dir=nvme_dir, **kw))


def _tiers():
    return ["host", pytest.param("nvme", marks=needs_aio)]


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


def test_bad_bank_arguments(tmp_path):
    with pytest.raises(ValueError, match="nvme_dir"):
        _head("sgd", TieredBank.factory(default="nvme"))
    with pytest.raises(ValueError, match="nvme_dir"):
        _head("sgd", TieredBank.factory({"weight": "nvme"}))
    with pytest.raises(FileNotFoundError, match="nvme_dir"):
        TieredBank.factory(default="nvme", nvme_dir=str(tmp_path / "missing"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileNotFoundError, match="nvme_dir"):
        TieredBank.factory({"weight": "nvme"}, nvme_dir=str(tmp_path / "file"))
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
    per-row version counters, at most 2 x 8 bytes per row and state, and the NVMe
    stores' page-locked staging buffers), staged bytes while a step is pending, and
    the traffic of each step."""
    b = _batches(0, 1, steps)
    per_row_in = sum(esize * D for _, esize in expected.values())
    placed = {"device": 0, "host": 0, "nvme": 0}
    for tier, esize in expected.values():
        placed[tier] += C * D * esize
    report = head.memory_report()
    res = report["resident"]
    buffers = sum(head.bank.store(n).nbytes() for n, (tier, _) in expected.items() if tier == "nvme")
    assert res["device"] == placed["device"]
    assert placed["host"] <= res["host"] <= placed["host"] + 16 * C * len(expected) + buffers
    assert placed["nvme"] <= res["nvme"] <= placed["nvme"] + (64 << 10)   # + header and block padding
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


@needs_aio
def test_memory_report_counts_nvme_state_on_the_nvme_tier(tmp_path):
    """A state placed on NVMe lives in its file: the nvme tier holds at least
    C_q x d x 4 bytes of float32 weights, also when the page-locked staging buffer is
    much smaller than the file (block_rows 64, stage_bytes 8 KiB here)."""
    bank = TieredBank.factory({"weight": "nvme"}, default="host", nvme_dir=str(tmp_path),
                              nvme_options={"block_rows": 64, "stage_bytes": 8192})
    head = _head("sgd", bank)
    try:
        _check_report(head, {"weight": ("nvme", 4), "momentum_buffer": ("host", 4)}, 3)
    finally:
        head.close()


# ---------------------------------------------------------------- main thread vs I/O worker
@needs_aio
def test_checkpoint_between_prefetch_and_step_does_not_race_the_io_worker(tmp_path):
    """NvmeStore is single-threaded (its staging buffer and aio handle are shared).
    ``head.centers()``/``state_dict()``/``flush()`` called between prefetch and
    step must not enter the store while the I/O worker is still fetching the
    prefetched rows (seen as a hang or garbage rows). The worker's gather is held at
    its entry until the main thread is done, so the check is deterministic and the
    real I/O never overlaps."""
    b = _batches(0, 1, 3)
    head, ref = _head("sgd", TieredBank.factory(default="nvme", nvme_dir=str(tmp_path))), _head("sgd")
    store = head.bank.store("weight")
    inside, overlaps, gate, entered = [], [], threading.Event(), threading.Event()
    gate.set()

    def guard(name, orig):
        def call(*args, **kwargs):
            worker = threading.current_thread() is not threading.main_thread()
            me = f"{name} ({'I/O worker' if worker else 'main thread'})"
            others = [n for n in inside if n.endswith("(I/O worker)") != worker]   # another thread's calls
            if others:
                overlaps.append((me, others))
            inside.append(me)
            if worker:
                entered.set()
                gate.wait(timeout=1.5)
            try:
                return orig(*args, **kwargs)
            finally:
                inside.remove(me)
        return call
    for name in ("gather", "scatter", "flush", "read_all"):
        setattr(store, name, guard(name, getattr(store, name)))
    for i, (x, y) in enumerate(b):
        for h in (head, ref):
            h(x, y).backward()
        if i == 1:
            gate.clear()
            entered.clear()
            head.prefetch(b[i + 1][1])
            entered.wait(timeout=1.0)       # the worker is fetching the next slot's cold rows
            try:
                snapshot = head.centers()   # e.g. logging or a checkpoint mid-step
            finally:
                gate.set()
            assert torch.equal(snapshot, ref.centers())
        elif i + 1 < len(b):
            head.prefetch(b[i + 1][1])
        for h in (head, ref):
            h.step(LR["sgd"])
    gate.set()
    assert torch.equal(head.centers(), ref.centers())
    head.close()
    assert not overlaps, f"main thread entered the NvmeStore while the I/O worker was in it: {overlaps[:3]}"


@needs_aio
def test_nvme_files_are_named_by_owner_and_never_shared(tmp_path):
    """Two replicas of one class range (a head replicated over tensor-parallel ranks)
    get files of their own; two banks that would use the same file are refused
    before either overwrites the other."""
    d = str(tmp_path)
    make = TieredBank.factory(default="nvme", nvme_dir=d)
    a = make(12, "cpu", class_start=5, owner="rank0")
    b = make(12, "cpu", class_start=5, owner="rank1")
    a.add_state("weight", 4, torch.float32, init=lambda lo, hi: torch.ones(hi - lo, 4))
    b.add_state("weight", 4, torch.float32, init=lambda lo, hi: torch.full((hi - lo, 4), 2.0))
    assert torch.equal(a.export("weight"), torch.ones(12, 4)) and torch.equal(b.export("weight"), torch.full((12, 4), 2.0))
    assert {"rank0-weight-5-17.bank", "rank1-weight-5-17.bank"} <= set(os.listdir(d))
    clash = make(12, "cpu", class_start=5, owner="rank0")
    with pytest.raises(RuntimeError, match="in use by another open store"):
        clash.add_state("weight", 4, torch.float32, init=lambda lo, hi: torch.zeros(hi - lo, 4))
    assert torch.equal(a.export("weight"), torch.ones(12, 4))         # untouched
    a.close()
    b.close()
    # once closed, the file can be reopened (a resumed run)
    again = TieredBank.factory(default="nvme", nvme_dir=d, resume=True)(12, "cpu", class_start=5, owner="rank0")
    again.add_state("weight", 4, torch.float32, init=lambda lo, hi: torch.zeros(hi - lo, 4))
    assert torch.equal(again.export("weight"), torch.ones(12, 4))
    again.close()
    # a head passes its global rank as the owner
    os.makedirs(tmp_path / "h")
    head = PartialFC(C, D, sample_rate=1.0, bank=TieredBank.factory(default="nvme", nvme_dir=str(tmp_path / "h")))
    assert f"rank0-weight-0-{C}.bank" in os.listdir(tmp_path / "h")
    head.close()
