"""Writers of ``.rec``/``.idx`` files for the RecordIO tests.

Written with ``struct.pack`` straight from the format (dmlc-core's ``recordio.h``
records as insightface's datasets use them), sharing no code with
``ds_pfc.data.recordio``: physical records, the split at 4-byte-aligned magic words, the IRHeader, the insightface
header/identity layout with its ``property`` file, and ``im2rec``'s records.
"""
from __future__ import annotations

import struct

MAGIC_LE = struct.pack("<I", 0xCED7230A)
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def physical(part: bytes, cflag: int) -> bytes:
    return struct.pack("<II", 0xCED7230A, (cflag << 29) | len(part)) + part + b"\0" * (-len(part) % 4)


def logical(payload: bytes) -> bytes:
    """One logical record: cut at every magic word found at an offset divisible by 4,
    dropping it; parts flagged 1 (first), 2 (middle), 3 (last); 0 when uncut."""
    cuts = [i for i in range(0, len(payload) - 3, 4) if payload[i:i + 4] == MAGIC_LE]
    if not cuts:
        return physical(payload, 0)
    starts = [0] + [c + 4 for c in cuts]
    ends = cuts + [len(payload)]
    flags = [1] + [2] * (len(cuts) - 1) + [3]
    return b"".join(physical(payload[s:e], f) for s, e, f in zip(starts, ends, flags))


def ir_pack(label, payload: bytes = b"", id1: int = 0, id2: int = 0) -> bytes:
    if isinstance(label, (list, tuple)):
        return struct.pack("<IfQQ", len(label), 0.0, id1, id2) + struct.pack(f"<{len(label)}f", *label) + payload
    return struct.pack("<IfQQ", 0, float(label), id1, id2) + payload


def write_rec(tmp_path, records, name="train", idx_order=None):
    """``records`` = [(key, payload)]; returns (rec_path, idx_path, offsets)."""
    rec, idx = tmp_path / f"{name}.rec", tmp_path / f"{name}.idx"
    blob, offsets = bytearray(), {}
    for key, payload in records:
        offsets[key] = len(blob)
        blob += logical(payload)
    rec.write_bytes(bytes(blob))
    order = idx_order if idx_order is not None else [k for k, _ in records]
    idx.write_text("".join(f"{k}\t{offsets[k]}\n" for k in order))
    return str(rec), str(idx), offsets


def fake_image(i: int) -> bytes:
    """JPEG-like bytes of odd lengths; every third one holds the magic at an aligned
    offset of the record payload (header of 24 or 36 bytes, then image offset 12), so
    those records are split."""
    body = bytes((i * 7 + j) % 251 for j in range(5 + 3 * i))
    if i % 3 == 0:
        body = body[:10] + MAGIC_LE + body[10:]
    return b"\xff\xd8" + body


def fake_png(i: int) -> bytes:
    return PNG_SIGNATURE + bytes((i * 11 + j) % 253 for j in range(3 + 2 * i))


def header_layout(class_sizes, array_labels=False, class_ids=None):
    """Insightface layout: record 0 = [A, B], images 1..A-1 grouped by class,
    identity records A..B-1 holding [img_start, img_end). Group ``g`` has label
    ``class_ids[g]`` (default ``g``): the writers only require increasing labels, so
    1-based or sparse ids are as valid as ``0..len-1``."""
    class_ids = list(range(len(class_sizes))) if class_ids is None else list(class_ids)
    assert len(class_ids) == len(class_sizes)
    num_images = sum(class_sizes)
    a, b = num_images + 1, num_images + 1 + len(class_sizes)
    records, expect = [(0, ir_pack([float(a), float(b)], id2=1))], []
    key = 1
    for cls, n in zip(class_ids, class_sizes):
        for _ in range(n):
            img = fake_image(key)
            label = [float(cls), 0.25 * key, -1.0] if array_labels else float(cls)
            records.append((key, ir_pack(label, img, id1=key)))
            expect.append((img, cls))
            key += 1
    start = 1
    for g, n in enumerate(class_sizes):
        records.append((a + g, ir_pack([float(start), float(start + n)])))
        start += n
    return records, expect, (a, b)


def write_property(tmp_path, num_classes: int, height: int = 112, width: int = 112) -> None:
    """insightface's ``property`` file beside the ``.rec``: ``num_classes,h,w``."""
    (tmp_path / "property").write_text(f"{num_classes},{height},{width}\n")


def im2rec_pack_label(lst):
    """The records ``im2rec --pack-label`` writes for a ``.lst`` given as
    ``[(index, [label, ...], image_bytes)]``: key = the list index, IRHeader with
    ``flag = number of labels``, the labels, ``id = index``, then the image as read
    from disk; in list order."""
    return [(index, ir_pack([float(v) for v in labels], image, id1=index)) for index, labels, image in lst]
