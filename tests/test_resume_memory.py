"""Resume streams a head shard into the bank row block by row block: the memory a load
needs is bounded by its chunk, never a whole state, whatever tier holds the state.

The counter sees every tensor storage a torch op creates while the load runs (a
``TorchDispatchMode``: a storage that aliases none of the op's inputs is new; it counts
until its last reference dies) and every Python-level allocation (``tracemalloc``: the
checksum pass's buffer, numpy). On a CPU the bank's "device" tier is host memory too, so
one counter bounds both. The staged fetch is bounded the same way, by its own chunk.
"""
from __future__ import annotations

import tracemalloc

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ds_pfc import PartialFC
from ds_pfc.bank.quantized import INT8_ROWWISE
from ds_pfc.bank.tiered import TieredBank
from ds_pfc.checkpoint import shards as ckpt
from ds_pfc.core import head as head_module

C, D = 16384, 64                 # 4 MiB per float32 state
CHUNK = 64 << 10
# What a load may hold beyond the chunk: the read buffer is one chunk; the bank's block
# conversion (float32 -> bfloat16 storage) or 8-bit coding of a block takes at most three
# more chunk-sized temporaries; the row ids of a block and bookkeeping stay under 64 KiB.
BOUND = 4 * CHUNK + (64 << 10)


