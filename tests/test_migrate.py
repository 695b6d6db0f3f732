"""``ds-pfc-migrate config``: arcface_torch's Python configs, read with ``ast``
(never executed), mapped key by key to a ds_pfc job that ds_pfc's own loader accepts.

The configs are written here in arcface_torch's layout (``configs/base.py`` plus a job
file, ``config = edict(); config.key = value``); the expected values follow from what
arcface_torch's train_v2.py does with each key, written out by hand."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from ds_pfc.app.config import ConfigError, split_config
from ds_pfc.app.migrate import ARCFACE_BASE_DEFAULTS, MigrateError, convert_arcface_config, parse_arcface_config
from ds_pfc.cli.migrate import main
from ds_pfc.app.training import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# arcface_torch's configs/base.py layout (comments, the AdamW alternative commented out).
BASE = """\
from easydict import EasyDict as edict

# make training faster
config = edict()

# Margin Base Softmax
config.margin_list = (1.0, 0.5, 0.0)
config.network = "r50"
config.resume = False
config.save_all_states = False
config.output = "ms1mv3_arcface_r50"

config.embedding_size = 512

# Partial FC
config.sample_rate = 1
config.interclass_filtering_threshold = 0

config.fp16 = False
config.batch_size = 128

# For SGD
config.optimizer = "sgd"
config.lr = 0.1
config.momentum = 0.9
config.weight_decay = 5e-4

# For AdamW
# config.optimizer = "adamw"
# config.lr = 0.001
# config.weight_decay = 0.1

config.verbose = 2000
config.frequent = 10
config.dali = False
config.dali_aug = False
config.gradient_acc = 1
config.seed = 2048
config.num_workers = 2

config.wandb_key = "XXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXX"
config.suffix_run_name = None
config.using_wandb = False
config.wandb_entity = "entity"
config.wandb_project = "project"
config.wandb_log_all = True
config.save_artifacts = False
config.wandb_resume = False # resume wandb run
"""

MS1MV3_R50 = """\
from easydict import EasyDict as edict

config = edict()
config.margin_list = (1.0, 0.5, 0.0)
config.network = "r50"
config.resume = False
config.output = None
config.embedding_size = 512
config.sample_rate = 1.0
config.fp16 = True
config.momentum = 0.9
config.weight_decay = 5e-4
config.batch_size = 128
config.lr = 0.1
config.verbose = 2000
config.dali = False

config.rec = "/train_tmp/ms1m-retinaface-t1"
config.num_classes = 93431
config.num_image = 5179510
config.num_epoch = 20
config.warmup_epoch = 0
config.val_targets = ['lfw', 'cfp_fp', "agedb_30"]
"""

# A WebFace42M ViT recipe: AdamW, gradient accumulation, warm-up computed from another key,
# the inter-class filter, and the base imported explicitly.
WF42M_VIT = """\
from easydict import EasyDict as edict
from configs.base import config

config.margin_list = (1.0, 0.0, 0.4)
config.network = "vit_s_dp005_mask_0"
config.output = "out/vit"
config.sample_rate = 0.3
config.interclass_filtering_threshold = 0.4
config.fp16 = True
config.weight_decay = 0.1
config.batch_size = 256
config.gradient_acc = 12 # total batchsize is 256 * 12
config.optimizer = "adamw"
config.lr = 0.001
config.verbose = 2000
config.frequent = 50
config.num_workers = 4
config.rec = "/train_tmp/WebFace42M"
config.num_classes = 2059906
config.num_image = 42474557
config.num_epoch = 40
config.warmup_epoch = config.num_epoch // 10
config.val_targets = []
"""

SYNTHETIC_MBF = """\
from easydict import EasyDict as edict
config = edict()
config.margin_list = (1.0, 0.0, 0.4)
config.network = "mbf"
config.resume = True
config.save_all_states = True
config.output = None
config.embedding_size = 128
config.sample_rate = 0.1
config.batch_size = 512 # total_batch_size = batch_size * num_gpus
config.lr = 0.1
config.rec = "synthetic"
config.num_classes = 30 * 10000
config.num_image = 100000
config.num_epoch = 30
config.warmup_epoch = -1
config.val_targets = []
config.using_wandb = True
config.wandb_project = "faces"
config.my_note = "kept for the log"
"""


def _write(directory, name, text):
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, name)
    with open(path, "w") as f:
        f.write(text)
    return path


@pytest.fixture
def configs(tmp_path):
    d = tmp_path / "configs"
    _write(d, "base.py", BASE)
    return d


def _convert(path, **kw):
    conv = convert_arcface_config(parse_arcface_config(str(path)), **kw)
    return conv, conv.config, conv.config["ds_pfc"]


def _loads(tmp_path, config: dict):
    """Through ds_pfc's own loader, as launch/train.py reads a job."""
    path = tmp_path / "job.json"
    path.write_text(json.dumps(config))
    return split_config(load_config(str(path)))


