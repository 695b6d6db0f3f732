"""Staging slots: the rows of the step's active set on the compute device, and the
double-buffered, stale-free prefetch that fills them (paper: Figure async_pipeline,
"Asynchronous hierarchical class storage").

A :class:`Slot` holds the active rows ``S`` of every bank state on the compute
device; the forward reads its centers, the row optimizer updates it in place, and it
is then written back. With lookahead labels the next step's slot B is built while
step t runs on slot A:

1. ``prefetch`` (during step t): ``S(t+1)`` is known on the device; the cold rows
   ``S(t+1) \\ S(t)`` are fetched into B at once, on a side stream.
2. ``after_step`` (optimizer step t done): the overlapping rows ``S(t) ∩ S(t+1)`` are
   copied from A into B, never earlier (before the step they would be stale), found on
   the device by binary search in the sorted row sets; then A is written back
   asynchronously.
3. ``take`` (forward t+1): B is exposed only when its fetch and its patch finished
   (the ready gate).

Slot A stays alive until its readers and its write-back finished, so it is never
reused early. Without lookahead, ``stage`` reads synchronously and gives identical
results.

How rows cross between the tables and the slots depends on the bank's host access,
one transfer design per module:

* :mod:`ds_pfc.bank.staged` (``host_access="staged"``): the host gathers rows into
  pinned buffers on an I/O worker thread and copies them over; write-backs come back
  the same way. Per-row versions turn any lost, late or torn write into a
  :class:`~ds_pfc.bank.tiered.StaleRowError`.
* :mod:`ds_pfc.bank.mapped` (``host_access="mapped"``): a row-move kernel reads and
  writes the tables in place (device memory, or host memory mapped into the device's
  address space), fetches and write-backs on two streams ordered by events, with no
  host work that grows with the rows and no host sync.

This module holds what both share: the slots, the pool of slot buffers, the overlap
patch, and the prefetch / take / discard protocol (:class:`Stager`, the base of
:class:`~ds_pfc.bank.staged.StagedStager` and :class:`~ds_pfc.bank.mapped.MappedStager`).
"""
from __future__ import annotations

import threading
from typing import Callable

