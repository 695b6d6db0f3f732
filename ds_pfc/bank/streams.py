"""Streams, events and buffer ownership for the tiered bank's asynchronous copies.

Every asynchronous copy of the bank and every buffer that one stream writes and
another reads goes through a :class:`Runtime`:

* ``run(stream, fn, *args, reads=, writes=)`` enqueues ``fn(*args)`` on ``stream``;
  ``reads``/``writes`` name the buffers it touches, whole or some of their rows
  (:func:`rows_of`: a table that one stream reads while another writes other rows). Index tensors the op needs are
  passed on the CPU and moved inside ``fn``, so they are allocated on (and owned by)
  the stream that uses them.
* ``record``/``wait``/``synchronize``/``query`` order streams and the host.
* ``empty(..., users=)`` allocates a buffer other streams may use (CUDA:
  ``record_stream`` for each of them, so the allocator cannot hand it out while
  their work is queued); ``keep_alive`` does the same for an existing tensor.
  A device buffer is allocated on the compute stream: its memory may still be in
  use by compute work queued before it (the caching allocator reuses a block as soon
  as the host freed it), so a side stream touches it only after waiting on an event
  recorded on the compute stream after the allocation. ``pin=True`` asks for a
  page-locked host buffer, filled by the host or a side stream, never by compute.
* ``on_compute(reads=, writes=)`` states that the work just enqueued on the compute
  stream reads or writes these buffers (e.g. a device table loaded by the caller):
  a side stream must likewise wait for an event recorded after it.
* ``to_host(tensor)`` copies a compute-stream tensor into host memory without
  blocking and returns ``(host, event)``: ``host`` holds the values once ``event``
  has completed (``synchronize`` it before reading them).
* ``retire(buffers, events)`` states that ``buffers`` go back to a pool and are free
  once ``events`` (their last readers) completed; ``reusable`` says whether they are.

Three implementations: :class:`CudaRuntime` (torch.cuda streams and events),
:class:`CpuRuntime` (everything is synchronous, nothing to order) and, with
``DS_PFC_DEBUG_STREAMS=1``, :class:`EmulatedRuntime`: CPU streams that complete
their work late and out of order on a worker thread, poison retired buffers and
raise :class:`StreamError` on a buffer reused while a consumer is pending, a buffer
used by a stream that does not own it, two unordered accesses from different
streams, or a side stream touching a buffer the compute stream allocated or wrote
with no event ordering it after that. CUDA ordering bugs that a CPU run would never
show then fail on the CPU.
"""
from __future__ import annotations

import collections
import itertools
import os
import random
import threading
import time
from typing import Callable, Iterable

import torch

__all__ = ["Runtime", "CpuRuntime", "CudaRuntime", "EmulatedRuntime", "StreamError", "debug_streams_active",
           "runtime_for", "rows_of", "Rows", "DEBUG_ENV"]

DEBUG_ENV = "DS_PFC_DEBUG_STREAMS"


def debug_streams_active() -> bool:
    """Whether new CPU banks use the stream emulator (``DS_PFC_DEBUG_STREAMS=1``)."""
    return os.environ.get(DEBUG_ENV, "0").strip() not in ("", "0")


class StreamError(RuntimeError):
    """A cross-stream ordering or ownership violation found by the stream emulator."""


def runtime_for(device: torch.device) -> "Runtime":
    """The runtime for a bank whose compute device is ``device``."""
    device = torch.device(device)
    if device.type == "cuda":
        return CudaRuntime(device)
    if debug_streams_active():
        return EmulatedRuntime(seed=int(os.environ.get(DEBUG_ENV + "_SEED", "0")))
    return CpuRuntime()


class Rows:
    """An access to rows ``index[mask]`` (``mask`` None: all of ``index``) of ``tensor``,
    for ``run``'s ``reads``/``writes``: two streams may touch one table at once where
    their rows differ. Row ids are those of one id space per table (a store split in
    two parts names its global ids for both)."""

    __slots__ = ("tensor", "index", "mask")

    def __init__(self, tensor: torch.Tensor, index: torch.Tensor, mask: torch.Tensor | None = None):
        self.tensor, self.index, self.mask = tensor, index, mask

    @property
    def shape(self):
        return self.tensor.shape

    @property
    def dtype(self):
        return self.tensor.dtype

    def ids(self) -> torch.Tensor:
        index = self.index.to("cpu")
        return index if self.mask is None else index[self.mask.to("cpu")]


