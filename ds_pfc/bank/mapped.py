"""Mapped host access (``TieredBank(host_access="mapped")``): a kernel moves the rows.

Every row moves by a row-move kernel (the caller's, e.g. Triton's on CUDA; torch ops
on the CPU) that reads and writes the bank's tables themselves: device memory, or
host memory mapped into the device's address space. The row ids, the split of the
next active set and the masks stay on the device: no host sync and a fixed number of
host operations per step, whatever the number of rows.

* The fetch stream carries the next slot's cold rows at prefetch and its overlap
  rows from the stepped slot after the step (the overlap patch).
* The write stream carries the stepped slot back into the tables, beside the fetch
  stream's work: PCIe moves both directions at once (duplex).

Ordering, by events only: a write-back starts after the step that wrote its slot. A
fetch reads the rows that the last write-back writes only after it landed (a row
written back after step t and fetched again for step t + 2), and every other row at
once; the fetch stream waits for older write-backs whole. The stream emulator checks
this row by row (``DS_PFC_DEBUG_STREAMS=1``: two streams may touch one table at once
only where their rows differ).
"""
from __future__ import annotations

from typing import Callable

import torch

from .quantized import RowwiseInt8Store
from .rows import move_rows_torch_
from .slots import Slot, Stager, _found_in, _positions_in, _tables
from .split import SplitStore
from .streams import rows_of
from .tiered import TieredBank

__all__ = ["MappedStager"]


