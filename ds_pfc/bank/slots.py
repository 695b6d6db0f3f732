"""Staging slots and the double-buffered, stale-free prefetcher (paper: Figure
async_pipeline, "Asynchronous hierarchical class storage").

A :class:`Slot` holds the active rows ``S`` of every bank state on the compute
device; the forward reads its centers, the row optimizer updates it in place, and it
is then written back. With lookahead labels the next step's slot B is built while
step t runs on slot A:

1. ``prefetch`` (during step t): ``S(t+1)`` is known on the device. The I/O worker
   waits for its copy to the host (the host thread does not), splits it, and fetches
   the cold rows ``S(t+1) \\ S(t)`` into B at once (on GPU: on a side stream).
2. ``after_step`` (optimizer step t done): the overlapping rows ``S(t) ∩ S(t+1)`` are
   copied from A into B, never earlier (before the step they would be stale), found on
   the device by binary search in the sorted row sets; then A is written back
   asynchronously. The I/O worker counts every write as *issued* before anything it
   runs later, and the store as *completed* when it lands (per-row versions). The
   training thread handles no row ids: it queues fixed numbers of ops.
3. ``take`` (forward t+1): B is exposed only when both paths finished (the ready
   gate: futures on CPU, plus a CUDA event the compute stream waits on).

All bank I/O runs on one worker thread, in submission order: a write-back is always
complete before any later read of the same rows, so reads find current versions;
the version check turns any violation (a lost, late or torn write) into a
:class:`~ds_pfc.bank.tiered.StaleRowError`. Slot A stays alive (and, on GPU, its
memory is marked in use by the side stream) until its readers and its write-back
finished, so it is never reused early. Without lookahead, ``stage`` reads
synchronously through the same worker and gives identical results.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch

from ..devices import set_thread_device
from .base import ClassBank
from .quantized import RowwiseInt8Store
from .rows import move_rows_torch_
from .split import SplitStore
from .streams import CpuRuntime, Runtime, runtime_for
from .tiered import TieredBank

__all__ = ["Slot", "SlotBank", "Stager", "merge_slots"]


class Slot:
    """Rows ``rows`` (sorted local ids) of every state, on the compute device.

    The host needs the row ids too (version checks, host and NVMe gathers, the
    overlap split): they are copied to the host asynchronously on the compute stream
    and ``rows_cpu`` waits for that copy at its first use, or are passed in as
    ``rows_cpu`` where the host knows them already.
    """

    def __init__(self, rows: torch.Tensor, states: dict[str, torch.Tensor], runtime: Runtime | None = None,
                 rows_cpu: torch.Tensor | None = None, host_ids: bool = True):
        self.rows = rows
        self._rows_event = None
        if rows_cpu is not None:
            self._rows_cpu = rows_cpu
        elif not host_ids:
            self._rows_cpu = None    # mapped access: copied only if asked for (a host sync)
        elif runtime is None:
            self._rows_cpu = rows.to("cpu")
        else:
            self._rows_cpu, self._rows_event = runtime.to_host(rows)
        self.states = states
        self.runtime = runtime
        self._futures: list[Future] = []
        self._event = None           # recorded on the fetch stream once the overlap patch is queued
        self.overlap = None          # a prefetched slot: "device" while rows held by live slots await the patch
        self.buffers = None          # the pooled full-capacity tensors behind ``states``
        # Events of side-stream work that reads this slot (overlap patches, write-backs):
        # its buffers may be reused only after them.
        self.readers: list = []

    @property
    def rows_cpu(self) -> torch.Tensor:
        """``rows`` on the host (blocks until their copy has landed)."""
        if self._rows_cpu is None:
            self._rows_cpu = self.rows.to("cpu")
        event = self._rows_event
        if event is not None:
            self.runtime.synchronize(event)
            self._rows_event = None
        return self._rows_cpu

    def wait(self) -> "Slot":
        """The ready gate: block until the cold fetch and the overlap patch finished."""
        for fut in self._futures:
            fut.result()              # re-raises a StaleRowError or an I/O error here
        self._futures = []
        if self._event is not None:
            self.runtime.wait(self.runtime.compute(), self._event)
            self._event = None
        return self


class SlotBank(ClassBank):
    """A slot seen as a bank of ``len(slot.rows)`` rows, for the row optimizer."""

    def __init__(self, slot: Slot):
        super().__init__(slot.rows.numel(), slot.rows.device)
        self.slot = slot

    def add_state(self, name, width, dtype, init=None):
        raise NotImplementedError("a slot holds the states of its bank")

    def state_names(self):
        return list(self.slot.states)

    def read(self, name, rows):
        state = self.slot.states[name]
        return state if rows is None else state.index_select(0, rows)

    def write(self, name, rows, values):
        state = self.slot.states[name]
        if rows is None:
            state.copy_(values)
        else:
            state.index_copy_(0, rows, values.to(state.dtype))

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The slot's live state tensors (for in-place fused updates)."""
        return dict(self.slot.states)

    def export(self, name):
        return self.slot.states[name].clone()

    def resident_bytes(self):
        return {"device": sum(t.numel() * t.element_size() for t in self.slot.states.values()), "host": 0, "nvme": 0}


