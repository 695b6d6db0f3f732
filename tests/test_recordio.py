"""Insightface RecordIO reader (``ds_pfc.data.recordio``).

The ``.rec``/``.idx`` files come from ``_recordio_writers``, written with
``struct.pack`` straight from the format description and sharing no code with the
reader; expectations come from the lists the tests hand to the writers. Sizes are
deliberately odd.
"""
from __future__ import annotations

import os
import pickle
import struct
import warnings

import pytest
import torch

from _recordio_writers import (MAGIC_LE, fake_image, fake_png, header_layout, im2rec_pack_label, ir_pack,
                               physical, write_property, write_rec)
from ds_pfc.data.recordio import InsightFaceRecord, RecordIOReader, unpack_header

# -- layouts ------------------------------------------------------------------------
@pytest.mark.parametrize("array_labels", [False, True], ids=["scalar", "array"])
def test_header_layout(tmp_path, array_labels):
    class_sizes = [3, 1, 5, 2, 7, 1, 4]
    records, expect, (a, b) = header_layout(class_sizes, array_labels)
    rec, idx, offsets = write_rec(tmp_path, records)
    ds = InsightFaceRecord(rec, idx)
    assert ds.header == (a, b)
    assert len(ds) == a - 1 == sum(class_sizes)
    assert ds.num_classes == b - a == len(class_sizes)
    assert [ds[i] for i in range(len(ds))] == expect
    assert ds.labels().tolist() == [c for _, c in expect]
    assert ds.labels().dtype == torch.int64
    with pytest.raises(IndexError):
        ds[len(ds)]
    # the identity records are there and readable, just not items
    flag, label, _, _, rest = unpack_header(ds.reader.read(a + 2))
    assert (flag, rest) == (2, b"") and label == (5.0, 10.0)
    # and some image records (keys 3, 6, .., 21) really were split by the writer
    raw = open(rec, "rb").read()
    assert sum(struct.unpack_from("<I", raw, off + 4)[0] >> 29 == 1 for off in offsets.values()) == 7


def test_im2rec_layout_no_header(tmp_path):
    labels = [4, 0, 0, 9, 2, 4, 1, 7, 3, 3, 0]
    keys = [5, 0, 3, 8, 1, 2, 10, 4, 6, 9, 7]  # .lst indices, in file order
    records = [(k, ir_pack(float(c), fake_image(k), id1=k)) for k, c in zip(keys, labels)]
    rec, idx, _ = write_rec(tmp_path, records, idx_order=list(reversed(keys)))
    ds = InsightFaceRecord(rec)  # idx path derived from the rec path
    assert ds.header is None and len(ds) == len(keys)
    order = list(reversed(keys))  # items follow the .idx order
    assert [ds.key(i) for i in range(len(ds))] == order
    by_key = dict(zip(keys, labels))
    assert [ds[i] for i in range(len(ds))] == [(fake_image(k), by_key[k]) for k in order]
    assert ds.labels().tolist() == [by_key[k] for k in order]
    assert ds.num_classes == max(labels) + 1


def test_im2rec_array_labels_without_key0(tmp_path):
    # multi-label im2rec output whose keys start at 1: no header to look for
    records = [(k, ir_pack([float(k % 4), 0.5], fake_image(k))) for k in range(1, 8)]
    rec, idx, _ = write_rec(tmp_path, records)
    ds = InsightFaceRecord(rec, idx)
    assert ds.header is None and len(ds) == 7
    assert ds[2] == (fake_image(3), 3)
    assert ds.num_classes == 4


# -- num_classes against the declared counts ------------------------------------------
@pytest.mark.parametrize("class_ids", [
    [1, 2, 3, 4, 5, 6, 7],       # face2rec-style, numbered from 1
    [0, 3, 4, 9, 10, 17],        # sparse: only increasing
    [2, 5, 6, 1000],             # one far-off class
], ids=["one-based", "sparse", "far"])
def test_num_classes_covers_largest_label(tmp_path, class_ids):
    class_sizes = [3, 1, 4, 2, 1, 5, 2][:len(class_ids)]
    records, _, (a, b) = header_layout(class_sizes, class_ids=class_ids)
    rec, idx, _ = write_rec(tmp_path, records)
    write_property(tmp_path, len(class_ids))  # what the writers record: one class per identity
    expected_labels = [c for c, n in zip(class_ids, class_sizes) for _ in range(n)]
    ds = InsightFaceRecord(rec, idx)
    assert ds.header == (a, b) and b - a == len(class_ids) < max(class_ids) + 1
    assert len(ds) == sum(class_sizes)
    assert [ds[i][1] for i in range(len(ds))] == expected_labels
    assert ds.labels().tolist() == expected_labels
    with pytest.warns(UserWarning) as caught:
        assert ds.num_classes == max(class_ids) + 1
    messages = [str(w.message) for w in caught]
    assert any("property" in m and f"declares {len(class_ids)} classes" in m for m in messages)
    assert any(f"[{a}, {b}]" in m for m in messages)
    assert all(f"largest label is {max(class_ids)}" in m for m in messages)
    # cached: no second warning, and every label fits a head of that size
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ds.num_classes == max(class_ids) + 1
    assert int(ds.labels().max()) < ds.num_classes


