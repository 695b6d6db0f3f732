"""``ds-pfc-bench clean-predict``: the all-pairs centre search of ``ds-pfc-clean`` counted
and predicted on GPUs (every class centre against every other, top-k, own id masked).

What one rank does (:func:`ds_pfc.core.neighbors.sharded_nearest` with ``impl="triton"``):
its ``Q_r`` centres (a :class:`~ds_pfc.core.partition.Partition` shard of ``C``) are the
queries; every owner's shard is broadcast in blocks of ``block_rows`` float32 rows; for
every pair of a query block and a key block one launch of the fused kernel
(:mod:`ds_pfc.kernels.triton_neighbors`, tiles ``BLOCK_Q x BLOCK_K`` and ``BLOCK_D`` wide)
computes the products and writes each key tile's ``k`` best per query, then torch merges
them into the running top-k (``cat``, ``topk``, ``gather``, ``where``: one merge per pair).

:func:`count_search` counts, per rank and exactly from the shapes: the kernel's programs,
FLOPs (``2 x 32 x 64 x d`` per program, the padded tile), bytes loaded into the SMs (every
program loads its query and key rows, ``d`` floats each) and written (``k`` value/index
pairs per query and key tile), the distinct bytes (each launch's two blocks), the merge's
bytes and ops, and the broadcast bytes received (every other rank's shard, float32).

:func:`predict_search` prices them on a :data:`~ds_pfc.bench.model.GPUS` model with the H200
calibration (:mod:`ds_pfc.bench.calibration`). Assumptions, each stated in the output:

* the kernel's products are IEEE float32 (``tl.dot(..., input_precision="ieee")``: FMA
  instructions, no tensor cores): the float32 FMA peak, scaled by the measured/peak ratio of
  the calibrated bf16 GEMM rate, times the efficiency the calibration measured for the
  forward Triton products kernel (``_lse_kernel``, also a query-by-class tile product with a
  per-row reduction in its epilogue) against cuBLAS's rate;
* bytes: distinct bytes at the measured copy rate (key blocks of 8 MiB stay in L2 across a
  launch's query tiles); the kernel's time is the larger of products and bytes;
* the merge: its bytes at the calibrated aten streaming efficiency plus one calibrated
  launch per op (10 ops per merge);
* broadcasts are not overlapped with compute (the code broadcasts a block, then merges it):
  NVLink within a node (up to 8 GPUs) at :data:`LINKS` ``nvlink``, InfiniBand across nodes
  at ``ib`` (per GPU), plus a fixed latency per broadcast;
* memory: a rank holds its shard, the normalised queries (one more copy), the result and
  one block of products; a case that exceeds the GPU's memory is reported, not priced away.
"""
from __future__ import annotations

import argparse
import math

from .._args import parser

__all__ = ["count_search", "predict_search", "LINKS", "MERGE_OPS", "build_parser", "main"]

LINKS = {"nvlink": {"bytes_per_s": 360e9, "latency_s": 15e-6,
                    "source": "H200 NVLink 4: 450 GB/s per direction; NCCL broadcast reaches ~80% (assumed)"},
         "ib": {"bytes_per_s": 40e9, "latency_s": 30e-6,
                "source": "one 400 Gb/s InfiniBand NIC per GPU (50 GB/s); NCCL across nodes ~80% (assumed)"}}
"""Broadcast rates per GPU: within a node of 8 GPUs and across nodes."""

MERGE_OPS = 10
"""Launches of one merge of a key block's candidates into the running top-k (torch ops:
cat x2, topk, gather, isinf, full_like, where, two slice writes, arange)."""

GPUS_PER_NODE = 8


def _check_positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _shards(classes: int, world: int) -> list[int]:
    base, extra = divmod(classes, world)
    return [base + (1 if r < extra else 0) for r in range(world)]