def merge_slots(slots: list[Slot]) -> tuple[Slot, torch.Tensor]:
    """One slot over the union of ``slots``' rows (they hold equal values where they
    overlap: no step ran between them) and, per row of the concatenation, its
    position in the union (for summing gradients)."""
    all_rows = torch.cat([s.rows for s in slots])
    rows, inverse = torch.unique(all_rows, return_inverse=True)
    first = torch.empty(rows.numel(), dtype=torch.long, device=rows.device)
    first.scatter_(0, inverse, torch.arange(all_rows.numel(), device=rows.device))
    states = {name: torch.cat([s.states[name] for s in slots]).index_select(0, first) for name in slots[0].states}
    if any(s._rows_cpu is None for s in slots):      # mapped access: no row ids on the host
        return Slot(rows, states, slots[0].runtime, host_ids=False), inverse
    # The union on the host from the slots' host rows (equal to ``rows``): no copy back.
    rows_cpu = torch.unique(torch.cat([s.rows_cpu for s in slots]))
    return Slot(rows, states, slots[0].runtime, rows_cpu=rows_cpu), inverse


class Stager:
    """Stages bank rows into slots, prefetches the next slot, writes slots back.

    Streams (see :mod:`ds_pfc.bank.streams`): ``fetch`` carries every host-to-device
    copy, the overlap patches and the reads *and* write-backs of device-tier states
    (one stream, so a device-tier row is always read after its last write);
    ``write`` carries the device-to-host copies of write-backs, so a write-back never
    queues ahead of the next fetch. Ownership: slot buffers are allocated for both
    streams, index tensors are made inside the operation on the stream that uses
    them, and a slot's buffers return to the pool with the events of their last
    readers (the compute stream's and the side streams'); the pool hands a buffer
    out only once those completed.

    Compute-stream order: a new slot's buffers come from the compute stream's
    allocator (their memory may still be read by compute work queued before, for the
    tensor that held it), and device-tier tables are written on the compute stream
    (initial values, ``load``). The fetch stream waits on an event recorded on the
    compute stream after these before it touches them (:meth:`_order_after_compute`,
    once per new slot and after every such write), whether or not the host happened
    to synchronize with the compute stream in between.
    """

    def __init__(self, bank: TieredBank, mover: Callable | None = None):
        self.bank = bank
        self.device = bank.device
        self.mapped = bool(getattr(bank, "mapped", False))
        # Mapped access: the row-move function (the caller's kernel, e.g. Triton's on CUDA;
        # torch ops by default). A CUDA bank with host tables needs a kernel: torch ops
        # cannot index host memory from the device.
        if self.mapped and mover is None and self.device.type == "cuda":
            raise ValueError("host_access='mapped' on CUDA needs a row-move kernel (Triton: pip install "
                             "ds_pfc[triton]); or use host_access='staged'")
        self._move = (mover or move_rows_torch_) if self.mapped else None
        # 8-bit rows are coded and decoded by the bank's codec kernels where it has them.
        self._codec = getattr(bank, "row_codec", None)
        # The worker makes the head's GPU current before any CUDA call: a new thread
        # starts on device 0 and would create a context there on every rank.
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ds_pfc-bank-io",
                                      initializer=set_thread_device, initargs=(self.device,))
        self.runtime = runtime_for(self.device)
        self._fetch_stream = self.runtime.new_stream("fetch")
        self._write_stream = self.runtime.new_stream("write")
        device_tables = [t for n in bank.state_names() if bank.store(n).tier == "device" for t in _tables(bank.store(n))]
        for data in device_tables:
            self.runtime.keep_alive(data, self._fetch_stream)
        if self.mapped:           # the fetch stream's kernels read and write the host tables too
            for name in bank.state_names():
                for table in _tables(bank.store(name)):
                    self.runtime.keep_alive(table, self._fetch_stream)
        # The tables were filled on the compute stream (initial values); later
        # compute-stream writes (load) are reported by the bank through this hook.
        self._device_tables_written(device_tables)
        bank.on_device_write = self._device_tables_written
        self._next: tuple[object, Slot] | None = None
        self._writebacks: list[Future] = []
        self._failure: BaseException | None = None   # a failed write-back, sticky
        self._pool: list[tuple[dict[str, torch.Tensor], list]] = []   # (buffers, events before reuse)
        self._pool_lock = threading.Lock()
        self._stage_buffers: dict[str, torch.Tensor] = {}
        # Test hook: copy overlapping rows at prefetch time, *before* the optimizer
        # step. This is the ordering bug the pipeline exists to avoid.
        self.patch_before_step = False

    # ---------------------------------------------------------------- ordering
    def _order_after_compute(self) -> None:
        """Make the fetch stream's later work wait for the compute stream's work so
        far. Called on the host thread that owns the compute stream."""
        rt = self.runtime
        rt.wait(self._fetch_stream, rt.record(rt.compute()))

    def _device_tables_written(self, tables: list[torch.Tensor]) -> None:
        """Device-tier ``tables`` were just written on the compute stream: the fetch
        stream, which reads and writes them, is ordered after that."""
        if tables:
            self.runtime.on_compute(writes=tables)
            self._order_after_compute()

    # ---------------------------------------------------------------- reads
    def _fetch(self, slot: Slot, positions: torch.Tensor | None, rows_cpu: torch.Tensor | None) -> None:
        """(I/O worker) read ``rows_cpu`` of every state into ``slot`` at ``positions``
        (CPU; None: all of it, then ``rows_cpu`` None: the slot's rows), checking
        versions first."""
        rt = self.runtime
        if rows_cpu is None:
            rows_cpu = slot.rows_cpu        # waits for the copy of the ids, here on the worker
        for name, dst in slot.states.items():
            store = self.bank.store(name)
            self.bank.check_versions(name, rows_cpu)
            if isinstance(store, RowwiseInt8Store) and store.tier == "device":
                rt.run(self._fetch_stream, _read_coded, dst, positions, store, rows_cpu, self._codec,
                       reads=store.tables(), writes=(dst,))
            elif store.tier == "device":
                rt.run(self._fetch_stream, _gather_rows, dst, positions, store.data, rows_cpu,
                       reads=(store.data,), writes=(dst,))
            elif isinstance(store, RowwiseInt8Store):       # host: codes cross as codes
                q, scale = store.gather_codes(rows_cpu, self._staging(name, rows_cpu.numel()))
                rt.keep_alive(q, self._fetch_stream)
                rt.keep_alive(scale, self._fetch_stream)
                rt.run(self._fetch_stream, store.land_codes, dst, positions, q, scale, self._codec,
                       reads=(q, scale), writes=(dst,))
            else:
                staging = self._staging(name, rows_cpu.numel())
                values = store.gather_into(rows_cpu, staging)
                if values is not staging:
                    rt.keep_alive(values, self._fetch_stream)
                rt.run(self._fetch_stream, _land_rows, dst, positions, values, reads=(values,), writes=(dst,))
        # The staging buffers are reused by the next fetch, and the caller's future
        # means "landed": wait for the copies here, on the I/O worker.
        rt.synchronize(rt.record(self._fetch_stream))

    def _staging(self, name: str, num: int) -> torch.Tensor:
        """(I/O worker) a reusable host buffer for ``num`` rows of ``name``. One
        worker uses it and waits for its copies, so one buffer per state is enough."""
        store = self.bank.store(name)
        buf = self._stage_buffers.get(name)
        if buf is None or buf.shape[0] < num:
            buf = self.runtime.empty((num,) + store.row_shape, store.dtype, "cpu", users=(self._fetch_stream,),
                                     pin=True)
            self._stage_buffers[name] = buf
        return buf[:num]

    def _empty_slot(self, rows: torch.Tensor, pooled: bool = True) -> Slot:
        """A slot for ``rows``. Pooled slots reuse the buffers of slots whose last
        readers finished (the double buffer: A while B fills, then B while A drains),
        so steady-state staging allocates nothing."""
        num = rows.numel()
        buffers = None
        if pooled:
            with self._pool_lock:
                for i, (candidate, events) in enumerate(self._pool):
                    if next(iter(candidate.values())).shape[0] >= num and self.runtime.reusable(events):
                        buffers = self._pool.pop(i)[0]
                        break
            if buffers is not None:
                self.runtime.check_reusable(buffers.values())
        if buffers is None:
            users = (self._fetch_stream, self._write_stream)
            buffers = {name: self.runtime.empty((num,) + self.bank.store(name).row_shape, self.bank._logical[name],
                                                self.device, users=users) for name in self.bank.state_names()}
        slot = Slot(rows, {name: t[:num] for name, t in buffers.items()}, self.runtime, host_ids=not self.mapped)
        slot.buffers = buffers if pooled else None
        # Fresh buffers belong to the compute stream's order, and a pooled buffer's last
        # compute-stream readers are covered too: the fetch stream writes them after.
        self._order_after_compute()
        return slot

    def release(self, slot: Slot, events: list | None = None) -> None:
        """Return a slot's buffers to the pool, to be reused after ``events``
        (default: everything the compute stream was given so far, and the slot's
        side-stream readers). Call it after the compute stream's last use is queued."""
        if events is None:
            events = [self.runtime.record(self.runtime.compute())] + slot.readers
        buffers, slot.buffers = slot.buffers, None
        if buffers is not None:
            events = self.runtime.retire(buffers.values(), events)
            with self._pool_lock:
                self._pool.append((buffers, events))
                del self._pool[:-3]         # slots A and B and one spare

    def _row_bytes(self) -> int:
        """Bytes one row of every state takes in its store."""
        return sum(self.bank.store(name).row_bytes() for name in self.bank.state_names())

    def stage(self, rows: torch.Tensor, pooled: bool = True) -> Slot:
        """Synchronous staging of ``rows`` (sorted local ids on the device).
        ``pooled=False`` for slots that are never stepped (evaluation)."""
        self.raise_failed()
        slot = self._empty_slot(rows, pooled)
        self.bank.count_traffic(staged_in=rows.numel() * self._row_bytes())
        if self.mapped:
            self._fetch_mapped(slot, None)
            return slot.wait()
        self._io.submit(self._fetch, slot, None, None).result()
        return slot

    def prefetch(self, rows: torch.Tensor, key, live: list[Slot]) -> None:
        """Start building the slot for the forward identified by ``key`` while the
        ``live`` slots (staged, not yet stepped) are still in use. Returns without
        waiting for the device."""
        self.raise_failed()
        self.discard()                      # a second lookahead replaces the first
        if self.mapped:
            self._prefetch_mapped(rows, key, live)
            return
        # The overlap rows are patched on the device after the step (_patch), so this
        # thread needs no row ids.
        held = self._count_cold(rows, live)
        slot = self._empty_slot(rows)
        # The cold rows are found and fetched on the I/O worker, which waits for the
        # copy of the row ids to the host; this thread goes on queueing the step.
        slot._futures.append(self._io.submit(self._split_and_fetch, slot, list(live)))
        if held is not None:
            slot.overlap = "device"         # patched from the live slots after their step
            if self.patch_before_step:      # the test hook's ordering bug (see __init__)
                self._patch(slot, live)
                # Completed now, so that it reads the pre-step values on every runtime.
                self.runtime.synchronize(slot._event)
        self._next = (key, slot)

    def _split_and_fetch(self, slot: Slot, live: list[Slot]) -> None:
        """(I/O worker) fetch the prefetched slot's cold rows: those the ``live`` slots
        do not hold (the others are copied from them after the step)."""
        rows_cpu = slot.rows_cpu
        # Both sides are sorted: a binary search per row, not isin's sort of both sets.
        in_live = _held_by(rows_cpu, [s.rows_cpu for s in live])
        cold = torch.arange(rows_cpu.numel()) if in_live is None else torch.nonzero(~in_live).squeeze(1)
        if cold.numel():
            self._fetch(slot, cold, rows_cpu[cold])

    def take(self, rows: torch.Tensor, key, live: list[Slot]) -> Slot | None:
        """The prefetched slot for ``key`` once ready, or None if there is none."""
        self.raise_failed()
        if self._next is None:
            return None
        next_key, slot = self._next
        self._next = None
        if next_key != key or not (slot.rows is rows or torch.equal(slot.rows, rows)):
            slot.wait()                     # drop it, but surface its errors
            self.release(slot)
            return None
        if slot.overlap is not None:        # no step since prefetch: live values are current
            self._patch(slot, live)
        return slot.wait()

    def _patch(self, slot: Slot, sources: list[Slot]) -> None:
        """Copy ``slot``'s rows that ``sources`` hold from them (after their update), on
        the fetch stream, ordered after the compute stream's work so far, rounded through
        each state's storage: found on the device by binary search in the sorted row
        sets, so the host needs no row ids (both paths)."""
        slot.overlap = None
        rt = self.runtime
        rt.wait(self._fetch_stream, rt.record(rt.compute()))
        move = self._move or move_rows_torch_
        exclusive = not self.mapped and isinstance(rt, CpuRuntime)
        patched = []
        for src in sources:
            if src.rows.numel() == 0:
                continue
            rt.keep_alive(src.rows, self._fetch_stream)
            rt.keep_alive(slot.rows, self._fetch_stream)
            for name, dst in slot.states.items():
                values = src.states[name]
                rt.keep_alive(values, self._fetch_stream)
                rt.run(self._fetch_stream, _patch_from, move, dst, slot.rows, values, src.rows,
                       self.bank.store(name), exclusive, self._codec, reads=(values, src.rows, slot.rows), writes=(dst,))
            patched.append(src)
        slot._event = rt.record(self._fetch_stream)
        for src in patched:
            src.readers.append(slot._event)

    def discard(self) -> None:
        """Drop the prefetched slot (after surfacing its errors)."""
        if self._next is not None:
            _, slot = self._next
            self._next = None
            slot.wait()
            self.release(slot)


    # ---------------------------------------------------------------- mapped access
    # Every row moves by a kernel on the fetch stream that reads or writes the bank's
    # tables themselves (device memory, or host memory mapped into the device's address
    # space): the next slot's cold rows at prefetch, its overlap rows from the stepped
    # slot after the step, the stepped slot back into the tables. One stream carries all
    # of them, so a row's write-back is always complete before a later fetch reads it,
    # and the row ids, the split and the masks stay on the device: no host sync and a
    # fixed number of ops per step, whatever the number of rows.
    def _tables(self):
        return [(name, self.bank.store(name)) for name in self.bank.state_names()]

    def _fetch_mapped(self, slot: Slot, cold: torch.Tensor | None) -> None:
        """Queue the fetch of ``slot``'s rows (where ``cold``; None: all of them) from the
        tables on the fetch stream; ``slot``'s ready gate waits for it."""
        rt = self.runtime
        rows = slot.rows
        rt.keep_alive(rows, self._fetch_stream)
        index = [rows] + ([cold] if cold is not None else [])
        if cold is not None:
            rt.keep_alive(cold, self._fetch_stream)
        rt.wait(self._fetch_stream, rt.record(rt.compute()))     # rows and mask were made on compute
        for name, store in self._tables():
            dst = slot.states[name]
            if isinstance(store, RowwiseInt8Store):
                rt.run(self._fetch_stream, store.fetch_into, rows, dst, None, cold, self._codec,
                       reads=(*store.tables(), *index), writes=(dst,))
            elif isinstance(store, SplitStore):
                rt.run(self._fetch_stream, _fetch_split, self._move, store, rows, dst, cold,
                       reads=(*store.tables(), *index), writes=(dst,))
            else:
                rt.run(self._fetch_stream, self._move, store.data, rows, dst, None, cold, None,
                       reads=(store.data, *index), writes=(dst,))
        slot._event = rt.record(self._fetch_stream)

    def _count_cold(self, rows: torch.Tensor, live: list[Slot]) -> torch.Tensor | None:
        """Which of the next set's ``rows`` the ``live`` slots hold (None: no live rows),
        found on the compute stream, and the bytes of the others counted as staged in,
        on the device: no host sync."""
        held = _held_by(rows, [s.rows for s in live])
        if held is None:
            self.bank.count_traffic(staged_in=rows.numel() * self._row_bytes())
        else:
            self.bank.count_staged_on_device((~held).sum() * self._row_bytes())
        return held

    def _prefetch_mapped(self, rows: torch.Tensor, key, live: list[Slot]) -> None:
        held = self._count_cold(rows, live)
        slot = self._empty_slot(rows)
        if held is None:
            self._fetch_mapped(slot, None)
        else:
            self._fetch_mapped(slot, ~held)
            slot.overlap = "device"         # patched from the live slots after their step
            if self.patch_before_step:      # the test hook's ordering bug (see __init__)
                self._patch(slot, live)
                self.runtime.synchronize(slot._event)
        self._next = (key, slot)

    def _write_back_mapped(self, updated: Slot) -> None:
        """Write every stepped row of ``updated`` into the tables, on the fetch stream."""
        rt = self.runtime
        self.bank.count_traffic(out=updated.rows.numel() * self._row_bytes())
        stepped = rt.record(rt.compute())
        rt.wait(self._fetch_stream, stepped)
        rt.keep_alive(updated.rows, self._fetch_stream)
        for name, store in self._tables():
            values = updated.states[name]
            if isinstance(store, RowwiseInt8Store):
                rt.run(self._fetch_stream, store.write_rows, updated.rows, values, self._codec,
                       reads=(values, updated.rows), writes=store.tables())
            elif isinstance(store, SplitStore):
                rt.run(self._fetch_stream, _write_split, self._move, store, updated.rows, values,
                       reads=(values, updated.rows), writes=store.tables())
            else:
                rt.run(self._fetch_stream, self._move, values, None, store.data, updated.rows, None, None,
                       reads=(values, updated.rows), writes=(store.data,))
        landed = rt.record(self._fetch_stream)
        updated.readers.append(landed)
        self.release(updated, [stepped] + updated.readers)

    # ---------------------------------------------------------------- writes
    def after_step(self, updated: Slot) -> None:
        """``updated`` holds the optimizer's new values: patch the prefetched slot's
        overlap from it, then write it back asynchronously."""
        rt = self.runtime
        # A merged slot was allocated by the compute stream, outside the pool.
        for t in updated.states.values():
            rt.keep_alive(t, self._fetch_stream)
            rt.keep_alive(t, self._write_stream)
        if self._next is not None and self._next[1].overlap is not None:
            self._patch(self._next[1], [updated])
        if self.mapped:
            self._write_back_mapped(updated)
            return
        # The row ids reach the host on the I/O worker, which counts the writes as issued
        # before anything it runs later could read those rows: no row work here.
        self.bank.count_traffic(out=updated.rows.numel() * self._row_bytes())
        stepped = rt.record(rt.compute())
        device_names = [n for n in updated.states if self.bank.store(n).tier == "device"]
        host_names = [n for n in updated.states if n not in device_names]
        landed = copied = None
        if device_names:
            # Device-tier rows never leave the device: written on the stream that reads them.
            rt.wait(self._fetch_stream, stepped)
            rt.keep_alive(updated.rows, self._fetch_stream)
            for name in device_names:
                store = self.bank.store(name)
                if isinstance(store, RowwiseInt8Store):
                    rt.run(self._fetch_stream, store.write_rows, updated.rows, updated.states[name], self._codec,
                           reads=(updated.states[name], updated.rows), writes=store.tables())
                else:
                    rt.run(self._fetch_stream, _scatter_rows, store.data, updated.rows, updated.states[name],
                           reads=(updated.states[name], updated.rows), writes=(store.data,))
            landed = rt.record(self._fetch_stream)
            updated.readers.append(landed)
        host = {}
        if host_names:
            rt.wait(self._write_stream, stepped)
            for name in host_names:
                store, values = self.bank.store(name), updated.states[name]
                if isinstance(store, RowwiseInt8Store):     # coded on the device: d + 4 bytes cross
                    codes = [rt.empty(shape, dtype, where, users=(self._write_stream,), pin=where == "cpu")
                             for where in (values.device, "cpu")
                             for shape, dtype in ((values.shape, torch.int8), (values.shape[:1], torch.float32))]
                    rt.wait(self._write_stream, rt.record(rt.compute()))    # after the allocation
                    rt.run(self._write_stream, store.code_rows, values, codes[0], codes[1], self._codec,
                           reads=(values,), writes=codes[:2])
                    for out, made in ((codes[2], codes[0]), (codes[3], codes[1])):
                        rt.run(self._write_stream, _copy_out, out, made, reads=(made,), writes=(out,))
                    host[name] = tuple(codes[2:])
                    continue
                host[name] = rt.empty(values.shape, store.dtype, "cpu", users=(self._write_stream,), pin=True)
                rt.run(self._write_stream, _copy_out, host[name], values, reads=(values,), writes=(host[name],))
            copied = rt.record(self._write_stream)
            updated.readers.append(copied)
        future = self._io.submit(self._write_back, updated, device_names, landed, host, copied)
        # Slot A goes back to the pool only when its write-back has finished, and is
        # reused only after its readers (the step, the patch, the copies) completed.
        events = [stepped] + updated.readers
        future.add_done_callback(lambda _f, slot=updated, events=events: self.release(slot, events))
        self._writebacks.append(future)
        self._writebacks = [f for f in self._writebacks if not f.done() or f.exception() is not None]

    def _write_back(self, updated, device_names, landed, host, copied) -> None:
        """(I/O worker) complete a write-back: its writes are counted as issued first
        (before any later read on this worker), and a row's version counts a write only
        once its data has landed, so a read that could see old data is a StaleRowError."""
        rows_cpu = updated.rows_cpu
        for name in updated.states:
            self.bank.note_issued(name, rows_cpu)
        self.runtime.synchronize(landed)
        for name in device_names:
            self.bank.store(name).count_landed(rows_cpu)
        self.runtime.synchronize(copied)
        for name, values in host.items():
            if isinstance(values, tuple):
                self.bank.store(name).scatter_codes(rows_cpu, *values)
            else:
                self.bank.store(name).scatter(rows_cpu, values)

    def drain(self) -> None:
        """Wait for every write-back and for the prefetch in flight (the stores are
        then idle); re-raise a write-back failure."""
        pending, self._writebacks = self._writebacks, []
        for fut in pending:
            if fut.exception() is not None and self._failure is None:
                self._failure = fut.exception()
        self.raise_failed()
        if self.mapped:                     # every transfer is on the fetch stream, in order
            self.runtime.synchronize(self.runtime.record(self._fetch_stream))
        if self._next is not None:
            for fut in self._next[1]._futures:
                fut.result()
            if self._next[1]._event is not None:
                self.runtime.synchronize(self._next[1]._event)

    def raise_failed(self) -> None:
        """Re-raise the original error of a failed write-back as soon as it is known,
        and at every later use: the bank no longer holds those rows' last values."""
        if self._failure is None:
            for fut in self._writebacks:
                if fut.done() and fut.exception() is not None:
                    self._failure = fut.exception()
                    break
        if self._failure is not None:
            raise self._failure

    def close(self) -> None:
        try:
            if self._failure is None:
                self.drain()
        finally:
            self._io.shutdown(wait=True)
            if getattr(self.bank, "on_device_write", None) == self._device_tables_written:
                self.bank.on_device_write = None
            self.runtime.close()


