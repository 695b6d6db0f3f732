"""The CPU stream emulator (``DS_PFC_DEBUG_STREAMS=1``) turns the tiered bank's
cross-stream ordering bugs into failures on the CPU.

Each test breaks the stager in one known way (W1: index tensors used on a side
stream without an owner; W2: merged slots pooled before their last read, or a pool
that ignores pending consumers; W3: device-tier rows written on another stream than
the one that reads them, versions counted at enqueue; a missing wait on the ready
event; W4: fresh slots and compute-written device tables touched by the fetch stream
with nothing ordering it after the compute stream) and checks that the emulator
reports a StreamError or that the numbers go wrong, while the unbroken stager
matches the device bank bitwise.
"""
from __future__ import annotations

import threading

import pytest
import torch

import ds_pfc.core.head as head_module
from ds_pfc import ArcFace, PartialFC
from ds_pfc.bank import StreamError, TieredBank, debug_streams_active
from ds_pfc.bank import slots as slots_module
from ds_pfc.bank import staged as staged_module
from ds_pfc.bank.slots import Slot, Stager
from ds_pfc.bank.staged import StagedStager
from ds_pfc.bank.streams import CpuRuntime, CudaRuntime, EmulatedRuntime
from ds_pfc.bank.tiered import Placement

C, D, STEPS = 257, 8, 8


@pytest.fixture(autouse=True)
def emulated(monkeypatch):
    monkeypatch.setenv("DS_PFC_DEBUG_STREAMS", "1")
    assert debug_streams_active()


