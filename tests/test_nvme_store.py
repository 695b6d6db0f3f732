"""NvmeStore: a file-backed row store through libaio (its default engine) or DeepSpeed's
async I/O op.

Reference: a plain torch tensor updated with ``index_copy_`` by the test itself (and
a per-row count of scatters), never read back from the store; the file itself is also
read with a plain numpy memmap. Every file-format error is provoked on files the test
writes or damages itself.
"""
from __future__ import annotations

import json
import os
import shutil
import struct
import time
import zlib
from collections import namedtuple

import numpy as np
import pytest
import torch

try:
    from deepspeed.ops.op_builder import AsyncIOBuilder
    _AIO_OK = AsyncIOBuilder().is_compatible()
except Exception:  # pragma: no cover
    AsyncIOBuilder, _AIO_OK = None, False

pytestmark = pytest.mark.skipif(
    not _AIO_OK, reason="DeepSpeed's async_io op is not compatible here (libaio missing: "
                        "apt-get install libaio-dev)")

from ds_pfc.bank import nvme  # noqa: E402
from ds_pfc.bank.nvme import DirtyStoreError, NvmeStore  # noqa: E402

R = 1021


def rand_values(shape, dtype, gen):
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)
    return torch.randint(-(2 ** 40), 2 ** 40, shape, generator=gen, dtype=torch.int64).to(dtype)


def row_shape(width):
    return () if width == 0 else (width,)


def file_rows(path, num_rows):
    """Rows, the rows past num_rows and the block padding of an NvmeStore file, read
    with a plain numpy memmap and the documented layout (not through the store)."""
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    fields = nvme._HEADER.unpack(raw[:nvme._HEADER.size].tobytes())
    br, rb, bb, nb, doff, fbytes = fields[8], fields[9], fields[10], fields[11], fields[13], fields[14]
    assert raw.size == fbytes
    blocks = np.asarray(raw[doff:]).reshape(nb, bb)
    rows = blocks[:, :br * rb].reshape(nb * br, rb)
    return torch.from_numpy(rows[:num_rows].copy()), rows[num_rows:], blocks[:, br * rb:]


def assert_file_holds(path, ref):
    """The file holds ``ref``'s bytes row after row, and zeros in padding and past the rows."""
    n = ref.shape[0]
    rows, phantom, padding = file_rows(path, n)
    assert torch.equal(rows, ref.contiguous().reshape(n, -1).view(torch.uint8))
    assert not phantom.any() and not padding.any()


Case = namedtuple("Case", "width dtype block_rows iop stage_bytes engine io rounds", defaults=("libaio", None, 40))
CASES = [
    Case(7, torch.float32, None, 1, 16 << 20),     # default block size: one block holds all
    Case(7, torch.float32, 100, 2, 8192),          # 100 does not divide 1021; one block per batch
    Case(0, torch.int64, 37, 1, 3 * 8192),         # 1-D rows, several blocks per batch
    Case(0, torch.bfloat16, 1000, 2, 16 << 20),    # last block has 21 real rows
    Case(512, torch.bfloat16, 3, 1, 5 * 4096),     # rows of 1 KiB, padded blocks, 5 per batch
    Case(512, torch.float32, None, 2, 1 << 20),    # rows of 2 KiB, default blocks
    Case(7, torch.int64, 1, 1, 4 * 4096),          # one row per block
    # rows of 6000 bytes straddle pages; no coalescing; 1-page requests; gap pages written back
    Case(1500, torch.float32, 5, 1, 1 << 20, "libaio", dict(coalesce_gap_bytes=0, max_request_bytes=4096,
                                                             coalesce_write_gap_bytes=3 * 4096), 15),
    Case(384, torch.bfloat16, None, 1, 1 << 20, "libaio", None, 15),   # rows of 768 bytes: some straddle pages
    Case(2048, torch.float32, 3, 1, 1 << 20, "libaio", None, 15),      # rows of two whole pages
    # DeepSpeed's handles: the same plans through the other engine
    Case(7, torch.float32, 100, 2, 8192, "deepspeed", None, 8),
    Case(512, torch.bfloat16, 3, 1, 5 * 4096, "deepspeed", None, 8),
    Case(1500, torch.float32, 5, 1, 1 << 20, "deepspeed", dict(coalesce_write_gap_bytes=4096), 8),
]


