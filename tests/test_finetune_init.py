"""Starting a run from pretrained weights (``ds_pfc.train.init``): the backbone from a
model export, the head from head shards, the frozen steps, and the refusals.

References: the export is written here with ``safetensors`` in the documented export
format (``format`` metadata ``ds_pfc.model/1``, ``backbone.<name>`` tensors, the job
config) and read back independently with ``safetensors.torch.load_file``; the head
shards come from ``import_head`` on centers drawn here, and the rows a run starts
from are compared with those drawn tensors.
"""
from __future__ import annotations

import copy
import json
import os
import warnings

import pytest
import torch

from _dist import one_process_world

pytest.importorskip("deepspeed")
from safetensors.torch import load_file, save_file  # noqa: E402

from ds_pfc.app.config import ConfigError, split_config  # noqa: E402

C, D = 24, 32
CONFIG = {
    "train_micro_batch_size_per_gpu": 8,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 0.0,
    "steps_per_print": 10 ** 9,
    "optimizer": {"type": "SGD", "params": {"lr": 0.02, "momentum": 0.9, "weight_decay": 5e-4}},
    "zero_optimization": {"stage": 0},
    "ds_pfc": {
        "head": {"num_classes": C, "embedding_size": D, "sample_rate": 1.0, "seed": 5,
                 "margin": {"type": "cosface", "scale": 16.0, "margin": 0.2}},
        "backbone": {"name": "vit_t", "width": 0.25},
        "data": {"synthetic": {"images_per_identity": 3}, "workers": 0},
        "train": {"epochs": 10, "max_steps": 3, "log_every": 1,
                  "schedule": {"type": "poly", "warmup_epochs": 0.0, "power": 1.0}},
        "evaluation": {"synthetic_pairs": 0},
        "checkpoint": {"every_steps": 0, "keep": 0, "export": False},
    },
}


@pytest.fixture(scope="module", autouse=True)
def single_process_group():
    with one_process_world():
        yield


def _write_export(path, backbone_block=None, *, fmt="ds_pfc.model/1", seed=7):
    """A model export as the format defines it, of a backbone with weights drawn here
    (not the ones a run would initialise)."""
    from ds_pfc.app.config import from_dict, BackboneConfig
    block = backbone_block or CONFIG["ds_pfc"]["backbone"]
    torch.manual_seed(seed)
    model = from_dict(BackboneConfig, block, "b").build(D)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, value in model.state_dict().items():
        if value.is_floating_point():
            value = torch.randn(value.shape, generator=gen, dtype=torch.float32) * 0.05
        tensors[f"backbone.{name}"] = value.contiguous()
    config = copy.deepcopy(CONFIG)
    config["ds_pfc"]["backbone"] = block
    save_file(tensors, path, metadata={"format": fmt, "heads": "[]", "global_steps": "0",
                                       "config": json.dumps(config)})
    return path


def _write_shards(directory, world_size, seed=3):
    """Centers (and SGD momentum) drawn here, in arcface_torch's 2-rank layout,
    imported as ``world_size`` ds_pfc shards. Returns the drawn ``[C, D]`` weight and
    momentum."""
    from ds_pfc.app.arcface_import import ArcfaceHead, import_head
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(C, D, generator=gen)
    momentum = torch.randn(C, D, generator=gen) * 0.01
    cut = C // 2
    source = ArcfaceHead({"weight": [weight[:cut], weight[cut:]], "momentum_buffer": [momentum[:cut], momentum[cut:]]},
                         2, "drawn")
    os.makedirs(directory, exist_ok=True)
    import_head(source, directory, world_size)
    return weight, momentum


def _config(**init):
    config = copy.deepcopy(CONFIG)
    config["ds_pfc"]["train"]["init"] = init
    return config


def _trainer(out, config, logs=None, **options):
    from ds_pfc.app.training import Trainer
    trainer = Trainer(config, output_dir=out, log=(logs.append if logs is not None else (lambda line: None)),
                      **options)
    trainer.setup()
    return trainer


def _backbone_state(trainer):
    return {k: v.detach().clone() for k, v in trainer.engine.module.state_dict().items()}


