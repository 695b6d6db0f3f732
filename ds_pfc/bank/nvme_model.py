"""What a per-step NVMe tier costs, counted from :class:`~ds_pfc.bank.nvme.NvmeStore`'s own
layout and request rules, and whether it fits a step and a drive's endurance.

A training step moves, per state: the cold rows ``S(t+1) \\ S(t)`` in (a gather) and the
stepped rows ``S(t)`` out (a scatter). The store reads and writes the 4 KiB pages that
hold those rows:

* a gather reads every page a moved row touches, and the untouched pages in gaps of at
  most ``coalesce_gap_bytes`` between two such pages (one request instead of two);
* a scatter writes every page a moved row touches (and, with ``coalesce_write_gap_bytes``,
  the untouched pages it read in gaps up to that size); it first reads each touched page
  that its rows do not cover whole, with the same gap rule.

Rows are drawn uniformly (the sampler's negatives; the positives are a small share at the
sizes where NVMe matters). A page meets the ``k`` rows that overlap it (packed back to
back); it is touched unless all of them are undrawn, and covered when all are drawn
(hypergeometric); gaps are counted with pages independent. Tests
compare these counts with the store's I/O counters on random row sets.

:func:`check_step` is what :class:`~ds_pfc.bank.TieredBank` applies before it creates an
NVMe file: a per-step NVMe tier is refused, with these numbers, when its I/O does not hide
behind the step or its writes exceed the drive's rated writes per day.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .nvme import DEFAULT_GAP_BYTES, SECTOR

__all__ = ["PAGE", "page_io", "step_io", "NvmeBudget", "check_step", "NvmeTierError"]

PAGE = SECTOR                 # the store's I/O unit (its alignment with intra_op_parallelism 1)
GB = 1e9


class NvmeTierError(ValueError):
    """A per-step NVMe tier that does not hide behind the step or wears out the drive."""


def _log_choose_ratio(a: float, b: float, k: float) -> float:
    """log( C(a, k) / C(b, k) ) for real a <= b (lgamma), -inf when a < k."""
    if a < k:
        return -math.inf
    return (math.lgamma(a + 1) - math.lgamma(a - k + 1)) - (math.lgamma(b + 1) - math.lgamma(b - k + 1))


def drawn_fractions(m: float, n: float, k: float) -> tuple[float, float]:
    """For ``m`` rows drawn uniformly without replacement from ``n``: the probability that a
    group of ``k`` rows holds at least one of them, and that it holds only drawn rows."""
    if n <= 0 or m <= 0:
        return 0.0, 0.0
    m = min(m, n)
    k = min(k, n)
    return 1.0 - math.exp(_log_choose_ratio(n - m, n, k)), math.exp(_log_choose_ratio(m, n, k))


def _with_gaps(p: float, gap_pages: int) -> float:
    """Share of pages read when each page is wanted with probability ``p`` and untouched
    pages in gaps of at most ``gap_pages`` between two wanted pages are read too."""
    if p <= 0.0:
        return 0.0
    q = 1.0 - p
    # an unwanted page with its nearest wanted pages a >= 1 and b >= 1 pages away lies in a
    # gap of a + b - 1 pages; (s - 1) pairs (a, b) have a + b = s
    in_gap = p * p * sum((s - 1) * q ** (s - 2) for s in range(2, gap_pages + 2))
    return p + q * in_gap


def _rows_met(row_bytes: int, page: int = PAGE) -> list[int]:
    """The rows each page of one period of the packing meets (rows back to back from a
    page boundary; the pattern repeats every ``row_bytes / gcd`` pages)."""
    period = row_bytes // math.gcd(page, row_bytes)
    return [((j + 1) * page - 1) // row_bytes - (j * page) // row_bytes + 1 for j in range(min(period, 4096))]


def page_io(row_bytes: int, num_rows: int, gathered: float, scattered: float, *,
            gap_bytes: int = DEFAULT_GAP_BYTES, write_gap_bytes: int = 0, page: int = PAGE) -> dict:
    """Expected bytes one state's file reads and writes when ``gathered`` random rows are
    gathered and ``scattered`` random rows are scattered (``num_rows`` rows of
    ``row_bytes``)."""
    pages = math.ceil(num_rows * row_bytes / page)
    gap, wgap = gap_bytes // page, write_gap_bytes // page
    # the pages of one period of the packing meet k_j rows each: average over them
    ks = _rows_met(row_bytes, page)
    t_in = sum(drawn_fractions(gathered, num_rows, k)[0] for k in ks) / len(ks)
    out = [drawn_fractions(scattered, num_rows, k) for k in ks]
    t_out = sum(t for t, _ in out) / len(ks)
    full_out = sum(f for _, f in out) / len(ks)
    read_in = _with_gaps(t_in, gap)
    read_out = _with_gaps(t_out - full_out, gap)          # touched pages not covered whole
    written = t_out if not wgap else _with_gaps(t_out, min(gap, wgap))
    return dict(pages=pages, touched_in=t_in, touched_out=t_out, covered_out=full_out,
                read_gather=pages * page * read_in, read_scatter=pages * page * read_out,
                read=pages * page * (read_in + read_out), write=pages * page * written)


def step_io(states: list[tuple[str, int]], num_rows: int, active_rows: float, *,
            gap_bytes: int = DEFAULT_GAP_BYTES, write_gap_bytes: int = 0, page: int = PAGE) -> dict:
    """Expected NVMe bytes of one training step for the ``(name, row_bytes)`` states on
    NVMe, ``active_rows`` of ``num_rows`` active per step (cold rows in, active rows out)."""
    active = min(float(active_rows), float(num_rows))
    cold = active * (1.0 - active / num_rows) if num_rows else 0.0
    per_state = {name: page_io(rb, num_rows, cold, active, gap_bytes=gap_bytes, write_gap_bytes=write_gap_bytes,
                               page=page)
                 for name, rb in states}
    return dict(cold_rows=cold, active_rows=active, states=per_state,
                read=sum(s["read"] for s in per_state.values()), write=sum(s["write"] for s in per_state.values()))


@dataclass(frozen=True)
class NvmeBudget:
    """What one rank may ask of its NVMe share per step. The defaults are one data-center
    drive per GPU (8 per 8-GPU node): 14 GB/s read, 10 GB/s write, 15.36 TB rated for one
    drive write per day, and a 300 ms training step. ``check``: ``"refuse"`` (raise
    :class:`NvmeTierError`), ``"warn"`` (print the figures and go on) or ``"off"``."""

    step_ms: float = 300.0
    read_gbps: float = 14.0
    write_gbps: float = 10.0
    drive_tb: float = 15.36
    dwpd: float = 1.0
    check: str = "refuse"

    CHECKS = ("refuse", "warn", "off")

    def __post_init__(self):
        for name in ("step_ms", "read_gbps", "write_gbps", "drive_tb", "dwpd"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 \
                    or not math.isfinite(value):
                raise ValueError(f"nvme_budget {name} must be a positive number, got {value!r}")
        if self.check not in self.CHECKS:
            raise ValueError(f"nvme_budget check must be one of {list(self.CHECKS)}, got {self.check!r}")

    @classmethod
    def parse(cls, value) -> "NvmeBudget":
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = sorted(set(value) - set(cls.__dataclass_fields__))
            if unknown:
                raise ValueError(f"nvme_budget has unknown keys {unknown}; known: {sorted(cls.__dataclass_fields__)}")
            return cls(**value)
        raise TypeError(f"nvme_budget must be an NvmeBudget, a dict or None, got {type(value).__name__}")


def check_step(states: list[tuple[str, int]], num_rows: int, active_rows: float, budget: NvmeBudget, *,
               gap_bytes: int = DEFAULT_GAP_BYTES, write_gap_bytes: int = 0, page: int = PAGE) -> tuple[dict, str | None]:
    """The step's NVMe figures and, when they exceed ``budget``, the reason (else None)."""
    io = step_io(states, num_rows, active_rows, gap_bytes=gap_bytes, write_gap_bytes=write_gap_bytes, page=page)
    step_s = budget.step_ms / 1e3
    seconds = io["read"] / (budget.read_gbps * GB) + io["write"] / (budget.write_gbps * GB)
    per_day = io["write"] * 86400.0 / step_s
    endurance = budget.drive_tb * 1e12 * budget.dwpd
    io.update(seconds=seconds, step_seconds=step_s, writes_per_day=per_day, endurance_per_day=endurance)
    problems = []
    if seconds > step_s:
        problems.append(f"{seconds:.3f} s of I/O at {budget.read_gbps:g} GB/s read and {budget.write_gbps:g} GB/s "
                        f"write does not hide behind a {step_s:.3f} s step")
    if per_day > endurance:
        problems.append(f"{per_day / 1e12:,.1f} TB written per day is {per_day / endurance:,.1f}x the drive's "
                        f"rated {endurance / 1e12:,.2f} TB/day ({budget.drive_tb:g} TB x {budget.dwpd:g} DWPD)")
    if not problems:
        return io, None
    names = ", ".join(f"{n} ({rb:,} B rows)" for n, rb in states)
    reason = (f"a per-step NVMe tier for states {names}: each step reads {io['read'] / 1e9:,.3f} GB and writes "
              f"{io['write'] / 1e9:,.3f} GB of this rank's {num_rows:,}-row files (the 4 KiB pages of "
              f"{io['cold_rows']:,.0f} cold rows in and {io['active_rows']:,.0f} stepped rows out); "
              + "; ".join(problems)
              + ". Lower the sample rate, place these states on the host tier (the NVMe store also serves as "
              "a backing store through checkpoints), or set nvme_budget (ds_pfc.head.bank.nvme_budget) to the "
              "drive's real rates and step time, or its check to 'warn' to run anyway")
    return io, reason
