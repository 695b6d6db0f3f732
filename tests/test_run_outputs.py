"""What a training run leaves in its output directory: ``training.log`` (rank 0's
console lines, appended across resumes under header lines), the fp16 loss scale in
the progress line, strict ``summary.json`` (``null`` for a TAR the pairs cannot
measure), TensorBoard event files and W&B calls under the output directory, and a
clear one-line refusal when a monitor's package is missing.

The app runs in-process (``launch/train.py``'s ``main``) on one CPU rank, under
fp16: DeepSpeed's CPU accelerator declares fp16 unsupported where oneDNN lacks it,
so the test declares it supported, as tests/test_loss_scaling.py does; the engine
and its fp16 optimizer then run their ordinary Python code. W&B is not installed
here: a stand-in ``wandb`` module records the calls DeepSpeed's W&B monitor makes.
"""
from __future__ import annotations

import copy
import json
import math
import os
import re
import sys
import types

import pytest

from _dist import one_process_world

pytest.importorskip("deepspeed")

STEPS, MORE = 3, 5
SCALE_POWER = 8

CONFIG = {
    "train_micro_batch_size_per_gpu": 8,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 0.0,
    "steps_per_print": 10 ** 9,
    "optimizer": {"type": "SGD", "params": {"lr": 0.02, "momentum": 0.9}},
    "fp16": {"enabled": True, "initial_scale_power": SCALE_POWER, "hysteresis": 2},
    "zero_optimization": {"stage": 0},
    "csv_monitor": {"enabled": True, "job_name": "train"},
    "tensorboard": {"enabled": True},
    "wandb": {"enabled": True, "project": "ds-pfc-test"},
    "ds_pfc": {
        "head": {"num_classes": 24, "embedding_size": 32, "sample_rate": 1.0,
                 "margin": {"type": "cosface", "scale": 16.0, "margin": 0.2}},
        "backbone": {"name": "vit_t", "width": 0.25},
        "data": {"synthetic": {"images_per_identity": 3, "held_out_identities": 10}, "workers": 0,
                 "prefetch_batches": 1},
        # 40 pairs, 20 of them impostors: FAR 0.1 is measurable (2 false accepts
        # allowed), FAR 1e-4 is not (it needs 10,000 impostor pairs).
        "evaluation": {"synthetic_pairs": 40, "batch_size": 16, "far": [0.1, 1e-4]},
        "train": {"epochs": 10, "max_steps": STEPS, "log_every": 1},
        "checkpoint": {"every_steps": 0, "keep": 0, "export": False},
    },
}


def _strict_loads(text: str):
    """json.loads that refuses NaN / Infinity (what a strict JSON parser does)."""
    def refuse(name):
        raise ValueError(f"non-standard JSON constant {name}")
    return json.loads(text, parse_constant=refuse)


def _train_main():
    """The train command's in-process entry: ``run`` trains and returns, leaving the
    process group to the caller (``main`` also leaves it, as a launched process does)."""
    from ds_pfc.cli.train import run
    return run


class _FakeWandb(types.ModuleType):
    """The part of ``wandb`` DeepSpeed's monitor calls, recording each call with the
    directory and mode W&B would use (``WANDB_DIR`` / ``WANDB_MODE`` at ``init``)."""

    def __init__(self):
        super().__init__("wandb")
        self.inits, self.logged = [], []

    def init(self, **kwargs):
        self.inits.append(dict(kwargs, dir=os.environ.get("WANDB_DIR"), mode=os.environ.get("WANDB_MODE")))

    def log(self, data, step=None, commit=None):
        self.logged.append((dict(data), step))


