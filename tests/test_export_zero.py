"""Exports of DeepSpeed checkpoints at every ZeRO stage, and bf16 training of the
BatchNorm backbones.

Export: two CPU ranks (gloo) train a small IResNet (its final BN1d has a frozen
weight) with a Partial FC head for one step at ZeRO stages 0-3, in fp32 and in bf16,
and save a checkpoint. At save time every rank records the live module: its state
dict (ZeRO-3 parameters gathered) and DeepSpeed's float32 master weights
(``safe_get_full_fp32_param``, read from the optimizer, not from the files). The
export must load strictly into a freshly built backbone (``load_backbone``) and equal
that record tensor for tensor: master weights where they exist, the frozen weight,
and rank 0's BatchNorm statistics.

bf16: DeepSpeed casts parameters to bf16 and leaves buffers in float32. Every shipped
backbone must train (forward, backward, step) and evaluate in that state, without and
with a DeepSpeed engine. Tolerance: the error against a float64 reference must stay
within a small multiple of the error of torch's own all-bf16 model (parameters and
statistics in bf16), the precision's own rounding.

The DeepSpeed cases share one pair of ranks (DeepSpeed's start-up dominates); each case
returns its result or its error, so each test reports its own case.
"""
from __future__ import annotations

import contextlib
import copy
import os
import traceback

import pytest
import torch
from torch import nn

from _dist import run_ranks
from ds_pfc.models import BACKBONES, build_backbone

pytest.importorskip("deepspeed")

WORLD, MICRO, D, C = 2, 8, 16, 11
WIDTHS = {"iresnet18": 0.0625, "mobilefacenet": 0.125, "vit_t": 0.125}
EXPORT_CASES = [("fp32", 0), ("fp32", 1), ("fp32", 2), ("fp32", 3), ("bf16", 0), ("bf16", 1), ("bf16", 3)]
BF16_BACKBONES = ("iresnet18", "mobilefacenet", "vit_t")
EXPORT_BACKBONE = "iresnet18"
# Error of the bf16 model (DeepSpeed's state: bf16 parameters, float32 statistics)
# against float64, at most this multiple of torch's all-bf16 model's error.
ERROR_RATIO = 2.0


def _job_config(name: str) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 0.0,
            "ds_pfc": {"head": {"num_classes": C, "embedding_size": D, "sample_rate": 1.0},
                       "backbone": {"name": name, "width": WIDTHS[name]}}}


def _ds_config(precision: str, stage: int) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 0.0, "steps_per_print": 10 ** 9,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
           "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def _images(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, 3, 112, 112, generator=torch.Generator().manual_seed(seed))


def _labels(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, C, (n,), generator=torch.Generator().manual_seed(seed))


def _backbone(name: str) -> nn.Module:
    torch.manual_seed(0)      # the same initial backbone on every rank and in the references
    model = build_backbone(name, embedding_size=D, width=WIDTHS[name])
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.momentum = None  # cumulative average: one training batch sets the statistics exactly
    return model


def _relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


def _mixed_bf16(model: nn.Module) -> nn.Module:
    """The state DeepSpeed's bf16 mode leaves a module in: parameters bf16, buffers as they were."""
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16)
    return model


# --- ranks ---------------------------------------------------------------------------

def _guarded(fn, *args):
    try:
        return fn(*args)
    except Exception:
        return {"error": traceback.format_exc()}


def _gathered(module: nn.Module):
    import deepspeed
    params = [p for p in module.parameters() if hasattr(p, "ds_id")]
    return deepspeed.zero.GatheredParameters(params) if params else contextlib.nullcontext()