def test_arcface_recipe_over_base_key_by_key(configs, tmp_path):
    conv, ds, pfc = _convert(_write(configs, "ms1mv3_r50.py", MS1MV3_R50))
    assert ds["train_micro_batch_size_per_gpu"] == 128 and ds["gradient_accumulation_steps"] == 1
    assert ds["gradient_clipping"] == 5.0                        # train_v2 clips the backbone at norm 5
    assert ds["optimizer"] == {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9, "weight_decay": 5e-4}}
    assert ds["fp16"]["enabled"] is True and ds["fp16"]["initial_scale_power"] == 16
    assert ds["fp16"]["loss_scale"] == 0 and ds["fp16"]["loss_scale_window"] == 100   # GradScaler(growth_interval=100)
    head = pfc["head"]
    assert head["margin"] == {"type": "arcface", "scale": 64.0, "margin": 0.5, "straight_through": True}
    assert (head["num_classes"], head["embedding_size"], head["sample_rate"]) == (93431, 512, 1.0)
    assert "filter_threshold" not in head                       # base's 0 means off
    assert head["compute_dtype"] == "fp32"                      # PartialFC_V2 is built with fp16=False
    assert head["optimizer"] == {"type": "sgd", "lr_ratio": 1.0, "momentum": 0.9, "weight_decay": 5e-4}
    assert head["seed"] == 2048
    assert pfc["backbone"] == {"name": "r50"}
    assert pfc["data"] == {"source": "recordio", "path": "/train_tmp/ms1m-retinaface-t1/train.rec", "seed": 2048,
                           "workers": 2, "flip": True, "shuffle": True}
    # train_v2.py's PolynomialLRWarmup (power 1) over config.num_image's epochs, per micro batch
    assert pfc["train"] == {"epochs": 20, "schedule": {"type": "arcface", "warmup_epochs": 0, "power": 1.0,
                                                       "images_per_epoch": 5179510},
                            "seed": 2048, "log_every": 10, "output_dir": os.path.join("work_dirs", "ms1mv3_r50")}
    # DDP's fp16_compress_hook: float16 all-reduces, divided by the world size before the sum
    assert (ds["communication_data_type"], ds["prescale_gradients"]) == ("fp16", True)
    assert pfc["evaluation"] == {"every_steps": 2000, "bins": ["/train_tmp/ms1m-retinaface-t1/lfw.bin",
                                                               "/train_tmp/ms1m-retinaface-t1/cfp_fp.bin",
                                                               "/train_tmp/ms1m-retinaface-t1/agedb_30.bin"]}
    # What a long cluster job needs, whatever the recipe says: resume on, a checkpoint every 30
    # minutes of wall time (no --world-size: no per-epoch steps), TensorBoard as arcface_torch.
    assert pfc["checkpoint"] == {"export": True, "resume": True, "every_minutes": 30.0, "every_steps": 0}
    assert ds["tensorboard"] == {"enabled": True}
    # --faithful: the recipe's resume = False and final-only checkpoints
    _, faithful_ds, faithful = _convert(os.path.join(configs, "ms1mv3_r50.py"), faithful=True)
    assert faithful["checkpoint"] == {"export": True, "resume": False, "every_steps": 0}
    assert faithful_ds["tensorboard"] == {"enabled": True}
    assert {k: v for k, v in faithful_ds.items() if k != "ds_pfc"} == {k: v for k, v in ds.items() if k != "ds_pfc"}
    assert {k: v for k, v in faithful.items() if k != "checkpoint"} == {k: v for k, v in pfc.items()
                                                                           if k != "checkpoint"}
    unmapped = {k: why for k, _, why in conv.unmapped}
    assert set(unmapped) == {"wandb_key", "suffix_run_name", "using_wandb", "wandb_entity",
                             "wandb_project", "wandb_log_all", "save_artifacts", "wandb_resume"}
    assert "XXXX" not in json.dumps(ds)                          # the key is never written
    notes = " ".join(conv.notes)
    assert "straight-through" in notes and "per GPU" in notes and "every unsampled row" in notes
    assert "fp16_compress_hook" in notes and "PolynomialLRWarmup" in notes
    ds_config, parsed = _loads(tmp_path, ds)
    margin = parsed.head.margin.build()
    assert type(margin).__name__ == "ArcFace" and margin.straight_through and margin.margin == 0.5
    assert parsed.head.optimizer.kwargs()["weight_decay"] == 5e-4


