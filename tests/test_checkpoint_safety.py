"""Checkpoints under crashes, power loss and damage: the training app and
``PfcEngine`` in one CPU process (plus one 2-rank run for the collectives).

Kills are simulated by raising at a chosen point (right after a tag became
complete, between renaming a pruned tag away and deleting it); damage by truncating
or overwriting bytes; leftovers of older saves by building directories by hand.
Every resumed run is compared bitwise with one uninterrupted run (CPU, one thread).
"""
from __future__ import annotations

import copy
import glob
import json
import os
import shutil
import socket
import stat
import sys

import pytest
import torch

from _dist import run_ranks

pytest.importorskip("deepspeed")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 6
CONFIG = {
    "train_micro_batch_size_per_gpu": 8,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 0.0,
    "steps_per_print": 10 ** 9,
    "optimizer": {"type": "SGD", "params": {"lr": 0.02, "momentum": 0.9, "weight_decay": 5e-4}},
    "zero_optimization": {"stage": 0},
    "ds_pfc": {
        "head": {"num_classes": 24, "embedding_size": 32, "sample_rate": 1.0,
                 "margin": {"type": "cosface", "scale": 16.0, "margin": 0.2}},
        "backbone": {"name": "vit_t", "width": 0.25},
        "data": {"synthetic": {"images_per_identity": 3, "held_out_identities": 10}, "workers": 0},
        "train": {"epochs": 10, "max_steps": STEPS, "log_every": 1,
                  "schedule": {"type": "poly", "warmup_epochs": 0.5, "power": 2.0}},
        "evaluation": {"synthetic_pairs": 40, "batch_size": 16, "every_steps": 2, "at_start": True},
        "checkpoint": {"every_steps": 2, "keep": 0},
    },
}
TAG = "step{:08d}".format
SHARD, RANK_STATE, MODEL = "head-rank00000-of-00001.safetensors", "rank_state-00000-of-00001.pt", \
    "mp_rank_00_model_states.pt"


class Killed(Exception):
    """Stands for the process dying at the point where it is raised."""


# ------------------------------------------------------------------------ helpers
def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _remove_shm_buffers(port):
    """DeepSpeed's CPU shared-memory all-reduce names its buffers after the master
    port and leaves them in /dev/shm when its processes end."""
    for name in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_127.0.0.1_{port}_*"):
        os.remove(name)


@pytest.fixture(scope="module", autouse=True)
def single_process_group():
    """One process group for the module (the app and DeepSpeed need one), undone after."""
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    saved = {k: os.environ.get(k) for k in keys}
    port = _free_port()
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    umask = os.umask(0o022)       # the usual file modes are checked below
    yield
    os.umask(umask)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    _remove_shm_buffers(port)
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _config(**checkpoint):
    config = copy.deepcopy(CONFIG)
    config["ds_pfc"]["checkpoint"].update(checkpoint)
    return config


def _trainer(out, *, config=None, max_steps=None, logs=None, **options):
    from ds_pfc.app.training import Trainer
    trainer = Trainer(config or _config(), output_dir=out, max_steps=max_steps,
                      log=(logs.append if logs is not None else (lambda line: None)), **options)
    trainer.setup()
    return trainer


def _run(out, **kwargs):
    trainer = _trainer(out, **kwargs)
    try:
        return trainer.run()
    finally:
        trainer.close()


def _ckpt(out):
    return os.path.join(out, "checkpoints")


def _latest(out):
    with open(os.path.join(_ckpt(out), "latest")) as f:
        return f.read()


def _export_tensors(out):
    from safetensors.torch import load_file
    return load_file(os.path.join(out, "export", "model.safetensors"))


def _assert_same_export(out, reference):
    got, want = _export_tensors(out), reference["export"]
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k


def _accuracies(evaluations):
    return {int(step): {name: (r["accuracy"] if isinstance(r, dict) else r.accuracy) for name, r in results.items()}
            for step, results in evaluations.items()}


def _own_copy(path):
    """Break a hard link before changing a file in place."""
    with open(path, "rb") as f:
        data = f.read()
    os.remove(path)
    with open(path, "wb") as f:
        f.write(data)


def _truncate(path, keep_fraction=0.5):
    _own_copy(path)
    with open(path, "r+b") as f:
        f.truncate(int(os.path.getsize(path) * keep_fraction))