@pytest.fixture(scope="module")
def fp16_run(tmp_path_factory):
    """STEPS steps, then a resume to MORE steps, in the same output directory."""
    from deepspeed.accelerator import get_accelerator
    tmp = tmp_path_factory.mktemp("outputs")
    out = str(tmp / "run")
    config_path = str(tmp / "job.json")
    with open(config_path, "w") as f:
        json.dump(CONFIG, f)
    fake = _FakeWandb()
    mp = pytest.MonkeyPatch()
    mp.setattr(type(get_accelerator()), "is_fp16_supported", lambda self: True)
    mp.setitem(sys.modules, "wandb", fake)
    mp.setenv("WANDB_DIR", "")        # unset for the app; restored afterwards
    mp.setenv("WANDB_MODE", "offline")
    main = _train_main()
    lines = []
    try:
        # one process group for both runs (DeepSpeed keeps its groups for the process)
        with one_process_world():
            for steps in (STEPS, MORE):
                with _Capture() as captured:
                    main(["--deepspeed_config", config_path, "--output_dir", out, "--max_steps", str(steps)])
                lines.append(captured.lines())
    finally:
        mp.undo()
    return out, config_path, lines, fake


class _Capture:
    """stdout of the block (the app prints with flush=True to sys.stdout)."""

    def __enter__(self):
        import io
        self._saved, self._buf = sys.stdout, io.StringIO()
        sys.stdout = self._buf
        return self

    def __exit__(self, *exc):
        sys.stdout = self._saved
        return False

    def lines(self) -> list[str]:
        return self._buf.getvalue().splitlines()


# DeepSpeed's own lines (its logger: "[2026-01-01 00:00:00,000] [INFO] ...", its op
# builder: "DeepSpeed deepspeed.ops... built successfully") are not the app's.
DEEPSPEED_LINE = re.compile(r"^(\[\d{4}-\d\d-\d\d [\d:,]+\] \[[A-Z]+\]|DeepSpeed )")


def test_training_log_holds_the_console_lines_of_every_run(fp16_run):
    out, config_path, lines, _ = fp16_run
    import deepspeed
    import torch

    import ds_pfc
    with open(os.path.join(out, "training.log")) as f:
        log = f.read().splitlines()
    headers = [i for i, line in enumerate(log) if line.startswith("=== ")]
    assert len(headers) == 2 and headers[0] == 0, log[:5]
    for i in headers:
        assert (f"ds_pfc {ds_pfc.__version__}, torch {torch.__version__}, deepspeed {deepspeed.__version__}"
                in log[i]), log[i]
        assert f"config {config_path}, world size 1" in log[i], log[i]
    runs = [log[headers[0] + 1:headers[1]], log[headers[1] + 1:]]
    for run, console in zip(runs, lines):
        app = [line for line in console if not DEEPSPEED_LINE.match(line)]
        assert app, console
        # every app line on the console is in the log, in the same order, and the log
        # holds nothing else
        assert run == app, (run, console)
    assert runs[0][0] == f"ds_pfc {ds_pfc.__version__}, torch {torch.__version__}, deepspeed {deepspeed.__version__}"
    assert any(line.startswith("resumed from ") for line in runs[1])
    assert sum(line.startswith("step ") for line in runs[0]) == STEPS
    assert sum(line.startswith("step ") for line in runs[1]) == MORE - STEPS
    assert runs[1][-1] == f"summary {os.path.join(out, 'summary.json')}"


