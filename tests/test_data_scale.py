"""RecordIO at scale (``ds_pfc.data.recordio``): start-up without a read of every
record, the index cache, dataset directories, the default loader workers.

Files come from ``_recordio_writers`` (insightface's header/identity layout and
``im2rec``'s, written with ``struct.pack`` from the format description); expected
labels are the class ids the tests hand to the writers, and the reads a start-up
makes are counted on the reader's only file access, ``RecordIOReader._pread``.
"""
from __future__ import annotations

import os
import threading
import time

import pytest
from pathlib import Path
import torch

from _recordio_writers import fake_image, header_layout, ir_pack, write_property, write_rec
from ds_pfc.data import recordio
from ds_pfc.data.loader import default_workers
from ds_pfc.data.recordio import InsightFaceRecord, RecordIOReader


@pytest.fixture
def preads(monkeypatch):
    """Every ``_pread`` of every reader: a list of (size, offset)."""
    calls = []
    real = RecordIOReader._pread

    def counted(self, size, offset):
        calls.append((size, offset))
        return real(self, size, offset)

    monkeypatch.setattr(RecordIOReader, "_pread", counted)
    return calls


def _sizes(num_classes: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(1, 6, (num_classes,), generator=g)).tolist()


def test_header_layout_labels_without_reading_every_record(tmp_path, preads):
    sizes = _sizes(700)
    records, expect, (a, b) = header_layout(sizes)
    rec, idx, offsets = write_rec(tmp_path, records)
    write_property(tmp_path, len(sizes))
    ds = InsightFaceRecord(tmp_path, cache=False)          # the dataset directory
    labels = ds.labels()
    assert labels.tolist() == [cls for _, cls in expect]
    assert ds.num_classes == len(sizes) == b - a
    assert ds.label_source.startswith("the header's")
    # A full scan reads every image header once; this start-up reads the header
    # record, the identity records in one block and at most 128 image headers.
    image_starts = {offsets[k] for k in range(1, a)}
    touched = {off for _, off in preads if off in image_starts}
    assert len(touched) <= 128 < len(expect) // 10
    assert len(preads) <= 3 * 128 + 10
    # Same answer as the full scan of the same file.
    assert torch.equal(labels, ds._scan_labels())
    assert ds[5][1] == expect[5][1] and ds[5][0] == expect[5][0]


def test_header_layout_with_sparse_class_ids_falls_back_to_the_scan(tmp_path):
    sizes = [2, 3, 1, 4]
    ids = [3, 10, 11, 40]
    records, expect, _ = header_layout(sizes, class_ids=ids)
    write_rec(tmp_path, records)
    ds = InsightFaceRecord(tmp_path / "train.rec", cache=False)
    assert ds.labels().tolist() == [cls for _, cls in expect]
    with pytest.warns(UserWarning, match="declares 4 classes but the largest label is 40"):
        assert ds.num_classes == 41
    assert "every record header" in ds.label_source


def test_identity_ranges_that_contradict_the_labels_fall_back_to_the_scan(tmp_path):
    # Identity records claim [1, 3) and [3, 5), the images alternate classes 1, 0, 1, 0.
    records = [(0, ir_pack([5.0, 7.0]))] + [(k, ir_pack(float(k % 2), fake_image(k))) for k in range(1, 5)] \
        + [(5, ir_pack([1.0, 3.0])), (6, ir_pack([3.0, 5.0]))]
    write_rec(tmp_path, records)
    ds = InsightFaceRecord(tmp_path, cache=False)
    assert ds.labels().tolist() == [1, 0, 1, 0]
    assert "do not follow the identity records" in ds.label_source


def _im2rec(tmp_path, labels):
    records = [(k, ir_pack(float(c), fake_image(k), id1=k)) for k, c in enumerate(labels)]
    return write_rec(tmp_path, records)


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    """Index caches of these tests go to their own directory (the default: DS_PFC_CACHE_DIR)."""
    monkeypatch.setenv("DS_PFC_CACHE_DIR", str(tmp_path / "index-cache"))


def _cache_file(rec) -> str:
    return InsightFaceRecord(rec, cache=True)._cache.path