def _overwrite(path, data, offset=None):
    """Overwrite bytes at ``offset`` (default: the middle of the file)."""
    _own_copy(path)
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2 if offset is None else offset)
        f.write(data)


def _write(path, data: bytes):
    """Replace a file (never through a hard link to the reference run)."""
    if os.path.lexists(path):
        os.remove(path)
    with open(path, "wb") as f:
        f.write(data)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """6 uninterrupted steps, checkpoints every 2 and evaluations every 2 steps."""
    out = str(tmp_path_factory.mktemp("reference") / "run")
    summary = _run(out)
    return {"out": out, "losses": list(summary["losses"]), "evaluations": _accuracies(summary["evaluations"]),
            "export": _export_tensors(out)}


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    """A set-up app whose engine the cases below share (resumed, saved from)."""
    trainer = _trainer(str(tmp_path_factory.mktemp("shared") / "run"))
    yield trainer
    trainer.close()


def _copy_checkpoints(reference, dst):
    shutil.copytree(_ckpt(reference["out"]), _ckpt(dst), copy_function=os.link)
    return _ckpt(dst)


# ------------------------------------------------------------------------ 1. latest never lags
def test_kill_after_a_tag_is_complete_resumes_it_and_moves_latest(reference, tmp_path, monkeypatch):
    """Killed after the final tag became complete, before 'latest' moved: the rerun
    resumes that tag (and says so), points 'latest' at it and exports it."""
    out = str(tmp_path / "run")
    real_replace = os.replace

    def replace(src, dst, **kwargs):
        if os.path.basename(str(dst)) == "latest":
            with open(src) as f:
                if f.read() == TAG(STEPS):
                    raise Killed("between the tag and 'latest'")
        return real_replace(src, dst, **kwargs)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(Killed):
        _run(out)
    monkeypatch.setattr(os, "replace", real_replace)
    assert _latest(out) == TAG(4)
    assert os.path.isfile(os.path.join(_ckpt(out), TAG(STEPS), "ds_pfc_complete.json"))

    logs = []
    summary = _run(out, logs=logs)
    assert summary["resumed"]
    assert any(TAG(STEPS) in line and "newer" in line for line in logs), logs
    assert _latest(out) == TAG(STEPS)
    assert summary["checkpoint"] == os.path.join(_ckpt(out), TAG(STEPS))
    _assert_same_export(out, reference)
    assert summary["losses"] == reference["losses"]           # the whole run, bitwise


def test_missing_latest_resumes_the_newest_complete_tag(reference, tmp_path):
    out = str(tmp_path / "run")
    _run(out, max_steps=4)
    os.remove(os.path.join(_ckpt(out), "latest"))
    logs = []
    summary = _run(out, logs=logs)
    assert summary["resumed"]
    assert any("no 'latest'" in line and TAG(4) in line for line in logs), logs
    assert summary["losses"] == reference["losses"]
    assert _latest(out) == TAG(STEPS)
    assert {TAG(2), TAG(4), TAG(6)} <= set(os.listdir(_ckpt(out)))
    _assert_same_export(out, reference)


def _marker_dir(save_dir, tag, steps, mtime):
    path = os.path.join(save_dir, tag)
    os.makedirs(path)
    marker = os.path.join(path, "ds_pfc_complete.json")
    with open(marker, "w") as f:
        json.dump({"tag": tag, "world_size": 1, "global_steps": steps, "heads": ["head"], "metadata": {}}, f)
    os.utime(marker, (mtime, mtime))
    os.utime(path, (mtime, mtime))


def test_tags_are_ordered_and_pruned_by_step_not_by_time(tmp_path):
    from ds_pfc.checkpoint import tags
    from ds_pfc.deepspeed_plugin import list_checkpoints
    save_dir = str(tmp_path)
    # copied without their times: the newest step looks oldest
    for i, (name, steps) in enumerate([("b", 6), ("c", 4), ("a", 2), ("d", 8)]):
        _marker_dir(save_dir, name, steps, 1_000_000 + 10 * i)
    with open(os.path.join(save_dir, "latest"), "w") as f:
        f.write("a")
    assert list_checkpoints(save_dir) == ["a", "c", "b", "d"]
    assert tags.prune(save_dir, 1) == ["c", "b"]           # keeps the newest and the one 'latest' names
    assert sorted(os.listdir(save_dir)) == ["a", "d", "latest"]