# Operations enqueued on a side stream. Index tensors arrive on the CPU and are moved
# here, so they are allocated on the stream that reads them and freed in its order.
def _land_rows(dst: torch.Tensor, positions: torch.Tensor | None, values: torch.Tensor) -> None:
    """Copy store-side ``values`` into ``dst`` (all of it, or rows ``positions``)."""
    if positions is None:
        dst.copy_(values, non_blocking=True)       # straight into the slot, converting on the way
    else:
        dst.index_copy_(0, positions.to(dst.device, non_blocking=True),
                        values.to(dst.device, non_blocking=True).to(dst.dtype))


def _gather_rows(dst, positions, data, rows_cpu) -> None:
    values = data.index_select(0, rows_cpu.to(data.device, non_blocking=True))
    _land_rows(dst, positions, values)


def _tables(store) -> tuple:
    """The tensors that hold a store's rows."""
    return store.tables() if isinstance(store, (RowwiseInt8Store, SplitStore)) else (store.data,)


def _split_indices(store, rows: torch.Tensor):
    """(rows in the device part, their ids there, the others, their ids in the host part):
    masks and in-range ids, on the device (no sync)."""
    low = rows < store.n_device
    return low, rows.clamp(max=max(store.n_device - 1, 0)), ~low, (rows - store.n_device).clamp(min=0)