def test_starts_from_the_exported_backbone_and_the_imported_head(tmp_path):
    export = _write_export(str(tmp_path / "model.safetensors"))
    weight, momentum = _write_shards(str(tmp_path / "head"), 1)
    expected = {k[len("backbone."):]: v for k, v in load_file(export).items()}
    trainer = _trainer(str(tmp_path / "run"), _config(backbone=export, head=str(tmp_path / "head")))
    try:
        state = _backbone_state(trainer)
        assert sorted(state) == sorted(expected)
        for name, value in expected.items():
            assert torch.equal(state[name], value), name
        head_state = trainer.head.state_dict()
        assert torch.equal(head_state["weight"].cpu().reshape(C, D), weight)
        assert torch.equal(head_state["momentum_buffer"].cpu().reshape(C, D), momentum)
        assert trainer.head.seed == 5            # the job's sampling seed, not the one stored with the shards
    finally:
        trainer.close()


def test_frozen_backbone_stays_for_its_steps_then_trains(tmp_path):
    export = _write_export(str(tmp_path / "model.safetensors"))
    expected = {k[len("backbone."):]: v for k, v in load_file(export).items()}
    trainer = _trainer(str(tmp_path / "run"), _config(backbone=export, freeze_backbone_steps=2))
    snapshots, heads = [], []
    step = trainer.engine.step

    def recorded():
        applied = step()
        snapshots.append(_backbone_state(trainer))
        heads.append(trainer.head.state_dict()["weight"].clone())
        return applied
    trainer.engine.step = recorded
    head_before = trainer.head.state_dict()["weight"].clone()
    try:
        trainer.run()
    finally:
        trainer.close()
    # The parameters are frozen (BatchNorm running statistics are buffers and keep
    # following the data, as documented).
    params = {name for name, _ in trainer.engine.module.named_parameters()}
    assert len(snapshots) == 3 and params and params <= set(expected)
    for i in (0, 1):                         # optimizer steps 1 and 2: the backbone is frozen
        for name in params:
            assert torch.equal(snapshots[i][name], expected[name]), (i, name)
    assert not torch.equal(heads[0], head_before)          # the head trains meanwhile
    changed = [n for n in params if not torch.equal(snapshots[2][n], expected[n])]
    assert changed, "the backbone did not train after its frozen steps"

    # Resuming that run: the checkpoint's weights, not the export's.
    logs = []
    again = _trainer(str(tmp_path / "run"), _config(backbone=export, freeze_backbone_steps=2), logs)
    again.close()
    assert any("not read" in line for line in logs), logs

    # A ds_pfc checkpoint tag holds head shards too: a new run starts from its head.
    tag = os.path.join(str(tmp_path / "run"), "checkpoints", "step00000003")
    fresh = _trainer(str(tmp_path / "next"), _config(head=tag))
    try:
        assert torch.equal(fresh.head.state_dict()["weight"], heads[-1])
    finally:
        fresh.close()


def test_backbone_lr_scale_scales_the_backbone_alone(tmp_path):
    from ds_pfc.app.training import schedule_factor
    trainer = _trainer(str(tmp_path / "run"), _config(backbone_lr_scale=0.25, freeze_backbone_steps=1))
    try:
        optimizer = trainer.engine.engine.optimizer
        base = 0.02
        factor = schedule_factor(trainer.cfg.train.schedule, trainer.steps_per_epoch, trainer.total_steps)
        assert optimizer.param_groups[0]["lr"] == 0.0 and trainer.engine.get_lr() == pytest.approx(base * factor(0))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")          # stepped here without an optimizer step
            trainer.engine.engine.lr_scheduler.step()
        assert optimizer.param_groups[0]["lr"] == pytest.approx(base * factor(1) * 0.25)
        assert trainer.engine.get_lr() == pytest.approx(base * factor(1))
    finally:
        trainer.close()