def test_kill_while_pruning_leaks_nothing(reference, tmp_path, monkeypatch):
    """Killed in the middle of deleting a pruned tag: the next save removes what is
    left, and the run continues bitwise."""
    out = str(tmp_path / "run")
    config = _config(keep=1)
    real_rmtree = shutil.rmtree

    def rmtree(path, *args, **kwargs):
        if TAG(2) in os.path.basename(str(path)):
            raise Killed("while deleting a pruned tag")
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", rmtree)
    with pytest.raises(Killed):
        _run(out, config=config, max_steps=4)
    monkeypatch.setattr(shutil, "rmtree", real_rmtree)
    summary = _run(out, config=config)
    assert summary["losses"] == reference["losses"]
    assert sorted(os.listdir(_ckpt(out))) == ["latest", TAG(STEPS)]


# ------------------------------------------------------------------------ 3. leftovers
def test_leftovers_of_killed_saves_are_cleaned(reference, tmp_path):
    out = str(tmp_path / "run")
    _run(out, max_steps=4)
    save_dir = _ckpt(out)
    old = os.path.join(save_dir, TAG(1))                  # a killed save of an older step, without marker
    os.makedirs(old)
    shutil.copy(os.path.join(save_dir, TAG(2), RANK_STATE), old)
    newer = os.path.join(save_dir, TAG(10))               # marker-less but of a later step: kept
    os.makedirs(newer)
    shutil.copy(os.path.join(save_dir, TAG(2), RANK_STATE), newer)
    os.makedirs(os.path.join(save_dir, "notes"))          # not a checkpoint: kept
    os.makedirs(os.path.join(save_dir, TAG(4) + ".tmp-0123abcd"))
    leftovers = [os.path.join(save_dir, "latest.tmp-0123abcd"), os.path.join(save_dir, ".ds_pfc-probe-0123"),
                 os.path.join(save_dir, TAG(4), f".{SHARD}.tmp-77-0123abcd")]
    for path in leftovers:
        with open(path, "wb") as f:
            f.write(b"partial")
    summary = _run(out)
    assert summary["losses"] == reference["losses"]
    assert sorted(os.listdir(save_dir)) == ["latest", "notes", TAG(2), TAG(4), TAG(6), TAG(10)]
    assert not any(os.path.exists(p) for p in leftovers)


def test_stale_shards_of_another_world_size_do_not_enter_the_tag(tmp_path):
    """A tag directory left by an interrupted 2-rank save is reached again by a 1-rank
    run: the new tag holds only the 1-rank files, and export (merge_shards) works."""
    out = str(tmp_path / "run")
    stale = os.path.join(_ckpt(out), TAG(2))
    os.makedirs(stale)
    for name in ("head-rank00001-of-00002.safetensors", "rank_state-00001-of-00002.pt"):
        with open(os.path.join(stale, name), "wb") as f:
            f.write(b"from a 2-rank save")
    summary = _run(out, max_steps=2)
    assert not any("-of-00002" in name for name in os.listdir(stale))
    assert os.path.isfile(summary["export"])


# ------------------------------------------------------------------------ 2. damage names the file and the fallback
def _at(save_dir, rel):
    return os.path.join(save_dir, rel)