@pytest.mark.parametrize("declared", [None, 5, 9], ids=["no-property", "property-exact", "property-larger"])
def test_num_classes_when_declared_counts_agree(tmp_path, declared):
    class_sizes = [2, 3, 1, 2, 4]
    records, expect, _ = header_layout(class_sizes)
    rec, idx, _ = write_rec(tmp_path, records)
    if declared is not None:
        write_property(tmp_path, declared)
    ds = InsightFaceRecord(rec, idx)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ds.num_classes == len(class_sizes)  # classes 0..4 hold images; a larger declared count is no error
    assert ds.labels().tolist() == [c for _, c in expect]


def test_unreadable_property_is_ignored(tmp_path):
    records, _, _ = header_layout([1, 2, 2])
    rec, idx, _ = write_rec(tmp_path, records)
    (tmp_path / "property").write_text("classes: many\n")
    ds = InsightFaceRecord(rec, idx)
    with pytest.warns(UserWarning, match=r"property'.*num_classes,height,width.*ignoring it"):
        assert ds.num_classes == 3


# -- record 0: header or image --------------------------------------------------------
@pytest.mark.parametrize("first_labels", [[3, 8], [1, 1], [0, 4], [6, 2]])
@pytest.mark.parametrize("image", [fake_image, fake_png], ids=["jpeg", "png"])
def test_im2rec_pack_label_numbered_from_zero(tmp_path, first_labels, image):
    # im2rec --pack-label from a .lst numbered from 0 with two integer label columns:
    # record 0 has flag=2 and a label that can read like [A, B], but carries an image.
    lst = [(0, first_labels, image(0))] + [(i, [(5 * i) % 11, i % 3], image(i)) for i in range(1, 12)]
    rec, idx, _ = write_rec(tmp_path, im2rec_pack_label(lst), name="packed")
    write_property(tmp_path, 4)  # a stray property file is only checked against, never trusted
    ds = InsightFaceRecord(rec, idx)
    assert ds.header is None
    assert len(ds) == len(lst)
    assert [ds.key(i) for i in range(len(ds))] == [index for index, _, _ in lst]
    assert [ds[i] for i in range(len(ds))] == [(img, labels[0]) for _, labels, img in lst]
    assert ds.labels().tolist() == [labels[0] for _, labels, _ in lst]
    with pytest.warns(UserWarning, match=r"property' declares 4 classes"):
        assert ds.num_classes == max(labels[0] for _, labels, _ in lst) + 1


def _pack_label_with_empty_first_image(num_lines):
    # an im2rec --pack-label list whose first image file is empty: record 0 then has
    # flag=2, label [3, 5] and no image bytes, just like a header
    lst = [(0, [3, 5], b"")] + [(i, [i % 4, 1], fake_image(i)) for i in range(1, num_lines)]
    return im2rec_pack_label(lst)


@pytest.mark.parametrize("case", ["keys-past-B", "image-at-identity-key", "image-key-missing", "three-labels"])
def test_ambiguous_record0_is_refused(tmp_path, case):
    if case == "keys-past-B":
        records = _pack_label_with_empty_first_image(10)  # keys 5..9 lie past B = 5
        why = r"5 key\(s\) lie outside 0\.\.4, the first being 5"
    elif case == "image-at-identity-key":
        records = _pack_label_with_empty_first_image(5)  # keys 0..4, but key 3 is an image
        why = r"record 3 should be an identity record \(flag=2, no image bytes\) and has flag=2 with \d+ image bytes"
    elif case == "image-key-missing":
        records, _, _ = header_layout([3, 2, 4])
        records = [r for r in records if r[0] != 4]  # a hole inside 1..A-1, not at its end
        why = r"images are keys 1\.\.9 but key 4 is not in the index \(1 of those 9 keys are missing\)"
    else:
        records = [(0, ir_pack([3.0, 5.0, 1.0]))] + [(k, ir_pack(float(k), fake_image(k))) for k in range(1, 5)]
        why = r"so it is not an image record.*layout of this file is unknown"
    rec, idx, _ = write_rec(tmp_path, records, name="ambiguous")
    with pytest.raises(ValueError, match=r"ambiguous\.rec': record 0 has flag=\d.*no image bytes.*" + why):
        InsightFaceRecord(rec, idx)


