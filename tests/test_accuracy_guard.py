"""Regression guard on training quality: several seeds of a small training run must
reach the held-out accuracy and the final loss recorded in
benchmarks/results/accuracy_guard.json.

A change of training semantics (a margin on the wrong logit, momentum or weight
decay on the wrong rows, a lost gradient term, a wrong loss scale) can pass every
exactness test that does not cover it and only shows in training. Single runs
cannot show it: the accuracy of one seed moves by several points with float32
rounding alone (see ds_pfc.bench.accuracy). This test trains the ``guard`` config
(200 identities x 10 images at 32 x 32, 148 steps) for seeds 0-5, two processes at
a time, and fails when their mean accuracy falls, or their mean final loss moves,
by more than ``3 sigma sqrt(1/6 + 1/n)`` from the record of ``n`` seeds with
spread ``sigma`` (ds_pfc.bench.accuracy.guard_verdict). A run takes about 13 s on an
idle core (each forked from the tests' fork server, which did the imports once), so the test
about 45 s on 2 idle cores.

Re-record after an intended change of training behaviour:
``python launch/bench.py accuracy --config guard --seeds 0-9 --label main --out
benchmarks/results/accuracy_guard.json`` (the file keeps one entry per label).
"""
from __future__ import annotations

import pytest

# Each run is a process of its own forked from the tests' fork server (one thread, as the
# guard's runs have): the imports a fresh interpreter would repeat for each run are done once.
from _dist import run_train_forked
from ds_pfc.bench import accuracy


@pytest.mark.slow
def test_guard_config_reaches_recorded_accuracy_and_loss():
    res = accuracy.guard_check(jobs=2, launch=run_train_forked)
    for key, check in res["checks"].items():
        assert check["recorded_std"] > 0, f"the record's {key} has no spread"
    assert res["checks"]["accuracy"]["tolerance"] < 0.1, "the record's accuracy spread is too wide to guard"
    per_seed = ", ".join(f"{r['seed']}: acc {r['accuracy']:.3f} loss {r['final_loss']:.2f}" for r in res["runs"])
    assert res["passed"], f"{accuracy.format_verdict(res)}\nper seed: {per_seed}"


@pytest.mark.slow
def test_compact_bank_storage_costs_no_accuracy():
    """bf16 centers with an 8-bit momentum (a float32 scale per row) on the device bank,
    1,540 bytes per class at d = 512 instead of 4,096: four seeds of the guard config,
    judged against the float32 record by the same rule (their rounding must not move the
    final loss or lower the accuracy beyond the seed-to-seed spread)."""
    res = accuracy.guard_check(jobs=2, seeds=range(4), storage="bf16-int8m", launch=run_train_forked)
    per_seed = ", ".join(f"{r['seed']}: acc {r['accuracy']:.3f} loss {r['final_loss']:.2f}" for r in res["runs"])
    assert res["passed"], f"{accuracy.format_verdict(res)}\nper seed: {per_seed}"


@pytest.mark.parametrize("storage", accuracy.STORAGES)
def test_storage_variants_build_the_bank_they_name(storage):
    import torch
    from ds_pfc.app.config import split_config
    job = accuracy.with_storage(accuracy.job_config("guard"), storage)
    _, pfc = split_config(job)
    head = pfc.head.build()
    try:
        if storage == "fp32":
            assert pfc.head.bank.is_default()
            return
        assert head.bank.store("weight").dtype == torch.bfloat16
        momentum = head.bank.store("momentum_buffer")
        assert (type(momentum).__name__, getattr(momentum, "dtype", None)) == (
            ("RowwiseInt8Store", momentum.dtype) if storage == "bf16-int8m" else ("DeviceStore", torch.bfloat16))
    finally:
        head.close()
    with pytest.raises(ValueError, match="storage must be one of"):
        accuracy.with_storage(job, "int4")


def test_head_path_variant_runs_the_triton_kernels_with_kept_cosines():
    """``--head-path triton-kept``: the guard job's head on the triton backend with bf16
    products and the default keep budget (which keeps the guard's cosines), run by Triton's
    interpreter; ``default`` leaves the config alone."""
    from ds_pfc.app.config import split_config
    from ds_pfc.core.softmax import COSINE_KEEP_BYTES, keeps_cosines
    import torch
    job = accuracy.job_config("guard")
    same, env = accuracy.with_head_path(job, "default")
    assert same == job and env == {}
    kept, env = accuracy.with_head_path(job, "triton-kept")
    assert env == {"TRITON_INTERPRET": "1"}
    _, pfc = split_config(kept)
    assert (pfc.head.backend, pfc.head.compute_dtype, pfc.head.keep_bytes) == ("triton", "bf16", None)
    batch = kept["train_micro_batch_size_per_gpu"]
    active = int(pfc.head.sample_rate * pfc.head.num_classes)
    assert keeps_cosines(batch, active, torch.bfloat16, COSINE_KEEP_BYTES)
    assert job["ds_pfc"]["head"].get("backend", "auto") != "triton"      # the original is untouched
    with pytest.raises(ValueError, match="head_path must be one of"):
        accuracy.with_head_path(job, "cuda")


def test_a_run_is_the_roots_train_script_in_a_fresh_interpreter_by_default(monkeypatch, tmp_path):
    """Without a ``launch`` of one's own, a run is ``python <root>/launch/train.py argv``
    with the run's environment and directory (what ``--root`` relies on)."""
    import subprocess
    import sys
    calls = []

    def run(cmd, **kwargs):
        calls.append((cmd, kwargs["env"], kwargs["cwd"]))
        return subprocess.CompletedProcess(cmd, 3, "out", "err")
    monkeypatch.setattr(accuracy.subprocess, "run", run)
    assert accuracy._subprocess(["--deepspeed_config", "j.json"], {"A": "1"}, str(tmp_path), "/other/checkout") == (
        3, "out", "err")
    assert calls == [([sys.executable, "/other/checkout/launch/train.py", "--deepspeed_config", "j.json"],
                      {"A": "1"}, str(tmp_path))]
