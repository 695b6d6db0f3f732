"""Pipeline parallelism: a Partial FC head in the last stage's ``loss_fn`` of a
DeepSpeed ``PipelineModule``, trained with ``PfcEngine.train_batch`` on gloo CPU ranks.

A 3-layer MLP is split over 2 stages; the head is built on the last stage over that
stage's data-parallel group (2 stages x 1 and 2 stages x 2 ranks). Each optimizer step
runs MICRO_BATCHES micro batches. Reference: the same MLP in one process in float64
with plain PyTorch, a full (unsampled) ArcFace softmax over all classes, one
``torch.optim.SGD`` with momentum for the MLP and the full weight matrix, the loss of
each micro batch the mean over its global batch (every data-parallel rank's rows)
divided by MICRO_BATCHES, the head's learning rate the engine's x its ratio.

fp16 runs as in test_loss_scaling.py: DeepSpeed's CPU accelerator is told that fp16
is supported, so its fp16 optimizers run their own Python with CPU kernels. There the
updates are compared, from the fp16-rounded start, so a missing or doubled loss scale
shows as a factor of 256.
"""
from __future__ import annotations

import os

import pytest
import torch

from _dist import free_port, run_ranks
from _reference import arcface_ref_loss

pytest.importorskip("deepspeed")

STAGES, MICRO, MICRO_BATCHES, STEPS, D_IN, HIDDEN, D, C = 2, 3, 3, 3, 10, 12, 8, 11
SCALE, MARGIN, RATIO = 16.0, 0.3, 0.5


def _layers():
    torch.manual_seed(0)
    return [torch.nn.Linear(D_IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, D)]


def _data(num_dp):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(STEPS, MICRO_BATCHES, num_dp * MICRO, D_IN, generator=g)
    y = torch.randint(0, C, (STEPS, MICRO_BATCHES, num_dp * MICRO), generator=g)
    return x, y


def _ds_config(num_dp):
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": MICRO_BATCHES,
            "train_batch_size": MICRO * MICRO_BATCHES * num_dp, "gradient_clipping": 0.0,
            "steps_per_print": 10 ** 9, "optimizer": {"type": "SGD", "params": {"lr": 0.2, "momentum": 0.9}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.05, "warmup_max_lr": 0.2,
                                                         "warmup_num_steps": 3, "warmup_type": "linear"}}}


def _head_kwargs():
    from ds_pfc import ArcFace
    return dict(sample_rate=1.0, margin=ArcFace(SCALE, MARGIN), seed=3, optimizer="sgd", momentum=0.9,
                weight_decay=0.0)