def rows_of(tensor: torch.Tensor, index: torch.Tensor, mask: torch.Tensor | None = None) -> Rows:
    """The rows ``index`` (where ``mask``) of ``tensor``, as an access (see :class:`Rows`)."""
    return Rows(tensor, index, mask)


def _tensor(access) -> torch.Tensor:
    return access.tensor if isinstance(access, Rows) else access


def _overlap(a, b) -> bool:
    """Whether two accesses to one buffer may touch a common row (whole buffers: yes)."""
    if not isinstance(a, Rows) or not isinstance(b, Rows):
        return True
    return bool(torch.isin(a.ids(), b.ids()).any())


def _storage_key(t: torch.Tensor) -> int:
    return _tensor(t).untyped_storage().data_ptr()


class Runtime:
    """Interface; see the module docstring."""

    def compute(self):
        """The stream the caller's (compute) work is enqueued on."""
        raise NotImplementedError

    def new_stream(self, name: str):
        raise NotImplementedError

    def record(self, stream):
        raise NotImplementedError

    def wait(self, stream, event) -> None:
        raise NotImplementedError

    def synchronize(self, event) -> None:
        raise NotImplementedError

    def query(self, event) -> bool:
        raise NotImplementedError

    def run(self, stream, fn: Callable, *args, reads: Iterable[torch.Tensor] = (),
            writes: Iterable[torch.Tensor] = ()) -> None:
        raise NotImplementedError

    def empty(self, shape, dtype, device, users=(), pin: bool = False) -> torch.Tensor:
        raise NotImplementedError

    def keep_alive(self, tensor: torch.Tensor, stream) -> None:
        raise NotImplementedError

    def on_compute(self, reads: Iterable[torch.Tensor] = (), writes: Iterable[torch.Tensor] = ()) -> None:
        """The caller's work just enqueued on the compute stream reads/writes these
        buffers. Nothing to do on a real device: the emulator checks it."""

    def to_host(self, tensor: torch.Tensor):
        """``(host copy, event)``: the copy is enqueued on the compute stream and
        holds ``tensor``'s values once ``event`` completed."""
        raise NotImplementedError

    def retire(self, buffers: Iterable[torch.Tensor], events: list) -> list:
        """``buffers`` return to a pool; their last readers end at ``events``.
        Returns the events after which the pool may hand them out."""
        return [e for e in events if e is not None]

    def reusable(self, events: list) -> bool:
        return all(self.query(e) for e in events)

    def check_reusable(self, buffers: Iterable[torch.Tensor]) -> None:
        """Called by a pool as it hands ``buffers`` out again."""

    def close(self) -> None:
        pass


class CpuRuntime(Runtime):
    """The CPU without emulation: work runs at once, so there is nothing to order."""

    def compute(self):
        return "compute"

    def new_stream(self, name):
        return name

    def record(self, stream):
        return None

    def wait(self, stream, event):
        pass

    def synchronize(self, event):
        pass

    def query(self, event):
        return True

    def run(self, stream, fn, *args, reads=(), writes=()):
        fn(*args)

    def empty(self, shape, dtype, device, users=(), pin=False):
        return torch.empty(shape, dtype=dtype, device=device)

    def keep_alive(self, tensor, stream):
        pass

    def to_host(self, tensor):
        return tensor.to("cpu"), None


class CudaRuntime(Runtime):
    """torch.cuda streams and events on one device."""

    def __init__(self, device: torch.device):
        self.device = device

    def compute(self):
        return torch.cuda.current_stream(self.device)

    def new_stream(self, name):
        return torch.cuda.Stream(self.device)

    def record(self, stream):
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait(self, stream, event):
        if event is not None:
            stream.wait_event(event)

    def synchronize(self, event):
        if event is not None:
            event.synchronize()

    def query(self, event):
        return event is None or event.query()

    def run(self, stream, fn, *args, reads=(), writes=()):
        with torch.cuda.stream(stream):
            fn(*args)

    def empty(self, shape, dtype, device, users=(), pin=False):
        t = torch.empty(shape, dtype=dtype, device=device, pin_memory=pin and torch.device(device).type == "cpu")
        for stream in users:
            self.keep_alive(t, stream)
        return t

    def to_host(self, tensor):
        if not tensor.is_cuda:
            return tensor.to("cpu"), None
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor, non_blocking=True)       # on the current (compute) stream
        return host, self.record(self.compute())

    def keep_alive(self, tensor, stream):
        # Pinned host memory needs nothing: the caching host allocator records an
        # event for every asynchronous copy out of or into it.
        if tensor.is_cuda:
            tensor.record_stream(stream)