class MappedStager(Stager):
    """Stages rows with a row-move kernel on the tables in place (see the module docstring)."""

    host_ids = False                # row ids are copied to the host only if asked for (a host sync)
    mapped = True

    def __init__(self, bank: TieredBank, mover: Callable | None = None):
        # A CUDA bank with host tables needs a kernel: torch ops cannot index host
        # memory from the device.
        if mover is None and bank.device.type == "cuda":
            raise ValueError("host_access='mapped' on CUDA needs a row-move kernel (Triton: pip install "
                             "ds_pfc[triton]); or use host_access='staged'")
        super().__init__(bank)
        self._move = mover or move_rows_torch_
        self.slot_sets = getattr(bank, "slot_sets", 3)
        # The side streams' kernels read and write the host tables too.
        for name in bank.state_names():
            for table in _tables(bank.store(name)):
                for stream in (self._fetch_stream, self._write_stream):
                    self.runtime.keep_alive(table, stream)
        self._watch_device_tables([t for n in bank.state_names() if bank.store(n).tier == "device"
                                   for t in _tables(bank.store(n))], (self._fetch_stream, self._write_stream))
        # The last write-back, (rows, where written or None: all, its landing event), and
        # the landing events of older ones that the fetch stream has not waited for.
        self._last_write: tuple[torch.Tensor, torch.Tensor | None, object] | None = None
        self._older_writes: list = []
        # Slots that hold rows newer than the tables: the overlap a write-back left to the
        # next slot (patched into it), until that slot is written back in its turn.
        self._carrying: list[Slot] = []
        # Test hook: fetch every row at once, before the last write-back landed. This
        # is the ordering bug the split fetch exists to avoid.
        self.fetch_before_landing = False
        # Test hook: write every stepped row back and carry none (the design before the
        # overlap was left to the next slot); the results must not change.
        self.write_back_all = False

    def _tables(self):
        return [(name, self.bank.store(name)) for name in self.bank.state_names()]

    # ---------------------------------------------------------------- reads
    def stage(self, rows: torch.Tensor, pooled: bool = True) -> Slot:
        self.raise_failed()
        slot = self._empty_slot(rows, pooled)
        self.bank.count_traffic(staged_in=rows.numel() * self._row_bytes())
        self._fetch_mapped(slot, None)
        if self._carrying:                  # rows newer than the tables, from the slots that hold them
            self._patch(slot, list(self._carrying))
        return slot.wait()

    def _fetch_mapped(self, slot: Slot, cold: torch.Tensor | None) -> None:
        """Queue the fetch of ``slot``'s rows (where ``cold``; None: all of them) from the
        tables on the fetch stream; ``slot``'s ready gate waits for it.

        The last write-back may still be on its way (write stream): rows it writes are
        fetched after it landed, the others at once, beside it. Older write-backs are
        waited for whole (they finished long ago)."""
        rt = self.runtime
        rows = slot.rows
        rt.keep_alive(rows, self._fetch_stream)
        rt.wait(self._fetch_stream, rt.record(rt.compute()))     # rows and mask were made on compute
        for event in self._older_writes:
            rt.wait(self._fetch_stream, event)
        self._older_writes = []
        last, self._last_write = self._last_write, None
        if last is None or self.fetch_before_landing:
            self._queue_fetch(slot, cold)
        else:
            written_rows, written, landed = last
            recent = _found_in(written_rows, rows)
            if written is not None:      # only where that write-back wrote
                recent &= written.index_select(0, _positions_in(written_rows, rows))
            self._queue_fetch(slot, ~recent if cold is None else cold & ~recent)
            rt.wait(self._fetch_stream, landed)
            self._queue_fetch(slot, recent if cold is None else cold & recent)
        slot._event = rt.record(self._fetch_stream)

    def _queue_fetch(self, slot: Slot, mask: torch.Tensor | None) -> None:
        """(fetch stream) ``slot``'s rows where ``mask`` from the tables, every state."""
        rt = self.runtime
        rows = slot.rows
        index = [rows] + ([mask] if mask is not None else [])
        if mask is not None:
            rt.keep_alive(mask, self._fetch_stream)
        for name, store in self._tables():
            dst = slot.states[name]
            tables = [rows_of(t, rows, mask) for t in _tables(store)]
            if isinstance(store, RowwiseInt8Store):
                rt.run(self._fetch_stream, store.fetch_into, rows, dst, None, mask, self._codec,
                       reads=(*tables, *index), writes=(dst,))
            elif isinstance(store, SplitStore):
                rt.run(self._fetch_stream, _fetch_split, self._move, store, rows, dst, mask,
                       reads=(*tables, *index), writes=(dst,))
            else:
                rt.run(self._fetch_stream, self._move, store.data, rows, dst, None, mask, None,
                       reads=(*tables, *index), writes=(dst,))

    def _prefetch(self, rows: torch.Tensor, key, live: list[Slot]) -> None:
        held = self._count_cold(rows, live)
        slot = self._empty_slot(rows)
        if held is None:
            self._fetch_mapped(slot, None)
        else:
            self._fetch_mapped(slot, ~held)
            slot.overlap = "device"         # patched from the live slots after their step
            if self.patch_before_step:      # the test hook's ordering bug
                self._patch_early(slot, live)
        self._next = (key, slot)

    # ---------------------------------------------------------------- writes
    def after_step(self, updated: Slot) -> None:
        rt = self.runtime
        # A merged slot was allocated by the compute stream, outside the pool.
        for t in updated.states.values():
            rt.keep_alive(t, self._fetch_stream)
            rt.keep_alive(t, self._write_stream)
        following = self._next[1] if self._next is not None else None
        if following is None or following.overlap is None or following.rows.numel() == 0:
            self._write_back(updated)
            return
        # The overlap is patched into the next slot, which carries it from now on: only
        # the rows that leave the next set go back to the tables.
        self._patch(following, [updated])
        handed_on = _found_in(following.rows, updated.rows)
        self._write_back(updated, ~handed_on)
        if self.write_back_all:             # test hook: as if nothing were carried
            return
        if not any(s is following for s in self._carrying):
            self._carrying.append(following)

    def _write_back(self, updated: Slot, mask: torch.Tensor | None = None, release: bool = True) -> None:
        """Write ``updated``'s rows (where ``mask``; None: all) into the tables, on the
        write stream (beside the next fetch: PCIe carries both directions at once), after
        the step and after the slot's own fetch and patches; ``updated`` goes back to the
        pool once they all finished."""
        rt = self.runtime
        if self.write_back_all:
            mask = None
        self._carrying = [s for s in self._carrying if s is not updated]
        if mask is None:
            self.bank.count_traffic(out=updated.rows.numel() * self._row_bytes())
        else:
            self.bank.count_written_on_device(mask.sum() * self._row_bytes())
        stepped = rt.record(rt.compute())
        rt.wait(self._write_stream, stepped)
        if updated._event is not None:      # a prefetched slot written back unstepped
            rt.wait(self._write_stream, updated._event)
        rows = updated.rows
        rt.keep_alive(rows, self._write_stream)
        index = [rows] + ([mask] if mask is not None else [])
        if mask is not None:
            rt.keep_alive(mask, self._write_stream)
        for name, store in self._tables():
            values = updated.states[name]
            tables = [rows_of(t, rows, mask) for t in _tables(store)]
            if isinstance(store, RowwiseInt8Store):
                rt.run(self._write_stream, store.write_rows, rows, values, self._codec, mask,
                       reads=(values, *index), writes=tables)
            elif isinstance(store, SplitStore):
                rt.run(self._write_stream, _write_split, self._move, store, rows, values, mask,
                       reads=(values, *index), writes=tables)
            else:
                rt.run(self._write_stream, _scatter, self._move, values, store.data, rows, mask,
                       reads=(values, *index), writes=tables)
        landed = rt.record(self._write_stream)
        if self._last_write is not None:
            self._older_writes.append(self._last_write[2])
        self._last_write = (rows, mask, landed)
        updated.readers.append(landed)
        if release:
            self.release(updated, [stepped] + updated.readers)

    def _drop(self, slot: Slot) -> None:
        if any(s is slot for s in self._carrying):
            slot.wait()
            self._write_back(slot)          # its carried rows exist nowhere else
        else:
            super()._drop(slot)

    def release(self, slot: Slot, events: list | None = None) -> None:
        # Merged into another slot (gradient accumulation), which carries its rows on.
        self._carrying = [s for s in self._carrying if s is not slot]
        super().release(slot, events)

    def discard(self) -> None:
        super().discard()
        self._write_back_carried()

    def _write_back_carried(self) -> None:
        """Write back every slot that carries rows newer than the tables (whole: its
        other rows equal the tables'); the slots stay usable."""
        for slot in list(self._carrying):
            self._write_back(slot, None, release=False)

    def drain(self) -> None:
        self.raise_failed()
        self._write_back_carried()
        for stream in (self._write_stream, self._fetch_stream):
            self.runtime.synchronize(self.runtime.record(stream))
        self._wait_next()


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


def _write_split(move, store, rows, values, mask=None) -> None:
    """(mapped access) ``values`` into a split store's rows (where ``mask``): one move
    into each part."""
    low, low_ids, high, high_ids = _split_indices(store, rows)
    if mask is not None:
        low, high = low & mask, high & mask
    if store.n_device:
        move(values, None, store.device_part.data, low_ids, low, None)
    if store.num_rows > store.n_device:
        move(values, None, store.host_part.data, high_ids, high, None)


def _scatter(move, values, table, rows, mask) -> None:
    """(mapped access) ``values`` into ``table``'s ``rows`` (distinct ids) where ``mask``."""
    move(values, None, table, rows, mask, None, unique_dst=True)