import torch

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
    """Stages bank rows into slots, prefetches the next slot, writes slots back: what
    both transfer designs share. Subclasses move the rows (``stage``, ``_prefetch``,
    ``after_step``, ``drain``).

    Streams (see :mod:`ds_pfc.bank.streams`): ``fetch`` carries the reads into slots
    and the overlap patches; ``write`` carries write-backs, so a write-back never
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

    #: whether slots carry their row ids on the host
    host_ids = True
    mapped = False

    def __init__(self, bank: TieredBank):
        self.bank = bank
        self.device = bank.device
        # 8-bit rows are coded and decoded by the bank's codec kernels where it has them.
        self._codec = getattr(bank, "row_codec", None)
        # The row-move function of mapped access (the overlap patch's too); None: torch ops.
        self._move: Callable | None = None
        self.runtime = runtime_for(self.device)
        self._fetch_stream = self.runtime.new_stream("fetch")
        self._write_stream = self.runtime.new_stream("write")
        self._next: tuple[object, Slot] | None = None
        self._failure: BaseException | None = None   # a failed write-back, sticky
        self._pool: list[tuple[dict[str, torch.Tensor], list]] = []   # (buffers, events before reuse)
        self._pool_lock = threading.Lock()
        # The most slot buffer sets to keep (None: no bound) and how many there are.
        self.slot_sets: int | None = None
        self._sets = 0
        # Test hook: copy overlapping rows at prefetch time, *before* the optimizer
        # step. This is the ordering bug the pipeline exists to avoid.
        self.patch_before_step = False

    def _watch_device_tables(self, tables: list[torch.Tensor], streams) -> None:
        """Keep the device tables alive on ``streams`` and order them after the compute
        stream's writes to them (initial values now, ``load`` later, reported by the
        bank through its hook)."""
        for data in tables:
            for stream in streams:
                self.runtime.keep_alive(data, stream)
        self._device_tables_written(tables)
        self.bank.on_device_write = self._device_tables_written

    # ---------------------------------------------------------------- ordering
    def _order_after_compute(self) -> None:
        """Make the fetch stream's later work wait for the compute stream's work so
        far. Called on the host thread that owns the compute stream."""
        rt = self.runtime
        rt.wait(self._fetch_stream, rt.record(rt.compute()))

    def _device_tables_written(self, tables: list[torch.Tensor]) -> None:
        """Device-tier ``tables`` were just written on the compute stream: the side
        streams, which read and write them, are ordered after that."""
        if tables:
            self.runtime.on_compute(writes=tables)
            self._order_after_compute()

    # ---------------------------------------------------------------- slots
    def _empty_slot(self, rows: torch.Tensor, pooled: bool = True) -> Slot:
        """A slot for ``rows``. Pooled slots reuse the buffers of slots whose last
        readers finished (the double buffer: A while B fills, then B while A drains),
        so steady-state staging allocates nothing."""
        num = rows.numel()
        buffers = pending = None
        if pooled:
            with self._pool_lock:
                fits = [i for i, (candidate, _) in enumerate(self._pool)
                        if next(iter(candidate.values())).shape[0] >= num]
                ready = [i for i in fits if self.runtime.reusable(self._pool[i][1])]
                if ready:
                    buffers = self._pool.pop(ready[0])[0]
                elif fits and self.slot_sets is not None and self._sets >= self.slot_sets:
                    # At the bound: the oldest set, once its last readers finished, in the
                    # device's order (the fetch stream waits for them; the host does not).
                    buffers, pending = self._pool.pop(fits[0])
            if buffers is not None and pending is None:
                self.runtime.check_reusable(buffers.values())
        if buffers is None:
            users = (self._fetch_stream, self._write_stream)
            buffers = {name: self.runtime.empty((num,) + self.bank.store(name).row_shape, self.bank._logical[name],
                                                self.device, users=users) for name in self.bank.state_names()}
            if pooled:
                with self._pool_lock:
                    self._sets += 1
        for event in pending or ():
            self.runtime.wait(self._fetch_stream, event)
        slot = Slot(rows, {name: t[:num] for name, t in buffers.items()}, self.runtime, host_ids=self.host_ids)
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
                dropped = len(self._pool) - 3           # slots A and B and one spare
                if dropped > 0:
                    del self._pool[:dropped]
                    self._sets -= dropped

    def _row_bytes(self) -> int:
        """Bytes one row of every state takes in its store."""
        return sum(self.bank.store(name).row_bytes() for name in self.bank.state_names())

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

    # ---------------------------------------------------------------- the protocol
    def stage(self, rows: torch.Tensor, pooled: bool = True) -> Slot:
        """Synchronous staging of ``rows`` (sorted local ids on the device).
        ``pooled=False`` for slots that are never stepped (evaluation)."""
        raise NotImplementedError

    def after_step(self, updated: Slot) -> None:
        """``updated`` holds the optimizer's new values: patch the prefetched slot's
        overlap from it, then write it back asynchronously."""
        raise NotImplementedError

    def drain(self) -> None:
        """Wait for every write-back and for the prefetch in flight (the stores are
        then idle); re-raise a write-back failure."""
        raise NotImplementedError

    def _prefetch(self, rows: torch.Tensor, key, live: list[Slot]) -> None:
        raise NotImplementedError

    def prefetch(self, rows: torch.Tensor, key, live: list[Slot]) -> None:
        """Start building the slot for the forward identified by ``key`` while the
        ``live`` slots (staged, not yet stepped) are still in use. Returns without
        waiting for the device."""
        self.raise_failed()
        self._drop_next()                   # a second lookahead replaces the first
        self._prefetch(rows, key, live)

    def _patch_early(self, slot: Slot, live: list[Slot]) -> None:
        """The test hook's ordering bug (see ``patch_before_step``): the overlap copied
        now, completed now, so that it reads the pre-step values on every runtime."""
        self._patch(slot, live)
        self.runtime.synchronize(slot._event)

    def take(self, rows: torch.Tensor, key, live: list[Slot]) -> Slot | None:
        """The prefetched slot for ``key`` once ready, or None if there is none."""
        self.raise_failed()
        if self._next is None:
            return None
        next_key, slot = self._next
        self._next = None
        if next_key != key or not (slot.rows is rows or torch.equal(slot.rows, rows)):
            self._drop(slot)
            return None
        if slot.overlap is not None:        # no step since prefetch: live values are current
            self._patch(slot, live)
        return slot.wait()

    def _drop(self, slot: Slot) -> None:
        """A prefetched slot no forward takes: surface its errors, return its buffers."""
        slot.wait()
        self.release(slot)

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
        """Drop the prefetched slot (after surfacing its errors) and forget the staged
        slots: the caller drops them unstepped."""
        self._drop_next()

    def _drop_next(self) -> None:
        if self._next is not None:
            _, slot = self._next
            self._next = None
            self._drop(slot)

    def _wait_next(self) -> None:
        """(drain) Wait for the prefetch in flight."""
        if self._next is not None:
            for fut in self._next[1]._futures:
                fut.result()
            if self._next[1]._event is not None:
                self.runtime.synchronize(self._next[1]._event)

    def raise_failed(self) -> None:
        """Re-raise the original error of a failed write-back at every use: the bank
        no longer holds those rows' last values."""
        if self._failure is not None:
            raise self._failure

    def _stop_workers(self) -> None:
        """(close) Stop the host threads that may still use the runtime."""

    def close(self) -> None:
        try:
            if self._failure is None:
                self.drain()
        finally:
            self._stop_workers()
            if getattr(self.bank, "on_device_write", None) == self._device_tables_written:
                self.bank.on_device_write = None
            self.runtime.close()


def _tables(store) -> tuple:
    """The tensors that hold a store's rows."""
    return store.tables() if isinstance(store, (RowwiseInt8Store, SplitStore)) else (store.data,)


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
