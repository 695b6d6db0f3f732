"""Host syncs of the training app's step, counted on CPU, and what the one-step-late
reads (``ds_pfc.head.validate`` 'deferred', the default) keep exactly as before.

A step of the app reads nothing back from the device with the default settings: the
head's input checks and the step's loss and accuracy are copied to the host behind an
event and read with the next step. Counts come from
:class:`~ds_pfc.bench.counting.OpCounter` over the whole step (the data loader's worker
process excepted); the run with ``validate`` 'immediate' is the reference both for the
count it adds and for the values the late reads must reproduce bitwise.
"""
from __future__ import annotations

import copy
import csv
import glob
import json
import os

import pytest
import torch

from _dist import one_process_world
from _inprocess import one_thread

pytest.importorskip("deepspeed")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = {
    "train_micro_batch_size_per_gpu": 8,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 0.0,
    "steps_per_print": 10 ** 9,
    "optimizer": {"type": "SGD", "params": {"lr": 0.02, "momentum": 0.9, "weight_decay": 5e-4}},
    "zero_optimization": {"stage": 0},
    "csv_monitor": {"enabled": True, "job_name": "train"},
    "ds_pfc": {
        "head": {"num_classes": 24, "embedding_size": 32, "sample_rate": 0.5,
                 "margin": {"type": "cosface", "scale": 16.0, "margin": 0.2}},
        "backbone": {"name": "vit_t", "width": 0.25},
        "data": {"synthetic": {"images_per_identity": 3, "held_out_identities": 10}, "workers": 1},
        "train": {"epochs": 10, "max_steps": 6, "log_every": 2,
                  "schedule": {"type": "poly", "warmup_epochs": 0.5, "power": 2.0}},
        "evaluation": {"synthetic_pairs": 40, "batch_size": 16, "every_steps": 3},
        "checkpoint": {"every_steps": 4, "keep": 0, "export": False},
    },
}


def _quickstart(steps):
    with open(os.path.join(ROOT, "ds_pfc", "configs", "cpu_quickstart.json")) as f:
        config = json.load(f)
    config["ds_pfc"]["train"]["max_steps"] = steps
    config["ds_pfc"]["evaluation"]["synthetic_pairs"] = 40
    config["ds_pfc"]["checkpoint"]["export"] = False
    return config


def _run(config, out, counted=False):
    """``(summary, log lines, syncs of each step after the first)`` of one in-process run."""
    from ds_pfc.app.training import Trainer
    from ds_pfc.bench.counting import OpCounter
    logs = []
    with one_process_world(), one_thread():
        trainer = Trainer(config, output_dir=out, log=logs.append)
        try:
            trainer.setup()
            marks = []
            if counted:
                counter = OpCounter()
                step = trainer.engine.step

                def marked_step(*args, **kwargs):
                    result = step(*args, **kwargs)
                    marks.append((counter.syncs, list(counter.sync_ops)))
                    return result
                trainer.engine.step = marked_step
                with counter:
                    summary = trainer.run()
            else:
                summary = trainer.run()
        finally:
            trainer.close()
    per_step = [(b[0] - a[0], b[1][len(a[1]):]) for a, b in zip(marks, marks[1:])]
    return summary, logs, per_step


def _with(config, **head):
    config = copy.deepcopy(config)
    config["ds_pfc"]["head"].update(head)
    return config


@pytest.mark.slow
def test_a_quickstart_step_has_no_host_sync(tmp_path):
    """The CPU quickstart's job (MobileFaceNet, r = 0.2, gradient clipping), 4 steps: every
    step after the first reads nothing back; with validate 'immediate' each pays the head's
    check table and the loss read."""
    _, _, late = _run(_quickstart(4), str(tmp_path / "late"), counted=True)
    _, _, now = _run(_with(_quickstart(4), validate="immediate"), str(tmp_path / "now"), counted=True)
    assert len(late) == len(now) == 3
    for syncs, ops in late:
        assert syncs == 0, ops
    for syncs, ops in now:
        assert syncs == 2 and ops == ["Tensor.tolist"] * 2, ops


