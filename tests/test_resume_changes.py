"""Resuming a run whose job changed: the config comparison, the checks that come
before any load, the new settings taking effect, another number of ranks at any
step, and the command-line app's refusals (one ``error:`` line, no traceback).

References: the learning rate applied after a resume is computed here from the
schedule's written formula (poly with linear warmup, steps_per_epoch = images //
global batch); the data a multi-rank run trains on is recorded at the dataset and
compared with the epoch's permutation drawn here (``torch.randperm`` seeded with
the blake2b hash the sampler documents).
"""
from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from _dist import one_process_world, run_ranks

pytest.importorskip("deepspeed")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
        "data": {"synthetic": {"images_per_identity": 3}, "workers": 0},
        "train": {"epochs": 10, "max_steps": 6, "log_every": 1,
                  "schedule": {"type": "poly", "warmup_epochs": 0.5, "power": 2.0}},
        "evaluation": {"synthetic_pairs": 0},
        "checkpoint": {"every_steps": 0, "keep": 0, "export": False},
    },
}
STEPS_PER_EPOCH = 24 * 3 // 8        # 72 images, global batch 8


@pytest.fixture(scope="module", autouse=True)
def single_process_group():
    with one_process_world():
        yield


def _trainer(out, config=None, logs=None, **options):
    from ds_pfc.app.training import Trainer
    trainer = Trainer(copy.deepcopy(config or CONFIG), output_dir=out,
                      log=(logs.append if logs is not None else (lambda line: None)), **options)
    trainer.setup()
    return trainer


@pytest.fixture(scope="module")
def three_steps(tmp_path_factory):
    """A run stopped after 3 of its 6 steps (mid-epoch: 9 steps per epoch)."""
    out = str(tmp_path_factory.mktemp("three") / "run")
    trainer = _trainer(out, max_steps=3)
    try:
        trainer.run()
    finally:
        trainer.close()
    return out


def _copy_run(src, dst):
    shutil.copytree(os.path.join(src, "checkpoints"), os.path.join(dst, "checkpoints"))
    return dst


def _changed():
    """The margin, the sample rate, the lr and the momentum changed (they change
    training), and the logging and evaluation cadence (they do not)."""
    config = copy.deepcopy(CONFIG)
    config["ds_pfc"]["head"]["margin"] = {"type": "arcface", "scale": 32.0, "margin": 0.3}
    config["ds_pfc"]["head"]["sample_rate"] = 0.5
    config["optimizer"]["params"]["lr"] = 0.05
    config["optimizer"]["params"]["momentum"] = 0.5
    config["ds_pfc"]["train"]["log_every"] = 2
    config["ds_pfc"]["evaluation"]["every_steps"] = 100
    return config


def _no_load(trainer, monkeypatch):
    """Make every expensive step of a resume fail the test if it is reached."""
    def forbidden(*args, **kwargs):
        raise AssertionError("the checkpoint was loaded (or converted) before the check")
    monkeypatch.setattr(trainer.engine, "load_checkpoint", forbidden)
    monkeypatch.setattr(trainer, "_convert_for_world_size", forbidden)


def test_changed_training_settings_are_listed_and_refused_before_loading(three_steps, tmp_path, monkeypatch):
    from ds_pfc.app.config import ConfigError
    out = _copy_run(three_steps, str(tmp_path))
    trainer = _trainer(out, config=_changed())
    try:
        _no_load(trainer, monkeypatch)
        with pytest.raises(ConfigError) as caught:
            trainer.resume()
    finally:
        trainer.close()
    message = str(caught.value)
    for line in ("ds_pfc.head.margin.type: 'cosface' -> 'arcface'", "ds_pfc.head.margin.scale: 16.0 -> 32.0",
                 "ds_pfc.head.margin.margin: 0.2 -> 0.3", "ds_pfc.head.sample_rate: 1.0 -> 0.5",
                 "optimizer.params.lr: 0.02 -> 0.05", "optimizer.params.momentum: 0.9 -> 0.5",
                 "--allow_config_change"):
        assert line in message, message
    # the harmless ones are named as allowed, after the others
    allowed = message[message.index("other changes, allowed"):]
    assert "ds_pfc.train.log_every: 1 -> 2" in allowed and "ds_pfc.evaluation.every_steps: 0 -> 100" in allowed
    assert "ds_pfc.train.max_steps: 3 -> 6" in allowed
    assert "\n" not in message