def count_search(classes: int, world: int, *, dim: int = 512, k: int = 10, block_rows: int | None = None,
                 rank: int = 0) -> dict:
    """Counts of rank ``rank``'s part of the all-pairs search of ``classes`` centres of width
    ``dim`` over ``world`` ranks, ``k`` neighbours, blocks of ``block_rows`` rows (default
    :data:`~ds_pfc.core.neighbors.NEIGHBOR_BLOCK_ROWS`). See the module docstring."""
    from ..core.neighbors import NEIGHBOR_BLOCK_ROWS
    from ..kernels.triton_neighbors import BLOCK_D, BLOCK_K, BLOCK_Q
    for name, value in (("classes", classes), ("world", world), ("dim", dim), ("k", k)):
        _check_positive(name, value)
    block_rows = NEIGHBOR_BLOCK_ROWS if block_rows is None else block_rows
    _check_positive("block_rows", block_rows)
    if not 0 <= rank < world:
        raise ValueError(f"rank must lie in [0, {world}), got {rank!r}")
    if k > BLOCK_K:
        raise ValueError(f"k must be at most {BLOCK_K} for the fused kernel, got {k}")
    shards = _shards(classes, world)
    queries = shards[rank]
    padded_d = math.ceil(dim / BLOCK_D) * BLOCK_D

    def blocks(rows: int) -> dict[int, int]:
        """block size -> how many blocks of ``rows`` rows cut into ``block_rows``."""
        full, last = divmod(rows, block_rows)
        out = {block_rows: full} if full else {}
        if last:
            out[last] = out.get(last, 0) + 1
        return out

    q_blocks = blocks(queries)
    k_blocks: dict[int, int] = {}
    for size in shards:
        for rows, n in blocks(size).items():
            k_blocks[rows] = k_blocks.get(rows, 0) + n
    c = dict(launches=0, programs=0, flops=0, loaded=0, written=0, unique=0, merges=0, merge_bytes=0)
    for qb, nq in q_blocks.items():
        for kb, nk in k_blocks.items():
            pairs = nq * nk
            q_tiles, k_tiles = math.ceil(qb / BLOCK_Q), math.ceil(kb / BLOCK_K)
            c["launches"] += pairs
            c["programs"] += pairs * q_tiles * k_tiles
            c["flops"] += pairs * q_tiles * k_tiles * 2 * BLOCK_Q * BLOCK_K * padded_d
            c["loaded"] += pairs * (k_tiles * qb + q_tiles * kb) * dim * 4
            c["written"] += pairs * qb * k_tiles * k * (4 + 8)
            c["unique"] += pairs * (qb + kb) * dim * 4
            # merge: cat of [qb, k] and [qb, T k] values (4 B) and indices (8 B), read and
            # written; topk reads the values; gather, isinf, where over [qb, k]; two writes
            cols = k + k_tiles * k
            c["merges"] += pairs
            c["merge_bytes"] += pairs * qb * (2 * cols * 12 + cols * 4 + 10 * k * 12)
    c["useful_flops"] = 2 * queries * classes * dim
    c["broadcasts"] = sum(math.ceil(s / block_rows) for s in shards) if world > 1 else 0
    c["received_bytes"] = (classes - queries) * dim * 4 if world > 1 else 0
    c["memory_bytes"] = 2 * queries * dim * 4 + queries * k * 12 + block_rows * dim * 4 \
        + block_rows * math.ceil(block_rows / BLOCK_K) * k * 12 * 2
    return dict(classes=classes, world=world, dim=dim, k=k, block_rows=block_rows, rank=rank, queries=queries,
                tiles=dict(BLOCK_Q=BLOCK_Q, BLOCK_K=BLOCK_K, BLOCK_D=BLOCK_D), **c)