def test_vit_adamw_with_explicit_base_import_key_by_key(configs, tmp_path):
    conv, ds, pfc = _convert(_write(configs, "wf42m_vit.py", WF42M_VIT))
    assert ds["train_micro_batch_size_per_gpu"] == 256 and ds["gradient_accumulation_steps"] == 12
    assert ds["optimizer"] == {"type": "AdamW", "params": {"lr": 0.001, "betas": [0.9, 0.999], "eps": 1e-8,
                                                           "weight_decay": 0.1, "torch_adam": True}}
    head = pfc["head"]
    assert head["margin"] == {"type": "cosface", "scale": 64.0, "margin": 0.4}
    assert head["filter_threshold"] == 0.4 and head["sample_rate"] == 0.3
    assert head["optimizer"] == {"type": "adamw", "lr_ratio": 1.0, "betas": [0.9, 0.999], "eps": 1e-8,
                                 "weight_decay": 0.1}
    assert pfc["backbone"] == {"name": "vit_s", "options": {"style": "arcface", "drop_path_rate": 0.05,
                                                           "mask_ratio": 0.0}}
    assert pfc["train"]["schedule"]["warmup_epochs"] == 4        # config.num_epoch // 10
    assert pfc["train"]["epochs"] == 40 and pfc["train"]["output_dir"] == "out/vit"
    assert pfc["train"]["log_every"] == 4                        # 50 micro batches // 12
    assert pfc["evaluation"] == {"every_steps": 166}             # 2000 // 12, no bins
    assert pfc["data"]["workers"] == 4
    unmapped = {k: why for k, _, why in conv.unmapped}
    assert "momentum" in unmapped and "adamw" in unmapped["momentum"]
    notes = " ".join(conv.notes)
    assert "removes it from the denominator" in notes and "sums the gradients" in notes
    _, parsed = _loads(tmp_path, ds)
    assert parsed.head.filter_threshold == 0.4 and parsed.backbone.options["mask_ratio"] == 0.0


