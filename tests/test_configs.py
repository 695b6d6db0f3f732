"""The shipped job configs (``configs/*.json``): each parses without a warning, is a
valid DeepSpeed config at the GPU count its file name states (``..._8gpu_...``; none
named: one), follows the repository's config rules (see ``rule_violations``), and the
paper configs carry the paper's numbers. Nothing big is built: only the CPU
quickstart's head is; the backbones are built on the meta device."""
import copy
import glob
import json
import os
import re
import warnings

import pytest
import torch

import deepspeed.comm
from deepspeed.runtime import lr_schedules
from deepspeed.runtime.config import DeepSpeedConfig

from ds_pfc.app.config import ConfigError, split_config
from ds_pfc.models import ALIASES, BACKBONES
from ds_pfc.app.training import Trainer, schedule_factor

CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
NAMES = sorted(os.path.basename(p) for p in glob.glob(os.path.join(CONFIG_DIR, "*.json")))

# The paper configs and the numbers they must carry (paper: Training Settings, Table 1,
# Table 2, the WebFace ablations and the communication profile). ``images``: the
# insightface release's image count, from which the epoch milestones are derived.
PAPER = {
    "single_gpu_r50.json": dict(batch=512, classes=10572, backbone="iresnet50", r=0.1, lr=0.1, images=490623,
                                milestones=[20000, 28000], end=32000),
    "casia_r50_8gpu_fp16.json": dict(batch=512, classes=10572, backbone="iresnet50", r=0.1, lr=0.1,
                                     images=490623, milestones=[20000, 28000], end=32000),
    "ms1mv2_r100_8gpu_fp16.json": dict(batch=512, classes=85742, backbone="iresnet100", r=0.1, lr=0.1,
                                       images=5822653, milestones=[100000, 160000], end=180000),
    "glint360k_r100_8gpu_fp16.json": dict(batch=512, classes=360232, backbone="iresnet100", r=0.1, lr=0.1,
                                          images=17091657, milestones=[200000, 400000, 500000, 550000],
                                          end=600000),
    "webface4m_r50_8gpu.json": dict(batch=1024, classes=205990, backbone="iresnet50", r=0.3, lr=0.1, epochs=20,
                                    power=2.0),
    "webface42m_r100_32gpu_poly.json": dict(batch=4096, classes=2059906, backbone="iresnet100", r=0.2, lr=0.4,
                                            epochs=20, warmup=2, power=2.0),
    "profile_vits_8gpu_bf16_adamw.json": dict(batch=2048, backbone="vit_s", r=0.1, precision="bf16",
                                              optimizer="AdamW"),
    "webface42m_vit_64gpu.json": dict(batch=24576, classes=2059906, backbone="vit_s", r=0.3, lr=1e-3, epochs=40,
                                      warmup=4, power=2.0, precision="bf16", optimizer="AdamW"),
}


# torch optimizers DeepSpeed's ZeRO accepts without ``zero_allow_untested_optimizer``
# (deepspeed/runtime/zero/utils.py; FusedAdam/CPU Adam are what "Adam"/"AdamW" build).
ZERO_TESTED = {"adam", "adamw", "adagrad", "lion"}
# Keys DeepSpeed pops from the optimizer params before constructing the optimizer.
DEEPSPEED_ONLY_OPTIMIZER_KEYS = {"torch_adam", "adam_w_mode", "fp32_optimizer_states", "bias_correction",
                                 "set_grad_none"}


def load(name: str) -> dict:
    def no_duplicates(pairs):
        keys = [k for k, _ in pairs]
        assert len(keys) == len(set(keys)), f"{name}: duplicate keys {keys}"
        return dict(pairs)
    with open(os.path.join(CONFIG_DIR, name)) as f:
        return json.load(f, object_pairs_hook=no_duplicates)


def world_size(name: str) -> int:
    """The GPU count a config is written for, from its file name (default 1)."""
    match = re.search(r"(\d+)gpu", name)
    return int(match.group(1)) if match else 1


def is_cpu(name: str) -> bool:
    return name.startswith("cpu_")


