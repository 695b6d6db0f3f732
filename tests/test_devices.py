"""Device placement rules (ds_pfc.devices), checked on CPU with a mocked torch.cuda.

A CUDA tensor's device always carries an index, so ``"cuda"`` must mean the current
device; a launched rank must bind its launcher's local GPU before it builds anything; a head on
an NCCL group must live on CUDA; worker threads must set their device; labels of any
integer dtype cross ranks as int64.
"""
from __future__ import annotations

import pytest
import torch

import ds_pfc
from ds_pfc.core import collectives
from ds_pfc import devices
from ds_pfc.bank.staged import StagedStager
from _dist import run_ranks


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda as on a 4-GPU node whose current device is 3; records set_device."""
    state = {"current": 3, "set": []}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: state["current"])

    def set_device(index):
        state["set"].append(index)
        state["current"] = index
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    return state


@pytest.fixture
def nccl(monkeypatch):
    monkeypatch.setattr(devices, "group_uses_nccl", lambda group=None: True)


def test_indexless_cuda_means_the_current_device(fake_cuda):
    assert devices.normalize_device("cuda") == torch.device("cuda", 3)
    assert devices.normalize_device(torch.device("cuda")) == torch.device("cuda", 3)
    assert devices.normalize_device("cuda:1") == torch.device("cuda", 1)
    assert devices.normalize_device("cpu") == torch.device("cpu")
    # the bug this prevents: a head on torch.device("cuda") refused its own cuda:3 tensors
    assert torch.device("cuda") != torch.device("cuda", 3)


def test_default_head_device_follows_the_group(fake_cuda, monkeypatch):
    assert devices.head_device(None) == torch.device("cpu")               # no process group: CPU
    assert devices.head_device("cuda") == torch.device("cuda", 3)
    monkeypatch.setattr(devices, "group_uses_nccl", lambda group=None: True)
    assert devices.head_device(None) == torch.device("cuda", 3)           # NCCL: the current GPU
    assert devices.head_device("cuda:2") == torch.device("cuda", 2)
    with pytest.raises(ValueError, match="device must be a CUDA device .* NCCL"):
        devices.head_device("cpu")


def test_small_collectives_never_hand_cpu_tensors_to_nccl(fake_cuda, nccl):
    assert devices.collective_device(None, torch.device("cpu")) == torch.device("cuda", 3)


def test_small_collectives_stay_on_the_head_device_under_gloo():
    assert devices.collective_device(None, torch.device("cpu")) == torch.device("cpu")


def test_group_backend_is_read_from_the_group(monkeypatch):
    assert devices.group_uses_nccl() is False                             # nothing initialised
    monkeypatch.setattr(devices.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(devices.dist, "get_backend", lambda group=None: "nccl")
    assert devices.group_uses_nccl("g") is True
    monkeypatch.setattr(devices.dist, "get_backend", lambda group=None: "gloo")
    assert devices.group_uses_nccl("g") is False
    monkeypatch.setattr(devices.dist, "get_backend", lambda group=None: "cpu:gloo,cuda:nccl")
    assert devices.group_uses_nccl("g") is True


def test_a_cpu_head_on_an_nccl_group_is_refused_by_name(fake_cuda, nccl):
    with pytest.raises(ValueError, match="device must be a CUDA device"):
        ds_pfc.PartialFC(10, 8, device="cpu")


def test_bad_device_string_is_a_clear_error():
    with pytest.raises(RuntimeError, match="bogus"):
        ds_pfc.PartialFC(10, 8, device="bogus")


def test_a_launched_rank_binds_its_local_gpu(fake_cuda):
    torchrun = {"RANK": "6", "WORLD_SIZE": "8", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "4"}
    assert devices.bind_local_device(torchrun) == torch.device("cuda", 2)
    assert fake_cuda["set"] == [2]
    assert devices.normalize_device("cuda") == torch.device("cuda", 2)
    assert devices.bind_local_device({}) == torch.device("cuda", 0)       # single process
    # mpirun sets no LOCAL_RANK: the launcher's own local rank is bound
    ompi = {"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "4", "MASTER_ADDR": "node0"}
    assert devices.bind_local_device(ompi) == torch.device("cuda", 1)
    assert devices.bind_local_device({}, local_rank=3) == torch.device("cuda", 3)
    assert fake_cuda["set"] == [2, 0, 1, 3]
    with pytest.raises(RuntimeError, match="LOCAL_RANK=5 but this node has 4"):
        devices.bind_local_device({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "5", "LOCAL_SIZE": "8"})


def test_without_cuda_nothing_is_bound(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    assert devices.bind_local_device({"LOCAL_RANK": "1"}) is None
    assert calls == []


def test_worker_threads_set_their_device(fake_cuda):
    devices.set_thread_device(torch.device("cuda", 1))
    devices.set_thread_device(torch.device("cpu"))
    assert fake_cuda["set"] == [1]


def test_the_bank_worker_sets_the_bank_device_first():
    bank = ds_pfc.TieredBank(12, "cpu", default=ds_pfc.Placement("host"))
    bank.add_state("weight", 4, torch.float32)
    stager = StagedStager(bank)
    try:
        assert stager._io._initializer is devices.set_thread_device
        assert stager._io._initargs == (bank.device,)
    finally:
        stager.close()


def test_training_app_binds_the_gpu_after_the_process_group(monkeypatch):
    """The app must take rank and local rank from the launcher, then call
    deepspeed.init_distributed, then bind cuda:<local rank> before it builds a head,
    data or evaluation (DeepSpeed binds only inside initialize). Under srun (no
    LOCAL_RANK) the bound GPU is SLURM_LOCALID's."""
    import json
    import os

    from ds_pfc import launchers
    from ds_pfc.app import training
    order = []

    class Stop(Exception):
        pass
    srun = {"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "SLURM_LOCALID": "1",
            "SLURM_NODEID": "1", "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
            "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURMD_NODENAME": "gpu08"}
    exported, real_export = {}, launchers.export

    def export(environ=None):
        order.append("export")
        exported.update(srun)
        return real_export(exported)
    monkeypatch.setattr(training.launchers, "export", export)
    monkeypatch.setattr(training, "init_distributed", lambda **kwargs: order.append("init_distributed"))
    monkeypatch.setattr(training.launchers, "check_process_group", lambda launch: order.append("check"))

    def bind(environ=None, local_rank=None):
        order.append(("bind", local_rank))
        raise Stop
    monkeypatch.setattr(training, "bind_local_device", bind)
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs",
                        "cpu_quickstart.json")
    with open(path) as f:
        trainer = training.Trainer(json.load(f))
    with pytest.raises(Stop):
        trainer.setup()
    assert order == ["export", "init_distributed", "check", ("bind", 1)]
    assert (exported["RANK"], exported["WORLD_SIZE"], exported["LOCAL_RANK"], exported["MASTER_ADDR"]) == \
        ("3", "4", "1", "gpu07")


