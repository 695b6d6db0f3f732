"""Staging slots and the double-buffered, stale-free prefetcher (paper: Figure
async_pipeline, "Asynchronous hierarchical class storage").

A :class:`Slot` holds the active rows ``S`` of every bank state on the compute
device; the forward reads its centers, the row optimizer updates it in place, and it
is then written back. With lookahead labels the next step's slot B is built while
step t runs on slot A:

1. ``prefetch`` (during step t): ``S(t+1)`` is known. Cold rows ``S(t+1) \\ S(t)``
   are fetched into B at once by the I/O worker (on GPU: on a side stream).
2. ``after_step`` (optimizer step t done): the overlapping rows ``S(t) ∩ S(t+1)`` are
   copied from A into B, never earlier (before the step they would be stale); then A
   is written back asynchronously. Every write is counted as *issued* at once and
   as *completed* by the store when it lands (per-row versions).
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

import torch

from ..devices import set_thread_device
from .base import ClassBank
from .tiered import TieredBank

__all__ = ["Slot", "SlotBank", "Stager", "merge_slots"]


class Slot:
    """Rows ``rows`` (sorted local ids) of every state, on the compute device."""

    def __init__(self, rows: torch.Tensor, states: dict[str, torch.Tensor]):
        self.rows = rows
        self.rows_cpu = rows.to("cpu")
        self.states = states
        self._futures: list[Future] = []
        self._event = None           # CUDA: recorded on the side stream when B is complete
        self.overlap = None          # (positions in this slot, their rows): filled after the step
        self.buffers = None          # the pooled full-capacity tensors behind ``states``

    def wait(self) -> "Slot":
        """The ready gate: block until the cold fetch and the overlap patch finished."""
        for fut in self._futures:
            fut.result()              # re-raises a StaleRowError or an I/O error here
        self._futures = []
        if self._event is not None:
            torch.cuda.current_stream(self.rows.device).wait_event(self._event)
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
    return Slot(rows, states), inverse


class Stager:
    """Stages bank rows into slots, prefetches the next slot, writes slots back."""

    def __init__(self, bank: TieredBank):
        self.bank = bank
        self.device = bank.device
        # The worker makes the head's GPU current before any CUDA call: a new thread
        # starts on device 0 and would create a context there on every rank.
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ds_pfc-bank-io",
                                      initializer=set_thread_device, initargs=(self.device,))
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._next: tuple[object, Slot] | None = None
        self._writebacks: list[Future] = []
        self._failure: BaseException | None = None   # a failed write-back, sticky
        self._pool: list[dict[str, torch.Tensor]] = []
        self._pool_lock = threading.Lock()
        self._stage_buffers: dict[str, torch.Tensor] = {}
        # Test hook: copy overlapping rows at prefetch time, *before* the optimizer
        # step. This is the ordering bug the pipeline exists to avoid.
        self.patch_before_step = False

    # ---------------------------------------------------------------- reads
    def _fetch(self, slot: Slot, positions: torch.Tensor | None, rows_cpu: torch.Tensor) -> None:
        """(I/O worker) read ``rows_cpu`` of every state into ``slot`` at ``positions``."""
        stream = torch.cuda.stream(self._stream) if self._stream is not None else _nullcontext()
        with stream:
            for name, dst in slot.states.items():
                values = self.bank.read(name, rows_cpu, staging=self._staging(name, rows_cpu.numel()))
                if positions is None:
                    dst.copy_(values, non_blocking=True)
                else:
                    dst.index_copy_(0, positions, values.to(dst.dtype))
            if self._stream is not None:
                event = torch.cuda.Event()
                event.record(self._stream)
                event.synchronize()

    def _staging(self, name: str, num: int) -> torch.Tensor:
        """(I/O worker) a reusable store-side buffer for ``num`` rows of ``name``.
        One worker uses it and waits for its copies, so one buffer per state is enough."""
        store = self.bank.store(name)
        buf = self._stage_buffers.get(name)
        if buf is None or buf.shape[0] < num:
            from .stores import pinned_empty
            buf = pinned_empty((num,) + store.row_shape, store.dtype) if store.tier != "device" else \
                torch.empty((num,) + store.row_shape, dtype=store.dtype, device=self.device)
            self._stage_buffers[name] = buf
        return buf[:num]

    def _empty_slot(self, rows: torch.Tensor, pooled: bool = True) -> Slot:
        """A slot for ``rows``. Pooled slots reuse the buffers of slots whose
        write-back finished (the double buffer: A while B fills, then B while A
        drains), so steady-state staging allocates nothing."""
        num = rows.numel()
        buffers = None
        if pooled:
            with self._pool_lock:
                for i, candidate in enumerate(self._pool):
                    if next(iter(candidate.values())).shape[0] >= num:
                        buffers = self._pool.pop(i)
                        break
        if buffers is None:
            buffers = {name: torch.empty((num,) + self.bank.store(name).row_shape, dtype=self.bank._logical[name],
                                         device=self.device) for name in self.bank.state_names()}
        slot = Slot(rows, {name: t[:num] for name, t in buffers.items()})
        slot.buffers = buffers if pooled else None
        return slot

    def release(self, slot: Slot) -> None:
        """Return a slot's buffers to the pool: only once its readers and its
        write-back are done."""
        buffers, slot.buffers = slot.buffers, None
        if buffers is not None:
            with self._pool_lock:
                self._pool.append(buffers)
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
        self._io.submit(self._fetch, slot, None, slot.rows_cpu).result()
        return slot

    def prefetch(self, rows: torch.Tensor, key, live: list[Slot]) -> None:
        """Start building the slot for the forward identified by ``key`` while the
        ``live`` slots (staged, not yet stepped) are still in use."""
        self.raise_failed()
        self.discard()                      # a second lookahead replaces the first
        slot = self._empty_slot(rows)
        live_rows = torch.cat([s.rows_cpu for s in live]) if live else torch.empty(0, dtype=torch.long)
        in_live = torch.isin(slot.rows_cpu, live_rows)
        cold = torch.nonzero(~in_live).squeeze(1)
        overlap = torch.nonzero(in_live).squeeze(1)
        if cold.numel():
            # Traffic is counted when a transfer is issued, so each step's report is
            # deterministic however fast the worker is.
            self.bank.count_traffic(staged_in=cold.numel() * self._row_bytes())
            slot._futures.append(self._io.submit(self._fetch, slot, cold.to(self.device), slot.rows_cpu[cold]))
        if overlap.numel():
            slot.overlap = (overlap.to(self.device), slot.rows[overlap.to(self.device)])
            if self.patch_before_step:
                self._patch(slot, live)
        self._next = (key, slot)

    def take(self, rows: torch.Tensor, key, live: list[Slot]) -> Slot | None:
        """The prefetched slot for ``key`` once ready, or None if there is none."""
        self.raise_failed()
        if self._next is None:
            return None
        next_key, slot = self._next
        self._next = None
        if next_key != key or not torch.equal(slot.rows, rows):
            slot.wait()                     # drop it, but surface its errors
            self.release(slot)
            return None
        if slot.overlap is not None:        # no step since prefetch: live values are current
            self._patch(slot, live)
        return slot.wait()

    def _as_stored(self, name: str, values: torch.Tensor) -> torch.Tensor:
        """``values`` as a read from the bank would return them after a write-back:
        rounded through the state's storage dtype."""
        storage = self.bank.store(name).dtype
        return values if storage == values.dtype else values.to(storage).to(values.dtype)

    def _patch(self, slot: Slot, sources: list[Slot]) -> None:
        """Copy ``slot``'s overlapping rows from ``sources`` (after their update)."""
        positions, rows = slot.overlap
        slot.overlap = None
        for src in sources:
            hit = torch.isin(rows, src.rows)
            if not bool(hit.any()):
                continue
            src_pos = torch.searchsorted(src.rows, rows[hit])
            dst_pos = positions[hit]
            if self._stream is not None:
                ready = torch.cuda.Event()
                ready.record(torch.cuda.current_stream(self.device))
                self._stream.wait_event(ready)
                with torch.cuda.stream(self._stream):
                    for name, dst in slot.states.items():
                        dst.index_copy_(0, dst_pos, self._as_stored(name, src.states[name].index_select(0, src_pos)))
                    slot._event = torch.cuda.Event()
                    slot._event.record(self._stream)
            else:
                for name, dst in slot.states.items():
                    dst.index_copy_(0, dst_pos, self._as_stored(name, src.states[name].index_select(0, src_pos)))
            rows, positions = rows[~hit], positions[~hit]
        assert rows.numel() == 0, "overlapping rows missing from the updated slots"

    def discard(self) -> None:
        """Drop the prefetched slot (after surfacing its errors)."""
        if self._next is not None:
            _, slot = self._next
            self._next = None
            slot.wait()
            self.release(slot)

    # ---------------------------------------------------------------- writes
    def after_step(self, updated: Slot) -> None:
        """``updated`` holds the optimizer's new values: patch the prefetched slot's
        overlap from it, then write it back asynchronously."""
        if self._next is not None and self._next[1].overlap is not None:
            self._patch(self._next[1], [updated])
        for name in updated.states:
            self.bank.note_issued(name, updated.rows_cpu)
        self.bank.count_traffic(out=updated.rows_cpu.numel() * self._row_bytes())
        if self._stream is not None:
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self.device))
            for t in updated.states.values():
                t.record_stream(self._stream)
            host = {}
            with torch.cuda.stream(self._stream):
                self._stream.wait_event(done)
                for name, t in updated.states.items():
                    host[name] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                    host[name].copy_(t, non_blocking=True)
                copied = torch.cuda.Event()
                copied.record(self._stream)
            future = self._io.submit(self._write_back, updated.rows_cpu, host, copied)
        else:
            future = self._io.submit(self._write_back, updated.rows_cpu, updated.states, None)
        # Slot A goes back to the pool only when its write-back has finished.
        future.add_done_callback(lambda _f, slot=updated: self.release(slot))
        self._writebacks.append(future)
        self._writebacks = [f for f in self._writebacks if not f.done() or f.exception() is not None]

    def _write_back(self, rows_cpu, states, copied) -> None:
        if copied is not None:
            copied.synchronize()
        for name, values in states.items():
            store = self.bank.store(name)
            store.scatter(rows_cpu, values)


    def drain(self) -> None:
        """Wait for every write-back and for the prefetch in flight (the stores are
        then idle); re-raise a write-back failure."""
        pending, self._writebacks = self._writebacks, []
        for fut in pending:
            if fut.exception() is not None and self._failure is None:
                self._failure = fut.exception()
        self.raise_failed()
        if self._next is not None:
            for fut in self._next[1]._futures:
                fut.result()

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


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