CORRUPTIONS = {
    "head shard truncated": (lambda d: _truncate(_at(d, f"{TAG(6)}/{SHARD}")), f"{TAG(6)}/{SHARD}", TAG(4)),
    "head shard header overwritten": (lambda d: _overwrite(_at(d, f"{TAG(6)}/{SHARD}"), b"\xff" * 8, 0),
                                      f"{TAG(6)}/{SHARD}", TAG(4)),
    # a few bytes inside the centers' data: the header is intact, only the checksum tells
    "head shard tensor bytes changed": (lambda d: _overwrite(_at(d, f"{TAG(6)}/{SHARD}"), b"\x5a\xa5\x5a\xa5",
                                                             os.path.getsize(_at(d, f"{TAG(6)}/{SHARD}")) - 64),
                                        f"{TAG(6)}/{SHARD}", TAG(4)),
    "head shard missing": (lambda d: os.remove(_at(d, f"{TAG(6)}/{SHARD}")), f"{TAG(6)}/{SHARD}", TAG(4)),
    "rank state truncated": (lambda d: _truncate(_at(d, f"{TAG(6)}/{RANK_STATE}")), f"{TAG(6)}/{RANK_STATE}",
                             TAG(4)),
    "engine file truncated": (lambda d: _truncate(_at(d, f"{TAG(6)}/{MODEL}")), f"{TAG(6)}/{MODEL}", TAG(4)),
    "engine file bytes overwritten": (lambda d: _overwrite(_at(d, f"{TAG(6)}/{MODEL}"), b"\x00" * 64),
                                      f"{TAG(6)}/{MODEL}", TAG(4)),
    "engine file missing": (lambda d: os.remove(_at(d, f"{TAG(6)}/{MODEL}")), f"{TAG(6)}/{MODEL}", TAG(4)),
    "latest not UTF-8": (lambda d: _write(_at(d, "latest"), b"\xff\xfe\x00garbage"), "latest", TAG(6)),
    "latest names no tag": (lambda d: _write(_at(d, "latest"), TAG(99).encode()), "latest", TAG(6)),
    "marker not JSON": (lambda d: _write(_at(d, f"{TAG(6)}/ds_pfc_complete.json"), b'{"tag": '),
                        f"{TAG(6)}/ds_pfc_complete.json", TAG(4)),
    "marker missing": (lambda d: os.remove(_at(d, f"{TAG(6)}/ds_pfc_complete.json")), TAG(6), TAG(4)),
}


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_damaged_checkpoint_names_the_file_and_the_tag_to_fall_back_to(reference, trainer, tmp_path, case):
    from ds_pfc.checkpoint.tags import CheckpointError
    damage, culprit, fallback = CORRUPTIONS[case]
    save_dir = _copy_checkpoints(reference, str(tmp_path))
    damage(save_dir)
    trainer.checkpoint_dir, trainer.resume_from = save_dir, None
    with pytest.raises(CheckpointError) as caught:
        trainer.resume()
    message = str(caught.value)
    assert os.path.join(save_dir, culprit) in message, message
    assert f"'{fallback}'" in message and f"--resume_from {fallback}" in message, message
    assert caught.value.fallback == fallback


def _launch_train(argv):
    """What ``launch/train.py`` runs, in this process (its ``run`` returns the summary)."""
    from ds_pfc.cli.train import run
    return run(argv)


def test_resume_from_an_older_tag_after_damage(reference, tmp_path):
    """The newest tag is damaged; ``--resume_from`` the one before continues the run
    bitwise, moves the damaged tag aside, and summary.json covers all steps."""
    out = str(tmp_path / "run")
    save_dir = _copy_checkpoints(reference, out)
    _overwrite(os.path.join(save_dir, TAG(6), MODEL), b"\x00" * 64)
    config = os.path.join(str(tmp_path), "job.json")
    with open(config, "w") as f:
        json.dump(CONFIG, f)
    _launch_train(["--deepspeed_config", config, "--output_dir", out, "--resume_from", TAG(4)])
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    assert summary["resumed"] and summary["steps"] == STEPS
    assert summary["losses"] == reference["losses"]
    assert {int(k): {n: r["accuracy"] for n, r in v.items()} for k, v in summary["evaluations"].items()} == \
        reference["evaluations"]
    assert sorted(reference["evaluations"]) == [0, 2, 4, 6]
    assert _latest(out) == TAG(6)
    assert [n.split(".")[0] for n in os.listdir(os.path.join(save_dir, "superseded"))] == [TAG(6)]
    _assert_same_export(out, reference)


# ------------------------------------------------------------------------ 7. history and file modes
def test_summary_covers_the_whole_run_across_resumes(reference, tmp_path):
    out = str(tmp_path / "run")
    first = _run(out, max_steps=3)
    assert len(first["losses"]) == 3
    second = _run(out)
    assert second["resumed"] and second["losses"] == reference["losses"]
    # the first run's final evaluation (step 3) belongs to the history as well
    assert _accuracies(second["evaluations"]) == {**reference["evaluations"], 3: _accuracies(first["evaluations"])[3]}