def _int16_label_ranks(rank, world_size):
    seen = []
    original = collectives._gather_rows

    def spy(x, sizes, group):
        seen.append(x.dtype)
        return original(x, sizes, group)
    collectives._gather_rows = spy
    torch.manual_seed(rank)
    head = ds_pfc.PartialFC(11, 8, sample_rate=1.0, data_parallel_grad=False)
    x = torch.randn(3 + rank, 8, requires_grad=True)
    y = torch.tensor([1, 5, 10, 2][: 3 + rank], dtype=torch.int16)
    loss = head(x, y)
    loss.backward()
    head.step(0.1)
    return {"dtypes": seen, "loss": loss.item()}


def test_labels_of_any_integer_dtype_cross_ranks_as_int64():
    results = run_ranks(_int16_label_ranks, 2)
    for r in results:
        assert torch.int16 not in r["dtypes"] and torch.int64 in r["dtypes"], r["dtypes"]
    assert results[0]["loss"] == pytest.approx(results[1]["loss"], rel=1e-6)


# ---------------------------------------------------------------- host tables near their GPU
def test_a_gpus_local_cpus_come_from_sysfs_by_its_pci_address(fake_cuda, monkeypatch, tmp_path):
    class Props:
        pci_domain_id, pci_bus_id, pci_device_id = 0, 0x9A, 0
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: Props())
    (tmp_path / "0000:9a:00.0").mkdir()
    (tmp_path / "0000:9a:00.0" / "local_cpulist").write_text("56-111,168-223\n")
    cpus = devices.local_cpus("cuda:1", sysfs=str(tmp_path))
    assert cpus == set(range(56, 112)) | set(range(168, 224))
    assert devices.local_cpus("cpu", sysfs=str(tmp_path)) is None
    Props.pci_bus_id = 0x1B                                   # no such device in sysfs: unknown
    assert devices.local_cpus("cuda:1", sysfs=str(tmp_path)) is None
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: object())   # an older torch
    assert devices.local_cpus("cuda:1", sysfs=str(tmp_path)) is None


