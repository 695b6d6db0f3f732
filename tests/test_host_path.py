"""The host tier's row path (``HostStore`` in ``ds_pfc.bank.stores``): gather and
scatter on the store's own threads against a plain per-row reference, bit for bit;
mapped registration of host tables (with a mocked CUDA runtime); and a smoke run of the
``hostpath`` benchmark."""
from __future__ import annotations

import json
import os
import threading

import pytest
import torch

from ds_pfc.bank import stores
from ds_pfc.bank.stores import HostStore

NUM = 101


def _random_bits(shape, dtype, seed):
    """Values with arbitrary bit patterns (NaNs with payloads, infinities, denormals):
    a copy must keep every bit."""
    g = torch.Generator().manual_seed(seed)
    width = {torch.float32: torch.int32, torch.bfloat16: torch.int16}[dtype]
    info = torch.iinfo(width)
    return torch.randint(info.min, info.max, shape, generator=g, dtype=torch.int64).to(width).view(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({torch.float32: torch.int32, torch.bfloat16: torch.int16}[t.dtype])


def _row_sets():
    g = torch.Generator().manual_seed(3)
    inner = torch.randperm(NUM - 2, generator=g)[:35] + 1
    return {
        "odd, first and last": torch.cat([torch.tensor([0, NUM - 1]), inner]).sort().values,   # 37 rows
        "empty": torch.empty(0, dtype=torch.int64),
        "first": torch.tensor([0]),
        "last": torch.tensor([NUM - 1]),
        "ends": torch.tensor([0, NUM - 1]),
        "range": torch.arange(10, 27),                  # a contiguous run: copied as a slice
        "all": torch.arange(NUM),
        "pairs": torch.tensor([1, 2, 4, 5, 7, 8, 50, 51, 52, 99]),
    }


# widths: 0 (1-D), element-wise rows (3), and rows copied as 2-, 4-, 8- and 16-byte words
WIDTHS = [0, 1, 2, 3, 4, 8, 24]
THREADS = [dict(threads=1), dict(threads=3, chunk_rows=2), dict(threads=3, chunk_rows=1), dict(threads=2)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("opts", THREADS, ids=lambda o: "-".join(f"{k}{v}" for k, v in o.items()))
def test_gather_and_scatter_match_a_per_row_reference(dtype, width, opts):
    shape = (NUM, width) if width else (NUM,)
    init = _random_bits(shape, dtype, seed=width)
    store = HostStore(NUM, width, dtype, init=init, **opts)
    ref = init.clone()
    versions = torch.zeros(NUM, dtype=torch.int64)
    try:
        for i, (name, rows) in enumerate(_row_sets().items()):
            k = rows.numel()
            # gather_into the caller's buffer (a slice of a larger one, as the stager's)
            staging = torch.empty((k + 5,) + store.row_shape, dtype=dtype)
            out = staging[:k]
            got = store.gather_into(rows, out)
            assert got is out
            expect = torch.stack([ref[r] for r in rows.tolist()]) if k else ref[:0]
            assert torch.equal(_bits(out), _bits(expect)), name
            assert torch.equal(_bits(store.gather(rows)), _bits(expect)), name
            # scatter new values; every row's version counts once
            values = _random_bits((k,) + store.row_shape, dtype, seed=100 + i)
            store.scatter(rows, values)
            for j, r in enumerate(rows.tolist()):
                ref[r] = values[j]
                versions[r] += 1
            assert torch.equal(_bits(store.data), _bits(ref)), name
            assert torch.equal(store.versions.to(torch.int64), versions), name
    finally:
        store.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("width", [0, 3, 8])
@pytest.mark.parametrize("source", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_scatter_converts_values_as_to_would(dtype, width, source):
    store = HostStore(NUM, width, dtype, threads=3, chunk_rows=2)
    g = torch.Generator().manual_seed(7)
    ref = store.data.clone()
    counts = torch.zeros(NUM, dtype=store.versions.dtype)
    for rows in (_row_sets()["odd, first and last"], torch.arange(30, 45)):
        k = rows.numel()
        values = (torch.randn((k,) + store.row_shape, generator=g, dtype=torch.float64) * 1e3).to(source)
        store.scatter(rows, values)
        ref[rows] = values.to(dtype)
        counts[rows] += 1
    assert torch.equal(_bits(store.data), _bits(ref))
    assert torch.equal(store.versions, counts) and int(counts.sum()) == 37 + 15
    store.close()


def test_non_contiguous_and_misaligned_buffers():
    """Values that are a transposed view, and an output buffer whose rows are not
    aligned to the copy's word, take the element-wise path with the same result."""
    store = HostStore(NUM, 8, torch.float32, threads=3, chunk_rows=2)
    rows = _row_sets()["odd, first and last"]
    k = rows.numel()
    values = torch.randn(8, k).t()                     # not contiguous
    store.scatter(rows, values)
    flat = torch.empty(k * 8 + 1)
    out = flat[1:].view(k, 8)                          # 4 bytes off a 16-byte boundary
    assert out.data_ptr() % 16
    store.gather_into(rows, out)
    assert torch.equal(out, values)
    assert torch.equal(store.data[rows], values)
    strided = torch.empty(k, 16)[:, ::2]               # not contiguous: torch's own path
    assert torch.equal(store.gather_into(rows, strided), values)
    store.close()


def test_bad_rows_and_shapes_raise_and_change_nothing():
    store = HostStore(NUM, 4, torch.float32, threads=3, chunk_rows=2)
    before = store.data.clone()
    for rows in (torch.tensor([3, NUM]), torch.tensor([-1, 3])):
        with pytest.raises(IndexError, match=r"\[0, 101\)"):
            store.scatter(rows, torch.ones(2, 4))
        with pytest.raises(IndexError):
            store.gather_into(rows, torch.empty(2, 4))
    with pytest.raises(ValueError, match="shape"):
        store.scatter(torch.tensor([1, 2]), torch.ones(2, 5))
    with pytest.raises(ValueError, match="int64"):
        store.scatter(torch.tensor([1.0, 2.0]), torch.ones(2, 4))
    assert torch.equal(store.data, before) and int(store.versions.sum()) == 0
    store.close()


def test_chunks_run_on_the_stores_own_threads():
    """Rows split into at most ``threads`` chunks of at least ``chunk_rows``; the caller
    runs the first, the store's pool the others, whatever torch's intra-op setting; an
    error in any chunk is raised after every chunk finished."""
    store = HostStore(NUM, 4, torch.float32, threads=3, chunk_rows=2)
    assert store._chunks(7) == [(0, 3), (3, 6), (6, 7)]
    assert store._chunks(3) == [(0, 2), (2, 3)]
    assert store._chunks(1) == [(0, 1)]
    seen, lock = [], threading.Lock()

    def work(lo, hi):
        with lock:
            seen.append((lo, hi, threading.current_thread().name))
        if lo == 3:
            raise RuntimeError("chunk 3 failed")
    with pytest.raises(RuntimeError, match="chunk 3 failed"):
        store._run(7, work)
    assert sorted(s[:2] for s in seen) == [(0, 3), (3, 6), (6, 7)]
    names = {lo: name for lo, _, name in seen}
    assert names[0] == threading.current_thread().name
    assert names[3].startswith("ds_pfc-host-rows") and names[6].startswith("ds_pfc-host-rows")
    store.threads = 1                                  # settable between operations
    assert store._chunks(7) == [(0, 7)]
    store.close()
    assert store._pool is None


def test_default_threads(monkeypatch):
    monkeypatch.delenv(stores.THREADS_ENV, raising=False)
    assert HostStore(4, 2, torch.float32).threads == min(8, os.cpu_count())
    monkeypatch.setenv(stores.THREADS_ENV, "3")
    assert HostStore(4, 2, torch.float32).threads == 3
    assert HostStore(4, 2, torch.float32, threads=5).threads == 5
    monkeypatch.setenv(stores.THREADS_ENV, "zero")
    with pytest.raises(ValueError, match=stores.THREADS_ENV):
        HostStore(4, 2, torch.float32)
    with pytest.raises(ValueError, match="threads"):
        HostStore(4, 2, torch.float32, threads=0)
    default = HostStore(100_000, 8, torch.float32, threads=1)
    assert default.chunk_rows == stores.CHUNK_BYTES // 32


def test_count_landed_counts_once_per_row():
    store = HostStore(NUM, 2, torch.float32, threads=1)
    rows = _row_sets()["odd, first and last"]
    store.count_landed(rows)
    store.count_landed(torch.empty(0, dtype=torch.int64))
    expect = torch.zeros(NUM, dtype=store.versions.dtype)
    expect[rows] = 1
    assert torch.equal(store.versions, expect)


# ---------------------------------------------------------------- mapped registration
class _Cudart:
    """A fake CUDA runtime recording host (un)registrations."""

    def __init__(self, log, fail_with=0):
        self.log, self.fail_with = log, fail_with

    def cudaHostRegister(self, ptr, nbytes, flags):
        self.log.append(("register", ptr, nbytes, flags))
        return self.fail_with

    def cudaHostUnregister(self, ptr):
        self.log.append(("unregister", ptr))
        return 0


@pytest.fixture
def fake_cuda(monkeypatch):
    """``torch.cuda`` says it is available; its runtime and the pinned allocator (which
    would need a driver) are fakes that log what happens, in order, with every
    ``zero_`` of a tensor."""
    log = []
    runtime = _Cudart(log)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: runtime)

    def pinned_empty(shape, dtype):
        log.append(("pinned_empty", tuple(shape)))
        return torch.empty(shape, dtype=dtype)
    monkeypatch.setattr(stores, "pinned_empty", pinned_empty)
    monkeypatch.setattr(stores, "REGISTER_MIN_BYTES", 1000)
    real_zero = torch.Tensor.zero_

    def zero_(t):
        log.append(("zero", t.data_ptr()))
        return real_zero(t)
    monkeypatch.setattr(torch.Tensor, "zero_", zero_)
    real_place = stores.place_host_table

    def place_host_table(t, cpus=None, huge_pages=True):
        log.append(("place", t.data_ptr(), cpus))
        return real_place(t, cpus, huge_pages)
    monkeypatch.setattr(stores, "place_host_table", place_host_table)
    monkeypatch.setattr(stores, "local_cpus", lambda device: {0} if device is not None else None)
    return log, runtime


def test_mapped_tables_are_prefaulted_and_registered_portable_and_mapped(fake_cuda):
    log, _ = fake_cuda
    store = HostStore(100, 5, torch.float32, mapped=True, threads=1)        # 2000 bytes
    ptr = store.data.data_ptr()
    assert store.mapped
    # every page touched (zeroed) before the registration, and not zeroed a second time after it
    assert log == [("place", ptr, None), ("register", ptr, 2000, stores.HOST_REGISTER_PORTABLE | 2)]
    assert log[1][3] == 3
    assert torch.count_nonzero(store.data) == 0
    store.close()
    store.close()
    assert log[2:] == [("unregister", ptr)]


def test_a_mapped_table_is_placed_near_its_gpu(fake_cuda):
    """``near``: the table's pages are touched from the CPUs of that GPU's NUMA node."""
    log, _ = fake_cuda
    store = HostStore(100, 5, torch.float32, mapped=True, threads=1, near=torch.device("cuda", 2))
    assert log[0] == ("place", store.data.data_ptr(), {0})
    assert torch.count_nonzero(store.data) == 0
    store.close()


def test_unmapped_tables_are_registered_with_default_flags(fake_cuda):
    log, _ = fake_cuda
    store = HostStore(100, 5, torch.float32, threads=1)
    ptr = store.data.data_ptr()
    assert not store.mapped
    assert [e for e in log if e[0] == "register"] == [("register", ptr, 2000, 0)]
    store.close()
    assert log[-1] == ("unregister", ptr)
    init = torch.randn(100, 5)
    mapped = HostStore(100, 5, torch.float32, init=init, mapped=True, threads=1)
    assert [e[3] for e in log if e[0] == "register"] == [0, 3]
    assert torch.equal(mapped.data, init)
    mapped.close()


def test_small_mapped_tables_come_from_the_pinned_allocator(fake_cuda):
    log, _ = fake_cuda
    store = HostStore(10, 5, torch.float32, mapped=True, threads=1)         # 200 bytes
    assert store.mapped and ("pinned_empty", (10, 5)) in log
    assert not [e for e in log if e[0] in ("register", "unregister")]
    store.close()
    assert not [e for e in log if e[0] == "unregister"]
    table, registered = stores.pinned_table((10, 5), torch.float32, mapped=True)
    assert not registered


def test_a_failed_registration_raises_with_the_size_and_registers_nothing(fake_cuda):
    log, runtime = fake_cuda
    runtime.fail_with = 2
    for mapped in (True, False):
        log.clear()
        with pytest.raises(RuntimeError, match="2000-byte host table") as info:
            HostStore(100, 5, torch.float32, mapped=mapped, threads=1)
        assert "error 2" in str(info.value)
        assert [e[0] for e in log if e[0] not in ("zero", "place")] == ["register"]
        assert log[-1][3] == (3 if mapped else 0)


def test_without_cuda_mapped_is_plain_memory(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(stores, "REGISTER_MIN_BYTES", 1000)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: pytest.fail("no CUDA call without CUDA"))
    store = HostStore(100, 5, torch.float32, mapped=True, threads=1)
    assert store.mapped and not store._registered and not store.data.is_pinned()
    store.close()


# ---------------------------------------------------------------- the benchmark
def test_hostpath_benchmark_smoke(tmp_path, capsys):
    from ds_pfc.bench import hostpath
    path = tmp_path / "hostpath.json"
    threads_before = torch.get_num_threads()
    rc = hostpath.main(["--rows", "40,7", "--dim", "8", "--dtype", "fp32,bf16", "--table-gb", "0.00001",
                        "--threads", "1,2", "--repeats", "2", "--json", str(path)])
    assert rc == 0
    assert torch.get_num_threads() == threads_before
    doc = json.loads(path.read_text())
    assert doc["benchmark"] == "hostpath" and doc["date"]
    assert doc["platform"] and doc["cpu_count"] == os.cpu_count() and doc["torch_version"] == torch.__version__
    assert doc["machine"]["cpu_count"] == os.cpu_count()
    assert doc["config"]["rows"] == [40, 7] and doc["config"]["threads"] == [1, 2]
    ops = [r["op"] for r in doc["results"]]
    assert ops.count("gather") == ops.count("scatter") == 2 * 2 * 2 and ops.count("split") == 2
    for r in doc["results"]:
        for key in ("wall_s", "cpu_s", "floor_wall_s", "floor_cpu_s", "ratio_wall", "ratio_cpu"):
            assert isinstance(r[key], float) and r[key] >= 0, (r["op"], key)
        if r["op"] != "split":
            assert r["bytes"] == r["rows"] * 8 * (4 if r["dtype"] == "fp32" else 2)
            assert "before_ratio_wall" in r
    table = capsys.readouterr().out
    assert "x floor" in table and "split (isin / searchsorted)" in table
