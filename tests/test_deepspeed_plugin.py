"""The DeepSpeed plugin on 2 CPU ranks (gloo): a multi-task model with two Partial FC
heads (two label spaces) attached to a DeepSpeed engine.

Reference: the same model trained in one process in float64 with plain PyTorch:
full (unsampled) margin softmax over all classes, ``torch.optim.SGD`` for the backbone
and for each head's full weight matrix, the loss averaged over the global batch and
over the accumulated micro batches, each head's learning rate = the backbone's x its
ratio. The ranks must reproduce the backbone and both full classifiers, under ZeRO
stages 0 to 3 (fp32) and bf16, and DeepSpeed must not have touched the heads.
"""
from __future__ import annotations

import os

import pytest
import torch

from _dist import free_port, run_ranks
from _reference import arcface_ref_loss
from ds_pfc import ArcFace, CosFace, PartialFC

pytest.importorskip("deepspeed")

W, MICRO, GAS, STEPS, D_IN, D = 2, 5, 2, 3, 16, 8
CLASSES = {"identity": 13, "attribute": 7}
RATIOS = {"identity": 1.0, "attribute": 0.5}
WEIGHTS = {"identity": 1.0, "attribute": 0.5}
MARGINS = {"identity": lambda: ArcFace(16.0, 0.3), "attribute": lambda: CosFace(8.0, 0.2)}