# ---------------------------------------------------------------- the emulator
class _Stream:
    def __init__(self, name: str):
        self.name = name
        self.ops: collections.deque = collections.deque()
        # The compute-stream position that the work queued here from now on is ordered
        # after (through waits on compute events, or on events of streams that waited).
        self.horizon = 0
        # A stream with an extra delay: its head op may run from this time on (monotonic
        # seconds); other streams run meanwhile, as on a device.
        self.not_before = 0.0
        self.held = False

    def __repr__(self):
        return f"<stream {self.name}>"


class _Event:
    def __init__(self, stream: _Stream, horizon: int = 0):
        self.stream = stream
        self.horizon = horizon      # the compute-stream position its completion implies
        self.done = threading.Event()

    def __repr__(self):
        return f"<event on {self.stream.name}, {'complete' if self.done.is_set() else 'pending'}>"


class EmulatedRuntime(Runtime):
    """CPU streams that run late and out of order, with hazard checks.

    Each stream is a FIFO of operations; one worker thread repeatedly picks a stream
    at random (seeded) among those whose head can run, sleeps up to ``max_delay``
    seconds and runs that head. A stream given an extra delay (``stream_delay``, tests)
    holds each head op that long while the other streams go on, as a slow copy engine
    would. Waits are honoured, nothing else orders two streams.
    The compute stream carries no work (the host ran it already; only the copies of
    ``to_host`` run on it, late) but its events complete late, as a GPU runs behind
    the host. Checks, raised as
    :class:`StreamError` (at once, or at the next call into the runtime):

    * a buffer used by a stream it was neither allocated for nor kept alive on
      (CUDA: its memory may be handed to other work while that stream still uses it);
    * a write to a buffer whose recorded consumer has not completed, or a pool
      handing such a buffer out;
    * an operation touching a buffer that an earlier operation on another stream
      still has to run on, with one of them writing (a missing wait);
    * a side-stream operation touching a buffer the compute stream allocated
      (``empty``, not pinned) or wrote (``on_compute``), or writing one it read, that
      is not ordered after that access: neither the side stream waited on an event
      recorded on compute after it, nor did the host synchronize (or find complete)
      such an event before enqueueing the operation. The compute stream's accesses
      are positions in its order (every access and every record takes the next one),
      so this is checked when the operation is enqueued. A compute-stream access to
      a buffer with side-stream work still pending on it is caught the same way.

    Retired buffers are filled with NaN (integers: their minimum) once their
    recorded consumers completed, fresh ones at allocation: a read that is not
    ordered after the write it needs returns garbage, not yesterday's values.
    """

    def __init__(self, seed: int = 0, max_delay: float = 5e-4):
        self.max_delay = max_delay
        self.stream_delay: dict[str, float] = {}   # per stream name: a fixed extra delay (tests)
        self._rng = random.Random(seed)
        self._cond = threading.Condition()
        self._compute = _Stream("compute")
        self._allocator = _Stream("allocator")      # deferred poisoning
        self._streams = [self._compute, self._allocator]
        self._seq = itertools.count()
        self._position = itertools.count(1)         # the compute stream's order
        self._synced = 0                            # compute position the host saw complete
        # key -> {"write": (position, what), "read": (position, what)}: the compute
        # stream's last write (an allocation counts as one) and last read of a buffer.
        self._compute_access: dict[int, dict[str, tuple[int, str]]] = {}
        self._owners: dict[int, set] = {}
        self._consumers: dict[int, list[_Event]] = {}
        # key -> [(seq, stream, writes, access)]: work enqueued on a side stream, not yet run
        self._inflight: dict[int, list] = collections.defaultdict(list)
        self._error: BaseException | None = None
        self._closed = False
        self._worker = threading.Thread(target=self._loop, name="ds_pfc-stream-emulator", daemon=True)
        self._worker.start()

    # -------------------------------------------------------- interface
    def compute(self):
        return self._compute

    def new_stream(self, name):
        stream = _Stream(name)
        with self._cond:
            self._streams.append(stream)
        return stream

    def record(self, stream):
        self._check()
        with self._cond:
            event = _Event(stream, next(self._position) if stream is self._compute else stream.horizon)
            stream.ops.append(("record", event))
            self._cond.notify_all()
        return event

    def wait(self, stream, event):
        self._check()
        if event is None or event.stream is stream:
            return
        if stream is self._compute:
            self.synchronize(event)     # the host is the compute stream's issuer: it blocks
        else:
            with self._cond:
                stream.ops.append(("wait", event))
                stream.horizon = max(stream.horizon, event.horizon)
                self._cond.notify_all()

    def synchronize(self, event):
        if event is not None:
            while not event.done.wait(0.05):
                self._check()
            self._saw_complete(event)
        self._check()

    def query(self, event):
        self._check()
        if event is None:
            return True
        if event.done.is_set():
            self._saw_complete(event)
            return True
        return False

    def on_compute(self, reads=(), writes=()):
        self._check()
        with self._cond:
            for t, w in [(t, False) for t in reads] + [(t, True) for t in writes]:
                key = _storage_key(t)
                for _, other, other_w, _ in self._inflight[key]:
                    if other is not self._compute and (w or other_w):
                        raise StreamError(
                            f"the compute stream {'writes' if w else 'reads'} a buffer {tuple(t.shape)} {t.dtype} "
                            f"that a {'write' if other_w else 'read'} on {other} has not finished: no event orders "
                            f"them (a missing wait)")
                self._mark_compute(t, w, "wrote" if w else "read")

    def to_host(self, tensor):
        self._check()
        host = torch.empty(tensor.shape, dtype=tensor.dtype)
        _poison(host)                   # garbage until the copy ran
        seq = next(self._seq)
        self._enqueue(self._compute, ("run", seq, host.copy_, (tensor,), [], []))
        return host, self.record(self._compute)

    def run(self, stream, fn, *args, reads=(), writes=()):
        self._check()
        reads, writes = list(reads), list(writes)
        for t in reads + writes:
            owners = self._owners.get(_storage_key(t))
            if owners is None or stream not in owners:
                raise StreamError(
                    f"a buffer {tuple(t.shape)} {t.dtype} is used on {stream} without being allocated for it or kept "
                    f"alive on it (record_stream): on CUDA its memory could be reused while {stream} still reads it")
        seq = next(self._seq)
        with self._cond:
            if stream is not self._compute and stream is not self._allocator:
                ordered = max(stream.horizon, self._synced)
                for t, w in [(t, False) for t in reads] + [(t, True) for t in writes]:
                    access = self._compute_access.get(_storage_key(t), {})
                    # A read must follow the compute stream's last write; a write its last read too.
                    conflicts = [access[k] for k in (("write", "read") if w else ("write",)) if k in access]
                    late = [a for a in conflicts if a[0] > ordered]
                    if late:
                        raise StreamError(
                            f"{stream} {'writes' if w else 'reads'} a buffer {tuple(t.shape)} {t.dtype} that the "
                            f"compute stream {late[0][1]} with no event ordering {stream} after it: wait on an event "
                            f"recorded on the compute stream after that (record(compute), then wait({stream.name}, "
                            f"event)); on CUDA the compute stream's work, or the work it freed that memory after, "
                            f"may still be running")
            for t, w in [(t, False) for t in reads] + [(t, True) for t in writes]:
                self._inflight[_storage_key(t)].append((seq, stream, w, t))
        self._enqueue(stream, ("run", seq, fn, args, reads, writes))

    def empty(self, shape, dtype, device, users=(), pin=False):
        t = torch.empty(shape, dtype=dtype, device=device)
        _poison(t)
        key = _storage_key(t)
        self._owners[key] = {self._compute, *users}
        self._consumers.pop(key, None)      # a freed buffer's consumers are not this one's
        with self._cond:
            if pin:                         # page-locked host memory: no compute-stream history
                self._compute_access.pop(key, None)
            else:                           # allocated on the compute stream
                self._compute_access[key] = {"write": (next(self._position), "allocated")}
        return t

    def keep_alive(self, tensor, stream):
        self._owners.setdefault(_storage_key(tensor), {self._compute}).add(stream)

    def retire(self, buffers, events):
        buffers = list(buffers)
        events = [e for e in events if e is not None]
        with self._cond:
            for t in buffers:
                self._consumers[_storage_key(t)] = list(events)
        # Compute-stream work was run by the host already: what it read is read. Side
        # streams may still be reading: poison after their recorded events.
        side = [e for e in events if e.stream is not self._compute and not e.done.is_set()]
        if not side:
            for t in buffers:
                _poison(t)
            return events
        for e in side:
            self._enqueue(self._allocator, ("wait", e))
        seq = next(self._seq)
        with self._cond:
            for t in buffers:
                self._inflight[_storage_key(t)].append((seq, self._allocator, True, t))
        self._enqueue(self._allocator, ("run", seq, _poison_all, (buffers,), [], buffers))
        return events + [self.record(self._allocator)]

    def check_reusable(self, buffers):
        self._check()
        for t in buffers:
            pending = [e for e in self._consumers.get(_storage_key(t), []) if not e.done.is_set()]
            if pending:
                raise StreamError(f"a pool handed out a buffer {tuple(t.shape)} {t.dtype} while its consumer "
                                  f"{pending[0]} has not completed")

    def close(self):
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._worker.join(timeout=10)

    # -------------------------------------------------------- internals
    def _check(self):
        if self._error is not None:
            raise self._error

    def _saw_complete(self, event):
        """The host knows ``event`` completed: compute work up to its position is done."""
        with self._cond:
            self._synced = max(self._synced, event.horizon)

    def _mark_compute(self, t, wrote, what):
        self._compute_access.setdefault(_storage_key(t), {})["write" if wrote else "read"] = \
            (next(self._position), what)

    def _enqueue(self, stream, op):
        with self._cond:
            stream.ops.append(op)
            self._cond.notify_all()

    def _runnable(self, stream):
        op = stream.ops[0]
        return op[0] != "wait" or op[1].done.is_set()

    def _loop(self):
        while True:
            with self._cond:
                while True:
                    now = time.monotonic()
                    runnable = [s for s in self._streams if s.ops and self._runnable(s)]
                    ready = [s for s in runnable if s.not_before <= now]
                    if ready or (self._closed and not any(s.ops for s in self._streams)):
                        break
                    later = [s.not_before - now for s in runnable]
                    self._cond.wait(min([0.05] + later))
                if not ready:
                    return
                stream = self._rng.choice(ready)
                extra = self.stream_delay.get(stream.name, 0.0)
                if extra and not stream.held:
                    # Its head op waits ``extra`` seconds while the other streams go on.
                    stream.not_before, stream.held = now + extra, True
                    continue
                stream.held = False
                delay = self._rng.uniform(0, self.max_delay)
            time.sleep(delay)
            op = stream.ops[0]
            try:
                if op[0] == "run":
                    self._execute(stream, *op[1:])
            except BaseException as err:   # surfaced at the next call into the runtime
                if self._error is None:
                    self._error = err
            with self._cond:
                stream.ops.popleft()
                if op[0] == "record":
                    op[1].done.set()
                elif op[0] == "run":
                    for t in op[4] + op[5]:
                        key = _storage_key(t)
                        self._inflight[key] = [a for a in self._inflight[key] if a[0] != op[1]]
                if self._error is not None:         # nobody may block on a broken runtime
                    for s in self._streams:
                        for queued in s.ops:
                            if queued[0] == "record":
                                queued[1].done.set()
                self._cond.notify_all()

    def _execute(self, stream, seq, fn, args, reads, writes):
        with self._cond:
            for t in writes:
                pending = [e for e in self._consumers.get(_storage_key(t), []) if not e.done.is_set()]
                if pending and stream is not self._allocator:
                    raise StreamError(f"{stream} writes a buffer {tuple(t.shape)} {t.dtype} while its consumer "
                                      f"{pending[0]} has not completed")
            for t, w in [(t, False) for t in reads] + [(t, True) for t in writes]:
                for other_seq, other, other_w, access in self._inflight[_storage_key(t)]:
                    if other_seq < seq and other is not stream and (w or other_w) and _overlap(t, access):
                        raise StreamError(
                            f"{stream} {'writes' if w else 'reads'} a buffer {tuple(t.shape)} {t.dtype} that an "
                            f"earlier {'write' if other_w else 'read'} on {other} has not finished: no event orders "
                            f"them (a missing wait)")
        fn(*args)


def _poison(t: torch.Tensor) -> None:
    if t.is_floating_point() or t.is_complex():
        t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.fill_(True)
    else:
        t.fill_(torch.iinfo(t.dtype).min)


def _poison_all(buffers) -> None:
    for t in buffers:
        _poison(t)