def _batches(steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    pool = torch.randperm(C, generator=g)[:40]
    proto = torch.randn(C, D, generator=g)
    out = []
    for t in range(steps):
        y = pool[torch.randint(0, pool.numel(), (6 + t % 3,), generator=g)]
        out.append((proto[y] + 0.3 * torch.randn(y.numel(), D, generator=g), y))
    return out


def _head(bank=None):
    return PartialFC(C, D, sample_rate=0.3, margin=ArcFace(16.0, 0.3), seed=3, bank=bank,
                     optimizer="sgd", momentum=0.9, weight_decay=5e-4)


def _train(head, batches, accum=1, delays=None):
    if head._stager is not None and delays:
        head._stager.runtime.stream_delay.update(delays)
    losses = []
    for i, (x, y) in enumerate(batches):
        loss = head(x, y)
        loss.backward()
        losses.append(loss.item())
        if i + 1 < len(batches):
            head.prefetch(batches[i + 1][1])
        if (i + 1) % accum == 0:
            head.step(1.0)
    centers = head.centers()
    head.close()
    return losses, centers


def _reference(accum=1):
    return _train(_head(), _batches(STEPS), accum)


TIERED = {"host": {"default": "host"}, "device": {"default": "device"},
          "mixed": {"placements": {"weight": "host"}, "default": "device"}}


def _tiered(kind):
    return _head(TieredBank.factory(**TIERED[kind]))


def _differs(got, ref):
    return got[0] != ref[0] or not torch.equal(got[1], ref[1])


def test_the_flag_selects_the_emulator(monkeypatch):
    head = _tiered("host")
    assert isinstance(head._stager.runtime, EmulatedRuntime)
    head.close()
    monkeypatch.setenv("DS_PFC_DEBUG_STREAMS", "0")
    assert not debug_streams_active()
    head = _tiered("host")
    assert isinstance(head._stager.runtime, CpuRuntime)
    head.close()


@pytest.mark.parametrize("kind", list(TIERED))
@pytest.mark.parametrize("accum", [1, 2])
def test_unbroken_stager_matches_device_bank_under_the_emulator(kind, accum):
    ref = _reference(accum)
    got = _train(_tiered(kind), _batches(STEPS), accum, delays={"fetch": 2e-3, "write": 2e-3})
    assert got[0] == ref[0]
    assert torch.equal(got[1], ref[1])


def test_w1_index_tensors_without_an_owner_are_caught(monkeypatch):
    """W1: overlap indices built on the compute stream and read by the fetch stream
    with no record_stream/keep-alive: the allocator may reuse them too early."""
    def patch(self, slot, sources):
        slot.overlap = None
        rt = self.runtime
        rt.wait(self._fetch_stream, rt.record(rt.compute()))
        for src in sources:
            # positions built on the compute stream, read by the fetch stream: never kept alive there
            src_pos = torch.searchsorted(src.rows, slot.rows).clamp_(max=src.rows.numel() - 1)
            hit = src.rows.index_select(0, src_pos) == slot.rows
            for name, dst in slot.states.items():
                rt.run(self._fetch_stream,
                       lambda d, h, s, sp: d.copy_(torch.where(h[:, None], s.index_select(0, sp), d)),
                       dst, hit, src.states[name], src_pos,
                       reads=(src.states[name], src_pos, hit), writes=(dst,))
        slot._event = rt.record(self._fetch_stream)
    monkeypatch.setattr(Stager, "_patch", patch)
    with pytest.raises(StreamError, match="without being allocated for it or kept alive"):
        _train(_tiered("host"), _batches(STEPS))


def test_w2_merged_slots_pooled_before_the_merge_give_wrong_numbers(monkeypatch):
    """W2: with accumulation the pending slots are merged; returning them to the pool
    before the merge read them (poisoned on return) corrupts the step."""
    ref = _reference(accum=2)
    holder = {}
    real_merge = slots_module.merge_slots

    def merge_early(slots):
        for s in slots:
            holder["stager"].release(s)
        return real_merge(slots)
    monkeypatch.setattr(head_module, "merge_slots", merge_early)
    head = _tiered("host")
    holder["stager"] = head._stager
    got = _train(head, _batches(STEPS), accum=2)
    assert _differs(got, ref)


def test_w3_device_rows_written_on_another_stream_are_caught(monkeypatch):
    """W3: device-tier write-backs on the write stream (not the stream that reads the
    store), their versions counted when enqueued: a later cold fetch of a written
    row is not ordered after the write."""
    real_after_step = StagedStager.after_step

    def after_step(self, updated):
        rt = self.runtime
        for name in self.bank.state_names():
            if self.bank.store(name).tier == "device":
                rt.keep_alive(self.bank.store(name).data, self._write_stream)
        real_run = rt.run

        def run(stream, fn, *args, **kwargs):     # only this thread's scatters; the I/O worker's fetches pass
            if fn is staged_module._scatter_rows:
                stream = self._write_stream
                rt.keep_alive(args[1], stream)          # the row ids: owned, so the missing wait is what fails
                rt.wait(stream, rt.record(rt.compute()))
            return real_run(stream, fn, *args, **kwargs)
        rt.run = run
        try:
            real_after_step(self, updated)
        finally:
            del rt.run

    def write_back(self, updated, device_names, landed, host, copied):
        rows_cpu = updated.rows_cpu
        for name in updated.states:
            self.bank.note_issued(name, rows_cpu)
        for name in device_names:           # counted at enqueue: the data has not landed
            self.bank.store(name).count_landed(rows_cpu)
        self.runtime.synchronize(copied)
        for name, values in host.items():
            self.bank.store(name).scatter(rows_cpu, values)
    monkeypatch.setattr(StagedStager, "after_step", after_step)
    monkeypatch.setattr(StagedStager, "_write_back", write_back)
    with pytest.raises(StreamError, match="no event orders them"):
        _train(_tiered("device"), _batches(STEPS), delays={"write": 0.03})


def test_missing_wait_on_the_ready_event_gives_wrong_numbers(monkeypatch):
    """The forward reads the prefetched slot without waiting for the overlap patch:
    the rows it reads are still poison."""
    ref = _reference()

    def wait(self):
        for fut in self._futures:
            fut.result()
        self._futures = []
        self._event = None                  # dropped, not waited on
        return self
    monkeypatch.setattr(Slot, "wait", wait)
    # The I/O worker's cold fetch finishes before the step queues the patch (a fast
    # worker), so the worker's own wait for the fetch stream does not cover the patch.
    real_after_step = StagedStager.after_step

    def after_step(self, updated):
        if self._next is not None:
            for fut in self._next[1]._futures:
                fut.result()
        real_after_step(self, updated)
    monkeypatch.setattr(StagedStager, "after_step", after_step)
    try:
        got = _train(_tiered("host"), _batches(STEPS), delays={"fetch": 0.02})
    except StreamError:
        return                              # a later write raced the unread patch: also caught
    assert _differs(got, ref)
    assert any(l != l for l in got[0]), "the poisoned rows did not reach the loss"


def test_retired_buffers_are_poisoned_and_reuse_is_checked():
    rt = EmulatedRuntime(seed=1)
    side, slow = rt.new_stream("side"), rt.new_stream("slow")
    floats = rt.empty((4, 2), torch.float32, "cpu", users=(side,))
    ints = rt.empty((3,), torch.int32, "cpu", users=(side,))
    floats.zero_()
    ints.zero_()
    rt.retire([floats, ints], [rt.record(rt.compute())])
    assert torch.isnan(floats).all() and (ints == torch.iinfo(torch.int32).min).all()
    # A consumer on a stream held back by an event nobody records yet.
    gate = rt.record(rt.new_stream("gate"))
    rt.stream_delay["gate"] = 0.3
    rt.wait(slow, gate)
    events = rt.retire([floats], [rt.record(slow)])
    assert not rt.reusable(events)
    with pytest.raises(StreamError, match="pool handed out"):
        rt.check_reusable([floats])
    rt.wait(side, rt.record(rt.compute()))     # ordered after the allocation, not after the consumer
    rt.run(side, lambda t: t.fill_(1.0), floats, writes=(floats,))
    with pytest.raises(StreamError, match="writes a buffer .* while its consumer"):
        rt.synchronize(rt.record(side))
    rt.close()


def test_large_host_tables_are_registered_not_rounded(monkeypatch):
    """M2: with CUDA, a large host table is plain memory registered with
    cudaHostRegister (the caching host allocator would round it up to a power of
    two), and unregistered on close; small ones use the pinned allocator."""
    from ds_pfc.bank import stores
    calls = []

    class Cudart:
        def cudaHostRegister(self, ptr, nbytes, flags):
            calls.append(("register", ptr, nbytes, flags))
            return 0

        def cudaHostUnregister(self, ptr):
            calls.append(("unregister", ptr))
            return 0
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: Cudart())
    monkeypatch.setattr(stores, "pinned_empty", lambda shape, dtype: torch.empty(shape, dtype=dtype))
    monkeypatch.setattr(stores, "REGISTER_MIN_BYTES", 1000)
    big = stores.HostStore(100, 5, torch.float32)             # 2000 bytes
    assert calls == [("register", big.data.data_ptr(), 2000, 0)]
    stores.HostStore(10, 5, torch.float32)                    # 200 bytes: not registered
    assert len(calls) == 1
    big.close()
    big.close()
    assert calls[1:] == [("unregister", big.data.data_ptr())]


