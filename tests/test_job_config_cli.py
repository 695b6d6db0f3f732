"""Job configs from the command line: ``--set KEY=VALUE`` overrides (checked by the config
parser, kept in the run's config copy and its checkpoints, so that a resume without them is
refused), the JSON Schema of the job config (``--schema``), and "did you mean" for typos."""
from __future__ import annotations

import copy
import glob
import json
import os
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
    with pytest.warns(UserWarning, match="did you mean 'gradient_accumulation_steps'"):
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
    first = _train("--deepspeed_config", str(path), "--output-dir", str(out), "--max-steps", "2",
                   "--set", "ds_pfc.head.margin.margin=0.3", "--set", "ds_pfc.evaluation.synthetic_pairs=0")
    assert first.returncode == 0, first.stderr[-3000:]
    used = json.load(open(out / "config.json"))
    assert used["ds_pfc"]["head"]["margin"]["margin"] == 0.3 and TINY["ds_pfc"]["head"]["margin"]["margin"] == 0.2
    log = open(out / "training.log").read()
    assert "with --set ds_pfc.head.margin.margin=0.3 ds_pfc.evaluation.synthetic_pairs=0" in log
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
