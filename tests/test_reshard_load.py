"""Loading head shards at another world size: each rank reads only the rows of its
own classes (safetensors slices of the one or few shards holding them), the
content checks of a load are spread over the ranks, and a 4 -> 3 reshard needs
about one shard of memory, not the whole head.

Source checkpoints are written here with plain safetensors in the documented shard
format (class ranges ``C // W + (r < C % W)``, metadata, CRC-32 per tensor), and the
reference is the concatenation of those files read back with plain safetensors.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import zlib

import pytest
import safetensors
import safetensors.torch
import torch

from _dist import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FORMAT = "ds_pfc.head_shard/1"


# ------------------------------------------------------------------------ an independent writer and reader
def _bounds(num_classes, world, rank):
    base, extra = divmod(num_classes, world)
    start = base * rank + min(rank, extra)
    return start, start + base + (rank < extra)


def _shard_name(name, rank, world):
    return f"{name}-rank{rank:05d}-of-{world:05d}.safetensors"


def _crc(t):
    return f"{zlib.crc32(t.contiguous().reshape(-1).view(torch.uint8).numpy()):08x}"


def _write_checkpoint(directory, states, *, num_classes, world, sub_centers=1, name="head",
                      margin_state='{"t": 0.3125}', optimizer="AdamW(betas=(0.9, 0.999))"):
    """``states`` (full ``[C K, ...]`` tensors) as ``world`` shard files."""
    os.makedirs(directory, exist_ok=True)
    d = states["weight"].shape[1]
    for r in range(world):
        lo, hi = _bounds(num_classes, world, r)
        part = {k: v[lo * sub_centers:hi * sub_centers].contiguous() for k, v in states.items()}
        meta = {"format": FORMAT, "optimizer": optimizer, "tensor_model_parallel": "true", "partition_dim": "0",
                "states": json.dumps(list(part)),
                "dtypes": json.dumps({k: str(v.dtype).removeprefix("torch.") for k, v in part.items()}),
                "num_classes": str(num_classes), "embedding_size": str(d), "class_start": str(lo),
                "num_local": str(hi - lo), "world_size": str(world), "rank": str(r), "seed": "7",
                "sample_step": "123", "step_count": "45", "sub_centers": str(sub_centers),
                "margin_state": margin_state, "crc32": ",".join(_crc(t) for t in part.values())}
        safetensors.torch.save_file(part, os.path.join(directory, _shard_name(name, r, world)), metadata=meta)


def _reference(directory, world, name="head"):
    """Every shard read whole with plain safetensors, concatenated in rank order."""
    parts = [safetensors.torch.load_file(os.path.join(directory, _shard_name(name, r, world))) for r in range(world)]
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def _data_range(path, tensor):
    """Absolute byte range of ``tensor``'s data in safetensors file ``path``."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    begin, end = header[tensor]["data_offsets"]
    return 8 + n + begin, 8 + n + end


def _flip(path, offset, count=4):
    with open(path, "r+b") as f:
        f.seek(offset)
        data = f.read(count)
        f.seek(offset)
        f.write(bytes(b ^ 0x5A for b in data))


def _states(rows, d, seed, optimizer="adamw"):
    g = torch.Generator().manual_seed(seed)
    out = {"weight": torch.randn(rows, d, generator=g)}
    if optimizer == "adamw":
        out["exp_avg"] = torch.randn(rows, d, generator=g)
        out["exp_avg_sq"] = torch.rand(rows, d, generator=g)
        out["step"] = torch.randint(1, 1000, (rows,), generator=g, dtype=torch.int32)
    else:
        out["momentum_buffer"] = torch.randn(rows, d, generator=g)
    return out


# ------------------------------------------------------------------------ a) the rows each rank reads
CASES = [(4, 3), (3, 4), (2, 5), (1, 3)]


