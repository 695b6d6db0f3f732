"""Tiered bank: each state tensor placed on the device or in host memory.

With the centers and their optimizer state off the device, device-resident head
memory is O(|S_q| d) (the staged rows) instead of O(C_q d). Each state is placed
independently, with its own storage dtype: e.g. weights in host memory as bfloat16
and momentum on the device as float32. Rows always reach the compute device in the
state's own (logical) dtype; a lower storage dtype rounds on every write-back.

Per-row versions: the bank counts the writes it has *issued* for every row and
state; every store counts the writes that *completed*. A staged read of a row whose
counts differ would train on an old value (a write-back that has not landed, or a
torn one) and raises :class:`StaleRowError` instead.
"""
from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

from .base import ClassBank
from .quantized import INT8_ROWWISE, RowwiseInt8Store
from .split import SplitStore
from .stores import PIN_FAILURE, DeviceStore, HostRegisterError, HostStore, RowStore

__all__ = ["Placement", "TieredBank", "StaleRowError", "TIERS", "HOST_ACCESS", "NVME_REFUSED"]

TIERS = ("device", "host")
#: Why ``"nvme"`` is not a tier. A step reads its cold rows and writes back every stepped
#: row: at r = 0.1 that is random page I/O over ~10% of the rows per step, which neither
#: hides behind a step nor stays within a data-centre drive's rated writes per day
#: (``ds-pfc-bench plan`` counts both). NVMe holds what needs sequential transfers only:
#: the checkpoint's streamed shards, read at start-up and written at save.
NVME_REFUSED = ("tier 'nvme' is not a per-step tier (random row I/O every step exceeds the drives' bandwidth and "
                "rated writes per day): place the state on 'device' or 'host' (host_access 'mapped' or 'staged'; "
                "hbm_share keeps part of a host-tier state in GPU memory); NVMe holds the bank's checkpoints, "
                "whose shards are streamed at start-up and save")
#: How staged rows move between the bank's tables and the slots (``host_access=``):
#: ``"staged"`` (the default): an I/O thread gathers rows into page-locked staging
#: buffers, copies them to the device and scatters write-backs into the tables;
#: ``"mapped"``: kernels read and write the tables themselves, on a side stream, with row
#: ids that never leave the device (host tables are page-locked and mapped into the GPU's
#: address space; on CUDA this needs Triton; device and host tiers only).
HOST_ACCESS = ("staged", "mapped")
#: Sets of slot buffers mapped access may keep (``TieredBank(slot_sets=)``).
SLOT_SETS = (2, 3)


class StaleRowError(RuntimeError):
    """A staged row's stored version is not the version the bank last wrote."""


@dataclass(frozen=True)
class Placement:
    """Where one state lives: ``tier`` in ("device", "host") and its storage
    ``dtype`` (None: the state's own dtype, float32 for centers and moments), or
    ``"int8_rowwise"`` for 8-bit codes with a scale per row (optimizer moments on the
    device or host tier; :mod:`ds_pfc.bank.quantized`)."""

    tier: str = "device"
    dtype: torch.dtype | None = None

    def __post_init__(self):
        if self.tier == "nvme":
            raise ValueError(NVME_REFUSED)
        if self.tier not in TIERS:
            raise ValueError(f"tier must be one of {TIERS}, got {self.tier!r}")
        if self.dtype is not None and not isinstance(self.dtype, torch.dtype) and self.dtype != INT8_ROWWISE:
            raise TypeError(f"dtype must be a torch.dtype, {INT8_ROWWISE!r} or None, got {self.dtype!r}")

    @classmethod
    def parse(cls, value) -> "Placement":
        """``Placement``, a tier name, or ``(tier, dtype)``."""
        if isinstance(value, Placement):
            return value
        if isinstance(value, str):
            return cls(value)
        if isinstance(value, (tuple, list)) and len(value) == 2:
            return cls(value[0], value[1])
        raise TypeError(f"a placement must be a Placement, a tier name or (tier, dtype), got {value!r}")


