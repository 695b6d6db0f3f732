"""The CPU stream emulator (``DS_PFC_DEBUG_STREAMS=1``) turns the tiered bank's
cross-stream ordering bugs into failures on the CPU.

Each test breaks the stager in one known way (W1: index tensors used on a side
stream without an owner; W2: merged slots pooled before their last read, or a pool
that ignores pending consumers; W3: device-tier rows written on another stream than
the one that reads them, versions counted at enqueue; a missing wait on the ready
event) and checks that the emulator reports a StreamError or that the numbers go
wrong, while the unbroken stager matches the device bank bitwise.
"""
from __future__ import annotations

import pytest
import torch

import ds_pfc.head as head_module
from ds_pfc import ArcFace, PartialFC
from ds_pfc.bank import StreamError, TieredBank, debug_streams_active
from ds_pfc.bank import slots as slots_module
from ds_pfc.bank.slots import Slot, Stager
from ds_pfc.bank.streams import CpuRuntime, EmulatedRuntime

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
        positions, rows = slot.overlap
        slot.overlap = None
        rt = self.runtime
        rt.wait(self._fetch_stream, rt.record(rt.compute()))
        for src in sources:
            hit = torch.isin(rows, src.rows_cpu)
            src_pos = torch.searchsorted(src.rows, rows[hit].to(src.rows.device))   # compute-stream tensors
            dst_pos = positions[hit].to(src.rows.device)
            for name, dst in slot.states.items():
                rt.run(self._fetch_stream, lambda d, dp, s, sp: d.index_copy_(0, dp, s.index_select(0, sp)),
                       dst, dst_pos, src.states[name], src_pos,
                       reads=(src.states[name], src_pos, dst_pos), writes=(dst,))
            rows, positions = rows[~hit], positions[~hit]
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
    real_after_step = Stager.after_step

    def after_step(self, updated):
        for name in self.bank.state_names():
            if self.bank.store(name).tier == "device":
                self.runtime.keep_alive(self.bank.store(name).data, self._write_stream)
        fetch = self._fetch_stream
        self._fetch_stream = self._write_stream
        try:
            real_after_step(self, updated)
        finally:
            self._fetch_stream = fetch

    def write_back(self, rows_cpu, device_names, landed, host, copied):
        for name in device_names:           # counted at enqueue: the data has not landed
            self.bank.store(name).count_landed(rows_cpu)
        self.runtime.synchronize(copied)
        for name, values in host.items():
            self.bank.store(name).scatter(rows_cpu, values)
    monkeypatch.setattr(Stager, "after_step", after_step)
    monkeypatch.setattr(Stager, "_write_back", write_back)
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