def _fetch_split(move, store, rows, dst, cold) -> None:
    """(mapped access) rows of a store split between device and host memory into ``dst``
    where ``cold``: one move from each part."""
    low, low_ids, high, high_ids = _split_indices(store, rows)
    if cold is not None:
        low, high = low & cold, high & cold
    if store.n_device:
        move(store.device_part.data, low_ids, dst, None, low, None)
    if store.num_rows > store.n_device:
        move(store.host_part.data, high_ids, dst, None, high, None)


def _write_split(move, store, rows, values) -> None:
    """(mapped access) ``values`` into a split store's rows: one move into each part."""
    low, low_ids, high, high_ids = _split_indices(store, rows)
    if store.n_device:
        move(values, None, store.device_part.data, low_ids, low, None)
    if store.num_rows > store.n_device:
        move(values, None, store.host_part.data, high_ids, high, None)


def _read_coded(dst, positions, store, rows_cpu, codec) -> None:
    store.fetch_into(rows_cpu.to(store.q.device, non_blocking=True), dst, positions, None, codec)


def _scatter_rows(data, rows, values) -> None:
    data.index_copy_(0, rows.to(data.device, non_blocking=True), values.to(data.dtype))


def _copy_out(host: torch.Tensor, values: torch.Tensor) -> None:
    host.copy_(values, non_blocking=True)


