"""Staged host access (``TieredBank(host_access="staged")``): the host moves the rows.

The I/O worker thread gathers a slot's rows of host-tier states into pinned buffers
and copies them over on the fetch stream; device-tier states are gathered on the
device, on the same stream. A write-back copies the stepped slot's host-tier rows to
pinned buffers on the write stream (8-bit rows coded on the device first: ``d + 4``
bytes cross), and the worker scatters them into the stores once they landed.

All bank I/O runs on the one worker thread, in submission order: a write-back is
always complete before any later read of the same rows, so reads find current
versions; the worker counts every write as *issued* before anything it runs later,
and a row's version counts it *completed* only once it landed, so any violation (a
lost, late or torn write) is a :class:`~ds_pfc.bank.tiered.StaleRowError`. The
training thread handles no row ids: the prefetch's cold rows are found on the
worker, which waits for the copy of the row ids to the host.

This path exists for hosts where mapped access cannot run (no row-move kernel, a
host table the device cannot map). Once mapped access has run on a GPU
(``ds-pfc-bench rows --tier-check``), it is the path to delete: :mod:`ds_pfc.bank.mapped`
moves every tier with no host work per row.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ..devices import set_thread_device
from .quantized import RowwiseInt8Store
from .slots import Slot, Stager, _held_by, _tables
from .tiered import TieredBank

__all__ = ["StagedStager", "FETCH_CHUNK_BYTES"]

#: The largest temporary a fetch makes on the device (the rows of a chunk in the store's
#: dtype and in the slot's): gathers from device tables, decoding and landing a staged
#: copy at its positions go a chunk at a time.
FETCH_CHUNK_BYTES = 32 << 20


class StagedStager(Stager):
    """Stages rows through the host's I/O worker (see the module docstring)."""

    def __init__(self, bank: TieredBank):
        super().__init__(bank)
        # The worker makes the head's GPU current before any CUDA call: a new thread
        # starts on device 0 and would create a context there on every rank.
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ds_pfc-bank-io",
                                      initializer=set_thread_device, initargs=(self.device,))
        self._writebacks: list[Future] = []
        self._stage_buffers: dict[str, torch.Tensor] = {}
        # Device-tier rows never leave the device: read and written on the fetch stream.
        device_tables = [t for n in bank.state_names() if bank.store(n).tier == "device" for t in _tables(bank.store(n))]
        self._watch_device_tables(device_tables, (self._fetch_stream,))

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
                rt.run(self._fetch_stream, _land_codes, store, dst, positions, q, scale, self._codec,
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

    def stage(self, rows: torch.Tensor, pooled: bool = True) -> Slot:
        """Synchronous staging of ``rows`` (sorted local ids on the device).
        ``pooled=False`` for slots that are never stepped (evaluation)."""
        self.raise_failed()
        slot = self._empty_slot(rows, pooled)
        self.bank.count_traffic(staged_in=rows.numel() * self._row_bytes())
        self._io.submit(self._fetch, slot, None, None).result()
        return slot

    def _prefetch(self, rows: torch.Tensor, key, live: list[Slot]) -> None:
        # The overlap rows are patched on the device after the step (_patch), so this
        # thread needs no row ids.
        held = self._count_cold(rows, live)
        slot = self._empty_slot(rows)
        # The cold rows are found and fetched on the I/O worker, which waits for the
        # copy of the row ids to the host; this thread goes on queueing the step.
        slot._futures.append(self._io.submit(self._split_and_fetch, slot, list(live)))
        if held is not None:
            slot.overlap = "device"         # patched from the live slots after their step
            if self.patch_before_step:      # the test hook's ordering bug
                self._patch_early(slot, live)
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

    # ---------------------------------------------------------------- writes
    def after_step(self, updated: Slot) -> None:
        rt = self.runtime
        # A merged slot was allocated by the compute stream, outside the pool.
        for t in updated.states.values():
            rt.keep_alive(t, self._fetch_stream)
            rt.keep_alive(t, self._write_stream)
        if self._next is not None and self._next[1].overlap is not None:
            self._patch(self._next[1], [updated])
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
        pending, self._writebacks = self._writebacks, []
        for fut in pending:
            if fut.exception() is not None and self._failure is None:
                self._failure = fut.exception()
        self.raise_failed()
        self._wait_next()

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

    def _stop_workers(self) -> None:
        self._io.shutdown(wait=True)


# Operations enqueued on a side stream. Index tensors arrive on the CPU and are moved
# here, so they are allocated on the stream that reads them and freed in its order.
def _chunks(num: int, dst: torch.Tensor):
    """Row ranges of at most :data:`FETCH_CHUNK_BYTES` of ``dst``'s rows."""
    row = max(1, dst[:1].numel() * dst.element_size())
    step = max(1, FETCH_CHUNK_BYTES // row)
    return ((lo, min(num, lo + step)) for lo in range(0, num, step))


def _land_rows(dst: torch.Tensor, positions: torch.Tensor | None, values: torch.Tensor) -> None:
    """Copy store-side ``values`` into ``dst`` (all of it, or rows ``positions``), with no
    device temporary larger than a chunk."""
    if positions is None:
        dst.copy_(values, non_blocking=True)       # straight into the slot, converting on the way
        return
    for lo, hi in _chunks(positions.numel(), dst):
        dst.index_copy_(0, positions[lo:hi].to(dst.device, non_blocking=True),
                        values[lo:hi].to(dst.device, non_blocking=True).to(dst.dtype))


def _gather_rows(dst, positions, data, rows_cpu) -> None:
    """Rows ``rows_cpu`` of a device table into ``dst`` (at ``positions``), a chunk at a time."""
    for lo, hi in _chunks(rows_cpu.numel(), dst):
        values = data.index_select(0, rows_cpu[lo:hi].to(data.device, non_blocking=True))
        if positions is None:
            dst[lo:hi].copy_(values)
        else:
            _land_rows(dst, positions[lo:hi], values)


def _read_coded(dst, positions, store, rows_cpu, codec) -> None:
    """8-bit rows ``rows_cpu`` of a device table decoded into ``dst``, a chunk at a time."""
    for lo, hi in _chunks(rows_cpu.numel(), dst):
        rows = rows_cpu[lo:hi].to(store.q.device, non_blocking=True)
        if positions is None:
            store.fetch_into(rows, dst[lo:hi], None, None, codec)
        else:
            store.fetch_into(rows, dst, positions[lo:hi], None, codec)


def _scatter_rows(data, rows, values) -> None:
    data.index_copy_(0, rows.to(data.device, non_blocking=True), values.to(data.dtype))


def _copy_out(host: torch.Tensor, values: torch.Tensor) -> None:
    host.copy_(values, non_blocking=True)


def _land_codes(store, dst, positions, q, scale, codec) -> None:
    """Host codes crossed and decoded into ``dst`` (at ``positions``), a chunk at a time."""
    for lo, hi in _chunks(q.shape[0], dst):
        if positions is None:
            store.land_codes(dst[lo:hi], None, q[lo:hi], scale[lo:hi], codec)
        else:
            store.land_codes(dst, positions[lo:hi], q[lo:hi], scale[lo:hi], codec)