def predict_search(classes: int, world: int, *, dim: int = 512, k: int = 10, gpu_name: str = "h200",
                   block_rows: int | None = None, calibration=None) -> dict:
    """Predicted seconds of the all-pairs search on ``world`` GPUs of ``gpu_name`` (the
    busiest rank: rank 0 holds the largest shard), split into kernel, merge and broadcast."""
    from . import calibration as calib
    from .model import GPUS
    if gpu_name not in GPUS:
        raise ValueError(f"gpu_name must be one of {sorted(GPUS)}, got {gpu_name!r}")
    cal = calibration if calibration is not None else calib.load_calibration()
    gpu, rates = GPUS[gpu_name], cal.rates(gpu_name)
    c = count_search(classes, world, dim=dim, k=k, block_rows=block_rows)
    mma_eff = cal.matrix["triton:_lse_kernel"] / cal.matrix["cublas:triton"]
    fma_rate = gpu["fma"] * rates["gemm"] / gpu["tensor_peak"] * mma_eff
    products_s = c["flops"] / fma_rate
    bytes_s = c["unique"] / rates["copy"]
    kernel_s = max(products_s, bytes_s) + c["launches"] * cal.launch_s
    merge_s = c["merge_bytes"] / (cal.stream["aten"] * rates["copy"]) + c["merges"] * MERGE_OPS * cal.launch_s
    link = LINKS["nvlink" if world <= GPUS_PER_NODE else "ib"]
    comm_s = c["received_bytes"] / link["bytes_per_s"] + c["broadcasts"] * link["latency_s"]
    total = kernel_s + merge_s + comm_s
    return dict(counts=c, gpu=gpu_name, fits=c["memory_bytes"] <= gpu["memory_bytes"],
                seconds=dict(kernel=kernel_s, products=products_s, bytes=bytes_s, merge=merge_s, broadcast=comm_s,
                             total=total),
                bound="products" if products_s >= bytes_s else "bytes",
                assumptions=dict(
                    products_rate=fma_rate,
                    products_rule=f"float32 FMA peak {gpu['fma'] / 1e12:.0f} TF/s x measured/peak GEMM "
                                  f"{rates['gemm'] / gpu['tensor_peak']:.1%} x _lse_kernel/cuBLAS "
                                  f"{mma_eff:.1%} = {fma_rate / 1e12:.1f} TF/s",
                    copy_rate=rates["copy"], aten_efficiency=cal.stream["aten"], launch_s=cal.launch_s,
                    link=("nvlink" if world <= GPUS_PER_NODE else "ib"), link_bytes_per_s=link["bytes_per_s"],
                    link_source=link["source"], calibration=cal.describe(gpu_name)))


def _human(seconds: float) -> str:
    if seconds >= 86400:
        return f"{seconds / 86400:.1f} d"
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 60:
        return f"{seconds / 60:.1f} min"
    return f"{seconds:.1f} s"


def build_parser() -> argparse.ArgumentParser:
    p = parser("ds-pfc-bench clean-predict", "Predict the all-pairs centre search of ds-pfc-clean on GPUs "
               "(ds_pfc/bench/clean_predict.py).")
    p.add_argument("--gpu", default="h200", help="the GPU model (default %(default)s; calibrated: h200)")
    p.add_argument("--classes", type=int, nargs="+", default=[1_000_000, 10_000_000, 100_000_000],
                   help="C: identities (default 1M 10M 100M)")
    p.add_argument("--world", type=int, nargs="+", default=[1, 8, 64], help="GPUs (default 1 8 64)")
    p.add_argument("--dim", type=int, default=512, help="d (default %(default)s)")
    p.add_argument("--k", type=int, default=10, help="neighbours per centre (default %(default)s)")
    p.add_argument("--out", default=None, help="write the table as JSON here")
    return p


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    rows = []
    try:
        for classes in args.classes:
            for world in args.world:
                rows.append(predict_search(classes, world, dim=args.dim, k=args.k, gpu_name=args.gpu))
    except ValueError as err:
        p.error(str(err))
    print(f"{'C':>12} {'GPUs':>5} {'TFLOP/rank':>11} {'recv GB':>8} {'kernel':>9} {'merge':>9} {'bcast':>9} "
          f"{'total':>9}  fits")
    for r in rows:
        c, s = r["counts"], r["seconds"]
        print(f"{c['classes']:>12,} {c['world']:>5} {c['flops'] / 1e12:>11.1f} {c['received_bytes'] / 1e9:>8.1f} "
              f"{_human(s['kernel']):>9} {_human(s['merge']):>9} {_human(s['broadcast']):>9} "
              f"{_human(s['total']):>9}  {'yes' if r['fits'] else 'no'}")
    print(rows[0]["assumptions"]["products_rule"])
    if args.out:
        from . import write_json
        write_json(args.out, "clean-predict", vars(args), rows)
        print(f"wrote {args.out}")
    return 0