def case_id(c):
    return f"w{c.width}-{str(c.dtype)[6:]}-br{c.block_rows}-p{c.iop}-{c.engine}" + ("-io" if c.io else "")


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_random_rounds_match_reference(tmp_path, case):
    gen = torch.Generator().manual_seed(1234 + case.width)
    shape = (R,) + row_shape(case.width)
    ref = rand_values(shape, case.dtype, gen)
    counts = torch.zeros(R, dtype=torch.int64)
    path = tmp_path / "bank.bin"
    store = NvmeStore(path, R, case.width, case.dtype, create=True, init=ref.clone(),
                      block_rows=case.block_rows, intra_op_parallelism=case.iop, stage_bytes=case.stage_bytes,
                      io_engine=case.engine, **(case.io or {}))
    assert store.tier == "nvme"
    align = 1024 * case.iop
    assert store.file_bytes() % align == 0 and os.path.getsize(path) == store.file_bytes()
    assert store._block_bytes % align == 0 and store._data_offset % align == 0
    assert torch.equal(store.read_all(), ref)
    for step in range(case.rounds):
        k = int(torch.randint(0, R + 1, (), generator=gen)) if step % 5 else [0, 1, R][step // 5 % 3]
        rows = torch.randperm(R, generator=gen)[:k].sort().values
        got = store.gather(rows)
        assert got.dtype == case.dtype and tuple(got.shape) == (k,) + row_shape(case.width)
        assert torch.equal(got, ref[rows])
        # scatter another random set, values given in another dtype (floats: float64)
        rows = torch.randperm(R, generator=gen)[:int(torch.randint(0, R // 3, (), generator=gen))].sort().values
        vals = rand_values((len(rows),) + row_shape(case.width), case.dtype, gen)
        given = vals.to(torch.float64) if case.dtype.is_floating_point else vals
        store.scatter(rows, given)
        ref.index_copy_(0, rows, vals)
        counts[rows] += 1
        assert torch.equal(store.versions, counts)
    assert torch.equal(store.read_all(), ref)
    store.close()
    assert_file_holds(path, ref)
    with NvmeStore(path, R, case.width, case.dtype, create=False, intra_op_parallelism=case.iop) as again:
        assert torch.equal(again.read_all(), ref)
        assert torch.equal(again.versions, counts)
        assert again.block_rows == store.block_rows


def test_zero_fill_and_init_conversion(tmp_path):
    with NvmeStore(tmp_path / "z.bin", R, 7, torch.float32, create=True) as s:
        assert torch.equal(s.read_all(), torch.zeros(R, 7))
        assert torch.equal(s.versions, torch.zeros(R, dtype=torch.int64))
    init = torch.randn(R, 7, dtype=torch.float64)
    with NvmeStore(tmp_path / "i.bin", R, 7, torch.bfloat16, create=True, init=init) as s:
        assert torch.equal(s.read_all(), init.to(torch.bfloat16))


def test_versions_count_scatters_and_write_all(tmp_path):
    with NvmeStore(tmp_path / "v.bin", R, 0, torch.float32, create=True, block_rows=64) as s:
        expect = torch.zeros(R, dtype=torch.int64)
        for times, rows in [(3, torch.tensor([0, 63, 64, 1020])), (1, torch.arange(64, 128)), (2, torch.tensor([5]))]:
            for _ in range(times):
                s.scatter(rows, torch.ones(len(rows)))
            expect[rows] += times
        s.gather(torch.arange(R))  # reads do not count
        assert torch.equal(s.versions, expect)
        new = torch.arange(R, dtype=torch.float32)
        s.write_all(new)
        assert torch.equal(s.versions, expect + 1)
        assert torch.equal(s.read_all(), new)
        # a full block (64..127) and the partial last block, written without reading
        s.scatter(torch.arange(960, R), -torch.ones(R - 960))
        s.scatter(torch.arange(64, 128), torch.full((64,), 7.0))
        new[960:] = -1
        new[64:128] = 7
        assert torch.equal(s.read_all(), new)


def test_unsorted_gather_and_duplicate_scatter(tmp_path):
    init = torch.randn(R, 3)
    with NvmeStore(tmp_path / "u.bin", R, 3, torch.float32, create=True, init=init, block_rows=50) as s:
        rows = torch.tensor([900, 3, 3, 500, 0])
        assert torch.equal(s.gather(rows), init[rows])
        with pytest.raises(ValueError, match="unique"):
            s.scatter(torch.tensor([4, 2, 4]), torch.zeros(3, 3))
        s.scatter(torch.tensor([7, 2]), torch.ones(2, 3))  # unsorted but unique: fine
        init[[7, 2]] = 1
        assert torch.equal(s.read_all(), init)


def test_reopen_after_more_writes_and_flush(tmp_path):
    path = tmp_path / "r.bin"
    init = torch.randn(R, 512).to(torch.bfloat16)
    s = NvmeStore(path, R, 512, torch.bfloat16, create=True, init=init)
    s.scatter(torch.tensor([1, 2, 1000]), torch.zeros(3, 512))
    s.flush()
    s.flush()  # nothing new: no-op
    init[[1, 2, 1000]] = 0
    s.close()
    s.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        s.gather(torch.tensor([0]))
    assert s.nbytes() == 0
    with NvmeStore(path, R, 512, torch.bfloat16, create=False) as s2:
        assert torch.equal(s2.read_all(), init)
        assert s2.versions.sum() == 3 and s2.versions[[1, 2, 1000]].tolist() == [1, 1, 1]
        s2.scatter(torch.tensor([2]), torch.ones(1, 512))
    with NvmeStore(path, R, 512, torch.bfloat16, create=False) as s3:
        assert s3.versions[[1, 2, 1000]].tolist() == [1, 2, 1]
        assert torch.equal(s3.gather(torch.tensor([2]))[0], torch.ones(512, dtype=torch.bfloat16))


def test_create_overwrites_existing_file(tmp_path):
    path = tmp_path / "o.bin"
    with NvmeStore(path, R, 7, torch.float32, create=True, init=torch.ones(R, 7)) as s:
        s.scatter(torch.tensor([0]), torch.zeros(1, 7))
    with NvmeStore(path, 10, 2, torch.int64, create=True) as s:
        assert torch.equal(s.read_all(), torch.zeros(10, 2, dtype=torch.int64))
        assert s.versions.tolist() == [0] * 10


def test_dirty_file_detected(tmp_path):
    path, copy = tmp_path / "d.bin", tmp_path / "copy.bin"
    init = torch.randn(R, 7)
    s = NvmeStore(path, R, 7, torch.float32, create=True, init=init, block_rows=100)
    s.scatter(torch.tensor([10, 20]), torch.zeros(2, 7))
    s.flush()
    s.scatter(torch.tensor([20, 30]), torch.ones(2, 7))
    # a "crash" now: the data and the (older) versions file as they are on disk
    shutil.copyfile(path, copy)
    shutil.copyfile(str(path) + ".versions", str(copy) + ".versions")
    s.close()
    with pytest.raises(DirtyStoreError, match="dirty.*allow_dirty"):
        NvmeStore(copy, R, 7, torch.float32, create=False)
    with NvmeStore(copy, R, 7, torch.float32, create=False, allow_dirty=True) as d:
        assert d.opened_dirty
        assert d.gather(torch.tensor([20, 30])).eq(1).all()            # the unflushed data
        assert d.versions[[10, 20, 30]].tolist() == [1, 1, 0]          # versions lag it
    with NvmeStore(copy, R, 7, torch.float32, create=False) as c:     # accepted: clean now
        assert not c.opened_dirty and c.versions[[10, 20, 30]].tolist() == [1, 1, 0]
    with NvmeStore(path, R, 7, torch.float32, create=False) as c:
        assert c.versions[[10, 20, 30]].tolist() == [1, 2, 1]


def test_versions_file_problems(tmp_path):
    path = tmp_path / "s.bin"
    vpath = str(path) + ".versions"
    with NvmeStore(path, R, 7, torch.float32, create=True) as s:
        s.scatter(torch.tensor([1]), torch.ones(1, 7))
    old = open(vpath, "rb").read()
    with NvmeStore(path, R, 7, torch.float32, create=False) as s:
        s.scatter(torch.tensor([1]), torch.ones(1, 7))
    with open(vpath, "wb") as f:  # an older versions file next to newer data
        f.write(old)
    with pytest.raises(ValueError, match="stale"):
        NvmeStore(path, R, 7, torch.float32, create=False)
    with open(vpath, "r+b") as f:  # corrupted payload
        f.seek(40)
        f.write(b"\xff")
    with pytest.raises(ValueError, match="CRC"):
        NvmeStore(path, R, 7, torch.float32, create=False)
    os.unlink(vpath)
    with pytest.raises(FileNotFoundError, match="versions"):
        NvmeStore(path, R, 7, torch.float32, create=False)


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.bin"):
        NvmeStore(tmp_path / "nope.bin", R, 7, torch.float32, create=False)
    with pytest.raises(FileNotFoundError, match="no_such_dir"):
        NvmeStore(tmp_path / "no_such_dir" / "x.bin", R, 7, torch.float32, create=True)
    with pytest.raises(FileNotFoundError, match="no_such_dir"):
        NvmeStore(tmp_path / "no_such_dir" / "x.bin", R, 7, torch.float32, create=False)


def test_truncated_file(tmp_path):
    path = tmp_path / "t.bin"
    with NvmeStore(path, R, 7, torch.float32, create=True, block_rows=100) as s:
        full = s.file_bytes()
    os.truncate(path, full - 4096)
    with pytest.raises(ValueError, match=rf"t\.bin.*truncated.*expected {full} bytes, found {full - 4096}"):
        NvmeStore(path, R, 7, torch.float32, create=False)
    os.truncate(path, 100)  # not even a whole header
    with pytest.raises(ValueError, match="truncated"):
        NvmeStore(path, R, 7, torch.float32, create=False)
    # truncated while open: an error, not the op's abort
    path2 = tmp_path / "t2.bin"
    s = NvmeStore(path2, R, 7, torch.float32, create=True, block_rows=100)
    os.truncate(path2, 8192)
    with pytest.raises(ValueError, match="truncated"):
        s.gather(torch.tensor([1020]))
    with pytest.raises(ValueError, match="truncated"):
        s.scatter(torch.tensor([1020]), torch.zeros(1, 7))
    s.close()


def test_header_for_another_store(tmp_path):
    path = tmp_path / "f.bin"
    NvmeStore(path, R, 7, torch.float32, create=True, block_rows=100).close()
    with pytest.raises(ValueError) as e:
        NvmeStore(path, 1000, 8, torch.bfloat16, create=False)
    msg = str(e.value)
    for part in ["num_rows: expected 1000, found 1021", "width: expected 8, found 7",
                 "dtype: expected bfloat16, found float32"]:
        assert part in msg, msg
    with pytest.raises(ValueError, match="block_rows: expected 64, found 100"):
        NvmeStore(path, R, 7, torch.float32, create=False, block_rows=64)
    # created with intra_op_parallelism=1: 4 KiB alignment cannot serve 2 threads
    with pytest.raises(ValueError, match="intra_op_parallelism=2"):
        NvmeStore(path, R, 7, torch.float32, create=False, intra_op_parallelism=2)
    NvmeStore(path, R, 7, torch.float32, create=False, block_rows=100).close()


def test_not_a_bank_file(tmp_path):
    for name, data in [("garbage.bin", os.urandom(70000)), ("empty.bin", b""), ("short.bin", b"DSP")]:
        p = tmp_path / name
        p.write_bytes(data)
        with pytest.raises(ValueError, match="bad magic"):
            NvmeStore(p, R, 7, torch.float32, create=False)
    # right magic, damaged header fields
    path = tmp_path / "crc.bin"
    NvmeStore(path, R, 7, torch.float32, create=True).close()
    with open(path, "r+b") as f:
        f.seek(20)
        f.write(b"\x01")
    with pytest.raises(ValueError, match="corrupted header"):
        NvmeStore(path, R, 7, torch.float32, create=False)
    # a consistent header of an unknown future format version
    path = tmp_path / "ver.bin"
    NvmeStore(path, R, 7, torch.float32, create=True).close()
    raw = bytearray(open(path, "rb").read(nvme._HEADER.size))
    raw[8:12] = struct.pack("<I", 99)
    with open(path, "r+b") as f:
        f.write(raw + struct.pack("<I", zlib.crc32(bytes(raw))))
    with pytest.raises(ValueError, match="format version 99"):
        NvmeStore(path, R, 7, torch.float32, create=False)


def test_full_disk(tmp_path, monkeypatch):
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(10 ** 9, 10 ** 9 - 5000, 5000))
    path = tmp_path / "big.bin"
    with pytest.raises(OSError, match=r"not enough free disk space.*big\.bin.*needs \d+ bytes, 5000 bytes free"):
        NvmeStore(path, R, 512, torch.float32, create=True)
    assert not path.exists()


@pytest.mark.parametrize("engine", ["libaio", "deepspeed"])
def test_aio_unavailable(tmp_path, monkeypatch, engine):
    if engine == "deepspeed":
        monkeypatch.setattr(nvme, "_AIO_OP", None)
        monkeypatch.setattr(AsyncIOBuilder, "is_compatible", lambda self, verbose=False: False)
    else:
        monkeypatch.setattr(nvme, "_LIBAIO", None)
        monkeypatch.setattr(nvme, "_libaio_names", lambda: ["libaio-missing.so.1"])
    with pytest.raises(RuntimeError, match="libaio-dev"):
        NvmeStore(tmp_path / "a.bin", R, 7, torch.float32, create=True, io_engine=engine)
    assert not (tmp_path / "a.bin").exists()


def test_argument_validation(tmp_path):
    p = tmp_path / "arg.bin"
    bad = [
        (dict(num_rows=-1), ValueError, "num_rows"), (dict(num_rows=1.5), TypeError, "num_rows"),
        (dict(num_rows=True), TypeError, "num_rows"), (dict(width=-2), ValueError, "width"),
        (dict(dtype=torch.complex64), ValueError, "dtype"), (dict(dtype="float32"), TypeError, "dtype"),
        (dict(block_rows=0), ValueError, "block_rows"), (dict(intra_op_parallelism=0), ValueError,
                                                         "intra_op_parallelism"),
        (dict(queue_depth=0), ValueError, "queue_depth"), (dict(init=torch.zeros(3, 7)), ValueError, "init"),
        (dict(path=3), TypeError, "path"), (dict(io_engine="spdk"), ValueError, "io_engine"),
        (dict(coalesce_gap_bytes=-1), ValueError, "coalesce_gap_bytes"),
        (dict(max_request_bytes=0), ValueError, "max_request_bytes"),
    ]
    for change, exc, word in bad:
        kw = dict(path=p, num_rows=R, width=7, dtype=torch.float32)
        kw.update(change)
        with pytest.raises(exc, match=word):
            NvmeStore(kw.pop("path"), kw.pop("num_rows"), kw.pop("width"), kw.pop("dtype"), create=True, **kw)
    assert not p.exists()
    with NvmeStore(p, R, 7, torch.float32, create=True) as s:
        with pytest.raises(ValueError, match="rows must lie in"):
            s.gather(torch.tensor([R]))
        with pytest.raises(ValueError, match="rows must lie in"):
            s.scatter(torch.tensor([-1]), torch.zeros(1, 7))
        with pytest.raises(TypeError, match="rows"):
            s.gather(torch.tensor([1.0]))
        with pytest.raises(ValueError, match="values must have shape"):
            s.scatter(torch.tensor([1]), torch.zeros(1, 8))
        with pytest.raises(ValueError, match="values must have shape"):
            s.write_all(torch.zeros(R, 6))


def test_empty_store_and_memory_accounting(tmp_path):
    with NvmeStore(tmp_path / "e.bin", 0, 7, torch.float32, create=True) as s:
        assert s.read_all().shape == (0, 7) and s.gather(torch.empty(0, dtype=torch.int64)).shape == (0, 7)
        s.write_all(torch.zeros(0, 7))
    with NvmeStore(tmp_path / "e.bin", 0, 7, torch.float32, create=False) as s:
        assert s.versions.numel() == 0
    with NvmeStore(tmp_path / "m.bin", 4096, 512, torch.float32, create=True, stage_bytes=1 << 20) as s:
        # host memory: 1 MiB staging + one header buffer + versions, not the 8 MiB file
        assert s.file_bytes() == os.path.getsize(tmp_path / "m.bin") > 8 << 20
        assert s.nbytes() == (1 << 20) + 4096 + 8 * 4096


def test_throughput_report(tmp_path, capsys):
    """Printed, not asserted: a gather of 10% random rows of a 16 MiB store."""
    rows_n, width = 8192, 512
    init = torch.randn(rows_n, width)
    with NvmeStore(tmp_path / "p.bin", rows_n, width, torch.float32, create=True, init=init) as s:
        rows = torch.randperm(rows_n)[: rows_n // 10].sort().values
        t = time.perf_counter()
        got = s.gather(rows)
        tg = time.perf_counter() - t
        assert torch.equal(got, init[rows])
        t = time.perf_counter()
        s.scatter(rows, got)
        ts = time.perf_counter() - t
    with capsys.disabled():
        print(f"\n[nvme] 16 MiB store, {len(rows)} random rows of 2 KiB: gather {tg * 1e3:.1f} ms, "
              f"scatter {ts * 1e3:.1f} ms")


def test_locked_memory_limit(tmp_path, monkeypatch):
    """Without CAP_IPC_LOCK DeepSpeed's mlock failure would abort the process: with
    io_engine='deepspeed' the store shrinks its staging to RLIMIT_MEMLOCK, or refuses
    with an error. The libaio engine locks nothing (O_DIRECT needs aligned memory only)."""
    init = torch.randn(R, 7)
    monkeypatch.setattr(nvme, "_lock_budget", lambda: 6000)
    with NvmeStore(tmp_path / "free.bin", R, 7, torch.float32, create=True, init=init, block_rows=100) as s:
        assert s._stage_blocks == 11 and torch.equal(s.read_all(), init)
    monkeypatch.setattr(nvme, "_lock_budget", lambda: 4096 + 2 * 4096)
    with NvmeStore(tmp_path / "l.bin", R, 7, torch.float32, create=True, init=init, block_rows=100,
                   io_engine="deepspeed") as s:
        assert s._stage_blocks == 2 and s.nbytes() == 3 * 4096 + 8 * R
        rows = torch.arange(0, R, 3)
        s.scatter(rows, torch.zeros(len(rows), 7))
        init[rows] = 0
        assert torch.equal(s.read_all(), init)
    monkeypatch.setattr(nvme, "_lock_budget", lambda: 6000)
    with pytest.raises(RuntimeError, match="RLIMIT_MEMLOCK"):
        NvmeStore(tmp_path / "l2.bin", R, 7, torch.float32, create=True, block_rows=100, io_engine="deepspeed")
    assert not (tmp_path / "l2.bin").exists()
    with pytest.raises(RuntimeError, match="RLIMIT_MEMLOCK"):
        NvmeStore(tmp_path / "l.bin", R, 7, torch.float32, create=False, io_engine="deepspeed")


def test_rows_at_file_ends_and_odd_blocks_against_the_file(tmp_path):
    """First and last rows, the partial last block (phantom rows stay zero), padded
    blocks of odd row counts, tiny stages: the bytes on disk match a plain read."""
    gen = torch.Generator().manual_seed(7)
    for width, br, stage in [(7, 100, 4096), (7, 37, 3 * 4096), (300, 11, 1 << 20), (13, 1, 2 * 4096)]:
        path = tmp_path / f"e{width}-{br}.bin"
        ref = torch.randn(R, width, generator=gen)
        with NvmeStore(path, R, width, torch.float32, create=True, init=ref, block_rows=br, stage_bytes=stage) as s:
            for rows in ([0], [R - 1], [0, R - 1], [br - 1, br, R - 2], list(range(R - 25, R))):
                rows = torch.tensor(rows)
                assert torch.equal(s.gather(rows), ref[rows])
                vals = torch.randn(len(rows), width, generator=gen)
                s.scatter(rows, vals)
                ref[rows] = vals
            out = torch.empty(3, width)
            assert s.gather_into(torch.tensor([0, 5, R - 1]), out) is out       # straight into the buffer
            assert torch.equal(out, ref[[0, 5, R - 1]])
            assert torch.equal(s.gather_into(torch.tensor([1]), torch.empty(1, width, dtype=torch.float64)), ref[[1]])
        assert_file_holds(path, ref)


def test_requests_are_coalesced_batched_and_exact(tmp_path):
    """1 KiB rows, 4 per 4 KiB page, 16 per block of 4 pages (data from page 1): a gather
    reads the touched pages, joined across gaps of up to coalesce_gap_bytes, all of a
    batch issued together; a scatter writes exactly the pages it touches (after the
    dirty header) and first reads those it does not cover whole."""
    A = 4096
    ref = torch.randn(4096, 256)
    with NvmeStore(tmp_path / "c.bin", 4096, 256, torch.float32, create=True, init=ref, block_rows=16,
                   coalesce_gap_bytes=2 * A, stage_bytes=64 << 10) as s:
        trace = s.record_io()
        rows = torch.tensor([0, 1, 9, 21, 1000, 1001, 4095])          # pages 1, 1, 3, 6, 251, 251, 1024
        assert torch.equal(s.gather(rows), ref[rows])
        assert len(trace) == 1                                          # one batch: one group of requests
        write, off, size = trace[0]
        assert not write and off.tolist() == [A, 251 * A, 1024 * A] and size.tolist() == [6 * A, A, A]
        # 64 KiB of stage: two buffers of two blocks (8 pages); rows every other page
        trace.clear()
        rows = torch.arange(0, 4096, 8)
        assert torch.equal(s.gather(rows), ref[rows])
        offsets = np.concatenate([o for _, o, _ in trace])
        sizes = np.concatenate([z for _, _, z in trace])
        assert len(trace) == 1024 // 8 and all(not w for w, _, _ in trace)
        assert (sizes <= 8 * A).all() and sizes.sum() == 1023 * A            # every page, gaps included, once
        assert (np.diff(offsets) > 0).all() and (offsets % A == 0).all()
        # a scatter: page 2 covered whole (rows 4-7: not read), page 3 (row 8) and 11 (row 40) read first
        trace.clear()
        rows = torch.tensor([4, 5, 6, 7, 8, 40])
        vals = torch.randn(6, 256)
        s.scatter(rows, vals)
        ref[rows] = vals
        (w0, o0, z0), (w1, o1, z1), (w2, o2, z2) = trace
        assert w0 and o0.tolist() == [0] and z0.tolist() == [A]                # the dirty header first
        assert not w1 and o1.tolist() == [3 * A, 11 * A] and z1.tolist() == [A, A]
        assert w2 and o2.tolist() == [2 * A, 11 * A] and z2.tolist() == [2 * A, A]
        assert torch.equal(s.read_all(), ref)
        # requests are capped at max_request_bytes and written gaps only when asked for
    with NvmeStore(tmp_path / "c.bin", 4096, 256, torch.float32, create=False, coalesce_gap_bytes=2 * A,
                   coalesce_write_gap_bytes=2 * A, max_request_bytes=2 * A) as s:
        trace = s.record_io()
        rows = torch.tensor([8, 20])                                    # pages 3 and 6: read [3, 7)
        vals = torch.randn(2, 256)
        s.scatter(rows, vals)
        ref[rows] = vals
        (_, _, _), (w1, o1, z1), (w2, o2, z2) = trace
        assert not w1 and o1.tolist() == [3 * A, 5 * A] and z1.tolist() == [2 * A, 2 * A]
        assert w2 and o2.tolist() == [3 * A, 5 * A] and z2.tolist() == [2 * A, 2 * A]
        assert s.io_stats()["write_bytes"] == A + 4 * A and s.io_stats()["coalesce_write_gap_bytes"] == 2 * A
    assert_file_holds(tmp_path / "c.bin", ref)


def test_failed_requests_are_reported(tmp_path):
    """DeepSpeed's op never checks a completion's result; the libaio engine reports a
    short read (past the end of the file) and a rejected request, and the store goes on."""
    init = torch.randn(R, 7)
    with NvmeStore(tmp_path / "f.bin", R, 7, torch.float32, create=True, init=init) as s:
        engine, size, zero = s._engine, s.file_bytes(), np.zeros(1, dtype=np.int64)
        with pytest.raises(OSError, match="short read"):
            engine.wait(engine.start(False, s._stage, zero, np.array([size]), np.array([4096])))
        with pytest.raises(OSError, match="Invalid argument"):                 # misaligned for O_DIRECT
            engine.wait(engine.start(False, s._stage, zero, np.array([100]), np.array([4096])))
        with pytest.raises(OSError, match="Invalid argument"):
            engine.wait(engine.start(True, s._stage, zero, np.array([4096]), np.array([100])))
        assert torch.equal(s.gather(torch.tensor([0, R - 1])), init[[0, R - 1]])
    assert_file_holds(tmp_path / "f.bin", init)


def test_benchmark_smoke(tmp_path, capsys, monkeypatch):
    """ds_pfc.bench.nvme at a tiny size: raw requests, store gathers and scatters,
    sequential transfers, next to fio when it is installed (n/a otherwise)."""
    from ds_pfc.bench import nvme as bench
    out = tmp_path / "nvme.json"
    args = ["--dir", str(tmp_path), "--file-gb", "0.004", "--block-kib", "4", "--requests", "64",
            "--rw", "read", "--raw-engines", "libaio", "--rates", "0.01", "--repeats", "1", "--json", str(out)]
    assert bench.main(args) == 0
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "nvme" and doc["config"]["queue_depth"] == 32 and "date" in doc and "machine" in doc
    parts = {r["part"] for r in doc["results"]}
    assert parts == {"fill", "raw", "store", "sequential"}
    store = [r for r in doc["results"] if r["part"] == "store"]
    assert {r["op"] for r in store} == {"gather", "scatter"} and all(r["requests"] > 0 for r in store)
    if bench.fio_binary() is not None:
        assert all(r["ratio_to_fio"] > 0 for r in doc["results"] if r["part"] in ("raw", "store", "sequential"))
    assert sorted(os.listdir(tmp_path)) == ["nvme.json"]                   # the scratch file is gone
    monkeypatch.setattr(bench, "fio_binary", lambda: None)
    assert bench.main(args[:-2] + ["--parts", "store", "--json", str(out)]) == 0
    assert "fio not found on PATH: the floor is n/a" in capsys.readouterr().out
    assert all(r["ratio_to_fio"] is None for r in json.loads(out.read_text())["results"] if r["part"] == "store")


@pytest.mark.parametrize("width,dtype,share,write_gap", [
    (128, torch.bfloat16, 0.02, 0),      # 256 B rows, 16 per page
    (256, torch.float32, 0.05, 0),       # 1 KiB rows, 4 per page
    (512, torch.float32, 0.3, 0),        # 2 KiB rows: pages covered whole occur
    (96, torch.float32, 0.03, 0),        # 384 B rows straddle pages
    (256, torch.bfloat16, 0.05, 8192),   # written gaps
], ids=lambda v: str(v).replace("torch.", ""))
def test_page_io_model_counts_what_the_store_reads_and_writes(tmp_path, width, dtype, share, write_gap):
    """ds_pfc.bank.nvme_model (the planner's NVMe figures and the bank's refusal of a
    per-step NVMe tier) against the store's own I/O counters: random gathers and scatters
    of ``share`` of the rows, bytes read and written within 4% of the model's expectation."""
    from ds_pfc.bank.nvme_model import page_io
    n, trials = 24_576, 6
    g = torch.Generator().manual_seed(width + int(share * 100))
    with NvmeStore(tmp_path / "m.bin", n, width, dtype, create=True, coalesce_write_gap_bytes=write_gap) as s:
        s.scatter(torch.tensor([0]), torch.zeros(1, width, dtype=dtype))     # the dirty header is written once
        m = int(share * n)
        read_g = read_s = written = 0
        for _ in range(trials):
            rows = torch.randperm(n, generator=g)[:m].sort().values
            before = s.io_stats()
            s.gather(rows)
            mid = s.io_stats()
            s.scatter(rows, torch.zeros(m, width, dtype=dtype))
            after = s.io_stats()
            read_g += mid["read_bytes"] - before["read_bytes"]
            read_s += after["read_bytes"] - mid["read_bytes"]
            written += after["write_bytes"] - mid["write_bytes"]
        rb = width * torch.empty((), dtype=dtype).element_size()
        model = page_io(rb, n, m, m, write_gap_bytes=write_gap)
    for measured, key in ((read_g, "read_gather"), (read_s, "read_scatter"), (written, "write")):
        expected = trials * model[key]
        assert measured == pytest.approx(expected, rel=0.04, abs=trials * 4096 * 8), (key, measured, expected)