@pytest.mark.parametrize("sub_centers,optimizer", [(1, "adamw"), (3, "sgd")])
@pytest.mark.parametrize("src,dst", CASES, ids=[f"{a}to{b}" for a, b in CASES])
def test_rows_of_each_new_rank_equal_the_concatenated_shards(tmp_path, src, dst, sub_centers, optimizer):
    """Every destination rank's rows, for every state, equal (bitwise, same dtype) the
    rows of the concatenated source files; the common metadata (sampler seed and
    step, optimizer steps, margin state) comes through; only the overlapping shards
    are read: the tensor bytes of every other shard are damaged, and the read
    (checksums on) still succeeds."""
    from ds_pfc.checkpoint import shards as ckpt
    C, d = 1021 if sub_centers == 1 else 347, 6
    directory = str(tmp_path / "src")
    _write_checkpoint(directory, _states(C * sub_centers, d, seed=src * 10 + dst, optimizer=optimizer),
                      num_classes=C, world=src, sub_centers=sub_centers)
    ref = _reference(directory, src)
    for r in range(dst):
        lo, hi = _bounds(C, dst, r)
        overlapping = {q for q in range(src) if max(lo, _bounds(C, src, q)[0]) < min(hi, _bounds(C, src, q)[1])}
        damaged = str(tmp_path / f"damaged{r}")
        shutil.copytree(directory, damaged)
        for q in set(range(src)) - overlapping:
            path = os.path.join(damaged, _shard_name("head", q, src))
            for key in ref:
                begin, end = _data_range(path, key)
                if end > begin:
                    _flip(path, begin + (end - begin) // 2)
        shards = ckpt.open_shards(damaged)
        assert set(shards.sources(lo, hi)) == overlapping
        got = shards.read_rows(lo, hi)
        assert sorted(got) == sorted(ref)
        for key, full in ref.items():
            want = full[lo * sub_centers:hi * sub_centers]
            assert got[key].dtype == want.dtype and got[key].shape == want.shape, (r, key)
            assert torch.equal(got[key], want), (r, key)
        assert shards.meta["sample_step"] == 123 and shards.meta["step_count"] == 45 and shards.meta["seed"] == 7
        assert json.loads(shards.meta["margin_state"]) == {"t": 0.3125}
        assert shards.meta["sub_centers"] == sub_centers and shards.meta["world_size"] == src


_HEADS_SCRIPT = r"""
import sys
import torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from ds_pfc import PartialFC
from ds_pfc.core.margins import CurricularFace
from ds_pfc.deepspeed_plugin.checkpointing import _load_resharded
jobs, out = torch.load(sys.argv[1]), {}
for key, (directory, src, dst, C, d, k, optimizer) in jobs.items():
    for rank in range(dst):
        dist.init_process_group("fake", rank=rank, world_size=dst, store=FakeStore())   # rank `rank` of `dst`
        kw = dict(momentum=0.9) if optimizer == "sgd" else {}
        head = PartialFC(C, d, optimizer=optimizer, margin=CurricularFace(), sub_centers=k, seed=0, **kw)
        _load_resharded(head, directory, "head", src)
        out[key, rank] = {"range": (head.class_start, head.class_end), "state": head.training_state(),
                          "rows": {n: t for n, t in head.state_dict().items() if n not in ("meta", "margin_state")}}
        dist.destroy_process_group()
torch.save(out, sys.argv[2])
"""


def test_heads_of_every_new_rank_load_their_rows_and_the_run_state(tmp_path):
    """Real heads, one rank of each destination world size at a time in a fresh
    process (a fake process group stands for the others), load through the resume
    path: every state's rows bitwise those of the concatenated source files, and
    the sampler seed and step, the optimizer step count and the margin's running
    state are the checkpoint's."""
    if importlib.util.find_spec("torch.testing._internal.distributed.fake_pg") is None:
        pytest.skip("this torch has no fake process group to stand for the other ranks")
    jobs = {}
    for (src, dst), (k, optimizer) in zip(CASES, [(1, "adamw"), (2, "sgd"), (1, "sgd"), (2, "adamw")]):
        C, d = 211, 5
        directory = str(tmp_path / f"{src}to{dst}")
        _write_checkpoint(directory, _states(C * k, d, seed=src + dst, optimizer=optimizer), num_classes=C,
                          world=src, sub_centers=k, optimizer=optimizer)
        jobs[f"{src}to{dst}"] = (directory, src, dst, C, d, k, optimizer)
    torch.save(jobs, str(tmp_path / "jobs.pt"))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", _HEADS_SCRIPT, str(tmp_path / "jobs.pt"), str(tmp_path / "out.pt")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = torch.load(str(tmp_path / "out.pt"), weights_only=False)
    for key, (directory, src, dst, C, d, k, optimizer) in jobs.items():
        ref = _reference(directory, src)
        for rank in range(dst):
            out = results[key, rank]
            lo, hi = _bounds(C, dst, rank)
            assert out["range"] == (lo, hi)
            assert sorted(out["rows"]) == sorted(ref), (key, rank)
            for name, full in ref.items():
                got = out["rows"][name]
                assert got.dtype == full.dtype and torch.equal(got, full[lo * k:hi * k]), (key, rank, name)
            state = out["state"]
            assert (state["seed"], state["sample_step"], state["step_count"]) == (7, 123, 45), (key, rank)
            assert state["margin_state"] == {"t": 0.3125} and state["world_size"] == dst


def test_offline_reshard_matches_and_keeps_checksums(tmp_path):
    """``reshard`` (one new shard in memory at a time) writes shards that concatenate
    to the source and carry checksums that catch a changed byte."""
    from ds_pfc.checkpoint import shards as ckpt
    C, d = 1021, 5
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    _write_checkpoint(src, _states(C, d, seed=1), num_classes=C, world=4)
    paths = ckpt.reshard(src, dst, 3)
    assert [os.path.basename(p) for p in paths] == [_shard_name("head", r, 3) for r in range(3)]
    ref, out = _reference(src, 4), _reference(dst, 3)
    for key in ref:
        assert out[key].dtype == ref[key].dtype and torch.equal(out[key], ref[key]), key
    for p in paths:
        ckpt.verify_shard(p)
    begin, end = _data_range(paths[1], "exp_avg")
    _flip(paths[1], (begin + end) // 2)
    with pytest.raises(ckpt.ShardChecksumError, match=_shard_name("head", 1, 3)):
        ckpt.verify_shard(paths[1])


# ------------------------------------------------------------------------ b) damage in what a rank reads
def test_damage_in_a_source_shard_is_caught_whether_or_not_its_rows_are_read(tmp_path):
    """With checksums on, a reader notices damage anywhere in a shard it reads from,
    in the rows it reads or in others, and so does a merge of every shard; a
    truncated shard is refused by the header checks before any row is read."""
    from ds_pfc.checkpoint import shards as ckpt
    C, d = 1021, 6
    directory = str(tmp_path / "src")
    _write_checkpoint(directory, _states(C, d, seed=2), num_classes=C, world=4)
    lo, hi = _bounds(C, 3, 1)           # rank 1 of 3 reads shards 1 and 2 of 4
    path = os.path.join(directory, _shard_name("head", 2, 4))
    s_lo, _ = _bounds(C, 4, 2)
    begin, _ = _data_range(path, "weight")
    row_bytes = d * 4
    for row in (hi - 1 - s_lo, hi + 3 - s_lo):      # a row rank 1 reads, a row it does not read
        shutil.copy2(path, path + ".orig")
        _flip(path, begin + row * row_bytes)
        with pytest.raises(ckpt.ShardChecksumError, match=_shard_name("head", 2, 4)):
            ckpt.open_shards(directory).read_rows(lo, hi)
        with pytest.raises(ckpt.ShardChecksumError, match=_shard_name("head", 2, 4)):
            ckpt.merge_shards(directory)            # shards read whole: checked from the rows read
        os.replace(path + ".orig", path)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 100)
    with pytest.raises(ckpt.ShardReadError, match=_shard_name("head", 2, 4)):
        ckpt.open_shards(directory)


def test_content_checks_are_shared_out_and_cover_every_file(tmp_path):
    """The shares of ``verify_share`` over 3 ranks are disjoint and together cover
    every ``torch.save`` file and every shard of the heads read in slices; shards of
    heads read whole are left to their readers."""
    from ds_pfc.checkpoint import tags
    tag_dir = str(tmp_path / "t")
    _write_checkpoint(tag_dir, _states(101, 3, seed=3), num_classes=101, world=4, name="a")
    _write_checkpoint(tag_dir, _states(50, 3, seed=4), num_classes=50, world=2, name="b")
    engine_files = {}
    for n in ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"] + \
            [tags.rank_state_name(r, 4) for r in range(4)]:
        torch.save({"n": n}, os.path.join(tag_dir, n))
        if not n.startswith("rank_state"):
            engine_files[n] = os.path.getsize(os.path.join(tag_dir, n))
    marker = {"tag": "t", "world_size": 4, "heads": ["a", "b"], "engine_files": engine_files,
              "head_layouts": {"a": {"world_size": 4}, "b": {"world_size": 2}}}
    tags.verify_tag(tag_dir, marker)
    shares = [tags.verify_share(tag_dir, marker, rank=r, world_size=3, shard_heads=["a"]) for r in range(3)]
    every = [p for share in shares for p in share]
    expected = {os.path.join(tag_dir, n) for n in engine_files} | \
        {os.path.join(tag_dir, tags.rank_state_name(r, 4)) for r in range(4)} | \
        {os.path.join(tag_dir, _shard_name("a", r, 4)) for r in range(4)}
    assert sorted(every) == sorted(expected)              # each once, shards of "b" left to their readers
    assert max(len(s) for s in shares) - min(len(s) for s in shares) <= 1
    # a damaged shard of "a" is reported by the one rank whose share holds it, naming it
    victim = os.path.join(tag_dir, _shard_name("a", 3, 4))
    begin, end = _data_range(victim, "weight")
    _flip(victim, (begin + end) // 2)
    owners = []
    for r in range(3):
        try:
            tags.verify_share(tag_dir, marker, rank=r, world_size=3, shard_heads=["a"])
        except tags.CheckpointCorruptError as err:
            assert victim in str(err) and err.path == victim
            owners.append(r)
    assert owners == [next(r for r, s in enumerate(shares) if victim in s)]


# ------------------------------------------------------------------------ b) end to end: 2 ranks save, 3 load
C_E, D_E = 23, 4


def _engine(rank, world_size, port):
    import deepspeed

    from ds_pfc import PartialFC
    from ds_pfc.deepspeed_plugin import attach, initialize
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    deepspeed.init_distributed(dist_backend="gloo")

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.fc = torch.nn.Linear(8, D_E)

        def forward(self, x, y):
            return self.cls(self.fc(x), y)

    model = Net()
    attach(model, "cls", PartialFC(C_E, D_E, sample_rate=0.6, optimizer="adamw", seed=5,
                                   device=torch.device("cpu")))
    return initialize(model=model, config={"train_micro_batch_size_per_gpu": 3, "steps_per_print": 10 ** 9,
                                           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})


def _save_worker(rank, world_size, base, port):
    engine = _engine(rank, world_size, port)
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        engine.backward(engine(torch.randn(3, 8, generator=g), torch.randint(0, C_E, (3,), generator=g)))
        engine.step()
    engine.save_checkpoint(os.path.join(base, "ckpt"), "a")


def _load_worker(rank, world_size, base, port):
    from ds_pfc.checkpoint import shards as ckpt
    from ds_pfc.checkpoint import tags
    engine = _engine(rank, world_size, port)
    checked, verified = [], []
    check, verify = tags.check_content, ckpt.verify_shard

    def spy_check(path):
        checked.append(os.path.basename(path))
        return check(path)

    def spy_verify(path):
        verified.append(os.path.basename(path))
        return verify(path)

    tags.check_content, ckpt.verify_shard = spy_check, spy_verify
    save_dir = os.path.join(base, "ckpt")
    out = {}
    try:
        engine.load_checkpoint(save_dir, "a")
        head = engine.heads["cls"]
        out["rows"] = {k: v for k, v in head.state_dict().items() if k != "meta"}
        out["range"] = (head.class_start, head.class_end)
        out["state"] = head.training_state()
        out["checked"], out["verified"] = list(checked), list(verified)
        victims = {"shard": os.path.join(save_dir, "a", "cls-rank00001-of-00002.safetensors"),
                   "rank_state": os.path.join(save_dir, "a", "rank_state-00000-of-00002.pt")}
        for what, path in victims.items():
            if rank == 0:
                shutil.copy2(path, path + ".orig")
                begin = _data_range(path, "weight")[0] + 4 if what == "shard" else os.path.getsize(path) // 2
                _flip(path, begin, 16)
            torch.distributed.barrier()
            try:
                engine.load_checkpoint(save_dir, "a")
                out[what] = None
            except tags.CheckpointError as err:
                out[what] = (type(err).__name__, str(err), err.path)
            torch.distributed.barrier()
            if rank == 0:
                os.replace(path + ".orig", path)
            torch.distributed.barrier()
    finally:
        tags.check_content, ckpt.verify_shard = check, verify
    return out


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_three_ranks_load_a_two_rank_checkpoint_sharing_the_checks(tmp_path):
    """Each of 3 ranks loads exactly its rows of the 2-rank AdamW head (every state,
    the sampler's step) and checks only its share of the tag's files, every file
    once; a damaged shard or rank-state file stops every rank with the same
    CheckpointCorruptError naming it."""
    import glob
    base = str(tmp_path)
    ports = [_free_port(), _free_port()]
    try:
        run_ranks(_save_worker, 2, base, ports[0])
        tag_dir = os.path.join(base, "ckpt", "a")
        ref = _reference(tag_dir, 2, name="cls")
        with safetensors.safe_open(os.path.join(tag_dir, _shard_name("cls", 0, 2)), framework="pt") as f:
            saved = f.metadata()
        results = run_ranks(_load_worker, 3, base, ports[1])
    finally:
        for port in ports:
            for name in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_127.0.0.1_{port}_*"):
                os.remove(name)
    assert ref["exp_avg"].abs().sum() > 0 and int(ref["step"].max()) > 0       # the optimizer state is real
    for r, out in enumerate(results):
        lo, hi = _bounds(C_E, 3, r)
        assert out["range"] == (lo, hi)
        assert sorted(out["rows"]) == sorted(ref)
        for key, full in ref.items():
            assert out["rows"][key].dtype == full.dtype and torch.equal(out["rows"][key], full[lo:hi]), (r, key)
        assert out["state"]["sample_step"] == int(saved["sample_step"]) > 0
        assert out["state"]["step_count"] == int(saved["step_count"]) == 3
    files = sorted(f for f in os.listdir(tag_dir) if f.endswith((".pt", ".safetensors")))
    checked = [f for out in results for f in out["checked"]]
    assert sorted(checked) == files, checked                         # every file, once, by some rank
    assert all(len(out["checked"]) <= -(-len(files) // 3) for out in results)
    for out in results:      # no rank verified a shard outside its share (reading uses the shared checks)
        assert sorted(out["verified"]) == sorted(f for f in out["checked"] if f.endswith(".safetensors"))
    for what, name in (("shard", "cls-rank00001-of-00002.safetensors"), ("rank_state", "rank_state-00000-of-00002.pt")):
        errors = [out[what] for out in results]
        assert errors[0] is not None and errors[0][0] == "CheckpointCorruptError", errors
        assert all(e == errors[0] for e in errors), errors                  # the same error on every rank
        assert errors[0][2] == os.path.join(tag_dir, name) and name in errors[0][1], errors[0]


# ------------------------------------------------------------------------ c) memory of a 4 -> 3 reshard
C_M, D_M = 100_003, 256          # AdamW: ~300 MB of head state, ~100 MB per destination rank

_RSS_SCRIPT = r"""
import json, sys
import torch, torch.distributed as dist
import safetensors.torch
from torch.testing._internal.distributed.fake_pg import FakeStore
tag_dir, rank, world, src, C, D = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), \
    int(sys.argv[5]), int(sys.argv[6])
dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())   # one rank of `world`, alone
from ds_pfc import PartialFC
from ds_pfc.deepspeed_plugin.checkpointing import _load_resharded

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))

head = PartialFC(C, D, optimizer="adamw", seed=7)          # its own rows exist before the load
with open("/proc/self/clear_refs", "w") as f:              # the high-water mark restarts here
    f.write("5")
base = status("VmRSS")
_load_resharded(head, tag_dir, "head", src)
extra = status("VmHWM") - base
sd = head.state_dict()
parts = [safetensors.torch.load_file(f"{tag_dir}/head-rank{q:05d}-of-{src:05d}.safetensors") for q in range(src)]
equal = {k: bool(torch.equal(sd[k], torch.cat([p[k] for p in parts])[head.class_start:head.class_end]))
         for k in parts[0]}
print(json.dumps({"extra": extra, "range": [head.class_start, head.class_end], "equal": equal,
                  "sample_step": head.sample_step, "step_count": head.step_count}))
"""


def test_peak_memory_of_a_4_to_3_reshard_is_about_one_own_shard(tmp_path):
    """A fresh process holding rank 1 of 3 of a ~300 MB AdamW head loads it from 4
    shards: its memory high-water mark rises by at most 1.5x its own shard (merging
    all shards first would need the whole head, twice), and the rows are bitwise
    those of the concatenated files."""
    if importlib.util.find_spec("torch.testing._internal.distributed.fake_pg") is None:
        pytest.skip("this torch has no fake process group to stand for the other ranks")
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError as err:
        pytest.skip(f"the memory high-water mark cannot be reset here (/proc/self/clear_refs: {err})")
    directory = str(tmp_path / "src")
    _write_checkpoint(directory, _states(C_M, D_M, seed=9), num_classes=C_M, world=4, margin_state="{}")
    lo, hi = _bounds(C_M, 3, 1)
    own = (hi - lo) * (3 * D_M * 4 + 4)           # weight, exp_avg, exp_avg_sq (float32 [d]) and step (int32)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, directory, "1", "3", "4", str(C_M), str(D_M)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["range"] == [lo, hi]
    assert out["equal"] == {"weight": True, "exp_avg": True, "exp_avg_sq": True, "step": True}
    assert out["sample_step"] == 123 and out["step_count"] == 45
    assert out["extra"] <= 1.5 * own, f"peak rose by {out['extra'] / 2**20:.0f} MB for a {own / 2**20:.0f} MB shard"
