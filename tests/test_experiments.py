"""``launch/experiments.py`` in its quick mode: the runner records each (cell, seed)
in the documented JSON, skips recorded runs, re-runs them with ``--force`` to the
same accuracy, and renders the table and the plot."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("deepspeed")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "launch", "experiments.py"), *args], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


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