def _worker(rank, world_size, port, declared, ckpt_dir=None):
    """``declared``: the head is a head_spec attached on every rank (built by
    initialize on the last stage); else a PartialFC built by the caller on the last
    stage from the grid and passed in ``heads=``."""
    import deepspeed
    from deepspeed.pipe import PipelineModule

    from ds_pfc import PartialFC
    from ds_pfc.deepspeed_plugin import attach, head_spec, initialize
    from ds_pfc.deepspeed_plugin.heads import _Attached, _last_stage_heads
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    deepspeed.init_distributed(dist_backend="gloo")
    heads = {}
    if declared:
        pipe = PipelineModule(layers=_layers(), num_stages=STAGES, partition_method="type:Linear",
                              loss_fn=lambda emb, labels: pipe.identity(emb, labels))
        attach(pipe, "identity", head_spec(C, D, **_head_kwargs()), lr_ratio=RATIO)
    else:
        pipe = PipelineModule(layers=_layers(), num_stages=STAGES, partition_method="type:Linear",
                              loss_fn=lambda emb, labels: heads["identity"][0](emb, labels))
        grid = pipe.mpu()
        if grid.is_last_stage:
            head = PartialFC(C, D, group=grid.get_data_parallel_group(), device="cpu", **_head_kwargs())
            heads["identity"] = (head, RATIO)
        else:       # a built head off the last stage is refused, a declared one is not built there
            stray = PartialFC(C, D, group=grid.get_data_parallel_group(), device="cpu")
            with pytest.raises(ValueError, match="last stage"):
                _last_stage_heads(pipe, {"stray": _Attached(stray, 1.0)})
            assert _last_stage_heads(pipe, {"declared": _Attached(head_spec(C, D), 1.0)}) == {}
    num_dp = world_size // STAGES
    engine = initialize(model=pipe, config=_ds_config(num_dp), heads=heads or None)
    grid = pipe.mpu()
    assert sorted(engine.heads) == (["identity"] if grid.is_last_stage else [])
    start = {n: h.centers().clone() for n, h in engine.heads.items()}
    for call in (lambda: engine(torch.zeros(MICRO, D_IN)), lambda: engine.backward(torch.zeros(())), engine.step):
        with pytest.raises(RuntimeError, match="train_batch"):
            call()

    x, y = _data(num_dp)
    rows = slice(grid.get_data_parallel_rank() * MICRO, (grid.get_data_parallel_rank() + 1) * MICRO)
    lrs, losses = [], []
    for step in range(STEPS):
        lrs.append(engine.get_lr())
        micro_batches = iter([(x[step, j, rows], y[step, j, rows]) for j in range(MICRO_BATCHES)])
        losses.append(float(engine.train_batch(micro_batches)))
    params = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    heads_out = {n: (h.class_start, h.centers().clone(), start[n]) for n, h in engine.heads.items()}
    # The trained model on the first step's batch: heads in evaluation mode, nothing to step.
    eval_loss = float(engine.eval_batch(iter([(x[0, j, rows], y[0, j, rows]) for j in range(MICRO_BATCHES)])))
    assert not any(h.training for h in engine.heads.values())
    out = {"params": params, "heads": heads_out, "lrs": lrs, "losses": losses, "global_steps": engine.global_steps,
           "skipped": engine.skipped_steps, "num_dp": num_dp, "eval_loss": eval_loss}
    if ckpt_dir is not None:
        # Save, train a step, restore, train that step again: both stages' layers and the
        # last stage's head come back bitwise and the step repeats exactly.
        def state():
            return ({k: v.detach().clone() for k, v in engine.module.state_dict().items()},
                    {n: h.centers().clone() for n, h in engine.heads.items()})

        def batch():
            return iter([(x[0, j, rows], y[0, j, rows]) for j in range(MICRO_BATCHES)])
        engine.save_checkpoint(ckpt_dir, "pipe")
        saved = state()
        engine.train_batch(batch())
        after = state()
        engine.load_checkpoint(ckpt_dir, "pipe")
        restored = state()
        engine.train_batch(batch())
        out["checkpoint"] = (saved, restored, after, state())
    return out


def _reference(start_centers, lrs, num_dp):
    mlp = torch.nn.Sequential(*_layers()).double()
    centers = start_centers.double().clone().requires_grad_(True)
    opt = torch.optim.SGD([{"params": mlp.parameters(), "ratio": 1.0}, {"params": [centers], "ratio": RATIO}],
                          lr=0.1, momentum=0.9)
    x, y = _data(num_dp)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        total = 0.0
        for j in range(MICRO_BATCHES):
            loss = arcface_ref_loss(mlp(x[step, j].double()), centers, y[step, j], SCALE, MARGIN)
            (loss / MICRO_BATCHES).backward()
            total += float(loss.detach()) / MICRO_BATCHES
        losses.append(total)
        for group in opt.param_groups:
            group["lr"] = lrs[step] * group["ratio"]
        opt.step()
    with torch.no_grad():
        eval_loss = sum(float(arcface_ref_loss(mlp(x[0, j].double()), centers, y[0, j], SCALE, MARGIN))
                        for j in range(MICRO_BATCHES)) / MICRO_BATCHES
    return mlp.state_dict(), centers.detach(), losses, eval_loss