def _reference_lr(base_lr, step):
    """The lr of optimizer step ``step`` (0-based): poly, power 2, over 6 steps, after
    a linear warmup of round(0.5 x 9) = 4 steps (Python rounds half to even)."""
    warmup, total = 4, 6
    if step < warmup:
        return base_lr * (step + 1) / warmup
    return base_lr * (1 - (step - warmup) / (total - warmup)) ** 2


def test_with_the_flag_the_new_settings_take_effect(three_steps, tmp_path):
    out = _copy_run(three_steps, str(tmp_path))
    logs = []
    trainer = _trainer(out, config=_changed(), logs=logs, allow_config_change=True)
    try:
        summary = trainer.run()
        head, groups = trainer.head, trainer.engine.engine.optimizer.param_groups
    finally:
        trainer.close()
    assert summary["resumed"]
    warning = next(line for line in logs if line.startswith("warning: resuming"))
    assert "optimizer.params.lr: 0.02 -> 0.05" in warning and "ds_pfc.head.sample_rate: 1.0 -> 0.5" in warning
    assert any("ds_pfc.train.log_every: 1 -> 2" in line for line in logs if "do not change training" in line)
    # the lr applied at every resumed step is the new base lr x the schedule
    applied = {int(line.split()[1].split("/")[0]): float(line.split(" lr ")[1].split()[0])
               for line in logs if line.startswith("step ")}
    assert sorted(applied) == [4, 6]        # log_every 2 (and the last step)
    for step, lr in applied.items():
        assert lr == pytest.approx(_reference_lr(0.05, step - 1), rel=1e-3), (step, lr)
    assert _reference_lr(0.05, 3) != pytest.approx(_reference_lr(0.02, 3))
    # the optimizer's other settings are the new ones; the head is the new head
    assert all(g["momentum"] == 0.5 and g["weight_decay"] == 5e-4 for g in groups)
    assert type(head.margin).__name__ == "ArcFace" and head.margin.scale == 32.0 and head.margin.margin == 0.3
    assert head.sample_rate == 0.5


def test_settings_the_checkpoint_cannot_take_are_refused_even_with_the_flag(three_steps, tmp_path, monkeypatch):
    from ds_pfc.app.config import ConfigError
    out = _copy_run(three_steps, str(tmp_path))
    config = copy.deepcopy(CONFIG)
    config["ds_pfc"]["head"]["embedding_size"] = 16
    trainer = _trainer(out, config=config, allow_config_change=True)
    try:
        _no_load(trainer, monkeypatch)
        with pytest.raises(ConfigError, match=r"ds_pfc.head.embedding_size: 32 -> 16.*new output directory"):
            trainer.resume()
    finally:
        trainer.close()


def test_harmless_changes_and_another_batch_split_are_logged(three_steps, tmp_path, monkeypatch):
    """Another split of the same global batch (4 x 2 instead of 8 x 1) and the
    logging cadence: resumed with the changes logged. Another global batch: refused
    before loading, with the setting that would keep it."""
    from ds_pfc.app.config import ConfigError
    out = _copy_run(three_steps, str(tmp_path))
    config = copy.deepcopy(CONFIG)
    config["ds_pfc"]["train"]["log_every"] = 3
    config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"] = 4, 2
    logs = []
    trainer = _trainer(out, config=config, logs=logs)
    try:
        assert trainer.resume()
    finally:
        trainer.close()
    assert any("ds_pfc.train.log_every: 1 -> 3" in line for line in logs)
    assert any("train_micro_batch_size_per_gpu: 8 -> 4" in line for line in logs)
    assert not any(line.startswith("warning") for line in logs)
    config["gradient_accumulation_steps"] = 4
    trainer = _trainer(out, config=config)
    try:
        _no_load(trainer, monkeypatch)
        with pytest.raises(ConfigError, match="set gradient_accumulation_steps to 2 "):
            trainer.resume()
    finally:
        trainer.close()


def test_changed_data_with_the_flag_starts_the_next_epoch(three_steps, tmp_path):
    """Another training set (4 images per identity): the saved position in the old
    order means nothing, so the run continues with the next epoch, from its start."""
    out = _copy_run(three_steps, str(tmp_path))
    config = copy.deepcopy(CONFIG)
    config["ds_pfc"]["data"]["synthetic"]["images_per_identity"] = 4
    logs = []
    trainer = _trainer(out, config=config, logs=logs, allow_config_change=True)
    try:
        assert trainer.resume()
        assert (trainer.sampler.epoch, trainer.sampler.start, trainer.sampler.consumed) == (1, 0, 0)
    finally:
        trainer.close()
    assert any("continues with epoch 1 from its start" in line for line in logs)