class LiveBytes(TorchDispatchMode):
    """Peak bytes of tensor storages created inside the mode and still alive."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        out = func(*args, **kwargs)
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                if storage.data_ptr() and storage.data_ptr() not in inputs:
                    ref = StorageWeakRef(storage)
                    self.live.setdefault(ref.cdata, (ref, storage.nbytes()))
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out


def _peak(fn) -> tuple[int, int]:
    """(peak live torch bytes, peak Python bytes) while ``fn`` runs."""
    with LiveBytes():                # the first dispatch mode imports torch's compiler stack: not the load's
        torch.empty(1)
    tracemalloc.start()
    tracemalloc.reset_peak()
    try:
        with LiveBytes() as counter:
            fn()
        _, python_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return counter.peak, python_peak


BANKS = {
    "device": None,
    "host-bf16-int8": TieredBank.factory({"weight": ("host", torch.bfloat16),
                                          "momentum_buffer": ("device", INT8_ROWWISE)}, default="host"),
    "host-mapped": TieredBank.factory(default="host", host_access="mapped"),
}


def _head(bank):
    return PartialFC(C, D, sample_rate=0.05, seed=5, optimizer="sgd", momentum=0.9, bank=bank)


def _trained(bank):
    head = _head(bank)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        head(torch.randn(16, D, generator=gen), torch.randint(0, C, (16,), generator=gen)).backward()
        head.step(0.5)
    return head


def _saved_states(head) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in head.state_dict().items()}


@pytest.mark.parametrize("bank", list(BANKS))
def test_a_shard_loads_block_by_block_within_its_chunk(bank, tmp_path):
    source = _trained(BANKS[bank])
    ckpt.save_head_shard(source, str(tmp_path))
    saved = _saved_states(source)
    source.close()
    head = _head(BANKS[bank])
    torch_peak, python_peak = _peak(lambda: ckpt.load_head_shard(head, str(tmp_path), chunk_bytes=CHUNK))
    whole = C * D * 4
    assert torch_peak + python_peak <= BOUND < whole, (torch_peak, python_peak)
    loaded = head.state_dict()
    for key, value in saved.items():
        assert loaded[key].dtype == value.dtype and torch.equal(loaded[key], value), key
    assert head.training_state() == source.training_state()
    head.close()


def test_the_memory_counter_sees_a_whole_state_load(tmp_path):
    """The counter is not blind: loading the same shard in one block needs a whole state."""
    source = _trained(None)
    ckpt.save_head_shard(source, str(tmp_path))
    head = _head(None)
    torch_peak, python_peak = _peak(lambda: ckpt.load_head_shard(head, str(tmp_path), chunk_bytes=C * D * 4))
    assert torch_peak >= C * D * 4


def test_zeroed_optimizer_states_stream_too(tmp_path):
    source = _trained(BANKS["host-bf16-int8"])
    ckpt.save_head_shard(source, str(tmp_path))
    head = _head(BANKS["host-bf16-int8"])
    torch_peak, python_peak = _peak(lambda: ckpt.load_head_shard(head, str(tmp_path), chunk_bytes=CHUNK,
                                                                 optimizer_states="zero"))
    assert torch_peak + python_peak <= BOUND
    assert torch.equal(head.state_dict()["weight"], source.state_dict()["weight"])
    assert int(torch.count_nonzero(head.state_dict()["momentum_buffer"])) == 0


def test_a_state_dict_reaches_the_bank_in_blocks(monkeypatch):
    """``load_state_dict`` of a host state dict never makes a whole-state copy (on a GPU:
    never moves a whole state to the device)."""
    source = _trained(BANKS["host-bf16-int8"])
    saved = _saved_states(source)
    head = _head(BANKS["host-bf16-int8"])
    monkeypatch.setattr(head_module, "LOAD_CHUNK_BYTES", CHUNK)
    torch_peak, _ = _peak(lambda: head.load_state_dict(saved))
    assert torch_peak <= BOUND, torch_peak
    for key, value in saved.items():
        assert torch.equal(head.state_dict()[key], value), key


def test_a_file_that_changes_during_the_load_is_reported(tmp_path, monkeypatch):
    source = _trained(None)
    path = ckpt.save_head_shard(source, str(tmp_path))
    head = _head(None)
    before = _saved_states(head)
    with open(path, "r+b") as f:                 # damage the last byte of the last tensor
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 0xFF]))
    with pytest.raises(ckpt.ShardChecksumError, match="do not match the checksum"):
        ckpt.load_head_shard(head, str(tmp_path), chunk_bytes=CHUNK)
    for key, value in head.state_dict().items():                # checked before anything changed
        assert torch.equal(value, before[key]), key
    monkeypatch.setattr(ckpt, "verify_shard", lambda path, chunk_bytes=None: None)   # as if it changed after
    with pytest.raises(ckpt.ShardChecksumError, match="changed while loading.*partly loaded"):
        ckpt.load_head_shard(head, str(tmp_path), chunk_bytes=CHUNK)
    with pytest.raises(ValueError, match="chunk_bytes must be a positive integer"):
        ckpt.load_head_shard(head, str(tmp_path), chunk_bytes=0)


@pytest.mark.parametrize("bank", ["device", "host-bf16-int8"])
def test_a_resharded_load_streams_too(bank, tmp_path):
    """Loading from shards of another world size (2 -> 1 here) reads the head's classes a
    block at a time: one block of every state, the bank's block work, never the shard."""
    source = _trained(BANKS[bank])
    ckpt.save_head_shard(source, str(tmp_path / "one"))
    ckpt.reshard(str(tmp_path / "one"), str(tmp_path / "two"), 2)
    saved = _saved_states(source)
    head = _head(BANKS[bank])
    shards = ckpt.open_shards(str(tmp_path / "two"))
    torch_peak, python_peak = _peak(lambda: ckpt.load_resharded(head, shards, chunk_bytes=CHUNK))
    # two states: one block of each read, plus the bank's work on one block
    assert torch_peak + python_peak <= BOUND + CHUNK < C * D * 4, (torch_peak, python_peak)
    for key, value in saved.items():
        assert torch.equal(head.state_dict()[key], value), key
    assert head.training_state() == source.training_state()