def test_index_cache_written_once_reused_and_rebuilt(tmp_path, preads):
    labels = [(k * 7) % 13 for k in range(200)]
    rec, idx, _ = _im2rec(tmp_path, labels)
    first = InsightFaceRecord(rec)
    assert first.labels().tolist() == labels
    assert "every record header" in first.label_source
    cache = Path(first._cache.path)
    assert cache.parent == tmp_path / "index-cache" and cache.name.endswith("-train.rec.ds_pfc-index.pt")
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == ["train.idx", "train.rec"]   # data untouched
    assert cache.is_file() and not os.path.exists(str(cache) + ".lock")
    stamp = cache.stat().st_mtime_ns

    preads.clear()
    again = InsightFaceRecord(rec)
    assert again.labels().tolist() == labels and again.num_classes == 13
    assert again.label_source.startswith("index cache")
    assert len(preads) <= 2                              # record 0, to tell the layout
    assert again.reader.offset(150) == first.reader.offset(150)
    assert cache.stat().st_mtime_ns == stamp             # read, not written again

    changed = [(k * 5) % 17 for k in range(201)]
    time.sleep(0.01)
    _im2rec(tmp_path, changed)                            # a new .rec and .idx
    rebuilt = InsightFaceRecord(rec)
    assert rebuilt.labels().tolist() == changed
    assert "every record header" in rebuilt.label_source
    assert InsightFaceRecord(rec).label_source.startswith("index cache")


def test_index_cache_goes_to_the_given_cache_dir_never_beside_the_data(tmp_path):
    data, cache_dir = tmp_path / "data", tmp_path / "cache"
    data.mkdir()
    labels = [k % 3 for k in range(20)]
    rec, _, _ = _im2rec(data, labels)
    assert InsightFaceRecord(rec, cache_dir=cache_dir).labels().tolist() == labels
    assert sorted(os.listdir(data)) == ["train.idx", "train.rec"]
    written = os.listdir(cache_dir)
    assert len(written) == 1 and written[0].endswith("train.rec.ds_pfc-index.pt")
    assert InsightFaceRecord(rec, cache_dir=cache_dir).label_source.startswith("index cache")


def test_second_process_waits_for_the_writer_and_reads_its_cache(tmp_path, preads):
    labels = [(k * 3) % 11 for k in range(120)]
    rec, _, _ = _im2rec(tmp_path, labels)
    writer, waiter = InsightFaceRecord(rec), InsightFaceRecord(rec)
    assert writer._cache.acquire()                       # the writer holds the lock first
    got = {}
    thread = threading.Thread(target=lambda: got.update(labels=waiter.labels()))
    thread.start()
    time.sleep(0.3)
    assert thread.is_alive()                             # waiting, not scanning
    preads.clear()
    assert writer.labels().tolist() == labels            # scans, writes, releases
    scans = len(preads)
    thread.join(10)
    assert got["labels"].tolist() == labels
    assert "written by another process" in waiter.label_source
    assert scans >= len(labels) and len(preads) == scans  # the waiter read no record


def test_directory_path_and_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"lacks 'train\.rec', 'train\.idx'.*holds nothing"):
        InsightFaceRecord(tmp_path)
    (tmp_path / "train.rec").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"lacks 'train\.idx' \(expected train\.rec, train\.idx"):
        InsightFaceRecord(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"not found: .*other\.rec.*other\.idx"):
        InsightFaceRecord(tmp_path / "other.rec")


def test_unordered_index_keys_are_found(tmp_path):
    labels = [k % 4 for k in range(30)]
    records = [(k, ir_pack(float(c), fake_image(k))) for k, c in enumerate(labels)]
    order = list(range(29, -1, -1))
    write_rec(tmp_path, records, idx_order=order)
    ds = InsightFaceRecord(tmp_path, cache=False)
    assert ds.reader.keys == order
    assert ds.labels().tolist() == [labels[k] for k in order]
    assert 31 not in ds.reader and 7 in ds.reader


@pytest.mark.parametrize("cpus,env,expect", [(2, {}, 1), (16, {"LOCAL_WORLD_SIZE": "4"}, 3),
                                             (64, {}, 8), (16, {"LOCAL_SIZE": "8"}, 1), (96, {"LOCAL_SIZE": "8"}, 8)])
def test_default_workers(cpus, env, expect):
    assert default_workers(env, cpus=cpus) == expect


def test_config_workers_auto_and_bad_values():
    from ds_pfc.app.config import ConfigError, DataConfig
    assert DataConfig().workers == "auto" and DataConfig(workers=3).workers == 3
    for bad in ("many", -1, True, 1.5):
        with pytest.raises(ConfigError, match=r"ds_pfc\.data\.workers must be an integer >= 0 or \"auto\""):
            DataConfig(workers=bad)