# ---------------------------------------------------------------- other numbers of ranks
class _Recorder(torch.utils.data.Dataset):
    """The training set, recording the indices of every micro batch fetched."""

    def __init__(self, dataset):
        self.dataset, self.fetched = dataset, []
        self.num_classes = dataset.num_classes

    def __len__(self):
        return len(self.dataset)

    def get_batch(self, indices):
        from ds_pfc.data.loader import _fetch
        self.fetched.append(indices.tolist())
        return _fetch(self.dataset, indices)


def _ranks_run(rank, world_size, out, micro, max_steps):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["DS_PFC_TEST_PORT"])
    config = copy.deepcopy(CONFIG)
    config["train_micro_batch_size_per_gpu"] = micro
    config["ds_pfc"]["head"]["num_classes"] = 25               # 75 images: 6 steps of 12, 3 left over
    trainer = _trainer(out, config=config, max_steps=max_steps)
    try:
        recorder = trainer.dataset = _Recorder(trainer.dataset)
        advanced = []
        advance = trainer.sampler.advance

        def counting(num):
            advanced.append((trainer.sampler.epoch, num))
            advance(num)
        trainer.sampler.advance = counting
        trainer.run()
    finally:
        trainer.close()
    trained = recorder.fetched[:len(advanced)]       # the loader fetches one micro batch ahead
    assert [len(b) for b in trained] == [n for _, n in advanced]
    return {"trained": trained, "epochs": [e for e, _ in advanced]}


@pytest.mark.slow
def test_rank_changes_mid_epoch_train_each_sample_of_the_epoch_once(tmp_path):
    """2 ranks (micro 6) for 2 steps, then 3 ranks (micro 4) to the end of the epoch:
    a global batch of 12 throughout, the change mid-epoch (after 24 of its 75
    images) and to another micro batch (the sampler's block). Over the epoch the
    ranks trained exactly the first 72 images of its permutation, each once (the 3
    left over are fewer than one global batch: an epoch is whole steps). Other sizes and directions (3 -> 2, 1 -> 2, several
    changes): tests/test_data_pipeline.py, on the sampler alone."""
    out = str(tmp_path / "run")
    seen = []
    for world, micro, steps in ((2, 6, 2), (3, 4, 6)):
        for result in run_ranks(_ranks_run, world, out, micro, steps):
            assert set(result["epochs"]) == {0}
            seen.extend(i for batch in result["trained"] for i in batch)
    g = torch.Generator()
    digest = hashlib.blake2b(b"0:0", digest_size=8).digest()        # seed 0, epoch 0
    g.manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))
    perm = torch.randperm(75, generator=g).tolist()
    assert len(seen) == 72 and sorted(seen) == sorted(perm[:72])


# ---------------------------------------------------------------- the command-line app
def _cli(tmp_path, config, *args):
    path = os.path.join(tmp_path, f"job{len(os.listdir(tmp_path))}.json")
    with open(path, "w") as f:
        json.dump(config, f)
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return subprocess.run([sys.executable, os.path.join(ROOT, "launch", "train.py"), "--deepspeed_config", path,
                           *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)


def _refused(proc, needle):
    assert proc.returncode == 1, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and needle in errors[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


def test_cli_refusals_are_one_error_line(three_steps, tmp_path):
    config = copy.deepcopy(CONFIG)
    config["gradient_allreduce_op"] = "sum"
    _refused(_cli(tmp_path, config, "--output_dir", str(tmp_path / "fresh")), "gradient_allreduce_op")
    out = _copy_run(three_steps, str(tmp_path / "run"))
    _refused(_cli(tmp_path, _changed(), "--output_dir", out), "--allow_config_change")


def test_eval_cli_names_a_model_file_it_cannot_read(tmp_path):
    """An arcface_torch ``.pt`` (or any non-safetensors file) and a missing model file:
    one error line each, naming the file."""
    bogus = tmp_path / "model.weights"
    bogus.write_bytes(b"\x80\x02not a safetensors file")
    arcface = tmp_path / "model.pt"                 # scored only with its arcface_torch network name
    arcface.write_bytes(b"\x80\x02")
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    for model, needle in ((str(bogus), "is not a safetensors file"), (str(arcface), "pass --network"),
                          (str(tmp_path / "missing.safetensors"), "model file not found")):
        proc = subprocess.run([sys.executable, os.path.join(ROOT, "launch", "eval.py"), "--model", model, "--bins",
                               str(tmp_path / "lfw.bin")], env=env, cwd=ROOT, capture_output=True, text=True,
                              timeout=300)
        _refused(proc, needle)


@pytest.mark.parametrize("script, args, needle", [
    ("demo.py", ["--sample-rate", "1.5"], "--sample-rate must be in (0, 1]"),
    ("multitask_tp.py", ["--tp", "0"], "--tp must be >= 1"),
    ("train.py", ["--max_steps", "-1"], "--max_steps must be >= 0"),
])
def test_cli_argument_errors_are_usage_errors(script, args, needle):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "launch", script), *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and needle in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]