def test_decode_callable_and_dataloader(tmp_path):
    records, expect, _ = header_layout([2, 3, 1])
    rec, idx, _ = write_rec(tmp_path, records)
    calls = []

    def decode(buf: bytes) -> torch.Tensor:
        calls.append(len(buf))
        return torch.tensor([len(buf), buf[-1]])

    ds = InsightFaceRecord(rec, idx, decode=decode)
    img, label = ds[4]
    assert img.tolist() == [len(expect[4][0]), expect[4][0][-1]] and label == expect[4][1]
    calls.clear()
    ds.labels()
    assert calls == []  # labels() never decodes
    batches = list(torch.utils.data.DataLoader(ds, batch_size=4))
    assert torch.cat([y for _, y in batches]).tolist() == [c for _, c in expect]
    # picklable for spawned DataLoader workers: the descriptor is reopened lazily
    clone = pickle.loads(pickle.dumps(InsightFaceRecord(rec, idx)))
    assert [clone[i] for i in range(len(clone))] == expect


def test_labels_reads_headers_only(tmp_path, monkeypatch):
    big = [(0, ir_pack([5.0, 7.0]))] + [(k, ir_pack(float(k % 2), bytes(1001 + k))) for k in range(1, 5)] \
        + [(5, ir_pack([1.0, 3.0])), (6, ir_pack([3.0, 5.0]))]
    rec, idx, _ = write_rec(tmp_path, big)
    ds = InsightFaceRecord(rec, idx)
    read = []
    real = ds.reader._pread
    monkeypatch.setattr(ds.reader, "_pread", lambda n, off: read.append(n) or real(n, off))
    assert ds.labels().tolist() == [1, 0, 1, 0]
    assert sum(read) < 4 * 200  # the ~1000-byte images were not read


# -- physical records -----------------------------------------------------------------
@pytest.mark.parametrize("payload", [
    b"",
    b"a",
    b"abcde",
    MAGIC_LE,                                     # whole payload is the magic: two empty parts
    MAGIC_LE + b"xyz",                            # magic at offset 0: empty first part
    b"0123" + MAGIC_LE + MAGIC_LE + b"4567",      # adjacent magics: empty middle part
    b"0123456" + MAGIC_LE[:1] + MAGIC_LE[1:] + b"89abcdef" + MAGIC_LE,  # aligned at 8, trailing at 20
    b"01" + MAGIC_LE + b"3",                      # unaligned magic: stays inline, no split
    bytes(range(37)) + MAGIC_LE + bytes(13),
], ids=["empty", "one", "odd", "only-magic", "magic-first", "adjacent", "aligned-and-last", "unaligned", "long"])
def test_split_records_round_trip(tmp_path, payload):
    before, after = b"\x01\x02\x03", b"\x09" * 6  # neighbours with odd sizes
    rec, idx, offsets = write_rec(tmp_path, [(0, before), (1, payload), (2, after)])
    raw = open(rec, "rb").read()
    # the test writer really produced split parts when a magic sits at an aligned offset
    aligned = any(payload[i:i + 4] == MAGIC_LE for i in range(0, len(payload) - 3, 4))
    cflag0 = struct.unpack_from("<I", raw, offsets[1] + 4)[0] >> 29
    assert cflag0 == (1 if aligned else 0)
    r = RecordIOReader(rec, idx)
    assert len(r) == 3 and r.keys == [0, 1, 2]
    assert r.read(1) == payload
    assert r.read(0) == before and r.read(2) == after


def test_split_record_with_cflags_1_2_3(tmp_path):
    payload = ir_pack(7.0, b"AB" + b"\0\0" + b"ijkl" + MAGIC_LE + b"mnop" + MAGIC_LE + b"qrs")
    rec, idx, offsets = write_rec(tmp_path, [(0, payload)])
    raw = open(rec, "rb").read()
    flags, pos = [], 0
    while pos < len(raw):
        magic, lrec = struct.unpack_from("<II", raw, pos)
        assert magic == 0xCED7230A
        flags.append(lrec >> 29)
        pos += 8 + ((lrec & (2 ** 29 - 1)) + 3) // 4 * 4
    assert flags == [1, 2, 3]
    ds = InsightFaceRecord(rec, idx)
    assert ds[0] == (b"AB\0\0ijkl" + MAGIC_LE + b"mnop" + MAGIC_LE + b"qrs", 7)
    assert ds.labels().tolist() == [7]