class TieredBank(ClassBank):
    """Bank whose states live in per-state :mod:`stores <ds_pfc.bank.stores>`.

    Build it through :meth:`factory` and pass that to ``PartialFC(bank=...)``.
    ``owner`` names the bank in messages (the head passes its process's global rank).
    A ``"nvme"`` placement is refused (:data:`NVME_REFUSED`). ``host_access``: see :data:`HOST_ACCESS`; with
    ``"mapped"`` the rows' versions are ordered by the side stream, not counted per row
    (no row id reaches the host), so :class:`StaleRowError` checks apply to the staged
    path only. ``hbm_share`` (mapped access only): the share of each host-tier state's
    rows kept in device memory (:class:`~ds_pfc.bank.split.SplitStore`); host traffic
    scales by ``1 - hbm_share``.
    ``pin_failure`` (:data:`~ds_pfc.bank.stores.PIN_FAILURE`): what a host table that
    cannot be page-locked does: ``"refuse"`` (the default) raises
    :class:`~ds_pfc.bank.stores.HostRegisterError`, naming the limit that likely caused
    it, and the tables already registered are released; ``"fallback"`` keeps the table in
    pageable memory and, with ``host_access="mapped"``, switches the bank to staged
    access (a warning says so; :attr:`host_access` tells). With ``hbm_share > 0`` a
    failure is always refused. :meth:`start_up` reports what each host table got.
    ``slot_sets`` (:data:`SLOT_SETS`): how many sets of slot buffers (the active rows of
    every state on the device) mapped access keeps. 3 (the default): the next-but-one
    fetch fills a third set while the last write-back still reads its own, so fetch and
    write-back overlap (duplex). 2: that fetch goes into the set the write-back reads,
    ordered after it on the device: one set less of GPU memory, the two directions in
    turn. Staged access keeps up to three.
    """

    def __init__(self, num_rows: int, device, *, placements: dict[str, Placement] | None = None,
                 default: Placement = Placement(), class_start: int = 0, owner: str | None = None,
                 host_access: str = "staged", hbm_share: float = 0.0, pin_failure: str = "refuse",
                 slot_sets: int = 3):
        super().__init__(num_rows, device)
        _check_slot_sets(slot_sets, host_access)
        self.slot_sets = slot_sets
        if pin_failure not in PIN_FAILURE:
            raise ValueError(f"pin_failure must be one of {PIN_FAILURE}, got {pin_failure!r}")
        self.pin_failure = pin_failure
        if host_access not in HOST_ACCESS:
            raise ValueError(f"host_access must be one of {HOST_ACCESS}, got {host_access!r}")
        _check_share(hbm_share, host_access)
        self.hbm_share = float(hbm_share)
        self.placements = dict(placements or {})
        self.default = default
        self.class_start, self.owner = class_start, owner
        self._stores: dict[str, RowStore] = {}
        self._logical: dict[str, torch.dtype] = {}
        self._issued: dict[str, torch.Tensor] = {}
        # Bytes the stager issued since the last reset_traffic(): rows staged in, rows
        # written back (counted when issued, not when the asynchronous I/O lands).
        self.bytes_in = 0
        self.bytes_out = 0
        self._bytes_in_device: torch.Tensor | None = None   # mapped access: counted on the device
        self._bytes_out_device: torch.Tensor | None = None
        self._traffic_lock = threading.Lock()   # the I/O worker counts too
        # Called with the device-tier tables just written on the compute stream (write,
        # load), so that the stager orders its side streams after those writes.
        self.on_device_write: Callable[[list[torch.Tensor]], None] | None = None
        self.host_access = host_access
        self.mapped = host_access == "mapped"
        #: The kernels that code and decode 8-bit rows in registers (a ``RowCodec``), set by
        #: the head before its states are added; None: torch ops.
        self.row_codec = None

    @classmethod
    def factory(cls, placements: dict | None = None, *, default="device", host_access: str = "staged",
                hbm_share: float = 0.0, pin_failure: str = "refuse",
                slot_sets: int = 3) -> Callable[..., "TieredBank"]:
        """A ``bank=`` argument for :class:`~ds_pfc.PartialFC`.

        ``placements`` maps state names (``"weight"``, ``"momentum_buffer"``,
        ``"exp_avg"``, ``"exp_avg_sq"``, ``"step"``) to a placement; others get
        ``default``. Example: ``TieredBank.factory({"weight": ("host", torch.bfloat16)},
        default="device")``. ``host_access``: how rows move (:data:`HOST_ACCESS`);
        ``hbm_share``: the share of host-tier rows kept in device memory (mapped access);
        ``pin_failure``: what a host table that cannot be page-locked does; ``slot_sets``:
        the slot buffer sets mapped access keeps (see the class).
        """
        if pin_failure not in PIN_FAILURE:
            raise ValueError(f"pin_failure must be one of {PIN_FAILURE}, got {pin_failure!r}")
        if host_access not in HOST_ACCESS:
            raise ValueError(f"host_access must be one of {HOST_ACCESS}, got {host_access!r}")
        _check_share(hbm_share, host_access)
        _check_slot_sets(slot_sets, host_access)
        parsed = {name: Placement.parse(p) for name, p in (placements or {}).items()}
        default = Placement.parse(default)

        def make(num_rows, device, class_start=0, owner=None):
            return cls(num_rows, device, placements=parsed, default=default, class_start=class_start, owner=owner,
                       host_access=host_access, hbm_share=hbm_share, pin_failure=pin_failure,
                       slot_sets=slot_sets)
        make.takes_owner = True
        return make

    # ---------------------------------------------------------------- states
    def placement(self, name: str) -> Placement:
        return self.placements.get(name, self.default)

    def add_state(self, name, width, dtype, init=None):
        if name in self._stores:
            raise ValueError(f"state {name!r} already exists")
        place = self.placement(name)
        if place.dtype == INT8_ROWWISE and (dtype.is_floating_point or name in self.placements):
            if name == "weight" or not dtype.is_floating_point or width == 0:
                raise ValueError(f"state {name!r} cannot be stored as {INT8_ROWWISE!r}: 8-bit rows with a scale are "
                                 f"for optimizer moments (the centers keep a floating storage dtype)")
            if self.mapped and place.tier == "host" and self.device.type == "cuda" and self.row_codec is None:
                raise ValueError(f"state {name!r}: 8-bit rows in mapped host memory are coded and decoded by the "
                                 f"row-move kernel (Triton), which is not available here; place them on the device "
                                 f"tier or use host_access='staged'")
            store = RowwiseInt8Store(self.num_rows, width, place.tier, self.device, mapped=self.mapped)
            if init is not None:
                _write_init(store, init, self.num_rows)
            self._stores[name] = store
            self._logical[name] = dtype
            self._issued[name] = store.versions.clone()
            return
        place, storage = self._storage(name, dtype)
        if place.tier == "device":
            store = DeviceStore(self.num_rows, width, storage, self.device)
        elif place.tier == "host" and self.hbm_share > 0:
            store = SplitStore(self.num_rows, width, storage, self.device,
                               n_device=int(round(self.hbm_share * self.num_rows)))
        else:
            try:
                store = HostStore(self.num_rows, width, storage, mapped=self.mapped,
                                  near=self.device if self.mapped else None, pin_failure=self.pin_failure)
            except HostRegisterError:
                self.close()            # a refused bank releases the tables it registered, now
                raise
            if self.mapped and store.start_up.get("pin_failure"):
                # The GPU cannot read pageable memory in place: every state moves staged.
                self.host_access, self.mapped = "staged", False
                warnings.warn(f"ds_pfc: state {name!r}: its host table could not be page-locked, so the bank "
                              "uses host_access='staged' instead of 'mapped' (pin_failure='fallback')",
                              RuntimeWarning, stacklevel=2)
        if init is not None:
            _write_init(store, init, self.num_rows)
        self._stores[name] = store
        self._logical[name] = dtype
        self._issued[name] = store.versions.clone()

    def start_up(self) -> dict[str, dict]:
        """What start-up did for each host-tier state's table: ``{"placement": NUMA
        placement of a mapped table (CPUs used, pages per node, a fallback's reason) or None,
        "registered", "pinned", "pin_failure": the message of a failure that fell back}``."""
        out = {}
        for name, store in self._stores.items():
            part = store.host_part if isinstance(store, SplitStore) else store
            if isinstance(part, HostStore):
                out[name] = dict(part.start_up)
        return out

    def _storage(self, name: str, dtype: torch.dtype) -> tuple[Placement, torch.dtype]:
        """The placement and storage dtype of a (non-int8) state of logical ``dtype``."""
        place = self.placement(name)
        if place.dtype == INT8_ROWWISE:      # a default of int8 codes: integer states keep their dtype
            place = Placement(place.tier)
        # A storage dtype applies to floating states; counters (AdamW's "step") keep
        # their own dtype unless a placement names them explicitly.
        storage = dtype if (place.dtype is None or (not dtype.is_floating_point and name not in self.placements)) \
            else place.dtype
        if dtype.is_floating_point != storage.is_floating_point:
            raise ValueError(f"state {name!r} is {dtype}; its storage dtype must be "
                             f"{'a floating' if dtype.is_floating_point else 'an integer'} dtype, got {storage}")
        return place, storage

    def state_names(self):
        return list(self._stores)

    def check_placements(self) -> None:
        """Every placement must name a state the bank holds (catches misspellings)."""
        unknown = sorted(set(self.placements) - set(self._stores))
        if unknown:
            raise ValueError(f"placements name states {unknown} that this bank does not hold; "
                             f"it holds {self.state_names()}")

    def count_traffic(self, staged_in: int = 0, out: int = 0) -> None:
        with self._traffic_lock:
            self.bytes_in += staged_in
            self.bytes_out += out

    def count_staged_on_device(self, nbytes: torch.Tensor) -> None:
        """Count bytes staged in whose number is known on the device only (mapped access:
        the cold rows of a prefetch), without a host sync."""
        with self._traffic_lock:
            if self._bytes_in_device is None:
                self._bytes_in_device = nbytes.to(torch.int64).clone()
            else:
                self._bytes_in_device.add_(nbytes)

    def count_written_on_device(self, nbytes: torch.Tensor) -> None:
        """Count bytes written back whose number is known on the device only (mapped
        access: the rows that leave the next set), without a host sync."""
        with self._traffic_lock:
            if self._bytes_out_device is None:
                self._bytes_out_device = nbytes.to(torch.int64).clone()
            else:
                self._bytes_out_device.add_(nbytes)

    def store(self, name: str) -> RowStore:
        try:
            return self._stores[name]
        except KeyError:
            raise KeyError(f"bank has no state {name!r}; it holds {self.state_names()}") from None

    # ---------------------------------------------------------------- rows
    def _ids(self, rows):
        if rows is None:
            return torch.arange(self.num_rows)
        return rows.to("cpu", torch.int64)

    def check_versions(self, name: str, rows_cpu: torch.Tensor) -> None:
        """Raise :class:`StaleRowError` if a stored row is not the last one written."""
        store = self.store(name)
        stored, issued = store.versions[rows_cpu], self._issued[name][rows_cpu]
        if not torch.equal(stored.to(torch.int64), issued.to(torch.int64)):
            bad = torch.nonzero(stored.to(torch.int64) != issued.to(torch.int64)).squeeze(1)[:5]
            raise StaleRowError(
                f"state {name!r}, local rows {rows_cpu[bad].tolist()} (classes "
                f"{(rows_cpu[bad] + self.class_start).tolist()}): stored versions {stored[bad].tolist()} but "
                f"{issued[bad].tolist()} writes were issued; a write-back did not land or a row is torn")

    def read(self, name, rows, staging: torch.Tensor | None = None):
        """Rows of ``name`` on the device, in its logical dtype, version-checked.
        ``staging``: a reusable buffer on the store's side to gather into."""
        ids = self._ids(rows)
        store = self.store(name)
        self.check_versions(name, ids)
        values = store.gather(ids) if staging is None else store.gather_into(ids, staging)
        return values.to(self.device, non_blocking=True).to(self._logical[name])

    def write(self, name, rows, values):
        ids = self._ids(rows)
        self.note_issued(name, ids)
        self.store(name).scatter(ids, values)
        self._device_written(name)
        self.count_traffic(out=values.numel() * torch.empty((), dtype=self.store(name).dtype).element_size())

    def note_issued(self, name: str, rows_cpu: torch.Tensor) -> None:
        """Count a write of ``rows`` as issued (before it lands, for async write-back)."""
        issued = self._issued[name]
        issued.index_add_(0, rows_cpu, torch.ones((), dtype=issued.dtype).expand(rows_cpu.numel()))

    def export(self, name):
        return self.store(name).read_all().to(self._logical[name])

    def export_rows(self, name, lo, hi):
        store = self.store(name)
        ids = torch.arange(lo, hi)
        self.check_versions(name, ids)
        return store.gather(ids).to("cpu").to(self._logical[name])

    def load(self, name, tensor):
        store = self.store(name)
        self._issued[name] += 1
        _write_init(store, lambda lo, hi: tensor[lo:hi], self.num_rows)
        store.versions.copy_(self._issued[name])
        self._device_written(name)

    def load_rows(self, name, lo, values):
        """Rows ``[lo, lo + len(values))`` of ``name`` replaced, as :meth:`load` replaces
        all rows: written through the store a block at a time (the store converts to its
        storage dtype and codes 8-bit rows block by block), the rows' versions counted as
        issued and landed."""
        store = self.store(name)
        hi = lo + values.shape[0]
        if not 0 <= lo <= hi <= self.num_rows:
            raise IndexError(f"rows [{lo}, {hi}) of state {name!r} are not within [0, {self.num_rows})")
        ids = torch.arange(lo, hi)
        self._issued[name][lo:hi] += 1
        store.scatter(ids, values)
        store.versions[lo:hi] = self._issued[name][lo:hi]
        self._device_written(name)

    def _device_written(self, name: str) -> None:
        store = self.store(name)
        if self.on_device_write is None:
            return
        if isinstance(store, SplitStore):           # its device part was written on the compute stream
            self.on_device_write([store.device_part.data])
        elif store.tier == "device":
            self.on_device_write(list(store.tables()) if isinstance(store, RowwiseInt8Store) else [store.data])

    def resident_bytes(self):
        """Bytes per tier: rows held on the device and in host memory (rows and version
        counters)."""
        out = {tier: 0 for tier in TIERS}
        for name, store in self._stores.items():
            issued = self._issued[name]
            out["host"] += issued.numel() * issued.element_size()
            if isinstance(store, SplitStore):
                for tier, nbytes in store.nbytes_by_tier().items():
                    out[tier] += nbytes
                out["host"] += store.versions.numel() * store.versions.element_size()
            else:
                out[store.tier] += store.nbytes()
                out["host"] += store.versions.numel() * store.versions.element_size()
        return out

    def reset_traffic(self) -> dict[str, int]:
        """Bytes staged in and written back since the last call; resets the counters."""
        return {k: int(v) for k, v in self.take_traffic().items()}

    def take_traffic(self) -> dict:
        """:meth:`reset_traffic` without a host sync: a count kept on the device stays a
        0-d tensor (``int()`` reads it)."""
        with self._traffic_lock:
            staged = self.bytes_in
            if self._bytes_in_device is not None:
                staged = self._bytes_in_device + staged
                self._bytes_in_device = None
            written = self.bytes_out
            if self._bytes_out_device is not None:
                written = self._bytes_out_device + written
                self._bytes_out_device = None
            moved = {"staged_in": staged, "written_back": written}
            self.bytes_in = self.bytes_out = 0
        return moved

    def flush(self) -> None:
        for store in self._stores.values():
            store.flush()

    def close(self) -> None:
        for store in self._stores.values():
            store.close()