@pytest.mark.parametrize("init, needle", [
    ({"backbone": "/no/such/model.safetensors"}, "ds_pfc.train.init.backbone: no such file"),
    ({"head": "/no/such/dir"}, "ds_pfc.train.init.head: no such directory"),
    ({"head": "."}, "ds_pfc.train.init.head: . holds no head shards"),
    ({"freeze_backbone_steps": -1}, "ds_pfc.train.init.freeze_backbone_steps"),
    ({"freeze_backbone_steps": 1.5}, "ds_pfc.train.init.freeze_backbone_steps"),
    ({"backbone_lr_scale": -0.5}, "ds_pfc.train.init.backbone_lr_scale"),
    ({"backbone": "x", "weights": 1}, "ds_pfc.train.init: unknown key ['weights']"),
])
def test_bad_init_is_a_config_error_naming_the_key(init, needle):
    with pytest.raises(ConfigError) as err:
        split_config(_config(**init))
    assert needle in str(err.value)


def test_deepspeed_scheduler_block_with_a_frozen_backbone_is_refused(tmp_path):
    from ds_pfc.app.training import Trainer
    config = _config(freeze_backbone_steps=2)
    del config["ds_pfc"]["train"]["schedule"]
    config["scheduler"] = {"type": "WarmupLR", "params": {"warmup_num_steps": 2}}
    with pytest.raises(ConfigError, match="ds_pfc.train.init.freeze_backbone_steps"):
        Trainer(config, output_dir=str(tmp_path / "run"))


def test_files_that_do_not_fit_are_refused(tmp_path):
    wrong_width = _write_export(str(tmp_path / "wide.safetensors"), {"name": "vit_t", "width": 0.5})
    with pytest.raises(ConfigError, match=r"ds_pfc.train.init.backbone: .* does not fit this job's backbone"):
        _trainer(str(tmp_path / "a"), _config(backbone=wrong_width))
    other = _write_export(str(tmp_path / "other.safetensors"), fmt="something/1")
    with pytest.raises(ConfigError, match="ds_pfc.train.init.backbone: .* is not a ds_pfc model export"):
        _trainer(str(tmp_path / "b"), _config(backbone=other))
    _write_shards(str(tmp_path / "two"), 2)
    with pytest.raises(ConfigError) as err:
        _trainer(str(tmp_path / "c"), _config(head=str(tmp_path / "two")))
    message = str(err.value)
    assert "ds_pfc.train.init.head" in message and "world_size=[2]" in message
    assert "import-arcface" in message and "--world_size 1" in message


def test_resume_compares_the_schedule_part_of_init_only(tmp_path):
    from ds_pfc.app.resume_changes import differences, effective_config
    export = _write_export(str(tmp_path / "model.safetensors"))
    plain = copy.deepcopy(CONFIG)
    paths_only = _config(backbone=export)
    frozen = _config(backbone=export, freeze_backbone_steps=4)

    def kinds(saved, current):
        return {c.key: c.kind for c in differences(effective_config(saved, None), effective_config(current, None))}
    assert kinds(plain, paths_only) == {"ds_pfc.train.init.backbone": "harmless"}
    assert kinds(plain, frozen) == {"ds_pfc.train.init.backbone": "harmless",
                                    "ds_pfc.train.init.freeze_backbone_steps": "training"}


def _ranks_setup(rank, world_size, out, config):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=os.environ["DS_PFC_TEST_PORT"])
    trainer = _trainer(out, config)
    try:
        return {"class_start": trainer.head.class_start, "num_local": trainer.head.num_local,
                "weight": trainer.head.state_dict()["weight"].cpu().clone(),
                "backbone": _backbone_state(trainer)}
    finally:
        trainer.close()