def _check(results):
    first = results[0]
    assert all(r["global_steps"] == STEPS and r["skipped"] == 0 for r in results)
    assert len(set(tuple(r["lrs"]) for r in results)) == 1 and len(set(first["lrs"])) > 1   # a real schedule
    last = sorted((r for r in results if r["heads"]), key=lambda r: r["heads"]["identity"][0])
    assert len(last) == first["num_dp"]
    if len(last) > 1:      # each rank's shard started from its own rows
        assert not torch.equal(last[0]["heads"]["identity"][2][:1], last[1]["heads"]["identity"][2][:1])
    start = torch.cat([r["heads"]["identity"][2] for r in last])
    assert start.shape == (C, D)
    ref_mlp, ref_centers, ref_losses, ref_eval_loss = _reference(start, first["lrs"], first["num_dp"])
    seen = set()
    for r in results:      # each stage holds its own layers, named by their index in the MLP
        for k, v in r["params"].items():
            torch.testing.assert_close(v.double(), ref_mlp[k], rtol=1e-4, atol=1e-5)
            seen.add(k)
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=1e-4, atol=1e-5)
        assert abs(r["eval_loss"] - ref_eval_loss) < 1e-4 * ref_eval_loss, (r["eval_loss"], ref_eval_loss)
    assert seen == set(ref_mlp)
    update = ref_centers - start.double()
    assert update.abs().max() > 1e-3          # the head really trained
    got = torch.cat([r["heads"]["identity"][1] for r in last])
    torch.testing.assert_close(got.double(), ref_centers, rtol=1e-4, atol=1e-5)


def test_two_stages_match_plain_pytorch():
    _check(run_ranks(_worker, STAGES, free_port(), False))


def test_two_stages_by_two_data_parallel_match_plain_pytorch(tmp_path):
    results = run_ranks(_worker, 2 * STAGES, free_port(), True, str(tmp_path))
    _check(results)
    # checkpoints: the head's shards come from the last stage only, one per data-parallel rank
    names = sorted(n for n in os.listdir(tmp_path / "pipe") if n.endswith(".safetensors"))
    assert names == ["identity-rank00000-of-00002.safetensors", "identity-rank00001-of-00002.safetensors"]
    for r in results:
        saved, restored, after, again = r["checkpoint"]
        for a, b in ((saved, restored), (after, again)):
            assert a[0].keys() == b[0].keys() and all(torch.equal(a[0][k], b[0][k]) for k in a[0])
            assert a[1].keys() == b[1].keys() and all(torch.equal(a[1][k], b[1][k]) for k in a[1])
        assert any(not torch.equal(saved[0][k], after[0][k]) for k in saved[0])          # the step trained


def _fp16_run(stage, power):
    """The 2-stage pipeline in fp16 at ZeRO ``stage`` with an initial loss scale of
    2**power; the head computes on the fp16 embeddings."""
    from deepspeed.pipe import PipelineModule

    from ds_pfc import PartialFC
    from ds_pfc.deepspeed_plugin import initialize, loss_scale
    heads = {}
    pipe = PipelineModule(layers=_layers(), num_stages=STAGES, partition_method="type:Linear",
                          loss_fn=lambda emb, labels: heads["identity"][0](emb, labels))
    grid = pipe.mpu()
    if grid.is_last_stage:
        heads["identity"] = (PartialFC(C, D, group=grid.get_data_parallel_group(), device="cpu", **_head_kwargs()),
                             RATIO)
    cfg = _ds_config(1)
    cfg.update(fp16={"enabled": True, "initial_scale_power": power, "hysteresis": 1},
               zero_optimization={"stage": stage}, zero_allow_untested_optimizer=True)
    engine = initialize(model=pipe, config=cfg, heads=heads or None)
    start = {n: h.centers().clone() for n, h in engine.heads.items()}
    x, y = _data(1)
    lrs, scales, applied = [], [], []
    for step in range(STEPS):
        lrs.append(engine.get_lr())
        scales.append(loss_scale(engine.engine))
        engine.train_batch(iter([(x[step, j].half(), y[step, j]) for j in range(MICRO_BATCHES)]))
        applied.append(engine.was_step_applied())
    params = {k: v.detach().float().clone() for k, v in engine.module.state_dict().items()}
    return {"params": params, "heads": {n: (h.centers().clone(), start[n]) for n, h in engine.heads.items()},
            "lrs": lrs, "scales": scales, "applied": applied, "skipped": engine.skipped_steps,
            "ds_scales_loss": engine._ds_scales_loss}