# ------------------------------------------------- W4: the compute stream's own order
def test_a_side_stream_must_be_ordered_after_a_compute_allocation():
    """Hand-written sequences: a buffer allocated on the compute stream and written
    on a side stream with no event between them is flagged at once; the same write
    after a wait on a compute event, or after the host synchronized one, is not."""
    rt = EmulatedRuntime(seed=2)
    side = rt.new_stream("side")
    fresh = rt.empty((4, 2), torch.float32, "cpu", users=(side,))
    with pytest.raises(StreamError, match="side> writes a buffer .* compute stream allocated"):
        rt.run(side, lambda t: t.fill_(1.0), fresh, writes=(fresh,))
    with pytest.raises(StreamError, match="side> reads a buffer .* compute stream allocated"):
        rt.run(side, lambda t: t.sum(), fresh, reads=(fresh,))
    early = rt.record(rt.compute())                  # recorded before the next allocation
    ordered = rt.empty((4, 2), torch.float32, "cpu", users=(side,))
    rt.wait(side, early)
    with pytest.raises(StreamError, match="compute stream allocated"):
        rt.run(side, lambda t: t.fill_(2.0), ordered, writes=(ordered,))
    rt.wait(side, rt.record(rt.compute()))
    rt.run(side, lambda t: t.fill_(2.0), ordered, writes=(ordered,))
    rt.synchronize(rt.record(side))
    assert (ordered == 2.0).all()
    synced = rt.empty((3,), torch.float32, "cpu", users=(side,))
    rt.synchronize(rt.record(rt.compute()))          # the host saw the compute stream get there
    rt.run(side, lambda t: t.fill_(3.0), synced, writes=(synced,))
    # A side stream ordered after another one that waited on compute is ordered too.
    relay, other = rt.new_stream("relay"), rt.new_stream("other")
    chained = rt.empty((2,), torch.float32, "cpu", users=(other,))
    rt.wait(relay, rt.record(rt.compute()))
    rt.wait(other, rt.record(relay))
    rt.run(other, lambda t: t.fill_(4.0), chained, writes=(chained,))
    # Pinned host buffers are filled by the host, not by the compute stream.
    pinned = rt.empty((2,), torch.float32, "cpu", users=(side,), pin=True)
    rt.run(side, lambda t: t.fill_(5.0), pinned, writes=(pinned,))
    rt.synchronize(rt.record(side))
    rt.synchronize(rt.record(other))
    assert (synced == 3.0).all() and (chained == 4.0).all() and (pinned == 5.0).all()
    rt.close()