def test_head_shards_and_exports_get_the_usual_file_mode(reference, tmp_path):
    from ds_pfc.checkpoint.export import reshard_checkpoint
    reshard_checkpoint(os.path.join(_ckpt(reference["out"]), TAG(6)), str(tmp_path), 2)
    paths = [os.path.join(reference["out"], "export", "model.safetensors"),
             os.path.join(_ckpt(reference["out"]), TAG(6), SHARD),
             os.path.join(str(tmp_path), TAG(6), "head-rank00001-of-00002.safetensors")]
    for path in paths:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o644, path


# ------------------------------------------------------------------------ 8. global batch
def test_resuming_with_another_global_batch_is_refused_unless_allowed(reference, trainer, tmp_path):
    from ds_pfc.app.config import ConfigError
    with open(os.path.join(_ckpt(reference["out"]), TAG(6), "ds_pfc_complete.json")) as f:
        meta = json.load(f)["metadata"]
    assert (meta["micro"], meta["gradient_accumulation_steps"], meta["world_size"], meta["global_batch"]) == \
        (8, 1, 1, 8)
    save_dir = _copy_checkpoints(reference, str(tmp_path))
    trainer.checkpoint_dir, trainer.resume_from, trainer.allow_batch_change = save_dir, None, False
    gas = trainer.gas
    trainer.gas = 2
    try:
        with pytest.raises(ConfigError) as caught:
            trainer.resume()
        message = str(caught.value)
        assert "global batch of 8 (8 micro x 1 accumulation x 1 rank(s))" in message and "16 (8 x 2 x 1)" in message
        assert "--allow_batch_change" in message
        trainer.allow_batch_change = True
        assert trainer.resume() and trainer.engine.global_steps == STEPS
    finally:
        trainer.gas, trainer.allow_batch_change = gas, False


# ------------------------------------------------------------------------ 4. fsync, 5. decoupled writers
@pytest.fixture(params=[0, 1], ids=["zero0", "zero1"])
def any_stage_trainer(request, trainer, tmp_path_factory):
    """The shared stage-0 app, or a ZeRO-1 one (whose tags also hold the optimizer's
    partitions)."""
    if request.param == 0:
        yield trainer
        return
    config = _config()
    config["zero_optimization"] = {"stage": 1}
    config["zero_allow_untested_optimizer"] = True     # SGD under ZeRO, as the ZeRO-1 configs run it
    zero1 = _trainer(str(tmp_path_factory.mktemp("zero1") / "run"), config=config)
    yield zero1
    zero1.close()


def test_every_file_is_fsynced_before_the_marker_and_renames_after(any_stage_trainer, tmp_path, monkeypatch):
    trainer = any_stage_trainer
    save_dir = os.path.realpath(str(tmp_path))
    events = []
    real = {name: getattr(os, name) for name in ("fsync", "replace", "rename")}

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real["fsync"](fd)

    def mover(name):
        def move(src, dst, **kwargs):
            events.append(("move", str(src), str(dst)))
            return real[name](src, dst, **kwargs)
        return move

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", mover("replace"))
    monkeypatch.setattr(os, "rename", mover("rename"))
    trainer.engine.save_checkpoint(save_dir, "t1")
    monkeypatch.undo()
    marker = next(i for i, e in enumerate(events) if e[0] == "move" and e[2].endswith("/ds_pfc_complete.json"))
    synced = {os.path.basename(e[1]) for e in events[:marker] if e[0] == "fsync"}
    files = set(os.listdir(os.path.join(save_dir, "t1"))) - {"ds_pfc_complete.json"}
    assert MODEL in files and files <= synced, files - synced
    if trainer.engine.engine.zero_optimization_stage():       # the ZeRO partitions too
        assert "zero_pp_rank_0_mp_rank_00_optim_states.pt" in files
    latest = next(i for i, e in enumerate(events) if e[0] == "move" and e[2] == os.path.join(save_dir, "latest"))
    dir_syncs = [i for i, e in enumerate(events) if e == ("fsync", save_dir)]
    assert any(marker < i < latest for i in dir_syncs) and any(i > latest for i in dir_syncs), events


class _DeferredWriter:
    """A decoupled checkpoint writer: files appear only when DeepSpeed commits."""

    def __init__(self):
        self.pending, self.info = [], None

    def create(self, info):
        self.info = info

    def makedirs(self, path, exist_ok=False):
        os.makedirs(path, exist_ok=exist_ok)

    def save(self, state_dict, path):
        self.pending.append((state_dict, path))

    def commit(self, info):
        for state_dict, path in self.pending:
            torch.save(state_dict, path)
        self.pending, self.info = [], None
        return True

    def is_decoupled(self):
        return True

    def get_commit_info(self):
        return self.info

    def is_data_parallel_writer(self, dp_rank):
        return dp_rank == 0

    def preserves_storage_sharing(self):
        return True