def _scalars(out):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    logdir = os.path.join(out, "tensorboard", "train")
    assert os.path.isdir(logdir) and any(n.startswith("events.out.tfevents") for n in os.listdir(logdir))
    acc = EventAccumulator(logdir, size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_fp16_progress_line_shows_the_loss_scale_deepspeed_reports(fp16_run):
    pytest.importorskip("tensorboard")
    out, _, lines, _ = fp16_run
    step_lines = [line for run in lines for line in run if line.startswith("step ")]
    scales = [float(re.search(r" loss_scale ([0-9.e+]+)", line).group(1)) for line in step_lines]
    # DeepSpeed's own monitor event (the engine's fp16 optimizer, read by DeepSpeed)
    by_samples = dict(_scalars(out)["Train/Samples/loss_scale"])
    assert scales == [by_samples[8 * step] for step in range(1, MORE + 1)]
    assert 1 <= min(scales) and max(scales) <= 2.0 ** SCALE_POWER


def test_no_loss_scale_in_the_line_without_fp16():
    from ds_pfc.app.run_outputs import loss_scale_text

    class Engine:
        def fp16_enabled(self):
            return False
    assert loss_scale_text(Engine()) == ""


def test_summary_is_strict_json_with_null_for_an_unmeasurable_tar(fp16_run):
    out, _, _, _ = fp16_run
    with open(os.path.join(out, "summary.json")) as f:
        summary = _strict_loads(f.read())
    assert summary["steps"] == MORE and len(summary["losses"]) == MORE and summary["resumed"]
    for step in (str(STEPS), str(MORE)):
        tars = summary["evaluations"][step]["synthetic_held_out"]["tar_at_far"]
        assert tars["0.0001"] is None               # 20 impostor pairs cannot measure FAR 1e-4
        assert 0.0 <= tars["0.1"] <= 1.0


def test_tensorboard_scalars_under_the_output_directory(fp16_run):
    pytest.importorskip("tensorboard")
    out, _, lines, _ = fp16_run
    scalars = _scalars(out)
    with open(os.path.join(out, "summary.json")) as f:
        summary = _strict_loads(f.read())
    for tag in ("Train/Samples/train_loss", "Train/Samples/train_accuracy", "Train/Samples/lr",
                "Train/Samples/loss_scale", "Train/Samples/samples_per_second",
                "Eval/Samples/synthetic_held_out_accuracy", "Eval/Samples/synthetic_held_out_tar_at_far_0.1"):
        assert tag in scalars, sorted(scalars)
    assert "Eval/Samples/synthetic_held_out_tar_at_far_0.0001" not in scalars     # not measurable: left out
    loss = scalars["Train/Samples/train_loss"]
    assert [s for s, _ in loss] == [8 * step for step in range(1, MORE + 1)]
    assert [v for _, v in loss] == pytest.approx(summary["losses"], rel=1e-6)
    lrs = [float(re.search(r" lr ([0-9.e+-]+) ", line).group(1)) for run in lines for line in run
           if line.startswith("step ")]
    assert [v for _, v in scalars["Train/Samples/lr"]] == pytest.approx(lrs, rel=1e-3)
    tar = dict(scalars["Eval/Samples/synthetic_held_out_tar_at_far_0.1"])
    assert tar[8 * MORE] == pytest.approx(summary["evaluations"][str(MORE)]["synthetic_held_out"]["tar_at_far"]["0.1"],
                                          abs=1e-6)


def test_wandb_runs_under_the_output_directory(fp16_run):
    out, _, _, fake = fp16_run
    assert len(fake.inits) == 2                       # one W&B run per launch
    for init in fake.inits:
        assert init["project"] == "ds-pfc-test" and init["mode"] == "offline"
        assert init["dir"] == os.path.abspath(out)    # W&B keeps its files in <dir>/wandb
    keys = {k for data, _ in fake.logged for k in data}
    assert {"Train/Samples/train_loss", "Train/Samples/lr", "Train/Samples/loss_scale",
            "Train/Samples/samples_per_second", "Eval/Samples/synthetic_held_out_tar_at_far_0.1"} <= keys
    steps = [step for data, step in fake.logged if "Train/Samples/train_loss" in data]
    assert steps == [8 * step for step in range(1, MORE + 1)]


@pytest.mark.parametrize("block, module, pip", [("tensorboard", "tensorboard", "pip install tensorboard"),
                                                ("wandb", "wandb", "pip install wandb")])
def test_missing_monitor_package_is_a_one_line_error(tmp_path, monkeypatch, capsys, block, module, pip):
    monkeypatch.setitem(sys.modules, module, None)      # import fails as if not installed
    config = copy.deepcopy(CONFIG)
    del config["fp16"]
    config["tensorboard" if block == "wandb" else "wandb"] = {"enabled": False}
    path = str(tmp_path / "job.json")
    with open(path, "w") as f:
        json.dump(config, f)
    with one_process_world(), pytest.raises(SystemExit) as err:
        _train_main()(["--deepspeed_config", path, "--output_dir", str(tmp_path / "run")])
    assert err.value.code == 1
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1
    assert lines[0].startswith(f"error: {block}.enabled is true but the {module} package is not installed: {pip}")
    assert not os.path.exists(tmp_path / "run" / "checkpoints")      # refused before anything is built


def test_strict_json_turns_non_finite_numbers_into_null():
    from ds_pfc.app.run_outputs import strict_json
    value = {"a": math.nan, "b": [1.5, math.inf, {"c": -math.inf}], "d": (2.0, math.nan), "e": None, "f": "NaN"}
    assert _strict_loads(strict_json(value)) == {"a": None, "b": [1.5, None, {"c": None}], "d": [2.0, None],
                                                 "e": None, "f": "NaN"}
    with pytest.raises(ValueError):
        _strict_loads(json.dumps({"a": math.nan}))      # what the summary held before: the parser refuses it


def test_study_results_are_strict_json(tmp_path):
    from ds_pfc.app.experiments import _save_results, load_results
    path = str(tmp_path / "sample_rate.json")
    data = {"experiment": "sample_rate",
            "cells": [{"cell": "PFC-0.1", "seeds": [{"seed": 0, "tar_at_far": {"0.0001": math.nan, "0.1": 0.5}}]}]}
    _save_results(path, data)
    with open(path) as f:
        saved = _strict_loads(f.read())
    assert saved["cells"][0]["seeds"][0]["tar_at_far"] == {"0.0001": None, "0.1": 0.5}
    assert load_results(path, "sample_rate") == saved


def test_a_long_phase_is_never_silent_and_a_short_one_says_nothing():
    """Heartbeat: nothing within ``first`` seconds; after it a "still running" line with the
    progress text, then one every ``every`` seconds, and none once the block has ended."""
    import time
    from ds_pfc.app.run_outputs import Heartbeat
    lines = []
    with Heartbeat(lines.append, "quick", first=5.0):
        time.sleep(0.05)
    assert lines == []
    state = ["1 of 3 done"]
    with Heartbeat(lines.append, "slow phase", progress=lambda: state[0], first=0.05, every=0.05):
        time.sleep(0.4)
    count = len(lines)
    assert count >= 2 and all(line.startswith("slow phase: still running after ") for line in lines), lines
    assert lines[0].endswith("(1 of 3 done)")
    time.sleep(0.15)
    assert len(lines) == count                       # stopped with the block
    with Heartbeat(None, "other ranks", first=0.0):   # no log: no thread
        time.sleep(0.05)


def test_the_data_index_build_is_announced_while_it_runs(tmp_path, monkeypatch):
    """build_train_set wraps a RecordIO set's indexing in a heartbeat that shows its progress."""
    import time
    from _recordio_writers import fake_image, ir_pack, write_rec
    from ds_pfc.app import datasets
    from ds_pfc.app.config import split_config
    from ds_pfc.app.run_outputs import Heartbeat
    from ds_pfc.data import recordio
    rec, _, _ = write_rec(tmp_path, [(k, ir_pack(float(k % 2), fake_image(k))) for k in range(4)])
    scan = recordio.InsightFaceRecord._scan_labels

    def slow_scan(self):
        out = scan(self)
        time.sleep(0.4)                               # a large set's header reads
        return out
    monkeypatch.setattr(recordio.InsightFaceRecord, "_scan_labels", slow_scan)
    monkeypatch.setattr(Heartbeat, "first_s", 0.05)
    monkeypatch.setenv("DS_PFC_CACHE_DIR", str(tmp_path / "cache"))
    _, cfg = split_config({"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0, "ds_pfc": {
        "head": {"num_classes": 2, "embedding_size": 8}, "data": {"source": "recordio", "path": rec}}})
    lines = []
    datasets.build_train_set(cfg, log=lines.append)
    beats = [line for line in lines if "still running after" in line]
    assert beats and beats[0].startswith(f"data: indexing {rec}: still running after"), lines
    assert "record headers read" in beats[0], lines