def _monitor_rows(out):
    rows = {}
    for path in sorted(glob.glob(os.path.join(out, "**", "*.csv"), recursive=True)):
        if "train_loss" in path or "train_accuracy" in path:
            with open(path) as f:
                rows[os.path.basename(path)] = list(csv.reader(f))
    return rows


def _loss_lines(logs):
    """The step, epoch, loss and accuracy of each progress line (the rates are timings)."""
    return [line.split(" lr ")[0] for line in logs if line.startswith("step ") and " loss " in line]


@pytest.mark.parametrize("accumulation", [1, 2])
def test_late_reads_give_every_step_its_values_in_order_bitwise(tmp_path, accumulation):
    """The same job with validate 'deferred' (values read a step late) and 'immediate':
    the summary's losses are equal bitwise, and so are the monitors' rows (value and
    sample count of every step) and the progress lines, with evaluations (step 3) and a
    checkpoint (step 4) between them."""
    config = copy.deepcopy(TINY)
    config["gradient_accumulation_steps"] = accumulation
    runs = {}
    for mode in ("deferred", "immediate"):
        out = str(tmp_path / mode)
        summary, logs, _ = _run(_with(config, validate=mode), out)
        runs[mode] = (summary, _monitor_rows(out), _loss_lines(logs))
    (late, late_rows, late_lines), (now, now_rows, now_lines) = runs["deferred"], runs["immediate"]
    assert len(now["losses"]) == 6 and all(isinstance(v, float) for v in now["losses"])
    assert late["losses"] == now["losses"]
    assert [torch.tensor(v, dtype=torch.float64) for v in late["losses"]] == \
        [torch.tensor(v, dtype=torch.float64) for v in now["losses"]]
    assert sorted(late["evaluations"]) == sorted(now["evaluations"]) == [3, 6]
    assert len(now_rows) == 2 and all(len(rows) == 1 + 6 for rows in now_rows.values()), now_rows
    assert late_rows == now_rows
    assert len(now_lines) == 3 and late_lines == now_lines, (late_lines, now_lines)


def _bad_label_run(config, out, at):
    """Run ``config`` with label 999 (outside [0, 24)) in micro batch ``at``; the error."""
    from ds_pfc.app.training import Trainer, TrainingStopped
    with one_process_world(), one_thread():
        trainer = Trainer(config, output_dir=out, log=lambda line: None)
        try:
            trainer.setup()
            batches = trainer._batches

            def corrupted():
                for i, (images, labels) in enumerate(batches()):
                    if i == at:
                        labels = labels.clone()
                        labels[1] = 999
                    yield images, labels
            trainer._batches = corrupted
            with pytest.raises(TrainingStopped) as err:
                trainer.run()
        finally:
            trainer.close()
    return str(err.value)


def test_a_bad_label_stops_the_run_a_step_late_and_before_a_checkpoint(tmp_path):
    """Label 999 in step 2's batch: 'immediate' stops at step 2, 'deferred' at step 3 with
    the same text naming the head's forward 1 (step 2), which was applied. In step 4's
    batch (checkpoints every 2 steps), 'deferred' stops before writing step 4's."""
    config = copy.deepcopy(TINY)
    config["ds_pfc"]["evaluation"]["every_steps"] = 0
    now = _bad_label_run(_with(config, validate="immediate"), str(tmp_path / "now"), at=1)
    late = _bad_label_run(config, str(tmp_path / "late"), at=1)
    text = "labels must lie in [0, 24), got values in ["
    assert now.startswith("step 2: " + text) and "999]" in now, now
    assert late.startswith("step 3: " + text) and "999] (checked one step late" in late, late
    assert "the batch of training forward 1 (sample_step 1), whose update may already have been applied" in late
    out = str(tmp_path / "ckpt")
    config["ds_pfc"]["checkpoint"]["every_steps"] = 2
    late = _bad_label_run(config, out, at=3)
    assert late.startswith("step 4: " + text) and "training forward 3 " in late, late
    assert os.path.isdir(os.path.join(out, "checkpoints", "step00000002"))
    assert not os.path.exists(os.path.join(out, "checkpoints", "step00000004"))