def _write_init(store: RowStore, init, num_rows: int, chunk_rows: int = 1 << 16) -> None:
    """Fill ``store`` from a tensor or ``init(lo, hi)`` in chunks of rows, so a bank
    larger than memory never materialises whole."""
    if isinstance(init, torch.Tensor):
        store.write_all(init)
        return
    for lo in range(0, num_rows, chunk_rows):
        hi = min(num_rows, lo + chunk_rows)
        store.scatter(torch.arange(lo, hi), init(lo, hi))
    store.versions.zero_()


def _check_slot_sets(slot_sets, host_access: str) -> None:
    if isinstance(slot_sets, bool) or slot_sets not in SLOT_SETS:
        raise ValueError(f"slot_sets must be one of {SLOT_SETS}, got {slot_sets!r}")
    if slot_sets == 2 and host_access != "mapped":
        raise ValueError("slot_sets=2 needs host_access='mapped': the staged path returns a slot's buffers only "
                         "once the host has scattered its write-back")


def _check_share(hbm_share, host_access: str) -> None:
    if isinstance(hbm_share, bool) or not isinstance(hbm_share, (int, float)) or not 0 <= hbm_share < 1:
        raise ValueError(f"hbm_share must be a number in [0, 1), got {hbm_share!r} (a share of 1 is the device tier)")
    if hbm_share > 0 and host_access != "mapped":
        raise ValueError(f"hbm_share={hbm_share} needs host_access='mapped': the staged path moves every row "
                         f"through host staging buffers")