def _fp16_worker(rank, world_size, port):
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    type(get_accelerator()).is_fp16_supported = lambda self: True
    deepspeed.init_distributed(dist_backend="gloo")
    # 2**8: every step applies; 2**14: the first step overflows in fp16 and is skipped, 2**13 fits.
    return {case: _fp16_run(stage, power) for case, stage, power in (("zero0", 0, 8), ("zero1", 1, 8),
                                                                        ("overflow", 0, 14))}


def _fp16_reference(start_centers, lrs, applied):
    """float64 from the fp16-rounded MLP; steps the engine skipped are skipped."""
    mlp = torch.nn.Sequential(*_layers())
    mlp.load_state_dict({k: v.half() for k, v in mlp.state_dict().items()})
    mlp = mlp.double()
    start = {k: v.clone() for k, v in mlp.state_dict().items()}
    centers = start_centers.double().clone().requires_grad_(True)
    opt = torch.optim.SGD([{"params": mlp.parameters(), "ratio": 1.0}, {"params": [centers], "ratio": RATIO}],
                          lr=0.1, momentum=0.9)
    x, y = _data(1)
    for step in range(STEPS):
        opt.zero_grad()
        if not applied[step]:
            continue
        for j in range(MICRO_BATCHES):
            loss = arcface_ref_loss(mlp(x[step, j].half().double()), centers, y[step, j], SCALE, MARGIN)
            (loss / MICRO_BATCHES).backward()
        for group in opt.param_groups:
            group["lr"] = lrs[step] * group["ratio"]
        opt.step()
    return start, mlp.state_dict(), centers.detach()


@pytest.fixture(scope="module")
def fp16_results():
    return run_ranks(_fp16_worker, STAGES, free_port())


@pytest.mark.parametrize("case", ["zero0", "zero1", "overflow"])
def test_fp16_loss_scaled_pipeline_matches_float64(fp16_results, case):
    results = [r[case] for r in fp16_results]
    first, last = results[0], results[-1]
    assert all(r["applied"] == first["applied"] and r["skipped"] == first["skipped"] for r in results)
    if case == "overflow":
        assert first["applied"][0] is False and all(first["applied"][1:]), first
        assert first["scales"][1] == first["scales"][0] / 2       # the scale came down
    else:
        assert all(first["applied"]) and first["scales"] == [256.0] * STEPS
    # ZeRO 0's fp16 optimizer divides by a scale DeepSpeed never multiplied in: the
    # last stage's probe supplied it (for the earlier stage too); ZeRO 1 scales itself.
    assert last["ds_scales_loss"] is (case == "zero1")
    centers, start_centers = last["heads"]["identity"]
    start, ref_mlp, ref_centers = _fp16_reference(start_centers, first["lrs"], first["applied"])
    for r in results:
        for k, v in r["params"].items():
            update = ref_mlp[k] - start[k]
            assert float((v.double() - ref_mlp[k]).norm() / update.norm()) < 0.02, (case, k)
    update = ref_centers - start_centers.double()
    assert float((centers.double() - ref_centers).norm() / update.norm()) < 0.02, case
