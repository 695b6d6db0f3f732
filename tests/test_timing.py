"""``python -m ds_pfc.selfcheck --timing``: what it measures on a GPU (the plan, with a
mocked CUDA) and that the harness runs end to end on the CPU at toy sizes, writing one
JSON with every part."""
from __future__ import annotations

import json

import pytest
import torch

from ds_pfc.bench import timing
from ds_pfc.cli import selfcheck as cli


def test_gpu_plan_times_every_width_with_validate_off_and_as_a_graph(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (60 * 2**30, 80 * 2**30))
    what = timing.plan(torch.device("cuda", 0))
    modes = {(m["dim"], m["validate"], m["graph"], m.get("cosines")) for m in what["modes"]}
    expected = {(512, True, False, None)} | {(d, False, g, None) for d in (512, 256, 128) for g in (False, True)}
    if what["backend"] == "triton":     # and the recompute path of the validate=False eager step
        expected |= {(d, False, False, "recompute") for d in (512, 256, 128)}
    assert modes == expected
    case = what["case"]
    assert case["batch"] == 2048 and case["sample_rate"] == 0.1 and case["compute"] == "bf16"
    assert round(case["classes"] * case["sample_rate"]) == 800_000      # the standard rank fits 60 GiB free


def test_cpu_run_writes_every_part(tmp_path, capsys):
    out = tmp_path / "t.json"
    assert cli.main(["--timing", "--no-model", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert set(doc["steps"]) == {"d64_validate1_graph0", "d64_validate0_graph0"}
    for step in doc["steps"].values():
        assert step["seconds"] > 0 and step["kernels"]["torch GEMMs"] > 0
    s = doc["sampler"]
    assert s["size"] == 2_000 and s["classes_per_rank"] == 20_000
    assert min(s["topk_s"], s["sort_s"], s["sample_active_s"]) > 0
    assert doc["model"] == {"skipped": "--no-model"} and doc["machine"] and doc["versions"]
    assert f"wrote {out}" in capsys.readouterr().out


def test_dry_lists_and_measures_nothing(tmp_path, capsys):
    assert cli.main(["--timing", "--dry"]) == 0
    text = capsys.readouterr().out
    assert "step d=64 validate=True graph=False" in text and "the model check" in text
    with pytest.raises(SystemExit, match="go with --timing"):
        cli.main(["--dry"])


def test_a_graph_needs_cuda():
    with pytest.raises(ValueError, match="graph=True needs a CUDA device"):
        timing.time_step(dict(timing._TOY), 64, "cpu", validate=False, graph=True, steps=1)
