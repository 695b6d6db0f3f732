"""RecordIO start-up and loader throughput at WebFace42M scale.

``python launch/bench.py data [--records 42499999 --classes 2060000]`` writes a
synthetic insightface-layout ``train.rec``/``train.idx``/``property`` (header record
0 ``[A, B]``, ``records`` tiny image records grouped by class, ``classes`` identity
records; 48 bytes a record, so 42.5M records take about 2 GB plus a 0.9 GB index) into
``--workdir`` (kept and reused), then times, each in a fresh process:

- ``index``: parsing the ``.idx`` (``RecordIOReader``);
- ``header``: start-up with labels from the header's identity records (no cache);
- ``cache-write`` / ``cache-load``: the first start-up writing the index cache, and a
  later one reading it;
- ``scan``: the old start-up, one read of every record header, timed over the first
  ``--scan-records`` records and extrapolated linearly to all of them.

Then images/s of ``MicroBatchLoader`` per worker count over a small ``.rec`` of raw
112x112 RGB payloads (decoded by a reshape: the read, collate, flip and normalise
path without a JPEG decoder, which this package does not ship).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import torch

from . import format_table, write_json
from .._args import parser

_STRIDE = 48          # bytes a record: 8 record header + 24 IRHeader + 16 payload / 8 labels + padding
_MAGIC = 0xCED7230A


def _class_sizes(records: int, classes: int) -> torch.Tensor:
    """Class sizes summing to ``records``. insightface stores the header and the identity
    ranges as float32, exact only up to 2**24; past that only multiples of 4 (up to
    2**26) survive. So that the header path can be timed at 42.5M images, the first
    class has 3 images and the others multiples of 4: every range boundary is then a
    multiple of 4 (``records % 4 == 3`` and ``classes % 4 == 0`` are required). Real
    recs past 2**24 images have rounded ranges and take the scan (once; then the cache)."""
    if records % 4 != 3 or classes % 4 or records > (1 << 26) - classes:
        raise SystemExit("--records must be 3 mod 4 and --classes a multiple of 4 (records + classes < 2**26): "
                         "see _class_sizes")
    base, extra = divmod((records - 3) // 4, classes - 1)
    sizes = torch.full((classes,), 4 * base, dtype=torch.int64)
    sizes[1 + torch.randperm(classes - 1, generator=torch.Generator().manual_seed(0))[:extra]] += 4
    sizes[0] = 3
    return sizes


def _write_dataset(folder: str, records: int, classes: int) -> None:
    os.makedirs(folder, exist_ok=True)
    rec, idx = os.path.join(folder, "train.rec"), os.path.join(folder, "train.idx")
    if os.path.isfile(os.path.join(folder, "done.json")):
        with open(os.path.join(folder, "done.json")) as f:
            if json.load(f) == {"records": records, "classes": classes}:
                return
    a, b = records + 1, records + 1 + classes
    sizes = _class_sizes(records, classes)
    labels = torch.repeat_interleave(torch.arange(classes, dtype=torch.int64), sizes)
    chunk = 1 << 20
    with open(rec, "wb") as out, open(idx, "w") as index:
        def block(first_key: int, n: int, flag: int, payload_words: torch.Tensor | None, label_words=None):
            words = torch.zeros(n, _STRIDE // 4, dtype=torch.int32)
            words[:, 0] = _MAGIC - (1 << 32)
            words[:, 1] = 24 + 8 if flag else 24 + 16                   # cflag 0, payload length
            words[:, 2] = flag
            if label_words is not None:
                words[:, 3:4] = label_words.view(torch.int32).view(n, 1)  # IRHeader scalar label
            words[:, 4:6] = torch.arange(first_key, first_key + n, dtype=torch.int64).view(torch.int32).view(n, 2)
            if payload_words is not None:
                words[:, 8:10] = payload_words
            start = out.tell()
            out.write(words.numpy().tobytes() if hasattr(words, "numpy") else bytes(words.untyped_storage()))
            index.write("".join(f"{first_key + i}\t{start + _STRIDE * i}\n" for i in range(n)))

        block(0, 1, 2, torch.tensor([[a, b]], dtype=torch.float32).view(torch.int32))
        for lo in range(0, records, chunk):
            n = min(chunk, records - lo)
            block(1 + lo, n, 0, None, labels[lo:lo + n].to(torch.float32))
        ends = torch.cumsum(sizes, 0) + 1
        ranges = torch.stack([ends - sizes, ends], 1).to(torch.float32).view(torch.int32)
        for lo in range(0, classes, chunk):
            n = min(chunk, classes - lo)
            block(a + lo, n, 2, ranges[lo:lo + n])
    with open(os.path.join(folder, "property"), "w") as f:
        f.write(f"{classes},112,112\n")
    with open(os.path.join(folder, "done.json"), "w") as f:
        json.dump({"records": records, "classes": classes}, f)


def _case(case: dict) -> dict:
    from ..data.recordio import InsightFaceRecord, RecordIOReader
    folder, kind = case["folder"], case["kind"]
    calls = [0]
    real = RecordIOReader._pread

    def counted(self, size, offset):
        calls[0] += 1
        return real(self, size, offset)

    RecordIOReader._pread = counted
    t0 = time.perf_counter()
    if kind == "index":
        n = len(RecordIOReader(os.path.join(folder, "train.rec")))
        return {"seconds": time.perf_counter() - t0, "records": n, "preads": calls[0]}
    if kind == "scan":
        ds = InsightFaceRecord(folder, cache=False)
        t1 = time.perf_counter()
        keys = ds._image_keys
        m = min(case["scan_records"], len(keys))
        ds._image_keys = keys[:m]
        ds._scan_labels()
        per_record = (time.perf_counter() - t1) / m
        ds._image_keys = keys
        return {"seconds": (t1 - t0) + per_record * len(keys), "measured_records": m,
                "per_record_us": per_record * 1e6, "extrapolated": True, "preads": calls[0]}
    ds = InsightFaceRecord(folder, cache=kind != "header", cache_dir=os.path.join(folder, "index-cache"))
    labels = ds.labels()
    return {"seconds": time.perf_counter() - t0, "records": len(labels), "num_classes": ds.num_classes,
            "preads": calls[0], "source": ds.label_source}


def _raw_decode(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(3, 112, 112)


class _Repeat(torch.utils.data.Dataset):
    """``base`` repeated: enough batches to measure without starting workers again."""

    def __init__(self, base, times: int):
        self.base, self.times = base, times

    def __len__(self) -> int:
        return len(self.base) * self.times

    def __getitem__(self, i: int):
        return self.base[i % len(self.base)]


def _throughput(folder: str, images: int, workers_list: list[int], batch: int, seconds: float) -> list[dict]:
    from ..data.loader import MicroBatchLoader
    from ..data.recordio import InsightFaceRecord
    from ..data.sampler import DistributedIdentitySampler
    os.makedirs(folder, exist_ok=True)
    rec, idx = os.path.join(folder, "train.rec"), os.path.join(folder, "train.idx")
    if not os.path.isfile(idx):
        g = torch.Generator().manual_seed(0)
        with open(rec, "wb") as out, open(idx, "w") as index:
            for k in range(images):
                pixels = torch.randint(0, 256, (3 * 112 * 112,), dtype=torch.uint8, generator=g)
                payload = bytearray((0).to_bytes(4, "little") + torch.tensor([float(k % 100)]).numpy().tobytes()
                                    + k.to_bytes(8, "little") + bytes(8)) + bytes(pixels.numpy().tobytes())
                index.write(f"{k}\t{out.tell()}\n")
                out.write(_MAGIC.to_bytes(4, "little") + len(payload).to_bytes(4, "little") + payload
                          + bytes(-len(payload) % 4))
    ds = _Repeat(InsightFaceRecord(rec, decode=_raw_decode, cache=False), 1000)
    results = []
    for workers in workers_list:
        sampler = DistributedIdentitySampler(len(ds), rank=0, world_size=1, block_size=batch)
        loader = MicroBatchLoader(ds, sampler, workers=workers)
        seen, t0, started = 0, None, time.perf_counter()
        for images_, _ in loader:
            if t0 is None:                       # after the first batch: workers are up
                t0 = time.perf_counter()
                continue
            seen += len(images_)
            if time.perf_counter() - t0 > seconds:
                break
        rate = seen / (time.perf_counter() - t0) if seen else 0.0
        results.append({"workers": workers, "images_per_s": rate,
                        "images_per_s_per_worker": rate / max(workers, 1),
                        "first_batch_s": (t0 or time.perf_counter()) - started})
    return results


def build_parser() -> argparse.ArgumentParser:
    p = parser("ds-pfc-bench data", " ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--records", type=int, default=42_499_999, help="image records (WebFace42M: 42.5M; 3 mod 4)")
    p.add_argument("--classes", type=int, default=2_060_000, help="identities (WebFace42M: 2.06M; a multiple of 4)")
    p.add_argument("--workdir", default="/tmp/ds_pfc_bench_data", help="where the synthetic data is kept")
    p.add_argument("--scan-records", type=int, default=300_000, help="records the full scan is timed over")
    p.add_argument("--throughput-images", type=int, default=2048,
                   help="raw 112x112 images in the loader benchmark's small .rec (default 2048)")
    p.add_argument("--workers", default="0,1,2", help="loader worker counts to time (comma-separated list)")
    p.add_argument("--batch", type=int, default=128, help="images per loader batch (default 128)")
    p.add_argument("--seconds", type=float, default=5.0, help="measuring time per worker count")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/data-<records>.json)")
    p.add_argument("--case", default=None, help=argparse.SUPPRESS)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.case:
        print(json.dumps(_case(json.loads(args.case))))
        return 0
    folder = os.path.join(args.workdir, f"rec-{args.records}-{args.classes}")
    t0 = time.perf_counter()
    _write_dataset(folder, args.records, args.classes)
    print(f"synthetic data in {folder} ({time.perf_counter() - t0:.1f} s)", file=sys.stderr)
    stale = os.path.join(folder, "index-cache")          # the cases' index cache: start without one
    if os.path.isdir(stale):
        shutil.rmtree(stale)
    startup = []
    for kind in ("index", "header", "cache-write", "cache-load", "scan"):
        case = {"folder": folder, "kind": kind, "scan_records": args.scan_records}
        proc = subprocess.run([sys.executable, "-m", __name__, "--case", json.dumps(case)],
                              capture_output=True, text=True)
        if proc.returncode:
            row = {"kind": kind, "error": (proc.stderr or proc.stdout).strip().splitlines()[-1]}
        else:
            row = {"kind": kind, **json.loads(proc.stdout.strip().splitlines()[-1])}
        print(json.dumps(row), file=sys.stderr)
        startup.append(row)
    workers = [int(w) for w in args.workers.split(",")]
    loader = _throughput(os.path.join(args.workdir, f"raw-{args.throughput_images}"), args.throughput_images,
                         workers, args.batch, args.seconds)
    print(format_table(["start-up", "seconds", "preads", "note"],
                       [[r["kind"], f"{r.get('seconds', float('nan')):.2f}", r.get("preads", "-"),
                         r.get("error") or ("extrapolated from %d records" % r["measured_records"]
                                            if r.get("extrapolated") else r.get("source", ""))[:70]]
                        for r in startup]))
    print(format_table(["workers", "images/s", "images/s/worker", "first batch s"],
                       [[r["workers"], f"{r['images_per_s']:.0f}", f"{r['images_per_s_per_worker']:.0f}",
                         f"{r['first_batch_s']:.2f}"] for r in loader]))
    out = args.out or os.path.join("benchmarks", "results", f"data-{args.records}.json")
    write_json(out, "data", vars(args), startup, {"loader": loader})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
