"""Per-rank safetensors checkpoints of the PartialFC head: save, merge, reshard, load, export."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import safetensors.torch
import torch

from _dist import run_ranks
from ds_pfc import PartialFC
from ds_pfc.checkpoint import shards as ckpt
from ds_pfc.core.partition import Partition

C, D, SEED = 1021, 7, 3
KW = dict(sample_rate=0.4, seed=SEED, optimizer="sgd", momentum=0.9)


def _train(head, rank, steps=3):
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        x = torch.randn(8, D, generator=gen)
        y = torch.randint(0, C, (8,), generator=gen)
        head(x, y).backward()
        head.step(0.5)


def _train_and_save(rank, world, directory):
    head = PartialFC(C, D, **KW)
    _train(head, rank)
    path = ckpt.save_head_shard(head, directory)
    sd = head.state_dict()
    return {"path": path, "centers": head.centers(), "momentum": sd["momentum_buffer"],
            "state": head.training_state()}


def _load_and_check(rank, world, good_dir, wrong_dir):
    head = PartialFC(C, D, **KW)
    before = {k: v.clone() for k, v in head.state_dict().items()}
    # A checkpoint of another world size is refused, naming world_size, and changes nothing.
    with pytest.raises(ValueError, match="world_size") as err:
        ckpt.load_head_shard(head, wrong_dir)
    assert "reshard" in str(err.value)
    for k, v in head.state_dict().items():
        assert torch.equal(v, before[k]), k
    ckpt.load_head_shard(head, good_dir)
    out = {"centers": head.centers(), "momentum": head.state_dict()["momentum_buffer"],
           "state": head.training_state()}
    _train(head, rank, steps=1)        # the loaded head trains
    assert head.step_count == out["state"]["step_count"] + 1
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("ckpt3"))
    results = run_ranks(_train_and_save, 3, directory)
    return directory, results


def _expected(results):
    return torch.cat([r["centers"] for r in results]), torch.cat([r["momentum"] for r in results])


def test_save_writes_one_file_per_rank(saved):
    directory, results = saved
    names = sorted(os.listdir(directory))
    assert names == [f"head-rank{r:05d}-of-00003.safetensors" for r in range(3)]
    assert [os.path.basename(r["path"]) for r in results] == names
    from safetensors import safe_open
    with safe_open(results[1]["path"], framework="pt") as f:
        meta = f.metadata()
    lo, hi = Partition(C, 3).bounds(1)
    assert meta["class_start"] == str(lo) and meta["num_local"] == str(hi - lo)
    assert meta["world_size"] == "3" and meta["rank"] == "1" and meta["format"] == ckpt.FORMAT
    assert meta["sample_step"] == "3" and meta["step_count"] == "3" and meta["seed"] == str(SEED)
    assert "momentum" in meta["optimizer"]


def test_merge_equals_concatenation_of_ranks(saved):
    directory, results = saved
    tensors, meta = ckpt.merge_shards(directory)
    centers, momentum = _expected(results)
    assert set(tensors) == {"weight", "momentum_buffer"}
    assert tensors["weight"].shape == (C, D)
    assert torch.equal(tensors["weight"], centers) and torch.equal(tensors["momentum_buffer"], momentum)
    assert momentum.abs().sum() > 0      # the optimizer state is non-trivial
    assert meta["num_classes"] == C and meta["world_size"] == 3 and meta["sample_step"] == 3


def test_reshard_round_trip_and_live_load(saved, tmp_path):
    directory, results = saved
    d2, d5, d1 = str(tmp_path / "w2"), str(tmp_path / "w5"), str(tmp_path / "w1")
    ckpt.reshard(directory, d2, 2)
    paths = ckpt.reshard(d2, d5, 5)
    assert [os.path.basename(p) for p in paths] == [f"head-rank{r:05d}-of-00005.safetensors" for r in range(5)]
    original, meta3 = ckpt.merge_shards(directory)
    for d, w in ((d2, 2), (d5, 5)):
        merged, meta = ckpt.merge_shards(d)
        assert meta["world_size"] == w
        assert {k: v for k, v in meta.items() if k != "world_size"} == \
            {k: v for k, v in meta3.items() if k != "world_size"}
        for k in original:
            assert merged[k].dtype == original[k].dtype and torch.equal(merged[k], original[k]), (w, k)

    # 2 live ranks load the 2-rank shards; a 3-rank checkpoint is refused without changes.
    loaded = run_ranks(_load_and_check, 2, d2, directory)
    part = Partition(C, 2)
    for r, out in enumerate(loaded):
        lo, hi = part.bounds(r)
        assert torch.equal(out["centers"], original["weight"][lo:hi])
        assert torch.equal(out["momentum"], original["momentum_buffer"][lo:hi])
        assert out["state"]["sample_step"] == 3 and out["state"]["step_count"] == 3
        assert out["state"]["seed"] == SEED

    # 5 live ranks load the 5-rank shards (C % 5 != 0: uneven ranges).
    loaded = run_ranks(_load_and_check, 5, d5, d2)
    part = Partition(C, 5)
    for r, out in enumerate(loaded):
        lo, hi = part.bounds(r)
        assert torch.equal(out["centers"], original["weight"][lo:hi])
        assert torch.equal(out["momentum"], original["momentum_buffer"][lo:hi])

    # A single-process head (world size 1).
    ckpt.reshard(d5, d1, 1)
    head = PartialFC(C, D, **KW)
    ckpt.load_head_shard(head, d1)
    assert torch.equal(head.centers(), original["weight"])


def _world1_dir(saved, tmp_path):
    d1 = str(tmp_path / "w1")
    ckpt.reshard(saved[0], d1, 1)
    return d1


@pytest.mark.parametrize("kwargs,field", [
    (dict(num_classes=C - 1), "num_classes"),
    (dict(embedding_size=D + 1), "embedding_size"),
    (dict(optimizer="adamw"), "states"),
])
def test_load_mismatch_raises_and_changes_nothing(saved, tmp_path, kwargs, field):
    d1 = _world1_dir(saved, tmp_path)
    args = dict(KW)
    if "optimizer" in kwargs:
        args = dict(sample_rate=0.4, seed=SEED, optimizer="adamw")
    head = PartialFC(kwargs.get("num_classes", C), kwargs.get("embedding_size", D), **args)
    before = {k: v.clone() for k, v in head.state_dict().items()}
    with pytest.raises(ValueError, match=field):
        ckpt.load_head_shard(head, d1)
    after = head.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())


def test_load_wrong_class_range_in_metadata(saved, tmp_path):
    d1 = _world1_dir(saved, tmp_path)
    path = os.path.join(d1, ckpt.shard_file_name("head", 0, 1))
    tensors = safetensors.torch.load_file(path)
    from safetensors import safe_open
    with safe_open(path, framework="pt") as f:
        meta = dict(f.metadata())
    meta["class_start"] = "5"
    safetensors.torch.save_file(tensors, path, metadata=meta)
    head = PartialFC(C, D, **KW)
    before = head.centers()
    with pytest.raises(ValueError, match="class_start=5"):
        ckpt.load_head_shard(head, d1)
    assert torch.equal(head.centers(), before)


def test_missing_extra_overlapping_shards(saved, tmp_path):
    src = saved[0]

    def fresh(tag):
        d = str(tmp_path / tag)
        shutil.copytree(src, d)
        return d

    d = fresh("missing")
    os.remove(os.path.join(d, ckpt.shard_file_name("head", 1, 3)))
    with pytest.raises(ValueError, match=r"missing shard\(s\) for ranks \[1\]"):
        ckpt.merge_shards(d)

    d = fresh("extra")
    shutil.copy(os.path.join(d, ckpt.shard_file_name("head", 2, 3)), os.path.join(d, ckpt.shard_file_name("head", 3, 3)))
    with pytest.raises(ValueError, match=r"extra shard\(s\) for ranks \[3\]"):
        ckpt.merge_shards(d)

    d = fresh("mixed")
    ckpt.reshard(src, str(tmp_path / "two"), 2)
    shutil.copy(os.path.join(tmp_path / "two", ckpt.shard_file_name("head", 0, 2)), d)
    with pytest.raises(ValueError, match="several world sizes"):
        ckpt.merge_shards(d)

    # Rank 1's shard claims one class more at its front: overlaps rank 0.
    d = fresh("overlap")
    path = os.path.join(d, ckpt.shard_file_name("head", 1, 3))
    tensors = safetensors.torch.load_file(path)
    from safetensors import safe_open
    with safe_open(path, framework="pt") as f:
        meta = dict(f.metadata())
    tensors = {k: torch.cat([v[:1], v]) for k, v in tensors.items()}
    meta["class_start"] = str(int(meta["class_start"]) - 1)
    meta["num_local"] = str(int(meta["num_local"]) + 1)
    del meta[ckpt.CRC_KEY]        # rewritten tensors: the save's checksums no longer apply
    safetensors.torch.save_file(tensors, path, metadata=meta)
    with pytest.raises(ValueError, match="overlap"):
        ckpt.merge_shards(d)
    with pytest.raises(ValueError):
        ckpt.reshard(d, str(tmp_path / "never"), 2)
    assert not os.path.exists(tmp_path / "never") or not os.listdir(tmp_path / "never")


def test_export_classifier(saved, tmp_path):
    directory, results = saved
    centers, momentum = _expected(results)
    out = ckpt.export_classifier(directory, str(tmp_path / "cls.safetensors"), include_optimizer=True)
    tensors = safetensors.torch.load_file(out)
    assert set(tensors) == {"weight", "optimizer.momentum_buffer"}
    assert torch.equal(tensors["weight"], centers) and torch.equal(tensors["optimizer.momentum_buffer"], momentum)
    from safetensors import safe_open
    with safe_open(out, framework="pt") as f:
        meta = f.metadata()
    assert meta["num_classes"] == str(C) and meta["embedding_size"] == str(D) and meta["source_world_size"] == "3"
    only = safetensors.torch.load_file(ckpt.export_classifier(directory, str(tmp_path / "w.safetensors")))
    assert set(only) == {"weight"}


def test_save_is_atomic(tmp_path, monkeypatch):
    head = PartialFC(C, D, **KW)
    _train(head, 0)
    directory = str(tmp_path / "ck")
    path = ckpt.save_head_shard(head, directory)
    with open(path, "rb") as f:
        good = f.read()
    _train(head, 0, steps=1)            # the state changes; the next save must not land

    real_rows = head.bank.export_rows
    calls = []

    def crashing_rows(name, lo, hi):
        # The first state is written, then the disk fills: a half-written temporary file.
        calls.append(name)
        if len(calls) > 1:
            raise OSError("disk full (simulated)")
        return real_rows(name, lo, hi)

    monkeypatch.setattr(head.bank, "export_rows", crashing_rows)
    with pytest.raises(OSError, match="simulated"):
        ckpt.save_head_shard(head, directory)
    with open(path, "rb") as f:
        assert f.read() == good
    assert os.listdir(directory) == [os.path.basename(path)]     # no temporary left behind
    # A first save that crashes leaves nothing under the final name.
    with pytest.raises(OSError):
        ckpt.save_head_shard(head, str(tmp_path / "empty"))
    assert os.listdir(tmp_path / "empty") == []
    monkeypatch.undo()
    # The surviving file is complete and loads.
    fresh = PartialFC(C, D, **KW)
    ckpt.load_head_shard(fresh, directory)
    assert fresh.training_state()["step_count"] == 3


def test_adamw_states_reshard_exactly(tmp_path):
    head = PartialFC(C, D, sample_rate=0.4, seed=SEED, optimizer="adamw")
    _train(head, 0)
    src, dst = str(tmp_path / "a1"), str(tmp_path / "a4")
    ckpt.save_head_shard(head, src)
    ckpt.reshard(src, dst, 4)
    with pytest.raises(ValueError, match="world_size"):     # another world size already in dst
        ckpt.reshard(src, dst, 2)
    merged, meta = ckpt.merge_shards(dst)
    sd = head.state_dict()
    assert set(merged) == {"weight", "exp_avg", "exp_avg_sq", "step"}
    assert merged["step"].dtype == torch.int32 and int(merged["step"].max()) > 0
    for k, v in merged.items():
        assert torch.equal(v, sd[k]), k
    assert "RowAdamW" in meta["optimizer"]


_SAVE_MEMORY_SCRIPT = """
import json, sys, torch
torch.set_num_threads(1)
from ds_pfc import PartialFC
from ds_pfc import checkpoint as ckpt

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

