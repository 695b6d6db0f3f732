"""Job configs from the command line: ``--set KEY=VALUE`` overrides (checked by the config
parser, kept in the run's config copy and its checkpoints, so that a resume without them is
refused), the JSON Schema of the job config (``--schema``), and "did you mean" for typos."""
from __future__ import annotations

import copy
import glob
import json
import os
import re
import subprocess
import sys
import warnings

import pytest

from ds_pfc.app.config import ConfigError, set_values, split_config
from ds_pfc.app.schema import job_schema

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_set_values_reads_json_creates_objects_and_leaves_the_input_alone():
    config = {"optimizer": {"params": {"lr": 0.1}}, "ds_pfc": {"head": {"num_classes": 10}}}
    before = copy.deepcopy(config)
    out = set_values(config, ["optimizer.params.lr=0.05", "ds_pfc.train.max_steps=7", "ds_pfc.description=a b",
                              'ds_pfc.evaluation.far=[1e-3, 1e-4]', "ds_pfc.checkpoint.resume=false",
                              "ds_pfc.train.output_dir=\"123\""])
    assert config == before
    assert out["optimizer"]["params"]["lr"] == 0.05 and out["ds_pfc"]["train"]["max_steps"] == 7
    assert out["ds_pfc"]["description"] == "a b" and out["ds_pfc"]["evaluation"]["far"] == [1e-3, 1e-4]
    assert out["ds_pfc"]["checkpoint"]["resume"] is False and out["ds_pfc"]["train"]["output_dir"] == "123"
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        set_values(config, ["ds_pfc.train.max_steps"])
    with pytest.raises(ConfigError, match="ds_pfc.head.num_classes is 10, not an object"):
        set_values(config, ["ds_pfc.head.num_classes.x=1"])


def test_unknown_keys_name_the_closest_known_one():
    base = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.0}
    with pytest.raises(ConfigError, match=r"unknown key \['num_clases'\] \(did you mean 'num_classes'\?\)"):
        split_config({**base, "ds_pfc": {"head": {"num_clases": 3}}})
    with pytest.raises(ConfigError, match=r"did you mean 'on_nonfinit' -> 'on_nonfinite'\?"):
        split_config({**base, "ds_pfc": {"head": {"num_classes": 3}, "train": {"on_nonfinit": "skip", "zzz": 1}}})
    with pytest.raises(ConfigError, match="did you mean 'gradient_accumulation_steps'"):
        split_config({**base, "gradient_acumulation_steps": 2, "ds_pfc": {"head": {"num_classes": 3}}})


# -- the schema, checked by a small validator of its own (no jsonschema package needed)
def _errors(value, schema, root, where="$") -> list[str]:
    if "$ref" in schema:
        return _errors(value, root["$defs"][schema["$ref"].rsplit("/", 1)[1]], root, where)
    if "anyOf" in schema:
        options = [_errors(value, s, root, where) for s in schema["anyOf"]]
        return [] if any(not o for o in options) else [f"{where}: matches none of {len(options)} options"]
    kinds = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}
    kind = schema.get("type")
    if kind == "integer" and not (isinstance(value, int) and not isinstance(value, bool)):
        return [f"{where}: not an integer"]
    if kind == "number" and not (isinstance(value, (int, float)) and not isinstance(value, bool)):
        return [f"{where}: not a number"]
    if kind in kinds and not isinstance(value, kinds[kind]):
        return [f"{where}: not {kind}"]
    if "enum" in schema and value not in schema["enum"]:
        return [f"{where}: {value!r} not in {schema['enum']}"]
    found = []
    if kind == "object":
        props = schema.get("properties", {})
        found += [f"{where}: missing {k}" for k in schema.get("required", []) if k not in value]
        if schema.get("additionalProperties") is False:
            found += [f"{where}: unknown {k}" for k in value if k not in props]
        for k, v in value.items():
            if k in props:
                found += _errors(v, props[k], root, f"{where}.{k}")
    return found


