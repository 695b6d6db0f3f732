"""A per-step NVMe tier is refused, before any file exists, when the page I/O a step
needs (ds_pfc.bank.nvme_model, itself checked against the store's I/O counters in
tests/test_nvme_store.py) does not hide behind the step or wears the drive out; with
check='warn' the head prints the figures and trains; the budget is a config key."""
from __future__ import annotations

import os

import pytest
import torch

from ds_pfc import PartialFC
from ds_pfc.bank import NvmeBudget, NvmeTierError, Placement, TieredBank
from ds_pfc.bank.nvme_model import page_io, step_io


def _aio_ok() -> bool:
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder
        return bool(AsyncIOBuilder().is_compatible())
    except Exception:  # deepspeed missing or broken
        return False


def test_the_papers_sample_rate_at_scale_is_refused_before_any_file_exists(tmp_path):
    """4M classes on one rank, d = 512, r = 0.1, bf16 weight and momentum on NVMe (1 KiB
    rows, 4 per page): each step rewrites the third of the pages its rows touch, 2.8 GB,
    some 800 TB a day against the default drive's 15.36 TB: refused, naming the knobs,
    and nothing is created."""
    bank = TieredBank.factory(default=("nvme", torch.bfloat16), nvme_dir=str(tmp_path))
    with pytest.raises(NvmeTierError) as err:
        PartialFC(4_000_000, 512, sample_rate=0.1, bank=bank, device="cpu")
    msg = str(err.value)
    expected = step_io([("weight", 1024), ("momentum_buffer", 1024)], 4_000_000, 400_000)
    assert f"{expected['write'] / 1e9:,.3f} GB" in msg and f"{expected['read'] / 1e9:,.3f} GB" in msg
    for needle in ("weight (1,024 B rows)", "momentum_buffer", "TB written per day", "rated 15.36 TB/day",
                   "nvme_budget", "sample rate", "host tier"):
        assert needle in msg, needle
    assert os.listdir(tmp_path) == []


def test_time_and_endurance_are_checked_apart():
    # one state, 100k rows of 1 KiB, 10k active: I/O per step from the page model
    io = page_io(1024, 100_000, 10_000 * 0.9, 10_000)
    seconds = io["read"] / 14e9 + io["write"] / 10e9
    specs = [("weight", 512, torch.float32)]       # stored as bf16: 1 KiB rows
    fast = TieredBank(100_000, "cpu", placements={"weight": _nvme_bf16()}, nvme_dir="/x",
                      nvme_budget={"step_ms": seconds * 1e3 * 1.01, "drive_tb": 1e6})
    assert fast.check_nvme_tier(specs, 10_000)["seconds"] == pytest.approx(seconds)
    slow = TieredBank(100_000, "cpu", placements={"weight": _nvme_bf16()}, nvme_dir="/x",
                      nvme_budget={"step_ms": seconds * 1e3 * 0.99, "drive_tb": 1e6})
    with pytest.raises(NvmeTierError, match="does not hide behind a"):
        slow.check_nvme_tier(specs, 10_000)
    per_day = io["write"] * 86400 / 0.3
    worn = TieredBank(100_000, "cpu", placements={"weight": _nvme_bf16()}, nvme_dir="/x",
                      nvme_budget={"drive_tb": per_day / 1e12 / 2, "read_gbps": 1e6, "write_gbps": 1e6})
    with pytest.raises(NvmeTierError, match=r"is 2\.0x the drive's rated") as err:
        worn.check_nvme_tier(specs, 10_000)
    assert "does not hide" not in str(err.value)
    off = TieredBank(100_000, "cpu", placements={"weight": _nvme_bf16()}, nvme_dir="/x",
                     nvme_budget={"drive_tb": 1e-6, "check": "off"})
    assert off.check_nvme_tier(specs, 10_000) is None
    host = TieredBank(100_000, "cpu", default=Placement("host"), nvme_budget={"drive_tb": 1e-6})
    assert host.check_nvme_tier(specs, 10_000) is None            # nothing on NVMe: nothing to check


def _nvme_bf16():
    return Placement("nvme", torch.bfloat16)


@pytest.mark.skipif(not _aio_ok(), reason="DeepSpeed's async_io op is not compatible here (libaio missing)")
def test_warn_prints_the_figures_and_trains(tmp_path, capsys):
    bank = TieredBank.factory(default="nvme", nvme_dir=str(tmp_path), nvme_budget={"step_ms": 1e-6, "check": "warn"})
    head = PartialFC(1000, 16, sample_rate=0.2, bank=bank, device="cpu")
    assert "does not hide behind a 0.000 s step" in capsys.readouterr().out
    loss = head(torch.randn(8, 16), torch.randint(0, 1000, (8,)))
    loss.backward()
    head.step(0.1)
    head.close()
    assert len(os.listdir(tmp_path)) >= 2


def test_budget_arguments_are_checked():
    with pytest.raises(ValueError, match="nvme_budget read_gbps must be a positive number"):
        TieredBank.factory(default="host", nvme_budget={"read_gbps": -1})
    with pytest.raises(TypeError, match="nvme_budget must be an NvmeBudget"):
        TieredBank.factory(default="host", nvme_budget=300)
    assert NvmeBudget.parse({"step_ms": 150}).step_ms == 150