def parse(config: dict):
    """``split_config`` with its warnings silenced (the rules are checked separately)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return split_config(config)


def precision(ds: dict) -> str:
    for key in ("fp16", "bf16"):
        if ds.get(key, {}).get("enabled"):
            return key
    return "fp32"


def rule_violations(name: str, config: dict) -> list[str]:
    """What is wrong with a job config, by the repository's rules (empty: nothing)."""
    ds, pfc = parse(config)
    problems = []
    if not pfc.description.strip():
        problems.append("ds_pfc.description is empty")
    if "train_batch_size" in ds:
        problems.append("train_batch_size is set (it must equal micro x GAS x world; let the launcher decide)")
    if "train_micro_batch_size_per_gpu" not in ds:
        problems.append("train_micro_batch_size_per_gpu is missing")
    if "gradient_clipping" not in ds:
        problems.append("gradient_clipping is missing (DeepSpeed's default clips at 1.0)")
    if ds.get("steps_per_print", 10) < 10**6:
        problems.append("steps_per_print is small (DeepSpeed's own step lines would flood the log)")
    if not ds.get("csv_monitor", {}).get("enabled"):
        problems.append("csv_monitor is not enabled")
    if "optimizer" not in ds:
        problems.append("the DeepSpeed optimizer block is missing (the training app requires it)")
    opt_type = ds.get("optimizer", {}).get("type", "")
    stage = ds.get("zero_optimization", {}).get("stage", 0)
    if "scheduler" in ds:
        if pfc.train.schedule is not None:
            problems.append("both DeepSpeed's scheduler block and ds_pfc.train.schedule are set")
        if not hasattr(lr_schedules, ds["scheduler"].get("type", "")) and (precision(ds) != "fp32" or stage > 0):
            problems.append(f"scheduler {ds['scheduler'].get('type')!r} is a torch scheduler: DeepSpeed hands it "
                            "its fp16/bf16/ZeRO optimizer wrapper, which torch rejects ('... is not an Optimizer')")
    if stage >= 1 and opt_type.lower() not in ZERO_TESTED and not ds.get("zero_allow_untested_optimizer"):
        problems.append(f"ZeRO stage {stage} with {opt_type!r} needs zero_allow_untested_optimizer")
    if is_cpu(name) and precision(ds) == "fp16":
        problems.append("fp16 in a CPU config (DeepSpeed's CPU accelerator has no fp16)")
    family = {"sgd": "sgd", "adam": "adamw", "adamw": "adamw"}.get(opt_type.lower())
    if family is not None and pfc.head.optimizer.type != family:
        problems.append(f"head optimizer {pfc.head.optimizer.type!r} differs from the engine's {opt_type!r}")
    if ALIASES.get(pfc.backbone.name, pfc.backbone.name) not in BACKBONES:
        problems.append(f"unknown backbone {pfc.backbone.name!r}")
    if not pfc.train.output_dir.startswith("runs/"):
        problems.append(f"output_dir {pfc.train.output_dir!r} is not under runs/")
    if pfc.checkpoint.every_steps < (1 if is_cpu(name) else 1000):
        problems.append(f"checkpoint.every_steps is {pfc.checkpoint.every_steps} (a few thousand on GPUs)")
    if pfc.data.source == "recordio" and not pfc.data.path.endswith(".rec"):
        problems.append(f"recordio path {pfc.data.path!r} is not a .rec file")
    if pfc.data.source != "synthetic" and not pfc.evaluation.bins:
        problems.append("real data but no evaluation bins: nothing would be verified")
    return problems


class FakeMpu:
    """The data-parallel topology DeepSpeedConfig asks an mpu for, without a process group."""

    def __init__(self, world: int):
        self.world = world

    def get_data_parallel_world_size(self):
        return self.world

    def get_data_parallel_rank(self):
        return 0

    def get_data_parallel_group(self):
        return None

    def get_model_parallel_world_size(self):
        return 1

    def get_model_parallel_rank(self):
        return 0

    def get_model_parallel_group(self):
        return None


def test_the_configs_are_there():
    assert "cpu_quickstart.json" in NAMES
    assert set(PAPER) <= set(NAMES), f"missing: {sorted(set(PAPER) - set(NAMES))}"
    dirs = [parse(load(n))[1].train.output_dir for n in NAMES]
    assert len(set(dirs)) == len(dirs), f"output_dir shared between configs: {dirs}"


@pytest.mark.parametrize("name", NAMES)
def test_parses_without_warnings(name):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        split_config(load(name))


@pytest.mark.parametrize("name", NAMES)
def test_follows_the_rules(name):
    assert rule_violations(name, load(name)) == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Trainer(load(name))                       # the training app's own checks (it builds nothing yet)