# -- IRHeader -------------------------------------------------------------------------
def test_unpack_header():
    flag, label, id1, id2, rest = unpack_header(ir_pack(3.0, b"img", id1=2 ** 40 + 3, id2=5))
    assert (flag, label, id1, id2, rest) == (0, 3.0, 2 ** 40 + 3, 5, b"img")
    flag, label, _, _, rest = unpack_header(ir_pack([1.5, 2.0, 360231.0], b"\xff"))
    assert (flag, label, rest) == (3, (1.5, 2.0, 360231.0), b"\xff")
    assert unpack_header(ir_pack([4.0, 9.0]))[4] == b""
    with pytest.raises(ValueError, match="24-byte IRHeader"):
        unpack_header(b"\0" * 23)
    with pytest.raises(ValueError, match="flag=3"):
        unpack_header(struct.pack("<IfQQ", 3, 0.0, 0, 0) + b"\0" * 11)


# -- errors ---------------------------------------------------------------------------
def test_missing_files(tmp_path):
    rec, idx, _ = write_rec(tmp_path, [(0, ir_pack(1.0, b"x"))])
    with pytest.raises(FileNotFoundError, match="nope.idx"):
        RecordIOReader(rec, str(tmp_path / "nope.idx"))
    os.remove(idx)
    with pytest.raises(FileNotFoundError, match=r"train\.idx"):
        InsightFaceRecord(rec)
    with pytest.raises(FileNotFoundError, match="missing.rec"):
        RecordIOReader(str(tmp_path / "missing.rec"), idx)


def test_bad_magic_names_path_and_offset(tmp_path):
    rec, idx, offsets = write_rec(tmp_path, [(0, ir_pack(1.0, b"abcdefgh")), (1, ir_pack(2.0, b"z"))])
    (tmp_path / "shifted.idx").write_text(f"0\t{offsets[0]}\n1\t{offsets[1] + 4}\n")
    r = RecordIOReader(rec, str(tmp_path / "shifted.idx"))
    with pytest.raises(ValueError, match=rf"train\.rec.*bad magic.*key 1 at byte offset {offsets[1] + 4}"):
        r.read(1)
    raw = bytearray(open(rec, "rb").read())
    raw[0:4] = struct.pack("<I", 0x3ED7230A)
    open(rec, "wb").write(bytes(raw))
    with pytest.raises(ValueError, match="old dmlc"):
        RecordIOReader(rec, idx).read(0)


def test_truncated(tmp_path):
    payload = ir_pack(1.0, bytes(range(41)))
    rec, idx, _ = write_rec(tmp_path, [(0, payload)])
    raw = open(rec, "rb").read()
    open(rec, "wb").write(raw[:-7])  # cut into the payload
    with pytest.raises(ValueError, match=r"truncated record for key 0 at byte offset 0.*65 payload bytes"):
        RecordIOReader(rec, idx).read(0)
    open(rec, "wb").write(raw[:5])  # cut into the 8-byte header
    with pytest.raises(ValueError, match="truncated record header for key 0"):
        RecordIOReader(rec, idx).read(0)
    with pytest.raises(ValueError, match="truncated record header"):
        InsightFaceRecord(rec, idx)
    # a split record whose later part is missing
    split = ir_pack(1.0, b"abcd" + MAGIC_LE + b"efgh")
    rec, idx, _ = write_rec(tmp_path, [(0, split)], name="split")
    raw = open(rec, "rb").read()
    open(rec, "wb").write(raw[:8 + 28])  # only the first part
    with pytest.raises(ValueError, match="truncated record header for key 0 at byte offset 36"):
        RecordIOReader(rec, idx).read(0)


def test_broken_split_sequences(tmp_path):
    rec = tmp_path / "x.rec"
    rec.write_bytes(physical(b"abcd", 1) + physical(b"efgh", 0) + physical(b"ijkl", 2) + physical(b"mn", 3))
    (tmp_path / "x.idx").write_text("0\t0\n1\t24\n2\t36\n")
    r = RecordIOReader(str(rec))
    with pytest.raises(ValueError, match="interrupted at byte offset 12 by cflag 0"):
        r.read(0)
    with pytest.raises(ValueError, match="starts with cflag 2"):
        r.read(1)
    with pytest.raises(ValueError, match="byte offset 36 starts with cflag 3"):
        r.read(2)