def _held_by(rows: torch.Tensor, sets: list[torch.Tensor]) -> torch.Tensor | None:
    """Which of ``rows`` (sorted) one of ``sets`` (each sorted) holds, as a bool mask on
    the device, by binary search (no sort, no host sync); None when every set is empty."""
    held = None
    for other in sets:
        if other.numel() == 0:
            continue
        hit = _found_in(other, rows)
        held = hit if held is None else held | hit
    return held


def _found_in(sorted_set: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Mask of ``rows`` found in ``sorted_set`` (non-empty)."""
    return sorted_set.index_select(0, _positions_in(sorted_set, rows)) == rows


def _positions_in(sorted_set: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Where each of ``rows`` is, or would be, in ``sorted_set``, clamped into range."""
    return torch.searchsorted(sorted_set, rows).clamp_(max=sorted_set.numel() - 1)


def _patch_from(move, dst, dst_rows, src, src_rows, store, exclusive: bool = False, codec=None) -> None:
    """(fetch stream) ``dst``'s rows that ``src`` holds, from ``src``, rounded through the
    store's storage as a write-back and a read would round them."""
    pos = _positions_in(src_rows, dst_rows)
    hit = src_rows.index_select(0, pos) == dst_rows
    # ``exclusive``: the I/O worker may be writing the cold rows of ``dst`` at this moment
    # (the plain CPU runtime, whose "streams" are threads): write the held rows alone,
    # selected on the host (there is no device to wait for). Otherwise both writes are
    # ordered on the fetch stream, and a masked move (no host sync) may rewrite the
    # other rows with their own values.
    at = torch.arange(dst_rows.numel(), device=dst.device) if exclusive else None
    if isinstance(store, RowwiseInt8Store):
        store.round_into(src, pos, dst, at, hit, codec)
        return
    move(src, pos, dst, at, hit, store.dtype if src.is_floating_point() else None)