def _export_case(rank, world_size, root, precision, stage):
    from deepspeed.utils import safe_get_full_fp32_param

    from ds_pfc import PartialFC
    from ds_pfc.deepspeed_plugin import initialize
    head = PartialFC(C, D, sample_rate=1.0, seed=3, optimizer="sgd", momentum=0.9, weight_decay=0.0)
    engine = initialize(model=_backbone(EXPORT_BACKBONE), config=_ds_config(precision, stage),
                        heads={"head": head})
    x, y = _images(MICRO, seed=10 + rank), _labels(MICRO, seed=20 + rank)
    loss = head(engine(x.to(engine.dtype)), y)
    engine.backward(loss)
    engine.step()
    save_dir = os.path.join(root, f"{precision}-zero{stage}")
    tag_dir = engine.save_checkpoint(save_dir, "step1")
    module = engine.module
    with _gathered(module):
        live = {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
    masters = {}
    for name, p in module.named_parameters():   # a collective under ZeRO-3: every rank, same order
        full = safe_get_full_fp32_param(p) if p.requires_grad else None
        if full is not None:
            masters[name] = full.detach().cpu().clone()
    return {"tag_dir": tag_dir, "live": live, "masters": masters,
            "head": (head.class_start, head.centers().detach().cpu().clone())}


def _bf16_case(rank, world_size, name):
    from ds_pfc import PartialFC
    from ds_pfc.deepspeed_plugin import initialize
    from ds_pfc.app.training import evaluate
    backbone = _backbone(name)
    ref = copy.deepcopy(backbone).double()
    plain = copy.deepcopy(backbone).bfloat16()
    head = PartialFC(C, D, sample_rate=1.0, seed=3, optimizer="sgd", momentum=0.9, weight_decay=0.0)
    engine = initialize(model=backbone, config=_ds_config("bf16", 0), heads={"head": head})
    module = engine.module
    assert next(module.parameters()).dtype == torch.bfloat16
    assert all(b.dtype != torch.bfloat16 for b in module.buffers())   # DeepSpeed leaves buffers alone
    x, y = _images(MICRO, seed=30 + rank), _labels(MICRO, seed=40 + rank)
    out = {}
    emb = engine(x.to(engine.dtype))
    with torch.no_grad():
        out["train"] = (emb.detach().float(), ref(x.double()), plain(x.bfloat16()).float())
        # Eval: each model's statistics are now those of the batch above.
        for m in (module, ref, plain):
            m.eval()
        out["eval"] = (module(x.bfloat16()).float(), ref(x.double()), plain(x.bfloat16()).float())
        module.train()
    before = {k: p.detach().clone() for k, p in module.named_parameters()}
    engine.backward(head(emb, y))
    applied = engine.step()
    after = {k: p.detach().clone() for k, p in module.named_parameters()}
    # The app's evaluation path in bf16: 10 pairs, the fewest its 10-fold protocol takes.
    pairs = torch.randint(0, 256, (20, 3, 112, 112), dtype=torch.uint8, generator=torch.Generator().manual_seed(50))
    metrics = evaluate(module, {"pairs": (pairs, [i % 2 == 0 for i in range(10)])}, batch_size=MICRO, flip=True,
                       far=[0.5], device=engine.device, dtype=engine.dtype, rank=rank, world_size=world_size)
    return {"out": out, "applied": applied, "before": before, "after": after,
            "frozen": [k for k, p in module.named_parameters() if not p.requires_grad],
            "accuracy": metrics["pairs"].accuracy}


def _worker(rank, world_size, root):
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=os.environ["DS_PFC_TEST_PORT"])
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    results = {}
    for precision, stage in EXPORT_CASES:
        results[(precision, stage)] = _guarded(_export_case, rank, world_size, root, precision, stage)
    for name in BF16_BACKBONES:
        results[name] = _guarded(_bf16_case, rank, world_size, name)
    return results


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("zero"))
    return run_ranks(_worker, WORLD, root)


def _result(ranks, case):
    for rank, results in enumerate(ranks):
        if "error" in results[case]:
            pytest.fail(f"rank {rank}, case {case}:\n{results[case]['error']}", pytrace=False)
    return [results[case] for results in ranks]


# --- export ----------------------------------------------------------------------------

@pytest.mark.parametrize("precision, stage", EXPORT_CASES, ids=[f"{p}-zero{s}" for p, s in EXPORT_CASES])
def test_export_loads_strictly_and_equals_the_engine_weights(ranks, tmp_path, precision, stage):
    from ds_pfc.app.export import load_backbone
    from ds_pfc.checkpoint.export import export_checkpoint
    rank0 = _result(ranks, (precision, stage))[0]
    live, masters = rank0["live"], rank0["masters"]
    out = export_checkpoint(rank0["tag_dir"], os.path.join(tmp_path, "model.safetensors"),
                            config=_job_config(EXPORT_BACKBONE))
    backbone, _ = load_backbone(out)                      # strict load_state_dict
    exported = backbone.state_dict()
    assert list(exported) == list(live)
    assert torch.equal(exported["features.weight"], torch.ones(D))        # the frozen BN1d weight
    if stage > 0:
        trainable = {k for k, p in backbone.named_parameters() if p.requires_grad}
        assert set(masters) == trainable
    for key, value in live.items():
        expected = masters.get(key, value.float() if value.is_floating_point() else value)
        assert exported[key].dtype == expected.dtype, key
        assert torch.equal(exported[key], expected), key
        # The engine's bf16 weights are its master weights rounded.
        assert torch.equal(exported[key].to(value.dtype), value), key

    from safetensors.torch import load_file
    shards = sorted((r["head"] for r in _result(ranks, (precision, stage))), key=lambda s: s[0])
    torch.testing.assert_close(load_file(out)["heads.head.weight"], torch.cat([c for _, c in shards]).float(),
                               rtol=0, atol=0)