def test_every_shipped_config_follows_the_schema_and_typos_do_not():
    schema = job_schema()
    json.dumps(schema)                        # plain JSON
    assert schema["$schema"].startswith("https://json-schema.org/")
    paths = sorted(glob.glob(os.path.join(ROOT, "configs", "*.json")))
    assert paths
    for path in paths:
        config = json.load(open(path))
        assert _errors(config, schema, schema) == [], path
    config = json.load(open(os.path.join(ROOT, "configs", "cpu_quickstart.json")))
    typo = copy.deepcopy(config)
    typo["ds_pfc"]["head"]["num_clases"] = 5
    assert _errors(typo, schema, schema) == ["$.ds_pfc.head: unknown num_clases"]
    wrong = copy.deepcopy(config)
    wrong["ds_pfc"]["head"]["margin"]["type"] = "arcfase"
    wrong["ds_pfc"]["train"]["max_steps"] = 1.5
    assert _errors(wrong, schema, schema) == ["$.ds_pfc.head.margin.type: 'arcfase' not in ['adaface', 'arcface', "
                                              "'combined', 'cosface', 'curricularface', 'elastic_arcface', "
                                              "'elastic_cosface', 'magface']",
                                              "$.ds_pfc.train.max_steps: matches none of 2 options"]
    head = schema["$defs"]["HeadConfig"]["properties"]
    assert head["num_classes"]["description"].startswith("C, the number of classes")
    assert schema["$defs"]["TrainConfig"]["properties"]["on_nonfinite"]["default"] == "stop"
    # every field of the parser is in the schema (both come from the same classes)
    from ds_pfc.app.config import DsPfcConfig
    import dataclasses
    assert set(schema["$defs"]["DsPfcConfig"]["properties"]) == {f.name for f in dataclasses.fields(DsPfcConfig)}