def test_each_rank_starts_from_its_own_shard(tmp_path):
    from _dist import run_ranks
    export = _write_export(str(tmp_path / "model.safetensors"))
    weight, _ = _write_shards(str(tmp_path / "head"), 2)
    expected = {k[len("backbone."):]: v for k, v in load_file(export).items()}
    results = run_ranks(_ranks_setup, 2, str(tmp_path / "run"),
                        _config(backbone=export, head=str(tmp_path / "head")))
    starts = []
    for r in results:
        start, n = r["class_start"], r["num_local"]
        starts.append((start, n))
        assert torch.equal(r["weight"].reshape(n, D), weight[start:start + n])
        for name, value in expected.items():
            assert torch.equal(r["backbone"][name], value), name
    assert sorted(starts) == [(0, C // 2), (C // 2, C // 2)]


def test_a_resumed_run_keeps_the_backbone_frozen_for_the_rest_of_its_steps(tmp_path):
    export = _write_export(str(tmp_path / "model.safetensors"))
    expected = {k[len("backbone."):]: v for k, v in load_file(export).items()}
    config = _config(backbone=export, freeze_backbone_steps=2)
    first = _trainer(str(tmp_path / "run"), copy.deepcopy(config), max_steps=1)
    try:
        first.run()
    finally:
        first.close()
    trainer = _trainer(str(tmp_path / "run"), copy.deepcopy(config), max_steps=3)
    snapshots = []
    step = trainer.engine.step

    def recorded():
        applied = step()
        snapshots.append(_backbone_state(trainer))
        return applied
    trainer.engine.step = recorded
    try:
        summary = trainer.run()
    finally:
        trainer.close()
    params = [name for name, _ in trainer.engine.module.named_parameters()]
    assert summary["resumed"] and len(snapshots) == 2           # optimizer steps 2 and 3
    assert all(torch.equal(snapshots[0][n], expected[n]) for n in params)
    assert any(not torch.equal(snapshots[1][n], expected[n]) for n in params)


def test_head_from_a_runs_checkpoints_directory_reads_the_tag_latest_names(tmp_path):
    """init.head may name a run's checkpoints/ directory: the head starts from the tag its
    'latest' file names (read back here with safetensors from that tag's shard), the log
    names the tag; with 'latest' lagging behind a newer complete tag, the newer one is
    read, as the export command reads it."""
    from ds_pfc.app.training import Trainer
    first = copy.deepcopy(CONFIG)
    first["ds_pfc"]["train"]["max_steps"] = 2
    first["ds_pfc"]["checkpoint"]["every_steps"] = 1
    source = str(tmp_path / "source")
    trainer = Trainer(first, output_dir=source, log=lambda line: None)
    try:
        trainer.run()
    finally:
        trainer.close()
    checkpoints = os.path.join(source, "checkpoints")
    assert open(os.path.join(checkpoints, "latest")).read().strip() == "step00000002"
    shard = "head-rank00000-of-00001.safetensors"
    saved = {tag: load_file(os.path.join(checkpoints, tag, shard))["weight"]
             for tag in ("step00000001", "step00000002")}
    assert not torch.equal(saved["step00000001"], saved["step00000002"])      # training moved the rows

    logs = []
    trainer = _trainer(str(tmp_path / "run"), _config(head=checkpoints), logs)
    try:
        assert torch.equal(trainer.head.state_dict()["weight"].cpu(), saved["step00000002"].reshape(C, D))
    finally:
        trainer.close()
    assert any("is a checkpoints directory: reading its tag step00000002" in line for line in logs), logs

    with open(os.path.join(checkpoints, "latest"), "w") as f:      # a save interrupted before it moved 'latest'
        f.write("step00000001")
    logs = []
    trainer = _trainer(str(tmp_path / "run2"), _config(head=checkpoints), logs)
    try:
        assert torch.equal(trainer.head.state_dict()["weight"].cpu(), saved["step00000002"].reshape(C, D))
    finally:
        trainer.close()
    assert any("reading its tag step00000002" in line and "names step00000001" in line for line in logs), logs


def test_an_empty_checkpoints_directory_is_not_a_head(tmp_path):
    empty = tmp_path / "checkpoints"
    empty.mkdir()
    with pytest.raises(ConfigError, match="ds_pfc.train.init.head: .* no head shards .* no checkpoints directory"):
        split_config(_config(head=str(empty)))


def test_a_missing_relative_class_map_names_where_it_looked_and_the_file_beside_the_config(tmp_path, monkeypatch):
    """A relative class_map is read from the working directory; when it is missing there,
    the error gives the absolute path tried, the working directory and, when the file sits
    beside the job config, that path (the run does not read it from there)."""
    from ds_pfc.app.training import Trainer
    _write_shards(str(tmp_path / "head"), 1)
    jobs, work = tmp_path / "jobs", tmp_path / "work"
    jobs.mkdir()
    work.mkdir()
    (jobs / "map.txt").write_text("0 0\n")
    job = jobs / "job.json"
    config = _config(head=str(tmp_path / "head"), class_map="map.txt")
    job.write_text(json.dumps(config))
    monkeypatch.chdir(work)
    with pytest.raises(ConfigError) as err:
        Trainer(config, output_dir=str(tmp_path / "run"), config_path=str(job))
    message = str(err.value)
    assert message.startswith("ds_pfc.train.init.class_map: no such file 'map.txt'")
    assert f"looked for {work / 'map.txt'}" in message and f"working directory {work}" in message
    assert f"{jobs / 'map.txt'} exists beside the job config {job}" in message
    assert not (tmp_path / "run").exists()
    (jobs / "map.txt").unlink()                 # nothing beside the config: no such hint
    with pytest.raises(ConfigError) as err:
        Trainer(config, output_dir=str(tmp_path / "run"), config_path=str(job))
    assert f"looked for {work / 'map.txt'}" in str(err.value) and "beside" not in str(err.value)
    (work / "map.txt").write_text("0 0\n")      # found in the working directory: accepted
    assert split_config(config)[1].train.init.class_map == "map.txt"


def test_max_steps_0_writes_the_initial_state_and_a_later_run_resumes_it(tmp_path):
    """max_steps 0 trains nothing: the checkpoint step00000000 holds the init weights (the
    head rows and the export's backbone read back with safetensors equal the ones drawn
    here), the export exists, and a run with more steps resumes from it, training exactly
    as a run started from the same init weights does."""
    from ds_pfc.app.training import Trainer
    export = _write_export(str(tmp_path / "model.safetensors"))
    weight, momentum = _write_shards(str(tmp_path / "head"), 1)
    expected = {k: v for k, v in load_file(export).items()}
    config = _config(backbone=export, head=str(tmp_path / "head"))
    config["ds_pfc"]["checkpoint"]["export"] = True
    out = str(tmp_path / "run")
    logs = []
    trainer = Trainer(config, output_dir=out, max_steps=0, log=logs.append)
    try:
        summary = trainer.run()
    finally:
        trainer.close()
    tag = os.path.join(out, "checkpoints", "step00000000")
    assert summary["checkpoint"] == tag and summary["losses"] == []
    assert os.path.isfile(os.path.join(tag, "ds_pfc_complete.json"))
    assert open(os.path.join(out, "checkpoints", "latest")).read().strip() == "step00000000"
    shard = load_file(os.path.join(tag, "head-rank00000-of-00001.safetensors"))
    assert torch.equal(shard["weight"].reshape(C, D), weight)
    assert torch.equal(shard["momentum_buffer"].reshape(C, D), momentum)
    exported = load_file(os.path.join(out, "export", "model.safetensors"))
    for name, value in expected.items():
        assert torch.equal(exported[name].to(value.dtype), value), name
    assert any("no training steps to run" in line for line in logs), logs

    logs = []
    trainer = Trainer(config, output_dir=out, max_steps=2, log=logs.append)
    try:
        resumed = trainer.run()
    finally:
        trainer.close()
    assert resumed["resumed"] and any("resumed from" in line and "step00000000" in line for line in logs), logs
    assert len(resumed["losses"]) == 2
    direct = Trainer(config, output_dir=str(tmp_path / "direct"), max_steps=2, log=lambda line: None)
    try:
        reference = direct.run()
    finally:
        direct.close()
    assert resumed["losses"] == reference["losses"]


@pytest.mark.parametrize("value", [-1, 1.5, True])
def test_max_steps_below_0_or_not_an_integer_is_refused(value):
    config = copy.deepcopy(CONFIG)
    config["ds_pfc"]["train"]["max_steps"] = value
    with pytest.raises(ConfigError, match="ds_pfc.train.max_steps must be "):
        split_config(config)