def test_marker_follows_the_commit_of_a_decoupled_writer(trainer, tmp_path):
    inner = trainer.engine.engine
    original = inner.checkpoint_engine
    inner.checkpoint_engine = _DeferredWriter()
    try:
        tag_dir = trainer.engine.save_checkpoint(str(tmp_path), "t1")
    finally:
        inner.checkpoint_engine = original
    assert os.path.isfile(os.path.join(tag_dir, "ds_pfc_complete.json"))
    state = torch.load(os.path.join(tag_dir, MODEL), map_location="cpu", weights_only=False)
    assert state["global_steps"] == trainer.engine.global_steps


# ------------------------------------------------------------------------ 6. shared directory; 2 ranks
def _two_ranks(rank, world_size, base, port):
    import deepspeed

    from ds_pfc import PartialFC
    from ds_pfc.checkpoint import tags
    from ds_pfc.deepspeed_plugin import attach, initialize
    out = {}
    tags.check_shared_directory(os.path.join(base, "shared"))
    out["shared_left"] = os.listdir(os.path.join(base, "shared"))
    try:
        tags.check_shared_directory(os.path.join(base, f"node{rank}"))     # node-local storage
    except tags.SharedDirectoryError as err:
        out["local"] = str(err)

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    deepspeed.init_distributed(dist_backend="gloo")

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.fc = torch.nn.Linear(8, 4)

        def forward(self, x, y):
            return self.cls(self.fc(x), y)

    model = Net()
    attach(model, "cls", PartialFC(11, 4, sample_rate=1.0, optimizer="sgd", device=torch.device("cpu")))
    engine = initialize(model=model, config={"train_micro_batch_size_per_gpu": 3, "steps_per_print": 10 ** 9,
                                             "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    g = torch.Generator().manual_seed(rank)
    save_dir = os.path.join(base, "ckpt")
    centers = {}
    for tag in ("a", "b"):
        engine.backward(engine(torch.randn(3, 8, generator=g), torch.randint(0, 11, (3,), generator=g)))
        engine.step()
        engine.save_checkpoint(save_dir, tag)
        centers[tag] = engine.heads["cls"].centers().clone()
    if rank == 1:        # damage that only rank 1 would notice when loading its own shard
        _truncate(os.path.join(save_dir, "b", "cls-rank00001-of-00002.safetensors"))
    torch.distributed.barrier()
    try:
        engine.load_checkpoint(save_dir)
    except tags.CheckpointCorruptError as err:
        out["damaged"] = str(err)
    loaded = engine.load_checkpoint(save_dir, "a")
    out["loaded"] = loaded["tag"]
    out["restored"] = torch.equal(engine.heads["cls"].centers(), centers["a"])
    return out


def test_two_ranks_probe_the_directory_and_agree_on_damage(tmp_path):
    base, port = str(tmp_path), _free_port()
    try:
        results = run_ranks(_two_ranks, 2, base, port)
    finally:
        _remove_shm_buffers(port)
    for rank, r in enumerate(results):
        assert r["shared_left"] == []                      # the probe file is gone
        # each rank names the directory by the path it was given (the same on real nodes)
        assert os.path.join(base, f"node{rank}") in r["local"] and "rank(s) 1 (" in r["local"], r["local"]
        assert "cls-rank00001-of-00002.safetensors" in r["damaged"] and "'a'" in r["damaged"], r["damaged"]
        assert r["loaded"] == "a" and r["restored"]


def test_resume_probes_the_checkpoint_directory(trainer, tmp_path, monkeypatch):
    from ds_pfc.checkpoint import tags
    seen = []

    def probe(directory, **kwargs):
        seen.append(directory)
        raise tags.SharedDirectoryError(f"{directory} is not shared by all ranks", path=directory)

    monkeypatch.setattr(tags, "check_shared_directory", probe)
    trainer.checkpoint_dir = str(tmp_path)
    with pytest.raises(tags.SharedDirectoryError):
        trainer.resume()
    assert seen == [str(tmp_path)]