class MultiTask(torch.nn.Module):
    """A shared trunk with two classifier heads, attached (not registered)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.trunk = torch.nn.Sequential(torch.nn.Linear(D_IN, 12), torch.nn.Tanh(), torch.nn.Linear(12, D))

    def forward(self, x, y_identity, y_attribute):
        e = self.trunk(x)
        return WEIGHTS["identity"] * self.identity(e, y_identity) + WEIGHTS["attribute"] * self.attribute(e, y_attribute)


def _data(world=W):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(STEPS, GAS, W * MICRO, D_IN, generator=g)
    ys = {n: torch.randint(0, c, (STEPS, GAS, W * MICRO), generator=g) for n, c in CLASSES.items()}
    rows = slice(0, world * MICRO)
    return x[:, :, rows], {n: y[:, :, rows] for n, y in ys.items()}


def _ds_config(stage, precision):
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS, "gradient_clipping": 0.0,
           "steps_per_print": 10 ** 9, "zero_optimization": {"stage": stage},
           "optimizer": {"type": "SGD", "params": {"lr": 0.2, "momentum": 0.9}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.05, "warmup_max_lr": 0.2,
                                                        "warmup_num_steps": 3, "warmup_type": "linear"}}}
    if stage:
        cfg["zero_allow_untested_optimizer"] = True
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    if precision == "fp16":     # a small static-free dynamic scale that still scales by 2**10
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 10, "loss_scale_window": 1000}
    return cfg


def _worker(rank, world_size, stage, precision):
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    from ds_pfc.deepspeed_plugin import attach, initialize, loss_scale
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=os.environ["DS_PFC_TEST_PORT"])
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    device = torch.device(get_accelerator().current_device_name())
    model = MultiTask()
    for name, c in CLASSES.items():
        attach(model, name, PartialFC(c, D, sample_rate=1.0, margin=MARGINS[name](), seed=3, optimizer="sgd",
                                      momentum=0.9, weight_decay=0.0, device=device), lr_ratio=RATIOS[name])
    start = {n: getattr(model, n).centers().clone() for n in CLASSES}
    engine = initialize(model=model, config=_ds_config(stage, precision))
    assert sorted(engine.heads) == sorted(CLASSES)
    assert not any("identity" in k or "attribute" in k for k in engine.module.state_dict())
    x, ys = _data(world_size)
    lrs, dtype = [], engine.dtype
    rows = slice(rank * MICRO, (rank + 1) * MICRO)
    scales = []
    for step in range(STEPS):
        lrs.append(engine.get_lr())
        for j in range(GAS):
            scales.append(loss_scale(engine.engine))
            loss = engine(x[step, j, rows].to(device, dtype), ys["identity"][step, j, rows].to(device),
                          ys["attribute"][step, j, rows].to(device))
            engine.backward(loss)
            engine.step()
    if stage == 3:
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
            trunk = {k: v.detach().float().cpu().clone() for k, v in engine.module.trunk.state_dict().items()}
    else:
        trunk = {k: v.detach().float().cpu().clone() for k, v in engine.module.trunk.state_dict().items()}
    heads = {n: (h.class_start, h.centers().cpu().clone(), start[n].cpu()) for n, h in engine.heads.items()}
    return {"trunk": trunk, "heads": heads, "lrs": lrs, "global_steps": engine.global_steps, "scales": scales,
            "world": world_size}


def _reference(start_centers, lrs, world):
    torch.manual_seed(0)
    model = MultiTask().double()
    centers = {n: c.double().clone().requires_grad_(True) for n, c in start_centers.items()}
    opt = torch.optim.SGD([{"params": model.trunk.parameters(), "ratio": 1.0}] +
                          [{"params": [centers[n]], "ratio": RATIOS[n]} for n in CLASSES], lr=0.1, momentum=0.9)
    margins = {"identity": (16.0, 0.3), "attribute": (8.0, 0.2)}
    x, ys = _data(world)
    for step in range(STEPS):
        opt.zero_grad()
        for j in range(GAS):
            e = model.trunk(x[step, j].double())
            loss = 0.0
            for n in CLASSES:
                s, m = margins[n]
                if n == "identity":
                    term = arcface_ref_loss(e, centers[n], ys[n][step, j], s, m)
                else:   # CosFace: s (cos - m) on the target
                    cos = torch.nn.functional.normalize(e) @ torch.nn.functional.normalize(centers[n]).T
                    logits = s * (cos - m * torch.nn.functional.one_hot(ys[n][step, j], cos.shape[1]))
                    term = torch.nn.functional.cross_entropy(logits, ys[n][step, j])
                loss = loss + WEIGHTS[n] * term
            (loss / GAS).backward()
        for group in opt.param_groups:
            group["lr"] = lrs[step] * group["ratio"]
        opt.step()
    return {k: v.detach() for k, v in model.trunk.state_dict().items()}, {n: c.detach() for n, c in centers.items()}


def _check(results, rtol, atol, update_rtol=None):
    first = results[0]
    assert first["global_steps"] == STEPS
    assert len(set(tuple(r["lrs"]) for r in results)) == 1 and len(set(first["lrs"])) > 1   # a real schedule
    for n in CLASSES:      # each rank's shard started from its own rows, not rank 0's
        assert len(results) == 1 or not torch.equal(results[0]["heads"][n][1][:1], results[1]["heads"][n][1][:1])
    start = {n: torch.cat([r["heads"][n][2] for r in sorted(results, key=lambda r: r["heads"][n][0])])
             for n in CLASSES}
    ref_trunk, ref_centers = _reference(start, first["lrs"], first["world"])
    for r in results:
        for k, v in ref_trunk.items():
            torch.testing.assert_close(r["trunk"][k].double(), v, rtol=rtol, atol=atol)
    for n in CLASSES:
        got = torch.cat([r["heads"][n][1] for r in sorted(results, key=lambda r: r["heads"][n][0])])
        update = ref_centers[n] - start[n].double()
        assert update.abs().max() > 1e-3          # the heads really trained
        if update_rtol is None:
            torch.testing.assert_close(got.double(), ref_centers[n], rtol=rtol, atol=atol)
        else:   # low precision: the update must be right to update_rtol in norm
            err = (got.double() - ref_centers[n]).norm() / update.norm()
            assert err < update_rtol, (n, float(err))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_two_heads_match_plain_pytorch_fp32(stage):
    _check(run_ranks(_worker, W, stage, "fp32"), rtol=1e-4, atol=1e-5)


def test_two_heads_match_plain_pytorch_bf16():
    _check(run_ranks(_worker, W, 1, "bf16"), rtol=0.05, atol=0.02, update_rtol=0.03)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="DeepSpeed's fp16 needs a GPU (its CPU accelerator "
                                                          "supports fp32 and bf16 only)")
@pytest.mark.parametrize("stage", [0, 2])
def test_two_heads_match_plain_pytorch_fp16_loss_scaled(stage, monkeypatch):
    monkeypatch.setenv("DS_PFC_TEST_PORT", str(free_port()))      # one process: no run_ranks to set it
    results = [_worker(0, 1, stage, "fp16")]
    assert min(results[0]["scales"]) >= 2 ** 9     # the heads' gradients really were scaled
    _check(results, rtol=0.05, atol=0.02, update_rtol=0.03)


# ---------------------------------------------------------------- shared memory
@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="POSIX shared memory under /dev/shm (Linux) only")
def test_init_distributed_leaves_no_shared_memory_behind():
    """DeepSpeed's CPU shared-memory all-reduce maps one 69 MB segment per rank and never
    unlinks it. ``init_distributed`` unlinks every name once all ranks have mapped them:
    the all-reduce still works through the (deleted) mappings and nothing is left under
    /dev/shm after the run."""
    port = free_port()
    results = run_ranks(_shm_ranks, 2, port)
    if results[0] is None:
        pytest.skip("DeepSpeed's shared-memory comm op is not available here (no C++ toolchain)")
    for rank, (total, peers_mapped) in enumerate(results):
        assert total == 1000 * (1.0 + 2.0)
        assert peers_mapped == 2, f"rank {rank} should still map both segments, unlinked"
    left = [n for n in os.listdir("/dev/shm") if n.endswith(tuple(f"_127.0.0.1_{port}_{r}" for r in range(2)))]
    assert not left, left


def _shm_ranks(rank, world_size, port):
    from deepspeed.comm import comm as ds_comm

    from ds_pfc.deepspeed_plugin import init_distributed
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    init_distributed("gloo")
    if ds_comm.cdb.shm_comm_op is None:
        return None
    x = torch.full((1000,), float(rank + 1))
    ds_comm.inference_all_reduce(x)
    with open("/proc/self/maps") as f:
        mapped = {line.split()[-2] for line in f if f"_127.0.0.1_{port}_" in line and line.rstrip().endswith("(deleted)")}
    return float(x.sum()), len(mapped)
