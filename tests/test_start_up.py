"""Start-up of the host tier that cannot strand a node: NUMA placement within the job's
CPU set, page-lock failures cleared, explained and either refused or survived, and
registered tables released by a finalizer. The CUDA runtime is a fake that logs calls."""
from __future__ import annotations

import gc
import os
import warnings

import pytest
import torch

from ds_pfc import devices
from ds_pfc.bank import stores
from ds_pfc.bank.stores import HostRegisterError, HostStore
from ds_pfc.bank.tiered import TieredBank


class _Runtime:
    """A fake CUDA runtime: registrations fail for the call numbers in ``fail`` with
    ``error``, which it keeps as its last error until ``cudaGetLastError`` reads it."""

    def __init__(self, log):
        self.log, self.fail, self.error, self.last, self.calls = log, set(), 2, 0, 0

    def cudaHostRegister(self, ptr, nbytes, flags):
        self.calls += 1
        self.log.append(("register", ptr, nbytes, flags))
        if self.calls in self.fail:
            self.last = self.error
            return self.error
        return 0

    def cudaHostUnregister(self, ptr):
        self.log.append(("unregister", ptr))
        return 0

    def cudaGetLastError(self):
        self.log.append(("get_last_error", self.last))
        err, self.last = self.last, 0
        return err


@pytest.fixture
def fake_cuda(monkeypatch):
    log = []
    runtime = _Runtime(log)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: runtime)
    monkeypatch.setattr(stores, "pinned_empty", lambda shape, dtype: torch.empty(shape, dtype=dtype))
    monkeypatch.setattr(stores, "REGISTER_MIN_BYTES", 1000)
    monkeypatch.setattr(stores, "local_cpus", lambda device: None)
    return log, runtime


# ---------------------------------------------------------------- NUMA placement
def _record_affinity(monkeypatch, fail: bool = False):
    seen = []
    original = os.sched_setaffinity

    def record(pid, cpus):
        seen.append(set(cpus))
        if fail:
            raise OSError(22, "Invalid argument")
        original(pid, cpus)
    monkeypatch.setattr(os, "sched_setaffinity", record)
    return seen


def test_a_cpuset_without_the_gpus_node_warns_and_touches_unbound(monkeypatch):
    seen = _record_affinity(monkeypatch)
    table = torch.full((1 << 18,), 3.0)
    with pytest.warns(RuntimeWarning, match=r"none of the GPU's 4 NUMA-local CPUs \(8-11\) is in this job's CPU set "
                                            r"\(0-1\)"):
        done = devices.place_host_table(table, cpus={8, 9, 10, 11}, allowed={0, 1})
    assert seen == [] and done["cpus"] is None and done["requested_cpus"] == 4
    assert "8-11" in done["fallback"]
    assert float(table.abs().max()) == 0.0


