"""The ``linear_ce`` baseline of the head benchmark and its ds_pfc counterpart.

``F.linear_cross_entropy(s * x_hat, w_hat, y)`` (every variant the benchmark runs) and
ds_pfc at ``r = 1`` with ``CosFace(margin=0)`` must be the same loss: both are checked
against a float64 softmax over ``s * cos`` written here in plain PyTorch, for the
loss, the embeddings' gradient and the centers after one ``torch.optim.SGD`` step.
A tiny run of ``bench.py head`` checks the comparison's plumbing (no timings asserted).
"""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from ds_pfc.core import softmax
from ds_pfc.bench import head as bench

pytestmark = pytest.mark.skipif(not hasattr(F, "linear_cross_entropy"),
                                reason="F.linear_cross_entropy needs torch >= 2.13")

C, D, N = 211, 7, 37
SCALE, LR = 64.0, 0.1


def _reference_step(x, w0, y):
    """Loss, dL/dx and the centers after SGD(momentum 0.9, wd 5e-4), in float64."""
    x = x.double().requires_grad_(True)
    w = torch.nn.Parameter(w0.double().clone())
    logits = SCALE * (x / x.norm(dim=1, keepdim=True)) @ (w / w.norm(dim=1, keepdim=True)).t()
    loss = F.cross_entropy(logits, y)
    loss.backward()
    torch.optim.SGD([w], lr=LR, momentum=0.9, weight_decay=5e-4).step()
    return loss.detach(), x.grad, w.detach()


def _case(impl, **kw):
    return {"impl": impl, "classes": C, "dim": D, "batch": N, "sample_rate": 1.0, "compute": "fp32",
            "device": "cpu", **kw}


def _centers(head):
    return head.centers() if hasattr(head, "centers") else head.weight.detach()


@pytest.mark.parametrize("case", [
    _case("ds_pfc", backend="torch", margin="cos"),
    # Logits larger than the kept budget: ds_pfc's rows in chunks of 16 samples.
    _case("ds_pfc", backend="torch", margin="cos", keep_bytes=4 * C * 20),
    _case("linear_ce", lce="none"),
    _case("linear_ce", lce="auto"),
    _case("linear_ce", lce="b8"),
], ids=lambda c: "/".join(str(c[k]) for k in ("impl", "margin", "lce", "keep_bytes") if k in c))
def test_baseline_and_ds_pfc_give_the_float64_loss_gradient_and_step(case, monkeypatch):
    if "keep_bytes" in case:
        monkeypatch.setattr(softmax, "KEEP_BYTES", case.pop("keep_bytes"))
        monkeypatch.setattr(softmax, "CPU_BLOCK_BYTES", 4 * N * 16)     # several class blocks per chunk
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(N, D, generator=gen)
    y = torch.randint(0, C, (N,), generator=gen)
    y[:3] = y[3]            # a class seen by several samples
    head = bench.make_head(case, C)
    w0 = _centers(head).clone()
    ref_loss, ref_dx, ref_w = _reference_step(x, w0, y)

    xx = x.clone().requires_grad_(True)
    loss = head(xx, y)
    loss.backward()
    head.step(LR)
    torch.testing.assert_close(loss.detach().double(), ref_loss, rtol=1e-5, atol=0.0)
    _assert_close_to_scale(xx.grad, ref_dx)
    # The update itself (float32 centers of ~1e-2 hide it otherwise).
    _assert_close_to_scale(_centers(head).double() - w0.double(), ref_w - w0.double())


def _assert_close_to_scale(got, want, tol=1e-5):
    """Float32 against float64: every element within ``tol`` of the largest one."""
    err = (got.double() - want).abs().max().item()
    assert err <= tol * want.abs().max().item(), (err, want.abs().max().item())


def test_lce_variants_are_checked():
    assert bench.lce_options("none") is None
    assert bench.lce_options("b16").batch_chunk_size == 16
    for bad in ("b0", "chunk", "b-1", ""):
        with pytest.raises(ValueError, match="linear_ce variant"):
            bench.lce_options(bad)


def test_bench_head_compares_linear_ce_with_ds_pfc(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(bench.__file__.rsplit("/ds_pfc/", 1)[0])     # subprocesses import this checkout
    out = tmp_path / "head.json"
    assert bench.main(["--classes", "300", "--batch", "16", "--dim", "8", "--steps", "1", "--warmup", "0",
                       "--compute", "fp32", "--impl", "linear_ce", "--lce-options", "none,b4", "--threads", "1",
                       "--out", str(out)]) == 0
    table = capsys.readouterr().out
    for name in ("ds_pfc/torch/cos", "linear_ce/none", "linear_ce/b4", "cpu ms", "state MiB", "step MiB"):
        assert name in table
    doc = json.loads(out.read_text())
    results = {(r["impl"], r.get("lce")): r for r in doc["results"]}
    assert set(results) == {("ds_pfc", None), ("linear_ce", "none"), ("linear_ce", "b4")}
    for res in results.values():
        assert "error" not in res, res.get("error")
        assert res["sample_rate"] == 1.0 and res["active"] == 300 and res["step"]["n"] == 1
        assert res["state_bytes"] is not None and res["step_peak_bytes"]["n"] == 1
    assert results[("ds_pfc", None)]["margin"] == "cos"
    # The same initial centers, data and optimizer: the same loss after the same steps.
    losses = [r["loss"] for r in results.values()]
    assert max(losses) - min(losses) < 1e-4 * abs(losses[0])
    summary = doc["summary"]
    for variant in ("none", "b4"):
        key = f"linear_ce/{variant}_vs_ds_pfc/cos_at_C=300"
        assert summary[f"time_{key}"] > 0 and summary[f"cpu_time_{key}"] > 0
        assert summary[f"loss_rel_diff_{key}"] < 1e-4