def test_synthetic_wandb_unknown_key_and_world_size(configs, tmp_path):
    path = _write(configs, "3millions.py", SYNTHETIC_MBF)
    conv, ds, pfc = _convert(path, world_size=8)
    assert pfc["head"]["num_classes"] == 300000 and pfc["head"]["embedding_size"] == 128
    assert pfc["data"]["source"] == "synthetic" and "path" not in pfc["data"]
    assert pfc["backbone"] == {"name": "mbf"}
    assert pfc["train"]["schedule"]["warmup_epochs"] == 0        # -1: no warm-up
    assert pfc["train"]["output_dir"] == os.path.join("work_dirs", "3millions")
    assert pfc["checkpoint"] == {"export": True, "resume": True, "every_minutes": 30.0,
                                 "every_steps": 100000 // (512 * 8)}
    _, _, faithful = _convert(path, world_size=8, faithful=True)
    assert faithful["checkpoint"] == {"export": True, "resume": True, "every_steps": 100000 // (512 * 8)}
    assert "fp16" not in ds                                      # base: fp16 False
    assert ds["wandb"] == {"enabled": True, "project": "faces", "team": "entity"}
    unmapped = {k: why for k, _, why in conv.unmapped}
    assert "my_note" in unmapped and "not an arcface_torch setting" in unmapped["my_note"]
    _loads(tmp_path, ds)
    # without the world size, the per-epoch checkpoints cannot be turned into steps
    _, _, pfc = _convert(path)
    assert pfc["checkpoint"]["every_steps"] == 0 and pfc["checkpoint"]["every_minutes"] == 30.0


@pytest.mark.parametrize("margin_list, expected", [
    ((1.0, 0.5, 0.0), {"type": "arcface", "scale": 64.0, "margin": 0.5, "straight_through": True}),
    ((1.0, 0.3, 0.0), {"type": "arcface", "scale": 64.0, "margin": 0.3, "straight_through": True}),
    ((1.0, 0.0, 0.4), {"type": "cosface", "scale": 64.0, "margin": 0.4}),
    # CombinedMarginLoss applies only m3 when m3 > 0: m1 and m2 have no effect there
    ((1.0, 0.2, 0.3), {"type": "cosface", "scale": 64.0, "margin": 0.3}),
    ((0.9, 0.4, 0.0), {"type": "combined", "scale": 64.0, "m1": 0.9, "m2": 0.4, "m3": 0.0}),
])
def test_margin_list(configs, tmp_path, margin_list, expected):
    text = MS1MV3_R50.replace("(1.0, 0.5, 0.0)", repr(margin_list))
    conv, ds, pfc = _convert(_write(configs, "m.py", text))
    assert pfc["head"]["margin"] == expected
    _loads(tmp_path, ds)


def test_sample_rate_zero_keeps_only_positives(configs, tmp_path):
    conv, ds, pfc = _convert(_write(configs, "p.py", MS1MV3_R50.replace("sample_rate = 1.0", "sample_rate = 0")))
    r = pfc["head"]["sample_rate"]
    assert 0 < r and int(r * 93431) == 0          # no negatives on any shard: positives only, as with 0
    _loads(tmp_path, ds)


def test_base_defaults_without_base_file(tmp_path):
    parsed = parse_arcface_config(_write(tmp_path, "lone.py", MS1MV3_R50))
    assert parsed.base == "built-in"
    assert {k: parsed.values[k] for k in ("seed", "frequent", "gradient_acc", "num_workers")} == \
        {"seed": 2048, "frequent": 10, "gradient_acc": 1, "num_workers": 2}
    assert parsed.values["network"] == "r50" and "network" not in parsed.from_base
    assert parsed.from_base == {"save_all_states", "interclass_filtering_threshold", "optimizer", "frequent",
                                "dali_aug", "gradient_acc", "seed", "num_workers", "wandb_key", "suffix_run_name",
                                "using_wandb", "wandb_entity", "wandb_project", "wandb_log_all", "save_artifacts",
                                "wandb_resume"}
    assert {k: parsed.values[k] for k in parsed.from_base} == {k: ARCFACE_BASE_DEFAULTS[k] for k in parsed.from_base}


def test_image_folder_rec(configs, tmp_path):
    folder = tmp_path / "faces"
    (folder / "0").mkdir(parents=True)
    text = MS1MV3_R50.replace("/train_tmp/ms1m-retinaface-t1", str(folder))
    _, ds, pfc = _convert(_write(configs, "f.py", text))
    assert pfc["data"]["source"] == "hf" and pfc["data"]["path"] == str(folder)


def test_literal_evaluation_and_not_understood(tmp_path):
    text = textwrap.dedent("""\
        from easydict import EasyDict as edict
        config = edict()
        config.a = 2 ** 3 - 1
        config.b = (config.a, -0.5, "x" + "y")
        config["c"] = {"k": [1, 2.5]}
        config.a += 1
        config.d = config.missing
        config.e = len("abc")
        config.f = __import__("os").getcwd()
        """)
    parsed = parse_arcface_config(_write(tmp_path, "lit.py", text), base=None)
    assert parsed.values == {"a": 8, "b": (7, -0.5, "xy"), "c": {"k": [1, 2.5]}}
    assert [line for line, _ in parsed.not_understood] == [7, 8, 9]


def _cli(*args, cwd=None):
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.run([sys.executable, "-m", "ds_pfc.cli.migrate", *args], capture_output=True, text=True,
                          env=env, cwd=cwd or ROOT, timeout=120)


def test_code_is_refused_and_never_executed(configs, tmp_path):
    marker = tmp_path / "side_effect"
    text = MS1MV3_R50 + textwrap.dedent(f"""\
        import os
        os.makedirs({str(marker)!r})
        open({str(marker) + '.txt'!r}, "w").write("ran")
        config.lr = float(os.environ.get("LR", 0.2))
        """)
    path = _write(configs, "code.py", text)
    r = _cli("config", path, "-o", str(tmp_path / "out.json"))
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "nothing in the file was executed" in lines[0]
    assert "import os" in lines[0] and "os.makedirs" in lines[0]
    assert not marker.exists() and not os.path.exists(str(marker) + ".txt")
    assert not (tmp_path / "out.json").exists()
    # --skip-unknown converts the rest; still nothing runs, and the lr is the file's literal one
    r = _cli("config", path, "-o", str(tmp_path / "out.json"), "--skip-unknown")
    assert r.returncode == 0, r.stderr
    assert not marker.exists() and not os.path.exists(str(marker) + ".txt")
    assert "not understood" in r.stdout and "nothing in the file was executed" in r.stdout
    ds, pfc = split_config(load_config(str(tmp_path / "out.json")))
    assert ds["optimizer"]["params"]["lr"] == 0.1 and pfc.head.num_classes == 93431


@pytest.mark.parametrize("case", ["missing", "not_py", "syntax", "no_rec"])
def test_bad_input_one_error_line(configs, tmp_path, case):
    if case == "missing":
        path, expect = str(tmp_path / "nope.py"), "not found"
    elif case == "not_py":
        path, expect = _write(tmp_path, "job.json", "{}"), "not a .py file"
    elif case == "syntax":
        path, expect = _write(configs, "bad.py", "config = edict(\nconfig.lr = 0.1\n"), "not valid Python"
    else:
        path, expect = _write(configs, "norec.py", MS1MV3_R50.replace("config.rec =", "# config.rec =")), \
            "missing config.rec"
    r = _cli("config", path)
    assert r.returncode != 0 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expect in lines[0], r.stderr


def test_stdout_json_and_existing_output(configs, tmp_path, capsys):
    path = _write(configs, "ms1mv3_r50.py", MS1MV3_R50)
    assert main(["config", path]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["ds_pfc"]["head"]["num_classes"] == 93431      # stdout is the JSON alone
    assert "nothing in the file was executed" in captured.err and "not mapped:" in captured.err
    out = tmp_path / "o.json"
    out.write_text("keep")
    assert main(["config", path, "-o", str(out)]) == 1 and out.read_text() == "keep"
    assert main(["config", path, "-o", str(out), "--force"]) == 0
    assert json.loads(out.read_text())["ds_pfc"]["head"]["num_classes"] == 93431


def test_wrong_types_are_named(configs):
    with pytest.raises(MigrateError, match="config.batch_size"):
        _convert(_write(configs, "t.py", MS1MV3_R50.replace("batch_size = 128", "batch_size = '128'")))
    with pytest.raises(MigrateError, match="config.optimizer"):
        _convert(_write(configs, "t.py", MS1MV3_R50 + "config.optimizer = 'lamb'\n"))
    with pytest.raises(MigrateError, match="config.network"):
        _convert(_write(configs, "t.py", MS1MV3_R50.replace('"r50"', '"r1000"')))


def test_load_config_points_python_configs_to_the_converter(configs):
    path = _write(configs, "ms1mv3_r50.py", MS1MV3_R50)
    with pytest.raises(ConfigError, match=r"arcface_torch configs are Python; convert with "
                                          r"ds-pfc-migrate config .*ms1mv3_r50\.py"):
        load_config(path)


def test_train_app_points_python_configs_to_the_converter(configs):
    path = _write(configs, "ms1mv3_r50.py", MS1MV3_R50)
    r = subprocess.run([sys.executable, os.path.join(ROOT, "launch", "train.py"), "--deepspeed_config", path],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert lines == [f"error: {path}: arcface_torch configs are Python; convert with ds-pfc-migrate "
                     f"config {path}"], r.stderr


TINY = """\
from easydict import EasyDict as edict
config = edict()
config.margin_list = (1.0, 0.5, 0.0)
config.network = "mbf"
config.embedding_size = 64
config.sample_rate = 0.5
config.batch_size = 8
config.lr = 0.1
config.rec = "synthetic"
config.num_classes = 20
config.num_image = 320
config.num_epoch = 1
config.warmup_epoch = 0
config.val_targets = []
config.num_workers = 0
"""


@pytest.mark.slow
def test_converted_config_trains(configs, tmp_path):
    """The converted job runs in the training app (2 steps of a full-width MobileFaceNet on CPU)."""
    path = _write(configs, "tiny.py", TINY.replace("config.embedding_size",
                                                   f"config.output = {str(tmp_path / 'run')!r}\nconfig.embedding_size"))
    job = convert_arcface_config(parse_arcface_config(path)).config
    job["ds_pfc"]["evaluation"]["synthetic_pairs"] = 16          # keep the evaluation short
    job["ds_pfc"]["data"]["synthetic"] = {"held_out_identities": 8}
    job_path = tmp_path / "tiny.json"
    job_path.write_text(json.dumps(job))
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, os.path.join(ROOT, "launch", "train.py"), "--deepspeed_config",
                        str(job_path), "--max_steps", "2"], capture_output=True, text=True, cwd=ROOT, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "ArcFace(scale=64.0, margin=0.5, straight_through=True)" in r.stdout
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 2 and len(summary["losses"]) == 2
    assert all(0 < loss < 1e3 for loss in summary["losses"])
    assert (tmp_path / "run" / "export" / "model.safetensors").exists()