def test_zero_exports_agree_with_stage_0(ranks):
    """Same seeds, same data: the fp32 runs at ZeRO 1-3 end where ZeRO 0 does (up to
    the order of the gradient reduction)."""
    from ds_pfc.checkpoint.export import backbone_state_dict
    reference = backbone_state_dict(_result(ranks, ("fp32", 0))[0]["tag_dir"])
    for stage in (1, 2, 3):
        state = backbone_state_dict(_result(ranks, ("fp32", stage))[0]["tag_dir"])
        assert list(state) == list(reference)
        for key, value in reference.items():
            torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{key}: {m}")


# --- bf16 ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", BF16_BACKBONES)
def test_bf16_engine_trains_and_evaluates_every_backbone(ranks, name):
    for rank, result in enumerate(_result(ranks, name)):
        for mode, (emb, ref, plain) in result["out"].items():
            error, own = _relative_error(emb, ref), _relative_error(plain, ref)
            assert error <= ERROR_RATIO * own + 1e-3, f"rank {rank} {mode}: error {error:.2e}, bf16's own {own:.2e}"
        assert result["applied"]
        # the final BatchNorm's scale: frozen in the IResNets only, as in arcface_torch
        assert result["frozen"] == (["features.weight"] if name.startswith("iresnet") else [])
        for key, value in result["after"].items():
            assert value.dtype == torch.bfloat16 and torch.isfinite(value).all(), key
            if key in result["frozen"]:
                assert torch.equal(value, result["before"][key]), key
        moved = [k for k in result["after"] if not torch.equal(result["after"][k], result["before"][k])]
        assert len(moved) > len(result["after"]) // 2
        assert 0.0 <= result["accuracy"] <= 1.0


# The deeper variants are the same classes with more blocks (and, for vit_b / vit_l,
# training-time token masking, which would draw different masks for the three copies).
DEEPER = ("iresnet200", "mobilefacenet_large", "vit_b", "vit_l")


@pytest.mark.parametrize("name", [n for n in BACKBONES if n not in DEEPER])
def test_backbones_run_with_bf16_parameters_beside_float32_statistics(name):
    """Every shipped backbone, in DeepSpeed's bf16 state, without DeepSpeed: training
    forward and backward, then eval, against float64 and torch's all-bf16 model."""
    torch.manual_seed(0)
    model = build_backbone(name, embedding_size=D, width=0.125)
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.momentum = None
    models = {"ref": (copy.deepcopy(model).double(), torch.float64),
              "plain": (copy.deepcopy(model).bfloat16(), torch.bfloat16),
              "mixed": (_mixed_bf16(model), torch.bfloat16)}
    x = _images(MICRO, seed=1)
    weights = torch.randn(MICRO, D, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    outs = {}
    for key, (m, dtype) in models.items():
        out = m(x.to(dtype))
        (out.double() * weights).sum().backward()
        outs[key] = out.detach()

    def grads(key):
        return torch.cat([p.grad.double().flatten() for p in models[key][0].parameters() if p.grad is not None])

    error, own = _relative_error(outs["mixed"], outs["ref"]), _relative_error(outs["plain"], outs["ref"])
    assert error <= ERROR_RATIO * own + 1e-3, (error, own)
    error, own = _relative_error(grads("mixed"), grads("ref")), _relative_error(grads("plain"), grads("ref"))
    assert error <= ERROR_RATIO * own + 1e-3, (error, own)
    for (k, p), p_ref in zip(model.named_parameters(), models["ref"][0].parameters()):
        assert (p.grad is None) == (p_ref.grad is None), k
        assert p.grad is None or (p.grad.dtype == torch.bfloat16 and torch.isfinite(p.grad).all()), k
    assert all(b.dtype in (torch.float32, torch.int64) for b in model.buffers())   # statistics stay float32
    with torch.no_grad():
        evals = {key: m.eval()(x.to(dtype)) for key, (m, dtype) in models.items()}
    error, own = _relative_error(evals["mixed"], evals["ref"]), _relative_error(evals["plain"], evals["ref"])
    assert error <= ERROR_RATIO * own + 1e-3, (error, own)