def test_the_touch_binds_to_the_nodes_cpus_the_job_may_use(monkeypatch):
    allowed = os.sched_getaffinity(0)
    cpu = min(allowed)
    seen = _record_affinity(monkeypatch)
    table = torch.full((1 << 18,), 3.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        done = devices.place_host_table(table, cpus={cpu, 10_000, 10_001})     # two CPUs outside the job's set
    assert seen == [{cpu}] and done["cpus"] == 1 and done["requested_cpus"] == 3 and done["fallback"] is None
    assert float(table.abs().max()) == 0.0
    assert os.sched_getaffinity(0) == allowed


def test_a_refused_binding_warns_and_still_places_the_table(monkeypatch):
    cpu = min(os.sched_getaffinity(0))
    _record_affinity(monkeypatch, fail=True)
    table = torch.full((1 << 18,), 3.0)
    with pytest.warns(RuntimeWarning, match="binding the touch to CPUs .* failed"):
        done = devices.place_host_table(table, cpus={cpu})
    assert done["cpus"] is None and float(table.abs().max()) == 0.0


def test_the_achieved_placement_is_read_from_numa_maps(tmp_path):
    table = torch.zeros(1 << 20)
    ptr = table.data_ptr()
    lo, hi = ptr - 4096, ptr + (8 << 20)
    (tmp_path / "maps").write_text(f"00400000-00452000 r-xp 00000000 08:02 173521 /usr/bin/python\n"
                                   f"{lo:016x}-{hi:016x} rw-p 00000000 00:00 0\n")
    (tmp_path / "numa_maps").write_text(f"00400000 default file=/usr/bin/python mapped=82 N0=82\n"
                                        f"{lo:016x} default anon=2049 dirty=2049 N0=17 N1=2032 kernelpagesize_kB=4\n")
    nodes = devices.host_placement(table, numa_maps=str(tmp_path / "numa_maps"), maps=str(tmp_path / "maps"))
    assert nodes == {0: 17, 1: 2032}
    (tmp_path / "maps").write_text("00400000-00452000 r-xp 00000000 08:02 173521 /usr/bin/python\n")
    assert devices.host_placement(table, numa_maps=str(tmp_path / "numa_maps"), maps=str(tmp_path / "maps")) is None
    assert devices.host_placement(table, numa_maps=str(tmp_path / "none"), maps=str(tmp_path / "none")) is None


# ---------------------------------------------------------------- page-lock failures
def test_a_failed_registration_is_cleared_explained_and_refused(fake_cuda, monkeypatch):
    log, runtime = fake_cuda
    runtime.fail = {1}
    monkeypatch.setattr(stores, "pin_limits", lambda: {"memlock": 1 << 10, "cgroup": None})
    before = stores.registered_tables()
    with pytest.raises(HostRegisterError) as info:
        HostStore(100, 5, torch.float32, mapped=True, threads=1)
    message = str(info.value)
    assert "\n" not in message
    assert "2000-byte host table" in message and "CUDA error 2" in message
    assert "likely cause: memlock (ulimit -l) 1 KiB is below the table" in message
    assert "cgroup memory limit unlimited" in message and "pin_failure='fallback'" in message
    # the runtime's error is read (cleared) right after the failure: the next launch check sees none
    assert [e[0] for e in log] == ["register", "get_last_error"] and log[1][1] == 2 and runtime.last == 0
    assert stores.registered_tables() == before


def test_the_message_names_a_cgroup_limit_below_the_table(fake_cuda, monkeypatch):
    _, runtime = fake_cuda
    runtime.fail = {1}
    monkeypatch.setattr(stores, "pin_limits", lambda: {"memlock": None, "cgroup": 1024})
    with pytest.raises(HostRegisterError, match=r"likely cause: cgroup memory limit 1 KiB is below the table"):
        stores.pinned_table((100, 5), torch.float32)
    monkeypatch.setattr(stores, "pin_limits", lambda: {"memlock": None, "cgroup": None})
    runtime.calls = 0
    with pytest.raises(HostRegisterError, match="no memlock or cgroup limit below it"):
        stores.pinned_table((100, 5), torch.float32)


def test_a_failed_registration_can_fall_back_to_pageable_memory(fake_cuda, monkeypatch):
    log, runtime = fake_cuda
    runtime.fail = {1}
    monkeypatch.setattr(stores, "pin_limits", lambda: {"memlock": None, "cgroup": None})
    with pytest.warns(RuntimeWarning, match="cudaHostRegister of a 2000-byte host table") as caught:
        store = HostStore(100, 5, torch.float32, threads=1, pin_failure="fallback")
    assert len([w for w in caught if "cudaHostRegister" in str(w.message)]) == 1
    assert not store._registered and not store.pinned and "CUDA error 2" in store.start_up["pin_failure"]
    rows, values = torch.tensor([3, 7, 99]), torch.randn(3, 5)
    store.scatter(rows, values)
    assert torch.equal(store.gather(rows), values) and int(torch.count_nonzero(store.data)) == 15
    store.close()
    assert [e[0] for e in log] == ["register", "get_last_error"]          # nothing to unregister
    with pytest.raises(ValueError, match="pin_failure must be one of"):
        HostStore(100, 5, torch.float32, threads=1, pin_failure="ignore")


def test_a_mapped_bank_falls_back_to_staged_access(fake_cuda, monkeypatch):
    log, runtime = fake_cuda
    runtime.fail = {2}                                     # the second state's table
    monkeypatch.setattr(stores, "pin_limits", lambda: {"memlock": None, "cgroup": None})
    bank = TieredBank.factory(default="host", host_access="mapped", pin_failure="fallback")(100, "cpu")
    bank.add_state("weight", 5, torch.float32)
    with pytest.warns(RuntimeWarning, match="uses host_access='staged' instead of 'mapped'"):
        bank.add_state("momentum_buffer", 5, torch.float32)
    assert bank.host_access == "staged" and not bank.mapped
    report = bank.start_up()
    assert report["weight"]["registered"] and report["momentum_buffer"]["pin_failure"]
    bank.close()


def test_a_refused_bank_releases_the_tables_it_registered(fake_cuda, monkeypatch):
    log, runtime = fake_cuda
    runtime.fail = {2}
    monkeypatch.setattr(stores, "pin_limits", lambda: {"memlock": None, "cgroup": None})
    before = stores.registered_tables()
    bank = TieredBank.factory(default="host", host_access="mapped")(100, "cpu")
    bank.add_state("weight", 5, torch.float32)
    first = bank.store("weight").data.data_ptr()
    with pytest.raises(HostRegisterError):
        bank.add_state("momentum_buffer", 5, torch.float32)
    assert ("unregister", first) in log and stores.registered_tables() == before
    with pytest.raises(ValueError, match="pin_failure must be one of"):
        TieredBank.factory(pin_failure="retry")


def test_a_table_never_closed_is_unregistered_when_collected(fake_cuda):
    log, _ = fake_cuda
    before = stores.registered_tables()
    store = HostStore(100, 5, torch.float32, mapped=True, threads=1)
    ptr = store.data.data_ptr()
    assert stores.registered_tables() == before + 1
    del store
    gc.collect()
    assert log[-1] == ("unregister", ptr) and stores.registered_tables() == before
    kept = HostStore(100, 5, torch.float32, threads=1)
    kept.close()
    kept.close()
    assert [e[0] for e in log].count("unregister") == 2


def test_pin_limits_read_the_processs_cgroup(tmp_path):
    (tmp_path / "cgroup").write_text("0::/job/step0\n")
    (tmp_path / "root" / "job" / "step0").mkdir(parents=True)
    (tmp_path / "root" / "job" / "step0" / "memory.max").write_text("34359738368\n")
    limits = stores.pin_limits(cgroup=str(tmp_path / "cgroup"), cgroup_root=str(tmp_path / "root"))
    assert limits["cgroup"] == 32 << 30
    (tmp_path / "root" / "job" / "step0" / "memory.max").write_text("max\n")
    assert stores.pin_limits(cgroup=str(tmp_path / "cgroup"), cgroup_root=str(tmp_path / "root"))["cgroup"] is None
    (tmp_path / "cgroup").write_text("12:memory:/slurm/uid_1/job_7\n")
    (tmp_path / "root" / "memory" / "slurm" / "uid_1" / "job_7").mkdir(parents=True)
    (tmp_path / "root" / "memory" / "slurm" / "uid_1" / "job_7" / "memory.limit_in_bytes").write_text("1073741824")
    assert stores.pin_limits(cgroup=str(tmp_path / "cgroup"), cgroup_root=str(tmp_path / "root"))["cgroup"] == 1 << 30
    assert "memlock" in limits


def test_the_job_config_chooses_the_page_lock_failure(fake_cuda, monkeypatch):
    from ds_pfc.app.config import BankConfig, ConfigError
    _, runtime = fake_cuda
    runtime.fail = {1}
    monkeypatch.setattr(stores, "pin_limits", lambda: {"memlock": None, "cgroup": None})
    bank = BankConfig(default="host", pin_failure="fallback").build()(100, "cpu")
    with pytest.warns(RuntimeWarning, match="kept in pageable memory"):
        bank.add_state("weight", 5, torch.float32)
    assert bank.start_up()["weight"]["pin_failure"]
    bank.close()
    runtime.calls = 0
    with pytest.raises(HostRegisterError):
        BankConfig(default="host").build()(100, "cpu").add_state("weight", 5, torch.float32)
    with pytest.raises(ConfigError, match="ds_pfc.head.bank.pin_failure must be one of"):
        BankConfig(default="host", pin_failure="ignore")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: a real failed cudaHostRegister, cleared "
                                                          "from the runtime torch uses, before a kernel launch")
def test_on_cuda_a_failed_registration_leaves_no_error_behind():
    table = torch.empty(1 << 22)                            # 16 MiB
    runtime, nbytes = torch.cuda.cudart(), table.numel() * table.element_size()
    assert int(runtime.cudaHostRegister(table.data_ptr(), nbytes, 0)) == 0
    try:
        err = int(runtime.cudaHostRegister(table.data_ptr(), nbytes, 0))     # already registered: fails
        assert err != 0
        assert stores._clear_cuda_error() == err, "cudaGetLastError of torch's runtime was not reached"
        x = torch.ones(4, device="cuda") * 2               # the launch check after it sees no error
        torch.cuda.synchronize()
        assert float(x.sum()) == 8.0
    finally:
        runtime.cudaHostUnregister(table.data_ptr())