def test_how_the_bank_moves_rows_is_a_harmless_change():
    """host_access changes how rows travel, not their values (bitwise equal runs): logged.
    Moving a state to another tier or storage dtype changes training: refused."""
    from ds_pfc.app.resume_changes import differences
    head = {"num_classes": 10, "embedding_size": 8}
    saved = {"ds_pfc": {"head": {**head, "bank": {"default": "host"}}}}
    mapped = {"ds_pfc": {"head": {**head, "bank": {"default": "host", "host_access": "mapped"}}}}
    coded = {"ds_pfc": {"head": {**head, "bank": {"default": "host",
                                                    "placements": {"momentum_buffer": ["host", "int8_rowwise"]}}}}}
    assert [(c.key, c.kind) for c in differences(saved, mapped)] == [("ds_pfc.head.bank.host_access", "harmless")]
    kinds = [c.kind for c in differences(saved, coded)]
    assert kinds and set(kinds) == {"training"}


def test_turning_on_a_non_finite_policy_or_preemption_signals_is_a_harmless_change():
    """A run that crashed on a NaN can resume with on_nonfinite skip/rollback (or other
    preemption signals) without --allow_config_change: nothing changes until such a step."""
    from ds_pfc.app.resume_changes import differences
    saved = {"ds_pfc": {"head": {"num_classes": 10}, "train": {"epochs": 1}}}
    now = {"ds_pfc": {"head": {"num_classes": 10}, "train": {
        "epochs": 1, "on_nonfinite": "rollback", "rollback_lr_factor": 0.25, "max_rollbacks": 5,
        "max_consecutive_skips": 3, "preempt_signals": ["SIGUSR2"]}}}
    kinds = {c.key: c.kind for c in differences(saved, now)}
    assert kinds == {f"ds_pfc.train.{k}": "harmless" for k in now["ds_pfc"]["train"] if k != "epochs"}
    assert {c.kind for c in differences(saved, {"ds_pfc": {"head": {"num_classes": 10},
                                                          "train": {"epochs": 1, "seed": 3}}})} == {"training"}


def test_a_checkpoint_of_other_trained_tensors_names_the_embedding_scale_option(three_steps, tmp_path):
    """A vit_t run (its final BatchNorm's scale trains) resumed by a job that fixes the
    scale: DeepSpeed's optimizer cannot load one tensor fewer; the refusal names the
    option (which is all a 0.2.0 checkpoint of a MobileFaceNet or ViT needs), and the
    option itself is not a change the comparison refuses."""
    from ds_pfc.app.resume_changes import differences
    from ds_pfc.checkpoint.tags import CheckpointError
    saved = {"ds_pfc": {"head": {"num_classes": 10}, "backbone": {"name": "mbf"}}}
    fixed = {"ds_pfc": {"head": {"num_classes": 10},
                        "backbone": {"name": "mbf", "options": {"train_embedding_scale": False}}}}
    assert [(c.key, c.kind) for c in differences(saved, fixed)] == [
        ("ds_pfc.backbone.options.train_embedding_scale", "harmless")]
    other = copy.deepcopy(fixed)
    other["ds_pfc"]["backbone"]["options"]["checkpoint_blocks"] = True
    assert {c.kind for c in differences(saved, other)} == {"fixed", "harmless"}
    out = _copy_run(three_steps, str(tmp_path))
    config = copy.deepcopy(CONFIG)
    config["ds_pfc"]["backbone"]["options"] = {"train_embedding_scale": False}
    trainer = _trainer(out, config=config)
    try:
        with pytest.raises(CheckpointError, match="train_embedding_scale false"):
            trainer.resume()
    finally:
        trainer.close()