def test_compute_stream_reads_and_writes_are_ordered_against_side_streams():
    rt = EmulatedRuntime(seed=3)
    side = rt.new_stream("side")
    table = torch.zeros(5)
    rt.keep_alive(table, side)
    rt.on_compute(writes=(table,))                   # e.g. a device table loaded by the caller
    with pytest.raises(StreamError, match="reads a buffer .* compute stream wrote"):
        rt.run(side, lambda t: t.sum(), table, reads=(table,))
    rt.wait(side, rt.record(rt.compute()))
    rt.run(side, lambda t: t.sum(), table, reads=(table,))
    rt.on_compute(reads=(table,))                    # read on compute, then read on a side stream: fine
    rt.run(side, lambda t: t.sum(), table, reads=(table,))
    with pytest.raises(StreamError, match="writes a buffer .* compute stream read"):
        rt.run(side, lambda t: t.add_(1.0), table, writes=(table,))
    rt.synchronize(rt.record(side))                  # the reads above have run
    rt.wait(side, rt.record(rt.compute()))
    rt.stream_delay["side"] = 0.2
    rt.run(side, lambda t: t.add_(1.0), table, writes=(table,))
    with pytest.raises(StreamError, match="the compute stream writes a buffer .* write on <stream side>"):
        rt.on_compute(writes=(table,))               # the side stream's write is still queued
    rt.synchronize(rt.record(side))
    rt.on_compute(writes=(table,))
    assert (table == 1.0).all()
    rt.close()


def test_to_host_copies_late_on_the_compute_stream():
    rt = EmulatedRuntime(seed=4)
    rt.stream_delay["compute"] = 0.05
    host, event = rt.to_host(torch.arange(6))
    assert not rt.query(event) and (host == torch.iinfo(torch.int64).min).all()   # garbage until it lands
    rt.synchronize(event)
    assert torch.equal(host, torch.arange(6))
    rt.close()


def _rows_on_host_without_a_sync(monkeypatch, runtime=EmulatedRuntime):
    """The optimisation that exposed the missing order: the host gets the row ids
    without synchronizing with the compute stream (no blocking device-to-host copy)."""
    monkeypatch.setattr(runtime, "to_host", lambda self, t: (t.to("cpu"), None))


def _unordered(monkeypatch):
    """The stager before the fix: nothing orders the fetch stream after compute."""
    monkeypatch.setattr(Stager, "_order_after_compute", lambda self: None)


@pytest.mark.parametrize("kind", list(TIERED))
def test_w4_fresh_slots_unordered_after_compute_are_caught_once_the_host_sync_is_gone(kind, monkeypatch):
    """W4: fresh slot buffers come from the compute stream's allocator and the fetch
    stream writes them. With the host synchronizing on the row ids the order holds by
    accident; without that sync and without the wait the emulator flags it."""
    ref = _reference()
    _unordered(monkeypatch)
    got = _train(_tiered(kind), _batches(STEPS))     # the host sync still hides it
    assert got[0] == ref[0] and torch.equal(got[1], ref[1])
    _rows_on_host_without_a_sync(monkeypatch)
    what = "wrote" if kind == "device" else "allocated"   # device tables: their initial values
    with pytest.raises(StreamError, match=f"<stream fetch> (writes|reads) a buffer .* compute stream {what}"):
        _train(_tiered(kind), _batches(STEPS))


