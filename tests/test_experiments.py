"""``launch/experiments.py`` in its quick mode: the runner records each (cell, seed)
in the documented JSON, skips recorded runs, re-runs them with ``--force`` to the
same accuracy, and renders the table and the plot.

The command's ``main`` (what ``launch/experiments.py`` runs) is called in this process,
as tests/test_features_setting.py calls it: each training run is still its own process
(the runner starts one per (cell, seed)), and a fresh interpreter for the runner itself
would only import torch and ds_pfc again. ``test_unknown_cell_is_refused`` runs the
script itself."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from _inprocess import call_main

pytest.importorskip("deepspeed")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _main(*args):
    """``launch/experiments.py *args`` in this process: (exit status, stdout, stderr)."""
    from ds_pfc.cli.experiments import main
    return call_main(main, args)


def _run(*args):
    status, stdout, stderr = _main(*args)
    assert status == 0, stdout[-3000:] + stderr[-3000:]
    return stdout


def test_runner_records_skips_and_reproduces(tmp_path):
    out = str(tmp_path)
    _run("conflict", "--quick", "--seeds", "1", "--cell", "FC-1", "--cell", "PFC*-0.1", "--out", out)
    path = os.path.join(out, "conflict.json")
    with open(path) as f:
        data = json.load(f)
    assert data["experiment"] == "conflict"
    assert [c["cell"] for c in data["cells"]] == ["FC-1", "PFC*-0.1"]        # the study's order
    fc, pfc = data["cells"]
    assert fc["sample_rate"] == 1.0 and pfc["sample_rate"] == 0.1
    assert fc["setting"]["filter_threshold"] is None and pfc["setting"]["filter_threshold"] == 0.4
    assert pfc["setting"]["stress"]["conflict"] == {"fraction": 1 / 3, "splits": 3}
    for cell in data["cells"]:
        (seed,) = cell["seeds"]
        assert seed["seed"] == 0 and seed["steps"] > 0 and seed["images_per_second"] > 0
        assert 0.0 <= seed["verification_acc"] <= 1.0
        assert set(seed["tar_at_far"]) == {"0.001", "0.01"}
    assert data["machine"]["torch"] and data["base_config"]["ds_pfc"]["head"]["num_classes"] == 40

    # recorded runs are skipped, the file left as it was
    stdout = _run("conflict", "--quick", "--seeds", "1", "--cell", "FC-1", "--out", out)
    assert "recorded already" in stdout
    with open(path) as f:
        assert json.load(f) == data

    # --force re-runs one cell with one seed: the same accuracy on the same machine
    _run("conflict", "--quick", "--seeds", "1", "--cell", "FC-1", "--force", "--out", out)
    with open(path) as f:
        again = json.load(f)
    first, second = fc["seeds"][0], again["cells"][0]["seeds"][0]
    assert abs(first["verification_acc"] - second["verification_acc"]) <= 0.02
    assert first["final_loss"] == pytest.approx(second["final_loss"], rel=1e-6)
    assert again["cells"][1] == pfc                                          # the other cell untouched

    with open(os.path.join(out, "conflict.md")) as f:
        table = f.read()
    assert "| FC-1 | 1 |" in table and "| PFC*-0.1 | 1 |" in table
    assert "| 79.9 |" in table and "| 91.6 |" in table                         # the paper's numbers beside
    with open(os.path.join(out, "conflict.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_unknown_cell_is_refused(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "launch", "experiments.py"), "long_tail", "--cell",
                           "PFC-0.7", "--out", str(tmp_path)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "has no cell(s) ['PFC-0.7']" in proc.stderr
    assert not os.listdir(tmp_path)


def _own_job(identities=24):
    """A job of one's own: the quick setup with other identities, data seed and lr."""
    from ds_pfc.app.experiments import base_config
    job = base_config(quick=True)
    job["optimizer"]["params"]["lr"] = 0.05
    job["ds_pfc"]["head"]["num_classes"] = identities
    job["ds_pfc"]["data"]["synthetic"].update(identities=identities, seed=5)
    return job


