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
    expected = {(d, v, False, None) for d in (512, 256, 128) for v in (True, False)} \
        | {(d, False, True, None) for d in (512, 256, 128)}
    if what["backend"] == "triton":     # and the recompute path, eager, validate on and off
        expected |= {(d, v, False, "recompute") for d in (512, 256, 128) for v in (True, False)}
        assert what["forward_batches"] == [2048, 4096]
    assert modes == expected and len(what["modes"]) == len(expected)
    assert what["products"] == [512, 256, 128] and what["budget_s"] <= 330
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
    # cuBLAS's shapes: S x N x d FLOPs twice, at the rate recorded.
    p = doc["products"]
    assert (p["S"], p["N"]) == (2_000, 64)
    for name in ("forward_fp16", "dx", "dw"):
        r = p["d64"][name]
        assert r["seconds"] > 0 and r["tflops"] * 1e12 * r["seconds"] == pytest.approx(2 * 64 * 2_000 * 64)
    # The forward kernel (Triton's interpreter here), with and without its store, and its grid.
    f = doc["forward"]
    assert set(f) == {"S", "dim", "sms", "n16", "n32"}
    for n in (16, 32):
        assert f[f"n{n}"]["seconds"] > 0 and f[f"n{n}"]["seconds_keep"] > 0
        assert f[f"n{n}"]["waves"] == pytest.approx(f[f"n{n}"]["programs"] / f["sms"])


def test_parts_past_the_budget_are_skipped_and_the_file_still_written(tmp_path):
    path = timing.run_timing(torch.device("cpu"), results_dir=str(tmp_path), stamp="x", gpu="cpu", model=False,
                             log=lambda *a: None, budget_s=-1.0)
    doc = json.loads(open(path).read())
    for part in (*doc["steps"].values(), doc["products"], doc["forward"], doc["sampler"]):
        assert part == {"skipped": "not started within the -1 s budget"}


def test_dry_lists_and_measures_nothing(tmp_path, capsys):
    assert cli.main(["--timing", "--dry"]) == 0
    text = capsys.readouterr().out
    assert "step d=64 validate=True graph=False" in text and "the model check" in text
    assert "cuBLAS at the kept step's shapes" in text and "the forward kernel at N = 16, 32" in text
    assert "within 330 s" in text
    with pytest.raises(SystemExit, match="go with --timing"):
        cli.main(["--dry"])


def test_a_graph_needs_cuda():
    with pytest.raises(ValueError, match="graph=True needs a CUDA device"):
        timing.time_step(dict(timing._TOY), 64, "cpu", validate=False, graph=True, steps=1)


def test_the_model_check_of_a_timing_run_finds_the_standard_counts(tmp_path):
    """The three triton paths and the torch backend of the standard rank, on 132 SMs, without
    counting (what the self-check's model check asks of the GPU it runs on)."""
    from ds_pfc.bench import model
    from ds_pfc.bench.selfcheck import fitting_case
    path = timing.standard_counts(str(tmp_path / "counts.json"))
    base = fitting_case(120 * 2**30)          # an H200's free memory: the whole standard rank
    assert model.case_rows(base) == 800_000
    for backend in ("torch", "triton"):
        case = dict(base, backend=backend)
        cosines = model.cosines_path(backend, case["batch"], model.case_rows(case), case["compute"], None)
        if cosines:
            case["cosines"] = cosines
        assert model.saved_counts(path, case, 132), case
        if backend == "triton":
            assert cosines == "exp"                  # bf16 products within the exp-kept bound
            for other in ("kept", "recompute"):
                assert model.saved_counts(path, dict(case, cosines=other), 132), other