@pytest.mark.parametrize("kind", list(TIERED))
@pytest.mark.parametrize("accum", [1, 2])
def test_w4_stager_is_ordered_after_compute_without_the_host_sync(kind, accum, monkeypatch):
    _rows_on_host_without_a_sync(monkeypatch)
    ref = _reference(accum)
    got = _train(_tiered(kind), _batches(STEPS), accum, delays={"fetch": 2e-3, "write": 2e-3, "compute": 1e-3})
    assert got[0] == ref[0]
    assert torch.equal(got[1], ref[1])


def test_w4_device_tables_loaded_on_compute_are_ordered(monkeypatch):
    """``load`` writes device-tier tables on the compute stream: the emulator sees it
    (the flag names the table write, not a slot), and the ordered stager trains from
    the loaded values exactly as the device bank does."""
    _rows_on_host_without_a_sync(monkeypatch)
    centers = torch.randn(C, D, generator=torch.Generator().manual_seed(7))
    ref_head = _head()
    ref_head.load_centers(centers)
    ref = _train(ref_head, _batches(STEPS))
    head = _tiered("device")
    head.load_centers(centers)
    got = _train(head, _batches(STEPS), delays={"compute": 1e-3})
    assert got[0] == ref[0] and torch.equal(got[1], ref[1])
    head = _tiered("device")                         # ordered after its initial values
    _unordered(monkeypatch)
    head.load_centers(centers)
    with pytest.raises(StreamError, match="<stream fetch> reads a buffer .* compute stream wrote"):
        _train(head, _batches(STEPS))


@pytest.mark.parametrize("accum", [1, 2])
def test_only_the_io_worker_waits_for_the_row_ids(accum, monkeypatch):
    """The row ids reach the host by an asynchronous copy; the host thread never
    waits for it (in prefetch it would stall until the device caught up with the
    backward): the I/O worker does, before it splits and fetches."""
    waits = []
    real = Slot.rows_cpu

    def rows_cpu(self):
        if self._rows_event is not None:
            waits.append(threading.current_thread() is threading.main_thread())
        return real.fget(self)
    monkeypatch.setattr(Slot, "rows_cpu", property(rows_cpu))
    ref = _reference(accum)
    got = _train(_tiered("host"), _batches(STEPS), accum, delays={"compute": 1e-3})
    assert got[0] == ref[0] and torch.equal(got[1], ref[1])
    assert len(waits) >= STEPS - 1 and not any(waits), f"waits on the host thread: {waits}"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: the real streams and allocator")
def test_w4_fresh_slot_on_cuda_is_written_after_the_compute_stream(monkeypatch):
    """On a GPU: a tensor read by compute work still queued (behind a sleep) is freed,
    and a fresh slot of the same size takes its memory from the caching allocator.
    With the host not synchronizing (row ids known on the host), the fetch stream
    must still wait for the compute stream before it writes the slot, or the queued
    reader sees the slot's rows instead of its own values."""
    dev = torch.device("cuda", torch.cuda.current_device())
    n, d = 256, 256
    table = torch.randn(4 * n, d)
    bank = TieredBank(4 * n, dev, default=Placement("device"))
    bank.add_state("weight", d, torch.float32, init=table)
    stager = StagedStager(bank)
    try:
        rows_host = torch.arange(0, 4 * n, 4)
        rows = rows_host.to(dev)
        monkeypatch.setattr(CudaRuntime, "to_host", lambda self, t: (rows_host.clone(), None))
        torch.cuda.synchronize(dev)
        old = torch.full((n, d), 7.0, device=dev)
        block = old.data_ptr()
        torch.cuda._sleep(int(5e8))                  # the compute stream runs ~0.3 s behind the host
        reader = old * 1.0                           # queued behind the sleep, reads ``old``
        del old                                      # its block goes back to the compute stream's cache
        slot = stager.stage(rows, pooled=False)
        assert slot.states["weight"].data_ptr() == block, "the allocator did not reuse the freed block"
        torch.cuda.synchronize(dev)
        assert (reader == 7.0).all(), "the fetch stream wrote the slot before the compute stream's reader ran"
        assert torch.equal(slot.states["weight"].cpu(), table[rows_host])
    finally:
        stager.close()