def test_cells_run_on_a_job_of_ones_own(tmp_path):
    """--config: the cell's setting on the user's job, through a launcher; the head is
    sized for the conflict's pseudo-classes; the job is recorded as the base setup and
    another base setup is refused in the same directory."""
    import shutil
    if shutil.which("deepspeed") is None:
        pytest.skip("the deepspeed launcher is not on PATH")
    job = _own_job()
    config = tmp_path / "job.json"
    config.write_text(json.dumps(job))
    out = str(tmp_path / "out")
    stdout = _run("conflict", "--config", str(config), "--launcher", "deepspeed --num_gpus 1", "--seeds", "1",
                  "--cell", "PFC-0.1", "--out", out)
    assert "conflict/PFC-0.1 seed 0: verification" in stdout
    with open(os.path.join(out, "conflict.json")) as f:
        data = json.load(f)
    assert data["base_config"] == job and data["scored_on"] == "synthetic_held_out"
    assert data["launcher"] == "deepspeed --num_gpus 1"
    (seed,) = data["cells"][0]["seeds"]
    assert seed["steps"] > 0 and 0.0 <= seed["verification_acc"] <= 1.0
    with open(os.path.join(out, "conflict.md")) as f:
        assert "runs under `deepspeed --num_gpus 1`" in f.read()

    # 8 of the 24 identities (4 images each) split into 3 pseudo-classes: 16 + 8 x 3
    from ds_pfc.app.experiments import STUDIES, cell_config
    cell = next(c for c in STUDIES["conflict"] if c.name == "PFC-0.1")
    run = cell_config(cell, 0, base=job)
    assert run["ds_pfc"]["head"]["num_classes"] == 16 + 8 * 3 and job["ds_pfc"]["head"]["num_classes"] == 24
    assert run["ds_pfc"]["head"]["sample_rate"] == 0.1 and run["ds_pfc"]["data"]["stress"]["seed"] == 0

    status, _, stderr = _main("conflict", "--quick", "--seeds", "1", "--cell", "FC-1", "--out", out)
    assert status != 0 and "another base setup" in stderr


def test_the_scoring_set_is_the_jobs_own_and_must_be_named_when_ambiguous():
    from ds_pfc.app.experiments import scoring_set
    job = _own_job()
    assert scoring_set(job) == "synthetic_held_out"
    job["ds_pfc"]["evaluation"]["bins"] = ["/data/lfw.bin", "/data/cfp_fp.bin"]
    assert scoring_set(job) == "synthetic_held_out"
    assert scoring_set(job, "cfp_fp") == "cfp_fp"
    with pytest.raises(ValueError, match=r"'agedb_30' is not among the job's evaluation sets"):
        scoring_set(job, "agedb_30")
    job["ds_pfc"]["evaluation"]["synthetic_pairs"] = 0
    with pytest.raises(ValueError, match=r"name the one that scores a run \(--target\)"):
        scoring_set(job)
    job["ds_pfc"]["evaluation"]["bins"] = ["/data/lfw.bin"]
    assert scoring_set(job) == "lfw"
    job["ds_pfc"]["evaluation"]["bins"] = []
    with pytest.raises(ValueError, match="evaluates on nothing"):
        scoring_set(job)


def test_own_job_options_are_checked_before_any_run(tmp_path):
    config = tmp_path / "job.json"
    config.write_text(json.dumps(_own_job()))
    for args, message in [(["--config", str(config)], "need their own --out directory"),
                          (["--config", str(config), "--out", str(tmp_path / "o"), "--target", "lfw"],
                           "'lfw' is not among the job's evaluation sets"),
                          (["--target", "lfw", "--out", str(tmp_path / "o")], "apply to --config runs"),
                          (["--config", str(tmp_path / "missing.json"), "--out", str(tmp_path / "o")],
                           "config file not found")]:
        status, _, stderr = _main("label_flip", *args)
        assert status == 2 and message in stderr, (args, stderr[-500:])
    assert sorted(os.listdir(tmp_path)) == ["job.json"]