def test_a_host_table_is_touched_from_the_given_cpus_only():
    import os
    table = torch.full((3 << 20,), 7.0)          # 12 MiB: several 2 MiB pages
    before = os.sched_getaffinity(0)
    cpu = min(before)
    seen = {}
    original = os.sched_setaffinity

    def record(pid, cpus):
        seen["cpus"] = set(cpus)
        original(pid, cpus)
    os.sched_setaffinity = record
    try:
        done = devices.place_host_table(table, cpus={cpu})
    finally:
        os.sched_setaffinity = original
    assert float(table.abs().max()) == 0.0
    assert seen["cpus"] == {cpu} and done["cpus"] == 1
    assert os.sched_getaffinity(0) == before        # the caller's own CPUs are untouched
    assert isinstance(done["huge_pages"], bool)


def test_cpu_native_half_reads_the_cpu_flags(tmp_path):
    from ds_pfc.devices import cpu_native_half
    avx2 = tmp_path / "avx2"
    avx2.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n\nprocessor\t: 1\nflags\t\t: fpu avx2\n")
    sapphire = tmp_path / "spr"
    sapphire.write_text("processor\t: 0\nflags\t\t: avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n")
    assert cpu_native_half(torch.bfloat16, str(avx2)) is False
    assert cpu_native_half(torch.float16, str(avx2)) is False
    assert cpu_native_half(torch.bfloat16, str(sapphire)) is True
    assert cpu_native_half(torch.float16, str(sapphire)) is False       # no avx512_fp16 / amx_fp16
    assert cpu_native_half(torch.float32, str(avx2)) is True
    assert cpu_native_half(torch.bfloat16, str(tmp_path / "missing")) is None


def test_head_warns_of_emulated_half_products_on_a_cpu(monkeypatch):
    import warnings
    from ds_pfc import PartialFC
    from ds_pfc.core import head as head_module
    monkeypatch.setattr(head_module, "cpu_native_half", lambda dtype: False)
    with pytest.warns(UserWarning, match=r"compute_dtype=torch.bfloat16 on a CPU without .* emulates"):
        PartialFC(50, 8, compute_dtype=torch.bfloat16, device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        PartialFC(50, 8, device="cpu")                                   # float32: nothing to say
        monkeypatch.setattr(head_module, "cpu_native_half", lambda dtype: True)
        PartialFC(50, 8, compute_dtype=torch.bfloat16, device="cpu")     # native bf16: nothing either


@pytest.mark.parametrize("capability, expected", [
    ((9, 0), torch.bfloat16), ((8, 6), torch.bfloat16), ((8, 0), torch.bfloat16),   # Hopper, Ada/Ampere
    ((7, 5), torch.float16), ((7, 0), torch.float16),                                  # Turing, Volta
    ((6, 0), torch.float32),                                                           # Pascal: no tensor cores
])
def test_auto_products_follow_the_gpus_tensor_cores(fake_cuda, monkeypatch, capability, expected):
    """``compute_dtype`` auto: the 2-byte type the GPU's tensor cores take (bf16 from 8.0,
    fp16 on 7.x), float32 without tensor cores; asked per device ("cuda" = the current one);
    CPU and float64 runs keep their accumulation dtype."""
    from ds_pfc.core import softmax
    asked = []

    def capability_of(index):
        asked.append(index)
        return capability if index == 3 else (9, 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", capability_of)
    softmax._cuda_products.cache_clear()
    try:
        assert softmax.default_compute_dtype("cuda", torch.float32) == expected
        assert softmax.default_compute_dtype(torch.device("cuda", 3), torch.float32) == expected
        assert softmax.default_compute_dtype("cuda:1", torch.float32) == torch.bfloat16
        assert asked == [3, 1]                              # one query per device, then cached
        assert softmax.default_compute_dtype("cuda", torch.float64) == torch.float64
        assert softmax.default_compute_dtype("cpu", torch.float32) == torch.float32
    finally:
        softmax._cuda_products.cache_clear()