head = PartialFC(1_000_000, 128, sample_rate=0.01, optimizer="sgd", momentum=0.9, data_parallel_grad=False)
with open("/proc/self/clear_refs", "w") as f:   # reset the high-water mark
    f.write("5")
before = status("VmRSS:")
path = ckpt.save_head_shard(head, sys.argv[1])
peak = status("VmHWM:")
print(json.dumps({"extra": peak - before, "shard_bytes": 2 * 1_000_000 * 128 * 4}))
"""


def test_saving_a_shard_streams_it_instead_of_copying_it(tmp_path):
    """A save copies the bank to host memory and the file a chunk at a time: the peak
    extra memory is bounded by a few chunks, not by the shard (1 GB here), so the first
    checkpoint of a bank that fills the GPU cannot run it out of memory."""
    proc = subprocess.run([sys.executable, "-c", _SAVE_MEMORY_SCRIPT, str(tmp_path)], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["extra"] <= 4 * ckpt.SAVE_CHUNK_BYTES, (res["extra"] / 2**20, res["shard_bytes"] / 2**20)
    # The streamed file is a valid shard holding the (untrained, seed-determined) bank.
    head = PartialFC(1_000_000, 128, sample_rate=0.01, optimizer="sgd", momentum=0.9, data_parallel_grad=False)
    with safetensors.safe_open(os.path.join(str(tmp_path), os.listdir(tmp_path)[0]), framework="pt") as f:
        assert torch.equal(f.get_tensor("weight"), head.centers())
        assert torch.equal(f.get_tensor("momentum_buffer"), torch.zeros(1_000_000, 128))
    ckpt.load_head_shard(head, str(tmp_path))