def _round_like_float32(v: float, exact: int) -> float:
    """``v`` rounded as a float32 rounds integers past ``2**24``, with ``exact`` in
    place of ``2**24`` (step 2 up to ``2 * exact``, 4 up to ``4 * exact``, ...;
    ties to even)."""
    step = 1
    while v >= exact * step:
        step *= 2
    return float(round(v / step) * step)


def test_header_layout_past_float32_precision(tmp_path, monkeypatch, preads):
    # Past 2**24 images insightface's float32 header and identity ranges are rounded.
    # With the threshold lowered to 64, ~400 images exercise steps of 2, 4 and 8.
    exact = 64
    monkeypatch.setattr(recordio, "_FLOAT32_EXACT", exact)
    sizes = [9 + (7 * g) % 11 for g in range(30)]
    records, expect, (a, b) = header_layout(sizes)
    rounded = []
    for key, payload in records:
        if key == 0 or key >= a:                       # header and identity records
            flag = int.from_bytes(payload[:4], "little")
            values = torch.tensor(list(torch.frombuffer(bytearray(payload[24:24 + 4 * flag]), dtype=torch.float32)))
            payload = ir_pack([_round_like_float32(float(v), exact) for v in values])
        rounded.append((key, payload))
    assert _round_like_float32(float(a), exact) != a   # the header itself is off
    rec, idx, offsets = write_rec(tmp_path, rounded)
    ds = InsightFaceRecord(tmp_path, cache=False)
    assert ds.header == (a, b) and len(ds) == a - 1
    preads.clear()
    assert ds.labels().tolist() == [cls for _, cls in expect]
    image_starts = {offsets[k] for k in range(1, a)}
    assert len({off for _, off in preads if off in image_starts}) < (a - 1) // 2   # not a scan
    assert ds.label_source.startswith("the header's")
    assert torch.equal(ds.labels(), ds._scan_labels())


def test_lock_left_by_a_dead_process_is_taken_over(tmp_path):
    import socket
    import subprocess
    import sys
    labels = [k % 5 for k in range(40)]
    rec, _, _ = _im2rec(tmp_path, labels)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    lock = Path(_cache_file(rec) + ".lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.write_text(f"{socket.gethostname()} {int(dead.stdout)}\n")
    start = time.monotonic()
    ds = InsightFaceRecord(rec)
    assert ds.labels().tolist() == labels and time.monotonic() - start < 5
    assert "every record header" in ds.label_source
    assert os.path.isfile(_cache_file(rec)) and not lock.exists()


def test_train_app_indexes_into_its_output_dir_or_the_cache_dir_and_says_so(tmp_path, monkeypatch):
    """The training app's RecordIO set: the index cache goes under <output_dir>/cache (or
    DS_PFC_CACHE_DIR), never into the dataset's directory, and the phase is announced with
    its duration."""
    from ds_pfc.app.config import split_config
    from ds_pfc.app.datasets import build_train_set
    data = tmp_path / "data"
    data.mkdir()
    labels = [k % 4 for k in range(30)]
    rec, _, _ = _im2rec(data, labels)
    out = tmp_path / "run"
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "ds_pfc": {"head": {"num_classes": 4}, "data": {"source": "recordio", "path": str(rec)},
                         "train": {"output_dir": str(out)}}}
    _, cfg = split_config(config)
    monkeypatch.delenv("DS_PFC_CACHE_DIR")
    lines = []
    assert build_train_set(cfg, log=lines.append).labels().tolist() == labels
    assert sorted(os.listdir(data)) == ["train.idx", "train.rec"]
    cached = os.listdir(out / "cache")
    assert len(cached) == 1 and cached[0].endswith("train.rec.ds_pfc-index.pt")
    assert len(lines) == 2 and str(out / "cache") in lines[0] and "30 images indexed in" in lines[1]
    assert "every record header" in lines[1]
    lines.clear()
    build_train_set(cfg, log=lines.append)
    assert "index cache" in lines[1]                        # the second run reads it
    monkeypatch.setenv("DS_PFC_CACHE_DIR", str(tmp_path / "shared"))
    build_train_set(cfg)
    assert len(os.listdir(tmp_path / "shared")) == 1