# ---------------------------------------------------------------- the staged fetch
@pytest.mark.parametrize("placement", [
    {"weight": ("device", torch.bfloat16)},                                  # a device table, converted
    {"weight": ("host", torch.bfloat16)},                                    # a staged copy landed at positions
    {"weight": "device", "momentum_buffer": ("device", INT8_ROWWISE)},       # 8-bit rows decoded
    {"weight": "host", "momentum_buffer": ("host", INT8_ROWWISE)},           # 8-bit codes crossed
])
def test_a_staged_fetch_holds_no_temporary_larger_than_its_chunk(monkeypatch, placement):
    """The staged fetch gathers, decodes and lands the cold rows a chunk at a time: its
    peak of new tensors, past the reusable host staging buffer, stays within a few chunks
    whatever the number of rows (a whole-set temporary is 16x the chunk here), and the
    slot holds exactly the bank's rows (read independently, whole)."""
    from ds_pfc.bank import staged
    monkeypatch.setenv("DS_PFC_DEBUG_STREAMS", "0")
    chunk = 16 << 10
    monkeypatch.setattr(staged, "FETCH_CHUNK_BYTES", chunk)
    bank = TieredBank(C, "cpu", placements=TieredBank.factory(placement, default="host")(C, "cpu").placements)
    g = torch.Generator().manual_seed(0)
    bank.add_state("weight", D, torch.float32, init=torch.randn(C, D, generator=g))
    bank.add_state("momentum_buffer", D, torch.float32, init=torch.randn(C, D, generator=g))
    stager = staged.StagedStager(bank)
    try:
        rows = torch.randperm(C, generator=g)[:4096].sort().values          # 1 MiB per float32 state
        positions = torch.arange(rows.numel()).flip(0)
        slot = stager._empty_slot(rows, pooled=False)
        stager._fetch(slot, positions, rows)                                 # the staging buffers, made once
        slot.states = {n: torch.zeros_like(t) for n, t in slot.states.items()}
        peak, _ = _peak(lambda: stager._fetch(slot, positions, rows))
        whole = rows.numel() * D * 4
        assert peak <= 4 * chunk + (64 << 10), (peak, whole)
        for name, got in slot.states.items():
            expected = bank.export(name).index_select(0, rows)
            assert torch.equal(got.index_select(0, positions), expected), name
    finally:
        stager.close()


@pytest.mark.parametrize("how", ["write_rows", "write_rows-masked", "code_rows"])
def test_coding_8_bit_rows_without_the_kernels_holds_a_chunk(monkeypatch, how):
    """Without the codec kernels, 8-bit rows are coded with torch ops a chunk at a time:
    the new tensors stay within a few chunks (the set's float32 rows are 16x the chunk),
    and the codes equal the whole set coded at once."""
    from ds_pfc.bank import quantized
    chunk = 16 << 10
    monkeypatch.setattr(quantized, "CODE_CHUNK_BYTES", chunk)
    g = torch.Generator().manual_seed(1)
    n = 4096
    values = torch.randn(n, D, generator=g)
    rows = torch.randperm(C, generator=g)[:n]
    mask = torch.rand(n, generator=g) < 0.5 if how.endswith("masked") else None
    store = quantized.RowwiseInt8Store(C, D, "device", "cpu")
    q0, s0 = store.q.clone(), store.scale.clone()
    if how == "code_rows":
        q, s = torch.empty(n, D, dtype=torch.int8), torch.empty(n)
        peak, _ = _peak(lambda: quantized.RowwiseInt8Store.code_rows(values, q, s))
    else:
        peak, _ = _peak(lambda: store.write_rows(rows, values, None, mask))
    assert peak <= 4 * chunk + (64 << 10), peak
    # Independent reference: each row coded alone (s = max|v| / 127, q = round-half-even(v / s)).
    scale = values.abs().amax(dim=1) / 127
    codes = torch.round(values / scale.clamp(min=torch.finfo(torch.float32).tiny)[:, None]).to(torch.int8)
    if how == "code_rows":
        assert torch.equal(q, codes) and torch.equal(s, scale)
    else:
        keep = torch.ones(n, dtype=torch.bool) if mask is None else mask
        q_ref, s_ref = q0.clone(), s0.clone()
        q_ref[rows[keep]], s_ref[rows[keep]] = codes[keep], scale[keep]
        assert torch.equal(store.q, q_ref) and torch.equal(store.scale, s_ref)