def test_bad_index_and_header(tmp_path):
    rec, idx, _ = write_rec(tmp_path, [(0, ir_pack(1.0, b"x"))])
    (tmp_path / "bad.idx").write_text("0\t0\n1 24\n")
    with pytest.raises(ValueError, match=r"bad\.idx.*line 2"):
        RecordIOReader(rec, str(tmp_path / "bad.idx"))
    (tmp_path / "past.idx").write_text("0\t0\n1\t9999\n")
    with pytest.raises(ValueError, match="key 1 points at byte offset 9999, past the end"):
        RecordIOReader(rec, str(tmp_path / "past.idx"))
    (tmp_path / "dup.idx").write_text("0\t0\n0\t0\n")
    with pytest.raises(ValueError, match="duplicate key 0"):
        RecordIOReader(rec, str(tmp_path / "dup.idx"))
    r = RecordIOReader(rec, idx)
    with pytest.raises(KeyError, match="key 5 is not in the index"):
        r.read(5)
    # header claims images 1..9 but the index stops at 2
    rec, idx, _ = write_rec(tmp_path, [(0, ir_pack([10.0, 12.0])), (1, ir_pack(0.0, b"a")), (2, ir_pack(0.0, b"b"))],
                            name="short")
    with pytest.raises(ValueError, match="key 9 is not in"):
        InsightFaceRecord(rec, idx)
    # no image bytes, so not an image record, and [5, 0.5] is no header either
    rec, idx, _ = write_rec(tmp_path, [(0, ir_pack([5.0, 0.5]))], name="multi")
    with pytest.raises(ValueError, match=r"multi\.rec.*not an insightface header either.*\[A, B\]"):
        InsightFaceRecord(rec, idx)
    rec, idx, _ = write_rec(tmp_path, [(0, ir_pack(2.5, b"img"))], name="frac")
    with pytest.raises(ValueError, match="non-negative integer class id"):
        InsightFaceRecord(rec, idx)[0]


def test_dataloader_workers_share_nothing(tmp_path):
    records, expect, _ = header_layout([4, 3, 2, 5])
    rec, idx, _ = write_rec(tmp_path, records)
    ds = InsightFaceRecord(rec, idx, decode=lambda b: torch.tensor(len(b)))
    ds[0]  # the parent opens its descriptor first; each worker must open its own
    loader = torch.utils.data.DataLoader(ds, batch_size=3, num_workers=2, multiprocessing_context="fork")
    got = [(int(n), int(y)) for imgs, ys in loader for n, y in zip(imgs, ys)]
    assert got == [(len(img), c) for img, c in expect]


def test_magic_inside_irheader(tmp_path):
    # id1 = the magic: the writer cuts at payload offset 8, inside the 24-byte IRHeader,
    # so even reading just the label has to join the parts.
    magic = 0xCED7230A
    records = [(k, ir_pack(float(k), fake_image(k), id1=magic, id2=magic | (magic << 32))) for k in range(3, 9)]
    rec, idx, offsets = write_rec(tmp_path, records)
    raw = open(rec, "rb").read()
    assert all(struct.unpack_from("<I", raw, off + 4)[0] >> 29 == 1 for off in offsets.values())
    ds = InsightFaceRecord(rec, idx)
    assert ds.labels().tolist() == list(range(3, 9))
    assert [ds[i] for i in range(6)] == [(fake_image(k), k) for k in range(3, 9)]
    assert unpack_header(ds.reader.read(5))[2:4] == (magic, magic | (magic << 32))


def test_indexing_reports_progress_and_the_callback_stays_behind(tmp_path):
    """The index build calls ``progress`` (the .idx parsed, the record headers read: what the
    app's heartbeat shows on a long first indexing); the callback is not pickled for workers."""
    records = [(k, ir_pack(float(k % 3), fake_image(k))) for k in range(5)]
    rec, idx, _ = write_rec(tmp_path, records)
    lines = []
    ds = InsightFaceRecord(rec, idx, cache=False, progress=lines.append)
    assert ds.labels().tolist() == [k % 3 for k in range(5)]
    assert any(line.endswith(f"MiB of {os.path.basename(idx)} parsed") for line in lines), lines
    assert "0 of 5 record headers read" in lines, lines
    clone = pickle.loads(pickle.dumps(ds))
    assert clone._progress is None and clone.labels().tolist() == ds.labels().tolist()