@pytest.mark.parametrize("name", NAMES)
def test_has_a_description(name):
    assert parse(load(name))[1].description.strip()


@pytest.mark.parametrize("name", NAMES)
def test_mixed_precision_configs_run_the_head_gemms_in_reduced_precision(name):
    """A GPU config that trains in fp16/bf16 must not leave the head's GEMMs in float32
    (no tensor cores: ~1/12 of the bf16 rate), and says why in its description."""
    cfg = load(name)
    if not (cfg.get("fp16", {}).get("enabled") or cfg.get("bf16", {}).get("enabled")):
        return
    pfc = parse(cfg)[1]
    assert pfc.head.compute_dtype in ("bf16", "fp16"), (name, pfc.head.compute_dtype)
    assert "compute_dtype" in pfc.description, name


@pytest.mark.parametrize("name", NAMES)
def test_is_a_valid_deepspeed_config_at_its_gpu_count(name, monkeypatch):
    ds, pfc = parse(load(name))
    world = world_size(name)
    # DeepSpeedConfig asks dist.get_rank() before the mpu and falls back to world size
    # 1 when no process group exists; a rank is all it needs from the process group.
    monkeypatch.setattr(deepspeed.comm, "get_rank", lambda group=None: 0)
    cfg = DeepSpeedConfig(copy.deepcopy(ds), mpu=FakeMpu(world))
    assert cfg.world_size == world
    micro, gas = ds["train_micro_batch_size_per_gpu"], ds.get("gradient_accumulation_steps", 1)
    assert (cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (micro, gas)
    assert cfg.train_batch_size == micro * gas * world
    assert cfg.gradient_clipping == ds["gradient_clipping"]
    if not is_cpu(name):
        assert re.search(rf"\b{world} GPUs?\b", pfc.description), f"the description does not say {world} GPU(s)"

    # The optimizer (and scheduler) parameters construct what DeepSpeed would build.
    param = torch.nn.Parameter(torch.zeros(2))
    params = {k: v for k, v in ds["optimizer"].get("params", {}).items() if k not in DEEPSPEED_ONLY_OPTIMIZER_KEYS}
    opt_type = ds["optimizer"]["type"]
    if opt_type.lower() in ("adam", "adamw"):
        optimizer = torch.optim.AdamW([param], **params)
    else:
        optimizer = getattr(torch.optim, opt_type)([param], **params)
    if "scheduler" in ds:
        kind = ds["scheduler"]["type"]
        scheduler = getattr(lr_schedules, kind, None) or getattr(torch.optim.lr_scheduler, kind)
        scheduler(optimizer, **ds["scheduler"].get("params", {}))


@pytest.mark.parametrize("name", NAMES)
def test_backbone_builds_on_the_meta_device(name):
    _, pfc = parse(load(name))
    with torch.device("meta"):
        backbone = pfc.backbone.build(pfc.head.embedding_size)       # checks backbone.options too
        size = pfc.data.synthetic.image_size if pfc.data.source == "synthetic" else 112
        out = backbone.eval()(torch.zeros(2, 3, size, size))
    assert out.shape == (2, pfc.head.embedding_size)


@pytest.mark.parametrize("name", [n for n in NAMES if is_cpu(n)])
def test_cpu_config_head_builds_and_runs(name):
    _, pfc = parse(load(name))
    head = pfc.head.build(device=torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, pfc.head.embedding_size, generator=g)
    y = torch.randint(0, pfc.head.num_classes, (8,), generator=g)
    loss = head(x, y)
    assert torch.isfinite(loss)
    head.close()


@pytest.mark.parametrize("name", sorted(PAPER))
def test_paper_numbers(name):
    want = PAPER[name]
    ds, pfc = parse(load(name))
    world = world_size(name)
    micro, gas = ds["train_micro_batch_size_per_gpu"], ds.get("gradient_accumulation_steps", 1)
    assert micro * gas * world == want["batch"]
    assert ALIASES.get(pfc.backbone.name, pfc.backbone.name) == want["backbone"]
    assert pfc.head.sample_rate == want["r"]
    assert pfc.head.embedding_size == 512
    if "classes" in want:
        assert pfc.head.num_classes == want["classes"]
    if "lr" in want:
        assert ds["optimizer"]["params"]["lr"] == want["lr"]
    assert precision(ds) == want.get("precision", precision(ds))
    assert ds["optimizer"]["type"] == want.get("optimizer", "SGD")
    if ds["optimizer"]["type"] == "SGD":
        assert ds["optimizer"]["params"] == {"lr": want["lr"], "momentum": 0.9, "weight_decay": 5e-4}
    if pfc.backbone.name.startswith("iresnet"):
        expected_margin = {"arcface": 0.5, "cosface": 0.4}[pfc.head.margin.type]
        assert (pfc.head.margin.scale, pfc.head.margin.margin) == (64.0, expected_margin)

    schedule = pfc.train.schedule
    if "milestones" in want:
        # The step schedule, in epochs, lands exactly on the paper's iterations at the
        # training app's steps per epoch (micro-batch blocks, drop_last).
        steps_per_epoch = want["images"] // (world * micro) * micro // (micro * gas)
        total = min(int(pfc.train.epochs * steps_per_epoch), pfc.train.max_steps)
        assert pfc.train.max_steps == want["end"] == total
        assert schedule.type == "step" and schedule.gamma == 0.1 and schedule.warmup_epochs == 0
        factor = schedule_factor(schedule, steps_per_epoch, total)
        drops = [s for s in range(1, total) if factor(s) != factor(s - 1)]
        assert drops == want["milestones"]
        assert factor(0) == 1.0 and factor(total - 1) == pytest.approx(0.1 ** len(want["milestones"]))
    if "epochs" in want:
        assert pfc.train.epochs == want["epochs"] and pfc.train.max_steps is None
        assert schedule.type == "poly" and schedule.power == want["power"]
        assert schedule.warmup_epochs == want.get("warmup", schedule.warmup_epochs) > 0


def test_a_typo_in_the_block_is_an_error_naming_the_key():
    for name in NAMES:
        config = copy.deepcopy(load(name))
        config["ds_pfc"]["head"]["sampel_rate"] = 0.1
        with pytest.raises(ConfigError, match="sampel_rate"):
            parse(config)
        config = copy.deepcopy(load(name))
        config["ds_pfc"]["train"]["ouput_dir"] = "runs/x"
        with pytest.raises(ConfigError, match="ds_pfc.train.*ouput_dir"):
            parse(config)


def test_a_top_level_typo_is_refused():
    config = load("casia_r50_8gpu_fp16.json")
    config["train_micro_batch_size_per_gpuu"] = 32
    with pytest.raises(ConfigError, match=r"\['train_micro_batch_size_per_gpuu'\] is not a DeepSpeed key .*did you "
                                          r"mean 'train_micro_batch_size_per_gpu'\?"):
        split_config(config)


@pytest.mark.parametrize("change, needle", [
    (lambda c: c.update(train_batch_size=512), "train_batch_size is set"),
    (lambda c: c.pop("gradient_clipping"), "gradient_clipping is missing"),
    (lambda c: c["ds_pfc"].update(description=" "), "description is empty"),
    (lambda c: c["csv_monitor"].update(enabled=False), "csv_monitor"),
    (lambda c: c.update(scheduler={"type": "MultiStepLR", "params": {"milestones": [20000], "gamma": 0.1}}),
     "both DeepSpeed's scheduler block and ds_pfc.train.schedule"),
    (lambda c: (c["ds_pfc"]["train"].pop("schedule"),
                c.update(scheduler={"type": "MultiStepLR", "params": {"milestones": [20000], "gamma": 0.1}})),
     "is a torch scheduler"),
    (lambda c: c.update(zero_optimization={"stage": 1}), "needs zero_allow_untested_optimizer"),
    (lambda c: c["ds_pfc"]["head"]["optimizer"].update(type="adamw"), "differs from the engine's"),
    (lambda c: c["ds_pfc"]["train"].update(output_dir="/tmp/x"), "not under runs/"),
    (lambda c: c["ds_pfc"]["evaluation"].update(bins=[]), "no evaluation bins"),
])
def test_the_rules_catch_bad_copies(change, needle):
    config = copy.deepcopy(load("casia_r50_8gpu_fp16.json"))
    change(config)
    assert any(needle in p for p in rule_violations("casia_r50_8gpu_fp16.json", config)), needle


def test_fp16_is_refused_in_cpu_configs():
    config = copy.deepcopy(load("cpu_quickstart.json"))
    config["fp16"] = {"enabled": True}
    assert any("fp16 in a CPU config" in p for p in rule_violations("cpu_quickstart.json", config))