def _train(*args, timeout=300):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    env.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(ROOT, ".torch_extensions"))
    return subprocess.run([sys.executable, os.path.join(ROOT, "launch", "train.py"), *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def test_schema_command_and_set_overrides_through_the_train_command(tmp_path):
    shown = _train("--schema")
    assert shown.returncode == 0 and json.loads(shown.stdout) == json.loads(json.dumps(job_schema()))

    from test_train_app import TINY
    path = tmp_path / "job.json"
    path.write_text(json.dumps(TINY))
    out = tmp_path / "run"
    # a new key marked with '+', and a key the JSON lacks but torch.optim.SGD takes
    first = _train("--deepspeed_config", str(path), "--output-dir", str(out), "--max-steps", "2",
                   "--set", "ds_pfc.head.margin.margin=0.3", "--set", "ds_pfc.evaluation.synthetic_pairs=0",
                   "--set", "ds_pfc.backbone.options.checkpoint_blocks=true", "--set", "optimizer.params.nesterov=true",
                   "--set", "+aio.block_size=1048576")
    assert first.returncode == 0, first.stderr[-3000:]
    used = json.load(open(out / "config.json"))
    assert used["ds_pfc"]["head"]["margin"]["margin"] == 0.3 and TINY["ds_pfc"]["head"]["margin"]["margin"] == 0.2
    assert used["ds_pfc"]["backbone"]["options"] == {"checkpoint_blocks": True} and "options" not in TINY["ds_pfc"][
        "backbone"]
    assert used["optimizer"]["params"]["nesterov"] is True and "nesterov" not in TINY["optimizer"]["params"]
    log = open(out / "training.log").read()
    assert ("with --set ds_pfc.head.margin.margin=0.3 ds_pfc.evaluation.synthetic_pairs=0 "
            "ds_pfc.backbone.options.checkpoint_blocks=true optimizer.params.nesterov=true +aio.block_size=1048576") in log
    marker = json.load(open(glob.glob(str(out / "checkpoints" / "step*" / "ds_pfc_complete.json"))[0]))
    assert marker["metadata"]["config"]["ds_pfc"]["head"]["margin"]["margin"] == 0.3
    # a resume without the override changes training: refused, naming it
    again = _train("--deepspeed_config", str(path), "--output_dir", str(out), "--max_steps", "3",
                   "--set", "ds_pfc.evaluation.synthetic_pairs=0")
    assert again.returncode == 1
    assert "ds_pfc.head.margin.margin: 0.3 -> 0.2" in again.stderr, again.stderr[-2000:]
    # a bad override is one line that names the closest key
    bad = _train("--deepspeed_config", str(path), "--output_dir", str(tmp_path / "bad"),
                 "--set", "ds_pfc.train.max_stepz=3")
    lines = [x for x in bad.stderr.splitlines() if x.startswith("error:")]
    assert bad.returncode == 1 and len(lines) == 1 and "did you mean 'max_steps'" in lines[0], bad.stderr[-2000:]


# -- --set refuses keys that exist nowhere; +KEY marks a key new ------------------------------
def _job(tmp_path, edit=None) -> tuple[str, str]:
    """A tiny job JSON whose output directory is ``tmp_path/run``: (path, output dir)."""
    from test_train_app import TINY
    config = copy.deepcopy(TINY)
    out = str(tmp_path / "run")
    config["ds_pfc"]["train"]["output_dir"] = out
    if edit is not None:
        edit(config)
    path = tmp_path / "job.json"
    path.write_text(json.dumps(config))
    return str(path), out


class _Counted:
    """Counts the calls of ``owner.name`` (and still makes them)."""

    def __init__(self, monkeypatch, owner, name):
        self.calls = 0
        real = getattr(owner, name)

        def counted(*args, **kwargs):
            self.calls += 1
            return real(*args, **kwargs)
        monkeypatch.setattr(owner, name, counted)


def _train_inprocess(args) -> tuple[int, str, str]:
    """The train command's main in this process, in a world of one process."""
    from _dist import one_process_world
    from _inprocess import call_main
    from ds_pfc.cli.train import main
    with one_process_world():
        return call_main(main, args)


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def test_set_typos_are_refused_in_one_line_and_nothing_starts(tmp_path, monkeypatch):
    from ds_pfc.app import training
    setup = _Counted(monkeypatch, training.Trainer, "setup")
    path, out = _job(tmp_path)
    expected = {
        # a typo inside a DeepSpeed block, and in a top-level key
        "optimizer.param.lr=0.05":
            "error: --set optimizer.param.lr=0.05: no key 'param' in optimizer (looked in the job and DeepSpeed's "
            "optimizer block; did you mean 'params'?); to add a key the job does not have, mark it new: "
            "--set +optimizer.param.lr=0.05",
        "optimiser.params.lr=0.05":
            "error: --set optimiser.params.lr=0.05: no key 'optimiser' at the top level (looked in the job and "
            "DeepSpeed 0.19's top-level keys and 'ds_pfc'; did you mean 'optimizer'?); to add a key the job does not "
            "have, mark it new: --set +optimiser.params.lr=0.05",
    }
    for assignment, line in expected.items():
        status, stdout, stderr = _train_inprocess(["--deepspeed_config", path, "--set", assignment])
        assert status == 1 and _error_lines(stderr) == [line], stderr[-2000:]
        assert "Traceback" not in stderr
    assert setup.calls == 0
    # raised before the output directory was known: nothing was created for it
    assert not os.path.exists(out)
    # the line docs/training.md shows is the one the command prints
    docs = open(os.path.join(ROOT, "docs", "training.md")).read()
    assert expected["optimizer.param.lr=0.05"] in docs


def test_set_needs_a_known_key_or_a_plus():
    from test_train_app import TINY
    config = copy.deepcopy(TINY)
    del config["ds_pfc"]["train"]["max_steps"], config["zero_optimization"]
    before = copy.deepcopy(config)
    # known to the schema though absent from the JSON: set without '+'
    out = set_values(config, ["optimizer.params.nesterov=true",          # torch.optim.SGD(nesterov=...)
                              "optimizer.params.dampening=0",
                              "ds_pfc.train.max_steps=5",                # TrainConfig.max_steps
                              "zero_optimization.stage=1",               # DeepSpeedZeroConfig.stage
                              "zero_optimization.offload_optimizer.device=cpu",
                              "zero_optimization.stage3_max_live_parameters=100",   # by its alias
                              "fp16.loss_scale_window=100", "ds_pfc.train.init.freeze_backbone_steps=2"])
    assert config == before
    assert out["optimizer"]["params"] == {**TINY["optimizer"]["params"], "nesterov": True, "dampening": 0}
    assert out["ds_pfc"]["train"]["max_steps"] == 5 and out["ds_pfc"]["train"]["init"] == {"freeze_backbone_steps": 2}
    assert out["zero_optimization"] == {"stage": 1, "offload_optimizer": {"device": "cpu"},
                                        "stage3_max_live_parameters": 100}
    assert out["fp16"] == {"loss_scale_window": 100}
    # unknown: refused naming the key, the place, the closest key and the '+' syntax; nothing created
    cases = {
        "zero_optimization.stag=1": r"no key 'stag' in zero_optimization \(looked in the job and DeepSpeed's "
                                    r"DeepSpeedZeroConfig; did you mean 'stage'\?\); .* --set \+zero_optimization",
        "zero_optimization.offload_optimizer.devise=cpu": r"no key 'devise' in zero_optimization.offload_optimizer "
                                                          r".*did you mean 'device'\?",
        "optimizer.params.lrr=1": r"no key 'lrr' in optimizer.params \(looked in the job and the parameters of "
                                  r"torch.optim.SGD; did you mean 'lr'\?\)",
        "ds_pfc.train.max_stepz=3": r"no key 'max_stepz' in ds_pfc.train \(looked in the job and ds_pfc's "
                                    r"TrainConfig; did you mean 'max_steps'\?\)",
        "ds_pfc.backbone.options.image_size=112": r"no key 'image_size' in ds_pfc.backbone.options \(looked in the "
                                                  r"job and the options of backbone vit_t \(ViT\)",
        "ds_pfc.backbone.options.train_embeding_scale=false": r"did you mean 'train_embedding_scale'\?",
        "aio.block_size=1": r"no key 'block_size' in aio \(looked in the job only: ds_pfc has no list of the keys of "
                            r"DeepSpeed's 'aio' block\); to add a key the job does not have, mark it new: "
                            r"--set \+aio.block_size=1",
    }
    for assignment, needle in cases.items():
        with pytest.raises(ConfigError, match=needle):
            set_values(config, [assignment])
        assert config == before
    # +KEY adds a key the job does not have, with the objects on its way
    out = set_values(config, ["ds_pfc.backbone.options.checkpoint_blocks=true", "+aio.block_size=1048576"])
    assert out["ds_pfc"]["backbone"]["options"] == {"checkpoint_blocks": True} and out["aio"] == {"block_size": 1048576}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert split_config(out)[1].backbone.options == {"checkpoint_blocks": True}
    # ... and is refused on a key that exists, in the JSON or in the schema
    for assignment, found in (("+optimizer.params.lr=0.05", "in the job"),
                              ("+ds_pfc.train.max_steps=5", "a key of ds_pfc's TrainConfig"),
                              ("+zero_optimization.stage=1", "a key of DeepSpeed's DeepSpeedZeroConfig"),
                              ("+optimizer.params.nesterov=true", "a key of the parameters of torch.optim.SGD")):
        key, _, value = assignment[1:].partition("=")
        with pytest.raises(ConfigError, match=re.escape(f"--set {assignment}: {key} exists ({found}); drop the '+' "
                                                        f"to set it: --set {key}={value}")):
            set_values(config, [assignment])
        assert config == before
    # the optimizer's params follow the type set before them
    out = set_values(config, ["optimizer.type=AdamW", "optimizer.params.torch_adam=true", "optimizer.params.amsgrad=true"])
    assert out["optimizer"]["params"]["amsgrad"] is True
    with pytest.raises(ConfigError, match=r"no key 'nesterov' in optimizer.params \(looked in the job and the "
                                          r"parameters of torch.optim.AdamW\)"):
        set_values(config, ["optimizer.type=AdamW", "optimizer.params.torch_adam=true",
                            "optimizer.params.nesterov=true"])


def test_an_unknown_top_level_key_is_one_error_line_also_in_training_log(tmp_path, monkeypatch):
    from ds_pfc.app import training
    setup = _Counted(monkeypatch, training.Trainer, "setup")
    path, out = _job(tmp_path, lambda c: c.update(optimiser={"type": "SGD"}))
    line = ("error: top-level config key ['optimiser'] is not a DeepSpeed key (DeepSpeed would ignore it; did you "
            f"mean 'optimizer'?): fix or remove it (traceback: {os.path.join(out, 'errors', 'rank0.txt')})")
    for attempt in (1, 2):
        status, _, stderr = _train_inprocess(["--deepspeed_config", path])
        assert status == 1 and _error_lines(stderr) == [line], stderr[-2000:]
        assert "UserWarning" not in stderr and "Traceback" not in stderr
        # training.log keeps a header line per run: each attempt's header, then its error line
        log = open(os.path.join(out, "training.log")).read().splitlines()
        assert len(log) == 2 * attempt and log[-1] == line, log
        assert re.fullmatch(r"=== \d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ ds_pfc .*, torch .*, deepspeed .*, config "
                            + re.escape(path) + ", world size 1", log[-2]), log[-2]
    assert setup.calls == 0
    assert "optimiser" in open(os.path.join(out, "errors", "rank0.txt")).read()
    # docs/training.md quotes the message as the command prints it
    docs = " ".join(open(os.path.join(ROOT, "docs", "training.md")).read().split())
    assert line[len("error: "):line.index(" (traceback:")] in docs


def test_optimizer_params_are_checked_before_anything_is_built(tmp_path, monkeypatch):
    from ds_pfc.app import training
    setup = _Counted(monkeypatch, training.Trainer, "setup")
    engine = _Counted(monkeypatch, training, "initialize")
    path, out = _job(tmp_path, lambda c: c["optimizer"]["params"].update(lrr=0.1))
    status, stdout, stderr = _train_inprocess(["--deepspeed_config", path])
    [line] = _error_lines(stderr)
    assert status == 1 and line.startswith(
        "error: optimizer.params: unknown key ['lrr'] for optimizer type 'SGD' (torch.optim.SGD takes ["), stderr
    assert "did you mean 'lr'?" in line and "building the DeepSpeed engine" not in stdout
    assert setup.calls == 0 and engine.calls == 0
    assert line in open(os.path.join(out, "training.log")).read()
    # torch.optim.SGD's documented parameters are all taken
    base = {"train_micro_batch_size_per_gpu": 8, "gradient_clipping": 0.0, "ds_pfc": {"head": {"num_classes": 3}}}
    split_config({**base, "optimizer": {"type": "SGD", "params": {
        "lr": 0.1, "momentum": 0.9, "dampening": 0.0, "weight_decay": 5e-4, "nesterov": True, "maximize": False}}})


@pytest.mark.parametrize("optimizer, zero, refused", [
    # DeepSpeed's own names in any case; Adam/AdamW build FusedAdam, or torch's with torch_adam,
    # or DeepSpeedCPUAdam when ZeRO offloads the optimizer; its switches are taken too
    ({"type": "ADAM", "params": {"lr": 1e-3, "bias_correction": True, "adam_w_mode": False}}, None, "momentum"),
    ({"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True, "amsgrad": True, "foreach": False}}, None,
     "bias_correction"),
    ({"type": "adamw", "params": {"lr": 1e-3, "fp32_optimizer_states": True}},
     {"stage": 2, "offload_optimizer": {"device": "cpu"}}, "set_grad_none"),
    ({"type": "Lamb", "params": {"lr": 1e-3, "max_coeff": 10.0}}, None, "momentum"),
    ({"type": "RMSprop", "params": {"lr": 1e-3, "alpha": 0.9, "centered": True}}, None, "betas"),
])
def test_optimizer_params_follow_the_class_deepspeed_builds(optimizer, zero, refused):
    base = {"train_micro_batch_size_per_gpu": 8, "gradient_clipping": 0.0, "ds_pfc": {"head": {"num_classes": 3}}}
    if zero is not None:
        base["zero_optimization"] = zero
    split_config({**base, "optimizer": optimizer})
    bad = copy.deepcopy(optimizer)
    bad["params"][refused] = 1
    with pytest.raises(ConfigError, match=rf"optimizer.params: unknown key \['{refused}'\] for optimizer type "
                                          rf"'{optimizer['type']}'"):
        split_config({**base, "optimizer": bad})


def test_an_optimizer_type_deepspeed_cannot_build_is_refused():
    base = {"train_micro_batch_size_per_gpu": 8, "gradient_clipping": 0.0, "ds_pfc": {"head": {"num_classes": 3}}}
    with pytest.raises(ConfigError, match=r"optimizer.type 'sgd' is not an optimizer DeepSpeed builds: .*"
                                          r"did you mean 'SGD'\?"):
        split_config({**base, "optimizer": {"type": "sgd", "params": {"lr": 0.1}}})
    with pytest.raises(ConfigError, match="max_grad_norm is refused by DeepSpeed: set the top-level "
                                          "gradient_clipping"):
        split_config({**base, "optimizer": {"type": "Adam", "params": {"lr": 0.1, "max_grad_norm": 1.0}}})
